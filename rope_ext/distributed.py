"""DTensor support: sharding rules for the rope ops, registered with torch.distributed.tensor.

With them each torch.ops.rope op, and so each public function, takes DTensors and runs on every
rank's local shards, with no communication when the tensors are sharded over heads (tensor
parallelism) or over tokens (context / sequence parallelism, positions sharded alike) and the
tables are replicated. docs/distributed.md lists the layouts and the errors.

Importing this module is cheap and safe: it registers at once when torch.distributed.tensor is
already loaded, otherwise right after it loads (an import hook), so importing rope_ext never pays
for torch.distributed.tensor; without torch.distributed it does nothing.

Why DTensor's strategy registration (ShardingPropagator.register_op_strategy) and not the public
torch.distributed.tensor.experimental.register_sharding: the public API takes candidate
placements per mesh dim and lets DTensor's cost model pick one, and keeps only the first argument
of an in-place op from being redistributed. Redistributing from Replicate costs nothing in that
model, so it may pick a candidate that chunks a replicated `key` or cache: the op would then write
a temporary copy and the update would be lost, silently. Here each rule returns the one layout
that fits the arguments as given, keeps every tensor the op writes as it is, and raises when that
is impossible. rope.apply.out also needs a dispatch handler: DTensor's out= path expects the op
to return `out`, and rope.apply.out returns nothing.
"""

import importlib.abc
import importlib.util
import sys
import threading
import types
import warnings

import torch

__all__ = ["install", "register", "registered"]

_DTENSOR_MODULE = "torch.distributed.tensor"
_lock = threading.RLock()
_registered = False
_dt = None  # torch.distributed.tensor names, bound by register(): importing them is the cost


def registered():
    """Whether the sharding rules are registered with DTensor."""
    return _registered


def register():
    """Registers the sharding rules of every rope op with DTensor (imports
    torch.distributed.tensor). Idempotent."""
    global _dt, _registered
    if not torch.distributed.is_available():
        raise RuntimeError("rope_ext.distributed: this torch build has no torch.distributed "
                           "(torch.distributed.is_available() is False)")
    with _lock:
        if _registered:
            return
        _dt = _load_dtensor()
        propagator = _dt.DTensor._op_dispatcher.sharding_propagator
        for name, (rule, static_argnum) in _RULES.items():
            # DTensor caches a layout per call signature: the keyword-only arguments (v_norm,
            # k_scale's layout, out, ...) decide it too, so they are part of the key.
            kwarg_only = [arg.name for arg in _overload(name)._schema.arguments if arg.kwarg_only]
            info = _dt.RuntimeSchemaInfo(static_argnum=static_argnum,
                                         static_kwargkey=kwarg_only or None)
            propagator.register_op_strategy(_overload(name), _strategy(name, rule), info)
        # Updated in place, not replaced: context parallelism copies this dict while enabled.
        handlers = _dt.DTensor._op_dispatcher._custom_op_handlers
        handlers[_overload("apply.out")] = _apply_out_handler
        _registered = True


def install():
    """register() now if torch.distributed.tensor is loaded, else as soon as it is; nothing when
    this torch has no torch.distributed. Runs on import of this module."""
    if _registered or not torch.distributed.is_available():
        return
    loaded = sys.modules.get(_DTENSOR_MODULE)
    if loaded is not None and hasattr(loaded, "DTensor"):
        _register_or_warn()
    elif not any(isinstance(f, _RegisterAfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterImport())


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when torch.distributed.tensor is about to load, it wraps that
    module's loader so that register() runs once the module has executed."""

    def __init__(self):
        self._finding = False

    def find_spec(self, fullname, path, target=None):
        if fullname != _DTENSOR_MODULE or self._finding:
            return None
        self._finding = True
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._finding = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        spec.loader = _RegisteringLoader(spec.loader, self)
        return spec


class _RegisteringLoader(importlib.abc.Loader):
    def __init__(self, loader, finder):
        self._loader, self._finder = loader, finder

    def __getattr__(self, name):  # get_source, is_package, ...: the real loader's
        return getattr(self._loader, name)

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        module.__loader__ = module.__spec__.loader = self._loader
        if self._finder in sys.meta_path:
            sys.meta_path.remove(self._finder)
        _register_or_warn()


def _register_or_warn():
    """register() on import: a failure (say, a torch whose DTensor internals changed) must not
    break importing rope_ext or torch.distributed.tensor, only DTensor support."""
    try:
        register()
    except Exception as e:
        warnings.warn(f"rope_ext.distributed: registering the DTensor sharding rules failed "
                      f"({e!r}); rope ops will not take DTensors", RuntimeWarning, stacklevel=3)


def _load_dtensor():
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, ShardOrderEntry
    from torch.distributed.tensor._op_schema import OpSpec, OpStrategy, RuntimeSchemaInfo
    from torch.distributed.tensor._ops.utils import generate_redistribute_costs
    from torch.distributed.tensor.placement_types import (
        Partial,
        Replicate,
        Shard,
        _StridedShard,
    )

    return types.SimpleNamespace(**locals())


def _overload(name):
    packet, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.rope, packet), overload or "default")


