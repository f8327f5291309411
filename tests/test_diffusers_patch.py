"""rope_ext.integrations.diffusers on tiny random-weight models of every family it patches,
built from config (tests/diffusers_models.py); run in an environment with diffusers, skipped
without it. Patched output and gradients equal diffusers' own (fp32 and bf16), the q/k norms run
fused with the RoPE (the fused op runs; the norm modules see only tokens that are not rotated),
unpatch restores the output bit for bit, and deepcopy, torch.save/torch.load (in a fresh process)
and torch.compile keep working. A hooked or replaced norm module runs as diffusers runs it."""

import copy
import os
import subprocess
import sys

import pytest
import torch

diffusers = pytest.importorskip("diffusers")

import diffusers_models as dm  # noqa: E402
from conftest import ROOT, torch_defaults  # noqa: E402
from rope_ext.compat import diffusers as rd  # noqa: E402
from rope_ext.integrations import _dit_prologue as prologue  # noqa: E402
from rope_ext.integrations import _qk_norm  # noqa: E402
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


QK_NORMS = ("norm_q", "norm_k", "norm_added_q", "norm_added_k")
# The tokens a family norms without rotating them, where its q/k norm modules still run once
# patched: text tokens, or the tokens of a cross-attention (attn2). The others rotate all.
UNROTATED = {"hunyuan_video": "text", "cogvideox": "text", "cogview4": "text", "mochi": "text",
             "wan": "cross-attention", "ltx": "cross-attention"}


@pytest.fixture
def norm_calls(monkeypatch):
    """[(norm module, input shape)] of every call of a norm class the patch fuses, recorded by
    wrapping the classes' forward (a hook on a module would stop its fusion), the wrapper made
    known to the patch as computing what the class's own forward does (a forward replaced on
    the class stops the fusion too)."""
    calls = []
    for cls in prologue.NORM_CLASSES:
        def forward(self, x, _forward=cls.forward):
            calls.append((self, tuple(x.shape)))
            return _forward(self, x)
        monkeypatch.setattr(cls, "forward", forward)
        monkeypatch.setitem(prologue._FORWARDS, cls, forward)
    return calls


def qk_norm_calls(model, calls):
    """(name, input shape) of the calls of model's attention q/k norm modules in `calls`."""
    names = {module: name for name, module in model.named_modules()}
    return [(names[m], shape) for m, shape in calls
            if m in names and names[m].rsplit(".", 1)[-1] in QK_NORMS]


