// Defines every op from its schema in rope_ext/schemas.def (the one list, which Python reads
// too). Kernels are registered per device (cpu/rope_cpu.cpp, cuda/cuda_ops.cpp); fake kernels,
// autograd and the in-place bookkeeping where Python serves it are registered from Python
// (rope_ext/_registrations.py). docs/architecture.md walks through them.
#include <string>

#include <torch/csrc/stable/library.h>

#include "routes.h"

// Every op; a routed one (routes.h) also gets its twins `_impl_<op>` and `_grad_<op>` with the
// same signature.
STABLE_TORCH_LIBRARY(rope, m) {
  for (const rope::OpSchema& op : rope::kOps) {
    m.def((std::string(op.name) + op.signature).c_str());
    for (const char* prefix : {"_impl_", "_grad_"}) {
      if (op.routed) m.def((std::string(prefix) + op.name + op.signature).c_str());
    }
  }
}