# ---- layouts ----

def _ndim(spec):
    return len(spec.tensor_meta.shape)


def _shard_dim(p, ndim):
    """The tensor dim placement p shards, or None (Replicate, Partial)."""
    if isinstance(p, (_dt.Shard, _dt._StridedShard)):
        return p.dim % ndim
    return None


def _linear_partial(p):
    """Partial placements a rotation can keep: it is linear, so rotating each rank's addend
    rotates the sum (or the average)."""
    return type(p) is _dt.Partial and p.reduce_op in ("sum", "avg")


def _layout(spec):
    return tuple(spec.placements), spec.shard_order


def _name(p):
    """p as one would write it: Shard(1), Replicate(), Partial('sum')."""
    if type(p) is _dt.Shard:
        return f"Shard({p.dim})"
    if type(p) is _dt.Partial:
        return f"Partial({p.reduce_op!r})"
    return "Replicate()" if p.is_replicate() else repr(p)


def _names(spec):
    return "[" + ", ".join(_name(p) for p in spec.placements) + "]"


def _replicated(mesh):
    return _dt.DTensorSpec(mesh, (_dt.Replicate(),) * mesh.ndim)


def _spec(mesh, placements, shard_order, tensor_meta=None):
    strided = any(isinstance(p, _dt._StridedShard) for p in placements)
    return _dt.DTensorSpec(mesh, tuple(placements), tensor_meta=tensor_meta,
                           shard_order=None if strided else shard_order,
                           use_strided_shard_as_shard_order=True if strided else None)


def _aligned(spec, dim_map):
    """The layout of a tensor aligned with spec's: its dim dim_map(d) runs along dim d of spec's
    tensor and is sharded alike (dim_map(d) None: it has no such dim, so Replicate there).
    Partial placements become Replicate: the aligned tensor is read whole."""
    nd = _ndim(spec)
    placements = []
    for p in spec.placements:
        d = _shard_dim(p, nd)
        new = None if d is None else dim_map(d)
        if new is None:
            placements.append(_dt.Replicate())
        elif isinstance(p, _dt._StridedShard):
            placements.append(_dt._StridedShard(new, split_factor=p.split_factor))
        else:
            placements.append(_dt.Shard(new))
    order = None
    if not spec.use_strided_shard_as_shard_order:  # the order of a dim split over mesh dims
        order = tuple(_dt.ShardOrderEntry(tensor_dim=dim_map(e.tensor_dim), mesh_dims=e.mesh_dims)
                      for e in spec.shard_order if dim_map(e.tensor_dim) is not None)
    return _spec(spec.mesh, placements, order)


def _reduced(spec):
    """spec with the Partial placements a rotation cannot keep (max, min, ...) made Replicate:
    those values are reduced before the op (DTensor all-reduces them)."""
    placements = [_dt.Replicate() if p.is_partial() and not _linear_partial(p) else p
                  for p in spec.placements]
    if placements == list(spec.placements):
        return spec
    order = None if spec.use_strided_shard_as_shard_order else spec.shard_order
    return _spec(spec.mesh, placements, order, spec.tensor_meta)


# ---- checks ----

def _fail(op, msg):
    raise RuntimeError(f"{op}: {msg}")


