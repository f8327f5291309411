"""Builds rope_ext's native op library against the LibTorch stable ABI.

The C++ uses only torch/csrc/stable and torch/headeronly, compiled for TORCH_TARGET_VERSION
(torch 2.10) and the Python limited API (3.10), so one abi3 binary serves every torch >= 2.10
and every Python >= 3.10. Build in place for development with
`python setup.py build_ext --inplace` (what `make` does), or a wheel with `make wheel`.
"""

import glob
import os
import sys

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import build_config  # noqa: E402

# Before torch.utils.cpp_extension is imported: it reads CUDA_HOME and the arch list at import.
BUILD_CUDA, CUDA_REASON = build_config.configure_environment()

from torch.utils.cpp_extension import BuildExtension, CppExtension  # noqa: E402

_flags = {}
with open(os.path.join(HERE, "rope_ext", "_build_flags.py")) as f:
    exec(f.read(), _flags)
# py_limited_api=True makes torch.utils.cpp_extension define Py_LIMITED_API (3.10) itself.
CXX_FLAGS = _flags["CXX_FLAGS"]
NVCC_FLAGS = _flags["NVCC_FLAGS"]


def sources(*patterns):
    return sorted(
        os.path.relpath(p, HERE) for pat in patterns for p in glob.glob(os.path.join(HERE, pat))
    )


def cpu_extension():
    return CppExtension(
        "rope_ext._C",
        sources("csrc/module.cpp", "csrc/ops/*.cpp", "csrc/ops/cpu/*.cpp"),
        extra_compile_args={"cxx": CXX_FLAGS},
        py_limited_api=True,
    )


def cuda_extension():
    """The CUDA kernels, in their own library (rope_ext._C_cuda) so that rope_ext._C loads
    under a CPU-only torch. It compiles the shared host-side checks once more
    (csrc/ops/cuda/rope_checks_cuda.cpp) but not the schemas, which only rope_ext._C defines."""
    from torch.utils.cpp_extension import CUDAExtension

    return CUDAExtension(
        "rope_ext._C_cuda",
        sources("csrc/cuda_module.cpp", "csrc/ops/cuda/*.cpp", "csrc/ops/cuda/*.cu"),
        extra_compile_args={
            "cxx": CXX_FLAGS,
            "nvcc": NVCC_FLAGS,
        },
        py_limited_api=True,
    )


def ext_modules():
    mods = [cpu_extension()]
    if BUILD_CUDA:
        mods.append(cuda_extension())
    else:
        print(f"rope_ext: building without the CUDA kernels ({CUDA_REASON})", file=sys.stderr)
    return mods


version = {}
with open(os.path.join(HERE, "rope_ext", "_version.py")) as f:
    exec(f.read(), version)

setup(
    name="rope_ext",
    version=version["__version__"],
    packages=find_packages(include=["rope_ext", "rope_ext.*"]),
    ext_modules=ext_modules(),
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    options={"bdist_wheel": {"py_limited_api": "cp310"}},
)
