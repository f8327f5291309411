"""rope_ext: rotary positional embedding (RoPE) as torch.ops.rope.* with native CPU (and CUDA)
kernels, autograd, torch.compile support, and a pure-PyTorch fallback."""

from . import _native, _registrations
from ._version import __version__

if not _native.load():
    _registrations.define_schemas_from_python()
_registrations.register_reference_kernels()
_registrations.register_python_side()

from . import jit, reference  # noqa: E402
from ._cpu_cache import cpu_cache_info, empty_cpu_cache  # noqa: E402
from ._cpu_isa import cpu_isa  # noqa: E402
from .cache import cos_sin_cache  # noqa: E402
from .modules import RotaryEmbedding  # noqa: E402
from .ops import apply_mrope_, apply_rope, apply_rope_, backend  # noqa: E402

__all__ = [
    "__version__",
    "apply_mrope_",
    "apply_rope",
    "apply_rope_",
    "backend",
    "cos_sin_cache",
    "cpu_cache_info",
    "cpu_isa",
    "empty_cpu_cache",
    "reference",
    "RotaryEmbedding",
]
