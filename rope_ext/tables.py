"""The cos/sin table a model's positions index: row p = [cos(p * w_i) | sin(p * w_i)], i < rotary_dim/2
(docs/math.md "The cos/sin table")."""

import torch

from ._args import check_int, check_positive
from ._checks import FLOAT_DTYPES
from .scaling import rope_parameters


def cos_sin_rows(positions, inv_freq, attention=1.0, dtype=torch.float32):
    """Rows [a cos(p w_i) | a sin(p w_i)] for each p of `positions` (any shape, any device):
    shape positions.shape + (2 * len(inv_freq),). Angles in float64 (inv_freq is upcast), rounded
    once to `dtype`; `attention` (a float or a 0-d tensor) scales both halves."""
    angles = positions.to(torch.float64).unsqueeze(-1) * inv_freq.to(torch.float64)
    return (torch.cat((angles.cos(), angles.sin()), dim=-1) * attention).to(dtype)


# Rows per pass when building a table: bounds the float64 temporaries of long tables (a
# 262144-row table would otherwise hold several float64 copies at once).
_CHUNK_ROWS = 1 << 15


def table_rows(length, inv_freq, attention=1.0, dtype=torch.float32, device=None):
    """cos_sin_rows for positions 0 .. length-1, built in chunks; the same values."""
    half = inv_freq.shape[0]
    out = torch.empty(length, 2 * half, dtype=dtype, device=device)
    for start in range(0, length, _CHUNK_ROWS):
        stop = min(start + _CHUNK_ROWS, length)
        pos = torch.arange(start, stop, dtype=torch.float64, device=device)
        out[start:stop] = cos_sin_rows(pos, inv_freq, attention, torch.float64)  # rounded once here
    return out


def _check_table_dtype(dtype, fn):
    if dtype not in FLOAT_DTYPES:  # what the ops read
        raise ValueError(f"{fn}: dtype must be torch.float16, torch.bfloat16, torch.float32 or "
                         f"torch.float64, got {dtype}")


def check_base(base, fn):
    """The RoPE base: a finite number > 0 (0, a negative or an infinite one gives no table)."""
    return check_positive(base, f"{fn}: base")


def _check_table_args(max_position, rotary_dim, base):
    check_int(max_position, "cos_sin_cache: max_position", 1)
    check_int(rotary_dim, "cos_sin_cache: rotary_dim", 1)
    if max_position * (rotary_dim + 1) * 8 >= 2**63:  # (its bytes in the widest dtype, float64)
        raise ValueError(f"cos_sin_cache: a table of max_position x rotary_dim = {max_position} x "
                         f"{rotary_dim} elements is larger than a tensor can hold")
    check_base(base, "cos_sin_cache")


def cos_sin_cache(max_position, rotary_dim, *, base=10000.0, scaling=None, dtype=torch.float32,
                  device=None, seq_len=None):
    """The (max_position, rotary_dim) table: cos in the first rotary_dim/2 columns, sin in the
    rest. An odd rotary_dim d gives a table of d + 1 columns, as transformers rotates for it
    (rope_ext.scaling.rotated_dims). Angles and cos/sin are computed in float64 and rounded once to `dtype`, so the table is
    exact to the stored dtype's rounding even at position 1,000,000.

    scaling: a `rope_scaling` dict (linear, dynamic, yarn, deepseek_yarn, llama3, longrope; see
    rope_ext.scaling), or None. Its attention factor multiplies cos and sin.
    seq_len: the sequence length the table serves, for `dynamic` and `longrope` (default
    max_position). One fixed table: RotaryEmbedding is what follows the length call by call."""
    _check_table_args(max_position, rotary_dim, base)
    _check_table_dtype(dtype, "cos_sin_cache")
    if seq_len is not None:
        check_int(seq_len, "cos_sin_cache: seq_len", 1)
    inv_freq, attention = rope_parameters(scaling, rotary_dim, base, max_position, seq_len, device)
    return table_rows(max_position, inv_freq, attention, dtype, device)


def _check_axes(positions, axes_dim, theta):
    if not isinstance(positions, torch.Tensor) or positions.dim() < 1 or positions.dtype == torch.bool \
            or positions.is_complex():
        got = f"{positions.dtype} of shape {list(positions.shape)}" if isinstance(positions, torch.Tensor) \
            else type(positions).__name__
        raise ValueError(f"multi_axis_cos_sin: positions must be a real tensor (..., n_axes), got {got}")
    try:  # a list, a tuple, a range, a config's list type
        dims = None if isinstance(axes_dim, (str, bytes)) else list(axes_dim)
    except TypeError:
        dims = None
    if not dims or any(isinstance(d, bool) or not isinstance(d, int) or d < 2 or d % 2 for d in dims):
        raise ValueError(f"multi_axis_cos_sin: axes_dim must be a non-empty sequence of positive even "
                         f"ints, got {axes_dim!r}")
    if positions.shape[-1] != len(dims):
        raise ValueError(f"multi_axis_cos_sin: positions of shape {list(positions.shape)} must have "
                         f"len(axes_dim) = {len(dims)} axes in its last dim")
    thetas = list(theta) if isinstance(theta, (list, tuple)) else [theta] * len(dims)
    if len(thetas) != len(dims):
        raise ValueError(f"multi_axis_cos_sin: theta must be a positive number or one per axis "
                         f"({len(dims)}), got {theta!r}")
    return dims, [check_positive(t, "multi_axis_cos_sin: theta") for t in thetas]


def multi_axis_cos_sin(positions, axes_dim, theta=10000.0, *, dtype=torch.float32):
    """cos and sin tables for N-axis positions (docs/math.md "Multi-axis tables"): positions
    (..., n_axes), integer or float (FLUX's ids, Wan's and HunyuanVideo's frame/height/width);
    axes_dim: n_axes even ints; theta: one base, or one per axis. Axis a owns axes_dim[a] / 2
    consecutive pairs, in axis order; its pair j turns by positions[..., a] / theta_a^(2j / d_a).
    Returns (cos, sin), each positions.shape[:-1] + (sum(axes_dim) / 2,), one entry per pair, on
    positions' device: angles and cos/sin in float64, rounded once to `dtype`. They serve
    rope_ext.apply_rope directly (a heads dim of size 1 to broadcast); diffusers' full-width
    (cos, sin) is each repeated per pair (repeat_interleave(2, -1))."""
    dims, thetas = _check_axes(positions, axes_dim, theta)
    _check_table_dtype(dtype, "multi_axis_cos_sin")
    pos = positions.to(torch.float64)
    angles = []
    for a, (d, t) in enumerate(zip(dims, thetas)):
        inv_freq = 1.0 / (t ** (torch.arange(0, d, 2, dtype=torch.float64, device=pos.device) / d))
        angles.append(pos[..., a, None] * inv_freq)
    angles = torch.cat(angles, dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)
