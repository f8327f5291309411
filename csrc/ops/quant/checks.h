// RoPE + FP8 quantization (rope.quantize_fp8 and rope.quantize_fp8_append_paged_kv_cache): the
// argument checks that produce the plain-data description of a call (QuantGeometry, in
// quant/geometry.h). Same conditions, order and messages as rope_ext/_quant/checks.py. Data
// checks (positions, page tables) run where the data is: the CPU host before anything is
// written, the CUDA kernel as device-side checks.
#pragma once

#include <string>
#include <utility>

#include "../checks.h"
#include "geometry.h"

namespace rope {

namespace quant_detail {

inline bool is_x_dtype(ScalarType t) {
  return t == ScalarType::Half || t == ScalarType::BFloat16 || t == ScalarType::Float;
}

inline bool is_index(ScalarType t) { return t == ScalarType::Int || t == ScalarType::Long; }

inline QuantRows rows_of(const Meta& m) {
  if (m.dim == 2) return QuantRows{m.strides[0], 0, m.strides[1]};
  return QuantRows{m.strides[0], m.strides[1], m.strides[2]};
}

inline QuantIndex index_of(const Meta& m) { return QuantIndex{m.strides[0], m.dtype == ScalarType::Long}; }

inline void check_index(const Meta& q, const Meta& m, const char* op, const char* name) {
  check_same_device(q, "q_rope", m, op, name);
  ROPE_CHECK(is_index(m.dtype), op, ": ", name, " must be int32 or int64, got ", dtype_str(m.dtype));
}

inline void check_1d(const Meta& m, int64_t n, const char* op, const char* name,
                     const std::string& what) {
  ROPE_CHECK(m.dim == 1 && (n < 0 || m.sizes[0] == n), op, ": ", name, " must have shape ", what,
             ", got ", shape_str(m));
}

inline std::string nnz_shape(int64_t n) { return "(nnz,) = (" + std::to_string(n) + ",)"; }

// A Meta viewed as (tokens, heads, dim): a 2-D tensor gets a heads dim of 1.
struct Rows3 {
  Meta m;
  int64_t sizes[3], strides[3];
  explicit Rows3(const Meta& src) : m(src) {
    if (src.dim == 2) {
      sizes[0] = src.sizes[0], sizes[1] = 1, sizes[2] = src.sizes[1];
      strides[0] = src.strides[0], strides[1] = src.strides[1] * src.sizes[1], strides[2] = src.strides[1];
      m.dim = 3;
      m.sizes = sizes;
      m.strides = strides;
    }
  }
};

// Outputs may be column slices of one buffer (q_out[..., :rope_dim], q_out[..., rope_dim:]).
inline void check_outputs_disjoint(const std::pair<const char*, const Meta*>* outs, int n,
                                   const char* op) {
  for (int i = 0; i < n; ++i) {
    for (int j = i + 1; j < n; ++j) {
      const Meta& a = *outs[i].second;
      const Meta& b = *outs[j].second;
      if (a.numel == 0 || b.numel == 0) continue;
      const Rows3 a3(a), b3(b);
      ROPE_CHECK(rows_disjoint(a3.m, b3.m, 1), op, ": ", outs[i].first, " and ", outs[j].first,
                 ": ", kPartialOverlap);
    }
  }
}

// The inputs both ops share: q_rope, k_rope, q_nope, k_nope, cos_sin_cache, pos_ids.
inline void check_inputs(const Meta& qr, const Meta& kr, const Meta& qn, const Meta& kn,
                         const Meta& tab, const Meta& pos, bool interleaved, const char* op,
                         QuantGeometry& g) {
  ROPE_CHECK(qr.dim == 3, op, ": q_rope must have shape (nnz, num_qo_heads, rope_dim), got ",
             shape_str(qr));
  ROPE_CHECK(is_x_dtype(qr.dtype), op, ": q_rope must be float16, bfloat16 or float32, got ",
             dtype_str(qr.dtype));
  const int64_t nnz = qr.sizes[0], q_heads = qr.sizes[1], rope_dim = qr.sizes[2];
  ROPE_CHECK((kr.dim == 2 || kr.dim == 3) && kr.sizes[0] == nnz && kr.size(-1) == rope_dim, op,
             ": k_rope must have shape (nnz, num_kv_heads, rope_dim) or, for MLA, (nnz, rope_dim) "
             "with nnz = ", nnz, " and rope_dim = ", rope_dim, ", got ", shape_str(kr));
  ROPE_CHECK(rope_dim % 2 == 0, op, ": rope_dim = q_rope.size(-1) must be even, got ", rope_dim);
  const bool mla = kr.dim == 2;
  const int64_t kv_heads = mla ? 1 : kr.sizes[1];
  ROPE_CHECK(qn.dim == 3 && qn.sizes[0] == nnz && qn.sizes[1] == q_heads, op,
             ": q_nope must have shape (nnz, num_qo_heads, no_rope_dim) = (", nnz, ", ", q_heads,
             ", no_rope_dim), got ", shape_str(qn));
  const int64_t nope = qn.sizes[2];
  const bool k_ok = mla ? (kn.dim == 2 && kn.sizes[0] == nnz && kn.sizes[1] == nope)
                        : (kn.dim == 3 && kn.sizes[0] == nnz && kn.sizes[1] == kv_heads &&
                           kn.sizes[2] == nope);
  if (!k_ok) {
    const std::string want = mla ? "[" + std::to_string(nnz) + ", " + std::to_string(nope) + "]"
                                 : "[" + std::to_string(nnz) + ", " + std::to_string(kv_heads) +
                                       ", " + std::to_string(nope) + "]";
    fail(op, ": k_nope must have shape ", want,
         " (k_rope's leading dims, q_nope's no_rope_dim), got ", shape_str(kn));
  }
  const std::pair<const char*, const Meta*> same[] = {{"k_rope", &kr}, {"q_nope", &qn}, {"k_nope", &kn}};
  for (const auto& [name, m] : same) {
    check_same_device(qr, "q_rope", *m, op, name);
    ROPE_CHECK(m->dtype == qr.dtype, op, ": ", name, " must have the dtype of q_rope (",
               dtype_str(qr.dtype), "), got ", dtype_str(m->dtype));
  }
  check_same_device(qr, "q_rope", tab, op, "cos_sin_cache");
  ROPE_CHECK(tab.dtype == ScalarType::Float, op, ": cos_sin_cache must be float32, got ",
             dtype_str(tab.dtype));
  ROPE_CHECK(tab.dim == 2 && tab.sizes[1] == rope_dim, op,
             ": cos_sin_cache must have shape (max_position, rope_dim) with rope_dim = ", rope_dim,
             ", got ", shape_str(tab));
  check_index(qr, pos, op, "pos_ids");
  check_1d(pos, nnz, op, "pos_ids", nnz_shape(nnz));

  g.tokens = nnz;
  g.q_heads = q_heads;
  g.kv_heads = kv_heads;
  g.half = rope_dim / 2;
  g.nope = nope;
  g.interleaved = interleaved;
  g.mla = mla;
  g.table_rows = tab.sizes[0];
  g.cos_row = tab.strides[0];
  g.cos_col = tab.strides[1];
  g.pos = index_of(pos);
  g.q_rope = rows_of(qr);
  g.k_rope = rows_of(kr);
  g.q_nope = rows_of(qn);
  g.k_nope = rows_of(kn);
}

// Outputs: the first a float8 dtype, the others the same; each its input's shape.
inline ScalarType check_outputs(const Meta& qr, const std::pair<const char*, const Meta*>* outs,
                                const Meta* const* srcs, int n, const char* op) {
  const ScalarType fmt = outs[0].second->dtype;
  for (int i = 0; i < n; ++i) {
    const auto& [name, m] = outs[i];
    if (i == 0) {
      ROPE_CHECK(fmt == ScalarType::Float8_e4m3fn || fmt == ScalarType::Float8_e5m2, op, ": ",
                 name, " must be float8_e4m3fn or float8_e5m2, got ", dtype_str(fmt));
    } else {
      ROPE_CHECK(m->dtype == fmt, op, ": ", name, " must have the dtype of ", outs[0].first, " (",
                 dtype_str(fmt), "), got ", dtype_str(m->dtype));
    }
    check_same_device(qr, "q_rope", *m, op, name);
    bool same = m->dim == srcs[i]->dim;
    for (int64_t d = 0; same && d < m->dim; ++d) same = m->sizes[d] == srcs[i]->sizes[d];
    ROPE_CHECK(same, op, ": ", name, " must have the shape of its input (", shape_str(*srcs[i]),
               "), got ", shape_str(*m));
  }
  return fmt;
}

inline Fp8Format fp8_format(ScalarType t) {
  return t == ScalarType::Float8_e4m3fn ? Fp8Format::kE4M3FN : Fp8Format::kE5M2;
}

}  // namespace quant_detail

// rope.quantize_fp8.
inline QuantGeometry check_quantize(const Tensor& q_rope, const Tensor& k_rope, const Tensor& q_nope,
                                    const Tensor& k_nope, const Tensor& cos_sin_cache,
                                    const Tensor& pos_ids, const Tensor& q_rope_out,
                                    const Tensor& k_rope_out, const Tensor& q_nope_out,
                                    const Tensor& k_nope_out, double scale_q, double scale_kv,
                                    bool interleaved) {
  using namespace quant_detail;
  const char* op = "rope.quantize_fp8";
  const Meta qr(q_rope), kr(k_rope), qn(q_nope), kn(k_nope), tab(cos_sin_cache), pos(pos_ids);
  const Meta qro(q_rope_out), kro(k_rope_out), qno(q_nope_out), kno(k_nope_out);
  QuantGeometry g;
  check_inputs(qr, kr, qn, kn, tab, pos, interleaved, op, g);
  const std::pair<const char*, const Meta*> outs[] = {
      {"q_rope_out", &qro}, {"k_rope_out", &kro}, {"q_nope_out", &qno}, {"k_nope_out", &kno}};
  const Meta* const srcs[] = {&qr, &kr, &qn, &kn};
  g.fmt = fp8_format(check_outputs(qr, outs, srcs, 4, op));
  for (const auto& [name, m] : outs) check_no_internal_overlap(*m, op, name);
  check_outputs_disjoint(outs, 4, op);
  const std::pair<const char*, const Meta*> inputs[] = {
      {"q_rope", &qr}, {"k_rope", &kr}, {"q_nope", &qn}, {"k_nope", &kn},
      {"cos_sin_cache", &tab}, {"pos_ids", &pos}};
  for (const auto& [oname, o] : outs) {
    for (const auto& [iname, i] : inputs) check_disjoint_bytes(*o, oname, *i, iname, op);
  }
  g.scale_q = static_cast<float>(scale_q);
  g.scale_kv = static_cast<float>(scale_kv);
  g.q_rope_out = rows_of(qro);
  g.k_rope_out = rows_of(kro);
  g.q_nope_out = rows_of(qno);
  g.k_nope_out = rows_of(kno);
  return g;
}

// rope.quantize_fp8_append_paged_kv_cache.
inline QuantGeometry check_paged(const Tensor& q_rope, const Tensor& k_rope, const Tensor& q_nope,
                                 const Tensor& k_nope, const std::optional<Tensor>& v_t,
                                 const Tensor& cos_sin_cache, const Tensor& pos_ids,
                                 const Tensor& q_rope_out, const Tensor& q_nope_out,
                                 const Tensor& k_cache, const Tensor& v_cache,
                                 const Tensor& kv_indices, const Tensor& kv_indptr,
                                 const Tensor& batch_indices, const Tensor& positions,
                                 int64_t page_size, const std::string& kv_layout, double scale_q,
                                 double scale_kv, bool interleaved) {
  using namespace quant_detail;
  const char* op = "rope.quantize_fp8_append_paged_kv_cache";
  const Meta qr(q_rope), kr(k_rope), qn(q_nope), kn(k_nope), tab(cos_sin_cache), pos(pos_ids);
  QuantGeometry g;
  check_inputs(qr, kr, qn, kn, tab, pos, interleaved, op, g);
  g.paged = true;
  const int64_t nnz = g.tokens, rope_dim = 2 * g.half;
  // Only empty inputs can make rope_dim + no_rope_dim overflow: no tensor then has that width.
  int64_t head_dim = -1;
  const bool head_dim_fits = add_fits(rope_dim, g.nope, head_dim);
  const std::string head_dim_str = head_dim_fits ? std::to_string(head_dim) : "2^63 or more";
  std::optional<Meta> vm;
  if (g.mla) {
    ROPE_CHECK(!v_t.has_value(), op,
               ": v must be None for MLA (2-D k_rope): the compressed KV is k_nope");
  } else {
    ROPE_CHECK(v_t.has_value(), op,
               ": v is required for GQA/MHA (3-D k_rope): (nnz, num_kv_heads, rope_dim + "
               "no_rope_dim)");
    vm.emplace(*v_t);
    const Meta& v = *vm;
    check_same_device(qr, "q_rope", v, op, "v");
    ROPE_CHECK(v.dtype == qr.dtype, op, ": v must have the dtype of q_rope (", dtype_str(qr.dtype),
               "), got ", dtype_str(v.dtype));
    ROPE_CHECK(v.dim == 3 && v.sizes[0] == nnz && v.sizes[1] == g.kv_heads && v.sizes[2] == head_dim,
               op, ": v must have shape (nnz, num_kv_heads, rope_dim + no_rope_dim) = (", nnz, ", ",
               g.kv_heads, ", ", head_dim_str, "), got ", shape_str(v));
    g.v = rows_of(v);
  }
  const Meta qro(q_rope_out), qno(q_nope_out);
  const std::pair<const char*, const Meta*> outs[] = {{"q_rope_out", &qro}, {"q_nope_out", &qno}};
  const Meta* const srcs[] = {&qr, &qn};
  const ScalarType fmt = check_outputs(qr, outs, srcs, 2, op);
  g.fmt = fp8_format(fmt);
  const bool nhd = kv_layout == "NHD";
  ROPE_CHECK(nhd || kv_layout == "HND", op, ": kv_layout must be 'NHD' or 'HND', got '", kv_layout,
             "'");
  ROPE_CHECK(page_size >= 1, op, ": page_size must be >= 1, got ", page_size);
  const char* c0 = g.mla ? "ckv_cache" : "k_cache";
  const char* c1 = g.mla ? "kpe_cache" : "v_cache";
  const Meta kc(k_cache), vc(v_cache);
  const std::pair<const char*, const Meta*> caches[] = {{c0, &kc}, {c1, &vc}};
  for (const auto& [name, m] : caches) {
    check_same_device(qr, "q_rope", *m, op, name);
    ROPE_CHECK(m->dtype == fmt, op, ": ", name, " must have the dtype of q_rope_out (",
               dtype_str(fmt), "), got ", dtype_str(m->dtype));
  }
  if (g.mla) {
    const std::string pages = kc.dim == 3 ? std::to_string(kc.sizes[0]) : "max_pages";
    const std::tuple<const char*, const Meta*, const char*, int64_t> mla_caches[] = {
        {c0, &kc, "no_rope_dim", g.nope}, {c1, &vc, "rope_dim", rope_dim}};
    for (const auto& [name, m, dim_name, dim] : mla_caches) {
      ROPE_CHECK(m->dim == 3 && m->sizes[0] == kc.sizes[0] && m->sizes[1] == page_size &&
                     m->sizes[2] == dim,
                 op, ": ", name, " must have shape (max_pages, page_size, ", dim_name, ") = (",
                 pages, ", ", page_size, ", ", dim, "), got ", shape_str(*m));
    }
    g.kc = QuantCache{kc.strides[0], kc.strides[1], 0, kc.strides[2]};
    g.vc = QuantCache{vc.strides[0], vc.strides[1], 0, vc.strides[2]};
  } else {
    const int64_t in0 = nhd ? page_size : g.kv_heads, in1 = nhd ? g.kv_heads : page_size;
    const char* dims = nhd ? "page_size, num_kv_heads" : "num_kv_heads, page_size";
    const std::string pages = kc.dim == 4 ? std::to_string(kc.sizes[0]) : "max_pages";
    for (const auto& [name, m] : caches) {
      ROPE_CHECK(m->dim == 4 && m->sizes[1] == in0 && m->sizes[2] == in1 &&
                     m->sizes[3] == head_dim && m->sizes[0] == kc.sizes[0],
                 op, ": ", name, " must have shape (max_pages, ", dims, ", head_dim) = (", pages,
                 ", ", in0, ", ", in1, ", ", head_dim_str, ") for kv_layout '", kv_layout,
                 "', got ", shape_str(*m));
    }
    // (page, entry, head, last): NHD is (pages, page_size, heads, dim), HND swaps the middle two.
    const int e = nhd ? 1 : 2, h = nhd ? 2 : 1;
    g.kc = QuantCache{kc.strides[0], kc.strides[e], kc.strides[h], kc.strides[3]};
    g.vc = QuantCache{vc.strides[0], vc.strides[e], vc.strides[h], vc.strides[3]};
  }
  int64_t entries = 0;  // (the kernels index cache entries in int64)
  ROPE_CHECK(mul_fits(kc.sizes[0], page_size, entries), op,
             ": the caches have 2^63 entries or more");
  const Meta ind(kv_indices), ptr(kv_indptr), bat(batch_indices), ps(positions);
  check_index(qr, ind, op, "kv_indices");
  check_1d(ind, -1, op, "kv_indices", "(total_pages,)");
  check_index(qr, ptr, op, "kv_indptr");
  ROPE_CHECK(ptr.dim == 1 && ptr.sizes[0] >= 1, op,
             ": kv_indptr must have shape (batch_size + 1,), got ", shape_str(ptr));
  check_index(qr, bat, op, "batch_indices");
  check_1d(bat, nnz, op, "batch_indices", nnz_shape(nnz));
  check_index(qr, ps, op, "positions");
  check_1d(ps, nnz, op, "positions", nnz_shape(nnz));
  const std::pair<const char*, const Meta*> written[] = {
      {"q_rope_out", &qro}, {"q_nope_out", &qno}, {c0, &kc}, {c1, &vc}};
  for (const auto& [name, m] : written) check_no_internal_overlap(*m, op, name);
  check_outputs_disjoint(written, 2, op);
  for (int i = 2; i < 4; ++i) {
    for (int j = 0; j < i; ++j) {
      check_elements_disjoint(*written[i].second, written[i].first, *written[j].second,
                              written[j].first, op);
    }
  }
  std::pair<const char*, const Meta*> inputs[] = {
      {"q_rope", &qr},   {"k_rope", &kr},         {"q_nope", &qn},         {"k_nope", &kn},
      {"v", nullptr},    {"cos_sin_cache", &tab}, {"pos_ids", &pos},       {"kv_indices", &ind},
      {"kv_indptr", &ptr}, {"batch_indices", &bat}, {"positions", &ps}};
  if (vm) inputs[4].second = &*vm;
  for (const auto& [wname, w] : written) {
    for (const auto& [iname, i] : inputs) {
      if (i != nullptr) check_disjoint_bytes(*w, wname, *i, iname, op);
    }
  }
  g.scale_q = static_cast<float>(scale_q);
  g.scale_kv = static_cast<float>(scale_kv);
  g.q_rope_out = rows_of(qro);
  g.q_nope_out = rows_of(qno);
  g.page_size = page_size;
  g.max_pages = kc.sizes[0];
  g.batch = ptr.sizes[0] - 1;
  g.num_indices = ind.sizes[0];
  g.kv_indices = index_of(ind);
  g.kv_indptr = index_of(ptr);
  g.batch_indices = index_of(bat);
  g.positions = index_of(ps);
  return g;
}

}  // namespace rope
