"""Forward-mode AD (torch.func.jvp, torch.autograd.forward_ad) through the public functions and
the ops: the tangent is the derivative, checked against central differences in float64 on fresh
random inputs and tangents, in grad mode and under no_grad; ops that are not differentiable
refuse a tangent instead of dropping it."""

import pytest
import torch
import torch.autograd.forward_ad as fwAD

import rope_ext
from rope_ext.qk_norm import qk_norm_rope, qk_norm_rope_

ops = torch.ops.rope
F64 = torch.float64


def central_difference(f, primals, tangents, h=1e-6):
    """(f(p + h t) - f(p - h t)) / 2h, for f returning a tensor or a tuple of tensors."""
    def at(sign):
        out = f(*[p + sign * h * t if t is not None else p for p, t in zip(primals, tangents)])
        return out if isinstance(out, tuple) else (out,)
    plus, minus = at(1), at(-1)
    return tuple((a - b) / (2 * h) for a, b in zip(plus, minus))


def check_jvp(f, primals, tangents):
    """torch.func.jvp of f against central differences (every primal given a tangent)."""
    out, tangent_out = torch.func.jvp(f, tuple(primals), tuple(tangents))
    out = out if isinstance(out, tuple) else (out,)
    tangent_out = tangent_out if isinstance(tangent_out, tuple) else (tangent_out,)
    expected = central_difference(f, primals, tangents)
    for got, want, value in zip(tangent_out, expected, out):
        assert want.abs().max() > 0.1, "the check needs a tangent that is not zero"
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    plain = f(*primals)
    plain = plain if isinstance(plain, tuple) else (plain,)
    for value, want in zip(out, plain):
        torch.testing.assert_close(value, want, rtol=1e-12, atol=1e-12)


def tables(rows, half):
    return torch.randn(rows, 1, half, dtype=F64), torch.randn(rows, 1, half, dtype=F64)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotary", [8, 4])  # full and partial rotary
