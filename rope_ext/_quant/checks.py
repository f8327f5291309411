"""Argument checks of the RoPE + FP8 quantization ops (rope.quantize_fp8 and
rope.quantize_fp8_append_paged_kv_cache) for the Python paths (reference and fake kernels).

They mirror csrc/ops/quant/checks.h: the same conditions in the same order and the same
messages. `memory=False` skips the byte-range overlap checks (fake tensors have no memory).
"""

import torch

from .._checks import (PARTIAL_OVERLAP, _check_same_device, _fail, _rows_disjoint, _shape, below,
                      check_disjoint_bytes, check_elements_disjoint, check_no_internal_overlap,
                      decided, differ, dtype_name)

OP = "rope.quantize_fp8"
PAGED_OP = "rope.quantize_fp8_append_paged_kv_cache"
X_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
INDEX_DTYPES = (torch.int32, torch.int64)
KV_LAYOUTS = ("NHD", "HND")


def _check_index(t, op, name, ref):
    _check_same_device(ref, "q_rope", t, op, name)
    if t.dtype not in INDEX_DTYPES:
        _fail(f"{op}: {name} must be int32 or int64, got {dtype_name(t.dtype)}")


def _check_1d(t, op, name, n, what):
    if t.dim() != 1 or (n is not None and differ(t.shape[0], n)):
        _fail(f"{op}: {name} must have shape {what}, got {_shape(t)}")


def check_inputs(q_rope, k_rope, q_nope, k_nope, cos_sin_cache, pos_ids, op):
    """The inputs both ops share. Returns (nnz, q_heads, kv_heads, rope_dim, no_rope_dim, mla)."""
    if q_rope.dim() != 3:
        _fail(f"{op}: q_rope must have shape (nnz, num_qo_heads, rope_dim), got {_shape(q_rope)}")
    if q_rope.dtype not in X_DTYPES:
        _fail(f"{op}: q_rope must be float16, bfloat16 or float32, got {dtype_name(q_rope.dtype)}")
    nnz, q_heads, rope_dim = q_rope.shape
    if k_rope.dim() not in (2, 3) or differ(k_rope.shape[0], nnz) or k_rope.shape[-1] != rope_dim:
        _fail(f"{op}: k_rope must have shape (nnz, num_kv_heads, rope_dim) or, for MLA, (nnz, "
              f"rope_dim) with nnz = {nnz} and rope_dim = {rope_dim}, got {_shape(k_rope)}")
    if rope_dim % 2:
        _fail(f"{op}: rope_dim = q_rope.size(-1) must be even, got {rope_dim}")
    mla = k_rope.dim() == 2
    kv_heads = 1 if mla else k_rope.shape[1]
    if q_nope.dim() != 3 or differ(q_nope.shape[0], nnz) or q_nope.shape[1] != q_heads:
        _fail(f"{op}: q_nope must have shape (nnz, num_qo_heads, no_rope_dim) = ({nnz}, {q_heads}, "
              f"no_rope_dim), got {_shape(q_nope)}")
    no_rope_dim = q_nope.shape[2]
    want = (nnz, no_rope_dim) if mla else (nnz, kv_heads, no_rope_dim)
    if differ(tuple(k_nope.shape), want):
        _fail(f"{op}: k_nope must have shape {list(want)} (k_rope's leading dims, q_nope's "
              f"no_rope_dim), got {_shape(k_nope)}")
    for name, t in (("k_rope", k_rope), ("q_nope", q_nope), ("k_nope", k_nope)):
        _check_same_device(q_rope, "q_rope", t, op, name)
        if t.dtype != q_rope.dtype:
            _fail(f"{op}: {name} must have the dtype of q_rope ({dtype_name(q_rope.dtype)}), got "
                  f"{dtype_name(t.dtype)}")
    _check_same_device(q_rope, "q_rope", cos_sin_cache, op, "cos_sin_cache")
    if cos_sin_cache.dtype != torch.float32:
        _fail(f"{op}: cos_sin_cache must be float32, got {dtype_name(cos_sin_cache.dtype)}")
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != rope_dim:
        _fail(f"{op}: cos_sin_cache must have shape (max_position, rope_dim) with rope_dim = "
              f"{rope_dim}, got {_shape(cos_sin_cache)}")
    _check_index(pos_ids, op, "pos_ids", q_rope)
    _check_1d(pos_ids, op, "pos_ids", nnz, f"(nnz,) = ({nnz},)")
    return nnz, q_heads, kv_heads, rope_dim, no_rope_dim, mla


