"""The op schemas, as csrc/ops/rope.cpp defines them.

Used only to define the ops from Python when the native library is not loaded, so that
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
        "int[] mrope_section, bool interleaved=False) -> ()"
    ),
    "cpu_isa": "cpu_isa() -> int",
    "cpu_output_cache_info": "cpu_output_cache_info() -> int[]",
    "cpu_output_cache_empty": "cpu_output_cache_empty() -> ()",
}
