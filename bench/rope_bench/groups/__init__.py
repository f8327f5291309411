"""Case groups: benchmarks that are not one op on one shape against the copy limits, each in its
own module here, run with `--cases <name>[,<name>...]` (mixable with the shape cases).

A group module defines
  NAME    what --cases calls it
  ABOUT   one line for --help and the report
  ORDER   (optional) where it runs among the groups, lowest first (default 100)
  run(ctx) -> {"rows": [dict, ...], "notes": [str, ...]}   measures; every row a JSON-able dict
  table(result) -> str                                      the Markdown table of run's result
and is found by its file alone: adding a group is adding a module (names starting with "_" are
not groups). ctx (Context below) carries the run's settings and the interleaved timer.
"""

import importlib
import pkgutil
from dataclasses import dataclass, field

from ..timing import measure_interleaved, median, quantile


def discover():
    """{NAME: module} of every group module in this package, in ORDER."""
    found = []
    for m in pkgutil.iter_modules(__path__):
        if m.name.startswith("_"):
            continue
        mod = importlib.import_module(f"{__name__}.{m.name}")
        found.append((getattr(mod, "ORDER", 100), mod.NAME, mod))
    return {name: mod for _, name, mod in sorted(found, key=lambda t: (t[0], t[1]))}


@dataclass
class Context:
    device: str
    dtypes: list  # names, as --dtypes gives them
    dtypes_given: bool  # whether --dtypes was on the command line (a group may default otherwise)
    repeat: int
    min_block_s: float
    clock: object
    quick: bool = False
    errors: list = field(default_factory=list)

    def time(self, fns, label=""):
        """{name: stats} of callables timed round-robin in blocks (timing.measure_interleaved);
        a callable that fails is recorded in errors and left out."""
        def failed(name, e):
            msg = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            self.errors.append({"case": label, "name": name, "error": msg})
            print(f"  {label} {name} FAILED {msg}", flush=True)

        plan = measure_interleaved(fns, self.clock, repeat=self.repeat,
                                   min_block_s=self.min_block_s, on_error=failed)
        return {name: stats(p["times"]) for name, p in plan.items()}


def stats(times):
    """Median and quartiles (seconds) of per-call times, with the times themselves."""
    return {"median_s": median(times), "p25_s": quantile(times, 0.25),
            "p75_s": quantile(times, 0.75), "times_s": list(times)}


def us(t):
    return "-" if t is None else f"{t * 1e6:.1f}"


def ms(t):
    return "-" if t is None else f"{t * 1e3:.1f}"


def x(v):
    return "-" if v is None else f"{v:.2f}x"


def md_table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


# ---- groups whose rows are calls timed per (sequence length, dtype) against one of them ----

def seq_rows(ctx, group, S, dtype_name, fns, ref, ratio, ref_key=None):
    """The rows of one (S, dtype) of a group: fns timed round-robin, each row's median over
    row `ref`'s as `ratio` (and ref's median as `ref_key`, if given); prints a line."""
    timed = ctx.time(fns, f"{group} S={S} {dtype_name}")
    base = timed.get(ref, {}).get("median_s")
    out = []
    for name, s in timed.items():
        row = {"call": name, "seq": S, "dtype": dtype_name, **s}
        if ref_key:
            row[ref_key] = base
        row[ratio] = s["median_s"] / base if base else None
        out.append(row)
    print(f"  {group} S={S:5d} {dtype_name:8s} " + ", ".join(
        f"{n} {s['median_s'] * 1e6:.1f} us" for n, s in timed.items()), flush=True)
    return out


def seq_table(rows, corner, ratio, ratio_label, label=lambda call: call):
    """A table of seq_rows' rows: a row per call, a column per (S, dtype), each cell the median
    in us and `ratio` (headed `ratio_label`)."""
    cols = sorted({(r["seq"], r["dtype"]) for r in rows}, key=lambda c: (c[1], c[0]))
    header = [corner] + [f"S={s} {d}: us ({ratio_label})" for s, d in cols]
    by = {(r["call"], r["seq"], r["dtype"]): r for r in rows}
    lines = []
    for call in dict.fromkeys(r["call"] for r in rows):
        cells = []
        for s, d in cols:
            r = by.get((call, s, d))
            cells.append("-" if r is None else f"{us(r['median_s'])} ({x(r[ratio])})")
        lines.append([label(call)] + cells)
    return md_table(header, lines)
