// The CUDA kernels' per-thread code, written as plain C++ so that one source serves two
// compilers: nvcc builds the kernels from it (rope_cuda.cu), and g++ builds the CPU simulator
// (tests/sim/cuda_sim.cpp) that runs every thread of the grid the host code plans and checks
// each memory access. Whatever the simulator proves about the index math, vector/tail handling,
// strides and gathers holds for the kernels.
//
// No CUDA built-ins here: a thread learns where it is from a ThreadPos, every memory access goes
// through load/store below (which the simulator instruments), and a failed device check goes
// through ROPE_DEVICE_CHECK.
#pragma once

#include <cstddef>
#include <cstdint>

#include "../../rope_math.h"
#include "../geometry.h"

#if defined(ROPE_SIM)
namespace rope::sim {
// Defined by the simulator: checks and records one access of `bytes` at `p`, made as a single
// (possibly vector) instruction that needs `align`-byte alignment. False for a bad access, which
// the simulator then does not perform (it reports it instead of crashing).
bool on_access(const void* p, size_t bytes, size_t elem_bytes, size_t align, bool is_write);
// A device-side check that failed (the kernel would trap).
void on_trap(const char* what);
}  // namespace rope::sim
#define ROPE_ACCESS_OK(p, bytes, elem, align, w) ::rope::sim::on_access(p, bytes, elem, align, w)
#define ROPE_DEVICE_CHECK(cond, what) \
  if (!(cond)) ::rope::sim::on_trap(what)
#elif defined(__CUDA_ARCH__)
#define ROPE_ACCESS_OK(p, bytes, elem, align, w) true
// A device-side assertion, as torch's own index checks: the kernel stops with
// cudaErrorAssert ("device-side assert triggered"), reported at the next synchronization.
#define ROPE_DEVICE_CHECK(cond, what) \
  if (!(cond)) __assert_fail(what, "rope_ext", 0, "rope kernel")
#else
// Host passes of a device file (nvcc's, and the C++ compiles that include the per-thread code for
// its definitions) never run a kernel: the condition is named, not evaluated.
#define ROPE_ACCESS_OK(p, bytes, elem, align, w) true
#define ROPE_DEVICE_CHECK(cond, what) static_cast<void>(sizeof(cond))
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

// One 16-byte access. On the device, explicitly a global one (LDG.128 / STG.128): the pointers
// come through a parameter struct, from which the compiler would only emit generic accesses.
// Cached loads (not the read-only path): the in-place ops write what they read.
template <typename T, int N>
ROPE_HD Pack<T, N> load_pack(const T* p) {
  using P = Pack<T, N>;
  static_assert(sizeof(P) == kVecBytes, "a pack is one 16-byte vector");
  if (!ROPE_ACCESS_OK(p, sizeof(P), sizeof(T), alignof(P), false)) return P();
#if defined(__CUDA_ARCH__)
  const uint4 bits = __ldca(reinterpret_cast<const uint4*>(p));
  P v;
  __builtin_memcpy(&v, &bits, sizeof(P));
  return v;
#else
  return *reinterpret_cast<const P*>(p);
#endif
}

template <typename T, int N>
ROPE_HD void store_pack(T* p, const Pack<T, N>& v) {
  using P = Pack<T, N>;
  if (!ROPE_ACCESS_OK(p, sizeof(P), sizeof(T), alignof(P), true)) return;
#if defined(__CUDA_ARCH__)
  uint4 bits;
  __builtin_memcpy(&bits, &v, sizeof(P));
  __stwb(reinterpret_cast<uint4*>(p), bits);
#else
  *reinterpret_cast<P*>(p) = v;
#endif
}

