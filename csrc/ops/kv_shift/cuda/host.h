// Host side of rope.shift_kv_cache_ on CUDA, shared by the op (cuda_ops.cpp) and the CPU
// simulator (tests/sim/cuda_sim.cpp): the checks (kv_shift/checks.h), the data checks on host
// copies of slot_mapping, delta and k_scale (one synchronization, so that a bad slot or delta
// is a clear error before anything is written, as on the CPU), the table in the arithmetic
// type, the launch plan and the dtype dispatch. A `Runner` launches or simulates.
#pragma once

#include <optional>
#include <string>

#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include "../checks.h"
#include "../../cuda/rope_cuda_host.h"
#include "thread.h"

namespace rope::gpu {

template <class Runner>
void shift_kv_cache_host(const Tensor& key_cache, const Tensor& slots, const Tensor& delta,
                         const Tensor& table_in, bool interleaved,
                         const std::string& kv_cache_dtype, const std::optional<Tensor>& k_scale,
                         Runner&& run, int64_t max_blocks = kMaxBlocks) {
  ShiftDesc d = check_shift_kv_cache(key_cache, slots, delta, table_in, interleaved,
                                     kv_cache_dtype, k_scale);
  const bool fp8 = d.format != CacheFormat::kSame;
  float scale = 1.0f;
  {
    const Tensor hs = host_contiguous(slots), hd = host_contiguous(delta);
    std::optional<Tensor> hk;
    if (fp8) hk = host_contiguous(*k_scale);
    ShiftDesc hdesc = d;  // the copies' strides
    hdesc.slot_stride = 1;
    hdesc.delta_stride = delta.dim() == 1 ? 1 : 0;
    const float* ks = fp8 ? static_cast<const float*>(hk->const_data_ptr()) : nullptr;
    check_shift_data(hdesc, hs, hd.const_data_ptr(), ks);
    if (fp8) scale = *ks;
  }
  if (d.n == 0 || d.heads == 0 || d.half == 0) return;  // nothing rotates
  const ScalarType acc =
      dtype_of(key_cache) == ScalarType::Double ? ScalarType::Double : ScalarType::Float;
  const Tensor table = dtype_of(table_in) == acc
                           ? table_in
                           : torch::stable::to(table_in, std::optional<ScalarType>(acc));
  if (table.get() != table_in.get()) {
    d = check_shift_kv_cache(key_cache, slots, delta, table, interleaved, kv_cache_dtype, k_scale);
  }
  auto launch = [&](auto x0, auto acc0) {
    using x_t = decltype(x0);
    using acc_t = decltype(acc0);
    ShiftArgs<x_t, acc_t> a{};
    a.d = d;
    a.cache = static_cast<x_t*>(key_cache.mutable_data_ptr());
    a.slots = slots.const_data_ptr();
    a.delta = delta.const_data_ptr();
    a.table = static_cast<const acc_t*>(table.const_data_ptr());
    a.scale = scale;
    LaunchPlan p;
    plan_block(p, d.half, d.heads, d.n, max_blocks);
    run(p, a);
  };
  if (fp8) {
    launch(uint8_t{}, float{});
  } else {
    ROPE_DISPATCH_FLOATING(dtype_of(key_cache), "rope.shift_kv_cache_",
                           [&] { launch(scalar_t{}, opmath_t<scalar_t>{}); });
  }
}

}  // namespace rope::gpu
