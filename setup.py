"""Builds rope_ext's native op libraries against the LibTorch stable ABI.

What is built, from which sources and with which flags is stated once, in csrc/build.json
(read here through build_config.py): the CPU library rope_ext._C (schemas and CPU kernels) and,
where torch is a CUDA build and a toolkit is found, rope_ext._C_cuda (CUDA kernels). The C++ uses
only torch/csrc/stable and torch/headeronly, compiled for torch 2.10 and the Python limited API
3.10, so one abi3 binary serves every torch >= 2.10 and every Python >= 3.10.

Develop with `make build` (python setup.py build_ext --inplace); build a wheel with `make wheel`.
"""

import os
import sys

import setuptools
from setuptools import find_packages, setup

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import build_config  # noqa: E402

# pyproject.toml's SPDX license needs setuptools 77. An older one (a --no-build-isolation build
# in an older env) would fail on that field with a message that names no version.
if build_config._release(setuptools.__version__) < (77,):
    sys.exit(f"rope_ext: building needs setuptools >= 77 (pyproject.toml's license field), found "
             f"{setuptools.__version__}: pip install 'setuptools>=77'")

# Before torch.utils.cpp_extension is imported: it reads CUDA_HOME and the arch list at import.
BUILD_CUDA, CUDA_REASON = build_config.configure_environment()

from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension  # noqa: E402


def extension(name):
    module, python_init, sources = build_config.library(name)
    make = CUDAExtension if name == "cuda" else CppExtension
    flags = {"cxx": build_config.cxx_flags()}
    if name == "cuda":
        flags["nvcc"] = build_config.nvcc_flags()
    # py_limited_api=True makes torch.utils.cpp_extension define Py_LIMITED_API itself.
    return make(module, [python_init] + sources, include_dirs=build_config.include_dirs(),
                extra_compile_args=flags, py_limited_api=True)


def ext_modules():
    mods = [extension("cpu")]
    if BUILD_CUDA:
        mods.append(extension("cuda"))
    else:
        print(f"rope_ext: building without the CUDA kernels ({CUDA_REASON})", file=sys.stderr)
    return mods


class BuildExt(BuildExtension.with_options(use_ninja=True)):
    """torch's build_ext, whose in-place build (`make build`) puts each library in place by a
    rename rather than by writing over it: a process that loaded the old one (a test run, a
    benchmark) keeps reading the file it mapped, where writing into that file would crash it."""

    def copy_file(self, infile, outfile, *args, **kwargs):
        if os.path.isdir(outfile):
            return super().copy_file(infile, outfile, *args, **kwargs)
        partial = f"{outfile}.{os.getpid()}.partial"
        _, copied = super().copy_file(infile, partial, *args, **kwargs)
        os.replace(partial, outfile)
        return outfile, copied


# The version: pyproject.toml reads it from rope_ext/_version.py (its one home).
setup(
    name="rope_ext",
    packages=find_packages(include=["rope_ext", "rope_ext.*"]),
    package_data={"rope_ext": ["*.json", "*.def"]},  # model_defaults.json, schemas.def
    ext_modules=ext_modules(),
    cmdclass={"build_ext": BuildExt},
    options={"bdist_wheel": {"py_limited_api": "cp310"}},
)
