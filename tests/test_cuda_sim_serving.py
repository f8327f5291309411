"""The CUDA kernels of the serving features, proven on the CPU simulator (tests/sim/cuda_sim.cpp:
every access in bounds of its operand, aligned, each output element written once by one thread,
in place only the rotary dims): rope_dim_offset and inverse of rope.apply_ / rope.mrope_, and the
K-shift (rope.shift_kv_cache_), compared bit for bit with the CPU kernels and the reference, and
with the float64 oracle."""

import pytest
import torch

import cuda_sim
import rope_ext
import rope_oracle
from conftest import assert_close, native_cpu
from cuda_testing import DTYPES, vec_width


@pytest.fixture(scope="module", autouse=True)
def simulator():
    cuda_sim.load()


def cache_table(max_position, rotary_dim, dtype=torch.float32):
    return rope_ext.cos_sin_cache(max_position, rotary_dim, dtype=dtype)


def oracle(x, positions, cache, offset, interleaved, inverse):
    half = cache.shape[1] // 2
    rows = cache.double()[positions.long()][:, None]
    want = x.double().clone()
    want[..., offset: offset + 2 * half] = rope_oracle.rope(
        want[..., offset: offset + 2 * half], rows[..., :half], rows[..., half:], interleaved, inverse)
    return want


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("head_dim,rotary_dim,offset", [
    (128, 64, 64), (128, 32, 0), (96, 32, 40), (100, 26, 7), (64, 16, 48)])
