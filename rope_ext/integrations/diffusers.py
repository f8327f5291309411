"""One-line patching of Hugging Face diffusers transformer models (diffusers 0.42):

    transformer = FluxTransformer2DModel.from_pretrained(...)   # or pipe.transformer
    rope_ext.integrations.diffusers.patch(transformer)    # attention RoPE on rope_ext's ops
    rope_ext.integrations.diffusers.unpatch(transformer)  # back to diffusers' own

What is patched: each attention processor of a class listed in PROCESSORS has its `__class__`
set to a subclass defined here under the same name (rope_ext.integrations.diffusers.<name>),
whose `__call__` is diffusers' own code with two changes: the RoPE function it calls (a global,
a local import, or a function defined inside `__call__`) is the rope_ext.compat.diffusers twin;
and its q/k norms run fused with that RoPE wherever the tokens they norm are rotated, one
rope.norm_rope call normalizing and rotating query and key (rope_ext.integrations._dit_prologue:
REWRITES, per processor, the few statements of diffusers' source that change and what replaces
them; tokens normed but never rotated keep diffusers' norm). The replacement decides at each call
whether the op computes what the norm modules do (an exact norm class it knows, no hooks, one
head's or one token's width, tables it takes in one pass); where not, the modules run and then
the twin, as with the RoPE alone. A processor whose installed source does not hold the statements
its rewrites expect gets the RoPE redirect only (its class's `_rope_ext_fused` tells which).
The subclass is built once per process from diffusers' source, compiled in the diffusers module's
globals, so everything else the processor does is diffusers' code of the installed version. The
instance keeps its state and identity; unpatch sets its class back. No wrapper, no global state
per model: a patched model deep-copies, pickles (torch.save of the whole model; loading needs
rope_ext importable) and compiles like an unpatched one.

Before a processor class is first patched, each replacement is compared with diffusers' function
on random inputs: a diffusers release whose RoPE differs is refused, not silently patched. A
model with no processor rope_ext knows raises UnsupportedModelError (a ValueError, and a
NotImplementedError) naming its class; nothing is changed then.
"""

import ast
import copy
import importlib
import inspect
import textwrap
import threading
import types

import torch

from ..compat import diffusers as dfx
from ._qk_norm import _statement_lists


class UnsupportedModelError(ValueError, NotImplementedError):
    """patch() was given a model whose attention RoPE rope_ext does not reproduce."""


_TRANSFORMERS = "diffusers.models.transformers."
_ATTENTION = "diffusers.models.attention_processor"

# processor class -> (its module, {name its __call__ uses for RoPE: the rope_ext.compat.diffusers
# function that replaces it}). The families: the models whose attention uses these processors.
PROCESSORS = {
    "FluxAttnProcessor": (_TRANSFORMERS + "transformer_flux", {"apply_rotary_emb": "apply_rotary_emb"}),
    "FluxIPAdapterAttnProcessor": (_TRANSFORMERS + "transformer_flux", {"apply_rotary_emb": "apply_rotary_emb"}),
    "Flux2AttnProcessor": (_TRANSFORMERS + "transformer_flux2", {"apply_rotary_emb": "apply_rotary_emb"}),
    "Flux2KVAttnProcessor": (_TRANSFORMERS + "transformer_flux2", {"apply_rotary_emb": "apply_rotary_emb"}),
    "Flux2ParallelSelfAttnProcessor": (_TRANSFORMERS + "transformer_flux2",
                                       {"apply_rotary_emb": "apply_rotary_emb"}),
    "Flux2KVParallelSelfAttnProcessor": (_TRANSFORMERS + "transformer_flux2",
                                         {"apply_rotary_emb": "apply_rotary_emb"}),
    "WanAttnProcessor": (_TRANSFORMERS + "transformer_wan", {"apply_rotary_emb": "apply_rotary_emb_wan"}),
    "HunyuanVideoAttnProcessor2_0": (_TRANSFORMERS + "transformer_hunyuan_video",
                                     {"apply_rotary_emb": "apply_rotary_emb"}),
    "QwenDoubleStreamAttnProcessor2_0": (_TRANSFORMERS + "transformer_qwenimage",
                                         {"apply_rotary_emb_qwen": "apply_rotary_emb_qwen"}),
    "LTXVideoAttnProcessor": (_TRANSFORMERS + "transformer_ltx", {"apply_rotary_emb": "apply_rotary_emb_ltx"}),
    "CogVideoXAttnProcessor2_0": (_ATTENTION, {"apply_rotary_emb": "apply_rotary_emb"}),
    "FusedCogVideoXAttnProcessor2_0": (_ATTENTION, {"apply_rotary_emb": "apply_rotary_emb"}),
    "Lumina2AttnProcessor2_0": (_TRANSFORMERS + "transformer_lumina2", {"apply_rotary_emb": "apply_rotary_emb"}),
    "CogView4AttnProcessor": (_TRANSFORMERS + "transformer_cogview4", {"apply_rotary_emb": "apply_rotary_emb"}),
    "CogView4TrainingAttnProcessor": (_TRANSFORMERS + "transformer_cogview4",
                                      {"apply_rotary_emb": "apply_rotary_emb"}),
    "MochiAttnProcessor2_0": (_ATTENTION, {"apply_rotary_emb": "apply_rotary_emb_mochi"}),
}

