"""The benchmark tool (bench/bench.py): one tiny end-to-end run and the structure of what it
writes, the bench's own PyTorch formulations against the float64 reference, and a clear refusal
of --device cuda without a GPU. No timing assertion: timings on a shared machine are not test
material, and speed is the benchmark's business, not the tests'."""

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, TOL, poison_like

if not os.path.isfile(os.path.join(ROOT, "bench", "bench.py")):
    # The copied test trees of `make torch213-test` and `make sanitize` carry no bench/.
    pytest.skip("no bench/ in this tree (not a source checkout)", allow_module_level=True)
sys.path.insert(0, os.path.join(ROOT, "bench"))

import rope_ext  # noqa: E402
from rope_ext import reference  # noqa: E402
from rope_bench import cases, dropins, report  # noqa: E402
from rope_bench.rows import OPS, limit_rows, op_rows  # noqa: E402

BENCH = os.path.join(ROOT, "bench", "bench.py")


def _run(*args, timeout=600):
    return subprocess.run([sys.executable, BENCH, *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


# One results file per CPU kernel variant: the stem names the variant that served.
VARIANT = f"-{rope_ext.cpu_isa()}" if rope_ext.backend("cpu") == "native" else ""
QUICK_STEM = f"cpu{VARIANT}-quick"


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    r = _run("--device", "cpu", "--quick", "--dtypes", "float32", "--out", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    stem = QUICK_STEM
    with open(out / f"{stem}.json") as f:
        doc = json.load(f)
    return doc, (out / f"{stem}.md").read_text(), r.stdout, out


def test_quick_run_times_every_row_of_every_op(quick):
    doc, _, _, _ = quick
    assert set(doc) == {"meta", "results", "summary", "peers", "errors", "skipped"}
    assert doc["errors"] == [], doc["errors"]
    names = {r["name"] for r in doc["results"]}
    expected = {"copy", "clone"}
    for op in OPS:
        expected |= {op, f"{op} eager", f"{op} compile"}
    expected.add("apply_rope_and_cache_ unfused")
    if dropins.load()[0] is not None:  # one pair per drop-in, each with the peer's eager path
        expected |= {f"compat.{n}{suffix}" for n in (
            "transformers.apply_rotary_pos_emb", "flash_attn.apply_rotary_emb",
            "vllm.rotary_embedding", "flashinfer.apply_rope_with_cos_sin_cache_inplace",
            "sglang.apply_rope_with_cos_sin_cache_inplace+kv") for suffix in ("", " eager")}
    assert expected <= names, expected - names
    for r in doc["results"]:
        assert len(r["times_s"]) == doc["meta"]["repeat"]
        assert r["min_s"] <= r["p25_s"] <= r["median_s"] <= r["p75_s"] <= r["max_s"]
        assert r["gbps"] == pytest.approx(r["bytes"] / r["median_s"] / 1e9, rel=1e-9)
        assert r["case"] == "tiny" and r["dtype"] == "float32"


def test_quick_run_summary_holds_each_op_against_its_limit(quick):
    doc, _, _, _ = quick
    by_op = {s["op"]: s for s in doc["summary"] if s["kind"] == "rope_ext"}
    assert set(by_op) == set(OPS)
    medians = {r["name"]: r["median_s"] for r in doc["results"]}
    gbps = {r["name"]: r["gbps"] for r in doc["results"]}
    for op, s in by_op.items():
        assert s["limit"] == OPS[op].limit
        assert s["of_limit"] == pytest.approx(gbps[op] / gbps[OPS[op].limit], rel=1e-9)
        for other in (f"{op} eager", f"{op} compile"):
            assert s["others"][other]["speedup"] == pytest.approx(medians[other] / medians[op],
                                                                  rel=1e-9)


def test_quick_run_prints_and_writes_the_tables(quick):
    doc, md, stdout, out = quick
    assert md in stdout  # the printed table is the Markdown file
    assert "| tiny | 4x4x32 (k: 2 heads) | float32 |" in md
    for op in OPS:
        assert f"| {op} | tiny | float32 |" in md
    assert "drop-ins:" in md  # present or skipped, always said
    assert doc["meta"]["allocator"].startswith(("glibc, mmap threshold pinned", "not pinned"))
    assert doc["meta"]["thp"]["enabled"] is None or "[" in doc["meta"]["thp"]["enabled"]
    try:
        import matplotlib  # noqa: F401
        has_mpl = True
    except ImportError:
        has_mpl = False
    assert os.path.exists(out / f"{QUICK_STEM}.png") == has_mpl


def test_summary_ratios_follow_the_medians():
    shape = {"tokens": 1, "q_heads": 1, "kv_heads": 1, "head_dim": 2}
    rows = [{"case": "c", "dtype": "float32", "shape": shape, "name": n, "kind": k, "op": op,
             "limit": lim, "median_s": t, "gbps": 100 / t / 1e9}
            for n, k, op, lim, t in (("copy", "limit", "", "", 1.0), ("clone", "limit", "", "", 2.0),
                                     ("apply", "rope_ext", "apply", "clone", 4.0),
                                     ("apply eager", "eager", "apply", "clone", 12.0))]
    (s,) = report.summarize(rows)
    assert s["limit"] == "clone" and s["of_limit"] == 0.5
    assert s["others"]["apply eager"]["speedup"] == 3.0


def _state(inputs, result):
    """Everything a row may write: its result(s), and the tensors updated in place."""
    got = {name: getattr(inputs, name) for name in ("q", "k", "out", "key_cache", "value_cache")}
    written = {t.untyped_storage().data_ptr() for t in got.values()}
    results = result if isinstance(result, (tuple, list)) else (result,)
    for n, r in enumerate(results):
        # A returned tensor that is one of the in-place ones (as apply_rope_ returns (q, k)) is
        # already compared as that tensor.
        if isinstance(r, torch.Tensor) and r.untyped_storage().data_ptr() not in written:
            got[f"result{n}"] = r
    return got


def _assert_same_state(got, expected, what):
    assert set(got) == set(expected), what
    rtol, atol = TOL[torch.float32]
    for name, t in got.items():
        torch.testing.assert_close(t.double(), expected[name].double(), rtol=rtol, atol=atol,
                                   equal_nan=name == "out",
                                   msg=lambda m: f"{what} {name}: {m}")


# Each op of the bench's table by rope_ext's reference (its data checks included): the float64
# state every row must leave.
REFERENCE = {
    "apply": lambda i: reference.apply_rope(i.q, i.cos, i.sin),
    "apply.out": lambda i: reference.apply_rope_out(i.q, i.cos, i.sin, out=i.out),
    "apply_backward": lambda i: reference.apply_rope_backward(i.grad, i.cos, i.sin),
    "apply_rope_at": lambda i: reference.apply_positions(i.q, i.positions, i.cos_t, i.sin_t),
    "apply_": lambda i: reference.apply_rope_(i.q, i.k, i.positions, i.cache),
    "apply_mrope_": lambda i: reference.apply_mrope_(i.q, i.k, i.positions3, i.cache, i.section),
    "apply_rope_and_cache_": lambda i: reference.apply_and_cache_(
        i.q, i.k, i.v, i.positions, i.cache, i.key_cache, i.value_cache, i.slots),
}


def test_every_op_of_the_table_has_a_reference():
    assert set(REFERENCE) == set(OPS)


@pytest.mark.parametrize("op", list(OPS))
def test_every_row_computes_what_the_float64_reference_does(op):
    """The rows of a comparison must do the same work, or their ratios mean nothing: rope_ext's
    call, the bench's equivalents (the functions of the eager rows, which the compile rows
    compile) and the unfused path, on fresh random float32 inputs, against the reference in float64."""
    shape = cases.Shape(5, 4, 2, 32)
    seed = int(torch.randint(0, 2**31, ()))

    def fresh(dtype):
        i = cases.Inputs(shape, dtype, "cpu", seed=seed)
        i.out.copy_(poison_like(i.out))  # apply.out must write every element
        return i

    ref = fresh(torch.float64)
    expected = _state(ref, REFERENCE[op](ref))
    o = OPS[op]
    fn, args = o.math
    for label, run in (("rope_ext", lambda i: o.rope_ext(i)()),
                       ("equivalent", lambda i: fn(*args(i))),
                       ("unfused", (lambda i: o.unfused(i)()) if o.unfused else None)):
        if run is None:
            continue
        i = fresh(torch.float32)
        got = _state(i, run(i))
        if op == "apply.out":
            assert not got["out"].isnan().any(), f"{label} left elements of out unwritten"
        _assert_same_state(got, expected, f"{op} {label}")


def test_each_drop_in_row_does_what_its_peer_row_does():
    """A drop-in and its peer's eager path get the same inputs in the peer's layout: on fresh
    random float32 inputs they must leave the same results and the same tensors behind."""
    loaded, status = dropins.load()
    if loaded is None:
        pytest.skip(status)
    shape = cases.Shape(6, 4, 2, 32)
    seed = int(torch.randint(0, 2**31, ()))
    for make in dropins.PAIRS:
        states = []
        for side in (3, 5):  # ours, theirs
            i = cases.Inputs(shape, torch.float32, "cpu", seed=seed)
            i.out.copy_(poison_like(i.out))  # no drop-in writes it: NaN on both sides
            states.append(_state(i, make(i, *loaded)[side]()))
        _assert_same_state(states[0], states[1], make.__name__)


def test_each_training_step_computes_what_its_peer_step_does():
    """The training pairs (a drop-in, its peer's code as tests/training_peers.py implements it,
    rope_ext's op with its tables ready) run the same forward on the same tensors, and give the
    same input gradients."""
    loaded, status = dropins.load_training()
    if loaded is None:
        pytest.skip(status)
    size = (2, 8, 4, 2, 32)
    for make in dropins.TRAINING_PAIRS:
        seed = int(torch.seed() % 2**31)
        steps = make(size, torch.float32, *loaded, torch.Generator().manual_seed(seed))[2:]
        results = []
        for step in steps:
            outs = step.forward()
            grads = torch.autograd.grad(outs, step.leaves, step.grads)
            results.append([o.detach() for o in outs] + list(grads))
            step()  # the timed call runs, and leaves no gradient behind
            assert all(t.grad is None for t in step.leaves)
        for other in results[1:]:
            for got, want in zip(results[0], other):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=make.__name__)


def test_limit_rows_copy_the_query():
    i = cases.Inputs(cases.Shape(3, 2, 1, 8), torch.float32, "cpu", seed=1)
    copy, clone = limit_rows(i)
    i.out.copy_(poison_like(i.out))
    copy.fn()
    assert torch.equal(i.out, i.q) and torch.equal(clone.fn(), i.q)
    assert copy.nbytes == clone.nbytes == 2 * i.q.numel() * 4


def test_rows_of_one_comparison_count_the_same_bytes():
    i = cases.Inputs(cases.Shape(3, 4, 2, 8), torch.bfloat16, "cpu", seed=2)
    rows = op_rows(i, list(OPS), ["rope_ext", "unfused", "eager"])
    for op in OPS:
        assert len({r.nbytes for r in rows if r.op == op}) == 1, op


def test_mrope_section_splits_the_pairs():
    assert cases.mrope_section(128) == [16, 24, 24]  # Qwen2-VL's
    for d in (8, 32, 64, 256):
        assert sum(cases.mrope_section(d)) == d // 2 and min(cases.mrope_section(d)) > 0


def test_a_spent_time_budget_skips_cases_and_says_so(tmp_path):
    r = _run("--cases", "decode,cache", "--dtypes", "float32", "--time-budget", "0",
             "--out", str(tmp_path), "--stem", "b", timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads((tmp_path / "b.json").read_text())
    assert doc["results"] == [] and doc["summary"] == []
    assert doc["skipped"] == ["decode float32: time budget (0 s) spent",
                              "cache float32: time budget (0 s) spent"]
    assert "- skipped: cache float32: time budget (0 s) spent" in (tmp_path / "b.md").read_text()


def test_unknown_arguments_are_refused_by_name():
    r = _run("--ops", "apply,nope", timeout=120)
    assert r.returncode == 2 and "--ops: unknown ['nope']" in r.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible")
def test_device_cuda_without_a_gpu_fails_clearly():
    r = _run("--device", "cuda", timeout=120)
    assert r.returncode == 2
    assert "--device cuda, but torch sees no CUDA device" in r.stderr


def test_case_groups_are_modules_with_the_group_interface():
    from rope_bench import groups

    found = groups.discover()
    assert {"calls", "dropins", "layouts", "models", "training"} <= set(found)
    for name, mod in found.items():
        assert mod.NAME == name and mod.ABOUT and callable(mod.run) and callable(mod.table)


def test_quick_run_of_the_case_groups_writes_their_tables(tmp_path):
    run = _run("--quick", "--cases", "calls,dropins,layouts,models,training", "--dtypes",
               "float32", "--threads", "1", "--clock", "thread", "--out", str(tmp_path))
    assert run.returncode == 0, run.stdout + run.stderr
    stem = f"cpu{VARIANT}-calls-dropins-layouts-models-training-quick"
    doc = json.loads((tmp_path / f"{stem}.json").read_text())
    md = (tmp_path / f"{stem}.md").read_text()
    assert doc["results"] == [] and doc["errors"] == [], doc["errors"]
    assert doc["meta"]["timing"].startswith("time.thread_time")
    assert list(doc["groups"]) == ["calls", "dropins", "layouts", "models", "training"]
    layouts = doc["groups"]["layouts"]["rows"]
    assert {r["call"] for r in layouts} >= {"floor: x.clone()", "(B, S, H, D)",
                                            "(B, H, S, D) transposed view",
                                            "(B, H, S, D) contiguous"}
    for r in layouts:
        assert r["x_floor"] == pytest.approx(r["median_s"] / r["floor_s"], rel=1e-9)
    calls = doc["groups"]["calls"]["rows"]
    assert {r["mode"] for r in calls} == {"inference_mode", "no_grad", "grad_mode"}
    names = {r["call"] for r in calls}
    assert {"floor: q.mul_(c); k.mul_(c)", "floor: q.clone(); k.clone()", "torch.ops.rope.apply_",
            "rope_ext.apply_rope_", "rope_ext.qk_norm_rope_", "rope_ext.apply_rope (q, k)",
            "rope_ext.apply_rope_at (q, k)", "torch.ops.rope.apply_positions (q, k)"} <= names
    floors = {(r["mode"], r["call"]): r["median_s"] for r in calls if r["call"].startswith("floor")}
    for r in calls:  # the functions that return new tensors against clone, the rest against mul_
        assert r["floor"] == ("floor: q.clone(); k.clone()" if "(q, k)" in r["call"] or "clone" in
                              r["call"] else "floor: q.mul_(c); k.mul_(c)")
        assert r["floor_s"] == floors[(r["mode"], r["floor"])]
        assert r["x_floor"] == pytest.approx(r["median_s"] / r["floor_s"], rel=1e-9)
    for r in doc["groups"]["dropins"]["rows"]:
        assert r["x_peer"] == pytest.approx(r["peer_median_s"] / r["median_s"], rel=1e-9)
    training = doc["groups"]["training"]["rows"]
    assert {r["call"] for r in training} >= {"floor: clone q, k and their output gradients",
                                             "rope_ext.qk_norm.qk_norm_rope"}
    for r in training:
        assert r["x_ours"] > 0
    models = doc["groups"]["models"]
    if models["rows"]:  # transformers importable
        assert {r["what"] for r in models["rows"]} == {"generate", "prefill"}
        assert all(r.get("same_tokens", True) for r in models["rows"])
    for name, g in doc["groups"].items():
        assert g["table"] in md and g["table"] in run.stdout


def test_thread_clock_needs_one_thread():
    r = _run("--clock", "thread", "--threads", "2", "--cases", "calls", timeout=120)
    assert r.returncode == 2 and "--clock thread times the calling thread only" in r.stderr


def test_cpu_isa_option_chooses_the_variant_and_names_the_files(capsys):
    from rope_bench import cli

    if rope_ext.backend("cpu") != "native":
        pytest.skip("no native CPU library")
    serving = rope_ext.cpu_isa()
    try:
        _, args = cli.parse(["--device", "cpu", "--quick", "--cpu-isa", "baseline"])
        assert rope_ext.cpu_isa() == "baseline" and args.stem == "cpu-baseline-quick"
        assert cli.meta_for(args)["cpu_isa"] == "baseline"
        with pytest.raises(SystemExit):
            cli.parse(["--device", "cpu", "--cpu-isa", "sse9"])
        assert "--cpu-isa: this CPU runs baseline" in capsys.readouterr().err
    finally:
        rope_ext.set_cpu_isa(serving)
    _, args = cli.parse(["--device", "cpu"])
    assert args.stem == f"cpu-{serving}"


def test_compare_puts_result_sets_side_by_side(quick):
    from rope_bench import compare

    doc, _, _, _ = quick
    other = json.loads(json.dumps(doc))
    other["meta"]["cpu_isa"] = "other"
    for s in other["summary"]:
        s["median_s"] *= 2
    table = compare.markdown([doc, other], ops=("apply",))
    lines = table.splitlines()
    assert "other (" in lines[0]
    apply_rows = [s for s in doc["summary"] if s["op"] == "apply"]
    assert len(lines) == 2 + len(apply_rows)
    first = apply_rows[0]
    assert f"{first['median_s'] * 1e6:.1f} / " in lines[2]
    assert f"{first['median_s'] * 2e6:.1f} / " in lines[2]
