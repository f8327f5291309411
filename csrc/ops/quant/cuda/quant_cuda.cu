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

__global__ void __launch_bounds__(kThreadsPerBlock) paged_slot_set_kernel(const PagedSlotSetArgs a) {
  paged_slot_set_thread(a, here());
}

}  // namespace

template <typename x_t>
const char* launch_quant(const LaunchPlan& p, const QuantArgs<x_t>& a, void* stream) {
  return launch(quant_kernel<x_t>, p, a, stream);
}

const char* launch_paged_slot_set(const LaunchPlan& p, const PagedSlotSetArgs& a, void* stream) {
  return launch(paged_slot_set_kernel, p, a, stream);
}

// The dtypes of ROPE_DISPATCH_QUANT_X (quant/cuda/host.h).
template const char* launch_quant<float>(const LaunchPlan&, const QuantArgs<float>&, void*);
template const char* launch_quant<torch::headeronly::Half>(
    const LaunchPlan&, const QuantArgs<torch::headeronly::Half>&, void*);
template const char* launch_quant<torch::headeronly::BFloat16>(
    const LaunchPlan&, const QuantArgs<torch::headeronly::BFloat16>&, void*);

}  // namespace rope::gpu
