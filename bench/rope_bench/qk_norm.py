"""Benchmark of the fused QK-RMSNorm + RoPE op (rope.qkv_norm_rope_): packed qkv
(T, (Hq + Hk + Hv) * D) in place, against, measured side by side (timing.measure_interleaved):
  floor      an in-place pass over the same q/k bytes: q.mul_(c); k.mul_(c) on the qkv views
  unfused    rope_ext's unfused path: torch's rms_norm of q and k, then rope_ext.apply_rope_
  compiled   torch.compile of the eager norm (transformers' float32 RMSNorm) + RoPE (gathered
             cos/sin, rotate_half), the unfused computation a compiler sees, written back into
             q and k as the fused op writes (a peer returning new tensors would pay for their
             fresh pages, 64 MiB of q at the DRAM case, which the in-place op does not)
at DRAM-sized prefill, cache-resident and decode-sized calls. Prints a table of medians and
ratios, writes qk_norm_<device>.json to --out.

    python bench/rope_bench/qk_norm.py [--device cpu|cuda] [--quick] [--no-compile] [--out DIR]
                                       [--threads N] [--clock wall|thread]
"""

import argparse
import datetime
import json
import os
import platform
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(HERE))  # rope_bench
    sys.path.insert(1, os.path.dirname(os.path.dirname(HERE)))  # rope_ext from this checkout

import rope_ext  # noqa: E402
from rope_ext.qk_norm import qkv_norm_rope_  # noqa: E402
from rope_bench import malloc  # noqa: E402
from rope_bench.cases import steady_norm_weight  # noqa: E402
from rope_bench.timing import CLOCKS, clock_for, measure_interleaved, median  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
HEADS = (32, 8, 8)
HEAD_DIM = 128
# (name, tokens): DRAM-sized prefill, cache-resident, decode
CASES = (("dram", 8192), ("cache", 64), ("decode-8", 8), ("decode-1", 1))
QUICK_CASES = (("dram", 8192), ("cache", 64), ("decode-1", 1))
EPS = 1e-6


class Case:
    def __init__(self, tokens, dtype, device):
        hq, hk, hv = HEADS
        d = HEAD_DIM
        self.hq, self.hk, self.hv, self.d = hq, hk, hv, d
        self.qkv = torch.randn(tokens, (hq + hk + hv) * d, dtype=dtype, device=device)
        self.q = self.qkv[:, : hq * d].view(tokens, hq, d)
        self.k = self.qkv[:, hq * d : (hq + hk) * d].view(tokens, hk, d)
        # Every timed call rewrites q and k in place: weights that keep them steady.
        self.wq = steady_norm_weight(d, dtype, device)
        self.wk = steady_norm_weight(d, dtype, device)
        self.cache = rope_ext.cos_sin_cache(4096, d).to(device)
        self.pos = torch.randint(0, 4096, (tokens,), device=device)
        self.c = torch.tensor(1.0, dtype=dtype, device=device)
        self.moved = 2 * (hq + hk) * d * tokens * self.qkv.element_size()  # q/k read + written

    def fused(self):
        qkv_norm_rope_(self.qkv, self.hq, self.hk, self.hv, self.d, self.wq, self.wk, self.pos,
                       self.cache, eps=EPS)

    def floor(self):
        self.q.mul_(self.c)
        self.k.mul_(self.c)

    def unfused(self):
        qn = torch.nn.functional.rms_norm(self.q, (self.d,), self.wq, EPS)
        kn = torch.nn.functional.rms_norm(self.k, (self.d,), self.wk, EPS)
        rope_ext.apply_rope_(qn, kn, self.pos, self.cache)
        return qn, kn


def eager_norm_rope(q, k, wq, wk, positions, cache):
    """The unfused computation as transformers and vLLM's native path write it, in place."""
    def norm(x, w):
        xf = x.float()
        return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)

    def rope(x, cos, sin):
        a, b = x.chunk(2, -1)
        return torch.cat((a * cos - b * sin, b * cos + a * sin), -1)

    cos, sin = cache[positions].to(q.dtype).unsqueeze(1).chunk(2, -1)
    q.copy_(rope(norm(q, wq), cos, sin))
    k.copy_(rope(norm(k, wk), cos, sin))


