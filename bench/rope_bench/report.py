"""Turns measured rows into the summary (medians and ratios), the Markdown tables and the files.

Ratios: "of limit" is a row's bandwidth over its limit's (both count the bytes their work needs
at least, so 1.0 is copy speed); "x eager", "x compile", "x <other>" are the other row's median
time over the rope_ext (or drop-in) row's: above 1 means rope_ext is faster.
"""

import json
import os

from .timing import median, quantile

MAIN_KINDS = ("rope_ext", "dropin")


def row_record(case, shape, dtype, row, plan):
    times = plan["times"]
    t = median(times)
    return {
        "case": case, "shape": shape, "dtype": dtype, "name": row.name, "kind": row.kind,
        "op": row.op, "limit": row.limit, "what": row.what, "bytes": row.nbytes, "median_s": t,
        "p25_s": quantile(times, 0.25), "p75_s": quantile(times, 0.75),
        "min_s": min(times), "max_s": max(times), "gbps": row.nbytes / t / 1e9,
        "first_call_s": plan["first_call_s"], "calls_per_block": plan["inner"], "times_s": times,
    }


def summarize(results):
    """Per (case, dtype, op) with a rope_ext or drop-in row: its median, bandwidth, share of its
    limit's bandwidth, and the other rows of the comparison as time ratios."""
    groups = {}
    for r in results:
        groups.setdefault((r["case"], r["dtype"]), []).append(r)
    out = []
    for (case, dtype), rows in groups.items():
        by_name = {r["name"]: r for r in rows}
        for main in (r for r in rows if r["kind"] in MAIN_KINDS):
            limit = by_name.get(main["limit"])
            s = {
                "case": case, "dtype": dtype, "shape": main["shape"], "op": main["op"],
                "row": main["name"], "kind": main["kind"], "median_s": main["median_s"], "gbps": main["gbps"],
                "limit": limit["name"] if limit else None,
                "limit_gbps": limit["gbps"] if limit else None,
                "of_limit": main["gbps"] / limit["gbps"] if limit else None,
                "others": {},
            }
            for r in rows:
                if r["op"] == main["op"] and r is not main and r["kind"] not in MAIN_KINDS:
                    s["others"][r["name"]] = {"kind": r["kind"], "median_s": r["median_s"],
                                              "speedup": r["median_s"] / main["median_s"]}
            out.append(s)
    return out


def _us(t):
    return "-" if t is None else (f"{t * 1e6:.1f}" if t < 1e-2 else f"{t * 1e3:.1f} ms")


def _x(v):
    return "-" if v is None else f"{v:.2f}x"


def _shape(shape):
    return f"{shape['tokens']}x{shape['q_heads']}x{shape['head_dim']} (k: {shape['kv_heads']} heads)"


def limits_table(results):
    rows = {}
    for r in results:
        if r["kind"] == "limit":
            rows.setdefault((r["case"], r["dtype"]), {"shape": r["shape"]})[r["name"]] = r
    lines = ["| case | shape (q) | dtype | copy us | copy GB/s | clone us | clone GB/s |",
             "|---|---|---|---|---|---|---|"]
    for (case, dtype), g in rows.items():
        cells = [case, _shape(g["shape"]), dtype]
        for name in ("copy", "clone"):
            r = g.get(name)
            cells += ["-", "-"] if r is None else [_us(r["median_s"]), f"{r['gbps']:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def ops_table(summary):
    lines = ["| op | case | dtype | us | GB/s | of limit | eager us | x eager | compile us | "
             "x compile | others (us, x) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in summary:
        if s["kind"] != "rope_ext":
            continue  # drop-ins: their own table
        o = dict(s["others"])
        eager, comp = o.pop(f"{s['op']} eager", None), o.pop(f"{s['op']} compile", None)
        rest = ", ".join(f"{k.split(' ', 1)[-1]} {_us(v['median_s'])} ({_x(v['speedup'])})"
                         for k, v in o.items())
        cells = [s["op"], s["case"], s["dtype"], _us(s["median_s"]), f"{s['gbps']:.1f}",
                 f"{_x(s['of_limit'])} {s['limit']}" if s["limit"] else "-",
                 _us(eager and eager["median_s"]), _x(eager and eager["speedup"]),
                 _us(comp and comp["median_s"]), _x(comp and comp["speedup"]), rest or "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def dropin_table(summary):
    rows = [s for s in summary if s["kind"] == "dropin"]
    if not rows:
        return None
    lines = ["| drop-in | case | dtype | us | GB/s | of limit | peer's own path (us, x) |",
             "|---|---|---|---|---|---|---|"]
    for s in rows:
        rest = ", ".join(f"{k.split(' ', 1)[-1]} {_us(v['median_s'])} ({_x(v['speedup'])})"
                         for k, v in s["others"].items())
        lines.append("| " + " | ".join([
            s["row"], s["case"], s["dtype"], _us(s["median_s"]), f"{s['gbps']:.1f}",
            f"{_x(s['of_limit'])} {s['limit']}" if s["limit"] else "-", rest or "-"]) + " |")
    return "\n".join(lines)


def markdown(doc):
    m = doc["meta"]
    parts = [
        f"rope_ext {m['rope_ext']} ({m['backend']} on {m['device']}), torch {m['torch']}, "
        f"{m['device_name']}; CPU kernels: {m['cpu_isa']}; threads: {m['threads']}; "
        f"allocator: {m['allocator']}; load average {m['loadavg_start']} at start, "
        f"{m['loadavg_end']} at end. Median of {m['repeat']} blocks of >= {m['min_block_ms']} ms "
        f"per row, the rows of a case timed round-robin by {m.get('timing', 'the wall clock')}; "
        f"{m['mode']}." + (f" Command: `{m['command']}`." if m.get("command") else ""),
    ]
    if doc["results"] or not doc.get("groups"):
        parts += _case_tables(doc)
    for name, g in doc.get("groups", {}).items():
        parts += ["", f"Group `{name}`: {g['about']} ({g['wall_s']} s).", "", g["table"]]
    notes = [f"- {p}: {s}" for p, s in doc["peers"].items()]
    notes += [f"- {e['case']} {e.get('dtype', '')} {e['name']}: failed ({e['error']})"
              for e in doc["errors"]]
    notes += [f"- skipped: {s}" for s in doc["skipped"]]
    if notes:
        parts += ["", "Notes:", ""] + notes
    return "\n".join(parts) + "\n"


def _case_tables(doc):
    parts = [
        "",
        "Memory-copy limits (bytes: x read + x written):",
        "",
        limits_table(doc["results"]),
        "",
        "Ops: median time per call; GB/s over the bytes the work needs at least; \"of limit\": "
        "that bandwidth over the limit's; \"x eager\" / \"x compile\" / others: their time over "
        "rope_ext's (above 1: rope_ext is faster).",
        "",
        ops_table(doc["summary"]),
    ]
    d = dropin_table(doc["summary"])
    if d:
        parts += ["", "Drop-ins (rope_ext.compat) against the peer's own eager code path:", "", d]
    return parts


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
