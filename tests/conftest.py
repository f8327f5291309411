import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import rope_ext  # noqa: E402

# Tolerances for comparing against a float64 reference: (rtol, atol) per dtype.
TOL = {
    torch.float64: (1e-12, 1e-12),
    torch.float32: (1e-6, 1e-6),
    torch.float16: (1e-3, 2e-3),
    torch.bfloat16: (1e-2, 1.6e-2),
}
DTYPES = list(TOL)


@pytest.fixture(autouse=True)
def _fresh_seed(request):
    # A different seed per test (and per run unless ROPE_TEST_SEED is set), printed on failure.
    seed = int(os.environ.get("ROPE_TEST_SEED", torch.seed() % (2**31)))
    torch.manual_seed(seed)
    request.node.user_properties.append(("seed", seed))
    yield


def assert_close(actual, expected, dtype):
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(actual.double(), expected.double(), rtol=rtol, atol=atol)


def poison_like(t):
    """A tensor of t's shape/dtype filled with NaN, so any element a kernel forgets shows."""
    return torch.full_like(t, float("nan"))


def native_cpu():
    return rope_ext.backend("cpu") == "native"