def test_apply_offset_inverse(dtype, interleaved, inverse, head_dim, rotary_dim, offset):
    T, Hq, Hk = 5, 4, 2
    qkv = torch.randn(T, (Hq + 2 * Hk) * head_dim, dtype=dtype)
    q = qkv[:, : Hq * head_dim].unflatten(-1, (Hq, head_dim))
    k = qkv[:, Hq * head_dim: (Hq + Hk) * head_dim].unflatten(-1, (Hk, head_dim))
    q0, k0 = q.clone(), k.clone()
    cache = cache_table(40, rotary_dim)
    positions = torch.randint(0, 40, (T,))
    plan = cuda_sim.apply_(q, k, positions, cache, interleaved, offset, inverse)
    w = vec_width(dtype)
    aligned = offset % w == 0 and head_dim % w == 0 and (interleaved or (rotary_dim // 2) % w == 0)
    assert plan.vec == aligned
    for t, t0 in ((q, q0), (k, k0)):
        assert_close(t, oracle(t0, positions, cache, offset, interleaved, inverse), dtype)
    if native_cpu():
        cq, ck = q0.clone(), k0.clone()
        rope_ext.apply_rope_(cq, ck, positions, cache, interleaved=interleaved,
                             rope_dim_offset=offset, inverse=inverse)
        assert torch.equal(q, cq) and torch.equal(k, ck)


@pytest.mark.parametrize("inverse", [False, True])
def test_mrope_offset_inverse(inverse):
    T, H, D = 6, 3, 96
    q, k = torch.randn(T, H, D, dtype=torch.bfloat16), torch.randn(T, 1, D, dtype=torch.bfloat16)
    q0, k0 = q.clone(), k.clone()
    positions = torch.randint(0, 30, (3, T))
    cache = cache_table(30, 32)
    cuda_sim.mrope_(q, k, positions, cache, [4, 6, 6], False, True, 64, inverse, max_blocks=2)
    assert torch.equal(q[..., :64], q0[..., :64]) and torch.equal(k[..., :64], k0[..., :64])
    if native_cpu():
        cq, ck = q0.clone(), k0.clone()
        rope_ext.apply_mrope_(cq, ck, positions, cache, [4, 6, 6], mrope_interleaved=True,
                              rope_dim_offset=64, inverse=inverse)
        assert torch.equal(q, cq) and torch.equal(k, ck)


def test_offset_error_before_any_write():
    q = torch.randn(3, 2, 32)
    q0 = q.clone()
    with pytest.raises(RuntimeError, match="rope.apply_: rope_dim_offset = 17 must lie in"):
        cuda_sim.apply_(q, None, torch.arange(3), cache_table(4, 16), False, 17, False)
    assert torch.equal(q, q0)


# ---- K-shift ----

@pytest.mark.parametrize("dtype,kv_cache_dtype", [
    (torch.float32, "auto"), (torch.bfloat16, "auto"), (torch.float16, "auto"),
    (torch.float64, "auto"), (torch.float8_e4m3fn, "fp8"), (torch.float8_e5m2, "fp8_e5m2")])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("table_dtype", [torch.float32, torch.bfloat16])
def test_shift_kv_cache(dtype, kv_cache_dtype, interleaved, table_dtype):
    from rope_ext._kv_shift import reference as ref
    from test_kv_shift import assert_same_result

    big = (torch.randn(5, 4, 6, 48) * 2).to(dtype)
    k_scale = torch.tensor([0.125]) if kv_cache_dtype != "auto" else None
    table = rope_ext.cos_sin_cache(64, 40, dtype=table_dtype,
                                   scaling={"rope_type": "yarn", "factor": 4.0,
                                            "original_max_position_embeddings": 16})
    slots = torch.tensor([0, 19, -1, 7, 12, 3, -4, 15], dtype=torch.int32)
    delta = torch.tensor([5, -63, 99, 0, 63, -1, 7, 30])
    sim, want = big.clone(), big.clone()
    plan = cuda_sim.shift_kv_cache_(sim[:, :, 1:5], slots, delta, table, interleaved,
                                    kv_cache_dtype, k_scale, max_blocks=2)
    assert plan.grid == 2  # the grid strides over the listed slots
    ref.shift_kv_cache_(want[:, :, 1:5], slots, delta, table, interleaved=interleaved,
                        kv_cache_dtype=kv_cache_dtype, k_scale=k_scale)
    assert_same_result(sim, want, dtype, None if k_scale is None else 0.125)
    if native_cpu():
        cpu = big.clone()
        rope_ext.shift_kv_cache_(cpu[:, :, 1:5], slots, delta, table, interleaved=interleaved,
                                 kv_cache_dtype=kv_cache_dtype, k_scale=k_scale)
        assert torch.equal(sim.view(torch.uint8), cpu.view(torch.uint8))


@pytest.mark.parametrize("slots,delta,msg", [
    ([3, 20], [1, 1], "slot_mapping must lie below num_blocks \\* block_size = 20"),
    ([3, 3], [1, 1], "slot_mapping must list each slot at most once"),
    ([3, 4], [1, -64], "delta must lie in \\(-max_position, max_position\\) = \\(-64, 64\\)"),
])
def test_shift_errors_before_any_write(slots, delta, msg):
    key_cache = torch.randn(5, 4, 2, 16)
    before = key_cache.clone()
    with pytest.raises(RuntimeError, match="rope.shift_kv_cache_: " + msg):
        cuda_sim.shift_kv_cache_(key_cache, torch.tensor(slots)[::1], torch.tensor(delta),
                                 cache_table(64, 16))
    assert torch.equal(key_cache, before)


def test_shift_strided_slots_and_scalar_delta():
    key_cache = torch.randn(4, 4, 3, 32, dtype=torch.bfloat16)
    want = key_cache.clone()
    slots = torch.tensor([1, 99, 5, 99, 14, 99])[::2]  # a strided view: slots 1, 5, 14
    cuda_sim.shift_kv_cache_(key_cache, slots, torch.tensor(-9), cache_table(32, 32))
    from rope_ext._kv_shift import reference as ref
    from test_kv_shift import assert_same_result

    ref.shift_kv_cache_(want, slots, torch.tensor(-9), cache_table(32, 32))
    assert_same_result(key_cache, want, torch.bfloat16)
    assert torch.equal(key_cache[0, 0], want[0, 0])  # slot 0: not listed
