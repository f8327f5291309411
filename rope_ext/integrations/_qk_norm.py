"""Patched forwards that fuse per-head QK-RMSNorm with RoPE (Qwen3, Qwen3-MoE, Qwen3-Next and
3.5, Gemma 3 and 4, GLM-4 MoE, ...): transformers' attention forward with its `self.q_norm(x)` and
`self.k_norm(x)` calls dropped and its RoPE call replaced by rope_ext.qk_norm.qk_norm_rope, which
normalizes and rotates q and k in one pass.

A vision tower's attention (GLM-OCR) is fused the same way around its vision RoPE function
(qk_norm_rope_vision_call). Gemma 3n and 4 norm and rotate q and k in separate calls of a
one-tensor RoPE function: there each `x = self.q_norm(x)` (or k_norm) followed in the same block
by `x = rope(x, ...)` becomes one call of the op on x (_one_tensor_sites, norm_rope_one_call).

Otherwise the rewrite is made on the forward's source (ast), only when it has the one shape this
fusion is right for: a `self.q_norm(...)` and a `self.k_norm(...)` call, each the value (through
view / transpose / reshape / contiguous only) last assigned to the name passed as q or k to the
one RoPE call, read by nothing else before it (its .shape aside), that call assigning its results
to the same two names (other norm calls, such as T5Gemma 2's k_norm of its cross-attention keys,
are left as they are), the norms under the same `if` conditions (passed to the fused call, which
falls back to the plain rotation when they are false). EXAONE 4 and its kin norm on every layer
but rotate on some only: `if rotary: q, k = rope(q, k, ...)` after unconditional norms becomes
the fused call in that branch and the two norms in an added else branch (_rope_branch).
Anything else is not rewritten, and the module is patched for RoPE only. The norm modules are
checked on random inputs against the two RMSNorm forms the op computes (x * w and Gemma's
x * (1 + w)), per norm class.
"""

import ast
import copy
import inspect
import textwrap
import threading
import types
import warnings
import weakref

import torch
from torch.nn.modules import module as _module_hooks

from .. import qk_norm as _api
from .._call import without_autograd_if_unneeded
from .._compiling import compiling
from ..compat import transformers as hf

FUSED_NAME = "_rope_ext_qk_norm_rope"
FUSED_ONE_NAME = "_rope_ext_norm_rope_one"  # the one-tensor form (Gemma 3n, Gemma 4)
FUSED_VISION_NAME = "_rope_ext_qk_norm_rope_vision"  # vision towers (GLM-OCR)
FUSED_IN_INPUT_DTYPE_NAME = "_rope_ext_qk_norm_rope_in_input_dtype"  # Olmo 2's and LFM3's form
# The kinds of fusion (a patched class's `fused`): q and k in one RoPE call (True; or
# IN_INPUT_DTYPE, a RoPE function that returns q's and k's dtypes), each in its own call of a
# one-tensor RoPE function, or q and k of a vision tower (seq, heads, head_dim).
ONE_TENSOR = "one tensor"
VISION = "vision"
IN_INPUT_DTYPE = "in input dtype"
_LAYOUT_METHODS = {"transpose", "view", "reshape", "contiguous"}
_NORMS = ("q_norm", "k_norm")  # the usual names; a forward's own are found by norm_names
_EPS_ATTRS = ("variance_epsilon", "eps")
_METADATA = {"shape", "dtype", "device", "ndim"}

# norm class -> (its forward when probed, its form: (unit_offset, eps attribute name, whether
# the output's dtype is the promotion of x's and the weight's) or None: not an RMSNorm the op
# computes, the names and the values of the probe instance's settings); a forward replaced on
# the class since is probed afresh. Weak: a class made per instance (parametrize's) goes with it.
_norm_forms = weakref.WeakKeyDictionary()
# class -> {(its forward, an instance's settings): that instance's form}
_instance_forms = weakref.WeakKeyDictionary()
_MISSING = object()


def qk_norm_api():
    return _api.qk_norm_rope


def _is_self_norm(node, norms):
    """Whether node is `self.<name>(x)` for a name in norms (any name: norms None)."""
    f = node.func if isinstance(node, ast.Call) else None
    return (isinstance(f, ast.Attribute) and (norms is None or f.attr in norms)
            and isinstance(f.value, ast.Name) and f.value.id == "self" and len(node.args) == 1
            and not node.keywords)


