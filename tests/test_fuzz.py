"""A randomized differential fuzz: every op on random shapes, strides, dtypes, broadcasts,
overlaps, positions (some out of range) and adversarial sizes, native against the reference.
Either both raise, with the same message, and nothing written changed; or both give the same
result. Every case also runs the CUDA code, on the CPU simulator, against the native CPU op (a
data error there is the device's trap), and, where torch sees a GPU, on the GPU against the native
CPU op (calls the CPU accepts). `--fuzz-cases N` sets how many (make
sanitize runs many under the sanitizers); each case's seed is in the failure message, and
`--fuzz-seed S --fuzz-cases 1` replays seed S."""

import random

import pytest
import torch

import rope_ext
from conftest import TOL

ops = torch.ops.rope
ref = rope_ext.reference
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def rand_view(rng, shape, dtype, allow_expand=True):
    """A tensor of `shape` that is a random view: permuted, sliced with steps, offset from an
    aligned start, or expanded along a size-1 dim (read-only operands only)."""
    if rng.random() < 0.2 and allow_expand and shape and any(n > 1 for n in shape):
        d = rng.choice([i for i, n in enumerate(shape) if n > 1])
        small = list(shape)
        small[d] = 1
        return torch.randn(small, dtype=torch.float64).to(dtype).expand(shape)
    perm = list(range(len(shape)))
    if rng.random() < 0.3:
        rng.shuffle(perm)
    step = rng.choice([1, 1, 2])
    base_shape = [shape[p] for p in perm]
    if base_shape:
        base_shape[-1] = base_shape[-1] * step
    offset = rng.choice([0, 0, 1, 3])
    n = 1
    for s in base_shape:
        n *= s
    flat = torch.randn(n + offset, dtype=torch.float64).to(dtype)[offset:]
    t = flat.view(base_shape) if base_shape else flat.view(())
    if base_shape:
        t = t[..., ::step]
    inverse = [perm.index(i) for i in range(len(shape))]
    return t.permute(inverse) if shape else t


def positions(rng, shape, rows, bad_rate=0.1):
    p = torch.randint(0, max(rows, 1), shape)
    if p.numel() and rng.random() < bad_rate:
        idx = rng.randrange(p.numel())
        p.view(-1)[idx] = rng.choice([-1, rows, rows + 7, -(2**40)])
    return p.to(rng.choice([torch.int32, torch.int64]))


