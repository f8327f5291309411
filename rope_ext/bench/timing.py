"""Median wall time of a callable, robust to a shared, noisy machine."""

import time


def calibrate(fn, *, min_block_s=2e-3, max_inner=10000):
    """Warms fn up (allocations, caches, lazy compilation) and returns how many calls make a block
    long enough for the clock (>= min_block_s)."""
    fn()
    fn()
    inner = 1
    while True:
        elapsed = _block(fn, inner)
        if elapsed >= min_block_s or inner >= max_inner:
            return inner
        inner = min(max_inner, inner * 2 if elapsed <= 0 else max(inner * 2, int(inner * min_block_s / elapsed) + 1))


def _block(fn, inner):
    t0 = time.perf_counter()
    for _ in range(inner):
        fn()
    return time.perf_counter() - t0


def measure(fn, *, repeat, **kw):
    """The per-call times of `repeat` blocks of fn."""
    inner = calibrate(fn, **kw)
    return [_block(fn, inner) / inner for _ in range(repeat)]


def measure_interleaved(fns, *, repeat, **kw):
    """{name: per-call times of `repeat` blocks} for several callables, timed round-robin (block k
    of every callable before block k + 1 of any), so a slow spell of a shared machine lands on all
    of them alike and the ratios between their medians stay meaningful."""
    inner = {name: calibrate(fn, **kw) for name, fn in fns.items()}
    times = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            times[name].append(_block(fn, inner[name]) / inner[name])
    return times


def median(values):
    s = sorted(values)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])
