"""Hugging Face transformers' RoPE functions (the `apply_rotary_pos_emb` of its modeling files) on
rope_ext's native op, with transformers' signatures, broadcasting, dtype promotion and autograd.

    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
 -> from rope_ext.compat.transformers import apply_rotary_pos_emb

(`rope_ext.integrations.transformers.patch(model)` routes a whole model through these.)

The tables: transformers' rotary modules return cos/sin of cat(freqs, freqs), so the two halves of
their last dim are equal. rope_ext reads the first half only (a view, no copy): one rotation per
pair instead of transformers' five elementwise passes. Tables whose halves differ are outside that
contract, with one exception: when cos or sin require grad (or carry a forward-AD tangent), each
half is read where transformers reads it (two passes), so the tables' gradients are
transformers' own, half by half.
"""

import functools
import importlib.metadata

import torch
from torch.autograd import forward_ad

from .._args import mrope_section_arg
from .._compiling import compiling
from ._layout import (derivative_wanted, float32_table, join_members, ops, pair_members,
                      rotate_pairs)
from .llama import cos_sin

# Where a function differs between transformers 4 and 5, the installed major version picks the
# form (read from the package's metadata: transformers is not imported here).
try:
    TRANSFORMERS_5 = int(importlib.metadata.version("transformers").split(".")[0]) >= 5
except (importlib.metadata.PackageNotFoundError, ValueError):
    TRANSFORMERS_5 = False


def _check_width(x, cos, sin, what, name):
    rot = cos.shape[-1]
    if sin.shape[-1] != rot or rot % 2 or rot > x.shape[-1]:  # 0: nothing rotates (rotary_pct=0)
        raise ValueError(f"cos and sin of shapes {list(cos.shape)} and {list(sin.shape)}: their last "
                         f"dim must be one even {what} <= {name}.size(-1) = {x.shape[-1]}")


def _promoted(*tensors):
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def _seq_major(x):
    """x (b, h, s, d) is a transposed view of a contiguous (b, s, h, d) tensor."""
    return x.transpose(1, 2).is_contiguous()


def in_projection_order(unsqueeze_dim, q, k=None):
    """Whether transformers' q (and k), (batch, heads, seq, head_dim) for unsqueeze_dim 1, are
    views of (batch, seq, heads, head_dim) projections, not contiguous as they are. Its
    elementwise RoPE keeps that memory order, and attention's output (SDPA's on the CPU) follows
    q's, so that the transpose after it is a view: a contiguous (batch, heads, seq, head_dim)
    result would cost a copy of the attention output there (saved for backward in training).
    Rotated as their transposes, the results keep the order."""
    return (unsqueeze_dim == 1 and not q.is_contiguous() and _seq_major(q)
            and (k is None or (k.dim() == 4 and _seq_major(k))))


def _rotate_half_style(tensors, cos, sin, dtypes, interleaved=False):
    """Each x of `tensors`: x * cos + rotate_half(x) * sin on its first cos.size(-1) dims, the
    rest passed through, in its dtype of `dtypes`. rotate_half pairs dims (i, i + width/2), or
    (2i, 2i+1) if interleaved (Cohere's), and the tables hold each angle at both members."""
    first_c, second_c = pair_members(cos, interleaved)
    first_s, second_s = pair_members(sin, interleaved)
    first_c, first_s = float32_table(first_c), float32_table(first_s)
    if not derivative_wanted(cos, sin):
        return tuple(rotate_pairs(x, first_c, first_s, d, interleaved) for x, d in zip(tensors, dtypes))
    # Each pair's first member reads the tables' entry at its place, the second member its own.
    second_c, second_s = float32_table(second_c), float32_table(second_s)
    out = []
    for x, d in zip(tensors, dtypes):
        x = x.to(d)  # once: the two passes then save one copy of x for backward, not one each
        first = rotate_pairs(x, first_c, first_s, d, interleaved)
        second = rotate_pairs(x, second_c, second_s, d, interleaved)
        out.append(join_members(first, second, interleaved, cos.shape[-1]))
    return tuple(out)


# Up to this many elements of q and k together, one call rotates both: q and k are concatenated
# along the heads dim (a copy, cheap at this size) and split again (views). At decode sizes the
# op's fixed cost exceeds the copy's; above this, the copy costs more than a second call.
ONE_CALL_NUMEL = 1 << 16


