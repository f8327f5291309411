"""The ops' call path: no Python between the caller and the kernel when nothing is recorded
(no_grad, inference_mode), torch's in-place bookkeeping kept there, and under autograd
torch's in-place errors raised before any tensor of the call is written, on every entry point."""

import re
import sys

import pytest
import torch

import rope_ext
from conftest import assert_close, native_cpu
from rope_ext._registrations import routed
from rope_ext.compat import flash_attn, flashinfer, sglang, vllm

# The C++ call path (csrc/ops/router.cpp) serves torch >= 2.13; below it the Python kernels do.
needs_routes = pytest.mark.skipif(not (native_cpu() and routed("apply_")),
                                  reason="the native library's C++ call path is not registered")

CACHE = rope_ext.cos_sin_cache(64, 16)
OPS = torch.ops.rope
F64 = torch.float64


def python_frames(fn):
    """The Python functions a call runs, once warmed up."""
    fn()
    seen = []

    def profile(frame, event, arg):
        if event == "call":
            seen.append(f"{frame.f_code.co_filename}:{frame.f_code.co_name}")

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return seen


@needs_routes
@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_ops_run_no_python_when_nothing_is_recorded(mode):
    table = CACHE.clone()  # a normal tensor, as a model's buffer is, whatever the mode
    with mode():
        q, k = torch.randn(3, 4, 16), torch.randn(3, 2, 16)
        pos = torch.tensor([5, 0, 63])
        kc, vc = torch.zeros(2, 4, 2, 16), torch.zeros(2, 4, 2, 16)
        calls = {
            "apply_": lambda: OPS.apply_(q, k, pos, table),
            "mrope_": lambda: OPS.mrope_(q, k, pos.expand(3, 3), table, [4, 2, 2]),
            "apply.out": lambda: OPS.apply.out(q, table[:3, None, :8], table[:3, None, 8:],
                                               out=torch.empty_like(q)),
            "apply_and_cache_": lambda: OPS.apply_and_cache_(q, k, k.clone(), pos, table, kc, vc,
                                                             torch.tensor([0, 5, -1])),
            "apply": lambda: OPS.apply(q, table[:3, None, :8], table[:3, None, 8:]),
            "apply_backward": lambda: OPS.apply_backward(q, table[:3, None, :8], table[:3, None, 8:]),
            "apply_positions": lambda: OPS.apply_positions(q, pos, table[:, :8], table[:, 8:]),
        }
        for name, call in calls.items():
            frames = [f for f in python_frames(call) if not f.endswith(":<lambda>")]
            # torch.ops' own __call__, nothing of rope_ext's
            assert all("rope_ext" not in f for f in frames), (name, frames)
            assert len(frames) <= 1, (name, frames)


def test_version_counters_move_and_inference_tensors_are_refused_without_grad_mode():
    base = torch.randn(3, 6, 16)
    q, k = base[:, :4], base[:, 4:]  # views of one buffer share its version counter
    with torch.no_grad():
        v = base._version
        OPS.apply_(q, k, torch.tensor([1, 2, 3]), CACHE)
        assert base._version >= v + 2
    normal = torch.randn(3, 4, 16)
    with torch.inference_mode():
        v = normal._version
        OPS.apply_(normal, None, torch.tensor([1, 2, 3]), CACHE)
        assert normal._version > v  # torch bumps a normal tensor written in inference mode
        inf = torch.randn(3, 4, 16)
    before = inf.clone()
    with torch.no_grad(), pytest.raises(RuntimeError, match="Inplace update to inference tensor"):
        OPS.apply_(inf, None, torch.tensor([1, 2, 3]), CACHE)
    assert torch.equal(inf, before)


# ---- under autograd: torch's in-place errors before anything is written ----

LEAF = "^a leaf Variable that requires grad is being used in an in-place operation"  # torch's
VIEW_OF_LEAF = "a view of a leaf Variable that requires grad is being used in an in-place operation"
MULTI_VIEW = "This view is the output of a function that returns multiple views"


