// Runs of float8 codes to floats and floats to codes, with the scale, written for the vector
// unit of the including ISA file: ROPE_FP8_AVX512 (AVX-512 F/BW + F16C) or ROPE_FP8_AVX2
// (AVX2 + F16C); without either, the branch-free lane functions in a loop the compiler
// vectorizes. Every path gives the bits of fp8_to_float and float_to_fp8 (../../rope_math.h,
// kv_shift/geometry.h): tests/cpp/fp8_codes.cpp runs each compiled one over all 2^32 floats and
// all 256 codes.
//
// Why not the lane functions everywhere: their auto-vectorized form widens codes to 32-bit
// lanes and narrows them back through memory, about 100 instructions per 64 codes each way,
// which made a float8 K-shift 2 cycles per element. Here a code decodes in 16-bit lanes to a
// half whose value is the code's times a power of two, exact for every code (e4m3: its bits
// shifted by 7 are a half of 2^-8 times its value, subnormals included; e5m2: its bits are a
// half's top byte), so one F16C conversion and one multiply by that power times the scale give
// code * scale rounded once, as the lane function's float times the scale does. Encoding keeps
// the lane function's arithmetic and narrows 32-bit lanes to bytes in registers.

#if defined(ROPE_FP8_AVX512) || defined(ROPE_FP8_AVX2)
#include <immintrin.h>
#endif

namespace rope {
namespace {

// The half bits of a code's NaN as the lane decoders give it: the quiet NaN of its sign.
constexpr uint16_t kHalfQuietNaN = 0x7E00;

// The factor a decoded half is multiplied by: the scale, times 2^8 for e4m3 (its half is the
// value times 2^-8). Exact: a power of two times a positive float, unless it overflows (a scale
// above 2^120: fp8_decode_run then takes the lane functions).
template <CacheFormat kFormat>
float fp8_half_factor(float scale) {
  return kFormat == CacheFormat::kE4M3FN ? scale * 256.0f : scale;
}

#if defined(ROPE_FP8_AVX512)

// 32 codes as halves (see above); NaN codes become the quiet NaN of their sign.
template <CacheFormat kFormat>
ROPE_INLINE __m512i fp8_halves32(const uint8_t* in) {
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in));
  __m512i h;
  __mmask32 nan;
  const __m512i magnitude = _mm512_set1_epi16(0x7FFF);
  if (kFormat == CacheFormat::kE4M3FN) {
    // Sign-extended, shifted by 7: the sign lands on bits 15 and 14; bit 14 cleared.
    h = _mm512_and_si512(_mm512_slli_epi16(_mm512_cvtepi8_epi16(b), 7),
                         _mm512_set1_epi16(static_cast<int16_t>(0xBF80)));
    nan = _mm512_cmpeq_epi16_mask(_mm512_and_si512(h, magnitude), _mm512_set1_epi16(0x3F80));
  } else {
    h = _mm512_slli_epi16(_mm512_cvtepu8_epi16(b), 8);
    nan = _mm512_cmpgt_epu16_mask(_mm512_and_si512(h, magnitude), _mm512_set1_epi16(0x7C00));
  }
  // (h & 0x8000) | 0x7E00
  const __m512i quiet = _mm512_ternarylogic_epi32(
      h, _mm512_set1_epi16(static_cast<int16_t>(0x8000)), _mm512_set1_epi16(kHalfQuietNaN), 0xEA);
  return _mm512_mask_mov_epi16(h, nan, quiet);
}

// Codes per step of fp8_decode_vec, floats per step of fp8_encode_vec: n is a multiple.
constexpr int64_t kFp8DecodeStep = 32, kFp8EncodeStep = 16;

template <CacheFormat kFormat>
ROPE_INLINE void fp8_decode_vec(const uint8_t* in, int64_t n, float* out, float scale) {
  const __m512 f = _mm512_set1_ps(fp8_half_factor<kFormat>(scale));
  for (int64_t j = 0; j < n; j += 32) {
    const __m512i h = fp8_halves32<kFormat>(in + j);
    _mm512_storeu_ps(out + j, _mm512_mul_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(h)), f));
    _mm512_storeu_ps(out + j + 16,
                     _mm512_mul_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1)), f));
  }
}

