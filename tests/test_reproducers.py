"""Reproducers of inputs that once gave a silent wrong result or a wrong error, each now held on
every path: the native op, the reference, and the CUDA host and thread code in the simulator."""

import pytest
import torch

import cuda_sim
import rope_ext
from conftest import assert_close
from rope_oracle import rope as oracle

PARTIAL = "some elements of the input tensor and the written-to tensor refer to a single memory location"


# ---- rope.apply_and_cache_: scales, repeated slots ----

def _op_cache(*args, **kw):
    torch.ops.rope.apply_and_cache_(*args, kw.get("interleaved", False), kw.get("kv_cache_dtype", "auto"),
                                    kw.get("k_scale"), kw.get("v_scale"))


CACHE_OPS = {"op": _op_cache, "reference": rope_ext.reference.apply_and_cache_,
             "cuda_host": lambda *a, **kw: cuda_sim.apply_and_cache_(
                 *a, kw.get("interleaved", False), kw.get("kv_cache_dtype", "auto"), kw.get("k_scale"),
                 kw.get("v_scale"))}


def _cache_inputs(T=6, fp8=False):
    q, k, v = torch.randn(T, 2, 16), torch.randn(T, 1, 16), torch.randn(T, 1, 8)
    dt = torch.float8_e4m3fn if fp8 else torch.float32
    kc, vc = torch.zeros(4, 4, 1, 16, dtype=dt), torch.zeros(4, 4, 1, 8, dtype=dt)
    return q, k, v, torch.randint(0, 8, (T,)), rope_ext.cos_sin_cache(8, 16), kc, vc


def _unchanged(before, after):
    return all(torch.equal(a.view(torch.uint8) if a.dtype.itemsize == 1 else a,
                           b.view(torch.uint8) if b.dtype.itemsize == 1 else b)
               for a, b in zip(before, after))


@pytest.mark.parametrize("impl", list(CACHE_OPS))
@pytest.mark.parametrize("owner", ["query", "key"])
def test_fp8_scale_sharing_memory_with_a_written_tensor_is_refused(impl, owner):
    # The kernels read the scale before rotating, the reference after: no order is right.
    q, k, v, pos, cache, kc, vc = _cache_inputs(fp8=True)
    scale = (q if owner == "query" else k).view(-1)[3:4]
    scale.fill_(0.5)
    before = [t.clone() for t in (q, k, kc, vc)]
    for kw in ({"k_scale": scale, "v_scale": torch.ones(1)}, {"k_scale": torch.ones(1), "v_scale": scale}):
        name = "k_scale" if kw["k_scale"] is scale else "v_scale"
        with pytest.raises(RuntimeError, match=f"rope.apply_and_cache_: {name} and {owner}: .*{PARTIAL}"):
            CACHE_OPS[impl](q, k, v, pos, cache, kc, vc, torch.arange(6), kv_cache_dtype="fp8", **kw)
        assert _unchanged(before, (q, k, kc, vc))


@pytest.mark.parametrize("impl", list(CACHE_OPS))
def test_scale_inside_a_cache_is_refused(impl):
    q, k, v, pos, cache, kc, vc = _cache_inputs(fp8=False)
    with pytest.raises(RuntimeError, match=f"v_scale and value_cache: .*{PARTIAL}"):
        CACHE_OPS[impl](q, k, v, pos, cache, kc, vc, torch.arange(6), k_scale=torch.ones(1),
                        v_scale=vc.view(-1)[:1])


@pytest.mark.parametrize("impl", list(CACHE_OPS))
@pytest.mark.parametrize("bad,msg", [
    (torch.ones(2), "k_scale must be a float32 tensor of one element, got Float of shape \\[2\\]"),
    (torch.ones(1, dtype=torch.float16), "k_scale must be a float32 tensor of one element, got Half"),
])
def test_scales_are_checked_with_kv_cache_dtype_auto(impl, bad, msg):
    q, k, v, pos, cache, kc, vc = _cache_inputs()
    with pytest.raises(RuntimeError, match=f"rope.apply_and_cache_: {msg}"):
        CACHE_OPS[impl](q, k, v, pos, cache, kc, vc, torch.arange(6), k_scale=bad, v_scale=None)
    # One-element float32 scales are accepted (vLLM passes them for every cache dtype), unused.
    want = [t.clone() for t in (q, k, v, pos, cache, kc, vc)]
    rope_ext.reference.apply_and_cache_(*want, torch.arange(6))
    CACHE_OPS[impl](q, k, v, pos, cache, kc, vc, torch.arange(6), k_scale=torch.full((1,), 3.0),
                    v_scale=torch.full((1,), 3.0))
    assert torch.equal(kc, want[5]) and torch.equal(vc, want[6])


