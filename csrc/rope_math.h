// Per-element RoPE math shared by the CPU kernels, the CUDA kernels and the CUDA simulator, so
// that they cannot drift apart: which position component an MRoPE pair takes and the float8
// conversion of the KV-cache write (every path), and the pair rotation (the CUDA thread code; the
// CPU kernels write the same products and sums in vector form, and the tests compare the two bit
// for bit). Header-only and callable from host and device code. The formulas are in docs/math.md.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define ROPE_HD __host__ __device__ __forceinline__
#else
#define ROPE_HD inline
#endif

namespace rope {

// Arithmetic type for a storage type: float for half/bfloat16/float, double for double.
template <typename T>
struct OpMath {
  using type = float;
};
template <>
struct OpMath<double> {
  using type = double;
};
template <typename T>
using opmath_t = typename OpMath<T>::type;

// Rotates one pair (a, b) by the angle whose cosine/sine are (c, s); the inverse rotation (the
// backward) is the same with -s, which the callers pass. Written as separate products and sums
// (the build forbids contraction into FMA), so every device rounds it identically.
template <typename acc_t>
ROPE_HD void rotate_pair(acc_t a, acc_t b, acc_t c, acc_t s, acc_t& out_a, acc_t& out_b) {
  out_a = a * c - b * s;
  out_b = b * c + a * s;
}

// ---- MRoPE: which of the three position components (temporal, height, width) pair i takes
// (docs/math.md "MRoPE") ----
constexpr int kMropeComponents = 3;

// Sections [t, h, w] (summing to rotary_dim/2).
//   chunked (Qwen2-VL, Qwen2.5-VL): pairs [0, t) take t, [t, t+h) take h, the rest w;
//   interleaved (Qwen3-VL): pair i takes h when i % 3 == 1 and i < 3h, w when i % 3 == 2 and
//   i < 3w, t otherwise (T,H,W,T,H,W,... then T to the end).
ROPE_HD int mrope_component(int64_t i, const int64_t section[kMropeComponents],
                            bool interleaved_sections) {
  if (interleaved_sections) {
    const int64_t r = i % 3;
    if (r == 1 && i < 3 * section[1]) return 1;
    if (r == 2 && i < 3 * section[2]) return 2;
    return 0;
  }
  return i < section[0] ? 0 : (i < section[0] + section[1] ? 1 : 2);
}

// ---- float8 storage of the KV cache (rope.apply_and_cache_ with kv_cache_dtype fp8;
// docs/math.md "Float8 KV cache") ----
// value / scale, saturated to the format's largest finite value (NaN stays NaN), rounded to
// nearest even: bit for bit what torch's own conversion gives for values in range, so
// `(v / scale).clamp(-max, max).to(torch.float8_*)` is the reference.
enum class Fp8Format : int32_t { kE4M3FN = 0, kE5M2 = 1 };

// The bits of a float and back (memcpy compiles to a register move on host and device).
ROPE_HD uint32_t float_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof(u));
  return u;
}

ROPE_HD float bits_float(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof(f));
  return f;
}

// x (already divided by the scale) to the 8-bit code. kMant mantissa bits, kBias exponent bias;
// the smallest normal is 2^(1 - kBias).
template <int kMant, int kBias>
ROPE_HD uint8_t float_to_fp8_bits(float x, float max_finite, uint8_t nan_code) {
  uint32_t u = float_bits(x);
  const uint32_t sign = u & 0x80000000u;
  u ^= sign;
  uint8_t code;
  if (u > 0x7F800000u) {
    code = nan_code;
  } else {
    if (bits_float(u) > max_finite) u = float_bits(max_finite);  // saturate, inf included
    if (u < static_cast<uint32_t>(127 + 1 - kBias) << 23) {
      // Below the smallest normal: adding 2^(24 - kBias - kMant), a float whose ulp is the
      // format's subnormal step 2^(1 - kBias - kMant), rounds to nearest even in float
      // arithmetic, and the low bits of the sum are the subnormal code.
      const uint32_t magic = static_cast<uint32_t>(127 + 24 - kBias - kMant) << 23;
      code = static_cast<uint8_t>(float_bits(bits_float(u) + bits_float(magic)) - magic);
    } else {
      // Rebias the exponent and round the dropped 23 - kMant bits to nearest even.
      const uint32_t odd = (u >> (23 - kMant)) & 1u;
      u += (static_cast<uint32_t>(kBias - 127) << 23) + ((1u << (22 - kMant)) - 1u) + odd;
      code = static_cast<uint8_t>(u >> (23 - kMant));
    }
  }
  return static_cast<uint8_t>(code | (sign >> 24));
}