def _norm_inside(value, norms):
    """The self.<norm> call (a name in norms, any: None) that `value` is, through layout-only
    method calls."""
    while isinstance(value, ast.Call):
        if _is_self_norm(value, norms):
            return value
        f = value.func
        if not (isinstance(f, ast.Attribute) and f.attr in _LAYOUT_METHODS):
            return None
        value = f.value
    return None


def _layout_of(value):
    """The name `value` is a layout-only view of (x.transpose(1, 2), ...), else None."""
    if not isinstance(value, ast.Call):
        return None
    while isinstance(value, ast.Call):
        f = value.func
        if not (isinstance(f, ast.Attribute) and f.attr in _LAYOUT_METHODS):
            return None
        value = f.value
    return value.id if isinstance(value, ast.Name) else None


def _assigned_names(node):
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, (ast.Tuple, ast.List)):
        return [n for e in node.elts for n in _assigned_names(e)]
    return []


class _Scan(ast.NodeVisitor):
    """Finds the norm assignments, the RoPE call and every assignment of the forward."""

    def __init__(self, rope_name, norms):
        self.rope_name, self.norms = rope_name, norms
        self.conditions = []
        self.norm_calls = []  # every call of a norm in norms
        # norm name -> [(target name, first and last line, conditions, the norm call)]
        self.norm_assigns = {}
        self.rope_calls = []  # (call, conditions)
        self.assigns = []  # (name, first and last line, whether a relayout of itself)
        self.reads = []  # (name, line)

    def visit_If(self, node):
        self.visit(node.test)
        self.conditions.append(node.test)
        for stmt in node.body:
            self.visit(stmt)
        self.conditions.pop()
        self.conditions.append(None)  # an else branch: not a condition we pass on
        for stmt in node.orelse:
            self.visit(stmt)
        self.conditions.pop()

    def visit_Assign(self, node):
        relayout = (len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                    and _layout_of(node.value) == node.targets[0].id)
        for target in node.targets:
            for name in _assigned_names(target):
                self.assigns.append((name, (node.lineno, node.end_lineno), relayout))
        norm = _norm_inside(node.value, self.norms)
        if norm is not None and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            self.norm_assigns.setdefault(norm.func.attr, []).append(
                (node.targets[0].id, (node.lineno, node.end_lineno), list(self.conditions), norm))
        self.generic_visit(node)

    def visit_Attribute(self, node):
        if not (isinstance(node.value, ast.Name) and node.attr in _METADATA):
            self.generic_visit(node)  # q.shape and its kin read no values

    def visit_Name(self, node):
        if isinstance(node.ctx, ast.Load):
            self.reads.append((node.id, node.lineno))

    def visit_Call(self, node):
        if _is_self_norm(node, self.norms):
            self.norm_calls.append(node)
        if isinstance(node.func, ast.Name) and node.func.id == self.rope_name:
            self.rope_calls.append((node, list(self.conditions)))
        self.generic_visit(node)


_SIMPLE_STATEMENTS = (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Expr, ast.Return)


def _statement_lists(node):
    """Every list of statements in node (bodies, else branches, handlers), nested ones too."""
    for child in ast.walk(node):
        for field in ("body", "orelse", "finalbody"):
            stmts = getattr(child, field, None)
            if isinstance(stmts, list) and stmts and isinstance(stmts[0], ast.stmt):
                yield stmts


