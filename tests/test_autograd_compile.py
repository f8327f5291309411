"""Autograd (gradcheck, including through the in-place ops), opcheck and
torch.compile(fullgraph=True) for every rope op."""

import pytest
import torch

import rope_ext
from conftest import assert_close
from rope_oracle import rope


def _tables(shape, requires_grad=False):
    cos = torch.randn(shape, dtype=torch.float64, requires_grad=requires_grad)
    sin = torch.randn(shape, dtype=torch.float64, requires_grad=requires_grad)
    return cos, sin


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("table_shape", [(1, 1, 5, 6), (1, 5, 1, 6), (2, 5, 1, 6)])
def test_gradcheck_x_cos_sin(interleaved, table_shape):
    # x: [B, S, H, D] (or [B, H, S, D] for the [1, 1, S, r/2] tables), partial rotary 12 of 16.
    shape = (2, 3, 5, 16) if table_shape == (1, 1, 5, 6) else (2, 5, 3, 16)
    x = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    cos, sin = _tables(table_shape, requires_grad=True)
    fn = lambda x, c, s: rope_ext.apply_rope(x, c, s, interleaved=interleaved)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x, cos, sin))
    assert torch.autograd.gradgradcheck(fn, (x, cos, sin))


def test_grad_x_only_and_low_precision_grad():
    x = torch.randn(4, 2, 32, dtype=torch.bfloat16, requires_grad=True)
    cos, sin = _tables((4, 1, 16))
    y = rope_ext.apply_rope(x, cos.float(), sin.float())
    g = torch.randn_like(y)
    (gx,) = torch.autograd.grad(y, x, g)
    assert gx.dtype == torch.bfloat16
    assert_close(gx, rope(g, cos, sin, False, inverse=True), torch.bfloat16)


POS = torch.tensor([[3, 0, 7, 3, 11], [1, 9, 9, 2, 5]])  # repeats: table gradients accumulate
MPOS = torch.stack((POS, (POS * 3) % 13, (POS + 5) % 13))  # MRoPE (t, h, w)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("section,mrope_interleaved", [(None, False), ([2, 2, 2], False), ([2, 2, 2], True)])
def test_gradcheck_positions_op(interleaved, section, mrope_interleaved):
    x = torch.randn(2, 5, 3, 16, dtype=torch.float64, requires_grad=True)
    cache = rope_ext.cos_sin_cache(13, 12, dtype=torch.float64).requires_grad_()
    pos = POS if section is None else MPOS

    def fn(x, cache):
        return rope_ext.apply_rope_at(x, pos, cache, interleaved=interleaved,
                                      mrope_section=section, mrope_interleaved=mrope_interleaved)

    assert torch.autograd.gradcheck(fn, (x, cache))
    assert torch.autograd.gradgradcheck(fn, (x, cache))


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("mrope", [False, True])
def test_gradcheck_through_in_place_ops(interleaved, mrope):
    # The in-place ops are differentiable w.r.t. query, key and the table, and their gradient is
    # the out-of-place op's.
    q = torch.randn(2, 5, 4, 16, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 5, 2, 16, dtype=torch.float64, requires_grad=True)
    cache = rope_ext.cos_sin_cache(13, 12, dtype=torch.float64).requires_grad_()

    def in_place(q, k, cache):
        q, k = q * 1.0, k * 1.0  # non-leaf copies the op may overwrite
        if mrope:
            rope_ext.apply_mrope_(q, k, MPOS, cache, [2, 2, 2], interleaved=interleaved)
        else:
            rope_ext.apply_rope_(q, k, POS, cache, interleaved=interleaved)
        return q, k

    def out_of_place(q, k, cache):
        kw = dict(interleaved=interleaved, mrope_section=[2, 2, 2] if mrope else None)
        pos = MPOS if mrope else POS
        return rope_ext.apply_rope_at(q, pos, cache, **kw), rope_ext.apply_rope_at(k, pos, cache, **kw)

    # fast_mode: random projections of the Jacobians (the exact comparison of the gradients with
    # the out-of-place op's follows), 13 s -> 1 s per case
    assert torch.autograd.gradcheck(in_place, (q, k, cache), fast_mode=True)
    assert torch.autograd.gradgradcheck(in_place, (q, k, cache), fast_mode=True)
    grads = [torch.randn(2, 5, 4, 16, dtype=torch.float64), torch.randn(2, 5, 2, 16, dtype=torch.float64)]
    a = torch.autograd.grad(in_place(q, k, cache), (q, k, cache), grads)
    b = torch.autograd.grad(out_of_place(q, k, cache), (q, k, cache), grads)
    for ga, gb in zip(a, b):
        torch.testing.assert_close(ga, gb, rtol=1e-12, atol=1e-12)


