# Two entry points do all set-up on a fresh machine:
#   make run    builds everything, then reports the build, checks the kernels, times them
#   make test   builds everything, then runs pytest tests/
#   make bench  builds everything, then runs the CPU benchmark (python -m rope_ext.bench)
# Both are incremental: the venv is rebuilt only when requirements.txt changes, the extension
# only when a source under csrc/ (or setup.py) changes.

PYTHON_BOOT ?= python3
VENV        := .venv
PY          := $(VENV)/bin/python
DEPS_STAMP  := $(VENV)/.deps-installed
NATIVE_SRC  := setup.py $(shell find csrc -type f \( -name '*.cpp' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' \))
LIB         := rope_ext/_C.abi3.so
export MAX_JOBS ?= 2

.PHONY: all venv build run test bench clean

all: build

$(DEPS_STAMP): requirements.txt
	test -x $(PY) || $(PYTHON_BOOT) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements.txt
	touch $@

venv: $(DEPS_STAMP)

$(LIB): $(DEPS_STAMP) $(NATIVE_SRC)
	$(PY) setup.py --quiet build_ext --inplace
	touch $@

build: $(LIB)

run: build
	$(PY) -m rope_ext

test: build
	$(PY) -m pytest tests/ -q

bench: build
	$(PY) -m rope_ext.bench

clean:
	rm -rf build dist *.egg-info rope_ext/*.so
