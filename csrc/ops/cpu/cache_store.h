// The host side of the paged-cache store stage (kernel_api.h CacheJob), for every CPU op whose
// call ends in the caches (rope.apply_and_cache_, rope.qk_norm_rope_and_cache_): the stage's job
// from the checked CacheGeometry, and the kernel of the variant that serves. Host only.
#pragma once

#include <optional>

#include "dt_index.h"

namespace rope {
namespace {

inline float read_scale(const std::optional<Tensor>& s) {
  return s.has_value() ? *static_cast<const float*>(s->const_data_ptr()) : 1.0f;
}

// key: the written key rows (the kernels store them after writing); v_eps >= 0: value rows
// normed first (v_norm), else < 0; value_out: where value rows are written (normed or copied),
// or nullptr.
inline CacheJob cache_store_job(const CacheGeometry& cg, const Tensor& key, const Tensor& value,
                                double v_eps, const Tensor& slot_mapping, const Tensor& key_cache,
                                const Tensor& value_cache, const std::optional<Tensor>& k_scale,
                                const std::optional<Tensor>& v_scale,
                                const Tensor* value_out = nullptr) {
  CacheJob job{};
  job.g = &cg;
  job.key = key.const_data_ptr();
  job.value = value.const_data_ptr();
  job.value_out = value_out != nullptr ? value_out->mutable_data_ptr() : nullptr;
  job.v_eps = v_eps;
  job.slot_mapping = slot_mapping.const_data_ptr();
  job.key_cache = const_cast<void*>(key_cache.const_data_ptr());
  job.value_cache = const_cast<void*>(value_cache.const_data_ptr());
  job.k_scale = read_scale(k_scale);
  job.v_scale = read_scale(v_scale);
  return job;
}

// The store stage of the variant that serves, for key's dtype and the caches' format.
inline TokenHookFn cache_store_kernel(const CacheGeometry& cg, ScalarType key_dtype) {
  return selected_cpu_kernels()->store[dt_index(key_dtype)][static_cast<int>(cg.format)];
}

}  // namespace
}  // namespace rope
