"""rope_ext.apply_rope on the layouts models hand it, against x.clone() (the floor of any call that
returns a new tensor), the eager reference math and torch.compile of it.

x holds B = 1 sequence of S tokens, 32 heads of 128 dims, with float32 tables of the S positions
broadcast over the heads, in three layouts:
  (B, S, H, D) contiguous with tables (1, S, 1, D/2)  - a projection's output viewed as heads
  (B, H, S, D) viewed from (B, S, H, D) memory         - transformers' q after .transpose(1, 2)
  (B, H, S, D) contiguous with tables (1, 1, S, D/2)  - after .contiguous(), or made that way
The last has a table row's 32 rows S rows apart; the CPU kernels walk them as one token's heads
where the call stays in the cache (docs/cpu-performance.md "Heads far apart"). The eager and
compiled rows run the reference math (bench equivalents.apply) on the contiguous (B, H, S, D) x.
Rows of one (S, dtype) are timed round-robin in blocks; the table gives medians and each row's
time over the clone floor.
"""

import torch

import rope_ext

from .. import equivalents as eq

NAME = "layouts"
ABOUT = ("rope_ext.apply_rope on (B, S, H, D), transposed (B, H, S, D) and contiguous (B, H, S, D) x "
         "against x.clone(), eager and torch.compile")
ORDER = 25

HEADS, HEAD_DIM = 32, 128
SEQS = (16, 256, 2048)
FLOOR = "floor: x.clone()"
EAGER = "eager reference, (B, H, S, D) contiguous"
COMPILED = "torch.compile(reference), (B, H, S, D) contiguous"


def _rows(S, dtype, compile_too):
    g = torch.Generator().manual_seed(S)
    bshd = torch.randn(1, S, HEADS, HEAD_DIM, generator=g).to(dtype)
    bhsd = bshd.transpose(1, 2).contiguous()
    angles = torch.rand(S, HEAD_DIM // 2, generator=g) * S
    cos, sin = angles.cos(), angles.sin()
    c_s, s_s = cos[None, :, None], sin[None, :, None]  # (1, S, 1, D/2)
    c_h, s_h = cos[None, None], sin[None, None]  # (1, 1, S, D/2)
    rows = {
        FLOOR: lambda: bhsd.clone(),
        "(B, S, H, D)": lambda: rope_ext.apply_rope(bshd, c_s, s_s),
        "(B, H, S, D) transposed view": lambda: rope_ext.apply_rope(bshd.transpose(1, 2), c_h, s_h),
        "(B, H, S, D) contiguous": lambda: rope_ext.apply_rope(bhsd, c_h, s_h),
        EAGER: lambda: eq.apply(bhsd, c_h, s_h),
    }
    if compile_too:
        torch._dynamo.reset()  # a fresh cache per shape: no recompile limit reached
        compiled = torch.compile(eq.apply, dynamic=False, fullgraph=True)
        rows[COMPILED] = lambda: compiled(bhsd, c_h, s_h)
    return rows


def run(ctx):
    from . import seq_rows
    from ..cases import DTYPES

    notes = ["--quick: no torch.compile row"] if ctx.quick else []
    out = []
    with torch.inference_mode():
        for dtype_name in ctx.dtypes:
            for S in SEQS[:1] if ctx.quick else SEQS:
                out += seq_rows(ctx, NAME, S, dtype_name,
                                _rows(S, DTYPES[dtype_name], not ctx.quick), FLOOR, "x_floor",
                                ref_key="floor_s")
    return {"rows": out, "notes": notes}


def table(result):
    from . import seq_table

    return seq_table(result["rows"], "x (1 sequence, 32 heads of 128)", "x_floor", "x clone",
                     lambda call: call if call in (FLOOR, EAGER, COMPILED)
                     else f"rope_ext.apply_rope, {call}")
