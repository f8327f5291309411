// The fused QK-RMSNorm + RoPE kernel for any CPU (baseline ISA; the compiler vectorizes what it
// can). Serves non-x86 builds, x86 CPUs without AVX2, and rope.set_cpu_isa(0).
#include "qk_norm_kernels.h"

ROPE_DEFINE_QK_NORM_KERNEL(qk_norm_kernel_baseline)
