"""rope.shift_kv_cache_ (K-shift) in PyTorch: the checks, mirroring csrc/ops/kv_shift/checks.h
message for message, and the reference kernel (the readable spec; docs/kv-shift.md).

Each listed slot's cached keys are rotated in place by `delta` positions: the first rotary_dim
dims of every head, pair by pair, by the unit rotation of table row |delta| ((cos, sin)
normalized to length 1, so a table carrying an attention factor does not rescale the keys;
sin negated for a negative delta). Math in float32 (float64 for a float64 cache), as the
kernels do it.
"""

import math

import torch

from .. import _checks
from .._checks import _check_same_device, _fail, _shape, dtype_name

OP = "rope.shift_kv_cache_"
KV_CACHE_DTYPES = _checks.KV_CACHE_DTYPES


def check_shift_kv_cache(key_cache, slot_mapping, delta, cos_sin_cache, kv_cache_dtype="auto",
                         k_scale=None, memory=True):
    """The metadata checks (no data read). Returns the float8 dtype of the cache, or None."""
    op = OP
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        _fail(f"{op}: kv_cache_dtype must be 'auto', 'fp8', 'fp8_e4m3' or 'fp8_e5m2', got "
              f"'{kv_cache_dtype}'")
    fmt = KV_CACHE_DTYPES[kv_cache_dtype]
    if fmt is None:
        if key_cache.dtype not in _checks.FLOAT_DTYPES:
            _fail(f"{op}: key_cache must be float16, bfloat16, float32 or float64 for kv_cache_dtype "
                  f"'auto', got {dtype_name(key_cache.dtype)}")
    elif key_cache.dtype != fmt:
        _fail(f"{op}: key_cache must be {dtype_name(fmt)} for kv_cache_dtype '{kv_cache_dtype}', got "
              f"{dtype_name(key_cache.dtype)}")
    if key_cache.dim() != 4:
        _fail(f"{op}: key_cache must have shape (num_blocks, block_size, num_kv_heads, head_dim), got "
              f"{_shape(key_cache)}")
    if key_cache.shape[1] < 1:
        _fail(f"{op}: key_cache must have block_size >= 1, got {_shape(key_cache)}")
    head_dim = key_cache.shape[3]
    table = cos_sin_cache
    _checks.check_cos_sin_cache(table, key_cache, "key_cache", head_dim, op)
    _check_same_device(key_cache, "key_cache", slot_mapping, op, "slot_mapping")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        _fail(f"{op}: slot_mapping must be int32 or int64, got {dtype_name(slot_mapping.dtype)}")
    if slot_mapping.dim() != 1:
        _fail(f"{op}: slot_mapping must have shape (num_slots_shifted,), got {_shape(slot_mapping)}")
    n = slot_mapping.shape[0]
    _check_same_device(key_cache, "key_cache", delta, op, "delta")
    if delta.dtype not in (torch.int32, torch.int64):
        _fail(f"{op}: delta must be int32 or int64, got {dtype_name(delta.dtype)}")
    if not (delta.dim() == 0 or (delta.dim() == 1 and delta.shape[0] == n)):
        _fail(f"{op}: delta must have shape () or slot_mapping's ({n},), got {_shape(delta)}")
    if fmt is not None and k_scale is None:
        _fail(f"{op}: k_scale is required for kv_cache_dtype '{kv_cache_dtype}' (a float32 tensor "
              "of one element)")
    if k_scale is not None:  # checked whenever given, as apply_and_cache_ checks its scales
        _check_same_device(key_cache, "key_cache", k_scale, op, "k_scale")
        if k_scale.dtype != torch.float32 or k_scale.numel() != 1:
            _fail(f"{op}: k_scale must be a float32 tensor of one element, got "
                  f"{dtype_name(k_scale.dtype)} of shape {_shape(k_scale)}")
    _checks.check_no_internal_overlap(key_cache, op, "key_cache")
    if memory:
        for name, t in (("slot_mapping", slot_mapping), ("delta", delta),
                        ("cos_sin_cache", table), ("k_scale", k_scale)):
            if t is not None:
                _checks.check_disjoint_bytes(key_cache, "key_cache", t, name, op)
    if _checks.decided(key_cache.shape[0] * key_cache.shape[1] >= 2**63, False):  # int64 slots
        _fail(f"{op}: key_cache has 2^63 slots or more")
    return fmt


