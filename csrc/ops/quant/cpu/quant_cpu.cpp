// RoPE + FP8 quantization (FlashInfer's rope_quantize_fp8 family) on the CPU: the host side (the
// CUDA ops' checks and arguments, quant/cuda/host.h), the data checks (positions, page
// tables) that the CUDA kernels make on the device, here made first so that a rejected call
// writes nothing, then the ISA's kernel (quant/cpu/kernels.h) over token ranges on torch's thread
// pool.
#include <algorithm>
#include <optional>
#include <string>
#include <type_traits>

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include "../cuda/host.h"
#include "../../routes.h"
#include "../../cpu/kernel_api.h"

namespace rope {
namespace {

int64_t read_index(const void* p, const QuantIndex& ix, int64_t i) {
  return ix.is64 ? static_cast<const int64_t*>(p)[i * ix.stride]
                 : static_cast<const int32_t*>(p)[i * ix.stride];
}

// The cache entry (page * page_size + entry) of paged token t, or -1 for padding; after the
// range checks below.
template <typename x_t>
int64_t paged_entry(const gpu::QuantArgs<x_t>& a, int64_t t) {
  const QuantGeometry& g = a.g;
  const int64_t b = read_index(a.batch_indices, g.batch_indices, t);
  if (b < 0) return -1;
  const int64_t start = read_index(a.kv_indptr, g.kv_indptr, b);
  const int64_t pos = read_index(a.positions, g.positions, t);
  const int64_t page = read_index(a.kv_indices, g.kv_indices, start + pos / g.page_size);
  return page * g.page_size + pos % g.page_size;
}

// The data checks, in token order, with the Python paths' messages (rope_ext/_quant/checks.py);
// then each cache entry written by one token at most (two would race for its row).
template <typename x_t>
void check_data(const gpu::QuantArgs<x_t>& a, const Tensor& like, const char* op) {
  const QuantGeometry& g = a.g;
  for (int64_t t = 0; t < g.tokens; ++t) {
    const int64_t p = read_index(a.pos, g.pos, t);
    ROPE_CHECK(p >= 0 && p < g.table_rows, op,
               ": pos_ids must lie in [0, max_position = cos_sin_cache.size(0) = ", g.table_rows,
               "), got ", p, " at index ", t);
  }
  if (!g.paged) return;
  int64_t used = 0;  // tokens cached (not padding)
  for (int64_t t = 0; t < g.tokens; ++t) {
    const int64_t b = read_index(a.batch_indices, g.batch_indices, t);
    if (b < 0) continue;
    ROPE_CHECK(b < g.batch, op, ": batch_indices must lie below batch_size = kv_indptr.size(0) - 1 = ",
               g.batch, " (negative: padding, skipped), got ", b, " at index ", t);
    const int64_t start = read_index(a.kv_indptr, g.kv_indptr, b);
    const int64_t end = read_index(a.kv_indptr, g.kv_indptr, b + 1);
    ROPE_CHECK(start >= 0 && start <= end && end <= g.num_indices, op,
               ": kv_indptr must be non-decreasing within [0, kv_indices.size(0) = ", g.num_indices,
               "], got kv_indptr[", b, "] = ", start, " and kv_indptr[", b + 1, "] = ", end,
               " (token ", t, ")");
    const int64_t pos = read_index(a.positions, g.positions, t);
    // (end - start) * page_size as a bound without forming the product: pos / page_size.
    if (pos < 0 || pos / g.page_size >= end - start) {
      int64_t bound;
      const std::string shown = mul_fits(end - start, g.page_size, bound) ? std::to_string(bound)
                                                                          : "2^63 or more";
      fail(op, ": positions must lie in [0, (kv_indptr[b + 1] - kv_indptr[b]) * page_size) = [0, ",
           shown, ") for request b = ", b, ", got ", pos, " at index ", t);
    }
    const int64_t j = start + pos / g.page_size;
    const int64_t page = read_index(a.kv_indices, g.kv_indices, j);
    ROPE_CHECK(page >= 0 && page < g.max_pages, op, ": kv_indices must lie in [0, max_pages = ",
               g.max_pages, "), got ", page, " at index ", j, " (token ", t, ")");
    ++used;
  }
  const int64_t entries = g.max_pages * g.page_size;  // checked to fit by check_paged
  auto entry_of = [&](int64_t t) { return paged_entry(a, t); };
  const auto [first, repeat] = find_repeated_slot(entry_of, g.tokens, used, entries, like);
  if (repeat >= 0) {
    const int64_t e = entry_of(repeat);
    fail(op, ": kv_indices and positions must give each token its own cache entry (negative "
         "batch_indices: padding, skipped), got page ", e / g.page_size, " entry ",
         e % g.page_size, " for tokens ", first, " and ", repeat);
  }
}

// Work per task: at least this many output elements (decode-sized calls run inline).
constexpr int64_t kGrainElements = 1 << 15;

struct CpuRunner {
  CpuRunner(const Tensor& first, const char* op_name) : like(first), op(op_name) {}

  // The data checks run on the host, in check_data, before anything is written.
  static constexpr bool kDeviceDataChecks = false;
  Tensor like;  // the first input: scratch memory for the checks comes from torch's allocator
  const char* op;

  template <typename x_t>
  void operator()(const gpu::LaunchPlan&, const gpu::QuantArgs<x_t>& a) const {
    check_data(a, like, op);
    const QuantGeometry& g = a.g;
    const int64_t per_token = std::max<int64_t>(
        1, (g.q_heads + g.kv_heads) * (2 * g.half + g.nope) +
               (g.paged && !g.mla ? g.kv_heads * (2 * g.half + g.nope) : 0));
    const int64_t grain = std::max<int64_t>(1, kGrainElements / per_token);
    // The ISA's kernel (quant/cpu/kernels.h) reads `a` as QuantArgs of its element type, of
    // the same layout: float, HalfBits or BF16Bits for float, Half and BFloat16.
    static_assert(sizeof(x_t) == (std::is_same<x_t, float>::value ? 4 : 2), "element layout");
    constexpr int dt = std::is_same<x_t, float>::value                        ? kF32
                       : std::is_same<x_t, torch::headeronly::Half>::value ? kF16
                                                                            : kBF16;
    const QuantTokensFn kernel = selected_cpu_kernels()->quant[dt];
    auto fn = [&](int64_t b, int64_t e) { kernel(&a, b, e); };
    if (g.tokens <= grain || torch::stable::get_num_threads() <= 1) {
      fn(0, g.tokens);
    } else {
      torch::stable::parallel_for(0, g.tokens, grain, fn);
    }
  }
};

}  // namespace
}  // namespace rope

STABLE_TORCH_LIBRARY_IMPL(rope, CPU, m) {
  ROPE_IMPL_CPU(m, "quantize_fp8", &rope::gpu::quantize_fp8_op<rope::CpuRunner>);
  ROPE_IMPL_CPU(m, "quantize_fp8_append_paged_kv_cache",
                &rope::gpu::quantize_fp8_paged_op<rope::CpuRunner>);
}
