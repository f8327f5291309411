"""rope.norm_rope, the norm forms of image/video attention fused with RoPE (RMSNorm per head or
across the heads of a token, LayerNorm per head; optional weights and biases): results against
an independent float64 computation on every compiled CPU variant, the native and reference paths
against each other, gradients (gradcheck, and equal to torch's own norms followed by the
rotation), errors (same on both paths), opcheck and torch.compile."""

import pytest
import torch

import rope_ext
from rope_ext._qk_norm import reference
from rope_ext.qk_norm import norm_rope

from conftest import native_cpu
from test_qk_norm import TOLS, rotated
from test_cpu_isa import runnable

ops = torch.ops.rope
FORMS = ("rms", "rms_across_heads", "layer")


def close(actual, expected, dtype):
    rtol, atol = TOLS[dtype]
    torch.testing.assert_close(actual.double(), expected.double(), rtol=rtol, atol=atol)


def oracle(x, w, b, cos, sin, eps, norm, interleaved):
    """float64: x normalized as `norm` says, times w, plus b, then its first 2 * cos.size(-1)
    dims rotated by (cos, sin) (..., rotary_dim/2, broadcast)."""
    x = x.double()
    if norm == "rms_across_heads":
        flat = x.flatten(-2)
        y = (flat / torch.sqrt((flat * flat).mean(-1, keepdim=True) + eps)).view(x.shape)
    elif norm == "layer":
        centred = x - x.mean(-1, keepdim=True)
        y = centred / torch.sqrt((centred * centred).mean(-1, keepdim=True) + eps)
    else:
        y = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)
    shape = x.shape[-2:] if norm == "rms_across_heads" else x.shape[-1:]
    if w is not None:
        y = y * w.double().reshape(shape)
    if b is not None:
        y = y + b.double().reshape(shape)
    return rotated(y, cos, sin, interleaved)


def params(norm, heads, D, dtype, weight=True, bias=False):
    n = heads * D if norm == "rms_across_heads" else D
    w = torch.randn(n, dtype=dtype) if weight else None
    b = torch.randn(n, dtype=dtype) if bias else None
    return w, b


def poison_heap(*tensors):
    """Frees NaN-filled blocks of the outputs' sizes right before a call, so an output the
    allocator hands out again shows any element the kernel does not write."""
    junk = [torch.full_like(t, float("nan")) for t in tensors]
    del junk


