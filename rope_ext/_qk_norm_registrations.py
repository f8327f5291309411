"""Python-side registrations of the fused QK-RMSNorm + RoPE ops (rope.qk_norm_rope,
rope.qk_norm_rope_, rope.qkv_norm_rope_): the reference kernels for devices without a native
one, fake kernels, the autograd of the out-of-place op, and for the in-place (serving) ops the
in-place bookkeeping of torch's own in-place ops plus an error under autograd. Their entries
join rope_ext._registrations.OPS on import, which registers them like every op.
"""

import torch

from . import _qk_norm_checks as checks
from . import _qk_norm_reference as ref
from . import _registrations as base

ops = torch.ops.rope
NOT_DIFFERENTIABLE = (
    "{op}: a serving op, not differentiable, but one of the arguments requires grad; call "
    "rope_ext.qk_norm.qk_norm_rope (out of place, differentiable), or this under torch.no_grad()"
)


# ---- fake kernels ----

def _fake_qk_norm_rope(query, key, q_weight, k_weight, cos, sin, eps, unit_offset=False,
                       interleaved=False):
    checks.check_qk_norm_rope(query, key, q_weight, k_weight, cos, sin, eps)
    return query.new_empty(query.shape), key.new_empty(key.shape)


def _fake_norm_rope(query, key, q_weight, k_weight, q_bias, k_bias, cos, sin, eps, norm="rms",
                    interleaved=False):
    checks.check_norm_rope(query, key, q_weight, k_weight, q_bias, k_bias, cos, sin, eps, norm)
    return query.new_empty(query.shape), key.new_empty(key.shape)


def _fake_qk_norm_rope_(query, key, q_weight, k_weight, positions, cos_sin_cache, eps,
                        unit_offset=False, interleaved=False, mrope_section=None,
                        mrope_interleaved=False):
    checks.check_qk_norm_rope_inplace(query, key, q_weight, k_weight, positions, cos_sin_cache,
                                      eps, mrope_section, memory=False)


def _fake_qkv_norm_rope_(qkv, num_heads_q, num_heads_k, num_heads_v, head_dim, q_weight,
                         k_weight, positions, cos_sin_cache, eps, unit_offset=False,
                         interleaved=False, mrope_section=None, mrope_interleaved=False):
    checks.check_qkv_norm_rope(qkv, num_heads_q, num_heads_k, num_heads_v, head_dim, q_weight,
                               k_weight, positions, cos_sin_cache, eps, mrope_section,
                               memory=False)


def _fake_qk_norm_rope_and_cache_(query, key, value, positions, cos_sin_cache, q_weight, k_weight,
                                  key_cache, value_cache, slot_mapping, eps=1e-6, *,
                                  unit_offset=False, interleaved=False, mrope_section=None,
                                  mrope_interleaved=False, v_norm=False, kv_cache_dtype="auto",
                                  k_scale=None, v_scale=None):
    checks.check_qk_norm_rope_and_cache(query, key, value, positions, cos_sin_cache, q_weight,
                                        k_weight, key_cache, value_cache, slot_mapping, eps,
                                        mrope_section, mrope_interleaved, v_norm, kv_cache_dtype,
                                        k_scale, v_scale, memory=False)


# ---- autograd of rope.qk_norm_rope ----

def _setup(ctx, inputs, output):
    query, key, q_weight, k_weight, cos, sin, eps, unit_offset, interleaved = base._with_defaults(
        inputs, (None,) * 7 + (False, False))
    ctx.args = (eps, unit_offset, interleaved)
    ctx.save_for_backward(query, key, q_weight, k_weight, cos, sin)


def _backward(ctx, grad_q, grad_k):
    query, key, q_weight, k_weight, cos, sin = ctx.saved_tensors
    eps, unit_offset, interleaved = ctx.args
    need = ctx.needs_input_grad
    tables = need[4] or need[5]
    grads = [None] * 9
    for i, (x, w, g) in enumerate(((query, q_weight, grad_q), (key, k_weight, grad_k))):
        if g is None or not (need[i] or need[2 + i] or tables):
            continue
        gx, gw, gc, gs = ref.norm_rope_backward(x, w, g, cos, sin, eps, unit_offset, interleaved,
                                                need[i], need[2 + i], tables)
        grads[i], grads[2 + i] = gx, gw
        if tables:
            grads[4] = gc if grads[4] is None else grads[4] + gc
            grads[5] = gs if grads[5] is None else grads[5] + gs
    return tuple(grads)


# ---- autograd of rope.norm_rope ----

def _setup_forms(ctx, inputs, output):
    (query, key, q_weight, k_weight, q_bias, k_bias, cos, sin, eps, norm,
     interleaved) = base._with_defaults(inputs, (None,) * 9 + ("rms", False))
    ctx.args = (eps, norm, interleaved)
    ctx.save_for_backward(query, key, q_weight, k_weight, q_bias, k_bias, cos, sin)


