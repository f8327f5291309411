// A cache of recycled memory blocks for large CPU outputs, and the ops that report and empty it.
//
// Why: glibc serves every allocation above 32 MiB with a fresh mmap and returns it to the OS on
// free, so each large output torch allocates is faulted in and zeroed by the kernel page by page
// on its first write; on the project's 2-core machine that took longer than the rotation itself
// (rope.apply at 0.2-0.6x of a copy into an existing buffer, bench/NOTES.md 2). The same bytes
// written into memory that is already backed run at 1-1.5x copy. So, like torch's CUDA caching
// allocator, freed output blocks are kept (up to a limit) and handed to the next output that fits.
//
// The block goes back to the cache when the last tensor (or view) using its storage dies: torch
// calls the deleter given to torch_from_blob. The cache holds only blocks no tensor uses, at most
// ROPE_EXT_CPU_CACHE_MB MiB of them (default 1024; 0 turns the cache off); the oldest are freed
// first. rope.cpu_output_cache_empty frees them all (rope_ext.empty_cpu_cache()).
#include "cpu_output_cache.h"

#include "cpu_env.h"

#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif
#if defined(__unix__) || defined(__APPLE__)
#include <pthread.h>
#endif

#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>

// torch_from_blob (a tensor over foreign memory, with a deleter) joined the stable C shim in
// torch 2.11; this library targets 2.10. Declared weak, it resolves to torch's function when the
// loading torch has one and to null otherwise, and then large outputs are plain allocations.
#if defined(__ELF__)
#define ROPE_HAVE_WEAK_FROM_BLOB 1
extern "C" __attribute__((weak)) AOTITorchError torch_from_blob(
    void* data, int64_t ndim, const int64_t* sizes_ptr, const int64_t* strides_ptr,
    int64_t storage_offset, int32_t dtype, int32_t device_type, int32_t device_index,
    AtenTensorHandle* ret, int32_t layout, const uint8_t* opaque_metadata,
    int64_t opaque_metadata_size, void (*deleter)(void* data, void* ctx), void* deleter_ctx);
#endif

namespace rope {
namespace {

using torch::stable::Tensor;

// Below this glibc recycles freed memory itself (its mmap threshold adapts up to 32 MiB), and the
// advice below needs whole 2 MiB pages to matter.
constexpr int64_t kMinBytes = int64_t(16) << 20;
constexpr int64_t kHugePage = int64_t(2) << 20;

// Transparent huge pages make the first write of a new block fault once per 2 MiB instead of once
// per 4 KiB (what torch's allocator does under THP_MEM_ALLOC_ENABLE=1). Only the 2 MiB-aligned
// interior is advised; the advice changes how pages are backed, nothing else.
void advise_huge_pages(void* data, int64_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  if (bytes < kMinBytes) return;
  const uintptr_t huge = static_cast<uintptr_t>(kHugePage);
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(data) + huge - 1) & ~(huge - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + bytes) & ~(huge - 1);
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#else
  (void)data;
  (void)bytes;
#endif
}

int64_t limit_from_env() {
  return env_mib_bytes("ROPE_EXT_CPU_CACHE_MB", int64_t(1024) << 20,
                       "0 turns the CPU output cache off");
}

struct Block {
  void* ptr;
  int64_t bytes;
};

class OutputCache {
 public:
  // The limit is read on first use, so a bad value surfaces as an error from the first large
  // rope.apply (or from rope_ext.cpu_cache_info()), not at library load.
  int64_t limit() {
    std::call_once(limit_once_, [this] { limit_ = limit_from_env(); });
    return limit_;
  }

  // A block of at least `bytes` (at most a quarter more, so a small request does not pin a big
  // block), or a new one; null if the system is out of memory.
  void* take(int64_t bytes, int64_t* block_bytes) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      int best = -1;
      for (int i = 0; i < static_cast<int>(free_.size()); ++i) {
        const int64_t b = free_[i].bytes;
        if (b >= bytes && b <= bytes + bytes / 4 && (best < 0 || b < free_[best].bytes)) best = i;
      }
      if (best >= 0) {
        const Block blk = free_[best];
        free_.erase(free_.begin() + best);
        cached_ -= blk.bytes;
        ++hits_;
        *block_bytes = blk.bytes;
        return blk.ptr;
      }
      ++misses_;
    }
    const int64_t rounded = (bytes + kHugePage - 1) / kHugePage * kHugePage;
    void* p = nullptr;
    if (posix_memalign(&p, static_cast<size_t>(kHugePage), static_cast<size_t>(rounded)) != 0) {
      return nullptr;
    }
    advise_huge_pages(p, rounded);
    *block_bytes = rounded;
    return p;
  }

  // Called by torch (any thread) when the last user of a block's storage dies.
  void give_back(void* p, int64_t bytes) {
    const int64_t lim = limit();
    std::vector<void*> to_free;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (bytes > lim) {
        to_free.push_back(p);
      } else {
        while (cached_ + bytes > lim) {
          to_free.push_back(free_.front().ptr);
          cached_ -= free_.front().bytes;
          free_.erase(free_.begin());
        }
        free_.push_back(Block{p, bytes});
        cached_ += bytes;
      }
    }
    for (void* q : to_free) std::free(q);
  }

  void empty() {
    std::vector<Block> blocks;
    {
      std::lock_guard<std::mutex> lock(mu_);
      blocks.swap(free_);
      cached_ = 0;
    }
    for (const Block& b : blocks) std::free(b.ptr);
  }

  std::vector<int64_t> info() {
    const int64_t lim = limit();
    std::lock_guard<std::mutex> lock(mu_);
    return {lim, cached_, static_cast<int64_t>(free_.size()), hits_, misses_};
  }

 private:
  std::once_flag limit_once_;
  int64_t limit_ = 0;
  std::mutex mu_;
  std::vector<Block> free_;  // oldest first
  int64_t cached_ = 0, hits_ = 0, misses_ = 0;
};

