"""Key and value caches that are views of one buffer, as vLLM's and FlashInfer's attention
backends allocate them: kv[:, 0] and kv[:, 1] of (num_blocks, 2, block_size, heads, head_dim),
or the column ranges of (num_blocks, block_size, heads, head_dim + value_dim). Their elements
interleave in memory without meeting: every path accepts them and writes what it writes into
separate caches, and still refuses views that do share an element."""

import itertools
import random

import pytest
import torch

import rope_ext
from conftest import assert_compiled_like_eager, native_cpu
from rope_ext import _checks
from rope_ext import reference
from rope_ext._qk_norm import reference as qk_reference

FP8 = torch.float8_e4m3fn


def addresses(t):
    """The storage offsets of t's elements."""
    ranges = [range(n) for n in t.shape]
    return {t.storage_offset() + sum(i * s for i, s in zip(ix, t.stride()))
            for ix in itertools.product(*ranges)}


def bits(t):
    """t's elements as integers of their size: NaN codes compare equal, and every bit counts."""
    return t.view({1: torch.uint8, 4: torch.int32}[t.element_size()])


def layouts(blocks, block_size, heads, head_dim, value_dim, dtype):
    """name -> (key_cache, value_cache, the buffer)."""
    kv = torch.zeros(blocks, 2, block_size, heads, max(head_dim, value_dim), dtype=dtype)
    split = torch.zeros(blocks, block_size, heads, head_dim + value_dim, dtype=dtype)
    head_major = torch.zeros(blocks, heads, 2, block_size, max(head_dim, value_dim), dtype=dtype)
    return {
        "kv[:, 0], kv[:, 1]": (kv[:, 0, ..., :head_dim], kv[:, 1, ..., :value_dim], kv),
        "[key | value] columns": (split[..., :head_dim], split[..., head_dim:], split),
        "heads first, then key and value": (head_major[:, :, 0, :, :head_dim].transpose(1, 2),
                                            head_major[:, :, 1, :, :value_dim].transpose(1, 2),
                                            head_major),
    }


def serving_calls(value_dim):
    """(name, fn(q, k, v, pos, table, kc, vc, slots, fp8, **extra), its reference, differs)"""
    w = torch.rand(16) + 0.5

    def cache_kw(fp8):
        return (dict(kv_cache_dtype="fp8", k_scale=torch.tensor([0.5]), v_scale=torch.tensor([2.0]))
                if fp8 else {})

    def rope_cache(fn):
        return lambda q, k, v, pos, table, kc, vc, slots, fp8: fn(
            q, k, v, pos, table, kc, vc, slots, **cache_kw(fp8))

    def prologue(fn):
        return lambda q, k, v, pos, table, kc, vc, slots, fp8: fn(
            q, k, v, pos, table, w, w, kc, vc, slots, v_norm=True, **cache_kw(fp8))

    return {
        "apply_rope_and_cache_": (rope_cache(rope_ext.apply_rope_and_cache_),
                                  rope_cache(reference.apply_and_cache_)),
        "qk_norm_rope_and_cache_": (prologue(rope_ext.qk_norm_rope_and_cache_),
                                    prologue(qk_reference.qk_norm_rope_and_cache_)),
        "qk_norm_rope_and_cache": (prologue(rope_ext.qk_norm_rope_and_cache),
                                   prologue(qk_reference.qk_norm_rope_and_cache)),
    }


def paths(pair):
    native, ref = pair
    return [native, ref] if native_cpu() else [ref]


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("value_dim", [16, 8])
@pytest.mark.parametrize("layout", ["kv[:, 0], kv[:, 1]", "[key | value] columns",
                                    "heads first, then key and value"])
@pytest.mark.parametrize("op", ["apply_rope_and_cache_", "qk_norm_rope_and_cache_",
                                "qk_norm_rope_and_cache"])
def test_serving_ops_write_both_halves_of_one_buffer(op, layout, value_dim, fp8):
    T, heads, head_dim = 7, 2, 16
    q, k = torch.randn(T, 4, head_dim), torch.randn(T, heads, head_dim)
    v = torch.randn(T, heads, value_dim)
    pos = torch.randint(0, 32, (T,))
    table = rope_ext.cos_sin_cache(32, head_dim)
    slots = torch.tensor([5, 0, -1, 17, 9, 23, 2])
    for fn in paths(serving_calls(value_dim)[op]):
        kc, vc, buf = layouts(3, 8, heads, head_dim, value_dim, FP8 if fp8 else torch.float32)[layout]
        assert not addresses(kc) & addresses(vc)
        bits(buf).random_()  # what the op does not write keeps its bytes
        kc_want, vc_want = kc.clone(), vc.clone()
        before = buf.clone()
        want = fn(q.clone(), k.clone(), v.clone(), pos, table, kc_want, vc_want, slots, fp8)
        got = fn(q.clone(), k.clone(), v.clone(), pos, table, kc, vc, slots, fp8)
        for a, b in zip(got or (), want or ()):
            assert torch.equal(bits(a), bits(b))
        assert torch.equal(bits(kc), bits(kc_want))
        assert torch.equal(bits(vc), bits(vc_want))
        # Elements of the buffer outside both caches are untouched.
        outside = torch.ones(buf.numel(), dtype=torch.bool)
        outside[list(addresses(kc) | addresses(vc))] = False
        assert torch.equal(bits(buf).flatten()[outside], bits(before).flatten()[outside])


