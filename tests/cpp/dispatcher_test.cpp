// Loads the CMake-built op libraries the way a Python-less runtime does (dlopen), then calls every
// rope op (apply, apply.out, apply_backward, apply_, mrope_, apply_positions, apply_and_cache_)
// through c10::Dispatcher and compares with a float64 reference computed here from the formulas
// of docs/math.md; and checks torch's in-place rules of apply_ and shift_kv_cache_ without Python.
// Usage: rope_dispatcher_test <librope_ops.so> [<librope_ops_cuda.so>]. Exit status 0 = pass.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <dlfcn.h>

#include <c10/core/InferenceMode.h>

#include <chrono>
#include <cstdio>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <vector>

namespace {

int failures = 0;

void expect(bool ok, const std::string& what) {
  if (!ok) {
    std::fprintf(stderr, "FAIL: %s\n", what.c_str());
    ++failures;
  }
}

// (rtol, atol) against the float64 reference, as in tests/conftest.py.
std::pair<double, double> tolerance(at::ScalarType t) {
  switch (t) {
    case at::kDouble: return {1e-12, 1e-12};
    case at::kFloat: return {1e-6, 1e-6};
    case at::kHalf: return {1e-3, 2e-3};
    default: return {1e-2, 1.6e-2};  // bfloat16
  }
}

void expect_close(const at::Tensor& actual, const at::Tensor& expected, at::ScalarType dtype,
                  const std::string& what) {
  auto [rtol, atol] = tolerance(dtype);
  auto a = actual.to(at::kDouble), e = expected.to(at::kDouble);
  bool ok = a.sizes() == e.sizes() && at::allclose(a, e, rtol, atol);
  if (!ok && a.sizes() == e.sizes()) {
    std::fprintf(stderr, "  %s: max abs error %g\n", what.c_str(), (a - e).abs().max().item<double>());
  }
  expect(ok, what);
}

// The rotation in float64: pairs (x[2i], x[2i+1]) if interleaved, else (x[i], x[i + r/2]);
// dims >= r pass through. inverse rotates by -theta (the gradient w.r.t. x).
at::Tensor reference(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                     bool interleaved, bool inverse = false) {
  auto xd = x.to(at::kDouble);
  auto c = cos.to(at::kDouble);
  auto s = inverse ? -sin.to(at::kDouble) : sin.to(at::kDouble);
  const int64_t half = cos.size(-1), r = 2 * half;
  auto rot = xd.narrow(-1, 0, r);
  at::Tensor a, b;
  if (interleaved) {
    a = rot.slice(-1, 0, r, 2);
    b = rot.slice(-1, 1, r, 2);
  } else {
    a = rot.narrow(-1, 0, half);
    b = rot.narrow(-1, half, half);
  }
  auto oa = a * c - b * s, ob = a * s + b * c;
  auto out = interleaved ? at::stack({oa, ob}, -1).flatten(-2) : at::cat({oa, ob}, -1);
  return at::cat({out, xd.narrow(-1, r, x.size(-1) - r)}, -1);
}

// cos/sin tables (max_position, rotary_dim): cos in the first half, sin in the second.
at::Tensor cos_sin_cache(int64_t max_position, int64_t rotary_dim) {
  auto inv = at::pow(10000.0, -at::arange(0, rotary_dim, 2, at::kDouble) / rotary_dim);
  auto ang = at::outer(at::arange(max_position, at::kDouble), inv);
  return at::cat({ang.cos(), ang.sin()}, -1).to(at::kFloat);
}

using ApplyFn = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, bool);
using ApplyOutFn = void(const at::Tensor&, const at::Tensor&, const at::Tensor&, bool, at::Tensor&);
// The in-place ops' trailing (rope_dim_offset, inverse): 0 and false in these checks.
using ApplyInplaceFn = void(at::Tensor&, const std::optional<at::Tensor>&, const at::Tensor&,
                            const at::Tensor&, bool, int64_t, bool);
