// CPU simulator of the CUDA kernels (test only; built by tests/cuda_sim.py with g++).
//
// The ops rope_sim::* run the CUDA ops' own host code (csrc/ops/cuda/rope_cuda_host.h: checks,
// positions read once, table dtypes, launch plan, dispatch) on CPU tensors, but instead of
// launching a kernel they call its per-thread function (rope_cuda_thread.h) for every
// (blockIdx, threadIdx) of the planned grid. Every memory access goes through an instrumented
// load/store, and the simulator proves for the run that:
//   - every access lies inside the elements of the operand it belongs to (reads: inputs, tables,
//     positions, slots, scales; writes: the outputs, the rotary dims of in-place rows, the cache
//     rows of the slots used),
//   - every vector access is aligned to its size,
//   - every output element is written exactly once, by one thread (no races), and in place only
//     the rotary dims are written,
//   - a device-side check (position or slot out of range) is reported as the kernel's trap.
// `info` (int64, 12) reports the plan and counters so tests can see which path ran.
// The RoPE + FP8 quantization and fused QK-RMSNorm + RoPE kernels are simulated in quant_sim.inc
// and qk_norm_sim.inc, part of this translation unit and of its one library (info: their own).
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <torch/csrc/stable/library.h>

#include "ops/cuda/rope_cuda_host.h"
#include "ops/kv_shift/cuda/host.h"
#include "sim_recorder.inc"