def _one_tensor_sites(fdef, rope_name, norms):
    """For a forward that norms and rotates q and k in separate calls (Gemma 3n and 4:
    `x = self.q_norm(x)`, then `x = rope(x, cos, sin, ...)` in the same block, x reassigned in
    between in layout only): {rope call: norm call}, covering every RoPE call and every norm
    call of the forward; None when the forward is not of that shape, or reads a normed tensor
    before its RoPE call (the reader would see it unnormed: the norm moves into that call)."""
    sites = {}
    for stmts in _statement_lists(fdef):
        pending = {}  # name -> the norm call last assigned to it in this block
        for stmt in stmts:
            if not isinstance(stmt, _SIMPLE_STATEMENTS):
                pending.clear()  # a nested block or control flow: nothing carried past it
                continue
            relayout = (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1
                        and isinstance(stmt.targets[0], ast.Name)
                        and _layout_of(stmt.value) == stmt.targets[0].id)
            calls = [node for node in ast.walk(stmt)
                     if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                     and node.func.id == rope_name and node.args
                     and isinstance(node.args[0], ast.Name) and node.args[0].id in pending]
            # A normed name is read by its RoPE call, which assigns the result back to it (else
            # the name would go on holding the tensor unnormed), by its own relayout, and for
            # its metadata (k.shape): by nothing else.
            if norms and any(not (isinstance(stmt, ast.Assign) and stmt.value is call
                                  and len(stmt.targets) == 1
                                  and isinstance(stmt.targets[0], ast.Name)
                                  and stmt.targets[0].id == call.args[0].id) for call in calls):
                return None
            allowed = {id(call.args[0]) for call in calls}
            allowed.update(id(n.value) for n in ast.walk(stmt)
                           if isinstance(n, ast.Attribute) and n.attr in _METADATA)
            for node in ast.walk(stmt) if norms else ():
                if (isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)
                        and node.id in pending and id(node) not in allowed
                        and not (relayout and node.id == stmt.targets[0].id)):
                    return None
            for call in calls:
                if call.args[0].id in pending:
                    sites[call] = pending.pop(call.args[0].id)
            if isinstance(stmt, ast.Assign):
                norm = _norm_inside(stmt.value, norms)
                for target in stmt.targets:
                    for name in _assigned_names(target):
                        if norm is not None and isinstance(target, ast.Name):
                            pending[name] = norm
                        elif not relayout:
                            pending.pop(name, None)
            elif not isinstance(stmt, ast.Expr):
                pending.clear()  # an augmented or annotated assignment, a return
    if norms is None:
        return sites
    scan = _Scan(rope_name, norms)
    scan.visit(fdef)
    rope_calls = {call for call, _ in scan.rope_calls}
    if (not sites or set(sites) != rope_calls
            or {id(n) for n in sites.values()} != {id(n) for n in scan.norm_calls}):
        return None
    return sites


class _RewriteOne(ast.NodeTransformer):
    def __init__(self, sites):
        self.sites = sites
        self.norms = {id(n) for n in sites.values()}

    def visit_Call(self, node):
        site = self.sites.get(node)
        self.generic_visit(node)
        if id(node) in self.norms:
            return node.args[0]
        if site is not None:
            node.func = ast.Name(FUSED_ONE_NAME, ast.Load())
            node.args = [ast.Name("self", ast.Load()), ast.Constant(site.func.attr)] + node.args
        return node


class _Rewrite(ast.NodeTransformer):
    def __init__(self, rope_call, normed, norms, fused_name, names):
        self.rope_call, self.normed, self.norms = rope_call, normed, {id(n) for n in norms}
        self.fused_name, self.names = fused_name, names

    def visit_Call(self, node):
        self.generic_visit(node)
        if id(node) in self.norms:
            return node.args[0]
        if node is self.rope_call:
            node.func = ast.Name(self.fused_name, ast.Load())
            node.args = [ast.Name("self", ast.Load())] + node.args
            node.keywords = node.keywords + [
                ast.keyword("_normed", self.normed),
                ast.keyword("_norms", ast.Tuple([ast.Constant(n) for n in self.names], ast.Load()))]
        return node


def _flows_unchanged(scan, name, lines, end):
    """Whether `name`, assigned on `lines` (first, last), reaches line `end` changed in layout
    only and read by nothing else on the way (what reads it would see it unnormed)."""
    start = lines[1]
    if not start < end:
        return False
    relayouts = []
    for n, (first, last), relayout in scan.assigns:
        if n == name and start < first < end:
            if not relayout:
                return False
            relayouts.append((first, last))
    return all(any(first <= line <= last for first, last in relayouts)
               for n, line in scan.reads if n == name and start < line < end)


def definition(fn):
    """fn's definition (ast.FunctionDef), or None where its source cannot be read."""
    try:
        source = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):
        return None
    tree = ast.parse(source)
    fdef = tree.body[0] if tree.body else None
    if not isinstance(fdef, (ast.FunctionDef, ast.AsyncFunctionDef)) or fdef.name != fn.__name__:
        return None
    return fdef


def _the_rope_call(scan, fdef):
    """(the one RoPE call, its conditions) when it is `q, k = rope(q, k, ...)`, else None."""
    if len(scan.rope_calls) != 1:
        return None
    rope_call, conditions = scan.rope_calls[0]
    if len(rope_call.args) < 2 or not _reassigns(fdef, rope_call):
        return None
    return rope_call, conditions


