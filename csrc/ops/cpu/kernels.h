// The CPU kernel family, written once over an instruction set's vector operations and compiled
// once per ISA (isa_*.cpp). Every op runs through rotate_tokens (geometry.h RotateGeometry) or,
// for the KV-cache write, cache_tokens. An ISA file defines, inside namespace rope::{anonymous}:
//   struct F32Ops  float lanes: using acc = float; using V; static constexpr int W;
//                  load(const T*) and store(T*, V) for T = float, HalfBits, BF16Bits;
//                  store_nt(T*, V): non-temporal, p aligned to W * sizeof(T);
//                  mul, add, sub (never fused: docs/math.md "The rotation"), swap_pairs (lanes 2i <-> 2i+1);
//                  half_to_float / float_to_half for one element, rounding as the vector forms;
//                  optionally kBf16Pairs and its helpers (below)
//   struct F64Ops  the same for double lanes (double only)
//   void store_fence()  orders non-temporal stores before the thread reports done
// then includes this header. Everything here has internal linkage (anonymous namespace), so the
// copies compiled for different ISAs never meet in the linker.
//
// Design: each row is memory-bound (one read and one write per element), so the loop body is a
// few multiplies and adds on full vectors of x. A token's cos/sin row is converted once into
// float (double for float64 x) stack buffers laid out for the loop, and reused while consecutive
// tokens share it; interleaved rows get tables duplicated per pair with the sign of sin folded in
// ([-s0, s0, -s1, s1, ...]), so that out = x*c2 + swap_pairs(x)*s2 needs no de-interleave; the
// inverse rotation is the opposite sign. Forward half-split rows read float tables in place.
// Rows are processed in blocks of at most kBlockPairs pairs (one block for any real head_dim),
// which bounds the stack buffers; rows with a non-unit stride along the head dim are gathered
// into a contiguous block buffer first.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <utility>

#include "convert.h"
#include "dt_dispatch.h"
#include "kernel_api.h"

#define ROPE_INLINE inline __attribute__((always_inline))
// A loop body inlined into the row walk rather than called once per row.
#define ROPE_INLINE_LAMBDA __attribute__((always_inline))