def _fast_path(q, k, cos, sin, unsqueeze_dim):
    """(q_embed, k_embed) for the common call, in as few tensor ops and Python steps as possible
    (at decode sizes the call costs about what the rotation does): transformers' layouts
    (batch, heads, seq, head_dim) or (batch, seq, heads, head_dim), tables (batch, seq,
    rotary_dim) of q's dtype needing no gradient; None for anything else (the general path).
    k None: q alone, (q_embed,)."""
    dtype = q.dtype
    k_one = q if k is None else k
    if (cos.requires_grad or sin.requires_grad or forward_ad._current_level >= 0
            or k_one.dtype != dtype or cos.dtype != dtype
            or sin.dtype != dtype or unsqueeze_dim not in (1, 2)):
        return None
    q_shape, k_shape, shape = q.shape, k_one.shape, cos.shape
    if len(q_shape) != 4 or len(k_shape) != 4 or len(shape) != 3 or sin.shape != shape:
        return None
    b, t, rot = shape
    head_dim, seq = q_shape[3], 3 - unsqueeze_dim  # q's seq dim: 2, or 1 for (b, s, h, d)
    if rot % 2 or rot == 0 or rot > head_dim or k_shape[3] != head_dim:
        return None
    if (b != 1 and not b == q_shape[0] == k_shape[0]) or \
            (t != 1 and not t == q_shape[seq] == k_shape[seq]):
        return None  # the tables broadcast q or k to more rows: the general path expands them
    if in_projection_order(unsqueeze_dim, q, k):
        out = _fast_path(q.transpose(1, 2), None if k is None else k.transpose(1, 2), cos, sin, 2)
        return None if out is None else tuple(t.transpose(1, 2) for t in out)
    half = rot // 2
    if compiling():
        # A traced graph has no storage offsets, and no per-call cost for a copy to save.
        c = float32_table(cos.unsqueeze(unsqueeze_dim)[..., :half])
        s = float32_table(sin.unsqueeze(unsqueeze_dim)[..., :half])
        if k is None:
            return (ops.apply(q, c, s, False),)
        return ops.apply(q, c, s, False), ops.apply(k, c, s, False)
    # cos.unsqueeze(unsqueeze_dim)[..., :half] in one view op: a fresh as_strided view is the
    # op's cheapest table argument.
    sb, st, sd = cos.stride()
    if unsqueeze_dim == 1:
        size, stride = (b, 1, t, half), (sb, 0, st, sd)
        same_rest = q_shape[0] == k_shape[0] and q_shape[2] == k_shape[2]
    else:
        size, stride = (b, t, 1, half), (sb, st, 0, sd)
        same_rest = q_shape[0] == k_shape[0] and q_shape[1] == k_shape[1]
    c = cos.as_strided(size, stride)  # the storage offset is cos's own
    sb, st, sd = sin.stride()
    s = sin.as_strided(size, (sb, 0, st, sd) if unsqueeze_dim == 1 else (sb, st, 0, sd))
    if k is None:  # (small: the tables as they are, as for q and k in one call below)
        if q.numel() > ONE_CALL_NUMEL:
            c, s = float32_table(c), float32_table(s)
        return (ops.apply(q, c, s, False),)
    # Small q and k in one call, but not where they need gradients: views of one output refuse
    # in-place ops under autograd (q_embed *= scale would fail).
    if same_rest and q.numel() + k.numel() <= ONE_CALL_NUMEL and \
            not (q.requires_grad or k.requires_grad):
        both = ops.apply(torch.cat((q, k), unsqueeze_dim), c, s, False)
        return both.split_with_sizes((q_shape[unsqueeze_dim], k_shape[unsqueeze_dim]), unsqueeze_dim)
    c, s = float32_table(c), float32_table(s)
    return ops.apply(q, c, s, False), ops.apply(k, c, s, False)


def apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """transformers' apply_rotary_pos_emb (Llama, Mistral, Qwen2/3, Gemma, Phi-3, GPT-NeoX, ...):
    returns (q_embed, k_embed) = (q * cos + rotate_half(q) * sin, likewise for k), with cos and sin
    unsqueezed at `unsqueeze_dim` to broadcast over the heads (1 for (batch, heads, seq, head_dim),
    2 for (batch, seq, heads, head_dim)). cos, sin: (batch, seq, rotary_dim) as transformers'
    rotary modules make them, halves equal. rotary_dim < head_dim rotates the first rotary_dim
    dims and passes the rest through, as the GPT-NeoX and Phi-3 versions do. position_ids:
    unused, as in transformers 4; an int in its place is transformers 5's unsqueeze_dim, given
    positionally. Differentiable w.r.t. q, k, cos and sin. At small sizes, when neither q nor
    k requires grad, q_embed and k_embed may be views of one tensor, as torch's split returns
    them."""
    return _q_and_k(q, k, cos, sin, _unsqueeze_dim(position_ids, unsqueeze_dim), in_input_dtype=False)


def apply_rotary_pos_emb_optional_key(q, k=None, cos=None, sin=None, unsqueeze_dim=1):
    """Qwen4-Exp's apply_rotary_pos_emb: apply_rotary_pos_emb's (q_embed, k_embed), k optional:
    without it, q_embed alone (its indexer rotates its queries, and its pooled keys, in calls of
    their own, by keyword)."""
    if k is None:
        return apply_rotary_pos_emb_single(q, cos, sin, unsqueeze_dim=unsqueeze_dim)
    return apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)


def apply_rotary_pos_emb_latest_queries(q, k, cos, sin, unsqueeze_dim=1):
    """Muse Glimmer assistant's apply_rotary_pos_emb: k holds the target model's context before
    the positions of q, so the tables span k's positions and q takes their last q.size(-2) rows
    (the unsqueezed tables' dim -2, as there); k_embed as apply_rotary_pos_emb's."""
    rows = cos.dim() + 1
    if unsqueeze_dim % rows != rows - 2:  # (else dim -2 of the unsqueezed tables is the new one)
        q_len = q.size(-2)
        q_embed = apply_rotary_pos_emb_single(q, cos[..., -q_len:, :], sin[..., -q_len:, :],
                                              unsqueeze_dim=unsqueeze_dim)
    else:
        q_embed = apply_rotary_pos_emb_single(q, cos, sin, unsqueeze_dim=unsqueeze_dim)
    return q_embed, apply_rotary_pos_emb_single(k, cos, sin, unsqueeze_dim=unsqueeze_dim)


