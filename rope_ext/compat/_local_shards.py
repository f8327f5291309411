"""A drop-in whose peer takes each rank's local tensors (Transformer Engine's context parallelism:
cp_size, cp_rank) called with a DTensor: it runs on the local shards, without communication, and
the result takes the input's placements. The peer's own arguments say which part of the sequence
a rank holds, so the global order DTensor sees (say chunks 0, 3 | 1, 2 over two ranks) is a
permutation of the sequence, as in docs/distributed.md's load-balanced splits."""

from ._layout import is_dtensor


def _contiguous_strides(shape):
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def _check_rotated(t):
    for dim, p in enumerate(t.placements):
        if p.is_shard() and p.dim % t.dim() == t.dim() - 1:
            raise ValueError(f"t is sharded over its last dim (head_dim) on mesh dim {dim} ({p}): "
                             "the rotation pairs span head_dim; shard another dim")
        if p.is_partial() and p.reduce_op not in ("sum", "avg"):
            raise ValueError(f"t is {p} on mesh dim {dim}: only partial sums and averages can be "
                             "rotated shard by shard; redistribute it to Replicate() first")


def _local(arg, name, t):
    """A DTensor argument other than the rotated one, as its local tensor: it must be Replicate()
    (each rank reads its rows). The gradient flowing back to it is linear in t, so it is placed
    as t is on each mesh dim: a partial sum where t is sharded (each rank's tokens' part),
    partial like t where t is partial, and whole on every rank where t is replicated (each
    rank's part is then all of it: a partial sum there would count it once per rank)."""
    if not is_dtensor(arg):
        return arg
    from torch.distributed.tensor import Partial, Replicate

    if not all(p.is_replicate() for p in arg.placements):
        raise ValueError(f"{name} must be Replicate() on every mesh dim (each rank reads the rows "
                         f"of its own tokens), got {list(arg.placements)}")
    grads = [Partial("sum") if p.is_shard() else Partial(p.reduce_op) if p.is_partial()
             else Replicate() for p in t.placements]
    return arg.to_local(grad_placements=grads)


def on_local_shards(fn, t, *args, names):
    """fn(local shard of t, *args as local tensors) as a DTensor placed like t."""
    from torch.distributed.tensor import DTensor

    _check_rotated(t)
    out = fn(t.to_local(), *(_local(a, n, t) for a, n in zip(args, names)))
    return DTensor.from_local(out, t.device_mesh, t.placements, run_check=False,
                              shape=t.shape, stride=_contiguous_strides(t.shape))