def norm_names(fn, rope_name, kind=True):
    """The names of the modules whose calls feed the RoPE call(s) of forward `fn`, found by what
    the forward does, not by their names (Qwen3's q_norm / k_norm, LFM2's q_layernorm /
    k_layernorm): (q's, k's) for a two-tensor RoPE call, else the norm of each one-tensor call
    in order. What they are (an RMSNorm per head, or a projection) is for fusable_norms to
    tell. None when the forward is not of a shape that could be fused."""
    fdef = definition(fn)
    if fdef is None:
        return None
    if kind == ONE_TENSOR:
        sites = _one_tensor_sites(fdef, rope_name, None)
        names = list(dict.fromkeys(norm.func.attr for norm in (sites or {}).values()))
        return tuple(names) or None
    scan = _Scan(rope_name, None)
    scan.visit(fdef)
    found = _the_rope_call(scan, fdef)
    if found is None:
        return None
    names = []
    for arg in found[0].args[:2]:
        assigned = [(lines, attr) for attr, assigns in scan.norm_assigns.items()
                    for target, lines, _, _ in assigns
                    if isinstance(arg, ast.Name) and target == arg.id
                    and lines[1] < found[0].lineno]
        if not assigned:
            return None
        names.append(max(assigned)[1])
    return tuple(names)


def rewritten_forward(fn, rope_name, kind=True, norms=_NORMS):
    """A function like `fn` (a plain function: the forward, unwrapped) with the norm modules
    `norms` (q's and k's; see norm_names) fused into its RoPE call, or None when its code is not
    of the shape described above. kind (see ONE_TENSOR, VISION): the fused call made;
    ONE_TENSOR: the RoPE function takes one tensor, and each norm is fused into its own call of
    it."""
    fdef = definition(fn)
    if fdef is None:
        return None
    if kind == ONE_TENSOR:
        sites = _one_tensor_sites(fdef, rope_name, norms)
        if sites is None:
            return None
        return _compiled_like(fn, _RewriteOne(sites).visit(fdef))
    if len(norms) != 2:
        return None
    scan = _Scan(rope_name, norms)
    scan.visit(fdef)
    found = _the_rope_call(scan, fdef)
    if found is None:
        return None
    rope_call, rope_conditions = found
    branch = None
    if rope_conditions:  # `if no_pe: ...` around the RoPE call alone (EXAONE 4, AFMoE)
        branch = _rope_branch(fdef, rope_call, rope_conditions)
        if branch is None:
            return None
    conditions, fused = None, []
    for norm, arg in zip(norms, rope_call.args[:2]):
        # The last norm call assigned to the name rotated (another, such as T5Gemma 2's k_norm
        # of the cross-attention keys, stays as it is).
        found = [f for f in scan.norm_assigns.get(norm, [])
                 if f[0] == arg.id and f[1][1] < rope_call.lineno]
        if not found:
            return None
        target, lines, conds, call = max(found, key=lambda f: f[1])
        if not _flows_unchanged(scan, target, lines, rope_call.lineno):
            return None
        if None in conds or (conditions is not None and
                             [ast.dump(c) for c in conds] != [ast.dump(c) for c in conditions]):
            return None
        if branch is not None and conds:
            return None
        conditions = conds
        fused.append(call)
    normed = (ast.Constant(True) if not conditions else
              conditions[0] if len(conditions) == 1 else ast.BoolOp(ast.And(), conditions))
    q, k = (arg.id for arg in rope_call.args[:2])
    fdef = _Rewrite(rope_call, normed, fused, FUSED_CALLS[kind][0], norms).visit(fdef)
    if branch is not None:
        # The norms ran whether or not the RoPE call did: now fused into it, they run in an
        # added else branch when it does not.
        branch.orelse = [ast.Assign(
            targets=[ast.Tuple([ast.Name(q, ast.Store()), ast.Name(k, ast.Store())], ast.Store())],
            value=ast.Tuple([_self_call(norm, name) for norm, name in zip(norms, (q, k))],
                            ast.Load()),
            lineno=branch.lineno)]
    return _compiled_like(fn, fdef)


def _self_call(method, arg):
    func = ast.Attribute(ast.Name("self", ast.Load()), method, ast.Load())
    return ast.Call(func, [ast.Name(arg, ast.Load())], [])


def _reassigns(fdef, rope_call):
    """Whether the RoPE call is `q, k = rope(q, k, ...)`: the names it rotates hold its results
    after it (the unnormed values the rewrite leaves in them before it are not seen again)."""
    names = [a.id for a in rope_call.args[:2] if isinstance(a, ast.Name)]
    for node in ast.walk(fdef):
        if isinstance(node, ast.Assign) and node.value is rope_call:
            return (len(names) == 2 and len(node.targets) == 1
                    and isinstance(node.targets[0], ast.Tuple)
                    and _assigned_names(node.targets[0]) == names)
    return False


