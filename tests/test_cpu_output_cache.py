"""Large CPU outputs of rope.apply / rope.apply_backward come from a cache of recycled blocks
(csrc/ops/cpu/cpu_output_cache.cpp): a recycled block must be overwritten completely, a block
still viewed by any tensor must never be handed out again, and the limit and the off switch
must hold."""

import os
import subprocess
import sys
import threading

import pytest
import torch

import rope_ext
from conftest import ROOT, assert_close
from rope_oracle import rope

native = pytest.mark.skipif(rope_ext.backend("cpu") != "native", reason="native library not built")
cache_on = pytest.mark.skipif(
    not rope_ext.cpu_cache_info()["available"], reason="torch has no torch_from_blob (< 2.11)"
)

MIB = 1 << 20
# [512, 32, 128] float32 = 8 MiB: under the cache's 16 MiB floor; [1024, ...] = 16 MiB: over it.
SMALL, LARGE = 512, 1024


def case(tokens, dtype=torch.float32, interleaved=False):
    x = torch.randn(tokens, 32, 128, dtype=dtype)
    theta = torch.rand(tokens, 1, 64, dtype=torch.float64) * 100
    return x, theta.cos().float(), theta.sin().float()


def stats():
    return rope_ext.cpu_cache_info()


@native
def test_info_reports_fields_and_default_limit():
    info = stats()
    assert set(info) == {"limit_bytes", "cached_bytes", "cached_blocks", "reuses", "new_blocks",
                         "available"}
    if "ROPE_EXT_CPU_CACHE_MB" not in os.environ:
        assert info["limit_bytes"] == 1024 * MIB
    assert isinstance(info["available"], bool)


@native
@cache_on
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("interleaved", [False, True])
def test_recycled_block_is_overwritten_completely(dtype, interleaved):
    tokens = LARGE * 4 // torch.empty((), dtype=dtype).element_size()
    rope_ext.empty_cpu_cache()
    with torch.inference_mode():
        x, cos, sin = case(tokens, dtype)
        first = torch.ops.rope.apply(x, cos, sin, interleaved)
        ptr = first.data_ptr()
        first.fill_(float("nan"))  # what the next output finds in the block
        del first
        assert stats()["cached_blocks"] == 1
        before = stats()["reuses"]
        x2, cos2, sin2 = case(tokens, dtype)
        y = torch.ops.rope.apply(x2, cos2, sin2, interleaved)
        assert stats()["reuses"] == before + 1
        assert y.data_ptr() == ptr
        assert y.shape == x2.shape and y.dtype == dtype and y.is_contiguous()
        assert not y.isnan().any()
        assert_close(y, rope(x2, cos2, sin2, interleaved), dtype)
        # The same bits as a fresh buffer: nothing of the block's old contents survives.
        out = torch.full_like(x2, float("nan"))
        torch.ops.rope.apply.out(x2, cos2, sin2, interleaved, out=out)
        assert torch.equal(y, out)


@native
@cache_on
def test_backward_outputs_use_the_cache_and_stay_correct():
    rope_ext.empty_cpu_cache()
    x, cos, sin = case(LARGE)
    g = torch.ops.rope.apply_backward(x, cos, sin, False)
    g.fill_(float("nan"))
    ptr = g.data_ptr()
    del g
    g = torch.ops.rope.apply_backward(x, cos, sin, False)
    assert g.data_ptr() == ptr
    assert_close(g, rope(x, cos, sin, False, inverse=True), torch.float32)


@native
@cache_on
def test_a_block_viewed_by_a_live_tensor_is_not_handed_out():
    rope_ext.empty_cpu_cache()
    x, cos, sin = case(LARGE)
    y = torch.ops.rope.apply(x, cos, sin)
    view = y[3:, 5]  # shares y's storage, not y itself
    expected = view.clone()
    ptr = y.data_ptr()
    del y
    assert stats()["cached_blocks"] == 0  # the view keeps the block
    z = torch.ops.rope.apply(x.neg(), cos, sin)
    assert z.data_ptr() != ptr
    assert torch.equal(view, expected)
    del view
    assert stats()["cached_blocks"] == 1  # back once its last user died


@native
@cache_on
def test_small_outputs_do_not_use_it():
    rope_ext.empty_cpu_cache()
    before = stats()
    x, cos, sin = case(SMALL)
    y = torch.ops.rope.apply(x, cos, sin)
    del y
    after = stats()
    assert (after["reuses"], after["new_blocks"], after["cached_blocks"]) == (
        before["reuses"], before["new_blocks"], 0)


@native
@cache_on
def test_empty_frees_what_no_tensor_uses():
    x, cos, sin = case(LARGE)
    a = torch.ops.rope.apply(x, cos, sin)
    b = torch.ops.rope.apply(x, cos, sin)
    del a
    assert stats()["cached_bytes"] >= 16 * MIB
    rope_ext.empty_cpu_cache()
    assert stats()["cached_bytes"] == 0 and stats()["cached_blocks"] == 0
    assert_close(b, rope(x, cos, sin, False), torch.float32)  # live outputs are untouched
    del b
    assert stats()["cached_blocks"] == 1