def fused_projection(B, S, Hq, Hk, D, dtype):
    """query (B, S, Hq, D) and key (B, S, Hk, D): strided views of one projection output."""
    qkv = torch.randn(B, S, (Hq + 2 * Hk) * D, dtype=dtype)
    q = qkv[..., : Hq * D].unflatten(-1, (Hq, D))
    k = qkv[..., Hq * D : (Hq + Hk) * D].unflatten(-1, (Hk, D))
    return q, k


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("norm", FORMS)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotary_dim", [64, 32])
@pytest.mark.parametrize("affine", ["weight", "weight+bias", "none", "bias"])
def test_forms_against_float64(dtype, norm, interleaved, rotary_dim, affine):
    B, S, Hq, Hk, D = 2, 5, 4, 2, 64
    q, k = fused_projection(B, S, Hq, Hk, D, dtype)
    wq, bq = params(norm, Hq, D, torch.float32, "weight" in affine, "bias" in affine)
    wk, bk = params(norm, Hk, D, dtype, "weight" in affine, "bias" in affine)
    cos, sin = torch.randn(1, S, 1, rotary_dim // 2), torch.randn(1, S, 1, rotary_dim // 2)
    poison_heap(q, k)
    oq, ok = norm_rope(q, k, wq, wk, cos, sin, q_bias=bq, k_bias=bk, eps=1e-5, norm=norm,
                       interleaved=interleaved, table_width="half")
    assert oq.dtype == dtype and oq.shape == q.shape and ok.shape == k.shape
    assert oq.is_contiguous() and ok.is_contiguous()
    close(oq, oracle(q, wq, bq, cos, sin, 1e-5, norm, interleaved), dtype)
    close(ok, oracle(k, wk, bk, cos, sin, 1e-5, norm, interleaved), dtype)


@pytest.mark.parametrize("norm", FORMS)
def test_head_first_and_full_tables(norm):
    B, S, H, D = 2, 6, 3, 32
    q = torch.randn(B, S, H, D).transpose(1, 2)  # (B, H, S, D), not contiguous
    k = torch.randn(B, H, S, D)
    w, b = params(norm, H, D, torch.float32, True, norm == "layer")
    ang = torch.rand(S, D // 2) * 6
    full_c, full_s = ang.cos().repeat_interleave(2, -1), ang.sin().repeat_interleave(2, -1)
    oq, ok = norm_rope(q, k, w, w, full_c, full_s, q_bias=b, k_bias=b, norm=norm,
                       interleaved=True, head_first=True)
    if norm == "rms_across_heads":  # the oracle normalizes dims -2 and -1: heads there
        want = oracle(q.transpose(1, 2), w, b, ang.cos()[:, None], ang.sin()[:, None], 1e-6,
                      norm, True).transpose(1, 2)
    else:
        want = oracle(q, w, b, ang.cos(), ang.sin(), 1e-6, norm, True)
    close(oq, want, torch.float32)
    assert ok.shape == k.shape


@pytest.mark.parametrize("norm", ["rms", "layer"])
def test_per_head_tables(norm):
    # Mochi's tables are (seq, heads, D/2): each head its own angles.
    S, H, D = 7, 3, 16
    q, k = torch.randn(2, S, H, D), torch.randn(2, S, H, D)
    cos, sin = torch.randn(1, S, H, D // 2), torch.randn(1, S, H, D // 2)
    w, b = params(norm, H, D, torch.float32, True, True)
    oq, ok = norm_rope(q, k, w, None, cos, sin, q_bias=b, norm=norm, interleaved=True,
                       table_width="half")
    close(oq, oracle(q, w, b, cos, sin, 1e-6, norm, True), torch.float32)
    close(ok, oracle(k, None, None, cos, sin, 1e-6, norm, True), torch.float32)


@pytest.mark.parametrize("layout", ["one_row", "contiguous_tokens"])
def test_across_heads_with_merged_leading_dims(layout):
    # Tables broadcast over every leading dim: the kernel's token walk merges batch, seq and
    # heads into one run of rows; the norm still groups each token's own heads.
    B, S, H, D = 2, 3, 5, 16
    q, k = torch.randn(B, S, H, D), torch.randn(B, S, 2, D)
    if layout == "one_row":
        cos, sin = torch.randn(D // 2), torch.randn(D // 2)
    else:
        cos, sin = torch.randn(1, 1, 1, D // 2), torch.randn(1, 1, 1, D // 2)
    wq, _ = params("rms_across_heads", H, D, torch.float32)
    wk, _ = params("rms_across_heads", 2, D, torch.float32)
    oq, ok = norm_rope(q, k, wq, wk, cos, sin, norm="rms_across_heads", table_width="half")
    close(oq, oracle(q, wq, None, cos, sin, 1e-6, "rms_across_heads", False), torch.float32)
    close(ok, oracle(k, wk, None, cos, sin, 1e-6, "rms_across_heads", False), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("table_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", FORMS)
def test_native_equals_reference(dtype, table_dtype, norm):
    q, k = torch.randn(3, 5, 4, 24, dtype=dtype), torch.randn(3, 5, 2, 24, dtype=dtype)
    wq, bq = params(norm, 4, 24, torch.bfloat16, True, True)
    wk, _ = params(norm, 2, 24, torch.float64)
    cos = torch.randn(3, 5, 1, 8, dtype=table_dtype)
    sin = torch.randn(3, 5, 1, 8, dtype=table_dtype)
    for interleaved in (False, True):
        a = ops.norm_rope(q, k, wq, wk, bq, None, cos, sin, 1e-4, norm, interleaved)
        b = reference.norm_rope(q, k, wq, wk, bq, None, cos, sin, 1e-4, norm, interleaved)
        for x, y in zip(a, b):  # sums in another order: equal up to float rounding
            close(x, y, dtype)


@pytest.mark.parametrize("isa", rope_ext._library.CPU_ISA_NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_every_cpu_variant_agrees_with_the_oracle(dtype, isa):
    if not native_cpu():
        pytest.skip("no native CPU library")
    if isa not in runnable():
        pytest.skip(f"this CPU cannot run the {isa} kernels")
    q, k = fused_projection(2, 9, 3, 2, 128, dtype)
    cos, sin = torch.randn(1, 9, 1, 64), torch.randn(1, 9, 1, 64)
    before = rope_ext.cpu_isa()
    try:
        assert rope_ext.set_cpu_isa(isa) == isa
        for norm in FORMS:
            wq, bq = params(norm, 3, 128, dtype, True, norm == "layer")
            wk, bk = params(norm, 2, 128, dtype, norm != "layer", False)
            for interleaved in (False, True):
                oq, ok = ops.norm_rope(q, k, wq, wk, bq, bk, cos, sin, 1e-6, norm, interleaved)
                close(oq, oracle(q, wq, bq, cos, sin, 1e-6, norm, interleaved), dtype)
                close(ok, oracle(k, wk, bk, cos, sin, 1e-6, norm, interleaved), dtype)
    finally:
        rope_ext.set_cpu_isa(before)


@pytest.mark.parametrize("isa", runnable())
@pytest.mark.parametrize("table_rows", ["S", "BS"])
@pytest.mark.parametrize("n_threads", [1, 2])
def test_head_first_contiguous_rows_far_apart(isa, table_rows, n_threads):
    # q and k (B, H, S, D) contiguous with (1, 1, S, h) or (B, 1, S, h) tables: the CPU walk
    # takes a table row's B * H (or H) rows as one token's heads (checks.h take_outer_heads), the
    # norm across heads keeps the view's order. rope.qk_norm_rope and every norm_rope form
    # against float64, on every kernel variant, the rows split across threads or not.
    if not native_cpu():
        pytest.skip("no native CPU library")
    B, Hq, Hk, S, D, rd = 2, 4, 2, 150, 64, 48
    ang = torch.rand(B if table_rows == "BS" else 1, 1, S, rd // 2) * 40
    cos, sin = ang.cos(), ang.sin()
    before, serving = torch.get_num_threads(), rope_ext.cpu_isa()
    try:
        torch.set_num_threads(n_threads)
        rope_ext.set_cpu_isa(isa)
        for dtype in (torch.float32, torch.bfloat16):
            q, k = torch.randn(B, Hq, S, D, dtype=dtype), torch.randn(B, Hk, S, D, dtype=dtype)
            wq, wk = torch.randn(D, dtype=dtype), torch.randn(D, dtype=dtype)
            for interleaved in (False, True):
                poison_heap(q, k)
                oq, ok = ops.qk_norm_rope(q, k, wq, wk, cos, sin, 1e-6, False, interleaved)
                close(oq, oracle(q, wq, None, cos, sin, 1e-6, "rms", interleaved), dtype)
                close(ok, oracle(k, wk, None, cos, sin, 1e-6, "rms", interleaved), dtype)
                for norm in FORMS:
                    if norm == "rms_across_heads":  # the norm runs over dims -2, -1: heads there
                        xq, xk = q.transpose(1, 2), k.transpose(1, 2)
                        c, s_ = cos.transpose(1, 2), sin.transpose(1, 2)
                    else:
                        xq, xk, c, s_ = q, k, cos, sin
                    pq, bq = params(norm, Hq, D, dtype, True, norm == "layer")
                    pk, bk = params(norm, Hk, D, dtype, True, False)
                    poison_heap(xq, xk)
                    oq, ok = ops.norm_rope(xq, xk, pq, pk, bq, bk, c, s_, 1e-6, norm, interleaved)
                    close(oq, oracle(xq, pq, bq, c, s_, 1e-6, norm, interleaved), dtype)
                    close(ok, oracle(xk, pk, bk, c, s_, 1e-6, norm, interleaved), dtype)
    finally:
        torch.set_num_threads(before)
        rope_ext.set_cpu_isa(serving)


@pytest.mark.parametrize("isa", rope_ext._library.CPU_ISA_NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_longer_than_the_stack_buffers(dtype, isa):
    # Rows past the kernels' stack buffers (head_dim > 1024: LTX-Video's flat (B, S, H * D) as
    # one head), summed a block at a time: whole blocks, a tail, strided rows; tables
    # contiguous or read at every other entry of full-width ones (diffusers' interleaved form).
    if not native_cpu():
        pytest.skip("no native CPU library")
    if isa not in runnable():
        pytest.skip(f"this CPU cannot run the {isa} kernels")
    before = rope_ext.cpu_isa()
    try:
        assert rope_ext.set_cpu_isa(isa) == isa
        for D, rot, strided in ((2048, 2048, False), (1304, 1280, False), (1152, 1088, True)):
            base = torch.randn(2, 5, 2, 2 * D if strided else D, dtype=dtype) * 3
            q = base[..., ::2] if strided else base
            k = torch.randn(2, 5, 1, D, dtype=dtype)
            w = torch.randn(D, dtype=dtype)
            wide = torch.rand(1, 5, 1, rot) * 30
            for cos, sin in ((wide.cos()[..., : rot // 2], wide.sin()[..., : rot // 2]),
                             (wide.cos()[..., 0::2], wide.sin()[..., 0::2])):
                for interleaved in (False, True):
                    oq, ok = ops.norm_rope(q, k, w, w, None, None, cos, sin, 1e-6, "rms",
                                           interleaved)
                    close(oq, oracle(q, w, None, cos, sin, 1e-6, "rms", interleaved), dtype)
                    close(ok, oracle(k, w, None, cos, sin, 1e-6, "rms", interleaved), dtype)
    finally:
        rope_ext.set_cpu_isa(before)


def test_empty():
    for shape in ((0, 3, 16), (4, 0, 16)):
        q, k = torch.randn(*shape), torch.randn(*shape)
        for norm in FORMS:
            oq, ok = norm_rope(q, k, None, None, torch.randn(8), torch.randn(8), norm=norm,
                               table_width="half")
            assert oq.shape == q.shape and ok.shape == k.shape


# ---- gradients ----

@pytest.mark.parametrize("norm", FORMS)
@pytest.mark.parametrize("interleaved", [False, True])
def test_gradcheck(norm, interleaved):
    S, D = 3, 8
    d = dict(dtype=torch.float64, requires_grad=True)
    q, k = torch.randn(2, S, 3, D, **d), torch.randn(2, S, 2, D, **d)
    n = (lambda h: h * D) if norm == "rms_across_heads" else (lambda h: D)
    wq, wk = torch.randn(n(3), **d), torch.randn(n(2), **d)
    bq, bk = torch.randn(n(3), **d), torch.randn(n(2), **d)
    cos, sin = torch.randn(1, S, 1, 3, **d), torch.randn(1, S, 1, 3, **d)  # partial rotary

    def f(q, k, wq, wk, bq, bk, cos, sin):
        return norm_rope(q, k, wq, wk, cos, sin, q_bias=bq, k_bias=bk, eps=1e-3, norm=norm,
                         interleaved=interleaved, table_width="half")

    assert torch.autograd.gradcheck(f, (q, k, wq, wk, bq, bk, cos, sin))


@pytest.mark.parametrize("norm", FORMS)
def test_gradients_equal_torch_norms_then_rotation(norm):
    B, S, H, D = 2, 4, 3, 16
    q = torch.randn(B, S, H, D, requires_grad=True)
    k = torch.randn(B, S, H, D, requires_grad=True)
    n = H * D if norm == "rms_across_heads" else D
    w = torch.randn(n, requires_grad=True)
    b = torch.randn(n, requires_grad=True) if norm == "layer" else None
    cos, sin = torch.randn(1, S, 1, D // 2), torch.randn(1, S, 1, D // 2)
    g = torch.randn(B, S, H, D)

    def eager(x):
        if norm == "rms":
            y = torch.nn.functional.rms_norm(x, (D,), w, 1e-6)
        elif norm == "layer":
            y = torch.nn.functional.layer_norm(x, (D,), w, b, 1e-6)
        else:
            y = torch.nn.functional.rms_norm(x.flatten(-2), (H * D,), w, 1e-6).view(x.shape)
        return ops.apply(y, cos, sin, False)

    leaves = (q, k, w) + ((b,) if b is not None else ())
    fq, fk = norm_rope(q, k, w, w, cos, sin, q_bias=b, k_bias=b, norm=norm, table_width="half")
    got = torch.autograd.grad((fq * g).sum() + (fk * 2 * g).sum(), leaves)
    want = torch.autograd.grad((eager(q) * g).sum() + (eager(k) * 2 * g).sum(), leaves)
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("norm", FORMS)
def test_batched_gradients_equal_a_loop(norm):
    # autograd.grad(..., is_grads_batched=True) vmaps the backward over the gradients: the
    # composed backward must not write a batched tensor into one derived from x alone.
    B, S, H, D = 2, 3, 2, 16
    q = torch.randn(B, S, H, D, requires_grad=True)
    k = torch.randn(B, S, 1, D, requires_grad=True)
    n = H * D if norm == "rms_across_heads" else D
    wq = torch.randn(n, requires_grad=True)
    wk = torch.randn(n // H if norm == "rms_across_heads" else n, requires_grad=True)
    b = torch.randn(n) if norm == "layer" else None
    cos, sin = torch.randn(1, S, 1, D // 2), torch.randn(1, S, 1, D // 2)
    fq, _ = norm_rope(q, k, wq, wk, cos, sin, q_bias=b, norm=norm, table_width="half")
    grads = torch.randn(4, *fq.shape)
    batched = torch.autograd.grad(fq, (q, wq), grads, is_grads_batched=True, retain_graph=True)
    for i, g in enumerate(grads):
        for got, want in zip(batched, torch.autograd.grad(fq, (q, wq), g, retain_graph=True)):
            torch.testing.assert_close(got[i], want, rtol=1e-5, atol=1e-5)


# ---- errors ----

def _args(**change):
    a = dict(q=torch.randn(2, 3, 2, 8), k=torch.randn(2, 3, 1, 8), wq=torch.randn(8),
             wk=torch.randn(8), bq=None, bk=None, cos=torch.randn(2, 3, 1, 2),
             sin=torch.randn(2, 3, 1, 2), eps=1e-6, norm="layer")
    a.update(change)
    return a


BAD = [
    (dict(norm="group"), "norm must be 'rms', 'rms_across_heads' or 'layer', got 'group'"),
    (dict(k=torch.randn(2, 3, 1, 8).double()), "key must have the dtype of query"),
    (dict(wq=torch.randn(16)), r"q_weight must have shape \(head_dim,\) = \(8,\)"),
    (dict(bk=torch.ones(8, dtype=torch.int32)), "k_bias must be float16"),
    (dict(norm="rms_across_heads"), r"q_weight must have shape \(num_heads \* head_dim,\) = \(16,\)"),
    (dict(norm="rms_across_heads", wq=torch.randn(16), wk=torch.randn(16),
          k=torch.randn(2, 3, 2, 8), cos=torch.randn(2, 3, 2, 2), sin=torch.randn(2, 3, 2, 2)),
     "cos and sin must be shared by them"),
    (dict(q=torch.randn(2, 1, 1, 1100), k=torch.randn(2, 1, 1, 1100), wq=None, wk=None,
          cos=torch.randn(2), sin=torch.randn(2)), "head_dim must be <= 1024"),
    (dict(eps=-1.0), "eps must be a finite number >= 0"),
    (dict(cos=torch.randn(2, 3, 1, 5)), "cos"),
]


@pytest.mark.parametrize("change,match", BAD)
def test_errors_same_on_both_paths(change, match):
    a = _args(**change)
    call = (a["q"], a["k"], a["wq"], a["wk"], a["bq"], a["bk"], a["cos"], a["sin"], a["eps"],
            a["norm"])
    msgs = []
    fns = [reference.norm_rope] + ([ops.norm_rope] if native_cpu() else [])
    for fn in fns:
        with pytest.raises(RuntimeError, match=match) as e:
            fn(*call)
        msgs.append(str(e.value))
    assert len(set(msgs)) == 1, msgs


# ---- opcheck and torch.compile ----

def _opcheck_samples():
    q, k = torch.randn(2, 5, 3, 16), torch.randn(2, 5, 1, 16)
    cos, sin = torch.randn(1, 5, 1, 8), torch.randn(1, 5, 1, 8)
    return [
        (q, k, torch.randn(16), None, torch.randn(16), None, cos, sin, 1e-6, "layer", True),
        (q, k, torch.randn(48), torch.randn(16), None, None, cos, sin, 1e-6, "rms_across_heads",
         False),
        (q.double().requires_grad_(), k.double(), None, torch.randn(16, requires_grad=True),
         None, torch.randn(16), cos.double(), sin.double(), 1e-5, "rms", False),
    ]


@pytest.mark.parametrize("i", range(3))
def test_opcheck(i):
    torch.library.opcheck(ops.norm_rope.default, _opcheck_samples()[i])


def test_torch_compile_fullgraph_with_backward():
    torch._dynamo.reset()
    S, H, D = 4, 3, 16
    q = torch.randn(1, S, H, D, requires_grad=True)
    k = torch.randn(1, S, H, D, requires_grad=True)
    w = torch.randn(H * D, requires_grad=True)
    cos, sin = torch.randn(1, S, 1, D // 2), torch.randn(1, S, 1, D // 2)

    def f(q, k, w):
        a, b = norm_rope(q, k, w, w, cos, sin, norm="rms_across_heads", table_width="half")
        return (a * a).sum() + (b * 3).sum()

    expect = torch.autograd.grad(f(q, k, w), (q, k, w))
    got = torch.autograd.grad(torch.compile(f, fullgraph=True)(q, k, w), (q, k, w))
    torch.testing.assert_close(got, expect, rtol=1e-5, atol=1e-5)


def test_head_first_across_heads_errors_say_the_dims_are_swapped():
    """With head_first=True and norm="rms_across_heads" the op runs on views with dims -3 and -2
    swapped: its errors describe those views, and say so."""
    q, k = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    per_head = torch.randn(1, 2, 5, 4)  # tables differing by head: refused across heads
    with pytest.raises(RuntimeError, match=r"must be shared by them .* \(with head_first=True and "
                                           r"norm='rms_across_heads' the op sees query, key, cos "
                                           r"and sin with dims -3 and -2 swapped\)$"):
        norm_rope(q, k, None, None, per_head, per_head, norm="rms_across_heads", head_first=True,
                  table_width="half")


@pytest.mark.parametrize("norm", ["rms", "layer", "rms_across_heads"])
def test_double_backward(norm):
    # the backward reuses its temporaries in place, except when it is itself recorded
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 3, 8, dtype=torch.float64, generator=g).requires_grad_()
    k = torch.randn(2, 3, 8, dtype=torch.float64, generator=g).requires_grad_()
    shape = (24,) if norm == "rms_across_heads" else (8,)
    w = torch.randn(shape, dtype=torch.float64, generator=g).requires_grad_()
    ang = torch.randn(2, 1, 4, dtype=torch.float64, generator=g)
    cos, sin = ang.cos(), ang.sin()

    def fn(q, k, w):
        return rope_ext.norm_rope(q, k, w, w, cos, sin, norm=norm, table_width="half")

    assert torch.autograd.gradgradcheck(fn, (q, k, w), fast_mode=True)
