// Plain-data descriptions of one op call, filled on the host by checks.h and read by the CPU
// kernels, the CUDA kernels and the CUDA simulator. Fixed-size arrays (no heap), so the structs
// can be passed by value to a CUDA kernel.
//
// Every op is one RotateGeometry: `tokens` rows of work; per token, a cos/sin row (from strided
// tables, or gathered by position, or per pair by MRoPE position component) rotates `heads` rows
// of each of up to two targets (query and key, or x), reading src and writing dst (the same
// memory for the in-place ops). rope.apply is the case heads = 1, one target.
#pragma once

#include <cstdint>

#include "../rope_math.h"

namespace rope {

// Leading dims left after dropping size-1 dims and merging dims that are contiguous with each
// other in every operand. Real layouts need at most 4.
constexpr int kMaxLeadDims = 8;

// The operands a LeadIndexer walks, per token.
enum Operand : int {
  kSrc0 = 0,  // target 0 (x, query): first element of the token's rows
  kDst0 = 1,
  kSrc1 = 2,  // target 1 (key)
  kDst1 = 3,
  kTab0 = 4,  // strided tables: cos; gathered tables: positions
  kTab1 = 5,  // strided tables: sin
  kMaxOperands = 6,
};

// Maps a flat token index over the leading dims to element offsets in every operand (stride 0
// where an operand is broadcast along a dim).
struct LeadIndexer {
  int ndim = 0;
  int64_t sizes[kMaxLeadDims] = {};
  int64_t strides[kMaxOperands][kMaxLeadDims] = {};

  ROPE_HD void offsets(int64_t token, int64_t out[kMaxOperands]) const {
    for (int t = 0; t < kMaxOperands; ++t) out[t] = 0;
    for (int d = ndim - 1; d >= 0; --d) {
      const int64_t q = token / sizes[d];
      const int64_t i = token - q * sizes[d];
      token = q;
      for (int t = 0; t < kMaxOperands; ++t) out[t] += i * strides[t][d];
    }
  }
};

enum class TableKind : int32_t {
  kStrided = 0,   // cos/sin rows at lead offsets kTab0/kTab1 (rope.apply)
  kGathered = 1,  // cos/sin table rows at positions[kTab0]
  kMrope = 2,     // pair i from the row of position component mrope_component(i)
};

struct TableDesc {
  TableKind kind = TableKind::kStrided;
  int64_t cos_col = 1, sin_col = 1;  // strides along the pair index
  int64_t cos_row = 0, sin_row = 0;  // gathered/MRoPE: strides between table rows
  int64_t rows = 0;                  // gathered/MRoPE: max_position (positions lie in [0, rows))
  bool pos64 = true;                 // positions are int64 (else int32)
  int64_t pos_component = 0;         // MRoPE: stride between the 3 components of positions
  int64_t section[kMropeComponents] = {};
  bool mrope_interleaved = false;
};

// One rotated tensor: `heads` rows per token, head_stride apart; `last` strides along the head dim.
struct TargetDesc {
  int64_t heads = 0;
  int64_t src_head = 0, dst_head = 0;
  int64_t src_last = 1, dst_last = 1;
};

struct RotateGeometry {
  int64_t tokens = 0;
  int64_t head_dim = 0;
  int64_t half = 0;  // rotary_dim / 2
  bool interleaved = false;
  bool inverse = false;    // rotate by the negative angle (the backward)
  bool copy_tail = false;  // out of place: dims >= rotary_dim are copied to dst
  // In place with rope_dim_offset: the rotary dims are [rot_offset, rot_offset + 2 * half) of
  // each row. The host binds every row's pointer at rot_offset, so the kernels never read it;
  // the simulator does, to bound the rows' elements.
  int64_t rot_offset = 0;
  int32_t targets = 0;
  TargetDesc target[2];
  TableDesc table;
  LeadIndexer lead;
};

// rope.apply_and_cache_: query and key (tokens, heads, head_dim) rotated in place as a
// RotateGeometry (gathered tables); then, per token with slot >= 0, the rotated key rows and the
// value rows are stored at cache[slot / block_size, slot % block_size] (vLLM's paged layout
// (num_blocks, block_size, kv_heads, head_dim)). Negative slots are padding and skipped.
enum class CacheFormat : int32_t {
  kSame = 0,    // the caches have the key's dtype
  kE4M3FN = 1,  // float8: value / scale, saturated
  kE5M2 = 2,
};

// A paged cache (num_blocks, block_size, kv_heads, head_dim): its strides, in elements.
struct CacheStrides {
  int64_t block = 0, offset = 0, head = 0, last = 1;

  // Element offset of the slot's row of head 0 (slot = block * block_size + offset); head h's
  // row is `head * h` further.
  ROPE_HD int64_t slot_row(int64_t slot, int64_t block_size) const {
    const int64_t b = slot / block_size;
    return b * block + (slot - b * block_size) * offset;
  }
};

// The cache part of a CacheGeometry (all the CUDA cache kernel needs beside the rotation).
struct CacheDesc {
  CacheFormat format = CacheFormat::kSame;
  int64_t kv_heads = 0, value_dim = 0;
  int64_t slots = 0;  // num_blocks * block_size
  int64_t block_size = 1;
  bool slots64 = true;
  // Strides, in elements: of slot_mapping, of the value rows (token, head, last dim), and of
  // the two caches (block, offset in the block, head, last dim).
  int64_t slot_stride = 1;
  int64_t v_token = 0, v_head = 0, v_last = 1;
  // Of the written value rows: value's own with v_norm in place, a fresh contiguous value out
  // of place (rope.qk_norm_rope_and_cache); unused where value is only read.
  int64_t vo_token = 0, vo_head = 0, vo_last = 1;
  CacheStrides kc, vc;
};

struct CacheGeometry : CacheDesc {
  RotateGeometry rot;  // target 0 = query, target 1 = key; one leading dim (tokens)
};

}  // namespace rope
