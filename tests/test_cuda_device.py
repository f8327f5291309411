"""The CUDA kernels on a GPU (skipped where torch sees none; `make gpu-check` runs them).

Against the float64 reference for every op, dtype, layout and partial rotary, on strided views
and GQA; outputs poisoned so that every element is proven written; CUDA graph capture; a
non-default stream; out-of-range positions (a device-side assert, checked in a child process);
autograd, opcheck and torch.compile on CUDA; the positions op, MRoPE and the KV-cache write; the
serving prologue (QK-norm + RoPE + paged KV write) in place and out of place against the CPU
kernels; and a tensor past 2^31 elements (64-bit indexing) where memory allows.

Where torch sees no GPU, the tests that need none (the comparisons with the reference and with
the CPU kernels) run on the CPU: few runs have a GPU, and a test that fell out of step with the
API would otherwise first fail there.
"""

import os
import subprocess
import sys

import pytest
import torch

import rope_ext
from cuda_testing import (DTYPES, TOL, assert_close, fused_qkv, reference_apply, reference_apply_,
                          tables)

ON_GPU = torch.cuda.is_available()
DEV = "cuda" if ON_GPU else "cpu"
needs_gpu = pytest.mark.skipif(not ON_GPU, reason="no CUDA GPU")
LAYOUTS = [False, True]


@pytest.fixture(autouse=True)
def native_cuda():
    assert not ON_GPU or rope_ext.backend(DEV) == "native", (
        f"the CUDA kernels are not loaded: {rope_ext._library.state.cuda_error}"
    )


