// CPU simulator of the CUDA kernels (test only; built by tests/cuda_sim.py with g++).
//
// The ops rope_sim::apply and rope_sim::apply_ run the CUDA ops' host code (rope_cuda_host.h:
// checks, table casts, launch plan, dispatch) on CPU tensors, but instead of launching a kernel
// they call the kernel's per-thread function (rope_cuda_thread.h) for every (blockIdx, threadIdx)
// of the planned grid. Every memory access goes through an instrumented load/store, and the
// simulator proves for the run that:
//   - every access lies inside the elements of the view it belongs to (reads: inputs, tables,
//     positions; writes: the output, or the rotary dims of query/key rows),
//   - every vector access is aligned to its size,
//   - every output element is written exactly once, by one thread, and no element another
//     thread writes is touched by a second thread (no races),
//   - in place: exactly the rotary dims of tokens with an in-range position are written.
// `info` (int64, 12) reports the plan and counters so tests can see which path ran.
#include <cstdint>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <unordered_map>
#include <vector>

#include <torch/csrc/stable/library.h>

#include "ops/cuda/rope_cuda_host.h"

namespace rope::sim {
namespace {

enum Perm : uint8_t { kRead = 1, kWrite = 2 };

struct ElementState {
  uint8_t perm = 0;
  int64_t elem_bytes = 0;
  int64_t first_thread = -1;  // first thread that touched it
  int64_t writes = 0;
  bool shared = false;  // touched by a second thread
};

struct Recorder {
  std::unordered_map<uintptr_t, ElementState> elems;
  int64_t thread = 0;
  int64_t vector_accesses = 0, scalar_accesses = 0;
  std::ostringstream errors;
  int64_t error_count = 0;

  void fail(const std::string& what) {
    if (error_count++ < 8) errors << what << "\n";
  }

