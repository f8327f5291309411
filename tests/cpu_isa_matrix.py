"""The cases every CPU kernel variant is checked on against the float64 reference (run by
tests/test_cpu_isa.py once per variant, with rope_ext.set_cpu_isa, and with non-temporal stores
forced on so both store paths are covered).

Covers: the four x dtypes x the four table dtypes, both layouts, head dims whose halves are not
multiples of any vector width, partial rotary (pass-through bit-exact), strided x and strided
heads/tables, broadcast tables, rope.apply_ with GQA keys inside a poisoned fused buffer,
int32/int64 positions, MRoPE (both section layouts), the positions op, the KV-cache write, large
outputs, and rotary_dim/2 above one kernel block (512 pairs).
"""

import itertools

import torch

import rope_ext
from rope_ext import reference
from tolerances import DTYPES, TOL

ops = torch.ops.rope


def close(actual, expected, dtype, what):
    rtol, atol = TOL[dtype]
    try:
        torch.testing.assert_close(actual.double(), expected.double(), rtol=rtol, atol=atol)
    except AssertionError as e:
        raise AssertionError(f"{what}: {e}") from None


def fresh_output_poisoned(numel, dtype):
    """Frees a NaN-filled block of the output's size just before the op allocates, so that the
    allocator likely hands the op that memory: an element the kernel forgets then shows as NaN.
    (Best effort; the comparison with the reference is the check.)"""
    t = torch.full((numel,), float("nan"), dtype=dtype)
    del t


def check_apply(x, cos, sin, interleaved, what):
    rot = 2 * cos.shape[-1]
    x64, c64, s64 = x.double(), cos.double(), sin.double()
    for name, op, ref in (
        ("apply", ops.apply, reference.apply_rope),
        ("apply_backward", ops.apply_backward, reference.apply_rope_backward),
    ):
        fresh_output_poisoned(x.numel(), x.dtype)
        out = op(x, cos, sin, interleaved)
        tag = f"{what} {name} interleaved={interleaved}"
        assert out.shape == x.shape and out.dtype == x.dtype, tag
        close(out, ref(x64, c64, s64, interleaved=interleaved), x.dtype, tag)
        assert torch.equal(out[..., rot:], x[..., rot:]), f"{tag}: pass-through dims changed"


def tables(positions, rotary_dim, tab_dtype, max_position=64):
    cache = rope_ext.cos_sin_cache(max_position, rotary_dim, dtype=tab_dtype)
    rows = cache[positions]
    half = rotary_dim // 2
    return cache, rows[..., :half], rows[..., half:]


def apply_matrix():
    n = 0
    # (head_dim, rotary_dim): full, halves that are no multiple of 4/8/16, partial, odd head_dim.
    dims = [(128, 128), (64, 64), (70, 70), (34, 34), (6, 6), (2, 2), (128, 64), (7, 6), (96, 32), (40, 0)]
    for dtype, tab_dtype, (d, r), il in itertools.product(DTYPES, DTYPES, dims, (False, True)):
        if r == 0:
            continue  # cos_sin_cache needs rotary_dim >= 2; rotary_dim 0 is covered below
        if tab_dtype not in (torch.float32, dtype) and (d, r) not in ((70, 70), (7, 6)):
            continue  # other table dtypes take the same conversion path: fewer shapes suffice
        pos = torch.randint(0, 64, (5,))
        _, cos, sin = tables(pos, r, tab_dtype)
        x = torch.randn(5, 3, d, dtype=dtype)
        check_apply(x, cos.unsqueeze(1), sin.unsqueeze(1), il, f"x {dtype} tables {tab_dtype} D={d} r={r}")
        n += 1
    return n