def _targets():
    """(name, query, key, message): a call whose key (or query) torch refuses to write in place,
    beside a query that it would accept."""
    leaf = torch.randn(4, 2, 16, requires_grad=True)
    base = torch.randn(4, 4, 16, requires_grad=True)
    inner = base * 1.0
    fine = torch.randn(4, 2, 16, requires_grad=True) * 1.0
    return [
        ("leaf key", fine, leaf, LEAF),
        ("leaf query", leaf, fine, LEAF),
        ("Parameter query", torch.nn.Parameter(torch.randn(4, 2, 16)), fine, LEAF),
        ("view of a leaf", fine, base[:, :2], VIEW_OF_LEAF),
        ("split view", fine, inner.split(2, dim=1)[1], MULTI_VIEW),
        ("unbind view", fine, inner.view(4, 2, 2, 16).unbind(1)[1], MULTI_VIEW),
    ]


def _flat(t):
    return t.flatten(-2)


ENTRIES = {
    "apply_rope_": lambda q, k, pos: rope_ext.apply_rope_(q, k, pos, CACHE),
    "apply_mrope_": lambda q, k, pos: rope_ext.apply_mrope_(q, k, pos.expand(3, 4), CACHE, [4, 2, 2]),
    "forward_": lambda q, k, pos: rope_ext.RotaryEmbedding(16, max_position=64).forward_(q, k, pos),
    "ops.apply_": lambda q, k, pos: OPS.apply_(q, k, pos, CACHE),
    "ops.mrope_": lambda q, k, pos: OPS.mrope_(q, k, pos.expand(3, 4), CACHE, [4, 2, 2]),
    "vllm": lambda q, k, pos: vllm.rotary_embedding(pos, q, k, 16, CACHE, True),
    "flashinfer": lambda q, k, pos: flashinfer.apply_rope_with_cos_sin_cache_inplace(
        pos, q, k, 16, CACHE),
    "sglang": lambda q, k, pos: sglang.apply_rope_with_cos_sin_cache_inplace(pos, q, k, 16, CACHE),
}


def _state(*tensors):
    """What a refused call must leave as it was: values, versions and autograd histories."""
    return [(t.detach().clone(), t._version, t.grad_fn) for t in tensors]


def _same_state(before, *tensors):
    return all(torch.equal(t.detach(), v) and t._version == n and t.grad_fn is g
               for t, (v, n, g) in zip(tensors, before))


@pytest.mark.parametrize("entry", ENTRIES)
def test_refused_in_place_call_writes_nothing(entry):
    pos = torch.tensor([3, 0, 9, 63])
    for name, q, k, message in _targets():
        before = _state(q, k)
        with pytest.raises(RuntimeError, match=message):
            ENTRIES[entry](q, k, pos)
        # the tensor torch accepts is not recorded either: its gradient stays the identity
        assert _same_state(before, q, k), name


@pytest.mark.parametrize("entry", ["apply_rope_", "apply_mrope_", "ops.apply_", "ops.mrope_"])
@pytest.mark.parametrize("fault", ["position out of range", "inference table",
                                   "inference positions", "no_grad view", "leaf key"])
