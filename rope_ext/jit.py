"""Development path: build csrc/ with torch.utils.cpp_extension.load (ninja) and load it instead
of the compiled rope_ext._C.

    ROPE_EXT_JIT=1 python -c "import rope_ext"        # at import (ROPE_EXT_JIT=verbose shows the build)
    rope_ext.jit.load(verbose=True)                    # from code, while no native library serves yet

The build lives in torch's usual extensions directory ($TORCH_EXTENSIONS_DIR, by default
~/.cache/torch_extensions/<python>_<accelerator>/rope_ext_jit) and ninja rebuilds only what changed.
The library is a plain shared library (no Python module: the ops register from static initializers),
built from the same sources and stable-ABI flags as setup.py, so the same Python-side registrations
(fake kernels, autograd, reference fallback) serve it.
"""

import glob
import os
import shlex
import shutil
import sys
import warnings

from . import _build_flags

JIT_ENV = "ROPE_EXT_JIT"
JIT_CUDA_ENV = "ROPE_EXT_JIT_CUDA"
DEFAULT_CUDA_ARCHS = "9.0+PTX"
NAME = "rope_ext_jit"

# The flags of setup.py (the stable ABI of torch 2.10, no FP contraction), less the Python module's.
CFLAGS = _build_flags.CXX_FLAGS
CUDA_CFLAGS = _build_flags.NVCC_FLAGS

SOURCE_ROOT = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
CSRC = os.path.join(SOURCE_ROOT, "csrc")
# Same globs as setup.py, less csrc/module.cpp (the Python module init, not needed by a plain
# library). One library holds every device, so of csrc/ops/cuda only the kernels (*.cu) join: the
# host-side checks are already in csrc/ops/*.cpp (as in CMakeLists.txt).
CPU_PATTERNS = ("ops/*.cpp", "ops/cpu/*.cpp")
CUDA_PATTERNS = ("ops/cuda/*.cu",)


