// Every float8 conversion the kernels use, against the branchy definitions in
// csrc/rope_math.h and csrc/ops/shift_geometry.h: float_to_fp8_code (the CPU's branch-free
// encoder) for all 2^32 floats, fp8_to_float_lanes (the branch-free decoder) for all 256 codes,
// in both formats. Built and run by tests/test_fp8_codes.py; prints the first mismatches and
// exits non-zero on any.
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <initializer_list>

#include "ops/shift_geometry.h"

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
  // Blocks of 2^16 inputs, each conversion in a loop of its own (so the branch-free one runs
  // vectorized, as in the kernels).
  constexpr int kBlock = 1 << 16;
  static float x[kBlock];
  static uint32_t lanes[kBlock];
  for (uint32_t hi = 0; hi < (1u << 16); ++hi) {
    for (int i = 0; i < kBlock; ++i) x[i] = bits_float(hi << 16 | static_cast<uint32_t>(i));
    for (Fp8Format f : {Fp8Format::kE4M3FN, Fp8Format::kE5M2}) {
      if (f == Fp8Format::kE4M3FN) {
        for (int i = 0; i < kBlock; ++i) lanes[i] = float_to_fp8_code(x[i], Fp8Format::kE4M3FN);
      } else {
        for (int i = 0; i < kBlock; ++i) lanes[i] = float_to_fp8_code(x[i], Fp8Format::kE5M2);
      }
      for (int i = 0; i < kBlock; ++i) {
        const uint32_t want = float_to_fp8(x[i], f);
        if (lanes[i] != want) report("encode", float_bits(x[i]), lanes[i], want);
      }
    }
  }
  std::printf("%ld mismatches\n", bad);
  return bad != 0;
}
