"""Independent eager implementations of the training stacks' RoPE entry points, with the peers'
own names (prefixed te_ / TE, llama_ and gpt_fast_, as the peers share names), arguments,
defaults and layouts, written here from their documented semantics: Transformer Engine's
apply_rotary_pos_emb (its PyTorch path, not its fused kernel) and RotaryPositionEmbedding, the
Llama reference's precompute_freqs_cis, reshape_for_broadcast and apply_rotary_emb, and gpt-fast's
apply_rope_scaling, precompute_freqs_cis and apply_rotary_emb. tests/test_te_compat.py,
tests/test_te_distributed.py and tests/test_llama_gpt_fast_compat.py check
rope_ext.compat.transformer_engine, .llama and .gpt_fast against these; the benchmark times them
as the eager baselines of training steps. Nothing here imports rope_ext or the peers.

Arithmetic, as each peer does it: Transformer Engine takes cos and sin of its angles in their own
dtype, rounds them to t's dtype and rotates in t's dtype; Llama and gpt-fast round x to float32
and rotate it there (Llama by a complex multiply, gpt-fast by a real (cos, sin) table), returning
x's dtype; a float64 table makes that rotation float64 after x's rounding to float32. The tables
(Llama's, gpt-fast's, the angles of TE's RotaryPositionEmbedding) are computed in float32.
"""

import math

import torch


def _members(x, interleaved):
    """(first, second) members of each pair along x's last dim: neighbours (2i, 2i + 1) when
    interleaved, else halves (i, i + d/2)."""
    if interleaved:
        return x[..., 0::2], x[..., 1::2]
    half = x.shape[-1] // 2
    return x[..., :half], x[..., half:]


def _join(first, second, interleaved):
    """Inverse of _members."""
    if interleaved:
        return torch.stack((first, second), dim=-1).flatten(-2)
    return torch.cat((first, second), dim=-1)


def _turn(a, b, cos_a, sin_a, cos_b, sin_b):
    """Pairs (a, b) turned by their angle: a cos - b sin and b cos + a sin, each member with the
    cos and sin of its own angle (the two are equal unless a table says otherwise)."""
    return a * cos_a - b * sin_a, b * cos_b + a * sin_b


