"""Positions for every layout: packed variable-length sequences (varlen_positions), flat q/k with
an explicit head_size, and the out-of-place positions op, against an independent float64 oracle."""

import re

import pytest
import torch

import rope_ext
from conftest import assert_close
from rope_oracle import rope, table_for


def oracle_at(x, positions, rotary_dim, interleaved):
    cos, sin = table_for(positions, rotary_dim)
    return rope(x, cos.unsqueeze(-2), sin.unsqueeze(-2), interleaved)


@pytest.mark.parametrize("offsets", ["zero", "int", "tensor"])
def test_varlen_positions(offsets):
    cu = torch.tensor([0, 3, 3, 7, 12], dtype=torch.int32)  # sequences of 3, 0, 4, 5 tokens
    off = {"zero": 0, "int": 5, "tensor": torch.tensor([10, 20, 30, 40])}[offsets]
    pos = rope_ext.varlen_positions(cu, 14, off)  # 2 padding tokens past the end
    want = []
    for b in range(4):
        o = off if isinstance(off, int) else int(off[b])
        want += [o + t for t in range(int(cu[b + 1] - cu[b]))]
    assert pos.tolist() == want + [-1, -1]
    assert pos.dtype == torch.int64
    assert rope_ext.varlen_positions(cu, 12, off, dtype=torch.int32).dtype == torch.int32


def test_varlen_positions_rejects_bad_arguments():
    with pytest.raises(ValueError, match="cu_seqlens must be a 1-D int32 or int64 tensor"):
        rope_ext.varlen_positions(torch.tensor([[0, 1]]), 1)
    with pytest.raises(ValueError, match=r"seqlen_offsets must be an int or an int32/int64 tensor of shape \(2,\)"):
        rope_ext.varlen_positions(torch.tensor([0, 1, 2]), 2, torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match=r"seqlen_offsets must be on cu_seqlens' device \(cpu\), got meta"):
        rope_ext.varlen_positions(torch.tensor([0, 1, 2]), 2, torch.tensor([1, 2], device="meta"))


@pytest.mark.parametrize("cu, bad", [
    ([0, 4, 2, 5], "cu_seqlens[2] = 2 < cu_seqlens[1] = 4"),  # overlapping sequences
    ([-1, 2, 5], "cu_seqlens[0] = -1"),                       # a sequence starts before the batch
    ([0, 3, 9], "cu_seqlens[-1] = 9"),                        # ... or ends past it
])
@pytest.mark.parametrize("many", [False, True])  # a few sequences (a list check), many (tensor ops)
def test_varlen_positions_refuses_sequences_out_of_order_or_outside_the_batch(cu, bad, many):
    if many:  # the same fault after 100 well-formed empty sequences
        cu = [0] * 100 + cu if cu[0] >= 0 else cu + [cu[-1]] * 100
        bad = re.sub(r"\[(\d+)\]", lambda m: f"[{int(m.group(1)) + 100}]", bad) if cu[0] >= 0 else bad
    for dtype in (torch.int32, torch.int64):
        with pytest.raises(ValueError, match=re.escape(
                f"cu_seqlens must be non-decreasing, from >= 0 up to <= total_tokens = 5, got {bad}")):
            rope_ext.varlen_positions(torch.tensor(cu, dtype=dtype), 5)
    assert rope_ext.varlen_positions(torch.tensor([0, 0, 5, 5]), 5).tolist() == [0, 1, 2, 3, 4]


def test_drop_ins_name_their_own_sequence_bounds():
    from rope_ext.compat import flash_attn, flashinfer
    cu = torch.tensor([0, 4, 2, 5], dtype=torch.int32)
    cos, sin = rope_ext.cos_sin_cache(16, 8).chunk(2, dim=-1)
    x = torch.randn(5, 2, 8)
    with pytest.raises(ValueError, match=re.escape("cu_seqlens must be non-decreasing, from >= 0 "
                                                   "up to <= x.size(0) = 5, got cu_seqlens[2] = 2")):
        flash_attn.apply_rotary_emb(x, cos, sin, cu_seqlens=cu, max_seqlen=4)
    q, k = torch.randn(5, 2, 8), torch.randn(5, 1, 8)
    q0, k0 = q.clone(), k.clone()
    with pytest.raises(ValueError, match=re.escape("indptr must be non-decreasing, from >= 0 up to "
                                                   "<= q.size(0) = 5, got indptr[-1] = 9")):
        flashinfer.apply_rope_inplace(q, k, torch.tensor([0, 3, 9]), torch.zeros(2, dtype=torch.int64))
    assert torch.equal(q, q0) and torch.equal(k, k0)


