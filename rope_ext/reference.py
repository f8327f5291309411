"""Pure-PyTorch RoPE: the fallback wherever no native kernel serves, and the readable spec.

Same signatures, semantics and errors as the native ops (README "The ops"); math in float32
(float64 for float64 inputs), like the kernels. docs/math.md has the formulas.
"""

import math
import sys

import torch

from . import _checks

__all__ = [
    "apply_and_cache_", "apply_mrope_", "apply_positions", "apply_positions_cache", "apply_rope",
    "apply_rope_", "apply_rope_backward", "apply_rope_out", "cache_halves", "gather_tables",
    "positions_table_grads", "table_grads", "TOLERANCES",
]

# How far a kernel's result may be from the float64 reference, per dtype of x: (rtol, atol), the
# test of torch.testing.assert_close. The one table: the test suite and `python -m rope_ext` use it.
TOLERANCES = {
    torch.float64: (1e-12, 1e-12),
    torch.float32: (1e-6, 1e-6),
    torch.float16: (1e-3, 2e-3),
    torch.bfloat16: (1e-2, 1.6e-2),
}


def _acc_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _split_pairs(x, half, interleaved):
    """(first, second) members of each rotary pair of x[..., :2*half]."""
    if interleaved:
        return x[..., 0 : 2 * half : 2], x[..., 1 : 2 * half : 2]
    return x[..., :half], x[..., half : 2 * half]


def _join_pairs(first, second, interleaved):
    if interleaved:
        return torch.stack((first, second), dim=-1).flatten(-2)
    return torch.cat((first, second), dim=-1)


def _rotate(x, cos, sin, interleaved, inverse):
    half = cos.shape[-1]
    acc = _acc_dtype(x.dtype)
    a, b = _split_pairs(x.to(acc), half, interleaved)
    c, s = cos.to(acc), sin.to(acc)
    if inverse:  # by -angle; (not s = -s: that would materialize a broadcast table)
        rotated = _join_pairs(a * c + b * s, b * c - a * s, interleaved)
    else:
        rotated = _join_pairs(a * c - b * s, b * c + a * s, interleaved)
    rotated = rotated.to(x.dtype)
    return torch.cat((rotated, x[..., 2 * half :]), dim=-1)


def apply_rope(x, cos, sin, *, interleaved=False):
    """Rotated copy of x; cos/sin (..., rotary_dim/2) with x's number of dims, broadcast."""
    _checks.check_apply(x, cos, sin)
    return _rotate(x, cos, sin, interleaved, inverse=False)


def apply_rope_out(x, cos, sin, *, interleaved=False, out):
    """apply_rope written into `out` (x's shape and dtype, contiguous, sharing no memory with the
    inputs); returns out (the op rope.apply.out returns nothing)."""
    _checks.check_apply_out(x, cos, sin, out)
    return out.copy_(_rotate(x, cos, sin, interleaved, inverse=False))


def apply_rope_backward(grad, cos, sin, *, interleaved=False):
    """Gradient of apply_rope w.r.t. x: the inverse rotation of grad."""
    _checks.check_apply(grad, cos, sin, op="rope.apply_backward", x_name="grad")
    return _rotate(grad, cos, sin, interleaved, inverse=True)


def _pair_grads(x, grad, half, interleaved, inverse):
    """Per-pair d cos, d sin of one rotation (docs/math.md "Backward"), in the arithmetic type."""
    acc = _acc_dtype(x.dtype)
    a, b = _split_pairs(x.to(acc), half, interleaved)
    ga, gb = _split_pairs(grad.to(acc), half, interleaved)
    d_sin = gb * a - ga * b
    return ga * a + gb * b, -d_sin if inverse else d_sin


def table_grads(x, grad, cos, sin, interleaved, inverse=False):
    """Gradients w.r.t. cos and sin of apply (inverse=False) or apply_backward (True), summed
    over the dims along which the tables were broadcast."""
    d_cos, d_sin = _pair_grads(x, grad, cos.shape[-1], interleaved, inverse)
    return _sum_to(d_cos, cos.shape).to(cos.dtype), _sum_to(d_sin, sin.shape).to(sin.dtype)


def _sum_to(t, shape):
    """t.sum_to_size(shape), deciding as torch's broadcasting does where a size depends on data
    (a traced token count from nonzero() or mark_unbacked): a table dim not known to be 1 is
    taken to match x's and recorded so, not summed over."""
    if all(type(n) is int for n in (*t.shape, *shape)):  # eager, and every size known
        return t.sum_to_size(shape)
    lead = t.dim() - len(shape)
    broadcast = []
    for i, n in enumerate(shape):
        size = t.shape[lead + i]
        if _checks.decided(n == 1, False):
            if not _checks.decided(size == 1, False):
                broadcast.append(lead + i)
        elif not isinstance(n, int) or not isinstance(size, int):
            torch._check(size == n)
    if broadcast:  # (an empty dim list would sum over every dim)
        t = t.sum(broadcast, keepdim=True)
    return t.sum(list(range(lead))) if lead else t


