"""Builds (once, cached under build/) and loads the CPU simulator of the fused QK-RMSNorm + RoPE
CUDA kernels, tests/sim/qk_norm_sim.cpp, and wraps its ops: each returns its result and the
launch's info (vector path taken, grid, vector and scalar accesses)."""

import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
import build_config  # noqa: E402

BUILD_DIR = os.path.join(ROOT, "build", "qk_norm_sim")
_loaded = False


def load():
    global _loaded
    if not _loaded:
        build_config.configure_environment()
        from torch.utils.cpp_extension import load as cpp_load

        os.makedirs(BUILD_DIR, exist_ok=True)
        cpp_load(
            name="rope_qk_norm_sim",
            sources=[os.path.join(ROOT, "tests", "sim", "qk_norm_sim.cpp")],
            extra_cflags=build_config.cxx_flags() + ["-DROPE_SIM"],
            extra_include_paths=build_config.include_dirs(),
            build_directory=BUILD_DIR,
            is_python_module=False,
            verbose=False,
        )
        _loaded = True


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
