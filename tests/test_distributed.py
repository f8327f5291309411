"""rope ops on DTensors (rope_ext.distributed): two processes on the gloo backend (CPU) run every
op on head- and token-sharded DTensors and compare each rank's shard of the result with the same
shard of the single-process result on the full tensors. The supported layouts must run without
communication; the others must fail with a clear error and change nothing.

One pair of worker processes (this file run as a script with --worker) runs every case, once per
backend (reference, and native when built); each test asserts one case's outcome on both ranks.
"""

import json
import os
import subprocess
import sys
import tempfile
import time
import traceback

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import rope_ext  # noqa: E402

WORLD = 2
WORKER_TIMEOUT_S = 240

if __name__ != "__main__" and not (torch.distributed.is_available()
                                   and torch.distributed.is_gloo_available()):
    pytest.skip("needs torch.distributed with the gloo backend", allow_module_level=True)

CASES = {}  # name -> function(run), in order


def case(fn):
    CASES[fn.__name__.removeprefix("case_")] = fn
    return fn


# ---------------------------------------------------------------------------------------------
# The worker side: one rank, every case
# ---------------------------------------------------------------------------------------------

class Run:
    """One rank: the mesh, DTensor builders, and checks of local shards against the same shard of
    the single-process result (no collectives, so a failing check cannot hang the other rank)."""

    def __init__(self, mesh):
        from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

        self.mesh, self.DTensor = mesh, DTensor
        self.S, self.R, self.P = Shard, Replicate(), Partial
        self._distribute = distribute_tensor

    def d(self, t, *placements, mesh=None):
        """t (the same on every rank: same seed) as a DTensor; each rank keeps its own shard.
        One placement on a 2-D mesh means that placement on both mesh dims."""
        mesh = mesh or self.mesh
        if len(placements) == 1 and mesh.ndim > 1:
            placements = placements * mesh.ndim
        return self._distribute(t.detach(), mesh, list(placements), src_data_rank=None)

    def partial(self, t, reduce_op="sum"):
        """t as Partial(reduce_op): addends (sum), shares (avg), or t on rank 0 and smaller
        values elsewhere (max)."""
        rank, n = self.mesh.get_local_rank(), self.mesh.size()
        noise = torch.randn(t.shape, generator=torch.Generator().manual_seed(7), dtype=t.dtype)
        if reduce_op == "sum":
            local = t - noise * (n - 1) if rank == 0 else noise
        elif reduce_op == "avg":
            local = t * n - noise * (n - 1) if rank == 0 else noise
        else:
            local = t if rank == 0 else t - noise.abs() - 1
        return self.DTensor.from_local(local, self.mesh, [self.P(reduce_op)], run_check=False)

    def expect(self, actual, expected, placements, dtype=None):
        """actual: a DTensor with these placements whose local shard is that of `expected`."""
        assert isinstance(actual, self.DTensor), f"expected a DTensor, got {type(actual)}"
        mesh = actual.device_mesh
        if len(placements) == 1 and mesh.ndim > 1:
            placements = placements * mesh.ndim
        assert tuple(actual.placements) == tuple(placements), (
            f"placements {actual.placements}, expected {tuple(placements)}")
        want, got = self.d(expected, *placements, mesh=mesh).to_local(), actual.to_local()
        assert got.shape == want.shape, f"local shape {list(got.shape)}, want {list(want.shape)}"
        close(got, want, dtype or expected.dtype)

    def no_comm(self, fn, *args, **kwargs):
        """fn(*args, **kwargs), checking that it runs no collective (DTensor's CommDebugMode
        counts every one)."""
        from torch.distributed.tensor.debug import CommDebugMode

        with CommDebugMode() as comm:
            out = fn(*args, **kwargs)
        assert comm.get_total_counts() == 0, f"collectives run: {dict(comm.get_comm_counts())}"
        return out

    def fails(self, fragments, fn, *args, **kwargs):
        """fn(*args, **kwargs) raises a RuntimeError whose message holds every fragment."""
        try:
            fn(*args, **kwargs)
        except RuntimeError as e:
            for f in fragments:
                assert f in str(e), f"error message lacks {f!r}: {e}"
            return
        raise AssertionError(f"no error; expected one mentioning {fragments}")

    def unchanged(self, dt, before):
        """A rejected call left dt (built from `before`) as it was: layout and every element."""
        want = self.d(before, *dt.placements, mesh=dt.device_mesh)
        assert dt._spec == want._spec, f"a rejected call changed the layout: {dt._spec}"
        torch.testing.assert_close(dt.to_local(), want.to_local(), rtol=0, atol=0, equal_nan=True,
                                   msg="a rejected call changed its input")


def close(actual, expected, dtype):
    from tolerances import TOL

    rtol, atol = TOL[dtype]
    torch.testing.assert_close(actual.double(), expected.double(), rtol=rtol, atol=atol,
                               equal_nan=True)


def _main_worker(out_dir, seed, cases=None):
    """One rank: every case of `cases` (default this file's CASES), the outcomes to a JSON file."""
    import datetime

    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank,
                            world_size=WORLD, timeout=datetime.timedelta(seconds=60))
    import rope_ext.distributed  # noqa: F401  (registers the rules once DTensor loads, below)
    from torch.distributed.tensor import init_device_mesh

    torch.set_num_threads(1)
    run = Run(init_device_mesh("cpu", (WORLD,)))
    results = {"backend": rope_ext.backend("cpu")}
    cases = CASES if cases is None else cases
    for i, name in enumerate(cases):
        torch.manual_seed(seed + i)  # the same inputs on every rank
        try:
            cases[name](run)
            results[name] = "ok"
        except Exception:
            results[name] = traceback.format_exc(limit=-4)
        dist.barrier()  # the next case starts together (a rank that desynced times out here)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# The cases
# ---------------------------------------------------------------------------------------------

T, HQ, HK, D, ROT, MAXPOS = 6, 4, 2, 16, 12, 64  # rotary_dim 12 < head_dim 16: a copied tail
DTYPES = (torch.float32, torch.bfloat16)
HEAD_DIM_SHARDED = "sharded over its last dim (head_dim)"


def _table():
    return rope_ext.cos_sin_cache(MAXPOS, ROT)


