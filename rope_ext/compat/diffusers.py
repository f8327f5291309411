"""Hugging Face diffusers' RoPE functions (0.42) on rope_ext's native op, with diffusers'
signatures, broadcasting, output dtypes and autograd.

    from diffusers.models.embeddings import apply_rotary_emb
 -> from rope_ext.compat.diffusers import apply_rotary_emb

(`rope_ext.integrations.diffusers.patch(model)` routes a whole model through these, and through
one_pass_tables where it fuses a processor's q/k norms with its RoPE.)

The tables. diffusers' real form passes cos/sin of the full head dim, each pair's angle written
twice: `repeat_interleave` (pairs (2i, 2i+1), `use_real_unbind_dim=-1`) or `cat` (pairs
(i, i + D/2), `use_real_unbind_dim=-2`). rope_ext reads one entry per pair, once. Its output is
diffusers' for any tables all the same: a table whose two entries of some pair differ (or a table
that requires grad) goes through two passes, each exact for one member of every pair, so values
and gradients are diffusers' own. Which case a table is takes one comparison of its two halves at
each call (a table's values can change without a version bump, so none is remembered).
Under torch.compile the comparison runs in the graph at each call and torch.cond picks the path
(the two passes where x needs a gradient); tensor subclasses take the two passes. See
docs/diffusers.md.
"""

import torch

from .._compiling import compiling
from ._layout import (broadcast_shape, broadcasts_within, comparable, derivative_wanted,
                      float32_table, join_members, pair_members, rotate_pairs)


def _one_per_pair(table, interleaved, compact):
    """The (..., D/2) table of one entry per pair when both members of every pair hold the same
    value, else None. Compared at every call: a table's values can change without a version
    bump (`t.data.copy_(...)`, `t.data = ...`), so nothing about them is remembered (the
    comparison reads the table once: a few percent of what the rotation moves where the table
    broadcasts over x's heads, about what x's pass moves where it does not, as LTX-Video's).
    compact: the entries copied into a contiguous table, which the kernel reads fastest when
    each table row serves several of x's rows; a table as large as x is read once either way,
    and the copy would be a third pass over it."""
    if compiling() or not comparable(table):
        return None  # no data to compare here
    first, second = pair_members(table, interleaved)
    if not torch.equal(first, second):
        return None
    return float32_table(first).contiguous() if compact else float32_table(first)


def _check_x(x, name="x"):
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() != 4:
        what = f"{x.dtype} tensor of shape {list(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{name} must be a 4-D floating-point tensor (batch, heads, seq, head_dim) "
                         f"or (batch, seq, heads, head_dim), got {what}")
    if x.shape[-1] % 2:
        raise ValueError(f"{name}.size(-1) = {x.shape[-1]} must be even")


def _check_float_tables(cos, sin):
    for t, name in ((cos, "cos"), (sin, "sin")):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"freqs_cis: {name} must be a floating-point tensor, got {got}")


def _check_tables(x, cos, sin):
    for t, name in ((cos, "cos"), (sin, "sin")):
        if t.shape[-1] != x.shape[-1]:
            raise ValueError(f"freqs_cis: {name} of shape {list(t.shape)} must have the head dim "
                             f"x.size(-1) = {x.shape[-1]} as its last dim")
    try:
        broadcast_shape(x.shape, cos.shape, sin.shape)
    except RuntimeError:
        raise ValueError(f"freqs_cis: cos {list(cos.shape)} and sin {list(sin.shape)} (as placed "
                         f"against x) do not broadcast with x of shape {list(x.shape)}") from None


def _float_math(x, c, s, interleaved):
    """rotate_pairs as diffusers computes `x.float() * cos + ...`: in float32 (float64 x too,
    which diffusers rounds to float32 first), in float64 when a table is float64 (a float64 x
    then unrounded: more accurate than diffusers by x's float32 rounding, and differentiable
    as float64 math is, which gradcheck needs); returned in x's dtype. Half-precision x needs
    no copy: the op computes in float32 and rounds once."""
    if torch.float64 in (c.dtype, s.dtype):
        dtype = torch.float64
    else:
        dtype = torch.float32 if x.dtype == torch.float64 else x.dtype
    return rotate_pairs(x, c, s, dtype, interleaved).to(x.dtype)