def test_jvp_of_apply_rope_wrt_x_and_tables(interleaved, rotary):
    x = torch.randn(5, 3, 8, dtype=F64)
    cos, sin = tables(5, rotary // 2)
    f = lambda x, c, s: rope_ext.apply_rope(x, c, s, interleaved=interleaved)  # noqa: E731
    check_jvp(f, (x, cos, sin), (torch.randn_like(x), torch.randn_like(cos), torch.randn_like(sin)))
    check_jvp(lambda x: f(x, cos, sin), (x,), (torch.randn_like(x),))


def test_jvp_of_the_op_and_of_its_backward():
    x = torch.randn(4, 2, 16, dtype=F64)
    cos, sin = tables(4, 6)
    for op in (ops.apply, ops.apply_backward):
        check_jvp(lambda x, c: op(x, c, sin, False), (x, cos), (torch.randn_like(x), torch.randn_like(cos)))


def test_jvp_of_apply_rope_at_gathered_and_mrope():
    x = torch.randn(6, 2, 16, dtype=F64)
    cache = torch.randn(32, 12, dtype=F64)
    pos = torch.randint(0, 32, (6,))
    check_jvp(lambda x, c: rope_ext.apply_rope_at(x, pos, c), (x, cache),
              (torch.randn_like(x), torch.randn_like(cache)))
    pos3 = torch.randint(0, 32, (3, 6))
    check_jvp(lambda x: rope_ext.apply_rope_at(x, pos3, cache, mrope_section=[2, 2, 2]), (x,),
              (torch.randn_like(x),))


@pytest.mark.parametrize("grad_mode", [True, False])
def test_forward_ad_through_apply_rope(grad_mode):
    x, t = torch.randn(5, 2, 8, dtype=F64), torch.randn(5, 2, 8, dtype=F64)
    cos, sin = tables(5, 4)
    with torch.set_grad_enabled(grad_mode), fwAD.dual_level():
        out = rope_ext.apply_rope(fwAD.make_dual(x, t), cos, sin)
        primal, tangent = fwAD.unpack_dual(out)
    assert tangent is not None
    torch.testing.assert_close(tangent, rope_ext.reference.apply_rope(t, cos, sin))  # linear in x
    torch.testing.assert_close(primal, rope_ext.reference.apply_rope(x, cos, sin))


@pytest.mark.parametrize("grad_mode", [True, False])
@pytest.mark.parametrize("mrope", [False, True])
def test_forward_ad_through_the_in_place_rotation(grad_mode, mrope):
    """apply_rope_ / apply_mrope_ rotate the tangent with the primal (it was left unrotated)."""
    q, tq = torch.randn(6, 3, 16, dtype=F64), torch.randn(6, 3, 16, dtype=F64)
    k, tk = torch.randn(6, 1, 16, dtype=F64), torch.randn(6, 1, 16, dtype=F64)
    cache = torch.randn(40, 12, dtype=F64)
    pos = torch.randint(0, 40, (3, 6) if mrope else (6,))

    def rotate(a, b):
        if mrope:
            return rope_ext.apply_mrope_(a, b, pos, cache, [2, 2, 2])
        return rope_ext.apply_rope_(a, b, pos, cache)

    with torch.set_grad_enabled(grad_mode), fwAD.dual_level():
        # (make_dual keeps the tangent tensor itself, which the rotation updates in place)
        a, b = fwAD.make_dual(q.clone(), tq.clone()), fwAD.make_dual(k.clone(), tk.clone())
        rotate(a, b)
        (pa, ta), (pb, tb) = fwAD.unpack_dual(a), fwAD.unpack_dual(b)
    want_q, want_k = q.clone(), k.clone()
    rotate(want_q, want_k)
    want_tq, want_tk = tq.clone(), tk.clone()
    rotate(want_tq, want_tk)  # linear: the tangent rotates like the primal
    for got, want in ((pa, want_q), (pb, want_k), (ta, want_tq), (tb, want_tk)):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("unit_offset", [False, True])
def test_jvp_of_qk_norm_rope_wrt_rows_and_weights(unit_offset):
    q, k = torch.randn(4, 3, 16, dtype=F64), torch.randn(4, 2, 16, dtype=F64)
    wq, wk = torch.randn(16, dtype=F64), torch.randn(16, dtype=F64)
    angles = torch.randn(4, 8, dtype=F64)
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()

    def f(q, k, wq, wk):
        return qk_norm_rope(q, k, wq, wk, cos, sin, unit_offset=unit_offset)

    check_jvp(f, (q, k, wq, wk), tuple(torch.randn_like(t) for t in (q, k, wq, wk)))


def test_serving_ops_refuse_a_tangent():
    """Ops that refuse gradients refuse tangents too, naming the op, before writing anything."""
    q, k = torch.randn(3, 2, 16, dtype=F64), torch.randn(3, 1, 16, dtype=F64)
    w = torch.randn(16, dtype=F64)
    cache = torch.randn(8, 16, dtype=F64)
    pos = torch.randint(0, 8, (3,))
    for grad_mode in (True, False):
        with torch.set_grad_enabled(grad_mode), fwAD.dual_level():
            a = fwAD.make_dual(q.clone(), torch.randn_like(q))
            with pytest.raises(RuntimeError, match="rope.qk_norm_rope_: not differentiable, but "
                                                   "a forward-mode AD tangent"):
                qk_norm_rope_(a, k.clone(), w, w, pos, cache)
            assert torch.equal(fwAD.unpack_dual(a).primal, q)
            if grad_mode:  # (under no_grad the op itself sees no tangent: the functions do)
                out = torch.empty_like(q)
                with pytest.raises(RuntimeError, match="rope.apply.out: not differentiable"):
                    ops.apply.out(a, cache[:3, None, :8], cache[:3, None, 8:], False, out=out)


def test_no_tangent_costs_nothing_and_changes_nothing():
    """Inside a dual level, calls whose inputs carry no tangent take the native kernel."""
    x = torch.randn(5, 2, 8)
    cos, sin = torch.randn(5, 1, 4), torch.randn(5, 1, 4)
    with fwAD.dual_level():
        out = rope_ext.apply_rope(x, cos, sin)
        assert fwAD.unpack_dual(out).tangent is None
    assert torch.equal(out, ops.apply(x, cos, sin, False))


def drop_in_cases():
    """name -> (f, primals, the peer's f or None): the drop-ins, whose calls go through the same
    op wrapper (rope_ext._call) as the public functions'. Tangents of full-width tables have
    unequal halves, which only the peer's own function defines (rope_ext's primal reads one half
    of tables that hold each angle twice): those cases compare with the peer's jvp."""
    import peers
    from rope_ext.compat import diffusers, flash_attn, llama, transformer_engine, transformers

    q, k = torch.randn(1, 2, 5, 8, dtype=F64), torch.randn(1, 1, 5, 8, dtype=F64)
    ang = torch.randn(1, 5, 4, dtype=F64)
    full = torch.cat((ang, ang), -1)
    x = torch.randn(1, 5, 2, 8, dtype=F64)
    freqs_cis = torch.polar(torch.ones(5, 4, dtype=F64), ang[0])
    pairs = ang[0].repeat_interleave(2, -1)

    def diffusers_peer(*args):
        from diffusers.models.embeddings import apply_rotary_emb
        return apply_rotary_emb(*args)

    return {
        "transformers, q and k": (
            lambda a, b: transformers.apply_rotary_pos_emb(a, b, full.cos(), full.sin()), (q, k),
            None),
        "transformers, tables": (
            lambda c, s: transformers.apply_rotary_pos_emb(q, k, c, s), (full.cos(), full.sin()),
            lambda c, s: peers.hf_apply_rotary_pos_emb(q, k, c, s)),
        # (flash-attn's tables take no gradient, and no tangent: test_flash_attn_tables_carry_no_tangent)
        "flash_attn": (lambda a: flash_attn.apply_rotary_emb(a, ang[0].cos(), ang[0].sin()), (x,), None),
        "transformer_engine": (lambda t, f: transformer_engine.apply_rotary_pos_emb(t, f),
                               (x.transpose(0, 1), torch.randn(5, 1, 1, 8, dtype=F64)), None),
        # TE's own table holds each angle twice; a tangent on it need not (one pass would drop
        # the second member's). TE makes it on the GPU where there is one: moved to x's device.
        "transformer_engine, its table": (
            lambda t, f: transformer_engine.apply_rotary_pos_emb(t, f),
            (x.transpose(0, 1), transformer_engine.RotaryPositionEmbedding(8)(5).to("cpu", F64)),
            None),
        "llama": (lambda a, b: llama.apply_rotary_emb(a, b, freqs_cis), (x, x.flip(1)), None),
        "diffusers": (lambda a, c, s: diffusers.apply_rotary_emb(a, (c, s)),
                      (q, pairs.cos(), pairs.sin()),
                      lambda a, c, s: diffusers_peer(a, (c, s))),
    }


@pytest.mark.parametrize("case", ["transformers, q and k", "transformers, tables", "flash_attn",
                                  "transformer_engine", "transformer_engine, its table", "llama",
                                  "diffusers"])
def test_jvp_through_the_drop_ins(case):
    if case == "diffusers":
        pytest.importorskip("diffusers")
    f, primals, peer = drop_in_cases()[case]
    tangents = tuple(torch.randn_like(p) for p in primals)
    if peer is None:
        check_jvp(f, primals, tangents)
        return
    # (diffusers' function computes in float32 whatever the input's dtype)
    for got, want in zip(torch.func.jvp(f, primals, tangents), torch.func.jvp(peer, primals, tangents)):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("grad_mode", [True, False])
def test_forward_ad_through_a_drop_in_keeps_the_tangent(grad_mode):
    f, (q, k), _ = drop_in_cases()["transformers, q and k"]
    tq, tk = torch.randn_like(q), torch.randn_like(k)
    want = central_difference(f, (q, k), (tq, tk))
    with torch.set_grad_enabled(grad_mode), fwAD.dual_level():
        out = f(fwAD.make_dual(q, tq), fwAD.make_dual(k, tk))
        for got, w in zip(out, want):
            torch.testing.assert_close(fwAD.unpack_dual(got).tangent, w, rtol=1e-6, atol=1e-6)


def test_flash_attn_tables_carry_no_tangent():
    """flash-attn's Functions give cos and sin no gradient: no tangent either (one on x is kept)."""
    from rope_ext.compat import flash_attn

    x, cos, sin = torch.randn(1, 4, 2, 8, dtype=F64), torch.randn(4, 4, dtype=F64), torch.randn(4, 4, dtype=F64)
    with fwAD.dual_level():
        out = flash_attn.apply_rotary_emb(x, fwAD.make_dual(cos, torch.randn_like(cos)), sin)
        assert fwAD.unpack_dual(out).tangent is None
        tx = torch.randn_like(x)
        out = flash_attn.apply_rotary_emb(fwAD.make_dual(x, tx), fwAD.make_dual(cos, torch.randn_like(cos)), sin)
        want = central_difference(lambda x: flash_attn.apply_rotary_emb(x, cos, sin), (x,), (tx,))[0]
        torch.testing.assert_close(fwAD.unpack_dual(out).tangent, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("grad_mode", [True, False])
def test_jvp_where_some_calls_carry_no_tangent(grad_mode):
    """Inside torch.func.jvp a call none of whose inputs carries a tangent (the key beside a
    query that has one; a captured tensor) still runs, with grad mode on or off: functorch's
    wrappers, which have no storage, must not reach the native kernel, and the output is the
    same."""
    from rope_ext.compat import transformers

    q, k = torch.randn(1, 2, 5, 8, dtype=F64), torch.randn(1, 1, 5, 8, dtype=F64)
    ang = torch.randn(1, 5, 4, dtype=F64)
    cos, sin = torch.cat((ang, ang), -1).cos(), torch.cat((ang, ang), -1).sin()
    x, (c, s) = torch.randn(5, 3, 8, dtype=F64), tables(5, 4)

    def both(a):
        q_embed, k_embed = transformers.apply_rotary_pos_emb(a, k, cos, sin)
        return q_embed + k_embed.sum()

    with torch.set_grad_enabled(grad_mode):
        check_jvp(both, (q,), (torch.randn_like(q),))
        check_jvp(lambda a: rope_ext.apply_rope(x, c, s) * a, (x,), (torch.randn_like(x),))
