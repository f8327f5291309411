// Per-thread code of the fused QK-RMSNorm + RoPE CUDA kernels (rope.qk_norm_rope*), plain C++
// over rope_cuda_thread.h's instrumented accesses, so that nvcc builds the kernels from it
// (qk_norm/cuda/qk_norm_cuda.cu) and g++ builds the simulator that checks every access
// (tests/sim/qk_norm_sim.inc).
//
// One thread per row (one head of one token): a first pass takes the sum of squares of the row
// (LayerNorm: its mean first, then the squares about it), a second reads each rotary pair again
// (now cached), normalizes it, scales it by its weights (and adds its biases), rotates it and
// writes it, then normalizes and writes the dims past rotary_dim. RMSNorm across heads
// (rope.norm_rope): a thread per token's heads of one target, the sum of squares over all of
// them, then the second pass on each. With aligned
// unit-stride rows (`vec`) every access of the row is a 16-byte vector. A thread reads its row
// fully before writing any of it, and no other thread touches it: in place is safe.
//
// With the paged-cache store stage (NormStore, rope.qk_norm_rope_and_cache*) a key row's thread
// also stores each element it writes into the key cache at its token's slot, and the value rows
// (the rows after the key heads) get a thread each: written to value_out where it is given
// (normed without weight with v_norm, else copied; in place: value_out is value), then stored
// into the value cache. Padding slots (negative) store nothing.
#pragma once

#include <cmath>

#include "../geometry.h"
#include "../../cuda/rope_cuda_thread.h"

