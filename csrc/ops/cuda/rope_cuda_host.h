// Host side of every CUDA op, shared by the kernels (rope_cuda.cu) and the CPU simulator
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

#include "../checks.h"
#include "rope_cuda_thread.h"

namespace rope::gpu {

template <bool B>
using Bool = std::integral_constant<bool, B>;

// At most this many blocks; beyond it blocks stride (a grid this size already fills any GPU).
constexpr int64_t kMaxBlocks = int64_t{1} << 20;
constexpr int64_t kThreadsPerBlock = 256;
// The largest block a plan chooses: bx * by <= 2 * kThreadsPerBlock (the kernels'
// __launch_bounds__).
constexpr int kMaxBlockThreads = 512;

struct LaunchPlan {
  Idx3 grid, block;
  bool vec = false;
  bool idx32 = false;
  int64_t rot_chunks = 0, tail_chunks = 0;
};

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

// x over a row's chunks, y over heads, z over tokens within a block; the grid strides over tokens.
inline void plan_block(LaunchPlan& p, int64_t chunks, int64_t heads, int64_t tokens,
                       int64_t max_blocks) {
  const int64_t bx = std::min<int64_t>(pow2_at_least(std::max<int64_t>(chunks, 1)), 64);
  const int64_t by = std::max<int64_t>(1, std::min<int64_t>(heads, 2 * kThreadsPerBlock / bx));
  const int64_t bz = std::max<int64_t>(1, kThreadsPerBlock / (bx * by));
  p.block = {static_cast<unsigned>(bx), static_cast<unsigned>(by), static_cast<unsigned>(bz)};
  p.grid = {static_cast<unsigned>(std::min(ceil_div(tokens, bz), max_blocks)), 1, 1};
  p.idx32 = tokens <= static_cast<int64_t>(UINT32_MAX);
}

template <typename x_t>
LaunchPlan plan_rotate(const RotateArgs<x_t>& a, int64_t max_blocks) {
  constexpr int W = kWidth<x_t>;
  const RotateGeometry& g = a.g;
  LaunchPlan p;
  p.rot_chunks = g.interleaved ? rotary_chunks<x_t, true>(g.half) : rotary_chunks<x_t, false>(g.half);
  p.tail_chunks = g.copy_tail ? ceil_div(g.head_dim - 2 * g.half, W) : 0;
  const void* src[2] = {a.src[0], a.src[1]};
  const void* dst[2] = {a.dst[0], a.dst[1]};
  p.vec = vectorizable<x_t>(g, src, dst, g.copy_tail);
  const int64_t heads = g.target[0].heads + (g.targets > 1 ? g.target[1].heads : 0);
  plan_block(p, p.rot_chunks + p.tail_chunks, heads, g.tokens, max_blocks);
  return p;
}

// The kernels read tables in the arithmetic type of x (float, or double for double x). Casting a
// table once here gives exactly the values the CPU kernels get by converting each element, and
// keeps one table type per x dtype; float32 tables with bf16/fp16/fp32 x need no cast.
inline Tensor tables_as_opmath(const Tensor& t, ScalarType x_type) {
  const ScalarType want = x_type == ScalarType::Double ? ScalarType::Double : ScalarType::Float;
  if (t.scalar_type() == want) return t;
  return torch::stable::to(t, std::optional<ScalarType>(want));
}

#define ROPE_DISPATCH_FLOATING(TYPE, NAME, ...)                                   \
  THO_DISPATCH_SWITCH(                                                            \
      TYPE, NAME,                                                                 \
      THO_DISPATCH_CASE(torch::headeronly::ScalarType::Float, __VA_ARGS__)        \
      THO_DISPATCH_CASE(torch::headeronly::ScalarType::Double, __VA_ARGS__)       \
      THO_DISPATCH_CASE(torch::headeronly::ScalarType::Half, __VA_ARGS__)         \
      THO_DISPATCH_CASE(torch::headeronly::ScalarType::BFloat16, __VA_ARGS__))

template <class F>
void dispatch_layout(bool interleaved, F&& f) {
  interleaved ? f(Bool<true>{}) : f(Bool<false>{});
}

// The tensors of one rotation, bound to a geometry: x (or query) and key, their outputs, the
// tables (already in the arithmetic type) and positions.
struct RotateTensors {
  const Tensor* src[2] = {nullptr, nullptr};
  const Tensor* dst[2] = {nullptr, nullptr};
  Tensor cos, sin;
  const Tensor* positions = nullptr;
};

template <class Runner>
void run_rotate(const RotateGeometry& g, const RotateTensors& t, ScalarType x_type, Runner&& run,
                int64_t max_blocks) {
  const int64_t heads = g.target[0].heads + (g.targets > 1 ? g.target[1].heads : 0);
  if (g.tokens == 0 || g.head_dim == 0 || heads == 0) return;  // however many (empty) tokens
  ROPE_DISPATCH_FLOATING(x_type, "rope", [&] {
    using x_t = scalar_t;
    using tab_t = opmath_t<x_t>;
    RotateArgs<x_t> a{};
    for (int k = 0; k < g.targets; ++k) {
      a.src[k] = t.src[k]->const_data_ptr<x_t>();
      a.dst[k] = t.dst[k]->mutable_data_ptr<x_t>();
    }
    a.cos = static_cast<const tab_t*>(t.cos.const_data_ptr());
    a.sin = static_cast<const tab_t*>(t.sin.const_data_ptr());
    a.pos = t.positions != nullptr ? t.positions->const_data_ptr() : nullptr;
    a.g = g;
    const LaunchPlan p = plan_rotate(a, max_blocks);
    a.rot_chunks = p.rot_chunks;
    a.tail_chunks = p.tail_chunks;
    a.idx32 = p.idx32;
    a.vec = p.vec;
    dispatch_layout(g.interleaved, [&](auto il) { run(p, a, il); });
  });
}

// rope.apply (inverse = false), rope.apply_backward (true) and rope.apply.out (out given).
template <class Runner>
Tensor apply_host(const Tensor& x, const Tensor& cos_in, const Tensor& sin_in, bool interleaved,
                  bool inverse, const std::optional<Tensor>& out_in, Runner&& run,
                  int64_t max_blocks = kMaxBlocks) {
  const char* op = out_in ? "rope.apply.out" : (inverse ? "rope.apply_backward" : "rope.apply");
  const char* x_name = inverse ? "grad" : "x";
  auto check = [&](const Tensor& c, const Tensor& s) {
    return out_in ? check_apply_out(x, c, s, *out_in, interleaved)
                  : check_apply(x, c, s, interleaved, inverse, op, x_name);
  };
  RotateGeometry g = check(cos_in, sin_in);
  RotateTensors t;
  t.cos = tables_as_opmath(cos_in, x.scalar_type());
  t.sin = tables_as_opmath(sin_in, x.scalar_type());
  if (t.cos.scalar_type() != cos_in.scalar_type()) g = check(t.cos, t.sin);  // the cast's strides
  Tensor out = out_in ? *out_in : torch::stable::new_empty(x, x.sizes());
  t.src[0] = &x;
  t.dst[0] = &out;
  run_rotate(g, t, x.scalar_type(), run, max_blocks);
  return out;
}

// The in-place ops: rope.apply_ (section == nullptr) and rope.mrope_.
template <class Runner>
void rotate_inplace_host(const Tensor& query, const std::optional<Tensor>& key,
                         const Tensor& positions_in, const Tensor& cache_in, bool interleaved,
                         const std::vector<int64_t>* section, bool mrope_interleaved,
                         Runner&& run, int64_t max_blocks = kMaxBlocks) {
  const char* op = section ? "rope.mrope_" : "rope.apply_";
  Tensor positions = positions_in;
  auto check = [&](const Tensor& cache) {
    RotateGeometry g = check_positions_op(query, key, positions, section ? 1 : 0,
                                          TableArgs{&cache}, interleaved, false, true, op, "query");
    if (section) {
      set_mrope_sections(g, *section, mrope_interleaved, positions.stride(0), op,
                         "cos_sin_cache.size(1)/2");
    }
    return g;
  };
  RotateGeometry g = check(cache_in);
  {
    const Meta q(query);
    std::optional<Meta> k;
    if (key) k.emplace(*key);
    positions = positions_read_once(positions, {&q, k ? &*k : nullptr});
  }
  Tensor cache = tables_as_opmath(cache_in, query.scalar_type());
  if (positions.get() != positions_in.get() || cache.get() != cache_in.get()) g = check(cache);
  RotateTensors t;
  t.src[0] = t.dst[0] = &query;
  if (key) t.src[1] = t.dst[1] = &*key;
  t.cos = cache;
  t.sin = torch::stable::narrow(cache, 1, g.half, g.half);
  t.positions = &positions;
  run_rotate(g, t, query.scalar_type(), run, max_blocks);
}

template <class Runner>
Tensor apply_positions_host(const Tensor& x, const Tensor& positions, const Tensor& cos_in,
                            const Tensor& sin_in, bool interleaved, bool inverse,
                            const std::optional<std::vector<int64_t>>& section,
                            bool mrope_interleaved, Runner&& run,
                            int64_t max_blocks = kMaxBlocks) {
  const char* op = "rope.apply_positions";
  auto check = [&](const Tensor& c, const Tensor& s) {
    RotateGeometry g = check_positions_op(x, std::nullopt, positions, section ? 1 : 0,
                                          TableArgs{nullptr, &c, &s}, interleaved, inverse,
                                          false, op, "x");
    if (section) {
      set_mrope_sections(g, *section, mrope_interleaved, positions.stride(0), op, "cos.size(1)");
    }
    return g;
  };
  RotateGeometry g = check(cos_in, sin_in);
  RotateTensors t;
  t.cos = tables_as_opmath(cos_in, x.scalar_type());
  t.sin = tables_as_opmath(sin_in, x.scalar_type());
  if (t.cos.scalar_type() != cos_in.scalar_type()) g = check(t.cos, t.sin);
  Tensor out = torch::stable::new_empty(x, x.sizes());
  t.src[0] = &x;
  t.dst[0] = &out;
  t.positions = &positions;
  run_rotate(g, t, x.scalar_type(), run, max_blocks);
  return out;
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
  CacheGeometry cg = check(cache_in);
  {
    const Meta q(query), k(key), kc(key_cache), vc(value_cache);
    positions = positions_read_once(positions, {&q, &k, &kc, &vc});
    slots = positions_read_once(slots, {&q, &k, &kc, &vc});
  }
  Tensor cache = tables_as_opmath(cache_in, query.scalar_type());
  if (positions.get() != positions_in.get() || slots.get() != slots_in.get() ||
      cache.get() != cache_in.get()) {
    cg = check(cache);
  }
  const RotateGeometry& g = cg.rot;
  if (g.tokens == 0 || g.head_dim == 0 || g.target[0].heads + cg.kv_heads == 0) return;
  const Tensor sin = torch::stable::narrow(cache, 1, g.half, g.half);
  ROPE_DISPATCH_FLOATING(query.scalar_type(), "rope.apply_and_cache_", [&] {
    using x_t = scalar_t;
    using tab_t = opmath_t<x_t>;
    constexpr int W = kWidth<x_t>;
    CacheArgs<x_t> a{};
    RotateArgs<x_t>& r = a.rot;
    r.src[0] = r.dst[0] = query.mutable_data_ptr<x_t>();
    r.src[1] = r.dst[1] = key.mutable_data_ptr<x_t>();
    r.cos = static_cast<const tab_t*>(cache.const_data_ptr());
    r.sin = static_cast<const tab_t*>(sin.const_data_ptr());
    r.pos = positions.const_data_ptr();
    r.g = g;
    LaunchPlan p = plan_rotate(r, max_blocks);
    r.rot_chunks = p.rot_chunks;
    r.idx32 = p.idx32;
    const void* src[2] = {r.src[0], r.src[1]};
    r.vec = p.vec = vectorizable<x_t>(g, src, src, true);  // key rows' tails go to the cache too
    a.cg = cg;
    a.value = value.const_data_ptr<x_t>();
    a.slots = slots.const_data_ptr();
    a.key_cache = key_cache.mutable_data_ptr();
    a.value_cache = value_cache.mutable_data_ptr();
    if (cg.format != CacheFormat::kSame) {
      a.k_scale = static_cast<const float*>(k_scale->const_data_ptr());
      a.v_scale = static_cast<const float*>(v_scale->const_data_ptr());
    }
    a.key_chunks = p.rot_chunks + ceil_div(g.head_dim - 2 * g.half, W);
    a.value_chunks = ceil_div(cg.value_dim, W);
    a.v_vec = cg.v_last == 1 && aligned(a.value, kVecBytes) && cg.v_token % W == 0 &&
              cg.v_head % W == 0 && cg.value_dim % W == 0;
    p.tail_chunks = std::max(a.key_chunks, a.value_chunks) - p.rot_chunks;
    plan_block(p, std::max(a.key_chunks, a.value_chunks), g.target[0].heads + cg.kv_heads,
               g.tokens, max_blocks);
    run(p, a);
  });
}

}  // namespace rope::gpu
