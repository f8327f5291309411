// The CUDA kernels of the fused QK-RMSNorm + RoPE ops: the per-thread code of
// qk_norm/cuda/thread.h run at each thread's position, and their launchers (cuda_kernels.h), one
// per dtype pair and layout that the host code (qk_norm/cuda/host.h, run by cuda_ops.cpp)
// dispatches to.
#include <torch/headeronly/util/BFloat16.h>
#include <torch/headeronly/util/Half.h>

#include "../../cuda/cuda_launch.cuh"

namespace rope::gpu {
namespace {

template <typename x_t, typename tab_t, bool kInterleaved>
__global__ void __launch_bounds__(kNormThreadsPerBlock, kNormMinBlocksPerSm)
    norm_rope_kernel(const NormRopeArgs<x_t, tab_t> a) {
  norm_rope_thread<x_t, tab_t, kInterleaved>(a, here());
}

}  // namespace

template <typename x_t, typename tab_t, bool kInterleaved>
const char* launch_norm_rope(const LaunchPlan& p, const NormRopeArgs<x_t, tab_t>& a,
                             void* stream) {
  return launch(norm_rope_kernel<x_t, tab_t, kInterleaved>, p, a, stream);
}

// The (x, table) dtypes of dispatch_types (rope_cuda_host.h): x's own, or its arithmetic type.
#define ROPE_NORM_ROPE_KERNELS(x_t, tab_t)                        \
  template const char* launch_norm_rope<x_t, tab_t, false>(       \
      const LaunchPlan&, const NormRopeArgs<x_t, tab_t>&, void*); \
  template const char* launch_norm_rope<x_t, tab_t, true>(        \
      const LaunchPlan&, const NormRopeArgs<x_t, tab_t>&, void*);

using torch::headeronly::BFloat16;
using torch::headeronly::Half;
ROPE_NORM_ROPE_KERNELS(float, float)
ROPE_NORM_ROPE_KERNELS(double, double)
ROPE_NORM_ROPE_KERNELS(Half, Half)
ROPE_NORM_ROPE_KERNELS(Half, float)
ROPE_NORM_ROPE_KERNELS(BFloat16, BFloat16)
ROPE_NORM_ROPE_KERNELS(BFloat16, float)

}  // namespace rope::gpu
