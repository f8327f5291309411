// The per-thread code of rope.shift_kv_cache_ (K-shift, kv_shift/geometry.h), plain C++ like
// rope_cuda_thread.h: nvcc builds the kernel from it (kv_shift/cuda/shift_cuda.cu), g++ the CPU simulator
// (tests/sim/cuda_sim.cpp) that checks every access. Scalar accesses: a K-shift moves a few
// cache rows per evicted or reused token, and the pairs of a float8 row are single bytes.
#pragma once

#include <cstdint>
#include <type_traits>

#include "../geometry.h"
#include "../../cuda/rope_cuda_thread.h"

namespace rope::gpu {

// x_t: the cache's element type (uint8_t: float8 codes); acc_t: its arithmetic type (float,
// double for double caches), which is also the table's.
template <typename x_t, typename acc_t>
struct ShiftArgs {
  ShiftDesc d;
  x_t* cache;
  const void* slots;
  const void* delta;
  const acc_t* table;
  float scale;  // k_scale of a float8 cache (read on the host), else 1
};

// A cache element in the arithmetic type: float8 codes dequantized (code * scale).
template <typename x_t, typename acc_t>
ROPE_HD acc_t shift_load(const x_t* p, CacheFormat format, float scale) {
  if constexpr (std::is_same_v<x_t, uint8_t>) {
    return fp8_to_float(load(p), format) * scale;
  } else {
    return static_cast<acc_t>(load(p));
  }
}

// And back: rounded to nearest even; float8 requantized (value / scale, saturated).
template <typename x_t, typename acc_t>
ROPE_HD void shift_store(x_t* p, acc_t v, CacheFormat format, float scale) {
  if constexpr (std::is_same_v<x_t, uint8_t>) {
    const Fp8Format fmt = format == CacheFormat::kE4M3FN ? Fp8Format::kE4M3FN : Fp8Format::kE5M2;
    store(p, float_to_fp8(v / scale, fmt));
  } else {
    store(p, static_cast<x_t>(v));
  }
}

// threadIdx.x over the pairs of a row, y over the key heads, z over listed slots within a block;
// the grid strides over the listed slots. The host checked slots and deltas (and that no slot
// is listed twice, so no two threads touch one element); the device checks guard its reads.
template <typename x_t, typename acc_t>
ROPE_HD void shift_thread(const ShiftArgs<x_t, acc_t>& a, const ThreadPos& tp) {
  const ShiftDesc& d = a.d;
  const int64_t step = static_cast<int64_t>(tp.grid_dim.x) * tp.block_dim.z;
  for (int64_t i = static_cast<int64_t>(tp.block.x) * tp.block_dim.z + tp.thread.z; i < d.n;
       i += step) {
    const int64_t slot = load_position(a.slots, d.slots64, i * d.slot_stride);
    if (slot < 0) continue;
    const int64_t k = load_position(a.delta, d.delta64, i * d.delta_stride);
    const bool ok = slot < d.slots && k < d.rows && k > -d.rows;
    ROPE_DEVICE_CHECK(ok, "rope: shift_kv_cache_ slot or delta out of range");
    if (!ok) continue;
    const int64_t row = k < 0 ? -k : k;
    x_t* const base = a.cache + d.kc.slot_row(slot, d.block_size);
    for (int64_t j = tp.thread.x; j < d.half; j += tp.block_dim.x) {
      acc_t c, s;
      unit_rotation(load(a.table + row * d.cos_row + j * d.cos_col),
                    load(a.table + row * d.cos_row + (d.half + j) * d.cos_col), k < 0, c, s);
      const int64_t ea = d.interleaved ? 2 * j : j;
      const int64_t eb = d.interleaved ? 2 * j + 1 : d.half + j;
      for (int64_t h = tp.thread.y; h < d.heads; h += tp.block_dim.y) {
        x_t* const pa = base + h * d.kc.head + ea * d.kc.last;
        x_t* const pb = base + h * d.kc.head + eb * d.kc.last;
        acc_t ra, rb;
        rotate_pair<acc_t>(shift_load<x_t, acc_t>(pa, d.format, a.scale),
                           shift_load<x_t, acc_t>(pb, d.format, a.scale), c, s, ra, rb);
        shift_store<x_t, acc_t>(pa, ra, d.format, a.scale);
        shift_store<x_t, acc_t>(pb, rb, d.format, a.scale);
      }
    }
  }
}

}  // namespace rope::gpu