def check_outputs(pairs, op, first_name):
    """pairs: (out name, out, input it mirrors). Returns the float8 dtype."""
    first = pairs[0][1]
    for name, out, src in pairs:
        if name == first_name:
            if out.dtype not in FP8_DTYPES:
                _fail(f"{op}: {name} must be float8_e4m3fn or float8_e5m2, got {dtype_name(out.dtype)}")
        elif out.dtype != first.dtype:
            _fail(f"{op}: {name} must have the dtype of {first_name} ({dtype_name(first.dtype)}), "
                  f"got {dtype_name(out.dtype)}")
        _check_same_device(src, "q_rope", out, op, name)
        if differ(out.shape, src.shape):
            _fail(f"{op}: {name} must have the shape of its input ({_shape(src)}), got {_shape(out)}")
    return first.dtype


def _as_rows(t):
    """t as (tokens, heads, dim): a 2-D (MLA) tensor gets a heads dim of 1."""
    return t.unsqueeze(1) if t.dim() == 2 else t


def check_outputs_disjoint(outs, op):
    """Outputs may be column slices of one buffer (FlashInfer's tests pass q_out[..., :rope_dim]
    and q_out[..., rope_dim:]): their rows must be disjoint."""
    for i, (a_name, a) in enumerate(outs):
        for b_name, b in outs[i + 1:]:
            if a.numel() and b.numel() and not _rows_disjoint(_as_rows(a), _as_rows(b), 1):
                _fail(f"{op}: {a_name} and {b_name}: {PARTIAL_OVERLAP}")


def check_quantize(q_rope, k_rope, q_nope, k_nope, cos_sin_cache, pos_ids, q_rope_out, k_rope_out,
                   q_nope_out, k_nope_out, memory=True):
    """Mirrors quant/checks.h check_quantize. Returns (geometry tuple, fp8 dtype)."""
    op = OP
    geo = check_inputs(q_rope, k_rope, q_nope, k_nope, cos_sin_cache, pos_ids, op)
    outs = (("q_rope_out", q_rope_out, q_rope), ("k_rope_out", k_rope_out, k_rope),
            ("q_nope_out", q_nope_out, q_nope), ("k_nope_out", k_nope_out, k_nope))
    fmt = check_outputs(outs, op, "q_rope_out")
    for name, out, _ in outs:
        check_no_internal_overlap(out, op, name)
    if memory:
        check_outputs_disjoint([(n, o) for n, o, _ in outs], op)
        inputs = (("q_rope", q_rope), ("k_rope", k_rope), ("q_nope", q_nope), ("k_nope", k_nope),
                  ("cos_sin_cache", cos_sin_cache), ("pos_ids", pos_ids))
        for name, out, _ in outs:
            for iname, t in inputs:
                check_disjoint_bytes(out, name, t, iname, op)
    return geo, fmt


def cache_names(mla):
    return ("ckv_cache", "kpe_cache") if mla else ("k_cache", "v_cache")