namespace rope {
namespace {

constexpr int64_t kBlockPairs = 512;

template <class Ops, typename T>
ROPE_INLINE typename Ops::acc to_acc(T v) {
  return static_cast<typename Ops::acc>(v);
}
template <class Ops>
ROPE_INLINE typename Ops::acc to_acc(HalfBits v) {
  return static_cast<typename Ops::acc>(F32Ops::half_to_float(v.bits));
}
template <class Ops>
ROPE_INLINE typename Ops::acc to_acc(BF16Bits v) {
  return static_cast<typename Ops::acc>(bf16_to_float(v.bits));
}

template <typename T, typename acc>
ROPE_INLINE T from_acc(acc v) {
  return static_cast<T>(v);
}
template <>
ROPE_INLINE HalfBits from_acc<HalfBits, float>(float v) {
  return HalfBits{F32Ops::float_to_half(v)};
}
template <>
ROPE_INLINE BF16Bits from_acc<BF16Bits, float>(float v) {
  return BF16Bits{float_to_bf16(v)};
}

template <typename x_t>
using OpsFor = std::conditional_t<std::is_same<x_t, double>::value, F64Ops, F32Ops>;

// A full vector to p: streamed when asked and p is aligned for it, else a plain store.
template <class Ops, bool kStream, typename T>
ROPE_INLINE void put(T* p, typename Ops::V v) {
  constexpr uintptr_t kAlign = Ops::W * sizeof(T);
  if (kStream && (reinterpret_cast<uintptr_t>(p) & (kAlign - 1)) == 0) {
    Ops::store_nt(p, v);
  } else {
    Ops::store(p, v);
  }
}

// ---- bfloat16 rows in pairs of vectors (Ops::kBf16Pairs), where conversions bound the loop ----
// Interleaved rows load 2 * W values as one vector and split it into its W even elements (the
// pairs' first members) and W odd ones with a shift and a mask (load_even_odd): plain tables, no
// lane swap; join_even_odd_raw converts and puts them back in order. Half-split rows take 2 * W
// elements of each half per step: on AVX512_BF16 in order (to_bf16_pair_raw, one instruction for
// both vectors); with Ops::kHalfSplitEvenOdd (AVX2) as even and odd lanes too, against tables
// laid out even/odd per 2 * W pairs (TableLayout::kEvenOdd), which saves AVX2 the lane-crossing
// widen and pack of converting in order.
// Where the conversion leaves NaN codes unfixed (AVX512_BF16), each result is folded into a
// NanAcc, and only a block that produced a NaN has its NaN codes set to 0xFFFF afterwards
// (fix_bf16_nans), which is what a per-vector fix would have written.
// The arithmetic per element is the other variants', and so are the bits.
template <class Ops, class = void>
struct HasBf16Pairs : std::false_type {};
template <class Ops>
struct HasBf16Pairs<Ops, std::enable_if_t<Ops::kBf16Pairs>> : std::true_type {};
template <class Ops, typename x_t>
constexpr bool kBf16Pairs = std::is_same<x_t, BF16Bits>::value && HasBf16Pairs<Ops>::value;
template <class Ops, typename x_t>
constexpr bool half_split_even_odd() {
  if constexpr (kBf16Pairs<Ops, x_t>) {
    return Ops::kHalfSplitEvenOdd;
  } else {
    return false;
  }
}
template <class Ops, typename x_t>
constexpr bool kHalfEvenOdd = half_split_even_odd<Ops, x_t>();

// NaN codes (magnitude above 0x7F80) of n bfloat16 values to 0xFFFF, as float_to_bf16 writes
// NaN. Values written with streaming stores are fenced first, so the reads see them.
template <bool kStream>
void fix_bf16_nans(BF16Bits* p, int64_t n) {
  if (kStream) store_fence();
  for (int64_t j = 0; j < n; ++j) {
    if ((p[j].bits & 0x7FFFu) > 0x7F80u) p[j].bits = 0xFFFF;
  }
}

// How a row reads its tables: plain c[i], s[i]; duplicated per element, c2 = [c0, c0, c1, c1, ...]
// and s2 = [-s0, s0, -s1, s1, ...] (interleaved rows, but for even/odd bf16); or, for half-split
// rows in even/odd lanes, each whole block of 2 * W pairs as its even pairs then its odd ones
// (the rest plain).
enum class TableLayout { kPlain, kPairDup, kEvenOdd };
template <class Ops, typename x_t, bool kInterleaved>
constexpr TableLayout kTableLayout =
    kInterleaved ? (kBf16Pairs<Ops, x_t> ? TableLayout::kPlain : TableLayout::kPairDup)
                 : (kHalfEvenOdd<Ops, x_t> ? TableLayout::kEvenOdd : TableLayout::kPlain);

// The whole blocks of 2 * W pairs of plain tables cs, ss (any type Ops loads) to
// TableLayout::kEvenOdd in c, s (which may be cs, ss themselves); returns the pairs done.
template <class Ops, typename T>
ROPE_INLINE int64_t even_odd_blocks(const T* cs, const T* ss, typename Ops::acc* c,
                                    typename Ops::acc* s, int64_t n) {
  int64_t i = 0;
  if constexpr (kHalfEvenOdd<Ops, BF16Bits>) {
    constexpr int W = Ops::W;
    for (; i + 2 * W <= n; i += 2 * W) {
      for (auto [from, to] : {std::pair(cs + i, c + i), std::pair(ss + i, s + i)}) {
        typename Ops::V even, odd;
        Ops::split_even_odd(from, even, odd);  // both loads before the stores: in place is fine
        Ops::store(to, even);
        Ops::store(to + W, odd);
      }
    }
  }
  return i;
}
template <class Ops>
ROPE_INLINE void even_odd_blocks_in_place(typename Ops::acc* c, typename Ops::acc* s, int64_t n) {
  using acc = typename Ops::acc;
  even_odd_blocks<Ops>(static_cast<const acc*>(c), static_cast<const acc*>(s), c, s, n);
}

// ---- one contiguous block of n pairs ----

// 2 * W bfloat16 of a half-split row as two vectors (kBf16Pairs): even and odd lanes with
// kHalfSplitEvenOdd (tables laid out to match, TableLayout::kEvenOdd), else in order; and back.
template <class Ops>
ROPE_INLINE void load_half_pair(const BF16Bits* p, typename Ops::V& v0, typename Ops::V& v1) {
  if constexpr (kHalfEvenOdd<Ops, BF16Bits>) {
    Ops::load_even_odd(p, v0, v1);
  } else {
    v0 = Ops::load(p);
    v1 = Ops::load(p + Ops::W);
  }
}
template <class Ops>
ROPE_INLINE auto convert_half_pair(typename Ops::V v0, typename Ops::V v1) {
  if constexpr (kHalfEvenOdd<Ops, BF16Bits>) {
    return Ops::join_even_odd_raw(v0, v1);
  } else {
    return Ops::to_bf16_pair_raw(v0, v1);
  }
}

// Half-split pairs (a[i], b[i]): (a*c - b*s, b*c + a*s), s already negated for the inverse.
template <class Ops, bool kStream, typename x_t>
ROPE_INLINE void rotate_half_split(const x_t* a, const x_t* b, x_t* oa, x_t* ob,
                                   const typename Ops::acc* c, const typename Ops::acc* s,
                                   int64_t n) {
  using V = typename Ops::V;
  constexpr int W = Ops::W;
  int64_t i = 0;
  if constexpr (kBf16Pairs<Ops, x_t>) {
    auto nan = Ops::nan_acc_init();
    for (; i + 2 * W <= n; i += 2 * W) {
      V a0, a1, b0, b1;
      load_half_pair<Ops>(a + i, a0, a1);
      load_half_pair<Ops>(b + i, b0, b1);
      const V c0 = Ops::load(c + i), s0 = Ops::load(s + i);
      const V c1 = Ops::load(c + i + W), s1 = Ops::load(s + i + W);
      const auto ra = convert_half_pair<Ops>(Ops::sub(Ops::mul(a0, c0), Ops::mul(b0, s0)),
                                             Ops::sub(Ops::mul(a1, c1), Ops::mul(b1, s1)));
      const auto rb = convert_half_pair<Ops>(Ops::add(Ops::mul(b0, c0), Ops::mul(a0, s0)),
                                             Ops::add(Ops::mul(b1, c1), Ops::mul(a1, s1)));
      nan = Ops::nan_acc(Ops::nan_acc(nan, ra), rb);
      Ops::write_bf16x2w(oa + i, ra, kStream);
      Ops::write_bf16x2w(ob + i, rb, kStream);
    }
    if (Ops::nan_any(nan)) {
      fix_bf16_nans<kStream>(oa, i);
      fix_bf16_nans<kStream>(ob, i);
    }
  }
  for (; i + W <= n; i += W) {
    const V va = Ops::load(a + i), vb = Ops::load(b + i);
    const V vc = Ops::load(c + i), vs = Ops::load(s + i);
    put<Ops, kStream>(oa + i, Ops::sub(Ops::mul(va, vc), Ops::mul(vb, vs)));
    put<Ops, kStream>(ob + i, Ops::add(Ops::mul(vb, vc), Ops::mul(va, vs)));
  }
  for (; i < n; ++i) {
    const auto va = to_acc<Ops>(a[i]), vb = to_acc<Ops>(b[i]);
    oa[i] = from_acc<x_t>(va * c[i] - vb * s[i]);
    ob[i] = from_acc<x_t>(vb * c[i] + va * s[i]);
  }
}

// Interleaved pairs (x[2i], x[2i+1]) with duplicated tables: out = x*c2 + swap_pairs(x)*s2.
// With kBf16Pairs the tables are plain (c[i], s[i]) and a*c - b*s has the bits of a*c + b*(-s).
template <class Ops, bool kStream, typename x_t>
ROPE_INLINE void rotate_interleaved(const x_t* x, x_t* out, const typename Ops::acc* c2,
                                    const typename Ops::acc* s2, int64_t n) {
  using V = typename Ops::V;
  constexpr int W = Ops::W;
  if constexpr (kBf16Pairs<Ops, x_t>) {
    int64_t p = 0;
    auto nan = Ops::nan_acc_init();
    for (; p + W <= n; p += W) {
      V a, b;
      Ops::load_even_odd(x + 2 * p, a, b);
      const V vc = Ops::load(c2 + p), vs = Ops::load(s2 + p);
      const auto r = Ops::join_even_odd_raw(Ops::sub(Ops::mul(a, vc), Ops::mul(b, vs)),
                                            Ops::add(Ops::mul(b, vc), Ops::mul(a, vs)));
      nan = Ops::nan_acc(nan, r);
      Ops::write_bf16x2w(out + 2 * p, r, kStream);
    }
    if (Ops::nan_any(nan)) fix_bf16_nans<kStream>(out, 2 * p);
    for (; p < n; ++p) {
      const auto a = to_acc<Ops>(x[2 * p]), b = to_acc<Ops>(x[2 * p + 1]);
      out[2 * p] = from_acc<x_t>(a * c2[p] - b * s2[p]);
      out[2 * p + 1] = from_acc<x_t>(b * c2[p] + a * s2[p]);
    }
    return;
  }
  int64_t j = 0;
  if constexpr (W > 1) {  // a pair swap needs two lanes
    for (; j + W <= 2 * n; j += W) {
      const V v = Ops::load(x + j);
      put<Ops, kStream>(out + j, Ops::add(Ops::mul(v, Ops::load(c2 + j)),
                                          Ops::mul(Ops::swap_pairs(v), Ops::load(s2 + j))));
    }
  }
  for (; j < 2 * n; j += 2) {
    const auto a = to_acc<Ops>(x[j]), b = to_acc<Ops>(x[j + 1]);
    out[j] = from_acc<x_t>(a * c2[j] + b * s2[j]);
    out[j + 1] = from_acc<x_t>(b * c2[j + 1] + a * s2[j + 1]);
  }
}

// ---- tables ----

// The cos/sin rows a token reads: one (strided, gathered) or three (MRoPE) of each, as element
// pointers into the tables with their column strides.
struct TableRows {
  const void* cos[kMropeComponents];
  const void* sin[kMropeComponents];
};

// A block of pairs [b0, b0 + n) of a token's cos/sin, converted for the row kernels (see
// kTableLayout), re-converted only when the source rows or the block change.
template <class Ops, TableLayout kLayout>
struct TableBlock {
  static constexpr bool kPairDup = kLayout == TableLayout::kPairDup;
  using acc = typename Ops::acc;
  alignas(64) acc c[2 * kBlockPairs];
  alignas(64) acc s[2 * kBlockPairs];
  const void* key[2 * kMropeComponents] = {};
  int64_t key_b0 = -1;

