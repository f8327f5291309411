// The DtIndex (kernel_api.h) of a tensor's dtype, for the CPU host files (rope_cpu.cpp,
// qk_norm/cpu/qk_norm_cpu.cpp). Host side only: the ISA files need no torch header.
#pragma once

#include "../checks.h"
#include "kernel_api.h"

namespace rope {
namespace {

int dt_index(ScalarType t) {
  switch (t) {
    case ScalarType::Float:
      return kF32;
    case ScalarType::Double:
      return kF64;
    case ScalarType::Half:
      return kF16;
    case ScalarType::BFloat16:
      return kBF16;
    default:  // the checks admit only the four: reaching here is a bug, not a bf16 tensor
      fail("rope: no CPU kernel for dtype ", dtype_str(t));
  }
}

}  // namespace
}  // namespace rope