def _rope_branch(fdef, rope_call, rope_conditions):
    """The `if` whose body holds the statement of the RoPE call (its only condition, no else
    branch); else None."""
    if len(rope_conditions) != 1 or rope_conditions[0] is None:
        return None
    for node in ast.walk(fdef):
        if not isinstance(node, ast.If) or node.test is not rope_conditions[0] or node.orelse:
            continue
        if any(isinstance(stmt, ast.Assign) and stmt.value is rope_call for stmt in node.body):
            return node
        return None
    return None


def _compiled_like(fn, fdef):
    """fdef (fn's rewritten definition) compiled into a function like fn, or None."""
    fdef.decorator_list = []
    # Compiled inside a class so that a zero-argument super() gets its __class__ cell as in the
    # original; line numbers are the source file's, for tracebacks.
    holder = ast.ClassDef(name="_Holder", bases=[], keywords=[], body=[fdef], decorator_list=[])
    module = ast.Module(body=[holder], type_ignores=[])
    ast.fix_missing_locations(module)
    ast.increment_lineno(module, fn.__code__.co_firstlineno - 1)
    code = compile(module, fn.__code__.co_filename, "exec")
    body = next(c for c in code.co_consts if isinstance(c, types.CodeType))
    new_code = next(c for c in body.co_consts if isinstance(c, types.CodeType)
                    and c.co_name == fn.__name__)
    cells = dict(zip(fn.__code__.co_freevars, fn.__closure__ or ()))
    if any(name not in cells for name in new_code.co_freevars):
        return None
    closure = tuple(cells[name] for name in new_code.co_freevars) or None
    new = types.FunctionType(new_code, fn.__globals__, fn.__name__, fn.__defaults__, closure)
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__qualname__, new.__doc__, new.__module__ = fn.__qualname__, fn.__doc__, fn.__module__
    new.__annotations__ = dict(getattr(fn, "__annotations__", {}))
    return new


# ---- the norm modules ----

def _norm_form(norm):
    """(unit_offset, eps attribute, promotes) of norm, probed once per class on a fresh instance
    of it; None when it is not an RMSNorm the op computes. An instance whose settings are not
    the fresh instance's (a class whose constructor chooses the form, as Liger-Kernel's
    `LigerRMSNorm(offset=...)` does) is probed on a copy of it, once per class and settings."""
    cls = type(norm)
    known = _norm_forms.get(cls)
    if known is None or known[0] is not cls.forward:
        form, settings = _probe_norm(norm)
        known = (cls.forward, form, tuple(n for n, _ in settings), tuple(v for _, v in settings))
        _norm_forms[cls] = known
    if known[2]:  # usually none: a weight and an eps
        values = tuple(getattr(norm, name, _MISSING) for name in known[2])
        if values != known[3]:
            key = (cls.forward, values)
            forms = _instance_forms.setdefault(cls, {})
            if key not in forms:
                forms[key] = _probe_norm(norm, instance=True)[0]
            return forms[key]
    return known[1]


def _holds_only_weight(norm):
    """norm's own state is its weight alone (a parameter, or a parametrized one): its class was
    probed with just the weight set, so the op would drop anything else an instance holds (a
    bias, say)."""
    params, modules, buffers = norm._parameters, norm._modules, norm._buffers
    if len(params) == 1 and not buffers and not modules:  # the usual norm: a weight, no more
        return params.get("weight") is not None
    if any(t is not None for t in buffers.values()) or any(
            t is not None for name, t in params.items() if name != "weight"):
        return False
    if not modules:
        return params.get("weight") is not None
    parametrized = modules.get("parametrizations")
    return (len(modules) == 1 and parametrized is not None
            and list(parametrized.keys()) == ["weight"])


def _settings(probe, eps_attr, width):
    """The plain settings a probe instance holds (numbers, flags, strings), but its eps (and
    copies of it), its training flag and the width it was made with: ((name, value), ...)."""
    return tuple((name, value) for name, value in vars(probe).items()
                 if not name.startswith("_") and name not in ("training", eps_attr)
                 and type(value) in (bool, int, float, str)
                 and not (type(value) is int and value == width) and value != 0.25)


_warnings_lock = threading.Lock()  # (see _probe_norm)