// A pack under 16 bytes (a chunk's W float8 codes) as one 2-, 4- or 8-byte global store.
template <typename T, int N>
ROPE_HD void store_small_pack(T* p, const Pack<T, N>& v) {
  using P = Pack<T, N>;
  static_assert(sizeof(P) == 2 || sizeof(P) == 4 || sizeof(P) == 8, "a pack of 2, 4 or 8 bytes");
  if (!ROPE_ACCESS_OK(p, sizeof(P), sizeof(T), alignof(P), true)) return;
#if defined(__CUDA_ARCH__)
  if constexpr (sizeof(P) == 8) {
    uint2 bits;
    __builtin_memcpy(&bits, &v, sizeof(P));
    __stwb(reinterpret_cast<uint2*>(p), bits);
  } else if constexpr (sizeof(P) == 4) {
    unsigned bits;
    __builtin_memcpy(&bits, &v, sizeof(P));
    __stwb(reinterpret_cast<unsigned*>(p), bits);
  } else {
    unsigned short bits;
    __builtin_memcpy(&bits, &v, sizeof(P));
    __stwb(reinterpret_cast<unsigned short*>(p), bits);
  }
#else
  *reinterpret_cast<P*>(p) = v;
#endif
}

// Element offsets of one token in every operand. Kernels index only with compile-time indices
// (unrolled loops, selects): a runtime index into a kernel parameter or a local array would put
// it in local memory, which a test of the compiled code rules out.
struct Offsets {
  int64_t o[kMaxOperands];
};

// LeadIndexer::offsets without the outermost division (token < tokens makes it a no-op) and,
// when every index fits (`idx32`), with 32-bit divisions, which cost a fraction of 64-bit ones.
ROPE_HD Offsets lead_offsets(const LeadIndexer& ix, int64_t token, bool idx32) {
  Offsets out;
  ROPE_UNROLL
  for (int t = 0; t < kMaxOperands; ++t) out.o[t] = 0;
  if (ix.ndim == 0) return out;
  uint32_t r32 = static_cast<uint32_t>(token);
  ROPE_UNROLL
  for (int d = kMaxLeadDims - 1; d > 0; --d) {
    if (d < ix.ndim) {  // the inner dims, innermost first
      int64_t i;
      if (idx32) {
        const uint32_t size = static_cast<uint32_t>(ix.sizes[d]);
        const uint32_t q = r32 / size;
        i = static_cast<int64_t>(r32 - q * size);
        r32 = q;
      } else {
        const int64_t q = token / ix.sizes[d];
        i = token - q * ix.sizes[d];
        token = q;
      }
      ROPE_UNROLL
      for (int t = 0; t < kMaxOperands; ++t) out.o[t] += i * ix.strides[t][d];
    }
  }
  if (idx32) token = static_cast<int64_t>(r32);
  ROPE_UNROLL
  for (int t = 0; t < kMaxOperands; ++t) out.o[t] += token * ix.strides[t][0];
  return out;
}

template <typename T>
ROPE_HD T pick3(int k, T a, T b, T c) {
  return k == 0 ? a : (k == 1 ? b : c);
}

// A chunk is the unit of work of one thread within one head_dim row: W = kWidth<x_t>
// consecutive elements, one 16-byte vector. Rotary chunk c covers
//   half-split:  pairs [c*W, c*W + W), whose members are the two vectors at c*W and half + c*W;
//   interleaved: elements [c*W, c*W + W), i.e. pairs [c*W/2, c*W/2 + W/2).
// The last rotary chunk may be partial (count < W); it is then done element by element.
// Pass-through chunks (dims >= rotary_dim) follow the rotary ones.
template <typename x_t, bool kInterleaved>
ROPE_HD int64_t rotary_chunks(int64_t half) {
  constexpr int W = kWidth<x_t>;
  return kInterleaved ? (2 * half + W - 1) / W : (half + W - 1) / W;
}

template <typename x_t, bool kInterleaved>
ROPE_HD void chunk_pairs(int64_t c, int64_t half, int64_t& first, int& count) {
  constexpr int W = kWidth<x_t>;
  constexpr int P = kInterleaved ? W / 2 : W;  // pairs per full chunk
  first = c * P;
  const int64_t left = half - first;
  count = left < P ? static_cast<int>(left) : P;
}

// The table rows of one token: one row, or one per MRoPE position component. tab_t is x's dtype
// or its arithmetic type (the host casts any other table dtype); load_tables converts.
template <typename tab_t>
struct TokenRows {
  const tab_t *cos0, *cos1, *cos2;
  const tab_t *sin0, *sin1, *sin2;
};

ROPE_HD int64_t load_position(const void* pos, bool pos64, int64_t offset) {
  return pos64 ? load(static_cast<const int64_t*>(pos) + offset)
               : static_cast<int64_t>(load(static_cast<const int32_t*>(pos) + offset));
}