@pytest.mark.parametrize("impl", list(CACHE_OPS))
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_a_slot_used_by_two_tokens_is_refused_before_any_write(impl, dtype):
    # A dummy padding slot >= 0 shared by several tokens: the threads would race on its row.
    q, k, v, pos, cache, kc, vc = _cache_inputs()
    slots = torch.tensor([5, -1, 2, 9, 2, 5], dtype=dtype)  # 5 at 0 and 5, 2 at 2 and 4
    before = [t.clone() for t in (q, k, kc, vc)]
    msg = "device-side assert triggered: rope: slot_mapping must not repeat a slot" if impl == "cuda_host" \
        else r"rope.apply_and_cache_: slot_mapping must not repeat a slot \(negative: padding, skipped\), " \
             "got 2 at indices 2 and 4"
    with pytest.raises(RuntimeError, match=msg):
        CACHE_OPS[impl](q, k, v, pos, cache, kc, vc, slots)
    assert _unchanged(before, (q, k, kc, vc))
    # Padding (-1) repeated is fine, as is a permutation of distinct slots.
    slots = torch.tensor([-1, 3, -1, 15, 0, -1], dtype=dtype)
    want = [t.clone() for t in (q, k, v, pos, cache, kc, vc, slots)]
    rope_ext.reference.apply_and_cache_(*want)
    CACHE_OPS[impl](q, k, v, pos, cache, kc, vc, slots)
    assert_close(kc, want[5], torch.float32)
    assert_close(vc, want[6], torch.float32)


@pytest.mark.parametrize("cache_blocks", ["few", "many"])
@pytest.mark.parametrize("tokens", [(2, 33), (33, 300)])
def test_every_repeated_slot_is_found_among_many_tokens(cache_blocks, tokens):
    # Many tokens through the simulated device set (collisions in its hash), one repeat each time;
    # on CPU up to 32 tokens are compared pairwise, more with a cache of few slots beside them
    # take a bitmap, with one of many a sort.
    for _ in range(4):
        T = int(torch.randint(*tokens, ()))
        # many blocks: keys of head_dim 0 and values of one element, little memory for the rows
        # (not none: with rows of 0 elements alone no kernel runs, and the host checks)
        blocks = T if cache_blocks == "few" else 2**20
        slots = torch.randperm(4 * blocks)[:T]
        i, j = sorted(torch.randperm(T)[:2].tolist())
        slots[j] = slots[i]
        d, dv = (4, 4) if cache_blocks == "few" else (0, 1)
        q, k, v = torch.randn(T, 1, d), torch.randn(T, 1, d), torch.randn(T, 1, dv)
        kc, vc = torch.zeros(blocks, 4, 1, d), torch.zeros(blocks, 4, 1, dv)
        pos, cache = torch.zeros(T, dtype=torch.long), rope_ext.cos_sin_cache(1, 4)[:, :d]
        for impl, msg in (("op", f"got {int(slots[i])} at indices {i} and {j}"),
                          ("reference", f"got {int(slots[i])} at indices {i} and {j}"),
                          ("cuda_host", "rope: slot_mapping must not repeat a slot")):
            with pytest.raises(RuntimeError, match=msg):
                CACHE_OPS[impl](q, k, v, pos, cache, kc, vc, slots)


# ---- an odd rotary_dim: transformers' rule everywhere ----

def _neox_config(**kw):
    pytest.importorskip("transformers")
    from transformers import GPTNeoXConfig
    return GPTNeoXConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=1, intermediate_size=64,
                         vocab_size=50, max_position_embeddings=32, **kw)


