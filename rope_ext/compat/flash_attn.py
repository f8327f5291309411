"""flash-attn's rotary functions (`flash_attn.layers.rotary`) on rope_ext's ops.

    from flash_attn.layers.rotary import apply_rotary_emb
 -> from rope_ext.compat.flash_attn import apply_rotary_emb

Same arguments, layouts, defaults, return values and in-place behaviour. Like flash-attn's
autograd Functions, the gradient flows to x / qkv / kv only: cos and sin get none.
Differences, all on inputs flash-attn mishandles: a position past the table (cos.size(0)) is an
error (flash-attn's kernel leaves such tokens unrotated); with cu_seqlens every token from
cu_seqlens[0] up to cu_seqlens[-1] is rotated, whatever max_seqlen says (flash-attn skips tokens
past max_seqlen of their sequence), and a token outside every sequence is an error (its
position: -1), not left unwritten.
"""

import numbers

import torch
from torch.autograd import forward_ad

from .._args import check_flag, check_flags
from .._checks import FLOAT_DTYPES, below, check_positions_in_range
from .._compiling import compiling
from .._registrations import check_not_inference
from ..ops import sequence_positions
from ._layout import check_int, check_values, float32_table, rotate_pairs

from .._call import ops  # noqa: E402  (torch.ops.rope, without autograd where none is needed)

_transforming = torch._C._functorch.peek_interpreter_stack  # None outside torch.func transforms


def _tables(cos, sin):
    if cos.dim() != 2 or sin.shape != cos.shape:
        raise ValueError(f"cos and sin must be tables of one shape (seqlen_ro, rotary_dim / 2), got "
                         f"cos {list(cos.shape)} and sin {list(sin.shape)}")
    # flash-attn's Functions return no gradient for the tables (nor, in forward mode, carry
    # their tangents: detach drops both).
    if cos.requires_grad or sin.requires_grad or forward_ad._current_level >= 0:
        return cos.detach(), sin.detach()
    return cos, sin


def _offsets(seqlen_offsets, batch):
    if isinstance(seqlen_offsets, torch.Tensor):
        if seqlen_offsets.shape != (batch,) or seqlen_offsets.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"seqlen_offsets must be an int or an int32/int64 tensor of shape "
                             f"({batch},), got {seqlen_offsets.dtype} of shape "
                             f"{list(seqlen_offsets.shape)}")
        return seqlen_offsets
    if not isinstance(seqlen_offsets, numbers.Integral) or isinstance(seqlen_offsets, bool):
        raise ValueError(f"seqlen_offsets must be an int or a tensor of shape ({batch},), got "
                         f"{seqlen_offsets!r}")
    return int(seqlen_offsets)


def _table_rows(cos, offsets, seqlen, name="cos"):
    """The rows of sequence positions offsets .. offsets + seqlen - 1, checked (`name`: cos's)."""
    if offsets < 0 or offsets + seqlen > cos.shape[0]:
        raise ValueError(f"seqlen_offsets + seqlen = {offsets} + {seqlen} must lie within the "
                         f"table's seqlen_ro = {name}.size(0) = {cos.shape[0]}")
    return slice(offsets, offsets + seqlen)


def _rows_view(table, rows, head_dims):
    """float32_table(table[rows]) as (1, seqlen, 1 x head_dims, rotary_dim / 2), broadcasting
    over the batch and the heads; a float32 table in one view op (a call at decode sizes costs
    about as much per tensor op as the rotation itself)."""
    if compiling():  # a traced graph has no storage offsets
        return float32_table(table[rows])[(None, slice(None)) + (None,) * head_dims]
    offset = rows.start
    if table.dtype in (torch.float16, torch.bfloat16):
        table, offset = table[rows].float(), 0
    seqlen = rows.stop - rows.start
    (_, width), (s0, s1) = table.shape, table.stride()
    return table.as_strided((1, seqlen) + (1,) * head_dims + (width,),
                            (0, s0) + (0,) * head_dims + (s1,), table.storage_offset() + offset * s0)


