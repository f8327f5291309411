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
//
// Which ops are routed and which of their arguments are written is read from the schemas
// themselves (rope_ext/schemas.def: the route column and the `(a!)` annotations), at compile
// time: there is no second list to keep in step with them.
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/tensor.h>

namespace rope {

using BoxedKernel = void (*)(StableIValue*, uint64_t, uint64_t);

// A written argument: its index on the boxed stack, and whether it is `Tensor?`.
struct Written {
  int8_t index;
  bool optional;
};

constexpr int kMaxWritten = 5, kMaxTensors = 20;

// A tensor argument: its index on the boxed stack, and whether it is `Tensor?`.
struct TensorArg {
  int8_t index;
  bool optional;
};

// One op of schemas.def: its name as the dispatcher spells it after "rope::" (overload
// included), whether it takes the C++ call path, its signature, the arguments it writes, and
// its tensor arguments (`Tensor` or `Tensor?`).
struct OpSchema {
  const char* name;
  bool routed;
  const char* signature;
  int n_written = 0;
  Written written[kMaxWritten] = {};
  int n_tensors = 0;
  TensorArg tensors[kMaxTensors] = {};
};

// Calls fn(index, text) for each argument of a signature "(Tensor(a!) query, Tensor(b!)? key,
// ..., *, ...) ->", split at the commas of the outer parentheses; the keyword-only marker `*`
// takes no slot on the stack (nor an index).
template <typename Fn>
constexpr void for_each_argument(const char* signature, Fn&& fn) {
  int depth = 0, arg = 0;
  const char* start = signature + 1;
  for (const char* p = signature; *p != '\0'; ++p) {
    const bool end = *p == ')' && depth == 1;
    if (*p == '(') {
      ++depth;
    } else if (*p == ')') {
      --depth;
    }
    if (end || (depth == 1 && *p == ',')) {
      std::string_view text(start, static_cast<size_t>(p - start));
      while (!text.empty() && text.front() == ' ') text.remove_prefix(1);
      if (text != "*") fn(arg++, text);
      start = p + 1;
    }
    if (end) break;
  }
}

// An argument's text "Tensor(a!)? key=None" as (type, name).
constexpr std::pair<std::string_view, std::string_view> type_and_name(std::string_view text) {
  const size_t space = text.find(' ');
  std::string_view name = text.substr(space + 1);
  return {text.substr(0, space), name.substr(0, std::min(name.find(' '), name.find('=')))};
}

// An alias annotation with `!` marks an argument written, and a `?` after it optional; a
// tensor argument is of type `Tensor`, annotated or not, with no list after it; `?` makes it
// optional.
constexpr OpSchema parse_schema(const char* name, bool routed, const char* signature) {
  OpSchema op{name, routed, signature};
  for_each_argument(signature, [&op](int arg, std::string_view text) {
    const std::string_view type = type_and_name(text).first;
    if (type.find('!') != std::string_view::npos) {
      if (op.n_written == kMaxWritten) throw std::logic_error("more written arguments than fit");
      op.written[op.n_written++] = {static_cast<int8_t>(arg), type.back() == '?'};
    }
    const bool optional = !type.empty() && type.back() == '?';
    const std::string_view base = optional ? type.substr(0, type.size() - 1) : type;
    if (base == "Tensor" || (base.substr(0, 7) == "Tensor(" && base.back() == ')')) {
      if (op.n_tensors == kMaxTensors) throw std::logic_error("more tensors than fit");
      op.tensors[op.n_tensors++] = {static_cast<int8_t>(arg), optional};
    }
  });
  return op;
}

#define ROUTED true
#define DIRECT false
inline constexpr OpSchema kOps[] = {
#define ROPE_OP(name, route, signature) parse_schema(name, route, signature),
#include "../../rope_ext/schemas.def"
#undef ROPE_OP
};
#undef ROUTED
#undef DIRECT
constexpr int kNumOps = static_cast<int>(sizeof(kOps) / sizeof(kOps[0]));

// The router finds a call's device from its first argument: a Tensor (not `Tensor?`) in every
// routed op.
constexpr bool routed_ops_start_with_a_tensor() {
  for (const OpSchema& op : kOps) {
    const std::string_view sig = op.signature;
    if (op.routed && !(sig.substr(0, 7) == "(Tensor" && (sig[7] == ' ' || sig[7] == '('))) {
      return false;
    }
  }
  return true;
}
static_assert(routed_ops_start_with_a_tensor(), "a routed op's first argument must be a Tensor");

// The index of op `name` in kOps (-1: none).
constexpr int op_index(std::string_view name) {
  for (int i = 0; i < kNumOps; ++i) {
    if (name == kOps[i].name) return i;
  }
  return -1;
}

// "apply.out" -> "<prefix>apply.out"
inline std::string twin_name(const char* prefix, int op) {
  return std::string(prefix) + kOps[op].name;
}

// A borrowed look at a tensor argument on the boxed stack: a `Tensor` is the handle, a
// `Tensor?` a pointer to a StableIValue holding it, or null for None.
inline AtenTensorHandle tensor_at(const StableIValue* stack, int index, bool optional) {
  const StableIValue v = stack[index];
  if (!optional) return torch::stable::detail::to<AtenTensorHandle>(v);
  const auto* p = torch::stable::detail::to<StableIValue*>(v);
  return p == nullptr ? nullptr : torch::stable::detail::to<AtenTensorHandle>(*p);
}

// A layout as Python prints it (torch.sparse_coo), for the message below.
inline std::string layout_str(int32_t layout) {
  const std::pair<int32_t (*)(), const char*> names[] = {
      {aoti_torch_layout_sparse_coo, "sparse_coo"}, {aoti_torch_layout_sparse_csr, "sparse_csr"},
      {aoti_torch_layout_sparse_csc, "sparse_csc"}, {aoti_torch_layout_sparse_bsr, "sparse_bsr"},
      {aoti_torch_layout_sparse_bsc, "sparse_bsc"}, {aoti_torch_layout__mkldnn, "_mkldnn"},
      {aoti_torch_layout_jagged, "jagged"}};
  for (const auto& [code, name] : names) {
    if (code() == layout) return std::string("torch.") + name;
  }
  return "code " + std::to_string(layout);
}

// Tensor argument `a` of a call on the boxed stack, or null where it is None or undefined.
inline AtenTensorHandle given_tensor(const StableIValue* stack, const TensorArg& a) {
  const AtenTensorHandle t = tensor_at(stack, a.index, a.optional);
  bool defined = false;
  if (t != nullptr) STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_is_defined(t, &defined));
  return defined ? t : nullptr;
}

