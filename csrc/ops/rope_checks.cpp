#include "rope_checks.h"

#include <algorithm>
#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#include <torch/headeronly/util/Exception.h>

namespace rope {

using torch::headeronly::ScalarType;

bool is_supported_float(ScalarType t) {
  return t == ScalarType::Float || t == ScalarType::Double || t == ScalarType::Half ||
         t == ScalarType::BFloat16;
}

namespace {

std::string shape_str(const Tensor& t) {
  std::ostringstream s;
  s << "[";
  for (int64_t d = 0; d < t.dim(); ++d) s << (d ? ", " : "") << t.size(d);
  s << "]";
  return s.str();
}

std::string dtype_str(const Tensor& t) { return torch::headeronly::toString(t.scalar_type()); }

// Spelled as Python's str(torch.device) so messages match the Python paths.
std::string device_str(const Tensor& t) {
  using torch::headeronly::DeviceType;
  const auto type = t.device().type();
  if (type == DeviceType::CPU) return "cpu";
  if (type == DeviceType::Meta) return "meta";
  const std::string name = type == DeviceType::CUDA ? "cuda" : "device type " + std::to_string(int(type));
  return name + ":" + std::to_string(t.get_device_index());
}

// Compares sizes without formatting them: this runs on every call, and decode-sized calls are
// dominated by fixed costs like this one.
bool same_shape(const Tensor& a, const Tensor& b) {
  if (a.dim() != b.dim()) return false;
  for (int64_t d = 0; d < a.dim(); ++d) {
    if (a.size(d) != b.size(d)) return false;
  }
  return true;
}

void check_float(const Tensor& t, const char* op, const char* name) {
  STD_TORCH_CHECK(is_supported_float(t.scalar_type()), op, ": ", name,
                  " must be float16, bfloat16, float32 or float64, got ", dtype_str(t));
}

void check_same_device(const Tensor& ref, const char* ref_name, const Tensor& t, const char* op,
                       const char* name) {
  STD_TORCH_CHECK(t.device() == ref.device(), op, ": ", name, " must be on the same device as ",
                  ref_name, " (", device_str(ref), "), got ", device_str(t));
}

// Builds `lead` from per-dim sizes and per-operand strides: drops size-1 dims and merges a dim
// into the next inner one when every operand is contiguous across the two.
LeadIndexer make_indexer(const std::vector<int64_t>& sizes,
                         const std::vector<std::vector<int64_t>>& strides, const char* op) {
  LeadIndexer ix;
  // An empty operand visits no rows: keep no dims, so that no kernel or row walk ever divides
  // by a zero size.
  if (std::find(sizes.begin(), sizes.end(), int64_t{0}) != sizes.end()) return ix;
  std::vector<int64_t> sz;
  std::vector<std::vector<int64_t>> st(kMaxOperands);
  for (size_t d = 0; d < sizes.size(); ++d) {
    if (sizes[d] == 1) continue;
    bool merge = !sz.empty();
    for (size_t t = 0; merge && t < strides.size(); ++t) {
      merge = st[t].back() == strides[t][d] * sizes[d];
    }
    if (merge) {
      sz.back() *= sizes[d];
      for (size_t t = 0; t < strides.size(); ++t) st[t].back() = strides[t][d];
    } else {
      sz.push_back(sizes[d]);
      for (size_t t = 0; t < kMaxOperands; ++t) {
        st[t].push_back(t < strides.size() ? strides[t][d] : 0);
      }
    }
  }
  STD_TORCH_CHECK(static_cast<int>(sz.size()) <= kMaxLeadDims, op,
                  ": the leading dims of the operands have a layout with more than ",
                  kMaxLeadDims, " non-mergeable dims; call .contiguous() first");
  ix.ndim = static_cast<int>(sz.size());
  for (int d = 0; d < ix.ndim; ++d) {
    ix.sizes[d] = sz[d];
    for (int t = 0; t < kMaxOperands; ++t) ix.strides[t][d] = st[t][d];
  }
  return ix;
}

// Byte range [begin, end) spanned by t's elements (empty for an empty tensor). Strides of
// tensors torch builds are never negative.
struct ByteRange {
  uintptr_t begin = 0, end = 0;
};

ByteRange byte_range(const Tensor& t) {
  ByteRange r;
  if (t.numel() == 0) return r;
  int64_t last = 0;
  for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
  const int64_t es = static_cast<int64_t>(t.element_size());
  r.begin = reinterpret_cast<uintptr_t>(t.const_data_ptr());
  r.end = r.begin + static_cast<uintptr_t>((last + 1) * es);
  return r;
}

void check_no_overlap(const Tensor& out, const Tensor& t, const char* op, const char* name) {
  const ByteRange a = byte_range(out), b = byte_range(t);
  STD_TORCH_CHECK(a.begin == a.end || b.begin == b.end || a.end <= b.begin || b.end <= a.begin,
                  op, ": out must not overlap ", name,
                  " in memory (use rope.apply_ to rotate in place)");
}

}  // namespace

ApplyGeometry check_apply_out(const Tensor& x, const Tensor& cos, const Tensor& sin,
                              const Tensor& out) {
  const char* op = "rope.apply.out";
  ApplyGeometry g = check_apply(x, cos, sin, op, "x");
  check_same_device(x, "x", out, op, "out");
  STD_TORCH_CHECK(out.scalar_type() == x.scalar_type(), op, ": out must have the dtype of x (",
                  dtype_str(x), "), got ", dtype_str(out));
  STD_TORCH_CHECK(same_shape(out, x), op, ": out must have the shape of x ", shape_str(x),
                  ", got ", shape_str(out));
  STD_TORCH_CHECK(out.is_contiguous(), op, ": out must be contiguous");
  check_no_overlap(out, x, op, "x");
  check_no_overlap(out, cos, op, "cos");
  check_no_overlap(out, sin, op, "sin");
  return g;
}

ApplyGeometry check_apply(const Tensor& x, const Tensor& cos, const Tensor& sin, const char* op,
                          const char* x_name) {
  check_float(x, op, x_name);
  check_float(cos, op, "cos");
  check_float(sin, op, "sin");
  STD_TORCH_CHECK(x.dim() >= 1, op, ": ", x_name, " must have at least 1 dim (..., head_dim)");
  check_same_device(x, x_name, cos, op, "cos");
  check_same_device(x, x_name, sin, op, "sin");
  STD_TORCH_CHECK(cos.scalar_type() == sin.scalar_type(), op,
                  ": cos and sin must have the same dtype, got cos ", dtype_str(cos), " and sin ",
                  dtype_str(sin));
  STD_TORCH_CHECK(same_shape(cos, sin), op,
                  ": cos and sin must have the same shape, got cos ", shape_str(cos), " and sin ",
                  shape_str(sin));
  STD_TORCH_CHECK(cos.dim() >= 1, op, ": cos must have at least 1 dim (..., rotary_dim/2)");

  const int64_t nlead = x.dim() - 1;
  const int64_t head_dim = x.size(-1);
  const int64_t half = cos.size(-1);
  STD_TORCH_CHECK(2 * half <= head_dim, op, ": rotary_dim = 2 * cos.size(-1) = ", 2 * half,
                  " must be <= head_dim = ", x_name, ".size(-1) = ", head_dim);
  bool broadcasts = cos.dim() - 1 <= nlead;
  for (int64_t j = 1; broadcasts && j < cos.dim(); ++j) {
    const int64_t c = cos.size(-1 - j), xs = x.size(-1 - j);
    broadcasts = (c == 1 || c == xs);
  }
  STD_TORCH_CHECK(broadcasts, op, ": cos and sin of shape ", shape_str(cos),
                  " must broadcast to ", x_name, ".shape[:-1] + (rotary_dim/2,) for ", x_name,
                  " of shape ", shape_str(x));

  ApplyGeometry g;
  g.head_dim = head_dim;
  g.half = half;
  g.x_last = x.stride(-1);
  g.cos_last = cos.stride(-1);
  g.sin_last = sin.stride(-1);
  g.rows = 1;
  std::vector<int64_t> sizes(nlead);
  std::vector<std::vector<int64_t>> strides(3, std::vector<int64_t>(nlead, 0));
  for (int64_t d = 0; d < nlead; ++d) {
    sizes[d] = x.size(d);
    g.rows *= sizes[d];
    strides[0][d] = x.stride(d);
    const int64_t cd = d - (nlead - (cos.dim() - 1));  // aligned from the right
    if (cd >= 0 && cos.size(cd) != 1) {
      strides[1][d] = cos.stride(cd);
      strides[2][d] = sin.stride(cd);
    }
  }
  g.lead = make_indexer(sizes, strides, op);
  return g;
}

InplaceGeometry check_apply_inplace(const Tensor& query, const std::optional<Tensor>& key,
                                    const Tensor& positions, const Tensor& cache) {
  return check_apply_inplace(query, key, positions, cache, "rope.apply_");
}

InplaceGeometry check_apply_inplace(const Tensor& query, const std::optional<Tensor>& key,
                                    const Tensor& positions, const Tensor& cache, const char* op) {
  check_float(query, op, "query");
  STD_TORCH_CHECK(query.dim() >= 2, op,
                  ": query must have shape (..., num_heads, head_dim), got ", shape_str(query));
  const int64_t nlead = query.dim() - 2;
  if (key.has_value()) {
    const Tensor& k = *key;
    check_same_device(query, "query", k, op, "key");
    STD_TORCH_CHECK(k.scalar_type() == query.scalar_type(), op,
                    ": key must have the dtype of query (", dtype_str(query), "), got ",
                    dtype_str(k));
    bool same_lead = k.dim() == query.dim() && k.size(-1) == query.size(-1);
    for (int64_t d = 0; same_lead && d < nlead; ++d) same_lead = k.size(d) == query.size(d);
    STD_TORCH_CHECK(same_lead, op,
                    ": key must have shape (..., num_kv_heads, head_dim) with the leading dims "
                    "and head_dim of query ",
                    shape_str(query), ", got ", shape_str(k));
  }
  check_same_device(query, "query", positions, op, "positions");
  check_same_device(query, "query", cache, op, "cos_sin_cache");
  STD_TORCH_CHECK(
      positions.scalar_type() == ScalarType::Long || positions.scalar_type() == ScalarType::Int, op,
      ": positions must be int32 or int64, got ", dtype_str(positions));
  bool pos_shape = positions.dim() == nlead;
  for (int64_t d = 0; pos_shape && d < nlead; ++d) pos_shape = positions.size(d) == query.size(d);
  STD_TORCH_CHECK(pos_shape, op, ": positions must have shape query.shape[:-2] (query is ",
                  shape_str(query), "), got ", shape_str(positions));
  check_float(cache, op, "cos_sin_cache");
  STD_TORCH_CHECK(cache.dim() == 2, op,
                  ": cos_sin_cache must have shape (max_position, rotary_dim), got ",
                  shape_str(cache));
  const int64_t rotary_dim = cache.size(1);
  STD_TORCH_CHECK(rotary_dim % 2 == 0 && rotary_dim <= query.size(-1), op,
                  ": rotary_dim = cos_sin_cache.size(1) = ", rotary_dim,
                  " must be even and <= head_dim = ", query.size(-1));

  InplaceGeometry g;
  g.head_dim = query.size(-1);
  g.half = rotary_dim / 2;
  g.q_heads = query.size(-2);
  g.q_head_stride = query.stride(-2);
  g.q_last = query.stride(-1);
  if (key.has_value()) {
    g.k_heads = key->size(-2);
    g.k_head_stride = key->stride(-2);
    g.k_last = key->stride(-1);
  }
  g.cache_row_stride = cache.stride(0);
  g.cache_col_stride = cache.stride(1);
  g.max_position = cache.size(0);
  g.tokens = 1;
  std::vector<int64_t> sizes(nlead);
  std::vector<std::vector<int64_t>> strides(3, std::vector<int64_t>(nlead, 0));
  for (int64_t d = 0; d < nlead; ++d) {
    sizes[d] = query.size(d);
    g.tokens *= sizes[d];
    strides[0][d] = query.stride(d);
    strides[1][d] = key.has_value() ? key->stride(d) : 0;
    strides[2][d] = positions.stride(d);
  }
  g.lead = make_indexer(sizes, strides, op);
  return g;
}

}  // namespace rope