def test_module_forward_and_forward_inplace_give_one_gradient():
    rope_mod = rope_ext.RotaryEmbedding(16, max_position=32).double()
    q = torch.randn(3, 4, 16, dtype=torch.float64, requires_grad=True)
    pos = torch.tensor([0, 31, 7])
    g = torch.randn(3, 4, 16, dtype=torch.float64)
    (a,) = torch.autograd.grad(rope_mod(q, None, pos)[0], q, g)
    (b,) = torch.autograd.grad(rope_mod.forward_(q.clone(), None, pos)[0], q, g)
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def _opcheck_samples():
    x = torch.randn(2, 5, 3, 16)
    cos, sin = torch.randn(1, 5, 1, 6), torch.randn(1, 5, 1, 6)
    q, k = torch.randn(7, 4, 16), torch.randn(7, 2, 16)
    pos = torch.randint(0, 20, (7,), dtype=torch.int32)
    mpos = torch.randint(0, 20, (3, 7))
    cache = rope_ext.cos_sin_cache(20, 12)
    c_tab, s_tab = cache[:, :6], cache[:, 6:]
    xg = x.double().requires_grad_()
    v = torch.randn(7, 2, 8)
    kc, vc = torch.zeros(4, 4, 2, 16), torch.zeros(4, 4, 2, 8)
    slots = torch.tensor([0, 5, -1, 9, 15, 2, 3])
    return [
        (torch.ops.rope.apply.default, (x, cos, sin, False)),
        (torch.ops.rope.apply.default, (x, cos, sin, True)),
        (torch.ops.rope.apply.default, (xg, cos.double().requires_grad_(), sin.double(), False)),
        (torch.ops.rope.apply.default, (x.transpose(1, 2), torch.randn(1, 1, 5, 6), torch.randn(1, 1, 5, 6), True)),
        (torch.ops.rope.apply_backward.default, (x, cos, sin, False)),
        (torch.ops.rope.apply_backward.default, (xg, cos.double(), sin.double(), True)),
        (torch.ops.rope.apply_.default, (q, k, pos, cache, False)),
        (torch.ops.rope.apply_.default, (q.clone(), None, pos.long(), cache, True)),
        (torch.ops.rope.mrope_.default, (q.clone(), k.clone(), mpos, cache, [2, 2, 2], False, True)),
        (torch.ops.rope.apply_positions.default, (q, pos, c_tab, s_tab, True, False, None, False)),
        (torch.ops.rope.apply_positions.default, (q.double().requires_grad_(), mpos, c_tab.double(), s_tab.double(), False, True, [1, 3, 2], False)),
        (torch.ops.rope.apply_positions.cache, (q, pos, cache, True)),
        (torch.ops.rope.apply_positions.cache, (q.double().requires_grad_(), mpos, cache.double().requires_grad_(), False, True, [1, 3, 2], True)),
        (torch.ops.rope.apply_and_cache_.default, (q.clone(), k.clone(), v, pos, cache, kc, vc, slots)),
    ]


@pytest.mark.parametrize("i", range(14))
def test_opcheck(i):
    op, args = _opcheck_samples()[i]
    torch.library.opcheck(op, args)


def test_schemas_defined_once_agree_with_python_copy():
    from rope_ext._schemas import SCHEMAS

    for key, schema in SCHEMAS.items():
        name, _, overload = key.partition(".")
        op = getattr(getattr(torch.ops.rope, name), overload or "default")
        assert str(op._schema) == "rope::" + schema


