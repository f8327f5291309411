# Two entry points do all set-up on a fresh machine:
#   make run    builds everything, then reports the build, checks the kernels, times them
#   make test   builds everything, then runs pytest tests/
# Both are incremental: the venv is rebuilt only when requirements.txt changes, the extension
# only when a source under csrc/ (or setup.py) changes.

PYTHON_BOOT ?= python3
VENV        := .venv
PY          := $(VENV)/bin/python
DEPS_STAMP  := $(VENV)/.deps-installed
NATIVE_SRC  := setup.py $(shell find csrc -type f \( -name '*.cpp' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' \))
LIB         := rope_ext/_C.abi3.so
# The CUDA library, tracked when setup.py would build it (see build_config.py; empty before the
# venv exists, so a fresh machine's first make builds it without tracking it).
CUDA_LIB    := $(shell test -x $(PY) && $(PY) build_config.py --cuda-lib)
export MAX_JOBS ?= 2

.PHONY: all venv build run test clean gpu-check

all: build

$(DEPS_STAMP): requirements.txt
	test -x $(PY) || $(PYTHON_BOOT) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements.txt
	touch $@

venv: $(DEPS_STAMP)

$(LIB) $(CUDA_LIB) &: $(DEPS_STAMP) $(NATIVE_SRC) build_config.py
	$(PY) setup.py --quiet build_ext --inplace
	touch $(LIB) $(CUDA_LIB)

build: $(LIB) $(CUDA_LIB)

run: build
	$(PY) -m rope_ext

test: build
	$(PY) -m pytest tests/ -q

# On a machine with a GPU (the H200 the device tool lends): build or reuse the libraries, run the
# tests on CUDA and the GPU benchmark; results under $$OUT (default gpu-results/).
gpu-check:
	bash scripts/gpu_check.sh

clean:
	rm -rf build dist *.egg-info rope_ext/*.so
