"""The QK-norm + RoPE part of a training step, forward and backward: rope_ext.qk_norm.qk_norm_rope
against transformers' own Qwen3 code (its Qwen3RMSNorm on q and k, then apply_rotary_pos_emb),
eagerly and under torch.compile.

q (1, S, 32, 128) and k (1, S, 8, 128) as the projections give them, requiring grad, with weights
that require grad and transformers' (1, S, 128) tables in q's dtype; both paths return
(1, heads, S, 128) as the attention takes them, and the backward starts from contiguous
gradients of that shape (as SDPA's backward returns them). The floor row clones q, k and the two
output gradients: the bytes a step must read at least, once. Rows of one (S, dtype) are timed
round-robin in blocks; the table gives medians and each row's time over rope_ext's.
"""

import torch

import rope_ext.qk_norm

NAME = "training"
ABOUT = ("qk_norm_rope forward + backward (a Qwen3 training step's norm and rotation) against "
         "transformers' own code, eager and under torch.compile")
ORDER = 30

HEADS, KV_HEADS, HEAD_DIM, EPS = 32, 8, 128, 1e-6
SEQS = (512, 2048)
QUICK_SEQS = (16,)
FLOOR = "floor: clone q, k and their output gradients"
OURS = "rope_ext.qk_norm.qk_norm_rope"
EAGER = "transformers Qwen3 (q_norm, k_norm, apply_rotary_pos_emb)"
COMPILED = "torch.compile of transformers Qwen3"


def _qwen3():
    """(Qwen3RMSNorm, apply_rotary_pos_emb) from transformers, or None."""
    try:
        from transformers.models.qwen3 import modeling_qwen3 as m
    except Exception:  # noqa: BLE001 - the rows are left out and the note says why
        return None
    return m.Qwen3RMSNorm, m.apply_rotary_pos_emb


class _Step:
    """forward() -> (q, k) in (1, heads, S, D); calling the step runs it and its backward, then
    drops the leaves' gradients so that every call allocates as the first did."""

    def __init__(self, forward, leaves, grads):
        self.forward, self.leaves, self.grads = forward, leaves, grads

    def __call__(self):
        torch.autograd.backward(self.forward(), self.grads)
        for t in self.leaves:
            t.grad = None


def _rows(S, dtype, qwen3, compile_too):
    g = torch.Generator().manual_seed(S)
    q = torch.randn(1, S, HEADS, HEAD_DIM, generator=g).to(dtype).requires_grad_()
    k = torch.randn(1, S, KV_HEADS, HEAD_DIM, generator=g).to(dtype).requires_grad_()
    wq = (1 + 0.1 * torch.randn(HEAD_DIM, generator=g)).to(dtype).requires_grad_()
    wk = (1 + 0.1 * torch.randn(HEAD_DIM, generator=g)).to(dtype).requires_grad_()
    inv = 1.0 / (1e6 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
    f = torch.arange(S).float()[:, None] * inv
    emb = torch.cat((f, f), -1)[None]
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    grads = tuple(torch.randn(1, h, S, HEAD_DIM, generator=g).to(dtype) for h in (HEADS, KV_HEADS))
    leaves = [q, k, wq, wk]

    def ours():
        a, b = rope_ext.qk_norm.qk_norm_rope(q, k, wq, wk, cos, sin, eps=EPS)
        return a.transpose(1, 2), b.transpose(1, 2)

    rows = {FLOOR: lambda: (q.detach().clone(), k.detach().clone(), grads[0].clone(),
                            grads[1].clone()),
            OURS: _Step(ours, leaves, grads)}
    if qwen3 is not None:
        norm_cls, rotate = qwen3
        q_norm, k_norm = norm_cls(HEAD_DIM, eps=EPS).to(dtype), norm_cls(HEAD_DIM, eps=EPS).to(dtype)
        with torch.no_grad():
            q_norm.weight.copy_(wq)
            k_norm.weight.copy_(wk)

        def eager(q, k):
            return rotate(q_norm(q).transpose(1, 2), k_norm(k).transpose(1, 2), cos, sin)

        hf_leaves = [q, k, q_norm.weight, k_norm.weight]
        rows[EAGER] = _Step(lambda: eager(q, k), hf_leaves, grads)
        if compile_too:
            torch._dynamo.reset()  # a fresh cache per shape: no recompile limit reached
            compiled = torch.compile(eager, dynamic=False, fullgraph=True)
            rows[COMPILED] = _Step(lambda: compiled(q, k), hf_leaves, grads)
    return rows


def run(ctx):
    from . import seq_rows
    from ..cases import DTYPES

    qwen3 = _qwen3()
    notes = [] if qwen3 is not None else ["transformers is not importable: no Qwen3 rows"]
    if ctx.quick:
        notes.append("--quick: no torch.compile row")
    out = []
    for dtype_name in ctx.dtypes:
        for S in QUICK_SEQS if ctx.quick else SEQS:
            out += seq_rows(ctx, NAME, S, dtype_name,
                            _rows(S, DTYPES[dtype_name], qwen3, not ctx.quick), OURS, "x_ours")
    return {"rows": out, "notes": notes}


def table(result):
    from . import seq_table

    return seq_table(result["rows"], "forward + backward (q 32 heads, k 8, of 128)", "x_ours",
                     "x rope_ext")