namespace rope::sim {
namespace {

using gpu::Bool;
using gpu::CacheArgs;
using gpu::RotateArgs;
using torch::stable::Tensor;

// The operand elements of a RotateGeometry, registered with their permissions. Each element is
// marked with the strongest access any operand needs (an in-place row is read and written).
template <typename x_t, typename tab_t>
void allow_rotate_operands(Recorder& rec, const RotateArgs<x_t, tab_t>& a) {
  const RotateGeometry& g = a.g;
  const int64_t write_end = g.copy_tail ? g.head_dim : 2 * g.half;
  for (int64_t tok = 0; tok < g.tokens; ++tok) {
    int64_t off[kMaxOperands];
    g.lead.offsets(tok, off);
    for (int k = 0; k < g.targets; ++k) {
      const TargetDesc& t = g.target[k];
      for (int64_t h = 0; h < t.heads; ++h) {
        // The row's elements: the host bound the row at rot_offset (in place with an offset).
        for (int64_t j = -g.rot_offset; j < g.head_dim - g.rot_offset; ++j) {
          rec.allow(a.src[k] + off[2 * k] + h * t.src_head + j * t.src_last, sizeof(x_t), kRead);
        }
        for (int64_t j = 0; j < write_end; ++j) {
          rec.allow(a.dst[k] + off[2 * k + 1] + h * t.dst_head + j * t.dst_last, sizeof(x_t),
                    kWrite | kMustWrite);
        }
      }
    }
    allow_token_tables(rec, g, a.cos, a.sin, a.pos, off);
  }
  allow_gathered_tables(rec, g, a.cos, a.sin);
}

// The paged-cache store stage of every op that ends in the caches: each token's slot read; its
// value rows read (and written once, when the op norms them in place); the key and value cache
// rows of the slots used written once each; the scales read (float8).
template <typename x_t>
void allow_paged_store(Recorder& rec, const CacheDesc& cg, int64_t tokens, int64_t head_dim,
                       const x_t* value, const x_t* value_out, const void* slots,
                       const void* key_cache, const void* value_cache, const float* k_scale,
                       const float* v_scale) {
  const int64_t es = cg.format == CacheFormat::kSame ? sizeof(x_t) : 1;
  const bool in_place = value_out == value;  // (value rows written in place: v_norm)
  const uint8_t value_perm = in_place ? kRead | kWrite | kMustWrite : kRead;
  for (int64_t tok = 0; tok < tokens; ++tok) {
    const char* sp = static_cast<const char*>(slots) + tok * cg.slot_stride * (cg.slots64 ? 8 : 4);
    rec.allow(sp, cg.slots64 ? 8 : 4, kRead);
    const int64_t slot = cg.slots64 ? *reinterpret_cast<const int64_t*>(sp)
                                    : *reinterpret_cast<const int32_t*>(sp);
    for (int64_t h = 0; h < cg.kv_heads; ++h) {
      for (int64_t j = 0; j < cg.value_dim; ++j) {
        rec.allow(value + tok * cg.v_token + h * cg.v_head + j * cg.v_last, sizeof(x_t), value_perm);
        if (value_out != nullptr && !in_place) {
          rec.allow(value_out + tok * cg.vo_token + h * cg.vo_head + j * cg.vo_last, sizeof(x_t),
                    kWrite | kMustWrite);
        }
      }
      if (slot < 0 || slot >= cg.slots) continue;
      // Written out here, not with CacheStrides::slot_row: an independent statement of the layout.
      const int64_t block = slot / cg.block_size, in_block = slot % cg.block_size;
      const char* kc = static_cast<const char*>(key_cache) +
                       (block * cg.kc.block + in_block * cg.kc.offset + h * cg.kc.head) * es;
      const char* vc = static_cast<const char*>(value_cache) +
                       (block * cg.vc.block + in_block * cg.vc.offset + h * cg.vc.head) * es;
      for (int64_t j = 0; j < head_dim; ++j) rec.allow(kc + j * cg.kc.last * es, es, kWrite | kMustWrite);
      for (int64_t j = 0; j < cg.value_dim; ++j) rec.allow(vc + j * cg.vc.last * es, es, kWrite | kMustWrite);
    }
  }
  if (cg.format != CacheFormat::kSame) {
    rec.allow(k_scale, 4, kRead);
    rec.allow(v_scale, 4, kRead);
  }
}

template <typename x_t, typename tab_t>
void allow_cache_operands(Recorder& rec, const CacheArgs<x_t, tab_t>& a) {
  allow_rotate_operands(rec, a.rot);
  allow_paged_store<x_t>(rec, a.cg, a.rot.g.tokens, a.rot.g.head_dim, a.value, nullptr, a.slots,
                         a.key_cache, a.value_cache, a.k_scale, a.v_scale);
}

// rope.shift_kv_cache_: slots and deltas read; the table rows; the rotary elements of every
// head of each listed slot read and written once (pass-through dims and other slots untouched).
template <typename x_t, typename acc_t>
void allow_shift_operands(Recorder& rec, const gpu::ShiftArgs<x_t, acc_t>& a) {
  const ShiftDesc& d = a.d;
  for (int64_t r = 0; r < d.rows; ++r) {
    for (int64_t j = 0; j < 2 * d.half; ++j) {
      rec.allow(a.table + r * d.cos_row + j * d.cos_col, sizeof(acc_t), kRead);
    }
  }
  for (int64_t i = 0; i < d.n; ++i) {
    const int64_t es_s = d.slots64 ? 8 : 4, es_d = d.delta64 ? 8 : 4;
    const char* sp = static_cast<const char*>(a.slots) + i * d.slot_stride * es_s;
    rec.allow(sp, es_s, kRead);
    rec.allow(static_cast<const char*>(a.delta) + i * d.delta_stride * es_d, es_d, kRead);
    const int64_t slot = d.slots64 ? *reinterpret_cast<const int64_t*>(sp)
                                   : *reinterpret_cast<const int32_t*>(sp);
    if (slot < 0 || slot >= d.slots) continue;
    // Written out here, not with CacheStrides::slot_row: an independent statement of the layout.
    const int64_t block = slot / d.block_size, in_block = slot % d.block_size;
    for (int64_t h = 0; h < d.heads; ++h) {
      for (int64_t j = 0; j < 2 * d.half; ++j) {
        rec.allow(a.cache + block * d.kc.block + in_block * d.kc.offset + h * d.kc.head +
                      j * d.kc.last,
                  sizeof(x_t), kRead | kWrite | kMustWrite);
      }
    }
  }
}

void fill_info(Tensor& info, const LaunchPlan& p, const Recorder& rec) {
  ROPE_CHECK(info.scalar_type() == ScalarType::Long && info.numel() == 12 && info.is_contiguous(),
             "sim: info must be a contiguous int64 tensor of 12 elements");
  int64_t* o = info.mutable_data_ptr<int64_t>();
  const int64_t v[12] = {p.vec,           p.idx32,         p.grid.x,
                         p.block.x,       p.block.y,       p.block.z,
                         p.rot_chunks,    p.tail_chunks,   rec.vector_accesses,
                         rec.scalar_accesses, p.tvec, 0};
  for (int i = 0; i < 12; ++i) o[i] = v[i];
}

// The Runner handed to the host code: installs a Recorder, registers the operands, runs every
// thread, checks. `force_idx64` takes the 64-bit index path a huge tensor would.
struct SimRunner {
  const char* op;
  bool force_idx64;
  Tensor* info;

