// The body of an AVX-512 kernel file (rope_cpu_avx512.cpp, rope_cpu_avx512bf16.cpp): those files
// only name the target features and the entry function, then include this header:
//   ROPE_AVX512_TARGET   the features, e.g. "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c"
//   ROPE_AVX512_ENTRY    the function that returns the table (declared in rope_cpu_isa.h)
//   ROPE_AVX512_BF16     defined for the variant with the one-instruction bfloat16 conversion
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "rope_cpu_isa.h"

// Everything with external linkage is included above this line, before the target switch.
#ifdef ROPE_CPU_X86_VARIANTS

#define ROPE_AVX512_PRAGMA(x) _Pragma(#x)
#if defined(__clang__)
#define ROPE_AVX512_PUSH(features) \
  ROPE_AVX512_PRAGMA(clang attribute push(__attribute__((target(features))), apply_to = function))
ROPE_AVX512_PUSH(ROPE_AVX512_TARGET)
#else
#define ROPE_AVX512_PUSH(features) ROPE_AVX512_PRAGMA(GCC target(features))
#pragma GCC push_options
// GCC 12's own AVX-512 headers trip this warning (_mm512_undefined_*): not our code.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
ROPE_AVX512_PUSH(ROPE_AVX512_TARGET)
#endif

#include "rope_cpu_avx512_ops.h"
#include "rope_cpu_simd.h"

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

ROPE_DEFINE_CPU_KERNELS(ROPE_AVX512_ENTRY)
#endif  // ROPE_CPU_X86_VARIANTS
