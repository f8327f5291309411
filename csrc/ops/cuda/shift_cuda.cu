// The CUDA kernel of rope.shift_kv_cache_, registered for the CUDA key. Per-thread code in
// shift_cuda_thread.h and host logic in shift_cuda_host.h (both simulated on the CPU); here the
// kernel and its runner (cuda_launch.cuh: device guard, current stream, launch check).
#include <torch/csrc/stable/library.h>

#include "cuda_launch.cuh"
#include "shift_cuda_host.h"

namespace rope::gpu {
namespace {

template <typename x_t, typename acc_t>
__global__ void __launch_bounds__(kMaxBlockThreads, 1)
    shift_kernel(const ShiftArgs<x_t, acc_t> a) {
  shift_thread<x_t, acc_t>(a, here());
}

struct ShiftLaunch : CudaStreamLaunch {
  using CudaStreamLaunch::CudaStreamLaunch;

  template <typename x_t, typename acc_t>
  void operator()(const LaunchPlan& p, const ShiftArgs<x_t, acc_t>& a) const {
    launch(shift_kernel<x_t, acc_t>, p, a);
  }
};

void shift_kv_cache_cuda(Tensor key_cache, Tensor slot_mapping, Tensor delta,
                         Tensor cos_sin_cache, bool interleaved, std::string kv_cache_dtype,
                         std::optional<Tensor> k_scale) {
  shift_kv_cache_host(key_cache, slot_mapping, delta, cos_sin_cache, interleaved, kv_cache_dtype,
                      k_scale, ShiftLaunch(key_cache, "rope.shift_kv_cache_"));
}

}  // namespace
}  // namespace rope::gpu

STABLE_TORCH_LIBRARY_IMPL(rope, CUDA, m) {
  m.impl("shift_kv_cache_", TORCH_BOX(&rope::gpu::shift_kv_cache_cuda));
}
