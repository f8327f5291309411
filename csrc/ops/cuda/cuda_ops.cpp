// The CUDA kernels of every op, registered for the CUDA key. Each op family's host logic
// (checks, table dtypes, launch plan, dispatch) is in its *_host.h (rope_cuda_host.h,
// qk_norm/cuda/host.h, quant/cuda/host.h, kv_shift/cuda/host.h), shared with the CPU simulator that
// tests the kernels without a GPU; this file adds what only a GPU needs: one runner
// (cuda_runner.h: the device guard, the current stream, the launch check) whose overloads launch
// every kernel of the family through its launcher (cuda_kernels.h, defined with the kernels in
// the .cu files).
#include <torch/csrc/stable/library.h>

#include "../routes.h"
#include "cuda_runner.h"
#include "../qk_norm/cuda/host.h"
#include "rope_cuda_host.h"
#include "../quant/cuda/host.h"
#include "../kv_shift/cuda/host.h"

namespace rope::gpu {
namespace {

// The one place every op's launches go through (see CudaStreamLaunch): an overload per kind of
// kernel arguments.
struct CudaLaunch : CudaStreamLaunch {
  using CudaStreamLaunch::CudaStreamLaunch;
  // Data checks the host does not make (a sync) run as kernels before the writes.
  static constexpr bool kDeviceDataChecks = true;

  template <typename x_t, typename tab_t, bool kI>
  void operator()(const LaunchPlan& p, const RotateArgs<x_t, tab_t>& a, Bool<kI>) const {
    check(launch_rotate<x_t, tab_t, kI>(p, a, stream()));
  }

  template <typename x_t, typename tab_t>
  void operator()(const LaunchPlan& p, const CacheArgs<x_t, tab_t>& a) const {
    check(launch_cache<x_t, tab_t>(p, a, stream()));
  }

  void operator()(const LaunchPlan& p, const SlotSetArgs& a) const {
    check(launch_slot_set(p, a, stream()));
  }

  template <typename x_t, typename tab_t, bool kI>
  void operator()(const LaunchPlan& p, const NormRopeArgs<x_t, tab_t>& a, Bool<kI>) const {
    check(launch_norm_rope<x_t, tab_t, kI>(p, a, stream()));
  }

  template <typename x_t>
  void operator()(const LaunchPlan& p, const QuantArgs<x_t>& a) const {
    check(launch_quant<x_t>(p, a, stream()));
  }

  void operator()(const LaunchPlan& p, const PagedSlotSetArgs& a) const {
    check(launch_paged_slot_set(p, a, stream()));
  }

