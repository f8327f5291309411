// Loads the CMake-built op library the way a Python-less runtime does (dlopen), then calls every
// rope op through c10::Dispatcher and compares with a float64 reference computed here from the
// formulas of ROPE.md. Usage: rope_dispatcher_test <path to librope_ops.so>. Exit status 0 = pass.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <dlfcn.h>

#include <chrono>
#include <cstdio>
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
using ApplyInplaceFn = void(at::Tensor&, const std::optional<at::Tensor>&, const at::Tensor&,
                            const at::Tensor&, bool);

// Every op, each dtype and layout, on one device, against the float64 reference on that device.
template <typename Apply, typename ApplyInplace>
void check_ops(Apply& apply, Apply& apply_backward, ApplyInplace& apply_inplace,
               at::DeviceType device) {
  const std::vector<at::ScalarType> dtypes = {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16};
  for (auto dtype : dtypes) {
    for (bool interleaved : {false, true}) {
      const std::string tag = c10::DeviceTypeName(device) + " " + c10::toString(dtype) +
                            (interleaved ? " interleaved" : " half-split");

      // apply / apply_backward: x [B,S,H,D] sliced from a wider buffer (non-contiguous), partial
      // rotary (24 of 40 dims), float32 cos/sin [S,1,r/2] broadcast over batch and heads.
      auto buffer = at::randn({2, 7, 3, 48}, at::TensorOptions().dtype(dtype).device(device));
      auto x = buffer.narrow(-1, 4, 40);
      auto table = cos_sin_cache(16, 24).to(device).narrow(0, 5, 7).unsqueeze(1);
      auto cos = table.narrow(-1, 0, 12), sin = table.narrow(-1, 12, 12);
      auto y = apply.call(x, cos, sin, interleaved);
      expect(y.scalar_type() == dtype && y.sizes() == x.sizes(), "rope::apply keeps shape and dtype " + tag);
      expect_close(y, reference(x, cos, sin, interleaved), dtype, "rope::apply " + tag);
      expect(at::equal(y.narrow(-1, 24, 16), x.narrow(-1, 24, 16)), "rope::apply pass-through dims " + tag);
      expect_close(apply_backward.call(x, cos, sin, interleaved),
                   reference(x, cos, sin, interleaved, /*inverse=*/true), dtype,
                   "rope::apply_backward " + tag);

      // apply_: query/key (GQA: 4 and 2 heads) as views into one fused [T, 4+2+2, D] buffer,
      // int64 then int32 positions; the value heads must stay untouched.
      for (auto pos_dtype : {at::kLong, at::kInt}) {
        auto qkv = at::randn({9, 8, 32}, at::TensorOptions().dtype(dtype).device(device));
        auto query = qkv.narrow(1, 0, 4), key = qkv.narrow(1, 4, 2);
        auto value = qkv.narrow(1, 6, 2).clone();
        auto cache = cos_sin_cache(64, 32).to(device);
        auto positions = at::randint(0, 64, {9}, at::TensorOptions().dtype(pos_dtype).device(device));
        auto rows = cache.index_select(0, positions.to(at::kLong)).unsqueeze(1);
        auto c = rows.narrow(-1, 0, 16), s = rows.narrow(-1, 16, 16);
        auto expected_q = reference(query, c, s, interleaved);
        auto expected_k = reference(key, c, s, interleaved);
        std::optional<at::Tensor> key_arg = key;
        apply_inplace.call(query, key_arg, positions, cache, interleaved);
        const std::string ptag = tag + (pos_dtype == at::kLong ? " int64" : " int32");
        expect_close(query, expected_q, dtype, "rope::apply_ query " + ptag);
        expect_close(key, expected_k, dtype, "rope::apply_ key " + ptag);
        expect(at::equal(qkv.narrow(1, 6, 2), value), "rope::apply_ leaves the value heads alone " + ptag);

        auto q_only = at::randn({9, 4, 32}, at::TensorOptions().dtype(dtype).device(device));
        auto expected_q_only = reference(q_only, c, s, interleaved);
        apply_inplace.call(q_only, std::nullopt, positions, cache, interleaved);
        expect_close(q_only, expected_q_only, dtype, "rope::apply_ without key " + ptag);
      }
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s <path to librope_ops.so>\n", argv[0]);
    return 2;
  }
  auto& dispatcher = c10::Dispatcher::singleton();
  expect(!dispatcher.findSchema({"rope::apply", ""}).has_value(),
         "rope::apply exists before the library is loaded");
  if (dlopen(argv[1], RTLD_NOW | RTLD_GLOBAL) == nullptr) {
    std::fprintf(stderr, "FAIL: dlopen(%s): %s\n", argv[1], dlerror());
    return 1;
  }
  const uint64_t seed = std::chrono::steady_clock::now().time_since_epoch().count();
  at::manual_seed(seed);
  std::printf("loaded %s; seed %llu\n", argv[1], static_cast<unsigned long long>(seed));

  for (const char* name : {"rope::apply", "rope::apply_backward", "rope::apply_"}) {
    auto op = dispatcher.findSchema({name, ""});
    expect(op.has_value() && op->hasKernelForDispatchKey(c10::DispatchKey::CPU),
           std::string(name) + " has a CPU kernel after loading");
  }
  auto apply = dispatcher.findSchemaOrThrow("rope::apply", "").typed<ApplyFn>();
  auto apply_backward = dispatcher.findSchemaOrThrow("rope::apply_backward", "").typed<ApplyFn>();
  auto apply_inplace = dispatcher.findSchemaOrThrow("rope::apply_", "").typed<ApplyInplaceFn>();

  check_ops(apply, apply_backward, apply_inplace, at::kCPU);
#ifdef ROPE_EXT_EXPECT_CUDA
  // Built with the CUDA kernels: they must be registered, and where a GPU is present, correct.
  for (const char* name : {"rope::apply", "rope::apply_backward", "rope::apply_"}) {
    expect(dispatcher.findSchemaOrThrow(name, "").hasKernelForDispatchKey(c10::DispatchKey::CUDA),
           std::string(name) + " has a CUDA kernel after loading");
  }
  if (at::hasCUDA()) {
    check_ops(apply, apply_backward, apply_inplace, at::kCUDA);
  } else {
    std::printf("no GPU: CUDA kernels registered, not run\n");
  }
#endif

  // Bad input: a clear error through the dispatcher, naming the argument, and no crash.
  auto x = at::randn({4, 8});
  auto wide = at::randn({4, 5});  // rotary_dim 10 > head_dim 8
  try {
    apply.call(x, wide, wide, false);
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
