// The norm stage of the CPU kernel family (rope.qk_norm_rope*, rope.norm_rope; the fused
// QK-RMSNorm + RoPE), written once in plain loops that the compiler vectorizes for the
// instruction set of the file including it: included by kernels.h, so compiled once per ISA into
// the same table (CpuKernels::norm_rope). Everything has internal linkage (see kernel_api.h). Per
// row (one head of one token): the sum of squares (kSumLanes partial sums, so the loop vectorizes),
// then each rotary pair read again (from L1), normalized (x * r), rotated with the weights folded
// into the token's cos and sin (a * (w_a * cos) - b * (w_b * sin): the products per token and
// target, not per head) and written once, then the dims past rotary_dim normalized, scaled and
// written. Arithmetic in float (double for float64), rounded once.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <utility>

#include "../../../rope_math.h"
#include "../../cpu/convert.h"
#include "../../cpu/dt_dispatch.h"
#include "../../cpu/kernel_api.h"

namespace rope {
namespace {

inline float to_f(float v) { return v; }
inline double to_f(double v) { return v; }
inline float to_f(HalfBits v) { return half_bits_to_float(v.bits); }
inline float to_f(BF16Bits v) { return bf16_to_float(v.bits); }

template <typename T, typename A>
inline T from_f(A v) {
  return static_cast<T>(v);
}
template <>
inline HalfBits from_f<HalfBits, float>(float v) {
  return HalfBits{float_to_half_bits(v)};
}
// convert.h's float_to_bf16 with the NaN case as a select, so the loops vectorize: the same bits.
template <>
inline BF16Bits from_f<BF16Bits, float>(float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  const uint16_t r = static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  return BF16Bits{v != v ? static_cast<uint16_t>(0xFFFF) : r};
}

#define ROPE_QK_INLINE inline __attribute__((always_inline))

constexpr int64_t kQkBlockPairs = 256;
constexpr int kSumLanes = 16;  // the partial sums of a row's squares

// part[0] += part[n]; then the halves of [0, n) likewise, down to one: log2 of the lane count
// dependent adds (a template, so each step has a constant width and unrolls).
template <int n, typename acc>
ROPE_QK_INLINE void tree_sum(acc* part) {
  for (int l = 0; l < n; ++l) part[l] += part[l + n];
  if constexpr (n > 1) tree_sum<n / 2>(part);
}

// A float row's 16 partial sums reduced in vector registers, pair for pair as tree_sum adds them:
// each step adds lane l ^ d to lane l, so lane 0 sums what part[0] does, and every step is an
// in-lane permutation or a swap of register halves. (The compiler's code of tree_sum took about
// 30 scalar extracts and adds per row: bfloat16 rows of 128 took 10% longer.)
typedef float FloatLanes __attribute__((vector_size(64)));
// (By reference: a vector passed by value would take a different ABI per instruction set.)
template <int d, int... rest>
ROPE_QK_INLINE void fold_lanes(FloatLanes& v) {
#if defined(__clang__)
  v += __builtin_shufflevector(v, v, 0 ^ d, 1 ^ d, 2 ^ d, 3 ^ d, 4 ^ d, 5 ^ d, 6 ^ d, 7 ^ d,
                               8 ^ d, 9 ^ d, 10 ^ d, 11 ^ d, 12 ^ d, 13 ^ d, 14 ^ d, 15 ^ d);
#else
  typedef int IntLanes __attribute__((vector_size(64)));
  v += __builtin_shuffle(v, IntLanes{0 ^ d, 1 ^ d, 2 ^ d, 3 ^ d, 4 ^ d, 5 ^ d, 6 ^ d, 7 ^ d,
                                     8 ^ d, 9 ^ d, 10 ^ d, 11 ^ d, 12 ^ d, 13 ^ d, 14 ^ d, 15 ^ d});
#endif
  if constexpr (sizeof...(rest) > 0) fold_lanes<rest...>(v);
}

// The sum of kSumLanes partial sums in tree_sum's pairing. kEvenOdd: part[l] holds the partial
// sum of element offset 2l (l < 8) or 2(l - 8) + 1 (the even/odd rows below), so tree_sum's tree
// over the offsets is the two halves' trees, then their sum.
template <bool kEvenOdd, typename acc>
ROPE_QK_INLINE acc sum_partials(acc* part) {
  if constexpr (std::is_same_v<acc, float>) {
    static_assert(kSumLanes == 16, "one vector of partial sums");
    FloatLanes v;
    std::memcpy(&v, part, sizeof(v));
    if constexpr (kEvenOdd) {
      fold_lanes<4, 2, 1, 8>(v);
    } else {
      fold_lanes<8, 4, 2, 1>(v);
    }
    return v[0];
  } else {
    static_assert(!kEvenOdd, "even/odd rows are float rows");
    tree_sum<kSumLanes / 2>(part);
    return part[0];
  }
}

// Rows that fit the stack: converted once into a float (double) buffer, whose sum of squares
// then vectorizes (kSumLanes independent partial sums: lanes of one vector) and which the
// rotation reads instead of the row.

template <typename x_t, typename acc>
inline void load_row(const x_t* x, int64_t last, int64_t n, acc* buf) {
  if (last == 1) {
    for (int64_t j = 0; j < n; ++j) buf[j] = static_cast<acc>(to_f(x[j]));
  } else {
    for (int64_t j = 0; j < n; ++j) buf[j] = static_cast<acc>(to_f(x[j * last]));
  }
}

// part[l] += the squares of buf's elements l, l + kSumLanes, ... (n a multiple of kSumLanes
// but in a row's last block: its tail goes to lanes 0, 1, ...).
template <typename acc>
ROPE_QK_INLINE void add_squares(const acc* buf, int64_t n, acc* part) {
  int64_t j = 0;
  for (; j + kSumLanes <= n; j += kSumLanes) {
    for (int l = 0; l < kSumLanes; ++l) part[l] += buf[j + l] * buf[j + l];
  }
  // (the bound on l, which holds anyway, keeps GCC from a false -Waggressive-loop-optimizations)
  for (int l = 0; l < kSumLanes && j < n; ++j, ++l) part[l] += buf[j] * buf[j];
}

template <typename acc>
inline acc sum_squares_buf(const acc* buf, int64_t n) {
  acc part[kSumLanes] = {};
  add_squares(buf, n, part);
  return sum_partials<false>(part);
}

// The sum of squares of a row too long for the stack buffers (or, across heads, of each head),
// in sum_squares_buf's order: converted a block at a time (a loop that vectorizes, where the
// row's elements one at a time took scalar code that waited on each load from memory).
template <typename x_t, typename acc>
__attribute__((noinline)) acc sum_squares(const x_t* x, int64_t last, int64_t n) {
  constexpr int64_t kBlock = 256;  // a multiple of kSumLanes: only the last block has a tail
  alignas(64) acc buf[kBlock];
  acc part[kSumLanes] = {};
  for (int64_t j0 = 0; j0 < n; j0 += kBlock) {
    const int64_t m = std::min(kBlock, n - j0);
    load_row<x_t, acc>(x + j0 * last, last, m, buf);
    add_squares(buf, m, part);
  }
  return sum_partials<false>(part);
}

// The block's weights folded into its cos and sin, for pair i of elements (ia, ib):
// ca = w_a * cos, sb = w_b * sin, cb = w_b * cos, sa = w_a * sin.
template <typename acc>
struct Folded {
  const acc* ca;
  const acc* sb;
  const acc* cb;
  const acc* sa;
};

// Rotates the pairs [b0, b0 + n) of one row, pair i's normalized elements given by
// ab(i, ia, ib) -> {a, b}, into dst (stride dl). Interleaved pairs go through two arrays: their two
// results land in adjacent elements, and GCC vectorizes "a*c - b*s, b*c + a*s" on adjacent lanes
// as one fused multiply-add-subtract (vfmaddsub) even under -ffp-contract=off, one rounding fewer
// than the other variants compute. Two plain loops and an interleaving store have no such lanes.
template <typename x_t, typename acc, bool kI, typename AB>
ROPE_QK_INLINE void rotate_pairs(x_t* dst, int64_t dl, int64_t half, int64_t b0, int64_t n,
                                 Folded<acc> f, AB ab) {
  if constexpr (kI) {
    alignas(64) acc lo[kQkBlockPairs];
    alignas(64) acc hi[kQkBlockPairs];
    for (int64_t i = 0; i < n; ++i) {
      const int64_t p = b0 + i;
      const auto [a, b] = ab(i, 2 * p, 2 * p + 1);
      lo[i] = a * f.ca[i] - b * f.sb[i];
      hi[i] = b * f.cb[i] + a * f.sa[i];
    }
    for (int64_t i = 0; i < n; ++i) {
      dst[2 * (b0 + i) * dl] = from_f<x_t>(lo[i]);
      dst[(2 * (b0 + i) + 1) * dl] = from_f<x_t>(hi[i]);
    }
  } else {
    for (int64_t i = 0; i < n; ++i) {
      const int64_t p = b0 + i;
      const auto [a, b] = ab(i, p, p + half);
      dst[p * dl] = from_f<x_t>(a * f.ca[i] - b * f.sb[i]);
      dst[(p + half) * dl] = from_f<x_t>(b * f.cb[i] + a * f.sa[i]);
    }
  }
}

// The pairs [b0, b0 + n) of a buffered row (unit stride) into dst (stride dl; kUnit: 1).
template <typename x_t, typename acc, bool kI, bool kUnit>
inline void norm_rotate_buf(const acc* buf, x_t* dst, int64_t dl, acc r, int64_t half,
                            int64_t b0, int64_t n, Folded<acc> f) {
  if (kUnit) dl = 1;
  rotate_pairs<x_t, acc, kI>(dst, dl, half, b0, n, f, [&](int64_t, int64_t ia, int64_t ib) {
    return std::pair<acc, acc>(buf[ia] * r, buf[ib] * r);
  });
}

template <typename x_t, typename acc, bool kUnit>
inline void norm_tail_buf(const acc* buf, x_t* dst, int64_t dl, const acc* w, acc r, int64_t from,
                          int64_t to) {
  if (kUnit) dl = 1;
  for (int64_t j = from; j < to; ++j) dst[j * dl] = from_f<x_t>((buf[j] * r) * w[j]);
}

// The pairs [b0, b0 + n) of one row. kUnit: unit strides (constants, so the loop vectorizes).
template <typename x_t, typename acc, bool kI, bool kUnit>
inline void norm_rotate_block(const x_t* src, int64_t sl, x_t* dst, int64_t dl, acc r,
                              int64_t half, int64_t b0, int64_t n, Folded<acc> f) {
  if (kUnit) sl = dl = 1;
  rotate_pairs<x_t, acc, kI>(dst, dl, half, b0, n, f, [&](int64_t, int64_t ia, int64_t ib) {
    return std::pair<acc, acc>(static_cast<acc>(to_f(src[ia * sl])) * r,
                               static_cast<acc>(to_f(src[ib * sl])) * r);
  });
}

template <typename x_t, typename acc, bool kUnit>
inline void norm_tail(const x_t* src, int64_t sl, x_t* dst, int64_t dl, const acc* w, int64_t ws,
                      acc r, int64_t from, int64_t to) {
  if (kUnit) sl = dl = ws = 1;
  for (int64_t j = from; j < to; ++j) {
    dst[j * dl] = from_f<x_t>((static_cast<acc>(to_f(src[j * sl])) * r) * w[j * ws]);
  }
}


// bfloat16 results of the fixed-head_dim rows (below) written whole vectors at once:
// - AVX512_BF16 (ROPE_AVX512_BF16, defined by that variant's file): a row of float results, one
//   instruction rounding 32 values to nearest even, then NaN lanes made torch's 0xFFFF. Like the
//   rotation kernels' variant, it treats float denormals (below 1.2e-38) as zero, unlike torch's
//   conversion (docs/math.md).
// - AVX2 (ROPE_AVX2_BF16, isa_avx2.cpp): rows in even/odd order, each 16 elements of a converted
//   row held as their 8 even elements, then their 8 odd ones (the tables likewise). One load
//   widens 16 values (a shift and a mask) and one word blend puts two vectors rounded as the
//   rotation kernels round (avx2_bf16.h) back in order, where widening and packing in order take
//   lane-crossing shuffles (the rotation kernels' kHalfSplitEvenOdd rows). Every element's
//   arithmetic is unchanged, and so are the bits: about 0.9x the time of in-order rows at 64
//   tokens.
// - Otherwise the compiler's code of from_f.
template <typename x_t>
constexpr bool kBf16 = std::is_same_v<x_t, BF16Bits>;
#if defined(ROPE_AVX512_BF16)
template <typename x_t>
constexpr bool kVectorBf16Rows = kBf16<x_t>;

template <int kD>
ROPE_QK_INLINE void store_bf16_row(BF16Bits* d, const float* out) {
  static_assert(kD % 32 == 0, "whole pairs of vectors");
  for (int j = 0; j < kD; j += 32) {
    const __m512 lo = _mm512_load_ps(out + j);
    const __m512 hi = _mm512_load_ps(out + j + 16);
    const __m512i r = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo));
    const __mmask32 nan = static_cast<__mmask32>(_mm512_cmp_ps_mask(lo, lo, _CMP_UNORD_Q)) |
                          (static_cast<__mmask32>(_mm512_cmp_ps_mask(hi, hi, _CMP_UNORD_Q)) << 16);
    _mm512_storeu_si512(d + j, _mm512_mask_mov_epi16(r, nan, _mm512_set1_epi16(-1)));
  }
}
#else
template <typename x_t>
constexpr bool kVectorBf16Rows = false;