  template <typename T>
  void allow(const T* p, uint8_t perm) {
    auto& e = elems[reinterpret_cast<uintptr_t>(p)];
    e.perm |= perm;
    e.elem_bytes = sizeof(T);
  }
};

Recorder* g_rec = nullptr;

}  // namespace

bool on_access(const void* p, size_t bytes, size_t elem_bytes, size_t align, bool is_write) {
  Recorder& r = *g_rec;
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  bool ok = true;
  (bytes > elem_bytes ? r.vector_accesses : r.scalar_accesses)++;
  if (a % align != 0) {
    std::ostringstream s;
    s << "misaligned " << bytes << "-byte access at " << p << " (needs " << align << ") by thread "
      << r.thread;
    r.fail(s.str());
    ok = false;
  }
  for (size_t o = 0; o < bytes; o += elem_bytes) {
    auto it = r.elems.find(a + o);
    if (it == r.elems.end() || it->second.elem_bytes != static_cast<int64_t>(elem_bytes)) {
      std::ostringstream s;
      s << (is_write ? "write" : "read") << " outside every operand at " << (const void*)(a + o)
        << " by thread " << r.thread;
      r.fail(s.str());
      ok = false;
      continue;
    }
    ElementState& e = it->second;
    if (!(e.perm & (is_write ? kWrite : kRead))) {
      std::ostringstream s;
      s << (is_write ? "write to a read-only" : "read of a write-only") << " element at "
        << (const void*)(a + o) << " by thread " << r.thread;
      r.fail(s.str());
      ok = false;
    }
    if (e.perm & kWrite) {  // only elements someone may write can race
      if (e.first_thread < 0) e.first_thread = r.thread;
      if (e.first_thread != r.thread) e.shared = true;
    }
    if (is_write) ++e.writes;
  }
  return ok;  // a bad access is reported, not performed
}

namespace {

using gpu::ApplyArgs;
using gpu::Bool;
using gpu::InplaceArgs;
using gpu::LaunchPlan;
using gpu::ThreadPos;
using torch::stable::Tensor;

// Calls f(ThreadPos) for every thread of the grid, in block order.
template <class F>
void run_grid(const LaunchPlan& p, Recorder& rec, F&& f) {
  const int64_t threads = int64_t{p.block.x} * p.block.y * p.block.z;
  STD_TORCH_CHECK(threads >= 1 && threads <= 512, "sim: block of ", threads,
                  " threads exceeds the kernels' __launch_bounds__(512)");
  STD_TORCH_CHECK(p.grid.x >= 1 && p.grid.y == 1 && p.grid.z == 1, "sim: bad grid");
  ThreadPos tp;
  tp.block_dim = p.block;
  tp.grid_dim = p.grid;
  for (unsigned bx = 0; bx < p.grid.x; ++bx) {
    for (unsigned tz = 0; tz < p.block.z; ++tz) {
      for (unsigned ty = 0; ty < p.block.y; ++ty) {
        for (unsigned tx = 0; tx < p.block.x; ++tx) {
          tp.block = {bx, 0, 0};
          tp.thread = {tx, ty, tz};
          rec.thread = bx * threads + (int64_t{tz} * p.block.y + ty) * p.block.x + tx;
          f(tp);
        }
      }
    }
  }
}

void fill_info(Tensor& info, const LaunchPlan& p, const Recorder& rec) {
  STD_TORCH_CHECK(info.scalar_type() == torch::headeronly::ScalarType::Long && info.numel() == 12 &&
                      info.is_contiguous(),
                  "sim: info must be a contiguous int64 tensor of 12 elements");
  int64_t* o = info.mutable_data_ptr<int64_t>();
  const int64_t v[12] = {p.vec,         p.idx32,        p.grid.x,        p.block.x,
                         p.block.y,     p.block.z,      p.rot_chunks,    p.tail_chunks,
                         rec.vector_accesses, rec.scalar_accesses, 0, 0};
  for (int i = 0; i < 12; ++i) o[i] = v[i];
}

void raise_if_failed(const Recorder& rec, const char* op) {
  STD_TORCH_CHECK(rec.error_count == 0, op, ": simulated kernel made ", rec.error_count,
                  " bad accesses, first ones:\n", rec.errors.str());
}

// One simulated launch: installs a fresh Recorder for the element hooks (g_rec) and removes it
// however the host code exits (a rejected call throws); finish() raises on any bad access and
// reports the launch plan in `info`.
struct SimRun {
  Recorder rec;
  LaunchPlan plan;
  SimRun() { g_rec = &rec; }
  ~SimRun() { g_rec = nullptr; }
  SimRun(const SimRun&) = delete;
  SimRun& operator=(const SimRun&) = delete;
  void finish(const char* op, Tensor& info) {
    g_rec = nullptr;
    raise_if_failed(rec, op);
    fill_info(info, plan, rec);
  }
};

struct ApplySim {
  Recorder& rec;
  bool force_idx64;
  LaunchPlan* plan_out;
  template <typename x_t, typename tab_t, bool kI, bool kInv, bool kVec>
  void operator()(const LaunchPlan& plan, ApplyArgs<x_t, tab_t> a, Bool<kI>, Bool<kInv>,
                  Bool<kVec>) const {
    LaunchPlan p = plan;
    if (force_idx64) a.idx32 = p.idx32 = false;
    *plan_out = p;
    // The operands' elements, from the geometry the CPU kernels also use (LeadIndexer).
    const ApplyGeometry& g = a.g;
    for (int64_t row = 0; row < g.rows; ++row) {
      int64_t off[kMaxOperands];
      g.lead.offsets(row, off);
      for (int64_t j = 0; j < g.head_dim; ++j) {
        rec.allow(a.x + off[0] + j * g.x_last, kRead);
        rec.allow(a.out + row * g.head_dim + j, kWrite);
      }
      for (int64_t i = 0; i < g.half; ++i) {
        rec.allow(a.cos + off[1] + i * g.cos_last, kRead);
        rec.allow(a.sin + off[2] + i * g.sin_last, kRead);
      }
    }
    run_grid(p, rec, [&](const ThreadPos& tp) {
      gpu::apply_thread<x_t, tab_t, kI, kInv, kVec>(a, tp);
    });
    for (int64_t row = 0; row < g.rows; ++row) {
      for (int64_t j = 0; j < g.head_dim; ++j) {
        const ElementState& e = rec.elems[reinterpret_cast<uintptr_t>(a.out + row * g.head_dim + j)];
        if (e.writes != 1) {
          std::ostringstream s;
          s << "out[row " << row << ", " << j << "] written " << e.writes << " times";
          rec.fail(s.str());
        }
        if (e.shared) rec.fail("an output element was touched by two threads");
      }
    }
  }
};

Tensor sim_apply(Tensor x, Tensor cos, Tensor sin, bool interleaved, bool inverse,
                 int64_t max_blocks, bool force_idx64, Tensor info) {
  STD_TORCH_CHECK(x.is_cpu(), "sim: CPU tensors only");
  SimRun sim;
  const ApplySim run{sim.rec, force_idx64, &sim.plan};
  Tensor out = inverse ? gpu::apply_host<true>(x, cos, sin, interleaved, run, max_blocks)
                       : gpu::apply_host<false>(x, cos, sin, interleaved, run, max_blocks);
  sim.finish("rope_sim.apply", info);
  return out;
}

// rope.apply.out through the same host code as the CUDA kernel (apply_out_host): validation,
// and a plan for the caller's `out`, whose address may not be vector-aligned.
void sim_apply_out(Tensor x, Tensor cos, Tensor sin, bool interleaved, int64_t max_blocks,
                   bool force_idx64, Tensor info, Tensor out) {
  STD_TORCH_CHECK(x.is_cpu(), "sim: CPU tensors only");
  SimRun sim;
  gpu::apply_out_host(x, cos, sin, interleaved, out, ApplySim{sim.rec, force_idx64, &sim.plan},
                      max_blocks);
  sim.finish("rope_sim.apply_out", info);
}

struct InplaceSim {
  Recorder& rec;
  bool force_idx64;
  LaunchPlan* plan_out;
  template <typename x_t, typename tab_t, bool kI, bool kVec>
  void operator()(const LaunchPlan& plan, InplaceArgs<x_t, tab_t> a, Bool<kI>, Bool<kVec>) const {
    LaunchPlan p = plan;
    if (force_idx64) a.idx32 = p.idx32 = false;
    *plan_out = p;
    const InplaceGeometry& g = a.g;
    const int64_t heads = g.q_heads + g.k_heads;
    auto row_of = [&](const int64_t off[], int64_t h, int64_t& st) {
      st = h < g.q_heads ? g.q_last : g.k_last;
      return h < g.q_heads ? a.q + off[0] + h * g.q_head_stride
                           : a.k + off[1] + (h - g.q_heads) * g.k_head_stride;
    };
    for (int64_t p0 = 0; p0 < g.max_position; ++p0) {
      for (int64_t j = 0; j < 2 * g.half; ++j) {
        rec.allow(a.cache + p0 * g.cache_row_stride + j * g.cache_col_stride, kRead);
      }
    }
    for (int64_t t = 0; t < g.tokens; ++t) {
      int64_t off[kMaxOperands];
      g.lead.offsets(t, off);
      if (a.pos64) {
        rec.allow(static_cast<const int64_t*>(a.pos) + off[2], kRead);
      } else {
        rec.allow(static_cast<const int32_t*>(a.pos) + off[2], kRead);
      }
      for (int64_t h = 0; h < heads; ++h) {
        int64_t st;
        x_t* row = row_of(off, h, st);
        for (int64_t j = 0; j < 2 * g.half; ++j) rec.allow(row + j * st, kRead | kWrite);
      }
    }
    // Positions as the kernel will see them (read before the run, which changes only q/k).
    std::vector<int64_t> pos(g.tokens);
    for (int64_t t = 0; t < g.tokens; ++t) {
      int64_t off[kMaxOperands];
      g.lead.offsets(t, off);
      pos[t] = a.pos64 ? static_cast<const int64_t*>(a.pos)[off[2]]
                       : static_cast<const int32_t*>(a.pos)[off[2]];
    }
    run_grid(p, rec, [&](const ThreadPos& tp) {
      gpu::apply_inplace_thread<x_t, tab_t, kI, kVec>(a, tp);
    });
    for (int64_t t = 0; t < g.tokens; ++t) {
      int64_t off[kMaxOperands];
      g.lead.offsets(t, off);
      const int64_t want = (pos[t] >= 0 && pos[t] < g.max_position) ? 1 : 0;
      for (int64_t h = 0; h < heads; ++h) {
        int64_t st;
        x_t* row = row_of(off, h, st);
        for (int64_t j = 0; j < 2 * g.half; ++j) {
          const ElementState& e = rec.elems[reinterpret_cast<uintptr_t>(row + j * st)];
          if (e.writes != want) {
            std::ostringstream s;
            s << "token " << t << " head " << h << " dim " << j << " written " << e.writes
              << " times, expected " << want;
            rec.fail(s.str());
          }
          if (e.shared) rec.fail("a query/key element was touched by two threads");
        }
      }
    }
  }
};

void sim_apply_inplace(Tensor query, std::optional<Tensor> key, Tensor positions,
                       Tensor cos_sin_cache, bool interleaved, int64_t max_blocks,
                       bool force_idx64, Tensor info) {
  STD_TORCH_CHECK(query.is_cpu(), "sim: CPU tensors only");
  SimRun sim;
  gpu::apply_inplace_host(query, key, positions, cos_sin_cache, interleaved,
                          InplaceSim{sim.rec, force_idx64, &sim.plan}, max_blocks);
  sim.finish("rope_sim.apply_", info);
}

}  // namespace
}  // namespace rope::sim

STABLE_TORCH_LIBRARY(rope_sim, m) {
  m.def(
      "apply(Tensor x, Tensor cos, Tensor sin, bool interleaved, bool inverse, int max_blocks, "
      "bool force_idx64, Tensor(a!) info) -> Tensor");
  m.def(
      "apply_out(Tensor x, Tensor cos, Tensor sin, bool interleaved, int max_blocks, "
      "bool force_idx64, Tensor(a!) info, Tensor(b!) out) -> ()");
  m.def(
      "apply_(Tensor(a!) query, Tensor(b!)? key, Tensor positions, Tensor cos_sin_cache, "
      "bool interleaved, int max_blocks, bool force_idx64, Tensor(c!) info) -> ()");
}

STABLE_TORCH_LIBRARY_IMPL(rope_sim, CPU, m) {
  m.impl("apply", TORCH_BOX(&rope::sim::sim_apply));
  m.impl("apply_out", TORCH_BOX(&rope::sim::sim_apply_out));
  m.impl("apply_", TORCH_BOX(&rope::sim::sim_apply_inplace));
}
