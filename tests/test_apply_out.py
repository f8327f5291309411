"""rope.apply.out / rope_ext.apply_rope(..., out=): the rotation written into a caller's buffer."""

import os
import re
import subprocess
import sys

import pytest
import torch

import rope_ext
from conftest import DTYPES, ROOT, assert_close, native_cpu, poison_like
from rope_oracle import rope, table_for

IMPLS = {
    "op": lambda x, cos, sin, interleaved, out: rope_ext.apply_rope(
        x, cos, sin, interleaved=interleaved, out=out
    ),
    "reference": lambda x, cos, sin, interleaved, out: rope_ext.reference.apply_rope_out(
        x, cos, sin, interleaved=interleaved, out=out
    ),
}

B, H, S = 2, 3, 5


def _layout(name, rotary_dim):
    """(x lead dims, cos/sin shape, positions) of the broadcast layouts models use."""
    h = rotary_dim // 2
    return {
        "BHSD_11Sh": ((B, H, S), (1, 1, S, h), torch.randint(0, 4096, (S,))),
        "BSHD_1S1h": ((B, S, H), (1, S, 1, h), torch.randint(0, 4096, (S,))),
        "BSHD_BS1h": ((B, S, H), (B, S, 1, h), torch.randint(0, 4096, (B, S))),
        "SD_Sh": ((S,), (S, h), torch.randint(0, 4096, (S,))),
    }[name]


# The out variant runs the kernel of rope.apply (test_apply.py covers its layouts and dims in
# full, and the check below that both agree bit for bit ties the two): here each broadcast
# layout, partial rotary dim and x's contiguity once, with what only out= adds (the caller's
# buffer written whole, x untouched).
CASES = [("BHSD_11Sh", 64, 64, True), ("BSHD_1S1h", 80, 32, False), ("BSHD_BS1h", 96, 48, True),
         ("SD_Sh", 80, 32, False)]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
def test_matches_oracle(impl, dtype, interleaved):
    for case in CASES:
        _check_out(impl, dtype, interleaved, *case)


def _check_out(impl, dtype, interleaved, layout, head_dim, rotary_dim, x_contiguous):
    lead, cos_shape, pos = _layout(layout, rotary_dim)
    cos64, sin64 = table_for(pos, rotary_dim)
    table_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    cos, sin = cos64.reshape(cos_shape).to(table_dtype), sin64.reshape(cos_shape).to(table_dtype)
    x = torch.randn(*lead, head_dim, dtype=dtype)
    if not x_contiguous:  # same shape, strided: a slice of a wider buffer
        x = torch.randn(*lead, head_dim + 16, dtype=dtype)[..., 8 : 8 + head_dim]
    x_before = x.clone()
    out = poison_like(x.contiguous())  # NaN everywhere: every element must be written
    res = IMPLS[impl](x, cos, sin, interleaved, out)
    assert res is out
    assert not out.isnan().any()
    assert_close(out, rope(x, cos, sin, interleaved), dtype)
    assert torch.equal(out[..., rotary_dim:], x[..., rotary_dim:])
    assert torch.equal(x, x_before)
    # The same kernel as the out-of-place op: bit for bit.
    assert torch.equal(out, rope_ext.apply_rope(x, cos, sin, interleaved=interleaved))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_output_streamed(dtype):
    # >= 16 MiB of output takes the non-temporal-store path on CPU.
    x = torch.randn(1024 if dtype == torch.float32 else 2048, 32, 128, dtype=dtype)
    cos, sin = table_for(torch.randint(0, 4096, (x.shape[0],)), 128)
    cos, sin = cos[:, None].float(), sin[:, None].float()
    out = poison_like(x)
    rope_ext.apply_rope(x, cos, sin, out=out)
    assert torch.equal(out, rope_ext.apply_rope(x, cos, sin))
    rows = torch.randint(0, x.shape[0], (16,))
    assert_close(out[rows], rope(x[rows], cos[rows], sin[rows], False), dtype)


def test_empty():
    x = torch.empty(0, 4, 64)
    cos, sin = torch.empty(0, 1, 32), torch.empty(0, 1, 32)
    out = torch.empty(0, 4, 64)
    assert rope_ext.apply_rope(x, cos, sin, out=out) is out