// The cos/sin rows of the token at lead offsets `off`. Positions are checked here, on the device:
// one outside [0, rows) stops the kernel before its table row is read.
template <typename tab_t>
ROPE_HD TokenRows<tab_t> token_rows(const RotateGeometry& g, const tab_t* cos, const tab_t* sin,
                                    const void* pos, const Offsets& off) {
  const TableDesc& t = g.table;
  TokenRows<tab_t> r;
  if (t.kind == TableKind::kStrided) {
    r.cos0 = r.cos1 = r.cos2 = cos + off.o[kTab0];
    r.sin0 = r.sin1 = r.sin2 = sin + off.o[kTab1];
    return r;
  }
  int64_t row[kMropeComponents];
  ROPE_UNROLL
  for (int j = 0; j < kMropeComponents; ++j) {
    row[j] = 0;
    if (j == 0 || t.kind == TableKind::kMrope) {
      const int64_t p = load_position(pos, t.pos64, off.o[kTab0] + j * t.pos_component);
      ROPE_DEVICE_CHECK(p >= 0 && p < t.rows, "rope: positions must lie in [0, max_position)");
      row[j] = (p >= 0 && p < t.rows) ? p : 0;  // never read outside the table
    }
  }
  r.cos0 = cos + row[0] * t.cos_row;
  r.cos1 = cos + row[1] * t.cos_row;
  r.cos2 = cos + row[2] * t.cos_row;
  r.sin0 = sin + row[0] * t.sin_row;
  r.sin1 = sin + row[1] * t.sin_row;
  r.sin2 = sin + row[2] * t.sin_row;
  return r;
}

// cos/sin of the pairs of one chunk, in the arithmetic type, sin negated for the inverse.
template <typename x_t>
struct ChunkTables {
  using acc_t = opmath_t<x_t>;
  static constexpr int P = kWidth<x_t>;  // enough for either layout
  acc_t c[P], s[P];
};

// tvec: the tables' rows are one component's (not MRoPE), unit stride along the pairs, and
// 16-byte aligned wherever a run of kWidth<tab_t> pairs starts (the host's tables_vectorizable):
// a chunk's cos and sin then come in whole vectors where `first` and `count` allow.
template <typename x_t, typename tab_t>
ROPE_HD void load_tables(const RotateGeometry& g, const TokenRows<tab_t>& r, int64_t first,
                         int count, bool tvec, ChunkTables<x_t>& t) {
  using acc_t = opmath_t<x_t>;
  constexpr int P = ChunkTables<x_t>::P;
  constexpr int TW = kWidth<tab_t>;
  if (tvec && (first % TW) == 0 && (count % TW) == 0) {
    ROPE_UNROLL
    for (int j0 = 0; j0 < P; j0 += TW) {
      if (j0 < count) {
        const Pack<tab_t, TW> c = load_pack<tab_t, TW>(r.cos0 + first + j0);
        const Pack<tab_t, TW> s = load_pack<tab_t, TW>(r.sin0 + first + j0);
        ROPE_UNROLL
        for (int j = 0; j < TW && j0 + j < P; ++j) {
          t.c[j0 + j] = static_cast<acc_t>(c.v[j]);
          t.s[j0 + j] = g.inverse ? -static_cast<acc_t>(s.v[j]) : static_cast<acc_t>(s.v[j]);
        }
      }
    }
    return;
  }
  const TableDesc& d = g.table;
  const bool mrope = d.kind == TableKind::kMrope;
  ROPE_UNROLL
  for (int j = 0; j < P; ++j) {
    if (j < count) {
      const int64_t pair = first + j;
      const int k = mrope ? mrope_component(pair, d.section, d.mrope_interleaved) : 0;
      t.c[j] = static_cast<acc_t>(load(pick3(k, r.cos0, r.cos1, r.cos2) + pair * d.cos_col));
      const acc_t s = static_cast<acc_t>(load(pick3(k, r.sin0, r.sin1, r.sin2) + pair * d.sin_col));
      t.s[j] = g.inverse ? -s : s;
    }
  }
}

