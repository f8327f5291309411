"""Scalar arguments (flags, offsets, eps, bases, scales, scaling values, config keys): a value
torch or Python would quietly read as something else (2, None or "false" for a bool, True for an
int, NaN or 0 for a base) is refused with the argument's name, before anything is written; and
values that would give a table of inf or NaN are refused where the table is built."""

import pytest
import torch

import rope_ext
from rope_ext.compat import flash_attn as fa
from rope_ext.compat import flashinfer as fi
from rope_ext.compat import gpt_fast, llama, sglang, vllm
from rope_ext.compat import transformer_engine as te
from rope_ext.compat import transformers as hf


def _inputs():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(4, 2, 16, generator=g), torch.randn(4, 1, 16, generator=g)
    return q, k, torch.arange(4), rope_ext.cos_sin_cache(8, 16), torch.ones(16)


# (call(q, k, pos, cache, w), message): each a value the call must refuse, naming it.
FLAG_CASES = {
    "apply_rope interleaved=None": (
        lambda q, k, p, c, w: rope_ext.apply_rope(q, c[:4, None, :8], c[:4, None, 8:], interleaved=None),
        r"interleaved must be True or False, got None"),
    "apply_rope_ interleaved=2": (
        lambda q, k, p, c, w: rope_ext.apply_rope_(q, k, p, c, interleaved=2),
        r"interleaved must be True or False, got 2"),
    "apply_rope_ inverse='no' (flat)": (
        lambda q, k, p, c, w: rope_ext.apply_rope_(q.flatten(1), None, p, c, head_size=16, inverse="no"),
        r"inverse must be True or False, got 'no'"),
    "apply_rope_ rope_dim_offset=True": (
        lambda q, k, p, c, w: rope_ext.apply_rope_(q, k, p, c, rope_dim_offset=True),
        r"rope_dim_offset must be an int, got True"),
    "apply_rope_ rope_dim_offset=tensor": (
        lambda q, k, p, c, w: rope_ext.apply_rope_(q, k, p, c, rope_dim_offset=torch.tensor(0)),
        r"rope_dim_offset must be an int"),
    "apply_mrope_ mrope_interleaved=2": (
        lambda q, k, p, c, w: rope_ext.apply_mrope_(q, k, torch.stack([p] * 3), c, [2, 3, 3],
                                                   mrope_interleaved=2),
        r"mrope_interleaved must be True or False, got 2"),
    "apply_rope_at interleaved='false'": (
        lambda q, k, p, c, w: rope_ext.apply_rope_at(q, p, c, interleaved="false"),
        r"interleaved must be True or False, got 'false'"),
    "apply_rope_and_cache_ interleaved=None": (
        lambda q, k, p, c, w: rope_ext.apply_rope_and_cache_(
            q, k, torch.randn(4, 1, 16), p, c, torch.zeros(2, 4, 1, 16), torch.zeros(2, 4, 1, 16),
            torch.arange(4), interleaved=None),
        r"interleaved must be True or False, got None"),
    "qk_norm_rope_ eps=True": (
        lambda q, k, p, c, w: rope_ext.qk_norm_rope_(q, k, w, w, p, c, eps=True),
        r"eps must be a float, got True"),
    "qk_norm_rope_ unit_offset=2": (
        lambda q, k, p, c, w: rope_ext.qk_norm_rope_(q, k, w, w, p, c, unit_offset=2),
        r"unit_offset must be True or False, got 2"),
    "qkv_norm_rope_ interleaved=-1": (
        lambda q, k, p, c, w: rope_ext.qkv_norm_rope_(torch.cat((q, k, k), 1).flatten(1), 2, 1, 1, 16,
                                                      w, w, p, c, interleaved=-1),
        r"interleaved must be True or False, got -1"),
    "qk_norm_rope_and_cache_ v_norm=None": (
        lambda q, k, p, c, w: rope_ext.qk_norm_rope_and_cache_(
            q, k, torch.randn(4, 1, 16), p, c, w, w, torch.zeros(2, 4, 1, 16),
            torch.zeros(2, 4, 1, 16), torch.arange(4), v_norm=None),
        r"v_norm must be True or False, got None"),
    "qk_norm_rope head_first='no'": (
        lambda q, k, p, c, w: rope_ext.qk_norm_rope(q[None], k[None], w, w, c[:4].clone(), c[:4].clone(),
                                                    head_first="no"),
        r"head_first must be True or False, got 'no'"),
    "norm_rope eps='1e-6'": (
        lambda q, k, p, c, w: rope_ext.norm_rope(q[None], k[None], w, w, c[:4].clone(), c[:4].clone(),
                                                 eps="1e-6"),
        r"eps must be a float, got '1e-6'"),
    "shift_kv_cache_ interleaved=None": (
        lambda q, k, p, c, w: rope_ext.shift_kv_cache_(k.view(1, 4, 1, 16), torch.tensor([0]), 1, c,
                                                       interleaved=None),
        r"interleaved must be True or False, got None"),
    "vllm is_neox=None": (
        lambda q, k, p, c, w: vllm.rotary_embedding(p, q.flatten(1), k.flatten(1), 16, c, None),
        r"is_neox must be True or False, got None"),
    "vllm rope_dim_offset=True": (
        lambda q, k, p, c, w: vllm.rotary_embedding(p, q.flatten(1), k.flatten(1), 16, c, True,
                                                    rope_dim_offset=True),
        r"rope_dim_offset must be an int, got True"),
    "sglang is_neox='False'": (
        lambda q, k, p, c, w: sglang.apply_rope_with_cos_sin_cache_inplace(
            p, q.flatten(1), k.flatten(1), 16, c, is_neox="False"),
        r"is_neox must be True or False, got 'False'"),
    "flashinfer interleave='no'": (
        lambda q, k, p, c, w: fi.apply_rope_pos_ids_inplace(q, k, p, interleave="no"),
        r"interleave must be True or False, got 'no'"),
    "flash-attn inplace='no'": (
        lambda q, k, p, c, w: fa.apply_rotary_emb(q[None], c[:, :8], c[:, 8:], inplace="no"),
        r"inplace must be True or False, got 'no'"),
    "transformer engine fused='no'": (
        lambda q, k, p, c, w: te.apply_rotary_pos_emb(q[:, None], torch.zeros(4, 1, 1, 16), fused="no"),
        r"fused must be True or False, got 'no'"),
}


