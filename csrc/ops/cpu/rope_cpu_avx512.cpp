// The CPU kernels compiled for AVX-512 (F, BW, VL, DQ: Skylake-SP, Ice Lake, Zen 4 and later),
// 16 float lanes. Chosen at run time by rope_cpu_isa.cpp only on CPUs that have them.
#include <algorithm>
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

#include "rope_cpu_avx512_ops.h"
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