# The models tested tiny (tests/test_diffusers_patch.py), for the error message and the docs;
# any other model whose attention uses a processor of PROCESSORS is patched as well.
FAMILIES = {
    "FluxTransformer2DModel": "FLUX.1",
    "ChromaTransformer2DModel": "Chroma",
    "Flux2Transformer2DModel": "FLUX.2",
    "WanTransformer3DModel": "Wan 2.1 / 2.2",
    "HunyuanVideoTransformer3DModel": "HunyuanVideo",
    "QwenImageTransformer2DModel": "Qwen-Image",
    "LTXVideoTransformer3DModel": "LTX-Video",
    "CogVideoXTransformer3DModel": "CogVideoX",
    "Lumina2Transformer2DModel": "Lumina-Image 2.0",
    "CogView4Transformer2DModel": "CogView4",
    "MochiTransformer3DModel": "Mochi",
}

_GLOBAL_PREFIX = "_rope_ext_"
_lock = threading.RLock()
_classes = {}  # processor class name -> its rope_ext subclass
# (compat function name, id of diffusers' function) -> that function, whose probe passed (held:
# a function freed after its probe, as the ones made from source are, would leave its id to
# another)
_verified = {}


# ---- building a processor subclass from diffusers' source ----

class _Redirect(ast.NodeTransformer):
    """Inside one function: drops the local imports and nested defs of the RoPE names and
    renames their uses to the injected globals; records where each name came from."""

    def __init__(self, renames, module):
        self.renames, self.module = renames, module
        self.origins = {}  # RoPE name -> ("import", module, attr) | ("def", FunctionDef node)
        self.loads = set()
        self.depth = 0

    def visit_FunctionDef(self, node):
        if self.depth and node.name in self.renames:
            self.origins[node.name] = ("def", node)
            return ast.copy_location(ast.Pass(), node)
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1
        return node

    def visit_ImportFrom(self, node):
        kept = []
        for alias in node.names:
            bound = alias.asname or alias.name
            if bound in self.renames:
                package = self.module.__package__ if node.level else None
                target = importlib.import_module("." * node.level + (node.module or ""), package)
                self.origins[bound] = ("import", target, alias.name)
            else:
                kept.append(alias)
        if not kept:
            return ast.copy_location(ast.Pass(), node)
        node.names = kept
        return node

    def visit_Name(self, node):
        if node.id in self.renames:
            if not isinstance(node.ctx, ast.Load):
                raise _Refused(f"it assigns {node.id}")
            self.loads.add(node.id)
            node.id = self.renames[node.id]
        return node


class _Refused(Exception):
    pass


def _statements(source):
    return ast.parse(source).body


def _at_line(nodes, lineno):
    """nodes (parsed replacement statements) placed on diffusers' line `lineno`, for tracebacks."""
    for node in nodes:
        for sub in ast.walk(node):
            if "lineno" in sub._attributes:
                sub.lineno = sub.end_lineno = lineno
                sub.col_offset = sub.end_col_offset = 0
    return nodes


def _find(fdef, statements):
    """(the statement list, index) where the run `statements` (parsed) is in fdef, compared
    structurally (ast.dump: names, values and layout, not comments or formatting), when it is
    there exactly once; else None."""
    want = [ast.dump(stmt) for stmt in statements]
    found = []
    for stmts in _statement_lists(fdef):
        dumps = [ast.dump(stmt) for stmt in stmts]
        found += [(stmts, i) for i in range(len(stmts) - len(want) + 1) if dumps[i:i + len(want)] == want]
    return found[0] if len(found) == 1 else None


