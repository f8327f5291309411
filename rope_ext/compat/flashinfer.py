"""FlashInfer's RoPE functions (`flashinfer.rope`, exported from `flashinfer`) on rope_ext's ops.

    import flashinfer                          ->  from rope_ext.compat import flashinfer
    flashinfer.apply_rope_pos_ids_inplace(q, k, pos_ids)

Same arguments, defaults, layouts and returns. The rope_scale / rope_theta variants compute
their angles as FlashInfer's kernels do, in float32: w_i = (1/theta)^(2i/rotary_dim) / rope_scale
(Llama 3.1: blended with the unscaled w_i by FlashInfer's smooth factor), angle = float(pos) * w_i.
That per-token cos|sin table ((nnz, rotary_dim) float32, small next to q and k) then drives
rope_ext's in-place op, so q and k are rotated in one native pass.
rope_quantize_fp8, mla_rope_quantize_fp8 and rope_quantize_fp8_append_paged_kv_cache (RoPE + FP8
quantization, MLA and GQA/MHA) each run one fused op: torch.ops.rope.quantize_fp8 and
torch.ops.rope.quantize_fp8_append_paged_kv_cache (docs/migrating.md).
Differences, on inputs FlashInfer mishandles: positions outside a cos_sin_cache are an error (FlashInfer
reads outside it); tokens outside indptr[0] .. indptr[-1] are left as they are (FlashInfer leaves
them unwritten, uninitialised in the out-of-place outputs).
"""

import functools
import math

import torch

from ..ops import apply_rope as _rotated, apply_rope_at, sequence_positions  # FlashInfer has its own apply_rope
from .._args import check_flag, check_float, check_int, check_positive, check_tensors
from .._call import ops
from ..ops import apply_rope_
from ._layout import (check_cache_views, check_index_tensor, interleaved_of, is_dtensor,
                      positions_table, uncached_when_tracing)

F32 = torch.float32


def _check_qk(q, k):
    try:
        bad = q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]
    except AttributeError:
        check_tensors(q=q, k=k)
        raise
    if bad:
        raise ValueError(f"q and k must have shapes (nnz, num_q_heads, head_dim) and (nnz, "
                         f"num_k_heads, head_dim), got q {list(q.shape)} and k {list(k.shape)}")


def _rotary_dim(rotary_dim, q):
    head_dim = q.shape[-1]
    if rotary_dim is None:
        rotary_dim = head_dim
    if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, int) or rotary_dim < 2 \
            or rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(f"rotary_dim must be an even int in [2, head_dim = {head_dim}], got "
                         f"{rotary_dim!r}")
    return rotary_dim


@functools.lru_cache(maxsize=64)
def _frequencies(rotary_dim, rope_scale, rope_theta, device, llama31=None):
    """FlashInfer's per-pair frequencies, float32 arithmetic in its kernel's order. Cached: a
    serving loop calls with the same few settings, and the cache spares the host-to-device copies
    of the scalars (read-only: callers never write it)."""
    rcp_scale = 1.0 / torch.tensor(float(rope_scale), dtype=F32, device=device)
    rcp_theta = 1.0 / torch.tensor(float(rope_theta), dtype=F32, device=device)
    exponent = torch.arange(0, rotary_dim, 2, dtype=F32, device=device) / float(rotary_dim)
    freq = torch.pow(rcp_theta, exponent)
    if llama31 is None:
        smooth_a = smooth_b = torch.zeros((), dtype=F32, device=device)
    else:
        # The kernel's arguments are floats: smooth_a is formed from them in double (M_PI) and
        # stored as float; smooth_b in float.
        low, high, old_context_len = (float(torch.tensor(float(v), dtype=F32, device="cpu"))
                                     for v in llama31)  # (any default device)
        smooth_a = torch.tensor(old_context_len / (2 * math.pi * high - 2 * math.pi * low),
                                dtype=F32, device=device)
        ratio = (torch.tensor(float(high), dtype=F32, device="cpu")
                 / torch.tensor(float(low), dtype=F32, device="cpu"))
        smooth_b = (-1.0 / (ratio - 1.0)).to(device)
    smooth = (freq * smooth_a + smooth_b).clamp(0.0, 1.0)
    return (1 - smooth) * (freq * rcp_scale) + smooth * freq


