"""Argument checks for the Python paths (the reference and the fake kernels).

They mirror csrc/ops/checks.h: the same conditions in the same order and the same messages, so
an error reads the same whichever path served the call. `memory=False` skips what needs real
memory (fake tensors have none): the byte-range overlap checks.
"""

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# The C++ ScalarType names, so messages read the same on every path.
_DTYPE_NAMES = {
    torch.float16: "Half", torch.bfloat16: "BFloat16", torch.float32: "Float",
    torch.float64: "Double", torch.int8: "Char", torch.uint8: "Byte", torch.int16: "Short",
    torch.int32: "Int", torch.int64: "Long", torch.bool: "Bool", torch.complex64: "ComplexFloat",
    torch.complex128: "ComplexDouble", torch.float8_e4m3fn: "Float8_e4m3fn",
    torch.float8_e5m2: "Float8_e5m2", torch.complex32: "ComplexHalf",
    torch.float8_e4m3fnuz: "Float8_e4m3fnuz", torch.float8_e5m2fnuz: "Float8_e5m2fnuz",
    torch.uint16: "UInt16", torch.uint32: "UInt32", torch.uint64: "UInt64",
}
# Any other dtype, as the native library names it (csrc/ops/checks.h: kUnnamedDtype; the stable
# ABI of the torch it targets has no name for it).
UNNAMED_DTYPE = "a dtype no op takes (float8_e8m0fnu, float4_e2m1fn_x2, a quantized or bits dtype)"

INTERNAL_OVERLAP = (
    "unsupported operation: more than one element of the written-to tensor refers to a single "
    "memory location. Please clone() the tensor before performing the operation."
)
PARTIAL_OVERLAP = (
    "unsupported operation: some elements of the input tensor and the written-to tensor refer to "
    "a single memory location. Please clone() the tensor before performing the operation."
)
MROPE_COMPONENTS = 3


def dtype_name(dtype):
    return _DTYPE_NAMES.get(dtype, UNNAMED_DTYPE)


def _shape(t):
    return list(t.shape)


def _fail(msg):
    raise RuntimeError(msg)


# ---- sizes that may be traced ----
# Under torch.compile and torch.export a size can be symbolic, and an unbacked one (tokens picked
# by nonzero(), a length from .item(), mark_unbacked) cannot be compared while tracing. A check of
# such a size is left to the kernel, which checks the real sizes when it runs.

def decided(cond, default):
    """cond, a bool or a traced SymBool; `default` where it depends on data (no guard)."""
    if isinstance(cond, bool):
        return cond
    from torch.fx.experimental.symbolic_shapes import guard_or_false, guard_or_true
    return guard_or_true(cond) if default else guard_or_false(cond)


def differ(a, b):
    """Sizes, or shapes, a and b known to differ."""
    if isinstance(a, (tuple, list, torch.Size)):
        return len(a) != len(b) or any(differ(x, y) for x, y in zip(a, b))
    return decided(a != b, False)


def _check_float(t, op, name):
    if t.dtype not in FLOAT_DTYPES:
        _fail(f"{op}: {name} must be float16, bfloat16, float32 or float64, got {dtype_name(t.dtype)}")


def _check_same_device(ref, ref_name, t, op, name):
    if t.device != ref.device:
        _fail(f"{op}: {name} must be on the same device as {ref_name} ({ref.device}), got {t.device}")


def _check_positions_dtype(t, op):
    if t.dtype not in (torch.int32, torch.int64):
        _fail(f"{op}: positions must be int32 or int64, got {dtype_name(t.dtype)}")


# ---- memory overlap ----

def byte_range(t):
    """(begin, end) of the bytes t's elements span; None for an empty tensor."""
    if t.numel() == 0:
        return None
    last = sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
    begin = t.data_ptr()
    return begin, begin + (last + 1) * t.element_size()


def _intersects(a, b):
    return a is not None and b is not None and a[0] < b[1] and b[0] < a[1]


