"""One-line patching of Hugging Face transformers models, the convention Liger-Kernel made
popular:

    model = AutoModelForCausalLM.from_pretrained(...)
    rope_ext.integrations.transformers.patch(model)     # RoPE now runs on rope_ext's ops
    rope_ext.integrations.transformers.unpatch(model)   # back to transformers' code

What is patched: the RoPE function the family's attention modules call (the modeling module's
`apply_rotary_pos_emb`, Qwen2-VL's `apply_multimodal_rotary_pos_emb` and vision
`apply_rotary_pos_emb_vision`) is replaced by its rope_ext.compat.transformers twin, for this
model only: its attention modules' `forward` (an instance attribute, removed by unpatch) marks
the calls as theirs, and the module-level function, while any model of that family is patched,
routes those calls to rope_ext and every other call to transformers' own function. Before the
first patch of a family, the replacement is checked against transformers' function on random
inputs, so a transformers release that changes the function is refused, not silently patched.
A family not listed in FAMILIES raises UnsupportedModelError (a ValueError, and a
NotImplementedError).
"""

import contextvars
import functools
import importlib
import inspect
import threading
import weakref

import torch

from ..compat import transformers as hf

_CALLER_PATCHED = contextvars.ContextVar("rope_ext_patched_attention", default=False)


class UnsupportedModelError(ValueError, NotImplementedError):
    """patch() was given a model whose RoPE code rope_ext does not reproduce."""


# ---- the checks that transformers' function computes what its replacement does ----

def _generator():
    return torch.Generator().manual_seed(0)


def _duplicated(angles):
    return torch.cat((angles, angles), dim=-1)


def _same(a, b):
    return all(torch.allclose(x, y, rtol=1e-10, atol=1e-10) for x, y in zip(a, b))


