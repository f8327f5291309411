// The CPU kernels compiled for AVX2 + FMA + F16C (Haswell and later, Zen): 8 float lanes. Chosen
// at run time only on CPUs that have all three; the rest of the library stays baseline x86-64.
#include "convert.h"
#include "kernel_api.h"

// Everything with external linkage is included above this line, before the target switch.
#if defined(ROPE_CPU_X86_VARIANTS) && ROPE_CPU_MAX_ISA >= 1

#define ROPE_ISA_TARGET "avx2,fma,f16c"
#include "isa_target_begin.h"

#include <immintrin.h>

#include "avx2_bf16.h"
// The norm kernels round bfloat16 rows with avx2_bf16.h too (qk_norm/cpu/kernels.h).
#define ROPE_AVX2_BF16 1

namespace rope {
namespace {

struct F32Ops {
  using acc = float;
  using V = __m256;
  static constexpr int W = 8;

  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V load(const HalfBits* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static V load(const BF16Bits* p) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }

  static __m128i to_half(V v) { return _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT); }
  static __m128i to_bf16(V v) {
    const __m256i r = _mm256_srli_epi32(bf16_round_hi(v), 16);
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  }

  // bfloat16 rows as even and odd lanes (kernels.h kBf16Pairs, kHalfSplitEvenOdd): 16 values
  // are one load, their even elements widen with a shift and the odd ones with a mask, and two
  // results go back in order with one word blend, where widening and packing in order take
  // lane-crossing shuffles. Measured on a Zen 2 core: 0.71 of the time per bfloat16 row.
  static constexpr bool kBf16Pairs = true;
  static constexpr bool kHalfSplitEvenOdd = true;
  struct NanAcc {};  // bf16_round_hi fixes NaN codes per vector: nothing is left to fix afterwards
  static NanAcc nan_acc_init() { return {}; }
  static NanAcc nan_acc(NanAcc acc, __m256i) { return acc; }
  static constexpr bool nan_any(NanAcc) { return false; }
  static void load_even_odd(const BF16Bits* p, V& even, V& odd) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
    odd = _mm256_castsi256_ps(_mm256_and_si256(v, high));
  }
  // 16 table values as their 8 even and 8 odd elements, in float (tables of kHalfSplitEvenOdd
  // rows): bfloat16 as load_even_odd, the others loaded in order, then split within each 128-bit
  // lane and the lanes' 64-bit halves put back in order.
  template <typename T>
  static void split_even_odd(const T* p, V& even, V& odd) {
    const V lo = load(p), hi = load(p + W);
    even = halves_in_order(_mm256_shuffle_ps(lo, hi, 0x88));
    odd = halves_in_order(_mm256_shuffle_ps(lo, hi, 0xDD));
  }
  static V halves_in_order(V v) {  // 64-bit quarters 0, 2, 1, 3
    return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(v), 0xD8));
  }
  static void split_even_odd(const BF16Bits* p, V& even, V& odd) { load_even_odd(p, even, odd); }
  // The inverse of load_even_odd: word 2j is even's lane j, word 2j + 1 odd's.
  static __m256i join_even_odd_raw(V even, V odd) {
    return _mm256_blend_epi16(_mm256_srli_epi32(bf16_round_hi(even), 16), bf16_round_hi(odd), 0xAA);
  }
  // 16 bfloat16 to p: streamed when asked and p is 32-byte aligned, else a plain store.
  static void write_bf16x2w(BF16Bits* p, __m256i v, bool stream) {
    if (stream && (reinterpret_cast<uintptr_t>(p) & 31) == 0) {
      _mm256_stream_si256(reinterpret_cast<__m256i*>(p), v);
    } else {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v);
    }
  }

  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static void store(HalfBits* p, V v) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), to_half(v));
  }
  static void store(BF16Bits* p, V v) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), to_bf16(v));
  }
  static void store_nt(float* p, V v) { _mm256_stream_ps(p, v); }
  static void store_nt(HalfBits* p, V v) {
    _mm_stream_si128(reinterpret_cast<__m128i*>(p), to_half(v));
  }
  static void store_nt(BF16Bits* p, V v) {
    _mm_stream_si128(reinterpret_cast<__m128i*>(p), to_bf16(v));
  }

  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V swap_pairs(V v) { return _mm256_permute_ps(v, 0xB1); }

  static float half_to_float(uint16_t h) { return _cvtsh_ss(h); }
  static uint16_t float_to_half(float f) { return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT); }
};

struct F64Ops {
  using acc = double;
  using V = __m256d;
  static constexpr int W = 4;

  static V load(const double* p) { return _mm256_loadu_pd(p); }
  static void store(double* p, V v) { _mm256_storeu_pd(p, v); }
  static void store_nt(double* p, V v) { _mm256_stream_pd(p, v); }
  static V mul(V a, V b) { return _mm256_mul_pd(a, b); }
  static V add(V a, V b) { return _mm256_add_pd(a, b); }
  static V sub(V a, V b) { return _mm256_sub_pd(a, b); }
  static V swap_pairs(V v) { return _mm256_permute_pd(v, 0x5); }
};

void store_fence() { _mm_sfence(); }

}  // namespace
}  // namespace rope

#define ROPE_FP8_AVX2 1  // fp8_vec.h
#include "kernels.h"

#include "isa_target_end.h"

ROPE_DEFINE_CPU_KERNELS(cpu_kernels_avx2)
#elif defined(ROPE_CPU_X86_VARIANTS)
ROPE_DEFINE_NO_CPU_KERNELS(cpu_kernels_avx2)
#endif