// Op `op`'s tensors as the kernels need them: a required one given (Python's None arrives as
// an undefined tensor, which the kernels would fail on with no word of which argument it was),
// and each one given dense (strided): a sparse or mkldnn tensor has no sizes, strides or data
// the kernels could read, and the C++ call path reaches them without the dispatcher, which
// would have refused them. One copy for every op (the argument's name is looked up in the
// signature only to raise). Mirrored in rope_ext/_registrations.py `_given`.
inline void check_tensors_given(int op, const StableIValue* stack) {
  const OpSchema& s = kOps[op];
  for (int i = 0; i < s.n_tensors; ++i) {
    const TensorArg& a = s.tensors[i];
    const AtenTensorHandle t = given_tensor(stack, a);
    const bool defined = t != nullptr;
    static const int32_t strided = aoti_torch_layout_strided();
    int32_t layout = strided;
    if (defined) STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_get_layout(t, &layout));
    if (defined ? layout == strided : a.optional) continue;
    std::string name;
    for_each_argument(s.signature, [&](int arg, std::string_view text) {
      if (arg == a.index) name = type_and_name(text).second;
    });
    throw std::runtime_error("rope." + std::string(s.name) + ": " + name +
                             (defined ? " must be a dense (strided) tensor, got layout " +
                                            layout_str(layout)
                                      : std::string(" must be a tensor, got None")));
  }
}

// A boxed call's arguments belong to the kernel that receives the stack: a new handle for each
// tensor, a box for each optional, a handle for each list or string. A kernel (TORCH_BOX) takes
// them into values that release them, and the dispatcher consumes a stack handed on to it; a
// wrapper that refuses the call before either (check_tensors_given, torch's in-place rules)
// releases them here, or every refused call would keep its tensors alive.
inline void release_arguments(int op, StableIValue* stack) {
  using torch::stable::Tensor;
  using torch::stable::detail::to;
  for_each_argument(kOps[op].signature, [&](int arg, std::string_view text) {
    std::string_view type = type_and_name(text).first;
    const bool optional = !type.empty() && type.back() == '?';
    if (optional) type.remove_suffix(1);
    if (type.substr(0, 7) == "Tensor(") type = "Tensor";
    const StableIValue v = stack[arg];
    if (type == "Tensor") {
      optional ? (void)to<std::optional<Tensor>>(v) : (void)to<Tensor>(v);
    } else if (type == "int[]") {
      optional ? (void)to<std::optional<std::vector<int64_t>>>(v)
               : (void)to<std::vector<int64_t>>(v);
    } else if (type == "str") {
      optional ? (void)to<std::optional<std::string>>(v) : (void)to<std::string>(v);
    } else if (optional) {  // an optional number's box
      (void)to<std::optional<double>>(v);
    }
  });
}