def gather_tables(positions, cos, sin, mrope_section=None, mrope_interleaved=False):
    """The cos/sin rows each token of x (..., H, D) reads: tables (max_position, rotary_dim/2)
    gathered at positions (x.shape[:-2]) -> (..., 1, rotary_dim/2), broadcast over heads. With
    mrope_section, positions are (3,) + x.shape[:-2] and pair i takes its row from the position
    component of its section (chunked or interleaved)."""
    if mrope_section is None:
        idx = positions.long()
        return cos[idx].unsqueeze(-2), sin[idx].unsqueeze(-2)
    half = cos.shape[1]
    component = mrope_components(mrope_section, half, mrope_interleaved, positions.device)
    # (..., half): the position of pair i of each token
    pos = positions.long().movedim(0, -1)[..., component]
    pair = torch.arange(half, device=positions.device)
    return cos[pos, pair].unsqueeze(-2), sin[pos, pair].unsqueeze(-2)


def mrope_components(mrope_section, half, mrope_interleaved, device=None):
    """(half,) int64: the position component (0 temporal, 1 height, 2 width) of each pair."""
    t, h, w = (int(s) for s in mrope_section)
    i = torch.arange(half, device=device)
    if mrope_interleaved:
        comp = torch.zeros(half, dtype=torch.int64, device=device)
        comp[(i % 3 == 1) & (i < 3 * h)] = 1
        comp[(i % 3 == 2) & (i < 3 * w)] = 2
        return comp
    return (i >= t).long() + (i >= t + h).long()


def apply_positions(x, positions, cos, sin, *, interleaved=False, inverse=False,
                    mrope_section=None, mrope_interleaved=False):
    """Rotated copy of x (..., H, D) by the rows of cos/sin (max_position, rotary_dim/2) at
    positions; inverse=True rotates by the negative angle."""
    _checks.check_apply_positions(x, positions, cos, sin, mrope_section,
                                  mrope_interleaved=mrope_interleaved)
    _checks.check_positions_in_range(positions, cos.shape[0], "rope.apply_positions", "cos.size(0)")
    c, s = gather_tables(positions, cos, sin, mrope_section, mrope_interleaved)
    return _rotate(x, c, s, interleaved, inverse)


def apply_positions_cache(x, positions, cos_sin_cache, *, interleaved=False, inverse=False,
                          mrope_section=None, mrope_interleaved=False):
    """apply_positions with the tables as one cos_sin_cache (max_position, rotary_dim), cos in
    the first half of each row."""
    _checks.check_apply_positions(x, positions, None, None, mrope_section, cache=cos_sin_cache,
                                  mrope_interleaved=mrope_interleaved)
    _checks.check_positions_in_range(positions, cos_sin_cache.shape[0],
                                     "rope.apply_positions.cache", "cos_sin_cache.size(0)")
    cos, sin = cache_halves(cos_sin_cache)
    c, s = gather_tables(positions, cos, sin, mrope_section, mrope_interleaved)
    return _rotate(x, c, s, interleaved, inverse)


def positions_table_grads(x, grad, positions, cos, sin, interleaved, inverse=False,
                          mrope_section=None, mrope_interleaved=False):
    """Gradients w.r.t. the tables cos, sin of apply_positions: each token's per-pair gradient,
    summed over heads, added into the row it read."""
    half = cos.shape[1]
    tokens = math.prod(x.shape[:-2])  # (not reshape(-1, half): ambiguous for a rotary_dim 0 table)
    d_cos, d_sin = _pair_grads(x, grad, half, interleaved, inverse)
    d_cos, d_sin = d_cos.sum(-2).reshape(tokens, half), d_sin.sum(-2).reshape(tokens, half)
    if mrope_section is None:
        rows = positions.long().reshape(tokens, 1).expand(tokens, half)
    else:
        comp = mrope_components(mrope_section, half, mrope_interleaved, positions.device)
        by_token = positions.long().movedim(0, -1)
        dtensor = sys.modules.get("torch.distributed.tensor")
        if dtensor is not None and isinstance(by_token, dtensor.DTensor):  # (refuses a plain index)
            comp = dtensor.DTensor.from_local(comp, by_token.device_mesh,
                                              [dtensor.Replicate()] * by_token.device_mesh.ndim,
                                              run_check=False)
        rows = by_token[..., comp].reshape(tokens, half)
    g_cos = cos.new_zeros(cos.shape, dtype=d_cos.dtype).scatter_add(0, rows, d_cos)
    g_sin = sin.new_zeros(sin.shape, dtype=d_sin.dtype).scatter_add(0, rows, d_sin)
    return g_cos.to(cos.dtype), g_sin.to(sin.dtype)


