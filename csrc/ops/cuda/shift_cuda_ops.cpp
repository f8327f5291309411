// The CUDA kernel of rope.shift_kv_cache_, registered for the CUDA key. Per-thread code in
// shift_cuda_thread.h and host logic in shift_cuda_host.h (both simulated on the CPU); here the
// runner (cuda_runner.h: device guard, current stream, launch check) that launches the kernel of
// shift_cuda.cu through its launcher (cuda_kernels.h).
#include <torch/csrc/stable/library.h>

#include "cuda_runner.h"
#include "shift_cuda_host.h"

namespace rope::gpu {
namespace {

struct ShiftLaunch : CudaStreamLaunch {
  using CudaStreamLaunch::CudaStreamLaunch;

  template <typename x_t, typename acc_t>
  void operator()(const LaunchPlan& p, const ShiftArgs<x_t, acc_t>& a) const {
    check(launch_shift<x_t, acc_t>(p, a, stream()));
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
