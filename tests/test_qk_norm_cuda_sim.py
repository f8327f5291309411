"""The fused QK-RMSNorm + RoPE CUDA kernels, run by the CPU simulator (tests/sim/qk_norm_sim.inc)
over every thread of the grid their host code plans, every access checked: results against the
float64 oracle, the vector and scalar paths, grid striding, in-place layouts (packed qkv,
strided heads), MRoPE, and a device-side trap for a position out of range."""

import pytest
import torch

import qk_norm_sim as sim
from test_qk_norm import check_packed, close, gathered, oracle, packed_case
from tolerances import DTYPES

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotary_dim", [64, 32, 6])
@pytest.mark.parametrize("table_dtype", [torch.float32, torch.bfloat16])
def test_packed_in_place(dtype, interleaved, rotary_dim, table_dtype):
    T, Hq, Hk, Hv, D = 5, 3, 2, 1, 64
    qkv, before, wq, wk, cache, pos = packed_case(T, Hq, Hk, Hv, D, dtype, 30, rotary_dim,
                                                  torch.float32, table_dtype)
    info = sim.qkv_norm_rope_(qkv, Hq, Hk, Hv, D, wq, wk, pos, cache, 1e-6, True, interleaved,
                              max_blocks=1)  # one block: the grid strides
    # vector path exactly where every rotary chunk and the tail are whole vectors
    W = 16 // qkv.element_size()
    assert bool(info[0]) == (rotary_dim % (W if interleaved else 2 * W) == 0 and D % W == 0)
    check_packed(qkv, before, Hq, Hk, wq, wk, *gathered(cache, pos), True, interleaved, dtype)


@pytest.mark.parametrize("section,mrope_interleaved", [(None, False), ([2, 3, 3], False),
                                                        ([3, 3, 2], True)])
def test_separate_in_place_strided_and_mrope(section, mrope_interleaved):
    B, S, D = 2, 3, 32
    q = torch.randn(B, S, 2, D, dtype=torch.bfloat16)
    k = torch.randn(B, S, 4, D, dtype=torch.bfloat16)[:, :, ::2]
    q0, k0 = q.clone(), k.clone()
    wq, wk = torch.randn(D), torch.randn(D)[:, None].expand(D, 2)[:, 0]
    cache = torch.randn(20, 16)
    pos = torch.randint(0, 20, (B, S) if section is None else (3, B, S))
    sim.qk_norm_rope_(q, k, wq, wk, pos, cache, 1e-5, False, False, section, mrope_interleaved)
    c, s = gathered(cache, pos, section, mrope_interleaved)
    close(q, oracle(q0, wq, c, s, 1e-5, False, False), torch.bfloat16)
    close(k, oracle(k0, wk, c, s, 1e-5, False, False), torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES)
def test_out_of_place(dtype):
    q = torch.randn(2, 4, 3, 48, dtype=dtype)
    k = torch.randn(2, 4, 1, 96, dtype=dtype)[..., ::2]  # strided along head_dim: scalar path
    wq, wk = torch.randn(48), torch.randn(48, dtype=dtype)
    cos, sin = torch.randn(2, 4, 1, 12), torch.randn(2, 4, 1, 12)
    (oq, ok), info = sim.qk_norm_rope(q, k, wq, wk, cos, sin, 1e-6, False, True, max_blocks=2)
    close(oq, oracle(q, wq, cos, sin, 1e-6, False, True), dtype)
    close(ok, oracle(k, wk, cos, sin, 1e-6, False, True), dtype)
    assert info[2] > 0 and info[3] > 0  # q took the vector path, k the scalar one


def test_position_out_of_range_traps():
    q, k = torch.randn(3, 2, 16), torch.randn(3, 1, 16)
    with pytest.raises(RuntimeError, match="device-side assert triggered"):
        sim.qk_norm_rope_(q, k, torch.ones(16), torch.ones(16), torch.tensor([0, 9, 1]),
                          torch.randn(8, 16), 1e-6)


def test_host_checks_are_the_native_ones():
    qkv = torch.randn(3, 64)
    with pytest.raises(RuntimeError, match=r"rope.qkv_norm_rope_: qkv.size\(1\) = 64 must be"):
        sim.qkv_norm_rope_(qkv, 2, 2, 1, 16, torch.ones(16), torch.ones(16),
                           torch.zeros(3, dtype=torch.long), torch.randn(4, 16), 1e-6)
    with pytest.raises(RuntimeError, match="eps must be a finite number >= 0, got -1"):
        sim.qkv_norm_rope_(qkv, 2, 1, 1, 16, torch.ones(16), torch.ones(16),
                           torch.zeros(3, dtype=torch.long), torch.randn(4, 16), -1.0)


