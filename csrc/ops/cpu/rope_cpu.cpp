// CPU kernels for rope.apply (and its out= overload), rope.apply_backward and rope.apply_.
// Rows (one head_dim vector each) are split across threads. Rows contiguous along the head dim
// go to the vectorized kernels of the ISA chosen at load time (rope_cpu_isa.h); the portable
// kernels below serve any strides, and every call on a CPU without AVX2 (or with
// ROPE_EXT_CPU_ISA=baseline). Within a row the portable unit-stride case is a separate
// instantiation with compile-time strides so the compiler vectorizes it.
#include <algorithm>

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include "../../rope_math.h"
#include "../dispatch.h"
#include "../rope_checks.h"
#include "cpu_output_cache.h"
#include "cpu_stream_policy.h"
#include "rope_cpu_isa.h"

namespace rope {
namespace {

using torch::headeronly::ScalarType;

// Work per task: at least this many elements, so tiny calls run inline on the calling thread.
constexpr int64_t kGrainElements = 1 << 15;

int64_t grain_rows(int64_t elements_per_row) {
  return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, elements_per_row));
}

// Runs fn over [0, n) on the calling thread when the work is below one grain (decode-sized
// calls: waking the pool costs more than the work), else across torch's intra-op threads.
template <typename F>
void run_rows(int64_t n, int64_t grain, const F& fn) {
  if (n <= grain || torch::stable::get_num_threads() <= 1) {
    fn(0, n);
  } else {
    torch::stable::parallel_for(0, n, grain, fn);
  }
}

int dt_index(ScalarType t) {
  switch (t) {
    case ScalarType::Float:
      return kF32;
    case ScalarType::Double:
      return kF64;
    case ScalarType::Half:
      return kF16;
    default:
      return kBF16;
  }
}

// Strides of one row's operands along the head dim; all 1 in the contiguous instantiation.
struct RowStrides {
  int64_t x, out, cos, sin;
};

// Rotates one row: out[pair] = rotate(x[pair], cos[i], sin[i]) for i < half; dims >= 2*half are
// copied when `copy_tail` (a fresh output) and left alone in place.
template <typename x_t, typename tab_t, bool kInterleaved, bool kInverse, bool kContig>
inline void rotate_row(const x_t* x, x_t* out, const tab_t* cos, const tab_t* sin, int64_t half,
                       int64_t head_dim, RowStrides st, bool copy_tail) {
  using acc_t = opmath_t<x_t>;
  const int64_t xs = kContig ? 1 : st.x, os = kContig ? 1 : st.out;
  const int64_t cs = kContig ? 1 : st.cos, ss = kContig ? 1 : st.sin;
  for (int64_t i = 0; i < half; ++i) {
    const int64_t p0 = pair_first(i, half, kInterleaved), p1 = pair_second(i, half, kInterleaved);
    acc_t o0, o1;
    rotate_pair<kInverse, acc_t>(static_cast<acc_t>(x[p0 * xs]), static_cast<acc_t>(x[p1 * xs]),
                                 static_cast<acc_t>(cos[i * cs]), static_cast<acc_t>(sin[i * ss]),
                                 o0, o1);
    out[p0 * os] = static_cast<x_t>(o0);
    out[p1 * os] = static_cast<x_t>(o1);
  }
  if (copy_tail) {
    for (int64_t j = 2 * half; j < head_dim; ++j) out[j * os] = x[j * xs];
  }
}

template <typename x_t, typename tab_t, bool kInverse>
using RowFn = void (*)(const x_t*, x_t*, const tab_t*, const tab_t*, int64_t, int64_t, RowStrides,
                       bool);

template <typename x_t, typename tab_t, bool kInverse>
RowFn<x_t, tab_t, kInverse> pick_row_fn(bool interleaved, bool contiguous) {
  if (interleaved) {
    return contiguous ? rotate_row<x_t, tab_t, true, kInverse, true>
                      : rotate_row<x_t, tab_t, true, kInverse, false>;
  }
  return contiguous ? rotate_row<x_t, tab_t, false, kInverse, true>
                    : rotate_row<x_t, tab_t, false, kInverse, false>;
}

