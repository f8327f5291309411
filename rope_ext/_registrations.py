"""Python-side registrations for the rope ops: the reference kernels that serve any device
without a native one, fake kernels for torch.compile and export, autograd, and the in-place
bookkeeping torch's own in-place ops do (version counters, leaf and inference-tensor errors).

The stable ABI has no autograd, so all of it lives here, for the native and the reference
kernels alike: both paths behave the same under autograd.
"""

from typing import Callable, NamedTuple

import torch
from torch.autograd import forward_ad

from . import _checks, reference
from ._compiling import compiling
from ._kv_shift import reference as _kv_shift_reference

_libraries = []  # keeps the torch.library.Library objects (and so their registrations) alive
ops = torch.ops.rope

OUT_NOT_DIFFERENTIABLE = (
    "functions with out=... arguments don't support automatic differentiation, but one of the "
    "arguments requires grad."
)


# ---- reference kernels (CompositeExplicitAutograd: any device without a backend kernel) ----

def _ref_apply(x, cos, sin, interleaved=False):
    return reference.apply_rope(x, cos, sin, interleaved=interleaved)


def _ref_apply_out(x, cos, sin, interleaved=False, *, out):
    reference.apply_rope_out(x, cos, sin, interleaved=interleaved, out=out)


def _ref_apply_backward(grad, cos, sin, interleaved=False):
    return reference.apply_rope_backward(grad, cos, sin, interleaved=interleaved)


def _ref_apply_(query, key, positions, cos_sin_cache, interleaved=False, rope_dim_offset=0,
                inverse=False):
    reference.apply_rope_(query, key, positions, cos_sin_cache, interleaved=interleaved,
                          rope_dim_offset=rope_dim_offset, inverse=inverse)


def _ref_mrope_(query, key, positions, cos_sin_cache, mrope_section, interleaved=False,
                mrope_interleaved=False, rope_dim_offset=0, inverse=False):
    reference.apply_mrope_(query, key, positions, cos_sin_cache, mrope_section,
                           interleaved=interleaved, mrope_interleaved=mrope_interleaved,
                           rope_dim_offset=rope_dim_offset, inverse=inverse)


def _ref_apply_positions(x, positions, cos, sin, interleaved=False, inverse=False,
                         mrope_section=None, mrope_interleaved=False):
    return reference.apply_positions(x, positions, cos, sin, interleaved=interleaved,
                                     inverse=inverse, mrope_section=mrope_section,
                                     mrope_interleaved=mrope_interleaved)


def _ref_apply_positions_cache(x, positions, cos_sin_cache, interleaved=False, inverse=False,
                               mrope_section=None, mrope_interleaved=False):
    return reference.apply_positions_cache(x, positions, cos_sin_cache, interleaved=interleaved,
                                           inverse=inverse, mrope_section=mrope_section,
                                           mrope_interleaved=mrope_interleaved)


def _ref_apply_and_cache_(query, key, value, positions, cos_sin_cache, key_cache, value_cache,
                          slot_mapping, interleaved=False, kv_cache_dtype="auto", k_scale=None,
                          v_scale=None):
    reference.apply_and_cache_(query, key, value, positions, cos_sin_cache, key_cache,
                               value_cache, slot_mapping, interleaved=interleaved,
                               kv_cache_dtype=kv_cache_dtype, k_scale=k_scale, v_scale=v_scale)


# ---- fake kernels: shapes and the metadata-only checks ----

def _fake_apply(x, cos, sin, interleaved=False):
    _checks.check_apply(x, cos, sin)
    return x.new_empty(x.shape)


def _fake_apply_out(x, cos, sin, interleaved=False, *, out):
    _checks.check_apply_out(x, cos, sin, out, memory=False)


def _fake_apply_backward(grad, cos, sin, interleaved=False):
    _checks.check_apply(grad, cos, sin, op="rope.apply_backward", x_name="grad")
    return grad.new_empty(grad.shape)


def _fake_apply_(query, key, positions, cos_sin_cache, interleaved=False, rope_dim_offset=0,
                 inverse=False):
    _checks.check_apply_inplace(query, key, positions, cos_sin_cache, memory=False,
                                rope_dim_offset=rope_dim_offset)


