// CUDA kernel for rope.mrope_, registered for the CUDA key. The per-thread code and launch shape
// are in mrope_cuda_thread.h (shared with a CPU simulator, tests/sim/mrope_cuda_sim.cpp); this
// file adds the host checks, the table cast, the device guard, the current stream and the launch.
//
// Built into the CUDA library with the other CUDA kernels (the csrc/ops/cuda/*.cu sources); the
// host checks come from mrope_checks_cuda.cpp. Not vectorized: one thread per (pair, token).
#include <cuda_runtime.h>

#include <cstdlib>
#include <cstring>
#include <optional>
#include <vector>

#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include "../dispatch.h"
#include "../mrope_checks.h"
#include "mrope_cuda_thread.h"

namespace rope::mrope_gpu {
namespace {

using torch::headeronly::ScalarType;
using torch::stable::Tensor;

constexpr int kMaxBlockThreads = 256;

template <typename x_t, bool kInterleaved>
__global__ void __launch_bounds__(kMaxBlockThreads) mrope_kernel(const MropeArgs<x_t> a) {
  const MropeThread th{static_cast<int64_t>(blockIdx.x) * blockDim.z + threadIdx.z,
                       static_cast<int64_t>(gridDim.x) * blockDim.z,
                       threadIdx.x,
                       blockDim.x,
                       threadIdx.y,
                       blockDim.y};
  mrope_thread<x_t, kInterleaved>(a, th);
}

// Same switch as the other CUDA ops: reading the positions on the host is a device sync (and
// impossible under CUDA graph capture), so it is opt-in; without it out-of-range tokens are
// skipped by the kernel.
bool position_checking_enabled() {
  const char* v = std::getenv("ROPE_EXT_CHECK_POSITIONS");
  return v != nullptr && *v != '\0' && std::strcmp(v, "0") != 0 &&
         std::strcmp(v, "false") != 0 && std::strcmp(v, "False") != 0;
}

// Component-major, so the flat index is that of positions.flatten(), as on the CPU.
void check_positions_on_host(const Tensor& positions, int64_t max_position) {
  if (positions.numel() == 0) return;
  Tensor cpu = torch::stable::to(positions, torch::stable::Device(torch::headeronly::DeviceType::CPU));
  cpu = torch::stable::contiguous(cpu);
  const bool pos64 = cpu.scalar_type() == ScalarType::Long;
  const void* data = cpu.const_data_ptr();
  for (int64_t t = 0; t < cpu.numel(); ++t) {
    const int64_t p = load_position(data, pos64, t);
    STD_TORCH_CHECK(p >= 0 && p < max_position, "rope.mrope_: positions must lie in [0, ",
                    max_position, ") (max_position = cos_sin_cache.size(0)), got ", p,
                    " at flat index ", t);
  }
}

cudaStream_t current_stream(int32_t device_index) {
  void* stream = nullptr;
  STD_TORCH_CHECK(aoti_torch_get_current_cuda_stream(device_index, &stream) == AOTI_TORCH_SUCCESS,
                  "rope.mrope_: could not get the current CUDA stream of device ", device_index);
  return static_cast<cudaStream_t>(stream);
}

void mrope_cuda(Tensor query, std::optional<Tensor> key, Tensor positions, Tensor cos_sin_cache,
                std::vector<int64_t> mrope_section, bool interleaved) {
  check_mrope(query, key, positions, cos_sin_cache, mrope_section);
  const int32_t dev = query.get_device_index();
  torch::stable::accelerator::DeviceGuard guard(dev);
  if (position_checking_enabled()) check_positions_on_host(positions, cos_sin_cache.size(0));
  const ScalarType want =
      query.scalar_type() == ScalarType::Double ? ScalarType::Double : ScalarType::Float;
  const Tensor cache = cos_sin_cache.scalar_type() == want
                           ? cos_sin_cache
                           : torch::stable::to(cos_sin_cache, std::optional<ScalarType>(want));
  const MropeGeometry g = check_mrope(query, key, positions, cache, mrope_section);
  if (g.inplace.tokens == 0 || g.inplace.half == 0) return;
  const MropeLaunch l = plan_mrope(g);
  const dim3 grid(l.grid_x), block(l.block_x, l.block_y, l.block_z);
  const cudaStream_t stream = current_stream(dev);
  ROPE_DISPATCH_FLOATING(query.scalar_type(), "rope.mrope_", [&] {
    using x_t = scalar_t;
    const MropeArgs<x_t> a{query.mutable_data_ptr<x_t>(),
                           key.has_value() ? key->mutable_data_ptr<x_t>() : nullptr,
                           positions.const_data_ptr(),
                           positions.scalar_type() == ScalarType::Long,
                           cache.const_data_ptr<opmath_t<x_t>>(),
                           g};
    if (interleaved) {
      mrope_kernel<x_t, true><<<grid, block, 0, stream>>>(a);
    } else {
      mrope_kernel<x_t, false><<<grid, block, 0, stream>>>(a);
    }
  });
  const cudaError_t err = cudaGetLastError();
  STD_TORCH_CHECK(err == cudaSuccess, "rope.mrope_: CUDA kernel launch failed: ",
                  cudaGetErrorString(err));
}

}  // namespace
}  // namespace rope::mrope_gpu

STABLE_TORCH_LIBRARY_IMPL(rope, CUDA, m) {
  m.impl("mrope_", TORCH_BOX(&rope::mrope_gpu::mrope_cuda));
}
