// What only a GPU adds to the per-thread code, for every kernel file (*.cu): the thread's position
// in the grid, and the launch of a kernel over a plan's grid on a stream, with its check. No
// torch header (see cuda_kernels.h): the ops' host files find the stream and report a failed
// launch (cuda_runner.h).
#pragma once

#include <cuda_runtime.h>

#include "cuda_kernels.h"

namespace rope::gpu {

__device__ __forceinline__ ThreadPos here() {
  return {{threadIdx.x, threadIdx.y, threadIdx.z},
          {blockIdx.x, blockIdx.y, blockIdx.z},
          {blockDim.x, blockDim.y, blockDim.z},
          {gridDim.x, gridDim.y, gridDim.z}};
}

inline dim3 to_dim3(const Idx3& i) { return dim3(i.x, i.y, i.z); }

// kernel(a) over the plan's grid and blocks on `stream`; the launch's error message, or nullptr.
template <typename Args>
const char* launch(void (*kernel)(Args), const LaunchPlan& p, const Args& a, void* stream) {
  kernel<<<to_dim3(p.grid), to_dim3(p.block), 0, static_cast<cudaStream_t>(stream)>>>(a);
  const cudaError_t err = cudaGetLastError();  // also clears it, so it is reported once
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

}  // namespace rope::gpu
