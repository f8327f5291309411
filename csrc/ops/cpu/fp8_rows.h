// Float8 rows in the CPU kernel family (included by kernels.h, compiled once per ISA): elements
// read into float blocks and float blocks written as float8 codes, and a row's rotary pairs
// taken through both with the family's rotate_block in between. The conversions are the ISA's
// (fp8_vec.h). Used by the paged cache store (kernels.h), the K-shift of float8 caches
// (kv_shift/cpu/kernels.h) and RoPE + FP8 quantization (quant/cpu/kernels.h).

#include "fp8_vec.h"

namespace rope {
namespace {

// Codes of a format read back as code * scale (floats are stored through an Fp8Encoder,
// fp8_vec.h). A value, like the encoder's format: one kernel serves both formats.
struct Fp8Decoder {
  float scale = 1.0f;
  CacheFormat format = CacheFormat::kE4M3FN;
};

// n elements of a row (stride `last`) as floats, each through to_float.
template <typename T, typename F>
ROPE_INLINE void floats_of(const T* row, int64_t last, int64_t n, float* out, F&& to_float) {
  if (last == 1) {
    for (int64_t e = 0; e < n; ++e) out[e] = to_float(row[e]);
  } else {
    for (int64_t e = 0; e < n; ++e) out[e] = to_float(row[e * last]);
  }
}

// n codes of a row (stride `last`) decoded (fp8_vec.h for a unit stride).
template <CacheFormat kFormat>
void strided_floats_of(const uint8_t* row, int64_t last, int64_t n, float* out, float scale) {
  for (int64_t e = 0; e < n; ++e) out[e] = fp8_to_float_lanes<kFormat>(row[e * last]) * scale;
}

ROPE_INLINE void floats_of(const uint8_t* row, int64_t last, int64_t n, float* out,
                           Fp8Decoder d) {
  const bool e4m3 = d.format == CacheFormat::kE4M3FN;
  if (last == 1) {
    e4m3 ? fp8_decode_run<CacheFormat::kE4M3FN>(row, n, out, d.scale)
         : fp8_decode_run<CacheFormat::kE5M2>(row, n, out, d.scale);
  } else {
    e4m3 ? strided_floats_of<CacheFormat::kE4M3FN>(row, last, n, out, d.scale)
         : strided_floats_of<CacheFormat::kE5M2>(row, last, n, out, d.scale);
  }
}

// n elements of a row (stride `last`; float, half or bfloat16) written to `out` (stride
// out_last) as codes (fp8_vec.h): float rows of unit strides directly, the rest through a float
// block.
template <typename T>
ROPE_INLINE void codes_of(const T* row, int64_t last, int64_t n, uint8_t* out, int64_t out_last,
                          const Fp8Encoder& enc) {
  if constexpr (std::is_same_v<T, float>) {
    if (last == 1 && out_last == 1) return fp8_encode_run(row, n, out, enc);
  }
  constexpr int64_t kBlock = 256;
  alignas(64) float block[kBlock];
  alignas(64) uint8_t code[kBlock];
  for (int64_t j0 = 0; j0 < n; j0 += kBlock) {
    const int64_t m = std::min(kBlock, n - j0);
    floats_of(row + j0 * last, last, m, block,
              [](T v) { return static_cast<float>(to_acc<F32Ops>(v)); });
    if (out_last == 1) {
      fp8_encode_run(block, m, out + j0, enc);
    } else {
      fp8_encode_run(block, m, code, enc);
      for (int64_t j = 0; j < m; ++j) out[(j0 + j) * out_last] = code[j];
    }
  }
}

// The elements of pairs [b0, b0 + n) of a row as at most two contiguous runs of the row (in
// element index): pairs in order (interleaved) or the first members then the second.
struct PairSpans {
  int64_t start[2], count[2];
  int spans;
};

template <bool kInterleaved>
PairSpans pair_spans(int64_t half, int64_t b0, int64_t n) {
  if (kInterleaved) return PairSpans{{2 * b0, 0}, {2 * n, 0}, 1};
  return PairSpans{{b0, half + b0}, {n, n}, 2};
}

// Pairs [b0, b0 + n) of row `src` (stride s_last) read as floats through to_float, rotated by
// (c, s) (laid out as kTableLayout<F32Ops, float, kInterleaved>), written to row `dst` (stride
// d_last; may be src) as codes.
template <bool kInterleaved, typename T, typename F>
ROPE_INLINE void rotate_to_codes(const T* src, int64_t s_last, uint8_t* dst, int64_t d_last,
                                 int64_t half, int64_t b0, int64_t n, const float* c,
                                 const float* s, F&& to_float, const Fp8Encoder& enc) {
  alignas(64) float buf[2 * kBlockPairs];
  const PairSpans sp = pair_spans<kInterleaved>(half, b0, n);
  for (int i = 0, k = 0; i < sp.spans; k += sp.count[i], ++i) {
    floats_of(src + sp.start[i] * s_last, s_last, sp.count[i], buf + k, to_float);
  }
  rotate_block<F32Ops, kInterleaved, false>(buf, buf, n, n, c, s);
  for (int i = 0, k = 0; i < sp.spans; k += sp.count[i], ++i) {
    codes_of(buf + k, int64_t{1}, sp.count[i], dst + sp.start[i] * d_last, d_last, enc);
  }
}

constexpr Fp8Format fp8_format(CacheFormat f) {
  return f == CacheFormat::kE4M3FN ? Fp8Format::kE4M3FN : Fp8Format::kE5M2;
}

// A float8 cache's conversions (kv_cache_dtype "fp8*"): a value stored as saturated
// value / scale, a code read back as code * scale.
inline Fp8Encoder cache_encoder(float scale, CacheFormat format) {
  return dividing_encoder(scale, fp8_format(format));
}

inline Fp8Decoder cache_decoder(float scale, CacheFormat format) { return {scale, format}; }

}  // namespace
}  // namespace rope
