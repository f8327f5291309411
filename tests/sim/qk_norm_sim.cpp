// CPU simulator of the fused QK-RMSNorm + RoPE CUDA kernels (test only; built by
// tests/qk_norm_sim.py with g++).
//
// The ops rope_qk_sim::* run the CUDA ops' own host code (csrc/ops/cuda/qk_norm_rope_host.h:
// checks, positions read once, table and weight casts, launch plan, dispatch) on CPU tensors and
// call the kernel's per-thread function (qk_norm_rope_thread.h) for every thread of the planned
// grid, each access through an instrumented load/store. It proves for the run that every access
// lies inside the elements of its operand (rows of query/key or x, the weights, the table rows,
// the positions) with the right permission and alignment, that every output element is written
// exactly once by one thread, and reports a failed device check (a position out of range) as the
// kernel's trap. `info` (int64, 4): vector path, grid, vector accesses, scalar accesses.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <torch/csrc/stable/library.h>

#include "ops/cuda/qk_norm_rope_host.h"
#include "sim_recorder.inc"

namespace rope::sim {
namespace {

using gpu::Bool;
using gpu::NormRopeArgs;
using torch::stable::Tensor;

template <typename x_t, typename tab_t>
void allow_operands(Recorder& rec, const NormRopeArgs<x_t, tab_t>& a) {
  using acc_t = opmath_t<x_t>;
  const RotateGeometry& g = a.g;
  for (int k = 0; k < g.targets; ++k) {
    for (int64_t j = 0; j < g.head_dim; ++j) {
      rec.allow(a.w[k] + j * a.norm.w_stride[k], sizeof(acc_t), kRead);
    }
  }
  for (int64_t tok = 0; tok < g.tokens; ++tok) {
    int64_t off[kMaxOperands];
    g.lead.offsets(tok, off);
    for (int k = 0; k < g.targets; ++k) {
      const TargetDesc& t = g.target[k];
      for (int64_t h = 0; h < t.heads; ++h) {
        for (int64_t j = 0; j < g.head_dim; ++j) {
          rec.allow(a.src[k] + off[2 * k] + h * t.src_head + j * t.src_last, sizeof(x_t), kRead);
          rec.allow(a.dst[k] + off[2 * k + 1] + h * t.dst_head + j * t.dst_last, sizeof(x_t),
                    kWrite | kMustWrite);
        }
      }
    }
    allow_token_tables(rec, g, a.cos, a.sin, a.pos, off);
  }
  allow_gathered_tables(rec, g, a.cos, a.sin);
}

struct SimRunner {
  const char* op;
  Tensor* info;

  template <typename x_t, typename tab_t, bool kI>
  void operator()(const LaunchPlan& p, const NormRopeArgs<x_t, tab_t>& a, Bool<kI>) const {
    Recorder rec;
    simulate_launch(rec, p, op, [&](Recorder& r) { allow_operands(r, a); },
                    [&](const ThreadPos& tp) { gpu::norm_rope_thread<x_t, tab_t, kI>(a, tp); });
    int64_t* o = info->mutable_data_ptr<int64_t>();
    o[0] += p.vec;
    o[1] = p.grid.x;
    o[2] += rec.vector_accesses;
    o[3] += rec.scalar_accesses;
  }
};

void check_info(const Tensor& info) {
  ROPE_CHECK(info.scalar_type() == ScalarType::Long && info.numel() == 4 && info.is_contiguous(),
             "sim: info must be a contiguous int64 tensor of 4 elements");
}

std::tuple<Tensor, Tensor> qk_norm_rope_sim(Tensor query, Tensor key, Tensor q_weight,
                                            Tensor k_weight, Tensor cos, Tensor sin, double eps,
                                            bool unit_offset, bool interleaved, int64_t max_blocks,
                                            Tensor info) {
  check_info(info);
  return gpu::qk_norm_rope_host(query, key, q_weight, k_weight, cos, sin, eps, unit_offset,
                                interleaved, SimRunner{"rope_qk_sim.qk_norm_rope", &info},
                                max_blocks);
}

void qk_norm_rope_inplace_sim(Tensor query, Tensor key, Tensor q_weight, Tensor k_weight,
                              Tensor positions, Tensor cache, double eps, bool unit_offset,
                              bool interleaved, std::optional<std::vector<int64_t>> section,
                              bool mrope_interleaved, int64_t max_blocks, Tensor info) {
  check_info(info);
  gpu::qk_norm_rope_inplace_host(query, key, &query, &key, q_weight, k_weight, positions, cache,
                                 eps, unit_offset, interleaved, section ? &*section : nullptr,
                                 mrope_interleaved, kQkNormInplaceOp,
                                 SimRunner{"rope_qk_sim.qk_norm_rope_", &info}, max_blocks);
}

void qkv_norm_rope_inplace_sim(Tensor qkv, int64_t hq, int64_t hk, int64_t hv, int64_t head_dim,
                               Tensor q_weight, Tensor k_weight, Tensor positions, Tensor cache,
                               double eps, bool unit_offset, bool interleaved,
                               std::optional<std::vector<int64_t>> section,
                               bool mrope_interleaved, int64_t max_blocks, Tensor info) {
  check_info(info);
  const auto [q, k] = qkv_views(qkv, hq, hk, hv, head_dim);
  gpu::qk_norm_rope_inplace_host(q, k, &qkv, nullptr, q_weight, k_weight, positions, cache, eps,
                                 unit_offset, interleaved, section ? &*section : nullptr,
                                 mrope_interleaved, kQkvNormOp,
                                 SimRunner{"rope_qk_sim.qkv_norm_rope_", &info}, max_blocks);
}

}  // namespace
}  // namespace rope::sim

STABLE_TORCH_LIBRARY(rope_qk_sim, m) {
  m.def("qk_norm_rope(Tensor query, Tensor key, Tensor q_weight, Tensor k_weight, Tensor cos, "
        "Tensor sin, float eps, bool unit_offset, bool interleaved, int max_blocks, "
        "Tensor(a!) info) -> (Tensor, Tensor)");
  m.def("qk_norm_rope_(Tensor(a!) query, Tensor(b!) key, Tensor q_weight, Tensor k_weight, "
        "Tensor positions, Tensor cos_sin_cache, float eps, bool unit_offset, bool interleaved, "
        "int[]? mrope_section, bool mrope_interleaved, int max_blocks, Tensor(c!) info) -> ()");
  m.def("qkv_norm_rope_(Tensor(a!) qkv, int num_heads_q, int num_heads_k, int num_heads_v, "
        "int head_dim, Tensor q_weight, Tensor k_weight, Tensor positions, Tensor cos_sin_cache, "
        "float eps, bool unit_offset, bool interleaved, int[]? mrope_section, "
        "bool mrope_interleaved, int max_blocks, Tensor(b!) info) -> ()");
}

STABLE_TORCH_LIBRARY_IMPL(rope_qk_sim, CPU, m) {
  m.impl("qk_norm_rope", TORCH_BOX(&rope::sim::qk_norm_rope_sim));
  m.impl("qk_norm_rope_", TORCH_BOX(&rope::sim::qk_norm_rope_inplace_sim));
  m.impl("qkv_norm_rope_", TORCH_BOX(&rope::sim::qkv_norm_rope_inplace_sim));
}
