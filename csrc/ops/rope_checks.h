// Argument validation shared by every device's kernels. Each check names the argument and what
// was expected, and runs before any output is written, so a rejected call changes nothing.
#pragma once

#include <optional>

#include <torch/csrc/stable/tensor.h>

#include "rope_geometry.h"

namespace rope {

using torch::stable::Tensor;

// rope.apply(x, cos, sin) and rope.apply_backward(grad, cos, sin): `x_name` is the name of the
// rotated argument in the calling op's schema ("x" or "grad").
ApplyGeometry check_apply(const Tensor& x, const Tensor& cos, const Tensor& sin, const char* op,
                          const char* x_name);

// rope.apply.out(x, cos, sin, out=out): check_apply, then `out` must have the device, dtype and
// shape of x, be contiguous, and share no memory with x, cos or sin (the kernels read their
// inputs while writing out; for an in-place rotation there is rope.apply_).
ApplyGeometry check_apply_out(const Tensor& x, const Tensor& cos, const Tensor& sin,
                              const Tensor& out);

// rope.apply_(query, key, positions, cos_sin_cache). Shapes and dtypes only: the range of the
// positions is data and is checked by each device where it reads them.
InplaceGeometry check_apply_inplace(const Tensor& query, const std::optional<Tensor>& key,
                                    const Tensor& positions, const Tensor& cos_sin_cache);
// The same checks, reported under another op's name (rope.mrope_ validates through it).
InplaceGeometry check_apply_inplace(const Tensor& query, const std::optional<Tensor>& key,
                                    const Tensor& positions, const Tensor& cos_sin_cache,
                                    const char* op);

bool is_supported_float(torch::headeronly::ScalarType t);

}  // namespace rope
