"""rope_ext: rotary positional embedding (RoPE) as torch.ops.rope.* with native CPU and CUDA
kernels, autograd, torch.compile support, and a pure-PyTorch fallback."""

import sys as _sys

from . import _call, _library, _registrations, envs, jit  # noqa: F401
from ._kv_shift import reference as _kv_shift_reference
from ._qk_norm import checks as _qk_norm_checks, reference as _qk_norm_reference
# The op families' registrations add their ops to _registrations.OPS on import
from ._qk_norm import registrations as _qk_norm_registrations
from ._quant import checks as _quant_checks, registrations as _quant_ops

# The families' modules by their names before they moved into folders (rope_ext._qk_norm_reference
# is rope_ext._qk_norm.reference), so that code importing those names keeps working.
for _name in ("_kv_shift_reference", "_qk_norm_checks", "_qk_norm_reference",
              "_qk_norm_registrations", "_quant_checks", "_quant_ops"):
    _sys.modules.setdefault(f"{__name__}.{_name}", globals()[_name])
del _name
from ._version import __version__

envs.read_runtime()  # (a bad value stops the import here, naming its variable)
if envs.JIT != "0":
    if envs.BACKEND == "reference":
        import warnings as _warnings

        _warnings.warn("rope_ext: ROPE_EXT_JIT wins over ROPE_EXT_BACKEND=reference: the JIT "
                       "library serves the rope ops natively", stacklevel=2)
    jit.load(verbose=envs.JIT == "verbose")
else:
    _library.load_compiled()
    _library.apply_cpu_settings()
_registrations.register()
_call.ops.resolve_all()  # each op's wrapper built now, outside any torch.compile trace
from . import distributed  # noqa: E402,F401  (DTensor sharding rules, registered when torch.distributed.tensor loads)

from . import reference  # noqa: E402
from ._library import cpu_isa, cpu_isas, set_cpu_isa  # noqa: E402
from .modules import RotaryEmbedding  # noqa: E402
from .ops import (  # noqa: E402
    apply_mrope_,
    apply_rope,
    apply_rope_,
    apply_rope_and_cache_,
    apply_rope_at,
    backend,
    varlen_positions,
)
from .qk_norm import (norm_rope, qk_norm_rope, qk_norm_rope_, qk_norm_rope_and_cache,  # noqa: E402
                      qk_norm_rope_and_cache_, qkv_norm_rope_)
from .tables import cos_sin_cache  # noqa: E402
from .kv_shift import shift_kv_cache_  # noqa: E402

__all__ = [
    "__version__",
    "apply_mrope_",
    "apply_rope",
    "apply_rope_",
    "apply_rope_and_cache_",
    "apply_rope_at",
    "backend",
    "cos_sin_cache",
    "cpu_isa",
    "cpu_isas",
    "qk_norm_rope",
    "norm_rope",
    "qk_norm_rope_",
    "qk_norm_rope_and_cache",
    "qk_norm_rope_and_cache_",
    "qkv_norm_rope_",
    "reference",
    "RotaryEmbedding",
    "set_cpu_isa",
    "shift_kv_cache_",
    "varlen_positions",
]