def test_refused_call_under_autograd_leaves_history_and_gradient(entry, fault):
    w = torch.randn(4, 2, 16, requires_grad=True)
    q, k = w * 1.0, torch.randn(4, 1, 16)
    pos, table = torch.tensor([3, 0, 9, 63]), CACHE
    message = None
    if fault == "position out of range":
        pos = torch.tensor([3, 0, 64, 1])
        message = r"positions must lie in \[0, 64\)"
    elif fault == "inference table":
        with torch.inference_mode():
            table = CACHE.clone()
    elif fault == "inference positions":
        with torch.inference_mode():
            pos = pos.clone()
    elif fault == "no_grad view":
        with torch.no_grad():
            q = q[:, :2]  # a view of w * 1.0, made in no_grad: torch refuses to write it
    else:
        k = torch.randn(4, 1, 16, requires_grad=True)
    if message is None:  # torch's own words for the same fault on its own in-place op
        with pytest.raises(RuntimeError) as torch_error:
            (k if fault == "leaf key" else q).mul_(table[:4, None, :16] if "table" in fault else
                                                   pos[:, None, None] if "positions" in fault else 2)
        message = re.escape(str(torch_error.value).split("\n")[0])
    before = _state(q, k)
    calls = {
        "apply_rope_": lambda: rope_ext.apply_rope_(q, k, pos, table),
        "apply_mrope_": lambda: rope_ext.apply_mrope_(q, k, pos.expand(3, 4), table, [4, 2, 2]),
        "ops.apply_": lambda: OPS.apply_(q, k, pos, table),
        "ops.mrope_": lambda: OPS.mrope_(q, k, pos.expand(3, 4), table, [4, 2, 2]),
    }
    with pytest.raises(RuntimeError, match=message):
        calls[entry]()
    assert _same_state(before, q, k)
    grad = torch.randn(4, 2, 16)
    (q._base if fault == "no_grad view" else q).backward(grad)
    assert torch.equal(w.grad, grad)  # q = w * 1: the identity, not a rotation


@pytest.mark.parametrize("subclass", ["TwoTensor", "torch_function"])
@pytest.mark.parametrize("fault", ["query is key", "position out of range", "inference table", None])
def test_tensor_subclass_under_autograd_refused_by_the_kernel_keeps_its_history(subclass, fault):
    # A tensor subclass skips the Python memory checks (its data is the subclass's own); the
    # kernel refuses on its data. The rotation must not have been recorded by then: a caught
    # error used to leave a rotated gradient behind (q is k) or a backward that failed.
    from torch.testing._internal.two_tensor import TwoTensor

    class FunctionSubclass(torch.Tensor):
        pass

    a = torch.randn(4, 2, 16)
    w = (TwoTensor(a, a.clone()) if subclass == "TwoTensor" else a).requires_grad_()
    q = w * 1.0
    q = q.as_subclass(FunctionSubclass) if subclass == "torch_function" else q
    k = q if fault == "query is key" else None
    pos = torch.tensor([3, 0, 64 if fault == "position out of range" else 9, 1])
    table = CACHE
    if fault == "inference table":  # refused by autograd (cannot be saved), after the kernel
        with torch.inference_mode():
            table = CACHE.clone()
    before = _state(q)
    if fault is None:
        rope_ext.apply_rope_(q, k, pos, table)
        assert q._version == 1 and q.grad_fn is not before[0][2]
        return
    with pytest.raises(RuntimeError, match="query and key|positions must lie in|Inference"):
        rope_ext.apply_rope_(q, k, pos, table)
    assert _same_state(before, q)
    q.sum().backward()
    grad = w.grad.a if subclass == "TwoTensor" else w.grad
    assert torch.equal(grad, torch.ones_like(a))


@pytest.mark.parametrize("entry", ["apply_rope_", "apply_mrope_"])
def test_versions_move_once_under_autograd_and_not_for_a_refused_call(entry):
    q = torch.randn(4, 2, 16, requires_grad=True) * 1.0
    k = torch.randn(4, 1, 16, requires_grad=True) * 1.0
    call = ENTRIES[entry]
    with pytest.raises(RuntimeError, match="positions must lie in"):
        call(q, k, torch.tensor([3, 0, 64, 1]))
    assert (q._version, k._version) == (0, 0)
    call(q, k, torch.tensor([3, 0, 9, 63]))
    assert (q._version, k._version) == (1, 1)  # as torch's q.mul_(c); k.mul_(c)


def test_flash_attn_one_pass_in_place_refuses_a_leaf_before_writing():
    cos, sin = CACHE[:, :8], CACHE[:, 8:]
    x = torch.randn(2, 64, 64, 16, requires_grad=True)  # 2^17 elements: the one-pass path
    assert x.numel() >= flash_attn._ONE_PASS_MIN_ELEMENTS
    before = x.detach().clone()
    with pytest.raises(RuntimeError, match=LEAF):
        flash_attn.apply_rotary_emb(x, cos, sin, inplace=True)
    assert torch.equal(x.detach(), before)