def _finite(value, name):
    value = check_float(value, name)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return value


def _llama31_args(llama31):
    """(low_freq_factor, high_freq_factor, old_context_len) as floats, or None; refused where
    FlashInfer's formula gives no finite table."""
    if llama31 is None:
        return None
    llama31 = tuple(_finite(v, name) for v, name in
                    zip(llama31, ("low_freq_factor", "high_freq_factor", "old_context_len")))
    if llama31[1] == llama31[0]:
        raise ValueError(f"high_freq_factor must differ from low_freq_factor = {llama31[0]} "
                         "(FlashInfer's blend divides by their difference)")
    return llama31


def _table(positions, valid, rotary_dim, rope_scale, rope_theta, llama31=None):
    """(nnz, rotary_dim) float32: cos | sin of each token's angles; rows where `valid` is False
    rotate by 0 (left unchanged)."""
    llama31 = _llama31_args(llama31)
    frequencies = uncached_when_tracing(_frequencies)
    freq = frequencies(rotary_dim, check_positive(rope_scale, "rope_scale"),
                       check_positive(rope_theta, "rope_theta"), positions.device, llama31)
    angles = positions.to(F32)[:, None] * freq
    if valid is not None:
        angles = angles.masked_fill(~valid[:, None], 0.0)
    # One cat, not cos/sin into slices of one buffer: out= of a strided slice breaks
    # torch.compile(fullgraph=True).
    return torch.cat((angles.cos(), angles.sin()), dim=-1)


def _indptr_positions(q, indptr, offsets):
    check_index_tensor(indptr, "indptr")
    if indptr.dim() != 1 or indptr.shape[0] < 1:
        raise ValueError(f"indptr must have shape (batch_size + 1,), got {list(indptr.shape)}")
    check_index_tensor(offsets, "offsets", (indptr.shape[0] - 1,))
    nnz = q.shape[0]
    positions = sequence_positions(indptr, nnz, offsets, names=("indptr", "q.size(0)"))
    token = torch.arange(nnz, device=q.device)
    return positions, (token >= indptr[0]) & (token < indptr[-1])


def _pos_ids(q, pos_ids):
    return check_index_tensor(pos_ids, "pos_ids", (q.shape[0],))


def _run(q, k, table, interleave, inplace, rows=None):
    """Rotates by the table's rows `rows`, by default row t for token t."""
    check_flag(interleave, "interleave")
    if inplace:
        if rows is None:
            rows = torch.arange(q.shape[0], device=q.device)
        apply_rope_(q, k, rows, table, interleaved=interleave)
        return None
    if rows is not None:
        table = table[rows]
    half = table.shape[1] // 2
    cos, sin = table[:, None, :half], table[:, None, half:]
    return (_rotated(q, cos, sin, interleaved=interleave),
            _rotated(k, cos, sin, interleaved=interleave))


def _ragged(q, k, indptr, offsets, rotary_dim, interleave, rope_scale, rope_theta, inplace,
            llama31=None):
    _check_qk(q, k)
    rotary_dim = _rotary_dim(rotary_dim, q)
    positions, valid = _indptr_positions(q, indptr, offsets)
    table = _table(positions, valid, rotary_dim, rope_scale, rope_theta, llama31)
    return _run(q, k, table, interleave, inplace)


