"""Pure-PyTorch fused QK-RMSNorm + RoPE: the readable spec of rope.qk_norm_rope* and the kernel
wherever no native one serves. Math in float32 (float64 for float64 inputs), rounded once to the
input dtype, like the native kernels; docs/qk_norm.md has the formulas.
"""

import torch

from . import checks
from .. import reference


def _acc_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def rms_norm_rope(x, weight, cos, sin, eps, unit_offset, interleaved):
    """RMSNorm then RoPE of x by cos/sin (..., rotary_dim/2, broadcast), rounded once to x.dtype."""
    y = norm_forms(x, weight, None, eps, "rms", unit_offset)[0]
    # reference._rotate computes in y's (arithmetic) dtype and does not round
    return reference._rotate(y, cos, sin, interleaved, inverse=False).to(x.dtype)


def qk_norm_rope(query, key, q_weight, k_weight, cos, sin, eps, unit_offset=False,
                 interleaved=False):
    checks.check_qk_norm_rope(query, key, q_weight, k_weight, cos, sin, eps)
    return (rms_norm_rope(query, q_weight, cos, sin, eps, unit_offset, interleaved),
            rms_norm_rope(key, k_weight, cos, sin, eps, unit_offset, interleaved))


def _affine(t, x, norm, unit_offset=False):
    """A weight or bias (None: None) in the arithmetic type, shaped to scale the rows of x it
    normalizes: (head_dim,), or (heads, head_dim) across heads; plus 1 with unit_offset."""
    if t is None:
        return None
    t = t.to(_acc_dtype(x.dtype)).reshape(x.shape[-2:] if norm == "rms_across_heads" else x.shape[-1:])
    return t + 1 if unit_offset else t


def norm_forms(x, weight, bias, eps, norm, unit_offset=False):
    """The norm of x (..., H, D) in the arithmetic type, not rounded: returns (z, n, r):
    n = (x - mean) * r normalized (mean 0 unless norm == "layer"), r = rsqrt(mean of the squares
    + eps) over each head (over all heads of a token for "rms_across_heads"), and
    z = n * w + bias, w = weight (1 + weight with unit_offset; 1 where None; bias 0 where None)."""
    n, r = _normalized(x, eps, norm)
    return _scaled(n, x, weight, bias, norm, unit_offset), n, r


def _normalized(x, eps, norm):
    """(n, r) of norm_forms."""
    xf = x.to(_acc_dtype(x.dtype))
    dims = (-2, -1) if norm == "rms_across_heads" else (-1,)
    if norm == "layer":
        xf = xf - xf.mean(dims, keepdim=True)
    r = torch.rsqrt(xf.square().mean(dims, keepdim=True) + eps)
    return xf * r, r


def _scaled(n, x, weight, bias, norm, unit_offset):
    """z = n * w + bias of norm_forms."""
    z = n
    w, b = _affine(weight, x, norm, unit_offset), _affine(bias, x, norm)
    if w is not None:
        z = z * w
    if b is not None:
        z = z + b
    return z


def norm_rope(query, key, q_weight, k_weight, q_bias, k_bias, cos, sin, eps, norm="rms",
              interleaved=False):
    """rope.norm_rope: each of query and key normalized (norm_forms), rotated, rounded once."""
    checks.check_norm_rope(query, key, q_weight, k_weight, q_bias, k_bias, cos, sin, eps, norm)
    out = []
    for x, w, b in ((query, q_weight, q_bias), (key, k_weight, k_bias)):
        z = norm_forms(x, w, b, eps, norm)[0]
        out.append(reference._rotate(z, cos, sin, interleaved, inverse=False).to(x.dtype))
    return tuple(out)


def _sum_leading(t, kept):
    """t summed over all but its last `kept` dims. (Not a reshape to (-1, width) first: a
    DTensor sharded unevenly over a leading dim cannot be flattened.)"""
    lead = tuple(range(t.dim() - kept))
    return t.sum(dim=lead) if lead else t


