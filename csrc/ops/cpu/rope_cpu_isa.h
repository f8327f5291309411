// The contract between rope_cpu.cpp (validation, allocation, threading) and the per-ISA
// vectorized kernels (rope_cpu_avx2.cpp, rope_cpu_avx512.cpp, rope_cpu_avx512bf16.cpp). The per-ISA files are compiled
// with `#pragma GCC target`, so nothing here may define a non-trivial inline function: an
// inline function with external linkage compiled for AVX-512 in one file could be the copy the
// linker keeps for every caller, and crash CPUs without it. Plain data and declarations only.
#pragma once

#include <cstdint>

#include "../rope_geometry.h"

namespace rope {

// Ordered: a higher value needs a superset of the CPU features of a lower one.
enum class CpuIsa : int { kBaseline = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Bf16 = 3 };

// Storage of 16-bit floats as raw bits, so the ISA files need no torch header.
struct HalfBits {
  uint16_t bits;
};
struct BF16Bits {
  uint16_t bits;
};

enum DtIndex : int { kF32 = 0, kF64 = 1, kF16 = 2, kBF16 = 3, kNumDt = 4 };

// One call of rope.apply / rope.apply_backward, contiguous along the head dim of x (x_last == 1);
// the tables may have any strides. `stream`: write `out` with non-temporal stores (large outputs
// that will not be read back from cache soon).
struct ApplyJob {
  const void* x;
  void* out;
  const void* cos;
  const void* sin;
  const ApplyGeometry* g;
  bool interleaved;
  bool inverse;
  bool stream;
};

// One call of rope.apply_, contiguous along the head dim of query and key; positions already
// validated against max_position.
struct InplaceJob {
  void* query;
  void* key;
  const void* positions;
  bool pos64;
  const void* cache;
  const InplaceGeometry* g;
  bool interleaved;
};

using ApplyRowsFn = void (*)(const ApplyJob&, int64_t begin_row, int64_t end_row);
using InplaceTokensFn = void (*)(const InplaceJob&, int64_t begin_token, int64_t end_token);

// Largest rotary_dim/2 the vectorized kernels take (their table buffers live on the stack);
// larger ones go to the portable kernel.
constexpr int64_t kSimdMaxHalf = 512;

// Kernels of one ISA, indexed [x dtype][table dtype].
struct CpuKernels {
  ApplyRowsFn apply[kNumDt][kNumDt];
  InplaceTokensFn inplace[kNumDt][kNumDt];
};

// nullptr when the library was built without that ISA (a non-x86 target or another compiler:
// rope_cpu_isa.cpp defines them so then).
const CpuKernels* cpu_kernels_avx2();
const CpuKernels* cpu_kernels_avx512();
const CpuKernels* cpu_kernels_avx512_bf16();

// Whether the per-ISA files compile their kernels (x86-64 with GCC or clang, whose target
// pragmas they use).
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define ROPE_CPU_X86_VARIANTS 1
#endif

// Defines `entry()` in a per-ISA file, after its target region: the table of that file's
// make_kernels(), built on first use, which is only on a CPU known to have the ISA
// (make_kernels only takes addresses).
#define ROPE_DEFINE_CPU_KERNELS(entry)              \
  namespace rope {                                  \
  const CpuKernels* entry() {                       \
    static const CpuKernels kernels = make_kernels(); \
    return &kernels;                                \
  }                                                 \
  }

// The ISA that serves, chosen once: the best the CPU supports, capped by ROPE_EXT_CPU_ISA
// (baseline|avx2|avx512|avx512_bf16) when set.
CpuIsa selected_cpu_isa();
// Its kernels; nullptr for the baseline.
const CpuKernels* selected_cpu_kernels();
const char* cpu_isa_name(CpuIsa isa);

}  // namespace rope