def cache_halves(cos_sin_cache):
    """The cos and sin halves of a (max_position, rotary_dim) table, as views."""
    width = cos_sin_cache.shape[1]
    if width % 2 == 0:
        return cos_sin_cache.chunk(2, 1)  # both views in one call: half the cost of two slices
    return cos_sin_cache[:, : width // 2], cos_sin_cache[:, width // 2 :]


def _rotate_inplace(query, key, positions, cos_sin_cache, interleaved, mrope_section=None,
                    mrope_interleaved=False, rope_dim_offset=0, inverse=False):
    if query.numel() == 0 and (key is None or key.numel() == 0):
        return query, key  # no rows, however many (broadcast) positions
    cos, sin = cache_halves(cos_sin_cache)
    c, s = gather_tables(positions, cos, sin, mrope_section, mrope_interleaved)
    for t in (query, key):
        if t is not None:
            part = t[..., rope_dim_offset:]  # the rotary dims start at the offset
            part.copy_(_rotate(part, c, s, interleaved, inverse=inverse))
    return query, key


def apply_rope_(query, key, positions, cos_sin_cache, *, interleaved=False, rope_dim_offset=0,
                inverse=False):
    """Rotates query (and key, unless None) in place by the cache rows at `positions`: dims
    [rope_dim_offset, rope_dim_offset + rotary_dim) of each head, by the negative angle with
    inverse=True."""
    _checks.check_apply_inplace(query, key, positions, cos_sin_cache,
                                rope_dim_offset=rope_dim_offset)
    positions = _checks.positions_read_once(positions, (query, key))
    _checks.check_positions_in_range(positions, cos_sin_cache.shape[0], "rope.apply_")
    return _rotate_inplace(query, key, positions, cos_sin_cache, interleaved,
                           rope_dim_offset=rope_dim_offset, inverse=inverse)


def apply_mrope_(query, key, positions, cos_sin_cache, mrope_section, *, interleaved=False,
                 mrope_interleaved=False, rope_dim_offset=0, inverse=False):
    """Multimodal RoPE in place: positions (3,) + query.shape[:-2] (temporal, height, width);
    mrope_section splits the rotary_dim/2 pairs into 3 groups (chunked or interleaved);
    rope_dim_offset and inverse as for apply_rope_."""
    section = _checks.check_mrope(query, key, positions, cos_sin_cache, mrope_section,
                                  rope_dim_offset=rope_dim_offset)
    positions = _checks.positions_read_once(positions, (query, key))
    _checks.check_positions_in_range(positions, cos_sin_cache.shape[0], "rope.mrope_")
    return _rotate_inplace(query, key, positions, cos_sin_cache, interleaved, section,
                           mrope_interleaved, rope_dim_offset, inverse)


def fp8_code(x, scale, dtype):
    """x / scale saturated to the float8 format's finite range and converted (NaN stays NaN): what
    rope.apply_and_cache_ stores for kv_cache_dtype fp8."""
    m = torch.finfo(dtype).max
    return (x.float() / scale).clamp(-m, m).to(dtype)  # clamp keeps NaN


def apply_and_cache_(query, key, value, positions, cos_sin_cache, key_cache, value_cache,
                     slot_mapping, *, interleaved=False, kv_cache_dtype="auto", k_scale=None,
                     v_scale=None):
    """Rotates query and key in place, then writes the rotated key and value into the paged
    caches (num_blocks, block_size, Hk, D) at slot_mapping (negative slots skipped)."""
    fmt = _checks.check_apply_and_cache(query, key, value, positions, cos_sin_cache, key_cache,
                                        value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale)
    positions = _checks.positions_read_once(positions, (query, key, key_cache, value_cache))
    slot_mapping = _checks.positions_read_once(slot_mapping, (query, key, key_cache, value_cache))
    _checks.check_positions_in_range(positions, cos_sin_cache.shape[0], "rope.apply_and_cache_")
    block_size = key_cache.shape[1]
    _checks.check_slots_in_range(slot_mapping, key_cache.shape[0] * block_size)
    _rotate_inplace(query, key, positions, cos_sin_cache, interleaved)
    store_paged(key, value, key_cache, value_cache, slot_mapping, fmt, k_scale, v_scale)
    return query, key


def store_paged(key, value, key_cache, value_cache, slot_mapping, fmt, k_scale, v_scale):
    """The store stage of every op that ends in the paged caches: the rows of key and value
    (tokens, Hk, D / Dv) to the caches (num_blocks, block_size, Hk, D / Dv) at slot_mapping
    (negative slots skipped), as x / scale saturated to float8 where fmt is a float8 dtype."""
    block_size = key_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    blocks, offsets = slots // block_size, slots % block_size
    k, v = key[keep], value[keep]
    kc, vc = key_cache, value_cache
    if fmt is not None:  # float8 tensors take no index_put: write their bytes
        k, v = fp8_code(k, k_scale, fmt).view(torch.uint8), fp8_code(v, v_scale, fmt).view(torch.uint8)
        kc, vc = kc.view(torch.uint8), vc.view(torch.uint8)
    kc[blocks, offsets] = k
    vc[blocks, offsets] = v
