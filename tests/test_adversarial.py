"""Inputs an adversarial user tries: in-place ops under autograd, overlapping targets, ambiguous
table shapes, sizes that overflow, positions that alias what is written, shapes that never end.
Each gives torch's own error or the right result on every path (native, reference, the CUDA host
code in the simulator), never a crash or a silent wrong value."""

import os
import re
import subprocess
import sys

import pytest
import torch

import cuda_sim
import rope_ext
from conftest import assert_close

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CACHE = rope_ext.cos_sin_cache(8, 16)
SAVED = "one of the variables needed for gradient computation has been modified by an inplace operation"
INTERNAL = "more than one element of the written-to tensor refers to a single memory location"
PARTIAL = "some elements of the input tensor and the written-to tensor refer to a single memory location"

# The public in-place entry points, on (query, positions, cache) of shape (4, 2, 16).
IN_PLACE = {
    "apply_rope_": lambda q, pos, cache: rope_ext.apply_rope_(q, None, pos, cache),
    "apply_mrope_": lambda q, pos, cache: rope_ext.apply_mrope_(
        q, None, pos.expand(3, *pos.shape), cache, [4, 2, 2]),
    "forward_": lambda q, pos, cache: rope_ext.RotaryEmbedding(16, max_position=8).forward_(q, None, pos),
}


@pytest.mark.parametrize("entry", IN_PLACE)
def test_in_place_op_refuses_to_overwrite_a_tensor_saved_for_backward(entry):
    a = torch.randn(4, 2, 16, requires_grad=True)
    y = a.exp()  # exp saves its output for the backward
    IN_PLACE[entry](y, torch.arange(4), CACHE)
    with pytest.raises(RuntimeError, match=SAVED):
        y.sum().backward()


@pytest.mark.parametrize("entry", IN_PLACE)
def test_in_place_op_gradient_is_the_out_of_place_one(entry):
    a = torch.randn(4, 2, 16, requires_grad=True)
    pos = torch.tensor([3, 1, 7, 0])
    y = a * 2.0  # saves nothing of y
    IN_PLACE[entry](y, pos, CACHE)
    g = torch.randn(4, 2, 16)
    (got,) = torch.autograd.grad(y, a, g)
    want = 2.0 * rope_ext.reference.apply_positions(g, pos, CACHE[:, :8], CACHE[:, 8:], inverse=True)
    assert_close(got, want, torch.float32)


@pytest.mark.parametrize("entry", IN_PLACE)
def test_in_place_op_follows_torch_rules_for_leaves_and_inference_tensors(entry):
    leaf = torch.nn.Parameter(torch.randn(4, 2, 16))
    with pytest.raises(RuntimeError, match="a leaf Variable that requires grad .* in-place operation"):
        IN_PLACE[entry](leaf, torch.arange(4), CACHE)
    with torch.no_grad():  # allowed, as for torch's own ops, and the version counter moves
        v = leaf._version
        IN_PLACE[entry](leaf, torch.arange(4), CACHE)
        assert leaf._version > v
    with torch.inference_mode():
        inf = torch.randn(4, 2, 16)
        IN_PLACE[entry](inf.clone(), torch.arange(4), CACHE)  # fine inside inference mode
    with pytest.raises(RuntimeError, match="Inplace update to inference tensor outside InferenceMode"):
        IN_PLACE[entry](inf, torch.arange(4), CACHE)


def test_raw_ops_bump_version_counters_of_every_written_tensor():
    q, k = torch.randn(4, 2, 16), torch.randn(4, 1, 16)
    vq, vk = q._version, k._version
    torch.ops.rope.apply_(q, k, torch.arange(4), CACHE, False)
    assert q._version > vq and k._version > vk
    out = torch.empty(4, 2, 16)
    v = out._version
    torch.ops.rope.apply.out(q, CACHE[:4, None, :8], CACHE[:4, None, 8:], False, out=out)
    assert out._version > v
    kc, vc = torch.zeros(2, 4, 1, 16), torch.zeros(2, 4, 1, 16)
    versions = [t._version for t in (q, k, kc, vc)]
    torch.ops.rope.apply_and_cache_(q, k, k.clone(), torch.arange(4), CACHE, kc, vc, torch.arange(4))
    assert all(t._version > v for t, v in zip((q, k, kc, vc), versions))


