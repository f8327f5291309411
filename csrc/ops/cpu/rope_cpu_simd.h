// The vectorized CPU kernels, written once over an ISA's vector operations and compiled once per
// ISA. A per-ISA file (rope_cpu_avx2.cpp, ...) defines, inside namespace rope::{anonymous}:
//   struct F32Ops  float lanes:  using acc = float;  using V = ...;  static constexpr int W;
//                  load/store/stream (non-temporal where aligned) for float, HalfBits, BF16Bits;
//                  mul, add, sub (never fused: see rope_ext/_build_flags.py), swap_pairs (lanes 2i <-> 2i+1);
//                  scalar half_to_float / float_to_half
//   struct F64Ops  the same for double lanes (load/store/stream for double only)
//   void store_fence()  orders non-temporal stores before the thread reports done
// then includes this header after its `#pragma GCC target`. Everything here has internal linkage
// (anonymous namespace), so the copies compiled for different ISAs never meet in the linker.
//
// Design: each row is memory-bound (one read and one write per element), so the loop body is a
// few FMAs on full vectors of x. The tables are converted once into float (double for float64 x)
// stack buffers in the layout the loop wants, and reused while consecutive rows share a table
// row (heads of one token): interleaved tables are stored duplicated per pair with the sign of
// sin folded in ([-s0, s0, -s1, s1, ...]), so that out = x*c2 + swap_pairs(x)*s2 needs no
// de-interleave; the inverse rotation (backward) is just the opposite sign. Half-split tables
// already in the arithmetic type are read in place in the forward rotation. Pairs left over
// from the vector loop run scalar.
#pragma once

#include <algorithm>
#include <cstring>
#include <type_traits>

#define ROPE_SIMD_INLINE inline __attribute__((always_inline))
// The per-row body, inlined into for_each_row's loop rather than called once per row.
#define ROPE_SIMD_INLINE_LAMBDA __attribute__((always_inline))

