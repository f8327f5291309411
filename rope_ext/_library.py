"""Loads the compiled op libraries, or defines the ops from Python where none serves.

The compiled CPU library rope_ext._C defines every schema (csrc/ops/rope.cpp) and registers the
CPU kernels; rope_ext._C_cuda, loaded only under a CUDA build of torch, registers the CUDA
kernels. Without them (not built, ROPE_EXT_BACKEND=reference) the same schemas are defined here
from _schemas.py, and the reference serves every device.
"""

import importlib
import os
import warnings

import torch

from . import envs
from ._schemas import SCHEMAS

_DEVICE_KEYS = {"cpu": "CPU", "cuda": "CUDA"}
# The int rope.cpu_isa returns -> its name (-1: no native library).
CPU_ISA_NAMES = ("baseline", "avx2", "avx512", "avx512_bf16")


class _State:
    # How the native ops came: "compiled" (rope_ext._C), "jit" (rope_ext.jit) or "preloaded"
    # (registered before rope_ext was imported, e.g. torch.ops.load_library of the CMake build).
    loaded_by = None
    path = None  # the library that serves, or None
    error = None  # why none serves
    cuda_path = None
    cuda_error = None


state = _State()
_python_defs = []  # torch.library.Library objects holding the Python-defined schemas


def define_from_python():
    """Defines the ops when no native library does, so torch.ops.rope.* exist either way."""
    lib = torch.library.Library("rope", "DEF")
    for schema in SCHEMAS.values():
        lib.define(schema)
    lib.impl("cpu_isa", lambda best=False: -1, "CompositeExplicitAutograd")
    lib.impl("set_cpu_isa", lambda isa: -1, "CompositeExplicitAutograd")
    lib.impl("set_cpu_stream_threshold", lambda nbytes: -1, "CompositeExplicitAutograd")
    _python_defs.append(lib)


def check_schemas():
    """Raises ImportError if the native library's ops are not those of schemas.def: a library
    built from other sources (a checkout updated without rebuilding) would take arguments this
    package does not pass."""
    for key, want in SCHEMAS.items():
        name, _, overload = key.partition(".")
        try:
            got = str(torch._C._dispatch_find_schema_or_throw(f"rope::{name}", overload).schema())
        except RuntimeError:
            got = "missing"
        if got != str(torch._C.parse_schema("rope::" + want)):  # both as this torch prints them
            raise ImportError(
                f"rope_ext: the native library {state.path} was built from other sources than this "
                f"package: rope::{key} is {got} there, rope::{want} here. Rebuild it (`make build`, "
                "or `pip install .`).")


def drop_python_definitions():
    """Removes the Python-defined schemas (a native library is about to define them)."""
    had = bool(_python_defs)
    for lib in _python_defs:
        lib._destroy()
    _python_defs.clear()
    return had


def _preloaded_libraries():
    """If libraries loaded before rope_ext already defined the rope ops in C++ (torch.ops.load_library
    of the CMake build: librope_ops.so, then librope_ops_cuda.so), (CPU library path or a
    description, CUDA library path or None); None otherwise."""
    if _python_defs:
        return None
    try:
        torch._C._dispatch_find_schema_or_throw("rope::apply", "")
    except RuntimeError:
        return None
    libs = sorted(torch.ops.loaded_libraries)
    cuda = [p for p in libs if "cuda" in os.path.basename(p)]
    cpu = [p for p in libs if p not in cuda]
    if len(cpu) == 1 and len(cuda) <= 1:
        return cpu[0], (cuda[0] if cuda else None)
    where = ", ".join(libs) or "not through torch.ops.load_library"  # e.g. dlopen'ed by a C++ host
    return f"a library loaded before rope_ext ({where})", None


def refuse_foreign_library(what):
    """Raises if a library that rope_ext did not load already defines the rope ops: loading a
    second copy would register them twice, which aborts the process. Called while no library of
    rope_ext's serves (state.path is None): one that did would be found here too."""
    preloaded = _preloaded_libraries()
    if preloaded is not None:
        raise RuntimeError(
            f"rope_ext: {what} would load a second copy of the rope ops, but {preloaded[0]} "
            "already registered them in this process; use that library, or load only one copy."
        )