def _rotated(x, cos, sin, interleaved, seqlen_offsets, name="cos"):
    """Rotated copy of x (batch, seqlen, *heads, headdim): token s of sequence b at position
    s + seqlen_offsets[b] (or + seqlen_offsets). name: cos's in errors."""
    batch, seqlen = x.shape[0], x.shape[1]
    offsets = _offsets(seqlen_offsets, batch)
    heads = (None,) * (x.dim() - 3)  # the tables broadcast over the head dims
    if isinstance(offsets, int):
        # One row per sequence position: the table slice itself, no gather.
        rows = _table_rows(cos, offsets, seqlen, name)
        return ops.apply(x, _rows_view(cos, rows, len(heads)), _rows_view(sin, rows, len(heads)),
                         interleaved)
    positions = _sequence_positions(x, offsets, cos, name)
    return ops.apply_positions(x, positions, cos, sin, interleaved, False, None, False)


def _sequence_positions(x, offsets, cos, name="cos"):
    """The position of each token of x (batch, seqlen, *heads, headdim), s + offsets[b], as
    (batch, seqlen, 1, ...) expanded to x.shape[:-2], after the check that every sequence lies
    within cos's rows."""
    seqlen = x.shape[1]
    check_values((offsets >= 0) & below(offsets, cos.shape[0] - seqlen + 1),
                 "seqlen_offsets + seqlen must lie within the table's seqlen_ro = " + name +
                 ".size(0) = {seqlen_ro} for every sequence, with seqlen = {seqlen}",
                 seqlen_ro=cos.shape[0], seqlen=seqlen)
    positions = torch.arange(seqlen, device=x.device) + offsets.to(torch.int64)[:, None]
    return positions.view(positions.shape + (1,) * (x.dim() - 4)).expand(x.shape[:-2])


# Below this many elements a rotated copy written back costs less than building the call's
# table and positions for the one-pass op (CPU, 40 heads x 128: ~2 us more at 1 token); above it
# the one pass wins (1.5x at 32 tokens, 2.4x at 256, 7.7x at 8192, float32).
_ONE_PASS_MIN_ELEMENTS = 1 << 17


def _one_pass(x, cos, sin, whole_table):
    """Whether an in-place call rotates x in one pass (rope.apply_ on a float32 cos|sin table of
    the call's rows, or of the whole table where whole_table): large inputs both ops accept,
    outside torch.func transforms (rope.apply_ has no batching or jvp rule), and a whole table
    that costs at most x's bytes to build (with its float32 copies of half-precision cos and
    sin). Anything else (small, a table as large as x, an input one of them rejects) takes the
    copy path, whose errors are apply_rotary_emb's."""
    table_bytes = 8 * cos.numel() * (2 if cos.dtype in (torch.float16, torch.bfloat16) else 1)
    return (x.numel() >= _ONE_PASS_MIN_ELEMENTS
            and (not whole_table or table_bytes <= x.numel() * x.element_size())
            and x.dtype in FLOAT_DTYPES and cos.dtype in FLOAT_DTYPES and sin.dtype == cos.dtype
            and cos.device == x.device and sin.device == x.device
            and 2 * cos.shape[1] <= x.shape[-1] and _transforming() is None)


def _rotate_(x, cos, sin, interleaved, seqlen_offsets):
    """x (batch, seqlen, *heads, headdim) rotated in place, as _rotated rotates a copy."""
    check_not_inference(x)  # torch's error, before anything is written (copy_ writes first)
    offsets = _offsets(seqlen_offsets, x.shape[0])
    gathered = not isinstance(offsets, int)
    if not _one_pass(x, cos, sin, gathered):
        # torch's copy_: autograd and version counters as for any in-place op
        x.copy_(_rotated(x, cos, sin, interleaved, offsets))
        return
    # One pass in place, on a cos|sin table: with one offset the rows of this call (seqlen
    # rows, small next to x), read at positions 0 .. seqlen - 1 of every sequence; with one per
    # sequence the whole table (_one_pass bounds it), read at s + offsets[b]. x is one query
    # whose tokens are its dims before (heads, headdim): qkv's Q and K (batch, seqlen, 2,
    # nheads, headdim) or (batch, seqlen, nheads_q + nheads_k, headdim) in any layout, each
    # element written once.
    if gathered:
        positions = _sequence_positions(x, offsets, cos)
    else:
        seqlen = x.shape[1]
        rows = _table_rows(cos, offsets, seqlen)
        cos, sin = cos[rows], sin[rows]
        positions = torch.arange(seqlen, device=x.device)
        if x.dim() > 4:  # (seqlen, 1, ...) against the token dims past seqlen
            positions = positions.view((seqlen,) + (1,) * (x.dim() - 4))
        positions = positions.expand(x.shape[:-2])
    _rotate_in_one_pass(x, positions, cos, sin, interleaved)