def test_torch_compile_fullgraph_no_graph_break():
    torch._dynamo.reset()

    def step(x, cos, sin, q, k, pos, mpos, cache):
        y = torch.ops.rope.apply(x, cos, sin, False) * 2.0
        torch.ops.rope.apply_(q, k, pos, cache, True)
        z = rope_ext.apply_rope_at(x, pos, cache, interleaved=True)
        rope_ext.apply_mrope_(k, None, mpos, cache, [4, 6, 6], mrope_interleaved=True)
        return y, q + 1.0, k, z

    T, D = 6, 32
    x = torch.randn(T, 4, D)
    cos, sin = torch.randn(T, 1, D // 2), torch.randn(T, 1, D // 2)
    q, k = torch.randn(T, 4, D), torch.randn(T, 2, D)
    pos = torch.randint(0, 50, (T,))
    mpos = torch.randint(0, 50, (3, T))
    cache = rope_ext.cos_sin_cache(50, D)
    qe, ke = q.clone(), k.clone()
    eager = step(x, cos, sin, qe, ke, pos, mpos, cache)
    qc, kc = q.clone(), k.clone()
    compiled = torch.compile(step, fullgraph=True, backend="inductor")(x, cos, sin, qc, kc, pos, mpos, cache)
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # The in-place rotation reached the caller's tensors, as in eager.
    assert torch.equal(qc, qe) and torch.equal(kc, ke) and not torch.equal(qc, q)


def _unbacked_cases():
    """name -> (f of a dict of inputs, the inputs whose dim 0, the tokens, is unbacked)."""
    from rope_ext import qk_norm
    from rope_ext.compat import flashinfer
    ops = torch.ops.rope
    cache = rope_ext.cos_sin_cache(64, 16)
    cos, sin = cache[:, :8], cache[:, 8:]
    w = torch.rand(16) + 0.5
    fp8_table = torch.cat((cos[:, :4], sin[:, :4]), -1)
    return {
        "apply": (lambda a: ops.apply(a["q"], a["c"], a["s"]), ["q", "c", "s"]),
        "apply_": (lambda a: (ops.apply_(a["q"], a["k"], a["pos"], cache), a["q"] * 1)[1],
                   ["q", "k", "pos"]),
        "mrope_": (lambda a: (ops.mrope_(a["q"], a["k"], a["pos"].expand(3, -1), cache, [4, 2, 2]),
                              a["q"] * 1)[1], ["q", "k", "pos"]),
        "apply_rope_at": (lambda a: rope_ext.apply_rope_at(a["q"], a["pos"], cache), ["q", "pos"]),
        "apply_and_cache_": (lambda a: (ops.apply_and_cache_(
            a["q"], a["k"], a["v"], a["pos"], cache, a["kc"], a["vc"], a["slots"]), a["kc"] * 1)[1],
            ["q", "k", "v", "pos", "slots"]),
        "qk_norm_rope_and_cache_": (lambda a: (rope_ext.qk_norm_rope_and_cache_(
            a["q"], a["k"], a["v"], a["pos"], cache, w, w, a["kc"], a["vc"], a["slots"]),
            a["q"] * 1)[1], ["q", "k", "v", "pos", "slots"]),
        "qk_norm_rope": (lambda a: qk_norm.qk_norm_rope(a["q"], a["k"], w, w, a["c"], a["s"],
                                                        table_width="half")[0], ["q", "k", "c", "s"]),
        "rope_quantize_fp8": (lambda a: flashinfer.rope_quantize_fp8(
            a["q"][..., :8], a["k"][..., :8], a["q"][..., 8:], a["k"][..., 8:], fp8_table,
            a["pos"])[0].float(), ["q", "k", "pos"]),
        "shift_kv_cache_": (lambda a: (rope_ext.shift_kv_cache_(a["kc"], a["slots"], -2, cache),
                                       a["kc"] * 1)[1], ["slots"]),
    }


@pytest.mark.parametrize("name", list(_unbacked_cases()))
def test_compile_with_a_data_dependent_token_count(name):
    """Tokens whose count the trace cannot know (picked by nonzero(), a length from .item(),
    mark_unbacked, as one graph for decode and prefill): the checks leave those sizes to the
    kernel, which checks them when it runs; the compiled call is the eager one."""
    f, unbacked = _unbacked_cases()[name]
    cache = rope_ext.cos_sin_cache(64, 16)
    pos = torch.randint(0, 64, (3,))

    def inputs():
        g = torch.Generator().manual_seed(0)
        return dict(q=torch.randn(3, 4, 16, generator=g), k=torch.randn(3, 2, 16, generator=g),
                    v=torch.randn(3, 2, 16, generator=g), pos=pos.clone(),
                    kc=torch.randn(4, 4, 2, 16, generator=g), vc=torch.zeros(4, 4, 2, 16),
                    slots=torch.tensor([0, 5, -1]), c=cache[pos, None, :8], s=cache[pos, None, 8:])

    want = f(inputs())
    torch._dynamo.reset()
    a = inputs()
    for n in unbacked:
        torch._dynamo.decorators.mark_unbacked(a[n], 0)
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(a)
    assert torch.equal(got, want)


@pytest.mark.parametrize("fn", ["apply_rope", "qk_norm_rope"])
def test_table_gradients_with_a_data_dependent_token_count(fn):
    """Gradients w.r.t. per-token tables (and x) whose token count the trace cannot know: the
    backward sums a table over the dims it was broadcast along, and decides those as torch's
    broadcasting does (a size not known to be 1 matches x's) instead of guarding on data."""
    w = torch.randn(16)
    call = {"apply_rope": lambda x, c, s: rope_ext.apply_rope(x, c, s),
            "qk_norm_rope": lambda x, c, s: rope_ext.qk_norm_rope(x, x[:, :2], w, w, c, s,
                                                                 table_width="half")[0]}[fn]

    def loss(x, c, s):
        return call(x, c, s).square().sum()

    def inputs():
        g = torch.Generator().manual_seed(1)
        ang = torch.randn(5, 1, 8, generator=g)
        return [torch.randn(5, 4, 16, generator=g).requires_grad_(),
                ang.cos().requires_grad_(), ang.sin().requires_grad_()]

    a = inputs()
    want = torch.autograd.grad(loss(*a), a)
    torch._dynamo.reset()
    b = inputs()
    for t in b:
        torch._dynamo.decorators.mark_unbacked(t, 0)
    got = torch.autograd.grad(torch.compile(loss, fullgraph=True, backend="aot_eager")(*b), b)
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-6)