namespace rope {
namespace {

// ---- scalar conversions of one element (tails and table expansion) ----

inline float bf16_to_float(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Round to nearest even, NaN to the canonical quiet NaN: what torch's BFloat16(float) does.
inline uint16_t float_to_bf16(float f) {
  if (f != f) return 0x7FC0;
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

template <class Ops, typename T>
inline typename Ops::acc to_acc(T v) {
  return static_cast<typename Ops::acc>(v);
}
template <class Ops>
inline typename Ops::acc to_acc(HalfBits v) {
  return static_cast<typename Ops::acc>(F32Ops::half_to_float(v.bits));
}
template <class Ops>
inline typename Ops::acc to_acc(BF16Bits v) {
  return static_cast<typename Ops::acc>(bf16_to_float(v.bits));
}

template <typename T, typename acc>
inline T from_acc(acc v) {
  return static_cast<T>(v);
}
template <>
inline HalfBits from_acc<HalfBits, float>(float v) {
  return HalfBits{F32Ops::float_to_half(v)};
}
template <>
inline BF16Bits from_acc<BF16Bits, float>(float v) {
  return BF16Bits{float_to_bf16(v)};
}

template <typename x_t>
using OpsFor = std::conditional_t<std::is_same<x_t, double>::value, F64Ops, F32Ops>;

// ---- one row ----

// bfloat16 rows where Ops::kBf16Pairs (AVX512_BF16), whose conversions bound the loop
// (bench/NOTES.md 11): two float vectors round to 2 * W bfloat16 in one instruction.
// - Half-split rows take 2 * W elements of each half per step: load as before, to_bf16_pair(lo, hi).
// - Interleaved rows load 2 * W values as one vector and split it into its W even elements (the
//   pairs' first values) and W odd ones (the second) with a shift and a mask: plain tables, no lane
//   swap; join_even_odd puts them back in order with one word permute. (Even/odd half-split rows
//   measured slower: they need that permute too, and de-interleaved tables.)
// The arithmetic per element is the other variants', and so are the bits.
template <class Ops, class = void>
struct HasBf16Pairs : std::false_type {};
template <class Ops>
struct HasBf16Pairs<Ops, std::enable_if_t<Ops::kBf16Pairs>> : std::true_type {};
template <class Ops, typename x_t>
constexpr bool kBf16Pairs = std::is_same<x_t, BF16Bits>::value && HasBf16Pairs<Ops>::value;

// 2 * W bfloat16 results to p: lo/hi = the first/second W values (kEvenOdd: the even/odd ones).
template <class Ops, bool kStream, bool kEvenOdd, typename x_t>
ROPE_SIMD_INLINE void put_bf16_pair(x_t* p, typename Ops::V a, typename Ops::V b) {
  Ops::write_bf16x32(p, kEvenOdd ? Ops::join_even_odd(a, b) : Ops::to_bf16_pair(a, b), kStream);
}

// Whether a row kernel reads its tables duplicated per element, c2 = [c0, c0, c1, c1, ...] and
// s2 = [-s0, s0, -s1, s1, ...] (interleaved rows, but for even/odd bf16), or plain c[i], s[i].
template <class Ops, typename x_t, bool kInterleaved>
constexpr bool kPairDupTables = kInterleaved && !kBf16Pairs<Ops, x_t>;

// Half-split pairs (x[i], x[i+half]): out = (a*c - b*s, b*c + a*s), with s already negated
// for the inverse rotation.
template <class Ops, bool kStream, typename x_t>
ROPE_SIMD_INLINE void row_half_split(const x_t* x, x_t* out, const typename Ops::acc* c,
                           const typename Ops::acc* s, int64_t half) {
  using V = typename Ops::V;
  constexpr int W = Ops::W;
  int64_t i = 0;
  if constexpr (kBf16Pairs<Ops, x_t>) {
    for (; i + 2 * W <= half; i += 2 * W) {
      const V a = Ops::load(x + i), b = Ops::load(x + half + i);
      const V a2 = Ops::load(x + i + W), b2 = Ops::load(x + half + i + W);
      const V cv = Ops::load(c + i), sv = Ops::load(s + i);
      const V cv2 = Ops::load(c + i + W), sv2 = Ops::load(s + i + W);
      put_bf16_pair<Ops, kStream, false>(out + i, Ops::sub(Ops::mul(a, cv), Ops::mul(b, sv)),
                             Ops::sub(Ops::mul(a2, cv2), Ops::mul(b2, sv2)));
      put_bf16_pair<Ops, kStream, false>(out + half + i, Ops::add(Ops::mul(b, cv), Ops::mul(a, sv)),
                             Ops::add(Ops::mul(b2, cv2), Ops::mul(a2, sv2)));
    }
  }
  for (; i + W <= half; i += W) {
    const V a = Ops::load(x + i), b = Ops::load(x + half + i);
    const V cv = Ops::load(c + i), sv = Ops::load(s + i);
    const V o0 = Ops::sub(Ops::mul(a, cv), Ops::mul(b, sv));
    const V o1 = Ops::add(Ops::mul(b, cv), Ops::mul(a, sv));
    if (kStream) {
      Ops::stream(out + i, o0);
      Ops::stream(out + half + i, o1);
    } else {
      Ops::store(out + i, o0);
      Ops::store(out + half + i, o1);
    }
  }
  for (; i < half; ++i) {
    const auto a = to_acc<Ops>(x[i]), b = to_acc<Ops>(x[half + i]);
    out[i] = from_acc<x_t>(a * c[i] - b * s[i]);
    out[half + i] = from_acc<x_t>(b * c[i] + a * s[i]);
  }
}

// Interleaved pairs (x[2i], x[2i+1]) with duplicated tables c2 = [c0, c0, c1, c1, ...] and
// signed s2 = [-s0, s0, -s1, s1, ...]: out = x*c2 + swap_pairs(x)*s2.
template <class Ops, bool kStream, typename x_t>
ROPE_SIMD_INLINE void row_interleaved(const x_t* x, x_t* out, const typename Ops::acc* c2,
                            const typename Ops::acc* s2, int64_t half) {
  using V = typename Ops::V;
  constexpr int W = Ops::W;
  if constexpr (kBf16Pairs<Ops, x_t>) {
    // Plain tables (c2, s2 hold c[i], s[i] here); a*c - b*s has the bits of a*c + b*(-s).
    const typename Ops::acc* c = c2;
    const typename Ops::acc* s = s2;
    int64_t p = 0;
    for (; p + W <= half; p += W) {
      V a, b;
      Ops::load_even_odd(x + 2 * p, a, b);
      const V cv = Ops::load(c + p), sv = Ops::load(s + p);
      put_bf16_pair<Ops, kStream, true>(out + 2 * p, Ops::sub(Ops::mul(a, cv), Ops::mul(b, sv)),
                                 Ops::add(Ops::mul(b, cv), Ops::mul(a, sv)));
    }
    for (; p < half; ++p) {
      const auto a = to_acc<Ops>(x[2 * p]), b = to_acc<Ops>(x[2 * p + 1]);
      out[2 * p] = from_acc<x_t>(a * c[p] - b * s[p]);
      out[2 * p + 1] = from_acc<x_t>(b * c[p] + a * s[p]);
    }
    return;
  }
  const int64_t n = 2 * half;
  int64_t j = 0;
  for (; j + W <= n; j += W) {
    const V v = Ops::load(x + j);
    const V o = Ops::add(Ops::mul(v, Ops::load(c2 + j)), Ops::mul(Ops::swap_pairs(v), Ops::load(s2 + j)));
    if (kStream) {
      Ops::stream(out + j, o);
    } else {
      Ops::store(out + j, o);
    }
  }
  for (; j < n; j += 2) {
    const auto a = to_acc<Ops>(x[j]), b = to_acc<Ops>(x[j + 1]);
    out[j] = from_acc<x_t>(a * c2[j] + b * s2[j]);
    out[j + 1] = from_acc<x_t>(b * c2[j + 1] + a * s2[j + 1]);
  }
}

// Table row -> the buffers the row kernels read (see kPairDupTables).
template <class Ops, bool kPairDup, typename tab_t>
inline void expand_tables(const tab_t* cos, const tab_t* sin, int64_t cos_stride,
                          int64_t sin_stride, int64_t half, bool inverse,
                          typename Ops::acc* cbuf, typename Ops::acc* sbuf) {
  using acc = typename Ops::acc;
  const acc sign = inverse ? acc(-1) : acc(1);
  for (int64_t i = 0; i < half; ++i) {
    const acc c = to_acc<Ops>(cos[i * cos_stride]);
    const acc s = sign * to_acc<Ops>(sin[i * sin_stride]);
    if (kPairDup) {
      cbuf[2 * i] = c;
      cbuf[2 * i + 1] = c;
      sbuf[2 * i] = -s;
      sbuf[2 * i + 1] = s;
    } else {
      cbuf[i] = c;
      sbuf[i] = s;
    }
  }
}

// Converted table rows, re-expanded only when the source row changes.
template <class Ops, bool kPairDup, typename tab_t>
struct TableCache {
  using acc = typename Ops::acc;
  alignas(64) acc c[2 * kSimdMaxHalf];
  alignas(64) acc s[2 * kSimdMaxHalf];
  const tab_t* last_cos = nullptr;
  const tab_t* last_sin = nullptr;

  void get(const tab_t* cos, const tab_t* sin, int64_t cos_stride, int64_t sin_stride,
           int64_t half, bool inverse) {
    if (cos == last_cos && sin == last_sin) return;
    expand_tables<Ops, kPairDup>(cos, sin, cos_stride, sin_stride, half, inverse, c, s);
    last_cos = cos;
    last_sin = sin;
  }
};

template <class Ops, bool kInterleaved, bool kStream, typename x_t>
ROPE_SIMD_INLINE void rotate_row(const x_t* x, x_t* out, const typename Ops::acc* c,
                       const typename Ops::acc* s, int64_t half) {
  if (kInterleaved) {
    row_interleaved<Ops, kStream>(x, out, c, s, half);
  } else {
    row_half_split<Ops, kStream>(x, out, c, s, half);
  }
}

// Calls f(first_row, count, offset0, offset1, offset2, stride0, stride1, stride2) for each run of
// rows [b, e) of `ix` along its innermost leading dim (heads, usually, with the tables' stride 0
// there), so the caller walks a run with pointer increments; offsets are re-derived (a division
// per dim) only where a run wraps. On [T, 32, 128] a row is 2-4 vector steps: per-row index
// arithmetic showed in the profile.
template <typename F>
ROPE_SIMD_INLINE void for_each_run(const LeadIndexer& ix, int64_t b, int64_t e, F&& f) {
  if (ix.ndim == 0) {
    f(b, e - b, int64_t(0), int64_t(0), int64_t(0), int64_t(0), int64_t(0), int64_t(0));
    return;
  }
  const int last = ix.ndim - 1;
  const int64_t n = ix.sizes[last];
  const int64_t s0 = ix.strides[0][last], s1 = ix.strides[1][last], s2 = ix.strides[2][last];
  for (int64_t r = b; r < e;) {
    int64_t off[kMaxOperands];
    ix.offsets(r, off);
    const int64_t run = std::min(e - r, n - r % n);
    f(r, run, off[0], off[1], off[2], s0, s1, s2);
    r += run;
  }
}

// Calls f(row, offset0, offset1, offset2) for rows [b, e) of `ix` (rope.apply_'s tokens).
template <typename F>
ROPE_SIMD_INLINE void for_each_row(const LeadIndexer& ix, int64_t b, int64_t e, F&& f) {
  for_each_run(ix, b, e,
               [&](int64_t r, int64_t run, int64_t o0, int64_t o1, int64_t o2, int64_t s0,
                   int64_t s1, int64_t s2) ROPE_SIMD_INLINE_LAMBDA {
                 for (int64_t j = 0; j < run; ++j) f(r + j, o0 + j * s0, o1 + j * s1, o2 + j * s2);
               });
}

// ---- rope.apply / rope.apply_backward over rows [b, e) ----

template <typename x_t, typename tab_t, bool kInterleaved, bool kStream>
void apply_rows_impl(const ApplyJob& job, int64_t b, int64_t e) {
  using Ops = OpsFor<x_t>;
  using acc = typename Ops::acc;
  const ApplyGeometry& g = *job.g;
  const x_t* xp = static_cast<const x_t*>(job.x);
  x_t* op = static_cast<x_t*>(job.out);
  const tab_t* cp = static_cast<const tab_t*>(job.cos);
  const tab_t* sp = static_cast<const tab_t*>(job.sin);
  const int64_t half = g.half, rot = 2 * half, tail = g.head_dim - rot;
  // Forward half-split with tables already in the arithmetic type: read them in place.
  constexpr bool kMaybeDirect =
      std::is_same<tab_t, acc>::value && !kPairDupTables<Ops, x_t, kInterleaved>;
  const bool direct = kMaybeDirect && !job.inverse && g.cos_last == 1 && g.sin_last == 1;
  const int64_t hd = g.head_dim;
  TableCache<Ops, kPairDupTables<Ops, x_t, kInterleaved>, tab_t> tables;
  auto row = [&](const x_t* x, x_t* out, const acc* cb, const acc* sb) ROPE_SIMD_INLINE_LAMBDA {
    rotate_row<Ops, kInterleaved, kStream>(x, out, cb, sb, half);
    if (tail > 0) std::memcpy(out + rot, x + rot, tail * sizeof(x_t));
  };
  for_each_run(g.lead, b, e,
               [&](int64_t r, int64_t run, int64_t x_off, int64_t c_off, int64_t s_off,
                   int64_t xs, int64_t cs, int64_t ss) ROPE_SIMD_INLINE_LAMBDA {
                 const x_t* x = xp + x_off;
                 x_t* out = op + r * hd;
                 const tab_t* c = cp + c_off;
                 const tab_t* s = sp + s_off;
                 if (direct) {
                   for (int64_t j = 0; j < run; ++j, x += xs, out += hd, c += cs, s += ss) {
                     row(x, out, reinterpret_cast<const acc*>(c), reinterpret_cast<const acc*>(s));
                   }
                 } else {
                   for (int64_t j = 0; j < run; ++j, x += xs, out += hd, c += cs, s += ss) {
                     tables.get(c, s, g.cos_last, g.sin_last, half, job.inverse);
                     row(x, out, tables.c, tables.s);
                   }
                 }
               });
  if (kStream) store_fence();
}

template <typename x_t, typename tab_t>
void apply_rows(const ApplyJob& job, int64_t b, int64_t e) {
  if (job.interleaved) {
    job.stream ? apply_rows_impl<x_t, tab_t, true, true>(job, b, e)
               : apply_rows_impl<x_t, tab_t, true, false>(job, b, e);
  } else {
    job.stream ? apply_rows_impl<x_t, tab_t, false, true>(job, b, e)
               : apply_rows_impl<x_t, tab_t, false, false>(job, b, e);
  }
}

// ---- rope.apply_ over tokens [b, e) ----

template <typename x_t, typename tab_t, bool kInterleaved>
void inplace_tokens_impl(const InplaceJob& job, int64_t b, int64_t e) {
  using Ops = OpsFor<x_t>;
  using acc = typename Ops::acc;
  const InplaceGeometry& g = *job.g;
  x_t* qp = static_cast<x_t*>(job.query);
  x_t* kp = static_cast<x_t*>(job.key);
  const tab_t* cache = static_cast<const tab_t*>(job.cache);
  const int64_t half = g.half;
  constexpr bool kMaybeDirect =
      std::is_same<tab_t, acc>::value && !kPairDupTables<Ops, x_t, kInterleaved>;
  const bool direct = kMaybeDirect && g.cache_col_stride == 1;
  TableCache<Ops, kPairDupTables<Ops, x_t, kInterleaved>, tab_t> tables;
  for_each_row(g.lead, b, e, [&](int64_t, int64_t q_off, int64_t k_off, int64_t p_off) ROPE_SIMD_INLINE_LAMBDA {
    const int64_t p = job.pos64 ? static_cast<const int64_t*>(job.positions)[p_off]
                                : static_cast<const int32_t*>(job.positions)[p_off];
    const tab_t* c = cache + p * g.cache_row_stride;
    const tab_t* s = c + half * g.cache_col_stride;
    const acc* cb;
    const acc* sb;
    if (direct) {
      cb = reinterpret_cast<const acc*>(c);
      sb = reinterpret_cast<const acc*>(s);
    } else {
      tables.get(c, s, g.cache_col_stride, g.cache_col_stride, half, false);
      cb = tables.c;
      sb = tables.s;
    }
    for (int64_t h = 0; h < g.q_heads; ++h) {
      x_t* row = qp + q_off + h * g.q_head_stride;
      rotate_row<Ops, kInterleaved, false>(row, row, cb, sb, half);
    }
    for (int64_t h = 0; h < g.k_heads; ++h) {
      x_t* row = kp + k_off + h * g.k_head_stride;
      rotate_row<Ops, kInterleaved, false>(row, row, cb, sb, half);
    }
  });
}

template <typename x_t, typename tab_t>
void inplace_tokens(const InplaceJob& job, int64_t b, int64_t e) {
  job.interleaved ? inplace_tokens_impl<x_t, tab_t, true>(job, b, e)
                  : inplace_tokens_impl<x_t, tab_t, false>(job, b, e);
}

// ---- the table of one ISA ----

template <typename x_t>
void fill_row(CpuKernels& k, int xi) {
  k.apply[xi][kF32] = apply_rows<x_t, float>;
  k.apply[xi][kF64] = apply_rows<x_t, double>;
  k.apply[xi][kF16] = apply_rows<x_t, HalfBits>;
  k.apply[xi][kBF16] = apply_rows<x_t, BF16Bits>;
  k.inplace[xi][kF32] = inplace_tokens<x_t, float>;
  k.inplace[xi][kF64] = inplace_tokens<x_t, double>;
  k.inplace[xi][kF16] = inplace_tokens<x_t, HalfBits>;
  k.inplace[xi][kBF16] = inplace_tokens<x_t, BF16Bits>;
}

CpuKernels make_kernels() {
  CpuKernels k{};
  fill_row<float>(k, kF32);
  fill_row<double>(k, kF64);
  fill_row<HalfBits>(k, kF16);
  fill_row<BF16Bits>(k, kBF16);
  return k;
}

}  // namespace
}  // namespace rope
