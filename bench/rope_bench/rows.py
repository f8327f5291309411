"""What is timed in one case: named rows, each a zero-argument callable.

Rows of kind "limit" are the memory-copy limits of the case. Every other row belongs to an op's
comparison: the rope_ext call, the same math in eager PyTorch and under torch.compile
(equivalents.py: rope_ext.reference's math without its data checks, which read the positions
and slots and, on CUDA, sync), and for the fused op the unfused rope_ext equivalent. All rows of
one comparison count the same bytes (the least traffic the work needs, as the copy limit counts
its own), so their GB/s compare directly.
"""

from dataclasses import dataclass, field
from typing import Callable

import torch

import rope_ext

from . import equivalents as eq

KINDS = ("limit", "rope_ext", "unfused", "eager", "compile", "dropin", "peer")


@dataclass
class Row:
    name: str  # unique within a case
    kind: str  # one of KINDS
    op: str  # the comparison it belongs to ("" for limits)
    what: str
    nbytes: int
    fn: Callable = field(repr=False)
    limit: str = ""  # the limit row it is held against ("" for the limits themselves)


@dataclass
class Op:
    """One comparison: which limit it is held against and what its rows call."""

    name: str
    limit: str  # "clone" (the op allocates its result) or "copy" (in place / out=)
    what: str
    nbytes: Callable  # Inputs -> bytes
    rope_ext: Callable  # Inputs -> callable
    math: tuple  # (function of equivalents.py, Inputs -> args tuple): the eager and compile rows
    unfused: Callable = None  # Inputs -> callable, or None


def rw_bytes(i, *tensors):
    """Bytes of tensors read and written back (in place)."""
    return 2 * sum(i.nbytes(t) for t in tensors)


def apply_bytes(i):  # x read, result written, cos and sin read
    return rw_bytes(i, i.q) + i.table_bytes()


def inplace_bytes(i, positions):
    return rw_bytes(i, i.q, i.k) + i.nbytes(positions) + i.table_bytes()


def cache_bytes(i):  # q, k in place; v read; k and v written to the caches; slots read
    return (inplace_bytes(i, i.positions) + i.nbytes(i.v) + i.nbytes(i.k) + i.nbytes(i.v)
            + i.nbytes(i.slots))


def unfused_cache(i):
    def run():
        rope_ext.apply_rope_(i.q, i.k, i.positions, i.cache)
        eq.cache_write(i.k, i.v, i.key_cache, i.value_cache, i.slots)
    return run


OPS = {
    o.name: o for o in (
        Op("apply", "clone", "rope_ext.apply_rope(x, cos, sin): a new rotated tensor", apply_bytes,
           lambda i: lambda: rope_ext.apply_rope(i.q, i.cos, i.sin),
           (eq.apply, lambda i: (i.q, i.cos, i.sin))),
        Op("apply.out", "copy", "rope_ext.apply_rope(x, cos, sin, out=out)", apply_bytes,
           lambda i: lambda: rope_ext.apply_rope(i.q, i.cos, i.sin, out=i.out),
           (eq.apply_out, lambda i: (i.q, i.cos, i.sin, i.out))),
        Op("apply_backward", "clone", "torch.ops.rope.apply_backward(grad, cos, sin)", apply_bytes,
           lambda i: lambda: torch.ops.rope.apply_backward(i.grad, i.cos, i.sin, False),
           (eq.apply_backward, lambda i: (i.grad, i.cos, i.sin))),
        Op("apply_rope_at", "clone",
           "rope_ext.apply_rope_at(x, positions, cos_sin_cache) (rope.apply_positions)",
           lambda i: apply_bytes(i) + i.nbytes(i.positions),
           lambda i: lambda: rope_ext.apply_rope_at(i.q, i.positions, i.cache),
           (eq.apply_positions, lambda i: (i.q, i.positions, i.cos_t, i.sin_t))),
        Op("apply_", "copy", "rope_ext.apply_rope_(q, k, positions, cos_sin_cache): q and k in place",
           lambda i: inplace_bytes(i, i.positions),
           lambda i: lambda: rope_ext.apply_rope_(i.q, i.k, i.positions, i.cache),
           (eq.apply_, lambda i: (i.q, i.k, i.positions, i.cache))),
        Op("apply_mrope_", "copy", "rope_ext.apply_mrope_(q, k, positions (3, T), cache, section)",
           lambda i: inplace_bytes(i, i.positions3),
           lambda i: lambda: rope_ext.apply_mrope_(i.q, i.k, i.positions3, i.cache, i.section),
           (eq.mrope_, lambda i: (i.q, i.k, i.positions3, i.cache, i.section))),
        Op("apply_rope_and_cache_", "copy",
           "rope_ext.apply_rope_and_cache_: q, k in place + k, v into paged caches at slots",
           cache_bytes,
           lambda i: lambda: rope_ext.apply_rope_and_cache_(
               i.q, i.k, i.v, i.positions, i.cache, i.key_cache, i.value_cache, i.slots),
           (eq.apply_and_cache_, lambda i: (i.q, i.k, i.v, i.positions, i.cache, i.key_cache,
                                            i.value_cache, i.slots)),
           unfused=unfused_cache),
    )
}

LIMITS = {
    "copy": "out.copy_(x) into an existing buffer: the limit of in-place and out= ops",
    "clone": "x.clone(): an allocating copy, the limit of ops that return a new tensor",
}


def limit_rows(i):
    return [
        Row("copy", "limit", "", LIMITS["copy"], rw_bytes(i, i.q), lambda: i.out.copy_(i.q)),
        Row("clone", "limit", "", LIMITS["clone"], rw_bytes(i, i.q), lambda: i.q.clone()),
    ]


def _eager(fn, args):
    return lambda: fn(*args)


def _compiled(fn, args):
    # A fresh wrapper per case; the caller resets dynamo between cases, so no case runs into the
    # recompile limit and falls back to eager unnoticed (fullgraph: a graph break is an error).
    f = torch.compile(fn, dynamic=False, fullgraph=True)
    return lambda: f(*args)


def op_rows(i, ops, kinds):
    rows = []
    for name in ops:
        o = OPS[name]
        n = o.nbytes(i)
        if "rope_ext" in kinds:
            rows.append(Row(name, "rope_ext", name, o.what, n, o.rope_ext(i), o.limit))
        if o.unfused is not None and "unfused" in kinds:
            rows.append(Row(f"{name} unfused", "unfused", name,
                            "rope_ext.apply_rope_ then index_copy_ of k and v into the caches", n,
                            o.unfused(i), o.limit))
        fn, args = o.math
        if "eager" in kinds:
            rows.append(Row(f"{name} eager", "eager", name, f"bench equivalents.{fn.__name__}, eager",
                            n, _eager(fn, args(i)), o.limit))
        if "compile" in kinds:
            rows.append(Row(f"{name} compile", "compile", name,
                            f"torch.compile(bench equivalents.{fn.__name__}), fullgraph", n,
                            _compiled(fn, args(i)), o.limit))
    return rows
