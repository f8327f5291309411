"""The public functions. Each calls its torch.ops.rope op; the dispatcher picks the native kernel
for the tensors' device, or the reference where none is registered (see `backend`)."""

import numbers

import torch

from . import _library, reference
from ._registrations import OUT_NOT_DIFFERENTIABLE, check_not_inference

ops = torch.ops.rope


def check_head_size(head_size):
    """head_size as an int, or a ValueError naming it."""
    if isinstance(head_size, bool) or not isinstance(head_size, numbers.Integral) or head_size < 1:
        raise ValueError(f"head_size must be a positive int, got {head_size!r}")
    return int(head_size)


def _heads(t, head_size, name):
    """t (..., H * head_size) viewed as (..., H, head_size); t itself when head_size is None."""
    if head_size is None or t is None:
        return t
    head_size = check_head_size(head_size)
    if t.dim() < 1 or t.shape[-1] % head_size:
        raise ValueError(f"{name} of shape {list(t.shape)}: its last dim must be a multiple of "
                         f"head_size = {head_size} (flat (..., num_heads * head_size) layout)")
    return t.unflatten(-1, (t.shape[-1] // head_size, head_size))


def _table_halves(cos_sin_cache):
    """The cos and sin halves of a (max_position, rotary_dim) table, checked."""
    if cos_sin_cache.dim() != 2:
        raise RuntimeError("apply_rope_at: cos_sin_cache must have shape (max_position, rotary_dim), "
                           f"got {list(cos_sin_cache.shape)}")
    if cos_sin_cache.shape[1] % 2:
        raise RuntimeError(f"apply_rope_at: rotary_dim = cos_sin_cache.size(1) = "
                           f"{cos_sin_cache.shape[1]} must be even")
    return reference.cache_halves(cos_sin_cache)


def apply_rope(x, cos, sin, *, interleaved=False, out=None):
    """RoPE of x, returned as a new tensor of x's shape and dtype, or written into `out`.

    x: (..., head_dim), float16/bfloat16/float32/float64, any strides.
    cos, sin: (..., rotary_dim/2), equal shapes, with x's number of dims (each x's size or 1), or
    one row (rotary_dim/2,) for every position; any float dtype.
    interleaved: pairs (x[2i], x[2i+1]) if True, (x[i], x[i + rotary_dim/2]) if False.
    Dims >= rotary_dim are copied unchanged. Differentiable w.r.t. x, cos and sin.
    out: a contiguous tensor of x's shape, dtype and device, sharing no memory with x, cos or
    sin; overwritten and returned (rope.apply.out). Like torch's out= arguments, not
    differentiable.
    """
    if out is None:
        return ops.apply(x, cos, sin, interleaved)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x, cos, sin, out)):
        raise RuntimeError(f"apply_rope(): {OUT_NOT_DIFFERENTIABLE}")
    check_not_inference(out)
    ops.apply.out(x, cos, sin, interleaved, out=out)
    return out


def apply_rope_(query, key, positions, cos_sin_cache, *, interleaved=False, head_size=None,
                rope_dim_offset=0, inverse=False):
    """Rotates query (..., Hq, D) and key (..., Hk, D) (or None) in place by the rows of
    cos_sin_cache (max_position, rotary_dim) at positions (query.shape[:-2], int32/int64).
    head_size: query/key are flat (..., H * head_size), as vLLM and FlashInfer take them.
    rope_dim_offset: the rotary dims are [rope_dim_offset, rope_dim_offset + rotary_dim) of each
    head (DeepSeek-V4 rotates the tail: head_dim - rotary_dim); the others stay as they are.
    inverse: rotate by the negative angle (undoes the rotation of the same positions).
    Differentiable like torch's in-place ops. Returns (query, key)."""
    check_not_inference(query, key)
    ops.apply_(_heads(query, head_size, "query"), _heads(key, head_size, "key"), positions,
               cos_sin_cache, interleaved, rope_dim_offset, inverse)
    return query, key


