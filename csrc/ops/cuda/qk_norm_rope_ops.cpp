// CUDA kernels of the fused QK-RMSNorm + RoPE ops, registered for the CUDA key. Host logic:
// qk_norm_rope_host.h (shared with the simulator); per-thread code: qk_norm_rope_thread.h, whose
// kernels qk_norm_rope.cu defines with their launchers (cuda_kernels.h).
#include <torch/csrc/stable/library.h>

#include "../routes.h"
#include "cuda_runner.h"
#include "qk_norm_rope_host.h"

namespace rope::gpu {
namespace {

// The device made current, torch's current stream there, a launch check after the kernel.
struct NormLaunch : CudaStreamLaunch {
  using CudaStreamLaunch::CudaStreamLaunch;

  template <typename x_t, typename tab_t, bool kI>
  void operator()(const LaunchPlan& p, const NormRopeArgs<x_t, tab_t>& a, Bool<kI>) const {
    check(launch_norm_rope<x_t, tab_t, kI>(p, a, stream()));
  }

  void operator()(const LaunchPlan& p, const SlotSetArgs& a) const {
    check(launch_slot_set(p, a, stream()));
  }
};

std::tuple<Tensor, Tensor> qk_norm_rope_cuda(Tensor query, Tensor key, Tensor q_weight,
                                             Tensor k_weight, Tensor cos, Tensor sin, double eps,
                                             bool unit_offset, bool interleaved) {
  return qk_norm_rope_host(query, key, q_weight, k_weight, cos, sin, eps, unit_offset,
                           interleaved, NormLaunch(query, kQkNormOp));
}

std::tuple<Tensor, Tensor> norm_rope_cuda(Tensor query, Tensor key,
                                          std::optional<Tensor> q_weight,
                                          std::optional<Tensor> k_weight,
                                          std::optional<Tensor> q_bias,
                                          std::optional<Tensor> k_bias, Tensor cos, Tensor sin,
                                          double eps, std::string norm, bool interleaved) {
  return norm_rope_host(query, key, q_weight, k_weight, q_bias, k_bias, cos, sin, eps, norm,
                        interleaved, NormLaunch(query, kNormFormsOp));
}

void qk_norm_rope_inplace_cuda(Tensor query, Tensor key, Tensor q_weight, Tensor k_weight,
                               Tensor positions, Tensor cos_sin_cache, double eps,
                               bool unit_offset, bool interleaved,
                               std::optional<std::vector<int64_t>> mrope_section,
                               bool mrope_interleaved) {
  qk_norm_rope_inplace_host(query, key, &query, &key, q_weight, k_weight, positions,
                            cos_sin_cache, eps, unit_offset, interleaved,
                            mrope_section ? &*mrope_section : nullptr, mrope_interleaved,
                            kQkNormInplaceOp, NormLaunch(query, kQkNormInplaceOp));
}

void qkv_norm_rope_inplace_cuda(Tensor qkv, int64_t num_heads_q, int64_t num_heads_k,
                                int64_t num_heads_v, int64_t head_dim, Tensor q_weight,
                                Tensor k_weight, Tensor positions, Tensor cos_sin_cache,
                                double eps, bool unit_offset, bool interleaved,
                                std::optional<std::vector<int64_t>> mrope_section,
                                bool mrope_interleaved) {
  const auto [q, k] = qkv_views(qkv, num_heads_q, num_heads_k, num_heads_v, head_dim);
  qk_norm_rope_inplace_host(q, k, &qkv, nullptr, q_weight, k_weight, positions, cos_sin_cache,
                            eps, unit_offset, interleaved,
                            mrope_section ? &*mrope_section : nullptr, mrope_interleaved,
                            kQkvNormOp, NormLaunch(qkv, kQkvNormOp));
}

void qk_norm_rope_and_cache_cuda(Tensor query, Tensor key, Tensor value, Tensor positions,
                                 Tensor cos_sin_cache, Tensor q_weight, Tensor k_weight,
                                 Tensor key_cache, Tensor value_cache, Tensor slot_mapping,
                                 double eps, bool unit_offset, bool interleaved,
                                 std::optional<std::vector<int64_t>> mrope_section,
                                 bool mrope_interleaved, bool v_norm, std::string kv_cache_dtype,
                                 std::optional<Tensor> k_scale, std::optional<Tensor> v_scale) {
  qk_norm_rope_and_cache_host(query, key, value, positions, cos_sin_cache, q_weight, k_weight,
                              key_cache, value_cache, slot_mapping, eps, unit_offset, interleaved,
                              mrope_section ? &*mrope_section : nullptr, mrope_interleaved,
                              v_norm, kv_cache_dtype, k_scale, v_scale,
                              NormLaunch(query, kQkNormCacheOp));
}

}  // namespace
}  // namespace rope::gpu

STABLE_TORCH_LIBRARY_IMPL(rope, CUDA, m) {
  rope::impl_routed(m, rope::kQkNormRope, TORCH_BOX(&rope::gpu::qk_norm_rope_cuda));
  m.impl("norm_rope", TORCH_BOX(&rope::gpu::norm_rope_cuda));
  rope::impl_routed(m, rope::kQkNormRopeInplace, TORCH_BOX(&rope::gpu::qk_norm_rope_inplace_cuda));
  rope::impl_routed(m, rope::kQkvNormRopeInplace, TORCH_BOX(&rope::gpu::qkv_norm_rope_inplace_cuda));
  rope::impl_routed(m, rope::kQkNormRopeAndCache,
                    TORCH_BOX(&rope::gpu::qk_norm_rope_and_cache_cuda));
}
