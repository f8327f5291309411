// Every float8 conversion the kernels use, against the branchy definitions in
// csrc/rope_math.h and csrc/ops/kv_shift/geometry.h: float_to_fp8_code (the CPU's branch-free
// encoder) and fp8_encode_run (csrc/ops/cpu/fp8_vec.h, as the ISA named at build time compiles
// it) for all 2^32 floats, fp8_to_float_lanes and fp8_decode_run for all 256 codes (times
// several scales, and with denormals flushed), in both formats; and dividing_encoder's choice
// (a multiplication where 1 / scale is exact) against the division. Built and run by
// tests/test_fp8_codes.py once per vector unit the machine has (ROPE_FP8_AVX2, ROPE_FP8_AVX512,
// or neither: that build holds the lane function to the branchy definition for every float,
// the others hold their runs to the lane function); prints the first mismatches and exits
// non-zero on any.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <initializer_list>
#if defined(__x86_64__)
#include <xmmintrin.h>
#endif

#define ROPE_INLINE inline __attribute__((always_inline))
#include "ops/kv_shift/geometry.h"
#include "ops/cpu/fp8_vec.h"

using namespace rope;

int main() {
  long bad = 0;
  auto report = [&](const char* what, uint32_t input, uint32_t got, uint32_t want) {
    if (bad++ < 8) std::printf("%s %08x: got %x, want %x\n", what, input, got, want);
  };
  for (uint32_t code = 0; code < 256; ++code) {
    for (CacheFormat f : {CacheFormat::kE4M3FN, CacheFormat::kE5M2}) {
      const float want = fp8_to_float(static_cast<uint8_t>(code), f);
      const float got = f == CacheFormat::kE4M3FN ? fp8_to_float_lanes<CacheFormat::kE4M3FN>(code)
                                                  : fp8_to_float_lanes<CacheFormat::kE5M2>(code);
      if (float_bits(got) != float_bits(want)) report("decode", code, float_bits(got), float_bits(want));
    }
  }
  // The runs: every code, each scale; then again with denormals flushed (DAZ and FTZ), which
  // must not change a result (the vector decoders pass e4m3's subnormals through half
  // denormals).
  uint8_t codes[256];
  for (int i = 0; i < 256; ++i) codes[i] = static_cast<uint8_t>(i);
  auto check_decode = [&](const char* what) {
    // 3e37: the e4m3 half path's factor (scale * 2^8) would overflow; the lane functions serve.
    for (float scale : {1.0f, 0.37f, 1e-3f, 448.0f, 3e-30f, 3e37f, 3.4e38f}) {
      float got_e4m3[256], got_e5m2[256];
      fp8_decode_run<CacheFormat::kE4M3FN>(codes, 256, got_e4m3, scale);
      fp8_decode_run<CacheFormat::kE5M2>(codes, 256, got_e5m2, scale);
      for (int i = 0; i < 256; ++i) {
        const float w4 = fp8_to_float(codes[i], CacheFormat::kE4M3FN) * scale;
        const float w5 = fp8_to_float(codes[i], CacheFormat::kE5M2) * scale;
        if (float_bits(got_e4m3[i]) != float_bits(w4)) report(what, i, float_bits(got_e4m3[i]), float_bits(w4));
        if (float_bits(got_e5m2[i]) != float_bits(w5)) report(what, i, float_bits(got_e5m2[i]), float_bits(w5));
      }
    }
  };
  check_decode("decode run");
#if defined(__x86_64__)
  const unsigned csr = _mm_getcsr();
  _mm_setcsr(csr | 0x8040);  // FTZ | DAZ
  check_decode("decode run (denormals flushed)");
  _mm_setcsr(csr);
#endif
  // Blocks of 2^16 inputs, each conversion in a loop of its own (so the branch-free one runs
  // vectorized, as in the kernels).
  constexpr int kBlock = 1 << 16;
  static float x[kBlock];
  static uint32_t lanes[kBlock];
  static uint8_t want[kBlock], run_div[kBlock], run_mul[kBlock];
  for (uint32_t hi = 0; hi < (1u << 16); ++hi) {
    for (int i = 0; i < kBlock; ++i) x[i] = bits_float(hi << 16 | static_cast<uint32_t>(i));
    for (Fp8Format f : {Fp8Format::kE4M3FN, Fp8Format::kE5M2}) {
      // A run's length off the vector widths, so the scalar tail is covered too.
      constexpr int kRun = kBlock - 3;
      if (f == Fp8Format::kE4M3FN) {  // the format a constant, as the CUDA kernels have it
        for (int i = 0; i < kBlock; ++i) lanes[i] = float_to_fp8_code(x[i], Fp8Format::kE4M3FN);
      } else {
        for (int i = 0; i < kBlock; ++i) lanes[i] = float_to_fp8_code(x[i], Fp8Format::kE5M2);
      }
      // The runs take the format as a value, as the CPU kernels do.
      fp8_encode_run_as<true>(x, kRun, run_div, 1.0f, f);
      fp8_encode_run_as<false>(x, kRun, run_mul, 1.0f, f);
#if defined(ROPE_FP8_AVX2) || defined(ROPE_FP8_AVX512)
      // The branchy definition is the slow part; the lane function has its bits (the build
      // without a vector unit checks that), so the vector runs are held to it.
      for (int i = 0; i < kBlock; ++i) want[i] = static_cast<uint8_t>(lanes[i]);
#else
      for (int i = 0; i < kBlock; ++i) want[i] = float_to_fp8(x[i], f);
#endif
      // Counted in loops that vectorize; read element by element only when something differs.
      int differ = 0;
      for (int i = 0; i < kBlock; ++i) differ += lanes[i] != want[i];
      for (int i = 0; i < kRun; ++i) differ += (run_div[i] != want[i]) + (run_mul[i] != want[i]);
      for (int i = 0; differ != 0 && i < kBlock; ++i) {
        if (lanes[i] != want[i]) report("encode", float_bits(x[i]), lanes[i], want[i]);
        if (i < kRun && run_div[i] != want[i]) report("encode run / 1", float_bits(x[i]), run_div[i], want[i]);
        if (i < kRun && run_mul[i] != want[i]) report("encode run * 1", float_bits(x[i]), run_mul[i], want[i]);
      }
    }
  }
  // The scale's division and multiplication: every float with 16 low bits of one pattern.
  for (float scale : {0.37f, 3.0f}) {
    for (uint32_t hi = 0; hi < (1u << 16); ++hi) x[hi] = bits_float(hi << 16 | 0x8001u);
    for (Fp8Format f : {Fp8Format::kE4M3FN, Fp8Format::kE5M2}) {
      fp8_encode_run_as<true>(x, kBlock, run_div, scale, f);
      fp8_encode_run_as<false>(x, kBlock, run_mul, scale, f);
      for (int i = 0; i < kBlock; ++i) {
        const uint8_t want_div = float_to_fp8(x[i] / scale, f), want_mul = float_to_fp8(x[i] * scale, f);
        if (run_div[i] != want_div) report("encode run / scale", float_bits(x[i]), run_div[i], want_div);
        if (run_mul[i] != want_mul) report("encode run * scale", float_bits(x[i]), run_mul[i], want_mul);
      }
    }
  }
  // dividing_encoder: a scale whose reciprocal is exact multiplies by it, every other divides;
  // either way the codes of x / scale.
  for (float scale : {1.0f, 0.5f, 4.0f, 0x1p-100f, 0x1p+100f, 0x1p+127f, 0.37f, 3.0f}) {
    for (uint32_t hi = 0; hi < (1u << 16); ++hi) x[hi] = bits_float(hi << 16 | 0x8001u);
    const auto e4m3 = dividing_encoder(scale, Fp8Format::kE4M3FN);
    const auto e5m2 = dividing_encoder(scale, Fp8Format::kE5M2);
    const bool power_of_two = scale == 1.0f || scale == 0.5f || scale == 4.0f ||
                              scale == 0x1p-100f || scale == 0x1p+100f;
    if (e4m3.divide == power_of_two) report("dividing_encoder choice", float_bits(scale), e4m3.divide, !power_of_two);
    fp8_encode_run(x, kBlock, run_div, e4m3);
    fp8_encode_run(x, kBlock, run_mul, e5m2);
    for (int i = 0; i < kBlock; ++i) {
      const uint8_t w4 = float_to_fp8(x[i] / scale, Fp8Format::kE4M3FN);
      const uint8_t w5 = float_to_fp8(x[i] / scale, Fp8Format::kE5M2);
      if (run_div[i] != w4) report("dividing_encoder e4m3", float_bits(x[i]), run_div[i], w4);
      if (run_mul[i] != w5) report("dividing_encoder e5m2", float_bits(x[i]), run_mul[i], w5);
    }
  }
  std::printf("%ld mismatches\n", bad);
  return bad != 0;
}