def _probe_rotate_half(original, replacement):
    g = _generator()
    q = torch.randn(2, 3, 4, 8, generator=g, dtype=torch.float64)
    k = torch.randn(2, 1, 4, 8, generator=g, dtype=torch.float64)
    for rot in (8, 4):  # full and partial rotary (versions without partial rotary raise)
        emb = _duplicated(torch.randn(2, 4, rot // 2, generator=g, dtype=torch.float64) * 3)
        try:
            want = original(q, k, emb.cos(), emb.sin())
        except RuntimeError:
            if rot == 8:
                raise
            continue
        if not _same(replacement(q, k, emb.cos(), emb.sin()), want):
            return False
    return True


def _probe_gptj(original, replacement):
    g = _generator()
    x = torch.randn(2, 4, 3, 8, generator=g, dtype=torch.float64)
    ang = torch.randn(2, 4, 4, generator=g, dtype=torch.float64) * 3
    return _same([replacement(x, ang.sin(), ang.cos())], [original(x, ang.sin(), ang.cos())])


def _probe_mrope(original, replacement):
    g = _generator()
    q = torch.randn(2, 3, 4, 16, generator=g, dtype=torch.float64)
    k = torch.randn(2, 1, 4, 16, generator=g, dtype=torch.float64)
    emb = _duplicated(torch.randn(3, 2, 4, 8, generator=g, dtype=torch.float64) * 3)
    section = [2, 3, 3]
    return _same(replacement(q, k, emb.cos(), emb.sin(), section),
                 original(q, k, emb.cos(), emb.sin(), section))


def _probe_vision(original, replacement):
    g = _generator()
    q = torch.randn(5, 2, 8, generator=g, dtype=torch.float32)
    k = torch.randn(5, 2, 8, generator=g, dtype=torch.float32)
    emb = _duplicated(torch.randn(5, 4, generator=g) * 3)
    got, want = replacement(q, k, emb.cos(), emb.sin()), original(q, k, emb.cos(), emb.sin())
    return all(torch.allclose(x, y, rtol=1e-5, atol=1e-5) for x, y in zip(got, want))


_ROTATE_HALF = {"apply_rotary_pos_emb": (hf.apply_rotary_pos_emb, _probe_rotate_half)}
_GPTJ = {"apply_rotary_pos_emb": (hf.apply_rotary_pos_emb_gptj, _probe_gptj)}
_QWEN_VL = {
    "apply_multimodal_rotary_pos_emb": (hf.apply_multimodal_rotary_pos_emb, _probe_mrope),
    "apply_rotary_pos_emb_vision": (hf.apply_rotary_pos_emb_vision, _probe_vision),
}
# Qwen3-VL's rotary module lays the MRoPE sections out interleaved (T,H,W,...) itself; its
# attention then applies the resulting full-width tables like any rotate_half model.
_QWEN3_VL = {
    "apply_rotary_pos_emb": (hf.apply_rotary_pos_emb, _probe_rotate_half),
    "apply_rotary_pos_emb_vision": (hf.apply_rotary_pos_emb_vision, _probe_vision),
}

# model_type -> (modeling module under transformers.models, the functions patched there).
# Each family is tested on a tiny model (tests/test_integrations.py).
FAMILIES = {
    "llama": ("llama.modeling_llama", _ROTATE_HALF),
    "mistral": ("mistral.modeling_mistral", _ROTATE_HALF),
    "mixtral": ("mixtral.modeling_mixtral", _ROTATE_HALF),
    "qwen2": ("qwen2.modeling_qwen2", _ROTATE_HALF),
    "qwen2_moe": ("qwen2_moe.modeling_qwen2_moe", _ROTATE_HALF),
    "qwen3": ("qwen3.modeling_qwen3", _ROTATE_HALF),
    "qwen3_moe": ("qwen3_moe.modeling_qwen3_moe", _ROTATE_HALF),
    "gemma": ("gemma.modeling_gemma", _ROTATE_HALF),
    "gemma2": ("gemma2.modeling_gemma2", _ROTATE_HALF),
    "phi3": ("phi3.modeling_phi3", _ROTATE_HALF),
    "phi": ("phi.modeling_phi", _ROTATE_HALF),
    "gpt_neox": ("gpt_neox.modeling_gpt_neox", _ROTATE_HALF),
    "stablelm": ("stablelm.modeling_stablelm", _ROTATE_HALF),
    "olmo2": ("olmo2.modeling_olmo2", _ROTATE_HALF),
    "granite": ("granite.modeling_granite", _ROTATE_HALF),
    "starcoder2": ("starcoder2.modeling_starcoder2", _ROTATE_HALF),
    "gptj": ("gptj.modeling_gptj", _GPTJ),
    "qwen2_vl": ("qwen2_vl.modeling_qwen2_vl", _QWEN_VL),
    "qwen2_vl_text": ("qwen2_vl.modeling_qwen2_vl", _QWEN_VL),
    "qwen2_5_vl": ("qwen2_5_vl.modeling_qwen2_5_vl", _QWEN_VL),
    "qwen2_5_vl_text": ("qwen2_5_vl.modeling_qwen2_5_vl", _QWEN_VL),
    "qwen3_vl": ("qwen3_vl.modeling_qwen3_vl", _QWEN3_VL),
    "qwen3_vl_text": ("qwen3_vl.modeling_qwen3_vl", _QWEN3_VL),
}


# ---- the module-level dispatchers, installed while a model of the family is patched ----

_lock = threading.Lock()
_installed = {}  # (module name, function name) -> [dispatcher, original, number of patched models]
_verified = set()  # (module name, function name, id(original)) whose probe passed
_patches = weakref.WeakKeyDictionary()  # patched model -> its _Patch


def _dispatcher(original, replacement):
    @functools.wraps(original)
    def dispatch(*args, **kwargs):
        if _CALLER_PATCHED.get():
            return replacement(*args, **kwargs)
        return original(*args, **kwargs)

    return dispatch


def _acquire(module, name, replacement):
    key = (module.__name__, name)
    entry = _installed.get(key)
    if entry is None:
        original = getattr(module, name)
        entry = _installed[key] = [_dispatcher(original, replacement), original, 0]
        setattr(module, name, entry[0])
    entry[2] += 1


def _release(keys):
    with _lock:
        for key in keys:
            entry = _installed[key]
            entry[2] -= 1
            if entry[2] == 0:
                setattr(importlib.import_module(key[0]), key[1], entry[1])
                del _installed[key]


def _original(module, name):
    entry = _installed.get((module.__name__, name))
    return getattr(module, name) if entry is None else entry[1]


def _verify(module, name, replacement, probe):
    original = _original(module, name)
    key = (module.__name__, name, id(original))
    if key in _verified:
        return
    with torch.no_grad():
        ok = probe(original, replacement)
    if not ok:
        import transformers

        raise RuntimeError(
            f"rope_ext.integrations.transformers.patch: {module.__name__}.{name} of transformers "
            f"{transformers.__version__} does not compute what its rope_ext replacement does; "
            "refusing to patch (please report it)")
    _verified.add(key)


# ---- the attention modules ----

def _marking(forward):
    @functools.wraps(forward)
    def marked_forward(*args, **kwargs):
        token = _CALLER_PATCHED.set(True)
        try:
            return forward(*args, **kwargs)
        finally:
            _CALLER_PATCHED.reset(token)

    return marked_forward


def _calls(module_obj, modeling, names):
    """Whether module_obj's class forward is code of `modeling` that calls one of `names`."""
    fn = inspect.unwrap(type(module_obj).forward)
    code = getattr(fn, "__code__", None)
    return (code is not None and getattr(fn, "__globals__", None) is vars(modeling)
            and any(n in code.co_names for n in names))


class _Patch:
    def __init__(self, modules):
        self.modules = modules  # (module, its previous instance `forward` or None)
        self.finalizer = None


def _model_type(model):
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type is None:
        raise UnsupportedModelError(
            f"rope_ext.integrations.transformers.patch: {type(model).__name__} has no "
            "config.model_type; pass a transformers PreTrainedModel")
    return model_type


def patch(model):
    """Routes `model`'s RoPE through rope_ext's ops; returns the model. Other models, patched or
    not, are unaffected. Patching a patched model does nothing. Raises UnsupportedModelError (a
    ValueError) for a family rope_ext cannot patch (see FAMILIES)."""
    if model in _patches:
        return model
    model_type = _model_type(model)
    if model_type not in FAMILIES:
        raise UnsupportedModelError(
            f"rope_ext.integrations.transformers.patch: cannot patch {type(model).__name__} "
            f"(model_type {model_type!r}): its RoPE code is not one rope_ext reproduces. Supported "
            f"model types: {', '.join(sorted(FAMILIES))}")
    path, functions = FAMILIES[model_type]
    modeling = importlib.import_module(f"transformers.models.{path}")
    for name, (replacement, probe) in functions.items():
        _verify(modeling, name, replacement, probe)
    targets = [m for m in model.modules() if _calls(m, modeling, functions)]
    if not targets:
        raise UnsupportedModelError(
            f"rope_ext.integrations.transformers.patch: found no attention module of "
            f"{type(model).__name__} calling {' or '.join(functions)} of {modeling.__name__}; "
            "nothing to patch")
    keys = [(modeling.__name__, name) for name in functions]
    with _lock:
        for name, (replacement, _) in functions.items():
            _acquire(modeling, name, replacement)
    record = _Patch([])
    for m in targets:
        record.modules.append((m, m.__dict__.get("forward")))
        m.forward = _marking(m.forward)
    # A patched model dropped without unpatch still releases the dispatchers.
    record.finalizer = weakref.finalize(model, _release, keys)
    _patches[model] = record
    return model


def unpatch(model):
    """Undoes patch(model): its attention modules get their own forward back, and transformers'
    functions are restored once no model of the family is patched. Returns the model; a model
    that is not patched is returned unchanged."""
    record = _patches.pop(model, None)
    if record is None:
        return model
    for m, previous in record.modules:
        if previous is None:
            del m.forward
        else:
            m.forward = previous
    record.finalizer()  # releases the dispatchers now, once
    return model


def is_patched(model):
    return model in _patches
