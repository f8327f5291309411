// Chooses, once per process, which compiled variant of the CPU kernels serves: the best the CPU
// supports, or a lower one forced by ROPE_EXT_CPU_ISA (so every variant can be tested on one
// machine). Also registers rope.cpu_isa, which reports the choice without Python.
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include <torch/csrc/stable/library.h>

#include "rope_cpu_isa.h"

namespace rope {
namespace {

CpuIsa best_supported() {
#ifdef ROPE_CPU_X86_VARIANTS
  __builtin_cpu_init();
  // __builtin_cpu_supports also checks that the OS saves the wider registers (XCR0).
  if (__builtin_cpu_supports("avx512f") &&
      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c")) {
    return __builtin_cpu_supports("avx512bf16") ? CpuIsa::kAvx512Bf16 : CpuIsa::kAvx512;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c")) {
    return CpuIsa::kAvx2;
  }
#endif
  return CpuIsa::kBaseline;
}

CpuIsa choose() {
  CpuIsa isa = best_supported();
  const char* env = std::getenv("ROPE_EXT_CPU_ISA");
  if (env == nullptr || env[0] == '\0' || std::strcmp(env, "auto") == 0) return isa;
  CpuIsa cap;
  if (std::strcmp(env, "baseline") == 0) {
    cap = CpuIsa::kBaseline;
  } else if (std::strcmp(env, "avx2") == 0) {
    cap = CpuIsa::kAvx2;
  } else if (std::strcmp(env, "avx512") == 0) {
    cap = CpuIsa::kAvx512;
  } else if (std::strcmp(env, "avx512_bf16") == 0) {
    cap = CpuIsa::kAvx512Bf16;
  } else {
    std::fprintf(stderr,
                 "rope_ext: ROPE_EXT_CPU_ISA=%s is not one of auto, baseline, avx2, avx512, "
                 "avx512_bf16; "
                 "using %s\n",
                 env, cpu_isa_name(isa));
    return isa;
  }
  if (cap > isa) {
    std::fprintf(stderr, "rope_ext: ROPE_EXT_CPU_ISA=%s: this CPU lacks it; using %s\n", env,
                 cpu_isa_name(isa));
    return isa;
  }
  return cap;
}

// The schema's int: 0 baseline, 1 avx2, 2 avx512, 3 avx512_bf16 (rope_ext.cpu_isa() maps it
// to a name).
int64_t cpu_isa_op() { return static_cast<int64_t>(selected_cpu_isa()); }

}  // namespace

const char* cpu_isa_name(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kAvx512Bf16:
      return "avx512_bf16";
    case CpuIsa::kAvx512:
      return "avx512";
    case CpuIsa::kAvx2:
      return "avx2";
    default:
      return "baseline";
  }
}

#ifndef ROPE_CPU_X86_VARIANTS
const CpuKernels* cpu_kernels_avx2() { return nullptr; }
const CpuKernels* cpu_kernels_avx512() { return nullptr; }
const CpuKernels* cpu_kernels_avx512_bf16() { return nullptr; }
#endif

CpuIsa selected_cpu_isa() {
  static const CpuIsa isa = choose();
  return isa;
}

const CpuKernels* selected_cpu_kernels() {
  static const CpuKernels* kernels = [] {
    switch (selected_cpu_isa()) {
      case CpuIsa::kAvx512Bf16:
        return cpu_kernels_avx512_bf16();
      case CpuIsa::kAvx512:
        return cpu_kernels_avx512();
      case CpuIsa::kAvx2:
        return cpu_kernels_avx2();
      default:
        return static_cast<const CpuKernels*>(nullptr);
    }
  }();
  return kernels;
}

}  // namespace rope

// No tensor arguments, so no backend key: CompositeExplicitAutograd serves every call.
STABLE_TORCH_LIBRARY_IMPL(rope, CompositeExplicitAutograd, m) {
  m.impl("cpu_isa", TORCH_BOX(&rope::cpu_isa_op));
}
