// The CPU kernels compiled for AVX-512 with AVX512_BF16 (Cooper Lake, Sapphire Rapids, Zen 4 and
// later): the avx512 variant with a one-instruction float -> bfloat16 conversion, which is most
// of the work of a bfloat16 row. Chosen at run time only on CPUs that have it.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "rope_cpu_isa.h"

// Everything with external linkage is included above this line, before the target switch.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define ROPE_HAVE_AVX512_BF16_KERNELS 1
#define ROPE_AVX512_BF16 1

#if defined(__clang__)
#pragma clang attribute push(                                                          \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c"))), \
    apply_to = function)
#else
#pragma GCC push_options
// GCC 12's own AVX-512 headers trip this warning (_mm512_undefined_*): not our code.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c")
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

const CpuKernels* cpu_kernels_avx512_bf16() {
#ifdef ROPE_HAVE_AVX512_BF16_KERNELS
  // Built on first use, on a CPU already known to have AVX512_BF16 (make_kernels only takes addresses).
  static const CpuKernels kernels = make_kernels();
  return &kernels;
#else
  return nullptr;
#endif
}

}  // namespace rope