def _fused_definition(fdef, rewrites):
    """A copy of the __call__ definition fdef with each (diffusers' statements, replacement) of
    rewrites (rope_ext.integrations._dit_prologue.REWRITES) made, or None where the installed
    source does not hold each run of statements once, apart from the others."""
    fdef = copy.deepcopy(fdef)
    sites = []  # (the statement list, the run of it to replace, the replacement)
    for statements, replacement in rewrites:
        statements = _statements(statements)
        where = _find(fdef, statements)
        if where is None:
            return None
        stmts, i = where
        sites.append((stmts, stmts[i:i + len(statements)], replacement))
    inner = [id(node) for _, run, _ in sites for stmt in run for node in ast.walk(stmt)
             if isinstance(node, ast.stmt)]
    if len(inner) != len(set(inner)):
        return None  # one run inside another
    for stmts, run, replacement in sites:
        i = next(j for j, stmt in enumerate(stmts) if stmt is run[0])
        stmts[i:i + len(run)] = _at_line(_statements(replacement), run[0].lineno)
        if not stmts:
            stmts.append(_at_line([ast.Pass()], run[0].lineno)[0])
    return fdef


def _original_function(origin, module, name):
    """diffusers' own function a RoPE name stands for, to compare the replacement with."""
    if origin is None:
        return getattr(module, name)
    if origin[0] == "import":
        return getattr(origin[1], origin[2])
    namespace = dict(vars(module))
    node = ast.fix_missing_locations(ast.Module(body=[origin[1]], type_ignores=[]))
    exec(compile(node, inspect.getsourcefile(module) or "<diffusers>", "exec"), namespace)
    return namespace[name]


def _rewritten_call(base, module, names, rewrites=()):
    """base.__call__ recompiled from diffusers' source with `rewrites` made (where the source
    holds them all: see _fused_definition) and its RoPE names redirected; returns (function,
    {RoPE name: where it comes from, for _original_function}, whether the rewrites were made)."""
    fn = base.__dict__.get("__call__")
    if not isinstance(fn, types.FunctionType):
        raise _Refused("it defines no __call__ of its own")
    if fn.__globals__ is not vars(module) or fn.__code__.co_name != "__call__":
        # another library's __call__ put on diffusers' class: recompiled in diffusers' module,
        # its names would resolve to diffusers' own or to nothing
        raise _Refused(f"its __call__ is not diffusers' own (it is {fn.__module__}.{fn.__qualname__})")
    try:
        source = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError) as e:
        raise _Refused(f"its source is not available ({e})") from None
    tree = ast.parse(source)
    fdef = tree.body[0]
    if not isinstance(fdef, ast.FunctionDef) or fdef.decorator_list or fn.__code__.co_freevars:
        raise _Refused("its __call__ is decorated or a closure")
    fused = _fused_definition(fdef, rewrites) if rewrites else None
    if fused is not None:
        tree.body[0] = fdef = fused
    renames = {name: _GLOBAL_PREFIX + target for name, target in names.items()}
    redirect = _Redirect(renames, module)
    redirect.visit(fdef)
    missing = set(names) - redirect.loads
    if missing:
        raise _Refused(f"its __call__ does not call {', '.join(sorted(missing))}")
    ast.increment_lineno(tree, fn.__code__.co_firstlineno - 1)
    code = compile(ast.fix_missing_locations(tree), fn.__code__.co_filename, "exec")
    fcode = next(c for c in code.co_consts if isinstance(c, types.CodeType) and c.co_name == "__call__")
    new = types.FunctionType(fcode, vars(module), "__call__", fn.__defaults__)
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__annotations__ = dict(fn.__annotations__)
    new.__qualname__, new.__module__, new.__doc__ = fn.__qualname__, __name__, fn.__doc__
    origins = {name: redirect.origins.get(name) for name in names}
    return new, origins, fused is not None


def _diffusers_functions(base, module, names):
    """{RoPE name: diffusers' own function} that base.__call__ calls (what the benchmarks and
    tests compare the replacements with)."""
    _, origins, _ = _rewritten_call(base, module, names)
    return {name: _original_function(origins[name], module, name) for name in names}


