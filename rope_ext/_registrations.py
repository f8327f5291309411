"""Python-side registrations for the rope ops: the reference kernels that serve any device
without a native one, fake kernels for torch.compile and export, autograd, and the in-place
bookkeeping torch's own in-place ops do (version counters, leaf and inference-tensor errors).

The stable ABI has no autograd, so all of it lives here, for the native and the reference
kernels alike: both paths behave the same under autograd.
"""

import torch

from . import _checks, reference

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


def _ref_apply_(query, key, positions, cos_sin_cache, interleaved=False):
    reference.apply_rope_(query, key, positions, cos_sin_cache, interleaved=interleaved)


def _ref_mrope_(query, key, positions, cos_sin_cache, mrope_section, interleaved=False,
                mrope_interleaved=False):
    reference.apply_mrope_(query, key, positions, cos_sin_cache, mrope_section,
                           interleaved=interleaved, mrope_interleaved=mrope_interleaved)


def _ref_apply_positions(x, positions, cos, sin, interleaved=False, inverse=False,
                         mrope_section=None, mrope_interleaved=False):
    return reference.apply_positions(x, positions, cos, sin, interleaved=interleaved,
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


def _fake_apply_(query, key, positions, cos_sin_cache, interleaved=False):
    _checks.check_apply_inplace(query, key, positions, cos_sin_cache, memory=False)


def _fake_mrope_(query, key, positions, cos_sin_cache, mrope_section, interleaved=False,
                 mrope_interleaved=False):
    _checks.check_mrope(query, key, positions, cos_sin_cache, mrope_section, memory=False)


def _fake_apply_positions(x, positions, cos, sin, interleaved=False, inverse=False,
                          mrope_section=None, mrope_interleaved=False):
    _checks.check_apply_positions(x, positions, cos, sin, mrope_section)
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
    opposite = ops.apply if inverse else ops.apply_backward

    def backward(ctx, grad):
        x, cos, sin = ctx.saved_tensors
        grad_x = grad_cos = grad_sin = None
        if ctx.needs_input_grad[0]:
            grad_x = opposite(grad, cos, sin, ctx.interleaved)
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            grad_cos, grad_sin = reference.table_grads(x, grad, cos, sin, ctx.interleaved, inverse)
        return grad_x, grad_cos, grad_sin, None

    return backward


def _setup_positions(ctx, inputs, output):
    x, positions, cos, sin, interleaved, inverse, section, mi = _with_defaults(
        inputs, (None, None, None, None, False, False, None, False))
    ctx.args = (interleaved, inverse, section, mi)
    tables_need_grad = cos.requires_grad or sin.requires_grad
    ctx.save_for_backward(x if tables_need_grad else None, positions, cos, sin)


def _backward_positions(ctx, grad):
    x, positions, cos, sin = ctx.saved_tensors
    interleaved, inverse, section, mi = ctx.args
    grad_x = grad_cos = grad_sin = None
    if ctx.needs_input_grad[0]:
        grad_x = ops.apply_positions(grad, positions, cos, sin, interleaved, not inverse, section, mi)
    if ctx.needs_input_grad[2] or ctx.needs_input_grad[3]:
        grad_cos, grad_sin = reference.positions_table_grads(x, grad, positions, cos, sin,
                                                             interleaved, inverse, section, mi)
    return grad_x, None, grad_cos, grad_sin, None, None, None, None


# ---- the in-place ops: torch's in-place semantics, and autograd through them ----

class _RotateInPlace(torch.autograd.Function):
    """rope.apply_ / rope.mrope_ on one tensor under autograd: it is marked dirty, as torch's own
    in-place ops mark theirs (so a leaf that requires grad is refused, a view rebases its
    history, and a tensor saved for backward that this overwrites is detected). One tensor per
    Function: autograd lets a Function modify a view in place only when it is its one output.
    The gradient is the out-of-place op's: the inverse rotation of the incoming gradient."""

    @staticmethod
    def forward(ctx, t, positions, cos_sin_cache, interleaved, section, mi):
        with torch._C._AutoDispatchBelowAutograd():
            if section is None:
                ops.apply_(t, None, positions, cos_sin_cache, interleaved)
            else:
                ops.mrope_(t, None, positions, cos_sin_cache, section, interleaved, mi)
        ctx.mark_dirty(t)
        ctx.args = (interleaved, section, mi)
        if cos_sin_cache.requires_grad:  # the table gradient needs the output (saved below)
            ctx.save_for_backward(positions, cos_sin_cache, t)
        else:
            ctx.save_for_backward(positions, cos_sin_cache)
        return t

    @staticmethod
    def backward(ctx, grad):
        positions, cache, *output = ctx.saved_tensors
        interleaved, section, mi = ctx.args
        cos, sin = reference.cache_halves(cache)

        def unrotate(t):
            return ops.apply_positions(t, positions, cos, sin, interleaved, True, section, mi)

        grad_cache = None
        if ctx.needs_input_grad[2]:
            g_cos, g_sin = reference.positions_table_grads(unrotate(output[0]), grad, positions, cos,
                                                           sin, interleaved, False, section, mi)
            grad_cache = torch.cat((g_cos, g_sin), dim=1)
        return unrotate(grad), None, grad_cache, None, None, None


MUTABLE_OPS = ("apply.out", "apply_", "mrope_", "apply_and_cache_")
INFERENCE_TENSOR_UPDATE = (
    "Inplace update to inference tensor outside InferenceMode is not allowed.You can make a clone "
    "to get a normal tensor before doing inplace update.See https://github.com/pytorch/rfcs/pull/17 "
    "for more details."
)


def check_not_inference(*written):
    """torch's error for an in-place update of an inference tensor outside inference mode.
    (Not traced: torch.compile graphs hold no inference tensors outside inference mode.)"""
    if not torch.compiler.is_compiling() and not torch.is_inference_mode_enabled():
        for t in written:
            if t is not None and t.is_inference():
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


def _needs_grad(*tensors):
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


_AFTER_AD_INPLACE = torch._C._after_ADInplaceOrView_keyset


def _below_autograd(op, keyset, written, *args, **kwargs):
    """The ADInplaceOrView work (inference-tensor error, version bump), then the backend kernel.
    Also the no-grad path of a mutable op's Autograd kernel, which does that work itself and
    skips the ADInplaceOrView key: one Python call instead of two on the hot path."""
    check_not_inference(*written)
    torch._C._increment_version([t for t in written if t is not None])
    return op.redispatch(keyset & _AFTER_AD_INPLACE, *args, **kwargs)


def _rotate_each(query, key, positions, cos_sin_cache, interleaved, section, mi):
    """The in-place rotation under autograd: the whole call checked once (query and key
    together), then one Function per tensor."""
    # Memory checks only on plain tensors: a tensor subclass (DTensor) is checked where its op
    # runs on the local shards. Positions are range-checked by the op on query, before anything
    # is written.
    memory = type(query) is torch.Tensor
    if section is None:
        _checks.check_apply_inplace(query, key, positions, cos_sin_cache, memory=memory)
    else:
        _checks.check_mrope(query, key, positions, cos_sin_cache, section, memory=memory)
    # Positions that share memory with query or key would change under the rotation; the
    # backward reads them again.
    positions = _checks.positions_read_once(positions, (query, key))
    for t in (query, key):
        if t is not None:
            _RotateInPlace.apply(t, positions, cos_sin_cache, interleaved, section, mi)


def _autograd_apply_(keyset, query, key, positions, cos_sin_cache, interleaved=False):
    if not _needs_grad(query, key, cos_sin_cache):
        return _below_autograd(ops.apply_.default, keyset, (query, key), query, key, positions,
                               cos_sin_cache, interleaved)
    _rotate_each(query, key, positions, cos_sin_cache, interleaved, None, False)


def _autograd_mrope_(keyset, query, key, positions, cos_sin_cache, mrope_section,
                     interleaved=False, mrope_interleaved=False):
    if not _needs_grad(query, key, cos_sin_cache):
        return _below_autograd(ops.mrope_.default, keyset, (query, key), query, key, positions,
                               cos_sin_cache, mrope_section, interleaved, mrope_interleaved)
    _rotate_each(query, key, positions, cos_sin_cache, interleaved, list(mrope_section),
                 mrope_interleaved)


def _autograd_apply_out(keyset, x, cos, sin, interleaved=False, *, out):
    if _needs_grad(x, cos, sin, out):
        raise RuntimeError(f"rope.apply.out: {OUT_NOT_DIFFERENTIABLE}")
    return _below_autograd(ops.apply.out, keyset, (out,), x, cos, sin, interleaved, out=out)


def _autograd_apply_and_cache_(keyset, query, key, value, positions, cos_sin_cache, key_cache,
                               value_cache, slot_mapping, interleaved=False, kv_cache_dtype="auto",
                               k_scale=None, v_scale=None):
    if _needs_grad(query, key, value, cos_sin_cache, key_cache, value_cache):
        raise RuntimeError(
            "rope.apply_and_cache_: a serving op, not differentiable, but one of the arguments "
            "requires grad; call it under torch.no_grad() or torch.inference_mode()"
        )
    return _below_autograd(ops.apply_and_cache_.default, keyset, (query, key, key_cache, value_cache),
                           query, key, value, positions, cos_sin_cache, key_cache, value_cache,
                           slot_mapping, interleaved, kv_cache_dtype, k_scale, v_scale)


def register():
    lib = torch.library.Library("rope", "IMPL")
    _libraries.append(lib)
    for name, kernel in (
        ("apply", _ref_apply), ("apply.out", _ref_apply_out),
        ("apply_backward", _ref_apply_backward), ("apply_", _ref_apply_),
        ("mrope_", _ref_mrope_), ("apply_positions", _ref_apply_positions),
        ("apply_and_cache_", _ref_apply_and_cache_),
    ):
        # A backend key (CPU, CUDA) registered by a native library wins over this.
        lib.impl(name, kernel, "CompositeExplicitAutograd")
    for name, fake in (
        ("apply", _fake_apply), ("apply.out", _fake_apply_out),
        ("apply_backward", _fake_apply_backward), ("apply_", _fake_apply_),
        ("mrope_", _fake_mrope_), ("apply_positions", _fake_apply_positions),
        ("apply_and_cache_", _fake_apply_and_cache_),
    ):
        torch.library.register_fake(f"rope::{name}", fake, lib=lib)
    torch.library.register_autograd("rope::apply", _backward_rotation(False),
                                    setup_context=_setup_apply, lib=lib)
    torch.library.register_autograd("rope::apply_backward", _backward_rotation(True),
                                    setup_context=_setup_apply, lib=lib)
    torch.library.register_autograd("rope::apply_positions", _backward_positions,
                                    setup_context=_setup_positions, lib=lib)
    for name, kernel in (
        ("apply_", _autograd_apply_), ("mrope_", _autograd_mrope_),
        ("apply.out", _autograd_apply_out), ("apply_and_cache_", _autograd_apply_and_cache_),
    ):
        lib.impl(name, kernel, "Autograd", with_keyset=True)
    for name in MUTABLE_OPS:
        lib.impl(name, _ad_inplace_or_view_kernel(name), "ADInplaceOrView", with_keyset=True)
