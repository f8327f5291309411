"""rope.mrope_ / rope_ext.apply_mrope_: multimodal RoPE (Qwen2-VL family)."""

import os
import subprocess
import sys

import pytest
import torch

import rope_ext

from conftest import TOL

IMPLS = {
    "op": rope_ext.apply_mrope_,  # torch.ops.rope.mrope_: the native kernel when built
    "reference": rope_ext.reference.apply_mrope_,
}


def expected_mrope(x, positions, sections, rotary_dim, interleaved, base=10000.0):
    """float64 from first principles: pair i of token t turns by positions[j(i), t] * w_i,
    j(i) the section holding i."""
    half = rotary_dim // 2
    w = base ** (-torch.arange(half, dtype=torch.float64) * 2 / rotary_dim)
    comp = torch.repeat_interleave(torch.arange(3), torch.tensor(sections))  # (half,)
    pos = positions.double()[comp]  # (half, *lead)
    ang = pos.movedim(0, -1) * w  # (*lead, half)
    c, s = ang.cos().unsqueeze(-2), ang.sin().unsqueeze(-2)
    x = x.double()
    if interleaved:
        a, b = x[..., 0:rotary_dim:2], x[..., 1:rotary_dim:2]
    else:
        a, b = x[..., :half], x[..., half:rotary_dim]
    oa, ob = a * c - b * s, b * c + a * s
    rot = torch.stack((oa, ob), -1).flatten(-2) if interleaved else torch.cat((oa, ob), -1)
    return torch.cat((rot, x[..., rotary_dim:]), -1)


def hf_qwen2vl(q, positions, sections, rotary_dim, base=10000.0):
    """The Qwen2-VL formulation (half-split, rotate_half, cos/sin built per component and the
    sections picked from the doubled cos), q as (*lead, H, D) with rotary_dim == D."""
    inv = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    freqs = positions.double()[..., None] * inv  # (3, *lead, D/2)
    emb = torch.cat((freqs, freqs), -1)
    cos, sin = emb.cos(), emb.sin()
    split = list(sections) * 2
    cos = torch.cat([m[i % 3] for i, m in enumerate(cos.split(split, dim=-1))], -1).unsqueeze(-2)
    sin = torch.cat([m[i % 3] for i, m in enumerate(sin.split(split, dim=-1))], -1).unsqueeze(-2)

    def rotate_half(x):
        x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
        return torch.cat((-x2, x1), -1)

    q = q.double()
    return q * cos + rotate_half(q) * sin


def make_case(lead, hq, hk, head_dim, rotary_dim, dtype, max_position=97, pos_dtype=torch.int64):
    q = torch.randn(*lead, hq, head_dim, dtype=dtype)
    k = torch.randn(*lead, hk, head_dim, dtype=dtype) if hk else None
    pos = torch.randint(0, max_position, (3, *lead), dtype=pos_dtype)
    cache = rope_ext.cos_sin_cache(max_position, rotary_dim, dtype=torch.float32 if dtype != torch.float64 else torch.float64)
    return q, k, pos, cache


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize(
    "lead, hq, hk, head_dim, rotary_dim, sections",
    [
        ((11,), 4, 2, 32, 32, [4, 6, 6]),
        ((2, 5), 3, 1, 64, 32, [4, 6, 6]),  # partial rotary, [B, S, H, D]
        ((9,), 2, 0, 16, 16, [0, 5, 3]),  # key None, an empty section
        ((3, 4), 2, 2, 128, 128, [16, 24, 24]),  # Qwen2-VL's split
    ],
)
def test_matches_float64(impl, dtype, interleaved, lead, hq, hk, head_dim, rotary_dim, sections):
    q, k, pos, cache = make_case(lead, hq, hk, head_dim, rotary_dim, dtype)
    q0 = q.clone()
    k0 = None if k is None else k.clone()
    IMPLS[impl](q, k, pos, cache, sections, interleaved=interleaved)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(q.double(), expected_mrope(q0, pos, sections, rotary_dim, interleaved), rtol=rtol, atol=atol)
    assert torch.equal(q[..., rotary_dim:], q0[..., rotary_dim:])
    if k is not None:
        torch.testing.assert_close(k.double(), expected_mrope(k0, pos, sections, rotary_dim, interleaved), rtol=rtol, atol=atol)
        assert torch.equal(k[..., rotary_dim:], k0[..., rotary_dim:])


