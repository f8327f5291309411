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
