"""Turns measurements into the printed/Markdown tables, the JSON document and target checks."""

import json
import os

from .impls import COMPILED, IMPLS

ROPE_IMPLS = ("apply", "apply_out", "apply_", "backward")
# (case, minimum bandwidth ratio to copy for apply, apply.out and apply_): the targets.
# apply.out is the out-of-place rotation at copy's terms (a preallocated output); apply also
# pays for a fresh output's pages (bench/NOTES.md).
COPY_TARGETS = {"large": 0.85, "cache": 0.5}
COMPILE_SPEEDUP_TARGET = 2.0


def summarize(rows):
    """Per (case, dtype): ratios to copy/clone and speed-ups over the compiled and eager refs."""
    groups = {}
    for r in rows:
        groups.setdefault((r["case"], r["dtype"]), {})[r["impl"]] = r
    out = []
    for (case, dtype), g in groups.items():
        s = {"case": case, "dtype": dtype, "shape": next(iter(g.values()))["shape"]}

        def t(name):
            return g[name]["median_s"] if name in g else None

        for name in ROPE_IMPLS:
            if t(name) is None:
                continue
            if t("copy"):
                s[f"{name}_x_copy"] = t("copy") / t(name)
            if t("clone"):
                s[f"{name}_x_clone"] = t("clone") / t(name)
            compiled = [t(c) for c in COMPILED if t(c)]
            if compiled and name not in ("backward", "apply_out"):
                s[f"{name}_speedup_vs_compile"] = min(compiled) / t(name)
            if t("eager_ref"):
                s[f"{name}_speedup_vs_eager_ref"] = t("eager_ref") / t(name)
        compiled = [t(c) for c in COMPILED if t(c)]
        if compiled and t("copy"):
            # The most any op that reads x and writes a result of x's size could show here.
            s["copy_speedup_vs_compile"] = min(compiled) / t("copy")
        if t("empty_op") is not None:
            s["empty_op_us"] = t("empty_op") * 1e6
        out.append(s)
    return out


def check_targets(summary):
    """The issue's targets as (description, value, passed) lines; informational, never raised."""
    lines = []
    for s in summary:
        tag = f"{s['case']} {s['dtype']}"
        need = COPY_TARGETS.get(s["case"])
        for name in ("apply", "apply_out", "apply_"):
            if need is not None and f"{name}_x_copy" in s:
                v = s[f"{name}_x_copy"]
                lines.append((f"{tag}: {name} >= {need}x copy bandwidth", v, v >= need))
            key = f"{name}_speedup_vs_compile"
            if key in s:
                v = s[key]
                desc = f"{tag}: {name} >= {COMPILE_SPEEDUP_TARGET}x faster than torch.compile"
                ceiling = s.get("copy_speedup_vs_compile")
                if v < COMPILE_SPEEDUP_TARGET and ceiling is not None:
                    desc += f" (copy itself: {ceiling:.2f}x)"
                lines.append((desc, v, v >= COMPILE_SPEEDUP_TARGET))
    return lines


def _fmt(v, spec):
    return "-" if v is None else format(v, spec)


def gbps_table(rows, impls):
    """Markdown: GB/s per implementation (time in us for empty_op), one line per case/dtype."""
    groups = {}
    for r in rows:
        groups.setdefault((r["case"], r["dtype"], tuple(r["shape"])), {})[r["impl"]] = r
    head = ["case", "shape", "dtype"] + [i if i != "empty_op" else "empty_op (us)" for i in impls]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (case, dtype, shape), g in groups.items():
        cells = [case, "x".join(map(str, shape)), dtype]
        for i in impls:
            r = g.get(i)
            if r is None:
                cells.append("-")
            elif i == "empty_op":
                cells.append(_fmt(r["median_s"] * 1e6, ".2f"))
            else:
                cells.append(_fmt(r["gbps"], ".1f"))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def ratio_table(summary):
    cols = [
        ("apply_x_copy", "apply / copy"),
        ("apply_out_x_copy", "apply.out / copy"),
        ("apply__x_copy", "apply_ / copy"),
        ("backward_x_copy", "backward / copy"),
        ("apply_x_clone", "apply / clone"),
        ("apply_speedup_vs_compile", "apply vs compile"),
        ("apply__speedup_vs_compile", "apply_ vs compile"),
        ("copy_speedup_vs_compile", "copy vs compile"),
        ("apply_speedup_vs_eager_ref", "apply vs eager ref"),
    ]
    head = ["case", "dtype"] + [c[1] for c in cols]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in summary:
        cells = [s["case"], s["dtype"]] + [
            _fmt(s.get(k), ".2f") + ("x" if s.get(k) is not None else "") for k, _ in cols
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def markdown(doc):
    meta = doc["meta"]
    impls = [i for i in IMPLS if any(r["impl"] == i for r in doc["results"])]
    parts = [
        f"rope_ext {meta['rope_ext']}, torch {meta['torch']}, CPU kernels: {meta['cpu_isa']}, "
        f"threads: {meta['threads']}, {meta['cpu']}; load average {meta['loadavg_start']} at start, "
        f"{meta['loadavg_end']} at end; median of {meta['repeat']} timed blocks (>= 20 ms), taken "
        f"round-robin across implementations; malloc: {meta.get('allocator', 'glibc defaults')}.",
        "",
        "Bandwidth, GB/s (x read + result written, 2 * x.nbytes; higher is better):",
        "",
        gbps_table(doc["results"], impls),
        "",
        "Ratios (bandwidth relative to copy/clone; speed-up = the other's time / ours):",
        "",
        ratio_table(doc["summary"]),
        "",
        "Targets:",
        "",
    ]
    parts += [f"- {'PASS' if ok else 'MISS'} {d}: {v:.2f}" for d, v, ok in doc["targets"]]
    return "\n".join(parts) + "\n"


def write(doc, out_dir, stem):
    os.makedirs(out_dir, exist_ok=True)
    json_path = os.path.join(out_dir, stem + ".json")
    with open(json_path, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    md_path = os.path.join(out_dir, stem + ".md")
    with open(md_path, "w") as f:
        f.write(markdown(doc))
    return json_path, md_path