def test_a_refused_call_moves_no_version_counter():
    """As torch's own in-place ops: versions move when the call has written, so a call refused by
    the op's checks, or for an inference tensor anywhere in its written arguments, moves none (an
    autograd record of the tensors stays valid)."""
    with torch.inference_mode():
        inference = [torch.randn(4, 1, 16), torch.zeros(2, 4, 1, 16)]
    for mode in (torch.no_grad, torch.enable_grad):
        q, k, v = torch.randn(4, 2, 16), torch.randn(4, 1, 16), torch.randn(4, 1, 16)
        kc, vc = torch.zeros(2, 4, 1, 16), torch.zeros(2, 4, 1, 16)
        calls = [  # (call, its written tensors, the error)
            (lambda: torch.ops.rope.apply_(q, k, torch.tensor([0, 1, 64, 2]), CACHE, False),
             (q, k), "positions must lie in"),
            (lambda: torch.ops.rope.apply_(q, inference[0], torch.arange(4), CACHE, False),
             (q,), "Inplace update to inference tensor"),
            (lambda: torch.ops.rope.apply_and_cache_(q, k, v, torch.arange(4), CACHE, kc, vc,
                                                     torch.tensor([0, 1, 1, 2])),
             (q, k, kc, vc), "slot_mapping"),
            (lambda: torch.ops.rope.apply_and_cache_(q, k, v, torch.arange(4), CACHE, kc,
                                                     inference[1], torch.arange(4)),
             (q, k, kc), "Inplace update to inference tensor"),
        ]
        for call, written, error in calls:
            before = [(t.clone(), t._version) for t in written]
            with mode(), pytest.raises(RuntimeError, match=error):
                call()
            assert all(torch.equal(t, d) and t._version == n
                       for t, (d, n) in zip(written, before)), (mode.__name__, error)


def test_out_variant_and_cache_write_refuse_autograd():
    x = torch.randn(4, 2, 16, requires_grad=True)
    with pytest.raises(RuntimeError, match="out=... arguments don't support automatic differentiation"):
        torch.ops.rope.apply.out(x, CACHE[:4, None, :8], CACHE[:4, None, 8:], False, out=torch.empty(4, 2, 16))
    k = torch.randn(4, 1, 16, requires_grad=True)
    with pytest.raises(RuntimeError, match="rope.apply_and_cache_: a serving op, not differentiable"):
        torch.ops.rope.apply_and_cache_(x.detach().clone(), k * 1.0, k.detach(), torch.arange(4), CACHE,
                                        torch.zeros(2, 4, 1, 16), torch.zeros(2, 4, 1, 16), torch.arange(4))


REFERENCE_BACKEND = """
import sys
sys.path.insert(0, {tests!r})
import pytest, rope_ext, test_adversarial as t
assert rope_ext.backend("cpu") == "reference"
for entry in t.IN_PLACE:
    t.test_in_place_op_refuses_to_overwrite_a_tensor_saved_for_backward(entry)
    t.test_in_place_op_gradient_is_the_out_of_place_one(entry)
    t.test_in_place_op_follows_torch_rules_for_leaves_and_inference_tensors(entry)
t.test_raw_ops_bump_version_counters_of_every_written_tensor()
t.test_a_refused_call_moves_no_version_counter()
t.test_out_variant_and_cache_write_refuse_autograd()
for ops in (t.CPU_OPS,):
    t.check_overlaps(ops)
print("OK")
"""


