// Sizes the CPU kernels take from the environment.
#pragma once

#include <cstdint>

namespace rope {

// Environment variable `name` as a whole number of MiB >= 0, in bytes; `fallback` when it is unset
// or empty. Anything else is an error naming the variable, `meaning` and the value given.
int64_t env_mib_bytes(const char* name, int64_t fallback, const char* meaning);

}  // namespace rope
