"""Every bad input raises a clear error that names the argument, and changes nothing."""

import re

import pytest
import torch

import rope_ext

APPLY = {"op": rope_ext.apply_rope, "reference": rope_ext.reference.apply_rope}
INPLACE = {"op": rope_ext.apply_rope_, "reference": rope_ext.reference.apply_rope_}


def _tables(shape=(5, 1, 8)):
    return torch.randn(shape), torch.randn(shape)


@pytest.mark.parametrize("impl", APPLY)
@pytest.mark.parametrize("case,match", [
    ("int_x", r"x must be float16, bfloat16, float32 or float64, got Long"),
    ("int_cos", r"cos must be float16, bfloat16, float32 or float64"),
    ("shape_mismatch", r"cos and sin must have the same shape"),
    ("dtype_mismatch", r"cos and sin must have the same dtype"),
    ("no_broadcast", r"cos and sin of shape \[4, 1, 8\] must broadcast to x.shape"),
    ("too_many_dims", r"cos and sin of shape .* must broadcast"),
    ("rotary_too_big", r"rotary_dim = 2 \* cos.size\(-1\) = 18 must be <= head_dim = x.size\(-1\) = 16"),
    ("device", r"cos must be on the same device as x"),
])
def test_apply_rejects(impl, case, match):
    x = torch.randn(5, 3, 16)
    cos, sin = _tables()
    if case == "int_x":
        x = x.long()
    elif case == "int_cos":
        cos = cos.long()
    elif case == "shape_mismatch":
        sin = sin[:4]
    elif case == "dtype_mismatch":
        sin = sin.double()
    elif case == "no_broadcast":
        cos, sin = _tables((4, 1, 8))
    elif case == "too_many_dims":
        cos, sin = _tables((2, 5, 3, 8))
    elif case == "rotary_too_big":
        cos, sin = _tables((5, 1, 9))
    elif case == "device":
        cos = cos.to("meta")
    with pytest.raises(RuntimeError, match=match):
        APPLY[impl](x, cos, sin)


def _inplace_args():
    q = torch.randn(6, 4, 32)
    k = torch.randn(6, 2, 32)
    pos = torch.randint(0, 10, (6,))
    cache = rope_ext.cos_sin_cache(10, 32)
    return q, k, pos, cache


@pytest.mark.parametrize("impl", INPLACE)
@pytest.mark.parametrize("case,match", [
    ("int_query", r"query must be float16, bfloat16, float32 or float64"),
    ("query_1d", r"query must have shape \(\.\.\., num_heads, head_dim\)"),
    ("key_dtype", r"key must have the dtype of query"),
    ("key_lead", r"key must have shape \(\.\.\., num_kv_heads, head_dim\) with the leading dims"),
    ("key_head_dim", r"key must have shape"),
    ("float_positions", r"positions must be int32 or int64, got Float"),
    ("positions_shape", r"positions must have shape query.shape\[:-2\]"),
    ("positions_high", r"positions must lie in \[0, 10\) .* got 10 at flat index 3"),
    ("positions_negative", r"positions must lie in \[0, 10\) .* got -1 at flat index 5"),
    ("cache_dims", r"cos_sin_cache must have shape \(max_position, rotary_dim\)"),
    ("cache_int", r"cos_sin_cache must be float16, bfloat16, float32 or float64"),
    ("rotary_odd", r"rotary_dim = cos_sin_cache.size\(1\) = 31 must be even and <= head_dim = 32"),
    ("rotary_too_big", r"rotary_dim = cos_sin_cache.size\(1\) = 34 must be even"),
    ("device", r"positions must be on the same device as query"),
])
def test_apply_inplace_rejects_and_changes_nothing(impl, case, match):
    q, k, pos, cache = _inplace_args()
    if case == "int_query":
        q = q.long()
        k = k.long()
    elif case == "query_1d":
        q = q[0, 0]
    elif case == "key_dtype":
        k = k.double()
    elif case == "key_lead":
        k = k[:5]
    elif case == "key_head_dim":
        k = k[..., :16]
    elif case == "float_positions":
        pos = pos.float()
    elif case == "positions_shape":
        pos = pos[:5]
    elif case == "positions_high":
        pos[3] = 10
    elif case == "positions_negative":
        pos[5] = -1
    elif case == "cache_dims":
        cache = cache[None]
    elif case == "cache_int":
        cache = cache.long()
    elif case == "rotary_odd":
        cache = cache[:, :31]
    elif case == "rotary_too_big":
        cache = torch.randn(10, 34)
    elif case == "device":
        pos = pos.to("meta")
    q0, k0 = q.clone(), k.clone()
    with pytest.raises(RuntimeError, match=match):
        INPLACE[impl](q, k, pos, cache)
    assert torch.equal(q, q0) and torch.equal(k, k0)


