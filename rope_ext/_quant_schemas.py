"""The schemas of the RoPE + FP8 quantization ops, as csrc/ops/rope_quant.cpp defines them
(merged into _schemas.SCHEMAS)."""

SCHEMAS = {
    "quantize_fp8": (
        "quantize_fp8(Tensor q_rope, Tensor k_rope, Tensor q_nope, Tensor k_nope, "
        "Tensor cos_sin_cache, Tensor pos_ids, Tensor(a!) q_rope_out, Tensor(b!) k_rope_out, "
        "Tensor(c!) q_nope_out, Tensor(d!) k_nope_out, float quant_scale_q=1., "
        "float quant_scale_kv=1., bool interleaved=False) -> ()"
    ),
    "quantize_fp8_append_paged_kv_cache": (
        "quantize_fp8_append_paged_kv_cache(Tensor q_rope, Tensor k_rope, Tensor q_nope, "
        "Tensor k_nope, Tensor? v, Tensor cos_sin_cache, Tensor pos_ids, Tensor(a!) q_rope_out, "
        "Tensor(b!) q_nope_out, Tensor(c!) k_cache, Tensor(d!) v_cache, Tensor kv_indices, "
        "Tensor kv_indptr, Tensor batch_indices, Tensor positions, int page_size, "
        "str kv_layout=\"NHD\", float quant_scale_q=1., float quant_scale_kv=1., "
        "bool interleaved=False) -> ()"
    ),
}
