"""JIT loading (rope_ext.jit, ROPE_EXT_JIT=1) and the one-copy-per-process rule. Each load runs in
a fresh process: this one already holds the compiled library."""

import os
import shutil
import subprocess
import sys

import pytest

import rope_ext
from rope_ext import _library, jit

HERE = os.path.dirname(os.path.abspath(__file__))
SMOKE = os.path.join(HERE, "op_smoke.py")
SOURCE_CHECKOUT = os.path.isfile(os.path.join(jit.SOURCE_ROOT, "csrc", "build.json"))
needs_sources = pytest.mark.skipif(
    not SOURCE_CHECKOUT, reason="rope_ext is an installed copy: JIT needs a source checkout"
)


def _env(env):
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("ROPE_EXT_")}
    full_env["PYTHONPATH"] = jit.SOURCE_ROOT
    full_env.update(env or {})
    return full_env


def run(args, env=None, cwd=None):
    return subprocess.run(
        [sys.executable, *args], env=_env(env), cwd=cwd or HERE, capture_output=True, text=True
    )


def jit_env(**extra):
    # Cached per checkout, so that parallel checkouts do not rebuild each other's copy.
    cache = os.path.join(jit.SOURCE_ROOT, "build", "torch_extensions")
    # Only the CPU variants this machine runs: the tests run no other (the compiled library's
    # build has compiled them all from the same files), and each costs a minute of compiling.
    return {"TORCH_EXTENSIONS_DIR": cache, "ROPE_EXT_CPU_VARIANTS": "native", **extra}


def test_second_copy_after_compiled_library_is_refused():
    state = _library.state
    if state.loaded_by != "compiled":
        pytest.skip(f"this process's library came from {state.loaded_by}, not rope_ext._C")
    before = state.path
    with pytest.raises(RuntimeError, match="second copy"):
        rope_ext.jit.load()
    assert state.path == before and state.loaded_by == "compiled"


@needs_sources
def test_preloaded_library_is_used_not_loaded_twice(tmp_path):
    # A copy at another path: were rope_ext to import its own _C as well, the ops would register
    # twice and the process would abort, so this fails loudly if the guard breaks.
    if _library.state.loaded_by != "compiled":
        pytest.skip("needs the compiled rope_ext._C to copy")
    lib = tmp_path / "librope_ops_copy.so"
    shutil.copy(_library.state.path, lib)
    result = run([SMOKE, "--preload", str(lib), "--expect-loaded-by", "preloaded"])
    assert result.returncode == 0, result.stdout + result.stderr
    # ROPE_EXT_JIT=1 would build and load a second copy: refused before any build.
    code = f"import torch; torch.ops.load_library({str(lib)!r}); import rope_ext"
    refused = run(["-c", code], env=jit_env(ROPE_EXT_JIT="1"))
    assert refused.returncode == 1, refused.stderr
    expected = f"ROPE_EXT_JIT=1 would load a second copy of the rope ops, but {lib}"
    assert expected in refused.stderr, refused.stderr
    # dlopen'ed directly (as a C++ host would): named as such, and jit.load's advice fits it.
    code = (f"import ctypes, os, torch; ctypes.CDLL({str(lib)!r}, mode=os.RTLD_NOW | os.RTLD_GLOBAL)\n"
            "import rope_ext\nprint(rope_ext._library.state.path)\n"
            "try:\n    rope_ext.jit.load()\nexcept RuntimeError as e:\n    print(e)\n")
    direct = run(["-c", code])
    assert direct.returncode == 0, direct.stderr
    assert "a library loaded before rope_ext (not through torch.ops.load_library)" in direct.stdout
    assert direct.stdout.rstrip().endswith("Start a new process without that library."), direct.stdout
    # ROPE_EXT_BACKEND=reference cannot take the ops back from the preloaded library: it says so.
    code = f"import torch; torch.ops.load_library({str(lib)!r}); import rope_ext; print(rope_ext.backend('cpu'))"
    warned = run(["-c", code], env={"ROPE_EXT_BACKEND": "reference"})
    assert warned.returncode == 0, warned.stderr
    assert warned.stdout.split()[-1] == "native"
    assert f"ROPE_EXT_BACKEND=reference is not honoured: {lib}, loaded before rope_ext" in warned.stderr


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


# The first JIT build of the checkout compiles the whole CPU library, the longest single step of
# the suite: conftest.py starts it (start_first_build) as soon as the tests are collected, on one
# core, so that it compiles while the other tests run; the test below waits for its result.
_first_build = None