def _two_passes(x, cos, sin, interleaved):
    """Exact for any placed full-width tables: one pass per member of the pairs."""
    (c0, c1), (s0, s1) = pair_members(cos, interleaved), pair_members(sin, interleaved)
    first = _float_math(x, float32_table(c0), float32_table(s0), interleaved)
    second = _float_math(x, float32_table(c1), float32_table(s1), interleaved)
    return join_members(first, second, interleaved, x.shape[-1])


def _one_pass(x, cos, sin, interleaved):
    """For placed full-width tables whose pairs hold one value: each pair's first entry."""
    return _float_math(x, float32_table(pair_members(cos, interleaved)[0]),
                       float32_table(pair_members(sin, interleaved)[0]), interleaved)


def _paired(x, cos, sin, interleaved):
    """The (..., D/2) tables (cos, sin) of one entry per pair, or None (see _one_per_pair;
    compacted where they broadcast over x)."""
    compact = cos.numel() < x.numel()
    c = _one_per_pair(cos, interleaved, compact)
    s = None if c is None else _one_per_pair(sin, interleaved, compact)
    return None if c is None or s is None else (c, s)


def _paired_pred(cos, sin, interleaved):
    """A 0-d bool tensor: both tables hold one value per pair."""
    (c0, c1), (s0, s1) = pair_members(cos, interleaved), pair_members(sin, interleaved)
    return torch.logical_and((c0 == c1).all(), (s0 == s1).all())


def _real(x, cos, sin, interleaved, place=lambda t: t):
    """x * cos + rotated(x) * sin for full-width tables, placed against x by `place` (diffusers'
    indexing), computed as _float_math does and returned in x's dtype. The check
    for one entry per pair looks at cos and sin themselves, the objects a model passes to every
    layer, at each call."""
    _check_float_tables(cos, sin)
    cos, sin = cos.to(x.device), sin.to(x.device)
    _check_tables(x, place(cos), place(sin))
    grads = derivative_wanted(cos, sin)
    if not grads and compiling() and not (torch.is_grad_enabled() and x.requires_grad):
        # In a graph the comparison runs each call too (a table's size, next to x's heads times
        # that), and torch.cond takes the one pass where it may.
        return torch.cond(_paired_pred(cos, sin, interleaved),
                          _one_pass_true if interleaved else _one_pass_false,
                          _two_passes_true if interleaved else _two_passes_false,
                          (x, place(cos), place(sin)))
    paired = None if grads else _paired(x, cos, sin, interleaved)
    if paired is not None:
        return _float_math(x, place(paired[0]), place(paired[1]), interleaved)
    return _two_passes(x, place(cos), place(sin), interleaved)


# torch.cond's branches: functions of tensors only.
def _one_pass_true(x, cos, sin):
    return _one_pass(x, cos, sin, True)


def _one_pass_false(x, cos, sin):
    return _one_pass(x, cos, sin, False)


def _two_passes_true(x, cos, sin):
    return _two_passes(x, cos, sin, True)


def _two_passes_false(x, cos, sin):
    return _two_passes(x, cos, sin, False)


def _at_seq2(t):
    return t[None, None, :, :]


def _at_seq1(t):
    return t[None, :, None, :]


def _at_front(t):
    return t[None, None]


# apply_rotary_emb's sequence_dim -> how it places a (S, D) table against x
_PLACES = {2: _at_seq2, 1: _at_seq1}
# use_real_unbind_dim -> whether the pairs are (2i, 2i+1) (else (i, i + D/2))
_INTERLEAVED = {-1: True, -2: False}


def _complex_members(freqs_cis, unsqueeze_dim, device):
    """The real and imaginary parts of freqs_cis.unsqueeze(unsqueeze_dim) on `device`: the cos
    and sin of each (2i, 2i+1) pair (a conjugate view, which view_as_real refuses, resolved)."""
    ri = torch.view_as_real(freqs_cis.unsqueeze(unsqueeze_dim).to(device).resolve_conj())
    return ri[..., 0], ri[..., 1]


