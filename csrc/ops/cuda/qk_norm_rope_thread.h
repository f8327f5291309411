// Per-thread code of the fused QK-RMSNorm + RoPE CUDA kernels (rope.qk_norm_rope*), plain C++
// over rope_cuda_thread.h's instrumented accesses, so that nvcc builds the kernels from it
// (qk_norm_rope.cu) and g++ builds the simulator that checks every access
// (tests/sim/qk_norm_sim.inc).
//
// One thread per row (one head of one token): a first pass takes the sum of squares of the row,
// a second reads each rotary pair again (now cached), normalizes it, scales it by its weights,
// rotates it and writes it, then normalizes and writes the dims past rotary_dim. With aligned
// unit-stride rows (`vec`) every access of the row is a 16-byte vector. A thread reads its row
// fully before writing any of it, and no other thread touches it: in place is safe.
#pragma once

#include <cmath>

#include "../qk_norm_geometry.h"
#include "rope_cuda_thread.h"

namespace rope::gpu {

template <typename x_t, typename tab_t = opmath_t<x_t>>
struct NormRopeArgs {
  const x_t* src[2];
  x_t* dst[2];
  const opmath_t<x_t>* w[2];  // the weights, in the arithmetic type
  const tab_t* cos;           // strided: the cos tensor; gathered/MRoPE: the table's row 0
  const tab_t* sin;
  const void* pos;
  RotateGeometry g;
  NormDesc norm;
  int64_t rows;  // tokens * (heads of target 0 + heads of target 1)
  bool idx32;
  bool vec;
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

template <typename x_t, typename tab_t, bool kInterleaved>
ROPE_HD void norm_rope_thread(const NormRopeArgs<x_t, tab_t>& a, const ThreadPos& tp) {
  using acc_t = opmath_t<x_t>;
  constexpr int W = kWidth<x_t>;
  const RotateGeometry& g = a.g;
  const TargetDesc& t0 = g.target[0];
  const TargetDesc& t1 = g.target[1];
  const int64_t heads = t0.heads + (g.targets > 1 ? t1.heads : 0);
  const int64_t D = g.head_dim, half = g.half;
  const acc_t unit = a.norm.unit_offset ? acc_t(1) : acc_t(0);
  const int64_t step = static_cast<int64_t>(tp.grid_dim.x) * tp.block_dim.x;
  for (int64_t row = static_cast<int64_t>(tp.block.x) * tp.block_dim.x + tp.thread.x;
       row < a.rows; row += step) {
    const int64_t tok = row / heads;
    const int64_t h = row - tok * heads;
    const Offsets off = lead_offsets(g.lead, tok, a.idx32);
    const TokenRows<tab_t> tr = token_rows(g, a.cos, a.sin, a.pos, off);
    const auto [src, dst, sl, dl] = head_row(a, off, h);
    const bool first = h < t0.heads;
    const acc_t* const w = first ? a.w[0] : a.w[1];
    const int64_t ws = first ? a.norm.w_stride[0] : a.norm.w_stride[1];
    // pass 1: the sum of squares
    acc_t ss = 0;
    if (a.vec) {
      for (int64_t c = 0; c < D; c += W) {
        const Pack<x_t, W> v = load_pack<x_t, W>(src + c);
        ROPE_UNROLL
        for (int l = 0; l < W; ++l) {
          const acc_t e = static_cast<acc_t>(v.v[l]);
          ss += e * e;
        }
      }
    } else {
      for (int64_t j = 0; j < D; ++j) {
        const acc_t e = static_cast<acc_t>(load(src + j * sl));
        ss += e * e;
      }
    }
    const acc_t r = inv_rms(ss, D, a.norm.eps);
    auto normed = [&](x_t v, int64_t j) {
      return (static_cast<acc_t>(v) * r) * (load(w + j * ws) + unit);
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
        }
      }
      for (int64_t c = 2 * half; c < D; c += W) {
        const Pack<x_t, W> v = load_pack<x_t, W>(src + c);
        Pack<x_t, W> o;
        ROPE_UNROLL
        for (int l = 0; l < W; ++l) o.v[l] = static_cast<x_t>(normed(v.v[l], c + l));
        store_pack<x_t, W>(dst + c, o);
      }
    } else {
      for (int64_t p = 0; p < half; ++p) {
        const int64_t ia = kInterleaved ? 2 * p : p, ib = kInterleaved ? 2 * p + 1 : p + half;
        acc_t cs, sn, oa, ob;
        pair_table(g, tr, p, cs, sn);
        rotate_pair(normed(load(src + ia * sl), ia), normed(load(src + ib * sl), ib), cs, sn, oa,
                    ob);
        store(dst + ia * dl, static_cast<x_t>(oa));
        store(dst + ib * dl, static_cast<x_t>(ob));
      }
      for (int64_t j = 2 * half; j < D; ++j) {
        store(dst + j * dl, static_cast<x_t>(normed(load(src + j * sl), j)));
      }
    }
  }
}

}  // namespace rope::gpu
