"""cos_sin_cache and RotaryEmbedding."""

import math

import pytest
import torch

import rope_ext
from conftest import assert_close
from rope_oracle import rope


def test_cache_layout_and_exactness_at_large_positions():
    R, base = 128, 10000.0
    positions = [0, 1, 7, 4095, 131071, 999_999]
    cache = rope_ext.cos_sin_cache(1_000_000, R, base=base)
    assert cache.shape == (1_000_000, R) and cache.dtype == torch.float32
    for p in positions:
        for i in (0, 1, 17, R // 2 - 1):
            theta = p * (1.0 / base ** (2 * i / R))  # python floats are float64
            # Exact to float32 rounding of the float64 value.
            assert cache[p, i].item() == torch.tensor(math.cos(theta), dtype=torch.float32).item()
            assert cache[p, R // 2 + i].item() == torch.tensor(math.sin(theta), dtype=torch.float32).item()


def test_cache_dtype_and_device_arguments():
    c = rope_ext.cos_sin_cache(16, 8, dtype=torch.float64, device="cpu", base=500000.0)
    assert c.dtype == torch.float64
    theta = 3 * 500000.0 ** (-2 * 1 / 8)
    assert c[3, 1].item() == pytest.approx(math.cos(theta), abs=1e-15)


def test_unknown_scaling_is_explicit():
    # The supported scalings are tested in test_scaling.py.
    with pytest.raises(ValueError, match="unknown rope scaling type"):
        rope_ext.cos_sin_cache(16, 8, scaling={"rope_type": "not-a-scaling", "factor": 2.0})


@pytest.mark.parametrize("interleaved", [False, True])
def test_rotary_embedding_forward_and_backward(interleaved):
    m = rope_ext.RotaryEmbedding(64, rotary_dim=32, max_position=256, base=10000.0, interleaved=interleaved)
    assert "cos_sin_cache" not in m.state_dict()  # non-persistent
    q = torch.randn(2, 9, 4, 64, requires_grad=True)
    k = torch.randn(2, 9, 2, 64, requires_grad=True)
    pos = torch.randint(0, 256, (2, 9))
    q2, k2 = m(q, k, pos)
    rows = m.cos_sin_cache.double()[pos].unsqueeze(-2)
    assert_close(q2, rope(q, rows[..., :16], rows[..., 16:], interleaved), torch.float32)
    assert_close(k2, rope(k, rows[..., :16], rows[..., 16:], interleaved), torch.float32)
    (q2.sum() + k2.square().sum()).backward()
    assert_close(q.grad, rope(torch.ones_like(q), rows[..., :16], rows[..., 16:], interleaved, inverse=True),
                 torch.float32)
    # The module's path agrees with the in-place inference op.
    qi, ki = q.detach().clone(), k.detach().clone()
    rope_ext.apply_rope_(qi, ki, pos, m.cos_sin_cache, interleaved=interleaved)
    assert torch.equal(qi, q2.detach()) and torch.equal(ki, k2.detach())
    assert m(q, None, pos)[1] is None


def test_rotary_embedding_keeps_float32_table_under_dtype_casts():
    m = rope_ext.RotaryEmbedding(32, max_position=64).to(torch.bfloat16)
    assert m.cos_sin_cache.dtype == torch.float32
    torch.testing.assert_close(m.cos_sin_cache, rope_ext.cos_sin_cache(64, 32), rtol=0, atol=0)
    q = torch.randn(3, 2, 32, dtype=torch.bfloat16)
    q2, _ = m(q, None, torch.tensor([1, 2, 63]))
    assert q2.dtype == torch.bfloat16


def test_rotary_embedding_rejects_out_of_range_positions():
    m = rope_ext.RotaryEmbedding(16, max_position=8)
    with pytest.raises(RuntimeError, match=r"positions must lie in \[0, 8\)"):
        m(torch.randn(2, 1, 16), None, torch.tensor([3, 8]))
    with pytest.raises(RuntimeError, match=r"got -1"):
        m(torch.randn(2, 1, 16), None, torch.tensor([-1, 0]))
