// Argument validation shared by every device's kernels: each check names the argument and what
// was expected, runs before anything is written (a rejected call changes nothing), and forms no
// size product or sum that could overflow. On success it returns the op's geometry.h description.
//
// Header-only (inline), so the CPU and the CUDA library each compile it without sharing an
// object file. rope_ext/_checks.py mirrors it for the reference and fake kernels, message for
// message; docs/errors.md lists the messages.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>

#include "geometry.h"

namespace rope {

using torch::headeronly::ScalarType;
using torch::stable::Tensor;

// ---- errors: the message alone (no function name or source path, unlike STD_TORCH_CHECK) ----

// A number as the Python side words it: a NaN unsigned ("nan": Python's format drops the sign
// that x86 gives 0/0, "-nan" here), everything else as it is.
template <typename T>
inline const T& shown(const T& a) { return a; }
inline double shown(double a) { return std::isnan(a) ? std::fabs(a) : a; }
inline float shown(float a) { return std::isnan(a) ? std::fabs(a) : a; }

template <typename... Args>
[[noreturn]] inline void fail(const Args&... args) {
  std::ostringstream s;
  (s << ... << shown(args));
  throw std::runtime_error(s.str());
}

#define ROPE_CHECK(cond, ...)       \
  do {                              \
    if (!(cond)) ::rope::fail(__VA_ARGS__); \
  } while (0)

template <typename Seq>
inline std::string list_str(const Seq& v, int64_t n) {
  std::ostringstream s;
  s << "[";
  for (int64_t d = 0; d < n; ++d) s << (d ? ", " : "") << v[d];
  s << "]";
  return s.str();
}

// ---- overflow-free size arithmetic (sizes and strides of torch tensors are never negative) ----

constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();
// What the messages call a dtype that the stable ABI of the torch this library targets cannot
// name (rope_ext/_checks.py: UNNAMED_DTYPE).
constexpr const char* kUnnamedDtype =
    "a dtype no op takes (float8_e8m0fnu, float4_e2m1fn_x2, a quantized or bits dtype)";

// a * b for a, b >= 0; false (and r untouched) when it does not fit in int64.
inline bool mul_fits(int64_t a, int64_t b, int64_t& r) {
  if (a != 0 && b > kInt64Max / a) return false;
  r = a * b;
  return true;
}

inline bool add_fits(int64_t a, int64_t b, int64_t& r) {
  if (b > kInt64Max - a) return false;
  r = a + b;
  return true;
}

// ---- one tensor's metadata, read once (every read is a call through the stable ABI's C shim) ----

// t.scalar_type() in one shim call. The stable header's version maps the shim's dtype code to
// a ScalarType by comparing it with each dtype's code in turn, a call apiece (13 for bfloat16),
// on every use, and a decode-sized call reads dozens of dtypes. The codes of the dtypes the ops
// take are read once; any other dtype goes the header's way.
inline ScalarType dtype_of(const Tensor& t) {
  struct Codes {
    std::pair<int32_t, ScalarType> known[9];
    Codes() {
      const ScalarType types[] = {ScalarType::Float, ScalarType::BFloat16, ScalarType::Half,
                                  ScalarType::Long, ScalarType::Int, ScalarType::Double,
                                  ScalarType::Byte, ScalarType::Float8_e4m3fn,
                                  ScalarType::Float8_e5m2};
      for (int i = 0; i < 9; ++i) {
        known[i] = {torch::stable::detail::to<int32_t>(torch::stable::detail::from(types[i])),
                    types[i]};
      }
    }
  };
  static const Codes codes;
  int32_t code = 0;
  if (aoti_torch_get_dtype(t.get(), &code) == AOTI_TORCH_SUCCESS) {
    for (const auto& [c, type] : codes.known) {
      if (c == code) return type;
    }
  }
  try {
    return t.scalar_type();  // another dtype: the header's way
  } catch (const std::exception&) {
    // A dtype the stable ABI of the torch this library targets cannot name (float8_e8m0fnu,
    // float4_e2m1fn_x2, the quantized and bits dtypes): no op takes it; dtype_str says so.
    return ScalarType::Undefined;
  }
}

struct Meta {
  const Tensor* t = nullptr;  // nullptr: a view described here only (data, itemsize below)
  int64_t dim = 0;
  const int64_t* sizes = nullptr;
  const int64_t* strides = nullptr;
  ScalarType dtype = ScalarType::Undefined;
  torch::stable::Device device{torch::headeronly::DeviceType::CPU};
  int64_t numel = 0;
  void* view_data = nullptr;
  int64_t view_itemsize = 0;