def _probe_norm(norm, instance=False):
    """(form, settings) of norm's class (_norm_forms), from the outputs of a fresh instance of
    it, or (instance) of a copy of norm."""
    weight = getattr(norm, "weight", None)
    attr = next((a for a in _EPS_ATTRS if isinstance(getattr(norm, a, None), float)), None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1 or attr is None:
        return None, ()
    width = weight.shape[0] if instance else 8
    try:
        # On the CPU in float32 whatever torch's defaults are (set_default_device/_dtype).
        with torch.device("cpu"):
            if instance:
                probe = copy.deepcopy(norm)
                setattr(probe, attr, 0.25)
            else:
                probe = type(norm)(width, eps=0.25)
        if any(t.is_meta for t in (*probe.parameters(), *probe.buffers())):
            # made inside init_empty_weights (accelerate's, transformers'), which puts new
            # parameters on meta: given CPU memory (the weight is set below; a norm whose
            # constructor sets other values then fails the probe and is not fused)
            probe = probe.to_empty(device="cpu")
        probe = probe.to("cpu", torch.float32)
    except Exception:  # noqa: BLE001 - a constructor of another shape: not a norm we know
        return None, ()
    if getattr(probe, attr, None) != 0.25 or getattr(probe, "weight", None) is None:
        return None, ()
    g = torch.Generator().manual_seed(0)
    call = type(probe).forward  # without the copied module's hooks
    try:
        with torch.no_grad(), torch.device("cpu"):
            x = torch.randn(3, 2, width, generator=g, dtype=torch.float32)
            w = torch.randn(width, generator=g, dtype=torch.float32)
            probe.weight.copy_(w)
            got = call(probe, x).double()
    except Exception:  # noqa: BLE001 - a norm that cannot run here (CUDA only, other widths)
        return None, ()
    try:
        # bfloat16 rows, a float32 weight (autocast, or a model that keeps its norms in
        # float32): transformers' Qwen3 norm returns float32, Gemma 3's the rows' dtype
        # (catch_warnings saves and restores the process's filters: two threads inside it at
        # once can leave "ignore" installed for good, so rope_ext's probes take turns)
        with _warnings_lock, torch.no_grad(), torch.device("cpu"), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch.nn.RMSNorm's note on the mixed dtypes
            promotes = call(probe, x.bfloat16()).dtype != torch.bfloat16
    except Exception:  # noqa: BLE001 - refuses mixed dtypes: fused only where they agree
        promotes = True
    x, w = x.double(), w.double()
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 0.25)
    for unit_offset in (False, True):
        want = normed * ((1 + w) if unit_offset else w)
        if got.shape == want.shape and torch.allclose(got, want, rtol=1e-5, atol=1e-5):
            return (unit_offset, attr, promotes), _settings(probe, attr, width)
    return None, ()


def fusable_norms(module, one_tensor=False, norms=_NORMS):
    """Whether the modules named `norms` (q's and k's: norm_names) are RMSNorms of one form over
    head_dim (OLMo 2's norms over all heads at once are not, nor a projection). one_tensor (each
    norm fused on its own): those the module has (Gemma 4's layers that reuse another layer's
    keys have no k_norm)."""
    forms = []
    head_dim = getattr(module, "head_dim", None)
    for i, name in enumerate(norms):
        norm = getattr(module, name, None)
        if one_tensor and norm is None and i > 0:
            continue
        if (not isinstance(norm, torch.nn.Module) or not isinstance(head_dim, int)
                or getattr(getattr(norm, "weight", None), "shape", None) != (head_dim,)
                or not _holds_only_weight(norm)):
            return False
        form = _norm_form(norm)
        if form is None:
            return False
        forms.append(form[0])
    return one_tensor or forms[0] == forms[1]


# The half-width tables of the last cos/sin converted: (weak references to cos and sin,
# unsqueeze_dim, half cos, half sin). See _tables.
_last_tables = None