def table_and_positions(rng, t, rot):
    """A cos_sin_cache of 1 or 9 rows of rot columns in a random dtype, an MRoPE section (or
    None) and positions for t tokens: (t,), or (3, t) with the section (some out of range)."""
    rows = rng.choice([1, 9])
    tab = rope_ext.cos_sin_cache(rows, max(rot, 2), dtype=rng.choice(DTYPES))[:, :rot]
    if rng.random() < 0.3 and rot >= 2:
        half = rot // 2
        return tab, [half - 2 * (half // 3), half // 3, half // 3], positions(rng, [3, t], rows)
    return tab, None, positions(rng, [t], rows)


def run_both(native, reference, written):
    """Calls both on clones of the written tensors; returns (native outputs, reference outputs)
    or asserts they raised alike with nothing changed."""
    results, errors = [], []
    for fn in (native, reference):
        copies = [w.clone() for w in written]
        try:
            out = fn(copies)
            results.append((out, copies))
            errors.append(None)
        except RuntimeError as e:
            errors.append(str(e))
            for c, w in zip(copies, written):
                assert torch.equal(c.view(torch.uint8) if c.dtype.is_floating_point and c.element_size() == 1 else c, w.view(torch.uint8) if w.dtype.is_floating_point and w.element_size() == 1 else w) or torch.equal(c.isnan(), w.isnan()), "a rejected call changed an input"
    if errors[0] is not None or errors[1] is not None:
        assert errors[0] == errors[1], f"native: {errors[0]!r}\nreference: {errors[1]!r}"
        return None
    return results


def run_simulated(native, simulated, written):
    """run_both for the CUDA simulator against the native CPU op: an error the host code raises
    has the same message on both; a data error (a position or slot out of range, a repeated
    slot) the simulated device reports as a trap, after which the written tensors are undefined
    (as on a GPU)."""
    results, errors = [], []
    for fn in (native, simulated):
        copies = [w.clone() for w in written]
        try:
            results.append((fn(copies), copies))
            errors.append(None)
        except RuntimeError as e:
            errors.append(str(e))
    if errors[0] is None and errors[1] is None:
        return results
    if errors[1] is not None and "device-side assert triggered" in errors[1]:
        assert errors[0] is not None, f"the simulator trapped where the CPU accepted: {errors[1]!r}"
        return None
    assert errors[0] == errors[1], f"native: {errors[0]!r}\nsimulated: {errors[1]!r}"
    return None


class SimOps:
    """torch.ops.rope's ops as the CUDA simulator runs them (tests/sim): the same arguments, the
    launch's own (max_blocks, force_idx64 where the op takes it, the info tensor) filled in."""

    def __init__(self, max_blocks):
        import cuda_sim

        cuda_sim.load()
        self.max_blocks = max_blocks

    def __getattr__(self, name):
        # rope.apply and rope.apply_backward are one simulated op; apply.out another
        if name in ("apply", "apply_backward"):
            call = self._op("apply", "apply", inverse=name == "apply_backward")
            call.out = self._op("apply_out", "apply")
            return call
        call = self._op(name, name)
        if name == "apply_positions":  # .cache: the simulated op with sin None
            call.cache = lambda x, positions, cache, *rest: call(x, positions, cache, None, *rest)
        return call

    def _op(self, sim_name, native_name, **fixed):
        op = getattr(torch.ops.rope_sim, sim_name)
        sim_args = [a.name for a in op.default._schema.arguments]
        # (the simulator's schemas have no defaults: the native op's fill what a call leaves out)
        defaults = {a.name: a.default_value
                    for a in getattr(torch.ops.rope, native_name).default._schema.arguments
                    if a.has_default_value()}

        def call(*args, **kwargs):
            info = torch.zeros(4 if "norm" in sim_name else 12, dtype=torch.int64)  # (sim's sizes)
            extra = dict(max_blocks=self.max_blocks, info=info, **fixed)
            if "force_idx64" in sim_args:
                extra["force_idx64"] = False
            given = set(sim_args[:len(args)]) | set(kwargs)
            extra.update({k: v for k, v in defaults.items() if k not in given})
            return op(*args, **kwargs, **extra)

        return call

    compare = staticmethod(run_simulated)


def run_on_device(native, on_device, written):
    """run_both for the ops on a GPU against the native CPU op, for the calls the CPU accepts: a
    data error the CPU refuses (a position or slot out of range, a repeated slot) is a
    device-side assert on a GPU, which leaves the CUDA context unusable, so a call the CPU
    refuses is not made there (the simulated test compares the errors)."""
    results = []
    for fn in (native, on_device):
        copies = [w.clone() for w in written]
        try:
            results.append((fn(copies), copies))
        except RuntimeError as e:
            if fn is on_device:
                raise AssertionError(f"the GPU refused a call the CPU accepted: {e}") from None
            return None  # refused by the CPU: not made on the GPU
    return results


class DeviceOps:
    """torch.ops.rope's ops run on `device` with the CPU tensors they are given: each storage is
    copied there once (so views of one buffer stay views of one buffer, with their strides,
    offsets and broadcasts), the op runs, every storage is copied back (an in-place write shows
    in the CPU tensors, as does a write where none belongs) and its outputs come back to the CPU."""

    compare = staticmethod(run_on_device)

    def __init__(self, device):
        self.device = device

    def __getattr__(self, name):
        return DeviceOp(getattr(ops, name), self.device)


class DeviceOp:
    def __init__(self, packet, device):
        self.packet, self.device = packet, device

    def __getattr__(self, overload):  # o.apply.out(...)
        return DeviceOp(getattr(self.packet, overload), self.device)

    def __call__(self, *args, **kwargs):
        moved = {}  # CPU storage's address -> (its bytes on the CPU, its bytes on the device)

        def to_device(a):
            if isinstance(a, (list, tuple)):
                return type(a)(to_device(b) for b in a)
            if not isinstance(a, torch.Tensor):
                return a
            st = a.untyped_storage()
            if st.data_ptr() not in moved:
                host = torch.empty(0, dtype=torch.uint8).set_(st)
                moved[st.data_ptr()] = (host, host.to(self.device, copy=True))
            dev = moved[st.data_ptr()][1]
            return torch.empty(0, dtype=a.dtype, device=self.device).set_(
                dev.untyped_storage(), a.storage_offset(), a.size(), a.stride())

        def to_cpu(a):
            if isinstance(a, (list, tuple)):
                return type(a)(to_cpu(b) for b in a)
            return a.cpu() if isinstance(a, torch.Tensor) else a

        out = self.packet(*to_device(args), **{k: to_device(v) for k, v in kwargs.items()})
        out = to_cpu(out)
        for host, dev in moved.values():
            host.copy_(dev.cpu())
        return out


# The second path of run_paths: None, the reference; a SimOps or a DeviceOps (set by the
# simulated and the GPU tests), the ops run on the simulator or on the GPU.
SECOND = {"sim": None}


def run_paths(call, reference, written):
    """call(o) is the op call on torch.ops.rope-like o; run against the reference (run_both) or,
    in the simulated and GPU tests, against the same call there (SECOND's compare)."""
    second = SECOND["sim"]
    if second is None:
        return run_both(call(ops), reference, written)
    return second.compare(call(ops), call(second), written)


def close(a, b, dtype, scaled=False):
    """a and b alike within dtype's tolerance (float8 codes: equal). scaled: the absolute
    tolerance taken relative to the largest magnitude of b (at least 1), for the norm stage,
    whose weights and bias scale each row: a*c - b*s of scaled rows can cancel to values far
    below its terms, whose rounding in each path (both in float32 for float32 rows) is relative to
    the terms, not to the result (float32, weights and bias ~N(0, 1): 1.07e-6 apart on an element
    of 0.066 whose terms were near 8)."""
    if isinstance(a, torch.Tensor):
        if a.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
            return
        rtol, atol = TOL[dtype] if dtype in TOL else (0, 0)
        if scaled and b.numel():
            atol *= max(1.0, b.double().nan_to_num(0.0, 0.0, 0.0).abs().max().item())
        torch.testing.assert_close(a.double(), b.double(), rtol=rtol, atol=atol, equal_nan=True)


def case_apply(rng):
    dtype, tdtype = rng.choice(DTYPES), rng.choice(DTYPES)
    lead = [rng.choice([0, 1, 2, 3, 5]) for _ in range(rng.randrange(0, 4))]
    head_dim = rng.choice([0, 2, 6, 8, 16, 34, 64, 130])
    half = rng.randrange(0, head_dim // 2 + 2)  # sometimes too wide
    x = rand_view(rng, lead + [head_dim], dtype)
    tshape = [n if rng.random() < 0.5 else 1 for n in lead] + [half]
    if rng.random() < 0.15:
        tshape = tshape[rng.randrange(0, len(tshape)):]  # fewer dims: must be refused alike
    cos, sin = rand_view(rng, tshape, tdtype), rand_view(rng, tshape, tdtype)
    il = rng.random() < 0.5
    kind = rng.choice(["apply", "backward", "out"])
    if kind == "out":
        out = torch.full(x.shape, float("nan"), dtype=dtype)
        res = run_paths(lambda o: lambda w: o.apply.out(x, cos, sin, il, out=w[0]),
                        lambda w: ref.apply_rope_out(x, cos, sin, interleaved=il, out=w[0]), [out])
        if res:
            close(res[0][1][0], res[1][1][0], dtype)
        return
    name = "apply" if kind == "apply" else "apply_backward"
    r_op = ref.apply_rope if kind == "apply" else ref.apply_rope_backward
    res = run_paths(lambda o: lambda w: getattr(o, name)(x, cos, sin, il),
                    lambda w: r_op(x, cos, sin, interleaved=il), [])
    if res:
        close(res[0][0], res[1][0], dtype)


def case_inplace(rng):
    dtype = rng.choice(DTYPES)
    lead = [rng.choice([0, 1, 2, 4]) for _ in range(rng.randrange(0, 3))]
    head_dim = rng.choice([2, 8, 16, 40, 64])
    rot = rng.choice([r for r in range(0, head_dim + 3, 2)])
    rows = rng.choice([1, 7, 64])
    hq, hk = rng.choice([1, 2, 4]), rng.choice([0, 1, 2])
    if rng.random() < 0.5:  # views of one fused buffer
        buf = rand_view(rng, lead + [hq + 2 * hk, head_dim], dtype, allow_expand=False)
        q, k = buf[..., :hq, :], (buf[..., hq:hq + hk, :] if hk else None)
        if rng.random() < 0.1 and hk:
            k = buf[..., :hk, :]  # overlaps query: must be refused alike
    else:
        q = rand_view(rng, lead + [hq, head_dim], dtype, allow_expand=rng.random() < 0.1)
        k = rand_view(rng, lead + [hk, head_dim], dtype, allow_expand=False) if hk else None
    cache = rope_ext.cos_sin_cache(rows, max(rot, 2), dtype=rng.choice(DTYPES))[:, :rot]
    mrope = rng.random() < 0.3
    il, mi = rng.random() < 0.5, rng.random() < 0.5
    if mrope:
        pos = positions(rng, [3] + lead, rows)
        half = rot // 2
        sec = [half - 2 * (half // 3), half // 3, half // 3]
        if rng.random() < 0.15:
            sec = rng.choice([[half, 1, -1], [2**62, 2**62, 5], [half], [0, 0, half + 1]])
        written = [q] + ([k] if k is not None else [])

        def call(o):
            return lambda w: o.mrope_(w[0], w[1] if k is not None else None, pos, cache, sec, il,
                                      mi)

        def reference(w):
            ref.apply_mrope_(w[0], w[1] if k is not None else None, pos, cache, sec, interleaved=il,
                             mrope_interleaved=mi)
    else:
        pos = positions(rng, lead, rows)
        written = [q] + ([k] if k is not None else [])

        def call(o):
            return lambda w: o.apply_(w[0], w[1] if k is not None else None, pos, cache, il)

        def reference(w):
            ref.apply_rope_(w[0], w[1] if k is not None else None, pos, cache, interleaved=il)
    # The written tensors are cloned by run_both, so in-place aliasing between them is lost;
    # call the ops on the originals when q and k share memory (both must refuse).
    if k is not None and q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr():
        run_paths(lambda o: lambda w: call(o)([q, k]), lambda w: reference([q, k]), [])
        return
    res = run_paths(call, reference, written)
    if res:
        for a, b in zip(res[0][1], res[1][1]):
            close(a, b, dtype)


def case_positions(rng):
    dtype = rng.choice(DTYPES)
    lead = [rng.choice([0, 1, 3]) for _ in range(rng.randrange(0, 3))]
    head_dim = rng.choice([4, 16, 38])
    half = rng.randrange(0, head_dim // 2 + 2)
    rows = rng.choice([1, 9])
    x = rand_view(rng, lead + [rng.choice([1, 3]), head_dim], dtype)
    tdtype = rng.choice(DTYPES)
    cos, sin = rand_view(rng, [rows, half], tdtype), rand_view(rng, [rows, half], tdtype)
    sec = None
    if rng.random() < 0.4:
        sec = [half - 2 * (half // 3), half // 3, half // 3]
        pos = positions(rng, [3] + lead, rows)
    else:
        pos = positions(rng, lead, rows)
    il, inv, mi = rng.random() < 0.5, rng.random() < 0.5, rng.random() < 0.5
    if rng.random() < 0.5:  # the .cache overload: one table, sometimes of odd width
        cache = rand_view(rng, [rows, 2 * half + (rng.random() < 0.1)], tdtype)
        res = run_paths(
            lambda o: lambda w: o.apply_positions.cache(x, pos, cache, il, inv, sec, mi),
            lambda w: ref.apply_positions_cache(x, pos, cache, interleaved=il, inverse=inv,
                                                mrope_section=sec, mrope_interleaved=mi), [])
    else:
        res = run_paths(lambda o: lambda w: o.apply_positions(x, pos, cos, sin, il, inv, sec, mi),
                        lambda w: ref.apply_positions(x, pos, cos, sin, interleaved=il, inverse=inv,
                                                      mrope_section=sec, mrope_interleaved=mi), [])
    if res:
        close(res[0][0], res[1][0], dtype)


def case_cache(rng):
    dtype = rng.choice(DTYPES)
    t, hq, hk = rng.choice([0, 1, 5]), rng.choice([1, 4]), rng.choice([1, 2])
    d, dv, rot = rng.choice([8, 32]), rng.choice([4, 32]), rng.choice([0, 4, 8])
    fmt = rng.choice(["auto", "fp8", "fp8_e5m2"])
    cdt = {"auto": dtype, "fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[fmt]
    if rng.random() < 0.1:
        cdt = torch.float32  # wrong cache dtype for the format: refused alike
    blocks, bs = rng.choice([1, 3]), rng.choice([1, 4])
    qkv = torch.randn(t, hq + 2 * hk, d).to(dtype)
    q, k = qkv[:, :hq], qkv[:, hq:hq + hk]
    v = torch.randn(t, hk, dv).to(dtype)
    kc = torch.randn(blocks, bs, hk, d).to(cdt)
    vc = torch.randn(blocks, bs, hk, dv).to(cdt)
    slots = torch.randint(-1, blocks * bs + (1 if rng.random() < 0.1 else 0), (t,))
    if t and rng.random() < 0.8:  # distinct slots, as a real slot mapping has
        slots = torch.randperm(blocks * bs + t)[:t] - t // 2
        slots = torch.where(slots < blocks * bs, slots, -1)
    pos = positions(rng, [t], 16)
    cache = rope_ext.cos_sin_cache(16, max(rot, 2))[:, :rot]
    scales = (torch.tensor([rng.choice([0.25, 1.0, 3.0])]), torch.tensor([0.5])) if fmt != "auto" else (None, None)
    il = rng.random() < 0.5
    res = run_paths(
        lambda o: lambda w: o.apply_and_cache_(w[0], w[1], v, pos, cache, w[2], w[3], slots, il, fmt, *scales),
        lambda w: ref.apply_and_cache_(w[0], w[1], v, pos, cache, w[2], w[3], slots, interleaved=il,
                                       kv_cache_dtype=fmt, k_scale=scales[0], v_scale=scales[1]),
        [q, k, kc, vc])
    if res:
        for a, b in zip(res[0][1], res[1][1]):
            close(a, b, dtype)


def close_cache(a, b, dtype):
    """Cache contents of the two paths: float8 codes compared as values within one step (the
    paths round the normed rows at different precisions, so a code can land on either side of a
    tie), other dtypes as close() does; unwritten (NaN-poisoned) rows must match exactly."""
    if a.element_size() == 1:
        torch.testing.assert_close(a.double(), b.double(), rtol=0.26, atol=1e-3, equal_nan=True)
    else:
        close(a, b, dtype)


def case_qk_norm_cache(rng):
    """rope.qk_norm_rope_and_cache_ and its out-of-place form (the serving prologue): random
    head dims, partial and too-wide rotary, both pair layouts, MRoPE, v_norm, unit_offset,
    weight dtypes and shapes, float8 caches with scales (sometimes missing), slots with padding
    (sometimes repeated or out of range), q/k/v as strided views of one buffer or separate
    tensors."""
    dtype = rng.choice(DTYPES)
    t, hq, hk = rng.choice([0, 1, 3, 6]), rng.choice([1, 3]), rng.choice([1, 2])
    d = rng.choice([2, 6, 8, 16, 40, 64, 128, 136])
    dv = d if rng.random() < 0.6 else rng.choice([4, 24])
    rot = rng.choice([r for r in range(0, d + 1, 2)] + ([d + 2, 3] if rng.random() < 0.1 else []))
    if dv == d and rng.random() < 0.6:  # views of one projection output
        buf = rand_view(rng, [t, hq + 2 * hk, d], dtype, allow_expand=False)
        q, k, v = buf[:, :hq], buf[:, hq:hq + hk], buf[:, hq + hk:]
    else:
        q = rand_view(rng, [t, hq, d], dtype, allow_expand=False)
        k = rand_view(rng, [t, hk, d], dtype, allow_expand=False)
        v = rand_view(rng, [t, hk, dv], dtype, allow_expand=False)
    wdt = rng.choice(DTYPES)
    wq = torch.randn(d + (1 if rng.random() < 0.05 else 0), dtype=torch.float64).to(wdt)
    wk = torch.randn(d, dtype=torch.float64).to(rng.choice([wdt, torch.float32]))
    fmt = rng.choice(["auto", "auto", "fp8", "fp8_e4m3", "fp8_e5m2"])
    cdt = {"auto": dtype, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
           "fp8_e5m2": torch.float8_e5m2}[fmt]
    if rng.random() < 0.05:
        cdt = torch.float16 if dtype != torch.float16 else torch.float32  # wrong: refused alike
    blocks, bs = rng.choice([1, 3]), rng.choice([1, 4])
    kc = torch.full((blocks, bs, hk, d), float("nan")).to(cdt)
    vc = torch.full((blocks, bs, hk, dv), float("nan")).to(cdt)
    slots = torch.randperm(blocks * bs + t)[:t] - t // 2
    slots = torch.where(slots < blocks * bs, slots, -1)
    if t > 1 and rng.random() < 0.1:
        slots[rng.randrange(1, t)] = max(int(slots[0]), 0)  # repeated (or padding): as it falls
    if t and rng.random() < 0.05:
        slots[rng.randrange(t)] = blocks * bs  # out of range
    tab, sec, pos = table_and_positions(rng, t, rot)
    mi = rng.random() < 0.5
    scales = {}
    if fmt != "auto" and rng.random() < 0.95:
        scales = dict(k_scale=torch.tensor([rng.choice([0.25, 0.37, 1.0, 3.0])]),
                      v_scale=torch.tensor([rng.choice([0.5, 1.9])]))
    kw = dict(unit_offset=rng.random() < 0.5, interleaved=rng.random() < 0.5, mrope_section=sec,
              mrope_interleaved=mi, v_norm=rng.random() < 0.5, kv_cache_dtype=fmt, **scales)
    eps = rng.choice([1e-6, 1e-5])
    # in place (rope.qk_norm_rope_and_cache_) or out of place (rope.qk_norm_rope_and_cache)
    out_of_place = rng.random() < 0.35
    name = "qk_norm_rope_and_cache" + ("" if out_of_place else "_")
    reference_op = getattr(rope_ext._qk_norm.reference, name)

    def on(fn, w):
        return fn(w[0], w[1], w[2], pos, tab, wq, wk, w[3], w[4], slots, eps, **kw)

    if t and q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr():
        # q, k and v share one buffer: each path gets a copy of it, and its views of the copy
        written = [buf, kc, vc]

        def views(w):
            return [w[0][:, :hq], w[0][:, hq:hq + hk], w[0][:, hq + hk:], w[1], w[2]]
    else:
        written = [q, k, v, kc, vc]

        def views(w):
            return w
    res = run_paths(lambda o: lambda w: on(getattr(o, name), views(w)),
                    lambda w: on(reference_op, views(w)), written)
    if res:
        # (the CUDA kernels sum a row's squares in another order than the CPU's: close, not
        # the same bits)
        n = len(written)
        for i, (a, b) in enumerate(zip(res[0][1], res[1][1])):
            (close_cache if i >= n - 2 else close)(a, b, dtype)
        if out_of_place:  # the inputs only read; the new query, key and value alike
            for _, copies in res:
                for c, w in zip(copies[:n - 2], written[:n - 2]):
                    torch.testing.assert_close(c, w, rtol=0, atol=0, equal_nan=True,
                                               msg="an input was written out of place")
            for a, b in zip(res[0][0], res[1][0]):
                close(a, b, dtype)


def case_shift(rng):
    """rope.shift_kv_cache_: caches of every dtype and float8 format, partial rotary, one delta
    or one per slot (some past the table), slots with padding (sometimes repeated or out of
    range), a missing scale."""
    fmt = rng.choice(["auto", "auto", "fp8", "fp8_e5m2"])
    dtype = rng.choice(DTYPES) if fmt == "auto" else {"fp8": torch.float8_e4m3fn,
                                                       "fp8_e5m2": torch.float8_e5m2}[fmt]
    blocks, bs, h = rng.choice([1, 3]), rng.choice([1, 4]), rng.choice([1, 2])
    d = rng.choice([2, 8, 16, 40, 128])
    rot = rng.choice([r for r in range(0, d + 1, 2)] + ([d + 2] if rng.random() < 0.1 else []))
    kc = torch.randn(blocks, bs, h, d, dtype=torch.float64).to(dtype)
    n = rng.choice([0, 1, 3, 5])
    slots = torch.randperm(blocks * bs + n)[:n] - n // 2
    slots = torch.where(slots < blocks * bs, slots, -1)
    if n > 1 and rng.random() < 0.1:
        slots[rng.randrange(1, n)] = max(int(slots[0]), 0)
    if n and rng.random() < 0.05:
        slots[rng.randrange(n)] = blocks * bs
    slots = slots.to(rng.choice([torch.int32, torch.int64]))
    rows = rng.choice([1, 9])
    tab = rope_ext.cos_sin_cache(rows, max(rot, 2), dtype=rng.choice(DTYPES))[:, :rot]
    span = rows + (2 if rng.random() < 0.1 else 0)  # sometimes past the table: refused alike
    delta = torch.randint(-span + 1, span, () if rng.random() < 0.4 else (n,))
    scale = None
    if fmt != "auto" and rng.random() < 0.95:  # (a missing scale: refused alike)
        scale = torch.tensor([rng.choice([0.25, 1.0, 3.0])])
    il = rng.random() < 0.5
    res = run_paths(
        lambda o: lambda w: o.shift_kv_cache_(w[0], slots, delta, tab, il, fmt, scale),
        lambda w: rope_ext._kv_shift.reference.shift_kv_cache_(
            w[0], slots, delta, tab, interleaved=il, kv_cache_dtype=fmt, k_scale=scale),
        [kc])
    if res:
        close_cache(res[0][1][0], res[1][1][0], dtype)


def quant_parts(rng):
    """The inputs of a RoPE + FP8 call: (dtype, nnz, hq, hk, mla, rope_dim, nope_dim,
    [q_rope, k_rope, q_nope, k_nope]) as random views; MLA keys have no heads dim."""
    dtype = rng.choice([torch.float16, torch.bfloat16, torch.float32])
    nnz, hq, hk = rng.choice([0, 1, 4, 5]), rng.choice([1, 3]), rng.choice([1, 2])
    mla = rng.random() < 0.4
    r, nope = rng.choice([0, 2, 8, 32, 64]), rng.choice([0, 4, 40])
    kshape = (nnz,) if mla else (nnz, hk)
    shapes = ([nnz, hq, r], [*kshape, r], [nnz, hq, nope], [*kshape, nope])
    return dtype, nnz, hq, hk, mla, r, nope, [rand_view(rng, list(sh), dtype, allow_expand=False)
                                              for sh in shapes]


def case_quant(rng):
    """rope.quantize_fp8: MLA (keys without heads) and GQA shapes, both float8 formats, scales,
    both pair layouts, positions out of range, outputs of the wrong format."""
    dtype, nnz, hq, hk, mla, r, nope, parts = quant_parts(rng)
    fp8 = rng.choice([torch.float8_e4m3fn, torch.float8_e5m2])
    outs = [torch.full(p.shape, float("nan")).to(fp8) for p in parts]
    if rng.random() < 0.05:
        outs[rng.randrange(4)] = outs[0].float()  # not float8: refused alike
    rows = rng.choice([1, 9])
    tab = torch.randn(rows, r, dtype=torch.float32)
    pos = positions(rng, [nnz], rows)
    sq, skv = rng.choice([1.0, 0.5, 3.0]), rng.choice([1.0, 0.25])
    il = rng.random() < 0.5
    res = run_paths(
        lambda o: lambda w: o.quantize_fp8(*parts, tab, pos, *w, sq, skv, il),
        lambda w: rope_ext._quant.registrations.quantize_fp8(*parts, tab, pos, *w, sq, skv, il),
        outs)
    if res:
        for a, b in zip(res[0][1], res[1][1]):
            close_cache(a, b, dtype)


def case_quant_paged(rng):
    """rope.quantize_fp8_append_paged_kv_cache: MLA and GQA (NHD, HND) caches, one request over
    shuffled pages, padding tokens, and sometimes a position past the request's pages, a page
    index past the cache or an indptr out of order."""
    dtype, nnz, hq, hk, mla, r, nope, parts = quant_parts(rng)
    v = None if mla else torch.randn(nnz, hk, r + nope).to(dtype)
    fp8 = rng.choice([torch.float8_e4m3fn, torch.float8_e5m2])
    ps = rng.choice([1, 4])
    pages = max(1, -(-nnz // ps))
    max_pages = pages + rng.choice([0, 2])
    layout = "NHD" if mla else rng.choice(["NHD", "HND"])
    if mla:
        shapes = ((max_pages, ps, nope), (max_pages, ps, r))
    elif layout == "NHD":
        shapes = ((max_pages, ps, hk, r + nope),) * 2
    else:
        shapes = ((max_pages, hk, ps, r + nope),) * 2
    caches = [torch.full(sh, float("nan")).to(fp8) for sh in shapes]
    kv_indices = torch.randperm(max_pages)[:pages].int()
    kv_indptr = torch.tensor([0, pages], dtype=torch.int32)
    batch = torch.zeros(nnz, dtype=torch.int32)
    pos_in_request = torch.randperm(pages * ps)[:nnz].int()
    if nnz and rng.random() < 0.3:
        batch[rng.randrange(nnz)] = -1  # padding: quantized queries, nothing cached
    bad = rng.random()
    if nnz and bad < 0.05:
        pos_in_request[rng.randrange(nnz)] = pages * ps
    elif bad < 0.1:
        kv_indices[rng.randrange(pages)] = max_pages
    elif bad < 0.13:
        kv_indptr = torch.tensor([pages, 0], dtype=torch.int32)
    rows = rng.choice([1, 9])
    tab = torch.randn(rows, r, dtype=torch.float32)
    pos = positions(rng, [nnz], rows)
    q_out = [torch.full(parts[i].shape, float("nan")).to(fp8) for i in (0, 2)]
    args = (tab, pos)
    index = (kv_indices, kv_indptr, batch, pos_in_request, ps, layout,
             rng.choice([1.0, 0.5]), rng.choice([1.0, 2.0]), rng.random() < 0.5)
    res = run_paths(
        lambda o: lambda w: o.quantize_fp8_append_paged_kv_cache(*parts, v, *args, *w, *index),
        lambda w: rope_ext._quant.registrations.quantize_fp8_append_paged_kv_cache(
            *parts, v, *args, *w, *index),
        q_out + caches)
    if res:
        for a, b in zip(res[0][1], res[1][1]):
            close_cache(a, b, dtype)


def case_qk_norm(rng):
    """The QK-norm family without a cache: rope.qk_norm_rope and rope.norm_rope (functional,
    broadcast cos/sin), rope.qk_norm_rope_ (in place, table rows at positions, MRoPE) and
    rope.qkv_norm_rope_ (packed qkv rows of any stride)."""
    dtype = rng.choice(DTYPES)
    t, hq, hk = rng.choice([0, 1, 3]), rng.choice([1, 3]), rng.choice([1, 2])
    d = rng.choice([2, 6, 8, 16, 40, 64, 128, 136])
    rot = rng.choice([r for r in range(0, d + 1, 2)] + ([d + 2] if rng.random() < 0.1 else []))
    wdt = rng.choice(DTYPES)
    wq = torch.randn(d + (1 if rng.random() < 0.05 else 0), dtype=torch.float64).to(wdt)
    wk = torch.randn(d, dtype=torch.float64).to(rng.choice([wdt, torch.float32]))
    eps, uo, il = rng.choice([1e-6, 1e-5]), rng.random() < 0.5, rng.random() < 0.5
    kind = rng.choice(["qk_norm_rope", "norm_rope", "qk_norm_rope_", "qkv_norm_rope_"])
    qr = rope_ext._qk_norm.reference
    if kind in ("qk_norm_rope", "norm_rope"):
        # Expanded (constant) rows only for the RMS norm: a LayerNorm of a constant row is
        # ill-conditioned (its centered values are rounding errors, then scaled by 1/sqrt(eps)).
        expand = kind == "qk_norm_rope" and rng.random() < 0.1
        q = rand_view(rng, [t, hq, d], dtype, allow_expand=expand)
        k = rand_view(rng, [t, hk, d], dtype, allow_expand=expand)
        tshape = [t if rng.random() < 0.5 else 1, 1, rot // 2]
        tdt = rng.choice(DTYPES)
        sdt = tdt if rng.random() < 0.95 else rng.choice(DTYPES)  # sometimes unlike: refused alike
        cos, sin = rand_view(rng, tshape, tdt), rand_view(rng, tshape, sdt)
        if kind == "qk_norm_rope":
            res = run_paths(lambda o: lambda w: o.qk_norm_rope(q, k, wq, wk, cos, sin, eps, uo, il),
                           lambda w: qr.qk_norm_rope(q, k, wq, wk, cos, sin, eps, uo, il), [])
        else:
            norm = rng.choice(["rms", "rms_across_heads", "layer"])
            if norm == "rms_across_heads":
                wa = torch.randn(hq * d, dtype=torch.float64).to(wdt)
                wb = torch.randn(hk * d, dtype=torch.float64).to(wdt)
            else:
                wa, wb = wq, wk
            ba = wa if rng.random() < 0.5 else None
            args = (q, k, wa if rng.random() < 0.8 else None, wb, ba, None, cos, sin, eps, norm, il)
            res = run_paths(lambda o: lambda w: o.norm_rope(*args), lambda w: qr.norm_rope(*args),
                            [])
        if res:
            for a, b in zip(res[0][0], res[1][0]):
                close(a, b, dtype, scaled=True)
        return
    tab, sec, pos = table_and_positions(rng, t, rot)
    mi = rng.random() < 0.5
    if kind == "qk_norm_rope_":
        q = rand_view(rng, [t, hq, d], dtype, allow_expand=False)
        k = rand_view(rng, [t, hk, d], dtype, allow_expand=False)
        res = run_paths(
            lambda o: lambda w: o.qk_norm_rope_(w[0], w[1], wq, wk, pos, tab, eps, uo, il, sec, mi),
            lambda w: qr.qk_norm_rope_(w[0], w[1], wq, wk, pos, tab, eps, uo, il, sec, mi), [q, k])
    else:
        hv = rng.choice([0, 1])
        width = (hq + hk + hv) * d
        extra = d if rng.random() < 0.05 else 0  # a width that is not the heads': refused alike
        pad = rng.choice([0, 0, 3, d])  # rows of a wider buffer (any row stride)
        qkv = torch.randn(t, width + extra + pad, dtype=torch.float64).to(dtype)[:, pad:]
        rest = (wq, wk, pos, tab, eps, uo, il, sec, mi)
        res = run_paths(
            lambda o: lambda w: o.qkv_norm_rope_(w[0], hq, hk, hv, d, *rest),
            lambda w: qr.qkv_norm_rope_(w[0], hq, hk, hv, d, *rest),
            [qkv])
    if res:
        for a, b in zip(res[0][1], res[1][1]):
            close(a, b, dtype, scaled=True)


CASES = [case_apply, case_inplace, case_positions, case_cache, case_qk_norm_cache, case_shift,
         case_quant, case_quant_paged, case_qk_norm]


def fuzz(request, cases, n, second=lambda rng: None, label=""):
    """n seeded cases from `cases` in turn (a seed's case: seed modulo their number, so
    `--fuzz-seed S --fuzz-cases 1` replays seed S), each against the second path second(rng)
    gives (run_paths; None: the reference). A failure names the case and its seed; the run goes
    on (a run on a lent GPU shows every failure at once), stopping at the 20th."""
    if rope_ext.backend("cpu") != "native":
        pytest.skip("the native library is not loaded")
    base = request.config.getoption("--fuzz-seed")
    base = random.randrange(2**31) if base is None else base
    failures = []
    for seed in range(base, base + n):
        rng = random.Random(seed)
        torch.manual_seed(seed)
        case = cases[seed % len(cases)]
        SECOND["sim"] = second(rng)
        try:
            case(rng)
        except AssertionError as e:
            failures.append(f"{label}{case.__name__}, --fuzz-seed {seed}: {e}")
            if len(failures) == 20:
                break
        finally:
            SECOND["sim"] = None
    if failures:
        stopped = " (the run stopped at the 20th)" if len(failures) == 20 else ""
        raise AssertionError(f"{len(failures)} failed case(s){stopped}; replay one with "
                             "--fuzz-seed S --fuzz-cases 1:\n" + "\n\n".join(failures[:5]))


def test_simulated_cuda_agrees_with_native_on_random_inputs(request):
    """The CUDA ops' code (host and kernels, on the CPU simulator) against the native CPU ops:
    close results on every accepted call, the same errors on rejected ones (a data error the
    device reports by a trap). max_blocks 1: the grid strides over the tokens."""
    fuzz(request, CASES, max(1, request.config.getoption("--fuzz-cases") // 2),
         lambda rng: SimOps(max_blocks=rng.choice([1, 3, 1 << 20])), "simulated ")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")
def test_cuda_agrees_with_native_on_random_inputs(request):
    """The CUDA ops on the GPU against the native CPU ops, on the calls the CPU accepts: close
    results (float8 codes equal), inputs written alike (make gpu-check runs many cases)."""
    if rope_ext.backend("cuda") != "native":
        pytest.skip("the CUDA kernels are not loaded")
    fuzz(request, CASES, max(1, request.config.getoption("--fuzz-cases") // 2),
         lambda rng: DeviceOps("cuda"), "cuda ")


def test_native_and_reference_agree_on_random_inputs(request):
    fuzz(request, CASES, request.config.getoption("--fuzz-cases"))