@pytest.mark.parametrize("impl", INPLACE)
def test_bad_position_late_in_a_large_batch_changes_nothing(impl):
    # The bad position sits after many good ones: no token may be rotated before the check.
    q = torch.randn(5000, 2, 64)
    k = torch.randn(5000, 1, 64)
    pos = torch.randint(0, 100, (5000,))
    pos[-1] = 100
    q0, k0 = q.clone(), k.clone()
    with pytest.raises(RuntimeError, match="positions must lie in"):
        INPLACE[impl](q, k, pos, rope_ext.cos_sin_cache(100, 64))
    assert torch.equal(q, q0) and torch.equal(k, k0)


def test_cos_sin_cache_rejects_bad_arguments():
    for bad in (0, 7.0, True):  # an odd int is transformers' rule (test_reproducers.py)
        with pytest.raises(ValueError, match=f"rotary_dim must be a positive int, got {bad!r}"):
            rope_ext.cos_sin_cache(10, bad)
    with pytest.raises(ValueError, match="max_position must be a positive int"):
        rope_ext.cos_sin_cache(0, 8)
    with pytest.raises(ValueError, match="base must be > 0"):
        rope_ext.cos_sin_cache(10, 8, base=-1.0)
    for dtype in (torch.int32, torch.int64, torch.bool, torch.complex64, torch.float8_e4m3fn):
        with pytest.raises(ValueError, match=f"cos_sin_cache: dtype must be torch.float16, "
                                             f"torch.bfloat16, torch.float32 or torch.float64, got {dtype}"):
            rope_ext.cos_sin_cache(10, 8, dtype=dtype)
        with pytest.raises(ValueError, match="multi_axis_cos_sin: dtype must be"):
            rope_ext.tables.multi_axis_cos_sin(torch.zeros(2, 1), [8], dtype=dtype)


# Dtypes no op takes (the native library reads a tensor's dtype through a table of the ones it
# does; any other takes the stable ABI's own lookup, which has no name for the last three): a
# clear error on both paths, in every argument role, never a crash, the dtype named alike.
ODD_DTYPES = [torch.bool, torch.int8, torch.int16, torch.uint16, torch.complex64,
              torch.float8_e4m3fnuz, torch.uint32, torch.complex32, torch.float8_e8m0fnu,
              torch.float4_e2m1fn_x2, torch.bits8]


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.parametrize("dtype", ODD_DTYPES)
@pytest.mark.parametrize("impl", ["op", "reference"])
def test_dtypes_no_op_takes_are_named_in_every_role(dtype, impl):
    ref = impl == "reference"
    q, pos = torch.randn(2, 3, 8), torch.zeros(2, dtype=torch.long)
    cache = rope_ext.cos_sin_cache(16, 8)
    odd = lambda t: torch.empty(t.shape, dtype=dtype)  # noqa: E731
    apply_ = rope_ext.reference.apply_rope_ if ref else torch.ops.rope.apply_
    named = re.escape(rope_ext._checks.dtype_name(dtype))
    for args, name in (((odd(q), None, pos, cache), "query"),
                       ((q, None, odd(pos), cache), "positions"),
                       ((q, None, pos, odd(cache)), "cos_sin_cache")):
        with pytest.raises(RuntimeError, match=rf"rope.apply_: {name} must be .*got {named}$"):
            apply_(*args)
    kc, vc = torch.zeros(2, 4, 3, 8), torch.zeros(2, 4, 3, 8)
    cache_op = rope_ext.reference.apply_and_cache_ if ref else torch.ops.rope.apply_and_cache_
    with pytest.raises(RuntimeError, match=r"rope.apply_and_cache_: slot_mapping must be .*got"):
        cache_op(q, q.clone(), q.clone(), pos, cache, kc, vc, odd(pos))


