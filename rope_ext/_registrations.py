"""Python-side registrations for the rope ops: fake (meta) kernels for torch.compile and
export, autograd, and the reference kernels that serve any device without a native one."""

import torch

from . import _checks, _cpu_cache, _cpu_isa, reference
from ._schemas import SCHEMAS

_libraries = []  # keeps the torch.library.Library objects (and so their registrations) alive


def define_schemas_from_python():
    """Defines the ops when the native library (which defines them in C++) is not loaded."""
    lib = torch.library.Library("rope", "DEF")
    for schema in SCHEMAS.values():
        lib.define(schema)
    lib.impl("cpu_isa", _cpu_isa.reference_cpu_isa, "CompositeExplicitAutograd")
    lib.impl("cpu_output_cache_info", _cpu_cache.reference_info, "CompositeExplicitAutograd")
    lib.impl("cpu_output_cache_empty", _cpu_cache.reference_empty, "CompositeExplicitAutograd")
    _libraries.append(lib)


def _reference_apply(x, cos, sin, interleaved=False):
    return reference.apply_rope(x, cos, sin, interleaved=interleaved)


def _reference_apply_out(x, cos, sin, interleaved=False, *, out):
    reference.apply_rope_out(x, cos, sin, interleaved=interleaved, out=out)


def _reference_apply_backward(grad, cos, sin, interleaved=False):
    return reference.apply_rope_backward(grad, cos, sin, interleaved=interleaved)


def _reference_apply_(query, key, positions, cos_sin_cache, interleaved=False):
    reference.apply_rope_(query, key, positions, cos_sin_cache, interleaved=interleaved)


def _reference_mrope_(query, key, positions, cos_sin_cache, mrope_section, interleaved=False):
    reference.apply_mrope_(query, key, positions, cos_sin_cache, mrope_section, interleaved=interleaved)


def register_reference_kernels():
    """The reference serves every device that has no kernel of its own (a backend key such as
    CPU or CUDA registered by a native library wins over CompositeExplicitAutograd)."""
    lib = torch.library.Library("rope", "IMPL")
    lib.impl("apply", _reference_apply, "CompositeExplicitAutograd")
    lib.impl("apply.out", _reference_apply_out, "CompositeExplicitAutograd")
    lib.impl("apply_backward", _reference_apply_backward, "CompositeExplicitAutograd")
    lib.impl("apply_", _reference_apply_, "CompositeExplicitAutograd")
    lib.impl("mrope_", _reference_mrope_, "CompositeExplicitAutograd")
    _libraries.append(lib)


def _fake_apply(x, cos, sin, interleaved=False):
    _checks.check_apply(x, cos, sin)
    return x.new_empty(x.shape)


def _fake_apply_out(x, cos, sin, interleaved=False, *, out):
    _checks.check_apply_out(x, cos, sin, out, check_overlap=False)  # fake tensors hold no memory


def _fake_apply_backward(grad, cos, sin, interleaved=False):
    _checks.check_apply(grad, cos, sin, op="rope.apply_backward", x_name="grad")
    return grad.new_empty(grad.shape)


def _fake_apply_(query, key, positions, cos_sin_cache, interleaved=False):
    _checks.check_apply_inplace(query, key, positions, cos_sin_cache)


def _fake_mrope_(query, key, positions, cos_sin_cache, mrope_section, interleaved=False):
    _checks.check_mrope(query, key, positions, cos_sin_cache, mrope_section)


def _interleaved(inputs):
    return bool(inputs[3]) if len(inputs) > 3 else False


def _setup_apply(ctx, inputs, output):
    x, cos, sin = inputs[:3]
    ctx.interleaved = _interleaved(inputs)
    tables_need_grad = cos.requires_grad or sin.requires_grad
    ctx.save_for_backward(x if tables_need_grad else None, cos, sin)


def _backward_apply(ctx, grad):
    x, cos, sin = ctx.saved_tensors
    grad_x = grad_cos = grad_sin = None
    if ctx.needs_input_grad[0]:
        grad_x = torch.ops.rope.apply_backward(grad, cos, sin, ctx.interleaved)
    if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
        grad_cos, grad_sin = reference.table_grads(x, grad, cos, sin, ctx.interleaved)
    return grad_x, grad_cos, grad_sin, None


def _backward_apply_backward(ctx, grad):
    # apply_backward is the inverse rotation: its gradient w.r.t. grad is the forward rotation.
    g_in, cos, sin = ctx.saved_tensors
    grad_g = grad_cos = grad_sin = None
    if ctx.needs_input_grad[0]:
        grad_g = torch.ops.rope.apply(grad, cos, sin, ctx.interleaved)
    if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
        grad_cos, grad_sin = reference.table_grads(g_in, grad, cos, sin, ctx.interleaved, inverse=True)
    return grad_g, grad_cos, grad_sin, None


def register_python_side():
    torch.library.register_fake("rope::apply", _fake_apply)
    torch.library.register_fake("rope::apply.out", _fake_apply_out)
    torch.library.register_fake("rope::apply_backward", _fake_apply_backward)
    torch.library.register_fake("rope::apply_", _fake_apply_)
    torch.library.register_fake("rope::mrope_", _fake_mrope_)
    torch.library.register_autograd("rope::apply", _backward_apply, setup_context=_setup_apply)
    torch.library.register_autograd(
        "rope::apply_backward", _backward_apply_backward, setup_context=_setup_apply
    )
