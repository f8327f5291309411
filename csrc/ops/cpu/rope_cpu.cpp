// The CPU host side of every op: checks (../checks.h), the positions' range check (the data is
// here, so it runs before anything is written), the threading, and the call into the kernel
// family of the ISA that serves (kernel_api.h).
#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include "../alloc.h"
#include "../checks.h"
#include "../routes.h"
#include "cache_store.h"
#include "dt_index.h"
#include "fresh_output.h"
#include "kernel_api.h"

namespace rope {
namespace {

// Work per task: at least this many elements, so decode-sized calls run inline on the calling
// thread (waking the pool costs more than the work).
constexpr int64_t kGrainElements = 1 << 15;

// a * b, or kInt64Max where it does not fit: a work estimate, which only sizes the grain (an
// empty tensor can be expanded to dims whose product overflows).
int64_t work(int64_t a, int64_t b) {
  int64_t r;
  return mul_fits(a, b, r) ? r : kInt64Max;
}

// `more_per_token`: elements each token moves besides its rotated rows (the value rows of the
// cache write), so a call with nothing to rotate but values to store still runs.
template <typename F>
void run_tokens(const RotateGeometry& g, const F& fn, int64_t more_per_token = 0) {
  if (g.tokens == 0) return;  // nothing to do, however large the (empty) rows
  int64_t per_token = more_per_token;
  for (int k = 0; k < g.targets; ++k) {
    if (!add_fits(per_token, work(g.target[k].heads, g.head_dim), per_token)) per_token = kInt64Max;
  }
  if (per_token == 0) return;
  const int64_t grain = std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, per_token));
  if (g.tokens <= grain || torch::stable::get_num_threads() <= 1) {
    fn(0, g.tokens);
  } else {
    torch::stable::parallel_for(0, g.tokens, grain, fn);
  }
}

// `fresh`: the output of an allocating op not yet backed by the OS (fresh_output.h), first
// touched chunk by chunk by the thread that writes it.
void run_rotate(const RotateJob& job, ScalarType x_type, const FreshOutput& fresh = {}) {
  const RotateTokensFn fn = selected_cpu_kernels()->rotate[dt_index(x_type)];
  run_tokens(*job.g, [&](int64_t b, int64_t e) {
    first_touch_chunks(fresh, b, e, [&](int64_t cb, int64_t ce) { fn(job, cb, ce); });
  });
}

RotateJob job_for(const RotateGeometry& g, const Tensor& x, void* dst, const Tensor& cos,
                  const Tensor& sin, int64_t out_bytes) {
  RotateJob job{};
  job.g = &g;
  job.src[0] = x.const_data_ptr();
  job.dst[0] = dst;
  job.cos = cos.const_data_ptr();
  job.sin = sin.const_data_ptr();
  job.table_dt = dt_index(dtype_of(cos));
  job.stream = out_bytes >= cpu_stream_threshold_bytes();
  return job;
}

// An allocating op's job into its new `out` (or with `fresh`, what fresh_output found of it):
// streamed as job_for says, unless out is fresh (then plain stores after a chunked first touch:
// fresh_output.h).
void run_rotate_new(RotateJob job, const FreshOutput& fresh, ScalarType x_type) {
  if (fresh.per_token != 0) job.stream = false;
  run_rotate(job, x_type, fresh);
}
void run_rotate_new(RotateJob job, const Tensor& out, ScalarType x_type) {
  run_rotate_new(job, fresh_output(*job.g, job.dst[0], nbytes(out)), x_type);
}

// rope.apply's rows of x into out (`fresh_out`: allocated by this call). Outer heads
// (take_outer_heads, checks.h) only for a call that stays in the cache, x and out together below
// the streaming threshold: at DRAM sizes a token's rows megabytes apart stream worse than the
// walk in memory order (docs/cpu-performance.md "Heads far apart"). Its fresh output, no longer
// written token after token, is backed at once.
void run_apply(RotateGeometry g, const Tensor& x, const Tensor& cos, const Tensor& sin,
               const Tensor& out, bool fresh_out) {
  void* dst = out.mutable_data_ptr();
  const int64_t bytes = nbytes(out);
  FreshOutput fresh = fresh_out ? fresh_output(g, dst, bytes) : FreshOutput{};
  if (stays_in_cache(bytes) && take_outer_heads(g)) fresh = back_at_once(fresh, bytes);
  run_rotate_new(job_for(g, x, dst, cos, sin, bytes), fresh, dtype_of(x));
}

