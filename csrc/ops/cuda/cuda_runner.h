// What a GPU adds to the shared host logic (cuda_ops.cpp registers every op with it): a runner
// base that makes the tensors' device current, finds the stream torch is using there (a CUDA graph's
// capture stream while capturing, a user's torch.cuda.Stream inside `with torch.cuda.stream(s)`)
// and checks each launch, made by a launcher of cuda_kernels.h (defined with the kernels).
#pragma once

#include <cstdint>

#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/accelerator.h>

#include "cuda_kernels.h"
#include "rope_cuda_host.h"

// torch's C shim declares its CUDA entries only where USE_CUDA is defined (nvcc's flags), and the
// host files are compiled by the C++ compiler with the library's C++ flags: its declaration.
extern "C" AOTITorchError aoti_torch_get_current_cuda_stream(int32_t device_index,
                                                             void** ret_stream);

namespace rope::gpu {

// An op's runner derives from this and passes each launcher's result to check().
class CudaStreamLaunch {
 public:
  CudaStreamLaunch(const Tensor& on, const char* op) : guard_(on.get_device_index()), op_(op) {
    ROPE_CHECK(aoti_torch_get_current_cuda_stream(on.get_device_index(), &stream_) ==
                   AOTI_TORCH_SUCCESS,
               op, ": could not get the current CUDA stream of device ", on.get_device_index());
  }

 protected:
  void* stream() const { return stream_; }

  // A launcher's result: nullptr, or the error of its launch.
  void check(const char* error) const {
    ROPE_CHECK(error == nullptr, op_, ": CUDA kernel launch failed: ", error);
  }

 private:
  torch::stable::accelerator::DeviceGuard guard_;
  const char* op_;
  void* stream_ = nullptr;  // a cudaStream_t
};

}  // namespace rope::gpu
