# Two entry points do all set-up on a fresh machine:
#   make run    builds everything, then reports the build, checks the kernels, times them
#   make test   builds everything, then runs pytest tests/
#   make bench  builds everything, then runs the CPU benchmark (bench/bench.py; options via BENCH_ARGS=...);
#               make bench-ops and make bench-diffusers run the other op families' benchmarks
# Both are incremental: the venv is rebuilt only when requirements.txt changes, the extension
# only when a source under csrc/ (or setup.py) changes.

PYTHON_BOOT ?= python3
# Byte-compiles a venv's packages once, on all cores (pip installs with --no-compile, which is
# serial otherwise): with PYTHONDONTWRITEBYTECODE set, as on some CI machines, every Python
# process would compile torch's sources again at import (5 s instead of 2.4 s on a 2-core VM).
# (A few files of torch's own tests are Python 3.12 syntax: their errors are expected.)
BYTE_COMPILE = -m compileall -q -j 0 "$$($(1) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" > /dev/null || true
VENV        := .venv
PY          := $(VENV)/bin/python
DEPS_STAMP  := $(VENV)/.deps-installed
NATIVE_SRC  := setup.py csrc/build.json rope_ext/schemas.def $(shell find csrc -type f \( -name '*.cpp' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' \))
LIB         := rope_ext/_C.abi3.so
# The CUDA library, tracked when setup.py would build it (build_config.py reads csrc/build.json;
# empty before the venv exists, so a fresh machine's first make builds it without tracking it).
CUDA_LIB    := $(shell test -x $(PY) && $(PY) build_config.py --cuda-lib)
export MAX_JOBS ?= 2
# The CUDA toolkit, for everything that imports torch.utils.cpp_extension (which would otherwise
# guess it from a stray nvcc on PATH, and warn, or take a CUDA_HOME with no toolkit in it and
# fail at the first CUDA compile): build_config.py keeps a CUDA_HOME that holds nvcc, else looks
# where toolkits live, and says so. Looked up once, when make starts (`?=` would define a
# recursive variable, run for each recipe).
CUDA_HOME := $(shell $(PYTHON_BOOT) build_config.py --cuda-home)
export CUDA_HOME

.PHONY: all venv build run test bench clean gpu-check

all: build

$(DEPS_STAMP): requirements.txt
	@echo "rope_ext: installing the pinned environment into $(VENV) (requirements.txt)"
	@test -x $(PY) || $(PYTHON_BOOT) -m venv $(VENV)
	@$(PY) -m pip install --quiet --disable-pip-version-check --no-compile -r requirements.txt
	@$(PY) $(call BYTE_COMPILE,$(PY))
	@touch $@

venv: $(DEPS_STAMP)

# What no mtime shows is recorded in a file, remade (FORCE) only when its lines differ from the
# record, so that what depends on it is rebuilt when they change and a second make does nothing:
# `$(call record,<lines>,<what is rebuilt>)` is such a file's recipe.
.PHONY: FORCE
define record
	@mkdir -p $(@D)
	@printf '%s\n' $(foreach i,$(1),'$(i)') > $@.new
	@if [ -f $@ ]; then echo "rope_ext: rebuilding $(2), changed since the last build (- was, + is now):"; \
		diff $@ $@.new | sed -n 's/^< /  - /p; s/^> /  + /p'; fi
	@mv $@.new $@
endef

# The build variables that shape the libraries (a build with ROPE_EXT_CPU_VARIANTS=native, then
# one without, compiles the other CPU variants).
BUILD_VARS     := ROPE_EXT_CUDA ROPE_EXT_BUILD ROPE_EXT_CPU_VARIANTS TORCH_CUDA_ARCH_LIST CUDA_HOME CXX
BUILD_VARS_NOW := $(foreach v,$(BUILD_VARS),$(v)=$($(v)))
BUILD_VARS_REC := build/.build-vars
ifneq ($(strip $(BUILD_VARS_NOW)),$(strip $(shell cat $(BUILD_VARS_REC) 2>/dev/null)))
$(BUILD_VARS_REC): FORCE
endif
$(BUILD_VARS_REC):
	$(call record,$(BUILD_VARS_NOW),the native libraries)

# scripts/build_native.py runs setup.py, printing a line per compiled file (and the whole step
# that failed, if one does); ROPE_EXT_BUILD_VERBOSE=1 shows every compiler command.
$(LIB) $(CUDA_LIB) &: $(DEPS_STAMP) $(NATIVE_SRC) build_config.py $(BUILD_VARS_REC)
	@echo "rope_ext: compiling the native libraries ($(MAX_JOBS) jobs; a few minutes the first time)"
	@$(PY) scripts/build_native.py --inplace
	@touch $(LIB) $(CUDA_LIB)

build: $(LIB) $(CUDA_LIB)

# `make run` on a machine with no GPU builds the CPU library alone (the CUDA one could serve
# nothing there, and compiling it is half the build); `make build` and `make test` build both.
# The CPU objects are the same either way, so a later full build compiles only the CUDA files.
CPU_ONLY_STAMP := build/.cpu-library-built
$(CPU_ONLY_STAMP): $(DEPS_STAMP) $(NATIVE_SRC) build_config.py $(BUILD_VARS_REC)
	@echo "rope_ext: compiling the CPU library ($(MAX_JOBS) jobs; a minute or two the first time;"
	@echo "  no GPU here, so not the CUDA library: make build compiles it)"
	@ROPE_EXT_CUDA=0 $(PY) scripts/build_native.py --inplace
	@mkdir -p build && touch $(LIB) $@

HAVE_GPU := $(shell ls /dev/nvidia0 >/dev/null 2>&1 && echo gpu)
ifeq ($(HAVE_GPU),gpu)
RUN_BUILD := build
else
RUN_BUILD := $(if $(wildcard $(CUDA_LIB)),build,$(CPU_ONLY_STAMP))
endif

run: $(RUN_BUILD)
	$(PY) -m rope_ext

# With two cores or more, two pytest processes that share the test files, each taking the next
# file the other has not (tests/conftest.py --claim-dir): most tests are single-threaded Python.
# The second process's report follows the first's; their progress lines count no percentage (each
# runs a part it cannot know ahead). TEST_JOBS=1 runs one.
TEST_SPLIT = --claim-dir build/test-claims -o console_output_style=classic
TEST_JOBS ?= $(shell [ "$$(nproc 2>/dev/null || echo 1)" -ge 2 ] && echo 2 || echo 1)
test: build
ifeq ($(TEST_JOBS),1)
	$(PY) -m pytest tests/ -q
else
	@echo "rope_ext: the tests in two processes (each takes the next test file; the second one's report follows)"
	@rm -rf build/test-claims && mkdir -p build/test-claims
	@$(PY) -m pytest tests/ -q -p no:cacheprovider $(TEST_SPLIT) > build/tests-part2.log 2>&1 & part2=$$!; \
	$(PY) -m pytest tests/ -q $(TEST_SPLIT); part1=$$?; wait $$part2; part2=$$?; \
	echo "rope_ext: the second process (build/tests-part2.log):"; cat build/tests-part2.log; \
	[ $$part1 -eq 0 ] && [ $$part2 -eq 0 ]
endif

BENCH_ARGS ?=
bench: build
	$(PY) bench/bench.py --device cpu $(BENCH_ARGS)

# The benchmarks of the op families with scripts of their own: fused QK-RMSNorm + RoPE, RoPE +
# FP8 quantization, K-shift and rope_dim_offset; the diffusers rows need the second environment
# (diffusers). Their tables and JSON go to BENCH_OUT, not over the records under bench/results/
# that the docs quote (each names its machine): BENCH_OUT=bench/results/<machine> records one.
BENCH_OUT ?= build/bench-results
.PHONY: bench-ops bench-diffusers
bench-ops: build
	@mkdir -p $(BENCH_OUT)
	$(PY) bench/rope_bench/qk_norm.py --device cpu --out $(BENCH_OUT)
	cd bench && PYTHONPATH=..:. $(CURDIR)/$(PY) -m rope_bench.quant --device cpu --out $(abspath $(BENCH_OUT))
	$(PY) bench/serving_bench.py --device cpu --out $(BENCH_OUT)
	@echo "rope_ext: results in $(BENCH_OUT)/"

# On a machine with a GPU: reuse (or rebuild) the libraries, run the tests on CUDA and the GPU
# benchmark; results under $$OUT (default gpu-results/). No build prerequisite: a lent GPU box has
# no internet to set up .venv, and takes the libraries built elsewhere. It runs with .venv's
# Python where there is one (PYTHON=... to choose), else the first python3 with torch.
gpu-check:
	PYTHON="$${PYTHON:-$(if $(wildcard $(PY)),$(CURDIR)/$(PY))}" bash scripts/gpu_check.sh

clean:
	rm -rf build dist *.egg-info rope_ext/*.so

# ---- transformers 5 / diffusers 0.42: the tests that import either, in a second venv ----------
# (requirements-hf5.txt; rebuilt only when it or the first venv changes), against the in-tree
# build: pytest runs from the repository root, so `import rope_ext` finds rope_ext/ and its
# libraries. The second venv is layered over the first (a .pth file puts .venv's packages after
# its own on sys.path): torch, numpy and pytest come from .venv at the same pins, and only what
# differs (transformers 5, diffusers and their dependencies) is installed, in seconds, not the
# minutes and gigabytes of a second torch.
HF5_VENV  := .venv-hf5
HF5_PY    := $(HF5_VENV)/bin/python
HF5_DEPS  := $(HF5_VENV)/.deps-installed
# tests/test_config.py is left out: its comparisons call transformers 4's internal rotary APIs
# (the rotary modules' signatures and helpers that transformers 5 changed).
HF5_TESTS  = $(filter-out tests/test_config.py,$(shell grep -lE 'importorskip\(.(transformers|diffusers).\)|^(import|from) (transformers|diffusers)\b' tests/test_*.py))

.PHONY: hf5-venv hf5-test

$(HF5_DEPS): requirements-hf5.txt $(DEPS_STAMP)
	@echo "rope_ext: installing transformers 5 and diffusers into $(HF5_VENV) (over $(VENV))"
	@test -x $(HF5_PY) || $(PYTHON_BOOT) -m venv $(HF5_VENV)
	@$(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' > \
		"$$($(HF5_PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/rope_ext_base_venv.pth"
	@$(HF5_PY) -m pip install --quiet --disable-pip-version-check --no-compile -r requirements-hf5.txt
	@$(HF5_PY) $(call BYTE_COMPILE,$(HF5_PY))
	@touch $@

hf5-venv: $(HF5_DEPS)

hf5-test: $(HF5_DEPS) build
	$(HF5_PY) -m pytest $(HF5_TESTS) -q -p no:cacheprovider

bench-diffusers: $(HF5_DEPS) build
	@mkdir -p $(BENCH_OUT)
	$(HF5_PY) bench/diffusers_bench.py --threads 1 --out $(BENCH_OUT)
	@echo "rope_ext: results in $(BENCH_OUT)/"

# ---- Three ways in (docs/packaging.md): a wheel, JIT loading, CMake/libtorch ----
.PHONY: wheel wheel-test torch213-test jit-test cmake-build cmake-test packaging-test

# The wheel: built against the installed torch, no build isolation; it reuses the object files of
# `make build` (same build/temp dir and flags). build/lib* is cleared so that nothing stale
# (a deleted module, an old library) can slip into the wheel.
# It is rebuilt when anything it packs changes: any file of the package (model_defaults.json and
# schemas.def too), the files its metadata and build come from, the libraries (and so the build
# variables, BUILD_VARS_REC), and which files the package holds (a module deleted), recorded.
WHEEL_STAMP   := dist/.wheel-built
WHEEL_INPUTS  := build/.wheel-inputs
PACKAGE_FILES := $(shell find rope_ext -type f ! -name '*.so' ! -path '*/__pycache__/*' | LC_ALL=C sort)
PACKAGE_SRC   := pyproject.toml setup.py MANIFEST.in README.md LICENSE $(PACKAGE_FILES)
ifneq ($(strip $(PACKAGE_FILES)),$(strip $(shell cat $(WHEEL_INPUTS) 2>/dev/null)))
$(WHEEL_INPUTS): FORCE
endif
$(WHEEL_INPUTS):
	$(call record,$(PACKAGE_FILES),the wheel)

$(WHEEL_STAMP): $(LIB) $(CUDA_LIB) $(PACKAGE_SRC) $(WHEEL_INPUTS)
	rm -rf build/lib.* dist/rope_ext-*.whl
	$(PY) -m pip wheel . --no-build-isolation --no-deps --no-index --quiet -w dist
	touch $@

wheel: $(WHEEL_STAMP)

# The source distribution: what a wheel is built from (MANIFEST.in), into dist/.
.PHONY: sdist
sdist: $(DEPS_STAMP)
	$(PY) setup.py -q sdist -d dist

wheel-test: $(WHEEL_STAMP)
	ROPE_EXT_WHEEL="$$(ls dist/rope_ext-*.whl)" $(PY) -m pytest tests/test_wheel.py -q

# One wheel across torch versions: the wheel built against torch 2.14.1 (above), installed in its
# own venv beside torch 2.13.0, runs the test suite there. The tests run from a copy of the tree
# whose rope_ext/ is a link to the installed package, so that the wheel is what they import.
TORCH213       := 2.13.0
TORCH213_VENV  := .venv-torch2.13
TORCH213_PY    := $(TORCH213_VENV)/bin/python
TORCH213_DEPS  := $(TORCH213_VENV)/.deps-installed
TORCH213_WHEEL := $(TORCH213_VENV)/.wheel-installed
TORCH213_TREE  := build/torch2.13-tests
# What the copies of the tree that run the tests take, rope_ext/ aside (torch213-test links the
# installed package there, sanitize copies the sources beside its own library).
TEST_TREE_FILES := tests csrc bench setup.py build_config.py pyproject.toml requirements.txt README.md
# The tests of the native ops themselves (kernels, checks, torch's in-place rules, the call path):
# what the torch 2.13 run and the sanitizer run repeat. The whole suite runs once, in `make test`.
NATIVE_TESTS := $(addprefix tests/,test_apply.py test_apply_out.py test_inplace.py \
	test_positions_api.py test_mrope.py test_cache_write.py test_adversarial.py test_reproducers.py \
	test_fuzz.py test_cpu_isa.py test_fresh_output.py test_qk_norm.py test_qk_norm_cache.py \
	test_rope_quant.py \
	test_kv_shift.py test_rope_dim_offset.py test_call_path.py test_errors.py test_fallback.py)

# The CPU kernel variants: `make test` runs every test under the best one this CPU has, the
# torch 2.13 run repeats the native tests under the baseline kernels (what a CPU without AVX2
# runs), and isa-test repeats the kernel tests under each variant in between (ROPE_EXT_CPU_ISA
# caps the variant at import): an AVX-512 machine checks its AVX2 code paths too. (The tests of
# checks, routing and fallbacks run no variant-specific code; tests/test_cpu_isa.py and
# test_fresh_output.py walk every variant themselves, and check that all give the same bits.)
ISA_TESTS := $(filter-out $(addprefix tests/,test_cpu_isa.py test_fresh_output.py test_errors.py \
	test_call_path.py test_fallback.py),$(NATIVE_TESTS))
.PHONY: isa-test
isa-test: build
	@for isa in $$($(PY) -c 'import rope_ext; print(*rope_ext.cpu_isas()[1:-1])'); do \
		echo "rope_ext: the kernel tests under the $$isa kernels"; \
		ROPE_EXT_CPU_ISA=$$isa $(PY) -m pytest $(ISA_TESTS) -q -p no:cacheprovider || exit 1; \
	done

$(TORCH213_DEPS): requirements.txt
	test -x $(TORCH213_PY) || $(PYTHON_BOOT) -m venv $(TORCH213_VENV)
	$(TORCH213_PY) -m pip install --quiet --disable-pip-version-check --no-compile torch==$(TORCH213) \
		$$(grep -E '^(pytest|numpy|transformers)==' requirements.txt)
	$(TORCH213_PY) $(call BYTE_COMPILE,$(TORCH213_PY))
	touch $@

$(TORCH213_WHEEL): $(TORCH213_DEPS) $(WHEEL_STAMP)
	$(TORCH213_PY) -m pip install --quiet --disable-pip-version-check --no-index --force-reinstall \
		--no-deps "$$(ls dist/rope_ext-*.whl)"
	$(TORCH213_PY) -m pip check
	touch $@

torch213-test: $(TORCH213_WHEEL)
	rm -rf $(TORCH213_TREE) && mkdir -p $(TORCH213_TREE)
	tar -c --exclude=__pycache__ $(TEST_TREE_FILES) | tar -x -C $(TORCH213_TREE)
	ln -s "$$($(TORCH213_PY) -c 'import sysconfig; print(sysconfig.get_paths()["platlib"])')/rope_ext" $(TORCH213_TREE)/rope_ext
	cd $(TORCH213_TREE) && ROPE_EXT_CPU_ISA=baseline ROPE_EXT_EXPECT_INSTALLED=$(TORCH213) \
		$(CURDIR)/$(TORCH213_PY) -m pytest \
		tests/test_wheel.py $(NATIVE_TESTS) -q -p no:cacheprovider

# JIT loading: tests/test_jit.py builds csrc/ with torch.utils.cpp_extension (cached per checkout
# under build/torch_extensions) and runs the ops through it. Part of `make test` too.
jit-test: $(DEPS_STAMP) build
	$(PY) -m pytest tests/test_jit.py -q

# CMake/libtorch: the op library with no Python, a C++ test through c10::Dispatcher (ctest), and
# torch.ops.load_library of that library from Python. Python only tells CMake where torch is.
CMAKE_DIR := build/cmake
CMAKE_LIB := $(CMAKE_DIR)/librope_ops.so
CMAKE_CUDA_LIB := $(CMAKE_DIR)/librope_ops_cuda.so

# It compiles only the CPU variants this machine runs (the wheel's build compiles them all, from
# the same files and flags): the test can run no other, and each costs a minute of compiling.
# Likewise, with no GPU here, the CUDA library for one arch (build.json's last, with its PTX):
# the test loads it to see its kernels register, and each arch costs a minute of nvcc.
CMAKE_CUDA_ARCH_FLAG := $(if $(HAVE_GPU),,-DROPE_EXT_CUDA_LAST_ARCH_ONLY=ON)
$(CMAKE_DIR)/CMakeCache.txt: $(DEPS_STAMP)
	cmake -S . -B $(CMAKE_DIR) -DCMAKE_BUILD_TYPE=Release $(CMAKE_CUDA_ARCH_FLAG) \
		-DCMAKE_CXX_FLAGS="$$($(PY) build_config.py --native-cpu-flags)" \
		-DCMAKE_PREFIX_PATH="$$($(PY) -c 'import os, torch; print(os.path.dirname(torch.__file__))')"

cmake-build: $(CMAKE_DIR)/CMakeCache.txt
	cmake --build $(CMAKE_DIR) -j $(MAX_JOBS)

# tests/test_aoti_deploy.py: an AOTInductor package calling the ops, run from C++ with that library.
cmake-test: cmake-build
	ctest --test-dir $(CMAKE_DIR) --output-on-failure
	ROPE_EXT_CMAKE_LIB=$(CMAKE_LIB) ROPE_EXT_CMAKE_CUDA_LIB=$(CMAKE_CUDA_LIB) \
		ROPE_EXT_AOTI_RUNNER=$(CMAKE_DIR)/rope_aoti_runner \
		$(PY) -m pytest tests/test_cmake_library.py tests/test_aoti_deploy.py -q

# Everything CI checks beyond `make test` (the longest chain first: see ci-checks).
packaging-test: torch213-test cmake-test wheel-test

# Everything CI checks after `make test` (.ci/run runs it with -j2: the jobs are independent, and
# most of their time is single-threaded Python, so two at a time halves it on a 2-core machine).
# Longest first (make starts them in this order), so the short ones fill the gaps at the end:
# on the 2-core AVX2 machine the sanitizer's build and run take about 7 minutes, the transformers 5
# / diffusers venv and tests about 7, the three ways in about 6 together (11 minutes in all, two at
# a time); isa-test about a minute per CPU variant it repeats (none on an AVX2-only machine:
# baseline and avx2 are run elsewhere).
.PHONY: ci-checks
ci-checks: sanitize hf5-test packaging-test isa-test

# ---- AddressSanitizer + UndefinedBehaviorSanitizer (no -fwrapv) over the CPU library ----------
# The library is built apart (build/sanitize; the release build in rope_ext/ is untouched), then
# the test suite and a long randomized fuzz run against it in a copy of the tree whose rope_ext/
# holds the sanitized library. Any report fails the run.
SAN_DIR   := build/sanitize
SAN_TREE  := $(SAN_DIR)/tree
SAN_LIB   := $(SAN_DIR)/lib/rope_ext/_C.abi3.so
# the native tests, the CUDA thread code in the simulator, and the proof the run is instrumented
# (not test_fallback.py: which path serves, in fresh processes, each slow to start instrumented,
# running kernel calls the other tests make)
SAN_TESTS ?= $(filter-out tests/test_fallback.py,$(NATIVE_TESTS)) $(addprefix tests/, \
	test_cuda_sim.py test_qk_norm_cuda_sim.py test_cuda_sim_serving.py test_sanitizer_build.py)
SAN_FUZZ  ?= 4000
SAN_ENV   := ROPE_EXT_BUILD=sanitize \
	LD_PRELOAD="$$(gcc -print-file-name=libasan.so) $$(gcc -print-file-name=libubsan.so)" \
	ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:strict_string_checks=1 \
	UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1

.PHONY: sanitize
$(SAN_LIB): $(DEPS_STAMP) $(NATIVE_SRC) build_config.py
	@echo "rope_ext: compiling the CPU library with AddressSanitizer and UBSan"
	@ROPE_EXT_BUILD=sanitize ROPE_EXT_CUDA=0 ROPE_EXT_CPU_VARIANTS=native $(PY) scripts/build_native.py \
		--build-temp $(SAN_DIR)/temp --build-lib $(SAN_DIR)/lib
	touch $@

sanitize: $(SAN_LIB)
	rm -rf $(SAN_TREE) && mkdir -p $(SAN_TREE)
	tar -c --exclude=__pycache__ --exclude='*.so' $(TEST_TREE_FILES) rope_ext | tar -x -C $(SAN_TREE)
	cp $(SAN_LIB) $(SAN_TREE)/rope_ext/
	cd $(SAN_TREE) && $(SAN_ENV) $(CURDIR)/$(PY) -m pytest $(SAN_TESTS) -q -p no:cacheprovider \
		--fuzz-cases $(SAN_FUZZ) --ignore=tests/test_jit.py --ignore=tests/test_cuda_codegen.py
