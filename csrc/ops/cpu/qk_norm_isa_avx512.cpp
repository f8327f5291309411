// The fused QK-RMSNorm + RoPE kernel compiled for AVX-512 (F, BW, VL, DQ), chosen at run time
// only on CPUs that have them.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "convert.h"
#include "qk_norm_kernel_api.h"

// Everything with external linkage is included above this line, before the target switch.
#ifdef ROPE_CPU_X86_VARIANTS

#define ROPE_ISA_TARGET "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c"
#include "isa_target_begin.h"

#include "qk_norm_kernels.h"

#include "isa_target_end.h"

ROPE_DEFINE_QK_NORM_KERNEL(qk_norm_kernel_avx512)

#endif  // ROPE_CPU_X86_VARIANTS
