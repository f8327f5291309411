// Which compiled variant of the CPU kernels serves (the best the CPU supports, or a lower one
// chosen with rope.set_cpu_isa, so every variant can be tested on one machine), and from which
// output size stores are non-temporal. Registers the ops that report and set both.
#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <fstream>
#include <string>

#include <torch/csrc/stable/library.h>

#include "../checks.h"
#include "kernel_api.h"

namespace rope {
namespace {

CpuIsa best_in_cpu() {
#ifdef ROPE_CPU_X86_VARIANTS
  __builtin_cpu_init();
  // __builtin_cpu_supports also checks that the OS saves the wider registers (XCR0).
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) {
    return __builtin_cpu_supports("avx512bf16") ? CpuIsa::kAvx512Bf16 : CpuIsa::kAvx512;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c")) {
    return CpuIsa::kAvx2;
  }
#endif
  return CpuIsa::kBaseline;
}

// The best variant both this CPU and this build have (kernel_api.h: ROPE_CPU_MAX_ISA).
CpuIsa best_supported() {
  return static_cast<CpuIsa>(std::min(static_cast<int>(best_in_cpu()), ROPE_CPU_MAX_ISA));
}

std::atomic<int> g_isa{-1};  // -1: not chosen yet

// The size of cpu0's highest-level cache as Linux sysfs reports it ("32768K"), 0 if unreadable.
// (glibc's sysconf(_SC_LEVEL3_CACHE_SIZE) reports a whole socket's L3 in some VMs.)
int64_t last_level_cache_bytes() {
  int best_level = 0;
  int64_t best_bytes = 0;
  for (int i = 0; i < 8; ++i) {
    const std::string dir = "/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(i) + "/";
    std::ifstream level_file(dir + "level"), size_file(dir + "size");
    int level = 0;
    std::string size;
    if (!(level_file >> level) || !(size_file >> size) || size.empty()) continue;
    char* end = nullptr;
    int64_t bytes = std::strtoll(size.c_str(), &end, 10);
    if (*end == 'K') bytes <<= 10;
    else if (*end == 'M') bytes <<= 20;
    if (level > best_level && bytes > 0) {
      best_level = level;
      best_bytes = bytes;
    }
  }
  return best_bytes;
}

int64_t default_stream_threshold() {
  static const int64_t bytes = [] {
    const int64_t llc = last_level_cache_bytes();
    return llc > 0 ? llc : int64_t{32} << 20;
  }();
  return bytes;
}

std::atomic<int64_t> g_stream_threshold{-1};  // -1: the default

// rope.cpu_isa(bool best=False) -> int: 0 baseline, 1 avx2, 2 avx512, 3 avx512_bf16. A query:
// it changes no setting (another thread's calls keep the variant they were given).
int64_t cpu_isa_op(bool best) {
  return static_cast<int64_t>(best ? best_supported() : selected_cpu_isa());
}

// rope.set_cpu_isa(int isa) -> int: serve with variant `isa` (-1: the best this CPU supports);
// returns the variant now serving. A variant this CPU lacks is an error.
int64_t set_cpu_isa_op(int64_t isa) {
  const int64_t best = static_cast<int64_t>(best_supported());
  ROPE_CHECK(isa >= -1 && isa < kNumCpuIsa, "rope.set_cpu_isa: isa must be -1 (the best) or 0..3 "
             "(baseline, avx2, avx512, avx512_bf16), got ", isa);
  ROPE_CHECK(isa <= best, "rope.set_cpu_isa: this CPU (or this build) supports variants up to ",
             best, ", got ", isa);
  g_isa.store(static_cast<int>(isa < 0 ? best : isa));
  return static_cast<int64_t>(selected_cpu_isa());
}

// rope.set_cpu_stream_threshold(int bytes) -> int: outputs of at least `bytes` are written with
// non-temporal stores (-1: the size of the last-level cache); returns the threshold now in use.
int64_t set_cpu_stream_threshold_op(int64_t bytes) {
  ROPE_CHECK(bytes >= -1, "rope.set_cpu_stream_threshold: bytes must be >= 0, or -1 for the "
             "last-level cache size, got ", bytes);
  g_stream_threshold.store(bytes);
  return cpu_stream_threshold_bytes();
}

}  // namespace

CpuIsa selected_cpu_isa() {
  int isa = g_isa.load(std::memory_order_relaxed);
  if (isa < 0) {  // first use: the best, unless a set_cpu_isa got there first
    const int best = static_cast<int>(best_supported());
    isa = g_isa.compare_exchange_strong(isa, best) ? best : isa;
  }
  return static_cast<CpuIsa>(isa);
}

const CpuKernels* selected_cpu_kernels() {
  const CpuIsa isa = selected_cpu_isa();
  return ROPE_CPU_ENTRY(isa, cpu_kernels_baseline, cpu_kernels_avx2, cpu_kernels_avx512,
                        cpu_kernels_avx512_bf16);
}

int64_t cpu_stream_threshold_bytes() {
  const int64_t t = g_stream_threshold.load(std::memory_order_relaxed);
  return t >= 0 ? t : default_stream_threshold();
}

}  // namespace rope

// No tensor arguments, so no backend key: CompositeExplicitAutograd serves every call.
STABLE_TORCH_LIBRARY_IMPL(rope, CompositeExplicitAutograd, m) {
  m.impl("cpu_isa", TORCH_BOX(&rope::cpu_isa_op));
  m.impl("set_cpu_isa", TORCH_BOX(&rope::set_cpu_isa_op));
  m.impl("set_cpu_stream_threshold", TORCH_BOX(&rope::set_cpu_stream_threshold_op));
}