// Writes rotate(x) into `out` (contiguous, x's shape and dtype, validated by the caller).
template <bool kInverse>
void apply_into(const Tensor& x, const Tensor& cos, const Tensor& sin, bool interleaved,
                const ApplyGeometry& g, Tensor& out) {
  if (g.rows == 0 || g.head_dim == 0) return;
  const int64_t out_bytes = g.rows * g.head_dim * static_cast<int64_t>(out.element_size());
  const int64_t grain = grain_rows(g.head_dim);
  const CpuKernels* simd = selected_cpu_kernels();
  if (simd != nullptr && g.x_last == 1 && g.half <= kSimdMaxHalf) {
    const ApplyJob job{x.const_data_ptr(), out.mutable_data_ptr(), cos.const_data_ptr(),
                       sin.const_data_ptr(), &g, interleaved, kInverse,
                       out_bytes >= cpu_stream_threshold_bytes()};
    const ApplyRowsFn fn = simd->apply[dt_index(x.scalar_type())][dt_index(cos.scalar_type())];
    run_rows(g.rows, grain, [&](int64_t b, int64_t e) { fn(job, b, e); });
    return;
  }
  const bool contiguous = g.x_last == 1 && g.cos_last == 1 && g.sin_last == 1;
  const RowStrides st{g.x_last, 1, g.cos_last, g.sin_last};
  ROPE_DISPATCH_FLOATING(x.scalar_type(), "rope.apply", [&] {
    using x_t = scalar_t;
    ROPE_DISPATCH_FLOATING(cos.scalar_type(), "rope.apply", [&] {
      using tab_t = scalar_t;
      const auto row_fn = pick_row_fn<x_t, tab_t, kInverse>(interleaved, contiguous);
      const x_t* xp = x.const_data_ptr<x_t>();
      const tab_t* cp = cos.const_data_ptr<tab_t>();
      const tab_t* sp = sin.const_data_ptr<tab_t>();
      x_t* op_ = out.mutable_data_ptr<x_t>();
      run_rows(g.rows, grain, [&](int64_t b, int64_t e) {
        LeadIterator it(g.lead, b);
        for (int64_t r = b; r < e; ++r, it.next()) {
          row_fn(xp + it.offset[0], op_ + r * g.head_dim, cp + it.offset[1], sp + it.offset[2],
                 g.half, g.head_dim, st, true);
        }
      });
    });
  });
}

template <bool kInverse>
Tensor apply_cpu(const Tensor& x, const Tensor& cos, const Tensor& sin, bool interleaved) {
  const char* op = kInverse ? "rope.apply_backward" : "rope.apply";
  const ApplyGeometry g = check_apply(x, cos, sin, op, kInverse ? "grad" : "x");
  Tensor out = new_cpu_output(x);
  apply_into<kInverse>(x, cos, sin, interleaved, g, out);
  return out;
}

Tensor apply_forward_cpu(Tensor x, Tensor cos, Tensor sin, bool interleaved) {
  return apply_cpu<false>(x, cos, sin, interleaved);
}

Tensor apply_backward_cpu(Tensor grad, Tensor cos, Tensor sin, bool interleaved) {
  return apply_cpu<true>(grad, cos, sin, interleaved);
}

// The caller's buffer; large outputs take non-temporal stores like apply's (bench/NOTES.md 8).
void apply_out_cpu(Tensor x, Tensor cos, Tensor sin, bool interleaved, Tensor out) {
  const ApplyGeometry g = check_apply_out(x, cos, sin, out);
  apply_into<false>(x, cos, sin, interleaved, g, out);
}

// Positions are read once on the host before anything is written, so an out-of-range one
// rejects the whole call with nothing changed.
template <typename pos_t>
void check_positions(const pos_t* pos, const InplaceGeometry& g) {
  LeadIterator it(g.lead, 0);
  for (int64_t t = 0; t < g.tokens; ++t, it.next()) {
    const int64_t p = static_cast<int64_t>(pos[it.offset[2]]);
    STD_TORCH_CHECK(p >= 0 && p < g.max_position, "rope.apply_: positions must lie in [0, ",
                    g.max_position, ") (max_position = cos_sin_cache.size(0)), got ", p,
                    " at flat index ", t);
  }
}

