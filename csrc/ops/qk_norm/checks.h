// Argument checks of the fused QK-RMSNorm + RoPE ops (rope.qk_norm_rope, rope.qk_norm_rope_,
// rope.qkv_norm_rope_), shared by every device: the rotation's part is checks.h's
// (check_apply / check_positions_op), the norm's part is here. rope_ext/_qk_norm/checks.py
// mirrors it message for message, in the same order.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "../checks.h"
#include "geometry.h"

namespace rope {

constexpr const char* kQkNormOp = "rope.qk_norm_rope";
constexpr const char* kQkNormInplaceOp = "rope.qk_norm_rope_";
constexpr const char* kQkvNormOp = "rope.qkv_norm_rope_";
constexpr const char* kQkNormCacheOp = "rope.qk_norm_rope_and_cache_";
constexpr const char* kQkNormCacheOutOp = "rope.qk_norm_rope_and_cache";
constexpr const char* kNormFormsOp = "rope.norm_rope";
constexpr const char* kQkNormBackwardOp = "rope.qk_norm_rope_backward";
// rope.norm_rope's general rows (any form but kRms, or biases) go through the kernels' stack
// buffer: head_dim at most this (rope_ext/_qk_norm/checks.py MAX_GENERAL_HEAD_DIM).
constexpr int64_t kMaxGeneralHeadDim = 1024;

// Spelled as Python's format(eps, "g") (a stream's default), so messages match the Python paths.
inline void check_eps(double eps, const char* op) {
  ROPE_CHECK(std::isfinite(eps) && eps >= 0, op, ": eps must be a finite number >= 0, got ", eps);
  // The norm adds it in float32, where a larger one is inf (every output 0).
  ROPE_CHECK(eps <= std::numeric_limits<float>::max(), op,
             ": eps must be at most 3.40282e+38 (float32's largest), got ", eps);
}

inline void check_norm_weight(const Tensor& t, const char* name, int64_t head_dim, const Meta& ref,
                              const char* ref_name, const char* op) {
  const Meta w(t);
  check_same_device(ref, ref_name, w, op, name);
  check_float(w, op, name);
  ROPE_CHECK(w.dim == 1 && w.sizes[0] == head_dim, op, ": ", name,
             " must have shape (head_dim,) = (", head_dim, ",), got ", shape_str(w));
}

inline void check_norm_weights(const Tensor& q_weight, const Tensor& k_weight, int64_t head_dim,
                               const Meta& ref, const char* ref_name, const char* op) {
  check_norm_weight(q_weight, "q_weight", head_dim, ref, ref_name, op);
  check_norm_weight(k_weight, "k_weight", head_dim, ref, ref_name, op);
}

// The weights are read while the written tensors are written: no byte may be both.
inline void check_weights_disjoint(const Tensor& q_weight, const Tensor& k_weight,
                                   std::initializer_list<std::pair<const char*, const Meta*>> written,
                                   const char* op) {
  const Meta weights[] = {Meta(q_weight), Meta(k_weight)};
  const char* names[] = {"q_weight", "k_weight"};
  for (int i = 0; i < 2; ++i) {
    for (const auto& [tname, t] : written) {
      if (t != nullptr) check_disjoint_bytes(*t, tname, weights[i], names[i], op);
    }
  }
}

// query (..., Hq, D) and key (..., Hk, D): one dtype, number of dims and head_dim.
inline void check_query_key(const Meta& q, const Meta& k, const char* op) {
  ROPE_CHECK(q.dim >= 2, op, ": query must have shape (..., num_heads, head_dim), got ",
             shape_str(q));
  ROPE_CHECK(k.dtype == q.dtype, op, ": key must have the dtype of query (", dtype_str(q.dtype),
             "), got ", dtype_str(k.dtype));
  ROPE_CHECK(k.dim == q.dim && k.size(-1) == q.size(-1), op,
             ": key must have shape (..., num_kv_heads, head_dim) with the number of dims and "
             "head_dim of query ",
             shape_str(q), ", got ", shape_str(k));
}

// rope.qk_norm_rope: query (..., Hq, D) and key (..., Hk, D) of one dtype and number of dims;
// cos/sin broadcast to each as rope.apply takes them. One geometry per tensor (each may
// broadcast the tables differently), both writing fresh contiguous outputs.
inline std::pair<RotateGeometry, RotateGeometry> check_qk_norm_rope(
    const Tensor& query, const Tensor& key, const Tensor& q_weight, const Tensor& k_weight,
    const Tensor& cos, const Tensor& sin, double eps, bool interleaved) {
  const char* op = kQkNormOp;
  RotateGeometry gq = check_apply(query, cos, sin, interleaved, false, op, "query");
  RotateGeometry gk = check_apply(key, cos, sin, interleaved, false, op, "key");
  const Meta q(query), k(key);
  check_query_key(q, k, op);
  check_norm_weights(q_weight, k_weight, q.size(-1), q, "query", op);
  check_eps(eps, op);
  return {gq, gk};
}

// rope.qk_norm_rope_backward: x (..., D) with cos/sin as rope.apply takes them (the conjugate
// rotation), grad of x's shape and dtype read alongside (kSrc1), weight (D,). The geometry
// writes grad_x, contiguous.
inline RotateGeometry check_qk_norm_rope_backward(const Tensor& grad, const Tensor& x,
                                                  const Tensor& weight, const Tensor& cos,
                                                  const Tensor& sin, double eps, bool interleaved) {
  const char* op = kQkNormBackwardOp;
  RotateGeometry g = check_apply(x, cos, sin, interleaved, true, op, "x", false, &grad, "grad");
  const Meta xm(x);
  check_norm_weight(weight, "weight", xm.size(-1), xm, "x", op);
  check_eps(eps, op);
  return g;
}

// rope.norm_rope: rope.qk_norm_rope's query, key and tables (one geometry each), the norm
// form, optional weights and biases of (head_dim,) or, across heads, (num_heads * head_dim,).
struct NormRopeCheck {
  RotateGeometry gq, gk;
  NormForm form;
  bool general;  // rows through the general path (kernels' NormJob::general)
};

inline NormRopeCheck check_norm_rope(const Tensor& query, const Tensor& key,
                                     const std::optional<Tensor>& q_weight,
                                     const std::optional<Tensor>& k_weight,
                                     const std::optional<Tensor>& q_bias,
                                     const std::optional<Tensor>& k_bias, const Tensor& cos,
                                     const Tensor& sin, double eps, const std::string& norm,
                                     bool interleaved) {
  const char* op = kNormFormsOp;
  NormRopeCheck r{};
  if (norm == "rms") {
    r.form = NormForm::kRms;
  } else if (norm == "rms_across_heads") {
    r.form = NormForm::kRmsAcrossHeads;
  } else if (norm == "layer") {
    r.form = NormForm::kLayer;
  } else {
    fail(op, ": norm must be 'rms', 'rms_across_heads' or 'layer', got '", norm, "'");
  }
  const bool across = r.form == NormForm::kRmsAcrossHeads;  // (a token's heads innermost)
  r.gq = check_apply(query, cos, sin, interleaved, false, op, "query", across);
  r.gk = check_apply(key, cos, sin, interleaved, false, op, "key", across);
  const Meta q(query), k(key);
  check_query_key(q, k, op);
  const int64_t head_dim = q.size(-1);
  const std::tuple<const char*, const std::optional<Tensor>*, const Meta*> args[] = {
      {"q_weight", &q_weight, &q}, {"k_weight", &k_weight, &k},
      {"q_bias", &q_bias, &q}, {"k_bias", &k_bias, &k}};
  for (const auto& [name, t, x] : args) {
    if (!t->has_value()) continue;
    const Meta m(**t);
    check_same_device(q, "query", m, op, name);
    check_float(m, op, name);
    int64_t n = head_dim;
    const bool fits = !across || mul_fits(x->size(-2), head_dim, n);  // (an empty tensor's)
    ROPE_CHECK(fits && m.dim == 1 && m.sizes[0] == n, op, ": ", name, " must have shape (",
               across ? "num_heads * head_dim" : "head_dim", ",) = (",
               fits ? std::to_string(n) : std::string("2^63 or more"), ",), got ",
               shape_str(m));
  }
  if (across) {
    const std::pair<const Meta*, const char*> xs[] = {{&q, "query"}, {&k, "key"}};
    const Meta c(cos), s(sin);
    for (const auto& [x, name] : xs) {
      const bool shared = !(c.dim == x->dim && c.size(-2) != 1) && !(s.dim == x->dim && s.size(-2) != 1);
      ROPE_CHECK(shared, op, ": norm='rms_across_heads' normalizes the heads of a token together, "
                 "so cos and sin must be shared by them (size 1 at dim -2 of ", name, " ",
                 shape_str(*x), "), got cos ", shape_str(c), " and sin ", shape_str(s));
    }
  }
  r.general = r.form != NormForm::kRms || q_bias.has_value() || k_bias.has_value();
  ROPE_CHECK(!r.general || head_dim <= kMaxGeneralHeadDim, op, ": head_dim must be <= ",
             kMaxGeneralHeadDim, " for norm='", norm, "' or with biases, got ", head_dim);
  check_eps(eps, op);
  return r;
}

// rope.qk_norm_rope_ (and the packed op on its views): check_positions_op in place on query and
// key with the cos_sin_cache (and MRoPE sections), then the norm's arguments.
inline RotateGeometry check_qk_norm_rope_inplace(const Meta& query, const Meta& key,
                                                 const Tensor& q_weight, const Tensor& k_weight,
                                                 const Tensor& positions, const Tensor& cache,
                                                 double eps, bool interleaved,
                                                 const std::vector<int64_t>* section,
                                                 bool mrope_interleaved, const char* op) {
  const RotateGeometry g = check_positions_op(
      query, &key, positions, TableArgs{&cache, nullptr, nullptr, section, mrope_interleaved},
      interleaved, false, true, op, "query");
  check_norm_weights(q_weight, k_weight, g.head_dim, query, "query", op);
  check_weights_disjoint(q_weight, k_weight, {{"query", &query}, {"key", &key}}, op);
  check_eps(eps, op);
  return g;
}

// rope.qk_norm_rope_and_cache_: the rotation and the paged caches as rope.apply_and_cache_
// (check_rope_and_cache, MRoPE sections allowed; value written with v_norm), then the norm's
// arguments. in_place false: rope.qk_norm_rope_and_cache, which only reads query, key and value
// (the geometry writes fresh contiguous outputs of their shapes).
inline CacheGeometry check_qk_norm_rope_and_cache(
    const Tensor& query, const Tensor& key, const Tensor& value, const Tensor& positions,
    const Tensor& cache, const Tensor& q_weight, const Tensor& k_weight, const Tensor& key_cache,
    const Tensor& value_cache, const Tensor& slots, double eps, bool interleaved,
    const std::vector<int64_t>* section, bool mrope_interleaved, bool v_norm,
    const std::string& kv_cache_dtype, const std::optional<Tensor>& k_scale,
    const std::optional<Tensor>& v_scale, bool in_place = true) {
  const char* op = in_place ? kQkNormCacheOp : kQkNormCacheOutOp;
  const CacheMetas m(query, key, value, key_cache, value_cache, slots);
  CacheGeometry cg = check_rope_and_cache(
      m, positions, TableArgs{&cache, nullptr, nullptr, section, mrope_interleaved}, interleaved,
      kv_cache_dtype, k_scale, v_scale, v_norm && in_place, op, in_place);
  check_norm_weights(q_weight, k_weight, cg.rot.head_dim, m.q, "query", op);
  check_weights_disjoint(q_weight, k_weight,
                         {{"query", in_place ? &m.q : nullptr}, {"key", in_place ? &m.k : nullptr},
                          {"key_cache", &m.kc}, {"value_cache", &m.vc},
                          {"value", v_norm && in_place ? &m.v : nullptr}},
                         op);
  check_eps(eps, op);
  return cg;
}

inline int64_t check_count(int64_t v, const char* op, const char* name) {
  ROPE_CHECK(v >= 0, op, ": ", name, " must be an int >= 0, got ", v);
  return v;
}

// rope.qkv_norm_rope_: qkv (num_tokens, (Hq + Hk + Hv) * head_dim), checked; q and k describe
// its q and k columns as (T, Hq, D) and (T, Hk, D) views that no tensor holds (Meta views: what
// the checks read and where the kernels write), since a tensor each would cost an allocation
// that a decode-sized call notices. Not copyable: the views point at its arrays. No size product
// can overflow: each factor is compared against qkv's width (a real tensor's size) before the
// products are formed.
struct QkvViews {
  int64_t q_sizes[3], k_sizes[3], strides[3];
  Meta qkv;
  std::optional<Meta> q, k;