def _complex(x, freqs_cis, unsqueeze_dim):
    """diffusers' complex form: x's interleaved pairs as complex numbers times
    freqs_cis.unsqueeze(unsqueeze_dim), in x's dtype."""
    if not isinstance(freqs_cis, torch.Tensor) or not freqs_cis.is_complex():
        got = freqs_cis.dtype if isinstance(freqs_cis, torch.Tensor) else type(freqs_cis).__name__
        raise ValueError(f"freqs_cis must be a complex tensor when use_real=False, got {got}")
    f_shape = freqs_cis.unsqueeze(unsqueeze_dim).shape
    pairs = x.shape[:-1] + (x.shape[-1] // 2,)
    try:
        shape = broadcast_shape(pairs, f_shape)
    except RuntimeError:
        shape = None
    if shape is None or len(shape) != 4 or shape[-1] != pairs[-1]:
        raise ValueError(f"freqs_cis of shape {list(freqs_cis.shape)}, unsqueezed at dim "
                         f"{unsqueeze_dim}, must broadcast with x's {list(pairs)} complex pairs "
                         f"to 4 dims ending in {pairs[-1]}")
    return _float_math(x, *_complex_members(freqs_cis, unsqueeze_dim, x.device), interleaved=True)


def _among(value, table):
    """value in table, False for an unhashable value ([1]: diffusers' == tests say no too)."""
    try:
        return value in table
    except TypeError:
        return False


def _unbind_layout(use_real_unbind_dim):
    if not _among(use_real_unbind_dim, _INTERLEAVED):
        raise ValueError(f"`use_real_unbind_dim={use_real_unbind_dim}` but should be -1 or -2.")
    return _INTERLEAVED[use_real_unbind_dim]


def _cos_sin(freqs_cis):
    try:
        cos, sin = freqs_cis
    except (TypeError, ValueError):
        raise ValueError("freqs_cis must be a (cos, sin) pair of tensors when use_real=True, got "
                         f"{type(freqs_cis).__name__}") from None
    return cos, sin


def apply_rotary_emb(x, freqs_cis, use_real=True, use_real_unbind_dim=-1, sequence_dim=2):
    """diffusers.models.embeddings.apply_rotary_emb: returns x rotated, in x's dtype.

    x: (B, H, S, D) for sequence_dim=2, (B, S, H, D) for sequence_dim=1.
    use_real=True: freqs_cis = (cos, sin), each (S, D) (anything diffusers' indexing
    cos[None, None, :, :] / cos[None, :, None, :] broadcasts against x), computed in float32
    (float64 x included, as diffusers' x.float() does; float64 tables: float64);
    use_real_unbind_dim=-1 rotates pairs (2i, 2i+1) (FLUX, HunyuanVideo, CogVideoX), -2 pairs
    (i, i + D/2) (CogView4, Stable Audio, OmniGen, Cosmos).
    use_real=False: freqs_cis is complex and multiplies x's (2i, 2i+1) pairs after
    freqs_cis.unsqueeze(2) (Lumina: freqs_cis (B, S, D/2) against x (B, S, H, D)); sequence_dim
    is not read, as in diffusers.
    Differentiable w.r.t. x and the tables."""
    if use_real and isinstance(x, torch.Tensor) and 2 <= x.dim() < 4:
        # (CogView4's training processor rotates (H, S, D) slices of packed batches): diffusers'
        # cos[None, None] broadcasts such an x to 4 dims, and so its result
        x = x.reshape((1,) * (4 - x.dim()) + tuple(x.shape))
    _check_x(x)
    if not use_real:
        return _complex(x, freqs_cis, 2)
    interleaved = _unbind_layout(use_real_unbind_dim)
    if not _among(sequence_dim, _PLACES):
        raise ValueError(f"`sequence_dim={sequence_dim}` but should be 1 or 2.")
    cos, sin = _cos_sin(freqs_cis)
    return _real(x, cos, sin, interleaved, _PLACES[sequence_dim])


def apply_rotary_emb_qwen(x, freqs_cis, use_real=True, use_real_unbind_dim=-1):
    """diffusers' QwenImage apply_rotary_emb_qwen: x (B, S, H, D). use_real=False (what
    QwenImage's processors use): complex freqs_cis (S, D/2), unsqueezed at dim 1, multiplies
    the (2i, 2i+1) pairs. use_real=True: (cos, sin) placed as cos[None, None], as diffusers does."""
    _check_x(x)
    if not use_real:
        return _complex(x, freqs_cis, 1)
    interleaved = _unbind_layout(use_real_unbind_dim)
    cos, sin = _cos_sin(freqs_cis)
    return _real(x, cos, sin, interleaved, _at_front)


def apply_rotary_emb_ltx(x, freqs):
    """diffusers' LTX-Video apply_rotary_emb(x, freqs) of transformer_ltx: x (B, S, C) with the
    heads still flat, freqs = (cos, sin) of shape (B, S, C), pairs (2i, 2i+1) across C."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() != 3 or x.shape[-1] % 2:
        what = f"{x.dtype} tensor of shape {list(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"x must be a 3-D floating-point tensor (batch, seq, channels) with an even "
                         f"channel count, got {what}")
    cos, sin = _cos_sin(freqs)
    return _real(x, cos, sin, True)


def _check_freqs(x, freqs_cos, freqs_sin, want, name):
    _check_x(x, name)
    for t, tname in ((freqs_cos, "freqs_cos"), (freqs_sin, "freqs_sin")):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.shape[-1] != want:
            got = f"{t.dtype} {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{tname} must be a floating-point tensor whose last dim is {want}, "
                             f"got {got}")


def _math_dtype(x, c, s):
    """The dtype rotate_pairs computes in to match diffusers' float32 math: float64 where any
    operand is (a copy of x then), else x's own (the op computes in float32 and rounds once)."""
    return torch.float64 if torch.float64 in (x.dtype, c.dtype, s.dtype) else x.dtype


def apply_rotary_emb_wan(hidden_states, freqs_cos, freqs_sin):
    """diffusers' Wan attention RoPE (the apply_rotary_emb inside WanAttnProcessor.__call__):
    hidden_states (B, S, H, D), freqs_cos/freqs_sin (1, S, 1, D) as WanRotaryPosEmbed returns
    them; pair (2i, 2i+1) is rotated by freqs_cos[..., 2i] and freqs_sin[..., 2i+1], exactly as
    Wan reads them (any tables). Computed in float32 (float64 if either is), in x's dtype."""
    x = hidden_states
    _check_freqs(x, freqs_cos, freqs_sin, x.shape[-1], "hidden_states")
    c, s = (float32_table(t.to(x.device)) for t in _wan_members(freqs_cos, freqs_sin))
    return rotate_pairs(x, c, s, _math_dtype(x, c, s), interleaved=True).to(x.dtype)


def _wan_members(freqs_cos, freqs_sin):
    """The (..., D/2) tables Wan rotates pair (2i, 2i+1) by: cos at 2i, sin at 2i+1."""
    return freqs_cos[..., 0::2], freqs_sin[..., 1::2]


def apply_rotary_emb_mochi(x, freqs_cos, freqs_sin):
    """diffusers' Mochi attention RoPE (the apply_rotary_emb inside MochiAttnProcessor2_0):
    x (B, S, H, D), freqs_cos/freqs_sin (S, H, D/2), one entry per pair (2i, 2i+1); computed in
    float32 (float64 with float64 tables), returned in x's dtype."""
    _check_freqs(x, freqs_cos, freqs_sin, x.shape[-1] // 2, "x")
    c, s = float32_table(freqs_cos.to(x.device)), float32_table(freqs_sin.to(x.device))
    return _float_math(x, c, s, interleaved=True)


# ---- one pass: the tables a fused q/k norm + RoPE takes ----

def one_pass_tables(rope, x, *args, **kwargs):
    """(cos, sin, interleaved) with which rope_ext's ops compute `rope(x, *args, **kwargs)` (rope:
    one of this module's functions) in one pass of x, in float32: (..., D/2) float32 tables of one
    entry per pair, on x's device, with x's number of dims (size 1 where they broadcast); pairs
    (2i, 2i+1) if interleaved, else (i, i + D/2). Float64 tables are rounded to float32 (`rope`
    computes in float64 with them: the results differ by float32 rounding). None where one pass
    does not compute what `rope` does (tables whose pairs differ or that need a gradient, a
    float64 x, the full-width tables of a traced graph, tables that broadcast x to a larger
    shape, any argument of an unusual form): `rope` itself then computes, or raises its error.
    rope_ext.integrations.diffusers fuses a processor's q/k norms into its RoPE with these."""
    tables = _ONE_PASS_TABLES.get(rope)
    return None if tables is None else tables(x, *args, **kwargs)


def _op_tables(x, cos, sin, interleaved):
    """(cos, sin, interleaved) as one_pass_tables returns them, or None."""
    if (cos.shape != sin.shape or cos.dim() > x.dim() or 2 * cos.shape[-1] != x.shape[-1]
            or x.dtype == torch.float64 or cos.device != x.device or sin.device != x.device):
        return None
    lead = (None,) * (x.dim() - cos.dim())
    cos, sin = cos[lead].to(torch.float32), sin[lead].to(torch.float32)
    return (cos, sin, interleaved) if broadcasts_within(cos, x) else None


def _tensors(*ts):
    return all(isinstance(t, torch.Tensor) and t.is_floating_point() for t in ts)


def _real_tables(x, freqs, interleaved, place):
    """The one-pass tables of the real form's full-width (cos, sin) as `place` puts them
    against x (None: see _real, which takes the same one pass where these are not None)."""
    if not isinstance(freqs, (tuple, list)) or len(freqs) != 2 or not _tensors(*freqs):
        return None
    cos, sin = freqs
    if cos.shape != sin.shape or cos.dim() < 1 or derivative_wanted(cos, sin):
        return None
    paired = _paired(x, cos, sin, interleaved)
    return None if paired is None else _op_tables(x, place(paired[0]), place(paired[1]), interleaved)


def _complex_tables(x, freqs_cis, unsqueeze_dim):
    if not isinstance(freqs_cis, torch.Tensor) or not freqs_cis.is_complex() or \
            freqs_cis.device != x.device or freqs_cis.dim() < unsqueeze_dim:
        return None
    return _op_tables(x, *_complex_members(freqs_cis, unsqueeze_dim, x.device), True)


def _apply_rotary_emb_tables(x, freqs_cis, use_real=True, use_real_unbind_dim=-1, sequence_dim=2):
    if not use_real:
        return _complex_tables(x, freqs_cis, 2)
    if not _among(use_real_unbind_dim, _INTERLEAVED) or not _among(sequence_dim, _PLACES) or \
            not isinstance(freqs_cis, (tuple, list)) or any(getattr(t, "ndim", 0) != 2 for t in freqs_cis):
        return None  # (diffusers' placing indexes (S, D) tables)
    return _real_tables(x, freqs_cis, _INTERLEAVED[use_real_unbind_dim], _PLACES[sequence_dim])


def _qwen_tables(x, freqs_cis, use_real=True, use_real_unbind_dim=-1):
    if not use_real:
        return _complex_tables(x, freqs_cis, 1)
    if use_real_unbind_dim not in _INTERLEAVED:
        return None
    return _real_tables(x, freqs_cis, _INTERLEAVED[use_real_unbind_dim], _at_front)


def _ltx_tables(x, freqs):
    return _real_tables(x, freqs, True, lambda t: t)


def _wan_tables(x, freqs_cos, freqs_sin):
    if not _tensors(freqs_cos, freqs_sin) or freqs_cos.shape[-1:] != x.shape[-1:]:
        return None
    return _op_tables(x, *_wan_members(freqs_cos, freqs_sin), True)


def _mochi_tables(x, freqs_cos, freqs_sin):
    if not _tensors(freqs_cos, freqs_sin):
        return None
    return _op_tables(x, freqs_cos, freqs_sin, True)


_ONE_PASS_TABLES = {apply_rotary_emb: _apply_rotary_emb_tables, apply_rotary_emb_qwen: _qwen_tables,
                    apply_rotary_emb_ltx: _ltx_tables, apply_rotary_emb_wan: _wan_tables,
                    apply_rotary_emb_mochi: _mochi_tables}
