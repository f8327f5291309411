// The norm part of a fused QK-RMSNorm + RoPE call (rope.qk_norm_rope*), beside its
// RotateGeometry (geometry.h): plain data, read by the CPU kernels, the CUDA kernels and the
// CUDA simulator. The weights are in the arithmetic type (the host casts them).
#pragma once

#include <cstdint>

namespace rope {

struct NormDesc {
  double eps = 0;
  bool unit_offset = false;      // scale by (1 + w) (Gemma) instead of w
  int64_t w_stride[2] = {1, 1};  // of the weights of target 0 (query) and target 1 (key)
};

}  // namespace rope