// Never destroyed: torch may free an output (and call the deleter) during interpreter teardown,
// after static destructors have run.
OutputCache* g_cache = nullptr;

// A child of fork() starts with a fresh cache: the parent's mutex may have been held by another
// thread at the fork (a DataLoader worker forked while a backward pass frees an output), and
// would never be released in the child. The parent's kept blocks are forgotten there (the
// child's copies of them stay mapped, unused); outputs the child inherited return to the new one.
void reset_cache_in_child() { g_cache = new OutputCache(); }

OutputCache& cache() {
  static const bool once = [] {
    g_cache = new OutputCache();
#if defined(__unix__) || defined(__APPLE__)
    pthread_atfork(nullptr, nullptr, reset_cache_in_child);
#endif
    return true;
  }();
  (void)once;
  return *g_cache;
}

bool cache_available() {
#ifdef ROPE_HAVE_WEAK_FROM_BLOB
  return torch_from_blob != nullptr;
#else
  return false;
#endif
}

#ifdef ROPE_HAVE_WEAK_FROM_BLOB
void release_block(void* data, void* ctx) {
  cache().give_back(data, static_cast<int64_t>(reinterpret_cast<uintptr_t>(ctx)));
}

// A contiguous tensor of `like`'s shape and dtype over block p, in *out; false on failure.
bool tensor_over_block(const Tensor& like, void* p, int64_t block_bytes, AtenTensorHandle* out) {
  const auto sizes = like.sizes();
  const int64_t ndim = static_cast<int64_t>(sizes.size());
  std::vector<int64_t> strides(sizes.size());
  int64_t st = 1;
  for (int64_t d = ndim - 1; d >= 0; --d) {
    strides[d] = st;
    st *= sizes[d];
  }
  int32_t dtype = 0, device_index = 0;
  if (aoti_torch_get_dtype(like.get(), &dtype) != AOTI_TORCH_SUCCESS ||
      aoti_torch_get_device_index(like.get(), &device_index) != AOTI_TORCH_SUCCESS) {
    return false;
  }
  return torch_from_blob(p, ndim, sizes.data(), strides.data(), 0, dtype,
                         aoti_torch_device_type_cpu(), device_index, out,
                         aoti_torch_layout_strided(), nullptr, 0, release_block,
                         reinterpret_cast<void*>(static_cast<uintptr_t>(block_bytes))) ==
         AOTI_TORCH_SUCCESS;
}
#endif

std::vector<int64_t> cpu_output_cache_info() {
  std::vector<int64_t> v = cache().info();
  v.push_back(cache_available() ? 1 : 0);
  return v;
}

void cpu_output_cache_empty() { cache().empty(); }

}  // namespace

Tensor new_cpu_output(const Tensor& like) {
  const int64_t bytes = like.numel() * static_cast<int64_t>(like.element_size());
#ifdef ROPE_HAVE_WEAK_FROM_BLOB
  if (bytes >= kMinBytes && cache_available() && cache().limit() > 0) {
    int64_t block_bytes = 0;
    if (void* p = cache().take(bytes, &block_bytes)) {
      AtenTensorHandle h = nullptr;
      if (tensor_over_block(like, p, block_bytes, &h)) return Tensor(h);
      cache().give_back(p, block_bytes);
    }
  }
#endif
  Tensor out = torch::stable::new_empty(like, like.sizes());
  advise_huge_pages(out.mutable_data_ptr(), bytes);
  return out;
}

}  // namespace rope

// No tensor arguments, so no backend key: CompositeExplicitAutograd serves every call.
STABLE_TORCH_LIBRARY_IMPL(rope, CompositeExplicitAutograd, m) {
  m.impl("cpu_output_cache_info", TORCH_BOX(&rope::cpu_output_cache_info));
  m.impl("cpu_output_cache_empty", TORCH_BOX(&rope::cpu_output_cache_empty));
}
