"""gpt-fast's RoPE (`model.py`, copied into many small training and inference scripts) on
rope_ext's op.

    from model import apply_rotary_emb, precompute_freqs_cis
 -> from rope_ext.compat.gpt_fast import apply_rotary_emb, precompute_freqs_cis

The cache is real: freqs_cis (seq, head_dim / 2, 2) holds (cos, sin) of each pair (2i, 2i+1),
bfloat16 by default. Same signatures, layouts, values (float32 arithmetic, as gpt-fast's x.float();
float64 where x or the cache is float64, as its product promotes; one rounding to x's dtype) and
gradients (w.r.t. x, and w.r.t. freqs_cis where it requires one). Arguments gpt-fast fails on
raise a ValueError naming them.
"""

import math

import torch

from .._args import check_positive
from ..scaling import llama3_parameters
from ._layout import float32_table, rotate_pairs_promoted
from .llama import cis, inv_freq


def _llama3_scaled(freqs, rope_scaling):
    """gpt-fast's Llama 3.1 frequency scaling, element for element in float32 as its loop computes
    it (rope_ext.scaling's llama3 computes in float64: the same frequencies up to the last bit,
    but the cache is gpt-fast's own only with gpt-fast's rounding)."""
    llama3_parameters(rope_scaling, "precompute_freqs_cis: rope_scaling", ordered=False)  # as given
    factor = rope_scaling["factor"]
    low_freq_factor = rope_scaling["low_freq_factor"]
    high_freq_factor = rope_scaling["high_freq_factor"]
    old_context_len = rope_scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / freqs
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * freqs / factor + smooth * freqs
    scaled = torch.where(wavelen > old_context_len / low_freq_factor, freqs / factor, blended)
    return torch.where(wavelen < old_context_len / high_freq_factor, freqs, scaled)


def precompute_freqs_cis(seq_len, n_elem, base=10000, dtype=torch.bfloat16, rope_scaling=None):
    """gpt-fast's cache: (seq_len, n_elem // 2, 2), [..., 0] cos and [..., 1] sin of p * w_i,
    w_i = base^(-2i/n_elem) (Llama 3.1-scaled with a rope_scaling dict), in `dtype`."""
    check_positive(base, "base")
    freqs = inv_freq(n_elem, base)
    if rope_scaling is not None:
        freqs = _llama3_scaled(freqs, rope_scaling)
    freqs_cis = cis(seq_len, freqs)
    return torch.stack([freqs_cis.real, freqs_cis.imag], dim=-1).to(dtype=dtype)


def apply_rotary_emb(x, freqs_cis):
    """x (bsz, seqlen, n_heads, head_dim) rotated by freqs_cis (seqlen, head_dim / 2, 2) (any
    shape with those elements that views as gpt-fast's (1, seqlen, 1, head_dim / 2, 2)); returns
    a new tensor in x's dtype."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() != 4 or x.shape[-1] % 2:
        got = f"{x.dtype} of shape {list(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"x must be a 4-D floating-point tensor (bsz, seqlen, n_heads, head_dim) "
                         f"with an even head_dim, got {got}")
    want = (1, x.shape[1], 1, x.shape[3] // 2, 2)
    if not isinstance(freqs_cis, torch.Tensor) or not freqs_cis.is_floating_point():
        got = freqs_cis.dtype if isinstance(freqs_cis, torch.Tensor) else type(freqs_cis).__name__
        raise ValueError(f"freqs_cis must be a real floating-point tensor (seqlen, head_dim / 2, 2), "
                         f"got {got}")
    if freqs_cis.numel() != math.prod(want):
        raise ValueError(f"freqs_cis of shape {list(freqs_cis.shape)} must hold seqlen * head_dim / 2 "
                         f"* 2 = {math.prod(want)} elements (seqlen, head_dim / 2, 2) for x of shape "
                         f"{list(x.shape)}")
    if freqs_cis.device != x.device:
        raise ValueError(f"freqs_cis must be on x's device ({x.device}), got {freqs_cis.device}")
    try:
        table = freqs_cis.view(want)
    except RuntimeError as e:
        raise ValueError(f"freqs_cis (shape {list(freqs_cis.shape)}, strides "
                         f"{list(freqs_cis.stride())}) cannot be viewed as {list(want)}, as gpt-fast "
                         f"views it: {e}") from None
    return rotate_pairs_promoted(x, float32_table(table[..., 0]), float32_table(table[..., 1]),
                                 interleaved=True)
