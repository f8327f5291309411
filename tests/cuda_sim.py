"""Builds (once, cached under build/) and loads the CPU simulator of the CUDA kernels,
tests/sim/rope_cuda_sim.cpp, and wraps its ops.

The simulator runs the CUDA ops' own host code and per-thread kernel code (csrc/ops/cuda/
rope_cuda_host.h, rope_cuda_thread.h) over every thread of the planned launch grid and checks
every memory access; see the .cpp for what it proves.
"""

import os

from rope_ext import _build_flags
from dataclasses import dataclass

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILD_DIR = os.path.join(ROOT, "build", "rope_cuda_sim")
SOURCES = [
    os.path.join(ROOT, "tests", "sim", "rope_cuda_sim.cpp"),
    os.path.join(ROOT, "csrc", "ops", "rope_checks.cpp"),
]
# The flags of the real libraries (same rounding: no FP contraction), plus the access hooks.
FLAGS = _build_flags.CXX_FLAGS + ["-DROPE_SIM"]

_loaded = False


def load():
    global _loaded
    if not _loaded:
        import build_config

        build_config.configure_environment()  # CUDA_HOME: no "guessing /usr/local" warning
        from torch.utils.cpp_extension import load as cpp_load

        os.makedirs(BUILD_DIR, exist_ok=True)
        cpp_load(
            name="rope_cuda_sim",
            sources=SOURCES,
            extra_cflags=FLAGS,
            extra_include_paths=[os.path.join(ROOT, "csrc")],
            build_directory=BUILD_DIR,
            is_python_module=False,
            verbose=False,
        )
        _loaded = True


@dataclass
class Plan:
    vec: bool
    idx32: bool
    grid: int
    block: tuple
    rot_chunks: int
    tail_chunks: int
    vector_accesses: int
    scalar_accesses: int


def _plan(info):
    v = info.tolist()
    return Plan(bool(v[0]), bool(v[1]), v[2], (v[3], v[4], v[5]), v[6], v[7], v[8], v[9])


def apply(x, cos, sin, interleaved=False, inverse=False, max_blocks=1 << 20, force_idx64=False):
    """The simulated rope.apply (inverse=False) / rope.apply_backward: (out, Plan)."""
    load()
    info = torch.zeros(12, dtype=torch.int64)
    out = torch.ops.rope_sim.apply(x, cos, sin, interleaved, inverse, max_blocks, force_idx64, info)
    return out, _plan(info)


def apply_out(x, cos, sin, out, interleaved=False, max_blocks=1 << 20, force_idx64=False):
    """The simulated rope.apply.out (writes out): Plan."""
    load()
    info = torch.zeros(12, dtype=torch.int64)
    torch.ops.rope_sim.apply_out(x, cos, sin, interleaved, max_blocks, force_idx64, info, out)
    return _plan(info)


def apply_(query, key, positions, cache, interleaved=False, max_blocks=1 << 20, force_idx64=False):
    """The simulated rope.apply_ (in place): Plan."""
    load()
    info = torch.zeros(12, dtype=torch.int64)
    torch.ops.rope_sim.apply_(query, key, positions, cache, interleaved, max_blocks, force_idx64, info)
    return _plan(info)
