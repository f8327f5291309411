"""NVIDIA Transformer Engine's RoPE (`transformer_engine.pytorch.attention.rope`, which
Megatron-Core and NeMo call) on rope_ext's ops, on CPU and CUDA.

    from transformer_engine.pytorch.attention.rope import RotaryPositionEmbedding, apply_rotary_pos_emb
 -> from rope_ext.compat.transformer_engine import RotaryPositionEmbedding, apply_rotary_pos_emb

Same signatures, positional order, defaults, layouts and values: formats sbhd, bshd and thd
(packed sequences, `cu_seqlens`), per-sequence `start_positions`, both pair layouts, partial
rotary (the dims past freqs.size(-1) pass through), and context parallelism: rank `cp_rank` of
`cp_size` holds chunks cp_rank and 2 * cp_size - 1 - cp_rank of every sequence (each local
sequence: its two chunks, one after the other), and the angles follow. `freqs` holds one angle per
element; its two members of a pair need not be equal (see _per_element.py). `fused` is accepted
and served by the same ops; it decides, as in TE, whether `freqs` gets a gradient: fused=False
differentiates w.r.t. t and freqs (TE's PyTorch path), fused=True w.r.t. t only (TE's kernel).

Differences, on inputs TE mishandles or leaves to a CUDA device:
- Arguments TE asserts on, or fails on deep inside, raise a ValueError naming the argument.
  Checks of tensor values (cu_seqlens, start_positions) raise on CPU; on CUDA they are
  device-side asserts (no host-device sync), where TE's kernel reads past its tables.
- start_positions holds one entry per sequence, each >= 0, with every sequence's positions
  inside freqs. It is also taken with cp_size > 1, where TE asserts: each token's position in
  its full sequence plus its sequence's start.
- The arithmetic is TE's kernel's (float32, one rounding to t's dtype), not its PyTorch path's,
  which rounds cos/sin to t's dtype first.
- Which path a call takes (one pass or two) is one comparison of the angles it reads: on CUDA
  that is one host-device sync per call, outside torch.compile.

A DTensor t (context parallelism with DTensor, docs/distributed.md) is rotated shard by shard, its
local shard being what TE would be given on that rank; the result is placed like t.
"""

import torch

from .._args import check_flag, check_flags, check_positive
from ..ops import token_sequences
from . import _per_element
from ._layout import check_index_tensor, check_int, check_values, is_dtensor

FORMATS = ("sbhd", "bshd", "thd")
# apply_rotary_pos_emb's arguments after t, in order
_ARGS = ("freqs", "tensor_format", "start_positions", "interleaved", "fused", "cu_seqlens",
         "cp_size", "cp_rank")


class RotaryPositionEmbedding(torch.nn.Module):
    """TE's RotaryPositionEmbedding: forward(max_seq_len, offset=0) returns the angles
    (max_seq_len, 1, 1, dim') of positions offset .. offset + max_seq_len - 1, float32, each
    pair's angle on both its members (dim' = int(dim * rotary_percent) rounded up to even).
    seq_len_interpolation_factor with pretrained_max_position_embeddings: positions divided by
    the factor (linear interpolation), or by max_seq_len / pretrained_max_position_embeddings when
    max_seq_len exceeds pretrained_max_position_embeddings * factor. The values are TE's, bit for
    bit (float32 throughout). inv_freq is created where TE creates it, on the current CUDA device,
    or on CPU where there is none."""

    def __init__(self, dim, rotary_percent=1.0, seq_len_interpolation_factor=None,
                 pretrained_max_position_embeddings=None, rotary_base=10000.0, interleaved=False):
        super().__init__()
        check_positive(dim, "dim")  # (TE takes a float too: torch.arange(0, dim, 2) / dim)
        check_positive(rotary_percent, "rotary_percent")
        check_positive(rotary_base, "rotary_base")
        if rotary_percent < 1.0:
            dim = int(dim * rotary_percent)
        self.seq_len_interpolation_factor = seq_len_interpolation_factor
        self.rotary_base = rotary_base
        device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
        exponents = torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim
        self.register_buffer("inv_freq", 1.0 / (self.rotary_base ** exponents))
        self.pretrained_max_position_embeddings = pretrained_max_position_embeddings
        self.interleaved = check_flag(interleaved, "interleaved")

    def forward(self, max_seq_len, offset=0):
        # Mixed precision would round the angles (TE turns autocast off here too).
        with torch.autocast("cuda", enabled=False), torch.autocast("cpu", enabled=False):
            inv_freq = self.inv_freq
            seq = torch.arange(max_seq_len, device=inv_freq.device, dtype=inv_freq.dtype) + offset
            pretrained = self.pretrained_max_position_embeddings
            factor = self.seq_len_interpolation_factor
            if pretrained is not None and factor is not None:
                if max_seq_len > pretrained * factor:
                    seq *= 1 / (max_seq_len / pretrained)  # dynamic: past the interpolated length
                else:
                    seq *= 1 / factor
            freqs = torch.outer(seq, inv_freq)
        if self.interleaved:
            emb = freqs.repeat_interleave(2, dim=-1)
        else:
            emb = torch.cat((freqs, freqs), dim=-1)
        return emb.reshape(emb.size(0), 1, 1, emb.size(1))


