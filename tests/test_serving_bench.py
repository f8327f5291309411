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


@pytest.mark.parametrize("fp8", [False, True])
def test_prologue_rows_write_what_the_fused_op_writes(fp8):
    # The unfused sequence and the eager peer are timed against the fused op: each must do the
    # same work (q, k normalized and rotated in place; every token's key and value cached).
    import torch

    import rope_ext
    sys.path.insert(0, os.path.dirname(BENCH))
    import serving_bench as sb

    t, hq, hk, d = 5, 4, 2, 64
    qkv = torch.randn(t, (hq + 2 * hk) * d, dtype=torch.bfloat16)
    table = rope_ext.cos_sin_cache(64, d)
    pos, slots = torch.randint(0, 64, (t,)), torch.randperm(8 * 4)[:t]
    wq, wk = torch.rand(d) + 0.5, torch.rand(d) + 0.5
    cdt = torch.float8_e4m3fn if fp8 else torch.bfloat16
    ks, vs = (torch.tensor([0.5]), torch.tensor([0.25])) if fp8 else (None, None)

    def state():
        buf = qkv.clone()
        q, k, v = buf.split([hq * d, hk * d, hk * d], 1)
        caches = [torch.full((8, 4, hk, d), 7.0).to(cdt) for _ in range(2)]
        return [q.unflatten(1, (hq, d)), k.unflatten(1, (hk, d)), v.unflatten(1, (hk, d))], caches

    (q, k, v), (kc, vc) = state()
    rope_ext.qk_norm_rope_and_cache_(q, k, v, pos, table, wq, wk, kc, vc, slots,
                                     kv_cache_dtype="fp8" if fp8 else "auto", k_scale=ks, v_scale=vs)
    (q1, k1, v1), (kc1, vc1) = state()
    rope_ext.qk_norm_rope_(q1, k1, wq, wk, pos, table)
    sb.store_paged(k1, v1, kc1, vc1, slots, ks, vs)
    (q2, k2, v2), (kc2, vc2) = state()
    sb.eager_prologue(q2, k2, v2, pos, table, wq, wk, kc2, vc2, slots, 1e-6, ks, vs)
    for got in ((q1, k1, kc1, vc1), (q2, k2, kc2, vc2)):
        for i, (a, b) in enumerate(zip(got, (q, k, kc, vc))):
            # bfloat16: rounding order apart; float8 e4m3: one code apart (2^-3 relative)
            rtol = 0.13 if fp8 and i >= 2 else 0.02
            torch.testing.assert_close(a.float(), b.float(), rtol=rtol, atol=0.02)