def _check_rotated(op, name, spec, written):
    """A tensor the op rotates: never sharded over its last dim (head_dim); Partial only for a
    sum or an average, unless it can be reduced first (not when written in place)."""
    nd = _ndim(spec)
    for m, p in enumerate(spec.placements):
        d = _shard_dim(p, nd)
        if d == nd - 1:
            _fail(op, f"{name} is sharded over its last dim (head_dim) on mesh dim {m} "
                      f"({_name(p)}): the rotation pairs span head_dim, so it must not be "
                      "sharded; shard the heads or the tokens instead")
        if d is not None or p.is_replicate() or _linear_partial(p):
            continue
        if not p.is_partial():
            _fail(op, f"{name} has placement {_name(p)} on mesh dim {m}; rope ops take Shard, "
                      "Replicate and Partial('sum' / 'avg')")
        if written:
            _fail(op, f"{name} is {_name(p)} on mesh dim {m}: only partial sums and averages "
                      "can be rotated shard by shard, and a tensor written in place cannot be "
                      f"reduced first; redistribute {name} to Replicate() before the call")


def _check_written(op, name, actual, required, why):
    if _layout(actual) != _layout(required):
        _fail(op, f"{name} is written in place, so its layout cannot change, and {why}: it must "
                  f"be {_names(required)}, got {_names(actual)}")


def _check_readable(op, name, actual, required):
    """DTensor compares placements only: a tensor dim split over several mesh dims in another
    order would be read as it is, its shards not matching. No rope layout needs that: refuse.
    (_StridedShard placements carry their order themselves: equal placements are one layout.)"""
    strided = any(isinstance(p, _dt._StridedShard) for p in required.placements)
    if (actual.placements == required.placements and not strided
            and actual.shard_order != required.shard_order):
        _fail(op, f"{name} is split over the mesh dims in another order ({actual.shard_order}) "
                  f"than the op needs ({required.shard_order})")


# ---- the rules: for one call, the layout of the result and of every tensor argument ----

def _rule_apply(op, a, x_name="x"):
    """apply, apply.out, apply_backward: x (..., head_dim) sharded over any dim but the last;
    cos/sin sharded like x along the dims where they have x's size, Replicate where broadcast
    (size 1) or 1-D; out (written) must already have the result's layout, x's."""
    x = a[x_name]
    _check_rotated(op, x_name, x, written=False)
    x = _reduced(x)
    x_shape, t_shape = x.tensor_meta.shape, a["cos"].tensor_meta.shape
    full = len(t_shape) == len(x_shape)
    tables = _aligned(x, lambda d: d if full and t_shape[d] == x_shape[d] else None)
    need = {x_name: x, "cos": tables, "sin": tables}
    if a.get("out") is None:
        return x, need
    _check_written(op, "out", a["out"], x, f"the result takes {x_name}'s layout")
    need["out"] = a["out"]
    return None, need


def _rule_apply_backward(op, a):
    return _rule_apply(op, a, "grad")


def _rule_apply_positions(op, a):
    """x (..., H, D) sharded over tokens (a leading dim; positions sharded alike) or heads
    (positions Replicate); the tables (cos and sin, or the .cache overload's cos_sin_cache)
    Replicate."""
    x = a["x"]
    _check_rotated(op, "x", x, written=False)
    x = _reduced(x)
    nd, off = _ndim(x), 0 if a["mrope_section"] is None else 1
    positions = _aligned(x, lambda d: d + off if d < nd - 2 else None)
    table = _replicated(x.mesh)
    tables = {"cos_sin_cache": table} if "cos_sin_cache" in a else {"cos": table, "sin": table}
    return x, {"x": x, "positions": positions, **tables}


def _rule_rotate_in_place(op, a):
    """apply_, mrope_: query and key keep their layouts (written in place): each Replicate,
    sharded over its heads, or over tokens, the tokens alike for both since they share
    positions (sharded like the tokens, Replicate otherwise); the table Replicate."""
    q, k = a["query"], a["key"]
    off = 1 if "mrope_section" in a else 0  # mrope positions: (3,) + the token dims
    nd = _ndim(q)

    def tokens(d):
        return d + off if d < nd - 2 else None

    _check_rotated(op, "query", q, written=True)
    positions = _aligned(q, tokens)
    if k is not None:
        _check_rotated(op, "key", k, written=True)
        if _layout(_aligned(k, tokens)) != _layout(positions):
            _fail(op, f"query {_names(q)} and key {_names(k)} must be sharded alike over the "
                      "token dims, since they share positions (each may be sharded over its own "
                      "heads, or replicated, independently)")
    return None, {"query": q, "key": k, "positions": positions,
                  "cos_sin_cache": _replicated(q.mesh)}


