"""Hugging Face models patched with rope_ext.integrations.transformers.patch against the same
models unpatched: greedy generate (tokens/s) and a long prefill (ms).

Two small models with random weights from their configs, both 8 layers, hidden 512, 8 heads of
64, 2 KV heads: Llama (patched: RoPE on rope_ext's op) and Qwen3 (patched: its per-head q/k
RMSNorms and RoPE in one fused op), float32 unless --dtypes says otherwise. The unpatched model
is a deep copy made before patching, so both hold the same weights. Per model and block, each of
the four calls runs once: generate 48 new tokens from a 16-token prompt (greedy, no early stop),
then a 2048-token prefill (a forward under no_grad); blocks interleave patched and unpatched,
each block in the other order from the last (so neither side always runs right after the other's
same call), and the table gives medians with each side's interquartile range: a speed-up inside
them is noise.
Whether both models generated the same tokens is recorded (a check that the patch computes what
the model does, not a timing).
"""

import copy

import torch

NAME = "models"
ABOUT = "patched vs unpatched HF Llama and Qwen3: greedy generate tokens/s and prefill ms"
ORDER = 30

CONFIG = dict(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
              num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096)
PROMPT, NEW_TOKENS, PREFILL = 16, 48, 2048


# model -> (transformers' config and model class names, config arguments beyond CONFIG)
MODELS = {"llama": ("LlamaConfig", "LlamaForCausalLM", {}),
          "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 64})}


def _models(model, dtype):
    import transformers

    from rope_ext.integrations import transformers as integration

    config_cls, model_cls, extra = MODELS[model]
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**CONFIG, **extra)
    plain = getattr(transformers, model_cls)(config).to(dtype).eval()
    patched = integration.patch(copy.deepcopy(plain))
    return plain, patched


def run(ctx):
    from ..cases import DTYPES

    dtypes = ctx.dtypes if ctx.dtypes_given else ["float32"]
    repeat = max(3, ctx.repeat // 3)
    prefill = 16 if ctx.quick else PREFILL  # --quick: a smoke run
    new_tokens = 2 if ctx.quick else NEW_TOKENS
    rows, notes = [], []
    for dtype_name, model in ((d, m) for d in dtypes for m in MODELS):
        try:
            plain, patched = _models(model, DTYPES[dtype_name])
        except Exception as e:  # noqa: BLE001 - transformers missing or the patch refused
            notes.append(f"models {model} {dtype_name}: skipped ({type(e).__name__}: {e})")
            continue
        g = torch.Generator().manual_seed(1)
        prompt = torch.randint(3, CONFIG["vocab_size"], (1, PROMPT), generator=g)
        long = torch.randint(3, CONFIG["vocab_size"], (1, prefill), generator=g)
        kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                  pad_token_id=0)
        out = {}

        def generate(m, name):
            def f():
                out[name] = m.generate(prompt, **kw)
            return f

        def forward(m):
            def f():
                with torch.no_grad():
                    m(long)
            return f

        fns = {("generate", "unpatched"): generate(plain, "unpatched"),
               ("generate", "patched"): generate(patched, "patched"),
               ("prefill", "unpatched"): forward(plain),
               ("prefill", "patched"): forward(patched)}
        times = {k: [] for k in fns}
        for f in fns.values():  # warm-up
            f()
        keys = list(fns)
        for b in range(repeat):
            for k in keys if b % 2 == 0 else keys[::-1]:
                times[k].append(ctx.clock.block(fns[k], 1))
        from . import stats

        same = torch.equal(out["unpatched"], out["patched"])
        for what in ("generate", "prefill"):
            u, p = stats(times[(what, "unpatched")]), stats(times[(what, "patched")])
            row = {"model": model, "what": what, "dtype": dtype_name, "unpatched": u,
                   "patched": p, "x_unpatched": u["median_s"] / p["median_s"], "blocks": repeat,
                   "tokens": new_tokens if what == "generate" else prefill}
            if what == "generate":
                row["same_tokens"] = same
                row["unpatched_tok_s"] = new_tokens / u["median_s"]
                row["patched_tok_s"] = new_tokens / p["median_s"]
            rows.append(row)
            print(f"  models {model:6s} {what:8s} {dtype_name:8s} unpatched "
                  f"{u['median_s'] * 1e3:.1f} ms, patched {p['median_s'] * 1e3:.1f} ms "
                  f"({row['x_unpatched']:.3f}x)", flush=True)
    return {"rows": rows, "notes": notes, "config": CONFIG,
            "models": {m: dict(CONFIG, **extra) for m, (_, _, extra) in MODELS.items()}}


def table(result):
    from . import md_table, ms, x

    def spread(s):  # the interquartile range, relative to the median
        return f"{(s['p75_s'] - s['p25_s']) / s['median_s'] * 100:.0f}%"

    lines = []
    for r in result["rows"]:
        if r["what"] == "generate":
            what = f"greedy generate {r['tokens']} tokens: tokens/s"
            u, p = f"{r['unpatched_tok_s']:.1f}", f"{r['patched_tok_s']:.1f}"
            note = "same tokens" if r["same_tokens"] else "TOKENS DIFFER"
        else:
            what = f"prefill {r['tokens']} tokens: ms"
            u, p, note = ms(r["unpatched"]["median_s"]), ms(r["patched"]["median_s"]), ""
        lines.append([r.get("model", "llama"), what, r["dtype"], u, p, x(r["x_unpatched"]),
                      f"{spread(r['unpatched'])} / {spread(r['patched'])}", r["blocks"],
                      note or "-"])
    return md_table(["model", "measure", "dtype", "unpatched", "patched", "patched speed-up",
                     "IQR unpatched / patched", "blocks", "check"], lines)
