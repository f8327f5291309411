"""Fused QK-RMSNorm + RoPE (rope.qk_norm_rope, rope.qk_norm_rope_, rope.qkv_norm_rope_): results
against an independent float64 computation, the native and reference paths against each other,
gradients (gradcheck, and equal to the unfused eager computation's), errors (same on both
paths, nothing written), opcheck and torch.compile."""

import pytest
import torch

import rope_ext
from rope_ext._qk_norm import reference
from rope_ext.qk_norm import qk_norm_rope, qk_norm_rope_, qkv_norm_rope_

from conftest import native_cpu, poison_like
from tolerances import DTYPES, TOL

ops = torch.ops.rope
# float32 norms sum head_dim squares: a few float32 roundings more than a rotation alone.
TOLS = {**TOL, torch.float32: (1e-5, 1e-5)}


def close(actual, expected, dtype):
    rtol, atol = TOLS[dtype]
    torch.testing.assert_close(actual.double(), expected.double(), rtol=rtol, atol=atol)


def oracle(x, w, cos, sin, eps, unit_offset, interleaved):
    """float64: x / sqrt(mean(x^2) + eps) * w (or 1 + w), then the first 2 * cos.size(-1) dims
    rotated by (cos, sin) (..., rotary_dim/2, broadcast)."""
    x = x.double()
    w = w.double() + (1.0 if unit_offset else 0.0)
    return rotated(x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w, cos, sin, interleaved)


def rotated(y, cos, sin, interleaved):
    """float64: the first 2 * cos.size(-1) dims of y rotated by (cos, sin) (..., rotary_dim/2,
    broadcast), the rest as they are."""
    half = cos.shape[-1]
    c, s = cos.double(), sin.double()
    ia = torch.arange(half) * 2 if interleaved else torch.arange(half)
    ib = ia + 1 if interleaved else ia + half
    a, b = y[..., ia], y[..., ib]
    out = y.clone()
    out[..., ia] = a * c - b * s
    out[..., ib] = b * c + a * s
    return out


def gathered(cache, positions, section=None, mrope_interleaved=False):
    """cos/sin rows (..., 1, rotary_dim/2) each token of a positions-indexed op reads."""
    cos, sin = rope_ext.reference.cache_halves(cache)
    return rope_ext.reference.gather_tables(positions, cos, sin, section, mrope_interleaved)


def packed_case(T, Hq, Hk, Hv, D, dtype, max_position, rotary_dim, wk_dtype=None,
                table_dtype=torch.float32, pos_dtype=torch.int32):
    """A packed (T, (Hq + Hk + Hv) * D) qkv and a copy of it, q and k weights (D,), a
    (max_position, rotary_dim) cos_sin_cache and positions (T,), all random."""
    qkv = torch.randn(T, (Hq + Hk + Hv) * D, dtype=dtype)
    wq, wk = torch.randn(D, dtype=dtype), torch.randn(D, dtype=wk_dtype or dtype)
    cache = torch.randn(max_position, rotary_dim, dtype=table_dtype)
    return (qkv, qkv.clone(), wq, wk, cache,
            torch.randint(0, max_position, (T,), dtype=pos_dtype))


def check_packed(qkv, before, Hq, Hk, wq, wk, c, s, unit_offset, interleaved, dtype):
    """A packed (T, (Hq + Hk + Hv) * D) qkv, normed and rotated in place from `before`: q and k
    against the oracle (eps 1e-6), v untouched."""
    T, D = qkv.shape[0], wq.shape[0]
    q0 = before[:, : Hq * D].view(T, Hq, D)
    k0 = before[:, Hq * D : (Hq + Hk) * D].view(T, Hk, D)
    close(qkv[:, : Hq * D].view(T, Hq, D), oracle(q0, wq, c, s, 1e-6, unit_offset, interleaved),
          dtype)
    close(qkv[:, Hq * D : (Hq + Hk) * D].view(T, Hk, D),
          oracle(k0, wk, c, s, 1e-6, unit_offset, interleaved), dtype)
    assert torch.equal(qkv[:, (Hq + Hk) * D :], before[:, (Hq + Hk) * D :])  # V untouched


