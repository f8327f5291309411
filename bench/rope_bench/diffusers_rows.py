"""diffusers rows: the attention RoPE of each family rope_ext.integrations.diffusers patches, at
the token counts of a real generation, rope_ext's drop-in against diffusers' own eager function
and torch.compile of it (`python bench/diffusers_bench.py`, see --help; needs diffusers).

A row times what one attention layer's processor does: the RoPE of its query and of its key,
with diffusers' layouts and table dtypes (float32 tables, bfloat16 activations by default).
Tables are built once per row, as a model builds them once per forward for all its layers; their
values are random angles written as the family's pos-embed writes them (each entry twice per
pair where diffusers does), which is all that the cost depends on.

The prologue rows (*_prologue) time the q/k norms and the RoPE together: diffusers' norm modules
and RoPE against the patched processor's fused statements (rope_ext.integrations._dit_prologue),
as FLUX.1 (per-head RMSNorm, image and text apart, then joined) and Wan (RMSNorm across the heads
of a token) run them. flux_block times a whole FLUX.1 attention (projections, norms, RoPE,
attention, output projections), patched against unpatched, eager only. Every row but the block
also times a copy of its activations (the floor: what producing new q and k costs at least).
"""

import argparse
import collections
import datetime
import json
import math
import os
import platform
import sys

import torch

from . import malloc
from .timing import clock_for, measure_interleaved, median

RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results")

# family -> (label, the generation it models)
SHAPES = {
    "flux": ("FLUX.1 / Chroma", "1024x1024: 4096 image + 512 text tokens, 24 heads of 128"),
    "flux2": ("FLUX.2", "1024x1024: 4096 image + 512 text tokens, 48 heads of 128"),
    "wan": ("Wan 2.1 1.3B", "480x832, 81 frames: 21x30x52 = 32760 tokens, 12 heads of 128"),
    "hunyuan_video": ("HunyuanVideo", "544x960, 33 frames: 9x34x60 = 18360 video tokens, 24 heads of 128"),
    "qwenimage": ("Qwen-Image", "1024x1024: 4096 image tokens, 24 heads of 128"),
    "ltx": ("LTX-Video", "768x512, 121 frames: 16x16x24 = 6144 tokens, 32 heads of 64 (flat)"),
    "cogvideox": ("CogVideoX 5B", "480x720, 49 frames: 13x30x45 = 17550 video tokens (+226 text), 48 heads of 64"),
    "lumina2": ("Lumina-Image 2.0", "1024x1024: 4096 + 256 tokens, 24 query / 8 key heads of 96"),
    "cogview4": ("CogView4", "1024x1024: 4096 image tokens (+128 text), 32 heads of 128"),
    "mochi": ("Mochi", "480x848, 31 frames: 6x30x53 = 9540 tokens, 24 heads of 128"),
    "flux_prologue": ("FLUX.1 norm+RoPE", "1024x1024: 4096 image + 512 text tokens, 24 heads of 128, "
                                          "RMSNorm per head"),
    "wan_prologue": ("Wan 2.1 14B norm+RoPE", "480x832, 17 frames: 5x30x52 = 7800 tokens, 40 heads of 128, "
                                              "RMSNorm across the heads"),
    "flux_block": ("FLUX.1 attention", "512x512: 1024 image + 512 text tokens, 24 heads of 128, the whole "
                                       "double-stream attention, eager"),
}
QUICK_DIVISOR = 16  # --quick: token counts / 16, a smoke run


def _angles(tokens, pairs):
    return torch.rand(tokens, pairs, dtype=torch.float64) * 100


