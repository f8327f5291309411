"""Transformer Engine's context-parallel layout with DTensors: two gloo processes (CPU) each hold
chunks cp_rank and 2 * cp_size - 1 - cp_rank of every sequence as the local shard of a DTensor and
rotate it with rope_ext.compat.transformer_engine, without communication; each rank's result and
gradients must be its chunks of the single-process result on the full sequences (and what TE's
PyTorch path, as tests/training_peers.py implements it, gives for the local tensor). Uses the
worker machinery of test_distributed.py. The two-process example of docs/distributed.md runs here
too, as its readers would run it."""

import os
import re
import socket
import subprocess
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import test_distributed as td  # noqa: E402
from rope_ext.compat import transformer_engine as te  # noqa: E402
from training_peers import te_apply_rotary_pos_emb  # noqa: E402

CASES = {}
CP = td.WORLD
B, H, D, ROT = 2, 4, 16, 12  # partial rotary: 12 of 16 dims
SEQ_DIM = {"sbhd": 0, "bshd": 1, "thd": 0}


def case(fn):
    CASES[fn.__name__.removeprefix("case_")] = fn
    return fn


def _mine(t, dim, rank):
    """This rank's part of a full sequence dim: chunks rank and 2 * CP - 1 - rank."""
    c = t.chunk(2 * CP, dim=dim)
    return torch.cat([c[rank], c[2 * CP - 1 - rank]], dim=dim)


def _inputs(fmt):
    """(full t, cu_seqlens or None, local t of this rank) for one format: 8 positions per
    sequence in sbhd/bshd, and for thd three packed sequences padded to multiples of 2 * CP."""
    if fmt == "thd":
        lengths = [4 * CP, 2 * CP, 6 * CP]
        cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
        full = torch.randn(sum(lengths), H, D)
        return full, cu, lengths
    shape = (8 * CP, B, H, D) if fmt == "sbhd" else (B, 8 * CP, H, D)
    return torch.randn(shape), None, None


def _local(full, fmt, lengths, rank):
    if fmt != "thd":
        return _mine(full, SEQ_DIM[fmt], rank)
    return torch.cat([_mine(s, 0, rank) for s in full.split(lengths)])


def _freqs(kind, rows):
    if kind == "module":  # (on CPU: like TE's, the module starts on a CUDA device if any)
        return te.RotaryPositionEmbedding(ROT, rotary_base=100.0).cpu()(rows)
    return torch.rand(rows, 1, 1, ROT) * 20


@case
def case_every_format_and_table(run):
    """sbhd, bshd, thd; angles from RotaryPositionEmbedding and per element; with and without
    start_positions; both pair layouts. t Shard over its sequence dim, freqs plain or Replicate."""
    rank = run.mesh.get_local_rank()
    for fmt in ("sbhd", "bshd", "thd"):
        for kind in ("module", "per-element"):
            for start in (None, torch.tensor([3, 0, 5])[: 3 if fmt == "thd" else B]):
                full, cu, lengths = _inputs(fmt)
                freqs = _freqs(kind, 8 * CP * 2 + 8)
                for il in (False, True):
                    kw = dict(tensor_format=fmt, start_positions=start, interleaved=il, cu_seqlens=cu)
                    want = _local(te.apply_rotary_pos_emb(full, freqs, **kw), fmt, lengths, rank)
                    local = _local(full, fmt, lengths, rank)
                    x = run.DTensor.from_local(local, run.mesh, [run.S(SEQ_DIM[fmt])])
                    for f in (freqs, run.d(freqs, run.R)):
                        got = run.no_comm(te.apply_rotary_pos_emb, x, f, cp_size=CP, cp_rank=rank, **kw)
                        assert isinstance(got, run.DTensor) and got.placements == x.placements
                        td.close(got.to_local(), want, torch.float32)
                    ref = te_apply_rotary_pos_emb(local.double(), freqs.double(), cp_size=CP,
                                                  cp_rank=rank, **kw)
                    td.close(got.to_local(), ref, torch.float32)


