"""The fused QK-RMSNorm + RoPE drop-ins of vLLM and SGLang on rope.qkv_norm_rope_, and vLLM's
whole prologue (norm, RoPE and the paged KV write) on rope.qk_norm_rope_and_cache; re-exported
by rope_ext.compat.vllm and rope_ext.compat.sglang."""

import math
import numbers

import torch

from .._args import check_int
from ..qk_norm import qk_norm_rope_and_cache, qkv_norm_rope_
from ._layout import interleaved_of, positions_table


def fused_qk_norm_rope(qkv, num_heads_q, num_heads_k, num_heads_v, head_dim, eps, q_weight,
                       k_weight, cos_sin_cache, is_neox, position_ids,
                       forced_token_heads_per_warp=-1):
    """vLLM's `_custom_ops.fused_qk_norm_rope`: in place on qkv (num_tokens, (Hq + Hk + Hv) *
    head_dim), each q and k head RMS-normalized over head_dim (float32, q_weight / k_weight
    (head_dim,)) and its first rot_dim dims rotated by the rows of cos_sin_cache (max_position,
    rot_dim; cos then sin) at position_ids (num_tokens,); pairs (i, i + rot_dim/2) if is_neox,
    else (2i, 2i+1). V untouched. Returns None, as vLLM's op does.

    forced_token_heads_per_warp is vLLM's GPU tuning knob: accepted (an int), ignored.
    Unlike vLLM's kernel: any head_dim, partial rotary, any float dtypes, and a position outside
    [0, max_position) is an error, raised (like every bad argument) before anything is written.
    """
    if type(forced_token_heads_per_warp) is not int and (
            isinstance(forced_token_heads_per_warp, bool)
            or not isinstance(forced_token_heads_per_warp, numbers.Integral)):
        raise TypeError(f"forced_token_heads_per_warp must be an int, got "
                        f"{forced_token_heads_per_warp!r}")
    qkv_norm_rope_(qkv, num_heads_q, num_heads_k, num_heads_v, head_dim, q_weight, k_weight,
                   position_ids, cos_sin_cache, eps=eps, interleaved=interleaved_of(is_neox))


# vLLM's float8 cache formats (its caches hold them as uint8: viewed as the format, same bytes).
_VLLM_FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
             "fp8_e5m2": torch.float8_e5m2}


def _int_arg(name, v, low=0):
    if type(v) is int and low <= v < 2**63:  # the common case, without the ABC check (decode calls)
        return v
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < low:
        raise ValueError(f"{name} must be an int >= {low}, got {v!r}")
    return check_int(v, name)  # (its int64 bound, its message)