def _interleaved(tokens, dim):
    a = _angles(tokens, dim // 2)
    return a.cos().repeat_interleave(2, -1).float(), a.sin().repeat_interleave(2, -1).float()


def _halves(tokens, dim):
    a = _angles(tokens, dim // 2)
    return torch.cat((a.cos(), a.cos()), -1).float(), torch.cat((a.sin(), a.sin()), -1).float()


def _complex(*shape):
    return torch.polar(torch.ones(*shape), torch.rand(*shape) * 100)


def _pair(fn):
    """(q, k, *args) -> (fn(q, *args), fn(k, *args)): one layer's query and key."""
    return lambda q, k, *args: (fn(q, *args), fn(k, *args))


# ours, theirs: callables taking args, doing one layer's work; activations: how many of the first
# args the work produces new copies of (the floor copies them; 0: no floor); compiled: whether
# torch.compile of both is timed too.
Row = collections.namedtuple("Row", "ours theirs args activations compiled", defaults=(2, True))


def _norms(count, width, dtype):
    """`count` inference RMSNorms (torch.nn's, as FLUX and Wan build them) of random weights."""
    norms = [torch.nn.RMSNorm(width, eps=1e-6, dtype=dtype).requires_grad_(False) for _ in range(count)]
    for norm in norms:
        norm.weight.uniform_(0.5, 1.5)
    return norms


def _flux_prologue(x, n, emb, rd):
    """FluxAttnProcessor's q/k norms and RoPE (24 heads of 128): diffusers' statements against
    the patched processor's (_dit_prologue.REWRITES["FluxAttnProcessor"])."""
    from rope_ext.integrations import _dit_prologue as prologue

    txt, img = n(512), n(4096)
    norm_q, norm_k, norm_added_q, norm_added_k = _norms(4, 128, x(1).dtype)

    def theirs(query, key, encoder_query, encoder_key, cos, sin):
        query, key = norm_q(query), norm_k(key)
        encoder_query, encoder_key = norm_added_q(encoder_query), norm_added_k(encoder_key)
        query, key = torch.cat([encoder_query, query], dim=1), torch.cat([encoder_key, key], dim=1)
        return (emb.apply_rotary_emb(query, (cos, sin), sequence_dim=1),
                emb.apply_rotary_emb(key, (cos, sin), sequence_dim=1))

    def ours(query, key, encoder_query, encoder_key, cos, sin):
        text, image = encoder_query.shape[1], query.shape[1]
        query, key = prologue.norm_rope(
            (norm_q, norm_k), query, key, rd.apply_rotary_emb,
            prologue.rows((cos, sin), text, image, "image"), sequence_dim=1)
        encoder_query, encoder_key = prologue.norm_rope(
            (norm_added_q, norm_added_k), encoder_query, encoder_key, rd.apply_rotary_emb,
            prologue.rows((cos, sin), text, image, "text"), sequence_dim=1)
        return torch.cat([encoder_query, query], dim=1), torch.cat([encoder_key, key], dim=1)

    return Row(ours, theirs, (x(1, img, 24, 128), x(1, img, 24, 128), x(1, txt, 24, 128),
                              x(1, txt, 24, 128)) + _interleaved(txt + img, 128), activations=4)


def _wan_prologue(x, n, wan, rd):
    """WanAttnProcessor's q/k norms (RMSNorm of the flat projection) and RoPE, 40 heads of 128."""
    from rope_ext.integrations import _dit_prologue as prologue

    S, H = n(7800), 40
    norm_q, norm_k = _norms(2, H * 128, x(1).dtype)
    a = _angles(S, 64)
    cos = a.cos().repeat_interleave(2, -1).float().view(1, S, 1, 128)
    sin = a.sin().repeat_interleave(2, -1).float().view(1, S, 1, 128)

    def theirs(query, key, cos, sin):
        query, key = norm_q(query).unflatten(2, (H, -1)), norm_k(key).unflatten(2, (H, -1))
        return wan(query, cos, sin), wan(key, cos, sin)

    def ours(query, key, cos, sin):
        query, key = query.unflatten(2, (H, -1)), key.unflatten(2, (H, -1))
        return prologue.norm_rope_across_heads((norm_q, norm_k), query, key, rd.apply_rotary_emb_wan, cos, sin)

    return Row(ours, theirs, (x(1, S, H * 128), x(1, S, H * 128), cos, sin))


def _flux_block(x, n):
    """A FLUX.1 double-stream attention (3072 wide, 24 heads of 128) with diffusers' processor
    and with the patched one, on the same module."""
    from diffusers.models.transformers.transformer_flux import FluxAttention, FluxAttnProcessor

    from rope_ext.integrations import diffusers as rdi

    txt, img = n(512), n(1024)
    attn = FluxAttention(query_dim=3072, heads=24, dim_head=128, added_kv_proj_dim=3072, out_dim=3072,
                         context_pre_only=False, bias=True, eps=1e-6).to(x(1).dtype).requires_grad_(False)
    patched, plain = rdi.FluxAttnProcessor(), FluxAttnProcessor()

    def call(processor):
        return lambda hidden, context, cos, sin: processor(attn, hidden, context, image_rotary_emb=(cos, sin))

    return Row(call(patched), call(plain), (x(1, img, 3072), x(1, txt, 3072)) + _interleaved(txt + img, 128),
               activations=0, compiled=False)


def row(family, dtype, scale):
    """The Row of `family` (one layer's work) in `dtype`, token counts divided by `scale`."""
    built = _build(family, dtype, scale)
    return built if isinstance(built, Row) else Row(*built)


def _build(family, dtype, scale):
    """A Row, or (ours, theirs, args) of a RoPE row: the q and k RoPE of one layer."""
    from diffusers.models import attention_processor
    from diffusers.models import embeddings as emb
    from diffusers.models.transformers import transformer_ltx, transformer_qwenimage, transformer_wan

    from rope_ext.compat import diffusers as rd
    from rope_ext.integrations import diffusers as rdi

    def n(tokens):
        return max(8, tokens // scale)

    def x(*shape):
        return torch.randn(*shape, dtype=dtype)

    if family == "flux_prologue":
        return _flux_prologue(x, n, emb, rd)
    if family == "wan_prologue":
        return _wan_prologue(x, n, _wan_rope(transformer_wan, rdi), rd)
    if family == "flux_block":
        return _flux_block(x, n)
    if family in ("flux", "flux2"):
        S, H = n(4608), 24 if family == "flux" else 48
        cs = _interleaved(S, 128)
        return (_pair(lambda t, c, s: rd.apply_rotary_emb(t, (c, s), sequence_dim=1)),
                _pair(lambda t, c, s: emb.apply_rotary_emb(t, (c, s), sequence_dim=1)),
                (x(1, S, H, 128), x(1, S, H, 128)) + cs)
    if family == "wan":
        S = n(32760)
        a = _angles(S, 64)
        cos = a.cos().repeat_interleave(2, -1).float().view(1, S, 1, 128)
        sin = a.sin().repeat_interleave(2, -1).float().view(1, S, 1, 128)
        return (_pair(rd.apply_rotary_emb_wan), _pair(_wan_rope(transformer_wan, rdi)),
                (x(1, S, 12, 128), x(1, S, 12, 128), cos, sin))
    if family == "hunyuan_video":
        S, T = n(18360), 256
        cs = _interleaved(S, 128)

        def hunyuan(apply):
            return lambda t, c, s: apply(t[:, :-T], (c, s), sequence_dim=1)
        return (_pair(hunyuan(rd.apply_rotary_emb)), _pair(hunyuan(emb.apply_rotary_emb)),
                (x(1, S + T, 24, 128), x(1, S + T, 24, 128)) + cs)
    if family == "qwenimage":
        S = n(4096)
        return (_pair(lambda t, f: rd.apply_rotary_emb_qwen(t, f, use_real=False)),
                _pair(lambda t, f: transformer_qwenimage.apply_rotary_emb_qwen(t, f, use_real=False)),
                (x(1, S, 24, 128), x(1, S, 24, 128), _complex(S, 64)))
    if family == "ltx":
        S = n(6144)
        a = _angles(S, 1024)
        cs = (a.cos().repeat_interleave(2, -1).float()[None], a.sin().repeat_interleave(2, -1).float()[None])
        return (_pair(lambda t, c, s: rd.apply_rotary_emb_ltx(t, (c, s))),
                _pair(lambda t, c, s: transformer_ltx.apply_rotary_emb(t, (c, s))),
                (x(1, S, 2048), x(1, S, 2048)) + cs)
    if family == "cogvideox":
        S, T = n(17550), 226
        cs = _interleaved(S, 64)

        def cog(apply):
            return lambda t, c, s: apply(t[:, :, T:], (c, s))
        return (_pair(cog(rd.apply_rotary_emb)), _pair(cog(emb.apply_rotary_emb)),
                (x(1, 48, S + T, 64), x(1, 48, S + T, 64)) + cs)
    if family == "lumina2":
        S = n(4352)
        f = _complex(1, S, 48)
        return (lambda q, k, f: (rd.apply_rotary_emb(q, f, use_real=False),
                                 rd.apply_rotary_emb(k, f, use_real=False)),
                lambda q, k, f: (emb.apply_rotary_emb(q, f, use_real=False),
                                 emb.apply_rotary_emb(k, f, use_real=False)),
                (x(1, S, 24, 96), x(1, S, 8, 96), f))
    if family == "cogview4":
        S, T = n(4096), 128
        cs = _halves(S, 128)

        def cv4(apply):
            return lambda t, c, s: apply(t[:, :, T:], (c, s), use_real_unbind_dim=-2)
        return (_pair(cv4(rd.apply_rotary_emb)), _pair(cv4(emb.apply_rotary_emb)),
                (x(1, 32, S + T, 128), x(1, 32, S + T, 128)) + cs)
    if family == "mochi":
        S = n(9540)
        a = _angles(S, 24 * 64).view(S, 24, 64)
        mochi = rdi._diffusers_functions(attention_processor.MochiAttnProcessor2_0, attention_processor,
                                         {"apply_rotary_emb": "apply_rotary_emb_mochi"})["apply_rotary_emb"]
        return (_pair(rd.apply_rotary_emb_mochi), _pair(mochi),
                (x(1, S, 24, 128), x(1, S, 24, 128), a.cos().float(), a.sin().float()))
    raise KeyError(family)


def _wan_rope(transformer_wan, rdi):
    """diffusers' Wan RoPE: the function WanAttnProcessor.__call__ defines."""
    return rdi._diffusers_functions(transformer_wan.WanAttnProcessor, transformer_wan,
                                    {"apply_rotary_emb": "apply_rotary_emb_wan"})["apply_rotary_emb"]


def _same(ours, theirs, args, dtype):
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for a, b in zip(ours(*args), theirs(*args)):
        torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)


def _callables(r):
    """{column: callable of no arguments} of Row r."""
    fns = {"rope_ext": lambda: r.ours(*r.args), "diffusers eager": lambda: r.theirs(*r.args)}
    if r.compiled:
        torch._dynamo.reset()
        compiled = torch.compile(r.theirs, dynamic=False)
        ours_compiled = torch.compile(r.ours, dynamic=False)  # what a compiled patched model runs
        fns["diffusers compiled"] = lambda: compiled(*r.args)
        fns["rope_ext compiled"] = lambda: ours_compiled(*r.args)
    if r.activations:
        fns["copy floor"] = lambda: [a.clone() for a in r.args[:r.activations]]
    return fns


def run(families, dtypes, *, scale, repeat, min_block_s, log=print):
    clock = clock_for("cpu")
    rows = []
    for family in families:
        for dtype_name in dtypes:
            dtype = getattr(torch, dtype_name)
            torch.manual_seed(0)
            case = row(family, dtype, scale)
            _same(case.ours, case.theirs, case.args, dtype)
            fns = _callables(case)
            errors = {}
            plan = measure_interleaved(fns, clock, repeat=repeat, min_block_s=min_block_s,
                                       on_error=lambda name, e: errors.__setitem__(name, repr(e)[:200]))
            med = {name: median(p["times"]) for name, p in plan.items()}
            r = {"family": family, "label": SHAPES[family][0], "shape": SHAPES[family][1],
                 "dtype": dtype_name, "median_s": med, "errors": errors,
                 "bytes": sum(a.numel() * a.element_size() for a in case.args if isinstance(a, torch.Tensor))}
            for peer in ("diffusers eager", "diffusers compiled"):
                if "rope_ext" in med and peer in med:
                    r[f"x vs {peer}"] = med[peer] / med["rope_ext"]
            if "rope_ext compiled" in med and "diffusers compiled" in med:
                r["compiled x vs diffusers compiled"] = med["diffusers compiled"] / med["rope_ext compiled"]
            rows.append(r)
            log(_line(r))
    return rows


HEADER = (f"| {'family':<21} | {'dtype':<8} | {'rope_ext ms':>11} | {'eager ms':>9} | "
          f"{'compiled ms':>11} | {'floor ms':>8} | {'x eager':>7} | {'x compiled':>10} | {'both compiled':>13} |")


def _line(r):
    def ms(name):
        v = r["median_s"].get(name)
        if v is None:
            return "failed" if name in r["errors"] else "-"
        return f"{v * 1e3:.3f}"

    def ratio(key):
        v = r.get(key)
        return "-" if v is None else f"{v:.2f}"
    return (f"| {r['label']:<21} | {r['dtype']:<8} | {ms('rope_ext'):>11} | {ms('diffusers eager'):>9} | "
            f"{ms('diffusers compiled'):>11} | {ms('copy floor'):>8} | {ratio('x vs diffusers eager'):>7} | "
            f"{ratio('x vs diffusers compiled'):>10} | {ratio('compiled x vs diffusers compiled'):>13} |")


def markdown(rows):
    lines = [HEADER, "|" + "|".join("-" * (len(c)) for c in HEADER.split("|")[1:-1]) + "|"]
    lines += [_line(r) for r in rows]
    lines.append("")
    lines.append("x eager, x compiled: diffusers' eager and compiled time over rope_ext's eager time; "
                 "both compiled: diffusers compiled over rope_ext compiled (a compiled patched model); "
                 "floor: a copy of the activations (new q and k, at least).")
    lines.append("")
    lines += [f"- {SHAPES[f][0]}: {SHAPES[f][1]}" for f in dict.fromkeys(r["family"] for r in rows)]
    lines += ["", "```", *plot(rows), "```"]
    return "\n".join(lines) + "\n"


def plot(rows, per_doubling=4):
    """A text plot of each row's speedups over diffusers eager (#) and compiled (=), on a log2
    scale (per_doubling characters per 2x; `|` marks 1x): one with the table, no plotting
    library needed."""
    left = 2 * per_doubling  # room for slowdowns down to 1/4
    out = [f"{'':<21}  rope_ext's speedup, log2 scale ({per_doubling} characters per 2x; | = 1x)"]
    for r in rows:
        for key, mark, what in (("x vs diffusers eager", "#", "eager"),
                                ("x vs diffusers compiled", "=", "compiled")):
            v = r.get(key)
            if v is None:
                continue
            n = max(round(math.log2(v) * per_doubling), -left)
            bar = " " * left + "|" + mark * n if n >= 0 else " " * (left + n) + mark * -n + "|"
            out.append(f"{r['label']:<21}  {bar:<{left + 33}} {v:.2f}x {what}")
    return out


def _loadavg():
    try:
        return round(os.getloadavg()[0], 2)  # a busy machine makes every row slower, not alike
    except OSError:
        return None


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--families", default=",".join(SHAPES), help=", ".join(SHAPES))
    p.add_argument("--dtypes", default="bfloat16", help="bfloat16,float32 (default bfloat16)")
    p.add_argument("--quick", action="store_true", help=f"token counts / {QUICK_DIVISOR}, few repeats")
    p.add_argument("--repeat", type=int, default=None, help="timed blocks per callable (default 7; 2 quick)")
    p.add_argument("--min-block-ms", type=float, default=50.0)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads first")
    p.add_argument("--out", default=RESULTS, help="output directory (default bench/results/)")
    p.add_argument("--stem", default="diffusers-cpu", help="file names STEM.json/.md")
    args = p.parse_args(argv)
    try:
        import diffusers
    except ImportError:
        print("diffusers is not installed: no diffusers rows", file=sys.stderr)
        return 1
    families = [f for f in args.families.split(",") if f]
    unknown = set(families) - set(SHAPES)
    if unknown:
        p.error(f"unknown families {sorted(unknown)}; choose from {', '.join(SHAPES)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    allocator = malloc.pin_thresholds()  # as bench/bench.py does: rows independent of order
    repeat = args.repeat or (2 if args.quick else 7)
    print(HEADER)
    rows = run(families, args.dtypes.split(","), scale=QUICK_DIVISOR if args.quick else 1,
               repeat=repeat, min_block_s=args.min_block_ms / 1e3)
    import rope_ext

    doc = {"when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "torch": torch.__version__, "diffusers": diffusers.__version__,
           "rope_ext": rope_ext.__version__, "cpu_isa": rope_ext.cpu_isa(),
           "threads": torch.get_num_threads(), "machine": platform.machine(),
           "allocator": allocator, "loadavg_1min": _loadavg(),
           "quick": args.quick, "repeat": repeat, "rows": rows}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, args.stem + ".json"), "w") as f:
        json.dump(doc, f, indent=1)
    with open(os.path.join(args.out, args.stem + ".md"), "w") as f:
        f.write(markdown(rows))
    print(f"wrote {args.stem}.json and {args.stem}.md under {os.path.relpath(args.out)}")
    return 0