  void get(const TableRows& r, const RotateGeometry& g, int dt, int64_t b0, int64_t n) {
    const TableDesc& t = g.table;
    const bool mrope = t.kind == TableKind::kMrope;
    bool same = key_b0 == b0;
    for (int j = 0; j < (mrope ? kMropeComponents : 1); ++j) {
      same = same && key[2 * j] == r.cos[j] && key[2 * j + 1] == r.sin[j];
      key[2 * j] = r.cos[j];
      key[2 * j + 1] = r.sin[j];
    }
    if (same) return;
    key_b0 = b0;
    with_dt_type(dt, [&](auto elem) {
      using T = decltype(elem);
      // Plain rows of a type the vector loads convert (float/half/bfloat16 to float, double to
      // double): whole vectors. Tables that change every row ((B, H, S, D) x with (1, 1, S, r/2)
      // bfloat16 tables) convert one row per row of x, so this is on the hot path.
      constexpr bool kLoadable =
          std::is_same<acc, double>::value == std::is_same<T, double>::value;
      if constexpr (!kPairDup && kLoadable) {
        if (!mrope && !g.inverse && t.cos_col == 1 && t.sin_col == 1) {
          const T* cs = static_cast<const T*>(r.cos[0]) + b0;
          const T* ss = static_cast<const T*>(r.sin[0]) + b0;
          int64_t i = 0;
          if constexpr (kLayout == TableLayout::kEvenOdd) i = even_odd_blocks<Ops>(cs, ss, c, s, n);
          for (; i + Ops::W <= n; i += Ops::W) {
            Ops::store(c + i, Ops::load(cs + i));
            Ops::store(s + i, Ops::load(ss + i));
          }
          for (; i < n; ++i) {
            c[i] = to_acc<Ops>(cs[i]);
            s[i] = to_acc<Ops>(ss[i]);
          }
          return;
        }
      }
      const acc sign = g.inverse ? acc(-1) : acc(1);
      if (std::is_same<T, float>::value && !mrope && t.cos_col == 2 && t.sin_col == 2) {
        // Every other entry (diffusers' interleaved full-width tables, read at their pairs'
        // first members): a constant stride, which vectorizes, where LTX-Video's tables (one
        // row per row of x, as large as x) spent more time here than in the rotation. (float
        // tables only: the drop-ins pass others converted, and each table dtype is a copy of
        // this loop in every row kernel.)
        const T* cs = static_cast<const T*>(r.cos[0]) + 2 * b0;
        const T* ss = static_cast<const T*>(r.sin[0]) + 2 * b0;
        for (int64_t i = 0; i < n; ++i) {
          c[i] = to_acc<Ops>(cs[2 * i]);
          s[i] = sign * to_acc<Ops>(ss[2 * i]);
        }
        if (kPairDup) {  // spread in place, from the last pair down
          for (int64_t i = n - 1; i >= 0; --i) {
            c[2 * i] = c[2 * i + 1] = c[i];
            const acc sv = s[i];
            s[2 * i] = -sv;
            s[2 * i + 1] = sv;
          }
        }
        if (kLayout == TableLayout::kEvenOdd) even_odd_blocks_in_place<Ops>(c, s, n);
        return;
      }
      for (int64_t i = 0; i < n; ++i) {
        const int64_t pair = b0 + i;
        const int j = mrope ? mrope_component(pair, t.section, t.mrope_interleaved) : 0;
        const acc cv = to_acc<Ops>(static_cast<const T*>(r.cos[j])[pair * t.cos_col]);
        const acc sv = sign * to_acc<Ops>(static_cast<const T*>(r.sin[j])[pair * t.sin_col]);
        if (kPairDup) {
          c[2 * i] = c[2 * i + 1] = cv;
          s[2 * i] = -sv;
          s[2 * i + 1] = sv;
        } else {
          c[i] = cv;
          s[i] = sv;
        }
      }
      if (kLayout == TableLayout::kEvenOdd) even_odd_blocks_in_place<Ops>(c, s, n);
    });
  }
};

// n plain (cos, sin) pairs laid out for the row kernels (kTableLayout): pair-duplicated with the
// sign of sin folded in, even/odd per block, or as they are.
template <class Ops, TableLayout kLayout>
ROPE_INLINE void lay_out_table(const typename Ops::acc* cb, const typename Ops::acc* sb, int64_t n,
                               typename Ops::acc* c, typename Ops::acc* s) {
  for (int64_t j = 0; j < n; ++j) {
    if (kLayout == TableLayout::kPairDup) {  // a*c + b*(-s) has the bits of a*c - b*s
      c[2 * j] = c[2 * j + 1] = cb[j];
      s[2 * j] = -sb[j];
      s[2 * j + 1] = sb[j];
    } else {
      c[j] = cb[j];
      s[j] = sb[j];
    }
  }
  if (kLayout == TableLayout::kEvenOdd) even_odd_blocks_in_place<Ops>(c, s, n);
}

// ---- the rows of one target for one token: the block of pairs [b0, b0 + n) of each head ----

template <class Ops, bool kInterleaved, bool kStream, typename x_t>
ROPE_INLINE void rotate_block(const x_t* src, x_t* dst, int64_t half, int64_t n,
                              const typename Ops::acc* c, const typename Ops::acc* s) {
  if (kInterleaved) {
    rotate_interleaved<Ops, kStream>(src, dst, c, s, n);
  } else {
    rotate_half_split<Ops, kStream>(src, src + half, dst, dst + half, c, s, n);
  }
}

// `heads` rows src -> dst (rows head_stride apart); src/dst point at pair b0 of the first row.
// stream (non-temporal stores) picks the stores of the unit-stride row loop only, so the token
// walk around it is compiled once, not once per store kind.
template <class Ops, bool kInterleaved, typename x_t>
ROPE_INLINE void rotate_heads(const TargetDesc& tg, const x_t* src, x_t* dst, int64_t half,
                              int64_t b0, int64_t n, const typename Ops::acc* c,
                              const typename Ops::acc* s, bool stream) {
  const int64_t first = kInterleaved ? 2 * b0 : b0;  // element of pair b0's first member
  if (tg.src_last == 1 && tg.dst_last == 1) {
    src += first;
    dst += first;
    auto rows = [&](auto stream_c) ROPE_INLINE_LAMBDA {
      for (int64_t h = 0; h < tg.heads; ++h, src += tg.src_head, dst += tg.dst_head) {
        rotate_block<Ops, kInterleaved, decltype(stream_c)::value>(src, dst, half, n, c, s);
      }
    };
    stream ? rows(std::true_type{}) : rows(std::false_type{});
    return;
  }
  // Strided along the head dim: each block goes through a contiguous copy of its 2n elements
  // (first members then second members for half-split, pairs in order for interleaved).
  x_t buf[2 * kBlockPairs];
  auto at = [&](int64_t k) {  // element (within the row) of buffer slot k
    return kInterleaved ? first + k : (k < n ? first + k : half + first + (k - n));
  };
  for (int64_t h = 0; h < tg.heads; ++h, src += tg.src_head, dst += tg.dst_head) {
    for (int64_t k = 0; k < 2 * n; ++k) buf[k] = src[at(k) * tg.src_last];
    rotate_block<Ops, kInterleaved, false>(buf, buf, n, n, c, s);
    for (int64_t k = 0; k < 2 * n; ++k) dst[at(k) * tg.dst_last] = buf[k];
  }
}

// Dims [2*half, head_dim) of a row, copied bit-exactly (out-of-place ops).
template <typename x_t>
ROPE_INLINE void copy_tail(const x_t* src, int64_t src_last, x_t* dst, int64_t dst_last,
                           int64_t from, int64_t to) {
  if (src_last == 1 && dst_last == 1) {
    std::memcpy(dst + from, src + from, (to - from) * sizeof(x_t));
  } else {
    for (int64_t j = from; j < to; ++j) dst[j * dst_last] = src[j * src_last];
  }
}

}  // namespace
}  // namespace rope