using MropeFn = void(at::Tensor&, const std::optional<at::Tensor>&, const at::Tensor&,
                     const at::Tensor&, c10::ArrayRef<int64_t>, bool, bool, int64_t, bool);

const char* const kOps[] = {"rope::apply", "rope::apply_backward", "rope::apply_", "rope::mrope_",
                            "rope::apply_positions", "rope::apply_and_cache_"};
const at::ScalarType kDtypes[] = {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16};

// Set once the library is loaded (the handles exist only then).
std::optional<c10::TypedOperatorHandle<ApplyFn>> apply_op, apply_backward_op;
std::optional<c10::TypedOperatorHandle<ApplyOutFn>> apply_out_op;  // rope::apply.out
std::optional<c10::TypedOperatorHandle<ApplyInplaceFn>> apply_inplace_op;
std::optional<c10::TypedOperatorHandle<MropeFn>> mrope_op;

std::string tag_of(at::DeviceType device, at::ScalarType dtype, bool interleaved) {
  return c10::DeviceTypeName(device) + " " + c10::toString(dtype) +
         (interleaved ? " interleaved" : " half-split");
}

// apply / apply_backward: x [B,S,H,D] sliced from a wider buffer (non-contiguous), partial rotary
// (24 of 40 dims), float32 cos/sin [1,S,1,r/2] broadcast over batch and heads.
void check_apply(at::DeviceType device, at::ScalarType dtype, bool interleaved) {
  const std::string tag = tag_of(device, dtype, interleaved);
  auto buffer = at::randn({2, 7, 3, 48}, at::TensorOptions().dtype(dtype).device(device));
  auto x = buffer.narrow(-1, 4, 40);
  auto table = cos_sin_cache(16, 24).to(device).narrow(0, 5, 7).unsqueeze(1).unsqueeze(0);
  auto cos = table.narrow(-1, 0, 12), sin = table.narrow(-1, 12, 12);
  auto y = apply_op->call(x, cos, sin, interleaved);
  expect(y.scalar_type() == dtype && y.sizes() == x.sizes(), "rope::apply keeps shape and dtype " + tag);
  expect_close(y, reference(x, cos, sin, interleaved), dtype, "rope::apply " + tag);
  expect(at::equal(y.narrow(-1, 24, 16), x.narrow(-1, 24, 16)), "rope::apply pass-through dims " + tag);
  auto out = at::full_like(y, std::numeric_limits<double>::quiet_NaN());
  apply_out_op->call(x, cos, sin, interleaved, out);
  expect(at::equal(out, y), "rope::apply.out writes what rope::apply returns " + tag);
  expect_close(apply_backward_op->call(x, cos, sin, interleaved),
               reference(x, cos, sin, interleaved, /*inverse=*/true), dtype,
               "rope::apply_backward " + tag);
}

// apply_: query/key (GQA: 4 and 2 heads) as views into one fused [T, 4+2+2, D] buffer, int64 and
// int32 positions, with and without key; the value heads must stay untouched.
void check_apply_inplace(at::DeviceType device, at::ScalarType dtype, bool interleaved) {
  for (auto pos_dtype : {at::kLong, at::kInt}) {
    const std::string tag = tag_of(device, dtype, interleaved) + (pos_dtype == at::kLong ? " int64" : " int32");
    auto qkv = at::randn({9, 8, 32}, at::TensorOptions().dtype(dtype).device(device));
    auto query = qkv.narrow(1, 0, 4), key = qkv.narrow(1, 4, 2);
    auto value = qkv.narrow(1, 6, 2).clone();
    auto cache = cos_sin_cache(64, 32).to(device);
    auto positions = at::randint(0, 64, {9}, at::TensorOptions().dtype(pos_dtype).device(device));
    auto rows = cache.index_select(0, positions.to(at::kLong)).unsqueeze(1);
    auto c = rows.narrow(-1, 0, 16), s = rows.narrow(-1, 16, 16);
    auto expected_q = reference(query, c, s, interleaved);
    auto expected_k = reference(key, c, s, interleaved);
    apply_inplace_op->call(query, key, positions, cache, interleaved, 0, false);
    expect_close(query, expected_q, dtype, "rope::apply_ query " + tag);
    expect_close(key, expected_k, dtype, "rope::apply_ key " + tag);
    expect(at::equal(qkv.narrow(1, 6, 2), value), "rope::apply_ leaves the value heads alone " + tag);

    auto q_only = at::randn({9, 4, 32}, at::TensorOptions().dtype(dtype).device(device));
    auto expected_q_only = reference(q_only, c, s, interleaved);
    apply_inplace_op->call(q_only, std::nullopt, positions, cache, interleaved, 0, false);
    expect_close(q_only, expected_q_only, dtype, "rope::apply_ without key " + tag);
  }
}

