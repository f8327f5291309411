// The CUDA kernels of every rotation op and of rope.apply_and_cache_: the per-thread code of
// rope_cuda_thread.h run at each thread's position, and their launchers (cuda_kernels.h), one
// per dtype pair and layout that the host code (rope_cuda_host.h, run by cuda_ops.cpp)
// dispatches to.
#include <torch/headeronly/util/BFloat16.h>
#include <torch/headeronly/util/Half.h>

#include "cuda_launch.cuh"

namespace rope::gpu {
namespace {

template <typename x_t, typename tab_t, bool kInterleaved>
__global__ void __launch_bounds__(kMaxBlockThreads, 1)
    rotate_kernel(const RotateArgs<x_t, tab_t> a) {
  rotate_thread<x_t, tab_t, kInterleaved>(a, here());
}

template <typename x_t, typename tab_t>
__global__ void __launch_bounds__(kMaxBlockThreads, 1) cache_kernel(const CacheArgs<x_t, tab_t> a) {
  cache_thread<x_t, tab_t>(a, here());
}

__global__ void __launch_bounds__(kThreadsPerBlock) slot_set_kernel(const SlotSetArgs a) {
  slot_set_thread(a, here());
}

}  // namespace

template <typename x_t, typename tab_t, bool kInterleaved>
const char* launch_rotate(const LaunchPlan& p, const RotateArgs<x_t, tab_t>& a, void* stream) {
  return launch(rotate_kernel<x_t, tab_t, kInterleaved>, p, a, stream);
}

template <typename x_t, typename tab_t>
const char* launch_cache(const LaunchPlan& p, const CacheArgs<x_t, tab_t>& a, void* stream) {
  return launch(cache_kernel<x_t, tab_t>, p, a, stream);
}

const char* launch_slot_set(const LaunchPlan& p, const SlotSetArgs& a, void* stream) {
  return launch(slot_set_kernel, p, a, stream);
}

// The (x, table) dtypes of dispatch_types (rope_cuda_host.h): x's own, or its arithmetic type.
#define ROPE_ROTATION_KERNELS(x_t, tab_t)                       \
  template const char* launch_rotate<x_t, tab_t, false>(        \
      const LaunchPlan&, const RotateArgs<x_t, tab_t>&, void*); \
  template const char* launch_rotate<x_t, tab_t, true>(         \
      const LaunchPlan&, const RotateArgs<x_t, tab_t>&, void*); \
  template const char* launch_cache<x_t, tab_t>(                \
      const LaunchPlan&, const CacheArgs<x_t, tab_t>&, void*);

using torch::headeronly::BFloat16;
using torch::headeronly::Half;
ROPE_ROTATION_KERNELS(float, float)
ROPE_ROTATION_KERNELS(double, double)
ROPE_ROTATION_KERNELS(Half, Half)
ROPE_ROTATION_KERNELS(Half, float)
ROPE_ROTATION_KERNELS(BFloat16, BFloat16)
ROPE_ROTATION_KERNELS(BFloat16, float)

}  // namespace rope::gpu