def _by_pos_ids(q, k, pos_ids, rotary_dim, interleave, rope_scale, rope_theta, inplace,
                llama31=None):
    _check_qk(q, k)
    rotary_dim = _rotary_dim(rotary_dim, q)
    pos_ids = _pos_ids(q, pos_ids)
    # On the CPU the rows of a kept table of positions 0 .. n-1 (_layout.positions_table): the
    # per-token table is a dozen small ops, 15 us of a 26 us decode call.
    llama31 = _llama31_args(llama31)
    key = ("flashinfer", rotary_dim, check_positive(rope_scale, "rope_scale"),
           check_positive(rope_theta, "rope_theta"), llama31)
    table = positions_table(pos_ids, key, rotary_dim, lambda positions: _table(
        positions, None, rotary_dim, rope_scale, rope_theta, llama31))
    if table is not None:
        return _run(q, k, table, interleave, inplace, pos_ids)
    table = _table(pos_ids, None, rotary_dim, rope_scale, rope_theta, llama31)
    return _run(q, k, table, interleave, inplace)


def apply_rope_inplace(q, k, indptr, offsets, rotary_dim=None, interleave=False, rope_scale=1,
                       rope_theta=1e4):
    """Rotates the ragged batch q (nnz, num_q_heads, head_dim), k (nnz, num_k_heads, head_dim) in
    place: token indptr[b] + i of segment b is at position offsets[b] + i. rotary_dim: the leading
    dims that rotate (default head_dim). interleave: pairs (2i, 2i+1) instead of
    (i, i + rotary_dim/2). Returns None."""
    _ragged(q, k, indptr, offsets, rotary_dim, interleave, rope_scale, rope_theta, True)


def apply_rope(q, k, indptr, offsets, rotary_dim=None, interleave=False, rope_scale=1,
               rope_theta=1e4):
    """apply_rope_inplace out of place: returns (q_rope, k_rope)."""
    return _ragged(q, k, indptr, offsets, rotary_dim, interleave, rope_scale, rope_theta, False)


def apply_rope_pos_ids_inplace(q, k, pos_ids, rotary_dim=None, interleave=False, rope_scale=1,
                               rope_theta=1e4):
    """Rotates q (nnz, num_q_heads, head_dim) and k (nnz, num_k_heads, head_dim) in place, token
    t at position pos_ids[t] (nnz,). Returns None."""
    _by_pos_ids(q, k, pos_ids, rotary_dim, interleave, rope_scale, rope_theta, True)


def apply_rope_pos_ids(q, k, pos_ids, rotary_dim=None, interleave=False, rope_scale=1,
                       rope_theta=1e4):
    """apply_rope_pos_ids_inplace out of place: returns (q_rope, k_rope)."""
    return _by_pos_ids(q, k, pos_ids, rotary_dim, interleave, rope_scale, rope_theta, False)


def apply_llama31_rope_inplace(q, k, indptr, offsets, rotary_dim=None, interleave=False,
                               rope_scale=8, rope_theta=5e5, low_freq_factor=1,
                               high_freq_factor=4, old_context_len=8192):
    """apply_rope_inplace with Llama 3.1 frequency scaling. Returns None."""
    _ragged(q, k, indptr, offsets, rotary_dim, interleave, rope_scale, rope_theta, True,
            (low_freq_factor, high_freq_factor, old_context_len))


def apply_llama31_rope(q, k, indptr, offsets, rotary_dim=None, interleave=False, rope_scale=8,
                       rope_theta=5e5, low_freq_factor=1, high_freq_factor=4,
                       old_context_len=8192):
    """apply_llama31_rope_inplace out of place: returns (q_rope, k_rope)."""
    return _ragged(q, k, indptr, offsets, rotary_dim, interleave, rope_scale, rope_theta, False,
                   (low_freq_factor, high_freq_factor, old_context_len))


def apply_llama31_rope_pos_ids_inplace(q, k, pos_ids, rotary_dim=None, interleave=False,
                                       rope_scale=8, rope_theta=5e5, low_freq_factor=1,
                                       high_freq_factor=4, old_context_len=8192):
    """apply_rope_pos_ids_inplace with Llama 3.1 frequency scaling. Returns None."""
    _by_pos_ids(q, k, pos_ids, rotary_dim, interleave, rope_scale, rope_theta, True,
                (low_freq_factor, high_freq_factor, old_context_len))


