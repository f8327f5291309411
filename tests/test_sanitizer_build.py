"""Under `make sanitize` (ROPE_EXT_BUILD=sanitize), proves that the suite really runs against the
instrumented library with the sanitizer runtimes loaded; skipped otherwise."""

import os
import subprocess

import pytest

import rope_ext
from rope_ext import _library, envs

pytestmark = pytest.mark.skipif(envs.BUILD != "sanitize", reason="not a `make sanitize` run")


def test_the_library_is_instrumented_and_the_runtimes_are_loaded():
    lib = _library.state.path
    symbols = subprocess.run(["nm", "-D", lib], capture_output=True, text=True, check=True).stdout
    assert "__asan_report" in symbols and "__ubsan_handle" in symbols, lib
    with open("/proc/self/maps") as f:
        maps = f.read()
    assert "libasan" in maps and "libubsan" in maps
    assert rope_ext.backend("cpu") == "native"
    assert os.path.dirname(lib) == os.path.dirname(rope_ext.__file__)
