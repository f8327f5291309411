// The CUDA kernels as the host code launches them: one launcher per kernel, declared here for the
// ops' host code (cuda_ops.cpp and the *_host.h it includes: checks, tensors, dispatch, compiled
// by the C++ compiler) and defined
// with the kernels in the kernel files (*.cu), which instantiate one per dtype (and layout) the
// host dispatches to. Plain C++ without torch: the kernel files then compile without torch's
// headers, which nvcc would otherwise read once per compilation step (several per file).
//
// A launcher runs its kernel over the plan's grid and blocks on `stream` (a cudaStream_t) and
// returns the launch's error message (cudaGetErrorString), or nullptr when it launched. A dtype
// the host code dispatches to without an instantiation in the kernel file is an undefined symbol
// of the library, an error when it loads (tests/test_cuda_build.py loads it).
#pragma once

#include "launch_plan.h"
#include "../qk_norm/cuda/thread.h"
#include "rope_cuda_thread.h"
#include "../quant/cuda/thread.h"
#include "../kv_shift/cuda/thread.h"

namespace rope::gpu {

// rope_cuda.cu: every rotation op; rope.apply_and_cache_ (the slot set, then the cache write).
template <typename x_t, typename tab_t, bool kInterleaved>
const char* launch_rotate(const LaunchPlan& p, const RotateArgs<x_t, tab_t>& a, void* stream);
template <typename x_t, typename tab_t>
const char* launch_cache(const LaunchPlan& p, const CacheArgs<x_t, tab_t>& a, void* stream);
const char* launch_slot_set(const LaunchPlan& p, const SlotSetArgs& a, void* stream);

// qk_norm/cuda/qk_norm_cuda.cu: the fused QK-RMSNorm + RoPE ops.
template <typename x_t, typename tab_t, bool kInterleaved>
const char* launch_norm_rope(const LaunchPlan& p, const NormRopeArgs<x_t, tab_t>& a,
                             void* stream);

// quant/cuda/quant_cuda.cu: the RoPE + FP8 quantization ops.
template <typename x_t>
const char* launch_quant(const LaunchPlan& p, const QuantArgs<x_t>& a, void* stream);
const char* launch_paged_slot_set(const LaunchPlan& p, const PagedSlotSetArgs& a, void* stream);

// kv_shift/cuda/shift_cuda.cu: rope.shift_kv_cache_.
template <typename x_t, typename acc_t>
const char* launch_shift(const LaunchPlan& p, const ShiftArgs<x_t, acc_t>& a, void* stream);

}  // namespace rope::gpu
