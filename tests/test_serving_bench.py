"""bench/serving_bench.py: one tiny run and the structure of what it writes (no timing
assertion: speed is the benchmark's business, not the tests')."""

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT

BENCH = os.path.join(ROOT, "bench", "serving_bench.py")
if not os.path.isfile(BENCH):
    pytest.skip("no bench/ in this tree (not a source checkout)", allow_module_level=True)


def test_quick_run(tmp_path):
    r = subprocess.run([sys.executable, BENCH, "--device", "cpu", "--quick", "--out", str(tmp_path)],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    with open(tmp_path / "serving-cpu-quick.json") as f:
        doc = json.load(f)
    assert doc["errors"] == []
    cases = {}
    for row in doc["results"]:
        cases.setdefault(row["case"], set()).add(row["row"])
        assert len(row["times_s"]) == doc["meta"]["repeat"]
        assert row["gbps"] == pytest.approx(row["bytes"] / row["median_s"] / 1e9, rel=1e-9)
    prologue = {"unfused rope_ext", "rope_ext out of place", "compat.vllm.fused_qknorm_rope_cache",
                "torch.compile"}
    assert all(rows == {"rope_ext", "eager", "copy"} | (prologue if c.startswith("qk_norm") else set())
               for c, rows in cases.items()), cases
    assert any(c.startswith("qk_norm_rope_and_cache_") for c in cases)
    assert any(c.startswith("shift_kv_cache_ fp8") for c in cases)
    assert any(c.startswith("apply_ rope_dim_offset") for c in cases)
    assert (tmp_path / "serving-cpu-quick.md").read_text().startswith("# Serving ops")


def test_cuda_refused_without_gpu():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    r = subprocess.run([sys.executable, BENCH, "--device", "cuda"], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 2 and "needs a GPU" in r.stdout