  QkvViews(const Tensor& qkv_t, int64_t hq, int64_t hk, int64_t hv, int64_t head_dim)
      : qkv(qkv_t) {
    const char* op = kQkvNormOp;
    check_count(hq, op, "num_heads_q");
    check_count(hk, op, "num_heads_k");
    check_count(hv, op, "num_heads_v");
    check_count(head_dim, op, "head_dim");
    ROPE_CHECK(head_dim != 0, op, ": head_dim must be >= 1, got 0");
    const Meta& m = qkv;
    check_float(m, op, "qkv");
    ROPE_CHECK(m.dim == 2, op,
               ": qkv must have shape (num_tokens, (num_heads_q + num_heads_k + num_heads_v) * "
               "head_dim), got ",
               shape_str(m));
    int64_t heads = 0, width = 0;
    const bool fits = add_fits(hq, hk, heads) && add_fits(heads, hv, heads) &&
                      mul_fits(heads, head_dim, width);
    ROPE_CHECK(fits && width == m.sizes[1], op, ": qkv.size(1) = ", m.sizes[1],
               " must be (num_heads_q + num_heads_k + num_heads_v) * head_dim = (", hq, " + ", hk,
               " + ", hv, ") * ", head_dim, " = ",
               fits ? std::to_string(width) : std::string("2^63 or more"));
    ROPE_CHECK(m.sizes[1] <= 1 || m.strides[1] == 1, op,
               ": qkv must have unit stride along its columns (qkv.stride(1) == 1), got strides ",
               list_str(m.strides, m.dim));
    const int64_t tokens = m.sizes[0];
    const int64_t qs[3] = {tokens, hq, head_dim}, ks[3] = {tokens, hk, head_dim};
    const int64_t st[3] = {m.strides[0], head_dim, 1};
    std::copy(qs, qs + 3, q_sizes);
    std::copy(ks, ks + 3, k_sizes);
    std::copy(st, st + 3, strides);
    // (numel: at most qkv's, the rows being a part of each of its rows)
    q.emplace(m, 0, 3, q_sizes, strides, tokens * hq * head_dim);
    k.emplace(m, hq * head_dim, 3, k_sizes, strides, tokens * hk * head_dim);
  }
  QkvViews(const QkvViews&) = delete;
  QkvViews& operator=(const QkvViews&) = delete;
};

}  // namespace rope
