// The ops' call path without Python.
//
// torch's in-place bookkeeping (version counters; leaf, view and inference-tensor errors) and
// autograd through an in-place op sit at the ADInplaceOrView and Autograd dispatch keys. The
// stable ABI offers no version-counter or redispatch entry point, so these used to be Python
// kernels, which cost more than the decode-sized kernel itself (and the functional ops' autograd
// kernel, from torch.library.register_autograd, is Python as well). ops/router.cpp now serves
// these keys in C++ for plain tensors:
//   - grad mode off (no_grad, inference_mode): each written tensor goes through aten::set_(t, t)
//     (no data or metadata change; torch's own in-place bookkeeping: the version counter moves,
//     an inference tensor outside inference mode is refused), then the kernel runs;
//   - grad mode on: the call goes to `_grad_<op>`, whose Autograd kernel is Python
//     (rope_ext/_registrations.py).
// The functional ops write nothing: only their Autograd key is routed.
// Tensor subclasses and Python dispatch modes (DTensor, FakeTensor, torch.compile's tracing)
// never reach the router: their calls carry the PythonTLSSnapshot key, which sits above
// Autograd and where Python takes the whole call.
//
// Each routed op has two twins with its schema: `_impl_<op>` (the device kernels alone, used
// for non-CPU tensors) and `_grad_<op>` (the autograd path). docs/architecture.md.
#pragma once

#include <cstdint>
#include <string>

#include <torch/csrc/stable/library.h>

namespace rope {

using BoxedKernel = void (*)(StableIValue*, uint64_t, uint64_t);

// A written argument: its index in the schema, and whether it is `Tensor?`.
struct Written {
  int8_t index;
  bool optional;
};

struct Route {
  const char* name;      // as the dispatcher spells it after "rope::", overload included
  int n_written;
  Written written[5];
};

enum RouteId : int {
  kApply,
  kQkNormRope,
  kApplyBackward,
  kApplyPositions,
  kApplyOut,
  kApplyInplace,
  kMropeInplace,
  kApplyAndCache,
  kQkNormRopeInplace,
  kQkvNormRopeInplace,
  kQuantizeFp8,
  kQuantizeFp8Paged,
  kQkNormRopeAndCache,
  kNumRoutes,
  kNoRoute = kNumRoutes  // an op without the C++ call path (rope_ext/schemas.def)
};

// The kernel's device is the first argument's (a Tensor in every op).
inline constexpr Route kRoutes[kNumRoutes] = {
    {"apply", 0, {}},
    {"qk_norm_rope", 0, {}},
    {"apply_backward", 0, {}},
    {"apply_positions", 0, {}},
    {"apply.out", 1, {{4, false}}},
    {"apply_", 2, {{0, false}, {1, true}}},
    {"mrope_", 2, {{0, false}, {1, true}}},
    {"apply_and_cache_", 4, {{0, false}, {1, false}, {5, false}, {6, false}}},
    {"qk_norm_rope_", 2, {{0, false}, {1, false}}},
    {"qkv_norm_rope_", 1, {{0, false}}},
    {"quantize_fp8", 4, {{6, false}, {7, false}, {8, false}, {9, false}}},
    {"quantize_fp8_append_paged_kv_cache", 4, {{7, false}, {8, false}, {9, false}, {10, false}}},
    {"qk_norm_rope_and_cache_", 5, {{0, false}, {1, false}, {2, false}, {7, false}, {8, false}}},
};

// "apply.out" -> "<prefix>apply.out"
inline std::string twin_name(const char* prefix, RouteId r) {
  return std::string(prefix) + kRoutes[r].name;
}

// The CPU kernels, as the router calls them for CPU tensors (set by the CPU registrations).
BoxedKernel& routed_cpu_kernel(RouteId r);

// Registers `fn` for op r and its kernel-only twin.
inline void impl_routed(torch::stable::detail::StableLibrary& m, RouteId r, BoxedKernel fn) {
  m.impl(kRoutes[r].name, fn);
  m.impl(twin_name("_impl_", r).c_str(), fn);
}

// The same for a CPU kernel, which the router also calls directly.
inline void impl_routed_cpu(torch::stable::detail::StableLibrary& m, RouteId r, BoxedKernel fn) {
  impl_routed(m, r, fn);
  routed_cpu_kernel(r) = fn;
}

}  // namespace rope
