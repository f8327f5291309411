// How an allocating op first touches its output (docs/cpu-performance.md "First touch of a fresh
// output").
//
// A large output straight from malloc is often a fresh mapping that the OS has not backed yet:
// the first write to each 4 KiB page faults, and the page is zeroed before the store lands.
// Faulting page by page costs a trap per page; streaming (non-temporal) stores into such pages
// cost more again, since the zeroing has just pulled the lines into the cache and the streamed
// line then goes to memory a second time. So for an output found not backed:
// - stores are plain, never streamed (the zeroed lines are in the cache and are written there);
// - each thread backs the chunk of its own tokens it is about to write, kFirstTouchChunk bytes
//   at a time, with one madvise(MADV_POPULATE_WRITE) (Linux 5.14+) instead of a fault per page,
//   and writes it while the zeroed chunk is still in its cache.
// The contents of memory are not changed by either step; elsewhere (not Linux, an older kernel,
// an output already backed, a layout not token-major) the kernel writes as before.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "../geometry.h"

#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14; older kernels answer EINVAL
#endif
#endif

namespace rope {
namespace {

// Outputs below this are not checked: the check (two mincore calls) would cost more than the
// faults it could save, and such outputs are mostly recycled heap memory anyway.
constexpr int64_t kFreshCheckBytes = int64_t{1} << 20;
// Bytes backed ahead of the kernel at a time: well inside a core's L2, so the zeroed lines are
// still there when the kernel writes them, and large enough that the syscall is cheap per byte.
constexpr int64_t kFirstTouchChunk = int64_t{128} << 10;

// The token-major part of an output: where token t's rows are bytes [t * per_token,
// (t + 1) * per_token) of it. per_token == 0: not such a layout, or not a fresh output.
struct FreshOutput {
  char* base = nullptr;
  int64_t per_token = 0;
};

#if defined(__linux__)
std::atomic<bool> g_populate_works{true};

uintptr_t page_bytes() {
  static const uintptr_t p = [] {
    const long s = sysconf(_SC_PAGESIZE);
    return s > 0 ? static_cast<uintptr_t>(s) : uintptr_t{4096};
  }();
  return p;
}

// Whether the page holding p is backed (mincore); true where that cannot be told.
bool page_backed(const char* p) {
  const uintptr_t page = reinterpret_cast<uintptr_t>(p) & ~(page_bytes() - 1);
  unsigned char v = 0;
  if (mincore(reinterpret_cast<void*>(page), page_bytes(), &v) != 0) return true;
  return (v & 1) != 0;
}

// Backs the pages of [b, e) for writing, without writing them.
void populate(char* b, char* e) {
  if (!g_populate_works.load(std::memory_order_relaxed) || e <= b) return;
  const uintptr_t mask = page_bytes() - 1;
  const uintptr_t lo = reinterpret_cast<uintptr_t>(b) & ~mask;
  const uintptr_t hi = (reinterpret_cast<uintptr_t>(e) + mask) & ~mask;
  if (madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_POPULATE_WRITE) != 0) {
    g_populate_works.store(false, std::memory_order_relaxed);  // no such advice here: fault
  }
}
#else
bool page_backed(const char*) { return true; }
void populate(char*, char*) {}
#endif

// The FreshOutput of `out` (bytes, contiguous) written by g's target 0, or per_token == 0 when it
// is small, already backed (its first or last page), or its tokens' rows are not in token order.
FreshOutput fresh_output(const RotateGeometry& g, void* out, int64_t bytes) {
  FreshOutput f;
  if (bytes < kFreshCheckBytes || g.tokens <= 0 || bytes % g.tokens != 0) return f;
  const int64_t per_token = bytes / g.tokens;
  const int64_t per_token_elems = g.target[0].heads * g.head_dim;
  if (per_token_elems <= 0 || per_token % per_token_elems != 0) return f;
  int64_t expected = per_token_elems;  // the dst stride of a token-major layout, innermost first
  for (int d = g.lead.ndim - 1; d >= 0; --d) {
    if (g.lead.sizes[d] > 1 && g.lead.strides[kDst0][d] != expected) return f;
    expected *= g.lead.sizes[d];
  }
  char* base = static_cast<char*>(out);
  if (page_backed(base) && page_backed(base + bytes - 1)) return f;
  f.base = base;
  f.per_token = per_token;
  return f;
}

// A fresh output small enough to stay in the cache, written in an order other than token after
// token, backed at once (one madvise); returns no FreshOutput (nothing left to back).
FreshOutput back_at_once(const FreshOutput& f, int64_t bytes) {
  if (f.per_token != 0) populate(f.base, f.base + bytes);
  return FreshOutput{};
}

// fn(b, e) over tokens [b, e), each kFirstTouchChunk of the output backed just before it is
// written; plain fn(b, e) when f is not a fresh output.
template <typename F>
void first_touch_chunks(const FreshOutput& f, int64_t b, int64_t e, const F& fn) {
  if (f.per_token == 0) {
    fn(b, e);
    return;
  }
  const int64_t step = std::max<int64_t>(1, kFirstTouchChunk / f.per_token);
  for (int64_t c = b; c < e; c += std::min(step, e - c)) {
    const int64_t ce = c + std::min(step, e - c);
    populate(f.base + c * f.per_token, f.base + ce * f.per_token);
    fn(c, ce);
  }
}

}  // namespace
}  // namespace rope