# ---- q and k as views of one fused buffer, with a table that learns ----

@pytest.mark.parametrize("interleaved", [False, True])
def test_views_of_one_qkv_buffer_with_a_learned_table(interleaved):
    qkv = torch.randn(5, 7, 16, dtype=torch.float64, requires_grad=True)
    table = rope_ext.cos_sin_cache(16, 12, dtype=torch.float64).requires_grad_()
    pos = torch.tensor([0, 3, 15, 7, 7])
    grad = torch.randn(5, 7, 16, dtype=torch.float64)

    def in_place(qkv, table):
        buf = qkv * 1.0
        rope_ext.apply_rope_(buf[:, :4], buf[:, 4:6], pos, table, interleaved=interleaved)
        return buf

    def out_of_place(qkv, table):
        rot = rope_ext.apply_rope_at(qkv[:, :6], pos, table, interleaved=interleaved)
        return torch.cat((rot, qkv[:, 6:]), dim=1)

    got = torch.autograd.grad(in_place(qkv, table), (qkv, table), grad)
    want = torch.autograd.grad(out_of_place(qkv, table), (qkv, table), grad)
    for g, w in zip(got, want):
        assert_close(g, w, torch.float64)


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_meta_tensors_take_the_shapes_path(mode):
    # Meta tensors carry no Python key: they reach the C++ call path, whose kernel-only twin
    # serves them with the fake kernels.
    table = CACHE.to("meta")
    with mode():
        q, k = torch.empty(3, 4, 16, device="meta"), torch.empty(3, 2, 16, device="meta")
        pos = torch.arange(3, device="meta")
        OPS.apply_(q, k, pos, table)
        assert OPS.apply_positions(q, pos, table[:, :8], table[:, 8:]).shape == q.shape
        assert OPS.apply(q, table[:3, None, :8], table[:3, None, 8:]).device.type == "meta"
        with pytest.raises(RuntimeError, match="rope.apply_: "):
            OPS.apply_(q, k, pos[:2], table)


def test_meta_tensors_under_autograd_are_shapes_alone():
    # In grad mode with a tensor requiring grad, meta tensors take the autograd path, whose
    # memory checks (null data pointers everywhere) once refused every call as an overlap; and
    # a module's table indexed by meta positions gave uninitialised rows.
    for grad_on in ("query", "table"):
        table = CACHE.to("meta").requires_grad_(grad_on == "table")
        q = torch.empty(3, 4, 16, device="meta", requires_grad=grad_on == "query") * 1
        k, pos = torch.empty(3, 2, 16, device="meta"), torch.arange(3, device="meta")
        rope_ext.apply_rope_(q, k, pos, table)
        rope_ext.apply_mrope_(q, k, torch.stack([pos] * 3), table, [2, 3, 3])
        assert q.requires_grad and q.device.type == "meta" and q.shape == (3, 4, 16)
    module = rope_ext.RotaryEmbedding(16, max_position=8)
    with pytest.raises(RuntimeError, match=r"RotaryEmbedding.cos_sin: positions must be on the "
                                           r"device of the module's table \(cpu\), got meta"):
        module.cos_sin(torch.arange(3, device="meta"))


