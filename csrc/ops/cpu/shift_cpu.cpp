// The CPU kernel of rope.shift_kv_cache_ (K-shift, ../shift_geometry.h): for each listed slot
// and key head, the rotary pairs of the cached row re-rotated in place by the unit rotation of
// table row |delta|. Scalar code compiled once (no ISA variants): a K-shift touches a few cache
// rows per evicted or reused token, far from the rotation kernels' hot path.
#include <cstring>
#include <optional>
#include <string>
#include <type_traits>

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include "../shift_checks.h"
#include "convert.h"

namespace rope {
namespace {

// How a cache element is stored.
enum class Stored { kF32, kF64, kF16, kBF16, kFp8 };

template <Stored S>
using acc_of = std::conditional_t<S == Stored::kF64, double, float>;

template <typename T>
T read_as(const char* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

template <typename T>
void write_as(char* p, T v) {
  std::memcpy(p, &v, sizeof(T));
}

// How float8 codes convert: the format, k_scale, and every code dequantized (code * scale),
// filled once per task so that a load is one table read.
struct Quant {
  CacheFormat format = CacheFormat::kSame;
  float scale = 1.0f;
  float decoded[256];

  void fill() {
    for (int code = 0; code < 256; ++code) {
      decoded[code] = fp8_to_float(static_cast<uint8_t>(code), format) * scale;
    }
  }
};

// A cache element in the arithmetic type; float8 codes are dequantized.
template <Stored S>
acc_of<S> load_elem(const char* p, const Quant& q) {
  if constexpr (S == Stored::kF32) return read_as<float>(p);
  if constexpr (S == Stored::kF64) return read_as<double>(p);
  if constexpr (S == Stored::kF16) return half_bits_to_float(read_as<uint16_t>(p));
  if constexpr (S == Stored::kBF16) return bf16_to_float(read_as<uint16_t>(p));
  if constexpr (S == Stored::kFp8) return q.decoded[read_as<uint8_t>(p)];
}

// And back: rounded to nearest even; float8 requantized (value / scale, saturated).
template <Stored S>
void store_elem(char* p, acc_of<S> v, const Quant& q) {
  if constexpr (S == Stored::kF32 || S == Stored::kF64) write_as(p, v);
  if constexpr (S == Stored::kF16) write_as(p, float_to_half_bits(v));
  if constexpr (S == Stored::kBF16) write_as(p, float_to_bf16(v));
  if constexpr (S == Stored::kFp8) {
    const Fp8Format fmt = q.format == CacheFormat::kE4M3FN ? Fp8Format::kE4M3FN : Fp8Format::kE5M2;
    write_as(p, float_to_fp8(v / q.scale, fmt));
  }
}

template <Stored S>
constexpr int64_t elem_bytes() {
  return S == Stored::kF64 ? 8 : (S == Stored::kF32 ? 4 : (S == Stored::kFp8 ? 1 : 2));
}

// One table element in the arithmetic type (converted on load, as the rotation kernels do).
template <typename acc_t>
acc_t table_elem(const char* base, ScalarType t, int64_t offset) {
  switch (t) {
    case ScalarType::Float:
      return static_cast<acc_t>(reinterpret_cast<const float*>(base)[offset]);
    case ScalarType::Double:
      return static_cast<acc_t>(reinterpret_cast<const double*>(base)[offset]);
    case ScalarType::Half:
      return static_cast<acc_t>(half_bits_to_float(reinterpret_cast<const uint16_t*>(base)[offset]));
    default:
      return static_cast<acc_t>(bf16_to_float(reinterpret_cast<const uint16_t*>(base)[offset]));
  }
}

struct ShiftJob {
  const ShiftDesc* d;
  char* cache;
  int64_t es;  // bytes per cache element
  const void* slots;
  const void* delta;
  const char* table;
  ScalarType table_type;
  float scale;
};

// Rows of at most this many pairs keep their unit rotation in a stack buffer, reused by every
// head and by the next slots while their delta is the same (one delta for every slot: computed
// once per task). Longer rows compute it pair by pair.
constexpr int64_t kRowPairs = 512;

// One head's row. The layout and a unit stride are template parameters: the common rows
// (contiguous, either layout) get a loop the compiler can vectorize.
template <Stored S, bool kInterleaved, bool kUnit>
void rotate_row_impl(const ShiftDesc& d, char* row, int64_t es, const acc_of<S>* c,
                     const acc_of<S>* s, const Quant& q) {
  using acc_t = acc_of<S>;
  const int64_t last = kUnit ? 1 : d.kc.last;
  if constexpr (kUnit) es = elem_bytes<S>();  // a constant: the addresses are plain indexing
  for (int64_t j = 0; j < d.half; ++j) {
    const int64_t ea = kInterleaved ? 2 * j : j, eb = kInterleaved ? 2 * j + 1 : d.half + j;
    char* const pa = row + ea * last * es;
    char* const pb = row + eb * last * es;
    acc_t ra, rb;
    rotate_pair<acc_t>(load_elem<S>(pa, q), load_elem<S>(pb, q), c[j],
                       s[j], ra, rb);
    store_elem<S>(pa, ra, q);
    store_elem<S>(pb, rb, q);
  }
}

template <Stored S>
void rotate_row(const ShiftDesc& d, char* row, int64_t es, const acc_of<S>* c,
                const acc_of<S>* s, const Quant& q) {
  if (d.kc.last == 1) {
    d.interleaved ? rotate_row_impl<S, true, true>(d, row, es, c, s, q)
                  : rotate_row_impl<S, false, true>(d, row, es, c, s, q);
  } else {
    d.interleaved ? rotate_row_impl<S, true, false>(d, row, es, c, s, q)
                  : rotate_row_impl<S, false, false>(d, row, es, c, s, q);
  }
}

template <Stored S>
void shift_entries(const ShiftJob& job, int64_t begin, int64_t end) {
  using acc_t = acc_of<S>;
  const ShiftDesc& d = *job.d;
  const int64_t es = job.es;
  Quant q;
  q.format = d.format;
  q.scale = job.scale;
  if constexpr (S == Stored::kFp8) q.fill();
  const bool buffered = d.half <= kRowPairs;
  acc_t c_buf[kRowPairs], s_buf[kRowPairs];
  int64_t cached = 0;
  bool have = false;
  for (int64_t i = begin; i < end; ++i) {
    const int64_t slot = read_index(job.slots, d.slots64, i * d.slot_stride);
    if (slot < 0) continue;
    const int64_t k = read_index(job.delta, d.delta64, i * d.delta_stride);
    const int64_t row = k < 0 ? -k : k;  // |k| < max_position: checked
    char* const base = job.cache + d.kc.slot_row(slot, d.block_size) * es;
    if (buffered) {
      if (!have || k != cached) {
        for (int64_t j = 0; j < d.half; ++j) {
          c_buf[j] = table_elem<acc_t>(job.table, job.table_type, row * d.cos_row + j * d.cos_col);
          s_buf[j] = table_elem<acc_t>(job.table, job.table_type,
                                       row * d.cos_row + (d.half + j) * d.cos_col);
        }
        // Separate from the loads (a switch on the table dtype), so that it vectorizes.
        const bool negative = k < 0;
        for (int64_t j = 0; j < d.half; ++j) {
          unit_rotation(c_buf[j], s_buf[j], negative, c_buf[j], s_buf[j]);
        }
        cached = k;
        have = true;
      }
      for (int64_t h = 0; h < d.heads; ++h) {
        rotate_row<S>(d, base + h * d.kc.head * es, es, c_buf, s_buf, q);
      }
      continue;
    }
    for (int64_t j = 0; j < d.half; ++j) {  // long rows: the rotation pair by pair
      acc_t c, s;
      unit_rotation(table_elem<acc_t>(job.table, job.table_type, row * d.cos_row + j * d.cos_col),
                    table_elem<acc_t>(job.table, job.table_type,
                                      row * d.cos_row + (d.half + j) * d.cos_col),
                    k < 0, c, s);
      const int64_t ea = d.interleaved ? 2 * j : j, eb = d.interleaved ? 2 * j + 1 : d.half + j;
      for (int64_t h = 0; h < d.heads; ++h) {
        char* const pa = base + (h * d.kc.head + ea * d.kc.last) * es;
        char* const pb = base + (h * d.kc.head + eb * d.kc.last) * es;
        acc_t ra, rb;
        rotate_pair<acc_t>(load_elem<S>(pa, q),
                           load_elem<S>(pb, q), c, s, ra, rb);
        store_elem<S>(pa, ra, q);
        store_elem<S>(pb, rb, q);
      }
    }
  }
}

// Entries per task: decode-sized calls (a few slots) run on the calling thread.
constexpr int64_t kGrainPairs = 1 << 14;

template <Stored S>
void run(const ShiftJob& job) {
  const ShiftDesc& d = *job.d;
  int64_t per_entry;
  if (!mul_fits(d.heads, d.half, per_entry)) per_entry = kInt64Max;
  const int64_t grain = std::max<int64_t>(1, kGrainPairs / std::max<int64_t>(1, per_entry));
  auto fn = [&](int64_t b, int64_t e) { shift_entries<S>(job, b, e); };
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
  check_shift_data(d, slot_mapping.const_data_ptr(), delta.const_data_ptr(), scale);
  if (d.n == 0 || d.heads == 0 || d.half == 0) return;  // nothing rotates (data may be null)
  ShiftJob job{&d,
               static_cast<char*>(key_cache.mutable_data_ptr()),
               static_cast<int64_t>(key_cache.element_size()),
               slot_mapping.const_data_ptr(),
               delta.const_data_ptr(),
               static_cast<const char*>(cos_sin_cache.const_data_ptr()),
               cos_sin_cache.scalar_type(),
               fp8 ? *scale : 1.0f};
  switch (fp8 ? ScalarType::Byte : key_cache.scalar_type()) {
    case ScalarType::Byte:
      return run<Stored::kFp8>(job);
    case ScalarType::Float:
      return run<Stored::kF32>(job);
    case ScalarType::Double:
      return run<Stored::kF64>(job);
    case ScalarType::Half:
      return run<Stored::kF16>(job);
    default:
      return run<Stored::kBF16>(job);
  }
}

}  // namespace
}  // namespace rope

STABLE_TORCH_LIBRARY_IMPL(rope, CPU, m) {
  m.impl("shift_kv_cache_", TORCH_BOX(&rope::shift_kv_cache_cpu));
}
