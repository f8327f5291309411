"""rope_ext.integrations.diffusers on tiny random-weight models of every family it patches,
built from config (tests/diffusers_models.py); run in an environment with diffusers, skipped
without it. Patched output equals diffusers' own (fp32 and bf16), unpatch restores it bit for bit,
the profiler sees rope:: ops, and deepcopy, torch.save/torch.load (in a fresh process) and
torch.compile keep working."""

import copy
import os
import subprocess
import sys

import pytest
import torch

diffusers = pytest.importorskip("diffusers")

import diffusers_models as dm  # noqa: E402
from conftest import ROOT  # noqa: E402
from rope_ext.integrations import diffusers as rdi  # noqa: E402

FAMILIES = list(dm.BUILDERS)
# The tiny models' outputs after a few layers: float32 agrees to rounding, bfloat16 to a few
# of its ulps (each layer rounds; the RoPE itself is the same math).
TOLS = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def run(model, inputs):
    with torch.no_grad():
        return model(**inputs)[0]


def rope_ops(model, inputs):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        run(model, inputs)
    return {e.key for e in prof.key_averages() if e.key.startswith("rope::")}


def processor_classes(model):
    return [type(p) for p in rdi._processors(model)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", FAMILIES)
def test_patched_equals_unpatched(family, dtype):
    model, inputs = dm.build(family, dtype)
    classes = processor_classes(model)
    want = run(model, inputs)
    assert not rdi.is_patched(model) and not rope_ops(model, inputs)
    assert rdi.patch(model) is model and rdi.is_patched(model)
    assert rdi.patch(model) is model  # patching twice changes nothing more
    for p in rdi._processors(model):
        if type(p).__module__ == rdi.__name__:
            assert isinstance(p, type(p)._rope_ext_base) and type(p).__name__ == type(p)._rope_ext_base.__name__
    got = run(model, inputs)
    assert got.dtype == want.dtype and not got.isnan().any()
    torch.testing.assert_close(got, want, **TOLS[dtype])
    assert "rope::apply" in rope_ops(model, inputs)
    assert rdi.unpatch(model) is model and not rdi.is_patched(model)
    assert processor_classes(model) == classes
    assert torch.equal(run(model, inputs), want)  # bit for bit
    assert not rope_ops(model, inputs)


@pytest.mark.parametrize("family", ["flux", "wan", "ltx", "lumina2"])
def test_training_gradients(family):
    model, inputs = dm.build(family)
    model.train()
    grads = []
    for patched in (False, True):
        if patched:
            rdi.patch(model)
        model.zero_grad()
        out = model(**inputs)[0]
        out.pow(2).mean().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    rdi.unpatch(model)
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("family", FAMILIES)
def test_deepcopy(family):
    model, inputs = dm.build(family)
    want = run(model, inputs)
    rdi.patch(model)
    twin = copy.deepcopy(model)
    assert rdi.is_patched(twin) and "rope::apply" in rope_ops(twin, inputs)
    torch.testing.assert_close(run(twin, inputs), want, **TOLS[torch.float32])
    rdi.unpatch(twin)  # the copy is its own: unpatching it leaves the original patched
    assert rdi.is_patched(model) and not rdi.is_patched(twin)
    assert torch.equal(run(twin, inputs), want)


LOAD = """
import sys, torch
sys.path.insert(0, "tests")
from rope_ext.integrations import diffusers as rdi
model = torch.load(sys.argv[1], weights_only=False)
inputs = torch.load(sys.argv[2], weights_only=False)
assert rdi.is_patched(model)
with torch.no_grad():
    out = model(**inputs)[0]
rdi.unpatch(model)
with torch.no_grad():
    back = model(**inputs)[0]
torch.save((out, back), sys.argv[3])
"""


@pytest.mark.parametrize("family", ["flux", "wan", "cogvideox"])
def test_save_and_load_in_a_fresh_process(family, tmp_path):
    model, inputs = dm.build(family)
    want = run(model, inputs)
    rdi.patch(model)
    torch.save(model, tmp_path / "model.pt")
    torch.save(inputs, tmp_path / "inputs.pt")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, "-c", LOAD, str(tmp_path / "model.pt"),
                          str(tmp_path / "inputs.pt"), str(tmp_path / "out.pt")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    out, back = torch.load(tmp_path / "out.pt")
    torch.testing.assert_close(out, want, **TOLS[torch.float32])
    assert torch.equal(back, want)


@pytest.mark.parametrize("family", ["flux", "wan"])
def test_compile(family):
    model, inputs = dm.build(family)
    want = run(model, inputs)
    rdi.patch(model)
    torch._dynamo.reset()
    compiled = torch.compile(model)
    torch.testing.assert_close(run(compiled, inputs), want, **TOLS[torch.float32])
    torch._dynamo.reset()


def test_compile_has_no_graph_break():
    model, inputs = dm.build("flux")
    rdi.patch(model)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(**inputs)
    assert explained.graph_break_count == 0, explained.break_reasons
    torch._dynamo.reset()


def test_processors_shared_within_a_model():
    model, inputs = dm.build("flux")
    want = run(model, inputs)
    shared = type(rdi._processors(model)[0])()
    model.set_attn_processor(shared)  # one processor object for every attention module
    rdi.patch(model)
    assert len(rdi._processors(model)) == 1 and rdi.is_patched(model)
    torch.testing.assert_close(run(model, inputs), want, **TOLS[torch.float32])
    rdi.unpatch(model)
    assert type(shared) is rdi.FluxAttnProcessor._rope_ext_base


def test_a_pipeline_patches_its_transformer():
    class Pipeline:  # what patch reads of a DiffusionPipeline: its components
        def __init__(self, **components):
            self.components = components

    model, inputs = dm.build("wan")
    want = run(model, inputs)
    pipe = Pipeline(transformer=model, scheduler=object(), text_encoder=torch.nn.Linear(2, 2))
    assert rdi.patch(pipe) is pipe and rdi.is_patched(pipe) and rdi.is_patched(model)
    torch.testing.assert_close(run(model, inputs), want, **TOLS[torch.float32])
    rdi.unpatch(pipe)
    assert not rdi.is_patched(model) and torch.equal(run(model, inputs), want)


def test_unsupported_model_changes_nothing():
    from diffusers import SD3Transformer2DModel

    model = SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, num_layers=1,
                                  attention_head_dim=8, num_attention_heads=2,
                                  joint_attention_dim=8, caption_projection_dim=16,
                                  pooled_projection_dim=8, out_channels=4)
    classes = processor_classes(model)
    with pytest.raises(rdi.UnsupportedModelError, match="SD3Transformer2DModel"):
        rdi.patch(model)
    assert processor_classes(model) == classes and not rdi.is_patched(model)
    with pytest.raises(ValueError, match="Linear"):
        rdi.patch(torch.nn.Linear(2, 2))
    with pytest.raises(NotImplementedError, match="expected a torch.nn.Module or a diffusers pipeline"):
        rdi.patch("flux")
    assert rdi.unpatch(model) is model


def test_a_diffusers_rope_that_differs_is_refused(monkeypatch):
    model, inputs = dm.build("wan")
    classes = processor_classes(model)
    monkeypatch.setattr(rdi, "_classes", {})
    monkeypatch.setattr(rdi, "_verified", set())
    right = rdi.dfx.apply_rotary_emb_wan
    wrong = lambda x, c, s: right(x, s, c)  # noqa: E731  (cos and sin swapped)
    monkeypatch.setattr(rdi.dfx, "apply_rotary_emb_wan", wrong)
    with pytest.raises(rdi.UnsupportedModelError, match="does not compute what"):
        rdi.patch(model)
    assert processor_classes(model) == classes and not rdi.is_patched(model)


def test_processor_classes_resolve_by_name():
    import pickle

    for name in rdi.PROCESSORS:
        cls = getattr(rdi, name)
        assert cls.__module__ == rdi.__name__ and cls.__qualname__ == name
        assert pickle.loads(pickle.dumps(cls)) is cls
    with pytest.raises(AttributeError):
        rdi.NotAProcessor  # noqa: B018