def refused_before_any_write(call, match, q, k, *args):
    """call(q, k, *args) raises a ValueError matching `match`, q and k unchanged (data, versions)."""
    before, versions = (q.clone(), k.clone()), (q._version, k._version)
    with pytest.raises(ValueError, match=match):
        call(q, k, *args)
    assert torch.equal(q, before[0]) and torch.equal(k, before[1])
    assert (q._version, k._version) == versions


@pytest.mark.parametrize("case", FLAG_CASES)
def test_flags_and_values_that_torch_would_misread_are_refused_before_any_write(case):
    refused_before_any_write(*FLAG_CASES[case], *_inputs())


def test_flags_take_what_torch_and_the_peers_take_for_a_bool():
    # True/False, NumPy bools and the ints 0 and 1 (torch's bool arguments take them, and the
    # peers' flags), with the results of the equal bool, bit for bit
    np = pytest.importorskip("numpy")
    q, k, pos, cache, w = _inputs()
    want = {flag: rope_ext.apply_rope_at(q, pos, cache, interleaved=flag) for flag in (False, True)}
    for value in (False, True, 0, 1, np.bool_(False), np.bool_(True), 1.0, np.float64(0.0),
                  torch.tensor(True), torch.tensor(0)):
        got = q.clone()
        rope_ext.apply_rope_(got, None, pos, cache, interleaved=value, inverse=False, rope_dim_offset=0)
        assert torch.equal(got, want[bool(value)])
        got = q.clone()
        vllm.rotary_embedding(pos, got.flatten(1), None, 16, cache, not value, inverse=0)
        assert torch.equal(got, want[bool(value)])
        got = q.clone()
        fi.apply_rope_pos_ids_inplace(got, k.clone(), pos, interleave=value)
        assert torch.equal(got, fi.apply_rope_pos_ids(q, k, pos, interleave=bool(value))[0])
        module = rope_ext.RotaryEmbedding(16, max_position=8, interleaved=value)
        assert torch.equal(module(q, None, pos)[0], want[bool(value)])
    # None: the module's default, as a config's rope_scaling.get("mrope_interleaved") gives it
    module = rope_ext.RotaryEmbedding(16, max_position=8, mrope_section=[2, 3, 3], interleaved=None,
                                      mrope_interleaved=None)
    assert module.interleaved is False and module.mrope_interleaved is False


