// Plain-data descriptions of an op's operands, filled on the host by rope_checks.cpp and
// read by the CPU and CUDA kernels. Fixed-size arrays (no heap) so the structs can be passed
// by value to a CUDA kernel.
#pragma once

#include <cstdint>

#include "../rope_math.h"

namespace rope {

// Leading (non-head-dim) dims left after dropping size-1 dims and merging dims that are
// contiguous with each other in every operand. Real layouts need at most 4.
constexpr int kMaxLeadDims = 10;
constexpr int kMaxOperands = 3;

// Maps a flat row index over the leading dims to element offsets in up to three operands
// (stride 0 where an operand is broadcast along a dim).
struct LeadIndexer {
  int ndim = 0;
  int64_t sizes[kMaxLeadDims] = {};
  int64_t strides[kMaxOperands][kMaxLeadDims] = {};

  ROPE_HD void offsets(int64_t row, int64_t out[kMaxOperands]) const {
    for (int t = 0; t < kMaxOperands; ++t) out[t] = 0;
    for (int d = ndim - 1; d >= 0; --d) {
      const int64_t i = row % sizes[d];
      row /= sizes[d];
      for (int t = 0; t < kMaxOperands; ++t) out[t] += i * strides[t][d];
    }
  }
};

// Walks consecutive rows without a division per row (the CPU kernels' row loop).
struct LeadIterator {
  const LeadIndexer* ix;
  int64_t index[kMaxLeadDims];
  int64_t offset[kMaxOperands];

  ROPE_HD LeadIterator(const LeadIndexer& indexer, int64_t row) : ix(&indexer) {
    indexer.offsets(row, offset);
    for (int d = indexer.ndim - 1; d >= 0; --d) {
      index[d] = row % indexer.sizes[d];
      row /= indexer.sizes[d];
    }
  }

  ROPE_HD void next() {
    for (int d = ix->ndim - 1; d >= 0; --d) {
      for (int t = 0; t < kMaxOperands; ++t) offset[t] += ix->strides[t][d];
      if (++index[d] < ix->sizes[d]) return;
      for (int t = 0; t < kMaxOperands; ++t) offset[t] -= index[d] * ix->strides[t][d];
      index[d] = 0;
    }
  }
};

// rope.apply / rope.apply_backward: out[row] = rotate(x[row], cos[row'], sin[row']).
// Operands of `lead`: 0 = x, 1 = cos, 2 = sin. The output is contiguous: row r at r * head_dim.
struct ApplyGeometry {
  int64_t rows = 0;
  int64_t head_dim = 0;
  int64_t half = 0;  // rotary_dim / 2 = cos.size(-1)
  int64_t x_last = 1, cos_last = 1, sin_last = 1;  // strides along the last dim
  LeadIndexer lead;
};

// rope.apply_: rotates query and key in place, gathering cos/sin rows by position.
// Operands of `lead`: 0 = query, 1 = key, 2 = positions.
struct InplaceGeometry {
  int64_t tokens = 0;
  int64_t head_dim = 0;
  int64_t half = 0;  // rotary_dim / 2
  int64_t q_heads = 0, k_heads = 0;  // k_heads == 0 when key is None
  int64_t q_head_stride = 0, k_head_stride = 0;
  int64_t q_last = 1, k_last = 1;
  int64_t cache_row_stride = 0, cache_col_stride = 1;
  int64_t max_position = 0;
  LeadIndexer lead;
};

}  // namespace rope