def _inverse_frequencies(dim, base):
    """float32 base^(-2i/dim) for i < dim // 2."""
    exponents = torch.arange(dim // 2, dtype=torch.float32) * 2 / dim
    return 1.0 / (base ** exponents)


def _unit_phasors(length, inv_freq):
    """complex [length, len(inv_freq)]: exp(1j * p * inv_freq[i]), angles in inv_freq's dtype."""
    angles = torch.arange(length, dtype=inv_freq.dtype, device=inv_freq.device)[:, None] * inv_freq
    return torch.polar(torch.ones_like(angles), angles)


# ---- Transformer Engine (transformer_engine.pytorch.attention.rope) ----------------------------

TE_FORMATS = ("sbhd", "bshd", "thd")


class TERotaryPositionEmbedding(torch.nn.Module):
    """Transformer Engine's RotaryPositionEmbedding. Its one piece of state is the float32 buffer
    inv_freq = rotary_base^(-2i/dim') for even 2i < dim', where dim' = int(dim * rotary_percent)
    when rotary_percent < 1, else dim; it starts on the current CUDA device (on CPU without one).

    forward(max_seq_len, offset=0): angles [max_seq_len, 1, 1, 2 * len(inv_freq)] in inv_freq's
    dtype, row r for position r + offset, each pair's angle on both its members: halves
    (i, i + dim'/2), or neighbours (2i, 2i + 1) when interleaved. With both
    seq_len_interpolation_factor and pretrained_max_position_embeddings set, positions are
    multiplied by 1 / factor, or, when max_seq_len exceeds pretrained * factor, by
    1 / (max_seq_len / pretrained) (position interpolation). The angles are plain float products,
    which autocast leaves alone."""

    def __init__(self, dim, rotary_percent=1.0, seq_len_interpolation_factor=None,
                 pretrained_max_position_embeddings=None, rotary_base=10000.0, interleaved=False):
        super().__init__()
        if rotary_percent < 1.0:
            dim = int(dim * rotary_percent)
        self.seq_len_interpolation_factor = seq_len_interpolation_factor
        self.pretrained_max_position_embeddings = pretrained_max_position_embeddings
        self.rotary_base = rotary_base
        self.interleaved = interleaved
        device = torch.cuda.current_device() if torch.cuda.is_available() else None
        even = torch.arange(0, dim, 2, dtype=torch.float32, device=device)
        self.register_buffer("inv_freq", 1.0 / (rotary_base ** (even / dim)))

    def _position_scale(self, max_seq_len):
        factor = self.seq_len_interpolation_factor
        pretrained = self.pretrained_max_position_embeddings
        if factor is None or pretrained is None:
            return None
        if max_seq_len > pretrained * factor:
            return 1 / (max_seq_len / pretrained)
        return 1 / factor

    def forward(self, max_seq_len, offset=0):
        inv_freq = self.inv_freq
        positions = torch.arange(max_seq_len, dtype=inv_freq.dtype, device=inv_freq.device) + offset
        scale = self._position_scale(max_seq_len)
        if scale is not None:
            positions = positions * scale
        angles = positions[:, None] * inv_freq[None, :]
        both = angles.repeat_interleave(2, dim=-1) if self.interleaved else angles.repeat(1, 2)
        return both[:, None, None, :]


def _te_chunk_positions(n, cp_size, cp_rank):
    """Positions within its sequence of the n tokens one context-parallel rank holds: the
    sequence is cut into 2 * cp_size chunks of n / 2 tokens, and the rank holds chunks cp_rank
    and 2 * cp_size - 1 - cp_rank, in that order (without context parallelism: 0 .. n - 1)."""
    if cp_size == 1:
        return torch.arange(n)
    if n % 2:
        raise ValueError(f"a rank's share of a sequence ({n} tokens) must be even under context "
                         "parallelism")
    half = n // 2
    return torch.cat([torch.arange(c * half, (c + 1) * half)
                      for c in (cp_rank, 2 * cp_size - 1 - cp_rank)])


def _te_positions_padded(t, tensor_format, start_positions, cp_size, cp_rank, rows):
    """Angle rows of sbhd / bshd tokens: [s, 1 or b] (sbhd) or [1 or b, s] (bshd)."""
    if t.dim() != 4:
        raise ValueError(f"t must be 4-D for {tensor_format}, got shape {tuple(t.shape)}")
    seq_dim = tensor_format.index("s")
    seqlen = t.shape[seq_dim]
    positions = _te_chunk_positions(seqlen, cp_size, cp_rank)[:, None]
    if start_positions is not None:
        # every sequence's whole window, start .. start + cp_size * seqlen, must lie in freqs
        if int(start_positions.max()) + cp_size * seqlen > rows:
            raise ValueError(f"start_positions reach past freqs' {rows} positions")
        positions = positions + start_positions.long().cpu()[None, :]
    return positions if seq_dim == 0 else positions.T


def _te_positions_packed(t, cu_seqlens, start_positions, cp_size, cp_rank):
    """Angle rows of thd tokens, [total]: cu_seqlens are the (padded) offsets of the full
    sequences, this rank holding 1 / cp_size of each."""
    if t.dim() != 3:
        raise ValueError(f"t must be 3-D for thd, got shape {tuple(t.shape)}")
    lengths = (cu_seqlens // cp_size).diff().tolist()
    if sum(lengths) != t.shape[0]:
        raise ValueError(f"cu_seqlens cover {sum(lengths)} tokens on this rank, t has {t.shape[0]}")
    starts = [0] * len(lengths) if start_positions is None else start_positions.tolist()
    return torch.cat([_te_chunk_positions(n, cp_size, cp_rank) + start
                      for n, start in zip(lengths, starts)])


def _te_rotate(t, angles, interleaved):
    """t's first angles.size(-1) dims turned by angles (one per element, broadcast against t),
    cos and sin rounded to t's dtype, the rest of t after them."""
    d2 = angles.shape[-1]
    cos, sin = angles.cos().to(t.dtype), angles.sin().to(t.dtype)
    a, b = _members(t[..., :d2], interleaved)
    cos_a, cos_b = _members(cos, interleaved)
    sin_a, sin_b = _members(sin, interleaved)
    turned = _join(*_turn(a, b, cos_a, sin_a, cos_b, sin_b), interleaved)
    return torch.cat((turned, t[..., d2:]), dim=-1)


def te_apply_rotary_pos_emb(t, freqs, tensor_format="sbhd", start_positions=None,
                            interleaved=False, fused=False, cu_seqlens=None, cp_size=1, cp_rank=0):
    """Transformer Engine's apply_rotary_pos_emb, its PyTorch path (fused=True, its CUDA kernel,
    is not modelled here). t: [s, b, h, d] (sbhd), [b, s, h, d] (bshd) or packed [total, h, d]
    (thd, sequences at cu_seqlens). freqs [s2, 1, 1, d2], d2 <= d even: one angle per element of
    t's first d2 dims (the two members of a pair may differ); dims past d2 pass through. Pairs are
    halves (i, i + d2/2), or neighbours (2i, 2i + 1) when interleaved.

    A token of sequence b at position p within it takes angle row p + start_positions[b] (p alone
    without start_positions). Under context parallelism (cp_size > 1) t holds rank cp_rank's
    share of every sequence, chunks cp_rank and 2 * cp_size - 1 - cp_rank of 2 * cp_size, and p is
    the token's position in the full sequence; for thd, cu_seqlens are the full sequences' (padded)
    offsets. cos and sin are taken in freqs' dtype, rounded to t's, and t rotated in its dtype."""
    if tensor_format == "thd" and cu_seqlens is None:
        raise ValueError("thd needs cu_seqlens")
    if fused:
        raise NotImplementedError("fused=True is Transformer Engine's CUDA kernel, not modelled here")
    if tensor_format not in TE_FORMATS:
        raise ValueError(f"tensor_format must be one of {TE_FORMATS}, got {tensor_format!r}")
    if freqs.dim() != 4 or freqs.shape[1:3] != (1, 1):
        raise ValueError(f"freqs must be [s2, 1, 1, d2], got shape {tuple(freqs.shape)}")
    d2 = freqs.shape[-1]
    if d2 % 2 or d2 > t.shape[-1]:
        raise ValueError(f"freqs' last dim ({d2}) must be even and at most t's ({t.shape[-1]})")
    table = freqs[:, 0, 0, :]
    if tensor_format == "thd":
        positions = _te_positions_packed(t, cu_seqlens, start_positions, cp_size, cp_rank)
    else:
        positions = _te_positions_padded(t, tensor_format, start_positions, cp_size, cp_rank,
                                         table.shape[0])
    if positions.numel() and not 0 <= int(positions.min()) <= int(positions.max()) < table.shape[0]:
        raise ValueError(f"freqs has {table.shape[0]} positions; positions "
                         f"{int(positions.min())} .. {int(positions.max())} are needed")
    angles = table[positions.to(table.device)].unsqueeze(-2)  # one row per token, over the heads
    return _te_rotate(t, angles, interleaved)


# ---- Meta's Llama reference (llama/model.py) ---------------------------------------------------

def llama_precompute_freqs_cis(dim, end, theta=10000.0):
    """complex64 [end, dim // 2]: entry (p, i) = exp(1j * p * theta^(-2i/dim)), the angles
    float32 products."""
    return _unit_phasors(end, _inverse_frequencies(dim, theta))


def llama_reshape_for_broadcast(freqs_cis, x):
    """freqs_cis [seqlen, pairs] viewed to broadcast against x [batch, seqlen, ..., pairs]: its
    two dims on x's dims 1 and -1, size 1 elsewhere."""
    if x.dim() < 2 or tuple(freqs_cis.shape) != (x.shape[1], x.shape[-1]):
        raise ValueError(f"freqs_cis of shape {tuple(freqs_cis.shape)} does not fit x of shape "
                         f"{tuple(x.shape)}")
    shape = [1] * x.dim()
    shape[1], shape[-1] = x.shape[1], x.shape[-1]
    return freqs_cis.view(shape)


def llama_apply_rotary_emb(xq, xk, freqs_cis):
    """xq and xk ([batch, seqlen, heads, head_dim], xk's heads may be fewer) each rounded to
    float32, its neighbours (2i, 2i + 1) read as the complex number x[2i] + 1j x[2i + 1] and
    multiplied by freqs_cis[s, i] (any complex table, or a real one), then read back as real
    pairs, the dims from 3 on merged (head_dim again for 4-D inputs), in the input's dtype."""

    def rotate(x):
        pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        product = pairs * llama_reshape_for_broadcast(freqs_cis, pairs)
        return torch.view_as_real(product).flatten(3).type_as(x)

    return rotate(xq), rotate(xk)


# ---- torchtitan (models/llama3/model/model.py): the reference's multiply, with positions -------

def titan_apply_rotary_emb(xq, xk, freqs_cis, positions=None):
    """llama_apply_rotary_emb with torchtitan's table rows: the first seqlen of a longer table, or
    those at positions (1, seqlen) (one row per token, shared by the batch) or (batch, seqlen)."""
    seqlen, pairs = xq.shape[1], xq.shape[-1] // 2
    if positions is None:
        rows = freqs_cis[:seqlen][None]
    else:
        if positions.dim() != 2 or positions.shape[1] != seqlen or positions.shape[0] not in (1, xq.shape[0]):
            raise ValueError(f"positions of shape {tuple(positions.shape)} does not fit xq")
        rows = freqs_cis[positions]
    if tuple(rows.shape[1:]) != (seqlen, pairs):
        raise ValueError(f"freqs_cis of shape {tuple(freqs_cis.shape)} does not fit xq")

    def rotate(x):
        pairs_ = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        table = rows.reshape(rows.shape[0], seqlen, *[1] * (x.dim() - 3), pairs)
        return torch.view_as_real(pairs_ * table).flatten(3).type_as(x)

    return rotate(xq), rotate(xk)


# ---- gpt-fast (model.py) -----------------------------------------------------------------------

def gpt_fast_apply_rope_scaling(freqs, rope_scaling=None):
    """Llama 3.1's frequency scaling, from rope_scaling's factor, low_freq_factor,
    high_freq_factor and original_max_position_embeddings: a frequency f of wavelength
    w = 2 pi / f is kept when w < original / high, divided by factor when w > original / low, and
    in between blended, (1 - smooth) * f / factor + smooth * f with
    smooth = (original / w - low) / (high - low). Tensor arithmetic in freqs' dtype."""
    factor = rope_scaling["factor"]
    low, high = rope_scaling["low_freq_factor"], rope_scaling["high_freq_factor"]
    original = rope_scaling["original_max_position_embeddings"]
    wavelength = 2 * math.pi / freqs
    smooth = (original / wavelength - low) / (high - low)
    blended = (1 - smooth) * freqs / factor + smooth * freqs
    scaled = torch.where(wavelength > original / low, freqs / factor, blended)
    return torch.where(wavelength < original / high, freqs, scaled)


def gpt_fast_precompute_freqs_cis(seq_len, n_elem, base=10000, dtype=torch.bfloat16,
                                  rope_scaling=None):
    """The cache [seq_len, n_elem // 2, 2] in dtype: (cos, sin) of p * base^(-2i/n_elem) (the
    frequencies Llama 3.1-scaled when rope_scaling is given), float32, rounded once to dtype."""
    inv_freq = _inverse_frequencies(n_elem, base)
    if rope_scaling is not None:
        inv_freq = gpt_fast_apply_rope_scaling(inv_freq, rope_scaling)
    return torch.view_as_real(_unit_phasors(seq_len, inv_freq)).to(dtype)


def gpt_fast_apply_rotary_emb(x, freqs_cis):
    """x [batch, seqlen, heads, head_dim] rounded to float32, each pair of neighbours
    (2i, 2i + 1) turned by freqs_cis[s, i] = (cos, sin): a [seqlen, head_dim / 2, 2] table of any
    dtype and modulus, which must view (no copy) as [1, seqlen, 1, head_dim / 2, 2]. Returns x's
    dtype."""
    if x.dim() != 4:
        raise ValueError(f"x must be [batch, seqlen, heads, head_dim], got shape {tuple(x.shape)}")
    pairs = x.float().reshape(*x.shape[:-1], -1, 2)
    table = freqs_cis.view(1, x.shape[1], 1, pairs.shape[3], 2)
    (a, b), (cos, sin) = pairs.unbind(-1), table.unbind(-1)
    turned = _turn(a, b, cos, sin, cos, sin)
    return torch.stack(turned, dim=-1).flatten(3).type_as(x)
