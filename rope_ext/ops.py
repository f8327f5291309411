"""The public functions. Each calls its torch.ops.rope op; the dispatcher picks the native kernel
for the tensors' device, or the reference where none is registered (see `backend`)."""

import torch

from . import _library
from ._args import check_dense, check_flag, check_flags, check_int, mrope_section_arg
from ._compiling import compiling
from ._registrations import OUT_NOT_DIFFERENTIABLE, check_not_inference

from ._call import ops  # noqa: E402  (torch.ops.rope, without autograd where none is needed)


def check_head_size(head_size):
    """head_size as an int, or a ValueError naming it."""
    return check_int(head_size, "head_size", 1)


def heads(t, head_size, name, lead=None):
    """t as (..., num_heads, head_size), a view (in-place writes reach the caller's tensor): t is
    flat (..., H * head_size), as vLLM, SGLang and FlashInfer take slices of a fused qkv buffer.
    With `lead` (the number of token dims) t may also be (*lead dims, H, head_size) already.
    None and head_size None give t itself."""
    if t is None or head_size is None:
        return t
    if type(head_size) is not int or head_size < 1:  # the common case costs no call (decode)
        head_size = check_head_size(head_size)
    check_dense(t, name)
    shape = t.shape
    nd = len(shape)
    if lead is not None and nd == lead + 2:
        if shape[-1] != head_size:
            raise ValueError(f"{name} of shape {list(shape)}: its last dim must be head_size = "
                             f"{head_size} in the (num_tokens, num_heads, head_size) layout")
        return t
    if lead is not None and nd != lead + 1:
        raise ValueError(
            f"{name} of shape {list(shape)} must have {lead + 1} dims (tokens, num_heads * head_size) "
            f"or {lead + 2} (tokens, num_heads, head_size) for positions with {lead} dim(s)")
    if nd < 1 or shape[-1] % head_size:
        raise ValueError(f"{name} of shape {list(shape)}: its last dim {shape[-1] if nd else None} "
                         f"must be a multiple of head_size = {head_size} (flat (..., num_heads * head_size) "
                         "layout)")
    return t.view(*shape[:-1], shape[-1] // head_size, head_size)  # ints: the cheapest view call


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
    if interleaved is not False and interleaved is not True:
        check_flag(interleaved, "interleaved")
    if out is None:
        return ops.apply(x, cos, sin, interleaved)
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"apply_rope(): out must be a tensor, got {type(out).__name__}")
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad
                                       for t in (x, cos, sin, out)):  # (else the op names it)
        raise RuntimeError(f"apply_rope(): {OUT_NOT_DIFFERENTIABLE}")
    check_not_inference(out)
    ops.apply.out(x, cos, sin, interleaved, out=out)
    return out


def _rotation_args(interleaved, rope_dim_offset, inverse):
    """The flags and offset of a rotation, checked where torch would take 2, None or "false"
    for a bool and True for an int (before any write)."""
    if not ((interleaved is True or interleaved is False) and (inverse is True or inverse is False)):
        check_flags("interleaved inverse", interleaved, inverse)  # (the test above: 40 ns, this 250)
    if type(rope_dim_offset) is not int or not -2**63 <= rope_dim_offset < 2**63:
        check_int(rope_dim_offset, "rope_dim_offset")