def rotated_tokens_normed(family, model, calls, inputs):
    """The q/k norm calls on tokens the family rotates (none if its norms are fused)."""
    text = inputs["encoder_hidden_states"].shape[1]

    def unrotated(name, shape):
        kind = UNROTATED.get(family)
        return ((kind == "cross-attention" and ".attn2." in name)
                or (kind == "text" and text in shape[1:3]))
    return [(name, shape) for name, shape in qk_norm_calls(model, calls) if not unrotated(name, shape)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", FAMILIES)
def test_patched_equals_unpatched(family, dtype, norm_calls):
    model, inputs = dm.build(family, dtype)
    classes = processor_classes(model)
    state = model.state_dict()
    want = run(model, inputs)
    assert not rdi.is_patched(model) and not rope_ops(model, inputs)
    assert rdi.patch(model) is model and rdi.is_patched(model)
    assert rdi.patch(model) is model  # patching twice changes nothing more
    for p in rdi._processors(model):
        if type(p).__module__ == rdi.__name__:
            assert isinstance(p, type(p)._rope_ext_base) and type(p).__name__ == type(p)._rope_ext_base.__name__
    assert model.state_dict().keys() == state.keys()
    norm_calls.clear()
    got = run(model, inputs)
    assert got.dtype == want.dtype and not got.isnan().any()
    torch.testing.assert_close(got, want, **TOLS[dtype])
    assert not rotated_tokens_normed(family, model, norm_calls, inputs)
    assert {"rope::norm_rope"} <= rope_ops(model, inputs)
    assert rdi.unpatch(model) is model and not rdi.is_patched(model)
    assert processor_classes(model) == classes
    assert torch.equal(run(model, inputs), want)  # bit for bit
    assert not rope_ops(model, inputs)


@pytest.mark.parametrize("default", ["bfloat16", "float16", "meta"])
@pytest.mark.parametrize("family", ["flux", "wan", "qwenimage"])
def test_patch_whatever_torch_defaults_are(family, default, monkeypatch):
    """A float32 CPU model patched while torch's default dtype or device is another (a script
    that sets them): the patch's probes of diffusers' functions and norms run on the CPU in
    float32, so the model is patched (they crashed, or Wan's was refused under float16) and
    computes what diffusers does."""
    monkeypatch.setattr(rdi, "_verified", {})  # probed afresh, under these defaults
    monkeypatch.setattr(_qk_norm, "_norm_forms", {})
    model, inputs = dm.build(family)
    want = run(model, inputs)
    with torch_defaults(default):
        rdi.patch(model)
    assert rdi.is_patched(model)
    torch.testing.assert_close(run(model, inputs), want, **TOLS[torch.float32])
    assert {"rope::norm_rope"} <= rope_ops(model, inputs)


@pytest.mark.parametrize("family", FAMILIES)
def test_training_gradients(family, norm_calls):
    model, inputs = dm.build(family)
    model.train()
    grads = []
    for patched in (False, True):
        if patched:
            rdi.patch(model)
            norm_calls.clear()
        model.zero_grad()
        out = model(**inputs)[0]
        out.pow(2).mean().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert not rotated_tokens_normed(family, model, norm_calls, inputs)  # fused in training too
    rdi.unpatch(model)
    assert grads[0].keys() == grads[1].keys() and grads[0]
    # the norms' weights among them (CogView4's LayerNorms have none)
    assert family == "cogview4" or any(set(name.split(".")) & set(QK_NORMS) for name in grads[0])
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("family", FAMILIES)
def test_deepcopy(family):
    model, inputs = dm.build(family)
    want = run(model, inputs)
    rdi.patch(model)
    twin = copy.deepcopy(model)
    assert rdi.is_patched(twin) and "rope::norm_rope" in rope_ops(twin, inputs)
    torch.testing.assert_close(run(twin, inputs), want, **TOLS[torch.float32])
    with torch.no_grad():  # other weights: the copy's own norms are fused
        for p in twin.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    got = run(twin, inputs)
    rdi.unpatch(twin)  # the copy is its own: unpatching it leaves the original patched
    assert rdi.is_patched(model) and not rdi.is_patched(twin)
    torch.testing.assert_close(got, run(twin, inputs), **TOLS[torch.float32])
    torch.testing.assert_close(run(model, inputs), want, **TOLS[torch.float32])


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
    compiled = torch.compile(model, fullgraph=True)
    torch.testing.assert_close(run(compiled, inputs), want, **TOLS[torch.float32])
    if family == "wan":  # (FLUX's full-width tables are compared in the graph: unfused there)
        assert "rope::norm_rope" in rope_ops(compiled, inputs)
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


def test_a_copy_of_a_listed_processor_elsewhere_is_refused_by_its_module():
    """ChronoEdit's attention processor is a copy of Wan's under the same name in its own module:
    not the class rope_ext checked, so the model is refused, and the message says which class."""
    if not hasattr(diffusers, "ChronoEditTransformer3DModel"):
        pytest.skip("no ChronoEdit in this diffusers")
    model = diffusers.ChronoEditTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4,
        out_channels=4, text_dim=8, freq_dim=8, ffn_dim=16, num_layers=1, rope_max_seq_len=32)
    classes = processor_classes(model)
    with pytest.raises(rdi.UnsupportedModelError,
                       match=r"\(diffusers\.models\.transformers\.transformer_chronoedit\."
                             r"WanAttnProcessor, not the listed diffusers\.models\.transformers\."
                             r"transformer_wan\.WanAttnProcessor\)"):
        rdi.patch(model)
    assert processor_classes(model) == classes and not rdi.is_patched(model)


