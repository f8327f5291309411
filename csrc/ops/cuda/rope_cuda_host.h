// Host side of every CUDA op, shared by the ops (cuda_ops.cpp) and the CPU simulator
// (tests/sim/cuda_sim.cpp): checks (../checks.h), positions read once, the table cast, the launch
// plan (grid, block, vector path) and the dtype/layout dispatch. Only the last step differs: a
// `Runner` either launches the kernel instantiation it is given or runs its per-thread code over
// the whole grid. Range checks of positions and slots are data on the device: the kernels do them.
#pragma once

#include <algorithm>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/Dispatch.h>

#include "../alloc.h"
#include "../checks.h"
#include "launch_plan.h"
#include "rope_cuda_thread.h"

namespace rope::gpu {

template <bool B>
using Bool = std::integral_constant<bool, B>;

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

inline int64_t pow2_at_least(int64_t n) {
  int64_t p = 1;
  while (p < n) p *= 2;
  return p;
}

inline bool aligned(const void* p, int64_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % static_cast<uintptr_t>(bytes) == 0;
}

// Every row of one operand starts 16-byte aligned with unit stride along the head dim: the base
// is aligned and every lead and head stride is a multiple of the vector width w.
inline bool rows_vectorizable(const void* base, const LeadIndexer& ix, int operand,
                              int64_t head_stride, int64_t last, int64_t w) {
  if (last != 1 || !aligned(base, kVecBytes) || head_stride % w != 0) return false;
  for (int d = 0; d < ix.ndim; ++d) {
    if (ix.strides[operand][d] % w != 0) return false;
  }
  return true;
}

// The vector path: every row of every target aligned, and (half-split) the second member of a
// pair vector-aligned too; rows with pass-through chunks also need rotary_dim and head_dim
// multiples of the width.
template <typename x_t>
bool vectorizable(const RotateGeometry& g, const void* const src[2], const void* const dst[2],
                  bool tails) {
  constexpr int W = kWidth<x_t>;
  if (!g.interleaved && g.half % W != 0) return false;
  if (tails && (g.head_dim % W != 0 || (2 * g.half) % W != 0)) return false;
  for (int k = 0; k < g.targets; ++k) {
    const TargetDesc& t = g.target[k];
    if (!rows_vectorizable(src[k], g.lead, 2 * k, t.src_head, t.src_last, W) ||
        !rows_vectorizable(dst[k], g.lead, 2 * k + 1, t.dst_head, t.dst_last, W)) {
      return false;
    }
  }
  return true;
}

// Whole-vector table loads (load_tables' tvec): a chunk's pairs span whole table vectors, the
// rows are one component's (not MRoPE) with unit stride along the pairs, both tables are
// 16-byte aligned, and every row starts at a multiple of the vector width: the table's row
// strides (gathered) or the tables' lead strides (strided).
template <typename x_t, typename tab_t>
bool tables_vectorizable(const RotateGeometry& g, const void* cos, const void* sin) {
  constexpr int TW = kWidth<tab_t>;
  const int pairs = g.interleaved ? kWidth<x_t> / 2 : kWidth<x_t>;  // of a full chunk
  const TableDesc& t = g.table;
  if (pairs % TW != 0) return false;
  if (t.kind == TableKind::kMrope || t.cos_col != 1 || t.sin_col != 1) return false;
  if (!aligned(cos, kVecBytes) || !aligned(sin, kVecBytes)) return false;
  if (t.kind == TableKind::kGathered) return t.cos_row % TW == 0 && t.sin_row % TW == 0;
  for (int d = 0; d < g.lead.ndim; ++d) {
    if (g.lead.strides[kTab0][d] % TW != 0 || g.lead.strides[kTab1][d] % TW != 0) return false;
  }
  return true;
}

// A paged cache takes a chunk as one store (CacheStore::vec): unit stride along the head dim,
// its base aligned for the chunk (16 bytes, or W float8 codes), and every row starting at a
// multiple of W elements.
template <typename x_t>
bool cache_rows_vectorizable(const void* base, const CacheStrides& s, CacheFormat format) {
  constexpr int W = kWidth<x_t>;
  return s.last == 1 && aligned(base, format == CacheFormat::kSame ? kVecBytes : W) &&
         s.block % W == 0 && s.offset % W == 0 && s.head % W == 0;
}

// Value rows read (or written) as whole vectors: unit stride along the head dim, the base 16-byte
// aligned, every token's and head's row starting at a multiple of W elements, and value_dim a
// multiple of W. (value_out's rows take the same test, with its own strides.)
template <typename x_t>
bool value_rows_vectorizable(const void* base, int64_t token, int64_t head, int64_t last,
                             int64_t value_dim) {
  constexpr int W = kWidth<x_t>;
  return last == 1 && aligned(base, kVecBytes) && token % W == 0 && head % W == 0 &&
         value_dim % W == 0;
}

// x over a row's chunks, y over heads, z over tokens within a block; the grid strides over tokens.
// At most kRowThreads threads share a token, so a thread takes several of its heads and reads
// its chunk's cos and sin once for all of them (see kRowThreads).
inline void plan_block(LaunchPlan& p, int64_t chunks, int64_t heads, int64_t tokens,
                       int64_t max_blocks) {
  const int64_t bx = std::min<int64_t>(pow2_at_least(std::max<int64_t>(chunks, 1)), 64);
  const int64_t by = std::max<int64_t>(1, std::min<int64_t>(heads, kRowThreads / bx));
  // (rows of one or two chunks and one head: fewer than kThreadsPerBlock threads, not a bz past
  // CUDA's limit)
  const int64_t bz = std::clamp<int64_t>(kThreadsPerBlock / (bx * by), 1, kMaxBlockZ);
  p.block = {static_cast<unsigned>(bx), static_cast<unsigned>(by), static_cast<unsigned>(bz)};
  p.grid = {static_cast<unsigned>(std::min(ceil_div(tokens, bz), max_blocks)), 1, 1};
  p.idx32 = tokens <= static_cast<int64_t>(UINT32_MAX);
}

template <typename x_t, typename tab_t>
LaunchPlan plan_rotate(const RotateArgs<x_t, tab_t>& a, int64_t max_blocks) {
  constexpr int W = kWidth<x_t>;
  const RotateGeometry& g = a.g;
  LaunchPlan p;
  p.rot_chunks = g.interleaved ? rotary_chunks<x_t, true>(g.half) : rotary_chunks<x_t, false>(g.half);
  p.tail_chunks = g.copy_tail ? ceil_div(g.head_dim - 2 * g.half, W) : 0;
  const void* src[2] = {a.src[0], a.src[1]};
  const void* dst[2] = {a.dst[0], a.dst[1]};
  p.vec = vectorizable<x_t>(g, src, dst, g.copy_tail);
  p.tvec = tables_vectorizable<x_t, tab_t>(g, a.cos, a.sin);
  const int64_t heads = g.target[0].heads + (g.targets > 1 ? g.target[1].heads : 0);
  plan_block(p, p.rot_chunks + p.tail_chunks, heads, g.tokens, max_blocks);
  return p;
}

// The kernels read tables of x's dtype or of its arithmetic type (float, or double for double
// x), converting each element as they load it, as the CPU kernels do: so the usual tables (the
// model's dtype, or float32) are read where they are. Any other table dtype is cast, which gives
// exactly the values the CPU kernels get by converting each element.
inline Tensor table_for(const Tensor& t, ScalarType x_type) {
  const ScalarType acc = x_type == ScalarType::Double ? ScalarType::Double : ScalarType::Float;
  if (dtype_of(t) == acc || dtype_of(t) == x_type) return t;
  return torch::stable::to(t, std::optional<ScalarType>(acc));
}

#define ROPE_DISPATCH_FLOATING(TYPE, NAME, ...)                                   \
  THO_DISPATCH_SWITCH(                                                            \
      TYPE, NAME,                                                                 \
      THO_DISPATCH_CASE(torch::headeronly::ScalarType::Float, __VA_ARGS__)        \
      THO_DISPATCH_CASE(torch::headeronly::ScalarType::Double, __VA_ARGS__)       \
      THO_DISPATCH_CASE(torch::headeronly::ScalarType::Half, __VA_ARGS__)         \
      THO_DISPATCH_CASE(torch::headeronly::ScalarType::BFloat16, __VA_ARGS__))

// f(x_t{}, tab_t{}) for x's dtype and the table's (x_t or opmath_t<x_t>, see table_for).
template <class F>
void dispatch_types(ScalarType x_type, ScalarType table_type, F&& f) {
  ROPE_DISPATCH_FLOATING(x_type, "rope", [&] {
    using x_t = scalar_t;
    if (table_type == x_type) {
      f(x_t{}, x_t{});
    } else {
      f(x_t{}, opmath_t<x_t>{});
    }
  });
}

// The tensors of one rotation, bound to a geometry: x (or query) and key, their outputs, the
// tables and positions.
struct RotateTensors {
  const Tensor* src[2] = {nullptr, nullptr};
  const Tensor* dst[2] = {nullptr, nullptr};
  // The tables read, kept alive (either may be a cast): cos and sin, or a cos_sin_cache in
  // cos_table (sin_table then unused). Both have one dtype.
  Tensor cos_table, sin_table;
  const void* cos = nullptr;
  const void* sin = nullptr;
  const Tensor* positions = nullptr;
};

// t on the host, contiguous (itself when it already is both).
inline Tensor host_contiguous(const Tensor& t) {
  return torch::stable::contiguous(
      torch::stable::to(t, torch::stable::Device(torch::headeronly::DeviceType::CPU)));
}

// A call with tokens but nothing to rotate or store (no heads, head_dim 0) launches no kernel,
// so what the kernels check on the device is checked here, on a host copy, with the CPU op's
// messages: the positions' range and, given, the slots' (range and repeats). A device sync,
// made only by such calls.
inline void check_data_on_host(int64_t tokens, const Tensor& positions, int64_t rows,
                               const char* op, const char* rows_name,
                               const Tensor* slots = nullptr, int64_t num_slots = 0) {
  if (tokens == 0) return;
  check_positions_in_range(host_contiguous(positions), rows, op, rows_name);
  if (slots != nullptr) check_slots(host_contiguous(*slots), num_slots, op);
}

// Returns whether a kernel was launched (false: nothing to rotate).
template <class Runner>
bool run_rotate(const RotateGeometry& g, const RotateTensors& t, ScalarType x_type, Runner&& run,
                int64_t max_blocks) {
  const int64_t heads = g.target[0].heads + (g.targets > 1 ? g.target[1].heads : 0);
  if (g.tokens == 0 || g.head_dim == 0 || heads == 0) return false;  // however many (empty) tokens
  dispatch_types(x_type, dtype_of(t.cos_table), [&](auto x0, auto tab0) {
    using x_t = decltype(x0);
    using tab_t = decltype(tab0);
    RotateArgs<x_t, tab_t> a{};
    for (int k = 0; k < g.targets; ++k) {  // rows bound where their rotary dims start
      a.src[k] = static_cast<const x_t*>(rotary_start(*t.src[k], g, g.target[k].src_last));
      a.dst[k] = static_cast<x_t*>(rotary_start(*t.dst[k], g, g.target[k].dst_last));
    }
    a.cos = static_cast<const tab_t*>(t.cos);
    a.sin = static_cast<const tab_t*>(t.sin);
    a.pos = t.positions != nullptr ? t.positions->const_data_ptr() : nullptr;
    a.g = g;
    const LaunchPlan p = plan_rotate(a, max_blocks);
    a.rot_chunks = p.rot_chunks;
    a.tail_chunks = p.tail_chunks;
    a.idx32 = p.idx32;
    a.vec = p.vec;
    a.tvec = p.tvec;
    g.interleaved ? run(p, a, Bool<true>{}) : run(p, a, Bool<false>{});
  });
  return true;
}

// Separate cos and sin tables, cast if their dtype needs it (then checked again: the cast's
// strides). `check(cos, sin)` returns the geometry.
template <class Check>
RotateGeometry bind_tables(const Tensor& cos_in, const Tensor& sin_in, ScalarType x_type,
                           RotateTensors& t, Check&& check) {
  RotateGeometry g = check(cos_in, sin_in);
  t.cos_table = table_for(cos_in, x_type);
  t.sin_table = table_for(sin_in, x_type);
  if (t.cos_table.get() != cos_in.get()) g = check(t.cos_table, t.sin_table);
  t.cos = t.cos_table.const_data_ptr();
  t.sin = t.sin_table.const_data_ptr();
  return g;
}

// One cos_sin_cache (cos in the first half of each row), cast like bind_tables' tables: `g` is
// the geometry of the table as given, `check(cache)` that of a cast.
template <class Check>
RotateGeometry bind_cache(const Tensor& cache_in, RotateGeometry g, ScalarType x_type,
                          RotateTensors& t, Check&& check) {
  t.cos_table = table_for(cache_in, x_type);
  if (t.cos_table.get() != cache_in.get()) g = check(t.cos_table);
  t.cos = t.cos_table.const_data_ptr();
  t.sin = sin_of_cache(t.cos_table, g);
  return g;
}

// rope.apply (inverse = false), rope.apply_backward (true) and rope.apply.out (out given).
template <class Runner>
Tensor apply_host(const Tensor& x, const Tensor& cos_in, const Tensor& sin_in, bool interleaved,
                  bool inverse, const std::optional<Tensor>& out_in, Runner&& run,
                  int64_t max_blocks = kMaxBlocks) {
  const char* op = out_in ? "rope.apply.out" : (inverse ? "rope.apply_backward" : "rope.apply");
  const char* x_name = inverse ? "grad" : "x";
  RotateTensors t;
  const RotateGeometry g =
      bind_tables(cos_in, sin_in, dtype_of(x), t, [&](const Tensor& c, const Tensor& s) {
        return out_in ? check_apply_out(x, c, s, *out_in, interleaved)
                      : check_apply(x, c, s, interleaved, inverse, op, x_name);
      });
  Tensor out = out_in ? *out_in : new_contiguous(x, x.sizes());
  t.src[0] = &x;
  t.dst[0] = &out;
  run_rotate(g, t, dtype_of(x), run, max_blocks);
  return out;
}

// The in-place ops: rope.apply_ (section == nullptr) and rope.mrope_.
template <class Runner>
void rotate_inplace_host(const Tensor& query, const std::optional<Tensor>& key,
                         const Tensor& positions_in, const Tensor& cache_in, bool interleaved,
                         const std::vector<int64_t>* section, bool mrope_interleaved,
                         int64_t rope_dim_offset, bool inverse, Runner&& run,
                         int64_t max_blocks = kMaxBlocks) {
  const char* op = section ? "rope.mrope_" : "rope.apply_";
  Tensor positions = positions_in;
  auto check = [&](const Tensor& cache) {
    RotateGeometry g = check_positions_op(
        query, key, positions, TableArgs{&cache, nullptr, nullptr, section, mrope_interleaved},
        interleaved, inverse, true, op, "query");
    set_rope_dim_offset(g, rope_dim_offset, op);
    return g;
  };
  RotateTensors t;
  const RotateGeometry g =
      bind_cache(cache_in,
                 check_read_once([&] { return check(cache_in); }, {&positions},
                                 {&query, key ? &*key : nullptr}),
                 dtype_of(query), t, check);
  t.src[0] = t.dst[0] = &query;
  if (key) t.src[1] = t.dst[1] = &*key;
  t.positions = &positions;
  if (!run_rotate(g, t, dtype_of(query), run, max_blocks)) {
    check_data_on_host(g.tokens, positions, g.table.rows, op, "cos_sin_cache.size(0)");
  }
}

// rope.apply_positions: the tables as cos and sin (sin_in given) or as one cos_sin_cache
// (cos_in, sin_in null).
template <class Runner>
Tensor apply_positions_host(const Tensor& x, const Tensor& positions, const Tensor& cos_in,
                            const Tensor* sin_in, bool interleaved, bool inverse,
                            const std::optional<std::vector<int64_t>>& section,
                            bool mrope_interleaved, Runner&& run,
                            int64_t max_blocks = kMaxBlocks) {
  const char* op = sin_in ? "rope.apply_positions" : "rope.apply_positions.cache";
  auto check = [&](const Tensor& c, const Tensor* s) {
    const TableArgs tables{s ? nullptr : &c, s ? &c : nullptr, s,
                           section ? &*section : nullptr, mrope_interleaved};
    return check_positions_op(x, std::nullopt, positions, tables, interleaved, inverse, false, op,
                              "x");
  };
  RotateTensors t;
  const RotateGeometry g =
      sin_in ? bind_tables(cos_in, *sin_in, dtype_of(x), t,
                           [&](const Tensor& c, const Tensor& s) { return check(c, &s); })
             : bind_cache(cos_in, check(cos_in, nullptr), dtype_of(x), t,
                          [&](const Tensor& c) { return check(c, nullptr); });
  Tensor out = new_contiguous(x, x.sizes());
  t.src[0] = &x;
  t.dst[0] = &out;
  t.positions = &positions;
  if (!run_rotate(g, t, dtype_of(x), run, max_blocks)) {
    check_data_on_host(g.tokens, positions, g.table.rows, op,
                       sin_in ? "cos.size(0)" : "cos_sin_cache.size(0)");
  }
  return out;
}

// An empty slot set for `tokens` tokens (a power of two >= 2 * tokens entries, all kEmptySlot,
// on `like`'s device) and the plan of a kernel with a thread per token that fills it.
struct SlotSet {
  Tensor entries;
  int64_t mask;
  LaunchPlan plan;
  unsigned long long* data() const {
    return static_cast<unsigned long long*>(entries.mutable_data_ptr());
  }
};

inline SlotSet new_slot_set(const Tensor& like, int64_t tokens, int64_t max_blocks) {
  const int64_t capacity = pow2_at_least(2 * tokens);
  SlotSet s{torch::stable::new_empty(like, {capacity}, ScalarType::Long), capacity - 1, {}};
  torch::stable::fill_(s.entries, -1.0);  // kEmptySlot
  s.plan.block = Idx3{static_cast<unsigned>(kThreadsPerBlock), 1, 1};
  s.plan.grid =
      Idx3{static_cast<unsigned>(std::min(ceil_div(tokens, kThreadsPerBlock), max_blocks)), 1, 1};
  return s;
}

// Slots used at most once, checked on the device before the kernel that writes the caches (with
// two tokens or more): the slot-set kernel's device-side assert stops the stream first.
template <class Runner>
void check_slots_on_device(const CacheGeometry& cg, const Tensor& slots, Runner& run,
                           int64_t max_blocks) {
  const int64_t tokens = cg.rot.tokens;
  if (tokens < 2) return;
  const SlotSet set = new_slot_set(slots, tokens, max_blocks);
  run(set.plan, SlotSetArgs{slots.const_data_ptr(), cg.slots64, cg.slot_stride, tokens, set.mask,
                            set.data()});
}

template <class Runner>
void apply_and_cache_host(const Tensor& query, const Tensor& key, const Tensor& value,
                          const Tensor& positions_in, const Tensor& cache_in,
                          const Tensor& key_cache, const Tensor& value_cache,
                          const Tensor& slots_in, bool interleaved,
                          const std::string& kv_cache_dtype, const std::optional<Tensor>& k_scale,
                          const std::optional<Tensor>& v_scale, Runner&& run,
                          int64_t max_blocks = kMaxBlocks) {
  Tensor positions = positions_in, slots = slots_in;
  auto check = [&](const Tensor& cache) {
    return check_apply_and_cache(query, key, value, positions, cache, key_cache, value_cache,
                                 slots, interleaved, kv_cache_dtype, k_scale, v_scale);
  };
  CacheGeometry cg = check_read_once([&] { return check(cache_in); }, {&positions, &slots},
                                     {&query, &key, &key_cache, &value_cache});
  const Tensor cache = table_for(cache_in, dtype_of(query));
  if (cache.get() != cache_in.get()) cg = check(cache);
  const RotateGeometry& g = cg.rot;
  auto check_on_host = [&] {
    check_data_on_host(g.tokens, positions, g.table.rows, "rope.apply_and_cache_",
                       "cos_sin_cache.size(0)", &slots, cg.slots);
  };
  // Rows to rotate or values to store (key rows of head_dim 0 still carry their values): with
  // none, or only rows of 0 elements, nothing launches and the host checks.
  if (g.tokens == 0 || g.target[0].heads + cg.kv_heads == 0 ||
      (g.head_dim == 0 && cg.value_dim == 0)) {
    return check_on_host();
  }
  // No key heads: no row reads a slot on the device, so the host checks the slots (a repeat
  // too, with the CPU op's message, before the slot-set kernel's assert could stop the stream).
  if (cg.kv_heads == 0) {
    check_on_host();
  } else {
    check_slots_on_device(cg, slots, run, max_blocks);
  }
  dispatch_types(dtype_of(query), dtype_of(cache), [&](auto x0, auto tab0) {
    using x_t = decltype(x0);
    using tab_t = decltype(tab0);
    constexpr int W = kWidth<x_t>;
    CacheArgs<x_t, tab_t> a{};
    RotateArgs<x_t, tab_t>& r = a.rot;
    r.src[0] = r.dst[0] = query.mutable_data_ptr<x_t>();
    r.src[1] = r.dst[1] = key.mutable_data_ptr<x_t>();
    r.cos = static_cast<const tab_t*>(cache.const_data_ptr());
    r.sin = static_cast<const tab_t*>(sin_of_cache(cache, g));
    r.pos = positions.const_data_ptr();
    r.g = g;
    a.cg = cg;
    a.value = value.const_data_ptr<x_t>();
    a.slots = slots.const_data_ptr();
    a.key_cache = key_cache.mutable_data_ptr();
    a.value_cache = value_cache.mutable_data_ptr();
    if (cg.format != CacheFormat::kSame) {
      a.k_scale = static_cast<const float*>(k_scale->const_data_ptr());
      a.v_scale = static_cast<const float*>(v_scale->const_data_ptr());
    }
    LaunchPlan p;
    p.rot_chunks = g.interleaved ? rotary_chunks<x_t, true>(g.half) : rotary_chunks<x_t, false>(g.half);
    a.key_chunks = p.rot_chunks + ceil_div(g.head_dim - 2 * g.half, W);
    a.value_vecs = g.interleaved ? 1 : 2;  // a value chunk as wide as a rotary one
    a.value_chunks = ceil_div(cg.value_dim, a.value_vecs * W);
    const int64_t chunks = std::max(a.key_chunks, a.value_chunks);
    if (chunks == 0) return;  // (rows of 0 elements: returned above)
    p.tail_chunks = chunks - p.rot_chunks;
    const void* src[2] = {r.src[0], r.src[1]};
    p.vec = vectorizable<x_t>(g, src, src, true);  // key rows' tails go to the cache too
    // rows: query heads, key heads, value heads
    plan_block(p, chunks, g.target[0].heads + 2 * cg.kv_heads, g.tokens, max_blocks);
    r.rot_chunks = p.rot_chunks;
    r.idx32 = p.idx32;
    r.vec = p.vec;
    r.tvec = p.tvec = tables_vectorizable<x_t, tab_t>(g, r.cos, r.sin);
    a.kc_vec = cache_rows_vectorizable<x_t>(a.key_cache, cg.kc, cg.format);
    a.vc_vec = cache_rows_vectorizable<x_t>(a.value_cache, cg.vc, cg.format);
    a.v_vec = value_rows_vectorizable<x_t>(a.value, cg.v_token, cg.v_head, cg.v_last,
                                           cg.value_dim);
    run(p, a);
  });
}

}  // namespace rope::gpu
