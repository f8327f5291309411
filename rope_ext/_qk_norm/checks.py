"""Argument checks of the fused QK-RMSNorm + RoPE ops (rope.qk_norm_rope, rope.qk_norm_rope_,
rope.qkv_norm_rope_), for the reference and fake kernels. They reuse rope_ext._checks for what
the rotation ops share (query/key, positions, the cos_sin_cache) and add the norm's arguments;
the native checks (csrc/ops/qk_norm/checks.h) raise the same messages in the same order.
"""

import math
import numbers

from .. import _checks
from .._checks import _fail, _shape, dtype_name

OP_OUT = "rope.qk_norm_rope"
OP_INPLACE = "rope.qk_norm_rope_"
OP_PACKED = "rope.qkv_norm_rope_"
OP_CACHE = "rope.qk_norm_rope_and_cache_"
OP_CACHE_OUT = "rope.qk_norm_rope_and_cache"
OP_FORMS = "rope.norm_rope"
OP_BACKWARD = "rope.qk_norm_rope_backward"

NORM_FORMS = ("rms", "rms_across_heads", "layer")
# The norm forms other than a weighted per-head RMSNorm run each row through the kernels' stack
# buffer (csrc/ops/cpu/kernel_api.h kQkNormStackHeadDim).
MAX_GENERAL_HEAD_DIM = 1024
FLOAT32_MAX = 3.4028234663852886e38


def _eps_str(eps):
    try:
        return format(float(eps), "g")  # as the native checks print it
    except (TypeError, ValueError):
        return repr(eps)


def check_eps(eps, op):
    if not (isinstance(eps, numbers.Real) and not isinstance(eps, bool)) or not math.isfinite(eps) or eps < 0:
        _fail(f"{op}: eps must be a finite number >= 0, got {_eps_str(eps)}")
    if eps > FLOAT32_MAX:  # the norm adds it in float32, where it would be inf
        _fail(f"{op}: eps must be at most 3.40282e+38 (float32's largest), got {_eps_str(eps)}")


def check_weight(w, name, head_dim, ref, ref_name, op):
    """A norm weight: 1-D (head_dim,), floating point, on ref's device."""
    _checks._check_same_device(ref, ref_name, w, op, name)
    if w.dtype not in _checks.FLOAT_DTYPES:
        _fail(f"{op}: {name} must be float16, bfloat16, float32 or float64, got "
              f"{dtype_name(w.dtype)}")
    if w.dim() != 1 or w.shape[0] != head_dim:
        _fail(f"{op}: {name} must have shape (head_dim,) = ({head_dim},), got {_shape(w)}")


def check_weights(q_weight, k_weight, head_dim, ref, ref_name, op):
    """q_weight and k_weight: check_weight each."""
    check_weight(q_weight, "q_weight", head_dim, ref, ref_name, op)
    check_weight(k_weight, "k_weight", head_dim, ref, ref_name, op)


def check_weights_disjoint(q_weight, k_weight, written, op):
    """The weights are read while the written tensors ((name, tensor or None) pairs) are
    written: no byte may be both."""
    for wname, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        for tname, t in written:
            if t is not None:
                _checks.check_disjoint_bytes(t, tname, w, wname, op)


def check_qk_norm_rope(query, key, q_weight, k_weight, cos, sin, eps):
    """The out-of-place op: query (..., Hq, D) and key (..., Hk, D) of one dtype with the same
    leading dims; cos/sin (..., rotary_dim/2) broadcast to each as rope.apply takes them."""
    op = OP_OUT
    _checks.check_apply(query, cos, sin, op=op, x_name="query")
    _checks.check_apply(key, cos, sin, op=op, x_name="key")
    _check_query_key(query, key, op)
    check_weights(q_weight, k_weight, query.shape[-1], query, "query", op)
    check_eps(eps, op)


def check_qk_norm_rope_backward(grad, x, weight, cos, sin, eps):
    """rope.qk_norm_rope_backward: x (..., D) with cos/sin as rope.apply takes them, grad of x's
    device, dtype and shape, weight (D,)."""
    op = OP_BACKWARD
    _checks.check_apply(x, cos, sin, op=op, x_name="x")
    _checks._check_same_device(x, "x", grad, op, "grad")
    if grad.dtype != x.dtype:
        _fail(f"{op}: grad must have the dtype of x ({dtype_name(x.dtype)}), got "
              f"{dtype_name(grad.dtype)}")
    if _checks.differ(grad.shape, x.shape):
        _fail(f"{op}: grad must have the shape of x {_shape(x)}, got {_shape(grad)}")
    check_weight(weight, "weight", x.shape[-1], x, "x", op)
    check_eps(eps, op)