def _processor_class(name):
    """The rope_ext subclass of diffusers' processor class `name`, built on first use, and
    again (checked as then) where diffusers' class or its __call__ has been replaced since; the
    RoPE functions its __call__ uses are checked on every use (another library may have replaced
    one since)."""
    with _lock:
        modname, names = PROCESSORS[name]
        module = importlib.import_module(modname)
        base = getattr(module, name)
        cls = _classes.get(name)
        if cls is not None and cls._rope_ext_base is base and \
                cls._rope_ext_call is base.__dict__.get("__call__"):
            for rope_name, target in names.items():
                origin = cls._rope_ext_origins[rope_name]
                if origin is None or origin[0] == "import":  # (one defined in __call__ is its own)
                    _verify(target, _original_function(origin, module, rope_name), name)
            return cls
        from . import _dit_prologue  # (imports diffusers)

        rewrites = _dit_prologue.REWRITES.get(name, ())
        try:
            call, origins, fused = _rewritten_call(base, module, names, rewrites)
        except _Refused as e:
            import diffusers

            raise UnsupportedModelError(
                f"rope_ext.integrations.diffusers: cannot patch {name} of diffusers "
                f"{diffusers.__version__}: {e}") from None
        for rope_name, target in names.items():
            _verify(target, _original_function(origins[rope_name], module, rope_name), name)
        # the globals the rewritten __call__ reads
        helpers = _dit_prologue.HELPERS if fused else {}
        for global_name, value in [*((t, getattr(dfx, t)) for t in names.values()), *helpers.items()]:
            setattr(module, _GLOBAL_PREFIX + global_name, value)
        what = "q/k norms and RoPE fused" if fused else "RoPE"
        cls = type(name, (base,), {
            "__call__": call,
            "__module__": __name__,
            "__qualname__": name,
            "__doc__": f"diffusers' {name} with its {what} on rope_ext's ops "
                       f"(rope_ext.integrations.diffusers.patch).",
            "_rope_ext_base": base,
            "_rope_ext_call": base.__dict__.get("__call__"),
            "_rope_ext_origins": origins,
            "_rope_ext_fused": fused,
        })
        _register_hook_metadata(cls, base)
        _classes[name] = cls
        return cls


def _register_hook_metadata(cls, base):
    """diffusers' hooks (layer skip, used by the SkipLayerGuidance, PerturbedAttentionGuidance
    and AutoGuidance guiders) look a processor up by its exact class: the subclass takes its
    base's entry."""
    try:
        from diffusers.hooks._helpers import AttentionProcessorRegistry
    except ImportError:  # a diffusers without these hooks
        return
    try:
        metadata = AttentionProcessorRegistry.get(base)
    except ValueError:  # (a processor diffusers' hooks do not know)
        return
    AttentionProcessorRegistry.register(cls, metadata)


