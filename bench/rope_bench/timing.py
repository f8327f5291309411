"""Median time per call of several callables, robust to a shared, noisy machine.

The callables of one case are timed round-robin in blocks (block k of every callable before
block k + 1 of any), so a slow spell of the machine lands on all of them alike and the ratios of
their medians stay meaningful. A block runs a callable enough times to last >= min_block_s, so
the clock's resolution and the cache refill after another callable are a small part of it.
"""

import time

import torch


class CpuClock:
    name = "time.perf_counter around each block"

    def sync(self):
        pass

    def block(self, fn, inner):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        return time.perf_counter() - t0


class ThreadCpuClock(CpuClock):
    """The calling thread's CPU time (user + system, page faults included) around each block:
    on a machine whose cores other jobs keep busy, the time the thread waits for a core is left
    out. Only meaningful with one thread (work on other threads is not counted)."""

    name = "time.thread_time around each block (the calling thread's CPU time)"

    def block(self, fn, inner):
        t0 = time.thread_time()
        for _ in range(inner):
            fn()
        return time.thread_time() - t0


class CudaClock:
    """CUDA events around each block; the block ends with a synchronize, so queued work from one
    callable never runs into the next one's block."""

    name = "CUDA events around each block (synchronized)"

    def __init__(self):
        self.start = torch.cuda.Event(enable_timing=True)
        self.end = torch.cuda.Event(enable_timing=True)

    def sync(self):
        torch.cuda.synchronize()

    def block(self, fn, inner):
        torch.cuda.synchronize()
        self.start.record()
        for _ in range(inner):
            fn()
        self.end.record()
        self.end.synchronize()
        return self.start.elapsed_time(self.end) / 1e3


CLOCKS = ("wall", "thread")


def clock_class(device, kind="wall"):
    if device == "cuda":
        return CudaClock
    return ThreadCpuClock if kind == "thread" else CpuClock


def clock_for(device, kind="wall"):
    return clock_class(device, kind)()


def calibrate(fn, clock, *, min_block_s, max_inner=100000):
    """Warms fn up (first call: allocations, lazy compilation) and returns (calls per block,
    seconds of the first call)."""
    t0 = time.perf_counter()
    fn()
    clock.sync()
    first = time.perf_counter() - t0
    fn()
    inner = 1
    while True:
        elapsed = clock.block(fn, inner)
        if elapsed >= min_block_s or inner >= max_inner:
            return inner, first
        grow = inner * 2 if elapsed <= 0 else int(inner * min_block_s / elapsed * 1.2) + 1
        inner = min(max_inner, max(inner * 2, grow))


def measure_interleaved(fns, clock, *, repeat, min_block_s, on_error=None):
    """{name: {"times": per-call seconds of `repeat` blocks, "first_call_s", "inner"}} for the
    callables that ran; a callable that raises while warming up is reported to on_error(name, exc)
    and left out, so one broken row does not cost the others."""
    plan = {}
    for name, fn in fns.items():
        try:
            inner, first = calibrate(fn, clock, min_block_s=min_block_s)
        except Exception as e:  # noqa: BLE001 - any failure of a row is reported, not fatal
            if on_error is None:
                raise
            on_error(name, e)
            continue
        plan[name] = {"inner": inner, "first_call_s": first, "times": []}
    for _ in range(repeat):
        for name, p in plan.items():
            p["times"].append(clock.block(fns[name], p["inner"]) / p["inner"])
    return plan


def quantile(values, q):
    s = sorted(values)
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def median(values):
    return quantile(values, 0.5)
