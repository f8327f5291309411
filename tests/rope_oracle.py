"""An independent float64 RoPE for the tests: complex multiplication, as RoPE is first written,
z'_i = z_i * e^{i theta}. Deliberately shares no code with rope_ext.reference."""

import torch


def table_for(positions, rotary_dim, base=10000.0):
    """cos, sin of shape positions.shape + (rotary_dim/2,), float64."""
    i = torch.arange(rotary_dim // 2, dtype=torch.float64)
    w = base ** (-2.0 * i / rotary_dim)
    theta = positions.to(torch.float64).unsqueeze(-1) * w
    return theta.cos(), theta.sin()


def rope(x, cos, sin, interleaved, inverse=False):
    """RoPE of x (any float dtype, computed in float64) with cos/sin broadcastable to
    x.shape[:-1] + (rotary_dim/2,). Returns float64."""
    x = x.to(torch.float64)
    half = cos.shape[-1]
    r = 2 * half
    rot = torch.complex(cos.to(torch.float64), (-1.0 if inverse else 1.0) * sin.to(torch.float64))
    head = x[..., :r]
    if interleaved:
        z = torch.complex(head[..., 0::2], head[..., 1::2])
    else:
        z = torch.complex(head[..., :half], head[..., half:])
    z = z * rot
    if interleaved:
        out = torch.stack((z.real, z.imag), dim=-1).flatten(-2)
    else:
        out = torch.cat((z.real, z.imag), dim=-1)
    return torch.cat((out, x[..., r:]), dim=-1)
