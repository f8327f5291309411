"""One-line patching of Hugging Face transformers models, the convention Liger-Kernel made
popular:

    model = AutoModelForCausalLM.from_pretrained(...)
    rope_ext.integrations.transformers.patch(model)     # RoPE now runs on rope_ext's ops
    rope_ext.integrations.transformers.unpatch(model)   # back to transformers' code

What is patched: each attention module whose forward calls its modeling module's RoPE function
(`apply_rotary_pos_emb`, Qwen2-VL's `apply_multimodal_rotary_pos_emb` and vision
`apply_rotary_pos_emb_vision`) changes class, to a subclass of its own class whose forward is
transformers' forward, the same code, with that one call resolved to its
rope_ext.compat.transformers twin (an attention calling its RoPE as its own method, RoFormer's,
gets a subclass overriding that method). Nothing else changes: no instance attribute is set, no
transformers function is replaced (other models, patched or not, run transformers' code), and
`unpatch` sets the original class back.

So a patched model is an ordinary module tree: `copy.deepcopy` gives a patched copy running its
own weights, `torch.save(model)` / `torch.load` round-trip it (the patched classes are rebuilt on
load, see `_PatchedAttention.__reduce_ex__`), `torch.compile(fullgraph=True)` traces it, and hooks
or instance `forward`s installed after `patch` (accelerate's) are left as they are by `unpatch`.

Before the first patch of a family, the replacement is checked against transformers' function on
random inputs, so a transformers release that changes the function is refused, not silently
patched. A model whose own family is not listed has the parts patched whose family is (a LLaVA
or PaliGemma model's language model); one with no such part raises UnsupportedModelError (a
ValueError, and a NotImplementedError).
"""

import ast
import dis
import functools
import importlib
import inspect
import sys
import threading
import types
import weakref

import torch

from ..compat import transformers as hf
from . import _qk_norm


class UnsupportedModelError(ValueError, NotImplementedError):
    """patch() was given a model whose RoPE code rope_ext does not reproduce."""


# ---- the checks that transformers' function computes what its replacement does ----

def _generator():
    return torch.Generator().manual_seed(0)


def _duplicated(angles):
    return torch.cat((angles, angles), dim=-1)


def _as_they_are(angles):  # GPT-OSS's tables: one angle per pair
    return angles


def _repeated(angles):  # Cohere's tables: each angle at both members of its pair (2i, 2i+1)
    return angles.repeat_interleave(2, dim=-1)


def _same(a, b, tol=1e-10):
    return all(torch.allclose(x, y, rtol=tol, atol=tol) for x, y in zip(a, b))


def _same_dtypes(original, replacement, *args, **kwargs):
    """Whether both functions return tensors of the same dtypes on these arguments (bfloat16
    inputs beside float32 tables, where families differ: torch's promotion or the inputs')."""
    return ([t.dtype for t in replacement(*args, **kwargs)]
            == [t.dtype for t in original(*args, **kwargs)])


