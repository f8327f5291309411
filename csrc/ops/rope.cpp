// The op schemas, defined once for every device. Kernels are registered per device
// (cpu/rope_cpu.cpp, cuda/rope_cuda.cu); fake kernels, autograd and the in-place bookkeeping are
// registered from Python (rope_ext/_registrations.py). docs/architecture.md walks through them.
#include <torch/csrc/stable/library.h>

STABLE_TORCH_LIBRARY(rope, m) {
  // Rotated copy of x (..., head_dim). cos/sin (..., rotary_dim/2) have x's number of dims (or
  // one), each dim x's size or 1.
  m.def("apply(Tensor x, Tensor cos, Tensor sin, bool interleaved=False) -> Tensor");
  // The same into a caller's buffer: out (x's shape and dtype, contiguous, sharing no memory
  // with the inputs) is overwritten. Returns nothing: torch's functionalization (torch.compile,
  // opcheck) handles a mutated argument but not a custom op whose output aliases an input.
  m.def(
      "apply.out(Tensor x, Tensor cos, Tensor sin, bool interleaved=False, *, Tensor(a!) out) "
      "-> ()");
  // Gradient of apply w.r.t. x: the inverse rotation of grad.
  m.def("apply_backward(Tensor grad, Tensor cos, Tensor sin, bool interleaved=False) -> Tensor");
  // In-place rotation of query (..., Hq, D) and key (..., Hk, D) by the rows of cos_sin_cache
  // (max_position, rotary_dim) at positions (query.shape[:-2]): dims [rope_dim_offset,
  // rope_dim_offset + rotary_dim) of each head; inverse=True rotates by the negative angle.
  m.def(
      "apply_(Tensor(a!) query, Tensor(b!)? key, Tensor positions, Tensor cos_sin_cache, "
      "bool interleaved=False, int rope_dim_offset=0, bool inverse=False) -> ()");
  // Multimodal RoPE (Qwen2-VL, Qwen3-VL): positions (3,) + query.shape[:-2] = (temporal,
  // height, width); mrope_section splits the rotary_dim/2 pairs into 3 groups, in order
  // (chunked) or T,H,W,T,H,W,... (mrope_interleaved), group j rotated by component j;
  // rope_dim_offset and inverse as for apply_.
  m.def(
      "mrope_(Tensor(a!) query, Tensor(b!)? key, Tensor positions, Tensor cos_sin_cache, "
      "int[] mrope_section, bool interleaved=False, bool mrope_interleaved=False, "
      "int rope_dim_offset=0, bool inverse=False) -> ()");
  // Rotated copy of x (..., H, D) by the rows of the tables cos and sin (max_position,
  // rotary_dim/2) at positions (x.shape[:-2], or (3,) + x.shape[:-2] with mrope_section);
  // inverse=True rotates by the negative angle (its own gradient). The differentiable twin of
  // apply_ and mrope_.
  m.def(
      "apply_positions(Tensor x, Tensor positions, Tensor cos, Tensor sin, bool interleaved=False, "
      "bool inverse=False, int[]? mrope_section=None, bool mrope_interleaved=False) -> Tensor");
  // Serving: apply_ on query and key (tokens, heads, head_dim), then the rotated key and value
  // written into the paged caches (num_blocks, block_size, Hk, D) at slot_mapping (tokens,);
  // negative slots are skipped. kv_cache_dtype: "auto" (the key's dtype) or "fp8"/"fp8_e4m3"/
  // "fp8_e5m2" with float32 scales (stored = value / scale, saturated).
  m.def(
      "apply_and_cache_(Tensor(a!) query, Tensor(b!) key, Tensor value, Tensor positions, "
      "Tensor cos_sin_cache, Tensor(c!) key_cache, Tensor(d!) value_cache, Tensor slot_mapping, "
      "bool interleaved=False, str kv_cache_dtype=\"auto\", Tensor? k_scale=None, "
      "Tensor? v_scale=None) -> ()");
  // K-shift: the keys of the paged key_cache (num_blocks, block_size, Hk, head_dim) at the
  // slots of slot_mapping (N,) (negative: skipped) rotated in place by delta (shape () or (N,))
  // positions: the unit (cos, sin) of table row |delta|, negated sin for delta < 0; float8
  // caches dequantized with k_scale, rotated, requantized (saturated). Kernels:
  // cpu/shift_cpu.cpp, cuda/shift_cuda.cu.
  m.def(
      "shift_kv_cache_(Tensor(a!) key_cache, Tensor slot_mapping, Tensor delta, "
      "Tensor cos_sin_cache, bool interleaved=False, str kv_cache_dtype=\"auto\", "
      "Tensor? k_scale=None) -> ()");
  // The compiled CPU kernel variant that serves: 0 baseline, 1 avx2, 2 avx512, 3 avx512_bf16.
  m.def("cpu_isa() -> int");
  // Serve with CPU variant isa (-1: the best the CPU supports); returns the variant serving.
  m.def("set_cpu_isa(int isa) -> int");
  // CPU outputs of at least `bytes` take non-temporal stores (-1: the last-level cache size);
  // returns the threshold in use.
  m.def("set_cpu_stream_threshold(int bytes) -> int");
}
