// CUDA kernels for rope.apply (and its out= overload), rope.apply_backward and rope.apply_, registered for the CUDA key.
// The per-thread code and launch plan are in rope_cuda_thread.h and the host logic in
// rope_cuda_host.h, both shared with the CPU simulator that tests them without a GPU; this file
// only adds the device guard, the current stream, the launches and their error checks.
#include <cuda_runtime.h>

#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/library.h>

#include "rope_cuda_host.h"

namespace rope::gpu {
namespace {

// The largest block any plan chooses (plan_apply: 256, plan_apply_inplace: 512 threads).
constexpr int kMaxBlockThreads = 512;

__device__ __forceinline__ ThreadPos here() {
  return {{threadIdx.x, threadIdx.y, threadIdx.z},
          {blockIdx.x, blockIdx.y, blockIdx.z},
          {blockDim.x, blockDim.y, blockDim.z},
          {gridDim.x, gridDim.y, gridDim.z}};
}

template <typename x_t, typename tab_t, bool kInterleaved, bool kInverse, bool kVec>
__global__ void __launch_bounds__(kMaxBlockThreads)
    apply_kernel(const ApplyArgs<x_t, tab_t> a) {
  apply_thread<x_t, tab_t, kInterleaved, kInverse, kVec>(a, here());
}

template <typename x_t, typename tab_t, bool kInterleaved, bool kVec>
__global__ void __launch_bounds__(kMaxBlockThreads)
    apply_inplace_kernel(const InplaceArgs<x_t, tab_t> a) {
  apply_inplace_thread<x_t, tab_t, kInterleaved, kVec>(a, here());
}

dim3 to_dim3(const Idx3& i) { return dim3(i.x, i.y, i.z); }

void check_launch(const char* op) {
  const cudaError_t err = cudaGetLastError();  // also clears it, so it is reported once
  STD_TORCH_CHECK(err == cudaSuccess, op, ": CUDA kernel launch failed: ", cudaGetErrorString(err));
}

// The stream torch is using on the tensors' device (a CUDA graph's capture stream while
// capturing, a user's torch.cuda.Stream inside `with torch.cuda.stream(s)`).
cudaStream_t current_stream(int32_t device_index) {
  void* stream = nullptr;
  STD_TORCH_CHECK(aoti_torch_get_current_cuda_stream(device_index, &stream) == AOTI_TORCH_SUCCESS,
                  "rope: could not get the current CUDA stream of device ", device_index);
  return static_cast<cudaStream_t>(stream);
}

struct ApplyLauncher {
  cudaStream_t stream;
  const char* op;
  template <typename x_t, typename tab_t, bool kI, bool kInv, bool kVec>
  void operator()(const LaunchPlan& p, const ApplyArgs<x_t, tab_t>& a, Bool<kI>, Bool<kInv>,
                  Bool<kVec>) const {
    apply_kernel<x_t, tab_t, kI, kInv, kVec>
        <<<to_dim3(p.grid), to_dim3(p.block), 0, stream>>>(a);
    check_launch(op);
  }
};

struct InplaceLauncher {
  cudaStream_t stream;
  template <typename x_t, typename tab_t, bool kI, bool kVec>
  void operator()(const LaunchPlan& p, const InplaceArgs<x_t, tab_t>& a, Bool<kI>,
                  Bool<kVec>) const {
    apply_inplace_kernel<x_t, tab_t, kI, kVec>
        <<<to_dim3(p.grid), to_dim3(p.block), 0, stream>>>(a);
    check_launch("rope.apply_");
  }
};

template <bool kInverse>
Tensor apply_cuda(const Tensor& x, const Tensor& cos, const Tensor& sin, bool interleaved) {
  const int32_t dev = x.get_device_index();
  torch::stable::accelerator::DeviceGuard guard(dev);
  const ApplyLauncher launch{current_stream(dev), kInverse ? "rope.apply_backward" : "rope.apply"};
  return apply_host<kInverse>(x, cos, sin, interleaved, launch);
}

Tensor apply_forward_cuda(Tensor x, Tensor cos, Tensor sin, bool interleaved) {
  return apply_cuda<false>(x, cos, sin, interleaved);
}

Tensor apply_backward_cuda(Tensor grad, Tensor cos, Tensor sin, bool interleaved) {
  return apply_cuda<true>(grad, cos, sin, interleaved);
}

void apply_out_cuda(Tensor x, Tensor cos, Tensor sin, bool interleaved, Tensor out) {
  const int32_t dev = x.get_device_index();
  torch::stable::accelerator::DeviceGuard guard(dev);
  apply_out_host(x, cos, sin, interleaved, out,
                        ApplyLauncher{current_stream(dev), "rope.apply.out"});
}

void apply_inplace_cuda(Tensor query, std::optional<Tensor> key, Tensor positions,
                        Tensor cos_sin_cache, bool interleaved) {
  const int32_t dev = query.get_device_index();
  torch::stable::accelerator::DeviceGuard guard(dev);
  apply_inplace_host(query, key, positions, cos_sin_cache, interleaved,
                     InplaceLauncher{current_stream(dev)});
}

}  // namespace
}  // namespace rope::gpu

// Kernels only: the schemas are defined once, in the CPU library (csrc/ops/rope.cpp), which
// rope_ext loads first.
STABLE_TORCH_LIBRARY_IMPL(rope, CUDA, m) {
  m.impl("apply", TORCH_BOX(&rope::gpu::apply_forward_cuda));
  m.impl("apply.out", TORCH_BOX(&rope::gpu::apply_out_cuda));
  m.impl("apply_backward", TORCH_BOX(&rope::gpu::apply_backward_cuda));
  m.impl("apply_", TORCH_BOX(&rope::gpu::apply_inplace_cuda));
}
