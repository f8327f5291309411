"""Bandwidth against size, one panel per dtype: the two copy limits and each rope_ext op.

Needs only matplotlib and the JSON the benchmark writes, so it also runs on its own:
    python bench/rope_bench/plot.py bench/results/cpu-avx2.json bench/results/cpu-avx2.png
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
    rows = [r for r in doc["results"] if r["kind"] in ("limit", "rope_ext")]
    dtypes = sorted({r["dtype"] for r in rows})
    if not dtypes:
        return False
    fig, axes = plt.subplots(1, len(dtypes), figsize=(6.5 * len(dtypes), 4.8), squeeze=False)
    for ax, dtype in zip(axes[0], dtypes):
        lines = {}
        for r in rows:
            if r["dtype"] == dtype:
                lines.setdefault(r["name"], []).append((r["bytes"] / 2**20, r["gbps"]))
        for name, pts in lines.items():
            xs, ys = zip(*sorted(pts))
            style = {"copy": "k--", "clone": "k:"}.get(name)
            if style:
                ax.plot(xs, ys, style, linewidth=2, label=f"{name} (limit)")
            else:
                ax.plot(xs, ys, marker="o", label=name)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("MiB moved per call")
        ax.set_ylabel("GB/s")
        ax.set_title(f"{dtype}, float32 tables")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    m = doc["meta"]
    fig.suptitle(f"rope_ext on {m['device_name']} ({m['cpu_isa']}, {m['threads']} threads), medians")
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return True


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        ok = plot(json.load(f), sys.argv[2])
    print("wrote " + sys.argv[2] if ok else "matplotlib is not installed; no PNG")
