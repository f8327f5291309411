"""Pins glibc's malloc thresholds for a benchmark run, so that no row's numbers depend on which
rows ran before it. A benchmark setting only: the runtime package never touches the allocator.

glibc serves a large allocation with a fresh mmap (pages the OS faults in and zeroes on first
write) or from its heap (pages already backed), and decides from history: freeing an mmapped
block raises the mmap threshold to that block's size (up to 32 MiB), and free heap memory above
the trim threshold (twice the mmap threshold) goes back to the OS. In one process timing many
rows, a 16 MiB output can thus be a fresh mmap for one row and recycled memory for the next.
Pinning both thresholds where glibc's own adaptation ends (32 MiB, 64 MiB) gives every row the
state a long-running process settles in: outputs up to 32 MiB recycled, larger ones fresh mmaps.
docs/cpu-performance.md has the measurements that keep this here.
"""

import ctypes
import ctypes.util

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 64 << 20


def _glibc():
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        libc.mallopt  # noqa: B018 - present only in glibc
    except (OSError, AttributeError, TypeError):
        return None
    return libc


def preloaded_allocator():
    """True if `malloc` resolves to something other than glibc's (LD_PRELOAD of jemalloc,
    tcmalloc, ...): then glibc's thresholds govern nothing."""
    libc = _glibc()
    if libc is None:
        return False
    addr = ctypes.cast(ctypes.CDLL(None).malloc, ctypes.c_void_p).value
    return addr != ctypes.cast(libc.malloc, ctypes.c_void_p).value


def pin_thresholds():
    """Returns a description of what was set, or why nothing was."""
    libc = _glibc()
    if libc is None:
        return "not pinned (no glibc mallopt)"
    if preloaded_allocator():
        return "not pinned (malloc is not glibc's: a preloaded allocator)"
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.mallopt.restype = ctypes.c_int
    if not (libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
            and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
        return "not pinned (mallopt refused)"
    return (f"glibc, mmap threshold pinned at {MMAP_THRESHOLD >> 20} MiB, trim threshold at "
            f"{TRIM_THRESHOLD >> 20} MiB")