def _fake_mrope_(query, key, positions, cos_sin_cache, mrope_section, interleaved=False,
                 mrope_interleaved=False, rope_dim_offset=0, inverse=False):
    _checks.check_mrope(query, key, positions, cos_sin_cache, mrope_section, memory=False,
                        rope_dim_offset=rope_dim_offset)


def _fake_apply_positions(x, positions, cos, sin, interleaved=False, inverse=False,
                          mrope_section=None, mrope_interleaved=False):
    _checks.check_apply_positions(x, positions, cos, sin, mrope_section,
                                  mrope_interleaved=mrope_interleaved)
    return x.new_empty(x.shape)


def _fake_apply_positions_cache(x, positions, cos_sin_cache, interleaved=False, inverse=False,
                                mrope_section=None, mrope_interleaved=False):
    _checks.check_apply_positions(x, positions, None, None, mrope_section, cache=cos_sin_cache,
                                  mrope_interleaved=mrope_interleaved)
    return x.new_empty(x.shape)


def _fake_apply_and_cache_(query, key, value, positions, cos_sin_cache, key_cache, value_cache,
                           slot_mapping, interleaved=False, kv_cache_dtype="auto", k_scale=None,
                           v_scale=None):
    _checks.check_apply_and_cache(query, key, value, positions, cos_sin_cache, key_cache,
                                  value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale,
                                  memory=False)


# ---- autograd of the functional ops ----

def _with_defaults(inputs, defaults):
    return tuple(inputs) + tuple(defaults[len(inputs):])


def _setup_apply(ctx, inputs, output):
    x, cos, sin, interleaved = _with_defaults(inputs, (None, None, None, False))
    ctx.interleaved = interleaved
    tables_need_grad = cos.requires_grad or sin.requires_grad
    ctx.save_for_backward(x if tables_need_grad else None, cos, sin)


def _backward_rotation(inverse):
    """The backward of rope.apply (inverse=False) or rope.apply_backward (True): the gradient
    w.r.t. the rotated tensor is the opposite rotation (docs/math.md "Backward")."""
    def backward(ctx, grad):
        opposite = ops.apply if inverse else ops.apply_backward
        x, cos, sin = ctx.saved_tensors
        grad_x = grad_cos = grad_sin = None
        if ctx.needs_input_grad[0]:
            grad_x = opposite(grad, cos, sin, ctx.interleaved)
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            grad_cos, grad_sin = reference.table_grads(x, grad, cos, sin, ctx.interleaved, inverse)
        return grad_x, grad_cos, grad_sin, None

    return backward


def _positions_autograd(tables):
    """(backward, setup_context) of rope.apply_positions: its tables as cos and sin (tables=2)
    or, the .cache overload, as one cos_sin_cache (tables=1)."""
    def setup(ctx, inputs, output):
        x, positions, *tabs = inputs[:2 + tables]
        ctx.args = _with_defaults(inputs[2 + tables:], (False, False, None, False))
        ctx.save_for_backward(x if any(t.requires_grad for t in tabs) else None, positions, *tabs)

    def backward(ctx, grad):
        x, positions, *tabs = ctx.saved_tensors
        interleaved, inverse, section, mi = ctx.args
        grad_x, grad_tabs = None, [None] * tables
        if ctx.needs_input_grad[0]:
            op = ops.apply_positions.default if tables == 2 else ops.apply_positions.cache
            grad_x = op(grad, positions, *tabs, interleaved, not inverse, section, mi)
        if any(ctx.needs_input_grad[2:2 + tables]):
            cos, sin = tabs if tables == 2 else reference.cache_halves(tabs[0])
            grad_tabs = reference.positions_table_grads(x, grad, positions, cos, sin, interleaved,
                                                        inverse, section, mi)
            if tables == 1:
                grad_tabs = [torch.cat(grad_tabs, dim=1)]
        return grad_x, None, *grad_tabs, None, None, None, None

    return backward, setup


# ---- the in-place ops: torch's in-place semantics, and autograd through them ----

