// Per-thread code of the CUDA kernel for rope.mrope_, in plain C++ (no CUDA built-ins) so that
// one source serves nvcc (mrope_cuda.cu) and g++ (tests/sim/mrope_cuda_sim.cpp, which runs every
// thread of a grid under AddressSanitizer and compares with a direct loop).
//
// A thread owns one rotary pair i of a token and loops over heads: pair i's cos/sin come from
// the cache row of position component mrope_component(i), loaded once and reused for every
// query and key head. Threads of a token own disjoint pairs, so the in-place update has no races.
#pragma once

#include <cstdint>

#include "../../rope_math.h"
#include "../mrope_geometry.h"

namespace rope::mrope_gpu {

// The table is passed in the arithmetic type of x (float, or double for double x): the host
// casts it once, which gives exactly the values the CPU kernel gets by casting each element.
template <typename x_t>
struct MropeArgs {
  using tab_t = opmath_t<x_t>;
  x_t* q;
  x_t* k;  // nullptr when key is None (then g.inplace.k_heads == 0)
  const void* pos;
  bool pos64;
  const tab_t* cache;
  MropeGeometry g;
};

// Where a thread starts and how far it strides along tokens, pairs and heads (on the GPU:
// blockIdx.x*blockDim.z + threadIdx.z / gridDim.x*blockDim.z, threadIdx.x / blockDim.x, and
// threadIdx.y / blockDim.y).
struct MropeThread {
  int64_t tok0, tok_step, pair0, pair_step, head0, head_step;
};

ROPE_HD int64_t load_position(const void* pos, bool pos64, int64_t offset) {
  return pos64 ? static_cast<const int64_t*>(pos)[offset]
               : static_cast<int64_t>(static_cast<const int32_t*>(pos)[offset]);
}

// Tokens with any position component outside [0, max_position) are skipped (left unchanged), so
// the cache is never read out of bounds; the host raises instead when position checking is on.
template <typename x_t, bool kInterleaved>
ROPE_HD void mrope_thread(const MropeArgs<x_t>& a, const MropeThread& th) {
  using acc_t = opmath_t<x_t>;
  const InplaceGeometry& g = a.g.inplace;
  const int64_t heads = g.q_heads + g.k_heads;
  for (int64_t tok = th.tok0; tok < g.tokens; tok += th.tok_step) {
    int64_t off[kMaxOperands];
    g.lead.offsets(tok, off);
    int64_t p[kMropeComponents];
    bool in_range = true;
    for (int c = 0; c < kMropeComponents; ++c) {
      p[c] = load_position(a.pos, a.pos64, off[2] + c * a.g.pos_component_stride);
      in_range = in_range && p[c] >= 0 && p[c] < g.max_position;
    }
    if (!in_range) continue;
    for (int64_t i = th.pair0; i < g.half; i += th.pair_step) {
      const typename MropeArgs<x_t>::tab_t* row =
          a.cache + p[mrope_component(i, a.g.section_end)] * g.cache_row_stride;
      const acc_t c = static_cast<acc_t>(row[i * g.cache_col_stride]);
      const acc_t s = static_cast<acc_t>(row[(g.half + i) * g.cache_col_stride]);
      const int64_t e0 = pair_first(i, g.half, kInterleaved);
      const int64_t e1 = pair_second(i, g.half, kInterleaved);
      for (int64_t h = th.head0; h < heads; h += th.head_step) {
        const bool is_q = h < g.q_heads;
        x_t* r = is_q ? a.q + off[0] + h * g.q_head_stride
                      : a.k + off[1] + (h - g.q_heads) * g.k_head_stride;
        const int64_t st = is_q ? g.q_last : g.k_last;
        acc_t o0, o1;
        rotate_pair<false, acc_t>(static_cast<acc_t>(r[e0 * st]), static_cast<acc_t>(r[e1 * st]),
                                  c, s, o0, o1);
        r[e0 * st] = static_cast<x_t>(o0);
        r[e1 * st] = static_cast<x_t>(o1);
      }
    }
  }
}

// Launch shape (host only): x over pairs, y over heads, z over tokens within a block; the grid
// strides over tokens.
struct MropeLaunch {
  unsigned grid_x, block_x, block_y, block_z;
};

inline MropeLaunch plan_mrope(const MropeGeometry& mg, int64_t max_blocks = int64_t{1} << 20) {
  const InplaceGeometry& g = mg.inplace;
  int64_t bx = 1;
  while (bx < g.half && bx < 64) bx *= 2;
  const int64_t heads = g.q_heads + g.k_heads;
  int64_t by = 1;
  while (by < heads && bx * by * 2 <= 256) by *= 2;
  const int64_t bz = 256 / (bx * by) > 0 ? 256 / (bx * by) : 1;
  int64_t gx = (g.tokens + bz - 1) / bz;
  if (gx > max_blocks) gx = max_blocks;
  if (gx < 1) gx = 1;
  return {static_cast<unsigned>(gx), static_cast<unsigned>(bx), static_cast<unsigned>(by),
          static_cast<unsigned>(bz)};
}

}  // namespace rope::mrope_gpu