// rope.apply (kInverse = false) and rope.apply_backward (true) into a fresh tensor.
template <bool kInverse>
Tensor apply_cpu(Tensor x, Tensor cos, Tensor sin, bool interleaved) {
  const RotateGeometry g = check_apply(x, cos, sin, interleaved, kInverse,
                                       kInverse ? "rope.apply_backward" : "rope.apply",
                                       kInverse ? "grad" : "x");
  Tensor out = new_contiguous(x, x.sizes());
  run_apply(g, x, cos, sin, out, true);
  return out;
}

void apply_out_cpu(Tensor x, Tensor cos, Tensor sin, bool interleaved, Tensor out) {
  run_apply(check_apply_out(x, cos, sin, out, interleaved), x, cos, sin, out, false);
}

// The in-place ops on query/key: positions copied if they share memory with what is written,
// range-checked, then the rotation of dims [rope_dim_offset, rope_dim_offset + rotary_dim).
RotateGeometry inplace_geometry(const Tensor& query, const std::optional<Tensor>& key,
                                Tensor& positions, const Tensor& cache, bool interleaved,
                                const std::vector<int64_t>* section, bool mrope_interleaved,
                                int64_t rope_dim_offset, bool inverse, const char* op) {
  auto check = [&] {
    RotateGeometry g = check_positions_op(
        query, key, positions, TableArgs{&cache, nullptr, nullptr, section, mrope_interleaved},
        interleaved, inverse, true, op, "query");
    set_rope_dim_offset(g, rope_dim_offset, op);
    return g;
  };
  const RotateGeometry g = check_read_once(check, {&positions}, {&query, key ? &*key : nullptr});
  check_positions_in_range(positions, g.table.rows, op, "cos_sin_cache.size(0)");
  return g;
}

void rotate_inplace(const RotateGeometry& g, const Tensor& query, const std::optional<Tensor>& key,
                    const Tensor& positions, const Tensor& cache) {
  RotateJob job{};
  job.g = &g;
  job.src[0] = job.dst[0] = rotary_start(query, g, g.target[0].src_last);
  if (key.has_value()) job.src[1] = job.dst[1] = rotary_start(*key, g, g.target[1].src_last);
  job.cos = cache.const_data_ptr();
  job.sin = sin_of_cache(cache, g);
  job.positions = positions.const_data_ptr();
  job.table_dt = dt_index(dtype_of(cache));
  run_rotate(job, dtype_of(query));
}

void apply_inplace_cpu(Tensor query, std::optional<Tensor> key, Tensor positions,
                       Tensor cos_sin_cache, bool interleaved, int64_t rope_dim_offset,
                       bool inverse) {
  const RotateGeometry g = inplace_geometry(query, key, positions, cos_sin_cache, interleaved,
                                            nullptr, false, rope_dim_offset, inverse,
                                            "rope.apply_");
  rotate_inplace(g, query, key, positions, cos_sin_cache);
}

void mrope_inplace_cpu(Tensor query, std::optional<Tensor> key, Tensor positions,
                       Tensor cos_sin_cache, std::vector<int64_t> mrope_section, bool interleaved,
                       bool mrope_interleaved, int64_t rope_dim_offset, bool inverse) {
  const RotateGeometry g = inplace_geometry(query, key, positions, cos_sin_cache, interleaved,
                                            &mrope_section, mrope_interleaved, rope_dim_offset,
                                            inverse, "rope.mrope_");
  rotate_inplace(g, query, key, positions, cos_sin_cache);
}

// rope.apply_positions: the tables as cos and sin, or as one cos_sin_cache (tables.cache).
Tensor positions_out(const Tensor& x, const Tensor& positions, const TableArgs& tables,
                     bool interleaved, bool inverse) {
  const char* op = tables.cache != nullptr ? "rope.apply_positions.cache" : "rope.apply_positions";
  const RotateGeometry g =
      check_positions_op(x, std::nullopt, positions, tables, interleaved, inverse, false, op, "x");
  // the table the cos values are read from (the cache's first halves); its dtype is both tables'
  const Tensor& cos = tables.cache != nullptr ? *tables.cache : *tables.cos;
  check_positions_in_range(positions, g.table.rows, op,
                           tables.cache != nullptr ? "cos_sin_cache.size(0)" : "cos.size(0)");
  Tensor out = new_contiguous(x, x.sizes());
  RotateJob job = job_for(g, x, out.mutable_data_ptr(), cos, cos, nbytes(out));
  job.sin = tables.cache != nullptr ? sin_of_cache(cos, g) : tables.sin->const_data_ptr();
  job.positions = positions.const_data_ptr();
  run_rotate_new(job, out, dtype_of(x));
  return out;
}

