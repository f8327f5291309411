// The fused QK-RMSNorm + RoPE kernel compiled for AVX-512 with AVX512_BF16: the avx512 variant
// whose bfloat16 rows of the common head dims are converted with one instruction per 32 values,
// as the rotation kernels' avx512_bf16 variant does (isa_avx512bf16.cpp). Chosen at run time
// only on CPUs that have it.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "convert.h"
#include "qk_norm_kernel_api.h"

// Everything with external linkage is included above this line, before the target switch.
#ifdef ROPE_CPU_X86_VARIANTS

#if !defined(__clang__)
// GCC 12's own AVX-512 headers trip this warning (_mm512_undefined_*): not our code.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#define ROPE_ISA_TARGET "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c"
#include "isa_target_begin.h"

#include <immintrin.h>

#define ROPE_QK_NATIVE_BF16 1
#include "qk_norm_kernels.h"

#include "isa_target_end.h"

ROPE_DEFINE_QK_NORM_KERNEL(qk_norm_kernel_avx512bf16)

#endif  // ROPE_CPU_X86_VARIANTS
