// rope.shift_kv_cache_ (K-shift): the keys of a paged cache re-rotated in place by a position
// change. Its plain-data description and its per-pair math, shared by the CPU kernel, the CUDA
// kernel and the CUDA simulator (host and device code); the checks are in kv_shift/checks.h.
// docs/kv-shift.md has the semantics.
#pragma once

#include <cmath>
#include <cstdint>

#include "../../rope_math.h"
#include "../geometry.h"

namespace rope {

// One call: `n` listed slots; for each slot >= 0 and each of `heads` key heads, the first
// rotary_dim = 2 * half dims of the row are rotated by the unit (cos, sin) pair of table row
// |delta| (sin negated for delta < 0). Strides in elements.
struct ShiftDesc {
  int64_t n = 0;
  int64_t heads = 0, head_dim = 0, half = 0;
  bool interleaved = false;
  CacheFormat format = CacheFormat::kSame;
  int64_t slots = 0;  // num_blocks * block_size
  int64_t block_size = 1;
  CacheStrides kc;
  int64_t cos_row = 0, cos_col = 1;  // of cos_sin_cache; a row's sin is half columns further
  int64_t rows = 0;                  // max_position = cos_sin_cache.size(0)
  bool slots64 = true, delta64 = true;
  int64_t slot_stride = 1;
  int64_t delta_stride = 0;  // 0: one delta for every slot
};

// ---- per-pair math (host and device) ----

ROPE_HD float shift_sqrt(float x) { return sqrtf(x); }
ROPE_HD double shift_sqrt(double x) { return sqrt(x); }

// The unit rotation of table row (c, s): a pure rotation even where the table carries an
// attention factor (YaRN's mscale, LongRoPE's), by the negative angle for a negative delta.
// IEEE square root and division: every device rounds it identically.
template <typename acc_t>
ROPE_HD void unit_rotation(acc_t c, acc_t s, bool negative, acc_t& uc, acc_t& us) {
  const acc_t n = shift_sqrt(c * c + s * s);
  uc = c / n;
  us = (negative ? -s : s) / n;
}

// An 8-bit float code to float (exact: every code is a float). e4m3fn: 4 exponent bits (bias
// 7), 3 mantissa bits, no infinities, NaN at S.1111.111; e5m2: 5 exponent bits (bias 15), 2
// mantissa bits, IEEE infinities and NaNs.
ROPE_HD float fp8_to_float(uint8_t code, CacheFormat format) {
  const bool e4m3 = format == CacheFormat::kE4M3FN;
  const int mant_bits = e4m3 ? 3 : 2, bias = e4m3 ? 7 : 15;
  const uint32_t sign = static_cast<uint32_t>(code & 0x80u) << 24;
  const uint32_t exp = (code & 0x7Fu) >> mant_bits;
  const uint32_t mant = code & ((1u << mant_bits) - 1u);
  const uint32_t exp_max = e4m3 ? 15u : 31u;
  uint32_t u;
  if (e4m3 ? (exp == exp_max && mant == 7u) : exp == exp_max) {
    u = sign | 0x7F800000u | (e4m3 || mant != 0 ? 0x400000u : 0u);  // NaN (or e5m2 infinity)
  } else if (exp != 0) {
    u = sign | ((exp + 127u - static_cast<uint32_t>(bias)) << 23) | (mant << (23 - mant_bits));
  } else {
    // Subnormal: mant * 2^(1 - bias - mant_bits), exact in float.
    const float m = static_cast<float>(mant) * bits_float(static_cast<uint32_t>(127 + 1 - bias - mant_bits) << 23);
    u = sign | float_bits(m);
  }
  return bits_float(u);
}

// The same decoding without branches, for the CPU's loops over rows (they vectorize; see
// float_to_fp8_lanes). A normal code is its bits moved into place with the exponent rebiased; a
// subnormal one (exponent 0) is mant * 2^(1 - bias - mant_bits), exact in float; the all-ones
// exponent is e5m2's infinity or NaN, and e4m3fn's NaN when the mantissa is all ones. NaNs
// decode as the quiet NaN of their sign, like fp8_to_float (the same bits for every code:
// tests/test_fp8_codes.py).
template <CacheFormat kFormat>
ROPE_HD float fp8_to_float_lanes(uint32_t code) {
  constexpr bool kE4M3 = kFormat == CacheFormat::kE4M3FN;
  constexpr int kMant = kE4M3 ? 3 : 2, kBias = kE4M3 ? 7 : 15;
  const uint32_t sign = (code & 0x80u) << 24;
  const uint32_t mag = code & 0x7Fu;
  const uint32_t mant = mag & ((1u << kMant) - 1u);
  const uint32_t normal = (mag << (23 - kMant)) + (static_cast<uint32_t>(127 - kBias) << 23);
  const uint32_t subnormal =
      float_bits(static_cast<float>(static_cast<int32_t>(mant)) *
                 bits_float(static_cast<uint32_t>(127 + 1 - kBias - kMant) << 23));
  // Selected by masks: GCC keeps `?:` on these as branches.
  const uint32_t special =
      kE4M3 ? 0x7FC00000u : 0x7F800000u | ((0u - static_cast<uint32_t>(mant != 0)) & 0x400000u);
  const uint32_t special_mask =
      0u - static_cast<uint32_t>(kE4M3 ? mag == 0x7Fu : mag >= (0x1Fu << kMant));
  const uint32_t sub_mask = 0u - static_cast<uint32_t>(mag < (1u << kMant));
  uint32_t u = (subnormal & sub_mask) | (normal & ~sub_mask);
  u = (special & special_mask) | (u & ~special_mask);
  return bits_float(u | sign);
}

}  // namespace rope