// mrope_: positions (3, B, S) = (temporal, height, width); mrope_section {4, 6, 6} splits the 16
// pairs of a 32-dim rotary part (of 40 dims) into 3 groups, group j rotated by component j.
void check_mrope(at::DeviceType device, at::ScalarType dtype, bool interleaved) {
  const std::string tag = tag_of(device, dtype, interleaved);
  const std::vector<int64_t> section = {4, 6, 6};
  auto opts = at::TensorOptions().dtype(dtype).device(device);
  auto query = at::randn({2, 5, 4, 40}, opts), key = at::randn({2, 5, 2, 40}, opts);
  auto cache = cos_sin_cache(32, 32).to(device);
  auto positions = at::randint(0, 32, {3, 2, 5}, at::TensorOptions().dtype(at::kLong).device(device));
  std::vector<at::Tensor> cos_parts, sin_parts;
  int64_t lo = 0;
  for (int j = 0; j < 3; ++j) {
    auto rows = at::embedding(cache, positions.select(0, j));  // (B, S, rotary_dim)
    cos_parts.push_back(rows.narrow(-1, lo, section[j]));
    sin_parts.push_back(rows.narrow(-1, 16 + lo, section[j]));
    lo += section[j];
  }
  auto c = at::cat(cos_parts, -1).unsqueeze(-2), s = at::cat(sin_parts, -1).unsqueeze(-2);
  auto expected_q = reference(query, c, s, interleaved);
  auto expected_k = reference(key, c, s, interleaved);
  mrope_op->call(query, key, positions, cache, section, interleaved, false, 0, false);
  expect_close(query, expected_q, dtype, "rope::mrope_ query " + tag);
  expect_close(key, expected_k, dtype, "rope::mrope_ key " + tag);
}

// apply_positions (boxed call): x [T,H,D] rotated by the rows of separate cos/sin tables at
// positions; then apply_and_cache_: the rotated key and the value land in a paged cache at the
// slots, padding slots (-1) skipped.
void check_positions_and_cache(at::DeviceType device, at::ScalarType dtype, bool interleaved) {
  const std::string tag = tag_of(device, dtype, interleaved);
  auto& dispatcher = c10::Dispatcher::singleton();
  auto opts = at::TensorOptions().dtype(dtype).device(device);
  auto x = at::randn({6, 3, 32}, opts);
  auto cache = cos_sin_cache(20, 32).to(device);
  auto cos = cache.narrow(1, 0, 16), sin = cache.narrow(1, 16, 16);
  auto positions = at::randint(0, 20, {6}, at::TensorOptions().dtype(at::kLong).device(device));
  auto rows = cache.index_select(0, positions).unsqueeze(1);
  auto c = rows.narrow(-1, 0, 16), s = rows.narrow(-1, 16, 16);
  std::vector<c10::IValue> stack = {x, positions, cos, sin, interleaved, false, c10::IValue(), false};
  dispatcher.findSchemaOrThrow("rope::apply_positions", "").callBoxed(&stack);
  expect_close(stack.at(0).toTensor(), reference(x, c, s, interleaved), dtype,
               "rope::apply_positions " + tag);

  auto q = at::randn({6, 4, 32}, opts), k = at::randn({6, 2, 32}, opts), v = at::randn({6, 2, 8}, opts);
  auto kc = at::zeros({3, 4, 2, 32}, opts), vc = at::zeros({3, 4, 2, 8}, opts);
  auto slots = at::tensor(std::vector<int64_t>{5, -1, 0, 11, 2, 7}).to(device);
  auto expected_k = reference(k, c, s, interleaved);
  auto expected_q = reference(q, c, s, interleaved);
  std::vector<c10::IValue> args = {q, k, v, positions, cache, kc, vc, slots, interleaved,
                                   std::string("auto"), c10::IValue(), c10::IValue()};
  dispatcher.findSchemaOrThrow("rope::apply_and_cache_", "").callBoxed(&args);
  expect_close(q, expected_q, dtype, "rope::apply_and_cache_ query " + tag);
  expect_close(k, expected_k, dtype, "rope::apply_and_cache_ key " + tag);
  const int64_t slot_of[6] = {5, -1, 0, 11, 2, 7};
  for (int64_t t = 0; t < 6; ++t) {
    if (slot_of[t] < 0) continue;
    auto kc_row = kc.select(0, slot_of[t] / 4).select(0, slot_of[t] % 4);
    auto vc_row = vc.select(0, slot_of[t] / 4).select(0, slot_of[t] % 4);
    expect(at::equal(kc_row, k.select(0, t)), "rope::apply_and_cache_ key cache row " + tag);
    expect(at::equal(vc_row, v.select(0, t)), "rope::apply_and_cache_ value cache row " + tag);
  }
  expect(at::equal(kc.select(0, 0).select(0, 1), at::zeros({2, 32}, opts)),
         "rope::apply_and_cache_ leaves unused slots alone " + tag);
}

