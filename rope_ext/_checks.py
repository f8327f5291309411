"""Argument checks for the Python paths (the reference and the fake kernels).

They mirror csrc/ops/rope_checks.cpp: the same conditions and messages, so an error reads the
same whichever path served the call. Shape checks only; see `check_positions_in_range`.
"""

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


# The C++ ScalarType names, so messages read the same on every path.
_DTYPE_NAMES = {
    torch.float16: "Half", torch.bfloat16: "BFloat16", torch.float32: "Float", torch.float64: "Double",
    torch.int8: "Char", torch.uint8: "Byte", torch.int16: "Short", torch.int32: "Int",
    torch.int64: "Long", torch.bool: "Bool", torch.complex64: "ComplexFloat",
    torch.complex128: "ComplexDouble",
}


def _dt(t):
    return _DTYPE_NAMES.get(t.dtype, str(t.dtype).replace("torch.", ""))


def _shape(t):
    return list(t.shape)


def _fail(msg):
    raise RuntimeError(msg)


def _check_float(t, op, name):
    if t.dtype not in FLOAT_DTYPES:
        _fail(f"{op}: {name} must be float16, bfloat16, float32 or float64, got {_dt(t)}")


def _check_same_device(ref, ref_name, t, op, name):
    if t.device != ref.device:
        _fail(f"{op}: {name} must be on the same device as {ref_name} ({ref.device}), got {t.device}")


def check_apply(x, cos, sin, op="rope.apply", x_name="x"):
    _check_float(x, op, x_name)
    _check_float(cos, op, "cos")
    _check_float(sin, op, "sin")
    if x.dim() < 1:
        _fail(f"{op}: {x_name} must have at least 1 dim (..., head_dim)")
    _check_same_device(x, x_name, cos, op, "cos")
    _check_same_device(x, x_name, sin, op, "sin")
    if cos.dtype != sin.dtype:
        _fail(f"{op}: cos and sin must have the same dtype, got cos {_dt(cos)} and sin {_dt(sin)}")
    if cos.shape != sin.shape:
        _fail(f"{op}: cos and sin must have the same shape, got cos {_shape(cos)} and sin {_shape(sin)}")
    if cos.dim() < 1:
        _fail(f"{op}: cos must have at least 1 dim (..., rotary_dim/2)")
    half = cos.shape[-1]
    if 2 * half > x.shape[-1]:
        _fail(
            f"{op}: rotary_dim = 2 * cos.size(-1) = {2 * half} must be <= head_dim = "
            f"{x_name}.size(-1) = {x.shape[-1]}"
        )
    ok = cos.dim() - 1 <= x.dim() - 1 and all(
        cos.shape[-1 - j] == 1 or cos.shape[-1 - j] == x.shape[-1 - j] for j in range(1, cos.dim())
    )
    if not ok:
        _fail(
            f"{op}: cos and sin of shape {_shape(cos)} must broadcast to {x_name}.shape[:-1] + "
            f"(rotary_dim/2,) for {x_name} of shape {_shape(x)}"
        )


def _byte_range(t):
    """(begin, end) of the bytes t's elements span; None for an empty tensor."""
    if t.numel() == 0:
        return None
    last = sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
    begin = t.data_ptr()
    return begin, begin + (last + 1) * t.element_size()


def check_apply_out(x, cos, sin, out, check_overlap=True):
    """rope.apply.out. check_overlap=False where tensors have no memory (fake/meta tensors)."""
    op = "rope.apply.out"
    check_apply(x, cos, sin, op=op)
    _check_same_device(x, "x", out, op, "out")
    if out.dtype != x.dtype:
        _fail(f"{op}: out must have the dtype of x ({_dt(x)}), got {_dt(out)}")
    if out.shape != x.shape:
        _fail(f"{op}: out must have the shape of x {_shape(x)}, got {_shape(out)}")
    if not out.is_contiguous():
        _fail(f"{op}: out must be contiguous")
    if not check_overlap:
        return
    a = _byte_range(out)
    for name, t in (("x", x), ("cos", cos), ("sin", sin)):
        b = _byte_range(t)
        if a is not None and b is not None and a[0] < b[1] and b[0] < a[1]:
            _fail(f"{op}: out must not overlap {name} in memory (use rope.apply_ to rotate in place)")


