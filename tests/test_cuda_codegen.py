"""The compiled CUDA code, read without a GPU: every kernel, for every arch the build targets
(csrc/build.json), uses no local memory (no stack frame, no register spills) and moves its
aligned vectors with 128-bit global loads and stores. Needs the CUDA toolkit's nvcc and ptxas
(skipped where they are missing)."""

import atexit
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
import build_config  # noqa: E402

HOME = build_config.cuda_home()
NVCC = os.path.join(HOME or "", "bin", "nvcc")
PTXAS = os.path.join(HOME or "", "bin", "ptxas")
pytestmark = pytest.mark.skipif(
    not (HOME and os.path.isfile(NVCC) and os.path.isfile(PTXAS)), reason="no CUDA toolkit"
)
ARCHS = [a.replace("+PTX", "").replace(".", "") for a in build_config.DESCRIPTION["cuda_archs"]]


def torch_include():
    import torch.utils.cpp_extension as ext

    return ext.include_paths()[0]


def _compile(arch, src, out, include):
    """(PTX text, ptxas -v report) of one source for one arch, with the library's own flags."""
    ptx = out / f"{os.path.basename(src)}.sm{arch}.ptx"
    cmd = [NVCC, "-ptx", f"-arch=compute_{arch}", *build_config.nvcc_flags(),
           *[f"-I{d}" for d in build_config.include_dirs()], f"-I{include}",
           os.path.join(ROOT, src), "-o", str(ptx)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    r = subprocess.run([PTXAS, f"-arch=sm_{arch}", "-O3", "-v", str(ptx), "-o",
                        str(ptx) + ".cubin"], check=True, capture_output=True, text=True)
    return ptx.read_text(), r.stderr + r.stdout


def start_compiles():
    """Every (arch, source) of the CUDA library (the host files, .cpp, hold no kernel) handed to
    a background nvcc + ptxas job, started by conftest.py when the run has collected these tests
    (which it runs last): the compiles, about a minute of CPU, run on one core while the rest of
    the suite mostly keeps the other busy. None where the toolkit is missing."""
    if not (HOME and os.path.isfile(NVCC) and os.path.isfile(PTXAS)):
        return None
    out = pathlib.Path(tempfile.mkdtemp(prefix="rope_ptx_"))
    atexit.register(shutil.rmtree, out, ignore_errors=True)
    _, _, sources = build_config.library("cuda")
    jobs = [(arch, src) for arch in ARCHS for src in sources if src.endswith(".cu")]
    include = torch_include()  # imported here, not in a worker thread
    pool = ThreadPoolExecutor(max_workers=1)
    atexit.register(pool.shutdown, wait=False, cancel_futures=True)
    return jobs, [pool.submit(_compile, arch, src, out, include) for arch, src in jobs]


_started = []  # the jobs conftest.py started, if it did


@pytest.fixture(scope="module")
def every_arch():
    """arch -> (PTX text, ptxas -v report) of the CUDA library's sources."""
    if not _started:  # (this file run without conftest.py's hook)
        _started.append(start_compiles())
    jobs, futures = _started[0]
    results = [f.result() for f in futures]
    return {arch: ("".join(p for (a, _), (p, _) in zip(jobs, results) if a == arch),
                   "\n".join(r for (a, _), (_, r) in zip(jobs, results) if a == arch))
            for arch in ARCHS}


@pytest.fixture(params=ARCHS)
def compiled(request, every_arch):
    """(PTX text, ptxas -v report) of the CUDA library's sources for one arch."""
    return every_arch[request.param]


def kernel_reports(report):
    """kernel name -> (stack frame bytes, spill store bytes, spill load bytes)."""
    found, name = {}, None
    for line in report.splitlines():
        m = re.search(r"Compiling entry function '([^']+)'", line)
        if m:
            name = m.group(1)
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and name:
            found[name] = tuple(int(v) for v in m.groups())
    return found


def kernel_bodies(ptx):
    """kernel name -> its PTX."""
    parts = re.split(r"\n(?:\.visible |\.weak )?\.entry ", ptx)
    return {p.split("(", 1)[0].strip(): p for p in parts[1:]}


def test_no_kernel_uses_local_memory(compiled):
    _, report = compiled
    kernels = kernel_reports(report)
    # rotate: 4 dtypes x 2 layouts, plus float16/bfloat16 x with tables of their own dtype;
    # cache: 4 dtypes, plus the same two; the slot set of apply_and_cache_
    assert len(kernels) >= 19, report
    # K-shift: float, double, half, bfloat16 and float8 caches.
    assert sum("shift_kernel" in k for k in kernels) == 5, report
    bad = {k: v for k, v in kernels.items() if v != (0, 0, 0)}
    assert not bad, f"stack frame / spill stores / spill loads: {bad}"


def test_aligned_path_moves_128_bit_global_vectors(compiled):
    ptx, _ = compiled
    bodies = kernel_bodies(ptx)
    assert len(bodies) >= 18
    for name, body in bodies.items():
        if "slot_set" in name or "shift_kernel" in name:  # one 8-byte slot per thread, read and
            # hashed; K-shift: scalar by design (kv_shift/cuda/thread.h). Nothing to vectorize.
            continue
        loads = re.findall(r"ld\.global(?:\.ca)?\.v4\.u32", body)
        stores = re.findall(r"st\.global(?:\.wb)?\.v4\.u32", body)
        assert loads and stores, f"{name}: no 128-bit global load/store"
        # Every vector access is a global one (not a generic access resolved at run time).
        generic = re.findall(r"\b(?:ld|st)\.v[24]\.", body)
        assert not generic, f"{name}: generic vector accesses {sorted(set(generic))}"
