"""The build system around the native code, without building it: when `make wheel` rebuilds (the
Makefile's dependencies, checked with `make -q`), what the sdist holds, which CUDA toolkit the
build uses when CUDA_HOME names none, and the license and build requirements in the metadata.
(The CMake option spellings are checked in tests/test_cmake_library.py.)"""

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time

import pytest

import build_config

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

needs_checkout = pytest.mark.skipif(
    not os.path.exists(os.path.join(ROOT, ".git")) or not shutil.which("git"),
    reason="not a git checkout (a copied test tree)",
)


def clean_env(**extra):
    """The environment without rope_ext's build variables or an outer make's flags."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("ROPE_EXT_") and k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    env.update(extra)
    return env


# ---- make wheel: rebuilt when anything it packs changes, and only then -------------------------

# What the Makefile reads when it parses (the rules' prerequisites), copied with its sources.
MAKE_TREE = ["Makefile", "build_config.py", "setup.py", "pyproject.toml", "LICENSE", "README.md",
             "MANIFEST.in", "requirements.txt", "csrc", "rope_ext"]


@pytest.fixture
def wheel_tree(tmp_path):
    """A copy of the tree, the venv, the library and the wheel all up to date (stamps and empty
    stand-ins): `make -q wheel` (`make -q build`) tells whether make would rebuild the wheel (the
    libraries)."""
    if not shutil.which("make"):
        pytest.skip("make not found")
    if not all(os.path.exists(os.path.join(ROOT, name)) for name in MAKE_TREE):
        pytest.skip("not a source checkout (a copied test tree)")
    tree = tmp_path / "tree"
    for name in MAKE_TREE:
        src = os.path.join(ROOT, name)
        if os.path.isdir(src):
            shutil.copytree(src, tree / name, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
        else:
            (tree / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, tree / name)
    (tree / "rope_ext" / "old_module.py").write_text("X = 1\n")
    t0 = time.time() - 1000
    for dirpath, _, files in os.walk(tree):
        for f in files:
            os.utime(os.path.join(dirpath, f), (t0, t0))
    (tree / ".venv").mkdir()
    (tree / "dist").mkdir()
    # In build order; the records (of the build variables, of the package's files) as make writes them.
    for i, stamp in enumerate([".venv/.deps-installed", "build/.build-vars", "rope_ext/_C.abi3.so",
                               "build/.wheel-inputs", "dist/.wheel-built"], 1):
        if stamp.startswith("build/"):
            make(tree, stamp)
        else:
            (tree / stamp).write_text("")
        os.utime(tree / stamp, (t0 + i, t0 + i))
    return tree


def rebuilt(tree):
    """What a build would leave: the library, then the wheel, newer than everything before."""
    for stamp in ("rope_ext/_C.abi3.so", "dist/.wheel-built"):
        os.utime(tree / stamp)


def make(tree, *args, check=True, **env):
    result = subprocess.run(["make", f"PYTHON_BOOT={sys.executable}", *args], cwd=tree,
                            env=clean_env(**env), capture_output=True, text=True)
    if check:
        assert result.returncode == 0, result.stdout + result.stderr
    return result


def up_to_date(tree, target, *args, **env):
    code = make(tree, "-q", target, *args, check=False, **env).returncode
    assert code in (0, 1), make(tree, "-n", target, *args, check=False, **env).stderr
    return code == 0


def wheel_up_to_date(tree, *args, **env):
    return up_to_date(tree, "wheel", *args, **env)


def test_wheel_with_nothing_changed_is_not_rebuilt(wheel_tree):
    assert wheel_up_to_date(wheel_tree) and up_to_date(wheel_tree, "build")
    assert "Nothing to be done" in make(wheel_tree, "wheel").stdout


@pytest.mark.parametrize("data", ["rope_ext/model_defaults.json", "rope_ext/schemas.def",
                                  "rope_ext/_version.py", "LICENSE", "MANIFEST.in"])
def test_wheel_rebuilt_when_a_file_it_packs_changes(wheel_tree, data):
    os.utime(wheel_tree / data)  # now: newer than the wheel
    assert not wheel_up_to_date(wheel_tree)
    assert "pip wheel" in make(wheel_tree, "-n", "wheel").stdout


def test_wheel_rebuilt_when_a_module_is_deleted_or_renamed(wheel_tree):
    module = wheel_tree / "rope_ext" / "old_module.py"
    module.rename(wheel_tree / "rope_ext" / "new_module.py")  # keeps its old mtime
    assert not wheel_up_to_date(wheel_tree)
    (wheel_tree / "rope_ext" / "new_module.py").unlink()
    assert not wheel_up_to_date(wheel_tree)
    # and the record says what changed, then leaves the wheel alone once it is rebuilt
    out = make(wheel_tree, "build/.wheel-inputs").stdout
    assert "  - rope_ext/old_module.py" in out, out
    os.utime(wheel_tree / "dist" / ".wheel-built")
    assert wheel_up_to_date(wheel_tree)


@pytest.mark.parametrize("var, value", [("ROPE_EXT_CPU_VARIANTS", "native"),
                                        ("ROPE_EXT_CUDA", "0"), ("ROPE_EXT_BUILD", "sanitize"),
                                        ("TORCH_CUDA_ARCH_LIST", "7.5;8.9+PTX"), ("CXX", "c++-13")])
def test_libraries_and_wheel_rebuilt_when_a_build_variable_changes(wheel_tree, var, value):
    for target in ("build", "wheel"):
        assert not up_to_date(wheel_tree, target, **{var: value})  # from the environment
        assert not up_to_date(wheel_tree, target, f"{var}={value}")  # or make's command line
    # a build with the new value: the record changes once, and says how
    out = make(wheel_tree, "build/.build-vars", **{var: value}).stdout
    assert f"  - {var}=" in out and f"  + {var}={value}\n" in out, out
    rebuilt(wheel_tree)
    assert wheel_up_to_date(wheel_tree, **{var: value})
    before = os.stat(wheel_tree / "build" / ".build-vars").st_mtime_ns
    make(wheel_tree, "build/.build-vars", **{var: value})
    assert os.stat(wheel_tree / "build" / ".build-vars").st_mtime_ns == before
    assert not up_to_date(wheel_tree, "build")  # and back to the default is a change too


def test_wheel_ignores_what_it_does_not_pack(wheel_tree):
    (wheel_tree / "rope_ext" / "__pycache__").mkdir()
    (wheel_tree / "rope_ext" / "__pycache__" / "config.cpython-311.pyc").write_text("")
    assert wheel_up_to_date(wheel_tree, ROPE_EXT_BUILD_VERBOSE="1", MAX_JOBS="1")
    assert up_to_date(wheel_tree, "build", ROPE_EXT_BUILD_VERBOSE="1", MAX_JOBS="1")


# ---- the sdist: a wheel builds from it -----------------------------------------------------------

INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def needed_sources():
    """Every file a compile of build.json's sources reads from the tree: the sources, and the
    headers they include with quotes (relative to the includer, else to an include dir)."""
    desc = build_config.DESCRIPTION
    todo = [path for lib in desc["libraries"].values() for path in [lib["python_init"], *lib["sources"]]]
    seen = set()
    while todo:
        path = os.path.normpath(todo.pop())
        if path in seen:
            continue
        seen.add(path)
        with open(os.path.join(ROOT, path)) as f:
            for inc in INCLUDE.findall(f.read()):
                for base in [os.path.dirname(path), *desc["include_dirs"]]:
                    if os.path.isfile(os.path.join(ROOT, base, inc)):
                        todo.append(os.path.join(base, inc))
                        break
                else:
                    raise AssertionError(f"{path}: #include \"{inc}\" not found in the tree")
    return seen


@pytest.fixture(scope="module")
def sdist(tmp_path_factory):
    """The sdist of the checkout's files (`python setup.py sdist`, as a build frontend does),
    made under ROPE_EXT_CUDA=0: it must hold the CUDA sources all the same. (file names under
    the sdist's top directory, the unpacked directory)"""
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT,
                         capture_output=True, check=True).stdout
    tree = tmp_path_factory.mktemp("sdist") / "tree"
    for rel in filter(None, out.decode().split("\0")):
        if os.path.isfile(os.path.join(ROOT, rel)):
            os.makedirs(tree / os.path.dirname(rel), exist_ok=True)
            shutil.copy2(os.path.join(ROOT, rel), tree / rel)
    dist = tree.parent / "dist"
    result = subprocess.run([sys.executable, "setup.py", "-q", "sdist", "-d", str(dist)], cwd=tree,
                            env=clean_env(ROPE_EXT_CUDA="0"), capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    (archive,) = dist.glob("rope_ext-*.tar.gz")
    with tarfile.open(archive) as tar:
        top = tar.getnames()[0].split("/")[0]
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n and tar.getmember(n).isfile()}
        safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tar.extractall(tree.parent / "unpacked", **safe)
    return names, tree.parent / "unpacked" / top