def fused_qknorm_rope_cache(qkv, q_weight, k_weight, cos_sin_cache, positions, slot_mapping,
                            key_cache, value_cache, num_q_heads, num_kv_heads, head_dim,
                            rotary_dim, eps, norm_weight_bias=0.0, kv_cache_dtype="auto",
                            k_scale=None, v_scale=None):
    """vLLM's `_custom_ops.fused_qknorm_rope_cache`: the attention prologue of a packed qkv
    (num_tokens, (num_q_heads + 2 * num_kv_heads) * head_dim), left as it is. Returns new
    contiguous q (num_tokens, num_q_heads * head_dim), k and v (num_tokens, num_kv_heads *
    head_dim): each q and k head RMS-normalized over head_dim in float32 with the weight plus
    norm_weight_bias (1.0: Gemma's zero-centered weights), its first rotary_dim dims rotated
    NeoX-style by the rows of cos_sin_cache at positions (cos and sin: the table's halves, each
    read from its start; rotary_dim 0: no rotation), v a copy; k and v also written into the
    paged caches (num_blocks, block_size, num_kv_heads, head_dim) at slot_mapping (negative,
    or past the end of a slot_mapping shorter than qkv: not cached), float8 caches (uint8 as
    vLLM allocates them, or a float8 dtype) storing x / scale, saturated.

    One rope.qk_norm_rope_and_cache call (one pass; qkv only read). Unlike vLLM's kernel, the
    normalized rows are rounded once, after the rotation (vLLM rounds them to qkv's dtype
    before it too: results can differ by one unit in the last place), a position or slot out
    of range is an error, and every bad argument raises before anything is written.
    """
    heads_q = _int_arg("num_q_heads", num_q_heads, 1)
    heads_kv = _int_arg("num_kv_heads", num_kv_heads, 1)
    dim = _int_arg("head_dim", head_dim, 1)
    rot = _int_arg("rotary_dim", rotary_dim)
    if rot > dim or rot % 8:
        raise ValueError(f"rotary_dim must be a multiple of 8 in [0, head_dim={dim}], got {rot}")
    if type(norm_weight_bias) is not float and (
            isinstance(norm_weight_bias, bool) or not isinstance(norm_weight_bias, numbers.Real)) \
            or not math.isfinite(norm_weight_bias):
        raise ValueError(f"norm_weight_bias must be a finite number, got {norm_weight_bias!r}")
    q_size, kv_size = heads_q * dim, heads_kv * dim
    # (each shape read once: a torch.Size costs 0.15 us, a fifth of the call's Python)
    shape = qkv.shape if isinstance(qkv, torch.Tensor) else None
    if shape is None or len(shape) != 2 or shape[1] != q_size + 2 * kv_size:
        got = list(shape) if shape is not None else type(qkv).__name__
        raise ValueError(f"qkv must have shape (num_tokens, (num_q_heads + 2 * num_kv_heads) * "
                         f"head_dim) = (num_tokens, {q_size + 2 * kv_size}), got {got}")
    table_shape = cos_sin_cache.shape if isinstance(cos_sin_cache, torch.Tensor) else None
    if table_shape is None or len(table_shape) != 2 or table_shape[1] % 2 or table_shape[1] < rot:
        got = list(table_shape) if table_shape is not None else type(cos_sin_cache).__name__
        raise ValueError(f"cos_sin_cache must have shape (max_position, width) with an even width "
                         f">= rotary_dim = {rot}, got {got}")
    half = table_shape[1] // 2
    table = cos_sin_cache if 2 * half == rot else torch.cat(
        (cos_sin_cache[:, : rot // 2], cos_sin_cache[:, half : half + rot // 2]), dim=1)
    if norm_weight_bias in (0.0, 1.0):
        unit_offset = norm_weight_bias == 1.0
    else:  # weights w + bias in float32 (anything else: the op's own error)
        unit_offset = False
        if isinstance(q_weight, torch.Tensor) and isinstance(k_weight, torch.Tensor):
            q_weight = q_weight.float() + float(norm_weight_bias)
            k_weight = k_weight.float() + float(norm_weight_bias)
    fmt = _VLLM_FP8.get(kv_cache_dtype)
    if fmt is not None and key_cache.dtype == torch.uint8 and value_cache.dtype == torch.uint8:
        key_cache, value_cache = key_cache.view(fmt), value_cache.view(fmt)
    tokens = shape[0]
    if isinstance(slot_mapping, torch.Tensor) and slot_mapping.dim() == 1 and \
            slot_mapping.shape[0] < tokens:
        # vLLM pads qkv to a CUDA graph's size while slot_mapping covers the real tokens (it
        # allows slot_mapping.numel() <= num_tokens): the rows past it are rotated, not cached.
        padding = slot_mapping.new_full((tokens - slot_mapping.shape[0],), -1)
        slot_mapping = torch.cat((slot_mapping, padding))
    # q, k, v: views of qkv's heads (one op; qkv is only read, so a layout that cannot be viewed
    # is copied by reshape)
    q, k, v = qkv.reshape(tokens, heads_q + 2 * heads_kv, dim).split_with_sizes(
        (heads_q, heads_kv, heads_kv), 1)
    q, k, v = qk_norm_rope_and_cache(q, k, v, positions, table, q_weight, k_weight, key_cache,
                                     value_cache, slot_mapping, eps=eps, unit_offset=unit_offset,
                                     kv_cache_dtype=kv_cache_dtype, k_scale=k_scale,
                                     v_scale=v_scale)
    return q.view(tokens, q_size), k.view(tokens, kv_size), v.view(tokens, kv_size)


def _yarn_tables(positions, rotary_dim, base, factor, low, high, attention_factor):
    """(num_tokens, rotary_dim) [cos | sin] rows of each token's angles, SGLang's frequencies:
    base^(-2i/rotary_dim), blended with YaRN's interpolated ones when factor != 1 by the linear
    ramp of pair i between low and high; both scaled by attention_factor. float64 angles."""
    half = rotary_dim // 2
    i = torch.arange(half, dtype=torch.float64, device=positions.device)
    freq = base ** (-2.0 * i / rotary_dim)
    if factor != 1.0:
        hi = high + 0.001 if abs(low - high) <= 1e-6 else high
        ramp = ((i - low) / (hi - low)).clamp(0.0, 1.0)
        extrapolation = 1.0 - ramp
        freq = (freq / factor) * (1.0 - extrapolation) + freq * extrapolation
    # one float64 temporary beside the angles, each half rounded into the float32 table as it
    # is made (the per-token table is kept small: it is allocated on every call)
    angle = positions.to(torch.float64)[:, None] * freq
    table = torch.empty(angle.shape[0], 2 * half, dtype=torch.float32, device=angle.device)
    table[:, :half] = torch.cos(angle).mul_(attention_factor)
    table[:, half:] = angle.sin_().mul_(attention_factor)
    return table


def sglang_fused_qk_norm_rope(qkv, num_heads_q, num_heads_k, num_heads_v, head_dim, eps,
                              q_weight, k_weight, base, is_neox, position_ids, factor, low, high,
                              attention_factor, rotary_dim=None):
    """SGLang's `sgl_kernel.fused_qk_norm_rope` (and sglang.jit_kernel's): in place on qkv like
    vLLM's, but the angles come from `base` (rope_theta) and YaRN's factor / low / high
    (factor 1.0: plain RoPE), the rotated dims scaled by attention_factor; rotary_dim defaults
    to head_dim. Returns None. Unlike SGLang's kernel: any head_dim and float dtype, int32 or
    int64 positions, errors before anything is written; on the CPU a table of positions
    0 .. n-1 is kept for each set of base, factor, low, high, attention_factor and rotary_dim
    (see _layout.positions_table)."""
    if rotary_dim is None:
        rotary_dim = head_dim
    for name, v in (("base", base), ("factor", factor), ("low", low), ("high", high),
                    ("attention_factor", attention_factor)):
        if type(v) is not float and (isinstance(v, bool) or not isinstance(v, numbers.Real)) \
                or not math.isfinite(v):
            raise ValueError(f"{name} must be a finite number, got {v!r}")
    if base <= 0 or factor <= 0:
        raise ValueError(f"base and factor must be > 0, got base={base!r}, factor={factor!r}")
    if type(rotary_dim) is not int and (isinstance(rotary_dim, bool)
                                        or not isinstance(rotary_dim, numbers.Integral)) or \
            rotary_dim < 0 or rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(f"rotary_dim must be an even int in [0, head_dim = {head_dim}], got "
                         f"{rotary_dim!r}")
    if not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 1:
        raise ValueError("position_ids must be a 1-D tensor (num_tokens,)")
    if position_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"position_ids must be int32 or int64, got {position_ids.dtype}")
    freqs = (int(rotary_dim), float(base), float(factor), float(low), float(high),
             float(attention_factor))
    table = positions_table(position_ids, ("sglang",) + freqs, freqs[0],
                            lambda positions: _yarn_tables(positions, *freqs))
    if table is not None:  # rows at the positions themselves
        rows = position_ids
    else:  # one row per token
        table = _yarn_tables(position_ids, *freqs)
        rows = torch.arange(position_ids.shape[0], device=position_ids.device)
    qkv_norm_rope_(qkv, num_heads_q, num_heads_k, num_heads_v, head_dim, q_weight, k_weight,
                   rows, table, eps=eps, interleaved=interleaved_of(is_neox))
