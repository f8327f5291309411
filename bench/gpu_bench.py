"""GPU benchmark of the CUDA kernels, side by side with what they must beat.

For rope.apply (a rotated copy of the query) and rope.apply_ (query and key in place, GQA, from a
fused qkv buffer), in bf16 and fp32, prefill- and decode-sized:
  - rope_ext        the native CUDA kernel
  - copy            a device-to-device copy of the same bytes (the bandwidth ceiling)
  - eager           rope_ext.reference in eager PyTorch
  - compiled        torch.compile of rope_ext.reference
Each time is the median over --iters runs, each timed with its own pair of CUDA events.
Prints a table and writes everything to --json.

    python bench/gpu_bench.py --json results.json
    python bench/gpu_bench.py --device cpu --small   # a dry run of the logic on the CPU
"""

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import rope_ext  # noqa: E402
from rope_ext import reference  # noqa: E402

HQ, HK, D = 32, 8, 128
MAX_POSITION = 65536


def timer(device):
    """f -> list of per-call times in microseconds, for `iters` calls after `warmup`."""

    def run(f, iters, warmup):
        for _ in range(warmup):
            f()
        times = []
        if device == "cuda":
            pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
            for start, end in pairs:
                start.record()
                f()
                end.record()
            torch.cuda.synchronize()
            times = [s.elapsed_time(e) * 1e3 for s, e in pairs]
        else:
            for _ in range(iters):
                t0 = time.perf_counter()
                f()
                times.append((time.perf_counter() - t0) * 1e6)
        return times

    return run


def make_case(tokens, dtype, device):
    qkv = torch.randn(tokens, (HQ + 2 * HK) * D, dtype=dtype, device=device)
    q = qkv[:, : HQ * D].view(tokens, HQ, D)
    k = qkv[:, HQ * D : (HQ + HK) * D].view(tokens, HK, D)
    positions = torch.randint(0, MAX_POSITION, (tokens,), device=device)
    cache = rope_ext.cos_sin_cache(MAX_POSITION, D, device=device)  # float32
    rows = cache[positions]
    cos, sin = rows[:, None, : D // 2], rows[:, None, D // 2 :]  # [T, 1, D/2] float32
    return qkv, q, k, positions, cache, cos.contiguous(), sin.contiguous()


def reference_inplace(q, k, positions, cache):
    """rope.apply_ in plain PyTorch (the reference's math without its data-dependent range
    check, which would break the compiled graph): gather the rows, rotate, write back."""
    half = cache.shape[1] // 2
    rows = cache[positions].unsqueeze(-2)
    cos, sin = rows[..., :half], rows[..., half:]
    q.copy_(reference.apply_rope(q, cos, sin))
    k.copy_(reference.apply_rope(k, cos, sin))


def variants(op, tokens, dtype, device):
    """name -> (callable, bytes it must move at least)."""
    qkv, q, k, positions, cache, cos, sin = make_case(tokens, dtype, device)
    esize = q.element_size()
    if op == "apply":
        x = q.contiguous()
        out = torch.empty_like(x)
        nbytes = 2 * x.numel() * esize + 2 * cos.numel() * cos.element_size()
        src = torch.empty(nbytes // 2, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        compiled = torch.compile(lambda a, c, s: reference.apply_rope(a, c, s))
        return nbytes, {
            "rope_ext": lambda: torch.ops.rope.apply(x, cos, sin, False),
            "copy": lambda: dst.copy_(src),
            "eager": lambda: reference.apply_rope(x, cos, sin),
            "compiled": lambda: compiled(x, cos, sin),
        }
    # apply_: read and write the q and k elements, read positions and one cache row per token
    nbytes = 2 * (q.numel() + k.numel()) * esize + positions.numel() * 8 + tokens * D * 4
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    compiled = torch.compile(reference_inplace)
    return nbytes, {
        "rope_ext": lambda: torch.ops.rope.apply_(q, k, positions, cache, False),
        "copy": lambda: dst.copy_(src),
        "eager": lambda: reference_inplace(q, k, positions, cache),
        "compiled": lambda: compiled(q, k, positions, cache),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="tiny sizes (dry run)")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    args = ap.parse_args()
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("gpu_bench: no CUDA GPU visible")

    sizes = {"prefill": 256, "decode": 4} if args.small else {"prefill": 32768, "decode": 64}
    run = timer(device)
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "backend": rope_ext.backend(device),
        "shape": {"q_heads": HQ, "kv_heads": HK, "head_dim": D, "tables": "float32"},
        "timing": f"median of {args.iters} runs, {'CUDA events' if device == 'cuda' else 'perf_counter'}",
        "results": [],
    }
    print(f"# {info['device']}  torch {info['torch']}  backend {info['backend']}  {info['date']}")
    header = f"{'op':7} {'dtype':9} {'case':8} {'tokens':>6} " + " ".join(
        f"{n + ' us':>12}" for n in ("rope_ext", "copy", "eager", "compiled")
    ) + f" {'GB/s':>7} {'%copy':>6} {'x comp':>6}"
    print(header)
    for op in ("apply", "apply_"):
        for dtype in (torch.bfloat16, torch.float32):
            for case, tokens in sizes.items():
                nbytes, fns = variants(op, tokens, dtype, device)
                if args.no_compile:
                    fns.pop("compiled")
                med = {}
                for name, f in fns.items():
                    try:
                        med[name] = statistics.median(run(f, args.iters, args.warmup))
                    except Exception as e:  # keep the other columns if compile fails here
                        med[name] = None
                        print(f"  {name} failed: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
                ours, copy, comp = med.get("rope_ext"), med.get("copy"), med.get("compiled")
                gbs = nbytes / (ours * 1e-6) / 1e9 if ours else None
                pct_copy = 100 * copy / ours if ours and copy else None
                vs_comp = comp / ours if ours and comp else None
                row = {
                    "op": op, "dtype": str(dtype).replace("torch.", ""), "case": case, "tokens": tokens,
                    "bytes": nbytes, "median_us": med, "rope_ext_GBps": gbs,
                    "pct_of_copy_bandwidth": pct_copy, "speedup_vs_compiled": vs_comp,
                }
                info["results"].append(row)

                def fmt(v, w=12, p=1):
                    return f"{v:>{w}.{p}f}" if v is not None else f"{'-':>{w}}"

                print(
                    f"{op:7} {row['dtype']:9} {case:8} {tokens:>6} "
                    + " ".join(fmt(med.get(n)) for n in ("rope_ext", "copy", "eager", "compiled"))
                    + f" {fmt(gbs, 7, 0)} {fmt(pct_copy, 6, 0)} {fmt(vs_comp, 6, 2)}"
                )
                sys.stdout.flush()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(info, f, indent=1)
        print(f"# wrote {args.json}")


if __name__ == "__main__":
    main()