  template <typename x_t, typename tab_t, bool kI>
  void operator()(const LaunchPlan& plan, RotateArgs<x_t, tab_t> a, Bool<kI>) const {
    if (force_idx64) a.idx32 = false;
    simulate(plan, a.idx32, [&](Recorder& rec) { allow_rotate_operands(rec, a); },
             [&](const ThreadPos& tp) { gpu::rotate_thread<x_t, tab_t, kI>(a, tp); });
  }

  template <typename x_t, typename acc_t>
  void operator()(const LaunchPlan& plan, const gpu::ShiftArgs<x_t, acc_t>& a) const {
    simulate(plan, plan.idx32, [&](Recorder& rec) { allow_shift_operands(rec, a); },
             [&](const ThreadPos& tp) { gpu::shift_thread<x_t, acc_t>(a, tp); });
  }

  template <typename x_t, typename tab_t>
  void operator()(const LaunchPlan& plan, CacheArgs<x_t, tab_t> a) const {
    if (force_idx64) a.rot.idx32 = false;
    simulate(plan, a.rot.idx32, [&](Recorder& rec) { allow_cache_operands(rec, a); },
             [&](const ThreadPos& tp) { gpu::cache_thread<x_t, tab_t>(a, tp); });
  }

  void operator()(const LaunchPlan& plan, const gpu::SlotSetArgs& a) const {
    simulate(plan, true,
             [&](Recorder& rec) {
               const int64_t es = a.slots64 ? 8 : 4;
               for (int64_t t = 0; t < a.tokens; ++t) {
                 rec.allow(static_cast<const char*>(a.slots) + t * a.slot_stride * es, es, kRead);
               }
               for (int64_t i = 0; i <= a.mask; ++i) rec.allow(a.set + i, 8, kRead | kWrite | kAtomic);
             },
             [&](const ThreadPos& tp) { gpu::slot_set_thread(a, tp); },
             gpu::kThreadsPerBlock);  // slot_set_kernel's bound
  }

