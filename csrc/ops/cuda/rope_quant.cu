// CUDA kernels of the RoPE + FP8 quantization ops. The per-thread code is in
// rope_quant_thread.h and the host logic in rope_quant_host.h, both shared with the CPU kernel and
// the simulator; this file adds the device guard, the current stream and the launch.
#include <torch/csrc/stable/library.h>

#include "../routes.h"
#include "cuda_launch.cuh"
#include "rope_quant_host.h"

namespace rope::gpu {
namespace {

template <typename x_t>
__global__ void __launch_bounds__(kMaxBlockThreads, 1) quant_kernel(const QuantArgs<x_t> a) {
  quant_thread<x_t>(a, here());
}

class QuantLaunch : public CudaStreamLaunch {
 public:
  using CudaStreamLaunch::CudaStreamLaunch;

  template <typename x_t>
  void operator()(const LaunchPlan& p, const QuantArgs<x_t>& a) const {
    quant_kernel<x_t><<<to_dim3(p.grid), to_dim3(p.block), 0, stream()>>>(a);
    check_launch();
  }
};

void quantize_fp8_cuda(Tensor q_rope, Tensor k_rope, Tensor q_nope, Tensor k_nope,
                       Tensor cos_sin_cache, Tensor pos_ids, Tensor q_rope_out, Tensor k_rope_out,
                       Tensor q_nope_out, Tensor k_nope_out, double quant_scale_q,
                       double quant_scale_kv, bool interleaved) {
  quantize_host(q_rope, k_rope, q_nope, k_nope, cos_sin_cache, pos_ids, q_rope_out, k_rope_out,
                q_nope_out, k_nope_out, quant_scale_q, quant_scale_kv, interleaved,
                QuantLaunch(q_rope, "rope.quantize_fp8"));
}

void quantize_fp8_paged_cuda(Tensor q_rope, Tensor k_rope, Tensor q_nope, Tensor k_nope,
                             std::optional<Tensor> v, Tensor cos_sin_cache, Tensor pos_ids,
                             Tensor q_rope_out, Tensor q_nope_out, Tensor k_cache, Tensor v_cache,
                             Tensor kv_indices, Tensor kv_indptr, Tensor batch_indices,
                             Tensor positions, int64_t page_size, std::string kv_layout,
                             double quant_scale_q, double quant_scale_kv, bool interleaved) {
  quantize_paged_host(q_rope, k_rope, q_nope, k_nope, v, cos_sin_cache, pos_ids, q_rope_out,
                      q_nope_out, k_cache, v_cache, kv_indices, kv_indptr, batch_indices,
                      positions, page_size, kv_layout, quant_scale_q, quant_scale_kv, interleaved,
                      QuantLaunch(q_rope, "rope.quantize_fp8_append_paged_kv_cache"));
}

}  // namespace
}  // namespace rope::gpu

STABLE_TORCH_LIBRARY_IMPL(rope, CUDA, m) {
  rope::impl_routed(m, rope::kQuantizeFp8, TORCH_BOX(&rope::gpu::quantize_fp8_cuda));
  rope::impl_routed(m, rope::kQuantizeFp8Paged, TORCH_BOX(&rope::gpu::quantize_fp8_paged_cuda));
}
