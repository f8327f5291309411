"""rope_ext.compat.transformer_engine against Transformer Engine's PyTorch path, as
tests/training_peers.py implements it independently, run in float64 on the same inputs: the three
formats, both pair layouts, partial rotary, unequal packed sequences, start_positions, context
parallelism (cp_size 1, 2, 4, every rank), angles from RotaryPositionEmbedding (both members of a
pair equal) and per element (unequal), non-contiguous inputs, gradients w.r.t. t and freqs,
torch.compile, the ops the profiler sees, and the inputs TE refuses."""

import re

import pytest
import torch

from conftest import TOL, native_cpu
from rope_ext.compat import transformer_engine as te
from training_peers import TERotaryPositionEmbedding, te_apply_rotary_pos_emb

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
H, D = 3, 32


@pytest.fixture(autouse=True)
def _te_on_cpu(monkeypatch):
    # TE's RotaryPositionEmbedding puts inv_freq on torch.cuda.current_device(): CPU here.
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")


# A gradient w.r.t. freqs sums a product over the batch and the heads: float32 sums round more
# than one rotated element does.
SUMMED = 10


def check(got, want, dtype, scale=1):
    assert got.dtype == dtype and got.shape == want.shape
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(got.double(), want.double(), rtol=rtol * scale, atol=atol * scale)


def angles(rows, rot, kind, interleaved):
    """freqs [rows, 1, 1, rot]: TE's module output (each pair's angle on both members), or
    random angles per element."""
    if kind == "module":
        return TERotaryPositionEmbedding(rot, rotary_base=50.0, interleaved=interleaved)(rows)
    return torch.rand(rows, 1, 1, rot) * 40 - 20


def make_t(fmt, dtype, seqlen, batch, contiguous=True, lengths=None):
    """t in `fmt`; non-contiguous: a strided view (every other head of a wider buffer, and for
    sbhd/bshd the other format's buffer transposed)."""
    shape = {"sbhd": (seqlen, batch, H, D), "bshd": (batch, seqlen, H, D),
             "thd": (sum(lengths or [0]), H, D)}[fmt]
    if contiguous:
        return torch.randn(shape).to(dtype)
    wide = list(shape)
    wide[-2] *= 2
    if fmt == "thd":
        return torch.randn(wide).to(dtype)[:, ::2]
    return torch.randn([wide[1], wide[0], *wide[2:]]).to(dtype).transpose(0, 1)[:, :, ::2]