def _rows(lead):
    """cos, sin for rope.apply: the table rows of random positions, shaped lead + (ROT/2,)."""
    n = 1
    for s in lead:
        n *= s
    rows = _table()[torch.randint(0, MAXPOS, (n,))]
    return (rows[:, : ROT // 2].reshape(*lead, ROT // 2),
            rows[:, ROT // 2 :].reshape(*lead, ROT // 2))


@case
def case_apply_tokens(run):
    """apply_rope: x (T, H, D) sharded over tokens (5 over 2 ranks: uneven); cos/sin (T, 1, R/2)
    sharded alike, or given Replicate (each rank takes its rows locally), or 1-D (Replicate)."""
    S, R = run.S, run.R
    for dtype in DTYPES:
        for il in (False, True):
            x = torch.randn(T - 1, HQ, D, dtype=dtype)
            cos, sin = _rows((T - 1, 1))
            want = rope_ext.apply_rope(x, cos, sin, interleaved=il)
            for pt in (S(0), R):
                got = run.no_comm(rope_ext.apply_rope, run.d(x, S(0)), run.d(cos, pt),
                                  run.d(sin, pt), interleaved=il)
                run.expect(got, want, [S(0)])
            c1, s1 = cos[0, 0], sin[0, 0]
            got = run.no_comm(rope_ext.apply_rope, run.d(x, S(0)), run.d(c1, R), run.d(s1, R),
                              interleaved=il)
            run.expect(got, rope_ext.apply_rope(x, c1, s1, interleaved=il), [S(0)])


@case
def case_apply_heads(run):
    """apply_rope: x sharded over heads; cos/sin (T, 1, R/2), broadcast over heads, Replicate."""
    S, R = run.S, run.R
    for dtype in DTYPES:
        x = torch.randn(T, HQ, D, dtype=dtype)
        cos, sin = _rows((T, 1))
        got = run.no_comm(rope_ext.apply_rope, run.d(x, S(1)), run.d(cos, R), run.d(sin, R))
        run.expect(got, rope_ext.apply_rope(x, cos, sin), [S(1)])


@case
def case_apply_batch_and_sequence(run):
    """apply_rope: x (B, S, H, D) sharded over the sequence (cos/sin (1, S, 1, R/2) sharded
    alike) or the batch (cos/sin broadcast over it: Replicate)."""
    S, R = run.S, run.R
    x = torch.randn(2, T, HQ, D)
    cos, sin = _rows((1, T, 1))
    want = rope_ext.apply_rope(x, cos, sin, interleaved=True)
    got = run.no_comm(rope_ext.apply_rope, run.d(x, S(1)), run.d(cos, S(1)), run.d(sin, S(1)),
                      interleaved=True)
    run.expect(got, want, [S(1)])
    got = run.no_comm(rope_ext.apply_rope, run.d(x, S(0)), run.d(cos, R), run.d(sin, R),
                      interleaved=True)
    run.expect(got, want, [S(0)])


@case
def case_apply_out(run):
    """apply_rope(..., out=): out (poisoned with NaN) placed like x is written and returned."""
    S, R = run.S, run.R
    for dtype in DTYPES:
        x = torch.randn(T, HQ, D, dtype=dtype)
        cos, sin = _rows((T, 1))
        want = rope_ext.apply_rope(x, cos, sin)
        for px, pt in ((S(0), S(0)), (S(1), R), (R, R)):
            out = run.d(torch.full_like(x, float("nan")), px)
            got = run.no_comm(rope_ext.apply_rope, run.d(x, px), run.d(cos, pt), run.d(sin, pt),
                              out=out)
            assert got is out
            run.expect(out, want, [px])


@case
def case_repeated_calls(run):
    """The same call again takes DTensor's cached sharding decision (its C++ fast path): the
    results stay right, apply.out still goes through its handler, in-place ops still write."""
    S, R = run.S, run.R
    x = torch.randn(T, HQ, D)
    cos, sin = _rows((T, 1))
    table, pos = _table(), torch.randint(0, MAXPOS, (T,))
    want = rope_ext.apply_rope(x, cos, sin)
    q1 = x.clone()
    rope_ext.apply_rope_(q1, None, pos, table)
    for _ in range(3):
        out = run.d(torch.full_like(x, float("nan")), S(0))
        assert rope_ext.apply_rope(run.d(x, S(0)), run.d(cos, S(0)), run.d(sin, S(0)),
                                   out=out) is out
        run.expect(out, want, [S(0)])
        dq = run.d(x, S(1))
        rope_ext.apply_rope_(dq, None, run.d(pos, R), run.d(table, R))
        run.expect(dq, q1, [S(1)])
    for _ in range(2):
        _fused(run, HQ, HK, S(1), S(1), S(1), S(2))


@case
def case_apply_out_misplaced(run):
    """out placed unlike the result: an error naming out, out left as it was."""
    S = run.S
    x = torch.randn(T, HQ, D)
    cos, sin = _rows((T, 1))
    poison = torch.full_like(x, float("nan"))
    out = run.d(poison, S(1))
    run.fails(("rope.apply.out", "out is written in place", "[Shard(0)]", "[Shard(1)]"),
              rope_ext.apply_rope, run.d(x, S(0)), run.d(cos, S(0)), run.d(sin, S(0)), out=out)
    run.unchanged(out, poison)


@case
def case_apply_backward_op(run):
    """rope.apply_backward (the inverse rotation) on token- and head-sharded gradients."""
    S, R = run.S, run.R
    op = torch.ops.rope.apply_backward
    g = torch.randn(T, HQ, D)
    cos, sin = _rows((T, 1))
    for il in (False, True):
        want = op(g, cos, sin, il)
        for pg, pt in ((S(0), S(0)), (S(1), R)):
            got = run.no_comm(op, run.d(g, pg), run.d(cos, pt), run.d(sin, pt), il)
            run.expect(got, want, [pg])


@case
def case_apply_partial(run):
    """The rotation is linear: Partial('sum') / Partial('avg') x gives a partial result with no
    communication; Partial('max') is reduced first (DTensor all-reduces it)."""
    R = run.R
    x = torch.randn(T, HQ, D)
    cos, sin = _rows((T, 1))
    want = rope_ext.apply_rope(x, cos, sin)
    c, s = run.d(cos, R), run.d(sin, R)
    for op in ("sum", "avg"):
        got = run.no_comm(rope_ext.apply_rope, run.partial(x, op), c, s)
        assert tuple(got.placements) == (run.P(op),), got.placements
        torch.testing.assert_close(got.full_tensor(), want, rtol=1e-5, atol=1e-5)
    run.expect(rope_ext.apply_rope(run.partial(x, "max"), c, s), want, [R])


@case
def case_apply_autograd(run):
    """Gradients through apply_rope w.r.t. x, cos and sin, token- and head-sharded."""
    S, R = run.S, run.R
    x, w = torch.randn(T, HQ, D), torch.randn(T, HQ, D)
    cos, sin = _rows((T, 1))
    leaves = [t.clone().requires_grad_() for t in (x, cos, sin)]
    (rope_ext.apply_rope(*leaves, interleaved=True) * w).sum().backward()
    for px, pt in ((S(0), S(0)), (S(1), R)):
        dx, dc, ds = (run.d(t, p).requires_grad_() for t, p in ((x, px), (cos, pt), (sin, pt)))
        (rope_ext.apply_rope(dx, dc, ds, interleaved=True) * run.d(w, px)).sum().backward()
        run.expect(dx.grad, leaves[0].grad, [px])
        for dt, ref in ((dc, leaves[1]), (ds, leaves[2])):
            close(dt.grad.full_tensor(), ref.grad, torch.float32)


@case
def case_head_dim_sharded(run):
    """head_dim (the last dim) sharded: an error from every op, nothing written."""
    S, R = run.S, run.R
    x = torch.randn(T, HQ, D)
    cos, sin = _rows((T, 1))
    c, s = run.d(cos, R), run.d(sin, R)
    pos, table = run.d(torch.arange(T), R), run.d(_table(), R)
    run.fails(("rope.apply:", "x is", HEAD_DIM_SHARDED), rope_ext.apply_rope, run.d(x, S(2)), c, s)
    out = run.d(torch.zeros_like(x), S(2))
    run.fails(("rope.apply.out:", HEAD_DIM_SHARDED), rope_ext.apply_rope, run.d(x, S(2)), c, s,
              out=out)
    run.unchanged(out, torch.zeros_like(x))
    run.fails(("rope.apply_backward:", "grad is", HEAD_DIM_SHARDED),
              torch.ops.rope.apply_backward, run.d(x, S(2)), c, s, False)
    q = run.d(x, S(2))
    run.fails(("rope.apply_:", "query is", HEAD_DIM_SHARDED), rope_ext.apply_rope_, q, None, pos,
              table)
    run.unchanged(q, x)
    run.fails(("rope.apply_positions.cache:", HEAD_DIM_SHARDED), rope_ext.apply_rope_at,
              run.d(x, S(2)), pos, table)


@case
def case_at_tokens_and_heads(run):
    """apply_rope_at (rope.apply_positions.cache): tokens sharded with positions sharded alike (or
    given Replicate: each rank takes its own), heads sharded with positions Replicate."""
    S, R = run.S, run.R
    table = _table()
    for dtype in DTYPES:
        for il in (False, True):
            x = torch.randn(T - 1, HQ, D, dtype=dtype)
            pos = torch.randint(0, MAXPOS, (T - 1,))
            want = rope_ext.apply_rope_at(x, pos, table, interleaved=il)
            for px, pp in ((S(0), S(0)), (S(0), R), (S(1), R)):
                got = run.no_comm(rope_ext.apply_rope_at, run.d(x, px), run.d(pos, pp),
                                  run.d(table, R), interleaved=il)
                run.expect(got, want, [px])


@case
def case_at_flattened_batch(run):
    """(batch, tokens, ...) x with its tokens sharded, then flattened to (batch * tokens, ...),
    positions flattened alike: both _StridedShard, the one layout of positions that fits x
    (refused once as "split over the mesh dims in another order"); apply_rope_at and
    apply_rope_ in place, no collective."""
    S, R = run.S, run.R
    table = _table()
    x, pos = torch.randn(2, T, HQ, D), torch.randint(0, MAXPOS, (2, T))
    want = rope_ext.apply_rope_at(x.flatten(0, 1), pos.flatten(), table)
    dx, dpos = run.d(x, S(1)).flatten(0, 1), run.d(pos, S(1)).flatten()
    got = run.no_comm(rope_ext.apply_rope_at, dx, dpos, run.d(table, R))
    assert got.placements == dx.placements
    close(got.full_tensor(), want, x.dtype)
    run.no_comm(rope_ext.apply_rope_, dx, None, dpos, run.d(table, R))
    close(dx.full_tensor(), want, x.dtype)


@case
def case_at_mrope(run):
    """apply_rope_at with mrope_section: positions (3, T) sharded over dim 1 like x's tokens."""
    S, R = run.S, run.R
    table = _table()
    x = torch.randn(T, HQ, D)
    pos = torch.randint(0, MAXPOS, (3, T))
    for mi in (False, True):
        want = rope_ext.apply_rope_at(x, pos, table, mrope_section=[2, 2, 2], mrope_interleaved=mi)
        for px, pp in ((S(0), S(1)), (S(1), R)):
            got = run.no_comm(rope_ext.apply_rope_at, run.d(x, px), run.d(pos, pp),
                              run.d(table, R), mrope_section=[2, 2, 2], mrope_interleaved=mi)
            run.expect(got, want, [px])


@case
def case_at_flat_head_size(run):
    """vLLM's flat (T, H * D) layout sharded over H * D (tensor parallelism), head_size=D: the
    heads view keeps the heads sharded."""
    S, R = run.S, run.R
    table = _table()
    x = torch.randn(T, HQ * D)
    pos = torch.randint(0, MAXPOS, (T,))
    got = run.no_comm(rope_ext.apply_rope_at, run.d(x, S(1)), run.d(pos, R), run.d(table, R),
                      head_size=D)
    run.expect(got, rope_ext.apply_rope_at(x, pos, table, head_size=D), [S(1)])


@case
def case_at_autograd(run):
    """Gradient through apply_rope_at w.r.t. x: the inverse rotation, sharded like x."""
    S, R = run.S, run.R
    x, w = torch.randn(T, HQ, D), torch.randn(T, HQ, D)
    pos = torch.randint(0, MAXPOS, (T,))
    table = _table()
    xr = x.clone().requires_grad_()
    (rope_ext.apply_rope_at(xr, pos, table, interleaved=True) * w).sum().backward()
    for px, pp in ((S(0), S(0)), (S(1), R)):
        dx = run.d(x, px).requires_grad_()
        y = rope_ext.apply_rope_at(dx, run.d(pos, pp), run.d(table, R), interleaved=True)
        (y * run.d(w, px)).sum().backward()
        run.expect(dx.grad, xr.grad, [px])


@case
def case_table_grads(run):
    """Gradients w.r.t. the replicated cos_sin_cache through apply_rope_at and apply_rope_,
    tokens and heads sharded: each rank's rows, summed over the ranks by DTensor's own ops."""
    S, R = run.S, run.R
    x, y = torch.randn(T, HQ, D), torch.randn(T, HK, D)
    wq, wk = torch.randn(T, HQ, D), torch.randn(T, HK, D)
    pos = torch.randint(0, MAXPOS, (T,))
    table = _table()
    t1 = table.clone().requires_grad_()
    (rope_ext.apply_rope_at(x, pos, t1) * wq).sum().backward()
    t2 = table.clone().requires_grad_()
    q, k = x.clone(), y.clone()
    rope_ext.apply_rope_(q, k, pos, t2)
    ((q * wq).sum() + (k * wk).sum()).backward()
    for p, pp in ((S(0), S(0)), (S(1), R)):
        dt = run.d(table, R).requires_grad_()
        (rope_ext.apply_rope_at(run.d(x, p), run.d(pos, pp), dt) * run.d(wq, p)).sum().backward()
        close(dt.grad.full_tensor(), t1.grad, torch.float32)
        dt = run.d(table, R).requires_grad_()
        q, k = run.d(x, p), run.d(y, p)
        rope_ext.apply_rope_(q, k, run.d(pos, pp), dt)
        ((q * run.d(wq, p)).sum() + (k * run.d(wk, p)).sum()).backward()
        close(dt.grad.full_tensor(), t2.grad, torch.float32)


@case
def case_mrope_table_grads(run):
    """The same through apply_mrope_ and apply_rope_at with mrope_section, positions (3, T)
    sharded over their tokens (the gradient's index of each pair's component was once a plain
    tensor, which DTensor refused: "got mixed torch.Tensor and DTensor")."""
    S, R = run.S, run.R
    x, y = torch.randn(T, HQ, D), torch.randn(T, HK, D)
    wq, wk = torch.randn(T, HQ, D), torch.randn(T, HK, D)
    pos = torch.randint(0, MAXPOS, (3, T))
    table, section = _table(), [2, 2, 2]
    for mi in (False, True):
        t1 = table.clone().requires_grad_()
        (rope_ext.apply_rope_at(x, pos, t1, mrope_section=section, mrope_interleaved=mi)
         * wq).sum().backward()
        t2 = table.clone().requires_grad_()
        q, k = x.clone(), y.clone()
        rope_ext.apply_mrope_(q, k, pos, t2, section, mrope_interleaved=mi)
        ((q * wq).sum() + (k * wk).sum()).backward()
        for p, pp in ((S(0), S(1)), (S(1), R)):
            dt = run.d(table, R).requires_grad_()
            (rope_ext.apply_rope_at(run.d(x, p), run.d(pos, pp), dt, mrope_section=section,
                                    mrope_interleaved=mi) * run.d(wq, p)).sum().backward()
            close(dt.grad.full_tensor(), t1.grad, torch.float32)
            dt = run.d(table, R).requires_grad_()
            q, k = run.d(x, p), run.d(y, p)
            rope_ext.apply_mrope_(q, k, run.d(pos, pp), dt, section, mrope_interleaved=mi)
            ((q * run.d(wq, p)).sum() + (k * run.d(wk, p)).sum()).backward()
            close(dt.grad.full_tensor(), t2.grad, torch.float32)


def _in_place(run, q, k, pos, qp, kp, pp, **kw):
    """apply_rope_ on DTensors placed (qp, kp, pp) against the single-process call."""
    R = run.R
    table = _table()
    q1, k1 = q.clone(), None if k is None else k.clone()
    rope_ext.apply_rope_(q1, k1, pos, table, **kw)
    dq, dk = run.d(q, qp), None if k is None else run.d(k, kp)
    rq, rk = run.no_comm(rope_ext.apply_rope_, dq, dk, run.d(pos, pp), run.d(table, R), **kw)
    assert rq is dq and rk is dk
    run.expect(dq, q1, [qp])
    if k is not None:
        run.expect(dk, k1, [kp])


@case
def case_in_place_tokens_gqa(run):
    """apply_rope_: query (T, 4, D), key (T, 2, D) sharded over tokens (5 over 2 ranks),
    positions sharded alike or given Replicate."""
    S, R = run.S, run.R
    for dtype in DTYPES:
        for il in (False, True):
            q, k = torch.randn(T - 1, HQ, D, dtype=dtype), torch.randn(T - 1, HK, D, dtype=dtype)
            pos = torch.randint(0, MAXPOS, (T - 1,), dtype=torch.int32)
            for pp in (S(0), R):
                _in_place(run, q, k, pos, S(0), S(0), pp, interleaved=il)


@case
def case_in_place_heads_gqa(run):
    """apply_rope_: query and key sharded over their heads (tensor parallelism), positions
    Replicate; also one kv head (MQA) replicated while the query heads are sharded."""
    S, R = run.S, run.R
    for dtype in DTYPES:
        for il in (False, True):
            q, k = torch.randn(T, HQ, D, dtype=dtype), torch.randn(T, HK, D, dtype=dtype)
            pos = torch.randint(0, MAXPOS, (T,))
            _in_place(run, q, k, pos, S(1), S(1), R, interleaved=il)
            _in_place(run, q, torch.randn(T, 1, D, dtype=dtype), pos, S(1), R, R, interleaved=il)


@case
def case_in_place_key_none_and_4d(run):
    """apply_rope_ without key; and (B, S, H, D) sharded over the sequence (positions (B, S)
    sharded alike) or the heads."""
    S, R = run.S, run.R
    _in_place(run, torch.randn(T, HQ, D), None, torch.randint(0, MAXPOS, (T,)), S(0), None, S(0))
    q, k, pos = torch.randn(2, T, HQ, D), torch.randn(2, T, HK, D), torch.randint(0, MAXPOS, (2, T))
    _in_place(run, q, k, pos, S(1), S(1), S(1))
    _in_place(run, q, k, pos, S(2), S(2), R)


@case
def case_in_place_flat_head_size(run):
    """apply_rope_ on flat (T, H * D) query/key sharded over H * D, head_size=D."""
    S, R = run.S, run.R
    _in_place(run, torch.randn(T, HQ * D), torch.randn(T, HK * D), torch.randint(0, MAXPOS, (T,)),
              S(1), S(1), R, head_size=D)


@case
def case_in_place_implicit_replication(run):
    """Plain positions and table under DTensor's implicit_replication(): taken as Replicate,
    each rank uses the positions of its own tokens, with no communication."""
    from torch.distributed.tensor.experimental import implicit_replication

    S = run.S
    table = _table()
    q, k = torch.randn(T, HQ, D), torch.randn(T, HK, D)
    pos = torch.randint(0, MAXPOS, (T,))
    q1, k1 = q.clone(), k.clone()
    rope_ext.apply_rope_(q1, k1, pos, table)
    dq, dk = run.d(q, S(0)), run.d(k, S(0))
    with implicit_replication():
        run.no_comm(rope_ext.apply_rope_, dq, dk, pos, table)
    run.expect(dq, q1, [S(0)])
    run.expect(dk, k1, [S(0)])


@case
def case_rotary_embedding_module(run):
    """RotaryEmbedding (its table a plain buffer) under implicit_replication(): forward and
    forward_ on token- and head-sharded query/key."""
    from torch.distributed.tensor.experimental import implicit_replication

    S, R = run.S, run.R
    rope = rope_ext.RotaryEmbedding(D, rotary_dim=ROT, max_position=MAXPOS)
    q, k = torch.randn(T, HQ, D), torch.randn(T, HK, D)
    pos = torch.randint(0, MAXPOS, (T,))
    wq, wk = rope(q, k, pos)
    for p, pp in ((S(0), S(0)), (S(1), R)):
        with implicit_replication():
            gq, gk = run.no_comm(rope, run.d(q, p), run.d(k, p), run.d(pos, pp))
            dq, dk = run.d(q, p), run.d(k, p)
            run.no_comm(rope.forward_, dq, dk, run.d(pos, pp))
        for got in (gq, dq):
            run.expect(got, wq, [p])
        for got in (gk, dk):
            run.expect(got, wk, [p])


@case
def case_dynamic_ntk_module(run):
    """A dynamic-NTK RotaryEmbedding under implicit_replication(), positions a DTensor
    (Replicate, or sharded with the tokens): the length state advances as on one process (the
    longest position over every rank), and query/key rotate by the grown base."""
    from torch.distributed.tensor.experimental import implicit_replication

    S, R = run.S, run.R
    scaling = {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 16}
    q, k = torch.randn(T, HQ, D), torch.randn(T, HK, D)
    pos = torch.tensor([0, 1, 2, 40, 5, 6])  # the long position on the first rank's tokens
    single = rope_ext.RotaryEmbedding(D, rotary_dim=ROT, max_position=MAXPOS, scaling=scaling)
    wq, wk = single(q, k, pos)
    for p, pp in ((S(1), R), (S(0), S(0))):
        rope = rope_ext.RotaryEmbedding(D, rotary_dim=ROT, max_position=MAXPOS, scaling=scaling)
        dq, dk = run.d(q, p), run.d(k, p)
        with implicit_replication():
            gq, gk = rope(run.d(q, p), run.d(k, p), run.d(pos, pp))
            rope.forward_(dq, dk, run.d(pos, pp))
        assert int(rope.dynamic_len) == int(single.dynamic_len) == 41
        for got in (gq, dq):
            run.expect(got, wq, [p])
        for got in (gk, dk):
            run.expect(got, wk, [p])
    # One token over the two ranks: one shard is empty (its max reduced to nothing, where it
    # raised alone and left the other rank waiting), and a position out of range is refused by
    # every rank alike, for dynamic and longrope modules.
    longrope = {"rope_type": "longrope", "short_factor": [1.0] * (ROT // 2),
                "long_factor": [2.0] * (ROT // 2), "original_max_position_embeddings": 16}
    for scale in (scaling, longrope):
        single = rope_ext.RotaryEmbedding(D, rotary_dim=ROT, max_position=MAXPOS, scaling=scale)
        wq, wk = single(q[:1], k[:1], pos[3:4])
        rope = rope_ext.RotaryEmbedding(D, rotary_dim=ROT, max_position=MAXPOS, scaling=scale)
        with implicit_replication():
            gq, gk = rope(run.d(q[:1], S(0)), run.d(k[:1], S(0)), run.d(pos[3:4], S(0)))
            run.expect(gq, wq, [S(0)])
            run.expect(gk, wk, [S(0)])
            bad = pos.clone()
            bad[-1] = MAXPOS  # on the last rank's tokens only
            run.fails([f"RotaryEmbedding: positions must lie in [0, {MAXPOS})", f"got {MAXPOS}"],
                      rope, run.d(q, S(0)), run.d(k, S(0)), run.d(bad, S(0)))


@case
def case_dynamic_ntk_module_compiled_with_no_tokens(run):
    """Compiled (dynamic shapes), a call with no tokens keeps the length: 40 -> 0 -> 20 tokens
    rotate as on one process, positions Replicate or sharded with the tokens."""
    from torch.distributed.tensor.experimental import implicit_replication

    S, R = run.S, run.R
    scaling = {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 16}
    for p, pp in ((S(1), R), (S(0), S(0))):
        torch._dynamo.reset()
        single = rope_ext.RotaryEmbedding(D, rotary_dim=ROT, max_position=MAXPOS, scaling=scaling)
        rope = rope_ext.RotaryEmbedding(D, rotary_dim=ROT, max_position=MAXPOS, scaling=scaling)
        compiled = torch.compile(rope, backend="aot_eager", dynamic=True)
        for n in (40, 0, 20):
            q, k, pos = torch.randn(n, HQ, D), torch.randn(n, HK, D), torch.randperm(n)
            wq, wk = single(q, k, pos)
            with implicit_replication():
                gq, gk = compiled(run.d(q, p), run.d(k, p), run.d(pos, pp))
            assert int(rope.dynamic_len) == int(single.dynamic_len) == 40
            run.expect(gq, wq, [p])
            run.expect(gk, wk, [p])


@case
def case_in_place_partial_sum(run):
    """A Partial('sum') query stays partial (the rotation is linear)."""
    R = run.R
    table = _table()
    q, pos = torch.randn(T, HQ, D), torch.randint(0, MAXPOS, (T,))
    q1 = q.clone()
    rope_ext.apply_rope_(q1, None, pos, table)
    dq = run.partial(q)
    run.no_comm(rope_ext.apply_rope_, dq, None, run.d(pos, R), run.d(table, R))
    torch.testing.assert_close(dq.full_tensor(), q1, rtol=1e-5, atol=1e-5)


@case
def case_in_place_offset_inverse(run):
    """apply_rope_ with rope_dim_offset (the tail of each head, DeepSeek-V4) and inverse, on
    token- and head-sharded query and key: each rank rotates its shard, no communication."""
    S, R = run.S, run.R
    q, k = torch.randn(T, HQ, D), torch.randn(T, HK, D)
    pos = torch.randint(0, MAXPOS, (T,))
    for qp, kp, pp in ((S(0), S(0), S(0)), (S(1), S(1), R), (R, S(1), R)):
        _in_place(run, q, k, pos, qp, kp, pp, rope_dim_offset=D - ROT, inverse=True)
        _in_place(run, q, k, pos, qp, kp, pp, rope_dim_offset=1)


@case
def case_shift_kv_cache(run):
    """K-shift of a key cache replicated or sharded over its kv heads: each rank rotates its
    heads of the listed slots, no communication; other layouts are refused, nothing written."""
    S, R = run.S, run.R
    kc = torch.randn(3, 4, HK, D)
    slots, delta, table = torch.tensor([5, -1, 0, 11]), torch.tensor([3, 9, -2, 1]), _table()
    want = kc.clone()
    rope_ext.shift_kv_cache_(want, slots, delta, table)
    for p in (R, S(2)):
        dk = run.d(kc.clone(), p)  # a Replicate DTensor may share kc's memory
        run.no_comm(rope_ext.shift_kv_cache_, dk, run.d(slots, R), run.d(delta, R), run.d(table, R))
        run.expect(dk, want, [p])
    for p, what in ((S(0), "sharded over its blocks"), (S(3), "Shard(3)")):
        dk = run.d(kc.clone(), p)
        run.fails(("rope.shift_kv_cache_:", what), rope_ext.shift_kv_cache_, dk, run.d(slots, R),
                  run.d(delta, R), run.d(table, R))
        run.unchanged(dk, kc)


@case
def case_in_place_autograd(run):
    """Gradients through apply_rope_ (query and key non-leaf, rotated in place) w.r.t. their
    leaves: the inverse rotation, token- and head-sharded."""
    S, R = run.S, run.R
    x, y = torch.randn(T, HQ, D), torch.randn(T, HK, D)
    wq, wk = torch.randn(T, HQ, D), torch.randn(T, HK, D)
    pos = torch.randint(0, MAXPOS, (T,))
    table = _table()
    xr, yr = x.clone().requires_grad_(), y.clone().requires_grad_()
    q, k = xr * 1, yr * 1
    rope_ext.apply_rope_(q, k, pos, table)
    ((q * wq).sum() + (k * wk).sum()).backward()
    for p, pp in ((S(0), S(0)), (S(1), R)):
        dx, dy = run.d(x, p).requires_grad_(), run.d(y, p).requires_grad_()
        q, k = dx * 1, dy * 1
        rope_ext.apply_rope_(q, k, run.d(pos, pp), run.d(table, R))
        ((q * run.d(wq, p)).sum() + (k * run.d(wk, p)).sum()).backward()
        run.expect(dx.grad, xr.grad, [p])
        run.expect(dy.grad, yr.grad, [p])


@case
def case_in_place_rejected(run):
    """Layouts apply_rope_ cannot run without moving a tensor it writes: an error, nothing
    written."""
    S, R = run.S, run.R
    table = run.d(_table(), R)
    alike = "must be sharded alike over the token dims"
    q, k = torch.randn(T, HQ, D), torch.randn(T, HK, D)
    pos = run.d(torch.randint(0, MAXPOS, (T,)), R)
    dq, dk = run.d(q, S(0)), run.d(k, R)
    run.fails(("rope.apply_:", alike), rope_ext.apply_rope_, dq, dk, pos, table)
    run.unchanged(dq, q)
    run.unchanged(dk, k)
    q4, k4 = torch.randn(2, T, HQ, D), torch.randn(2, T, HK, D)
    dq, dk = run.d(q4, S(0)), run.d(k4, S(1))
    run.fails((alike,), rope_ext.apply_rope_, dq, dk,
              run.d(torch.randint(0, MAXPOS, (2, T)), R), table)
    run.unchanged(dq, q4)
    run.unchanged(dk, k4)
    dq = run.partial(q, "max")
    before = dq.to_local().clone()
    run.fails(("query is Partial('max')", "redistribute query to Replicate()"),
              rope_ext.apply_rope_, dq, None, pos, table)
    assert torch.equal(dq.to_local(), before)


@case
def case_out_of_range_position_on_one_rank(run):
    """No communication means no global check: a position out of range on one rank's shard
    raises on that rank only (its shard unchanged); the other rank rotates its tokens."""
    S, R = run.S, run.R
    table = _table()
    q, pos = torch.randn(T, HQ, D), torch.randint(0, MAXPOS, (T,))
    pos[-1] = MAXPOS  # in the last rank's shard
    dq = run.d(q, S(0))
    if run.mesh.get_local_rank() == WORLD - 1:
        run.fails(("rope.apply_:", f"must lie in [0, {MAXPOS})"), rope_ext.apply_rope_, dq, None,
                  run.d(pos, S(0)), run.d(table, R))
        run.unchanged(dq, q)
    else:
        q1 = q.clone()
        rope_ext.apply_rope_(q1[:-1], None, pos[:-1], table)
        rope_ext.apply_rope_(dq, None, run.d(pos, S(0)), run.d(table, R))
        run.expect(dq, q1, [S(0)])


@case
def case_mrope(run):
    """apply_mrope_: query/key sharded over tokens (positions (3, T) sharded over dim 1) or
    heads (positions Replicate), chunked and interleaved sections."""
    S, R = run.S, run.R
    table = _table()
    for mi in (False, True):
        q, k = torch.randn(T, HQ, D), torch.randn(T, HK, D)
        pos = torch.randint(0, MAXPOS, (3, T))
        q1, k1 = q.clone(), k.clone()
        rope_ext.apply_mrope_(q1, k1, pos, table, [2, 2, 2], mrope_interleaved=mi)
        for p, pp in ((S(0), S(1)), (S(1), R)):
            dq, dk = run.d(q, p), run.d(k, p)
            run.no_comm(rope_ext.apply_mrope_, dq, dk, run.d(pos, pp), run.d(table, R),
                        [2, 2, 2], mrope_interleaved=mi)
            run.expect(dq, q1, [p])
            run.expect(dk, k1, [p])


def _cache_inputs(hq, hk, dtype=torch.float32, kv_cache_dtype="auto"):
    nb, bs, dv = 4, 4, 8
    q, k = torch.randn(T, hq, D, dtype=dtype), torch.randn(T, hk, D, dtype=dtype)
    v = torch.randn(T, hk, dv, dtype=dtype)
    pos = torch.randint(0, MAXPOS, (T,))
    slots = torch.randperm(nb * bs)[:T]
    slots[1] = -1  # padding: skipped
    cdtype = dtype if kv_cache_dtype == "auto" else torch.float8_e4m3fn
    kc, vc = torch.randn(nb, bs, hk, D).to(cdtype), torch.randn(nb, bs, hk, dv).to(cdtype)
    return q, k, v, pos, kc, vc, slots


def _fused(run, hq, hk, qp, kp, vp, cp, dtype=torch.float32, kv_cache_dtype="auto"):
    """apply_rope_and_cache_ on DTensors placed (qp, kp, vp, caches cp) against the
    single-process call."""
    R = run.R
    table = _table()
    q, k, v, pos, kc, vc, slots = _cache_inputs(hq, hk, dtype, kv_cache_dtype)
    scales = {}
    if kv_cache_dtype != "auto":
        scales = dict(k_scale=torch.tensor([0.5]), v_scale=torch.tensor([2.0]))
    q1, k1, kc1, vc1 = q.clone(), k.clone(), kc.clone(), vc.clone()
    rope_ext.apply_rope_and_cache_(q1, k1, v, pos, table, kc1, vc1, slots,
                                   kv_cache_dtype=kv_cache_dtype, **scales)
    dq, dk, dkc, dvc = run.d(q, qp), run.d(k, kp), run.d(kc, cp), run.d(vc, cp)
    run.no_comm(rope_ext.apply_rope_and_cache_, dq, dk, run.d(v, vp), run.d(pos, R),
                run.d(table, R), dkc, dvc, run.d(slots, R), kv_cache_dtype=kv_cache_dtype,
                **{n: run.d(s, R) for n, s in scales.items()})
    run.expect(dq, q1, [qp])
    run.expect(dk, k1, [kp])
    if kv_cache_dtype == "auto":
        run.expect(dkc, kc1, [cp])
        run.expect(dvc, vc1, [cp])
        return
    for got, want in ((dkc, kc1), (dvc, vc1)):  # fp8 codes: within one step of e4m3 (2^-3)
        want = run.d(want.float(), cp).to_local()
        torch.testing.assert_close(got.to_local().float(), want, rtol=0.125, atol=2e-3)


@case
def case_cache_heads_gqa(run):
    """apply_rope_and_cache_ under tensor parallelism: query, key, value sharded over heads
    (4 query heads, 2 kv heads), the paged caches over their kv heads (Shard(2)), slot_mapping
    (with padding) and positions Replicate; value given Replicate is taken shard by shard."""
    S, R = run.S, run.R
    for dtype in DTYPES:
        _fused(run, HQ, HK, S(1), S(1), S(1), S(2), dtype)
    _fused(run, HQ, HK, S(1), S(1), R, S(2))


@case
def case_cache_kv_replicated(run):
    """One kv head (MQA) replicated, with replicated caches, while the query heads are sharded:
    every rank writes the same cache."""
    S, R = run.S, run.R
    _fused(run, HQ, 1, S(1), R, R, R)


@case
def case_cache_uneven_heads(run):
    """3 query heads and 1 kv head over 2 ranks: shards of 2 and 1 query heads, 1 and 0 kv
    heads (the second rank rotates and writes no kv head)."""
    S = run.S
    _fused(run, 3, 1, S(1), S(1), S(1), S(2))


@case
def case_cache_fp8(run):
    """fp8 paged caches (kv_cache_dtype 'fp8', scales Replicate), heads sharded."""
    S = run.S
    _fused(run, HQ, HK, S(1), S(1), S(1), S(2), kv_cache_dtype="fp8")


@case
def case_cache_rejected(run):
    """Layouts the fused op cannot run without communication: tokens sharded (each rank would
    write only its tokens into the caches), caches placed unlike key, caches sharded over
    blocks or head_dim, key partial: each an error, nothing written."""
    S, R = run.S, run.R
    table = run.d(_table(), R)
    q, k, v, pos, kc, vc, slots = _cache_inputs(HQ, HK)
    pos, slots = run.d(pos, R), run.d(slots, R)

    def attempt(placements, fragments, dk=None):
        """The call with query, key, value, key_cache, value_cache placed so (dk: key as
        given) fails naming the fragments."""
        qp, kp, vp, kcp, vcp = placements
        dq, dkc, dvc = run.d(q, qp), run.d(kc, kcp), run.d(vc, vcp)
        dk = run.d(k, kp) if dk is None else dk
        k_before = dk.to_local().clone()
        run.fails(("rope.apply_and_cache_:",) + fragments, rope_ext.apply_rope_and_cache_,
                  dq, dk, run.d(v, vp), pos, table, dkc, dvc, slots)
        for dt, t in ((dq, q), (dkc, kc), (dvc, vc)):
            run.unchanged(dt, t)
        assert torch.equal(dk.to_local(), k_before)

    attempt((S(0), S(0), S(0), R, R), ("query is sharded over the tokens", "per-rank cache"))
    attempt((S(1), S(0), S(0), S(0), S(0)), ("key is sharded over the tokens",))
    attempt((S(1), S(1), S(1), R, S(2)), ("key_cache is written in place", "[Shard(2)]"))
    attempt((S(1), S(1), S(1), S(0), S(0)), ("key_cache is Shard(0)", "over its blocks"))
    attempt((S(1), S(1), S(1), S(2), S(3)), ("value_cache is Shard(3)", "its last dim"))
    attempt((S(1), S(2), S(1), S(2), S(2)), ("key is", HEAD_DIM_SHARDED))
    attempt((R, R, R, R, R), ("key is Partial('sum')",), dk=run.partial(k))
    # The key pair sharded, the value pair replicated (and the reverse): refused on every rank.
    attempt((S(1), S(1), R, S(2), R), ("value_cache is written in place", "like key_cache",
                                       "must be [Shard(2)], got [Replicate()]"))
    attempt((S(1), R, S(1), R, S(2)), ("value_cache is written in place", "must be [Replicate()]"))


@case
def case_cache_value_pair_unlike_key_pair_one_kv_head(run):
    """1 kv head over 2 ranks, key pair sharded, value pair replicated: the first rank would
    write both caches and the second raise; both ranks refuse before writing."""
    S, R = run.S, run.R
    table = run.d(_table(), R)
    q, k, v, pos, kc, vc, slots = _cache_inputs(HQ, 1)
    dq, dk, dv, dkc, dvc = run.d(q, S(1)), run.d(k, S(1)), run.d(v, R), run.d(kc, S(2)), run.d(vc, R)
    run.fails(("rope.apply_and_cache_: value_cache is written in place",), rope_ext.apply_rope_and_cache_,
              dq, dk, dv, run.d(pos, R), table, dkc, dvc, run.d(slots, R))
    for dt, t in ((dq, q), (dk, k), (dkc, kc), (dvc, vc)):
        run.unchanged(dt, t)


def _quant_inputs(hq, hk, mla=False, dtype=torch.bfloat16):
    """quantize_fp8's inputs: rope parts of 8 dims, nope parts of 4 (MLA: 2-D keys)."""
    lead = (T,) if mla else (T, hk)
    return dict(q_rope=torch.randn(T, hq, 8, dtype=dtype), k_rope=torch.randn(*lead, 8, dtype=dtype),
                q_nope=torch.randn(T, hq, 4, dtype=dtype), k_nope=torch.randn(*lead, 4, dtype=dtype),
                cos_sin_cache=rope_ext.cos_sin_cache(MAXPOS, 8), pos_ids=torch.randint(0, MAXPOS, (T,)))


def _quant_outs(x, fmt=torch.float8_e4m3fn):
    return {n + "_out": torch.full_like(t, float("nan"), dtype=fmt)
            for n, t in x.items() if n.endswith(("rope", "nope"))}


def _quant(**kw):
    torch.ops.rope.quantize_fp8(*kw.values(), 0.5, 2.0, True)  # in schema order


def _codes(t):
    return t.view(torch.uint8) if t.dtype.is_floating_point and t.element_size() == 1 else t


@case
def case_quantize_fp8(run):
    """rope.quantize_fp8 on DTensors: the query and key parts sharded over heads or tokens (pos_ids
    alike), GQA keys or MLA's 2-D keys replicated, a Partial query reduced first; each rank
    quantizes its shards, bit for bit the single-process codes."""
    S, R = run.S, run.R
    layouts = [(HQ, HK, False, S(1), S(1), R), (HQ, HK, False, S(0), S(0), S(0)),
               (3, 1, False, S(1), R, R), (HQ, 1, True, S(1), R, R), (HQ, 1, True, S(0), S(0), S(0))]
    for hq, hk, mla, qp, kp, pp in layouts:
        x = _quant_inputs(hq, hk, mla)
        want = _quant_outs(x)
        _quant(**x, **want)
        place = dict(q_rope=qp, q_nope=qp, k_rope=kp, k_nope=kp, pos_ids=pp, cos_sin_cache=R)
        dx = {n: run.d(t, place[n]) for n, t in x.items()}
        douts = {n: run.d(t, place[n.removesuffix("_out")]) for n, t in _quant_outs(x).items()}
        run.no_comm(_quant, **dx, **douts)
        for n, got in douts.items():
            p = place[n.removesuffix("_out")]
            assert tuple(got.placements) == (p,), (n, got.placements)
            assert torch.equal(_codes(got.to_local()), _codes(run.d(want[n], p).to_local())), n
    x = _quant_inputs(HQ, HK)
    dx = {n: run.d(t, R) for n, t in x.items()}
    dx["q_rope"] = run.partial(x["q_rope"])  # reduced first: saturation is not linear
    x["q_rope"] = dx["q_rope"].full_tensor()  # the sum of the addends (bfloat16, rounded)
    want = _quant_outs(x)
    _quant(**x, **want)
    douts = {n: run.d(t, R) for n, t in _quant_outs(x).items()}
    _quant(**dx, **douts)
    for n, got in douts.items():
        assert torch.equal(_codes(got.to_local()), _codes(want[n])), n


@case
def case_quantize_fp8_dropin(run):
    """FlashInfer's rope_quantize_fp8 drop-in on DTensors, nope parts None (size-0 views of the
    rope parts, in their layouts) and outputs allocated like the inputs."""
    from rope_ext.compat import flashinfer as fi

    S, R = run.S, run.R
    x = _quant_inputs(HQ, HK)
    want = fi.rope_quantize_fp8(x["q_rope"], x["k_rope"], None, None, x["cos_sin_cache"],
                                x["pos_ids"])
    got = run.no_comm(fi.rope_quantize_fp8, run.d(x["q_rope"], S(1)), run.d(x["k_rope"], S(1)),
                      None, None, run.d(x["cos_sin_cache"], R), run.d(x["pos_ids"], R))
    for g, w in zip(got, want):
        assert tuple(g.placements) == (S(1),)
        assert torch.equal(_codes(g.to_local()), _codes(run.d(w, S(1)).to_local()))


@case
def case_quantize_fp8_rejected(run):
    """Layouts quantize_fp8 refuses on every rank, nothing written: query and key tokens sharded
    unlike each other, an output laid out unlike its input, a rope part sharded over its last
    dim."""
    S, R = run.S, run.R
    x = _quant_inputs(HQ, HK)

    def attempt(place, fragments):
        dx = {n: run.d(t, place.get(n, R)) for n, t in x.items()}
        outs = _quant_outs(x)
        douts = {n: run.d(t, place.get(n, place.get(n.removesuffix("_out"), R)))
                 for n, t in outs.items()}
        run.fails(("rope.quantize_fp8:",) + fragments, _quant, **dx, **douts)
        for n, t in outs.items():
            assert torch.equal(_codes(douts[n].to_local()),
                               _codes(run.d(t, douts[n].placements[0]).to_local())), n

    attempt(dict(q_rope=S(0), q_nope=S(0), pos_ids=S(0)), ("must be sharded alike over the tokens",))
    attempt(dict(q_rope=S(1), q_nope=S(1), q_nope_out=R), ("q_nope_out is written in place",
                                                           "must be [Shard(1)], got [Replicate()]"))
    attempt(dict(k_rope=S(2)), ("k_rope is", HEAD_DIM_SHARDED))


def _paged_inputs(mla, layout, hk=HK, dtype=torch.bfloat16):
    """quantize_fp8_append_paged_kv_cache's inputs: 2 requests of 3 tokens on pages of 2 (one
    token padding), GQA HQ/hk heads or MLA, float8 caches poisoned with NaN."""
    hk = 1 if mla else hk
    x = _quant_inputs(HQ, hk, mla, dtype)
    x["v"] = None if mla else torch.randn(T, hk, 12, dtype=dtype)
    pages, page_size, fmt = 6, 2, torch.float8_e4m3fn
    if mla:
        caches = (torch.full((pages, page_size, 4), float("nan")), torch.full((pages, page_size, 8), float("nan")))
    else:
        shape = (pages, page_size, hk, 12) if layout == "NHD" else (pages, hk, page_size, 12)
        caches = (torch.full(shape, float("nan")), torch.full(shape, float("nan")))
    outs = dict(q_rope_out=torch.full((T, HQ, 8), float("nan")).to(fmt),
                q_nope_out=torch.full((T, HQ, 4), float("nan")).to(fmt),
                k_cache=caches[0].to(fmt), v_cache=caches[1].to(fmt))
    index = dict(kv_indices=torch.tensor([4, 0, 5, 2]), kv_indptr=torch.tensor([0, 2, 4]),
                 batch_indices=torch.tensor([0, 0, -1, 1, 1, 1]),
                 positions=torch.tensor([0, 3, 0, 0, 1, 2]))
    return x, outs, index


def _paged(x, outs, index, layout):
    torch.ops.rope.quantize_fp8_append_paged_kv_cache(
        x["q_rope"], x["k_rope"], x["q_nope"], x["k_nope"], x["v"], x["cos_sin_cache"],
        x["pos_ids"], outs["q_rope_out"], outs["q_nope_out"], outs["k_cache"], outs["v_cache"],
        *index.values(), 2, layout, 0.5, 2.0, False)


@case
def case_quantize_fp8_paged(run):
    """rope.quantize_fp8_append_paged_kv_cache under tensor parallelism: query heads sharded;
    key, value and the caches sharded over the kv heads (NHD's dim 2, HND's dim 1) or
    replicated (one kv head over two ranks: the second has none); MLA's compressed caches
    replicated. Bit for bit the single-process result;
    tokens sharded, caches laid out unlike the keys: refused, nothing written."""
    S, R = run.S, run.R
    for mla, layout, kp, hk in ((False, "NHD", S(1), HK), (False, "HND", S(1), HK),
                                (False, "NHD", R, HK), (False, "HND", S(1), 1), (True, "NHD", R, 1)):
        x, outs, index = _paged_inputs(mla, layout, hk)
        want = {n: t.clone() for n, t in outs.items()}
        _paged(x, want, index, layout)
        cp = kp if kp == R else S(2 if layout == "NHD" else 1)
        place = dict(q_rope=S(1), q_nope=S(1), k_rope=kp, k_nope=kp, v=kp, q_rope_out=S(1),
                     q_nope_out=S(1), k_cache=cp, v_cache=cp)
        dx = {n: None if t is None else run.d(t, place.get(n, R)) for n, t in x.items()}
        douts = {n: run.d(t, place[n]) for n, t in outs.items()}
        run.no_comm(_paged, dx, douts, {n: run.d(t, R) for n, t in index.items()}, layout)
        for n, got in douts.items():
            w = run.d(want[n], place[n]).to_local()  # unwritten cache entries: NaN codes
            assert torch.equal(_codes(got.to_local()), _codes(w)), (n, layout, kp)
    x, outs, index = _paged_inputs(False, "NHD")
    for place, fragments in ((dict(q_rope=S(0), q_nope=S(0), k_rope=S(0), k_nope=S(0), v=S(0)),
                              ("q_rope is sharded over the tokens",)),
                             (dict(q_rope=S(1), q_nope=S(1), k_rope=S(1), k_nope=S(1), v=S(1),
                                   q_rope_out=S(1), q_nope_out=S(1), k_cache=S(2)),
                              ("v_cache is written in place", "must be [Shard(2)], got [Replicate()]"))):
        dx = {n: run.d(t, place.get(n, R)) for n, t in x.items()}
        douts = {n: run.d(t, place.get(n, R)) for n, t in outs.items()}
        run.fails(("rope.quantize_fp8_append_paged_kv_cache:",) + fragments, _paged, dx, douts,
                  {n: run.d(t, R) for n, t in index.items()}, "NHD")
        for n, t in outs.items():
            assert torch.equal(_codes(douts[n].to_local()),
                               _codes(run.d(t, douts[n].placements[0]).to_local())), n


@case
def case_mesh_2d(run):
    """2-D meshes (2, 1) and (1, 2): tokens over one mesh dim and heads over the other, or the
    tokens split over both; the rules apply mesh dim by mesh dim."""
    from torch.distributed.tensor import init_device_mesh

    S, R = run.S, run.R
    table = _table()
    for shape in ((WORLD, 1), (1, WORLD)):
        mesh = init_device_mesh("cpu", shape)
        rt = run.d(table, R, R, mesh=mesh)
        q, k = torch.randn(T, HQ, D), torch.randn(T, HK, D)
        pos = torch.randint(0, MAXPOS, (T,))
        q1, k1 = q.clone(), k.clone()
        rope_ext.apply_rope_(q1, k1, pos, table)
        dq, dk = run.d(q, S(0), S(1), mesh=mesh), run.d(k, S(0), S(1), mesh=mesh)
        run.no_comm(rope_ext.apply_rope_, dq, dk, run.d(pos, S(0), R, mesh=mesh), rt)
        run.expect(dq, q1, [S(0), S(1)])
        run.expect(dk, k1, [S(0), S(1)])
        dq = run.d(q, S(0), S(0), mesh=mesh)
        run.no_comm(rope_ext.apply_rope_, dq, None, run.d(pos, S(0), S(0), mesh=mesh), rt)
        run.expect(dq, q1, [S(0), S(0)])
        x = torch.randn(T, HQ, D)
        got = run.no_comm(rope_ext.apply_rope_at, run.d(x, S(1), S(0), mesh=mesh),
                          run.d(pos, R, S(0), mesh=mesh), rt)
        run.expect(got, rope_ext.apply_rope_at(x, pos, table), [S(1), S(0)])


# ---------------------------------------------------------------------------------------------
# The pytest side
# ---------------------------------------------------------------------------------------------

# Cases that need a change outside this file, expected to fail until it lands.
PENDING = {}


def _backends():
    """The reference backend always; the native one too when this process has it
    (ROPE_EXT_BACKEND=reference in the environment leaves only the reference)."""
    return ["reference"] + (["native"] if rope_ext.backend("cpu") == "native" else [])


def _spawn(seed, backend, script, cases):
    """Runs `script --worker` on each rank once (its cases `cases`): ({case: [outcome on rank 0,
    on rank 1]}, the workers' logs)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.pathsep.join(p for p in (ROOT, HERE, os.environ.get("PYTHONPATH")) if p)
        env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1", ROPE_EXT_BACKEND=backend)
        procs = []
        for rank in range(WORLD):
            log = open(os.path.join(tmp, f"rank{rank}.log"), "w")
            cmd = [sys.executable, os.path.abspath(script), "--worker", tmp, str(seed)]
            procs.append((subprocess.Popen(cmd, env=dict(env, RANK=str(rank)), cwd=ROOT,
                                           stdout=log, stderr=subprocess.STDOUT), log))
        deadline = time.monotonic() + WORKER_TIMEOUT_S
        for p, log in procs:
            try:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                for other, _ in procs:
                    other.kill()
                p.wait()
            log.close()
        outcomes, logs = {}, []
        for rank, (p, _) in enumerate(procs):
            with open(os.path.join(tmp, f"rank{rank}.log")) as f:
                logs.append(f"rank {rank} (exit {p.returncode}):\n{f.read()[-4000:]}")
            results = {}
            if os.path.exists(os.path.join(tmp, f"rank{rank}.json")):
                with open(os.path.join(tmp, f"rank{rank}.json")) as f:
                    results = json.load(f)
            for name in list(cases) + ["backend"]:
                outcomes.setdefault(name, []).append(results.get(name, "no result"))
        return outcomes, "\n".join(logs)


def case_tests(script, cases, pending=None):
    """The pytest fixture `outcomes` (the workers of `script` run once per backend) and the test
    `test_case` (one per case; those in `pending`, name -> reason, expected to fail) of a test
    file whose cases run on WORLD ranks; the file runs `_main_worker` under `--worker`."""
    pending = pending or {}

    @pytest.fixture(scope="module", params=[] if sys.argv[1:2] == ["--worker"] else _backends())
    def outcomes(request):
        seed = int(os.environ.get("ROPE_TEST_SEED", torch.seed() % (2**31)))
        print(f"ROPE_TEST_SEED={seed}")
        results, logs = _spawn(seed, request.param, script, cases)
        return request.param, results, logs, seed

    @pytest.mark.parametrize("name", [
        pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=pending[n])) if n in pending
        else n for n in cases
    ])
    def test_case(outcomes, name):
        backend, results, logs, seed = outcomes
        got = results[name]
        if got != ["ok"] * WORLD:
            detail = "\n".join(f"rank {r}: {o}" for r, o in enumerate(got))
            if "no result" in got:
                detail += "\n" + logs
            pytest.fail(f"{name}, {backend} backend (ROPE_TEST_SEED={seed}):\n{detail}",
                        pytrace=False)

    return outcomes, test_case


outcomes, test_case = case_tests(__file__, CASES, PENDING)


def test_workers_ran_the_backend(outcomes):
    backend, results, logs, _ = outcomes
    assert results["backend"] == [backend] * WORLD, logs


REGISTERED = r"""
ops = torch.ops.rope
funcs = DTensor._op_dispatcher.sharding_propagator.op_strategy_funcs
for op in (ops.apply.default, ops.apply.out, ops.apply_backward.default, ops.apply_.default,
           ops.mrope_.default, ops.apply_positions.default, ops.apply_positions.cache,
           ops.apply_and_cache_.default,
           ops.shift_kv_cache_.default, ops.quantize_fp8.default,
           ops.quantize_fp8_append_paged_kv_cache.default):
    assert op in funcs, op
assert ops.apply.out in DTensor._op_dispatcher._custom_op_handlers
assert not any(type(f).__module__ == "rope_ext.distributed" for f in sys.meta_path), "hook left"
rd.register()  # idempotent
print("ok")
"""
IMPORT_ORDERS = {
    # rope_ext first: nothing loads DTensor; the rules come when something else loads it
    "rope_ext_first": r"""
import sys, torch, rope_ext, rope_ext.distributed as rd
assert "torch.distributed.tensor" not in sys.modules, "rope_ext.distributed imported DTensor"
assert not rd.registered()
from torch.distributed.tensor import DTensor
assert rd.registered(), "not registered once torch.distributed.tensor loaded"
import torch.distributed.tensor as t
assert type(t.__spec__.loader).__module__ != "rope_ext.distributed", "hook left its loader"
""",
    # DTensor already loaded: registered on import
    "dtensor_first": r"""
import sys, torch
from torch.distributed.tensor import DTensor
import rope_ext, rope_ext.distributed as rd
assert rd.registered()
""",
}


@pytest.mark.parametrize("order", IMPORT_ORDERS)
def test_import_registers_lazily(order):
    """Importing rope_ext.distributed does not import torch.distributed.tensor; the rules are
    registered on import when it is loaded already, otherwise as soon as it loads."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    res = subprocess.run([sys.executable, "-c", IMPORT_ORDERS[order] + REGISTERED], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stdout + res.stderr


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    sys.path.insert(0, HERE)
    _main_worker(sys.argv[2], int(sys.argv[3]))
