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
// The largest block a plan chooses: bx * by <= 2 * kThreadsPerBlock (the kernels'
// __launch_bounds__).
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
  bool idx32 = false;
  int64_t rot_chunks = 0, tail_chunks = 0;
};

}  // namespace rope::gpu