def _check_t(t, tensor_format):
    dims = 3 if tensor_format == "thd" else 4
    if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.dim() != dims:
        got = f"{t.dtype} of shape {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        layout = {"sbhd": "[s, b, h, d]", "bshd": "[b, s, h, d]", "thd": "[t, h, d]"}[tensor_format]
        raise ValueError(f"t must be a floating-point tensor of shape {layout} for tensor_format "
                         f"{tensor_format!r}, got {got}")


def _check_freqs(freqs, t, batch=None):
    """freqs as (max_seq_len, rotary_dim) float angles, checked against t; with `batch` (t's
    batch size, sbhd or bshd without start_positions) also [s2, b, 1, d2], each sequence's own
    angles (TE's PyTorch path), as (max_seq_len, b, rotary_dim)."""
    if not isinstance(freqs, torch.Tensor) or freqs.is_complex():
        got = freqs.dtype if isinstance(freqs, torch.Tensor) else type(freqs).__name__
        raise ValueError(f"freqs must be a real tensor of angles [s2, 1, 1, d2], got {got}")
    if freqs.dim() != 4 or freqs.shape[1] not in (1, batch) or freqs.shape[2] != 1:
        also = "" if batch is None else f" or [s2, b, 1, d2] with b = {batch}"
        raise ValueError(f"freqs must have shape [s2, 1, 1, d2]{also} (one angle per element "
                         f"of the rotary dims), got {list(freqs.shape)}")
    d2, d = freqs.shape[3], t.shape[-1]
    if d2 % 2 or not 2 <= d2 <= d:
        raise ValueError(f"freqs.size(-1) = {d2} (the rotary dims) must be even and in [2, d = "
                         f"t.size(-1) = {d}]")
    if freqs.device != t.device:
        raise ValueError(f"freqs must be on t's device ({t.device}), got {freqs.device}")
    freqs = freqs[:, 0, 0] if freqs.shape[1] == 1 else freqs[:, :, 0]
    return freqs if freqs.is_floating_point() else freqs.float()  # TE takes integer angles too


def _rank_positions(local, length, cp_size, cp_rank):
    """Position in its full sequence of the token at index `local` of a local sequence of
    `length` tokens (ints or tensors): with context parallelism the local sequence is chunk
    cp_rank then chunk 2 * cp_size - 1 - cp_rank, each length / 2 tokens."""
    if cp_size == 1:
        return local
    half = length // 2
    return torch.where(local < half, local + cp_rank * half,
                       local + (cp_size * length - (cp_rank + 2) * half))


def _check_starts(start_positions, batch, device):
    check_index_tensor(start_positions, "start_positions", (batch,))
    start_positions = start_positions.to(device)
    check_values(start_positions >= 0, "start_positions must be >= 0")
    return start_positions.long()


