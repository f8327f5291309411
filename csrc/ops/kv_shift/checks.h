// Checks of rope.shift_kv_cache_: the argument metadata first, then the data (slots, deltas,
// duplicates), all before anything is written. Header-only, like checks.h;
// rope_ext/_kv_shift/reference.py mirrors it message for message.
#pragma once

#include <cmath>
#include <limits>
#include <optional>
#include <string>

#include "../checks.h"
#include "geometry.h"

namespace rope {

constexpr const char* kShiftOp = "rope.shift_kv_cache_";

inline CacheFormat shift_cache_format(const std::string& kv_cache_dtype, ScalarType& want) {
  if (kv_cache_dtype == "auto") return CacheFormat::kSame;
  if (kv_cache_dtype == "fp8" || kv_cache_dtype == "fp8_e4m3") {
    want = ScalarType::Float8_e4m3fn;
    return CacheFormat::kE4M3FN;
  }
  if (kv_cache_dtype == "fp8_e5m2") {
    want = ScalarType::Float8_e5m2;
    return CacheFormat::kE5M2;
  }
  fail(kShiftOp, ": kv_cache_dtype must be 'auto', 'fp8', 'fp8_e4m3' or 'fp8_e5m2', got '",
       kv_cache_dtype, "'");
}

// The metadata checks (no data read): dtypes, devices, shapes, memory overlap.
inline ShiftDesc check_shift_kv_cache(const Tensor& key_cache_t, const Tensor& slots_t,
                                      const Tensor& delta_t, const Tensor& table_t,
                                      bool interleaved, const std::string& kv_cache_dtype,
                                      const std::optional<Tensor>& k_scale_t) {
  const char* op = kShiftOp;
  const Meta kc(key_cache_t), sl(slots_t), dl(delta_t), tab(table_t);
  ShiftDesc d;
  ScalarType want = ScalarType::Undefined;
  d.format = shift_cache_format(kv_cache_dtype, want);
  if (d.format == CacheFormat::kSame) {
    ROPE_CHECK(is_float(kc.dtype), op,
               ": key_cache must be float16, bfloat16, float32 or float64 for kv_cache_dtype "
               "'auto', got ", dtype_str(kc.dtype));
  } else {
    ROPE_CHECK(kc.dtype == want, op, ": key_cache must be ", dtype_str(want),
               " for kv_cache_dtype '", kv_cache_dtype, "', got ", dtype_str(kc.dtype));
  }
  ROPE_CHECK(kc.dim == 4, op,
             ": key_cache must have shape (num_blocks, block_size, num_kv_heads, head_dim), got ",
             shape_str(kc));
  ROPE_CHECK(kc.sizes[1] >= 1, op, ": key_cache must have block_size >= 1, got ", shape_str(kc));
  d.heads = kc.sizes[2];
  d.head_dim = kc.sizes[3];

  d.half = check_cos_sin_cache(kc, "key_cache", tab, op, d.head_dim);
  d.rows = tab.sizes[0];
  d.cos_row = tab.strides[0];
  d.cos_col = tab.strides[1];

  check_same_device(kc, "key_cache", sl, op, "slot_mapping");
  ROPE_CHECK(sl.dtype == ScalarType::Long || sl.dtype == ScalarType::Int, op,
             ": slot_mapping must be int32 or int64, got ", dtype_str(sl.dtype));
  ROPE_CHECK(sl.dim == 1, op, ": slot_mapping must have shape (num_slots_shifted,), got ",
             shape_str(sl));
  d.n = sl.sizes[0];
  check_same_device(kc, "key_cache", dl, op, "delta");
  ROPE_CHECK(dl.dtype == ScalarType::Long || dl.dtype == ScalarType::Int, op,
             ": delta must be int32 or int64, got ", dtype_str(dl.dtype));
  ROPE_CHECK(dl.dim == 0 || (dl.dim == 1 && dl.sizes[0] == d.n), op,
             ": delta must have shape () or slot_mapping's (", d.n, ",), got ", shape_str(dl));
  ROPE_CHECK(d.format == CacheFormat::kSame || k_scale_t.has_value(), op,
             ": k_scale is required for kv_cache_dtype '", kv_cache_dtype,
             "' (a float32 tensor of one element)");
  if (k_scale_t.has_value()) {  // checked whenever given, as apply_and_cache_ checks its scales
    const Meta s(*k_scale_t);
    check_same_device(kc, "key_cache", s, op, "k_scale");
    ROPE_CHECK(s.dtype == ScalarType::Float && s.numel == 1, op,
               ": k_scale must be a float32 tensor of one element, got ", dtype_str(s.dtype),
               " of shape ", shape_str(s));
  }

  // Written: key_cache alone. Nothing it reads may share its memory.
  check_no_internal_overlap(kc, op, "key_cache");
  check_disjoint_bytes(kc, "key_cache", sl, "slot_mapping", op);
  check_disjoint_bytes(kc, "key_cache", dl, "delta", op);
  check_disjoint_bytes(kc, "key_cache", tab, "cos_sin_cache", op);
  if (k_scale_t.has_value()) check_disjoint_bytes(kc, "key_cache", Meta(*k_scale_t), "k_scale", op);

  ROPE_CHECK(mul_fits(kc.sizes[0], kc.sizes[1], d.slots), op,
             ": key_cache has 2^63 slots or more");
  d.block_size = kc.sizes[1];
  d.interleaved = interleaved;
  d.kc = CacheStrides{kc.strides[0], kc.strides[1], kc.strides[2], kc.strides[3]};
  d.slots64 = sl.dtype == ScalarType::Long;
  d.slot_stride = sl.dim == 1 ? sl.strides[0] : 0;
  d.delta64 = dl.dtype == ScalarType::Long;
  d.delta_stride = dl.dim == 1 ? dl.strides[0] : 0;
  return d;
}

inline int64_t read_index(const void* base, bool is64, int64_t offset) {
  return is64 ? static_cast<const int64_t*>(base)[offset]
              : static_cast<const int32_t*>(base)[offset];
}

// The data checks, on host memory (CPU tensors, or host copies of CUDA ones), before anything
// is written: a float8 cache's k_scale finite and > 0 (`k_scale`: nullptr otherwise); in index
// order, each listed slot below num_blocks * block_size and its delta in (-max_position,
// max_position); then no slot listed twice (a slot would be rotated twice, and on a GPU by two
// threads at once). Negative slots are skipped, their deltas unread.
// `slots_t`: slot_mapping (a CPU tensor: the op's, or a host copy of a CUDA one).
inline void check_shift_data(const ShiftDesc& d, const Tensor& slots_t, const void* delta,
                             const float* k_scale) {
  const char* op = kShiftOp;
  const void* slots = slots_t.const_data_ptr();
  if (k_scale != nullptr) {
    const float s = *k_scale;
    ROPE_CHECK(s > 0.0f && s <= std::numeric_limits<float>::max(), op,
               ": k_scale must be finite and > 0 (the keys are dequantized, rotated and "
               "requantized with it), got ", s);
    // Every code times k_scale a finite, normal float32: a larger scale turns the largest codes
    // into inf (and inf * 0 in the rotation into NaN), a smaller one rounds the smallest to 0.
    const bool e4m3 = d.format == CacheFormat::kE4M3FN;
    const float max_code = e4m3 ? 448.0f : 57344.0f;
    const int min_exp = e4m3 ? -117 : -110;  // log2(FLT_MIN / the smallest subnormal code)
    ROPE_CHECK(s * max_code <= std::numeric_limits<float>::max() && s >= std::ldexp(1.0f, min_exp),
               op, ": k_scale must lie in [2^", min_exp, ", 3.40282e+38 / ", max_code, "] for a ",
               e4m3 ? "float8_e4m3fn" : "float8_e5m2",
               " cache (every code times it a normal float32), got ", s);
  }
  auto slot_at = [&](int64_t i) { return read_index(slots, d.slots64, i * d.slot_stride); };
  int64_t used = 0;
  for (int64_t i = 0; i < d.n; ++i) {
    const int64_t s = slot_at(i);
    if (s < 0) continue;
    ++used;
    ROPE_CHECK(s < d.slots, op, ": slot_mapping must lie below num_blocks * block_size = ",
               d.slots, " (negative: skipped), got ", s, " at index ", i);
    const int64_t k = read_index(delta, d.delta64, i * d.delta_stride);
    // Both bounds without forming -k or |k| (k may be INT64_MIN).
    ROPE_CHECK(k < d.rows && k > -d.rows, op, ": delta must lie in (-max_position, max_position) = (-",
               d.rows, ", ", d.rows, ") (table row |delta|; max_position = cos_sin_cache.size(0)), "
               "got ", k, " at index ", i);
  }
  const auto [first, repeat] = find_repeated_slot(slot_at, d.n, used, d.slots, slots_t);
  ROPE_CHECK(repeat < 0, op, ": slot_mapping must list each slot at most once (negative: skipped), "
             "got slot ", repeat < 0 ? 0 : slot_at(repeat), " at indices ", first, " and ", repeat);
}

}  // namespace rope