template <int kD>
ROPE_QK_INLINE void store_bf16_row(BF16Bits*, const float*) {}
#endif

#if defined(ROPE_AVX2_BF16)
template <typename x_t>
constexpr bool kEvenOddRows = kBf16<x_t>;

// n (a multiple of 16) values, a bfloat16 row or a float table, as floats in even/odd order.
template <typename T>
ROPE_QK_INLINE void even_odd_floats(const T* in, float* out, int n) {
  for (int j = 0; j < n; j += 16) {
    __m256 even, odd;
    F32Ops::split_even_odd(in + j, even, odd);
    _mm256_store_ps(out + j, even);
    _mm256_store_ps(out + j + 8, odd);
  }
}

// 8 pairs: their a and b elements (8 floats each, aligned) normalized by rv, rotated with the
// folded tables (the pairs' 8 entries of each) into lo and hi.
ROPE_QK_INLINE void norm_rotate_8(const float* a_row, const float* b_row, __m256 rv,
                                  const float* ca, const float* sb, const float* cb,
                                  const float* sa, __m256& lo, __m256& hi) {
  const __m256 a = _mm256_mul_ps(_mm256_load_ps(a_row), rv);
  const __m256 b = _mm256_mul_ps(_mm256_load_ps(b_row), rv);
  lo = _mm256_sub_ps(_mm256_mul_ps(a, _mm256_loadu_ps(ca)), _mm256_mul_ps(b, _mm256_loadu_ps(sb)));
  hi = _mm256_add_ps(_mm256_mul_ps(b, _mm256_loadu_ps(cb)), _mm256_mul_ps(a, _mm256_loadu_ps(sa)));
}

