"""Drop-in use: RotaryEmbedding.from_config and a Llama-style attention block.

The eager block below is written the way transformers' Llama code does it (rotate_half, cos/sin
of cat(freqs, freqs), partial rotary by slicing), with its own inv_freq formulas; rope_ext must
give the same outputs when it replaces that rotary code.
"""

import math
import re
import types

import pytest
import torch
import torch.nn.functional as F

import rope_ext
from conftest import TOL


# ---- the eager reference: rotate_half RoPE as in hub model code --------------------------------


def eager_inv_freq(dim, base, scaling):
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    attention = 1.0
    kind = None if scaling is None else scaling.get("rope_type", scaling.get("type"))
    if kind == "llama3":
        f, lo, hi, m = (scaling[k] for k in ("factor", "low_freq_factor", "high_freq_factor",
                                             "original_max_position_embeddings"))
        wavelen = 2 * math.pi / inv
        out = torch.where(wavelen > m / lo, inv / f, inv)
        smooth = (m / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * out / f + smooth * out
        medium = ~(wavelen < m / hi) * ~(wavelen > m / lo)
        inv = torch.where(medium, smoothed, out)
    elif kind == "yarn":
        f, m = scaling["factor"], scaling["original_max_position_embeddings"]

        def corr(rot):
            return (dim * math.log(m / (rot * 2 * math.pi))) / (2 * math.log(base))

        low, high = max(math.floor(corr(32)), 0), min(math.ceil(corr(1)), dim - 1)
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low), 0, 1)
        extrapolation = 1 - ramp
        inv = (inv / f) * (1 - extrapolation) + inv * extrapolation
        attention = 0.1 * math.log(f) + 1.0
    elif kind == "linear":
        inv = inv / scaling["factor"]
    return inv, attention


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def eager_rope(q, k, position_ids, rot_dim, base, scaling):
    """q, k: [B, H, S, D]; position_ids [B, S]. cos/sin in float64, stored in q's dtype."""
    inv, attention = eager_inv_freq(rot_dim, base, scaling)
    freqs = position_ids.double()[..., None] * inv  # [B, S, rot/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos = (emb.cos() * attention).to(torch.float32).to(q.dtype).unsqueeze(1)
    sin = (emb.sin() * attention).to(torch.float32).to(q.dtype).unsqueeze(1)
    q_rot, q_pass = q[..., :rot_dim], q[..., rot_dim:]
    k_rot, k_pass = k[..., :rot_dim], k[..., rot_dim:]
    q_rot = q_rot * cos + rotate_half(q_rot) * sin
    k_rot = k_rot * cos + rotate_half(k_rot) * sin
    return torch.cat((q_rot, q_pass), -1), torch.cat((k_rot, k_pass), -1)


class Attention(torch.nn.Module):
    """A small Llama-style attention block (GQA, causal SDPA). `rope` is None for the eager
    rotate_half path, or a rope_ext.RotaryEmbedding."""

    def __init__(self, config, rope=None):
        super().__init__()
        c = config
        self.heads, self.kv_heads = c["num_attention_heads"], c["num_key_value_heads"]
        self.head_dim = c.get("head_dim") or c["hidden_size"] // self.heads
        self.rot_dim = int(self.head_dim * c.get("partial_rotary_factor", 1.0))
        self.base, self.scaling = c["rope_theta"], c.get("rope_scaling")
        self.q_proj = torch.nn.Linear(c["hidden_size"], self.heads * self.head_dim, bias=False)
        self.k_proj = torch.nn.Linear(c["hidden_size"], self.kv_heads * self.head_dim, bias=False)
        self.v_proj = torch.nn.Linear(c["hidden_size"], self.kv_heads * self.head_dim, bias=False)
        self.o_proj = torch.nn.Linear(self.heads * self.head_dim, c["hidden_size"], bias=False)
        self.rope = rope

    def forward(self, x, position_ids):
        B, S, _ = x.shape
        q = self.q_proj(x).view(B, S, self.heads, self.head_dim)
        k = self.k_proj(x).view(B, S, self.kv_heads, self.head_dim)
        v = self.v_proj(x).view(B, S, self.kv_heads, self.head_dim).transpose(1, 2)
        if self.rope is None:
            q, k = eager_rope(q.transpose(1, 2), k.transpose(1, 2), position_ids, self.rot_dim, self.base,
                              self.scaling)
        else:
            q, k = self.rope(q, k, position_ids)  # [B, S, H, D] with positions [B, S]
            q, k = q.transpose(1, 2), k.transpose(1, 2)
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(B, S, -1))