def norm_forms_rope_backward(x, weight, bias, grad, cos, sin, eps, norm, interleaved, need,
                             unit_offset=False):
    """Gradients (x, weight, bias, cos, sin) of x's norm_forms then rotation; need: which of
    (x, weight, bias, tables) are wanted (None for the others). The inverse rotation of grad,
    then the norm's backward, in the arithmetic type (docs/qk_norm.md "Backward"). It runs at the
    start of a training step's backward, where memory peaks: temporaries of x's size in the
    arithmetic type are made only where needed and reused in place."""
    need_x, need_w, need_b, need_tables = need
    acc = _acc_dtype(x.dtype)
    g = torch.ops.rope.apply_backward(grad.to(acc), cos, sin, interleaved)
    n, r = _normalized(x, eps, norm)
    across = norm == "rms_across_heads"
    dims = (-2, -1) if across else (-1,)
    width = x.shape[-2] * x.shape[-1] if across else x.shape[-1]
    gx = gw = gb = gc = gs = None
    if need_w and weight is not None:
        gw = _sum_leading(g * n, len(dims)).reshape(width).to(weight.dtype)
    if need_b and bias is not None:
        gb = _sum_leading(g, len(dims)).reshape(width).to(bias.dtype)
    if need_tables:  # the rotation's input: its only reader
        gc, gs = reference.table_grads(_scaled(n, x, weight, bias, norm, unit_offset), grad, cos,
                                       sin, interleaved)
    if need_x:
        w = _affine(weight, x, norm, unit_offset)
        # In place (g, then n, are not read after their last use here), unless this backward is
        # itself recorded (double backward: autograd keeps what these ops read).
        inplace = not torch.is_grad_enabled()
        gn = g if w is None else (g.mul_(w) if inplace else g * w)
        m = (gn * n).mean(dims, keepdim=True)
        centre = gn.mean(dims, keepdim=True) if norm == "layer" else None
        # (gn - n * m in place in gn, which derives from grad: n derives from x, and under
        # is_grads_batched's vmap an in-place write of batched m into unbatched n is an error)
        gn = gn.addcmul_(n, m, value=-1) if inplace else gn - n * m
        if centre is not None:
            gn = gn.sub_(centre) if inplace else gn - centre
        gx = (gn.mul_(r) if inplace else gn * r).to(x.dtype)
    return gx, gw, gb, gc, gs


def qk_norm_rope_backward(grad, x, weight, cos, sin, eps, unit_offset=False, interleaved=False):
    """rope.qk_norm_rope_backward: (grad_x, grad_weight) of rms_norm_rope's x and weight given
    its output's gradient grad; grad_weight in the arithmetic type (float32, float64)."""
    checks.check_qk_norm_rope_backward(grad, x, weight, cos, sin, eps)
    gx, gw = norm_forms_rope_backward(x, weight.to(_acc_dtype(x.dtype)), None, grad, cos, sin, eps,
                                      "rms", interleaved, (True, True, False, False),
                                      unit_offset)[:2]
    return gx.contiguous(), gw


def _norm_rope_inplace(query, key, q_weight, k_weight, positions, cache, eps, unit_offset,
                       interleaved, section, mrope_interleaved):
    if query.numel() == 0 and key.numel() == 0:
        return
    cos, sin = reference.cache_halves(cache)
    c, s = reference.gather_tables(positions, cos, sin, section, mrope_interleaved)
    for t, w in ((query, q_weight), (key, k_weight)):
        t.copy_(rms_norm_rope(t, w, c, s, eps, unit_offset, interleaved))


def qk_norm_rope_(query, key, q_weight, k_weight, positions, cos_sin_cache, eps,
                  unit_offset=False, interleaved=False, mrope_section=None,
                  mrope_interleaved=False):
    section = checks.check_qk_norm_rope_inplace(query, key, q_weight, k_weight, positions,
                                                cos_sin_cache, eps, mrope_section,
                                                mrope_interleaved=mrope_interleaved)
    positions = reference._checks.positions_read_once(positions, (query, key))
    reference._checks.check_positions_in_range(positions, cos_sin_cache.shape[0], checks.OP_INPLACE)
    _norm_rope_inplace(query, key, q_weight, k_weight, positions, cos_sin_cache, eps, unit_offset,
                       interleaved, section, mrope_interleaved)


