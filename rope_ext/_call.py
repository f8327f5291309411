"""How the public functions call the ops: `ops.<name>(...)` is torch.ops.rope.<name>(...), but
in grad mode with no argument requiring grad, the call runs with grad mode off.

Why: with grad mode on, a call reaches the op's Autograd kernel, which is Python (torch.library's
autograd path; the stable ABI has no requires_grad getter, so the C++ router cannot look), only
to find that nothing requires grad and redispatch: about 8 us, several times a decode-sized
kernel. With grad mode off the C++ router sends the call straight to the kernel, torch's in-place
bookkeeping (version counters, inference-tensor errors) included. Results, errors and what is
recorded are the same: an op none of whose inputs requires grad records nothing either way.

Under torch.compile the op is traced as it is (the graph decides grad mode itself). While a
forward-AD dual level is open (torch.func.jvp, torch.autograd.forward_ad), calls go to
_registrations.tangent_aware, which keeps the tangents the kernel alone would drop: every caller
of `ops` (the public functions, the drop-ins, the model patches) gets that from here.
"""

import torch
from torch.autograd import forward_ad

from ._compiling import compiling
from ._registrations import OPS, tangent_aware

_grad_enabled = torch.is_grad_enabled
_set_grad_enabled = torch._C._set_grad_enabled
_any_requires_grad = torch._C._any_requires_grad  # tensors, and tensors in lists, at C speed
_transforming = torch._C._functorch.peek_interpreter_stack  # None outside torch.func transforms


def _keyword_defaults(op):
    """{name: default} of an OpOverload's arguments that have one."""
    return {a.name: a.default_value for a in op._schema.arguments if a.has_default_value()}


def without_autograd_if_unneeded(op):
    """op (an OpOverload or packet) as a function that switches grad mode off around calls whose
    arguments need no gradient, and that leaves out keyword arguments given as their schema
    default: torch matches each keyword given against the schema by name, about 0.2 us apiece
    (the serving prologue's public call passes eight), and fills in defaults for less."""
    defaults = _keyword_defaults(getattr(op, "default", op))
    missing = object()
    overload = getattr(op, "_overloadname", "default")
    name = op.__name__.split(".")[0] + ("" if overload == "default" else "." + overload)
    differentiable = name in OPS  # has an autograd story (not the library's settings ops)

    def call(*args, **kwargs):
        if kwargs:  # keep the keywords that are not their default (False is not 0 here)
            given = {}
            for k, v in kwargs.items():
                d = defaults.get(k, missing)
                if not (v is d or (type(v) is type(d) and v == d)):
                    given[k] = v
            kwargs = given
        if forward_ad._current_level >= 0 and differentiable:  # a dual level is open
            return tangent_aware(name, *args, **kwargs)
        # (vmap's and functionalize's wrappers report no requires_grad of the tensors they wrap:
        # inside a torch.func transform grad mode stays as it is.)
        if _grad_enabled() and not compiling() and not _any_requires_grad(*args, **kwargs) \
                and _transforming() is None:
            _set_grad_enabled(False)
            try:
                return op(*args, **kwargs)
            finally:
                _set_grad_enabled(True)
        try:
            return op(*args, **kwargs)
        except RuntimeError as e:
            _reraise_stop_recomputation(e)
            raise

    call.__name__ = call.__qualname__ = f"rope.{op.__name__}"
    call.op = op
    return call


def _reraise_stop_recomputation(error):
    """Activation checkpointing (use_reentrant=False, early stop) ends a recomputation by raising
    its _StopRecomputationError from the hook that saves the last tensor it needs, to be caught
    by torch.utils.checkpoint. Saved by a routed op's autograd path, which the C++ router calls
    through the stable ABI, it comes back as a RuntimeError carrying its name: raised again as
    itself here, so checkpointing sees the exception it raised."""
    if str(error).startswith("_StopRecomputationError"):
        from torch.utils.checkpoint import _StopRecomputationError

        raise _StopRecomputationError() from None


class _Ops:
    """torch.ops.rope with each op's default overload wrapped by without_autograd_if_unneeded;
    other overloads as attributes of the wrapper (`ops.apply.out`). Every op of schemas.def is
    wrapped once the ops are registered (resolve_all, from the package's import): building one
    on first use would look up torch.ops inside a torch.compile trace, which dynamo refuses."""

    def __getattr__(self, name):
        packet = getattr(torch.ops.rope, name)
        fn = without_autograd_if_unneeded(packet.default)
        for overload in packet.overloads():
            if overload != "default":
                setattr(fn, overload, without_autograd_if_unneeded(getattr(packet, overload)))
        setattr(self, name, fn)
        return fn

    def resolve_all(self):
        from ._schemas import SCHEMAS

        for name in {key.split(".")[0] for key in SCHEMAS}:
            getattr(self, name)


ops = _Ops()
