// Host side of the fused QK-RMSNorm + RoPE CUDA ops, shared by the ops (cuda_ops.cpp) and
// the CPU simulator (tests/sim/qk_norm_sim.inc): checks (qk_norm/checks.h), positions read
// once, table and weight casts, the launch plan and the dtype dispatch. A `Runner` launches the
// kernel instantiation it is given, or simulates it. Positions are range-checked on the device.
#pragma once

#include <algorithm>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "../../alloc.h"
#include "../checks.h"
#include "thread.h"
#include "../../cuda/rope_cuda_host.h"

namespace rope::gpu {

// A weight in the arithmetic type (a cast only when it has another dtype).
inline Tensor norm_weight_for(const Tensor& w, ScalarType x_type) {
  const ScalarType acc = x_type == ScalarType::Double ? ScalarType::Double : ScalarType::Float;
  if (dtype_of(w) == acc) return w;
  return torch::stable::to(w, std::optional<ScalarType>(acc));
}

// The norm of the qk_norm_rope* ops: a weighted per-head RMSNorm.
inline NormDesc rms_norm(double eps, bool unit_offset) {
  NormDesc n;
  n.eps = eps;
  n.unit_offset = unit_offset;
  return n;
}

struct NormRopeTensors {
  const void* src[2] = {nullptr, nullptr};
  void* dst[2] = {nullptr, nullptr};
  const Tensor* w[2] = {nullptr, nullptr};  // nullptr: no weight (rope.norm_rope)
  const Tensor* b[2] = {nullptr, nullptr};  // rope.norm_rope's biases, contiguous
  const void* cos = nullptr;
  const void* sin = nullptr;
  const void* pos = nullptr;
  ScalarType table_type = ScalarType::Float;
};

// `store`: the paged-cache store stage (its value heads get rows of their own), or nullptr.
// `norm`: its eps, unit_offset, form and group_heads are read (the weights' strides are set here).
// Returns whether a kernel was launched (false: nothing to normalize, rotate or store).
template <class Runner>
bool run_norm_rope(const RotateGeometry& g, const NormRopeTensors& t, const NormDesc& norm,
                   ScalarType x_type, Runner&& run, int64_t max_blocks,
                   const NormStore* store = nullptr) {
  // a thread per unit: one head, or across heads a token's heads of one target (norm_rope_thread)
  const bool across = norm.form == NormForm::kRmsAcrossHeads;
  const int64_t qk_units = g.target[0].heads / (across ? norm.group_heads[0] : 1) +
                           (g.targets > 1 ? g.target[1].heads / (across ? norm.group_heads[1] : 1)
                                          : 0);
  if (store == nullptr && g.head_dim == 0) return false;
  const int64_t heads = qk_units + (store != nullptr ? store->cg.kv_heads : 0);
  if (g.tokens == 0 || heads == 0) return false;
  dispatch_types(x_type, t.table_type, [&](auto x0, auto tab0) {
    using x_t = decltype(x0);
    using tab_t = decltype(tab0);
    using acc_t = opmath_t<x_t>;
    NormRopeArgs<x_t, tab_t> a{};
    a.norm = norm;
    for (int k = 0; k < g.targets; ++k) {
      a.src[k] = static_cast<const x_t*>(t.src[k]);
      a.dst[k] = static_cast<x_t*>(t.dst[k]);
      a.w[k] = t.w[k] ? static_cast<const acc_t*>(t.w[k]->const_data_ptr()) : nullptr;
      a.norm.w_stride[k] = t.w[k] ? t.w[k]->stride(0) : 1;
      a.b[k] = t.b[k] ? static_cast<const acc_t*>(t.b[k]->const_data_ptr()) : nullptr;
    }
    a.cos = static_cast<const tab_t*>(t.cos);
    a.sin = static_cast<const tab_t*>(t.sin);
    a.pos = t.pos;
    a.g = g;
    a.rows = g.tokens * heads;  // at most the rows of the operands: fits
    if (store != nullptr) {
      NormStore& st = a.store;
      st = *store;
      st.on = true;
      const CacheDesc& cg = st.cg;
      st.v_vec = value_rows_vectorizable<x_t>(st.value, cg.v_token, cg.v_head, cg.v_last,
                                              cg.value_dim) &&
                 (st.value_out == nullptr ||
                  value_rows_vectorizable<x_t>(st.value_out, cg.vo_token, cg.vo_head, cg.vo_last,
                                               cg.value_dim));
      st.kc_vec = cache_rows_vectorizable<x_t>(st.key_cache, cg.kc, cg.format);
      st.vc_vec = cache_rows_vectorizable<x_t>(st.value_cache, cg.vc, cg.format);
    }
    const void* src[2] = {a.src[0], a.src[1]};
    const void* dst[2] = {a.dst[0], a.dst[1]};
    a.vec = vectorizable<x_t>(g, src, dst, true) && (g.interleaved || g.half % kWidth<x_t> == 0);
    LaunchPlan p;
    p.vec = a.vec;
    p.block = {static_cast<unsigned>(kNormThreadsPerBlock), 1, 1};
    p.grid = {static_cast<unsigned>(std::min(ceil_div(a.rows, kNormThreadsPerBlock), max_blocks)),
              1, 1};
    p.idx32 = g.tokens <= static_cast<int64_t>(UINT32_MAX);
    a.idx32 = p.idx32;
    g.interleaved ? run(p, a, Bool<true>{}) : run(p, a, Bool<false>{});
  });
  return true;
}

template <class Runner>
std::tuple<Tensor, Tensor> qk_norm_rope_host(const Tensor& query, const Tensor& key,
                                             const Tensor& q_weight, const Tensor& k_weight,
                                             const Tensor& cos_in, const Tensor& sin_in,
                                             double eps, bool unit_offset, bool interleaved,
                                             Runner&& run, int64_t max_blocks = kMaxBlocks) {
  auto geoms = check_qk_norm_rope(query, key, q_weight, k_weight, cos_in, sin_in, eps, interleaved);
  const ScalarType xt = dtype_of(query);
  const Tensor cos = table_for(cos_in, xt), sin = table_for(sin_in, xt);
  if (cos.get() != cos_in.get() || sin.get() != sin_in.get()) {
    geoms = check_qk_norm_rope(query, key, q_weight, k_weight, cos, sin, eps, interleaved);
  }
  const Tensor wq = norm_weight_for(q_weight, xt), wk = norm_weight_for(k_weight, xt);
  Tensor oq = new_contiguous(query, query.sizes());
  Tensor ok = new_contiguous(key, key.sizes());
  const RotateGeometry* gs[2] = {&geoms.first, &geoms.second};
  const Tensor* in[2] = {&query, &key};
  Tensor* out[2] = {&oq, &ok};
  const Tensor* ws[2] = {&wq, &wk};
  for (int i = 0; i < 2; ++i) {
    NormRopeTensors t;
    t.src[0] = in[i]->const_data_ptr();
    t.dst[0] = out[i]->mutable_data_ptr();
    t.w[0] = t.w[1] = ws[i];
    t.cos = cos.const_data_ptr();
    t.sin = sin.const_data_ptr();
    t.table_type = dtype_of(cos);
    run_norm_rope(*gs[i], t, rms_norm(eps, unit_offset), xt, run, max_blocks);
  }
  return {oq, ok};
}

// rope.norm_rope: a weight or bias in the arithmetic type, contiguous (the thread code reads
// biases with unit stride), or none.
inline std::optional<Tensor> form_operand_for(const std::optional<Tensor>& t, ScalarType x_type) {
  if (!t.has_value()) return std::nullopt;
  return torch::stable::contiguous(norm_weight_for(*t, x_type));
}

template <class Runner>
std::tuple<Tensor, Tensor> norm_rope_host(const Tensor& query, const Tensor& key,
                                          const std::optional<Tensor>& q_weight,
                                          const std::optional<Tensor>& k_weight,
                                          const std::optional<Tensor>& q_bias,
                                          const std::optional<Tensor>& k_bias,
                                          const Tensor& cos_in, const Tensor& sin_in, double eps,
                                          const std::string& norm, bool interleaved,
                                          Runner&& run, int64_t max_blocks = kMaxBlocks) {
  auto check = [&](const Tensor& c, const Tensor& s) {
    return check_norm_rope(query, key, q_weight, k_weight, q_bias, k_bias, c, s, eps, norm,
                           interleaved);
  };
  NormRopeCheck c = check(cos_in, sin_in);
  const ScalarType xt = dtype_of(query);
  const Tensor cos = table_for(cos_in, xt), sin = table_for(sin_in, xt);
  if (cos.get() != cos_in.get() || sin.get() != sin_in.get()) c = check(cos, sin);
  const std::optional<Tensor> w[2] = {form_operand_for(q_weight, xt),
                                      form_operand_for(k_weight, xt)};
  const std::optional<Tensor> b[2] = {form_operand_for(q_bias, xt), form_operand_for(k_bias, xt)};
  const Tensor* in[2] = {&query, &key};
  Tensor out[2] = {new_contiguous(query, query.sizes()), new_contiguous(key, key.sizes())};
  const RotateGeometry* gs[2] = {&c.gq, &c.gk};
  for (int i = 0; i < 2; ++i) {
    NormDesc nd = rms_norm(eps, false);
    nd.form = c.form;
    if (c.form == NormForm::kRmsAcrossHeads && gs[i]->tokens > 0) {
      // a token's rows, in runs of the tensor's heads (see the CPU host, norm_rope_cpu)
      const int64_t heads = in[i]->size(-2);
      STD_TORCH_CHECK(heads > 0 && gs[i]->target[0].heads % heads == 0, kNormFormsOp,
                      ": internal error: rows of ", gs[i]->target[0].heads,
                      " heads per token for ", heads, " heads");
      nd.group_heads[0] = heads;
    }
    NormRopeTensors t;
    t.src[0] = in[i]->const_data_ptr();
    t.dst[0] = out[i].mutable_data_ptr();
    t.w[0] = w[i] ? &*w[i] : nullptr;
    t.b[0] = b[i] ? &*b[i] : nullptr;
    t.cos = cos.const_data_ptr();
    t.sin = sin.const_data_ptr();
    t.table_type = dtype_of(cos);
    run_norm_rope(*gs[i], t, nd, xt, run, max_blocks);
  }
  return {out[0], out[1]};
}

// The in-place ops' operands: query and key read and written where they are, the rows of the
// cos_sin_cache at positions, the weights wq and wk (the caller's: kept alive by it).
inline NormRopeTensors inplace_operands(const Meta& query, const Meta& key, const Tensor& wq,
                                        const Tensor& wk, const Tensor& cache,
                                        const RotateGeometry& g, const Tensor& positions) {
  NormRopeTensors t;
  t.src[0] = t.dst[0] = query.data();
  t.src[1] = t.dst[1] = key.data();
  t.w[0] = &wq;
  t.w[1] = &wk;
  t.cos = cache.const_data_ptr();
  t.sin = sin_of_cache(cache, g);
  t.pos = positions.const_data_ptr();
  t.table_type = dtype_of(cache);
  return t;
}

// rope.qk_norm_rope_ (written1 = &key) and rope.qkv_norm_rope_ (query/key: views of written0 =
// &qkv, QkvViews; written1 = nullptr).
template <class Runner>
void qk_norm_rope_inplace_host(const Meta& query, const Meta& key, const Tensor* written0,
                               const Tensor* written1, const Tensor& q_weight,
                               const Tensor& k_weight, const Tensor& positions_in,
                               const Tensor& cache_in, double eps, bool unit_offset,
                               bool interleaved, const std::vector<int64_t>* section,
                               bool mrope_interleaved, const char* op, Runner&& run,
                               int64_t max_blocks = kMaxBlocks) {
  Tensor positions = positions_in;
  auto check = [&](const Tensor& cache) {
    return check_qk_norm_rope_inplace(query, key, q_weight, k_weight, positions, cache, eps,
                                      interleaved, section, mrope_interleaved, op);
  };
  RotateGeometry g = check(cache_in);
  positions = positions_read_once(positions, {written0, written1});
  const Tensor cache = table_for(cache_in, query.dtype);
  if (positions.get() != positions_in.get() || cache.get() != cache_in.get()) g = check(cache);
  const ScalarType xt = query.dtype;
  const Tensor wq = norm_weight_for(q_weight, xt), wk = norm_weight_for(k_weight, xt);
  if (!run_norm_rope(g, inplace_operands(query, key, wq, wk, cache, g, positions),
                     rms_norm(eps, unit_offset), xt, run, max_blocks)) {
    check_data_on_host(g.tokens, positions, g.table.rows, op, "cos_sin_cache.size(0)");
  }
}

// rope.qk_norm_rope_and_cache_: the norm and rotation of qk_norm_rope_ with the paged-cache store
// stage of apply_and_cache_ (NormStore), in one kernel after the slots' device check. `out`:
// nullptr in place, else rope.qk_norm_rope_and_cache: the fresh query, key and value are
// allocated there and written instead.
template <class Runner>
void qk_norm_rope_and_cache_host(
    const Tensor& query, const Tensor& key, const Tensor& value, const Tensor& positions_in,
    const Tensor& cache_in, const Tensor& q_weight, const Tensor& k_weight,
    const Tensor& key_cache, const Tensor& value_cache, const Tensor& slots_in, double eps,
    bool unit_offset, bool interleaved, const std::vector<int64_t>* section,
    bool mrope_interleaved, bool v_norm, const std::string& kv_cache_dtype,
    const std::optional<Tensor>& k_scale, const std::optional<Tensor>& v_scale, Runner&& run,
    std::optional<std::tuple<Tensor, Tensor, Tensor>>* out = nullptr,
    int64_t max_blocks = kMaxBlocks) {
  const bool in_place = out == nullptr;
  Tensor positions = positions_in, slots = slots_in;
  auto check = [&](const Tensor& cache) {
    return check_qk_norm_rope_and_cache(query, key, value, positions, cache, q_weight, k_weight,
                                        key_cache, value_cache, slots, eps, interleaved, section,
                                        mrope_interleaved, v_norm, kv_cache_dtype, k_scale,
                                        v_scale, in_place);
  };
  CacheGeometry cg =
      in_place ? check_read_once([&] { return check(cache_in); }, {&positions, &slots},
                                 {&query, &key, &value, &key_cache, &value_cache})
               : check_read_once([&] { return check(cache_in); }, {&positions, &slots},
                                 {&key_cache, &value_cache});
  const ScalarType xt = dtype_of(query);
  const Tensor cache = table_for(cache_in, xt);
  if (cache.get() != cache_in.get()) cg = check(cache);
  // The kernel checks a slot where a key or value row reads it. With no key heads no row does,
  // nor do rows of 0 elements, and with no rows nothing launches: such calls check positions
  // and slots on the host (a copy, in degenerate calls only), before anything is written.
  const bool host_checks = cg.kv_heads == 0 || (cg.rot.head_dim == 0 && cg.value_dim == 0);
  if (!host_checks) check_slots_on_device(cg, slots, run, max_blocks);
  const Tensor wq = norm_weight_for(q_weight, xt), wk = norm_weight_for(k_weight, xt);
  NormRopeTensors t = inplace_operands(Meta(query), Meta(key), wq, wk, cache, cg.rot, positions);
  NormStore st{};
  st.cg = cg;
  st.value = value.const_data_ptr();
  st.value_out = v_norm ? value.mutable_data_ptr() : nullptr;
  if (!in_place) {
    out->emplace(new_contiguous(query, query.sizes()), new_contiguous(key, key.sizes()),
                 new_contiguous(value, value.sizes()));
    t.src[0] = query.const_data_ptr();  // only read: no mutable access (a lazy clone stays one)
    t.src[1] = key.const_data_ptr();
    t.dst[0] = std::get<0>(**out).mutable_data_ptr();
    t.dst[1] = std::get<1>(**out).mutable_data_ptr();
    st.value_out = std::get<2>(**out).mutable_data_ptr();
  }
  st.slots = slots.const_data_ptr();
  st.key_cache = key_cache.mutable_data_ptr();
  st.value_cache = value_cache.mutable_data_ptr();
  if (cg.format != CacheFormat::kSame) {
    st.k_scale = static_cast<const float*>(k_scale->const_data_ptr());
    st.v_scale = static_cast<const float*>(v_scale->const_data_ptr());
  }
  st.v_norm = v_norm;
  auto check_on_host = [&] {
    check_data_on_host(cg.rot.tokens, positions, cg.rot.table.rows,
                       in_place ? kQkNormCacheOp : kQkNormCacheOutOp, "cos_sin_cache.size(0)",
                       &slots, cg.slots);
  };
  if (host_checks) check_on_host();
  if (!run_norm_rope(cg.rot, t, rms_norm(eps, unit_offset), xt, run, max_blocks, &st) &&
      !host_checks) {
    check_on_host();
  }
}

}  // namespace rope::gpu
