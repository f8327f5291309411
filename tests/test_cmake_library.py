"""The CMake-built libraries (librope_ops.so, and librope_ops_cuda.so where built) from Python:
torch.ops.load_library of them alone gives working torch.ops.rope.*, and rope_ext imported
afterwards uses that library rather than loading its own copy. `make cmake-test` sets
ROPE_EXT_CMAKE_LIB (and ROPE_EXT_CMAKE_CUDA_LIB); elsewhere this is skipped.

The spellings of the -DROPE_EXT_CUDA option are checked wherever cmake is installed (a configure
only, under a second each)."""

import importlib.util
import os
import shutil
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
LIB = os.environ.get("ROPE_EXT_CMAKE_LIB")
CUDA_LIB = os.environ.get("ROPE_EXT_CMAKE_CUDA_LIB")


@pytest.mark.skipif(not LIB, reason="ROPE_EXT_CMAKE_LIB not set (run `make cmake-test`)")
def test_load_library_of_the_cmake_build():
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROPE_EXT_")}
    env["PYTHONPATH"] = ROOT
    result = subprocess.run(
        [sys.executable, os.path.join(HERE, "op_smoke.py"), "--preload", os.path.abspath(LIB),
         *(["--preload", os.path.abspath(CUDA_LIB)] if CUDA_LIB and os.path.exists(CUDA_LIB) else []),
         "--expect-loaded-by", "preloaded"],
        env=env, cwd=HERE, capture_output=True, text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"OK preloaded {os.path.abspath(LIB)}" in result.stdout


# ---- -DROPE_EXT_CUDA: CMake's boolean spellings in any case, AUTO, and nothing else ------------

def torch_dir():
    spec = importlib.util.find_spec("torch")
    return os.path.dirname(spec.origin) if spec and spec.origin else None


def configure(tmp_path, value):
    """(exit status, output with its line breaks undone) of configuring with -DROPE_EXT_CUDA=value.
    CUDACXX names no compiler, so no nvcc runs: a CUDA library is impossible here."""
    if not shutil.which("cmake"):
        pytest.skip("cmake not found")
    torch = torch_dir()
    if not torch or not os.path.exists(os.path.join(torch, "include", "torch", "csrc", "stable")):
        pytest.skip("no torch with the stable ABI headers")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROPE_EXT_")}
    env["CUDACXX"] = os.path.join(str(tmp_path), "no-such-nvcc")
    result = subprocess.run(
        ["cmake", "-S", ROOT, "-B", str(tmp_path / "build"), f"-DROPE_EXT_CUDA={value}",
         "-DROPE_EXT_BUILD_TESTS=OFF", f"-DCMAKE_PREFIX_PATH={torch}"],
        env=env, capture_output=True, text=True,
    )
    return result.returncode, " ".join((result.stdout + result.stderr).split())


@pytest.mark.parametrize("value", ["off", "OFF", "0", "False", "no"])
def test_cmake_cuda_option_off_spellings(tmp_path, value):
    code, out = configure(tmp_path, value)
    assert code == 0, out
    assert f"rope_ext: CUDA library OFF (ROPE_EXT_CUDA={value})" in out


@pytest.mark.parametrize("value", ["on", "ON", "1", "TRUE", "yes"])
def test_cmake_cuda_option_on_spellings_require_cuda(tmp_path, value):
    code, out = configure(tmp_path, value)
    assert code != 0 and f"ROPE_EXT_CUDA={value} but the CUDA kernels cannot be built" in out, out


@pytest.mark.parametrize("value", ["auto", "AUTO"])
def test_cmake_cuda_option_auto_goes_without(tmp_path, value):
    code, out = configure(tmp_path, value)
    assert code == 0, out
    assert "rope_ext: CUDA library OFF (" in out and f"(ROPE_EXT_CUDA={value})" not in out


@pytest.mark.parametrize("value", ["maybe", "2", ""])
def test_cmake_cuda_option_rejects_other_values(tmp_path, value):
    code, out = configure(tmp_path, value)
    assert code != 0 and f"ROPE_EXT_CUDA='{value}': expected AUTO, ON or OFF" in out, out
