"""rope.apply_ / rope_ext.apply_rope_: in-place query+key rotation by gathered positions."""

import pytest
import torch

import rope_ext
from conftest import DTYPES, assert_close
from rope_oracle import rope

IMPLS = {"op": rope_ext.apply_rope_, "reference": rope_ext.reference.apply_rope_}


def expected(x, positions, cache, interleaved):
    half = cache.shape[1] // 2
    rows = cache.to(torch.float64)[positions.long()].unsqueeze(-2)
    return rope(x, rows[..., :half], rows[..., half:], interleaved)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("pos_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("lead", [(11,), (2, 5)])
def test_gqa_matches_oracle(impl, dtype, interleaved, pos_dtype, lead):
    Hq, Hk, D, R, max_pos = 8, 2, 96, 64, 4096
    cache = rope_ext.cos_sin_cache(max_pos, R, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
    q = torch.randn(*lead, Hq, D, dtype=dtype)
    k = torch.randn(*lead, Hk, D, dtype=dtype)
    pos = torch.randint(0, max_pos, lead, dtype=pos_dtype)
    q0, k0 = q.clone(), k.clone()
    out_q, out_k = IMPLS[impl](q, k, pos, cache, interleaved=interleaved)
    assert out_q is q and out_k is k
    assert_close(q, expected(q0, pos, cache, interleaved), dtype)
    assert_close(k, expected(k0, pos, cache, interleaved), dtype)
    assert torch.equal(q[..., R:], q0[..., R:]) and torch.equal(k[..., R:], k0[..., R:])


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("interleaved", [False, True])
def test_fused_qkv_views_leave_value_untouched(impl, interleaved):
    T, Hq, Hk, D = 13, 4, 2, 64
    qkv = torch.randn(T, (Hq + 2 * Hk) * D, dtype=torch.bfloat16)
    before = qkv.clone()
    q = qkv[:, : Hq * D].view(T, Hq, D)
    k = qkv[:, Hq * D : (Hq + Hk) * D].view(T, Hk, D)
    cache = rope_ext.cos_sin_cache(64, D)
    pos = torch.randint(0, 64, (T,))
    IMPLS[impl](q, k, pos, cache, interleaved=interleaved)
    assert torch.equal(qkv[:, (Hq + Hk) * D :], before[:, (Hq + Hk) * D :])  # v untouched
    assert_close(q, expected(before[:, : Hq * D].view(T, Hq, D), pos, cache, interleaved), torch.bfloat16)
    assert_close(k, expected(before[:, Hq * D : (Hq + Hk) * D].view(T, Hk, D), pos, cache, interleaved),
                 torch.bfloat16)


@pytest.mark.parametrize("impl", IMPLS)
def test_strided_last_dim_and_noncontiguous_positions(impl):
    q_buf = torch.randn(6, 3, 2 * 32)
    q = q_buf[..., ::2]
    pos = torch.randint(0, 50, (6, 2))[:, 1]
    cache = rope_ext.cos_sin_cache(50, 16)[:, :].t().contiguous().t()  # strided cache
    untouched = q_buf[..., 1::2].clone()
    q0 = q.clone()
    IMPLS[impl](q, None, pos, cache)
    assert_close(q, expected(q0, pos, cache, False), torch.float32)
    assert torch.equal(q_buf[..., 1::2], untouched)


@pytest.mark.parametrize("impl", IMPLS)
def test_key_none_and_empty(impl):
    cache = rope_ext.cos_sin_cache(8, 8)
    q = torch.randn(0, 2, 8)
    IMPLS[impl](q, None, torch.zeros(0, dtype=torch.long), cache)
    q = torch.randn(3, 2, 8)
    q0 = q.clone()
    IMPLS[impl](q, None, torch.tensor([0, 3, 7]), cache)
    assert_close(q, expected(q0, torch.tensor([0, 3, 7]), cache, False), torch.float32)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("interleaved", [False, True])
def test_relative_position_property(impl, interleaved):
    """<RoPE(q, m), RoPE(k, n)> depends only on n - m (RoPE's defining property)."""
    D, shift = 64, 1234
    cache = rope_ext.cos_sin_cache(4096, D, dtype=torch.float64)
    q = torch.randn(1, 1, D, dtype=torch.float64)
    k = torch.randn(1, 1, D, dtype=torch.float64)
    scores = []
    for m, n in ((5, 17), (5 + shift, 17 + shift)):
        qm, kn = q.clone(), k.clone()
        IMPLS[impl](qm, None, torch.tensor([m]), cache, interleaved=interleaved)
        IMPLS[impl](kn, None, torch.tensor([n]), cache, interleaved=interleaved)
        scores.append((qm * kn).sum())
    torch.testing.assert_close(scores[0], scores[1], rtol=1e-12, atol=1e-12)
    # ... and does depend on the offset: a different gap gives a different score.
    qm, kn = q.clone(), k.clone()
    IMPLS[impl](qm, None, torch.tensor([5]), cache, interleaved=interleaved)
    IMPLS[impl](kn, None, torch.tensor([18]), cache, interleaved=interleaved)
    assert abs(float((qm * kn).sum() - scores[0])) > 1e-6


def test_inplace_agrees_with_copy_op():
    T, H, D = 7, 4, 128
    cache = rope_ext.cos_sin_cache(100, D)
    pos = torch.randint(0, 100, (T,))
    x = torch.randn(T, H, D, dtype=torch.float16)
    rows = cache[pos].unsqueeze(1)
    copy = rope_ext.apply_rope(x, rows[..., : D // 2], rows[..., D // 2 :])
    rope_ext.apply_rope_(x, None, pos, cache)
    assert torch.equal(copy, x)