// The format's constants of float_to_fp8_lanes, as values: one loop converts to either format
// (a format as a template parameter doubled every CPU kernel that writes float8 rows).
struct Fp8LaneConsts {
  uint32_t max_bits;    // the largest finite value's bits (saturation)
  uint32_t min_normal;  // the smallest normal's exponent field, 127 + 1 - bias
  uint32_t step;        // (23 - mantissa bits) << 23: c's exponent above the binade's
  uint32_t shift;       // 23 - mantissa bits
  uint32_t first;       // (151 - mantissa bits - bias) << mantissa bits
};

template <int kMant, int kBias>
ROPE_HD Fp8LaneConsts fp8_lane_consts_of(float max_finite) {
  return {float_bits(max_finite), static_cast<uint32_t>(127 + 1 - kBias) << 23,
          static_cast<uint32_t>(23 - kMant) << 23, static_cast<uint32_t>(23 - kMant),
          static_cast<uint32_t>(151 - kMant - kBias) << kMant};
}

ROPE_HD Fp8LaneConsts fp8_lane_consts(Fp8Format fmt) {
  return fmt == Fp8Format::kE4M3FN ? fp8_lane_consts_of<3, 7>(448.0f)
                                   : fp8_lane_consts_of<2, 15>(57344.0f);
}

// The same conversion without branches (every case computed, the result picked by masks), for
// the CPU's loops over rows: it vectorizes (GCC keeps conditionals here as branches), where on
// the GPU the extra registers would spill. One float addition rounds: c = 2^(e + 23 - kMant),
// where 2^e is the input's binade (the smallest normal's below it), has an ulp of the format's
// step there, so u + c rounds u to a whole number of steps (to nearest even) and stays in c's
// binade, where the bits of the sum less those of c count the steps: the mantissa with its
// leading one for a normal, the code itself for a subnormal. The two conversions give the same
// bits for every one of the 2^32 floats in both formats (tests/test_fp8_codes.py;
// tests/test_cache_write.py compares the CPU cache stores with torch's conversion for every
// bfloat16 value). NaN gives 0x7F with its sign, in both formats.
ROPE_HD uint32_t float_to_fp8_lanes(float x, const Fp8LaneConsts& k) {
  uint32_t u = float_bits(x);
  const uint32_t sign = u & 0x80000000u;
  u ^= sign;
  const uint32_t nan_mask = 0u - static_cast<uint32_t>(u > 0x7F800000u);
  // Saturate, inf included (for non-negative floats the bits order as the values do).
  u = u < k.max_bits ? u : k.max_bits;
  const uint32_t e = u & 0x7F800000u;
  const uint32_t c = (e > k.min_normal ? e : k.min_normal) + k.step;
  const uint32_t sum = float_bits(bits_float(u) + bits_float(c));
  // The binade's first code, ((e - min_normal) >> 23) << kMant, plus the steps.
  const uint32_t code = (c >> k.shift) + (sum - c) - k.first;
  return ((0x7Fu & nan_mask) | (code & ~nan_mask)) | (sign >> 24);  // narrowed by the caller
}

ROPE_HD uint8_t float_to_fp8(float x, Fp8Format fmt) {
  return fmt == Fp8Format::kE4M3FN ? float_to_fp8_bits<3, 7>(x, 448.0f, 0x7F)
                                   : float_to_fp8_bits<2, 15>(x, 57344.0f, 0x7F);
}

// float_to_fp8_lanes's code in a 32-bit lane: loops that convert a block into such lanes, then
// narrow the block to bytes in a loop of their own, vectorize both cleanly (narrowing inside the
// conversion has the compiler pack every intermediate mask down to bytes).
ROPE_HD uint32_t float_to_fp8_code(float x, Fp8Format fmt) {
  return float_to_fp8_lanes(x, fp8_lane_consts(fmt));
}

ROPE_HD uint8_t float_to_fp8_vec(float x, Fp8Format fmt) {
  return static_cast<uint8_t>(float_to_fp8_code(x, fmt));
}

}  // namespace rope