def _strided_dims_disjoint(dims, inner):
    """(size, stride) dims, sorted by stride, are non-overlapping when each stride exceeds the
    offset the smaller-stride dims reach (sufficient, not necessary)."""
    extent = inner
    for size, stride in sorted(dims, key=lambda d: d[1]):
        if decided(size <= 1, False):
            continue
        if decided(stride <= extent, False):
            return False
        extent += (size - 1) * stride
    return True


def check_no_internal_overlap(t, op, name):
    if differ(t.numel(), 0) and not _strided_dims_disjoint(list(zip(t.shape, t.stride())), 0):
        _fail(f"{op}: {name}: {INTERNAL_OVERLAP}")


def _rows_disjoint(a, b, nlead):
    ra, rb = byte_range(a), byte_range(b)
    if not _intersects(ra, rb):
        return True
    if a.element_size() != b.element_size():
        return False
    if any(a.shape[d] > 1 and a.stride(d) != b.stride(d) for d in range(nlead)):
        return False
    es = a.element_size()
    delta_bytes = b.data_ptr() - a.data_ptr()
    if delta_bytes % es:
        return False
    delta = delta_bytes // es
    rows = []
    for m, base in ((a, 0), (b, delta)):
        span = (m.shape[-1] - 1) * m.stride(-1)
        rows += [(base + h * m.stride(-2), base + h * m.stride(-2) + span) for h in range(m.shape[-2])]
    rows.sort()
    if any(rows[i][0] <= rows[i - 1][1] for i in range(1, len(rows))):
        return False
    span = max(r[1] for r in rows) - rows[0][0]
    return _strided_dims_disjoint([(a.shape[d], a.stride(d)) for d in range(nlead)], span)


