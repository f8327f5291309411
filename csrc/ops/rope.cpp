// Defines every op from its schema in rope_ext/schemas.def (the one list, which Python reads
// too). Kernels are registered per device (cpu/rope_cpu.cpp, cuda/cuda_ops.cpp); fake kernels,
// autograd and the in-place bookkeeping where Python serves it are registered from Python
// (rope_ext/_registrations.py). docs/architecture.md walks through them.
#include <string>

#include <torch/csrc/stable/library.h>

#include "routes.h"

namespace {

// Defines op `name`; a routed op (routes.h) also gets its twins `_impl_<op>` and `_grad_<op>`
// with the same signature.
void def_op(torch::stable::detail::StableLibrary& m, const char* name, rope::RouteId route,
            const char* signature) {
  m.def((std::string(name) + signature).c_str());
  if (route != rope::kNoRoute) {
    for (const char* prefix : {"_impl_", "_grad_"}) {
      m.def((rope::twin_name(prefix, route) + signature).c_str());
    }
  }
}

}  // namespace

STABLE_TORCH_LIBRARY(rope, m) {
#define ROPE_OP(name, route, signature) def_op(m, name, rope::route, signature);
#include "../../rope_ext/schemas.def"
#undef ROPE_OP
}