@native
@cache_on
def test_concurrent_calls_and_frees_from_many_threads():
    rope_ext.empty_cpu_cache()
    errors = []

    def worker():
        try:
            for _ in range(6):
                x, cos, sin = case(LARGE)
                y = torch.ops.rope.apply(x, cos, sin)
                y2 = torch.ops.rope.apply(y, cos, sin)
                assert_close(y2, rope(rope(x, cos, sin, False), cos, sin, False), torch.float32)
                del y, y2
        except Exception as e:  # reported below, on the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    assert stats()["reuses"] > 0


def run_python(code, **env):
    full_env = dict(os.environ)
    full_env.update(env)
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=full_env,
                          capture_output=True, text=True, timeout=300)


SNIPPET = """
import torch, rope_ext
x = torch.randn(1024, 32, 128); cos = torch.rand(1024, 1, 64); sin = torch.rand(1024, 1, 64)
for _ in range(3):
    y = torch.ops.rope.apply(x, cos, sin); del y
y = [torch.ops.rope.apply(x, cos, sin) for _ in range(3)]; del y
i = rope_ext.cpu_cache_info()
print(i["limit_bytes"], i["cached_bytes"], i["reuses"], i["new_blocks"])
"""


@native
@cache_on
def test_limit_zero_turns_it_off():
    r = run_python(SNIPPET, ROPE_EXT_CPU_CACHE_MB="0")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["0", "0", "0", "0"]


@native
@cache_on
def test_limit_caps_what_is_kept():
    # Three 16 MiB blocks freed together; a 40 MiB limit keeps two (the oldest one is freed).
    r = run_python(SNIPPET, ROPE_EXT_CPU_CACHE_MB="40")
    assert r.returncode == 0, r.stderr
    limit, cached, reuses, new = map(int, r.stdout.split())
    assert limit == 40 * MIB
    assert cached == 32 * MIB
    assert reuses >= 2 and new == 3


@native
@pytest.mark.parametrize("bad", ["-1", "lots", "1.5"])
def test_bad_limit_is_a_clear_error(bad):
    r = run_python(SNIPPET, ROPE_EXT_CPU_CACHE_MB=bad)
    assert r.returncode != 0
    assert "ROPE_EXT_CPU_CACHE_MB" in r.stderr and bad in r.stderr


def test_reference_backend_reports_no_cache():
    r = run_python("import rope_ext; print(rope_ext.cpu_cache_info())", ROPE_EXT_BACKEND="reference")
    assert r.returncode == 0, r.stderr
    assert "'available': False" in r.stdout and "'limit_bytes': 0" in r.stdout


@native
@cache_on
def test_cached_outputs_through_autograd_and_compile():
    # Outputs and gradients from recycled blocks behave like any tensor: accumulated into
    # x.grad over several backward passes, and consumed by an Inductor graph.
    x, cos, sin = case(LARGE)
    x.requires_grad_(True)
    before = stats()["reuses"]
    for _ in range(3):
        y = rope_ext.apply_rope(x, cos, sin)
        (y * y.detach()).sum().backward()
    assert stats()["reuses"] > before
    y64 = rope(x.detach(), cos, sin, False)
    assert_close(x.grad, 3 * rope(y64, cos, sin, False, inverse=True), torch.float32)

    f = torch.compile(lambda a: (torch.ops.rope.apply(a, cos, sin) * 2 + 1).sum(-1), fullgraph=True)
    with torch.no_grad():
        for _ in range(2):
            out = f(x.detach())
    torch.testing.assert_close(out.double(), (2 * y64 + 1).sum(-1), rtol=1e-5, atol=1e-3)


@native
@cache_on
def test_a_forked_child_has_a_working_cache_of_its_own():
    # os.fork directly (the inherited tensors need no pickling); the child reports by exit code.
    x, cos, sin = case(LARGE)
    expected = rope(x, cos, sin, False)
    kept = torch.ops.rope.apply(x, cos, sin)  # inherited by the child and freed there
    torch.ops.rope.apply(x, cos, sin)  # a block the parent's cache keeps
    pid = os.fork()
    if pid == 0:  # the child: never return into pytest
        code = 1
        try:
            torch.set_num_threads(1)  # as DataLoader workers do: the OpenMP pool does not survive fork
            del kept  # its block joins the child's (fresh) cache
            y = torch.ops.rope.apply(x, cos, sin)
            info = rope_ext.cpu_cache_info()
            good = bool(torch.allclose(y.double(), expected, rtol=1e-6, atol=1e-6))
            code = 0 if good and info["reuses"] == 1 and info["new_blocks"] == 0 else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
