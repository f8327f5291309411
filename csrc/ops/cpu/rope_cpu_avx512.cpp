// The CPU kernels compiled for AVX-512 (F, BW, VL, DQ: Skylake-SP, Ice Lake, Zen 4 and later),
// 16 float lanes. Chosen at run time by rope_cpu_isa.cpp only on CPUs that have them.
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "rope_cpu_isa.h"

// Everything with external linkage is included above this line, before the target switch.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define ROPE_HAVE_AVX512_KERNELS 1

#if defined(__clang__)
#pragma clang attribute push(                                                          \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c"))), \
    apply_to = function)
#else
#pragma GCC push_options
// GCC 12's own AVX-512 headers trip this warning (_mm512_undefined_*): not our code.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#endif

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
  // Round to nearest even as torch does; NaN to 0x7FC0. (Not VCVTNEPS2BF16: that needs
  // AVX512_BF16, which most AVX-512 CPUs lack.)
  static __m256i to_bf16(V v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb);
    r = _mm512_srli_epi32(r, 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC0));
    return _mm512_cvtepi32_epi16(r);
  }

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
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V fnma(V a, V b, V c) { return _mm512_fnmadd_ps(a, b, c); }
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
  static V fma(V a, V b, V c) { return _mm512_fmadd_pd(a, b, c); }
  static V fnma(V a, V b, V c) { return _mm512_fnmadd_pd(a, b, c); }
  static V swap_pairs(V v) { return _mm512_permute_pd(v, 0x55); }
};

void store_fence() { _mm_sfence(); }

}  // namespace
}  // namespace rope

#include "rope_cpu_simd.h"

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif  // x86-64 with GCC or clang

namespace rope {

const CpuKernels* cpu_kernels_avx512() {
#ifdef ROPE_HAVE_AVX512_KERNELS
  // Built on first use, on a CPU already known to have AVX-512 (make_kernels only takes addresses).
  static const CpuKernels kernels = make_kernels();
  return &kernels;
#else
  return nullptr;
#endif
}

}  // namespace rope
