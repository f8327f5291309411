"""The branch-free float8 conversions of the CPU kernels (float_to_fp8_code, fp8_to_float_lanes)
give the branchy definitions' bits for every input: all 2^32 floats, all 256 codes, both formats
(tests/cpp/fp8_codes.cpp, built here with the library's flags for this machine's vector units)."""

import os
import shutil
import subprocess

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
CSRC = os.path.join(os.path.dirname(HERE), "csrc")
CXX = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")


@pytest.mark.skipif(CXX is None, reason="no C++ compiler")
def test_every_float8_conversion(tmp_path):
    exe = tmp_path / "fp8_codes"
    flags = ["-O2", "-std=c++17", "-ffp-contract=off", "-march=native"]
    build = subprocess.run([CXX, *flags, "-I", CSRC, os.path.join(HERE, "cpp", "fp8_codes.cpp"),
                            "-o", str(exe)], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and run.stdout.strip().endswith("0 mismatches"), run.stdout
