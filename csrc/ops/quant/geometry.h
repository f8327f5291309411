// The plain-data description of a RoPE + FP8 quantization call (rope.quantize_fp8 and
// rope.quantize_fp8_append_paged_kv_cache), made by the checks (quant/checks.h) and read by
// the CPU kernel, the CUDA kernel and the simulator. No torch header: the CUDA kernel file
// includes it.
#pragma once

#include <cstdint>

#include "../../rope_math.h"

namespace rope {

// One operand of rows (tokens, heads, dim): element strides. A 2-D (MLA) key has head = 0.
struct QuantRows {
  int64_t tok = 0, head = 0, last = 1;
};

// A paged cache: element strides of (page, entry in the page, head, last dim).
struct QuantCache {
  int64_t page = 0, entry = 0, head = 0, last = 1;
};

// An int32/int64 vector: element stride and width.
struct QuantIndex {
  int64_t stride = 1;
  bool is64 = true;
};

struct QuantGeometry {
  int64_t tokens = 0, q_heads = 0, kv_heads = 0, half = 0, nope = 0;
  bool interleaved = false, mla = false, paged = false;
  Fp8Format fmt = Fp8Format::kE4M3FN;
  float scale_q = 1.0f, scale_kv = 1.0f;
  int64_t table_rows = 0, cos_row = 0, cos_col = 1;  // cos_sin_cache (float32)
  QuantIndex pos;
  // Inputs, and the outputs of rope.quantize_fp8 (the paged op writes only the query outputs).
  QuantRows q_rope, k_rope, q_nope, k_nope, v;
  QuantRows q_rope_out, k_rope_out, q_nope_out, k_nope_out;
  // Paged: GQA/MHA key/value caches (rope then nope in a key row); MLA: kc = ckv (nope), vc =
  // kpe (rope).
  QuantCache kc, vc;
  int64_t page_size = 1, max_pages = 0, batch = 0, num_indices = 0;
  QuantIndex kv_indices, kv_indptr, batch_indices, positions;
};

}  // namespace rope
