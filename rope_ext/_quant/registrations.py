"""RoPE + FP8 quantization ops: their pure-PyTorch reference (the readable spec, serving any device
without a native kernel), fake kernels, and the autograd / in-place bookkeeping of mutable ops.

rope.quantize_fp8: q_rope (nnz, Hq, R) and k_rope (nnz, Hk, R) or (nnz, R) (MLA) rotated by the
rows of cos_sin_cache (max_position, R) float32 at pos_ids, q_nope / k_nope passed through
unrotated, every part multiplied by its scale (quant_scale_q for queries, quant_scale_kv for
keys) and saturated to float8: fp8(clamp(float32(x) * scale)), written into the four outputs.

rope.quantize_fp8_append_paged_kv_cache: the same for the queries (into q_rope_out and
q_nope_out), while the keys (and, for GQA/MHA, the values) go straight into a paged cache: token
t of request b = batch_indices[t] (negative: padding, not stored) at in-request position
positions[t] lands in page kv_indices[kv_indptr[b] + positions[t] // page_size], entry
positions[t] % page_size. GQA/MHA: k_cache, v_cache (max_pages, page_size, Hk, R + N) ("NHD") or
(max_pages, Hk, page_size, R + N) ("HND"), the key row rotated part first. MLA: the cache pair is
(ckv_cache (max_pages, page_size, N), kpe_cache (max_pages, page_size, R)).

The rotation is rope_math.h's: a*c - b*s, b*c + a*s in float32 (no fused multiply-add), the
product with the scale in float32, then the float8 conversion saturating at the format's largest
finite value (NaN stays NaN) with round-to-nearest-even: what FlashInfer's kernels compute.
"""

import torch

from . import checks as qc
from .. import _registrations as base
from ..reference import _join_pairs, _split_pairs


# ---- the math ----

def _f32(scale):
    return torch.tensor(scale, dtype=torch.float32).item()  # the kernels' float(scale)


def fp8_codes(x, scale, dtype):
    """x (float32) times scale, saturated and converted: uint8 codes of `dtype`."""
    m = torch.finfo(dtype).max
    return (x * _f32(scale)).clamp(-m, m).to(dtype).view(torch.uint8)  # clamp keeps NaN


def _rotated(x, cos, sin, interleaved):
    """x (nnz, H, R) rotated in float32 by cos, sin (nnz, 1, R/2)."""
    a, b = _split_pairs(x.float(), cos.shape[-1], interleaved)
    return _join_pairs(a * cos - b * sin, b * cos + a * sin, interleaved)


def _quantized(q_rope, k_rope, q_nope, k_nope, cos_sin_cache, pos_ids, scale_q, scale_kv,
               interleaved, fmt):
    """The codes of the four parts (k parts of k_rope's rank)."""
    half = cos_sin_cache.shape[1] // 2
    rows = cos_sin_cache[pos_ids.long()]
    cos, sin = rows[:, None, :half], rows[:, None, half:]
    k3 = k_rope.unsqueeze(1) if k_rope.dim() == 2 else k_rope
    k_rot = _rotated(k3, cos, sin, interleaved).reshape(k_rope.shape)
    return (fp8_codes(_rotated(q_rope, cos, sin, interleaved), scale_q, fmt),
            fp8_codes(k_rot, scale_kv, fmt),
            fp8_codes(q_nope.float(), scale_q, fmt),
            fp8_codes(k_nope.float(), scale_kv, fmt))


def _write(out, codes):
    out.view(torch.uint8).copy_(codes)


# ---- reference kernels ----

def quantize_fp8(q_rope, k_rope, q_nope, k_nope, cos_sin_cache, pos_ids, q_rope_out, k_rope_out,
                 q_nope_out, k_nope_out, quant_scale_q=1.0, quant_scale_kv=1.0, interleaved=False):
    _, fmt = qc.check_quantize(q_rope, k_rope, q_nope, k_nope, cos_sin_cache, pos_ids, q_rope_out,
                               k_rope_out, q_nope_out, k_nope_out)
    qc.check_pos_ids(pos_ids, cos_sin_cache.shape[0], qc.OP)
    codes = _quantized(q_rope, k_rope, q_nope, k_nope, cos_sin_cache, pos_ids, quant_scale_q,
                       quant_scale_kv, interleaved, fmt)
    for out, c in zip((q_rope_out, k_rope_out, q_nope_out, k_nope_out), codes):
        _write(out, c)


