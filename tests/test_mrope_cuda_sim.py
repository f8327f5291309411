"""The rope.mrope_ CUDA kernel without a GPU.

1. Its per-thread code (csrc/ops/cuda/mrope_cuda_thread.h) is plain C++: tests/sim/mrope_cuda_sim.cpp
   runs every thread of the launch grid on the CPU under AddressSanitizer/UBSan, on random shapes,
   layouts, strides, sections and out-of-range tokens, and compares with a direct loop.
2. csrc/ops/cuda/mrope_cuda.cu compiles with nvcc under the stable-ABI flags (when a toolkit is
   installed), so the kernel file cannot rot before a CUDA build picks it up.
"""

import os
import shutil
import subprocess
import sysconfig

import pytest
import torch

from rope_ext import _build_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(cmd, timeout):
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{' '.join(cmd)}\n{r.stdout}\n{r.stderr}"
    return r.stdout


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_mrope_cuda_thread_code_on_cpu(tmp_path):
    exe = str(tmp_path / "mrope_sim")
    _run(["g++", "-std=c++17", "-O1", "-g", "-fsanitize=address,undefined", "-fno-sanitize-recover=all",
          "tests/sim/mrope_cuda_sim.cpp", "-o", exe], timeout=300)
    out = _run([exe, "400"], timeout=300)
    assert out.strip() == "ok 400"


def _nvcc():
    for home in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if home and os.path.isfile(os.path.join(home, "bin", "nvcc")):
            return os.path.join(home, "bin", "nvcc")
    return shutil.which("nvcc")


@pytest.mark.skipif(_nvcc() is None, reason="needs a CUDA toolkit (nvcc)")
def test_mrope_cuda_compiles(tmp_path):
    inc = os.path.join(os.path.dirname(torch.__file__), "include")
    _run([_nvcc(), "-c", "csrc/ops/cuda/mrope_cuda.cu", "-o", str(tmp_path / "mrope_cuda.o"), *_build_flags.NVCC_FLAGS,
          *_build_flags.PY_MODULE_FLAGS,
          "-gencode", "arch=compute_90,code=sm_90", f"-I{inc}", f"-I{sysconfig.get_paths()['include']}",
          "-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__", "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",
          "-D__CUDA_NO_HALF2_OPERATORS__", "--expt-relaxed-constexpr", "-Xcompiler", "-fPIC"], timeout=600)
