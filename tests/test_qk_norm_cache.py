"""rope.qk_norm_rope_and_cache_ (the serving attention prologue in one op call): query and key
normed and rotated in place, value normed (v_norm), key and value stored into paged caches,
against an independent float64 computation written out here; the native and reference paths
against each other; bad inputs (same error on both paths, nothing written); opcheck; and
torch.compile(fullgraph=True) with one op call for the whole prologue. Each also for its
out-of-place form rope.qk_norm_rope_and_cache (inputs only read, new query, key and value)."""

import pytest
import torch

import rope_ext
from rope_ext._qk_norm import reference

from conftest import native_cpu
from tolerances import TOL

ops = torch.ops.rope
FP8 = {"auto": None, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
       "fp8_e5m2": torch.float8_e5m2}
TOLS = {**TOL, torch.float32: (1e-5, 1e-5)}  # norms sum head_dim squares
EPS = 1e-6


def close(actual, expected, dtype, what):
    rtol, atol = TOLS[dtype]
    torch.testing.assert_close(actual.double(), expected.double(), rtol=rtol, atol=atol,
                               msg=lambda m: f"{what}: {m}")


def oracle_rows(x, w, cos, sin, eps, unit_offset, interleaved):
    """float64: each row of x normed (x / sqrt(mean(x^2) + eps) * w, or * (1 + w), no weight
    when w is None), then its first 2 * cos.size(-1) dims rotated by (cos, sin) (complex
    multiplication of the pairs)."""
    x = x.double()
    y = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)
    if w is not None:
        y = y * (w.double() + (1.0 if unit_offset else 0.0))
    half = cos.shape[-1]
    if half == 0:
        return y
    head = y[..., : 2 * half]
    if interleaved:
        z = torch.complex(head[..., 0::2], head[..., 1::2])
    else:
        z = torch.complex(head[..., :half], head[..., half:])
    z = z * torch.complex(cos.double(), sin.double())
    rot = torch.stack((z.real, z.imag), -1).flatten(-2) if interleaved else torch.cat((z.real, z.imag), -1)
    return torch.cat((rot, y[..., 2 * half:]), -1)