@pytest.mark.parametrize("op", ["apply_rope_and_cache_", "qk_norm_rope_and_cache_"])
def test_caches_that_share_an_element_are_refused_on_every_path(op):
    T, heads, head_dim = 3, 2, 16
    q, k, v = torch.randn(T, 4, head_dim), torch.randn(T, heads, head_dim), torch.randn(T, heads, head_dim)
    table = rope_ext.cos_sin_cache(32, head_dim)
    kv = torch.zeros(3, 2, 8, heads, head_dim)
    # value_cache starts one element into key_cache's last row of each block half.
    kc = kv[:, 0]
    vc = kv.flatten()[head_dim * heads * 8 - 1:].as_strided(kc.shape, kc.stride())
    assert addresses(kc) & addresses(vc)
    for fn in paths(serving_calls(head_dim)[op]):
        before = kv.clone()
        with pytest.raises(RuntimeError, match="value_cache and key_cache: unsupported operation"):
            fn(q.clone(), k.clone(), v, torch.arange(T), table, kc, vc, torch.arange(T), False)
        assert torch.equal(kv, before)


def random_view_pair(rng):
    """Two 4-dim views of one buffer with the strides of a random nesting of its dims, gaps and
    offsets: (key_cache, value_cache)."""
    sizes = [rng.randint(1, 3), rng.randint(1, 3), rng.randint(1, 3), rng.randint(1, 4)]
    vsizes = sizes[:3] + [rng.randint(1, 4)]
    order = list(range(4))
    rng.shuffle(order)
    strides, extent = [0] * 4, 1
    for d in order:
        strides[d] = extent + rng.choice([0, 0, 1, 2, 5])
        extent = strides[d] * max(sizes[d], vsizes[d])
    if rng.random() < 0.2:  # a size-1 dim's stride is arbitrary
        d = rng.randrange(4)
        if sizes[d] == 1:
            strides[d] = rng.randint(1, 40)
    a, b = rng.randint(0, extent), rng.randint(0, extent)
    vstrides = list(strides)
    if rng.random() < 0.1:
        vstrides[rng.randrange(4)] += 1

    def end(offset, shape, steps):  # one past the view's last element
        return offset + sum((n - 1) * s for n, s in zip(shape, steps)) + 1

    # (a size-1 dim's arbitrary stride can reach past 2 * extent)
    buf = torch.zeros(max(2 * extent + 64, end(a, sizes, strides), end(b, vsizes, vstrides)))
    return buf.as_strided(sizes, strides, a), buf.as_strided(vsizes, vstrides, b)


def test_disjointness_check_is_exact_for_views_with_the_same_strides():
    rng = random.Random(torch.initial_seed())
    table = rope_ext.cos_sin_cache(8, 4)
    seen = {True: 0, False: 0}
    for _ in range(300):
        kc, vc = random_view_pair(rng)
        if not (_checks._strided_dims_disjoint(list(zip(kc.shape, kc.stride())), 0)
                and _checks._strided_dims_disjoint(list(zip(vc.shape, vc.stride())), 0)):
            continue  # refused for their own overlap first
        apart = not addresses(kc) & addresses(vc)
        exact = all(kc.stride(d) == vc.stride(d) for d in range(4)
                    if kc.shape[d] > 1 and vc.shape[d] > 1)
        accepted = _checks._elements_disjoint(kc, vc)
        assert accepted == apart if exact else (not accepted or apart)
        seen[apart] += 1
        # The C++ check agrees (native path), as apply_rope_and_cache_ accepts or refuses.
        heads, head_dim, value_dim = kc.shape[2], kc.shape[3], vc.shape[3]
        if native_cpu() and head_dim == 4:
            args = (torch.randn(1, heads, 4), torch.randn(1, heads, 4), torch.randn(1, heads, value_dim),
                    torch.zeros(1, dtype=torch.long), table, kc, vc, torch.zeros(1, dtype=torch.long))
            try:
                rope_ext.apply_rope_and_cache_(*args)
                native = True
            except RuntimeError as e:
                assert "value_cache and key_cache" in str(e)
                native = False
            assert native == accepted
    assert seen[True] > 20 and seen[False] > 20


def test_compiled_prologue_writes_both_halves_of_one_buffer():
    table = rope_ext.cos_sin_cache(32, 16)
    w = torch.rand(16) + 0.5

    def step(q, k, v, pos, kv, slots):
        rope_ext.qk_norm_rope_and_cache_(q, k, v, pos, table, w, w, kv[:, 0], kv[:, 1], slots)
        return q + 1

    args = [torch.randn(5, 4, 16), torch.randn(5, 2, 16), torch.randn(5, 2, 16), torch.arange(5),
            torch.zeros(3, 2, 8, 2, 16), torch.tensor([7, 0, -1, 3, 20])]
    assert_compiled_like_eager(step, args)
    assert args[4][:, 0].abs().sum() > 0 and args[4][:, 1].abs().sum() > 0
