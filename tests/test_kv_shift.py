"""rope_ext.shift_kv_cache_ (K-shift) by its defining property: keys written into a paged cache at
positions p and shifted by delta equal the keys written at p + delta (float caches within
rounding; float8 caches within the quantization error a rotation spreads across each pair), for
plain, YaRN and Llama 3 tables; slots not listed stay bit-exact; the native kernel and the
reference agree; every bad input is an error that changes nothing, on every path."""

import math

import pytest
import torch

import rope_ext
from conftest import native_cpu
from rope_ext._kv_shift import reference as ref

MAXPOS = 96
TABLES = {
    "plain": None,
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
}
FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
BACKENDS = ["native", "reference"]


def table(kind, rotary_dim, dtype=torch.float32):
    return rope_ext.cos_sin_cache(MAXPOS, rotary_dim, scaling=TABLES[kind], dtype=dtype)


def shift(backend, *args, **kwargs):
    if backend == "native":
        if not native_cpu():
            pytest.skip("no native CPU library")
        return rope_ext.shift_kv_cache_(*args, **kwargs)
    args = list(args)
    if not isinstance(args[2], torch.Tensor):
        args[2] = torch.tensor(args[2])
    return ref.shift_kv_cache_(*args, **kwargs)


def rotated_keys(keys, positions, cos_sin_cache, interleaved):
    """keys (N, Hk, D) as written at `positions`: rotated in float64 by the table rows."""
    half = cos_sin_cache.shape[1] // 2
    rows = cos_sin_cache.double()[positions][:, None]
    c, s = rows[..., :half], rows[..., half:]
    k = keys.double().clone()
    idx_a = torch.arange(0, 2 * half, 2) if interleaved else torch.arange(half)
    idx_b = idx_a + 1 if interleaved else idx_a + half
    a, b = k[..., idx_a], k[..., idx_b]
    k[..., idx_a], k[..., idx_b] = a * c - b * s, b * c + a * s
    return k


def random_case(n, heads, head_dim, num_blocks=6, block_size=5):
    slots = torch.randperm(num_blocks * block_size)[:n]
    p = torch.randint(0, MAXPOS, (n,))
    delta = torch.randint(-MAXPOS + 1, MAXPOS, (n,))
    delta = torch.where((p + delta < 0) | (p + delta >= MAXPOS), -delta, delta)
    delta = torch.where((p + delta < 0) | (p + delta >= MAXPOS), 0, delta)
    return slots, p, delta, torch.randn(n, heads, head_dim, dtype=torch.float64)


def fill_cache(shape, dtype):
    c = torch.randn(shape) * 4
    return c.to(dtype)