def test_odd_rotary_dim_rotates_as_transformers_does():
    # partial_rotary_factor 0.6875 of head_dim 16: d = 11; transformers builds 6 frequencies
    # base^(-2i/11) and rotates 12 dims.
    cfg = _neox_config(rotary_pct=0.6875)
    from transformers.models.gpt_neox import modeling_gpt_neox as neox
    hf = neox.GPTNeoXRotaryEmbedding(cfg)
    q, k = torch.randn(2, 4, 9, 16, dtype=torch.float64), torch.randn(2, 4, 9, 16, dtype=torch.float64)
    pos = torch.randint(0, 32, (2, 9))
    cos, sin = hf(q, pos)
    want_q, want_k = neox.apply_rotary_pos_emb(q, k, cos.double(), sin.double())
    for module in (rope_ext.RotaryEmbedding.from_config(cfg), rope_ext.RotaryEmbedding(16, rotary_dim=11, max_position=32)):
        assert module.rotary_dim == 12 and module.cos_sin_cache.shape == (32, 12)
        c, s = module.cos_sin(pos)
        assert c.shape == s.shape == (2, 9, 6)
        assert_close(c, cos[..., :6], torch.float32)
        assert_close(s, sin[..., :6], torch.float32)  # no cosine among the sines
        got_q, got_k = module(q.transpose(1, 2), k.transpose(1, 2), pos)
        # Against float64 math with transformers' frequencies, to float32's tolerance (the table is
        # float32); transformers' own float32 angles are within a few 1e-6 of it.
        angles = pos.double()[..., None] * 10000.0 ** (-torch.arange(0, 11, 2, dtype=torch.float64) / 11)
        cos64, sin64 = angles.cos()[:, None], angles.sin()[:, None]
        assert_close(got_q.transpose(1, 2), oracle(q, cos64, sin64, False), torch.float32)
        assert_close(got_k.transpose(1, 2), oracle(k, cos64, sin64, False), torch.float32)
        torch.testing.assert_close(got_q.transpose(1, 2), want_q, rtol=1e-5, atol=2e-5)
        torch.testing.assert_close(got_k.transpose(1, 2), want_k, rtol=1e-5, atol=2e-5)
    table = rope_ext.cos_sin_cache(32, 11)
    assert torch.equal(table, rope_ext.RotaryEmbedding(16, rotary_dim=11, max_position=32).cos_sin_cache)


def test_odd_rotary_dim_that_rounds_past_head_dim_is_refused():
    with pytest.raises(ValueError, match=r"RotaryEmbedding: rotary_dim must be in \(0, head_dim=15\]"):
        rope_ext.RotaryEmbedding(15)
    with pytest.raises(ValueError, match="cos_sin_cache: rotary_dim must be a positive int, got 0"):
        rope_ext.cos_sin_cache(8, 0)


def test_rotary_pct_zero_runs_in_the_patched_transformers_model():
    cfg = _neox_config(rotary_pct=0.0)
    from transformers import GPTNeoXForCausalLM
    from rope_ext.integrations.transformers import patch
    model = GPTNeoXForCausalLM(cfg).eval()
    ids = torch.randint(0, 50, (2, 7))
    with torch.no_grad():
        want = model(ids).logits
        patch(model)
        got = model(ids).logits
    assert_close(got, want, torch.float32)


@pytest.mark.parametrize("grad", [False, True])
def test_drop_in_with_cos_sin_of_width_zero_passes_through(grad):
    from rope_ext.compat.transformers import apply_rotary_pos_emb
    q = torch.randn(2, 3, 5, 8, dtype=torch.float16, requires_grad=grad)
    k = torch.randn(2, 1, 5, 8, dtype=torch.float16)
    cos = torch.empty(2, 5, 0, requires_grad=grad)
    qo, ko = apply_rotary_pos_emb(q, k, cos, cos.detach())
    assert qo.dtype == ko.dtype == torch.float32  # transformers promotes with the tables
    assert torch.equal(qo, q.float()) and torch.equal(ko, k.float())
    if grad:
        qo.sum().backward()
        assert torch.equal(q.grad, torch.ones_like(q))


# ---- varlen_positions: both ends of the batch alike, arguments checked ----

def test_tokens_before_the_first_sequence_get_no_position():
    cu = torch.tensor([2, 4, 7], dtype=torch.int32)
    pos = rope_ext.varlen_positions(cu, 9, 5)
    assert pos.tolist() == [-1, -1, 5, 6, 5, 6, 7, -1, -1]
    pos = rope_ext.varlen_positions(cu, 9, torch.tensor([1, 3]))
    assert pos.tolist() == [-1, -1, 1, 2, 3, 4, 5, -1, -1]


def test_flash_attn_varlen_refuses_tokens_before_the_first_sequence():
    from rope_ext.compat import flash_attn
    cos, sin = rope_ext.cos_sin_cache(16, 8).chunk(2, dim=-1)
    x = torch.randn(7, 2, 8)
    before = x.clone()
    for inplace in (False, True):
        with pytest.raises(RuntimeError, match=r"positions must lie in \[0, 16\).*got -1 at flat index 0"):
            flash_attn.apply_rotary_emb(x, cos, sin, inplace=inplace, cu_seqlens=torch.tensor([2, 4, 7], dtype=torch.int32),
                                        max_seqlen=3)
        assert torch.equal(x, before)
    # The same batch from 0 rotates every token.
    out = flash_attn.apply_rotary_emb(x, cos, sin, cu_seqlens=torch.tensor([0, 4, 7], dtype=torch.int32), max_seqlen=4)
    want = rope_ext.reference.apply_positions(x, torch.tensor([0, 1, 2, 3, 0, 1, 2]), cos, sin)
    assert_close(out, want, torch.float32)


