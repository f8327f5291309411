"""None where an op requires a tensor (`key=None` to an op whose key is not optional, say): every
op, for each of its `Tensor` arguments, raises `rope.<op>: <name> must be a tensor, got None` on
the native path (device kernels and the C++ call path, in every grad mode) and on the reference
path alike, before anything is written. Likewise a sparse or mkldnn tensor in any tensor
argument, `Tensor?` ones included: `<name> must be a dense (strided) tensor, got layout ...`."""

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


# What each kind of bad tensor argument is, which arguments it is tried in, and the message.
BAD = {
    "none": (lambda: None, False, "must be a tensor, got None"),
    "sparse": (lambda: torch.full((2, 2), 0.5).to_sparse(), True,
               "must be a dense (strided) tensor, got layout torch.sparse_coo"),
    "mkldnn": (lambda: torch.full((2, 2), 0.5).to_mkldnn(), True,
               "must be a dense (strided) tensor, got layout torch._mkldnn"),
}
if not torch.backends.mkldnn.is_available():
    del BAD["mkldnn"]


def cases(kind):
    """(op name, bad tensor's name, keyword args): each required tensor (and, for a bad tensor
    rather than None, each optional one) bad in turn, the others tensors, every other argument
    its default or a plain value."""
    make_bad, optional_too, _ = BAD[kind]
    plain = {"int": 1, "float": 1.0, "bool": False, "str": "auto", "List[int]": [1, 1, 1],
             "Optional[Tensor]": None}
    out = []
    for name in sorted(SCHEMAS):
        args = overload(name)._schema.arguments
        tensors = [a.name for a in args if isinstance(a.type, torch._C.TensorType)
                   or (optional_too and str(a.type) == "Optional[Tensor]")]
        for bad in tensors:
            kw = {}
            for a in args:
                if a.name == bad:
                    kw[a.name] = make_bad()
                elif isinstance(a.type, torch._C.TensorType):
                    kw[a.name] = torch.full((2, 2), 0.5)
                elif not a.has_default_value():
                    kw[a.name] = plain[str(a.type)]
            out.append((name, bad, kw))
    return out


def messages(modes=("grad", "no_grad", "inference")):
    """{(kind, op, bad argument, mode): (message, whether every dense tensor argument kept its
    values)}."""
    got = {}
    contexts = {"grad": torch.enable_grad, "no_grad": torch.no_grad,
                "inference": torch.inference_mode}
    for kind in BAD:
        for mode in modes:
            for name, bad, kw in cases(kind):
                tensors = [t for t in kw.values()
                           if isinstance(t, torch.Tensor) and t.layout == torch.strided]
                before = [t.clone() for t in tensors]
                with contexts[mode]():
                    try:
                        overload(name)(**kw)
                        message = None
                    except RuntimeError as e:
                        message = str(e).splitlines()[0]
                unchanged = all(torch.equal(t, b) for t, b in zip(tensors, before))
                got[f"{kind} {name} {bad} {mode}"] = (message, unchanged)
    return got


def test_every_op_names_a_missing_or_non_dense_tensor_on_every_path():
    assert len(cases("none")) > 60 and len(cases("sparse")) > len(cases("none")) + 10
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
        assert len(got) == 3 * sum(len(cases(kind)) for kind in BAD)
        for key, (message, unchanged) in got.items():
            kind, name, bad, _ = key.split(" ")
            assert message == f"rope.{name}: {bad} {BAD[kind][2]}", (path, key)
            assert unchanged, (path, key)


def jagged_messages():
    """The first line of each op's error for a jagged (nested) tensor argument, in grad mode:
    {op: message}. (A jagged tensor is a Python subclass: it would reach its own dispatch table,
    which has no rope op, unless the Autograd kernel names it first.)"""
    x = torch.nested.nested_tensor([torch.randn(3, 8), torch.randn(2, 8)], layout=torch.jagged)
    cos = sin = torch.ones(1, 1, 4)
    calls = {"apply": lambda: rope_ext.apply_rope(x, cos, sin),
             "norm_rope": lambda: rope_ext.norm_rope(x, x, None, None, cos, sin, table_width="half")}
    got = {}
    for name, call in calls.items():
        try:
            call()
            got[name] = None
        except RuntimeError as e:
            got[name] = str(e).splitlines()[0]
    return got


def test_a_jagged_tensor_is_named_on_every_path():
    want = {"apply": "rope.apply: x must be a dense (strided) tensor, got layout torch.jagged",
            "norm_rope": "rope.norm_rope: query must be a dense (strided) tensor, got layout "
                         "torch.jagged"}
    if native_cpu():
        assert jagged_messages() == want
    env = dict(os.environ, ROPE_EXT_BACKEND="reference", PYTHONPATH=os.pathsep.join([ROOT, HERE]))
    script = "import json, test_missing_tensors as t; print(json.dumps(t.jagged_messages()))"
    out = subprocess.run([sys.executable, "-c", script], env=env, cwd=HERE, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[-1]) == want


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


def test_public_functions_name_a_missing_tensor():
    # The Python wrappers read nothing of a None tensor before the op names it (they once
    # raised AttributeError: 'NoneType' object has no attribute 'requires_grad' / 'dim' / ...).
    from rope_ext import qk_norm
    q, k, pos = torch.randn(3, 2, 8), torch.randn(3, 1, 8), torch.arange(3)
    cache, w, cos = rope_ext.cos_sin_cache(8, 8), torch.ones(8), torch.randn(3, 8)
    calls = {
        "rope.apply.out: x": lambda: rope_ext.apply_rope(None, cos[:, None, :4], cos[:, None, :4],
                                                         out=torch.empty(3, 2, 8)),
        "rope.apply_positions.cache: cos_sin_cache": lambda: rope_ext.apply_rope_at(q, pos, None),
        "rope.qk_norm_rope: query": lambda: qk_norm.qk_norm_rope(None, k, w, w, cos, cos),
        "rope.norm_rope: query": lambda: qk_norm.norm_rope(None, k, w, w, cos, cos),
        "rope.shift_kv_cache_: key_cache": lambda: rope_ext.shift_kv_cache_(None, pos, 1, cache),
    }
    for named, call in calls.items():
        with pytest.raises(RuntimeError, match=f"^{named} must be a tensor, got None$"):
            call()
