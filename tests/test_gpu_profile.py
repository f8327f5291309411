"""bench/gpu_profile.py (which needs a GPU to time anything): every call it profiles is built
and runs once on the CPU at tiny sizes, so the script keeps up with the ops it calls."""

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))


def test_every_profiled_call_runs():
    import gpu_profile

    calls = gpu_profile.calls("cpu", quick=True)
    for family in ("apply ", "apply_ ", "apply_mrope_", "apply_rope_and_cache_", "unfused",
                   "copy", "qk_norm_rope_and_cache_", "shift_kv_cache_", "apply_ rope_dim_offset"):
        assert any(n.startswith(family) for n in calls), family
    for name, fn in calls.items():
        try:
            fn()
        except Exception as e:  # pragma: no cover - the failure names the call
            pytest.fail(f"{name}: {e!r}")
