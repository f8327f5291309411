"""Benchmark of the RoPE + FP8 quantization ops (FlashInfer's rope_quantize_fp8 family).

    python -m rope_bench.quant --device cpu|cuda [--quick] [--out DIR]   (from bench/)

Per case, timed round-robin (timing.py), every row counting the same bytes (the inputs read once,
the float8 outputs written once: the least traffic the work needs):
  - rope_ext: the fused op (torch.ops.rope.quantize_fp8, or ..._append_paged_kv_cache);
  - unfused eager: the same math as separate PyTorch ops (gather the table rows, rotate in
    float32, scale, clamp, convert, per part; the paged case then index_put_ into the caches);
  - copy: out.copy_(x) of a buffer of the same bytes (read + write), the memory limit.
Prints a table and writes quant_<device>.json.
"""

import argparse
import json
import os
import sys

import torch

from . import timing

# (name, nnz, q_heads, kv_heads (0: MLA), rope_dim, no_rope_dim)
CASES = {
    "cpu": [("mla-decode", 32, 16, 0, 64, 512), ("mla-prefill", 512, 16, 0, 64, 512),
            ("gqa-prefill", 512, 32, 8, 128, 0), ("gqa-split", 512, 32, 8, 64, 64)],
    "cuda": [("mla-decode", 64, 128, 0, 64, 512), ("mla-prefill", 4096, 128, 0, 64, 512),
             ("gqa-prefill", 8192, 32, 8, 128, 0), ("gqa-split", 8192, 32, 8, 64, 64)],
}
QUICK = {"cpu": CASES["cpu"][:1] + CASES["cpu"][2:3], "cuda": CASES["cuda"][:1]}
FP8 = torch.float8_e4m3fn
PAGE = 16


class Inputs:
    def __init__(self, case, device, dtype=torch.bfloat16):
        name, nnz, hq, hk, r, n = case
        self.name, self.mla = name, hk == 0
        g = torch.Generator(device="cpu").manual_seed(0)
        rnd = lambda *s: torch.randn(*s, generator=g).to(device=device, dtype=dtype)  # noqa: E731
        kshape = (nnz,) if self.mla else (nnz, hk)
        self.parts = (rnd(nnz, hq, r), rnd(*kshape, r), rnd(nnz, hq, n), rnd(*kshape, n))
        self.table = torch.randn(4096, r, generator=g).to(device)
        self.pos = torch.randint(0, 4096, (nnz,), generator=g).to(device)
        self.outs = [torch.empty(p.shape, dtype=FP8, device=device) for p in self.parts]
        # paged: one request over shuffled pages
        pages = (nnz + PAGE - 1) // PAGE
        self.index = (torch.randperm(pages, generator=g).int().to(device),
                      torch.tensor([0, pages], dtype=torch.int32, device=device),
                      torch.zeros(nnz, dtype=torch.int32, device=device),
                      torch.arange(nnz, dtype=torch.int32, device=device))
        if self.mla:
            self.v = None
            self.caches = (torch.zeros(pages, PAGE, n, dtype=FP8, device=device),
                           torch.zeros(pages, PAGE, r, dtype=FP8, device=device))
        else:
            self.v = rnd(nnz, hk, r + n)
            self.caches = tuple(torch.zeros(pages, PAGE, hk, r + n, dtype=FP8, device=device)
                                for _ in range(2))
        self.in_bytes = sum(p.numel() * p.element_size() for p in self.parts)
        self.out_bytes = sum(p.numel() for p in self.parts)
        self.v_bytes = 0 if self.v is None else self.v.numel() * (self.v.element_size() + 1)
        total = self.in_bytes + self.out_bytes
        self.src = torch.empty(total // 2, dtype=torch.uint8, device=device)
        self.dst = torch.empty_like(self.src)


def _codes(x, scale):
    m = torch.finfo(FP8).max
    return (x.float() * scale).clamp(-m, m).to(FP8)


def _rotate(x, rows, half):
    cos, sin = rows[..., :half], rows[..., half:]
    a, b = x[..., :half].float(), x[..., half:].float()
    return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)


def unfused(i, sq=1.0, skv=1.0):
    """The eager PyTorch equivalent: one op per step."""
    q_rope, k_rope, q_nope, k_nope = i.parts
    half = q_rope.shape[-1] // 2
    rows = i.table[i.pos]
    kr = _rotate(k_rope, rows if i.mla else rows[:, None], half)
    return (_codes(_rotate(q_rope, rows[:, None], half), sq), _codes(kr, skv), _codes(q_nope, sq),
            _codes(k_nope, skv))


def unfused_paged(i):
    qr, kr, qn, kn = unfused(i)
    pages, entries = i.index[0][i.index[3] // PAGE].long(), (i.index[3] % PAGE).long()
    if i.mla:
        i.caches[0][pages, entries] = kn
        i.caches[1][pages, entries] = kr
    else:
        i.caches[0][pages, entries] = torch.cat((kr, kn), dim=-1)
        i.caches[1][pages, entries] = _codes(i.v, 1.0)
    return qr, qn


def rows(i):
    """{row name: (bytes, callable)} of one case."""
    op = torch.ops.rope
    q_out = (i.outs[0], i.outs[2])
    n = i.in_bytes + i.out_bytes
    return {
        "rope_ext quantize_fp8": (n, lambda: op.quantize_fp8(*i.parts, i.table, i.pos, *i.outs,
                                                             1.0, 1.0, False)),
        "eager unfused quantize_fp8": (n, lambda: unfused(i)),
        "rope_ext paged append": (n + i.v_bytes, lambda: op.quantize_fp8_append_paged_kv_cache(
            *i.parts, i.v, i.table, i.pos, *q_out, *i.caches, *i.index, PAGE, "NHD", 1.0, 1.0,
            False)),
        "eager unfused paged append": (n + i.v_bytes, lambda: unfused_paged(i)),
        "copy limit": (2 * i.src.numel(), lambda: i.dst.copy_(i.src)),
    }


def run(device, quick=False, repeat=5, min_block_s=0.02):
    clock = timing.clock_for(device)
    results = []
    for case in (QUICK if quick else CASES)[device]:
        i = Inputs(case, device)
        rs = rows(i)
        plan = timing.measure_interleaved({k: f for k, (_, f) in rs.items()}, clock, repeat=repeat,
                                          min_block_s=min_block_s)
        copy_s = timing.median(plan["copy limit"]["times"])
        for name, p in plan.items():
            t = timing.median(p["times"])
            nbytes = rs[name][0]
            results.append({"case": i.name, "shape": list(case[1:]), "row": name,
                            "median_us": t * 1e6, "GB/s": nbytes / t / 1e9,
                            "vs_copy_GB/s": (nbytes / t) / (2 * i.src.numel() / copy_s)})
    return results


def table(results):
    lines = [f"{'case':<12} {'row':<28} {'us':>10} {'GB/s':>8} {'of copy':>8}"]
    for r in results:
        lines.append(f"{r['case']:<12} {r['row']:<28} {r['median_us']:>10.1f} {r['GB/s']:>8.2f} "
                     f"{r['vs_copy_GB/s']:>8.2f}")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", default=None, help="directory for quant_<device>.json")
    args = ap.parse_args(argv)
    import rope_ext  # noqa: F401  (registers the ops)

    results = run(args.device, args.quick, args.repeat)
    print(table(results))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, f"quant_{args.device}.json")
        with open(path, "w") as f:
            json.dump({"device": args.device, "torch": torch.__version__,
                       "threads": torch.get_num_threads(), "results": results}, f, indent=1)
        print(f"wrote {os.path.basename(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
