"""Checks every CPU kernel path of the variant that serves this process against the float64
reference. Run by tests/test_cpu_isa.py once per variant, in a fresh process with
ROPE_EXT_CPU_ISA set (the variant is chosen once, when the library loads):

    ROPE_EXT_CPU_ISA=avx2 python tests/cpu_isa_matrix.py avx2 [seed]

Covers: the four x dtypes x the four table dtypes, both layouts, head dims whose halves are not
multiples of any vector width, partial rotary (pass-through bit-exact), strided x (the portable
path) and strided heads/tables (the vectorized path), broadcast tables, rope.apply_ with GQA keys
inside a poisoned fused buffer, int32/int64 positions, outputs large enough for the CPU output
cache, and rotary_dim/2 above the vectorized kernels' limit. test_cpu_isa.py runs it with
ROPE_EXT_CPU_STREAM_MB=0, so every output here takes the non-temporal-store path.
"""

import itertools
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

import rope_ext  # noqa: E402
from rope_ext import reference  # noqa: E402

from tolerances import DTYPES, TOL  # noqa: E402
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
        # x as [B, H, S, D] with tables [S, r/2] (broadcast over B and H) and [1, 1, S, r/2].
        x = torch.randn(b, h, s, d, dtype=dtype)
        check_apply(x, cos, sin, il, f"[B,H,S,D] {dtype}")
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
    """Outputs >= 16 MiB (the output cache; non-temporal stores under the test's
    ROPE_EXT_CPU_STREAM_MB=0), aligned and not, many rows
    (threads), and rotary_dim/2 above the vectorized limit (512)."""
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


def main(expected_isa=None):
    got = rope_ext.cpu_isa()
    if expected_isa is not None and got != expected_isa:
        raise SystemExit(f"asked for ROPE_EXT_CPU_ISA={expected_isa}, but {got} serves")
    counts = {f.__name__: f() for f in (apply_matrix, layout_matrix, inplace_matrix, large_matrix)}
    print(f"cpu_isa={got} ok {counts}")


if __name__ == "__main__":
    if len(sys.argv) > 2:
        torch.manual_seed(int(sys.argv[2]))
    main(sys.argv[1] if len(sys.argv) > 1 else None)
