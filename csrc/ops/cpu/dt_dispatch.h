// The storage type of a DtIndex as a C++ type, for the kernel headers (kernels.h,
// qk_norm/cpu/kernels.h): their conversion loops then know it instead of switching per element.
// Included by them, so inside the ISA file's target switch, like the lambdas it calls; internal
// linkage (see kernel_api.h).
#pragma once

#include "kernel_api.h"

namespace rope {
namespace {

// Bytes per element of DtIndex dt.
inline __attribute__((always_inline)) int dt_size(int dt) {
  return dt == kF64 ? 8 : (dt == kF32 ? 4 : 2);
}

// Calls f(T{}) with T the storage type of DtIndex dt.
template <class F>
inline __attribute__((always_inline)) void with_dt_type(int dt, F&& f) {
  switch (dt) {
    case kF32:
      return f(float{});
    case kF64:
      return f(double{});
    case kF16:
      return f(HalfBits{});
    default:
      return f(BF16Bits{});
  }
}

}  // namespace
}  // namespace rope
