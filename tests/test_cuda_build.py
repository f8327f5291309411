"""The CUDA library is built and registers a CUDA kernel for every op, wherever setup.py builds
it (a CUDA build of torch plus a CUDA toolkit), GPU or not: this runs in CI, which has no GPU."""

import os
import subprocess
import sys

import pytest
import torch

import build_config
import rope_ext

from rope_ext._schemas import SCHEMAS  # noqa: E402

# Every op on tensors, including any added later (rope::cpu_isa reports the CPU build: no device).
OPS = [f"rope::{name}" for name, schema in SCHEMAS.items() if "Tensor" in schema]
# Ops with a CPU kernel alone: on CUDA their reference (torch ops, registered from Python) serves.
# Checked both ways below: an op listed here that gains a CUDA kernel fails until it leaves it.
CPU_KERNEL_ONLY = {"rope::qk_norm_rope_backward"}


def cuda_expected():
    build, why = build_config.want_cuda()
    if not build:
        pytest.skip(f"the CUDA library is not built here: {why}")
    if rope_ext._library.state.path is None:
        pytest.skip(f"native libraries disabled: {rope_ext._library.state.error}")


def test_cuda_library_registers_every_op():
    cuda_expected()
    state = rope_ext._library.state
    assert state.cuda_path, state.cuda_error
    assert os.path.basename(state.cuda_path).startswith("_C_cuda")
    for op in OPS:
        has_cuda = torch._C._dispatch_has_kernel_for_dispatch_key(op, "CUDA")
        assert has_cuda == (op not in CPU_KERNEL_ONLY), op
        assert torch._C._dispatch_has_kernel_for_dispatch_key(op, "CPU"), op
    assert rope_ext.backend("cuda") == "native"


def test_cuda_library_defines_no_schema():
    # The schemas live only in rope_ext._C: loading the CUDA library alone defines no op, so
    # the two libraries can never disagree about a schema.
    cuda_expected()
    lib = rope_ext._library.state.cuda_path
    code = (
        "import sys, torch\n"
        "torch.ops.load_library(sys.argv[1])  # alone: without rope_ext and its rope_ext._C\n"
        "print(torch._C._dispatch_dump('rope::apply'))\n"
    )
    res = subprocess.run([sys.executable, "-c", code, lib], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]
    dump = res.stdout
    assert "schema: (none)" in dump and "CUDA: registered at" in dump, dump
