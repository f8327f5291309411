// The op schemas, defined once for every device. Kernels are registered per device in
// csrc/ops/<device>/; fake (meta) kernels and autograd are registered from Python.
#include <torch/csrc/stable/library.h>

STABLE_TORCH_LIBRARY(rope, m) {
  // Rotated copy of x. cos/sin: (..., rotary_dim/2), broadcastable to x.shape[:-1].
  m.def("apply(Tensor x, Tensor cos, Tensor sin, bool interleaved=False) -> Tensor");
  // The same into a caller's buffer: out (x's shape and dtype, contiguous, sharing no memory
  // with the inputs) is overwritten. Skips allocating (and the OS zeroing) a fresh one. Returns
  // nothing: torch's functionalization (torch.compile, opcheck) rejects a custom op whose
  // output aliases an input, while it handles a mutated argument; rope_ext.apply_rope returns out.
  m.def(
      "apply.out(Tensor x, Tensor cos, Tensor sin, bool interleaved=False, *, Tensor(a!) out) "
      "-> ()");
  // Gradient of apply w.r.t. x: the inverse rotation of grad.
  m.def("apply_backward(Tensor grad, Tensor cos, Tensor sin, bool interleaved=False) -> Tensor");
  // In-place rotation of query and key by cos/sin rows gathered at `positions`.
  m.def(
      "apply_(Tensor(a!) query, Tensor(b!)? key, Tensor positions, Tensor cos_sin_cache, "
      "bool interleaved=False) -> ()");
  // Multimodal RoPE (Qwen2-VL): positions (3, ...) = (temporal, height, width); mrope_section
  // splits the rotary_dim/2 pairs, in order, into 3 groups, group j rotated by component j.
  m.def(
      "mrope_(Tensor(a!) query, Tensor(b!)? key, Tensor positions, Tensor cos_sin_cache, "
      "int[] mrope_section, bool interleaved=False) -> ()");
  // Which compiled variant of the CPU kernels serves: 0 baseline, 1 avx2, 2 avx512,
  // 3 avx512_bf16.
  m.def("cpu_isa() -> int");
  // The cache of recycled blocks that large CPU outputs come from (cpu/cpu_output_cache.cpp):
  // [limit bytes, cached bytes, cached blocks, reuses, new blocks, available (torch >= 2.11)].
  m.def("cpu_output_cache_info() -> int[]");
  // Frees every cached block (outputs still alive keep theirs).
  m.def("cpu_output_cache_empty() -> ()");
}
