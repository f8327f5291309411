"""Reproducers of inputs that once gave a silent wrong result or a wrong error, each now held on
every path: the native op, the reference, and the CUDA host and thread code in the simulator."""

import pytest
import torch

import cuda_sim
import rope_ext
from conftest import assert_close

PARTIAL = "some elements of the input tensor and the written-to tensor refer to a single memory location"


# ---- rope.apply_and_cache_: scales, repeated slots ----

def _op_cache(*args, **kw):
    torch.ops.rope.apply_and_cache_(*args, kw.get("interleaved", False), kw.get("kv_cache_dtype", "auto"),
                                    kw.get("k_scale"), kw.get("v_scale"))


CACHE_OPS = {"op": _op_cache, "reference": rope_ext.reference.apply_and_cache_,
             "cuda_host": lambda *a, **kw: cuda_sim.apply_and_cache_(
                 *a, kw.get("interleaved", False), kw.get("kv_cache_dtype", "auto"), kw.get("k_scale"),
                 kw.get("v_scale"))}


def _cache_inputs(T=6, fp8=False):
    q, k, v = torch.randn(T, 2, 16), torch.randn(T, 1, 16), torch.randn(T, 1, 8)
    dt = torch.float8_e4m3fn if fp8 else torch.float32
    kc, vc = torch.zeros(4, 4, 1, 16, dtype=dt), torch.zeros(4, 4, 1, 8, dtype=dt)
    return q, k, v, torch.randint(0, 8, (T,)), rope_ext.cos_sin_cache(8, 16), kc, vc


def _unchanged(before, after):
    return all(torch.equal(a.view(torch.uint8) if a.dtype.itemsize == 1 else a,
                           b.view(torch.uint8) if b.dtype.itemsize == 1 else b)
               for a, b in zip(before, after))


@pytest.mark.parametrize("impl", list(CACHE_OPS))
@pytest.mark.parametrize("owner", ["query", "key"])
def test_fp8_scale_sharing_memory_with_a_written_tensor_is_refused(impl, owner):
    # The kernels read the scale before rotating, the reference after: no order is right.
    q, k, v, pos, cache, kc, vc = _cache_inputs(fp8=True)
    scale = (q if owner == "query" else k).view(-1)[3:4]
    scale.fill_(0.5)
    before = [t.clone() for t in (q, k, kc, vc)]
    for kw in ({"k_scale": scale, "v_scale": torch.ones(1)}, {"k_scale": torch.ones(1), "v_scale": scale}):
        name = "k_scale" if kw["k_scale"] is scale else "v_scale"
        with pytest.raises(RuntimeError, match=f"rope.apply_and_cache_: {name} and {owner}: .*{PARTIAL}"):
            CACHE_OPS[impl](q, k, v, pos, cache, kc, vc, torch.arange(6), kv_cache_dtype="fp8", **kw)
        assert _unchanged(before, (q, k, kc, vc))


@pytest.mark.parametrize("impl", list(CACHE_OPS))
def test_scale_inside_a_cache_is_refused(impl):
    q, k, v, pos, cache, kc, vc = _cache_inputs(fp8=False)
    with pytest.raises(RuntimeError, match=f"v_scale and value_cache: .*{PARTIAL}"):
        CACHE_OPS[impl](q, k, v, pos, cache, kc, vc, torch.arange(6), k_scale=torch.ones(1),
                        v_scale=vc.view(-1)[:1])


@pytest.mark.parametrize("impl", list(CACHE_OPS))
@pytest.mark.parametrize("bad,msg", [
    (torch.ones(2), "k_scale must be a float32 tensor of one element, got Float of shape \\[2\\]"),
    (torch.ones(1, dtype=torch.float16), "k_scale must be a float32 tensor of one element, got Half"),
])
def test_scales_are_checked_with_kv_cache_dtype_auto(impl, bad, msg):
    q, k, v, pos, cache, kc, vc = _cache_inputs()
    with pytest.raises(RuntimeError, match=f"rope.apply_and_cache_: {msg}"):
        CACHE_OPS[impl](q, k, v, pos, cache, kc, vc, torch.arange(6), k_scale=bad, v_scale=None)
    # One-element float32 scales are accepted (vLLM passes them for every cache dtype), unused.
    want = [t.clone() for t in (q, k, v, pos, cache, kc, vc)]
    rope_ext.reference.apply_and_cache_(*want, torch.arange(6))
    CACHE_OPS[impl](q, k, v, pos, cache, kc, vc, torch.arange(6), k_scale=torch.full((1,), 3.0),
                    v_scale=torch.full((1,), 3.0))
    assert torch.equal(kc, want[5]) and torch.equal(vc, want[6])


@pytest.mark.parametrize("impl", list(CACHE_OPS))
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_a_slot_used_by_two_tokens_is_refused_before_any_write(impl, dtype):
    # A dummy padding slot >= 0 shared by several tokens: the threads would race on its row.
    q, k, v, pos, cache, kc, vc = _cache_inputs()
    slots = torch.tensor([5, -1, 2, 9, 2, 5], dtype=dtype)  # 5 at 0 and 5, 2 at 2 and 4
    before = [t.clone() for t in (q, k, kc, vc)]
    msg = "device-side assert triggered: rope: slot_mapping must not repeat a slot" if impl == "cuda_host" \
        else r"rope.apply_and_cache_: slot_mapping must not repeat a slot \(negative: padding, skipped\), " \
             "got 2 at indices 2 and 4"
    with pytest.raises(RuntimeError, match=msg):
        CACHE_OPS[impl](q, k, v, pos, cache, kc, vc, slots)
    assert _unchanged(before, (q, k, kc, vc))
    # Padding (-1) repeated is fine, as is a permutation of distinct slots.
    slots = torch.tensor([-1, 3, -1, 15, 0, -1], dtype=dtype)
    want = [t.clone() for t in (q, k, v, pos, cache, kc, vc, slots)]
    rope_ext.reference.apply_and_cache_(*want)
    CACHE_OPS[impl](q, k, v, pos, cache, kc, vc, slots)
    assert_close(kc, want[5], torch.float32)
    assert_close(vc, want[6], torch.float32)


def test_every_repeated_slot_is_found_among_many_tokens():
    # Many tokens through the simulated device set (collisions in its hash), one repeat each time.
    for _ in range(4):
        T = int(torch.randint(2, 300, ()))
        slots = torch.randperm(4 * T)[:T]
        i, j = sorted(torch.randperm(T)[:2].tolist())
        slots[j] = slots[i]
        q, k, v = torch.randn(T, 1, 4), torch.randn(T, 1, 4), torch.randn(T, 1, 4)
        kc, vc = torch.zeros(T, 4, 1, 4), torch.zeros(T, 4, 1, 4)
        pos, cache = torch.zeros(T, dtype=torch.long), rope_ext.cos_sin_cache(1, 4)
        for impl, msg in (("op", f"got {int(slots[i])} at indices {i} and {j}"),
                          ("reference", f"got {int(slots[i])} at indices {i} and {j}"),
                          ("cuda_host", "rope: slot_mapping must not repeat a slot")):
            with pytest.raises(RuntimeError, match=msg):
                CACHE_OPS[impl](q, k, v, pos, cache, kc, vc, slots)
