// rope.shift_kv_cache_ (K-shift, kv_shift/geometry.h) in the CPU kernel family: each listed
// slot's key rows re-rotated in place by the unit rotation of table row |delta|. Included by
// kernels.h, so it is compiled once per ISA with the rotation kernels it reuses (rotate_heads):
// a K-shift of a long context moves as many bytes as a copy of the cache rows, and the row loop
// is the same vector code as rope.apply_'s. Float8 rows are decoded into a float block, rotated
// there and encoded, both with branch-free conversions (the same bits as fp8_to_float and
// float_to_fp8).

namespace rope {
namespace {

// The unit rotation of table row |k| (sin negated for k < 0) for pairs [b0, b0 + n), laid out
// as the row kernels read it (kTableLayout). A row of the accumulator's type at unit stride (the
// common table) is read where it lies, straight into c, s where the layout keeps pairs in place
// (plain; even/odd, rearranged there after): with a delta per slot, a copy of the row first and
// a pass laying it out took about a tenth of a bfloat16 slot's time. Other tables are converted
// into a block first (one loop per table type; the division loop is shared).
template <class Ops, TableLayout kLayout>
void unit_rotation_block(const ShiftJob& job, int64_t k, int64_t b0, int64_t n,
                         typename Ops::acc* c, typename Ops::acc* s) {
  using acc = typename Ops::acc;
  const ShiftDesc& d = *job.d;
  const int64_t row = k < 0 ? -k : k;  // |k| < max_position: checked
  const bool negative = k < 0;
  alignas(64) acc cb[kBlockPairs];
  alignas(64) acc sb[kBlockPairs];
  if (job.table_dt == (std::is_same_v<acc, double> ? kF64 : kF32) && d.cos_col == 1) {
    constexpr bool kDirect = kLayout != TableLayout::kPairDup;
    acc* const uc = kDirect ? c : cb;
    acc* const us = kDirect ? s : sb;
    const acc* t = static_cast<const acc*>(job.table) + row * d.cos_row + b0;
    for (int64_t j = 0; j < n; ++j) unit_rotation(t[j], t[d.half + j], negative, uc[j], us[j]);
    if constexpr (kDirect) {
      if constexpr (kLayout == TableLayout::kEvenOdd) even_odd_blocks_in_place<Ops>(c, s, n);
      return;
    }
  } else {
    with_dt_type(job.table_dt, [&](auto elem) {
      using T = decltype(elem);
      const T* t = static_cast<const T*>(job.table) + row * d.cos_row;
      for (int64_t j = 0; j < n; ++j) {
        cb[j] = to_acc<Ops>(t[(b0 + j) * d.cos_col]);
        sb[j] = to_acc<Ops>(t[(d.half + b0 + j) * d.cos_col]);
      }
    });
    // Separate from the loads (a switch on the table dtype), so that it vectorizes once.
    for (int64_t j = 0; j < n; ++j) unit_rotation(cb[j], sb[j], negative, cb[j], sb[j]);
  }
  lay_out_table<Ops, kLayout>(cb, sb, n, c, s);
}

// A float8 cache's conversions, built once per task (the encoder's choice costs a division).
struct Fp8Cache {
  Fp8Decoder decode;
  Fp8Encoder encode;
};

// A float8 row's pairs [b0, b0 + n): decoded and dequantized (code * scale) into a float block,
// rotated, encoded as saturated value / scale.
template <bool kInterleaved>
void shift_fp8_row(uint8_t* row, int64_t last, int64_t half, int64_t b0, int64_t n,
                   const float* c, const float* s, const Fp8Cache& conv) {
  rotate_to_codes<kInterleaved>(row, last, row, last, half, b0, n, c, s, conv.decode,
                                conv.encode);
}

// A float8 slot's `heads` rows of 2 * half codes, each rotated whole, that follow each other:
// decoded in one loop, rotated row by row, encoded in one loop (the per-row loops' setup is most
// of the work of a 128-code row).
constexpr int64_t kSlotElements = 4096;

template <bool kInterleaved>
void shift_fp8_slot(uint8_t* slot, int64_t heads, int64_t half, const float* c, const float* s,
                    const Fp8Cache& conv) {
  alignas(64) float buf[kSlotElements];
  const int64_t row = 2 * half, total = heads * row;
  floats_of(slot, int64_t{1}, total, buf, conv.decode);
  for (int64_t h = 0; h < heads; ++h) {
    rotate_block<F32Ops, kInterleaved, false>(buf + h * row, buf + h * row, half, half, c, s);
  }
  codes_of(buf, int64_t{1}, total, slot, int64_t{1}, conv.encode);
}

// The listed slots are scattered over the cache, and their deltas over the table, so the
// hardware prefetchers see each row only once it is being rotated: the cache rows (for writing)
// and the table row of the entry kPrefetchAhead places ahead are requested while this one is
// rotated. Unit-stride rows only (the common cache layout; a table row's columns likewise).
constexpr int64_t kPrefetchAhead = 4;

template <typename x_t>
ROPE_INLINE void prefetch_slot_rows(const ShiftJob& job, int64_t i, int64_t e) {
  const ShiftDesc& d = *job.d;
  if (i >= e || d.kc.last != 1) return;
  const int64_t slot = read_position(job.slots, d.slots64, i * d.slot_stride);
  if (slot < 0) return;
  if (d.cos_col == 1) {
    const int64_t k = read_position(job.delta, d.delta64, i * d.delta_stride);
    const int64_t es = job.table_dt == kF64 ? 8 : job.table_dt == kF32 ? 4 : 2;
    const char* t = static_cast<const char*>(job.table) + (k < 0 ? -k : k) * d.cos_row * es;
    for (int64_t o = 0; o < 2 * d.half * es; o += 64) __builtin_prefetch(t + o, 0);
  }
  const char* base = reinterpret_cast<const char*>(static_cast<const x_t*>(job.cache) +
                                                   d.kc.slot_row(slot, d.block_size));
  const int64_t row_bytes = 2 * d.half * static_cast<int64_t>(sizeof(x_t));
  for (int64_t h = 0; h < d.heads; ++h) {
    const char* row = base + h * d.kc.head * static_cast<int64_t>(sizeof(x_t));
    for (int64_t o = 0; o < row_bytes; o += 64) __builtin_prefetch(row + o, 1);
  }
}

// Entries [b, e) of the slot list. x_t: the cache's element type, or (kFp8) uint8_t codes of
// the format d.format.
template <typename x_t, bool kFp8, bool kInterleaved>
void shift_slots_impl(const ShiftJob& job, int64_t b, int64_t e) {
  using Ops = std::conditional_t<kFp8, F32Ops, OpsFor<x_t>>;
  using acc = typename Ops::acc;
  // Float8 rows are rotated as float blocks.
  constexpr TableLayout kLayout =
      kTableLayout<Ops, std::conditional_t<kFp8, float, x_t>, kInterleaved>;
  const ShiftDesc& d = *job.d;
  const CacheStrides& kc = d.kc;
  const TargetDesc tg{d.heads, kc.head, kc.head, kc.last, kc.last};
  alignas(64) acc c[2 * kBlockPairs];
  alignas(64) acc s[2 * kBlockPairs];
  const bool one_block = d.half <= kBlockPairs;
  // A float8 slot whose heads are rotated whole and follow each other: one decode, one encode.
  const bool whole_slot = kFp8 && one_block && kc.last == 1 && kc.head == 2 * d.half &&
                          d.heads * kc.head <= kSlotElements;
  Fp8Cache conv{};
  if constexpr (kFp8) {
    conv = {cache_decoder(job.scale, d.format), cache_encoder(job.scale, d.format)};
  }
  int64_t cached = 0;
  bool have = false;
  x_t* const cache = static_cast<x_t*>(job.cache);
  for (int64_t i = b; i < std::min(e, b + kPrefetchAhead); ++i) prefetch_slot_rows<x_t>(job, i, e);
  for (int64_t i = b; i < e; ++i) {
    prefetch_slot_rows<x_t>(job, i + kPrefetchAhead, e);
    const int64_t slot = read_position(job.slots, d.slots64, i * d.slot_stride);
    if (slot < 0) continue;  // padding
    const int64_t k = read_position(job.delta, d.delta64, i * d.delta_stride);
    x_t* const base = cache + kc.slot_row(slot, d.block_size);
    for (int64_t b0 = 0; b0 < d.half; b0 += kBlockPairs) {
      const int64_t n = std::min(kBlockPairs, d.half - b0);
      // The rotation is reused by the next slots while their delta is the same (one delta for
      // every slot: computed once per task).
      if (!(one_block && have && k == cached)) {
        unit_rotation_block<Ops, kLayout>(job, k, b0, n, c, s);
        cached = k;
        have = true;
      }
      if constexpr (kFp8) {
        if (whole_slot) {
          shift_fp8_slot<kInterleaved>(base, d.heads, d.half, c, s, conv);
          continue;
        }
        for (int64_t h = 0; h < d.heads; ++h) {
          shift_fp8_row<kInterleaved>(base + h * kc.head, kc.last, d.half, b0, n, c, s, conv);
        }
      } else {
        rotate_heads<Ops, kInterleaved>(tg, base, base, d.half, b0, n, c, s, false);
      }
    }
  }
}

template <typename x_t, bool kFp8>
void shift_slots(const ShiftJob& job, int64_t b, int64_t e) {
  job.d->interleaved ? shift_slots_impl<x_t, kFp8, true>(job, b, e)
                     : shift_slots_impl<x_t, kFp8, false>(job, b, e);
}

}  // namespace
}  // namespace rope
