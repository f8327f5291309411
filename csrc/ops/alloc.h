// Fresh outputs. torch::stable::new_empty (stable ABI >= 2.10) calls aten::new_empty through
// the dispatcher by name: an operator lookup and a full dispatch (autograd, backend select) per
// call, about a microsecond, which a decode-sized call pays on top of a kernel of a few. A
// kernel's output needs none of that: aoti_torch_empty_strided allocates a plain contiguous
// tensor on `like`'s device through torch's allocator (the CUDA caching allocator on a GPU).
#pragma once

#include <cstdint>

#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/tensor.h>

namespace rope {

// A contiguous tensor of `sizes` (at most 64 dims: every op's tensors are checked to far fewer)
// with like's device and dtype.
inline torch::stable::Tensor new_contiguous(const torch::stable::Tensor& like,
                                            torch::headeronly::IntHeaderOnlyArrayRef sizes) {
  constexpr int64_t kMaxDims = 64;
  const int64_t nd = static_cast<int64_t>(sizes.size());
  STD_TORCH_CHECK(nd <= kMaxDims, "rope: an output of ", nd, " dims (at most ", kMaxDims, ")");
  int64_t strides[kMaxDims];
  int64_t step = 1;
  for (int64_t d = nd - 1; d >= 0; --d) {
    strides[d] = step;
    step *= sizes[d] > 1 ? sizes[d] : 1;  // the input's numel fits: so does every partial product
  }
  int32_t device_type = 0, device_index = 0, dt = 0;
  STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_get_device_type(like.get(), &device_type));
  STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_get_device_index(like.get(), &device_index));
  STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_get_dtype(like.get(), &dt));
  AtenTensorHandle out = nullptr;
  STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_empty_strided(nd, sizes.data(), strides, dt,
                                                         device_type, device_index, &out));
  return torch::stable::Tensor(out);
}

}  // namespace rope
