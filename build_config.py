"""Reads the build description, csrc/build.json, for setup.py, rope_ext.jit and the tests that
compile native code, and decides whether the CUDA library is built. Imports no torch.

Rules for CUDA: ROPE_EXT_CUDA=1 forces the CUDA library (an error if it cannot be built), 0 skips
it; otherwise it is built whenever the installed torch is a CUDA build and a CUDA toolkit is found
(CUDA_HOME, else /usr/local/cuda, else the nvcc on PATH), GPU or not; a CUDA_HOME (or CUDA_PATH)
with no bin/nvcc in it is passed over, and the build output says so. Without a GPU torch cannot
detect the archs, so TORCH_CUDA_ARCH_LIST defaults to build.json's `cuda_archs`.

`python build_config.py --cuda-lib` prints the CUDA library's path when it would be built (the
Makefile tracks that file), and nothing otherwise; `--cuda-home` prints the toolkit root found
(and on stderr a note, where CUDA_HOME was passed over); `--native-cpu-flags` the C++ flags of a
build of only the CPU variants this machine runs.
"""

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.abspath(__file__))

with open(os.path.join(ROOT, "csrc", "build.json")) as _f:
    DESCRIPTION = json.load(_f)

# rope_ext/envs.py is the one reader of the environment; loaded by path (no torch, no package).
_spec = importlib.util.spec_from_file_location("_rope_ext_envs", os.path.join(ROOT, "rope_ext", "envs.py"))
envs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(envs)


def library(name):
    """(module name, python-init source, sources) of library "cpu" or "cuda", paths relative to
    the repository root."""
    lib = DESCRIPTION["libraries"][name]
    return lib["module"], lib["python_init"], list(lib["sources"])


def library_path(name, suffix=".abi3.so"):
    """Where the in-place build puts the library, relative to the root."""
    return library(name)[0].replace(".", "/") + suffix


def native_cpu_variant(cpuinfo="/proc/cpuinfo"):
    """The best CPU kernel variant this machine runs (0 baseline .. 3 avx512_bf16, as in
    csrc/ops/cpu/kernel_api.h), read from the kernel's CPU flags; 3 where they are unreadable."""
    try:
        with open(cpuinfo) as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), None)
    except OSError:
        flags = None
    if flags is None:
        return 3
    has = set(flags).issuperset
    if has({"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma", "f16c"}):
        return 3 if has({"avx512_bf16"}) else 2
    return 1 if has({"avx2", "fma", "f16c"}) else 0


def native_cpu_flags():
    """The C++ flags of a build of only the CPU variants this machine runs."""
    return [f"-DROPE_CPU_MAX_ISA={native_cpu_variant()}"]


def _defines():
    return [f"-DTORCH_TARGET_VERSION={DESCRIPTION['torch_target_version']}"]


def cxx_flags():
    """Flags for the C++ sources: the project's, then release (no debug info) or sanitizer flags."""
    extra = DESCRIPTION["sanitize_flags" if envs.BUILD == "sanitize" else "release_flags"]
    if envs.CPU_VARIANTS == "native":
        extra = extra + native_cpu_flags()
    return DESCRIPTION["cxx_flags"] + _defines() + extra