def start_first_build():
    """Starts `op_smoke.py` with ROPE_EXT_JIT=1 (the build, then every op checked) in the
    background, once."""
    global _first_build
    if _first_build is None:
        env = jit_env(ROPE_EXT_JIT="1", MAX_JOBS="1")
        args = ["--expect-loaded-by", "jit", "--expect-library-under", env["TORCH_EXTENSIONS_DIR"]]
        _first_build = subprocess.Popen([sys.executable, SMOKE, *args], env=_env(env), cwd=HERE,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return _first_build


@needs_sources
def test_jit_build_serves_the_ops_and_is_cached():
    build = start_first_build()
    stdout, stderr = build.communicate(timeout=1800)
    first = subprocess.CompletedProcess(build.args, build.returncode, stdout, stderr)
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


def test_one_build_description_serves_every_way_in():
    """setup.py, the JIT loader and CMakeLists.txt read their sources, flags and CUDA archs from
    csrc/build.json, and nothing else states them."""
    import json

    root = jit.SOURCE_ROOT
    if not os.path.isfile(os.path.join(root, "setup.py")):
        pytest.skip("no source checkout beside an installed copy")
    with open(os.path.join(root, "csrc", "build.json")) as f:
        desc = json.load(f)
    config = jit._build_config()
    for name, lib in desc["libraries"].items():
        assert config.library(name) == (lib["module"], lib["python_init"], lib["sources"])
        for src in lib["sources"] + [lib["python_init"]]:
            assert os.path.isfile(os.path.join(root, src)), src
    assert config.cuda_arch_list() == ";".join(desc["cuda_archs"])
    for flag in desc["cxx_flags"] + [desc["torch_target_version"]]:
        assert any(flag in f for f in config.cxx_flags()), flag
    # Every C++/CUDA source under csrc/ is either listed or included (no stray, unbuilt file),
    # and no .cpp includes another .cpp.
    listed = {s for lib in desc["libraries"].values() for s in lib["sources"] + [lib["python_init"]]}
    # The JIT build names each object file after its source's base name (family folders reuse
    # file names: qk_norm/cpu/kernels.h, quant/cpu/kernels.h), so a library's sources must not.
    for lib in desc["libraries"].values():
        stems = [os.path.splitext(os.path.basename(s))[0] for s in lib["sources"] + [lib["python_init"]]]
        assert len(stems) == len(set(stems)), f"sources sharing a base name: {sorted(stems)}"
    for dirpath, _, files in os.walk(os.path.join(root, "csrc")):
        for f in files:
            rel = os.path.relpath(os.path.join(dirpath, f), root)
            if f.endswith((".cpp", ".cu")):
                assert rel in listed, f"{rel} is not in csrc/build.json"
            if f.endswith((".cpp", ".cu", ".h")):
                with open(os.path.join(dirpath, f)) as src:
                    assert '.cpp"' not in src.read(), f"{rel} includes a .cpp file"
    with open(os.path.join(root, "setup.py")) as f:
        text = f.read()
        assert "build_config" in text and "csrc/ops" not in text and "-O3" not in text
    with open(os.path.join(root, "CMakeLists.txt")) as f:
        text = f.read()
        assert "csrc/build.json" in text
        assert "csrc/ops" not in text and "-O3" not in text
    with open(os.path.join(root, "rope_ext", "jit.py")) as f:
        text = f.read()
        assert "csrc/ops" not in text and "-O3" not in text and "9.0" not in text


@needs_sources
def test_failed_jit_build_leaves_the_reference_serving(tmp_path):
    # `false` is a compiler that exists and always fails: the build breaks after the Python
    # definitions were dropped for the library's, so they must come back.
    code = (
        "import torch, rope_ext\n"
        "try:\n    rope_ext.jit.load()\n"
        "except RuntimeError as e:\n    print('build failed:', str(e).splitlines()[0])\n"
        "else:\n    raise SystemExit('the build with CXX=false succeeded')\n"
        "assert rope_ext.backend('cpu') == 'reference' and rope_ext._library.state.path is None\n"
        "x = torch.randn(2, 3, 8)\n"
        "t = rope_ext.cos_sin_cache(4, 8)[:2, None]\n"
        "torch.testing.assert_close(torch.ops.rope.apply(x, t[..., :4], t[..., 4:], False),\n"
        "                           rope_ext.reference.apply_rope(x, t[..., :4], t[..., 4:]))\n"
    )
    env = {"ROPE_EXT_BACKEND": "reference", "CXX": "false", "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    result = run(["-c", code], env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"build failed: rope_ext JIT build of {jit.SOURCE_ROOT}/csrc failed" in result.stdout, result.stdout


@needs_sources
def test_failed_cuda_build_after_the_cpu_library(tmp_path):
    """The CPU library loads, then the CUDA library's build fails (an nvcc that always fails):
    rope_ext's error names the CUDA build, the CPU library serves with ROPE_EXT_CPU_ISA
    applied, and a second jit.load() tries the CUDA build again instead of reporting success."""
    import torch

    if torch.version.cuda is None:
        pytest.skip("torch is a CPU-only build: no CUDA library to build")
    nvcc = tmp_path / "cuda" / "bin" / "nvcc"
    nvcc.parent.mkdir(parents=True)
    nvcc.write_text("#!/bin/sh\necho 'nvcc: this toolkit always fails' >&2\nexit 1\n")
    nvcc.chmod(0o755)
    code = (
        "import rope_ext\n"
        "from rope_ext import _library as L\n"
        "for attempt in (1, 2):\n"
        "    try:\n        rope_ext.jit.load()\n"
        "    except RuntimeError as e:\n        print('failed', attempt, str(e).splitlines()[0])\n"
        "    else:\n        raise SystemExit('the CUDA build succeeded')\n"
        "    assert L.state.loaded_by == 'jit' and L.state.cuda_path is None\n"
        "    assert rope_ext.backend('cpu') == 'native' and rope_ext.cpu_isa() == 'baseline'\n"
    )
    env = jit_env(ROPE_EXT_BACKEND="reference", ROPE_EXT_CUDA="1", ROPE_EXT_CPU_ISA="baseline",
                  CUDA_HOME=str(nvcc.parent.parent), TORCH_CUDA_ARCH_LIST="9.0")
    result = run(["-c", code], env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    want = f"rope_ext JIT build of {jit.SOURCE_ROOT}/csrc failed (the CUDA library; the CPU one is loaded"
    for attempt in (1, 2):
        assert f"failed {attempt} {want}" in result.stdout, result.stdout
