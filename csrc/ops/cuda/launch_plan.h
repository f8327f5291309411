// The launch geometry every CUDA kernel is planned and launched with: the block sizes its
// __launch_bounds__ name and the plan the host code makes (grid, block, vector path). Plain C++
// without torch, for the kernel files (*.cu), the host code (rope_cuda_host.h and the others)
// and the simulator.
#pragma once

#include <cstdint>

#include "rope_cuda_thread.h"

namespace rope::gpu {

// At most this many blocks; beyond it blocks stride (a grid this size already fills any GPU).
constexpr int64_t kMaxBlocks = int64_t{1} << 20;
constexpr int64_t kThreadsPerBlock = 256;
// The threads of one token's rows in a block (plan_block: bx * by). Fewer threads than rows, so
// a thread rotates several heads with one load of its chunk's cos and sin and one reading of
// the token's position: on an H200 (bench/results/gpu-profile-h200.md) 128 took a prefill
// rotation (8192 x 32 x 128) from 90 to 74 us in bfloat16 and from 206 to 96 us in float32,
// and rope.apply_and_cache_ from 221 to 109 us, against 256 or 512.
constexpr int64_t kRowThreads = 128;
// The kernels' __launch_bounds__: no block is larger (a plan's blocks have at most
// kThreadsPerBlock threads, or kRowThreads times one token), and a thread may use up to 128
// registers.
constexpr int kMaxBlockThreads = 512;
// CUDA's limit on blockDim.z (x and y may reach 1024): a launch past it fails.
constexpr int64_t kMaxBlockZ = 64;
// The block of the fused QK-RMSNorm + RoPE kernel: one thread per row.
constexpr int64_t kNormThreadsPerBlock = 128;
// ... and the blocks per SM its __launch_bounds__ asks for: 170 registers per thread at most
// (ptxas's own budget for a bare thread bound is tighter, and it spilled the norm forms).
constexpr int kNormMinBlocksPerSm = 3;

struct LaunchPlan {
  Idx3 grid, block;
  bool vec = false;
  bool tvec = false;  // whole-vector table loads (load_tables)
  bool idx32 = false;
  int64_t rot_chunks = 0, tail_chunks = 0;
};

}  // namespace rope::gpu
