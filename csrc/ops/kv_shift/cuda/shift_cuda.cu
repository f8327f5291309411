// The CUDA kernel of rope.shift_kv_cache_: the per-thread code of kv_shift/cuda/thread.h run at each
// thread's position, and its launcher (cuda_kernels.h), one per cache dtype that the host code
// (kv_shift/cuda/host.h, run by cuda_ops.cpp) dispatches to.
#include <cstdint>

#include <torch/headeronly/util/BFloat16.h>
#include <torch/headeronly/util/Half.h>

#include "../../cuda/cuda_launch.cuh"

namespace rope::gpu {
namespace {

template <typename x_t, typename acc_t>
__global__ void __launch_bounds__(kMaxBlockThreads, 1)
    shift_kernel(const ShiftArgs<x_t, acc_t> a) {
  shift_thread<x_t, acc_t>(a, here());
}

}  // namespace

template <typename x_t, typename acc_t>
const char* launch_shift(const LaunchPlan& p, const ShiftArgs<x_t, acc_t>& a, void* stream) {
  return launch(shift_kernel<x_t, acc_t>, p, a, stream);
}

// The caches of shift_kv_cache_host: float8 codes, and each floating dtype with its arithmetic
// type.
#define ROPE_SHIFT_KERNEL(x_t, acc_t)                          \
  template const char* launch_shift<x_t, acc_t>(               \
      const LaunchPlan&, const ShiftArgs<x_t, acc_t>&, void*);

using torch::headeronly::BFloat16;
using torch::headeronly::Half;
ROPE_SHIFT_KERNEL(uint8_t, float)
ROPE_SHIFT_KERNEL(float, float)
ROPE_SHIFT_KERNEL(double, double)
ROPE_SHIFT_KERNEL(Half, float)
ROPE_SHIFT_KERNEL(BFloat16, float)

}  // namespace rope::gpu
