"""rope_ext.apply_rope_and_cache_ (rope.apply_and_cache_) against an eager implementation written
out here: rotate query and key, then write the rotated key and the value into vLLM's paged layout
(num_blocks, block_size, kv_heads, head_dim) at slot = block * block_size + offset, skipping
negative slots; fp8 stores (x / scale) saturated to the format's range."""

import pytest
import torch

import rope_ext
from conftest import assert_close, assert_compiled_like_eager
from rope_oracle import rope, table_for

FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def eager(q, k, v, pos, rotary_dim, key_cache, value_cache, slots, interleaved, fmt, k_scale, v_scale):
    """The two-step eager path: rotate (float64, rounded to the model dtype), then the paged write."""
    cos, sin = table_for(pos, rotary_dim)
    q_rot = rope(q, cos[:, None], sin[:, None], interleaved).to(q.dtype)
    k_rot = rope(k, cos[:, None], sin[:, None], interleaved).to(k.dtype)
    kc, vc = key_cache.clone(), value_cache.clone()
    block = kc.shape[1]
    for t, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        kv = (k_rot[t], v[t])
        if fmt != "auto":
            dt = FP8[fmt]
            m = torch.finfo(dt).max
            kv = tuple((x.float() / sc).clamp(-m, m).to(dt) for x, sc in zip(kv, (k_scale, v_scale)))
        kc[s // block, s % block] = kv[0] if fmt == "auto" else kv[0]
        vc[s // block, s % block] = kv[1]
    return q_rot, k_rot, kc, vc


def bits(t):
    return t.view(torch.uint8) if t.element_size() == 1 else t


@pytest.mark.parametrize("block_size", [1, 16, 256])
@pytest.mark.parametrize("fmt", ["auto", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interleaved", [False, True])
def test_matches_eager_rotate_then_paged_write(block_size, fmt, dtype, interleaved):
    T, hq, hk, d, dv, rot = 23, 8, 2, 64, 48, 32  # GQA, partial rotary, value_dim != head_dim
    qkv = torch.randn(T, (hq + 2 * hk) * d, dtype=dtype)  # strided views of one fused buffer
    q = qkv[:, : hq * d].view(T, hq, d)
    k = qkv[:, hq * d : (hq + hk) * d].view(T, hk, d)
    v = torch.randn(T, hk, dv, dtype=dtype)
    blocks = (T + block_size) // block_size + 2
    cdt = FP8.get(fmt, dtype)
    key_cache = torch.randn(blocks, block_size, hk, d).to(cdt)  # old contents: must stay where unwritten
    value_cache = torch.randn(blocks, block_size, hk, dv).to(cdt)
    slots = torch.randperm(blocks * block_size)[:T]
    slots[torch.rand(T) < 0.25] = -1  # padding tokens
    pos = torch.randint(0, 2048, (T,))
    cache = rope_ext.cos_sin_cache(2048, rot)
    scales = (torch.tensor([0.37]), torch.tensor([1.7])) if fmt != "auto" else (None, None)
    want = eager(q.clone(), k.clone(), v, pos, rot, key_cache, value_cache, slots, interleaved, fmt, *scales)
    q0, k0 = q.clone(), k.clone()
    out = rope_ext.apply_rope_and_cache_(q, k, v, pos, cache, key_cache, value_cache, slots,
                                         interleaved=interleaved, kv_cache_dtype=fmt,
                                         k_scale=scales[0], v_scale=scales[1])
    assert out[0] is q and out[1] is k
    assert_close(q, want[0], dtype)
    assert_close(k, want[1], dtype)
    assert torch.equal(q[..., rot:], q0[..., rot:]) and torch.equal(k[..., rot:], k0[..., rot:])
    # The caches get the rotated key as stored in `key` (rounded to the model dtype), then
    # converted: with the key's own bits as input, the eager conversion is exact.
    ref = eager(q0, k0, v, pos, rot, key_cache.clone(), value_cache.clone(), slots, interleaved, fmt, *scales)
    expect_kc, expect_vc = ref[2].clone(), ref[3]
    block = key_cache.shape[1]
    for t, s in enumerate(slots.tolist()):  # the key as rope_ext rotated it (within tolerance above)
        if s >= 0:
            kr = k[t]
            if fmt != "auto":
                m = torch.finfo(cdt).max
                kr = (kr.float() / scales[0]).clamp(-m, m).to(cdt)
            expect_kc[s // block, s % block] = kr
    assert torch.equal(bits(key_cache), bits(expect_kc))
    assert torch.equal(bits(value_cache), bits(expect_vc))


@pytest.mark.parametrize("fmt", ["auto", "fp8_e4m3"])
@pytest.mark.parametrize("backend", ["native", "reference"])
def test_empty_key_rows_still_store_their_values(fmt, backend):
    # head_dim 0: nothing to rotate, but every kept token's value rows go to the value cache
    # (a path that skipped the call as "no work" would leave the cache untouched).
    T, hk, dv = 5, 2, 24
    q, k = torch.randn(T, 3, 0), torch.randn(T, hk, 0)
    v = torch.randn(T, hk, dv)
    pos = torch.randint(0, 8, (T,))
    key_cache = torch.randn(3, 4, hk, 0).to(FP8.get(fmt, torch.float32))
    value_cache = torch.randn(3, 4, hk, dv).to(FP8.get(fmt, torch.float32))
    slots = torch.tensor([0, 7, -1, 11, 4])
    scales = (torch.tensor([0.5]), torch.tensor([1.5])) if fmt != "auto" else (None, None)
    _, _, _, want = eager(q, k, v, pos, 0, key_cache, value_cache, slots, False, fmt, *scales)
    fn = rope_ext.apply_rope_and_cache_ if backend == "native" else rope_ext.reference.apply_and_cache_
    if backend == "native" and rope_ext.backend("cpu") != "native":
        pytest.skip("no native CPU library")
    fn(q, k, v, pos, torch.empty(8, 0), key_cache, value_cache, slots,
       kv_cache_dtype=fmt, k_scale=scales[0], v_scale=scales[1])
    assert torch.equal(bits(value_cache), bits(want))


def test_fp8_conversion_is_torchs_for_every_magnitude_and_saturates():
    # Values from far below the subnormals to far above the largest finite value, both signs.
    T, hk, dv = 64, 1, 64
    exps = torch.linspace(-30, 20, T * dv)
    x = (torch.sign(torch.randn(T * dv)) * torch.exp2(exps) * (1 + torch.rand(T * dv))).view(T, hk, dv)
    x[0, 0, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0])
    for fmt, dt in (("fp8_e4m3", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)):
        vc = torch.zeros(T, 1, hk, dv, dtype=dt)
        rope_ext.apply_rope_and_cache_(torch.randn(T, 1, 8), torch.randn(T, hk, 8), x, torch.zeros(T, dtype=torch.long),
                                       rope_ext.cos_sin_cache(4, 8), torch.zeros(T, 1, hk, 8, dtype=dt), vc,
                                       torch.arange(T), kv_cache_dtype=fmt, k_scale=torch.tensor([1.0]),
                                       v_scale=torch.tensor([1.0]))
        m = torch.finfo(dt).max
        want = x.clamp(-m, m).to(dt)
        got = vc[:, 0]
        nan = want.float().isnan()
        assert torch.equal(got.float().isnan(), nan)
        assert torch.equal(bits(got)[~nan], bits(want)[~nan])
        assert got.float()[0, 0, 1] == m and got.float()[0, 0, 2] == -m  # saturated, not inf/NaN


def test_rejected_calls_change_nothing():
    T = 4
    q, k, v = torch.randn(T, 2, 16), torch.randn(T, 1, 16), torch.randn(T, 1, 16)
    kc, vc = torch.randn(2, 4, 1, 16), torch.randn(2, 4, 1, 16)
    pos, slots, cache = torch.arange(T), torch.tensor([0, 3, -1, 7]), rope_ext.cos_sin_cache(8, 16)
    cases = [
        (dict(slot_mapping=torch.tensor([0, 3, 8, 1])), r"slot_mapping must lie below num_blocks \* block_size = 8"),
        (dict(key_cache=torch.randn(2, 4, 2, 16)), r"key_cache must have shape \(num_blocks, block_size, num_kv_heads, head_dim\)"),
        (dict(value_cache=torch.randn(3, 4, 1, 16)), r"value_cache must have shape"),
        (dict(key_cache=kc.double()), r"key_cache must be Float for kv_cache_dtype 'auto'"),
        (dict(kv_cache_dtype="fp8"), r"key_cache must be Float8_e4m3fn for kv_cache_dtype 'fp8'"),
        (dict(kv_cache_dtype="fp8", key_cache=kc.to(torch.float8_e4m3fn), value_cache=vc.to(torch.float8_e4m3fn)),
         r"k_scale is required for kv_cache_dtype 'fp8'"),
        (dict(kv_cache_dtype="int8"), r"kv_cache_dtype must be 'auto', 'fp8', 'fp8_e4m3' or 'fp8_e5m2'"),
        (dict(positions=torch.tensor([0, 1, 9, 2])), r"positions must lie in \[0, 8\)"),
        (dict(value=torch.randn(T, 2, 16)), r"value must have shape \(num_tokens, num_kv_heads, value_dim\)"),
        (dict(key_cache=q.view(2, 4, 1, 16)), r"query and key_cache: .*refer to a single memory location"),
    ]
    for impl in ("op", "reference"):
        for change, match in cases:
            args = dict(query=q, key=k, value=v, positions=pos, cos_sin_cache=cache, key_cache=kc,
                        value_cache=vc, slot_mapping=slots, kv_cache_dtype="auto")
            args.update(change)
            before = {n: t.clone() for n, t in args.items() if isinstance(t, torch.Tensor)}
            kw = dict(args)
            pos_args = [kw.pop(n) for n in ("query", "key", "value", "positions", "cos_sin_cache",
                                            "key_cache", "value_cache", "slot_mapping")]
            with pytest.raises(RuntimeError, match=match):
                if impl == "op":
                    rope_ext.apply_rope_and_cache_(*pos_args, **kw)
                else:
                    rope_ext.reference.apply_and_cache_(*pos_args, **kw)
            for n, t in before.items():
                now = args[n]
                assert torch.equal(bits(now) if now.element_size() == 1 else now,
                                   bits(t) if t.element_size() == 1 else t), f"{impl}: {match}: {n} changed"


def test_compiles_without_graph_break():
    cache = rope_ext.cos_sin_cache(32, 16)

    def step(q, k, v, pos, kc, vc, slots):
        rope_ext.apply_rope_and_cache_(q, k, v, pos, cache, kc, vc, slots)
        return q * 2

    args = [torch.randn(5, 2, 16), torch.randn(5, 1, 16), torch.randn(5, 1, 16), torch.arange(5),
            torch.zeros(2, 4, 1, 16), torch.zeros(2, 4, 1, 16), torch.tensor([7, 0, -1, 3, 1])]
    assert_compiled_like_eager(step, args)


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("scale", [1.0, 0.37, 2.0**-6, 2.0**100, 2.0**-126])
def test_fp8_store_of_every_bfloat16_value_is_torchs(fmt, scale):
    """Every one of the 65536 bfloat16 bit patterns as a value row, stored through the CPU's
    vectorized float8 conversion: the bits torch's own conversion gives (NaN: a NaN). Scales
    from 1 to those that take every value to a subnormal or zero."""
    T, D = 512, 128
    v = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    v = v.reshape(T, 1, D)
    q, k = torch.randn(T, 1, D, dtype=torch.bfloat16), torch.randn(T, 1, D, dtype=torch.bfloat16)
    dt = FP8[fmt]
    kc, vc = torch.zeros(T, 1, 1, D).to(dt), torch.zeros(T, 1, 1, D).to(dt)
    s = torch.tensor([scale])
    rope_ext.apply_rope_and_cache_(q, k, v, torch.zeros(T, dtype=torch.long), rope_ext.cos_sin_cache(4, D),
                                   kc, vc, torch.arange(T), kv_cache_dtype=fmt, k_scale=s, v_scale=s)
    m = torch.finfo(dt).max
    want = (v.float() / s).clamp(-m, m).to(dt)[:, None]
    nan = want.float().isnan()
    assert torch.equal(vc.float().isnan(), nan)
    assert torch.equal(bits(vc)[~nan], bits(want)[~nan])