def test_a_diffusers_rope_that_differs_is_refused(monkeypatch):
    model, inputs = dm.build("wan")
    classes = processor_classes(model)
    monkeypatch.setattr(rdi, "_classes", {})
    monkeypatch.setattr(rdi, "_verified", {})
    right = rdi.dfx.apply_rotary_emb_wan
    wrong = lambda x, c, s: right(x, s, c)  # noqa: E731  (cos and sin swapped)
    monkeypatch.setattr(rdi.dfx, "apply_rotary_emb_wan", wrong)
    with pytest.raises(rdi.UnsupportedModelError, match="does not compute what"):
        rdi.patch(model)
    assert processor_classes(model) == classes and not rdi.is_patched(model)


class _OtherLibrary:
    """Another library's attention, put on diffusers' processor class before patch()."""

    def __call__(self, attn, hidden_states, *args, **kwargs):
        raise AssertionError("patch() does not call a processor")


def fast_call(self, attn, hidden_states, *args, **kwargs):
    raise AssertionError("patch() does not call a processor")


def test_a_processor_call_another_library_replaced_is_refused(monkeypatch):
    """diffusers' source of the class no longer says what __call__ does, and recompiled in
    diffusers' module the replacement's names would resolve to diffusers' own or to nothing."""
    model, inputs = dm.build("flux")
    cls = type(model.transformer_blocks[0].attn.processor)
    for replacement in (fast_call, _OtherLibrary.__call__):
        monkeypatch.setattr(rdi, "_classes", {})
        monkeypatch.setattr(rdi, "_verified", {})
        monkeypatch.setattr(cls, "__call__", replacement)
        classes = processor_classes(model)
        with pytest.raises(rdi.UnsupportedModelError, match="its __call__ is not diffusers' own"):
            rdi.patch(model)
        assert processor_classes(model) == classes and not rdi.is_patched(model)


def test_a_processor_call_replaced_after_a_first_patch_is_refused_for_the_next(monkeypatch):
    """The patched class built for a first model is not reused once another library has replaced
    diffusers' __call__: the next patch checks the class as it is now, as in a fresh process;
    the first model stays patched, and unpatch still gives it diffusers' class back."""
    first, _ = dm.build("flux")
    second, _ = dm.build("flux")
    original = processor_classes(first)
    rdi.patch(first)
    cls = original[0]
    monkeypatch.setattr(cls, "__call__", fast_call)
    classes = processor_classes(second)
    with pytest.raises(rdi.UnsupportedModelError, match="its __call__ is not diffusers' own"):
        rdi.patch(second)
    assert processor_classes(second) == classes and not rdi.is_patched(second)
    assert rdi.is_patched(first)
    rdi.unpatch(first)
    assert processor_classes(first) == original


def test_a_rope_function_replaced_after_a_first_patch_is_refused_for_the_next(monkeypatch):
    """As with __call__: the RoPE function a processor's __call__ calls, replaced by another
    library after a first patch, is checked again for the next (its replacement would never
    run there), and a model patched before still pickles (its class is kept for that)."""
    import pickle

    first, _ = dm.build("flux")
    second, _ = dm.build("flux")
    rdi.patch(first)
    base = type(first.transformer_blocks[0].attn.processor)._rope_ext_base
    monkeypatch.setattr(sys.modules[base.__module__], "apply_rotary_emb",
                        lambda *args, **kwargs: args[0])
    with pytest.raises(rdi.UnsupportedModelError, match="does not compute what"):
        rdi.patch(second)
    assert not rdi.is_patched(second)
    monkeypatch.setattr(base, "__call__", fast_call)
    assert rdi.is_patched(pickle.loads(pickle.dumps(first)))


def test_processor_classes_resolve_by_name():
    import pickle

    for name in rdi.PROCESSORS:
        cls = getattr(rdi, name)
        assert cls.__module__ == rdi.__name__ and cls.__qualname__ == name
        assert pickle.loads(pickle.dumps(cls)) is cls
    with pytest.raises(AttributeError):
        rdi.NotAProcessor  # noqa: B018


