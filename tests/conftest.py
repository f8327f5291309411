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


def native_cpu():
    return rope_ext.backend("cpu") == "native"


def pytest_addoption(parser):
    parser.addoption("--fuzz-cases", type=int, default=400,
                     help="random cases of tests/test_fuzz.py (make sanitize runs more)")
    parser.addoption("--fuzz-seed", type=int, default=None, help="replay test_fuzz.py from this seed")
    parser.addoption("--shard", default=None, metavar="I/N",
                     help="run part I of N: every N-th test file (make test runs two parts at once)")


def _shard(config, items):
    """The items of part I of N (--shard I/N): whole files, every N-th in collection order, so
    that a module's fixtures and background work stay in one process."""
    value = config.getoption("--shard")
    if not value:
        return items, []
    try:
        part, parts = (int(v) for v in value.split("/"))
    except ValueError:
        raise pytest.UsageError(f"--shard {value!r}: expected I/N, e.g. 1/2") from None
    if not 1 <= part <= parts:
        raise pytest.UsageError(f"--shard {value!r}: expected 1 <= I <= N")
    files = list(dict.fromkeys(str(item.path) for item in items))
    mine = set(files[part - 1::parts])
    return ([i for i in items if str(i.path) in mine], [i for i in items if str(i.path) not in mine])


def pytest_collection_modifyitems(session, config, items):
    """The CUDA codegen tests run last: their compiles run in the background meanwhile."""
    keep, deselected = _shard(config, items)
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = keep
    items.sort(key=lambda item: item.module.__name__ == "test_cuda_codegen")  # a stable sort


def pytest_collection_finish(session):
    """Background work starts now, when the tests that need it are among those to run: the JIT
    build tests/test_jit.py checks (test_jit.start_first_build) and the CUDA sources' PTX that
    tests/test_cuda_codegen.py reads (test_cuda_codegen.start_compiles)."""
    if session.config.option.collectonly:
        return
    jit = codegen = None
    for item in session.items:
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
