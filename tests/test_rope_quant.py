"""RoPE + FP8 quantization: torch.ops.rope.quantize_fp8 / quantize_fp8_append_paged_kv_cache and
FlashInfer's drop-ins (rope_ext.compat.flashinfer.rope_quantize_fp8, mla_rope_quantize_fp8,
rope_quantize_fp8_append_paged_kv_cache), against FlashInfer's semantics written out here from its
kernels (include/flashinfer/pos_enc.cuh): per element, in float32,
    out[i] = x[i] * cos[j] + rot(x)[i] * sin[j]      (rot: (-x2, x1) half-split; (-x_odd, x_even)
                                                       interleaved; j = i % half or i // 2)
then out * quant_scale, converted to float8 saturating at the largest finite value (cvt.satfinite).
Also against the same math in float64 (within one float8 step), native CPU vs reference vs the
CUDA simulator bit for bit, the paged layouts and page tables, and bad inputs.
"""

import re

import pytest
import torch

import rope_ext
from rope_ext._quant import registrations as _quant_ops
from rope_ext.compat import flashinfer as fi

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
X_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MANT = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}
MIN_SUB = {torch.float8_e4m3fn: 2.0 ** -9, torch.float8_e5m2: 2.0 ** -16}


# ---- FlashInfer's semantics, written independently ----

def peer_rope(x, table, pos, interleave, acc=torch.float32):
    """x (nnz, H, R) rotated FlashInfer's way, in `acc`."""
    r = x.shape[-1]
    half = r // 2
    rows = table[pos.long()].to(acc)
    idx = torch.arange(r) // 2 if interleave else torch.arange(r) % half
    cos, sin = rows[:, None, idx], rows[:, None, half + idx]
    xf = x.to(acc)
    if interleave:
        rot = torch.stack((-xf[..., 1::2], xf[..., 0::2]), dim=-1).flatten(-2)
    else:
        rot = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return xf * cos + rot * sin


def peer_fp8(v, scale, fmt):
    """cvt.rn.satfinite: v * scale (in v's dtype, scale rounded to float32 as FlashInfer passes
    it), saturated, rounded to nearest even."""
    m = torch.finfo(fmt).max
    s = torch.tensor(scale, dtype=torch.float32).to(v.dtype)
    return (v * s).clamp(-m, m).to(fmt)


def peer_quantize(q_rope, k_rope, q_nope, k_nope, table, pos, interleave, sq, skv, fmt,
                  acc=torch.float32):
    k3 = k_rope.unsqueeze(1) if k_rope.dim() == 2 else k_rope
    kr = peer_rope(k3, table, pos, interleave, acc).reshape(k_rope.shape)
    return (peer_fp8(peer_rope(q_rope, table, pos, interleave, acc), sq, fmt),
            peer_fp8(kr, skv, fmt),
            peer_fp8(q_nope.to(acc), sq, fmt),
            peer_fp8(k_nope.to(acc), skv, fmt))


def exact(q_rope, k_rope, q_nope, k_nope, table, pos, interleave, sq, skv, fmt):
    """The unquantized values in float64 (saturated), for the float64 comparison."""
    m = torch.finfo(fmt).max
    k3 = k_rope.unsqueeze(1) if k_rope.dim() == 2 else k_rope
    kr = peer_rope(k3, table, pos, interleave, torch.float64).reshape(k_rope.shape)
    return tuple((v * s).clamp(-m, m) for v, s in (
        (peer_rope(q_rope, table, pos, interleave, torch.float64), sq), (kr, skv),
        (q_nope.double(), sq), (k_nope.double(), skv)))


def assert_within_one_step(codes, value, fmt):
    got = codes.double()
    step = value.abs() * 2.0 ** -MANT[fmt] + MIN_SUB[fmt]
    assert bool(((got - value).abs() <= step).all()), (got - value).abs().max()