// 16 pairs of a row in even/odd order: elements of a and b (the row's first and second half)
// normalized by r, rotated with the folded tables, rounded and written in order to da and db.
ROPE_QK_INLINE void norm_rotate_even_odd(const float* a_row, const float* b_row, float r,
                                         const float* ca, const float* sb, const float* cb,
                                         const float* sa, BF16Bits* da, BF16Bits* db) {
  const __m256 rv = _mm256_set1_ps(r);
  __m256 lo[2], hi[2];
  for (int h = 0; h < 2; ++h) {
    const int e = 8 * h;
    norm_rotate_8(a_row + e, b_row + e, rv, ca + e, sb + e, cb + e, sa + e, lo[h], hi[h]);
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(da), F32Ops::join_even_odd_raw(lo[0], lo[1]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(db), F32Ops::join_even_odd_raw(hi[0], hi[1]));
}

// 8 interleaved pairs of a row in even/odd order (their 16 elements: a_row the 8 even ones,
// a_row + 8 the odd ones): normalized by r, rotated with the folded tables (in pair order),
// rounded and written in order to d (pair i's results to elements 2i and 2i + 1).
ROPE_QK_INLINE void norm_rotate_even_odd_pairs(const float* a_row, float r, const float* ca,
                                               const float* sb, const float* cb, const float* sa,
                                               BF16Bits* d) {
  __m256 lo, hi;
  norm_rotate_8(a_row, a_row + 8, _mm256_set1_ps(r), ca, sb, cb, sa, lo, hi);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(d), F32Ops::join_even_odd_raw(lo, hi));
}

// 16 elements of a row in even/odd order past the rotary dims: normalized by r, scaled by their
// weights w (even/odd order too), rounded and written in order to d.
ROPE_QK_INLINE void norm_scale_even_odd(const float* row, float r, const float* w, BF16Bits* d) {
  const __m256 rv = _mm256_set1_ps(r);
  __m256 v[2];
  for (int h = 0; h < 2; ++h) {
    v[h] = _mm256_mul_ps(_mm256_mul_ps(_mm256_load_ps(row + 8 * h), rv), _mm256_load_ps(w + 8 * h));
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(d), F32Ops::join_even_odd_raw(v[0], v[1]));
}
#else  // never called (kEvenOddRows is false)
template <typename x_t>
constexpr bool kEvenOddRows = false;
template <typename T>
inline void even_odd_floats(const T*, float*, int) {}
inline void norm_rotate_even_odd(const float*, const float*, float, const float*, const float*,
                                 const float*, const float*, BF16Bits*, BF16Bits*) {}
inline void norm_rotate_even_odd_pairs(const float*, float, const float*, const float*,
                                       const float*, const float*, BF16Bits*) {}
inline void norm_scale_even_odd(const float*, float, const float*, BF16Bits*) {}
#endif

// The common rows: unit strides, either pair layout (kI), head_dim kD (64, 128, 256) and the pairs
// rotated kHalf (all of them, or 32: partial rotary as GLM-4.5's 64 of 128 and Qwen3-Next's 64
// of 256, the rest normalized and scaled) compile-time constants. Every loop has a constant trip
// count, so the compiler keeps the rows in registers (or L1) and vectorizes each step. Rows go
// in groups of kG heads, each in two steps: the norm (group_norm: sums of squares, then
// r = rsqrt(mean + eps)) and the rotation (group_rotate). A row's r is a chain of dependent
// operations (a tree of partial sums, a square root, a division): kG independent chains overlap,
// and norm_rope_heads_fixed runs the next group's norm before this group's rotation, so the
// chains' latency hides behind the rotation.

// Rows in the arithmetic type already (float, double) are read where they are, twice (the
// second time from L1); others are converted once into a stack buffer, read by the rotation.
template <typename x_t, typename acc, int kD, int kG>
struct GroupRows {
  static constexpr bool kDirect = std::is_same_v<x_t, acc>;
  alignas(64) acc row[kDirect ? 1 : kG][kDirect ? 1 : kD];
  acc r[kG];

  ROPE_QK_INLINE acc at(const x_t* src, int64_t src_head, int g, int j) const {
    return row_of(src, src_head, g)[j];
  }
  ROPE_QK_INLINE const acc* row_of(const x_t* src, int64_t src_head, int g) const {
    if constexpr (kDirect) {
      return src + g * src_head;
    } else {
      return row[g];
    }
  }
};

template <typename x_t, typename acc, int kD, int kG>
ROPE_QK_INLINE void group_norm(const x_t* src, int64_t src_head, acc eps,
                               GroupRows<x_t, acc, kD, kG>& rows) {
  static_assert(kD % kSumLanes == 0, "whole vectors of partial sums");
  if constexpr (kEvenOddRows<x_t>) {
    for (int g = 0; g < kG; ++g) even_odd_floats(src + g * src_head, rows.row[g], kD);
  } else if constexpr (!GroupRows<x_t, acc, kD, kG>::kDirect) {
    // Converted rows first (as one loop with the squares the compiler converts in narrower,
    // slower steps).
    for (int g = 0; g < kG; ++g) {
      for (int j = 0; j < kD; ++j) rows.row[g][j] = static_cast<acc>(to_f(src[g * src_head + j]));
    }
  }
  alignas(64) acc part[kG][kSumLanes];
  for (int g = 0; g < kG; ++g) {
    for (int l = 0; l < kSumLanes; ++l) part[g][l] = 0;
    for (int j = 0; j < kD; j += kSumLanes) {
      for (int l = 0; l < kSumLanes; ++l) {
        const acc v = rows.at(src, src_head, g, j + l);
        part[g][l] += v * v;
      }
    }
  }
  for (int g = 0; g < kG; ++g) {
    const acc sum = sum_partials<kEvenOddRows<x_t>>(part[g]);
    rows.r[g] = acc(1) / std::sqrt(sum / static_cast<acc>(kD) + eps);
  }
}