def llama_config(**over):
    c = dict(model_type="llama", hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
             rope_theta=10000.0, max_position_embeddings=256, rope_scaling=None)
    c.update(over)
    return c


SCALINGS = {
    "none": None,
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "yarn": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "linear": {"type": "linear", "factor": 2.0},
}


@pytest.mark.parametrize("scaling", SCALINGS)
@pytest.mark.parametrize("partial", [1.0, 0.5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_llama_block_same_outputs(scaling, partial, dtype):
    cfg = llama_config(rope_scaling=SCALINGS[scaling], rope_theta=500000.0 if scaling == "llama3" else 10000.0)
    if partial != 1.0:
        cfg["partial_rotary_factor"] = partial
    eager = Attention(cfg).to(dtype)
    ours = Attention(cfg, rope=rope_ext.RotaryEmbedding.from_config(cfg)).to(dtype)
    ours.load_state_dict(eager.state_dict())
    assert ours.rope.cos_sin_cache.dtype == torch.float32 and not ours.rope.interleaved
    x = torch.randn(2, 12, 128, dtype=dtype)
    position_ids = torch.stack([torch.arange(12), torch.arange(100, 112)])  # prefill; a decode offset
    with torch.no_grad():
        want, got = eager(x, position_ids), ours(x, position_ids)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(got, want, rtol=rtol * 4, atol=atol * 4)


def test_llama_block_in_place_path_and_grads():
    cfg = llama_config(rope_scaling=SCALINGS["llama3"])
    rope = rope_ext.RotaryEmbedding.from_config(cfg)
    q = torch.randn(2, 12, 4, 32, requires_grad=True)
    k = torch.randn(2, 12, 2, 32, requires_grad=True)
    pos = torch.randint(0, 256, (2, 12))
    q2, k2 = rope(q, k, pos)
    eq, ek = eager_rope(q.transpose(1, 2), k.transpose(1, 2), pos, 32, 10000.0, SCALINGS["llama3"])
    torch.testing.assert_close(q2, eq.transpose(1, 2), rtol=1e-6, atol=1e-6)
    (q2 * torch.arange(32.0)).sum().backward()
    qa = q.detach().clone().requires_grad_()
    ea, _ = eager_rope(qa.transpose(1, 2), k.detach().transpose(1, 2), pos, 32, 10000.0, SCALINGS["llama3"])
    (ea.transpose(1, 2) * torch.arange(32.0)).sum().backward()
    torch.testing.assert_close(q.grad, qa.grad, rtol=1e-6, atol=1e-6)
    qi, ki = q.detach().clone(), k.detach().clone()
    rope.forward_(qi, ki, pos)
    assert torch.equal(qi, q2.detach()) and torch.equal(ki, k2.detach())


# ---- from_config ---------------------------------------------------------------------------


def as_object(d):
    return types.SimpleNamespace(**d)


@pytest.mark.parametrize("wrap", [dict, as_object])
def test_from_config_llama31(wrap):
    sc = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192, "rope_type": "llama3"}
    cfg = wrap(dict(model_type="llama", hidden_size=4096, num_attention_heads=32, rope_theta=500000.0,
                    max_position_embeddings=1024, rope_scaling=sc))
    m = rope_ext.RotaryEmbedding.from_config(cfg)
    assert (m.head_dim, m.rotary_dim, m.max_position, m.base, m.interleaved) == (128, 128, 1024, 500000.0, False)
    want = rope_ext.cos_sin_cache(1024, 128, base=500000.0, scaling=sc)
    assert torch.equal(m.cos_sin_cache, want)
    inv, _ = eager_inv_freq(128, 500000.0, sc)
    ang = torch.arange(1024, dtype=torch.float64)[:, None] * inv
    torch.testing.assert_close(m.cos_sin_cache, torch.cat((ang.cos(), ang.sin()), -1).float(), rtol=0, atol=0)


def test_from_config_head_dim_and_partial_rotary():
    # Gemma-like: head_dim given explicitly, not hidden_size / heads.
    m = rope_ext.RotaryEmbedding.from_config(dict(hidden_size=3072, num_attention_heads=16, head_dim=256,
                                                  max_position_embeddings=64))
    assert (m.head_dim, m.rotary_dim) == (256, 256)
    # Phi-2-like: partial_rotary_factor 0.4 of 80.
    m = rope_ext.RotaryEmbedding.from_config(dict(model_type="phi", hidden_size=2560, num_attention_heads=32,
                                                  partial_rotary_factor=0.4, max_position_embeddings=64))
    assert (m.head_dim, m.rotary_dim, m.interleaved) == (80, 32, False)
    # GPT-J: rotary_dim 64 of 256, interleaved.
    m = rope_ext.RotaryEmbedding.from_config(dict(model_type="gptj", hidden_size=4096, num_attention_heads=16,
                                                  rotary_dim=64, max_position_embeddings=64))
    assert (m.head_dim, m.rotary_dim, m.interleaved) == (256, 64, True)
    # GPT-NeoX: rotary_pct.
    m = rope_ext.RotaryEmbedding.from_config(dict(model_type="gpt_neox", hidden_size=512, num_attention_heads=8,
                                                  rotary_pct=0.25, max_position_embeddings=64))
    assert (m.head_dim, m.rotary_dim, m.interleaved) == (64, 16, False)


@pytest.mark.parametrize(
    "extra, override, want",
    [
        ({"model_type": "llama"}, None, False),
        ({"model_type": "mistral"}, None, False),
        ({"model_type": "qwen2"}, None, False),
        ({"model_type": "gptj", "rotary_dim": 16}, None, True),
        ({"model_type": "chatglm"}, None, True),
        ({"model_type": "cohere"}, None, True),
        ({"model_type": "deepseek_v3", "rope_interleave": True}, None, True),
        ({"model_type": "deepseek_v3", "qk_rope_head_dim": 16}, None, True),  # the class default
        ({"model_type": "deepseek_v3", "qk_rope_head_dim": 16, "rope_interleave": False}, None, False),
        ({"model_type": "llama4_text"}, None, True),
        ({"model_type": "qwen3_vl_text"}, None, False),
        ({"model_type": "gptj", "rotary_dim": 16, "rope_interleaved": False}, None, False),
        ({"model_type": "llama"}, True, True),
        ({"model_type": "gptj", "rotary_dim": 16}, False, False),
    ],
)
def test_from_config_layout(extra, override, want):
    cfg = dict(hidden_size=64, num_attention_heads=2, max_position_embeddings=16, **extra)
    assert rope_ext.RotaryEmbedding.from_config(cfg, interleaved=override).interleaved is want


def test_from_config_fills_original_length_and_rope_parameters():
    # yarn without original_max_position_embeddings: the config's max_position_embeddings.
    cfg = dict(hidden_size=64, num_attention_heads=2, max_position_embeddings=512, rope_theta=10000.0,
               rope_scaling={"type": "yarn", "factor": 4.0})
    m = rope_ext.RotaryEmbedding.from_config(cfg, max_position=2048)
    want = rope_ext.cos_sin_cache(2048, 32, scaling={"type": "yarn", "factor": 4.0,
                                                     "original_max_position_embeddings": 512})
    assert torch.equal(m.cos_sin_cache, want) and m.max_position == 2048
    assert cfg["rope_scaling"] == {"type": "yarn", "factor": 4.0}  # the config is not modified
    # transformers >= 5: theta and scaling in rope_parameters.
    cfg = dict(hidden_size=64, num_attention_heads=2, max_position_embeddings=64,
               rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1000.0})
    m = rope_ext.RotaryEmbedding.from_config(cfg)
    assert m.base == 1000.0
    assert torch.equal(m.cos_sin_cache, rope_ext.cos_sin_cache(64, 32, base=1000.0,
                                                               scaling={"rope_type": "linear", "factor": 2.0}))
    m = rope_ext.RotaryEmbedding.from_config(dict(cfg, rope_parameters={"rope_type": "default", "rope_theta": 5.0}))
    assert m.scaling is None and m.base == 5.0
    # yarn with the original length but no factor: max_position_embeddings / original.
    cfg = dict(hidden_size=64, num_attention_heads=2, max_position_embeddings=4096,
               rope_scaling={"rope_type": "yarn", "original_max_position_embeddings": 1024})
    m = rope_ext.RotaryEmbedding.from_config(cfg, max_position=64)
    assert m.scaling["factor"] == 4.0
    assert m.cos_sin_cache[0, 0].item() == pytest.approx(0.1 * math.log(4.0) + 1, rel=1e-7)


