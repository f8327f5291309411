// Fresh outputs. torch::stable::new_empty (stable ABI >= 2.10) calls aten::new_empty through
// the dispatcher by name: an operator lookup and a full dispatch (autograd, backend select) per
// call, about a microsecond, which a decode-sized call pays on top of a kernel of a few. A
// kernel's output needs none of that: aoti_torch_empty_strided allocates a plain contiguous
// tensor on `like`'s device through torch's allocator (the CUDA caching allocator on a GPU).
#pragma once

#include <cstdint>
#include <stdexcept>
#include <vector>

#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/tensor.h>

namespace rope {

// A contiguous tensor of `sizes` with like's device and dtype. Its strides are computed as
// torch computes them, and refused as torch refuses them: an empty input's other dims may
// multiply past int64 (its numel, 0, bounds nothing), and the reference path's torch.empty_like
// raises this same message.
inline torch::stable::Tensor new_contiguous(const torch::stable::Tensor& like,
                                            torch::headeronly::IntHeaderOnlyArrayRef sizes) {
  constexpr size_t kInline = 16;  // every op's usual rank; more dims take the heap
  const size_t nd = sizes.size();
  int64_t inline_strides[kInline];
  std::vector<int64_t> heap_strides(nd > kInline ? nd : 0);
  int64_t* strides = nd > kInline ? heap_strides.data() : inline_strides;
  int64_t step = 1;
  for (size_t d = nd; d-- > 0;) {
    strides[d] = step;
    if (d > 0 && __builtin_mul_overflow(step, sizes[d] > 1 ? sizes[d] : int64_t{1}, &step)) {
      throw std::runtime_error("Stride calculation overflowed");
    }
  }
  int32_t device_type = 0, device_index = 0, dt = 0;
  STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_get_device_type(like.get(), &device_type));
  STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_get_device_index(like.get(), &device_index));
  STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_get_dtype(like.get(), &dt));
  AtenTensorHandle out = nullptr;
  STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_empty_strided(static_cast<int64_t>(nd), sizes.data(),
                                                         strides, dt,
                                                         device_type, device_index, &out));
  return torch::stable::Tensor(out);
}

// The bytes of an allocated tensor's elements (which fit: they were allocated).
inline int64_t nbytes(const torch::stable::Tensor& t) {
  return t.numel() * static_cast<int64_t>(t.element_size());
}

}  // namespace rope