def _dense_angles(t, freqs, seq_dim, start_positions, cp_size, cp_rank):
    """The angles of every token of t in sbhd (seq_dim 0) or bshd (1), placed against t."""
    seqlen, batch, rows = t.shape[seq_dim], t.shape[1 - seq_dim], freqs.shape[0]
    if cp_size > 1 and seqlen % 2:
        raise ValueError(f"with cp_size > 1, t's sequence length (t.size({seq_dim}) = {seqlen}) "
                         "must be even: the two chunks this rank holds")
    if seqlen * cp_size > rows:
        raise ValueError(f"freqs has {rows} positions (freqs.size(0)); the sequences need "
                         f"cp_size * seqlen = {cp_size} * {seqlen}")
    if start_positions is None:
        if cp_size == 1:
            rows_of_t = freqs[:seqlen]  # a view: no gather
        else:
            local = torch.arange(seqlen, device=t.device)
            rows_of_t = freqs[_rank_positions(local, seqlen, cp_size, cp_rank)]
        if rows_of_t.dim() == 3:  # (s, b, d2): each sequence's own angles
            return (rows_of_t if seq_dim == 0 else rows_of_t.transpose(0, 1))[:, :, None]
        return rows_of_t[:, None, None] if seq_dim == 0 else rows_of_t[None, :, None]
    start = _check_starts(start_positions, batch, t.device)
    check_values(start <= rows - seqlen * cp_size,  # not start + ...: a huge start would wrap
                 "start_positions + cp_size * seqlen must be <= freqs.size(0) = {rows} (every "
                 "sequence's positions inside freqs), with seqlen = {seqlen}, cp_size = {cp_size}",
                 rows=rows, seqlen=seqlen, cp_size=cp_size)
    local = torch.arange(seqlen, device=t.device)
    pos = _rank_positions(local, seqlen, cp_size, cp_rank)[:, None] + start  # (s, b)
    return freqs[pos if seq_dim == 0 else pos.T][:, :, None]


def _packed_angles(t, freqs, cu_seqlens, start_positions, cp_size, cp_rank):
    """The angles of every token of t (thd), placed against t: sequence b holds the tokens
    cu_seqlens[b] // cp_size - cu_seqlens[0] // cp_size onwards, up to the next one (TE's split
    of t by the lengths of cu_seqlens // cp_size)."""
    check_index_tensor(cu_seqlens, "cu_seqlens")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"cu_seqlens must have shape [b + 1], got {list(cu_seqlens.shape)}")
    total, rows = t.shape[0], freqs.shape[0]
    bounds = cu_seqlens.to(t.device).long()
    if cp_size != 1:
        bounds = bounds // cp_size
    starts = bounds - bounds[:1]
    lengths = starts[1:] - starts[:-1]
    check_values((lengths >= 0) & (starts[-1] == total),
                 "cu_seqlens // cp_size must be non-decreasing and span t.size(0) = {total} "
                 "tokens (cu_seqlens[-1] - cu_seqlens[0], over cp_size)", total=total)
    if cp_size > 1:
        check_values(lengths % 2 == 0, "with cp_size > 1, every sequence's length over cp_size "
                     "(from cu_seqlens) must be even: the two chunks this rank holds")
    offsets = 0 if start_positions is None else _check_starts(start_positions, lengths.numel(),
                                                              t.device)
    # (without offsets, every sequence fits where all of them do: the lengths, checked
    # non-negative, sum to total; a decode call is then spared five tensor ops)
    if not (start_positions is None and type(total) is int and type(rows) is int
            and total * cp_size <= rows):
        check_values(offsets <= rows - lengths * cp_size,  # no int64 wrap for a huge offset
                     f"freqs has {rows} positions (freqs.size(0)); a sequence needs "
                     "start_positions + cp_size * (its length over cp_size)")
    token, seq = token_sequences(starts, total)
    local = token - starts[seq]
    pos = _rank_positions(local, lengths[seq], cp_size, cp_rank)
    if start_positions is not None:
        pos = pos + offsets[seq]
    return freqs[pos][:, None]