def test_reference_backend_behaves_the_same():
    env = dict(os.environ, ROPE_EXT_BACKEND="reference", PYTHONPATH=ROOT)
    r = subprocess.run([sys.executable, "-c", REFERENCE_BACKEND.format(tests=HERE)], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stdout + r.stderr[-3000:]


# ---- overlapping targets: the native op, the reference and the CUDA host code alike ----

def _sim_apply_(q, k, pos, cache):
    cuda_sim.apply_(q, k, pos, cache)


def _ref_apply_(q, k, pos, cache):
    rope_ext.reference.apply_rope_(q, k, pos, cache)


def _op_apply_(q, k, pos, cache):
    torch.ops.rope.apply_(q, k, pos, cache, False)


CPU_OPS = {"op": _op_apply_, "reference": _ref_apply_}
ALL_OPS = dict(CPU_OPS, cuda_host=_sim_apply_)


def check_overlaps(ops):
    pos = torch.tensor([1, 2, 3, 4])
    for name, apply_ in ops.items():
        expanded = torch.randn(1, 2, 16).expand(4, 2, 16)
        with pytest.raises(RuntimeError, match=f"query: .*{INTERNAL}"):
            apply_(expanded, None, pos, CACHE)
        q = torch.randn(4, 2, 16)
        before = q.clone()
        for k in (q, q[:, :1], q.view(4, 2, 16)[:, 1:]):  # the same memory twice
            with pytest.raises(RuntimeError, match=f"query and key: .*{PARTIAL}"):
                apply_(q, k, pos, CACHE)
            assert torch.equal(q, before), name
        table = torch.cat([CACHE, torch.randn(4, 16)])  # the table inside the written buffer
        with pytest.raises(RuntimeError, match=f"cos_sin_cache and query: .*{PARTIAL}"):
            apply_(table[8:].view(4, 1, 16), None, pos, table)
        # Views of one fused qkv buffer are disjoint: accepted, and rotated once each.
        qkv = torch.randn(4, (4 + 2 + 2) * 16)
        ref = qkv.clone()
        apply_(qkv[:, :64].view(4, 4, 16), qkv[:, 64:96].view(4, 2, 16), pos, CACHE)
        rope_ext.reference.apply_rope_(ref[:, :64].view(4, 4, 16), ref[:, 64:96].view(4, 2, 16), pos, CACHE)
        assert_close(qkv, ref, torch.float32)


def test_overlapping_targets_are_refused_everywhere():
    check_overlaps(ALL_OPS)


@pytest.mark.parametrize("impl", list(ALL_OPS))
def test_positions_that_alias_the_query_are_read_once(impl):
    # positions is an int32 view of query's first column: rotating query rewrites it. The
    # positions checked must be the positions used.
    q = torch.randn(5, 2, 16)
    pos = torch.tensor([1, 5, 2, 7, 3], dtype=torch.int32)
    q[:, 0, 0] = pos.view(torch.float32)
    alias = q.view(torch.int32)[:, 0, 0]
    assert torch.equal(alias, pos)
    want = q.clone()
    rope_ext.reference.apply_rope_(want, None, pos.clone(), CACHE)
    ALL_OPS[impl](q, None, alias, CACHE)
    assert torch.equal(q, want)


# ---- sizes that overflow, shapes that never end ----

BIG = 2**62 + 1


@pytest.mark.parametrize("impl", ["op", "reference", "cuda_host"])
def test_huge_table_size_is_an_error_not_an_overflow(impl):
    c = torch.ones(1).expand(BIG)
    x = torch.randn(4, 16)
    call = {"op": lambda: torch.ops.rope.apply(x, c, c, False),
            "reference": lambda: rope_ext.reference.apply_rope(x, c, c),
            "cuda_host": lambda: cuda_sim.apply(x, c, c)}[impl]
    with pytest.raises(RuntimeError, match=rf"rotary_dim = 2 \* cos.size\(-1\) = {2 * BIG} must be <= head_dim"):
        call()


@pytest.mark.parametrize("impl", ["op", "reference"])
def test_int32_indices_into_tables_and_caches_past_int32(impl):
    # a bound past int32 is compared as it is, not wrapped to int32 (expanded table rows, caches
    # with no kv heads: no memory)
    table = rope_ext.cos_sin_cache(8, 8)[5:6].expand(2**31 + 1, 8)
    pos = torch.tensor([7, 0, 6], dtype=torch.int32)
    rotate = torch.ops.rope.apply_ if impl == "op" else rope_ext.reference.apply_rope_
    want, got = torch.randn(3, 2, 8), None
    got = want.clone()
    rotate(want, None, pos.long(), table)
    rotate(got, None, pos, table)
    assert torch.equal(got, want)
    kc, vc = torch.empty(2**31 + 8, 1, 0, 8), torch.empty(2**31 + 8, 1, 0, 8)
    store = (torch.ops.rope.apply_and_cache_ if impl == "op" else
             rope_ext.reference.apply_and_cache_)
    store(torch.randn(3, 2, 8), torch.randn(3, 0, 8), torch.randn(3, 0, 8), pos.long(),
          rope_ext.cos_sin_cache(8, 8), kc, vc, torch.tensor([5, -1, 0], dtype=torch.int32))


@pytest.mark.parametrize("impl", ["op", "reference"])
@pytest.mark.parametrize("blocks, block_size", [(2**62, 2), (2**61, 5), (2**62, 3)])
def test_cache_of_2_63_slots_or_more_is_an_error(impl, blocks, block_size):
    # slots are indexed in int64: num_blocks * block_size must stay below 2^63 (caches with no
    # kv heads hold no memory); int32 and int64 slot_mapping alike, nothing written
    q, k, v = torch.randn(2, 2, 8), torch.randn(2, 0, 8), torch.randn(2, 0, 8)
    kc, vc = torch.empty(blocks, block_size, 0, 8), torch.empty(blocks, block_size, 0, 8)
    q0 = q.clone()
    for slots in (torch.tensor([0, 5]), torch.tensor([3, -1], dtype=torch.int32)):
        args = (q, k, v, torch.tensor([1, 2]), rope_ext.cos_sin_cache(4, 8), kc, vc, slots)
        call = (torch.ops.rope.apply_and_cache_ if impl == "op" else
                rope_ext.reference.apply_and_cache_)
        with pytest.raises(RuntimeError, match=r"rope.apply_and_cache_: key_cache has 2\^63 "
                                               r"slots or more"):
            call(*args)
        assert torch.equal(q, q0)


@pytest.mark.parametrize("impl", ["op", "reference", "cuda_host"])
@pytest.mark.parametrize("section", [[2**63 - 1, 2**63 - 1, 10], [-1, 5, 4], [2, 3]])
def test_mrope_section_that_overflows_is_an_error(impl, section):
    q = torch.randn(4, 2, 16)
    pos = torch.zeros(3, 4, dtype=torch.int64)
    q0 = q.clone()
    call = {"op": lambda: torch.ops.rope.mrope_(q, None, pos, CACHE, section, False, False),
            "reference": lambda: rope_ext.reference.apply_mrope_(q, None, pos, CACHE, section),
            "cuda_host": lambda: cuda_sim.mrope_(q, None, pos, CACHE, section)}[impl]
    with pytest.raises(RuntimeError, match=r"rope.mrope_: mrope_section"):
        call()
    assert torch.equal(q, q0)


HANG = """
import torch, rope_ext
q = torch.empty(1, 0, 16).expand(2**62, 0, 16)      # no rows at all, 2^62 tokens
pos = torch.zeros(1, dtype=torch.int64).expand(2**62)
rope_ext.apply_rope_(q, None, pos, rope_ext.cos_sin_cache(8, 16))
pos_bad = torch.full((1,), 9, dtype=torch.int64).expand(2**62)
try:
    rope_ext.apply_rope_(q, None, pos_bad, rope_ext.cos_sin_cache(8, 16))
except RuntimeError as e:
    assert "got 9 at flat index 0" in str(e), e
print("DONE")
"""


def test_empty_query_with_huge_token_count_returns_at_once():
    r = subprocess.run([sys.executable, "-c", HANG], cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "DONE" in r.stdout, r.stderr[-2000:]


# ---- position checks on every path, eager and compiled ----

@pytest.mark.parametrize("bad", [-1, 8])
def test_module_rejects_out_of_range_positions_eager_and_compiled(bad):
    mod = rope_ext.RotaryEmbedding(16, max_position=8)
    q = torch.randn(3, 2, 16)
    pos = torch.tensor([0, bad, 2])
    msg = rf"positions must lie in \[0, 8\).*got {bad} at flat index 1"
    with pytest.raises(RuntimeError, match=msg):
        mod(q, None, pos)
    torch._dynamo.reset()
    with pytest.raises(Exception, match=msg):
        torch.compile(mod, fullgraph=True)(q, None, pos)
    q0 = q.clone()
    with pytest.raises(RuntimeError, match=msg):
        mod.forward_(q, None, pos)
    assert torch.equal(q, q0)


# ---- messages and NaN ----

def test_native_messages_carry_no_source_path():
    x = torch.randn(4, 16)
    for call in (lambda: torch.ops.rope.apply(x.long(), x, x, False),
                 lambda: torch.ops.rope.apply_(x[None], None, torch.tensor([9]), CACHE, False),
                 lambda: torch.ops.rope.set_cpu_isa(99)):
        with pytest.raises(RuntimeError) as e:
            call()
        msg = str(e.value)
        assert msg.startswith("rope."), msg
        assert not re.search(r"\.(cpp|h|cu):\d+|/csrc/|check_\w+, ", msg), msg


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_nan_codes_match_the_reference_bit_for_bit(dtype):
    x = torch.randn(8, 2, 64, dtype=dtype)
    x[0, 0, 0], x[1, 1, 5], x[2, 0, 40] = float("nan"), -float("nan"), float("inf")
    cos, sin = CACHE[:8, None, :8].clone(), CACHE[:8, None, 8:].clone()
    cos, sin = torch.cat([cos] * 4, -1), torch.cat([sin] * 4, -1)  # rotary_dim 64
    native = torch.ops.rope.apply(x, cos, sin, False)
    ref = rope_ext.reference.apply_rope(x, cos, sin)
    assert native.isnan().any()
    assert torch.equal(native.view(torch.int16), ref.view(torch.int16))


# ---- sizes past int64 and int32 in the other families, on every path ----

def _empty(*sizes, dtype=torch.float32):
    """A tensor of these sizes holding no element (a 0 dim among them): no memory, any size."""
    return torch.empty(0, dtype=dtype).as_strided(sizes, (1,) * len(sizes))


def _on(impl, op, reference):
    """op on impl's path: the native op, the reference, or the fake kernel (FakeTensorMode)."""
    if impl != "fake":
        return op if impl == "op" else reference

    def call(*args):
        from torch._subclasses.fake_tensor import FakeTensorMode
        with FakeTensorMode(allow_non_fake_inputs=True):
            return op(*args)
    return call


@pytest.mark.parametrize("impl", ["op", "reference", "fake"])
def test_shift_of_a_cache_of_2_63_slots_is_an_error(impl):
    shift = _on(impl, torch.ops.rope.shift_kv_cache_, rope_ext._kv_shift.reference.shift_kv_cache_)
    kc = _empty(2**62, 2, 0, 8)
    for slots in (torch.tensor([0, 5]), torch.empty(0, dtype=torch.long)):
        with pytest.raises(RuntimeError, match=r"rope.shift_kv_cache_: key_cache has 2\^63 slots or more"):
            shift(kc, slots, torch.tensor(1), torch.randn(16, 8))


@pytest.mark.parametrize("impl", ["op", "reference", "fake"])
def test_paged_quantize_sizes_past_int64_are_errors(impl):
    from rope_ext._quant import registrations as quant

    paged = _on(impl, torch.ops.rope.quantize_fp8_append_paged_kv_cache,
                lambda *a: quant.quantize_fp8_append_paged_kv_cache(*a, 1.0, 1.0, False))
    f8, long = torch.float8_e4m3fn, torch.long
    # rope_dim + no_rope_dim past int64 (only empty inputs can have such widths)
    r = 2**62
    with pytest.raises(RuntimeError, match=r"v must have shape \(nnz, num_kv_heads, rope_dim \+ no_rope_dim\) "
                                           r"= \(0, 1, 2\^63 or more\)"):
        paged(_empty(0, 1, r), _empty(0, 1, r), _empty(0, 1, r), _empty(0, 1, r), _empty(0, 1, 2**63 - 1),
              _empty(0, r), torch.empty(0, dtype=long), _empty(0, 1, r, dtype=f8), _empty(0, 1, r, dtype=f8),
              _empty(0, 1, 1, 2**63 - 1, dtype=f8), _empty(0, 1, 1, 2**63 - 1, dtype=f8),
              torch.empty(0, dtype=long), torch.tensor([0]), torch.empty(0, dtype=long),
              torch.empty(0, dtype=long), 1, "NHD")
    # max_pages * page_size entries past int64, refused from the shapes (no kv heads: no memory)
    q, qn = torch.randn(1, 1, 4), torch.randn(1, 1, 4)
    k, kn, v = torch.randn(1, 0, 4), torch.randn(1, 0, 4), torch.randn(1, 0, 8)
    outs = (torch.empty(1, 1, 4, dtype=f8), torch.empty(1, 1, 4, dtype=f8))
    with pytest.raises(RuntimeError, match=r"the caches have 2\^63 entries or more"):
        paged(q, k, qn, kn, v, torch.randn(8, 4), torch.tensor([1]), *outs, _empty(2**62, 2, 0, 8, dtype=f8),
              _empty(2**62, 2, 0, 8, dtype=f8), torch.tensor([0]), torch.tensor([0, 1]), torch.tensor([0]),
              torch.tensor([0]), 2, "NHD")
    if impl == "fake":
        return  # (the positions are data)
    # a request's page count times page_size past int64, shown as such
    with pytest.raises(RuntimeError, match=r"\(kv_indptr\[b \+ 1\] - kv_indptr\[b\]\) \* page_size\) = "
                                           r"\[0, 2\^63 or more\) for request b = 0, got -1 at index 0"):
        paged(q, k, qn, kn, v, torch.randn(8, 4), torch.tensor([1]), *outs, _empty(1, 2**62, 0, 8, dtype=f8),
              _empty(1, 2**62, 0, 8, dtype=f8), torch.zeros(1, dtype=long).expand(4), torch.tensor([0, 4]),
              torch.tensor([0]), torch.tensor([-1]), 2**62, "NHD")


@pytest.mark.parametrize("impl", ["op", "reference"])
def test_fresh_outputs_of_empty_inputs_with_strides_past_int64_are_torchs_error(impl):
    # x has no element, but its contiguous strides would pass int64: torch.empty_like's error
    from rope_ext._qk_norm import reference as qk_reference

    ref, ops = impl == "reference", torch.ops.rope
    x, c = _empty(0, 2**62, 4, 8), torch.zeros(1).expand(4)
    pos, table = _empty(0, 2**62, dtype=torch.long), torch.zeros(4, 4)
    calls = [lambda: (rope_ext.reference.apply_rope if ref else ops.apply)(x, c, c),
             lambda: (rope_ext.reference.apply_rope_backward if ref else ops.apply_backward)(x, c, c),
             lambda: (rope_ext.reference.apply_positions(x, pos, table, table) if ref else
                      ops.apply_positions(x, pos, table, table, False, False, None, False)),
             lambda: (qk_reference.qk_norm_rope if ref else ops.qk_norm_rope)(
                 x, x, torch.ones(8), torch.ones(8), c, c, 1e-6)]
    for call in calls:
        with pytest.raises(RuntimeError, match="Stride calculation overflowed"):
            call()


@pytest.mark.parametrize("impl", ["op", "reference"])
def test_backward_of_an_empty_gradient_reads_a_broadcast_table_as_it_is(impl):
    # the inverse rotation must not materialize cos/sin's 2^61 broadcast rows
    grad, c = _empty(0, 2**62), torch.zeros(1).expand(2**61)
    call = rope_ext.reference.apply_rope_backward if impl == "reference" else torch.ops.rope.apply_backward
    assert call(grad, c, c).shape == (0, 2**62)


@pytest.mark.parametrize("impl", ["op", "reference"])
def test_outputs_of_more_than_64_dims(impl):
    x, c, s = torch.randn(*([1] * 63), 3, 8), torch.randn(4), torch.randn(4)
    call = rope_ext.reference.apply_rope if impl == "reference" else torch.ops.rope.apply
    want = rope_ext.reference.apply_rope(x.reshape(3, 8).double(), c.double(), s.double())
    assert_close(call(x, c, s).reshape(3, 8), want, torch.float32)


def test_int32_indices_against_tables_past_int32_rows_in_the_other_families():
    """int32 positions compared with a bound past 2^31 (expanded tables): the bound is not
    wrapped to int32, which refused every position."""
    from rope_ext._quant import registrations as quant
    from rope_ext.compat import flash_attn, llama

    f8, pos = torch.float8_e4m3fn, torch.tensor([7, 1], dtype=torch.int32)
    qr, kr, qn, kn = (torch.randn(2, 1, 4) for _ in range(4))
    for rows in (2**31, 2**32 + 5):
        table = rope_ext.cos_sin_cache(8, 4)[3:4].expand(rows, 4)
        for quantize in (torch.ops.rope.quantize_fp8, quant.quantize_fp8):
            outs = [torch.empty(2, 1, 4, dtype=f8) for _ in range(4)]
            quantize(qr, kr, qn, kn, table, pos, *outs, 1.0, 1.0, False)
            with pytest.raises(RuntimeError, match=r"pos_ids must lie in \[0, max_position = "
                                                   r"cos_sin_cache.size\(0\) = 5\), got 7 at index 0"):
                quantize(qr, kr, qn, kn, table[:5], pos, *outs, 1.0, 1.0, False)
    freqs = torch.polar(torch.ones(1, 4), torch.full((1, 4), 0.3)).expand(2**31, 4)
    xq, xk = torch.randn(1, 2, 2, 8), torch.randn(1, 2, 1, 8)
    got = llama.apply_rotary_emb(xq, xk, freqs, positions=torch.tensor([[1, 5]], dtype=torch.int32))
    want = llama.apply_rotary_emb(xq, xk, freqs, positions=torch.tensor([[1, 5]]))
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    cos = sin = torch.randn(1, 4).expand(2**31 + 10, 4)
    x = torch.randn(2, 3, 2, 8)
    got = flash_attn.apply_rotary_emb(x, cos, sin, seqlen_offsets=torch.tensor([0, 5], dtype=torch.int32))
    assert torch.equal(got, flash_attn.apply_rotary_emb(x, cos, sin, seqlen_offsets=torch.tensor([0, 5])))
    with pytest.raises(ValueError, match="seqlen_offsets \\+ seqlen must lie within"):
        flash_attn.apply_rotary_emb(x, cos[:6], sin[:6], seqlen_offsets=torch.tensor([0, 5], dtype=torch.int32))