// Runs `check`, which may refuse op `op`'s call before its stack is handed on; a refusal
// releases the stack's arguments first (release_arguments).
template <class Check>
void refuse_releasing(int op, StableIValue* stack, Check&& check) {
  try {
    check();
  } catch (...) {
    release_arguments(op, stack);
    throw;
  }
}

// Whether each tensor of op `op`'s call (checked given) has memory, for the router's direct call
// of a CPU kernel: torch's ZeroTensor (an efficient zero, as some of torch's derivative formulas
// make) has a null data pointer, which the dispatcher's ZeroTensor key materializes before a
// kernel; the direct call skips that key. (Only tensors on their way to a kernel's data reads are
// asked: a tensor with no storage at all, such as functorch's wrappers, fails here as it would in
// the kernel; the Python call layer keeps them off this path.)
inline bool tensors_have_memory(int op, const StableIValue* stack) {
  const OpSchema& s = kOps[op];
  for (int i = 0; i < s.n_tensors; ++i) {
    const AtenTensorHandle t = given_tensor(stack, s.tensors[i]);
    if (t == nullptr) continue;
    void* data = nullptr;
    STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_get_data_ptr(t, &data));
    int64_t numel = 0;
    if (data == nullptr) STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_get_numel(t, &numel));
    if (data == nullptr && numel != 0) return false;
  }
  return true;
}

// The CPU kernels, as the router calls them for CPU tensors (set by the CPU registrations).
BoxedKernel& routed_cpu_kernel(int op);

// Registers `fn` for the routed op `name` and its kernel-only twin; returns the op's index.
inline int impl_routed(torch::stable::detail::StableLibrary& m, const char* name, BoxedKernel fn) {
  const int op = op_index(name);
  if (op < 0 || !kOps[op].routed) {
    throw std::logic_error(std::string("rope::") + name + " is not a routed op (schemas.def)");
  }
  m.impl(name, fn);
  m.impl(twin_name("_impl_", op).c_str(), fn);
  return op;
}

// The same for a CPU kernel, which the router also calls directly.
inline void impl_routed_cpu(torch::stable::detail::StableLibrary& m, const char* name,
                            BoxedKernel fn) {
  routed_cpu_kernel(impl_routed(m, name, fn)) = fn;
}

// Device kernel K of op R, after the check that its tensors were given.
template <int R, BoxedKernel K>
void tensors_given_then(StableIValue* stack, uint64_t num_args, uint64_t num_outputs) {
  refuse_releasing(R, stack, [&] { check_tensors_given(R, stack); });
  K(stack, num_args, num_outputs);
}

// Registers kernel K for op R (and, if it is routed, for its twin; the router also calls a CPU
// kernel directly).
template <int R, BoxedKernel K>
void impl_kernel(torch::stable::detail::StableLibrary& m, bool cpu) {
  static_assert(R >= 0, "not an op of schemas.def");
  constexpr BoxedKernel fn = &tensors_given_then<R, K>;
  if constexpr (kOps[R].routed) {
    cpu ? impl_routed_cpu(m, kOps[R].name, fn) : (void)impl_routed(m, kOps[R].name, fn);
  } else {
    m.impl(kOps[R].name, fn);
  }
}

}  // namespace rope

// The device kernels' registrations, in STABLE_TORCH_LIBRARY_IMPL(rope, CPU / CUDA, m): the
// typed kernel `fn` of op `name` (as schemas.def spells it), boxed.
#define ROPE_IMPL_CPU(m, name, fn) ::rope::impl_kernel<::rope::op_index(name), TORCH_BOX(fn)>(m, true)
#define ROPE_IMPL(m, name, fn) ::rope::impl_kernel<::rope::op_index(name), TORCH_BOX(fn)>(m, false)
