// Per-token code of the RoPE + FP8 quantization ops (rope.quantize_fp8 and
// rope.quantize_fp8_append_paged_kv_cache), plain C++ like rope_cuda_thread.h: the CUDA kernels
// (quant/cuda/quant_cuda.cu) and the simulator run all of it; the CPU kernels (quant/cpu/kernels.h) run
// its rows and their destinations (quant_token_rows, quant_row) with their own vector row loops,
// which round like rotate_pair and float_to_fp8 (tests/test_rope_quant.py compares every path's
// bits).
//
// Per token, rows of work: the query's rope heads, the key's rope heads, the query's nope heads,
// the key's nope heads and (paged GQA/MHA) the value heads; each row in chunks of 16 outputs (one
// 16-byte vector of float8 codes). Every input element is read once: a rotary pair by the thread
// that writes both of its outputs.
#pragma once

#include "../geometry.h"
#include "../../cuda/rope_cuda_thread.h"

namespace rope::gpu {

// Outputs per chunk: one 16-byte vector of 1-byte codes.
constexpr int kQuantChunk = 16;

template <typename x_t>
struct QuantArgs {
  QuantGeometry g;
  const x_t* q_rope;
  const x_t* k_rope;
  const x_t* q_nope;
  const x_t* k_nope;
  const x_t* v;  // paged GQA/MHA only
  const float* cos;
  const float* sin;
  const void* pos;
  uint8_t* q_rope_out;
  uint8_t* k_rope_out;  // unused by the paged op
  uint8_t* q_nope_out;
  uint8_t* k_nope_out;  // unused by the paged op
  uint8_t* kc;          // paged: key cache (MLA: ckv)
  uint8_t* vc;          // paged: value cache (MLA: kpe)
  const void* kv_indices;
  const void* kv_indptr;
  const void* batch_indices;
  const void* positions;
  int64_t rope_chunks, nope_chunks, v_chunks;
  bool vec;  // every row 16-byte aligned, unit stride, every dim a multiple of the chunk
};

// Pairs per rotary chunk: interleaved pairs are adjacent (16 elements = 8 pairs); half-split
// pairs have their members half apart (16 pairs, 16 outputs in each half).
ROPE_HD int64_t quant_pairs_per_chunk(bool interleaved) { return interleaved ? 8 : 16; }

template <typename x_t>
ROPE_HD void load16(const x_t* p, float (&out)[kQuantChunk]) {
  constexpr int W = kWidth<x_t>;
  ROPE_UNROLL
  for (int k = 0; k < kQuantChunk / W; ++k) {
    const Pack<x_t, W> pk = load_pack<x_t, W>(p + k * W);
    ROPE_UNROLL
    for (int j = 0; j < W; ++j) out[k * W + j] = static_cast<float>(pk.v[j]);
  }
}

// The same bits either way: on the GPU the branchy conversion (the branch-free one costs
// registers there, and spills), in the simulator the branch-free one.
ROPE_HD void store16(uint8_t* p, const float (&v)[kQuantChunk], float scale, Fp8Format fmt) {
  Pack<uint8_t, kQuantChunk> pk;
#ifdef __CUDA_ARCH__
  ROPE_UNROLL
  for (int j = 0; j < kQuantChunk; ++j) pk.v[j] = float_to_fp8(v[j] * scale, fmt);
#else
  if (fmt == Fp8Format::kE4M3FN) {
    for (int j = 0; j < kQuantChunk; ++j) pk.v[j] = float_to_fp8_vec(v[j] * scale, Fp8Format::kE4M3FN);
  } else {
    for (int j = 0; j < kQuantChunk; ++j) pk.v[j] = float_to_fp8_vec(v[j] * scale, Fp8Format::kE5M2);
  }
#endif
  store_pack<uint8_t, kQuantChunk>(p, pk);
}

// Rotary chunk c of one row: src (x_t) -> dst (codes), cos/sin of the token's table row.
template <typename x_t>
ROPE_HD void quant_rope_chunk(const x_t* src, int64_t s_last, uint8_t* dst, int64_t d_last,
                              int64_t half, bool interleaved, int64_t c, const float* cos,
                              const float* sin, int64_t col, float scale, Fp8Format fmt,
                              bool vec) {
  if (vec) {
    if (interleaved) {  // elements [16c, 16c + 16): 8 pairs
      float x[kQuantChunk], o[kQuantChunk];
      load16(src + c * kQuantChunk, x);
      ROPE_UNROLL
      for (int i = 0; i < kQuantChunk / 2; ++i) {
        const int64_t p = c * (kQuantChunk / 2) + i;
        rotate_pair(x[2 * i], x[2 * i + 1], load(cos + p * col), load(sin + p * col), o[2 * i],
                    o[2 * i + 1]);
      }
      store16(dst + c * kQuantChunk, o, scale, fmt);
    } else {  // pairs [16c, 16c + 16): elements there and half further
      float a[kQuantChunk], b[kQuantChunk], oa[kQuantChunk], ob[kQuantChunk];
      load16(src + c * kQuantChunk, a);
      load16(src + half + c * kQuantChunk, b);
      ROPE_UNROLL
      for (int i = 0; i < kQuantChunk; ++i) {
        const int64_t p = c * kQuantChunk + i;
        rotate_pair(a[i], b[i], load(cos + p * col), load(sin + p * col), oa[i], ob[i]);
      }
      store16(dst + c * kQuantChunk, oa, scale, fmt);
      store16(dst + (half + c * kQuantChunk), ob, scale, fmt);
    }
    return;
  }
  const int64_t per = quant_pairs_per_chunk(interleaved);
  ROPE_UNROLL
  for (int i = 0; i < kQuantChunk; ++i) {
    const int64_t p = c * per + i;
    if (i < per && p < half) {
      const int64_t ia = interleaved ? 2 * p : p, ib = interleaved ? 2 * p + 1 : p + half;
      const float x0 = static_cast<float>(load(src + ia * s_last));
      const float x1 = static_cast<float>(load(src + ib * s_last));
      float o0, o1;
      rotate_pair(x0, x1, load(cos + p * col), load(sin + p * col), o0, o1);
      store(dst + ia * d_last, float_to_fp8(o0 * scale, fmt));
      store(dst + ib * d_last, float_to_fp8(o1 * scale, fmt));
    }
  }
}

// Pass-through chunk c of a row of n elements: x * scale to codes.
template <typename x_t>
ROPE_HD void quant_copy_chunk(const x_t* src, int64_t s_last, uint8_t* dst, int64_t d_last,
                              int64_t n, int64_t c, float scale, Fp8Format fmt, bool vec) {
  if (vec) {
    float x[kQuantChunk];
    load16(src + c * kQuantChunk, x);
    store16(dst + c * kQuantChunk, x, scale, fmt);
    return;
  }
  ROPE_UNROLL
  for (int i = 0; i < kQuantChunk; ++i) {
    const int64_t e = c * kQuantChunk + i;
    if (e < n) store(dst + e * d_last, float_to_fp8(static_cast<float>(load(src + e * s_last)) * scale, fmt));
  }
}

// The page table of a paged call: what paged_slot reads, whatever x's dtype.
struct PagedTable {
  const void* kv_indices;
  const void* kv_indptr;
  const void* batch_indices;
  const void* positions;
};

template <typename x_t>
ROPE_HD PagedTable paged_table(const QuantArgs<x_t>& a) {
  return {a.kv_indices, a.kv_indptr, a.batch_indices, a.positions};
}

// The token's cache slot (page, entry); false when the token is padding (batch_indices < 0) or
// its page table entries are out of range (a device-side check, which the CPU host has already
// made).
ROPE_HD bool paged_slot(const QuantGeometry& g, const PagedTable& a, int64_t tok, int64_t& page,
                        int64_t& entry) {
  const int64_t b = load_position(a.batch_indices, g.batch_indices.is64, tok * g.batch_indices.stride);
  if (b < 0) return false;
  ROPE_DEVICE_CHECK(b < g.batch, "rope: batch_indices must lie below batch_size");
  if (b >= g.batch) return false;
  const int64_t start = load_position(a.kv_indptr, g.kv_indptr.is64, b * g.kv_indptr.stride);
  const int64_t end = load_position(a.kv_indptr, g.kv_indptr.is64, (b + 1) * g.kv_indptr.stride);
  const bool ptr_ok = start >= 0 && start <= end && end <= g.num_indices;
  ROPE_DEVICE_CHECK(ptr_ok, "rope: kv_indptr must be non-decreasing within [0, kv_indices.size(0)]");
  if (!ptr_ok) return false;
  const int64_t p = load_position(a.positions, g.positions.is64, tok * g.positions.stride);
  const bool p_ok = p >= 0 && p / g.page_size < end - start;
  ROPE_DEVICE_CHECK(p_ok, "rope: positions must lie within the request's pages");
  if (!p_ok) return false;
  page = load_position(a.kv_indices, g.kv_indices.is64, (start + p / g.page_size) * g.kv_indices.stride);
  ROPE_DEVICE_CHECK(page >= 0 && page < g.max_pages, "rope: kv_indices must lie in [0, max_pages)");
  entry = p - (p / g.page_size) * g.page_size;
  return page >= 0 && page < g.max_pages;
}

// The paged op's cache entries used at most once, as rope.apply_and_cache_'s slots
// (slot_set_thread): launched before the quant kernel when two tokens or more are cached, each
// token inserts page * page_size + entry into the set (`mask + 1` entries, all kEmptySlot), and
// one that finds its entry there stops the stream before the quant kernel writes anything.
// One kernel for every dtype: it reads the page table only.
struct PagedSlotSetArgs {
  QuantGeometry g;
  PagedTable table;
  int64_t mask;
  unsigned long long* set;
};

ROPE_HD void paged_slot_set_thread(const PagedSlotSetArgs& s, const ThreadPos& tp) {
  const int64_t step = static_cast<int64_t>(tp.grid_dim.x) * tp.block_dim.x;
  for (int64_t tok = static_cast<int64_t>(tp.block.x) * tp.block_dim.x + tp.thread.x;
       tok < s.g.tokens; tok += step) {
    int64_t page = 0, entry = 0;
    if (!paged_slot(s.g, s.table, tok, page, entry)) continue;  // padding
    const auto key = static_cast<unsigned long long>(page * s.g.page_size + entry);
    ROPE_DEVICE_CHECK(insert_slot(s.set, s.mask, key),
                      "rope: two tokens must not write one cache entry");
  }
}

// Rows of one token (see the top of the file).
template <typename x_t>
ROPE_HD int64_t quant_rows(const QuantGeometry& g) {
  return 2 * (g.q_heads + g.kv_heads) + (g.paged && !g.mla ? g.kv_heads : 0);
}

// What a token's rows share: its table row and, paged, its cache rows (head 0). ok is false for
// a position outside the table (a device-side check; never read there).
struct QuantTokenRows {
  bool ok = false, to_cache = false;
  const float* cos = nullptr;
  const float* sin = nullptr;
  int64_t kc_row = 0, vc_row = 0;
};

template <typename x_t>
ROPE_HD QuantTokenRows quant_token_rows(const QuantArgs<x_t>& a, int64_t tok) {
  const QuantGeometry& g = a.g;
  QuantTokenRows t;
  const int64_t pos = load_position(a.pos, g.pos.is64, tok * g.pos.stride);
  ROPE_DEVICE_CHECK(pos >= 0 && pos < g.table_rows, "rope: pos_ids must lie in [0, max_position)");
  if (pos < 0 || pos >= g.table_rows) return t;
  int64_t page = 0, entry = 0;
  t.ok = true;
  t.to_cache = g.paged && paged_slot(g, paged_table(a), tok, page, entry);
  t.cos = a.cos + pos * g.cos_row;
  t.sin = a.sin + pos * g.cos_row;
  t.kc_row = page * g.kc.page + entry * g.kc.entry;
  t.vc_row = page * g.vc.page + entry * g.vc.entry;
  return t;
}

// Row r of a token: source and destination (codes), their strides along the row, its elements
// (a rotary row: its pairs' 2 * half), its chunks and scale. dst == nullptr: nothing to write (a
// paged key or value row of a token that is not cached).
template <typename x_t>
struct QuantRow {
  const x_t* src = nullptr;
  int64_t s_last = 1;
  uint8_t* dst = nullptr;
  int64_t d_last = 1;
  int64_t n = 0, chunks = 0;
  bool rope = false;
  float scale = 1.0f;
};

// Key head h's row w (rope or nope part, w.rope): written to its output row (`out`, `rows`), or
// paged, to the token's cache row: MLA, the rope part to kpe (vc) and the nope part to ckv (kc);
// GQA/MHA, head h of the key cache, rope dims first. Left unset: a paged token not cached.
template <typename x_t>
ROPE_HD void key_destination(const QuantArgs<x_t>& a, const QuantTokenRows& t, uint8_t* out,
                             const QuantRows& rows, int64_t tok, int64_t h, QuantRow<x_t>& w) {
  const QuantGeometry& g = a.g;
  if (!g.paged) {
    w.dst = out + tok * rows.tok + h * rows.head;
    w.d_last = rows.last;
  } else if (t.to_cache && g.mla) {
    w.dst = w.rope ? a.vc + t.vc_row : a.kc + t.kc_row;
    w.d_last = w.rope ? g.vc.last : g.kc.last;
  } else if (t.to_cache) {
    w.dst = a.kc + t.kc_row + h * g.kc.head + (w.rope ? 0 : 2 * g.half * g.kc.last);
    w.d_last = g.kc.last;
  }
}

template <typename x_t>
ROPE_HD QuantRow<x_t> quant_row(const QuantArgs<x_t>& a, const QuantTokenRows& t, int64_t tok,
                                int64_t r) {
  const QuantGeometry& g = a.g;
  const int64_t rope_dim = 2 * g.half, hq = g.q_heads, hk = g.kv_heads;
  QuantRow<x_t> w;
  if (r < hq) {  // query rope
    w = {a.q_rope + tok * g.q_rope.tok + r * g.q_rope.head, g.q_rope.last,
         a.q_rope_out + tok * g.q_rope_out.tok + r * g.q_rope_out.head, g.q_rope_out.last,
         rope_dim, a.rope_chunks, true, g.scale_q};
  } else if (r < hq + hk) {  // key rope
    const int64_t h = r - hq;
    w = {a.k_rope + tok * g.k_rope.tok + h * g.k_rope.head, g.k_rope.last, nullptr, 1, rope_dim,
         a.rope_chunks, true, g.scale_kv};
    key_destination(a, t, a.k_rope_out, g.k_rope_out, tok, h, w);
  } else if (r < 2 * hq + hk) {  // query nope
    const int64_t h = r - hq - hk;
    w = {a.q_nope + tok * g.q_nope.tok + h * g.q_nope.head, g.q_nope.last,
         a.q_nope_out + tok * g.q_nope_out.tok + h * g.q_nope_out.head, g.q_nope_out.last,
         g.nope, a.nope_chunks, false, g.scale_q};
  } else if (r < 2 * (hq + hk)) {  // key nope
    const int64_t h = r - 2 * hq - hk;
    w = {a.k_nope + tok * g.k_nope.tok + h * g.k_nope.head, g.k_nope.last, nullptr, 1, g.nope,
         a.nope_chunks, false, g.scale_kv};
    key_destination(a, t, a.k_nope_out, g.k_nope_out, tok, h, w);
  } else if (t.to_cache) {  // value (paged GQA/MHA)
    const int64_t h = r - 2 * (hq + hk);
    w = {a.v + tok * g.v.tok + h * g.v.head, g.v.last, a.vc + t.vc_row + h * g.vc.head, g.vc.last,
         rope_dim + g.nope, a.v_chunks, false, g.scale_kv};
  }
  return w;
}

// Rows [r0, rows) step rs, chunks [c0, chunks) step cs of each, of token tok. Rows outer, chunks
// inner: one thread (a CPU core) walks a row front to back, which the hardware prefetchers follow.
template <typename x_t>
ROPE_HD void quant_token(const QuantArgs<x_t>& a, int64_t tok, int64_t c0, int64_t cs, int64_t r0,
                         int64_t rs) {
  const QuantGeometry& g = a.g;
  const QuantTokenRows t = quant_token_rows(a, tok);
  if (!t.ok) return;
  const int64_t rows = quant_rows<x_t>(g);
  for (int64_t r = r0; r < rows; r += rs) {
    const QuantRow<x_t> w = quant_row(a, t, tok, r);
    if (w.dst == nullptr) continue;
    for (int64_t c = c0; c < w.chunks; c += cs) {
      if (w.rope) {
        quant_rope_chunk(w.src, w.s_last, w.dst, w.d_last, g.half, g.interleaved, c, t.cos,
                         t.sin, g.cos_col, w.scale, g.fmt, a.vec);
      } else {
        quant_copy_chunk(w.src, w.s_last, w.dst, w.d_last, w.n, c, w.scale, g.fmt, a.vec);
      }
    }
  }
}

// One CUDA thread: x over chunks, y over rows, z over tokens within a block; the grid strides
// over tokens.
template <typename x_t>
ROPE_HD void quant_thread(const QuantArgs<x_t>& a, const ThreadPos& tp) {
  const int64_t step = static_cast<int64_t>(tp.grid_dim.x) * tp.block_dim.z;
  for (int64_t tok = static_cast<int64_t>(tp.block.x) * tp.block_dim.z + tp.thread.z;
       tok < a.g.tokens; tok += step) {
    quant_token(a, tok, tp.thread.x, tp.block_dim.x, tp.thread.y, tp.block_dim.y);
  }
}

}  // namespace rope::gpu