def test_every_processor_is_fused():
    if not diffusers.__version__.startswith("0.42."):
        pytest.skip(f"the rewrites are written against diffusers 0.42, not {diffusers.__version__}")
    for name in rdi.PROCESSORS:
        assert getattr(rdi, name)._rope_ext_fused == (name in prologue.REWRITES), name
    # Its IP-Adapter attention reads the image query normed and unrotated too.
    assert set(rdi.PROCESSORS) - set(prologue.REWRITES) == {"FluxIPAdapterAttnProcessor"}


def test_a_source_the_rewrites_do_not_match_is_patched_for_rope_only(monkeypatch):
    model, inputs = dm.build("wan")
    want = run(model, inputs)
    monkeypatch.setattr(rdi, "_classes", {})
    statements, replacement = prologue.REWRITES["WanAttnProcessor"][1]
    changed = [prologue.REWRITES["WanAttnProcessor"][0],
               (statements.replace("*rotary_emb", "rotary_emb[0], rotary_emb[1]"), replacement)]
    monkeypatch.setitem(prologue.REWRITES, "WanAttnProcessor", changed)
    rdi.patch(model)
    assert not type(rdi._processors(model)[0])._rope_ext_fused
    torch.testing.assert_close(run(model, inputs), want, **TOLS[torch.float32])
    ops = rope_ops(model, inputs)
    assert "rope::apply" in ops and "rope::norm_rope" not in ops
    rdi.unpatch(model)


@pytest.mark.parametrize("how", ["module hook", "global hook"])
def test_a_hooked_norm_runs_as_diffusers_runs_it(how):
    model, inputs = dm.build("flux")
    want = run(model, inputs)
    rdi.patch(model)
    norm = model.transformer_blocks[0].attn.norm_q
    seen = []

    def hook(module, args, out):
        if module is norm:
            seen.append(args[0].shape)
    if how == "module hook":
        handle = norm.register_forward_hook(hook)
    else:
        handle = torch.nn.modules.module.register_module_forward_hook(hook)
    try:
        torch.testing.assert_close(run(model, inputs), want, **TOLS[torch.float32])
        assert seen == [(2, 16, 2, 16)]  # the image tokens, unfused (the hook ran)
        # the layers whose norms have no hook stay fused
        assert ("rope::norm_rope" in rope_ops(model, inputs)) == (how == "module hook")
    finally:
        handle.remove()


def test_a_hooked_norm_over_text_and_image_tokens_sees_them_at_once():
    """CogVideoX norms text and image tokens in one call and rotates the image tokens: a hooked
    norm (here one scaling each token differently) runs once over all of them, as in
    diffusers, not over each part."""
    model, inputs = dm.build("cogvideox")
    norm = model.transformer_blocks[0].attn1.norm_q
    seen = []

    def hook(module, args, out):
        seen.append(tuple(args[0].shape))
        return out * torch.linspace(0.5, 1.5, out.shape[2])[None, None, :, None]

    handle = norm.register_forward_hook(hook)
    try:
        want, calls = run(model, inputs), list(seen)
        seen.clear()
        rdi.patch(model)
        got = run(model, inputs)
        rdi.unpatch(model)
    finally:
        handle.remove()
    assert seen == calls and len(calls) == 1
    torch.testing.assert_close(got, want, **TOLS[torch.float32])


def test_flux_tables_that_are_not_one_row_per_joint_token():
    """FLUX's double-stream attention cuts the joint [text, image] tables into each part's rows:
    a one-row table broadcasts over every token, as in diffusers, and a table a row short of
    the text's and the image's tokens fails as it fails there (a cut once fitted the image part
    and broadcast its one row silently)."""
    model, _ = dm.build("flux")
    attn = model.transformer_blocks[0].attn
    image, text = torch.randn(2, 16, 32), torch.randn(2, 5, 32)
    one_row = model.pos_embed(torch.tensor([[0.0, 3.0, 4.0]]))
    short = model.pos_embed(torch.cat([torch.zeros(5, 3), torch.tensor([[0.0, 3.0, 4.0]])]))
    with torch.no_grad():
        want = attn(image, text, image_rotary_emb=one_row)
        with pytest.raises(RuntimeError):
            attn(image, text, image_rotary_emb=short)
        rdi.patch(model)
        try:
            got = attn(image, text, image_rotary_emb=one_row)
            with pytest.raises((RuntimeError, ValueError), match="broadcast|size"):
                attn(image, text, image_rotary_emb=short)
        finally:
            rdi.unpatch(model)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **TOLS[torch.float32])