def test_from_config_phi3_longrope():
    # Phi-3-mini-128k: top-level original length 4096 of 131072 -> factor 32,
    # attention sqrt(1 + ln 32 / ln 4096) = sqrt(1 + 5/12); long factors for the full table.
    short, long_ = [1.0 + 0.01 * i for i in range(48)], [1.0 + 0.5 * i for i in range(48)]
    cfg = dict(model_type="phi3", hidden_size=3072, num_attention_heads=32, max_position_embeddings=131072,
               original_max_position_embeddings=4096, rope_theta=10000.0,
               rope_scaling={"type": "longrope", "short_factor": short, "long_factor": long_})
    m = rope_ext.RotaryEmbedding.from_config(cfg, max_position=8192)
    a = math.sqrt(1 + 5 / 12)
    assert m.cos_sin_cache[0, 0].item() == pytest.approx(a, rel=1e-7)
    w = [10000.0 ** (-2 * i / 96) / long_[i] for i in range(48)]
    pos = 5000
    for i in (0, 7, 47):
        assert m.cos_sin_cache[pos, i].item() == pytest.approx(a * math.cos(pos * w[i]), abs=1e-6)
    # Serving only the original length: the short factors, same attention factor.
    m = rope_ext.RotaryEmbedding.from_config(cfg, max_position=4096)
    w = [10000.0 ** (-2 * i / 96) / short[i] for i in range(48)]
    assert m.cos_sin_cache[1000, 3].item() == pytest.approx(a * math.cos(1000 * w[3]), abs=1e-6)