@needs_routes
def test_public_functions_in_grad_mode_skip_autograd_when_nothing_requires_grad():
    # rope_ext/_call.py: grad mode on, no argument requiring grad -> no Python autograd kernel
    # (the ops' `_grad_` twins), the same results, grad mode on again afterwards, also after an
    # error; with an argument that requires grad the call is recorded as before.
    pos = torch.tensor([1, 5, 9])
    x, cos, sin = torch.randn(3, 4, 16), torch.randn(3, 1, 8), torch.randn(3, 1, 8)
    q, k = torch.randn(3, 4, 16), torch.randn(3, 2, 16)
    twins = ("_grad_", "_impl_")
    frames = python_frames(lambda: (rope_ext.apply_rope(x, cos, sin),
                                    rope_ext.apply_rope_(q, k, pos, CACHE)))
    assert not [f for f in frames if "_registrations.py" in f], frames
    with torch.profiler.profile() as prof:
        got = rope_ext.apply_rope(x, cos, sin)
        v = q._version
        rope_ext.apply_rope_(q, k, pos, CACHE)
    assert q._version > v  # the in-place bookkeeping still runs
    names = {e.key for e in prof.key_averages()}
    assert not {n for n in names if any(t in n for t in twins)}, names
    assert torch.is_grad_enabled() and not got.requires_grad
    assert_close(got, rope_ext.reference.apply_rope(x.double(), cos.double(), sin.double()),
                 torch.float32)
    with pytest.raises(RuntimeError, match="positions must lie in"):
        rope_ext.apply_rope_(q, k, torch.tensor([1, 5, 99]), CACHE)
    assert torch.is_grad_enabled()
    xg = x.clone().requires_grad_()
    out = rope_ext.apply_rope(xg, cos, sin)
    assert out.requires_grad and out.grad_fn is not None


def _vmapped_functions():
    """Public functions over one sample (S, H, D) of float64 x: {name: f}."""
    from rope_ext.compat import transformers as hf

    cos, sin = torch.randn(5, 1, 4, dtype=F64), torch.randn(5, 1, 4, dtype=F64)
    full = (torch.cat([cos, cos], -1)[None, :, 0], torch.cat([sin, sin], -1)[None, :, 0])
    pos, w = torch.randint(0, 64, (5,)), torch.randn(8, dtype=F64)
    rope = rope_ext.RotaryEmbedding(8, max_position=64).double()
    per_head = lambda x: x.transpose(0, 1)[None]  # noqa: E731  (1, H, S, D)
    return {
        "apply_rope": lambda x: rope_ext.apply_rope(x, cos, sin),
        "apply_rope_at": lambda x: rope_ext.apply_rope_at(x, pos, CACHE.double()[:, :8]),
        "qk_norm_rope": lambda x: rope_ext.qk_norm_rope(x[None], x[None], w, w, *full)[0][0],
        "RotaryEmbedding": lambda x: rope(x, None, pos)[0],
        "transformers": lambda x: hf.apply_rotary_pos_emb(per_head(x), per_head(x), *full)[0],
    }


@pytest.mark.parametrize("name", list(_vmapped_functions()))
@pytest.mark.parametrize("transform", ["vmap", "functionalize"])
def test_torch_func_transforms_keep_the_history_of_inputs_that_require_grad(name, transform):
    # vmap's and functionalize's wrappers show no requires_grad of the tensors they wrap: the
    # public call must not take that for "nothing to record" (it switched grad mode off and
    # returned an output without history: the loss below lost the term, with no error).
    f = _vmapped_functions()[name]
    x = torch.randn(3, 5, 2, 8, dtype=F64, requires_grad=True)
    weight = torch.randn_like(x)
    each = torch.stack([f(x[i]) for i in range(3)]).reshape(x.shape)
    want, = torch.autograd.grad((each * weight).sum() + x.sum(), x)
    if transform == "vmap":
        out = torch.vmap(f)(x)
    else:
        out = torch.func.functionalize(lambda x: torch.stack([f(x[i]) for i in range(3)]))(x)
    assert out.requires_grad
    got, = torch.autograd.grad((out.reshape(x.shape) * weight).sum() + x.sum(), x)
    assert torch.equal(got, want)


@pytest.mark.parametrize("paired", [True, False])
def test_vmap_over_the_tables_of_drop_ins_that_compare_pair_members(paired):
    # diffusers' and TE's drop-ins compare the two members of each pair's table entries to take
    # one pass; a vmapped table has no data to compare there (torch.equal has no batching rule):
    # they take the general path, equal to the per-sample loop.
    from rope_ext.compat import diffusers, transformer_engine

    x = torch.randn(1, 2, 5, 8, dtype=F64)
    half = torch.randn(3, 5, 4, dtype=F64)
    angles = half.repeat_interleave(2, -1) if paired else torch.randn(3, 5, 8, dtype=F64)
    calls = {
        "diffusers": lambda a: diffusers.apply_rotary_emb(x, (a.cos(), a.sin())),
        "transformer_engine": lambda a: transformer_engine.apply_rotary_pos_emb(
            x[0].transpose(0, 1)[:, None], a[:, None, None], interleaved=True),
    }
    for name, f in calls.items():
        got = torch.vmap(f)(angles)
        assert torch.equal(got, torch.stack([f(a) for a in angles])), name


