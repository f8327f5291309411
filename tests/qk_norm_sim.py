"""Builds (once, cached under build/) and loads the CPU simulator of the fused QK-RMSNorm + RoPE
CUDA kernels, tests/sim/qk_norm_sim.cpp, and wraps its ops: each returns its result and the
launch's info (vector path taken, grid, vector and scalar accesses)."""

import torch

import sim_build


def load():
    sim_build.load("qk_norm_sim", "rope_qk_norm_sim")


def _info():
    load()
    return torch.zeros(4, dtype=torch.int64)


def qk_norm_rope(query, key, q_weight, k_weight, cos, sin, eps, unit_offset=False,
                 interleaved=False, max_blocks=1 << 20):
    info = _info()
    out = torch.ops.rope_qk_sim.qk_norm_rope(query, key, q_weight, k_weight, cos, sin, eps,
                                             unit_offset, interleaved, max_blocks, info)
    return out, info.tolist()


def qk_norm_rope_(query, key, q_weight, k_weight, positions, cache, eps, unit_offset=False,
                  interleaved=False, mrope_section=None, mrope_interleaved=False,
                  max_blocks=1 << 20):
    info = _info()
    torch.ops.rope_qk_sim.qk_norm_rope_(query, key, q_weight, k_weight, positions, cache, eps,
                                        unit_offset, interleaved, mrope_section,
                                        mrope_interleaved, max_blocks, info)
    return info.tolist()


def qkv_norm_rope_(qkv, hq, hk, hv, head_dim, q_weight, k_weight, positions, cache, eps,
                   unit_offset=False, interleaved=False, mrope_section=None,
                   mrope_interleaved=False, max_blocks=1 << 20):
    info = _info()
    torch.ops.rope_qk_sim.qkv_norm_rope_(qkv, hq, hk, hv, head_dim, q_weight, k_weight, positions,
                                         cache, eps, unit_offset, interleaved, mrope_section,
                                         mrope_interleaved, max_blocks, info)
    return info.tolist()
