"""Benchmark of the serving ops: `python bench/serving_bench.py --device cpu|cuda [--quick]
[--out DIR]`.

Rows per case: the rope_ext op, its unfused eager PyTorch equivalent (rope_ext's reference
path, checks included, as a user calling it gets it), and the copy limit (a contiguous copy of
the bytes the op must read and write). Every row of a case counts the same bytes, the least
traffic the work needs, so GB/s compare directly. Cases:
- shift_kv_cache_: K-shift of N cached slots of a paged key cache (float and float8 caches);
- apply_ rope_dim_offset + inverse: DeepSeek-V4's RoPE on the tail of each head, undone in place;
- qk_norm_rope_and_cache_: the serving attention prologue (Qwen3-8B heads 32/8/128, bfloat16,
  bfloat16 and float8 caches) at 1 to 512 tokens, against rope_ext's own unfused sequence
  (qk_norm_rope_, then the paged write in PyTorch), its out-of-place form
  (rope_ext.qk_norm_rope_and_cache), vLLM's signature for it
  (rope_ext.compat.vllm.fused_qknorm_rope_cache), the prologue in eager PyTorch as a model's
  native path writes it, and torch.compile of that.

Prints a table and writes STEM.json and STEM.md to --out (default bench/results/). Timing reuses
rope_bench (round-robin blocks, robust to a shared machine); the ratios are what to read.
"""

import argparse
import json
import os
import platform
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # rope_bench
sys.path.insert(1, os.path.dirname(HERE))  # rope_ext from this checkout

import torch  # noqa: E402

import rope_ext  # noqa: E402
from rope_bench import malloc  # noqa: E402
from rope_bench.cases import steady_norm_weight  # noqa: E402
from rope_bench.timing import clock_for, measure_interleaved, median, quantile  # noqa: E402
from rope_ext import reference  # noqa: E402
from rope_ext.compat.vllm import fused_qknorm_rope_cache  # noqa: E402
from rope_ext._kv_shift import reference as _kv_shift_reference  # noqa: E402

RESULTS = os.path.join(HERE, "results")