@pytest.mark.parametrize("impl", IMPLS)
def test_matches_qwen2vl_formulation(impl):
    q = torch.randn(2, 6, 4, 128, dtype=torch.float64)
    pos = torch.randint(0, 500, (3, 2, 6))
    cache = rope_ext.cos_sin_cache(500, 128, dtype=torch.float64)
    want = hf_qwen2vl(q, pos, [16, 24, 24], 128)
    IMPLS[impl](q, None, pos, cache, [16, 24, 24])
    torch.testing.assert_close(q, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_text_tokens_are_exactly_plain_rope(impl, interleaved, dtype):
    q, k, _, cache = make_case((13,), 4, 2, 64, 48, dtype)
    p = torch.randint(0, 97, (13,))
    pos = p.expand(3, 13)
    q1, k1, q2, k2 = q.clone(), k.clone(), q.clone(), k.clone()
    IMPLS[impl](q1, k1, pos, cache, [8, 8, 8], interleaved=interleaved)
    plain = rope_ext.apply_rope_ if impl == "op" else rope_ext.reference.apply_rope_
    plain(q2, k2, p, cache, interleaved=interleaved)
    assert torch.equal(q1, q2) and torch.equal(k1, k2)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("pos_dtype", [torch.int32, torch.int64])
def test_strided_views_and_int32(impl, pos_dtype):
    # q/k as slices of a fused qkv buffer; positions a non-contiguous view; cache a column view.
    T, Hq, Hk, D = 10, 4, 2, 32
    qkv = torch.randn(T, (Hq + 2 * Hk) * D)
    q = qkv[:, : Hq * D].view(T, Hq, D)
    k = qkv[:, Hq * D : (Hq + Hk) * D].view(T, Hk, D)
    pos = torch.randint(0, 50, (T, 3), dtype=pos_dtype).t()
    wide = rope_ext.cos_sin_cache(50, 32)
    q0, k0 = q.clone(), k.clone()
    v0 = qkv[:, (Hq + Hk) * D :].clone()
    IMPLS[impl](q, k, pos, wide, [4, 4, 8], interleaved=True)
    torch.testing.assert_close(q.double(), expected_mrope(q0, pos, [4, 4, 8], 32, True), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(k.double(), expected_mrope(k0, pos, [4, 4, 8], 32, True), rtol=1e-6, atol=1e-6)
    assert torch.equal(qkv[:, (Hq + Hk) * D :], v0)  # v untouched


def test_non_unit_stride_head_dim():
    q = torch.randn(6, 2, 64)[..., ::2]  # head_dim 32 with stride 2
    pos = torch.randint(0, 40, (3, 6))
    cache = rope_ext.cos_sin_cache(40, 16)
    q0 = q.clone()
    rope_ext.apply_mrope_(q, None, pos, cache, [2, 3, 3])
    torch.testing.assert_close(q.double(), expected_mrope(q0, pos, [2, 3, 3], 16, False), rtol=1e-6, atol=1e-6)


BAD = [
    ("sections_sum", r"rope.mrope_: mrope_section \[4, 4, 4\] must sum to rotary_dim/2 = cos_sin_cache.size\(1\)/2 = 8, got 12"),
    ("sections_len", r"rope.mrope_: mrope_section must have 3 entries \(temporal, height, width\), got \[4, 4\]"),
    ("sections_neg", r"rope.mrope_: mrope_section entries must be >= 0, got \[10, -2, 0\]"),
    ("positions_2d", r"rope.mrope_: positions must have shape \(3,\) \+ query.shape\[:-2\] .*got \[5\]"),
    ("positions_comp", r"rope.mrope_: positions must have shape \(3,\) \+ query.shape\[:-2\] .*got \[2, 5\]"),
    ("positions_len", r"rope.mrope_: positions must have shape \(3,\) \+ query.shape\[:-2\] .*got \[3, 4\]"),
    ("positions_float", r"rope.mrope_: positions must be int32 or int64, got Float"),
    ("positions_range", r"rope.mrope_: positions must lie in \[0, 20\) .*got 20 at flat index 7"),
    ("positions_negative", r"rope.mrope_: positions must lie in \[0, 20\) .*got -1 at flat index 14"),
    ("key_heads_dim", r"rope.mrope_: key must have shape \(..., num_kv_heads, head_dim\)"),
    ("rotary_too_big", r"rope.mrope_: rotary_dim = cos_sin_cache.size\(1\) = 32 must be even and <= head_dim = 16"),
    ("int_query", r"rope.mrope_: query must be float16, bfloat16, float32 or float64, got Long"),
    ("query_1d", r"rope.mrope_: query must have shape \(\.\.\., num_heads, head_dim\), got \[16\]"),
    ("key_dtype", r"rope.mrope_: key must have the dtype of query \(Float\), got Double"),
    ("cache_int", r"rope.mrope_: cos_sin_cache must be float16, bfloat16, float32 or float64, got Long"),
    ("device", r"rope.mrope_: positions must be on the same device as query \(cpu\), got meta"),
]


def bad_case(case):
    q = torch.randn(5, 2, 16)
    k = torch.randn(5, 1, 16)
    pos = torch.randint(0, 20, (3, 5))
    cache = rope_ext.cos_sin_cache(20, 16)
    sections = [2, 3, 3]
    if case == "sections_sum":
        sections = [4, 4, 4]
    elif case == "sections_len":
        sections = [4, 4]
    elif case == "sections_neg":
        sections = [10, -2, 0]
    elif case == "positions_2d":
        pos = pos[0]
    elif case == "positions_comp":
        pos = pos[:2]
    elif case == "positions_len":
        pos = pos[:, :4]
    elif case == "positions_float":
        pos = pos.float()
    elif case == "positions_range":
        pos[1, 2] = 20
    elif case == "positions_negative":
        pos[2, 4] = -1
    elif case == "key_heads_dim":
        k = torch.randn(5, 1, 8)
    elif case == "rotary_too_big":
        cache = rope_ext.cos_sin_cache(20, 32)
    elif case == "int_query":
        q, k = q.long(), k.long()
    elif case == "query_1d":
        q = q[0, 0]
    elif case == "key_dtype":
        k = k.double()
    elif case == "cache_int":
        cache = cache.long()
    elif case == "device":
        pos = pos.to("meta")
    return q, k, pos, cache, sections


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case, match", BAD)
def test_bad_input_raises_and_changes_nothing(impl, case, match):
    q, k, pos, cache, sections = bad_case(case)
    q0, k0 = q.clone(), k.clone()
    with pytest.raises(RuntimeError, match=match):
        IMPLS[impl](q, k, pos, cache, sections)
    assert torch.equal(q, q0) and torch.equal(k, k0)


@pytest.mark.parametrize("case", [c for c, _ in BAD if c != "device"])
def test_native_and_reference_messages_are_identical(case):
    # The Python checks mirror csrc/ops/checks.h word for word (C++ adds a location prefix).
    messages = []
    for impl in IMPLS.values():
        q, k, pos, cache, sections = bad_case(case)
        with pytest.raises(RuntimeError) as e:
            impl(q, k, pos, cache, sections)
        msg = str(e.value)
        messages.append(msg[msg.index("rope.mrope_:"):].splitlines()[0])
    assert messages[0] == messages[1]


@pytest.mark.parametrize("impl", IMPLS)
def test_bad_position_late_in_a_large_batch_changes_nothing(impl):
    q, k = torch.randn(4000, 2, 64), torch.randn(4000, 1, 64)
    pos = torch.randint(0, 100, (3, 4000))
    pos[2, -1] = 100  # the very last value read
    q0, k0 = q.clone(), k.clone()
    with pytest.raises(RuntimeError, match="at flat index 11999"):
        IMPLS[impl](q, k, pos, rope_ext.cos_sin_cache(100, 64), [8, 12, 12])
    assert torch.equal(q, q0) and torch.equal(k, k0)


def _mrope_fn(q, k, pos, cache):
    torch.ops.rope.mrope_(q, k, pos, cache, [4, 6, 6], False)
    return q, k


def test_opcheck():
    q, k, pos, cache = make_case((2, 5), 4, 2, 48, 32, torch.float32)
    torch.library.opcheck(torch.ops.rope.mrope_.default, (q, k, pos, cache, [4, 6, 6], False))
    torch.library.opcheck(torch.ops.rope.mrope_.default, (q, None, pos, cache, [4, 6, 6], True))


def test_compile_fullgraph_matches_eager():
    q, k, pos, cache = make_case((7,), 4, 2, 32, 32, torch.float32)

    def f(q, k, pos, cache):
        q = q * 1.0
        k = k * 1.0
        rope_ext.apply_mrope_(q, k, pos, cache, [4, 6, 6])
        return q + 0.0, k + 0.0

    want = f(q, k, pos, cache)
    got = torch.compile(f, fullgraph=True, backend="inductor")(q, k, pos, cache)
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=1e-6)


def test_compile_fullgraph_module_with_mrope():
    m = rope_ext.RotaryEmbedding(32, max_position=97, mrope_section=[4, 6, 6])
    q, k, pos, _ = make_case((2, 7), 4, 2, 32, 32, torch.float32)
    want = m(q, k, pos)
    got = torch.compile(m, fullgraph=True, backend="aot_eager")(q, k, pos)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)


