"""The wheel from `make wheel`: what it holds, its metadata, and an install used from outside the
source tree. `make wheel-test` sets ROPE_EXT_WHEEL; elsewhere these tests are skipped.

test_this_process_uses_the_installed_wheel runs where ROPE_EXT_EXPECT_INSTALLED names a torch
version (`make torch213-test`: the native ops' tests against the wheel installed beside torch 2.13).
It proves that the suite is testing the wheel there, and runs every op against the reference."""

import email.parser
import glob
import os
import re
import subprocess
import sys
import zipfile

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SMOKE = os.path.join(HERE, "op_smoke.py")
WHEEL = os.environ.get("ROPE_EXT_WHEEL")
needs_wheel = pytest.mark.skipif(not WHEEL, reason="ROPE_EXT_WHEEL not set (run `make wheel-test`)")

# The native libraries a wheel may carry: the CPU library, and the CUDA one where it was built.
NATIVE = re.compile(r"rope_ext/_C(_cuda)?\.abi3\.so")


def source_version():
    with open(os.path.join(ROOT, "rope_ext", "_version.py")) as f:
        return re.search(r'__version__ = "([^"]+)"', f.read()).group(1)


def dist_info_file(names, wheel, member):
    name = next(n for n in names if n.endswith(".dist-info/" + member))
    return email.parser.Parser().parsestr(wheel.read(name).decode())


@needs_wheel
def test_wheel_holds_the_package_and_nothing_else():
    version = source_version()
    with zipfile.ZipFile(WHEEL) as wheel:
        names = wheel.namelist()
    dist_info = f"rope_ext-{version}.dist-info/"
    package_sources = {  # every module of the package and its subpackages (rope_ext.compat, ...)
        os.path.relpath(p, ROOT).replace(os.sep, "/")
        for p in glob.glob(os.path.join(ROOT, "rope_ext", "**", "*.py"), recursive=True)
    }
    python_files = {n for n in names if n.startswith("rope_ext/") and n.endswith(".py")}
    data_files = {n for n in names if n.startswith("rope_ext/") and n.endswith((".json", ".def"))}
    assert data_files == {"rope_ext/model_defaults.json", "rope_ext/schemas.def"}
    natives = {n for n in names if NATIVE.fullmatch(n)}
    metadata = {n for n in names if n.startswith(dist_info)}
    assert python_files == package_sources
    assert "rope_ext/_C.abi3.so" in natives
    assert {dist_info + m for m in ("METADATA", "WHEEL", "RECORD", "licenses/LICENSE")} <= metadata
    unexpected = set(names) - python_files - data_files - natives - metadata
    assert not unexpected, f"the wheel carries files it should not: {sorted(unexpected)}"
    assert not any(re.search(r"\.(o|cpp|cu|h|cuh|pyc)$|tests/|csrc/|build/|bench/", n) for n in names)


@needs_wheel
def test_wheel_native_libraries_carry_no_debug_info():
    # Release builds: code only. The CPU and CUDA libraries together stay under 12 MB (five op
    # families, each CPU kernel compiled per instruction set, each CUDA kernel for two archs; a
    # build with debug info is several times that).
    with zipfile.ZipFile(WHEEL) as wheel:
        sizes = {i.filename: i.file_size for i in wheel.infolist() if NATIVE.fullmatch(i.filename)}
        data = {n: wheel.read(n) for n in sizes}
    assert sum(sizes.values()) < 12 * 2**20, sizes
    # With CUDA 13 the device code is compressed for size (build.json's nvcc13_flags): the CUDA
    # library is then under 2 MB, where it was 7.4 MB uncompressed.
    cuda = sizes.get("rope_ext/_C_cuda.abi3.so")
    import build_config  # the toolkit that built it (`make wheel` builds here)

    if cuda is not None and (build_config.nvcc_major() or 0) >= 13:
        assert cuda < 2 * 2**20, sizes
    for name, blob in data.items():
        assert b".debug_info" not in blob, f"{name} carries debug info"


@needs_wheel
def test_wheel_metadata():
    version = source_version()
    assert os.path.basename(WHEEL).startswith(f"rope_ext-{version}-cp310-abi3-")
    with zipfile.ZipFile(WHEEL) as wheel:
        names = wheel.namelist()
        meta = dist_info_file(names, wheel, "METADATA")
        tags = dist_info_file(names, wheel, "WHEEL")
    assert meta["Name"] == "rope_ext"
    assert meta["Version"] == version
    assert meta.get_all("Requires-Dist") == ["torch>=2.10"]
    assert meta["Requires-Python"] == ">=3.10"
    assert tags["Root-Is-Purelib"] == "false"  # it carries a native library
    # the license: an SPDX expression, and its text
    assert meta["License-Expression"] == "BSD-3-Clause"
    assert meta.get_all("License-File") == ["LICENSE"]
    with zipfile.ZipFile(WHEEL) as wheel, open(os.path.join(ROOT, "LICENSE"), "rb") as f:
        assert wheel.read(f"rope_ext-{version}.dist-info/licenses/LICENSE") == f.read()
    assert [t.rsplit("-", 1)[0] for t in tags.get_all("Tag")] == ["cp310-abi3"]


@needs_wheel
def test_installed_wheel_serves_from_outside_the_source_tree(tmp_path):
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
         "--target", str(target), WHEEL],
        check=True,
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    # -I: no PYTHONPATH, no user site, no current directory on sys.path; op_smoke puts the install
    # target first and checks that rope_ext and its native library both come from there.
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROPE_EXT_")}
    result = subprocess.run(
        [sys.executable, "-I", SMOKE, "--path", str(target), "--expect-loaded-by", "compiled",
         "--expect-under", str(target)],
        cwd=elsewhere, env=env, capture_output=True, text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"OK compiled {target}" in result.stdout
    # The installed copy has no sources to JIT-build, and says so.
    code = (
        f"import sys; sys.path.insert(0, {str(target)!r}); import rope_ext\n"
        "try:\n    rope_ext.jit.check_prerequisites()\n"
        "except RuntimeError as e:\n    print(e)\n"
    )
    result = subprocess.run([sys.executable, "-I", "-c", code], cwd=elsewhere, env=env,
                            capture_output=True, text=True)
    assert "not a source checkout" in result.stdout, result.stdout + result.stderr


@pytest.mark.skipif(not os.environ.get("ROPE_EXT_EXPECT_INSTALLED"),
                    reason="ROPE_EXT_EXPECT_INSTALLED not set (run `make torch213-test`)")
def test_this_process_uses_the_installed_wheel():
    import torch

    import rope_ext
    from rope_ext import _library

    assert torch.__version__.split("+")[0] == os.environ["ROPE_EXT_EXPECT_INSTALLED"]
    package_dir = os.path.dirname(os.path.realpath(rope_ext.__file__))
    assert os.path.basename(os.path.dirname(package_dir)) == "site-packages", package_dir
    assert not os.path.isdir(os.path.join(os.path.dirname(package_dir), "csrc"))
    assert _library.state.loaded_by == "compiled"
    assert os.path.realpath(_library.state.path).startswith(package_dir + os.sep)
    assert rope_ext.backend("cpu") == "native"
    # and the ops it carries, built against another torch, compute the right thing under this one
    import op_smoke

    op_smoke.check_ops(torch, rope_ext)