#include "fp8_rows.h"

namespace rope {
namespace {

// ---- the token walk ----

// Calls f(first_token, count, offsets, steps) for each run of tokens [b, e) of `ix` along its
// innermost leading dim, so the caller walks a run with pointer increments; offsets are
// re-derived (a division per dim) only where a run wraps.
template <typename F>
ROPE_INLINE void for_each_run(const LeadIndexer& ix, int64_t b, int64_t e, F&& f) {
  int64_t off[kMaxOperands], step[kMaxOperands] = {};
  if (ix.ndim == 0) {
    for (int t = 0; t < kMaxOperands; ++t) off[t] = 0;
    f(b, e - b, off, step);
    return;
  }
  const int last = ix.ndim - 1;
  const int64_t n = ix.sizes[last];
  for (int t = 0; t < kMaxOperands; ++t) step[t] = ix.strides[t][last];
  for (int64_t r = b; r < e;) {
    ix.offsets(r, off);
    const int64_t run = std::min(e - r, n - r % n);
    f(r, run, off, step);
    r += run;
  }
}

ROPE_INLINE int64_t read_position(const void* pos, bool pos64, int64_t offset) {
  return pos64 ? static_cast<const int64_t*>(pos)[offset]
               : static_cast<int64_t>(static_cast<const int32_t*>(pos)[offset]);
}

// The cos/sin rows of the token whose operand offsets are `off`.
ROPE_INLINE TableRows token_rows(const RotateJob& job, const int64_t* off) {
  const TableDesc& t = job.g->table;
  const int64_t es = dt_size(job.table_dt);
  const char* cos = static_cast<const char*>(job.cos);
  const char* sin = static_cast<const char*>(job.sin);
  TableRows r;
  if (t.kind == TableKind::kStrided) {
    r.cos[0] = cos + off[kTab0] * es;
    r.sin[0] = sin + off[kTab1] * es;
  } else {
    const int n = t.kind == TableKind::kMrope ? kMropeComponents : 1;
    for (int j = 0; j < n; ++j) {
      const int64_t p = read_position(job.positions, t.pos64, off[kTab0] + j * t.pos_component);
      r.cos[j] = cos + p * t.cos_row * es;
      r.sin[j] = sin + p * t.sin_row * es;
    }
  }
  return r;
}

// Called after each token's rows are rotated, with the token index and its operand offsets
// (rope.apply_and_cache_ writes the KV cache there).
// Rotates every row of tokens [b, e).
template <typename x_t, bool kInterleaved>
void rotate_tokens_impl(const RotateJob& job, int64_t b, int64_t e, TokenHook hook) {
  using Ops = OpsFor<x_t>;
  using acc = typename Ops::acc;
  constexpr TableLayout kLayout = kTableLayout<Ops, x_t, kInterleaved>;
  const RotateGeometry& g = *job.g;
  const TableDesc& t = g.table;
  const int64_t half = g.half;
  // Forward plain-layout rows with tables in the arithmetic type, contiguous: read in place.
  constexpr int kAccDt = std::is_same<acc, double>::value ? kF64 : kF32;
  const bool direct = kLayout == TableLayout::kPlain && t.kind != TableKind::kMrope &&
                      !g.inverse && job.table_dt == kAccDt && t.cos_col == 1 && t.sin_col == 1;
  TableBlock<Ops, kLayout> tables;
  const x_t* src[2] = {static_cast<const x_t*>(job.src[0]), static_cast<const x_t*>(job.src[1])};
  x_t* dst[2] = {static_cast<x_t*>(job.dst[0]), static_cast<x_t*>(job.dst[1])};
  for_each_run(g.lead, b, e,
               [&](int64_t first, int64_t run, int64_t* off, const int64_t* step)
                   ROPE_INLINE_LAMBDA {
                 for (int64_t j = 0; j < run; ++j) {
                   const TableRows rows = token_rows(job, off);
                   for (int64_t b0 = 0; b0 < half; b0 += kBlockPairs) {
                     const int64_t n = std::min(kBlockPairs, half - b0);
                     const acc* c;
                     const acc* s;
                     if (direct) {
                       c = static_cast<const acc*>(rows.cos[0]) + b0;
                       s = static_cast<const acc*>(rows.sin[0]) + b0;
                     } else {
                       tables.get(rows, g, job.table_dt, b0, n);
                       c = tables.c;
                       s = tables.s;
                     }
                     for (int k = 0; k < g.targets; ++k) {
                       rotate_heads<Ops, kInterleaved>(g.target[k], src[k] + off[2 * k],
                                                       dst[k] + off[2 * k + 1], half, b0, n, c,
                                                       s, job.stream);
                     }
                   }
                   if (g.copy_tail && 2 * half < g.head_dim) {
                     for (int k = 0; k < g.targets; ++k) {
                       const TargetDesc& tg = g.target[k];
                       for (int64_t h = 0; h < tg.heads; ++h) {
                         copy_tail(src[k] + off[2 * k] + h * tg.src_head, tg.src_last,
                                   dst[k] + off[2 * k + 1] + h * tg.dst_head, tg.dst_last,
                                   2 * half, g.head_dim);
                       }
                     }
                   }
                   if (hook.fn != nullptr) hook.fn(hook.ctx, first + j, off);
                   for (int o = 0; o < kMaxOperands; ++o) off[o] += step[o];
                 }
               });
  if (job.stream) store_fence();
}

template <typename x_t>
void rotate_tokens_hooked(const RotateJob& job, int64_t b, int64_t e, TokenHook hook) {
  job.g->interleaved ? rotate_tokens_impl<x_t, true>(job, b, e, hook)
                     : rotate_tokens_impl<x_t, false>(job, b, e, hook);
}

template <typename x_t>
void rotate_tokens(const RotateJob& job, int64_t b, int64_t e) {
  rotate_tokens_hooked<x_t>(job, b, e, TokenHook{nullptr, nullptr});
}

// ---- rope.apply_and_cache_: the rotation, then each token's paged KV-cache write ----

// n elements (stride `last`) to a cache row (stride `cache_last`), converted (float8: by enc,
// cache_encoder of the cache's scale).
template <typename x_t, bool kFp8>
void store_cache_row(const x_t* row, int64_t last, void* cache_row, int64_t cache_last,
                     int64_t n, const Fp8Encoder& enc) {
  if (n == 0) return;  // rows of 0 elements (head_dim 0) may have null data pointers
  if (!kFp8) {
    x_t* out = static_cast<x_t*>(cache_row);
    if (last == 1 && cache_last == 1) {
      std::memcpy(out, row, n * sizeof(x_t));
    } else {
      for (int64_t j = 0; j < n; ++j) out[j * cache_last] = row[j * last];
    }
    return;
  }
  codes_of(row, last, n, static_cast<uint8_t*>(cache_row), cache_last, enc);
}

// A value row (n elements, stride `last`) written to `out` (stride `out_last`; may be the row
// itself): with eps >= 0 (v_norm) RMS-normalized without a weight in the arithmetic type,
// rounded once; else copied.
template <typename x_t>
void write_value_row(const x_t* row, int64_t last, x_t* out, int64_t out_last, int64_t n,
                     double eps) {
  using acc = typename OpsFor<x_t>::acc;
  if (eps < 0) {
    if (last == 1 && out_last == 1) {
      std::memcpy(out, row, n * sizeof(x_t));
    } else {
      for (int64_t j = 0; j < n; ++j) out[j * out_last] = row[j * last];
    }
    return;
  }
  acc ss = 0;
  for (int64_t j = 0; j < n; ++j) {
    const acc v = to_acc<OpsFor<x_t>>(row[j * last]);
    ss += v * v;
  }
  const acc r = acc(1) / std::sqrt(ss / static_cast<acc>(n) + static_cast<acc>(eps));
  for (int64_t j = 0; j < n; ++j) {
    out[j * out_last] = from_acc<x_t>(to_acc<OpsFor<x_t>>(row[j * last]) * r);
  }
}

// The token's written key rows (still in L1) and its value rows (written first where value_out
// is given), to the caches at its slot. Padding slots (negative) store nothing, but their value
// rows are written. kFp8: float8 caches, of either format (cg.format).
template <typename x_t, bool kFp8>
void write_cache_token(const void* ctx, int64_t token, const int64_t* off) {
  const CacheJob& job = *static_cast<const CacheJob*>(ctx);
  const CacheGeometry& cg = *job.g;
  const x_t* v = static_cast<const x_t*>(job.value) + token * cg.v_token;
  int64_t v_head = cg.v_head, v_last = cg.v_last;
  if (job.value_out != nullptr && cg.value_dim > 0) {
    x_t* out = static_cast<x_t*>(job.value_out) + token * cg.vo_token;
    for (int64_t h = 0; h < cg.kv_heads; ++h) {
      write_value_row<x_t>(v + h * cg.v_head, cg.v_last, out + h * cg.vo_head, cg.vo_last,
                           cg.value_dim, job.v_eps);
    }
    v = out;  // the cache stores the written rows
    v_head = cg.vo_head;
    v_last = cg.vo_last;
  }
  const int64_t slot = read_position(job.slot_mapping, cg.slots64, token * cg.slot_stride);
  if (slot < 0) return;  // padding
  const int64_t es = kFp8 ? 1 : sizeof(x_t);
  const TargetDesc& kt = cg.rot.target[1];
  const x_t* k = static_cast<const x_t*>(job.key) + off[kDst1];
  char* kc = static_cast<char*>(job.key_cache) + cg.kc.slot_row(slot, cg.block_size) * es;
  char* vc = static_cast<char*>(job.value_cache) + cg.vc.slot_row(slot, cg.block_size) * es;
  // Once per token, not per row (the encoder's choice costs a division).
  const Fp8Encoder k_enc = kFp8 ? cache_encoder(job.k_scale, cg.format) : Fp8Encoder{};
  const Fp8Encoder v_enc = kFp8 ? cache_encoder(job.v_scale, cg.format) : Fp8Encoder{};
  for (int64_t h = 0; h < cg.kv_heads; ++h) {
    store_cache_row<x_t, kFp8>(k + h * kt.dst_head, kt.dst_last, kc + h * cg.kc.head * es,
                               cg.kc.last, cg.rot.head_dim, k_enc);
    store_cache_row<x_t, kFp8>(v + h * v_head, v_last, vc + h * cg.vc.head * es, cg.vc.last,
                               cg.value_dim, v_enc);
  }
}

template <typename x_t, bool kFp8>
void cache_tokens(const CacheJob& job, int64_t b, int64_t e) {
  rotate_tokens_hooked<x_t>(job.rot, b, e, TokenHook{write_cache_token<x_t, kFp8>, &job});
}

}  // namespace
}  // namespace rope

