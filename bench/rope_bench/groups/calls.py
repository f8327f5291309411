"""Per-call cost at decode sizes, against the floor a model pays anyway for touching q and k
once: `q.mul_(c); k.mul_(c)` (two of torch's cheapest in-place ops, c a Python float) for the
in-place calls, `q.clone(); k.clone()` for the ones that return new tensors.

q (T, 32, 128) and k (T, 8, 128) for T = 1 and 8 tokens, made inside the mode as a model's
activations are (inference tensors under inference_mode, ordinary ones under no_grad and in grad
mode, where nothing requires grad); the cos/sin table (4096, 128) float32 made outside any mode,
as a model's buffer is. Every row works on both q and k; the rows of one (mode, T, dtype) are
timed round-robin in blocks, and the table gives each row's median and its time over its floor's
(1.00x: as cheap as the floor).
"""

import torch

import rope_ext

NAME = "calls"
ABOUT = ("per-call cost at decode sizes (q 32 heads, k 8, head_dim 128) against q.mul_(c); "
         "k.mul_(c) (in place) or q.clone(); k.clone()")
ORDER = 10

TOKENS = (1, 8)
HEADS_Q, HEADS_K, HEAD_DIM, MAX_POSITION = 32, 8, 128, 4096
MODES = {"inference_mode": torch.inference_mode, "no_grad": torch.no_grad,
         "grad_mode": torch.enable_grad}
FLOOR = "floor: q.mul_(c); k.mul_(c)"
CLONE_FLOOR = "floor: q.clone(); k.clone()"
# The calls that return new tensors, measured against CLONE_FLOOR; the rest against FLOOR.
ALLOCATING = {CLONE_FLOOR, "torch.ops.rope.apply_positions (q, k)", "torch.ops.rope.apply (q, k)",
              "rope_ext.apply_rope (q, k)", "rope_ext.apply_rope_at (q, k)"}


def _compat():
    try:
        from rope_ext.compat import vllm
    except Exception:  # noqa: BLE001 - the row is left out, with a note
        return None
    return vllm


def _rows(q, k, positions, cache, cos, sin, weight, vllm):
    """name -> callable, every one on q and k."""
    T = q.shape[0]
    half = cache.shape[1] // 2
    cos_t, sin_t = cache[:, :half], cache[:, half:]  # views of the buffer, as models slice it
    ops = torch.ops.rope
    rows = {
        FLOOR: lambda: (q.mul_(1.0), k.mul_(1.0)),
        CLONE_FLOOR: lambda: (q.clone(), k.clone()),
        "torch.ops.rope.apply_": lambda: ops.apply_(q, k, positions, cache, False),
        "torch.ops.rope.apply_positions (q, k)": lambda: (
            ops.apply_positions(q, positions, cos_t, sin_t, False, False, None, False),
            ops.apply_positions(k, positions, cos_t, sin_t, False, False, None, False)),
        "torch.ops.rope.apply (q, k)": lambda: (ops.apply(q, cos, sin, False),
                                                ops.apply(k, cos, sin, False)),
        "rope_ext.apply_rope_": lambda: rope_ext.apply_rope_(q, k, positions, cache),
        "rope_ext.qk_norm_rope_": lambda: rope_ext.qk_norm_rope_(q, k, weight, weight, positions,
                                                                 cache),
        "rope_ext.apply_rope (q, k)": lambda: (rope_ext.apply_rope(q, cos, sin),
                                               rope_ext.apply_rope(k, cos, sin)),
        "rope_ext.apply_rope_at (q, k)": lambda: (rope_ext.apply_rope_at(q, positions, cache),
                                                  rope_ext.apply_rope_at(k, positions, cache)),
    }
    if vllm is not None:
        qf, kf = q.view(T, -1), k.view(T, -1)
        rows["compat.vllm.rotary_embedding"] = lambda: vllm.rotary_embedding(
            positions, qf, kf, HEAD_DIM, cache, True)
    return rows


def run(ctx):
    from ..cases import DTYPES

    vllm = _compat()
    notes = [] if vllm is not None else ["compat.vllm not importable: its row is left out"]
    cache = rope_ext.cos_sin_cache(MAX_POSITION, HEAD_DIM)  # outside any mode: a buffer
    weight = torch.ones(HEAD_DIM)  # the norm's weight, a model's parameter (not requiring grad)
    out = []
    for mode, enter in MODES.items():  # --quick: still every mode, one size
        for dtype_name in ctx.dtypes:
            for T in TOKENS[:1] if ctx.quick else TOKENS:
                g = torch.Generator().manual_seed(T)
                pos_cpu = torch.randint(0, MAX_POSITION, (T,), generator=g)
                cos = cache[pos_cpu, None, :HEAD_DIM // 2].contiguous()  # gathered, (T, 1, D/2)
                sin = cache[pos_cpu, None, HEAD_DIM // 2:].contiguous()
                with enter():
                    dt = DTYPES[dtype_name]
                    q = torch.randn(T, HEADS_Q, HEAD_DIM, generator=g).to(dt)
                    k = torch.randn(T, HEADS_K, HEAD_DIM, generator=g).to(dt)
                    positions = pos_cpu.clone()
                    fns = _rows(q, k, positions, cache, cos, sin, weight, vllm)
                    timed = ctx.time(fns, f"calls {mode} T={T} {dtype_name}")
                for name, s in timed.items():
                    floor_name = CLONE_FLOOR if name in ALLOCATING else FLOOR
                    floor = timed.get(floor_name, {}).get("median_s")
                    out.append({"call": name, "mode": mode, "tokens": T, "dtype": dtype_name,
                                **s, "floor": floor_name, "floor_s": floor,
                                "x_floor": s["median_s"] / floor if floor else None})
                print(f"  calls {mode:14s} T={T} {dtype_name:8s} " + ", ".join(
                    f"{n.split(' ')[0]} {s['median_s'] * 1e6:.1f} us" for n, s in timed.items()),
                    flush=True)
    return {"rows": out, "notes": notes}


def table(result):
    from . import md_table, us, x

    rows = result["rows"]
    cols = sorted({(r["tokens"], r["dtype"]) for r in rows}, key=lambda c: (c[1], c[0]))
    header = ["mode", "call"] + [f"{t} tok {d}: us (x its floor)" for t, d in cols]
    by = {(r["mode"], r["call"], r["tokens"], r["dtype"]): r for r in rows}
    lines = []
    for mode in dict.fromkeys(r["mode"] for r in rows):
        for call in dict.fromkeys(r["call"] for r in rows):
            cells = []
            for t, d in cols:
                r = by.get((mode, call, t, d))
                cells.append("-" if r is None else
                             f"{us(r['median_s'])} ({x(r['x_floor'])})")
            lines.append([mode, f"`{call}`"] + cells)
    return md_table(header, lines)