def _backward_forms(ctx, grad_q, grad_k):
    query, key, q_weight, k_weight, q_bias, k_bias, cos, sin = ctx.saved_tensors
    eps, norm, interleaved = ctx.args
    need = ctx.needs_input_grad
    tables = need[6] or need[7]
    grads = [None] * 11
    for i, (x, w, b, g) in enumerate(((query, q_weight, q_bias, grad_q),
                                      (key, k_weight, k_bias, grad_k))):
        wanted = (need[i], need[2 + i], need[4 + i], tables)
        if g is None or not any(wanted):
            continue
        gx, gw, gb, gc, gs = ref.norm_forms_rope_backward(x, w, b, g, cos, sin, eps, norm,
                                                          interleaved, wanted)
        grads[i], grads[2 + i], grads[4 + i] = gx, gw, gb
        if tables:
            grads[6] = gc if grads[6] is None else grads[6] + gc
            grads[7] = gs if grads[7] is None else grads[7] + gs
    return tuple(grads)


# ---- the in-place ops under autograd ----

def _autograd_qk_norm_rope_(keyset, query, key, q_weight, k_weight, positions, cos_sin_cache,
                            eps, unit_offset=False, interleaved=False, mrope_section=None,
                            mrope_interleaved=False):
    if base._needs_grad(query, key, q_weight, k_weight, cos_sin_cache):
        raise RuntimeError(NOT_DIFFERENTIABLE.format(op=checks.OP_INPLACE))
    return base._below_autograd(ops.qk_norm_rope_.default, keyset, (query, key), query, key,
                                q_weight, k_weight, positions, cos_sin_cache, eps, unit_offset,
                                interleaved, mrope_section, mrope_interleaved)


def _autograd_qkv_norm_rope_(keyset, qkv, num_heads_q, num_heads_k, num_heads_v, head_dim,
                             q_weight, k_weight, positions, cos_sin_cache, eps, unit_offset=False,
                             interleaved=False, mrope_section=None, mrope_interleaved=False):
    if base._needs_grad(qkv, q_weight, k_weight, cos_sin_cache):
        raise RuntimeError(NOT_DIFFERENTIABLE.format(op=checks.OP_PACKED))
    return base._below_autograd(ops.qkv_norm_rope_.default, keyset, (qkv,), qkv, num_heads_q,
                                num_heads_k, num_heads_v, head_dim, q_weight, k_weight, positions,
                                cos_sin_cache, eps, unit_offset, interleaved, mrope_section,
                                mrope_interleaved)


def _ref_qk_norm_rope_and_cache_(*args, **kwargs):
    ref.qk_norm_rope_and_cache_(*args, **kwargs)  # the op returns nothing


def _autograd_qk_norm_rope_and_cache_(keyset, query, key, value, positions, cos_sin_cache,
                                      q_weight, k_weight, key_cache, value_cache, slot_mapping,
                                      eps=1e-6, **kwargs):
    if base._needs_grad(query, key, value, q_weight, k_weight, cos_sin_cache, key_cache,
                        value_cache):
        raise RuntimeError(NOT_DIFFERENTIABLE.format(op=checks.OP_CACHE))
    return base._below_autograd(ops.qk_norm_rope_and_cache_.default, keyset,
                                (query, key, value, key_cache, value_cache), query, key, value,
                                positions, cos_sin_cache, q_weight, k_weight, key_cache,
                                value_cache, slot_mapping, eps, **kwargs)


def ops_table(op_type):
    """These ops' entries of rope_ext._registrations.OPS (op_type: its Op)."""
    return {
        "qk_norm_rope": op_type(ref.qk_norm_rope, _fake_qk_norm_rope, (_backward, _setup)),
        "norm_rope": op_type(ref.norm_rope, _fake_norm_rope, (_backward_forms, _setup_forms)),
        "qk_norm_rope_": op_type(ref.qk_norm_rope_, _fake_qk_norm_rope_,
                                 mutable_autograd=_autograd_qk_norm_rope_, differentiable=False),
        "qkv_norm_rope_": op_type(ref.qkv_norm_rope_, _fake_qkv_norm_rope_,
                                  mutable_autograd=_autograd_qkv_norm_rope_, differentiable=False),
        "qk_norm_rope_and_cache_": op_type(_ref_qk_norm_rope_and_cache_,
                                           _fake_qk_norm_rope_and_cache_,
                                           mutable_autograd=_autograd_qk_norm_rope_and_cache_,
                                           differentiable=False),
    }


base.OPS.update(ops_table(base.Op))
