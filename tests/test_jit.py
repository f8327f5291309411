"""JIT loading (rope_ext.jit, ROPE_EXT_JIT=1) and the one-copy-per-process rule. Each load runs in
a fresh process: this one already holds the compiled library."""

import os
import shutil
import subprocess
import sys

import pytest

import rope_ext
from rope_ext import _native, jit

HERE = os.path.dirname(os.path.abspath(__file__))
SMOKE = os.path.join(HERE, "op_smoke.py")
SOURCE_CHECKOUT = os.path.isdir(os.path.join(jit.CSRC, "ops"))
needs_sources = pytest.mark.skipif(
    not SOURCE_CHECKOUT, reason="rope_ext is an installed copy: JIT needs a source checkout"
)


def run(args, env=None, cwd=None):
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("ROPE_EXT_")}
    full_env["PYTHONPATH"] = jit.SOURCE_ROOT
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, *args], env=full_env, cwd=cwd or HERE, capture_output=True, text=True
    )


def jit_env(**extra):
    # Cached per checkout, so that parallel checkouts do not rebuild each other's copy.
    cache = os.path.join(jit.SOURCE_ROOT, "build", "torch_extensions")
    return {"TORCH_EXTENSIONS_DIR": cache, **extra}


def test_second_copy_after_compiled_library_is_refused():
    if _native.loaded_by != "compiled":
        pytest.skip(f"this process's library came from {_native.loaded_by}, not rope_ext._C")
    before = _native.loaded_from
    with pytest.raises(RuntimeError, match="second copy"):
        rope_ext.jit.load()
    assert _native.loaded_from == before and _native.loaded_by == "compiled"


@needs_sources
def test_preloaded_library_is_used_not_loaded_twice(tmp_path):
    # A copy at another path: were rope_ext to import its own _C as well, the ops would register
    # twice and the process would abort, so this fails loudly if the guard breaks.
    if _native.loaded_by != "compiled":
        pytest.skip("needs the compiled rope_ext._C to copy")
    lib = tmp_path / "librope_ops_copy.so"
    shutil.copy(_native.loaded_from, lib)
    result = run([SMOKE, "--preload", str(lib), "--expect-loaded-by", "preloaded"])
    assert result.returncode == 0, result.stdout + result.stderr
    # ROPE_EXT_JIT=1 would build and load a second copy: refused before any build.
    code = f"import torch; torch.ops.load_library({str(lib)!r}); import rope_ext"
    refused = run(["-c", code], env=jit_env(ROPE_EXT_JIT="1"))
    assert refused.returncode == 1, refused.stderr
    expected = f"ROPE_EXT_JIT=1 would load a second copy of the rope ops, but {lib}"
    assert expected in refused.stderr, refused.stderr


@needs_sources
def test_missing_ninja_is_a_clear_error(tmp_path):
    result = run(["-c", "import rope_ext"], env=jit_env(ROPE_EXT_JIT="1", PATH=str(tmp_path)))
    assert result.returncode == 1
    assert "RuntimeError: rope_ext JIT build needs ninja" in result.stderr, result.stderr


@needs_sources
def test_missing_compiler_is_a_clear_error(tmp_path):
    if shutil.which("ninja") is None:
        pytest.skip("ninja is missing too, which is reported first")
    env = jit_env(ROPE_EXT_JIT="1", CXX=str(tmp_path / "no-c++"))
    result = run(["-c", "import rope_ext"], env=env)
    assert result.returncode == 1
    assert "RuntimeError: rope_ext JIT build needs a C++17 compiler" in result.stderr, result.stderr


@needs_sources
def test_jit_build_serves_the_ops_and_is_cached():
    env = jit_env(ROPE_EXT_JIT="1")
    args = ["--expect-loaded-by", "jit", "--expect-library-under", env["TORCH_EXTENSIONS_DIR"]]
    first = run([SMOKE, *args], env=env)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "rope_ext._C" not in first.stdout
    # Nothing changed: ninja has nothing to rebuild.
    again = run(["-c", "import rope_ext"], env=jit_env(ROPE_EXT_JIT="verbose"))
    assert again.returncode == 0, again.stderr
    assert "ninja: no work to do" in again.stdout + again.stderr, again.stdout + again.stderr


@needs_sources
def test_jit_load_from_code_replaces_the_python_definitions():
    # With ROPE_EXT_BACKEND=reference the ops are defined from Python; jit.load() swaps in the
    # library's definitions and the Python-side registrations (autograd, fake) keep working.
    code = (
        "import torch, rope_ext\n"
        "assert rope_ext.backend('cpu') == 'reference'\n"
        "path = rope_ext.jit.load(verbose=False)\n"
        "assert rope_ext.jit.load() == path and rope_ext.backend('cpu') == 'native'\n"
        "x = torch.randn(3, 2, 8, dtype=torch.float64, requires_grad=True)\n"
        "t = rope_ext.cos_sin_cache(5, 8, dtype=torch.float64)[:3, None]\n"
        "cos, sin = t[..., :4], t[..., 4:]\n"
        "assert torch.autograd.gradcheck(lambda x: torch.ops.rope.apply(x, cos, sin, True), (x,))\n"
        "r = torch.library.opcheck(torch.ops.rope.apply.default, (x, cos, sin, False))\n"
        "assert all(v == 'SUCCESS' for v in r.values()), r\n"
        "print('served by', path)\n"
    )
    result = run(["-c", code], env=jit_env(ROPE_EXT_BACKEND="reference"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "rope_ext_jit" in result.stdout


def test_every_build_uses_the_shared_flags():
    from rope_ext import _build_flags

    assert jit.CFLAGS == _build_flags.CXX_FLAGS and jit.CUDA_CFLAGS == _build_flags.NVCC_FLAGS
    setup_py = os.path.join(jit.SOURCE_ROOT, "setup.py")
    cmake = os.path.join(jit.SOURCE_ROOT, "CMakeLists.txt")
    if not os.path.exists(setup_py):
        pytest.skip("no setup.py beside an installed copy")
    with open(setup_py) as f:
        assert "_build_flags.py" in f.read()
    with open(cmake) as f:  # CMake cannot read Python: it repeats the values
        text = f.read()
    assert f"set(ROPE_EXT_TORCH_TARGET_VERSION {_build_flags.TORCH_TARGET_VERSION})" in text
    assert "-ffp-contract=off" in text and "--fmad=false" in text


@needs_sources
def test_failed_jit_build_leaves_the_reference_serving(tmp_path):
    # `false` is a compiler that exists and always fails: the build breaks after the Python
    # definitions were dropped for the library's, so they must come back.
    code = (
        "import torch, rope_ext\n"
        "try:\n    rope_ext.jit.load()\n"
        "except RuntimeError as e:\n    print('build failed:', str(e).splitlines()[0])\n"
        "else:\n    raise SystemExit('the build with CXX=false succeeded')\n"
        "assert rope_ext.backend('cpu') == 'reference' and rope_ext._native.loaded_from is None\n"
        "x = torch.randn(2, 3, 8)\n"
        "t = rope_ext.cos_sin_cache(4, 8)[:2, None]\n"
        "torch.testing.assert_close(torch.ops.rope.apply(x, t[..., :4], t[..., 4:], False),\n"
        "                           rope_ext.reference.apply_rope(x, t[..., :4], t[..., 4:]))\n"
    )
    env = {"ROPE_EXT_BACKEND": "reference", "CXX": "false", "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    result = run(["-c", code], env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"build failed: rope_ext JIT build of {jit.CSRC} failed" in result.stdout, result.stdout