@needs_checkout
def test_sdist_holds_what_the_build_reads(sdist):
    names, _ = sdist
    package = {os.path.relpath(os.path.join(d, f), ROOT)
               for d, dirs, files in os.walk(os.path.join(ROOT, "rope_ext"))
               for f in files if f.endswith((".py", ".json", ".def")) and "__pycache__" not in d}
    needed = {"setup.py", "pyproject.toml", "build_config.py", "LICENSE", "README.md",
              "csrc/build.json", *needed_sources(), *package}
    assert not needed - names, f"the sdist lacks {sorted(needed - names)}"
    assert any(n.endswith(".cu") for n in names) and any(n.endswith(".cuh") for n in names)


@needs_checkout
def test_sdist_carries_no_tests_or_build_output(sdist):
    names, _ = sdist
    stray = [n for n in names if re.match(r"(tests|bench|scripts|docs|build|dist|\.venv)/", n)
             or n.endswith((".so", ".o", ".pyc", ".whl"))]
    assert not stray, stray


@needs_checkout
def test_sdist_metadata_and_setup_run_from_it(sdist):
    names, unpacked = sdist
    with open(unpacked / "PKG-INFO") as f:
        meta = f.read()
    assert "License-Expression: BSD-3-Clause" in meta and "License-File: LICENSE" in meta
    # setup.py runs from the unpacked sdist (it imports build_config, which reads csrc/build.json)
    result = subprocess.run([sys.executable, "setup.py", "--version"], cwd=unpacked,
                            env=clean_env(ROPE_EXT_CUDA="0"), capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.split()[-1] == build_config_version()


def build_config_version():
    with open(os.path.join(ROOT, "rope_ext", "_version.py")) as f:
        return re.search(r'__version__ = "([^"]+)"', f.read()).group(1)


# ---- CUDA_HOME with no toolkit in it ------------------------------------------------------------

@pytest.fixture
def toolkits(tmp_path, monkeypatch):
    """A CUDA_HOME with no nvcc, a toolkit elsewhere (CUDA_PATH), a CUDA build of torch; the
    environment is restored afterwards (configure_environment writes CUDA_HOME)."""
    good = tmp_path / "cuda-good"
    (good / "bin").mkdir(parents=True)
    (good / "bin" / "nvcc").write_text("")
    bad = tmp_path / "cuda-gone"
    monkeypatch.setenv("CUDA_HOME", str(bad))
    monkeypatch.setenv("CUDA_PATH", str(good))
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    monkeypatch.setattr(build_config, "torch_cuda_version", lambda: "12.8")
    monkeypatch.setattr(build_config.envs, "CUDA", "auto")
    monkeypatch.setattr(build_config.envs, "BUILD", "release")
    return str(good), str(bad)


def test_cuda_home_without_nvcc_gives_way_to_the_toolkit_found(toolkits, capsys):
    good, bad = toolkits
    assert build_config.cuda_home() == good
    build, why = build_config.want_cuda()
    assert build and f"toolkit {good}" in why and f"CUDA_HOME={bad} holds no bin/nvcc" in why
    # what the build does agrees with that report: torch is given the toolkit, and the build says so
    assert build_config.configure_environment() == (build, why)
    assert os.environ["CUDA_HOME"] == good
    assert f"rope_ext: CUDA_HOME={bad} holds no bin/nvcc: using the CUDA toolkit at {good}" in (
        capsys.readouterr().err)


def test_cuda_home_without_nvcc_and_no_toolkit_anywhere(toolkits, monkeypatch):
    good, bad = toolkits
    monkeypatch.delenv("CUDA_PATH")
    has_nvcc = build_config._has_nvcc
    monkeypatch.setattr(build_config, "_has_nvcc", lambda home: home != "/usr/local/cuda" and has_nvcc(home))
    monkeypatch.setattr(build_config.shutil, "which", lambda name: None)
    assert build_config.cuda_home() is None
    build, why = build_config.want_cuda()
    assert not build and f"CUDA_HOME={bad} holds no bin/nvcc" in why
    monkeypatch.setattr(build_config.envs, "CUDA", "1")
    with pytest.raises(RuntimeError, match=f"ROPE_EXT_CUDA=1 .*CUDA_HOME={re.escape(bad)} holds no"):
        build_config.want_cuda()


def test_cuda_home_of_the_command_line_tool(toolkits):
    good, bad = toolkits
    result = subprocess.run([sys.executable, os.path.join(ROOT, "build_config.py"), "--cuda-home"],
                            env=clean_env(), capture_output=True, text=True, check=True)
    assert result.stdout.strip() == good  # what the Makefile exports
    assert f"CUDA_HOME={bad} holds no bin/nvcc" in result.stderr


def test_run_time_variables_stop_no_build():
    # They are read at rope_ext's import, not by a build: a bad value once failed setup.py, and
    # made the Makefile export an empty CUDA_HOME (and rebuild everything once it was fixed).
    bad = clean_env(ROPE_EXT_CPU_STREAM_MB="64MB", ROPE_EXT_BACKEND="cpu", ROPE_EXT_CPU_ISA="sse",
                    ROPE_EXT_JIT="true")
    tool = os.path.join(ROOT, "build_config.py")
    result = subprocess.run([sys.executable, tool, "--cuda-home"], env=bad, capture_output=True,
                            text=True)
    assert result.returncode == 0 and result.stdout.strip() == (build_config.cuda_home() or ""), \
        result.stderr
    result = subprocess.run([sys.executable, "-c", "import rope_ext"], cwd=ROOT, env=bad,
                            capture_output=True, text=True)
    assert result.returncode != 0 and "ROPE_EXT_BACKEND='cpu': expected one of" in result.stderr
    result = subprocess.run([sys.executable, tool, "--cuda_lib"], env=clean_env(),
                            capture_output=True, text=True)
    assert result.returncode != 0 and "unknown arguments --cuda_lib" in result.stderr


def test_setup_names_the_setuptools_it_needs():
    # An older setuptools (a --no-build-isolation build in an older env) failed on pyproject's
    # license field with a message that named no version.
    code = ("import runpy, sys, setuptools; setuptools.__version__ = '65.5.0'; "
            "sys.argv = ['setup.py', '--version']; runpy.run_path('setup.py', run_name='__main__')")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=clean_env(ROPE_EXT_CUDA="0"),
                            capture_output=True, text=True)
    assert result.returncode != 0
    assert "building needs setuptools >= 77 (pyproject.toml's license field), found 65.5.0" in result.stderr