// The rotation goes chunk by chunk through the kG rows, so each chunk of the folded tables is
// loaded once for all of them (loads and stores, not arithmetic, bound this loop).
// Then the dims past the rotary ones, normalized and scaled by their weights w (in the rows'
// order), likewise.
template <typename x_t, typename acc, int kD, int kHalf, int kG, bool kI>
ROPE_QK_INLINE void group_rotate(const x_t* src, x_t* dst, int64_t src_head, int64_t dst_head,
                                 const GroupRows<x_t, acc, kD, kG>& rows,
                                 const acc* __restrict__ ca, const acc* __restrict__ sb,
                                 const acc* __restrict__ cb, const acc* __restrict__ sa,
                                 const acc* __restrict__ w) {
  constexpr int kChunk = 32;
  static_assert(kHalf % kChunk == 0 && 2 * kHalf <= kD, "whole chunks");
  for (int j = 0; kI && j < kHalf; j += kChunk) {  // interleaved: chunk j's 2 * kChunk elements
    for (int g = 0; g < kG; ++g) {
      const acc* rx = rows.row_of(src, src_head, g) + 2 * j;
      x_t* d = dst + g * dst_head + 2 * j;
      const acc r = rows.r[g];
      if constexpr (kEvenOddRows<x_t>) {  // each 16 elements: their 8 pairs' a, then their b
        for (int i = 0; i < kChunk; i += 8) {
          norm_rotate_even_odd_pairs(rx + 2 * i, r, ca + j + i, sb + j + i, cb + j + i, sa + j + i,
                                     d + 2 * i);
        }
        continue;
      }
      // The results in two arrays, then interleaved (as rotate_pairs computes them, so that no
      // fused multiply-add-subtract of adjacent lanes rounds them otherwise). In place, every
      // element of the chunk is read before any is written.
      alignas(64) acc lo[kChunk], hi[kChunk];
      for (int l = 0; l < kChunk; ++l) {
        const acc a = rx[2 * l] * r, b = rx[2 * l + 1] * r;
        lo[l] = a * ca[j + l] - b * sb[j + l];
        hi[l] = b * cb[j + l] + a * sa[j + l];
      }
      if constexpr (kVectorBf16Rows<x_t>) {
        alignas(64) float out[2 * kChunk];
        for (int l = 0; l < kChunk; ++l) out[2 * l] = lo[l], out[2 * l + 1] = hi[l];
        store_bf16_row<2 * kChunk>(d, out);
      } else {
        for (int l = 0; l < kChunk; ++l) {
          d[2 * l] = from_f<x_t>(lo[l]);
          d[2 * l + 1] = from_f<x_t>(hi[l]);
        }
      }
    }
  }
  for (int j = 0; !kI && j < kHalf; j += kChunk) {
    for (int g = 0; g < kG; ++g) {
      const acc* ra = rows.row_of(src, src_head, g) + j;  // the chunk's first and second members
      const acc* rb = ra + kHalf;
      x_t* da = dst + g * dst_head + j;
      x_t* db = da + kHalf;
      const acc r = rows.r[g];
      if constexpr (kEvenOddRows<x_t>) {  // rows and tables in even/odd order
        for (int i = 0; i < kChunk; i += 16) {
          norm_rotate_even_odd(ra + i, rb + i, r, ca + j + i, sb + j + i, cb + j + i, sa + j + i,
                               da + i, db + i);
        }
      } else if constexpr (kVectorBf16Rows<x_t>) {  // the results in float, then converted at once
        alignas(64) float lo[kChunk], hi[kChunk];
        for (int l = 0; l < kChunk; ++l) {
          const acc a = ra[l] * r, b = rb[l] * r;
          lo[l] = a * ca[j + l] - b * sb[j + l];
          hi[l] = b * cb[j + l] + a * sa[j + l];
        }
        store_bf16_row<kChunk>(da, lo);
        store_bf16_row<kChunk>(db, hi);
      } else {
        // In place (dst == src) each element is read before it is written, and no other
        // element reads it: the loop has no dependence between iterations.
#pragma GCC ivdep
        for (int l = 0; l < kChunk; ++l) {
          const acc a = ra[l] * r, b = rb[l] * r;
          da[l] = from_f<x_t>(a * ca[j + l] - b * sb[j + l]);
          db[l] = from_f<x_t>(b * cb[j + l] + a * sa[j + l]);
        }
      }
    }
  }
  for (int j = 2 * kHalf; j < kD; j += kChunk) {  // (x * r) * w, as the other rows round it
    for (int g = 0; g < kG; ++g) {
      const acc* rx = rows.row_of(src, src_head, g) + j;
      x_t* d = dst + g * dst_head + j;
      const acc* wj = w + j;
      const acc r = rows.r[g];
      if constexpr (kEvenOddRows<x_t>) {
        for (int i = 0; i < kChunk; i += 16) norm_scale_even_odd(rx + i, r, wj + i, d + i);
      } else if constexpr (kVectorBf16Rows<x_t>) {
        alignas(64) float out[kChunk];
        for (int l = 0; l < kChunk; ++l) out[l] = (rx[l] * r) * wj[l];
        store_bf16_row<kChunk>(d, out);
      } else {
#pragma GCC ivdep
        for (int l = 0; l < kChunk; ++l) d[l] = from_f<x_t>((rx[l] * r) * wj[l]);
      }
    }
  }
}

// The rows a fixed-path call prefetches past its own (prefetch: rows from DRAM): those of the
// next target or token, `heads` rows `head` elements apart from src (none: heads 0).
template <typename x_t>
struct NextRows {
  bool prefetch = false;
  const x_t* src = nullptr;
  int64_t head = 0, heads = 0;
};

// Every head of one target of one token (not inlined: one copy per element type, kD and kHalf,
// not one per layout). ca, sb, cb and sa are the caller's stack buffers, so no write through dst
// reaches them (__restrict__: the stores need not be ordered against their loads).
template <typename x_t, typename acc, int kD, int kHalf, bool kI>
__attribute__((noinline)) void norm_rope_heads_fixed(const x_t* src, x_t* dst, int64_t src_head,
                                                     int64_t dst_head, int64_t heads,
                                                     const acc* __restrict__ ca,
                                                     const acc* __restrict__ sb,
                                                     const acc* __restrict__ cb,
                                                     const acc* __restrict__ sa,
                                                     const acc* __restrict__ w, acc eps,
                                                     const NextRows<x_t>& next) {
  constexpr int kG = 4;
  // Rows from DRAM (next.prefetch: the call's rows outgrow the caches): the loads of a group
  // wait on memory (the cache's miss buffers hold a group's lines at most), so the rows kAhead
  // heads past those being read are fetched (to be written: in place) meanwhile, past the last
  // head into the rows the caller runs next.
  constexpr int kAhead = 2 * kG;
  constexpr int kLineElems = 64 / static_cast<int>(sizeof(x_t));
  const int64_t groups = heads / kG;
  constexpr bool kEvenOdd = kEvenOddRows<x_t>;
  alignas(32) acc t[kEvenOdd && !kI ? 4 : 1][kEvenOdd && !kI ? kHalf : 1];
  alignas(32) acc wt[kEvenOdd && 2 * kHalf < kD ? kD : 1];
  if constexpr (kEvenOdd) {  // the tables, and the weights past the rotary dims, in the rows' order
    if constexpr (!kI) {  // (interleaved rows in even/odd order hold their pairs' a and b apart)
      const acc* in[4] = {ca, sb, cb, sa};
      for (int k = 0; k < 4; ++k) even_odd_floats(in[k], t[k], kHalf);
      ca = t[0], sb = t[1], cb = t[2], sa = t[3];
    }
    if constexpr (2 * kHalf < kD) {
      even_odd_floats(w + 2 * kHalf, wt + 2 * kHalf, kD - 2 * kHalf);
      w = wt;
    }
  }
  GroupRows<x_t, acc, kD, kG> rows[2];
  if (groups > 0) group_norm<x_t, acc, kD, kG>(src, src_head, eps, rows[0]);
  for (int64_t q = 0; q < groups; ++q) {
    const int64_t h = q * kG;
    for (int g = 0; next.prefetch && g < kG; ++g) {
      const int64_t ahead = h + kG + kAhead + g;  // past the next group's rows, normed now
      const x_t* row = ahead < heads ? src + ahead * src_head
                       : ahead - heads < next.heads ? next.src + (ahead - heads) * next.head
                                                    : nullptr;
      for (int j = 0; row != nullptr && j < kD; j += kLineElems) {
        __builtin_prefetch(row + j, 1, 3);
      }
    }
    if (q + 1 < groups) {
      group_norm<x_t, acc, kD, kG>(src + (h + kG) * src_head, src_head, eps, rows[(q + 1) & 1]);
    }
    group_rotate<x_t, acc, kD, kHalf, kG, kI>(src + h * src_head, dst + h * dst_head, src_head,
                                              dst_head, rows[q & 1], ca, sb, cb, sa, w);
  }
  for (int64_t h = groups * kG; h < heads; ++h) {
    GroupRows<x_t, acc, kD, 1> one;
    group_norm<x_t, acc, kD, 1>(src + h * src_head, src_head, eps, one);
    group_rotate<x_t, acc, kD, kHalf, 1, kI>(src + h * src_head, dst + h * dst_head, src_head,
                                             dst_head, one, ca, sb, cb, sa, w);
  }
}

// The fixed paths: head_dim kD, rotated pairs kHalf (all, or 32: partial rotary of 64 dims).
// The forward takes them for interleaved pairs too but at head_dim 256 (no model we know of
// normalizes interleaved rows of 256; 150 KB of library), the backward for half-split pairs.
enum class FixedRows { kNone, k64, k128, k256, k128Rot64, k256Rot64 };

