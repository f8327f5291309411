"""Decides whether setup.py builds the CUDA library, without importing torch.

Rules: ROPE_EXT_CUDA=1 forces the CUDA build (an error if it is impossible), ROPE_EXT_CUDA=0
skips it; otherwise it is built whenever the installed torch is a CUDA build and a CUDA toolkit
is found (CUDA_HOME, else /usr/local/cuda, else the nvcc on PATH), GPU or not. Without a GPU
torch cannot detect the archs, so TORCH_CUDA_ARCH_LIST defaults to DEFAULT_ARCHS.

`python build_config.py --cuda-lib` prints the CUDA library's path when it would be built (the
Makefile uses it to track that file), and nothing otherwise.
"""

import importlib.util
import os
import shutil
import sys

CUDA_ENV = "ROPE_EXT_CUDA"
CUDA_LIB = "rope_ext/_C_cuda.abi3.so"
# SASS for sm_80 (A100; also runs on sm_86/sm_89) and sm_90 (H100/H200), plus compute_90 PTX that
# the driver compiles for newer GPUs (Blackwell). Measured on 2 cores: the .cu takes ~21-27 s
# with "9.0+PTX" and ~21-42 s with this list (noisy, shared machine); worth it so the default
# build runs on every GPU from Ampere on.
DEFAULT_ARCHS = "8.0;9.0+PTX"


def _has_nvcc(home):
    return bool(home) and os.path.isfile(os.path.join(home, "bin", "nvcc"))


def cuda_home():
    """The CUDA toolkit root, or None."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(var)
        if _has_nvcc(home):
            return home
    if _has_nvcc("/usr/local/cuda"):
        return "/usr/local/cuda"
    nvcc = shutil.which("nvcc")
    if nvcc:
        return os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
    return None


def torch_cuda_version():
    """torch.version.cuda of the installed torch (None for a CPU-only build), read from
    torch/version.py so that no torch import (seconds) is needed."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "version.py")
    scope = {}
    try:
        with open(path) as f:
            exec(compile(f.read(), path, "exec"), scope)
    except (OSError, SyntaxError, ImportError):
        return None
    return scope.get("cuda")


def want_cuda():
    """(build the CUDA library?, why)."""
    forced = os.environ.get(CUDA_ENV, "").strip()
    if forced == "0":
        return False, f"{CUDA_ENV}=0"
    home, tcuda = cuda_home(), torch_cuda_version()
    missing = []
    if not tcuda:
        missing.append("torch is a CPU-only build")
    if not home:
        missing.append("no CUDA toolkit (set CUDA_HOME or install one at /usr/local/cuda)")
    if missing:
        if forced == "1":
            raise RuntimeError(f"{CUDA_ENV}=1 but the CUDA library cannot be built: " + "; ".join(missing))
        return False, "; ".join(missing)
    return True, f"torch CUDA {tcuda}, toolkit {home}"


def configure_environment():
    """Sets CUDA_HOME and TORCH_CUDA_ARCH_LIST for torch.utils.cpp_extension, which reads them
    at import (it would otherwise guess /usr/local from a stray nvcc and fail to link)."""
    build, why = want_cuda()
    home = cuda_home()
    if home:
        os.environ["CUDA_HOME"] = home
    if build:
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_ARCHS)
    return build, why


if __name__ == "__main__":
    if sys.argv[1:] == ["--cuda-lib"]:
        if want_cuda()[0]:
            print(CUDA_LIB)
    else:
        print(want_cuda())