def _tables(cos, sin, unsqueeze_dim):
    """The op's half-width tables of transformers' cos/sin for 4-dim q and k (views:
    qk_norm.half_tables). transformers computes cos/sin once per forward and hands the same two
    tensors to every layer, so the views made for the first layer are kept and reused while the
    next ones get the same tensors (compared by identity; views read what the tables hold now).
    The views are of detached aliases, and are let go when cos is freed (after the forward):
    nothing keeps a forward's tables alive. Not while torch.compile traces, nor for tables that
    require grad."""
    global _last_tables
    if compiling() or cos.requires_grad or sin.requires_grad:
        return _api.half_tables(cos, sin, head_first=unsqueeze_dim == 1, ndim=4)
    last = _last_tables
    if last is not None and last[0]() is cos and last[1]() is sin and last[2] == unsqueeze_dim:
        return last[3], last[4]
    half_cos, half_sin = _api.half_tables(cos.detach(), sin.detach(),
                                          head_first=unsqueeze_dim == 1, ndim=4)
    # The callback rides on the reference itself, so replacing the entry drops it with it (a
    # finalizer per table would pile up while alternating tables live on).
    _last_tables = (weakref.ref(cos, _forget_freed_tables), weakref.ref(sin), unsqueeze_dim,
                    half_cos, half_sin)
    return half_cos, half_sin


def _forget_freed_tables(ref):
    global _last_tables
    last = _last_tables
    if last is not None and last[0] is ref:
        _last_tables = None


def _submodule(module, name):
    try:
        return module._modules[name]  # what module.<name> returns, without Module.__getattr__
    except KeyError:
        return getattr(module, name)


def _weight(norm):
    """norm.weight: the registered parameter, else (a parametrized norm) the attribute."""
    weight = norm._parameters.get("weight")
    return getattr(norm, "weight", None) if weight is None else weight


_global_hooks = (_module_hooks._global_forward_hooks, _module_hooks._global_forward_pre_hooks,
                 _module_hooks._global_backward_hooks, _module_hooks._global_backward_pre_hooks)


def plain_call(module):
    """Whether calling `module` (an nn.Module) runs just its class's forward: no hooks of its own
    or global ones, no forward set on the instance (those would not run inside a fused op)."""
    return not (module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks or "forward" in module.__dict__ or any(_global_hooks))


def _stand_in(norm, x):
    """(weight, eps, unit_offset) when the op can stand in for calling `norm` on x, else None:
    a module whose call runs just its class's forward (plain_call), of an RMSNorm form the op
    computes (one replaced after patch by another kind of module, an Identity say, is not),
    holding its weight alone, over x's last dim, and a float eps (torch.nn.RMSNorm's None means
    the dtype's epsilon: left to the norm)."""
    if not isinstance(norm, torch.nn.Module) or not plain_call(norm):
        return None
    form = _norm_form(norm)  # a class first seen here (or changed since): probed
    if form is None or not _holds_only_weight(norm):
        return None
    weight = _weight(norm)
    eps = getattr(norm, form[1], None)
    if (not isinstance(weight, torch.Tensor) or weight.shape != x.shape[-1:]
            or not isinstance(eps, float)):
        return None
    if form[2] and weight.dtype is not x.dtype and \
            torch.promote_types(x.dtype, weight.dtype) != x.dtype:
        return None  # the norm's output would be of another dtype than x (the op writes x's)
    return weight, eps, form[0]


def _fused_norms(module, q, k, cos, sin, norms):
    """(q weight, k weight, eps, unit_offset) of module's norms (the names `norms`), or None
    where the op cannot stand in for them (_stand_in), or for norms of two forms or two eps
    (the norms act on the last dim, whatever the layout), or tables that require grad (the op
    reads the first half of each, the angles, while transformers' gradients reach both halves,
    which compat.transformers reproduces)."""
    q_fused = _stand_in(_submodule(module, norms[0]), q)
    k_fused = _stand_in(_submodule(module, norms[1]), k)
    if (q_fused is None or k_fused is None or q_fused[1:] != k_fused[1:]
            or cos.requires_grad or sin.requires_grad):
        return None
    return q_fused[0], k_fused[0], q_fused[1], q_fused[2]


