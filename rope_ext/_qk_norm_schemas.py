"""The schemas of the fused QK-RMSNorm + RoPE ops, as csrc/ops/qk_norm_rope.cpp defines them
(rope_ext._schemas includes them)."""

QK_NORM_SCHEMAS = {
    "qk_norm_rope": (
        "qk_norm_rope(Tensor query, Tensor key, Tensor q_weight, Tensor k_weight, Tensor cos, "
        "Tensor sin, float eps, bool unit_offset=False, bool interleaved=False) -> (Tensor, Tensor)"
    ),
    "qk_norm_rope_": (
        "qk_norm_rope_(Tensor(a!) query, Tensor(b!) key, Tensor q_weight, Tensor k_weight, "
        "Tensor positions, Tensor cos_sin_cache, float eps, bool unit_offset=False, "
        "bool interleaved=False, int[]? mrope_section=None, bool mrope_interleaved=False) -> ()"
    ),
    "qkv_norm_rope_": (
        "qkv_norm_rope_(Tensor(a!) qkv, int num_heads_q, int num_heads_k, int num_heads_v, "
        "int head_dim, Tensor q_weight, Tensor k_weight, Tensor positions, Tensor cos_sin_cache, "
        "float eps, bool unit_offset=False, bool interleaved=False, int[]? mrope_section=None, "
        "bool mrope_interleaved=False) -> ()"
    ),
}
