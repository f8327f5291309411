// AVX-512 vector operations for rope_cpu_simd.h, shared by the avx512 and avx512_bf16 variants
// (the latter defines ROPE_AVX512_BF16 to convert float to bfloat16 in one instruction).
// Included only after a `#pragma GCC target` that enables AVX-512 F/BW/VL/DQ.
#pragma once

#include <immintrin.h>

namespace rope {
namespace {

struct F32Ops {
  using acc = float;
  using V = __m512;
  static constexpr int W = 16;

  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V load(const HalfBits* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static V load(const BF16Bits* p) {
    const __m512i w =
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  }

  static __m256i to_half(V v) {
    return _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
#ifdef ROPE_AVX512_BF16
  // One instruction: round to nearest even, NaN stays NaN. It treats float denormals (below
  // 1.2e-38) as zero, unlike torch's conversion; bf16 keeps 3 significant digits anyway.
  static __m256i to_bf16(V v) { return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)); }
#else
  // Round to nearest even as torch does; NaN to 0x7FC0.
  static __m256i to_bf16(V v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb);
    r = _mm512_srli_epi32(r, 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC0));
    return _mm512_cvtepi32_epi16(r);
  }
#endif

#ifdef ROPE_AVX512_BF16
  // Two float vectors to 32 bfloat16 at once (rope_cpu_simd.h, kBf16Pairs).
  static constexpr bool kBf16Pairs = true;
  // lo = values 0-15, hi = 16-31, stored in order.
  static __m512i to_bf16_pair(V lo, V hi) {
    return reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo));
  }
  // 32 bfloat16 to p: streamed when asked and p is 64-byte aligned, else a plain store.
  static void write_bf16x32(BF16Bits* p, __m512i v, bool stream) {
    if (stream && (reinterpret_cast<uintptr_t>(p) & 63) == 0) {
      _mm512_stream_si512(reinterpret_cast<__m512i*>(p), v);
    } else {
      _mm512_storeu_si512(reinterpret_cast<void*>(p), v);
    }
  }
  // 32 values as their 16 even and 16 odd elements, widened to float with a shift and a mask.
  static void load_even_odd(const BF16Bits* p, V& even, V& odd) {
    const __m512i v = _mm512_loadu_si512(reinterpret_cast<const void*>(p));
    even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    odd = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
  // The inverse: to_bf16_pair gives even in words 0-15 and odd in 16-31; word 2j takes j and
  // 2j+1 takes 16+j.
  static __m512i join_even_odd(V even, V odd) {
    const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                           24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17,
                                           1, 16, 0);
    return _mm512_permutexvar_epi16(order, to_bf16_pair(even, odd));
  }
#endif

  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static void store(HalfBits* p, V v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_half(v));
  }
  static void store(BF16Bits* p, V v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16(v));
  }
  // Non-temporal stores need aligned addresses; fall back to plain stores otherwise.
  static void stream(float* p, V v) {
    if ((reinterpret_cast<uintptr_t>(p) & 63) == 0) {
      _mm512_stream_ps(p, v);
    } else {
      store(p, v);
    }
  }
  static void stream(HalfBits* p, V v) {
    if ((reinterpret_cast<uintptr_t>(p) & 31) == 0) {
      _mm256_stream_si256(reinterpret_cast<__m256i*>(p), to_half(v));
    } else {
      store(p, v);
    }
  }
  static void stream(BF16Bits* p, V v) {
    if ((reinterpret_cast<uintptr_t>(p) & 31) == 0) {
      _mm256_stream_si256(reinterpret_cast<__m256i*>(p), to_bf16(v));
    } else {
      store(p, v);
    }
  }

  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V swap_pairs(V v) { return _mm512_permute_ps(v, 0xB1); }

  static float half_to_float(uint16_t h) { return _cvtsh_ss(h); }
  static uint16_t float_to_half(float f) { return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT); }
};

struct F64Ops {
  using acc = double;
  using V = __m512d;
  static constexpr int W = 8;

  static V load(const double* p) { return _mm512_loadu_pd(p); }
  static void store(double* p, V v) { _mm512_storeu_pd(p, v); }
  static void stream(double* p, V v) {
    if ((reinterpret_cast<uintptr_t>(p) & 63) == 0) {
      _mm512_stream_pd(p, v);
    } else {
      store(p, v);
    }
  }
  static V mul(V a, V b) { return _mm512_mul_pd(a, b); }
  static V add(V a, V b) { return _mm512_add_pd(a, b); }
  static V sub(V a, V b) { return _mm512_sub_pd(a, b); }
  static V swap_pairs(V v) { return _mm512_permute_pd(v, 0x55); }
};

void store_fence() { _mm_sfence(); }

}  // namespace
}  // namespace rope