def _qk_norm_rope_call(rope):
    """What the rewritten forward calls in place of the q and k norms (the modules named
    `_norms`) and the RoPE function, for a family whose RoPE function is `rope`
    (compat.transformers'). It runs once per layer and token step (at decode it costs about what
    the norms and RoPE it replaces do), so the common case takes few Python steps and calls the
    op directly. Where the op cannot stand in for the norms, they run as transformers runs them,
    then `rope`."""
    def call(module, q, k, cos, sin, position_ids=None, unsqueeze_dim=1, *, _normed,
             _norms=_NORMS):
        if not _normed:  # the forward's conditions on its norms are false: RoPE only
            return rope(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
        norms = _fused_norms(module, q, k, cos, sin, _norms)
        if norms is None or unsqueeze_dim not in (1, 2) or q.dim() != 4:  # transformers' layouts
            q_norm, k_norm = _submodule(module, _norms[0]), _submodule(module, _norms[1])
            return rope(q_norm(q), k_norm(k), cos, sin, unsqueeze_dim=unsqueeze_dim)
        seq_major = hf.in_projection_order(unsqueeze_dim, q, k)  # (rotated in that order)
        if seq_major:
            q, k, unsqueeze_dim = q.transpose(1, 2), k.transpose(1, 2), 2
        if cos.dim() == 3:  # transformers' (batch, seq, rotary_dim)
            cos, sin = _tables(cos, sin, unsqueeze_dim)
        else:
            cos, sin = _api.half_tables(cos, sin, head_first=unsqueeze_dim == 1, ndim=4)
        q_weight, k_weight, eps, unit_offset = norms
        # rope_ext.qk_norm.qk_norm_rope(..., table_width="half") without its Python frames.
        q, k = fused_op(q, k, q_weight, k_weight, cos, sin, eps, unit_offset, False)
        return (q.transpose(1, 2), k.transpose(1, 2)) if seq_major else (q, k)

    return call


qk_norm_rope_call = _qk_norm_rope_call(hf.apply_rotary_pos_emb)
qk_norm_rope_in_input_dtype_call = _qk_norm_rope_call(hf.apply_rotary_pos_emb_in_input_dtype)


def qk_norm_rope_vision_call(module, q, k, cos, sin, *, _normed, _norms=_NORMS):
    """qk_norm_rope_call of a vision tower's attention: q, k (seq, heads, head_dim) and the
    vision RoPE function's tables (seq, rotary_dim), as compat.transformers'
    apply_rotary_pos_emb_vision takes them (computed in float32, returned in q's dtype)."""
    if not _normed:
        return hf.apply_rotary_pos_emb_vision(q, k, cos, sin)
    norms = _fused_norms(module, q, k, cos, sin, _norms)
    if norms is None or q.dim() != 3 or k.dim() != 3 or cos.dim() != 2:
        q_norm, k_norm = _submodule(module, _norms[0]), _submodule(module, _norms[1])
        return hf.apply_rotary_pos_emb_vision(q_norm(q), k_norm(k), cos, sin)
    q_weight, k_weight, eps, unit_offset = norms
    cos, sin = _api.half_tables(cos, sin, ndim=3)
    return fused_op(q, k, q_weight, k_weight, cos, sin, eps, unit_offset, False)


def norm_rope_one_call(module, norm_name, x, cos, sin, position_ids=None, unsqueeze_dim=1):
    """What the rewritten one-tensor forward (Gemma 3n, Gemma 4) calls in place of
    `self.<norm_name>(x)` and the RoPE call on its result: the op on x alone (a key of no heads
    beside it)."""
    norm = _submodule(module, norm_name)
    fused = _stand_in(norm, x)
    if (fused is None or unsqueeze_dim not in (1, 2) or x.dim() != 4 or cos.dim() != 3
            or cos.requires_grad or sin.requires_grad):
        return hf.apply_rotary_pos_emb_single(norm(x), cos, sin, unsqueeze_dim=unsqueeze_dim)
    seq_major = hf.in_projection_order(unsqueeze_dim, x)
    if seq_major:  # rotated in the projection's order
        x, unsqueeze_dim = x.transpose(1, 2), 2
    cos, sin = _tables(cos, sin, unsqueeze_dim)
    none = x.narrow(unsqueeze_dim, 0, 0)
    weight, eps, unit_offset = fused
    out = fused_op(x, none, weight, weight, cos, sin, eps, unit_offset, False)[0]
    return out.transpose(1, 2) if seq_major else out


# The op qk_norm_rope_call runs (looked up at each call: tests count its calls through it),
# without autograd when nothing needs it (rope_ext/_call.py).
fused_op = without_autograd_if_unneeded(torch.ops.rope.qk_norm_rope.default)


# Each kind of fusion: the name the rewritten forward calls, and what it calls.
FUSED_CALLS = {True: (FUSED_NAME, qk_norm_rope_call),
               IN_INPUT_DTYPE: (FUSED_IN_INPUT_DTYPE_NAME, qk_norm_rope_in_input_dtype_call),
               ONE_TENSOR: (FUSED_ONE_NAME, norm_rope_one_call),
               VISION: (FUSED_VISION_NAME, qk_norm_rope_vision_call)}
