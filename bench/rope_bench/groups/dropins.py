"""Each rope_ext.compat drop-in against its peer's own code, at decode and prefill sizes: one
row per drop-in and size, with the peer's time over the drop-in's (above 1: the drop-in is
faster).

- Every drop-in of rope_bench/dropins.py (vLLM, FlashInfer, SGLang, flash-attn, transformers)
  against the peer's code as tests/peers.py re-implements it, on T = 1, 8 and 2048 tokens of
  q (T, 32, 128), k (T, 8, 128), under inference_mode as serving stacks run.
- compat.transformers functions against transformers' own (imported from its modeling
  modules) at the sizes their attention layers call them with, under no_grad, as transformers'
  generate runs: Llama's apply_rotary_pos_emb (q (batch, heads, seq, head_dim), k with a quarter
  of the heads, cos/sin (batch, seq, head_dim) in q's dtype), Llama 4's complex-table
  apply_rotary_emb (q (batch, seq, heads, head_dim), complex64 freqs_cis (batch, seq,
  head_dim / 2)) and DINOv3's apply_rotary_pos_emb (q and k (batch, heads, 5 + patches,
  head_dim) seen from (batch, tokens, heads, head_dim), a class and 4 register tokens unrotated,
  cos/sin (patches, head_dim) in q's dtype).
- The training stacks' drop-ins (Transformer Engine sbhd and packed thd, the Llama reference,
  gpt-fast) as training steps, forward + backward, at 4 sequences of 4096 tokens, 32 heads
  (8 kv heads) of 128, against the peers' PyTorch code as tests/training_peers.py re-implements
  it, and against rope_ext's op on the same tensors with its tables ready ("x op": the drop-in's
  time over the op's; the drop-in's own work is building the tables and picking the path).
"""

import torch

from .. import dropins
from ..cases import DTYPES, Inputs, Shape

NAME = "dropins"
ABOUT = ("each drop-in against its peer's own code at decode and prefill sizes (x peer: the "
         "peer's time over the drop-in's, above 1 the drop-in is faster; x op: the drop-in's "
         "time over rope_ext's op on the same tensors, above 1 the drop-in costs more)")
ORDER = 20

SIZES = {"decode-1": 1, "decode-8": 8, "prefill-2048": 2048}
# (batch, seq, heads, kv heads, head_dim) of the training steps; the quick run's is tiny.
TRAIN_SIZE = ("train 4x4096", (4, 4096, 32, 8, 128))
TRAIN_QUICK = ("train 2x16", (2, 16, 4, 2, 32))
# (batch, q heads, seq, head_dim) of transformers' calls: Llama's and Llama 4's at decode and
# prefill sizes, DINOv3's (ViT-L's heads) at 14x14 and 32x32 patches.
HF_SIZES = ((1, 32, 1, 128), (1, 8, 1, 64), (4, 32, 1, 128), (1, 32, 256, 128))
VIT_SIZES = ((1, 16, 196, 64), (1, 16, 1024, 64))


def _angles(S, D):
    pos = torch.arange(100, 100 + S, dtype=torch.float32)
    return pos[:, None] * (1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.float32) / D)))