// Which fixed path the rows of target tg take.
inline FixedRows fixed_rows(const RotateGeometry& g, const TargetDesc& tg) {
  if (tg.src_last != 1 || tg.dst_last != 1 || g.rot_offset != 0) {
    return FixedRows::kNone;
  }
  const int64_t D = g.head_dim, half = g.half;
  if (D == 256 && g.interleaved) return FixedRows::kNone;
  if (2 * half == D) {
    return D == 64 ? FixedRows::k64 : D == 128 ? FixedRows::k128 : D == 256 ? FixedRows::k256
                                                                            : FixedRows::kNone;
  }
  if (half != 32) return FixedRows::kNone;
  return D == 128 ? FixedRows::k128Rot64 : D == 256 ? FixedRows::k256Rot64 : FixedRows::kNone;
}

inline int64_t read_pos(const void* pos, bool pos64, int64_t off) {
  return pos64 ? static_cast<const int64_t*>(pos)[off]
               : static_cast<int64_t>(static_cast<const int32_t*>(pos)[off]);
}

// The cos and sin of pairs [b0, b0 + n) of a token's table rows (per MRoPE component: cr, sr,
// byte pointers to element 0 of each row), converted from the tables' dtype dt into c and s.
// The dtype is switched on here, once per block, rather than being a template parameter of the
// token walk: only these loops are compiled per table dtype (and not inlined: one copy per
// arithmetic type), not the whole walk.
template <typename acc>
__attribute__((noinline)) void load_table_block(int dt, const TableDesc& t,
                                                const char* const* cr, const char* const* sr,
                                                int64_t b0, int64_t n, acc* __restrict__ c,
                                                acc* __restrict__ s) {
  with_dt_type(dt, [&](auto elem) {
    using tab_t = decltype(elem);
    const bool mrope = t.kind == TableKind::kMrope;
    // Rows at a constant stride (the table contiguous, or every other entry of a float one, as
    // kernels.h TableBlock reads it): loops that vectorize.
    auto strided = [&](auto stride) {
      const tab_t* c0 = reinterpret_cast<const tab_t*>(cr[0]) + stride * b0;
      const tab_t* s0 = reinterpret_cast<const tab_t*>(sr[0]) + stride * b0;
      for (int64_t i = 0; i < n; ++i) {
        c[i] = static_cast<acc>(to_f(c0[stride * i]));
        s[i] = static_cast<acc>(to_f(s0[stride * i]));
      }
    };
    if (!mrope && t.cos_col == 1 && t.sin_col == 1) {
      return strided(std::integral_constant<int, 1>{});
    }
    if (std::is_same_v<tab_t, float> && !mrope && t.cos_col == 2 && t.sin_col == 2) {
      return strided(std::integral_constant<int, 2>{});
    }
    for (int64_t i = 0; i < n; ++i) {
      const int64_t pair = b0 + i;
      const int j = mrope ? mrope_component(pair, t.section, t.mrope_interleaved) : 0;
      c[i] = static_cast<acc>(to_f(reinterpret_cast<const tab_t*>(cr[j])[pair * t.cos_col]));
      s[i] = static_cast<acc>(to_f(reinterpret_cast<const tab_t*>(sr[j])[pair * t.sin_col]));
    }
  });
}

// The n weights (stride ws, DtIndex dt) plus `unit` into out, in the arithmetic type: like
// load_table_block, a switch once per call rather than a copy of every loop per weight dtype.
template <typename acc>
__attribute__((noinline)) void load_weights(int dt, const void* w, int64_t ws, int64_t n, acc unit,
                                            acc* __restrict__ out) {
  with_dt_type(dt, [&](auto elem) {
    using W = decltype(elem);
    const W* p = static_cast<const W*>(w);
    for (int64_t j = 0; j < n; ++j) out[j] = static_cast<acc>(to_f(p[j * ws])) + unit;
  });
}

// ---- rope.norm_rope's general rows: LayerNorm, RMSNorm across heads, biases ----
// Each row converted into a stack buffer, normalized and scaled there (z = n * w + b), then its
// pairs rotated by the plain cos and sin of the block and the rest copied: one read and one
// write of the row, like the RMSNorm paths, with the norm's statistics from the buffer (L1).

template <typename acc>
inline acc sum_buf(const acc* buf, int64_t n) {
  acc part[kSumLanes] = {};
  int64_t j = 0;
  for (; j + kSumLanes <= n; j += kSumLanes) {
    for (int l = 0; l < kSumLanes; ++l) part[l] += buf[j + l];
  }
  for (int l = 0; j < n; ++j, ++l) part[l] += buf[j];
  return sum_partials<false>(part);
}

// z = (buf * r) * w + b in place (w, b: nullptr for none), the order the reference rounds in.
template <typename acc>
inline void scale_row(acc* __restrict__ buf, int64_t n, acc r, const acc* __restrict__ w,
                      const acc* __restrict__ b) {
  if (w != nullptr && b != nullptr) {
    for (int64_t j = 0; j < n; ++j) buf[j] = (buf[j] * r) * w[j] + b[j];
  } else if (w != nullptr) {
    for (int64_t j = 0; j < n; ++j) buf[j] = (buf[j] * r) * w[j];
  } else if (b != nullptr) {
    for (int64_t j = 0; j < n; ++j) buf[j] = buf[j] * r + b[j];
  } else {
    for (int64_t j = 0; j < n; ++j) buf[j] *= r;
  }
}

// The pairs [b0, b0 + n) of a normalized row rotated by the plain c and s into dst (stride dl;
// kUnit: 1), through rotate_pairs (its interleaved form keeps the variants' bits equal).
template <typename x_t, typename acc, bool kI, bool kUnit>
inline void rotate_buf(const acc* z, x_t* dst, int64_t dl, int64_t half, int64_t b0, int64_t n,
                       const acc* c, const acc* s) {
  if (kUnit) dl = 1;
  rotate_pairs<x_t, acc, kI>(dst, dl, half, b0, n, Folded<acc>{c, s, c, s},
                             [&](int64_t, int64_t ia, int64_t ib) {
                               return std::pair<acc, acc>(z[ia], z[ib]);
                             });
}

template <typename x_t, typename acc, bool kUnit>
inline void store_buf(const acc* z, x_t* dst, int64_t dl, int64_t from, int64_t to) {
  if (kUnit) dl = 1;
  for (int64_t j = from; j < to; ++j) dst[j * dl] = from_f<x_t>(z[j]);
}

// One row's statistic r (and its mean removed from buf, for LayerNorm).
template <typename acc>
inline acc row_rstd(acc* buf, int64_t n, NormForm form, acc eps) {
  if (form == NormForm::kLayer) {
    const acc mean = sum_buf<acc>(buf, n) / static_cast<acc>(n);
    for (int64_t j = 0; j < n; ++j) buf[j] -= mean;
  }
  return acc(1) / std::sqrt(sum_squares_buf<acc>(buf, n) / static_cast<acc>(n) + eps);
}

