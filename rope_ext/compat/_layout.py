"""Shared argument handling of the drop-ins: the peers' q/k layouts as views rope_ext's ops take,
their scalar arguments checked with errors that name them, and the pieces several drop-ins
compute alike (the transformers-layout rotation, float32 tables, cached device scalars, the two
members of full-width tables, checks of tensor values, DTensor detection)."""

import functools
import math
import sys
import threading

import torch

from .._args import check_dense, check_flag, check_int, check_tensors  # noqa: F401  (re-exported for the drop-ins)
from .._compiling import compiling, tracing  # noqa: F401  (re-exported for the drop-ins)
from ..ops import check_head_size, heads  # noqa: F401

from .._call import ops  # noqa: E402  (torch.ops.rope, without autograd where none is needed)
from .._registrations import has_tangent


def interleaved_of(is_neox):
    """The pair layout of serving engines' is_neox flag (True: rotate_half pairs), checked: a
    string or None must not pick the GPT-J layout silently."""
    if is_neox is True:
        return False
    return not check_flag(is_neox, "is_neox")


def derivative_wanted(*tables):
    """Whether a derivative reaches the tables: one requires grad, or carries a forward-AD
    tangent. The one-pass forms read one member of each pair of a full-width table, so the
    other's derivative needs the two passes."""
    return (torch.is_grad_enabled() and any(t.requires_grad for t in tables)) or \
        has_tangent(tables, {})


def check_index_tensor(t, name, shape=None):
    if not isinstance(t, torch.Tensor) or t.dtype not in (torch.int32, torch.int64):
        got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be an int32 or int64 tensor, got {got}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(t.shape)}")
    return check_dense(t, name)


def check_cache_views(positions, query, key, head_size, cos_sin_cache, key_required=None):
    """(query, key) as (nnz, num_heads, head_size) views, for FlashInfer's and SGLang's
    apply_rope_with_cos_sin_cache*: checks the cache's dtype, head_size, positions (nnz,), key,
    then query's and key's layouts, in that order. key may be None (returned as None) unless
    key_required, the error message for a missing key, is given."""
    try:
        if cos_sin_cache.dtype != torch.float32:
            raise ValueError("cos_sin_cache should be float32")
        head_size = check_head_size(head_size)
        if positions.dim() != 1:
            raise ValueError(f"positions must have shape (nnz,), got {list(positions.shape)}")
        if key is None and key_required is not None:
            raise ValueError(key_required)
        q, k = _peer_view(query, head_size, "query"), _peer_view(key, head_size, "key")
    except AttributeError:
        check_tensors(("key",), cos_sin_cache=cos_sin_cache, positions=positions, query=query,
                      key=key)
        raise
    if q is None:
        check_tensors(query=query)
    return q, k


def _peer_view(t, head_size, name):
    """t as (nnz, num_heads, head_size): the peers view it as t.view(nnz, -1, head_size), so a
    3-D t whose last dim is a multiple of head_size is taken too (a view: writes reach t)."""
    if t is not None and t.dim() == 3 and t.shape[-1] != head_size and t.shape[-1] % head_size == 0:
        return t.view(t.shape[0], -1, head_size)
    return heads(t, head_size, name, 1)


def uncached_when_tracing(cached):
    """`cached` (an lru_cache'd function), or its uncached body while tracing(): the cache
    spares eager calls their host-to-device copies; a traced graph builds its own tensors."""
    return cached.__wrapped__ if tracing() else cached


# Where a peer computes each token's angles in registers (SGLang's fused_qk_norm_rope,
# FlashInfer's pos_ids functions), a table of each call's tokens costs a dozen small ops (20-60 us
# at decode on one CPU thread, where the rotation takes 5). So on the CPU a table of positions
# 0 .. n-1 is kept per frequency set (its rows are the per-token rows' values) and the positions
# index it, grown (by the rows past its end) to the next power of two past the largest position.
# At most _TABLES_KEPT sets are kept, each at most _TABLE_BYTES: a call past either (another set,
# a later position), on another device (a host sync would break CUDA graphs) or while tracing
# builds the per-token table, as a call did before the cache.
_TABLES = {}
_TABLES_KEPT = 8
_TABLE_BYTES = 64 << 20  # 131072 positions at rotary_dim 128
_TABLES_LOCK = threading.Lock()


def positions_table(positions, key, rotary_dim, build):
    """The kept (n, rotary_dim) table of frequency set `key` (a tuple naming its drop-in first)
    whose rows `positions` index, made by build(positions) -> their rows; or None: the caller
    builds the rows of its tokens itself."""
    if (type(positions) is not torch.Tensor or positions.device.type != "cpu"
            or positions.numel() == 0 or tracing() or _wrapped(positions)):
        return None  # (a torch.func transform's wrapper has no values to read)
    if positions.numel() <= 64:  # decode: cheaper than a reduction
        values = positions.tolist()
        low, high = min(values), max(values)
    else:
        low, high = (int(v) for v in positions.aminmax())
    table = _TABLES.get(key)
    if table is not None and 0 <= low and high < table.shape[0]:
        return table
    size = max(4096, 1 << high.bit_length())
    if low < 0 or size * 4 * max(rotary_dim, 2) > _TABLE_BYTES:
        return None
    with _TABLES_LOCK:
        table = _TABLES.get(key)
        if table is None and len(_TABLES) >= _TABLES_KEPT:
            return None
        start = 0 if table is None else table.shape[0]
        if start < size:
            with torch.inference_mode(False), torch.no_grad():  # usable in any mode later
                rows = build(torch.arange(start, size, device="cpu"))
                table = rows if table is None else torch.cat((table, rows))
            _TABLES[key] = table
        return table


