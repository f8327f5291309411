"""The CUDA kernels' code, proven on the CPU: tests/sim/cuda_sim.cpp runs the CUDA ops' host
code and per-thread kernel code over every thread of the launch grid the host code plans, with
every memory access checked (in bounds of its operand, aligned, each output element written once
by one thread). Here its results are compared with the float64 reference and, bit for bit, with
the CPU kernels (same math in the same precision, no FMA contraction on the CPU build), on odd
shapes: head_dim 64..256, partial rotary with tails that are not a multiple of the vector width,
strided views, broadcasting, GQA, int32/int64 positions, every dtype.

No GPU needed: this runs in `make test`. It needs a C++ compiler (the simulator is built once,
cached under build/cuda_sim/).
"""

import pytest
import torch

import cuda_sim
import rope_ext
from cuda_testing import (DTYPES, assert_close, fused_qkv, reference_apply, reference_apply_,
                          tables, vec_width)

HEAD_DIMS = [64, 80, 96, 128, 256]
# Not a multiple of any vector width: output rows and pass-through dims start misaligned.
ODD_HEAD_DIMS = [66, 100]
LAYOUTS = [False, True]


def rotary_dims(head_dim):
    # full; about a quarter (GPT-NeoX); 26: 13 pairs, a tail for every vector width (2, 4, 8).
    return sorted({head_dim, 2 * (head_dim // 8), 26})


def native_cpu():
    return rope_ext.backend("cpu") == "native"


def check_against_cpu_and_reference(out, x, cos, sin, interleaved, inverse=False):
    assert out.shape == x.shape and out.dtype == x.dtype and out.is_contiguous()
    assert_close(out, reference_apply(x, cos, sin, interleaved, inverse), x.dtype)
    if native_cpu():
        op = torch.ops.rope.apply_backward if inverse else torch.ops.rope.apply
        torch.testing.assert_close(out, op(x, cos, sin, interleaved), rtol=0, atol=0)
    rot = 2 * cos.shape[-1]
    assert torch.equal(out[..., rot:], x[..., rot:])  # pass-through dims bit-exact


def expect_vec(dtype, head_dim, half, interleaved):
    w = vec_width(dtype)
    return head_dim % w == 0 and (2 * half) % w == 0 and (interleaved or half % w == 0)


@pytest.fixture(scope="module", autouse=True)
def simulator():
    cuda_sim.load()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", HEAD_DIMS + ODD_HEAD_DIMS)
@pytest.mark.parametrize("interleaved", LAYOUTS, ids=["half_split", "interleaved"])
def test_apply_every_head_dim_and_rotary_dim(dtype, head_dim, interleaved):
    B, S, H = 2, 5, 3
    w = vec_width(dtype)
    for rot in rotary_dims(head_dim):
        x = torch.randn(B, S, H, head_dim, dtype=dtype)
        cos, sin = tables(torch.arange(S).view(1, S, 1), rot)  # [1, S, 1, rot/2], float32
        out, plan = cuda_sim.apply(x, cos, sin, interleaved)
        check_against_cpu_and_reference(out, x, cos, sin, interleaved)
        assert plan.vec == expect_vec(dtype, head_dim, rot // 2, interleaved), (rot, plan)
        if plan.vec:  # float32 tables (float64 for float64 x): whole vectors where a chunk spans them
            table_w = 2 if dtype == torch.float64 else 4
            assert plan.tvec == ((w // 2 if interleaved else w) % table_w == 0), (rot, plan)
        # vector accesses: x's where its rows are vectors, else the tables' at most
        assert plan.vector_accesses > 0 if plan.vec else plan.tvec or plan.vector_accesses == 0


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("interleaved", LAYOUTS, ids=["half_split", "interleaved"])
def test_apply_backward(dtype, interleaved):
    for head_dim, rot in [(128, 128), (80, 26), (64, 32)]:
        g = torch.randn(3, 4, head_dim, dtype=dtype)
        cos, sin = tables(torch.arange(3).view(3, 1), rot)
        out, _ = cuda_sim.apply(g, cos, sin, interleaved, inverse=True)
        check_against_cpu_and_reference(out, g, cos, sin, interleaved, inverse=True)


def strided_cases(dtype):
    """(name, x, cos, sin, vectorized?) for layouts other than a contiguous x."""
    D, S = 128, 6
    cache = rope_ext.cos_sin_cache(S, D)  # [S, D]: cos | sin halves, non-contiguous slices
    cos_v, sin_v = cache[:, : D // 2].unsqueeze(1), cache[:, D // 2 :].unsqueeze(1)
    q, k = fused_qkv(S, 4, 2, D, dtype)
    yield "fused_qkv_query", q, cos_v, sin_v, True
    yield "fused_qkv_key", k, cos_v, sin_v, True
    bshd = torch.randn(2, S, 3, D, dtype=dtype)
    cos4, sin4 = tables(torch.arange(S).view(1, S, 1).expand(2, S, 1), D)  # [B, S, 1, r/2]
    yield "bshd_full_tables", bshd, cos4, sin4, True
    bhsd = bshd.transpose(1, 2)  # [B, H, S, D] view, tables [1, 1, S, r/2]
    c, s = tables(torch.arange(S).view(1, 1, S), D)
    yield "bhsd_transposed_view", bhsd, c, s, True
    yield "last_dim_stride_2", torch.randn(S, 3, 2 * D, dtype=dtype)[..., ::2], cos_v, sin_v, False
    flat = torch.randn(S * 3 * D + 1, dtype=dtype)
    yield "misaligned_storage_offset", flat[1:].view(S, 3, D), cos_v, sin_v, False
    # bf16 / float64 tables are cast to the arithmetic type on the host.
    yield "bf16_tables", bshd, cos4.bfloat16(), sin4.bfloat16(), True
    yield "f64_tables", bshd, cos4.double(), sin4.double(), True
    yield "zero_rotary_dim", bshd, cos4[..., :0], sin4[..., :0], True  # a pure copy
    yield "one_dim_x", torch.randn(D, dtype=dtype), cos_v[2, 0], sin_v[2, 0], True
    yield "head_dim_stride_padded", torch.randn(S, 3, D + 8, dtype=dtype)[..., :D], cos_v, sin_v, True
    yield "head_dim_stride_odd", torch.randn(S, 3, D + 3, dtype=dtype)[..., :D], cos_v, sin_v, False
    # aligned input rows (stride 104) but head_dim 98: output rows are misaligned
    x98 = torch.randn(S, 3, 104, dtype=dtype)[..., :98]
    c96, s96 = cos_v[..., :48], sin_v[..., :48]
    yield "out_rows_misaligned", x98, c96, s96, dtype == torch.float64


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("interleaved", LAYOUTS, ids=["half_split", "interleaved"])
def test_apply_strided_views_and_broadcasting(dtype, interleaved):
    for name, x, cos, sin, vec in strided_cases(dtype):
        out, plan = cuda_sim.apply(x, cos, sin, interleaved)
        check_against_cpu_and_reference(out, x, cos, sin, interleaved)
        if dtype == torch.float64 and name == "head_dim_stride_odd":
            vec = False  # stride 131 is odd whatever the width
        assert plan.vec == vec, name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_apply_grid_stride_and_64bit_index_paths(dtype):
    # Fewer blocks than rows: blocks stride over rows. force_idx64: the 64-bit index math that
    # tensors with more than 2^32 rows take, on a small tensor.
    x = torch.randn(7, 5, 3, 96, dtype=dtype)[:, 1:]
    cos, sin = tables(torch.arange(5)[1:].view(1, 4, 1), 96)
    expected, full = cuda_sim.apply(x, cos, sin, False)
    for max_blocks in (1, 2):
        out, plan = cuda_sim.apply(x, cos, sin, False, max_blocks=max_blocks, force_idx64=True)
        assert plan.grid == max_blocks < full.grid and not plan.idx32
        torch.testing.assert_close(out, expected, rtol=0, atol=0)


def inplace_case(dtype, head_dim, rot, hq, hk, pos_dtype, lead, cache_dtype=torch.float32):
    T = 5
    q, k = fused_qkv(T, hq, hk, head_dim, dtype, lead=lead)
    if hk == 0:
        k = None
    max_pos = 40
    positions = torch.randint(0, max_pos, (*lead, T), dtype=pos_dtype)
    cache = rope_ext.cos_sin_cache(max_pos, rot, dtype=cache_dtype)
    return q, k, positions, cache


def check_inplace(q, k, positions, cache, interleaved):
    q0, k0 = q.clone(), None if k is None else k.clone()
    want_q, want_k = reference_apply_(q0, k0, positions, cache, interleaved)
    plan = cuda_sim.apply_(q, k, positions, cache, interleaved)
    rot = cache.shape[1]
    for got, before, want in ((q, q0, want_q), (k, k0, want_k)):
        if got is None:
            continue
        assert_close(got, want, got.dtype)
        assert torch.equal(got[..., rot:], before[..., rot:])
    if native_cpu():
        cq, ck = q0.clone(), None if k0 is None else k0.clone()
        torch.ops.rope.apply_(cq, ck, positions, cache, interleaved)
        torch.testing.assert_close(q, cq, rtol=0, atol=0)
        if k is not None:
            torch.testing.assert_close(k, ck, rtol=0, atol=0)
    return plan


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", HEAD_DIMS + ODD_HEAD_DIMS)
@pytest.mark.parametrize("interleaved", LAYOUTS, ids=["half_split", "interleaved"])
def test_apply_inplace_gqa_every_head_dim(dtype, head_dim, interleaved):
    for rot in rotary_dims(head_dim):
        for hq, hk, pos_dtype, lead in [(4, 2, torch.int64, ()), (3, 1, torch.int32, (2,)), (2, 0, torch.int64, ())]:
            q, k, positions, cache = inplace_case(dtype, head_dim, rot, hq, hk, pos_dtype, lead)
            plan = check_inplace(q, k, positions, cache, interleaved)
            w = vec_width(dtype)
            # rows start at multiples of head_dim (fused qkv): aligned iff head_dim % w == 0
            assert plan.vec == (head_dim % w == 0 and (interleaved or (rot // 2) % w == 0)), (rot, plan)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_apply_inplace_strided_and_table_dtypes(dtype):
    D = 96
    # positions as a strided view, separate (contiguous) q and k, a transposed cache view,
    # float64, bfloat16 and float16 caches (read as they are when of x's dtype, else cast on the
    # host), grid striding.
    q = torch.randn(6, 4, D, dtype=dtype)
    k = torch.randn(6, 2, 2 * D, dtype=dtype)[..., ::2]  # unit stride lost: scalar path
    positions = torch.randint(0, 30, (12,), dtype=torch.int32)[::2]
    cache_t = rope_ext.cos_sin_cache(30, D).t().contiguous().t()  # column-major cache
    plan = check_inplace(q, k, positions, cache_t, False)
    assert not plan.vec
    for cache_dtype in (torch.float64, torch.bfloat16, torch.float16):
        q, k, positions, cache = inplace_case(dtype, D, D, 4, 2, torch.int64, (), cache_dtype)
        check_inplace(q, k, positions, cache, True)
    q, k, positions, cache = inplace_case(dtype, D, 64, 4, 2, torch.int64, (3,))
    positions = positions.t().contiguous().t()  # column-major: two lead dims that do not merge
    expected_q, expected_k = q.clone(), k.clone()
    cuda_sim.apply_(expected_q, expected_k, positions, cache)
    plan = cuda_sim.apply_(q, k, positions, cache, max_blocks=2, force_idx64=True)
    assert plan.grid == 2 and not plan.idx32
    assert torch.equal(q, expected_q) and torch.equal(k, expected_k)


@pytest.mark.parametrize("bad", [-1, 40])
def test_out_of_range_position_traps_on_the_device(bad):
    # The kernel checks each position before reading its table row (a device-side assert on a
    # GPU): the simulator reports the trap, and proves no access outside the cache was made.
    q, k, positions, cache = inplace_case(torch.float32, 64, 64, 4, 2, torch.int64, (2,))
    positions[1, 2] = bad
    with pytest.raises(RuntimeError, match=r"device-side assert triggered: rope: positions must "
                                           r"lie in \[0, max_position\)"):
        cuda_sim.apply_(q, k, positions, cache)
    with pytest.raises(RuntimeError, match="device-side assert triggered"):
        cuda_sim.apply_positions(q, positions, cache[:, :32], cache[:, 32:])


def test_launch_plan_shapes():
    # The prefill shape of the benchmark: bf16, 32 q + 8 kv heads, head_dim 128.
    q, k = fused_qkv(16, 32, 8, 128, torch.bfloat16)
    plan = cuda_sim.apply_(q, k, torch.arange(16), rope_ext.cos_sin_cache(16, 128))
    # 8 chunks x 16 threads over the 40 heads (a thread takes 2 or 3 of them), 2 tokens a block;
    # the float32 table rows in whole vectors
    assert plan.vec and plan.tvec and plan.rot_chunks == 8
    assert plan.block == (8, 16, 2) and plan.grid == 8
    out, plan = cuda_sim.apply(q, *tables(torch.arange(16).view(16, 1), 128), False)
    assert plan.vec and plan.tvec and plan.block == (8, 16, 2) and plan.grid == 8
    # Rows of one chunk and one head: blocks of 64 tokens, CUDA's limit on blockDim.z (a plan of
    # 256 failed its launch on a GPU with "invalid argument").
    x = torch.randn(300, 1, 4)
    cos, sin = tables(torch.arange(300).view(300, 1), 4)
    out, plan = cuda_sim.apply(x, cos, sin, False)
    assert plan.block == (1, 1, 64) and plan.grid == 5
    torch.testing.assert_close(out, torch.ops.rope.apply(x, cos, sin, False), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("interleaved", LAYOUTS, ids=["half_split", "interleaved"])
def test_apply_out_into_aligned_and_misaligned_buffers(dtype, interleaved):
    # rope.apply.out: the caller's out may start anywhere; a misaligned one must take the
    # scalar path and still write every element once, bit for bit as apply.
    x = torch.randn(6, 4, 128, dtype=dtype)
    cos, sin = tables(torch.arange(6).view(6, 1), 96)
    expected, full = cuda_sim.apply(x, cos, sin, interleaved)
    aligned = torch.full_like(x, float("nan"))
    plan = cuda_sim.apply_out(x, cos, sin, aligned, interleaved)
    assert plan.vec == full.vec
    torch.testing.assert_close(aligned, expected, rtol=0, atol=0)
    buf = torch.full((x.numel() + 1,), float("nan"), dtype=dtype)
    shifted = buf[1:].view(x.shape)  # one element past a vector boundary
    plan = cuda_sim.apply_out(x, cos, sin, shifted, interleaved)
    assert not plan.vec
    torch.testing.assert_close(shifted, expected, rtol=0, atol=0)
    assert buf[0].isnan()  # nothing written before out
    with pytest.raises(RuntimeError, match="rope.apply.out: out must not overlap x in memory"):
        cuda_sim.apply_out(x, cos, sin, x, interleaved)


def check_positions_op(x, positions, cos, sin, interleaved, inverse=False, section=None, mi=False):
    """rope.apply_positions on cos and sin, or (sin None) its .cache overload on cos_sin_cache cos."""
    out, plan = cuda_sim.apply_positions(x, positions, cos, sin, interleaved, inverse, section, mi)
    tables = rope_ext.reference.cache_halves(cos) if sin is None else (cos, sin)
    want = rope_ext.reference.apply_positions(x.double(), positions, *(t.double() for t in tables),
                                              interleaved=interleaved, inverse=inverse,
                                              mrope_section=section, mrope_interleaved=mi)
    assert_close(out, want, x.dtype)
    if native_cpu():
        op = torch.ops.rope.apply_positions
        args = (cos,) if sin is None else (cos, sin)
        cpu = (op.cache if sin is None else op.default)(x, positions, *args, interleaved, inverse,
                                                        section, mi)
        torch.testing.assert_close(out, cpu, rtol=0, atol=0)
    return plan


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("interleaved", LAYOUTS, ids=["half_split", "interleaved"])
def test_positions_op_and_mrope(dtype, interleaved):
    for head_dim in (64, 100, 128):
        for rot in rotary_dims(head_dim):
            half = rot // 2
            cache = rope_ext.cos_sin_cache(40, rot)
            cos, sin = cache[:, :half], cache[:, half:]
            x = torch.randn(2, 5, 3, head_dim, dtype=dtype)
            pos = torch.randint(0, 40, (2, 5), dtype=torch.int32)
            for inverse in (False, True):
                check_positions_op(x, pos, cos, sin, interleaved, inverse)
                check_positions_op(x, pos, cache, None, interleaved, inverse)
            sec = [half - 2 * (half // 3), half // 3, half // 3]
            mpos = torch.randint(0, 40, (3, 2, 5))
            for mi in (False, True):
                check_positions_op(x, mpos, cos, sin, interleaved, False, sec, mi)
                check_positions_op(x, mpos, cache, None, interleaved, False, sec, mi)
                q, k = fused_qkv(5, 4, 2, head_dim, dtype, lead=(2,))
                q0, k0 = q.double(), k.double()
                cuda_sim.mrope_(q, k, mpos, cache, sec, interleaved, mi)
                rope_ext.reference.apply_mrope_(q0, k0, mpos, cache.double(), sec,
                                                interleaved=interleaved, mrope_interleaved=mi)
                assert_close(q, q0, dtype)
                assert_close(k, k0, dtype)


FP8 = {"auto": None, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kv_cache_dtype", list(FP8))
@pytest.mark.parametrize("interleaved", LAYOUTS, ids=["half_split", "interleaved"])
def test_apply_and_cache(dtype, kv_cache_dtype, interleaved):
    for head_dim, rot, dv, block in ((128, 128, 128, 16), (96, 64, 80, 1), (66, 26, 40, 4)):
        T, hq, hk = 9, 4, 2
        qkv = torch.randn(T, hq + 2 * hk, head_dim, dtype=dtype)  # strided views of a fused buffer
        q, k = qkv[:, :hq], qkv[:, hq : hq + hk]
        v = torch.randn(T, hk, dv, dtype=dtype)
        if head_dim == 96:  # value strided along its head dim: element by element
            v = torch.randn(T, hk, 2 * dv, dtype=dtype)[..., ::2]
        cdt = FP8[kv_cache_dtype] or dtype
        blocks = (T + 3 + block - 1) // block  # room for every token, and unused slots
        kc = torch.randn(blocks, block, hk, head_dim).to(cdt)
        vc = torch.randn(blocks, block, hk, dv).to(cdt)
        slots = torch.randperm(blocks * block)[:T]
        slots[::3] = -1  # padding tokens
        pos = torch.randint(0, 40, (T,))
        cache = rope_ext.cos_sin_cache(40, rot)
        scales = (torch.tensor([0.7]), torch.tensor([1.9])) if FP8[kv_cache_dtype] else (None, None)
        ref = [t.clone() for t in (q, k, v, pos, cache, kc, vc, slots)]
        cuda_sim.apply_and_cache_(q, k, v, pos, cache, kc, vc, slots, interleaved, kv_cache_dtype,
                                  *scales)
        rope_ext.reference.apply_and_cache_(*ref, interleaved=interleaved,
                                            kv_cache_dtype=kv_cache_dtype, k_scale=scales[0],
                                            v_scale=scales[1])
        assert torch.equal(q, ref[0]) and torch.equal(k, ref[1])
        assert torch.equal(kc.view(torch.uint8), ref[5].view(torch.uint8))
        assert torch.equal(vc.view(torch.uint8), ref[6].view(torch.uint8))
        bad = slots.clone()
        bad[4] = blocks * block
        with pytest.raises(RuntimeError, match="device-side assert triggered: rope: slot_mapping"):
            cuda_sim.apply_and_cache_(q, k, v, pos, cache, kc, vc, bad, interleaved,
                                      kv_cache_dtype, *scales)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("interleaved", LAYOUTS, ids=["half_split", "interleaved"])
def test_tables_of_x_dtype_are_read_as_they_are(dtype, interleaved):
    # Tables in the model's dtype take the kernels that convert on load (no cast of the whole
    # table): same bits as the CPU kernels, which convert each element too.
    x = torch.randn(7, 4, 96, dtype=dtype)
    pos = torch.randint(0, 50, (7,))
    cache = rope_ext.cos_sin_cache(50, 64, dtype=dtype)
    cos, sin = cache[:, :32], cache[:, 32:]
    out, _ = cuda_sim.apply(x, cos[pos][:, None], sin[pos][:, None], interleaved)
    check_against_cpu_and_reference(out, x, cos[pos][:, None], sin[pos][:, None], interleaved)
    out, _ = cuda_sim.apply_positions(x, pos, cos, sin, interleaved)
    assert_close(out, reference_apply(x, cos[pos][:, None], sin[pos][:, None], interleaved), dtype)
    if native_cpu():
        cpu = torch.ops.rope.apply_positions(x, pos, cos, sin, interleaved, False, None, False)
        assert torch.equal(out, cpu)
    q, k = fused_qkv(7, 4, 2, 96, dtype)
    q0, k0 = q.clone(), k.clone()
    cuda_sim.apply_(q, k, pos, cache, interleaved)
    rope_ext.reference.apply_rope_(q0, k0, pos, cache, interleaved=interleaved)
    assert_close(q, q0, dtype)
    assert_close(k, k0, dtype)
    v = torch.randn(7, 2, 40, dtype=dtype)
    kc, vc = torch.zeros(4, 4, 2, 96, dtype=dtype), torch.zeros(4, 4, 2, 40, dtype=dtype)
    slots = torch.tensor([3, -1, 0, 9, 15, 2, 7])
    ref = [t.clone() for t in (q, k, v, pos, cache, kc, vc, slots)]
    cuda_sim.apply_and_cache_(q, k, v, pos, cache, kc, vc, slots, interleaved)
    rope_ext.reference.apply_and_cache_(*ref, interleaved=interleaved)
    assert torch.equal(q, ref[0]) and torch.equal(k, ref[1])
    assert torch.equal(kc, ref[5]) and torch.equal(vc, ref[6])


def test_cache_write_with_empty_key_rows():
    # head_dim 0: no rotary or key chunks, but the value rows are still written; and rows of
    # 0 elements on both sides launch nothing.
    T, hk = 5, 2
    q, k = torch.randn(T, 3, 0), torch.randn(T, hk, 0)
    pos = torch.randint(0, 8, (T,))
    cache = torch.empty(8, 0)
    slots = torch.tensor([0, 7, -1, 11, 4])
    for dv in (24, 0):
        v = torch.randn(T, hk, dv)
        kc, vc = torch.randn(3, 4, hk, 0), torch.randn(3, 4, hk, dv)
        ref = [t.clone() for t in (q, k, v, pos, cache, kc, vc, slots)]
        cuda_sim.apply_and_cache_(q, k, v, pos, cache, kc, vc, slots)
        rope_ext.reference.apply_and_cache_(*ref)
        assert torch.equal(vc, ref[6])


@pytest.mark.parametrize("slots,match", [
    ([0, 1, 99, 2], "slot_mapping must lie below"),
    ([0, 1, 1, 2],  # the CPU op's message, not the slot-set kernel's device-side assert
     r"must not repeat a slot \(negative: padding, skipped\), got 1 at indices 1 and 2")])
@pytest.mark.parametrize("hk,d", [(0, 16), (1, 0)], ids=["no key heads", "rows of 0 elements"])
def test_cache_write_with_no_row_to_store_checks_slots_on_the_host(slots, match, hk, d):
    # Query heads but no key heads, or rows of 0 elements: no row reads a slot, so the host
    # checks the slots with the CPU op's messages (a repeat too, not the slot-set kernel's
    # device-side assert).
    q, k, v = torch.randn(4, 2, d), torch.randn(4, hk, d), torch.randn(4, hk, d)
    kc, vc = torch.zeros(2, 4, hk, d), torch.zeros(2, 4, hk, d)
    args = (torch.arange(4), torch.randn(8, d), kc, vc, torch.tensor(slots))
    before = q.clone()
    with pytest.raises(RuntimeError, match=match):
        cuda_sim.apply_and_cache_(q, k, v, *args)
    assert torch.equal(q, before)
    with pytest.raises(RuntimeError, match=match):
        torch.ops.rope.apply_and_cache_(q, k, v, *args)


def _no_rows_cases():
    """(name, simulated call, CPU call) with tokens but no rows (no heads, head_dim 0, rows of
    0 elements) and a bad position (7 of 4) or slot (9 of 4)."""
    import qk_norm_sim

    ops = torch.ops.rope
    bad, good = torch.tensor([0, 7, 1]), torch.tensor([0, 1, 2])
    cache, c0 = torch.randn(4, 8), torch.randn(4, 0)

    def cached(q, k, v, pos, tab, kv, slots):
        caches = (torch.zeros(2, 2, kv, k.shape[-1]), torch.zeros(2, 2, kv, v.shape[-1]))
        return ((lambda: cuda_sim.apply_and_cache_(q, k, v, pos, tab, *caches, slots)),
                (lambda: ops.apply_and_cache_(q, k, v, pos, tab, *caches, slots, False, "auto", None, None)))

    def normed_cache(fn_sim, fn_cpu, pos, slots):
        q, k, v = torch.randn(3, 0, 8), torch.randn(3, 0, 8), torch.randn(3, 0, 8)
        caches = (torch.zeros(2, 2, 0, 8), torch.zeros(2, 2, 0, 8))
        w = torch.ones(8)
        return ((lambda: fn_sim(q, k, v, pos, cache, w, w, *caches, slots)),
                (lambda: fn_cpu(q, k, v, pos, cache, w, w, *caches, slots, 1e-6)))

    q0 = torch.randn(3, 0, 8)
    return [
        ("apply_ no heads", lambda: cuda_sim.apply_(q0, None, bad, cache),
         lambda: ops.apply_(q0, None, bad, cache, False, 0, False)),
        ("apply_ head_dim 0", lambda: cuda_sim.apply_(torch.randn(3, 2, 0), None, bad, c0),
         lambda: ops.apply_(torch.randn(3, 2, 0), None, bad, c0, False, 0, False)),
        ("mrope_ no heads", lambda: cuda_sim.mrope_(q0, None, bad.expand(3, 3), cache, [2, 1, 1]),
         lambda: ops.mrope_(q0, None, bad.expand(3, 3), cache, [2, 1, 1], False, False, 0, False)),
        ("apply_positions no heads",
         lambda: cuda_sim.apply_positions(q0, bad, cache[:, :4], cache[:, 4:]),
         lambda: ops.apply_positions(q0, bad, cache[:, :4], cache[:, 4:], False, False, None, False)),
        ("apply_and_cache_ no heads, position", *cached(q0, q0, torch.randn(3, 0, 4), bad, cache, 0, good)),
        ("apply_and_cache_ no heads, slot", *cached(q0, q0, torch.randn(3, 0, 4), good, cache, 0,
                                                     torch.tensor([0, 9, 1]))),
        ("apply_and_cache_ rows of 0 elements", *cached(torch.randn(3, 2, 0), torch.randn(3, 1, 0),
                                                         torch.randn(3, 1, 0), bad, c0, 1, good)),
        ("qk_norm_rope_ head_dim 0",
         lambda: qk_norm_sim.qk_norm_rope_(torch.randn(3, 2, 0), torch.randn(3, 1, 0), torch.ones(0),
                                           torch.ones(0), bad, c0, 1e-6),
         lambda: ops.qk_norm_rope_(torch.randn(3, 2, 0), torch.randn(3, 1, 0), torch.ones(0),
                                   torch.ones(0), bad, c0, 1e-6)),
        ("qk_norm_rope_and_cache_ no heads",
         *normed_cache(qk_norm_sim.qk_norm_rope_and_cache_, ops.qk_norm_rope_and_cache_, bad, good)),
        ("qk_norm_rope_and_cache no heads, slot",
         *normed_cache(qk_norm_sim.qk_norm_rope_and_cache, ops.qk_norm_rope_and_cache, good,
                       torch.tensor([0, 9, 1]))),
    ]


def test_calls_with_nothing_to_rotate_still_check_their_data():
    """A call with tokens but no rows launches no kernel on CUDA: its positions and slots are
    checked on the host instead, with the CPU op's messages (they used to go unchecked)."""
    cuda_sim.load()
    for name, on_sim, on_cpu in _no_rows_cases():
        with pytest.raises(RuntimeError) as cpu:
            on_cpu()
        with pytest.raises(RuntimeError) as sim:
            on_sim()
        assert str(sim.value).splitlines()[0] == str(cpu.value).splitlines()[0], name
