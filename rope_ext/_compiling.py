"""Whether the code running now is being traced into a graph (torch.compile, torch.export) in
this thread: the eager data checks (positions read on the host, torch's inference-tensor rule)
are then left to the graph.

torch.compiler.is_compiling() alone answers for the process: torch sets its flag for the whole of
a compilation, so while one thread compiles, the eager calls of every other thread would skip
their checks (an inference tensor written outside inference mode, a ValueError becoming a
device assert). Code that dynamo traces reads True from is_dynamo_compiling() (folded into the
graph); code that runs eagerly during a compilation (the ops' Python kernels under AOTAutograd,
a model's code under a non-strict torch.export) runs in the compiling thread, inside a tracing
context or a dispatch mode (fake tensors), both of which are per thread.
"""

import torch

_is_compiling = torch.compiler.is_compiling
_is_dynamo_compiling = torch.compiler.is_dynamo_compiling
_tracing_context = torch._guards.TracingContext.try_get
_dispatch_modes = torch._C._len_torch_dispatch_stack


def compiling():
    """torch.compiler.is_compiling(), for this thread."""
    return _is_compiling() and (_is_dynamo_compiling() or _tracing_context() is not None
                                or _dispatch_modes() > 0)


def tracing():
    """Whether tensors made now belong to a trace, not to eager code: torch.compile or export,
    a dispatch mode (FakeTensorMode, make_fx), or torch.jit.trace. A cache must neither keep
    them nor hand a kept real tensor to the trace."""
    return compiling() or _dispatch_modes() > 0 or torch.jit.is_tracing()
