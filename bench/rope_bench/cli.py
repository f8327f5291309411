"""`python bench/bench.py --device cpu|cuda [--quick] [--out DIR] [--cases ...]` (see --help)."""

import argparse
import datetime
import gc
import os
import platform
import sys
import tempfile
import time

import torch

import rope_ext
from rope_ext import envs

from . import dropins, groups, malloc, peers, plot, report
from .cases import DTYPES, QUICK_CASES, Inputs, cases_for, default_cases
from .rows import KINDS, OPS, limit_rows, op_rows
from .timing import CLOCKS, clock_class, clock_for, measure_interleaved


RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results")
ROOT = os.path.dirname(os.path.dirname(RESULTS))


def shown_path(path):
    """path relative to the repository when it lies inside it, so results name no machine's
    directories."""
    rel = os.path.relpath(os.path.abspath(path), ROOT)
    return path if rel.startswith("..") else rel

# What changes the numbers from outside the command line, recorded with them.
ENV_RECORDED = ("LD_PRELOAD", "MALLOC_CONF", "GLIBC_TUNABLES", "MALLOC_MMAP_THRESHOLD_",
                "MALLOC_TRIM_THRESHOLD_", "THP_MEM_ALLOC_ENABLE", "ROPE_EXT_CPU_STREAM_MB",
                "ROPE_EXT_CPU_ISA", "ROPE_EXT_BACKEND", "OMP_NUM_THREADS")


def _cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _loadavg():
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def _sysfs(path):
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _stream_threshold():
    """The CPU stream threshold in bytes now in use (None without the native CPU library)."""
    if rope_ext.backend("cpu") != "native":
        return None
    if envs.CPU_STREAM_MB is not None:
        return envs.CPU_STREAM_MB << 20
    return int(torch.ops.rope.set_cpu_stream_threshold(-1))  # -1 = the default: no change


def _list(arg, known, what, parser):
    items = [a for a in arg.split(",") if a]
    unknown = [a for a in items if a not in known]
    if unknown:
        parser.error(f"--{what}: unknown {unknown}; choose from {', '.join(known)}")
    return items


def parse(argv):
    p = argparse.ArgumentParser(
        prog="python bench/bench.py",
        description="Times rope_ext's ops against the memory-copy limits, the eager reference and "
                    "torch.compile (and drop-ins against their peers), interleaved; prints a table "
                    "of medians and ratios and writes JSON + Markdown. docs/cpu-performance.md "
                    "explains the method.")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--quick", action="store_true", help="one tiny case, few repeats (a smoke run)")
    p.add_argument("--out", default=None, help="output directory (default: bench/results/; a "
                   "temporary directory for --quick)")
    p.add_argument("--stem", default=None, help="file names STEM.json/.md/.png (default: the device"
                   " and, on cpu, the kernel variant that served, e.g. cpu-avx2; -quick appended "
                   "for --quick): one results file per CPU variant")
    p.add_argument("--cpu-isa", default=None, help="cpu: the kernel variant to time (rope_ext."
                   "cpu_isas(): baseline, avx2, avx512, avx512_bf16, as this CPU has them; "
                   "default: the best it has)")
    group_mods = groups.discover()
    p.add_argument("--cases", default=None, help="comma-separated; cpu: decode,cache,mid,prefill"
                   " (default), fresh; cuda: decode-1,decode-16,decode-64,prefill,long; and case "
                   "groups (rope_bench/groups/): " + "; ".join(
                       f"{n}: {m.ABOUT}" for n, m in group_mods.items()))
    p.add_argument("--dtypes", default=None, help=", ".join(DTYPES) + " (default: float32,bfloat16;"
                   " bfloat16,float32 on cuda)")
    p.add_argument("--ops", default=",".join(OPS), help=", ".join(OPS))
    p.add_argument("--kinds", default=",".join(k for k in KINDS if k != "limit"),
                   help="rows besides the limits: " + ", ".join(k for k in KINDS if k != "limit"))
    p.add_argument("--repeat", type=int, default=None, help="timed blocks per row (default 15; 3 quick)")
    p.add_argument("--min-block-ms", type=float, default=None,
                   help="least duration of a timed block (default 20 on cpu, 5 on cuda, 2 quick)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads first")
    p.add_argument("--clock", choices=CLOCKS, default="wall",
                   help="cpu: time blocks by the wall clock (default) or by the calling thread's CPU "
                   "time (thread: needs --threads 1; leaves out the waits for a core on a machine "
                   "other jobs load)")
    p.add_argument("--malloc", choices=("pinned", "default"), default="pinned",
                   help="cpu: pin glibc's malloc thresholds for the run (rope_bench/malloc.py)")
    p.add_argument("--time-budget", type=float, default=None,
                   help="seconds; no new case is started after this (the rest is listed as skipped)")
    args = p.parse_args(argv)
    table = QUICK_CASES if args.quick else cases_for(args.device)
    names = list(table) if args.quick else list(default_cases(args.device))
    args.group_list = []
    if args.cases:
        names = _list(args.cases, list(table) + list(group_mods), "cases", p)
        args.group_list = [n for n in names if n in group_mods]
        names = [n for n in names if n in table]
    args.group_mods = {n: group_mods[n] for n in args.group_list}
    args.case_table = {n: table[n] for n in names}
    args.dtypes_given = args.dtypes is not None
    dtypes = args.dtypes or ("bfloat16,float32" if args.device == "cuda" else "float32,bfloat16")
    args.dtype_list = _list(dtypes, list(DTYPES), "dtypes", p)
    args.op_list = _list(args.ops, list(OPS), "ops", p)
    args.kind_list = _list(args.kinds, [k for k in KINDS if k != "limit"], "kinds", p)
    args.repeat = args.repeat or (3 if args.quick else 15)
    args.min_block_s = (args.min_block_ms or (2 if args.quick else 5 if args.device == "cuda" else 20)) / 1e3
    # Groups run alone write beside the shape cases' results, not over them.
    alone = "-" + "-".join(args.group_list) if args.group_list and not args.case_table else ""
    if args.cpu_isa is not None:
        if args.device != "cpu" or rope_ext.backend("cpu") != "native":
            p.error("--cpu-isa: chooses among the native CPU kernels (--device cpu)")
        if args.cpu_isa not in rope_ext.cpu_isas():
            p.error(f"--cpu-isa: this CPU runs {', '.join(rope_ext.cpu_isas())}; got {args.cpu_isa}")
        rope_ext.set_cpu_isa(args.cpu_isa)
    variant = f"-{rope_ext.cpu_isa()}" if args.device == "cpu" and rope_ext.backend("cpu") == "native" else ""
    args.stem = args.stem or args.device + variant + alone + ("-quick" if args.quick else "")
    if args.out is None:  # a smoke run leaves nothing among the committed results
        args.out = (os.path.join(tempfile.gettempdir(), "rope_bench") if args.quick else RESULTS)
    return p, args


