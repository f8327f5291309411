// The fused QK-RMSNorm + RoPE kernel compiled for AVX2 + FMA + F16C (chosen at run time only on
// CPUs that have them, as the rotation kernels of isa_avx2.cpp). -ffp-contract=off keeps
// products and sums unfused.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "convert.h"
#include "qk_norm_kernel_api.h"

// Everything with external linkage is included above this line, before the target switch.
#ifdef ROPE_CPU_X86_VARIANTS

#define ROPE_ISA_TARGET "avx2,fma,f16c"
#include "isa_target_begin.h"

#include "avx2_bf16.h"

#define ROPE_QK_AVX2_BF16 1
#include "qk_norm_kernels.h"

#include "isa_target_end.h"

ROPE_DEFINE_QK_NORM_KERNEL(qk_norm_kernel_avx2)

#endif  // ROPE_CPU_X86_VARIANTS
