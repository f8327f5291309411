#include "cpu_env.h"

#include <cstdlib>

#include <torch/csrc/stable/library.h>

namespace rope {

int64_t env_mib_bytes(const char* name, int64_t fallback, const char* meaning) {
  const char* env = std::getenv(name);
  if (env == nullptr || *env == '\0') return fallback;
  char* end = nullptr;
  const long long mb = std::strtoll(env, &end, 10);
  STD_TORCH_CHECK(*end == '\0' && mb >= 0 && mb <= (int64_t(1) << 40), name,
                  " must be a whole number of MiB >= 0 (", meaning, "), got '", env, "'");
  return static_cast<int64_t>(mb) << 20;
}

}  // namespace rope