def test_a_traced_flag_is_taken_in_non_strict_export():
    # torch.export (non-strict) traces q.shape[0] >= 2 as a SymBool, which the op takes
    class Rotate(torch.nn.Module):
        def forward(self, q, pos):
            return rope_ext.apply_rope_at(q, pos, rope_ext.cos_sin_cache(8, 16), interleaved=q.shape[0] >= 2)

    q, pos = torch.randn(4, 2, 16), torch.arange(4) % 8
    tokens = torch.export.Dim("tokens", min=2, max=8)
    program = torch.export.export(Rotate(), (q, pos), dynamic_shapes=({0: tokens}, {0: tokens}), strict=False)
    assert torch.equal(program.module()(q, pos), Rotate()(q, pos))


def test_sizes_and_bases_of_the_kinds_callers_pass():
    # a range for the axes, a float head dim for TE's module (TE computes arange(0, dim, 2) / dim)
    pos = torch.randn(3, 2)
    cos, _ = rope_ext.tables.multi_axis_cos_sin(pos, range(4, 8, 2))
    assert torch.equal(cos, rope_ext.tables.multi_axis_cos_sin(pos, [4, 6])[0])
    assert torch.equal(te.RotaryPositionEmbedding(16.0)(8), te.RotaryPositionEmbedding(16)(8))


def test_llama31_values_the_peers_compute_finite_tables_for_are_taken():
    # FlashInfer's blend with low_freq_factor 0 or high < low, gpt-fast's with high <= low (a
    # step function): finite tables, as the peers compute them
    q, k, pos, _, _ = _inputs()
    for low, high in ((0, 4), (4, 2)):
        out = fi.apply_llama31_rope_pos_ids(q, k, pos, low_freq_factor=low, high_freq_factor=high)
        assert all(torch.isfinite(t).all() for t in out)
    scaling = dict(factor=8.0, low_freq_factor=4.0, high_freq_factor=4.0, original_max_position_embeddings=8)
    assert torch.isfinite(gpt_fast.precompute_freqs_cis(16, 8, rope_scaling=scaling).float()).all()


# (call, message) of values that would give a table of NaN or inf, or fail inside arithmetic.
TABLE_CASES = {
    "flashinfer rope_scale=nan": (lambda q, k, p: fi.apply_rope_pos_ids_inplace(q, k, p, rope_scale=float("nan")),
                                  r"rope_scale must be > 0 and finite, got nan"),
    "flashinfer rope_theta=0": (lambda q, k, p: fi.apply_rope_pos_ids_inplace(q, k, p, rope_theta=0),
                                r"rope_theta must be > 0 and finite, got 0"),
    "flashinfer rope_scale='2'": (lambda q, k, p: fi.apply_rope_pos_ids(q, k, p, rope_scale="2"),
                                  r"rope_scale must be > 0 and finite, got '2'"),
    "flashinfer llama31 low=high": (
        lambda q, k, p: fi.apply_llama31_rope_pos_ids_inplace(q, k, p, low_freq_factor=4, high_freq_factor=4),
        r"high_freq_factor must differ from low_freq_factor = 4.0"),
    "flashinfer llama31 old_context_len=inf": (
        lambda q, k, p: fi.apply_llama31_rope_pos_ids_inplace(q, k, p, old_context_len=float("inf")),
        r"old_context_len must be finite, got inf"),
    "llama theta=0": (lambda q, k, p: llama.precompute_freqs_cis(16, 8, theta=0),
                      r"theta must be > 0 and finite, got 0"),
    "gpt-fast base=-1": (lambda q, k, p: gpt_fast.precompute_freqs_cis(8, 16, base=-1),
                         r"base must be > 0 and finite, got -1"),
    "gpt-fast rope_scaling without keys": (
        lambda q, k, p: gpt_fast.precompute_freqs_cis(8, 16, rope_scaling={"factor": 8.0}),
        r"precompute_freqs_cis: rope_scaling needs the key 'low_freq_factor'"),
    "TE rotary_base=0": (lambda q, k, p: te.RotaryPositionEmbedding(16, rotary_base=0),
                         r"rotary_base must be > 0 and finite, got 0"),
    "TE dim=-8": (lambda q, k, p: te.RotaryPositionEmbedding(-8), r"dim must be > 0 and finite, got -8"),
    "multi-axis theta=inf": (
        lambda q, k, p: rope_ext.tables.multi_axis_cos_sin(torch.zeros(3, 2), [4, 4], theta=float("inf")),
        r"multi_axis_cos_sin: theta must be > 0 and finite, got inf"),
    "multi-axis axes_dim=4": (lambda q, k, p: rope_ext.tables.multi_axis_cos_sin(torch.zeros(3, 2), 4),
                              r"axes_dim must be a non-empty sequence of positive even ints, got 4"),
    "transformers mrope_section [2.9, 1, 1]": (
        lambda q, k, p: hf.apply_multimodal_rotary_pos_emb(
            q[None].transpose(1, 2), k[None].transpose(1, 2), torch.ones(3, 1, 4, 16), torch.zeros(3, 1, 4, 16),
            [2.9, 2.1, 3]),
        r"mrope_section must hold ints, got \[2.9, 2.1, 3\]"),
}