def packed(cp_size, batch=3):
    """cu_seqlens of `batch` unequal sequences, each a multiple of 2 * cp_size (TE's padding),
    and the local lengths (over cp_size)."""
    lengths = [2 * cp_size * n for n in torch.randint(1, 5, (batch,)).tolist()]
    lengths[0] += 2 * cp_size  # never all equal
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    return cu, [n // cp_size for n in lengths]


def case(fmt, dtype, interleaved, rot, kind, cp_size, start, contiguous=True):
    """(t, freqs, kwargs) for one call; freqs rows enough for every start position."""
    seqlen, batch = 6, 3
    kwargs = dict(tensor_format=fmt, interleaved=interleaved, cp_size=cp_size)
    lengths = None
    if fmt == "thd":
        kwargs["cu_seqlens"], lengths = packed(cp_size, batch)
        seqlen = max(lengths)
    if start:
        kwargs["start_positions"] = torch.randint(0, 9, (batch,))
    t = make_t(fmt, dtype, seqlen, batch, contiguous, lengths)
    return t, angles(cp_size * seqlen + 9, rot, kind, interleaved), kwargs


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", ["sbhd", "bshd", "thd"])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rot", [D, D // 2 + 2])  # full, partial (the rest passes through)
@pytest.mark.parametrize("kind", ["module", "per-element"])
@pytest.mark.parametrize("cp_size", [1, 2, 4])
@pytest.mark.parametrize("start", [False, True])
def test_values_match_te(dtype, fmt, interleaved, rot, kind, cp_size, start):
    t, freqs, kw = case(fmt, dtype, interleaved, rot, kind, cp_size, start)
    t0 = t.clone()
    for rank in range(cp_size):
        got = te.apply_rotary_pos_emb(t, freqs, cp_rank=rank, **kw)
        want = te_apply_rotary_pos_emb(t.double(), freqs.double(), cp_rank=rank, **kw)
        check(got, want, dtype)
        assert torch.equal(got[..., rot:], t[..., rot:])  # partial rotary: copied exactly
    assert torch.equal(t, t0)


@pytest.mark.parametrize("fmt", ["sbhd", "bshd", "thd"])
@pytest.mark.parametrize("kind", ["module", "per-element"])
def test_non_contiguous_t(fmt, kind):
    t, freqs, kw = case(fmt, torch.bfloat16, True, D - 4, kind, 2, True, contiguous=False)
    assert not t.is_contiguous()
    for rank in range(2):
        got = te.apply_rotary_pos_emb(t, freqs, cp_rank=rank, **kw)
        check(got, te_apply_rotary_pos_emb(t.double(), freqs.double(), cp_rank=rank, **kw),
              torch.bfloat16)


def test_positional_order_and_defaults():
    t, freqs = torch.randn(5, 2, H, D), angles(8, D, "per-element", False)
    want = te_apply_rotary_pos_emb(t, freqs)  # sbhd, no offsets, pairs (i, i + d/2)
    check(te.apply_rotary_pos_emb(t, freqs), want, torch.float32)
    cu, start = torch.tensor([0, 2, 5], dtype=torch.int32), torch.tensor([1, 0])
    args = (t[:, 0], freqs, "thd", start, True, False, cu, 1, 0)
    check(te.apply_rotary_pos_emb(*args), te_apply_rotary_pos_emb(*args), torch.float32)


@pytest.mark.parametrize("fmt", ["sbhd", "bshd", "thd"])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("kind", ["module", "per-element"])
@pytest.mark.parametrize("cp_size", [1, 2])
def test_gradients_match_te_autograd(fmt, interleaved, kind, cp_size):
    t, freqs, kw = case(fmt, torch.float32, interleaved, D - 8, kind, cp_size, True)
    for rank in range(cp_size):
        grad = torch.randn(t.shape)
        x, f = t.clone().requires_grad_(), freqs.clone().requires_grad_()
        te.apply_rotary_pos_emb(x, f, cp_rank=rank, **kw).backward(grad)
        x64, f64 = t.double().requires_grad_(), freqs.double().requires_grad_()
        te_apply_rotary_pos_emb(x64, f64, cp_rank=rank, **kw).backward(grad.double())
        check(x.grad, x64.grad, torch.float32)
        check(f.grad, f64.grad, torch.float32, SUMMED)  # every member's angle its own gradient
        # TE's kernel (fused=True) gives t the same gradient and freqs none
        x2, f2 = t.clone().requires_grad_(), freqs.clone().requires_grad_()
        te.apply_rotary_pos_emb(x2, f2, fused=True, cp_rank=rank, **kw).backward(grad)
        check(x2.grad, x64.grad, torch.float32)
        assert f2.grad is None


@pytest.mark.parametrize("fmt", ["sbhd", "thd"])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("kind", ["module", "per-element"])
def test_gradcheck(fmt, interleaved, kind):
    t, freqs, kw = case(fmt, torch.float64, interleaved, D - 8, kind, 2, True)
    x, f = t[..., :2, :].clone().requires_grad_(), freqs.double().requires_grad_()
    # fast_mode: the Jacobians compared along random directions (each wrong entry shows, with
    # probability 1), not column by column: a few hundred fewer calls of the Python drop-in.
    for rank in range(2):
        assert torch.autograd.gradcheck(
            lambda a, b: te.apply_rotary_pos_emb(a, b, cp_rank=rank, **kw), (x, f), fast_mode=True)
        assert torch.autograd.gradcheck(  # t alone: the single-pass path for equal members
            lambda a: te.apply_rotary_pos_emb(a, f.detach(), cp_rank=rank, **kw), (x,),
            fast_mode=True)


def rope_calls(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {e.key: e.count for e in prof.key_averages() if e.key.startswith("rope::")}


@pytest.mark.skipif(not native_cpu(), reason="needs the native CPU library")
@pytest.mark.parametrize("interleaved", [False, True])
def test_runs_rope_ops_one_pass_for_equal_members(interleaved):
    t = torch.randn(8, 2, H, D, requires_grad=True)
    for kind, passes in (("module", 1), ("per-element", 2)):
        freqs = angles(8, D, kind, interleaved)
        calls = rope_calls(lambda: te.apply_rotary_pos_emb(t, freqs, interleaved=interleaved)
                           .sum().backward())
        assert (calls.get("rope::apply"), calls.get("rope::apply_backward")) == (passes, passes), \
            (kind, calls)


@pytest.mark.parametrize("fmt", ["sbhd", "thd"])
@pytest.mark.parametrize("kind", ["module", "per-element"])
@pytest.mark.parametrize("needs_grad", [False, True])
def test_compile_fullgraph(fmt, kind, needs_grad):
    t, freqs, kw = case(fmt, torch.float32, False, D - 4, kind, 2, fmt == "sbhd")
    f = torch.compile(te.apply_rotary_pos_emb, fullgraph=True, backend="aot_eager")
    for rank in range(2):
        x = t.clone().requires_grad_(needs_grad)
        got = f(x, freqs, cp_rank=rank, **kw)
        want = te_apply_rotary_pos_emb(t.double(), freqs.double(), cp_rank=rank, **kw)
        check(got, want, torch.float32)
        if needs_grad:
            got.backward(torch.ones_like(got))
            w = t.double().requires_grad_()
            te_apply_rotary_pos_emb(w, freqs.double(), cp_rank=rank, **kw).sum().backward()
            check(x.grad, w.grad, torch.float32)


@pytest.mark.skipif(not native_cpu(), reason="needs the native CPU library")
def test_compiled_training_step_runs_rope_ops():
    """Inductor, t and freqs needing gradients: the graph calls the rope ops (no eager
    fallback of the rotation) and matches TE."""
    t = torch.randn(6, 2, H, D, requires_grad=True)
    freqs = angles(12, D, "per-element", False).requires_grad_()
    f = torch.compile(lambda a, b: te.apply_rotary_pos_emb(a, b, "sbhd", cp_size=2, cp_rank=1),
                      fullgraph=True)
    calls = rope_calls(lambda: f(t, freqs).pow(2).sum().backward())
    assert calls.get("rope::apply", 0) >= 1 and calls.get("rope::apply_backward", 0) >= 1, calls
    w, wf = t.detach().double().requires_grad_(), freqs.detach().double().requires_grad_()
    te_apply_rotary_pos_emb(w, wf, "sbhd", cp_size=2, cp_rank=1).pow(2).sum().backward()
    check(t.grad, w.grad, torch.float32)
    check(freqs.grad, wf.grad, torch.float32, SUMMED)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")
@pytest.mark.parametrize("fmt", ["sbhd", "bshd", "thd"])
@pytest.mark.parametrize("kind", ["module", "per-element"])
def test_cuda_matches_te(fmt, kind):
    """On CUDA: TE's values and gradients, through the CUDA kernels."""
    t, freqs, kw = case(fmt, torch.bfloat16, True, D - 4, kind, 2, True)
    on_gpu = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    for rank in range(2):
        x, grad = t.cuda().requires_grad_(), torch.randn(t.shape)
        calls = rope_calls(lambda: te.apply_rotary_pos_emb(x, freqs.cuda(), cp_rank=rank, **on_gpu)
                           .backward(grad.to("cuda", t.dtype)))
        assert calls.get("rope::apply") and calls.get("rope::apply_backward"), calls
        w = t.double().requires_grad_()
        want = te_apply_rotary_pos_emb(w, freqs.double(), cp_rank=rank, **kw)
        want.backward(grad.to(t.dtype).double())
        got = te.apply_rotary_pos_emb(x.detach(), freqs.cuda(), cp_rank=rank, **on_gpu)
        check(got.cpu(), want, torch.bfloat16)
        check(x.grad.cpu(), w.grad, torch.bfloat16)


def _sbhd():
    return torch.randn(6, 2, H, D), angles(12, D, "module", False)


def _thd():
    return torch.randn(8, H, D), torch.tensor([0, 3, 8], dtype=torch.int32)


# (what, call arguments, fragment of our error): inputs TE refuses too (with an assertion, a
# ValueError, or an error deep inside).
REFUSED = [
    ("unknown format", lambda: (*_sbhd(), "hsbd"), "tensor_format"),
    ("thd without cu_seqlens", lambda: (_thd()[0], _sbhd()[1], "thd"), "cu_seqlens must not be None"),
    ("freqs wider than head_dim",
     lambda: (_sbhd()[0], angles(12, D + 2, "module", False)), "freqs.size(-1)"),
    ("freqs shorter than the sequence", lambda: (_sbhd()[0], _sbhd()[1][:5]), "freqs has 5 positions"),
    ("freqs shorter than cp_size * seqlen",
     lambda: (*_sbhd(), "sbhd", None, False, False, None, 4, 0), "freqs has 12 positions"),
    ("start_positions past freqs", lambda: (*_sbhd(), "sbhd", torch.tensor([0, 7])), "start_positions"),
    ("odd sequence under context parallelism",
     lambda: (_sbhd()[0][:5], _sbhd()[1], "sbhd", None, False, False, None, 2, 0), "must be even"),
    ("t of 3 dims for sbhd", lambda: (_sbhd()[0][:, 0], _sbhd()[1]), "t must be"),
    ("cu_seqlens not spanning t", lambda: (_thd()[0], _sbhd()[1], "thd", None, False, False,
                                           torch.tensor([0, 3, 7], dtype=torch.int32)), "cu_seqlens"),
    ("packed sequence longer than freqs",
     lambda: (_thd()[0], _sbhd()[1][:4], "thd", None, False, False, _thd()[1]), "freqs has 4 positions"),
    ("odd packed sequence under context parallelism",
     lambda: (_thd()[0], _sbhd()[1], "thd", None, False, False, _thd()[1] * 2, 2, 0), "must be even"),
]


@pytest.mark.parametrize("what,args,fragment", REFUSED, ids=[r[0] for r in REFUSED])
def test_refuses_what_te_refuses(what, args, fragment):
    a = args()
    with pytest.raises((AssertionError, ValueError, RuntimeError)):
        te_apply_rotary_pos_emb(*a)
    with pytest.raises(ValueError, match=re.escape(fragment)):
        te.apply_rotary_pos_emb(*a)


@pytest.mark.parametrize("kwargs,fragment", [
    (dict(cp_size=0), "cp_size must be a positive int"),
    (dict(cp_size=2, cp_rank=2), "cp_rank must be < cp_size"),
    (dict(start_positions=torch.tensor([0.0, 1.0])), "start_positions must be an int32 or int64"),
    (dict(start_positions=torch.tensor([0, 1, 2])), "start_positions must have shape \\[2\\]"),
    (dict(start_positions=torch.tensor([-1, 0])), "start_positions must be >= 0"),
    # past freqs, and so far past that start + seqlen wraps int64
    (dict(start_positions=torch.tensor([9, 0])), "start_positions \\+ cp_size \\* seqlen must be <="),
    (dict(start_positions=torch.tensor([2**63 - 2, 0])), "start_positions \\+ cp_size \\* seqlen must be <="),
])
def test_refuses_bad_scalars_by_name(kwargs, fragment):
    t, freqs = _sbhd()
    with pytest.raises(ValueError, match=fragment):
        te.apply_rotary_pos_emb(t, freqs, **kwargs)


def test_refuses_freqs_that_are_not_angles_per_element():
    t = torch.randn(6, 2, H, D)
    for bad, fragment in ((torch.rand(12, D), "freqs must have shape \\[s2, 1, 1, d2\\]"),
                          (torch.rand(12, 1, 1, 7), "freqs.size\\(-1\\) = 7"),
                          (torch.rand(12, 1, 1, D, dtype=torch.complex64), "real tensor")):
        with pytest.raises(ValueError, match=fragment):
            te.apply_rotary_pos_emb(t, bad)


@pytest.mark.parametrize("args", [
    (32,), (48, 0.5), (32, 1.0, 2, 16), (32, 1.0, 4, 64), (32, 1.0, None, 16),
    (64, 0.75, 2, 8, 5e5, True),
])
def test_rotary_position_embedding_is_tes(args):
    ours, theirs = te.RotaryPositionEmbedding(*args), TERotaryPositionEmbedding(*args)
    assert torch.equal(ours.inv_freq, theirs.inv_freq)
    assert ours.state_dict().keys() == theirs.state_dict().keys() == {"inv_freq"}
    for max_seq_len, offset in ((1, 0), (17, 0), (40, 5), (300, 0)):
        want = theirs(max_seq_len, offset)
        got = ours(max_seq_len, offset)
        assert got.dtype == want.dtype == torch.float32
        assert torch.equal(got, want), (max_seq_len, offset)
        assert torch.equal(ours.forward(max_seq_len, offset=offset), want)


@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
@pytest.mark.parametrize("cp_size", [1, 2])
def test_per_sequence_freqs(fmt, cp_size):
    # freqs [s2, b, 1, d2] (TE's PyTorch path): sequence i turns by freqs[:, i], as a call of
    # that sequence alone with [s2, 1, 1, d2] does; differentiable w.r.t. freqs too.
    s, b = 6, 3
    freqs = torch.rand(cp_size * s + 2, b, 1, D - 4, dtype=torch.float64) * 10
    t = torch.randn((s, b, H, D) if fmt == "sbhd" else (b, s, H, D), dtype=torch.float64)
    seq_dim = 0 if fmt == "sbhd" else 1
    for rank in range(cp_size):
        got = te.apply_rotary_pos_emb(t, freqs, fmt, cp_size=cp_size, cp_rank=rank)
        for i in range(b):
            one = t.narrow(1 - seq_dim, i, 1)
            want = te.apply_rotary_pos_emb(one, freqs[:, i : i + 1], fmt, cp_size=cp_size,
                                           cp_rank=rank)
            assert torch.equal(got.narrow(1 - seq_dim, i, 1), want)
    f = freqs[: s + 1].clone().requires_grad_()
    x = t.clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda x, f: te.apply_rotary_pos_emb(x, f, fmt), (x, f))
    with pytest.raises(ValueError, match=re.escape("[s2, 1, 1, d2] (one angle")):
        te.apply_rotary_pos_emb(t, freqs, fmt, start_positions=torch.zeros(b, dtype=torch.long))
