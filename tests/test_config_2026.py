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
    # an odd rotary_dim would be a table of d - 1 columns where the module splits d + 1
    with pytest.raises(ValueError, match="'proportional': rotary_dim \\(the head dim\\) must be even, got 9"):
        rope_ext.cos_sin_cache(16, 9, scaling={"rope_type": "proportional"})
    with pytest.raises(ValueError, match="must be even, got 9"):
        rope_ext.RotaryEmbedding(10, rotary_dim=9, max_position=16, scaling={"rope_type": "proportional"})


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


# ---- keys that set RoPE by layer, and other spellings of the sizes ----

def test_modernbert_global_and_local_bases():
    # ModernBERT's files (and its transformers 4 config) give global and local attention layers
    # their own base: the file's, per layer type, never the 10000 default
    file = {"model_type": "modernbert", "hidden_size": 768, "num_attention_heads": 12,
            "max_position_embeddings": 8192, "global_rope_theta": 160000.0,
            "local_rope_theta": 10000.0}
    with pytest.raises(ValueError, match="global_rope_theta, local_rope_theta\\); pass layer_type="):
        rope_kwargs_from_config(file)
    with pytest.raises(ValueError, match="layer_type 'chunked' is not one of"):
        rope_kwargs_from_config(file, layer_type="chunked")
    assert rope_kwargs_from_config(file, layer_type="full_attention")["base"] == 160000.0
    assert rope_kwargs_from_config(file, layer_type="sliding_attention")["base"] == 10000.0
    # A rope_scaling serves both kinds of layer, each at its base (as transformers 4 and 5 build
    # them; the local layers once dropped it)
    scaled = dict(file, rope_scaling={"rope_type": "linear", "factor": 4.0})
    for layer_type, base in (("full_attention", 160000.0), ("sliding_attention", 10000.0)):
        k = rope_kwargs_from_config(scaled, layer_type=layer_type)
        assert k["base"] == base and k["scaling"]["factor"] == 4.0
    del file["local_rope_theta"]  # the local layers then take the global base
    assert rope_kwargs_from_config(file, layer_type="sliding_attention")["base"] == 160000.0


def test_longrope_in_the_rope_scaling_spelling_reads_the_top_level_length():
    # transformers 4 reads original_max_position_embeddings from the top level only (else
    # max_position_embeddings), whatever the dict holds; rope_parameters take the dict's
    n = 4
    scaling = {"short_factor": [1.0] * n, "long_factor": [4.0] * n, "factor": 2.0,
               "original_max_position_embeddings": 128}
    file = {"model_type": "llama", "head_dim": 2 * n, "max_position_embeddings": 256,
            "rope_scaling": dict(scaling, rope_type="longrope")}
    got = rope_kwargs_from_config(file)["scaling"]
    assert got["original_max_position_embeddings"] == 256 and got["factor"] == 2.0
    file = dict(file, original_max_position_embeddings=64)
    got = rope_kwargs_from_config(file)["scaling"]
    assert got["original_max_position_embeddings"] == 64 and got["factor"] == 4.0
    v5 = {"model_type": "llama", "head_dim": 2 * n, "max_position_embeddings": 256,
          "rope_parameters": dict(scaling, rope_type="longrope")}
    assert rope_kwargs_from_config(v5)["scaling"]["original_max_position_embeddings"] == 128


@pytest.mark.parametrize("model_type,key", [("zamba2", "attention_head_dim"), ("zamba", "attention_head_dim"),
                                            ("jetmoe", "kv_channels")])
def test_head_dim_under_another_name(model_type, key):
    file = {"model_type": model_type, "hidden_size": 2560, "num_attention_heads": 32, key: 160,
            "max_position_embeddings": 4096}
    assert rope_kwargs_from_config(file)["head_dim"] == 160


def test_a_config_objects_attribute_map_is_read():
    class Config:  # as transformers' config classes: an alias the dict form does not carry
        attribute_map = {"head_dim": "my_head_size"}

        def to_dict(self):
            return {"model_type": "some_new_model", "hidden_size": 256, "num_attention_heads": 4,
                    "my_head_size": 96, "max_position_embeddings": 64}

    assert rope_kwargs_from_config(Config())["head_dim"] == 96


def test_bases_per_layer_index():
    file = {"model_type": "granitemoe_swa", "head_dim": 64, "max_position_embeddings": 64,
            "rope_theta": 1e4, "layer_rope_theta": [1e6, 1e6, 1e6]}
    assert rope_kwargs_from_config(file)["base"] == 1e6  # every layer's base
    file["layer_rope_theta"] = [1e6, 1e4, 1e6]
    with pytest.raises(ValueError, match="layer_rope_theta gives the layers different bases"):
        rope_kwargs_from_config(file)