TOKENS_IN_CACHE = (
    "sharding the tokens is not supported by an op that writes the paged caches: each rank would "
    "write only its own tokens into them, so a replicated cache would differ between ranks, and "
    "a cache sharded over its blocks would need each rank's slots translated. Shard the heads "
    "(query, key, value Shard(1); key_cache, value_cache Shard(2)), or call the op on the local "
    "tensors (DTensor.to_local()) with a per-rank cache and slot_mapping"
)
_CACHE_DIMS = {0: "its blocks", 1: "its block offsets", 3: "its last dim"}


def _check_cache_placements(op, name, c, why):
    """A paged cache (num_blocks, block_size, Hk, D) is Replicate or Shard(2) on every mesh dim;
    why(cache dim) ends the error for any other placement."""
    for m, p in enumerate(c.placements):
        d = _shard_dim(p, 4)
        if p.is_replicate() or d == 2:
            continue
        what = f" (sharded over {_CACHE_DIMS[d]})" if d in _CACHE_DIMS else ""
        _fail(op, f"{name} is {_name(p)} on mesh dim {m}{what}; {why(d)}")


def _rule_apply_and_cache(op, a):
    """Tensor parallelism: query Replicate or sharded over its heads (Shard(1)); key with
    key_cache, and value with value_cache, Replicate or sharded over the kv heads (Shard(1) of
    (T, Hk, D), Shard(2) of (num_blocks, block_size, Hk, D)); the rest Replicate."""
    q, k, kc, vc = a["query"], a["key"], a["key_cache"], a["value_cache"]
    for name, t in (("query", q), ("key", k)):
        for m, p in enumerate(t.placements):
            if _shard_dim(p, 3) == 0:
                _fail(op, f"{name} is sharded over the tokens (Shard(0)) on mesh dim {m}; "
                          + TOKENS_IN_CACHE)
        _check_rotated(op, name, t, written=True)
    for m, p in enumerate(k.placements):
        if p.is_partial():
            _fail(op, f"key is {_name(p)} on mesh dim {m}: it is written into key_cache, which "
                      "holds values, not partial sums; redistribute key to Replicate() first")
    for name, c in (("key_cache", kc), ("value_cache", vc)):
        _check_cache_placements(op, name, c, lambda d: "a paged cache is Replicate or sharded "
                                "over its kv heads (Shard(2))"
                                + (": " + TOKENS_IN_CACHE if d in (0, 1) else ""))
    heads = _aligned(k, lambda d: 2 if d == 1 else None)
    _check_written(op, "key_cache", kc, heads,
                   "it holds key's heads (Shard(2) where key is Shard(1), Replicate where key "
                   "is Replicate)")
    # Each rank stores value rows for its own key heads: value_cache sharded unlike key_cache
    # would leave a rank with kv heads in one cache and not the other (and a "replicated" cache
    # written by some ranks only). Refused here, on every rank, before any writes.
    _check_written(op, "value_cache", vc, heads,
                   "it holds the value rows of key's heads, so it is sharded like key_cache")
    r = _replicated(q.mesh)
    return None, {"query": q, "key": k, "value": _aligned(vc, lambda d: 1 if d == 2 else None),
                  "positions": r, "cos_sin_cache": r, "key_cache": kc, "value_cache": vc,
                  "slot_mapping": r, "k_scale": r, "v_scale": r}


def _rule_shift_kv_cache(op, a):
    """K-shift: key_cache rotated in place, Replicate or sharded over its kv heads (Shard(2)):
    each rank rotates its heads of the listed slots; the rest Replicate."""
    kc = a["key_cache"]
    _check_cache_placements(op, "key_cache", kc, lambda d: "K-shift rotates a cache that is "
                            "Replicate or sharded over its kv heads (Shard(2)): slots are global "
                            "indices, and the rotation pairs span head_dim")
    r = _replicated(kc.mesh)
    return None, {"key_cache": kc, "slot_mapping": r, "delta": r, "cos_sin_cache": r, "k_scale": r}


