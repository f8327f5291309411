"""Builds rope_ext's native op library against the LibTorch stable ABI.

The C++ uses only torch/csrc/stable and torch/headeronly, compiled for TORCH_TARGET_VERSION
(torch 2.10) and the Python limited API (3.10), so one abi3 binary serves every torch >= 2.10
and every Python >= 3.10. Build in place for development with
`python setup.py build_ext --inplace` (what `make` does), or a wheel with `make wheel`.
"""

import glob
import os

from setuptools import find_packages, setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

HERE = os.path.dirname(os.path.abspath(__file__))
TORCH_TARGET_VERSION = "0x020a000000000000"  # torch 2.10: the oldest torch the binary must load in
PY_LIMITED_API = "0x030a0000"  # Python 3.10

STABLE_ABI_FLAGS = [
    f"-DTORCH_TARGET_VERSION={TORCH_TARGET_VERSION}",
    f"-DPy_LIMITED_API={PY_LIMITED_API}",
]
CXX_FLAGS = ["-O3", "-std=c++17", "-fno-math-errno", *STABLE_ABI_FLAGS]


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


version = {}
with open(os.path.join(HERE, "rope_ext", "_version.py")) as f:
    exec(f.read(), version)

setup(
    name="rope_ext",
    version=version["__version__"],
    packages=find_packages(include=["rope_ext", "rope_ext.*"]),
    ext_modules=[cpu_extension()],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    options={"bdist_wheel": {"py_limited_api": "cp310"}},
)
