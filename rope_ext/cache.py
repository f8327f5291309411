"""The cos/sin table of ROPE.md section 5: cache[pos] = [cos(pos * w_i) | sin(pos * w_i)]."""

import torch

from .scaling import rope_parameters


def inv_frequencies(rotary_dim, base=10000.0, *, device=None):
    """w_i = base^(-2i/rotary_dim) for i < rotary_dim/2, in float64."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float64, device=device) / rotary_dim
    return 1.0 / (float(base) ** exponents)


def _check_table_args(max_position, rotary_dim, base):
    if not isinstance(max_position, int) or max_position < 1:
        raise ValueError(f"cos_sin_cache: max_position must be a positive int, got {max_position!r}")
    if not isinstance(rotary_dim, int) or rotary_dim < 2 or rotary_dim % 2:
        raise ValueError(f"cos_sin_cache: rotary_dim must be a positive even int, got {rotary_dim!r}")
    if not float(base) > 0:
        raise ValueError(f"cos_sin_cache: base must be > 0, got {base!r}")


def cos_sin_cache(max_position, rotary_dim, *, base=10000.0, scaling=None, dtype=torch.float32,
                  device=None, seq_len=None):
    """The (max_position, rotary_dim) table: cos in the first rotary_dim/2 columns, sin in the
    rest. Angles and cos/sin are computed in float64 and rounded once to `dtype`, so the table is
    exact to the stored dtype's rounding even at position 1,000,000.

    scaling: a config's `rope_scaling` dict (linear, dynamic, yarn, llama3, longrope; see
    rope_ext.scaling), or None. Its attention factor multiplies cos and sin.
    seq_len: the sequence length the table serves, for `dynamic` and `longrope` (default
    max_position)."""
    _check_table_args(max_position, rotary_dim, base)
    if seq_len is not None and (isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1):
        raise ValueError(f"cos_sin_cache: seq_len must be a positive int or None, got {seq_len!r}")
    inv_freq, attention = rope_parameters(scaling, rotary_dim, base, max_position, seq_len, device)
    pos = torch.arange(max_position, dtype=torch.float64, device=device)
    angles = torch.outer(pos, inv_freq)
    return (torch.cat((angles.cos(), angles.sin()), dim=-1) * attention).to(dtype)