def same_bits(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def poisoned(shape, fmt):
    return torch.full(shape, 0x7F, dtype=torch.uint8).view(fmt)  # NaN in both formats


def table_for(rows, rope_dim):
    return rope_ext.cos_sin_cache(rows, rope_dim)


# ---- the paths that serve the ops ----

def native(fn_name):
    if not rope_ext.backend("cpu") == "native":
        pytest.skip("native CPU library not loaded")
    return getattr(torch.ops.rope, fn_name)


PATHS = ["native", "reference"]


def quantize_op(path):
    return native("quantize_fp8") if path == "native" else _quant_ops.quantize_fp8


def paged_op(path):
    if path == "native":
        return native("quantize_fp8_append_paged_kv_cache")
    return _quant_ops.quantize_fp8_append_paged_kv_cache


def make_inputs(dtype, nnz=7, hq=4, hk=2, rope_dim=32, nope=48, mla=False, rows=64, fused=True):
    """FlashInfer's tests' layout: rope and nope parts are slices of one (.., head_dim) tensor."""
    q = torch.randn(nnz, hq, rope_dim + nope, dtype=dtype) * 3
    k = torch.randn(nnz, rope_dim + nope, dtype=dtype) * 3 if mla else \
        torch.randn(nnz, hk, rope_dim + nope, dtype=dtype) * 3
    if not fused:
        q, k = q.contiguous(), k.contiguous()
    parts = (q[..., :rope_dim], k[..., :rope_dim], q[..., rope_dim:], k[..., rope_dim:])
    table = table_for(rows, rope_dim)
    pos = torch.randint(0, rows, (nnz,))
    return parts, table, pos


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", X_DTYPES)
@pytest.mark.parametrize("fmt", FP8)
@pytest.mark.parametrize("interleave", [False, True])
@pytest.mark.parametrize("mla", [False, True])
def test_quantize_matches_flashinfer(path, dtype, fmt, interleave, mla):
    op = quantize_op(path)
    parts, table, pos = make_inputs(dtype, mla=mla)
    sq, skv = 0.75, 3.1  # scales that push values past the float8 range too (saturation)
    parts[0][0, 0, :2] = torch.tensor([1e4, -1e4], dtype=dtype)
    parts[2][0, 0, :4] = torch.tensor([1e4, -1e4, float("inf"), float("nan")], dtype=dtype)
    # outputs: column slices of one buffer per tensor, as FlashInfer's tests pass them
    q_out = poisoned(parts[0].shape[:-1] + (parts[0].shape[-1] + parts[2].shape[-1],), fmt)
    k_out = poisoned(parts[1].shape[:-1] + (parts[1].shape[-1] + parts[3].shape[-1],), fmt)
    r = parts[0].shape[-1]
    outs = (q_out[..., :r], k_out[..., :r], q_out[..., r:], k_out[..., r:])
    op(*parts, table, pos, *outs, sq, skv, interleave)
    want = peer_quantize(*parts, table, pos, interleave, sq, skv, fmt)
    for got, w in zip(outs, want):
        same_bits(got, w)
    for got, w in zip(outs, exact(*parts, table, pos, interleave, sq, skv, fmt)):
        ok = ~w.isnan()
        assert_within_one_step(got[ok], w[ok], fmt)
    assert torch.isnan(outs[2][0, 0, 3].float())  # NaN stays NaN
    assert outs[2][0, 0, 2].float() == torch.finfo(fmt).max  # inf saturates


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("interleave", [False, True])
def test_native_and_reference_agree_on_odd_shapes(dtype, interleave):
    """Scalar and vector paths, empty nope parts, rope_dim not a multiple of the chunk."""
    for rope_dim, nope, hq, hk, mla in ((64, 512, 8, 1, True), (2, 3, 1, 1, False),
                                        (34, 0, 3, 3, False), (96, 32, 2, 1, False)):
        parts, table, pos = make_inputs(dtype, nnz=5, hq=hq, hk=hk, rope_dim=rope_dim, nope=nope,
                                        mla=mla, fused=False)
        results = []
        for path in PATHS:
            outs = [poisoned(p.shape, torch.float8_e4m3fn) for p in parts]
            quantize_op(path)(*parts, table, pos, *outs, 1.5, 0.5, interleave)
            results.append(outs)
        for a, b in zip(*results):
            same_bits(a, b)
        want = peer_quantize(*parts, table, pos, interleave, 1.5, 0.5, torch.float8_e4m3fn)
        for a, w in zip(results[0], want):
            same_bits(a, w)


def test_dropins_allocate_or_write_in_place_and_infer_the_dtype():
    parts, table, pos = make_inputs(torch.bfloat16, mla=True)
    q_rope, k_rope, q_nope, k_nope = parts
    a = fi.mla_rope_quantize_fp8(q_rope, k_rope, q_nope, k_nope, table, pos)
    assert all(t.dtype == torch.float8_e4m3fn for t in a)
    assert [t.shape for t in a] == [t.shape for t in parts]
    want = peer_quantize(*parts, table, pos, False, 1.0, 1.0, torch.float8_e4m3fn)
    for got, w in zip(a, want):
        same_bits(got, w)
    # given outputs: written in place, their dtype inferred, returned as they are
    outs = [poisoned(t.shape, torch.float8_e5m2) for t in parts]
    b = fi.rope_quantize_fp8(q_rope, k_rope, q_nope, k_nope, table, pos, False, None, 2.0, 0.5,
                             *outs)
    assert all(x is y for x, y in zip(b, outs))
    want = peer_quantize(*parts, table, pos, True, 2.0, 0.5, torch.float8_e5m2)
    for got, w in zip(outs, want):
        same_bits(got, w)
    # None nope parts are size 0
    c = fi.rope_quantize_fp8(q_rope, k_rope, None, None, table, pos,
                             quantize_dtype=torch.float8_e5m2)
    assert c[2].shape == (q_rope.shape[0], q_rope.shape[1], 0) and c[3].shape == (q_rope.shape[0], 0)
    with pytest.raises(ValueError, match="cos_sin_cache should be float32"):
        fi.rope_quantize_fp8(q_rope, k_rope, q_nope, k_nope, table.double(), pos)
    with pytest.raises(ValueError, match="Unsupported backend"):
        fi.rope_quantize_fp8(q_rope, k_rope, q_nope, k_nope, table, pos, backend="triton")


# ---- the paged append ----

def page_table(nnz, page_size, rng_pages=3):
    """Two requests over shuffled pages, a padding token, tokens at scattered positions."""
    n0 = nnz // 2
    n1 = nnz - n0 - 1
    pages0, pages1 = (n0 + 5) // page_size + 1, (n1 + 3) // page_size + 1
    max_pages = pages0 + pages1 + rng_pages
    kv_indices = torch.randperm(max_pages)[: pages0 + pages1].int()
    kv_indptr = torch.tensor([0, pages0, pages0 + pages1], dtype=torch.int32)
    batch = torch.tensor([0] * n0 + [-1] + [1] * n1, dtype=torch.int32)
    positions = torch.cat((torch.arange(5, 5 + n0), torch.tensor([0]),
                           torch.arange(3, 3 + n1))).int()
    return kv_indices, kv_indptr, batch, positions, max_pages


def peer_paged(parts, v, table, pos, kv_indices, kv_indptr, batch, positions, page_size,
               kv_layout, interleave, sq, skv, fmt, caches):
    """FlashInfer's append, token by token (a copy of the caches)."""
    qr, kr, qn, kn = peer_quantize(*parts, table, pos, interleave, sq, skv, fmt)
    c0, c1 = (c.clone() for c in caches)
    mla = parts[1].dim() == 2
    # Writes go through (page, entry, ...) views: HND's (pages, heads, page_size, dim) transposed.
    w0, w1 = (c.transpose(1, 2) if kv_layout == "HND" and not mla else c for c in (c0, c1))
    for t in range(pos.shape[0]):
        b = int(batch[t])
        if b < 0:
            continue
        page_iter, entry = divmod(int(kv_indptr[b]) * page_size + int(positions[t]), page_size)
        page = int(kv_indices[page_iter])
        if mla:
            w0[page, entry], w1[page, entry] = kn[t], kr[t]
        else:
            w0[page, entry] = torch.cat((kr[t], kn[t]), dim=-1)
            w1[page, entry] = peer_fp8(v[t].float(), skv, fmt)
    return qr, qn, c0, c1


def paged_case(dtype, fmt, mla, kv_layout, page_size, nnz=9, hq=4, hk=2, rope_dim=32, nope=32):
    parts, table, pos = make_inputs(dtype, nnz=nnz, hq=hq, hk=hk, rope_dim=rope_dim, nope=nope,
                                    mla=mla)
    kv_indices, kv_indptr, batch, positions, max_pages = page_table(nnz, page_size)
    v = None if mla else torch.randn(nnz, hk, rope_dim + nope, dtype=dtype)
    if mla:
        shapes = ((max_pages, page_size, nope), (max_pages, page_size, rope_dim))
    elif kv_layout == "NHD":
        shapes = ((max_pages, page_size, hk, rope_dim + nope),) * 2
    else:
        shapes = ((max_pages, hk, page_size, rope_dim + nope),) * 2
    caches = tuple(torch.randint(0, 0x70, s, dtype=torch.uint8).view(fmt) for s in shapes)
    return parts, v, table, pos, (kv_indices, kv_indptr, batch, positions), caches


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", X_DTYPES)
@pytest.mark.parametrize("fmt", FP8)
@pytest.mark.parametrize("mla,kv_layout", [(True, "NHD"), (False, "NHD"), (False, "HND")])
@pytest.mark.parametrize("interleave", [False, True])
def test_paged_append_matches_flashinfer(path, dtype, fmt, mla, kv_layout, interleave):
    page_size = 4
    parts, v, table, pos, index, caches = paged_case(dtype, fmt, mla, kv_layout, page_size)
    q_out = [poisoned(parts[i].shape, fmt) for i in (0, 2)]
    before = tuple(c.clone() for c in caches)
    paged_op(path)(*parts, v, table, pos, *q_out, *caches, *index, page_size, kv_layout, 0.5, 2.0,
                   interleave)
    qr, qn, c0, c1 = peer_paged(parts, v, table, pos, *index, page_size, kv_layout, interleave,
                                0.5, 2.0, fmt, before)
    same_bits(q_out[0], qr)
    same_bits(q_out[1], qn)
    same_bits(caches[0], c0)  # written slots match, untouched slots unchanged
    same_bits(caches[1], c1)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("mla,kv_layout", [(True, "NHD"), (False, "NHD"), (False, "HND")])
def test_paged_append_into_the_two_halves_of_one_buffer(path, mla, kv_layout):
    # FlashInfer's and vLLM's (max_pages, 2, ...) cache passed as (kv[:, 0], kv[:, 1]); MLA's two
    # caches as column ranges of one (max_pages, page_size, no_rope_dim + rope_dim) buffer.
    page_size, fmt = 4, torch.float8_e4m3fn
    parts, v, table, pos, index, caches = paged_case(torch.float32, fmt, mla, kv_layout, page_size)
    if mla:
        buf = torch.cat(caches, -1)
        views = (buf[..., :caches[0].shape[-1]], buf[..., caches[0].shape[-1]:])
    else:
        buf = torch.stack(caches, 1)
        views = (buf[:, 0], buf[:, 1])
    outs = []
    for c in (caches, views):
        q_out = [poisoned(parts[i].shape, fmt) for i in (0, 2)]
        paged_op(path)(*parts, v, table, pos, *q_out, *c, *index, page_size, kv_layout, 0.5, 2.0,
                       False)
        outs.append(q_out + list(c))
    for a, b in zip(*outs):
        same_bits(a, b)


def test_paged_dropin_flashinfer_layouts_and_errors():
    page_size = 4
    for mla, layout in ((True, "NHD"), (False, "HND")):
        parts, v, table, pos, index, caches = paged_case(torch.float16, torch.float8_e4m3fn, mla,
                                                         layout, page_size)
        before = tuple(c.clone() for c in caches)
        q_rope_out, q_nope_out = fi.rope_quantize_fp8_append_paged_kv_cache(
            *parts, v, table, pos, caches, *index, page_size=page_size, kv_layout=layout,
            quant_scale_kv=0.25)
        qr, qn, c0, c1 = peer_paged(parts, v, table, pos, *index, page_size, layout, False, 1.0,
                                    0.25, torch.float8_e4m3fn, before)
        for a, b in ((q_rope_out, qr), (q_nope_out, qn), (caches[0], c0), (caches[1], c1)):
            same_bits(a, b)
    with pytest.raises(ValueError, match="GQA/MHA expects a V tensor"):
        fi.rope_quantize_fp8_append_paged_kv_cache(*parts, None, table, pos, caches, *index,
                                                   page_size=page_size, kv_layout=layout)
    with pytest.raises(ValueError, match="cache dtype mismatch"):
        fi.rope_quantize_fp8_append_paged_kv_cache(*parts, v, table, pos, caches, *index,
                                                   quantize_dtype=torch.float8_e5m2,
                                                   page_size=page_size, kv_layout=layout)
    # scalars as given, not converted (2.5 would be written as pages of 2)
    before = tuple(c.clone() for c in caches)
    for bad, message in ((dict(page_size=2.5), "page_size must be an int, got 2.5"),
                         (dict(page_size="4"), "page_size must be an int, got '4'"),
                         (dict(quant_scale_q="2"), "quant_scale_q must be a float, got '2'"),
                         (dict(quant_scale_kv=True), "quant_scale_kv must be a float, got True")):
        kw = {"page_size": page_size, "kv_layout": layout, **bad}
        with pytest.raises(ValueError, match=message):
            fi.rope_quantize_fp8_append_paged_kv_cache(*parts, v, table, pos, caches, *index, **kw)
        assert all(torch.equal(c.view(torch.uint8), b.view(torch.uint8)) for c, b in zip(caches, before))
    with pytest.raises(ValueError, match="quant_scale_kv must be a float, got None"):
        fi.rope_quantize_fp8(*parts, table, pos, quant_scale_kv=None)


# ---- bad input: an error naming the argument, nothing written ----

def bad_quantize_cases():
    parts, table, pos = make_inputs(torch.bfloat16, nnz=4)
    outs = [poisoned(p.shape, torch.float8_e4m3fn) for p in parts]
    base = dict(zip(("q_rope", "k_rope", "q_nope", "k_nope"), parts))
    base.update(cos_sin_cache=table, pos_ids=pos)
    base.update(zip(("q_rope_out", "k_rope_out", "q_nope_out", "k_nope_out"), outs))
    buf = poisoned((4, 4, 80), torch.float8_e4m3fn)
    return base, [
        ({"q_rope": parts[0].float()}, "k_rope must have the dtype of q_rope"),
        ({"q_rope": parts[0][..., :31]}, "k_rope must have shape"),
        ({"q_rope": parts[0][..., :3], "k_rope": parts[1][..., :3],
          "cos_sin_cache": table[:, :3], "q_rope_out": outs[0][..., :3],
          "k_rope_out": outs[1][..., :3]}, "rope_dim = q_rope.size(-1) must be even"),
        ({"k_nope": parts[3][:, :1]}, "k_nope must have shape"),
        ({"q_nope": parts[2][:3]}, "q_nope must have shape"),
        ({"cos_sin_cache": table.half()}, "cos_sin_cache must be float32"),
        ({"cos_sin_cache": table[:, :16]}, "cos_sin_cache must have shape"),
        ({"pos_ids": pos.float()}, "pos_ids must be int32 or int64"),
        ({"pos_ids": pos[:3]}, "pos_ids must have shape"),
        ({"pos_ids": torch.tensor([0, 1, 64, 2])}, "pos_ids must lie in [0, max_position"),
        ({"pos_ids": torch.tensor([0, -1, 3, 2])}, "pos_ids must lie in [0, max_position"),
        ({"q_rope_out": outs[0].view(torch.uint8)}, "q_rope_out must be float8_e4m3fn or"),
        ({"k_nope_out": poisoned(parts[3].shape, torch.float8_e5m2)},
         "k_nope_out must have the dtype of q_rope_out"),
        ({"k_rope_out": outs[1][:2]}, "k_rope_out must have the shape of its input"),
        ({"q_nope_out": buf[..., 20:68], "q_rope_out": buf[..., :32]},
         "q_rope_out and q_nope_out: unsupported operation"),
        ({"q_rope_out": outs[0][:, :1].expand(4, 4, 32)}, "q_rope_out: unsupported operation"),
        ({"q_rope_out": parts[0].view(torch.uint8)[..., :32].view(torch.float8_e4m3fn)},
         "q_rope and q_rope_out: unsupported operation"),
    ]


@pytest.mark.parametrize("path", PATHS)
def test_quantize_bad_input_names_the_argument_and_writes_nothing(path):
    op = quantize_op(path)
    base, cases = bad_quantize_cases()
    names = ("q_rope", "k_rope", "q_nope", "k_nope", "cos_sin_cache", "pos_ids", "q_rope_out",
             "k_rope_out", "q_nope_out", "k_nope_out")
    for change, message in cases:
        args = dict(base, **change)
        written = [args[n].view(torch.uint8).clone() for n in names[6:]]
        inputs = [args[n].clone() for n in names[:6]]
        with pytest.raises(RuntimeError, match=re.escape("rope.quantize_fp8: " + message)):
            op(*[args[n] for n in names], 1.0, 1.0, False)
        for n, w in zip(names[6:], written):
            assert torch.equal(args[n].view(torch.uint8), w), (message, n)
        for n, i in zip(names[:6], inputs):
            assert torch.equal(args[n], i) or args[n].dtype.is_floating_point and \
                torch.equal(args[n].view(torch.uint8), i.view(torch.uint8)), (message, n)


@pytest.mark.parametrize("path", PATHS)
def test_paged_bad_input_names_the_argument_and_writes_nothing(path):
    op = paged_op(path)
    page_size = 4
    parts, v, table, pos, index, caches = paged_case(torch.bfloat16, torch.float8_e4m3fn, False,
                                                     "NHD", page_size)
    kv_indices, kv_indptr, batch, positions = index
    q_out = [poisoned(parts[i].shape, torch.float8_e4m3fn) for i in (0, 2)]
    base = dict(zip(("q_rope", "k_rope", "q_nope", "k_nope"), parts))
    base.update(v=v, cos_sin_cache=table, pos_ids=pos, q_rope_out=q_out[0], q_nope_out=q_out[1],
                k_cache=caches[0], v_cache=caches[1], kv_indices=kv_indices, kv_indptr=kv_indptr,
                batch_indices=batch, positions=positions, page_size=page_size, kv_layout="NHD")
    names = list(base)
    late_token = batch.clone()
    late_token[-1] = 2  # only the last token is bad: the earlier ones must not be written either
    far = positions.clone()
    far[-1] = 1000
    bad_pages = kv_indices.clone()
    bad_pages[-1] = caches[0].shape[0]
    repeated = positions.clone()
    repeated[-1] = repeated[-2]  # the last two tokens (of one request) would write one cache row
    p = int(repeated[-1])
    page, entry = int(kv_indices[int(kv_indptr[1]) + p // page_size]), p % page_size
    n = len(positions)
    cases = [
        ({"v": None}, "v is required for GQA/MHA"),
        ({"v": v[..., :10]}, "v must have shape"),
        ({"kv_layout": "NDH"}, "kv_layout must be 'NHD' or 'HND'"),
        ({"page_size": 0}, "page_size must be >= 1"),
        ({"page_size": 8}, "k_cache must have shape"),
        ({"v_cache": caches[1].view(torch.uint8).view(torch.float8_e5m2)},
         "v_cache must have the dtype of q_rope_out"),
        ({"kv_layout": "HND"}, "k_cache must have shape"),
        ({"kv_indptr": kv_indptr[:0]}, "kv_indptr must have shape"),
        ({"batch_indices": batch.float()}, "batch_indices must be int32 or int64"),
        ({"positions": positions[:2]}, "positions must have shape"),
        ({"batch_indices": late_token}, "batch_indices must lie below batch_size"),
        ({"positions": far}, "positions must lie in [0, (kv_indptr[b + 1] - kv_indptr[b]) * page_size)"),
        ({"kv_indices": bad_pages}, "kv_indices must lie in [0, max_pages"),
        ({"kv_indptr": torch.tensor([0, 9, 2], dtype=torch.int32)}, "kv_indptr must be non-decreasing"),
        ({"v_cache": caches[0]}, "k_cache and v_cache: unsupported operation"),
        ({"pos_ids": torch.full_like(pos, 64)}, "pos_ids must lie in [0, max_position"),
        ({"positions": repeated},
         f"kv_indices and positions must give each token its own cache entry (negative "
         f"batch_indices: padding, skipped), got page {page} entry {entry} for tokens {n - 2} and {n - 1}"),
    ]
    for change, message in cases:
        args = dict(base, **change)
        written = [args[n].view(torch.uint8).clone() for n in ("q_rope_out", "q_nope_out", "k_cache",
                                                               "v_cache")]
        with pytest.raises(RuntimeError,
                           match=re.escape("rope.quantize_fp8_append_paged_kv_cache: " + message)):
            op(*[args[n] for n in names], 1.0, 1.0, False)
        for n, w in zip(("q_rope_out", "q_nope_out", "k_cache", "v_cache"), written):
            assert torch.equal(args[n].view(torch.uint8), w), (message, n)


def test_mla_paged_errors():
    page_size = 4
    parts, v, table, pos, index, caches = paged_case(torch.bfloat16, torch.float8_e4m3fn, True,
                                                     "NHD", page_size, nope=48)
    q_out = [poisoned(parts[i].shape, torch.float8_e4m3fn) for i in (0, 2)]
    for path in PATHS:
        op = paged_op(path)
        with pytest.raises(RuntimeError, match="v must be None for MLA"):
            op(*parts, parts[1], table, pos, *q_out, *caches, *index, page_size, "NHD", 1.0, 1.0,
               False)
        with pytest.raises(RuntimeError, match=r"kpe_cache must have shape \(max_pages, page_size, rope_dim\)"):
            op(*parts, None, table, pos, *q_out, caches[0], caches[0].clone(), *index, page_size, "NHD",
               1.0, 1.0, False)


def test_fake_kernels_and_grad_refused():
    parts, table, pos = make_inputs(torch.bfloat16, nnz=4)
    outs = [poisoned(p.shape, torch.float8_e4m3fn) for p in parts]
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(t) for t in (*parts, table, pos, *outs)]
        torch.ops.rope.quantize_fp8(*fake, 1.0, 1.0, False)
        with pytest.raises(RuntimeError, match="k_rope_out must have the shape"):
            torch.ops.rope.quantize_fp8(*fake[:7], fake[6], *fake[8:], 1.0, 1.0, False)
    q = parts[0].detach().clone().requires_grad_()
    with pytest.raises(RuntimeError, match="not differentiable"):
        torch.ops.rope.quantize_fp8(q, *parts[1:], table, pos, *outs, 1.0, 1.0, False)
    v0 = outs[0]._version
    torch.ops.rope.quantize_fp8(*parts, table, pos, *outs, 1.0, 1.0, False)
    assert outs[0]._version > v0  # the version bump of a mutated argument


def test_opcheck():
    parts, table, pos = make_inputs(torch.float16, nnz=3, fused=False)
    outs = [poisoned(p.shape, torch.float8_e4m3fn) for p in parts]
    torch.library.opcheck(torch.ops.rope.quantize_fp8.default,
                          (*parts, table, pos, *outs, 1.0, 2.0, True),
                          test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))


# ---- the CUDA kernels' code, on the CPU simulator (every thread, every access checked) ----

@pytest.fixture(scope="module")
def sim():
    import cuda_sim

    cuda_sim.load()
    return torch.ops.rope_sim


def sim_info():
    return torch.zeros(12, dtype=torch.int64)


@pytest.mark.parametrize("dtype", X_DTYPES)
@pytest.mark.parametrize("interleave", [False, True])
def test_simulated_kernel_quantize(sim, dtype, interleave):
    fmt = torch.float8_e4m3fn if dtype != torch.float32 else torch.float8_e5m2
    for rope_dim, nope, mla, fused, vec in ((64, 128, True, False, True), (32, 32, False, False, True),
                                            (64, 120, True, True, False), (6, 5, False, False, False),
                                            (64, 128, False, True, True)):
        parts, table, pos = make_inputs(dtype, nnz=6, hq=3, hk=2, rope_dim=rope_dim, nope=nope,
                                        mla=mla, fused=fused)
        outs = [poisoned(p.shape, fmt) for p in parts]
        info = sim_info()
        sim.quantize_fp8(*parts, table, pos, *outs, 1.25, 0.75, interleave, 2, info)
        assert bool(info[0]) == vec, (rope_dim, nope, fused)
        want = peer_quantize(*parts, table, pos, interleave, 1.25, 0.75, fmt)
        for got, w in zip(outs, want):
            same_bits(got, w)


@pytest.mark.parametrize("mla,kv_layout", [(True, "NHD"), (False, "NHD"), (False, "HND")])
@pytest.mark.parametrize("interleave", [False, True])
def test_simulated_kernel_paged(sim, mla, kv_layout, interleave):
    page_size = 4
    fmt = torch.float8_e5m2
    for nope, vec in ((32, True), (40, False)):  # 40: rows off the 16-element chunk (scalar path)
        parts, v, table, pos, index, caches = paged_case(torch.bfloat16, fmt, mla, kv_layout,
                                                         page_size, nope=nope)
        parts = tuple(p.contiguous() for p in parts)
        q_out = [poisoned(parts[i].shape, fmt) for i in (0, 2)]
        before = tuple(c.clone() for c in caches)
        info = sim_info()
        sim.quantize_fp8_append_paged_kv_cache(*parts, v, table, pos, *q_out, *caches, *index,
                                               page_size, kv_layout, 0.5, 2.0, interleave, 3, info)
        assert bool(info[0]) == vec
        qr, qn, c0, c1 = peer_paged(parts, v, table, pos, *index, page_size, kv_layout,
                                    interleave, 0.5, 2.0, fmt, before)
        for a, b in ((q_out[0], qr), (q_out[1], qn), (caches[0], c0), (caches[1], c1)):
            same_bits(a, b)


def test_simulated_kernel_traps_on_bad_page_tables(sim):
    page_size = 4
    parts, v, table, pos, index, caches = paged_case(torch.float16, torch.float8_e4m3fn, False,
                                                     "NHD", page_size)
    kv_indices, kv_indptr, batch, positions = index
    q_out = [poisoned(parts[i].shape, torch.float8_e4m3fn) for i in (0, 2)]
    bad_pages = kv_indices.clone()
    bad_pages[:] = caches[0].shape[0]
    far = positions.clone()
    far[0] = 1000
    for idx in ((bad_pages, kv_indptr, batch, positions), (kv_indices, kv_indptr, batch, far)):
        with pytest.raises(RuntimeError, match="device-side assert triggered"):
            sim.quantize_fp8_append_paged_kv_cache(*parts, v, table, pos, *q_out, *caches, *idx,
                                                   page_size, "NHD", 1.0, 1.0, False, 4,
                                                   sim_info())
    with pytest.raises(RuntimeError, match="device-side assert triggered"):
        sim.quantize_fp8_append_paged_kv_cache(*parts, v, table, torch.full_like(pos, 64), *q_out,
                                               *caches, *index, page_size, "NHD", 1.0, 1.0, False,
                                               4, sim_info())
    # Two tokens on one cache entry: the entry-set kernel, launched first, traps (its accesses
    # checked too), so the quant kernel never runs; with one block, then with a thread per token.
    repeated = positions.clone()
    repeated[-1] = repeated[-2]
    before = [c.view(torch.uint8).clone() for c in (*q_out, *caches)]
    for max_blocks in (1, 4):
        with pytest.raises(RuntimeError, match="device-side assert triggered: rope: two tokens must "
                                               "not write one cache entry"):
            sim.quantize_fp8_append_paged_kv_cache(*parts, v, table, pos, *q_out, *caches,
                                                   kv_indices, kv_indptr, batch, repeated,
                                                   page_size, "NHD", 1.0, 1.0, False, max_blocks,
                                                   sim_info())
        assert all(torch.equal(c.view(torch.uint8), b) for c, b in zip((*q_out, *caches), before))


def test_rows_of_no_elements_still_check_positions(sim):
    """rope_dim 0 and no nope part: nothing to write, but a position outside the table is
    refused on every path (the CPU once skipped the call and its checks; found by the fuzz)."""
    parts = [torch.randn(4, 2, 0), torch.randn(4, 1, 0), torch.randn(4, 2, 0), torch.randn(4, 1, 0)]
    table, pos = torch.randn(9, 0), torch.tensor([6, 9, 0, 4])
    outs = [torch.empty(p.shape, dtype=torch.float8_e4m3fn) for p in parts]
    messages = []
    for fn in (torch.ops.rope.quantize_fp8, _quant_ops.quantize_fp8):
        with pytest.raises(RuntimeError, match=r"pos_ids must lie in \[0, max_position") as e:
            fn(*parts, table, pos, *outs, 1.0, 1.0, False)
        messages.append(str(e.value))
    assert messages[0] == messages[1]
    with pytest.raises(RuntimeError, match="device-side assert triggered"):
        sim.quantize_fp8(*parts, table, pos, *outs, 1.0, 1.0, False, 2, sim_info())
    torch.ops.rope.quantize_fp8(*parts, table, pos.clamp(max=8), *outs, 1.0, 1.0, False)


def test_bench_rows_do_the_same_work():
    """bench/rope_bench/quant.py: its unfused eager rows compute what the fused op computes."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                    "bench"))
    from rope_bench import quant

    for case in (("mla", 5, 4, 0, 64, 64), ("gqa", 5, 4, 2, 32, 32)):
        i = quant.Inputs(case, "cpu")
        want = quant.unfused(i)
        rows = quant.rows(i)
        rows["rope_ext quantize_fp8"][1]()
        for got, w in zip(i.outs, want):
            same_bits(got, w)
        before = [c.clone() for c in i.caches]
        q_want = quant.unfused_paged(i)
        expected = [c.clone() for c in i.caches]
        for c, b in zip(i.caches, before):
            c.copy_(b)
        rows["rope_ext paged append"][1]()
        for got, w in zip((i.outs[0], i.outs[2], *i.caches), (*q_want, *expected)):
            same_bits(got, w)


def random_case(g):
    """Random shapes, strides, dtypes and formats: every path must agree bit for bit."""
    pick = lambda seq: seq[int(torch.randint(len(seq), (1,), generator=g))]  # noqa: E731
    dtype, fmt, interleave, mla = pick(X_DTYPES), pick(FP8), pick([False, True]), pick([False, True])
    nnz = pick([0, 1, 3, 6])
    hq, hk = pick([1, 2, 5]), 1 if mla else pick([1, 2, 3])
    rope_dim, nope = 2 * pick([1, 4, 8, 16, 17, 32]), pick([0, 1, 16, 23, 64])
    rows = pick([1, 5, 40])
    lead = lambda h: (nnz,) if h is None else (nnz, h)  # noqa: E731

    def tensor(shape, layout):
        if layout == "transposed" and len(shape) == 3:  # heads outermost in memory
            return torch.randn(shape[1], shape[0], shape[2], generator=g).to(dtype).transpose(0, 1)
        if layout == "padded":  # rows inside a wider buffer
            return torch.randn(*shape[:-1], shape[-1] + 5, generator=g).to(dtype)[..., 3:3 + shape[-1]]
        return torch.randn(*shape, generator=g).to(dtype)

    layout = pick(["contiguous", "transposed", "padded"])
    kh = None if mla else hk
    parts = (tensor((nnz, hq, rope_dim), layout), tensor((*lead(kh), rope_dim), layout),
             tensor((nnz, hq, nope), layout), tensor((*lead(kh), nope), layout))
    table = torch.randn(rows, rope_dim, generator=g)
    pos = torch.randint(0, rows, (nnz,), generator=g).to(pick([torch.int32, torch.int64]))
    scales = (float(torch.rand((), generator=g)) * 4, float(torch.rand((), generator=g)) * 4)
    return parts, table, pos, fmt, interleave, scales


def test_random_cases_every_path_agrees(sim):
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    for _ in range(40):
        parts, table, pos, fmt, interleave, (sq, skv) = random_case(g)
        want = peer_quantize(*parts, table, pos, interleave, sq, skv, fmt)
        runs = [lambda o: _quant_ops.quantize_fp8(*parts, table, pos, *o, sq, skv, interleave),
                lambda o: sim.quantize_fp8(*parts, table, pos, *o, sq, skv, interleave, 3, sim_info())]
        if rope_ext.backend("cpu") == "native":
            runs.append(lambda o: torch.ops.rope.quantize_fp8(*parts, table, pos, *o, sq, skv,
                                                              interleave))
        for run in runs:
            outs = [poisoned(p.shape, fmt) for p in parts]
            run(outs)
            for got, w in zip(outs, want):
                same_bits(got, w)