def _llama(shape, dtype, g):
    B, H, S, D = shape
    q = torch.randn(B, H, S, D, generator=g).to(dtype)
    k = torch.randn(B, max(1, H // 4), S, D, generator=g).to(dtype)
    emb = torch.cat([_angles(S, D)] * 2, dim=-1)
    cos = emb.cos()[None].expand(B, S, D).to(dtype)  # as LlamaRotaryEmbedding returns them
    sin = emb.sin()[None].expand(B, S, D).to(dtype)
    return q, k, cos, sin


def _llama4(shape, dtype, g):
    B, H, S, D = shape
    q = torch.randn(B, S, H, D, generator=g).to(dtype)
    k = torch.randn(B, S, max(1, H // 4), D, generator=g).to(dtype)
    angles = _angles(S, D)[None].expand(B, S, D // 2)  # as Llama4TextRotaryEmbedding's polar
    return q, k, torch.polar(torch.ones_like(angles), angles)


def _dinov3(shape, dtype, g):
    B, H, P, D = shape
    q, k = (torch.randn(B, 5 + P, H, D, generator=g).to(dtype).transpose(1, 2) for _ in "qk")
    emb = torch.cat([_angles(P, D)] * 2, dim=-1)
    return q, k, emb.cos().to(dtype), emb.sin().to(dtype)


# (compat function, transformers' module and function, inputs, sizes)
HF_PAIRS = (("apply_rotary_pos_emb", "llama.modeling_llama", "apply_rotary_pos_emb", _llama,
             HF_SIZES),
            ("apply_rotary_emb_complex", "llama4.modeling_llama4", "apply_rotary_emb", _llama4,
             HF_SIZES),
            ("apply_rotary_pos_emb_patches", "dinov3_vit.modeling_dinov3_vit",
             "apply_rotary_pos_emb", _dinov3, VIT_SIZES))


def _hf_pair(pair, shape, dtype):
    """(ours, theirs) callables of compat.transformers vs transformers' own function."""
    import importlib

    from rope_ext.compat import transformers as compat_hf

    name, module, function, inputs, _ = pair
    theirs = getattr(importlib.import_module(f"transformers.models.{module}"), function)
    ours = getattr(compat_hf, name)
    args = inputs(shape, dtype, torch.Generator().manual_seed(shape[2]))
    return lambda: ours(*args), lambda: theirs(*args)


def _record(ctx, rows, what, size, dtype_name, mode, timed, ours, theirs, peer):
    if ours not in timed or theirs not in timed:
        return
    a, b = timed[ours]["median_s"], timed[theirs]["median_s"]
    rows.append({"drop_in": what, "size": size, "dtype": dtype_name, "mode": mode, "peer": peer,
                 "median_s": a, "peer_median_s": b, "x_peer": b / a,
                 "times_s": timed[ours]["times_s"], "peer_times_s": timed[theirs]["times_s"]})


def _training(ctx, dtype_name, rows, notes):
    """The training pairs of dropins.TRAINING_PAIRS at one size, each timed (ours, the peer's,
    rope_ext's op) interleaved; the tensors of one pair are freed before the next is built."""
    loaded, status = dropins.load_training()
    if loaded is None:
        notes.append(f"training drop-ins: {status}")
        return
    size_name, size = TRAIN_QUICK if ctx.quick else TRAIN_SIZE
    for make in dropins.TRAINING_PAIRS:
        try:
            what, peer, ours, theirs, op = make(size, DTYPES[dtype_name], *loaded,
                                                torch.Generator().manual_seed(0))
        except Exception as e:  # noqa: BLE001 - one missing pair is a note
            notes.append(f"{size_name} {dtype_name}: {make.__name__[1:]} skipped "
                         f"({type(e).__name__}: {e})")
            continue
        timed = ctx.time({"ours": ours, "theirs": theirs, "op": op}, f"dropins {what} {size_name}")
        del ours, theirs, op
        _record(ctx, rows, "compat." + what, size_name, dtype_name, "train (fwd+bwd)", timed,
                "ours", "theirs", f"tests/training_peers.py {peer}")
        if rows and rows[-1]["drop_in"] == "compat." + what and "op" in timed:
            r = rows[-1]
            r["op_median_s"] = timed["op"]["median_s"]
            r["x_op"] = r["median_s"] / r["op_median_s"]
            r["op_times_s"] = timed["op"]["times_s"]
            print(f"  dropins {what} {size_name} {dtype_name}: {r['x_peer']:.2f}x peer, "
                  f"{r['x_op']:.2f}x the op's time", flush=True)


def run(ctx):
    rows, notes = [], []
    loaded, status = dropins.load()
    if loaded is None:
        notes.append(f"drop-ins against tests/peers.py: {status}")
    for dtype_name in ctx.dtypes:
        dt = DTYPES[dtype_name]
        if loaded is not None:
            for size, T in (list(SIZES.items())[:1] if ctx.quick else SIZES.items()):
                with torch.inference_mode():
                    i = Inputs(Shape(T, 32, 8, 128), dt, "cpu")
                    made, fns = [], {}
                    for make in dropins.PAIRS:
                        try:
                            op, _, _, ours, peer_name, theirs = make(i, *loaded)
                        except Exception as e:  # noqa: BLE001 - one missing pair is a note
                            notes.append(f"{size} {dtype_name}: {make.__name__[1:]} skipped "
                                         f"({type(e).__name__}: {e})")
                            continue
                        fns[op], fns[op + " peer"] = ours, theirs
                        made.append((op, peer_name))
                    timed = ctx.time(fns, f"dropins {size} {dtype_name}")
                for op, peer_name in made:
                    _record(ctx, rows, "compat." + op, size, dtype_name, "inference_mode", timed,
                            op, op + " peer", dropins.peer_label(peer_name))
                print(f"  dropins {size:13s} {dtype_name:8s} " + ", ".join(
                    f"{r['drop_in'][len('compat.'):]} {r['x_peer']:.2f}x" for r in rows
                    if r["size"] == size and r["dtype"] == dtype_name), flush=True)
        for pair in HF_PAIRS:
            for shape in pair[4][:1] if ctx.quick else pair[4]:
                try:
                    ours, theirs = _hf_pair(pair, shape, dt)
                except Exception as e:  # noqa: BLE001 - transformers missing: a note
                    notes.append(f"transformers' own {pair[1]}.{pair[2]}: {type(e).__name__}: {e}")
                    break
                size = "q " + "x".join(map(str, shape))
                with torch.no_grad():
                    timed = ctx.time({"ours": ours, "theirs": theirs}, f"dropins hf {size}")
                _record(ctx, rows, f"compat.transformers.{pair[0]}", size, dtype_name, "no_grad",
                        timed, "ours", "theirs", f"transformers.models.{pair[1]}.{pair[2]}")
                if rows and rows[-1]["size"] == size:
                    print(f"  dropins hf {pair[0]} {size} {dtype_name}: "
                          f"{rows[-1]['x_peer']:.2f}x", flush=True)
        _training(ctx, dtype_name, rows, notes)
    return {"rows": rows, "notes": notes}


def table(result):
    from . import md_table, us, x

    return md_table(
        ["drop-in", "size", "dtype", "mode", "us", "peer us", "x peer", "rope op us", "x op",
         "peer's code"],
        [[f"`{r['drop_in']}`", r["size"], r["dtype"], r["mode"], us(r["median_s"]),
          us(r["peer_median_s"]), x(r["x_peer"]), us(r.get("op_median_s")), x(r.get("x_op")),
          r["peer"]] for r in result["rows"]])
