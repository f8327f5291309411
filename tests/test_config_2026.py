"""The 2026 config forms without transformers (tests/test_config_hf5.py checks them against
transformers 5.23 itself): the `proportional` table against its formula in float64, what
from_config reads from Gemma 4 and DeepSeek-V4 config.json files, and RotaryEmbedding with
rope_dim_offset against the float64 oracle."""

import pytest
import torch

import rope_ext
import rope_oracle
from rope_ext.config import rope_kwargs_from_config


@pytest.mark.parametrize("head_dim,partial,factor", [(512, 0.25, 1.0), (64, 0.5, 2.0), (96, 1.0, 1.0),
                                                     (80, 0.3, 1.0)])
def test_proportional_table(head_dim, partial, factor):
    base = 1e6
    table = rope_ext.cos_sin_cache(300, head_dim, base=base, dtype=torch.float64,
                                   scaling={"rope_type": "proportional",
                                            "partial_rotary_factor": partial, "factor": factor})
    angles = int(partial * head_dim // 2)
    i = torch.arange(head_dim // 2, dtype=torch.float64)
    w = torch.where(i < angles, base ** (-2 * i / head_dim) / factor, 0.0)
    theta = torch.arange(300, dtype=torch.float64)[:, None] * w
    torch.testing.assert_close(table, torch.cat((theta.cos(), theta.sin()), 1), rtol=1e-13, atol=1e-13)
    assert torch.equal(table[:, angles: head_dim // 2], torch.ones(300, head_dim // 2 - angles,
                                                                    dtype=torch.float64))


def test_proportional_errors():
    with pytest.raises(ValueError, match="partial_rotary_factor must be in \\(0, 1\\]"):
        rope_ext.cos_sin_cache(4, 8, scaling={"rope_type": "proportional", "partial_rotary_factor": 2})
    with pytest.raises(ValueError, match="'proportional' does not understand the key 'beta_fast'"):
        rope_ext.cos_sin_cache(4, 8, scaling={"rope_type": "proportional", "beta_fast": 2})


def test_gemma4_file():
    file = {"model_type": "gemma4", "text_config": {"model_type": "gemma4_text", "head_dim": 128,
                                                    "global_head_dim": 256, "num_hidden_layers": 4}}
    full = rope_kwargs_from_config(file, layer_type="full_attention")
    assert (full["head_dim"], full["rotary_dim"], full["base"]) == (256, 256, 1e6)
    assert full["scaling"] == {"rope_type": "proportional", "partial_rotary_factor": 0.25}
    local = rope_kwargs_from_config(file, layer_type="sliding_attention")
    assert (local["head_dim"], local["rotary_dim"], local["base"], local["scaling"]) == (128, 128, 1e4, None)
    # transformers' to_dict form: the global layers' head dim as a per-layer override.
    as_dict = {"model_type": "gemma4_text", "head_dim": 128, "num_hidden_layers": 3,
               "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
               "per_layer_config": {"2": {"head_dim": 384}},
               "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                   "full_attention": {"rope_type": "proportional", "rope_theta": 1e6,
                                                      "partial_rotary_factor": 0.5}}}
    assert rope_kwargs_from_config(as_dict, layer_type="full_attention")["head_dim"] == 384


def test_deepseek_v4_file():
    file = {"model_type": "deepseek_v4", "head_dim": 512, "qk_rope_head_dim": 64,
            "max_position_embeddings": 4096, "compress_rope_theta": 160000.0,
            "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 256}}
    main = rope_kwargs_from_config(file, layer_type="main")
    assert (main["head_dim"], main["rotary_dim"], main["rope_dim_offset"], main["interleaved"],
            main["base"], main["scaling"]) == (512, 64, 448, True, 10000.0, None)
    compress = rope_kwargs_from_config(file, layer_type="compress")
    assert compress["base"] == 160000.0 and compress["scaling"]["rope_type"] == "yarn"
    assert compress["scaling"]["attention_factor"] == 1.0  # V4 does not scale by YaRN's mscale


@pytest.mark.parametrize("interleaved", [False, True])
def test_module_rope_dim_offset(interleaved):
    module = rope_ext.RotaryEmbedding(48, rotary_dim=16, max_position=64, interleaved=interleaved,
                                      rope_dim_offset=32)
    q, k = torch.randn(5, 3, 48), torch.randn(5, 1, 48)
    positions = torch.randint(0, 64, (5,))
    rq, rk = module(q, k, positions)
    cos, sin = rope_oracle.table_for(positions, 16)
    for out, x in ((rq, q), (rk, k)):
        want = x.double().clone()
        want[..., 32:] = rope_oracle.rope(x[..., 32:], cos[:, None], sin[:, None], interleaved)
        torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    q2, k2 = q.clone(), k.clone()
    module.forward_(q2, k2, positions)
    torch.testing.assert_close(q2, rq, rtol=0, atol=0)
    torch.testing.assert_close(k2, rk, rtol=0, atol=0)
    with pytest.raises(ValueError, match="rope_dim_offset must be an int in \\[0, head_dim - rotary_dim\\]"):
        rope_ext.RotaryEmbedding(48, rotary_dim=16, rope_dim_offset=33)