Tensor apply_positions_cpu(Tensor x, Tensor positions, Tensor cos, Tensor sin, bool interleaved,
                           bool inverse, std::optional<std::vector<int64_t>> mrope_section,
                           bool mrope_interleaved) {
  const TableArgs tables{nullptr, &cos, &sin, mrope_section ? &*mrope_section : nullptr,
                         mrope_interleaved};
  return positions_out(x, positions, tables, interleaved, inverse);
}

Tensor apply_positions_cache_cpu(Tensor x, Tensor positions, Tensor cos_sin_cache,
                                 bool interleaved, bool inverse,
                                 std::optional<std::vector<int64_t>> mrope_section,
                                 bool mrope_interleaved) {
  const TableArgs tables{&cos_sin_cache, nullptr, nullptr,
                         mrope_section ? &*mrope_section : nullptr, mrope_interleaved};
  return positions_out(x, positions, tables, interleaved, inverse);
}

void apply_and_cache_cpu(Tensor query, Tensor key, Tensor value, Tensor positions,
                         Tensor cos_sin_cache, Tensor key_cache, Tensor value_cache,
                         Tensor slot_mapping, bool interleaved, std::string kv_cache_dtype,
                         std::optional<Tensor> k_scale, std::optional<Tensor> v_scale) {
  const char* op = "rope.apply_and_cache_";
  auto check = [&] {
    return check_apply_and_cache(query, key, value, positions, cos_sin_cache, key_cache,
                                 value_cache, slot_mapping, interleaved, kv_cache_dtype, k_scale,
                                 v_scale);
  };
  const CacheGeometry cg = check_read_once(check, {&positions, &slot_mapping},
                                           {&query, &key, &key_cache, &value_cache});
  check_positions_in_range(positions, cg.rot.table.rows, op, "cos_sin_cache.size(0)");
  check_slots(slot_mapping, cg.slots, op);
  CacheJob job = cache_store_job(cg, key, value, -1, slot_mapping, key_cache, value_cache,
                                 k_scale, v_scale);
  job.rot.g = &cg.rot;
  job.rot.src[0] = job.rot.dst[0] = query.mutable_data_ptr();
  job.rot.src[1] = job.rot.dst[1] = key.mutable_data_ptr();
  job.rot.cos = cos_sin_cache.const_data_ptr();
  job.rot.sin = sin_of_cache(cos_sin_cache, cg.rot);
  job.rot.positions = positions.const_data_ptr();
  job.rot.table_dt = dt_index(dtype_of(cos_sin_cache));
  const CacheTokensFn fn =
      selected_cpu_kernels()->cache[dt_index(dtype_of(query))][static_cast<int>(cg.format)];
  run_tokens(cg.rot, [&](int64_t b, int64_t e) { fn(job, b, e); }, work(cg.kv_heads, cg.value_dim));
}

}  // namespace
}  // namespace rope

STABLE_TORCH_LIBRARY_IMPL(rope, CPU, m) {
  ROPE_IMPL_CPU(m, "apply", &rope::apply_cpu<false>);
  ROPE_IMPL_CPU(m, "apply.out", &rope::apply_out_cpu);
  ROPE_IMPL_CPU(m, "apply_backward", &rope::apply_cpu<true>);
  ROPE_IMPL_CPU(m, "apply_", &rope::apply_inplace_cpu);
  ROPE_IMPL_CPU(m, "mrope_", &rope::mrope_inplace_cpu);
  ROPE_IMPL_CPU(m, "apply_positions", &rope::apply_positions_cpu);
  ROPE_IMPL_CPU(m, "apply_positions.cache", &rope::apply_positions_cache_cpu);
  ROPE_IMPL_CPU(m, "apply_and_cache_", &rope::apply_and_cache_cpu);
}
