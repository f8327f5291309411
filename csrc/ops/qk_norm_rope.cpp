// Schemas of the fused QK-RMSNorm + RoPE ops (docs/qk_norm.md), a fragment of the rope library
// (csrc/ops/rope.cpp defines the others). Kernels: cpu/qk_norm_rope_cpu.cpp and
// cuda/qk_norm_rope.cu; fake kernels and autograd: rope_ext/_qk_norm_registrations.py.
#include <torch/csrc/stable/library.h>

STABLE_TORCH_LIBRARY_FRAGMENT(rope, m) {
  // Per-head RMSNorm (float32; x * rsqrt(mean(x^2) + eps) * w, or * (1 + w) with unit_offset)
  // then RoPE of query (..., Hq, D) and key (..., Hk, D), as new contiguous tensors; cos/sin
  // (..., rotary_dim/2) broadcast to each as rope.apply takes them. Differentiable.
  m.def(
      "qk_norm_rope(Tensor query, Tensor key, Tensor q_weight, Tensor k_weight, Tensor cos, "
      "Tensor sin, float eps, bool unit_offset=False, bool interleaved=False) -> (Tensor, Tensor)");
  // The same in place, by the rows of cos_sin_cache (max_position, rotary_dim) at positions
  // (query.shape[:-2], or (3,) + that with mrope_section, as rope.mrope_).
  m.def(
      "qk_norm_rope_(Tensor(a!) query, Tensor(b!) key, Tensor q_weight, Tensor k_weight, "
      "Tensor positions, Tensor cos_sin_cache, float eps, bool unit_offset=False, "
      "bool interleaved=False, int[]? mrope_section=None, bool mrope_interleaved=False) -> ()");
  // In place on packed qkv (num_tokens, (Hq + Hk + Hv) * head_dim) (vLLM's layout): the q and
  // k heads as rope.qk_norm_rope_, the v heads untouched.
  m.def(
      "qkv_norm_rope_(Tensor(a!) qkv, int num_heads_q, int num_heads_k, int num_heads_v, "
      "int head_dim, Tensor q_weight, Tensor k_weight, Tensor positions, Tensor cos_sin_cache, "
      "float eps, bool unit_offset=False, bool interleaved=False, int[]? mrope_section=None, "
      "bool mrope_interleaved=False) -> ()");
}