// Rotates the pairs [first, first+count) of one row: reads src (stride ss along the head dim),
// writes dst (stride ds). src == dst (in place) is fine: a thread reads its chunk fully before
// writing it, and no other thread touches it. vec: src/dst rows are 16-byte aligned with unit
// stride and (half-split) half % W == 0, so a full chunk is one or two vector accesses.
// The rotated values are also handed to `also` (the KV-cache write): a vector's worth at once,
// also.chunk(first element, pack), where the rows are vectors, else also(element, value).
template <typename x_t, bool kInterleaved, typename Also>
ROPE_HD void rotate_chunk(const x_t* src, int64_t ss, x_t* dst, int64_t ds, int64_t half,
                          int64_t first, int count, const ChunkTables<x_t>& t, bool vec,
                          Also&& also) {
  using acc_t = opmath_t<x_t>;
  constexpr int W = kWidth<x_t>;
  if (kInterleaved) {
    const int64_t e0 = 2 * first;  // first element of the chunk
    if (vec && 2 * count == W) {
      Pack<x_t, W> v = load_pack<x_t, W>(src + e0);
      ROPE_UNROLL
      for (int j = 0; j < W / 2; ++j) {
        acc_t o0, o1;
        rotate_pair<acc_t>(static_cast<acc_t>(v.v[2 * j]),
                                  static_cast<acc_t>(v.v[2 * j + 1]), t.c[j], t.s[j], o0, o1);
        v.v[2 * j] = static_cast<x_t>(o0);
        v.v[2 * j + 1] = static_cast<x_t>(o1);
      }
      store_pack<x_t, W>(dst + e0, v);
      also.chunk(e0, v);
      return;
    }
    ROPE_UNROLL
    for (int j = 0; j < W / 2; ++j) {
      if (j < count) {
        const int64_t e = e0 + 2 * j;
        acc_t o0, o1;
        rotate_pair<acc_t>(static_cast<acc_t>(load(src + e * ss)),
                                  static_cast<acc_t>(load(src + (e + 1) * ss)), t.c[j], t.s[j],
                                  o0, o1);
        const x_t r0 = static_cast<x_t>(o0), r1 = static_cast<x_t>(o1);
        store(dst + e * ds, r0);
        store(dst + (e + 1) * ds, r1);
        also(e, r0);
        also(e + 1, r1);
      }
    }
    return;
  }
  if (vec && count == W) {
    Pack<x_t, W> a = load_pack<x_t, W>(src + first);
    Pack<x_t, W> b = load_pack<x_t, W>(src + half + first);
    ROPE_UNROLL
    for (int j = 0; j < W; ++j) {
      acc_t o0, o1;
      rotate_pair<acc_t>(static_cast<acc_t>(a.v[j]), static_cast<acc_t>(b.v[j]), t.c[j],
                                t.s[j], o0, o1);
      a.v[j] = static_cast<x_t>(o0);
      b.v[j] = static_cast<x_t>(o1);
    }
    store_pack<x_t, W>(dst + first, a);
    store_pack<x_t, W>(dst + half + first, b);
    also.chunk(first, a);
    also.chunk(half + first, b);
    return;
  }
  ROPE_UNROLL
  for (int j = 0; j < W; ++j) {
    if (j < count) {
      const int64_t p0 = first + j, p1 = half + first + j;
      acc_t o0, o1;
      rotate_pair<acc_t>(static_cast<acc_t>(load(src + p0 * ss)),
                                static_cast<acc_t>(load(src + p1 * ss)), t.c[j], t.s[j], o0, o1);
      const x_t r0 = static_cast<x_t>(o0), r1 = static_cast<x_t>(o1);
      store(dst + p0 * ds, r0);
      store(dst + p1 * ds, r1);
      also(p0, r0);
      also(p1, r1);
    }
  }
}

struct NoAlso {
  template <typename T>
  ROPE_HD void operator()(int64_t, T) const {}
  template <typename P>
  ROPE_HD void chunk(int64_t, const P&) const {}
};

// Elements [e0, min(e0 + W, end)) of a row, handed to `put` as rotate_chunk hands them to
// `also` (their KV-cache write). vec: src is a 16-byte aligned unit-stride row and e0 + W <= end.
template <typename x_t, typename Put>
ROPE_HD void read_chunk(const x_t* src, int64_t ss, int64_t e0, int64_t end, bool vec, Put&& put) {
  constexpr int W = kWidth<x_t>;
  if (vec && e0 + W <= end) {
    put.chunk(e0, load_pack<x_t, W>(src + e0));
    return;
  }
  ROPE_UNROLL
  for (int j = 0; j < W; ++j) {
    if (e0 + j < end) put(e0 + j, load(src + (e0 + j) * ss));
  }
}