def apply_llama31_rope_pos_ids(q, k, pos_ids, rotary_dim=None, interleave=False, rope_scale=8,
                               rope_theta=5e5, low_freq_factor=1, high_freq_factor=4,
                               old_context_len=8192):
    """apply_llama31_rope_pos_ids_inplace out of place: returns (q_rope, k_rope)."""
    return _by_pos_ids(q, k, pos_ids, rotary_dim, interleave, rope_scale, rope_theta, False,
                       (low_freq_factor, high_freq_factor, old_context_len))


def _cache_views(positions, query, key, head_size, cos_sin_cache):
    return check_cache_views(positions, query, key, head_size, cos_sin_cache,
                             key_required="key is required (FlashInfer rotates query and key together)")


def apply_rope_with_cos_sin_cache_inplace(positions, query, key, head_size, cos_sin_cache,
                                          is_neox=True):
    """vLLM/SGLang-style: query (nnz, num_q_heads * head_size), key (nnz, num_k_heads *
    head_size) rotated in place by the rows of cos_sin_cache (max_seq_len, rotary_dim) float32
    (cos | sin) at positions (nnz,). is_neox=False: interleaved pairs. Returns None."""
    q, k = _cache_views(positions, query, key, head_size, cos_sin_cache)
    apply_rope_(q, k, positions, cos_sin_cache, interleaved=interleaved_of(is_neox))


def apply_rope_with_cos_sin_cache(positions, query, key, head_size, cos_sin_cache, is_neox=True):
    """apply_rope_with_cos_sin_cache_inplace out of place: returns (query_out, key_out) of
    query's and key's shapes."""
    q, k = _cache_views(positions, query, key, head_size, cos_sin_cache)
    interleaved = interleaved_of(is_neox)
    rotate = lambda t, like: apply_rope_at(t, positions, cos_sin_cache,  # noqa: E731
                                           interleaved=interleaved).reshape(like.shape)
    return rotate(q, query), rotate(k, key)


# ---- RoPE + FP8 quantization (flashinfer.rope.rope_quantize_fp8 and family) ----
# FlashInfer's convention: stored = fp8(rotated * quant_scale), saturated to the format's finite
# range. (rope_ext's own cache write, apply_rope_and_cache_, divides by its scale, as vLLM does.)

_FP8_DEFAULT = torch.float8_e4m3fn


def _nope_parts(q_rope, k_rope, q_nope, k_nope):
    """FlashInfer's None nope parts: size-0 tensors of the rope parts' leading dims (for DTensors
    size-0 views, in the rope parts' layouts)."""
    if q_nope is None:
        q_nope = (q_rope[..., :0] if is_dtensor(q_rope) else
                  torch.empty(*q_rope.shape[:-1], 0, dtype=q_rope.dtype, device=q_rope.device))
    if k_nope is None:
        k_nope = (k_rope[..., :0] if is_dtensor(k_rope) else
                  torch.empty(*k_rope.shape[:-1], 0, dtype=k_rope.dtype, device=k_rope.device))
    return q_nope, k_nope


def _check_inputs(cos_sin_cache, q_rope, k_rope, **optional):
    """The tensors named (the optional ones may be None; a non-tensor is named here, not by
    empty_like or an attribute); a float32 table."""
    if not (isinstance(q_rope, torch.Tensor) and isinstance(k_rope, torch.Tensor)
            and isinstance(cos_sin_cache, torch.Tensor)
            and all(t is None or isinstance(t, torch.Tensor) for t in optional.values())):
        check_tensors(tuple(optional), q_rope=q_rope, k_rope=k_rope, cos_sin_cache=cos_sin_cache,
                      **optional)
    if cos_sin_cache.dtype != F32:
        raise ValueError("cos_sin_cache should be float32")


def _check_dtype(quantize_dtype):
    if not isinstance(quantize_dtype, torch.dtype):  # (the op checks that it is a float8 one)
        raise ValueError(f"quantize_dtype must be a torch.dtype (torch.float8_e4m3fn or "
                         f"torch.float8_e5m2), got {quantize_dtype!r}")


