// The CUDA kernel of rope.shift_kv_cache_, registered for the CUDA key. Per-thread code in
// shift_cuda_thread.h and host logic in shift_cuda_host.h (both simulated on the CPU); here the
// device guard, the current stream, the launch and its check, as rope_cuda.cu does for the
// rotation ops.
#include <cuda_runtime.h>

#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/library.h>

#include "shift_cuda_host.h"

namespace rope::gpu {
namespace {

template <typename x_t, typename acc_t>
__global__ void __launch_bounds__(kMaxBlockThreads, 1)
    shift_kernel(const ShiftArgs<x_t, acc_t> a) {
  shift_thread<x_t, acc_t>(a, {{threadIdx.x, threadIdx.y, threadIdx.z},
                               {blockIdx.x, blockIdx.y, blockIdx.z},
                               {blockDim.x, blockDim.y, blockDim.z},
                               {gridDim.x, gridDim.y, gridDim.z}});
}

constexpr const char* kOp = "rope.shift_kv_cache_";

// Launches on the stream torch uses on the cache's device (a user's stream, or a capture's).
struct ShiftLaunch {
  int device;
  template <typename x_t, typename acc_t>
  void operator()(const LaunchPlan& p, const ShiftArgs<x_t, acc_t>& a) const {
    void* stream = nullptr;
    ROPE_CHECK(aoti_torch_get_current_cuda_stream(device, &stream) == AOTI_TORCH_SUCCESS, kOp,
               ": could not get the current CUDA stream of device ", device);
    shift_kernel<x_t, acc_t><<<dim3(p.grid.x, p.grid.y, p.grid.z),
                               dim3(p.block.x, p.block.y, p.block.z), 0,
                               static_cast<cudaStream_t>(stream)>>>(a);
    const cudaError_t err = cudaGetLastError();
    ROPE_CHECK(err == cudaSuccess, kOp, ": CUDA kernel launch failed: ", cudaGetErrorString(err));
  }
};

void shift_kv_cache_cuda(Tensor key_cache, Tensor slot_mapping, Tensor delta,
                         Tensor cos_sin_cache, bool interleaved, std::string kv_cache_dtype,
                         std::optional<Tensor> k_scale) {
  const torch::stable::accelerator::DeviceGuard guard(key_cache.get_device_index());
  shift_kv_cache_host(key_cache, slot_mapping, delta, cos_sin_cache, interleaved, kv_cache_dtype,
                      k_scale, ShiftLaunch{key_cache.get_device_index()});
}

}  // namespace
}  // namespace rope::gpu

STABLE_TORCH_LIBRARY_IMPL(rope, CUDA, m) {
  m.impl("shift_kv_cache_", TORCH_BOX(&rope::gpu::shift_kv_cache_cuda));
}