def _check_query_key(query, key, op):
    if query.dim() < 2:
        _fail(f"{op}: query must have shape (..., num_heads, head_dim), got {_shape(query)}")
    if key.dtype != query.dtype:
        _fail(f"{op}: key must have the dtype of query ({dtype_name(query.dtype)}), got "
              f"{dtype_name(key.dtype)}")
    if key.dim() != query.dim() or key.shape[-1] != query.shape[-1]:
        _fail(f"{op}: key must have shape (..., num_kv_heads, head_dim) with the number of dims "
              f"and head_dim of query {_shape(query)}, got {_shape(key)}")


def uses_general_rows(norm, q_weight, k_weight, q_bias, k_bias):
    """Whether rope.norm_rope runs its rows through the general norm path (anything but a
    weighted per-head RMSNorm without bias); head_dim is bounded there."""
    return (norm != "rms" or q_bias is not None or k_bias is not None)


def check_norm_rope(query, key, q_weight, k_weight, q_bias, k_bias, cos, sin, eps, norm):
    """rope.norm_rope: rope.qk_norm_rope's query, key and tables; the norm form; optional
    weights and biases, (head_dim,) per head or (num_heads * head_dim,) across heads."""
    op = OP_FORMS
    if not isinstance(norm, str) or norm not in NORM_FORMS:
        _fail(f"{op}: norm must be 'rms', 'rms_across_heads' or 'layer', got {norm!r}")
    _checks.check_apply(query, cos, sin, op=op, x_name="query")
    _checks.check_apply(key, cos, sin, op=op, x_name="key")
    _check_query_key(query, key, op)
    head_dim = query.shape[-1]
    across = norm == "rms_across_heads"
    for name, t, x in (("q_weight", q_weight, query), ("k_weight", k_weight, key),
                       ("q_bias", q_bias, query), ("k_bias", k_bias, key)):
        if t is None:
            continue
        _checks._check_same_device(query, "query", t, op, name)
        if t.dtype not in _checks.FLOAT_DTYPES:
            _fail(f"{op}: {name} must be float16, bfloat16, float32 or float64, got "
                  f"{dtype_name(t.dtype)}")
        n = x.shape[-2] * head_dim if across else head_dim
        if t.dim() != 1 or t.shape[0] != n:
            what = "num_heads * head_dim" if across else "head_dim"
            shown = n if n < 2**63 else "2^63 or more"
            _fail(f"{op}: {name} must have shape ({what},) = ({shown},), got {_shape(t)}")
    if across:
        for x, name in ((query, "query"), (key, "key")):
            if any(t.dim() == x.dim() and t.shape[-2] != 1 for t in (cos, sin)):
                _fail(f"{op}: norm='rms_across_heads' normalizes the heads of a token together, "
                      f"so cos and sin must be shared by them (size 1 at dim -2 of {name} "
                      f"{_shape(x)}), got cos {_shape(cos)} and sin {_shape(sin)}")
    if uses_general_rows(norm, q_weight, k_weight, q_bias, k_bias) and head_dim > MAX_GENERAL_HEAD_DIM:
        _fail(f"{op}: head_dim must be <= {MAX_GENERAL_HEAD_DIM} for norm={norm!r} or with "
              f"biases, got {head_dim}")
    check_eps(eps, op)


def check_qk_norm_rope_inplace(query, key, q_weight, k_weight, positions, cache, eps,
                               mrope_section=None, memory=True, op=OP_INPLACE,
                               mrope_interleaved=False):
    """The in-place op on query (..., Hq, D) and key (..., Hk, D); returns the mrope section
    (a list) or None."""
    half = _checks.check_positions_op(query, key, positions, 0 if mrope_section is None else 1,
                                      cache=cache, op=op, memory=memory,
                                      mrope_interleaved=mrope_interleaved)
    section = None
    if mrope_section is not None:
        section = _checks.check_mrope_sections(mrope_section, half, op, "cos_sin_cache.size(1)/2")
    check_weights(q_weight, k_weight, query.shape[-1], query, "query", op)
    if memory:
        check_weights_disjoint(q_weight, k_weight, (("query", query), ("key", key)), op)
    check_eps(eps, op)
    return section


