"""The op schemas, as csrc/ops/rope.cpp defines them.

Used only to define the ops from Python when no native library is loaded, so that
`torch.ops.rope.*` exists either way; a test checks that both definitions agree. Keys are
"name" or "name.overload", as the dispatcher spells them after "rope::".
"""

SCHEMAS = {
    "apply": "apply(Tensor x, Tensor cos, Tensor sin, bool interleaved=False) -> Tensor",
    "apply.out": (
        "apply.out(Tensor x, Tensor cos, Tensor sin, bool interleaved=False, *, Tensor(a!) out) "
        "-> ()"
    ),
    "apply_backward": (
        "apply_backward(Tensor grad, Tensor cos, Tensor sin, bool interleaved=False) -> Tensor"
    ),
    "apply_": (
        "apply_(Tensor(a!) query, Tensor(b!)? key, Tensor positions, Tensor cos_sin_cache, "
        "bool interleaved=False) -> ()"
    ),
    "mrope_": (
        "mrope_(Tensor(a!) query, Tensor(b!)? key, Tensor positions, Tensor cos_sin_cache, "
        "int[] mrope_section, bool interleaved=False, bool mrope_interleaved=False) -> ()"
    ),
    "apply_positions": (
        "apply_positions(Tensor x, Tensor positions, Tensor cos, Tensor sin, "
        "bool interleaved=False, bool inverse=False, int[]? mrope_section=None, "
        "bool mrope_interleaved=False) -> Tensor"
    ),
    "apply_and_cache_": (
        "apply_and_cache_(Tensor(a!) query, Tensor(b!) key, Tensor value, Tensor positions, "
        "Tensor cos_sin_cache, Tensor(c!) key_cache, Tensor(d!) value_cache, Tensor slot_mapping, "
        "bool interleaved=False, str kv_cache_dtype=\"auto\", Tensor? k_scale=None, "
        "Tensor? v_scale=None) -> ()"
    ),
    "cpu_isa": "cpu_isa() -> int",
    "set_cpu_isa": "set_cpu_isa(int isa) -> int",
    "set_cpu_stream_threshold": "set_cpu_stream_threshold(int bytes) -> int",
}

# ---- RoPE + FP8 quantization (FlashInfer's rope_quantize_fp8 family): rope_ext/_quant_schemas.py ----
from ._quant_schemas import SCHEMAS as _QUANT_SCHEMAS  # noqa: E402

SCHEMAS.update(_QUANT_SCHEMAS)
