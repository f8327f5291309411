// The CUDA kernels' per-thread code and launch configuration, written as plain C++ so that one
// source serves two compilers: nvcc builds the kernels from it (rope_cuda_kernels.cu), and g++
// builds a CPU simulator from it (tests/sim/rope_cuda_sim.cpp) that runs every thread of the
// launch grid the host code chooses and checks each memory access. Whatever the simulator proves
// about the index math, vector/tail handling, strides and the position gather holds for the kernel.
//
// No CUDA built-ins here: a thread learns where it is from a ThreadPos (blockIdx/threadIdx/...),
// and every memory access goes through load/store below, which the simulator instruments.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "../../rope_math.h"
#include "../rope_geometry.h"

#if defined(ROPE_SIM)
namespace rope::sim {
// Defined by the simulator: checks and records one access of `bytes` at `p` made as a single
// (possibly vector) instruction that requires `align`-byte alignment. False for a bad access,
// which the simulator then does not perform (it reports it instead of crashing).
bool on_access(const void* p, size_t bytes, size_t elem_bytes, size_t align, bool is_write);
}  // namespace rope::sim
#define ROPE_ACCESS_OK(p, bytes, elem, align, w) ::rope::sim::on_access(p, bytes, elem, align, w)
#else
#define ROPE_ACCESS_OK(p, bytes, elem, align, w) true
#endif

#if defined(__CUDACC__)
#define ROPE_UNROLL _Pragma("unroll")
#else
#define ROPE_UNROLL
#endif

