// CPU kernels and host side of the fused QK-RMSNorm + RoPE ops (rope.qk_norm_rope,
// rope.qk_norm_rope_, rope.qkv_norm_rope_; docs/qk_norm.md). Each op is a RotateGeometry
// (geometry.h) plus a NormDesc: per row (one head of one token), the sum of squares is taken in
// a first pass, then each rotary pair is read, normalized, scaled by its weights, rotated and
// written, and the dims past rotary_dim are normalized and written. The first pass brings the row
// into L1, so query and key cross the memory bus once each way; the norm never leaves registers.
// Arithmetic in float (double for float64), rounded once to the output dtype.
#include <algorithm>
#include <cmath>
#include <optional>
#include <tuple>
#include <vector>

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include "../qk_norm_checks.h"
#include "convert.h"
#include "kernel_api.h"

namespace rope {
namespace {

template <typename T>
struct AccOf {
  using type = float;
};
template <>
struct AccOf<double> {
  using type = double;
};

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
template <>
inline BF16Bits from_f<BF16Bits, float>(float v) {
  return BF16Bits{float_to_bf16(v)};
}

// The pointers of one call. Weights are in the arithmetic type (the host casts them).
struct NormJob {
  const RotateGeometry* g;
  NormDesc norm;
  const void* src[2];
  void* dst[2];
  const void* w[2];
  const void* cos;  // strided: the cos tensor; gathered/MRoPE: the cache's row 0
  const void* sin;
  const void* positions;
};

constexpr int64_t kBlockPairs = 256;
constexpr int kLanes = 8;  // partial sums of the sum of squares, so the loop vectorizes

// Sum of squares of a row of n elements (stride `last`).
template <typename x_t, typename acc>
inline acc sum_squares(const x_t* x, int64_t last, int64_t n) {
  acc part[kLanes] = {};
  int64_t j = 0;
  if (last == 1) {
    for (; j + kLanes <= n; j += kLanes) {
      for (int l = 0; l < kLanes; ++l) {
        const acc v = to_f(x[j + l]);
        part[l] += v * v;
      }
    }
  }
  for (; j < n; ++j) {
    const acc v = to_f(x[j * last]);
    part[j % kLanes] += v * v;
  }
  acc s = 0;
  for (int l = 0; l < kLanes; ++l) s += part[l];
  return s;
}

// Normalizes and rotates the pairs [b0, b0 + n) of one row; c/s are the block's tables.
// kUnit: unit strides everywhere (the loop then vectorizes).
template <typename x_t, typename acc, bool kI, bool kUnit>
inline void norm_rotate_block(const x_t* src, int64_t sl, x_t* dst, int64_t dl, const acc* w,
                              int64_t ws, acc unit, acc r, int64_t half, int64_t b0, int64_t n,
                              const acc* c, const acc* s) {
  if (kUnit) sl = dl = ws = 1;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t p = b0 + i;
    const int64_t ia = kI ? 2 * p : p, ib = kI ? 2 * p + 1 : p + half;
    const acc a = (static_cast<acc>(to_f(src[ia * sl])) * r) * (w[ia * ws] + unit);
    const acc b = (static_cast<acc>(to_f(src[ib * sl])) * r) * (w[ib * ws] + unit);
    const acc oa = a * c[i] - b * s[i];
    const acc ob = b * c[i] + a * s[i];
    dst[ia * dl] = from_f<x_t>(oa);
    dst[ib * dl] = from_f<x_t>(ob);
  }
}

template <typename x_t, typename acc>
inline void norm_tail(const x_t* src, int64_t sl, x_t* dst, int64_t dl, const acc* w, int64_t ws,
                      acc unit, acc r, int64_t from, int64_t to) {
  for (int64_t j = from; j < to; ++j) {
    dst[j * dl] = from_f<x_t>((static_cast<acc>(to_f(src[j * sl])) * r) * (w[j * ws] + unit));
  }
}

template <typename tab_t>
inline const tab_t* row_at(const void* base, int64_t elems) {
  return static_cast<const tab_t*>(base) + elems;
}

inline int64_t read_pos(const void* pos, bool pos64, int64_t off) {
  return pos64 ? static_cast<const int64_t*>(pos)[off]
               : static_cast<int64_t>(static_cast<const int32_t*>(pos)[off]);
}

template <typename x_t, typename tab_t, bool kI>
void norm_rope_tokens(const NormJob& job, int64_t b, int64_t e) {
  using acc = typename AccOf<x_t>::type;
  const RotateGeometry& g = *job.g;
  const TableDesc& t = g.table;
  const int64_t half = g.half, D = g.head_dim;
  const acc eps = static_cast<acc>(job.norm.eps);
  const acc unit = job.norm.unit_offset ? acc(1) : acc(0);
  alignas(64) acc c[kBlockPairs];
  alignas(64) acc s[kBlockPairs];
  const tab_t* key[2 * kMropeComponents] = {};
  int64_t key_b0 = -1;
  for (int64_t tok = b; tok < e; ++tok) {
    int64_t off[kMaxOperands];
    g.lead.offsets(tok, off);
    const tab_t* cr[kMropeComponents];
    const tab_t* sr[kMropeComponents];
    if (t.kind == TableKind::kStrided) {
      cr[0] = cr[1] = cr[2] = row_at<tab_t>(job.cos, off[kTab0]);
      sr[0] = sr[1] = sr[2] = row_at<tab_t>(job.sin, off[kTab1]);
    } else {
      const bool mrope = t.kind == TableKind::kMrope;
      for (int j = 0; j < kMropeComponents; ++j) {
        const int64_t p =
            (j == 0 || mrope) ? read_pos(job.positions, t.pos64, off[kTab0] + j * t.pos_component)
                              : read_pos(job.positions, t.pos64, off[kTab0]);
        cr[j] = row_at<tab_t>(job.cos, p * t.cos_row);
        sr[j] = row_at<tab_t>(job.sin, p * t.sin_row);
      }
    }
    auto tables = [&](int64_t b0, int64_t n) {
      bool same = key_b0 == b0;
      for (int j = 0; j < kMropeComponents; ++j) {
        same = same && key[2 * j] == cr[j] && key[2 * j + 1] == sr[j];
        key[2 * j] = cr[j];
        key[2 * j + 1] = sr[j];
      }
      if (same) return;
      key_b0 = b0;
      const bool mrope = t.kind == TableKind::kMrope;
      for (int64_t i = 0; i < n; ++i) {
        const int64_t pair = b0 + i;
        const int j = mrope ? mrope_component(pair, t.section, t.mrope_interleaved) : 0;
        c[i] = static_cast<acc>(to_f(cr[j][pair * t.cos_col]));
        s[i] = static_cast<acc>(to_f(sr[j][pair * t.sin_col]));
      }
    };
    for (int k = 0; k < g.targets; ++k) {
      const TargetDesc& tg = g.target[k];
      const x_t* src = static_cast<const x_t*>(job.src[k]) + off[2 * k];
      x_t* dst = static_cast<x_t*>(job.dst[k]) + off[2 * k + 1];
      const acc* w = static_cast<const acc*>(job.w[k]);
      const int64_t ws = job.norm.w_stride[k];
      const bool unit_strides = tg.src_last == 1 && tg.dst_last == 1 && ws == 1;
      for (int64_t h = 0; h < tg.heads; ++h, src += tg.src_head, dst += tg.dst_head) {
        const acc ss = sum_squares<x_t, acc>(src, tg.src_last, D);
        const acc r = acc(1) / std::sqrt(ss / static_cast<acc>(D) + eps);
        for (int64_t b0 = 0; b0 < half; b0 += kBlockPairs) {
          const int64_t n = std::min(kBlockPairs, half - b0);
          tables(b0, n);
          if (unit_strides) {
            norm_rotate_block<x_t, acc, kI, true>(src, 1, dst, 1, w, 1, unit, r, half, b0, n, c, s);
          } else {
            norm_rotate_block<x_t, acc, kI, false>(src, tg.src_last, dst, tg.dst_last, w, ws,
                                                   unit, r, half, b0, n, c, s);
          }
        }
        norm_tail<x_t, acc>(src, tg.src_last, dst, tg.dst_last, w, ws, unit, r, 2 * half, D);
      }
    }
  }
}

template <typename x_t, typename tab_t>
void norm_rope_dispatch_layout(const NormJob& job, int64_t b, int64_t e) {
  job.g->interleaved ? norm_rope_tokens<x_t, tab_t, true>(job, b, e)
                     : norm_rope_tokens<x_t, tab_t, false>(job, b, e);
}

template <typename x_t>
void norm_rope_dispatch_table(ScalarType tab, const NormJob& job, int64_t b, int64_t e) {
  switch (tab) {
    case ScalarType::Float:
      return norm_rope_dispatch_layout<x_t, float>(job, b, e);
    case ScalarType::Double:
      return norm_rope_dispatch_layout<x_t, double>(job, b, e);
    case ScalarType::Half:
      return norm_rope_dispatch_layout<x_t, HalfBits>(job, b, e);
    default:
      return norm_rope_dispatch_layout<x_t, BF16Bits>(job, b, e);
  }
}

void norm_rope_range(ScalarType x, ScalarType tab, const NormJob& job, int64_t b, int64_t e) {
  switch (x) {
    case ScalarType::Float:
      return norm_rope_dispatch_table<float>(tab, job, b, e);
    case ScalarType::Double:
      return norm_rope_dispatch_table<double>(tab, job, b, e);
    case ScalarType::Half:
      return norm_rope_dispatch_table<HalfBits>(tab, job, b, e);
    default:
      return norm_rope_dispatch_table<BF16Bits>(tab, job, b, e);
  }
}

// Work per task: at least this many elements, so decode-sized calls run on the calling thread.
constexpr int64_t kGrainElements = 1 << 15;

void run_norm_rope(const NormJob& job, ScalarType x, ScalarType tab) {
  const RotateGeometry& g = *job.g;
  if (g.tokens == 0 || g.head_dim == 0) return;
  int64_t per_token = 0;
  for (int k = 0; k < g.targets; ++k) {
    int64_t rows;
    if (!mul_fits(g.target[k].heads, g.head_dim, rows) || !add_fits(per_token, rows, per_token)) {
      per_token = kInt64Max;
      break;
    }
  }
  if (per_token == 0) return;
  const int64_t grain = std::max<int64_t>(1, kGrainElements / per_token);
  auto fn = [&](int64_t b, int64_t e) { norm_rope_range(x, tab, job, b, e); };
  if (g.tokens <= grain || torch::stable::get_num_threads() <= 1) {
    fn(0, g.tokens);
  } else {
    torch::stable::parallel_for(0, g.tokens, grain, fn);
  }
}

ScalarType acc_type(ScalarType x) {
  return x == ScalarType::Double ? ScalarType::Double : ScalarType::Float;
}

// A weight in the arithmetic type (a cast only when it has another dtype).
Tensor norm_weight(const Tensor& w, ScalarType x) {
  const ScalarType acc = acc_type(x);
  if (w.scalar_type() == acc) return w;
  return torch::stable::to(w, std::optional<ScalarType>(acc));
}

NormJob make_job(const RotateGeometry& g, double eps, bool unit_offset, const Tensor& wq,
                 const Tensor& wk) {
  NormJob job{};
  job.g = &g;
  job.norm.eps = eps;
  job.norm.unit_offset = unit_offset;
  job.w[0] = wq.const_data_ptr();
  job.w[1] = wk.const_data_ptr();
  job.norm.w_stride[0] = wq.stride(0);
  job.norm.w_stride[1] = wk.stride(0);
  return job;
}

std::tuple<Tensor, Tensor> qk_norm_rope_cpu(Tensor query, Tensor key, Tensor q_weight,
                                            Tensor k_weight, Tensor cos, Tensor sin, double eps,
                                            bool unit_offset, bool interleaved) {
  const auto [gq, gk] =
      check_qk_norm_rope(query, key, q_weight, k_weight, cos, sin, eps, interleaved);
  const ScalarType xt = query.scalar_type();
  const Tensor wq = norm_weight(q_weight, xt), wk = norm_weight(k_weight, xt);
  Tensor oq = torch::stable::new_empty(query, query.sizes());
  Tensor ok = torch::stable::new_empty(key, key.sizes());
  const std::pair<const RotateGeometry*, std::pair<const Tensor*, const Tensor*>> parts[] = {
      {&gq, {&query, &oq}}, {&gk, {&key, &ok}}};
  for (int i = 0; i < 2; ++i) {
    const RotateGeometry& g = *parts[i].first;
    const Tensor& w = i == 0 ? wq : wk;
    NormJob job = make_job(g, eps, unit_offset, w, w);
    job.src[0] = parts[i].second.first->const_data_ptr();
    job.dst[0] = parts[i].second.second->mutable_data_ptr();
    job.cos = cos.const_data_ptr();
    job.sin = sin.const_data_ptr();
    run_norm_rope(job, xt, cos.scalar_type());
  }
  return {oq, ok};
}

// The in-place ops: positions copied if they share memory with what is written (re-checked:
// the copy's strides), range-checked, then one pass.
void norm_rope_inplace(const Tensor& query, const Tensor& key, const Tensor* written0,
                       const Tensor* written1,
                       const Tensor& q_weight, const Tensor& k_weight, Tensor positions,
                       const Tensor& cache, double eps, bool unit_offset, bool interleaved,
                       const std::optional<std::vector<int64_t>>& section, bool mrope_interleaved,
                       const char* op) {
  const std::vector<int64_t>* sec = section ? &*section : nullptr;
  auto check = [&] {
    return check_qk_norm_rope_inplace(query, key, q_weight, k_weight, positions, cache, eps,
                                      interleaved, sec, mrope_interleaved, op);
  };
  RotateGeometry g = check();
  const Tensor once = positions_read_once(positions, {written0, written1});
  if (once.get() != positions.get()) {
    positions = once;
    g = check();
  }
  check_positions_in_range(positions, g.table.rows, op, "cos_sin_cache.size(0)");
  const ScalarType xt = query.scalar_type();
  const Tensor wq = norm_weight(q_weight, xt), wk = norm_weight(k_weight, xt);
  NormJob job = make_job(g, eps, unit_offset, wq, wk);
  job.src[0] = job.dst[0] = query.mutable_data_ptr();
  job.src[1] = job.dst[1] = key.mutable_data_ptr();
  job.cos = cache.const_data_ptr();
  job.sin = sin_of_cache(cache, g);
  job.positions = positions.const_data_ptr();
  run_norm_rope(job, xt, cache.scalar_type());
}

void qk_norm_rope_inplace_cpu(Tensor query, Tensor key, Tensor q_weight, Tensor k_weight,
                              Tensor positions, Tensor cos_sin_cache, double eps, bool unit_offset,
                              bool interleaved, std::optional<std::vector<int64_t>> mrope_section,
                              bool mrope_interleaved) {
  norm_rope_inplace(query, key, &query, &key, q_weight, k_weight, positions, cos_sin_cache, eps,
                    unit_offset,
                    interleaved, mrope_section, mrope_interleaved, kQkNormInplaceOp);
}

void qkv_norm_rope_inplace_cpu(Tensor qkv, int64_t num_heads_q, int64_t num_heads_k,
                               int64_t num_heads_v, int64_t head_dim, Tensor q_weight,
                               Tensor k_weight, Tensor positions, Tensor cos_sin_cache, double eps,
                               bool unit_offset, bool interleaved,
                               std::optional<std::vector<int64_t>> mrope_section,
                               bool mrope_interleaved) {
  const auto [q, k] = qkv_views(qkv, num_heads_q, num_heads_k, num_heads_v, head_dim);
  norm_rope_inplace(q, k, &qkv, nullptr, q_weight, k_weight, positions, cos_sin_cache, eps, unit_offset,
                    interleaved, mrope_section, mrope_interleaved, kQkvNormOp);
}

}  // namespace
}  // namespace rope

STABLE_TORCH_LIBRARY_IMPL(rope, CPU, m) {
  m.impl("qk_norm_rope", TORCH_BOX(&rope::qk_norm_rope_cpu));
  m.impl("qk_norm_rope_", TORCH_BOX(&rope::qk_norm_rope_inplace_cpu));
  m.impl("qkv_norm_rope_", TORCH_BOX(&rope::qkv_norm_rope_inplace_cpu));
}
