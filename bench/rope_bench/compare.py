"""Result sets side by side (one per CPU kernel variant, or per machine): for each case, dtype and
op, each set's time, fraction of its own copy limit and speedup over its own torch.compile row.
Ratios, not times, are what carry across machines.

    python bench/rope_bench/compare.py bench/results/cpu-avx2.json bench/results/cpu-avx512_bf16.json
"""

import argparse
import json
import sys

DEFAULT_OPS = ("apply", "apply.out", "apply_", "apply_rope_and_cache_")


def _label(doc, with_machine=False):
    m = doc["meta"]
    machine = f", {m.get('device_name')}" if with_machine and m.get("device_name") else ""
    return f"{m.get('cpu_isa') or m['device']}{machine} ({m['threads']} thr)"


def labels(docs):
    """Each set's variant and threads; with the machine's name where two sets share a variant."""
    plain = [_label(d) for d in docs]
    return [_label(d, plain.count(lab) > 1) for d, lab in zip(docs, plain)]


def rows(docs, ops):
    """[(case, dtype, op, [(us, of_limit, x_compile) or None per doc])] in the first set's order."""
    index = [{(s["case"], s["dtype"], s["op"]): s for s in d["summary"]} for d in docs]
    seen, out = set(), []
    for s in docs[0]["summary"]:
        key = (s["case"], s["dtype"], s["op"])
        if s["op"] not in ops or key in seen:
            continue
        seen.add(key)
        cells = []
        for ix in index:
            r = ix.get(key)
            if r is None:
                cells.append(None)
                continue
            compile_row = next((o for o in r.get("others", {}).values() if o["kind"] == "compile"), None)
            cells.append((r["median_s"] * 1e6, r["of_limit"],
                          compile_row["speedup"] if compile_row else None))
        out.append((*key, cells))
    return out


def markdown(docs, ops=DEFAULT_OPS):
    head = "| case | dtype | op | " + " | ".join(
        f"{lab}: us / of limit / x compile" for lab in labels(docs)) + " |"
    lines = [head, "|" + "---|" * (3 + len(docs))]
    for case, dtype, op, cells in rows(docs, ops):
        shown = []
        for c in cells:
            if c is None:
                shown.append("-")
            else:
                us, lim, comp = c
                shown.append(f"{us:.1f} / {lim:.2f}x / " + (f"{comp:.2f}x" if comp else "-"))
        lines.append(f"| {case} | {dtype} | `{op}` | " + " | ".join(shown) + " |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", nargs="+", help="bench/bench.py JSON files")
    p.add_argument("--ops", default=",".join(DEFAULT_OPS), help="comma-separated ops")
    args = p.parse_args(argv)
    docs = []
    for path in args.results:
        with open(path) as f:
            docs.append(json.load(f))
    print(markdown(docs, tuple(o for o in args.ops.split(",") if o)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