def check_device(parser, device):
    if device != "cuda":
        return
    if not torch.cuda.is_available():
        parser.exit(2, f"bench.py: --device cuda, but torch sees no CUDA device (torch "
                       f"{torch.__version__}, CUDA build: {torch.version.cuda or 'none'}); run it "
                       "on a GPU machine (make gpu-check), or use --device cpu\n")
    if rope_ext.backend("cuda") != "native":
        from rope_ext import _library

        print(f"WARNING: no native CUDA kernels ({_library.state.cuda_error}); the rope_ext rows "
              "on cuda are the pure-PyTorch reference", flush=True)


def meta_for(args):
    dev = args.device
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python bench/bench.py " + " ".join(sys.argv[1:]),
        "device": dev,
        "device_name": torch.cuda.get_device_name() if dev == "cuda" else _cpu_model(),
        "rope_ext": rope_ext.__version__, "backend": rope_ext.backend(dev),
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "python": platform.python_version(), "cpu_count": os.cpu_count(),
        "cpu_isa": rope_ext.cpu_isa(), "threads": torch.get_num_threads(),
        "stream_threshold_bytes": _stream_threshold(),
        "repeat": args.repeat, "min_block_ms": args.min_block_s * 1e3,
        "timing": clock_class(dev, args.clock).name,
        "mode": "torch.inference_mode()",
        "env": {k: os.environ[k] for k in ENV_RECORDED if os.environ.get(k)},
        "thp": {"enabled": _sysfs("/sys/kernel/mm/transparent_hugepage/enabled"),
                "defrag": _sysfs("/sys/kernel/mm/transparent_hugepage/defrag")},
        "ops": {name: OPS[name].what for name in args.op_list},
        "kinds": args.kind_list,
        "loadavg_start": _loadavg(),
    }


def run_case(args, case, shape, dtype_name, dropin_module, doc):
    inputs = Inputs(shape, DTYPES[dtype_name], args.device)
    rows = limit_rows(inputs) + op_rows(inputs, args.op_list, args.kind_list)
    if "peer" in args.kind_list:
        extra, status = peers.gpu_peer_rows(inputs, args.op_list)
        rows += extra
        doc["peers"].update({k: v for k, v in status.items() if k not in doc["peers"]})
    if "dropin" in args.kind_list and dropin_module is not None:
        extra, notes = dropins.rows(dropin_module, inputs)
        rows += extra
        doc["skipped"] += [f"{case} {dtype_name}: {n}" for n in notes]
    by_name = {r.name: r for r in rows}

    def failed(name, e):
        msg = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        doc["errors"].append({"case": case, "dtype": dtype_name, "name": name, "error": msg})
        print(f"  {case:9s} {dtype_name:8s} {name:30s} FAILED {msg}", flush=True)

    plan = measure_interleaved({r.name: r.fn for r in rows}, clock_for(args.device, args.clock),
                               repeat=args.repeat, min_block_s=args.min_block_s, on_error=failed)
    shape_d = {"tokens": shape.tokens, "q_heads": shape.q_heads, "kv_heads": shape.kv_heads,
               "head_dim": shape.head_dim}
    width = max(map(len, plan), default=0)
    for name, p in plan.items():
        rec = report.row_record(case, shape_d, dtype_name, by_name[name], p)
        doc["results"].append(rec)
        print(f"  {case:9s} {dtype_name:8s} {name:{width}s} {rec['median_s'] * 1e6:12.2f} us "
              f"{rec['gbps']:8.2f} GB/s", flush=True)