  template <typename x_t, typename acc_t>
  void operator()(const LaunchPlan& p, const ShiftArgs<x_t, acc_t>& a) const {
    check(launch_shift<x_t, acc_t>(p, a, stream()));
  }
};

// ---- rotations (rope_cuda_host.h) ----

template <bool kInverse>
Tensor apply_cuda(Tensor x, Tensor cos, Tensor sin, bool interleaved) {
  return apply_host(x, cos, sin, interleaved, kInverse, std::nullopt,
                    CudaLaunch(x, kInverse ? "rope.apply_backward" : "rope.apply"));
}

void apply_out_cuda(Tensor x, Tensor cos, Tensor sin, bool interleaved, Tensor out) {
  apply_host(x, cos, sin, interleaved, false, out, CudaLaunch(x, "rope.apply.out"));
}

void apply_inplace_cuda(Tensor query, std::optional<Tensor> key, Tensor positions,
                        Tensor cos_sin_cache, bool interleaved, int64_t rope_dim_offset,
                        bool inverse) {
  rotate_inplace_host(query, key, positions, cos_sin_cache, interleaved, nullptr, false,
                      rope_dim_offset, inverse, CudaLaunch(query, "rope.apply_"));
}

void mrope_inplace_cuda(Tensor query, std::optional<Tensor> key, Tensor positions,
                        Tensor cos_sin_cache, std::vector<int64_t> mrope_section, bool interleaved,
                        bool mrope_interleaved, int64_t rope_dim_offset, bool inverse) {
  rotate_inplace_host(query, key, positions, cos_sin_cache, interleaved, &mrope_section,
                      mrope_interleaved, rope_dim_offset, inverse,
                      CudaLaunch(query, "rope.mrope_"));
}

Tensor apply_positions_cuda(Tensor x, Tensor positions, Tensor cos, Tensor sin, bool interleaved,
                            bool inverse, std::optional<std::vector<int64_t>> mrope_section,
                            bool mrope_interleaved) {
  return apply_positions_host(x, positions, cos, &sin, interleaved, inverse, mrope_section,
                              mrope_interleaved, CudaLaunch(x, "rope.apply_positions"));
}

Tensor apply_positions_cache_cuda(Tensor x, Tensor positions, Tensor cos_sin_cache,
                                  bool interleaved, bool inverse,
                                  std::optional<std::vector<int64_t>> mrope_section,
                                  bool mrope_interleaved) {
  return apply_positions_host(x, positions, cos_sin_cache, nullptr, interleaved, inverse,
                              mrope_section, mrope_interleaved,
                              CudaLaunch(x, "rope.apply_positions.cache"));
}

void apply_and_cache_cuda(Tensor query, Tensor key, Tensor value, Tensor positions,
                          Tensor cos_sin_cache, Tensor key_cache, Tensor value_cache,
                          Tensor slot_mapping, bool interleaved, std::string kv_cache_dtype,
                          std::optional<Tensor> k_scale, std::optional<Tensor> v_scale) {
  apply_and_cache_host(query, key, value, positions, cos_sin_cache, key_cache, value_cache,
                       slot_mapping, interleaved, kv_cache_dtype, k_scale, v_scale,
                       CudaLaunch(query, "rope.apply_and_cache_"));
}

// ---- norm + rotation (qk_norm/cuda/host.h) ----

std::tuple<Tensor, Tensor> qk_norm_rope_cuda(Tensor query, Tensor key, Tensor q_weight,
                                             Tensor k_weight, Tensor cos, Tensor sin, double eps,
                                             bool unit_offset, bool interleaved) {
  return qk_norm_rope_host(query, key, q_weight, k_weight, cos, sin, eps, unit_offset,
                           interleaved, CudaLaunch(query, kQkNormOp));
}

std::tuple<Tensor, Tensor> norm_rope_cuda(Tensor query, Tensor key,
                                          std::optional<Tensor> q_weight,
                                          std::optional<Tensor> k_weight,
                                          std::optional<Tensor> q_bias,
                                          std::optional<Tensor> k_bias, Tensor cos, Tensor sin,
                                          double eps, std::string norm, bool interleaved) {
  return norm_rope_host(query, key, q_weight, k_weight, q_bias, k_bias, cos, sin, eps, norm,
                        interleaved, CudaLaunch(query, kNormFormsOp));
}

void qk_norm_rope_inplace_cuda(Tensor query, Tensor key, Tensor q_weight, Tensor k_weight,
                               Tensor positions, Tensor cos_sin_cache, double eps,
                               bool unit_offset, bool interleaved,
                               std::optional<std::vector<int64_t>> mrope_section,
                               bool mrope_interleaved) {
  qk_norm_rope_inplace_host(Meta(query), Meta(key), &query, &key, q_weight, k_weight, positions,
                            cos_sin_cache, eps, unit_offset, interleaved,
                            mrope_section ? &*mrope_section : nullptr, mrope_interleaved,
                            kQkNormInplaceOp, CudaLaunch(query, kQkNormInplaceOp));
}

void qkv_norm_rope_inplace_cuda(Tensor qkv, int64_t num_heads_q, int64_t num_heads_k,
                                int64_t num_heads_v, int64_t head_dim, Tensor q_weight,
                                Tensor k_weight, Tensor positions, Tensor cos_sin_cache,
                                double eps, bool unit_offset, bool interleaved,
                                std::optional<std::vector<int64_t>> mrope_section,
                                bool mrope_interleaved) {
  const QkvViews v(qkv, num_heads_q, num_heads_k, num_heads_v, head_dim);
  qk_norm_rope_inplace_host(*v.q, *v.k, &qkv, nullptr, q_weight, k_weight, positions, cos_sin_cache,
                            eps, unit_offset, interleaved,
                            mrope_section ? &*mrope_section : nullptr, mrope_interleaved,
                            kQkvNormOp, CudaLaunch(qkv, kQkvNormOp));
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
                              CudaLaunch(query, kQkNormCacheOp));
}

std::tuple<Tensor, Tensor, Tensor> qk_norm_rope_and_cache_out_cuda(
    Tensor query, Tensor key, Tensor value, Tensor positions, Tensor cos_sin_cache,
    Tensor q_weight, Tensor k_weight, Tensor key_cache, Tensor value_cache, Tensor slot_mapping,
    double eps, bool unit_offset, bool interleaved,
    std::optional<std::vector<int64_t>> mrope_section, bool mrope_interleaved, bool v_norm,
    std::string kv_cache_dtype, std::optional<Tensor> k_scale, std::optional<Tensor> v_scale) {
  std::optional<std::tuple<Tensor, Tensor, Tensor>> out;
  qk_norm_rope_and_cache_host(query, key, value, positions, cos_sin_cache, q_weight, k_weight,
                              key_cache, value_cache, slot_mapping, eps, unit_offset, interleaved,
                              mrope_section ? &*mrope_section : nullptr, mrope_interleaved,
                              v_norm, kv_cache_dtype, k_scale, v_scale,
                              CudaLaunch(query, kQkNormCacheOutOp), &out);
  return std::move(*out);
}

// ---- K-shift (kv_shift/cuda/host.h) ----

void shift_kv_cache_cuda(Tensor key_cache, Tensor slot_mapping, Tensor delta,
                         Tensor cos_sin_cache, bool interleaved, std::string kv_cache_dtype,
                         std::optional<Tensor> k_scale) {
  shift_kv_cache_host(key_cache, slot_mapping, delta, cos_sin_cache, interleaved, kv_cache_dtype,
                      k_scale, CudaLaunch(key_cache, "rope.shift_kv_cache_"));
}

}  // namespace
}  // namespace rope::gpu

