// The CPU host side of the fused QK-RMSNorm + RoPE ops (rope.qk_norm_rope, rope.qk_norm_rope_,
// rope.qkv_norm_rope_; docs/qk_norm.md): checks (qk_norm/checks.h), positions read once and
// range-checked before anything is written, the threading, and the call into the norm kernel of
// the CPU variant that serves (CpuKernels::norm_rope, qk_norm/cpu/kernels.h). Each call is a
// RotateGeometry plus a NormDesc.
#include <algorithm>
#include <cmath>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include "../../alloc.h"
#include "../checks.h"
#include "../../routes.h"
#include "../../cpu/cache_store.h"
#include "../../cpu/dt_index.h"
#include "../../cpu/kernel_api.h"

namespace rope {
namespace {

// Work per task: at least this many elements, so decode-sized calls run on the calling thread.
constexpr int64_t kGrainElements = 1 << 15;

// `more_per_token`: elements each token moves besides its normed rows (the value rows of the
// cache store), so a call with only values to store still runs.
void run_norm_rope(const NormJob& job, int64_t more_per_token = 0) {
  const RotateGeometry& g = *job.g;
  if (g.tokens == 0) return;
  int64_t per_token = more_per_token;
  for (int k = 0; k < g.targets; ++k) {
    int64_t rows;
    if (!mul_fits(g.target[k].heads, g.head_dim, rows) || !add_fits(per_token, rows, per_token)) {
      per_token = kInt64Max;
      break;
    }
  }
  if (per_token == 0) return;
  const int64_t grain = std::max<int64_t>(1, kGrainElements / per_token);
  const NormRopeTokensFn kernel = selected_cpu_kernels()->norm_rope[job.x_dt];
  auto fn = [&](int64_t b, int64_t e) { kernel(job, b, e); };
  if (g.tokens <= grain || torch::stable::get_num_threads() <= 1) {
    fn(0, g.tokens);
  } else {
    torch::stable::parallel_for(0, g.tokens, grain, fn);
  }
}

// A weight as the kernel reads it: as it is for rows that fit its stack buffers (it converts
// them), else cast to the arithmetic type (a torch op: an allocation).
Tensor norm_weight(const Tensor& w, ScalarType x, int64_t head_dim) {
  const ScalarType acc = x == ScalarType::Double ? ScalarType::Double : ScalarType::Float;
  if (head_dim <= kQkNormStackHeadDim || dtype_of(w) == acc) return w;
  return torch::stable::to(w, std::optional<ScalarType>(acc));
}

NormJob make_job(const RotateGeometry& g, double eps, bool unit_offset, const Tensor& wq,
                 const Tensor& wk, ScalarType x, ScalarType table) {
  NormJob job{};
  job.g = &g;
  job.norm.eps = eps;
  job.norm.unit_offset = unit_offset;
  const Tensor* ws[2] = {&wq, &wk};
  for (int k = 0; k < 2; ++k) {
    job.w[k] = ws[k]->const_data_ptr();
    job.w_dt[k] = dt_index(dtype_of(*ws[k]));
    job.norm.w_stride[k] = ws[k]->stride(0);
  }
  job.x_dt = dt_index(x);
  job.table_dt = dt_index(table);
  return job;
}

std::tuple<Tensor, Tensor> qk_norm_rope_cpu(Tensor query, Tensor key, Tensor q_weight,
                                            Tensor k_weight, Tensor cos, Tensor sin, double eps,
                                            bool unit_offset, bool interleaved) {
  auto [gq, gk] = check_qk_norm_rope(query, key, q_weight, k_weight, cos, sin, eps, interleaved);
  const ScalarType xt = dtype_of(query);
  const Tensor wq = norm_weight(q_weight, xt, query.size(-1));
  const Tensor wk = norm_weight(k_weight, xt, query.size(-1));
  Tensor oq = new_contiguous(query, query.sizes());
  Tensor ok = new_contiguous(key, key.sizes());
  if (stays_in_cache(nbytes(oq) + nbytes(ok))) {  // a per-head norm: any rows can be heads
    take_outer_heads(gq);
    take_outer_heads(gk);
  }
  const std::pair<const RotateGeometry*, std::pair<const Tensor*, const Tensor*>> parts[] = {
      {&gq, {&query, &oq}}, {&gk, {&key, &ok}}};
  for (int i = 0; i < 2; ++i) {
    const RotateGeometry& g = *parts[i].first;
    const Tensor& w = i == 0 ? wq : wk;
    NormJob job = make_job(g, eps, unit_offset, w, w, xt, dtype_of(cos));
    job.src[0] = parts[i].second.first->const_data_ptr();
    job.dst[0] = parts[i].second.second->mutable_data_ptr();
    job.cos = cos.const_data_ptr();
    job.sin = sin.const_data_ptr();
    run_norm_rope(job);
  }
  return {oq, ok};
}

// rope.qk_norm_rope_backward: the tokens in one task per thread (none for a small call), each
// with its scratch rows and its share of grad_weight from one torch allocation; the shares are
// added in task order (the same sums for the same number of threads).
std::tuple<Tensor, Tensor> qk_norm_rope_backward_cpu(Tensor grad, Tensor x, Tensor weight,
                                                     Tensor cos, Tensor sin, double eps,
                                                     bool unit_offset, bool interleaved) {
  const RotateGeometry g = check_qk_norm_rope_backward(grad, x, weight, cos, sin, eps, interleaved);
  const ScalarType xt = dtype_of(x);
  const ScalarType acc = xt == ScalarType::Double ? ScalarType::Double : ScalarType::Float;
  const int64_t D = g.head_dim;
  Tensor grad_x = new_contiguous(x, x.sizes());
  Tensor grad_w = torch::stable::new_empty(x, {D}, std::optional<ScalarType>(acc));
  int64_t per_token = 0, width = 0;
  if (!mul_fits(g.target[0].heads, D, per_token)) per_token = kInt64Max;
  // (grad_w's D elements were allocated: D * kNormBackwardScratch fits.)
  ROPE_CHECK(mul_fits(D, kNormBackwardScratch, width), kQkNormBackwardOp,
             ": internal error: scratch of ", D, " elements per row");
  const int64_t grain = std::max<int64_t>(1, kGrainElements / std::max<int64_t>(per_token, 1));
  const int64_t tasks =
      g.tokens <= grain ? 1
                        : std::min<int64_t>(std::max<int64_t>(1, torch::stable::get_num_threads()),
                                            g.tokens / grain + 1);
  Tensor scratch = torch::stable::new_empty(x, {tasks, width}, std::optional<ScalarType>(acc));
  NormBackwardJob job{};
  job.g = &g;
  job.eps = eps;
  job.unit_offset = unit_offset;
  job.x = x.const_data_ptr();
  job.grad = grad.const_data_ptr();
  job.grad_x = grad_x.mutable_data_ptr();
  job.w = weight.const_data_ptr();
  job.w_dt = dt_index(dtype_of(weight));
  job.w_stride = weight.stride(0);
  job.cos = cos.const_data_ptr();
  job.sin = sin.const_data_ptr();
  job.x_dt = dt_index(xt);
  job.table_dt = dt_index(dtype_of(cos));
  const NormBackwardTokensFn kernel = selected_cpu_kernels()->norm_rope_backward[job.x_dt];
  char* const rows = static_cast<char*>(scratch.mutable_data_ptr());
  const int64_t task_bytes = width * static_cast<int64_t>(scratch.element_size());
  const int64_t share = g.tokens / tasks, extra = g.tokens % tasks;
  auto run = [&](int64_t t0, int64_t t1) {
    for (int64_t k = t0; k < t1; ++k) {  // task k: tokens [k * share + min(k, extra), ...)
      const int64_t b = k * share + std::min(k, extra);
      kernel(job, b, b + share + (k < extra ? 1 : 0), rows + k * task_bytes);
    }
  };
  if (tasks == 1) {
    run(0, 1);
  } else {
    torch::stable::parallel_for(0, tasks, 1, run);
  }
  auto add_shares = [&](auto* out) {  // (in double: a handful of tasks, rounded once)
    using acc_t = std::remove_pointer_t<decltype(out)>;
    const acc_t* part = reinterpret_cast<const acc_t*>(rows);
    for (int64_t j = 0; j < D; ++j) {
      double sum = 0;
      for (int64_t k = 0; k < tasks; ++k) sum += static_cast<double>(part[k * width + j]);
      out[j] = static_cast<acc_t>(sum);
    }
  };
  if (acc == ScalarType::Double) {
    add_shares(static_cast<double*>(grad_w.mutable_data_ptr()));
  } else {
    add_shares(static_cast<float*>(grad_w.mutable_data_ptr()));
  }
  return {grad_x, grad_w};
}

// rope.norm_rope's weight or bias for the kernel: the general rows read them contiguous in the
// arithmetic type (a cast, or none: nullptr); a weighted per-head RMSNorm as rope.qk_norm_rope
// (with weights of 1 when there is none).
std::optional<Tensor> form_operand(const std::optional<Tensor>& t, bool general, ScalarType x,
                                   const Tensor& query, bool weight) {
  const ScalarType acc = x == ScalarType::Double ? ScalarType::Double : ScalarType::Float;
  if (!t.has_value()) {
    if (general || !weight) return std::nullopt;
    Tensor ones = torch::stable::new_empty(query, {query.size(-1)}, std::optional<ScalarType>(acc));
    torch::stable::fill_(ones, 1.0);
    return ones;
  }
  if (!general) return norm_weight(*t, x, query.size(-1));
  if (dtype_of(*t) == acc && t->is_contiguous()) return t;
  return torch::stable::contiguous(torch::stable::to(*t, std::optional<ScalarType>(acc)));
}

std::tuple<Tensor, Tensor> norm_rope_cpu(Tensor query, Tensor key, std::optional<Tensor> q_weight,
                                         std::optional<Tensor> k_weight,
                                         std::optional<Tensor> q_bias,
                                         std::optional<Tensor> k_bias, Tensor cos, Tensor sin,
                                         double eps, std::string norm, bool interleaved) {
  NormRopeCheck c =
      check_norm_rope(query, key, q_weight, k_weight, q_bias, k_bias, cos, sin, eps, norm,
                      interleaved);
  const ScalarType xt = dtype_of(query);
  Tensor out[2] = {new_contiguous(query, query.sizes()), new_contiguous(key, key.sizes())};
  // (Not across heads: there a token's heads must be its innermost rows.)
  if (c.form != NormForm::kRmsAcrossHeads && stays_in_cache(nbytes(out[0]) + nbytes(out[1]))) {
    take_outer_heads(c.gq);
    take_outer_heads(c.gk);
  }
  const Tensor* xs[2] = {&query, &key};
  const std::optional<Tensor>* ws[2] = {&q_weight, &k_weight};
  const std::optional<Tensor>* bs[2] = {&q_bias, &k_bias};
  const RotateGeometry* g[2] = {&c.gq, &c.gk};
  for (int i = 0; i < 2; ++i) {
    const std::optional<Tensor> w = form_operand(*ws[i], c.general, xt, *xs[i], true);
    const std::optional<Tensor> b = form_operand(*bs[i], c.general, xt, *xs[i], false);
    NormJob job{};
    job.g = g[i];
    job.norm.eps = eps;
    job.norm.form = c.form;
    if (c.form == NormForm::kRmsAcrossHeads && g[i]->tokens > 0) {
      // The heads of a token are the kernel's rows of one token (the tables are shared by
      // them), in runs of the tensor's heads where the token walk merged leading dims.
      const int64_t heads = xs[i]->size(-2);
      STD_TORCH_CHECK(heads > 0 && g[i]->target[0].heads % heads == 0, kNormFormsOp,
                      ": internal error: rows of ", g[i]->target[0].heads, " heads per token for ",
                      heads, " heads");
      job.norm.group_heads[0] = heads;
    }
    job.general = c.general;
    job.w[0] = w ? w->const_data_ptr() : nullptr;
    job.w_dt[0] = w ? dt_index(dtype_of(*w)) : 0;
    job.norm.w_stride[0] = w ? w->stride(0) : 1;
    job.b[0] = b ? b->const_data_ptr() : nullptr;
    job.x_dt = dt_index(xt);
    job.table_dt = dt_index(dtype_of(cos));
    job.src[0] = xs[i]->const_data_ptr();
    job.dst[0] = out[i].mutable_data_ptr();
    job.cos = cos.const_data_ptr();
    job.sin = sin.const_data_ptr();
    run_norm_rope(job);
  }
  return {out[0], out[1]};
}

// The in-place ops: positions copied if they share memory with what is written (re-checked:
// the copy's strides), range-checked, then one pass. query and key: tensors' Metas, or views of
// qkv's (QkvViews).
void norm_rope_inplace(const Meta& query, const Meta& key, const Tensor* written0,
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
  const ScalarType xt = query.dtype;
  const Tensor wq = norm_weight(q_weight, xt, g.head_dim);
  const Tensor wk = norm_weight(k_weight, xt, g.head_dim);
  NormJob job = make_job(g, eps, unit_offset, wq, wk, xt, dtype_of(cache));
  job.src[0] = job.dst[0] = query.data();
  job.src[1] = job.dst[1] = key.data();
  job.cos = cache.const_data_ptr();
  job.sin = sin_of_cache(cache, g);
  job.positions = positions.const_data_ptr();
  run_norm_rope(job);
}

void qk_norm_rope_inplace_cpu(Tensor query, Tensor key, Tensor q_weight, Tensor k_weight,
                              Tensor positions, Tensor cos_sin_cache, double eps, bool unit_offset,
                              bool interleaved, std::optional<std::vector<int64_t>> mrope_section,
                              bool mrope_interleaved) {
  norm_rope_inplace(Meta(query), Meta(key), &query, &key, q_weight, k_weight, positions,
                    cos_sin_cache, eps, unit_offset, interleaved, mrope_section,
                    mrope_interleaved, kQkNormInplaceOp);
}

void qkv_norm_rope_inplace_cpu(Tensor qkv, int64_t num_heads_q, int64_t num_heads_k,
                               int64_t num_heads_v, int64_t head_dim, Tensor q_weight,
                               Tensor k_weight, Tensor positions, Tensor cos_sin_cache, double eps,
                               bool unit_offset, bool interleaved,
                               std::optional<std::vector<int64_t>> mrope_section,
                               bool mrope_interleaved) {
  const QkvViews v(qkv, num_heads_q, num_heads_k, num_heads_v, head_dim);
  norm_rope_inplace(*v.q, *v.k, &qkv, nullptr, q_weight, k_weight, positions, cos_sin_cache, eps,
                    unit_offset, interleaved, mrope_section, mrope_interleaved, kQkvNormOp);
}

// The serving prologue: the norm and rotation stage of rope.qk_norm_rope_ with the paged-cache
// store stage of rope.apply_and_cache_ (cache_store.h) run after each token, while its rows are
// in L1. Positions and slots read once and checked before anything is written. `out`: nullptr
// in place (rope.qk_norm_rope_and_cache_), else the fresh query, key and value are allocated
// there and written instead (rope.qk_norm_rope_and_cache).
void prologue_cpu(const Tensor& query, const Tensor& key, const Tensor& value, Tensor positions,
                  const Tensor& cos_sin_cache, const Tensor& q_weight, const Tensor& k_weight,
                  const Tensor& key_cache, const Tensor& value_cache, Tensor slot_mapping,
                  double eps, bool unit_offset, bool interleaved,
                  const std::optional<std::vector<int64_t>>& mrope_section,
                  bool mrope_interleaved, bool v_norm, const std::string& kv_cache_dtype,
                  const std::optional<Tensor>& k_scale, const std::optional<Tensor>& v_scale,
                  std::optional<std::tuple<Tensor, Tensor, Tensor>>* out) {
  const bool in_place = out == nullptr;
  const char* op = in_place ? kQkNormCacheOp : kQkNormCacheOutOp;
  auto check = [&] {
    return check_qk_norm_rope_and_cache(query, key, value, positions, cos_sin_cache, q_weight,
                                        k_weight, key_cache, value_cache, slot_mapping, eps,
                                        interleaved, mrope_section ? &*mrope_section : nullptr,
                                        mrope_interleaved, v_norm, kv_cache_dtype, k_scale,
                                        v_scale, in_place);
  };
  const CacheGeometry cg =
      in_place ? check_read_once(check, {&positions, &slot_mapping},
                                 {&query, &key, &value, &key_cache, &value_cache})
               : check_read_once(check, {&positions, &slot_mapping}, {&key_cache, &value_cache});
  check_positions_in_range(positions, cg.rot.table.rows, op, "cos_sin_cache.size(0)");
  check_slots(slot_mapping, cg.slots, op);
  const ScalarType xt = dtype_of(query);
  const Tensor wq = norm_weight(q_weight, xt, cg.rot.head_dim);
  const Tensor wk = norm_weight(k_weight, xt, cg.rot.head_dim);
  if (!in_place) {
    out->emplace(new_contiguous(query, query.sizes()), new_contiguous(key, key.sizes()),
                 new_contiguous(value, value.sizes()));
  }
  const Tensor& q_out = in_place ? query : std::get<0>(**out);
  const Tensor& k_out = in_place ? key : std::get<1>(**out);
  const Tensor* v_out = in_place ? (v_norm ? &value : nullptr) : &std::get<2>(**out);
  const CacheJob store = cache_store_job(cg, k_out, value, v_norm ? eps : -1.0, slot_mapping,
                                         key_cache, value_cache, k_scale, v_scale, v_out);
  NormJob job = make_job(cg.rot, eps, unit_offset, wq, wk, xt, dtype_of(cos_sin_cache));
  job.src[0] = query.const_data_ptr();
  job.src[1] = key.const_data_ptr();
  job.dst[0] = q_out.mutable_data_ptr();
  job.dst[1] = k_out.mutable_data_ptr();
  job.cos = cos_sin_cache.const_data_ptr();
  job.sin = sin_of_cache(cos_sin_cache, cg.rot);
  job.positions = positions.const_data_ptr();
  job.after_token = TokenHook{cache_store_kernel(cg, xt), &store};
  int64_t values = 0;
  if (!mul_fits(cg.kv_heads, cg.value_dim, values)) values = kInt64Max;
  run_norm_rope(job, values);
}

void qk_norm_rope_and_cache_cpu(Tensor query, Tensor key, Tensor value, Tensor positions,
                                Tensor cos_sin_cache, Tensor q_weight, Tensor k_weight,
                                Tensor key_cache, Tensor value_cache, Tensor slot_mapping,
                                double eps, bool unit_offset, bool interleaved,
                                std::optional<std::vector<int64_t>> mrope_section,
                                bool mrope_interleaved, bool v_norm, std::string kv_cache_dtype,
                                std::optional<Tensor> k_scale, std::optional<Tensor> v_scale) {
  prologue_cpu(query, key, value, positions, cos_sin_cache, q_weight, k_weight, key_cache,
               value_cache, slot_mapping, eps, unit_offset, interleaved, mrope_section,
               mrope_interleaved, v_norm, kv_cache_dtype, k_scale, v_scale, nullptr);
}

std::tuple<Tensor, Tensor, Tensor> qk_norm_rope_and_cache_out_cpu(
    Tensor query, Tensor key, Tensor value, Tensor positions, Tensor cos_sin_cache,
    Tensor q_weight, Tensor k_weight, Tensor key_cache, Tensor value_cache, Tensor slot_mapping,
    double eps, bool unit_offset, bool interleaved,
    std::optional<std::vector<int64_t>> mrope_section, bool mrope_interleaved, bool v_norm,
    std::string kv_cache_dtype, std::optional<Tensor> k_scale, std::optional<Tensor> v_scale) {
  std::optional<std::tuple<Tensor, Tensor, Tensor>> out;
  prologue_cpu(query, key, value, positions, cos_sin_cache, q_weight, k_weight, key_cache,
               value_cache, slot_mapping, eps, unit_offset, interleaved, mrope_section,
               mrope_interleaved, v_norm, kv_cache_dtype, k_scale, v_scale, &out);
  return std::move(*out);
}

}  // namespace
}  // namespace rope

STABLE_TORCH_LIBRARY_IMPL(rope, CPU, m) {
  ROPE_IMPL_CPU(m, "qk_norm_rope", &rope::qk_norm_rope_cpu);
  ROPE_IMPL_CPU(m, "norm_rope", &rope::norm_rope_cpu);
  ROPE_IMPL_CPU(m, "qk_norm_rope_backward", &rope::qk_norm_rope_backward_cpu);
  ROPE_IMPL_CPU(m, "qk_norm_rope_", &rope::qk_norm_rope_inplace_cpu);
  ROPE_IMPL_CPU(m, "qkv_norm_rope_", &rope::qkv_norm_rope_inplace_cpu);
  ROPE_IMPL_CPU(m, "qk_norm_rope_and_cache_", &rope::qk_norm_rope_and_cache_cpu);
  ROPE_IMPL_CPU(m, "qk_norm_rope_and_cache", &rope::qk_norm_rope_and_cache_out_cpu);
}
