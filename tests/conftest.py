import contextlib
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import rope_ext  # noqa: E402

from tolerances import DTYPES, TOL  # noqa: E402,F401


@pytest.fixture(autouse=True)
def _fresh_seed(request):
    # A different seed per test (and per run unless ROPE_TEST_SEED is set), printed on failure.
    seed = int(os.environ.get("ROPE_TEST_SEED", torch.seed() % (2**31)))
    torch.manual_seed(seed)
    print(f"ROPE_TEST_SEED={seed}")  # shown with a failure's captured output, to replay it
    yield


def assert_close(actual, expected, dtype):
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(actual.double(), expected.double(), rtol=rtol, atol=atol)


def poison_like(t):
    """A tensor of t's shape/dtype filled with NaN, so any element a kernel forgets shows."""
    return torch.full_like(t, float("nan"))


def assert_compiled_like_eager(step, args):
    """torch.compile(step, fullgraph=True) on args returns and writes (in place, into args) what
    step does eagerly on copies of them."""
    torch._dynamo.reset()
    eager_args = [a.clone() for a in args]
    out = torch.compile(step, fullgraph=True)(*args)
    torch.testing.assert_close(out, step(*eager_args), rtol=0, atol=0)
    for a, b in zip(args, eager_args):
        assert torch.equal(a, b)


@contextlib.contextmanager
def torch_defaults(default):
    """torch's default dtype ("bfloat16", "float16") or default device ("meta") set to
    `default` inside, as a script that builds models under such defaults has them."""
    dtype = torch.get_default_dtype()
    try:
        if default == "meta":
            torch.set_default_device("meta")
        else:
            torch.set_default_dtype(getattr(torch, default))
        yield
    finally:
        torch.set_default_device(None)
        torch.set_default_dtype(dtype)


def native_cpu():
    return rope_ext.backend("cpu") == "native"


def pytest_addoption(parser):
    parser.addoption("--fuzz-cases", type=int, default=400,
                     help="random cases of tests/test_fuzz.py (make sanitize runs more)")
    parser.addoption("--fuzz-seed", type=int, default=None, help="replay test_fuzz.py from this seed")
    parser.addoption("--claim-dir", default=None, metavar="DIR",
                     help="share the test files with the other pytest processes given this DIR: "
                          "each runs the files it takes first (make test runs two processes)")


class _FileClaims:
    """Whole test files handed out to the pytest processes that share a directory (--claim-dir):
    a process about to run a file's first test takes it by creating a marker there, and leaves
    the files another process took first. So the processes stay busy until the last file is
    taken, whatever each file's length on this machine (a fixed split of the files left one
    process a minute behind the other). Whole files, so that a module's fixtures and background
    work stay in one process."""

    def __init__(self, directory):
        self.directory = directory
        self.mine = {}

    def owns(self, path):
        taken = self.mine.get(path)
        if taken is None:
            marker = os.path.join(self.directory, os.path.relpath(path, ROOT).replace(os.sep, "--"))
            try:
                os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
                taken = True
            except FileExistsError:
                taken = False
            self.mine[path] = taken
        return taken


_CLAIMS = pytest.StashKey()


def _claims(config):
    """The run's _FileClaims, or None without --claim-dir."""
    directory = config.getoption("--claim-dir")
    return None if directory is None else config.stash.setdefault(_CLAIMS, _FileClaims(directory))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    """With --claim-dir, a test of a file another process took is left to it (not run, not
    reported here)."""
    claims = _claims(item.config)
    if claims is not None and not claims.owns(str(item.path)):
        return True
    return None


def pytest_collection_modifyitems(session, config, items):
    """The CUDA codegen tests run last: their compiles run in the background meanwhile."""
    items.sort(key=lambda item: item.module.__name__ == "test_cuda_codegen")  # a stable sort


def pytest_collection_finish(session):
    """Background work starts now, when the tests that need it are among those to run (with
    --claim-dir: in the process that takes their files, now): the JIT build tests/test_jit.py
    checks (test_jit.start_first_build) and the CUDA sources' PTX that tests/test_cuda_codegen.py
    reads (test_cuda_codegen.start_compiles)."""
    if session.config.option.collectonly:
        return
    claims = _claims(session.config)
    jit = codegen = None
    for item in session.items:
        if claims is not None and item.module.__name__ in ("test_jit", "test_cuda_codegen") \
                and not claims.owns(str(item.path)):
            continue
        if item.name == "test_jit_build_serves_the_ops_and_is_cached":
            jit = item.module
        elif item.module.__name__ == "test_cuda_codegen":
            codegen = item.module
    if jit is not None and jit.SOURCE_CHECKOUT:
        session.config._rope_ext_jit_build = jit.start_first_build()
    if codegen is not None and not codegen._started:
        codegen._started.append(codegen.start_compiles())


def pytest_sessionfinish(session):
    """A background JIT build the run did not wait for (it stopped early) is stopped too."""
    build = getattr(session.config, "_rope_ext_jit_build", None)
    if build is not None and build.poll() is None:
        build.kill()
        build.communicate()
