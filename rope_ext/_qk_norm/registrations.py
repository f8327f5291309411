"""Python-side registrations of the fused norm + RoPE ops (rope.qk_norm_rope, rope.norm_rope,
rope.qk_norm_rope_, rope.qkv_norm_rope_, rope.qk_norm_rope_and_cache[_]): the reference kernels
for devices without a native one, fake kernels, the autograd of the out-of-place ops, and for
the in-place (serving) ops rope_ext._registrations.serving_autograd (torch's in-place
bookkeeping, a refusal under autograd). Their entries join rope_ext._registrations.OPS on
import, which registers them like every op.
"""

import sys

import torch

from . import checks
from . import reference as ref
from .. import _registrations as base

# What a refusal under autograd suggests instead.
INSTEAD = ("rope_ext.qk_norm.qk_norm_rope (out of place, differentiable), or this under "
           "torch.no_grad()")


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
                                      eps, mrope_section, memory=False,
                                      mrope_interleaved=mrope_interleaved)


def _fake_qkv_norm_rope_(qkv, num_heads_q, num_heads_k, num_heads_v, head_dim, q_weight,
                         k_weight, positions, cos_sin_cache, eps, unit_offset=False,
                         interleaved=False, mrope_section=None, mrope_interleaved=False):
    checks.check_qkv_norm_rope(qkv, num_heads_q, num_heads_k, num_heads_v, head_dim, q_weight,
                               k_weight, positions, cos_sin_cache, eps, mrope_section,
                               memory=False, mrope_interleaved=mrope_interleaved)


def _fake_prologue(in_place):
    """The fake kernel of rope.qk_norm_rope_and_cache_ (in_place) or rope.qk_norm_rope_and_cache
    (new query, key and value)."""
    def fake(query, key, value, positions, cos_sin_cache, q_weight, k_weight, key_cache,
             value_cache, slot_mapping, eps=1e-6, *, unit_offset=False, interleaved=False,
             mrope_section=None, mrope_interleaved=False, v_norm=False, kv_cache_dtype="auto",
             k_scale=None, v_scale=None):
        checks.check_qk_norm_rope_and_cache(
            query, key, value, positions, cos_sin_cache, q_weight, k_weight, key_cache,
            value_cache, slot_mapping, eps, mrope_section, mrope_interleaved, v_norm,
            kv_cache_dtype, k_scale, v_scale, memory=False, in_place=in_place)
        if not in_place:
            return tuple(t.new_empty(t.shape) for t in (query, key, value))
        return None

    return fake


def _fake_qk_norm_rope_backward(grad, x, weight, cos, sin, eps, unit_offset=False,
                                interleaved=False):
    checks.check_qk_norm_rope_backward(grad, x, weight, cos, sin, eps)
    return x.new_empty(x.shape), x.new_empty(x.shape[-1:], dtype=ref._acc_dtype(x.dtype))


# ---- autograd of rope.qk_norm_rope ----

def _setup(ctx, inputs, output):
    query, key, q_weight, k_weight, cos, sin, eps, unit_offset, interleaved = base._with_defaults(
        inputs, (None,) * 7 + (False, False))
    ctx.args = (eps, unit_offset, interleaved)
    ctx.save_for_backward(query, key, q_weight, k_weight, cos, sin)
    # An output no loss reached gets None, not zeros autograd would make as plain tensors (a
    # DTensor call's tables would then meet them in rope.apply_backward): its pair is skipped.
    ctx.set_materialize_grads(False)


def _native_cpu_backward():
    return torch._C._dispatch_has_kernel_for_dispatch_key("rope::qk_norm_rope_backward", "CPU")


def _one_pass(x, *tensors):
    """Whether rope.qk_norm_rope's backward (and rope.norm_rope's, for a per-head RMSNorm without
    biases) takes rope.qk_norm_rope_backward: where its native kernel serves x (the CPU: one pass
    per tensor; elsewhere the op would run the torch ops below as one opaque call, which
    torch.compile could no longer fuse), not when the backward is itself recorded (double
    backward: the op is not differentiable). DTensors take it through its sharding rule
    (rope_ext/distributed.py), unless registering the rules failed."""
    if torch.is_grad_enabled() or x.device.type != "cpu" or not _native_cpu_backward():
        return False
    dtensor = sys.modules.get("torch.distributed.tensor")
    if dtensor is None or not any(isinstance(t, dtensor.DTensor) for t in (x, *tensors)):
        return True
    from .. import distributed
    return distributed.registered()


def _backward(ctx, grad_q, grad_k):
    query, key, q_weight, k_weight, cos, sin = ctx.saved_tensors
    eps, unit_offset, interleaved = ctx.args
    need = ctx.needs_input_grad
    grads = None if need[4] or need[5] else _one_pass_grads(
        query, key, q_weight, k_weight, grad_q, grad_k, need, cos, sin, eps, unit_offset,
        interleaved)
    if grads is not None:
        return (*grads, None, None, None, None, None)
    (gq, gk), gc, gs = _norm_rope_grads(
        ((query, q_weight, None, grad_q, need[0], need[2], False),
         (key, k_weight, None, grad_k, need[1], need[3], False)),
        cos, sin, eps, "rms", interleaved, unit_offset, need[4] or need[5])
    return gq[0], gk[0], gq[1], gk[1], gc, gs, None, None, None


