// Operand description for rope.mrope_ (multimodal RoPE, the Qwen2-VL family). Plain data, so a
// CUDA kernel can take it by value, like the structs in rope_geometry.h.
#pragma once

#include <cstdint>

#include "rope_geometry.h"

namespace rope {

constexpr int kMropeComponents = 3;  // temporal, height, width

struct MropeGeometry {
  // query/key/cache as for rope.apply_; operand 2 of `inplace.lead` walks positions[0]
  // (component 0), and component j of a token sits j * pos_component_stride further on.
  InplaceGeometry inplace;
  int64_t pos_component_stride = 0;
  // Cumulative mrope_section: pairs [section_end[j-1], section_end[j]) take their angle from
  // position component j; section_end[2] == rotary_dim / 2.
  int64_t section_end[kMropeComponents] = {};
};

// The position component whose cache row pair i reads. Written per pair so a CUDA thread that
// owns one pair can call it directly.
ROPE_HD int mrope_component(int64_t pair, const int64_t section_end[kMropeComponents]) {
  return pair < section_end[0] ? 0 : (pair < section_end[1] ? 1 : 2);
}

}  // namespace rope
