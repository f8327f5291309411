// Host-side validation for rope.mrope_, shared by every device's kernel.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include <torch/csrc/stable/tensor.h>

#include "mrope_geometry.h"

namespace rope {

// rope.mrope_(query, key, positions, cos_sin_cache, mrope_section): shapes, dtypes, devices and
// sections. The range of the positions is data; each device checks it before writing.
MropeGeometry check_mrope(const torch::stable::Tensor& query,
                          const std::optional<torch::stable::Tensor>& key,
                          const torch::stable::Tensor& positions,
                          const torch::stable::Tensor& cos_sin_cache,
                          const std::vector<int64_t>& mrope_section);

}  // namespace rope