  explicit Meta(const Tensor& tensor) : t(&tensor), device(tensor.device()) {
    dim = tensor.dim();
    sizes = tensor.sizes().data();
    strides = tensor.strides().data();
    dtype = dtype_of(tensor);
    numel = tensor.numel();
  }
  // A view of base's memory that no tensor holds: the element at `offset` (elements) of base,
  // `dim` sizes and strides (the caller's arrays, alive as long as this), numel elements. What
  // the checks read of a tensor, for rope.qkv_norm_rope_'s q and k columns without a tensor
  // allocation each.
  Meta(const Meta& base, int64_t offset, int64_t dim_, const int64_t* sizes_,
       const int64_t* strides_, int64_t numel_)
      : dim(dim_), sizes(sizes_), strides(strides_), dtype(base.dtype), device(base.device),
        numel(numel_), view_itemsize(base.itemsize()) {
    char* p = static_cast<char*>(base.data());
    view_data = base.numel == 0 ? p : p + offset * view_itemsize;
  }
  int64_t size(int64_t d) const { return sizes[d < 0 ? d + dim : d]; }
  int64_t stride(int64_t d) const { return strides[d < 0 ? d + dim : d]; }
  void* data() const { return t != nullptr ? t->data_ptr() : view_data; }
  int64_t itemsize() const {
    return t != nullptr ? static_cast<int64_t>(t->element_size()) : view_itemsize;
  }
};

inline std::string shape_str(const Meta& m) { return list_str(m.sizes, m.dim); }

inline std::string dtype_str(ScalarType t) {
  // (rope_ext/_checks.py's dtype_name names the dtypes alike)
  return t == ScalarType::Undefined ? std::string(kUnnamedDtype) : torch::headeronly::toString(t);
}

// Spelled as Python's str(torch.device), so messages match the Python paths.
inline std::string device_str(const torch::stable::Device& d) {
  using torch::headeronly::DeviceType;
  if (d.type() == DeviceType::CPU) return "cpu";
  if (d.type() == DeviceType::Meta) return "meta";
  const std::string name =
      d.type() == DeviceType::CUDA ? "cuda" : "device type " + std::to_string(int(d.type()));
  return name + ":" + std::to_string(d.index());
}

inline bool is_float(ScalarType t) {
  return t == ScalarType::Float || t == ScalarType::Double || t == ScalarType::Half ||
         t == ScalarType::BFloat16;
}

inline void check_float(const Meta& m, const char* op, const char* name) {
  ROPE_CHECK(is_float(m.dtype), op, ": ", name,
             " must be float16, bfloat16, float32 or float64, got ", dtype_str(m.dtype));
}

inline void check_same_device(const Meta& ref, const char* ref_name, const Meta& m,
                              const char* op, const char* name) {
  ROPE_CHECK(m.device == ref.device, op, ": ", name, " must be on the same device as ", ref_name,
             " (", device_str(ref.device), "), got ", device_str(m.device));
}

inline void check_positions_dtype(const Meta& m, const char* op) {
  ROPE_CHECK(m.dtype == ScalarType::Long || m.dtype == ScalarType::Int, op,
             ": positions must be int32 or int64, got ", dtype_str(m.dtype));
}

// A (max_position, rotary_dim) cos_sin_cache on ref's device, for rows of head_dim elements:
// returns rotary_dim / 2.
inline int64_t check_cos_sin_cache(const Meta& ref, const char* ref_name, const Meta& cache,
                                   const char* op, int64_t head_dim) {
  check_same_device(ref, ref_name, cache, op, "cos_sin_cache");
  check_float(cache, op, "cos_sin_cache");
  ROPE_CHECK(cache.dim == 2, op,
             ": cos_sin_cache must have shape (max_position, rotary_dim), got ", shape_str(cache));
  const int64_t rotary_dim = cache.sizes[1];
  ROPE_CHECK(rotary_dim % 2 == 0 && rotary_dim <= head_dim, op,
             ": rotary_dim = cos_sin_cache.size(1) = ", rotary_dim,
             " must be even and <= head_dim = ", head_dim);
  return rotary_dim / 2;
}

// ---- memory overlap (torch's rules for in-place ops, with its messages) ----

// The byte range [begin, end) t's elements span; empty for an empty tensor.
struct ByteRange {
  uintptr_t begin = 0, end = 0;
  bool empty() const { return begin == end; }
  bool intersects(const ByteRange& o) const {
    return !empty() && !o.empty() && begin < o.end && o.begin < end;
  }
};

// Bounded by real memory for any tensor torch can build (as_strided checks the storage covers
// the last element; expanded dims have stride 0).
inline ByteRange byte_range(const Meta& m) {
  ByteRange r;
  if (m.numel == 0) return r;
  int64_t last = 0;
  for (int64_t d = 0; d < m.dim; ++d) last += (m.sizes[d] - 1) * m.strides[d];
  r.begin = reinterpret_cast<uintptr_t>(m.data());
  r.end = r.begin + static_cast<uintptr_t>(last + 1) * m.itemsize();
  return r;
}

constexpr const char* kInternalOverlap =
    "unsupported operation: more than one element of the written-to tensor refers to a single "
    "memory location. Please clone() the tensor before performing the operation.";
constexpr const char* kPartialOverlap =
    "unsupported operation: some elements of the input tensor and the written-to tensor refer to "
    "a single memory location. Please clone() the tensor before performing the operation.";

// Dims (size, stride) sorted by stride are non-overlapping when each stride exceeds the largest
// offset the smaller-stride dims reach. `inner` is the extent already taken by inner elements.
// Sufficient, not necessary: exotic interleavings built with as_strided are refused too.
inline bool strided_dims_disjoint(std::vector<std::pair<int64_t, int64_t>> dims, int64_t inner) {
  std::sort(dims.begin(), dims.end(),
            [](const auto& a, const auto& b) { return a.second < b.second; });
  int64_t extent = inner;
  for (const auto& [size, stride] : dims) {
    if (size <= 1) continue;
    if (stride <= extent) return false;
    int64_t reach;
    if (!mul_fits(size - 1, stride, reach) || !add_fits(extent, reach, extent)) return false;
  }
  return true;
}

// A tensor the op writes must not have two elements at one address (an expanded query would be
// rotated once per alias).
inline void check_no_internal_overlap(const Meta& m, const char* op, const char* name) {
  if (m.numel == 0) return;
  std::vector<std::pair<int64_t, int64_t>> dims;
  for (int64_t d = 0; d < m.dim; ++d) dims.emplace_back(m.sizes[d], m.strides[d]);
  ROPE_CHECK(strided_dims_disjoint(dims, 0), op, ": ", name, ": ", kInternalOverlap);
}

// Two tensors with the same leading dims (query and key: tokens, then heads and head_dim) that
// the op writes or reads while writing the other. Separate allocations pass on their byte
// ranges; views of one fused buffer (qkv[..., :Hq*D], qkv[..., Hq*D:(Hq+Hk)*D]) pass when they
// share the token strides, their rows within a token are disjoint, and the tokens' combined rows
// do not reach each other.
inline bool rows_disjoint(const Meta& a, const Meta& b, int64_t nlead) {
  const ByteRange ra = byte_range(a), rb = byte_range(b);
  if (!ra.intersects(rb)) return true;
  if (a.itemsize() != b.itemsize()) return false;
  for (int64_t d = 0; d < nlead; ++d) {
    if (a.sizes[d] > 1 && a.strides[d] != b.strides[d]) return false;
  }
  const int64_t es = a.itemsize();
  const int64_t delta_bytes = static_cast<int64_t>(reinterpret_cast<uintptr_t>(b.data()) -
                                                   reinterpret_cast<uintptr_t>(a.data()));
  if (delta_bytes % es != 0) return false;
  const int64_t delta = delta_bytes / es;
  // Rows (head_dim vectors) of one token as closed intervals of element offsets from a's start.
  std::vector<std::pair<int64_t, int64_t>> rows;
  auto add_rows = [&](const Meta& m, int64_t base) {  // m is (..., heads, head_dim)
    const int64_t heads = m.size(-2), hs = m.stride(-2);
    const int64_t span = (m.size(-1) - 1) * m.stride(-1);
    for (int64_t h = 0; h < heads; ++h) rows.emplace_back(base + h * hs, base + h * hs + span);
  };
  add_rows(a, 0);
  add_rows(b, delta);
  std::sort(rows.begin(), rows.end());
  for (size_t i = 1; i < rows.size(); ++i) {
    if (rows[i].first <= rows[i - 1].second) return false;
  }
  const int64_t span = std::max_element(rows.begin(), rows.end(),
                                        [](const auto& x, const auto& y) {
                                          return x.second < y.second;
                                        })->second -
                       rows.front().first;
  std::vector<std::pair<int64_t, int64_t>> lead;
  for (int64_t d = 0; d < nlead; ++d) lead.emplace_back(a.sizes[d], a.strides[d]);
  return strided_dims_disjoint(lead, span);
}

inline void check_rows_disjoint(const Meta& a, const Meta& b, int64_t nlead, const char* op,
                                const char* a_name, const char* b_name) {
  if (a.numel == 0 || b.numel == 0) return;
  ROPE_CHECK(rows_disjoint(a, b, nlead), op, ": ", a_name, " and ", b_name, ": ",
             kPartialOverlap);
}

// Whether i_d in [lo_d, hi_d] exist with sum i_d * stride_d == r, dims[0..n) sorted by stride
// (all > 0). Each step tries the few i of its largest dim that leave a rest the smaller dims can
// reach; `budget` caps the steps (false when it runs out: "may meet").
struct LatticeDim {
  int64_t lo, hi, stride;
};
inline bool lattice_reaches(const LatticeDim* dims, int n, int64_t r, int& budget) {
  if (n == 0) return r == 0;
  int64_t below_lo = 0, below_hi = 0;  // the sums the smaller dims reach
  for (int d = 0; d < n - 1; ++d) {
    below_lo += dims[d].lo * dims[d].stride;
    below_hi += dims[d].hi * dims[d].stride;
  }
  const LatticeDim& top = dims[n - 1];
  auto floor_div = [](int64_t a, int64_t b) { return a / b - (a % b != 0 && a < 0); };
  const int64_t first = std::max(top.lo, -floor_div(below_hi - r, top.stride));  // ceil
  const int64_t last = std::min(top.hi, floor_div(r - below_lo, top.stride));
  for (int64_t i = first; i <= last; ++i) {
    if (--budget < 0 || lattice_reaches(dims, n - 1, r - i * top.stride, budget)) return true;
  }
  return false;
}

// Two written tensors with no element in common: apart in memory, or views of one buffer with
// the same strides whose elements interleave without meeting (a paged KV buffer's key and value
// halves: kv[:, 0] and kv[:, 1] of (num_blocks, 2, block_size, heads, head_dim), or the two
// column ranges of (..., heads, head_dim + value_dim)). The sizes may differ; element i of a
// and element j of b meet where a's offset sum_d i_d s_d equals delta + sum_d j_d s_d.
inline bool elements_disjoint(const Meta& a, const Meta& b) {
  if (!byte_range(a).intersects(byte_range(b))) return true;
  if (a.itemsize() != b.itemsize() || a.dim != b.dim || a.dim > 8) return false;
  const int64_t delta_bytes = static_cast<int64_t>(reinterpret_cast<uintptr_t>(b.data()) -
                                                   reinterpret_cast<uintptr_t>(a.data()));
  if (delta_bytes % a.itemsize() != 0) return false;
  LatticeDim dims[8];
  int n = 0;
  for (int64_t d = 0; d < a.dim; ++d) {
    // A size-1 dim's stride is arbitrary: only the other tensor's counts there.
    if (a.sizes[d] > 1 && b.sizes[d] > 1 && a.strides[d] != b.strides[d]) return false;
    const int64_t stride = a.sizes[d] > 1 ? a.strides[d] : b.strides[d];
    if ((a.sizes[d] == 1 && b.sizes[d] == 1) || stride == 0) continue;  // no step to take
    // i_d - j_d, inserted in stride order (bounded by real memory, as are the sums above).
    int at = n++;
    for (; at > 0 && dims[at - 1].stride > stride; --at) dims[at] = dims[at - 1];
    dims[at] = {1 - b.sizes[d], a.sizes[d] - 1, stride};
  }
  int budget = 256;
  return !lattice_reaches(dims, n, delta_bytes / a.itemsize(), budget);
}

// Two tensors the op writes.
inline void check_elements_disjoint(const Meta& a, const char* a_name, const Meta& b,
                                    const char* b_name, const char* op) {
  ROPE_CHECK(elements_disjoint(a, b), op, ": ", b_name, " and ", a_name, ": ", kPartialOverlap);
}

// A read-only input that lies in the bytes of a written tensor.
inline void check_disjoint_bytes(const Meta& written, const char* written_name, const Meta& input,
                                 const char* input_name, const char* op) {
  ROPE_CHECK(!byte_range(written).intersects(byte_range(input)), op, ": ", input_name, " and ",
             written_name, ": ", kPartialOverlap);
}

// ---- leading dims -> LeadIndexer ----

// The leading dims' sizes and per-operand strides as the checks gather them, before make_indexer
// merges them. Inline for up to kInline dims (every real layout): a check allocates nothing.
struct LeadDims {
  static constexpr int64_t kInline = 16;
  explicit LeadDims(int64_t ndim) : n(ndim) {
    if (n > kInline) heap.assign(static_cast<size_t>((kMaxOperands + 1) * n), 0);
  }
  int64_t& size(int64_t d) { return base()[d]; }
  int64_t& stride(int t, int64_t d) { return base()[(t + 1) * stride_of_rows() + d]; }
  int64_t size(int64_t d) const { return base()[d]; }
  int64_t stride(int t, int64_t d) const { return base()[(t + 1) * stride_of_rows() + d]; }
  const int64_t n;

