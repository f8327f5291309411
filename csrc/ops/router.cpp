// The Autograd and ADInplaceOrView kernels of the routed (in-place) ops: routes.h says why.
#include <optional>
#include <string>
#include <utility>

#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/macros.h>
#include <torch/csrc/stable/tensor.h>

#include "routes.h"

namespace rope {

BoxedKernel& routed_cpu_kernel(int op) {
  static BoxedKernel kernels[kNumOps] = {};
  return kernels[op];
}

namespace {

using torch::stable::detail::from;
using torch::stable::detail::to;

// The message of the error torch_call_dispatcher just reported, as the op itself raised it: no
// source location appended, nothing printed. An error raised by a Python kernel (the autograd
// path) arrives as "RuntimeError: <message>\n\nAt:\n<traceback>": the message alone is kept.
[[noreturn]] void rethrow_dispatch_error(const std::string& op) {
  const char* what = TORCH_DYNAMIC_VERSION_CALL_2_13_0(
      torch_exception_get_what_without_backtrace, torch::stable::detail::torch_shim_bc_const_char_ptr);
  std::string msg = what != nullptr ? std::string(what) : op + " failed";
  const std::string python_prefix = "RuntimeError: ";
  if (msg.compare(0, python_prefix.size(), python_prefix) == 0) {
    msg.erase(0, python_prefix.size());
    const auto traceback = msg.find("\n\nAt:\n");
    if (traceback != std::string::npos) msg.erase(traceback);
  }
  throw std::runtime_error(msg);
}

// Calls op `name` ("ns::name"), overload `overload` ("" for the default) on a boxed stack it
// consumes.
void call_op(const char* name, const char* overload, StableIValue* stack) {
  if (torch_call_dispatcher(name, overload, stack, TORCH_ABI_VERSION) != TORCH_SUCCESS) {
    rethrow_dispatch_error(*overload ? std::string(name) + "." + overload : std::string(name));
  }
}

// An op's name and overload ("rope::_impl_apply", "out"), as the dispatcher takes them.
struct OpName {
  std::string name, overload;
};

OpName twin_op(const char* prefix, int op) {
  const std::string full = "rope::" + twin_name(prefix, op);
  const auto dot = full.find('.');
  return {full.substr(0, dot), dot == std::string::npos ? "" : full.substr(dot + 1)};
}

// Calls op R's kernel-only ("_impl_") or autograd ("_grad_") twin: its name split once.
template <int R>
void call_twin(bool grad, StableIValue* stack) {
  static const OpName impl = twin_op("_impl_", R), with_grad = twin_op("_grad_", R);
  const OpName& twin = grad ? with_grad : impl;
  call_op(twin.name.c_str(), twin.overload.c_str(), stack);
}

AtenTensorHandle borrowed(const StableIValue* stack, const Written& w) {
  return tensor_at(stack, w.index, w.optional);
}

// A new reference to t, for a boxed call that consumes it.
torch::stable::Tensor new_reference(AtenTensorHandle t) {
  AtenTensorHandle handle = nullptr;
  STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_new_tensor_handle(t, &handle));
  return torch::stable::Tensor(handle);
}

// torch's in-place bookkeeping for a written tensor, through aten::set_(t, t): the version
// counter (shared with every view of its storage) moves, and an inference tensor outside
// inference mode is refused with torch's own error.
void bump_version(const torch::stable::Tensor& tensor) {
  StableIValue stack[2] = {from(tensor), from(tensor)};  // new references, consumed by the call
  call_op("aten::set_", "source_Tensor", stack);
  torch::stable::Tensor returned(to<AtenTensorHandle>(stack[0]));  // releases the alias
}

// Whether t was made in inference mode (aten::is_inference: the stable ABI has no getter).
bool is_inference(const torch::stable::Tensor& tensor) {
  StableIValue stack[1] = {from(tensor)};
  call_op("aten::is_inference", "", stack);
  return to<bool>(stack[0]);
}

bool on_cpu(AtenTensorHandle t) {
  int32_t type = 0;
  STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_get_device_type(t, &type));
  return type == aoti_torch_device_type_cpu();
}