# ---- rope.qk_norm_rope_and_cache[_]: the kernel with the paged-cache store stage ----

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fmt", ["auto", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("v_norm", [False, True])
@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("in_place", [True, False])
def test_prologue_with_cache_store(dtype, fmt, v_norm, packed, in_place):
    """In place (rope.qk_norm_rope_and_cache_) and out of place (rope.qk_norm_rope_and_cache:
    the simulator also proves the inputs only read and every element of the new query, key and
    value written once)."""
    from test_qk_norm_cache import EPS, POSITIONAL, check_against_oracle, make_case
    a = make_case(T=6, hq=3, hk=2, D=64, dtype=dtype, fmt=fmt, packed=packed, block_size=2)
    before = {n: a[n].clone() for n in ("query", "key", "value")}
    kw = {n: v for n, v in a.items() if n not in POSITIONAL}
    args = [a[n] for n in POSITIONAL]
    if in_place:
        info = sim.qk_norm_rope_and_cache_(*args, eps=EPS, v_norm=v_norm, max_blocks=1,
                                           **kw)  # one block: the grid strides
    else:
        out, info = sim.qk_norm_rope_and_cache(*args, eps=EPS, v_norm=v_norm, max_blocks=1, **kw)
        for n, t in zip(("query", "key", "value"), out):
            assert torch.equal(a[n], before[n]), f"{n} written out of place"
            assert t.is_contiguous() and t.shape == a[n].shape
            a[n] = t
    assert info[0] == 1  # unit-stride 16-byte-aligned rows: the vector path
    check_against_oracle(a, before, dtype, v_norm=v_norm)


def test_prologue_scalar_path_mrope_and_partial_rotary():
    from test_qk_norm_cache import EPS, POSITIONAL, check_against_oracle, make_case
    a = make_case(T=5, hq=2, hk=1, D=40, Dv=24, rotary_dim=24, dtype=torch.float16,
                  fmt="fp8_e4m3", packed=False, mrope=True)
    a["query"] = torch.randn(5, 2, 80, dtype=torch.float16)[..., ::2]  # strided head dim
    a["value"] = torch.randn(5, 1, 48, dtype=torch.float16)[..., ::2]  # the value's too
    before = {n: a[n].clone() for n in ("query", "key", "value")}
    kw = {n: v for n, v in a.items() if n not in POSITIONAL}
    info = sim.qk_norm_rope_and_cache_(*[a[n] for n in POSITIONAL], eps=EPS, v_norm=True,
                                       mrope_section=[4, 4, 4], interleaved=True, **kw)
    assert info[0] == 0
    check_against_oracle(a, before, torch.float16, interleaved=True, section=[4, 4, 4],
                         v_norm=True)


@pytest.mark.parametrize("slots,match", [([0, 9, 1], "device-side assert triggered"),
                                         ([2, 1, 2], "device-side assert triggered")])
def test_prologue_bad_slots_trap(slots, match):
    q, k, v = torch.randn(3, 2, 16), torch.randn(3, 1, 16), torch.randn(3, 1, 16)
    kc, vc = torch.zeros(2, 4, 1, 16), torch.zeros(2, 4, 1, 16)
    slot = torch.tensor(slots)
    if slots[1] == 9:  # past the last slot: the host cannot see it here; the kernel traps
        kc, vc = torch.zeros(1, 4, 1, 16), torch.zeros(1, 4, 1, 16)
    with pytest.raises(RuntimeError, match=match):
        sim.qk_norm_rope_and_cache_(q, k, v, torch.tensor([0, 1, 2]), torch.randn(8, 16),
                                    torch.ones(16), torch.ones(16), kc, vc, slot)


@pytest.mark.parametrize("T", [1, 8])
@pytest.mark.parametrize("in_place", [True, False])
def test_prologue_with_empty_caches(T, in_place):
    """Caches of 0 blocks (every slot padding) have no data pointer: the kernel still gives the
    value heads their rows (it once took such a call for one without the store stage and
    walked past the last token)."""
    q, k, v = (torch.randn(T, h, 64, dtype=torch.bfloat16) for h in (4, 2, 2))
    kc, vc = (torch.empty(0, 16, 2, 64, dtype=torch.bfloat16) for _ in range(2))
    pos, cache, w = torch.randint(0, 32, (T,)), torch.randn(32, 64), torch.randn(64)
    args = (pos, cache, w, w, kc, vc, torch.full((T,), -1))
    want = [t.clone() for t in (q, k, v)]
    torch.ops.rope.qk_norm_rope_and_cache_(*want, *args, 1e-6, v_norm=True)
    if in_place:
        got = [t.clone() for t in (q, k, v)]
        sim.qk_norm_rope_and_cache_(*got, *args, eps=1e-6, v_norm=True)
    else:
        got, _ = sim.qk_norm_rope_and_cache(q, k, v, *args, eps=1e-6, v_norm=True)
    for g, w_ in zip(got, want):
        close(g, w_, torch.bfloat16)