def check_apply_inplace(query, key, positions, cache, op="rope.apply_"):
    _check_float(query, op, "query")
    if query.dim() < 2:
        _fail(f"{op}: query must have shape (..., num_heads, head_dim), got {_shape(query)}")
    if key is not None:
        _check_same_device(query, "query", key, op, "key")
        if key.dtype != query.dtype:
            _fail(f"{op}: key must have the dtype of query ({_dt(query)}), got {_dt(key)}")
        if key.dim() != query.dim() or key.shape[:-2] != query.shape[:-2] or key.shape[-1] != query.shape[-1]:
            _fail(
                f"{op}: key must have shape (..., num_kv_heads, head_dim) with the leading dims "
                f"and head_dim of query {_shape(query)}, got {_shape(key)}"
            )
    _check_same_device(query, "query", positions, op, "positions")
    _check_same_device(query, "query", cache, op, "cos_sin_cache")
    if positions.dtype not in (torch.int32, torch.int64):
        _fail(f"{op}: positions must be int32 or int64, got {_dt(positions)}")
    if positions.shape != query.shape[:-2]:
        _fail(
            f"{op}: positions must have shape query.shape[:-2] (query is {_shape(query)}), "
            f"got {_shape(positions)}"
        )
    _check_float(cache, op, "cos_sin_cache")
    if cache.dim() != 2:
        _fail(f"{op}: cos_sin_cache must have shape (max_position, rotary_dim), got {_shape(cache)}")
    rotary_dim = cache.shape[1]
    if rotary_dim % 2 != 0 or rotary_dim > query.shape[-1]:
        _fail(
            f"{op}: rotary_dim = cos_sin_cache.size(1) = {rotary_dim} must be even and <= "
            f"head_dim = {query.shape[-1]}"
        )


def check_mrope(query, key, positions, cache, mrope_section):
    """rope.mrope_: mirrors csrc/ops/mrope_checks.cpp."""
    op = "rope.mrope_"
    if query.dim() < 2:
        _fail(f"{op}: query must have shape (..., num_heads, head_dim), got {_shape(query)}")
    if positions.dim() != query.dim() - 1 or positions.shape[0] != 3 or positions.shape[1:] != query.shape[:-2]:
        _fail(
            f"{op}: positions must have shape (3,) + query.shape[:-2] (temporal, height, width; "
            f"query is {_shape(query)}), got {_shape(positions)}"
        )
    check_apply_inplace(query, key, positions[0], cache, op=op)
    sections = list(mrope_section)
    if len(sections) != 3:
        _fail(f"{op}: mrope_section must have 3 entries (temporal, height, width), got {sections}")
    if any(s < 0 for s in sections):
        _fail(f"{op}: mrope_section entries must be >= 0, got {sections}")
    half = cache.shape[1] // 2
    if sum(sections) != half:
        _fail(
            f"{op}: mrope_section {sections} must sum to rotary_dim/2 = cos_sin_cache.size(1)/2 = "
            f"{half}, got {sum(sections)}"
        )


def check_positions_in_range(positions, max_position, op="rope.apply_"):
    """Data check (reads the positions; a device sync on accelerators)."""
    if positions.numel() == 0:
        return
    bad = (positions < 0) | (positions >= max_position)
    if bool(bad.any()):
        flat = int(bad.flatten().nonzero()[0, 0])
        got = int(positions.flatten()[flat])
        _fail(
            f"{op}: positions must lie in [0, {max_position}) (max_position = "
            f"cos_sin_cache.size(0)), got {got} at flat index {flat}"
        )