def test_export_of_tokens_picked_by_nonzero():
    cache = rope_ext.cos_sin_cache(64, 16)

    class Selected(torch.nn.Module):
        def forward(self, q, k, mask):
            idx = mask.nonzero()[:, 0]
            qs, ks = q[idx], k[idx]
            torch.ops.rope.apply_(qs, ks, idx, cache)
            return qs, ks

    q, k = torch.randn(10, 4, 16), torch.randn(10, 2, 16)
    mask = torch.tensor([1, 0, 1, 1, 0, 0, 1, 1, 1, 0], dtype=torch.bool)
    program = torch.export.export(Selected(), (q, k, mask))
    for got, want in zip(program.module()(q, k, mask), Selected()(q, k, mask)):
        assert torch.equal(got, want)


def test_torch_compile_backward():
    torch._dynamo.reset()
    x = torch.randn(3, 8, 2, 16, requires_grad=True)
    cos, sin = torch.randn(1, 8, 1, 8), torch.randn(1, 8, 1, 8)
    cache = rope_ext.cos_sin_cache(16, 16)
    pos = torch.randint(0, 16, (3, 8))

    def f(x):
        y = rope_ext.apply_rope(x, cos, sin, interleaved=True) + rope_ext.apply_rope_at(x, pos, cache)
        return y.square().sum()

    (g_eager,) = torch.autograd.grad(f(x), x)
    (g_comp,) = torch.autograd.grad(torch.compile(f, fullgraph=True)(x), x)
    torch.testing.assert_close(g_eager, g_comp)


@pytest.mark.parametrize("call,backend", [("apply_rope_", "inductor"), ("apply_rope_", "aot_eager"),
                                          ("apply_mrope_", "aot_eager"), ("forward_", "aot_eager"),
                                          ("table grad", "aot_eager"), ("table grad, a view", "inductor"),
                                          ("mrope table grad, a view", "inductor")])