@pytest.mark.parametrize("mrope_interleaved", [False, True])
def test_module_text_only_positions_are_plain_rope(mrope_interleaved):
    """Positions of shape query.shape[:-2] (a text-only batch) through a module with MRoPE
    sections, chunked or interleaved (Qwen3-VL's), rotate as plain RoPE, in forward (which
    raised for interleaved sections) and forward_ alike; (3, ...) positions still take the
    sections."""
    section = [4, 6, 6]
    m = rope_ext.RotaryEmbedding(32, max_position=97, mrope_section=section,
                                 mrope_interleaved=mrope_interleaved)
    plain = rope_ext.RotaryEmbedding(32, max_position=97)
    q, k, pos, _ = make_case((2, 7), 4, 2, 32, 32, torch.float32)
    text = pos[0]
    want = plain(q, k, text)
    for got in (m(q, k, text), m.forward_(q.clone(), k.clone(), text)):
        torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
        torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)
    sectioned = rope_ext.apply_rope_at(q, pos, m._tables, mrope_section=section,
                                       mrope_interleaved=mrope_interleaved)
    torch.testing.assert_close(m(q, k, pos)[0], sectioned, rtol=0, atol=0)


def test_schema_matches_python_definition():
    from rope_ext._schemas import SCHEMAS

    assert str(torch.ops.rope.mrope_.default._schema) == "rope::" + SCHEMAS["mrope_"]


