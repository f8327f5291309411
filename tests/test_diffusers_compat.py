"""rope_ext.compat.diffusers against diffusers' own functions (run in an environment with
diffusers; skipped without it): every argument combination of apply_rotary_emb, the per-model
helpers, values and gradients, tables of every kind; and multi_axis_cos_sin against FLUX's
tables. A float64 rotation written here is the second reference."""

import pytest
import torch

from conftest import TOL

diffusers = pytest.importorskip("diffusers")

from diffusers.models import attention_processor  # noqa: E402
from diffusers.models import embeddings as emb  # noqa: E402
from diffusers.models.transformers import transformer_ltx, transformer_qwenimage, transformer_wan  # noqa: E402

from rope_ext.compat import diffusers as rd  # noqa: E402
from rope_ext.integrations import diffusers as rdi  # noqa: E402
from rope_ext.tables import multi_axis_cos_sin  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def close(got, want, dtype, scale=1.0):
    assert got.dtype == want.dtype and got.shape == want.shape
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(got.double(), want.double(), rtol=rtol * scale, atol=atol * scale)


def close_reduced(got, want, terms):
    """A table's gradient is a sum over the batch and heads that share each entry: two correct
    float32 summation orders differ by about eps * terms * the largest partial sum, so the
    tolerance is relative to the gradient's magnitude, not to each (possibly cancelled) entry."""
    close(got, want, torch.float32, scale=terms * max(1.0, want.abs().max().item()))


def oracle(x, cos, sin, interleaved):
    """float64 rotation with full-width tables (each member of a pair reads its own entry)."""
    x, cos, sin = x.double(), cos.double(), sin.double()
    if interleaved:
        rot = torch.stack((-x[..., 1::2], x[..., 0::2]), -1).flatten(-2)
    else:
        h = x.shape[-1] // 2
        rot = torch.cat((-x[..., h:], x[..., :h]), -1)
    return x * cos + rot * sin


def tables(S, D, interleaved, duplicated):
    if not duplicated:
        return torch.randn(S, D), torch.randn(S, D)
    return emb.get_1d_rotary_pos_embed(D, torch.rand(S) * 100, use_real=True,
                                       repeat_interleave_real=interleaved)


def placed(t, sequence_dim):
    return t[None, None] if sequence_dim == 2 else t[None, :, None]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sequence_dim", [1, 2])
@pytest.mark.parametrize("unbind", [-1, -2])
@pytest.mark.parametrize("duplicated", [True, False])
def test_apply_rotary_emb_real(dtype, sequence_dim, unbind, duplicated):
    B, H, S, D = 2, 3, 7, 16
    x = torch.randn((B, H, S, D) if sequence_dim == 2 else (B, S, H, D), dtype=dtype)
    x0 = x.clone()
    cos, sin = tables(S, D, unbind == -1, duplicated)
    kw = dict(use_real_unbind_dim=unbind, sequence_dim=sequence_dim)
    for _ in range(2):  # the second call reads the remembered one-entry-per-pair tables
        got = rd.apply_rotary_emb(x, (cos, sin), **kw)
        want = emb.apply_rotary_emb(x, (cos, sin), **kw)
        close(got, want, torch.float32 if dtype == torch.float64 else dtype)
        if dtype in (torch.float32, torch.bfloat16):
            assert torch.equal(got, want)  # the same products and sums, rounded alike
    want64 = oracle(x, placed(cos, sequence_dim), placed(sin, sequence_dim), unbind == -1)
    # diffusers computes in float32 whatever x is (x.float()): float32 accuracy, x's dtype.
    close(got.double(), want64, torch.float32 if dtype == torch.float64 else dtype, scale=2.0)
    assert torch.equal(x, x0)