def layout_matrix():
    """Strides and broadcasting, for each dtype with float32 tables (and x's own dtype)."""
    n = 0
    for dtype, il in itertools.product(DTYPES, (False, True)):
        tab = torch.float32
        b, s, h, d, r = 2, 5, 4, 64, 48
        pos = torch.randint(0, 64, (s,))
        _, cos, sin = tables(pos, r, tab)
        # x as [B, H, S, D] with tables [1, 1, S, r/2] (broadcast over B and H).
        x = torch.randn(b, h, s, d, dtype=dtype)
        check_apply(x, cos[None, None], sin[None, None], il, f"[B,H,S,D] 4-d tables {dtype}")
        # x as [B, S, H, D] with tables [B, S, 1, r/2].
        x = torch.randn(b, s, h, d, dtype=dtype)
        cb, sb = cos[None, :, None].expand(b, s, 1, r // 2), sin[None, :, None].expand(b, s, 1, r // 2)
        check_apply(x, cb.contiguous(), sb.contiguous(), il, f"[B,S,H,D] {dtype}")
        # q/k slices of a fused qkv buffer: heads strided, head dim contiguous (vectorized path).
        qkv = torch.randn(s, 3 * h, d, dtype=dtype)
        check_apply(qkv[:, h : 2 * h], cos[:, None], sin[:, None], il, f"fused qkv slice {dtype}")
        # head dim strided (the portable path).
        wide = torch.randn(s, h, 2 * d, dtype=dtype)
        check_apply(wide[..., ::2], cos[:, None], sin[:, None], il, f"strided head dim {dtype}")
        # tables strided along their last dim (expanded into the kernel's buffers).
        cw = torch.stack((cos, cos), -1).flatten(-2)[..., ::2]
        sw = torch.stack((sin, sin), -1).flatten(-2)[..., ::2]
        assert cw.stride(-1) == 2
        check_apply(torch.randn(s, h, d, dtype=dtype), cw[:, None], sw[:, None], il, f"strided tables {dtype}")
        # x starting one element past an aligned address (unaligned vector loads and stores).
        flat = torch.randn(1 + s * h * d, dtype=dtype)
        check_apply(flat[1:].view(s, h, d), cos[:, None], sin[:, None], il, f"unaligned x {dtype}")
        # no leading dims at all, and only size-1 ones.
        check_apply(torch.randn(d, dtype=dtype), cos[0], sin[0], il, f"1-d x {dtype}")
        check_apply(torch.randn(1, 1, d, dtype=dtype), cos[:1, None], sin[:1, None], il, f"[1,1,D] {dtype}")
        # rotary_dim = 0: everything passes through.
        z = torch.zeros(s, 1, 0, dtype=tab)
        check_apply(torch.randn(s, h, d, dtype=dtype), z, z, il, f"rotary_dim 0 {dtype}")
        n += 10
    return n


def inplace_matrix():
    n = 0
    dims = [(128, 128), (70, 70), (34, 34), (128, 64), (7, 6), (6, 2)]
    for i, (dtype, tab_dtype, (d, r), il) in enumerate(
        itertools.product(DTYPES, DTYPES, dims, (False, True))
    ):
        if tab_dtype not in (torch.float32, dtype) and (d, r) not in ((70, 70), (7, 6)):
            continue
        pos_dtype = (torch.int64, torch.int32)[i % 2]
        t, hq, hk = 6, 4, 2
        cache = rope_ext.cos_sin_cache(64, r, dtype=tab_dtype)
        pos = torch.randint(0, 64, (t,), dtype=pos_dtype)
        # q and k are views into a NaN-poisoned fused buffer [T, Hq + Hk + Hk(v), D]: the
        # v heads must stay NaN, so any write outside q/k shows.
        buf = torch.full((t, hq + 2 * hk, d), float("nan"), dtype=dtype)
        buf[:, : hq + hk] = torch.randn(t, hq + hk, d, dtype=dtype)
        q, k, v = buf[:, :hq], buf[:, hq : hq + hk], buf[:, hq + hk :]
        q0, k0 = q.clone(), k.clone()
        ops.apply_(q, k, pos, cache, il)
        rows = cache.double()[pos.long()].unsqueeze(1)
        cos, sin = rows[..., : r // 2], rows[..., r // 2 :]
        tag = f"apply_ x {dtype} cache {tab_dtype} D={d} r={r} interleaved={il} {pos_dtype}"
        close(q, reference.apply_rope(q0.double(), cos, sin, interleaved=il), dtype, tag + " query")
        close(k, reference.apply_rope(k0.double(), cos, sin, interleaved=il), dtype, tag + " key")
        assert torch.equal(q[..., r:], q0[..., r:]) and torch.equal(k[..., r:], k0[..., r:]), tag
        assert v.isnan().all(), f"{tag}: wrote outside query/key"
        n += 1
    # A cache with a strided column dim, and key=None.
    for dtype, il in itertools.product(DTYPES, (False, True)):
        full = rope_ext.cos_sin_cache(64, 64)
        cache = torch.stack((full, full), -1).flatten(-2)[:, ::2]
        assert cache.stride(-1) == 2
        pos = torch.randint(0, 64, (3, 4))
        q = torch.randn(3, 4, 5, 64, dtype=dtype)
        q0 = q.clone()
        ops.apply_(q, None, pos, cache, il)
        rows = full.double()[pos].unsqueeze(-2)
        close(q, reference.apply_rope(q0.double(), rows[..., :32], rows[..., 32:], interleaved=il),
              dtype, f"apply_ strided cache {dtype} interleaved={il}")
        n += 1
    return n


def large_matrix():
    """Large outputs, aligned and not, many rows (threads), and rotary_dim/2 above one kernel
    block (512 pairs)."""
    n = 0
    cases = [
        (torch.float32, (4096, 8, 128), 128),  # 16 MiB, rows 64-byte aligned
        (torch.bfloat16, (8192, 8, 128), 96),  # 16 MiB, partial rotary
        (torch.float32, (4100, 11, 100), 100),  # 17.6 MiB, rows not 64-byte aligned
        (torch.float64, (4, 3, 1100), 1100),  # half = 550 > 512
    ]
    # Leading dims that do not merge (a slice along S, tables broadcast over heads): rows are
    # walked in runs that wrap, and thread chunks start in the middle of a run.
    for dtype, il in itertools.product((torch.float32, torch.bfloat16), (False, True)):
        x = torch.randn(64, 40, 8, 128, dtype=dtype)[:, :37]
        pos = torch.randint(0, 64, (64, 37))
        _, cos, sin = tables(pos, 128, torch.float32)
        check_apply(x, cos[:, :, None], sin[:, :, None], il, f"non-mergeable lead dims {dtype}")
        q = torch.randn(64, 40, 8, 128, dtype=dtype)[:, :37]
        q0 = q.clone()
        cache = rope_ext.cos_sin_cache(64, 128)
        ops.apply_(q, None, pos, cache, il)
        rows = cache.double()[pos].unsqueeze(-2)
        close(q, reference.apply_rope(q0.double(), rows[..., :64], rows[..., 64:], interleaved=il),
              dtype, f"apply_ non-mergeable lead dims {dtype} interleaved={il}")
        n += 2
    for dtype, shape, r in cases:
        for il in (False, True):
            pos = torch.randint(0, 64, (shape[0],))
            _, cos, sin = tables(pos, r, torch.float32)
            x = torch.randn(shape, dtype=dtype)
            check_apply(x, cos[:, None], sin[:, None], il, f"large {dtype} {shape} r={r}")
            n += 1
    return n


def positions_matrix():
    """rope.mrope_ (chunked and interleaved sections) and rope.apply_positions (forward and
    inverse, plain and MRoPE) against the reference, with GQA keys and partial rotary."""
    n = 0
    for dtype, il, (d, r) in itertools.product(DTYPES, (False, True), ((128, 128), (70, 36), (34, 34))):
        t, hq, hk = 6, 4, 2
        cache = rope_ext.cos_sin_cache(64, r)
        half = r // 2
        sec = [half - 2 * (half // 3), half // 3, half // 3]
        mpos = torch.randint(0, 64, (3, t))
        for mi in (False, True):
            q, k = torch.randn(t, hq, d, dtype=dtype), torch.randn(t, hk, d, dtype=dtype)
            q0, k0 = q.clone(), k.clone()
            ops.mrope_(q, k, mpos, cache, sec, il, mi)
            rq, rk = q0.double(), k0.double()
            reference.apply_mrope_(rq, rk, mpos, cache.double(), sec, interleaved=il, mrope_interleaved=mi)
            tag = f"mrope_ {dtype} D={d} r={r} il={il} mrope_interleaved={mi}"
            close(q, rq, dtype, tag + " query")
            close(k, rk, dtype, tag + " key")
            n += 1
        pos = torch.randint(0, 64, (t,))
        x = torch.randn(t, hq, d, dtype=dtype)
        c, s = cache[:, :half], cache[:, half:]
        for inverse, section in itertools.product((False, True), (None, sec)):
            p = pos if section is None else mpos
            out = ops.apply_positions(x, p, c, s, il, inverse, section, False)
            ref = reference.apply_positions(x.double(), p, c.double(), s.double(), interleaved=il,
                                            inverse=inverse, mrope_section=section)
            tag = f"apply_positions {dtype} D={d} r={r} il={il} inverse={inverse} mrope={section}"
            close(out, ref, dtype, tag)
            assert torch.equal(out[..., r:], x[..., r:]), tag
            n += 1
    return n


def cache_matrix():
    """rope.apply_and_cache_ for each dtype and cache format against the reference."""
    n = 0
    formats = {"auto": None, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
    for dtype, il, (fmt, cdt) in itertools.product(DTYPES, (False, True), formats.items()):
        t, hq, hk, d, dv, r = 7, 4, 2, 64, 32, 48
        cache = rope_ext.cos_sin_cache(64, r)
        pos = torch.randint(0, 64, (t,))
        slots = torch.tensor([5, -1, 0, 11, 3, 8, 14])
        q, k, v = (torch.randn(t, h, n_, dtype=dtype) for h, n_ in ((hq, d), (hk, d), (hk, dv)))
        cdt = dtype if cdt is None else cdt
        kc = torch.randn(4, 4, hk, d).to(cdt)
        vc = torch.randn(4, 4, hk, dv).to(cdt)
        scales = (torch.tensor([0.5]), torch.tensor([2.0])) if fmt != "auto" else (None, None)
        args = [(q, k, v, pos, cache, kc, vc, slots)]
        ref = [a.clone() if isinstance(a, torch.Tensor) else a for a in args[0]]
        ops.apply_and_cache_(*args[0], il, fmt, *scales)
        reference.apply_and_cache_(*ref, interleaved=il, kv_cache_dtype=fmt, k_scale=scales[0],
                                   v_scale=scales[1])
        tag = f"apply_and_cache_ {dtype} {fmt} il={il}"
        for got, want, name in ((q, ref[0], "query"), (k, ref[1], "key")):
            assert torch.equal(got, want), f"{tag}: {name} differs from the reference bit for bit"
        for got, want, name in ((kc, ref[5], "key_cache"), (vc, ref[6], "value_cache")):
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), f"{tag}: {name}"
        n += 1
    return n


def run_all():
    """Every case; returns the count per group."""
    return {f.__name__: f() for f in (apply_matrix, layout_matrix, inplace_matrix, positions_matrix,
                                      cache_matrix, large_matrix)}