def test_from_config_qwen2vl_mrope():
    cfg = dict(model_type="qwen2_vl", hidden_size=1536, num_attention_heads=12, max_position_embeddings=512,
               rope_theta=1000000.0, rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]})
    m = rope_ext.RotaryEmbedding.from_config(cfg)
    assert (m.head_dim, m.rotary_dim, m.mrope_section, m.interleaved) == (128, 128, [16, 24, 24], False)
    q = torch.randn(2, 5, 12, 128, requires_grad=True)
    k = torch.randn(2, 5, 2, 128)
    pos3 = torch.randint(0, 512, (3, 2, 5))
    q2, k2 = m(q, k, pos3)
    # Qwen2-VL's formulation: cos of cat(freqs, freqs) per component, sections picked from it.
    inv = 1.0 / (1e6 ** (torch.arange(0, 128, 2, dtype=torch.float64) / 128))
    emb = torch.cat([pos3.double()[..., None] * inv] * 2, -1)
    split = [16, 24, 24] * 2
    cos = torch.cat([c[i % 3] for i, c in enumerate(emb.cos().split(split, -1))], -1).unsqueeze(-2)
    sin = torch.cat([s[i % 3] for i, s in enumerate(emb.sin().split(split, -1))], -1).unsqueeze(-2)
    want = q.double() * cos + rotate_half(q.double()) * sin
    torch.testing.assert_close(q2.double(), want, rtol=1e-5, atol=1e-5)
    q2.sum().backward()
    assert q.grad is not None
    # The in-place path agrees, and text-only positions are plain RoPE.
    qi, ki = q.detach().clone(), k.clone()
    m.forward_(qi, ki, pos3)
    assert torch.equal(qi, q2.detach()) and torch.equal(ki, k2)
    p = pos3[0]
    assert torch.equal(m(q, k, p.expand(3, 2, 5))[0], m(q, k, p)[0])


@pytest.mark.parametrize(
    "cfg, match",
    [
        (dict(max_position_embeddings=16), "needs head_dim, or hidden_size and num_attention_heads"),
        (dict(hidden_size=100, num_attention_heads=3, max_position_embeddings=16), "not a multiple"),
        (dict(head_dim=64), "no max_position_embeddings"),
        (dict(head_dim=64, max_position_embeddings=16, rope_scaling={"type": "mrope", "mrope_section": [8, 8, 8]}),
         "mrope_section must be 3 ints"),
    ],
)
def test_from_config_errors(cfg, match):
    with pytest.raises(ValueError, match=match):
        rope_ext.RotaryEmbedding.from_config(cfg)


@pytest.mark.parametrize("section", [[2.9, 3, 3], ["2", 3, 3], [True, 3, 4], [2, 3.5, 2.5]])
def test_module_mrope_section_entries_are_ints(section):
    # never truncated to ints (2.9 -> 2) or converted ('2', True): the error shows what was passed
    with pytest.raises(ValueError, match=re.escape(f"mrope_section must be 3 ints >= 0 summing to "
                                                   f"rotary_dim/2 = 8, got {section!r}")):
        rope_ext.RotaryEmbedding(16, mrope_section=section)
    assert rope_ext.RotaryEmbedding(16, mrope_section=(2, 3, 3)).mrope_section == [2, 3, 3]


def test_readme_examples_run():
    """Every Python block of the README runs, in order, in one namespace (nothing downloaded)."""
    import os
    import re

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "README.md")) as f:
        blocks = re.findall(r"```python\n(.*?)```", f.read(), re.S)
    assert any("RotaryEmbedding.from_config" in b for b in blocks), "README lost its from_config example"
    namespace = {}
    for i, code in enumerate(blocks):
        exec(compile(code, f"README.md:python-block-{i}", "exec"), namespace)