def check_shift_data(key_cache, slot_mapping, delta, cos_sin_cache, k_scale):
    """The data checks (reads slots, deltas and k_scale: a device sync on accelerators), in the
    order of the kernels: k_scale; per index, the slot's range, then its delta's; duplicates."""
    op = OP
    if k_scale is not None:
        s = float(k_scale.reshape(()))
        if not (0.0 < s <= torch.finfo(torch.float32).max):
            _fail(f"{op}: k_scale must be finite and > 0 (the keys are dequantized, rotated and "
                  f"requantized with it), got {s:g}")
        # Every code times k_scale a finite, normal float32 (float32 arithmetic, as the kernels').
        codes = torch.finfo(key_cache.dtype)
        smallest = codes.smallest_normal * codes.eps  # the smallest subnormal code
        min_exp = -126 - round(math.log2(smallest))  # log2(FLT_MIN / smallest)
        scale = k_scale.reshape(()).float()
        if not (bool(torch.isfinite(scale * codes.max)) and s >= 2.0 ** min_exp):
            _fail(f"{op}: k_scale must lie in [2^{min_exp}, 3.40282e+38 / {codes.max:g}] for a "
                  f"{str(key_cache.dtype).removeprefix('torch.')} cache (every code times it a "
                  f"normal float32), got {s:g}")
    n = slot_mapping.shape[0]
    if n == 0:
        return
    slots = slot_mapping.long().cpu()
    deltas = delta.long().cpu().expand(n)
    num_slots = key_cache.shape[0] * key_cache.shape[1]
    rows = cos_sin_cache.shape[0]
    listed = slots >= 0
    bad_slot = listed & (slots >= num_slots)
    bad_delta = listed & ~bad_slot & ((deltas >= rows) | (deltas <= -rows))
    bad = bad_slot | bad_delta
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        if bool(bad_slot[i]):
            _fail(f"{op}: slot_mapping must lie below num_blocks * block_size = {num_slots} "
                  f"(negative: skipped), got {int(slots[i])} at index {i}")
        _fail(f"{op}: delta must lie in (-max_position, max_position) = (-{rows}, {rows}) (table "
              f"row |delta|; max_position = cos_sin_cache.size(0)), got {int(deltas[i])} at index {i}")
    # Duplicates: in a stable sort of the listed slots, equal slots are adjacent in index order;
    # the repeat with the smallest index is reported with the group's first index.
    index = listed.nonzero().flatten()
    order = torch.sort(slots[index], stable=True).indices
    ordered, at = slots[index][order], index[order]
    repeat = (ordered[1:] == ordered[:-1]).nonzero().flatten()
    if repeat.numel():
        k = int(repeat[at[repeat + 1].argmin()])
        _fail(f"{op}: slot_mapping must list each slot at most once (negative: skipped), got "
              f"slot {int(ordered[k + 1])} at indices {int(at[k])} and {int(at[k + 1])}")


def _acc_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _square_gap(x, c):
    """|x - c^2|, exactly: c^2 is fl(c * c) plus its rounding error, Dekker's product of c's two
    26-bit halves (float64 c, no overflow or underflow in the split)."""
    p = c * c
    t = 134217729.0 * c  # 2^27 + 1
    hi = t - (t - c)
    lo = c - hi
    error = ((hi * hi - p) + 2.0 * hi * lo) + lo * lo
    return ((x - p) - error).abs()


