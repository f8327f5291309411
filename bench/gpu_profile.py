"""Where a CUDA call's time goes: for each call, the time per call back to back (CUDA events:
what a caller sees, host work included) beside the GPU time of its kernels (torch.profiler),
and which kernels those are. A call whose wall time is far above its kernel time is bound by its
host side (Python, checks, launches); one near it, by its kernels.

    python bench/gpu_profile.py [--out DIR] [--stem NAME] [--calls NAME,...]

Prints a table and writes DIR/NAME.json. Needs a GPU.
"""

import argparse
import json
import os
import statistics
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import rope_ext  # noqa: E402
from rope_bench.cases import CUDA_CASES, QUICK_CASES, Inputs  # noqa: E402
from rope_bench.rows import unfused_cache  # noqa: E402
from serving_bench import offset_case, prologue_case, shift_case  # noqa: E402


def calls(device="cuda", quick=False):
    """name -> a call with its inputs made, the shapes of bench/bench.py and serving_bench.py
    (quick: tiny ones, a smoke run)."""
    shape = (lambda case: QUICK_CASES["tiny"]) if quick else CUDA_CASES.__getitem__
    out = {}
    for case, dtypes in (("decode-64", ("bfloat16",)), ("prefill", ("bfloat16", "float32")),
                         ("long", ("bfloat16",))):
        for dt in dtypes:
            x = Inputs(shape(case), getattr(torch, dt), device)
            tag = f"{case} {dt}"
            out[f"apply {tag}"] = lambda x=x: torch.ops.rope.apply(x.q, x.cos, x.sin, False)
            out[f"apply_ {tag}"] = lambda x=x: rope_ext.apply_rope_(x.q, x.k, x.positions, x.cache)
            out[f"apply_mrope_ {tag}"] = lambda x=x: rope_ext.apply_mrope_(
                x.q, x.k, x.positions3, x.cache, x.section)
            out[f"apply_rope_and_cache_ {tag}"] = lambda x=x: rope_ext.apply_rope_and_cache_(
                x.q, x.k, x.v, x.positions, x.cache, x.key_cache, x.value_cache, x.slots)
            out[f"unfused apply_rope_and_cache_ {tag}"] = unfused_cache(x)
            out[f"copy {tag}"] = lambda x=x: x.out.copy_(x.q)
    x = Inputs(shape("prefill"), torch.bfloat16, device)
    kc, vc = (c.to(torch.float8_e4m3fn) for c in (x.key_cache, x.value_cache))
    scale = torch.ones(1, device=device)
    out["apply_rope_and_cache_ prefill bfloat16, fp8 cache"] = lambda: rope_ext.apply_rope_and_cache_(
        x.q, x.k, x.v, x.positions, x.cache, kc, vc, x.slots, kv_cache_dtype="fp8",
        k_scale=scale, v_scale=scale)
    small = dict(heads=(4, 2), head_dim=64) if quick else {}
    for tokens in (1, 512):
        for cache in ("auto", "fp8"):
            _, _, _, rows = prologue_case(device, 4 if quick else tokens, cache, **small)
            out[f"qk_norm_rope_and_cache_ {tokens} tokens, {cache} cache"] = rows["rope_ext"]
    for slots, cache in ((4096, "auto"), (4096, "fp8"), (64, "auto")):
        name, _, _, rows = shift_case(device, 32 if quick else slots, 8, 128, 128, cache)
        out[f"{name} {slots} slots"] = rows["rope_ext"]
    name, _, _, rows = offset_case(device, 16 if quick else 1024, 16, 512, 64, torch.bfloat16)
    out[f"{name} 1024 tokens"] = rows["rope_ext"]
    return out


def wall_us(fn, iters, blocks=7):
    """Median over blocks of the mean time per call, back to back."""
    times = []
    for _ in range(blocks):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / iters)
    return statistics.median(times)


def kernels_us(fn, iters):
    """GPU time per call of each kernel the call launches."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    per = {}
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t and e.device_type == torch.autograd.DeviceType.CUDA:
            per[e.key[:60]] = t / iters
    return per


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    p.add_argument("--stem", default="gpu-profile")
    p.add_argument("--calls", default=None, help="names separated by semicolons (default: all)")
    args = p.parse_args(argv)
    assert torch.cuda.is_available(), "gpu_profile needs a GPU"
    table = calls()
    names = args.calls.split(";") if args.calls else list(table)
    rows = []
    print(f"| call | wall us/call | kernels us/call | kernels |\n|---|---|---|---|")
    for name in names:
        fn = table[name]
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        iters = 20
        wall = wall_us(fn, iters)
        per = kernels_us(fn, iters)
        dev = sum(per.values())
        rows.append({"call": name, "wall_us": wall, "kernels_us": dev, "kernels": per})
        ks = "; ".join(f"{k} {v:.1f}" for k, v in sorted(per.items(), key=lambda kv: -kv[1]))
        print(f"| {name} | {wall:.1f} | {dev:.1f} | {ks} |", flush=True)
    os.makedirs(args.out, exist_ok=True)
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "library": os.path.basename(rope_ext._library.state.cuda_path or "none")}
    with open(os.path.join(args.out, args.stem + ".json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