// Kernels only: the schemas are defined once, in the CPU library (csrc/ops/rope.cpp), which
// rope_ext loads first.
STABLE_TORCH_LIBRARY_IMPL(rope, CUDA, m) {
  ROPE_IMPL(m, "apply", &rope::gpu::apply_cuda<false>);
  ROPE_IMPL(m, "apply.out", &rope::gpu::apply_out_cuda);
  ROPE_IMPL(m, "apply_backward", &rope::gpu::apply_cuda<true>);
  ROPE_IMPL(m, "apply_", &rope::gpu::apply_inplace_cuda);
  ROPE_IMPL(m, "mrope_", &rope::gpu::mrope_inplace_cuda);
  ROPE_IMPL(m, "apply_positions", &rope::gpu::apply_positions_cuda);
  ROPE_IMPL(m, "apply_positions.cache", &rope::gpu::apply_positions_cache_cuda);
  ROPE_IMPL(m, "apply_and_cache_", &rope::gpu::apply_and_cache_cuda);
  ROPE_IMPL(m, "qk_norm_rope", &rope::gpu::qk_norm_rope_cuda);
  ROPE_IMPL(m, "norm_rope", &rope::gpu::norm_rope_cuda);
  ROPE_IMPL(m, "qk_norm_rope_", &rope::gpu::qk_norm_rope_inplace_cuda);
  ROPE_IMPL(m, "qkv_norm_rope_", &rope::gpu::qkv_norm_rope_inplace_cuda);
  ROPE_IMPL(m, "qk_norm_rope_and_cache_", &rope::gpu::qk_norm_rope_and_cache_cuda);
  ROPE_IMPL(m, "qk_norm_rope_and_cache", &rope::gpu::qk_norm_rope_and_cache_out_cuda);
  ROPE_IMPL(m, "quantize_fp8", &rope::gpu::quantize_fp8_op<rope::gpu::CudaLaunch>);
  ROPE_IMPL(m, "quantize_fp8_append_paged_kv_cache",
            &rope::gpu::quantize_fp8_paged_op<rope::gpu::CudaLaunch>);
  ROPE_IMPL(m, "shift_kv_cache_", &rope::gpu::shift_kv_cache_cuda);
}