def _rotate_in_one_pass(x, positions, cos, sin, interleaved):
    """x rotated in place by rope.apply_ at positions of a float32 cos|sin table of cos, sin."""
    ops.apply_(x, None, positions, torch.cat((float32_table(cos), float32_table(sin)), dim=-1),
               interleaved)


def apply_rotary_emb(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0,
                     cu_seqlens=None, max_seqlen=None):
    """x: (batch_size, seqlen, nheads, headdim), or (total_seqlen, nheads, headdim) with
    cu_seqlens (batch + 1,) and max_seqlen. cos, sin: (seqlen_ro, rotary_dim / 2); the first
    rotary_dim dims of each head rotate, the rest are copied (or left, in place).
    interleaved: pairs (2i, 2i+1) (GPT-J) instead of (i, i + rotary_dim/2) (GPT-NeoX).
    seqlen_offsets: an int or a (batch_size,) tensor: token s of sequence b is at position
    s + offset_b. Returns the rotated tensor: x itself when inplace."""
    if not ((interleaved is True or interleaved is False) and (inplace is True or inplace is False)):
        check_flags("interleaved inplace", interleaved, inplace)  # (the test: 40 ns, the call 250)
    cos, sin = _tables(cos, sin)
    if cu_seqlens is None:
        if x.dim() != 4:
            raise ValueError(f"x must have shape (batch_size, seqlen, nheads, headdim), got "
                             f"{list(x.shape)}")
        if inplace:
            _rotate_(x, cos, sin, interleaved, seqlen_offsets)
            return x
        out = _rotated(x, cos, sin, interleaved, seqlen_offsets)
    else:
        if x.dim() != 3:
            raise ValueError(f"with cu_seqlens, x must have shape (total_seqlen, nheads, headdim), "
                             f"got {list(x.shape)}")
        if max_seqlen is None:
            raise ValueError("If cu_seqlens is passed in, then max_seqlen must be passed")
        if cu_seqlens.dim() == 1:  # else sequence_positions names the problem
            seqlen_offsets = _offsets(seqlen_offsets, cu_seqlens.shape[0] - 1)
        positions = sequence_positions(cu_seqlens, x.shape[0], seqlen_offsets,
                                       names=("cu_seqlens", "x.size(0)"))
        if inplace:
            check_not_inference(x)  # before anything is written (copy_ writes first)
            if _one_pass(x, cos, sin, whole_table=True):
                # The kernel checks the positions, as apply_positions's does, but its message
                # would name the table it is given: on the CPU they are checked here first,
                # with the message of the copy path (elsewhere that would cost a sync).
                if x.device.type == "cpu" and not compiling():
                    check_positions_in_range(positions, cos.shape[0], "rope.apply_positions",
                                             "cos.size(0)")
                _rotate_in_one_pass(x, positions, cos, sin, interleaved)
                return x
        out = ops.apply_positions(x, positions, cos, sin, interleaved, False, None, False)
    if inplace:
        x.copy_(out)
        return x
    return out


apply_rotary_emb_func = apply_rotary_emb  # flash-attn's older name