// The same elements copied bit for bit to dst (unit stride), as one vector store when vec.
template <typename x_t>
ROPE_HD void copy_chunk(const x_t* src, int64_t ss, x_t* dst, int64_t e0, int64_t end, bool vec) {
  constexpr int W = kWidth<x_t>;
  if (vec && e0 + W <= end) {
    store_pack<x_t, W>(dst + e0, load_pack<x_t, W>(src + e0));
    return;
  }
  ROPE_UNROLL
  for (int j = 0; j < W; ++j) {
    if (e0 + j < end) store(dst + e0 + j, load(src + (e0 + j) * ss));
  }
}

// ---------------------------------------------------------------------------------------------
// rotate_thread: every op of geometry.h RotateGeometry (apply, apply_backward, apply.out, apply_,
// mrope_, apply_positions). Block (bx, by, bz): threadIdx.x walks the chunks of a row (rotary
// chunks, then pass-through chunks when copy_tail), threadIdx.y the heads (target 0's, then
// target 1's), threadIdx.z the token; blocks stride over tokens. A thread loads the cos/sin of
// its chunk once per token and reuses them for every head it rotates.

// tab_t: the tables' element type, x_t or opmath_t<x_t> (converted as they are loaded).
template <typename x_t, typename tab_t = opmath_t<x_t>>
struct RotateArgs {
  const x_t* src[2];
  x_t* dst[2];
  const tab_t* cos;  // strided: the cos tensor; gathered/MRoPE: the table's row 0
  const tab_t* sin;
  const void* pos;
  RotateGeometry g;
  int64_t rot_chunks;   // rotary chunks per row
  int64_t tail_chunks;  // pass-through chunks per row (copy_tail)
  bool idx32;
  bool vec;
  bool tvec;  // whole-vector table loads (load_tables)
};

// Head h over both targets (target 0's heads, then target 1's): where its row starts in src and
// dst for the token at `off`, and its strides along the head dim. For every kernel's arguments
// with src[2], dst[2] and a RotateGeometry g (RotateArgs, NormRopeArgs); the constant indices
// keep the arguments in the kernel's parameter space (a variable index would copy them to a
// stack frame).
template <typename x_t>
struct HeadRow {
  const x_t* src;
  x_t* dst;
  int64_t src_last, dst_last;
};

template <template <typename, typename> class Args, typename x_t, typename tab_t>
ROPE_HD HeadRow<x_t> head_row(const Args<x_t, tab_t>& a, const Offsets& off, int64_t h) {
  const TargetDesc& t0 = a.g.target[0];
  const TargetDesc& t1 = a.g.target[1];
  if (h < t0.heads) {
    return {a.src[0] + off.o[kSrc0] + h * t0.src_head, a.dst[0] + off.o[kDst0] + h * t0.dst_head,
            t0.src_last, t0.dst_last};
  }
  h -= t0.heads;
  return {a.src[1] + off.o[kSrc1] + h * t1.src_head, a.dst[1] + off.o[kDst1] + h * t1.dst_head,
          t1.src_last, t1.dst_last};
}

