// The CPU kernels compiled for AVX-512 with AVX512_BF16 (Cooper Lake, Sapphire Rapids, Zen 4 and
// later): the avx512 variant with a one-instruction float -> bfloat16 conversion, which is most
// of the work of a bfloat16 row. Chosen at run time only on CPUs that have it.
#define ROPE_AVX512_BF16 1
#define ROPE_AVX512_TARGET "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c"
#define ROPE_AVX512_ENTRY cpu_kernels_avx512_bf16
#define ROPE_AVX512_LEVEL 3
#include "avx512_kernels.h"