class _RotateInPlace(torch.autograd.Function):
    """The autograd record of rope.apply_ / rope.mrope_ on one tensor. Its forward writes
    nothing: it marks the tensor dirty, as torch's own in-place ops mark theirs, so that torch
    refuses a leaf that requires grad, a view of one or a view from split/unbind (its own
    errors), and rebases a view's history, before any tensor of the call is written; the caller
    rotates the data once every tensor has passed. One tensor per Function: autograd lets a
    Function modify a view in place only when it is its one output. The gradient is the
    out-of-place op's: the opposite rotation of the incoming gradient (the forward rotation for
    inverse=True) on the rotary dims, the identity on the others."""

    @staticmethod
    def forward(ctx, t, t_input, positions, cos_sin_cache, interleaved, section, mi, offset,
                inverse):
        # t_input: a copy of t's values made before the call (only when the table requires grad:
        # its gradient needs them), differentiable, so double backward reaches t's history.
        ctx.mark_dirty(t)
        ctx.args = (interleaved, section, mi, offset, inverse)
        ctx.save_for_backward(positions, cos_sin_cache, t_input)
        return t

    @staticmethod
    def backward(ctx, grad):
        positions, cache, t_input = ctx.saved_tensors
        interleaved, section, mi, offset, inverse = ctx.args
        grad_cache = None
        if ctx.needs_input_grad[3]:
            g_cos, g_sin = reference.positions_table_grads(
                t_input[..., offset:], grad[..., offset:], positions,
                *reference.cache_halves(cache), interleaved, inverse, section, mi)
            grad_cache = torch.cat((g_cos, g_sin), dim=1)
        # dims from the offset on, the rotary ones first among them
        tail = ops.apply_positions.cache(grad[..., offset:], positions, cache, interleaved,
                                         not inverse, section, mi)
        grad_t = torch.cat((grad[..., :offset], tail), dim=-1) if offset else tail
        return grad_t, None, None, grad_cache, None, None, None, None, None


INFERENCE_TENSOR_UPDATE = (
    "Inplace update to inference tensor outside InferenceMode is not allowed.You can make a clone "
    "to get a normal tensor before doing inplace update.See https://github.com/pytorch/rfcs/pull/17 "
    "for more details."
)


def check_not_inference(*written):
    """torch's error for an in-place update of an inference tensor outside inference mode.
    (Not traced: torch.compile graphs hold no inference tensors outside inference mode.)"""
    if not compiling() and not torch.is_inference_mode_enabled():
        for t in written:  # (not a tensor: the op names it)
            if isinstance(t, torch.Tensor) and t.is_inference():
                raise RuntimeError(INFERENCE_TENSOR_UPDATE)


def _ad_inplace_or_view_kernel(name):
    """What torch's in-place ops do at the ADInplaceOrView key: bump the version counter of every
    mutated argument (so autograd detects a tensor it saved being overwritten), refusing
    inference tensors, then run the kernel below."""
    overload = name.split(".")[1] if "." in name else "default"
    op = getattr(getattr(ops, name.split(".")[0]), overload)
    positional, keyword = torch._library.utils.mutated_args_kwargs(op._schema)

    def kernel(keyset, *args, **kwargs):
        written = [args[i] for i in positional if i < len(args)] + [kwargs.get(k) for k in keyword]
        return _below_autograd(op, keyset, written, *args, **kwargs)

    return kernel


def serving_autograd(name, instead="it under torch.no_grad() or torch.inference_mode()",
                     kind="a serving op"):
    """The Autograd kernel of serving op `name` (not differentiable; `kind`: what the message
    calls it): torch's refusal when an argument requires grad (`instead`: what the message
    suggests), else the ADInplaceOrView work on what the schema marks written, then the kernel."""
    below = []  # built on first use: the op is registered after this module is imported

    def kernel(keyset, *args, **kwargs):
        if _needs_grad(*[a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]):
            raise RuntimeError(f"rope.{name}: {kind}, not differentiable, but one of the "
                               f"arguments requires grad; call {instead}")
        if not below:
            below.append(_ad_inplace_or_view_kernel(name))
        return below[0](keyset, *args, **kwargs)

    return kernel