def _check_sequence_shards(t, tensor_format, cp_size, cp_rank):
    """A DTensor t sharded over its sequence dim holds one rank's part of each sequence: cp_size
    must say how many parts there are (with cp_size 1 each rank would take its part for the
    whole sequence, and rotate it from position 0), and, sharded over one mesh dim, cp_rank which
    part (this rank's coordinate on it). A t not sharded over its sequence dim is context
    parallelism outside the mesh: cp_size and cp_rank are the caller's, the same on every rank."""
    seq_dim = 1 if tensor_format == "bshd" else 0
    parts, where = 1, []
    for m, p in enumerate(t.placements):
        if p.is_shard() and p.dim % t.dim() == seq_dim:
            parts *= t.device_mesh.size(m)
            where.append((m, f"Shard({seq_dim}) on mesh dim {m}"))
    if parts != 1 and parts != cp_size:
        raise ValueError(f"t is sharded over its sequence dim ({', '.join(w for _, w in where)}) "
                         f"into {parts} parts, so cp_size must be {parts} (and cp_rank this rank's "
                         f"part, in Transformer Engine's context-parallel layout), got "
                         f"cp_size={cp_size}")
    if len(where) == 1 and parts > 1:
        m = where[0][0]
        part = t.device_mesh.get_local_rank(m)
        if cp_rank != part:
            raise ValueError(f"t is sharded over its sequence dim on mesh dim {m}, where this rank "
                             f"holds part {part}: cp_rank must be {part}, got cp_rank={cp_rank}")


def apply_rotary_pos_emb(t, freqs, tensor_format="sbhd", start_positions=None, interleaved=False,
                         fused=False, cu_seqlens=None, cp_size=1, cp_rank=0):
    """TE's apply_rotary_pos_emb: t [s, b, h, d] (sbhd), [b, s, h, d] (bshd) or [t, h, d] (thd,
    with cu_seqlens [b + 1], padded to the full sequences when cp_size > 1); freqs [s2, 1, 1, d2]
    angles (RotaryPositionEmbedding's output), d2 <= d, or in sbhd / bshd without
    start_positions [s2, b, 1, d2], each sequence's own (TE's PyTorch path). Token i of a local
    sequence takes the angles of row start_positions[b] + (its position in the full sequence).
    Returns a new tensor of t's shape and dtype."""
    if tensor_format not in FORMATS:
        raise ValueError(f"Unsupported tensor_format: {tensor_format!r} (tensor_format must be one "
                         f"of {', '.join(map(repr, FORMATS))})")
    if tensor_format == "thd" and cu_seqlens is None:
        raise ValueError("cu_seqlens must not be None when tensor_format is 'thd'.")
    cp_size = check_int(cp_size, "cp_size", 1)
    cp_rank = check_int(cp_rank, "cp_rank", 0)
    check_flags("interleaved fused", interleaved, fused)
    if cp_rank >= cp_size:
        raise ValueError(f"cp_rank must be < cp_size = {cp_size}, got {cp_rank}")
    if is_dtensor(t):
        from ._local_shards import on_local_shards

        _check_sequence_shards(t, tensor_format, cp_size, cp_rank)
        return on_local_shards(apply_rotary_pos_emb, t, freqs, tensor_format, start_positions,
                               interleaved, fused, cu_seqlens, cp_size, cp_rank, names=_ARGS)
    _check_t(t, tensor_format)
    per_sequence = tensor_format != "thd" and start_positions is None  # [s2, b, 1, d2] allowed
    freqs = _check_freqs(freqs, t, t.shape[1 - FORMATS.index(tensor_format)] if per_sequence
                         else None)
    if fused:
        freqs = freqs.detach()  # TE's kernel returns no gradient for freqs
    if tensor_format == "thd":
        angles = _packed_angles(t, freqs, cu_seqlens, start_positions, cp_size, cp_rank)
    else:
        angles = _dense_angles(t, freqs, FORMATS.index(tensor_format), start_positions, cp_size,
                               cp_rank)
    return _per_element.rotate(t, angles, interleaved)