#include "../qk_norm/cpu/kernels.h"
#include "../kv_shift/cpu/kernels.h"
#include "../quant/cpu/kernels.h"

namespace rope {
namespace {

// ---- the table of one ISA ----

template <typename x_t>
void fill(CpuKernels& k, int xi) {
  k.rotate[xi] = rotate_tokens<x_t>;
  k.norm_rope[xi] = norm_rope_layout<x_t>;
  k.norm_rope_backward[xi] = norm_rope_backward_layout<x_t>;
  // Both float8 formats: one kernel, which reads the format from the call's description.
  k.cache[xi][int(CacheFormat::kSame)] = cache_tokens<x_t, false>;
  k.cache[xi][int(CacheFormat::kE4M3FN)] = cache_tokens<x_t, true>;
  k.cache[xi][int(CacheFormat::kE5M2)] = cache_tokens<x_t, true>;
  k.store[xi][int(CacheFormat::kSame)] = write_cache_token<x_t, false>;
  k.store[xi][int(CacheFormat::kE4M3FN)] = write_cache_token<x_t, true>;
  k.store[xi][int(CacheFormat::kE5M2)] = write_cache_token<x_t, true>;
  k.shift[xi] = shift_slots<x_t, false>;
  if constexpr (!std::is_same<x_t, double>::value) k.quant[xi] = quant_tokens<x_t>;
}

#ifndef ROPE_KERNELS_BF16_ONLY
CpuKernels make_kernels() {
  CpuKernels k{};
  fill<float>(k, kF32);
  fill<double>(k, kF64);
  fill<HalfBits>(k, kF16);
  fill<BF16Bits>(k, kBF16);
  k.shift_fp8[int(CacheFormat::kE4M3FN)] = shift_slots<uint8_t, true>;
  k.shift_fp8[int(CacheFormat::kE5M2)] = shift_slots<uint8_t, true>;
  return k;
}
#endif

}  // namespace
}  // namespace rope