def _needs_grad(*tensors):
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


_AFTER_AD_INPLACE = torch._C._after_ADInplaceOrView_keyset


def _below_autograd(op, keyset, written, *args, **kwargs):
    """The ADInplaceOrView work (inference-tensor error, version bump), then the backend kernel.
    Also the no-grad path of a mutable op's Autograd kernel, which does that work itself and
    skips the ADInplaceOrView key: one Python call instead of two on the hot path. As in the
    native call path (csrc/ops/router.cpp): inference tensors refused before the kernel, versions
    moved after it, so a refused call writes nothing and moves no version."""
    check_not_inference(*written)
    result = op.redispatch(keyset & _AFTER_AD_INPLACE, *args, **kwargs)
    torch._C._increment_version([t for t in written if t is not None])
    return result


_creation_meta = getattr(torch._C._autograd, "_get_creation_meta", None)
_META_SOURCE = torch.empty((), device="meta")


def inplace_rules_may_apply(t):
    """Whether one of torch's in-place rules under autograd could refuse t (from its autograd
    metadata alone: any tensor, a subclass's too)."""
    return (t.is_leaf and t.requires_grad) or (t._is_view() and (
        _creation_meta is None or _creation_meta(t) != torch._C._autograd.CreationMeta.DEFAULT
        or (t.requires_grad and t._base.is_leaf)))


def check_inplace_rules(t, table_grad):
    """torch's in-place rules for t under autograd (a leaf that requires grad, a view of one, a
    view from split/unbind, no_grad or inference mode), raised with torch's own errors, recording
    and writing nothing. Where a rule may apply, a copy_ into t from a meta tensor runs torch's
    check (check_inplace) and then fails in its kernel, before anything is written."""
    if not inplace_rules_may_apply(t):
        return  # the common case: none applies (and a try/except costs microseconds)
    source = _META_SOURCE.expand(t.shape)
    try:
        t.copy_(source.requires_grad_() if table_grad else source)
    except NotImplementedError:  # meta tensors hold no data: torch's rules passed
        pass


def check_savable(*saved):
    """torch's error for an inference tensor saved for backward, before anything is recorded."""
    for t in saved:
        if t.is_inference() and not torch.is_inference_mode_enabled():
            torch.zeros((), device=t.device, requires_grad=True) * t  # torch's own error


_PLAIN = (torch.Tensor, torch.nn.Parameter)  # tensors whose memory is their own data


def _rotate_each(op, keyset, query, key, positions, cos_sin_cache, interleaved, section, mi,
                 offset=0, inverse=False):
    """The in-place rotation under autograd: the whole call checked, torch's in-place rules
    included, one kernel call for both tensors, then each recorded. A refused call (by torch's
    rules on either tensor, or by the kernel's checks) records, writes and bumps nothing."""
    # Memory checks only on plain tensors with memory: a tensor subclass (DTensor) is checked
    # where its op runs on the local shards; meta tensors have none to compare (their data
    # pointers all null, every two would "overlap").
    memory = type(query) in _PLAIN and query.device.type != "meta"
    if section is None:
        _checks.check_apply_inplace(query, key, positions, cos_sin_cache, memory=memory,
                                    rope_dim_offset=offset)
    else:
        _checks.check_mrope(query, key, positions, cos_sin_cache, section, memory=memory,
                            rope_dim_offset=offset)
    check_not_inference(query, key)
    written = [t for t in (query, key) if t is not None]
    table_grad = cos_sin_cache.requires_grad
    # Positions that share memory with query or key would change under the rotation; the
    # backward reads them again. A tensor subclass (a traced FakeTensor, a DTensor) shows no
    # memory to compare: its positions are copied (a few integers per token).
    positions = (_checks.positions_read_once(positions, (query, key)) if memory else
                 positions.clone())
    inputs = [t.clone() if table_grad else None for t in written]  # the table's gradient reads them

    def record():  # mark_dirty: torch's rules checked, the history rebased, the version moved
        for t, t_input in zip(written, inputs):
            _RotateInPlace.apply(t, t_input, positions, cos_sin_cache, interleaved, section, mi,
                                 offset, inverse)

    # A tensor subclass whose rules may apply has them checked as it is recorded, before the
    # write (a refusal by the kernel's own checks, which run on its data, would then leave the
    # record); otherwise the record follows the write, as for plain tensors.
    record_first = not memory and any(inplace_rules_may_apply(t) for t in written)
    if memory:
        for t in written:
            check_inplace_rules(t, table_grad)
        check_savable(positions, cos_sin_cache)
    elif record_first:
        record()
    else:  # recorded after the write: what recording refuses is checked before it
        check_savable(positions, cos_sin_cache)
    with torch._C._AutoDispatchBelowAutograd():
        if table_grad and compiling():
            # Traced (torch.compile), the copies saved for the table's gradient and the in-place
            # kernel's write can be reordered by Inductor: the copies then read the rotated rows
            # (a wrong gradient, no error). As the out-of-place rotation of each copy, written
            # with copy_, the write follows the copies in the graph.
            rotated = [ops.apply_positions.cache(t_input[..., offset:], positions, cos_sin_cache,
                                                 interleaved, inverse, section, mi)
                       for t_input in inputs]
            for t, r in zip(written, rotated):
                t[..., offset:].copy_(r)
        else:
            args = (query, key, positions, cos_sin_cache)
            args += (interleaved,) if section is None else (section, interleaved, mi)
            op.redispatch(keyset & _AFTER_AD_INPLACE, *args, offset, inverse)
    if not record_first:
        record()


