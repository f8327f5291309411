// Host side of the RoPE + FP8 quantization ops, shared by the CUDA ops (cuda_ops.cpp), the
// CPU kernel (quant/cpu/quant_cpu.cpp) and the simulator: checks (quant/checks.h), the
// arguments, the launch plan (grid, block, vector path) and the dtype dispatch. The `Runner`
// launches the kernel, runs it on the CPU, or simulates every thread.
#pragma once

#include <optional>
#include <string>
#include <type_traits>

#include <torch/csrc/stable/tensor.h>

#include "../checks.h"
#include "../../cuda/rope_cuda_host.h"
#include "thread.h"

namespace rope::gpu {

#define ROPE_DISPATCH_QUANT_X(TYPE, NAME, ...)                              \
  THO_DISPATCH_SWITCH(                                                      \
      TYPE, NAME,                                                           \
      THO_DISPATCH_CASE(torch::headeronly::ScalarType::Float, __VA_ARGS__)  \
      THO_DISPATCH_CASE(torch::headeronly::ScalarType::Half, __VA_ARGS__)   \
      THO_DISPATCH_CASE(torch::headeronly::ScalarType::BFloat16, __VA_ARGS__))

// The tensors of one call; absent ones are nullptr.
struct QuantTensors {
  const Tensor *q_rope, *k_rope, *q_nope, *k_nope, *v, *cos_sin_cache, *pos_ids;
  const Tensor *q_rope_out, *k_rope_out, *q_nope_out, *k_nope_out;
  const Tensor *kc, *vc, *kv_indices, *kv_indptr, *batch_indices, *positions;
};

// Rows start on chunk boundaries (16 codes, or 16 x_t: 32 or 64 bytes), so every 16-byte access
// of the vector path is aligned. An absent operand (nullptr) constrains nothing.
inline bool quant_aligned(const void* p, const QuantRows& r) {
  const int64_t w = kQuantChunk;
  return p == nullptr || (r.last == 1 && aligned(p, kVecBytes) && r.tok % w == 0 && r.head % w == 0);
}

inline bool quant_cache_aligned(const void* p, const QuantCache& c) {
  const int64_t w = kQuantChunk;
  return c.last == 1 && aligned(p, kVecBytes) && c.page % w == 0 && c.entry % w == 0 &&
         c.head % w == 0;
}

template <typename x_t>
QuantArgs<x_t> quant_args(const QuantGeometry& g, const QuantTensors& t) {
  auto in = [](const Tensor* p) { return p ? p->const_data_ptr<x_t>() : nullptr; };
  auto out = [](const Tensor* p) { return p ? static_cast<uint8_t*>(p->mutable_data_ptr()) : nullptr; };
  auto idx = [](const Tensor* p) { return p ? p->const_data_ptr() : nullptr; };
  QuantArgs<x_t> a{};
  a.g = g;
  a.q_rope = in(t.q_rope);
  a.k_rope = in(t.k_rope);
  a.q_nope = in(t.q_nope);
  a.k_nope = in(t.k_nope);
  a.v = in(t.v);
  a.cos = static_cast<const float*>(t.cos_sin_cache->const_data_ptr());
  a.sin = a.cos != nullptr ? a.cos + g.half * g.cos_col : nullptr;  // a table of 0 rows: null
  a.pos = idx(t.pos_ids);
  a.q_rope_out = out(t.q_rope_out);
  a.k_rope_out = out(t.k_rope_out);
  a.q_nope_out = out(t.q_nope_out);
  a.k_nope_out = out(t.k_nope_out);
  a.kc = out(t.kc);
  a.vc = out(t.vc);
  a.kv_indices = idx(t.kv_indices);
  a.kv_indptr = idx(t.kv_indptr);
  a.batch_indices = idx(t.batch_indices);
  a.positions = idx(t.positions);
  const int64_t per = quant_pairs_per_chunk(g.interleaved);
  a.rope_chunks = ceil_div(g.half, per);
  a.nope_chunks = ceil_div(g.nope, kQuantChunk);
  a.v_chunks = g.paged && !g.mla ? ceil_div(2 * g.half + g.nope, kQuantChunk) : 0;
  // The vector path: every row of every operand starts on a 16-byte boundary with unit stride,
  // and every dim (and, half-split, the pair distance) is a multiple of the chunk.
  const int64_t w = kQuantChunk;
  bool vec = (g.interleaved ? (2 * g.half) % w == 0 : g.half % w == 0) && g.nope % w == 0;
  const std::pair<const void*, const QuantRows*> rows[] = {
      {a.q_rope, &g.q_rope},         {a.k_rope, &g.k_rope},         {a.q_nope, &g.q_nope},
      {a.k_nope, &g.k_nope},         {a.v, &g.v},                   {a.q_rope_out, &g.q_rope_out},
      {a.k_rope_out, &g.k_rope_out}, {a.q_nope_out, &g.q_nope_out}, {a.k_nope_out, &g.k_nope_out}};
  for (const auto& [p, r] : rows) vec = vec && quant_aligned(p, *r);
  if (g.paged) vec = vec && quant_cache_aligned(a.kc, g.kc) && quant_cache_aligned(a.vc, g.vc);
  a.vec = vec;
  return a;
}

// Plans the launch and hands (plan, args) to the runner.
template <class Runner>
void run_quant(const QuantGeometry& g, const QuantTensors& t, Runner&& run,
               int64_t max_blocks = kMaxBlocks) {
  if (g.tokens == 0) return;
  ROPE_DISPATCH_QUANT_X(dtype_of(*t.q_rope), "rope_quant", [&] {
    QuantArgs<scalar_t> a = quant_args<scalar_t>(g, t);
    // Each cache entry written at most once: on the device (the CPU runner checks on the host).
    if constexpr (std::decay_t<Runner>::kDeviceDataChecks) {
      if (g.paged && g.tokens >= 2) {
        const SlotSet set = new_slot_set(*t.q_rope, g.tokens, max_blocks);
        run(set.plan, PagedSlotSetArgs{g, paged_table(a), set.mask, set.data()});
      }
    }
    const int64_t chunks = std::max({a.rope_chunks, a.nope_chunks, a.v_chunks});
    const int64_t rows = quant_rows<scalar_t>(g);
    // Rows of 0 elements still run: each token's positions are checked (the reference refuses
    // a position outside the table whatever the rows' widths), and nothing is written.
    LaunchPlan p;
    p.rot_chunks = a.rope_chunks;
    p.tail_chunks = chunks - a.rope_chunks;
    p.vec = a.vec;
    plan_block(p, chunks, rows, g.tokens, max_blocks);
    run(p, a);
  });
}

template <class Runner>
void quantize_host(const Tensor& q_rope, const Tensor& k_rope, const Tensor& q_nope,
                   const Tensor& k_nope, const Tensor& cos_sin_cache, const Tensor& pos_ids,
                   const Tensor& q_rope_out, const Tensor& k_rope_out, const Tensor& q_nope_out,
                   const Tensor& k_nope_out, double scale_q, double scale_kv, bool interleaved,
                   Runner&& run, int64_t max_blocks = kMaxBlocks) {
  const QuantGeometry g = check_quantize(q_rope, k_rope, q_nope, k_nope, cos_sin_cache, pos_ids,
                                         q_rope_out, k_rope_out, q_nope_out, k_nope_out, scale_q,
                                         scale_kv, interleaved);
  const QuantTensors t{&q_rope, &k_rope, &q_nope, &k_nope, nullptr, &cos_sin_cache, &pos_ids,
                       &q_rope_out, &k_rope_out, &q_nope_out, &k_nope_out, nullptr, nullptr,
                       nullptr, nullptr, nullptr, nullptr};
  run_quant(g, t, run, max_blocks);
}

template <class Runner>
void quantize_paged_host(const Tensor& q_rope, const Tensor& k_rope, const Tensor& q_nope,
                         const Tensor& k_nope, const std::optional<Tensor>& v,
                         const Tensor& cos_sin_cache, const Tensor& pos_ids,
                         const Tensor& q_rope_out, const Tensor& q_nope_out, const Tensor& k_cache,
                         const Tensor& v_cache, const Tensor& kv_indices, const Tensor& kv_indptr,
                         const Tensor& batch_indices, const Tensor& positions, int64_t page_size,
                         const std::string& kv_layout, double scale_q, double scale_kv,
                         bool interleaved, Runner&& run, int64_t max_blocks = kMaxBlocks) {
  const QuantGeometry g = check_paged(q_rope, k_rope, q_nope, k_nope, v, cos_sin_cache, pos_ids,
                                      q_rope_out, q_nope_out, k_cache, v_cache, kv_indices,
                                      kv_indptr, batch_indices, positions, page_size, kv_layout,
                                      scale_q, scale_kv, interleaved);
  const QuantTensors t{&q_rope, &k_rope, &q_nope, &k_nope, v ? &*v : nullptr, &cos_sin_cache,
                       &pos_ids, &q_rope_out, nullptr, &q_nope_out, nullptr, &k_cache, &v_cache,
                       &kv_indices, &kv_indptr, &batch_indices, &positions};
  run_quant(g, t, run, max_blocks);
}

// The two ops with their schemas' arguments, registered by the CPU and the CUDA library: each
// gives its `Runner`, built from the first input and the op's name.
template <class Runner>
void quantize_fp8_op(Tensor q_rope, Tensor k_rope, Tensor q_nope, Tensor k_nope,
                     Tensor cos_sin_cache, Tensor pos_ids, Tensor q_rope_out, Tensor k_rope_out,
                     Tensor q_nope_out, Tensor k_nope_out, double quant_scale_q,
                     double quant_scale_kv, bool interleaved) {
  quantize_host(q_rope, k_rope, q_nope, k_nope, cos_sin_cache, pos_ids, q_rope_out, k_rope_out,
                q_nope_out, k_nope_out, quant_scale_q, quant_scale_kv, interleaved,
                Runner(q_rope, "rope.quantize_fp8"));
}

template <class Runner>
void quantize_fp8_paged_op(Tensor q_rope, Tensor k_rope, Tensor q_nope, Tensor k_nope,
                           std::optional<Tensor> v, Tensor cos_sin_cache, Tensor pos_ids,
                           Tensor q_rope_out, Tensor q_nope_out, Tensor k_cache, Tensor v_cache,
                           Tensor kv_indices, Tensor kv_indptr, Tensor batch_indices,
                           Tensor positions, int64_t page_size, std::string kv_layout,
                           double quant_scale_q, double quant_scale_kv, bool interleaved) {
  quantize_paged_host(q_rope, k_rope, q_nope, k_nope, v, cos_sin_cache, pos_ids, q_rope_out,
                      q_nope_out, k_cache, v_cache, kv_indices, kv_indptr, batch_indices,
                      positions, page_size, kv_layout, quant_scale_q, quant_scale_kv, interleaved,
                      Runner(q_rope, "rope.quantize_fp8_append_paged_kv_cache"));
}

}  // namespace rope::gpu