@case
def case_gradients(run):
    """A training step: the gradient w.r.t. the local shard is its chunks of the full gradient;
    a Replicate() freqs gets the sum of every rank's part (its full gradient)."""
    rank = run.mesh.get_local_rank()
    for fmt in ("sbhd", "thd"):
        full, cu, lengths = _inputs(fmt)
        freqs = _freqs("per-element", 8 * CP * 2)
        grad = torch.randn(full.shape)
        x_ref, f_ref = full.clone().requires_grad_(), freqs.clone().requires_grad_()
        te.apply_rotary_pos_emb(x_ref, f_ref, fmt, cu_seqlens=cu).backward(grad)
        local = _local(full, fmt, lengths, rank).requires_grad_()
        f = run.d(freqs, run.R).requires_grad_()
        x = run.DTensor.from_local(local, run.mesh, [run.S(0)])
        out = te.apply_rotary_pos_emb(x, f, fmt, cu_seqlens=cu, cp_size=CP, cp_rank=rank)
        out.to_local().backward(_local(grad, fmt, lengths, rank))
        td.close(local.grad, _local(x_ref.grad, fmt, lengths, rank), torch.float32)
        # (a sum over tokens, batch and heads, rounded in another order: float32 sums' tolerance)
        torch.testing.assert_close(f.grad.full_tensor(), f_ref.grad, rtol=1e-5, atol=1e-5)
    # t replicated, or sharded over heads only: freqs' gradient is each rank's whole (it was
    # once a partial sum there, the world size times the gradient)
    full, freqs, grad = torch.randn(8, B, H, D), _freqs("per-element", 8), torch.randn(8, B, H, D)
    f_ref = freqs.clone().requires_grad_()
    te.apply_rotary_pos_emb(full, f_ref).backward(grad)
    for p in (run.R, run.S(2)):
        f = run.d(freqs, run.R).requires_grad_()
        te.apply_rotary_pos_emb(run.d(full, p), f).backward(run.d(grad, p))
        torch.testing.assert_close(f.grad.full_tensor(), f_ref.grad, rtol=1e-5, atol=1e-5)


@case
def case_heads_sharded_too(run):
    """Tensor parallelism alongside: t's heads sharded (no context parallelism, cp_size 1)."""
    full, freqs = torch.randn(8, B, H, D), _freqs("module", 8)
    got = run.no_comm(te.apply_rotary_pos_emb, run.d(full, run.S(2)), freqs)
    run.expect(got, te.apply_rotary_pos_emb(full, freqs), [run.S(2)])


@case
def case_refused(run):
    full, freqs = torch.randn(8, B, H, D), _freqs("module", 8)
    seq_sharded = f"t is sharded over its sequence dim (Shard(0) on mesh dim 0) into {CP} parts, so cp_size must be {CP}"
    for x, f, fragment, cp in (
            (run.d(full, run.S(3)), freqs, "t is sharded over its last dim (head_dim)", CP),
            (run.partial(full, "max"), freqs, "only partial sums and averages", CP),
            (run.d(full, run.S(0)), run.d(freqs, run.S(0)), "freqs must be Replicate()", CP),
            # sequence-sharded with the default cp_size: each rank would rotate from position 0
            (run.d(full, run.S(0)), freqs, seq_sharded, 1),
            # another rank's part: cp_rank must be this rank's coordinate on the mesh dim
            (run.d(full, run.S(0)), freqs, "cp_rank must be", -CP)):
        rank = run.mesh.get_local_rank()
        cp_rank = (rank + 1) % CP if cp < 0 else rank if cp > 1 else 0
        try:
            te.apply_rotary_pos_emb(x, f, cp_size=abs(cp), cp_rank=cp_rank)
        except ValueError as e:
            assert fragment in str(e), str(e)
        else:
            raise AssertionError(f"no error; expected one mentioning {fragment!r}")


outcomes, test_case = td.case_tests(__file__, CASES)


# ---- docs/distributed.md's example, as written ------------------------------------------------

def doc_example():
    """The Python block that follows the "run by tests/test_te_distributed.py" marker."""
    with open(os.path.join(td.ROOT, "docs", "distributed.md")) as f:
        text = f.read()
    found = re.search(r"<!-- run by tests/test_te_distributed\.py[^\n]*-->\n```python\n(.*?)```",
                      text, re.S)
    assert found, "docs/distributed.md lost the example this test runs"
    return found.group(1)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_doc_example_runs_on_two_processes():
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "example.py")
        with open(script, "w") as f:
            f.write(doc_example())
        path = os.pathsep.join(p for p in (td.ROOT, os.environ.get("PYTHONPATH")) if p)
        env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1", WORLD_SIZE=str(td.WORLD),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
        procs = [subprocess.Popen([sys.executable, script], env=dict(env, RANK=str(r)), cwd=tmp,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for r in range(td.WORLD)]
        outs = []
        for p in procs:
            try:
                outs.append(p.communicate(timeout=td.WORKER_TIMEOUT_S)[0])
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                outs.append(p.communicate()[0])
        for r, (p, out) in enumerate(zip(procs, outs)):
            assert p.returncode == 0 and f"rank {r}: ok" in out, (
                f"rank {r} (exit {p.returncode}):\n{out[-4000:]}")


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    td._main_worker(sys.argv[2], int(sys.argv[3]), CASES)