def oracle_tables(cache, positions, section, mrope_interleaved):
    """The (T, 1, rotary_dim/2) cos and sin each token's pairs use: row positions[t], or with an
    MRoPE section, pair i from the row of component c(i) (chunked: sections in order;
    interleaved: T, H, W, T, H, W, ... within the sections' counts)."""
    half = cache.shape[1] // 2
    cos_all, sin_all = cache[:, :half].double(), cache[:, half:].double()
    if section is None:
        return cos_all[positions.long()][:, None], sin_all[positions.long()][:, None]
    comp = []
    if mrope_interleaved:
        counts = list(section)
        for i in range(half):
            c = i % 3
            comp.append(c if i // 3 < counts[c] else 0)
    else:
        for c, n in enumerate(section):
            comp += [c] * n
    T = positions.shape[1]
    cos, sin = torch.empty(T, half, dtype=torch.float64), torch.empty(T, half, dtype=torch.float64)
    for i, c in enumerate(comp):
        rows = positions[c].long()
        cos[:, i], sin[:, i] = cos_all[rows, i], sin_all[rows, i]
    return cos[:, None], sin[:, None]


def bits(t):
    """t's raw bits (NaN poison compares equal to itself)."""
    if not t.dtype.is_floating_point:
        return t
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def make_case(T=9, hq=4, hk=2, D=128, Dv=None, dtype=torch.bfloat16, rotary_dim=None,
              fmt="auto", block_size=4, mrope=None, packed=True, pad=True):
    """A call's arguments: q, k, v views of one (T, (hq + 2 hk) * D) projection output (packed)
    or separate tensors, random weights, a random cos_sin_cache, positions, a permutation of
    slots (some padding), caches poisoned with NaN (or float8 NaN bytes) so unwritten rows show,
    and scales for float8 caches."""
    Dv = D if Dv is None else Dv
    rotary_dim = D if rotary_dim is None else rotary_dim
    if packed and Dv == D:
        qkv = torch.randn(T, (hq + 2 * hk) * D, dtype=dtype) * 3
        q = qkv[:, : hq * D].unflatten(1, (hq, D))
        k = qkv[:, hq * D : (hq + hk) * D].unflatten(1, (hk, D))
        v = qkv[:, (hq + hk) * D :].unflatten(1, (hk, D))
    else:
        q, k = torch.randn(T, hq, D, dtype=dtype) * 3, torch.randn(T, hk, D, dtype=dtype)
        v = torch.randn(T, hk, Dv, dtype=dtype)
    max_position = 64
    cache = torch.randn(max_position, rotary_dim, dtype=torch.float32)
    if mrope is None:
        positions = torch.randint(0, max_position, (T,))
    else:
        positions = torch.randint(0, max_position, (3, T))
    blocks = (T + block_size) // block_size + 1
    slots = torch.randperm(blocks * block_size)[:T]
    if pad:
        slots[::4] = -1  # padding tokens: rotated (and v-normed) but not cached
    cdt = FP8[fmt] or dtype
    kc = torch.full((blocks, block_size, hk, D), float("nan")).to(cdt)
    vc = torch.full((blocks, block_size, hk, Dv), float("nan")).to(cdt)
    scales = {}
    if fmt != "auto":
        scales = dict(k_scale=torch.tensor([0.37]), v_scale=torch.tensor([1.9]))
    wq = torch.randn(D, dtype=dtype)
    wk = torch.randn(D, dtype=torch.float32)
    return dict(query=q, key=k, value=v, positions=positions, cos_sin_cache=cache, q_weight=wq,
                k_weight=wk, key_cache=kc, value_cache=vc, slot_mapping=slots,
                kv_cache_dtype=fmt, **scales)


POSITIONAL = ("query", "key", "value", "positions", "cos_sin_cache", "q_weight", "k_weight",
              "key_cache", "value_cache", "slot_mapping")


def call(fn, a, **kw):
    args = [a[n] for n in POSITIONAL]
    rest = {n: v for n, v in a.items() if n not in POSITIONAL}
    return fn(*args, **rest, **kw)


FORMS = ("in_place", "out_of_place")
OPS = {"in_place": (ops.qk_norm_rope_and_cache_, reference.qk_norm_rope_and_cache_),
       "out_of_place": (ops.qk_norm_rope_and_cache, reference.qk_norm_rope_and_cache)}


def run_prologue(form, a, **kw):
    """The public prologue function of `form` on case `a`; after it a["query"], a["key"] and
    a["value"] hold the results: in place the inputs themselves; out of place the returned
    tensors, once the inputs are seen unchanged (bit for bit) and the results new contiguous
    tensors of the inputs' shapes and dtype."""
    names = ("query", "key", "value")
    if form == "in_place":
        got = call(rope_ext.qk_norm_rope_and_cache_, a, **kw)
        assert got[0] is a["query"] and got[1] is a["key"]
        return
    before = {n: bits(a[n]).clone() for n in names}
    got = call(rope_ext.qk_norm_rope_and_cache, a, **kw)
    assert len(got) == 3
    for n, t in zip(names, got):
        assert torch.equal(bits(a[n]), before[n]), f"{n} was written out of place"
        assert t.is_contiguous() and t.shape == a[n].shape and t.dtype == a[n].dtype, n
        assert t.numel() == 0 or t.data_ptr() != a[n].data_ptr(), n
        a[n] = t


def check_against_oracle(a, before, dtype, unit_offset=False, interleaved=False, section=None,
                         mrope_interleaved=False, v_norm=False):
    q0, k0, v0 = before["query"], before["key"], before["value"]
    cos, sin = oracle_tables(a["cos_sin_cache"], a["positions"], section, mrope_interleaved)
    want_q = oracle_rows(q0, a["q_weight"], cos, sin, EPS, unit_offset, interleaved)
    want_k = oracle_rows(k0, a["k_weight"], cos, sin, EPS, unit_offset, interleaved)
    close(a["query"], want_q, dtype, "query")
    close(a["key"], want_k, dtype, "key")
    if v_norm:
        none = cos[..., :0]
        close(a["value"], oracle_rows(v0, None, none, none, EPS, False, False), dtype, "value")
    else:
        assert torch.equal(a["value"], v0), "value changed without v_norm"
    check_cache_rows(a["key_cache"], a["value_cache"], a, a["key"], a["value"])


def check_cache_rows(kc, vc, a, key, value):
    """Each non-padding token's rows of key and value (T, Hk, D) stored in the caches at its slot
    as the cache dtype (float8: x / scale saturated, by torch's conversion); every other cache
    row keeps its NaN poison."""
    fmt = FP8[a["kv_cache_dtype"]]
    bs = kc.shape[1]
    written = torch.zeros(kc.shape[:2], dtype=torch.bool)
    for t, s in enumerate(a["slot_mapping"].tolist()):
        if s < 0:
            continue
        written[s // bs, s % bs] = True
        for src, cache, scale in ((key[t], kc, "k_scale"), (value[t], vc, "v_scale")):
            want = src
            if fmt is not None:
                m = torch.finfo(fmt).max
                want = (src.float() / a[scale]).clamp(-m, m).to(fmt)
            got = cache[s // bs, s % bs]
            assert torch.equal(bits(got), bits(want)), f"cache row of token {t} (slot {s})"
    for cache in (kc, vc):
        assert cache[~written].float().isnan().all(), "a cache row without a token was written"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("fmt", ["auto", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("v_norm", [False, True])
@pytest.mark.parametrize("form", FORMS)
def test_matches_float64_computation(dtype, fmt, v_norm, form):
    a = make_case(dtype=dtype, fmt=fmt)
    before = {n: a[n].clone() for n in ("query", "key", "value")}
    run_prologue(form, a, eps=EPS, v_norm=v_norm)
    check_against_oracle(a, before, dtype, v_norm=v_norm)


@pytest.mark.parametrize("D,rotary_dim", [(64, 64), (128, 64), (256, 256), (512, 512),
                                          (512, 128), (80, 48)])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("unit_offset", [False, True])
@pytest.mark.parametrize("form", FORMS)
def test_head_dims_layouts_and_partial_rotary(D, rotary_dim, interleaved, unit_offset, form):
    a = make_case(T=6, hq=3, hk=1, D=D, rotary_dim=rotary_dim, dtype=torch.bfloat16,
                  packed=D != 80, block_size=1)
    before = {n: a[n].clone() for n in ("query", "key", "value")}
    run_prologue(form, a, eps=EPS, interleaved=interleaved, unit_offset=unit_offset, v_norm=True)
    check_against_oracle(a, before, torch.bfloat16, unit_offset, interleaved, v_norm=True)


@pytest.mark.parametrize("section,mrope_interleaved", [([16, 24, 24], False), ([24, 20, 20], True)])
@pytest.mark.parametrize("form", FORMS)
def test_mrope(section, mrope_interleaved, form):
    a = make_case(T=7, D=128, dtype=torch.float32, mrope=True, fmt="fp8")
    before = {n: a[n].clone() for n in ("query", "key", "value")}
    run_prologue(form, a, eps=EPS, mrope_section=section, mrope_interleaved=mrope_interleaved)
    check_against_oracle(a, before, torch.float32, section=section,
                         mrope_interleaved=mrope_interleaved)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("v_norm", [False, True])
def test_value_dim_differs_and_strided_caches(form, v_norm):
    """value_dim != head_dim; caches that are views with non-contiguous strides (HND-like
    permutations of a bigger buffer); value a strided view."""
    a = make_case(T=5, hq=2, hk=2, D=64, Dv=32, dtype=torch.float32, packed=False)
    kc = torch.full((a["key_cache"].shape[0], 2, 4, 64), float("nan")).permute(0, 2, 1, 3)
    a["key_cache"] = kc  # (blocks, block_size=4, hk=2, 64), heads outer in memory
    a["value"] = torch.randn(5, 32, 2).transpose(1, 2)  # (T, hk, Dv), last dim strided
    before = {n: a[n].clone() for n in ("query", "key", "value")}
    run_prologue(form, a, eps=EPS, v_norm=v_norm)
    check_against_oracle(a, before, torch.float32, v_norm=v_norm)


@pytest.mark.parametrize("fmt", ["auto", "fp8_e4m3"])
@pytest.mark.parametrize("v_norm", [False, True])
@pytest.mark.parametrize("form", FORMS)
def test_native_equals_reference(fmt, v_norm, form):
    if not native_cpu():
        pytest.skip("no native CPU library")
    a = make_case(dtype=torch.bfloat16, fmt=fmt, T=13)
    b = {n: (t.clone() if isinstance(t, torch.Tensor) else t) for n, t in a.items()}
    native, ref = OPS[form]
    outs = [call(native, a, eps=EPS, v_norm=v_norm), call(ref, b, eps=EPS, v_norm=v_norm)]
    if form == "out_of_place":
        for d, out in zip((a, b), outs):
            d.update(zip(("query", "key", "value"), out))
    for n in ("query", "key", "value", "key_cache", "value_cache"):
        x, y = a[n], b[n]
        if x.element_size() == 1:  # a float8 code may differ by one step where bf16 inputs tie
            x, y = x.float(), y.float()
            torch.testing.assert_close(x, y, rtol=0.13, atol=1e-3, equal_nan=True)
        else:
            torch.testing.assert_close(x.float(), y.float(), rtol=1.6e-2, atol=1e-5,
                                       equal_nan=True)


@pytest.mark.parametrize("form", FORMS)
def test_one_token_decode_and_empty(form):
    a = make_case(T=1, pad=False)
    before = {n: a[n].clone() for n in ("query", "key", "value")}
    run_prologue(form, a, eps=EPS)
    check_against_oracle(a, before, torch.bfloat16)
    e = make_case(T=0)
    run_prologue(form, e, eps=EPS, v_norm=True)
    assert e["key_cache"].float().isnan().all()
    assert e["query"].shape == (0, 4, 128) and e["value"].shape == (0, 2, 128)


def test_out_of_place_reads_overlapping_inputs():
    """Out of place nothing of query, key or value is written, so they may share memory: one
    tensor as all three, and the weights and the table inside it (each a rejected call in
    place). The results are those of the in-place op on separate copies."""
    torch.manual_seed(3)
    x = torch.randn(6, 2, 64)
    buf = torch.randn(64 * 64)
    wq, cache = buf[:64], buf.view(64, 64)
    kc, vc = (torch.full((2, 4, 2, 64), float("nan")) for _ in range(2))
    slots, positions = torch.tensor([0, 5, -1, 2, 7, 3]), torch.randint(0, 64, (6,))
    before = x.clone()
    results = []
    for fn in OPS["out_of_place"]:  # native, then the reference
        results.append((*fn(x, x, x, positions, cache, wq, wq, kc, vc, slots, EPS, v_norm=True),
                        kc.clone(), vc.clone()))
        assert torch.equal(x, before)
    copies = [x.clone() for _ in range(3)]
    kc2, vc2 = torch.full_like(kc, float("nan")), torch.full_like(vc, float("nan"))
    ops.qk_norm_rope_and_cache_(*copies, positions, cache.clone(), wq.clone(), wq.clone(), kc2,
                                vc2, slots, EPS, v_norm=True)
    for got, want in zip(results[0], (*copies, kc2, vc2)):
        assert torch.equal(bits(got), bits(want))
    for got, want in zip(results[1], (*copies, kc2, vc2)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, equal_nan=True)
    with pytest.raises(RuntimeError, match="query and key"):
        ops.qk_norm_rope_and_cache_(x, x, x.clone(), positions, cache, wq, wq, kc, vc, slots, EPS)


def test_out_of_place_reads_expanded_inputs():
    """Expanded query and key (stride 0: one row read for many heads or tokens), which the
    in-place op refuses, are read out of place: the float64 computation of the materialized
    tensors, on both paths."""
    a = make_case(T=5, hq=4, hk=2, D=64, dtype=torch.float32, packed=False)
    a["query"] = torch.randn(5, 1, 64).expand(5, 4, 64)
    a["key"] = torch.randn(1, 2, 64).expand(5, 2, 64)
    b = {n: (t.clone() if isinstance(t, torch.Tensor) and n.endswith("cache") else t)
         for n, t in a.items()}
    before = {n: a[n].clone() for n in ("query", "key", "value")}
    run_prologue("out_of_place", a, eps=EPS, v_norm=True)
    check_against_oracle(a, before, torch.float32, v_norm=True)
    got = call(reference.qk_norm_rope_and_cache, b, eps=EPS, v_norm=True)
    for x, y in zip(got, (a["query"], a["key"], a["value"])):
        close(x, y, torch.float32, "reference")
    with pytest.raises(RuntimeError, match="query: unsupported operation: more than one element"):
        call(ops.qk_norm_rope_and_cache_, b, eps=EPS)


def _bad_cases():
    """(change to a good call, the message): each must raise on both paths and write nothing."""
    def dup(a):
        s = a["slot_mapping"].clone()
        s[3] = s[1]
        return dict(slot_mapping=s)
    return [
        (dup, r"slot_mapping must not repeat a slot"),
        (lambda a: dict(slot_mapping=a["slot_mapping"] + 10**4),
         r"slot_mapping must lie below num_blocks \* block_size"),
        (lambda a: dict(positions=a["positions"].clone().fill_(64)), r"positions must lie in \[0, 64\)"),
        (lambda a: dict(kv_cache_dtype="fp8", key_cache=a["key_cache"].to(torch.float8_e4m3fn),
                        value_cache=a["value_cache"].to(torch.float8_e4m3fn)),
         r"k_scale is required for kv_cache_dtype 'fp8'"),
        (lambda a: dict(q_weight=a["q_weight"][:64]), r"q_weight must have shape \(head_dim,\)"),
        (lambda a: dict(value=a["value"].float()), r"value must have the dtype of key"),
        (lambda a: dict(key_cache=a["key_cache"].float()), r"key_cache must be BFloat16"),
        (lambda a: dict(eps=-1.0), r"eps must be a finite number >= 0"),
        (lambda a: dict(mrope_section=[8, 8, 8]), r"positions must have shape \(3,\)"),
        # In place only (IN_PLACE_ONLY): read while value (v_norm) is written, a weight or the
        # table in value's memory.
        (lambda a: (lambda v: dict(value=v, q_weight=v[0, 0]))(torch.randn(8, 2, 128).bfloat16()),
         r"q_weight and value: "),
        (lambda a: (lambda v: dict(value=v, cos_sin_cache=v[:, 0]))(torch.randn(8, 2, 128).bfloat16()),
         r"cos_sin_cache and value: "),
    ]


IN_PLACE_ONLY = 2  # the last cases of _bad_cases


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("case", range(len(_bad_cases())))
def test_rejected_calls_change_nothing_and_both_paths_agree(case, form):
    if form == "out_of_place" and case >= len(_bad_cases()) - IN_PLACE_ONLY:
        pytest.skip("value is only read out of place")
    change, match = _bad_cases()[case]
    messages = []
    base = make_case(T=8, D=128)
    for fn in OPS[form]:
        a = {n: (t.clone() if isinstance(t, torch.Tensor) else t) for n, t in base.items()}
        a.update(eps=EPS, v_norm=True)
        torch.manual_seed(1)
        a.update(change(a))
        before = {n: bits(t).clone() for n, t in a.items() if isinstance(t, torch.Tensor)}
        with pytest.raises(RuntimeError, match=match) as info:
            call(fn, a)
        messages.append(str(info.value))
        for n, t in before.items():
            assert torch.equal(bits(a[n]), t), f"{n} changed by a rejected call"
    assert messages[0] == messages[1]
    op = "rope.qk_norm_rope_and_cache" + ("_" if form == "in_place" else "")
    assert messages[0].startswith(op + ": "), messages[0]


@pytest.mark.parametrize("fn", [rope_ext.qk_norm_rope_and_cache_, rope_ext.qk_norm_rope_and_cache])
def test_refuses_grad(fn):
    a = make_case(dtype=torch.float32, T=4)
    a["query"] = a["query"].detach().clone().requires_grad_()
    with pytest.raises(RuntimeError, match="not differentiable"):
        call(fn, a)


def test_opcheck():
    # (float8 caches are left out: opcheck's schema test multiplies the outputs, which float8
    # tensors do not support; test_compile_fullgraph_is_one_op_call traces a float8 call.)
    for fmt, v_norm, mrope in (("auto", True, None), ("auto", False, True)):
        a = make_case(T=5, D=64, fmt=fmt, mrope=mrope, packed=False)
        kwargs = {n: v for n, v in a.items() if n not in POSITIONAL}
        kwargs.update(eps=EPS, v_norm=v_norm)
        if mrope:
            kwargs["mrope_section"] = [8, 12, 12]
        for op in (ops.qk_norm_rope_and_cache_, ops.qk_norm_rope_and_cache):
            torch.library.opcheck(op.default, [a[n] for n in POSITIONAL], kwargs)


@pytest.mark.parametrize("form", FORMS)
def test_compile_fullgraph_is_one_op_call(form):
    torch._dynamo.reset()
    a = make_case(T=6, D=64, fmt="fp8_e4m3", packed=True)
    b = {n: (t.clone() if isinstance(t, torch.Tensor) else t) for n, t in a.items()}
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def prologue(q, k, v, pos, cache, wq, wk, kc, vc, slots, ks, vs):
        kw = dict(eps=EPS, v_norm=True, kv_cache_dtype="fp8_e4m3", k_scale=ks, v_scale=vs)
        if form == "out_of_place":
            return rope_ext.qk_norm_rope_and_cache(q, k, v, pos, cache, wq, wk, kc, vc, slots, **kw)
        rope_ext.qk_norm_rope_and_cache_(q, k, v, pos, cache, wq, wk, kc, vc, slots, **kw)
        return q, k, v

    args = lambda d: [d[n] for n in POSITIONAL] + [d["k_scale"], d["v_scale"]]  # noqa: E731
    got = torch.compile(prologue, fullgraph=True, backend=backend)(*args(a))
    want = prologue(*args(b))
    for x, y in zip(got, want):
        assert torch.equal(bits(x), bits(y))
    for n in ("query", "key", "value", "key_cache", "value_cache"):
        assert torch.equal(bits(a[n]), bits(b[n])), n
    calls = [n for g in graphs for n in g.graph.nodes if n.op == "call_function"]
    rope_calls = [n for n in calls if "rope" in str(n.target)]
    assert len(rope_calls) == 1, calls


def test_compile_reads_an_expanded_value_as_eager_does():
    """Without v_norm the in-place prologue only reads value, and eager mode takes one expanded
    from a single head; compiled, the schema's write annotation on value (for v_norm) met
    functionalization's overlap check, an error naming neither the op nor value. The compiled
    call now gives eager's bits; with v_norm both refuse."""
    torch._dynamo.reset()
    a = make_case(T=6, D=64, dtype=torch.float32, packed=False)
    a["value"] = torch.randn(6, 1, 64).expand(6, 2, 64)
    b = {n: (t.clone() if isinstance(t, torch.Tensor) else t) for n, t in a.items()}
    b["value"] = a["value"]  # read by both calls
    before = {n: a[n].clone() for n in ("query", "key", "value")}
    call(torch.compile(rope_ext.qk_norm_rope_and_cache_, fullgraph=True), a, eps=EPS)
    check_against_oracle(a, before, torch.float32)
    call(rope_ext.qk_norm_rope_and_cache_, b, eps=EPS)
    for n in ("query", "key", "key_cache", "value_cache"):
        assert torch.equal(bits(a[n]), bits(b[n])), n
    with pytest.raises(RuntimeError, match="value: unsupported operation: more than one element"):
        call(rope_ext.qk_norm_rope_and_cache_, b, eps=EPS, v_norm=True)


@pytest.mark.parametrize("path", ["op", "reference"])
def test_an_expanded_value_of_one_qkv_buffer_is_refused_for_itself(path):
    """v_norm writes value: one expanded over the kv heads from a column block of the qkv buffer
    that query and key are views of is refused for its own overlap, naming value alone (its
    rows were compared with query's first: "query and value ... share elements", which they
    do not)."""
    T, hq, hk, D = 6, 4, 2, 64
    qkv = torch.randn(T, (hq + 2 * hk) * D)
    q = qkv[:, :hq * D].unflatten(1, (hq, D))
    k = qkv[:, hq * D:(hq + hk) * D].unflatten(1, (hk, D))
    v = qkv[:, (hq + hk) * D:(hq + hk + 1) * D].unflatten(1, (1, D)).expand(T, hk, D)
    kc, vc = torch.zeros(4, 4, hk, D), torch.zeros(4, 4, hk, D)
    before = [t.clone() for t in (qkv, kc, vc)]
    with pytest.raises(RuntimeError, match=r"rope.qk_norm_rope_and_cache_: value: unsupported "
                                           r"operation: more than one element"):
        fn = rope_ext.qk_norm_rope_and_cache_ if path == "op" else reference.qk_norm_rope_and_cache_
        fn(q, k, v, torch.arange(T), rope_ext.cos_sin_cache(16, D), torch.ones(D), torch.ones(D),
           kc, vc, torch.arange(T), v_norm=True)
    assert all(torch.equal(a, b) for a, b in zip((qkv, kc, vc), before))


# ---- vLLM's fused_qknorm_rope_cache (rope_ext.compat.vllm) ----

def vllm_prologue_case(dtype, fmt, rotary_dim, width=128, T=7, hq=4, hk=2, D=128):
    """qkv (T, (hq + 2 hk) * D), weights (q's in qkv's dtype, k's float32, as vLLM allows), a
    table of `width` columns, positions, slots with padding, NaN-poisoned caches (uint8 for
    vLLM's "fp8", as vLLM allocates them), scales as vLLM passes them (for every cache dtype)."""
    qkv = torch.randn(T, (hq + 2 * hk) * D, dtype=dtype) * 3
    cache = torch.randn(64, width, dtype=torch.float32)
    positions = torch.randint(0, 64, (T,))
    slots = torch.randperm(4 * T)[:T]
    slots[1::3] = -1
    cdt = FP8[fmt] or dtype
    kc = torch.full((T, 4, hk, D), float("nan")).to(cdt)
    vc = torch.full((T, 4, hk, D), float("nan")).to(cdt)
    if fmt == "fp8":
        kc, vc = kc.view(torch.uint8), vc.view(torch.uint8)
    return dict(qkv=qkv, q_weight=torch.randn(D, dtype=dtype), k_weight=torch.randn(D),
                cos_sin_cache=cache, positions=positions, slot_mapping=slots, key_cache=kc,
                value_cache=vc, num_q_heads=hq, num_kv_heads=hk, head_dim=D,
                rotary_dim=rotary_dim, eps=EPS, kv_cache_dtype=fmt,
                k_scale=torch.tensor(0.37), v_scale=torch.tensor(1.9))


def vllm_prologue_peer(a, bias):
    """vLLM's documented semantics in float64: each q and k head normed with weight + bias, then
    its first rotary_dim dims rotated NeoX-style by the halves of the table (cos: columns
    [0, rotary_dim/2), sin: [width/2, width/2 + rotary_dim/2)) at the token's position; v as it
    is. Returns (q, k, v) as (T, H * D). (vLLM's kernel also rounds the normed rows to qkv's
    dtype before the rotation; the drop-in rounds once, so both are held to the exact values.)"""
    qkv, D, hq, hk = a["qkv"], a["head_dim"], a["num_q_heads"], a["num_kv_heads"]
    half, r = a["cos_sin_cache"].shape[1] // 2, a["rotary_dim"] // 2
    q, k, v = qkv.split([hq * D, hk * D, hk * D], 1)
    rows = a["cos_sin_cache"].double()[a["positions"]]
    cos, sin = rows[:, None, :r], rows[:, None, half : half + r]
    out = [oracle_rows(x.unflatten(1, (h, D)), w.double() + bias, cos, sin, EPS, False, False)
           for x, w, h in ((q, a["q_weight"], hq), (k, a["k_weight"], hk))]
    return out[0].flatten(1), out[1].flatten(1), v


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("fmt", ["auto", "fp8", "fp8_e5m2"])
@pytest.mark.parametrize("bias", [0.0, 1.0, 0.5])
@pytest.mark.parametrize("rotary_dim,width", [(128, 128), (64, 128), (0, 128), (64, 64)])
def test_vllm_fused_qknorm_rope_cache(dtype, fmt, bias, rotary_dim, width):
    from rope_ext.compat.vllm import fused_qknorm_rope_cache

    a = vllm_prologue_case(dtype, fmt, rotary_dim, width)
    qkv0 = a["qkv"].clone()
    q, k, v = fused_qknorm_rope_cache(**a, norm_weight_bias=bias)
    assert torch.equal(a["qkv"], qkv0), "qkv changed"
    want_q, want_k, want_v = vllm_prologue_peer(a, bias)
    D = a["head_dim"]
    for got, want, what in ((q, want_q, "q"), (k, want_k, "k"), (v, want_v, "v")):
        assert got.shape == want.shape and got.dtype == dtype and got.is_contiguous(), what
        assert got.untyped_storage().data_ptr() != a["qkv"].untyped_storage().data_ptr(), what
        close(got, want, dtype, what)
    assert torch.equal(v, want_v)
    # the caches: the returned k and v rows at each non-padding slot, poison elsewhere
    kc, vc = a["key_cache"], a["value_cache"]
    if fmt == "fp8":  # vLLM's uint8 caches
        kc, vc = kc.view(FP8[fmt]), vc.view(FP8[fmt])
    heads = (a["num_kv_heads"], D)
    check_cache_rows(kc, vc, a, k.unflatten(1, heads), v.unflatten(1, heads))


def test_vllm_fused_qknorm_rope_cache_slot_mapping_shorter_than_qkv():
    """vLLM pads qkv to a CUDA graph's size while slot_mapping covers the real tokens: the rows
    past its end are normed and rotated as the others, and not cached."""
    from rope_ext.compat.vllm import fused_qknorm_rope_cache

    a = vllm_prologue_case(torch.bfloat16, "auto", 128)
    full = fused_qknorm_rope_cache(**{**a, "key_cache": a["key_cache"].clone(),
                                      "value_cache": a["value_cache"].clone(),
                                      "slot_mapping": torch.cat((a["slot_mapping"][:5],
                                                                 torch.tensor([-1, -1])))})
    a["slot_mapping"] = a["slot_mapping"][:5]
    got = fused_qknorm_rope_cache(**a)
    for g, w in zip(got, full):
        assert torch.equal(g, w)
    heads = (a["num_kv_heads"], a["head_dim"])
    padded = {**a, "slot_mapping": torch.cat((a["slot_mapping"], torch.tensor([-1, -1])))}
    check_cache_rows(a["key_cache"], a["value_cache"], padded, got[1].unflatten(1, heads),
                     got[2].unflatten(1, heads))


@pytest.mark.parametrize("layout", ["rows of a wider buffer", "column-major"])
def test_vllm_fused_qknorm_rope_cache_qkv_layouts(layout):
    """qkv of any strides: rows of a wider buffer are viewed as heads, a column-major qkv (its
    heads not a view) is copied first; either way the contiguous case's results, qkv unchanged."""
    from rope_ext.compat.vllm import fused_qknorm_rope_cache

    a = vllm_prologue_case(torch.bfloat16, "auto", 128)
    want = fused_qknorm_rope_cache(**{**a, "key_cache": a["key_cache"].clone(),
                                      "value_cache": a["value_cache"].clone()})
    T, W = a["qkv"].shape
    if layout == "column-major":
        qkv = a["qkv"].t().contiguous().t()
    else:
        qkv = torch.full((T, W + 64), float("nan"), dtype=torch.bfloat16)[:, 32 : 32 + W]
        qkv.copy_(a["qkv"])
    before = qkv.clone()
    got = fused_qknorm_rope_cache(**{**a, "qkv": qkv})
    assert torch.equal(qkv, before)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_vllm_fused_qknorm_rope_cache_rejects_and_changes_nothing():
    from rope_ext.compat.vllm import fused_qknorm_rope_cache

    def case(**change):
        a = vllm_prologue_case(torch.bfloat16, "auto", 128)
        a.update(change)
        return a

    bad = [
        (case(rotary_dim=60), ValueError, r"multiple of 8 in \[0, head_dim=128\], got 60"),
        (case(rotary_dim=136), ValueError, r"multiple of 8 in \[0, head_dim=128\], got 136"),
        (case(num_kv_heads=3), ValueError, "qkv must have shape"),
        (case(norm_weight_bias=float("nan")), ValueError, "norm_weight_bias must be a finite"),
        (case(cos_sin_cache=torch.randn(64, 127)), ValueError, "cos_sin_cache must have shape"),
        (case(slot_mapping=torch.tensor([0, 1, 2, 3, 4, 5, 28])), RuntimeError, "slot"),
        (case(positions=torch.tensor([0, 1, 2, 3, 4, 5, 64])), RuntimeError, "positions"),
        (case(kv_cache_dtype="fp8"), RuntimeError, "key_cache must be"),
    ]
    for a, error, match in bad:
        before = {n: t.clone() for n, t in a.items() if isinstance(t, torch.Tensor)}
        with pytest.raises(error, match=match):
            fused_qknorm_rope_cache(**a)
        for n, t in before.items():
            assert torch.equal(bits(a[n]), bits(t)), f"{n} changed by a rejected call"
