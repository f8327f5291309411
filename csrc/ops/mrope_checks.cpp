#include "mrope_checks.h"

#include <sstream>
#include <string>

#include <torch/csrc/stable/ops.h>
#include <torch/headeronly/util/Exception.h>

#include "rope_checks.h"

namespace rope {

namespace {

template <typename Seq>
std::string list_str(const Seq& v, int64_t n) {
  std::ostringstream s;
  s << "[";
  for (int64_t d = 0; d < n; ++d) s << (d ? ", " : "") << v[d];
  s << "]";
  return s.str();
}

std::string shape_str(const torch::stable::Tensor& t) {
  std::vector<int64_t> sizes(t.dim());
  for (int64_t d = 0; d < t.dim(); ++d) sizes[d] = t.size(d);
  return list_str(sizes, t.dim());
}

}  // namespace

MropeGeometry check_mrope(const torch::stable::Tensor& query,
                          const std::optional<torch::stable::Tensor>& key,
                          const torch::stable::Tensor& positions,
                          const torch::stable::Tensor& cache,
                          const std::vector<int64_t>& mrope_section) {
  const char* op = "rope.mrope_";
  STD_TORCH_CHECK(query.dim() >= 2, op,
                  ": query must have shape (..., num_heads, head_dim), got ", shape_str(query));
  const int64_t nlead = query.dim() - 2;
  bool pos_shape = positions.dim() == nlead + 1 && positions.size(0) == kMropeComponents;
  for (int64_t d = 0; pos_shape && d < nlead; ++d) {
    pos_shape = positions.size(d + 1) == query.size(d);
  }
  STD_TORCH_CHECK(pos_shape, op,
                  ": positions must have shape (3,) + query.shape[:-2] (temporal, height, width; "
                  "query is ",
                  shape_str(query), "), got ", shape_str(positions));

  // Component 0 has exactly the shape rope.apply_ expects; the rest share its strides.
  MropeGeometry g;
  g.inplace = check_apply_inplace(query, key, torch::stable::select(positions, 0, 0), cache, op);
  g.pos_component_stride = positions.stride(0);

  const int64_t n = static_cast<int64_t>(mrope_section.size());
  STD_TORCH_CHECK(n == kMropeComponents, op,
                  ": mrope_section must have 3 entries (temporal, height, width), got ",
                  list_str(mrope_section, n));
  int64_t total = 0;
  for (int j = 0; j < kMropeComponents; ++j) {
    STD_TORCH_CHECK(mrope_section[j] >= 0, op, ": mrope_section entries must be >= 0, got ",
                    list_str(mrope_section, n));
    total += mrope_section[j];
    g.section_end[j] = total;
  }
  STD_TORCH_CHECK(total == g.inplace.half, op, ": mrope_section ", list_str(mrope_section, n),
                  " must sum to rotary_dim/2 = cos_sin_cache.size(1)/2 = ", g.inplace.half,
                  ", got ", total);
  return g;
}

}  // namespace rope