def test_a_norm_class_whose_forward_was_replaced_is_not_fused(monkeypatch):
    """A forward replaced on a norm class (by a library, say) computes otherwise: not fused."""
    model, inputs = dm.build("flux")
    forward = torch.nn.RMSNorm.forward
    monkeypatch.setattr(torch.nn.RMSNorm, "forward", lambda self, x: forward(self, x) * 1.5)
    want = run(model, inputs)
    rdi.patch(model)
    got, ops = run(model, inputs), rope_ops(model, inputs)
    rdi.unpatch(model)
    torch.testing.assert_close(got, want, **TOLS[torch.float32])
    assert "rope::norm_rope" not in ops


def test_diffusers_layer_skip_hooks_find_the_patched_processors():
    """diffusers' layer skip (the guiders' SkipLayerGuidance and others) looks processors up by
    class: the patched ones are registered as their bases are."""
    from diffusers.hooks import LayerSkipConfig, apply_layer_skip

    outputs = []
    for patched in (False, True):
        torch.manual_seed(0)  # the same model and inputs twice
        model, inputs = dm.build("cogview4")
        if patched:
            rdi.patch(model)
        apply_layer_skip(model, LayerSkipConfig(indices=[0], fqn="transformer_blocks", skip_attention=False,
                                                skip_attention_scores=True, skip_ff=False))
        outputs.append(run(model, inputs))
    torch.testing.assert_close(outputs[1], outputs[0], **TOLS[torch.float32])


def test_cogview4_training_processor_packed_batches():
    """CogView4's training processor with batch_flag rotates (heads, tokens, head_dim) slices of
    packed samples, which diffusers' apply_rotary_emb broadcasts to 4 dims."""
    from diffusers.models.transformers.transformer_cogview4 import CogView4TrainingAttnProcessor

    model, _ = dm.build("cogview4")
    attn = model.transformer_blocks[0].attn1
    attn.set_processor(CogView4TrainingAttnProcessor())
    width, head_dim = attn.to_q.in_features, attn.to_q.out_features // attn.heads
    hs, ehs = torch.randn(2, 4, width), torch.randn(2, 3, width)
    angles = torch.rand(4, head_dim // 2) * 10
    tables = [(torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1))] * 2
    kw = dict(latent_attn_mask=torch.ones(2, 4, dtype=torch.int32),
              text_attn_mask=torch.ones(2, 3, dtype=torch.int32), batch_flag=torch.tensor([0, 0]),
              image_rotary_emb=tables)
    with torch.no_grad():
        want = attn.processor(attn, hs, ehs, **kw)
        rdi.patch(model)
        got = attn.processor(attn, hs, ehs, **kw)
    assert type(attn.processor).__module__ == rdi.__name__
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **TOLS[torch.float32])


class DoubledRMSNorm(torch.nn.RMSNorm):  # an RMSNorm's weight and eps, another forward
    def forward(self, x):
        return 2 * super().forward(x)


@pytest.mark.parametrize("replacement", [
    lambda n: torch.nn.Identity(),
    lambda n: torch.nn.LayerNorm(n, eps=1e-3),  # a form the op computes, but not norm_q's
    DoubledRMSNorm,
], ids=["identity", "layernorm", "rmsnorm-subclass"])
def test_a_norm_replaced_after_patch_is_not_fused(replacement):
    model, inputs = dm.build("flux")
    rdi.patch(model)
    attn = model.single_transformer_blocks[0].attn
    attn.norm_k = replacement(attn.head_dim)
    got = run(model, inputs)
    rdi.unpatch(model)
    torch.testing.assert_close(got, run(model, inputs), **TOLS[torch.float32])