template <typename x_t, bool kI>
void norm_rope_tokens_impl(const NormJob& job, int64_t b, int64_t e) {
  using acc = opmath_t<x_t>;
  const RotateGeometry& g = *job.g;
  const TableDesc& t = g.table;
  const int64_t half = g.half, D = g.head_dim;
  const acc eps = static_cast<acc>(job.norm.eps);
  const acc unit = job.norm.unit_offset ? acc(1) : acc(0);
  // The weights (+ 1 for the Gemma form) in the arithmetic type: converted here for rows that
  // fit the stack buffers, else already cast by the host (then read with their stride).
  alignas(64) acc wbuf[2][kQkNormStackHeadDim];
  const acc* w[2];
  int64_t ws[2];
  for (int k = 0; k < g.targets; ++k) {
    if (D <= kQkNormStackHeadDim) {
      if (job.w[k] == nullptr) {  // no weight (rope.norm_rope): the tables unscaled
        std::fill(wbuf[k], wbuf[k] + D, acc(1) + unit);
      } else {
        load_weights<acc>(job.w_dt[k], job.w[k], job.norm.w_stride[k], D, unit, wbuf[k]);
      }
      w[k] = wbuf[k];
      ws[k] = 1;
    } else {
      w[k] = static_cast<const acc*>(job.w[k]);
      ws[k] = job.norm.w_stride[k];
    }
  }
  const bool weights_plus_unit = D <= kQkNormStackHeadDim || !job.norm.unit_offset;
  // The weight of element j as the rows are scaled by: w + 1 added here for long rows of the
  // Gemma form (their weights are read from the host's cast, not the stack buffers).
  auto weight = [&](int k, int64_t j) {
    return weights_plus_unit ? w[k][j * ws[k]] : w[k][j * ws[k]] + unit;
  };
  alignas(64) acc c[kQkBlockPairs];
  alignas(64) acc s[kQkBlockPairs];
  alignas(64) acc fold[4][kQkBlockPairs];
  const Folded<acc> folded{fold[0], fold[1], fold[2], fold[3]};
  alignas(64) acc row[kQkNormStackHeadDim];
  // Rows past the caches (about a core's L2) are prefetched on the fixed-head_dim path.
  // (In double: an estimate, which no product can overflow.)
  const bool prefetch = static_cast<double>(g.tokens) *
                            static_cast<double>(g.target[0].heads + g.target[1].heads) *
                            static_cast<double>(D) * sizeof(x_t) >
                        double(4 << 20);
  const char* key[2 * kMropeComponents] = {};
  int64_t key_b0 = -1;
  int fold_k = -1;  // the target whose weights fold holds, with the cos and sin in c and s
  // A token's operand offsets and its table rows (per MRoPE component), as byte pointers: the
  // table dtype is a run-time value (load_table_block), its element size tes.
  const int64_t tes = dt_size(job.table_dt);
  const char* const cos_base = static_cast<const char*>(job.cos);
  const char* const sin_base = static_cast<const char*>(job.sin);
  struct TokenRows {
    int64_t off[kMaxOperands];
    const char* cr[kMropeComponents];
    const char* sr[kMropeComponents];
  };
  auto token_rows = [&](int64_t tok, TokenRows& r) {
    g.lead.offsets(tok, r.off);
    if (t.kind == TableKind::kStrided) {
      r.cr[0] = r.cr[1] = r.cr[2] = cos_base + r.off[kTab0] * tes;
      r.sr[0] = r.sr[1] = r.sr[2] = sin_base + r.off[kTab1] * tes;
      return;
    }
    const bool mrope = t.kind == TableKind::kMrope;
    for (int j = 0; j < kMropeComponents; ++j) {
      const int64_t p = read_pos(job.positions, t.pos64,
                                 r.off[kTab0] + (mrope ? j * t.pos_component : 0));
      r.cr[j] = cos_base + p * t.cos_row * tes;
      r.sr[j] = sin_base + p * t.sin_row * tes;
    }
  };
  // Gathered rows of a contiguous table: the next token's are fetched while this one runs
  // (positions in any order, e.g. a decode batch, miss the caches at each token otherwise).
  const bool prefetch_tables =
      t.kind != TableKind::kStrided && t.cos_col == 1 && t.sin_col == 1;
  const int64_t table_row_bytes = half * tes;
  TokenRows cur, next;
  for (int64_t tok = b; tok < e; ++tok) {
    if (tok == b) {
      token_rows(tok, cur);
    } else {
      cur = next;
    }
    if (tok + 1 < e) token_rows(tok + 1, next);
    if (prefetch_tables && tok + 1 < e) {
      const int comps = t.kind == TableKind::kMrope ? kMropeComponents : 1;
      for (int j = 0; j < comps; ++j) {
        for (int64_t x = 0; x < table_row_bytes; x += 64) {
          __builtin_prefetch(next.cr[j] + x, 0, 3);
          __builtin_prefetch(next.sr[j] + x, 0, 3);
        }
      }
    }
    const int64_t* off = cur.off;
    const char* const* cr = cur.cr;
    const char* const* sr = cur.sr;
    // The cos and sin of pairs [b0, b0 + n) of this token in c and s (kept while the token's
    // table rows and the block stay the same), then target k's weights folded into them.
    auto tables = [&](int k, int64_t b0, int64_t n) {
      bool same = key_b0 == b0;
      for (int j = 0; j < kMropeComponents; ++j) {
        same = same && key[2 * j] == cr[j] && key[2 * j + 1] == sr[j];
        key[2 * j] = cr[j];
        key[2 * j + 1] = sr[j];
      }
      if (same && fold_k == k) return;
      if (!same) {
        key_b0 = b0;
        load_table_block<acc>(job.table_dt, t, cr, sr, b0, n, c, s);
      }
      fold_k = k;
      auto fold_pairs = [&](auto wa_of, auto wb_of) {
        for (int64_t i = 0; i < n; ++i) {
          const acc wa = wa_of(b0 + i), wb = wb_of(b0 + i);
          fold[0][i] = wa * c[i];
          fold[1][i] = wb * s[i];
          fold[2][i] = wb * c[i];
          fold[3][i] = wa * s[i];
        }
      };
      if (!kI && ws[k] == 1 && weights_plus_unit) {  // unit-stride weights: vectorizes
        const acc* wk = w[k];
        fold_pairs([&](int64_t p) { return wk[p]; }, [&](int64_t p) { return wk[p + half]; });
      } else {
        fold_pairs([&](int64_t p) { return weight(k, kI ? 2 * p : p); },
                   [&](int64_t p) { return weight(k, kI ? 2 * p + 1 : p + half); });
      }
    };
    // rope.norm_rope's general rows of target k (see row_rstd): runs of `group` heads share
    // one statistic (all heads of a token across heads, else each head its own).
    auto general_rows = [&](int k, const TargetDesc& tg, const x_t* src, x_t* dst) {
      const NormForm form = job.norm.form;
      const bool across = form == NormForm::kRmsAcrossHeads;
      const int64_t group = across ? job.norm.group_heads[k] : 1;
      const acc* wk = static_cast<const acc*>(job.w[k]);
      const acc* bk = static_cast<const acc*>(job.b[k]);
      for (int64_t h0 = 0; h0 < tg.heads; h0 += group) {
        acc r = 0;
        if (across) {
          acc ss = 0;
          for (int64_t h = h0; h < h0 + group; ++h) {
            ss += sum_squares<x_t, acc>(src + h * tg.src_head, tg.src_last, D);
          }
          r = acc(1) / std::sqrt(ss / static_cast<acc>(group * D) + eps);
        }
        for (int64_t h = h0; h < h0 + group; ++h) {
          load_row<x_t, acc>(src + h * tg.src_head, tg.src_last, D, row);
          if (!across) r = row_rstd<acc>(row, D, form, eps);
          const int64_t wo = across ? (h - h0) * D : 0;  // this head's weights and biases
          scale_row<acc>(row, D, r, wk == nullptr ? nullptr : wk + wo,
                         bk == nullptr ? nullptr : bk + wo);
          x_t* d = dst + h * tg.dst_head;
          for (int64_t b0 = 0; b0 < half; b0 += kQkBlockPairs) {
            const int64_t n = std::min(kQkBlockPairs, half - b0);
            tables(k, b0, n);  // c and s: the plain cos and sin of the block
            if (tg.dst_last == 1) {
              rotate_buf<x_t, acc, kI, true>(row, d, 1, half, b0, n, c, s);
            } else {
              rotate_buf<x_t, acc, kI, false>(row, d, tg.dst_last, half, b0, n, c, s);
            }
          }
          if (tg.dst_last == 1) {
            store_buf<x_t, acc, true>(row, d, 1, 2 * half, D);
          } else {
            store_buf<x_t, acc, false>(row, d, tg.dst_last, 2 * half, D);
          }
        }
      }
    };
    for (int k = 0; k < g.targets; ++k) {
      const TargetDesc& tg = g.target[k];
      const x_t* src = static_cast<const x_t*>(job.src[k]) + off[2 * k];
      x_t* dst = static_cast<x_t*>(job.dst[k]) + off[2 * k + 1];
      if (job.general) {
        general_rows(k, tg, src, dst);
        continue;
      }
      const bool unit_strides = tg.src_last == 1 && tg.dst_last == 1 && ws[k] == 1;
      // (float64 rows, which tests and references use, take the general rows: each fixed path
      // is a copy per element type, pair layout and instruction set.)
      constexpr bool kFixedRows = !std::is_same_v<x_t, double>;
      if (const FixedRows fixed = kFixedRows && D <= kQkNormStackHeadDim ? fixed_rows(g, tg)
                                                                         : FixedRows::kNone;
          fixed != FixedRows::kNone) {
        tables(k, 0, half);
        NextRows<x_t> rows_after;  // the next target's rows, or the next token's first target's
        rows_after.prefetch = prefetch;
        const int nk = k + 1 < g.targets ? k + 1 : tok + 1 < e ? 0 : -1;
        if (prefetch && nk >= 0) {
          rows_after.src = static_cast<const x_t*>(job.src[nk]) + (nk > k ? off : next.off)[2 * nk];
          rows_after.head = g.target[nk].src_head;
          rows_after.heads = g.target[nk].heads;
        }
        const auto run = [&](auto fixed_fn) {
          fixed_fn(src, dst, tg.src_head, tg.dst_head, tg.heads, fold[0], fold[1], fold[2],
                   fold[3], w[k], eps, rows_after);
        };
        switch (fixed) {
          case FixedRows::k64: run(norm_rope_heads_fixed<x_t, acc, 64, 32, kI>); break;
          case FixedRows::k128: run(norm_rope_heads_fixed<x_t, acc, 128, 64, kI>); break;
          case FixedRows::k128Rot64: run(norm_rope_heads_fixed<x_t, acc, 128, 32, kI>); break;
          default:  // (fixed_rows gives interleaved rows of 256 none)
            if constexpr (!kI) {
              if (fixed == FixedRows::k256) {
                run(norm_rope_heads_fixed<x_t, acc, 256, 128, false>);
              } else {
                run(norm_rope_heads_fixed<x_t, acc, 256, 32, false>);
              }
            }
        }
        continue;
      }
      for (int64_t h = 0; h < tg.heads; ++h, src += tg.src_head, dst += tg.dst_head) {
        if (D <= kQkNormStackHeadDim) {  // the row through a stack buffer (weights there too)
          load_row<x_t, acc>(src, tg.src_last, D, row);
          const acc r = acc(1) / std::sqrt(sum_squares_buf<acc>(row, D) / static_cast<acc>(D) + eps);
          const bool unit_dst = tg.dst_last == 1;
          for (int64_t b0 = 0; b0 < half; b0 += kQkBlockPairs) {
            const int64_t n = std::min(kQkBlockPairs, half - b0);
            tables(k, b0, n);
            if (unit_dst) {
              norm_rotate_buf<x_t, acc, kI, true>(row, dst, 1, r, half, b0, n, folded);
            } else {
              norm_rotate_buf<x_t, acc, kI, false>(row, dst, tg.dst_last, r, half, b0, n, folded);
            }
          }
          if (unit_dst) {
            norm_tail_buf<x_t, acc, true>(row, dst, 1, w[k], r, 2 * half, D);
          } else {
            norm_tail_buf<x_t, acc, false>(row, dst, tg.dst_last, w[k], r, 2 * half, D);
          }
          continue;
        }
        const acc ss = sum_squares<x_t, acc>(src, tg.src_last, D);
        const acc r = acc(1) / std::sqrt(ss / static_cast<acc>(D) + eps);
        for (int64_t b0 = 0; b0 < half; b0 += kQkBlockPairs) {
          const int64_t n = std::min(kQkBlockPairs, half - b0);
          tables(k, b0, n);
          if (tg.src_last == 1 && tg.dst_last == 1) {
            norm_rotate_block<x_t, acc, kI, true>(src, 1, dst, 1, r, half, b0, n, folded);
          } else {
            norm_rotate_block<x_t, acc, kI, false>(src, tg.src_last, dst, tg.dst_last, r, half, b0,
                                                   n, folded);
          }
        }
        if (!weights_plus_unit) {
          for (int64_t j = 2 * half; j < D; ++j) {
            dst[j * tg.dst_last] =
                from_f<x_t>((static_cast<acc>(to_f(src[j * tg.src_last])) * r) * weight(k, j));
          }
        } else if (unit_strides) {
          norm_tail<x_t, acc, true>(src, 1, dst, 1, w[k], 1, r, 2 * half, D);
        } else {
          norm_tail<x_t, acc, false>(src, tg.src_last, dst, tg.dst_last, w[k], ws[k], r, 2 * half,
                                     D);
        }
      }
    }
    if (job.after_token.fn != nullptr) job.after_token.fn(job.after_token.ctx, tok, off);
  }
}

