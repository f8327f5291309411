"""SGLang's RoPE kernel entry points (`sgl_kernel.apply_rope_with_cos_sin_cache_inplace`, with its
fused KV-cache store, `rotary_embedding`, `fused_qk_norm_rope`) on rope_ext's ops.

    from sgl_kernel import apply_rope_with_cos_sin_cache_inplace, FusedSetKVBufferArg
 -> from rope_ext.compat.sglang import apply_rope_with_cos_sin_cache_inplace, FusedSetKVBufferArg
"""

from dataclasses import dataclass
from typing import Optional

import torch

from .._args import check_float
from ..ops import apply_rope_, apply_rope_and_cache_
from ._layout import (check_cache_views, check_index_tensor, float32_scalar, heads,
                      interleaved_of)
from . import vllm

_FP8 = {torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2"}


@dataclass
class FusedSetKVBufferArg:
    """What SGLang's set_kv_buffer would write, fused into the rotation: the rotated key and
    `value` (nnz, num_kv_heads * head_size) go to k_buffer / v_buffer (num_slots, num_kv_heads *
    head_size) or (num_slots, num_kv_heads, head_size), rows cache_loc (nnz,)."""

    value: torch.Tensor
    k_buffer: torch.Tensor
    v_buffer: torch.Tensor
    k_scale: Optional[float]
    v_scale: Optional[float]
    cache_loc: torch.Tensor


def _slots(buffer, head_size, name, kv_heads):
    # SGLang's token-slot pool is a paged cache with one token per block: (num_slots, 1, H, D).
    pool = heads(buffer, head_size, name, 1) if buffer.dim() in (2, 3) else None
    if pool is None or pool.shape[1] != kv_heads:
        raise ValueError(f"{name} must have shape (num_slots, num_kv_heads * head_size) or "
                         f"(num_slots, num_kv_heads, head_size) with num_kv_heads = {kv_heads} (key's) "
                         f"and head_size = {head_size}, got {list(buffer.shape)}")
    return pool.unsqueeze(1)


def _cache_format(arg, key):
    k_dtype, v_dtype = arg.k_buffer.dtype, arg.v_buffer.dtype
    if k_dtype != v_dtype:
        raise ValueError(f"k_buffer and v_buffer must have one dtype, got {k_dtype} and {v_dtype}")
    if k_dtype != key.dtype and k_dtype not in _FP8:
        raise ValueError(f"k_buffer and v_buffer must have key's dtype ({key.dtype}) or a float8 "
                         f"one, got {k_dtype}")
    if k_dtype in _FP8:
        scale = lambda s, name: float32_scalar(1.0 if s is None else check_float(s, name),  # noqa: E731
                                               key.device)
        return _FP8[k_dtype], scale(arg.k_scale, "k_scale"), scale(arg.v_scale, "v_scale")
    if arg.k_scale is not None or arg.v_scale is not None:
        raise ValueError("fused_set_kv_buffer_arg: k_scale and v_scale must be None for buffers of "
                         "the key's dtype (SGLang's fused kernel supports no scales); they apply "
                         "to float8 buffers only")
    return "auto", None, None


def apply_rope_with_cos_sin_cache_inplace(positions, query, key, head_size, cos_sin_cache,
                                          is_neox=True, fused_set_kv_buffer_arg=None,
                                          enable_pdl=None):
    """Rotates query (nnz, num_q_heads * head_size) and key (nnz, num_k_heads * head_size) in
    place by the rows of cos_sin_cache (max_seq_len, rotary_dim) float32 (cos | sin) at positions
    (nnz,); is_neox=False: interleaved pairs. With fused_set_kv_buffer_arg, the rotated key and
    the value are also stored at cache_loc in the same pass (a negative cache_loc skips the
    token); float8 buffers store value / scale (scale 1 when None), saturated. Returns None.
    Positions outside the table are an error (SGLang reads outside it). enable_pdl (programmatic
    dependent launch, a scheduling hint for Hopper GPUs) is accepted and changes no result: the
    kernels here launch without it."""
    q, k = check_cache_views(positions, query, key, head_size, cos_sin_cache)
    head_size = q.shape[-1]  # checked, as an int
    arg = fused_set_kv_buffer_arg
    if arg is None:
        apply_rope_(q, k, positions, cos_sin_cache, interleaved=interleaved_of(is_neox))
        return
    if key is None:
        raise ValueError("fused_set_kv_buffer_arg needs key: the rotated key is what is stored")
    fmt, k_scale, v_scale = _cache_format(arg, key)
    value = heads(arg.value, head_size, "value", 1)
    check_index_tensor(arg.cache_loc, "cache_loc", (q.shape[0],))
    k_pool = _slots(arg.k_buffer, head_size, "k_buffer", k.shape[1])
    v_pool = _slots(arg.v_buffer, value.shape[-1], "v_buffer", k.shape[1])
    if v_pool.shape[0] != k_pool.shape[0]:
        raise ValueError(f"v_buffer must have k_buffer's num_slots = {k_pool.shape[0]}, got "
                         f"{list(arg.v_buffer.shape)}")
    try:
        apply_rope_and_cache_(q, k, value, positions, cos_sin_cache, k_pool, v_pool,
                              arg.cache_loc, interleaved=interleaved_of(is_neox),
                              kv_cache_dtype=fmt,
                              k_scale=k_scale, v_scale=v_scale)
    except RuntimeError as e:  # the checks of cache_loc's values, in SGLang's names
        if "slot_mapping" not in str(e):
            raise
        raise RuntimeError(str(e).replace("slot_mapping", "cache_loc").replace(
            "num_blocks * block_size", "k_buffer.size(0)")) from None


def rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox=True):
    """`sgl_kernel.rotary_embedding`: vLLM's op (`rope_ext.compat.vllm.rotary_embedding`) under
    SGLang's name, is_neox True unless given. Returns None."""
    vllm.rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox)


# fused QK-RMSNorm + RoPE (`sgl_kernel.fused_qk_norm_rope`: angles from base and YaRN)
from ._qk_norm import sglang_fused_qk_norm_rope as fused_qk_norm_rope  # noqa: E402,F401
