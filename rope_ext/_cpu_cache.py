"""The cache of recycled memory blocks that large CPU outputs of rope.apply and
rope.apply_backward come from (csrc/ops/cpu/cpu_output_cache.cpp)."""

import torch

FIELDS = ("limit_bytes", "cached_bytes", "cached_blocks", "reuses", "new_blocks", "available")


def cpu_cache_info():
    """How the CPU output cache stands, as a dict:

    - limit_bytes: the most memory it keeps in blocks no tensor uses (ROPE_EXT_CPU_CACHE_MB,
      default 1024 MiB; 0 turns the cache off);
    - cached_bytes, cached_blocks: what it keeps now;
    - reuses, new_blocks: outputs served from a kept block / from a new one, since load;
    - available: False when torch is older than 2.11 (no torch_from_blob) or the native library
      is not loaded: every output is then a plain allocation.

    Outputs of at least 16 MiB use it. Without it glibc returns each such block to the OS when the
    tensor dies, and the OS faults in and zeroes the pages of the next one as it is written, which
    costs more than the rotation (bench/NOTES.md).
    """
    values = [int(v) for v in torch.ops.rope.cpu_output_cache_info()]
    info = dict(zip(FIELDS, values))
    info["available"] = bool(info["available"])
    return info


def empty_cpu_cache():
    """Frees every block the CPU output cache keeps; blocks of live outputs return to it when
    they die. Like torch.cuda.empty_cache()."""
    torch.ops.rope.cpu_output_cache_empty()


def reference_info():
    return [0, 0, 0, 0, 0, 0]


def reference_empty():
    return None