def hf_tables(batch, seq, rotary_dim, interleaved, dtype=torch.float32):
    """transformers' rotary embedding output: (batch, seq, rotary_dim), each angle twice."""
    inv = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    pos = torch.randint(0, 100, (batch, seq)).double()
    f = pos[..., None] * inv
    emb = f.repeat_interleave(2, -1) if interleaved else torch.cat((f, f), -1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


# ---- out of place ----

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotary_dim", [32, 16, 2])
@pytest.mark.parametrize("unit_offset", [False, True])
def test_out_of_place_hf_layout(dtype, interleaved, rotary_dim, unit_offset):
    B, S, Hq, Hk, D = 2, 7, 4, 2, 32
    q = torch.randn(B, S, Hq * D, dtype=dtype).view(B, S, Hq, D)
    k = torch.randn(B, S, Hk, D, dtype=dtype)
    wq, wk = torch.randn(D, dtype=dtype), torch.randn(D, dtype=torch.float32)
    cos, sin = hf_tables(B, S, rotary_dim, interleaved)
    oq, ok = qk_norm_rope(q, k, wq, wk, cos, sin, eps=1e-6, unit_offset=unit_offset,
                          interleaved=interleaved)
    h = rotary_dim // 2
    c = (cos[..., ::2] if interleaved else cos[..., :h])[:, :, None]
    s = (sin[..., ::2] if interleaved else sin[..., :h])[:, :, None]
    assert oq.dtype == dtype and oq.shape == q.shape and ok.shape == k.shape
    close(oq, oracle(q, wq, c, s, 1e-6, unit_offset, interleaved), dtype)
    close(ok, oracle(k, wk, c, s, 1e-6, unit_offset, interleaved), dtype)


def test_out_of_place_head_first_half_tables_and_strides():
    B, S, H, D = 2, 6, 3, 16
    base = torch.randn(B, S, H, D)
    q = base.transpose(1, 2)  # (B, H, S, D), not contiguous
    k = torch.randn(B, S, 1, 2 * D)[..., ::2].transpose(1, 2)  # strided along head_dim too
    wq, wk = torch.randn(D), torch.randn(D)
    cos, sin = hf_tables(B, S, D, False)
    oq, ok = qk_norm_rope(q, k, wq, wk, cos, sin, eps=1e-5, head_first=True)
    c, s = cos[:, None, :, : D // 2], sin[:, None, :, : D // 2]
    close(oq, oracle(q, wq, c, s, 1e-5, False, False), torch.float32)
    close(ok, oracle(k, wk, c, s, 1e-5, False, False), torch.float32)
    # half-width tables as rope.apply takes them give the same
    hq, hk = qk_norm_rope(q, k, wq, wk, c, s, eps=1e-5, table_width="half")
    torch.testing.assert_close(hq, oq, rtol=0, atol=0)
    torch.testing.assert_close(hk, ok, rtol=0, atol=0)
    # (seq, rotary_dim) tables shared by the batch
    oq2, _ = qk_norm_rope(q[:1], k[:1], wq, wk, cos[0], sin[0], eps=1e-5, head_first=True)
    torch.testing.assert_close(oq2, oq[:1], rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("table_dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_native_equals_reference_out_of_place(dtype, table_dtype):
    q, k = torch.randn(3, 5, 4, 24, dtype=dtype), torch.randn(3, 5, 2, 24, dtype=dtype)
    wq, wk = torch.randn(24, dtype=torch.bfloat16), torch.randn(24, dtype=torch.float64)
    cos, sin = torch.randn(3, 5, 1, 8, dtype=table_dtype), torch.randn(3, 5, 1, 8, dtype=table_dtype)
    for interleaved in (False, True):
        a = ops.qk_norm_rope(q, k, wq, wk, cos, sin, 1e-4, True, interleaved)
        b = reference.qk_norm_rope(q, k, wq, wk, cos, sin, 1e-4, True, interleaved)
        # the sums of squares are added in another order: equal up to float rounding
        for x, y in zip(a, b):
            close(x, y, dtype)


def test_empty_and_single_row():
    for shape in ((0, 3, 16), (1, 1, 16), (4, 0, 16)):
        q, k = torch.randn(*shape), torch.randn(*shape)
        cos, sin = torch.randn(shape[0], 1, 4), torch.randn(shape[0], 1, 4)
        oq, ok = ops.qk_norm_rope(q, k, torch.ones(16), torch.ones(16), cos, sin, 1e-6)
        close(oq, oracle(q, torch.ones(16), cos, sin, 1e-6, False, False), torch.float32)


# ---- in place ----

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D,rotary_dim", [(64, 64), (128, 128), (256, 256), (128, 64), (256, 64)])
@pytest.mark.parametrize("unit_offset", [False, True])
def test_rows_of_common_head_dims(dtype, D, rotary_dim, unit_offset):
    """The CPU kernel's rows of head_dim 64/128/256 (unit strides) rotated whole, or their first
    64 dims (GLM-4.5's 64 of 128, Qwen3-Next's 64 of 256), take paths of their own, heads in
    groups of four: 6 q heads (a group and two more) and 3 k heads."""
    T, Hq, Hk, Hv = 5, 6, 3, 1
    qkv, before, wq, wk, cache, pos = packed_case(T, Hq, Hk, Hv, D, dtype, 40, rotary_dim)
    qkv_norm_rope_(qkv, Hq, Hk, Hv, D, wq, wk, pos, cache, eps=1e-6, unit_offset=unit_offset)
    c, s = gathered(cache, pos)
    check_packed(qkv, before, Hq, Hk, wq, wk, c, s, unit_offset, False, dtype)
    q = before[:, : Hq * D].view(T, Hq, D)
    k = before[:, Hq * D : (Hq + Hk) * D].view(T, Hk, D)
    oq, ok = ops.qk_norm_rope(q, k, wq, wk, c, s, 1e-6, unit_offset, False)
    close(oq, oracle(q, wq, c, s, 1e-6, unit_offset, False), dtype)
    close(ok, oracle(k, wk, c, s, 1e-6, unit_offset, False), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotary_dim", [64, 32, 6])
def test_packed_qkv_in_place(dtype, interleaved, rotary_dim):
    T, Hq, Hk, Hv, D = 9, 4, 2, 2, 64
    qkv, before, wq, wk, cache, pos = packed_case(T, Hq, Hk, Hv, D, dtype, 50, rotary_dim)
    qkv_norm_rope_(qkv, Hq, Hk, Hv, D, wq, wk, pos, cache, eps=1e-6, interleaved=interleaved)
    check_packed(qkv, before, Hq, Hk, wq, wk, *gathered(cache, pos), False, interleaved, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("section,mrope_interleaved", [(None, False), ([2, 3, 3], False),
                                                        ([3, 3, 2], True)])
def test_separate_in_place_mrope_and_layouts(dtype, section, mrope_interleaved):
    B, S, Hq, Hk, D = 2, 5, 3, 2, 32
    q = torch.randn(B, S, Hq, D, dtype=dtype)
    k = torch.randn(B, S, 2 * Hk, D, dtype=dtype)[:, :, ::2]  # strided heads
    q0, k0 = q.clone(), k.clone()
    wq, wk = torch.randn(D), torch.randn(D)
    cache = torch.randn(40, 16, dtype=torch.bfloat16)
    pos = torch.randint(0, 40, (B, S) if section is None else (3, B, S))
    qk_norm_rope_(q, k, wq, wk, pos, cache, eps=1e-5, unit_offset=True, mrope_section=section,
                  mrope_interleaved=mrope_interleaved)
    c, s = gathered(cache, pos, section, mrope_interleaved)
    close(q, oracle(q0, wq, c, s, 1e-5, True, False), dtype)
    close(k, oracle(k0, wk, c, s, 1e-5, True, False), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_native_equals_reference_in_place(dtype):
    T, D = 6, 48
    q, k = torch.randn(T, 4, D, dtype=dtype), torch.randn(T, 2, D, dtype=dtype)
    wq, wk = torch.randn(D), torch.randn(D, dtype=torch.float16)
    cache = torch.randn(20, 32, dtype=torch.float64)
    pos = torch.randint(0, 20, (T,))
    for interleaved in (False, True):
        a = (q.clone(), k.clone())
        b = (q.clone(), k.clone())
        ops.qk_norm_rope_(*a, wq, wk, pos, cache, 1e-6, False, interleaved)
        reference.qk_norm_rope_(*b, wq, wk, pos, cache, 1e-6, False, interleaved)
        for x, y in zip(a, b):
            close(x, y, dtype)


def test_positions_sharing_memory_with_qkv_are_read_before_written():
    T, D = 4, 16
    qkv = torch.randn(T, 3 * D)
    cache = torch.randn(8, 16)
    pos_src = torch.tensor([1, 3, 0, 7])
    # positions stored (as float bits) in the V columns, which the op does not write anyway;
    # the op must still give the results of an independent copy.
    expect = qkv.clone()
    qkv_norm_rope_(expect, 1, 1, 1, D, torch.ones(D), torch.ones(D), pos_src, cache)
    qkv_norm_rope_(qkv, 1, 1, 1, D, torch.ones(D), torch.ones(D), pos_src.clone(), cache)
    torch.testing.assert_close(qkv, expect, rtol=0, atol=0)


# ---- autograd ----

@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("unit_offset", [False, True])
def test_gradcheck(interleaved, unit_offset):
    d = dict(dtype=torch.float64, requires_grad=True)
    q, k = torch.randn(2, 3, 2, 8, **d), torch.randn(2, 3, 1, 8, **d)
    wq, wk = torch.randn(8, **d), torch.randn(8, **d)
    cos, sin = torch.randn(1, 3, 1, 3, **d), torch.randn(1, 3, 1, 3, **d)

    def f(q, k, wq, wk, cos, sin):
        return ops.qk_norm_rope(q, k, wq, wk, cos, sin, 1e-3, unit_offset, interleaved)

    assert torch.autograd.gradcheck(f, (q, k, wq, wk, cos, sin))


def _eager(q, k, wq, wk, cos, sin, eps):
    """The unfused computation as transformers writes it (Qwen3: RMSNorm in float32, RoPE with
    rotate_half on full-width tables)."""
    def norm(x, w):
        xf = x.float()
        return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)

    def rot(x):
        a, b = x.chunk(2, -1)
        return torch.cat((-b, a), -1)

    c, s = cos.unsqueeze(2), sin.unsqueeze(2)
    qn, kn = norm(q, wq), norm(k, wk)
    return qn * c + rot(qn) * s, kn * c + rot(kn) * s


def test_gradients_equal_unfused_eager():
    B, S, D = 2, 5, 16
    q = torch.randn(B, S, 4, D, requires_grad=True)
    k = torch.randn(B, S, 2, D, requires_grad=True)
    wq = torch.randn(D, requires_grad=True)
    wk = torch.randn(D, requires_grad=True)
    cos, sin = hf_tables(B, S, D, False)
    gq, gk = torch.randn(B, S, 4, D), torch.randn(B, S, 2, D)
    fused = qk_norm_rope(q, k, wq, wk, cos, sin, eps=1e-6)
    eager = _eager(q, k, wq, wk, cos, sin, 1e-6)
    for a, b in zip(fused, eager):
        close(a, b, torch.float32)
    ga = torch.autograd.grad(fused, (q, k, wq, wk), (gq, gk))
    gb = torch.autograd.grad(eager, (q, k, wq, wk), (gq, gk))
    for a, b in zip(ga, gb):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


# ---- the backward op (rope.qk_norm_rope_backward) ----

def oracle_grads(grad, x, w, cos, sin, eps, unit_offset, interleaved):
    """float64 gradients (of x, of w) of the oracle, by autograd."""
    xd = x.detach().double().requires_grad_()
    wd = w.detach().double().requires_grad_()
    y = oracle(xd, wd, cos, sin, eps, unit_offset, interleaved)
    return torch.autograd.grad(y, (xd, wd), grad.double())


def backward_cases(dtype, D, rotary_dim):
    """(grad, x, cos, sin) in the layouts qk_norm_rope meets: (B, S, H, D) with (B, S, 1, h)
    tables; (B, H, S, D) contiguous with (1, 1, S, h) bfloat16 tables and a grad whose memory is
    (B, S, H, D) (transformers' transposed attention output); strided x with strided tables."""
    B, S, H, h = 2, (301 if D <= 128 else 23), 3, rotary_dim // 2  # 2 threads: 2 tasks
    yield (torch.randn(B, S, H, D, dtype=dtype), torch.randn(B, S, H, D, dtype=dtype),
           torch.randn(B, S, 1, h), torch.randn(B, S, 1, h))
    yield (torch.randn(B, S, H, D, dtype=dtype).transpose(1, 2),
           torch.randn(B, H, S, D, dtype=dtype),
           torch.randn(1, 1, S, h, dtype=torch.bfloat16), torch.randn(1, 1, S, h,
                                                                      dtype=torch.bfloat16))
    yield (torch.randn(B, S, H, D, dtype=dtype), torch.randn(B, S, H, 2 * D, dtype=dtype)[..., ::2],
           torch.randn(B, S, 1, 2 * h)[..., ::2], torch.randn(B, S, 1, 2 * h)[..., ::2])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D,rotary_dim", [(128, 128), (64, 64), (128, 64), (96, 64), (2050, 1030)])
def test_backward_op_against_float64(dtype, D, rotary_dim):
    # Every kernel variant this CPU runs (the oracle computed once for all of them), 1 and 2
    # threads (grad_weight's per-thread shares added), both pair layouts, the Gemma form, partial
    # rotary (its pass-through dims), rows past 1024 dims; the fixed paths (head_dim 64 and 128,
    # 128 rotating 64) and the general rows.
    if not native_cpu():
        pytest.skip("no native CPU library")
    before, serving = torch.get_num_threads(), rope_ext.cpu_isa()
    w = torch.randn(D, dtype=torch.bfloat16)
    try:
        for n_threads, (grad, x, cos, sin) in zip((1, 2, 1), backward_cases(dtype, D, rotary_dim)):
            torch.set_num_threads(n_threads)
            for interleaved in (False, True):
                for unit_offset in (False, True):
                    args = (grad, x, w, cos, sin, 1e-6, unit_offset, interleaved)
                    ex, ew = oracle_grads(*args)
                    rx = reference.qk_norm_rope_backward(*args)[0]
                    rtol = 1e-10 if dtype == torch.float64 else 1e-5  # (grad_weight's)
                    for isa in rope_ext.cpu_isas():
                        rope_ext.set_cpu_isa(isa)
                        gx, gw = ops.qk_norm_rope_backward(*args)
                        assert gx.dtype == dtype and gx.shape == x.shape and gx.is_contiguous()
                        assert gw.dtype == (torch.float64 if dtype == torch.float64
                                            else torch.float32)
                        close(gx, ex, dtype)
                        # grad_weight: sums over every row, in the arithmetic type
                        torch.testing.assert_close(gw.double(), ew, rtol=rtol,
                                                   atol=rtol * ew.abs().max().item())
                        close(gx, rx, dtype)
    finally:
        torch.set_num_threads(before)
        rope_ext.set_cpu_isa(serving)


@pytest.mark.parametrize("n_threads", [1, 2])
def test_backward_op_grad_weight_keeps_float32_accuracy_over_many_rows(n_threads):
    # grad_weight sums a term per row: half a million rows whose terms share a sign (a running
    # float32 sum loses about four digits there; torch's pairwise sum keeps float32's).
    if not native_cpu():
        pytest.skip("no native CPU library")
    x, g = torch.randn(500_000, 8), torch.randn(500_000, 8) + 1.0
    w, tables = torch.ones(8), torch.randn(500_000, 2)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(n_threads)
        gw = ops.qk_norm_rope_backward(g, x, w, tables, tables.flip(1), 1e-6)[1]
    finally:
        torch.set_num_threads(before)
    expected = oracle_grads(g, x, w, tables, tables.flip(1), 1e-6, False, False)[1]
    assert ((gw.double() - expected).abs().max() / expected.abs().max()).item() < 1e-6


@pytest.mark.parametrize("isa", rope_ext._library.CPU_ISA_NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale,eps", [(1e-13, 0.0), (1e-6, 0.0), (1e15, 1e-6), (1e18, 1e-6)])
def test_backward_op_keeps_its_accuracy_at_extreme_row_scales(isa, dtype, scale, eps):
    # grad_x is scale-free in x's own units: r^3 alone overflows float at rows of RMS 1e-13
    # (eps 0) and loses digits to subnormals at 1e13 and above, the kernel's form must not.
    if not native_cpu():
        pytest.skip("no native CPU library")
    if isa not in rope_ext.cpu_isas():
        pytest.skip(f"this CPU cannot run the {isa} kernels")
    serving = rope_ext.cpu_isa()
    D = 128
    x = (torch.randn(3, 17, 4, D, dtype=torch.float64) * scale).to(dtype)
    grad, w = torch.randn(3, 17, 4, D, dtype=dtype), torch.randn(D, dtype=dtype)
    cos, sin = torch.randn(3, 17, 1, D // 2), torch.randn(3, 17, 1, D // 2)
    try:
        rope_ext.set_cpu_isa(isa)
        gx, gw = ops.qk_norm_rope_backward(grad, x, w, cos, sin, eps)
    finally:
        rope_ext.set_cpu_isa(serving)
    ex, ew = oracle_grads(grad, x, w, cos, sin, eps, False, False)
    assert gx.isfinite().all()
    rel = ((gx.double() - ex).abs().max() / ex.abs().max()).item()
    assert rel < (1e-5 if dtype == torch.float32 else 2e-2), rel
    torch.testing.assert_close(gw.double(), ew, rtol=1e-5, atol=1e-5 * ew.abs().max().item())


def test_backward_takes_the_backward_op_and_double_backward_does_not():
    if not native_cpu():
        pytest.skip("no native CPU library: the backward is the torch ops")
    q = torch.randn(2, 5, 4, 16, requires_grad=True)
    k = torch.randn(2, 5, 2, 16, requires_grad=True)
    wq, wk = torch.randn(16, requires_grad=True), torch.randn(16, requires_grad=True)
    cos, sin = torch.randn(2, 5, 1, 8), torch.randn(2, 5, 1, 8)
    a, b = ops.qk_norm_rope(q, k, wq, wk, cos, sin, 1e-6)
    with torch.profiler.profile() as prof:
        torch.autograd.backward((a, b), (torch.randn_like(a), torch.randn_like(b)))
    names = [e.name for e in prof.events()]
    assert names.count("rope::qk_norm_rope_backward") == 2, names
    # rope.norm_rope: a per-head RMSNorm without biases (a weight or none) takes it too, the
    # other forms not
    for norm, q_bias, calls in (("rms", None, 2), ("layer", None, 0), ("rms", torch.zeros(16), 0)):
        a, b = ops.norm_rope(q, k, wq, None, q_bias, None, cos, sin, 1e-6, norm)
        with torch.profiler.profile() as prof:
            torch.autograd.backward((a, b), (torch.randn_like(a), torch.randn_like(b)))
        names = [e.name for e in prof.events()]
        assert names.count("rope::qk_norm_rope_backward") == calls, (norm, names)
    d = dict(dtype=torch.float64, requires_grad=True)
    args = (torch.randn(2, 3, 2, 8, **d), torch.randn(2, 3, 1, 8, **d), torch.randn(8, **d),
            torch.randn(8, **d), torch.randn(2, 3, 1, 3), torch.randn(2, 3, 1, 3))

    def f(q, k, wq, wk):
        return ops.qk_norm_rope(q, k, wq, wk, *args[4:], 1e-3, True, False)

    assert torch.autograd.gradgradcheck(f, args[:4])


def test_backward_op_refuses_grad_and_bad_inputs_alike_on_both_paths():
    x, g = torch.randn(2, 3, 8), torch.randn(2, 3, 8)
    w, c = torch.randn(8), torch.randn(2, 1, 3)
    with pytest.raises(RuntimeError, match="rope.qk_norm_rope_backward: the backward of "
                                           "rope.qk_norm_rope, not differentiable"):
        ops.qk_norm_rope_backward(g, x.requires_grad_(), w, c, c, 1e-6)
    x = x.detach()
    bad = [dict(g=g.double()), dict(g=torch.randn(2, 3, 6)), dict(g=torch.randn(3, 2, 8)),
           dict(w=torch.randn(2, 8)), dict(w=torch.ones(8, dtype=torch.int32)),
           dict(c=torch.randn(2, 1, 5)), dict(eps=float("nan")), dict(x=torch.zeros(2, 3, 8,
                                                                                    dtype=torch.long))]
    paths = [reference.qk_norm_rope_backward] + ([ops.qk_norm_rope_backward] if native_cpu() else [])
    for change in bad:
        a = dict(g=g, x=x, w=w, c=c, eps=1e-6)
        a.update(change)
        msgs = set()
        for fn in paths:
            with pytest.raises(RuntimeError, match="^rope.qk_norm_rope_backward: ") as e:
                fn(a["g"], a["x"], a["w"], a["c"], a["c"], a["eps"])
            msgs.add(str(e.value))
        assert len(msgs) == 1, (change, msgs)


def test_in_place_ops_refuse_grad():
    q = torch.randn(3, 2, 8, requires_grad=True)
    with pytest.raises(RuntimeError, match="rope.qk_norm_rope_: a serving op, not differentiable"):
        qk_norm_rope_(q, torch.randn(3, 1, 8), torch.ones(8), torch.ones(8),
                      torch.zeros(3, dtype=torch.long), torch.randn(4, 8))
    with torch.no_grad():
        qk_norm_rope_(q, torch.randn(3, 1, 8), torch.ones(8), torch.ones(8),
                      torch.zeros(3, dtype=torch.long), torch.randn(4, 8))


# ---- errors: clear, the same on both paths, nothing written ----

def _packed_args():
    T, D = 5, 16
    return dict(qkv=torch.randn(T, 4 * D), hq=2, hk=1, hv=1, d=D, wq=torch.randn(D),
                wk=torch.randn(D), pos=torch.randint(0, 10, (T,)), cache=torch.randn(10, 16),
                eps=1e-6)


PACKED_CASES = [
    ("width", dict(hq=3), r"rope.qkv_norm_rope_: qkv.size\(1\) = 64 must be \(num_heads_q \+ "
                          r"num_heads_k \+ num_heads_v\) \* head_dim = \(3 \+ 1 \+ 1\) \* 16 = 80"),
    ("negative_heads", dict(hv=-1), r"num_heads_v must be an int >= 0, got -1"),
    ("qkv_dims", dict(qkv=torch.randn(5, 1, 64)), r"qkv must have shape \(num_tokens, "),
    ("int_qkv", dict(qkv=torch.zeros(5, 64, dtype=torch.long)), r"qkv must be float16"),
    ("qkv_columns_strided", dict(qkv=torch.randn(64, 5).t()),
     r"qkv must have unit stride along its columns \(qkv.stride\(1\) == 1\), got strides \[1, 5\]"),
    ("weight_shape", dict(wq=torch.randn(8)), r"q_weight must have shape \(head_dim,\) = \(16,\), got \[8\]"),
    ("weight_dtype", dict(wk=torch.ones(16, dtype=torch.int32)), r"k_weight must be float16, bfloat16, float32 or float64, got Int"),
    ("rotary_odd", dict(cache=torch.randn(10, 7)), r"rotary_dim = cos_sin_cache.size\(1\) = 7 must be even and <= head_dim = 16"),
    ("rotary_big", dict(cache=torch.randn(10, 18)), r"rotary_dim = cos_sin_cache.size\(1\) = 18 must be even"),
    ("pos_range", dict(pos=torch.tensor([0, 1, 10, 2, 3])), r"positions must lie in \[0, 10\) .* got 10 at flat index 2"),
    ("pos_negative", dict(pos=torch.tensor([0, -1, 1, 2, 3])), r"positions must lie in \[0, 10\)"),
    ("pos_length", dict(pos=torch.zeros(4, dtype=torch.long)), r"positions must have shape query.shape\[:-2\]"),
    ("pos_dtype", dict(pos=torch.zeros(5)), r"positions must be int32 or int64, got Float"),
    ("eps_negative", dict(eps=-1.0), r"eps must be a finite number >= 0, got -1"),
    ("eps_nan", dict(eps=float("nan")), r"eps must be a finite number >= 0, got nan"),
    # x86's 0/0 sets a NaN's sign bit: both paths word it "nan", as Python does
    ("eps_negative_nan", dict(eps=-float("nan")), r"eps must be a finite number >= 0, got nan$"),
    # finite as a double, inf in the float32 the norm adds it in
    ("eps_above_float32", dict(eps=1e39),
     r"eps must be at most 3.40282e\+38 \(float32's largest\), got 1e\+39$"),
]


def _run_packed(fn, a):
    fn(a["qkv"], a["hq"], a["hk"], a["hv"], a["d"], a["wq"], a["wk"], a["pos"], a["cache"], a["eps"])


@pytest.mark.parametrize("path", ["native", "reference"])
@pytest.mark.parametrize("case,change,match", PACKED_CASES, ids=[c[0] for c in PACKED_CASES])
def test_packed_errors(path, case, change, match):
    if path == "native" and not native_cpu():
        pytest.skip("no native CPU library")
    a = dict(_packed_args(), **change)
    before = a["qkv"].clone()
    fn = ops.qkv_norm_rope_ if path == "native" else reference.qkv_norm_rope_
    with pytest.raises(RuntimeError, match=match):
        _run_packed(fn, a)
    assert torch.equal(a["qkv"], before)


def test_native_and_reference_messages_agree():
    if not native_cpu():
        pytest.skip("no native CPU library")
    for _, change, _ in PACKED_CASES:
        msgs = []
        for fn in (ops.qkv_norm_rope_, reference.qkv_norm_rope_):
            with pytest.raises(RuntimeError) as e:
                _run_packed(fn, dict(_packed_args(), **change))
            msgs.append(str(e.value))
        assert msgs[0] == msgs[1]
    q, k = torch.randn(2, 3, 2, 8), torch.randn(2, 3, 1, 8)
    bad = [
        dict(k=k.double()), dict(k=torch.randn(2, 3, 1, 6)), dict(wq=torch.randn(2, 8)),
        dict(cos=torch.randn(2, 3, 1, 5)), dict(sin=torch.randn(2, 3, 1, 3)), dict(eps=-0.5),
        dict(q=torch.randn(8)),
    ]
    for change in bad:
        a = dict(q=q, k=k, wq=torch.randn(8), wk=torch.randn(8), cos=torch.randn(2, 3, 1, 2),
                 sin=torch.randn(2, 3, 1, 2), eps=1e-6)
        a.update(change)
        msgs = []
        for fn in (ops.qk_norm_rope, reference.qk_norm_rope):
            with pytest.raises(RuntimeError) as e:
                fn(a["q"], a["k"], a["wq"], a["wk"], a["cos"], a["sin"], a["eps"])
            msgs.append(str(e.value))
        assert msgs[0] == msgs[1], change


def test_weights_overlapping_what_is_written_are_refused_on_both_paths():
    # The weights are read while query and key are written: a weight in their memory (a column
    # of the packed qkv buffer, say) would be read half-overwritten.
    paths = [ops, reference] if native_cpu() else [reference]
    for name in ("q_weight", "k_weight"):
        msgs = []
        for path in paths:
            qkv = torch.randn(5, 4 * 16)
            before = qkv.clone()
            weights = dict(q_weight=torch.randn(16), k_weight=torch.randn(16))
            weights[name] = qkv[1, :16]  # inside query's columns
            with pytest.raises(RuntimeError, match=f"rope.qkv_norm_rope_: {name} and query: ") as e:
                path.qkv_norm_rope_(qkv, 2, 1, 1, 16, weights["q_weight"], weights["k_weight"],
                                    torch.randint(0, 10, (5,)), torch.randn(10, 16), 1e-6)
            assert torch.equal(qkv, before)
            msgs.append(str(e.value))
            q, k = torch.randn(4, 2, 16), torch.randn(4, 1, 16)
            q0, k0 = q.clone(), k.clone()
            weights[name] = q[2, 1]
            with pytest.raises(RuntimeError, match=f"rope.qk_norm_rope_: {name} and query: "):
                path.qk_norm_rope_(q, k, weights["q_weight"], weights["k_weight"],
                                   torch.tensor([0, 1, 2, 3]), torch.randn(10, 16), 1e-6)
            assert torch.equal(q, q0) and torch.equal(k, k0)
        assert len(set(msgs)) == 1, msgs


def test_in_place_error_writes_nothing():
    q, k = torch.randn(4, 2, 16), torch.randn(4, 1, 16)
    q0, k0 = q.clone(), k.clone()
    with pytest.raises(RuntimeError, match="positions must lie in"):
        qk_norm_rope_(q, k, torch.ones(16), torch.ones(16), torch.tensor([0, 1, 2, 99]),
                      torch.randn(10, 16))
    assert torch.equal(q, q0) and torch.equal(k, k0)
    with pytest.raises(RuntimeError, match="mrope_section"):
        qk_norm_rope_(q, k, torch.ones(16), torch.ones(16), torch.zeros(3, 4, dtype=torch.long),
                      torch.randn(10, 16), mrope_section=[2, 2, 2])
    assert torch.equal(q, q0) and torch.equal(k, k0)


# ---- opcheck, torch.compile ----

def _opcheck_samples():
    q, k = torch.randn(7, 4, 16), torch.randn(7, 2, 16)
    pos = torch.randint(0, 20, (7,), dtype=torch.int32)
    cache = torch.randn(20, 12)
    w = torch.randn(16)
    d = dict(dtype=torch.float64, requires_grad=True)
    return [
        (ops.qk_norm_rope.default, (torch.randn(2, 5, 3, 16), torch.randn(2, 5, 1, 16), w, w,
                                    torch.randn(2, 5, 1, 6), torch.randn(2, 5, 1, 6), 1e-6)),
        (ops.qk_norm_rope.default, (torch.randn(2, 3, 2, 8, **d), torch.randn(2, 3, 1, 8, **d),
                                    torch.randn(8, **d), torch.randn(8, **d),
                                    torch.randn(2, 3, 1, 4, **d), torch.randn(2, 3, 1, 4, **d),
                                    1e-5, True, True)),
        (ops.qk_norm_rope_.default, (q.clone(), k.clone(), w, w, pos, cache, 1e-6, False, True)),
        (ops.qk_norm_rope_.default, (q.clone(), k.clone(), w, w, torch.randint(0, 20, (3, 7)),
                                     cache, 1e-6, True, False, [2, 2, 2], True)),
        (ops.qkv_norm_rope_.default, (torch.randn(7, 8 * 16), 4, 2, 2, 16, w, w, pos, cache,
                                      1e-6)),
        (ops.qk_norm_rope_backward.default, (torch.randn(2, 5, 3, 16), torch.randn(2, 5, 3, 16),
                                             w, torch.randn(2, 5, 1, 6), torch.randn(2, 5, 1, 6),
                                             1e-6, True, True)),
    ]


@pytest.mark.parametrize("i", range(6))
def test_opcheck(i):
    op, args = _opcheck_samples()[i]
    torch.library.opcheck(op, args)


def test_torch_compile_fullgraph():
    torch._dynamo.reset()
    D = 16
    wq, wk = torch.randn(D), torch.randn(D)
    cache = torch.randn(32, D)

    def step(qkv, pos, q, k, cos, sin):
        qkv_norm_rope_(qkv, 2, 1, 1, D, wq, wk, pos, cache)
        a, b = qk_norm_rope(q, k, wq, wk, cos, sin, eps=1e-6)
        return a * 2, b

    qkv = torch.randn(5, 4 * D)
    pos = torch.randint(0, 32, (5,))
    q, k = torch.randn(1, 5, 2, D), torch.randn(1, 5, 1, D)
    cos, sin = hf_tables(1, 5, D, False)
    e_qkv = qkv.clone()
    expect = step(e_qkv, pos, q, k, cos, sin)
    got_qkv = qkv.clone()
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(got_qkv, pos, q, k, cos, sin)
    torch.testing.assert_close(got, expect, rtol=0, atol=0)
    torch.testing.assert_close(got_qkv, e_qkv, rtol=0, atol=0)


def test_torch_compile_backward():
    torch._dynamo.reset()
    q = torch.randn(1, 4, 2, 16, requires_grad=True)
    k = torch.randn(1, 4, 1, 16, requires_grad=True)
    w = torch.randn(16, requires_grad=True)
    cos, sin = hf_tables(1, 4, 16, False)

    def f(q, k, w):
        a, b = qk_norm_rope(q, k, w, w, cos, sin)
        return (a * a).sum() + (b * 3).sum()

    expect = torch.autograd.grad(f(q, k, w), (q, k, w))
    got = torch.autograd.grad(torch.compile(f, fullgraph=True)(q, k, w), (q, k, w))
    torch.testing.assert_close(got, expect, rtol=1e-5, atol=1e-5)


# ---- drop-ins ----

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("rot_dim", [128, 64])
def test_vllm_fused_qk_norm_rope(dtype, is_neox, rot_dim):
    from rope_ext.compat.vllm import fused_qk_norm_rope

    T, Hq, Hk, Hv, D = 6, 4, 2, 2, 128
    qkv, before, wq, wk, cache, pos = packed_case(T, Hq, Hk, Hv, D, dtype, 64, rot_dim,
                                                  pos_dtype=torch.int64)
    assert fused_qk_norm_rope(qkv, Hq, Hk, Hv, D, 1e-6, wq, wk, cache, is_neox, pos, 4) is None
    check_packed(qkv, before, Hq, Hk, wq, wk, *gathered(cache, pos), False, not is_neox, dtype)


def test_vllm_fused_qk_norm_rope_bad_input_changes_nothing():
    from rope_ext.compat.vllm import fused_qk_norm_rope

    qkv = torch.randn(3, 4 * 16)
    before = qkv.clone()
    w = torch.ones(16)
    cases = [
        ((qkv, 2, 2, 1, 16, 1e-6, w, w, torch.randn(8, 16), True, torch.zeros(3, dtype=torch.long)),
         "qkv.size\\(1\\) = 64 must be"),
        ((qkv, 2, 1, 1, 16, 1e-6, w, w, torch.randn(8, 16), True, torch.tensor([0, 8, 1])),
         "positions must lie in \\[0, 8\\)"),
        ((qkv, 2, 1, 1, 16, -1e-6, w, w, torch.randn(8, 16), True, torch.zeros(3, dtype=torch.long)),
         "eps must be a finite number >= 0"),
        ((qkv, 2, 1, 1, 16, 1e-6, w, torch.ones(15), torch.randn(8, 16), True,
          torch.zeros(3, dtype=torch.long)), "k_weight must have shape"),
        ((qkv, 2, 1, 1, 16, 1e-6, w, w, torch.randn(8, 15), True, torch.zeros(3, dtype=torch.long)),
         "rotary_dim = cos_sin_cache.size\\(1\\) = 15 must be even"),
    ]
    for args, match in cases:
        with pytest.raises(RuntimeError, match=match):
            fused_qk_norm_rope(*args)
        assert torch.equal(qkv, before)


@pytest.mark.parametrize("factor", [1.0, 4.0])
@pytest.mark.parametrize("rotary_dim", [None, 32])
def test_sglang_fused_qk_norm_rope(factor, rotary_dim):
    from rope_ext.compat.sglang import fused_qk_norm_rope

    T, Hq, Hk, Hv, D = 5, 2, 1, 1, 64
    qkv = torch.randn(T, (Hq + Hk + Hv) * D, dtype=torch.bfloat16)
    before = qkv.clone()
    wq, wk = torch.randn(D, dtype=torch.bfloat16), torch.randn(D, dtype=torch.bfloat16)
    pos = torch.randint(0, 4000, (T,), dtype=torch.int32)
    base, low, high, att = 1e6, 3.0, 20.0, 1.2
    fused_qk_norm_rope(qkv, Hq, Hk, Hv, D, 1e-6, wq, wk, base, True, pos, factor, low, high, att,
                       rotary_dim)
    r = D if rotary_dim is None else rotary_dim
    freqs = []  # SGLang's frequencies, one pair at a time
    for i in range(r // 2):
        f = base ** (-2.0 * i / r)
        if factor != 1.0:
            ramp = min(max((i - low) / (high - low), 0.0), 1.0)
            f = (f / factor) * ramp + f * (1.0 - ramp)
        freqs.append(f)
    angle = pos.double()[:, None] * torch.tensor(freqs, dtype=torch.float64)
    c, s = (angle.cos() * att)[:, None], (angle.sin() * att)[:, None]
    q0 = before[:, : Hq * D].view(T, Hq, D)
    close(qkv[:, : Hq * D].view(T, Hq, D), oracle(q0, wq, c, s, 1e-6, False, False),
          torch.bfloat16)
    assert torch.equal(qkv[:, (Hq + Hk) * D :], before[:, (Hq + Hk) * D :])


def test_sglang_fused_qk_norm_rope_cached_table_gives_the_per_token_bits(monkeypatch):
    from rope_ext.compat import _layout, _qk_norm as impl
    from rope_ext.compat.sglang import fused_qk_norm_rope

    monkeypatch.setattr(_layout, "_TABLES", {})  # none kept by earlier tests
    T, Hq, Hk, Hv, D = 7, 2, 1, 1, 64
    qkv = torch.randn(T, (Hq + Hk + Hv) * D, dtype=torch.bfloat16)
    wq, wk = torch.randn(D, dtype=torch.bfloat16), torch.randn(D, dtype=torch.bfloat16)
    args = (1e6, True)
    yarn = (4.0, 3.0, 20.0, 1.2, 48)
    cases = [torch.randint(0, 5000, (T,), dtype=torch.int32), torch.randint(0, 300, (T,)),
             torch.randint(0, 300, (70,)), torch.tensor([-3, 0, 5, 9, 1, 2, 3]),
             torch.tensor([1 << 19, 0, 5, 9, 1, 2, 3])]  # a table past 64 MiB: not kept
    for pos in cases:
        x = torch.randn(pos.shape[0], qkv.shape[1], dtype=torch.bfloat16)
        got = x.clone()
        fused_qk_norm_rope(got, Hq, Hk, Hv, D, 1e-6, wq, wk, *args, pos, *yarn)
        cached = ("sglang", 48, 1e6, 4.0, 3.0, 20.0, 1.2) in _layout._TABLES
        assert cached == (int(pos.min()) >= 0 and int(pos.max()) < 1 << 19)
        with monkeypatch.context() as m:  # the per-token rows
            m.setattr(impl, "positions_table", lambda *args: None)
            want = x.clone()
            fused_qk_norm_rope(want, Hq, Hk, Hv, D, 1e-6, wq, wk, *args, pos, *yarn)
        assert torch.equal(got, want)
        assert not torch.equal(got, x)
        _layout._TABLES.clear()
    # a table grows by the rows past its end; past _TABLES_KEPT sets, calls build their own rows
    freqs = (48, 1e6, 4.0, 3.0, 20.0, 1.2)
    for pos in (torch.tensor([3, 100]), torch.tensor([9000, 2])):
        _layout.positions_table(pos, ("sglang",) + freqs, 48, lambda p: impl._yarn_tables(p, *freqs))
    kept = _layout._TABLES[("sglang",) + freqs]
    assert kept.shape[0] == 16384
    assert torch.equal(kept, impl._yarn_tables(torch.arange(16384), *freqs))
    for base in range(_layout._TABLES_KEPT + 2):
        other = (48, 10.0 + base, 1.0, 0.0, 0.0, 1.0)
        table = _layout.positions_table(torch.tensor([7]), ("sglang",) + other, 48,
                                        lambda p: impl._yarn_tables(p, *other))
        assert (table is None) == (base >= _layout._TABLES_KEPT - 1)
    assert len(_layout._TABLES) == _layout._TABLES_KEPT
    _layout._TABLES.clear()


def test_flashinfer_pos_ids_kept_table_gives_the_per_token_bits(monkeypatch):
    # FlashInfer's pos_ids functions read a kept table of positions 0 .. n-1 on the CPU: the same
    # bits as the table of the call's own tokens, in place and out of place, Llama 3.1 too.
    from rope_ext.compat import _layout, flashinfer

    monkeypatch.setattr(_layout, "_TABLES", {})
    for rot, nnz, llama31, dtype in [(128, 1, False, torch.bfloat16), (40, 17, True, torch.float32),
                                     (8, 70, False, torch.float16), (96, 8, True, torch.bfloat16)]:
        q, k = torch.randn(nnz, 4, 128, dtype=dtype), torch.randn(nnz, 2, 128, dtype=dtype)
        pos = torch.randint(0, 20000, (nnz,))
        kw = dict(rotary_dim=rot, rope_theta=1e4 + rot, rope_scale=2)
        if llama31:
            out_of_place, in_place = (flashinfer.apply_llama31_rope_pos_ids,
                                      flashinfer.apply_llama31_rope_pos_ids_inplace)
        else:
            out_of_place, in_place = flashinfer.apply_rope_pos_ids, flashinfer.apply_rope_pos_ids_inplace
        got = out_of_place(q, k, pos, **kw)
        got_q, got_k = q.clone(), k.clone()
        in_place(got_q, got_k, pos, **kw)
        assert any(key[0] == "flashinfer" and key[1] == rot for key in _layout._TABLES)
        with monkeypatch.context() as m:  # the per-token rows
            m.setattr(flashinfer, "positions_table", lambda *args: None)
            want = out_of_place(q, k, pos, **kw)
        for a, b in zip(got + (got_q, got_k), want + want):
            assert torch.equal(a, b)
        assert not torch.equal(got_q, q)


# ---- every compiled CPU variant, and rows past the kernel's stack buffers ----

@pytest.mark.parametrize("isa", rope_ext._library.CPU_ISA_NAMES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_cpu_variant_agrees_with_the_oracle(dtype, isa):
    if not native_cpu():
        pytest.skip("no native CPU library")
    if isa not in rope_ext.cpu_isas():
        pytest.skip(f"this CPU cannot run the {isa} kernels")
    T, D = 5, 96
    q, k = torch.randn(T, 3, D, dtype=dtype), torch.randn(T, 2, D, dtype=dtype)
    wq, wk = torch.randn(D, dtype=torch.bfloat16), torch.randn(D)
    cache = torch.randn(16, 64)
    pos = torch.randint(0, 16, (T,))
    c, s = gathered(cache, pos)
    before = rope_ext.cpu_isa()
    try:
        assert rope_ext.set_cpu_isa(isa) == isa
        for interleaved in (False, True):
            a, b = q.clone(), k.clone()
            ops.qk_norm_rope_(a, b, wq, wk, pos, cache, 1e-6, True, interleaved)
            close(a, oracle(q, wq, c, s, 1e-6, True, interleaved), dtype)
            close(b, oracle(k, wk, c, s, 1e-6, True, interleaved), dtype)
    finally:
        rope_ext.set_cpu_isa(before)


@pytest.mark.parametrize("unit_offset", [False, True])
@pytest.mark.parametrize("interleaved", [False, True])
def test_rows_longer_than_the_stack_buffers(unit_offset, interleaved):
    T, D, R = 3, 2 * 1024 + 2, 1030  # head_dim past 1024: weights cast by the host; 2 blocks
    q, k = torch.randn(T, 2, D, dtype=torch.bfloat16), torch.randn(T, 1, D, dtype=torch.bfloat16)
    q = q.transpose(0, 1).contiguous().transpose(0, 1)  # strided heads
    wq, wk = torch.randn(D, dtype=torch.bfloat16), torch.randn(2 * D)[::2]
    cache = torch.randn(8, R)
    pos = torch.randint(0, 8, (T,))
    a, b = q.clone(), k.clone()
    qk_norm_rope_(a, b, wq, wk, pos, cache, unit_offset=unit_offset, interleaved=interleaved)
    c, s = gathered(cache, pos)
    close(a, oracle(q, wq, c, s, 1e-6, unit_offset, interleaved), torch.bfloat16)
    close(b, oracle(k, wk, c, s, 1e-6, unit_offset, interleaved), torch.bfloat16)


def test_glm_tables_as_documented():
    """transformers' GLM-4 rotary module duplicates the halves of its interleaved tables (its
    apply_rotary_pos_emb repeats the entries): the documented call, cos[..., :rotary_dim // 2]
    with table_width="half", gives GLM-4's norm + RoPE; its full tables read as interleaved
    (repeated entries) would not, which is why the docs say so."""
    glm4 = pytest.importorskip("transformers.models.glm4.modeling_glm4")
    B, S, H, D, rd = 2, 6, 3, 16, 8  # GLM-4's partial rotary: half of head_dim
    freqs = torch.rand(B, S, rd // 2, dtype=torch.float64) * 6
    emb = torch.cat((freqs, freqs), dim=-1)  # as Glm4RotaryEmbedding.forward returns them
    cos, sin = emb.cos(), emb.sin()
    q, k = torch.randn(B, S, H, D, dtype=torch.float64), torch.randn(B, S, 1, D, dtype=torch.float64)
    wq, wk = torch.randn(D, dtype=torch.float64), torch.randn(D, dtype=torch.float64)

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w

    want = glm4.apply_rotary_pos_emb(rms(q, wq).transpose(1, 2), rms(k, wk).transpose(1, 2), cos, sin)
    half = (cos[..., None, : rd // 2], sin[..., None, : rd // 2])
    got = qk_norm_rope(q, k, wq, wk, *half, interleaved=True, table_width="half")
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w.transpose(1, 2), rtol=1e-12, atol=1e-12)
    wrong = qk_norm_rope(q, k, wq, wk, cos, sin, interleaved=True)
    assert not torch.allclose(wrong[0], want[0].transpose(1, 2), atol=1e-3)
