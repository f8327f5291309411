// The CPU kernels for any CPU, one lane at a time (the compiler may still vectorize the loops for
// the baseline ISA). Serves non-x86 builds, x86 CPUs without AVX2, and rope.set_cpu_isa(0).
#include "convert.h"
#include "kernel_api.h"

namespace rope {
namespace {

struct F32Ops {
  using acc = float;
  using V = float;
  static constexpr int W = 1;
  static float half_to_float(uint16_t h) { return half_bits_to_float(h); }
  static uint16_t float_to_half(float f) { return float_to_half_bits(f); }
  static V load(const float* p) { return *p; }
  static V load(const HalfBits* p) { return half_bits_to_float(p->bits); }
  static V load(const BF16Bits* p) { return bf16_to_float(p->bits); }
  static void store(float* p, V v) { *p = v; }
  static void store(HalfBits* p, V v) { p->bits = float_to_half_bits(v); }
  static void store(BF16Bits* p, V v) { p->bits = float_to_bf16(v); }
  template <typename T>
  static void store_nt(T* p, V v) { store(p, v); }
  static V mul(V a, V b) { return a * b; }
  static V add(V a, V b) { return a + b; }
  static V sub(V a, V b) { return a - b; }
};

struct F64Ops {
  using acc = double;
  using V = double;
  static constexpr int W = 1;
  static V load(const double* p) { return *p; }
  static void store(double* p, V v) { *p = v; }
  static void store_nt(double* p, V v) { *p = v; }
  static V mul(V a, V b) { return a * b; }
  static V add(V a, V b) { return a + b; }
  static V sub(V a, V b) { return a - b; }
};

void store_fence() {}

}  // namespace
}  // namespace rope

#include "kernels.h"

ROPE_DEFINE_CPU_KERNELS(cpu_kernels_baseline)