def requested():
    """The value of ROPE_EXT_JIT: None (off), "quiet" or "verbose"."""
    value = os.environ.get(JIT_ENV, "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return None
    return "verbose" if value == "verbose" else "quiet"


def _glob(patterns):
    return sorted(p for pat in patterns for p in glob.glob(os.path.join(CSRC, pat)))


def _default_cuda_home():
    """torch.utils.cpp_extension reads CUDA_HOME once, at import, and without it guesses from any
    nvcc on PATH (often wrongly, e.g. /usr/local); point it at the usual toolkit first."""
    if "torch.utils.cpp_extension" in sys.modules:
        return
    if os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH"):
        return
    if os.path.isfile("/usr/local/cuda/bin/nvcc"):
        os.environ["CUDA_HOME"] = "/usr/local/cuda"


def _cuda_wanted():
    """Whether the CUDA kernels join the JIT build. ROPE_EXT_JIT_CUDA=1 forces them (an error if
    impossible), 0 leaves them out; by default they join where torch sees a GPU and nvcc is found.
    CI and CPU-only machines build the CPU kernels alone, which keeps the JIT build short."""
    import torch
    from torch.utils import cpp_extension

    forced = os.environ.get(JIT_CUDA_ENV, "").strip()
    if forced == "0":
        return False
    home = cpp_extension.CUDA_HOME
    has_nvcc = bool(home) and os.path.isfile(os.path.join(home, "bin", "nvcc"))
    missing = [
        why
        for why, bad in (
            ("no sources in csrc/ops/cuda", not _glob(CUDA_PATTERNS)),
            ("torch is a CPU-only build", torch.version.cuda is None),
            ("nvcc not found (set CUDA_HOME)", not has_nvcc),
        )
        if bad
    ]
    if forced == "1":
        if missing:
            raise RuntimeError(
                f"{JIT_CUDA_ENV}=1 but the CUDA kernels cannot be built: " + "; ".join(missing)
            )
        return True
    if not torch.cuda.is_available():
        return False
    if missing:
        warnings.warn(
            "rope_ext JIT: building without the CUDA kernels (" + "; ".join(missing) + "); "
            "CUDA tensors are served by the reference",
            stacklevel=3,
        )
        return False
    return True


def check_prerequisites():
    """Raises RuntimeError naming what is missing (sources, ninja, a C++ compiler) before any build."""
    _default_cuda_home()
    from torch.utils import cpp_extension

    if not os.path.isdir(os.path.join(CSRC, "ops")):
        raise RuntimeError(
            f"rope_ext JIT build needs the C++ sources, but {CSRC}/ops does not exist: rope_ext was "
            f"imported from {SOURCE_ROOT}, which is not a source checkout. JIT loading is for "
            "development from a clone (put the clone first on PYTHONPATH); an installed wheel "
            "carries the compiled library instead."
        )
    if not cpp_extension.is_ninja_available():
        raise RuntimeError(
            "rope_ext JIT build needs ninja, which was not found on PATH: "
            "`pip install ninja` (or install your system's ninja-build package)."
        )
    cxx = os.environ.get("CXX", "c++")
    words = shlex.split(cxx) or ["c++"]
    if shutil.which(words[0]) is None:
        raise RuntimeError(
            f"rope_ext JIT build needs a C++17 compiler, but {words[0]!r} (from $CXX, default c++) "
            "was not found: install g++ or clang++, or point CXX at one."
        )


def load(verbose=False):
    """Builds (if needed) and loads the JIT library; returns its path.

    Works while no native library serves the rope ops: the ops may have been defined from Python
    (the compiled library is not built, or ROPE_EXT_BACKEND=reference); those definitions are
    replaced by the library's. Calling it again after a JIT load returns the same path. Refuses,
    with a RuntimeError, when another native library (rope_ext._C, or one loaded with
    torch.ops.load_library) already registered the ops: a second copy would register them twice
    and crash the process.
    """
    from . import _native, _registrations

    if _native.loaded_by == "jit":
        return _native.loaded_from
    if _native.loaded_from is not None:
        raise RuntimeError(
            f"rope_ext.jit.load: the rope ops are already served by the native library "
            f"{_native.loaded_from}; loading a second copy into this process would register "
            f"rope::* twice. Start a new process with {JIT_ENV}=1 (or without the compiled "
            "library) to use the JIT build."
        )
    check_prerequisites()
    _native.refuse_foreign_library(f"{JIT_ENV}=1" if requested() else "rope_ext.jit.load")

    import torch
    from torch.utils import cpp_extension

    with_cuda = _cuda_wanted()
    if with_cuda and not torch.cuda.is_available():
        # Nothing to detect the archs from (a forced build without a GPU): setup.py's default.
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_CUDA_ARCHS)
    sources = _glob(CPU_PATTERNS) + (_glob(CUDA_PATTERNS) if with_cuda else [])
    python_defs = [lib for lib in _registrations._libraries if lib.kind == "DEF"]
    for lib in python_defs:  # the library's STABLE_TORCH_LIBRARY defines the same schemas
        lib._destroy()
        _registrations._libraries.remove(lib)
    try:
        path = cpp_extension.load(
            name=NAME,
            sources=sources,
            extra_cflags=CFLAGS,
            extra_cuda_cflags=CUDA_CFLAGS if with_cuda else None,
            with_cuda=with_cuda,
            is_python_module=False,
            verbose=verbose,
        )
    except BaseException as e:
        if python_defs:  # keep torch.ops.rope.* defined (reference-backed) as before the attempt
            _registrations.define_schemas_from_python()
        if isinstance(e, Exception):
            raise RuntimeError(f"rope_ext JIT build of {CSRC} failed: {e}") from e
        raise
    _native.loaded_from = path
    _native.loaded_by = "jit"
    _native.load_error = None
    torch.ops.rope.apply  # noqa: B018  (fails loudly here if the library did not define the ops)
    return path