def nvcc_major(home=None):
    """The major version of the toolkit's nvcc (`nvcc --version`: "release 13.0"), or None."""
    home = home or cuda_home()
    if not _has_nvcc(home):
        return None
    try:
        out = subprocess.run([os.path.join(home, "bin", "nvcc"), "--version"], capture_output=True,
                             text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    found = re.search(r"release (\d+)\.", out)
    return int(found.group(1)) if found else None


def nvcc_flags(home=None):
    """Flags for the CUDA sources. From CUDA 13 on, `nvcc13_flags` too: the fatbin compressed for
    size (the CUDA library a fifth as large). nvcc before 12.8 lacks the option, and a 12.x build
    compressed so would need a newer driver (550+) than its torch does; CUDA 13 needs 580+."""
    major = nvcc_major(home)
    extra = DESCRIPTION["nvcc13_flags"] if major is not None and major >= 13 else []
    return DESCRIPTION["nvcc_flags"] + extra + _defines()


def include_dirs():
    return [os.path.join(ROOT, d) for d in DESCRIPTION["include_dirs"]]


def cuda_arch_list():
    """The default TORCH_CUDA_ARCH_LIST ("8.0;9.0+PTX")."""
    return ";".join(DESCRIPTION["cuda_archs"])


def _has_nvcc(home):
    return bool(home) and os.path.isfile(os.path.join(home, "bin", "nvcc"))


def _find_cuda_home():
    """(the CUDA toolkit root or None, the settings passed over on the way: "CUDA_HOME=<dir>" for
    CUDA_HOME and CUDA_PATH each set to a directory without bin/nvcc)."""
    passed_over = []
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(var)
        if _has_nvcc(home):
            return home, passed_over
        if home:
            passed_over.append(f"{var}={home}")
    if _has_nvcc("/usr/local/cuda"):
        return "/usr/local/cuda", passed_over
    nvcc = shutil.which("nvcc")
    if nvcc:
        return os.path.dirname(os.path.dirname(os.path.realpath(nvcc))), passed_over
    return None, passed_over


def cuda_home():
    """The CUDA toolkit root, or None."""
    return _find_cuda_home()[0]


def _no_nvcc(passed_over):
    return f"{' and '.join(passed_over)} hold{'s' if len(passed_over) == 1 else ''} no bin/nvcc"


def cuda_home_note():
    """What the build output says when CUDA_HOME (or CUDA_PATH) names no toolkit, else None."""
    home, passed_over = _find_cuda_home()
    if not passed_over:
        return None
    where = f"using the CUDA toolkit at {home} instead" if home else "no other CUDA toolkit found"
    return f"{_no_nvcc(passed_over)}: {where}"


def _torch_version_file():
    """The names of the installed torch's torch/version.py ({} without one), read so that no
    torch import (seconds) is needed."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return {}
    path = os.path.join(list(spec.submodule_search_locations)[0], "version.py")
    scope = {}
    try:
        with open(path) as f:
            exec(compile(f.read(), path, "exec"), scope)
    except (OSError, SyntaxError, ImportError):
        return {}
    return scope


def torch_cuda_version():
    """torch.version.cuda of the installed torch (None for a CPU-only build)."""
    return _torch_version_file().get("cuda")


def _release(version):
    """(major, minor) of "2.14.1+cu130"."""
    return tuple(int(p) for p in re.findall(r"\d+", version)[:2])


def check_torch_for_build():
    """The sources need the stable ABI headers of torch_build_min or newer (what they compile
    against; the binaries still load in torch_target_version's torch). Older headers would fail
    mid-compile on a missing macro: say so before."""
    found, least = _torch_version_file().get("__version__"), DESCRIPTION["torch_build_min"]
    if found and _release(found) < _release(least):
        raise RuntimeError(f"rope_ext: building from source needs torch >= {least} (the stable ABI "
                           f"headers the sources compile against), found torch {found}; what it "
                           f"builds loads in torch >= 2.10: build the wheel with a newer torch "
                           f"and install it here")


def want_cuda():
    """(build the CUDA library?, why)."""
    forced = envs.CUDA
    if forced == "0":
        return False, "ROPE_EXT_CUDA=0"
    if envs.BUILD == "sanitize":
        return False, "sanitizer builds are CPU-only"
    (home, passed_over), tcuda = _find_cuda_home(), torch_cuda_version()
    bad = _no_nvcc(passed_over) if passed_over else ""
    missing = []
    if not _torch_version_file().get("__version__"):
        missing.append("torch is not installed")
    elif not tcuda:
        missing.append("torch is a CPU-only build")
    if not home:
        missing.append(f"no CUDA toolkit ({bad + '; ' if bad else ''}"
                       "set CUDA_HOME to one or install one at /usr/local/cuda)")
    if missing:
        if forced == "1":
            raise RuntimeError("ROPE_EXT_CUDA=1 but the CUDA library cannot be built: " + "; ".join(missing))
        return False, "; ".join(missing)
    return True, f"torch CUDA {tcuda}, toolkit {home}" + (f" ({bad}: passed over)" if bad else "")


def configure_environment():
    """Sets CUDA_HOME and TORCH_CUDA_ARCH_LIST for torch.utils.cpp_extension, which reads them
    at import (it would otherwise guess /usr/local from a stray nvcc and fail to link). A CUDA_HOME
    without nvcc is replaced by the toolkit found: torch would take it as it is, and fail at the
    first CUDA compile, where want_cuda() has promised a CUDA library."""
    check_torch_for_build()
    build, why = want_cuda()
    home, note = cuda_home(), cuda_home_note()
    if home:
        if note and build:
            print(f"rope_ext: {note}", file=sys.stderr)
        os.environ["CUDA_HOME"] = home
    if build:
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", cuda_arch_list())
    return build, why


if __name__ == "__main__":
    if sys.argv[1:] == ["--cuda-lib"]:
        if want_cuda()[0]:
            print(library_path("cuda"))
    elif sys.argv[1:] == ["--cuda-home"]:
        if cuda_home_note():
            print(f"rope_ext: {cuda_home_note()}", file=sys.stderr)
        print(cuda_home() or "")
    elif sys.argv[1:] == ["--native-cpu-flags"]:
        print(*native_cpu_flags())
    elif sys.argv[1:]:
        sys.exit(f"build_config.py: unknown arguments {' '.join(sys.argv[1:])} (one of --cuda-lib, "
                 "--cuda-home, --native-cpu-flags, or none: whether the CUDA library is built)")
    else:
        print(want_cuda())