def _norms():
    """(name, a q/k norm module over 16 dims, across: applied to 4 heads of 4 flattened)."""
    from diffusers.models import normalization as dn

    yield "torch-rms", torch.nn.RMSNorm(16, eps=1e-6), False
    yield "torch-rms-default-eps", torch.nn.RMSNorm(16), False
    yield "torch-rms-no-weight", torch.nn.RMSNorm(16, elementwise_affine=False), False
    yield "torch-rms-across-heads", torch.nn.RMSNorm(16, eps=1e-6), True
    yield "diffusers-rms", dn.RMSNorm(16, eps=1e-5), False
    yield "diffusers-rms-bias", dn.RMSNorm(16, eps=1e-5, bias=True), False
    yield "diffusers-rms-no-weight", dn.RMSNorm(16, eps=1e-5, elementwise_affine=False), False
    yield "mochi-rms", dn.MochiRMSNorm(16, eps=1e-5), False
    yield "layer", torch.nn.LayerNorm(16, eps=1e-6), False
    yield "layer-no-affine", torch.nn.LayerNorm(16, eps=1e-5, elementwise_affine=False, bias=False), False
    yield "fp32-layer", dn.FP32LayerNorm(16, eps=1e-6), False


@pytest.mark.parametrize("weights", [None, torch.float32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name,module,across", list(_norms()), ids=[n[0] for n in _norms()])
def test_each_norm_class_fused_as_it_computes(name, module, across, dtype, weights):
    """The op stands in for each norm class as the processors call it (Mochi's per-head tables),
    its weights (random) in x's dtype or float32; where it cannot (weights of another dtype than
    a module computing in x's dtype uses), the module runs."""
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p))
    module.to(weights or dtype)
    heads, head_dim = (4, 4) if across else (2, 16)
    q, k = (torch.randn(2, 5, heads, head_dim, dtype=dtype) * 3 for _ in range(2))
    tables = torch.rand(5, 1 if across else heads, head_dim // 2) * 6
    fns = prologue.norm_rope_across_heads if across else prologue.norm_rope
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        got = fns((module, module), q, k, rd.apply_rotary_emb_mochi, tables.cos(), tables.sin())
    fused = any(e.key == "rope::norm_rope" for e in prof.key_averages())
    in_x_dtype = prologue.NORM_CLASSES[type(module)][1]
    assert fused == (weights in (None, dtype) or not in_x_dtype or not list(module.parameters()))
    for x, y in zip((q, k), got):
        normed = module(x.flatten(-2)).unflatten(-1, x.shape[-2:]) if across else module(x)
        want = rd.apply_rotary_emb_mochi(normed, tables.cos(), tables.sin())
        assert y.dtype == want.dtype
        torch.testing.assert_close(y, want, **TOLS[dtype])


def test_a_verified_function_is_held_not_named_by_its_address(monkeypatch):
    """A probe that passed is recorded for the function it probed: a wrong function given
    later the same id (a freed function's address, as the ones made from source are freed) is
    probed, and refused, not taken for the verified one."""
    from diffusers.models import embeddings

    monkeypatch.setattr(rdi, "_verified", {})
    monkeypatch.setattr(rdi, "id", lambda obj: 1, raising=False)  # every function one address
    good = embeddings.apply_rotary_emb

    def wrong(x, freqs_cis, use_real=True, use_real_unbind_dim=-1, sequence_dim=2):
        return good(x, freqs_cis, use_real, use_real_unbind_dim, sequence_dim) * 2

    rdi._verify("apply_rotary_emb", good, "AProcessor")
    with pytest.raises(rdi.UnsupportedModelError, match="does not compute what"):
        rdi._verify("apply_rotary_emb", wrong, "AProcessor")
    rdi._verify("apply_rotary_emb", good, "AProcessor")
