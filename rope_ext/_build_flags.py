"""Compiler flags shared by every build of the native code: setup.py (the wheel and
`make build`), rope_ext.jit (JIT loading) and, by hand, CMakeLists.txt (a test checks it).

Imports nothing, so setup.py can read it before torch is imported.
"""

# torch 2.10: the oldest torch the binaries must load in (LibTorch stable ABI).
TORCH_TARGET_VERSION = "0x020a000000000000"
# Python 3.10: the abi3 module init of the compiled package.
PY_LIMITED_API = "0x030a0000"

# No floating-point contraction (FMA) anywhere: every CPU kernel variant, the CUDA kernels and
# the CPU simulator of their per-thread code then round a*c - b*s identically, so results are
# bit-for-bit the same on every path and tests can compare them exactly. RoPE is memory-bound:
# the unfused multiply costs nothing measurable.
CXX_FLAGS = ["-O3", "-std=c++17", "-fno-math-errno", "-ffp-contract=off",
             f"-DTORCH_TARGET_VERSION={TORCH_TARGET_VERSION}"]
NVCC_FLAGS = ["-O3", "-std=c++17", "--fmad=false", "-DUSE_CUDA",
              f"-DTORCH_TARGET_VERSION={TORCH_TARGET_VERSION}"]
# What torch.utils.cpp_extension adds for py_limited_api=True; for builds that call nvcc directly.
PY_MODULE_FLAGS = [f"-DPy_LIMITED_API={PY_LIMITED_API}"]