def test_scaling_in_some_layers_only():
    file = {"model_type": "molmo2", "head_dim": 64, "max_position_embeddings": 64,
            "num_hidden_layers": 3, "rope_scaling": {"rope_type": "linear", "factor": 4.0},
            "rope_scaling_layers": [0, 1, 2]}
    assert rope_kwargs_from_config(file)["scaling"]["factor"] == 4.0  # every layer scaled
    file["rope_scaling_layers"] = [0]
    with pytest.raises(ValueError, match="rope_scaling_layers applies the linear scaling to layers \\[0\\] only"):
        rope_kwargs_from_config(file)
    del file["rope_scaling"]  # no scaling: every layer's table is the same
    assert rope_kwargs_from_config(file)["scaling"] is None


@pytest.mark.parametrize("method", ["forward", "forward_"])
def test_module_refuses_heads_of_another_size(method):
    m = rope_ext.RotaryEmbedding(80, max_position=16)
    q, k, pos = torch.randn(3, 2, 160), torch.randn(3, 1, 80), torch.arange(3)
    with pytest.raises(ValueError, match="query of shape \\[3, 2, 160\\] must have the module's head_dim = 80"):
        getattr(m, method)(q, k, pos)
    with pytest.raises(ValueError, match="key of shape \\[3, 1, 160\\]"):
        getattr(m, method)(k.new_zeros(3, 2, 80), q[:, :1], pos)


def test_chatglm_rotates_half_of_each_head():
    # ChatGLM2/3's and GLM-4's own code (no transformers class): interleaved pairs of the first
    # kv_channels // 2 dims, base 10000, seq_length positions; a rope_ratio other than 1 is
    # refused (the base's multiplier in ChatGLM3's and GLM-4's code, the positions' divisor in
    # ChatGLM2-32K's: the file does not say which), where it once built base 10000 on the head
    chatglm3_6b = {"model_type": "chatglm", "hidden_size": 4096, "num_attention_heads": 32,
                   "kv_channels": 128, "multi_query_group_num": 2, "num_layers": 28,
                   "seq_length": 8192}
    k = rope_kwargs_from_config(chatglm3_6b)
    assert (k["head_dim"], k["rotary_dim"], k["interleaved"], k["max_position"], k["base"]) == (
        128, 64, True, 8192, 10000.0)
    glm4_9b_chat = dict(chatglm3_6b, num_layers=40, seq_length=131072, rope_ratio=500)
    with pytest.raises(ValueError, match="rope_ratio 500: ChatGLM3's and GLM-4's code multiply"):
        rope_kwargs_from_config(glm4_9b_chat, max_position=131072)


def test_differing_partial_rotary_factors_are_refused():
    # transformers 5 keeps a rope_parameters' own factor while its attention classes (StableLM's,
    # Phi's) read the top level's: a file giving two is refused, not read one way silently
    file = {"model_type": "stablelm", "hidden_size": 512, "num_attention_heads": 4,
            "max_position_embeddings": 4096, "partial_rotary_factor": 0.5,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                "partial_rotary_factor": 0.25}}
    with pytest.raises(ValueError, match="partial_rotary_factor is 0.5 but rope_parameters holds "
                                         "partial_rotary_factor 0.25; keep one"):
        rope_kwargs_from_config(file)
    file["rope_parameters"]["partial_rotary_factor"] = 0.5
    assert rope_kwargs_from_config(file)["rotary_dim"] == 64


@pytest.mark.parametrize("config, kind", [
    ({"model_type": "bert", "hidden_size": 768, "num_attention_heads": 12,
      "max_position_embeddings": 512}, "absolute"),
    ({"model_type": "esm", "hidden_size": 320, "num_attention_heads": 20,
      "max_position_embeddings": 1026, "position_embedding_type": "absolute"}, "absolute"),
    ({"model_type": "opt", "hidden_size": 768, "num_attention_heads": 12,
      "max_position_embeddings": 2048}, "absolute"),
    ({"model_type": "bloom", "hidden_size": 64, "n_head": 4}, "ALiBi"),
])
def test_a_config_without_rope_is_refused(config, kind):
    with pytest.raises(ValueError, match=f"uses {kind} position embeddings, not RoPE"):
        rope_kwargs_from_config(config)
    # the same model family with RoPE (ESM-2, Jina's XLM-RoBERTa) is read
    rotary = dict(config, position_embedding_type="rotary", num_attention_heads=4,
                  hidden_size=64, max_position_embeddings=64)
    assert rope_kwargs_from_config(rotary)["head_dim"] == 16