// Every op with a kernel for this device, each dtype and layout.
void check_device(at::DeviceType device, c10::DispatchKey key) {
  auto& dispatcher = c10::Dispatcher::singleton();
  auto has = [&](const char* name) {
    bool yes = dispatcher.findSchemaOrThrow(name, "").hasKernelForDispatchKey(key);
    if (!yes) std::printf("%s: no %s kernel, not checked\n", name, c10::DeviceTypeName(device).c_str());
    return yes;
  };
  const bool apply = has("rope::apply") && has("rope::apply_backward");
  const bool inplace = has("rope::apply_"), mrope = has("rope::mrope_");
  const bool positions = has("rope::apply_positions") && has("rope::apply_and_cache_");
  for (auto dtype : kDtypes) {
    for (bool interleaved : {false, true}) {
      if (apply) check_apply(device, dtype, interleaved);
      if (inplace) check_apply_inplace(device, dtype, interleaved);
      if (mrope) check_mrope(device, dtype, interleaved);
      if (positions) check_positions_and_cache(device, dtype, interleaved);
    }
  }
}

// Without Python, an in-place op keeps torch's in-place rules (the C++ call path of the ops
// marked ROUTED in schemas.def): the written tensor's version moves, and a leaf that requires
// grad or an inference tensor outside inference mode is refused before anything is written.
void check_inplace_rules(const char* name, const std::function<void(const at::Tensor&)>& call,
                         const std::vector<int64_t>& shape) {
  auto t = at::randn(shape);
  const auto v0 = t._version();
  {
    at::NoGradGuard no_grad;
    call(t);
  }
  expect(t._version() > v0, std::string(name) + " moves the version of the tensor it writes");
  auto refused = [&](const at::Tensor& u, const char* what) {
    auto before = u.detach().clone();
    bool threw = false;
    try {
      call(u);
    } catch (const std::exception&) {
      threw = true;
    }
    expect(threw && at::equal(u.detach(), before), std::string(name) + " refuses " + what +
                                                       " before writing it");
  };
  refused(at::randn(shape).requires_grad_(), "a leaf that requires grad (grad mode)");
  at::Tensor inference;
  {
    c10::InferenceMode guard;
    inference = at::randn(shape);
  }
  refused(inference, "an inference tensor outside inference mode");
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2 && argc != 3) {
    std::fprintf(stderr, "usage: %s <librope_ops.so> [<librope_ops_cuda.so>]\n", argv[0]);
    return 2;
  }
  auto& dispatcher = c10::Dispatcher::singleton();
  expect(!dispatcher.findSchema({"rope::apply", ""}).has_value(),
         "rope::apply exists before the library is loaded");
  // The CPU library defines the schemas, so it loads first; the CUDA one only adds kernels.
  for (int i = 1; i < argc; ++i) {
    if (dlopen(argv[i], RTLD_NOW | RTLD_GLOBAL) == nullptr) {
      std::fprintf(stderr, "FAIL: dlopen(%s): %s\n", argv[i], dlerror());
      return 1;
    }
  }
  const uint64_t seed = std::chrono::steady_clock::now().time_since_epoch().count();
  at::manual_seed(seed);
  std::printf("loaded %s; seed %llu\n", argv[1], static_cast<unsigned long long>(seed));

  for (const char* name : kOps) {
    auto op = dispatcher.findSchema({name, ""});
    expect(op.has_value() && op->hasKernelForDispatchKey(c10::DispatchKey::CPU),
           std::string(name) + " has a CPU kernel after loading");
    if (!op.has_value()) return 1;
  }
  apply_op = dispatcher.findSchemaOrThrow("rope::apply", "").typed<ApplyFn>();
  apply_backward_op = dispatcher.findSchemaOrThrow("rope::apply_backward", "").typed<ApplyFn>();
  apply_out_op = dispatcher.findSchemaOrThrow("rope::apply", "out").typed<ApplyOutFn>();
  apply_inplace_op = dispatcher.findSchemaOrThrow("rope::apply_", "").typed<ApplyInplaceFn>();
  mrope_op = dispatcher.findSchemaOrThrow("rope::mrope_", "").typed<MropeFn>();

  check_device(at::kCPU, c10::DispatchKey::CPU);
  {
    auto table = at::rand({16, 8});
    auto positions = at::arange(3);
    check_inplace_rules("rope::apply_", [&](const at::Tensor& q) {
      at::Tensor t = q;
      apply_inplace_op->call(t, std::nullopt, positions, table, false, 0, false);
    }, {3, 2, 8});
    auto shift = dispatcher.findSchemaOrThrow("rope::shift_kv_cache_", "");
    check_inplace_rules("rope::shift_kv_cache_", [&](const at::Tensor& cache) {
      std::vector<c10::IValue> stack{cache, at::arange(3), at::ones({}, at::kLong), table, false,
                                     std::string("auto"), c10::IValue()};
      shift.callBoxed(&stack);
    }, {2, 4, 1, 8});
  }
