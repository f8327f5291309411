"""RotaryEmbedding.from_config on real model configs, against what transformers builds.

The configs below are spelled as their config.json files are, across transformers generations
(keys that do not matter to RoPE kept, as in the files). The oracle is transformers 4.57 itself:
its config classes (class defaults, backward-compatibility conversions), its rotary modules
(including the length-dependent updates of dynamic NTK and LongRoPE) and its apply functions.
Forms only transformers 5 reads (`rope_parameters`, per layer type) are compared with the 4.57
spelling of the same model.

Precision: transformers computes inv_freq, the angles and cos/sin in float32; rope_ext computes
them in float64 and rounds once. They differ by transformers' float32 error on the angle theta
(a few float32 ulps of inv_freq from pow, division and the scaling blends, then the product:
|theta| * 2^-20 at most) plus an ulp or two of cos/sin and of the attention factor. So cos/sin
are compared element by element with a * (|theta| * 2^-19 + 2^-21), twice that bound (a: the
attention factor). The rotations are then compared tightly: the same float32 cos/sin fed to
transformers' apply functions and to rope_ext, in float64.
"""

import copy
import math
from dataclasses import dataclass

import pytest
import torch

import rope_ext
from rope_ext.config import rope_kwargs_from_config

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

from transformers import AutoConfig  # noqa: E402
from transformers.models.deepseek_v2 import modeling_deepseek_v2 as hf_dsv2  # noqa: E402
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_dsv3  # noqa: E402
from transformers.models.gemma import modeling_gemma as hf_gemma  # noqa: E402
from transformers.models.gemma3 import modeling_gemma3 as hf_gemma3  # noqa: E402
from transformers.models.gpt_neox import modeling_gpt_neox as hf_neox  # noqa: E402
from transformers.models.gptj import modeling_gptj as hf_gptj  # noqa: E402
from transformers.models.llama import modeling_llama as hf_llama  # noqa: E402
from transformers.models.mistral import modeling_mistral as hf_mistral  # noqa: E402
from transformers.models.phi3 import modeling_phi3 as hf_phi3  # noqa: E402
from transformers.models.phimoe import modeling_phimoe as hf_phimoe  # noqa: E402
from transformers.models.qwen2 import modeling_qwen2 as hf_qwen2  # noqa: E402
from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as hf_qwen25vl  # noqa: E402
from transformers.models.qwen2_vl import modeling_qwen2_vl as hf_qwen2vl  # noqa: E402
from transformers.models.qwen3_vl import modeling_qwen3_vl as hf_qwen3vl  # noqa: E402

# ---- real configs, as their config.json files spell them -----------------------------------

# LongRoPE factor lists have the shape of Phi-3's (rotary_dim/2 numbers, short near 1, long
# growing to tens), not its exact values.
def _short(n):
    return [round(1.0 + 0.002 * i * i / n, 6) for i in range(n)]


def _long(n):
    return [round(1.0 + 60.0 * (i / n) ** 2, 6) for i in range(n)]


