"""rope_ext.tables.multi_axis_cos_sin: N-axis position tables (FLUX ids, video frame/height/
width) against a float64 oracle written from docs/math.md, and the rotation they drive."""

import math

import pytest
import torch

from conftest import TOL
from rope_ext import apply_rope
from rope_ext.tables import multi_axis_cos_sin


def oracle_angles(positions, axes_dim, thetas):
    """Angles (tokens, sum(axes_dim) / 2) pair by pair, in Python floats."""
    rows = []
    for p in positions.double().tolist():
        row = []
        for a, (d, t) in enumerate(zip(axes_dim, thetas)):
            row += [p[a] / t ** (2 * j / d) for j in range(d // 2)]
        rows.append(row)
    return torch.tensor(rows, dtype=torch.float64)


@pytest.mark.parametrize("axes_dim, theta", [((16, 56, 56), 10000.0), ((4, 6, 6), 256.0),
                                              ((8, 8, 8, 8), 2000.0), ((12, 20), (10000.0, 500.0))])
@pytest.mark.parametrize("kind", ["int", "float"])
def test_tables_match_the_oracle(axes_dim, theta, kind):
    n = len(axes_dim)
    if kind == "int":
        pos = torch.randint(0, 4096, (33, n))
    else:
        pos = torch.rand(33, n, dtype=torch.float64) * 300 - 20  # fractional, negative too
    thetas = list(theta) if isinstance(theta, tuple) else [theta] * n
    want = oracle_angles(pos, axes_dim, thetas)
    cos, sin = multi_axis_cos_sin(pos, axes_dim, theta)
    assert cos.dtype == sin.dtype == torch.float32
    assert cos.shape == sin.shape == (33, sum(axes_dim) // 2)
    # Exact to float32 rounding of a float64 value: within one float32 ulp of the oracle.
    torch.testing.assert_close(cos.double(), want.cos(), rtol=0, atol=2 ** -24)
    torch.testing.assert_close(sin.double(), want.sin(), rtol=0, atol=2 ** -24)
    cos64, sin64 = multi_axis_cos_sin(pos, axes_dim, theta, dtype=torch.float64)
    torch.testing.assert_close(cos64, want.cos(), rtol=0, atol=1e-9)
    torch.testing.assert_close(sin64, want.sin(), rtol=0, atol=1e-9)


def test_leading_dims_and_each_axis_moves_only_its_pairs():
    axes_dim = (4, 6, 6)
    pos = torch.randint(0, 50, (2, 7, 3))
    cos, sin = multi_axis_cos_sin(pos, axes_dim)
    assert cos.shape == (2, 7, 8)
    flat_cos, _ = multi_axis_cos_sin(pos.reshape(14, 3), axes_dim)
    assert torch.equal(cos.reshape(14, 8), flat_cos)
    moved = pos.clone()
    moved[..., 1] += 5  # the height axis only
    cos2, _ = multi_axis_cos_sin(moved, axes_dim)
    assert torch.equal(cos2[..., :2], cos[..., :2]) and torch.equal(cos2[..., 5:], cos[..., 5:])
    assert not torch.equal(cos2[..., 2:5], cos[..., 2:5])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interleaved", [True, False])
def test_rotation_with_multi_axis_tables(dtype, interleaved):
    T, H, axes_dim = 40, 3, (8, 12, 12)
    D = sum(axes_dim)
    pos = torch.rand(T, 3) * 64
    cos, sin = multi_axis_cos_sin(pos, axes_dim, 10000.0)
    x = torch.randn(T, H, D, dtype=dtype)
    got = apply_rope(x, cos[:, None], sin[:, None], interleaved=interleaved)
    ang = oracle_angles(pos, axes_dim, [10000.0] * 3)[:, None]
    xd = x.double()
    if interleaved:
        a, b = xd[..., 0::2], xd[..., 1::2]
        want = torch.stack((a * ang.cos() - b * ang.sin(), b * ang.cos() + a * ang.sin()), -1).flatten(-2)
    else:
        a, b = xd[..., : D // 2], xd[..., D // 2 :]
        want = torch.cat((a * ang.cos() - b * ang.sin(), b * ang.cos() + a * ang.sin()), -1)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(got.double(), want, rtol=rtol, atol=atol)


@pytest.mark.parametrize("args, match", [
    ((torch.zeros(4, 2), (4, 6, 6)), "len\\(axes_dim\\) = 3"),
    ((torch.zeros(4, 3), (4, 5, 6)), "axes_dim must be"),
    ((torch.zeros(4, 3), ()), "axes_dim must be"),
    ((torch.zeros(4, 3, dtype=torch.bool), (4, 6, 6)), "positions must be a real tensor"),
    ((torch.zeros(4, 3), (4, 6, 6), 0.0), "theta must be"),
    ((torch.zeros(4, 3), (4, 6, 6), (1.0, 2.0)), "theta must be"),
    (([[0, 1, 2]], (4, 6, 6)), "positions must be a real tensor"),
])
def test_errors_name_the_argument(args, match):
    with pytest.raises(ValueError, match=match):
        multi_axis_cos_sin(*args)


def test_large_positions_keep_float64_angles():
    pos = torch.tensor([[1_000_003, 7]], dtype=torch.int64)
    cos, _ = multi_axis_cos_sin(pos, (2, 2))
    assert abs(cos[0, 0].item() - math.cos(1_000_003)) < 2 ** -24