def apply_mrope_(query, key, positions, cos_sin_cache, mrope_section, *, interleaved=False,
                 mrope_interleaved=False, head_size=None, rope_dim_offset=0, inverse=False):
    """Multimodal RoPE (Qwen2-VL, Qwen3-VL) in place: positions (3,) + query.shape[:-2] hold the
    (temporal, height, width) components; mrope_section (3 ints summing to rotary_dim/2) splits
    the pairs into 3 groups, in order (chunked) or T,H,W,T,H,W,... (mrope_interleaved, Qwen3-VL),
    and group j is rotated by component j. Tokens whose 3 components are equal get exactly
    apply_rope_. rope_dim_offset and inverse as for apply_rope_. Differentiable like apply_rope_.
    Returns (query, key)."""
    check_not_inference(query, key)
    ops.mrope_(_heads(query, head_size, "query"), _heads(key, head_size, "key"), positions,
               cos_sin_cache, [int(s) for s in mrope_section], interleaved, mrope_interleaved,
               rope_dim_offset, inverse)
    return query, key


def apply_rope_at(x, positions, cos_sin_cache, *, interleaved=False, mrope_section=None,
                  mrope_interleaved=False, head_size=None):
    """Rotated copy of x (..., H, D) by the rows of cos_sin_cache (max_position, rotary_dim) at
    positions (x.shape[:-2]; (3,) + x.shape[:-2] with mrope_section): the out-of-place,
    differentiable twin of apply_rope_ (gradients w.r.t. x and the table)."""
    cos, sin = _table_halves(cos_sin_cache)
    xv = _heads(x, head_size, "x")
    section = None if mrope_section is None else [int(s) for s in mrope_section]
    out = ops.apply_positions(xv, positions, cos, sin, interleaved, False, section,
                              mrope_interleaved)
    return out if head_size is None else out.flatten(-2)


def varlen_positions(cu_seqlens, total_tokens, seqlen_offsets=0, *, dtype=torch.int64):
    """Positions of packed variable-length sequences: token t of sequence b (tokens
    cu_seqlens[b] .. cu_seqlens[b+1]-1 of a (total_tokens, ...) batch) gets position
    t - cu_seqlens[b] + offset_b, offset_b = seqlen_offsets (an int) or seqlen_offsets[b] (a
    tensor (B,)). No host-device sync, so it runs under torch.compile and CUDA graphs. Tokens
    past cu_seqlens[-1] get position -1, which every op rejects."""
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1 or cu_seqlens.is_floating_point():
        raise ValueError(f"cu_seqlens must be a 1-D integer tensor (B + 1,), got "
                         f"{cu_seqlens.dtype} of shape {list(cu_seqlens.shape)}")
    batch = cu_seqlens.numel() - 1
    token = torch.arange(total_tokens, device=cu_seqlens.device, dtype=torch.int64)
    starts = cu_seqlens.long()
    seq = torch.searchsorted(starts[1:], token, right=True).clamp_max(max(batch - 1, 0))
    pos = token - starts[seq]
    if isinstance(seqlen_offsets, torch.Tensor):
        if seqlen_offsets.shape != (batch,):
            raise ValueError(f"seqlen_offsets must be an int or a tensor of shape ({batch},), got "
                             f"shape {list(seqlen_offsets.shape)}")
        pos = pos + seqlen_offsets.long()[seq]
    else:
        pos = pos + int(seqlen_offsets)
    pos = torch.where(token < starts[-1], pos, -1)
    return pos.to(dtype)


def apply_rope_and_cache_(query, key, value, positions, cos_sin_cache, key_cache, value_cache,
                          slot_mapping, *, interleaved=False, kv_cache_dtype="auto", k_scale=None,
                          v_scale=None):
    """Serving: rotates query (T, Hq, D) and key (T, Hk, D) in place by the cache rows at
    positions (T,), and writes the rotated key and value (T, Hk, Dv) into the paged caches
    key_cache (num_blocks, block_size, Hk, D) / value_cache (num_blocks, block_size, Hk, Dv) at
    slot_mapping (T,) (slot = block * block_size + offset; negative slots are padding, skipped),
    in one pass. kv_cache_dtype "auto" stores the key's dtype; "fp8" / "fp8_e4m3" / "fp8_e5m2"
    store value / scale saturated, with float32 scale tensors k_scale, v_scale. Returns
    (query, key)."""
    check_not_inference(query, key, key_cache, value_cache)
    ops.apply_and_cache_(query, key, value, positions, cos_sin_cache, key_cache, value_cache,
                         slot_mapping, interleaved, kv_cache_dtype, k_scale, v_scale)
    return query, key


def backend(device="cpu"):
    """Which implementation serves tensors on `device`: "native" or "reference"."""
    return "native" if _library.has_kernel(torch.device(device).type) else "reference"
