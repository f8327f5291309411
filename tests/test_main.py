"""`python -m rope_ext` (make run): its check of the ops against the float64 reference passes
the kernels as built and fails a broken one, whatever the breakage: a NaN element (which
max() alone would drop), the key rotated twice, the cache write skipped, the MRoPE components
swapped, the K-shift skipped."""

import pytest
import torch

import rope_ext
from rope_ext import __main__ as main


def test_the_ops_as_built_pass():
    assert main.check_kernels(["cpu"]) == 0


def _nan_element(orig):
    def broken(*args, **kwargs):
        out = orig(*args, **kwargs)
        out.view(-1)[3] = float("nan")
        return out
    return broken


def _key_twice(orig):
    def broken(query, key, *args, **kwargs):
        orig(query, key, *args, **kwargs)
        orig(key, None, *args, **kwargs)
        return query, key
    return broken


BREAKAGES = {
    "apply_rope_at": _nan_element,
    "apply_rope_": _key_twice,
    "apply_rope_and_cache_": lambda orig: (
        lambda q, k, v, pos, cache, kc, vc, slots, **kw: rope_ext.apply_rope_(q, k, pos, cache, **kw)),
    "apply_mrope_": lambda orig: lambda q, k, pos, *a, **kw: orig(q, k, pos.flip(0), *a, **kw),
    "shift_kv_cache_": lambda orig: lambda *a, **kw: None,
}


@pytest.mark.parametrize("name", list(BREAKAGES))
def test_a_broken_op_fails(name, monkeypatch, capsys):
    monkeypatch.setattr(rope_ext, name, BREAKAGES[name](getattr(rope_ext, name)))
    torch.manual_seed(0)
    assert main.check_kernels(["cpu"]) > 0
    assert "FAIL" in capsys.readouterr().out


def test_a_torch_compile_without_its_toolchain_is_a_row_not_a_failed_run(monkeypatch, capsys):
    # On a machine without a C++ compiler torch.compile raises at its first call: the timing
    # table says so in its row, and the run goes on (it once ended there, exit status 1).
    def no_toolchain(fn, **kwargs):
        def compiled(*args):
            raise RuntimeError("no working C++ compiler found")
        return compiled
    monkeypatch.setattr(torch, "compile", no_toolchain)
    main.time_kernels("cpu", shape=(8, 2, 16))
    out = capsys.readouterr().out
    assert out.count("torch.compile unavailable here: RuntimeError") == 2
    assert out.count("rope_ext apply_ (in place)") == 2