def test_torch_compile_trains_through_the_in_place_ops(call, backend):
    # Training under torch.compile: the in-place ops on a tensor that requires grad, traced with
    # fake tensors (which show no memory to compare positions against), then the backward. A
    # learned table's gradient reads the rows before the write: with q a view of a larger buffer
    # (a qkv projection's), Inductor once read them after it.
    torch._dynamo.reset()
    x = torch.randn(5, 4, 16, requires_grad=True)
    table = rope_ext.cos_sin_cache(64, 16).requires_grad_("table grad" in call)
    pos = torch.randint(0, 64, (5,))
    module = rope_ext.RotaryEmbedding(16, max_position=64)

    def f(x, table):
        q = x * 2 if call != "table grad" else (x * 2).detach()
        if call.endswith("a view"):  # the query of a qkv projection's output
            q = (x[:, 0].repeat(1, 3 * 4) * 1).view(5, 3, 4, 16)[:, 0]
        if "mrope" in call:
            rope_ext.apply_mrope_(q, None, torch.stack((pos, pos.flip(0), pos)), table, [2, 3, 3])
        elif call == "forward_":
            module.forward_(q, None, pos)
        else:
            rope_ext.apply_rope_(q, None, pos, table)
        if call.endswith("a view"):
            return (q * weight).sum()
        return (q * torch.arange(16.0)).square().sum()

    weight = torch.randn(5, 4, 16)
    wrt = {"table grad": (table,)}.get(call, (x, table) if "table grad" in call else (x,))
    want = torch.autograd.grad(f(x, table), wrt)
    with torch._inductor.utils.fresh_inductor_cache():  # (the kernels' Python is not in its key)
        got = torch.autograd.grad(torch.compile(f, backend=backend, fullgraph=True)(x, table), wrt)
    for g, w in zip(got, want):
        assert w.abs().max() > 0
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_export_of_a_module_with_parameters_and_an_in_place_rotation():
    # torch.export traces with the parameters requiring grad: the in-place op's autograd path
    # runs on fake tensors.
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(16, 64)
            self.register_buffer("cache", rope_ext.cos_sin_cache(32, 16))

        def forward(self, x, pos):
            q = self.proj(x).view(x.shape[0], 4, 16)
            rope_ext.apply_rope_(q, None, pos, self.cache)
            return q

    block, x, pos = Block(), torch.randn(6, 16), torch.randint(0, 32, (6,))
    exported = torch.export.export(block, (x, pos))
    torch.testing.assert_close(exported.module()(x, pos), block(x, pos), rtol=0, atol=0)


def test_token_count_stays_symbolic_in_varlen_and_drop_in_paths():
    # Packed sequences (varlen_positions, flash-attn's cu_seqlens, TE's thd and start_positions):
    # one graph serves every token count (formatting a traced size into a check's message, or
    # refusing a SymInt as an int, specialized the graph to each count), and export takes a Dim.
    from torch._dynamo.testing import CompileCounter

    from rope_ext.compat import flash_attn, transformer_engine as te

    D = 16
    cache = rope_ext.cos_sin_cache(64, D)
    cos, sin = rope_ext.reference.cache_halves(cache)
    freqs = torch.rand(64, 1, 1, D) * 10
    calls = [
        lambda x, cu: rope_ext.apply_rope_at(x, rope_ext.varlen_positions(cu, x.shape[0]), cache),
        lambda x, cu: flash_attn.apply_rotary_emb(x, cos, sin, cu_seqlens=cu, max_seqlen=32),
        lambda x, cu: te.apply_rotary_pos_emb(x, freqs, "thd", cu_seqlens=cu),
        lambda x, cu: te.apply_rotary_pos_emb(x[:, None], freqs, "sbhd",
                                              start_positions=cu[:1]),
    ]
    for f in calls:
        torch._dynamo.reset()
        counter = CompileCounter()
        compiled = torch.compile(f, fullgraph=True, dynamic=True, backend=counter)
        for T in range(10, 15):
            x, cu = torch.randn(T, 2, D), torch.tensor([0, 3, T])
            assert torch.equal(compiled(x, cu), f(x, cu))
        assert counter.frame_count == 1

    class Varlen(torch.nn.Module):
        def forward(self, x, cu):
            return calls[0](x, cu)

    tokens = torch.export.Dim("tokens", min=4, max=64)
    ep = torch.export.export(Varlen(), (torch.randn(10, 2, D), torch.tensor([0, 3, 10])),
                             dynamic_shapes=({0: tokens}, None))
    x, cu = torch.randn(17, 2, D), torch.tensor([0, 5, 17])
    assert torch.equal(ep.module()(x, cu), calls[0](x, cu))