@functools.lru_cache(maxsize=64)
def _float32_scalar(value, sign, device):
    # `sign` only keys the cache: 0.0 and -0.0 are one key otherwise, yet divide to opposite
    # infinities.
    return torch.tensor([value], dtype=torch.float32, device=device)


def float32_scalar(value, device):
    """A (1,) float32 tensor holding float(value) on `device`. Cached: a serving loop passes the
    same few values every layer and step, and the cache spares a host-to-device copy each
    (read-only: callers never write it)."""
    value = float(value)
    return uncached_when_tracing(_float32_scalar)(value, math.copysign(1.0, value), device)


def float32_table(table):
    """A float16/bfloat16 cos or sin table as float32 (exact), any other as it is. The tables are
    small next to q and k (they broadcast over the heads), and the kernels run faster on float32
    tables (on CPU several times so when they broadcast over an outer dim)."""
    return table.float() if table.dtype in (torch.float16, torch.bfloat16) else table


def broadcasts_within(table, x):
    """Whether a (..., pairs) table has x's number of dims and broadcasts over x without
    growing it (each leading dim 1 or x's): the tables rope_ext's ops take as they are."""
    return table.dim() == x.dim() and all(c == 1 or c == n for c, n in zip(table.shape[:-1], x.shape[:-1]))


def broadcast_shape(*shapes):
    """torch.broadcast_shapes(*shapes), without most of its cost for shapes of plain ints (17-50
    us a call in torch 2.14, which checks each dim as a symbolic one); symbolic shapes (under
    torch.compile) and shapes that do not broadcast (its error) go to torch's."""
    n = max(map(len, shapes))
    out = [1] * n
    for shape in shapes:
        for i, d in enumerate(shape, n - len(shape)):
            if type(d) is not int or out[i] not in (1, d) and d != 1:
                return torch.broadcast_shapes(*shapes)
            if d != 1:
                out[i] = d
    return torch.Size(out)


def rotate_pairs(x, cos, sin, dtype, interleaved=False):
    """x with pair i of its first 2 * cos.size(-1) dims rotated by (cos[..., i], sin[..., i]), the
    rest passed through; cos/sin broadcast against x.shape[:-1] as torch broadcasts, the result in
    `dtype` (computed in float32, or float64 for float64)."""
    if cos.shape == sin.shape and broadcasts_within(cos, x):  # the op broadcasts the tables
        return ops.apply(x if x.dtype == dtype else x.to(dtype), cos, sin, interleaved)
    lead = broadcast_shape(x.shape[:-1], cos.shape[:-1], sin.shape[:-1])
    x = x.to(dtype).expand(*lead, x.shape[-1])
    shape = broadcast_shape(cos.shape, sin.shape)
    cos, sin = cos.expand(shape), sin.expand(shape)
    pad = (None,) * (x.dim() - cos.dim())  # rope.apply aligns no dims implicitly
    return ops.apply(x, cos[pad], sin[pad], interleaved)


def rotate_pairs_promoted(x, cos, sin, interleaved=False):
    """rotate_pairs with the arithmetic of the peers that compute `x.float() * table` (gpt-fast,
    Meta's complex multiply): float32, or float64 where x or the table is float64 (torch's
    promotion), one rounding to x's dtype."""
    if cos.dtype != torch.float64 or x.dtype == torch.float64:
        return rotate_pairs(x, cos, sin, x.dtype, interleaved)
    return rotate_pairs(x, cos, sin, torch.float64, interleaved).to(x.dtype)


_wrapped = torch._C._functorch.is_functorch_wrapped_tensor  # vmap's, grad's, functionalize's


def comparable(t):
    """A tensor whose values can be read here (not fake, meta, functional or distributed, nor a
    torch.func transform's wrapper): the drop-ins compare a table's pair members on it."""
    return (type(t) in (torch.Tensor, torch.nn.Parameter) and t.device.type != "meta"
            and not _wrapped(t))


def pair_members(table, interleaved):
    """The two (..., width/2) views of a table with one entry per element of the rotary dims (its
    last dim, `width`): each pair's first member's entries, and its second's. Pairs are (2i, 2i+1)
    if interleaved, else (i, i + width/2)."""
    if interleaved:
        return table[..., 0::2], table[..., 1::2]
    half = table.shape[-1] // 2
    return table[..., :half], table[..., half:]


def join_members(first, second, interleaved, width):
    """One tensor from two rotations of the same x: each pair's first member of the first `width`
    dims from `first`, everything else (second members, and the dims past `width`, which both
    passed through) from `second`."""
    if not interleaved:
        return torch.cat((first[..., : width // 2], second[..., width // 2 :]), dim=-1)
    pairs = torch.stack((first[..., 0:width:2], second[..., 1:width:2]), dim=-1).flatten(-2)
    if width == first.shape[-1]:
        return pairs
    return torch.cat((pairs, second[..., width:]), dim=-1)


def check_values(ok, message, **sizes):
    """A check of tensor values (a bool tensor, every element true) without a host-device sync
    where one would cost: on CPU outside torch.compile a ValueError(message), elsewhere a
    device-side assert with the same message. With `sizes`, message is a str.format template of
    them; while torch.compile traces, each size is written as its name (formatting a symbolic
    size would specialize the graph to its value)."""
    if ok.device.type == "cpu" and not compiling():
        if not bool(ok.all()):
            raise ValueError(message.format(**sizes) if sizes else message)
    else:
        if sizes:
            traced = compiling()
            message = message.format(**{k: k if traced else v for k, v in sizes.items()})
        torch._assert_async(ok.all(), message)



def is_dtensor(t):
    """t is a DTensor (without importing DTensor: a process that never loaded it holds none)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)