// The kernel between torch's in-place bookkeeping. With grad mode off (the call path's case),
// inference tensors first (refused outside inference mode, with torch's error, before anything
// is written; they have no version counter to move), the others' versions after the kernel, as
// torch's own in-place ops move them: a call refused by torch's rule or by the kernel's checks
// writes nothing and moves no version. With grad mode on (the `_grad_` twin where no Python
// registered autograd: a C++-only deployment) every version moves first, so that torch's
// autograd rules (a leaf that requires grad, a view of one, ...), which only aten::set_ can
// check through the stable ABI, refuse the call before anything is written.
// The CPU kernel runs directly, any other device's (and a call with a ZeroTensor) through the
// kernel-only twin (both consume the stack: the written tensors are held apart).
template <int R>
void bump_and_run(StableIValue* stack, uint64_t num_args, uint64_t num_outputs) {
  constexpr const OpSchema& op = kOps[R];
  std::optional<torch::stable::Tensor> versioned[kMaxWritten];
  const BoxedKernel cpu = routed_cpu_kernel(R);
  bool direct = false;
  refuse_releasing(R, stack, [&] {
    check_tensors_given(R, stack);  // before the device of the first is read
    const bool rules_first = aoti_torch_grad_mode_is_enabled();
    for (int i = 0; i < op.n_written; ++i) {
      if (AtenTensorHandle t = borrowed(stack, op.written[i])) {
        torch::stable::Tensor held = new_reference(t);
        if (rules_first || is_inference(held)) {
          bump_version(held);  // torch's rules may refuse the call here
        } else {
          versioned[i] = std::move(held);
        }
      }
    }
    direct = cpu != nullptr && on_cpu(to<AtenTensorHandle>(stack[0])) &&
             tensors_have_memory(R, stack);
  });
  if (direct) {
    cpu(stack, num_args, num_outputs);
  } else {
    call_twin<R>(false, stack);
  }
  for (int i = 0; i < op.n_written; ++i) {
    if (versioned[i]) bump_version(*versioned[i]);
  }
}

// Autograd key: with grad mode off nothing is recorded, so the call is the in-place op itself;
// with grad mode on, the autograd path (Python, or bump_and_run where no Python registered it).
template <int R>
void autograd_router(StableIValue* stack, uint64_t num_args, uint64_t num_outputs) {
  refuse_releasing(R, stack, [&] { check_tensors_given(R, stack); });
  if (aoti_torch_grad_mode_is_enabled()) {
    call_twin<R>(true, stack);
  } else {
    bump_and_run<R>(stack, num_args, num_outputs);
  }
}

// Serves routed op R at the Autograd key (autograd_router) or, when it writes, at
// ADInplaceOrView (bump_and_run).
template <int R>
void register_one(torch::stable::detail::StableLibrary& m, bool autograd) {
  if constexpr (kOps[R].routed) {
    if (autograd) {
      m.impl(kOps[R].name, &autograd_router<R>);
    } else if (kOps[R].n_written > 0) {
      m.impl(kOps[R].name, &bump_and_run<R>);
    }
  }
}

template <int... R>
void register_all(torch::stable::detail::StableLibrary& m, bool autograd,
                  std::integer_sequence<int, R...>) {
  (register_one<R>(m, autograd), ...);
}

template <int R>
void register_grad_twin(torch::stable::detail::StableLibrary& m) {
  if constexpr (kOps[R].routed) m.impl(twin_name("_grad_", R).c_str(), &bump_and_run<R>);
}

template <int... R>
void register_grad_twins(torch::stable::detail::StableLibrary& m, std::integer_sequence<int, R...>) {
  (register_grad_twin<R>(m), ...);
}

// torch_exception_get_what_without_backtrace (the error text of a forwarded call) is in every
// torch from 2.13; on older ones the Python kernels keep serving these keys.
bool routing_supported() { return aoti_torch_abi_version() >= TORCH_VERSION_2_13_0; }

}  // namespace
}  // namespace rope

STABLE_TORCH_LIBRARY_IMPL(rope, Autograd, m) {
  if (rope::routing_supported()) {
    rope::register_all(m, true, std::make_integer_sequence<int, rope::kNumOps>{});
  }
}

STABLE_TORCH_LIBRARY_IMPL(rope, ADInplaceOrView, m) {
  if (rope::routing_supported()) {
    rope::register_all(m, false, std::make_integer_sequence<int, rope::kNumOps>{});
  }
}

// Where no Python registered the autograd path (a C++-only deployment), `_grad_<op>` is the
// op without autograd: bookkeeping and the kernel.
STABLE_TORCH_LIBRARY_IMPL(rope, CompositeExplicitAutograd, m) {
  if (rope::routing_supported()) {
    rope::register_grad_twins(m, std::make_integer_sequence<int, rope::kNumOps>{});
  }
}