template <typename x_t, typename tab_t, bool kInterleaved>
ROPE_HD void rotate_thread(const RotateArgs<x_t, tab_t>& a, const ThreadPos& tp) {
  constexpr int W = kWidth<x_t>;
  const RotateGeometry& g = a.g;
  const int64_t heads = g.target[0].heads + (g.targets > 1 ? g.target[1].heads : 0);
  const int64_t chunks = a.rot_chunks + a.tail_chunks;
  const int64_t tok_step = static_cast<int64_t>(tp.grid_dim.x) * tp.block_dim.z;
  for (int64_t tok = static_cast<int64_t>(tp.block.x) * tp.block_dim.z + tp.thread.z;
       tok < g.tokens; tok += tok_step) {
    const Offsets off = lead_offsets(g.lead, tok, a.idx32);
    const TokenRows<tab_t> rows = token_rows(g, a.cos, a.sin, a.pos, off);
    for (int64_t c = tp.thread.x; c < chunks; c += tp.block_dim.x) {
      ChunkTables<x_t> t;
      int64_t first = 0;
      int count = 0;
      if (c < a.rot_chunks) {
        chunk_pairs<x_t, kInterleaved>(c, g.half, first, count);
        load_tables(g, rows, first, count, a.tvec, t);
      }
      for (int64_t h = tp.thread.y; h < heads; h += tp.block_dim.y) {
        const HeadRow<x_t> row = head_row(a, off, h);
        if (c < a.rot_chunks) {
          rotate_chunk<x_t, kInterleaved>(row.src, row.src_last, row.dst, row.dst_last, g.half,
                                          first, count, t, a.vec, NoAlso{});
        } else {
          copy_chunk<x_t>(row.src, row.src_last, row.dst, 2 * g.half + (c - a.rot_chunks) * W,
                          g.head_dim, a.vec);
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// cache_thread: rope.apply_and_cache_. The rotation of rotate_thread on query (target 0) and key
// (target 1) in place; each rotated key chunk also goes, converted, into the key cache, and the
// value rows are stored into the value cache. threadIdx.y walks the rows of a token: query heads,
// key heads, then value heads; threadIdx.x the chunks of a row, max(key chunks, value chunks).
// A value chunk is as wide as a key row's rotary chunk (two vectors half-split, one interleaved),
// so that every thread of a block moves about as many bytes.

template <typename x_t, typename tab_t = opmath_t<x_t>>
struct CacheArgs {
  RotateArgs<x_t, tab_t> rot;  // its g is the rotation of the CacheGeometry
  CacheDesc cg;
  const x_t* value;
  const void* slots;
  void* key_cache;
  void* value_cache;
  const float* k_scale;  // nullptr unless fp8
  const float* v_scale;
  int64_t key_chunks;    // rotary + pass-through chunks of a key row
  int64_t value_chunks;  // chunks of value_vecs vectors of a value row
  int value_vecs;        // 2 half-split, 1 interleaved
  bool v_vec;            // value rows 16-byte aligned with unit stride, value_dim % W == 0
  bool kc_vec, vc_vec;   // the caches take whole chunks (CacheStore::vec)
};

// The cache write of one element, or of a chunk's W elements: kept (kSame) or value / scale to
// float8. vec: the row takes a chunk as one store (the host's cache_rows_vectorizable): 16
// bytes, or W float8 codes, at every multiple of W.
template <typename x_t>
struct CacheStore {
  void* row;  // the slot's row in the cache, of x_t or of 1-byte float8 codes
  int64_t last;
  float scale;
  CacheFormat format;
  bool vec;
  ROPE_HD uint8_t code(x_t v) const {
    const Fp8Format fmt = format == CacheFormat::kE4M3FN ? Fp8Format::kE4M3FN : Fp8Format::kE5M2;
    return float_to_fp8(static_cast<float>(v) / scale, fmt);
  }
  ROPE_HD void operator()(int64_t e, x_t v) const {
    if (format == CacheFormat::kSame) {
      store(static_cast<x_t*>(row) + e * last, v);
    } else {
      store(static_cast<uint8_t*>(row) + e * last, code(v));
    }
  }
  // Elements [e0, e0 + W), e0 a multiple of W. (Each conversion written once: the kernels
  // inline this at every store site.)
  ROPE_HD void chunk(int64_t e0, const Pack<x_t, kWidth<x_t>>& v) const {
    constexpr int W = kWidth<x_t>;
    if (format == CacheFormat::kSame) {
      store_row_pack(static_cast<x_t*>(row) + e0 * last, last, v, vec);
      return;
    }
    Pack<uint8_t, W> codes;
    ROPE_UNROLL
    for (int j = 0; j < W; ++j) codes.v[j] = code(v.v[j]);
    store_row_pack(static_cast<uint8_t*>(row) + e0 * last, last, codes, vec);
  }

 private:
  // A pack at p: one store where vec, else element by element `last` apart.
  template <typename T, int N>
  static ROPE_HD void store_row_pack(T* p, int64_t last, const Pack<T, N>& v, bool vec) {
    if (!vec) {
      ROPE_UNROLL
      for (int j = 0; j < N; ++j) store(p + j * last, v.v[j]);
    } else if constexpr (sizeof(Pack<T, N>) == kVecBytes) {
      store_pack<T, N>(p, v);
    } else {
      store_small_pack<T, N>(p, v);
    }
  }
};

// One chunk of a query (or, with `also`, key) row rotated in place, for either layout.
template <typename x_t, typename Also>
ROPE_HD void rotate_row_chunk(const RotateGeometry& g, x_t* row, int64_t last, int64_t first,
                              int count, const ChunkTables<x_t>& t, bool vec, Also&& also) {
  if (g.interleaved) {
    rotate_chunk<x_t, true>(row, last, row, last, g.half, first, count, t, vec, also);
  } else {
    rotate_chunk<x_t, false>(row, last, row, last, g.half, first, count, t, vec, also);
  }
}

// Layout and cache format are runtime branches here (uniform across the grid), which keeps the
// library to one cache kernel per dtype.
template <typename x_t, typename tab_t>
ROPE_HD void cache_thread(const CacheArgs<x_t, tab_t>& a, const ThreadPos& tp) {
  constexpr int W = kWidth<x_t>;
  const RotateArgs<x_t, tab_t>& r = a.rot;
  const RotateGeometry& g = r.g;
  const CacheDesc& cg = a.cg;
  const int64_t es = cg.format == CacheFormat::kSame ? sizeof(x_t) : 1;
  const int64_t q_heads = g.target[0].heads, qk_heads = q_heads + cg.kv_heads;
  const int64_t rows_per_token = qk_heads + cg.kv_heads;
  const int64_t chunks = a.key_chunks > a.value_chunks ? a.key_chunks : a.value_chunks;
  const int64_t tok_step = static_cast<int64_t>(tp.grid_dim.x) * tp.block_dim.z;
  // Read once: the compiler cannot hoist these loads past the cache stores (they may alias).
  const bool fp8 = cg.format != CacheFormat::kSame;
  const float k_scale = fp8 ? load(a.k_scale) : 1.0f, v_scale = fp8 ? load(a.v_scale) : 1.0f;
  for (int64_t tok = static_cast<int64_t>(tp.block.x) * tp.block_dim.z + tp.thread.z;
       tok < g.tokens; tok += tok_step) {
    const Offsets off = lead_offsets(g.lead, tok, r.idx32);
    // The table rows (and the check of the position) where the thread has a query or key row:
    // the threads of value rows only store.
    TokenRows<tab_t> rows{};
    if (tp.thread.y < qk_heads) rows = token_rows(g, r.cos, r.sin, r.pos, off);
    const int64_t slot = load_position(a.slots, cg.slots64, tok * cg.slot_stride);
    ROPE_DEVICE_CHECK(slot < cg.slots, "rope: slot_mapping must lie below num_blocks * block_size");
    const bool write = slot >= 0 && slot < cg.slots;
    // The slot's rows of head 0 in the caches (bytes).
    char* const kc0 = static_cast<char*>(a.key_cache) + cg.kc.slot_row(write ? slot : 0, cg.block_size) * es;
    char* const vc0 = static_cast<char*>(a.value_cache) + cg.vc.slot_row(write ? slot : 0, cg.block_size) * es;
    for (int64_t c = tp.thread.x; c < chunks; c += tp.block_dim.x) {
      // The chunk's cos and sin, read where a query or key row needs them.
      ChunkTables<x_t> t;
      int64_t first = 0;
      int count = 0;
      bool tables = false;
      for (int64_t h = tp.thread.y; h < rows_per_token; h += tp.block_dim.y) {
        if (h >= qk_heads) {  // value head hi: its chunk into the value cache
          if (!write || c >= a.value_chunks) continue;
          const int64_t hi = h - qk_heads;
          const x_t* v = a.value + tok * cg.v_token + hi * cg.v_head;
          const CacheStore<x_t> to_value_cache{vc0 + hi * cg.vc.head * es, cg.vc.last, v_scale,
                                               cg.format, a.vc_vec};
          ROPE_UNROLL
          for (int k = 0; k < 2; ++k) {
            const int64_t e0 = (c * a.value_vecs + k) * W;
            if (k < a.value_vecs && e0 < cg.value_dim) {
              read_chunk(v, cg.v_last, e0, cg.value_dim, a.v_vec, to_value_cache);
            }
          }
          continue;
        }
        if (c < r.rot_chunks && !tables) {
          if (g.interleaved) {
            chunk_pairs<x_t, true>(c, g.half, first, count);
          } else {
            chunk_pairs<x_t, false>(c, g.half, first, count);
          }
          load_tables(g, rows, first, count, r.tvec, t);
          tables = true;
        }
        const HeadRow<x_t> hr = head_row(r, off, h);  // in place: src == dst
        x_t* row = hr.dst;
        if (h < q_heads) {
          if (c < r.rot_chunks) rotate_row_chunk(g, row, hr.dst_last, first, count, t, r.vec, NoAlso{});
          continue;
        }
        const int64_t hi = h - q_heads;
        const TargetDesc& tg = g.target[1];
        const CacheStore<x_t> to_key_cache{kc0 + hi * cg.kc.head * es, cg.kc.last, k_scale,
                                           cg.format, a.kc_vec};
        if (c < r.rot_chunks) {
          if (write) {
            rotate_row_chunk(g, row, tg.dst_last, first, count, t, r.vec, to_key_cache);
          } else {
            rotate_row_chunk(g, row, tg.dst_last, first, count, t, r.vec, NoAlso{});
          }
        } else if (c < a.key_chunks && write) {
          read_chunk(row, tg.dst_last, 2 * g.half + (c - r.rot_chunks) * W, g.head_dim, r.vec,
                     to_key_cache);
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// slot_set_thread: rope.apply_and_cache_'s slots used at most once. Launched before the cache
// kernel when there are two tokens or more: each token inserts its non-negative slot into an
// open-addressing set (`mask + 1` entries, a power of two >= 2 * tokens, all kEmptySlot). A token
// that finds its slot there shares it with another token, whose rows would race for the slot:
// the device-side assert stops the stream before the cache kernel writes anything.

constexpr unsigned long long kEmptySlot = ~0ull;  // -1 as int64; slots lie below 2^63

struct SlotSetArgs {
  const void* slots;
  bool slots64;
  int64_t slot_stride, tokens, mask;
  unsigned long long* set;
};

// Compare-and-swap of one set entry: atomic on the device; the simulator runs one thread at a time.
ROPE_HD unsigned long long cas_entry(unsigned long long* p, unsigned long long expected,
                                     unsigned long long desired) {
#if defined(__CUDA_ARCH__)
  return atomicCAS(p, expected, desired);
#else
  if (!ROPE_ACCESS_OK(p, sizeof(*p), sizeof(*p), alignof(unsigned long long), true)) return desired;
  const unsigned long long old = *p;
  if (old == expected) *p = desired;
  return old;
#endif
}

// Inserts slot `key` into the set (`mask + 1` entries, never full); false if it was there.
ROPE_HD bool insert_slot(unsigned long long* set, int64_t mask, unsigned long long key) {
  const unsigned long long h = key * 0x9E3779B97F4A7C15ull;  // spreads neighbouring slots
  for (int64_t probe = 0; probe <= mask; ++probe) {
    const unsigned long long old =
        cas_entry(set + (((h ^ (h >> 31)) + static_cast<unsigned long long>(probe)) &
                         static_cast<unsigned long long>(mask)),
                  kEmptySlot, key);
    if (old == kEmptySlot) return true;
    if (old == key) return false;
  }
  return true;
}

ROPE_HD void slot_set_thread(const SlotSetArgs& a, const ThreadPos& tp) {
  const int64_t step = static_cast<int64_t>(tp.grid_dim.x) * tp.block_dim.x;
  for (int64_t tok = static_cast<int64_t>(tp.block.x) * tp.block_dim.x + tp.thread.x;
       tok < a.tokens; tok += step) {
    const int64_t slot = load_position(a.slots, a.slots64, tok * a.slot_stride);
    if (slot < 0) continue;  // padding
    ROPE_DEVICE_CHECK(insert_slot(a.set, a.mask, static_cast<unsigned long long>(slot)),
                      "rope: slot_mapping must not repeat a slot");
  }
}

}  // namespace rope::gpu
