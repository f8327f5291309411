"""bench/diffusers_bench.py runs (a smoke run of two families): its rows check rope_ext against
diffusers before timing, and it writes the table and the JSON. Needs diffusers; no timing is
asserted."""

import json
import os
import sys

import pytest

pytest.importorskip("diffusers")

from conftest import ROOT  # noqa: E402

sys.path.insert(0, os.path.join(ROOT, "bench"))

from rope_bench import diffusers_rows  # noqa: E402


def test_quick_run_writes_rows(tmp_path):
    rc = diffusers_rows.main(["--quick", "--families", "flux,wan,flux_prologue", "--dtypes", "float32",
                              "--repeat", "1", "--min-block-ms", "1", "--out", str(tmp_path)])
    assert rc == 0
    doc = json.loads((tmp_path / "diffusers-cpu.json").read_text())
    assert [r["family"] for r in doc["rows"]] == ["flux", "wan", "flux_prologue"]
    for r in doc["rows"]:
        assert not r["errors"]
        assert set(r["median_s"]) == {"rope_ext", "diffusers eager", "diffusers compiled",
                                      "rope_ext compiled", "copy floor"}
        assert r["x vs diffusers eager"] > 0 and r["x vs diffusers compiled"] > 0
        assert r["compiled x vs diffusers compiled"] > 0
    table = (tmp_path / "diffusers-cpu.md").read_text()
    assert "FLUX.1" in table and "Wan" in table and "norm+RoPE" in table


def test_unknown_family_is_an_error():
    with pytest.raises(SystemExit):
        diffusers_rows.main(["--families", "sd3"])