def _sqrt_rn(x):
    """The correctly rounded square root of a float64 tensor (x >= 0): torch's CPU sqrt is within
    1 ulp of it; of that root and its two neighbours, the one whose square is nearest x. (The
    nearest square is the nearest root: x is a whole multiple of the roots' squared ulp, which
    no midpoint's square is. Each |x - c^2| is exact: below 2^53 of those units where it
    decides.) Where the product could overflow or underflow, torch's root stays."""
    r = torch.sqrt(x)
    roots = torch.stack((torch.nextafter(r, torch.zeros_like(r)), r,
                         torch.nextafter(r, torch.full_like(r, math.inf))))
    best = roots.gather(0, _square_gap(x, roots).argmin(0, keepdim=True))[0]
    safe = (r > 2.0 ** -480) & (r < 2.0 ** 480)
    return torch.where(safe, best, r)


def unit_rows(cos_sin_cache, delta, acc):
    """(cos, sin) of the unit rotation by `delta` positions (one row per delta): table row
    |delta| normalized to length 1, sin negated for a negative delta."""
    half = cos_sin_cache.shape[1] // 2
    rows = cos_sin_cache[delta.abs()].to(acc)
    c, s = rows[..., :half], rows[..., half:]
    n2 = c * c + s * s
    # torch's CPU sqrt is not correctly rounded (its vector code is within 1 ulp); the kernels'
    # IEEE one is. A float32 root taken in float64 and rounded once is the correctly rounded
    # one; a float64 root is corrected by _sqrt_rn.
    if n2.device.type != "cpu":
        n = torch.sqrt(n2)
    elif acc == torch.float32:
        n = torch.sqrt(n2.double()).to(acc)
    else:
        n = _sqrt_rn(n2)
    c, s = c / n, s / n
    return c, torch.where(delta[..., None] < 0, -s, s)


def shift_kv_cache_(key_cache, slot_mapping, delta, cos_sin_cache, *, interleaved=False,
                    kv_cache_dtype="auto", k_scale=None):
    """The reference kernel: checks, then each listed slot's keys rotated in place."""
    fmt = check_shift_kv_cache(key_cache, slot_mapping, delta, cos_sin_cache, kv_cache_dtype,
                               k_scale)
    check_shift_data(key_cache, slot_mapping, delta, cos_sin_cache,
                     k_scale if fmt is not None else None)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    if slots.numel() == 0 or key_cache.shape[2] == 0 or cos_sin_cache.shape[1] == 0:
        return
    deltas = delta.long().expand(slot_mapping.shape)[keep]
    block_size = key_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    acc = _acc_dtype(key_cache.dtype)
    half = cos_sin_cache.shape[1] // 2
    rows = key_cache[blocks, offsets][..., : 2 * half]  # (n, Hk, rotary_dim); the rest untouched
    if fmt is not None:
        rows = rows.to(torch.float32) * k_scale.reshape(())
    rows = rows.to(acc)
    c, s = unit_rows(cos_sin_cache, deltas, acc)
    c, s = c[:, None], s[:, None]  # over heads
    if interleaved:
        a, b = rows[..., 0: 2 * half: 2], rows[..., 1: 2 * half: 2]
        rotated = torch.stack((a * c - b * s, b * c + a * s), dim=-1).flatten(-2)
    else:
        a, b = rows[..., :half], rows[..., half: 2 * half]
        rotated = torch.cat((a * c - b * s, b * c + a * s), dim=-1)
    if fmt is not None:  # float8 tensors take no index_put: write their bytes
        m = torch.finfo(fmt).max
        codes = (rotated / k_scale.reshape(())).clamp(-m, m).to(fmt)  # clamp keeps NaN
        key_cache.view(torch.uint8)[blocks, offsets, :, : 2 * half] = codes.view(torch.uint8)
    else:
        key_cache[blocks, offsets, :, : 2 * half] = rotated.to(key_cache.dtype)