def _routed_calls():
    """A valid call of every op that writes an argument, each argument a tensor of its own (so
    each has its own version counter): {name: (op, args, kwargs)}."""
    r, f8 = torch.randn, torch.float8_e4m3fn
    q, k, v = r(3, 4, 16), r(3, 2, 16), r(3, 2, 16)
    pos, slots = torch.tensor([5, 0, 63]), torch.tensor([0, 5, -1])
    wq, wk = r(16), r(16)
    caches = lambda: (torch.zeros(2, 4, 2, 16), torch.zeros(2, 4, 2, 16))  # noqa: E731
    parts = (r(3, 4, 16), r(3, 2, 16), r(3, 4, 8), r(3, 2, 8))  # q/k rope, q/k nope
    outs = tuple(torch.empty(p.shape, dtype=f8) for p in parts)
    fp8_caches = (torch.zeros(2, 4, 2, 24, dtype=f8), torch.zeros(2, 4, 2, 24, dtype=f8))
    pages = (torch.tensor([0, 1]), torch.tensor([0, 2]), torch.tensor([0, 0, 0]),
             torch.tensor([0, 1, 2]))  # kv_indices, kv_indptr, batch_indices, positions
    return {
        "apply.out": (OPS.apply.out, (q, CACHE[:3, None, :8], CACHE[:3, None, 8:]),
                      {"out": torch.empty_like(q)}),
        "apply_": (OPS.apply_, (q, k, pos, CACHE), {}),
        "mrope_": (OPS.mrope_, (q, k, pos.expand(3, 3), CACHE, [4, 2, 2]), {}),
        "apply_and_cache_": (OPS.apply_and_cache_, (q, k, v, pos, CACHE, *caches(), slots), {}),
        "qk_norm_rope_": (OPS.qk_norm_rope_, (q, k, wq, wk, pos, CACHE, 1e-6), {}),
        "qkv_norm_rope_": (OPS.qkv_norm_rope_, (r(3, 8 * 16), 4, 2, 2, 16, wq, wk, pos, CACHE,
                                                1e-6), {}),
        "qk_norm_rope_and_cache_": (OPS.qk_norm_rope_and_cache_, (q, k, v, pos, CACHE, wq, wk,
                                                                  *caches(), slots, 1e-6), {}),
        "qk_norm_rope_and_cache": (OPS.qk_norm_rope_and_cache, (q, k, v, pos, CACHE, wq, wk,
                                                                *caches(), slots, 1e-6), {}),
        "shift_kv_cache_": (OPS.shift_kv_cache_, (torch.randn(2, 4, 2, 16), torch.tensor([0, 5]),
                                                  torch.tensor(1), CACHE), {}),
        "quantize_fp8": (OPS.quantize_fp8, (*parts, CACHE, pos, *outs), {}),
        "quantize_fp8_append_paged_kv_cache": (
            OPS.quantize_fp8_append_paged_kv_cache,
            (*parts, r(3, 2, 24), CACHE, pos, outs[0], outs[2], *fp8_caches, *pages, 4), {}),
    }


