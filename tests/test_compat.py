"""rope_ext.compat: each drop-in, called with its peer's argument names and layouts on random
inputs, against an independent implementation of that peer (tests/peers.py) evaluated in float64
on the same inputs; in-place entry points are checked on the whole buffer they live in (a fused
qkv, a KV pool), so an element written wrongly or not at all shows."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import peers
from conftest import TOL
from rope_ext.compat import flash_attn, flashinfer, sglang, vllm
from rope_ext.compat import transformers as hf

DTYPES = [torch.float32, torch.bfloat16]
gradcheck = torch.autograd.gradcheck


def check(actual, expected, dtype, scale=1.0):
    assert actual.dtype == dtype
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(actual.double(), expected.double(), rtol=rtol * scale,
                               atol=atol * scale, equal_nan=True)


def f64(*ts):
    return [None if t is None else t.detach().double() for t in ts]


def tables(rows, half, dtype=torch.float32, scale=3.0):
    angles = torch.rand(rows, half, dtype=torch.float64) * scale
    return angles.cos().to(dtype), angles.sin().to(dtype)


def cos_sin_cache(max_pos, rot, dtype=torch.float32):
    cos, sin = tables(max_pos, rot // 2, torch.float64, scale=50.0)
    return torch.cat((cos, sin), dim=-1).to(dtype)


# ---- transformers ----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
@pytest.mark.parametrize("rot_frac", [1.0, 0.5])
@pytest.mark.parametrize("one_call", [True, False])  # q and k rotated in one call, or one each
def test_hf_apply_rotary_pos_emb(dtype, unsqueeze_dim, rot_frac, one_call, monkeypatch):
    monkeypatch.setattr(hf, "ONE_CALL_NUMEL", 1 << 30 if one_call else 0)
    B, S, Hq, Hk, D = 2, 7, 4, 2, 32
    rot = int(D * rot_frac)
    position_ids = torch.randint(0, 200, (B, S))
    cos, sin = peers.hf_cos_sin(position_ids, rot, dtype=dtype)
    shape = (lambda h: (B, h, S, D)) if unsqueeze_dim == 1 else (lambda h: (B, S, h, D))
    q, k = torch.randn(shape(Hq), dtype=dtype), torch.randn(shape(Hk), dtype=dtype)
    if one_call:  # transformers' q and k are transposed views of the projections
        q = torch.randn(shape(Hq)[::-1], dtype=dtype).permute(3, 2, 1, 0)
    q0, k0 = q.clone(), k.clone()
    got = hf.apply_rotary_pos_emb(q, k, cos, sin, position_ids, unsqueeze_dim=unsqueeze_dim)
    want = peers.hf_apply_rotary_pos_emb(*f64(q, k, cos, sin), unsqueeze_dim=unsqueeze_dim)
    for g, w in zip(got, want):
        check(g, w, dtype)
    assert torch.equal(q, q0) and torch.equal(k, k0)
    assert torch.equal(got[0][..., rot:], q[..., rot:])  # partial rotary: the rest passes through


@pytest.mark.parametrize("one_call", [True, False])
@pytest.mark.parametrize("single", [False, True])
def test_hf_results_keep_the_projections_memory_order(one_call, single, monkeypatch):
    """transformers' q and k are (batch, seq, heads, head_dim) projections seen as (batch, heads,
    seq, head_dim); its elementwise RoPE keeps that memory order, and so must the drop-in (SDPA's
    CPU output follows q's, and a contiguous q_embed made the transpose after attention a copy,
    saved for backward in training)."""
    monkeypatch.setattr(hf, "ONE_CALL_NUMEL", 1 << 30 if one_call else 0)
    B, S, Hq, Hk, D = 2, 9, 4, 2, 32
    cos, sin = peers.hf_cos_sin(torch.randint(0, 200, (B, S)), D)
    q = torch.randn(B, S, Hq, D).transpose(1, 2)
    k = torch.randn(B, S, Hk, D).transpose(1, 2)
    if single:
        got = (hf.apply_rotary_pos_emb_single(q, cos, sin), hf.apply_rotary_pos_emb_single(k, cos, sin))
    else:
        got = hf.apply_rotary_pos_emb(q, k, cos, sin)
    want = peers.hf_apply_rotary_pos_emb(*f64(q, k, cos, sin))
    for g, w, x in zip(got, want, (q, k)):
        check(g, w, torch.float32)
        # the same order of dims in memory (one call for q and k: views of one buffer of both)
        order = [sorted(range(4), key=lambda i: -t.stride(i)) for t in (g, x)]
        assert order[0] == order[1] == [0, 2, 1, 3], (g.stride(), x.stride())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
@pytest.mark.parametrize("rot_frac", [1.0, 0.5])
def test_hf_apply_rotary_pos_emb_single(dtype, unsqueeze_dim, rot_frac):
    # Gemma 4's one-tensor form: x rotated as the pair form rotates q, against float64 math.
    B, S, H, D = 2, 7, 3, 32
    rot = int(D * rot_frac)
    cos, sin = peers.hf_cos_sin(torch.randint(0, 200, (B, S)), rot, dtype=dtype)
    x = torch.randn((B, H, S, D) if unsqueeze_dim == 1 else (B, S, H, D), dtype=dtype)
    x0 = x.clone()
    got = hf.apply_rotary_pos_emb_single(x, cos, sin, unsqueeze_dim=unsqueeze_dim)
    want, _ = peers.hf_apply_rotary_pos_emb(*f64(x, x, cos, sin), unsqueeze_dim=unsqueeze_dim)
    check(got, want, dtype)
    assert torch.equal(x, x0) and torch.equal(got[..., rot:], x[..., rot:])
    # gradients w.r.t. x and both tables (the tables' halves read where transformers reads them)
    x64 = (x[:1, :2, :3] if unsqueeze_dim == 1 else x[:1, :3, :2]).double().requires_grad_()
    c64, s64 = (t[:1, :3].double().requires_grad_() for t in (cos, sin))
    assert gradcheck(lambda a, c, s: hf.apply_rotary_pos_emb_single(a, c, s, unsqueeze_dim),
                     (x64, c64, s64))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
def test_hf_apply_rotary_pos_emb_optional_key(dtype, unsqueeze_dim):
    # Qwen4-Exp's form: (q_embed, k_embed) given k, q_embed alone by keyword without it (its
    # indexer's calls), partial rotary, against float64 math.
    B, S, D, rot = 2, 7, 32, 16
    cos, sin = peers.hf_cos_sin(torch.randint(0, 200, (B, S)), rot, dtype=dtype)
    shape = (lambda h: (B, h, S, D)) if unsqueeze_dim == 1 else (lambda h: (B, S, h, D))
    q, k = torch.randn(shape(4), dtype=dtype), torch.randn(shape(2), dtype=dtype)
    want = peers.hf_apply_rotary_pos_emb(*f64(q, k, cos, sin), unsqueeze_dim=unsqueeze_dim)
    got = hf.apply_rotary_pos_emb_optional_key(q, k, cos, sin, unsqueeze_dim)
    assert len(got) == 2
    check(got[0], want[0], dtype)
    check(got[1], want[1], dtype)
    alone = hf.apply_rotary_pos_emb_optional_key(q, cos=cos, sin=sin, unsqueeze_dim=unsqueeze_dim)
    assert isinstance(alone, torch.Tensor)
    check(alone, want[0], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
def test_hf_apply_rotary_pos_emb_interleaved_half_tables(dtype, unsqueeze_dim):
    # OpenAI Privacy Filter's form: pairs (2i, 2i+1), tables of one entry per pair (any angles).
    B, S, D = 2, 7, 16
    ang = torch.randn(B, S, D // 2, dtype=torch.float64) * 3
    cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
    shape = (lambda h: (B, h, S, D)) if unsqueeze_dim == 1 else (lambda h: (B, S, h, D))
    q, k = torch.randn(shape(4), dtype=dtype), torch.randn(shape(2), dtype=dtype)
    got = hf.apply_rotary_pos_emb_interleaved_half_tables(q, k, cos, sin,
                                                          unsqueeze_dim=unsqueeze_dim)
    c64, s64 = (t.double().unsqueeze(unsqueeze_dim) for t in (cos, sin))
    for x, g in zip((q, k), got):
        a, b = x.double()[..., ::2], x.double()[..., 1::2]
        want = torch.stack((a * c64 - b * s64, b * c64 + a * s64), dim=-1).flatten(-2)
        check(g, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_value", [False, True])
def test_hf_apply_rotary_position_embeddings(dtype, with_value):
    # RoFormer's form: one table (1, 1, seq, D) of each pair's sin, then its cos; pairs (2i, 2i+1)
    # of q, k and, with rotary_value, v (batch, heads, seq, D).
    B, S, D = 2, 7, 16
    ang = torch.randn(1, 1, S, D // 2, dtype=torch.float64) * 3
    table = torch.cat((ang.sin(), ang.cos()), dim=-1).to(dtype)
    tensors = [torch.randn(B, h, S, D, dtype=dtype) for h in (4, 2, 2)[:2 + with_value]]
    got = hf.apply_rotary_position_embeddings(table, *tensors)
    assert len(got) == len(tensors)
    s64, c64 = table.double().chunk(2, dim=-1)
    for x, g in zip(tensors, got):
        a, b = x.double()[..., ::2], x.double()[..., 1::2]
        check(g, torch.stack((a * c64 - b * s64, b * c64 + a * s64), dim=-1).flatten(-2), dtype)
    with pytest.raises(ValueError, match=r"sinusoidal_pos .* key_layer.size\(-1\) = 8"):
        hf.apply_rotary_position_embeddings(table, tensors[0], tensors[1][..., :8])


@pytest.mark.parametrize("dtype", DTYPES)
def test_hf_apply_rotary_embedding_to_hidden_states(dtype):
    # The speech encoders' form: hidden states (batch, seq, heads * D) rotated as heads
    # (rotate_half pairs) by tables (2, >= seq, 1, 1, D) of cos, then sin, each angle twice.
    import types

    B, S, H, D = 2, 5, 3, 16
    attention = types.SimpleNamespace(num_heads=H, head_size=D)
    ang = torch.randn(S + 3, D // 2, dtype=torch.float64) * 3
    emb = torch.cat((ang, ang), dim=-1)[:, None, None, :]
    tables = torch.stack((emb.cos(), emb.sin())).to(dtype)
    x = torch.randn(B, S, H * D, dtype=dtype)
    got = hf.apply_rotary_embedding_to_hidden_states(attention, x, tables)
    c64, s64 = (t[:S, 0, 0, : D // 2].double()[:, None] for t in tables)  # (S, 1, D/2)
    heads = x.double().view(B, S, H, D)
    a, b = heads[..., : D // 2], heads[..., D // 2 :]
    want = torch.cat((a * c64 - b * s64, b * c64 + a * s64), dim=-1).view(B, S, H * D)
    check(got, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_hf_apply_rotary_pos_emb_qkv_indexed(dtype):
    # CLVP's form: (positions, rot) tables gathered at (batch, seq) position_ids; q, k and v.
    B, S, D = 2, 7, 32
    cos, sin = peers.hf_cos_sin(torch.arange(50)[None], D, dtype=dtype)
    cos, sin = cos[0], sin[0]  # (positions, D)
    pos = torch.randint(0, 50, (B, S))
    q, k, v = (torch.randn(B, h, S, D, dtype=dtype) for h in (4, 2, 2))
    got = hf.apply_rotary_pos_emb_qkv_indexed(q, k, v, cos, sin, pos)
    for x, g in zip((q, k, v), got):
        want, _ = peers.hf_apply_rotary_pos_emb(*f64(x, x, cos[pos], sin[pos]))
        check(g, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_hf_apply_rotary_pos_emb_vision_pairs(dtype):
    # Inkling 2's vision form: q, k (seq, heads, D); tables (seq, D) holding each angle at both
    # members of pair (2i, 2i+1); computed in float32, results in q's and k's dtypes.
    S, D = 9, 16
    ang = torch.randn(S, D // 2, dtype=torch.float64) * 3
    cos, sin = (t.repeat_interleave(2, dim=-1).float() for t in (ang.cos(), ang.sin()))
    q, k = torch.randn(S, 4, D, dtype=dtype), torch.randn(S, 2, D, dtype=dtype)
    got = hf.apply_rotary_pos_emb_vision_pairs(q, k, cos, sin)
    c, s_ = ang.cos()[:, None], ang.sin()[:, None]
    for x, g in zip((q, k), got):
        assert g.dtype == dtype
        a, b = x.double()[..., ::2], x.double()[..., 1::2]
        check(g, torch.stack((a * c - b * s_, b * c + a * s_), dim=-1).flatten(-2), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_hf_apply_rotary_pos_emb_latest_queries(dtype):
    # Muse Glimmer assistant's form: q (4 positions) by the last rows of tables spanning k's 9.
    B, D = 2, 32
    cos, sin = peers.hf_cos_sin(torch.randint(0, 200, (B, 9)), D, dtype=dtype)
    q, k = torch.randn(B, 4, 4, D, dtype=dtype), torch.randn(B, 2, 9, D, dtype=dtype)
    got = hf.apply_rotary_pos_emb_latest_queries(q, k, cos, sin)
    want_q, _ = peers.hf_apply_rotary_pos_emb(*f64(q, q, cos[:, -4:], sin[:, -4:]))
    _, want_k = peers.hf_apply_rotary_pos_emb(*f64(k, k, cos, sin))
    check(got[0], want_q, dtype)
    check(got[1], want_k, dtype)


@pytest.mark.parametrize("q_dtype, table_dtype", [(torch.bfloat16, torch.float32),
                                                   (torch.float32, torch.bfloat16)])
def test_hf_promotes_dtypes_like_torch(q_dtype, table_dtype):
    q, k = torch.randn(2, 3, 5, 16, dtype=q_dtype), torch.randn(2, 1, 5, 16, dtype=q_dtype)
    cos, sin = peers.hf_cos_sin(torch.arange(5).expand(2, 5), 16, dtype=table_dtype)
    want = peers.hf_apply_rotary_pos_emb(q, k, cos, sin)  # promotes to float32
    got = hf.apply_rotary_pos_emb(q, k, cos, sin)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype == torch.float32
        check(g, w.double(), torch.float32, scale=4)


def test_hf_broadcasts_tables_like_torch():
    q, k = torch.randn(3, 6, 4, 16), torch.randn(3, 6, 2, 16)  # (batch, seq, heads, head_dim)
    cos, sin = peers.hf_cos_sin(torch.arange(6)[None], 16)  # batch 1, broadcast over 3
    for c, s in ((cos, sin), (cos[0], sin[0])):  # (1, seq, dim) and (seq, dim)
        got = hf.apply_rotary_pos_emb(q, k, c, s, unsqueeze_dim=-2)
        want = peers.hf_apply_rotary_pos_emb(*f64(q, k, c, s), unsqueeze_dim=-2)
        for g, w in zip(got, want):
            check(g, w, torch.float32)


@pytest.mark.parametrize("q_shape,k_shape,table_batch,table_seq", [
    ((1, 3, 5, 8), (1, 1, 5, 8), 2, 5),  # the tables' batch broadcasts q and k
    ((2, 3, 5, 8), (1, 1, 5, 8), 2, 5),  # ... k alone
    ((2, 3, 1, 8), (2, 1, 1, 8), 2, 5),  # the tables' positions broadcast one token
])
def test_hf_broadcasts_q_and_k_against_larger_tables_like_torch(q_shape, k_shape, table_batch,
                                                                  table_seq):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as transformers_own

    q, k = torch.randn(q_shape, dtype=torch.float64), torch.randn(k_shape, dtype=torch.float64)
    angles = torch.randn(table_batch, table_seq, 4, dtype=torch.float64).repeat(1, 1, 2)
    got = hf.apply_rotary_pos_emb(q, k, angles.cos(), angles.sin())
    want = transformers_own(q, k, angles.cos(), angles.sin())
    for g, w in zip(got, want):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


def test_flash_attn_qkv_names_the_short_table_of_k():
    cache = torch.randn(16, 8)
    with pytest.raises(ValueError, match=r"seqlen_ro = cos_k.size\(0\) = 2"):
        flash_attn.apply_rotary_emb_qkv_(torch.randn(1, 4, 3, 2, 8), cache[:4, :4], cache[:4, 4:],
                                         cache[:2, :4], cache[:2, 4:])


@pytest.mark.parametrize("rot", [8, 4])
def test_hf_gradients(rot):
    # Tables with unequal halves that require grad take the exact two-pass path: values and
    # gradients are transformers' own, half by half, and match finite differences.
    q = torch.randn(2, 3, 4, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 1, 4, 8, dtype=torch.float64, requires_grad=True)
    cos = torch.randn(2, 4, rot, dtype=torch.float64, requires_grad=True)
    sin = torch.randn(2, 4, rot, dtype=torch.float64, requires_grad=True)
    assert gradcheck(hf.apply_rotary_pos_emb, (q, k, cos, sin))
    got, want = hf.apply_rotary_pos_emb(q, k, cos, sin), peers.hf_apply_rotary_pos_emb(q, k, cos, sin)
    w = [torch.randn_like(t) for t in want]
    g_got = torch.autograd.grad(sum((a * b).sum() for a, b in zip(got, w)), (q, k, cos, sin))
    g_want = torch.autograd.grad(sum((a * b).sum() for a, b in zip(want, w)), (q, k, cos, sin))
    for a, b in zip(list(got) + list(g_got), list(want) + list(g_want)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_hf_table_gradients_save_no_more_than_transformers():
    # bfloat16 q/k with float32 tables that require grad: q and k are promoted once each, and
    # the two passes save that one copy (they once saved a copy each: 1.9x transformers' bytes).
    def saved_bytes(fn):
        storages = {}

        def pack(t):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn()
        return sum(storages.values())

    q = torch.randn(2, 4, 64, 32, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(2, 2, 64, 32, dtype=torch.bfloat16, requires_grad=True)
    cos, sin = (t.requires_grad_() for t in peers.hf_cos_sin(torch.arange(64)[None].expand(2, 64),
                                                            32, dtype=torch.float32))
    ours = saved_bytes(lambda: hf.apply_rotary_pos_emb(q, k, cos, sin))
    assert ours <= saved_bytes(lambda: peers.hf_apply_rotary_pos_emb(q, k, cos, sin))


@pytest.mark.parametrize("one_call", [True, False])
def test_hf_gradients_without_table_grads(one_call, monkeypatch):
    monkeypatch.setattr(hf, "ONE_CALL_NUMEL", 1 << 30 if one_call else 0)
    q = torch.randn(2, 3, 4, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 1, 4, 8, dtype=torch.float64, requires_grad=True)
    cos, sin = peers.hf_cos_sin(torch.randint(0, 50, (2, 4)), 8, dtype=torch.float64)
    assert gradcheck(lambda q, k: hf.apply_rotary_pos_emb(q, k, cos, sin), (q, k))


def test_hf_outputs_that_need_gradients_take_in_place_ops(monkeypatch):
    # transformers returns two tensors of their own; views of one (the one-call path) would
    # refuse `q_embed *= scale` under autograd
    monkeypatch.setattr(hf, "ONE_CALL_NUMEL", 1 << 30)
    q = torch.randn(2, 3, 4, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 1, 4, 8, dtype=torch.float64, requires_grad=True)
    cos, sin = peers.hf_cos_sin(torch.randint(0, 50, (2, 4)), 8, dtype=torch.float64)
    q_embed, k_embed = hf.apply_rotary_pos_emb(q, k, cos, sin)
    q_embed *= 0.5
    (q_embed.sum() + k_embed.sum()).backward()
    want_q, _ = peers.hf_apply_rotary_pos_emb(q.detach(), k.detach(), cos, sin)
    check(q_embed.detach(), want_q * 0.5, torch.float64)


@pytest.mark.parametrize("single", [False, True])
def test_hf_unsqueeze_dim_given_in_position_ids_place(single):
    # transformers 5's (q, k, cos, sin, unsqueeze_dim=1) called positionally puts unsqueeze_dim
    # where transformers 4 had position_ids: seq == heads here, so reading it as position_ids
    # (unsqueeze at 1) would rotate by the wrong rows without a shape error
    q, k = torch.randn(2, 4, 4, 8, dtype=torch.float64), torch.randn(2, 4, 4, 8, dtype=torch.float64)
    cos, sin = peers.hf_cos_sin(torch.randint(0, 50, (2, 4)), 8, dtype=torch.float64)
    want = peers.hf_apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=2)
    if single:
        check(hf.apply_rotary_pos_emb_single(q, cos, sin, 2), want[0], torch.float64)
        # Gemma 3n's transformers 4 signature: (x, cos, sin, position_ids=None, unsqueeze_dim=1)
        check(hf.apply_rotary_pos_emb_single(q, cos, sin, torch.arange(4), unsqueeze_dim=2), want[0],
              torch.float64)
    else:
        for got, exp in zip(hf.apply_rotary_pos_emb(q, k, cos, sin, 2), want):
            check(got, exp, torch.float64)
    with pytest.raises(ValueError, match="position_ids .* or the positional unsqueeze_dim of transformers 5"):
        hf.apply_rotary_pos_emb(q, k, cos, sin, 2, unsqueeze_dim=2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [8, 16])  # GPT-J slices rotary_dim; a wider tensor passes through
def test_hf_gptj(dtype, width):
    B, S, H, rot = 2, 5, 3, 8
    tensor = torch.randn(B, S, H, width, dtype=dtype)
    cos, sin = tables(B * S, rot // 2, dtype)
    cos, sin = cos.view(B, S, -1), sin.view(B, S, -1)
    got = hf.apply_rotary_pos_emb_gptj(tensor, sin, cos)
    t64, s64, c64 = f64(tensor, sin, cos)
    want = torch.cat((peers.hf_gptj_apply_rotary_pos_emb(t64[..., :rot], s64, c64), t64[..., rot:]), -1)
    check(got, want, dtype)
    x = torch.randn(B, S, H, rot, dtype=torch.float64, requires_grad=True)
    c, s = (t.double().requires_grad_() for t in (cos, sin))
    assert gradcheck(hf.apply_rotary_pos_emb_gptj, (x, s, c))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("prefix", [0, 5])  # a class token and 4 register tokens
def test_hf_patches(dtype, prefix):
    """DINOv3's apply_rotary_pos_emb: the patches rotated, the tokens before them as they are;
    float32 tables promote bfloat16 q and k as transformers' arithmetic does; gradients."""
    B, H, P, D = 2, 3, 6, 16
    q, k = (torch.randn(B, H, prefix + P, D, dtype=dtype) for _ in range(2))
    cos, sin = tables(P, D // 2)
    cos, sin = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)
    got = hf.apply_rotary_pos_emb_patches(q, k, cos, sin)
    want = peers.hf_dinov3_apply_rotary_pos_emb(*f64(q, k, cos, sin))
    for g, w in zip(got, want):
        check(g, w, torch.float32)
    if dtype == torch.float32 and prefix:  # the gradients once
        x, y, c, s = (t.double().requires_grad_() for t in (q[:1, :1], k[:1, :1], cos, sin))
        assert gradcheck(hf.apply_rotary_pos_emb_patches, (x, y, c, s))
    with pytest.raises(ValueError, match=r"must be one \(patches, head_dim\) shape with patches <="):
        hf.apply_rotary_pos_emb_patches(q[..., :3, :], k[..., :3, :], cos, sin)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [24, 8])  # nope dims before the rotated ones, or none