def check_paged(q_rope, k_rope, q_nope, k_nope, v, cos_sin_cache, pos_ids, q_rope_out, q_nope_out,
                k_cache, v_cache, kv_indices, kv_indptr, batch_indices, positions, page_size,
                kv_layout, memory=True):
    """Mirrors quant/checks.h check_paged. Returns (geometry tuple, fp8 dtype)."""
    op = PAGED_OP
    geo = check_inputs(q_rope, k_rope, q_nope, k_nope, cos_sin_cache, pos_ids, op)
    nnz, q_heads, kv_heads, rope_dim, no_rope_dim, mla = geo
    head_dim = rope_dim + no_rope_dim
    head_dim_str = head_dim if head_dim < 2**63 else "2^63 or more"  # (only empty inputs)
    if mla:
        if v is not None:
            _fail(f"{op}: v must be None for MLA (2-D k_rope): the compressed KV is k_nope")
    else:
        if v is None:
            _fail(f"{op}: v is required for GQA/MHA (3-D k_rope): (nnz, num_kv_heads, rope_dim + "
                  f"no_rope_dim)")
        _check_same_device(q_rope, "q_rope", v, op, "v")
        if v.dtype != q_rope.dtype:
            _fail(f"{op}: v must have the dtype of q_rope ({dtype_name(q_rope.dtype)}), got "
                  f"{dtype_name(v.dtype)}")
        if tuple(v.shape) != (nnz, kv_heads, head_dim):
            _fail(f"{op}: v must have shape (nnz, num_kv_heads, rope_dim + no_rope_dim) = ({nnz}, "
                  f"{kv_heads}, {head_dim_str}), got {_shape(v)}")
    outs = (("q_rope_out", q_rope_out, q_rope), ("q_nope_out", q_nope_out, q_nope))
    fmt = check_outputs(outs, op, "q_rope_out")
    if kv_layout not in KV_LAYOUTS:
        _fail(f"{op}: kv_layout must be 'NHD' or 'HND', got '{kv_layout}'")
    if page_size < 1:
        _fail(f"{op}: page_size must be >= 1, got {page_size}")
    c0, c1 = cache_names(mla)
    for name, c in ((c0, k_cache), (c1, v_cache)):
        _check_same_device(q_rope, "q_rope", c, op, name)
        if c.dtype != fmt:
            _fail(f"{op}: {name} must have the dtype of q_rope_out ({dtype_name(fmt)}), got "
                  f"{dtype_name(c.dtype)}")
    if mla:
        pages = k_cache.shape[0] if k_cache.dim() == 3 else "max_pages"
        for name, c, dim_name, dim in ((c0, k_cache, "no_rope_dim", no_rope_dim),
                                       (c1, v_cache, "rope_dim", rope_dim)):
            if c.dim() != 3 or c.shape[0] != k_cache.shape[0] or tuple(c.shape[1:]) != (page_size, dim):
                _fail(f"{op}: {name} must have shape (max_pages, page_size, {dim_name}) = ({pages}, "
                      f"{page_size}, {dim}), got {_shape(c)}")
    else:
        inner = (page_size, kv_heads) if kv_layout == "NHD" else (kv_heads, page_size)
        dims = "page_size, num_kv_heads" if kv_layout == "NHD" else "num_kv_heads, page_size"
        pages = k_cache.shape[0] if k_cache.dim() == 4 else "max_pages"
        for name, c in ((c0, k_cache), (c1, v_cache)):
            if c.dim() != 4 or tuple(c.shape[1:]) != (*inner, head_dim) or c.shape[0] != k_cache.shape[0]:
                _fail(f"{op}: {name} must have shape (max_pages, {dims}, head_dim) = ({pages}, "
                      f"{inner[0]}, {inner[1]}, {head_dim_str}) for kv_layout '{kv_layout}', got "
                      f"{_shape(c)}")
    if decided(k_cache.shape[0] * page_size >= 2**63, False):  # the kernels index entries in int64
        _fail(f"{op}: the caches have 2^63 entries or more")
    _check_index(kv_indices, op, "kv_indices", q_rope)
    _check_1d(kv_indices, op, "kv_indices", None, "(total_pages,)")
    _check_index(kv_indptr, op, "kv_indptr", q_rope)
    if kv_indptr.dim() != 1 or kv_indptr.shape[0] < 1:
        _fail(f"{op}: kv_indptr must have shape (batch_size + 1,), got {_shape(kv_indptr)}")
    _check_index(batch_indices, op, "batch_indices", q_rope)
    _check_1d(batch_indices, op, "batch_indices", nnz, f"(nnz,) = ({nnz},)")
    _check_index(positions, op, "positions", q_rope)
    _check_1d(positions, op, "positions", nnz, f"(nnz,) = ({nnz},)")
    written = (("q_rope_out", q_rope_out), ("q_nope_out", q_nope_out), (c0, k_cache), (c1, v_cache))
    for name, t in written:
        check_no_internal_overlap(t, op, name)
    if memory:
        check_outputs_disjoint(written[:2], op)
        for i, (wname, w) in enumerate(written[2:]):
            for oname, o in written[:2 + i]:
                check_elements_disjoint(w, wname, o, oname, op)
        inputs = (("q_rope", q_rope), ("k_rope", k_rope), ("q_nope", q_nope), ("k_nope", k_nope),
                  ("v", v), ("cos_sin_cache", cos_sin_cache), ("pos_ids", pos_ids),
                  ("kv_indices", kv_indices), ("kv_indptr", kv_indptr),
                  ("batch_indices", batch_indices), ("positions", positions))
        for wname, w in written:
            for iname, t in inputs:
                if t is not None:
                    check_disjoint_bytes(w, wname, t, iname, op)
    return geo, fmt