 private:
  // One simulated launch: record every access the threads make, check it against the operands
  // the launch was allowed to touch, and report the plan it ran with.
  template <typename Allow, typename Thread>
  void simulate(const LaunchPlan& plan, bool idx32, Allow allow, Thread thread,
                int64_t max_threads = gpu::kMaxBlockThreads) const {
    LaunchPlan p = plan;
    p.idx32 = idx32;
    Recorder rec;
    simulate_launch(rec, p, op, allow, thread, max_threads);
    fill_info(*info, p, rec);
  }
};

// The ops: the real schemas' arguments, then max_blocks (small values force block striding),
// force_idx64 and info.
Tensor apply_sim(Tensor x, Tensor cos, Tensor sin, bool interleaved, bool inverse,
                 int64_t max_blocks, bool force_idx64, Tensor info) {
  return gpu::apply_host(x, cos, sin, interleaved, inverse, std::nullopt,
                         SimRunner{"rope_sim.apply", force_idx64, &info}, max_blocks);
}

void apply_out_sim(Tensor x, Tensor cos, Tensor sin, bool interleaved, int64_t max_blocks,
                   bool force_idx64, Tensor info, Tensor out) {
  gpu::apply_host(x, cos, sin, interleaved, false, out,
                  SimRunner{"rope_sim.apply_out", force_idx64, &info}, max_blocks);
}

void apply_inplace_sim(Tensor query, std::optional<Tensor> key, Tensor positions, Tensor cache,
                       bool interleaved, int64_t rope_dim_offset, bool inverse,
                       int64_t max_blocks, bool force_idx64, Tensor info) {
  gpu::rotate_inplace_host(query, key, positions, cache, interleaved, nullptr, false,
                           rope_dim_offset, inverse,
                           SimRunner{"rope_sim.apply_", force_idx64, &info}, max_blocks);
}

void mrope_sim(Tensor query, std::optional<Tensor> key, Tensor positions, Tensor cache,
               std::vector<int64_t> section, bool interleaved, bool mrope_interleaved,
               int64_t rope_dim_offset, bool inverse, int64_t max_blocks, bool force_idx64,
               Tensor info) {
  gpu::rotate_inplace_host(query, key, positions, cache, interleaved, &section, mrope_interleaved,
                           rope_dim_offset, inverse,
                           SimRunner{"rope_sim.mrope_", force_idx64, &info}, max_blocks);
}

// sin None: cos is a cos_sin_cache (rope.apply_positions.cache).
Tensor apply_positions_sim(Tensor x, Tensor positions, Tensor cos, std::optional<Tensor> sin,
                           bool interleaved, bool inverse,
                           std::optional<std::vector<int64_t>> section, bool mrope_interleaved,
                           int64_t max_blocks, bool force_idx64, Tensor info) {
  return gpu::apply_positions_host(x, positions, cos, sin ? &*sin : nullptr, interleaved, inverse,
                                   section, mrope_interleaved,
                                   SimRunner{"rope_sim.apply_positions", force_idx64, &info},
                                   max_blocks);
}

void apply_and_cache_sim(Tensor query, Tensor key, Tensor value, Tensor positions, Tensor cache,
                         Tensor key_cache, Tensor value_cache, Tensor slots, bool interleaved,
                         std::string kv_cache_dtype, std::optional<Tensor> k_scale,
                         std::optional<Tensor> v_scale, int64_t max_blocks, bool force_idx64,
                         Tensor info) {
  gpu::apply_and_cache_host(query, key, value, positions, cache, key_cache, value_cache, slots,
                            interleaved, kv_cache_dtype, k_scale, v_scale,
                            SimRunner{"rope_sim.apply_and_cache_", force_idx64, &info},
                            max_blocks);
}

void shift_kv_cache_sim(Tensor key_cache, Tensor slots, Tensor delta, Tensor cache,
                        bool interleaved, std::string kv_cache_dtype,
                        std::optional<Tensor> k_scale, int64_t max_blocks, bool force_idx64,
                        Tensor info) {
  gpu::shift_kv_cache_host(key_cache, slots, delta, cache, interleaved, kv_cache_dtype, k_scale,
                           SimRunner{"rope_sim.shift_kv_cache_", force_idx64, &info},
                           max_blocks);
}

}  // namespace
}  // namespace rope::sim

// The RoPE + FP8 quantization kernels and the fused QK-RMSNorm + RoPE kernels (their own files,
// same translation unit: one simulator library).
#include "quant_sim.inc"
#include "qk_norm_sim.inc"