void apply_inplace_cpu(Tensor query, std::optional<Tensor> key, Tensor positions,
                       Tensor cos_sin_cache, bool interleaved) {
  const InplaceGeometry g = check_apply_inplace(query, key, positions, cos_sin_cache);
  const bool pos64 = positions.scalar_type() == ScalarType::Long;
  if (pos64) {
    check_positions(positions.const_data_ptr<int64_t>(), g);
  } else {
    check_positions(positions.const_data_ptr<int32_t>(), g);
  }
  if (g.tokens == 0 || g.half == 0) return;
  const int64_t grain = grain_rows((g.q_heads + g.k_heads) * g.head_dim);
  const CpuKernels* simd = selected_cpu_kernels();
  if (simd != nullptr && g.q_last == 1 && (g.k_heads == 0 || g.k_last == 1) &&
      g.half <= kSimdMaxHalf) {
    const InplaceJob job{query.mutable_data_ptr(),
                         key.has_value() ? key->mutable_data_ptr() : nullptr,
                         positions.const_data_ptr(),
                         pos64,
                         cos_sin_cache.const_data_ptr(),
                         &g,
                         interleaved};
    const InplaceTokensFn fn =
        simd->inplace[dt_index(query.scalar_type())][dt_index(cos_sin_cache.scalar_type())];
    run_rows(g.tokens, grain, [&](int64_t b, int64_t e) { fn(job, b, e); });
    return;
  }
  const bool contiguous = g.q_last == 1 && (g.k_heads == 0 || g.k_last == 1) &&
                          g.cache_col_stride == 1;
  ROPE_DISPATCH_FLOATING(query.scalar_type(), "rope.apply_", [&] {
    using x_t = scalar_t;
    ROPE_DISPATCH_FLOATING(cos_sin_cache.scalar_type(), "rope.apply_", [&] {
      using tab_t = scalar_t;
      const auto row_fn = pick_row_fn<x_t, tab_t, false>(interleaved, contiguous);
      x_t* qp = query.mutable_data_ptr<x_t>();
      x_t* kp = key.has_value() ? key->mutable_data_ptr<x_t>() : nullptr;
      const tab_t* cache = cos_sin_cache.const_data_ptr<tab_t>();
      const void* pos = positions.const_data_ptr();
      const RowStrides qs{g.q_last, g.q_last, g.cache_col_stride, g.cache_col_stride};
      const RowStrides ks{g.k_last, g.k_last, g.cache_col_stride, g.cache_col_stride};
      run_rows(g.tokens, grain, [&](int64_t b, int64_t e) {
        LeadIterator it(g.lead, b);
        for (int64_t t = b; t < e; ++t, it.next()) {
          const int64_t p = pos64 ? static_cast<const int64_t*>(pos)[it.offset[2]]
                                  : static_cast<const int32_t*>(pos)[it.offset[2]];
          const tab_t* c = cache + p * g.cache_row_stride;
          const tab_t* s = c + g.half * g.cache_col_stride;
          for (int64_t h = 0; h < g.q_heads; ++h) {
            x_t* row = qp + it.offset[0] + h * g.q_head_stride;
            row_fn(row, row, c, s, g.half, g.head_dim, qs, false);
          }
          for (int64_t h = 0; h < g.k_heads; ++h) {
            x_t* row = kp + it.offset[1] + h * g.k_head_stride;
            row_fn(row, row, c, s, g.half, g.head_dim, ks, false);
          }
        }
      });
    });
  });
}

}  // namespace
}  // namespace rope

STABLE_TORCH_LIBRARY_IMPL(rope, CPU, m) {
  m.impl("apply", TORCH_BOX(&rope::apply_forward_cpu));
  m.impl("apply.out", TORCH_BOX(&rope::apply_out_cpu));
  m.impl("apply_backward", TORCH_BOX(&rope::apply_backward_cpu));
  m.impl("apply_", TORCH_BOX(&rope::apply_inplace_cpu));
}
