"""Loads the compiled op libraries, or records why none serves.

ROPE_EXT_BACKEND=reference skips loading them; the ops are then defined from Python and backed
by rope_ext.reference on every device.
"""

import importlib
import os
import warnings

import torch

BACKEND_ENV = "ROPE_EXT_BACKEND"
_DEVICE_KEYS = {"cpu": "CPU", "cuda": "CUDA"}
# How the native library came: "compiled" (rope_ext._C), "jit" (rope_ext.jit) or "preloaded"
# (registered before rope_ext was imported, e.g. torch.ops.load_library of the CMake build).
loaded_by = None

# Set by load(): the module that registered the native kernels, or why there is none.
loaded_from = None
load_error = None
# The same for the CUDA kernels (rope_ext._C_cuda), loaded only under a CUDA build of torch.
cuda_loaded_from = None
cuda_load_error = None


def requested_backend():
    value = os.environ.get(BACKEND_ENV, "auto").strip().lower() or "auto"
    if value not in ("auto", "native", "reference"):
        warnings.warn(f"{BACKEND_ENV}={value!r} is not one of auto, native, reference; using auto")
        value = "auto"
    return value


def load():
    """Imports rope_ext._C (whose static initializers register the ops); returns True if the
    native library serves. With ROPE_EXT_JIT=1 the JIT build of csrc/ serves instead; if a library
    loaded before rope_ext already registered the ops, that one serves."""
    global loaded_from, load_error, loaded_by
    from . import jit

    if jit.requested():
        jit.load(verbose=jit.requested() == "verbose")
        return True
    preloaded = _preloaded_library()
    if preloaded is not None:  # loading rope_ext._C too would register the ops twice
        loaded_from, loaded_by = preloaded, "preloaded"
        return True
    if requested_backend() == "reference":
        load_error = f"{BACKEND_ENV}=reference"
        return False
    try:
        module = importlib.import_module("rope_ext._C")
    except ImportError as e:
        load_error = f"{type(e).__name__}: {e}"
        warnings.warn(
            "rope_ext: the compiled library rope_ext._C could not be loaded "
            f"({load_error}); torch.ops.rope.* fall back to the pure-PyTorch reference. "
            "Build it with `make build` (or `pip install .`).",
            stacklevel=3,
        )
        return False
    loaded_by = "compiled"
    loaded_from = module.__file__
    _load_cuda()
    return True


def _load_cuda():
    """Imports rope_ext._C_cuda (CUDA kernels only; the schemas come from rope_ext._C) where
    torch has CUDA. Without it CUDA tensors are served by the reference."""
    global cuda_loaded_from, cuda_load_error
    if not torch.version.cuda:
        cuda_load_error = "torch is a CPU-only build"
        return
    try:
        module = importlib.import_module("rope_ext._C_cuda")
    except ImportError as e:
        cuda_load_error = f"{type(e).__name__}: {e}"
        if torch.cuda.is_available():
            warnings.warn(
                "rope_ext: the CUDA library rope_ext._C_cuda could not be loaded "
                f"({cuda_load_error}); CUDA tensors fall back to the pure-PyTorch reference.",
                stacklevel=4,
            )
        return
    cuda_loaded_from = module.__file__


def has_kernel(device_type):
    """True if a native kernel for rope::apply is registered for this device type."""
    key = _DEVICE_KEYS.get(device_type)
    return (
        loaded_from is not None
        and key is not None
        and torch._C._dispatch_has_kernel_for_dispatch_key("rope::apply", key)
    )


def _preloaded_library():
    """If another library already defined the rope ops in C++ before rope_ext loaded any, its path
    (or a description); None otherwise."""
    from . import _registrations

    if any(lib.kind == "DEF" for lib in _registrations._libraries):
        return None  # rope_ext defined them from Python itself
    try:
        torch._C._dispatch_find_schema_or_throw("rope::apply", "")
    except RuntimeError:
        return None
    libs = sorted(torch.ops.loaded_libraries)
    return libs[0] if len(libs) == 1 else "a library loaded before rope_ext (" + ", ".join(libs) + ")"


def refuse_foreign_library(what):
    """Raises if a library that rope_ext did not load already defines the rope ops: loading a
    second copy would register them twice, which aborts the process."""
    preloaded = _preloaded_library() if loaded_from is None else None
    if preloaded is not None:
        raise RuntimeError(
            f"rope_ext: {what} would load a second copy of the rope ops, but {preloaded} already "
            "registered them in this process; use that library, or load only one copy."
        )