STABLE_TORCH_LIBRARY(rope_sim, m) {
  m.def("apply(Tensor x, Tensor cos, Tensor sin, bool interleaved, bool inverse, int max_blocks, "
        "bool force_idx64, Tensor info) -> Tensor");
  m.def("apply_out(Tensor x, Tensor cos, Tensor sin, bool interleaved, int max_blocks, "
        "bool force_idx64, Tensor info, Tensor(a!) out) -> ()");
  m.def("apply_(Tensor(a!) query, Tensor(b!)? key, Tensor positions, Tensor cos_sin_cache, "
        "bool interleaved, int rope_dim_offset, bool inverse, int max_blocks, bool force_idx64, "
        "Tensor info) -> ()");
  m.def("mrope_(Tensor(a!) query, Tensor(b!)? key, Tensor positions, Tensor cos_sin_cache, "
        "int[] mrope_section, bool interleaved, bool mrope_interleaved, int rope_dim_offset, "
        "bool inverse, int max_blocks, bool force_idx64, Tensor info) -> ()");
  m.def("apply_positions(Tensor x, Tensor positions, Tensor cos, Tensor? sin, bool interleaved, "
        "bool inverse, int[]? mrope_section, bool mrope_interleaved, int max_blocks, "
        "bool force_idx64, Tensor info) -> Tensor");
  m.def("apply_and_cache_(Tensor(a!) query, Tensor(b!) key, Tensor value, Tensor positions, "
        "Tensor cos_sin_cache, Tensor(c!) key_cache, Tensor(d!) value_cache, Tensor slot_mapping, "
        "bool interleaved, str kv_cache_dtype, Tensor? k_scale, Tensor? v_scale, int max_blocks, "
        "bool force_idx64, Tensor info) -> ()");
  m.def("shift_kv_cache_(Tensor(a!) key_cache, Tensor slot_mapping, Tensor delta, "
        "Tensor cos_sin_cache, bool interleaved, str kv_cache_dtype, Tensor? k_scale, "
        "int max_blocks, bool force_idx64, Tensor info) -> ()");
  m.def("quantize_fp8(Tensor q_rope, Tensor k_rope, Tensor q_nope, Tensor k_nope, "
        "Tensor cos_sin_cache, Tensor pos_ids, Tensor(a!) q_rope_out, Tensor(b!) k_rope_out, "
        "Tensor(c!) q_nope_out, Tensor(d!) k_nope_out, float quant_scale_q, float quant_scale_kv, "
        "bool interleaved, int max_blocks, Tensor info) -> ()");
  m.def("quantize_fp8_append_paged_kv_cache(Tensor q_rope, Tensor k_rope, Tensor q_nope, "
        "Tensor k_nope, Tensor? v, Tensor cos_sin_cache, Tensor pos_ids, Tensor(a!) q_rope_out, "
        "Tensor(b!) q_nope_out, Tensor(c!) k_cache, Tensor(d!) v_cache, Tensor kv_indices, "
        "Tensor kv_indptr, Tensor batch_indices, Tensor positions, int page_size, str kv_layout, "
        "float quant_scale_q, float quant_scale_kv, bool interleaved, int max_blocks, "
        "Tensor info) -> ()");
  m.def("qk_norm_rope(Tensor query, Tensor key, Tensor q_weight, Tensor k_weight, Tensor cos, "
        "Tensor sin, float eps, bool unit_offset, bool interleaved, int max_blocks, "
        "Tensor(a!) info) -> (Tensor, Tensor)");
  m.def("norm_rope(Tensor query, Tensor key, Tensor? q_weight, Tensor? k_weight, "
        "Tensor? q_bias, Tensor? k_bias, Tensor cos, Tensor sin, float eps, str norm, "
        "bool interleaved, int max_blocks, Tensor(a!) info) -> (Tensor, Tensor)");
  m.def("qk_norm_rope_(Tensor(a!) query, Tensor(b!) key, Tensor q_weight, Tensor k_weight, "
        "Tensor positions, Tensor cos_sin_cache, float eps, bool unit_offset, bool interleaved, "
        "int[]? mrope_section, bool mrope_interleaved, int max_blocks, Tensor(c!) info) -> ()");
  m.def("qkv_norm_rope_(Tensor(a!) qkv, int num_heads_q, int num_heads_k, int num_heads_v, "
        "int head_dim, Tensor q_weight, Tensor k_weight, Tensor positions, Tensor cos_sin_cache, "
        "float eps, bool unit_offset, bool interleaved, int[]? mrope_section, "
        "bool mrope_interleaved, int max_blocks, Tensor(b!) info) -> ()");
  m.def("qk_norm_rope_and_cache_(Tensor(a!) query, Tensor(b!) key, Tensor(c!) value, "
        "Tensor positions, Tensor cos_sin_cache, Tensor q_weight, Tensor k_weight, "
        "Tensor(d!) key_cache, Tensor(e!) value_cache, Tensor slot_mapping, float eps, "
        "bool unit_offset, bool interleaved, int[]? mrope_section, bool mrope_interleaved, "
        "bool v_norm, str kv_cache_dtype, Tensor? k_scale, Tensor? v_scale, int max_blocks, "
        "Tensor(f!) info) -> ()");
  m.def("qk_norm_rope_and_cache(Tensor query, Tensor key, Tensor value, "
        "Tensor positions, Tensor cos_sin_cache, Tensor q_weight, Tensor k_weight, "
        "Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor slot_mapping, float eps, "
        "bool unit_offset, bool interleaved, int[]? mrope_section, bool mrope_interleaved, "
        "bool v_norm, str kv_cache_dtype, Tensor? k_scale, Tensor? v_scale, int max_blocks, "
        "Tensor(c!) info) -> (Tensor, Tensor, Tensor)");
}