MROPE_BAD = [([2.0, 3, 3], False, r"mrope_section must hold ints, got \[2.0, 3, 3\]"),
             (["2", "3", "3"], True, r"mrope_section must hold ints"),
             (None, True, r"mrope_interleaved=True needs mrope_section")]


@pytest.mark.parametrize("fn,section,interleaved,match", [
    (fn, *bad) for fn in ["apply_mrope_", "apply_rope_at", "qk_norm_rope_", "qkv_norm_rope_",
                          "qk_norm_rope_and_cache_"]
    for bad in MROPE_BAD if not (fn == "apply_mrope_" and bad[0] is None)])  # its section is required
def test_mrope_arguments_that_would_be_truncated_or_ignored_are_refused(fn, section, interleaved,
                                                                        match):
    q, k, v = torch.randn(3, 4, 16), torch.randn(3, 2, 16), torch.randn(3, 2, 16)
    w, cache = torch.ones(16), rope_ext.cos_sin_cache(8, 16)
    pos = torch.zeros(3, 3, dtype=torch.long) if section is not None else torch.zeros(3, dtype=torch.long)
    kw = dict(mrope_section=section, mrope_interleaved=interleaved)
    before = q.clone()
    calls = {
        "apply_mrope_": lambda: rope_ext.apply_mrope_(q, k, pos, cache, section,
                                                      mrope_interleaved=interleaved),
        "apply_rope_at": lambda: rope_ext.apply_rope_at(q, pos, cache, **kw),
        "qk_norm_rope_": lambda: rope_ext.qk_norm_rope_(q, k, w, w, pos, cache, **kw),
        "qkv_norm_rope_": lambda: rope_ext.qkv_norm_rope_(torch.cat((q, k, v), 1).flatten(1), 4, 2, 2,
                                                          16, w, w, pos, cache, **kw),
        "qk_norm_rope_and_cache_": lambda: rope_ext.qk_norm_rope_and_cache_(
            q, k, v, pos, cache, w, w, torch.zeros(2, 4, 2, 16), torch.zeros(2, 4, 2, 16),
            torch.arange(3), **kw),
    }
    with pytest.raises(ValueError, match=match):
        calls[fn]()
    assert torch.equal(q, before)


def _with_config(module, config):
    module.config = config
    return module


