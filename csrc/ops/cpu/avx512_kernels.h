// The body of the two AVX-512 kernel files (isa_avx512.cpp, isa_avx512bf16.cpp), which only name
// their target features and entry function, then include this header:
//   ROPE_AVX512_TARGET   the features, e.g. "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c"
//   ROPE_AVX512_ENTRY    the function that returns the table (declared in kernel_api.h)
//   ROPE_AVX512_BF16     defined for the variant with the one-instruction bfloat16 conversion
//   ROPE_AVX512_LEVEL    its CpuIsa value (2 or 3): above ROPE_CPU_MAX_ISA the file compiles nothing
#include "convert.h"
#include "kernel_api.h"

// Everything with external linkage is included above this line, before the target switch.
#if defined(ROPE_CPU_X86_VARIANTS) && ROPE_CPU_MAX_ISA >= ROPE_AVX512_LEVEL

#if !defined(__clang__)
// GCC 12's own AVX-512 headers trip this warning (_mm512_undefined_*): not our code.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#define ROPE_ISA_TARGET ROPE_AVX512_TARGET
#include "isa_target_begin.h"

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
  static __mmask16 nan_lanes(V v) { return _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q); }
  // 32 bfloat16 to p: streamed when asked and p is 64-byte aligned, else a plain store.
  static void write_bf16x2w(BF16Bits* p, __m512i v, bool stream) {
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
    odd = _mm512_castsi512_ps(
        _mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
  static constexpr bool kBf16Pairs = true;
#ifdef ROPE_AVX512_BF16
  // One instruction rounds to nearest even; NaN lanes then become 0xFFFF (convert.h). It treats
  // float denormals (below 1.2e-38) as zero, unlike torch's conversion: docs/math.md says so and
  // why it stays (a check of every 32 results cost 10% of an arithmetic-bound row).
  static __m256i to_bf16(V v) {
    const __m256i r = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));
    return _mm256_mask_mov_epi16(r, nan_lanes(v), _mm256_set1_epi16(-1));
  }
  // Two float vectors to 32 bfloat16 at once: lo = values 0-15, hi = 16-31, stored in order.
  // NaN lanes keep the instruction's quiet NaN codes: loops fold each result into a NanAcc (2
  // instructions per 32 values, where fixing every vector took 3) and fix a block's NaN codes
  // afterwards, only when it has any (kernels.h fix_bf16_nans). The same bits: a NaN code
  // (magnitude above 0x7F80) comes only from a NaN.
  static constexpr bool kHalfSplitEvenOdd = false;  // pairs convert in order in one instruction
  static __m512i to_bf16_pair_raw(V lo, V hi) {
    return reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo));
  }
  using NanAcc = __m512i;  // per word: the largest magnitude code seen
  static NanAcc nan_acc_init() { return _mm512_setzero_si512(); }
  static NanAcc nan_acc(NanAcc acc, __m512i r) {
    return _mm512_max_epu16(acc, _mm512_and_si512(r, _mm512_set1_epi16(0x7FFF)));
  }
  static bool nan_any(NanAcc acc) {
    return _mm512_cmpgt_epu16_mask(acc, _mm512_set1_epi16(0x7F80)) != 0;
  }
  // The inverse of load_even_odd, NaN codes unfixed: to_bf16_pair_raw gives even in words 0-15
  // and odd in 16-31; word 2j takes j and 2j+1 takes 16+j.
  static __m512i join_even_odd_raw(V even, V odd) {
    const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                           24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17,
                                           1, 16, 0);
    return _mm512_permutexvar_epi16(order, to_bf16_pair_raw(even, odd));
  }
#else
  // Rounded to nearest even with the code in each 32-bit lane's high half; NaN lanes all ones,
  // so their code is 0xFFFF (convert.h float_to_bf16).
  static __m512i bf16_round_hi(V v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb);
    return _mm512_mask_mov_epi32(r, nan_lanes(v), _mm512_set1_epi32(-1));
  }
  static __m256i to_bf16(V v) {
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_round_hi(v), 16));
  }
  // bfloat16 rows as even and odd lanes (kernels.h kBf16Pairs, kHalfSplitEvenOdd), as on AVX2:
  // 32 values are one load, widened with a shift and a mask, and two results go back in order
  // with one word blend, where widening and narrowing in order (vpmovzxwd, vpmovdw) are
  // lane-crossing shuffles.
  static constexpr bool kHalfSplitEvenOdd = true;
  struct NanAcc {};  // bf16_round_hi fixes NaN codes per vector: nothing is left to fix afterwards
  static NanAcc nan_acc_init() { return {}; }
  static NanAcc nan_acc(NanAcc acc, __m512i) { return acc; }
  static constexpr bool nan_any(NanAcc) { return false; }
  // 32 table values as their 16 even and 16 odd elements, in float (tables of kHalfSplitEvenOdd
  // rows): bfloat16 as load_even_odd, the others loaded in order, then one two-source permutation
  // each.
  template <typename T>
  static void split_even_odd(const T* p, V& even, V& odd) {
    const V lo = load(p), hi = load(p + W);
    even = _mm512_permutex2var_ps(
        lo, _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30), hi);
    odd = _mm512_permutex2var_ps(
        lo, _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31), hi);
  }
  static void split_even_odd(const BF16Bits* p, V& even, V& odd) { load_even_odd(p, even, odd); }
  // The inverse of load_even_odd: word 2j is even's lane j, word 2j + 1 odd's.
  static __m512i join_even_odd_raw(V even, V odd) {
    return _mm512_mask_blend_epi16(0xAAAAAAAAu, _mm512_srli_epi32(bf16_round_hi(even), 16),
                                   bf16_round_hi(odd));
  }
#endif

  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static void store(HalfBits* p, V v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_half(v));
  }
  static void store(BF16Bits* p, V v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16(v));
  }
  static void store_nt(float* p, V v) { _mm512_stream_ps(p, v); }
  static void store_nt(HalfBits* p, V v) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p), to_half(v));
  }
  static void store_nt(BF16Bits* p, V v) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p), to_bf16(v));
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
  static void store_nt(double* p, V v) { _mm512_stream_pd(p, v); }
  static V mul(V a, V b) { return _mm512_mul_pd(a, b); }
  static V add(V a, V b) { return _mm512_add_pd(a, b); }
  static V sub(V a, V b) { return _mm512_sub_pd(a, b); }
  static V swap_pairs(V v) { return _mm512_permute_pd(v, 0x55); }
};

void store_fence() { _mm_sfence(); }

}  // namespace
}  // namespace rope

#ifdef ROPE_AVX512_BF16
#define ROPE_KERNELS_BF16_ONLY 1
#endif
#define ROPE_FP8_AVX512 1  // fp8_vec.h
#include "kernels.h"

#ifdef ROPE_AVX512_BF16
namespace rope {
namespace {
// Only bfloat16 rows use the one-instruction conversion; every other dtype is avx512's.
CpuKernels make_kernels() {
  CpuKernels k = *cpu_kernels_avx512();
  fill<BF16Bits>(k, kBF16);
  return k;
}
}  // namespace
}  // namespace rope
#endif

#include "isa_target_end.h"

ROPE_DEFINE_CPU_KERNELS(ROPE_AVX512_ENTRY)
#elif defined(ROPE_CPU_X86_VARIANTS)
ROPE_DEFINE_NO_CPU_KERNELS(ROPE_AVX512_ENTRY)
#endif