def _checkpointed_functions():
    from rope_ext.compat.transformers import apply_rotary_pos_emb

    pos, cache = torch.tensor([3, 0, 3, 1, 6]), torch.randn(7, 8)
    cos, sin = cache[:5, None, :4], cache[:5, None, 4:]
    return {
        "apply_rope_at": lambda x: rope_ext.apply_rope_at(x, pos, cache),
        "apply_rope": lambda x: rope_ext.apply_rope(x, cos, sin),
        "apply_rope_": lambda x: rope_ext.apply_rope_(x * 1.0, None, pos, cache)[0],
        "qk_norm_rope": lambda x: rope_ext.qk_norm_rope(x, x, torch.ones(8), torch.ones(8), cos, sin,
                                                        table_width="half")[0],
        "transformers drop-in": lambda x: apply_rotary_pos_emb(x[None], x[None], cache[None, :2],
                                                               cache[None, :2])[0],
    }


@pytest.mark.parametrize("name", list(_checkpointed_functions()))
@pytest.mark.parametrize("use_reentrant", [True, False])
def test_activation_checkpointing_ending_in_a_rope_op(name, use_reentrant):
    """torch.utils.checkpoint around a function whose last saved tensors are a rope op's: the
    non-reentrant mode stops the recomputation by raising its own exception from the hook that
    saves them, which must reach checkpoint as itself (the op's autograd path is called through
    the C++ router). Gradients equal the uncheckpointed ones."""
    from torch.utils.checkpoint import checkpoint

    fn = _checkpointed_functions()[name]
    x0 = torch.randn(5, 2, 8)
    x = x0.clone().requires_grad_()
    fn(x).square().sum().backward()
    want = x.grad
    x = x0.clone().requires_grad_()
    checkpoint(fn, x, use_reentrant=use_reentrant).square().sum().backward()
    assert torch.equal(x.grad, want)


@pytest.mark.parametrize("name", ["apply_rope_", "apply_mrope_", "forward_"])
def test_selective_checkpointing_whose_policy_saves_the_rope_ops_still_rotates(name):
    """Selective activation checkpointing replays a saved op from what it returned: the in-place
    ops return nothing, so they run again whatever the policy says (else the recomputation reads
    unrotated q and k, and the gradient is wrong with no error)."""
    import functools

    from torch.utils.checkpoint import (CheckpointPolicy, checkpoint,
                                        create_selective_checkpoint_contexts)

    pos, cache = torch.tensor([3, 0, 3, 1, 6]), torch.randn(7, 8, dtype=torch.float64)
    rotate = {
        "apply_rope_": lambda q: rope_ext.apply_rope_(q, None, pos, cache),
        "apply_mrope_": lambda q: rope_ext.apply_mrope_(q, None, torch.stack((pos, pos.flip(0), pos)),
                                                        cache, [2, 1, 1]),
        "forward_": lambda q: rope_ext.RotaryEmbedding(8, max_position=7).double().forward_(q, None, pos),
    }[name]

    def block(x):
        q = x * 1.0
        rotate(q)
        return (q * q).sum()  # mul saves the rotated q

    def saves_rope_ops(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if str(op).startswith("rope.") else \
            CheckpointPolicy.PREFER_RECOMPUTE

    x0 = torch.randn(5, 2, 8, dtype=torch.float64)
    x = x0.clone().requires_grad_()
    block(x).backward()
    want = x.grad
    x = x0.clone().requires_grad_()
    context = functools.partial(create_selective_checkpoint_contexts, saves_rope_ops)
    checkpoint(block, x, use_reentrant=False, context_fn=context).backward()
    assert torch.equal(x.grad, want)


def test_another_threads_compilation_leaves_eager_checks_on(monkeypatch):
    """torch sets torch.compiler.is_compiling()'s flag for the whole process while any thread
    compiles; an eager call of this thread meanwhile still checks its data (as it does alone):
    torch's inference-tensor rule, the ValueErrors of values read on the host."""
    monkeypatch.setattr(torch.compiler, "_is_compiling_flag", True)  # another thread compiling
    assert torch.compiler.is_compiling()
    with torch.inference_mode():
        q = torch.randn(4, 2, 16)
    before = q.clone()
    with pytest.raises(RuntimeError, match="Inplace update to inference tensor outside InferenceMode"):
        rope_ext.apply_rope_(q, None, torch.arange(4), rope_ext.cos_sin_cache(64, 16))
    assert torch.equal(q, before)
    with pytest.raises(ValueError, match=r"cu_seqlens must be non-decreasing"):
        rope_ext.varlen_positions(torch.tensor([0, 5, 3]), 8)
