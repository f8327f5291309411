"""Which compiled variant of the CPU kernels serves (chosen once, when the library loads)."""

import torch

from . import _native

# The int rope.cpu_isa returns -> its name; -1 is what the Python-defined op (no native library)
# returns.
ISA_NAMES = {-1: "reference", 0: "baseline", 1: "avx2", 2: "avx512", 3: "avx512_bf16"}


def cpu_isa():
    """The CPU kernel variant serving torch.ops.rope.* on CPU: "avx512_bf16" (AVX-512 with the
    one-instruction bfloat16 conversion), "avx512", "avx2", "baseline" (portable C++), or
    "reference" when the native library is not loaded (pure PyTorch).

    The native library picks the best variant the CPU supports; the environment variable
    ROPE_EXT_CPU_ISA=baseline|avx2|avx512|avx512_bf16, set before import, caps it (for tests
    and comparisons).
    """
    if not _native.has_kernel("cpu"):
        return "reference"
    return ISA_NAMES.get(int(torch.ops.rope.cpu_isa()), "unknown")


def reference_cpu_isa():
    return -1