@pytest.mark.parametrize("case", TABLE_CASES)
def test_values_that_give_no_finite_table_are_refused_before_any_write(case):
    refused_before_any_write(*TABLE_CASES[case], *_inputs()[:3])


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}


@pytest.mark.parametrize("kw,match", [
    (dict(base=1.0, scaling=YARN), r"rope scaling 'yarn' with base 1.0 and .* has no table"),
    (dict(scaling={"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [1.0] * 4,
                   "original_max_position_embeddings": 1}), r"rope scaling 'longrope' .* has no table"),
    (dict(scaling={"rope_type": "dynamic", "factor": 1e300, "original_max_position_embeddings": 4}, seq_len=32),
     r"rope scaling 'dynamic' .* has no table"),
    (dict(scaling={"rope_type": "linear", "factor": 1e-320}), r"rope scaling 'linear' .* gives non-finite"),
    (dict(scaling={**YARN, "attention_factor": 1e300}), r"rope scaling 'yarn' .* attention factor outside "
                                                         r"float32's range \(1e\+300\)"),
    (dict(scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0, "high_freq_factor": 1.0,
                   "original_max_position_embeddings": 8}),
     r"rope scaling 'llama3': high_freq_factor \(1.0\) must be >= low_freq_factor"),
])
def test_scalings_whose_values_give_no_finite_table_are_refused(kw, match):
    with pytest.raises(ValueError, match="cos_sin_cache: " + match):
        rope_ext.cos_sin_cache(32, 8, **kw)
    # the same dict in a module is refused the same way
    if "seq_len" not in kw:
        with pytest.raises(ValueError, match=match):
            rope_ext.RotaryEmbedding(8, max_position=32, **kw)


BASE = {"model_type": "llama", "hidden_size": 512, "num_attention_heads": 4, "max_position_embeddings": 64,
        "rope_theta": 10000.0}
LINEAR = {"rope_type": "linear", "factor": 2.0}


@pytest.mark.parametrize("extra,kw,match", [
    ({}, dict(interleaved="false"), r"interleaved must be True or False, got 'false'"),
    ({"max_position_embeddings": float("inf")}, {}, r"max_position_embeddings must be a positive integer, got inf"),
    ({"hidden_size": float("inf")}, {}, r"hidden_size must be a positive integer, got inf"),
    ({"rope_scaling": {**LINEAR, "rope_theta": "abc"}}, {}, r"rope_scaling.rope_theta must be a positive number"),
    ({"layer_rope_theta": [1e4, "x"]}, {}, r"layer_rope_theta must be a list of bases \(numbers\), got"),
    ({"layer_rope_theta": [1e4, 0]}, {}, r"layer_rope_theta gives the layers different bases"),  # 0: NoPE
    ({"layer_rope_theta": [0, 0]}, {}, r"layer_rope_theta must be a positive number, got 0"),
    ({"rope_scaling": LINEAR, "rope_scaling_layers": 3, "num_hidden_layers": 2}, {},
     r"rope_scaling_layers must be a list of layer indices, got 3"),
    ({"rope_scaling": LINEAR, "rope_scaling_layers": [0, 1], "num_hidden_layers": "2"}, {},
     r"num_hidden_layers must be a positive integer, got '2'"),
])
def test_from_config_names_bad_values(extra, kw, match):
    with pytest.raises(ValueError, match="RotaryEmbedding.from_config: " + match):
        rope_ext.RotaryEmbedding.from_config({**BASE, **extra}, **kw)


