// Which CPU outputs are written with non-temporal (streaming) stores.
#pragma once

#include <cstdint>

namespace rope {

// Outputs of at least this many bytes are streamed: larger than the last-level cache, they cannot
// stay in it, and streaming skips reading each destination line before writing it. Smaller ones
// take plain stores and stay in cache for whatever reads them next (bench/NOTES.md 3 and 12).
// The cache size comes from Linux sysfs (cpu0's highest-level cache; 32 MiB where unknown);
// ROPE_EXT_CPU_STREAM_MB overrides it (the tests use it to run both paths on any machine).
int64_t cpu_stream_threshold_bytes();

}  // namespace rope
