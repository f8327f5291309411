"""`python -m rope_ext` (what `make run` runs): reports the build, checks the kernels that serve
against a float64 reference, and prints a small timing table."""

import argparse
import platform
import sys

import torch

import rope_ext
from rope_ext import _native, reference
from rope_ext.bench.timing import measure, median

TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def report_build():
    print("rope_ext", rope_ext.__version__)
    print(f"  torch {torch.__version__} (CUDA {torch.version.cuda or 'none'}), "
          f"Python {platform.python_version()}, {platform.machine()}, "
          f"{torch.get_num_threads()} threads")
    if _native.loaded_from:
        print(f"  native library ({_native.loaded_by}): {_native.loaded_from}")
    else:
        print(f"  native library: not loaded ({_native.load_error})")
    if _native.cuda_loaded_from:
        print(f"  CUDA library: {_native.cuda_loaded_from}")
    elif _native.loaded_by == "compiled":
        print(f"  CUDA library: not loaded ({_native.cuda_load_error})")
    print(f"  CPU kernel variant: {rope_ext.cpu_isa()}")
    cache = rope_ext.cpu_cache_info()
    if cache["available"]:
        print(f"  CPU output cache (outputs >= 16 MiB): up to {cache['limit_bytes'] >> 20} MiB "
              "(ROPE_EXT_CPU_CACHE_MB)")
    else:
        print("  CPU output cache: not available (needs the native library and torch >= 2.11)")
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for dev in ("cpu", "cuda"):
        avail = "" if dev in devices else " (no device here)"
        print(f"  {dev}: {rope_ext.backend(dev)} kernels{avail}")
    return devices


def _max_rel_err(out, ref):
    scale = ref.abs().max().clamp_min(1.0)
    return float((out.double() - ref).abs().max() / scale)


def check_kernels(devices):
    """Native (or whatever serves) vs the reference evaluated in float64."""
    print("\nCorrectness against a float64 reference (max error / max |ref|):")
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
                    rows = cache[pos].unsqueeze(-2)
                    cos, sin = rows[..., : rot // 2], rows[..., rot // 2:]
                    ref = reference.apply_rope(x.double(), cos.double(), sin.double(), interleaved=interleaved)
                    worst = max(worst, _max_rel_err(rope_ext.apply_rope(x, cos, sin, interleaved=interleaved), ref))
                    worst = max(worst, _max_rel_err(
                        torch.ops.rope.apply_backward(x, cos, sin, interleaved),
                        reference.apply_rope_backward(x.double(), cos.double(), sin.double(),
                                                      interleaved=interleaved)))
                    q = x.clone()
                    rope_ext.apply_rope_(q, None, pos, cache, interleaved=interleaved)
                    worst = max(worst, _max_rel_err(q, ref))
                ok = worst <= TOL[dtype]
                failures += not ok
                layout = "interleaved" if interleaved else "half-split"
                print(f"  {dev:4s} {str(dtype).replace('torch.', ''):9s} {layout:11s} "
                      f"{worst:9.2e}  {'ok' if ok else 'FAIL'}")
    return failures


def _median_ms(fn, device, reps):
    if device == "cuda":
        call = fn
        fn = lambda: (call(), torch.cuda.synchronize())  # noqa: E731
    return median(measure(fn, repeat=reps)) * 1e3


def time_kernels(device, shape=(1024, 32, 128), reps=15):
    print(f"\nTiming on {device}, x of shape {list(shape)}, float32 tables, median of {reps} "
          "(timed in blocks; GB/s counts bytes read + written of x):")
    compiled_ref = torch.compile(reference.apply_rope, dynamic=False)
    print(f"  {'dtype':9s} {'implementation':28s} {'ms':>8s} {'GB/s':>7s} {'x copy':>7s}")
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(shape, dtype=dtype, device=device)
        out = torch.empty_like(x)
        pos = torch.arange(shape[0], device=device)
        cache = rope_ext.cos_sin_cache(shape[0], shape[-1], device=device)
        rows = cache[pos].unsqueeze(-2)
        cos, sin = rows[..., : shape[-1] // 2], rows[..., shape[-1] // 2:]
        nbytes = 2 * x.numel() * x.element_size()
        rows_ = [
            ("memory copy (out.copy_(x))", lambda: out.copy_(x)),
            (f"rope_ext apply ({rope_ext.backend(device)})", lambda: rope_ext.apply_rope(x, cos, sin)),
            ("rope_ext apply_ (in place)", lambda: rope_ext.apply_rope_(x, None, pos, cache)),
            ("eager reference", lambda: reference.apply_rope(x, cos, sin)),
            ("torch.compile(reference)", lambda: compiled_ref(x, cos, sin)),
        ]
        copy_ms = None
        for name, fn in rows_:
            ms = _median_ms(fn, device, reps)
            copy_ms = copy_ms or ms
            print(f"  {str(dtype).replace('torch.', ''):9s} {name:28s} {ms:8.3f} "
                  f"{nbytes / ms / 1e6:7.1f} {copy_ms / ms:6.2f}x")


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
