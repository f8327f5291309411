"""Pins glibc's malloc thresholds for the benchmark, so that no implementation's numbers depend on
which ones ran before it.

glibc serves a large allocation with a fresh mmap (pages the OS must fault in and zero when first
written) or from its heap (pages already backed), and decides from history: freeing an mmapped
block raises the mmap threshold to that block's size (up to 32 MiB), and freed heap memory above
the trim threshold (twice the mmap threshold) goes back to the OS. In one process running many
implementations, a 16 MiB output could thus be a fresh mmap for one implementation and recycled
memory for the next: torch.compile of the reference measured 6 GB/s on the mid case after the other
implementations and 21-24 GB/s alone (bench/NOTES.md 12). Pinning both thresholds at the values
glibc's own adaptation ends at (32 MiB, 64 MiB) gives every implementation the same allocator:
outputs up to 32 MiB recycled, larger ones fresh mmaps (rope_ext's large CPU outputs come from its
own cache either way).
"""

import ctypes
import ctypes.util

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 64 << 20


def pin_thresholds():
    """Returns a description of what was set, or why nothing was (not glibc)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return "not pinned (no glibc mallopt)"
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    if not (mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
        return "not pinned (mallopt refused)"
    return f"glibc mmap threshold {MMAP_THRESHOLD >> 20} MiB, trim threshold {TRIM_THRESHOLD >> 20} MiB"
