"""rope_dim_offset and inverse of the in-place ops (rope.apply_, rope.mrope_, the vLLM and SGLang
drop-ins): RoPE on dims [offset, offset + rotary_dim) of each head, by the negative angle with
inverse, against the float64 oracle; the other dims bit-exact; errors before anything is
written, on the native, reference and fake paths alike; autograd (the gradient of the inverse
rotation is the forward one); and vLLM's DeepSeek-V4 rotary embedding run through the drop-in
against vLLM's own forward_native semantics, written out here in float64."""

import pytest
import torch
from torch.autograd import gradcheck

import rope_ext
import rope_oracle
from conftest import DTYPES, assert_close, native_cpu
from rope_ext.compat import sglang, vllm


def table(max_position, rotary_dim, dtype=torch.float32, scale=1.0):
    i = torch.arange(rotary_dim // 2, dtype=torch.float64)
    theta = torch.arange(max_position, dtype=torch.float64)[:, None] * 10000.0 ** (-2 * i / rotary_dim)
    return (torch.cat((theta.cos(), theta.sin()), dim=1) * scale).to(dtype)


def expected(x, positions, cache, offset, interleaved, inverse):
    """float64: x with dims [offset, offset + rotary_dim) rotated by the cache rows at positions
    (x (T, H, D), positions (T,))."""
    half = cache.shape[1] // 2
    rows = cache.double()[positions.long()][:, None]
    want = x.double().clone()
    part = want[..., offset: offset + 2 * half]
    want[..., offset: offset + 2 * half] = rope_oracle.rope(part, rows[..., :half], rows[..., half:],
                                                            interleaved, inverse)
    return want


def check_rotated(x, x0, want, offset, rotary_dim, dtype):
    assert_close(x, want, dtype)
    assert torch.equal(x[..., :offset], x0[..., :offset])  # untouched dims: bit-exact
    assert torch.equal(x[..., offset + rotary_dim:], x0[..., offset + rotary_dim:])


BACKENDS = ["native", "reference"]


def run_apply(backend, *args, **kwargs):
    if backend == "native" and not native_cpu():
        pytest.skip("no native CPU library")
    f = rope_ext.apply_rope_ if backend == "native" else rope_ext.reference.apply_rope_
    return f(*args, **kwargs)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("head_dim,rotary_dim,offset", [
    (64, 64, 0), (64, 16, 48), (64, 16, 0), (72, 26, 46), (80, 26, 7), (32, 0, 32)])
def test_apply_offset_inverse(backend, dtype, interleaved, inverse, head_dim, rotary_dim, offset):
    T, Hq, Hk = 7, 4, 2
    qkv = torch.randn(T, (Hq + 2 * Hk) * head_dim, dtype=dtype)  # fused: strided views
    q = qkv[:, : Hq * head_dim].unflatten(-1, (Hq, head_dim))
    k = qkv[:, Hq * head_dim: (Hq + Hk) * head_dim].unflatten(-1, (Hk, head_dim))
    q0, k0 = q.clone(), k.clone()
    cache = table(50, rotary_dim, dtype=torch.float32)
    positions = torch.randint(0, 50, (T,))
    run_apply(backend, q, k, positions, cache, interleaved=interleaved, rope_dim_offset=offset,
              inverse=inverse)
    check_rotated(q, q0, expected(q0, positions, cache, offset, interleaved, inverse), offset,
                  rotary_dim, dtype)
    check_rotated(k, k0, expected(k0, positions, cache, offset, interleaved, inverse), offset,
                  rotary_dim, dtype)
    v = qkv[:, (Hq + Hk) * head_dim:]
    assert torch.isfinite(v).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_and_reference_agree_query_only(dtype):
    if not native_cpu():
        pytest.skip("no native CPU library")
    x = torch.randn(3, 5, 8, 96, dtype=dtype)[:, :, ::2]  # (3, 5, 4, 96), strided heads
    positions = torch.randint(0, 40, (3, 5), dtype=torch.int32)
    cache = table(40, 32, torch.bfloat16)
    a, b = x.clone(), x.clone()
    rope_ext.apply_rope_(a, None, positions, cache, rope_dim_offset=64, inverse=True)
    rope_ext.reference.apply_rope_(b, None, positions, cache, rope_dim_offset=64, inverse=True)
    want = expected(x.flatten(0, 1), positions.flatten(), cache, 64, False, True).unflatten(0, (3, 5))
    assert_close(a, want, dtype)
    assert_close(b, want, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("interleaved", [False, True])
def test_inverse_undoes_the_rotation(backend, interleaved):
    x = torch.randn(9, 3, 40, dtype=torch.float64)
    cache = table(30, 24, torch.float64)
    positions = torch.randint(0, 30, (9,))
    y = x.clone()
    run_apply(backend, y, None, positions, cache, interleaved=interleaved, rope_dim_offset=16)
    assert not torch.allclose(y, x)
    run_apply(backend, y, None, positions, cache, interleaved=interleaved, rope_dim_offset=16,
              inverse=True)
    torch.testing.assert_close(y, x, rtol=1e-12, atol=1e-12)


def mrope_expected(x, positions, cache, section, offset, inverse):
    """float64: chunked MRoPE (pair i takes the row of component j of its section) on dims
    [offset, offset + rotary_dim)."""
    half = cache.shape[1] // 2
    comp = torch.tensor(sum(([j] * n for j, n in enumerate(section)), []))
    pos = positions.long().T[:, comp]  # (T, half): the position of each pair
    c = cache.double()[pos, torch.arange(half)][:, None]
    s = cache.double()[pos, half + torch.arange(half)][:, None]
    want = x.double().clone()
    want[..., offset: offset + 2 * half] = rope_oracle.rope(want[..., offset: offset + 2 * half], c, s,
                                                            False, inverse)
    return want


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("inverse", [False, True])
def test_mrope_offset_inverse(backend, inverse):
    if backend == "native" and not native_cpu():
        pytest.skip("no native CPU library")
    T, H, D, section = 6, 3, 80, [4, 6, 6]  # rotary_dim 32
    q, k = torch.randn(T, H, D), torch.randn(T, 1, D)
    q0, k0 = q.clone(), k.clone()
    positions = torch.randint(0, 64, (3, T))
    cache = table(64, 32)
    f = rope_ext.apply_mrope_ if backend == "native" else rope_ext.reference.apply_mrope_
    f(q, k, positions, cache, section, rope_dim_offset=40, inverse=inverse)
    for t, t0 in ((q, q0), (k, k0)):
        check_rotated(t, t0, mrope_expected(t0, positions, cache, section, 40, inverse), 40, 32,
                      torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("offset", [-1, 17, 2**62, -2**63])
def test_offset_out_of_range_changes_nothing(backend, offset):
    q, k = torch.randn(4, 2, 32), torch.randn(4, 1, 32)
    q0, k0 = q.clone(), k.clone()
    cache = table(10, 16)
    msg = (f"rope.apply_: rope_dim_offset = {offset} must lie in \\[0, head_dim - rotary_dim\\] = "
           "\\[0, 16\\] \\(head_dim = 32, rotary_dim = 16\\)")
    with pytest.raises(RuntimeError, match=msg):
        run_apply(backend, q, k, torch.arange(4), cache, rope_dim_offset=offset)
    assert torch.equal(q, q0) and torch.equal(k, k0)
    with pytest.raises(RuntimeError, match=msg.replace("apply_", "mrope_")):
        f = rope_ext.apply_mrope_ if backend == "native" else rope_ext.reference.apply_mrope_
        f(q, k, torch.zeros(3, 4, dtype=torch.long), cache, [8, 0, 0], rope_dim_offset=offset)
    assert torch.equal(q, q0) and torch.equal(k, k0)


def test_offset_checked_on_meta_tensors():
    q = torch.empty(4, 2, 32, device="meta")
    with pytest.raises(RuntimeError, match="rope_dim_offset = 20 must lie in"):
        torch.ops.rope.apply_(q, None, torch.empty(4, dtype=torch.long, device="meta"),
                              torch.empty(10, 16, device="meta"), False, 20, False)
    torch.ops.rope.apply_(q, None, torch.empty(4, dtype=torch.long, device="meta"),
                          torch.empty(10, 16, device="meta"), False, 16, True)


def test_opcheck():
    q, k = torch.randn(5, 4, 48), torch.randn(5, 2, 48)
    cache, positions = table(20, 16), torch.randint(0, 20, (5,))
    torch.library.opcheck(torch.ops.rope.apply_.default, (q, k, positions, cache, True, 32, True))
    torch.library.opcheck(torch.ops.rope.mrope_.default,
                          (q, k, torch.randint(0, 20, (3, 5)), cache, [2, 3, 3], False, True, 8,
                           True))


@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("interleaved", [False, True])
def test_gradients(inverse, interleaved):
    positions = torch.randint(0, 12, (4,))

    def fn(q, k, cache):
        q, k = q * 1, k * 1
        rope_ext.apply_rope_(q, k, positions, cache, interleaved=interleaved, rope_dim_offset=6,
                             inverse=inverse)
        return q, k

    q = torch.randn(4, 2, 18, dtype=torch.float64, requires_grad=True)
    k = torch.randn(4, 1, 18, dtype=torch.float64, requires_grad=True)
    cache = table(12, 8, torch.float64).requires_grad_()
    assert gradcheck(fn, (q, k, cache))


def test_gradient_of_inverse_is_forward_rotation():
    positions = torch.randint(0, 12, (4,))
    cache = table(12, 8, torch.float64)
    x = torch.randn(4, 2, 16, dtype=torch.float64, requires_grad=True)
    y = x * 1
    rope_ext.apply_rope_(y, None, positions, cache, rope_dim_offset=8, inverse=True)
    g = torch.randn_like(y)
    y.backward(g)
    want = expected(g, positions, cache, 8, False, False)
    torch.testing.assert_close(x.grad, want, rtol=1e-12, atol=1e-12)


def test_mrope_gradients():
    positions = torch.randint(0, 12, (3, 4))

    def fn(q, cache):
        q = q * 1
        rope_ext.apply_mrope_(q, None, positions, cache, [1, 2, 1], rope_dim_offset=2, inverse=True)
        return q

    q = torch.randn(4, 2, 12, dtype=torch.float64, requires_grad=True)
    assert gradcheck(fn, (q, table(12, 8, torch.float64).requires_grad_()))


def test_compile():
    def f(q, k, positions, cache):
        rope_ext.apply_rope_(q, k, positions, cache, rope_dim_offset=16, inverse=True)
        return q, k

    q, k = torch.randn(5, 4, 48), torch.randn(5, 2, 48)
    cache, positions = table(20, 32), torch.randint(0, 20, (5,))
    want = f(q.clone(), k.clone(), positions, cache)
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(q.clone(), k.clone(), positions, cache)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


# ---- vLLM ----------------------------------------------------------------------------------

@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("flat", [True, False])
def test_vllm_offset_inverse(is_neox, inverse, flat):
    import peers

    Hq, Hk, hs, rot, T = 4, 2, 64, 16, 9
    qkv = torch.randn(T, (Hq + 2 * Hk) * hs, dtype=torch.bfloat16)
    query, key = qkv[:, : Hq * hs], qkv[:, Hq * hs: (Hq + Hk) * hs]
    if not flat:
        query, key = query.unflatten(-1, (Hq, hs)), key.unflatten(-1, (Hk, hs))
    cache = table(32, rot)
    positions = torch.randint(0, 32, (T,))
    want = qkv.double()
    peers.vllm_rotary_embedding(positions, want[:, : Hq * hs], want[:, Hq * hs: (Hq + Hk) * hs],
                                hs, cache.double(), is_neox, rope_dim_offset=hs - rot,
                                inverse=inverse)
    assert vllm.rotary_embedding(positions, query, key, hs, cache, is_neox,
                                 rope_dim_offset=hs - rot, inverse=inverse) is None
    assert_close(qkv, want, torch.bfloat16)
    assert torch.equal(qkv[:, (Hq + Hk) * hs:], want[:, (Hq + Hk) * hs:].to(qkv.dtype))


def test_vllm_offset_error_changes_nothing():
    query, key = torch.randn(5, 2 * 32), torch.randn(5, 32)
    q0, k0 = query.clone(), key.clone()
    with pytest.raises(RuntimeError, match="rope_dim_offset = 20 must lie in .* = \\[0, 16\\]"):
        vllm.rotary_embedding(torch.arange(5), query, key, 32, table(8, 16), True,
                              rope_dim_offset=20)
    assert torch.equal(query, q0) and torch.equal(key, k0)


class DeepseekV4Rope:
    """The parts of vLLM 0.33's DeepseekV4ScalingRotaryEmbedding that its forward paths read
    (rotary_dim, is_neox_style, a float32 cos_sin_cache carrying YaRN's mscale), with its
    forward_cuda logic: RoPE on the last rotary_dim dims of each head through
    `ops.rotary_embedding(..., rope_dim_offset=head_size - rotary_dim, inverse=inverse)`; the
    head size is taken from the query, since the indexer and attention differ."""

    def __init__(self, rotary_dim, max_position, is_neox_style, mscale):
        self.rotary_dim, self.is_neox_style = rotary_dim, is_neox_style
        self.cos_sin_cache = table(max_position, rotary_dim, torch.float32, scale=mscale)

    def forward_cuda(self, positions, query, key=None, offsets=None, inverse=False):
        ops = vllm
        head_size = query.size(-1)
        rope_dim_offset = head_size - self.rotary_dim
        ops.rotary_embedding(torch.add(positions, offsets) if offsets is not None else positions,
                             query, key, head_size, self.cos_sin_cache, self.is_neox_style,
                             rope_dim_offset=rope_dim_offset, inverse=inverse)
        return query, key


def deepseek_v4_forward_native(rope, positions, query, key=None, offsets=None, inverse=False):
    """vLLM's forward_native semantics in float64: the last rotary_dim dims rotated, cos and sin
    expanded to the full rotary width (neox: cat(c, c); gptj: each repeated twice), sin negated
    for inverse, x * cos + rotate(x) * sin, the pass-through dims first."""
    rd = rope.rotary_dim
    q, k = query.double(), None if key is None else key.double()
    cos, sin = rope.cos_sin_cache.double()[positions + offsets if offsets is not None else positions].chunk(2, -1)
    if rope.is_neox_style:
        cos, sin = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)
    else:
        cos, sin = cos.repeat_interleave(2, -1), sin.repeat_interleave(2, -1)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    if inverse:
        sin = -sin

    def rotate(x):
        if rope.is_neox_style:
            x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
            return torch.cat((-x2, x1), -1)
        x1, x2 = x[..., ::2], x[..., 1::2]
        return torch.stack((-x2, x1), -1).flatten(-2)

    def one(x):
        r = x[..., -rd:]
        return torch.cat((x[..., :-rd], r * cos + rotate(r) * sin), -1)

    return one(q), None if k is None else one(k)


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("head_size", [512, 128, 64])  # attention, indexer, rope only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("with_key", [True, False])
def test_deepseek_v4_forward_cuda_matches_forward_native(is_neox, inverse, head_size, dtype,
                                                        with_key):
    rope = DeepseekV4Rope(64, 256, is_neox, mscale=1.2)
    T, H = 6, 4
    query = torch.randn(T, H, head_size, dtype=dtype)
    key = torch.randn(T, 1, head_size, dtype=dtype) if with_key else None
    positions, offsets = torch.randint(0, 200, (T,)), torch.randint(0, 50, (T,))
    want_q, want_k = deepseek_v4_forward_native(rope, positions, query, key, offsets, inverse)
    q0 = query.clone()
    got_q, got_k = rope.forward_cuda(positions, query, key, offsets, inverse)
    assert got_q is query and got_k is key
    assert_close(query, want_q, dtype)
    assert torch.equal(query[..., : head_size - 64], q0[..., : head_size - 64])
    if with_key:
        assert_close(key, want_k, dtype)


def test_deepseek_v4_inverse_round_trip():
    rope = DeepseekV4Rope(64, 128, True, mscale=1.0)
    query = torch.randn(5, 2, 128, dtype=torch.float64)
    positions = torch.randint(0, 128, (5,))
    q = query.clone()
    rope.forward_cuda(positions, q)
    rope.forward_cuda(positions, q, inverse=True)
    # The float32 table's (cos, sin) are unit length to float32 rounding, so is the round trip.
    torch.testing.assert_close(q, query, rtol=1e-6, atol=1e-6)


# ---- SGLang --------------------------------------------------------------------------------

@pytest.mark.parametrize("enable_pdl", [None, False, True])
def test_sglang_enable_pdl_accepted(enable_pdl):
    query, key = torch.randn(4, 2 * 16), torch.randn(4, 16)
    want_q, want_k = query.clone(), key.clone()
    cache, positions = table(8, 16), torch.randint(0, 8, (4,))
    rope_ext.apply_rope_(want_q, want_k, positions, cache, head_size=16)
    sglang.apply_rope_with_cos_sin_cache_inplace(positions, query, key, 16, cache, True, None,
                                                 enable_pdl)
    torch.testing.assert_close(query, want_q, rtol=0, atol=0)
    torch.testing.assert_close(key, want_k, rtol=0, atol=0)
    sglang.apply_rope_with_cos_sin_cache_inplace(positions, query, key, 16, cache,
                                                 enable_pdl=enable_pdl)