# op -> (rule, index of its first non-tensor argument: from there on, arguments are part of
# DTensor's sharding cache key; mrope_section, for one, decides the positions' layout)
_RULES = {
    "apply": (_rule_apply, 3),
    "apply.out": (_rule_apply, 3),
    "apply_backward": (_rule_apply_backward, 3),
    "apply_positions": (_rule_apply_positions, 4),
    "apply_positions.cache": (_rule_apply_positions, 3),
    "apply_": (_rule_rotate_in_place, 4),
    "mrope_": (_rule_rotate_in_place, 4),
    "apply_and_cache_": (_rule_apply_and_cache, 8),
    "shift_kv_cache_": (_rule_shift_kv_cache, 4),
}


# ---- fused QK-RMSNorm + RoPE: the norm runs over head_dim within one head, so heads and tokens
# shard freely (no communication); a Partial sum cannot be normalized shard by shard. ----

def _check_normed(op, name, spec, written):
    _check_rotated(op, name, spec, written)
    for m, p in enumerate(spec.placements):
        if p.is_partial() and written:
            _fail(op, f"{name} is {_name(p)} on mesh dim {m}: RMSNorm is not linear, so a "
                      f"partial value cannot be normalized shard by shard, and a tensor written in "
                      f"place cannot be reduced first; redistribute {name} to Replicate() first")


def _whole(spec):
    """spec with every Partial placement made Replicate (reduced before the op: the norm is not
    linear)."""
    placements = [_dt.Replicate() if p.is_partial() else p for p in spec.placements]
    if placements == list(spec.placements):
        return spec
    order = None if spec.use_strided_shard_as_shard_order else spec.shard_order
    return _spec(spec.mesh, placements, order, spec.tensor_meta)


def _tables_like(x, cos):
    """The layout of qk_norm_rope's cos/sin read with x (normalized and rotated): sharded like x
    along the dims where they vary (x's number of dims), Replicate where they broadcast."""
    t_shape = cos.tensor_meta.shape
    full = len(t_shape) == _ndim(x)
    return _aligned(x, lambda d: d if full and t_shape[d] != 1 else None)


def _rule_qk_norm_rope(op, a):
    """qk_norm_rope: query and key (..., H, D) each sharded over any dim but head_dim (Partial
    reduced first); cos/sin sharded like both along the dims where they have their size (query
    and key must agree there), Replicate where broadcast; the weights Replicate."""
    q, k = a["query"], a["key"]
    _check_normed(op, "query", q, written=False)
    _check_normed(op, "key", k, written=False)
    q, k = _whole(q), _whole(k)
    tables = _tables_like(q, a["cos"])
    if _layout(_tables_like(k, a["cos"])) != _layout(tables):
        _fail(op, f"query {_names(q)} and key {_names(k)} must be sharded alike over the dims "
                  "along which cos and sin vary, since they read the same tables")
    r = _replicated(q.mesh)
    return (q, k), {"query": q, "key": k, "q_weight": r, "k_weight": r, "cos": tables,
                    "sin": tables}


def _rule_qk_norm_rope_backward(op, a):
    """qk_norm_rope_backward: x as qk_norm_rope's query (Partial reduced first), grad and the
    tables read in x's layout, the weight Replicate. grad_x comes back in x's layout; grad_weight
    sums a term per row of x, so each rank's sum over its own rows is a Partial('sum') over every
    mesh dim that shards x (the all-reduce, where the weight's gradient needs one, is DTensor's,
    after the op), Replicate over the others."""
    x = a["x"]
    _check_normed(op, "x", x, written=False)
    _check_rotated(op, "grad", a["grad"], written=False)
    x = _whole(x)
    tables = _tables_like(x, a["cos"])
    summed = [_dt.Partial() if _shard_dim(p, _ndim(x)) is not None else _dt.Replicate()
              for p in x.placements]
    grad_weight = _spec(x.mesh, summed, None)
    return (x, grad_weight), {"grad": x, "x": x, "weight": _replicated(x.mesh), "cos": tables,
                              "sin": tables}


