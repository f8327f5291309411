"""The benchmark runs end to end on a tiny size and writes valid results (no timing asserts:
timings on a shared machine are not test material)."""

import json
import os
import subprocess
import sys

from rope_ext.bench import plot, report
from rope_ext.bench.impls import IMPLS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_quick_run_writes_json_and_table(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "rope_ext.bench", "--quick", "--dtypes", "float32",
         "--out", str(tmp_path), "--stem", "quick"],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    with open(tmp_path / "quick.json") as f:
        doc = json.load(f)
    assert set(doc) == {"meta", "results", "summary", "targets"}
    # Every implementation measured under the same malloc thresholds (rope_ext/bench/malloc.py).
    assert doc["meta"]["allocator"].startswith(("glibc mmap threshold 32 MiB", "not pinned"))
    assert doc["meta"]["cpu_isa"] in ("baseline", "avx2", "avx512", "avx512_bf16", "reference")
    assert {row["impl"] for row in doc["results"]} == set(IMPLS)
    for row in doc["results"]:
        assert row["median_s"] > 0 and len(row["times_s"]) == doc["meta"]["repeat"]
        assert row["min_s"] <= row["median_s"] <= row["max_s"]
        if row["impl"] == "empty_op":
            assert row["gbps"] is None
        else:
            assert abs(row["gbps"] - row["bytes"] / row["median_s"] / 1e9) < 1e-6 * row["gbps"]
    (summary,) = doc["summary"]
    for key in ("apply_x_copy", "apply_out_x_copy", "apply__x_copy", "backward_x_copy",
                "apply_speedup_vs_compile", "copy_speedup_vs_compile"):
        assert summary[key] > 0
    table = (tmp_path / "quick.md").read_text()
    assert "| tiny | 4x2x16 | float32 |" in table
    assert os.path.exists(tmp_path / "quick.png") == _has_matplotlib()


def test_summary_ratios_follow_the_medians():
    rows = [{"case": "c", "dtype": "float32", "shape": [1], "impl": i, "median_s": m}
            for i, m in (("copy", 1.0), ("apply", 2.0), ("compile_ref", 3.0), ("compile_hf", 6.0))]
    (s,) = report.summarize(rows)
    assert s["apply_x_copy"] == 0.5
    assert s["apply_speedup_vs_compile"] == 1.5  # against the faster compiled function
    assert s["copy_speedup_vs_compile"] == 3.0


def _has_matplotlib():
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def test_targets_are_checked_against_the_issue():
    summary = [
        {"case": "large", "dtype": "float32", "apply_x_copy": 0.5, "apply_out_x_copy": 0.9,
         "apply__x_copy": 0.8,
         "apply_speedup_vs_compile": 3.0, "apply__speedup_vs_compile": 1.5},
    ]
    got = {d: ok for d, _, ok in report.check_targets(summary)}
    assert got == {
        "large float32: apply >= 0.85x copy bandwidth": False,
        "large float32: apply_out >= 0.85x copy bandwidth": True,
        "large float32: apply_ >= 0.85x copy bandwidth": False,
        "large float32: apply >= 2.0x faster than torch.compile": True,
        "large float32: apply_ >= 2.0x faster than torch.compile": False,
    }
    # A missed speed-up names what a plain copy achieves against the same compiled function.
    summary[0]["copy_speedup_vs_compile"] = 1.7
    descs = [d for d, _, _ in report.check_targets(summary)]
    assert "large float32: apply_ >= 2.0x faster than torch.compile (copy itself: 1.70x)" in descs


def test_plot_without_matplotlib_draws_nothing(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    assert plot.plot({"meta": {}, "results": []}, str(tmp_path / "x.png")) is False
    assert not (tmp_path / "x.png").exists()


def test_interleaved_timing_runs_blocks_round_robin():
    from rope_ext.bench import timing

    calls = []
    fns = {name: (lambda name=name: calls.append(name)) for name in ("a", "b")}
    times = timing.measure_interleaved(fns, repeat=3, min_block_s=0.0)
    assert set(times) == {"a", "b"} and all(len(t) == 3 for t in times.values())
    # After each one's warm-up and calibration: a, b, a, b, a, b.
    assert calls[-6:] == ["a", "b"] * 3
