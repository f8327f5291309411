"""The fused QK-RMSNorm + RoPE ops on DTensors: two gloo processes (CPU) run them on head- and
token-sharded DTensors, without communication, and compare each rank's shard with the same shard
of the single-process result; unsupported layouts fail clearly and change nothing. Uses the
worker machinery of test_distributed.py."""

import os
import sys

import torch

import rope_ext

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import test_distributed as td  # noqa: E402
from rope_ext.qk_norm import (  # noqa: E402
    norm_rope, qk_norm_rope, qk_norm_rope_, qk_norm_rope_and_cache, qk_norm_rope_and_cache_,
    qkv_norm_rope_)

CASES = {}
B, S, T, HQ, HK, D, ROT, MAXPOS = 2, 4, 6, 4, 2, 16, 12, 32


def case(fn):
    CASES[fn.__name__.removeprefix("case_")] = fn
    return fn


def _weights():
    return torch.randn(D), torch.randn(D)


def _packed():
    """Weights, a (MAXPOS, ROT) cos_sin_cache and a packed (T, (HQ + 2 * HK) * D) qkv."""
    wq, wk = _weights()
    return wq, wk, torch.randn(MAXPOS, ROT), torch.randn(T, (HQ + 2 * HK) * D)


def _prologue_args():
    """The serving prologue's arguments: weights, a cos_sin_cache, q, k, v (T, H, D), positions,
    slots (one padding) and zeroed paged caches."""
    wq, wk = _weights()
    cache = torch.randn(MAXPOS, ROT)
    q, k, v = torch.randn(T, HQ, D), torch.randn(T, HK, D), torch.randn(T, HK, D)
    pos = torch.randint(0, MAXPOS, (T,))
    slots = torch.randperm(16)[:T]
    slots[0] = -1
    kc, vc = torch.zeros(4, 4, HK, D), torch.zeros(4, 4, HK, D)
    return wq, wk, cache, q, k, v, pos, slots, kc, vc


