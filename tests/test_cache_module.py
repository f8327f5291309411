"""cos_sin_cache and RotaryEmbedding."""

import math

import pytest
import torch

import rope_ext
from conftest import assert_close
from rope_oracle import rope


def test_cache_layout_and_exactness_at_large_positions():
    R, base = 128, 10000.0
    positions = [0, 1, 7, 4095, 131071, 999_999]
    cache = rope_ext.cos_sin_cache(1_000_000, R, base=base)
    assert cache.shape == (1_000_000, R) and cache.dtype == torch.float32
    for p in positions:
        for i in (0, 1, 17, R // 2 - 1):
            theta = p * (1.0 / base ** (2 * i / R))  # python floats are float64
            # Exact to float32 rounding of the float64 value.
            assert cache[p, i].item() == torch.tensor(math.cos(theta), dtype=torch.float32).item()
            assert cache[p, R // 2 + i].item() == torch.tensor(math.sin(theta), dtype=torch.float32).item()


def test_cache_dtype_and_device_arguments():
    c = rope_ext.cos_sin_cache(16, 8, dtype=torch.float64, device="cpu", base=500000.0)
    assert c.dtype == torch.float64
    theta = 3 * 500000.0 ** (-2 * 1 / 8)
    assert c[3, 1].item() == pytest.approx(math.cos(theta), abs=1e-15)


def test_unknown_scaling_is_explicit():
    # The supported scalings are tested in test_scaling.py.
    with pytest.raises(ValueError, match="unknown rope scaling type"):
        rope_ext.cos_sin_cache(16, 8, scaling={"rope_type": "not-a-scaling", "factor": 2.0})


@pytest.mark.parametrize("interleaved", [False, True])
def test_rotary_embedding_forward_and_backward(interleaved):
    m = rope_ext.RotaryEmbedding(64, rotary_dim=32, max_position=256, base=10000.0, interleaved=interleaved)
    assert "cos_sin_cache" not in m.state_dict()  # non-persistent
    q = torch.randn(2, 9, 4, 64, requires_grad=True)
    k = torch.randn(2, 9, 2, 64, requires_grad=True)
    pos = torch.randint(0, 256, (2, 9))
    q2, k2 = m(q, k, pos)
    rows = m.cos_sin_cache.double()[pos].unsqueeze(-2)
    assert_close(q2, rope(q, rows[..., :16], rows[..., 16:], interleaved), torch.float32)
    assert_close(k2, rope(k, rows[..., :16], rows[..., 16:], interleaved), torch.float32)
    (q2.sum() + k2.square().sum()).backward()
    assert_close(q.grad, rope(torch.ones_like(q), rows[..., :16], rows[..., 16:], interleaved, inverse=True),
                 torch.float32)
    # The module's path agrees with the in-place inference op.
    qi, ki = q.detach().clone(), k.detach().clone()
    rope_ext.apply_rope_(qi, ki, pos, m.cos_sin_cache, interleaved=interleaved)
    assert torch.equal(qi, q2.detach()) and torch.equal(ki, k2.detach())
    assert m(q, None, pos)[1] is None


def test_rotary_embedding_keeps_float32_table_under_dtype_casts():
    m = rope_ext.RotaryEmbedding(32, max_position=64).to(torch.bfloat16)
    assert m.cos_sin_cache.dtype == torch.float32
    torch.testing.assert_close(m.cos_sin_cache, rope_ext.cos_sin_cache(64, 32), rtol=0, atol=0)
    q = torch.randn(3, 2, 32, dtype=torch.bfloat16)
    q2, _ = m(q, None, torch.tensor([1, 2, 63]))
    assert q2.dtype == torch.bfloat16


@pytest.mark.parametrize("scaling", [None, "dynamic", "longrope"])
def test_rotary_embedding_built_on_meta_then_materialized_has_its_table(scaling):
    # Large models are built on the meta device, then given memory with to_empty(): the table is
    # not a parameter any checkpoint restores, so the module computes it again.
    kw = dict(max_position=300, scaling={None: None, "dynamic": DYNAMIC, "longrope": LONGROPE}[scaling])
    fresh = rope_ext.RotaryEmbedding(8, **kw)
    with torch.device("meta"):
        m = rope_ext.RotaryEmbedding(8, **kw)
    m.to_empty(device="cpu")
    assert torch.equal(m._tables, fresh._tables)
    if scaling == "dynamic":
        assert int(m.dynamic_len) == int(fresh.dynamic_len)
    q, pos = torch.randn(2, 5, 3, 8), torch.randint(0, 300, (2, 5))
    assert torch.equal(m(q, None, pos)[0], fresh(q, None, pos)[0])


def _placeholder(buf):
    """What a loader hands a non-persistent buffer it has no checkpoint value for: memory of the
    buffer's kind on the CPU holding no table (here NaN or a huge length, so that a rotation by it
    shows)."""
    return torch.full_like(buf, float("nan") if buf.is_floating_point() else 1 << 40, device="cpu")


@pytest.mark.parametrize("scaling", [None, "dynamic", "longrope"])
def test_rotary_embedding_state_placed_by_a_loader_gets_its_values(scaling):
    # transformers 5's from_pretrained builds the model on meta, then sets each non-persistent
    # buffer to an empty tensor by setattr (FSDP's ranks other than 0: a zeroed one): the module
    # builds its state there.
    kw = dict(max_position=300, scaling={None: None, "dynamic": DYNAMIC, "longrope": LONGROPE}[scaling])
    fresh = rope_ext.RotaryEmbedding(8, **kw)
    with torch.device("meta"):
        model = torch.nn.Sequential(rope_ext.RotaryEmbedding(8, **kw))
    for name, buf in list(model.named_buffers()):
        owner, attr = name.rsplit(".", 1)
        setattr(model.get_submodule(owner), attr, _placeholder(buf))
    m = model[0]
    assert m._tables.device.type == "cpu" and torch.equal(m._tables, fresh._tables)
    if scaling == "dynamic":
        assert m.dynamic_len.dtype == torch.int64 and int(m.dynamic_len) == int(fresh.dynamic_len)
    q, pos = torch.randn(2, 5, 3, 8), torch.randint(0, 300, (2, 5))
    assert torch.equal(m(q, None, pos)[0], fresh(q, None, pos)[0])


def test_rotary_embedding_state_assigned_to_a_module_with_values_is_taken():
    # An assignment to state that holds values is the caller's: taken as it is, and the tensor
    # assigned (here another module's table, then shared) is not written.
    a = rope_ext.RotaryEmbedding(8, max_position=300)
    b = rope_ext.RotaryEmbedding(8, max_position=300, base=5e5)
    want = a._tables.clone()
    b._tables = a._tables
    assert b._tables is a._tables and torch.equal(a._tables, want)
    d = rope_ext.RotaryEmbedding(8, max_position=300, scaling=DYNAMIC)
    d(torch.randn(1, 2, 8), None, torch.tensor([250]))
    d.dynamic_len = torch.tensor(70)
    assert int(d.dynamic_len) == 70


@pytest.mark.parametrize("scaling", [None, "dynamic", "longrope"])
def test_rotary_embedding_whose_state_stayed_on_meta_says_so(scaling):
    # Built on meta, parameters loaded with assign=True: the table, not in a state_dict, is
    # still on meta; the call names it and what gives it memory, changing nothing.
    kw = dict(max_position=300, scaling={None: None, "dynamic": DYNAMIC, "longrope": LONGROPE}[scaling])
    with torch.device("meta"):
        m = rope_ext.RotaryEmbedding(8, **kw)
    q, pos = torch.randn(2, 3, 8), torch.tensor([1, 2])
    for call in (lambda: m(q, q, pos), lambda: m.forward_(q.clone(), None, pos), lambda: m.cos_sin(pos)):
        with pytest.raises(RuntimeError, match=r"RotaryEmbedding: its table is on the meta device .* "
                                               r"call \.to_empty\(device=\.\.\.\)"):
            call()
    m.to_empty(device="cpu")
    assert torch.equal(m(q, None, pos)[0], rope_ext.RotaryEmbedding(8, **kw)(q, None, pos)[0])


def test_rotary_embedding_state_swapped_by_functional_call_is_used_as_given():
    # torch.func.functional_call (and export) swap buffers in for one call: not a loader's
    # placeholder, the call rotates by what it was given.
    m = rope_ext.RotaryEmbedding(8, max_position=16)
    other = rope_ext.cos_sin_cache(16, 8, base=7.0)
    q, pos = torch.randn(3, 2, 8), torch.tensor([1, 5, 9])
    got = torch.func.functional_call(m, {"_tables": other}, (q, None, pos))[0]
    assert torch.equal(got, rope_ext.apply_rope_at(q, pos, other))
    assert torch.equal(m._tables, rope_ext.cos_sin_cache(16, 8))


@pytest.mark.parametrize("how", ["to_empty", "type", "meta and back"])
def test_rotary_embedding_state_survives_what_apply_does(how):
    """A module with real tables given new memory (to_empty(), as after init_empty_weights() of
    parameters only), cast by .type() (which casts int64 buffers too) or moved: the table is
    rebuilt and the dynamic-NTK length kept exactly."""
    m = rope_ext.RotaryEmbedding(8, max_position=140_000, scaling=DYNAMIC)
    fresh = rope_ext.RotaryEmbedding(8, max_position=140_000, scaling=DYNAMIC)
    q, pos = torch.randn(3, 2, 8), torch.tensor([5, 70_000, 2])
    want = fresh(q, None, pos)[0]
    m(q, None, pos)
    if how == "to_empty":
        m.to_empty(device="cpu")
    elif how == "type":
        m.type(torch.float16)  # 70001 is not a float16
    else:
        m.to("meta").to_empty(device="cpu")
    assert m._tables.dtype == torch.float32 and torch.equal(m._tables, fresh._tables)
    assert m.dynamic_len.dtype == torch.int64
    assert int(m.dynamic_len) == (64 if how == "meta and back" else 70_001)
    if how != "meta and back":
        assert torch.equal(m(q.to(m._tables.dtype), None, pos)[0], want)


def test_rotary_embedding_built_in_inference_mode_serves_outside_it():
    """Built under inference_mode, a dynamic-NTK module's length is still updated by calls under
    no_grad (transformers' generate) and in grad mode, and its table can be saved for backward."""
    with torch.inference_mode():
        m = rope_ext.RotaryEmbedding(8, max_position=300, scaling=DYNAMIC)
        s = rope_ext.RotaryEmbedding(8, max_position=300)
    fresh = rope_ext.RotaryEmbedding(8, max_position=300, scaling=DYNAMIC)
    q = torch.randn(2, 1, 8)
    for pos in (torch.tensor([3, 99]), torch.tensor([1, 250])):
        with torch.no_grad():
            got = m.forward_(q.clone(), None, pos)[0]
        assert torch.equal(got, fresh(q, None, pos)[0]) and int(m.dynamic_len) == int(fresh.dynamic_len)
    x = torch.randn(2, 1, 8, requires_grad=True)
    s(x, None, torch.tensor([1, 2]))[0].sum().backward()
    assert x.grad is not None


def test_rotary_embedding_checks_base_seq_len_positions_and_copies_scaling():
    for kw, match in ((dict(base=0), "base must be > 0 and finite, got 0"),
                      (dict(base=float("nan")), "base must be > 0 and finite"),
                      (dict(base=-1e4), "base must be > 0 and finite"),
                      (dict(seq_len=0), "seq_len must be a positive int, got 0"),
                      (dict(seq_len=2.5), "seq_len must be a positive int"),
                      (dict(seq_len=True), "seq_len must be a positive int")):
        with pytest.raises(ValueError, match="RotaryEmbedding: " + match):
            rope_ext.RotaryEmbedding(8, **kw)
    with pytest.raises(ValueError, match="cos_sin_cache: base must be > 0 and finite, got inf"):
        rope_ext.cos_sin_cache(8, 8, base=float("inf"))
    m = rope_ext.RotaryEmbedding(8)
    for call in (m.cos_sin, lambda p: m(torch.randn(2, 1, 8), None, p)):
        with pytest.raises(TypeError, match="RotaryEmbedding: positions must be a tensor of "
                                            "int32 or int64, got list"):
            call([0, 1])
    scaling = {k: list(v) if isinstance(v, list) else v for k, v in LONGROPE.items()}
    m = rope_ext.RotaryEmbedding(8, max_position=300, scaling=scaling)
    before = m._tables.clone()
    scaling["long_factor"][0] = 100.0  # the caller's config edited afterwards
    m.half()
    assert torch.equal(m._tables, before)


@pytest.mark.parametrize("name,value", [("base", 5e5), ("max_position", 64), ("rotary_dim", 4),
                                        ("seq_len", 32), ("scaling", {"rope_type": "linear",
                                                                     "factor": 2.0})])
def test_rotary_embedding_settings_of_its_table_are_fixed(name, value):
    """An edit of what the table was built from would take effect at the next cast or move (which
    builds the table again): results depending on the module's history. It is refused, and the
    scaling dict reads as a copy; a cast still gives what a fresh module gives."""
    dyn = {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 64}
    m = rope_ext.RotaryEmbedding(8, max_position=256, scaling=dyn)
    x, pos = torch.randn(1, 3, 2, 8), torch.arange(200, 203)[None]
    want = m(x, None, pos)[0]
    with pytest.raises(AttributeError, match=f"RotaryEmbedding: {name} is fixed once the table is "
                                             f"built from it; build a new RotaryEmbedding"):
        setattr(m, name, value)
    m.scaling["factor"] = 4.0  # a copy
    assert m.scaling == dyn and m._factor == 2.0
    m.half().float()
    assert torch.equal(m(x, None, pos)[0], want)
    fresh = rope_ext.RotaryEmbedding(8, max_position=256, scaling=dyn)
    assert torch.equal(fresh(x, None, pos)[0], want)
    m.interleaved = True  # read at call time, not built into the table: takes effect at once
    assert torch.equal(m(x, None, pos)[0],
                       rope_ext.RotaryEmbedding(8, max_position=256, scaling=dyn,
                                                interleaved=True)(x, None, pos)[0])


def test_rotary_embedding_rejects_out_of_range_positions():
    m = rope_ext.RotaryEmbedding(16, max_position=8)
    with pytest.raises(RuntimeError, match=r"positions must lie in \[0, 8\)"):
        m(torch.randn(2, 1, 16), None, torch.tensor([3, 8]))
    with pytest.raises(RuntimeError, match=r"got -1"):
        m(torch.randn(2, 1, 16), None, torch.tensor([-1, 0]))


# ---- length-dependent scalings in the module ------------------------------------------------
# The expected rows come from cos_sin_cache built for the length a call has (max(positions) + 1),
# with the length rule restated here: longrope reads its long factors past the original length,
# dynamic NTK keeps the longest length seen and returns to the original below it.

LONGROPE = {"rope_type": "longrope", "short_factor": [1.0, 1.5, 2.0, 3.0], "long_factor": [2.0, 4.0, 8.0, 16.0],
            "original_max_position_embeddings": 64}
DYNAMIC = {"rope_type": "dynamic", "factor": 4.0, "original_max_position_embeddings": 64}


def _rotated(q, rows, interleaved=False):
    half = rows.shape[-1] // 2
    rows = rows.double().unsqueeze(-2)
    return rope(q, rows[..., :half], rows[..., half:], interleaved)


@pytest.mark.parametrize("interleaved", [False, True])
def test_longrope_module_switches_by_call_length(interleaved):
    m = rope_ext.RotaryEmbedding(12, rotary_dim=8, max_position=256, scaling=LONGROPE, interleaved=interleaved)
    assert m.mode == "longrope"
    short = rope_ext.cos_sin_cache(256, 8, scaling=LONGROPE, seq_len=64)  # factor 256/64 in both sets
    long_ = rope_ext.cos_sin_cache(256, 8, scaling=LONGROPE, seq_len=65)
    assert torch.equal(m.cos_sin_cache, long_) and not torch.equal(short, long_)
    for last, table in ((10, short), (63, short), (64, long_), (255, long_)):
        pos = torch.randint(0, last + 1, (3, 5))
        pos[1, 2] = last
        q = torch.randn(3, 5, 2, 12)
        q2, _ = m(q, None, pos)
        assert_close(q2, _rotated(q, table[pos], interleaved), torch.float32)
        qi = q.clone()
        m.forward_(qi, None, pos)
        assert torch.equal(qi, q2)
        cos, sin = m.cos_sin(pos)
        assert torch.equal(torch.cat((cos, sin), -1), table[pos])


@pytest.mark.parametrize("bad", [[3, 256], [-1, 100], [-1, 3], [300, 3]])
def test_longrope_module_rejects_out_of_range_positions(bad):
    # A long call shifts rows past the short ones; a negative or too-large position must still
    # fail, not land in the other set.
    m = rope_ext.RotaryEmbedding(8, max_position=256, scaling=LONGROPE)
    q = torch.randn(2, 1, 8)
    qi = q.clone()
    with pytest.raises(RuntimeError, match=r"positions must lie in \[0, 256\)"):
        m.forward_(qi, None, torch.tensor(bad))
    assert torch.equal(qi, q)
    with pytest.raises(RuntimeError, match=r"positions must lie in \[0, 256\)"):
        m(q, None, torch.tensor(bad))


def _dynamic_lengths(calls, original):
    state, out = original, []
    for n in calls:
        state = n if n > state else (original if n < original else state)
        out.append(state)
    return out


def test_dynamic_module_follows_the_longest_length():
    m = rope_ext.RotaryEmbedding(10, rotary_dim=8, max_position=300, scaling=DYNAMIC)
    assert m.mode == "dynamic" and int(m.dynamic_len) == 64
    assert torch.equal(m.cos_sin_cache, rope_ext.cos_sin_cache(300, 8, scaling=DYNAMIC, seq_len=300))
    calls = [10, 64, 65, 200, 120, 63, 64, 150, 299, 1, 300]
    for n, length in zip(calls, _dynamic_lengths(calls, 64)):
        pos = torch.randint(0, n, (2, 4))
        pos[0, 0] = n - 1
        q = torch.randn(2, 4, 3, 10, dtype=torch.float64)
        q2, _ = m(q, None, pos)
        assert int(m.dynamic_len) == length
        # float64 angles on the device vs the float64 table: equal to rounding of pow/exp.
        table = rope_ext.cos_sin_cache(300, 8, scaling=DYNAMIC, seq_len=length, dtype=torch.float64)
        torch.testing.assert_close(q2, _rotated(q, table[pos]), rtol=1e-6, atol=1e-6)
        cos, sin = m.cos_sin(pos)  # a second read of the same length changes nothing
        assert int(m.dynamic_len) == length
        torch.testing.assert_close(torch.cat((cos, sin), -1).double(), table[pos], rtol=0, atol=1e-7)


def test_dynamic_module_in_place_and_rejected_calls():
    m = rope_ext.RotaryEmbedding(8, max_position=300, scaling=DYNAMIC)
    pos = torch.tensor([[5, 250]])
    q, k = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 1, 8)
    want_q, want_k = rope_ext.RotaryEmbedding(8, max_position=300, scaling=DYNAMIC)(q, k, pos)
    qi, ki = q.clone(), k.clone()
    m.forward_(qi, ki, pos)
    assert torch.equal(qi, want_q) and torch.equal(ki, want_k) and int(m.dynamic_len) == 251
    for bad, err in (([[3, 300]], r"positions must lie in \[0, 300\)"), ([[-2, 3]], r"got -2"),
                     (torch.tensor([[1.0, 2.0]]), r"positions must be int32 or int64")):
        bad = bad if isinstance(bad, torch.Tensor) else torch.tensor(bad)
        qi = q.clone()
        with pytest.raises(RuntimeError, match=err):
            m.forward_(qi, None, bad)
        assert torch.equal(qi, q) and int(m.dynamic_len) == 251  # nothing changed


def test_dynamic_module_empty_call_and_int32_positions():
    m = rope_ext.RotaryEmbedding(8, max_position=300, scaling=DYNAMIC)
    out, _ = m(torch.randn(0, 2, 8), None, torch.zeros(0, dtype=torch.int64))
    assert out.shape == (0, 2, 8) and int(m.dynamic_len) == 64
    q = torch.randn(3, 2, 8)
    pos = torch.tensor([1, 100, 7])
    torch.testing.assert_close(m(q, None, pos.int())[0], m(q, None, pos)[0], rtol=0, atol=0)


def test_seq_len_builds_one_fixed_table():
    for sc in (DYNAMIC, LONGROPE):
        m = rope_ext.RotaryEmbedding(8, max_position=256, scaling=sc, seq_len=100)
        assert m.mode == "static"
        assert torch.equal(m.cos_sin_cache, rope_ext.cos_sin_cache(256, 8, scaling=sc, seq_len=100))
    # A table no longer than the original length never switches: one table, the short set.
    m = rope_ext.RotaryEmbedding(8, max_position=64, scaling=LONGROPE)
    assert m.mode == "static"
    assert torch.equal(m.cos_sin_cache, rope_ext.cos_sin_cache(64, 8, scaling=LONGROPE, seq_len=64))


def test_length_dependent_tables_stay_float32_under_casts():
    for sc in (DYNAMIC, LONGROPE):
        m = rope_ext.RotaryEmbedding(8, max_position=256, scaling=sc)
        want = m.cos_sin_cache.clone()
        m(torch.randn(1, 1, 8), None, torch.tensor([200]))
        m = m.to(torch.bfloat16)
        assert m.cos_sin_cache.dtype == torch.float32 and torch.equal(m.cos_sin_cache, want)
        if sc is DYNAMIC:
            assert m.dynamic_len.dtype == torch.int64 and int(m.dynamic_len) == 201
        assert m(torch.randn(2, 1, 8, dtype=torch.bfloat16), None, torch.tensor([3, 4]))[0].dtype == torch.bfloat16


def test_dynamic_module_call_rejected_by_the_op_keeps_its_length():
    # The positions are fine but do not match query's shape: the op rejects the call after the
    # module computed the new length, which must then not be kept.
    m = rope_ext.RotaryEmbedding(8, max_position=300, scaling=DYNAMIC)
    q = torch.randn(3, 2, 8)
    for call in (m, m.forward_):
        with pytest.raises(RuntimeError, match=r"positions must have shape"):
            call(q.clone(), None, torch.tensor([5, 250]))
        assert int(m.dynamic_len) == 64


LENGTH_DEPENDENT = {
    "dynamic": {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 16},
    "longrope": {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
                 "original_max_position_embeddings": 16},
}


@pytest.mark.parametrize("mode", sorted(LENGTH_DEPENDENT))
def test_length_dependent_module_traces_any_token_count(mode):
    # A traced call takes one path for every token count: data-dependent (unbacked) counts
    # trace, and an exported module called with no tokens leaves the dynamic-NTK length as
    # eager does (40 -> 0 -> 20 tokens: the length stays 40).
    D = 16
    traced = rope_ext.RotaryEmbedding(D, max_position=64, scaling=LENGTH_DEPENDENT[mode])
    eager = rope_ext.RotaryEmbedding(D, max_position=64, scaling=LENGTH_DEPENDENT[mode])
    q, k, pos = torch.randn(20, 4, D), torch.randn(20, 2, D), torch.randperm(20)
    for t in (q, k, pos):
        torch._dynamo.decorators.mark_unbacked(t, 0)
    torch._dynamo.reset()
    got = torch.compile(traced, fullgraph=True, backend="aot_eager")(q, k, pos)
    for g, w in zip(got, eager(q, k, pos)):
        assert torch.equal(g, w)

    class Rotate(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.rope = rope_ext.RotaryEmbedding(D, max_position=64, scaling=LENGTH_DEPENDENT[mode])

        def forward(self, x, positions):
            return self.rope(x, None, positions)[0]

    tokens = torch.export.Dim("tokens", min=0, max=64)
    exported = torch.export.export(Rotate(), (torch.randn(8, 4, D), torch.arange(8)),
                                   dynamic_shapes=({0: tokens}, {0: tokens})).module()
    reference = Rotate()
    for n in (40, 0, 20):
        x, positions = torch.randn(n, 4, D), torch.randperm(n)
        want = reference(x, positions)
        assert torch.equal(exported(x, positions), want) and want.shape == (n, 4, D)
    if mode == "dynamic":
        assert int(reference.rope.dynamic_len) == 40