#ifdef ROPE_EXT_EXPECT_CUDA
  // Built with CUDA kernels: they must be registered, and where a GPU is present, correct.
  int cuda_ops = 0;
  for (const char* name : kOps) {
    cuda_ops += dispatcher.findSchemaOrThrow(name, "").hasKernelForDispatchKey(c10::DispatchKey::CUDA);
  }
  expect(cuda_ops > 0, "built with CUDA kernels, but no rope op has a CUDA kernel");
  if (at::hasCUDA()) {
    check_device(at::kCUDA, c10::DispatchKey::CUDA);
  } else {
    std::printf("no GPU: %d ops have CUDA kernels, not run\n", cuda_ops);
  }
#endif

  // Bad input: a clear error through the dispatcher, naming the argument, and no crash.
  auto x = at::randn({4, 8});
  auto wide = at::randn({4, 5});  // rotary_dim 10 > head_dim 8
  try {
    apply_op->call(x, wide, wide, false);
    expect(false, "rope::apply accepted rotary_dim > head_dim");
  } catch (const std::exception& e) {
    expect(std::string(e.what()).find("rotary_dim") != std::string::npos,
           std::string("error names rotary_dim: ") + e.what());
  }

  if (failures) {
    std::fprintf(stderr, "%d check(s) failed (seed %llu)\n", failures, static_cast<unsigned long long>(seed));
    return 1;
  }
  std::printf("all rope ops match the reference through c10::Dispatcher\n");
  return 0;
}