@pytest.mark.parametrize("table_dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_table_dtypes(table_dtype):
    x = torch.randn(2, 9, 4, 32, dtype=torch.bfloat16)
    cos, sin = (t.to(table_dtype) for t in tables(9, 32, True, True))
    got = rd.apply_rotary_emb(x, (cos, sin), sequence_dim=1)
    close(got, emb.apply_rotary_emb(x, (cos, sin), sequence_dim=1), torch.bfloat16)


@pytest.mark.parametrize("unbind", [-1, -2])
@pytest.mark.parametrize("duplicated", [True, False])
def test_apply_rotary_emb_gradients(unbind, duplicated):
    B, H, S, D = 2, 3, 5, 8
    cos, sin = tables(S, D, unbind == -1, duplicated)
    grads = []
    for fn in (rd.apply_rotary_emb, emb.apply_rotary_emb):
        x = torch.randn(B, H, S, D, generator=torch.Generator().manual_seed(1)).requires_grad_()
        c, s = cos.clone().requires_grad_(), sin.clone().requires_grad_()
        out = fn(x, (c, s), use_real_unbind_dim=unbind)
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(2)))
        grads.append((out.detach(), x.grad, c.grad, s.grad))
    for g, w in zip(grads[0][:2], grads[1][:2]):
        close(g, w, torch.float32, scale=4.0)
    for g, w in zip(grads[0][2:], grads[1][2:]):
        close_reduced(g, w, terms=B * H)
    # Only x requiring grad: the one-pass path's gradient.
    x = torch.randn(B, H, S, D).requires_grad_()
    rd.apply_rotary_emb(x, (cos, sin), use_real_unbind_dim=unbind).sum().backward()
    x2 = x.detach().clone().requires_grad_()
    emb.apply_rotary_emb(x2, (cos, sin), use_real_unbind_dim=unbind).sum().backward()
    close(x.grad, x2.grad, torch.float32)


def test_float64_x_and_tables_computed_in_float64():
    """diffusers computes x.float() * cos ...: with float64 tables, in float64 from x rounded to
    float32. Here x is not rounded: the float64 rotation itself (diffusers' result is within
    x's float32 rounding of it)."""
    from diffusers.models.embeddings import apply_rotary_emb as peer

    x = torch.randn(1, 5, 2, 8, dtype=torch.float64)
    angles = torch.rand(5, 4, dtype=torch.float64) * 10
    cos_sin = (angles.cos().repeat_interleave(2, -1), angles.sin().repeat_interleave(2, -1))
    freqs = torch.polar(torch.ones(1, 5, 4, dtype=torch.float64), angles[None])
    exact = torch.view_as_real(torch.view_as_complex(x.reshape(1, 5, 2, 4, 2)) * freqs[:, :, None]).flatten(-2)
    for got, want in ((rd.apply_rotary_emb(x, cos_sin, sequence_dim=1), peer(x, cos_sin, sequence_dim=1)),
                      (rd.apply_rotary_emb(x, freqs, use_real=False), peer(x, freqs, use_real=False))):
        torch.testing.assert_close(got, exact, rtol=1e-14, atol=1e-14)
        torch.testing.assert_close(got, want, rtol=0, atol=4 * 2**-24 * x.abs().max().item())