@pytest.mark.parametrize("impl", IMPLS)
def test_bad_out_rejected_changing_nothing(impl):
    wide = torch.randn(2 * 2 * 3 * 64)
    x = wide[: 2 * 3 * 64].view(2, 3, 64)  # x lives in the first half of `wide`
    tables = torch.randn(2, 2, 3, 32)  # cos and sin are slices of one buffer
    cos, sin = tables[0], tables[1]
    cases = [
        (torch.zeros(2, 3, 65), "out must have the shape of x [2, 3, 64], got [2, 3, 65]"),
        (torch.zeros(2, 3, 64, dtype=torch.float64), "out must have the dtype of x (Float), got Double"),
        (torch.zeros(2, 3, 64, device="meta"), "out must be on the same device as x (cpu), got meta"),
        (torch.zeros(2, 64, 3).transpose(1, 2), "out must be contiguous"),
        (x, "out must not overlap x in memory"),
        (wide[100 : 100 + 2 * 3 * 64].view(2, 3, 64), "out must not overlap x in memory"),
    ]
    # out spanning cos's (then sin's) memory: same numel as x, from a float buffer covering it.
    big = torch.randn(2000)
    cos_b = big[:192].view(2, 3, 32)
    sin_b = big[1000:1192].view(2, 3, 32)
    cases_tables = [
        (big[:384].view(2, 3, 64), cos_b, torch.randn(2, 3, 32), "out must not overlap cos in memory"),
        (big[900:1284].view(2, 3, 64), torch.randn(2, 3, 32), sin_b, "out must not overlap sin in memory"),
    ]
    before = [t.clone() for t in (wide, tables, big)]
    for bad, msg in cases:
        kept = bad.clone() if bad.device.type != "meta" else None
        with pytest.raises(RuntimeError, match=re.escape("rope.apply.out: " + msg)):
            IMPLS[impl](x, cos, sin, False, bad)
        if kept is not None:
            assert torch.equal(bad, kept)
    for bad, c, s, msg in cases_tables:
        with pytest.raises(RuntimeError, match=re.escape("rope.apply.out: " + msg)):
            IMPLS[impl](x, c, s, False, bad)
    for t, b in zip((wide, tables, big), before):
        assert torch.equal(t, b)


def test_bad_inputs_reported_under_out_overload():
    x, cos = torch.randn(2, 8), torch.randn(2, 5)
    with pytest.raises(RuntimeError, match=r"rope.apply.out: rotary_dim = 2 \* cos.size\(-1\) = 10"):
        torch.ops.rope.apply.out(x, cos, cos.clone(), False, out=torch.empty(2, 8))


def test_requires_grad_raises_like_torch_out_ops():
    x = torch.randn(3, 4, 16, requires_grad=True)
    cos, sin = torch.randn(3, 1, 8), torch.randn(3, 1, 8)
    out = torch.empty(3, 4, 16)
    with pytest.raises(RuntimeError, match=r"apply_rope\(\): functions with out=\.\.\. arguments don't support automatic differentiation"):
        rope_ext.apply_rope(x, cos, sin, out=out)
    with torch.no_grad():
        assert rope_ext.apply_rope(x, cos, sin, out=out) is out
    assert_close(out, rope(x.detach(), cos, sin, False), torch.float32)


def test_opcheck():
    x = torch.randn(3, 4, 32)
    cos, sin = torch.randn(3, 1, 8), torch.randn(3, 1, 8)
    torch.library.opcheck(torch.ops.rope.apply.out, (x, cos, sin, False), {"out": torch.empty_like(x)})
    xb = torch.randn(2, 5, 3, 64, dtype=torch.bfloat16)[:, :, :, :48]
    cb, sb = torch.randn(1, 5, 1, 24), torch.randn(1, 5, 1, 24)
    torch.library.opcheck(torch.ops.rope.apply.out, (xb, cb, sb, True), {"out": torch.empty(2, 5, 3, 48, dtype=torch.bfloat16)})


def test_torch_compile_fullgraph():
    torch._dynamo.reset()

    def step(x, cos, sin, out):
        rope_ext.apply_rope(x, cos, sin, out=out)
        return out * 2.0

    x = torch.randn(6, 4, 32)
    cos, sin = torch.randn(6, 1, 16), torch.randn(6, 1, 16)
    out_eager, out_compiled = poison_like(x), poison_like(x)
    eager = step(x, cos, sin, out_eager)
    compiled = torch.compile(step, fullgraph=True, backend="inductor")(x, cos, sin, out_compiled)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
    torch.testing.assert_close(out_compiled, out_eager, rtol=0, atol=0)


def test_native_cpu_kernel_registered():
    if not native_cpu():
        pytest.skip("native library not loaded")
    assert torch._C._dispatch_has_kernel_for_dispatch_key("rope::apply.out", "CPU")


REFERENCE_CHECK = r"""
import torch, rope_ext
from rope_oracle import rope
assert rope_ext.backend("cpu") == "reference", rope_ext.backend("cpu")
x = torch.randn(4, 3, 32)
cos, sin = torch.randn(4, 1, 12), torch.randn(4, 1, 12)
out = torch.full_like(x, float("nan"))
assert torch.ops.rope.apply.out(x, cos, sin, True, out=out) is None
torch.testing.assert_close(out.double(), rope(x, cos, sin, True), rtol=1e-6, atol=1e-6)
try:
    torch.ops.rope.apply.out(x, cos, sin, False, out=x)
except RuntimeError as e:
    assert "rope.apply.out: out must not overlap x in memory" in str(e), e
else:
    raise AssertionError("overlap not rejected")
print("OK")
"""


def test_reference_backend_serves_out_overload():
    env = dict(os.environ, ROPE_EXT_BACKEND="reference",
               PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]))
    res = subprocess.run([sys.executable, "-c", REFERENCE_CHECK], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.strip().endswith("OK"), res.stderr[-3000:]
