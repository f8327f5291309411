// float -> bfloat16 rounding on AVX2, for the AVX2 kernel file (isa_avx2.cpp: the rotation and
// norm kernels), included inside its target region. Internal linkage (kernel_api.h on why nothing
// inline is shared across ISA files).
#pragma once

#include <immintrin.h>

namespace rope {
namespace {

// Rounded to nearest even with the code in each 32-bit lane's high half; NaN lanes all ones, so
// their code is 0xFFFF (convert.h float_to_bf16).
inline __m256i bf16_round_hi(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb);
  return _mm256_or_si256(r, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}

}  // namespace
}  // namespace rope