@pytest.mark.parametrize("name", list(_routed_calls()))
def test_exactly_the_arguments_the_schema_marks_written_move_their_version(name):
    """The C++ call path reads which arguments an op writes from its schema's `(a!)` annotations
    (csrc/ops/routes.h parses rope_ext/schemas.def): checked here against torch's own parse of the
    registered schema, by the version counter of every tensor argument, in both grad-off modes."""
    op, args, kwargs = _routed_calls()[name]
    schema = getattr(op, "default", op)._schema  # a packet's only overload, or the overload
    written = {a.name for a in schema.arguments
               if a.alias_info is not None and a.alias_info.is_write}
    assert written, name
    for mode in (torch.no_grad, torch.inference_mode):
        op, args, kwargs = _routed_calls()[name]  # fresh tensors: normal ones in both modes
        named = dict(zip([a.name for a in schema.arguments], args)) | kwargs
        tensors = {n: t for n, t in named.items() if isinstance(t, torch.Tensor)}
        before = {n: t._version for n, t in tensors.items()}
        with mode():
            op(*args, **kwargs)
        moved = {n for n, t in tensors.items() if t._version != before[n]}
        assert moved == written, (name, mode.__name__)


@pytest.mark.parametrize("kwargs", [
    {}, {"interleaved": False, "rope_dim_offset": 0, "inverse": False}, {"interleaved": True},
    {"rope_dim_offset": 2, "inverse": True}, {"interleaved": 1, "rope_dim_offset": False}])
def test_public_calls_leave_out_default_keywords_without_changing_the_call(kwargs):
    """The public functions' op calls drop keywords equal to their schema default (_call.py: torch
    parses each keyword given): a value that differs, or has another type, still reaches the op."""
    from rope_ext._call import ops

    table = rope_ext.cos_sin_cache(64, 12)
    q, k, pos = torch.randn(3, 4, 16), torch.randn(3, 2, 16), torch.tensor([5, 0, 63])
    q2, k2 = q.clone(), k.clone()
    ops.apply_(q, k, pos, table, **kwargs)
    OPS.apply_(q2, k2, pos, table, **kwargs)
    assert torch.equal(q, q2) and torch.equal(k, k2)  # (a dropped non-default would differ)


def test_every_keyword_at_its_default_is_the_plain_call_and_a_tensor_for_a_flag_is_torchs_error():
    """The serving prologue passes all eight keywords (the wrapper's fast path: every one its
    default); a tensor where the schema takes a bool still meets torch's own check."""
    from rope_ext._call import ops

    q, k, v = torch.randn(2, 4, 16), torch.randn(2, 2, 16), torch.randn(2, 2, 16)
    w, pos, slots = torch.randn(16), torch.tensor([1, 60]), torch.tensor([0, 5])
    caches = [torch.zeros(2, 4, 2, 16) for _ in range(4)]
    kw = dict(unit_offset=False, interleaved=False, mrope_section=None, mrope_interleaved=False,
              v_norm=False, kv_cache_dtype="auto", k_scale=None, v_scale=None)
    a, b = (q.clone(), k.clone(), v.clone()), (q.clone(), k.clone(), v.clone())
    ops.qk_norm_rope_and_cache_(*a, pos, CACHE, w, w, *caches[:2], slots, 1e-6, **kw)
    OPS.qk_norm_rope_and_cache_(*b, pos, CACHE, w, w, *caches[2:], slots, 1e-6)
    for x, y in zip(a + tuple(caches[:2]), b + tuple(caches[2:])):
        assert torch.equal(x, y)
    for fn in (ops.qk_norm_rope_and_cache_, OPS.qk_norm_rope_and_cache_):
        with pytest.raises(RuntimeError, match="Expected a value of type 'bool' for argument "
                                               "'interleaved'"):
            fn(q, k, v, pos, CACHE, w, w, *caches[:2], slots, 1e-6,
               **(kw | {"interleaved": torch.tensor([True, False])}))


ZERO_CALLS = {  # op, argument given as torch's ZeroTensor (no memory: a null data pointer)
    "apply x": lambda z: OPS.apply(z(4, 2, 16), CACHE[:4, None, :8], CACHE[:4, None, 8:]),
    "apply cos, sin": lambda z: OPS.apply(torch.randn(4, 2, 16), z(4, 1, 8), z(4, 1, 8)),
    "apply_positions table": lambda z: OPS.apply_positions(torch.randn(4, 2, 16), torch.arange(4),
                                                           z(64, 8), z(64, 8)),
    "apply_ positions": lambda z: rope_ext.apply_rope_(torch.randn(4, 2, 16), None,
                                                      z(4, dtype=torch.int64), CACHE)[0],
    "qk_norm_rope_ weight": lambda z: rope_ext.qk_norm_rope_(
        torch.randn(4, 2, 16), torch.randn(4, 1, 16), z(16), torch.ones(16), torch.arange(4), CACHE)[0],
    "apply_and_cache_ value": lambda z: _cache_write(z(4, 1, 16)),
}