def rope_quantize_fp8(q_rope, k_rope, q_nope, k_nope, cos_sin_cache, pos_ids, is_neox=True,
                      quantize_dtype=None, quant_scale_q=1.0, quant_scale_kv=1.0, q_rope_out=None,
                      k_rope_out=None, q_nope_out=None, k_nope_out=None, enable_pdl=False,
                      backend="cuda"):
    """RoPE on q_rope (nnz, Hq, rope_dim) and k_rope ((nnz, Hk, rope_dim), or (nnz, rope_dim) for
    MLA) by the rows of cos_sin_cache (max_seq_len, rope_dim) float32 (cos | sin) at pos_ids;
    q_nope / k_nope (None: size 0) pass unrotated; queries times quant_scale_q, keys times
    quant_scale_kv, saturated to float8 (quantize_dtype, else the given outputs' dtype, else
    float8_e4m3fn). Outputs are written in place when given, allocated otherwise. One fused
    rope_ext op (torch.ops.rope.quantize_fp8). enable_pdl and backend are accepted (both
    FlashInfer backends compute the same values). Returns (q_rope_out, k_rope_out, q_nope_out,
    k_nope_out)."""
    if backend not in ("cuda", "cutile"):
        raise ValueError(f"Unsupported backend for rope_quantize_fp8: {backend!r}; "
                         "expected 'cuda' or 'cutile'.")
    _check_inputs(cos_sin_cache, q_rope, k_rope, q_nope=q_nope, k_nope=k_nope,
                  q_rope_out=q_rope_out, k_rope_out=k_rope_out, q_nope_out=q_nope_out,
                  k_nope_out=k_nope_out)
    q_nope, k_nope = _nope_parts(q_rope, k_rope, q_nope, k_nope)
    if quantize_dtype is None:
        given = [o for o in (q_rope_out, k_rope_out, q_nope_out, k_nope_out) if o is not None]
        quantize_dtype = given[0].dtype if given else _FP8_DEFAULT
    _check_dtype(quantize_dtype)
    outs = [o if o is not None else torch.empty_like(x, dtype=quantize_dtype)
            for o, x in ((q_rope_out, q_rope), (k_rope_out, k_rope), (q_nope_out, q_nope),
                         (k_nope_out, k_nope))]
    ops.quantize_fp8(q_rope, k_rope, q_nope, k_nope, cos_sin_cache, pos_ids, *outs,
                     check_float(quant_scale_q, "quant_scale_q"),
                     check_float(quant_scale_kv, "quant_scale_kv"), interleaved_of(is_neox))
    return tuple(outs)


def mla_rope_quantize_fp8(q_rope, k_rope, q_nope, k_nope, cos_sin_cache, pos_ids, is_neox=True,
                          quantize_dtype=None, quant_scale_q=1.0, quant_scale_kv=1.0,
                          q_rope_out=None, k_rope_out=None, q_nope_out=None, k_nope_out=None,
                          enable_pdl=False):
    """rope_quantize_fp8 with MLA's 2-D keys: k_rope (nnz, rope_dim), k_nope (nnz,
    no_rope_dim)."""
    return rope_quantize_fp8(q_rope, k_rope, q_nope, k_nope, cos_sin_cache, pos_ids, is_neox,
                             quantize_dtype, quant_scale_q, quant_scale_kv, q_rope_out,
                             k_rope_out, q_nope_out, k_nope_out, enable_pdl)