namespace rope::gpu {

// The store stage of a call that ends in the paged caches (`on`; otherwise none).
struct NormStore {
  CacheDesc cg;
  const void* value;     // (T, Hk, Dv) rows of x_t, read (the cg.v_* strides)
  void* value_out;       // where value rows are written (cg.vo_* strides), or nullptr
  const void* slots;
  void* key_cache;
  void* value_cache;
  const float* k_scale;  // nullptr unless fp8
  const float* v_scale;
  bool v_norm;
  bool on;  // the store stage runs (its value heads have rows): a cache of 0 elements has no
            // data pointer, so the pointers cannot tell
  // value rows (and value_out's) 16-byte aligned with unit stride, value_dim % W == 0; the
  // caches take whole chunks (CacheStore::vec)
  bool v_vec, kc_vec, vc_vec;
};

template <typename x_t, typename tab_t = opmath_t<x_t>>
struct NormRopeArgs {
  const x_t* src[2];
  x_t* dst[2];
  const opmath_t<x_t>* w[2];  // the weights, in the arithmetic type (nullptr: none)
  const opmath_t<x_t>* b[2];  // rope.norm_rope's biases, contiguous (nullptr: none)
  const tab_t* cos;           // strided: the cos tensor; gathered/MRoPE: the table's row 0
  const tab_t* sin;
  const void* pos;
  RotateGeometry g;
  NormDesc norm;
  // tokens * (units of target 0 + units of target 1 [+ value heads]); a unit is a head, or
  // across heads (NormForm::kRmsAcrossHeads) the norm.group_heads heads of one norm
  int64_t rows;
  bool idx32;
  bool vec;
  NormStore store;
};

template <typename acc_t>
ROPE_HD acc_t inv_rms(acc_t sum_squares, int64_t n, double eps) {
  return acc_t(1) / std::sqrt(sum_squares / static_cast<acc_t>(n) + static_cast<acc_t>(eps));
}

// cos and sin of pair p of the token's rows.
template <typename acc_t, typename tab_t>
ROPE_HD void pair_table(const RotateGeometry& g, const TokenRows<tab_t>& r, int64_t p, acc_t& c,
                        acc_t& s) {
  const TableDesc& d = g.table;
  const int k = d.kind == TableKind::kMrope ? mrope_component(p, d.section, d.mrope_interleaved) : 0;
  c = static_cast<acc_t>(load(pick3(k, r.cos0, r.cos1, r.cos2) + p * d.cos_col));
  s = static_cast<acc_t>(load(pick3(k, r.sin0, r.sin1, r.sin2) + p * d.sin_col));
}

// The slot of token tok (store stage), device-checked; -1: store nothing.
ROPE_HD int64_t store_slot(const NormStore& s, int64_t tok) {
  const int64_t slot = load_position(s.slots, s.cg.slots64, tok * s.cg.slot_stride);
  ROPE_DEVICE_CHECK(slot < s.cg.slots, "rope: slot_mapping must lie below num_blocks * block_size");
  return slot < s.cg.slots ? slot : -1;
}

// The first pass over a row (src, element stride sl; vec: aligned unit-stride vectors): the sum
// of its elements minus `mean`, squared (kSquares) or not. (The row by value, not the token's
// Offsets by reference: an address taken would put them in local memory.)
template <bool kSquares, typename x_t>
ROPE_HD opmath_t<x_t> row_sum(const x_t* src, int64_t sl, int64_t n, bool vec,
                              opmath_t<x_t> mean) {
  using acc_t = opmath_t<x_t>;
  constexpr int W = kWidth<x_t>;
  acc_t sum = 0;
  if (vec) {
    for (int64_t c = 0; c < n; c += W) {
      const Pack<x_t, W> v = load_pack<x_t, W>(src + c);
      ROPE_UNROLL
      for (int l = 0; l < W; ++l) {
        const acc_t e = static_cast<acc_t>(v.v[l]) - mean;
        sum += kSquares ? e * e : e;
      }
    }
  } else {
    for (int64_t j = 0; j < n; ++j) {
      const acc_t e = static_cast<acc_t>(load(src + j * sl)) - mean;
      sum += kSquares ? e * e : e;
    }
  }
  return sum;
}

// Value head hi of token tok: written to value_out (normed without weight with v_norm, else
// copied) where it is given, then stored to the value cache at the token's slot. Each element
// is read before its own write: in place is safe.
template <typename x_t>
ROPE_HD void value_row(const NormStore& s, double eps, int64_t tok, int64_t hi) {
  using acc_t = opmath_t<x_t>;
  const CacheDesc& cg = s.cg;
  const int64_t slot = store_slot(s, tok);
  if (slot < 0 && s.value_out == nullptr) return;
  const x_t* v = static_cast<const x_t*>(s.value) + tok * cg.v_token + hi * cg.v_head;
  x_t* out = s.value_out == nullptr
                 ? nullptr
                 : static_cast<x_t*>(s.value_out) + tok * cg.vo_token + hi * cg.vo_head;
  const acc_t r = s.v_norm ? inv_rms(row_sum<true>(v, cg.v_last, cg.value_dim, s.v_vec, acc_t(0)),
                                     cg.value_dim, eps)
                          : acc_t(1);
  const bool fp8 = cg.format != CacheFormat::kSame;
  const int64_t es = fp8 ? 1 : sizeof(x_t);
  const CacheStore<x_t> to_cache{
      static_cast<char*>(s.value_cache) + (cg.vc.slot_row(slot < 0 ? 0 : slot, cg.block_size) +
                                           hi * cg.vc.head) * es,
      cg.vc.last, fp8 ? load(s.v_scale) : 1.0f, cg.format, s.vc_vec};
  if (s.v_vec) {
    constexpr int W = kWidth<x_t>;
    for (int64_t c = 0; c < cg.value_dim; c += W) {
      Pack<x_t, W> e = load_pack<x_t, W>(v + c);
      if (s.v_norm) {
        ROPE_UNROLL
        for (int l = 0; l < W; ++l) e.v[l] = static_cast<x_t>(static_cast<acc_t>(e.v[l]) * r);
      }
      if (out != nullptr) store_pack<x_t, W>(out + c, e);
      if (slot >= 0) to_cache.chunk(c, e);
    }
    return;
  }
  for (int64_t j = 0; j < cg.value_dim; ++j) {
    x_t e = load(v + j * cg.v_last);
    if (s.v_norm) e = static_cast<x_t>(static_cast<acc_t>(e) * r);
    if (out != nullptr) store(out + j * cg.vo_last, e);
    if (slot >= 0) to_cache(j, e);
  }
}

template <typename x_t, typename tab_t, bool kInterleaved>
ROPE_HD void norm_rope_thread(const NormRopeArgs<x_t, tab_t>& a, const ThreadPos& tp) {
  using acc_t = opmath_t<x_t>;
  constexpr int W = kWidth<x_t>;
  const RotateGeometry& g = a.g;
  const TargetDesc& t0 = g.target[0];
  const TargetDesc& t1 = g.target[1];
  const NormStore& st = a.store;
  const bool storing = st.on;
  const bool across = a.norm.form == NormForm::kRmsAcrossHeads;
  const bool layer = a.norm.form == NormForm::kLayer;
  // the heads of one unit (one thread) of each target
  const int64_t group0 = across ? a.norm.group_heads[0] : 1;
  const int64_t group1 = across ? a.norm.group_heads[1] : 1;
  const int64_t units0 = t0.heads / group0;
  const int64_t qk_units = units0 + (g.targets > 1 ? t1.heads / group1 : 0);
  const int64_t units = qk_units + (storing ? st.cg.kv_heads : 0);
  const int64_t D = g.head_dim, half = g.half;
  const acc_t unit = a.norm.unit_offset ? acc_t(1) : acc_t(0);
  const int64_t step = static_cast<int64_t>(tp.grid_dim.x) * tp.block_dim.x;
  for (int64_t row = static_cast<int64_t>(tp.block.x) * tp.block_dim.x + tp.thread.x;
       row < a.rows; row += step) {
    const int64_t tok = row / units;
    const int64_t u = row - tok * units;
    if (u >= qk_units) {
      value_row<x_t>(st, a.norm.eps, tok, u - qk_units);
      continue;
    }
    const bool first = u < units0;
    const int64_t group = first ? group0 : group1;
    const int64_t h0 = first ? u * group0 : t0.heads + (u - units0) * group1;
    const Offsets off = lead_offsets(g.lead, tok, a.idx32);
    const TokenRows<tab_t> tr = token_rows(g, a.cos, a.sin, a.pos, off);
    const acc_t* const w = first ? a.w[0] : a.w[1];
    const acc_t* const bias = first ? a.b[0] : a.b[1];
    const int64_t ws = first ? a.norm.w_stride[0] : a.norm.w_stride[1];
    acc_t group_r = 0;
    if (across) {
      acc_t ss = 0;
      for (int64_t h = h0; h < h0 + group; ++h) {
        const HeadRow<x_t> hr = head_row(a, off, h);
        ss += row_sum<true>(hr.src, hr.src_last, D, a.vec, acc_t(0));
      }
      group_r = inv_rms(ss, group * D, a.norm.eps);
    }
    for (int64_t h = h0; h < h0 + group; ++h) {
      // A key row of a call with the store stage: each written element also goes to the cache.
      const bool to_cache = storing && h >= t0.heads;
      const int64_t slot = to_cache ? store_slot(st, tok) : -1;
      const bool fp8 = st.cg.format != CacheFormat::kSame;
      const int64_t es = fp8 ? 1 : sizeof(x_t);
      const CacheStore<x_t> key_cache{
          slot < 0 ? nullptr
                   : static_cast<char*>(st.key_cache) +
                         (st.cg.kc.slot_row(slot, st.cg.block_size) +
                          (h - t0.heads) * st.cg.kc.head) *
                             es,
          st.cg.kc.last, slot >= 0 && fp8 ? load(st.k_scale) : 1.0f, st.cg.format, st.kc_vec};
      auto cached = [&](int64_t j, x_t v) {
        if (key_cache.row != nullptr) key_cache(j, v);
      };
      auto cached_chunk = [&](int64_t j0, const Pack<x_t, W>& v) {
        if (key_cache.row != nullptr) key_cache.chunk(j0, v);
      };
      const auto [src, dst, sl, dl] = head_row(a, off, h);
      // pass 1: the row's statistics (across heads: the unit's, above)
      const acc_t mean =
          layer ? row_sum<false>(src, sl, D, a.vec, acc_t(0)) / static_cast<acc_t>(D) : acc_t(0);
      const acc_t r = across ? group_r : inv_rms(row_sum<true>(src, sl, D, a.vec, mean), D,
                                                 a.norm.eps);
      // this head's weights and biases (across heads: its slice of the token's)
      const acc_t* const wr = w == nullptr ? nullptr : w + (h - h0) * D * ws;
      const acc_t* const br = bias == nullptr ? nullptr : bias + (h - h0) * D;
      auto normed = [&](x_t v, int64_t j) {
        const acc_t n = (static_cast<acc_t>(v) - mean) * r;
        const acc_t z = wr == nullptr ? n : n * (load(wr + j * ws) + unit);
        return br == nullptr ? z : z + load(br + j);
      };
      // pass 2: the rotary pairs, then the rest
      if (a.vec) {
        if (kInterleaved) {
          for (int64_t c = 0; c < 2 * half; c += W) {
            const Pack<x_t, W> v = load_pack<x_t, W>(src + c);
            Pack<x_t, W> o;
            ROPE_UNROLL
            for (int l = 0; l < W; l += 2) {
              acc_t cs, sn, oa, ob;
              pair_table(g, tr, (c + l) / 2, cs, sn);
              rotate_pair(normed(v.v[l], c + l), normed(v.v[l + 1], c + l + 1), cs, sn, oa, ob);
              o.v[l] = static_cast<x_t>(oa);
              o.v[l + 1] = static_cast<x_t>(ob);
            }
            store_pack<x_t, W>(dst + c, o);
            cached_chunk(c, o);
          }
        } else {
          for (int64_t c = 0; c < half; c += W) {
            const Pack<x_t, W> va = load_pack<x_t, W>(src + c);
            const Pack<x_t, W> vb = load_pack<x_t, W>(src + half + c);
            Pack<x_t, W> oa, ob;
            ROPE_UNROLL
            for (int l = 0; l < W; ++l) {
              acc_t cs, sn, ra, rb;
              pair_table(g, tr, c + l, cs, sn);
              rotate_pair(normed(va.v[l], c + l), normed(vb.v[l], half + c + l), cs, sn, ra, rb);
              oa.v[l] = static_cast<x_t>(ra);
              ob.v[l] = static_cast<x_t>(rb);
            }
            store_pack<x_t, W>(dst + c, oa);
            store_pack<x_t, W>(dst + half + c, ob);
            cached_chunk(c, oa);
            cached_chunk(half + c, ob);
          }
        }
        for (int64_t c = 2 * half; c < D; c += W) {
          const Pack<x_t, W> v = load_pack<x_t, W>(src + c);
          Pack<x_t, W> o;
          ROPE_UNROLL
          for (int l = 0; l < W; ++l) o.v[l] = static_cast<x_t>(normed(v.v[l], c + l));
          store_pack<x_t, W>(dst + c, o);
          cached_chunk(c, o);
        }
      } else {
        for (int64_t p = 0; p < half; ++p) {
          const int64_t ia = kInterleaved ? 2 * p : p, ib = kInterleaved ? 2 * p + 1 : p + half;
          acc_t cs, sn, oa, ob;
          pair_table(g, tr, p, cs, sn);
          rotate_pair(normed(load(src + ia * sl), ia), normed(load(src + ib * sl), ib), cs, sn, oa,
                      ob);
          const x_t xa = static_cast<x_t>(oa), xb = static_cast<x_t>(ob);
          store(dst + ia * dl, xa);
          store(dst + ib * dl, xb);
          cached(ia, xa);
          cached(ib, xb);
        }
        for (int64_t j = 2 * half; j < D; ++j) {
          const x_t e = static_cast<x_t>(normed(load(src + j * sl), j));
          store(dst + j * dl, e);
          cached(j, e);
        }
      }
    }
  }
}

}  // namespace rope::gpu