def test_hf_trailing(dtype, width):
    """DeepSeek-V4's apply_rotary_pos_emb: the last rope_dim dims rotated (pairs (2i, 2i+1), half
    tables), by -sin too (its inverse), in x's dtype; gradients."""
    x = torch.randn(2, 3, 5, width, dtype=dtype)
    cos, sin = tables(10, 4, dtype)
    cos, sin = cos.view(2, 5, 4), sin.view(2, 5, 4)
    for s in (sin, -sin):
        check(hf.apply_rotary_pos_emb_trailing(x, cos, s),
              peers.hf_deepseek_v4_apply_rotary_pos_emb(*f64(x, cos, s)), dtype)
    if dtype == torch.float32 and width > 8:  # the gradients once
        assert gradcheck(hf.apply_rotary_pos_emb_trailing,
                         tuple(t[:1].double().requires_grad_() for t in (x, cos, sin)))
    with pytest.raises(ValueError, match=r"0 < rope_dim <= x.size\(-1\) = 6"):
        hf.apply_rotary_pos_emb_trailing(x[..., :6], cos, sin)


@pytest.mark.parametrize("dtype", DTYPES)
def test_hf_sam_2d(dtype):
    """SAM's apply_rotary_pos_emb_2d (memory attention: object pointers excluded, keys of two
    frames by the tables repeated) and EdgeTAM's cross-attention form (temporal keys passed
    through): pairs (2i, 2i+1), tables holding each angle at both members; gradients."""
    def rotated(x, cos, sin):  # float64: the rotation of every pair by its tables
        return peers.hf_cohere_apply_rotary_pos_emb(x, x, cos, sin, 0)[0]

    angles = (torch.rand(1, 6, 4, dtype=torch.float64) * 20).repeat_interleave(2, -1)
    cos, sin = angles.cos().float(), angles.sin().float()
    q, k = torch.randn(2, 3, 6, 8, dtype=dtype), torch.randn(2, 3, 2 * 6 + 4, 8, dtype=dtype)
    got = hf.apply_rotary_pos_emb_2d(q, k, cos, sin, num_k_exclude_rope=4, repeat_freqs_k=True)
    q64, k64, c64, s64 = f64(q, k, cos, sin)
    check(got[0], rotated(q64, c64, s64), dtype)
    check(got[1], torch.cat((rotated(k64[..., :12, :], c64.repeat(1, 2, 1), s64.repeat(1, 2, 1)),
                             k64[..., 12:, :]), -2), dtype)
    # EdgeTAM: 2 groups of 3 temporal keys (as they are) and 2 spatial ones, 1 excluded
    ck, sk = cos[:, :2], sin[:, :2]
    k = torch.randn(2, 3, 2 * 5 + 1, 8, dtype=dtype)
    got = hf.apply_rotary_pos_emb_2d_cross_attn(q, k, cos, sin, ck, sk, num_k_exclude_rope=1,
                                                repeat_freqs_k=2)
    k64 = k.double()
    want = k64.clone()
    for g in (0, 5):
        want[..., g + 3:g + 5, :] = rotated(k64[..., g + 3:g + 5, :], c64[:, :2], s64[:, :2])
    check(got[1], want, dtype)
    if dtype == torch.float32:  # the gradients once
        x, y = q[:1, :1].double().requires_grad_(), k[:1, :1].double().requires_grad_()
        assert gradcheck(lambda a, b: hf.apply_rotary_pos_emb_2d_cross_attn(
            a, b, c64, s64, c64[:, :2], s64[:, :2], num_k_exclude_rope=1, repeat_freqs_k=2), (x, y))


