// CUDA kernels of every rotation op, registered for the CUDA key: the ops' host logic (checks,
// table dtypes, launch plan, dispatch) is in rope_cuda_host.h, shared with the CPU simulator that
// tests the kernels without a GPU; this file adds what only a GPU needs (cuda_runner.h: the device
// guard, the current stream, the launch checks) and launches the kernels through their launchers
// (cuda_kernels.h, defined with the kernels in rope_cuda.cu).
#include <torch/csrc/stable/library.h>

#include "../routes.h"
#include "cuda_runner.h"
#include "rope_cuda_host.h"

namespace rope::gpu {
namespace {

// The one place every rotation op goes through (see CudaStreamLaunch).
struct CudaLaunch : CudaStreamLaunch {
  using CudaStreamLaunch::CudaStreamLaunch;

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
};

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
                      mrope_interleaved, rope_dim_offset, inverse, CudaLaunch(query, "rope.mrope_"));
}

Tensor apply_positions_cuda(Tensor x, Tensor positions, Tensor cos, Tensor sin, bool interleaved,
                            bool inverse, std::optional<std::vector<int64_t>> mrope_section,
                            bool mrope_interleaved) {
  return apply_positions_host(x, positions, cos, sin, interleaved, inverse, mrope_section,
                              mrope_interleaved, CudaLaunch(x, "rope.apply_positions"));
}

void apply_and_cache_cuda(Tensor query, Tensor key, Tensor value, Tensor positions,
                          Tensor cos_sin_cache, Tensor key_cache, Tensor value_cache,
                          Tensor slot_mapping, bool interleaved, std::string kv_cache_dtype,
                          std::optional<Tensor> k_scale, std::optional<Tensor> v_scale) {
  apply_and_cache_host(query, key, value, positions, cos_sin_cache, key_cache, value_cache,
                       slot_mapping, interleaved, kv_cache_dtype, k_scale, v_scale,
                       CudaLaunch(query, "rope.apply_and_cache_"));
}

}  // namespace
}  // namespace rope::gpu

// Kernels only: the schemas are defined once, in the CPU library (csrc/ops/rope.cpp), which
// rope_ext loads first.
STABLE_TORCH_LIBRARY_IMPL(rope, CUDA, m) {
  rope::impl_routed(m, rope::kApply, TORCH_BOX(&rope::gpu::apply_cuda<false>));
  rope::impl_routed(m, rope::kApplyOut, TORCH_BOX(&rope::gpu::apply_out_cuda));
  rope::impl_routed(m, rope::kApplyBackward, TORCH_BOX(&rope::gpu::apply_cuda<true>));
  rope::impl_routed(m, rope::kApplyInplace, TORCH_BOX(&rope::gpu::apply_inplace_cuda));
  rope::impl_routed(m, rope::kMropeInplace, TORCH_BOX(&rope::gpu::mrope_inplace_cuda));
  rope::impl_routed(m, rope::kApplyPositions, TORCH_BOX(&rope::gpu::apply_positions_cuda));
  rope::impl_routed(m, rope::kApplyAndCache, TORCH_BOX(&rope::gpu::apply_and_cache_cuda));
}
