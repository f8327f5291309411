"""The pure-PyTorch reference serves when the native library is disabled or missing."""

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

import rope_ext

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests")

# Runs in a fresh interpreter: checks which path serves, then the ops against the oracle.
CHECK = textwrap.dedent("""
    import warnings, sys
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import rope_ext
        import rope_ext  # a second import must not warn again
    import torch
    from rope_oracle import rope
    print("WARNINGS", len([w for w in caught if "rope_ext" in str(w.message)]))
    print("BACKEND", rope_ext.backend("cpu"))
    best = int(torch.ops.rope.cpu_isa(True))  # the op's query form answers on either path
    assert (best >= 0) == (rope_ext.backend("cpu") == "native"), best
    x = torch.randn(3, 5, 2, 32, dtype=torch.float64, requires_grad=True)
    cos, sin = torch.randn(1, 5, 1, 12, dtype=torch.float64), torch.randn(1, 5, 1, 12, dtype=torch.float64)
    y = torch.ops.rope.apply(x, cos, sin, True)
    torch.testing.assert_close(y, rope(x, cos, sin, True))
    (g,) = torch.autograd.grad(y, x, torch.ones_like(y))
    torch.testing.assert_close(g, rope(torch.ones_like(y), cos, sin, True, inverse=True))
    q, k = torch.randn(5, 4, 32), torch.randn(5, 1, 32)
    q0 = q.clone()
    pos = torch.tensor([0, 9, 3, 2, 1])
    cache = rope_ext.cos_sin_cache(10, 32)
    torch.ops.rope.apply_(q, k, pos, cache, False)
    rows = cache.double()[pos].unsqueeze(1)
    torch.testing.assert_close(q.double(), rope(q0, rows[..., :16], rows[..., 16:], False), rtol=1e-6, atol=1e-6)
    try:
        torch.ops.rope.apply_(q, k, pos + 1, cache, False)
    except RuntimeError as e:
        assert "positions must lie in [0, 10)" in str(e), e
    else:
        raise AssertionError("out-of-range position accepted")
    torch.library.opcheck(torch.ops.rope.apply.default, (x.detach(), cos, sin, False))
    # In place under autograd and the version counter, on either path: one version per call,
    # as torch's own in-place ops leave it.
    for grad_mode in (True, False):
        with torch.set_grad_enabled(grad_mode):
            v, vk = q._version, k._version
            torch.ops.rope.apply_(q, k, pos, cache, False)
            assert (q._version - v, k._version - vk) == (1, 1), (q._version - v, k._version - vk)
    leaf = torch.randn(5, 4, 32, requires_grad=True)
    try:
        rope_ext.apply_rope_(leaf, None, pos, cache)
    except RuntimeError as e:
        assert "a leaf Variable that requires grad" in str(e), e
    else:
        raise AssertionError("in-place update of a leaf that requires grad accepted")
    # Autocast leaves the ops alone on either path: x's dtype in and out, even where autocast's
    # dtype is the other 16-bit one (whose mix torch's own promotion refuses).
    for x_dtype, amp_dtype in ((torch.float16, torch.bfloat16), (torch.bfloat16, torch.float16)):
        xh = torch.randn(5, 4, 32, dtype=x_dtype)
        with torch.autocast("cpu", dtype=amp_dtype):
            y = rope_ext.apply_rope(xh, rows[..., :16].float(), rows[..., 16:].float())
            qh = rope_ext.apply_rope_(xh.clone(), None, pos, cache)[0]
        assert y.dtype == qh.dtype == x_dtype, (y.dtype, qh.dtype)
        expected = rope(xh, rows[..., :16], rows[..., 16:], False)
        torch.testing.assert_close(y.double(), expected, rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(qh.double(), expected, rtol=1e-2, atol=1e-2)
    print("OK")
""")


def _run(env_extra, cwd, pythonpath):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([pythonpath, TESTS]), **env_extra)
    res = subprocess.run([sys.executable, "-c", CHECK], cwd=cwd, env=env, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout


@pytest.mark.skipif(rope_ext.backend("cpu") != "native", reason="the native library is not built")
def test_native_serves_cpu_by_default(tmp_path):
    out = _run({"ROPE_EXT_BACKEND": "auto"}, tmp_path, ROOT)
    assert "BACKEND native" in out and "WARNINGS 0" in out and "OK" in out


def test_backend_env_reference_disables_native(tmp_path):
    out = _run({"ROPE_EXT_BACKEND": "reference"}, tmp_path, ROOT)
    assert "BACKEND reference" in out and "WARNINGS 0" in out and "OK" in out


def test_missing_native_library_falls_back_with_one_warning(tmp_path):
    # A copy of the package without any compiled library, imported from outside the tree.
    pkg = tmp_path / "site" / "rope_ext"
    shutil.copytree(os.path.join(ROOT, "rope_ext"), pkg,
                    ignore=shutil.ignore_patterns("*.so", "*.pyd", "__pycache__"))
    out = _run({"ROPE_EXT_BACKEND": "auto"}, tmp_path, str(tmp_path / "site"))
    assert "BACKEND reference" in out and "WARNINGS 1" in out and "OK" in out


def test_a_library_built_from_other_sources_is_refused(monkeypatch):
    """The loaded library's ops are checked against schemas.def at import: one built from other
    sources (a checkout pulled without rebuilding) is an ImportError that says to rebuild, not
    an AttributeError or a call with the wrong arguments later."""
    from rope_ext import _library

    if _library.state.path is None:
        pytest.skip("no native library loaded")
    _library.check_schemas()  # this build's library: its ops are the package's
    schemas = dict(_library.SCHEMAS)
    schemas["apply"] = schemas["apply"].replace("bool interleaved=False)", "bool interleaved=False, int extra=0)")
    schemas["apply_new"] = "apply_new(Tensor x) -> Tensor"
    for changed in ("apply", "apply_new"):
        monkeypatch.setattr(_library, "SCHEMAS", {changed: schemas[changed]})
        with pytest.raises(ImportError, match=f"rope_ext: the native library .* was built from other "
                                              f"sources than this package: rope::{changed} is "
                                              f"{'rope::apply.Tensor x' if changed == 'apply' else 'missing'}"):
            _library.check_schemas()