namespace rope::gpu {

// Bytes moved by one vector load/store: 16 (LDG.128/STG.128).
constexpr int kVecBytes = 16;

// Elements of T in one vector access: 8 for half/bfloat16, 4 for float, 2 for double.
template <typename T>
constexpr int kWidth = kVecBytes / static_cast<int>(sizeof(T));

struct Idx3 {
  unsigned x = 0, y = 0, z = 0;
};

// Where a thread is: threadIdx, blockIdx, blockDim, gridDim.
struct ThreadPos {
  Idx3 thread, block, block_dim, grid_dim;
};

// One vector's worth of T, aligned so that a load/store of it is one 16-byte instruction.
template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

template <typename T>
ROPE_HD T load(const T* p) {
  if (!ROPE_ACCESS_OK(p, sizeof(T), sizeof(T), alignof(T), false)) return T();
  return *p;
}

template <typename T>
ROPE_HD void store(T* p, T v) {
  if (!ROPE_ACCESS_OK(p, sizeof(T), sizeof(T), alignof(T), true)) return;
  *p = v;
}

template <typename T, int N>
ROPE_HD Pack<T, N> load_pack(const T* p) {
  using P = Pack<T, N>;
  if (!ROPE_ACCESS_OK(p, sizeof(P), sizeof(T), alignof(P), false)) return P();
  return *reinterpret_cast<const P*>(p);
}

template <typename T, int N>
ROPE_HD void store_pack(T* p, const Pack<T, N>& v) {
  using P = Pack<T, N>;
  if (!ROPE_ACCESS_OK(p, sizeof(P), sizeof(T), alignof(P), true)) return;
  *reinterpret_cast<P*>(p) = v;
}

// LeadIndexer::offsets without the outermost modulo (row < rows makes it a no-op) and, when
// every index fits (`idx32`), with 32-bit divisions, which cost a fraction of 64-bit ones.
ROPE_HD void lead_offsets(const LeadIndexer& ix, int64_t row, bool idx32,
                          int64_t out[kMaxOperands]) {
  for (int t = 0; t < kMaxOperands; ++t) out[t] = 0;
  if (ix.ndim == 0) return;
  if (idx32) {
    uint32_t r = static_cast<uint32_t>(row);
    for (int d = ix.ndim - 1; d > 0; --d) {
      const uint32_t size = static_cast<uint32_t>(ix.sizes[d]);
      const uint32_t q = r / size;
      const int64_t i = static_cast<int64_t>(r - q * size);
      r = q;
      for (int t = 0; t < kMaxOperands; ++t) out[t] += i * ix.strides[t][d];
    }
    row = static_cast<int64_t>(r);
  } else {
    for (int d = ix.ndim - 1; d > 0; --d) {
      const int64_t q = row / ix.sizes[d];
      const int64_t i = row - q * ix.sizes[d];
      row = q;
      for (int t = 0; t < kMaxOperands; ++t) out[t] += i * ix.strides[t][d];
    }
  }
  for (int t = 0; t < kMaxOperands; ++t) out[t] += row * ix.strides[t][0];
}

// A chunk is the unit of work of one thread within one head_dim row: W = kWidth<x_t>
// consecutive elements, i.e. one 16-byte vector. Rotary chunk c covers
//   half-split:  pairs [c*W, c*W + W), whose members are the two vectors at c*W and half + c*W;
//   interleaved: elements [c*W, c*W + W), i.e. pairs [c*W/2, c*W/2 + W/2).
// The last chunk may be partial (count < W); it is then done element by element.
template <typename x_t, bool kInterleaved>
ROPE_HD int64_t rotary_chunks(int64_t half) {
  constexpr int W = kWidth<x_t>;
  return kInterleaved ? (2 * half + W - 1) / W : (half + W - 1) / W;
}

// Pairs of chunk c: first pair index and count.
template <typename x_t, bool kInterleaved>
ROPE_HD void chunk_pairs(int64_t c, int64_t half, int64_t& first, int& count) {
  constexpr int W = kWidth<x_t>;
  constexpr int P = kInterleaved ? W / 2 : W;  // pairs per full chunk
  first = c * P;
  const int64_t left = half - first;
  count = left < P ? static_cast<int>(left) : P;
}

// cos/sin of the pairs of one chunk, converted to the arithmetic type.
template <typename x_t>
struct ChunkTables {
  using acc_t = opmath_t<x_t>;
  static constexpr int P = kWidth<x_t>;  // enough for either layout
  acc_t c[P], s[P];
};

template <typename x_t, typename tab_t>
ROPE_HD void load_tables(const tab_t* cos, int64_t cos_stride, const tab_t* sin,
                         int64_t sin_stride, int64_t first, int count, ChunkTables<x_t>& t) {
  using acc_t = opmath_t<x_t>;
  ROPE_UNROLL
  for (int j = 0; j < ChunkTables<x_t>::P; ++j) {
    if (j < count) {
      t.c[j] = static_cast<acc_t>(load(cos + (first + j) * cos_stride));
      t.s[j] = static_cast<acc_t>(load(sin + (first + j) * sin_stride));
    }
  }
}

// Rotates the pairs [first, first+count) of one row: reads src (stride ss along the head dim),
// writes dst (stride ds). src == dst (in place) is fine: a thread reads its chunk fully before
// writing it, and no other thread touches it. kVec: src/dst rows are 16-byte aligned with unit
// stride and (half-split) half % W == 0, so every full chunk is one or two vector accesses.
template <typename x_t, bool kInterleaved, bool kInverse, bool kVec>
ROPE_HD void rotate_chunk(const x_t* src, int64_t ss, x_t* dst, int64_t ds, int64_t half,
                          int64_t first, int count, const ChunkTables<x_t>& t) {
  using acc_t = opmath_t<x_t>;
  constexpr int W = kWidth<x_t>;
  if (kInterleaved) {
    const int64_t e0 = 2 * first;  // first element of the chunk
    if (kVec && 2 * count == W) {
      Pack<x_t, W> v = load_pack<x_t, W>(src + e0);
      ROPE_UNROLL
      for (int j = 0; j < W / 2; ++j) {
        acc_t o0, o1;
        rotate_pair<kInverse, acc_t>(static_cast<acc_t>(v.v[2 * j]),
                                     static_cast<acc_t>(v.v[2 * j + 1]), t.c[j], t.s[j], o0, o1);
        v.v[2 * j] = static_cast<x_t>(o0);
        v.v[2 * j + 1] = static_cast<x_t>(o1);
      }
      store_pack<x_t, W>(dst + e0, v);
    } else {
      ROPE_UNROLL
      for (int j = 0; j < W / 2; ++j) {
        if (j < count) {
          const int64_t e = e0 + 2 * j;
          acc_t o0, o1;
          rotate_pair<kInverse, acc_t>(static_cast<acc_t>(load(src + e * ss)),
                                       static_cast<acc_t>(load(src + (e + 1) * ss)), t.c[j],
                                       t.s[j], o0, o1);
          store(dst + e * ds, static_cast<x_t>(o0));
          store(dst + (e + 1) * ds, static_cast<x_t>(o1));
        }
      }
    }
  } else {
    if (kVec && count == W) {
      Pack<x_t, W> a = load_pack<x_t, W>(src + first);
      Pack<x_t, W> b = load_pack<x_t, W>(src + half + first);
      ROPE_UNROLL
      for (int j = 0; j < W; ++j) {
        acc_t o0, o1;
        rotate_pair<kInverse, acc_t>(static_cast<acc_t>(a.v[j]), static_cast<acc_t>(b.v[j]),
                                     t.c[j], t.s[j], o0, o1);
        a.v[j] = static_cast<x_t>(o0);
        b.v[j] = static_cast<x_t>(o1);
      }
      store_pack<x_t, W>(dst + first, a);
      store_pack<x_t, W>(dst + half + first, b);
    } else {
      ROPE_UNROLL
      for (int j = 0; j < W; ++j) {
        if (j < count) {
          const int64_t p0 = pair_first(first + j, half, false);
          const int64_t p1 = pair_second(first + j, half, false);
          acc_t o0, o1;
          rotate_pair<kInverse, acc_t>(static_cast<acc_t>(load(src + p0 * ss)),
                                       static_cast<acc_t>(load(src + p1 * ss)), t.c[j], t.s[j],
                                       o0, o1);
          store(dst + p0 * ds, static_cast<x_t>(o0));
          store(dst + p1 * ds, static_cast<x_t>(o1));
        }
      }
    }
  }
}

// Copies elements [e0, min(e0 + W, end)) of a row bit-exactly (the dims past rotary_dim).
template <typename x_t, bool kVec>
ROPE_HD void copy_chunk(const x_t* src, int64_t ss, x_t* dst, int64_t e0, int64_t end) {
  constexpr int W = kWidth<x_t>;
  if (kVec && e0 + W <= end) {
    store_pack<x_t, W>(dst + e0, load_pack<x_t, W>(src + e0));
    return;
  }
  ROPE_UNROLL
  for (int j = 0; j < W; ++j) {
    if (e0 + j < end) store(dst + e0 + j, load(src + (e0 + j) * ss));
  }
}

// ---------------------------------------------------------------------------------------------
// rope.apply / rope.apply_backward: out (contiguous) = rotate(x, cos, sin).
// Block (bx, by): threadIdx.x walks the chunks of a row (rotary chunks, then pass-through
// chunks), threadIdx.y picks the row; blocks stride over rows.

template <typename x_t, typename tab_t>
struct ApplyArgs {
  const x_t* x;
  x_t* out;
  const tab_t* cos;
  const tab_t* sin;
  ApplyGeometry g;
  int64_t rot_chunks;   // rotary chunks per row
  int64_t tail_chunks;  // pass-through chunks per row
  bool idx32;
};

template <typename x_t, typename tab_t, bool kInterleaved, bool kInverse, bool kVec>
ROPE_HD void apply_thread(const ApplyArgs<x_t, tab_t>& a, const ThreadPos& tp) {
  constexpr int W = kWidth<x_t>;
  const ApplyGeometry& g = a.g;
  const int64_t chunks = a.rot_chunks + a.tail_chunks;
  const int64_t row_step = static_cast<int64_t>(tp.grid_dim.x) * tp.block_dim.y;
  for (int64_t row = static_cast<int64_t>(tp.block.x) * tp.block_dim.y + tp.thread.y;
       row < g.rows; row += row_step) {
    int64_t off[kMaxOperands];
    lead_offsets(g.lead, row, a.idx32, off);
    const x_t* src = a.x + off[0];
    x_t* dst = a.out + row * g.head_dim;
    for (int64_t c = tp.thread.x; c < chunks; c += tp.block_dim.x) {
      if (c < a.rot_chunks) {
        int64_t first;
        int count;
        chunk_pairs<x_t, kInterleaved>(c, g.half, first, count);
        ChunkTables<x_t> t;
        load_tables<x_t, tab_t>(a.cos + off[1], g.cos_last, a.sin + off[2], g.sin_last, first,
                                count, t);
        rotate_chunk<x_t, kInterleaved, kInverse, kVec>(src, g.x_last, dst, 1, g.half, first,
                                                        count, t);
      } else {
        copy_chunk<x_t, kVec>(src, g.x_last, dst, 2 * g.half + (c - a.rot_chunks) * W,
                              g.head_dim);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// rope.apply_: query and key rotated in place in one launch.
// Block (bx, by, bz): threadIdx.x walks a row's rotary chunks, threadIdx.y the heads (query heads
// 0..Hq-1, then key heads), threadIdx.z the token; blocks stride over tokens. A thread loads the
// cos/sin of its chunk once per token and reuses them for every head it rotates.
//
// Out-of-range positions: a token whose position p is not in [0, max_position) is skipped (its
// query and key rows are left unchanged) so the cache is never read out of bounds. The host
// raises instead when position checking is on (see rope_cuda_host.h).

template <typename x_t, typename tab_t>
struct InplaceArgs {
  x_t* q;
  x_t* k;  // nullptr when key is None (then g.k_heads == 0)
  const void* pos;
  bool pos64;
  const tab_t* cache;
  InplaceGeometry g;
  int64_t rot_chunks;
  bool idx32;
};

template <typename x_t, typename tab_t, bool kInterleaved, bool kVec>
ROPE_HD void apply_inplace_thread(const InplaceArgs<x_t, tab_t>& a, const ThreadPos& tp) {
  const InplaceGeometry& g = a.g;
  const int64_t heads = g.q_heads + g.k_heads;
  const int64_t tok_step = static_cast<int64_t>(tp.grid_dim.x) * tp.block_dim.z;
  for (int64_t tok = static_cast<int64_t>(tp.block.x) * tp.block_dim.z + tp.thread.z;
       tok < g.tokens; tok += tok_step) {
    int64_t off[kMaxOperands];
    lead_offsets(g.lead, tok, a.idx32, off);
    const int64_t p = a.pos64 ? load(static_cast<const int64_t*>(a.pos) + off[2])
                              : static_cast<int64_t>(load(static_cast<const int32_t*>(a.pos) + off[2]));
    if (p < 0 || p >= g.max_position) continue;  // never read outside the cache
    const tab_t* cos = a.cache + p * g.cache_row_stride;
    const tab_t* sin = cos + g.half * g.cache_col_stride;
    for (int64_t c = tp.thread.x; c < a.rot_chunks; c += tp.block_dim.x) {
      int64_t first;
      int count;
      chunk_pairs<x_t, kInterleaved>(c, g.half, first, count);
      ChunkTables<x_t> t;
      load_tables<x_t, tab_t>(cos, g.cache_col_stride, sin, g.cache_col_stride, first, count, t);
      for (int64_t h = tp.thread.y; h < heads; h += tp.block_dim.y) {
        const bool is_q = h < g.q_heads;
        x_t* row = is_q ? a.q + off[0] + h * g.q_head_stride
                        : a.k + off[1] + (h - g.q_heads) * g.k_head_stride;
        const int64_t st = is_q ? g.q_last : g.k_last;
        rotate_chunk<x_t, kInterleaved, false, kVec>(row, st, row, st, g.half, first, count, t);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Launch configuration (host only). The kernels' host code and the simulator both call these.

// At most this many blocks; beyond it blocks stride (a grid this size already fills any GPU).
constexpr int64_t kMaxBlocks = int64_t{1} << 20;
constexpr int64_t kThreadsPerBlock = 256;

struct LaunchPlan {
  Idx3 grid, block;
  bool vec = false;
  bool idx32 = false;
  int64_t rot_chunks = 0, tail_chunks = 0;
};

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

inline int64_t pow2_at_least(int64_t n) {
  int64_t p = 1;
  while (p < n) p *= 2;
  return p;
}

inline bool aligned(const void* p, int64_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % static_cast<uintptr_t>(bytes) == 0;
}

// True if every stride of operand `t` of the indexer is a multiple of `w` elements.
inline bool lead_strides_multiple_of(const LeadIndexer& ix, int t, int64_t w) {
  for (int d = 0; d < ix.ndim; ++d) {
    if (ix.strides[t][d] % w != 0) return false;
  }
  return true;
}

// Vector path for one operand's rows: unit stride along the head dim, every row start 16-byte
// aligned, and (half-split) the second member of each pair vector-aligned too.
inline bool rows_vectorizable(const void* base, int64_t last_stride, bool lead_ok,
                              int64_t extra_row_stride, int64_t half, bool interleaved, int w) {
  return last_stride == 1 && aligned(base, kVecBytes) && lead_ok && extra_row_stride % w == 0 &&
         (interleaved || half % w == 0);
}

template <typename x_t>
LaunchPlan plan_apply(const ApplyGeometry& g, const x_t* x, const x_t* out, bool interleaved,
                      int64_t max_blocks = kMaxBlocks) {
  constexpr int W = kWidth<x_t>;
  LaunchPlan p;
  p.rot_chunks = interleaved ? rotary_chunks<x_t, true>(g.half) : rotary_chunks<x_t, false>(g.half);
  p.tail_chunks = ceil_div(g.head_dim - 2 * g.half, W);
  // out rows start at r * head_dim; pass-through chunks start at 2*half: both must be aligned.
  p.vec = rows_vectorizable(x, g.x_last, lead_strides_multiple_of(g.lead, 0, W), 0, g.half,
                            interleaved, W) &&
          aligned(out, kVecBytes) && g.head_dim % W == 0 && (2 * g.half) % W == 0;
  p.idx32 = g.rows <= static_cast<int64_t>(UINT32_MAX);
  const int64_t bx = std::min<int64_t>(pow2_at_least(p.rot_chunks + p.tail_chunks), 64);
  const int64_t by = std::max<int64_t>(1, kThreadsPerBlock / bx);
  p.block = {static_cast<unsigned>(bx), static_cast<unsigned>(by), 1};
  p.grid = {static_cast<unsigned>(std::min(ceil_div(g.rows, by), max_blocks)), 1, 1};
  return p;
}

template <typename x_t>
LaunchPlan plan_apply_inplace(const InplaceGeometry& g, const x_t* q, const x_t* k,
                              bool interleaved, int64_t max_blocks = kMaxBlocks) {
  constexpr int W = kWidth<x_t>;
  LaunchPlan p;
  p.rot_chunks = interleaved ? rotary_chunks<x_t, true>(g.half) : rotary_chunks<x_t, false>(g.half);
  p.vec = rows_vectorizable(q, g.q_last, lead_strides_multiple_of(g.lead, 0, W), g.q_head_stride,
                            g.half, interleaved, W) &&
          (g.k_heads == 0 || rows_vectorizable(k, g.k_last, lead_strides_multiple_of(g.lead, 1, W),
                                               g.k_head_stride, g.half, interleaved, W));
  p.idx32 = g.tokens <= static_cast<int64_t>(UINT32_MAX);
  const int64_t heads = g.q_heads + g.k_heads;
  const int64_t bx = std::min<int64_t>(pow2_at_least(p.rot_chunks), 64);
  const int64_t by = std::max<int64_t>(1, std::min<int64_t>(heads, 2 * kThreadsPerBlock / bx));
  const int64_t bz = std::max<int64_t>(1, kThreadsPerBlock / (bx * by));
  p.block = {static_cast<unsigned>(bx), static_cast<unsigned>(by), static_cast<unsigned>(bz)};
  p.grid = {static_cast<unsigned>(std::min(ceil_div(g.tokens, bz), max_blocks)), 1, 1};
  return p;
}

}  // namespace rope::gpu