def _rule_norm_rope(op, a):
    """norm_rope: as qk_norm_rope, the biases Replicate too; across heads the heads dim may not
    be sharded (a token's statistic spans all its heads)."""
    if a["norm"] == "rms_across_heads":
        for name in ("query", "key"):
            spec = a[name]
            for m, p in enumerate(spec.placements):
                if _shard_dim(p, _ndim(spec)) == _ndim(spec) - 2:
                    _fail(op, f"{name} is {_name(p)} on mesh dim {m} (its heads), but "
                              "norm='rms_across_heads' normalizes all heads of a token together; "
                              "shard another dim, or redistribute the heads to Replicate() first")
    out, need = _rule_qk_norm_rope(op, a)
    r = _replicated(a["query"].mesh)
    need.update(q_bias=r, k_bias=r)
    return out, need


def _rule_qk_norm_rope_in_place(op, a):
    """qk_norm_rope_: as apply_ (query and key keep their layouts: Replicate, sharded over their
    heads, or over tokens alike, positions sharded like the tokens), no Partial; the table and
    the weights Replicate."""
    q, k = a["query"], a["key"]
    _check_normed(op, "query", q, written=True)
    _check_normed(op, "key", k, written=True)
    off = 0 if a["mrope_section"] is None else 1  # mrope positions: (3,) + the token dims
    nd = _ndim(q)

    def tokens(d):
        return d + off if d < nd - 2 else None

    positions = _aligned(q, tokens)
    if _layout(_aligned(k, tokens)) != _layout(positions):
        _fail(op, f"query {_names(q)} and key {_names(k)} must be sharded alike over the token "
                  "dims, since they share positions (each may be sharded over its own heads, or "
                  "replicated, independently)")
    r = _replicated(q.mesh)
    return None, {"query": q, "key": k, "positions": positions, "cos_sin_cache": r,
                  "q_weight": r, "k_weight": r}


def _rule_qkv_norm_rope(op, a):
    """qkv_norm_rope_: qkv (T, (Hq + Hk + Hv) * D) Replicate or sharded over its tokens
    (positions sharded alike); not over its width: a shard of the packed columns is not a packed
    [q | k | v] of fewer heads. Tables and weights Replicate."""
    qkv = a["qkv"]
    for m, p in enumerate(qkv.placements):
        if _shard_dim(p, 2) == 1:
            _fail(op, f"qkv is {_name(p)} on mesh dim {m} (its packed columns): a shard of "
                      "[q | k | v] is not the packed qkv of fewer heads; shard the tokens "
                      "(Shard(0)), or call the op on each rank's local qkv with its local head "
                      "counts")
        if p.is_partial():
            _fail(op, f"qkv is {_name(p)} on mesh dim {m}: RMSNorm is not linear and qkv is "
                      "written in place; redistribute qkv to Replicate() first")
    off = 1 if a["mrope_section"] is not None else 0
    positions = _aligned(qkv, lambda d: d + off if d == 0 else None)
    r = _replicated(qkv.mesh)
    return None, {"qkv": qkv, "positions": positions, "cos_sin_cache": r, "q_weight": r,
                  "k_weight": r}


def _rule_qk_norm_rope_and_cache(op, a, in_place=True):
    """The serving prologue: the layouts of apply_and_cache_ (query, key, value and the caches
    Replicate or sharded over their heads; never the tokens), with no Partial tensor written
    (RMSNorm is not linear); with v_norm, value is written in place too, so it must already
    have value_cache's heads; the weights Replicate. The out-of-place op writes no query: a
    Partial one is reduced first."""
    if not in_place:
        a = dict(a, query=_whole(a["query"]))
    _check_normed(op, "query", a["query"], written=True)
    _check_normed(op, "key", a["key"], written=True)
    v_written = a["v_norm"] and in_place
    if v_written:
        _check_normed(op, "value", a["value"], written=True)
    _, need = _rule_apply_and_cache(op, a)
    if v_written:
        _check_written(op, "value", a["value"], need["value"],
                       "it holds the value rows of value_cache's heads (Shard(1) where value_cache "
                       "is Shard(2), Replicate where it is Replicate)")
    r = _replicated(a["query"].mesh)
    need.update(q_weight=r, k_weight=r)
    return None, need


