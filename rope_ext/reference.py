"""Pure-PyTorch RoPE: the fallback wherever no native kernel serves, and the readable spec.

Same signatures, semantics and errors as the native ops (see README "The ops"). Math in float32
(float64 for float64 inputs), like the kernels.
"""

import torch

from . import _checks
from .cache import cos_sin_cache  # noqa: F401  (the table is the same computation on every path)

__all__ = ["apply_mrope_", "apply_rope", "apply_rope_out", "apply_rope_backward", "apply_rope_", "cos_sin_cache", "table_grads"]


def _acc_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _split_pairs(x, half, interleaved):
    """(first, second) members of each rotary pair of x[..., :2*half]."""
    if interleaved:
        return x[..., 0 : 2 * half : 2], x[..., 1 : 2 * half : 2]
    return x[..., :half], x[..., half : 2 * half]


def _join_pairs(first, second, interleaved):
    if interleaved:
        return torch.stack((first, second), dim=-1).flatten(-2)
    return torch.cat((first, second), dim=-1)


def _rotate(x, cos, sin, interleaved, inverse):
    half = cos.shape[-1]
    acc = _acc_dtype(x.dtype)
    a, b = _split_pairs(x.to(acc), half, interleaved)
    c, s = cos.to(acc), sin.to(acc)
    if inverse:
        s = -s
    rotated = _join_pairs(a * c - b * s, b * c + a * s, interleaved).to(x.dtype)
    return torch.cat((rotated, x[..., 2 * half :]), dim=-1)


def apply_rope(x, cos, sin, *, interleaved=False):
    """Rotated copy of x; cos/sin of shape (..., rotary_dim/2) broadcast to x.shape[:-1]."""
    _checks.check_apply(x, cos, sin)
    return _rotate(x, cos, sin, interleaved, inverse=False)


def apply_rope_out(x, cos, sin, *, interleaved=False, out):
    """apply_rope written into `out` (x's shape and dtype, contiguous, sharing no memory with the
    inputs); returns out (the op rope.apply.out returns nothing)."""
    _checks.check_apply_out(x, cos, sin, out)
    return out.copy_(_rotate(x, cos, sin, interleaved, inverse=False))


def apply_rope_backward(grad, cos, sin, *, interleaved=False):
    """Gradient of apply_rope w.r.t. x: the inverse rotation of grad."""
    _checks.check_apply(grad, cos, sin, op="rope.apply_backward", x_name="grad")
    return _rotate(grad, cos, sin, interleaved, inverse=True)


def table_grads(x, grad, cos, sin, interleaved, inverse=False):
    """Gradients w.r.t. cos and sin of apply (inverse=False) or apply_backward (True), summed
    over the dims along which the tables were broadcast (ROPE.md section 4)."""
    half = cos.shape[-1]
    acc = _acc_dtype(x.dtype)
    a, b = _split_pairs(x.to(acc), half, interleaved)
    ga, gb = _split_pairs(grad.to(acc), half, interleaved)
    d_cos = ga * a + gb * b
    d_sin = gb * a - ga * b
    if inverse:
        d_sin = -d_sin
    return (
        d_cos.sum_to_size(cos.shape).to(cos.dtype),
        d_sin.sum_to_size(sin.shape).to(sin.dtype),
    )


def apply_rope_(query, key, positions, cos_sin_cache, *, interleaved=False):
    """Rotates query (and key, unless None) in place by the cache rows at `positions`."""
    _checks.check_apply_inplace(query, key, positions, cos_sin_cache)
    _checks.check_positions_in_range(positions, cos_sin_cache.shape[0])
    half = cos_sin_cache.shape[1] // 2
    rows = cos_sin_cache[positions.long()].unsqueeze(-2)  # (..., 1, rotary_dim)
    cos, sin = rows[..., :half], rows[..., half:]
    for t in (query, key):
        if t is not None:
            t.copy_(_rotate(t, cos, sin, interleaved, inverse=False))
    return query, key


def mrope_tables(positions, cos_sin_cache, mrope_section):
    """cos, sin of shape positions.shape[1:] + (rotary_dim/2,): pair i of a token takes its
    angle from the position component j of the section that holds i."""
    half = cos_sin_cache.shape[1] // 2
    cos_parts, sin_parts, lo = [], [], 0
    for j, n in enumerate(mrope_section):
        rows = cos_sin_cache[positions[j].long()]  # (..., rotary_dim)
        cos_parts.append(rows[..., lo : lo + n])
        sin_parts.append(rows[..., half + lo : half + lo + n])
        lo += n
    return torch.cat(cos_parts, dim=-1), torch.cat(sin_parts, dim=-1)


def apply_mrope_(query, key, positions, cos_sin_cache, mrope_section, *, interleaved=False):
    """Multimodal RoPE in place: positions (3,) + query.shape[:-2] (temporal, height, width);
    mrope_section splits the rotary_dim/2 pairs, in order, into 3 groups."""
    _checks.check_mrope(query, key, positions, cos_sin_cache, mrope_section)
    _checks.check_positions_in_range(positions, cos_sin_cache.shape[0], op="rope.mrope_")
    cos, sin = mrope_tables(positions, cos_sin_cache, mrope_section)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # broadcast over heads
    for t in (query, key):
        if t is not None:
            t.copy_(_rotate(t, cos, sin, interleaved, inverse=False))
    return query, key
