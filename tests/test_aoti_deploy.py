"""Production inference without Python (docs/deployment.md): torch.export of a small block that
calls torch.ops.rope.apply_positions and torch.ops.rope.apply_, AOTInductor-compiled to a .pt2
package, then run from C++ (tests/cpp/aoti_runner.cpp) that dlopens the CMake-built op library
and loads the package with torch::inductor::AOTIModelPackageLoader; its outputs are compared
with eager PyTorch. `make cmake-test` builds the library and the runner and sets
ROPE_EXT_CMAKE_LIB and ROPE_EXT_AOTI_RUNNER; elsewhere this is skipped."""

import os
import subprocess

import pytest
import torch

import build_config
import rope_ext
from conftest import assert_close

LIB = os.environ.get("ROPE_EXT_CMAKE_LIB")
RUNNER = os.environ.get("ROPE_EXT_AOTI_RUNNER")
DTYPE_NAMES = {torch.float32: "float32", torch.float64: "float64", torch.float16: "float16",
               torch.bfloat16: "bfloat16", torch.int32: "int32", torch.int64: "int64"}

pytestmark = pytest.mark.skipif(not (LIB and RUNNER), reason="ROPE_EXT_CMAKE_LIB and ROPE_EXT_AOTI_RUNNER "
                                                          "not set (run `make cmake-test`)")


class Block(torch.nn.Module):
    """Attention's RoPE step as a deployed model has it: the query rotated out of place by
    gathered cos/sin (rope.apply_positions), the key projected and rotated in place (rope.apply_),
    the tables buffers baked into the package."""

    def __init__(self, head_dim, max_position):
        super().__init__()
        cache = rope_ext.cos_sin_cache(max_position, head_dim)
        self.register_buffer("cos_sin_cache", cache)
        self.register_buffer("cos", cache[:, : head_dim // 2].contiguous())
        self.register_buffer("sin", cache[:, head_dim // 2 :].contiguous())

    def forward(self, q, k, positions):
        q = torch.ops.rope.apply_positions(q, positions, self.cos, self.sin, False, False, None, False)
        k = k * 2.0
        torch.ops.rope.apply_(q, k, positions, self.cos_sin_cache, True)
        return q, k


def _write_inputs(io_dir, inputs):
    with open(os.path.join(io_dir, "inputs.txt"), "w") as manifest:
        for i, t in enumerate(inputs):
            manifest.write(f"in{i} {DTYPE_NAMES[t.dtype]} {t.dim()} {' '.join(map(str, t.shape))}\n")
            t.contiguous().numpy().tofile(os.path.join(io_dir, f"in{i}.bin"))


def _read_outputs(io_dir):
    names = {v: k for k, v in DTYPE_NAMES.items()}
    outputs = []
    with open(os.path.join(io_dir, "outputs.txt")) as desc:
        for line in desc:
            name, dtype, ndim, *sizes = line.split()
            assert int(ndim) == len(sizes)
            data = torch.from_file(os.path.join(io_dir, f"{name}.bin"), size=0 if not sizes else
                                   torch.Size(map(int, sizes)).numel(), dtype=names[dtype])
            outputs.append(data.view(*map(int, sizes)))
    return outputs


def test_aoti_package_runs_from_cpp_with_the_cmake_library(tmp_path):
    build_config.configure_environment()  # the toolkit AOTInductor's compiler step looks for
    model = Block(head_dim=64, max_position=128)
    q, k = torch.randn(7, 4, 64), torch.randn(7, 2, 64)
    positions = torch.randint(0, 128, (7,))
    tokens = torch.export.Dim("tokens", min=1, max=4096)  # the batch size varies per call
    exported = torch.export.export(model, (q, k, positions), dynamic_shapes=(
        {0: tokens}, {0: tokens}, {0: tokens}))
    package = torch._inductor.aoti_compile_and_package(exported, package_path=str(tmp_path / "rope.pt2"))
    # Fresh inputs, another token count: nothing of the example is baked in.
    q, k = torch.randn(11, 4, 64), torch.randn(11, 2, 64)
    positions = torch.randint(0, 128, (11,))
    want = model(q.clone(), k.clone(), positions)
    io_dir = tmp_path / "io"
    io_dir.mkdir()
    _write_inputs(str(io_dir), (q, k, positions))
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROPE_EXT_")}
    env.pop("PYTHONPATH", None)
    result = subprocess.run([os.path.abspath(RUNNER), package, str(io_dir), os.path.abspath(LIB)],
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    got = _read_outputs(str(io_dir))
    assert len(got) == 2
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert_close(g, w, torch.float32)