def apply_rope_(query, key, positions, cos_sin_cache, *, interleaved=False, head_size=None,
                rope_dim_offset=0, inverse=False):
    """Rotates query (..., Hq, D) and key (..., Hk, D) (or None) in place by the rows of
    cos_sin_cache (max_position, rotary_dim) at positions (query.shape[:-2], int32/int64).
    head_size: query/key are flat (..., H * head_size), as vLLM and FlashInfer take them.
    rope_dim_offset: the rotary dims are [rope_dim_offset, rope_dim_offset + rotary_dim) of each
    head (DeepSeek-V4 rotates the tail: head_dim - rotary_dim); the others stay as they are.
    inverse: rotate by the negative angle (undoes the rotation of the same positions).
    Differentiable like torch's in-place ops (the op refuses what torch's own in-place ops refuse,
    before anything is written). Returns (query, key)."""
    if head_size is None:
        if interleaved is False and inverse is False and type(rope_dim_offset) is int and \
                rope_dim_offset == 0:  # the defaults, left to torch (each argument given
            ops.apply_(query, key, positions, cos_sin_cache)  # costs 0.15 us to convert)
        else:
            _rotation_args(interleaved, rope_dim_offset, inverse)
            ops.apply_(query, key, positions, cos_sin_cache, interleaved, rope_dim_offset, inverse)
    else:
        _rotation_args(interleaved, rope_dim_offset, inverse)
        ops.apply_(heads(query, head_size, "query"), heads(key, head_size, "key"), positions,
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
    _rotation_args(interleaved, rope_dim_offset, inverse)
    check_flag(mrope_interleaved, "mrope_interleaved")
    ops.mrope_(heads(query, head_size, "query"), heads(key, head_size, "key"), positions,
               cos_sin_cache, mrope_section_arg(mrope_section), interleaved, mrope_interleaved,
               rope_dim_offset, inverse)
    return query, key


def apply_rope_at(x, positions, cos_sin_cache, *, interleaved=False, mrope_section=None,
                  mrope_interleaved=False, head_size=None):
    """Rotated copy of x (..., H, D) by the rows of cos_sin_cache (max_position, rotary_dim) at
    positions (x.shape[:-2]; (3,) + x.shape[:-2] with mrope_section): the out-of-place,
    differentiable twin of apply_rope_ (gradients w.r.t. x and the table)."""
    if interleaved is not False or mrope_interleaved is not False:  # (the defaults cost no call)
        check_flags("interleaved mrope_interleaved", interleaved, mrope_interleaved)
    xv = heads(x, head_size, "x")
    if mrope_section is None and interleaved is False and mrope_interleaved is False:
        # torch fills in the defaults for less than they cost given
        out = ops.apply_positions.cache(xv, positions, cos_sin_cache)
    else:
        section = mrope_section_arg(mrope_section, mrope_interleaved)
        out = ops.apply_positions.cache(xv, positions, cos_sin_cache, interleaved, False, section,
                                        mrope_interleaved)
    return out if head_size is None else out.flatten(-2)


def varlen_positions(cu_seqlens, total_tokens, seqlen_offsets=0, *, dtype=torch.int64):
    """Positions of packed variable-length sequences: token t of sequence b (tokens
    cu_seqlens[b] .. cu_seqlens[b+1]-1 of a (total_tokens, ...) batch) gets position
    t - cu_seqlens[b] + offset_b, offset_b = seqlen_offsets (an int) or seqlen_offsets[b] (an
    integer tensor (B,)). Tokens outside every sequence (before cu_seqlens[0] or from
    cu_seqlens[-1] on) get position -1, which every op rejects. dtype: int64, or int32 where
    every position fits it (checked: on CPU a ValueError, elsewhere a device-side assert). No
    host-device sync, so it runs under torch.compile and CUDA graphs. cu_seqlens must be
    non-decreasing, from >= 0 up to <= total_tokens (checked likewise)."""
    return sequence_positions(cu_seqlens, total_tokens, seqlen_offsets, dtype)


def sequence_positions(cu_seqlens, total_tokens, seqlen_offsets, dtype=torch.int64,
                       names=("cu_seqlens", "total_tokens")):
    """varlen_positions, its bounds' error naming the caller's arguments (a drop-in's)."""
    if (not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1
            or cu_seqlens.dtype not in (torch.int32, torch.int64)):
        got = (f"{cu_seqlens.dtype} of shape {list(cu_seqlens.shape)}" if isinstance(cu_seqlens, torch.Tensor)
               else type(cu_seqlens).__name__)
        raise ValueError(f"cu_seqlens must be a 1-D int32 or int64 tensor (B + 1,), got {got}")
    check_dense(cu_seqlens, "cu_seqlens")
    total_tokens = check_int(total_tokens, "total_tokens", 0)
    if dtype not in (torch.int32, torch.int64):
        raise ValueError(f"dtype must be torch.int32 or torch.int64, got {dtype}")
    batch = cu_seqlens.numel() - 1
    if isinstance(seqlen_offsets, torch.Tensor):
        if seqlen_offsets.shape != (batch,) or seqlen_offsets.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"seqlen_offsets must be an int or an int32/int64 tensor of shape ({batch},), "
                             f"got {seqlen_offsets.dtype} of shape {list(seqlen_offsets.shape)}")
        if seqlen_offsets.device != cu_seqlens.device:
            raise ValueError(f"seqlen_offsets must be on cu_seqlens' device ({cu_seqlens.device}), "
                             f"got {seqlen_offsets.device}")
    else:
        seqlen_offsets = check_int(seqlen_offsets, "seqlen_offsets")  # (int64: checked there)
    starts = cu_seqlens.long()
    _check_bounds(starts, total_tokens, names)
    token, seq = token_sequences(starts, total_tokens)
    pos = token - starts[seq]
    inside = (token >= starts[0]) & (token < starts[-1])
    if isinstance(seqlen_offsets, torch.Tensor):
        offset = seqlen_offsets.long()[seq]
        pos = pos + offset
        _check_int64(pos, offset, inside, seqlen_offsets, total_tokens)
    else:
        pos = pos + seqlen_offsets
        if seqlen_offsets > 2**63 - 1 - total_tokens:  # (rare: the exact check only then)
            _check_int64(pos, seqlen_offsets, inside, None, total_tokens)
    pos = torch.where(inside, pos, -1)
    if dtype == torch.int32 and pos.numel():
        _check_int32(pos)
    return pos.to(dtype)