# ---- data checks (read the index tensors; run before anything is written) ----

def check_pos_ids(pos_ids, rows, op):
    bad = (pos_ids < 0) | ~below(pos_ids, rows)
    if pos_ids.numel() and bool(bad.any()):
        t = int(bad.nonzero()[0, 0])
        _fail(f"{op}: pos_ids must lie in [0, max_position = cos_sin_cache.size(0) = {rows}), got "
              f"{int(pos_ids[t])} at index {t}")


def paged_slots(kv_indices, kv_indptr, batch_indices, positions, page_size, max_pages):
    """(tokens written, their pages, their entries in the page), after checking every token that
    is not padding (batch_indices < 0) against the page table (token order: the first bad one is
    reported, as the native kernels do), then that no two tokens write one cache entry (the
    first token, in order, whose entry an earlier one has)."""
    op = PAGED_OP
    batch = kv_indptr.shape[0] - 1
    total = kv_indices.shape[0]
    b_all = batch_indices.long().cpu().tolist()
    p_all = positions.long().cpu().tolist()
    indptr = kv_indptr.long().cpu().tolist()
    indices = kv_indices.long().cpu().tolist()
    tokens, pages, entries = [], [], []
    for t, (b, p) in enumerate(zip(b_all, p_all)):
        if b < 0:
            continue
        if b >= batch:
            _fail(f"{op}: batch_indices must lie below batch_size = kv_indptr.size(0) - 1 = {batch} "
                  f"(negative: padding, skipped), got {b} at index {t}")
        start, end = indptr[b], indptr[b + 1]
        if not 0 <= start <= end <= total:
            _fail(f"{op}: kv_indptr must be non-decreasing within [0, kv_indices.size(0) = {total}], "
                  f"got kv_indptr[{b}] = {start} and kv_indptr[{b + 1}] = {end} (token {t})")
        if p < 0 or p // page_size >= end - start:
            bound = (end - start) * page_size
            _fail(f"{op}: positions must lie in [0, (kv_indptr[b + 1] - kv_indptr[b]) * page_size) = "
                  f"[0, {bound if bound < 2**63 else '2^63 or more'}) for request b = {b}, got {p} "
                  f"at index {t}")
        page = indices[start + p // page_size]
        if not 0 <= page < max_pages:
            _fail(f"{op}: kv_indices must lie in [0, max_pages = {max_pages}), got {page} at index "
                  f"{start + p // page_size} (token {t})")
        tokens.append(t)
        pages.append(page)
        entries.append(p % page_size)
    owner = {}
    for t, page, entry in zip(tokens, pages, entries):
        first = owner.setdefault((page, entry), t)
        if first != t:
            _fail(f"{op}: kv_indices and positions must give each token its own cache entry (negative "
                  f"batch_indices: padding, skipped), got page {page} entry {entry} for tokens {first} "
                  f"and {t}")
    return tokens, pages, entries