// float_to_fp8_lanes on 16 floats (x / scale or x * scale first), in 32-bit lanes.
template <Fp8Format kFmt, bool kDivide>
ROPE_INLINE __m512i fp8_code_lanes16(__m512 x, __m512 scale) {
  constexpr bool kE4M3 = kFmt == Fp8Format::kE4M3FN;
  constexpr int kMant = kE4M3 ? 3 : 2, kBias = kE4M3 ? 7 : 15;
  const __m512 v = kDivide ? _mm512_div_ps(x, scale) : _mm512_mul_ps(x, scale);
  const __m512i u = _mm512_castps_si512(v);
  __m512i a = _mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF));
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(a, _mm512_set1_epi32(0x7F800000));
  const int32_t max_bits = static_cast<int32_t>(float_bits(kE4M3 ? 448.0f : 57344.0f));
  a = _mm512_min_epu32(a, _mm512_set1_epi32(max_bits));
  const __m512i e = _mm512_and_si512(a, _mm512_set1_epi32(0x7F800000));
  const __m512i min_normal = _mm512_set1_epi32((127 + 1 - kBias) << 23);
  const __m512i c = _mm512_add_epi32(_mm512_max_epu32(e, min_normal),
                                     _mm512_set1_epi32((23 - kMant) << 23));
  const __m512i sum =
      _mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(c)));
  __m512i code = _mm512_add_epi32(_mm512_srli_epi32(c, 23 - kMant), _mm512_sub_epi32(sum, c));
  code = _mm512_sub_epi32(code, _mm512_set1_epi32((151 - kMant - kBias) << kMant));
  code = _mm512_mask_mov_epi32(code, nan, _mm512_set1_epi32(0x7F));
  // code | ((u >> 24) & 0x80)
  return _mm512_ternarylogic_epi32(code, _mm512_srli_epi32(u, 24), _mm512_set1_epi32(0x80), 0xF8);
}

template <Fp8Format kFmt, bool kDivide>
ROPE_INLINE void fp8_encode_vec(const float* in, int64_t n, uint8_t* out, float scale) {
  const __m512 s = _mm512_set1_ps(scale);
  // Two packs put 64 codes in 32-bit groups ordered (group of 4 codes, vector) per 128-bit
  // lane: one permutation (a 4 x 4 transpose of groups) restores them (a narrowing per vector
  // costs 2 instructions per 16 codes; the packs and permutation 3 per 64).
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  int64_t j = 0;
  for (; j + 64 <= n; j += 64) {
    const __m512i c0 = fp8_code_lanes16<kFmt, kDivide>(_mm512_loadu_ps(in + j), s);
    const __m512i c1 = fp8_code_lanes16<kFmt, kDivide>(_mm512_loadu_ps(in + j + 16), s);
    const __m512i c2 = fp8_code_lanes16<kFmt, kDivide>(_mm512_loadu_ps(in + j + 32), s);
    const __m512i c3 = fp8_code_lanes16<kFmt, kDivide>(_mm512_loadu_ps(in + j + 48), s);
    const __m512i bytes =
        _mm512_packus_epi16(_mm512_packus_epi32(c0, c1), _mm512_packus_epi32(c2, c3));
    _mm512_storeu_si512(out + j, _mm512_permutexvar_epi32(order, bytes));
  }
  for (; j < n; j += 16) {
    const __m512i c = fp8_code_lanes16<kFmt, kDivide>(_mm512_loadu_ps(in + j), s);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + j), _mm512_cvtepi32_epi8(c));
  }
}

#elif defined(ROPE_FP8_AVX2)

template <CacheFormat kFormat>
ROPE_INLINE __m256i fp8_halves16(const uint8_t* in) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in));
  __m256i h, nan;
  const __m256i magnitude = _mm256_set1_epi16(0x7FFF);
  if (kFormat == CacheFormat::kE4M3FN) {
    h = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(b), 7),
                         _mm256_set1_epi16(static_cast<int16_t>(0xBF80)));
    nan = _mm256_cmpeq_epi16(_mm256_and_si256(h, magnitude), _mm256_set1_epi16(0x3F80));
  } else {
    h = _mm256_slli_epi16(_mm256_cvtepu8_epi16(b), 8);
    // Signed compare: both sides are below 0x8000.
    nan = _mm256_cmpgt_epi16(_mm256_and_si256(h, magnitude), _mm256_set1_epi16(0x7C00));
  }
  const __m256i quiet = _mm256_or_si256(
      _mm256_and_si256(h, _mm256_set1_epi16(static_cast<int16_t>(0x8000))),
      _mm256_set1_epi16(kHalfQuietNaN));
  return _mm256_blendv_epi8(h, quiet, nan);
}