def test_from_config_still_reads_the_good_values():
    cfg = {**BASE, "rope_scaling": LINEAR, "rope_scaling_layers": [0, 1], "num_hidden_layers": 2}
    m = rope_ext.RotaryEmbedding.from_config(cfg, interleaved=True)
    assert m.interleaved is True and m.scaling["factor"] == 2.0


@pytest.mark.parametrize("kw,match", [
    (dict(mrope_interleaved=True), r"mrope_interleaved=True needs mrope_section"),
    (dict(scaling="linear"), r"scaling must be a dict \(a config's rope_scaling\) or None, got 'linear'"),
    (dict(mrope_section=4), r"mrope_section must be 3 ints >= 0 summing to rotary_dim/2 = 8, got 4"),
    (dict(mrope_section=[2.9, 1, 4.1]), r"mrope_section must be 3 ints"),
    (dict(interleaved="no"), r"interleaved must be True or False, got 'no'"),
])
def test_rotary_embedding_refuses_what_it_would_ignore_or_misread(kw, match):
    with pytest.raises(ValueError, match="RotaryEmbedding: " + match):
        rope_ext.RotaryEmbedding(16, **kw)


def test_scaled_tables_build_under_fake_tensor_mode():
    # the finiteness check of a scaling's frequencies reads values only where there are some
    from torch._subclasses.fake_tensor import FakeTensorMode
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 16}
    with FakeTensorMode():
        module = rope_ext.RotaryEmbedding(16, max_position=128, scaling=llama3)
        table = rope_ext.cos_sin_cache(128, 16, scaling={**YARN, "original_max_position_embeddings": 16})
    assert type(module.cos_sin_cache).__name__ == "FakeTensor" and tuple(table.shape) == (128, 16)


def _drop_in_calls():
    """(label, call(**overrides)) of the vLLM, SGLang and FlashInfer drop-ins, with good defaults."""
    q, k, p, c, _ = _inputs()
    flat = dict(positions=p, query=q.flatten(1), key=k.flatten(1), head_size=16, cos_sin_cache=c)
    mla = dict(q_rope=q[..., :8], k_rope=k[..., :8], q_nope=q[..., 8:], k_nope=k[..., 8:],
               cos_sin_cache=rope_ext.cos_sin_cache(8, 8), pos_ids=p)
    return {
        "vllm.rotary_embedding": (lambda **kw: vllm.rotary_embedding(**{**flat, "is_neox": True, **kw}),
                                  ("positions", "query", "key")),
        "sglang": (lambda **kw: sglang.apply_rope_with_cos_sin_cache_inplace(**{**flat, **kw}),
                   ("positions", "query", "key", "cos_sin_cache")),
        "flashinfer cos_sin_cache": (lambda **kw: fi.apply_rope_with_cos_sin_cache(**{**flat, **kw}),
                                     ("positions", "query", "key", "cos_sin_cache")),
        "flashinfer pos_ids": (lambda **kw: fi.apply_rope_pos_ids_inplace(**{"q": q, "k": k, "pos_ids": p, **kw}),
                               ("q", "k")),
        "flashinfer rope_quantize_fp8": (lambda **kw: fi.rope_quantize_fp8(**{**mla, **kw}),
                                         ("q_rope", "k_rope", "cos_sin_cache")),
    }


@pytest.mark.parametrize("bad", [None, [1.0, 2.0]], ids=["None", "list"])
@pytest.mark.parametrize("label", list(_drop_in_calls()))
def test_drop_ins_name_a_required_tensor_given_something_else(label, bad):
    call, names = _drop_in_calls()[label]
    call()  # the good call runs
    for name in names:
        if bad is None and name == "key":
            continue  # optional in vLLM and SGLang; FlashInfer's "key is required" (ValueError)
        got = "None" if bad is None else "list"
        with pytest.raises(TypeError, match=f"^{name} must be a tensor, got {got}$"):
            call(**{name: bad})