def rows_for(case, with_compile):
    rows = {"fused": case.fused, "floor": case.floor, "unfused": case.unfused}
    if with_compile:
        # each case is timed before the next is made: a fresh cache per case keeps every case
        # within torch's limit of 8 graphs per function (past it the row would run eager)
        torch._dynamo.reset()
        compiled = torch.compile(eager_norm_rope, dynamic=False, fullgraph=True)
        rows["compiled"] = lambda: compiled(case.q, case.k, case.wq, case.wk, case.pos,
                                            case.cache)
    return rows


def run(args):
    clock = clock_for(args.device, args.clock)
    cases = QUICK_CASES if args.quick else CASES
    results = []
    for name, tokens in cases:
        for dname, dtype in DTYPES.items():
            case = Case(tokens, dtype, args.device)
            errors = {}
            plan = measure_interleaved(rows_for(case, args.compile), clock, repeat=args.repeat,
                                       min_block_s=args.min_block_s,
                                       on_error=lambda n, e: errors.__setitem__(n, repr(e)))
            med = {n: median(p["times"]) for n, p in plan.items()}
            rec = {"case": name, "tokens": tokens, "dtype": dname, "heads": list(HEADS),
                   "head_dim": HEAD_DIM, "qk_bytes_moved": case.moved,
                   "median_s": med, "errors": errors,
                   "fused_gbps": case.moved / med["fused"] / 1e9,
                   "floor_gbps": case.moved / med["floor"] / 1e9}
            for other in ("floor", "unfused", "compiled"):
                if other in med:
                    rec[f"{other}_over_fused"] = med[other] / med["fused"]
            results.append(rec)
            print(_line(rec), flush=True)
    return results


HEADER = (f"{'case':<9} {'dtype':<5} {'tokens':>6} {'fused us':>10} {'GB/s':>7} "
          f"{'floor/fused':>11} {'unfused/fused':>13} {'compiled/fused':>14}")


def _line(r):
    def x(key):
        return f"{r[key]:.2f}x" if key in r else "-"

    return (f"{r['case']:<9} {r['dtype']:<5} {r['tokens']:>6} {r['median_s']['fused'] * 1e6:>10.1f} "
            f"{r['fused_gbps']:>7.1f} {x('floor_over_fused'):>11} {x('unfused_over_fused'):>13} "
            f"{x('compiled_over_fused'):>14}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--quick", action="store_true", help="fewer cases and repeats")
    p.add_argument("--no-compile", dest="compile", action="store_false",
                   help="skip the torch.compile row (its compilation takes a while)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads first")
    p.add_argument("--clock", choices=CLOCKS, default="wall",
                   help="cpu: the wall clock (default) or the calling thread's CPU time (thread: "
                   "needs --threads 1; leaves out waits for a core on a busy machine)")
    p.add_argument("--repeat", type=int, default=None)
    p.add_argument("--min-block-ms", type=float, default=None)
    p.add_argument("--out", default=os.path.join(os.path.dirname(HERE), "results"))
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.clock == "thread" and torch.get_num_threads() != 1:
        p.error("--clock thread needs --threads 1 (other threads' work would go uncounted)")
    args.repeat = args.repeat or (5 if args.quick else 15)
    # the unfused row's normalized q and k from recycled memory, as in a long-running process
    allocator = malloc.pin_thresholds() if args.device == "cpu" else "torch's CUDA caching allocator"
    args.min_block_s = (args.min_block_ms or (20 if args.quick else 50)) / 1e3
    print(HEADER)
    with torch.inference_mode():
        results = run(args)
    doc = {
        "meta": {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": "python bench/rope_bench/qk_norm.py " + " ".join(sys.argv[1:]),
            "device": args.device, "backend": rope_ext.backend(args.device),
            "torch": torch.__version__, "python": platform.python_version(),
            "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
            "repeat": args.repeat, "min_block_ms": args.min_block_s * 1e3,
            "clock": clock_for(args.device, args.clock).name,  # what timed it (cuda: events)
            "rows": {"fused": "rope_ext.qkv_norm_rope_ (packed qkv, in place)",
                     "floor": "q.mul_(c); k.mul_(c): an in-place pass over the same bytes",
                     "unfused": "torch rms_norm of q and k, then rope_ext.apply_rope_",
                     "compiled": "torch.compile of the eager float32 RMSNorm + RoPE, "
                                 "written back into q and k"},
            "allocator": allocator,
        },
        "results": results,
    }
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"qk_norm_{args.device}.json")
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    print(f"wrote {os.path.relpath(path, os.path.dirname(os.path.dirname(HERE)))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
