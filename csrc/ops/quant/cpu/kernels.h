// rope.quantize_fp8 and rope.quantize_fp8_append_paged_kv_cache (RoPE + FP8 quantization,
// quant/geometry.h) in the CPU kernel family: included by kernels.h, so compiled once per
// ISA. Which rows a token has and where each goes (outputs, paged caches, MLA) is the CUDA
// kernels' own code (quant/cuda/thread.h: quant_token_rows, quant_row), so the devices
// cannot disagree on it; here each row is converted with the family's vector loops
// (fp8_rows.h): rotary rows rotated in float blocks, then every row scaled and encoded.

namespace rope {
namespace {

template <typename x_t, bool kInterleaved>
void quant_tokens_impl(const gpu::QuantArgs<x_t>& a, int64_t b, int64_t e) {
  const QuantGeometry& g = a.g;
  constexpr TableLayout kLayout = kTableLayout<F32Ops, float, kInterleaved>;
  alignas(64) float cb[kBlockPairs];
  alignas(64) float sb[kBlockPairs];
  alignas(64) float c[2 * kBlockPairs];
  alignas(64) float s[2 * kBlockPairs];
  // The token's table row for pairs [b0, b0 + n).
  auto table = [&](const gpu::QuantTokenRows& t, int64_t b0, int64_t n) {
    for (int64_t j = 0; j < n; ++j) {
      cb[j] = t.cos[(b0 + j) * g.cos_col];
      sb[j] = t.sin[(b0 + j) * g.cos_col];
    }
    lay_out_table<F32Ops, kLayout>(cb, sb, n, c, s);
  };
  auto to_float = [](x_t v) { return static_cast<float>(to_acc<F32Ops>(v)); };
  const bool one_block = g.half <= kBlockPairs;
  const int64_t rows = gpu::quant_rows<x_t>(g);
  for (int64_t tok = b; tok < e; ++tok) {
    const gpu::QuantTokenRows t = gpu::quant_token_rows(a, tok);
    if (!t.ok) continue;  // not reached: the host checks the positions first
    if (one_block) table(t, 0, g.half);
    for (int64_t r = 0; r < rows; ++r) {
      const gpu::QuantRow<x_t> w = gpu::quant_row(a, t, tok, r);
      if (w.dst == nullptr || w.n == 0) continue;
      const Fp8Encoder code_of{w.scale, false, g.fmt};
      if (!w.rope) {
        codes_of(w.src, w.s_last, w.n, w.dst, w.d_last, code_of);
        continue;
      }
      for (int64_t b0 = 0; b0 < g.half; b0 += kBlockPairs) {
        const int64_t n = std::min(kBlockPairs, g.half - b0);
        if (!one_block) table(t, b0, n);
        rotate_to_codes<kInterleaved>(w.src, w.s_last, w.dst, w.d_last, g.half, b0, n, c, s,
                                      to_float, code_of);
      }
    }
  }
}

// args: the call's gpu::QuantArgs, whose element type (float, Half, BFloat16) has the layout of
// x_t (float, HalfBits, BF16Bits): only its five input pointers name it.
template <typename x_t>
void quant_tokens(const void* args, int64_t b, int64_t e) {
  const auto& a = *static_cast<const gpu::QuantArgs<x_t>*>(args);
  a.g.interleaved ? quant_tokens_impl<x_t, true>(a, b, e) : quant_tokens_impl<x_t, false>(a, b, e);
}

}  // namespace
}  // namespace rope
