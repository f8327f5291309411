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
#include <sstream>
#include <string>
#include <unordered_map>
#include <vector>

#include <torch/csrc/stable/library.h>

#include "ops/cuda/qk_norm_rope_host.h"

namespace rope::sim {
namespace {

enum Perm : uint8_t { kRead = 1, kWrite = 2, kMustWrite = 4 };

struct Element {
  uint8_t perm = 0;
  int64_t bytes = 0;
  int64_t writer = -1;
  int64_t writes = 0;
  bool shared = false;
};

struct Recorder {
  std::unordered_map<uintptr_t, Element> elems;
  int64_t thread = 0, vector_accesses = 0, scalar_accesses = 0, errors = 0;
  std::ostringstream log;
  std::string trap;

  void fail(const std::string& what) {
    if (errors++ < 8) log << what << "\n";
  }
  void allow(const void* p, int64_t bytes, uint8_t perm) {
    Element& e = elems[reinterpret_cast<uintptr_t>(p)];
    e.perm |= perm;
    e.bytes = bytes;
  }
};

Recorder* g_rec = nullptr;

}  // namespace

bool on_access(const void* p, size_t bytes, size_t elem_bytes, size_t align, bool is_write) {
  Recorder& r = *g_rec;
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  (bytes > elem_bytes ? r.vector_accesses : r.scalar_accesses)++;
  bool ok = true;
  if (a % align != 0) {
    r.fail("misaligned access by thread " + std::to_string(r.thread));
    ok = false;
  }
  for (size_t o = 0; o < bytes; o += elem_bytes) {
    auto it = r.elems.find(a + o);
    if (it == r.elems.end() || it->second.bytes != static_cast<int64_t>(elem_bytes)) {
      r.fail(std::string(is_write ? "write" : "read") + " outside every operand by thread " +
             std::to_string(r.thread));
      ok = false;
      continue;
    }
    Element& e = it->second;
    if (!(e.perm & (is_write ? kWrite : kRead))) {
      r.fail(std::string(is_write ? "write to a read-only" : "read of a write-only") +
             " element by thread " + std::to_string(r.thread));
      ok = false;
    }
    if (e.perm & kWrite) {
      if (e.writer < 0) e.writer = r.thread;
      if (e.writer != r.thread) e.shared = true;
    }
    if (is_write) ++e.writes;
  }
  return ok;
}

void on_trap(const char* what) {
  if (g_rec->trap.empty()) g_rec->trap = what;
}

namespace {

using gpu::Bool;
using gpu::LaunchPlan;
using gpu::NormRopeArgs;
using gpu::ThreadPos;
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
    const TableDesc& d = g.table;
    if (d.kind == TableKind::kStrided) {
      for (int64_t i = 0; i < g.half; ++i) {
        rec.allow(a.cos + off[kTab0] + i * d.cos_col, sizeof(tab_t), kRead);
        rec.allow(a.sin + off[kTab1] + i * d.sin_col, sizeof(tab_t), kRead);
      }
    } else {
      const int n = d.kind == TableKind::kMrope ? kMropeComponents : 1;
      for (int j = 0; j < n; ++j) {
        const int64_t e = off[kTab0] + j * d.pos_component;
        if (d.pos64) {
          rec.allow(static_cast<const int64_t*>(a.pos) + e, 8, kRead);
        } else {
          rec.allow(static_cast<const int32_t*>(a.pos) + e, 4, kRead);
        }
      }
    }
  }
  if (g.table.kind != TableKind::kStrided) {
    for (int64_t p = 0; p < g.table.rows; ++p) {
      for (int64_t i = 0; i < g.half; ++i) {
        rec.allow(a.cos + p * g.table.cos_row + i * g.table.cos_col, sizeof(tab_t), kRead);
        rec.allow(a.sin + p * g.table.sin_row + i * g.table.sin_col, sizeof(tab_t), kRead);
      }
    }
  }
}

struct SimRunner {
  const char* op;
  Tensor* info;

  template <typename x_t, typename tab_t, bool kI>
  void operator()(const LaunchPlan& p, const NormRopeArgs<x_t, tab_t>& a, Bool<kI>) const {
    Recorder rec;
    g_rec = &rec;
    struct Reset {
      ~Reset() { g_rec = nullptr; }
    } reset;
    allow_operands(rec, a);
    ThreadPos tp;
    tp.block_dim = p.block;
    tp.grid_dim = p.grid;
    for (unsigned b = 0; b < p.grid.x; ++b) {
      for (unsigned t = 0; t < p.block.x; ++t) {
        tp.block = {b, 0, 0};
        tp.thread = {t, 0, 0};
        rec.thread = int64_t{b} * p.block.x + t;
        gpu::norm_rope_thread<x_t, tab_t, kI>(a, tp);
      }
    }
    for (const auto& [addr, e] : rec.elems) {
      if ((e.perm & kMustWrite) && e.writes != 1) {
        rec.fail("an output element was written " + std::to_string(e.writes) + " times");
      }
      if (e.shared) rec.fail("an output element was touched by two threads");
    }
    ROPE_CHECK(rec.trap.empty(), op, ": device-side assert triggered: ", rec.trap);
    ROPE_CHECK(rec.errors == 0, op, ": simulated kernel made ", rec.errors,
               " bad accesses, first ones:\n", rec.log.str());
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