def _rule_qk_norm_rope_and_cache_out(op, a):
    """The out-of-place prologue: the layouts of the in-place one (a rank normalizes and rotates
    its own heads); the new query and key come back in query's and key's layouts (a Partial
    query reduced), the new value in value_cache's heads, where value was moved."""
    _, need = _rule_qk_norm_rope_and_cache(op, a, in_place=False)
    return (need["query"], need["key"], need["value"]), need


_RULES.update({
    "qk_norm_rope_and_cache_": (_rule_qk_norm_rope_and_cache, 10),
    "qk_norm_rope_and_cache": (_rule_qk_norm_rope_and_cache_out, 10),
    "qk_norm_rope": (_rule_qk_norm_rope, 6),
    "qk_norm_rope_backward": (_rule_qk_norm_rope_backward, 5),
    "norm_rope": (_rule_norm_rope, 8),
    "qk_norm_rope_": (_rule_qk_norm_rope_in_place, 6),
    "qkv_norm_rope_": (_rule_qkv_norm_rope, 1),
})


# ---- RoPE + FP8 quantization: the rotation, then a scale and a saturation per element, so heads
# and tokens shard freely; saturation is not linear, so a Partial input is reduced first. ----

def _tokens_only(d):
    return 0 if d == 0 else None


def _rule_quantize_fp8(op, a):
    """quantize_fp8: q_rope (nnz, Hq, R) and k_rope (nnz, Hk, R) or, MLA, (nnz, R) each
    Replicate or sharded over its heads or tokens (never over R), the tokens alike for both
    since they share pos_ids (sharded like them); q_nope and k_nope read in q_rope's and
    k_rope's layouts; each output written in place in its input's layout; the table Replicate."""
    q, k = a["q_rope"], a["k_rope"]
    _check_rotated(op, "q_rope", q, written=False)
    _check_rotated(op, "k_rope", k, written=False)
    q, k = _whole(q), _whole(k)
    positions = _aligned(q, _tokens_only)
    if _layout(_aligned(k, _tokens_only)) != _layout(positions):
        _fail(op, f"q_rope {_names(q)} and k_rope {_names(k)} must be sharded alike over the "
                  "tokens (dim 0), since they share pos_ids (each may be sharded over its own "
                  "heads, or replicated, independently)")
    for out, src, x in (("q_rope_out", "q_rope", q), ("k_rope_out", "k_rope", k),
                        ("q_nope_out", "q_nope", q), ("k_nope_out", "k_nope", k)):
        _check_written(op, out, a[out], x, f"it holds {src}'s values, laid out like "
                       f"{'q_rope' if x is q else 'k_rope'}")
    return None, {"q_rope": q, "k_rope": k, "q_nope": q, "k_nope": k, "pos_ids": positions,
                  "cos_sin_cache": _replicated(q.mesh), "q_rope_out": a["q_rope_out"],
                  "k_rope_out": a["k_rope_out"], "q_nope_out": a["q_nope_out"],
                  "k_nope_out": a["k_nope_out"]}