def qkv_norm_rope_(qkv, num_heads_q, num_heads_k, num_heads_v, head_dim, q_weight, k_weight,
                   positions, cos_sin_cache, eps, unit_offset=False, interleaved=False,
                   mrope_section=None, mrope_interleaved=False):
    query, key, section = checks.check_qkv_norm_rope(
        qkv, num_heads_q, num_heads_k, num_heads_v, head_dim, q_weight, k_weight, positions,
        cos_sin_cache, eps, mrope_section, mrope_interleaved=mrope_interleaved)
    positions = reference._checks.positions_read_once(positions, (qkv,))
    reference._checks.check_positions_in_range(positions, cos_sin_cache.shape[0], checks.OP_PACKED)
    _norm_rope_inplace(query, key, q_weight, k_weight, positions, cos_sin_cache, eps, unit_offset,
                       interleaved, section, mrope_interleaved)


def _prologue(query, key, value, positions, cos_sin_cache, q_weight, k_weight, key_cache,
              value_cache, slot_mapping, eps, unit_offset, interleaved, mrope_section,
              mrope_interleaved, v_norm, kv_cache_dtype, k_scale, v_scale, in_place):
    """The serving prologue. In place: qk_norm_rope_ on query and key, with v_norm each value
    head RMS-normalized without weight (in place), then key and value stored into the paged
    caches as rope.apply_and_cache_ stores them. Out of place: the same on new contiguous copies
    of query, key and value, which are returned."""
    _checks = reference._checks
    op = checks.OP_CACHE if in_place else checks.OP_CACHE_OUT
    fmt, section = checks.check_qk_norm_rope_and_cache(
        query, key, value, positions, cos_sin_cache, q_weight, k_weight, key_cache, value_cache,
        slot_mapping, eps, mrope_section, mrope_interleaved, v_norm, kv_cache_dtype, k_scale,
        v_scale, in_place=in_place)
    written = (query, key, value, key_cache, value_cache) if in_place else (key_cache, value_cache)
    positions = _checks.positions_read_once(positions, written)
    slot_mapping = _checks.positions_read_once(slot_mapping, written)
    _checks.check_positions_in_range(positions, cos_sin_cache.shape[0], op)
    _checks.check_slots_in_range(slot_mapping, key_cache.shape[0] * key_cache.shape[1], op)
    if not in_place:
        query, key, value = (t.clone(memory_format=torch.contiguous_format)
                             for t in (query, key, value))
    _norm_rope_inplace(query, key, q_weight, k_weight, positions, cos_sin_cache, eps, unit_offset,
                       interleaved, section, mrope_interleaved)
    if v_norm and value.numel():
        acc = _acc_dtype(value.dtype)
        vf = value.to(acc)
        value.copy_(vf * torch.rsqrt(vf.square().mean(-1, keepdim=True) + eps))
    reference.store_paged(key, value, key_cache, value_cache, slot_mapping, fmt, k_scale, v_scale)
    return query, key, value


def qk_norm_rope_and_cache_(query, key, value, positions, cos_sin_cache, q_weight, k_weight,
                            key_cache, value_cache, slot_mapping, eps=1e-6, *, unit_offset=False,
                            interleaved=False, mrope_section=None, mrope_interleaved=False,
                            v_norm=False, kv_cache_dtype="auto", k_scale=None, v_scale=None):
    """The serving prologue in place (_prologue); returns (query, key)."""
    _prologue(query, key, value, positions, cos_sin_cache, q_weight, k_weight, key_cache,
              value_cache, slot_mapping, eps, unit_offset, interleaved, mrope_section,
              mrope_interleaved, v_norm, kv_cache_dtype, k_scale, v_scale, True)
    return query, key


def qk_norm_rope_and_cache(query, key, value, positions, cos_sin_cache, q_weight, k_weight,
                           key_cache, value_cache, slot_mapping, eps=1e-6, *, unit_offset=False,
                           interleaved=False, mrope_section=None, mrope_interleaved=False,
                           v_norm=False, kv_cache_dtype="auto", k_scale=None, v_scale=None):
    """The serving prologue out of place (_prologue); returns the new (query, key, value)."""
    return _prologue(query, key, value, positions, cos_sin_cache, q_weight, k_weight, key_cache,
                     value_cache, slot_mapping, eps, unit_offset, interleaved, mrope_section,
                     mrope_interleaved, v_norm, kv_cache_dtype, k_scale, v_scale, False)