def token_sequences(starts, total_tokens):
    """(token, seq): the token indices 0 .. total_tokens - 1 (int64) and the sequence each lies in,
    for sequences starting at starts[:-1] (int64 (B + 1,), the last entry the end): the last
    sequence that starts at or before the token (a token past the end counts in the last one,
    a token before the first start in the first). Device ops only: no host-device sync."""
    token = torch.arange(total_tokens, device=starts.device, dtype=torch.int64)
    seq = torch.searchsorted(starts[1:], token, right=True).clamp_max(max(starts.numel() - 2, 0))
    return token, seq


def _check_bounds(starts, total_tokens, names):
    """Sequences laid end to end inside the batch: 0 <= cu_seqlens[0] <= ... <= cu_seqlens[-1] <=
    total_tokens (else positions of overlapping sequences, or of tokens the batch lacks)."""
    cu, total = names
    rule = f"{cu} must be non-decreasing, from >= 0 up to <= {total}"
    if starts.device.type != "cpu" or compiling():  # no sync: a device assert
        # (a traced total_tokens is not formatted: that would specialize the graph to its value)
        torch._assert_async(_bounds_hold(starts, total_tokens),
                            rule if compiling() else f"{rule} = {total_tokens}")
        return
    rule += f" = {total_tokens}"
    if starts.numel() <= 64:  # the usual few sequences: a list is ten times quicker than tensor ops
        v = starts.tolist()
        ok = v[0] >= 0 and v[-1] <= total_tokens and v == sorted(v)
    else:
        ok = bool(_bounds_hold(starts, total_tokens))
    if not ok:
        v = starts.tolist()
        i = next((i for i in range(len(v) - 1) if v[i + 1] < v[i]), None)
        bad = (f"{cu}[{i + 1}] = {v[i + 1]} < {cu}[{i}] = {v[i]}" if i is not None else
               f"{cu}[0] = {v[0]}" if v[0] < 0 else f"{cu}[-1] = {v[-1]}")
        raise ValueError(f"{rule}, got {bad}")


def _bounds_hold(starts, total_tokens):
    return (starts[0] >= 0) & (starts[-1] <= total_tokens) & (starts[1:] >= starts[:-1]).all()


def _check_int64(pos, offset, inside, offsets, total_tokens):
    """A position of a token inside a sequence is its offset plus a count >= 0: below the offset
    it wrapped past int64."""
    if offsets is not None and offsets.dtype == torch.int32:
        return  # (below 2^31 + total_tokens: no position can wrap)
    eager_cpu = pos.device.type == "cpu" and not compiling()
    if offsets is not None and eager_cpu and (
            offsets.numel() == 0 or int(offsets.max()) <= 2**63 - 1 - total_tokens):
        return  # the usual offsets: no position can wrap
    wrapped = inside & (pos < offset)
    if eager_cpu:
        if bool(wrapped.any()):
            i = int(wrapped.nonzero()[0, 0])
            raise ValueError(f"varlen_positions: the position of token {i} (its offset plus "
                             f"{int(pos[i] - offset if offsets is None else pos[i] - offset[i])}) "
                             "does not fit int64")
    else:  # no sync: an assert on the device
        torch._assert_async(~wrapped.any(), "varlen_positions: a position does not fit int64")


def _check_int32(pos):
    low, high = -2**31, 2**31 - 1
    if pos.device.type == "cpu" and not compiling():
        bad = (pos < low) | (pos > high)
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            raise ValueError(f"varlen_positions: position {int(pos[i])} of token {i} does not fit "
                             "dtype int32; use int64")
    else:  # no sync: an assert on the device
        torch._assert_async(((pos >= low) & (pos <= high)).all(),
                            "varlen_positions: a position does not fit dtype int32; use int64")


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
    if interleaved is False and kv_cache_dtype == "auto" and k_scale is None and v_scale is None:
        ops.apply_and_cache_(query, key, value, positions, cos_sin_cache, key_cache, value_cache,
                             slot_mapping)  # the defaults, left to torch (0.6 us at decode)
    else:
        check_flag(interleaved, "interleaved")
        ops.apply_and_cache_(query, key, value, positions, cos_sin_cache, key_cache, value_cache,
                             slot_mapping, interleaved, kv_cache_dtype, k_scale, v_scale)
    return query, key


def backend(device="cpu"):
    """Which implementation serves tensors on `device`: "native" or "reference"."""
    return "native" if _library.has_kernel(torch.device(device).type) else "reference"
