"""None where an op requires a tensor (`key=None` to an op whose key is not optional, say): every
op, for each of its `Tensor` arguments, raises `rope.<op>: <name> must be a tensor, got None` on
the native path (device kernels and the C++ call path, in every grad mode) and on the reference
path alike, before anything is written."""

import json
import os
import subprocess
import sys

import pytest
import torch

import rope_ext  # noqa: F401  (registers the ops)
from conftest import native_cpu
from rope_ext._schemas import SCHEMAS

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def overload(name):
    base, _, over = name.partition(".")
    return getattr(getattr(torch.ops.rope, base), over or "default")


def cases():
    """(op name, required tensor's name, keyword args): every required tensor None in turn, the
    others tensors, every other argument its default or a plain value."""
    plain = {"int": 1, "float": 1.0, "bool": False, "str": "auto", "List[int]": [1, 1, 1],
             "Optional[Tensor]": None}
    out = []
    for name in sorted(SCHEMAS):
        args = overload(name)._schema.arguments
        required = [a.name for a in args if isinstance(a.type, torch._C.TensorType)]
        for missing in required:
            kw = {}
            for a in args:
                if isinstance(a.type, torch._C.TensorType):
                    kw[a.name] = None if a.name == missing else torch.full((2, 2), 0.5)
                elif not a.has_default_value():
                    kw[a.name] = plain[str(a.type)]
            out.append((name, missing, kw))
    return out


def messages(modes=("grad", "no_grad", "inference")):
    """{(op, missing, mode): (message, whether every tensor argument kept its values)}."""
    got = {}
    contexts = {"grad": torch.enable_grad, "no_grad": torch.no_grad,
                "inference": torch.inference_mode}
    for mode in modes:
        for name, missing, kw in cases():
            tensors = [t for t in kw.values() if isinstance(t, torch.Tensor)]
            before = [t.clone() for t in tensors]
            with contexts[mode]():
                try:
                    overload(name)(**kw)
                    message = None
                except RuntimeError as e:
                    message = str(e).splitlines()[0]
            unchanged = all(torch.equal(t, b) for t, b in zip(tensors, before))
            got[f"{name} {missing} {mode}"] = (message, unchanged)
    return got


def test_every_op_names_a_missing_tensor_on_every_path():
    assert len(cases()) > 60
    paths = {}
    if native_cpu():
        paths["native"] = messages()
    env = dict(os.environ, ROPE_EXT_BACKEND="reference", PYTHONPATH=os.pathsep.join([ROOT, HERE]))
    script = "import json, test_missing_tensors as t; print(json.dumps(t.messages()))"
    out = subprocess.run([sys.executable, "-c", script], env=env, cwd=HERE, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    paths["reference"] = {k: tuple(v) for k, v in json.loads(out.stdout.splitlines()[-1]).items()}
    for path, got in paths.items():
        for key, (message, unchanged) in got.items():
            name, missing, _ = key.split(" ")
            assert message == f"rope.{name}: {missing} must be a tensor, got None", (path, key)
            assert unchanged, (path, key)


@pytest.mark.parametrize("fn", ["qk_norm_rope_", "apply_rope_"])
def test_public_in_place_function_with_a_missing_tensor_writes_nothing(fn):
    q, k = torch.randn(3, 4, 8), torch.randn(3, 2, 8)
    before = q.clone()
    cache = rope_ext.cos_sin_cache(8, 8)
    call = {"qk_norm_rope_": lambda: rope_ext.qk_norm_rope_(q, k, torch.ones(8), None, None, cache),
            "apply_rope_": lambda: rope_ext.apply_rope_(q, k, None, cache)}[fn]
    with pytest.raises(RuntimeError, match="positions must be a tensor, got None|k_weight must be a tensor"):
        call()
    assert torch.equal(q, before)
