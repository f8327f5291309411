// The norm part of a fused norm + RoPE call (rope.qk_norm_rope*, rope.norm_rope), beside its
// RotateGeometry (geometry.h): plain data, read by the CPU kernels, the CUDA kernels and the
// CUDA simulator. The weights are in the arithmetic type (the host casts them).
#pragma once

#include <cstdint>

namespace rope {

// What each row is normalized by (rope.norm_rope's `norm`; the qk_norm_rope* ops: kRms).
enum class NormForm : int32_t {
  kRms = 0,             // x * rsqrt(mean(x^2) + eps) over each head
  kRmsAcrossHeads = 1,  // the same over all heads of a token (weights (heads * head_dim,))
  kLayer = 2,           // (x - mean) * rsqrt(mean((x - mean)^2) + eps) over each head
};

struct NormDesc {
  double eps = 0;
  bool unit_offset = false;      // scale by (1 + w) (Gemma) instead of w
  int64_t w_stride[2] = {1, 1};  // of the weights of target 0 (query) and target 1 (key)
  NormForm form = NormForm::kRms;
  // kRmsAcrossHeads: the heads of one token of each target (its rows come in runs of these).
  int64_t group_heads[2] = {1, 1};
};

}  // namespace rope