def quantize_fp8_append_paged_kv_cache(q_rope, k_rope, q_nope, k_nope, v, cos_sin_cache, pos_ids,
                                       q_rope_out, q_nope_out, k_cache, v_cache, kv_indices,
                                       kv_indptr, batch_indices, positions, page_size,
                                       kv_layout="NHD", quant_scale_q=1.0, quant_scale_kv=1.0,
                                       interleaved=False):
    geo, fmt = qc.check_paged(q_rope, k_rope, q_nope, k_nope, v, cos_sin_cache, pos_ids,
                              q_rope_out, q_nope_out, k_cache, v_cache, kv_indices, kv_indptr,
                              batch_indices, positions, page_size, kv_layout)
    mla = geo[-1]
    qc.check_pos_ids(pos_ids, cos_sin_cache.shape[0], qc.PAGED_OP)
    tokens, pages, entries = qc.paged_slots(kv_indices, kv_indptr, batch_indices, positions,
                                            page_size, k_cache.shape[0])
    qr, kr, qn, kn = _quantized(q_rope, k_rope, q_nope, k_nope, cos_sin_cache, pos_ids,
                                quant_scale_q, quant_scale_kv, interleaved, fmt)
    _write(q_rope_out, qr)
    _write(q_nope_out, qn)
    if not tokens:
        return
    dev = q_rope.device
    t, p, e = (torch.tensor(x, dtype=torch.long, device=dev) for x in (tokens, pages, entries))
    kc, vc = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    if mla:
        kc[p, e] = kn[t]
        vc[p, e] = kr[t]
        return
    k_rows = torch.cat((kr[t], kn[t]), dim=-1)
    v_rows = fp8_codes(v[t].float(), quant_scale_kv, fmt)
    if kv_layout == "NHD":
        kc[p, e] = k_rows
        vc[p, e] = v_rows
    else:  # (pages, heads, page_size, dim): the advanced indices around a slice come first
        kc[p, :, e] = k_rows
        vc[p, :, e] = v_rows


# ---- fake kernels ----

def _fake_quantize_fp8(q_rope, k_rope, q_nope, k_nope, cos_sin_cache, pos_ids, q_rope_out,
                       k_rope_out, q_nope_out, k_nope_out, quant_scale_q=1.0, quant_scale_kv=1.0,
                       interleaved=False):
    qc.check_quantize(q_rope, k_rope, q_nope, k_nope, cos_sin_cache, pos_ids, q_rope_out,
                      k_rope_out, q_nope_out, k_nope_out, memory=False)


def _fake_paged(q_rope, k_rope, q_nope, k_nope, v, cos_sin_cache, pos_ids, q_rope_out, q_nope_out,
                k_cache, v_cache, kv_indices, kv_indptr, batch_indices, positions, page_size,
                kv_layout="NHD", quant_scale_q=1.0, quant_scale_kv=1.0, interleaved=False):
    qc.check_paged(q_rope, k_rope, q_nope, k_nope, v, cos_sin_cache, pos_ids, q_rope_out,
                   q_nope_out, k_cache, v_cache, kv_indices, kv_indptr, batch_indices, positions,
                   page_size, kv_layout, memory=False)


def ops_table(op_type):
    """These ops' entries of rope_ext._registrations.OPS (op_type: its Op)."""
    return {
        "quantize_fp8": op_type(quantize_fp8, _fake_quantize_fp8,
                                mutable_autograd=base.serving_autograd("quantize_fp8"),
                                differentiable=False),
        "quantize_fp8_append_paged_kv_cache": op_type(
            quantize_fp8_append_paged_kv_cache, _fake_paged,
            mutable_autograd=base.serving_autograd("quantize_fp8_append_paged_kv_cache"),
            differentiable=False),
    }


base.OPS.update(ops_table(base.Op))
