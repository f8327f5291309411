// What only a GPU adds to the shared host logic, for every op's .cu file: the thread's position
// in the grid, and a runner base that makes the tensors' device current, finds the stream torch
// is using there (a CUDA graph's capture stream while capturing, a user's torch.cuda.Stream
// inside `with torch.cuda.stream(s)`) and checks each launch.
#pragma once

#include <cuda_runtime.h>

#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/accelerator.h>

#include "rope_cuda_host.h"

namespace rope::gpu {

__device__ __forceinline__ ThreadPos here() {
  return {{threadIdx.x, threadIdx.y, threadIdx.z},
          {blockIdx.x, blockIdx.y, blockIdx.z},
          {blockDim.x, blockDim.y, blockDim.z},
          {gridDim.x, gridDim.y, gridDim.z}};
}

inline dim3 to_dim3(const Idx3& i) { return dim3(i.x, i.y, i.z); }

// An op's runner derives from this and launches each kernel with launch().
class CudaStreamLaunch {
 public:
  CudaStreamLaunch(const Tensor& on, const char* op) : guard_(on.get_device_index()), op_(op) {
    void* stream = nullptr;
    ROPE_CHECK(aoti_torch_get_current_cuda_stream(on.get_device_index(), &stream) ==
                   AOTI_TORCH_SUCCESS,
               op, ": could not get the current CUDA stream of device ", on.get_device_index());
    stream_ = static_cast<cudaStream_t>(stream);
  }

 protected:
  // kernel(a) over the plan's grid and blocks on the stream, then the launch's check.
  template <typename Args>
  void launch(void (*kernel)(Args), const LaunchPlan& p, const Args& a) const {
    kernel<<<to_dim3(p.grid), to_dim3(p.block), 0, stream_>>>(a);
    const cudaError_t err = cudaGetLastError();  // also clears it, so it is reported once
    ROPE_CHECK(err == cudaSuccess, op_, ": CUDA kernel launch failed: ", cudaGetErrorString(err));
  }

 private:
  torch::stable::accelerator::DeviceGuard guard_;
  const char* op_;
  cudaStream_t stream_ = nullptr;
};

}  // namespace rope::gpu