def test_arguments_of_the_wrong_kind_are_named():
    # Each once raised an incidental AttributeError / TypeError / KeyError from inside a wrapper
    # (a list for a tensor, a dict key that cannot be hashed, a None where a tuple is read).
    from types import SimpleNamespace

    from rope_ext.compat import diffusers, flashinfer, sglang, vllm
    from rope_ext.integrations import transformers as hf_patch
    q, k, pos = torch.randn(3, 2, 8), torch.randn(3, 1, 8), torch.arange(3)
    w, cos = torch.ones(8), torch.randn(3, 8)
    module = rope_ext.RotaryEmbedding(8, max_position=16, mrope_section=[2, 1, 1])
    f8 = torch.float8_e4m3fn
    kv = dict(k_buffer=torch.zeros(8, 8, dtype=f8), v_buffer=torch.zeros(8, 8, dtype=f8),
              cache_loc=torch.arange(3), value=torch.randn(3, 8), v_scale=None)
    cases = {
        "cos and sin must be tensors": lambda: rope_ext.qk_norm_rope(q[None], k[None], w, w, None, cos),
        "apply_rope\\(\\): out must be a tensor, got list": lambda: rope_ext.apply_rope(
            q, cos[:, None, :4], cos[:, None, :4], out=[1]),
        "RotaryEmbedding: query must be a tensor or None, got list": lambda: module(q.tolist(), k, pos),
        "rope.norm_rope: query must be a tensor": lambda: rope_ext.norm_rope(
            None, k[None], None, None, cos, cos, norm="rms_across_heads", head_first=True),
        "`use_real_unbind_dim=\\[1\\]` but should be -1 or -2": lambda: diffusers.apply_rotary_emb(
            q[None], (cos, cos), use_real_unbind_dim=[1]),
        "`sequence_dim=\\[2\\]` but should be 1 or 2": lambda: diffusers.apply_rotary_emb(
            q[None], (cos, cos), sequence_dim=[2]),
        "quantize_dtype must be a torch.dtype": lambda: flashinfer.rope_quantize_fp8(
            q, k, q, k, rope_ext.cos_sin_cache(8, 8), pos, quantize_dtype="fp8"),
        "paged_kv_cache must be a tuple of 2 tensors": lambda: flashinfer.rope_quantize_fp8_append_paged_kv_cache(
            q, k, q, k, k, rope_ext.cos_sin_cache(8, 8), pos, None, pos, pos, pos, pos),
        "k_scale must be a float, got 'x'": lambda: sglang.apply_rope_with_cos_sin_cache_inplace(
            pos, q.flatten(1), k.flatten(1), 8, rope_ext.cos_sin_cache(8, 8),
            fused_set_kv_buffer_arg=sglang.FusedSetKVBufferArg(k_scale="x", **kv)),
        # (each written tensor of an in-place call is read for torch's inference-tensor rule
        # first: a number there is the op's error, naming it)
        "argument 'query' but instead found type 'int'": lambda: rope_ext.apply_mrope_(
            3, None, torch.stack([pos] * 3), rope_ext.cos_sin_cache(8, 8), [1, 1, 2]),
        "for argument 'key' but instead found type 'list'": lambda: rope_ext.apply_mrope_(
            q.clone(), [1], torch.stack([pos] * 3), rope_ext.cos_sin_cache(8, 8), [1, 1, 2]),
        "argument 'key_cache' but instead found type 'list'": lambda: rope_ext.shift_kv_cache_(
            [1], pos, 1, rope_ext.cos_sin_cache(8, 8)),
        "argument 'value_cache' but instead found type 'int'": lambda: rope_ext.apply_rope_and_cache_(
            q.clone(), k.clone(), k.clone(), pos, rope_ext.cos_sin_cache(8, 8), torch.zeros(2, 2, 1, 8),
            7, pos),
        "argument 'x' but instead found type 'int'": lambda: rope_ext.apply_rope(
            3, cos[:, None, :4], cos[:, None, :4], out=torch.empty(3)),
        "query must be a dense \\(strided\\) tensor, got int": lambda: rope_ext.apply_rope_(
            3, None, pos, rope_ext.cos_sin_cache(8, 8), head_size=8),
        "query must be a dense \\(strided\\) tensor, got layout torch.sparse_coo": lambda: rope_ext.apply_rope_(
            q.flatten(1).to_sparse(), None, pos, rope_ext.cos_sin_cache(8, 8), head_size=8),
        # (each once failed inside the first torch op to view it, naming no argument)
        "cos must be a dense \\(strided\\) tensor, got layout torch.sparse_coo": lambda: rope_ext.qk_norm_rope(
            q[None], k[None], w, w, cos[None].to_sparse(), cos[None]),
        "sin must be a dense \\(strided\\) tensor, got layout torch.sparse_coo": lambda: rope_ext.norm_rope(
            q[None], k[None], w, w, cos[None], cos[None].to_sparse()),
        "cu_seqlens must be a dense \\(strided\\) tensor": lambda: rope_ext.varlen_positions(
            torch.tensor([0, 1, 3]).to_sparse(), 3),
        "^query must be a dense \\(strided\\) tensor, got layout torch.sparse_coo": lambda: vllm.rotary_embedding(
            pos, q.flatten(1).to_sparse(), k.flatten(1), 8, rope_ext.cos_sin_cache(8, 8), True),
        "^key must be a dense \\(strided\\) tensor, got layout torch._mkldnn": lambda: vllm.rotary_embedding(
            pos, q.flatten(1), k.flatten(1).to_mkldnn(), 8, rope_ext.cos_sin_cache(8, 8), True),
        "pos_ids must be a dense \\(strided\\) tensor": lambda: flashinfer.apply_rope_pos_ids(
            q, k, pos.to_sparse()),
        "eps must be a float, got tensor": lambda: rope_ext.qk_norm_rope_(
            q.clone(), k.clone(), w, w, pos, rope_ext.cos_sin_cache(8, 8), eps=torch.ones(2)),
        "qkv_norm_rope_: num_heads_k must be an int, got True": lambda: rope_ext.qkv_norm_rope_(
            torch.randn(3, 32), 2, True, True, 8, w, w, pos, rope_ext.cos_sin_cache(8, 8)),
        "RotaryEmbedding, rotating key \\(the op's x\\): .*x must be float16": lambda: rope_ext.RotaryEmbedding(
            8, max_position=16)(q, k.long(), pos),
        "q_rope_out must be a tensor, got int": lambda: flashinfer.rope_quantize_fp8(
            q, k, None, None, rope_ext.cos_sin_cache(8, 8), pos, q_rope_out=3),
        "k_rope must be a tensor, got ndarray": lambda: flashinfer.rope_quantize_fp8_append_paged_kv_cache(
            q, k.numpy(), None, None, k, rope_ext.cos_sin_cache(8, 8), pos, None, pos, pos, pos, pos),
        "cos_sin_cache: max_position must fit in int64": lambda: rope_ext.cos_sin_cache(2**64, 8),
        "cos_sin_cache: a table of max_position x rotary_dim = .* is larger than a tensor can hold":
            lambda: rope_ext.cos_sin_cache(2**62, 8),
        "total_tokens must fit in int64": lambda: rope_ext.varlen_positions(pos, 2**63),
        # (plain ints take a fast path past the check: it must still bound them)
        "qkv_norm_rope_: num_heads_k must fit in int64": lambda: rope_ext.qkv_norm_rope_(
            torch.randn(3, 32), 2, 2**64, 1, 8, w, w, pos, rope_ext.cos_sin_cache(8, 8)),
        "rope_dim_offset must fit in int64": lambda: rope_ext.apply_rope_(
            q, k, pos, rope_ext.cos_sin_cache(8, 8), rope_dim_offset=-2**63 - 1),
        "num_kv_heads must fit in int64": lambda: vllm.fused_qknorm_rope_cache(
            torch.randn(3, 32), w, w, rope_ext.cos_sin_cache(8, 8), pos, pos, torch.zeros(2, 2, 1, 8),
            torch.zeros(2, 2, 1, 8), 2, 2**64, 8, 8, 1e-6),
        "unpatch: expected a torch.nn.Module, got NoneType": lambda: hf_patch.unpatch(None),
        "is_patched: expected a torch.nn.Module, got NoneType": lambda: hf_patch.is_patched(None),
        "patch: expected a torch.nn.Module, got SimpleNamespace": lambda: hf_patch.patch(
            SimpleNamespace(config=SimpleNamespace(model_type="llama"))),
        "config.model_type must be a string, got \\['llama'\\]": lambda: hf_patch.patch(
            _with_config(torch.nn.Linear(2, 2), SimpleNamespace(model_type=["llama"]))),
    }
    for match, call in cases.items():
        before = (q.clone(), k.clone())
        with pytest.raises((ValueError, TypeError, RuntimeError), match=match):
            call()
        assert torch.equal(q, before[0]) and torch.equal(k, before[1]), match