constexpr int64_t kFp8DecodeStep = 16, kFp8EncodeStep = 8;

template <CacheFormat kFormat>
ROPE_INLINE void fp8_decode_vec(const uint8_t* in, int64_t n, float* out, float scale) {
  const __m256 f = _mm256_set1_ps(fp8_half_factor<kFormat>(scale));
  for (int64_t j = 0; j < n; j += 16) {
    const __m256i h = fp8_halves16<kFormat>(in + j);
    _mm256_storeu_ps(out + j, _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(h)), f));
    _mm256_storeu_ps(out + j + 8,
                     _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)), f));
  }
}

// float_to_fp8_lanes on 8 floats, in 32-bit lanes (narrowed by the caller).
template <Fp8Format kFmt, bool kDivide>
ROPE_INLINE __m256i fp8_code_lanes8(__m256 x, __m256 scale) {
  constexpr bool kE4M3 = kFmt == Fp8Format::kE4M3FN;
  constexpr int kMant = kE4M3 ? 3 : 2, kBias = kE4M3 ? 7 : 15;
  const __m256 v = kDivide ? _mm256_div_ps(x, scale) : _mm256_mul_ps(x, scale);
  const __m256i u = _mm256_castps_si256(v);
  __m256i a = _mm256_and_si256(u, _mm256_set1_epi32(0x7FFFFFFF));
  // Signed compare: both sides are non-negative.
  const __m256i nan = _mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x7F800000));
  const int32_t max_bits = static_cast<int32_t>(float_bits(kE4M3 ? 448.0f : 57344.0f));
  a = _mm256_min_epu32(a, _mm256_set1_epi32(max_bits));
  const __m256i e = _mm256_and_si256(a, _mm256_set1_epi32(0x7F800000));
  const __m256i min_normal = _mm256_set1_epi32((127 + 1 - kBias) << 23);
  const __m256i c = _mm256_add_epi32(_mm256_max_epu32(e, min_normal),
                                     _mm256_set1_epi32((23 - kMant) << 23));
  const __m256i sum =
      _mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(a), _mm256_castsi256_ps(c)));
  __m256i code = _mm256_add_epi32(_mm256_srli_epi32(c, 23 - kMant), _mm256_sub_epi32(sum, c));
  code = _mm256_sub_epi32(code, _mm256_set1_epi32((151 - kMant - kBias) << kMant));
  code = _mm256_blendv_epi8(code, _mm256_set1_epi32(0x7F), nan);
  return _mm256_or_si256(code, _mm256_and_si256(_mm256_srli_epi32(u, 24), _mm256_set1_epi32(0x80)));
}

template <Fp8Format kFmt, bool kDivide>
ROPE_INLINE void fp8_encode_vec(const float* in, int64_t n, uint8_t* out, float scale) {
  const __m256 s = _mm256_set1_ps(scale);
  // Two packs put 32 codes in lane order 0-3, 8-11, 16-19, 24-27 | 4-7, 12-15, ...: one
  // permutation of 32-bit groups restores it.
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  int64_t j = 0;
  for (; j + 32 <= n; j += 32) {
    const __m256i c0 = fp8_code_lanes8<kFmt, kDivide>(_mm256_loadu_ps(in + j), s);
    const __m256i c1 = fp8_code_lanes8<kFmt, kDivide>(_mm256_loadu_ps(in + j + 8), s);
    const __m256i c2 = fp8_code_lanes8<kFmt, kDivide>(_mm256_loadu_ps(in + j + 16), s);
    const __m256i c3 = fp8_code_lanes8<kFmt, kDivide>(_mm256_loadu_ps(in + j + 24), s);
    const __m256i bytes =
        _mm256_packus_epi16(_mm256_packus_epi32(c0, c1), _mm256_packus_epi32(c2, c3));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + j),
                        _mm256_permutevar8x32_epi32(bytes, order));
  }
  for (; j < n; j += 8) {
    const __m256i c = fp8_code_lanes8<kFmt, kDivide>(_mm256_loadu_ps(in + j), s);
    const __m128i words =
        _mm_packus_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(out + j), _mm_packus_epi16(words, words));
  }
}

#else

// No vector unit of our own: every element goes to the loops below.
constexpr int64_t kFp8DecodeStep = 1 << 30, kFp8EncodeStep = 1 << 30;

template <CacheFormat kFormat>
void fp8_decode_vec(const uint8_t*, int64_t, float*, float) {}