def _rule_quantize_fp8_paged(op, a):
    """quantize_fp8_append_paged_kv_cache, under tensor parallelism: q_rope, q_nope and their
    outputs Replicate or sharded over the query heads; k_rope, k_nope, v and the paged caches
    Replicate or sharded over the kv heads (the caches' dim 2 for NHD, 1 for HND); MLA's
    compressed k and its caches Replicate; never the tokens (each rank would write only its own
    tokens into the caches); the indices and the table Replicate."""
    q, k = a["q_rope"], a["k_rope"]
    for name, t in (("q_rope", q), ("k_rope", k)):
        for m, p in enumerate(t.placements):
            if _shard_dim(p, _ndim(t)) == 0:
                _fail(op, f"{name} is sharded over the tokens (Shard(0)) on mesh dim {m}; an op "
                          "that writes the paged caches cannot shard the tokens: each rank would "
                          "write only its own tokens into them. Shard the heads, or call the op "
                          "on the local tensors (DTensor.to_local()) with per-rank caches")
        _check_rotated(op, name, t, written=False)
    q, k = _whole(q), _whole(k)
    mla = a["v"] is None
    names = ("ckv_cache", "kpe_cache") if mla else ("k_cache", "v_cache")
    head_dim = 2 if a["kv_layout"] == "NHD" else 1
    heads = _aligned(k, lambda d: head_dim if d == 1 else None)
    why = ("it holds k_rope's heads (sharded over its kv heads where k_rope is Shard(1), "
           "Replicate where k_rope is Replicate)" if not mla else
           "MLA's compressed cache has no heads to shard")
    for name, cache in zip(names, (a["k_cache"], a["v_cache"])):
        _check_written(op, name, cache, heads, why)
    for out, src in (("q_rope_out", "q_rope"), ("q_nope_out", "q_nope")):
        _check_written(op, out, a[out], q, f"it holds {src}'s values, laid out like q_rope")
    r = _replicated(q.mesh)
    need = {"q_rope": q, "k_rope": k, "q_nope": q, "k_nope": k, "v": k, "cos_sin_cache": r,
            "pos_ids": r, "q_rope_out": a["q_rope_out"], "q_nope_out": a["q_nope_out"],
            "k_cache": a["k_cache"], "v_cache": a["v_cache"]}
    need.update(dict.fromkeys(("kv_indices", "kv_indptr", "batch_indices", "positions"), r))
    return None, need


_RULES.update({
    "quantize_fp8": (_rule_quantize_fp8, 10),
    "quantize_fp8_append_paged_kv_cache": (_rule_quantize_fp8_paged, 15),
})


# ---- glue to DTensor's sharding propagation ----

def _arguments(op_schema):
    """The call's arguments by schema name: the DTensorSpec of each tensor (None if absent) and
    the value of every other argument, defaults filled in."""
    arguments = op_schema.op._schema.arguments
    values = dict(zip((arg.name for arg in arguments), op_schema.args_schema))
    values.update(op_schema.kwargs_schema)
    for arg in arguments:
        if arg.name not in values:
            values[arg.name] = arg.default_value if arg.has_default_value() else None
    return {name: v.strategies[0].output_spec if isinstance(v, _dt.OpStrategy) else v
            for name, v in values.items()}


def _strategy(name, rule):
    """DTensor's strategy function for one op: the single layout the rule gives."""
    op = "rope." + name

    def strategy(op_schema):
        a = _arguments(op_schema)
        specs = {n: s for n, s in a.items() if isinstance(s, _dt.DTensorSpec)}
        mesh = next(iter(specs.values())).mesh
        for n, s in specs.items():
            if s.mesh != mesh:
                _fail(op, f"every DTensor argument must be on one DeviceMesh; {n} is on {s.mesh}, "
                          f"not {mesh}")
        output, need = rule(op, a)
        npos = len(op_schema.args_schema)
        positional = {arg.name for arg in op_schema.op._schema.arguments[:npos]}
        input_specs, costs = [], []
        for n, actual in specs.items():  # in argument order, as DTensor lists them
            required = need[n]
            if n not in positional:  # DTensor never redistributes keyword arguments
                if _layout(actual) != _layout(required):
                    _fail(op, f"{n} must be {_names(required)}, got {_names(actual)}")
                continue
            _check_readable(op, n, actual, required)
            required = required.shallow_copy_with_tensor_meta(actual.tensor_meta)
            input_specs.append(required)
            costs.append(_dt.generate_redistribute_costs(
                _dt.OpStrategy([_dt.OpSpec(actual)]), required))
        return _dt.OpStrategy([_dt.OpSpec(output_specs=output, input_specs=input_specs,
                                          redistribute_cost=costs)])

    return strategy


def _apply_out_handler(op_call, args, kwargs):
    """rope.apply.out on DTensors. DTensor's own out= path re-wraps `out` from the value the op
    returns, and this op returns nothing; the steps are otherwise the same: propagate the
    sharding (the rule checks that `out` has the result's layout), redistribute the inputs that
    need it, run the op on the local shards."""
    dispatcher = _dt.DTensor._op_dispatcher
    op_info = dispatcher.unwrap_to_op_info(op_call, args, kwargs)
    dispatcher.sharding_propagator.propagate(op_info)
    dispatcher._dispatch_get_local_results_slow_path(op_call, args, op_info)


install()
