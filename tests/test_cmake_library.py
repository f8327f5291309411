"""The CMake-built libraries (librope_ops.so, and librope_ops_cuda.so where built) from Python:
torch.ops.load_library of them alone gives working torch.ops.rope.*, and rope_ext imported
afterwards uses that library rather than loading its own copy. `make cmake-test` sets
ROPE_EXT_CMAKE_LIB (and ROPE_EXT_CMAKE_CUDA_LIB); elsewhere this is skipped."""

import os
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
