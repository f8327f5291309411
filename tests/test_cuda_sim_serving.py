"""The CUDA kernels of the serving features, proven on the CPU simulator (tests/sim/cuda_sim.cpp:
every access in bounds of its operand, aligned, each output element written once by one thread,
in place only the rotary dims): rope_dim_offset and inverse of rope.apply_ / rope.mrope_, compared
bit for bit with the CPU kernels and with the float64 oracle."""

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
