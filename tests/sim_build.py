"""Builds (once per process, cached under build/<name>/) and loads a CPU simulator of CUDA kernels,
tests/sim/<name>.cpp, compiled with the flags of the real libraries (same rounding: no FP
contraction) plus -DROPE_SIM for the hooks."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
import build_config  # noqa: E402

_loaded = set()


def load(name, library):
    """Loads tests/sim/<name>.cpp as the library `library`, whose ops it registers."""
    if name in _loaded:
        return
    try:
        build_config.check_torch_for_build()
    except RuntimeError as e:  # (the wheel's tests beside an older torch)
        import pytest
        pytest.skip(f"the simulator compiles csrc/ against this torch's headers: {e}",
                    allow_module_level=True)
    build_config.configure_environment()  # CUDA_HOME: no "guessing /usr/local" warning
    from torch.utils.cpp_extension import load as cpp_load

    build_dir = os.path.join(ROOT, "build", name)
    os.makedirs(build_dir, exist_ok=True)
    cpp_load(
        name=library,
        sources=[os.path.join(ROOT, "tests", "sim", name + ".cpp")],
        # -O1 after the library's -O3: the same IEEE arithmetic (no contraction, no
        # reassociation at any level), compiled in half the time; the simulator runs small cases.
        # Under the sanitizers -O0: instrumented, the file compiles in a third of the time (19 s,
        # not 64, on two cores) and its small cases still run about as fast.
        extra_cflags=build_config.cxx_flags() + [
            "-O0" if build_config.envs.BUILD == "sanitize" else "-O1", "-DROPE_SIM"],
        extra_include_paths=build_config.include_dirs(),
        build_directory=build_dir,
        is_python_module=False,
        verbose=False,
    )
    _loaded.add(name)