def _probe_rotate_half(original, replacement, tables=_duplicated, dtype=torch.float64):
    """dtype: of the inputs compared; float32 for a function that computes in float32 whatever
    its inputs' dtype (rope_ext's twin computes float64 inputs in float64)."""
    g = _generator()
    q = torch.randn(2, 3, 4, 8, generator=g, dtype=dtype)
    k = torch.randn(2, 1, 4, 8, generator=g, dtype=dtype)
    for rot in (8, 4):  # full and partial rotary (versions without partial rotary raise)
        emb = tables(torch.randn(2, 4, rot // 2, generator=g, dtype=dtype) * 3)
        try:
            want = original(q, k, emb.cos(), emb.sin())
        except RuntimeError:
            if rot == 8:
                raise
            continue
        if not _same(replacement(q, k, emb.cos(), emb.sin()), want,
                     1e-10 if dtype == torch.float64 else 1e-5):
            return False
    # A bfloat16 model's float32 tables: most families return torch's promotion (float32), Olmo 2
    # and LFM3 cast the results back to q's and k's dtypes, which their attention relies on.
    emb = tables(torch.randn(2, 4, 4, generator=g, dtype=torch.float32) * 3)
    mixed = (q.to(torch.bfloat16), k.to(torch.bfloat16), emb.cos(), emb.sin())
    return _same_dtypes(original, replacement, *mixed)


def _probe_roformer(original, replacement):
    """RoFormer's table: each pair's sin, then its cos, one entry per pair; with and without v."""
    g = _generator()
    angles = torch.randn(1, 1, 4, 4, generator=g, dtype=torch.float64) * 3
    table = torch.cat((angles.sin(), angles.cos()), dim=-1)
    q, k, v = (torch.randn(2, 3, 4, 8, generator=g, dtype=torch.float64) for _ in range(3))
    return all(_same(replacement(*args), original(*args)) and len(original(*args)) == len(args) - 1
               for args in ((table, q, k), (table, q, k, v)))


def _probe_hidden_states(original, replacement):
    """The speech encoders' rotation of the hidden states: a self of 3 heads of 8, tables for
    more positions than the sequence has."""
    g = _generator()
    attention = types.SimpleNamespace(num_heads=3, head_size=8)
    emb = _duplicated(torch.randn(6, 1, 1, 4, generator=g, dtype=torch.float64) * 3)
    tables = torch.stack((emb.cos(), emb.sin()))
    x = torch.randn(2, 5, 24, generator=g, dtype=torch.float64)
    return _same((replacement(attention, x, tables),), (original(attention, x, tables),))


def _probe_optional_key(original, replacement):
    """Qwen4-Exp's: apply_rotary_pos_emb's probe, then q alone by keyword (k left out), full and
    partial rotary, heads at dim 1 and 2."""
    if not _probe_rotate_half(original, replacement):
        return False
    g = _generator()
    for rot, dim in ((8, 1), (4, 2)):
        q = torch.randn(2, 3, 4, 8, generator=g, dtype=torch.float64)
        if dim == 2:
            q = q.transpose(1, 2)
        emb = _duplicated(torch.randn(2, 4, rot // 2, generator=g, dtype=torch.float64) * 3)
        call = dict(cos=emb.cos(), sin=emb.sin(), unsqueeze_dim=dim)
        if not _same([replacement(q, **call)], [original(q, **call)]):
            return False
    return True


def _probe_latest_queries(original, replacement):
    """Muse Glimmer assistant's: q over the last 2 of k's 5 positions, heads at dim 1; dtypes of
    a bfloat16 model's float32 tables."""
    g = _generator()
    q = torch.randn(2, 3, 2, 8, generator=g, dtype=torch.float64)
    k = torch.randn(2, 1, 5, 8, generator=g, dtype=torch.float64)
    emb = _duplicated(torch.randn(2, 5, 4, generator=g, dtype=torch.float64) * 3)
    if not _same(replacement(q, k, emb.cos(), emb.sin()), original(q, k, emb.cos(), emb.sin())):
        return False
    mixed = (q.to(torch.bfloat16), k.to(torch.bfloat16), emb.cos().float(), emb.sin().float())
    return _same_dtypes(original, replacement, *mixed)


def _probe_indexed(original, replacement):
    """transformers 4's PhiMoE: (positions, rotary_dim) tables gathered at position_ids, which
    its signature requires; transformers 5's takes the gathered tables (_probe_rotate_half)."""
    position_ids = inspect.signature(original).parameters.get("position_ids")
    if position_ids is None or position_ids.default is not inspect.Parameter.empty:
        return _probe_rotate_half(original, replacement)
    g = _generator()
    q = torch.randn(2, 3, 4, 8, generator=g, dtype=torch.float64)
    k = torch.randn(2, 1, 4, 8, generator=g, dtype=torch.float64)
    emb = _duplicated(torch.randn(9, 4, generator=g, dtype=torch.float64) * 3)
    positions = torch.randint(0, 9, (2, 4), generator=g)
    return _same(replacement(q, k, emb.cos(), emb.sin(), positions),
                 original(q, k, emb.cos(), emb.sin(), positions))


def _probe_qkv_indexed(original, replacement):
    """CLVP's: q, k and v rotated by (positions, rotary_dim) tables gathered at position_ids; the
    result dtypes of bfloat16 q, k and v with float32 tables."""
    g = _generator()
    q, k, v = (torch.randn(2, 3, 4, 8, generator=g, dtype=torch.float64) for _ in range(3))
    emb = _duplicated(torch.randn(9, 4, generator=g, dtype=torch.float64) * 3)
    positions = torch.randint(0, 9, (2, 4), generator=g)
    if not _same(replacement(q, k, v, emb.cos(), emb.sin(), positions),
                 original(q, k, v, emb.cos(), emb.sin(), positions)):
        return False
    mixed = (q.bfloat16(), k.bfloat16(), v.bfloat16(), emb.cos().float(), emb.sin().float(),
             positions)
    return _same_dtypes(original, replacement, *mixed)


def _probe_one_tensor(original, replacement):
    g = _generator()
    x = torch.randn(2, 4, 3, 8, generator=g, dtype=torch.float64)  # (batch, seq, heads, dim)
    emb = _duplicated(torch.randn(2, 4, 4, generator=g, dtype=torch.float64) * 3)
    return _same([replacement(x, emb.cos(), emb.sin(), unsqueeze_dim=2)],
                 [original(x, emb.cos(), emb.sin(), unsqueeze_dim=2)])


def _probe_gptj(original, replacement):
    g = _generator()
    x = torch.randn(2, 4, 3, 8, generator=g, dtype=torch.float64)
    ang = torch.randn(2, 4, 4, generator=g, dtype=torch.float64) * 3
    return _same([replacement(x, ang.sin(), ang.cos())], [original(x, ang.sin(), ang.cos())])


def _probe_mrope(original, replacement):
    g = _generator()
    q = torch.randn(2, 3, 4, 16, generator=g, dtype=torch.float64)
    k = torch.randn(2, 1, 4, 16, generator=g, dtype=torch.float64)
    for section in ([2, 3, 3], [1, 1, 2]):  # full and partial rotary (Qwen2-VL's raises)
        emb = _duplicated(torch.randn(3, 2, 4, sum(section), generator=g, dtype=torch.float64) * 3)
        try:
            want = original(q, k, emb.cos(), emb.sin(), section)
        except RuntimeError:
            if section == [2, 3, 3]:
                raise
            continue
        if not _same(replacement(q, k, emb.cos(), emb.sin(), section), want):
            return False
    return True


def _probe_vision(original, replacement, tables=_duplicated, dtypes=False):
    """dtypes: also the results' dtypes of bfloat16 q and k with float32 tables."""
    g = _generator()
    q = torch.randn(5, 2, 8, generator=g, dtype=torch.float32)
    k = torch.randn(5, 2, 8, generator=g, dtype=torch.float32)
    emb = tables(torch.randn(5, 4, generator=g, dtype=torch.float32) * 3)
    got, want = replacement(q, k, emb.cos(), emb.sin()), original(q, k, emb.cos(), emb.sin())
    if not all(torch.allclose(x, y, rtol=1e-5, atol=1e-5) for x, y in zip(got, want)):
        return False
    mixed = (q.bfloat16(), k.bfloat16(), emb.cos(), emb.sin())
    return not dtypes or _same_dtypes(original, replacement, *mixed)


def _probe_complex(original, replacement, q_shape, k_shape, table_shape):
    """Complex tables (Llama 4's, DeepSeek-V2's) of any modulus; float32 inputs, which both
    compute in float32."""
    g = _generator()
    q = torch.randn(q_shape, generator=g, dtype=torch.float32)
    k = torch.randn(k_shape, generator=g, dtype=torch.float32)
    table = torch.polar(torch.rand(table_shape, generator=g, dtype=torch.float32) + 0.5,
                        torch.randn(table_shape, generator=g, dtype=torch.float32) * 3)
    return _same(replacement(q, k, table), original(q, k, table), tol=1e-6)


def _probe_patches(original, replacement):
    """DINOv3's: the tables cover the last tokens (the patches) only."""
    g = _generator()
    q = torch.randn(2, 3, 6, 8, generator=g, dtype=torch.float64)
    k = torch.randn(2, 3, 6, 8, generator=g, dtype=torch.float64)
    emb = _duplicated(torch.randn(4, 4, generator=g, dtype=torch.float64) * 3)
    return _same(replacement(q, k, emb.cos(), emb.sin()), original(q, k, emb.cos(), emb.sin()))


def _probe_trailing(original, replacement):
    """DeepSeek-V4's: one tensor, its last dims rotated by half tables, -sin too; float32, as
    both compute."""
    g = _generator()
    x = torch.randn(2, 3, 4, 12, generator=g, dtype=torch.float32)
    ang = torch.randn(2, 4, 4, generator=g, dtype=torch.float32) * 3
    return all(_same([replacement(x, ang.cos(), s)], [original(x, ang.cos(), s)], tol=1e-6)
               for s in (ang.sin(), -ang.sin()))


def _sam_tables(tokens, g):
    """(1, tokens, 8) tables as SAM's rotary modules build them: each angle at both members."""
    angles = _repeated(torch.randn(1, tokens, 4, generator=g, dtype=torch.float32) * 3)
    return angles.cos(), angles.sin()


def _probe_2d(original, replacement, cases):
    """SAM's 2D RoPE (float32 inputs: both compute in float32): each case's extra arguments
    (keys, tables, keywords) after q; then the result dtypes of bfloat16 q and keys."""
    g = _generator()
    q = torch.randn(2, 3, 4, 8, generator=g, dtype=torch.float32)
    cos, sin = _sam_tables(4, g)
    cases = [(torch.randn(2, 3, n, 8, generator=g, dtype=torch.float32),
              tuple(t for n_k in extra for t in _sam_tables(n_k, g)), kw)
             for n, extra, kw in cases]
    for k, extra, kw in cases:
        got, want = replacement(q, k, cos, sin, *extra, **kw), original(q, k, cos, sin, *extra, **kw)
        if not (_same(got, want, tol=1e-6) and [t.shape for t in got] == [t.shape for t in want]):
            return False
    k, extra, kw = cases[0]
    bf16 = (q.bfloat16(), k.bfloat16(), cos, sin, *extra)
    return _same_dtypes(original, replacement, *bf16, **kw)


# SAM 2's and SAM 3 tracker's memory attention: keys of one frame, of several (object pointers
# excluded), of two, all excluded; EdgeTAM's self-attention; its cross-attention (2 groups of 2
# temporal + 3 spatial keys and 2 excluded, 3 spatial keys, all excluded)
_probe_sam = functools.partial(_probe_2d, cases=[
    (14, (), dict(num_k_exclude_rope=2, repeat_freqs_k=True)), (4, (), {}),
    (8, (), dict(repeat_freqs_k=True)), (3, (), dict(num_k_exclude_rope=3))])
_probe_sam_qk = functools.partial(_probe_2d, cases=[(4, (), {})])
_probe_sam_cross = functools.partial(_probe_2d, cases=[
    (12, (3,), dict(num_k_exclude_rope=2, repeat_freqs_k=2)), (3, (3,), {}),
    (2, (3,), dict(num_k_exclude_rope=2))])


# Where a family's function differs between transformers 4 and 5, its form is chosen by the
# installed major version (hf.TRANSFORMERS_5); the probe holds whichever is chosen to the code it
# replaces.
_TRANSFORMERS_5 = hf.TRANSFORMERS_5

_ROTATE_HALF = {"apply_rotary_pos_emb": (hf.apply_rotary_pos_emb, _probe_rotate_half)}
_ROTATE_HALF_IN_INPUT_DTYPE = {
    "apply_rotary_pos_emb": (hf.apply_rotary_pos_emb_in_input_dtype, _probe_rotate_half)}
# NanoChat's: rotate_half with flipped signs, the rotation by the negative angle
_NEGATIVE = {"apply_rotary_pos_emb": (hf.apply_rotary_pos_emb_negative, _probe_rotate_half)}
# ModernBERT decoder's under transformers 5: in float32, the results cast back to q's and k's
# dtypes (float64 models aside, where rope_ext computes in float64, the same)
_IN_FLOAT32 = {"apply_rotary_pos_emb": (hf.apply_rotary_pos_emb_in_input_dtype,
                                        functools.partial(_probe_rotate_half, dtype=torch.float32))}
_GPTJ = {"apply_rotary_pos_emb": (hf.apply_rotary_pos_emb_gptj, _probe_gptj)}
# GLM's interleaved pairs, rotated by the first half of rotate_half-style tables (GLM, GLM-4,
# Helium; ERNIE 4.5 in q's dtype); Cohere's by tables holding each angle at both members
_GLM = {"apply_rotary_pos_emb": (hf.apply_rotary_pos_emb_glm, _probe_rotate_half)}
_ERNIE = {"apply_rotary_pos_emb": (hf.apply_rotary_pos_emb_ernie, _probe_rotate_half)}
# GPT-OSS's: rotate_half pairs, tables of one entry per pair
_HALF_TABLES = {"apply_rotary_pos_emb": (hf.apply_rotary_pos_emb_half_tables,
                                         functools.partial(_probe_rotate_half, tables=_as_they_are))}
# OpenAI Privacy Filter's: GPT-OSS's tables on interleaved pairs
_INTERLEAVED_HALF_TABLES = {"apply_rotary_pos_emb": (
    hf.apply_rotary_pos_emb_interleaved_half_tables,
    functools.partial(_probe_rotate_half, tables=_as_they_are))}
# DeepSeek-V3's MLA: pairs (2i, 2i+1) rotated, then laid out as halves (`rope_interleave`, its
# default), or Llama's RoPE
_DEEPSEEK = {
    "apply_rotary_pos_emb": (hf.apply_rotary_pos_emb, _probe_rotate_half),
    "apply_rotary_pos_emb_interleave": (hf.apply_rotary_pos_emb_interleave, _probe_rotate_half),
}
_COHERE = {"apply_rotary_pos_emb": (hf.apply_rotary_pos_emb_cohere,
                                    functools.partial(_probe_rotate_half, tables=_repeated))}
# transformers 4's PhiMoE gathers its tables at position_ids inside apply_rotary_pos_emb.
_INDEXED = {"apply_rotary_pos_emb": (hf.apply_rotary_pos_emb_indexed, _probe_indexed)}
# CLVP's: PhiMoE's gathered tables, v rotated too
_QKV_INDEXED = {"apply_rotary_pos_emb": (hf.apply_rotary_pos_emb_qkv_indexed, _probe_qkv_indexed)}
# Gemma 3n's and Gemma 4's apply_rotary_pos_emb rotates one tensor; their attention calls it for q
# and for k.
_ONE_TENSOR = {"apply_rotary_pos_emb": (hf.apply_rotary_pos_emb_single, _probe_one_tensor)}
# Transformers 5 dropped apply_multimodal_rotary_pos_emb: its Qwen2-VL rotary module mixes the
# MRoPE sections itself and the attention calls the plain apply_rotary_pos_emb.
_MROPE = {"apply_multimodal_rotary_pos_emb": (hf.apply_multimodal_rotary_pos_emb, _probe_mrope)}
# Vision towers' RoPE in Qwen2-VL's form (also GLM-OCR's, whose attention norms q and k per head
# first, and GLM-4.1V's and GLM-4.5V's)
_VISION = {"apply_rotary_pos_emb_vision": (hf.apply_rotary_pos_emb_vision, _probe_vision)}
# Inkling 2's vision tower: pairs (2i, 2i+1), each angle at both members
_VISION_PAIRS = {"apply_rotary_pos_emb_vision": (
    hf.apply_rotary_pos_emb_vision_pairs,
    functools.partial(_probe_vision, tables=_repeated, dtypes=True))}
_QWEN_VL = {**_ROTATE_HALF, **_MROPE, **_VISION}
# Complex tables, pairs (2i, 2i+1): Llama 4's text model (q and k (batch, seq, heads, head_dim))
# and vision tower (a table per patch), DeepSeek-V2's MLA (q and k (batch, heads, seq, rope_dim))
_LLAMA4 = {
    "apply_rotary_emb": (hf.apply_rotary_emb_complex, functools.partial(
        _probe_complex, q_shape=(2, 4, 3, 8), k_shape=(2, 4, 1, 8), table_shape=(2, 4, 4))),
    "vision_apply_rotary_emb": (hf.vision_apply_rotary_emb, functools.partial(
        _probe_complex, q_shape=(2, 5, 3, 8), k_shape=(2, 5, 3, 8), table_shape=(5, 1, 4))),
}
# DINOv3's ViT: the image's patches rotated, its class and register tokens passed through
_PATCHES = {"apply_rotary_pos_emb": (hf.apply_rotary_pos_emb_patches, _probe_patches)}
# DeepSeek-V4's: the trailing rope dims of one tensor, interleaved pairs, half tables
_DEEPSEEK_V4 = {"apply_rotary_pos_emb": (hf.apply_rotary_pos_emb_trailing, _probe_trailing)}
# Muse Glimmer assistant's: q over the last of k's positions (k holds the target's context too)
_LATEST_QUERIES = {"apply_rotary_pos_emb": (hf.apply_rotary_pos_emb_latest_queries,
                                            _probe_latest_queries)}
# Qwen4-Exp's: k optional (its indexer rotates queries alone); its vision tower's as Qwen2-VL's
_QWEN4_EXP = {"apply_rotary_pos_emb": (hf.apply_rotary_pos_emb_optional_key, _probe_optional_key),
              **_VISION}
# RoPE an attention module calls as its own method (SELF + its name): the patched class overrides
# the method. RoFormer's (a static method) on pairs (2i, 2i+1), value too with rotary_value;
# the speech encoders' (Wav2Vec2-Conformer's, copied into Wav2Vec2-BERT and SeamlessM4T) rotate
# the hidden states, seen as heads, before the q and k projections.
SELF = "self."
_ROFORMER = {SELF + "apply_rotary_position_embeddings": (hf.apply_rotary_position_embeddings,
                                                         _probe_roformer)}
_HIDDEN_STATES = {SELF + "_apply_rotary_embedding": (hf.apply_rotary_embedding_to_hidden_states,
                                                     _probe_hidden_states)}
# SAM's 2D RoPE of video memory attention: pairs (2i, 2i+1) of an image's rows and columns
_SAM_VIDEO = {"apply_rotary_pos_emb_2d": (hf.apply_rotary_pos_emb_2d, _probe_sam)}
_EDGETAM_VIDEO = {
    "apply_rotary_pos_emb_2d_self_attn": (hf.apply_rotary_pos_emb_2d_qk, _probe_sam_qk),
    "apply_rotary_pos_emb_2d_cross_attn": (hf.apply_rotary_pos_emb_2d_cross_attn,
                                           _probe_sam_cross),
}
_DEEPSEEK_V2 = {"apply_rotary_emb": (hf.apply_rotary_emb_complex_heads_first, functools.partial(
    _probe_complex, q_shape=(2, 3, 4, 8), k_shape=(2, 1, 4, 8), table_shape=(2, 4, 4)))}
# Interleaved pairs by tables holding each angle at both members, on the first cos.size(-1)
# dims, torch's promotion (BLT's; GLM-4.1V's under transformers 5)
_REPEATED_TABLES = {"apply_rotary_pos_emb": (
    hf.apply_rotary_pos_emb_glm4v, functools.partial(_probe_rotate_half, tables=_repeated))}
# GLM-4.1V's language model: interleaved pairs of the first half of each head, rotated by MRoPE
# tables whose sections transformers 5 chooses in its rotary module, 4 in the function
_GLM4V = (_REPEATED_TABLES if _TRANSFORMERS_5 else
          {"apply_multimodal_rotary_pos_emb": (hf.apply_multimodal_rotary_pos_emb_glm4v,
                                               _probe_mrope)})
# Qwen3-VL's rotary module lays the MRoPE sections out interleaved (T,H,W,...) itself; its
# attention then applies the resulting full-width tables like any rotate_half model.
_QWEN3_VL = {
    "apply_rotary_pos_emb": (hf.apply_rotary_pos_emb, _probe_rotate_half),
    "apply_rotary_pos_emb_vision": (hf.apply_rotary_pos_emb_vision, _probe_vision),
}

# model_type -> (modeling module under transformers.models, the functions patched there; those
# a transformers version does not define or its attention does not call are skipped).
# Each family is tested on a tiny model under transformers 4 and 5 (tests/test_integrations.py).
FAMILIES = {
    "llama": ("llama.modeling_llama", _ROTATE_HALF),
    "mistral": ("mistral.modeling_mistral", _ROTATE_HALF),
    "mixtral": ("mixtral.modeling_mixtral", _ROTATE_HALF),
    "qwen2": ("qwen2.modeling_qwen2", _ROTATE_HALF),
    "qwen2_moe": ("qwen2_moe.modeling_qwen2_moe", _ROTATE_HALF),
    "qwen3": ("qwen3.modeling_qwen3", _ROTATE_HALF),
    "qwen3_moe": ("qwen3_moe.modeling_qwen3_moe", _ROTATE_HALF),
    "gemma": ("gemma.modeling_gemma", _ROTATE_HALF),
    "gemma2": ("gemma2.modeling_gemma2", _ROTATE_HALF),
    "gemma3_text": ("gemma3.modeling_gemma3", _ROTATE_HALF),
    "gemma3": ("gemma3.modeling_gemma3", _ROTATE_HALF),  # the vision-language model
    "qwen3_next": ("qwen3_next.modeling_qwen3_next", _ROTATE_HALF),
    "qwen3_5_text": ("qwen3_5.modeling_qwen3_5", _ROTATE_HALF),  # transformers >= 5
    "qwen3_5_moe_text": ("qwen3_5_moe.modeling_qwen3_5_moe", _ROTATE_HALF),  # transformers >= 5
    # Qwen3.5's and Gemma 4's vision-language models (transformers >= 5): their language models
    "qwen3_5": ("qwen3_5.modeling_qwen3_5", _ROTATE_HALF),
    "qwen3_5_moe": ("qwen3_5_moe.modeling_qwen3_5_moe", _ROTATE_HALF),
    "gemma4": ("gemma4.modeling_gemma4", _ONE_TENSOR),
    "glm4_moe": ("glm4_moe.modeling_glm4_moe", _ROTATE_HALF),
    "gemma4_text": ("gemma4.modeling_gemma4", _ONE_TENSOR),  # transformers >= 5
    "gemma3n_text": ("gemma3n.modeling_gemma3n", _ONE_TENSOR),
    "dots1": ("dots1.modeling_dots1", _ROTATE_HALF),
    "apertus": ("apertus.modeling_apertus", _ROTATE_HALF),
    "phi3": ("phi3.modeling_phi3", _ROTATE_HALF),
    "phi": ("phi.modeling_phi", _ROTATE_HALF),
    "phimoe": ("phimoe.modeling_phimoe", _INDEXED),
    # Llama 3.2 Vision's and Emu3's language models (and the text-only models): Llama's RoPE
    "mllama": ("mllama.modeling_mllama", _ROTATE_HALF),  # (its cross-attention layers: no RoPE)
    "mllama_text_model": ("mllama.modeling_mllama", _ROTATE_HALF),
    "emu3": ("emu3.modeling_emu3", _ROTATE_HALF),
    "emu3_text_model": ("emu3.modeling_emu3", _ROTATE_HALF),
    # Llama 4: its text model (its NoPE layers, and the L2 norm after the rotation, run
    # transformers' code) and vision tower, alone or in the multimodal model
    "llama4": ("llama4.modeling_llama4", _LLAMA4),
    "llama4_text": ("llama4.modeling_llama4", _LLAMA4),
    "llama4_vision_model": ("llama4.modeling_llama4", _LLAMA4),
    # Aria's language model (MoE; and its text-only model), Sesame CSM's backbone and depth
    # decoder, EuroBERT (an encoder; transformers >= 5): Llama's RoPE
    "aria": ("aria.modeling_aria", _ROTATE_HALF),
    "aria_text": ("aria.modeling_aria", _ROTATE_HALF),
    "csm": ("csm.modeling_csm", _ROTATE_HALF),
    "eurobert": ("eurobert.modeling_eurobert", _ROTATE_HALF),
    "nanochat": ("nanochat.modeling_nanochat", _NEGATIVE),  # transformers >= 5
    # ModernBERT's decoder: global and sliding-window layers, each kind with its own base;
    # transformers 5's computes in float32
    "modernbert-decoder": ("modernbert_decoder.modeling_modernbert_decoder",
                           _IN_FLOAT32 if _TRANSFORMERS_5 else _ROTATE_HALF),
    # Encoders of transformers >= 5 (text embeddings, masked LMs, protein LMs): Llama's RoPE;
    # ModernBERT's computes in float32 (transformers 4's calls RoPE from functions outside its
    # attention module: not listed there)
    **({"modernbert": ("modernbert.modeling_modernbert", _IN_FLOAT32)} if _TRANSFORMERS_5 else {}),
    "gte": ("gte.modeling_gte", _ROTATE_HALF),
    "nomic_bert": ("nomic_bert.modeling_nomic_bert", _ROTATE_HALF),
    "jina_embeddings_v3": ("jina_embeddings_v3.modeling_jina_embeddings_v3", _ROTATE_HALF),
    "esmc": ("esmc.modeling_esmc", _ROTATE_HALF),
    # ESM-2 (transformers 4's calls a rotary module of another form: not listed there), in float32
    **({"esm": ("esm.modeling_esm", _IN_FLOAT32)} if _TRANSFORMERS_5 else {}),
    # Evolla: its language model, and under transformers 5 its protein encoder (SaProt), in
    # float32 (transformers 4's config names its type "EvollaModel")
    "evolla": ("evolla.modeling_evolla", _IN_FLOAT32 if _TRANSFORMERS_5 else _ROTATE_HALF),
    **({} if _TRANSFORMERS_5 else {"EvollaModel": ("evolla.modeling_evolla", _ROTATE_HALF)}),
    "ultrabert": ("ultrabert.modeling_ultrabert", _ROTATE_HALF),
    "neomme": ("neomme.modeling_neomme", _ROTATE_HALF),
    # EmbeddingGemma 2's text encoder (>= 5; QK norms fused), also inside its multimodal model
    "embedding_gemma2_text": ("embedding_gemma2.modeling_embedding_gemma2", _ROTATE_HALF),
    # Pixtral's vision encoder (Mistral 3's, Pixtral's vision tower): Llama's RoPE over a 2-D
    # table of patch rows and columns
    "pixtral": ("pixtral.modeling_pixtral", _ROTATE_HALF),
    # the language models of Cosmos 3 Edge and Granite-Docling (transformers >= 5; their vision
    # towers run transformers' code)
    "cosmos3_edge": ("cosmos3_edge.modeling_cosmos3_edge", _ROTATE_HALF),
    "granite_docling": ("granite_docling.modeling_granite_docling", _ROTATE_HALF),
    "gpt_neox": ("gpt_neox.modeling_gpt_neox", _ROTATE_HALF),
    "stablelm": ("stablelm.modeling_stablelm", _ROTATE_HALF),
    "olmo2": ("olmo2.modeling_olmo2", _ROTATE_HALF_IN_INPUT_DTYPE),
    "granite": ("granite.modeling_granite", _ROTATE_HALF),
    "starcoder2": ("starcoder2.modeling_starcoder2", _ROTATE_HALF),
    "smollm3": ("smollm3.modeling_smollm3", _ROTATE_HALF),  # RoPE on some layers only
    "seed_oss": ("seed_oss.modeling_seed_oss", _ROTATE_HALF),
    "arcee": ("arcee.modeling_arcee", _ROTATE_HALF),
    "ministral": ("ministral.modeling_ministral", _ROTATE_HALF),
    "vaultgemma": ("vaultgemma.modeling_vaultgemma", _ROTATE_HALF),
    "diffllama": ("diffllama.modeling_diffllama", _ROTATE_HALF),
    "bitnet": ("bitnet.modeling_bitnet", _ROTATE_HALF),
    "falcon": ("falcon.modeling_falcon", _ROTATE_HALF),  # its rotary configs (not ALiBi)
    "nemotron": ("nemotron.modeling_nemotron", _ROTATE_HALF),  # partial rotary
    "persimmon": ("persimmon.modeling_persimmon", _ROTATE_HALF),  # partial; LayerNorm on q, k
    "granitemoe": ("granitemoe.modeling_granitemoe", _ROTATE_HALF),
    "granitemoeshared": ("granitemoeshared.modeling_granitemoeshared", _ROTATE_HALF),
    "granitemoehybrid": ("granitemoehybrid.modeling_granitemoehybrid", _ROTATE_HALF),  # if "rope"
    "bamba": ("bamba.modeling_bamba", _ROTATE_HALF),  # Mamba 2 layers and attention ones
    "falcon_h1": ("falcon_h1.modeling_falcon_h1", _ROTATE_HALF),  # Mamba 2 and attention
    "zamba2": ("zamba2.modeling_zamba2", _ROTATE_HALF),  # its shared attention blocks' RoPE
    "recurrent_gemma": ("recurrent_gemma.modeling_recurrent_gemma", _ROTATE_HALF),
    "dbrx": ("dbrx.modeling_dbrx", _ROTATE_HALF),
    "gpt_neox_japanese": ("gpt_neox_japanese.modeling_gpt_neox_japanese", _ROTATE_HALF),
    "moshi": ("moshi.modeling_moshi", _ROTATE_HALF),  # its text transformer
    "chameleon": ("chameleon.modeling_chameleon", _ROTATE_HALF),  # LayerNorms on q, k: not fused
    "phi4_multimodal": ("phi4_multimodal.modeling_phi4_multimodal", _ROTATE_HALF),  # its text model
    "t5gemma": ("t5gemma.modeling_t5gemma", _ROTATE_HALF),  # encoder and decoder self-attention
    "flex_olmo": ("flex_olmo.modeling_flex_olmo", _ROTATE_HALF_IN_INPUT_DTYPE),
    "jetmoe": ("jetmoe.modeling_jetmoe", _ROTATE_HALF),
    "minimax": ("minimax.modeling_minimax", _ROTATE_HALF),  # its full-attention layers
    # q and k normed after the rotation: not fused
    "hunyuan_v1_dense": ("hunyuan_v1_dense.modeling_hunyuan_v1_dense", _ROTATE_HALF),
    "hunyuan_v1_moe": ("hunyuan_v1_moe.modeling_hunyuan_v1_moe", _ROTATE_HALF),
    # results cast back to q's and k's dtypes (OLMo, OLMo 3); OLMo 3's and OLMoE's norms span
    # all heads, as OLMo 2's: not fused
    "olmo": ("olmo.modeling_olmo", _ROTATE_HALF_IN_INPUT_DTYPE),
    "olmo3": ("olmo3.modeling_olmo3", _ROTATE_HALF_IN_INPUT_DTYPE),
    "olmoe": ("olmoe.modeling_olmoe", _ROTATE_HALF),
    # transformers >= 5 (Llama's RoPE; OLMo hybrid's and Beam's in the inputs' dtypes)
    "minimax_m2": ("minimax_m2.modeling_minimax_m2", _ROTATE_HALF),
    "mimo_v2_flash": ("mimo_v2_flash.modeling_mimo_v2_flash", _ROTATE_HALF),
    "ministral3": ("ministral3.modeling_ministral3", _ROTATE_HALF),
    "minicpm3": ("minicpm3.modeling_minicpm3", _ROTATE_HALF),  # MLA, Llama's RoPE
    "cwm": ("cwm.modeling_cwm", _ROTATE_HALF),
    "hyperclovax": ("hyperclovax.modeling_hyperclovax", _ROTATE_HALF),
    "jais2": ("jais2.modeling_jais2", _ROTATE_HALF),
    "solar_open": ("solar_open.modeling_solar_open", _ROTATE_HALF),
    "hy_v4": ("hy_v4.modeling_hy_v4", _ROTATE_HALF),
    "zaya": ("zaya.modeling_zaya", _ROTATE_HALF),
    "hrm_text": ("hrm_text.modeling_hrm_text", _ROTATE_HALF),
    "granite_swa": ("granite_swa.modeling_granite_swa", _ROTATE_HALF),
    "granitemoe_swa": ("granitemoe_swa.modeling_granitemoe_swa", _ROTATE_HALF),
    "olmo_hybrid": ("olmo_hybrid.modeling_olmo_hybrid", _ROTATE_HALF_IN_INPUT_DTYPE),
    "beam": ("beam.modeling_beam", _ROTATE_HALF_IN_INPUT_DTYPE),  # QK-norm fused, NoPE global layers
    "gptj": ("gptj.modeling_gptj", _GPTJ),
    "glm": ("glm.modeling_glm", _GLM),  # partial rotary
    "glm4": ("glm4.modeling_glm4", _GLM),
    "helium": ("helium.modeling_helium", _GLM),
    "ernie4_5": ("ernie4_5.modeling_ernie4_5", _ERNIE),
    # Moonshine and Moonshine Streaming (>= 5) (speech recognition; their encoders' and decoders'
    # self-attention): GLM's RoPE
    "moonshine": ("moonshine.modeling_moonshine", _GLM),
    "moonshine_streaming": ("moonshine_streaming.modeling_moonshine_streaming", _GLM),
    # Dia (text to speech: encoder and decoder self-attention) and Kyutai STT (speech to text;
    # its decoder over text and audio codes)
    "dia": ("dia.modeling_dia", _ROTATE_HALF),
    "kyutai_speech_to_text": ("kyutai_speech_to_text.modeling_kyutai_speech_to_text", _ROTATE_HALF),
    "ernie4_5_moe": ("ernie4_5_moe.modeling_ernie4_5_moe", _ERNIE),
    "codegen": ("codegen.modeling_codegen", _GPTJ),
    # BLT (Byte Latent Transformer): its entropy patcher, local encoder and decoder and global
    # transformer, each a model type of its own
    **{t: ("blt.modeling_blt", _REPEATED_TABLES) for t in (
        "blt", "blt_patcher", "blt_local_encoder", "blt_local_decoder", "blt_global_transformer")},
    "gpt_oss": ("gpt_oss.modeling_gpt_oss", _HALF_TABLES),
    "clvp": ("clvp.modeling_clvp", _QKV_INDEXED),
    "clvp_encoder": ("clvp.modeling_clvp", _QKV_INDEXED),
    "roformer": ("roformer.modeling_roformer", _ROFORMER),
    # speech encoders with position_embeddings_type="rotary" (SeamlessM4T's: its speech encoder)
    "wav2vec2-conformer": ("wav2vec2_conformer.modeling_wav2vec2_conformer", _HIDDEN_STATES),
    "wav2vec2-bert": ("wav2vec2_bert.modeling_wav2vec2_bert", _HIDDEN_STATES),
    "seamless_m4t": ("seamless_m4t.modeling_seamless_m4t", _HIDDEN_STATES),
    "openai_privacy_filter": ("openai_privacy_filter.modeling_openai_privacy_filter",
                              _INTERLEAVED_HALF_TABLES),  # transformers >= 5
    "deepseek_v2": ("deepseek_v2.modeling_deepseek_v2", _DEEPSEEK_V2),
    "deepseek_v3": ("deepseek_v3.modeling_deepseek_v3", _DEEPSEEK),
    # transformers >= 5; its attention, compressors and indexer, and the output's inverse rotation
    "deepseek_v4": ("deepseek_v4.modeling_deepseek_v4", _DEEPSEEK_V4),
    # ESMFold2's atom attention (the atoms' 3-D positions as angles), transformers >= 5
    "esmfold2": ("esmfold2.modeling_esmfold2", _ROTATE_HALF),
    # image matchers: Cohere's pairs over the whole hidden size (EfficientLoFTR) or each head
    "efficientloftr": ("efficientloftr.modeling_efficientloftr", _COHERE),
    "lightglue": ("lightglue.modeling_lightglue", _COHERE),
    # speech encoders (transformers >= 5); Nemotron 3.5 Transcribe's holds a Nemotron 3
    # diarization model too (its language model, Nemotron-H, has no RoPE)
    "nemotron3_diarization": ("nemotron3_diarization.modeling_nemotron3_diarization", _ROTATE_HALF),
    "nemotron3_diarization_audio": ("nemotron3_diarization.modeling_nemotron3_diarization",
                                    _ROTATE_HALF),
    **{t: ("nemotron3_5_transcribe.modeling_nemotron3_5_transcribe", _ROTATE_HALF)
       for t in ("nemo_speechlm", "nemotron3_5_transcribe_audio",
                 "nemotron3_5_transcribe_asr_audio", "nemotron3_5_transcribe_word_timestamp")},
    # vision towers of models whose language models have no RoPE (transformers >= 5)
    "glm5_next": ("glm5_next.modeling_glm5_next", _VISION),
    "glm5_next_vision": ("glm5_next.modeling_glm5_next", _VISION),
    "inkling2": ("inkling2.modeling_inkling2", _VISION_PAIRS),
    "inkling2_vision": ("inkling2.modeling_inkling2", _VISION_PAIRS),
    "qwen4_exp": ("qwen4_exp.modeling_qwen4_exp", _QWEN4_EXP),  # transformers >= 5
    # Gemma 4's one-tensor RoPE in an encoder and a decoder (transformers >= 5)
    "diffusion_gemma": ("diffusion_gemma.modeling_diffusion_gemma", _ONE_TENSOR),
    "diffusion_gemma_text": ("diffusion_gemma.modeling_diffusion_gemma", _ONE_TENSOR),
    "muse_glimmer_assistant": ("muse_glimmer_assistant.modeling_muse_glimmer_assistant",
                               _LATEST_QUERIES),  # transformers >= 5
    "qwen4_exp_text": ("qwen4_exp.modeling_qwen4_exp", _QWEN4_EXP),
    "qwen4_exp_vision": ("qwen4_exp.modeling_qwen4_exp", _QWEN4_EXP),
    "longcat_flash": ("longcat_flash.modeling_longcat_flash", _DEEPSEEK),
    "glm4_moe_lite": ("glm4_moe_lite.modeling_glm4_moe_lite", _DEEPSEEK),  # transformers >= 5
    "mistral4": ("mistral4.modeling_mistral4", _DEEPSEEK),  # transformers >= 5
    "youtu": ("youtu.modeling_youtu", _DEEPSEEK),  # transformers >= 5
    "deepseek_v32": ("deepseek_v32.modeling_deepseek_v32", _DEEPSEEK),  # >= 5; its indexer's too
    "glm_moe_dsa": ("glm_moe_dsa.modeling_glm_moe_dsa", _DEEPSEEK),  # transformers >= 5
    "dots3_note_text": ("dots3_note.modeling_dots3_note", _DEEPSEEK),  # transformers >= 5
    "bailing_hybrid": ("bailing_hybrid.modeling_bailing_hybrid", _DEEPSEEK),  # >= 5
    "axk1": ("axk1.modeling_axk1", _DEEPSEEK),  # transformers >= 5
    "axk2": ("axk2.modeling_axk2", _DEEPSEEK),  # transformers >= 5
    # >= 5; layers that reuse another layer's keys rotate q alone
    "mistral_large4": ("mistral_large4.modeling_mistral_large4", _DEEPSEEK),
    "mistral_large4_text": ("mistral_large4.modeling_mistral_large4", _DEEPSEEK),
    "cohere": ("cohere.modeling_cohere", _COHERE),  # LayerNorms on q and k (optional): not fused
    "cohere2": ("cohere2.modeling_cohere2", _COHERE),  # RoPE on sliding-window layers only
    "cohere2_moe": ("cohere2_moe.modeling_cohere2_moe", _COHERE),  # transformers >= 5
    "qwen2_vl": ("qwen2_vl.modeling_qwen2_vl", _QWEN_VL),
    "qwen2_vl_text": ("qwen2_vl.modeling_qwen2_vl", _QWEN_VL),
    "qwen2_5_vl": ("qwen2_5_vl.modeling_qwen2_5_vl", _QWEN_VL),
    "qwen2_5_vl_text": ("qwen2_5_vl.modeling_qwen2_5_vl", _QWEN_VL),
    "qwen3_vl": ("qwen3_vl.modeling_qwen3_vl", _QWEN3_VL),
    "qwen3_vl_text": ("qwen3_vl.modeling_qwen3_vl", _QWEN3_VL),
    "qwen3_vl_moe": ("qwen3_vl_moe.modeling_qwen3_vl_moe", _QWEN3_VL),
    "qwen3_vl_moe_text": ("qwen3_vl_moe.modeling_qwen3_vl_moe", _QWEN3_VL),
    "qwen3_omni_moe_thinker": ("qwen3_omni_moe.modeling_qwen3_omni_moe", _QWEN3_VL),
    # QK-norm families; EXAONE 4 (and 4.5), EXAONE MoE, AFMoE, Flint and Kolibri 1 rotate on
    # some layers only (NoPE on global layers)
    "exaone4": ("exaone4.modeling_exaone4", _ROTATE_HALF),
    "exaone_moe": ("exaone_moe.modeling_exaone_moe", _ROTATE_HALF),  # transformers >= 5
    "exaone4_5": ("exaone4.modeling_exaone4", _ROTATE_HALF),  # >= 5; its language model is EXAONE 4
    "afmoe": ("afmoe.modeling_afmoe", _ROTATE_HALF),  # transformers >= 5
    "flint": ("flint.modeling_flint", _ROTATE_HALF),  # transformers >= 5
    "kolibri1": ("kolibri1.modeling_kolibri1", _ROTATE_HALF),  # transformers >= 5
    "doge": ("doge.modeling_doge", _ROTATE_HALF),
    "hy_v3": ("hy_v3.modeling_hy_v3", _ROTATE_HALF),  # transformers >= 5
    "laguna": ("laguna.modeling_laguna", _ROTATE_HALF),  # transformers >= 5
    "mellum": ("mellum.modeling_mellum", _ROTATE_HALF),  # transformers >= 5
    "lfm3": ("lfm3.modeling_lfm3", _ROTATE_HALF_IN_INPUT_DTYPE),  # transformers >= 5
    "minimax_m3_vl_text": ("minimax_m3_vl.modeling_minimax_m3_vl", _ROTATE_HALF),  # >= 5
    "minimax_m3_vl": ("minimax_m3_vl.modeling_minimax_m3_vl", _ROTATE_HALF),  # >= 5; text
    "gemma4_unified_text": ("gemma4_unified.modeling_gemma4_unified", _ONE_TENSOR),  # >= 5
    "t5gemma2": ("t5gemma2.modeling_t5gemma2", _ROTATE_HALF),  # transformers >= 5
    "step3p7": ("step3p7.modeling_step3p7", _ROTATE_HALF),  # >= 5; its language model's RoPE
    "molmo2": ("molmo2.modeling_molmo2", _ROTATE_HALF),  # >= 5; its language model's RoPE
    "glm_ocr": ("glm_ocr.modeling_glm_ocr", _VISION),  # >= 5; its vision tower's
    "paddleocr_vl": ("paddleocr_vl.modeling_paddleocr_vl", _QWEN3_VL),  # >= 5; LM and tower
    # ERNIE 4.5 VL (>= 5): Cohere's interleaved pairs in its language model (MRoPE tables made
    # so by its rotary module), Qwen2-VL's vision RoPE in its tower
    "ernie4_5_vl_moe": ("ernie4_5_vl_moe.modeling_ernie4_5_vl_moe", {**_COHERE, **_VISION}),
    "ernie4_5_vl_moe_text": ("ernie4_5_vl_moe.modeling_ernie4_5_vl_moe", _COHERE),
    # GLM-4.1V and GLM-4.5V: vision towers and language models (GLM-4.5V's: Qwen2-VL's MRoPE on
    # the first half of each head, its sections chosen in its rotary module under transformers 5)
    "glm4v": ("glm4v.modeling_glm4v", {**_GLM4V, **_VISION}),
    "glm4v_moe": ("glm4v_moe.modeling_glm4v_moe", {**_ROTATE_HALF, **_VISION} if _TRANSFORMERS_5
                  else {**_MROPE, **_VISION}),
    # Liquid's LFM2 family (hybrid conv + attention, made for CPUs): per-head norms named
    # q_layernorm / k_layernorm, found and fused like any other (norm_names)
    "lfm2": ("lfm2.modeling_lfm2", _ROTATE_HALF),
    "lfm2-vl": ("lfm2.modeling_lfm2", _ROTATE_HALF),  # transformers 4; its language model
    "lfm2_vl": ("lfm2.modeling_lfm2", _ROTATE_HALF),  # transformers >= 5; its language model
    "lfm2_moe": ("lfm2_moe.modeling_lfm2_moe", _ROTATE_HALF),  # transformers >= 5
    # LFM3-VL's vision tower (>= 5; its language model is LFM3, listed)
    "lfm3_vl_vision": ("lfm3_vl.modeling_lfm3_vl", _VISION),
    # MLCD, a vision encoder, and the vision towers of VideoLLaMA 3 and Kimi K2.5 (>= 5):
    # Qwen2-VL's vision RoPE
    "mlcd_vision_model": ("mlcd.modeling_mlcd", _VISION),
    "video_llama_3_vision": ("video_llama_3.modeling_video_llama_3", _VISION),
    "kimi_k25_vision": ("kimi_k25.modeling_kimi_k25", _VISION),
    # The memory attention of the video trackers of SAM 2, SAM 3 (>= 5) and EdgeTAM
    "sam2_video": ("sam2_video.modeling_sam2_video", _SAM_VIDEO),
    "sam3_tracker_video": ("sam3_tracker_video.modeling_sam3_tracker_video", _SAM_VIDEO),
    "edgetam_video": ("edgetam_video.modeling_edgetam_video", _EDGETAM_VIDEO),
    # DINOv3's ViT and Sapiens2 (>= 5), their class and register tokens unrotated
    "dinov3_vit": ("dinov3_vit.modeling_dinov3_vit", _PATCHES),
    "sapiens2": ("sapiens2.modeling_sapiens2", _PATCHES),
    # Muse Spark, Muse Glimmer and Cohere Compass (>= 5): Qwen3-VL's interleaved MRoPE tables
    # (their weightless q/k norms, shared by q and k and scaled after, run transformers' code)
    # and vision towers; Unlimited OCR's language model (its towers have no RoPE)
    **{f"{family}{part}": (f"{family}.modeling_{family}", _QWEN3_VL)
       for family in ("muse_spark", "muse_glimmer", "cohere_compass")
       for part in ("", "_text", "_vision")},
    "unlimited_ocr": ("unlimited_ocr.modeling_unlimited_ocr", _ROTATE_HALF),
    "unlimited_ocr_text": ("unlimited_ocr.modeling_unlimited_ocr", _ROTATE_HALF),
    # Perception Encoder's audio, video and audio-video encoders (>= 5): GLM's interleaved pairs
    **{f"pe_{kind}_encoder": (f"pe_{kind}.modeling_pe_{kind}", _GLM)
       for kind in ("audio", "video", "audio_video")},
    # TimesFM 2.5 (time series; its q/k norms follow the rotation) and Higgs Audio v2 (>= 5)
    "timesfm2_5": ("timesfm2_5.modeling_timesfm2_5", _ROTATE_HALF),
    "higgs_audio_v2": ("higgs_audio_v2.modeling_higgs_audio_v2", _ROTATE_HALF),
    # Qwen2.5-Omni's thinker: its language model's MRoPE (transformers 4: Qwen2-VL's function;
    # 5: the tables composed in its rotary module, Llama's rotation), its vision tower's under 5
    "qwen2_5_omni_thinker": ("qwen2_5_omni.modeling_qwen2_5_omni",
                             _QWEN3_VL if _TRANSFORMERS_5 else _MROPE),
    # The language models of Granite 4 Vision and DeepSeek-OCR 2 and DeepSeek-OCR 2's vision
    # encoder (>= 5; each found by its own type inside the model)
    "granite4_vision_text": ("granite4_vision.modeling_granite4_vision", _ROTATE_HALF),
    "deepseek_ocr2_text": ("deepseek_ocr2.modeling_deepseek_ocr2", _ROTATE_HALF),
    "deepseek_ocr2_encoder": ("deepseek_ocr2.modeling_deepseek_ocr2", _ROTATE_HALF),
    # GLM-Image's autoregressive model (>= 5): MRoPE tables, Llama's rotation
    "glm_image": ("glm_image.modeling_glm_image", _ROTATE_HALF),
    "glm_image_text": ("glm_image.modeling_glm_image", _ROTATE_HALF),
    # HunYuan-VL's language model (>= 5): the rotation in float32, each result in its input's dtype
    "hunyuan_vl": ("hunyuan_vl.modeling_hunyuan_vl", _IN_FLOAT32),
    "hunyuan_vl_text": ("hunyuan_vl.modeling_hunyuan_vl", _IN_FLOAT32),
    # The audio encoders of GLM-ASR (>= 5; its language model is Llama, listed) and Voxtral
    # Realtime (>= 5; its language model, whose norms take a time embedding, is not listed: it
    # has no test here)
    "glmasr_encoder": ("glmasr.modeling_glmasr", _ROTATE_HALF),
    "voxtral_realtime_encoder": ("voxtral_realtime.modeling_voxtral_realtime", _ROTATE_HALF),
    # LASR's speech encoder, alone or in its CTC model (>= 5)
    "lasr_encoder": ("lasr.modeling_lasr", _ROTATE_HALF),
    "lasr_ctc": ("lasr.modeling_lasr", _ROTATE_HALF),
}
# The model types of GLM-4.1V's and GLM-4.5V's parts, as models built around them hold them
# (GLM-4.6V: GLM-4.1V's)
FAMILIES.update({f"{family}_{part}": FAMILIES[family] for family in ("glm4v", "glm4v_moe")
                 for part in ("text", "vision")})


_lock = threading.Lock()
# (module name, function name) -> the function whose probe passed there, held (an id() could
# name a later function at a freed one's address)
_verified = {}


def _original(cls, modeling, name):
    """What `name` of FAMILIES names for attention class cls: a function of its modeling
    module, or (SELF + method) the method cls has, as defined in that module (a staticmethod's
    function); None if cls has no such method of that module."""
    if not name.startswith(SELF):
        return getattr(modeling, name, None)
    method = next((c.__dict__[name[len(SELF):]] for c in cls.__mro__
                   if name[len(SELF):] in c.__dict__), None)
    method = getattr(method, "__func__", method)  # a staticmethod's function
    return method if getattr(method, "__module__", None) == modeling.__name__ else None


def _verify(modeling, name, replacement, probe, original):
    key = (modeling.__name__, getattr(original, "__qualname__", name))
    if _verified.get(key) is original:
        return
    # On the CPU whatever torch's defaults are (a model built under set_default_device); the
    # probes name their inputs' dtypes (the default dtype is the process's: another thread's
    # from_pretrained(dtype=...) sets it while it loads).
    # A function whose signature changed fails the probe's call: refused alike, not an error
    # from inside the probe.
    failure = None
    with torch.no_grad(), torch.device("cpu"):
        try:
            ok = probe(original, replacement)
        except Exception as e:  # any failure of the call is a mismatch
            ok, failure = False, f" (the probe's call failed: {type(e).__name__}: {e})"
    if not ok:
        import transformers

        raise RuntimeError(
            f"rope_ext.integrations.transformers.patch: {modeling.__name__}.{name} (transformers "
            f"{transformers.__version__}) does not compute what its rope_ext replacement does"
            f"{failure or ''}; refusing to patch. Either it was replaced or wrapped after "
            "transformers defined it, or this release computes otherwise (please report that)")
    _verified[key] = original


# ---- the patched forward: transformers' code with its RoPE call resolved to rope_ext ----

# The name under which a replacement is reachable from the modeling module's globals. The
# patched forward keeps the module's own (live) globals, so everything else it looks up (the
# attention interface, eager_attention_forward, a later monkeypatch of either) stays
# transformers' own; only the renamed RoPE call differs.
_PREFIX = "_rope_ext_"

# Opcodes that read a global; anything else naming a RoPE function (an attribute of the same
# name, a store) would change meaning when renamed, so such code is refused.
_GLOBAL_READS = {"LOAD_GLOBAL"}


def _code_names(code):
    """The global names `code` (and the code nested in it) reads."""
    names = set()
    for inst in dis.get_instructions(code):
        if inst.opname in _GLOBAL_READS:
            names.add(inst.argval)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
    return names


def _renamed_code(code, renames):
    for inst in dis.get_instructions(code):
        if inst.opcode in dis.hasname and inst.argval in renames and inst.opname not in _GLOBAL_READS:
            raise UnsupportedModelError(
                f"rope_ext.integrations.transformers.patch: {code.co_name} uses the name "
                f"{inst.argval!r} other than as a global function; not patchable")
    consts = tuple(_renamed_code(c, renames) if isinstance(c, types.CodeType) else c
                   for c in code.co_consts)
    return code.replace(co_names=tuple(renames.get(n, n) for n in code.co_names), co_consts=consts)


def _rebuilt(fn, make):
    """A copy of function `fn` with its code made by `make(plain function)`. fn may be a
    decorator's wrapper (functools.wraps, the wrapped function in one of its closure cells, as
    transformers' deprecate_kwarg makes them): the wrapper is rebuilt around the new function."""
    inner = getattr(fn, "__wrapped__", None)
    if inner is None:
        return make(fn)
    new_inner = _rebuilt(inner, make)
    cells, found = [], False
    for cell in fn.__closure__ or ():
        try:
            held = cell.cell_contents
        except ValueError:  # an empty cell
            held = None
        if held is inner:
            cells.append(types.CellType(new_inner))
            found = True
        else:
            cells.append(cell)
    if not found:
        raise UnsupportedModelError(
            f"rope_ext.integrations.transformers.patch: {fn.__qualname__} wraps its forward in "
            "a way rope_ext cannot rebuild; not patchable")
    new = _copy_function(fn, fn.__code__, tuple(cells))
    new.__wrapped__ = new_inner
    return new


def _copy_function(fn, code, closure):
    new = types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, closure)
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__dict__.update(fn.__dict__)
    new.__qualname__, new.__doc__, new.__module__ = fn.__qualname__, fn.__doc__, fn.__module__
    new.__annotations__ = dict(getattr(fn, "__annotations__", {}))
    return new


def _renaming(renames):
    """make() for _rebuilt: the function's global reads of `renames` read the new names."""
    return lambda fn: _copy_function(fn, _renamed_code(fn.__code__, renames), fn.__closure__)


def _fusing(rope_name, kind):
    """make() for _rebuilt: the q and k norms fused into the RoPE call (integrations/_qk_norm)."""
    def make(fn):
        norms = _qk_norm.norm_names(fn, rope_name, kind)
        new = norms and _qk_norm.rewritten_forward(fn, rope_name, kind, norms)
        if new is None:
            raise _NotFusable
        return new

    return make


class _NotFusable(Exception):
    pass


def _rope_calls(cls, modeling, functions):
    """The names of `functions` that cls.forward, code of `modeling`, calls (empty if none)."""
    fn = inspect.unwrap(getattr(cls, "forward", None) or (lambda: None))
    code = getattr(fn, "__code__", None)
    if code is None or getattr(fn, "__globals__", None) is not vars(modeling):
        return ()
    used = _code_names(code) | {SELF + n for n in code.co_names}  # (self.<method> as SELF names)
    called = {n for n in functions if n in used and _original(cls, modeling, n) is not None}
    return tuple(sorted(called - _given_a_slice_of_the_table(fn, called)))


_TABLES = ("cos", "sin")


def _given_a_slice_of_the_table(fn, names):
    """Those of `names` that fn's source calls with a slice of cos or sin, such as MiniMax-M3-VL's
    indexer (`cos[..., :self.head_dim]`): the slice's two halves differ, where the replacements
    read one half of a table that holds each angle twice. transformers' own code serves them."""
    tree = _qk_norm.definition(fn) if names else None
    if tree is None:
        return set()
    sliced = set()
    for call in ast.walk(tree):
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id in names:
            for arg in (*call.args, *(k.value for k in call.keywords)):
                if any(isinstance(n, ast.Subscript) and isinstance(n.value, ast.Name)
                       and n.value.id in _TABLES and isinstance(n.slice, (ast.Slice, ast.Tuple))
                       for n in ast.walk(arg)):
                    sliced.add(call.func.id)
    return sliced


# ---- the patched classes ----

class _PatchedAttention:
    """Marks the classes patch() makes (each `type(name, (original, _PatchedAttention))`)."""

    __slots__ = ()
    _rope_ext_spec = None  # (original class, RoPE function names, fused), set on each subclass

    def __reduce_ex__(self, protocol):
        # Pickle (torch.save) and deepcopy name the object's class; a class made at run time is
        # named by what rebuilds it: the original class (pickled by reference) and the spec.
        reduced = super().__reduce_ex__(protocol)
        return (_new_patched, self._rope_ext_spec) + tuple(reduced[2:])


# (original class, names, fused) -> (the class's forward it was made from, the patched class or
# None: cannot be fused); a forward replaced since then makes it anew
_classes = {}


def _patched_class(original, names, fused=False):
    """The patched subclass of `original` (made once per forward the class has), after checking
    that the functions `names` of its modeling module, as they are now, compute what their
    replacements do. fused: q_norm and k_norm fused into the RoPE call (True, or the kind of
    fusion: _qk_norm.ONE_TENSOR, VISION); None if the forward is not of a shape that allows it."""
    key = (original, tuple(names), fused)
    modeling = importlib.import_module(inspect.unwrap(original.forward).__module__)
    functions = _functions_of(modeling)
    for name in names:
        replacement, probe = functions[name]
        _verify(modeling, name, replacement, probe, _original(original, modeling, name))
    # The class a super().forward(...) in the forward reaches, patched too where it calls the
    # functions (transformers 4's SDPA attention classes hand output_attentions=True to their
    # eager parents: Qwen2-MoE's, StableLM's, DBRX's, ...): the patched class's bases
    # (original, parent patched) put it right after the original in the instance's MRO.
    parent = None if fused else _super_target(original)
    parent_names = _rope_calls(parent, modeling, functions) if parent is not None else ()
    base = _patched_class(parent, parent_names) if parent_names else _PatchedAttention
    with _lock:
        source = original.forward
        made = _classes.get(key)
        if made is not None and made[0] is source and (made[1] is None  # (not fusable)
                                                       or base in made[1].__bases__):
            return made[1]
        if fused:
            (rope_name,) = names
            try:
                forward = _rebuilt(source, _fusing(rope_name, fused))
            except _NotFusable:
                _classes[key] = (source, None)
                return None
            setattr(modeling, *_qk_norm.FUSED_CALLS[fused])
        else:
            global_names = [n for n in names if not n.startswith(SELF)]
            for name in global_names:
                setattr(modeling, _PREFIX + name, functions[name][0])
            forward = (_rebuilt(source, _renaming({n: _PREFIX + n for n in global_names}))
                       if global_names else source)  # (a method overridden alone: as it is)
        namespace = {"__slots__": (), "__module__": original.__module__,
                     "__qualname__": original.__qualname__, "__doc__": original.__doc__,
                     "forward": forward, "_rope_ext_spec": key}
        for name in names:
            if name.startswith(SELF):  # the method overridden, a staticmethod by a staticmethod
                method = name[len(SELF):]
                replacement = functions[name][0]
                namespace[method] = (staticmethod(replacement) if isinstance(
                    inspect.getattr_static(original, method), staticmethod) else replacement)
        patched = type(original)(original.__name__, (original, base), namespace)
        _classes[key] = (source, patched)
    return patched


def _super_target(cls):
    """The class whose forward a zero-argument super().forward in cls.forward calls (the next
    in cls's MRO that defines one), or None if cls.forward has no super()."""
    fn = inspect.unwrap(cls.forward)
    if "__class__" not in getattr(getattr(fn, "__code__", None), "co_freevars", ()):
        return None
    return next((c for c in cls.__mro__[1:] if "forward" in c.__dict__), None)


def _new_patched(original, names, fused=False):
    """An empty instance of the patched subclass of `original` (unpickling, deepcopy)."""
    cls = _patched_class(original, names, fused)
    return cls.__new__(cls)


# The kind of fusion (_qk_norm) of an attention whose one RoPE function is replaced by each.
_FUSED_KINDS = {hf.apply_rotary_pos_emb: True,
                hf.apply_rotary_pos_emb_optional_key: True,  # its attention passes q and k
                hf.apply_rotary_pos_emb_in_input_dtype: _qk_norm.IN_INPUT_DTYPE,
                hf.apply_rotary_pos_emb_single: _qk_norm.ONE_TENSOR,
                hf.apply_rotary_pos_emb_vision: _qk_norm.VISION}


def _fused_class(module, names, functions):
    """The fused patched class for `module`, or None (patch RoPE only)."""
    if len(names) != 1 or _qk_norm.qk_norm_api() is None:
        return None
    fused = _FUSED_KINDS.get(functions[names[0]][0])
    if fused is None:
        return None
    # The modules feeding the RoPE call, whatever their names (LFM2's q_layernorm), found in
    # the forward's code; fused only where they are per-head RMSNorms.
    norms = _qk_norm.norm_names(inspect.unwrap(type(module).forward), names[0], fused)
    if not norms or not _qk_norm.fusable_norms(module, fused == _qk_norm.ONE_TENSOR, norms):
        return None
    return _patched_class(type(module), names, fused=fused)


# modeling module name -> {function name: (replacement, probe)}, the first family's where
# several share a module; made at import, so that no thread sees it half filled
_functions_by_module = {f"transformers.models.{path}": functions
                        for path, functions in reversed(list(FAMILIES.values()))}


def _functions_of(modeling):
    try:
        return _functions_by_module[modeling.__name__]
    except KeyError:
        raise UnsupportedModelError(
            f"rope_ext.integrations.transformers: {modeling.__name__} is no module rope_ext "
            "patches") from None


# ---- patch / unpatch ----

def _model_type(model):
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type is not None and not isinstance(model_type, str):
        raise UnsupportedModelError(f"rope_ext.integrations.transformers.patch: config.model_type "
                                    f"must be a string, got {model_type!r}")
    if model_type is None:
        raise UnsupportedModelError(
            f"rope_ext.integrations.transformers.patch: {type(model).__name__} has no "
            "config.model_type; pass a transformers PreTrainedModel")
    return model_type


# Instance attributes that hold the module's own forward as a bound method: an instance forward,
# and accelerate's `_old_forward` (its hooks call it from the `forward` they install).
_BOUND_FORWARDS = ("forward", "_old_forward")


def _rebind(module, old, new):
    """Points the instance attributes holding `old` bound to `module` to `new` bound to it, so
    that a hook installed before patch (or before unpatch) calls the forward of the module's
    class; any other instance attribute is left as it is."""
    for name in _BOUND_FORWARDS:
        held = module.__dict__.get(name)
        if isinstance(held, types.MethodType) and held.__self__ is module and held.__func__ is old:
            module.__dict__[name] = types.MethodType(new, module)


def _listed_families(model):
    """{modeling module path: functions} of the listed model types of `model` and its parts (a
    module whose `config.model_type` is listed: a vision-language model's language model or
    vision tower, say). Types sharing a modeling module list the same replacement for a function
    they both list (a test holds FAMILIES to that), so their functions are merged."""
    found = {}
    for m in model.modules():
        model_type = getattr(getattr(m, "config", None), "model_type", None)
        if isinstance(model_type, str) and model_type in FAMILIES:
            path, functions = FAMILIES[model_type]
            found.setdefault(path, {}).update(functions)
    return found


def patch(model):
    """Routes `model`'s RoPE through rope_ext's ops; returns the model. Other models, patched or
    not, are unaffected. Patching a patched model does nothing. The model's own model type and
    those of its parts (each module's `config.model_type`) say which modeling code is patched: a
    LLaVA model's Llama, say, or the models held by a module of the caller's; parts of no listed
    type run transformers' code. Raises UnsupportedModelError (a ValueError) for a model with
    nothing rope_ext can patch (see FAMILIES)."""
    families = _listed_families(_module(model, "patch"))
    if not families:
        model_type = _model_type(model)
        raise UnsupportedModelError(
            f"rope_ext.integrations.transformers.patch: cannot patch {type(model).__name__} "
            f"(model_type {model_type!r}): neither it nor any of its parts is among the families "
            f"rope_ext's patch covers (each one is checked against its modeling code). Supported "
            f"model types: {', '.join(sorted(FAMILIES))}")
    modelings = [(importlib.import_module(f"transformers.models.{path}"), functions)
                 for path, functions in families.items()]
    targets, already, calls = [], False, {}
    for m in model.modules():
        if isinstance(m, _PatchedAttention):
            already = True
            continue
        cls = type(m)
        if cls not in calls:  # the same for every layer of a class
            calls[cls] = next(((names, functions) for modeling, functions in modelings
                               if (names := _rope_calls(cls, modeling, functions))), None)
        if calls[cls] is not None:
            targets.append((m, *calls[cls]))
    if not targets and not already:
        looked_for = "; ".join(f"{' or '.join(functions)} of {modeling.__name__}"
                               for modeling, functions in modelings)
        raise UnsupportedModelError(
            f"rope_ext.integrations.transformers.patch: found no attention module of "
            f"{type(model).__name__} calling {looked_for}; nothing to patch")
    # Every class is built (and its functions checked) before any module changes class.
    classes = [_fused_class(m, names, functions) or _patched_class(type(m), names)
               for m, names, functions in targets]
    for (m, _, _), cls in zip(targets, classes):
        _rebind(m, cls.__bases__[0].forward, cls.forward)
        m.__class__ = cls
    return model


# A class made from a patched one after patch() -> the class unpatch gives its modules.
_unpatched = weakref.WeakKeyDictionary()


def _binds(cls, value):
    """Whether code reachable from a class attribute refers to cls through its `__class__` cell
    (super()): the function itself, a method's, a property's, a cached property's, and what
    decorators wrap (`__wrapped__`, functions in their closures), a few levels deep."""
    todo, seen = [(value, 0)], set()
    while todo:
        v, depth = todo.pop()
        if depth > 4 or id(v) in seen:
            continue
        seen.add(id(v))
        for name in ("__func__", "fget", "fset", "fdel", "func", "__wrapped__"):
            inner = getattr(v, name, None)
            if inner is not None:
                todo.append((inner, depth + 1))
        for cell in getattr(v, "__closure__", None) or ():
            try:
                held = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if held is cls:
                return True
            if isinstance(held, (types.FunctionType, types.MethodType)):
                todo.append((held, depth + 1))
    return False


def _importable(cls):
    """Whether cls is what its module's namespace names it (pickle finds it by that name)."""
    found = sys.modules.get(cls.__module__)
    for part in cls.__qualname__.split("."):
        found = getattr(found, part, None)
    return found is cls


def _unpatched_class(cls):
    """The class a patched module goes back to: for a class patch() made, the original; for one
    made from it at run time since (FSDP2's fully_shard makes `FSDP<name>(FSDPModule, cls)`,
    parametrize `Parametrized<name>(cls)`), that class made anew over the original, so that
    unpatch keeps what it adds. A class that cannot be made again as it was (a class statement:
    pickled by its name, its methods' super() bound to it, its __init_subclass__ asking for
    arguments) gives the original class, as before it."""
    if "_rope_ext_spec" in cls.__dict__:
        return cls._rope_ext_spec[0]
    made = _unpatched.get(cls)
    if made is None:
        made = cls._rope_ext_spec[0]
        if not _importable(cls) and not any(_binds(cls, v) for v in cls.__dict__.values()):
            bases = tuple(_unpatched_class(b) if issubclass(b, _PatchedAttention) else b
                          for b in cls.__bases__)
            slots = cls.__dict__.get("__slots__", ())
            slots = (slots,) if isinstance(slots, str) else tuple(slots)
            namespace = {k: v for k, v in cls.__dict__.items()
                         if k not in ("__dict__", "__weakref__", *slots)}
            try:
                made = type(cls)(cls.__name__, bases, namespace)
            except Exception:  # a metaclass or __init_subclass__ that asks for more
                pass
        made = _unpatched.setdefault(cls, made)
    return made


def unpatch(model):
    """Undoes patch(model): its attention modules get their original classes back (or, where a
    class was made from the patched one since, such as FSDP2's or parametrize's, that class made
    from the original). Nothing else is touched (hooks, instance attributes). Returns the
    model; a model that is not patched is returned unchanged."""
    # Every class is made before any module changes class.
    targets = [(m, _unpatched_class(type(m))) for m in _module(model, "unpatch").modules()
               if isinstance(m, _PatchedAttention)]
    for m, cls in targets:
        _rebind(m, type(m).forward, cls.forward)
        m.__class__ = cls
    return model


def is_patched(model):
    return any(isinstance(m, _PatchedAttention) for m in _module(model, "is_patched").modules())


def _module(model, caller):
    if not isinstance(model, torch.nn.Module):
        raise UnsupportedModelError(f"rope_ext.integrations.transformers.{caller}: expected a "
                                    f"torch.nn.Module, got {type(model).__name__}")
    return model