template <typename x_t>
void norm_rope_layout(const NormJob& job, int64_t b, int64_t e) {
  job.g->interleaved ? norm_rope_tokens_impl<x_t, true>(job, b, e)
                     : norm_rope_tokens_impl<x_t, false>(job, b, e);
}

// ---- the backward of rope.qk_norm_rope (rope.qk_norm_rope_backward) ----
// Per row, with its x and grad converted into the task's scratch rows (L1): r = rsqrt(mean(x^2) +
// eps); gz = grad rotated back (the conjugate rotation: a * c + b * s, b * c - a * s; the dims
// past rotary_dim as they are); then, with gn = gz * w and n = x * r,
//   grad_x = r * (gn - n * m), m = mean(gn * n) = r * sum(gn * x) / D,
// rounded once. (In this form every factor stays in range wherever grad_x does; the expanded
// r * gn - x * r^3 * sum(gn * x) / D overflows float in r^3 at rows of RMS below 1e-13 with
// eps 0, and loses digits to subnormals at RMS above 1e13.) grad_weight += gz * n: summed over
// blocks of kGwBlockRows rows, each block added into the task's total with a compensated (Kahan)
// sum, so that the error stays at a few roundings however many rows a task has (a running sum
// over a million rows lost four digits); the host adds the tasks' totals. One read of x and grad
// and one write of grad_x, where the same in torch ops is about a dozen passes over float32
// copies (docs/qk_norm.md "Backward").
constexpr int64_t kGwBlockRows = 16;

// A row's grad_x (contiguous: the output is) and its share of grad_weight (into the block's
// sums gw); restrict, so both loops vectorize (o may be float, as gw is). bfloat16 rows where
// the variant converts a vector at once (kVectorBf16Rows): 32 results at a time in float, then
// store_bf16_row (the tail as from_f rounds it: the same bits).
template <typename x_t, typename acc>
ROPE_QK_INLINE void backward_row_out(x_t* __restrict__ o, acc* __restrict__ gw,
                                     const acc* __restrict__ gr, const acc* __restrict__ xr,
                                     const acc* __restrict__ w, acc r, acc m, int64_t D) {
  if constexpr (kVectorBf16Rows<x_t>) {
    int64_t k = 0;
    for (; k + 32 <= D; k += 32) {
      alignas(64) float out[32];
      for (int l = 0; l < 32; ++l) out[l] = r * (gr[k + l] * w[k + l] - (xr[k + l] * r) * m);
      store_bf16_row<32>(o + k, out);
    }
    // (the bound on l, which holds anyway, keeps GCC from a false -Waggressive-loop-optimizations)
    for (int l = 0; l < 32 && k < D; ++l, ++k) {
      o[k] = from_f<x_t>(r * (gr[k] * w[k] - (xr[k] * r) * m));
    }
  } else {
    for (int64_t k = 0; k < D; ++k) o[k] = from_f<x_t>(r * (gr[k] * w[k] - (xr[k] * r) * m));
  }
  for (int64_t k = 0; k < D; ++k) gw[k] += gr[k] * (xr[k] * r);
}