def test_gradcheck_float64_tables():
    # float64 tables make the math float64: gradcheck applies.
    x = torch.randn(1, 2, 3, 8, dtype=torch.float64, requires_grad=True)
    cos = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
    sin = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
    for unbind in (-1, -2):
        assert torch.autograd.gradcheck(
            lambda a, c, s: rd.apply_rotary_emb(a, (c, s), use_real_unbind_dim=unbind), (x, cos, sin))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_rotary_emb_complex(dtype):
    B, S, H, D = 2, 6, 3, 16
    x = torch.randn(B, S, H, D, dtype=dtype)
    freqs = torch.polar(torch.ones(B, S, D // 2), torch.rand(B, S, D // 2) * 50)
    got = rd.apply_rotary_emb(x, freqs, use_real=False)
    close(got, emb.apply_rotary_emb(x, freqs, use_real=False), dtype)
    ang = freqs.angle().double()[:, :, None]
    cos, sin = ang.cos().repeat_interleave(2, -1), ang.sin().repeat_interleave(2, -1)
    close(got.double(), oracle(x, cos, sin, True), dtype, scale=2.0)
    # A conjugate view (the inverse rotation), which diffusers multiplies by as it is.
    close(rd.apply_rotary_emb(x, freqs.conj(), use_real=False),
          emb.apply_rotary_emb(x, freqs.conj(), use_real=False), dtype)
    # Gradients w.r.t. x and the complex table.
    outs = []
    for fn in (rd.apply_rotary_emb, emb.apply_rotary_emb):
        xg = x.float().clone().requires_grad_()
        fg = freqs.clone().requires_grad_()
        out = fn(xg, fg, use_real=False)
        out.backward(torch.ones_like(out))
        outs.append((xg.grad, fg.grad))
    for g, w in zip(*outs):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_qwen():
    x = torch.randn(2, 6, 3, 16)
    freqs = torch.polar(torch.ones(6, 8), torch.rand(6, 8) * 50)
    close(rd.apply_rotary_emb_qwen(x, freqs, use_real=False),
          transformer_qwenimage.apply_rotary_emb_qwen(x, freqs, use_real=False), torch.float32)
    cos, sin = tables(3, 16, True, True)
    for unbind in (-1, -2):
        close(rd.apply_rotary_emb_qwen(x, (cos, sin), use_real_unbind_dim=unbind),
              transformer_qwenimage.apply_rotary_emb_qwen(x, (cos, sin), use_real_unbind_dim=unbind),
              torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ltx(dtype):
    x = torch.randn(2, 9, 48, dtype=dtype)
    ang = torch.rand(2, 9, 24) * 30
    cos, sin = ang.cos().repeat_interleave(2, -1), ang.sin().repeat_interleave(2, -1)
    cos[..., :4], sin[..., :4] = 1.0, 0.0  # LTX pads the first dims with the identity
    close(rd.apply_rotary_emb_ltx(x, (cos, sin)), transformer_ltx.apply_rotary_emb(x, (cos, sin)), dtype)


def originals(processor_module, processor, names):
    base = getattr(processor_module, processor)
    return rdi._diffusers_functions(base, processor_module, names)["apply_rotary_emb"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_wan(dtype):
    wan = originals(transformer_wan, "WanAttnProcessor", {"apply_rotary_emb": "apply_rotary_emb_wan"})
    x = torch.randn(2, 10, 3, 12, dtype=dtype)
    cos, sin = torch.randn(1, 10, 1, 12), torch.randn(1, 10, 1, 12)  # any tables: Wan reads both
    close(rd.apply_rotary_emb_wan(x, cos, sin), wan(x, cos, sin), dtype)
    xs = [x.float().clone().requires_grad_() for _ in range(2)]
    ts = [(cos.clone().requires_grad_(), sin.clone().requires_grad_()) for _ in range(2)]
    for fn, xg, (c, s) in zip((rd.apply_rotary_emb_wan, wan), xs, ts):
        fn(xg, c, s).pow(2).sum().backward()
    close(xs[0].grad, xs[1].grad, torch.float32)
    close_reduced(ts[0][0].grad, ts[1][0].grad, terms=x.shape[0] * x.shape[2])
    close_reduced(ts[0][1].grad, ts[1][1].grad, terms=x.shape[0] * x.shape[2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mochi(dtype):
    mochi = originals(attention_processor, "MochiAttnProcessor2_0",
                      {"apply_rotary_emb": "apply_rotary_emb_mochi"})
    x = torch.randn(2, 10, 3, 16, dtype=dtype)
    cos, sin = torch.randn(10, 3, 8), torch.randn(10, 3, 8)
    close(rd.apply_rotary_emb_mochi(x, cos, sin), mochi(x, cos, sin), dtype)


def test_table_changed_in_place_is_seen():
    x = torch.randn(1, 2, 5, 8)
    cos, sin = tables(5, 8, True, True)
    close(rd.apply_rotary_emb(x, (cos, sin)), emb.apply_rotary_emb(x, (cos, sin)), torch.float32)
    cos[:, 1::2] += 0.25  # the pairs' entries now differ: the remembered check must not serve
    close(rd.apply_rotary_emb(x, (cos, sin)), emb.apply_rotary_emb(x, (cos, sin)), torch.float32)
    cos[:, 1::2] = cos[:, 0::2]
    close(rd.apply_rotary_emb(x, (cos, sin)), emb.apply_rotary_emb(x, (cos, sin)), torch.float32)


@pytest.mark.parametrize("how", ["data assigned", "data copied into"])
@pytest.mark.parametrize("unbind", [-1, -2])
def test_table_changed_without_a_version_bump_is_seen(how, unbind):
    """`t.data = new` and `t.data.copy_(new)` change a table's values without a version bump:
    the drop-in must not serve the pairs' check of the old values."""
    x = torch.randn(1, 5, 2, 8)
    kw = dict(sequence_dim=1, use_real_unbind_dim=unbind)
    cos, sin = tables(5, 8, unbind == -1, True)
    close(rd.apply_rotary_emb(x, (cos, sin), **kw), emb.apply_rotary_emb(x, (cos, sin), **kw),
          torch.float32)
    for duplicated in (False, True):
        new_cos, _ = tables(5, 8, unbind == -1, duplicated)
        before = cos._version
        if how == "data assigned":
            cos.data = new_cos
        else:
            cos.data.copy_(new_cos)
        assert cos._version == before
        close(rd.apply_rotary_emb(x, (cos, sin), **kw),
              emb.apply_rotary_emb(x, (cos, sin), **kw), torch.float32)


def test_inference_mode_tables():
    x = torch.randn(1, 2, 5, 8)
    with torch.inference_mode():
        cos, sin = tables(5, 8, True, True)
        close(rd.apply_rotary_emb(x, (cos, sin)), emb.apply_rotary_emb(x, (cos, sin)), torch.float32)
        cos[:, 1::2] += 0.25  # no version counter here: the check runs again
        close(rd.apply_rotary_emb(x, (cos, sin)), emb.apply_rotary_emb(x, (cos, sin)), torch.float32)


@pytest.mark.parametrize("unbind", [-1, -2])
def test_compiled_drop_in(unbind):
    # In a graph the pairs' comparison runs each call and torch.cond picks the path.
    x = torch.randn(1, 7, 2, 16)
    compiled = torch.compile(rd.apply_rotary_emb, fullgraph=True, backend="aot_eager")
    kw = dict(sequence_dim=1, use_real_unbind_dim=unbind)
    for duplicated in (True, False, True):
        cos, sin = tables(7, 16, unbind == -1, duplicated)
        close(compiled(x, (cos, sin), **kw), emb.apply_rotary_emb(x, (cos, sin), **kw), torch.float32)
        xs = [x.clone().requires_grad_() for _ in range(2)]
        compiled(xs[0], (cos, sin), **kw).pow(2).sum().backward()
        emb.apply_rotary_emb(xs[1], (cos, sin), **kw).pow(2).sum().backward()
        close(xs[0].grad, xs[1].grad, torch.float32)


@pytest.mark.parametrize("call, match", [
    (lambda x, cs: rd.apply_rotary_emb(x, cs, use_real_unbind_dim=0), "use_real_unbind_dim=0"),
    (lambda x, cs: rd.apply_rotary_emb(x, cs, sequence_dim=3), "sequence_dim=3"),
    (lambda x, cs: rd.apply_rotary_emb(x[0, 0, 0], cs), "4-D"),
    (lambda x, cs: rd.apply_rotary_emb(x[0], cs[0], use_real=False), "4-D"),
    (lambda x, cs: rd.apply_rotary_emb(x, (cs[0][:, :4], cs[1][:, :4])), "head dim"),
    (lambda x, cs: rd.apply_rotary_emb(x, (cs[0][:3], cs[1][:3])), "do not broadcast"),
    (lambda x, cs: rd.apply_rotary_emb(x, cs[0]), "pair of tensors"),
    (lambda x, cs: rd.apply_rotary_emb(x, (cs[0].numpy(), cs[1])), "cos must be a floating-point tensor"),
    (lambda x, cs: rd.apply_rotary_emb(x, (cs[0], cs[1].long())), "sin must be a floating-point tensor"),
    (lambda x, cs: rd.apply_rotary_emb(x, cs[0][:, :4], use_real=False), "complex"),
    (lambda x, cs: rd.apply_rotary_emb_wan(x, cs[0][:, :4], cs[1]), "freqs_cos"),
    (lambda x, cs: rd.apply_rotary_emb_ltx(x, cs), "3-D"),
])
def test_errors(call, match):
    x = torch.randn(2, 3, 5, 8)
    with pytest.raises(ValueError, match=match):
        call(x, tables(5, 8, True, True))


@pytest.mark.parametrize("axes_dim, n", [((4, 6, 6), 3), ((16, 56, 56), 3), ((32, 32, 32, 32), 4)])
def test_multi_axis_tables_are_flux_tables(axes_dim, n):
    from diffusers.models.transformers.transformer_flux import FluxPosEmbed

    ids = torch.cat((torch.zeros(5, n), torch.rand(20, n) * 64), dim=0)
    want_cos, want_sin = FluxPosEmbed(theta=10000, axes_dim=list(axes_dim))(ids)
    cos, sin = multi_axis_cos_sin(ids.float(), axes_dim, 10000.0)
    assert torch.equal(cos.repeat_interleave(2, -1), want_cos)
    assert torch.equal(sin.repeat_interleave(2, -1), want_sin)
