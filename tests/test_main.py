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