def _cache_write(value):
    caches = torch.zeros(2, 2, 4, 1, 16)
    rope_ext.apply_rope_and_cache_(torch.randn(4, 2, 16), torch.randn(4, 1, 16), value,
                                   torch.arange(4), CACHE, caches[0], caches[1], torch.arange(4))
    return caches


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode, torch.enable_grad])
@pytest.mark.parametrize("case", ZERO_CALLS)
def test_a_zero_tensor_reads_as_zeros(case, mode):
    """torch's ZeroTensor (some derivative formulas make one) has no memory: the call gives what
    it gives on materialized zeros, on the CPU as anywhere (the dispatcher's ZeroTensor key
    materializes it; the C++ call path, which skips that key, must not read through null)."""
    seed = torch.seed()
    with mode():
        got = ZERO_CALLS[case](lambda *s, **kw: torch._efficientzerotensor(s, **kw))
    torch.manual_seed(seed)
    with mode():
        want = ZERO_CALLS[case](lambda *s, **kw: torch.zeros(s, **kw))
    assert torch.equal(got, want)


def _refused_calls():
    """([(name, a call the C++ call path refuses before a kernel or the dispatcher takes its
    stack, its grad mode)], the tensors the calls take): each wrapper's refusal, with the
    argument kinds a stack carries (tensors, `Tensor?`, `int[]`, `str`)."""
    q, k, pos = torch.randn(4, 2, 16), torch.randn(4, 1, 16), torch.arange(4)
    kc, vc = torch.zeros(2, 4, 1, 16), torch.zeros(2, 4, 1, 16)
    with torch.inference_mode():
        made_in_inference = torch.randn(4, 2, 16)
    sparse = torch.randn(4, 16).to_sparse()
    return [
        # bump_and_run: torch's inference-tensor rule refuses the write
        ("apply_ inference query", lambda: OPS.apply_(made_in_inference, k, pos, CACHE), False),
        ("mrope_ inference query", lambda: OPS.mrope_(made_in_inference, k, torch.stack([pos] * 3),
                                                       CACHE, [2, 3, 3]), False),
        ("apply_and_cache_ inference query", lambda: OPS.apply_and_cache_(
            made_in_inference, k, k, pos, CACHE, kc, vc, pos, False, "auto"), False),
        # autograd_router and bump_and_run: a tensor not given dense
        ("apply_ sparse key, grad mode", lambda: OPS.apply_(q, sparse, pos, CACHE), True),
        ("apply_ sparse key, no grad", lambda: OPS.apply_(q, sparse, pos, CACHE), False),
        # the kernel's own check (inference mode skips the router): a required tensor missing
        ("apply_and_cache_ no key, inference mode", lambda: _in_inference_mode(
            lambda: OPS.apply_and_cache_(q, None, k, pos, CACHE, kc, vc, pos, False, "auto")), False),
    ], (q, k, pos, kc, vc, made_in_inference, sparse)


def _in_inference_mode(fn):
    with torch.inference_mode():
        fn()


@needs_routes
def test_a_refused_call_keeps_none_of_its_tensors():
    # The boxed stack holds a new handle for each tensor: a wrapper that refuses the call before
    # handing the stack on releases them (each refused call once kept all of its tensors alive).
    calls, tensors = _refused_calls()
    held = [CACHE, *tensors]
    for name, call, grad in calls:
        before = [t._use_count() for t in held]
        for _ in range(3):
            with torch.set_grad_enabled(grad), pytest.raises(RuntimeError):
                call()
        assert [t._use_count() for t in held] == before, name