def test_a_valid_cuda_home_is_kept(toolkits, monkeypatch, capsys):
    good, _ = toolkits
    monkeypatch.setenv("CUDA_HOME", good)
    monkeypatch.delenv("CUDA_PATH")
    assert build_config.cuda_home_note() is None
    build_config.configure_environment()
    assert os.environ["CUDA_HOME"] == good and capsys.readouterr().err == ""


# ---- nvcc flags per toolkit version -------------------------------------------------------------

@pytest.mark.parametrize("release, compressed", [
    ("Cuda compilation tools, release 12.6, V12.6.77", False),
    ("Cuda compilation tools, release 13.0, V13.0.88", True),
    ("Cuda compilation tools, release 14.1, V14.1.2", True),
    ("no version line", False),
])
def test_fatbin_compressed_for_size_from_cuda_13(tmp_path, release, compressed):
    # --compress-mode is unknown to nvcc before 12.8, and a 12.x build compressed for size would
    # need a newer driver than its torch does: only CUDA 13 toolkits get nvcc13_flags.
    home = tmp_path / "cuda"
    (home / "bin").mkdir(parents=True)
    nvcc = home / "bin" / "nvcc"
    nvcc.write_text(f"#!/bin/sh\necho 'nvcc: NVIDIA (R) Cuda compiler driver'\necho '{release}'\n")
    nvcc.chmod(0o755)
    flags = build_config.nvcc_flags(str(home))
    extra = build_config.DESCRIPTION["nvcc13_flags"]
    assert extra == ["-Xfatbin=-compress-all", "--compress-mode=size"]
    assert all(f in flags for f in extra) == compressed
    assert flags[:len(build_config.DESCRIPTION["nvcc_flags"])] == build_config.DESCRIPTION["nvcc_flags"]