def llama2_7b():  # written before rope_theta existed: the class default 10000 applies
    return {"architectures": ["LlamaForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
            "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 11008,
            "max_position_embeddings": 4096, "model_type": "llama", "num_attention_heads": 32,
            "num_hidden_layers": 32, "num_key_value_heads": 32, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
            "rope_scaling": None, "tie_word_embeddings": False, "torch_dtype": "float16",
            "transformers_version": "4.31.0.dev0", "use_cache": True, "vocab_size": 32000}


def llama2_dynamic():  # a dynamic-NTK fine-tune of Llama 2
    return dict(llama2_7b(), rope_scaling={"factor": 2.0, "type": "dynamic"}, rope_theta=10000.0)


def llama2_linear():  # position interpolation, as the 32K Llama-2 fine-tunes ship
    return dict(llama2_7b(), max_position_embeddings=32768, rope_scaling={"factor": 8.0, "type": "linear"})


def llama31_8b():
    return {"architectures": ["LlamaForCausalLM"], "attention_bias": False, "bos_token_id": 128000,
            "eos_token_id": [128001, 128008, 128009], "hidden_act": "silu", "hidden_size": 4096,
            "intermediate_size": 14336, "max_position_embeddings": 131072, "mlp_bias": False,
            "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
            "pretraining_tp": 1, "rms_norm_eps": 1e-05,
            "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192, "rope_type": "llama3"},
            "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
            "transformers_version": "4.43.0.dev0", "use_cache": True, "vocab_size": 128256}


def llama32_1b():
    return dict(llama31_8b(), hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, head_dim=64,
                tie_word_embeddings=True,
                rope_scaling={"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                              "original_max_position_embeddings": 8192, "rope_type": "llama3"})


def mistral_7b():
    return {"architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
            "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
            "max_position_embeddings": 32768, "model_type": "mistral", "num_attention_heads": 32,
            "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
            "sliding_window": 4096, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
            "transformers_version": "4.34.0.dev0", "use_cache": True, "vocab_size": 32000}


def qwen2_7b():
    return {"architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
            "eos_token_id": 151645, "hidden_act": "silu", "hidden_size": 3584, "intermediate_size": 18944,
            "max_position_embeddings": 32768, "max_window_layers": 28, "model_type": "qwen2",
            "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-06,
            "rope_theta": 1000000.0, "sliding_window": 131072, "tie_word_embeddings": False,
            "torch_dtype": "bfloat16", "transformers_version": "4.41.2", "use_cache": True,
            "use_sliding_window": False, "vocab_size": 152064}


def qwen25_7b_yarn():  # the long-context setting Qwen2.5's model card adds to config.json
    return dict(qwen2_7b(), rope_scaling={"factor": 4.0, "original_max_position_embeddings": 32768, "type": "yarn"})


def qwen2_vl_7b():
    return {"architectures": ["Qwen2VLForConditionalGeneration"], "attention_dropout": 0.0, "bos_token_id": 151643,
            "eos_token_id": 151645, "vision_start_token_id": 151652, "hidden_act": "silu", "hidden_size": 3584,
            "intermediate_size": 18944, "max_position_embeddings": 32768, "max_window_layers": 28,
            "model_type": "qwen2_vl", "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4,
            "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": False,
            "torch_dtype": "bfloat16", "transformers_version": "4.41.2", "use_cache": True,
            "use_sliding_window": False,
            "vision_config": {"depth": 32, "embed_dim": 1280, "mlp_ratio": 4, "num_heads": 16, "in_chans": 3,
                              "hidden_size": 3584, "patch_size": 14, "spatial_merge_size": 2,
                              "spatial_patch_size": 14, "temporal_patch_size": 2},
            "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}, "vocab_size": 152064}


def qwen25_vl_7b():
    d = qwen2_vl_7b()
    d.update(model_type="qwen2_5_vl", architectures=["Qwen2_5_VLForConditionalGeneration"],
             rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24], "rope_type": "default"},
             vision_config={"depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420,
                            "num_heads": 16, "in_chans": 3, "out_hidden_size": 3584, "patch_size": 14,
                            "spatial_merge_size": 2, "spatial_patch_size": 14, "window_size": 112,
                            "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2,
                            "temporal_patch_size": 2})
    return d


def qwen3_vl_8b():
    return {"architectures": ["Qwen3VLForConditionalGeneration"], "image_token_id": 151655,
            "model_type": "qwen3_vl",
            "text_config": {"attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643,
                            "dtype": "bfloat16", "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
                            "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 12288,
                            "max_position_embeddings": 262144, "model_type": "qwen3_vl_text",
                            "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8,
                            "rms_norm_eps": 1e-06,
                            "rope_scaling": {"mrope_interleaved": True, "mrope_section": [24, 20, 20],
                                             "rope_type": "default"},
                            "rope_theta": 5000000, "use_cache": True, "vocab_size": 151936},
            "tie_word_embeddings": False, "transformers_version": "4.57.0.dev0", "video_token_id": 151656,
            "vision_config": {"deepstack_visual_indexes": [8, 16, 24], "depth": 27,
                              "hidden_act": "gelu_pytorch_tanh",
                              "hidden_size": 1152, "in_channels": 3, "initializer_range": 0.02,
                              "intermediate_size": 4304, "model_type": "qwen3_vl", "num_heads": 16,
                              "num_position_embeddings": 2304, "out_hidden_size": 4096, "patch_size": 16,
                              "spatial_merge_size": 2, "temporal_patch_size": 2},
            "vision_end_token_id": 151653, "vision_start_token_id": 151652}


def gemma_7b():
    return {"architectures": ["GemmaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
            "bos_token_id": 2, "eos_token_id": 1, "head_dim": 256, "hidden_act": "gelu", "hidden_size": 3072,
            "initializer_range": 0.02, "intermediate_size": 24576, "max_position_embeddings": 8192,
            "model_type": "gemma", "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 16,
            "pad_token_id": 0, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 10000.0,
            "torch_dtype": "bfloat16", "transformers_version": "4.38.0.dev0", "use_cache": True,
            "vocab_size": 256000}


def gemma3_1b():  # text only: every key spelled out
    return {"architectures": ["Gemma3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
            "attn_logit_softcapping": None, "bos_token_id": 2, "cache_implementation": "hybrid",
            "eos_token_id": [1, 106], "final_logit_softcapping": None, "head_dim": 256,
            "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152, "initializer_range": 0.02,
            "intermediate_size": 6912, "max_position_embeddings": 32768, "model_type": "gemma3_text",
            "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1, "pad_token_id": 0,
            "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000,
            "rope_scaling": None, "rope_theta": 1000000, "sliding_window": 512, "sliding_window_pattern": 6,
            "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0", "use_cache": True,
            "vocab_size": 262144}


def gemma3_4b():  # multimodal: text_config written sparse, the class defaults fill it
    return {"architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999,
            "eoi_token_index": 256000, "eos_token_id": [1, 106], "image_token_index": 262144,
            "initializer_range": 0.02, "mm_tokens_per_image": 256, "model_type": "gemma3",
            "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                            "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                            "sliding_window": 1024},
            "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0",
            "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                              "model_type": "siglip_vision_model", "num_attention_heads": 16,
                              "num_hidden_layers": 27, "patch_size": 14, "vision_use_head": False}}


def phi3_mini_128k():
    return {"architectures": ["Phi3ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1,
            "embd_pdrop": 0.0, "eos_token_id": 32000, "hidden_act": "silu", "hidden_size": 3072,
            "initializer_range": 0.02, "intermediate_size": 8192, "max_position_embeddings": 131072,
            "model_type": "phi3", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32,
            "original_max_position_embeddings": 4096, "pad_token_id": 32000, "resid_pdrop": 0.0,
            "rms_norm_eps": 1e-05,
            "rope_scaling": {"long_factor": _long(48), "short_factor": _short(48), "type": "longrope"},
            "rope_theta": 10000.0, "sliding_window": 262144, "tie_word_embeddings": False,
            "torch_dtype": "bfloat16", "transformers_version": "4.40.2", "use_cache": True,
            "vocab_size": 32064}


def phi4_mini():  # partial rotary: 0.75 of 128
    return dict(phi3_mini_128k(), hidden_size=3072, num_attention_heads=24, num_key_value_heads=8,
                partial_rotary_factor=0.75, vocab_size=200064,
                rope_scaling={"long_factor": _long(48), "short_factor": _short(48), "type": "longrope"})


def phi35_moe(short_mscale=1.243163121016122, long_mscale=1.243163121016122):
    return {"architectures": ["PhiMoEForCausalLM"], "attention_bias": True, "hidden_act": "silu",
            "hidden_size": 4096, "intermediate_size": 6400, "max_position_embeddings": 131072,
            "model_type": "phimoe", "num_attention_heads": 32, "num_experts_per_tok": 2,
            "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 16,
            "original_max_position_embeddings": 4096, "rms_norm_eps": 1e-05,
            "rope_scaling": {"long_factor": _long(64), "long_mscale": long_mscale,
                             "original_max_position_embeddings": 4096, "short_factor": _short(64),
                             "short_mscale": short_mscale, "type": "longrope"},
            "rope_theta": 10000.0, "sliding_window": 131072, "tie_word_embeddings": False,
            "torch_dtype": "bfloat16", "transformers_version": "4.43.3", "vocab_size": 32064}


def deepseek_v3():
    return {"architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
            "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3, "hidden_act": "silu",
            "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 18432, "kv_lora_rank": 512,
            "max_position_embeddings": 163840, "model_type": "deepseek_v3", "moe_intermediate_size": 2048,
            "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1,
            "norm_topk_prob": True, "num_attention_heads": 128, "num_experts_per_tok": 8,
            "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1,
            "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
            "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                             "original_max_position_embeddings": 4096, "type": "yarn"},
            "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid",
            "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
            "transformers_version": "4.33.1", "use_cache": True, "v_head_dim": 128, "vocab_size": 129280}


def deepseek_v2_lite():  # mscale 0.707 on both sides: the attention factor cancels to 1
    return {"architectures": ["DeepseekV2ForCausalLM"], "hidden_size": 2048, "intermediate_size": 10944,
            "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v2",
            "moe_intermediate_size": 1408, "n_routed_experts": 64, "n_shared_experts": 2,
            "num_attention_heads": 16, "num_experts_per_tok": 6, "num_hidden_layers": 27,
            "num_key_value_heads": 16, "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
            "rms_norm_eps": 1e-06,
            "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707,
                             "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096, "type": "yarn"},
            "rope_theta": 10000, "torch_dtype": "bfloat16", "v_head_dim": 128, "vocab_size": 102400}


def pythia_410m():
    return {"architectures": ["GPTNeoXForCausalLM"], "bos_token_id": 0, "eos_token_id": 0, "hidden_act": "gelu",
            "hidden_size": 1024, "initializer_range": 0.02, "intermediate_size": 4096,
            "layer_norm_eps": 1e-05, "max_position_embeddings": 2048, "model_type": "gpt_neox",
            "num_attention_heads": 16, "num_hidden_layers": 24, "rotary_emb_base": 10000, "rotary_pct": 0.25,
            "tie_word_embeddings": False, "torch_dtype": "float16", "transformers_version": "4.24.0",
            "use_cache": True, "use_parallel_residual": True, "vocab_size": 50304}


def gptj_6b():
    return {"activation_function": "gelu_new", "architectures": ["GPTJForCausalLM"], "attn_pdrop": 0.0,
            "bos_token_id": 50256, "embd_pdrop": 0.0, "eos_token_id": 50256, "gradient_checkpointing": False,
            "initializer_range": 0.02, "layer_norm_epsilon": 1e-05, "model_type": "gptj", "n_embd": 4096,
            "n_head": 16, "n_inner": None, "n_layer": 28, "n_positions": 2048, "resid_pdrop": 0.0,
            "rotary": True, "rotary_dim": 64, "scale_attn_weights": True, "tie_word_embeddings": False,
            "transformers_version": "4.18.0.dev0", "use_cache": True, "vocab_size": 50400}


# transformers 5 spellings: theta and scaling together in rope_parameters.

def llama31_8b_v5():
    d = llama31_8b()
    del d["rope_theta"], d["rope_scaling"]
    d["rope_parameters"] = {"rope_theta": 500000.0, "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    return d


def llama2_dynamic_v5():
    d = llama2_7b()
    del d["rope_scaling"]
    d["rope_parameters"] = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    return d


def gemma3_1b_v5():  # rope_parameters per layer type
    d = gemma3_1b()
    for k in ("rope_local_base_freq", "rope_scaling", "rope_theta", "sliding_window_pattern"):
        del d[k]
    d["layer_types"] = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(26)]
    d["rope_parameters"] = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
                            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    return d


def gemma3_1b_linear():  # the 4.57 spelling of gemma3_1b_v5
    return dict(gemma3_1b(), rope_scaling={"rope_type": "linear", "factor": 8.0})


def phi3_mini_128k_v5():
    d = phi3_mini_128k()
    scaling = d.pop("rope_scaling")
    d["rope_parameters"] = {"rope_type": "longrope", "rope_theta": d.pop("rope_theta"),
                            "partial_rotary_factor": 1.0, "original_max_position_embeddings": 4096,
                            "short_factor": scaling["short_factor"], "long_factor": scaling["long_factor"]}
    return d


def deepseek_v3_v5():
    d = deepseek_v3()
    scaling = d.pop("rope_scaling")
    del scaling["type"]
    d["rope_parameters"] = dict(scaling, rope_type="yarn", rope_theta=10000.0, factor=40.0)
    return d


def pythia_410m_v5():
    d = pythia_410m()
    del d["rotary_pct"], d["rotary_emb_base"]
    d["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000, "partial_rotary_factor": 0.25}
    return d


def qwen3_vl_8b_v5():
    d = qwen3_vl_8b()
    text = d["text_config"]
    text["rope_parameters"] = dict(text.pop("rope_scaling"), rope_theta=text.pop("rope_theta"))
    return d


@dataclass
class Case:
    config: object            # () -> the config.json dict
    layer_type: str = None
    hf: object = None         # () -> the transformers 4.57 spelling, when `config` is a v5 one
    length: int = 8192        # the table length the test builds (max_position)


CASES = {
    "llama2_7b": Case(llama2_7b),
    "llama2_dynamic": Case(llama2_dynamic),
    "llama2_linear": Case(llama2_linear),
    "llama31_8b": Case(llama31_8b),
    "llama32_1b": Case(llama32_1b),
    "mistral_7b": Case(mistral_7b),
    "qwen2_7b": Case(qwen2_7b),
    "qwen25_7b_yarn": Case(qwen25_7b_yarn),
    "qwen2_vl_7b": Case(qwen2_vl_7b),
    "qwen25_vl_7b": Case(qwen25_vl_7b),
    "qwen3_vl_8b": Case(qwen3_vl_8b),
    "gemma_7b": Case(gemma_7b),
    "gemma3_1b_full": Case(gemma3_1b, "full_attention"),
    "gemma3_1b_sliding": Case(gemma3_1b, "sliding_attention"),
    "gemma3_4b_full": Case(gemma3_4b, "full_attention"),
    "gemma3_4b_sliding": Case(gemma3_4b, "sliding_attention"),
    "phi3_mini_128k": Case(phi3_mini_128k),
    "phi4_mini": Case(phi4_mini),
    "phi35_moe": Case(phi35_moe),
    "deepseek_v3": Case(deepseek_v3),
    "deepseek_v2_lite": Case(deepseek_v2_lite),
    "pythia_410m": Case(pythia_410m, length=2048),
    "gptj_6b": Case(gptj_6b, length=2048),
    "llama31_8b_v5": Case(llama31_8b_v5, hf=llama31_8b),
    "llama2_dynamic_v5": Case(llama2_dynamic_v5, hf=llama2_dynamic),
    "gemma3_1b_v5_full": Case(gemma3_1b_v5, "full_attention", hf=gemma3_1b_linear),
    "gemma3_1b_v5_sliding": Case(gemma3_1b_v5, "sliding_attention", hf=gemma3_1b_linear),
    "phi3_mini_128k_v5": Case(phi3_mini_128k_v5, hf=phi3_mini_128k),
    "deepseek_v3_v5": Case(deepseek_v3_v5, hf=deepseek_v3),
    "pythia_410m_v5": Case(pythia_410m_v5, hf=pythia_410m, length=2048),
    "qwen3_vl_8b_v5": Case(qwen3_vl_8b_v5, hf=qwen3_vl_8b),
}


# ---- the transformers oracle -----------------------------------------------------------------

ROTARY = {
    "llama": hf_llama.LlamaRotaryEmbedding, "mistral": hf_mistral.MistralRotaryEmbedding,
    "qwen2": hf_qwen2.Qwen2RotaryEmbedding, "qwen2_vl": hf_qwen2vl.Qwen2VLRotaryEmbedding,
    "qwen2_5_vl": hf_qwen25vl.Qwen2_5_VLRotaryEmbedding, "qwen2_vl_text": hf_qwen2vl.Qwen2VLRotaryEmbedding,
    "qwen2_5_vl_text": hf_qwen25vl.Qwen2_5_VLRotaryEmbedding,
    "qwen3_vl_text": hf_qwen3vl.Qwen3VLTextRotaryEmbedding,
    "gemma": hf_gemma.GemmaRotaryEmbedding, "gemma3_text": hf_gemma3.Gemma3RotaryEmbedding,
    "phi3": hf_phi3.Phi3RotaryEmbedding, "phimoe": hf_phimoe.PhimoeRotaryEmbedding,
    "deepseek_v3": hf_dsv3.DeepseekV3RotaryEmbedding, "deepseek_v2": hf_dsv2.DeepseekV2RotaryEmbedding,
    "gpt_neox": hf_neox.GPTNeoXRotaryEmbedding,
}


def hf_config(d):
    d = copy.deepcopy(d)  # transformers' config classes edit the dicts they are given
    return AutoConfig.for_model(d.pop("model_type"), **d).get_text_config()


class HF:
    """transformers' rotary embedding for a config: cos/sin per position as its model reads them."""

    def __init__(self, d, layer_type=None):
        c = hf_config(d)
        if c.model_type == "gemma3_text" and layer_type == "sliding_attention":
            c = copy.deepcopy(c)  # what Gemma3TextModel does for its local rotary embedding
            c.rope_theta, c.rope_scaling = c.rope_local_base_freq, {"rope_type": "default"}
        self.config, self.kind = c, c.model_type
        if self.kind == "gptj":
            self.half = c.rotary_dim // 2
            self.table = hf_gptj.create_sinusoidal_positions(c.max_position_embeddings, c.rotary_dim)
        else:
            self.rot = ROTARY[self.kind](config=c)

    def cos_sin(self, positions):
        """(cos, sin, inv_freq) for positions (B, S): float32 (B, S, rotary_dim/2) each, and the
        inv_freq transformers used for them."""
        x = torch.zeros(1)
        if self.kind == "gptj":
            rows = self.table[positions]
            inv = 1.0 / (10000 ** (torch.arange(0, 2 * self.half, 2) / (2 * self.half)))
            return rows[..., self.half:], rows[..., :self.half], inv
        if self.kind == "phimoe":  # its model asks for the first max(positions) + 1 rows
            n = int(positions.max()) + 1
            cos, sin = self.rot(x, seq_len=n)
            inv, _ = self.rot.rope_init_fn(self.config, None, n)
            half = cos.shape[-1] // 2
            return cos[positions][..., :half], sin[positions][..., :half], inv
        if self.kind == "deepseek_v2":  # complex e^{i theta}, times the attention factor
            f = self.rot(x, positions)
            return f.real, f.imag, self.rot.inv_freq
        if self.kind in ("qwen2_vl", "qwen2_5_vl", "qwen2_vl_text", "qwen2_5_vl_text"):
            # text positions: 3 equal components
            cos, sin = (t[0] for t in self.rot(x, positions.expand(3, *positions.shape)))
        else:
            cos, sin = self.rot(x, positions)
        half = cos.shape[-1] // 2
        return cos[..., :half], sin[..., :half], self.rot.inv_freq


def assert_cos_sin_match(ours, theirs, positions, inv_freq):
    """ours/theirs: (cos, sin). Tolerance: see the module docstring."""
    theta = positions.double()[..., None] * inv_freq.double()
    a = max(1.0, float(theirs[0].abs().max()), float(theirs[1].abs().max()))
    tol = a * (theta.abs() * 2.0**-19 + 2.0**-21)
    for got, want in zip(ours, theirs):
        assert got.dtype == torch.float32 and got.shape == want.shape
        err = (got.double() - want.double()).abs()
        assert bool((err <= tol).all()), f"max error {float((err - tol).max())} over tolerance"


def sample_positions(length, batch=2, seq=24):
    """A prefill from 0 and random positions up to the table length (fresh each run)."""
    return torch.stack([torch.arange(seq), torch.randint(0, length, (seq,))])[:batch]


@pytest.mark.parametrize("name", CASES)
def test_cos_sin_match_transformers(name):
    case = CASES[name]
    cfg = case.config()
    before = copy.deepcopy(cfg)
    m = rope_ext.RotaryEmbedding.from_config(cfg, layer_type=case.layer_type, max_position=case.length)
    assert cfg == before  # from_config does not edit the config
    hf = HF((case.hf or case.config)(), case.layer_type)
    pos = sample_positions(case.length)
    got = m.cos_sin(pos)
    *want, inv = hf.cos_sin(pos)
    assert_cos_sin_match(got, want, pos, inv)
    assert m.rotary_dim == 2 * want[0].shape[-1]


# What each real config means for the module (the models' published geometry, not rope_ext's
# output): head_dim, rotary_dim, layout, MRoPE, and the default table length.
GEOMETRY = {
    "llama2_7b": (128, 128, False, None, False, 4096, 10000.0),
    "llama2_dynamic": (128, 128, False, None, False, 8192, 10000.0),  # 4096 * factor 2
    "llama31_8b": (128, 128, False, None, False, 131072, 500000.0),
    "llama32_1b": (64, 64, False, None, False, 131072, 500000.0),
    "mistral_7b": (128, 128, False, None, False, 32768, 10000.0),
    "qwen25_7b_yarn": (128, 128, False, None, False, 131072, 1e6),  # 32768 * 4
    "qwen2_vl_7b": (128, 128, False, [16, 24, 24], False, 32768, 1e6),
    "qwen25_vl_7b": (128, 128, False, [16, 24, 24], False, 32768, 1e6),
    "qwen3_vl_8b": (128, 128, False, [24, 20, 20], True, 262144, 5e6),
    "qwen3_vl_8b_v5": (128, 128, False, [24, 20, 20], True, 262144, 5e6),
    "gemma3_4b_full": (256, 256, False, None, False, 131072, 1e6),
    "gemma3_4b_sliding": (256, 256, False, None, False, 131072, 10000.0),
    "gemma3_1b_v5_sliding": (256, 256, False, None, False, 32768, 10000.0),
    "phi3_mini_128k": (96, 96, False, None, False, 131072, 10000.0),
    "phi4_mini": (128, 96, False, None, False, 131072, 10000.0),
    "deepseek_v3": (64, 64, True, None, False, 163840, 10000.0),
    "deepseek_v3_v5": (64, 64, True, None, False, 163840, 10000.0),
    "deepseek_v2_lite": (64, 64, True, None, False, 163840, 10000.0),
    "pythia_410m": (64, 16, False, None, False, 2048, 10000.0),
    "pythia_410m_v5": (64, 16, False, None, False, 2048, 10000.0),
    "gptj_6b": (256, 64, True, None, False, 2048, 10000.0),
}


@pytest.mark.parametrize("name", GEOMETRY)
def test_geometry_of_real_configs(name):
    case = CASES[name]
    k = rope_kwargs_from_config(case.config(), layer_type=case.layer_type)
    got = (k["head_dim"], k["rotary_dim"], k["interleaved"], k["mrope_section"], k["mrope_interleaved"],
           k["max_position"], k["base"])
    assert got == GEOMETRY[name]


def test_deepseek_v3_yarn_attention_and_scaling():
    # factor 40, mscale = mscale_all_dim = 1: the mscale ratio is 1 (the softmax scale carries
    # DeepSeek's mscale, not the table). The table is yarn over 4096 trained positions.
    k = rope_kwargs_from_config(deepseek_v3())
    assert k["scaling"]["original_max_position_embeddings"] == 4096 and k["scaling"]["factor"] == 40
    m = rope_ext.RotaryEmbedding(**k)
    assert m.cos_sin_cache[0, 0].item() == 1.0


def dbrx_instruct():
    return {"model_type": "dbrx", "d_model": 6144, "n_heads": 48, "n_layers": 40,
            "max_seq_len": 32768, "vocab_size": 100352,
            "attn_config": {"clip_qkv": 8, "kv_n_heads": 8, "rope_theta": 500000},
            "ffn_config": {"ffn_hidden_size": 10752, "moe_num_experts": 16, "moe_top_k": 4}}


@pytest.mark.parametrize("as_object", [False, True])
def test_dbrx_base_is_read_in_its_attn_config(as_object):
    # (transformers 4's DBRX attention reads it there; the checkpoints were trained with it)
    from transformers import DbrxConfig

    cfg = dbrx_instruct()
    if as_object:
        cfg = DbrxConfig(**{k: v for k, v in cfg.items() if k != "model_type"})
        if getattr(cfg, "rope_parameters", None) is not None:
            pytest.skip("transformers 5's DbrxConfig sets rope_parameters to its default base, "
                        "which its model runs and the object holds")
    k = rope_kwargs_from_config(cfg)
    assert (k["head_dim"], k["rotary_dim"], k["max_position"], k["base"]) == (128, 128, 32768, 500000)


# ---- the rotations, through transformers' own apply functions ---------------------------------


def _qk(batch, seq, heads, dim, dtype=torch.float64):
    return torch.randn(batch, seq, heads, dim, dtype=dtype), torch.randn(batch, seq, 1, dim, dtype=dtype)


def _check_both_paths(m, q, k, pos, want_q, want_k, tol=1e-12):
    q2, k2 = m(q, k, pos)
    torch.testing.assert_close(q2, want_q, rtol=tol, atol=tol)
    torch.testing.assert_close(k2, want_k, rtol=tol, atol=tol)
    qi, ki = q.clone(), k.clone()
    m.forward_(qi, ki, pos)
    assert torch.equal(qi, q2) and torch.equal(ki, k2)


@pytest.mark.parametrize("name", ["llama31_8b", "phi4_mini", "pythia_410m", "gemma3_4b_full"])
def test_half_split_rotation_matches_transformers(name):
    case = CASES[name]
    m = rope_ext.RotaryEmbedding.from_config(case.config(), layer_type=case.layer_type, max_position=case.length)
    pos = sample_positions(case.length, seq=8)
    q, k = _qk(2, 8, 3, m.head_dim)
    cos, sin = (torch.cat((t, t), -1) for t in m.cos_sin(pos))  # transformers' layout
    # Phi-3's and GPT-NeoX's apply functions rotate the first cos.shape[-1] dims (partial
    # rotary) and keep the rest; Llama's and Gemma's rotate the whole head.
    apply = {"phi4_mini": hf_phi3.apply_rotary_pos_emb, "pythia_410m": hf_neox.apply_rotary_pos_emb}.get(
        name, hf_llama.apply_rotary_pos_emb)
    assert (m.rotary_dim < m.head_dim) == (name in ("phi4_mini", "pythia_410m"))
    want_q, want_k = apply(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    _check_both_paths(m, q, k, pos, want_q.transpose(1, 2), want_k.transpose(1, 2))


def test_gptj_rotation_matches_transformers():
    m = rope_ext.RotaryEmbedding.from_config(gptj_6b())
    pos = sample_positions(2048, seq=8)
    q, k = _qk(2, 8, 2, 256)
    cos, sin = m.cos_sin(pos)
    r = m.rotary_dim

    def hf_apply(t):  # GPT-J's attention: rotary part through apply_rotary_pos_emb, rest kept
        return torch.cat((hf_gptj.apply_rotary_pos_emb(t[..., :r], sin, cos), t[..., r:]), -1)

    _check_both_paths(m, q, k, pos, hf_apply(q), hf_apply(k))


def test_deepseek_v3_rotation_matches_transformers():
    # transformers' interleave path returns the pairs de-interleaved (x[2i] first, then x[2i+1]);
    # q and k are permuted alike, so attention is unchanged. Undo it to compare.
    m = rope_ext.RotaryEmbedding.from_config(deepseek_v3(), max_position=8192)
    pos = sample_positions(8192, seq=8)
    q, k = _qk(2, 8, 4, 64)
    cos, sin = (torch.cat((t, t), -1) for t in m.cos_sin(pos))
    want_q, want_k = hf_dsv3.apply_rotary_pos_emb_interleave(q.transpose(1, 2), k.transpose(1, 2), cos, sin)

    def interleave(t):
        return t.transpose(1, 2).unflatten(-1, (2, 32)).transpose(-1, -2).flatten(-2)

    _check_both_paths(m, q, k, pos, interleave(want_q), interleave(want_k))


def test_deepseek_v2_rotation_matches_transformers():
    # transformers rotates complex pairs in float32 here, so float32 inputs and tolerance.
    m = rope_ext.RotaryEmbedding.from_config(deepseek_v2_lite(), max_position=8192)
    pos = sample_positions(8192, seq=8)
    q, k = _qk(2, 8, 4, 64, torch.float32)
    cos, sin = m.cos_sin(pos)
    want_q, want_k = hf_dsv2.apply_rotary_emb(q.transpose(1, 2), k.transpose(1, 2), torch.complex(cos, sin))
    _check_both_paths(m, q, k, pos, want_q.transpose(1, 2), want_k.transpose(1, 2), tol=1e-6)


def _mrope_positions(batch, seq, length):
    """Text tokens (3 equal components) then an image grid (t fixed, h/w varying)."""
    text = torch.arange(seq // 2).expand(3, batch, -1)
    grid = torch.randint(0, length, (3, batch, seq - seq // 2))
    return torch.cat((text, grid), -1)


@pytest.mark.parametrize("name", ["qwen2_vl_7b", "qwen25_vl_7b"])
def test_qwen2_vl_mrope_matches_transformers(name):
    m = rope_ext.RotaryEmbedding.from_config(CASES[name].config(), max_position=4096)
    pos = _mrope_positions(2, 10, 4096)
    q, k = _qk(2, 10, 2, 128)
    cos, sin = (torch.cat((t, t), -1) for t in m.cos_sin(pos))  # (3, B, S, 128)
    want_q, want_k = hf_qwen2vl.apply_multimodal_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin,
                                                                m.mrope_section)
    _check_both_paths(m, q, k, pos, want_q.transpose(1, 2), want_k.transpose(1, 2))


@pytest.mark.parametrize("name", ["qwen3_vl_8b", "qwen3_vl_8b_v5"])
def test_qwen3_vl_interleaved_mrope_matches_transformers(name):
    m = rope_ext.RotaryEmbedding.from_config(CASES[name].config(), max_position=4096)
    assert m.mrope_interleaved
    hf = HF(qwen3_vl_8b())
    pos = _mrope_positions(2, 10, 4096)
    q, k = _qk(2, 10, 2, 128)
    # transformers picks each pair's component from the angles; the same selection of cos/sin.
    cos, sin = (hf.rot.apply_interleaved_mrope(t.clone(), hf.rot.mrope_section) for t in m.cos_sin(pos))
    cos, sin = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)
    want_q, want_k = hf_qwen3vl.apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    _check_both_paths(m, q, k, pos, want_q.transpose(1, 2), want_k.transpose(1, 2))
    # And the angles: transformers' own cos/sin for these 3-D positions.
    hcos, hsin = hf.rot(torch.zeros(1), pos)
    ours = m.cos_sin(pos)
    inv = hf.rot.inv_freq
    theta_pos = pos.amax(0)  # a bound on the position each pair reads
    assert_cos_sin_match((hf.rot.apply_interleaved_mrope(ours[0].clone(), [24, 20, 20]),
                          hf.rot.apply_interleaved_mrope(ours[1].clone(), [24, 20, 20])),
                         (hcos[..., :64], hsin[..., :64]), theta_pos, inv)


# ---- length-dependent scalings: call by call, as transformers does -------------------------


def _call_lengths(original, length):
    """Calls as generation makes them: prefills and decode steps below, at and past the original
    length, growing, then shorter again (transformers resets dynamic NTK below the original)."""
    return [100, original - 1, original, original + 1, original + 700, original + 300, length - 1,
            original // 2, original + 5, 1]


def _call_positions(last, n=6):
    """Positions of a call whose largest is `last`: a few earlier tokens and the last."""
    pos = torch.cat((torch.randint(0, last + 1, (n - 1,)), torch.tensor([last])))
    return pos[torch.randperm(n)][None]


@pytest.mark.parametrize("name", ["llama2_dynamic", "llama2_dynamic_v5"])
def test_dynamic_ntk_follows_transformers_call_by_call(name):
    case = CASES[name]
    m = rope_ext.RotaryEmbedding.from_config(case.config())
    assert m.mode == "dynamic" and m.max_position == 8192
    hf = HF((case.hf or case.config)())
    in_place = rope_ext.RotaryEmbedding.from_config(case.config())
    for last in _call_lengths(4096, 8192):
        pos = _call_positions(last - 1)
        got = m.cos_sin(pos)
        *want, inv = hf.cos_sin(pos)
        assert_cos_sin_match(got, want, pos, inv)
        assert int(m.dynamic_len) == hf.rot.max_seq_len_cached
        # forward_ keeps the same state and rotates by the same rows.
        q = torch.randn(1, pos.shape[1], 2, 128)
        qi = q.clone()
        in_place.forward_(qi, None, pos)
        assert torch.equal(qi, m(q, None, pos)[0])
        assert int(in_place.dynamic_len) == int(m.dynamic_len)


@pytest.mark.parametrize("name", ["phi3_mini_128k", "phi3_mini_128k_v5", "phi4_mini"])
def test_longrope_switches_like_transformers(name):
    case = CASES[name]
    m = rope_ext.RotaryEmbedding.from_config(case.config(), max_position=8192)
    assert m.mode == "longrope"
    hf = HF((case.hf or case.config)())
    for last in _call_lengths(4096, 8192):
        pos = _call_positions(last - 1)
        got = m.cos_sin(pos)
        *want, inv = hf.cos_sin(pos)
        assert_cos_sin_match(got, want, pos, inv)
        uses_long = last > 4096
        assert torch.equal(hf.rot.inv_freq, hf.rot.long_inv_freq if uses_long else hf.rot.original_inv_freq)


def test_phimoe_mscale_per_set():
    # Phi-3.5-MoE's short_mscale / long_mscale are the attention factors of the two sets; made
    # different here so the switch shows.
    cfg = phi35_moe(short_mscale=1.1, long_mscale=1.3)
    m = rope_ext.RotaryEmbedding.from_config(cfg, max_position=8192)
    hf = HF(cfg)
    for last in (50, 4096, 4097, 8000):
        pos = torch.cat((torch.tensor([[0]]), _call_positions(last - 1)), 1)
        got = m.cos_sin(pos)
        *want, inv = hf.cos_sin(pos)
        assert_cos_sin_match(got, want, pos, inv)
        # cos at position 0 is the attention factor itself.
        assert got[0][0, 0, 0].item() == pytest.approx(1.3 if last > 4096 else 1.1, rel=1e-7)


# ---- errors: never a silent default ---------------------------------------------------------


@pytest.mark.parametrize(
    "cfg, match",
    [
        (dict(llama31_8b(), rope_scaling=dict(llama31_8b()["rope_scaling"], alpha=2.0)),
         r"rope scaling type 'llama3' does not understand the key 'alpha'"),
        (dict(llama2_7b(), rope_scaling={"type": "dynamic", "factor": 2.0, "alpha": 1.0}),
         r"'dynamic' does not understand the key 'alpha'"),
        (dict(qwen25_7b_yarn(), rope_scaling={"type": "yarn", "factor": 4.0, "extrapolation_factor": 1.0}),
         r"'yarn' does not understand the key 'extrapolation_factor'"),
        (dict(llama2_7b(), rope_scaling={"type": "ntk-by-parts", "factor": 2.0}),
         r"unknown rope scaling type 'ntk-by-parts'; supported: deepseek_yarn, default, dynamic, linear, "
         r"llama3, longrope, mrope, proportional, su, yarn"),
        (dict(llama2_7b(), rope_parameters={"rope_type": "default", "rope_theta": 1e4, "factor": 2.0}),
         r"'default' does not understand the key 'factor'"),
        (dict(llama2_7b(), rope_scaling={"rope_type": "linear", "type": "dynamic", "factor": 2.0}),
         r"two types, rope_type='linear' and type='dynamic'"),
        (dict(llama2_7b(), rope_scaling={"type": "linear", "factor": 2.0},
              rope_parameters={"rope_type": "linear", "factor": 4.0}), r"both rope_scaling and rope_parameters"),
        (dict(llama2_7b(), rope_theta=1e4, rope_scaling={"type": "linear", "factor": 2.0, "rope_theta": 5e5}),
         r"rope_theta is 10000.0 but rope_scaling holds rope_theta 500000.0"),
        (gemma3_1b(), r"sliding-window layers their own base \(rope_local_base_freq\); pass layer_type="),
        (gemma3_1b_v5(), r"per layer type \(full_attention, sliding_attention\); pass layer_type="),
        (dict(qwen3_vl_8b(), text_config=dict(qwen3_vl_8b()["text_config"],
                                              rope_scaling={"rope_type": "default", "mrope_interleaved": False,
                                                            "mrope_section": [24, 20, 20]})),
         r"qwen3_vl_text lays MRoPE out interleaved; the config says mrope_interleaved=false"),
        (dict(model_type="falcon", hidden_size=64, num_attention_heads=2, alibi=True), r"ALiBi"),
        (dict(pythia_410m(), rotary_pct=0.0), r"rotary_pct must be a positive number, got 0.0"),
        (dict(pythia_410m(), rotary_pct=1.5), r"rotary_pct must be in \(0, 1\], got 1.5"),
        (dict(model_type="my_model", rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4},
              head_dim=64), r"'yarn' needs the config's max_position_embeddings"),
    ],
)
def test_errors_name_the_problem(cfg, match):
    with pytest.raises(ValueError, match=r"^RotaryEmbedding.from_config: .*" + match):
        rope_ext.RotaryEmbedding.from_config(cfg)


@pytest.mark.parametrize("layer_type, match", [("global", r"layer_type 'global' has no RoPE parameters"),
                                               (3, r"layer_type must be a string")])
def test_unknown_layer_type(layer_type, match):
    with pytest.raises(ValueError, match=match):
        rope_ext.RotaryEmbedding.from_config(gemma3_1b_v5(), layer_type=layer_type)


def test_layer_type_checked_against_layer_types():
    cfg = dict(mistral_7b(), layer_types=["full_attention"] * 4)
    m = rope_ext.RotaryEmbedding.from_config(cfg, layer_type="full_attention", max_position=64)
    assert torch.equal(m.cos_sin_cache, rope_ext.RotaryEmbedding.from_config(cfg, max_position=64).cos_sin_cache)
    with pytest.raises(ValueError, match=r"'sliding_attention' is not among the config's layer_types"):
        rope_ext.RotaryEmbedding.from_config(cfg, layer_type="sliding_attention")


# ---- no host-device sync: the whole call compiles as one graph -------------------------------


@pytest.mark.parametrize("name", ["llama2_dynamic", "phi3_mini_128k"])
def test_length_dependent_forward_compiles_without_graph_breaks(name):
    # A .item() or a Python branch on a tensor value would break the graph (fullgraph=True
    # raises); the dynamic-NTK length is a buffer mutated inside the graph.
    eager = rope_ext.RotaryEmbedding.from_config(CASES[name].config(), max_position=8192)
    compiled_mod = rope_ext.RotaryEmbedding.from_config(CASES[name].config(), max_position=8192)
    compiled = torch.compile(compiled_mod, backend="aot_eager", fullgraph=True, dynamic=False)
    for last in (100, 5000, 6000, 200):
        pos = _call_positions(last - 1)
        q = torch.randn(1, pos.shape[1], 2, compiled_mod.head_dim)
        torch.testing.assert_close(compiled(q, None, pos)[0], eager(q, None, pos)[0], rtol=0, atol=0)
        if name == "llama2_dynamic":
            assert int(compiled_mod.dynamic_len) == int(eager.dynamic_len)
    bad = torch.tensor([[0, 8192]])
    with pytest.raises(RuntimeError, match=r"positions must lie in \[0, 8192\)"):
        compiled(torch.randn(1, 2, 2, compiled_mod.head_dim), None, bad)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["llama2_dynamic", "phi3_mini_128k", "llama31_8b"])
def test_forward_captures_in_a_cuda_graph(name):
    m = rope_ext.RotaryEmbedding.from_config(CASES[name].config(), max_position=8192).cuda()
    ref = rope_ext.RotaryEmbedding.from_config(CASES[name].config(), max_position=8192).cuda()
    q = torch.randn(1, 6, 2, m.head_dim, device="cuda")
    pos = torch.zeros(1, 6, dtype=torch.int64, device="cuda")
    s = torch.cuda.Stream()  # warm up on a side stream, outside the capture
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        m(q, None, pos)
    torch.cuda.current_stream().wait_stream(s)
    ref(q, None, pos)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # a host-device sync inside would fail the capture
        out = m(q, None, pos)[0]
    for last in (100, 5000, 6000, 200):
        pos.copy_(_call_positions(last - 1).cuda())
        q.copy_(torch.randn_like(q))
        graph.replay()
        torch.testing.assert_close(out, ref(q, None, pos)[0], rtol=0, atol=0)
        if name == "llama2_dynamic":  # the replayed graph advanced the length like eager calls
            assert int(m.dynamic_len) == int(ref.dynamic_len)


@pytest.mark.parametrize("name", ["llama2_7b", "llama31_8b", "qwen2_vl_7b", "qwen3_vl_8b", "gemma3_4b_full",
                                  "gemma3_1b_sliding", "phi3_mini_128k", "deepseek_v3", "pythia_410m", "gptj_6b"])
def test_config_objects_read_like_their_files(name):
    # transformers' config object (class defaults and conversions applied), whole or its text
    # part, gives the module the file gives.
    case = CASES[name]
    want = rope_kwargs_from_config(case.config(), layer_type=case.layer_type)
    whole = copy.deepcopy(case.config())
    whole = AutoConfig.for_model(whole.pop("model_type"), **whole)
    for obj in (whole, whole.get_text_config()):
        assert rope_kwargs_from_config(obj, layer_type=case.layer_type) == want


# ---- lengths and factors derived from the rest of the config ------------------------------


def _llama(**kw):
    return dict(model_type="llama", hidden_size=256, num_attention_heads=4, max_position_embeddings=16384,
                rope_theta=10000.0, **kw)


@pytest.mark.parametrize(
    "cfg",
    [
        # dynamic: transformers grows past max_position_embeddings; a dict original is not used.
        _llama(rope_scaling={"rope_type": "dynamic", "factor": 4.0, "original_max_position_embeddings": 1024}),
        # yarn (rope_scaling): the dict's original; a top-level one is not read by transformers 4.
        _llama(original_max_position_embeddings=2048,
               rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}),
        _llama(rope_scaling={"rope_type": "yarn", "factor": 4.0}),  # no original: max_position_embeddings
        # longrope (rope_scaling) with a top-level original: the ratio replaces the dict's factor.
        _llama(original_max_position_embeddings=4096,
               rope_scaling={"rope_type": "longrope", "factor": 2.0, "short_factor": _short(32),
                             "long_factor": _long(32)}),
    ],
    ids=["dynamic", "yarn_top_level_ignored", "yarn_no_original", "longrope_top_level_ratio"],
)
def test_derived_lengths_match_transformers_4(cfg):
    m = rope_ext.RotaryEmbedding.from_config(cfg, max_position=16384)
    hf = HF(cfg)
    pos = torch.stack([torch.arange(16), torch.arange(16000, 16016)])  # a long call
    got = m.cos_sin(pos)
    *want, inv = hf.cos_sin(pos)
    assert_cos_sin_match(got, want, pos, inv)


def test_derived_lengths_of_rope_parameters_follow_transformers_5():
    # transformers 5 copies a top-level original length over the dict's (yarn, llama3, longrope)
    # and keeps an explicit factor; without one the factor is max_position_embeddings / original.
    k = rope_kwargs_from_config(_llama(original_max_position_embeddings=2048, rope_parameters={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096, "rope_theta": 1e4}))
    assert k["scaling"]["original_max_position_embeddings"] == 2048 and k["scaling"]["factor"] == 4.0
    k = rope_kwargs_from_config(_llama(rope_parameters={
        "rope_type": "yarn", "original_max_position_embeddings": 4096, "rope_theta": 1e4}))
    assert k["scaling"]["factor"] == 4.0 and k["max_position"] == 16384
    k = rope_kwargs_from_config(_llama(original_max_position_embeddings=4096, rope_parameters={
        "rope_type": "longrope", "factor": 2.0, "short_factor": _short(32), "long_factor": _long(32)}))
    assert k["scaling"]["original_max_position_embeddings"] == 4096 and k["scaling"]["factor"] == 2.0
    # Per layer type, only the entry's own length, else max_position_embeddings.
    k = rope_kwargs_from_config(_llama(original_max_position_embeddings=2048, rope_parameters={
        "full_attention": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4}}), layer_type="full_attention")
    assert k["scaling"]["original_max_position_embeddings"] == 16384
    # A yarn config keeping max_position_embeddings at the trained length: the table covers
    # original * factor by default.
    k = rope_kwargs_from_config(_llama(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}))
    assert k["max_position"] == 4 * 16384