def apply_rotary_pos_emb_in_input_dtype(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """Olmo 2's and LFM3's apply_rotary_pos_emb: apply_rotary_pos_emb's rotation, each result in
    its input's dtype (float32 tables of a bfloat16 model give bfloat16 q_embed and k_embed, the
    rotation computed in float32 and rounded once)."""
    return _q_and_k(q, k, cos, sin, _unsqueeze_dim(position_ids, unsqueeze_dim), in_input_dtype=True)


def _unsqueeze_dim(position_ids, unsqueeze_dim):
    """unsqueeze_dim, also where transformers 5's signature (..., cos, sin, unsqueeze_dim=1) gave
    it positionally, in transformers 4's place of position_ids (a tensor or None, unused)."""
    if position_ids is None or isinstance(position_ids, torch.Tensor):
        return unsqueeze_dim
    if type(position_ids) is int and unsqueeze_dim == 1:
        return position_ids
    raise ValueError(f"position_ids (unused) must be a tensor or None, or the positional "
                     f"unsqueeze_dim of transformers 5 (an int, without unsqueeze_dim=), got "
                     f"{position_ids!r} and unsqueeze_dim={unsqueeze_dim!r}")


def _q_and_k(q, k, cos, sin, unsqueeze_dim, in_input_dtype):
    """(q_embed, k_embed) in q's and k's dtypes, or in torch's promotion of each with the tables."""
    fast = _fast_path(q, k, cos, sin, unsqueeze_dim)
    if fast is not None:
        return fast
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    _check_width(q, cos, sin, "rotary_dim", "q")
    _check_width(k, cos, sin, "rotary_dim", "k")
    dtypes = ((q.dtype, k.dtype) if in_input_dtype else
              (_promoted(q, cos, sin), _promoted(k, cos, sin)))
    return _rotate_half_style((q, k), cos, sin, dtypes)


def apply_rotary_pos_emb_indexed(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """transformers 4's PhiMoE apply_rotary_pos_emb: cos and sin (positions, rotary_dim) are
    gathered at position_ids (batch, seq) first (`cos[position_ids]`), then rotated as
    apply_rotary_pos_emb does. position_ids None or an int: apply_rotary_pos_emb itself
    (transformers 5's PhiMoE, which passes the gathered tables)."""
    if isinstance(position_ids, torch.Tensor):
        cos, sin, position_ids = cos[position_ids], sin[position_ids], None
    return apply_rotary_pos_emb(q, k, cos, sin, position_ids, unsqueeze_dim)


def apply_rotary_pos_emb_qkv_indexed(q, k, v, cos, sin, position_ids, unsqueeze_dim=1):
    """CLVP's apply_rotary_pos_emb: cos and sin (positions, rotary_dim) gathered at position_ids
    (batch, seq) first, then q, k and v each rotated as apply_rotary_pos_emb rotates q (its
    attention passes the first rotary_dim dims of each); (q_embed, k_embed, v_embed)."""
    cos, sin = cos[position_ids], sin[position_ids]
    q_embed, k_embed = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
    return q_embed, k_embed, apply_rotary_pos_emb_single(v, cos, sin, unsqueeze_dim=unsqueeze_dim)


def apply_rotary_pos_emb_negative(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """NanoChat's apply_rotary_pos_emb: its rotate_half flips the signs (x2, -x1), so each pair
    turns by the negative angle; apply_rotary_pos_emb with sin negated (exactly: a sign)."""
    return apply_rotary_pos_emb(q, k, cos, -sin, position_ids, unsqueeze_dim)


def apply_rotary_pos_emb_single(x, cos, sin, position_ids=None, unsqueeze_dim=1):
    """transformers' one-tensor apply_rotary_pos_emb (Gemma 3n and 4, which rotate q and k in
    separate calls): x * cos + rotate_half(x) * sin, as apply_rotary_pos_emb computes it for q.
    position_ids as apply_rotary_pos_emb's (Gemma 3n's in transformers 4)."""
    unsqueeze_dim = _unsqueeze_dim(position_ids, unsqueeze_dim)
    fast = _fast_path(x, None, cos, sin, unsqueeze_dim)
    if fast is not None:
        return fast[0]
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    _check_width(x, cos, sin, "rotary_dim", "x")
    return _rotate_half_style((x,), cos, sin, (_promoted(x, cos, sin),))[0]


def _pairs_rotated(rotate, q, k, cos, sin, position_ids, unsqueeze_dim, full_precision=False):
    """(q_embed, k_embed) of rotate(q, k, cos, sin, dtypes), the tables unsqueezed at
    unsqueeze_dim, each result in torch's promotion of its input with the tables; or, with
    full_precision, transformers' `(q.float() * cos + ...).to(q.dtype)` for both. q and k that
    are (batch, heads, seq, head_dim) views of (batch, seq, heads, head_dim) projections are
    rotated in the projections' order, which the results keep (see _fast_path)."""
    unsqueeze_dim = _unsqueeze_dim(position_ids, unsqueeze_dim)
    if (unsqueeze_dim == 1 and cos.dim() == 3 and q.dim() == 4 and k.dim() == 4
            and not q.is_contiguous() and _seq_major(q) and _seq_major(k)):
        out = _pairs_rotated(rotate, q.transpose(1, 2), k.transpose(1, 2), cos, sin, None, 2,
                             full_precision)
        return tuple(t.transpose(1, 2) for t in out)
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    if not full_precision:
        return rotate(q, k, cos, sin, (_promoted(q, cos, sin), _promoted(k, cos, sin)))
    # .float() rounds float64 q and k to float32; the arithmetic is then float32's, or float64's
    # for float64 tables, rounded to q's dtype. The op computes in float32 (for any dtype it
    # writes but float64) and rounds once: a float32 computation writes q's dtype directly.
    dtype = q.dtype
    compute = torch.promote_types(torch.float32, _promoted(cos, sin))
    out = dtype if compute == torch.float32 and dtype != torch.float64 else compute
    q, k = (x.float() if x.dtype == torch.float64 else x for x in (q, k))
    # (k of a wider dtype than q's, float32 for bfloat16 q, say: computed in its own, then rounded)
    got = rotate(q, k, cos, sin, (torch.promote_types(q.dtype, out), torch.promote_types(k.dtype, out)))
    return tuple(t.to(dtype) for t in got)


def _glm_pairs(q, k, cos, sin, dtypes):
    _check_width(q, cos, sin, "rotary_dim", "q")
    _check_width(k, cos, sin, "rotary_dim", "k")
    half = cos.shape[-1] // 2
    c, s = float32_table(cos[..., :half]), float32_table(sin[..., :half])
    return tuple(rotate_pairs(x, c, s, d, interleaved=True) for x, d in zip((q, k), dtypes))


def _cohere_pairs(q, k, cos, sin, dtypes, what="head_dim"):
    _check_width(q, cos, sin, what, "q")
    _check_width(k, cos, sin, what, "k")
    return _rotate_half_style((q, k), cos, sin, dtypes, interleaved=True)


def _glm4v_pairs(q, k, cos, sin, dtypes):
    return _cohere_pairs(q, k, cos, sin, dtypes, what="rotary_dim")


def _one_entry_per_pair(q, k, cos, sin, dtypes, interleaved=False):
    for x, name in ((q, "q"), (k, "k")):
        if sin.shape[-1] != cos.shape[-1] or 2 * cos.shape[-1] != x.shape[-1]:
            raise ValueError(f"cos and sin of shapes {list(cos.shape)} and {list(sin.shape)}: "
                             f"their last dim must be {name}.size(-1) / 2 = {x.shape[-1] / 2:g}")
    c, s = float32_table(cos), float32_table(sin)
    return tuple(rotate_pairs(x, c, s, d, interleaved=interleaved) for x, d in zip((q, k), dtypes))


def apply_rotary_pos_emb_interleaved_half_tables(q, k, cos, sin, position_ids=None,
                                                 unsqueeze_dim=1):
    """OpenAI Privacy Filter's apply_rotary_pos_emb: GPT-OSS's (tables of one entry per pair,
    any tables exact; torch's promotion of q (k) with the tables) on interleaved pairs (2i, 2i+1)
    of the whole head. Arguments as apply_rotary_pos_emb's."""
    return _pairs_rotated(functools.partial(_one_entry_per_pair, interleaved=True), q, k, cos, sin,
                          position_ids, unsqueeze_dim)


def _deinterleaved_pairs(q, k, cos, sin, dtypes):
    width = cos.shape[-1]
    for x, name in ((q, "q"), (k, "k")):
        if x.shape[-1] != width or width % 2 or sin.shape[-1] != width:
            raise ValueError(f"cos and sin of shapes {list(cos.shape)} and {list(sin.shape)}: "
                             f"their last dim must be {name}.size(-1) = {x.shape[-1]}, even (the "
                             "whole head rotates)")
    if derivative_wanted(cos, sin) and not TRANSFORMERS_5:  # (5 reads the first halves only)
        return _rotate_half_style([_deinterleaved(x) for x in (q, k)], cos, sin, dtypes)
    c, s = cos[..., : width // 2], sin[..., : width // 2]
    if (q.dim() == k.dim() == cos.dim() == 4 and cos.shape[1] == 1 and q.dtype == k.dtype
            == dtypes[0] == dtypes[1] and q.shape[0] == k.shape[0] and q.shape[2] == k.shape[2]
            and cos.shape[0] in (1, q.shape[0]) and cos.shape[2] in (1, q.shape[2])
            and q.numel() + k.numel() <= ONE_CALL_NUMEL and not (q.requires_grad or k.requires_grad)
            and forward_ad._current_level < 0):
        # Small (batch, heads, seq, width) q and k, as DeepSeek's attention has them at decode:
        # one copy and one rotation for both (such calls cost about what their Python does),
        # then views of it, as apply_rotary_pos_emb's one call
        both = ops.apply(_deinterleaved(torch.cat((q, k), dim=1)), c, s, False)
        return both.split_with_sizes((q.shape[1], k.shape[1]), dim=1)
    c, s = float32_table(c), float32_table(s)
    return tuple(rotate_pairs(_deinterleaved(x), c, s, d) for x, d in zip((q, k), dtypes))


def _deinterleaved(x):
    """x's last dim reordered from pairs (2i, 2i+1) to halves (i, i + width/2): a copy, as
    transformers makes it (torch's cat of the two members' strided views: several times faster
    than a reshape's copy of the pairs transposed where x is itself strided)."""
    return torch.cat(x.unflatten(-1, (-1, 2)).unbind(-1), dim=-1)


def apply_rotary_pos_emb_glm(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """GLM's, GLM-4's and Helium's apply_rotary_pos_emb: pairs (2i, 2i+1) of the first
    cos.size(-1) dims rotated by entry i of the tables' first half (transformers repeats each
    entry for both members of its pair, `cos[..., :width // 2].repeat_interleave(2)`; the second
    half is never read, so any tables are exact, their gradients too), the rest passed through;
    torch's promotion of q (k) with the tables. Arguments as apply_rotary_pos_emb's."""
    return _pairs_rotated(_glm_pairs, q, k, cos, sin, position_ids, unsqueeze_dim)


def apply_rotary_pos_emb_ernie(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """ERNIE 4.5's apply_rotary_pos_emb: GLM's rotation of the whole head, computed from
    `q.float()` and `k.float()` and both results in q's dtype."""
    return _pairs_rotated(_glm_pairs, q, k, cos, sin, position_ids, unsqueeze_dim,
                          full_precision=True)


def apply_rotary_pos_emb_cohere(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """Cohere's (Command R, Cohere2) apply_rotary_pos_emb: pairs (2i, 2i+1) of the whole head, the
    tables holding each angle at both members of its pair (its rotary module repeats each
    frequency twice, `repeat_interleave(freqs, 2)`); computed from `q.float()` and `k.float()`,
    both results in q's dtype. Tables whose pair members differ, as in apply_rotary_pos_emb: one
    pass reads the first members; two where the tables need gradients."""
    return _pairs_rotated(_cohere_pairs, q, k, cos, sin, position_ids, unsqueeze_dim,
                          full_precision=True)


def apply_rotary_pos_emb_glm4v(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """GLM-4.1V's apply_rotary_pos_emb (transformers 5): pairs (2i, 2i+1) of the first
    cos.size(-1) dims (the rest passed through), the tables holding each angle at both members
    of its pair, as its rotary module makes them; torch's promotion of q (k) with the tables.
    Tables whose pair members differ, as apply_rotary_pos_emb_cohere's."""
    return _pairs_rotated(_glm4v_pairs, q, k, cos, sin, position_ids, unsqueeze_dim)


def apply_rotary_pos_emb_half_tables(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """GPT-OSS's apply_rotary_pos_emb: pairs (i, i + head_dim/2) rotated by tables of one entry
    per pair, cos and sin (batch, seq, head_dim / 2) as its rotary module makes them (no
    duplicated halves, so any tables are exact); torch's promotion of q (k) with the tables.
    Arguments as apply_rotary_pos_emb's."""
    return _pairs_rotated(_one_entry_per_pair, q, k, cos, sin, position_ids, unsqueeze_dim)


def apply_rotary_pos_emb_interleave(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """DeepSeek-V3's apply_rotary_pos_emb_interleave (its MLA's `rope_interleave` weights, also
    LongCat-Flash's, GLM-4 MoE Lite's, Mistral 4's): pairs (2i, 2i+1) of the whole head rotated,
    and each result laid out de-interleaved, pair i's members at i and i + head_dim/2, as its
    attention reads them. The tables as apply_rotary_pos_emb's (halves equal; when they need
    gradients, read where the installed transformers reads them: both halves in 4, the first
    half in 5); arguments as its. At small sizes, when
    neither q nor k requires grad, q_embed and k_embed may be views of one tensor, as there.
    k None: q alone, (q_embed, None) (Mistral Large 4's layers that reuse another's keys)."""
    if k is None:  # an empty k beside q: no heads along the dim the tables are unsqueezed at
        dim = _unsqueeze_dim(position_ids, unsqueeze_dim)
        return _pairs_rotated(_deinterleaved_pairs, q, q.narrow(dim, 0, 0), cos, sin, None,
                              dim)[0], None
    return _pairs_rotated(_deinterleaved_pairs, q, k, cos, sin, position_ids, unsqueeze_dim)


def _sections(mrope_section, width):
    section = mrope_section_arg(mrope_section)  # 2.9 is not an int (transformers' split refuses it)
    if len(section) != 3 or min(section) < 0 or 2 * sum(section) != width:
        raise ValueError(f"mrope_section must be 3 ints >= 0 summing to cos.size(-1) / 2 = "
                         f"{width // 2}, got {list(mrope_section)}")
    return section


def _mixed(table, section, halves):
    """The (..., width) table whose chunk j of each half comes from component j of
    table (3, ..., width): Qwen2-VL's per-section choice of the temporal/height/width rows."""
    half, parts, start = table.shape[-1] // 2, [], 0
    for h in range(halves):
        for j, size in enumerate(section):
            parts.append(table[j, ..., h * half + start : h * half + start + size])
            start += size
        start = 0
    return torch.cat(parts, dim=-1)


def apply_multimodal_rotary_pos_emb(q, k, cos, sin, mrope_section, unsqueeze_dim=1):
    """transformers' Qwen2-VL / Qwen2.5-VL apply_multimodal_rotary_pos_emb: cos, sin (3, batch,
    seq, head_dim) hold the temporal, height and width tables; the pairs are split into
    mrope_section (3 ints summing to head_dim/2) and section j is rotated by table j. Returns
    (q_embed, k_embed). The rows of the 3 tables are gathered into one (batch, seq, head_dim/2)
    table (transformers gathers the full head_dim), then q and k rotate in one pass each."""
    if cos.dim() < 2 or cos.shape[0] != 3 or sin.shape != cos.shape:
        raise ValueError(f"cos and sin must have one shape (3, batch, seq, head_dim), got "
                         f"{list(cos.shape)} and {list(sin.shape)}")
    section = _sections(mrope_section, cos.shape[-1])
    halves = 2 if derivative_wanted(cos, sin) else 1  # both halves only when the tables need grads
    cos = _mixed(cos, section, halves).unsqueeze(unsqueeze_dim)
    sin = _mixed(sin, section, halves).unsqueeze(unsqueeze_dim)
    dtypes = (_promoted(q, cos, sin), _promoted(k, cos, sin))
    if halves == 2:
        _check_width(q, cos, sin, "head_dim", "q")
        _check_width(k, cos, sin, "head_dim", "k")
        return _rotate_half_style((q, k), cos, sin, dtypes)
    cos, sin = float32_table(cos), float32_table(sin)
    return rotate_pairs(q, cos, sin, dtypes[0]), rotate_pairs(k, cos, sin, dtypes[1])


def apply_multimodal_rotary_pos_emb_glm4v(q, k, cos, sin, mrope_section, unsqueeze_dim=1):
    """transformers 4's GLM-4.1V apply_multimodal_rotary_pos_emb: the sections of cos, sin (3,
    batch, seq, rotary_dim) chosen as Qwen2-VL's are, then GLM's rotation of the first rotary_dim
    dims (apply_rotary_pos_emb_glm: pairs (2i, 2i+1) by the chosen tables' first half)."""
    if cos.dim() < 2 or cos.shape[0] != 3 or sin.shape != cos.shape:
        raise ValueError(f"cos and sin must have one shape (3, batch, seq, rotary_dim), got "
                         f"{list(cos.shape)} and {list(sin.shape)}")
    section = _sections(mrope_section, cos.shape[-1])
    return apply_rotary_pos_emb_glm(q, k, _mixed(cos, section, 2), _mixed(sin, section, 2),
                                    unsqueeze_dim=unsqueeze_dim)


def apply_rotary_pos_emb_vision(q, k, cos, sin):
    """transformers' Qwen2-VL / Qwen2.5-VL vision-tower apply_rotary_pos_emb_vision: q, k (seq,
    heads, head_dim), cos, sin (seq, head_dim), halves equal; computed in float32 and returned in
    q's and k's dtypes (float64 inputs stay float64 throughout)."""
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    _check_width(q, cos, sin, "head_dim", "q")
    _check_width(k, cos, sin, "head_dim", "k")
    return _rotate_half_style((q, k), cos, sin, (q.dtype, k.dtype))


def apply_rotary_pos_emb_patches(q, k, cos, sin, **kwargs):
    """DINOv3's apply_rotary_pos_emb: q, k (batch, heads, tokens, head_dim) whose last
    cos.size(-2) tokens are an image's patches, rotated by cos, sin (patches, head_dim) (halves
    equal); the tokens before them (the class and register tokens) pass through. Results in
    torch's promotion of each input with the tables."""
    patches = cos.shape[-2] if cos.dim() >= 2 else -1
    if not 0 <= patches <= min(q.shape[-2], k.shape[-2]) or sin.shape != cos.shape:
        raise ValueError(f"cos and sin of shapes {list(cos.shape)} and {list(sin.shape)} must be one "
                         f"(patches, head_dim) shape with patches <= the tokens of q "
                         f"{list(q.shape)} and k {list(k.shape)}")
    out = []
    for x, name in ((q, "q"), (k, "k")):
        _check_width(x, cos, sin, "head_dim", name)
        prefix, tail = x.split((x.shape[-2] - patches, patches), dim=-2)
        # the tables with x's number of dims: the op broadcasts them as they are (torch's
        # broadcast_shapes, which the general path takes, costs 17 us a call)
        pad = (None,) * (tail.dim() - cos.dim())
        rotated, = _rotate_half_style((tail,), cos[pad], sin[pad], (_promoted(tail, cos, sin),))
        out.append(torch.cat((prefix.to(rotated.dtype), rotated), dim=-2))
    return tuple(out)


def apply_rotary_pos_emb_trailing(x, cos, sin, unsqueeze_dim=1):
    """DeepSeek-V4's apply_rotary_pos_emb: one tensor x (..., head_dim) whose last 2 *
    cos.size(-1) dims are rotated, pairs (2i, 2i+1), by cos and sin of one entry per pair
    unsqueezed at unsqueeze_dim (its attention passes -sin to undo the rotation); the dims before
    them pass through. Computed in float32 (float64 for float64 x, where transformers rounds to
    float32 first), the result in x's dtype."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    rot = 2 * cos.shape[-1]
    if sin.shape != cos.shape or not 0 < rot <= x.shape[-1]:
        raise ValueError(f"cos and sin of shapes {list(cos.shape)} and {list(sin.shape)} "
                         f"(unsqueezed) must be one shape (..., rope_dim / 2) with 0 < rope_dim "
                         f"<= x.size(-1) = {x.shape[-1]}")
    nope, rope = x.split((x.shape[-1] - rot, rot), dim=-1)
    rotated = rotate_pairs(rope, float32_table(cos), float32_table(sin), x.dtype, interleaved=True)
    return torch.cat((nope, rotated), dim=-1) if rot < x.shape[-1] else rotated


def _pairs_in_float32(x, cos, sin):
    """SAM's `(x.float() * cos + rotate_pairwise(x.float()) * sin).type_as(x)`: pairs (2i, 2i+1)
    by tables holding each angle at both members, rounded once to x's dtype."""
    return _rotate_half_style((x,), cos, sin, (x.dtype,), interleaved=True)[0]


def apply_rotary_pos_emb_2d(q, k, cos, sin, num_k_exclude_rope=0, repeat_freqs_k=False):
    """SAM 2's and SAM 3 tracker's apply_rotary_pos_emb_2d (their video memory attention): q and
    the keys before the last num_k_exclude_rope (object pointers, passed through) rotated, pairs
    (2i, 2i+1), by tables (1, tokens, head_dim) holding each angle at both members; with
    repeat_freqs_k, keys of several frames (a multiple of q's tokens) by the tables repeated per
    frame. In float32, each result in its input's dtype."""
    split = k.shape[-2] - num_k_exclude_rope
    k_rot, k_pass = k[..., :split, :], k[..., split:, :]
    q_embed = _pairs_in_float32(q, cos, sin)
    if k_rot.shape[-2] == 0:
        return q_embed, torch.cat([k_rot, k_pass], dim=-2)
    if repeat_freqs_k and k_rot.shape[-2] != q.shape[-2]:
        frames = k_rot.shape[-2] // q.shape[-2]
        cos, sin = cos.repeat(1, 1, frames, 1), sin.repeat(1, 1, frames, 1)
    return q_embed, torch.cat([_pairs_in_float32(k_rot, cos, sin), k_pass], dim=-2)


def apply_rotary_pos_emb_2d_qk(q, k, cos, sin):
    """EdgeTAM's apply_rotary_pos_emb_2d_self_attn: q and k rotated as apply_rotary_pos_emb_2d
    rotates them."""
    return _pairs_in_float32(q, cos, sin), _pairs_in_float32(k, cos, sin)


def apply_rotary_pos_emb_vision_pairs(q, k, cos, sin):
    """Inkling 2's vision apply_rotary_pos_emb_vision: Qwen2-VL's (q and k (seq, heads, head_dim),
    tables (seq, head_dim) over the heads, computed in float32, each result in its input's dtype)
    on pairs (2i, 2i+1) by tables holding each angle at both members (SAM's pairs)."""
    return apply_rotary_pos_emb_2d_qk(q, k, cos.unsqueeze(-2), sin.unsqueeze(-2))


def apply_rotary_pos_emb_2d_cross_attn(q, k, cos, sin, cos_k, sin_k, num_k_exclude_rope=0,
                                       repeat_freqs_k=1):
    """EdgeTAM's apply_rotary_pos_emb_2d_cross_attn: q rotated by cos/sin; the keys before the
    last num_k_exclude_rope (passed through) are repeat_freqs_k groups of temporal tokens (passed
    through) then spatial ones, rotated by cos_k/sin_k."""
    q_embed = _pairs_in_float32(q, cos, sin)
    split = k.shape[-2] - num_k_exclude_rope
    k_rot, k_excluded = k[..., :split, :], k[..., split:, :]
    if k_rot.shape[-2] == 0:
        return q_embed, k_excluded
    batch, heads, tokens, dim = k_rot.shape
    per_group = tokens // repeat_freqs_k
    temporal = per_group - cos_k.shape[-2]
    grouped = k_rot.view(batch, heads, repeat_freqs_k, per_group, dim)
    if repeat_freqs_k > 1:
        cos_k, sin_k = cos_k.repeat(1, 1, repeat_freqs_k, 1), sin_k.repeat(1, 1, repeat_freqs_k, 1)
    spatial = _pairs_in_float32(grouped[..., temporal:, :].reshape(batch, heads, -1, dim),
                                cos_k, sin_k)
    joined = torch.cat([grouped[..., :temporal, :],
                        spatial.view(batch, heads, repeat_freqs_k, -1, dim)], dim=3)
    return q_embed, torch.cat([joined.view(batch, heads, tokens, dim), k_excluded], dim=-2)


def apply_rotary_position_embeddings(sinusoidal_pos, query_layer, key_layer, value_layer=None):
    """RoFormer's self-attention method (a static method) of this name: the table (..., seq,
    head_dim) holds each pair's sin in its first half and its cos in the second (one entry per
    pair), the pairs (2i, 2i+1) of the whole head; value_layer rotated too where given (RoFormer's
    rotary_value). Returns (query, key) or (query, key, value), each in torch's promotion of its
    input with the table."""
    tensors = (query_layer, key_layer) if value_layer is None else (query_layer, key_layer,
                                                                   value_layer)
    width = sinusoidal_pos.shape[-1]
    for x, name in zip(tensors, ("query_layer", "key_layer", "value_layer")):
        if width % 2 or x.shape[-1] != width:
            raise ValueError(f"sinusoidal_pos of shape {list(sinusoidal_pos.shape)}: its last dim "
                             f"must be {name}.size(-1) = {x.shape[-1]}, even (sin then cos of "
                             "each pair)")
    sin, cos = sinusoidal_pos.chunk(2, dim=-1)
    c, s = float32_table(cos), float32_table(sin)
    return tuple(rotate_pairs(x, c, s, _promoted(x, sinusoidal_pos), interleaved=True)
                 for x in tensors)


def apply_rotary_embedding_to_hidden_states(self, hidden_states, relative_position_embeddings):
    """Wav2Vec2-Conformer's self-attention method `_apply_rotary_embedding` (Wav2Vec2-BERT's and
    SeamlessM4T's speech encoder's are copies): hidden_states (batch, seq, heads * head_size),
    seen as self.num_heads heads of self.head_size, rotated before the q and k projections
    (rotate_half pairs (i, i + head_size / 2)) by relative_position_embeddings (2, >= seq, 1, 1,
    head_size): cos, then sin, each angle at both members of its pair (the first half is read).
    The result (batch, seq, heads * head_size), in torch's promotion with the tables."""
    batch, seq, _ = hidden_states.size()
    x = hidden_states.view(batch, seq, self.num_heads, self.head_size)
    tables = relative_position_embeddings[:, :seq].transpose(1, 2)  # (2, 1, seq, 1, head_size)
    cos, sin = tables[0], tables[1]
    _check_width(x, cos, sin, "head_size", "hidden_states viewed as heads")
    out = _rotate_half_style((x,), cos, sin, (_promoted(x, cos, sin),))[0]
    return out.view(batch, seq, self.num_heads * self.head_size)


def apply_rotary_pos_emb_gptj(tensor, sin, cos):
    """transformers' GPT-J apply_rotary_pos_emb(tensor, sin, cos) (note the order): tensor (batch,
    seq, heads, rotary_dim), sin/cos (batch, seq, rotary_dim / 2), pairs (2i, 2i+1) (GPT-J's
    rotate_every_two); returns tensor * cos + rotate_every_two(tensor) * sin with cos/sin repeated
    per pair. A wider tensor passes its dims past rotary_dim through. Exact for any tables:
    GPT-J repeats each entry for both members of its pair, as rope_ext reads it."""
    if tensor.dim() != 4 or cos.dim() != 3 or sin.shape != cos.shape:
        raise ValueError(f"tensor must be (batch, seq, heads, rotary_dim) and sin, cos (batch, seq, "
                         f"rotary_dim / 2), got tensor {list(tensor.shape)}, sin {list(sin.shape)} "
                         f"and cos {list(cos.shape)}")
    if 2 * cos.shape[-1] > tensor.shape[-1]:
        raise ValueError(f"rotary_dim = 2 * cos.size(-1) = {2 * cos.shape[-1]} must be <= "
                         f"tensor.size(-1) = {tensor.shape[-1]}")
    dtype = _promoted(tensor, cos, sin)
    cos, sin = float32_table(cos[:, :, None, :]), float32_table(sin[:, :, None, :])
    return rotate_pairs(tensor, cos, sin, dtype, interleaved=True)


def apply_rotary_emb_complex(xq, xk, freqs_cis):
    """transformers' Llama 4 apply_rotary_emb(xq, xk, freqs_cis): pair (2i, 2i+1) of each head of
    xq (batch, seq, heads, head_dim) and xk, read as a complex number, times freqs_cis (batch,
    seq, head_dim / 2) (complex, any modulus: Llama 4 scales it by its attention factor) placed
    over the heads (`freqs_cis[:, :, None, :]`); computed in float32, each result rounded once to
    its input's dtype (float64 inputs stay float64, where transformers rounds them to float32
    first). Differentiable w.r.t. xq, xk and freqs_cis."""
    # freqs_cis[:, :, None, :]; for its 3 dims one unsqueeze, half the cost of the indexing
    return _complex_pairs(xq, xk, freqs_cis.unsqueeze(2) if freqs_cis.dim() == 3 else
                          freqs_cis[:, :, None, :])


def apply_rotary_emb_complex_heads_first(xq, xk, freqs_cis):
    """DeepSeek-V2's apply_rotary_emb: apply_rotary_emb_complex for xq (batch, heads, seq,
    rope_dim) and xk, freqs_cis (batch, seq, rope_dim / 2) placed at `freqs_cis.unsqueeze(1)`."""
    return _complex_pairs(xq, xk, freqs_cis.unsqueeze(1))


def vision_apply_rotary_emb(query, key, freqs_ci):
    """Llama 4's vision_apply_rotary_emb: apply_rotary_emb_complex for query (batch, patches,
    heads, head_dim) and key, freqs_ci (patches, 1, head_dim / 2) viewed as (1, patches, 1,
    head_dim / 2) (its reshape_for_broadcast)."""
    pairs = (*query.shape[:-1], query.shape[-1] // 2)
    placed = [n if i in (1, len(pairs) - 1) else 1 for i, n in enumerate(pairs)]
    if query.dim() < 3 or freqs_ci.numel() != placed[1] * placed[-1]:
        raise ValueError(f"freqs_ci of shape {list(freqs_ci.shape)} must hold query.size(1) x "
                         f"query.size(-1) / 2 entries for query (batch, patches, heads, head_dim) "
                         f"of shape {list(query.shape)}")
    return _complex_pairs(query, key, freqs_ci.view(placed))


def _complex_pairs(xq, xk, table):
    """xq and xk with pair (2i, 2i+1) times table[..., i] (complex, broadcast over them)."""
    for x, name in ((xq, "xq"), (xk, "xk")):
        if x.shape[-1] % 2 or table.shape[-1] != x.shape[-1] // 2:
            raise ValueError(f"freqs_cis of shape {list(table.shape)} (placed over the heads) must "
                             f"have {name}.size(-1) / 2 entries per row, {name} an even last dim; "
                             f"got {name} {list(x.shape)}")
    cos, sin = (float32_table(t) for t in cos_sin(table))
    return (rotate_pairs(xq, cos, sin, xq.dtype, interleaved=True),
            rotate_pairs(xk, cos, sin, xk.dtype, interleaved=True))
