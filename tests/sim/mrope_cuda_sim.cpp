// Runs every thread of the rope.mrope_ CUDA grid on the CPU (csrc/ops/cuda/mrope_cuda_thread.h)
// and compares with a direct loop. Built with -fsanitize=address by tests/test_mrope_cuda_sim.py:
// operands are exactly-sized heap buffers, so any out-of-bounds access of the index math aborts.
// Prints "ok <cases>" on success.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "../../csrc/ops/cuda/mrope_cuda_thread.h"

using namespace rope;
using namespace rope::mrope_gpu;

static std::mt19937_64 rng(12345);

static int64_t rnd(int64_t lo, int64_t hi) {  // [lo, hi]
  return lo + static_cast<int64_t>(rng() % static_cast<uint64_t>(hi - lo + 1));
}

struct Case {
  int64_t B, S, Hq, Hk, D, R, max_pos;
  int64_t sec[3];
  bool interleaved, fused, pos_t_major, pos64, with_bad;
};

template <typename x_t>
static int run_case(const Case& c) {
  using tab_t = opmath_t<x_t>;
  using acc_t = opmath_t<x_t>;
  const int64_t T = c.B * c.S, half = c.R / 2;
  const int64_t row = c.fused ? (c.Hq + 2 * c.Hk) * c.D : 0;  // fused qkv row length
  std::vector<x_t> qbuf, kbuf;
  int64_t q_tok, k_tok, k_base = 0;
  if (c.fused) {
    qbuf.resize(T * row);
    q_tok = k_tok = row;
    k_base = c.Hq * c.D;
  } else {
    qbuf.resize(T * c.Hq * c.D);
    kbuf.resize(T * c.Hk * c.D);
    q_tok = c.Hq * c.D;
    k_tok = c.Hk * c.D;
  }
  std::normal_distribution<double> nd;
  for (auto& v : qbuf) v = static_cast<x_t>(nd(rng));
  for (auto& v : kbuf) v = static_cast<x_t>(nd(rng));
  x_t* q = qbuf.data();
  x_t* k = c.Hk == 0 ? nullptr : (c.fused ? qbuf.data() + k_base : kbuf.data());

  // positions (3, B, S), either component-major contiguous or the transpose of a (B, S, 3) buffer.
  std::vector<int64_t> p64(3 * T);
  std::vector<int32_t> p32(3 * T);
  const int64_t comp_stride = c.pos_t_major ? 1 : T, tok_stride = c.pos_t_major ? 3 : 1;
  std::vector<int64_t> pos_val(3 * T);  // [comp][token]
  for (int64_t j = 0; j < 3; ++j) {
    for (int64_t t = 0; t < T; ++t) pos_val[j * T + t] = rnd(0, c.max_pos - 1);
  }
  int64_t bad_tok = -1;
  if (c.with_bad && T > 0) {
    bad_tok = rnd(0, T - 1);
    pos_val[rnd(0, 2) * T + bad_tok] = rnd(0, 1) ? c.max_pos : -1;
  }
  for (int64_t j = 0; j < 3; ++j) {
    for (int64_t t = 0; t < T; ++t) {
      p64[j * comp_stride + t * tok_stride] = pos_val[j * T + t];
      p32[j * comp_stride + t * tok_stride] = static_cast<int32_t>(pos_val[j * T + t]);
    }
  }
  // cache (max_pos, R) with arbitrary values: the test is about which element goes where.
  std::vector<tab_t> cache(c.max_pos * c.R);
  for (auto& v : cache) v = static_cast<tab_t>(nd(rng));

  MropeGeometry mg;
  InplaceGeometry& g = mg.inplace;
  g.tokens = T;
  g.head_dim = c.D;
  g.half = half;
  g.q_heads = c.Hq;
  g.k_heads = c.Hk;
  g.q_head_stride = c.D;
  g.k_head_stride = c.D;
  g.q_last = g.k_last = 1;
  g.cache_row_stride = c.R;
  g.cache_col_stride = 1;
  g.max_position = c.max_pos;
  g.lead.ndim = 2;  // (B, S), not merged: exercises the multi-dim offsets
  g.lead.sizes[0] = c.B;
  g.lead.sizes[1] = c.S;
  g.lead.strides[0][0] = c.S * q_tok;
  g.lead.strides[0][1] = q_tok;
  g.lead.strides[1][0] = c.S * k_tok;
  g.lead.strides[1][1] = k_tok;
  g.lead.strides[2][0] = c.S * tok_stride;
  g.lead.strides[2][1] = tok_stride;
  mg.pos_component_stride = comp_stride;
  int64_t end = 0;
  for (int j = 0; j < 3; ++j) mg.section_end[j] = (end += c.sec[j]);

  // Expected: a direct loop, from the unmodified buffers.
  std::vector<x_t> q_want = qbuf, k_want = kbuf;
  x_t* kw = c.Hk == 0 ? nullptr : (c.fused ? q_want.data() + k_base : k_want.data());
  for (int64_t t = 0; t < T; ++t) {
    if (t == bad_tok) continue;
    for (int64_t i = 0; i < half; ++i) {
      const int comp = i < c.sec[0] ? 0 : (i < c.sec[0] + c.sec[1] ? 1 : 2);
      const int64_t p = pos_val[comp * T + t];
      const acc_t cs = cache[p * c.R + i], sn = cache[p * c.R + half + i];
      const int64_t e0 = c.interleaved ? 2 * i : i, e1 = c.interleaved ? 2 * i + 1 : i + half;
      for (int64_t h = 0; h < c.Hq + c.Hk; ++h) {
        x_t* r = h < c.Hq ? q_want.data() + t * q_tok + h * c.D : kw + t * k_tok + (h - c.Hq) * c.D;
        const acc_t a = r[e0], b = r[e1];
        r[e0] = static_cast<x_t>(a * cs - b * sn);
        r[e1] = static_cast<x_t>(b * cs + a * sn);
      }
    }
  }

  const MropeArgs<x_t> args{q, k, c.pos64 ? static_cast<const void*>(p64.data()) : p32.data(), c.pos64,
                            cache.data(), mg};
  const MropeLaunch l = plan_mrope(mg, /*max_blocks=*/rnd(1, 4));  // few blocks: grid striding
  for (unsigned bx = 0; bx < l.grid_x; ++bx)
    for (unsigned tz = 0; tz < l.block_z; ++tz)
      for (unsigned ty = 0; ty < l.block_y; ++ty)
        for (unsigned tx = 0; tx < l.block_x; ++tx) {
          const MropeThread th{static_cast<int64_t>(bx) * l.block_z + tz,
                               static_cast<int64_t>(l.grid_x) * l.block_z, tx, l.block_x, ty, l.block_y};
          if (c.interleaved) {
            mrope_thread<x_t, true>(args, th);
          } else {
            mrope_thread<x_t, false>(args, th);
          }
        }
  const int64_t threads = static_cast<int64_t>(l.block_x) * l.block_y * l.block_z;
  if (threads > 256 || threads < 1) {
    std::printf("bad block of %lld threads\n", static_cast<long long>(threads));
    return 1;
  }
  for (size_t j = 0; j < qbuf.size(); ++j) {
    if (qbuf[j] != q_want[j]) {
      std::printf("query mismatch at %zu: %g vs %g\n", j, double(qbuf[j]), double(q_want[j]));
      return 1;
    }
  }
  for (size_t j = 0; j < kbuf.size(); ++j) {
    if (kbuf[j] != k_want[j]) {
      std::printf("key mismatch at %zu\n", j);
      return 1;
    }
  }
  return 0;
}