def check_qk_norm_rope_and_cache(query, key, value, positions, cache, q_weight, k_weight,
                                 key_cache, value_cache, slot_mapping, eps, mrope_section=None,
                                 mrope_interleaved=False, v_norm=False, kv_cache_dtype="auto",
                                 k_scale=None, v_scale=None, memory=True, in_place=True):
    """The serving prologue: the rotation and the caches as rope.apply_and_cache_ checks them
    (MRoPE allowed; value written with v_norm), then the norm's arguments. Returns (the caches'
    format or None, the mrope section or None). in_place False: rope.qk_norm_rope_and_cache,
    which only reads query, key and value."""
    op = OP_CACHE if in_place else OP_CACHE_OUT
    fmt, section = _checks.check_rope_and_cache(
        query, key, value, positions, cache, key_cache, value_cache, slot_mapping,
        kv_cache_dtype, k_scale, v_scale, memory, op=op, mrope_section=mrope_section,
        mrope_interleaved=mrope_interleaved, value_written=v_norm and in_place,
        in_place=in_place)
    check_weights(q_weight, k_weight, query.shape[-1], query, "query", op)
    if memory:
        check_weights_disjoint(q_weight, k_weight, (
            ("query", query if in_place else None), ("key", key if in_place else None),
            ("key_cache", key_cache), ("value_cache", value_cache),
            ("value", value if v_norm and in_place else None)), op)
    check_eps(eps, op)
    return fmt, section


def _count(v, op, name):
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 0:
        _fail(f"{op}: {name} must be an int >= 0, got {v!r}")
    return int(v)


def packed_views(qkv, num_heads_q, num_heads_k, num_heads_v, head_dim, op=OP_PACKED):
    """query (T, Hq, D) and key (T, Hk, D): views of the q and k columns of qkv
    (T, (Hq + Hk + Hv) * D), after checking that its width matches the head counts."""
    hq = _count(num_heads_q, op, "num_heads_q")
    hk = _count(num_heads_k, op, "num_heads_k")
    hv = _count(num_heads_v, op, "num_heads_v")
    d = _count(head_dim, op, "head_dim")
    if d == 0:
        _fail(f"{op}: head_dim must be >= 1, got 0")
    _checks._check_float(qkv, op, "qkv")
    if qkv.dim() != 2:
        _fail(f"{op}: qkv must have shape (num_tokens, (num_heads_q + num_heads_k + num_heads_v) * "
              f"head_dim), got {_shape(qkv)}")
    width = (hq + hk + hv) * d
    if qkv.shape[1] != width:
        shown = width if width < 2**63 else "2^63 or more"
        _fail(f"{op}: qkv.size(1) = {qkv.shape[1]} must be (num_heads_q + num_heads_k + "
              f"num_heads_v) * head_dim = ({hq} + {hk} + {hv}) * {d} = {shown}")
    if qkv.shape[1] > 1 and qkv.stride(1) != 1:
        _fail(f"{op}: qkv must have unit stride along its columns (qkv.stride(1) == 1), got "
              f"strides {list(qkv.stride())}")
    query = qkv[:, : hq * d].unflatten(1, (hq, d))
    key = qkv[:, hq * d : (hq + hk) * d].unflatten(1, (hk, d))
    return query, key


def check_qkv_norm_rope(qkv, num_heads_q, num_heads_k, num_heads_v, head_dim, q_weight, k_weight,
                        positions, cache, eps, mrope_section=None, memory=True,
                        mrope_interleaved=False):
    """The packed in-place op; returns (query view, key view, mrope section or None)."""
    query, key = packed_views(qkv, num_heads_q, num_heads_k, num_heads_v, head_dim)
    section = check_qk_norm_rope_inplace(query, key, q_weight, k_weight, positions, cache, eps,
                                         mrope_section, memory=memory, op=OP_PACKED,
                                         mrope_interleaved=mrope_interleaved)
    return query, key, section
