"""rope_ext.compat.llama and rope_ext.compat.gpt_fast against Meta's Llama reference and gpt-fast,
as tests/training_peers.py implements them independently: their tables bit for bit; values over
dtypes, head dims, GQA keys, non-contiguous inputs and tables that are not unit-modulus, against
the peers run in float64 on the same inputs (the peers round x to float32 first: float64 tables
make them exact for inputs that float32 holds); gradients w.r.t. x and the tables; torch.compile;
the rope ops the profiler sees; the inputs the peers refuse."""

import pytest
import torch

from conftest import TOL, native_cpu
from rope_ext.compat import gpt_fast, llama
import training_peers as ref

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
HEAD_DIMS = [2, 64, 80, 128]
SCALING = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
               original_max_position_embeddings=64)


def check(got, want, dtype):
    assert got.dtype == dtype and got.shape == want.shape
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(got.double(), want.double(), rtol=rtol, atol=atol)


def layout(shape, dtype, contiguous):
    """A random (bsz, seqlen, heads, head_dim) tensor; non-contiguous: the transpose of a
    (bsz, heads, seqlen, head_dim) one, as attention code transposes."""
    if contiguous:
        return torch.randn(shape).to(dtype)
    b, s, h, d = shape
    return torch.randn(b, h, s, d).to(dtype).transpose(1, 2)


def random_cis(seqlen, half):
    """A complex table that is not unit-modulus (the reference multiplies by any value)."""
    return torch.polar(torch.rand(seqlen, half) + 0.5, torch.rand(seqlen, half) * 50)


# ---- Llama ------------------------------------------------------------------------------------

@pytest.mark.parametrize("dim,end,theta", [(128, 4096, 10000.0), (64, 300, 500000.0), (80, 17, 1e6),
                                           (2, 5, 10000.0)])
def test_llama_table_is_the_references(dim, end, theta):
    got = llama.precompute_freqs_cis(dim, end, theta)
    want = ref.llama_precompute_freqs_cis(dim, end, theta)
    assert got.dtype == want.dtype == torch.complex64 and torch.equal(got, want)
    assert torch.equal(llama.precompute_freqs_cis(dim, end), ref.llama_precompute_freqs_cis(dim, end))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("table", ["precomputed", "any", "conjugate"])