int main(int argc, char** argv) {
  const int n = argc > 1 ? std::atoi(argv[1]) : 300;
  for (int it = 0; it < n; ++it) {
    Case c;
    c.B = rnd(1, 3);
    c.S = rnd(0, 9);
    c.Hq = rnd(1, 5);
    c.Hk = rnd(0, 3);
    c.R = 2 * rnd(1, 40);
    c.D = c.R + rnd(0, 5);  // pass-through dims, odd head_dim included
    c.max_pos = rnd(1, 50);
    const int64_t half = c.R / 2;
    c.sec[0] = rnd(0, half);
    c.sec[1] = rnd(0, half - c.sec[0]);
    c.sec[2] = half - c.sec[0] - c.sec[1];
    c.interleaved = rnd(0, 1);
    c.fused = rnd(0, 1);
    c.pos_t_major = rnd(0, 1);
    c.pos64 = rnd(0, 1);
    c.with_bad = rnd(0, 3) == 0;
    const int rc = rnd(0, 1) ? run_case<float>(c) : run_case<double>(c);
    if (rc) {
      std::printf("case %d failed: B=%lld S=%lld Hq=%lld Hk=%lld D=%lld R=%lld il=%d fused=%d\n", it,
                  (long long)c.B, (long long)c.S, (long long)c.Hq, (long long)c.Hk, (long long)c.D,
                  (long long)c.R, c.interleaved, c.fused);
      return 1;
    }
  }
  std::printf("ok %d\n", n);
  return 0;
}