def copy_limit(nbytes, device):
    """A contiguous copy moving `nbytes` (half read, half written)."""
    src = torch.randn(max(1, nbytes // 8), device=device)
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def shift_case(device, slots, heads, head_dim, rotary_dim, kv_cache_dtype):
    """(name, shape, bytes, {row: fn}) of one K-shift case: `slots` listed slots of a 4x larger
    cache, each shifted by its own delta."""
    fmt = _kv_shift_reference.KV_CACHE_DTYPES[kv_cache_dtype]
    dtype = fmt or torch.bfloat16
    block_size = 16
    blocks = 4 * slots // block_size + 1
    key_cache = (torch.randn(blocks, block_size, heads, head_dim, device=device)).to(dtype)
    slot_mapping = torch.randperm(blocks * block_size, device=device)[:slots]
    table = rope_ext.cos_sin_cache(4096, rotary_dim, device=device)
    delta = torch.randint(-4095, 4096, (slots,), device=device)
    k_scale = torch.tensor([0.1], device=device) if fmt is not None else None
    kw = dict(kv_cache_dtype=kv_cache_dtype, k_scale=k_scale)
    es = key_cache.element_size()
    # Rotary dims of each listed row read and written; slots and deltas read; the table rows.
    nbytes = (2 * slots * heads * rotary_dim * es + 2 * slots * 8 + slots * rotary_dim * 4)
    rows = {
        "rope_ext": lambda: rope_ext.shift_kv_cache_(key_cache, slot_mapping, delta, table, **kw),
        "eager": lambda: _kv_shift_reference.shift_kv_cache_(key_cache, slot_mapping, delta, table,
                                                             **kw),
        "copy": copy_limit(nbytes, device),
    }
    name = f"shift_kv_cache_ {kv_cache_dtype if fmt is not None else 'bfloat16'}"
    return name, [slots, heads, head_dim, rotary_dim], nbytes, rows


def offset_case(device, tokens, heads, head_dim, rotary_dim, dtype):
    """apply_ with rope_dim_offset = head_dim - rotary_dim and inverse=True (DeepSeek-V4)."""
    q = torch.randn(tokens, heads, head_dim, device=device, dtype=dtype)
    k = torch.randn(tokens, 1, head_dim, device=device, dtype=dtype)
    positions = torch.randint(0, 4096, (tokens,), device=device)
    table = rope_ext.cos_sin_cache(4096, rotary_dim, device=device)
    off = head_dim - rotary_dim
    es = q.element_size()
    nbytes = 2 * tokens * (heads + 1) * rotary_dim * es + tokens * 8 + tokens * rotary_dim * 4
    kw = dict(rope_dim_offset=off, inverse=True)
    rows = {
        "rope_ext": lambda: rope_ext.apply_rope_(q, k, positions, table, **kw),
        "eager": lambda: reference.apply_rope_(q, k, positions, table, **kw),
        "copy": copy_limit(nbytes, device),
    }
    return (f"apply_ rope_dim_offset+inverse {str(dtype).removeprefix('torch.')}",
            [tokens, heads, head_dim, rotary_dim], nbytes, rows)


def eager_prologue(q, k, v, positions, table, wq, wk, key_cache, value_cache, slots, eps,
                   k_scale, v_scale):
    """The attention prologue in plain PyTorch, as a model's native path writes it: per-head
    RMSNorm of q and k in float32, NeoX RoPE by the table rows at positions, then key and value
    into the paged caches (float8: x / scale, saturated) at every token's slot. The cases have
    no padding slots (-1), so this writes what the op writes; picking the tokens to cache by a
    mask would make the token count data-dependent, which torch.compile runs as several graphs
    glued by Python (an unfair peer)."""
    def norm(x, w):
        xf = x.float()
        return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()

    half = table.shape[1] // 2
    cos, sin = table[positions, :half][:, None], table[positions, half:][:, None]

    def rotate(x):
        a, b = x[..., :half], x[..., half:]
        return torch.cat((a * cos - b * sin, b * cos + a * sin), -1)

    q.copy_(rotate(norm(q, wq)))
    k.copy_(rotate(norm(k, wk)))
    store_paged(k, v, key_cache, value_cache, slots, k_scale, v_scale)


def store_paged(k, v, key_cache, value_cache, slots, k_scale, v_scale):
    """key and value into the paged caches at every token's slot (float8: x / scale,
    saturated), by plain indexing: the prologue's store stage as a model writes it, for the eager
    and compiled peers and the unfused sequence alike. (rope_ext.reference's store skips padding
    slots through a mask: a gather of k and v, and on CUDA a sync, that the cases don't need.)"""
    block = key_cache.shape[1]
    s, kk, vv = slots, k, v
    if key_cache.dtype != k.dtype:  # float8
        m = torch.finfo(key_cache.dtype).max
        kk = (kk.float() / k_scale).clamp(-m, m).to(key_cache.dtype).view(torch.uint8)
        vv = (vv.float() / v_scale).clamp(-m, m).to(key_cache.dtype).view(torch.uint8)
        key_cache, value_cache = key_cache.view(torch.uint8), value_cache.view(torch.uint8)
    key_cache[s // block, s % block] = kk
    value_cache[s // block, s % block] = vv


def prologue_case(device, tokens, kv_cache_dtype, heads=(32, 8), head_dim=128):
    """rope.qk_norm_rope_and_cache_ on a Qwen3-8B-like layer: q, k, v views of one bfloat16
    projection output, a 16-token-block paged cache with room for 4096 tokens."""
    hq, hk = heads
    dtype = torch.bfloat16
    qkv = torch.randn(tokens, (hq + 2 * hk) * head_dim, device=device, dtype=dtype)
    q = qkv[:, : hq * head_dim].unflatten(1, (hq, head_dim))
    k = qkv[:, hq * head_dim : (hq + hk) * head_dim].unflatten(1, (hk, head_dim))
    v = qkv[:, (hq + hk) * head_dim :].unflatten(1, (hk, head_dim))
    # Every timed call rewrites q and k in place: weights that keep them steady.
    wq, wk = (steady_norm_weight(head_dim, device=device) for _ in range(2))
    table = rope_ext.cos_sin_cache(4096, head_dim, device=device)
    positions = torch.randint(0, 4096, (tokens,), device=device)
    fp8 = kv_cache_dtype != "auto"
    cdt = torch.float8_e4m3fn if fp8 else dtype
    key_cache = torch.zeros(256, 16, hk, head_dim, device=device).to(cdt)
    value_cache = torch.zeros(256, 16, hk, head_dim, device=device).to(cdt)
    slots = torch.randperm(256 * 16, device=device)[:tokens]  # no padding (eager_prologue)
    ks = torch.tensor([0.5], device=device) if fp8 else None
    vs = torch.tensor([0.25], device=device) if fp8 else None
    eps = 1e-6
    kw = dict(eps=eps, kv_cache_dtype=kv_cache_dtype, k_scale=ks, v_scale=vs)
    compiled = torch.compile(eager_prologue, dynamic=False, fullgraph=True)  # one graph, or an error

    def unfused():
        rope_ext.qk_norm_rope_(q, k, wq, wk, positions, table, eps=eps)
        store_paged(k, v, key_cache, value_cache, slots, ks, vs)

    es, ces = 2, key_cache.element_size()
    nbytes = (2 * tokens * (hq + hk) * head_dim * es + tokens * hk * head_dim * es
              + 2 * tokens * hk * head_dim * ces + tokens * head_dim * 4 + 2 * tokens * 8)
    args = (q, k, v, positions, table, wq, wk, key_cache, value_cache, slots, eps, ks, vs)
    rows = {
        "rope_ext": lambda: rope_ext.qk_norm_rope_and_cache_(q, k, v, positions, table, wq, wk,
                                                             key_cache, value_cache, slots, **kw),
        "unfused rope_ext": unfused,
        # out of place: q, k, v (views of qkv) only read, new ones written
        "rope_ext out of place": lambda: rope_ext.qk_norm_rope_and_cache(
            q, k, v, positions, table, wq, wk, key_cache, value_cache, slots, **kw),
        # vLLM's signature (packed qkv in, new q, k, v out), on the out-of-place op
        "compat.vllm.fused_qknorm_rope_cache": lambda: fused_qknorm_rope_cache(
            qkv, wq, wk, table, positions, slots, key_cache, value_cache, hq, hk, head_dim,
            head_dim, eps, 0.0, kv_cache_dtype, ks, vs),
        "eager": lambda: eager_prologue(*args),
        "torch.compile": lambda: compiled(*args),
        "copy": copy_limit(nbytes, device),
    }
    cache = "float8_e4m3fn" if fp8 else "bfloat16"
    return (f"qk_norm_rope_and_cache_ bfloat16, {cache} cache", [tokens, hq, hk, head_dim],
            nbytes, rows)


def cases(device, quick):
    if quick:
        return [shift_case(device, 32, 2, 64, 64, "auto"), shift_case(device, 32, 2, 64, 64, "fp8"),
                offset_case(device, 16, 4, 128, 64, torch.float32),
                prologue_case(device, 4, "fp8", heads=(4, 2), head_dim=64)]
    prologue = [prologue_case(device, t, c) for c in ("auto", "fp8") for t in (1, 16, 128, 512)]
    return prologue + [
        shift_case(device, 4096, 8, 128, 128, "auto"),
        shift_case(device, 4096, 8, 128, 128, "fp8"),
        shift_case(device, 64, 8, 128, 128, "auto"),  # a few slots: the per-call cost
        offset_case(device, 1024, 16, 512, 64, torch.bfloat16),
        offset_case(device, 1024, 16, 512, 64, torch.float32),
    ]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--quick", action="store_true", help="tiny cases, few repeats (a smoke run)")
    p.add_argument("--out", default=None, help="output directory (default bench/results/, or a "
                   "temporary directory for --quick)")
    p.add_argument("--repeat", type=int, default=None, help="timed blocks per row (default 11; 3 quick)")
    p.add_argument("--threads", type=int, default=1, help="CPU threads (torch.set_num_threads; "
                   "default 1, as bench/bench.py: timings per core, steady on a shared machine)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    # outputs (the out-of-place rows) from recycled memory, as in a long-running process
    allocator = malloc.pin_thresholds() if args.device == "cpu" else "torch's CUDA caching allocator"
    if args.device == "cuda" and not torch.cuda.is_available():
        print("serving_bench: --device cuda needs a GPU (torch.cuda.is_available() is False)")
        return 2
    repeat = args.repeat or (3 if args.quick else 11)
    min_block_s = 0.002 if args.quick else (0.005 if args.device == "cuda" else 0.02)
    out = args.out or (os.path.join(tempfile.gettempdir(), "rope_bench") if args.quick else RESULTS)
    stem = f"serving-{args.device}" + ("-quick" if args.quick else "")
    torch.manual_seed(0)
    # Every prologue case compiles eager_prologue for its own shapes, all built before timing:
    # one graph each, past torch's default limit of 8 per function (where it would fall back to
    # eager under the compiled row's name).
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    clock = clock_for(args.device)
    results, errors = [], []
    for name, shape, nbytes, rows in cases(args.device, args.quick):
        plan = measure_interleaved(rows, clock, repeat=repeat, min_block_s=min_block_s,
                                   on_error=lambda row, e: errors.append(f"{name} / {row}: {e!r}"))
        med = {row: median(p["times"]) for row, p in plan.items()}
        for row, p in plan.items():
            results.append({
                "case": name, "shape": shape, "row": row, "bytes": nbytes,
                "times_s": p["times"], "median_s": med[row],
                "p25_s": quantile(p["times"], 0.25), "p75_s": quantile(p["times"], 0.75),
                "gbps": nbytes / med[row] / 1e9,
                "vs_rope_ext": med[row] / med["rope_ext"] if "rope_ext" in med else None,
            })
    doc = {"meta": {"device": args.device, "torch": torch.__version__,
                    "rope_ext": rope_ext.__version__, "backend": rope_ext.backend(args.device),
                    "threads": torch.get_num_threads(), "machine": platform.machine(),
                    "cpu_isa": rope_ext.cpu_isa() if args.device == "cpu" else None,
                    "repeat": repeat, "min_block_ms": min_block_s * 1e3, "clock": clock.name,
                    "allocator": allocator},
           "results": results, "errors": errors}
    lines = ["| case | shape | row | median (us) | GB/s | time / rope_ext |", "|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['case']} | {r['shape']} | {r['row']} | {r['median_s'] * 1e6:.1f} | "
                     f"{r['gbps']:.2f} | {r['vs_rope_ext']:.2f}x |")
    table = "\n".join(lines)
    print(table)
    for e in errors:
        print("error:", e)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, stem + ".json"), "w") as f:
        json.dump(doc, f, indent=1)
    with open(os.path.join(out, stem + ".md"), "w") as f:
        m = doc["meta"]
        isa = f", {m['cpu_isa']} kernels" if m["cpu_isa"] else ""
        f.write(f"# Serving ops ({m['device']}, {m['backend']}{isa}, {m['threads']} threads, torch "
                f"{m['torch']})\n\nBytes: the least traffic each case needs; copy: a contiguous "
                f"copy of as many bytes.\n\n{table}\n")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
