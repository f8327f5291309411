// The contract between rope_cpu.cpp (validation, threading) and the kernel family compiled once
// per instruction set (kernels.h, included by isa_*.cpp). The ISA files are compiled with
// `#pragma GCC target`, so nothing here may define a non-trivial inline function: an inline
// function with external linkage compiled for AVX-512 in one file could be the copy the linker
// keeps for every caller, and crash CPUs without it. Plain data and declarations only.
#pragma once

#include <cstdint>

#include "../quant/cuda/thread.h"
#include "../geometry.h"
#include "../qk_norm/geometry.h"
#include "../kv_shift/geometry.h"

namespace rope {

// Ordered: a higher value needs a superset of the CPU features of a lower one.
enum class CpuIsa : int { kBaseline = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Bf16 = 3 };
constexpr int kNumCpuIsa = 4;

// Storage of 16-bit floats as raw bits, so the ISA files need no torch header.
struct HalfBits {
  uint16_t bits;
};
struct BF16Bits {
  uint16_t bits;
};

// Element types by index.
enum DtIndex : int { kF32 = 0, kF64 = 1, kF16 = 2, kBF16 = 3, kNumDt = 4 };

// One call of a RotateGeometry: the pointers of its operands. Tables may have any float dtype
// (table_dt) and strides; they are converted to the arithmetic type row by row.
struct RotateJob {
  const RotateGeometry* g;
  const void* src[2];
  void* dst[2];
  const void* cos;        // strided: the cos tensor; gathered/MRoPE: the cos table's row 0
  const void* sin;
  const void* positions;  // gathered/MRoPE, already range-checked
  int table_dt;
  bool stream;            // write dst with non-temporal stores (large fresh outputs)
};

// A call's store stage into the paged caches (geometry.h CacheGeometry): after a token's query
// and key rows are written (rotated, or normed and rotated), its key rows and value rows go to
// the caches at its slot. Scales already read. Value rows go through value_out first where it
// is given (the geometry's vo_* strides): RMS-normalized without a weight with v_norm (v_eps >=
// 0), else copied; the stored rows are then the written ones. rope.qk_norm_rope_and_cache_
// with v_norm writes value in place (value_out = value); rope.qk_norm_rope_and_cache writes a
// fresh value.
struct CacheJob {
  const CacheGeometry* g;
  RotateJob rot;          // query and key, rotated in place (rope.apply_and_cache_)
  const void* key;        // the written key rows (token offsets: the geometry's kDst1)
  const void* value;      // the value rows read (v_* strides)
  void* value_out;        // nullptr: value only read and stored
  double v_eps;           // >= 0: v_norm
  const void* slot_mapping;
  void* key_cache;
  void* value_cache;
  float k_scale, v_scale;
};

// A stage run once per token after its rows are written: ctx is the stage's job, off the
// token's operand offsets (geometry.h Operand).
struct TokenHook {
  void (*fn)(const void* ctx, int64_t token, const int64_t* off);
  const void* ctx;
};
using TokenHookFn = void (*)(const void* ctx, int64_t token, const int64_t* off);

// One call of a fused norm + RoPE op (rope.qk_norm_rope*, rope.norm_rope): the geometry, the
// norm, the operands' pointers and element types (DtIndex).
struct NormJob {
  const RotateGeometry* g;
  NormDesc norm;
  const void* src[2];
  void* dst[2];
  const void* w[2];  // nullptr: no weight (rope.norm_rope)
  int w_dt[2];
  // rope.norm_rope's general rows (a form other than kRms, or biases): weights and biases
  // contiguous in the arithmetic type (the host casts them), or nullptr for none.
  bool general = false;
  const void* b[2];
  const void* cos;  // strided: the cos tensor; gathered/MRoPE: the cache's row 0
  const void* sin;
  const void* positions;
  int x_dt, table_dt;
  TokenHook after_token;  // a later stage per token (the paged-cache store), or {nullptr}
};

// One call of rope.qk_norm_rope_backward: per row of x (target 0: x at src, grad_x at dst) and
// of grad (operand kSrc1, target[1].src_*), grad rotated back, then the RMSNorm's backward.
// scratch: per task, kNormBackwardScratch * head_dim elements of the arithmetic type, from
// torch; the first head_dim of them receive the task's share of grad_weight.
struct NormBackwardJob {
  const RotateGeometry* g;
  double eps;
  bool unit_offset;
  const void* x;
  const void* grad;
  void* grad_x;
  const void* w;
  int w_dt;
  int64_t w_stride;
  const void* cos;
  const void* sin;
  int x_dt, table_dt;
};
// grad_weight, its compensation and the current block's sums; the rows of x, of grad, of grad
// rotated back; w; cos and sin
constexpr int64_t kNormBackwardScratch = 8;

// Rows of at most this many elements convert their weights into stack buffers in the norm
// kernel; longer ones get weights the host cast to the arithmetic type.
constexpr int64_t kQkNormStackHeadDim = 1024;

// One call of rope.shift_kv_cache_ (kv_shift/geometry.h ShiftDesc, checked, its data too).
struct ShiftJob {
  const ShiftDesc* d;
  void* cache;        // the key cache: its elements, or float8 codes
  const void* slots;  // slot_mapping, int32 or int64 (d->slots64)
  const void* delta;
  const void* table;  // cos_sin_cache's row 0
  int table_dt;
  float scale;        // k_scale of a float8 cache
};

using RotateTokensFn = void (*)(const RotateJob&, int64_t begin_token, int64_t end_token);
using ShiftSlotsFn = void (*)(const ShiftJob&, int64_t begin_entry, int64_t end_entry);
using NormRopeTokensFn = void (*)(const NormJob&, int64_t begin_token, int64_t end_token);
using CacheTokensFn = void (*)(const CacheJob&, int64_t begin_token, int64_t end_token);
using NormBackwardTokensFn = void (*)(const NormBackwardJob&, int64_t begin_token,
                                      int64_t end_token, void* scratch);
// args: a gpu::QuantArgs (quant/cuda/thread.h) of the entry's element type.
using QuantTokensFn = void (*)(const void* args, int64_t begin_token, int64_t end_token);

// Kernels of one ISA, indexed by the dtype of x (query/key) and, for the cache write, the
// CacheFormat of the caches: the rotation, the norm stage with the rotation (qk_norm/cpu/kernels.h),
// the rotation with the cache store, and the cache store alone (a TokenHook over a CacheJob, for
// the norm kernel's tokens); the K-shift by the cache's dtype, or its float8 format
// (shift_fp8[kSame] is unused).
struct CpuKernels {
  RotateTokensFn rotate[kNumDt];
  NormRopeTokensFn norm_rope[kNumDt];
  NormBackwardTokensFn norm_rope_backward[kNumDt];
  CacheTokensFn cache[kNumDt][3];
  TokenHookFn store[kNumDt][3];
  ShiftSlotsFn shift[kNumDt];
  ShiftSlotsFn shift_fp8[3];
  QuantTokensFn quant[kNumDt];  // float, half, bfloat16 (no float64 quantization)
};

// Whether the x86 ISA files compile their kernels (x86-64 with GCC or clang, whose target
// pragmas they use); elsewhere only the baseline exists.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define ROPE_CPU_X86_VARIANTS 1
#endif

// The highest variant compiled (0 baseline, 1 avx2, 2 avx512, 3 avx512_bf16; all by default).
// A build of only the variants its own machine runs (ROPE_EXT_CPU_VARIANTS=native: the sanitizer
// build, the JIT test) sets it lower: the kernel files above it then define their entry as
// nullptr, and the variant chosen never exceeds it (cpu_isa.cpp).
#ifndef ROPE_CPU_MAX_ISA
#define ROPE_CPU_MAX_ISA 3
#endif

const CpuKernels* cpu_kernels_baseline();
// Defined only where ROPE_CPU_X86_VARIANTS is.
const CpuKernels* cpu_kernels_avx2();
const CpuKernels* cpu_kernels_avx512();
const CpuKernels* cpu_kernels_avx512_bf16();

// Defines `entry()` in a kernel file, after its target region: the table of that file's
// make_kernels(), built on first use, which is only on a CPU known to have the ISA.
#define ROPE_DEFINE_CPU_KERNELS(entry)                \
  namespace rope {                                    \
  const CpuKernels* entry() {                         \
    static const CpuKernels kernels = make_kernels(); \
    return &kernels;                                  \
  }                                                   \
  }
// ... and in a kernel file above ROPE_CPU_MAX_ISA, which compiles nothing else.
#define ROPE_DEFINE_NO_CPU_KERNELS(entry)       \
  namespace rope {                              \
  const CpuKernels* entry() { return nullptr; } \
  }

// The variant that serves: the best the CPU supports unless capped by rope.set_cpu_isa.
CpuIsa selected_cpu_isa();
const CpuKernels* selected_cpu_kernels();
// Outputs of at least this many bytes are written with non-temporal stores.
int64_t cpu_stream_threshold_bytes();
// Whether a call that reads and writes `out_bytes` each stays in the cache: both below the
// threshold of non-temporal stores (the last-level cache's size unless set).
inline bool stays_in_cache(int64_t out_bytes) {
  return out_bytes < cpu_stream_threshold_bytes() / 2;
}

// The entry of variant `isa` of a kernel family, from the family's entry function per variant
// (a family without a bfloat16 variant names its avx512 entry twice): the one mapping every
// family follows. A macro, not a function: the x86 entries are declared everywhere but defined,
// and so named here, only where ROPE_CPU_X86_VARIANTS is.
#ifdef ROPE_CPU_X86_VARIANTS
#define ROPE_CPU_ENTRY(isa, baseline, avx2, avx512, avx512_bf16) \
  ((isa) == CpuIsa::kAvx512Bf16 ? avx512_bf16()                 \
   : (isa) == CpuIsa::kAvx512   ? avx512()                      \
   : (isa) == CpuIsa::kAvx2     ? avx2()                        \
                                : baseline())
#else
#define ROPE_CPU_ENTRY(isa, baseline, avx2, avx512, avx512_bf16) ((void)(isa), baseline())
#endif

}  // namespace rope
