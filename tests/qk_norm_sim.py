"""Builds (once, cached under build/) and loads the CPU simulator of the CUDA kernels,
tests/sim/cuda_sim.cpp, and wraps its ops of the fused QK-RMSNorm + RoPE kernels
(tests/sim/qk_norm_sim.inc): each returns its result and the launch's info (vector path taken,
grid, vector and scalar accesses)."""

import torch

from cuda_sim import load


def _info():
    load()
    return torch.zeros(4, dtype=torch.int64)


def qk_norm_rope(query, key, q_weight, k_weight, cos, sin, eps, unit_offset=False,
                 interleaved=False, max_blocks=1 << 20):
    info = _info()
    out = torch.ops.rope_sim.qk_norm_rope(query, key, q_weight, k_weight, cos, sin, eps,
                                          unit_offset, interleaved, max_blocks, info)
    return out, info.tolist()


def norm_rope(query, key, q_weight, k_weight, q_bias, k_bias, cos, sin, eps, norm,
              interleaved=False, max_blocks=1 << 20):
    info = _info()
    out = torch.ops.rope_sim.norm_rope(query, key, q_weight, k_weight, q_bias, k_bias, cos, sin,
                                       eps, norm, interleaved, max_blocks, info)
    return out, info.tolist()


def qk_norm_rope_(query, key, q_weight, k_weight, positions, cache, eps, unit_offset=False,
                  interleaved=False, mrope_section=None, mrope_interleaved=False,
                  max_blocks=1 << 20):
    info = _info()
    torch.ops.rope_sim.qk_norm_rope_(query, key, q_weight, k_weight, positions, cache, eps,
                                     unit_offset, interleaved, mrope_section, mrope_interleaved,
                                     max_blocks, info)
    return info.tolist()


def qkv_norm_rope_(qkv, hq, hk, hv, head_dim, q_weight, k_weight, positions, cache, eps,
                   unit_offset=False, interleaved=False, mrope_section=None,
                   mrope_interleaved=False, max_blocks=1 << 20):
    info = _info()
    torch.ops.rope_sim.qkv_norm_rope_(qkv, hq, hk, hv, head_dim, q_weight, k_weight, positions,
                                      cache, eps, unit_offset, interleaved, mrope_section,
                                      mrope_interleaved, max_blocks, info)
    return info.tolist()


def qk_norm_rope_and_cache_(query, key, value, positions, cache, q_weight, k_weight, key_cache,
                            value_cache, slot_mapping, *, eps=1e-6, unit_offset=False,
                            interleaved=False, mrope_section=None, mrope_interleaved=False,
                            v_norm=False, kv_cache_dtype="auto", k_scale=None, v_scale=None,
                            max_blocks=1 << 20):
    info = _info()
    torch.ops.rope_sim.qk_norm_rope_and_cache_(
        query, key, value, positions, cache, q_weight, k_weight, key_cache, value_cache,
        slot_mapping, eps, unit_offset, interleaved, mrope_section, mrope_interleaved, v_norm,
        kv_cache_dtype, k_scale, v_scale, max_blocks, info)
    return info.tolist()


def qk_norm_rope_and_cache(query, key, value, positions, cache, q_weight, k_weight, key_cache,
                           value_cache, slot_mapping, *, eps=1e-6, unit_offset=False,
                           interleaved=False, mrope_section=None, mrope_interleaved=False,
                           v_norm=False, kv_cache_dtype="auto", k_scale=None, v_scale=None,
                           max_blocks=1 << 20):
    info = _info()
    out = torch.ops.rope_sim.qk_norm_rope_and_cache(
        query, key, value, positions, cache, q_weight, k_weight, key_cache, value_cache,
        slot_mapping, eps, unit_offset, interleaved, mrope_section, mrope_interleaved, v_norm,
        kv_cache_dtype, k_scale, v_scale, max_blocks, info)
    return out, info.tolist()
