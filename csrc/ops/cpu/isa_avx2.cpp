// The CPU kernels compiled for AVX2 + FMA + F16C (Haswell and later, Zen): 8 float lanes. Chosen
// at run time only on CPUs that have all three; the rest of the library stays baseline x86-64.
#include "convert.h"
#include "kernel_api.h"

// Everything with external linkage is included above this line, before the target switch.
#ifdef ROPE_CPU_X86_VARIANTS

#define ROPE_ISA_TARGET "avx2,fma,f16c"
#include "isa_target_begin.h"

#include <immintrin.h>

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
  // Round to nearest even; NaN to 0xFFFF (convert.h float_to_bf16).
  static __m128i to_bf16(V v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb);
    r = _mm256_srli_epi32(r, 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0xFFFF), nan);
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
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

#include "kernels.h"

#include "isa_target_end.h"

ROPE_DEFINE_CPU_KERNELS(cpu_kernels_avx2)
#endif  // ROPE_CPU_X86_VARIANTS
