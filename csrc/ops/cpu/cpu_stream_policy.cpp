#include "cpu_stream_policy.h"

#include "cpu_env.h"

#include <cstdlib>
#include <fstream>
#include <string>

#include <torch/csrc/stable/library.h>

namespace rope {
namespace {

constexpr int64_t kUnknownCacheBytes = int64_t(32) << 20;

// The size of cpu0's highest-level cache as sysfs reports it ("32768K"), 0 if unreadable. (glibc's
// sysconf(_SC_LEVEL3_CACHE_SIZE) is no help: in the project's VM it reports 320 MiB, the whole
// socket's L3, for a guest that sees 32 MiB.)
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

int64_t threshold_from_env_or_cache() {
  const int64_t llc = last_level_cache_bytes();
  return env_mib_bytes("ROPE_EXT_CPU_STREAM_MB", llc > 0 ? llc : kUnknownCacheBytes,
                       "CPU outputs of at least that size are written with non-temporal stores");
}

}  // namespace

int64_t cpu_stream_threshold_bytes() {
  static const int64_t bytes = threshold_from_env_or_cache();
  return bytes;
}

}  // namespace rope