def test_prologue_values_only():
    """head_dim 0: no query or key element, and still every value row normed and cached."""
    T, Dv = 4, 8
    q, k = torch.randn(T, 2, 0), torch.randn(T, 1, 0)
    kc, vc = torch.zeros(2, 4, 1, 0), torch.full((2, 4, 1, Dv), float("nan"))
    args = (torch.arange(T), torch.randn(8, 0), torch.ones(0), torch.ones(0), kc)
    slots = torch.tensor([5, 0, -1, 2])
    v = torch.randn(T, 1, Dv)
    want_v, want_vc = v.clone(), vc.clone()
    torch.ops.rope.qk_norm_rope_and_cache_(q, k, want_v, *args, want_vc, slots, 1e-6, v_norm=True)
    got_v, got_vc = v.clone(), vc.clone()
    sim.qk_norm_rope_and_cache_(q, k, got_v, *args, got_vc, slots, eps=1e-6, v_norm=True)
    close(got_v, want_v, torch.float32)
    assert torch.equal(got_vc.isnan(), want_vc.isnan()) and want_vc.isnan().sum() == Dv * 5
    close(got_vc.nan_to_num(), want_vc.nan_to_num(), torch.float32)


@pytest.mark.parametrize("in_place", [True, False])
@pytest.mark.parametrize("slots,match", [
    ([0, 1, 999, 2], "slot_mapping must lie below"),
    ([0, 1, 1, 2],  # the CPU op's message, not the slot-set kernel's device-side assert
     r"must not repeat a slot \(negative: padding, skipped\), got 1 at indices 1 and 2")])
@pytest.mark.parametrize("hk,d", [(0, 16), (1, 0)], ids=["no key heads", "rows of 0 elements"])
def test_prologue_with_no_row_to_store_checks_slots(in_place, slots, match, hk, d):
    """No key heads, or rows of 0 elements: no kernel row reads a slot, so the host checks them,
    as the CPU op does."""
    q, k, v = torch.randn(4, 2, d), torch.randn(4, hk, d), torch.randn(4, hk, d)
    kc, vc = torch.zeros(2, 4, hk, d), torch.zeros(2, 4, hk, d)
    args = (torch.arange(4), torch.randn(8, d), torch.ones(d), torch.ones(d), kc, vc,
            torch.tensor(slots))
    before = q.clone()
    run = sim.qk_norm_rope_and_cache_ if in_place else sim.qk_norm_rope_and_cache
    with pytest.raises(RuntimeError, match=match):
        run(q, k, v, *args, eps=1e-6)
    assert torch.equal(q, before)
    with pytest.raises(RuntimeError, match=match):
        torch.ops.rope.qk_norm_rope_and_cache_(q, k, v, *args, 1e-6)


# ---- rope.norm_rope: the DiT norm forms ----

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm", ["rms", "rms_across_heads", "layer"])
@pytest.mark.parametrize("interleaved", [False, True])
def test_norm_forms(dtype, norm, interleaved):
    from test_norm_rope import fused_projection, oracle, params

    q, k = fused_projection(2, 3, 3, 2, 64, dtype)  # strided views: the vector path
    k = torch.randn(2, 3, 2, 128, dtype=dtype)[..., ::2]  # strided along head_dim: scalar path
    wq, bq = params(norm, 3, 64, torch.float32, True, True)
    _, bk = params(norm, 2, 64, dtype, False, norm == "layer")
    cos, sin = torch.randn(1, 3, 1, 16), torch.randn(1, 3, 1, 16)  # partial rotary
    (oq, ok), info = sim.norm_rope(q, k, wq, None, bq, bk, cos, sin, 1e-5, norm, interleaved,
                                   max_blocks=1)  # one block: the grid strides
    close(oq, oracle(q, wq, bq, cos, sin, 1e-5, norm, interleaved), dtype)
    close(ok, oracle(k, None, bk, cos, sin, 1e-5, norm, interleaved), dtype)
    assert info[2] > 0 and info[3] > 0  # q took the vector path, k the scalar one


def test_norm_across_heads_with_merged_leading_dims():
    from test_norm_rope import oracle, params

    q, k = torch.randn(2, 3, 5, 16), torch.randn(2, 3, 2, 16)
    cos, sin = torch.randn(8), torch.randn(8)  # one row for every token: leading dims merge
    wq, _ = params("rms_across_heads", 5, 16, torch.float32)
    (oq, ok), _ = sim.norm_rope(q, k, wq, None, None, None, cos, sin, 1e-6, "rms_across_heads")
    close(oq, oracle(q, wq, None, cos, sin, 1e-6, "rms_across_heads", False), torch.float32)
    close(ok, oracle(k, None, None, cos, sin, 1e-6, "rms_across_heads", False), torch.float32)