def pair_norms(x, half, interleaved):
    """Per element, the length of the pair it belongs to (elements outside pairs: their own)."""
    x = x.double()
    out = x.abs().clone()
    ia = torch.arange(0, 2 * half, 2) if interleaved else torch.arange(half)
    ib = ia + 1 if interleaved else ia + half
    n = torch.sqrt(x[..., ia] ** 2 + x[..., ib] ** 2)
    out[..., ia], out[..., ib] = n, n
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", list(TABLES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("interleaved", [False, True])
def test_shift_equals_writing_at_the_new_positions(backend, kind, dtype, interleaved):
    heads, head_dim, rotary_dim = 3, 24, 16  # partial rotary: the tail must stay put
    cache_table = table(kind, rotary_dim, torch.float64 if dtype == torch.float64 else torch.float32)
    slots, p, delta, keys = random_case(9, heads, head_dim)
    key_cache = fill_cache((6, 5, heads, head_dim), dtype)
    flat = key_cache.view(-1, heads, head_dim)
    flat[slots] = rotated_keys(keys, p, cache_table, interleaved).to(dtype)
    before = key_cache.clone()
    assert shift(backend, key_cache, slots, delta, cache_table, interleaved=interleaved) is None
    want = rotated_keys(keys, p + delta, cache_table, interleaved)
    got = key_cache.view(-1, heads, head_dim)[slots].double()
    # Each stored value was rounded once when written and once when shifted; the table's rounding
    # adds a few float32 steps.
    eps = {torch.float64: 2.0**-47, torch.float32: 2.0**-20, torch.bfloat16: 2.0**-7,
           torch.float16: 2.0**-10}[dtype]
    subnormal_step = torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps
    bound = 2 * eps * pair_norms(want, rotary_dim // 2, interleaved) + 4 * subnormal_step
    assert ((got - want).abs() <= bound).all(), float(((got - want).abs() / bound).max())
    assert torch.equal(got[..., rotary_dim:], before.view(-1, heads, head_dim)[slots][..., rotary_dim:].double())
    untouched = torch.ones(30, dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(key_cache.view(-1, heads, head_dim)[untouched],
                       before.view(-1, heads, head_dim)[untouched])


def code_index(codes):
    """float8 codes as integers in the order of their values (+-0 both 0): neighbours differ by 1."""
    bits = codes.view(torch.uint8).long()
    magnitude = bits & 0x7F
    return torch.where(bits & 0x80 != 0, -magnitude, magnitude)


def fp8_step(x, fmt):
    """The spacing of the float8 format at magnitude |x| (its subnormal step below the normals)."""
    mant, min_exp = (3, -6) if fmt == torch.float8_e4m3fn else (2, -14)
    e = torch.floor(torch.log2(x.abs().clamp_min(2.0**min_exp)))
    return torch.pow(2.0, e - mant)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", list(TABLES))
@pytest.mark.parametrize("kv_cache_dtype", list(FP8))
@pytest.mark.parametrize("interleaved", [False, True])
def test_fp8_shift_within_quantization_error(backend, kind, kv_cache_dtype, interleaved):
    fmt = FP8[kv_cache_dtype]
    heads, head_dim, rotary_dim = 2, 32, 32
    cache_table = table(kind, rotary_dim)
    scale = torch.tensor([0.05])
    slots, p, delta, keys = random_case(12, heads, head_dim)
    key_cache = (torch.randn(6, 5, heads, head_dim) * 3).to(fmt)
    codes_at_p = (rotated_keys(keys, p, cache_table, interleaved) / 0.05).float().to(fmt)
    key_cache.view(-1, heads, head_dim)[slots] = codes_at_p
    before = key_cache.clone()
    shift(backend, key_cache, slots, delta, cache_table, interleaved=interleaved,
          kv_cache_dtype=kv_cache_dtype, k_scale=scale)
    # Compared as codes (values / k_scale): their differences and steps are exact in float64,
    # where scaled values would carry the rounding of the products into the comparison.
    k = float(scale)  # the float32 scale the kernels use
    got = key_cache.view(-1, heads, head_dim)[slots].double()
    half = rotary_dim // 2
    # Against the keys written at p + delta: a step or two at the pair's magnitude.
    want = (rotated_keys(keys, p + delta, cache_table, interleaved) / 0.05).float().to(fmt).double()
    norms = pair_norms(want, half, interleaved)
    assert ((got - want).abs() <= 2 * fp8_step(norms, fmt)).all()
    # Against dequantize-rotate-requantize done exactly: within one step.
    deq = codes_at_p.double() * k
    c, s = ref.unit_rows(cache_table.double(), delta, torch.float64)
    exact_rows = deq.clone()
    ia = torch.arange(0, 2 * half, 2) if interleaved else torch.arange(half)
    ib = ia + 1 if interleaved else ia + half
    a, b = deq[..., ia], deq[..., ib]
    exact_rows[..., ia], exact_rows[..., ib] = a * c[:, None] - b * s[:, None], b * c[:, None] + a * s[:, None]
    m = torch.finfo(fmt).max
    exact = (exact_rows / k).clamp(-m, m).to(fmt)
    got_codes = key_cache.view(-1, heads, head_dim)[slots]
    assert ((code_index(got_codes) - code_index(exact)).abs() <= 1).all()  # neighbouring codes
    untouched = torch.ones(30, dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(key_cache.view(torch.uint8).view(-1, heads, head_dim)[untouched],
                       before.view(torch.uint8).view(-1, heads, head_dim)[untouched])


def assert_same_result(a, b, dtype, k_scale=None):
    """Native and reference results agree to the last rounding (bit for bit:
    test_reference_bits_equal_native)."""
    if k_scale is None:
        # A unit in the last place of the pair's larger member: relative to the largest key.
        eps = torch.finfo(dtype).eps
        torch.testing.assert_close(a, b, rtol=2 * eps, atol=2 * eps * float(b.abs().max()))
        return
    ad, bd = a.double() * k_scale, b.double() * k_scale
    step = fp8_step(torch.maximum(ad, bd).abs() / k_scale, dtype) * k_scale
    assert ((ad - bd).abs() <= step).all()
    assert (a.view(torch.uint8) != b.view(torch.uint8)).float().mean() < 0.05


@pytest.mark.parametrize("dtype,kv_cache_dtype", [
    (torch.float32, "auto"), (torch.bfloat16, "auto"), (torch.float64, "auto"),
    (torch.float8_e4m3fn, "fp8")])
def test_reference_bits_equal_native(dtype, kv_cache_dtype):
    """The reference gives the kernels' bits: its table rows are normalized with a correctly
    rounded square root, as the kernels' are. 1024 rows of random lengths (torch's own CPU sqrt
    misrounds about one in 500 of them in float32, one in 70 in float64)."""
    if not native_cpu():
        pytest.skip("no native CPU library")
    cache = (torch.randn(64, 16, 2, 64) * 3).to(dtype)
    cos_sin = (torch.rand(1024, 64, dtype=torch.float64) * 2 + 0.1).to(
        torch.float64 if dtype == torch.float64 else torch.float32)
    slots = torch.randperm(64 * 16)
    delta = torch.randint(-1023, 1024, (slots.numel(),))
    scale = torch.tensor([0.3]) if kv_cache_dtype != "auto" else None
    a, b = cache.clone(), cache.clone()
    rope_ext.shift_kv_cache_(a, slots, delta, cos_sin, kv_cache_dtype=kv_cache_dtype, k_scale=scale)
    ref.shift_kv_cache_(b, slots, delta, cos_sin, kv_cache_dtype=kv_cache_dtype, k_scale=scale)
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert not torch.equal(a.view(torch.uint8), cache.view(torch.uint8))


def unit_table_with_edges(rows, rotary_dim, dtype):
    """A plain table (in 99% of its entries the norm rounds to 1) with edges: subnormal cos or
    sin beside an exact unit, rows just off unit length (their division changes bits), an exact
    (1, 0), a (0, 0)."""
    t = rope_ext.cos_sin_cache(rows, rotary_dim, dtype=dtype)
    half = rotary_dim // 2
    tiny = torch.finfo(dtype).tiny
    t[3, 5], t[3, half + 5] = tiny / 4, 1.0                   # subnormal cos
    t[4, half + 40], t[4, 40] = -tiny / 8, -1.0               # subnormal sin
    t[5] *= 1 + torch.finfo(dtype).eps                        # norms of 1 + eps
    t[8] *= 1 - torch.finfo(dtype).eps / 2                    # norms of the float below 1
    t[6, :half], t[6, half:] = 1.0, 0.0                       # exact
    t[7, 9], t[7, half + 9] = 0.0, 0.0                        # no length at all: 0 / 0
    return t


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("flush_denormal", [False, True])
def test_unit_table_bits_equal_reference(dtype, flush_denormal):
    """A model's own table, unit rows to float precision, with its edges: the reference's bits,
    also where denormals are flushed (which reads a subnormal table entry as zero)."""
    if not native_cpu():
        pytest.skip("no native CPU library")
    table_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    cos_sin = unit_table_with_edges(64, 128, table_dtype)
    cache = (torch.randn(16, 4, 2, 128) * 3).to(dtype)
    slots = torch.randperm(64)
    delta = torch.randint(-63, 64, (64,))
    delta[:12] = torch.tensor([3, -3, 4, -4, 5, -5, 6, -6, 7, -7, 8, -8])
    a, b = cache.clone(), cache.clone()
    if not torch.set_flush_denormal(flush_denormal):
        pytest.skip("this CPU cannot flush denormals")
    try:
        rope_ext.shift_kv_cache_(a, slots, delta, cos_sin)
        ref.shift_kv_cache_(b, slots, delta, cos_sin)
    finally:
        torch.set_flush_denormal(False)
    nan = a.isnan()
    assert torch.equal(nan, b.isnan()) and nan.any()  # the 0 / 0 row
    assert torch.equal(a[~nan].view(torch.uint8), b[~nan].view(torch.uint8))  # -0 too
    assert not torch.equal(a[~nan], cache[~nan])


@pytest.mark.parametrize("dtype,kv_cache_dtype", [
    (torch.float32, "auto"), (torch.bfloat16, "auto"), (torch.float16, "auto"),
    (torch.float64, "auto"), (torch.float8_e4m3fn, "fp8"), (torch.float8_e5m2, "fp8_e5m2")])
@pytest.mark.parametrize("table_dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("interleaved", [False, True])
def test_native_matches_reference(dtype, kv_cache_dtype, table_dtype, interleaved):
    if not native_cpu():
        pytest.skip("no native CPU library")
    big = (torch.randn(4, 6, 5, 40) * 2).to(dtype)
    cache_table = table("yarn", 20, table_dtype)[::2]  # strided rows
    slots = torch.tensor([3, -1, 7, 0, 17, -5, 12], dtype=torch.int32)
    delta = torch.tensor([1, 99, -4, 0, 47, 3, -47])
    k_scale = 0.25 if kv_cache_dtype != "auto" else None
    scale_t = None if k_scale is None else torch.tensor([k_scale])
    a, b = big.clone(), big.clone()
    # Strided: blocks, heads and head_dim views of a larger buffer.
    rope_ext.shift_kv_cache_(a[1:, :, 1:4], slots, delta, cache_table, interleaved=interleaved,
                             kv_cache_dtype=kv_cache_dtype, k_scale=scale_t)
    ref.shift_kv_cache_(b[1:, :, 1:4], slots, delta, cache_table, interleaved=interleaved,
                        kv_cache_dtype=kv_cache_dtype, k_scale=scale_t)
    assert_same_result(a, b, dtype, k_scale)
    keep = torch.ones_like(a, dtype=torch.bool)
    keep[1:, :, 1:4] = False
    assert torch.equal(a[keep].view(torch.uint8), big[keep].view(torch.uint8))  # outside the view
    assert not torch.equal(a.view(torch.uint8), big.view(torch.uint8))


def scale_bound(fmt, which):
    """The smallest or largest k_scale the shift accepts for the format: every code times it a
    normal float32 (the largest code's product finite in float32 arithmetic)."""
    max_code, min_exp = (448.0, -117) if fmt == torch.float8_e4m3fn else (57344.0, -110)
    if which == "smallest":
        return 2.0 ** min_exp
    s = torch.tensor(torch.finfo(torch.float32).max / max_code, dtype=torch.float32)
    up = torch.tensor(math.inf)
    while torch.isfinite(torch.nextafter(s, up) * max_code):
        s = torch.nextafter(s, up)
    while not torch.isfinite(s * max_code):
        s = torch.nextafter(s, -up)
    return float(s)


@pytest.mark.parametrize("kv_cache_dtype", list(FP8))
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("k_scale", [1.0, 0.37, 2.0**-6, "smallest", "largest"])
def test_fp8_every_code_pair_exactly(kv_cache_dtype, interleaved, k_scale):
    """Every pair of float8 codes (NaNs, infinities, subnormals, both signs) shifted by rotations
    that float arithmetic does exactly (0 and +-90 degrees): the native decoding, rotation and
    encoding give the reference's bits, code for code. A NaN's sign is not compared: arithmetic
    on NaNs leaves it unspecified (the kernels may fuse a multiply and subtract)."""
    if not native_cpu():
        pytest.skip("no native CPU library")
    fmt = FP8[kv_cache_dtype]
    half = 256
    codes = torch.arange(256, dtype=torch.uint8)
    first = codes[:, None].expand(256, half)  # slot i: code i paired with every code
    second = codes[None, :].expand(256, half)
    if interleaved:
        rows = torch.stack((first, second), dim=-1).reshape(256, 2 * half)
    else:
        rows = torch.cat((first, second), dim=-1)
    cache = rows.contiguous().view(fmt).view(256, 1, 1, 2 * half)
    one, zero = torch.ones(half), torch.zeros(half)
    cache_table = torch.stack((torch.cat((one, zero)), torch.cat((zero, one))))  # 0, 90 degrees
    slots = torch.randperm(256)
    delta = torch.randint(-1, 2, (256,))
    scale = torch.tensor([scale_bound(fmt, k_scale) if isinstance(k_scale, str) else k_scale])
    a, b = cache.clone(), cache.clone()
    rope_ext.shift_kv_cache_(a, slots, delta, cache_table, interleaved=interleaved,
                             kv_cache_dtype=kv_cache_dtype, k_scale=scale)
    ref.shift_kv_cache_(b, slots, delta, cache_table, interleaved=interleaved,
                        kv_cache_dtype=kv_cache_dtype, k_scale=scale)
    got, want = a.view(torch.uint8).flatten(), b.view(torch.uint8).flatten()
    nan = a.float().isnan().flatten()
    assert torch.equal(nan, b.float().isnan().flatten())
    assert torch.equal(got[~nan], want[~nan])
    assert not torch.equal(a.view(torch.uint8), cache.view(torch.uint8))


@pytest.mark.parametrize("backend", BACKENDS)
def test_round_trip_and_delta_forms(backend):
    cache_table = table("plain", 16, torch.float64)
    key_cache = torch.randn(4, 4, 2, 16, dtype=torch.float64)
    before = key_cache.clone()
    slots = torch.tensor([5, 2, 9])
    shift(backend, key_cache, slots, 7, cache_table)  # an int: every slot
    assert not torch.allclose(key_cache, before)
    shift(backend, key_cache, slots, torch.tensor(-3, dtype=torch.int32), cache_table)  # 0-dim
    shift(backend, key_cache, slots, torch.tensor([-4, -4, -4]), cache_table)  # per slot
    torch.testing.assert_close(key_cache, before, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("backend", BACKENDS)
def test_skipped_and_empty(backend):
    cache_table = table("plain", 8)
    key_cache = torch.randn(2, 3, 1, 8)
    before = key_cache.clone()
    # Negative slots are skipped, their deltas not even read.
    shift(backend, key_cache, torch.tensor([-1, -7]), torch.tensor([10**6, -10**6]), cache_table)
    shift(backend, key_cache, torch.empty(0, dtype=torch.long), 5, cache_table)
    assert torch.equal(key_cache, before)
    empty = torch.empty(0, 3, 1, 8)
    shift(backend, empty, torch.empty(0, dtype=torch.long), 1, cache_table)


def test_version_counter_and_inference():
    key_cache = torch.randn(2, 2, 1, 8)
    v = key_cache._version
    rope_ext.shift_kv_cache_(key_cache, torch.tensor([1]), 1, table("plain", 8))
    assert key_cache._version > v
    with torch.inference_mode():
        frozen = torch.randn(2, 2, 1, 8)
        rope_ext.shift_kv_cache_(frozen, torch.tensor([1]), 1, table("plain", 8))
    with pytest.raises(RuntimeError, match="Inplace update to inference tensor"):
        rope_ext.shift_kv_cache_(frozen, torch.tensor([1]), 1, table("plain", 8))


def test_not_differentiable():
    key_cache = torch.randn(2, 2, 1, 8, requires_grad=True)
    with pytest.raises(RuntimeError, match="rope.shift_kv_cache_: a serving op, not differentiable"):
        rope_ext.shift_kv_cache_(key_cache * 1, torch.tensor([1]), 1, table("plain", 8))
    with torch.no_grad():
        rope_ext.shift_kv_cache_(key_cache, torch.tensor([1]), 1, table("plain", 8))


def test_opcheck_and_compile():
    key_cache = torch.randn(3, 4, 2, 16)
    args = (key_cache, torch.tensor([0, 5, -1, 11]), torch.tensor([3, -2, 0, 1]),
            table("yarn", 8), True, "auto", None)
    torch.library.opcheck(torch.ops.rope.shift_kv_cache_.default, args)

    def f(kc, slots, delta, t):
        rope_ext.shift_kv_cache_(kc, slots, delta, t, interleaved=True)
        return kc

    want = f(key_cache.clone(), *args[1:4])
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(key_cache.clone(), *args[1:4])
    torch.testing.assert_close(got, want, rtol=0, atol=0)


# ---- bad inputs: a clear error naming the argument, nothing written, on every path ----

def _case(**over):
    a = dict(key_cache=torch.randn(3, 4, 2, 16), slot_mapping=torch.tensor([1, 6, -1]),
             delta=torch.tensor([2, -3, 1]), cos_sin_cache=table("plain", 8), interleaved=False,
             kv_cache_dtype="auto", k_scale=None)
    a.update(over)
    return a


fp8_cache = torch.randn(3, 4, 2, 16).to(torch.float8_e4m3fn)
BAD = {
    "slot out of range": (dict(slot_mapping=torch.tensor([1, 12, -1])),
                          "slot_mapping must lie below num_blocks \\* block_size = 12 \\(negative: "
                          "skipped\\), got 12 at index 1"),
    "duplicate slot": (dict(slot_mapping=torch.tensor([4, 6, 4])),
                       "slot_mapping must list each slot at most once \\(negative: skipped\\), got slot 4 at "
                       "indices 0 and 2"),
    "duplicates, several": (dict(slot_mapping=torch.tensor([9, 2, 9, -3, 2, 2]), delta=torch.tensor(1)),
                            "slot_mapping must list each slot at most once \\(negative: skipped\\), "
                            "got slot 9 at indices 0 and 2"),
    "delta too large": (dict(delta=torch.tensor([2, 96, 1])),
                        "delta must lie in \\(-max_position, max_position\\) = \\(-96, 96\\) "
                        "\\(table row \\|delta\\|; max_position = cos_sin_cache.size\\(0\\)\\), got "
                        "96 at index 1"),
    "delta int64 min": (dict(delta=torch.tensor(-2**63)),
                        "delta must lie in .*, got -9223372036854775808 at index 0"),
    "delta shape": (dict(delta=torch.tensor([1, 2])),
                    "delta must have shape \\(\\) or slot_mapping's \\(3,\\), got \\[2\\]"),
    "delta dtype": (dict(delta=torch.tensor([1.0, 2.0, 3.0])), "delta must be int32 or int64, got Float"),
    "slots dtype": (dict(slot_mapping=torch.tensor([1.0])), "slot_mapping must be int32 or int64"),
    "slots shape": (dict(slot_mapping=torch.tensor([[1]]), delta=torch.tensor(1)),
                    "slot_mapping must have shape \\(num_slots_shifted,\\), got \\[1, 1\\]"),
    "cache shape": (dict(key_cache=torch.randn(12, 2, 16)),
                    "key_cache must have shape \\(num_blocks, block_size, num_kv_heads, head_dim\\)"),
    "cache dtype": (dict(key_cache=torch.zeros(3, 4, 2, 16, dtype=torch.int32)),
                    "key_cache must be float16, bfloat16, float32 or float64 for kv_cache_dtype 'auto', got Int"),
    "rotary_dim": (dict(cos_sin_cache=torch.randn(96, 18)),
                   "rotary_dim = cos_sin_cache.size\\(1\\) = 18 must be even and <= head_dim = 16"),
    "kv_cache_dtype": (dict(kv_cache_dtype="int8"),
                       "kv_cache_dtype must be 'auto', 'fp8', 'fp8_e4m3' or 'fp8_e5m2', got 'int8'"),
    "fp8 dtype": (dict(kv_cache_dtype="fp8_e5m2", key_cache=fp8_cache, k_scale=torch.tensor([1.0])),
                  "key_cache must be Float8_e5m2 for kv_cache_dtype 'fp8_e5m2', got Float8_e4m3fn"),
    "no k_scale": (dict(kv_cache_dtype="fp8", key_cache=fp8_cache),
                   "k_scale is required for kv_cache_dtype 'fp8'"),
    "k_scale dtype": (dict(kv_cache_dtype="fp8", key_cache=fp8_cache, k_scale=torch.tensor([1.0, 2.0])),
                      "k_scale must be a float32 tensor of one element, got Float of shape \\[2\\]"),
    "k_scale of an auto cache": (dict(k_scale=torch.tensor([1.0, 2.0], dtype=torch.float64)),
                                 "k_scale must be a float32 tensor of one element, got Double of shape \\[2\\]"),
    "k_scale zero": (dict(kv_cache_dtype="fp8", key_cache=fp8_cache, k_scale=torch.tensor([0.0])),
                     "k_scale must be finite and > 0 .*, got 0$"),
    "k_scale nan": (dict(kv_cache_dtype="fp8", key_cache=fp8_cache, k_scale=torch.tensor([math.nan])),
                    "k_scale must be finite and > 0 .*, got nan$"),
    "k_scale -nan": (dict(kv_cache_dtype="fp8", key_cache=fp8_cache, k_scale=-torch.tensor([math.nan])),
                     "k_scale must be finite and > 0 .*, got nan$"),
    "k_scale inf": (dict(kv_cache_dtype="fp8", key_cache=fp8_cache, k_scale=torch.tensor([math.inf])),
                    "k_scale must be finite and > 0 .*, got inf$"),
    "k_scale huge": (dict(kv_cache_dtype="fp8", key_cache=fp8_cache, k_scale=torch.tensor([1e36])),
                     "k_scale must lie in \\[2\\^-117, 3.40282e\\+38 / 448\\] for a float8_e4m3fn "
                     "cache \\(every code times it a normal float32\\), got 1e\\+36$"),
    "k_scale tiny": (dict(kv_cache_dtype="fp8", key_cache=fp8_cache, k_scale=torch.tensor([2.0**-118])),
                     "k_scale must lie in \\[2\\^-117, .*, got 3.00927e-36$"),
    "k_scale e5m2": (dict(kv_cache_dtype="fp8_e5m2", key_cache=fp8_cache.to(torch.float8_e5m2),
                          k_scale=torch.tensor([6e33])),
                     "k_scale must lie in \\[2\\^-110, 3.40282e\\+38 / 57344\\] for a float8_e5m2 "
                     "cache .*, got 6e\\+33$"),
    "internal overlap": (dict(key_cache=torch.randn(3, 1, 2, 16).expand(3, 4, 2, 16)),
                         "key_cache: unsupported operation: more than one element"),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_changes_nothing(backend, name):
    over, msg = BAD[name]
    a = _case(**over)
    kc = a["key_cache"]
    before = kc.clone()
    if backend == "native" and not native_cpu():
        pytest.skip("no native CPU library")
    f = torch.ops.rope.shift_kv_cache_ if backend == "native" else ref.shift_kv_cache_
    with pytest.raises(RuntimeError, match=f"rope.shift_kv_cache_: {msg}"):
        if backend == "native":
            f(*a.values())
        else:
            k = dict(a)
            f(k.pop("key_cache"), k.pop("slot_mapping"), k.pop("delta"), k.pop("cos_sin_cache"), **k)
    assert torch.equal(kc.view(torch.uint8) if kc.dtype.itemsize == 1 else kc,
                       before.view(torch.uint8) if kc.dtype.itemsize == 1 else before)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("blocks", [4, 2048])  # the repeat found by a bitmap, or by sorting
def test_long_slot_lists_report_the_first_repeat(backend, blocks):
    """Lists longer than a decode batch: the first index that repeats an earlier slot (and that
    slot's first index) is reported, whatever the search, and nothing is written."""
    if backend == "native" and not native_cpu():
        pytest.skip("no native CPU library")
    kc = torch.randn(blocks, 16, 1, 8)
    slots = torch.randperm(blocks * 16)[:40]
    slots[3] = -1
    slots[33], slots[37], slots[39] = slots[20], slots[5], slots[20]
    before = kc.clone()
    f = torch.ops.rope.shift_kv_cache_ if backend == "native" else ref.shift_kv_cache_
    msg = (f"rope.shift_kv_cache_: slot_mapping must list each slot at most once \\(negative: "
           f"skipped\\), got slot {int(slots[20])} at indices 20 and 33")
    with pytest.raises(RuntimeError, match=msg):
        f(kc, slots, torch.tensor(1), table("plain", 8))
    assert torch.equal(kc, before)


def test_metadata_errors_on_meta_tensors():
    for name in ("delta shape", "cache shape", "rotary_dim", "no k_scale", "k_scale dtype"):
        over, msg = BAD[name]
        a = {k: (v.to("meta") if isinstance(v, torch.Tensor) else v) for k, v in _case(**over).items()}
        with pytest.raises(RuntimeError, match=msg):
            torch.ops.rope.shift_kv_cache_(*a.values())


def test_overlapping_table_is_refused():
    buf = torch.randn(3, 4, 2, 16)
    before = buf.clone()
    table_view = buf.view(-1, 8)[:20]
    with pytest.raises(RuntimeError, match="cos_sin_cache and key_cache: unsupported operation"):
        rope_ext.shift_kv_cache_(buf, torch.tensor([1]), 1, table_view)
    assert torch.equal(buf, before)


def test_device_mismatch():
    with pytest.raises(RuntimeError, match="slot_mapping must be on the same device as key_cache"):
        torch.ops.rope.shift_kv_cache_(torch.randn(2, 2, 1, 8), torch.tensor([1], device="meta"),
                                       torch.tensor(1), table("plain", 8))


@pytest.mark.parametrize("delta", [1.5, True, 2**63, None])
def test_python_delta_errors(delta):
    key_cache = torch.randn(2, 2, 1, 8)
    with pytest.raises(ValueError, match="delta must"):
        rope_ext.shift_kv_cache_(key_cache, torch.tensor([1]), delta, table("plain", 8))


def test_an_int_delta_is_the_same_shift_in_every_mode():
    # an int delta's tensor is kept per (value, device) (made per call, it was 4 of 10 us of a
    # decode-sized shift): the kept tensor serves inference mode, grad mode and no_grad alike,
    # whichever mode made it, and a compiled call makes its own
    kc = torch.randn(8, 4, 2, 16)
    cache = rope_ext.cos_sin_cache(64, 16)
    slots = torch.randperm(32)[:6]
    want = kc.clone()
    rope_ext.shift_kv_cache_(want, slots, torch.tensor(-3), cache)
    for mode in (torch.inference_mode, torch.enable_grad, torch.no_grad, torch.inference_mode):
        with mode():
            got = kc.clone()
            rope_ext.shift_kv_cache_(got, slots, -3, cache)
        assert torch.equal(got, want), mode
    got = kc.clone()
    torch.compile(lambda t: rope_ext.shift_kv_cache_(t, slots, -3, cache), fullgraph=True)(got)
    assert torch.equal(got, want)