 private:
  int64_t stride_of_rows() const { return n > kInline ? n : kInline; }
  int64_t* base() { return n > kInline ? heap.data() : inline_dims; }
  const int64_t* base() const { return n > kInline ? heap.data() : inline_dims; }
  int64_t inline_dims[(kMaxOperands + 1) * kInline] = {};
  std::vector<int64_t> heap;
};

// The leading dims reordered so that operand t's strides descend (stably: ties, size-1 dims
// included, keep their order). The rows are then walked in t's memory order: for x of a
// transposed view (batch, heads, seq, head_dim), a (batch, seq) table row's heads become one
// token's heads (one table row, rows one after another) instead of seq rows apart.
inline LeadDims in_memory_order(LeadDims dims, int t) {
  for (int64_t i = 1; i < dims.n; ++i) {  // an insertion sort: a handful of dims, no allocation
    for (int64_t j = i; j > 0 && dims.stride(t, j - 1) < dims.stride(t, j); --j) {
      std::swap(dims.size(j - 1), dims.size(j));
      for (int u = 0; u < kMaxOperands; ++u) std::swap(dims.stride(u, j - 1), dims.stride(u, j));
    }
  }
  return dims;
}

// Builds the indexer from per-dim sizes and per-operand strides: drops size-1 dims and merges a
// dim into the next inner one when every operand is contiguous across the two.
inline LeadIndexer make_indexer(const LeadDims& in, const char* op) {
  LeadIndexer ix;
  // An empty operand visits no rows: keep no dims, so that no loop ever divides by zero.
  for (int64_t d = 0; d < in.n; ++d) {
    if (in.size(d) == 0) return ix;
  }
  int nd = 0;
  for (int64_t d = 0; d < in.n; ++d) {
    if (in.size(d) == 1) continue;
    bool merge = nd > 0;
    for (int t = 0; merge && t < kMaxOperands; ++t) {
      int64_t outer;
      merge = mul_fits(in.stride(t, d), in.size(d), outer) && ix.strides[t][nd - 1] == outer;
    }
    if (merge) {
      ix.sizes[nd - 1] *= in.size(d);  // a product of a tensor's sizes: at most its numel
      for (int t = 0; t < kMaxOperands; ++t) ix.strides[t][nd - 1] = in.stride(t, d);
    } else {
      ROPE_CHECK(nd < kMaxLeadDims, op,
                 ": the leading dims of the operands have a layout with more than ", kMaxLeadDims,
                 " non-mergeable dims; call .contiguous() first");
      ix.sizes[nd] = in.size(d);
      for (int t = 0; t < kMaxOperands; ++t) ix.strides[t][nd] = in.stride(t, d);
      ++nd;
    }
  }
  ix.ndim = nd;
  return ix;
}

// ---- positions: range checked on the host where the data is (CPU), read once ----

// Positions the op reads while writing query/key (or whose memory it writes) are copied first,
// so that a position cannot change between its check and its use.
// `written`: the tensors the op writes (nullptr for an absent optional one).
inline Tensor positions_read_once(const Tensor& positions,
                                  std::initializer_list<const Tensor*> written) {
  const ByteRange pr = byte_range(Meta(positions));
  for (const Tensor* w : written) {
    if (w != nullptr && byte_range(Meta(*w)).intersects(pr)) return torch::stable::clone(positions);
  }
  return positions;
}

// Runs check(); copies each of `read` (positions, slots) that shares memory with a tensor of
// `written`, so that no value can change between its check and its use; runs check() again on
// the copies' strides if any was copied. Returns the last check's result.
template <class Check>
auto check_read_once(Check&& check, std::initializer_list<Tensor*> read,
                     std::initializer_list<const Tensor*> written) {
  auto g = check();
  bool copied = false;
  for (Tensor* t : read) {
    Tensor once = positions_read_once(*t, written);
    if (once.get() != t->get()) {
      *t = once;
      copied = true;
    }
  }
  if (copied) g = check();
  return g;
}

// Raises if a position lies outside [0, rows). Visits each element of positions' memory once
// (dims of stride 0 repeat one element), so it ends on any shape; reports the first bad
// position in flat (row-major) order, as the Python paths do.
inline void check_positions_in_range(const Tensor& positions, int64_t rows, const char* op,
                                     const char* rows_name) {
  const Meta m(positions);
  if (m.numel == 0) return;
  const bool pos64 = m.dtype == ScalarType::Long;
  const char* base = static_cast<const char*>(positions.const_data_ptr());
  const int64_t es = pos64 ? 8 : 4;
  // Walk the dims that have a stride (others stay at index 0), keeping the flat index.
  std::vector<int64_t> dims, flat_step(m.dim);
  int64_t step = 1;
  for (int64_t d = m.dim - 1; d >= 0; --d) {
    flat_step[d] = step;
    step *= m.sizes[d];  // at most numel (< 2^63)
    if (m.sizes[d] > 1 && m.strides[d] != 0) dims.insert(dims.begin(), d);
  }
  std::vector<int64_t> idx(dims.size(), 0);
  int64_t offset = 0, flat = 0;
  while (true) {
    const int64_t p = pos64 ? *reinterpret_cast<const int64_t*>(base + offset * es)
                            : *reinterpret_cast<const int32_t*>(base + offset * es);
    ROPE_CHECK(p >= 0 && p < rows, op, ": positions must lie in [0, ", rows, ") (max_position = ",
               rows_name, "), got ", p, " at flat index ", flat);
    int64_t k = static_cast<int64_t>(dims.size()) - 1;
    for (; k >= 0; --k) {
      const int64_t d = dims[k];
      offset += m.strides[d];
      flat += flat_step[d];
      if (++idx[k] < m.sizes[d]) break;
      offset -= idx[k] * m.strides[d];
      flat -= idx[k] * flat_step[d];
      idx[k] = 0;
    }
    if (k < 0) return;
  }
}

// The first repeat in a list of n slots (slot_at(t): entry t; negative entries skipped, `used`
// of them >= 0, all below `slots`): {the first index of the slot, the index that repeats it},
// the smallest such index; {-1, -1} if none. `like`: a CPU tensor, for scratch memory from
// torch's allocator.
template <class SlotAt>
std::pair<int64_t, int64_t> find_repeated_slot(const SlotAt& slot_at, int64_t n, int64_t used,
                                               int64_t slots, const Tensor& like) {
  if (used < 2) return {-1, -1};
  // A decode-sized batch: every pair of tokens compared (at most 496 comparisons), no buffer
  // allocated: an allocation through torch costs more than the comparisons.
  constexpr int64_t kPairwise = 32;
  if (n <= kPairwise) {
    for (int64_t t = 1; t < n; ++t) {
      const int64_t s = slot_at(t);
      if (s < 0) continue;
      for (int64_t first = 0; first < t; ++first) {
        if (slot_at(first) == s) return {first, t};
      }
    }
    return {-1, -1};
  }
  // Few slots beside the tokens (a large prefill): one bit per slot, one pass in token order.
  const int64_t bitmap_bytes = slots / 8 + 1;
  if (bitmap_bytes <= 64 * used) {
    Tensor bits = torch::stable::new_zeros(like, {bitmap_bytes}, ScalarType::Byte);
    auto* b = static_cast<uint8_t*>(bits.mutable_data_ptr());
    for (int64_t t = 0; t < n; ++t) {
      const int64_t s = slot_at(t);
      if (s < 0) continue;
      const uint8_t bit = static_cast<uint8_t>(1u << (s & 7));
      if (b[s >> 3] & bit) {
        int64_t first = 0;
        while (slot_at(first) != s) ++first;
        return {first, t};
      }
      b[s >> 3] |= bit;
    }
    return {-1, -1};
  }
  // Otherwise (slot, token) of the used slots, sorted: a repeated slot's tokens side by side.
  Tensor buf = torch::stable::new_empty(like, {used, 2}, ScalarType::Long);
  auto* pairs = static_cast<std::pair<int64_t, int64_t>*>(buf.mutable_data_ptr());
  static_assert(sizeof(std::pair<int64_t, int64_t>) == 2 * sizeof(int64_t), "packed pairs");
  for (int64_t t = 0, k = 0; t < n; ++t) {
    const int64_t s = slot_at(t);
    if (s >= 0) pairs[k++] = {s, t};
  }
  std::sort(pairs, pairs + used);
  int64_t first = -1, repeat = n;
  for (int64_t k = 1, group = 0; k < used; ++k) {
    if (pairs[k].first != pairs[k - 1].first) {
      group = k;
    } else if (pairs[k].second < repeat) {
      repeat = pairs[k].second;
      first = pairs[group].second;
    }
  }
  return repeat != n ? std::pair<int64_t, int64_t>{first, repeat}
                     : std::pair<int64_t, int64_t>{-1, -1};
}

// The paged-cache ops' slots (CPU, before anything is written): each below `slots`, negative
// ones padding; a non-negative slot used by two tokens would leave its row to whichever thread
// writes last, so it is refused, naming the first token (in order) whose slot an earlier token has.
inline void check_slots(const Tensor& slot_mapping, int64_t slots, const char* op) {
  const Meta m(slot_mapping);
  const int64_t n = m.numel, stride = m.dim == 1 ? m.strides[0] : 1;
  const bool slots64 = m.dtype == ScalarType::Long;
  const char* base = static_cast<const char*>(slot_mapping.const_data_ptr());
  auto slot_at = [&](int64_t t) -> int64_t {
    return slots64 ? reinterpret_cast<const int64_t*>(base)[t * stride]
                   : reinterpret_cast<const int32_t*>(base)[t * stride];
  };
  int64_t used = 0;
  for (int64_t t = 0; t < n; ++t) {
    const int64_t s = slot_at(t);
    ROPE_CHECK(s < slots, op, ": slot_mapping must lie below num_blocks * block_size = ", slots,
               " (negative: padding, skipped), got ", s, " at index ", t);
    used += s >= 0;
  }
  const auto [first, repeat] = find_repeated_slot(slot_at, n, used, slots, slot_mapping);
  ROPE_CHECK(repeat < 0, op,
             ": slot_mapping must not repeat a slot (negative: padding, skipped), got ",
             repeat < 0 ? 0 : slot_at(repeat), " at indices ", first, " and ", repeat);
}

// The cos_sin_cache row's sin half: half * (column stride) elements past its cos.
inline const void* sin_of_cache(const Tensor& cache, const RotateGeometry& g) {
  return static_cast<const char*>(cache.const_data_ptr()) +
         g.half * g.table.cos_col * static_cast<int64_t>(cache.element_size());
}

// ---- the ops ----

// rope.apply / rope.apply_backward / rope.apply.out: cos and sin (..., rotary_dim/2) have x's
// number of dims (or are one row, 1-D), each dim x's size or 1. The output is contiguous with
// x's shape. Pointers are not part of the geometry; the caller binds x, cos, sin and out.
// The rows are walked in x's memory order (in_memory_order), but with view_order in the order of
// x's dims (the norm across heads: a token's heads must be its innermost rows).
//
// `also` (rope.qk_norm_rope_backward's grad): a second tensor read row for row with x, of x's
// device, dtype and shape; its strides ride in the geometry as operand kSrc1 and target[1]'s
// src_head / src_last (target 1 is no target of its own: targets stays 1).
inline RotateGeometry check_apply(const Tensor& x_t, const Tensor& cos_t, const Tensor& sin_t,
                                  bool interleaved, bool inverse, const char* op,
                                  const char* x_name, bool view_order = false,
                                  const Tensor* also_t = nullptr, const char* also_name = nullptr) {
  const Meta x(x_t), cos(cos_t), sin(sin_t);
  check_float(x, op, x_name);
  check_float(cos, op, "cos");
  check_float(sin, op, "sin");
  ROPE_CHECK(x.dim >= 1, op, ": ", x_name, " must have at least 1 dim (..., head_dim)");
  check_same_device(x, x_name, cos, op, "cos");
  check_same_device(x, x_name, sin, op, "sin");
  ROPE_CHECK(cos.dtype == sin.dtype, op, ": cos and sin must have the same dtype, got cos ",
             dtype_str(cos.dtype), " and sin ", dtype_str(sin.dtype));
  bool same = cos.dim == sin.dim;
  for (int64_t d = 0; same && d < cos.dim; ++d) same = cos.sizes[d] == sin.sizes[d];
  ROPE_CHECK(same, op, ": cos and sin must have the same shape, got cos ", shape_str(cos),
             " and sin ", shape_str(sin));
  ROPE_CHECK(cos.dim >= 1, op, ": cos must have at least 1 dim (..., rotary_dim/2)");
  ROPE_CHECK(cos.dim <= x.dim, op, ": cos and sin of shape ", shape_str(cos), " must broadcast to ",
             x_name, ".shape[:-1] + (rotary_dim/2,) for ", x_name, " of shape ", shape_str(x));
  ROPE_CHECK(cos.dim == x.dim || cos.dim == 1, op, ": cos and sin of shape ", shape_str(cos),
             " have ", cos.dim, " dims but ", x_name, " of shape ", shape_str(x), " has ", x.dim,
             ": give them ", x_name,
             "'s number of dims, with size 1 where they broadcast (e.g. cos[None, :, None, :] "
             "for a (seq, rotary_dim/2) table and ",
             x_name, " in (batch, seq, heads, head_dim) layout); dims are never aligned implicitly");
  const int64_t head_dim = x.size(-1), half = cos.size(-1);
  ROPE_CHECK(half <= head_dim / 2, op, ": rotary_dim = 2 * cos.size(-1) = ",
             2 * static_cast<uint64_t>(half), " must be <= head_dim = ", x_name, ".size(-1) = ",
             head_dim);
  bool broadcasts = true;
  for (int64_t d = 0; broadcasts && cos.dim > 1 && d < x.dim - 1; ++d) {
    broadcasts = cos.sizes[d] == 1 || cos.sizes[d] == x.sizes[d];
  }
  ROPE_CHECK(broadcasts, op, ": cos and sin of shape ", shape_str(cos), " must broadcast to ",
             x_name, ".shape[:-1] + (rotary_dim/2,) for ", x_name, " of shape ", shape_str(x));
  std::optional<Meta> also;
  if (also_t != nullptr) {
    also.emplace(*also_t);
    check_same_device(x, x_name, *also, op, also_name);
    ROPE_CHECK(also->dtype == x.dtype, op, ": ", also_name, " must have the dtype of ", x_name,
               " (", dtype_str(x.dtype), "), got ", dtype_str(also->dtype));
    bool same_shape = also->dim == x.dim;
    for (int64_t d = 0; same_shape && d < x.dim; ++d) same_shape = also->sizes[d] == x.sizes[d];
    ROPE_CHECK(same_shape, op, ": ", also_name, " must have the shape of ", x_name, " ",
               shape_str(x), ", got ", shape_str(*also));
  }

  RotateGeometry g;
  g.head_dim = head_dim;
  g.half = half;
  g.interleaved = interleaved;
  g.inverse = inverse;
  g.copy_tail = true;
  g.targets = 1;
  g.target[0] = TargetDesc{1, 0, 0, x.stride(-1), 1};
  if (also) g.target[1].src_last = also->stride(-1);
  g.table.kind = TableKind::kStrided;
  g.table.cos_col = cos.stride(-1);
  g.table.sin_col = sin.stride(-1);
  if (x.numel == 0) return g;  // tokens = 0: nothing to do (and no size product to form)
  g.tokens = x.numel / head_dim;
  const int64_t nlead = x.dim - 1;
  LeadDims lead(nlead);
  int64_t out_stride = head_dim;  // the output is contiguous
  for (int64_t d = nlead - 1; d >= 0; --d) {
    lead.size(d) = x.sizes[d];
    lead.stride(kSrc0, d) = x.strides[d];
    lead.stride(kDst0, d) = out_stride;
    if (also) lead.stride(kSrc1, d) = also->strides[d];
    if (cos.dim > 1 && cos.sizes[d] != 1) {
      lead.stride(kTab0, d) = cos.strides[d];
      lead.stride(kTab1, d) = sin.strides[d];
    }
    out_stride *= x.sizes[d];  // at most x's numel
  }
  g.lead = make_indexer(view_order ? lead : in_memory_order(lead, kSrc0), op);
  // Rows that share a table row along the innermost leading dim (the heads of x (B, S, H, D)
  // with cos (B, S, 1, rotary_dim/2)) become the heads of one token: the kernels convert the
  // table row once and loop over the heads with nothing else per row.
  LeadIndexer& ix = g.lead;
  if (ix.ndim > 0 && ix.strides[kTab0][ix.ndim - 1] == 0 && ix.strides[kTab1][ix.ndim - 1] == 0) {
    const int d = --ix.ndim;
    g.target[0].heads = ix.sizes[d];
    g.target[0].src_head = ix.strides[kSrc0][d];
    g.target[0].dst_head = ix.strides[kDst0][d];
    g.target[1].src_head = ix.strides[kSrc1][d];
    g.tokens /= ix.sizes[d];
  }
  return g;
}

// Rows of one target where no leading dim shares its table rows innermost but an outer one does
// (x (B, H, S, D) contiguous with tables (1, 1, S, rotary_dim/2): a table row's B * H rows lie S
// rows apart): that dim becomes the heads, so a table row is read (and converted) once for all of
// them rather than once per row. Returns whether g changed. The CPU ops that rotate by broadcast
// tables (rope.apply, rope.qk_norm_rope, rope.norm_rope but across heads) take it for calls that
// stay in the cache (docs/cpu-performance.md "Heads far apart").
inline bool take_outer_heads(RotateGeometry& g) {
  LeadIndexer& ix = g.lead;
  if (g.target[0].heads != 1) return false;
  for (int d = ix.ndim - 2; d >= 0; --d) {
    if (ix.strides[kTab0][d] != 0 || ix.strides[kTab1][d] != 0) continue;
    g.target[0].heads = ix.sizes[d];
    g.target[0].src_head = ix.strides[kSrc0][d];
    g.target[0].dst_head = ix.strides[kDst0][d];
    g.tokens /= ix.sizes[d];
    for (int i = d; i + 1 < ix.ndim; ++i) {
      ix.sizes[i] = ix.sizes[i + 1];
      for (int t = 0; t < kMaxOperands; ++t) ix.strides[t][i] = ix.strides[t][i + 1];
    }
    --ix.ndim;
    return true;
  }
  return false;
}

// rope.apply.out: check_apply, then out has x's device, dtype and shape, is contiguous, and
// shares no memory with x, cos or sin.
inline RotateGeometry check_apply_out(const Tensor& x_t, const Tensor& cos_t, const Tensor& sin_t,
                                      const Tensor& out_t, bool interleaved) {
  const char* op = "rope.apply.out";
  RotateGeometry g = check_apply(x_t, cos_t, sin_t, interleaved, false, op, "x");
  const Meta x(x_t), out(out_t);
  check_same_device(x, "x", out, op, "out");
  ROPE_CHECK(out.dtype == x.dtype, op, ": out must have the dtype of x (", dtype_str(x.dtype),
             "), got ", dtype_str(out.dtype));
  bool same = out.dim == x.dim;
  for (int64_t d = 0; same && d < x.dim; ++d) same = out.sizes[d] == x.sizes[d];
  ROPE_CHECK(same, op, ": out must have the shape of x ", shape_str(x), ", got ", shape_str(out));
  ROPE_CHECK(out_t.is_contiguous(), op, ": out must be contiguous");
  const ByteRange o = byte_range(out);
  const std::pair<const char*, const Tensor*> inputs[] = {{"x", &x_t}, {"cos", &cos_t},
                                                          {"sin", &sin_t}};
  for (const auto& [name, t] : inputs) {
    ROPE_CHECK(!o.intersects(byte_range(Meta(*t))), op, ": out must not overlap ", name,
               " in memory (use rope.apply_ to rotate in place)");
  }
  return g;
}

// Where a positions-indexed op finds its tables: cos_sin_cache (max_position, rotary_dim), cos
// in the first half of each row, or separate cos and sin tables (max_position, rotary_dim/2);
// and, for MRoPE, which position component each pair's row is taken at (positions then have a
// leading dim of 3 components).
struct TableArgs {
  const Tensor* cache = nullptr;  // set for cos_sin_cache
  const Tensor* cos = nullptr;    // set for separate tables
  const Tensor* sin = nullptr;
  const std::vector<int64_t>* mrope_section = nullptr;
  bool mrope_interleaved = false;
};

inline void set_mrope_sections(RotateGeometry& g, const std::vector<int64_t>& section,
                               bool mrope_interleaved, int64_t pos_component_stride,
                               const char* op, const char* half_name);

// The query/key (or x) part shared by every positions-indexed op: dtypes, devices, shapes, the
// table (and MRoPE sections), and the lead indexer. In place (`in_place`): the written tensors
// may not overlap themselves, each other or the table.
inline RotateGeometry check_positions_op(const Meta& q, const Meta* key_meta,
                                         const Tensor& positions_t, const TableArgs& tables,
                                         bool interleaved, bool inverse, bool in_place,
                                         const char* op, const char* q_name) {
  const Meta pos(positions_t);
  const int64_t pos_lead_dim0 = tables.mrope_section != nullptr ? 1 : 0;  // the components' dim
  ROPE_CHECK(pos_lead_dim0 == 1 || !tables.mrope_interleaved, op,
             ": mrope_interleaved=True needs mrope_section (the pairs of each of the 3 position "
             "components)");
  check_float(q, op, q_name);
  ROPE_CHECK(q.dim >= 2, op, ": ", q_name, " must have shape (..., num_heads, head_dim), got ",
             shape_str(q));
  const int64_t nlead = q.dim - 2;
  std::optional<Meta> k;
  if (key_meta != nullptr) {
    k.emplace(*key_meta);
    check_same_device(q, q_name, *k, op, "key");
    ROPE_CHECK(k->dtype == q.dtype, op, ": key must have the dtype of ", q_name, " (",
               dtype_str(q.dtype), "), got ", dtype_str(k->dtype));
    bool same_lead = k->dim == q.dim && k->size(-1) == q.size(-1);
    for (int64_t d = 0; same_lead && d < nlead; ++d) same_lead = k->sizes[d] == q.sizes[d];
    ROPE_CHECK(same_lead, op,
               ": key must have shape (..., num_kv_heads, head_dim) with the leading dims and "
               "head_dim of ",
               q_name, " ", shape_str(q), ", got ", shape_str(*k));
  }
  check_same_device(q, q_name, pos, op, "positions");
  check_positions_dtype(pos, op);
  bool pos_shape = pos.dim == nlead + pos_lead_dim0;
  for (int64_t d = 0; pos_shape && d < nlead; ++d) {
    pos_shape = pos.sizes[d + pos_lead_dim0] == q.sizes[d];
  }
  if (pos_lead_dim0 == 0) {
    ROPE_CHECK(pos_shape, op, ": positions must have shape ", q_name, ".shape[:-2] (", q_name,
               " is ", shape_str(q), "), got ", shape_str(pos));
  } else {
    ROPE_CHECK(pos_shape && pos.sizes[0] == kMropeComponents, op,
               ": positions must have shape (3,) + ", q_name,
               ".shape[:-2] (temporal, height, width; ", q_name, " is ", shape_str(q), "), got ",
               shape_str(pos));
  }

  RotateGeometry g;
  g.head_dim = q.size(-1);
  g.interleaved = interleaved;
  g.inverse = inverse;
  g.copy_tail = !in_place;
  g.table.kind = TableKind::kGathered;
  g.table.pos64 = pos.dtype == ScalarType::Long;
  if (tables.cache != nullptr) {
    const Meta cache(*tables.cache);
    g.half = check_cos_sin_cache(q, q_name, cache, op, g.head_dim);
    g.table.rows = cache.sizes[0];
    g.table.cos_row = g.table.sin_row = cache.strides[0];
    g.table.cos_col = g.table.sin_col = cache.strides[1];
  } else {
    const Meta cos(*tables.cos), sin(*tables.sin);
    check_same_device(q, q_name, cos, op, "cos");
    check_same_device(q, q_name, sin, op, "sin");
    check_float(cos, op, "cos");
    check_float(sin, op, "sin");
    ROPE_CHECK(cos.dtype == sin.dtype, op, ": cos and sin must have the same dtype, got cos ",
               dtype_str(cos.dtype), " and sin ", dtype_str(sin.dtype));
    ROPE_CHECK(cos.dim == 2 && sin.dim == 2 && cos.sizes[0] == sin.sizes[0] &&
                   cos.sizes[1] == sin.sizes[1],
               op,
               ": cos and sin must be tables of one shape (max_position, rotary_dim/2), got cos ",
               shape_str(cos), " and sin ", shape_str(sin));
    ROPE_CHECK(cos.sizes[1] <= g.head_dim / 2, op, ": rotary_dim = 2 * cos.size(1) = ",
               2 * static_cast<uint64_t>(cos.sizes[1]), " must be <= head_dim = ", g.head_dim);
    g.half = cos.sizes[1];
    g.table.rows = cos.sizes[0];
    g.table.cos_row = cos.strides[0];
    g.table.sin_row = sin.strides[0];
    g.table.cos_col = cos.strides[1];
    g.table.sin_col = sin.strides[1];
  }

  if (in_place) {
    check_no_internal_overlap(q, op, q_name);
    if (k) {
      check_no_internal_overlap(*k, op, "key");
      check_rows_disjoint(q, *k, nlead, op, q_name, "key");
    }
    const std::pair<const char*, const Tensor*> inputs[] = {
        {"cos_sin_cache", tables.cache}, {"cos", tables.cos}, {"sin", tables.sin}};
    for (const auto& [name, t] : inputs) {
      if (t == nullptr) continue;
      const Meta m(*t);
      check_disjoint_bytes(q, q_name, m, name, op);
      if (k) check_disjoint_bytes(*k, "key", m, name, op);
    }
  }

  g.targets = k ? 2 : 1;
  g.target[0] = TargetDesc{q.size(-2), q.stride(-2), q.stride(-2), q.stride(-1), q.stride(-1)};
  if (k) {
    g.target[1] = TargetDesc{k->size(-2), k->stride(-2), k->stride(-2), k->stride(-1),
                             k->stride(-1)};
  }
  LeadDims lead(nlead);
  g.tokens = 1;
  for (int64_t d = 0; d < nlead; ++d) {
    lead.size(d) = q.sizes[d];
    g.tokens = q.sizes[d] == 0 ? 0 : g.tokens;
    lead.stride(kSrc0, d) = lead.stride(kDst0, d) = q.strides[d];
    if (k) lead.stride(kSrc1, d) = lead.stride(kDst1, d) = k->strides[d];
    lead.stride(kTab0, d) = pos.strides[d + pos_lead_dim0];
  }
  if (g.tokens != 0) {
    for (int64_t d = 0; d < nlead; ++d) g.tokens *= q.sizes[d];  // positions' numel (< 2^63)
  }
  if (!in_place) {  // fresh contiguous outputs of the targets' shapes
    const Meta* xs[2] = {&q, k ? &*k : nullptr};
    for (int t = 0; t < g.targets; ++t) {
      g.target[t].dst_head = g.head_dim;
      g.target[t].dst_last = 1;
      if (g.tokens == 0) continue;  // no rows: the products below could overflow
      int64_t st = xs[t]->size(-2) * g.head_dim;  // at most the target's numel
      for (int64_t d = nlead - 1; d >= 0; --d) {
        lead.stride(t == 0 ? kDst0 : kDst1, d) = st;
        st *= xs[t]->sizes[d];  // at most the target's numel
      }
    }
  }
  g.lead = make_indexer(lead, op);
  if (tables.mrope_section != nullptr) {
    set_mrope_sections(g, *tables.mrope_section, tables.mrope_interleaved, pos.strides[0], op,
                       tables.cache != nullptr ? "cos_sin_cache.size(1)/2" : "cos.size(1)");
  }
  return g;
}

inline RotateGeometry check_positions_op(const Tensor& query_t, const std::optional<Tensor>& key_t,
                                         const Tensor& positions_t, const TableArgs& tables,
                                         bool interleaved, bool inverse, bool in_place,
                                         const char* op, const char* q_name) {
  const Meta q(query_t);
  std::optional<Meta> k;
  if (key_t.has_value()) k.emplace(*key_t);
  return check_positions_op(q, k ? &*k : nullptr, positions_t, tables, interleaved, inverse,
                            in_place, op, q_name);
}

// rope.apply_ / rope.mrope_ with rope_dim_offset (vLLM's DeepSeek-V4 rotates the tail of each
// head): the rotary dims are [offset, offset + rotary_dim). No sum is formed: rotary_dim <=
// head_dim is already checked, so head_dim - rotary_dim cannot overflow.
inline void set_rope_dim_offset(RotateGeometry& g, int64_t offset, const char* op) {
  const int64_t rotary_dim = 2 * g.half;
  ROPE_CHECK(offset >= 0 && offset <= g.head_dim - rotary_dim, op, ": rope_dim_offset = ", offset,
             " must lie in [0, head_dim - rotary_dim] = [0, ", g.head_dim - rotary_dim,
             "] (head_dim = ", g.head_dim, ", rotary_dim = ", rotary_dim, ")");
  g.rot_offset = offset;
}

// The element of a row where its rotary dims start (rot_offset along the head dim); an empty
// tensor's pointer (possibly null) is left as it is.
inline void* rotary_start(const Tensor& t, const RotateGeometry& g, int64_t last_stride) {
  char* p = static_cast<char*>(t.mutable_data_ptr());
  if (g.rot_offset == 0 || g.half == 0 || t.numel() == 0) return p;
  return p + g.rot_offset * last_stride * static_cast<int64_t>(t.element_size());
}

// The MRoPE part: the sections, as 3 entries >= 0 summing to rotary_dim/2 (no sum formed that
// could overflow: an entry above rotary_dim/2 already fails).
inline void set_mrope_sections(RotateGeometry& g, const std::vector<int64_t>& section,
                               bool mrope_interleaved, int64_t pos_component_stride,
                               const char* op, const char* half_name) {
  const int64_t n = static_cast<int64_t>(section.size());
  ROPE_CHECK(n == kMropeComponents, op,
             ": mrope_section must have 3 entries (temporal, height, width), got ",
             list_str(section, n));
  int64_t total = 0;
  bool fits = true;
  for (int j = 0; j < kMropeComponents; ++j) {
    ROPE_CHECK(section[j] >= 0, op, ": mrope_section entries must be >= 0, got ",
               list_str(section, n));
    fits = fits && section[j] <= g.half;
    if (fits) total += section[j];
  }
  if (!fits || total != g.half) {
    fail(op, ": mrope_section ", list_str(section, n), " must sum to rotary_dim/2 = ", half_name,
         " = ", g.half, ", got ", fits ? std::to_string(total) : "more than " + std::to_string(g.half));
  }
  g.table.kind = TableKind::kMrope;
  for (int j = 0; j < kMropeComponents; ++j) g.table.section[j] = section[j];
  g.table.mrope_interleaved = mrope_interleaved;
  g.table.pos_component = pos_component_stride;
}

// The ops that end in the paged caches (rope.apply_and_cache_, rope.qk_norm_rope_and_cache_):
// the rotation of query and key (check_positions_op; tables.mrope_section for MRoPE), then value,
// the caches (num_blocks, block_size, kv_heads, head_dim / value_dim), slot_mapping and the
// scales. The caches are written (and value, where value_written), so they may not overlap
// anything; slot range checks are data and run where the data is (the CPU host, or the CUDA
// kernel).
// What the checks read of the paged-cache ops' tensors, read once (a caller that checks more of
// them, the prologue's weights against what it writes, reuses it).
struct CacheMetas {
  Meta q, k, v, kc, vc, sl;
  CacheMetas(const Tensor& query, const Tensor& key, const Tensor& value, const Tensor& key_cache,
             const Tensor& value_cache, const Tensor& slots)
      : q(query), k(key), v(value), kc(key_cache), vc(value_cache), sl(slots) {}
};

inline CacheGeometry check_rope_and_cache(const CacheMetas& m, const Tensor& positions_t,
                                          const TableArgs& tables, bool interleaved,
                                          const std::string& kv_cache_dtype,
                                          const std::optional<Tensor>& k_scale_t,
                                          const std::optional<Tensor>& v_scale_t,
                                          bool value_written, const char* op,
                                          bool in_place = true) {
  const Meta &q = m.q, &k = m.k, &v = m.v, &kc = m.kc, &vc = m.vc, &sl = m.sl;
  ROPE_CHECK(q.dim == 3 && k.dim == 3, op,
             ": query and key must have shape (num_tokens, num_heads, head_dim), got query ",
             shape_str(q), " and key ", shape_str(k));
  CacheGeometry cg;
  cg.rot = check_positions_op(q, &k, positions_t, tables, interleaved, false, in_place, op,
                              "query");
  const int64_t tokens = q.sizes[0], kv_heads = k.sizes[1], head_dim = k.sizes[2];
  check_same_device(q, "query", v, op, "value");
  ROPE_CHECK(v.dtype == k.dtype, op, ": value must have the dtype of key (", dtype_str(k.dtype),
             "), got ", dtype_str(v.dtype));
  ROPE_CHECK(v.dim == 3 && v.sizes[0] == tokens && v.sizes[1] == kv_heads, op,
             ": value must have shape (num_tokens, num_kv_heads, value_dim) = (", tokens, ", ",
             kv_heads, ", value_dim), got ", shape_str(v));
  const int64_t value_dim = v.sizes[2];

  ScalarType want;
  if (kv_cache_dtype == "auto") {
    cg.format = CacheFormat::kSame;
    want = k.dtype;
  } else if (kv_cache_dtype == "fp8" || kv_cache_dtype == "fp8_e4m3") {
    cg.format = CacheFormat::kE4M3FN;
    want = ScalarType::Float8_e4m3fn;
  } else if (kv_cache_dtype == "fp8_e5m2") {
    cg.format = CacheFormat::kE5M2;
    want = ScalarType::Float8_e5m2;
  } else {
    fail(op, ": kv_cache_dtype must be 'auto', 'fp8', 'fp8_e4m3' or 'fp8_e5m2', got '",
         kv_cache_dtype, "'");
  }
  const std::pair<const char*, const Meta*> caches[] = {{"key_cache", &kc}, {"value_cache", &vc}};
  for (const auto& [name, m] : caches) {
    check_same_device(q, "query", *m, op, name);
    ROPE_CHECK(m->dtype == want, op, ": ", name, " must be ", dtype_str(want), " for kv_cache_dtype '",
               kv_cache_dtype, "' and key ", dtype_str(k.dtype), ", got ", dtype_str(m->dtype));
  }
  ROPE_CHECK(kc.dim == 4 && kc.sizes[2] == kv_heads && kc.sizes[3] == head_dim, op,
             ": key_cache must have shape (num_blocks, block_size, num_kv_heads, head_dim) with "
             "num_kv_heads = ", kv_heads, " and head_dim = ", head_dim, ", got ", shape_str(kc));
  ROPE_CHECK(vc.dim == 4 && vc.sizes[0] == kc.sizes[0] && vc.sizes[1] == kc.sizes[1] &&
                 vc.sizes[2] == kv_heads && vc.sizes[3] == value_dim,
             op, ": value_cache must have shape (num_blocks, block_size, num_kv_heads, value_dim) = (",
             kc.sizes[0], ", ", kc.sizes[1], ", ", kv_heads, ", ", value_dim, "), got ",
             shape_str(vc));
  ROPE_CHECK(kc.sizes[1] >= 1, op, ": key_cache must have block_size >= 1, got ", shape_str(kc));
  check_same_device(q, "query", sl, op, "slot_mapping");
  ROPE_CHECK(sl.dtype == ScalarType::Long || sl.dtype == ScalarType::Int, op,
             ": slot_mapping must be int32 or int64, got ", dtype_str(sl.dtype));
  ROPE_CHECK(sl.dim == 1 && sl.sizes[0] == tokens, op,
             ": slot_mapping must have shape (num_tokens,) = (", tokens, ",), got ",
             shape_str(sl));
  const std::pair<const char*, const std::optional<Tensor>*> scales[] = {{"k_scale", &k_scale_t},
                                                                         {"v_scale", &v_scale_t}};
  // Checked whenever given (vLLM passes them for every cache dtype), required for fp8 only.
  for (const auto& [name, s] : scales) {
    ROPE_CHECK(s->has_value() || cg.format == CacheFormat::kSame, op, ": ", name,
               " is required for kv_cache_dtype '", kv_cache_dtype,
               "' (a float32 tensor of one element)");
    if (!s->has_value()) continue;
    const Meta m(**s);
    check_same_device(q, "query", m, op, name);
    ROPE_CHECK(m.dtype == ScalarType::Float && m.numel == 1, op, ": ", name,
               " must be a float32 tensor of one element, got ", dtype_str(m.dtype), " of shape ",
               shape_str(m));
  }

  // Written: both caches, and in place query and key (out of place they are only read, like
  // value, and may share memory with each other). Nothing else may share the written memory.
  check_no_internal_overlap(kc, op, "key_cache");
  check_no_internal_overlap(vc, op, "value_cache");
  if (value_written) check_no_internal_overlap(v, op, "value");  // before its rows are compared
  check_elements_disjoint(kc, "key_cache", vc, "value_cache", op);
  const std::pair<const char*, const Meta*> rotated[] = {{"query", &q}, {"key", &k}};
  for (const auto& [wname, w] : rotated) {
    for (const auto& [cname, c] : caches) check_disjoint_bytes(*c, cname, *w, wname, op);
  }
  if (in_place) {
    // value may be a view of the same fused qkv buffer as query and key: disjoint rows suffice.
    check_rows_disjoint(q, v, 1, op, "query", "value");
    check_rows_disjoint(k, v, 1, op, "key", "value");
  }
  check_disjoint_bytes(kc, "key_cache", v, "value", op);
  check_disjoint_bytes(vc, "value_cache", v, "value", op);
  const Meta table(*tables.cache);
  for (const auto& [cname, c] : caches) check_disjoint_bytes(*c, cname, table, "cos_sin_cache", op);
  if (value_written) check_disjoint_bytes(v, "value", table, "cos_sin_cache", op);
  // The scales are read while query, key and the caches are written: the kernels would see the
  // old or the new value depending on the order of their reads.
  for (const auto& [name, s] : scales) {
    if (!s->has_value()) continue;
    const Meta m(**s);
    if (in_place) {
      for (const auto& [wname, w] : rotated) check_disjoint_bytes(*w, wname, m, name, op);
    }
    for (const auto& [cname, c] : caches) check_disjoint_bytes(*c, cname, m, name, op);
    if (value_written) check_disjoint_bytes(v, "value", m, name, op);
  }

  int64_t slots;
  ROPE_CHECK(mul_fits(kc.sizes[0], kc.sizes[1], slots), op,
             ": key_cache has 2^63 slots or more");
  cg.kv_heads = kv_heads;
  cg.value_dim = value_dim;
  cg.slots = slots;
  cg.block_size = kc.sizes[1];
  cg.slots64 = sl.dtype == ScalarType::Long;
  cg.slot_stride = sl.strides[0];
  cg.v_token = v.strides[0];
  cg.v_head = v.strides[1];
  cg.v_last = v.strides[2];
  if (in_place) {
    cg.vo_token = cg.v_token;
    cg.vo_head = cg.v_head;
    cg.vo_last = cg.v_last;
  } else {  // a fresh contiguous (tokens, kv_heads, value_dim)
    cg.vo_head = value_dim;
    if (!mul_fits(kv_heads, value_dim, cg.vo_token)) cg.vo_token = 0;  // only with no tokens
  }
  cg.kc = CacheStrides{kc.strides[0], kc.strides[1], kc.strides[2], kc.strides[3]};
  cg.vc = CacheStrides{vc.strides[0], vc.strides[1], vc.strides[2], vc.strides[3]};
  return cg;
}

inline CacheGeometry check_apply_and_cache(const Tensor& query, const Tensor& key,
                                           const Tensor& value, const Tensor& positions,
                                           const Tensor& cache, const Tensor& key_cache,
                                           const Tensor& value_cache, const Tensor& slots,
                                           bool interleaved, const std::string& kv_cache_dtype,
                                           const std::optional<Tensor>& k_scale,
                                           const std::optional<Tensor>& v_scale) {
  return check_rope_and_cache(CacheMetas(query, key, value, key_cache, value_cache, slots),
                              positions, TableArgs{&cache}, interleaved, kv_cache_dtype, k_scale,
                              v_scale, false, "rope.apply_and_cache_");
}

}  // namespace rope