def test_nvcc_flags_without_a_toolkit(tmp_path):
    assert build_config.nvcc_major(str(tmp_path)) is None
    assert "--compress-mode=size" not in build_config.nvcc_flags(str(tmp_path))


# ---- license and build requirements --------------------------------------------------------------

def pyproject():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def test_license_file_is_bsd_3_clause():
    project = pyproject()["project"]
    assert project["license"] == "BSD-3-Clause" and project["license-files"] == ["LICENSE"]
    with open(os.path.join(ROOT, "LICENSE")) as f:
        text = f.read()
    assert "BSD 3-Clause License" in text and "the rope_ext authors" in text
    assert "Neither the name of the copyright holder" in text


def test_the_torch_a_build_requires_is_the_build_descriptions():
    # pyproject.toml cannot read build.json: the two must agree by hand (csrc/ needs the stable
    # ABI headers of torch_build_min; build_config.check_torch_for_build says so before compiling)
    with open(os.path.join(ROOT, "csrc", "build.json")) as f:
        least = json.load(f)["torch_build_min"]
    assert f"torch>={least}" in pyproject()["build-system"]["requires"]
    assert "torch>=2.10" in pyproject()["project"]["dependencies"]


@pytest.mark.parametrize("version,ok", [("2.12.1+cu130", False), ("2.10.0", False), ("2.13.0", True),
                                        ("2.14.1+cu130", True), ("2.20.0.dev20270101", True)])
