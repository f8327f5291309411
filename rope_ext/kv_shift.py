"""K-shift: re-rotating the keys of a paged KV cache by a position change, in place (llama.cpp's
context shift, StreamingLLM's attention sinks, a cached prefix reused at new positions).
docs/kv-shift.md has the semantics and their limits."""

import functools
import numbers

import torch

from ._args import check_flag
from ._compiling import tracing
from ._registrations import check_not_inference

from ._call import ops  # noqa: E402  (torch.ops.rope, without autograd where none is needed)

_INT64 = (-(2**63), 2**63 - 1)


def _delta_tensor(delta, device):
    if isinstance(delta, torch.Tensor):
        return delta
    if isinstance(delta, bool) or not isinstance(delta, numbers.Integral):
        raise ValueError(f"delta must be an int or an int32/int64 tensor, got {delta!r}")
    if not _INT64[0] <= delta <= _INT64[1]:
        raise ValueError(f"delta must fit in int64, got {delta}")
    if device is None or tracing():  # (no cache: the op names key_cache; a trace's own tensor)
        return torch.tensor(int(delta), dtype=torch.int64, device=device)
    return _int64_scalar(int(delta), device)


@functools.lru_cache(maxsize=64)
def _int64_scalar(value, device):
    """A 0-dim int64 tensor of `value` on `device`, kept: a tensor made per call was 4 of a 10 us
    decode-sized shift (a host-to-device copy on a GPU). Read-only: the op never writes it. Made
    outside inference mode, so that any later mode can use it."""
    with torch.inference_mode(False):
        return torch.tensor(value, dtype=torch.int64, device=device)


def shift_kv_cache_(key_cache, slot_mapping, delta, cos_sin_cache, *, interleaved=False,
                    kv_cache_dtype="auto", k_scale=None):
    """Rotates the cached keys of the listed slots in place by `delta` positions: keys written
    at position p become the keys written at p + delta.

    key_cache: (num_blocks, block_size, num_kv_heads, head_dim), the paged layout
    apply_rope_and_cache_ writes (slot = block * block_size + offset); float16/bfloat16/float32/
    float64, or float8 with kv_cache_dtype "fp8"/"fp8_e4m3"/"fp8_e5m2" and k_scale (a float32
    tensor of one element): the keys are dequantized (code * k_scale), rotated and requantized
    (value / k_scale, saturated).
    slot_mapping: (N,) int32/int64, the slots to shift, each at most once; negative: skipped.
    delta: an int, or an int32/int64 tensor of shape () or (N,); may be negative.
    cos_sin_cache: (max_position, rotary_dim) cos | sin, the table the keys were rotated with;
    |delta| < max_position. Row |delta|'s (cos, sin) pairs, normalized to unit length, rotate
    the first rotary_dim dims of each head (by the negative angle for delta < 0); tables with
    an attention factor (YaRN, LongRoPE) therefore do not rescale the keys.
    interleaved: the pair layout the keys were rotated with.
    Every bad argument (a slot out of range or listed twice, |delta| too large) is an error
    before anything is written. Not differentiable. Returns None."""
    check_not_inference(key_cache)
    check_flag(interleaved, "interleaved")
    device = key_cache.device if isinstance(key_cache, torch.Tensor) else None  # (the op names it)
    ops.shift_kv_cache_(key_cache, slot_mapping, _delta_tensor(delta, device),
                        cos_sin_cache, interleaved, kv_cache_dtype, k_scale)