def _one_pass_grads(query, key, q_weight, k_weight, grad_q, grad_k, need, cos, sin, eps,
                    unit_offset, interleaved):
    """The gradients (query, key, q_weight, k_weight) of a per-head RMSNorm (weighted; None:
    weights of 1) and rotation by rope.qk_norm_rope_backward, or None where it does not serve
    (_one_pass). need: the autograd's needs_input_grad, those four first."""
    if not _one_pass(query, key, grad_q, grad_k, cos):
        return None
    grads = []
    for x, w, g, need_x, need_w in ((query, q_weight, grad_q, need[0], need[2]),
                                    (key, k_weight, grad_k, need[1], need[3])):
        if g is None or not (need_x or need_w):
            grads.append((None, None))
            continue
        ones = w is None
        if ones:
            w = x.new_ones(x.shape[-1:])
        # Below autograd (grad mode is off here, so its kernel would only pass the call on: a
        # Python call of tens of microseconds); fake and functional tensors still see the op.
        with torch._C._AutoDispatchBelowADInplaceOrView():
            gx, gw = torch.ops.rope.qk_norm_rope_backward(g, x, w, cos, sin, eps, unit_offset,
                                                          interleaved)
        grads.append((gx if need_x else None, gw.to(w.dtype) if need_w and not ones else None))
    (gq, gw_q), (gk, gw_k) = grads
    return gq, gk, gw_q, gw_k


def _norm_rope_grads(pairs, cos, sin, eps, norm, interleaved, unit_offset, tables):
    """The gradients of query's and key's norm and rotation. pairs: per tensor (x, weight, bias,
    grad, need x, need weight, need bias); returns ([(gx, gw, gb)] per tensor, the tables'
    gradients summed over both: (g_cos, g_sin), None unless `tables`)."""
    out, g_cos, g_sin = [], None, None
    for x, w, b, g, need_x, need_w, need_b in pairs:
        if g is None or not (need_x or need_w or need_b or tables):
            out.append((None, None, None))
            continue
        gx, gw, gb, gc, gs = ref.norm_forms_rope_backward(
            x, w, b, g, cos, sin, eps, norm, interleaved, (need_x, need_w, need_b, tables),
            unit_offset)
        out.append((gx, gw, gb))
        if tables:
            g_cos = gc if g_cos is None else g_cos + gc
            g_sin = gs if g_sin is None else g_sin + gs
    return out, g_cos, g_sin


# ---- autograd of rope.norm_rope ----

def _setup_forms(ctx, inputs, output):
    (query, key, q_weight, k_weight, q_bias, k_bias, cos, sin, eps, norm,
     interleaved) = base._with_defaults(inputs, (None,) * 9 + ("rms", False))
    ctx.args = (eps, norm, interleaved)
    ctx.save_for_backward(query, key, q_weight, k_weight, q_bias, k_bias, cos, sin)
    ctx.set_materialize_grads(False)  # (as _setup's)


def _backward_forms(ctx, grad_q, grad_k):
    query, key, q_weight, k_weight, q_bias, k_bias, cos, sin = ctx.saved_tensors
    eps, norm, interleaved = ctx.args
    need = ctx.needs_input_grad
    per_head_rms = norm == "rms" and q_bias is None and k_bias is None
    grads = None if not per_head_rms or need[6] or need[7] else _one_pass_grads(
        query, key, q_weight, k_weight, grad_q, grad_k, need, cos, sin, eps, False, interleaved)
    if grads is not None:
        return (*grads, None, None, None, None, None, None, None)
    (gq, gk), gc, gs = _norm_rope_grads(
        ((query, q_weight, q_bias, grad_q, need[0], need[2], need[4]),
         (key, k_weight, k_bias, grad_k, need[1], need[3], need[5])),
        cos, sin, eps, norm, interleaved, False, need[6] or need[7])
    return gq[0], gk[0], gq[1], gk[1], gq[2], gk[2], gc, gs, None, None, None


# ---- the in-place ops under autograd ----

def _ref_qk_norm_rope_and_cache_(*args, **kwargs):
    ref.qk_norm_rope_and_cache_(*args, **kwargs)  # the op returns nothing


def ops_table(op_type):
    """These ops' entries of rope_ext._registrations.OPS (op_type: its Op)."""

    def serving(name, reference, fake):
        return op_type(reference, fake, mutable_autograd=base.serving_autograd(name, INSTEAD),
                       differentiable=False)

    return {
        "qk_norm_rope": op_type(ref.qk_norm_rope, _fake_qk_norm_rope, (_backward, _setup)),
        "norm_rope": op_type(ref.norm_rope, _fake_norm_rope, (_backward_forms, _setup_forms)),
        "qk_norm_rope_backward": op_type(
            ref.qk_norm_rope_backward, _fake_qk_norm_rope_backward,
            mutable_autograd=base.serving_autograd(
                "qk_norm_rope_backward", "rope.qk_norm_rope's backward with create_graph=True "
                "(a double backward: its torch ops), or this under torch.no_grad()",
                kind="the backward of rope.qk_norm_rope"),
            differentiable=False),
        "qk_norm_rope_": serving("qk_norm_rope_", ref.qk_norm_rope_, _fake_qk_norm_rope_),
        "qkv_norm_rope_": serving("qkv_norm_rope_", ref.qkv_norm_rope_, _fake_qkv_norm_rope_),
        "qk_norm_rope_and_cache_": serving("qk_norm_rope_and_cache_",
                                           _ref_qk_norm_rope_and_cache_, _fake_prologue(True)),
        "qk_norm_rope_and_cache": serving("qk_norm_rope_and_cache", ref.qk_norm_rope_and_cache,
                                          _fake_prologue(False)),
    }


base.OPS.update(ops_table(base.Op))
