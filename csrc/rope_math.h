// Per-pair RoPE math shared by the CPU and CUDA kernels, so the two cannot drift apart.
// Everything here is header-only and callable from host and device code.
#pragma once

#include <cstdint>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define ROPE_HD __host__ __device__ __forceinline__
#else
#define ROPE_HD inline
#endif

namespace rope {

// Arithmetic type for a storage type: float for half/bfloat16/float, double for double.
template <typename T>
struct OpMath {
  using type = float;
};
template <>
struct OpMath<double> {
  using type = double;
};
template <typename T>
using opmath_t = typename OpMath<T>::type;

// Rotate one pair (a, b) by the angle whose cosine/sine are (c, s).
// kInverse rotates by the negative angle: the backward of the forward rotation,
// since the rotation is orthogonal (ROPE.md section 4).
template <bool kInverse, typename acc_t>
ROPE_HD void rotate_pair(acc_t a, acc_t b, acc_t c, acc_t s, acc_t& out_a, acc_t& out_b) {
  if (kInverse) s = -s;
  out_a = a * c - b * s;
  out_b = b * c + a * s;
}

// Offsets (in elements along the head dim) of the two members of pair i.
// interleaved: (2i, 2i+1); half-split ("rotate_half"): (i, i + half).
ROPE_HD int64_t pair_first(int64_t i, int64_t half, bool interleaved) {
  return interleaved ? 2 * i : i;
}
ROPE_HD int64_t pair_second(int64_t i, int64_t half, bool interleaved) {
  return interleaved ? 2 * i + 1 : i + half;
}

}  // namespace rope