template <Fp8Format kFmt, bool kDivide>
void fp8_encode_vec(const float*, int64_t, uint8_t*, float) {}

#endif

// n codes to floats (code * scale), the same bits as fp8_to_float(code) * scale. Not inlined:
// one copy per format (inlined into each row loop of each dtype and layout, the runs took
// 0.7 MB of the CPU library); a call costs a few cycles of a 128-code row.
template <CacheFormat kFormat>
__attribute__((noinline)) void fp8_decode_run(const uint8_t* in, int64_t n, float* out,
                                              float scale) {
  int64_t j = fp8_half_factor<kFormat>(scale) <= 3.40282347e+38f ? n - n % kFp8DecodeStep : 0;
  fp8_decode_vec<kFormat>(in, j, out, scale);
  for (; j < n; ++j) out[j] = fp8_to_float_lanes<kFormat>(in[j]) * scale;
}

// n floats to codes of x / scale (kDivide) or x * scale in format fmt, the same bits as
// float_to_fp8. The format is a value, so the kernels that write float8 rows are compiled once
// for both formats (a copy per format made them about 1 MB of the CPU library). Only the vector
// loop is compiled per format, its constants in its instructions: held in registers instead,
// they pushed the loop's temporaries to the stack.
template <bool kDivide>
ROPE_INLINE void fp8_encode_run_as(const float* in, int64_t n, uint8_t* out, float scale,
                                   Fp8Format fmt) {
  int64_t j = n - n % kFp8EncodeStep;
  fmt == Fp8Format::kE4M3FN ? fp8_encode_vec<Fp8Format::kE4M3FN, kDivide>(in, j, out, scale)
                            : fp8_encode_vec<Fp8Format::kE5M2, kDivide>(in, j, out, scale);
  if (j == n) return;
  // The rest (all of it without a vector unit above): in 32-bit lanes a block at a time, then
  // narrowed in a loop of their own (narrowing inside the conversion has the compiler pack
  // every intermediate mask down to bytes).
  const Fp8LaneConsts k = fp8_lane_consts(fmt);
  constexpr int64_t kBlock = 64;
  alignas(64) uint32_t code[kBlock];
  for (; j < n; j += kBlock) {
    const int64_t m = std::min(kBlock, n - j);
    for (int64_t i = 0; i < m; ++i) {
      code[i] = float_to_fp8_lanes(kDivide ? in[j + i] / scale : in[j + i] * scale, k);
    }
    for (int64_t i = 0; i < m; ++i) out[j + i] = static_cast<uint8_t>(code[i]);
  }
}

// Floats stored as the codes (format fmt) of x * factor, or of x / factor (divide: a KV
// cache's scale, which torch divides by).
struct Fp8Encoder {
  float factor = 1.0f;
  bool divide = false;
  Fp8Format fmt = Fp8Format::kE4M3FN;
};

// The codes of x / scale. Where 1 / scale is exact (scale a power of two: a KV cache's scale of
// 1 most of all), x * (1 / scale) is the same real number as x / scale, rounded once either way,
// and a multiplication costs a fraction of a division (a fifth of a float8 K-shift). Checked in
// double, where the product of two floats is exact; a subnormal reciprocal is left alone (a
// flush-to-zero mode would read it as 0).
inline Fp8Encoder dividing_encoder(float scale, Fp8Format fmt) {
  const float r = 1.0f / scale;
  const bool exact = r >= 1.17549435e-38f && r <= 3.40282347e+38f &&
                     static_cast<double>(r) * static_cast<double>(scale) == 1.0;
  return exact ? Fp8Encoder{r, false, fmt} : Fp8Encoder{scale, true, fmt};
}

// The division's run out of line (one copy; its division costs more than the call), the
// multiplication's inlined into the row loops (RoPE + FP8 quantization's rows of 32-512 codes
// run 3-10% slower through a call).
__attribute__((noinline)) void fp8_encode_run_dividing(const float* in, int64_t n, uint8_t* out,
                                                       float scale, Fp8Format fmt) {
  fp8_encode_run_as<true>(in, n, out, scale, fmt);
}

ROPE_INLINE void fp8_encode_run(const float* in, int64_t n, uint8_t* out, const Fp8Encoder& enc) {
  if (enc.divide) return fp8_encode_run_dividing(in, n, out, enc.factor, enc.fmt);
  fp8_encode_run_as<false>(in, n, out, enc.factor, enc.fmt);
}

}  // namespace
}  // namespace rope