def apply_rotary_emb_qkv_(qkv, cos, sin, cos_k=None, sin_k=None, interleaved=False,
                          seqlen_offsets=0, num_heads_q=None):
    """Rotates Q and K of qkv in place and returns qkv. qkv: (batch_size, seqlen, 3, nheads,
    headdim), or (batch_size, seqlen, num_heads_q + 2 * num_heads_k, headdim) (MQA/GQA) with
    num_heads_q given. cos_k, sin_k: K's own tables (each defaults to cos / sin)."""
    check_flag(interleaved, "interleaved")
    if qkv.dim() == 5:
        if qkv.shape[2] != 3:
            raise ValueError(f"qkv must have shape (batch_size, seqlen, 3, nheads, headdim), got "
                             f"{list(qkv.shape)}")
        q, k, qk = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, :2]
    elif qkv.dim() == 4:
        if num_heads_q is None:
            raise ValueError("num_heads_q is required for qkv of shape (batch_size, seqlen, "
                             "num_heads_q + 2 * num_heads_k, headdim)")
        hq = check_int(num_heads_q, "num_heads_q", 1)
        hk = (qkv.shape[2] - hq) // 2
        if hk < 1 or qkv.shape[2] != hq + 2 * hk:
            raise ValueError(f"qkv of shape {list(qkv.shape)}: dim 2 must be num_heads_q + 2 * "
                             f"num_heads_k with num_heads_q = {hq}")
        q, k, qk = qkv[:, :, :hq], qkv[:, :, hq : hq + hk], qkv[:, :, : hq + hk]
    else:
        raise ValueError(f"qkv must have 5 dims (batch_size, seqlen, 3, nheads, headdim) or 4 "
                         f"(batch_size, seqlen, num_heads_q + 2 * num_heads_k, headdim), got "
                         f"{list(qkv.shape)}")
    cos, sin = _tables(cos, sin)
    if cos_k is None and sin_k is None:
        _rotate_(qk, cos, sin, interleaved, seqlen_offsets)  # Q and K in one call
    else:
        cos_k, sin_k = _tables(cos if cos_k is None else cos_k, sin if sin_k is None else sin_k)
        # Both rotated before either is written: a call rejected for K's tables changes nothing.
        check_not_inference(qkv)
        q_rot = _rotated(q, cos, sin, interleaved, seqlen_offsets)
        k_rot = _rotated(k, cos_k, sin_k, interleaved, seqlen_offsets,
                         "cos" if cos_k is cos else "cos_k")
        q.copy_(q_rot)
        k.copy_(k_rot)
    return qkv


def apply_rotary_emb_kv_(kv, cos, sin, interleaved=False, seqlen_offsets=0):
    """Rotates K of kv (batch_size, seqlen, 2, nheads, headdim) in place; returns kv."""
    check_flag(interleaved, "interleaved")
    if kv.dim() != 5 or kv.shape[2] != 2:
        raise ValueError(f"kv must have shape (batch_size, seqlen, 2, nheads, headdim), got "
                         f"{list(kv.shape)}")
    cos, sin = _tables(cos, sin)
    _rotate_(kv[:, :, 0], cos, sin, interleaved, seqlen_offsets)
    return kv


def apply_rotary_emb_torch(x, cos, sin, interleaved=False):
    """flash-attn's pure-PyTorch reference, on the native op: x (batch_size, seqlen, nheads,
    headdim), cos/sin (seqlen, rotary_dim / 2) or (batch_size, seqlen, rotary_dim / 2).
    Out of place; differentiable w.r.t. x, cos and sin, as that reference is."""
    check_flag(interleaved, "interleaved")
    if cos.shape != sin.shape or cos.dim() not in (2, 3):
        raise ValueError(f"cos and sin must have one shape, (seqlen, rotary_dim / 2) or (batch_size, "
                         f"seqlen, rotary_dim / 2), got cos {list(cos.shape)} and sin {list(sin.shape)}")
    if 2 * cos.shape[-1] > x.shape[-1]:
        raise ValueError(f"rotary_dim = 2 * cos.size(-1) = {2 * cos.shape[-1]} must be <= headdim = "
                         f"{x.shape[-1]}")
    # (..., seqlen, 1, rotary_dim / 2): the tables broadcast over the heads.
    return rotate_pairs(x, cos.unsqueeze(-2), sin.unsqueeze(-2),
                        torch.promote_types(x.dtype, cos.dtype), interleaved)