@pytest.mark.parametrize("args,msg", [
    ((torch.tensor([0, 1, 1], dtype=torch.bool), 2), r"cu_seqlens must be a 1-D int32 or int64 tensor .* got torch.bool"),
    ((torch.tensor([0.0, 2.0]), 2), "cu_seqlens must be a 1-D int32 or int64 tensor"),
    ((torch.tensor([0, 2]), -1), "total_tokens must be >= 0, got -1"),
    ((torch.tensor([0, 2]), 2.0), "total_tokens must be an int, got 2.0"),
    ((torch.tensor([0, 2]), True), "total_tokens must be an int, got True"),
    ((torch.tensor([0, 2]), 2, 1.7), "seqlen_offsets must be an int, got 1.7"),
    ((torch.tensor([0, 2]), 2, torch.tensor([1.5])), "seqlen_offsets must be an int or an int32/int64 tensor"),
    ((torch.tensor([0, 2]), 2, 2**64), "seqlen_offsets must fit in int64"),
])
def test_varlen_positions_rejects_bad_arguments_by_name(args, msg):
    with pytest.raises(ValueError, match=msg):
        rope_ext.varlen_positions(*args)


def test_varlen_positions_int32_refuses_positions_that_wrap():
    cu = torch.tensor([0, 3])
    with pytest.raises(ValueError, match=r"varlen_positions: position 4294967299 of token 0 does not fit dtype int32"):
        rope_ext.varlen_positions(cu, 3, 2**32 + 3, dtype=torch.int32)
    with pytest.raises(ValueError, match="position 2147483648 of token 1"):
        rope_ext.varlen_positions(cu, 3, 2**31 - 1, dtype=torch.int32)
    assert rope_ext.varlen_positions(cu, 3, 2**31 - 3, dtype=torch.int32).tolist() == [2**31 - 3, 2**31 - 2, 2**31 - 1]
    assert rope_ext.varlen_positions(cu, 3, 2**32 + 3).tolist() == [2**32 + 3, 2**32 + 4, 2**32 + 5]


def test_varlen_positions_refuses_positions_past_int64():
    """Offset plus the token's place in its sequence past 2^63 - 1 wrapped to -2^63 (once)."""
    cu = torch.tensor([0, 3])
    for offsets in (2**63 - 2, torch.tensor([2**63 - 2])):
        with pytest.raises(ValueError, match=r"the position of token 2 \(its offset plus 2\) does not fit int64"):
            rope_ext.varlen_positions(cu, 3, offsets)
    top = [2**63 - 3, 2**63 - 2, 2**63 - 1]
    assert rope_ext.varlen_positions(cu, 3, 2**63 - 3).tolist() == top
    assert rope_ext.varlen_positions(cu, 3, torch.tensor([2**63 - 3])).tolist() == top
    # a token outside every sequence is -1, whatever its offset would give
    assert rope_ext.varlen_positions(torch.tensor([1, 3]), 4, 2**63 - 2).tolist() == [-1, 2**63 - 2, 2**63 - 1, -1]
    assert rope_ext.varlen_positions(cu, 3, -2**63).tolist() == [-2**63, -2**63 + 1, -2**63 + 2]


# ---- FlashInfer's pos_ids entry points under torch.compile(fullgraph=True) ----

@pytest.mark.parametrize("name", ["apply_rope_pos_ids", "apply_llama31_rope_pos_ids",
                                  "apply_rope_pos_ids_inplace", "apply_rope"])
def test_flashinfer_entry_points_compile_without_graph_break(name):
    from rope_ext.compat import flashinfer
    torch._dynamo.reset()
    fn = getattr(flashinfer, name)
    q, k = torch.randn(6, 4, 32), torch.randn(6, 2, 32)
    pos = torch.tensor([0, 5, 2, 9, 1, 3])
    extra = (torch.tensor([0, 2, 6]), torch.tensor([1, 4])) if name == "apply_rope" else (pos,)

    def step(q, k, *extra):
        out = fn(q, k, *extra, rotary_dim=16)
        return (q, k) if out is None else out

    want = step(q.clone(), k.clone(), *extra)
    got = torch.compile(step, fullgraph=True)(q.clone(), k.clone(), *extra)
    for g, w in zip(got, want):
        assert_close(g, w, torch.float32)
