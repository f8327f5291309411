// CUDA kernels of the RoPE + FP8 quantization ops, registered for the CUDA key. The per-thread
// code is in rope_quant_thread.h and the host logic in rope_quant_host.h, both shared with the
// CPU kernel and the simulator; this file adds the device guard, the current stream and the
// launch (the launcher of rope_quant.cu, cuda_kernels.h).
#include <torch/csrc/stable/library.h>

#include "../routes.h"
#include "cuda_runner.h"
#include "rope_quant_host.h"

namespace rope::gpu {
namespace {

struct QuantLaunch : CudaStreamLaunch {
  using CudaStreamLaunch::CudaStreamLaunch;

  template <typename x_t>
  void operator()(const LaunchPlan& p, const QuantArgs<x_t>& a) const {
    check(launch_quant<x_t>(p, a, stream()));
  }
};

}  // namespace
}  // namespace rope::gpu

STABLE_TORCH_LIBRARY_IMPL(rope, CUDA, m) {
  rope::impl_routed(m, rope::kQuantizeFp8, TORCH_BOX(&rope::gpu::quantize_fp8_op<rope::gpu::QuantLaunch>));
  rope::impl_routed(m, rope::kQuantizeFp8Paged, TORCH_BOX(&rope::gpu::quantize_fp8_paged_op<rope::gpu::QuantLaunch>));
}
