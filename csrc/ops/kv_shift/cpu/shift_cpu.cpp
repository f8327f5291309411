// The CPU host of rope.shift_kv_cache_ (K-shift, kv_shift/geometry.h): the checks, then the
// listed slots split across threads; the kernel (kv_shift/cpu/kernels.h) is the variant that serves,
// compiled per ISA with the rotation kernels whose row loop it shares.
#include <optional>
#include <string>

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include "../checks.h"
#include "../../cpu/dt_index.h"
#include "../../routes.h"

namespace rope {
namespace {

// Entries per task: decode-sized calls (a few slots) run on the calling thread.
constexpr int64_t kGrainPairs = 1 << 14;

void run(const ShiftJob& job, ShiftSlotsFn kernel) {
  const ShiftDesc& d = *job.d;
  int64_t per_entry;
  if (!mul_fits(d.heads, d.half, per_entry)) per_entry = kInt64Max;
  const int64_t grain = std::max<int64_t>(1, kGrainPairs / std::max<int64_t>(1, per_entry));
  auto fn = [&](int64_t b, int64_t e) { kernel(job, b, e); };
  if (d.n <= grain || torch::stable::get_num_threads() <= 1) {
    fn(0, d.n);
  } else {
    torch::stable::parallel_for(0, d.n, grain, fn);
  }
}

void shift_kv_cache_cpu(Tensor key_cache, Tensor slot_mapping, Tensor delta, Tensor cos_sin_cache,
                        bool interleaved, std::string kv_cache_dtype,
                        std::optional<Tensor> k_scale) {
  const ShiftDesc d = check_shift_kv_cache(key_cache, slot_mapping, delta, cos_sin_cache,
                                           interleaved, kv_cache_dtype, k_scale);
  const bool fp8 = d.format != CacheFormat::kSame;
  const float* scale = fp8 ? static_cast<const float*>(k_scale->const_data_ptr()) : nullptr;
  check_shift_data(d, slot_mapping, delta.const_data_ptr(), scale);
  if (d.n == 0 || d.heads == 0 || d.half == 0) return;  // nothing rotates (data may be null)
  ShiftJob job{&d,
               key_cache.mutable_data_ptr(),
               slot_mapping.const_data_ptr(),
               delta.const_data_ptr(),
               cos_sin_cache.const_data_ptr(),
               dt_index(dtype_of(cos_sin_cache)),
               fp8 ? *scale : 1.0f};
  const CpuKernels* k = selected_cpu_kernels();
  run(job, fp8 ? k->shift_fp8[static_cast<int>(d.format)]
               : k->shift[dt_index(dtype_of(key_cache))]);
}

}  // namespace
}  // namespace rope

STABLE_TORCH_LIBRARY_IMPL(rope, CPU, m) {
  ROPE_IMPL_CPU(m, "shift_kv_cache_", &rope::shift_kv_cache_cpu);
}
