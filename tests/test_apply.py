"""rope.apply / rope_ext.apply_rope against an independent float64 oracle."""

import pytest
import torch

import rope_ext
from conftest import DTYPES, assert_close, native_cpu, poison_like
from rope_oracle import rope, table_for
from test_cpu_isa import runnable

IMPLS = {
    "op": rope_ext.apply_rope,
    "reference": rope_ext.reference.apply_rope,
}


def tables(positions, rotary_dim, dtype):
    cos, sin = table_for(positions, rotary_dim)
    return cos.to(dtype), sin.to(dtype)


# (x shape, cos shape builder) pairs covering the broadcast layouts models use.
B, H, S = 2, 3, 5


def _layouts(rotary_dim):
    h = rotary_dim // 2
    pos_s = torch.randint(0, 4096, (S,))
    pos_bs = torch.randint(0, 4096, (B, S))
    return {
        "BHSD_11Sh": ((B, H, S), table_for(pos_s, rotary_dim), (1, 1, S, h)),
        "BSHD_1S1h": ((B, S, H), table_for(pos_s, rotary_dim), (1, S, 1, h)),
        "BSHD_BS1h": ((B, S, H), table_for(pos_bs, rotary_dim), (B, S, 1, h)),
        "SD_Sh": ((S,), table_for(pos_s, rotary_dim), (S, h)),
    }


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("layout", ["BHSD_11Sh", "BSHD_1S1h", "BSHD_BS1h", "SD_Sh"])
@pytest.mark.parametrize("head_dim,rotary_dim", [(64, 64), (80, 32), (128, 128), (96, 48)])
def test_matches_oracle(impl, dtype, interleaved, layout, head_dim, rotary_dim):
    lead, (cos64, sin64), cos_shape = _layouts(rotary_dim)[layout]
    x = torch.randn(*lead, head_dim, dtype=dtype)
    table_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    cos = cos64.reshape(cos_shape).to(table_dtype)
    sin = sin64.reshape(cos_shape).to(table_dtype)
    out = IMPLS[impl](x, cos, sin, interleaved=interleaved)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert_close(out, rope(x, cos, sin, interleaved), dtype)
    # The pass-through dims are copied bit for bit.
    assert torch.equal(out[..., rotary_dim:], x[..., rotary_dim:])


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("x_dtype,table_dtype", [
    (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float64),
    (torch.float32, torch.float16), (torch.float32, torch.float64), (torch.float64, torch.float32),
])
def test_mixed_table_dtypes(impl, x_dtype, table_dtype):
    x = torch.randn(4, 7, 64, dtype=x_dtype)
    cos, sin = tables(torch.randint(0, 100, (4, 1)), 64, table_dtype)
    out = IMPLS[impl](x, cos, sin)
    # Math is in float32 (float64 for float64 x) on the table values as stored.
    assert_close(out, rope(x, cos, sin, False), x_dtype)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_non_contiguous_inputs(impl, interleaved, dtype):
    T, Hq, Hk, D = 9, 4, 2, 64
    qkv = torch.randn(T, (Hq + 2 * Hk) * D, dtype=dtype)
    q = qkv[:, : Hq * D].view(T, Hq, D)  # a strided view into a fused qkv buffer
    k = qkv[:, Hq * D : (Hq + Hk) * D].view(T, Hk, D)
    strided_last = torch.randn(T, Hq, 2 * D, dtype=dtype)[..., ::2]  # last dim not contiguous
    transposed = torch.randn(Hq, T, D, dtype=dtype).transpose(0, 1)
    pos = torch.randint(0, 1000, (T,))
    cos, sin = tables(pos, 48, torch.float32)
    cos_nc = torch.randn(48 // 2, T).t()  # non-contiguous table
    sin_nc = torch.randn(48 // 2, T).t()
    for x in (q, k, strided_last, transposed):
        assert not x.is_contiguous()
        out = IMPLS[impl](x, cos.unsqueeze(1), sin.unsqueeze(1), interleaved=interleaved)
        assert out.is_contiguous()
        assert_close(out, rope(x, cos.unsqueeze(1), sin.unsqueeze(1), interleaved), dtype)
        out = IMPLS[impl](x, cos_nc.unsqueeze(1), sin_nc.unsqueeze(1), interleaved=interleaved)
        assert_close(out, rope(x, cos_nc.unsqueeze(1), sin_nc.unsqueeze(1), interleaved), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("perm", [(0, 1, 2), (0, 2, 1), (1, 0, 2), (1, 2, 0), (2, 0, 1), (2, 1, 0)])
def test_any_memory_order_of_leading_dims(perm, dtype):
    # x stored (B, S, H, D) but seen in any order of its leading dims (transformers' q is the
    # (B, H, S, D) view): the op walks x's rows in memory order, writing a contiguous output of
    # the view's shape; apply.out into a poisoned buffer shows every element written. Rows
    # enough to be split across threads, the table broadcast over the heads.
    Bn, Sn, Hn, D = 2, 300, 6, 64
    base = torch.randn(Bn, Sn, Hn, D, dtype=dtype)
    ang = torch.rand(1, Sn, 1, D // 2) * 50
    x = base.permute(*perm, 3)
    cos, sin = ang.cos().permute(*perm, 3), ang.sin().permute(*perm, 3)
    want = rope(x, cos, sin, False)
    out = rope_ext.apply_rope(x, cos, sin)
    assert out.is_contiguous() and out.shape == x.shape
    assert_close(out, want, dtype)
    poisoned = torch.full(x.shape, float("nan"), dtype=dtype)
    torch.ops.rope.apply.out(x, cos, sin, False, out=poisoned)
    assert torch.equal(poisoned, out)
    grad = torch.ops.rope.apply_backward(x, cos, sin, False)
    assert_close(grad, rope(x, cos, sin, False, inverse=True), dtype)


@pytest.mark.parametrize("isa", runnable())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("table_rows", ["S", "BS"])
@pytest.mark.parametrize("n_threads", [1, 2])
def test_rows_sharing_a_table_row_far_apart(isa, dtype, table_rows, n_threads):
    # x (B, H, S, D) contiguous with (1, 1, S, h) or (B, 1, S, h) tables: a table row's rows lie
    # S rows apart, and the CPU walk takes them as one token's heads (rope_cpu.cpp
    # take_outer_heads). Every row written (a poisoned out=), forward and inverse, partial
    # rotary with its pass-through dims, both pair layouts, a strided x too, on every kernel
    # variant, split across threads or not.
    if not native_cpu():
        pytest.skip("native library not built")
    Bn, Hn, Sn, D, rd = 2, 5, 601, 96, 64  # over 1 MiB: a fresh output is backed at once
    pos = torch.randint(0, 4096, (Bn if table_rows == "BS" else 1, Sn))
    cos64, sin64 = table_for(pos, rd)
    cos, sin = cos64[:, None].float(), sin64[:, None].float()
    if dtype == torch.bfloat16:
        cos, sin = cos.bfloat16(), sin.bfloat16()
    before, serving = torch.get_num_threads(), rope_ext.cpu_isa()
    try:
        torch.set_num_threads(n_threads)
        rope_ext.set_cpu_isa(isa)
        for x in (torch.randn(Bn, Hn, Sn, D, dtype=dtype),
                  torch.randn(Bn, Hn, Sn, 2 * D, dtype=dtype)[..., ::2]):
            for interleaved in (False, True):
                out = poison_like(x.contiguous())
                torch.ops.rope.apply.out(x, cos, sin, interleaved, out=out)
                assert_close(out, rope(x, cos, sin, interleaved), dtype)
                assert torch.equal(out[..., rd:], x[..., rd:])
                assert torch.equal(torch.ops.rope.apply(x, cos, sin, interleaved), out)
                back = torch.ops.rope.apply_backward(x, cos, sin, interleaved)
                assert_close(back, rope(x, cos, sin, interleaved, inverse=True), dtype)
    finally:
        torch.set_num_threads(before)
        rope_ext.set_cpu_isa(serving)


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("table_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("head_dim,rotary_dim,broadcast", [(2048, 2048, False), (96, 64, True),
                                                            (1280, 1216, True)])
def test_tables_of_every_other_entry(x_dtype, table_dtype, interleaved, head_dim, rotary_dim,
                                     broadcast):
    # Tables read at every other entry of a wider one (diffusers' interleaved full-width
    # tables, LTX-Video's one row per row of x): a column stride of 2, in blocks of pairs past
    # the first (head_dim 2048: 1024 pairs), forward and inverse, broadcast over heads or not.
    S, H = 5, 3
    x = torch.randn(S, H, head_dim, dtype=x_dtype)
    rows = (S, 1) if broadcast else (S, H)
    wide = (torch.rand(*rows, rotary_dim) * 40).to(table_dtype)
    cos, sin = wide.cos()[..., 0::2], wide.sin()[..., 0::2]
    assert cos.stride(-1) == 2
    out = rope_ext.apply_rope(x, cos, sin, interleaved=interleaved)
    assert_close(out, rope(x, cos, sin, interleaved), x_dtype)
    assert torch.equal(out[..., rotary_dim:], x[..., rotary_dim:])
    back = torch.ops.rope.apply_backward(x, cos, sin, interleaved)
    assert_close(back, rope(x, cos, sin, interleaved, inverse=True), x_dtype)


@pytest.mark.parametrize("impl", IMPLS)
def test_large_parallel_rows(impl):
    # Enough rows to be split across threads; offsets must stay right at every chunk start.
    x = torch.randn(3, 700, 5, 128)
    cos, sin = tables(torch.randint(0, 10_000, (700,)), 128, torch.float32)
    cos, sin = cos[None, :, None], sin[None, :, None]
    out = IMPLS[impl](x, cos, sin, interleaved=True)
    assert_close(out, rope(x, cos, sin, True), torch.float32)


@pytest.mark.parametrize("impl", IMPLS)
def test_empty_and_degenerate_shapes(impl):
    cos, sin = tables(torch.arange(3), 8, torch.float32)
    x = torch.randn(0, 3, 8)
    assert IMPLS[impl](x, cos[None], sin[None]).shape == (0, 3, 8)
    x1 = torch.randn(8)  # no leading dims at all
    c1, s1 = tables(torch.tensor(7), 8, torch.float32)
    assert_close(IMPLS[impl](x1, c1, s1), rope(x1, c1, s1, False), torch.float32)


def test_backward_op_is_inverse_rotation():
    x = torch.randn(2, 6, 4, 64, dtype=torch.float64)
    cos, sin = tables(torch.randint(0, 500, (6,)), 64, torch.float64)
    cos, sin = cos[None, :, None], sin[None, :, None]
    for interleaved in (False, True):
        y = torch.ops.rope.apply(x, cos, sin, interleaved)
        back = torch.ops.rope.apply_backward(y, cos, sin, interleaved)
        assert_close(back, x, torch.float64)
        expected = rope(x, cos, sin, interleaved, inverse=True)
        assert_close(torch.ops.rope.apply_backward(x, cos, sin, interleaved), expected,
                     torch.float64)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("seq,heads", [(5, 3), (4, 4)])
def test_tables_with_fewer_dims_are_refused_not_realigned(impl, seq, heads):
    # flash-attn's (seq, rotary_dim/2) tables for x (batch, seq, heads, head_dim): right-aligned
    # broadcasting would pair seq with heads (a silent wrong result when seq == heads).
    x = torch.randn(2, seq, heads, 64)
    cos, sin = tables(torch.randint(0, 100, (seq,)), 64, torch.float32)
    x0 = x.clone()
    with pytest.raises(RuntimeError, match=r"have 2 dims but x of shape \[2, \d, \d, 64\] has 4: "
                       r"give them x's number of dims.*cos\[None, :, None, :\]"):
        IMPLS[impl](x, cos, sin)
    assert torch.equal(x, x0)
    with pytest.raises(RuntimeError, match="have 3 dims"):
        IMPLS[impl](x, cos[:, None], sin[:, None])
    # Lined up explicitly, it is the right rotation.
    out = IMPLS[impl](x, cos[None, :, None], sin[None, :, None])
    assert_close(out, rope(x, cos[None, :, None], sin[None, :, None], False), torch.float32)
    # One row for every position (1-D) needs no alignment.
    out = IMPLS[impl](x, cos[1], sin[1])
    assert_close(out, rope(x, cos[1], sin[1], False), torch.float32)
