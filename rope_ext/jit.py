"""Development path: build csrc/ with torch.utils.cpp_extension.load (ninja) and load it instead
of the compiled rope_ext._C.

    ROPE_EXT_JIT=1 python -c "import rope_ext"     # at import (ROPE_EXT_JIT=verbose shows the build)
    rope_ext.jit.load(verbose=True)                 # from code, while no native library serves yet

It builds the same libraries as setup.py, from the same sources and flags (csrc/build.json, read
through build_config.py): the CPU library, and the CUDA library where a GPU is visible (or
ROPE_EXT_CUDA=1), as plain shared libraries (no Python module init: the ops register from static
initializers). Builds live in torch's extensions directory ($TORCH_EXTENSIONS_DIR, by default
~/.cache/torch_extensions/...), and ninja rebuilds only what changed.
"""

import importlib.util
import os
import shlex
import shutil

from . import _library, envs

SOURCE_ROOT = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
NAMES = {"cpu": "rope_ext_jit", "cuda": "rope_ext_jit_cuda"}


def _build_config():
    """build_config.py of the source checkout this package was imported from."""
    path = os.path.join(SOURCE_ROOT, "build_config.py")
    if not os.path.isfile(os.path.join(SOURCE_ROOT, "csrc", "build.json")) or not os.path.isfile(path):
        raise RuntimeError(
            f"rope_ext JIT build needs the C++ sources, but {SOURCE_ROOT} has no csrc/build.json: "
            "rope_ext was imported from an installed package, not a source checkout. JIT loading "
            "is for development from a clone (put the clone first on PYTHONPATH); an installed "
            "wheel carries the compiled library instead."
        )
    spec = importlib.util.spec_from_file_location("_rope_ext_build_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check_prerequisites():
    """Raises RuntimeError naming what is missing (sources, ninja, a C++ compiler) before any
    build; returns the build description's reader."""
    config = _build_config()
    config.configure_environment()  # CUDA_HOME before torch.utils.cpp_extension is imported
    from torch.utils import cpp_extension

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
    return config


def _with_cuda(config):
    """Whether the CUDA library joins: ROPE_EXT_CUDA=1 forces it, 0 leaves it out; by default it
    joins where torch sees a GPU (CPU-only machines keep the JIT build short)."""
    import torch

    if envs.CUDA == "0":
        return False
    if envs.CUDA == "1":
        return config.want_cuda()[0]  # raises when impossible
    return torch.cuda.is_available() and config.want_cuda()[0]


def _build(config, name, cuda, verbose):
    from torch.utils import cpp_extension

    _, _, sources = config.library(name)
    return cpp_extension.load(
        name=NAMES[name],
        sources=[os.path.join(SOURCE_ROOT, s) for s in sources],
        extra_cflags=config.cxx_flags(),
        extra_cuda_cflags=config.nvcc_flags() if cuda else None,
        extra_include_paths=config.include_dirs(),
        with_cuda=cuda,
        is_python_module=False,
        verbose=verbose,
    )


def load(verbose=False):
    """Builds (if needed) and loads the JIT libraries; returns the CPU library's path.

    Works while no native library serves the rope ops (the compiled one is not built, or
    ROPE_EXT_BACKEND=reference): the Python-defined schemas are replaced by the library's.
    Calling it again after a JIT load returns the same path (and retries the CUDA library if its
    build failed). Refuses, with a RuntimeError, when another native library already registered
    the ops: a second copy would register them twice.
    """
    state = _library.state
    if state.loaded_by == "jit":
        config = _build_config()
        with_cuda = state.cuda_path is None and _with_cuda(config)
    else:
        if state.path is not None:
            fresh = ("without that library" if state.loaded_by == "preloaded"
                     else "with ROPE_EXT_JIT=1 (or without the compiled library)")
            raise RuntimeError(
                f"rope_ext.jit.load: the rope ops are already served by the native library "
                f"{state.path}; loading a second copy into this process would register rope::* "
                f"twice. Start a new process {fresh}."
            )
        config = check_prerequisites()
        _library.refuse_foreign_library("ROPE_EXT_JIT=1" if envs.JIT != "0" else "rope_ext.jit.load")
        with_cuda = _with_cuda(config)  # ROPE_EXT_CUDA=1 where impossible: refused before building
        _load_cpu(config, verbose)
    if with_cuda:
        try:
            state.cuda_path = _build(config, "cuda", True, verbose)
        except Exception as e:
            raise RuntimeError(
                f"rope_ext JIT build of {SOURCE_ROOT}/csrc failed (the CUDA library; the CPU one "
                f"is loaded and serves, and rope_ext.jit.load() tries the CUDA build again): {e}"
            ) from e
    return state.path


def _load_cpu(config, verbose):
    import torch

    state = _library.state
    had_python_defs = _library.drop_python_definitions()
    try:
        path = _build(config, "cpu", False, verbose)
    except BaseException as e:
        if had_python_defs:  # keep torch.ops.rope.* defined (reference-backed) as before
            _library.define_from_python()
        if isinstance(e, Exception):
            raise RuntimeError(f"rope_ext JIT build of {SOURCE_ROOT}/csrc failed: {e}") from e
        raise
    state.path, state.loaded_by, state.error = path, "jit", None
    torch.ops.rope.apply  # noqa: B018  (fails loudly here if the library did not define the ops)
    if had_python_defs:  # registered before the library: its C++ call path needs the twins' kernels
        from . import _registrations

        _registrations.register_routes()
    _library.apply_cpu_settings()  # before the CUDA build, which may fail
