"""`python -m rope_ext` (what `make run` runs): reports the build, checks every op of the
kernels that serve against a float64 reference (the float8 stores aside: the tests check them
code for code), and prints a small timing table beside a memory
copy, the eager reference and torch.compile of it. The full benchmark is a source checkout's
bench/bench.py."""

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
        print("  CUDA library: not built (built where torch is a CUDA build and a CUDA toolkit is "
              "found; in a checkout, make run builds it where a GPU is visible, make build always)")
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
    at most 1 passes, as torch.testing.assert_close would. A NaN or inf where the reference is
    finite counts as infinitely wrong (a NaN would slip through max())."""
    rtol, atol = reference.TOLERANCES[out.dtype]
    err = (out.double() - ref).abs() / (atol + rtol * ref.abs())
    return float(torch.nan_to_num(err, nan=float("inf")).max()) if err.numel() else 0.0


def _rotation_errors(x, pos, cache, interleaved):
    """The worst error / tolerance of the rotation ops on (x, positions, cache) against the
    float64 reference: out of place (and into out=), its backward, by positions, in place on
    query and key, and MRoPE with three distinct position components."""
    rot = cache.shape[1]
    c64, s64 = reference.cache_halves(cache.double())
    cos, sin = (t[pos].unsqueeze(-2) for t in reference.cache_halves(cache))
    x64 = x.double()
    ref = reference.apply_positions(x64, pos, c64, s64, interleaved=interleaved)
    ref_back = reference.apply_positions(x64, pos, c64, s64, interleaved=interleaved, inverse=True)
    key = x[..., :2, :].flip(-1).contiguous()
    ref_key = reference.apply_positions(key.double(), pos, c64, s64, interleaved=interleaved)
    q, k = x.clone(), key.clone()
    rope_ext.apply_rope_(q, k, pos, cache, interleaved=interleaved)
    out = torch.empty_like(x)
    rope_ext.apply_rope(x, cos, sin, interleaved=interleaved, out=out)
    third = rot // 6
    section = [rot // 2 - 2 * third, third, third]
    pos3 = torch.stack((pos, (pos * 7 + 1) % cache.shape[0], (pos * 13 + 2) % cache.shape[0]))
    ref_m = reference.apply_positions(x64, pos3, c64, s64, interleaved=interleaved,
                                      mrope_section=section)
    m = x.clone()
    rope_ext.apply_mrope_(m, None, pos3, cache, section, interleaved=interleaved)
    return max(
        _rel_err(rope_ext.apply_rope(x, cos, sin, interleaved=interleaved), ref),
        _rel_err(out, ref),
        _rel_err(torch.ops.rope.apply_backward(x, cos, sin, interleaved), ref_back),
        _rel_err(rope_ext.apply_rope_at(x, pos, cache, interleaved=interleaved), ref),
        _rel_err(q, ref),
        _rel_err(k, ref_key),
        _rel_err(m, ref_m),
    )


def _fused_errors(dtype, device, interleaved):
    """The same for the fused ops on (tokens, heads, head_dim) query and key: QK-RMSNorm + RoPE
    in place, out of place and on a packed qkv, the DiT norm forms + RoPE, RoPE + the paged
    cache write, the whole prologue in place and out of place, and the K-shift of a cache; each
    against its reference run in float64."""
    from rope_ext._kv_shift import reference as shift_ref
    from rope_ext._qk_norm import reference as norm_ref

    T, hq, hk, D, rot, blocks, bs = 9, 4, 2, 128, 96, 4, 4

    def rand(*shape, dt=dtype):
        return torch.randn(shape, device=device).to(dt)

    q, k, v = rand(T, hq, D), rand(T, hk, D), rand(T, hk, D)
    wq, wk, bq, bk = rand(D), rand(D), rand(D), rand(D)
    cache = rope_ext.cos_sin_cache(64, rot, device=device)
    pos = torch.randint(0, 64, (T,), device=device)
    slots = torch.randperm(blocks * bs, device=device)[:T]
    slots[::3] = -1  # padding: rotated, not cached
    kc, vc = rand(blocks, bs, hk, D), rand(blocks, bs, hk, D)
    cos, sin = (t[pos].unsqueeze(-2) for t in reference.cache_halves(cache))
    c64, s64 = cos.double(), sin.double()
    cache64 = cache.double()
    q64, k64, v64, wq64, wk64, bq64, bk64, kc64, vc64 = (
        t.double() for t in (q, k, v, wq, wk, bq, bk, kc, vc))
    errs = []

    def clones(*ts):
        return [t.clone() for t in ts]

    a = clones(q, k)  # QK-RMSNorm + RoPE in place
    rope_ext.qk_norm_rope_(*a, wq, wk, pos, cache, eps=1e-6, interleaved=interleaved)
    b = clones(q64, k64)
    norm_ref.qk_norm_rope_(*b, wq64, wk64, pos, cache64, 1e-6, interleaved=interleaved)
    errs += [_rel_err(x, y) for x, y in zip(a, b)]
    errs += [_rel_err(x, y) for x, y in zip(
        rope_ext.qk_norm_rope(q, k, wq, wk, cos, sin, eps=1e-6, interleaved=interleaved,
                              table_width="half"), b)]
    qkv = torch.cat((q, k, v), 1)  # the packed projection (T, (hq + 2 hk) * D), in place
    rope_ext.qkv_norm_rope_(qkv.view(T, -1), hq, hk, hk, D, wq, wk, pos, cache, eps=1e-6,
                            interleaved=interleaved)
    errs += [_rel_err(x, y) for x, y in zip((qkv[:, :hq], qkv[:, hq : hq + hk]), b)]
    errs.append(_rel_err(qkv[:, hq + hk :], v64))
    # the DiT norm forms: per head (FLUX), over all heads of a token (Wan), LayerNorm with
    # bias (CogVideoX)
    across = [t.repeat(h) for t, h in ((wq, hq), (wk, hk))]
    for form, weights, biases in (("rms", (wq, wk), (None, None)),
                                  ("rms_across_heads", across, (None, None)),
                                  ("layer", (wq, wk), (bq, bk))):
        errs += [_rel_err(x, y) for x, y in zip(
            rope_ext.norm_rope(q, k, *weights, cos, sin, q_bias=biases[0], k_bias=biases[1],
                               norm=form, interleaved=interleaved, table_width="half"),
            norm_ref.norm_rope(q64, k64, *(t.double() for t in weights),
                               *(None if t is None else t.double() for t in biases), c64, s64,
                               1e-6, form, interleaved=interleaved))]
    a = clones(q, k, kc, vc)  # RoPE + the paged cache write
    rope_ext.apply_rope_and_cache_(a[0], a[1], v, pos, cache, a[2], a[3], slots,
                                   interleaved=interleaved)
    b = clones(q64, k64, kc64, vc64)
    reference.apply_and_cache_(b[0], b[1], v64, pos, cache64, b[2], b[3], slots,
                               interleaved=interleaved)
    errs += [_rel_err(x, y) for x, y in zip(a, b)]
    a = clones(q, k, v, kc, vc)  # the whole serving prologue, V-norm included
    rope_ext.qk_norm_rope_and_cache_(a[0], a[1], a[2], pos, cache, wq, wk, a[3], a[4], slots,
                                     interleaved=interleaved, v_norm=True)
    b = clones(q64, k64, v64, kc64, vc64)
    norm_ref.qk_norm_rope_and_cache_(b[0], b[1], b[2], pos, cache64, wq64, wk64, b[3], b[4],
                                     slots, interleaved=interleaved, v_norm=True)
    errs += [_rel_err(x, y) for x, y in zip(a, b)]
    kc_out, vc_out = kc.clone(), vc.clone()  # the same, out of place
    out = rope_ext.qk_norm_rope_and_cache(q, k, v, pos, cache, wq, wk, kc_out, vc_out, slots,
                                          interleaved=interleaved, v_norm=True)
    errs += [_rel_err(x, y) for x, y in zip(list(out) + [kc_out, vc_out], b)]
    delta = torch.randint(-63, 64, (T,), device=device)  # the K-shift of the cached keys
    a, b = kc.clone(), kc64.clone()
    rope_ext.shift_kv_cache_(a, slots, delta, cache, interleaved=interleaved)
    shift_ref.shift_kv_cache_(b, slots, delta, cache64, interleaved=interleaved)
    errs.append(_rel_err(a, b))
    return max(errs)


def check_kernels(devices):
    print("\nEvery op against a float64 reference (worst error / tolerance, at most 1 passes; "
          "the float8 stores are checked code for code by the tests):")
    cases = [((7, 4, 64), 64), ((3, 5, 2, 80), 32), ((16, 8, 128), 128), ((2, 9, 256), 192)]
    failures = 0
    for dev in devices:
        for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
            for interleaved in (False, True):
                worst = _fused_errors(dtype, dev, interleaved)
                for shape, rot in cases:
                    x = torch.randn(shape, dtype=dtype, device=dev)
                    pos = torch.randint(0, 10_000, shape[:-2], device=dev)
                    cache = rope_ext.cos_sin_cache(10_000, rot, device=dev)
                    worst = max(worst, _rotation_errors(x, pos, cache, interleaved))
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
          "(GB/s counts the bytes of x read and written; \"vs floor\": the time of x.clone() over "
          "the row's for the rows that return a new tensor, of out.copy_(x) for the in-place "
          "one; bench/bench.py is the full benchmark):")
    # On a machine without a GPU, torch.compile's C++ toolchain lookup warns that it found the
    # CUDA toolkit but no CUDA runtime: true, and nothing to act on here.
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    compiled_ref = torch.compile(reference.apply_rope, dynamic=False)
    print(f"  {'dtype':9s} {'implementation':30s} {'us':>9s} {'GB/s':>7s} {'vs floor':>8s}")
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(shape, dtype=dtype, device=device)
        out = torch.empty_like(x)
        pos = torch.arange(shape[0], device=device)
        cache = rope_ext.cos_sin_cache(shape[0], shape[-1], device=device)
        cos, sin = (t[pos].unsqueeze(-2) for t in reference.cache_halves(cache))
        nbytes = 2 * x.numel() * x.element_size()
        rows = [  # (name, floor: "clone" for a new tensor, "copy" in place, call)
            ("memory copy (x.clone())", "clone", lambda: x.clone()),
            ("memory copy (out.copy_(x))", "copy", lambda: out.copy_(x)),
            (f"rope_ext apply ({rope_ext.backend(device)})", "clone",
             lambda: rope_ext.apply_rope(x, cos, sin)),
            ("rope_ext apply_ (in place)", "copy",
             lambda: rope_ext.apply_rope_(x, None, pos, cache)),
            ("eager reference", "clone", lambda: reference.apply_rope(x, cos, sin)),
            # last: the one row a machine may lack (torch.compile needs a C++ toolchain)
            ("torch.compile(reference)", "clone", lambda: compiled_ref(x, cos, sin)),
        ]
        floor_us = {}
        for name, floor, fn in rows:
            try:
                us = median_us(fn, device)
            except Exception as e:  # (torch.compile's toolchain missing: a row, not a failed run)
                if fn is not rows[-1][2]:
                    raise
                print(f"  {str(dtype).replace('torch.', ''):9s} {name:30s} {'n/a':>9s}  "
                      f"(torch.compile unavailable here: {type(e).__name__})")
                continue
            base = floor_us.setdefault(floor, us)  # the first row of each floor is the floor
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