def load_compiled():
    """Imports rope_ext._C (its static initializers register the ops) and, under a CUDA build of
    torch, rope_ext._C_cuda. Falls back to Python-defined ops, with one warning, when the CPU
    library cannot be loaded (ROPE_EXT_BACKEND=native makes that an error)."""
    preloaded = _preloaded_libraries()
    if preloaded is not None:  # loading rope_ext._C too would register the ops twice
        state.path, state.cuda_path = preloaded
        state.loaded_by = "preloaded"
        check_schemas()
        if envs.BACKEND == "reference":
            warnings.warn(f"rope_ext: ROPE_EXT_BACKEND=reference is not honoured: {preloaded[0]}, "
                          "loaded before rope_ext, already serves the rope ops natively",
                          stacklevel=3)
        return
    if envs.BACKEND == "reference":
        state.error = "ROPE_EXT_BACKEND=reference"
        define_from_python()
        return
    try:
        module = importlib.import_module("rope_ext._C")
    except ImportError as e:
        state.error = f"{type(e).__name__}: {e}"
        if envs.BACKEND == "native":
            raise ImportError(f"rope_ext: ROPE_EXT_BACKEND=native but rope_ext._C could not be "
                              f"loaded ({state.error})") from e
        warnings.warn(
            "rope_ext: the compiled library rope_ext._C could not be loaded "
            f"({state.error}); torch.ops.rope.* fall back to the pure-PyTorch reference. "
            "Build it with `make build` (or `pip install .`).",
            stacklevel=3,
        )
        define_from_python()
        return
    state.loaded_by, state.path = "compiled", module.__file__
    check_schemas()
    _load_cuda()


def _load_cuda():
    if not torch.version.cuda:
        state.cuda_error = "torch is a CPU-only build"
        return
    try:
        module = importlib.import_module("rope_ext._C_cuda")
    except ImportError as e:
        state.cuda_error = f"{type(e).__name__}: {e}"
        if torch.cuda.is_available():
            warnings.warn(
                "rope_ext: the CUDA library rope_ext._C_cuda could not be loaded "
                f"({state.cuda_error}); CUDA tensors fall back to the pure-PyTorch reference.",
                stacklevel=4,
            )
        return
    state.cuda_path = module.__file__


def apply_cpu_settings():
    """Applies ROPE_EXT_CPU_ISA and ROPE_EXT_CPU_STREAM_MB to the native CPU library."""
    if not has_kernel("cpu"):
        return
    if envs.CPU_ISA != "auto":
        wanted = CPU_ISA_NAMES.index(envs.CPU_ISA)
        try:
            torch.ops.rope.set_cpu_isa(wanted)
        except RuntimeError:
            warnings.warn(f"rope_ext: ROPE_EXT_CPU_ISA={envs.CPU_ISA}: this CPU lacks it; using "
                          f"{cpu_isa()}", stacklevel=3)
    if envs.CPU_STREAM_MB is not None:
        torch.ops.rope.set_cpu_stream_threshold(envs.CPU_STREAM_MB << 20)


def has_kernel(device_type):
    """True if a native kernel for rope::apply is registered for this device type."""
    key = _DEVICE_KEYS.get(device_type)
    return (
        state.path is not None
        and key is not None
        and torch._C._dispatch_has_kernel_for_dispatch_key("rope::apply", key)
    )


def cpu_isa():
    """The CPU kernel variant that serves: "avx512_bf16", "avx512", "avx2", "baseline", or
    "reference" when no native library is loaded."""
    if not has_kernel("cpu"):
        return "reference"
    return CPU_ISA_NAMES[int(torch.ops.rope.cpu_isa())]


def cpu_isas():
    """The CPU kernel variants this CPU (and this build) can serve with, lowest first: a prefix
    of ("baseline", "avx2", "avx512", "avx512_bf16"); () when no native library is loaded."""
    if not has_kernel("cpu"):
        return ()
    return CPU_ISA_NAMES[: int(torch.ops.rope.cpu_isa(True)) + 1]  # (a query: no setting moves)


def set_cpu_isa(name):
    """Serves the CPU ops with variant `name` ("auto" for the best this CPU supports; a variant it
    lacks is an error); returns the name of the variant now serving. For tests and comparisons:
    every variant gives the same bits, but for NaN payloads and avx512_bf16's bfloat16 results
    below 1.2e-38, stored as zeros (docs/math.md)."""
    if not has_kernel("cpu"):
        raise RuntimeError("rope_ext.set_cpu_isa: no native CPU library is loaded")
    if name != "auto" and name not in CPU_ISA_NAMES:
        raise ValueError(f"rope_ext.set_cpu_isa: name must be auto or one of "
                         f"{', '.join(CPU_ISA_NAMES)}, got {name!r}")
    torch.ops.rope.set_cpu_isa(-1 if name == "auto" else CPU_ISA_NAMES.index(name))
    return cpu_isa()