// grad's row g rotated back into gz (the conjugate rotation; the dims past rotary_dim as they
// are); returns sum(gz * w * x) (kSumLanes partial sums, so the loop vectorizes).
template <typename acc, bool kI>
ROPE_QK_INLINE acc rotate_back(const acc* __restrict__ g, acc* __restrict__ gz,
                               const acc* __restrict__ c, const acc* __restrict__ s,
                               const acc* __restrict__ w, const acc* __restrict__ x, int64_t half,
                               int64_t D) {
  if constexpr (kI) {  // through two arrays, as rotate_pairs: no fused add-subtract lanes
    for (int64_t b0 = 0; b0 < half; b0 += kQkBlockPairs) {
      const int64_t n = std::min(kQkBlockPairs, half - b0);
      alignas(64) acc lo[kQkBlockPairs];
      alignas(64) acc hi[kQkBlockPairs];
      const acc* gb = g + 2 * b0;
      for (int64_t i = 0; i < n; ++i) {
        lo[i] = gb[2 * i] * c[b0 + i] + gb[2 * i + 1] * s[b0 + i];
        hi[i] = gb[2 * i + 1] * c[b0 + i] - gb[2 * i] * s[b0 + i];
      }
      for (int64_t i = 0; i < n; ++i) {
        gz[2 * (b0 + i)] = lo[i];
        gz[2 * (b0 + i) + 1] = hi[i];
      }
    }
  } else {
    for (int64_t i = 0; i < half; ++i) {
      gz[i] = g[i] * c[i] + g[i + half] * s[i];
      gz[i + half] = g[i + half] * c[i] - g[i] * s[i];
    }
  }
  for (int64_t j = 2 * half; j < D; ++j) gz[j] = g[j];
  acc part[kSumLanes] = {};
  int64_t j = 0;
  for (; j + kSumLanes <= D; j += kSumLanes) {
    for (int l = 0; l < kSumLanes; ++l) part[l] += gz[j + l] * w[j + l] * x[j + l];
  }
  for (int l = 0; j < D; ++j, ++l) part[l] += gz[j] * w[j] * x[j];
  return sum_partials<false>(part);
}

// kD, kHalf: a fixed path's head_dim and rotated pairs (fixed_rows: unit strides, half-split
// pairs), compile-time constants, so every row loop has a constant trip count and unrolls (about
// 0.75x the time of the same rows with run-time sizes at head_dim 128); 0: any rows.
template <typename x_t, bool kI, int64_t kD = 0, int64_t kHalf = 0>
void norm_rope_backward_impl(const NormBackwardJob& job, int64_t b, int64_t e, void* scratch) {
  using acc = opmath_t<x_t>;
  const RotateGeometry& g = *job.g;
  const TableDesc& t = g.table;
  const int64_t half = kD > 0 ? kHalf : g.half, D = kD > 0 ? kD : g.head_dim;
  const acc eps = static_cast<acc>(job.eps);
  acc* const total = static_cast<acc*>(scratch);  // the task's grad_weight
  acc* const comp = total + D;                      // its compensation
  acc* const gw = comp + D;                         // the current block's
  acc* const xr = gw + D;  // this row of x, of grad, and of grad rotated back
  acc* const gr = xr + D;
  acc* const gz = gr + D;
  acc* const w = gz + D;
  acc* const c = w + D;    // the token's cos (half), then sin (half)
  acc* const s = c + half;
  std::fill(total, total + 3 * D, acc(0));
  int64_t block_rows = 0;
  auto add_block = [&] {  // (-ffp-contract=off and no fast-math: the compensation stays)
    for (int64_t k = 0; k < D; ++k) {
      const acc y = gw[k] - comp[k];
      const acc sum = total[k] + y;
      comp[k] = (sum - total[k]) - y;
      total[k] = sum;
      gw[k] = acc(0);
    }
    block_rows = 0;
  };
  load_weights<acc>(job.w_dt, job.w, job.w_stride, D, job.unit_offset ? acc(1) : acc(0), w);
  const int64_t tes = dt_size(job.table_dt);
  const char* const cos_base = static_cast<const char*>(job.cos);
  const char* const sin_base = static_cast<const char*>(job.sin);
  const char* loaded[2] = {nullptr, nullptr};  // the table rows in c and s
  const TargetDesc& tx = g.target[0];
  const TargetDesc& tg = g.target[1];  // grad's strides
  const acc inv_d = acc(1) / static_cast<acc>(D);
  int64_t off[kMaxOperands];
  for (int64_t tok = b; tok < e; ++tok) {
    g.lead.offsets(tok, off);
    const char* cr[kMropeComponents];
    const char* sr[kMropeComponents];
    for (int j = 0; j < kMropeComponents; ++j) {
      cr[j] = cos_base + off[kTab0] * tes;
      sr[j] = sin_base + off[kTab1] * tes;
    }
    if (half > 0 && (cr[0] != loaded[0] || sr[0] != loaded[1])) {
      load_table_block<acc>(job.table_dt, t, cr, sr, 0, half, c, s);
      loaded[0] = cr[0];
      loaded[1] = sr[0];
    }
    const x_t* xs = static_cast<const x_t*>(job.x) + off[kSrc0];
    const x_t* gs = static_cast<const x_t*>(job.grad) + off[kSrc1];
    x_t* out = static_cast<x_t*>(job.grad_x) + off[kDst0];
    for (int64_t h = 0; h < tx.heads; ++h) {
      load_row<x_t, acc>(xs + h * tx.src_head, kD > 0 ? 1 : tx.src_last, D, xr);
      load_row<x_t, acc>(gs + h * tg.src_head, kD > 0 ? 1 : tg.src_last, D, gr);
      const acc r = acc(1) / std::sqrt(sum_squares_buf<acc>(xr, D) * inv_d + eps);
      const acc dot = rotate_back<acc, kI>(gr, gz, c, s, w, xr, half, D);
      backward_row_out<x_t, acc>(out + h * tx.dst_head, gw, gz, xr, w, r, r * dot * inv_d, D);
      if (++block_rows == kGwBlockRows) add_block();
    }
  }
  add_block();
}

template <typename x_t>
void norm_rope_backward_layout(const NormBackwardJob& job, int64_t b, int64_t e, void* scratch) {
  const RotateGeometry& g = *job.g;
  if (g.interleaved) return norm_rope_backward_impl<x_t, true>(job, b, e, scratch);
  // (float64 rows, which tests and references use, take the general rows, as in the forward)
  const FixedRows fixed = !std::is_same_v<x_t, double> && g.target[1].src_last == 1
                              ? fixed_rows(g, g.target[0])
                              : FixedRows::kNone;
  switch (fixed) {
    case FixedRows::k64: return norm_rope_backward_impl<x_t, false, 64, 32>(job, b, e, scratch);
    case FixedRows::k128: return norm_rope_backward_impl<x_t, false, 128, 64>(job, b, e, scratch);
    case FixedRows::k128Rot64:
      return norm_rope_backward_impl<x_t, false, 128, 32>(job, b, e, scratch);
    // (head_dim 256 gains about 10% at 20 KB of library per path and element type: not taken)
    default: return norm_rope_backward_impl<x_t, false>(job, b, e, scratch);
  }
}

}  // namespace
}  // namespace rope