def _mrope_interleaved_without_section():
    """Each op that takes mrope_interleaved beside an optional mrope_section, given the first
    alone: (the native op's call, the reference's call) on fresh tensors."""
    from rope_ext._qk_norm import reference as qk_reference

    ref, ops = rope_ext.reference, torch.ops.rope
    cache = rope_ext.cos_sin_cache(16, 16)
    cos, sin = cache[:, :8], cache[:, 8:]
    pos, slots, w = torch.arange(3), torch.arange(3), torch.ones(16)

    def qkv():
        return torch.randn(3, 4, 16), torch.randn(3, 2, 16), torch.randn(3, 2, 16)

    def caches():
        return torch.zeros(2, 4, 2, 16), torch.zeros(2, 4, 2, 16)

    return {
        "apply_positions": (
            lambda: ops.apply_positions(qkv()[0], pos, cos, sin, False, False, None, True),
            lambda: ref.apply_positions(qkv()[0], pos, cos, sin, mrope_interleaved=True)),
        "apply_positions.cache": (
            lambda: ops.apply_positions.cache(qkv()[0], pos, cache, False, False, None, True),
            lambda: ref.apply_positions_cache(qkv()[0], pos, cache, mrope_interleaved=True)),
        "qk_norm_rope_": (
            lambda: ops.qk_norm_rope_(*qkv()[:2], w, w, pos, cache, 1e-6, mrope_interleaved=True),
            lambda: qk_reference.qk_norm_rope_(*qkv()[:2], w, w, pos, cache, 1e-6,
                                               mrope_interleaved=True)),
        "qkv_norm_rope_": (
            lambda: ops.qkv_norm_rope_(torch.randn(3, 8 * 16), 4, 2, 2, 16, w, w, pos, cache, 1e-6,
                                       mrope_interleaved=True),
            lambda: qk_reference.qkv_norm_rope_(torch.randn(3, 8 * 16), 4, 2, 2, 16, w, w, pos,
                                                cache, 1e-6, mrope_interleaved=True)),
        "qk_norm_rope_and_cache_": (
            lambda: ops.qk_norm_rope_and_cache_(*qkv(), pos, cache, w, w, *caches(), slots, 1e-6,
                                                mrope_interleaved=True),
            lambda: qk_reference.qk_norm_rope_and_cache_(*qkv(), pos, cache, w, w, *caches(),
                                                         slots, 1e-6, mrope_interleaved=True)),
        "qk_norm_rope_and_cache": (
            lambda: ops.qk_norm_rope_and_cache(*qkv(), pos, cache, w, w, *caches(), slots, 1e-6,
                                               mrope_interleaved=True),
            lambda: qk_reference.qk_norm_rope_and_cache(*qkv(), pos, cache, w, w, *caches(),
                                                        slots, 1e-6, mrope_interleaved=True)),
    }


@pytest.mark.parametrize("name", list(_mrope_interleaved_without_section()))
def test_mrope_interleaved_without_a_section_is_refused_by_every_op(name):
    """A flag that would be ignored is refused, by the op and its reference with one message
    (the public functions raise a ValueError of their own before the op)."""
    native, reference = _mrope_interleaved_without_section()[name]
    message = f"rope.{name}: mrope_interleaved=True needs mrope_section"
    for call in (native, reference):
        with pytest.raises(RuntimeError, match=re.escape(message)):
            call()
