// The contract between qk_norm_rope_cpu.cpp (checks, threading) and the fused QK-RMSNorm + RoPE
// kernel (qk_norm_kernels.h), compiled once per instruction set (qk_norm_isa_*.cpp). Plain data
// and declarations only, for the reason kernel_api.h gives.
#pragma once

#include <cstdint>

#include "../geometry.h"
#include "../qk_norm_geometry.h"
#include "kernel_api.h"

namespace rope {

// Rows of at most this many elements convert their weights into stack buffers in the kernel;
// longer ones get weights the host cast to the arithmetic type.
constexpr int64_t kQkNormStackHeadDim = 1024;

// One call: the geometry, the norm, the operands' pointers and element types (DtIndex).
struct NormJob {
  const RotateGeometry* g;
  NormDesc norm;
  const void* src[2];
  void* dst[2];
  const void* w[2];  // nullptr: no weight (rope.norm_rope)
  int w_dt[2];
  // rope.norm_rope's general rows (a form other than kRms, or biases): weights and biases
  // contiguous in the arithmetic type (the host casts them), or nullptr for none.
  bool general = false;
  const void* b[2];
  const void* cos;  // strided: the cos tensor; gathered/MRoPE: the cache's row 0
  const void* sin;
  const void* positions;
  int x_dt, table_dt;
  TokenHook after_token;  // a later stage per token (the paged-cache store), or {nullptr}
};

using NormRopeTokensFn = void (*)(const NormJob&, int64_t begin_token, int64_t end_token);

NormRopeTokensFn qk_norm_kernel_baseline();
// Defined only where ROPE_CPU_X86_VARIANTS is.
NormRopeTokensFn qk_norm_kernel_avx2();
NormRopeTokensFn qk_norm_kernel_avx512();
NormRopeTokensFn qk_norm_kernel_avx512bf16();

}  // namespace rope
