// CPU kernel for rope.mrope_: rope.apply_ with three position components per token.
// Within a row the three sections are separate pair ranges, each with one fixed cache row, so the
// inner loop is the plain rotation loop and vectorizes like rope.apply_'s (unit-stride case as a
// separate instantiation).
#include <algorithm>
#include <vector>

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include "../../rope_math.h"
#include "../dispatch.h"
#include "../mrope_checks.h"

namespace rope {
namespace {

using torch::headeronly::ScalarType;
using torch::stable::Tensor;

constexpr int64_t kGrainElements = 1 << 15;  // tiny calls run inline on the calling thread

// Rotates pairs [lo, hi) of one row in place by the cos/sin of one cache row.
template <typename x_t, typename tab_t, bool kInterleaved, bool kContig>
inline void rotate_range(x_t* row, const tab_t* cos, const tab_t* sin, int64_t lo, int64_t hi,
                         int64_t half, int64_t xs_, int64_t cs_) {
  using acc_t = opmath_t<x_t>;
  const int64_t xs = kContig ? 1 : xs_, cs = kContig ? 1 : cs_;
  for (int64_t i = lo; i < hi; ++i) {
    const int64_t p0 = pair_first(i, half, kInterleaved), p1 = pair_second(i, half, kInterleaved);
    acc_t o0, o1;
    rotate_pair<false, acc_t>(static_cast<acc_t>(row[p0 * xs]), static_cast<acc_t>(row[p1 * xs]),
                              static_cast<acc_t>(cos[i * cs]), static_cast<acc_t>(sin[i * cs]), o0,
                              o1);
    row[p0 * xs] = static_cast<x_t>(o0);
    row[p1 * xs] = static_cast<x_t>(o1);
  }
}

template <typename pos_t>
int64_t read_pos(const void* pos, int64_t offset) {
  return static_cast<int64_t>(static_cast<const pos_t*>(pos)[offset]);
}

// All 3 * tokens positions are read before anything is written, so an out-of-range one rejects
// the whole call unchanged. Component-major, so the flat index matches positions.flatten().
template <typename pos_t>
void check_positions(const void* pos, const MropeGeometry& mg) {
  const InplaceGeometry& g = mg.inplace;
  for (int c = 0; c < kMropeComponents; ++c) {
    LeadIterator it(g.lead, 0);
    for (int64_t t = 0; t < g.tokens; ++t, it.next()) {
      const int64_t p = read_pos<pos_t>(pos, it.offset[2] + c * mg.pos_component_stride);
      STD_TORCH_CHECK(p >= 0 && p < g.max_position, "rope.mrope_: positions must lie in [0, ",
                      g.max_position, ") (max_position = cos_sin_cache.size(0)), got ", p,
                      " at flat index ", c * g.tokens + t);
    }
  }
}

template <typename x_t, typename tab_t, bool kInterleaved, bool kContig>
void mrope_rows(x_t* qp, x_t* kp, const tab_t* cache, const void* pos, bool pos64,
                const MropeGeometry& mg) {
  const InplaceGeometry& g = mg.inplace;
  const int64_t heads = g.q_heads + g.k_heads;
  const int64_t grain = std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, heads * g.head_dim));
  const int64_t cs = g.cache_col_stride;
  torch::stable::parallel_for(0, g.tokens, grain, [&](int64_t b, int64_t e) {
    LeadIterator it(g.lead, b);
    for (int64_t t = b; t < e; ++t, it.next()) {
      const tab_t* cos[kMropeComponents];
      for (int c = 0; c < kMropeComponents; ++c) {
        const int64_t off = it.offset[2] + c * mg.pos_component_stride;
        const int64_t p = pos64 ? read_pos<int64_t>(pos, off) : read_pos<int32_t>(pos, off);
        cos[c] = cache + p * g.cache_row_stride;
      }
      for (int64_t h = 0; h < heads; ++h) {
        const bool is_q = h < g.q_heads;
        x_t* row = is_q ? qp + it.offset[0] + h * g.q_head_stride
                        : kp + it.offset[1] + (h - g.q_heads) * g.k_head_stride;
        const int64_t xs = is_q ? g.q_last : g.k_last;
        int64_t lo = 0;
        for (int c = 0; c < kMropeComponents; ++c) {
          const int64_t hi = mg.section_end[c];
          rotate_range<x_t, tab_t, kInterleaved, kContig>(row, cos[c], cos[c] + g.half * cs, lo,
                                                          hi, g.half, xs, cs);
          lo = hi;
        }
      }
    }
  });
}

void mrope_cpu(Tensor query, std::optional<Tensor> key, Tensor positions, Tensor cos_sin_cache,
               std::vector<int64_t> mrope_section, bool interleaved) {
  const MropeGeometry mg = check_mrope(query, key, positions, cos_sin_cache, mrope_section);
  const InplaceGeometry& g = mg.inplace;
  const bool pos64 = positions.scalar_type() == ScalarType::Long;
  const void* pos = positions.const_data_ptr();
  if (pos64) {
    check_positions<int64_t>(pos, mg);
  } else {
    check_positions<int32_t>(pos, mg);
  }
  if (g.tokens == 0 || g.half == 0) return;
  const bool contiguous =
      g.q_last == 1 && (g.k_heads == 0 || g.k_last == 1) && g.cache_col_stride == 1;
  ROPE_DISPATCH_FLOATING(query.scalar_type(), "rope.mrope_", [&] {
    using x_t = scalar_t;
    ROPE_DISPATCH_FLOATING(cos_sin_cache.scalar_type(), "rope.mrope_", [&] {
      using tab_t = scalar_t;
      x_t* qp = query.mutable_data_ptr<x_t>();
      x_t* kp = key.has_value() ? key->mutable_data_ptr<x_t>() : nullptr;
      const tab_t* cache = cos_sin_cache.const_data_ptr<tab_t>();
      if (interleaved) {
        contiguous ? mrope_rows<x_t, tab_t, true, true>(qp, kp, cache, pos, pos64, mg)
                   : mrope_rows<x_t, tab_t, true, false>(qp, kp, cache, pos, pos64, mg);
      } else {
        contiguous ? mrope_rows<x_t, tab_t, false, true>(qp, kp, cache, pos, pos64, mg)
                   : mrope_rows<x_t, tab_t, false, false>(qp, kp, cache, pos, pos64, mg);
      }
    });
  });
}

}  // namespace
}  // namespace rope

STABLE_TORCH_LIBRARY_IMPL(rope, CPU, m) {
  m.impl("mrope_", TORCH_BOX(&rope::mrope_cpu));
}