@case
def case_out_of_place_heads_and_tokens(run):
    Sh, R = run.S, run.R
    wq, wk = _weights()
    for dtype in (torch.float32, torch.bfloat16):
        q, k = torch.randn(B, S, HQ, D, dtype=dtype), torch.randn(B, S, HK, D, dtype=dtype)
        cos, sin = torch.randn(B, S, 1, ROT // 2), torch.randn(B, S, 1, ROT // 2)
        want = qk_norm_rope(q, k, wq, wk, cos, sin, table_width="half")
        for p, pt in ((Sh(2), R), (Sh(1), Sh(1)), (Sh(1), R), (Sh(0), Sh(0))):
            got = run.no_comm(qk_norm_rope, run.d(q, p), run.d(k, p), run.d(wq, R),
                              run.d(wk, R), run.d(cos, pt), run.d(sin, pt), table_width="half")
            run.expect(got[0], want[0], [p])
            run.expect(got[1], want[1], [p])


@case
def case_in_place_heads_and_tokens(run):
    Sh, R = run.S, run.R
    wq, wk = _weights()
    cache = torch.randn(MAXPOS, ROT)
    q, k = torch.randn(T, HQ, D), torch.randn(T, HK, D)
    pos = torch.randint(0, MAXPOS, (T,))
    want_q, want_k = q.clone(), k.clone()
    qk_norm_rope_(want_q, want_k, wq, wk, pos, cache, unit_offset=True)
    for p, pp in ((Sh(1), R), (Sh(0), Sh(0))):
        dq, dk = run.d(q, p), run.d(k, p)
        run.no_comm(qk_norm_rope_, dq, dk, run.d(wq, R), run.d(wk, R), run.d(pos, pp),
                    run.d(cache, R), unit_offset=True)
        run.expect(dq, want_q, [p])
        run.expect(dk, want_k, [p])


@case
def case_packed_tokens(run):
    Sh, R = run.S, run.R
    wq, wk, cache, qkv = _packed()
    pos = torch.randint(0, MAXPOS, (T,))
    want = qkv.clone()
    qkv_norm_rope_(want, HQ, HK, HK, D, wq, wk, pos, cache)
    dqkv = run.d(qkv, Sh(0))
    run.no_comm(qkv_norm_rope_, dqkv, HQ, HK, HK, D, run.d(wq, R), run.d(wk, R),
                run.d(pos, Sh(0)), run.d(cache, R))
    run.expect(dqkv, want, [Sh(0)])


@case
def case_rejected_layouts(run):
    Sh, R = run.S, run.R
    wq, wk, cache, qkv = _packed()
    dqkv = run.d(qkv, Sh(1))
    run.fails(["qkv is Shard(1)", "packed"], qkv_norm_rope_, dqkv, HQ, HK, HK, D, run.d(wq, R),
              run.d(wk, R), run.d(torch.zeros(T, dtype=torch.long), R), run.d(cache, R))
    run.unchanged(dqkv, qkv)
    q, k = torch.randn(T, HQ, D), torch.randn(T, HK, D)
    dq = run.partial(q)
    run.fails(["query is Partial('sum')", "not linear"], qk_norm_rope_, dq, run.d(k, R),
              run.d(wq, R), run.d(wk, R), run.d(torch.zeros(T, dtype=torch.long), R),
              run.d(cache, R))
    dq = run.d(q, Sh(2))
    run.fails([td.HEAD_DIM_SHARDED], qk_norm_rope_, dq, run.d(k, Sh(1)), run.d(wq, R),
              run.d(wk, R), run.d(torch.zeros(T, dtype=torch.long), R), run.d(cache, R))
    run.unchanged(dq, q)


@case
def case_prologue_with_cache_heads(run):
    """The serving prologue with query, key, value sharded over their heads and the caches over
    their kv heads (tensor parallelism): each rank writes its heads; the tokens may not be
    sharded (each rank would fill a different part of a replicated cache)."""
    Sh, R = run.S, run.R
    wq, wk, cache, q, k, v, pos, slots, kc, vc = _prologue_args()
    want = [t.clone() for t in (q, k, v, kc, vc)]
    qk_norm_rope_and_cache_(*want[:3], pos, cache, wq, wk, want[3], want[4], slots, v_norm=True)
    got = [run.d(t, Sh(1)) for t in (q, k, v)] + [run.d(t, Sh(2)) for t in (kc, vc)]
    run.no_comm(qk_norm_rope_and_cache_, *got[:3], run.d(pos, R), run.d(cache, R), run.d(wq, R),
                run.d(wk, R), got[3], got[4], run.d(slots, R), v_norm=True)
    for g, w, p in zip(got, want, [Sh(1)] * 3 + [Sh(2)] * 2):
        run.expect(g, w, [p])
    dq, dk = run.d(q, Sh(0)), run.d(k, Sh(0))
    run.fails(["query is sharded over the tokens"], qk_norm_rope_and_cache_, dq, dk,
              run.d(v, Sh(0)), run.d(pos, Sh(0)), run.d(cache, R), run.d(wq, R), run.d(wk, R),
              run.d(kc, R), run.d(vc, R), run.d(slots, Sh(0)))
    run.unchanged(dq, q)
    run.unchanged(dk, k)


@case
def case_prologue_out_of_place_heads(run):
    """The out-of-place prologue over sharded heads: the new query, key and value come back
    sharded like the inputs, which are only read; the caches as in place."""
    Sh, R = run.S, run.R
    wq, wk, cache, q, k, v, pos, slots, kc, vc = _prologue_args()
    want_kc, want_vc = kc.clone(), vc.clone()
    want = qk_norm_rope_and_cache(q, k, v, pos, cache, wq, wk, want_kc, want_vc, slots,
                                  v_norm=True)
    inputs = [run.d(t, Sh(1)) for t in (q, k, v)]
    caches = [run.d(t, Sh(2)) for t in (kc, vc)]
    got = run.no_comm(qk_norm_rope_and_cache, *inputs, run.d(pos, R), run.d(cache, R),
                      run.d(wq, R), run.d(wk, R), *caches, run.d(slots, R), v_norm=True)
    for g, w in zip(got, want):
        run.expect(g, w, [Sh(1)])
    for g, w in zip(caches, (want_kc, want_vc)):
        run.expect(g, w, [Sh(2)])
    for g, w in zip(inputs, (q, k, v)):
        run.unchanged(g, w)


@case
def case_prologue_value_and_keyword_layouts(run):
    """With v_norm, value is written in place: placed unlike value_cache's heads it is refused
    (it used to be moved, normalized as a temporary copy, and left as it was). A layout DTensor
    accepted for one call is decided again when a keyword-only argument changes (v_norm, or
    k_scale's placement): the second call is refused on every rank, nothing written. The
    out-of-place op reduces a Partial query first."""
    Sh, R = run.S, run.R
    wq, wk, cache, q, k, v, pos, slots, kc, vc = _prologue_args()
    common = (run.d(pos, R), run.d(cache, R), run.d(wq, R), run.d(wk, R))
    dq, dk, dv = run.d(q, Sh(1)), run.d(k, Sh(1)), run.d(v, R)
    dkc, dvc = run.d(kc, Sh(2)), run.d(vc, Sh(2))
    run.fails(["value is written in place", "it must be [Shard(1)], got [Replicate()]"],
              qk_norm_rope_and_cache_, dq, dk, dv, *common, dkc, dvc, run.d(slots, R), v_norm=True)
    for t, w in ((dq, q), (dk, k), (dv, v), (dkc, kc), (dvc, vc)):
        run.unchanged(t, w)
    pv = run.partial(v)
    qk_norm_rope_and_cache_(run.d(q, Sh(1)), run.d(k, Sh(1)), pv, *common, run.d(kc, Sh(2)),
                            run.d(vc, Sh(2)), run.d(slots, R), v_norm=False)  # accepted: v read
    run.fails(["value is Partial('sum')", "not linear"], qk_norm_rope_and_cache_, dq, dk, pv,
              *common, dkc, dvc, run.d(slots, R), v_norm=True)
    run.unchanged(dq, q)
    fmt = torch.float8_e4m3fn
    f8 = [run.d(c.to(fmt), Sh(2)) for c in (kc, vc)]
    scale = torch.tensor([0.5])
    qk_norm_rope_and_cache_(run.d(q, Sh(1)), run.d(k, Sh(1)), run.d(v, Sh(1)), *common, *f8,
                            run.d(slots, R), kv_cache_dtype="fp8", k_scale=run.d(scale, R),
                            v_scale=run.d(scale, R))
    before = [c.to_local().view(torch.uint8).clone() for c in f8]
    run.fails(["k_scale must be [Replicate()], got [Shard(0)]"], qk_norm_rope_and_cache_, dq,
              dk, run.d(v, Sh(1)), *common, *f8, run.d(slots, R), kv_cache_dtype="fp8",
              k_scale=run.d(scale, Sh(0)), v_scale=run.d(scale, R))
    assert all(torch.equal(c.to_local().view(torch.uint8), b) for c, b in zip(f8, before))
    run.unchanged(dq, q)
    want_kc, want_vc = kc.clone(), vc.clone()
    want = qk_norm_rope_and_cache(q, k, v, pos, cache, wq, wk, want_kc, want_vc, slots)
    caches = [run.d(t, Sh(2)) for t in (kc, vc)]
    got = qk_norm_rope_and_cache(run.partial(q), run.d(k, Sh(1)), run.d(v, Sh(1)), *common,
                                 *caches, run.d(slots, R))
    run.expect(got[0], want[0], [R])
    run.expect(got[1], want[1], [Sh(1)])
    for g, w in zip(caches, (want_kc, want_vc)):
        run.expect(g, w, [Sh(2)])


@case
def case_norm_forms(run):
    """rope.norm_rope: LayerNorm with biases sharded like qk_norm_rope (heads or tokens); across
    heads the tokens may be sharded, the heads not."""
    Sh, R = run.S, run.R
    q, k = torch.randn(B, S, HQ, D), torch.randn(B, S, HK, D)
    cos, sin = torch.randn(B, S, 1, ROT // 2), torch.randn(B, S, 1, ROT // 2)
    w, b = torch.randn(D), torch.randn(D)
    want = norm_rope(q, k, w, None, cos, sin, q_bias=b, norm="layer", table_width="half")
    for p, pt in ((Sh(2), R), (Sh(1), Sh(1))):
        got = run.no_comm(norm_rope, run.d(q, p), run.d(k, p), run.d(w, R), None, run.d(cos, pt),
                          run.d(sin, pt), q_bias=run.d(b, R), norm="layer", table_width="half")
        run.expect(got[0], want[0], [p])
        run.expect(got[1], want[1], [p])
    wq, wk = torch.randn(HQ * D), torch.randn(HK * D)
    want = norm_rope(q, k, wq, wk, cos, sin, norm="rms_across_heads", table_width="half")
    got = run.no_comm(norm_rope, run.d(q, Sh(1)), run.d(k, Sh(1)), run.d(wq, R), run.d(wk, R),
                      run.d(cos, Sh(1)), run.d(sin, Sh(1)), norm="rms_across_heads",
                      table_width="half")
    run.expect(got[0], want[0], [Sh(1)])
    run.fails(["query is Shard(2)", "all heads of a token"], norm_rope, run.d(q, Sh(2)),
              run.d(k, Sh(2)), run.d(wq, R), run.d(wk, R), run.d(cos, R), run.d(sin, R),
              norm="rms_across_heads", table_width="half")


@case
def case_weight_gradients_with_uneven_token_shards(run):
    """qk_norm_rope and norm_rope (LayerNorm with a bias) with 3 tokens on 2 ranks: the weight
    and bias gradients are one process's (the backward once flattened an unevenly sharded
    DTensor, which DTensor refuses)."""
    Sh, R = run.S, run.R
    q, k = torch.randn(3, HQ, D), torch.randn(3, HK, D)
    cos, sin = torch.randn(3, 1, ROT // 2), torch.randn(3, 1, ROT // 2)
    params = (torch.randn(D), torch.randn(D), torch.randn(D))  # q_weight, k_weight, q_bias
    for fn, kw, n in ((qk_norm_rope, {}, 2), (norm_rope, {"norm": "layer"}, 3)):
        def loss(q, k, cos, sin, wq, wk, *bias):
            extra = {"q_bias": bias[0]} if bias else {}
            out = fn(q, k, wq, wk, cos, sin, table_width="half", **kw, **extra)
            return out[0].square().sum() + out[1].sum()

        plain = [t.clone().requires_grad_() for t in params[:n]]
        loss(q, k, cos, sin, *plain).backward()
        spread = [run.d(t, R).requires_grad_() for t in params[:n]]
        loss(run.d(q, Sh(0)), run.d(k, Sh(0)), run.d(cos, Sh(0)), run.d(sin, Sh(0)),
             *spread).backward()
        for leaf, dleaf in zip(plain, spread):
            torch.testing.assert_close(dleaf.grad.full_tensor(), leaf.grad, rtol=1e-5,
                                       atol=1e-5)


@case
def case_gradients_with_one_output_unused(run):
    """Only the queries reach the loss, the tables and k_weight requiring grad: the gradients are
    one process's (autograd's zeros for the keys, plain tensors, once met the tables' DTensors in
    the backward and failed)."""
    Sh, R = run.S, run.R
    q, k = torch.randn(T, HQ, D), torch.randn(T, HK, D)
    cos, sin = torch.randn(T, 1, ROT // 2), torch.randn(T, 1, ROT // 2)
    wq, wk = _weights()
    for fn in (qk_norm_rope, norm_rope):
        def grads(q, k, cos, sin, wq, wk):
            leaves = [t.requires_grad_() for t in (q, cos, sin, wq, wk)]
            fn(q, k, wq, wk, cos, sin, table_width="half")[0].square().sum().backward()
            return [leaf.grad for leaf in leaves]

        want = grads(q.clone(), k, cos.clone(), sin.clone(), wq.clone(), wk.clone())
        got = grads(run.d(q, Sh(1)), run.d(k, Sh(1)), run.d(cos, R), run.d(sin, R),
                    run.d(wq, R), run.d(wk, R))
        assert want[-1] is None and got[-1] is None  # k_weight: nothing reached it
        for g, w in zip(got[:-1], want[:-1]):
            torch.testing.assert_close(g.full_tensor(), w, rtol=1e-5, atol=1e-5)


@case
def case_backward_op(run):
    """rope.qk_norm_rope_backward with x sharded over heads or tokens and grad in x's layout: no
    communication, grad_x in x's layout, grad_weight each rank's sum over its own rows as a
    Partial('sum'); grad in another layout is moved to x's, a Partial x reduced first. The
    autograd of qk_norm_rope takes the op on DTensors too."""
    import torch.distributed.tensor as dt
    Sh, R = run.S, run.R
    w = torch.randn(D)
    x, g = torch.randn(B, S, HQ, D), torch.randn(B, S, HQ, D)
    cos, sin = torch.randn(B, S, 1, ROT // 2), torch.randn(B, S, 1, ROT // 2)
    want = torch.ops.rope.qk_norm_rope_backward(g, x, w, cos, sin, 1e-6)
    op = torch.ops.rope.qk_norm_rope_backward
    for px, pt in ((Sh(2), R), (Sh(1), Sh(1)), (R, R)):  # (tables: sharded like the tokens)
        args = (run.d(g, px), run.d(x, px), run.d(w, R), run.d(cos, pt), run.d(sin, pt), 1e-6)
        gx, gw = run.no_comm(op, *args)
        run.expect(gx, want[0], (px,))
        assert gw.placements == ((R,) if px == R else (dt.Partial(),)), gw.placements
        local = op(*(a.to_local() if isinstance(a, dt.DTensor) else a for a in args))[1]
        torch.testing.assert_close(gw.to_local(), local, rtol=0, atol=0)
        torch.testing.assert_close(gw.full_tensor(), want[1], rtol=1e-5, atol=1e-5)
    gx, gw = op(run.d(g, Sh(1)), run.partial(x), run.d(w, R), run.d(cos, R), run.d(sin, R), 1e-6)
    run.expect(gx, want[0], (R,))
    torch.testing.assert_close(gw.full_tensor(), want[1], rtol=1e-5, atol=1e-5)
    q = run.d(x, Sh(2)).requires_grad_()
    out = qk_norm_rope(q, run.d(x[:, :, :HK], Sh(2)), run.d(w, R).requires_grad_(), run.d(w, R),
                       run.d(cos, R), run.d(sin, R), table_width="half")[0]
    with torch.profiler.profile() as prof:
        out.backward(run.d(g, Sh(2)))
    if rope_ext.backend("cpu") == "native":  # (the reference backend keeps the torch ops)
        assert "rope::qk_norm_rope_backward" in [e.name for e in prof.events()]
    run.expect(q.grad, want[0], (Sh(2),))


outcomes, test_case = td.case_tests(__file__, CASES)


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    td._main_worker(sys.argv[2], int(sys.argv[3]), CASES)