def run_groups(args, doc, start):
    """Each asked-for case group (rope_bench/groups/), its result under doc["groups"][name]."""
    doc["groups"] = {}
    ctx = groups.Context(device=args.device, dtypes=args.dtype_list, dtypes_given=args.dtypes_given,
                         repeat=args.repeat, min_block_s=args.min_block_s,
                         clock=clock_for(args.device, args.clock), quick=args.quick,
                         errors=doc["errors"])
    for name, mod in args.group_mods.items():
        if args.time_budget is not None and time.perf_counter() - start > args.time_budget:
            doc["skipped"].append(f"group {name}: time budget ({args.time_budget:.0f} s) spent")
            continue
        t0 = time.perf_counter()
        result = mod.run(ctx)
        result["about"] = mod.ABOUT
        result["wall_s"] = round(time.perf_counter() - t0, 1)
        result["table"] = mod.table(result)
        doc["groups"][name] = result
        doc["skipped"] += result.get("notes", [])
        gc.collect()
        finish(doc, start)


def finish(doc, start):
    m = doc["meta"]
    m["loadavg_end"] = _loadavg()
    m["wall_s"] = round(time.perf_counter() - start, 1)
    doc["summary"] = report.summarize(doc["results"])
    return report.write(doc, m["out"], m["stem"])


def main(argv=None):
    parser, args = parse(argv)
    check_device(parser, args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.clock == "thread" and (args.device != "cpu" or torch.get_num_threads() != 1):
        parser.error("--clock thread times the calling thread only: it needs --device cpu and "
                     f"--threads 1 (torch uses {torch.get_num_threads()} threads)")
    allocator = "glibc defaults"
    if args.device == "cpu":
        if args.malloc == "pinned":
            allocator = malloc.pin_thresholds()
        elif malloc.preloaded_allocator():
            allocator = "preloaded (not glibc)"
        else:
            allocator = "glibc, adaptive thresholds (not pinned)"
    else:
        allocator = "torch's CUDA caching allocator"
    doc = {"meta": meta_for(args), "results": [], "summary": [], "peers": {}, "errors": [],
           "skipped": []}
    doc["meta"].update(allocator=allocator, out=shown_path(args.out), stem=args.stem)
    dropin_module, status = dropins.load() if "dropin" in args.kind_list else (None, "not asked")
    doc["peers"]["drop-ins"] = status
    m = doc["meta"]
    print(f"bench: {m['device_name']}, rope_ext {m['backend']}, CPU kernels {m['cpu_isa']}, "
          f"{m['threads']} threads, allocator: {allocator}, load average {m['loadavg_start']}",
          flush=True)
    print(f"bench: drop-ins: {status}", flush=True)

    start = time.perf_counter()
    with torch.inference_mode():
        for case, shape in args.case_table.items():
            for dtype_name in args.dtype_list:
                if args.time_budget is not None and time.perf_counter() - start > args.time_budget:
                    doc["skipped"].append(f"{case} {dtype_name}: time budget "
                                          f"({args.time_budget:.0f} s) spent")
                    print(f"  {case:9s} {dtype_name:8s} skipped: time budget spent", flush=True)
                    continue
                torch._dynamo.reset()
                run_case(args, case, shape, dtype_name, dropin_module, doc)
                gc.collect()
                if args.device == "cuda":
                    torch.cuda.empty_cache()
                finish(doc, start)  # after every case, so a run cut short leaves its results
    if args.group_mods:
        run_groups(args, doc, start)
    for p, s in doc["peers"].items():
        if p != "drop-ins":
            print(f"bench: peer {p}: {s}", flush=True)
    json_path, md_path = finish(doc, start)
    print()
    print(report.markdown(doc))
    png = os.path.join(args.out, args.stem + ".png")
    drew = plot.plot(doc, png) if doc["results"] else None
    print(f"wrote {json_path}, {md_path}" + (
        f", {png}" if drew else "" if drew is None else " (no PNG: matplotlib is not installed)"))
    return 0
