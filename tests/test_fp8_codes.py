"""The float8 conversions of the CPU kernels give the branchy definitions' bits for every input:
the branch-free lane functions (float_to_fp8_code, fp8_to_float_lanes) and the runs built on
them (fp8_encode_run, fp8_decode_run) for all 2^32 floats and all 256 codes, both formats
(tests/cpp/fp8_codes.cpp), once per vector unit the runs are written for: built with the flags
of the CPU variant that compiles them (csrc/ops/cpu/isa_*.cpp), skipped where this CPU lacks it."""

import os
import shutil
import subprocess

import pytest

import rope_ext

HERE = os.path.dirname(os.path.abspath(__file__))
CSRC = os.path.join(os.path.dirname(HERE), "csrc")
CXX = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")

# variant -> (the CPU variant that must serve here, flags). "lanes": the loops the compiler
# vectorizes for this machine, as the baseline kernels use them.
VARIANTS = {
    "lanes": ("baseline", ["-march=native"]),
    "avx2": ("avx2", ["-mavx2", "-mfma", "-mf16c", "-DROPE_FP8_AVX2"]),
    "avx512": ("avx512", ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2",
                          "-mfma", "-mf16c", "-DROPE_FP8_AVX512"]),
}


@pytest.mark.skipif(CXX is None, reason="no C++ compiler")
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_float8_conversion(tmp_path, variant):
    isa, flags = VARIANTS[variant]
    if rope_ext.cpu_isas() and isa not in rope_ext.cpu_isas():
        pytest.skip(f"this CPU has no {isa} variant")
    exe = tmp_path / "fp8_codes"
    flags = ["-O3", "-std=c++17", "-ffp-contract=off", *flags]
    build = subprocess.run([CXX, *flags, "-I", CSRC, os.path.join(HERE, "cpp", "fp8_codes.cpp"),
                            "-o", str(exe)], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and run.stdout.strip().endswith("0 mismatches"), run.stdout