def __getattr__(name):
    # Pickled patched models name their processors' classes here; they are built on demand.
    # (pickle needs the class its objects have, unchecked: patch checks it.)
    if name in PROCESSORS:
        return _classes.get(name) or _processor_class(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ---- the checks that diffusers' function computes what its replacement does ----

def _duplicated(angles, interleaved):
    if interleaved:
        return angles.repeat_interleave(2, dim=-1)
    return torch.cat((angles, angles), dim=-1)


def _probe_calls(target, g):
    """(args, kwargs) to call both functions with: every layout the replacement serves."""
    def randn(*shape):  # float32 whatever torch's default dtype is
        return torch.randn(*shape, generator=g, dtype=torch.float32, device="cpu")

    def ones(*shape):
        return torch.ones(*shape, dtype=torch.float32, device="cpu")

    if target == "apply_rotary_emb":
        calls = []
        for interleaved, unbind in ((True, -1), (False, -2)):
            ang = randn(5, 4) * 3
            cs = (_duplicated(ang.cos(), interleaved), _duplicated(ang.sin(), interleaved))
            calls.append(((randn(2, 3, 5, 8), cs), {"use_real_unbind_dim": unbind}))
            calls.append(((randn(2, 5, 3, 8), cs), {"use_real_unbind_dim": unbind, "sequence_dim": 1}))
        calls.append(((randn(2, 5, 3, 8), torch.polar(ones(2, 5, 4), randn(2, 5, 4))),
                      {"use_real": False}))
        return calls
    if target == "apply_rotary_emb_qwen":
        ang = randn(3, 4) * 3
        return [((randn(2, 5, 3, 8), torch.polar(ones(5, 4), randn(5, 4))), {"use_real": False}),
                ((randn(2, 5, 3, 8), (_duplicated(ang.cos(), True), _duplicated(ang.sin(), True))), {})]
    if target == "apply_rotary_emb_ltx":
        ang = randn(2, 5, 8) * 3
        return [((randn(2, 5, 16), (_duplicated(ang.cos(), True), _duplicated(ang.sin(), True))), {})]
    if target == "apply_rotary_emb_wan":
        return [((randn(2, 5, 3, 8), randn(1, 5, 1, 8), randn(1, 5, 1, 8)), {})]
    if target == "apply_rotary_emb_mochi":
        return [((randn(2, 5, 3, 8), randn(5, 3, 4), randn(5, 3, 4)), {})]
    raise KeyError(target)


def _verify(target, original, processor):
    key = (target, id(original))
    if _verified.get(key) is original:
        return
    replacement = getattr(dfx, target)
    # On the CPU whatever torch's defaults are (a model built under set_default_device).
    with torch.no_grad(), torch.device("cpu"):
        for args, kwargs in _probe_calls(target, torch.Generator().manual_seed(0)):
            want, got = original(*args, **kwargs), replacement(*args, **kwargs)
            if got.shape != want.shape or not torch.allclose(got, want, rtol=1e-5, atol=1e-5):
                import diffusers

                raise UnsupportedModelError(
                    f"rope_ext.integrations.diffusers: the RoPE function {processor} calls in "
                    f"diffusers {diffusers.__version__} does not compute what "
                    f"rope_ext.compat.diffusers.{target} does; refusing to patch. Either it was "
                    f"replaced or wrapped after diffusers defined it, or this release computes "
                    f"otherwise (please report that)")
    _verified[key] = original


# ---- patching a model ----

def _processors(model):
    """The distinct attention processors of `model`'s modules, in module order."""
    seen, out = set(), []
    for m in model.modules():
        # A plain-object processor is an attribute; an nn.Module one (IP-Adapter) a submodule.
        p = m.__dict__.get("processor", m._modules.get("processor"))
        if p is not None and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def _is_ours(proc):
    cls = type(proc)
    return cls.__module__ == __name__ and "_rope_ext_base" in cls.__dict__


def _patchable_name(proc):
    """The PROCESSORS name of proc's class when it is diffusers' class of that name, else None."""
    cls = type(proc)
    entry = PROCESSORS.get(cls.__name__)
    if entry is None or cls.__module__ != entry[0]:
        return None
    return cls.__name__


def _processor_label(cls):
    """cls's name in a refusal; with its module where a listed processor has that name elsewhere
    (ChronoEdit's and Wan-Animate's copies of WanAttnProcessor are not diffusers' Wan class)."""
    entry = PROCESSORS.get(cls.__name__)
    if entry is None or cls.__module__ == entry[0]:
        return cls.__name__
    return f"{cls.__module__}.{cls.__name__}, not the listed {entry[0]}.{cls.__name__}"


def _models(obj, caller):
    """The models behind `obj`: obj itself (a torch.nn.Module), or the nn.Module components of
    a diffusers pipeline (its transformer, and Wan 2.2's transformer_2)."""
    if isinstance(obj, torch.nn.Module):
        return [obj]
    components = getattr(obj, "components", None)
    if isinstance(components, dict):
        return [m for m in components.values() if isinstance(m, torch.nn.Module)]
    raise UnsupportedModelError(f"rope_ext.integrations.diffusers.{caller}: expected a torch.nn.Module "
                                f"or a diffusers pipeline, got {type(obj).__name__}")


def patch(model):
    """Routes the attention RoPE of `model` (a diffusers transformer such as pipe.transformer, or
    a pipeline: each of its components that can be) through rope_ext's ops; returns `model`.
    Patching a patched model does nothing more. Processors shared with another model are patched
    for it too (they are one object). Raises UnsupportedModelError, changing nothing, when no
    attention processor is one rope_ext reproduces."""
    processors = [p for m in _models(model, "patch") for p in _processors(m)]
    targets = [(p, _patchable_name(p)) for p in processors]
    targets = [(p, name) for p, name in targets if name is not None]
    if not targets and not any(_is_ours(p) for p in processors):
        found = sorted({_processor_label(type(p)) for p in processors}) or ["none"]
        raise UnsupportedModelError(
            f"rope_ext.integrations.diffusers.patch: cannot patch {type(model).__name__}: none of "
            f"its attention processors ({', '.join(found)}) is one whose RoPE rope_ext reproduces. "
            f"Supported models: {', '.join(sorted(FAMILIES))} (processors: "
            f"{', '.join(sorted(PROCESSORS))})")
    classes = {name: _processor_class(name) for _, name in targets}  # may raise: nothing set yet
    for p, name in targets:
        p.__class__ = classes[name]
    return model


def unpatch(model):
    """Undoes patch(model): every processor gets diffusers' class back (the same object, so the
    model computes exactly what it did before patch). Returns `model`; a model that is not
    patched is returned unchanged."""
    for m in _models(model, "unpatch"):
        for p in _processors(m):
            if _is_ours(p):
                p.__class__ = type(p)._rope_ext_base
    return model


def is_patched(model):
    """Whether any attention processor of `model` (or of a pipeline's components) runs on
    rope_ext."""
    return any(_is_ours(p) for m in _models(model, "is_patched") for p in _processors(m))