def poison_allocator(nbytes=64 << 20):
    """Leaves NaN bytes in the caching allocator's free blocks, so a fresh output that a kernel
    forgets to write shows up as NaN. (On the CPU, a no-op: those tests poison their own.)"""
    if not ON_GPU:
        return
    torch.empty(nbytes // 4, dtype=torch.float32, device=DEV).fill_(float("nan"))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("interleaved", LAYOUTS, ids=["half_split", "interleaved"])
@pytest.mark.parametrize("inverse", [False, True], ids=["apply", "apply_backward"])
def test_apply_matches_reference(dtype, interleaved, inverse):
    op = torch.ops.rope.apply_backward if inverse else torch.ops.rope.apply
    S = 37
    for head_dim, rot in [(64, 64), (80, 80), (96, 32), (128, 128), (256, 64), (100, 26)]:
        x = torch.randn(3, S, 5, head_dim, dtype=dtype, device=DEV)
        cos, sin = tables(torch.arange(S, device=DEV).view(1, S, 1), rot, device=DEV)
        views = [
            ("contiguous", x),
            ("bhsd_view", x.transpose(1, 2)),
            ("last_dim_stride_2", torch.randn(3, S, 5, 2 * head_dim, dtype=dtype, device=DEV)[..., ::2]),
        ]
        for name, xv in views:
            c, s = (cos.transpose(1, 2), sin.transpose(1, 2)) if name == "bhsd_view" else (cos, sin)
            poison_allocator()
            out = op(xv, c, s, interleaved)
            assert not out.isnan().any(), name
            assert_close(out, reference_apply(xv, c, s, interleaved, inverse), dtype)
            assert torch.equal(out[..., rot:], xv[..., rot:]), name


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("interleaved", LAYOUTS, ids=["half_split", "interleaved"])
def test_apply_inplace_gqa_matches_reference(dtype, interleaved):
    for head_dim, rot in [(64, 64), (128, 128), (96, 32), (80, 26)]:
        for pos_dtype, lead in [(torch.int64, ()), (torch.int32, (2,))]:
            q, k = fused_qkv(57, 8, 2, head_dim, dtype, device=DEV, lead=lead)
            positions = torch.randint(0, 1000, (*lead, 57), dtype=pos_dtype, device=DEV)
            cache = rope_ext.cos_sin_cache(1000, rot, device=DEV)
            want_q, want_k = reference_apply_(q, k, positions, cache, interleaved)
            q0, k0 = q.clone(), k.clone()
            torch.ops.rope.apply_(q, k, positions, cache, interleaved)
            assert_close(q, want_q, dtype)
            assert_close(k, want_k, dtype)
            assert torch.equal(q[..., rot:], q0[..., rot:]) and torch.equal(k[..., rot:], k0[..., rot:])


def test_apply_inplace_key_none_and_table_dtypes():
    q = torch.randn(33, 4, 128, dtype=torch.bfloat16, device=DEV)
    positions = torch.randint(0, 64, (33,), device=DEV)
    for cache_dtype in (torch.float32, torch.float64, torch.bfloat16):
        cache = rope_ext.cos_sin_cache(64, 128, dtype=cache_dtype, device=DEV)
        qq = q.clone()
        torch.ops.rope.apply_(qq, None, positions, cache, False)
        assert_close(qq, reference_apply_(q, None, positions, cache, False)[0], torch.bfloat16)


def test_matches_cpu_kernels():
    x = torch.randn(4, 9, 6, 128, dtype=torch.float32)
    cos, sin = tables(torch.arange(9).view(1, 9, 1), 96)
    out = torch.ops.rope.apply(x.to(DEV), cos.to(DEV), sin.to(DEV), False).cpu()
    torch.testing.assert_close(out, torch.ops.rope.apply(x, cos, sin, False), rtol=1e-6, atol=1e-6)


@needs_gpu
def test_cuda_graph_capture_and_replay():
    q, k = fused_qkv(64, 8, 2, 128, torch.bfloat16, device=DEV)
    positions = torch.arange(64, device=DEV)
    cache = rope_ext.cos_sin_cache(4096, 128, device=DEV)
    x = torch.randn(64, 8, 128, dtype=torch.bfloat16, device=DEV)
    cos, sin = tables(torch.arange(64, device=DEV).view(64, 1), 128, device=DEV)
    # warm up on a side stream, as torch.cuda.graph expects
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        torch.ops.rope.apply(x, cos, sin, False)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.rope.apply(x, cos, sin, False)
        torch.ops.rope.apply_(q, k, positions, cache, False)
    for _ in range(2):  # replay with new data in the captured buffers
        x.copy_(torch.randn_like(x))
        q.copy_(torch.randn_like(q))
        k.copy_(torch.randn_like(k))
        positions.copy_(torch.randint(0, 4096, (64,), device=DEV))
        want_q, want_k = reference_apply_(q, k, positions, cache, False)
        graph.replay()
        torch.cuda.synchronize()
        assert_close(out, reference_apply(x, cos, sin, False), torch.bfloat16)
        assert_close(q, want_q, torch.bfloat16)
        assert_close(k, want_k, torch.bfloat16)


@needs_gpu
def test_non_default_stream():
    x = torch.randn(2048, 32, 128, dtype=torch.float32, device=DEV)
    cos, sin = tables(torch.arange(2048, device=DEV).view(2048, 1), 128, device=DEV)
    cache = rope_ext.cos_sin_cache(2048, 128, device=DEV)
    positions = torch.arange(2048, device=DEV)
    want = reference_apply(x, cos, sin, False)
    y = torch.full_like(x, float("nan"))
    q = torch.full_like(x, float("nan"))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        # s is held up, then fills y and q: a kernel that ran on another stream would read NaN
        torch.cuda._sleep(2_000_000)
        y.copy_(x)
        q.copy_(x)
        out = torch.ops.rope.apply(y, cos, sin, False)
        torch.ops.rope.apply_(q, None, positions, cache, False)
        done = torch.cuda.Event()
        done.record(s)
    done.synchronize()
    assert_close(out, want, torch.float32)
    assert_close(q, want, torch.float32)


@needs_gpu
def test_other_device_index_guard():
    if torch.cuda.device_count() < 2:
        pytest.skip("one GPU")
    x = torch.randn(8, 4, 64, device="cuda:1")  # tables [8, 1, 32]
    cos, sin = tables(torch.arange(8, device="cuda:1").view(8, 1), 64, device="cuda:1")
    out = torch.ops.rope.apply(x, cos, sin, False)
    assert out.device == x.device
    assert_close(out, reference_apply(x, cos, sin, False), torch.float32)


TRAP = """
import sys, torch, rope_ext
q = torch.randn(16, 4, 64, device="cuda")
cache = rope_ext.cos_sin_cache(32, 64, device="cuda")
positions = torch.randint(0, 32, (16,), device="cuda")
positions[int(sys.argv[1])] = int(sys.argv[2])
rope_ext.apply_rope_(q, None, positions, cache)
torch.cuda.synchronize()
print("NO TRAP")
"""


@needs_gpu
@pytest.mark.parametrize("bad", [-5, 32])
def test_out_of_range_position_is_a_device_side_assert(bad):
    # A device-side assert leaves the CUDA context unusable, so it runs in a child process.
    res = subprocess.run([sys.executable, "-c", TRAP, "7", str(bad)], capture_output=True,
                         text=True, timeout=300, env=dict(os.environ))
    assert res.returncode != 0 and "NO TRAP" not in res.stdout
    assert "device-side assert" in res.stderr or "positions must lie in" in res.stderr, res.stderr[-3000:]


def test_positions_mrope_and_cache_write_match_reference():
    for dtype in DTYPES:
        for interleaved in LAYOUTS:
            x = torch.randn(40, 8, 128, dtype=dtype, device=DEV)
            cache = rope_ext.cos_sin_cache(512, 96, device=DEV)
            pos = torch.randint(0, 512, (40,), device=DEV)
            mpos = torch.randint(0, 512, (3, 40), device=DEV)
            c, s = cache[:, :48], cache[:, 48:]
            for section, p in ((None, pos), ([16, 16, 16], mpos)):
                for mi in (False, True) if section else (False,):
                    out = rope_ext.apply_rope_at(x, p, cache, interleaved=interleaved,
                                                 mrope_section=section, mrope_interleaved=mi)
                    want = rope_ext.reference.apply_positions(
                        x.double(), p, c.double(), s.double(), interleaved=interleaved,
                        mrope_section=section, mrope_interleaved=mi)
                    assert_close(out, want, dtype)
            for fmt, cdt in (("auto", dtype), ("fp8_e4m3", torch.float8_e4m3fn)):
                q, k, v = (torch.randn(40, h, 128, dtype=dtype, device=DEV) for h in (8, 2, 2))
                kc = torch.zeros(8, 16, 2, 128, device=DEV).to(cdt)
                vc = torch.zeros(8, 16, 2, 128, device=DEV).to(cdt)
                slots = torch.randperm(128, device=DEV)[:40]
                slots[::5] = -1
                scales = (torch.tensor([0.5], device=DEV), torch.tensor([2.0], device=DEV))
                scales = scales if fmt != "auto" else (None, None)
                ref = [t.clone() for t in (q, k, v, pos, cache, kc, vc, slots)]
                rope_ext.apply_rope_and_cache_(q, k, v, pos, cache, kc, vc, slots, interleaved=interleaved,
                                               kv_cache_dtype=fmt, k_scale=scales[0], v_scale=scales[1])
                rope_ext.reference.apply_and_cache_(*ref, interleaved=interleaved, kv_cache_dtype=fmt,
                                                    k_scale=scales[0], v_scale=scales[1])
                assert_close(q, ref[0], dtype)
                assert_close(k, ref[1], dtype)
                assert_close(kc.float(), ref[5].float(), dtype)
                assert_close(vc.float(), ref[6].float(), dtype)


@needs_gpu
def test_module_forward_captures_in_a_cuda_graph():
    rope_mod = rope_ext.RotaryEmbedding(128, max_position=4096).to(DEV)
    q = torch.randn(64, 8, 128, device=DEV, requires_grad=False)
    positions = torch.arange(64, device=DEV)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        rope_mod(q, None, positions)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # no host-device sync inside: capture succeeds
        out, _ = rope_mod(q, None, positions)
    positions.copy_(torch.randint(0, 4096, (64,), device=DEV))
    graph.replay()
    torch.cuda.synchronize()
    assert_close(out, rope_mod(q, None, positions)[0], torch.float32)


@needs_gpu  # (on the CPU: test_autograd_compile.py; this one's compile takes 45 s there)
def test_autograd_opcheck_and_compile():
    x = torch.randn(2, 16, 4, 64, dtype=torch.float64, device=DEV, requires_grad=True)
    cos, sin = tables(torch.arange(16, device=DEV).view(1, 16, 1), 64, dtype=torch.float64, device=DEV)
    cos.requires_grad_()
    sin.requires_grad_()
    torch.autograd.gradcheck(lambda a, c, s: torch.ops.rope.apply(a, c, s, False), (x, cos, sin))
    torch.library.opcheck(torch.ops.rope.apply.default, (x.detach(), cos.detach(), sin.detach(), True))
    q, k = fused_qkv(16, 4, 2, 64, torch.float32, device=DEV)
    torch.library.opcheck(
        torch.ops.rope.apply_.default,
        (q.clone(), k.clone(), torch.arange(16, device=DEV), rope_ext.cos_sin_cache(16, 64, device=DEV), False),
    )
    f = torch.compile(lambda a, c, s: torch.ops.rope.apply(a, c, s, False) * 2, fullgraph=True)
    xd = x.detach().float()
    assert_close(f(xd, cos.detach(), sin.detach()), reference_apply(xd, cos, sin, False) * 2, torch.float32)


@needs_gpu
def test_more_than_2_pow_31_elements():
    # 64-bit indexing: a bf16 x of 2^31 + 2^20 elements (4.3 GB) and its output.
    free, _ = torch.cuda.mem_get_info()
    if free < 12 << 30:
        pytest.skip("needs 12 GB of free GPU memory")
    rows = (2**31 + 2**20) // 128
    x = torch.empty(rows, 128, dtype=torch.bfloat16, device=DEV).normal_()
    cache = rope_ext.cos_sin_cache(8192, 128, device=DEV)
    cos, sin = cache[:, :64], cache[:, 64:]
    # one table row per 4096 rows: broadcast through a [rows/4096, 1, 64] view
    xv = x.view(rows // 4096, 4096, 128)  # (tables [rows/4096, 1, 64]: three dims, as xv)
    c, s = cos[: rows // 4096].unsqueeze(1), sin[: rows // 4096].unsqueeze(1)
    out = torch.ops.rope.apply(xv, c, s, False)
    for lo in (0, rows // 4096 - 1):  # first and last blocks of rows (past 2^31 elements)
        assert_close(out[lo], reference_apply(xv[lo], c[lo], s[lo], False), torch.bfloat16)
    del out
    positions = (torch.arange(rows, device=DEV) % 4096).view(rows // 4096, 4096)
    q = xv.view(rows // 4096, 4096, 1, 128)
    tail_before = q[-1].clone()
    torch.ops.rope.apply_(q, None, positions, cache, False)
    want = reference_apply_(tail_before, None, positions[-1], cache, False)[0]
    assert_close(q[-1], want, torch.bfloat16)


def prologue_on(device, a, form, kw):
    """The serving prologue of `form` on a copy of case `a` (test_qk_norm_cache.make_case, q, k
    and v views of one qkv buffer) moved to `device`, the views rebuilt there; returns the
    results (query, key, value, key_cache, value_cache) on the CPU."""
    from test_qk_norm_cache import POSITIONAL
    qkv = a["query"]._base
    hq, hk, d = a["query"].shape[1], a["key"].shape[1], a["query"].shape[2]
    b = {n: (t.to(device) if isinstance(t, torch.Tensor) else t) for n, t in a.items()}
    base = qkv.to(device)
    b["query"] = base[:, : hq * d].unflatten(1, (hq, d))
    b["key"] = base[:, hq * d : (hq + hk) * d].unflatten(1, (hk, d))
    b["value"] = base[:, (hq + hk) * d :].unflatten(1, (hk, d))
    args = [b[n] for n in POSITIONAL]
    rest = {n: v for n, v in b.items() if n not in POSITIONAL}
    if form == "in_place":
        rope_ext.qk_norm_rope_and_cache_(*args, **rest, **kw)
        out = (b["query"], b["key"], b["value"])
    else:
        if device == DEV:
            poison_allocator()
        before = base.clone()
        out = rope_ext.qk_norm_rope_and_cache(*args, **rest, **kw)
        assert torch.equal(base, before), "qkv written out of place"
    return [t.cpu() for t in (*out, b["key_cache"], b["value_cache"])]


def test_qk_norm_prologue_matches_the_cpu_kernels():
    """rope.qk_norm_rope_and_cache_ and rope.qk_norm_rope_and_cache on the GPU against the CPU
    kernels (tested against float64 in test_qk_norm_cache.py): bf16 and fp32, bf16 and fp8
    caches, v_norm, MRoPE, padding slots, q/k/v views of one qkv buffer; the out-of-place outputs
    from a NaN-poisoned allocator, the caches NaN-poisoned (every row written or kept)."""
    from test_qk_norm_cache import make_case
    for dtype in (torch.bfloat16, torch.float32):
        for fmt in ("auto", "fp8_e4m3"):
            for v_norm, mrope in ((False, None), (True, True)):
                a = make_case(T=9, hq=4, hk=2, D=128, dtype=dtype, fmt=fmt, mrope=mrope)
                kw = dict(eps=1e-6, v_norm=v_norm,
                          mrope_section=[16, 24, 24] if mrope else None)
                for form in ("in_place", "out_of_place"):
                    got = prologue_on(DEV, a, form, kw)
                    want = prologue_on("cpu", a, form, kw)
                    for x, y in zip(got, want):
                        if x.element_size() == 1:  # float8 codes: within one step
                            torch.testing.assert_close(x.float(), y.float(), rtol=0.13,
                                                       atol=1e-3, equal_nan=True)
                        else:  # (the caches' unwritten rows: NaN on both)
                            # two float32 results, each within TOL of the exact one: within
                            # twice TOL of each other (sums of squares in different orders;
                            # a seed found 1.9e-6 apart at 0.21)
                            rtol, atol = (2 * t for t in TOL[dtype])
                            torch.testing.assert_close(x.double(), y.double(), rtol=rtol,
                                                       atol=atol, equal_nan=True)