def _autograd_apply_(keyset, query, key, positions, cos_sin_cache, interleaved=False,
                     rope_dim_offset=0, inverse=False):
    if not _needs_grad(query, key, cos_sin_cache):
        return _below_autograd(ops.apply_.default, keyset, (query, key), query, key, positions,
                               cos_sin_cache, interleaved, rope_dim_offset, inverse)
    _rotate_each(ops.apply_.default, keyset, query, key, positions, cos_sin_cache, interleaved,
                 None, False, rope_dim_offset, inverse)


def _autograd_mrope_(keyset, query, key, positions, cos_sin_cache, mrope_section,
                     interleaved=False, mrope_interleaved=False, rope_dim_offset=0,
                     inverse=False):
    if not _needs_grad(query, key, cos_sin_cache):
        return _below_autograd(ops.mrope_.default, keyset, (query, key), query, key, positions,
                               cos_sin_cache, mrope_section, interleaved, mrope_interleaved,
                               rope_dim_offset, inverse)
    _rotate_each(ops.mrope_.default, keyset, query, key, positions, cos_sin_cache, interleaved,
                 list(mrope_section), mrope_interleaved, rope_dim_offset, inverse)


def _autograd_apply_out(keyset, x, cos, sin, interleaved=False, *, out):
    if _needs_grad(x, cos, sin, out):
        raise RuntimeError(f"rope.apply.out: {OUT_NOT_DIFFERENTIABLE}")
    return _below_autograd(ops.apply.out, keyset, (out,), x, cos, sin, interleaved, out=out)


# ---- rope.shift_kv_cache_ (K-shift): reference and fake kernels, autograd ----

def _ref_shift_kv_cache_(key_cache, slot_mapping, delta, cos_sin_cache, interleaved=False,
                         kv_cache_dtype="auto", k_scale=None):
    _kv_shift_reference.shift_kv_cache_(key_cache, slot_mapping, delta, cos_sin_cache,
                                        interleaved=interleaved, kv_cache_dtype=kv_cache_dtype,
                                        k_scale=k_scale)


def _fake_shift_kv_cache_(key_cache, slot_mapping, delta, cos_sin_cache, interleaved=False,
                          kv_cache_dtype="auto", k_scale=None):
    _kv_shift_reference.check_shift_kv_cache(key_cache, slot_mapping, delta, cos_sin_cache,
                                             kv_cache_dtype, k_scale, memory=False)


# ---- every op's facts, in one table ----

