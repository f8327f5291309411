"""Autograd (gradcheck), opcheck and torch.compile(fullgraph=True) for the rope ops."""

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
@pytest.mark.parametrize("table_shape", [(1, 1, 5, 6), (5, 1, 6), (2, 5, 1, 6)])
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


def _opcheck_samples():
    x = torch.randn(2, 5, 3, 16)
    cos, sin = torch.randn(5, 1, 6), torch.randn(5, 1, 6)
    q, k = torch.randn(7, 4, 16), torch.randn(7, 2, 16)
    pos = torch.randint(0, 20, (7,), dtype=torch.int32)
    cache = rope_ext.cos_sin_cache(20, 12)
    xg = x.double().requires_grad_()
    return [
        (torch.ops.rope.apply.default, (x, cos, sin, False)),
        (torch.ops.rope.apply.default, (x, cos, sin, True)),
        (torch.ops.rope.apply.default, (xg, cos.double().requires_grad_(), sin.double(), False)),
        (torch.ops.rope.apply.default, (x.transpose(1, 2), torch.randn(3, 1, 6), torch.randn(3, 1, 6), True)),
        (torch.ops.rope.apply_backward.default, (x, cos, sin, False)),
        (torch.ops.rope.apply_backward.default, (xg, cos.double(), sin.double(), True)),
        (torch.ops.rope.apply_.default, (q, k, pos, cache, False)),
        (torch.ops.rope.apply_.default, (q.clone(), None, pos.long(), cache, True)),
    ]


@pytest.mark.parametrize("i", range(8))
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

    def step(x, cos, sin, q, k, pos, cache):
        y = torch.ops.rope.apply(x, cos, sin, False) * 2.0
        torch.ops.rope.apply_(q, k, pos, cache, True)
        return y, q + 1.0, k

    T, D = 6, 32
    x = torch.randn(T, 4, D)
    cos, sin = torch.randn(T, 1, D // 2), torch.randn(T, 1, D // 2)
    q, k = torch.randn(T, 4, D), torch.randn(T, 2, D)
    pos = torch.randint(0, 50, (T,))
    cache = rope_ext.cos_sin_cache(50, D)
    qe, ke = q.clone(), k.clone()
    eager = step(x, cos, sin, qe, ke, pos, cache)
    qc, kc = q.clone(), k.clone()
    compiled = torch.compile(step, fullgraph=True, backend="inductor")(x, cos, sin, qc, kc, pos, cache)
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # The in-place rotation reached the caller's tensors, as in eager.
    assert torch.equal(qc, qe) and torch.equal(kc, ke) and not torch.equal(qc, q)


def test_torch_compile_backward():
    torch._dynamo.reset()
    x = torch.randn(3, 8, 2, 16, requires_grad=True)
    cos, sin = torch.randn(8, 1, 8), torch.randn(8, 1, 8)
    f = lambda x: rope_ext.apply_rope(x, cos, sin, interleaved=True).square().sum()  # noqa: E731
    (g_eager,) = torch.autograd.grad(f(x), x)
    (g_comp,) = torch.autograd.grad(torch.compile(f, fullgraph=True)(x), x)
    torch.testing.assert_close(g_eager, g_comp)
