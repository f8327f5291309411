// Runs an AOTInductor package (.pt2) whose graph calls torch.ops.rope.*, the way a Python-less
// deployment does: dlopen the CMake-built op libraries (loading them registers the ops with the
// dispatcher, where the package's calls find them), load the package with
// torch::inductor::AOTIModelPackageLoader, run it on inputs read from raw files, write the
// outputs back as raw files. tests/test_aoti_deploy.py writes the inputs and compares the
// outputs with eager PyTorch.
//
// Usage: rope_aoti_runner <package.pt2> <io dir> <librope_ops.so> [<more libraries>...]
//   <io dir>/inputs.txt: one line per input, "<name> <dtype> <ndim> <sizes...>", its contiguous
//   bytes in <io dir>/<name>.bin; the outputs go to out<i>.bin, described in outputs.txt.
#include <ATen/ATen.h>
#include <dlfcn.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>

#include <cstdio>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

namespace {

const std::map<std::string, at::ScalarType> kDtypes = {
    {"float32", at::kFloat}, {"float64", at::kDouble}, {"float16", at::kHalf},
    {"bfloat16", at::kBFloat16}, {"int32", at::kInt}, {"int64", at::kLong}};

std::string dtype_name(at::ScalarType t) {
  for (const auto& [name, type] : kDtypes) {
    if (type == t) return name;
  }
  return "unknown";
}

at::Tensor read_input(const std::string& dir, std::istream& line) {
  std::string name, dtype;
  int64_t ndim = 0;
  line >> name >> dtype >> ndim;
  std::vector<int64_t> sizes(ndim);
  for (auto& s : sizes) line >> s;
  TORCH_CHECK(kDtypes.count(dtype), "unknown dtype ", dtype);
  at::Tensor t = at::empty(sizes, at::TensorOptions().dtype(kDtypes.at(dtype)));
  std::ifstream f(dir + "/" + name + ".bin", std::ios::binary);
  f.read(static_cast<char*>(t.data_ptr()), static_cast<std::streamsize>(t.nbytes()));
  TORCH_CHECK(f.gcount() == static_cast<std::streamsize>(t.nbytes()), "short read of ", name);
  return t;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: %s <package.pt2> <io dir> <librope_ops.so> [<library>...]\n", argv[0]);
    return 2;
  }
  const std::string package = argv[1], dir = argv[2];
  for (int i = 3; i < argc; ++i) {  // the CPU library first: it defines the schemas
    if (dlopen(argv[i], RTLD_NOW | RTLD_GLOBAL) == nullptr) {
      std::fprintf(stderr, "dlopen %s: %s\n", argv[i], dlerror());
      return 1;
    }
  }
  try {
    std::vector<at::Tensor> inputs;
    std::ifstream manifest(dir + "/inputs.txt");
    for (std::string line; std::getline(manifest, line);) {
      if (line.empty()) continue;
      std::istringstream fields(line);
      inputs.push_back(read_input(dir, fields));
    }
    torch::inductor::AOTIModelPackageLoader loader(package);
    const std::vector<at::Tensor> outputs = loader.run(inputs);
    std::ofstream desc(dir + "/outputs.txt");
    for (size_t i = 0; i < outputs.size(); ++i) {
      const at::Tensor out = outputs[i].contiguous();
      desc << "out" << i << " " << dtype_name(out.scalar_type()) << " " << out.dim();
      for (int64_t s : out.sizes()) desc << " " << s;
      desc << "\n";
      std::ofstream f(dir + "/out" + std::to_string(i) + ".bin", std::ios::binary);
      f.write(static_cast<const char*>(out.data_ptr()), static_cast<std::streamsize>(out.nbytes()));
    }
    std::printf("OK %zu outputs\n", outputs.size());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
  return 0;
}