class Op(NamedTuple):
    """What Python registers for one op: its reference kernel (any device without a native one),
    its fake kernel (shapes and metadata-only checks) and its autograd: for a functional op
    (backward, setup_context) as torch.library.register_autograd takes them; for a mutable op
    the kernel that serves the Autograd key (with_keyset), which does the in-place bookkeeping."""
    reference: Callable
    fake: Callable
    functional_autograd: tuple = None
    mutable_autograd: Callable = None
    differentiable: bool = True  # False: serving ops and out=, which refuse gradients


OPS = {
    "apply": Op(_ref_apply, _fake_apply, (_backward_rotation(False), _setup_apply)),
    "apply.out": Op(_ref_apply_out, _fake_apply_out, mutable_autograd=_autograd_apply_out,
                    differentiable=False),
    "apply_backward": Op(_ref_apply_backward, _fake_apply_backward,
                         (_backward_rotation(True), _setup_apply)),
    "apply_": Op(_ref_apply_, _fake_apply_, mutable_autograd=_autograd_apply_),
    "mrope_": Op(_ref_mrope_, _fake_mrope_, mutable_autograd=_autograd_mrope_),
    "apply_positions": Op(_ref_apply_positions, _fake_apply_positions, _positions_autograd(2)),
    "apply_positions.cache": Op(_ref_apply_positions_cache, _fake_apply_positions_cache,
                                _positions_autograd(1)),
    "apply_and_cache_": Op(_ref_apply_and_cache_, _fake_apply_and_cache_,
                           mutable_autograd=serving_autograd("apply_and_cache_"),
                           differentiable=False),
    "shift_kv_cache_": Op(_ref_shift_kv_cache_, _fake_shift_kv_cache_,
                          mutable_autograd=serving_autograd("shift_kv_cache_"),
                          differentiable=False),
}
# Op families in folders of their own add their entries on import (rope_ext/__init__.py imports
# them before register()): _qk_norm/registrations.py (fused QK-RMSNorm + RoPE),
# _quant/registrations.py (RoPE + FP8 quantization).


def routed(name):
    """True when the native library serves op `name`'s Autograd and ADInplaceOrView keys in C++
    (ROUTED in schemas.def; csrc/ops/routes.h): its `_grad_` twin then carries the Python
    autograd path."""
    base, _, overload = name.partition(".")
    try:  # no twin: the Python-defined schemas (no native library), or a library without routes
        torch._C._dispatch_find_schema_or_throw(f"rope::_grad_{base}", overload)
    except RuntimeError:
        return False
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"rope::_grad_{name}",
                                                          "CompositeExplicitAutograd")


def _snapshot_kernel(name, autograd_kernel):
    """The PythonTLSSnapshot kernel of a routed op: calls that involve a tensor subclass or a
    Python dispatch mode (DTensor, FakeTensor, torch.compile's tracing) carry this key, above
    Autograd; they take the Python path, which redispatches to the subclass's handler under the
    op's own name. Plain tensors never reach it."""
    inplace_or_view = _ad_inplace_or_view_kernel(name)
    autograd_active = torch._C.DispatchKey.AutogradFunctionality

    def kernel(keyset, *args, **kwargs):
        if keyset.has(autograd_active):
            return autograd_kernel(keyset, *args, **kwargs)
        return inplace_or_view(keyset, *args, **kwargs)

    return kernel


def _functional_autograd_kernel(name, backward, setup_context):
    """The kernel torch.library.register_autograd would register at op `name`'s Autograd key,
    made to serve its `_grad_` twin (and its PythonTLSSnapshot key): it redispatches to `name`."""
    from torch._library import autograd as library_autograd

    base, _, overload = name.partition(".")
    op = getattr(getattr(ops, base), overload or "default")
    return library_autograd.make_autograd_impl(op, library_autograd.Info(backward, setup_context))


def has_tangent(args, kwargs):
    """Whether a forward-mode AD tangent rides on a tensor argument (torch.func.jvp and
    torch.autograd.forward_ad both make dual tensors at forward_ad's current level)."""
    if forward_ad._current_level < 0:  # no dual level entered: the common case, one read
        return False
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor) and forward_ad.unpack_dual(a).tangent is not None:
            return True
    return False


