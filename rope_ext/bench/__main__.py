"""`python -m rope_ext.bench [--quick] [--out DIR] [--repeat N] [--impls a,b] [--dtypes ...]`"""

import argparse
import datetime
import os
import platform
import sys

import torch

import rope_ext

from . import malloc, plot, report
from .impls import IMPLS, Case
from .timing import measure_interleaved, median

# name -> [tokens, heads, head_dim]. decode/cache/large are the cases; mid fills in the
# bandwidth-against-size curve between cache-resident and memory-bound.
CASES = {
    "decode": (8, 32, 128),
    "cache": (256, 32, 128),
    "mid": (1024, 32, 128),
    "large": (8192, 32, 128),
}
QUICK_CASES = {"tiny": (4, 2, 16)}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def loadavg():
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def run(cases, dtypes, impls, repeat, log=print, min_block_s=20e-3):
    rows = []
    for case_name, shape in cases.items():
        for dtype_name in dtypes:
            case = Case(case_name, shape, DTYPES[dtype_name])
            # Blocks of >= 20 ms: interleaved, each block starts after another implementation has
            # had the caches, and a block of a few calls would time mostly that refill.
            all_times = measure_interleaved({impl: case.fn(impl) for impl in impls}, repeat=repeat,
                                            min_block_s=min_block_s)
            for impl in impls:
                times = all_times[impl]
                t = median(times)
                gbps = None if impl == "empty_op" else case.bytes / t / 1e9
                rows.append({
                    "case": case_name, "shape": list(shape), "dtype": dtype_name, "impl": impl,
                    "bytes": case.bytes, "median_s": t, "gbps": gbps,
                    "min_s": min(times), "max_s": max(times), "times_s": times,
                })
                log(f"  {case_name:6s} {dtype_name:8s} {impl:11s} {t * 1e6:11.2f} us"
                    + ("" if gbps is None else f" {gbps:8.2f} GB/s"))
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m rope_ext.bench", description=__doc__)
    p.add_argument("--quick", action="store_true", help="one tiny case (a smoke run for tests)")
    p.add_argument("--out", default=os.path.join("bench", "results"), help="output directory")
    p.add_argument("--stem", default="cpu", help="output file names: STEM.json, STEM.md, STEM.png")
    p.add_argument("--repeat", type=int, default=None, help="timed blocks per measurement")
    p.add_argument("--impls", default=",".join(IMPLS), help="comma-separated subset of: " + ", ".join(IMPLS))
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--cases", default=None, help="comma-separated subset of: " + ", ".join(CASES))
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads first")
    p.add_argument("--no-pin-malloc", action="store_true",
                   help="leave glibc's adaptive malloc thresholds alone (see rope_ext/bench/malloc.py)")
    args = p.parse_args(argv)
    allocator = "glibc defaults (adaptive)" if args.no_pin_malloc else malloc.pin_thresholds()

    if args.threads:
        torch.set_num_threads(args.threads)
    impls = [i for i in args.impls.split(",") if i]
    unknown = [i for i in impls if i not in IMPLS]
    if unknown:
        p.error(f"unknown --impls {unknown}; choose from {list(IMPLS)}")
    dtypes = [d for d in args.dtypes.split(",") if d]
    if any(d not in DTYPES for d in dtypes):
        p.error(f"--dtypes: choose from {list(DTYPES)}")
    cases = QUICK_CASES if args.quick else CASES
    if args.cases:
        cases = {k: v for k, v in CASES.items() if k in args.cases.split(",")}
    repeat = args.repeat or (3 if args.quick else 15)

    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "rope_ext": rope_ext.__version__, "torch": torch.__version__,
        "python": platform.python_version(), "cpu": cpu_model(), "cpu_count": os.cpu_count(),
        "cpu_isa": rope_ext.cpu_isa(), "threads": torch.get_num_threads(), "repeat": repeat,
        "loadavg_start": loadavg(), "impls": {i: IMPLS[i] for i in impls},
        "timing": "per case, the implementations' timed blocks (>= 20 ms each) round-robin; "
                  "median per implementation",
        "mode": "torch.inference_mode()", "allocator": allocator,
        "bytes_counted": "2 * x.nbytes: x read once, a result of x's size written once",
        "tables": "float32 cos/sin [T, 1, D/2] (apply, backward, reference); float32 "
                  "cos_sin_cache [T, D] (apply_); HF-style: [T, 1, D] in x's dtype",
    }
    print(f"rope_ext.bench: CPU kernels {meta['cpu_isa']}, {meta['threads']} threads, "
          f"load average {meta['loadavg_start']}, malloc: {allocator}", flush=True)
    with torch.inference_mode():
        rows = run(cases, dtypes, impls, repeat, log=lambda s: print(s, flush=True),
                   min_block_s=2e-3 if args.quick else 20e-3)
    meta["loadavg_end"] = loadavg()
    summary = report.summarize(rows)
    doc = {"meta": meta, "results": rows, "summary": summary}
    doc["targets"] = report.check_targets(summary)
    json_path, md_path = report.write(doc, args.out, args.stem)
    print()
    print(report.markdown(doc))
    png = os.path.join(args.out, args.stem + ".png")
    drew = plot.plot(doc, png)
    print(f"wrote {json_path}, {md_path}" + (f", {png}" if drew else " (no PNG: matplotlib is not installed)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