# Complex tables: each form's q and k shapes, its table's shape and where it places the table
COMPLEX = {
    "llama4": (hf.apply_rotary_emb_complex, (2, 5, 3, 16), (2, 5, 1, 16), (2, 5, 8),
               lambda f: f[:, :, None, :]),
    "deepseek_v2": (hf.apply_rotary_emb_complex_heads_first, (2, 3, 5, 16), (2, 1, 5, 16),
                    (2, 5, 8), lambda f: f.unsqueeze(1)),
    "llama4_vision": (hf.vision_apply_rotary_emb, (2, 5, 3, 16), (2, 5, 3, 16), (5, 1, 8),
                      lambda f: f.view(1, 5, 1, 8)),
}


@pytest.mark.parametrize("dtype", DTYPES + [torch.float16])
@pytest.mark.parametrize("form", COMPLEX)
def test_hf_complex_tables(dtype, form):
    """Llama 4's (text and vision) and DeepSeek-V2's apply_rotary_emb: complex tables of any
    modulus; values in the inputs' dtypes, k with fewer heads, and every gradient (float64)."""
    fn, q_shape, k_shape, table_shape, placed = COMPLEX[form]
    q, k = torch.randn(q_shape, dtype=dtype), torch.randn(k_shape, dtype=dtype)
    table = torch.polar(torch.rand(table_shape, dtype=torch.float64) + 0.5,
                        torch.randn(table_shape, dtype=torch.float64) * 3)
    got = fn(q, k, table.to(torch.complex64))
    want = peers.hf_complex_apply_rotary_emb(*f64(q, k), placed(table.to(torch.complex64)
                                                                .to(torch.complex128)))
    for g, w in zip(got, want):
        check(g, w, dtype)
    if dtype == torch.float32:  # the gradients once per form
        x, y = (t[:1].double().requires_grad_() for t in (q, k))
        f = torch.view_as_real(table[:1] if form != "llama4_vision" else table).clone()
        assert gradcheck(lambda a, b, f: fn(a, b, torch.view_as_complex(f)),
                         (x, y, f.requires_grad_()))
    refused = (r"freqs_ci of shape .* must hold query.size\(1\) x query" if form == "llama4_vision"
               else r"freqs_cis of shape .* must have xq.size\(-1\) / 2")
    with pytest.raises(ValueError, match=refused):
        fn(q[..., :14], k[..., :14], table.to(torch.complex64))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