def _forward_ad_aware(name, autograd_kernel):
    """Op `name`'s autograd kernel, unless a tangent rides on an argument: then the op's
    reference kernel runs on the dual tensors, made of torch ops that carry tangents (the kernel
    alone would drop them and leave a zero tangent: forward AD has no formula for a custom op).
    Its results are the reference's; gradients in reverse mode are unchanged."""
    reference_kernel, differentiable = OPS[name].reference, OPS[name].differentiable

    def kernel(keyset, *args, **kwargs):
        if has_tangent(args, kwargs):
            if not differentiable:
                raise RuntimeError(f"rope.{name}: not differentiable, but a forward-mode AD "
                                   "tangent (torch.func.jvp, torch.autograd.forward_ad) rides "
                                   "on one of its arguments")
            return reference_kernel(*args, **kwargs)
        return autograd_kernel(keyset, *args, **kwargs)

    return kernel


def tangent_aware(name, *args, **kwargs):
    """rope.<name>(*args, **kwargs) called through _call.ops while a forward-AD dual level is
    open. With grad mode on the op's autograd kernel sees the tangents (_forward_ad_aware); with
    it off the native call path goes straight to the kernel, which would drop them, so the
    reference (or the refusal of a non-differentiable op) serves here."""
    if not torch.is_grad_enabled():
        if has_tangent(args, kwargs):
            return _forward_ad_aware(name, None)(None, *args, **kwargs)
        if torch._C._functorch.peek_interpreter_stack() is not None:
            # Inside torch.func.jvp the tensors are functorch's wrappers, which have no storage
            # and reach the Autograd key as they are: with grad mode off the native call path
            # would hand them to the kernel. The reference's torch ops unwrap them.
            return OPS[name].reference(*args, **kwargs)
    packet, _, overload = name.partition(".")
    return getattr(getattr(ops, packet), overload or "default")(*args, **kwargs)


def _autograd_kernel(name, op):
    """The kernel that serves op `name`'s Autograd key (or its `_grad_` twin's)."""
    if op.functional_autograd is not None:
        return _forward_ad_aware(name, _functional_autograd_kernel(name, *op.functional_autograd))
    return _forward_ad_aware(name, op.mutable_autograd)


def _given(name, kernel, with_keyset=False, dense=True):
    """`kernel` of op `name` after the check that its tensor arguments were given as the kernels
    need them: a `Tensor` one not None (None would reach the kernels, which would fail on it
    later, after writing, in place, or with no word of which argument it was), and (dense)
    each one dense (strided): a sparse, mkldnn or jagged tensor would fail inside torch's ops
    with no word of which argument it was. Mirrors csrc/ops/routes.h check_tensors_given. The
    Autograd kernel checks the layouts too: a jagged tensor (a Python subclass) would otherwise
    reach its own dispatch table, which has no rope op, not the kernels' check; the
    ADInplaceOrView kernel, below it, leaves them (dense=False: it costs 0.1 us a tensor)."""
    base, _, overload = name.partition(".")
    schema = getattr(getattr(ops, base), overload or "default")._schema
    tensors = [(i, a.name, a.kwarg_only, isinstance(a.type, torch._C.OptionalType))
               for i, a in enumerate(schema.arguments)
               if a.type.isSubtypeOf(torch._C.OptionalType.ofTensor())]
    if not dense:
        tensors = [t for t in tensors if not t[3]]

    def check(args, kwargs):
        for i, arg, kwarg_only, optional in tensors:
            t = kwargs.get(arg) if kwarg_only or i >= len(args) else args[i]
            if t is None:
                if optional:
                    continue
                raise RuntimeError(f"rope.{name}: {arg} must be a tensor, got None")
            if dense and t.layout != torch.strided:
                raise RuntimeError(f"rope.{name}: {arg} must be a dense (strided) tensor, got "
                                   f"layout {t.layout}")

    if with_keyset:
        def given(keyset, *args, **kwargs):
            check(args, kwargs)
            return kernel(keyset, *args, **kwargs)
    else:
        def given(*args, **kwargs):
            check(args, kwargs)
            return kernel(*args, **kwargs)
    return given


