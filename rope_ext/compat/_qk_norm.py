"""The fused QK-RMSNorm + RoPE drop-ins of vLLM and SGLang on rope.qkv_norm_rope_; re-exported
by rope_ext.compat.vllm and rope_ext.compat.sglang."""

import math
import numbers

import torch

from ..qk_norm import qkv_norm_rope_


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
    if isinstance(forced_token_heads_per_warp, bool) or not isinstance(
            forced_token_heads_per_warp, numbers.Integral):
        raise TypeError(f"forced_token_heads_per_warp must be an int, got "
                        f"{forced_token_heads_per_warp!r}")
    qkv_norm_rope_(qkv, num_heads_q, num_heads_k, num_heads_v, head_dim, q_weight, k_weight,
                   position_ids, cos_sin_cache, eps=eps, interleaved=not is_neox)


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
    angle = positions.to(torch.float64)[:, None] * freq
    table = torch.cat((angle.cos(), angle.sin()), dim=1) * attention_factor
    return table.to(torch.float32)


def sglang_fused_qk_norm_rope(qkv, num_heads_q, num_heads_k, num_heads_v, head_dim, eps,
                              q_weight, k_weight, base, is_neox, position_ids, factor, low, high,
                              attention_factor, rotary_dim=None):
    """SGLang's `sgl_kernel.fused_qk_norm_rope` (and sglang.jit_kernel's): in place on qkv like
    vLLM's, but the angles come from `base` (rope_theta) and YaRN's factor / low / high
    (factor 1.0: plain RoPE), the rotated dims scaled by attention_factor; rotary_dim defaults
    to head_dim. Returns None. Unlike SGLang's kernel: any head_dim and float dtype, int32 or
    int64 positions, errors before anything is written."""
    if rotary_dim is None:
        rotary_dim = head_dim
    for name, v in (("base", base), ("factor", factor), ("low", low), ("high", high),
                    ("attention_factor", attention_factor)):
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v):
            raise ValueError(f"{name} must be a finite number, got {v!r}")
    if base <= 0 or factor <= 0:
        raise ValueError(f"base and factor must be > 0, got base={base!r}, factor={factor!r}")
    if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, numbers.Integral) or \
            rotary_dim < 0 or rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(f"rotary_dim must be an even int in [0, head_dim = {head_dim}], got "
                         f"{rotary_dim!r}")
    if not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 1:
        raise ValueError("position_ids must be a 1-D tensor (num_tokens,)")
    if position_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"position_ids must be int32 or int64, got {position_ids.dtype}")
    table = _yarn_tables(position_ids, int(rotary_dim), float(base), float(factor), float(low),
                         float(high), float(attention_factor))
    rows = torch.arange(position_ids.shape[0], device=position_ids.device)
    qkv_norm_rope_(qkv, num_heads_q, num_heads_k, num_heads_v, head_dim, q_weight, k_weight,
                   rows, table, eps=eps, interleaved=not is_neox)