@pytest.mark.parametrize("contiguous", [True, False])
def test_llama_values(dtype, head_dim, table, contiguous):
    B, S, HQ, HK = 2, 7, 4, 2  # GQA: fewer key heads
    xq = layout((B, S, HQ, head_dim), dtype, contiguous)
    xk = layout((B, S, HK, head_dim), dtype, contiguous)
    fc = (ref.llama_precompute_freqs_cis(head_dim, 40)[9 : 9 + S] if table == "precomputed"
          else random_cis(S, head_dim // 2))
    if table == "conjugate":  # the inverse rotation, a lazy view the reference multiplies by
        fc = fc.conj()
    xq0, xk0 = xq.clone(), xk.clone()
    got = llama.apply_rotary_emb(xq, xk, fc)
    want = ref.llama_apply_rotary_emb(xq.double(), xk.double(), fc.to(torch.complex128))
    check(got[0], want[0], dtype)
    check(got[1], want[1], dtype)
    assert torch.equal(xq, xq0) and torch.equal(xk, xk0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_wide_tables_compute_as_the_peers_promote(dtype):
    """A float64 (complex128) table: the peers' x.float() * table promotes to float64 and rounds
    once to x's dtype; the drop-ins give those bits, not a float32 computation's."""
    B, S, H, D = 2, 7, 3, 16
    x = torch.randn(B, S, H, D).to(dtype)
    fc = random_cis(S, D // 2).to(torch.complex128)
    got = llama.apply_rotary_emb(x, x, fc)
    want = ref.llama_apply_rotary_emb(x, x, fc)
    assert got[0].dtype == dtype and torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    table = torch.view_as_real(fc)
    got = gpt_fast.apply_rotary_emb(x, table)
    assert got.dtype == dtype and torch.equal(got, ref.gpt_fast_apply_rotary_emb(x, table))


def test_llama_odd_shapes_are_the_references():
    """3-D inputs come back in the reference's own shape ((..., head_dim / 2, 2)), and a real
    table multiplies as the reference multiplies by it."""
    x, fc = torch.randn(2, 5, 8), ref.llama_precompute_freqs_cis(8, 5)
    for got, want in zip(llama.apply_rotary_emb(x, x, fc), ref.llama_apply_rotary_emb(x, x, fc)):
        assert got.shape == want.shape == (2, 5, 4, 2)
        check(got, want, torch.float32)
    x, real = torch.randn(2, 5, 3, 8), torch.randn(5, 4)
    for got, want in zip(llama.apply_rotary_emb(x, x, real), ref.llama_apply_rotary_emb(x, x, real)):
        check(got, want, torch.float32)


@pytest.mark.parametrize("positions", [None, "shared", "per batch"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_torchtitan_table_rows_and_positions(positions, dtype):
    # torchtitan passes the model's whole table (its first seqlen rows serve), or positions
    B, S = 3, 5
    xq, xk = torch.randn(B, S, 4, 16, dtype=dtype), torch.randn(B, S, 2, 16, dtype=dtype)
    fc = random_cis(40, 8)
    pos = {None: None, "shared": torch.randint(0, 40, (1, S)),
           "per batch": torch.randint(0, 40, (B, S))}[positions]
    got = llama.apply_rotary_emb(xq, xk, fc, positions=pos)
    want = ref.titan_apply_rotary_emb(xq.double(), xk.double(), fc.to(torch.complex128), pos)
    check(got[0], want[0], dtype)
    check(got[1], want[1], dtype)
    # gradients w.r.t. the table reach the rows the positions read
    table = fc.clone().requires_grad_()
    llama.apply_rotary_emb(xq.float(), xk.float(), table, pos)[0].sum().backward()
    peer_table = fc.clone().requires_grad_()
    ref.titan_apply_rotary_emb(xq.float(), xk.float(), peer_table, pos)[0].sum().backward()
    torch.testing.assert_close(table.grad, peer_table.grad, rtol=1e-5, atol=1e-5)


def test_torchtitan_positions_are_checked():
    xq, fc = torch.randn(2, 5, 3, 8), random_cis(10, 4)
    for pos, fragment in ((torch.zeros(2, 4, dtype=torch.int64), "positions must have shape"),
                          (torch.zeros(3, 5, dtype=torch.int64), "positions must have shape"),
                          (torch.zeros(1, 5), "positions must be an int32 or int64 tensor"),
                          (torch.tensor([[0, 1, 2, 3, 10]]), r"positions must lie in \[0, "
                                                             r"freqs_cis.size\(0\)\) = \[0, 10\)")):
        with pytest.raises(ValueError, match=fragment):
            llama.apply_rotary_emb(xq, xq, fc, pos)


def test_llama_gradients_match_reference_autograd():
    B, S, HQ, HK, D = 2, 6, 4, 2, 16
    xq, xk, fc = torch.randn(B, S, HQ, D), torch.randn(B, S, HK, D), random_cis(S, D // 2)
    gq, gk = torch.randn(B, S, HQ, D), torch.randn(B, S, HK, D)
    ours = [t.clone().requires_grad_() for t in (xq, xk, fc)]
    theirs = [t.clone().requires_grad_() for t in (xq.double(), xk.double(), fc.to(torch.complex128))]
    for fn, args in ((llama.apply_rotary_emb, ours), (ref.llama_apply_rotary_emb, theirs)):
        q, k = fn(*args)
        torch.autograd.backward((q, k), (gq.to(q.dtype), gk.to(k.dtype)))
    check(ours[0].grad, theirs[0].grad, torch.float32)
    check(ours[1].grad, theirs[1].grad, torch.float32)
    assert ours[2].grad.dtype == torch.complex64
    torch.testing.assert_close(ours[2].grad.to(torch.complex128), theirs[2].grad, rtol=1e-5, atol=1e-5)


def test_llama_gradcheck():
    xq = torch.randn(1, 3, 2, 8, dtype=torch.float64, requires_grad=True)
    xk = torch.randn(1, 3, 1, 8, dtype=torch.float64, requires_grad=True)
    fc = random_cis(3, 4).to(torch.complex128).requires_grad_()
    assert torch.autograd.gradcheck(llama.apply_rotary_emb, (xq, xk, fc))


@pytest.mark.parametrize("needs_grad,backend", [(False, "aot_eager"), (True, "aot_eager"),
                                                (True, "inductor")])
def test_llama_compile_fullgraph(needs_grad, backend):
    xq = torch.randn(2, 6, 4, 32, requires_grad=needs_grad)
    xk = torch.randn(2, 6, 2, 32, requires_grad=needs_grad)
    fc = llama.precompute_freqs_cis(32, 6)  # a complex graph input
    f = torch.compile(llama.apply_rotary_emb, fullgraph=True, backend=backend)
    got = f(xq, xk, fc)
    want = ref.llama_apply_rotary_emb(xq.detach().double(), xk.detach().double(),
                                      fc.to(torch.complex128))
    check(got[0], want[0], torch.float32)
    check(got[1], want[1], torch.float32)
    if needs_grad:
        (got[0].sum() + got[1].sum()).backward()
        wq, wk = (t.detach().double().requires_grad_() for t in (xq, xk))
        w = ref.llama_apply_rotary_emb(wq, wk, fc.to(torch.complex128))
        (w[0].sum() + w[1].sum()).backward()
        check(xq.grad, wq.grad, torch.float32)
        check(xk.grad, wk.grad, torch.float32)


# ---- gpt-fast ---------------------------------------------------------------------------------

@pytest.mark.parametrize("seq_len,n_elem,base",
                         [(4096, 128, 10000), (300, 64, 500000), (17, 80, 1000000)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("scaling", [None, SCALING])
def test_gpt_fast_cache_is_gpt_fasts(seq_len, n_elem, base, dtype, scaling):
    got = gpt_fast.precompute_freqs_cis(seq_len, n_elem, base, dtype, scaling)
    want = ref.gpt_fast_precompute_freqs_cis(seq_len, n_elem, base, dtype, scaling)
    assert got.dtype == want.dtype == dtype and torch.equal(got, want)
    assert torch.equal(gpt_fast.precompute_freqs_cis(seq_len, n_elem),
                       ref.gpt_fast_precompute_freqs_cis(seq_len, n_elem))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("contiguous", [True, False])
def test_gpt_fast_values(dtype, head_dim, cache_dtype, contiguous):
    B, S, H = 2, 7, 3
    x = layout((B, S, H, head_dim), dtype, contiguous)
    cache = ref.gpt_fast_precompute_freqs_cis(64, head_dim, 10000, cache_dtype)
    freqs_cis = cache[torch.randint(0, 64, (S,))]  # gpt-fast: self.freqs_cis[input_pos]
    x0 = x.clone()
    got = gpt_fast.apply_rotary_emb(x, freqs_cis)
    check(got, ref.gpt_fast_apply_rotary_emb(x.double(), freqs_cis.double()), dtype)
    assert torch.equal(x, x0)


def test_gpt_fast_gradients_match_its_autograd():
    B, S, H, D = 2, 6, 3, 16
    x, cache, grad = torch.randn(B, S, H, D), torch.randn(S, D // 2, 2), torch.randn(B, S, H, D)
    x1, c1 = x.clone().requires_grad_(), cache.clone().requires_grad_()
    gpt_fast.apply_rotary_emb(x1, c1).backward(grad)
    x2, c2 = x.double().requires_grad_(), cache.double().requires_grad_()
    ref.gpt_fast_apply_rotary_emb(x2, c2).backward(grad.double())
    check(x1.grad, x2.grad, torch.float32)
    torch.testing.assert_close(c1.grad.double(), c2.grad, rtol=1e-5, atol=1e-5)
    xb, cb = x.bfloat16().requires_grad_(), cache.bfloat16().requires_grad_()  # gpt-fast's dtypes
    gpt_fast.apply_rotary_emb(xb, cb).backward(grad.bfloat16())
    x3 = x.bfloat16().double().requires_grad_()
    ref.gpt_fast_apply_rotary_emb(x3, cache.bfloat16().double()).backward(grad.bfloat16().double())
    check(xb.grad, x3.grad, torch.bfloat16)
    assert cb.grad.dtype == torch.bfloat16


def test_gpt_fast_gradcheck():
    x = torch.randn(1, 3, 2, 8, dtype=torch.float64, requires_grad=True)
    cache = torch.randn(3, 4, 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(gpt_fast.apply_rotary_emb, (x, cache))


@pytest.mark.parametrize("needs_grad", [False, True])
def test_gpt_fast_compile_fullgraph(needs_grad):
    x = torch.randn(2, 6, 4, 32, dtype=torch.bfloat16, requires_grad=needs_grad)
    cache = gpt_fast.precompute_freqs_cis(16, 32)
    f = torch.compile(gpt_fast.apply_rotary_emb, fullgraph=True, backend="aot_eager")
    got = f(x, cache[3:9])
    want = ref.gpt_fast_apply_rotary_emb(x.detach().double(), cache[3:9].double())
    check(got, want, torch.bfloat16)
    if needs_grad:
        got.float().sum().backward()
        w = x.detach().double().requires_grad_()
        ref.gpt_fast_apply_rotary_emb(w, cache[3:9].double()).sum().backward()
        check(x.grad, w.grad, torch.bfloat16)


# ---- both: the ops that run, the inputs refused ------------------------------------------------

def rope_calls(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {e.key: e.count for e in prof.key_averages() if e.key.startswith("rope::")}


@pytest.mark.skipif(not native_cpu(), reason="needs the native CPU library")
def test_training_steps_run_rope_ops():
    xq = torch.randn(2, 6, 4, 32, dtype=torch.bfloat16, requires_grad=True)
    xk = torch.randn(2, 6, 2, 32, dtype=torch.bfloat16, requires_grad=True)

    def llama_step():
        q, k = llama.apply_rotary_emb(xq, xk, llama.precompute_freqs_cis(32, 6))
        (q.float().sum() + k.float().sum()).backward()

    def gpt_fast_step():
        gpt_fast.apply_rotary_emb(xq, gpt_fast.precompute_freqs_cis(6, 32)).float().sum().backward()

    for step, calls in ((llama_step, 2), (gpt_fast_step, 1)):
        seen = rope_calls(step)
        assert (seen.get("rope::apply"), seen.get("rope::apply_backward")) == (calls, calls), seen


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")
def test_cuda_matches_the_peers():
    xq, xk = torch.randn(2, 9, 4, 64).bfloat16(), torch.randn(2, 9, 2, 64).bfloat16()
    fc, cache = random_cis(9, 32), ref.gpt_fast_precompute_freqs_cis(9, 64)
    got = llama.apply_rotary_emb(xq.cuda(), xk.cuda(), fc.cuda())
    want = ref.llama_apply_rotary_emb(xq.double(), xk.double(), fc.to(torch.complex128))
    for g, w in zip(got, want):
        check(g.cpu(), w, torch.bfloat16)
    got = gpt_fast.apply_rotary_emb(xq.cuda(), cache.cuda())
    check(got.cpu(), ref.gpt_fast_apply_rotary_emb(xq.double(), cache.double()), torch.bfloat16)


def _q(d=8, s=5, h=3):
    return torch.randn(2, s, h, d)


# (what, the peer, ours, arguments, fragment of our error): inputs each peer refuses too.
REFUSED = [
    ("llama: freqs_cis of another seqlen", ref.llama_apply_rotary_emb, llama.apply_rotary_emb,
     lambda: (_q(), _q(), ref.llama_precompute_freqs_cis(8, 4)), "freqs_cis must have shape"),
    ("llama: freqs_cis of another width", ref.llama_apply_rotary_emb, llama.apply_rotary_emb,
     lambda: (_q(), _q(), ref.llama_precompute_freqs_cis(16, 5)), "freqs_cis must have shape"),
    ("llama: odd head_dim", ref.llama_apply_rotary_emb, llama.apply_rotary_emb,
     lambda: (_q(7), _q(7), torch.ones(5, 3, dtype=torch.complex64)), "xq must be"),
    ("llama: xk of another seqlen", ref.llama_apply_rotary_emb, llama.apply_rotary_emb,
     lambda: (_q(), _q(s=4), ref.llama_precompute_freqs_cis(8, 5)), "xk of shape"),
    ("llama: 2-D xq", ref.llama_apply_rotary_emb, llama.apply_rotary_emb,
     lambda: (torch.randn(4, 8), torch.randn(4, 8), ref.llama_precompute_freqs_cis(8, 4)), "xq must be"),
    ("gpt-fast: cache of another seqlen", ref.gpt_fast_apply_rotary_emb, gpt_fast.apply_rotary_emb,
     lambda: (_q(), ref.gpt_fast_precompute_freqs_cis(6, 8)), "freqs_cis of shape"),
    ("gpt-fast: odd head_dim", ref.gpt_fast_apply_rotary_emb, gpt_fast.apply_rotary_emb,
     lambda: (_q(7), torch.randn(5, 3, 2)), "x must be"),
    ("gpt-fast: 3-D x", ref.gpt_fast_apply_rotary_emb, gpt_fast.apply_rotary_emb,
     lambda: (torch.randn(2, 5, 8), ref.gpt_fast_precompute_freqs_cis(5, 8)), "x must be"),
    ("gpt-fast: cache not viewable", ref.gpt_fast_apply_rotary_emb, gpt_fast.apply_rotary_emb,
     lambda: (_q(), torch.randn(4, 2, 5).transpose(0, 2)), "cannot be viewed"),
]


@pytest.mark.parametrize("what,peer,ours,args,fragment", REFUSED, ids=[r[0] for r in REFUSED])
def test_refuses_what_the_peer_refuses(what, peer, ours, args, fragment):
    a = args()
    with pytest.raises((AssertionError, RuntimeError, ValueError, IndexError)):
        peer(*a)
    with pytest.raises(ValueError, match=fragment):
        ours(*a)