def test_reference_backend_serves_when_native_disabled():
    code = (
        "import torch, rope_ext\n"
        "assert rope_ext.backend('cpu') == 'reference'\n"
        "q = torch.randn(4, 2, 16); p = torch.tensor([[0, 1, 2, 3]] * 3)\n"
        "c = rope_ext.cos_sin_cache(8, 16)\n"
        "q2 = q.clone(); rope_ext.apply_rope_(q2, None, p[0], c)\n"
        "rope_ext.apply_mrope_(q, None, p, c, [2, 3, 3])\n"
        "assert torch.equal(q, q2)\n"
        "try:\n"
        "    rope_ext.apply_mrope_(q, None, p, c, [2, 2, 2])\n"
        "except RuntimeError as e:\n"
        "    assert 'must sum to rotary_dim/2' in str(e)\n"
        "else:\n"
        "    raise SystemExit('no error')\n"
        "print('ok')\n"
    )
    env = dict(os.environ, ROPE_EXT_BACKEND="reference")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("section", [[24, 20, 20], [8, 28, 28], [30, 2, 32]])
def test_interleaved_sections_match_qwen3_vl_modeling_code(dtype, section):
    """mrope_interleaved=True against transformers' own Qwen3-VL text rotary module (which lays
    the sections out T,H,W,T,H,W,... with apply_interleaved_mrope) and its apply_rotary_pos_emb."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen3_vl import modeling_qwen3_vl as hf

    cfg = transformers.Qwen3VLTextConfig(hidden_size=256, num_attention_heads=2, num_key_value_heads=1,
                                         head_dim=128, rope_theta=5e6, max_position_embeddings=4096,
                                         rope_scaling={"rope_type": "default", "mrope_section": section,
                                                       "mrope_interleaved": True})
    rotary = hf.Qwen3VLTextRotaryEmbedding(cfg)
    B, S = 2, 11
    positions = torch.randint(0, 300, (3, B, S))
    q = torch.randn(B, 2, S, 128, dtype=torch.float64)  # transformers' (B, H, S, D) layout
    k = torch.randn(B, 1, S, 128, dtype=torch.float64)
    cos, sin = rotary(q, positions)
    want_q, want_k = hf.apply_rotary_pos_emb(q, k, cos.double(), sin.double())
    cache = rope_ext.cos_sin_cache(300, 128, base=5e6)
    got_q = q.transpose(1, 2).to(dtype).contiguous()  # rope_ext's (B, S, H, D)
    got_k = k.transpose(1, 2).to(dtype).contiguous()
    rope_ext.apply_mrope_(got_q, got_k, positions, cache, section, mrope_interleaved=True)
    # transformers builds its angles in float32: at positions up to 300 they are off by ~1e-5.
    tol = dict(rtol=2e-4, atol=2e-4) if dtype == torch.float32 else dict(rtol=1e-2, atol=1.6e-2)
    torch.testing.assert_close(got_q.transpose(1, 2).double(), want_q, **tol)
    torch.testing.assert_close(got_k.transpose(1, 2).double(), want_k, **tol)
    # And the chunked layout is a different rotation (the flag matters).
    chunked = q.transpose(1, 2).to(dtype).contiguous()
    rope_ext.apply_mrope_(chunked, None, positions, cache, section)
    assert not torch.allclose(chunked.transpose(1, 2).double(), want_q, **tol)


def test_a_module_without_sections_names_mrope_positions():
    # from_config builds plain RoPE where a family's default sections do not fit the head: the
    # grid positions (3, T) it is then given are named as such, not as an op's shape mismatch
    module = rope_ext.RotaryEmbedding(16, max_position=32)
    q = torch.randn(4, 2, 16)
    before = q.clone()
    for call in (module, module.forward_):
        with pytest.raises(ValueError, match=r"RotaryEmbedding: positions of shape \[3, 4\] hold 3 MRoPE "
                                             r"components, but the module has no mrope_section"):
            call(q, None, torch.zeros(3, 4, dtype=torch.long))
    assert torch.equal(q, before)
    # (3, T) positions of a batch of 3 sequences are plain positions
    assert module(torch.randn(3, 4, 2, 16), None, torch.zeros(3, 4, dtype=torch.long))[0].shape == (3, 4, 2, 16)
