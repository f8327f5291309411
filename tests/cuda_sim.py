"""Builds (once, cached under build/) and loads the CPU simulator of the CUDA kernels,
tests/sim/cuda_sim.cpp, and wraps its ops.

The simulator runs the CUDA ops' own host code and per-thread kernel code (csrc/ops/cuda/
rope_cuda_host.h, rope_cuda_thread.h) over every thread of the planned launch grid and checks
every memory access; see the .cpp for what it proves.
"""

from dataclasses import dataclass

import torch

import sim_build


def load():
    sim_build.load("cuda_sim", "rope_cuda_sim")


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
    tvec: bool  # whole-vector table loads


def _plan_fields(v):
    return bool(v[0]), bool(v[1]), v[2], (v[3], v[4], v[5]), v[6], v[7], v[8], v[9], bool(v[10])


def _run(op_name, *args, max_blocks=1 << 20, force_idx64=False):
    load()  # before the op is looked up: the simulator library defines it
    info = torch.zeros(12, dtype=torch.int64)
    result = getattr(torch.ops.rope_sim, op_name)(*args, max_blocks, force_idx64, info)
    v = info.tolist()
    return result, Plan(*_plan_fields(v))


def apply(x, cos, sin, interleaved=False, inverse=False, **kw):
    """The simulated rope.apply (inverse: rope.apply_backward): (out, Plan)."""
    return _run("apply", x, cos, sin, interleaved, inverse, **kw)


def apply_out(x, cos, sin, out, interleaved=False, max_blocks=1 << 20, force_idx64=False):
    """The simulated rope.apply.out (writes out): Plan."""
    load()
    info = torch.zeros(12, dtype=torch.int64)
    torch.ops.rope_sim.apply_out(x, cos, sin, interleaved, max_blocks, force_idx64, info, out)
    v = info.tolist()
    return Plan(*_plan_fields(v))


def apply_(query, key, positions, cache, interleaved=False, rope_dim_offset=0, inverse=False,
           **kw):
    """The simulated rope.apply_ (in place): Plan."""
    return _run("apply_", query, key, positions, cache, interleaved, rope_dim_offset, inverse,
                **kw)[1]


def mrope_(query, key, positions, cache, section, interleaved=False, mrope_interleaved=False,
           rope_dim_offset=0, inverse=False, **kw):
    """The simulated rope.mrope_ (in place): Plan."""
    return _run("mrope_", query, key, positions, cache, list(section),
                interleaved, mrope_interleaved, rope_dim_offset, inverse, **kw)[1]


def apply_positions(x, positions, cos, sin, interleaved=False, inverse=False, mrope_section=None,
                    mrope_interleaved=False, **kw):
    """The simulated rope.apply_positions: (out, Plan); sin None: cos is a cos_sin_cache
    (rope.apply_positions.cache)."""
    return _run("apply_positions", x, positions, cos, sin, interleaved, inverse,
                mrope_section, mrope_interleaved, **kw)


def apply_and_cache_(query, key, value, positions, cache, key_cache, value_cache, slots,
                     interleaved=False, kv_cache_dtype="auto", k_scale=None, v_scale=None, **kw):
    """The simulated rope.apply_and_cache_ (in place, caches written): Plan."""
    return _run("apply_and_cache_", query, key, value, positions, cache,
                key_cache, value_cache, slots, interleaved, kv_cache_dtype, k_scale, v_scale,
                **kw)[1]


def shift_kv_cache_(key_cache, slots, delta, cache, interleaved=False, kv_cache_dtype="auto",
                    k_scale=None, **kw):
    """The simulated rope.shift_kv_cache_ (the cache rotated in place): Plan."""
    return _run("shift_kv_cache_", key_cache, slots, delta, cache, interleaved, kv_cache_dtype,
                k_scale, **kw)[1]