def test_a_build_with_older_torch_headers_is_refused_before_compiling(monkeypatch, version, ok):
    monkeypatch.setattr(build_config, "_torch_version_file", lambda: {"__version__": version})
    if ok:
        build_config.check_torch_for_build()
    else:
        with pytest.raises(RuntimeError, match=rf"building from source needs torch >= 2.13 .*found "
                                               rf"torch {re.escape(version)}"):
            build_config.check_torch_for_build()


def test_setuptools_floor_reads_the_license_metadata():
    # An SPDX string as `license`, and `license-files`, came with setuptools 77 (PEP 639); older
    # ones reject the pyproject.toml, and `pip install --no-build-isolation` uses what is installed.
    (req,) = [r for r in pyproject()["build-system"]["requires"] if r.startswith("setuptools")]
    floor = re.fullmatch(r"setuptools>=(\d+)(\.\d+)*", req)
    assert floor and int(floor.group(1)) >= 77, req


@needs_checkout
def test_packaging_doc_names_every_data_file_of_the_wheel():
    with open(os.path.join(ROOT, "docs", "packaging.md")) as f:
        doc = f.read()
    section = doc.split("## The wheel", 1)[1].split("\n## ", 1)[0]
    data = [f for f in os.listdir(os.path.join(ROOT, "rope_ext")) if f.endswith((".json", ".def"))]
    assert data and all(f"`{f}`" in section for f in data), data


# ---- make gpu-check ----------------------------------------------------------------------------

def test_gpu_check_without_a_gpu_stops_instead_of_passing(tmp_path):
    """Where no GPU is visible every CUDA test skips: the check would pass having checked nothing
    (a CPU machine, or a GPU box whose CUDA_VISIBLE_DEVICES hides its GPU). It stops at once,
    saying so, with its own exit status."""
    import torch
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: scripts/gpu_check.sh runs for real there")
    res = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu_check.sh")],
                         env=clean_env(OUT=str(tmp_path), PYTHON=sys.executable),
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 3, res.stdout + res.stderr
    assert "no CUDA device visible" in res.stdout and "GPU_CHECK_DRY=1" in res.stdout, res.stdout
    assert "1. libraries" not in res.stdout, res.stdout
    # an interpreter that is not there, or has no torch, is said as such (not as "no GPU")
    res = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu_check.sh")],
                         env=clean_env(OUT=str(tmp_path), PYTHON="no-such-python"),
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "PYTHON=no-such-python cannot import torch" in res.stdout, \
        res.stdout + res.stderr