// The implementations, one block per simulator file: this one's first.
STABLE_TORCH_LIBRARY_IMPL(rope_sim, CPU, m) {
  m.impl("apply", TORCH_BOX(&rope::sim::apply_sim));
  m.impl("apply_out", TORCH_BOX(&rope::sim::apply_out_sim));
  m.impl("apply_", TORCH_BOX(&rope::sim::apply_inplace_sim));
  m.impl("mrope_", TORCH_BOX(&rope::sim::mrope_sim));
  m.impl("apply_positions", TORCH_BOX(&rope::sim::apply_positions_sim));
  m.impl("apply_and_cache_", TORCH_BOX(&rope::sim::apply_and_cache_sim));
  m.impl("shift_kv_cache_", TORCH_BOX(&rope::sim::shift_kv_cache_sim));
}

// quant_sim.inc
STABLE_TORCH_LIBRARY_IMPL(rope_sim, CPU, m) {
  m.impl("quantize_fp8", TORCH_BOX(&rope::sim::quantize_fp8_sim));
  m.impl("quantize_fp8_append_paged_kv_cache", TORCH_BOX(&rope::sim::quantize_fp8_paged_sim));
}

// qk_norm_sim.inc
STABLE_TORCH_LIBRARY_IMPL(rope_sim, CPU, m) {
  m.impl("qk_norm_rope", TORCH_BOX(&rope::sim::qk_norm_rope_sim));
  m.impl("norm_rope", TORCH_BOX(&rope::sim::norm_rope_sim));
  m.impl("qk_norm_rope_", TORCH_BOX(&rope::sim::qk_norm_rope_inplace_sim));
  m.impl("qkv_norm_rope_", TORCH_BOX(&rope::sim::qkv_norm_rope_inplace_sim));
  m.impl("qk_norm_rope_and_cache_", TORCH_BOX(&rope::sim::qk_norm_rope_and_cache_sim));
  m.impl("qk_norm_rope_and_cache", TORCH_BOX(&rope::sim::qk_norm_rope_and_cache_out_sim));
}
