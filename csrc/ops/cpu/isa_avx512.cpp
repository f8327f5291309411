// The CPU kernels compiled for AVX-512 (F, BW, VL, DQ: Skylake-SP, Ice Lake, Zen 4 and later),
// 16 float lanes. Chosen at run time only on CPUs that have them.
#define ROPE_AVX512_TARGET "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c"
#define ROPE_AVX512_ENTRY cpu_kernels_avx512
#define ROPE_AVX512_LEVEL 2
#include "avx512_kernels.h"
