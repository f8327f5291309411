// Host side of the CUDA ops, shared by the kernels (rope_cuda_kernels.cu) and the CPU simulator
// (tests/sim/rope_cuda_sim.cpp): validation, table conversion, the optional position check, the
// launch plan and the dtype/layout dispatch. Only the final step differs: a `Runner` either
// launches the kernel instantiation it is given or runs its per-thread code over the whole grid.
#pragma once

#include <cstdlib>
#include <cstring>
#include <optional>
#include <type_traits>

#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include "../dispatch.h"
#include "../rope_checks.h"
#include "rope_cuda_thread.h"

namespace rope::gpu {

using torch::headeronly::ScalarType;
using torch::stable::Tensor;

template <bool B>
using Bool = std::integral_constant<bool, B>;

// Environment switch of the position check (see check_positions_on_host).
constexpr const char* kCheckPositionsEnv = "ROPE_EXT_CHECK_POSITIONS";

inline bool position_checking_enabled() {
  const char* v = std::getenv(kCheckPositionsEnv);
  return v != nullptr && *v != '\0' && std::strcmp(v, "0") != 0 &&
         std::strcmp(v, "false") != 0 && std::strcmp(v, "False") != 0;
}

// Raises, before anything is written, if a position lies outside [0, max_position), with the
// CPU kernel's message. It copies the positions to the host: a device sync, so it is opt-in
// (and cannot run inside CUDA graph capture). Without it the kernel skips such tokens.
inline void check_positions_on_host(const Tensor& positions, int64_t max_position) {
  if (positions.numel() == 0) return;
  Tensor cpu = positions;
  if (!positions.is_cpu()) {
    cpu = torch::stable::to(positions, torch::stable::Device(torch::headeronly::DeviceType::CPU));
  }
  cpu = torch::stable::contiguous(cpu);
  const int64_t n = cpu.numel();
  const bool pos64 = cpu.scalar_type() == ScalarType::Long;
  const void* data = cpu.const_data_ptr();
  for (int64_t t = 0; t < n; ++t) {
    const int64_t p = pos64 ? static_cast<const int64_t*>(data)[t]
                            : static_cast<int64_t>(static_cast<const int32_t*>(data)[t]);
    STD_TORCH_CHECK(p >= 0 && p < max_position, "rope.apply_: positions must lie in [0, ",
                    max_position, ") (max_position = cos_sin_cache.size(0)), got ", p,
                    " at flat index ", t);
  }
}

// The kernels read tables in the arithmetic type of x (float, or double for double x). Casting a
// table once here gives exactly the values the CPU kernels get by casting each element, and
// keeps one table type per x dtype; float32 tables with bf16/fp16/fp32 x need no cast.
inline Tensor tables_as_opmath(const Tensor& t, ScalarType x_type) {
  const ScalarType want = x_type == ScalarType::Double ? ScalarType::Double : ScalarType::Float;
  if (t.scalar_type() == want) return t;
  return torch::stable::to(t, std::optional<ScalarType>(want));
}

template <class F>
void dispatch_bools(bool a, bool b, F&& f) {
  if (a) {
    b ? f(Bool<true>{}, Bool<true>{}) : f(Bool<true>{}, Bool<false>{});
  } else {
    b ? f(Bool<false>{}, Bool<true>{}) : f(Bool<false>{}, Bool<false>{});
  }
}

// Runs rope.apply (kInverse = false) or rope.apply_backward (true) into `out` (contiguous, x's
// shape and dtype, validated by the caller); g = check_apply of (x, cos_in, sin_in). `run(plan,
// args, interleaved, inverse, vec)` executes the plan; the last three are Bool<> tags.
template <bool kInverse, class Runner>
void apply_into_host(const Tensor& x, const Tensor& cos_in, const Tensor& sin_in,
                     bool interleaved, ApplyGeometry g, const Tensor& out, Runner&& run,
                     int64_t max_blocks, const char* op, const char* x_name) {
  const Tensor cos = tables_as_opmath(cos_in, x.scalar_type());
  const Tensor sin = tables_as_opmath(sin_in, x.scalar_type());
  if (cos.scalar_type() != cos_in.scalar_type()) {
    g = check_apply(x, cos, sin, op, x_name);  // the strides of the cast tables
  }
  if (g.rows == 0 || g.head_dim == 0) return;
  ROPE_DISPATCH_FLOATING(x.scalar_type(), "rope.apply", [&] {
    using x_t = scalar_t;
    using tab_t = opmath_t<x_t>;
    ApplyArgs<x_t, tab_t> a{x.const_data_ptr<x_t>(), out.mutable_data_ptr<x_t>(),
                            cos.const_data_ptr<tab_t>(), sin.const_data_ptr<tab_t>(), g, 0, 0,
                            false};
    const LaunchPlan p = plan_apply<x_t>(g, a.x, a.out, interleaved, max_blocks);
    a.rot_chunks = p.rot_chunks;
    a.tail_chunks = p.tail_chunks;
    a.idx32 = p.idx32;
    dispatch_bools(interleaved, p.vec,
                   [&](auto il, auto vec) { run(p, a, il, Bool<kInverse>{}, vec); });
  });
}

// rope.apply (kInverse = false) and rope.apply_backward (true) into a fresh tensor.
template <bool kInverse, class Runner>
Tensor apply_host(const Tensor& x, const Tensor& cos_in, const Tensor& sin_in, bool interleaved,
                  Runner&& run, int64_t max_blocks = kMaxBlocks) {
  const char* op = kInverse ? "rope.apply_backward" : "rope.apply";
  const char* x_name = kInverse ? "grad" : "x";
  const ApplyGeometry g = check_apply(x, cos_in, sin_in, op, x_name);
  Tensor out = torch::stable::new_empty(x, x.sizes());
  apply_into_host<kInverse>(x, cos_in, sin_in, interleaved, g, out, run, max_blocks, op, x_name);
  return out;
}

// rope.apply.out: the same rotation into the caller's `out`.
template <class Runner>
void apply_out_host(const Tensor& x, const Tensor& cos_in, const Tensor& sin_in,
                      bool interleaved, const Tensor& out, Runner&& run,
                      int64_t max_blocks = kMaxBlocks) {
  const ApplyGeometry g = check_apply_out(x, cos_in, sin_in, out);
  apply_into_host<false>(x, cos_in, sin_in, interleaved, g, out, run, max_blocks,
                         "rope.apply.out", "x");
}

// rope.apply_: query and key in one launch. `run(plan, args, interleaved, vec)`.
template <class Runner>
void apply_inplace_host(const Tensor& query, const std::optional<Tensor>& key,
                        const Tensor& positions, const Tensor& cache_in, bool interleaved,
                        Runner&& run, int64_t max_blocks = kMaxBlocks) {
  InplaceGeometry g = check_apply_inplace(query, key, positions, cache_in);
  if (position_checking_enabled()) check_positions_on_host(positions, cache_in.size(0));
  const Tensor cache = tables_as_opmath(cache_in, query.scalar_type());
  if (cache.scalar_type() != cache_in.scalar_type()) {
    g = check_apply_inplace(query, key, positions, cache);  // the strides of the cast cache
  }
  if (g.tokens == 0 || g.half == 0 || g.q_heads + g.k_heads == 0) return;
  ROPE_DISPATCH_FLOATING(query.scalar_type(), "rope.apply_", [&] {
    using x_t = scalar_t;
    using tab_t = opmath_t<x_t>;
    x_t* k = g.k_heads > 0 ? key->mutable_data_ptr<x_t>() : nullptr;
    InplaceArgs<x_t, tab_t> a{query.mutable_data_ptr<x_t>(),
                              k,
                              positions.const_data_ptr(),
                              positions.scalar_type() == ScalarType::Long,
                              cache.const_data_ptr<tab_t>(),
                              g,
                              0,
                              false};
    const LaunchPlan p = plan_apply_inplace<x_t>(g, a.q, a.k, interleaved, max_blocks);
    a.rot_chunks = p.rot_chunks;
    a.idx32 = p.idx32;
    dispatch_bools(interleaved, p.vec, [&](auto il, auto vec) { run(p, a, il, vec); });
  });
}

}  // namespace rope::gpu
