"""Meta's Llama reference RoPE (`llama/model.py`) and torchtitan's (`models/llama3/model/model.py`,
the same complex multiply, with its `positions`) on rope_ext's op.

    from llama.model import apply_rotary_emb, precompute_freqs_cis
 -> from rope_ext.compat.llama import apply_rotary_emb, precompute_freqs_cis

freqs_cis (max_seqlen, head_dim / 2) is complex: pair (2i, 2i+1) of every head of token s, read as
the complex number x[2i] + j x[2i+1], is multiplied by freqs_cis[s, i] (any value: the table need
not be unit-modulus), or by freqs_cis[positions[b, s], i] with torchtitan's positions. The result
is the reference's: its shape (for 4-D xq/xk their own), its dtypes (xq's and xk's), gradients
w.r.t. xq, xk and freqs_cis. Arithmetic in float32 as the reference's complex64 multiply
(float64 with a complex128 table, as its multiply promotes), one rounding to the output dtype
(float64 inputs: float64, where the reference rounds them to float32 first). Arguments the
reference asserts on or fails on raise a ValueError naming them; a table longer than seqlen is
torchtitan's call, whose first seqlen rows serve.
"""

import torch

from .._args import check_positive
from .._checks import below
from ._layout import check_index_tensor, check_values, float32_table, rotate_pairs_promoted


def inv_freq(dim, theta):
    """The reference's frequencies theta^(-2i/dim), i < dim/2, float32, with its arithmetic (the
    tables are the models' own, bit for bit)."""
    check_positive(theta, "theta")
    return 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))


def cis(end, freqs):
    """exp(j * p * freqs) for positions p = 0 .. end - 1: complex64 (end, len(freqs))."""
    angles = torch.outer(torch.arange(end, device=freqs.device), freqs).float()
    return torch.polar(torch.ones_like(angles), angles)


def precompute_freqs_cis(dim, end, theta=10000.0):
    """The reference's table: complex64 (end, dim // 2), row p = exp(j * p * theta^(-2i/dim))."""
    return cis(end, inv_freq(dim, theta))


def _check_x(x, name):
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() < 3 or x.shape[-1] % 2:
        got = f"{x.dtype} of shape {list(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{name} must be a floating-point tensor (bsz, seqlen, n_heads, head_dim) with "
                         f"an even head_dim, got {got}")


def cos_sin(freqs_cis):
    """(cos, sin): the real and imaginary parts of a complex table (views), or a real table and
    zeros (the reference multiplies by a real table too). A conjugate view (`freqs_cis.conj()`,
    the inverse rotation) is resolved first: view_as_real refuses it."""
    if freqs_cis.is_complex():
        # (dynamo cannot trace is_conj; one unbind makes both views for less than two selects)
        return torch.view_as_real(freqs_cis.resolve_conj()).unbind(-1)
    return freqs_cis, torch.zeros_like(freqs_cis)


def _rotated(x, cos, sin):
    out = rotate_pairs_promoted(x, cos, sin, interleaved=True)
    # the reference's shape: its view_as_real(...).flatten(3) (x itself for 4-D x)
    return out if x.dim() == 4 else out.unflatten(-1, (-1, 2)).flatten(3)


def _rows(freqs_cis, positions, xq):
    """The table rows of xq's tokens, (P, seqlen, pairs): torchtitan's reshape_for_broadcast
    (the first seqlen rows, or those at positions (1 or bsz, seqlen)); P = 1 without positions."""
    seqlen, pairs = xq.shape[1], xq.shape[-1] // 2
    if not isinstance(freqs_cis, torch.Tensor) or freqs_cis.dim() != 2 or (
            freqs_cis.shape[1] != pairs or (positions is None and freqs_cis.shape[0] < seqlen)):
        got = list(freqs_cis.shape) if isinstance(freqs_cis, torch.Tensor) else type(freqs_cis).__name__
        raise ValueError(f"freqs_cis must have shape (max_seqlen, head_dim / 2) with max_seqlen >= "
                         f"seqlen = {seqlen} and head_dim / 2 = {pairs} for xq of shape "
                         f"{list(xq.shape)}, got {got}")
    if positions is None:
        return freqs_cis[None, :seqlen]
    check_index_tensor(positions, "positions")
    if positions.dim() != 2 or positions.shape[1] != seqlen or positions.shape[0] not in (1, xq.shape[0]):
        raise ValueError(f"positions must have shape (1, seqlen) or (bsz, seqlen) = (1 or "
                         f"{xq.shape[0]}, {seqlen}), got {list(positions.shape)}")
    if positions.device != freqs_cis.device:
        raise ValueError(f"positions must be on freqs_cis's device ({freqs_cis.device}), got "
                         f"{positions.device}")
    check_values((positions >= 0) & below(positions, freqs_cis.shape[0]),
                 f"positions must lie in [0, freqs_cis.size(0)) = [0, {freqs_cis.shape[0]})")
    return freqs_cis[positions]


def apply_rotary_emb(xq, xk, freqs_cis, positions=None):
    """xq (bsz, seqlen, n_heads, head_dim) and xk (bsz, seqlen, n_kv_heads, head_dim) rotated by
    freqs_cis (max_seqlen, head_dim / 2): its first seqlen rows (Meta's reference requires exactly
    seqlen; torchtitan slices them), or with torchtitan's positions (1 or bsz, seqlen) the rows at
    them; placed at dims 0-1 and -1 (reshape_for_broadcast). Returns (xq_out, xk_out) in xq's and
    xk's dtypes."""
    _check_x(xq, "xq")
    _check_x(xk, "xk")
    if xk.dim() != xq.dim() or xk.shape[1] != xq.shape[1] or xk.shape[-1] != xq.shape[-1]:
        raise ValueError(f"xk of shape {list(xk.shape)} must have xq's number of dims, seqlen and "
                         f"head_dim (xq: {list(xq.shape)})")
    if isinstance(freqs_cis, torch.Tensor) and not (freqs_cis.is_complex() or freqs_cis.is_floating_point()):
        raise ValueError(f"freqs_cis must be a complex (or real floating-point) tensor, got "
                         f"{freqs_cis.dtype}")
    rows = _rows(freqs_cis, positions, xq)
    if freqs_cis.device != xq.device:
        raise ValueError(f"freqs_cis must be on xq's device ({xq.device}), got {freqs_cis.device}")
    place = [rows.shape[0], xq.shape[1]] + [1] * (xq.dim() - 3) + [rows.shape[-1]]
    cos, sin = (float32_table(part).reshape(place) for part in cos_sin(rows))
    return _rotated(xq, cos, sin), _rotated(xk, cos, sin)
