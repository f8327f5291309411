"""Bandwidth against tensor size, one line per implementation, the copy as the limit.

Needs only matplotlib and the JSON the benchmark writes (no torch), so it also runs on its own:
    python rope_ext/bench/plot.py bench/results/cpu.json bench/results/cpu.png
"""

import json
import sys


def plot(doc, png_path):
    """Draws the PNG; returns False (drawing nothing) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    dtypes = sorted({r["dtype"] for r in doc["results"]})
    fig, axes = plt.subplots(1, len(dtypes), figsize=(6.5 * len(dtypes), 4.8), squeeze=False)
    for ax, dtype in zip(axes[0], dtypes):
        lines = {}
        for r in doc["results"]:
            if r["dtype"] == dtype and r["gbps"] is not None:
                lines.setdefault(r["impl"], []).append((r["bytes"] / 2**20, r["gbps"]))
        for impl, pts in lines.items():
            pts.sort()
            xs, ys = zip(*pts)
            if impl == "copy":
                ax.plot(xs, ys, "k--", linewidth=2, label="copy (limit)")
            else:
                ax.plot(xs, ys, marker="o", label=impl)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("bytes moved per call, MiB (x read + result written)")
        ax.set_ylabel("GB/s")
        ax.set_title(f"{dtype}, float32 tables")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    meta = doc["meta"]
    threads = meta["threads"]
    fig.suptitle(f"rope_ext CPU ({meta['cpu_isa']}, {threads} thread{'s' if threads != 1 else ''}), "
                 "median times")
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return True


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        ok = plot(json.load(f), sys.argv[2])
    print("wrote " + sys.argv[2] if ok else "matplotlib is not installed; no PNG")
