"""The public functions. Each calls its torch.ops.rope op; the dispatcher picks the native kernel
for the tensors' device, or the reference where none is registered (see `backend`)."""

import torch

from . import _native


def apply_rope(x, cos, sin, *, interleaved=False, out=None):
    """RoPE of x, returned as a new tensor of x's shape and dtype, or written into `out`.

    x: (..., head_dim), float16/bfloat16/float32/float64, any strides.
    cos, sin: (..., rotary_dim/2), equal shapes, broadcastable to x.shape[:-1]; any float dtype.
    interleaved: pairs (x[2i], x[2i+1]) if True, (x[i], x[i + rotary_dim/2]) if False.
    Dims >= rotary_dim are copied unchanged. Differentiable w.r.t. x, cos and sin.
    out: a contiguous tensor of x's shape, dtype and device, sharing no memory with x, cos or
    sin; it is overwritten and returned (rope.apply.out). It saves allocating a fresh output,
    which on large tensors is most of the cost (README "CPU performance"). Like torch's out=
    arguments, not differentiable.
    """
    if out is None:
        return torch.ops.rope.apply(x, cos, sin, interleaved)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x, cos, sin, out)):
        raise RuntimeError(
            "apply_rope(): functions with out=... arguments don't support automatic "
            "differentiation, but one of the arguments requires grad."
        )
    torch.ops.rope.apply.out(x, cos, sin, interleaved, out=out)
    return out


def apply_rope_(query, key, positions, cos_sin_cache, *, interleaved=False):
    """Rotates query (..., Hq, D) and key (..., Hk, D) (or None) in place by the rows of
    cos_sin_cache (max_position, rotary_dim) at positions (query.shape[:-2], int32/int64).
    Returns (query, key)."""
    torch.ops.rope.apply_(query, key, positions, cos_sin_cache, interleaved)
    return query, key


def apply_mrope_(query, key, positions, cos_sin_cache, mrope_section, *, interleaved=False):
    """Multimodal RoPE (Qwen2-VL family) in place: positions (3,) + query.shape[:-2] hold the
    (temporal, height, width) components; mrope_section (3 ints summing to rotary_dim/2) splits
    the pairs, in order, into 3 groups and group j is rotated by the angle of component j.
    Tokens whose 3 components are equal get exactly apply_rope_. Returns (query, key)."""
    torch.ops.rope.mrope_(query, key, positions, cos_sin_cache, list(mrope_section), interleaved)
    return query, key


def backend(device="cpu"):
    """Which implementation serves tensors on `device`: "native" or "reference"."""
    return "native" if _native.has_kernel(torch.device(device).type) else "reference"
