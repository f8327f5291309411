"""`python -m rope_ext` (what `make run` runs): reports the build, checks every op of the
kernels that serve against a float64 reference, and prints a small timing table beside a memory
copy, the eager reference and torch.compile of it. The full benchmark is bench/bench.py."""

import argparse
import logging
import platform
import statistics
import sys
import time

import torch

import rope_ext
from rope_ext import _library, reference



def report_build():
    s = _library.state
    print("rope_ext", rope_ext.__version__)
    print(f"  torch {torch.__version__} (CUDA {torch.version.cuda or 'none'}), "
          f"Python {platform.python_version()}, {platform.machine()}, "
          f"{torch.get_num_threads()} threads")
    print(f"  native library ({s.loaded_by}): {s.path}" if s.path else
          f"  native library: not loaded ({s.error})")
    if s.cuda_path:
        print(f"  CUDA library: {s.cuda_path}")
    elif s.loaded_by == "compiled" and str(s.cuda_error).startswith("ModuleNotFoundError"):
        print("  CUDA library: not built (make run builds it where a GPU is visible, make build "
              "always)")
    elif s.loaded_by == "compiled":
        print(f"  CUDA library: not loaded ({s.cuda_error})")
    print(f"  CPU kernel variant: {rope_ext.cpu_isa()}")
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for dev in ("cpu", "cuda"):
        avail = "" if dev in devices else " (no device here)"
        print(f"  {dev}: {rope_ext.backend(dev)} kernels{avail}")
    return devices


def _rel_err(out, ref):
    """The worst error over the tolerance of out's dtype (reference.TOLERANCES, the tests' own):
    at most 1 passes, as torch.testing.assert_close would."""
    rtol, atol = reference.TOLERANCES[out.dtype]
    return float(((out.double() - ref).abs() / (atol + rtol * ref.abs())).max())


def _errors(x, pos, cache, interleaved):
    """The worst error / tolerance of every op on (x, positions, cache) against the float64
    reference."""
    rot = cache.shape[1]
    c64, s64 = reference.cache_halves(cache.double())
    cos, sin = (t[pos].unsqueeze(-2) for t in reference.cache_halves(cache))
    x64 = x.double()
    ref = reference.apply_positions(x64, pos, c64, s64, interleaved=interleaved)
    ref_back = reference.apply_positions(x64, pos, c64, s64, interleaved=interleaved, inverse=True)
    q = x.clone()
    rope_ext.apply_rope_(q, None, pos, cache, interleaved=interleaved)
    m = x.clone()
    rope_ext.apply_mrope_(m, None, pos.expand(3, *pos.shape), cache, [rot // 2, 0, 0],
                          interleaved=interleaved)
    return max(
        _rel_err(rope_ext.apply_rope(x, cos, sin, interleaved=interleaved), ref),
        _rel_err(torch.ops.rope.apply_backward(x, cos, sin, interleaved), ref_back),
        _rel_err(rope_ext.apply_rope_at(x, pos, cache, interleaved=interleaved), ref),
        _rel_err(q, ref),
        _rel_err(m, ref),
    )


def check_kernels(devices):
    print("\nEvery op against a float64 reference (worst error / tolerance, at most 1 passes):")
    cases = [((7, 4, 64), 64), ((3, 5, 2, 80), 32), ((16, 8, 128), 128), ((2, 9, 256), 192)]
    failures = 0
    for dev in devices:
        for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
            for interleaved in (False, True):
                worst = 0.0
                for shape, rot in cases:
                    x = torch.randn(shape, dtype=dtype, device=dev)
                    pos = torch.randint(0, 10_000, shape[:-2], device=dev)
                    cache = rope_ext.cos_sin_cache(10_000, rot, device=dev)
                    worst = max(worst, _errors(x, pos, cache, interleaved))
                ok = worst <= 1.0
                failures += not ok
                layout = "interleaved" if interleaved else "half-split"
                print(f"  {dev:4s} {str(dtype).replace('torch.', ''):9s} {layout:11s} "
                      f"{worst:9.2e}  {'ok' if ok else 'FAIL'}")
    return failures


def median_us(fn, device, blocks=15, min_block_s=0.01):
    """Median time of one call, over blocks of calls each long enough to time."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    fn()
    sync()
    calls, t = 1, 0.0
    while t < min_block_s:  # calls per block
        calls *= 2
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        t = time.perf_counter() - t0
    samples = []
    for _ in range(blocks):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        samples.append((time.perf_counter() - t0) / calls)
    return statistics.median(samples) * 1e6


def time_kernels(device, shape=(1024, 32, 128)):
    print(f"\nTiming on {device}, x of shape {list(shape)}, float32 table, median of 15 blocks "
          "(GB/s counts the bytes of x read and written; bench/bench.py is the full benchmark):")
    # On a machine without a GPU, torch.compile's C++ toolchain lookup warns that it found the
    # CUDA toolkit but no CUDA runtime: true, and nothing to act on here.
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    compiled_ref = torch.compile(reference.apply_rope, dynamic=False)
    print(f"  {'dtype':9s} {'implementation':30s} {'us':>9s} {'GB/s':>7s} {'vs copy':>8s}")
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(shape, dtype=dtype, device=device)
        out = torch.empty_like(x)
        pos = torch.arange(shape[0], device=device)
        cache = rope_ext.cos_sin_cache(shape[0], shape[-1], device=device)
        cos, sin = (t[pos].unsqueeze(-2) for t in reference.cache_halves(cache))
        nbytes = 2 * x.numel() * x.element_size()
        rows = [
            ("memory copy (x.clone())", lambda: x.clone()),
            ("memory copy (out.copy_(x))", lambda: out.copy_(x)),
            (f"rope_ext apply ({rope_ext.backend(device)})", lambda: rope_ext.apply_rope(x, cos, sin)),
            ("rope_ext apply_ (in place)", lambda: rope_ext.apply_rope_(x, None, pos, cache)),
            ("eager reference", lambda: reference.apply_rope(x, cos, sin)),
            ("torch.compile(reference)", lambda: compiled_ref(x, cos, sin)),
        ]
        copy_us = {}
        for name, fn in rows:
            us = median_us(fn, device)
            base = copy_us.setdefault("clone" if "clone" in name or "apply (" in name else "copy", us)
            print(f"  {str(dtype).replace('torch.', ''):9s} {name:30s} {us:9.1f} "
                  f"{nbytes / us / 1e3:7.1f} {base / us:7.2f}x")


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m rope_ext", description=__doc__)
    parser.add_argument("--no-timing", action="store_true", help="skip the timing table")
    args = parser.parse_args(argv)
    devices = report_build()
    failures = check_kernels(devices)
    if not args.no_timing:
        for dev in devices:
            time_kernels(dev)
    if failures:
        print(f"\n{failures} check(s) FAILED")
        return 1
    print("\nall checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