def _lattice_reaches(dims, r, budget):
    """Mirrors checks.h lattice_reaches: budget is a one-item list."""
    if not dims:
        return r == 0
    below_lo = sum(lo * s for lo, _, s in dims[:-1])
    below_hi = sum(hi * s for _, hi, s in dims[:-1])
    lo, hi, stride = dims[-1]
    for i in range(max(lo, -((below_hi - r) // stride)), min(hi, (r - below_lo) // stride) + 1):
        budget[0] -= 1
        if budget[0] < 0 or _lattice_reaches(dims[:-1], r - i * stride, budget):
            return True
    return False


def _elements_disjoint(a, b):
    """Mirrors checks.h elements_disjoint: apart in memory, or same-stride views of one buffer
    whose elements interleave without meeting (a paged KV buffer's key and value halves)."""
    if not _intersects(byte_range(a), byte_range(b)):
        return True
    if a.element_size() != b.element_size() or a.dim() != b.dim() or a.dim() > 8:
        return False
    delta_bytes = b.data_ptr() - a.data_ptr()
    if delta_bytes % a.element_size():
        return False
    dims = []
    for n, m, sa, sb in zip(a.shape, b.shape, a.stride(), b.stride()):
        if n > 1 and m > 1 and sa != sb:
            return False
        stride = sa if n > 1 else sb
        if (n > 1 or m > 1) and stride:
            dims.append((1 - m, n - 1, stride))
    dims.sort(key=lambda d: d[2])
    return not _lattice_reaches(dims, delta_bytes // a.element_size(), [256])


def check_elements_disjoint(a, a_name, b, b_name, op):
    """Two tensors the op writes."""
    if not _elements_disjoint(a, b):
        _fail(f"{op}: {b_name} and {a_name}: {PARTIAL_OVERLAP}")


def check_rows_disjoint(a, b, nlead, op, a_name, b_name):
    if a.numel() and b.numel() and not _rows_disjoint(a, b, nlead):
        _fail(f"{op}: {a_name} and {b_name}: {PARTIAL_OVERLAP}")


def check_disjoint_bytes(written, written_name, t, name, op):
    if _intersects(byte_range(written), byte_range(t)):
        _fail(f"{op}: {name} and {written_name}: {PARTIAL_OVERLAP}")


def positions_read_once(positions, written):
    """positions, or a copy of them when they share memory with a tensor the op writes."""
    pr = byte_range(positions)
    if any(w is not None and _intersects(byte_range(w), pr) for w in written):
        return positions.clone()
    return positions


# ---- the ops ----

def check_apply(x, cos, sin, op="rope.apply", x_name="x"):
    _check_float(x, op, x_name)
    _check_float(cos, op, "cos")
    _check_float(sin, op, "sin")
    if x.dim() < 1:
        _fail(f"{op}: {x_name} must have at least 1 dim (..., head_dim)")
    _check_same_device(x, x_name, cos, op, "cos")
    _check_same_device(x, x_name, sin, op, "sin")
    if cos.dtype != sin.dtype:
        _fail(f"{op}: cos and sin must have the same dtype, got cos {dtype_name(cos.dtype)} and "
              f"sin {dtype_name(sin.dtype)}")
    if differ(cos.shape, sin.shape):
        _fail(f"{op}: cos and sin must have the same shape, got cos {_shape(cos)} and sin {_shape(sin)}")
    if cos.dim() < 1:
        _fail(f"{op}: cos must have at least 1 dim (..., rotary_dim/2)")
    if cos.dim() > x.dim():
        _fail(f"{op}: cos and sin of shape {_shape(cos)} must broadcast to {x_name}.shape[:-1] + "
              f"(rotary_dim/2,) for {x_name} of shape {_shape(x)}")
    if cos.dim() != x.dim() and cos.dim() != 1:
        _fail(
            f"{op}: cos and sin of shape {_shape(cos)} have {cos.dim()} dims but {x_name} of shape "
            f"{_shape(x)} has {x.dim()}: give them {x_name}'s number of dims, with size 1 where they "
            "broadcast (e.g. cos[None, :, None, :] for a (seq, rotary_dim/2) table and "
            f"{x_name} in (batch, seq, heads, head_dim) layout); dims are never aligned implicitly"
        )
    half, head_dim = cos.shape[-1], x.shape[-1]
    if half > head_dim // 2:
        _fail(f"{op}: rotary_dim = 2 * cos.size(-1) = {2 * half} must be <= head_dim = "
              f"{x_name}.size(-1) = {head_dim}")
    if cos.dim() > 1 and any(differ(c, 1) and differ(c, n) for c, n in zip(cos.shape[:-1], x.shape[:-1])):
        _fail(f"{op}: cos and sin of shape {_shape(cos)} must broadcast to {x_name}.shape[:-1] + "
              f"(rotary_dim/2,) for {x_name} of shape {_shape(x)}")


def check_apply_out(x, cos, sin, out, memory=True):
    op = "rope.apply.out"
    check_apply(x, cos, sin, op=op)
    _check_same_device(x, "x", out, op, "out")
    if out.dtype != x.dtype:
        _fail(f"{op}: out must have the dtype of x ({dtype_name(x.dtype)}), got {dtype_name(out.dtype)}")
    if differ(out.shape, x.shape):
        _fail(f"{op}: out must have the shape of x {_shape(x)}, got {_shape(out)}")
    if not out.is_contiguous():
        _fail(f"{op}: out must be contiguous")
    if memory:
        o = byte_range(out)
        for name, t in (("x", x), ("cos", cos), ("sin", sin)):
            if _intersects(o, byte_range(t)):
                _fail(f"{op}: out must not overlap {name} in memory (use rope.apply_ to rotate in place)")


def check_cos_sin_cache(cache, ref, ref_name, head_dim, op):
    """A (max_position, rotary_dim) cos_sin_cache on ref's device, rotary_dim even and <= head_dim;
    returns rotary_dim / 2."""
    _check_same_device(ref, ref_name, cache, op, "cos_sin_cache")
    _check_float(cache, op, "cos_sin_cache")
    if cache.dim() != 2:
        _fail(f"{op}: cos_sin_cache must have shape (max_position, rotary_dim), got {_shape(cache)}")
    rotary_dim = cache.shape[1]
    if rotary_dim % 2 or rotary_dim > head_dim:
        _fail(f"{op}: rotary_dim = cos_sin_cache.size(1) = {rotary_dim} must be even and <= "
              f"head_dim = {head_dim}")
    return rotary_dim // 2


def check_positions_op(query, key, positions, pos_lead_dim0, cache=None, cos=None, sin=None,
                       in_place=True, op="rope.apply_", q_name="query", memory=True,
                       mrope_interleaved=False):
    """Mirrors checks.h check_positions_op; returns rotary_dim / 2."""
    if mrope_interleaved and pos_lead_dim0 == 0:
        _fail(f"{op}: mrope_interleaved=True needs mrope_section (the pairs of each of the 3 "
              "position components)")
    _check_float(query, op, q_name)
    if query.dim() < 2:
        _fail(f"{op}: {q_name} must have shape (..., num_heads, head_dim), got {_shape(query)}")
    nlead = query.dim() - 2
    if key is not None:
        _check_same_device(query, q_name, key, op, "key")
        if key.dtype != query.dtype:
            _fail(f"{op}: key must have the dtype of {q_name} ({dtype_name(query.dtype)}), got "
                  f"{dtype_name(key.dtype)}")
        if (key.dim() != query.dim() or differ(key.shape[:nlead], query.shape[:nlead])
                or key.shape[-1] != query.shape[-1]):
            _fail(f"{op}: key must have shape (..., num_kv_heads, head_dim) with the leading dims "
                  f"and head_dim of {q_name} {_shape(query)}, got {_shape(key)}")
    _check_same_device(query, q_name, positions, op, "positions")
    _check_positions_dtype(positions, op)
    ok = (positions.dim() == nlead + pos_lead_dim0
          and not differ(positions.shape[pos_lead_dim0:], query.shape[:nlead]))
    if pos_lead_dim0 == 0:
        if not ok:
            _fail(f"{op}: positions must have shape {q_name}.shape[:-2] ({q_name} is {_shape(query)}), "
                  f"got {_shape(positions)}")
    elif not (ok and positions.shape[0] == MROPE_COMPONENTS):
        _fail(f"{op}: positions must have shape (3,) + {q_name}.shape[:-2] (temporal, height, width; "
              f"{q_name} is {_shape(query)}), got {_shape(positions)}")
    head_dim = query.shape[-1]
    if cache is not None:
        half = check_cos_sin_cache(cache, query, q_name, head_dim, op)
    else:
        _check_same_device(query, q_name, cos, op, "cos")
        _check_same_device(query, q_name, sin, op, "sin")
        _check_float(cos, op, "cos")
        _check_float(sin, op, "sin")
        if cos.dtype != sin.dtype:
            _fail(f"{op}: cos and sin must have the same dtype, got cos {dtype_name(cos.dtype)} and "
                  f"sin {dtype_name(sin.dtype)}")
        if cos.dim() != 2 or sin.dim() != 2 or differ(cos.shape, sin.shape):
            _fail(f"{op}: cos and sin must be tables of one shape (max_position, rotary_dim/2), got "
                  f"cos {_shape(cos)} and sin {_shape(sin)}")
        if cos.shape[1] > head_dim // 2:
            _fail(f"{op}: rotary_dim = 2 * cos.size(1) = {2 * cos.shape[1]} must be <= head_dim = {head_dim}")
        half = cos.shape[1]
    if in_place:
        check_no_internal_overlap(query, op, q_name)
        if key is not None:
            check_no_internal_overlap(key, op, "key")
            if memory:
                check_rows_disjoint(query, key, nlead, op, q_name, "key")
        if memory:
            for name, t in (("cos_sin_cache", cache), ("cos", cos), ("sin", sin)):
                if t is not None:
                    check_disjoint_bytes(query, q_name, t, name, op)
                    if key is not None:
                        check_disjoint_bytes(key, "key", t, name, op)
    return half


def check_mrope_sections(section, half, op, half_name):
    section = list(section)
    if len(section) != MROPE_COMPONENTS:
        _fail(f"{op}: mrope_section must have 3 entries (temporal, height, width), got {section}")
    if any(s < 0 for s in section):
        _fail(f"{op}: mrope_section entries must be >= 0, got {section}")
    fits = all(s <= half for s in section)
    if not fits or sum(section) != half:
        got = sum(section) if fits else f"more than {half}"
        _fail(f"{op}: mrope_section {section} must sum to rotary_dim/2 = {half_name} = {half}, got {got}")
    return section


def check_rope_dim_offset(offset, head_dim, half, op):
    """Mirrors checks.h set_rope_dim_offset: the rotary dims [offset, offset + rotary_dim) lie in
    the head."""
    rotary_dim = 2 * half
    if not 0 <= offset <= head_dim - rotary_dim:
        _fail(f"{op}: rope_dim_offset = {offset} must lie in [0, head_dim - rotary_dim] = "
              f"[0, {head_dim - rotary_dim}] (head_dim = {head_dim}, rotary_dim = {rotary_dim})")


def check_apply_inplace(query, key, positions, cache, memory=True, rope_dim_offset=0):
    op = "rope.apply_"
    half = check_positions_op(query, key, positions, 0, cache=cache, op=op, memory=memory)
    check_rope_dim_offset(rope_dim_offset, query.shape[-1], half, op)
    return half


def check_mrope(query, key, positions, cache, mrope_section, memory=True, rope_dim_offset=0):
    op = "rope.mrope_"
    half = check_positions_op(query, key, positions, 1, cache=cache, op=op, memory=memory)
    section = check_mrope_sections(mrope_section, half, op, "cos_sin_cache.size(1)/2")
    check_rope_dim_offset(rope_dim_offset, query.shape[-1], half, op)
    return section


def check_apply_positions(x, positions, cos, sin, mrope_section=None, cache=None,
                          mrope_interleaved=False):
    """rope.apply_positions with tables cos and sin, or (its .cache overload) one cos_sin_cache."""
    op = "rope.apply_positions" if cache is None else "rope.apply_positions.cache"
    half = check_positions_op(x, None, positions, 0 if mrope_section is None else 1, cache=cache,
                              cos=cos, sin=sin, in_place=False, op=op, q_name="x",
                              mrope_interleaved=mrope_interleaved)
    if mrope_section is not None:
        check_mrope_sections(mrope_section, half, op,
                             "cos.size(1)" if cache is None else "cos_sin_cache.size(1)/2")
    return half


KV_CACHE_DTYPES = {"auto": None, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
                   "fp8_e5m2": torch.float8_e5m2}


def check_apply_and_cache(query, key, value, positions, cache, key_cache, value_cache,
                          slot_mapping, kv_cache_dtype="auto", k_scale=None, v_scale=None,
                          memory=True):
    """Mirrors checks.h check_apply_and_cache; returns the caches' format (None for "auto")."""
    return check_rope_and_cache(query, key, value, positions, cache, key_cache, value_cache,
                                slot_mapping, kv_cache_dtype, k_scale, v_scale, memory)[0]


def check_rope_and_cache(query, key, value, positions, cache, key_cache, value_cache,
                         slot_mapping, kv_cache_dtype="auto", k_scale=None, v_scale=None,
                         memory=True, op="rope.apply_and_cache_", mrope_section=None,
                         mrope_interleaved=False, value_written=False, in_place=True):
    """Mirrors checks.h check_rope_and_cache (every op that ends in the paged caches); returns
    (the caches' format or None for "auto", the mrope section or None). in_place False: query,
    key and value only read (fresh outputs written)."""
    if query.dim() != 3 or key.dim() != 3:
        _fail(f"{op}: query and key must have shape (num_tokens, num_heads, head_dim), got query "
              f"{_shape(query)} and key {_shape(key)}")
    half = check_positions_op(query, key, positions, 0 if mrope_section is None else 1,
                              cache=cache, in_place=in_place, op=op, memory=memory,
                              mrope_interleaved=mrope_interleaved)
    section = None
    if mrope_section is not None:
        section = check_mrope_sections(mrope_section, half, op, "cos_sin_cache.size(1)/2")
    tokens, kv_heads, head_dim = key.shape
    _check_same_device(query, "query", value, op, "value")
    if value.dtype != key.dtype:
        _fail(f"{op}: value must have the dtype of key ({dtype_name(key.dtype)}), got {dtype_name(value.dtype)}")
    if value.dim() != 3 or differ(value.shape[0], tokens) or value.shape[1] != kv_heads:
        _fail(f"{op}: value must have shape (num_tokens, num_kv_heads, value_dim) = ({tokens}, "
              f"{kv_heads}, value_dim), got {_shape(value)}")
    value_dim = value.shape[2]
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        _fail(f"{op}: kv_cache_dtype must be 'auto', 'fp8', 'fp8_e4m3' or 'fp8_e5m2', got '{kv_cache_dtype}'")
    fmt = KV_CACHE_DTYPES[kv_cache_dtype]
    want = key.dtype if fmt is None else fmt
    for name, c in (("key_cache", key_cache), ("value_cache", value_cache)):
        _check_same_device(query, "query", c, op, name)
        if c.dtype != want:
            _fail(f"{op}: {name} must be {dtype_name(want)} for kv_cache_dtype '{kv_cache_dtype}' and "
                  f"key {dtype_name(key.dtype)}, got {dtype_name(c.dtype)}")
    kc, vc = key_cache, value_cache
    if kc.dim() != 4 or kc.shape[2] != kv_heads or kc.shape[3] != head_dim:
        _fail(f"{op}: key_cache must have shape (num_blocks, block_size, num_kv_heads, head_dim) with "
              f"num_kv_heads = {kv_heads} and head_dim = {head_dim}, got {_shape(kc)}")
    if vc.dim() != 4 or vc.shape[:2] != kc.shape[:2] or vc.shape[2] != kv_heads or vc.shape[3] != value_dim:
        _fail(f"{op}: value_cache must have shape (num_blocks, block_size, num_kv_heads, value_dim) = "
              f"({kc.shape[0]}, {kc.shape[1]}, {kv_heads}, {value_dim}), got {_shape(vc)}")
    if kc.shape[1] < 1:
        _fail(f"{op}: key_cache must have block_size >= 1, got {_shape(kc)}")
    _check_same_device(query, "query", slot_mapping, op, "slot_mapping")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        _fail(f"{op}: slot_mapping must be int32 or int64, got {dtype_name(slot_mapping.dtype)}")
    if slot_mapping.dim() != 1 or differ(slot_mapping.shape[0], tokens):
        _fail(f"{op}: slot_mapping must have shape (num_tokens,) = ({tokens},), got {_shape(slot_mapping)}")
    # Checked whenever given (vLLM passes them for every cache dtype), required for fp8 only.
    scales = (("k_scale", k_scale), ("v_scale", v_scale))
    for name, s in scales:
        if s is None and fmt is None:
            continue
        if s is None:
            _fail(f"{op}: {name} is required for kv_cache_dtype '{kv_cache_dtype}' (a float32 tensor "
                  "of one element)")
        _check_same_device(query, "query", s, op, name)
        if s.dtype != torch.float32 or s.numel() != 1:
            _fail(f"{op}: {name} must be a float32 tensor of one element, got {dtype_name(s.dtype)} "
                  f"of shape {_shape(s)}")
    check_no_internal_overlap(kc, op, "key_cache")
    check_no_internal_overlap(vc, op, "value_cache")
    if value_written:  # before its rows are compared with query's and key's
        check_no_internal_overlap(value, op, "value")
    if memory:
        check_elements_disjoint(kc, "key_cache", vc, "value_cache", op)
        caches = (("key_cache", kc), ("value_cache", vc))
        for wname, w in (("query", query), ("key", key)):
            for cname, c in caches:
                check_disjoint_bytes(c, cname, w, wname, op)
        if in_place:
            # value may be a view of the same fused qkv buffer as query and key: disjoint rows
            # suffice.
            check_rows_disjoint(query, value, 1, op, "query", "value")
            check_rows_disjoint(key, value, 1, op, "key", "value")
        check_disjoint_bytes(kc, "key_cache", value, "value", op)
        check_disjoint_bytes(vc, "value_cache", value, "value", op)
        for cname, c in caches:
            check_disjoint_bytes(c, cname, cache, "cos_sin_cache", op)
        if value_written:
            check_disjoint_bytes(value, "value", cache, "cos_sin_cache", op)
        # The scales are read while query, key and the caches (and value, if written) are
        # written.
        written = (("query", query), ("key", key)) if in_place else ()
        written += caches
        written += (("value", value),) if value_written else ()
        for name, s in scales:
            if s is not None:
                for wname, w in written:
                    check_disjoint_bytes(w, wname, s, name, op)
    if decided(kc.shape[0] * kc.shape[1] >= 2**63, False):  # the kernels index slots in int64
        _fail(f"{op}: key_cache has 2^63 slots or more")
    return fmt, section


def _footprint(t):
    """t without its broadcast dims (stride 0: one element repeated), and the flat-index step
    of each remaining dim in t itself: every element of t's memory once, in row-major order,
    so a check of it ends on any shape."""
    keep = [d for d in range(t.dim()) if t.stride(d) != 0 or t.shape[d] <= 1]
    index = tuple(slice(None) if d in keep else 0 for d in range(t.dim()))
    steps, step = [0] * t.dim(), 1
    for d in reversed(range(t.dim())):
        steps[d] = step
        step *= t.shape[d]
    return t[index], [steps[d] for d in keep]


_INT_RANGES = {dt: (torch.iinfo(dt).min, torch.iinfo(dt).max)
               for dt in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)}


def below(t, bound):
    """t < bound for an integer tensor t and an int bound, which torch would cast to t's dtype
    first: an int32 tensor compared with 2^31 wraps it, and every element fails."""
    low, high = _INT_RANGES.get(t.dtype) or (torch.iinfo(t.dtype).min, torch.iinfo(t.dtype).max)
    if bound > high or bound <= low:
        return torch.full_like(t, bound > high, dtype=torch.bool)
    return t < bound


def check_positions_in_range(positions, max_position, op, rows_name="cos_sin_cache.size(0)"):
    """Data check (reads the positions; a device sync on accelerators). Reports the first bad
    position in flat order, as the native kernels do."""
    if positions.numel() == 0:
        return
    view, steps = _footprint(positions)
    bad = (view < 0) | ~below(view, max_position)
    if bool(bad.any()):
        idx = bad.nonzero()[0].tolist()
        flat = sum(i * s for i, s in zip(idx, steps))
        got = int(view[tuple(idx)])
        _fail(f"{op}: positions must lie in [0, {max_position}) (max_position = {rows_name}), got "
              f"{got} at flat index {flat}")


def check_slots_in_range(slot_mapping, slots, op="rope.apply_and_cache_"):
    if slot_mapping.numel() == 0:
        return
    bad = ~below(slot_mapping, slots)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        _fail(f"{op}: slot_mapping must lie below num_blocks * block_size = {slots} (negative: "
              f"padding, skipped), got {int(slot_mapping[i])} at index {i}")
    # A slot used by two tokens would leave its row to whichever writes last: refused, naming the
    # first token (in order) whose slot an earlier token has, as checks.h check_slots does.
    s, order = torch.sort(slot_mapping.long(), stable=True)
    repeat = (s[1:] == s[:-1]) & (s[1:] >= 0)
    if bool(repeat.any()):
        j = int(order[1:][repeat].min())
        i = int((slot_mapping == slot_mapping[j]).nonzero()[0, 0])
        _fail(f"{op}: slot_mapping must not repeat a slot (negative: padding, skipped), got "
              f"{int(slot_mapping[j])} at indices {i} and {j}")