def rope_quantize_fp8_append_paged_kv_cache(q_rope, k_rope, q_nope, k_nope, v, cos_sin_cache,
                                            pos_ids, paged_kv_cache, kv_indices, kv_indptr,
                                            batch_indices, positions, is_neox=True,
                                            quantize_dtype=None, quant_scale_q=1.0,
                                            quant_scale_kv=1.0, page_size=16, kv_layout="NHD",
                                            q_rope_out=None, q_nope_out=None, enable_pdl=False):
    """rope_quantize_fp8 for the queries (returned: (q_rope_out, q_nope_out)), while the keys go
    straight into a paged float8 cache: MLA (2-D k_rope, v None) into paged_kv_cache = (ckv_cache
    (max_pages, page_size, no_rope_dim), kpe_cache (max_pages, page_size, rope_dim)); GQA/MHA
    (3-D k_rope) the full key row (rotated part first) and v (nnz, Hk, head_dim) into
    paged_kv_cache = (k_cache, v_cache), (max_pages, page_size, Hk, head_dim) for kv_layout
    "NHD" or (max_pages, Hk, page_size, head_dim) for "HND". Token t of request
    batch_indices[t] (negative: padding, not stored) at in-request position positions[t] goes to
    page kv_indices[kv_indptr[b] + positions[t] // page_size], entry positions[t] % page_size.
    One fused rope_ext op (torch.ops.rope.quantize_fp8_append_paged_kv_cache)."""
    _check_inputs(cos_sin_cache, q_rope, k_rope, q_nope=q_nope, k_nope=k_nope, v=v,
                  q_rope_out=q_rope_out, q_nope_out=q_nope_out)
    mla = k_rope.dim() == 2
    q_nope, k_nope = _nope_parts(q_rope, k_rope, q_nope, k_nope)
    if quantize_dtype is None:
        if q_rope_out is not None:
            quantize_dtype = q_rope_out.dtype
        elif q_nope_out is not None:
            quantize_dtype = q_nope_out.dtype
        else:
            quantize_dtype = _FP8_DEFAULT
    _check_dtype(quantize_dtype)
    if q_rope_out is None:
        q_rope_out = torch.empty_like(q_rope, dtype=quantize_dtype)
    if q_nope_out is None:
        q_nope_out = torch.empty_like(q_nope, dtype=quantize_dtype)
    if mla and v is not None:
        raise ValueError("MLA should not have V input (pass None)")
    if not isinstance(paged_kv_cache, (tuple, list)) or len(paged_kv_cache) != 2:
        raise ValueError("paged_kv_cache must be a tuple of 2 tensors")
    cache_0, cache_1 = paged_kv_cache
    if mla:
        if cache_0.dtype != quantize_dtype or cache_1.dtype != quantize_dtype:
            raise ValueError(f"MLA cache dtype mismatch: expected {quantize_dtype}, "
                             f"got ckv={cache_0.dtype}, kpe={cache_1.dtype}")
        if cache_0.ndim != 3 or cache_1.ndim != 3:
            raise ValueError(f"MLA cache must be 3D: (max_pages, page_size, dim), "
                             f"got ckv={cache_0.ndim}D, kpe={cache_1.ndim}D")
    else:
        if v is None:
            raise ValueError("GQA/MHA expects a V tensor, but got None. "
                             "Only MLA uses None for V (compressed KV representation).")
        if cache_0.dtype != quantize_dtype or cache_1.dtype != quantize_dtype:
            raise ValueError(f"GQA/MHA cache dtype mismatch: expected {quantize_dtype}, "
                             f"got k={cache_0.dtype}, v={cache_1.dtype}")
        if cache_0.ndim != 4 or cache_1.ndim != 4:
            raise ValueError(f"GQA/MHA cache must be 4D, got k={cache_0.ndim}D, v={cache_1.ndim}D")
    ops.quantize_fp8_append_paged_kv_cache(
        q_rope, k_rope, q_nope, k_nope, v, cos_sin_cache, pos_ids, q_rope_out, q_nope_out,
        cache_0, cache_1, kv_indices, kv_indptr, batch_indices, positions,
        check_int(page_size, "page_size"), kv_layout, check_float(quant_scale_q, "quant_scale_q"),
        check_float(quant_scale_kv, "quant_scale_kv"), interleaved_of(is_neox))
    return q_rope_out, q_nope_out