def test_packed_sequences_rotate_each_from_its_offset_and_padding_is_refused():
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    x = torch.randn(9, 3, 64)
    cache = rope_ext.cos_sin_cache(64, 64)
    pos = rope_ext.varlen_positions(cu, 9, torch.tensor([7, 0]))
    out = rope_ext.apply_rope_at(x, pos, cache)
    assert_close(out[:4], oracle_at(x[:4], torch.arange(7, 11), 64, False), torch.float32)
    assert_close(out[4:], oracle_at(x[4:], torch.arange(0, 5), 64, False), torch.float32)
    padded = rope_ext.varlen_positions(cu, 10)
    with pytest.raises(RuntimeError, match=r"positions must lie in \[0, 64\).*got -1 at flat index 9"):
        rope_ext.apply_rope_at(torch.randn(10, 3, 64), padded, cache)


def test_varlen_positions_compile_without_graph_break():
    torch._dynamo.reset()
    cache = rope_ext.cos_sin_cache(64, 32)

    def step(x, cu, off):
        return rope_ext.apply_rope_at(x, rope_ext.varlen_positions(cu, x.shape[0], off), cache)

    x = torch.randn(11, 2, 32)
    cu = torch.tensor([0, 5, 11], dtype=torch.int32)
    off = torch.tensor([3, 9])
    compiled = torch.compile(step, fullgraph=True)
    torch.testing.assert_close(compiled(x, cu, off), step(x, cu, off), rtol=0, atol=0)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flat_query_and_key_views_of_a_fused_qkv_buffer(interleaved, dtype):
    T, hq, hk, d = 7, 4, 2, 64
    qkv = torch.randn(T, (hq + 2 * hk) * d, dtype=dtype)
    q, k = qkv[:, : hq * d], qkv[:, hq * d : (hq + hk) * d]  # flat (T, H * head_size) views
    v_before = qkv[:, (hq + hk) * d :].clone()
    pos = torch.randint(0, 100, (T,))
    cache = rope_ext.cos_sin_cache(100, 48)  # partial rotary
    want_q = oracle_at(q.unflatten(-1, (hq, d)), pos, 48, interleaved).flatten(-2)
    want_k = oracle_at(k.unflatten(-1, (hk, d)), pos, 48, interleaved).flatten(-2)
    out_q = rope_ext.apply_rope_at(q, pos, cache, interleaved=interleaved, head_size=d)
    assert out_q.shape == q.shape
    assert_close(out_q, want_q, dtype)
    res = rope_ext.apply_rope_(q, k, pos, cache, interleaved=interleaved, head_size=d)
    assert res[0] is q and res[1] is k
    assert_close(q, want_q, dtype)
    assert_close(k, want_k, dtype)
    assert torch.equal(qkv[:, (hq + hk) * d :], v_before)


def test_flat_width_not_a_multiple_of_head_size_is_refused():
    q = torch.randn(3, 100)
    q0 = q.clone()
    with pytest.raises(ValueError, match=r"query of shape \[3, 100\]: its last dim 100 must be a multiple "
                                         r"of head_size = 64"):
        rope_ext.apply_rope_(q, None, torch.arange(3), rope_ext.cos_sin_cache(4, 64), head_size=64)
    assert torch.equal(q, q0)
    with pytest.raises(ValueError, match="head_size must be a positive int"):
        rope_ext.apply_rope_at(q, torch.arange(3), rope_ext.cos_sin_cache(4, 64), head_size=0)


def test_odd_width_table_is_refused_like_apply_():
    cache = torch.randn(8, 9)
    x = torch.randn(3, 2, 16)
    with pytest.raises(RuntimeError, match=r"rope.apply_positions.cache: rotary_dim = cos_sin_cache.size\(1\) = 9 must be even"):
        rope_ext.apply_rope_at(x, torch.arange(3), cache)
    with pytest.raises(RuntimeError, match=r"rotary_dim = cos_sin_cache.size\(1\) = 9 must be even"):
        rope_ext.apply_rope_(x, None, torch.arange(3), cache)


@pytest.mark.parametrize("call", ["apply_rope_at", "apply_positions", "apply_rope_", "apply_mrope_"])
def test_a_zero_width_table_passes_x_through_and_gets_a_zero_width_gradient(call):
    # rotary_dim 0 is a legal table: x is copied, and the table's gradient is (max_position, 0)
    # (the backward once reshaped an empty gradient to (-1, 0), which torch calls ambiguous)
    x = torch.randn(3, 2, 8, dtype=torch.float64, requires_grad=True)
    cache = torch.rand(5, 0, dtype=torch.float64, requires_grad=True)
    positions = torch.randint(0, 5, (3,))
    if call == "apply_rope_at":
        y = rope_ext.apply_rope_at(x, positions, cache)
    elif call == "apply_positions":
        y = torch.ops.rope.apply_positions(x, positions, cache[:, :0], cache[:, :0])
    elif call == "apply_rope_":
        y = x.clone()
        rope_ext.apply_rope_(y, None, positions, cache)
    else:
        y = x.clone()
        rope_ext.apply_mrope_(y, None, positions.expand(3, 3), cache, [0, 0, 0])
    grad = torch.randn_like(y)
    y.backward(grad)
    assert torch.equal(y.detach(), x.detach())
    assert torch.equal(x.grad, grad)
    assert cache.grad.shape == (5, 0)