def test_hf_indexed_tables(dtype, unsqueeze_dim):
    """transformers 4's PhiMoE: (positions, head_dim) tables gathered at position_ids; values,
    every gradient, and position_ids None (transformers 5's gathered tables) as the plain form."""
    B, S, H, D, P = 2, 4, 2, 8, 9
    angles = torch.rand(P, D // 2, dtype=torch.float64) * 20
    emb = torch.cat((angles, angles), -1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    pos = torch.randint(0, P, (B, S))
    q = torch.randn((B, H, S, D) if unsqueeze_dim == 1 else (B, S, H, D), dtype=dtype)
    k = torch.randn((B, 1, S, D) if unsqueeze_dim == 1 else (B, S, 1, D), dtype=dtype)
    got = hf.apply_rotary_pos_emb_indexed(q, k, cos, sin, pos, unsqueeze_dim)
    want = peers.hf_phimoe4_apply_rotary_pos_emb(*f64(q, k, cos, sin), pos, unsqueeze_dim)
    for g, w in zip(got, want):
        check(g, w, dtype)
    plain = hf.apply_rotary_pos_emb(q, k, cos[pos], sin[pos], unsqueeze_dim=unsqueeze_dim)
    gathered = hf.apply_rotary_pos_emb_indexed(q, k, cos[pos], sin[pos], unsqueeze_dim=unsqueeze_dim)
    assert all(torch.equal(a, b) for a, b in zip(plain, gathered))
    args = [t.double().requires_grad_() for t in (q, k, cos, sin)]
    assert gradcheck(lambda *a: hf.apply_rotary_pos_emb_indexed(*a, pos, unsqueeze_dim), args)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
def test_hf_negative_angle(dtype, unsqueeze_dim):
    """NanoChat's flipped rotate_half: values against its code in float64, every gradient."""
    B, S, H, D = 2, 4, 2, 8
    angles = torch.rand(B, S, D // 2, dtype=torch.float64) * 20
    emb = torch.cat((angles, angles), -1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    q = torch.randn((B, H, S, D) if unsqueeze_dim == 1 else (B, S, H, D), dtype=dtype)
    k = torch.randn((B, 1, S, D) if unsqueeze_dim == 1 else (B, S, 1, D), dtype=dtype)
    got = hf.apply_rotary_pos_emb_negative(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
    want = peers.hf_nanochat_apply_rotary_pos_emb(*f64(q, k, cos, sin), unsqueeze_dim)
    for g, w in zip(got, want):
        check(g, w, dtype)
    args = [t.double().requires_grad_() for t in (q, k, cos, sin)]
    negative = hf.apply_rotary_pos_emb_negative
    assert gradcheck(lambda *a: negative(*a, unsqueeze_dim=unsqueeze_dim), args)


INTERLEAVED_FAMILIES = {  # compat function, its transformers peer, the peer's table layout
    "glm": (hf.apply_rotary_pos_emb_glm, peers.hf_glm_apply_rotary_pos_emb, "halves"),
    "ernie": (hf.apply_rotary_pos_emb_ernie, peers.hf_ernie_apply_rotary_pos_emb, "halves"),
    "cohere": (hf.apply_rotary_pos_emb_cohere, peers.hf_cohere_apply_rotary_pos_emb, "pairs"),
    "deepseek": (hf.apply_rotary_pos_emb_interleave,
                 peers.hf_deepseek_apply_rotary_pos_emb_interleave, "halves"),
    "gpt_oss": (hf.apply_rotary_pos_emb_half_tables, peers.hf_gpt_oss_apply_rotary_pos_emb, "one"),
    "glm4v": (hf.apply_rotary_pos_emb_glm4v, peers.hf_glm4v_apply_rotary_pos_emb, "pairs"),
}
PREFIX = {"glm", "glm4v"}  # rotate the first half of the head; the others the whole head


def family_tables(layout, B, S, rot, dtype):
    """cos, sin as the family's rotary module makes them: (B, S, rot), each angle twice, or
    (B, S, rot / 2), once ("one")."""
    angles = torch.rand(B, S, rot // 2, dtype=torch.float64) * 20
    emb = {"halves": lambda: torch.cat((angles, angles), -1), "one": lambda: angles,
           "pairs": lambda: angles.repeat_interleave(2, -1)}[layout]()
    return emb.cos().to(dtype), emb.sin().to(dtype)


@pytest.mark.parametrize("family", INTERLEAVED_FAMILIES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
def test_hf_interleaved_families(family, dtype, unsqueeze_dim):
    fn, peer, layout = INTERLEAVED_FAMILIES[family]
    B, S, H, D = 2, 5, 3, 32
    rot = D // 2 if family in PREFIX else D
    cos, sin = family_tables(layout, B, S, rot, dtype)
    q = torch.randn((B, H, S, D) if unsqueeze_dim == 1 else (B, S, H, D), dtype=dtype)
    k = torch.randn((B, 1, S, D) if unsqueeze_dim == 1 else (B, S, 1, D), dtype=dtype)
    q0, k0 = q.clone(), k.clone()
    got = fn(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
    want = peer(*f64(q, k, cos, sin), unsqueeze_dim=unsqueeze_dim)
    for g, w, x in zip(got, want, (q, k)):
        check(g, w, dtype)
        assert g.shape == x.shape and torch.equal(g[..., rot:], x[..., rot:])
    assert torch.equal(q, q0) and torch.equal(k, k0)
    # bfloat16 q and k with float32 tables: the peer's dtypes (GLM promotes, the others give q's)
    mixed = (q.bfloat16(), k.bfloat16(), cos.float(), sin.float())
    assert [t.dtype for t in fn(*mixed, unsqueeze_dim=unsqueeze_dim)] == \
        [t.dtype for t in peer(*mixed, unsqueeze_dim=unsqueeze_dim)]


@pytest.mark.parametrize("family", INTERLEAVED_FAMILIES)
@pytest.mark.parametrize("q_dtype, k_dtype, table_dtype", [
    (torch.float32, torch.float16, torch.float16), (torch.float16, torch.bfloat16, torch.bfloat16),
    (torch.bfloat16, torch.bfloat16, torch.float64)])
def test_hf_interleaved_families_projection_views_and_mixed_dtypes(family, q_dtype, k_dtype,
                                                                   table_dtype):
    # q and k as transformers' attention makes them, (batch, seq, heads, head_dim) projections
    # seen as (batch, heads, seq, head_dim), of dtypes of their own: each result is the peer's
    # (its dtype, its values within that dtype's tolerance: rounded once) in the projection's
    # order of dims in memory, as the Llama drop-in keeps it.
    fn, peer, layout = INTERLEAVED_FAMILIES[family]
    B, S, D = 2, 5, 32
    cos, sin = family_tables(layout, B, S, D // 2 if family in PREFIX else D, table_dtype)
    q = torch.randn(B, S, 3 * D, dtype=q_dtype).view(B, S, 3, D).transpose(1, 2)
    k = torch.randn(B, S, 2 * D, dtype=k_dtype).view(B, S, 2, D).transpose(1, 2)
    got = fn(q, k, cos, sin)
    dtypes = [t.dtype for t in peer(q, k, cos, sin)]
    want = peer(*f64(q, k, cos, sin))
    for g, w, d in zip(got, want, dtypes):
        check(g, w, d, scale=2)
        assert sorted(range(4), key=lambda i: -g.stride(i)) == [0, 2, 1, 3], g.stride()


@pytest.mark.parametrize("family", [f for f in INTERLEAVED_FAMILIES if f not in PREFIX])
@pytest.mark.parametrize("q_shape", [(1, 4, 5, 16), (2, 4, 1, 16)])
def test_hf_interleaved_families_tables_broadcast_q_and_k_as_torch_does(family, q_shape):
    # Tables of more rows than q and k (batch 2 for batch 1, 5 positions for one): the results
    # take torch's broadcast shape, as the peer's arithmetic does (small sizes included, where
    # DeepSeek's form rotates q and k in one call). (GLM's and GLM-4.1V's cat of the rotated and
    # passed dims refuses such tables in transformers; rope_ext's forms broadcast them.)
    fn, peer, layout = INTERLEAVED_FAMILIES[family]
    cos, sin = family_tables(layout, 2, 5, 16, torch.float32)
    q = torch.randn(q_shape)
    k = torch.randn(q_shape[0], 1, *q_shape[2:])
    for g, w in zip(fn(q, k, cos, sin), peer(*f64(q, k, cos, sin))):
        assert g.shape == w.shape
        check(g, w, torch.float32)


@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
def test_hf_interleave_of_q_alone(unsqueeze_dim):
    # Mistral Large 4's form: k None rotates q alone, as with any k
    cos, sin = family_tables("halves", 2, 5, 16, torch.float32)
    q = torch.randn((2, 3, 5, 16) if unsqueeze_dim == 1 else (2, 5, 3, 16))
    k = q[:, :1] if unsqueeze_dim == 1 else q[:, :, :1]
    got, none = hf.apply_rotary_pos_emb_interleave(q, None, cos, sin, unsqueeze_dim=unsqueeze_dim)
    want, _ = hf.apply_rotary_pos_emb_interleave(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
    assert none is None and torch.equal(got, want)
    check(got, peers.hf_deepseek_apply_rotary_pos_emb_interleave(
        *f64(q, k, cos, sin), unsqueeze_dim=unsqueeze_dim)[0], torch.float32)


@pytest.mark.parametrize("family", INTERLEAVED_FAMILIES)
def test_hf_interleaved_families_forward_ad(family):
    # A tangent on q only: q_embed's is the peer's, k_embed has none (as the peer's)
    import torch.autograd.forward_ad as fwAD

    fn, peer, layout = INTERLEAVED_FAMILIES[family]
    cos, sin = family_tables(layout, 1, 3, 8, torch.float64)
    q, k, tq = (torch.randn(1, 2, 3, 8, dtype=torch.float64) for _ in range(3))
    with fwAD.dual_level():
        got = [fwAD.unpack_dual(t) for t in fn(fwAD.make_dual(q, tq), k, cos, sin)]
        want = [fwAD.unpack_dual(t) for t in peer(fwAD.make_dual(q, tq), k, cos, sin)]
    assert got[1].tangent is None and want[1].tangent is None
    torch.testing.assert_close(got[0].tangent, want[0].tangent, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", INTERLEAVED_FAMILIES)
def test_hf_interleaved_families_gradients(family):
    # Any tables (GLM's second half unread; Cohere's pair members and DeepSeek's halves
    # differing): values and gradients of q, k and both tables are the peer's in float64, and
    # finite differences'.
    # (ERNIE and Cohere compute from q.float(): float64 q and k are rounded to float32 there, and
    # so are their gradients, each term on its own: float32's tolerance for those)
    fn, peer, _ = INTERLEAVED_FAMILIES[family]
    width = 4 if family == "gpt_oss" else 8  # tables of one entry per pair
    args = [torch.randn(shape, dtype=torch.float64, requires_grad=True)
            for shape in ((2, 3, 4, 8), (2, 1, 4, 8), (2, 4, width), (2, 4, width))]
    got, want = fn(*args), peer(*args)
    w = [torch.randn_like(t) for t in want]
    g_got = torch.autograd.grad(sum((a * b).sum() for a, b in zip(got, w)), args)
    g_want = torch.autograd.grad(sum((a * b).sum() for a, b in zip(want, w)), args)
    exact = family in ("glm", "deepseek", "gpt_oss")
    for a, b in zip(list(got) + list(g_got), list(want) + list(g_want)):
        torch.testing.assert_close(a, b, rtol=1e-12 if exact else 1e-5, atol=1e-12 if exact else 1e-5)
    if exact:
        assert gradcheck(fn, args)


def mrope_tables(B, S, D, dtype):
    angles = torch.rand(3, B, S, D // 2, dtype=torch.float64) * 20  # distinct t, h, w components
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_hf_multimodal_rotary_pos_emb(dtype):
    B, S, D, section = 2, 5, 16, [2, 3, 3]
    q, k = torch.randn(B, 4, S, D, dtype=dtype), torch.randn(B, 2, S, D, dtype=dtype)
    cos, sin = mrope_tables(B, S, D, dtype)
    got = hf.apply_multimodal_rotary_pos_emb(q, k, cos, sin, section)
    want = peers.hf_apply_multimodal_rotary_pos_emb(*f64(q, k, cos, sin), section)
    for g, w in zip(got, want):
        check(g, w, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("section", [[2, 3, 3], [1, 1, 2]])  # whole head, first half
def test_hf_glm4v_multimodal_rotary_pos_emb(dtype, section):
    """transformers 4's GLM-4.1V: its code's values in float64 (the dims past rotary_dim passed
    through), every gradient (tables whose halves differ included)."""
    B, S, D, rot = 2, 5, 16, 2 * sum(section)
    q, k = torch.randn(B, 4, S, D, dtype=dtype), torch.randn(B, 2, S, D, dtype=dtype)
    cos, sin = mrope_tables(B, S, rot, dtype)
    got = hf.apply_multimodal_rotary_pos_emb_glm4v(q, k, cos, sin, section)
    want = peers.hf_glm4v_apply_multimodal_rotary_pos_emb(*f64(q, k, cos, sin), section)
    for g, w, x in zip(got, want, (q, k)):
        check(g, w, dtype)
        assert torch.equal(g[..., rot:], x[..., rot:])
    args = [torch.randn(*t.shape, dtype=torch.float64, requires_grad=True)
            for t in (q[:1, :2, :3], k[:1, :1, :3], cos[:, :1, :3], sin[:, :1, :3])]
    fn = lambda *a: hf.apply_multimodal_rotary_pos_emb_glm4v(*a, section)  # noqa: E731
    assert gradcheck(fn, args)
    for g, w in zip(fn(*args), peers.hf_glm4v_apply_multimodal_rotary_pos_emb(*args, section)):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


def test_hf_multimodal_gradients():
    q = torch.randn(1, 2, 3, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 1, 3, 8, dtype=torch.float64, requires_grad=True)
    cos = torch.randn(3, 1, 3, 8, dtype=torch.float64, requires_grad=True)  # unequal halves
    sin = torch.randn(3, 1, 3, 8, dtype=torch.float64, requires_grad=True)
    fn = lambda q, k, c, s: hf.apply_multimodal_rotary_pos_emb(q, k, c, s, [1, 2, 1])  # noqa: E731
    assert gradcheck(fn, (q, k, cos, sin))
    for g, w in zip(fn(q, k, cos, sin), peers.hf_apply_multimodal_rotary_pos_emb(q, k, cos, sin, [1, 2, 1])):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", DTYPES)
def test_hf_rotary_pos_emb_vision(dtype):
    q, k = torch.randn(9, 3, 16, dtype=dtype), torch.randn(9, 3, 16, dtype=dtype)
    angles = torch.rand(9, 8) * 10
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    got = hf.apply_rotary_pos_emb_vision(q, k, cos, sin)
    want = peers.hf_apply_rotary_pos_emb_vision(*f64(q, k, cos, sin))
    for g, w in zip(got, want):
        check(g, w, dtype)
    q64, k64 = (torch.randn(4, 2, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
    c64, s64 = (torch.randn(4, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
    assert gradcheck(hf.apply_rotary_pos_emb_vision, (q64, k64, c64, s64))


def test_hf_errors():
    q, k = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8)
    with pytest.raises(ValueError, match="even rotary_dim <= q.size"):
        hf.apply_rotary_pos_emb(q, k, torch.ones(1, 3, 10), torch.ones(1, 3, 10))
    with pytest.raises(ValueError, match="even rotary_dim"):
        hf.apply_rotary_pos_emb(q, k, torch.ones(1, 3, 5), torch.ones(1, 3, 5))
    with pytest.raises(ValueError, match="mrope_section must be 3 ints"):
        hf.apply_multimodal_rotary_pos_emb(q, k, torch.ones(3, 1, 3, 8), torch.ones(3, 1, 3, 8), [1, 1, 1])


# ---- flash-attn ------------------------------------------------------------------------------

def offsets_arg(kind, batch):
    return {"zero": 0, "int": 5, "tensor": torch.tensor([0, 3, 9, 1][:batch], dtype=torch.int32)}[kind]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("offsets", ["zero", "int", "tensor"])
@pytest.mark.parametrize("rot", [32, 16])
def test_fa_apply_rotary_emb(dtype, interleaved, inplace, offsets, rot):
    B, S, H, D = 3, 6, 4, 32
    cos, sin = tables(20, rot // 2, dtype)  # flash-attn's tables have x's dtype
    x = torch.randn(B, S, H, D, dtype=dtype)
    x0 = x.clone()
    off = offsets_arg(offsets, B)
    out = flash_attn.apply_rotary_emb(x, cos, sin, interleaved=interleaved, inplace=inplace,
                                      seqlen_offsets=off)
    want = peers.fa_apply_rotary_emb(*f64(x0, cos, sin), interleaved=interleaved, seqlen_offsets=off)
    check(out, want, dtype)
    assert (out is x) if inplace else torch.equal(x, x0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("offsets", ["int", "tensor"])
def test_fa_apply_rotary_emb_varlen(dtype, interleaved, inplace, offsets):
    cu_seqlens = torch.tensor([0, 3, 7, 12], dtype=torch.int32)
    x = torch.randn(12, 4, 32, dtype=dtype)
    x0 = x.clone()
    cos, sin = tables(16, 12, dtype)  # rotary_dim 24 of 32
    off = offsets_arg(offsets, 3)
    out = flash_attn.apply_rotary_emb(x, cos, sin, interleaved, inplace, off, cu_seqlens, 5)
    want = peers.fa_apply_rotary_emb(*f64(x0, cos, sin), interleaved, False, off, cu_seqlens, 5)
    check(out, want, dtype)
    assert (out is x) if inplace else torch.equal(x, x0)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("batched_tables", [False, True])
def test_fa_published_reference(interleaved, batched_tables):
    B, S, H, D = 2, 5, 3, 16
    x = torch.randn(B, S, H, D, dtype=torch.float64, requires_grad=True)
    shape = (B, S, 6) if batched_tables else (S, 6)
    cos = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    sin = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    got = flash_attn.apply_rotary_emb_torch(x, cos, sin, interleaved)
    torch.testing.assert_close(got, peers.fa_apply_rotary_emb_torch(x, cos, sin, interleaved),
                               rtol=1e-12, atol=1e-12)
    assert gradcheck(lambda x, c, s: flash_attn.apply_rotary_emb_torch(x, c, s, interleaved), (x, cos, sin))
    if not batched_tables:  # the kernel entry point agrees with the published reference
        fast = flash_attn.apply_rotary_emb(x.detach(), cos.detach(), sin.detach(), interleaved)
        torch.testing.assert_close(fast, got.detach(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("interleaved", [False, True])
def test_fa_gradients(interleaved):
    cos, sin = tables(12, 4, torch.float64)
    cos.requires_grad_()
    x = torch.randn(2, 4, 3, 12, dtype=torch.float64, requires_grad=True)
    off = torch.tensor([2, 7])
    assert gradcheck(lambda x: flash_attn.apply_rotary_emb(x, cos, sin, interleaved, seqlen_offsets=off), (x,))
    assert gradcheck(lambda x: flash_attn.apply_rotary_emb(x * 1, cos, sin, interleaved, inplace=True,
                                                           seqlen_offsets=3), (x,))
    xv = torch.randn(7, 3, 12, dtype=torch.float64, requires_grad=True)
    cu = torch.tensor([0, 2, 7])
    assert gradcheck(lambda x: flash_attn.apply_rotary_emb(x, cos, sin, interleaved, cu_seqlens=cu,
                                                           max_seqlen=5), (xv,))
    flash_attn.apply_rotary_emb(x, cos, sin, interleaved).sum().backward()
    assert cos.grad is None  # as flash-attn's Function: no gradient for the tables


@pytest.mark.parametrize("layout", ["qkv5", "gqa"])
@pytest.mark.parametrize("k_tables", [False, True])
@pytest.mark.parametrize("offsets", ["int", "tensor"])
@pytest.mark.parametrize("interleaved", [False, True])
def test_fa_apply_rotary_emb_qkv_(layout, k_tables, offsets, interleaved):
    dtype = torch.bfloat16
    B, S, D = 2, 5, 16
    qkv = torch.randn((B, S, 3, 4, D) if layout == "qkv5" else (B, S, 4 + 2 * 2, D), dtype=dtype)
    hq = None if layout == "qkv5" else 4
    cos, sin = tables(16, 6, dtype)
    cos_k, sin_k = tables(16, 6, dtype) if k_tables else (None, None)
    off = offsets_arg(offsets, B)
    want = peers.fa_apply_rotary_emb_qkv_(*f64(qkv, cos, sin, cos_k, sin_k), interleaved=interleaved,
                                          seqlen_offsets=off, num_heads_q=hq)
    out = flash_attn.apply_rotary_emb_qkv_(qkv, cos, sin, cos_k, sin_k, interleaved, off, hq)
    assert out is qkv
    check(qkv, want, dtype)  # the whole buffer: q and k rotated, v untouched


def test_fa_qkv_and_kv_gradients():
    cos, sin = tables(8, 3, torch.float64)
    qkv = torch.randn(1, 4, 3, 2, 8, dtype=torch.float64, requires_grad=True)
    assert gradcheck(lambda t: flash_attn.apply_rotary_emb_qkv_(t * 1, cos, sin, seqlen_offsets=2), (qkv,))
    gqa = torch.randn(1, 4, 2 + 2 * 1, 8, dtype=torch.float64, requires_grad=True)
    assert gradcheck(lambda t: flash_attn.apply_rotary_emb_qkv_(t * 1, cos, sin, num_heads_q=2), (gqa,))
    kv = torch.randn(2, 4, 2, 2, 8, dtype=torch.float64, requires_grad=True)
    assert gradcheck(lambda t: flash_attn.apply_rotary_emb_kv_(t * 1, cos, sin, True, torch.tensor([0, 4])), (kv,))


@pytest.mark.parametrize("interleaved", [False, True])
def test_fa_apply_rotary_emb_kv_(interleaved):
    kv = torch.randn(2, 5, 2, 3, 16)
    cos, sin = tables(10, 8)
    want = peers.fa_apply_rotary_emb_kv_(*f64(kv, cos, sin), interleaved, torch.tensor([1, 4]))
    assert flash_attn.apply_rotary_emb_kv_(kv, cos, sin, interleaved, torch.tensor([1, 4])) is kv
    check(kv, want, torch.float32)


class OpCounter(TorchDispatchMode):
    """The names of the ops a call dispatches (torch's and rope's)."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("per_sequence", [False, True])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fa_inplace_one_pass_path(monkeypatch, interleaved, dtype, per_sequence):
    # Large enough in-place calls rotate in one pass (rope.apply_ on the call's table rows, or
    # on the whole table with an offset per sequence); the threshold at 0 sends these small
    # ones there: the same values as the peer, the same bits as the out-of-place call,
    # gradients through it, torch's in-place errors, and no copy of x.
    monkeypatch.setattr(flash_attn, "_ONE_PASS_MIN_ELEMENTS", 0)
    cos, sin = tables(16, 6, dtype)
    offset = (lambda o: torch.tensor([o, 5 - o])) if per_sequence else (lambda o: o)  # noqa: E731
    for shape, hq in (((2, 5, 3, 4, 16), None), ((2, 5, 4 + 2 * 2, 16), 4)):
        qkv = torch.randn(shape, dtype=dtype)
        want = peers.fa_apply_rotary_emb_qkv_(*f64(qkv, cos, sin), interleaved=interleaved,
                                              seqlen_offsets=offset(3), num_heads_q=hq)
        with OpCounter() as ops:
            assert flash_attn.apply_rotary_emb_qkv_(qkv, cos, sin, None, None, interleaved,
                                                    offset(3), hq) is qkv
        assert "rope.apply_.default" in ops.names and "aten.copy_.default" not in ops.names
        check(qkv, want, dtype)
    kv = torch.randn(2, 5, 2, 3, 16, dtype=dtype)
    want = peers.fa_apply_rotary_emb_kv_(*f64(kv, cos, sin), interleaved, offset(2))
    assert flash_attn.apply_rotary_emb_kv_(kv, cos, sin, interleaved, offset(2)) is kv
    check(kv, want, dtype)
    x = torch.randn(2, 7, 3, 16, dtype=dtype)
    out_of_place = flash_attn.apply_rotary_emb(x, cos, sin, interleaved, seqlen_offsets=offset(4))
    assert flash_attn.apply_rotary_emb(x, cos, sin, interleaved, True, offset(4)) is x
    assert torch.equal(x, out_of_place)
    c64, s64 = tables(8, 3, torch.float64)
    qkv = torch.randn(1, 4, 3, 2, 8, dtype=torch.float64, requires_grad=True)
    assert gradcheck(lambda t: flash_attn.apply_rotary_emb_qkv_(t * 1, c64, s64, seqlen_offsets=2), (qkv,))
    x = torch.randn(1, 4, 2, 8, dtype=torch.float64, requires_grad=True)
    assert gradcheck(lambda t: flash_attn.apply_rotary_emb(t * 1, c64, s64, interleaved, True, 1), (x,))
    with pytest.raises(RuntimeError, match="a leaf Variable that requires grad"):
        flash_attn.apply_rotary_emb(x, c64, s64, inplace=True)
    with torch.inference_mode():
        inf = torch.randn(1, 4, 2, 8)
    with pytest.raises(RuntimeError, match="Inplace update to inference tensor outside InferenceMode"):
        flash_attn.apply_rotary_emb(inf, c64.float(), s64.float(), inplace=True)


@pytest.mark.parametrize("one_pass", [False, True])
def test_fa_varlen_inplace_in_one_pass(monkeypatch, one_pass):
    # With cu_seqlens too, a large in-place call rotates in one pass (no copy of x): the bits of
    # the out-of-place call, and its errors (a token outside every sequence, a position past
    # the table) before anything is written.
    if one_pass:
        monkeypatch.setattr(flash_attn, "_ONE_PASS_MIN_ELEMENTS", 0)
    cos, sin = tables(12, 6)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    for offsets in (2, torch.tensor([4, 0])):
        x = torch.randn(8, 3, 16)
        want = flash_attn.apply_rotary_emb(x, cos, sin, False, False, offsets, cu, 5)
        with OpCounter() as ops:
            assert flash_attn.apply_rotary_emb(x, cos, sin, False, True, offsets, cu, 5) is x
        assert ("aten.copy_.default" in ops.names) != one_pass
        assert torch.equal(x, want)
    for cu, offsets in ((torch.tensor([0, 6]), 0), (torch.tensor([0, 8]), 5)):
        with pytest.raises(RuntimeError) as out_of_place:
            flash_attn.apply_rotary_emb(x, cos, sin, False, False, offsets, cu, 8)
        x0, version = x.clone(), x._version
        with pytest.raises(RuntimeError) as in_place:
            flash_attn.apply_rotary_emb(x, cos, sin, False, True, offsets, cu, 8)
        assert str(in_place.value) == str(out_of_place.value)
        assert "rope.apply_positions: positions must lie in [0, 12)" in str(in_place.value)
        assert torch.equal(x, x0) and x._version == version


def test_fa_one_pass_only_where_it_serves(monkeypatch):
    # Not inside torch.func transforms (rope.apply_ has no batching or jvp rule: the copy path
    # serves them, as out of place), and not where the whole table would cost more to build
    # than x holds (a bfloat16 table widens to float32 for the call).
    monkeypatch.setattr(flash_attn, "_ONE_PASS_MIN_ELEMENTS", 0)
    cos, sin = tables(12, 6)
    offsets = torch.tensor([4, 0])
    x, t = torch.randn(2, 3, 2, 16), torch.randn(2, 3, 2, 16)

    def rotated(y, inplace):
        return flash_attn.apply_rotary_emb(y, cos, sin, False, inplace, offsets)

    want = torch.func.jvp(lambda y: rotated(y, False), (x,), (t,))
    got = torch.func.jvp(lambda y: rotated(y.clone(), True), (x,), (t,))
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    batch = torch.stack([x, 2 * x])
    assert torch.equal(torch.vmap(lambda y: rotated(y.clone(), True))(batch),
                       torch.vmap(lambda y: rotated(y, False))(batch))
    for dtype, one_pass in ((torch.float32, True), (torch.bfloat16, False)):
        x = torch.randn(2, 3, 2, 16, dtype=dtype)  # 192 elements; the table 12 x 6 = 72
        c, s_ = cos.to(dtype), sin.to(dtype)
        want = flash_attn.apply_rotary_emb(x, c, s_, False, False, offsets)
        with OpCounter() as ops:
            flash_attn.apply_rotary_emb(x, c, s_, False, True, offsets)
        assert ("rope.apply_.default" in ops.names) == one_pass and torch.equal(x, want)


def test_fa_inplace_above_the_one_pass_threshold():
    # A real size above the threshold (no patching): the peer's values.
    cos, sin = tables(300, 32)
    qkv = torch.randn(1, 256, 8 + 2 * 4, 64)
    assert qkv[:, :, :12].numel() >= flash_attn._ONE_PASS_MIN_ELEMENTS
    want = peers.fa_apply_rotary_emb_qkv_(*f64(qkv, cos, sin), seqlen_offsets=40, num_heads_q=8)
    flash_attn.apply_rotary_emb_qkv_(qkv, cos, sin, seqlen_offsets=40, num_heads_q=8)
    check(qkv, want, torch.float32)


@pytest.mark.parametrize("one_pass", [False, True])
def test_fa_inplace_any_qkv_layout_and_refusals_change_nothing(monkeypatch, one_pass):
    # qkv stored head-major ((b, 3, h, s, d) seen as (b, s, 3, h, d); GQA's (b, h, s, d)
    # transposed): Q and K never meet, on either path; an inference tensor, or cos and sin of
    # two dtypes, is refused on either path before anything is written.
    if one_pass:
        monkeypatch.setattr(flash_attn, "_ONE_PASS_MIN_ELEMENTS", 0)
    cos, sin = tables(16, 6)
    for qkv, hq in ((torch.randn(2, 3, 4, 5, 16).permute(0, 3, 1, 2, 4), None),
                    (torch.randn(2, 4 + 2 * 2, 5, 16).transpose(1, 2), 4)):
        want = peers.fa_apply_rotary_emb_qkv_(*f64(qkv, cos, sin), seqlen_offsets=3,
                                              num_heads_q=hq)
        assert flash_attn.apply_rotary_emb_qkv_(qkv, cos, sin, None, None, False, 3, hq) is qkv
        check(qkv, want, torch.float32)
    with torch.inference_mode():
        qkv, x = torch.randn(1, 4, 3, 2, 16), torch.randn(1, 4, 2, 16)
    calls = [lambda: flash_attn.apply_rotary_emb_qkv_(qkv, cos, sin),
             lambda: flash_attn.apply_rotary_emb_qkv_(qkv, cos, sin, cos, sin),
             lambda: flash_attn.apply_rotary_emb_kv_(qkv[:, :, 1:], cos, sin),
             lambda: flash_attn.apply_rotary_emb(x, cos, sin, inplace=True),
             lambda: flash_attn.apply_rotary_emb(x.view(4, 2, 16), cos, sin, inplace=True,
                                                 cu_seqlens=torch.tensor([0, 4]), max_seqlen=4)]
    before = qkv.clone(), x.clone()
    for call in calls:
        with pytest.raises(RuntimeError, match="Inplace update to inference tensor outside"):
            call()
        assert torch.equal(qkv, before[0]) and torch.equal(x, before[1])
    x = torch.randn(1, 4, 2, 16)
    x0 = x.clone()
    with pytest.raises(RuntimeError, match="cos and sin must have the same dtype"):
        flash_attn.apply_rotary_emb(x, cos.double(), sin, inplace=True)
    assert torch.equal(x, x0)


def test_fa_inplace_on_a_leaf_that_requires_grad_is_refused():
    x = torch.randn(1, 3, 2, 8, requires_grad=True)
    cos, sin = tables(3, 4)
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        flash_attn.apply_rotary_emb(x, cos, sin, inplace=True)


def test_fa_errors_change_nothing():
    x = torch.randn(2, 6, 3, 16)
    x0 = x.clone()
    cos, sin = tables(8, 8)
    with pytest.raises(ValueError, match="seqlen_offsets \\+ seqlen = 3 \\+ 6 must lie within"):
        flash_attn.apply_rotary_emb(x, cos, sin, inplace=True, seqlen_offsets=3)
    for offsets in (torch.tensor([0, 5]), torch.tensor([-1, 0], dtype=torch.int32)):
        with pytest.raises(ValueError, match=r"seqlen_offsets \+ seqlen must lie within the table's "
                                             r"seqlen_ro = cos.size\(0\) = 8 for every sequence, "
                                             r"with seqlen = 6"):
            flash_attn.apply_rotary_emb(x, cos, sin, inplace=True, seqlen_offsets=offsets)
    with pytest.raises(ValueError, match="max_seqlen must be passed"):
        flash_attn.apply_rotary_emb(x[0], cos, sin, inplace=True, cu_seqlens=torch.tensor([0, 6]))
    with pytest.raises(RuntimeError, match="got -1 at flat index 4"):  # tokens past cu_seqlens[-1]
        flash_attn.apply_rotary_emb(x[0], cos, sin, inplace=True, cu_seqlens=torch.tensor([0, 4]), max_seqlen=4)
    with pytest.raises(ValueError, match="batch_size, seqlen, nheads, headdim"):
        flash_attn.apply_rotary_emb(x[0], cos, sin)
    with pytest.raises(ValueError, match="seqlen_offsets must be an int or an int32/int64 tensor"):
        flash_attn.apply_rotary_emb(x, cos, sin, seqlen_offsets=torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="num_heads_q is required"):
        flash_attn.apply_rotary_emb_qkv_(x.view(2, 6, 3, 2, 8)[:, :, :, 0], cos[:, :4], sin[:, :4])
    assert torch.equal(x, x0)


# ---- vLLM ------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("layout", ["flat", "heads"])
@pytest.mark.parametrize("lead", [(11,), (2, 5)])
@pytest.mark.parametrize("with_key", [True, False])
def test_vllm_rotary_embedding(dtype, is_neox, layout, lead, with_key):
    Hq, Hk, hs, rot = 4, 2, 32, 16  # GQA, partial rotary
    qkv = torch.randn(*lead, (Hq + 2 * Hk) * hs, dtype=dtype)  # the fused projection output
    query, key = qkv[..., : Hq * hs], qkv[..., Hq * hs : (Hq + Hk) * hs]
    if layout == "heads":
        query, key = query.unflatten(-1, (Hq, hs)), key.unflatten(-1, (Hk, hs))
    key = key if with_key else None
    cache = cos_sin_cache(64, rot, dtype)
    positions = torch.randint(0, 64, lead)
    want = qkv.double()
    wq, wk = want[..., : Hq * hs], want[..., Hq * hs : (Hq + Hk) * hs]
    peers.vllm_rotary_embedding(positions, wq, wk if with_key else None, hs, cache.double(), is_neox)
    assert vllm.rotary_embedding(positions, query, key, hs, cache, is_neox) is None
    check(qkv, want, dtype)


@pytest.mark.parametrize("is_neox", [None, True, False])
def test_sglang_rotary_embedding_is_vllms_op(is_neox):
    # sgl_kernel.rotary_embedding: vLLM's kernel under SGLang's name, is_neox=True by default
    T, Hq, Hk, hs = 7, 4, 2, 32
    qkv = torch.randn(T, (Hq + 2 * Hk) * hs)
    query, key = qkv[:, : Hq * hs], qkv[:, Hq * hs : (Hq + Hk) * hs]
    cache, positions = cos_sin_cache(64, hs), torch.randint(0, 64, (T,))
    want = qkv.double()
    peers.vllm_rotary_embedding(positions, want[:, : Hq * hs], want[:, Hq * hs : (Hq + Hk) * hs], hs,
                                cache.double(), is_neox is not False)
    args = (positions, query, key, hs, cache) + (() if is_neox is None else (is_neox,))
    assert sglang.rotary_embedding(*args) is None
    check(qkv, want, torch.float32)


def test_vllm_errors_change_nothing():
    query, key = torch.randn(5, 3 * 16), torch.randn(5, 16)
    q0, k0 = query.clone(), key.clone()
    cache = cos_sin_cache(10, 16)
    with pytest.raises(ValueError, match="query of shape \\[5, 48\\]: its last dim 48 must be a multiple of "
                                         "head_size = 32"):
        vllm.rotary_embedding(torch.arange(5), query, key, 32, cache, True)
    with pytest.raises(RuntimeError, match="positions must lie in \\[0, 10\\)"):
        vllm.rotary_embedding(torch.tensor([0, 1, 2, 3, 10]), query, key, 16, cache, True)
    with pytest.raises(ValueError, match="head_size must be a positive int"):
        vllm.rotary_embedding(torch.arange(5), query, key, 0, cache, True)
    assert torch.equal(query, q0) and torch.equal(key, k0)


def test_vllm_gradients():
    cache = cos_sin_cache(20, 8, torch.float64)
    positions = torch.randint(0, 20, (4,))

    def fn(q, k):
        q, k = q * 1, k * 1
        vllm.rotary_embedding(positions, q, k, 8, cache, False)
        return q, k

    q = torch.randn(4, 2 * 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    assert gradcheck(fn, (q, k))


# ---- FlashInfer ------------------------------------------------------------------------------

def fi_inputs(dtype, nnz=10, Hq=4, Hk=2, D=32):
    return torch.randn(nnz, Hq, D, dtype=dtype), torch.randn(nnz, Hk, D, dtype=dtype)


SCALINGS = [dict(), dict(rope_scale=2.0, rope_theta=5e5)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleave", [False, True])
@pytest.mark.parametrize("rotary_dim", [None, 16])
@pytest.mark.parametrize("scaling", [0, 1])
@pytest.mark.parametrize("inplace", [False, True])
def test_fi_apply_rope_pos_ids(dtype, interleave, rotary_dim, scaling, inplace):
    q, k = fi_inputs(dtype)
    q0, k0 = q.clone(), k.clone()
    pos_ids = torch.randint(0, 3000, (10,), dtype=torch.int32)
    kw = dict(rotary_dim=rotary_dim, interleave=interleave, **SCALINGS[scaling])
    want = peers.flashinfer_apply_rope_pos_ids(*f64(q, k), pos_ids, **kw)
    if inplace:
        assert flashinfer.apply_rope_pos_ids_inplace(q, k, pos_ids, **kw) is None
        got = (q, k)
    else:
        got = flashinfer.apply_rope_pos_ids(q, k, pos_ids, **kw)
        assert torch.equal(q, q0) and torch.equal(k, k0)
    for g, w in zip(got, want):
        check(g, w, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleave", [False, True])
@pytest.mark.parametrize("inplace", [False, True])
def test_fi_apply_rope_ragged(dtype, interleave, inplace):
    q, k = fi_inputs(dtype, nnz=12)
    q0, k0 = q.clone(), k.clone()
    indptr = torch.tensor([0, 4, 4, 9, 12], dtype=torch.int32)  # an empty segment too
    offsets = torch.tensor([0, 7, 100, 2500], dtype=torch.int32)
    want = peers.flashinfer_apply_rope(*f64(q, k), indptr, offsets, 24, interleave)
    if inplace:
        assert flashinfer.apply_rope_inplace(q, k, indptr, offsets, 24, interleave) is None
        got = (q, k)
    else:
        got = flashinfer.apply_rope(q, k, indptr, offsets, 24, interleave)
        assert torch.equal(q, q0) and torch.equal(k, k0)
    for g, w in zip(got, want):
        check(g, w, dtype)


@pytest.mark.parametrize("inplace", [False, True])
def test_fi_tokens_outside_indptr_are_left_alone(inplace):
    q, k = fi_inputs(torch.float32, nnz=9)
    q0 = q.clone()
    indptr, offsets = torch.tensor([2, 5, 7]), torch.tensor([3, 0])
    want = peers.flashinfer_apply_rope(*f64(q, k), indptr, offsets)
    got = flashinfer.apply_rope(q, k, indptr, offsets) if not inplace else None
    if inplace:
        flashinfer.apply_rope_inplace(q, k, indptr, offsets)
        got = (q, k)
    check(got[0], want[0], torch.float32)
    assert torch.equal(got[0][:2], q0[:2]) and torch.equal(got[0][7:], q0[7:])


@pytest.mark.parametrize("ragged", [False, True])
@pytest.mark.parametrize("inplace", [False, True])
def test_fi_llama31(ragged, inplace):
    q, k = fi_inputs(torch.float32, nnz=8, D=64)
    kw = dict(rope_scale=8, rope_theta=5e5, low_freq_factor=1, high_freq_factor=4, old_context_len=64)
    positions = torch.tensor([0, 1, 33, 100, 700, 2000, 5, 9000])
    indptr, offsets = torch.tensor([0, 3, 8]), torch.tensor([60, 2000])
    if ragged:
        wq, wk = f64(q, k)
        peers.flashinfer_apply_llama31_rope_inplace(wq, wk, indptr, offsets, **kw)
        args = (indptr, offsets)
        fn = flashinfer.apply_llama31_rope_inplace if inplace else flashinfer.apply_llama31_rope
    else:
        wq, wk = f64(q, k)
        peers.flashinfer_apply_llama31_rope_pos_ids_inplace(wq, wk, positions, **kw)
        args = (positions,)
        fn = flashinfer.apply_llama31_rope_pos_ids_inplace if inplace else flashinfer.apply_llama31_rope_pos_ids
    out = fn(q, k, *args, **kw)
    got = (q, k) if inplace else out
    assert (out is None) == inplace
    check(got[0], wq, torch.float32)
    check(got[1], wk, torch.float32)
    # The Llama 3.1 blend moves the low frequencies (1/8 of the unscaled value), keeps the high ones.
    unscaled = peers.flashinfer_frequencies(64, 1.0, 5e5)
    blended = peers.flashinfer_frequencies(64, 8, 5e5, 1, 4, 64)
    assert blended[0] == unscaled[0] and torch.isclose(blended[-1], unscaled[-1] / 8)


def test_fi_llama31_factors_are_floats_first():
    """FlashInfer's host function takes the Llama 3.1 factors as C floats: factors float32 cannot
    hold exactly give the frequencies of their float32 roundings, to the bit."""
    from rope_ext.compat.flashinfer import _frequencies

    got = _frequencies(64, 8.0, 5e5, torch.device("cpu"), (1.1, 4.3, 8191.3))
    want = peers.flashinfer_frequencies(64, 8.0, 5e5, 1.1, 4.3, 8191.3)
    rounded = [float(torch.tensor(v, dtype=torch.float32)) for v in (1.1, 4.3, 8191.3)]
    assert torch.equal(got, want)
    assert torch.equal(got, peers.flashinfer_frequencies(64, 8.0, 5e5, *rounded))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("inplace", [False, True])
def test_fi_apply_rope_with_cos_sin_cache(dtype, is_neox, inplace):
    T, Hq, Hk, hs = 7, 4, 2, 32
    qkv = torch.randn(T, (Hq + 2 * Hk) * hs, dtype=dtype)
    query, key = qkv[:, : Hq * hs], qkv[:, Hq * hs : (Hq + Hk) * hs]
    cache = cos_sin_cache(40, 24)
    positions = torch.randint(0, 40, (T,))
    want = qkv.double()
    peers.flashinfer_apply_rope_with_cos_sin_cache_inplace(
        positions, want[:, : Hq * hs], want[:, Hq * hs : (Hq + Hk) * hs], hs, cache, is_neox)
    if inplace:
        assert flashinfer.apply_rope_with_cos_sin_cache_inplace(positions, query, key, hs, cache, is_neox) is None
        check(qkv, want, dtype)
    else:
        before = qkv.clone()
        q_out, k_out = flashinfer.apply_rope_with_cos_sin_cache(positions, query, key, hs, cache, is_neox)
        assert q_out.shape == query.shape and k_out.shape == key.shape and torch.equal(qkv, before)
        check(q_out, want[:, : Hq * hs], dtype)
        check(k_out, want[:, Hq * hs : (Hq + Hk) * hs], dtype)


@pytest.mark.parametrize("fn", ["flashinfer", "sglang"])
def test_cos_sin_cache_drop_ins_view_3d_heads_as_the_peers_do(fn):
    # FlashInfer and SGLang view query as query.view(nnz, -1, head_size): a (nnz, 2, 2 * hs)
    # query is 4 heads of hs
    T, hs = 5, 16
    qkv = torch.randn(T, 3, 2, 2 * hs)
    query, key = qkv[:, 0], qkv[:, 1]
    cache, positions = cos_sin_cache(40, 16), torch.randint(0, 40, (T,))
    want = qkv.double()
    peers.flashinfer_apply_rope_with_cos_sin_cache_inplace(
        positions, want[:, 0].flatten(1), want[:, 1].flatten(1), hs, cache, True)
    call = (flashinfer.apply_rope_with_cos_sin_cache_inplace if fn == "flashinfer"
            else sglang.apply_rope_with_cos_sin_cache_inplace)
    call(positions, query, key, hs, cache)
    check(qkv, want, torch.float32)


@pytest.mark.filterwarnings("ignore:There is a performance drop")
def test_fi_pos_ids_under_vmap_and_functionalize():
    # torch.func's wrappers have no values to read: the kept position table is not looked up
    # for them (it once read them, and failed), the per-token table serves
    q, k = torch.randn(4, 3, 2, 32), torch.randn(4, 3, 1, 32)
    pos = torch.randint(0, 5000, (4, 3))
    got = torch.vmap(flashinfer.apply_rope_pos_ids)(q, k, pos)
    for b in range(4):
        for a, want in zip(got, flashinfer.apply_rope_pos_ids(q[b], k[b], pos[b])):
            assert torch.equal(a[b], want)
    once = torch.func.functionalize(flashinfer.apply_llama31_rope_pos_ids)(q[0], k[0], pos[0])
    for a, want in zip(once, flashinfer.apply_llama31_rope_pos_ids(q[0], k[0], pos[0])):
        assert torch.equal(a, want)


def test_fi_errors_change_nothing():
    q, k = fi_inputs(torch.float32)
    q0 = q.clone()
    with pytest.raises(ValueError, match="cos_sin_cache should be float32"):
        flashinfer.apply_rope_with_cos_sin_cache_inplace(torch.arange(10), q.flatten(1), k.flatten(1), 32,
                                                         cos_sin_cache(20, 32, torch.float16))
    with pytest.raises(ValueError, match="must be a multiple of head_size = 48"):
        flashinfer.apply_rope_with_cos_sin_cache_inplace(torch.arange(10), q.flatten(1), k.flatten(1), 48,
                                                         cos_sin_cache(20, 32))
    with pytest.raises(ValueError, match="rotary_dim must be an even int in \\[2, head_dim = 32\\]"):
        flashinfer.apply_rope_pos_ids_inplace(q, k, torch.arange(10), rotary_dim=33)
    with pytest.raises(ValueError, match="pos_ids must have shape \\[10\\]"):
        flashinfer.apply_rope_pos_ids_inplace(q, k, torch.arange(9))
    with pytest.raises(ValueError, match="q and k must have shapes"):
        flashinfer.apply_rope_pos_ids_inplace(q.flatten(1), k, torch.arange(10))
    with pytest.raises(ValueError, match="offsets must have shape \\[2\\]"):
        flashinfer.apply_rope_inplace(q, k, torch.tensor([0, 4, 10]), torch.tensor([0]))
    assert torch.equal(q, q0)


def test_fi_gradients():
    q = torch.randn(5, 2, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(5, 1, 8, dtype=torch.float64, requires_grad=True)
    pos = torch.randint(0, 100, (5,))
    assert gradcheck(lambda q, k: flashinfer.apply_rope_pos_ids(q, k, pos, rotary_dim=6), (q, k))
    assert gradcheck(lambda q, k: flashinfer.apply_rope(q, k, torch.tensor([0, 2, 5]), torch.tensor([4, 1]),
                                                        interleave=True), (q, k))

    def in_place(qk):  # q and k as views of one buffer, rotated in place
        qk = qk * 1
        flashinfer.apply_rope_pos_ids_inplace(qk[:, :2], qk[:, 2:], pos)
        return qk

    assert gradcheck(in_place, (torch.randn(5, 3, 8, dtype=torch.float64, requires_grad=True),))


# ---- SGLang ----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("fused", [None, "flat", "heads"])
def test_sglang_apply_rope_with_cos_sin_cache_inplace(dtype, is_neox, fused):
    T, Hq, Hk, hs, slots = 6, 4, 2, 16, 20
    qkv = torch.randn(T, (Hq + 2 * Hk) * hs, dtype=dtype)
    query, key, value = (qkv[:, : Hq * hs], qkv[:, Hq * hs : (Hq + Hk) * hs],
                         qkv[:, (Hq + Hk) * hs :])
    cache = cos_sin_cache(50, hs)
    positions = torch.randint(0, 50, (T,))
    want = qkv.double()
    w_arg = arg = None
    if fused is not None:
        shape = (slots, Hk * hs) if fused == "flat" else (slots, Hk, hs)
        k_buffer = torch.full(shape, float("nan"), dtype=dtype)  # untouched slots stay NaN
        v_buffer = torch.full(shape, float("nan"), dtype=dtype)
        cache_loc = torch.randperm(slots)[:T]
        arg = sglang.FusedSetKVBufferArg(value, k_buffer, v_buffer, None, None, cache_loc)
        w_arg = sglang.FusedSetKVBufferArg(want[:, (Hq + Hk) * hs :], k_buffer.double(),
                                           v_buffer.double(), None, None, cache_loc)
    peers.sglang_apply_rope_with_cos_sin_cache_inplace(
        positions, want[:, : Hq * hs], want[:, Hq * hs : (Hq + Hk) * hs], hs, cache, is_neox, w_arg)
    assert sglang.apply_rope_with_cos_sin_cache_inplace(positions, query, key, hs, cache, is_neox,
                                                        arg) is None
    check(qkv, want, dtype)
    if fused is not None:
        check(arg.k_buffer, w_arg.k_buffer, dtype)
        check(arg.v_buffer, w_arg.v_buffer, dtype)


def test_sglang_gradients_without_cache_store():
    cache, positions = cos_sin_cache(20, 8, torch.float64), torch.randint(0, 20, (4,))

    def fn(qkv):
        qkv = qkv * 1
        sglang.apply_rope_with_cos_sin_cache_inplace(positions, qkv[:, :16], qkv[:, 16:24], 8, cache.float(),
                                                     False)
        return qkv

    qkv = torch.randn(4, 32, dtype=torch.float32, requires_grad=True)
    out = fn(qkv)
    (out * torch.arange(32.0)).sum().backward()
    # The gradient is the inverse rotation of the incoming one; v's passes through unchanged.
    assert torch.equal(qkv.grad[:, 24:], torch.arange(24.0, 32).expand(4, 8))
    g = torch.arange(32.0).expand(4, 32).clone()
    want = g.clone()
    half = cache.float()[positions]
    inverse = torch.cat((half[:, :4], -half[:, 4:]), -1)  # rotation by the negative angle
    peers.vllm_rotary_embedding(torch.arange(4), want[:, :16], want[:, 16:24], 8, inverse, False)
    torch.testing.assert_close(qkv.grad, want, rtol=1e-5, atol=1e-5)


def test_sglang_fp8_buffers():
    T, Hk, hs = 5, 2, 16
    query, key, value = torch.randn(T, 2 * hs), torch.randn(T, Hk * hs), torch.randn(T, Hk * hs)
    k_buffer = torch.zeros(8, Hk, hs, dtype=torch.float8_e4m3fn)
    v_buffer = torch.zeros(8, Hk, hs, dtype=torch.float8_e4m3fn)
    cache, positions = cos_sin_cache(30, hs), torch.randint(0, 30, (T,))
    loc = torch.tensor([7, 0, 3, 5, 1])
    rotated = key.clone()
    peers.vllm_rotary_embedding(positions, query.clone(), rotated, hs, cache, True)
    arg = sglang.FusedSetKVBufferArg(value, k_buffer, v_buffer, 0.5, 2.0, loc)
    sglang.apply_rope_with_cos_sin_cache_inplace(positions, query, key, hs, cache, True, arg)
    # SGLang's set_kv_buffer for float8 pools: value / scale, converted.
    assert torch.equal(k_buffer[loc].view(T, -1).float(), (rotated / 0.5).to(torch.float8_e4m3fn).float())
    assert torch.equal(v_buffer[loc].view(T, -1).float(), (value / 2.0).to(torch.float8_e4m3fn).float())
    assert torch.equal(k_buffer[[2, 4, 6]].float(), torch.zeros(3, Hk, hs))


def test_sglang_fp8_scales_are_each_calls_own():
    # The scale tensors are cached by value: every call must still store with its own scales,
    # 0.0 and -0.0 (equal as cache keys) included.
    T, Hk, hs = 4, 2, 16
    cache, positions = cos_sin_cache(30, hs), torch.randint(0, 30, (T,))
    big = torch.finfo(torch.float8_e4m3fn).max
    for k_scale, v_scale in ((0.5, 2.0), (2.0, 0.5), (None, 0.25), (0.0, -0.0), (-0.0, 0.0)):
        query, key, value = torch.randn(T, 2 * hs), torch.randn(T, Hk * hs), torch.randn(T, Hk * hs)
        k_buffer = torch.zeros(T, Hk, hs, dtype=torch.float8_e4m3fn)
        v_buffer = torch.zeros_like(k_buffer)
        rotated = key.clone()
        peers.vllm_rotary_embedding(positions, query.clone(), rotated, hs, cache, True)
        arg = sglang.FusedSetKVBufferArg(value, k_buffer, v_buffer, k_scale, v_scale, torch.arange(T))
        sglang.apply_rope_with_cos_sin_cache_inplace(positions, query, key, hs, cache, True, arg)
        for buf, x, scale in ((k_buffer, rotated, k_scale), (v_buffer, value, v_scale)):
            want = (x / (1.0 if scale is None else scale)).clamp(-big, big).to(torch.float8_e4m3fn)
            assert torch.equal(buf.view(T, -1).float(), want.float()), (k_scale, v_scale)


def test_sglang_errors_change_nothing():
    query, key = torch.randn(4, 32), torch.randn(4, 16)
    q0 = query.clone()
    buf = torch.zeros(6, 16)
    arg = sglang.FusedSetKVBufferArg(torch.randn(4, 16), buf, buf.clone(), 1.0, None, torch.arange(4))
    with pytest.raises(ValueError, match="cos_sin_cache should be float32"):
        sglang.apply_rope_with_cos_sin_cache_inplace(torch.arange(4), query, key, 16,
                                                     cos_sin_cache(8, 16, torch.bfloat16))
    with pytest.raises(ValueError, match="k_scale and v_scale must be None"):
        sglang.apply_rope_with_cos_sin_cache_inplace(torch.arange(4), query, key, 16, cos_sin_cache(8, 16),
                                                     True, arg)
    assert torch.equal(query, q0) and torch.equal(buf, torch.zeros(6, 16))
    # the fused store's arguments named as SGLang names them
    value, loc = torch.randn(4, 16), torch.tensor([0, 5, 2, -1])
    for k_buffer, v_buffer, cache_loc, error, fragment in (
            (buf, buf.clone(), torch.tensor([0, 1, 7, -1]), RuntimeError,
             r"cache_loc must lie below k_buffer.size\(0\) = 6 \(negative: padding, skipped\), got 7"),
            (buf, buf.clone(), torch.tensor([0, 1, 0, -1]), RuntimeError,
             "cache_loc must not repeat a slot"),
            (buf, buf.clone(), loc.float(), ValueError, "cache_loc must be an int32 or int64 tensor"),
            (buf, buf.clone(), loc[:3], ValueError, r"cache_loc must have shape \[4\]"),
            (torch.zeros(6, 32), torch.zeros(6, 32), loc, ValueError,
             r"k_buffer must have shape .* with num_kv_heads = 1 \(key's\) and head_size = 16, "
             r"got \[6, 32\]"),
            (buf.bfloat16(), buf.bfloat16(), loc, ValueError,
             r"k_buffer and v_buffer must have key's dtype \(torch.float32\) or a float8 one"),
            (buf, torch.zeros(5, 16), loc, ValueError, "v_buffer must have k_buffer's num_slots = 6")):
        arg = sglang.FusedSetKVBufferArg(value, k_buffer, v_buffer, None, None, cache_loc)
        before = (k_buffer.clone(), v_buffer.clone())
        with pytest.raises(error, match=fragment):
            sglang.apply_rope_with_cos_sin_cache_inplace(torch.arange(4), query, key, 16,
                                                         cos_sin_cache(8, 16), True, arg)
        assert torch.equal(query, q0) and torch.equal(k_buffer, before[0])
        assert torch.equal(v_buffer, before[1])


@pytest.mark.parametrize("how", ["fake_mode", "make_fx"])
def test_compat_caches_keep_no_traced_tensors(how, monkeypatch):
    # The drop-ins' caches (FlashInfer's frequencies, float32 scalars, SGLang's kept table) skip
    # traces: a fake trace then an eager call, and an eager call then a fake trace, both run.
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    from rope_ext.compat import _layout

    monkeypatch.setattr(_layout, "_TABLES", {})  # room for this test's sets
    q, k, pos = torch.randn(5, 4, 16), torch.randn(5, 2, 16), torch.arange(5)
    qkv = torch.randn(5, 4 * 16)
    w = torch.randn(16)
    theta = 1000.0 + torch.rand(()).item()  # keys no earlier call cached

    def calls(q, k, pos, qkv, w):
        flashinfer.apply_rope_pos_ids(q, k, pos, rope_theta=theta)
        sglang.fused_qk_norm_rope(qkv, 2, 1, 1, 16, 1e-6, w, w, theta, True, pos, 1.0, 0.0,
                                  0.0, 1.0)
        return q, k, qkv

    for first_eager in (False, True):
        if first_eager:
            calls(q.clone(), k.clone(), pos, qkv.clone(), w)
        if how == "fake_mode":
            with FakeTensorMode() as mode:
                calls(*(mode.from_tensor(t) for t in (q, k, pos, qkv, w)))
                _layout.float32_scalar(theta, torch.device("cpu"))
        else:
            make_fx(calls, tracing_mode="fake")(q, k, pos, qkv, w)
        a = calls(q.clone(), k.clone(), pos, qkv.clone(), w)
        assert type(_layout.float32_scalar(theta, torch.device("cpu"))) is torch.Tensor
        assert all(type(t) is torch.Tensor for t in _layout._TABLES.values())
        b = calls(q.clone(), k.clone(), pos, qkv.clone(), w)
        assert all(torch.equal(x, y) for x, y in zip(a, b))
        theta += 1.0


def test_compat_tables_follow_the_inputs_not_the_default_device(monkeypatch):
    # A call under `with torch.device("meta")` (or set_default_device) with CPU tensors: the
    # drop-ins' own tables (SGLang's cached per-position set, FlashInfer's Llama 3.1 blend) are
    # made on the inputs' device, and a cached table stays usable after the context.
    from rope_ext.compat import _layout

    monkeypatch.setattr(_layout, "_TABLES", {})
    qkv, w, pos = torch.randn(4, 4 * 8), torch.randn(8), torch.arange(4)
    q, k = torch.randn(4, 2, 64), torch.randn(4, 1, 64)
    kw = dict(rope_scale=8, rope_theta=5e5, low_freq_factor=1, high_freq_factor=4,
              old_context_len=64)

    def calls():
        x = qkv.clone()
        sglang.fused_qk_norm_rope(x, 2, 1, 1, 8, 1e-6, w, w, 1e4, True, pos, 1.0, 0.0, 0.0, 1.0)
        return (x, *flashinfer.apply_llama31_rope_pos_ids(q, k, pos, **kw))

    with torch.device("meta"):
        inside = calls()
    outside = calls()
    assert all(t.device.type == "cpu" for t in _layout._TABLES.values())
    assert all(a.device.type == "cpu" and torch.equal(a, b) for a, b in zip(inside, outside))
