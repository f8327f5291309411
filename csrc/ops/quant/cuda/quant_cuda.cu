// The CUDA kernels of the RoPE + FP8 quantization ops: the per-token code of quant/cuda/thread.h
// (shared with the CPU kernel and the simulator) run at each thread's position, and their
// launchers (cuda_kernels.h), one per dtype that the host code (quant/cuda/host.h, run by
// cuda_ops.cpp) dispatches to.
#include <torch/headeronly/util/BFloat16.h>
#include <torch/headeronly/util/Half.h>

#include "../../cuda/cuda_launch.cuh"

namespace rope::gpu {
namespace {

template <typename x_t>
__global__ void __launch_bounds__(kMaxBlockThreads, 1) quant_kernel(const QuantArgs<x_t> a) {
  quant_thread<x_t>(a, here());
}

template <typename x_t>
__global__ void __launch_bounds__(kThreadsPerBlock) paged_slot_set_kernel(const PagedSlotSetArgs<x_t> a) {
  paged_slot_set_thread<x_t>(a, here());
}

}  // namespace

template <typename x_t>
const char* launch_quant(const LaunchPlan& p, const QuantArgs<x_t>& a, void* stream) {
  return launch(quant_kernel<x_t>, p, a, stream);
}

template <typename x_t>
const char* launch_paged_slot_set(const LaunchPlan& p, const PagedSlotSetArgs<x_t>& a,
                                  void* stream) {
  return launch(paged_slot_set_kernel<x_t>, p, a, stream);
}

// The dtypes of ROPE_DISPATCH_QUANT_X (quant/cuda/host.h).
#define ROPE_QUANT_KERNELS(x_t)                                                             \
  template const char* launch_quant<x_t>(const LaunchPlan&, const QuantArgs<x_t>&, void*); \
  template const char* launch_paged_slot_set<x_t>(const LaunchPlan&,                       \
                                                  const PagedSlotSetArgs<x_t>&, void*);
ROPE_QUANT_KERNELS(float)
ROPE_QUANT_KERNELS(torch::headeronly::Half)
ROPE_QUANT_KERNELS(torch::headeronly::BFloat16)

}  // namespace rope::gpu