def _reference_kernel(name, reference):
    """The reference as op `name`'s kernel: the tensors checked given, and its own torch ops run
    below ADInplaceOrView, so that what it writes (copy_) is not bumped a second time: one version
    per call, the ADInplaceOrView work's (Python's or the C++ router's), as with the native
    kernel and torch's own in-place ops. Autocast is off inside, as it is in a native kernel: the
    op's result has x's dtype either way (a float16 x under bfloat16 autocast would otherwise
    meet autocast's promotion rules in the reference's own torch ops, which refuse the mix)."""
    given = _given(name, reference)

    def kernel(*args, **kwargs):
        with torch._C._AutoDispatchBelowADInplaceOrView(), torch._C._DisableAutocast():
            return given(*args, **kwargs)

    return kernel


def register():
    lib = torch.library.Library("rope", "IMPL")
    _libraries.append(lib)
    for name, op in OPS.items():
        # A backend key (CPU, CUDA) registered by a native library wins over this.
        lib.impl(name, _reference_kernel(name, op.reference), "CompositeExplicitAutograd")
        torch.library.register_fake(f"rope::{name}", _given(name, op.fake), lib=lib)
        if routed(name):
            continue  # the library's C++ kernels serve Autograd and ADInplaceOrView: see below
        lib.impl(name, _given(name, _autograd_kernel(name, op), True), "Autograd",
                 with_keyset=True)
        if op.functional_autograd is None:
            lib.impl(name, _given(name, _ad_inplace_or_view_kernel(name), True, dense=False),
                     "ADInplaceOrView", with_keyset=True)
    register_routes()


def _run_under_selective_checkpointing():
    """Selective activation checkpointing replays an op its policy saves from what the op
    returned: an op that writes activations (q and k in place, `out=`) and returns nothing would
    be replayed as nothing, and the recomputation would read unwritten tensors. Such ops (and
    their twins) join torch's SAC_IGNORED_OPS, which run each time whatever the policy says
    (torch.compile's SAC recomputes them then). An op that writes a cache is left to the policy:
    replaying a saved cache write as nothing is what it asks for."""
    from torch.utils import checkpoint

    for name in OPS:
        base, _, overload = name.partition(".")
        for twin in (base, f"_impl_{base}", f"_grad_{base}"):  # (the twins: routed ops only)
            packet = getattr(ops, twin, None)
            if packet is None:
                continue
            op = getattr(packet, overload or "default")
            written = [a.name for a in op._schema.arguments
                       if a.alias_info is not None and a.alias_info.is_write]
            if written and not op._schema.returns and not any("cache" in w for w in written):
                checkpoint.SAC_IGNORED_OPS.add(op)


def register_routes():
    """For the ops the native library routes (ROUTED in schemas.def): its C++ kernels serve their
    Autograd and ADInplaceOrView keys (registered after the Python ones above, they win), so
    the Python autograd path moves to each op's `_grad_` twin, and calls with a tensor subclass
    or a Python mode take it at PythonTLSSnapshot. Called again by rope_ext.jit.load() when the
    library comes after these registrations."""
    lib = torch.library.Library("rope", "IMPL")
    _libraries.append(lib)
    for name, op in OPS.items():
        if name in _routes_registered or not routed(name):
            continue
        # The kernel-only twin serves every device but the CPU, meta included (no Python key:
        # a plain meta tensor reaches the C++ router too).
        torch.library.register_fake(f"rope::_impl_{name}", _given(name, op.fake), lib=lib)
        # The C++ router has checked the tensors given before the `_grad_` twin; the calls that
        # take the PythonTLSSnapshot key never reached it.
        autograd = _autograd_kernel(name, op)
        lib.impl(f"_grad_{name}", autograd, "Autograd", with_keyset=True)
        if op.functional_autograd is None:
            autograd = _snapshot_kernel(name, autograd)
        lib.impl(name, _given(name, autograd, True), "PythonTLSSnapshot", with_keyset=True)
        _routes_registered.add(name)
    _run_under_selective_checkpointing()  # (the native library's twins too)


_routes_registered = set()
