// Scalar conversions of one 16-bit float, bit for bit as torch's CPU conversions: for tails,
// tables, strided rows and the baseline kernels. Internal linkage: each kernel file compiles its
// own copy (see kernel_api.h on why nothing inline may be shared across ISA files).
#pragma once

#include <cstdint>
#include <cstring>

namespace rope {
namespace {

inline float bf16_to_float(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Round to nearest even; NaN to 0xFFFF, which is what torch's CPU conversion gives. Branch-free
// (a mask for NaN), so that loops of it vectorize.
inline uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t nan = 0u - static_cast<uint32_t>((u & 0x7FFFFFFFu) > 0x7F800000u);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>((u >> 16) | nan);
}

// IEEE binary16 <-> float, rounding to nearest even and keeping a NaN's sign and top payload
// bits (quieted), as the F16C instructions do.
inline float half_bits_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu, mant = h & 0x3FFu;
  uint32_t u;
  if (exp == 0x1F) {
    u = sign | 0x7F800000u | (mant << 13) | (mant ? 0x400000u : 0u);
  } else if (exp != 0) {
    u = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant == 0) {
    u = sign;
  } else {  // subnormal: normalize
    uint32_t e = 113, m = mant;
    while ((m & 0x400u) == 0) {
      m <<= 1;
      --e;
    }
    u = sign | (e << 23) | ((m & 0x3FFu) << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t float_to_half_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return sign | 0x7E00u | static_cast<uint16_t>((a >> 13) & 0x3FFu);
  if (a >= 0x477FF000u) return sign | 0x7C00u;  // rounds to 65536 or more: infinity
  if (a < 0x38800000u) {  // below 2^-14: a subnormal half (or zero)
    float mag;
    std::memcpy(&mag, &a, 4);
    mag += 0.5f;  // 2^-1, whose ulp is the half subnormal step 2^-24: rounds to nearest even
    uint32_t r;
    std::memcpy(&r, &mag, 4);
    return sign | static_cast<uint16_t>(r - 0x3F000000u);
  }
  const uint32_t odd = (a >> 13) & 1u;
  return sign | static_cast<uint16_t>((a - 0x38000000u + 0xFFFu + odd) >> 13);
}

}  // namespace
}  // namespace rope
