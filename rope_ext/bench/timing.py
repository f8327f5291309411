"""Median wall time of a callable, robust to a shared, noisy machine."""

import time


def measure(fn, *, repeat, min_block_s=2e-3, max_inner=10000):
    """Runs fn in blocks long enough for the clock (>= min_block_s) and returns the per-call
    times of `repeat` blocks. Warm-up first (allocations, caches, lazy compilation)."""
    fn()
    fn()
    inner = 1
    while True:
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        elapsed = time.perf_counter() - t0
        if elapsed >= min_block_s or inner >= max_inner:
            break
        inner = min(max_inner, inner * 2 if elapsed <= 0 else max(inner * 2, int(inner * min_block_s / elapsed) + 1))
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - t0) / inner)
    return times


def median(values):
    s = sorted(values)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])
