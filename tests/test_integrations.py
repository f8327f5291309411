"""rope_ext.integrations.transformers: patch(model) routes a transformers model's RoPE through
rope_ext's ops and unpatch(model) undoes it. Tiny randomly initialised models built from config
(no downloads): the patched model must give the unpatched model's logits, run rope ops (counted
at the dispatcher, so a silent no-op fails), touch no other model, and unpatch must restore
transformers' code exactly. A patched model must survive what users do with models: deepcopy,
torch.save / torch.load, state_dict round trips, torch.compile(fullgraph=True), hooks.
The same tests run under transformers 4 and 5 (`make hf5-test`).

Tolerance: in float32 the native kernel computes each output as x1*c - x2*s, rounding like
transformers' q*cos + rotate_half(q)*sin, so the logits agree to ~1 ulp (we allow 1e-5 relative);
bfloat16 logits differ by transformers' extra roundings of its intermediates (rope_ext rounds
once), within bf16 tolerance."""

import copy
import functools
import os
import sys
import gc
import importlib
import inspect
import textwrap
import types
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

transformers = pytest.importorskip("transformers")
from rope_ext import RotaryEmbedding  # noqa: E402
from rope_ext.integrations import _qk_norm  # noqa: E402
from rope_ext.integrations import transformers as integration  # noqa: E402
from conftest import torch_defaults  # noqa: E402

BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
ENCODER = {k: v for k, v in BASE.items() if k != "num_key_value_heads"}
MROPE = {"type": "mrope", "mrope_section": [2, 3, 3]}  # head_dim 16: 8 pairs


class Missing:
    """A class this transformers version lacks: calling it gives itself, so the families below
    are written out whatever the version, and build() skips one that needs it."""

    def __init__(self, name):
        self.name = name

    def __call__(self, *args, **kwargs):
        return self


class Classes:
    """transformers' classes by name (or those of the modules given), a Missing for one this
    version lacks."""

    def __init__(self, modules=(transformers,)):
        self.modules = modules

    @classmethod
    def of(cls, *module_names):
        """The classes of transformers' modules by name (none where the version lacks them)."""
        import importlib

        def find(name):
            try:
                return importlib.import_module(name)
            except ImportError:
                return None

        return cls([m for m in map(find, module_names) if m is not None])

    def __getattr__(self, name):
        for module in self.modules:
            found = getattr(module, name, None)
            if found is not None:
                return found
        return Missing(name)


def causal_lm(config):
    if isinstance(config, Missing):
        return lambda: config
    return lambda: transformers.AutoModelForCausalLM.from_config(config)


def vl_model(config_cls, model_cls, vision, text=None):
    config = config_cls(text_config=text or dict(BASE, rope_scaling=MROPE), vision_config=vision,
                        image_token_id=5, video_token_id=6, vision_start_token_id=7,
                        vision_end_token_id=8)
    return lambda: config if isinstance(config, Missing) else model_cls(config)


T = Classes()
QWEN3_VL_VISION = dict(depth=1, hidden_size=32, out_hidden_size=64, intermediate_size=64,
                       num_heads=2, patch_size=2, spatial_merge_size=2, temporal_patch_size=1,
                       num_position_embeddings=16, deepstack_visual_indexes=[0])
QWEN3_VL_TEXT = dict(BASE, head_dim=16, rope_scaling=dict(
    rope_type="default", mrope_section=[2, 3, 3], mrope_interleaved=True))
MOE = dict(num_experts=2, num_experts_per_tok=1, moe_intermediate_size=32)
SIGLIP = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
              image_size=8, patch_size=2)
BLT_PART = dict(num_attention_heads=4, num_hidden_layers=1, vocab_size=128, hidden_size=32,
                intermediate_size=64, max_position_embeddings=64)


def without_cache(model):
    if not isinstance(model, Missing):
        model.config.use_cache = False
    return model


EVOLLA = dict(BASE, num_hidden_layers=1, bos_token_id=1, eos_token_id=2, pad_token_id=0,
              aligner_num_add_layers=1, resampler_depth=1, resampler_dim_head=8,
              resampler_heads=2, resampler_num_latents=4, resampler_ff_mult=1,
              protein_encoder_config=dict(ENCODER, hidden_size=32, intermediate_size=64,
                                          pad_token_id=1, mask_token_id=4))
LLAMA4_TEXT = dict(BASE, head_dim=16, intermediate_size_mlp=128, num_local_experts=2,
                   num_experts_per_tok=1, no_rope_layers=[1, 0], attention_chunk_size=8)
NOPE_GLOBAL = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=8)
HF5 = int(transformers.__version__.split(".")[0]) >= 5
# (text configs the top-level namespace does not export)
MLLAMA = Classes.of("transformers.models.mllama.configuration_mllama", "transformers.models.mllama")
EMU3 = Classes.of("transformers.models.emu3")
MLLAMA_TEXT = dict(BASE, pad_token_id=0, cross_attention_layers=[1], rope_scaling=dict(
    rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
    original_max_position_embeddings=32))
FAMILIES = {
    "llama": causal_lm(T.LlamaConfig(**BASE)),
    "mistral": causal_lm(T.MistralConfig(**BASE)),
    "mixtral": causal_lm(T.MixtralConfig(**BASE, num_local_experts=2, num_experts_per_tok=1)),
    "qwen2": causal_lm(T.Qwen2Config(**BASE)),
    "qwen2_moe": causal_lm(T.Qwen2MoeConfig(**BASE, num_experts=2, num_experts_per_tok=1,
                                            moe_intermediate_size=32,
                                            shared_expert_intermediate_size=32)),
    "qwen3": causal_lm(T.Qwen3Config(**BASE, head_dim=16)),
    # per-head norms named q_layernorm / k_layernorm; a conv layer and an attention layer
    "lfm2": causal_lm(T.Lfm2Config(**BASE, layer_types=["conv", "full_attention"])),
    "qwen3_moe": causal_lm(T.Qwen3MoeConfig(**BASE, head_dim=16, num_experts=2, num_experts_per_tok=1,
                                            moe_intermediate_size=32)),
    "gemma": causal_lm(T.GemmaConfig(**BASE, head_dim=16)),
    "gemma2": causal_lm(T.Gemma2Config(**BASE, head_dim=16)),
    "gemma3_text": causal_lm(T.Gemma3TextConfig(**BASE, head_dim=16)),
    "qwen3_next": causal_lm(T.Qwen3NextConfig(  # a linear-attention and a full-attention layer
        **BASE, head_dim=16, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, layer_types=["linear_attention", "full_attention"],
        linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=8,
        linear_value_head_dim=8)),
    "glm4_moe": causal_lm(T.Glm4MoeConfig(**BASE, head_dim=16, use_qk_norm=True, n_routed_experts=2,
                                          num_experts_per_tok=1, moe_intermediate_size=32,
                                          first_k_dense_replace=1, n_group=1, topk_group=1)),
    "dots1": causal_lm(T.Dots1Config(**BASE, head_dim=16, n_routed_experts=2, num_experts_per_tok=1,
                                     moe_intermediate_size=32, first_k_dense_replace=1, n_group=1,
                                     topk_group=1, n_shared_experts=1)),
    "apertus": causal_lm(T.ApertusConfig(**BASE, head_dim=16)),
    "gemma3n_text": causal_lm(T.Gemma3nTextConfig(  # q and k normed and rotated one at a time
        **BASE, head_dim=16, hidden_size_per_layer_input=8, vocab_size_per_layer_input=128,
        laurel_rank=4, altup_num_inputs=2, num_kv_shared_layers=0,
        activation_sparsity_pattern=[0.0, 0.0], layer_types=["sliding_attention", "full_attention"],
        sliding_window=8)),
    "phi3": causal_lm(T.Phi3Config(**BASE, partial_rotary_factor=0.5, pad_token_id=0)),  # partial
    "phi": causal_lm(T.PhiConfig(**BASE, partial_rotary_factor=0.5)),
    # (transformers 4's gathers its tables at position_ids)
    "phimoe": causal_lm(T.PhimoeConfig(**BASE, num_local_experts=2, num_experts_per_tok=1)),
    # CLVP's text encoder: q, k and v rotated, on the first 32 of 64 dims
    "clvp_encoder": lambda: T.ClvpEncoder(T.ClvpEncoderConfig(
        vocab_size=128, hidden_size=64, intermediate_size=64, projection_dim=16,
        num_hidden_layers=2, num_attention_heads=1)),
    "gpt_neox": causal_lm(T.GPTNeoXConfig(**BASE, rotary_pct=0.25)),  # partial rotary
    "stablelm": causal_lm(T.StableLmConfig(**BASE, partial_rotary_factor=0.25)),
    "olmo2": causal_lm(T.Olmo2Config(**BASE)),
    "granite": causal_lm(T.GraniteConfig(**BASE)),
    "starcoder2": causal_lm(T.Starcoder2Config(**BASE)),
    "gptj": causal_lm(T.GPTJConfig(vocab_size=128, n_embd=64, n_layer=2, n_head=4, rotary_dim=8,
                                   n_positions=128)),  # interleaved, partial rotary
    "qwen2_vl": vl_model(T.Qwen2VLConfig, T.Qwen2VLForConditionalGeneration,
                         dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, patch_size=2,
                              spatial_merge_size=2, temporal_patch_size=1)),
    "qwen2_5_vl": vl_model(T.Qwen2_5_VLConfig, T.Qwen2_5_VLForConditionalGeneration,
                           dict(depth=1, hidden_size=32, out_hidden_size=64, intermediate_size=64,
                                num_heads=2, patch_size=2, spatial_merge_size=2,
                                temporal_patch_size=1, window_size=8, fullatt_block_indexes=[0])),
    "qwen3_vl": vl_model(T.Qwen3VLConfig, T.Qwen3VLForConditionalGeneration,  # interleaved MRoPE
                         QWEN3_VL_VISION,
                         text=QWEN3_VL_TEXT),
    "qwen3_vl_moe": vl_model(T.Qwen3VLMoeConfig, T.Qwen3VLMoeForConditionalGeneration,
                             QWEN3_VL_VISION, text=dict(QWEN3_VL_TEXT, **MOE)),
    # RoPE on sliding-window layers only (the global layers have none), QK norms on every layer.
    "exaone4": causal_lm(T.Exaone4Config(**BASE, head_dim=16, **NOPE_GLOBAL)),
    "doge": causal_lm(T.DogeConfig(**BASE, head_dim=16)),
    "gemma3": lambda: T.Gemma3ForConditionalGeneration(T.Gemma3Config(  # text inputs
        text_config=dict(BASE, head_dim=16), vision_config=SIGLIP, mm_tokens_per_image=4,
        image_token_index=5, boi_token_index=6, eoi_token_index=7)),
    # Llama 3.2 Vision: its language model's self-attention layers (Llama 3's RoPE), a
    # cross-attention layer (no RoPE); text inputs
    "mllama_text_model": lambda: MLLAMA.MllamaForCausalLM(MLLAMA.MllamaTextConfig(**MLLAMA_TEXT)),
    # complex tables; its second layer NoPE, the L2 norm after the rotation
    "llama4_text": causal_lm(T.Llama4TextConfig(**LLAMA4_TEXT)),
    "mllama": lambda: T.MllamaForConditionalGeneration(T.MllamaConfig(
        text_config=MLLAMA_TEXT, image_token_index=5, vision_config=dict(
            hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_global_layers=1,
            attention_heads=2, image_size=8, patch_size=2, vision_output_dim=64,
            intermediate_layers_indices=[0]))),
    "aria_text": lambda: T.AriaTextForCausalLM(T.AriaTextConfig(  # (MoE)
        **BASE, pad_token_id=0, moe_num_experts=2, moe_topk=1, moe_intermediate_size=32)),
    # backbone, depth decoder (small: the default depth decoder and codebooks make 400M weights)
    "csm": lambda: T.CsmForConditionalGeneration(T.CsmConfig(
        **BASE, num_codebooks=4, text_vocab_size=128,
        depth_decoder_config=dict(BASE, backbone_hidden_size=64, num_codebooks=4))),
    "eurobert": lambda: T.EuroBertForMaskedLM(T.EuroBertConfig(**BASE, pad_token_id=0)),  # encoder
    "nanochat": causal_lm(T.NanoChatConfig(**BASE)),  # rotate_half with flipped signs
    # Vision-language models of transformers 5, text inputs: their language models' RoPE
    "cosmos3_edge": lambda: T.Cosmos3EdgeForConditionalGeneration(T.Cosmos3EdgeConfig(
        text_config=BASE, vision_config=SIGLIP)),  # (a vision tower unrun: small)
    "granite_docling": lambda: T.GraniteDoclingForConditionalGeneration(T.GraniteDoclingConfig(
        text_config=dict(BASE, pad_token_id=0), pad_token_id=0, vision_config=dict(
            hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            out_hidden_size=64, image_size=8, patch_size=2))),
    # Encoders of transformers 5 (ModernBERT's: a global and a sliding-window layer)
    "modernbert": lambda: (T.ModernBertForMaskedLM if HF5 else Missing("ModernBertAttention "
                           "calling RoPE (transformers >= 5)"))(T.ModernBertConfig(
        **ENCODER, pad_token_id=0, local_attention=8, global_attn_every_n_layers=2)),
    "gte": lambda: T.GteForMaskedLM(T.GteConfig(**ENCODER, pad_token_id=0)),
    "nomic_bert": lambda: T.NomicBertForMaskedLM(T.NomicBertConfig(**ENCODER, pad_token_id=0)),
    "jina_embeddings_v3": lambda: T.JinaEmbeddingsV3ForMaskedLM(T.JinaEmbeddingsV3Config(
        **ENCODER, pad_token_id=0)),
    "esmc": lambda: T.EsmcForMaskedLM(T.EsmcConfig(**ENCODER, pad_token_id=0)),
    "esm": lambda: (T.EsmForMaskedLM if HF5 else Missing("EsmSelfAttention calling RoPE "
                    "(transformers >= 5)"))(T.EsmConfig(
        **ENCODER, position_embedding_type="rotary", pad_token_id=1, mask_token_id=32)),
    # Higgs Audio v2 on text (5)
    "higgs_audio_v2": lambda: T.HiggsAudioV2ForConditionalGeneration(T.HiggsAudioV2Config(
        **dict(BASE, max_position_embeddings=2048), head_dim=16, num_codebooks=2,
        codebook_size=16, audio_stream_bos_id=16, audio_stream_eos_id=17, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, audio_token_id=100, audio_bos_token_id=101,
        audio_delay_token_id=102)),
    # BLT: its patcher, local encoder and decoder and global transformer (transformers 5.23's
    # fails to make its cache: use_cache off)
    "blt": lambda: without_cache(T.BltForCausalLM(T.BltConfig(
        vocab_size=128, max_position_embeddings=64, patch_size=4, cross_attn_k=2,
        local_attention_window_len=16, encoder_hash_byte_group_size=[3, 4],
        encoder_hash_byte_group_vocab=64, patcher_config=dict(BLT_PART, sliding_window=16),
        encoder_config=dict(BLT_PART, hidden_size_global=64, cross_attn_k=2),
        decoder_config=dict(BLT_PART, hidden_size_global=64, cross_attn_k=2),
        global_config=dict(BLT_PART, hidden_size=64, intermediate_size=128)))),
    # Unlimited OCR's language model, on text (its vision towers have no RoPE) (5)
    "unlimited_ocr": lambda: T.UnlimitedOcrForConditionalGeneration(T.UnlimitedOcrConfig(
        text_config=dict(BASE, num_key_value_heads=1, sliding_window=8, n_routed_experts=2,
                         num_experts_per_tok=1, n_shared_experts=1, moe_intermediate_size=32),
        image_token_id=5, vision_config=dict(
            sam_config=dict(hidden_size=16, output_channels=16, num_hidden_layers=1,
                            num_attention_heads=2, image_size=32, patch_size=4, window_size=0,
                            global_attn_indexes=[0], mlp_dim=32, downsample_channels=[16, 32]),
            encoder_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                num_attention_heads=2, image_size=8, patch_size=4)))),
    # Evolla on text (its language model); its protein encoder in TOWERS
    "evolla": lambda: T.EvollaForProteinText2Text(T.EvollaConfig(**EVOLLA)),
    "ultrabert": lambda: T.UltrabertForMaskedLM(T.UltrabertConfig(**ENCODER, pad_token_id=0)),
    "neomme": lambda: T.NeoMMEForMaskedLM(T.NeoMMEConfig(**ENCODER, pad_token_id=0)),
    # EmbeddingGemma 2: Gemma's attention, no LM head (its last hidden states compared)
    "embedding_gemma2_text": lambda: T.EmbeddingGemma2TextModel(T.EmbeddingGemma2TextConfig(
        **BASE, head_dim=16, pad_token_id=0)),
    # ModernBERT's decoder: a global and a sliding-window layer, each with its own table
    "modernbert-decoder": causal_lm(T.ModernBertDecoderConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, pad_token_id=0, local_attention=8, global_attn_every_n_layers=2)),
    # Emu3: a Llama-form language model over text and VQ image tokens; text inputs
    "emu3_text_model": lambda: EMU3.Emu3ForCausalLM(EMU3.Emu3TextConfig(**BASE, pad_token_id=0)),
    "emu3": lambda: T.Emu3ForConditionalGeneration(T.Emu3Config(
        text_config=dict(BASE, pad_token_id=0), vocabulary_map={"<image>": 5, "<|extra_200|>": 6},
        vq_config=dict(embed_dim=4, codebook_size=16, latent_channels=4, base_channels=32,
                       channel_multiplier=[1, 1], num_res_blocks=1, attn_resolutions=[],
                       temporal_downsample_factor=1))),
    "qwen3_omni_moe_thinker": lambda: T.Qwen3OmniMoeThinkerForConditionalGeneration(
        T.Qwen3OmniMoeThinkerConfig(
            text_config=dict(QWEN3_VL_TEXT, **MOE), vision_config=QWEN3_VL_VISION,
            audio_config=dict(encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=32,
                              d_model=32, output_dim=64, num_mel_bins=16,
                              downsample_hidden_size=8),
            image_token_id=5, video_token_id=6, vision_start_token_id=7, audio_token_id=9,
            audio_start_token_id=4)),
}
# GLM-4.1V and GLM-4.5V: their vision towers' and language models' RoPE. The language models
# rotate the first half of each head (transformers 4's GLM-4.1V: the whole head), split into
# MRoPE sections.
def glm4v(config, model, partial=True, **text):
    sections = [1, 1, 2] if partial or HF5 else [2, 3, 3]
    rope = ({"rope_parameters": dict(rope_type="default", rope_theta=1e4, mrope_section=sections,
                                     partial_rotary_factor=0.5)} if HF5
            else {"rope_scaling": dict(type="default", mrope_section=sections)})
    return lambda: model(config(
        text_config=dict(BASE, **rope, **text), image_token_id=5, video_token_id=6,
        image_start_token_id=7, image_end_token_id=8, vision_config=dict(
            depth=1, hidden_size=32, num_heads=2, patch_size=2, spatial_merge_size=2,
            temporal_patch_size=1, out_hidden_size=64, intermediate_size=64, image_size=8)))


FAMILIES["paddleocr_vl"] = lambda: T.PaddleOCRVLForConditionalGeneration(T.PaddleOCRVLConfig(
    text_config=dict(BASE, head_dim=16, rope_parameters=dict(
        rope_type="default", rope_theta=1e4, mrope_section=[2, 3, 3])),
    vision_config=SIGLIP, image_token_id=5, video_token_id=6,
    vision_start_token_id=7, vision_end_token_id=8))
FAMILIES["ernie4_5_vl_moe"] = lambda: T.Ernie4_5_VLMoeForConditionalGeneration(
    T.Ernie4_5_VLMoeConfig(
        text_config=dict(BASE, head_dim=16, rope_parameters=dict(
            rope_type="default", rope_theta=1e4, mrope_section=[3, 3, 2]), moe_num_experts=2,
            moe_k=1, moe_intermediate_size=[32, 32], moe_num_shared_experts=0),
        vision_config=dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64,
                           patch_size=2, spatial_merge_size=2),
        image_token_id=5, video_token_id=6, image_start_token_id=7, image_end_token_id=8))
# Moonshine: speech in, text out (its encoder's and decoder's self-attention rotate)
FAMILIES["moonshine"] = lambda: T.MoonshineForConditionalGeneration(T.MoonshineConfig(
    vocab_size=128, hidden_size=32, intermediate_size=64, encoder_num_hidden_layers=1,
    decoder_num_hidden_layers=1, encoder_num_attention_heads=2, decoder_num_attention_heads=2,
    pad_token_id=0, decoder_start_token_id=1))
# Kyutai STT: each step's token ids are its text token and the audio codebooks' codes
FAMILIES["kyutai_speech_to_text"] = lambda: T.KyutaiSpeechToTextForConditionalGeneration(
    T.KyutaiSpeechToTextConfig(codebook_vocab_size=128, vocab_size=128, hidden_size=32,
                               num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                               ffn_dim=64, num_codebooks=2, audio_bos_token_id=126,
                               audio_pad_token_id=127, pad_token_id=0, bos_token_id=1,
                               max_position_embeddings=64, sliding_window=32))
# Dia (text to speech): a text encoder, a decoder over the audio channels' codes
DIA_TOKENS = dict(pad_token_id=125, eos_token_id=124, bos_token_id=126)  # the decoder's in 5
FAMILIES["dia"] = lambda: T.DiaForConditionalGeneration(T.DiaConfig(
    encoder_config=T.DiaEncoderConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2,
                                      num_key_value_heads=2, head_dim=16, intermediate_size=64,
                                      vocab_size=128),
    decoder_config=T.DiaDecoderConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                                      num_attention_heads=2, num_key_value_heads=2, head_dim=16,
                                      cross_num_attention_heads=2, cross_head_dim=16,
                                      cross_num_key_value_heads=2, cross_hidden_size=32,
                                      vocab_size=128, num_channels=2, **(DIA_TOKENS if HF5 else {})),
    delay_pattern=[0, 1], **({} if HF5 else DIA_TOKENS)))
# HunYuan-VL (5): its language model's RoPE (four-axis tables, OLMo's float32 rotation), the
# per-head norms after it
FAMILIES["hunyuan_vl"] = lambda: T.HunYuanVLForConditionalGeneration(T.HunYuanVLConfig(
    text_config=dict(BASE, head_dim=16, rope_parameters=dict(
        rope_type="default", rope_theta=1e4, mrope_section=[2, 2, 2, 2])),
    vision_config=dict(hidden_size=32, intermediate_size=64, num_attention_heads=2,
                       num_hidden_layers=1, out_hidden_size=64, patch_size=2, text_hidden_size=64),
    image_token_id=120, im_start_id=121, im_end_id=122, im_newline_id=123))
# GLM-Image (5): its autoregressive model's RoPE (MRoPE tables, Llama's rotation)
FAMILIES["glm_image"] = lambda: T.GlmImageForConditionalGeneration(T.GlmImageConfig(
    text_config=dict(BASE, pad_token_id=0, eos_token_id=2, vision_vocab_size=64,
                     rope_parameters=dict(rope_type="default", rope_theta=1e4,
                                          mrope_section=[2, 3, 3])),
    vision_config=dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, patch_size=2),
    vq_config=dict(embed_dim=8, num_embeddings=16), image_token_id=120, image_start_token_id=121,
    image_end_token_id=122))
# Qwen2.5-Omni's thinker: its language model's MRoPE (its vision tower's RoPE too under
# transformers 5; its audio encoder has none)
FAMILIES["qwen2_5_omni_thinker"] = lambda: T.Qwen2_5OmniThinkerForConditionalGeneration(
    T.Qwen2_5OmniThinkerConfig(
        text_config=dict(BASE, **({"rope_parameters": dict(rope_type="default", rope_theta=1e4,
                                                            mrope_section=[2, 3, 3])} if HF5 else
                                  {"rope_scaling": dict(rope_type="default",
                                                        mrope_section=[2, 3, 3])})),
        vision_config=dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64,
                           patch_size=2, spatial_merge_size=2, temporal_patch_size=1,
                           out_hidden_size=64, fullatt_block_indexes=[0]),
        audio_config=dict(encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=32,
                          d_model=32, output_dim=64, num_mel_bins=16),
        image_token_index=5, video_token_index=6, vision_start_token_id=7, audio_token_index=9,
        audio_start_token_id=4))
MOE2_DEEPSEEK = dict(n_routed_experts=2, num_experts_per_tok=1, moe_intermediate_size=32,
                     n_shared_experts=1, mlp_layer_types=["dense", "sparse"])


def part(exported, model, config, **sizes):
    """A part of a model that transformers exports whole (`exported`), not part by part: classes
    `model` and `config` of its modeling module (Missing where this version lacks it)."""
    exported = getattr(T, exported)
    if isinstance(exported, Missing):
        return exported
    modeling = sys.modules[exported.__module__]
    return getattr(modeling, model)(getattr(modeling, config)(**sizes))


def ocr2_part(model, config, **sizes):
    return part("DeepseekOcr2ForConditionalGeneration", model, config, **sizes)


# Granite 4 Vision's and DeepSeek-OCR 2's language models (5; tested alone: their last hidden
# states)
FAMILIES["granite4_vision_text"] = lambda: T.Granite4VisionTextModel(
    T.Granite4VisionTextConfig(**BASE))
FAMILIES["deepseek_ocr2_text"] = lambda: ocr2_part("DeepseekOcr2TextModel", "DeepseekOcr2TextConfig",
                                                   **BASE, **MOE2_DEEPSEEK)
TINY_HEADS = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=2)
FAMILIES["moonshine_streaming"] = lambda: T.MoonshineStreamingForConditionalGeneration(  # 5
    T.MoonshineStreamingConfig(**TINY_HEADS, encoder_config=TINY_HEADS, vocab_size=128,
                               pad_token_id=0, decoder_start_token_id=1))
FAMILIES["glm4v"] = glm4v(T.Glm4vConfig, T.Glm4vForConditionalGeneration, partial=False)
FAMILIES["glm4v_moe"] = glm4v(T.Glm4vMoeConfig, T.Glm4vMoeForConditionalGeneration,
                              n_routed_experts=2, num_experts_per_tok=1, first_k_dense_replace=1,
                              n_group=1, topk_group=1, moe_intermediate_size=32)
MOE2 = dict(num_local_experts=2, num_experts_per_tok=1)
MLA = dict(q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
           moe_intermediate_size=32)
MOE_DS = dict(n_routed_experts=2, num_experts_per_tok=1, first_k_dense_replace=1, n_group=1,
              topk_group=1)  # DeepSeek's experts
KV4 = dict(BASE, num_key_value_heads=4)
INDEXER = dict(index_n_heads=2, index_head_dim=16, index_topk=4)
FAMILIES.update({  # the rotate-half RoPE of Llama, each family's attention around it
    "smollm3": causal_lm(T.SmolLM3Config(**BASE, pad_token_id=0)),
    "seed_oss": causal_lm(T.SeedOssConfig(**BASE, head_dim=16)),
    "arcee": causal_lm(T.ArceeConfig(**BASE)),
    "ministral": causal_lm(T.MinistralConfig(**BASE, head_dim=16, sliding_window=8,
                                             layer_types=["sliding_attention", "full_attention"])),
    "vaultgemma": causal_lm(T.VaultGemmaConfig(**BASE, head_dim=16)),
    "diffllama": causal_lm(T.DiffLlamaConfig(**BASE)),
    "bitnet": causal_lm(T.BitNetConfig(**BASE)),
    "falcon": causal_lm(T.FalconConfig(**BASE, new_decoder_architecture=True, num_kv_heads=2)),
    "nemotron": causal_lm(T.NemotronConfig(**BASE, partial_rotary_factor=0.5)),
    "persimmon": causal_lm(T.PersimmonConfig(**BASE, partial_rotary_factor=0.5,
                                             qk_layernorm=True)),  # LayerNorms: not fused
    "granitemoe": causal_lm(T.GraniteMoeConfig(**BASE, **MOE2)),
    "granitemoeshared": causal_lm(T.GraniteMoeSharedConfig(**BASE, **MOE2,
                                                           shared_intermediate_size=32)),
    "granitemoehybrid": causal_lm(T.GraniteMoeHybridConfig(
        **BASE, **MOE2, position_embedding_type="rope", layer_types=["mamba", "attention"],
        mamba_n_heads=4, mamba_d_head=32, mamba_d_state=8, mamba_n_groups=1)),
    "bamba": causal_lm(T.BambaConfig(**BASE, attn_layer_indices=[1], mamba_n_heads=4,
                                     mamba_d_head=32, mamba_d_state=8, mamba_n_groups=1)),
    "jetmoe": causal_lm(T.JetMoeConfig(**BASE)),
    "minimax": causal_lm(T.MiniMaxConfig(**BASE, head_dim=16, **MOE2,
                                         layer_types=["linear_attention", "full_attention"])),
    "hunyuan_v1_dense": causal_lm(T.HunYuanDenseV1Config(**BASE, head_dim=16)),
    "hunyuan_v1_moe": causal_lm(T.HunYuanMoEV1Config(**BASE, head_dim=16, num_experts=2,
                                                     moe_topk=1)),
    "olmo": causal_lm(T.OlmoConfig(**BASE)),
    "olmo3": causal_lm(T.Olmo3Config(**BASE, sliding_window=8)),
    "olmoe": causal_lm(T.OlmoeConfig(**BASE, num_experts=2, num_experts_per_tok=1)),
    # interleaved pairs: GLM's tables (the first half read), Cohere's (each angle twice, side by side)
    "glm": causal_lm(T.GlmConfig(**BASE, head_dim=16, pad_token_id=0)),  # partial rotary
    "glm4": causal_lm(T.Glm4Config(**BASE, head_dim=16, pad_token_id=0)),
    "helium": causal_lm(T.HeliumConfig(**BASE, head_dim=16)),
    "ernie4_5": causal_lm(T.Ernie4_5Config(**BASE, head_dim=16)),
    "ernie4_5_moe": causal_lm(T.Ernie4_5_MoeConfig(**BASE, head_dim=16, moe_num_experts=2, moe_k=1,
                                                   moe_intermediate_size=32)),
    "gpt_oss": causal_lm(T.GptOssConfig(**BASE, head_dim=16, **MOE2, sliding_window=8,
                                        layer_types=["sliding_attention", "full_attention"])),
    # DeepSeek-V3's MLA (latent q and kv, a rotated part of each head): pairs rotated and laid
    # out as halves (rope_interleave), or Llama's RoPE
    # complex tables; dense layers (transformers 4's MoE does not trace as one graph)
    "deepseek_v2": causal_lm(T.DeepseekV2Config(**KV4, **MLA,
                                                **dict(MOE_DS, first_k_dense_replace=2))),
    "deepseek_v3": causal_lm(T.DeepseekV3Config(**BASE, **MLA, n_routed_experts=2,
                                                num_experts_per_tok=1, first_k_dense_replace=1,
                                                n_group=1, topk_group=1)),
    "longcat_flash": causal_lm(T.LongcatFlashConfig(
        **BASE, **MLA, head_dim=8, num_layers=1, ffn_hidden_size=64, expert_ffn_hidden_size=32,
        n_routed_experts=2, moe_topk=2, zero_expert_num=1)),
    "cohere": causal_lm(T.CohereConfig(**BASE, use_qk_norm=True)),  # LayerNorms: not fused
    "cohere2": causal_lm(T.Cohere2Config(**BASE, sliding_window=8,
                                         layer_types=["sliding_attention", "full_attention"])),
    "codegen": causal_lm(T.CodeGenConfig(vocab_size=128, n_embd=64, n_layer=2, n_head=4,
                                         rotary_dim=8, n_positions=128, n_ctx=128)),
    # Mamba 2 / recurrent layers beside attention ones
    "falcon_h1": causal_lm(T.FalconH1Config(
        **BASE, head_dim=16, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8,
        mamba_n_groups=1, mamba_chunk_size=16)),
    "zamba2": causal_lm(T.Zamba2Config(
        vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=128, mamba_d_state=8, n_mamba_heads=4, use_mem_rope=True,
        layers_block_type=["mamba", "hybrid"], use_mamba_kernels=False)),
    "recurrent_gemma": causal_lm(T.RecurrentGemmaConfig(**BASE, head_dim=16, lru_width=64,
                                                        block_types=["recurrent", "attention"])),
    "dbrx": causal_lm(T.DbrxConfig(
        d_model=64, n_heads=4, n_layers=2, max_seq_len=128, vocab_size=128,
        attn_config=dict(kv_n_heads=2, clip_qkv=8.0, rope_theta=1e4),
        ffn_config=dict(ffn_hidden_size=32, moe_num_experts=2, moe_top_k=1))),
    "gpt_neox_japanese": causal_lm(T.GPTNeoXJapaneseConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_multiple_size=2, rotary_pct=0.5, max_position_embeddings=128)),
    "moshi": causal_lm(T.MoshiConfig(**BASE, audio_vocab_size=16, num_codebooks=2,
                                     depth_decoder_config=dict(
                                         hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                         audio_vocab_size=16, num_codebooks=2, vocab_size=128,
                                         input_size=64))),
    "chameleon": lambda: T.ChameleonForConditionalGeneration(T.ChameleonConfig(
        **BASE, vocabulary_map={"<image>": 5}, vq_config=dict(
            embed_dim=8, num_embeddings=16, base_channels=32, channel_multiplier=[1],
            num_res_blocks=1))),
    "phi4_multimodal": lambda: T.Phi4MultimodalForCausalLM(T.Phi4MultimodalConfig(
        **BASE, partial_rotary_factor=0.5, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, image_size=8, patch_size=2, crop_size=8,
                           image_token_id=5),
        audio_config=dict(hidden_size=32, intermediate_size=64, num_blocks=1, num_attention_heads=2,
                          ext_pw_out_channel=32, depthwise_separable_out_channel=32,
                          nemo_conv_channels=32, input_size=16, audio_token_id=6))),
    "t5gemma": lambda: T.T5GemmaForConditionalGeneration(T.T5GemmaConfig(
        encoder=dict(BASE, head_dim=16, sliding_window=8),
        decoder=dict(BASE, head_dim=16, sliding_window=8), vocab_size=128)),
    "flex_olmo": causal_lm(T.FlexOlmoConfig(**BASE, **MOE, pad_token_id=0)),
})
if HF5:
    QWEN3_5_TEXT = dict(BASE, head_dim=16, layer_types=["linear_attention", "full_attention"],
                        linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=8,
                        linear_value_head_dim=8)
    FAMILIES["qwen3_5_text"] = causal_lm(T.Qwen3_5TextConfig(**QWEN3_5_TEXT))
    QWEN3_5_VISION = dict(depth=1, hidden_size=32, out_hidden_size=64, intermediate_size=64,
                          num_heads=2, patch_size=2, spatial_merge_size=2,
                          temporal_patch_size=1, num_position_embeddings=16)
    FAMILIES["qwen3_5"] = lambda: T.Qwen3_5ForConditionalGeneration(T.Qwen3_5Config(
        text_config=QWEN3_5_TEXT, vision_config=QWEN3_5_VISION))
    FAMILIES["qwen3_5_moe"] = lambda: T.Qwen3_5MoeForConditionalGeneration(T.Qwen3_5MoeConfig(
        text_config=dict(QWEN3_5_TEXT, **MOE, shared_expert_intermediate_size=32),
        vision_config=QWEN3_5_VISION))
    # GPT-OSS's tables (one entry per pair) on interleaved pairs, a token classifier
    FAMILIES["openai_privacy_filter"] = lambda: T.OpenAIPrivacyFilterForTokenClassification(
        T.OpenAIPrivacyFilterConfig(**dict(BASE, num_key_value_heads=1), head_dim=16,
                                    num_local_experts=2, num_experts_per_tok=1, sliding_window=4,
                                    pad_token_id=0, eos_token_id=0))
    # Gemma 4's one-tensor QK-norm + RoPE in an encoder (the prompt) and a decoder (the canvas)
    FAMILIES["diffusion_gemma"] = lambda: T.DiffusionGemmaForBlockDiffusion(T.DiffusionGemmaConfig(
        text_config=dict(BASE, head_dim=16, sliding_window=8, num_experts=2, top_k_experts=1,
                         moe_intermediate_size=32,
                         layer_types=["sliding_attention", "full_attention"]),
        vision_config=None, canvas_length=4))
    # A linear-attention layer and an indexed one, whose indexer rotates queries alone
    QWEN4_EXP_TEXT = dict(
        BASE, head_dim=16, layer_types=["linear_attention", "indexed_attention"],
        linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8,
        linear_value_head_dim=8, **MOE, shared_expert_intermediate_size=32, hc_count=2,
        hc_lowrank=8, indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16,
        indexer_budget=4, indexer_compress_ratio=2,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5))
    FAMILIES["qwen4_exp_text"] = causal_lm(T.Qwen4ExpTextConfig(**QWEN4_EXP_TEXT))
    FAMILIES["qwen4_exp"] = lambda: T.Qwen4ExpForConditionalGeneration(T.Qwen4ExpConfig(
        text_config=QWEN4_EXP_TEXT, vision_config=QWEN3_5_VISION))
    # Sliding and global layers (each with its own head dim and table), the last two reusing
    # the keys of the first two (their attention norms and rotates q only).
    GEMMA4_TEXT = dict(BASE, num_hidden_layers=4, head_dim=16, global_head_dim=32,
                       sliding_window=8, num_kv_shared_layers=2, hidden_size_per_layer_input=8,
                       vocab_size_per_layer_input=128,
                       layer_types=["sliding_attention", "full_attention"] * 2)
    FAMILIES["gemma4_text"] = causal_lm(T.Gemma4TextConfig(**GEMMA4_TEXT))
    FAMILIES["gemma4"] = lambda: T.Gemma4ForConditionalGeneration(T.Gemma4Config(
        text_config=GEMMA4_TEXT, audio_config=None, vision_config=dict(
            hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            head_dim=16)))
    FAMILIES["gemma4_unified_text"] = causal_lm(T.Gemma4UnifiedTextConfig(
        **BASE, head_dim=16, global_head_dim=32, sliding_window=8, hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=128, layer_types=["sliding_attention", "full_attention"]))
    FAMILIES.update({  # Qwen3's shape, transformers 5 only
        "hy_v3": causal_lm(T.HYV3Config(**BASE, head_dim=16)),
        "laguna": causal_lm(T.LagunaConfig(**BASE, head_dim=16)),
        "mellum": causal_lm(T.MellumConfig(**BASE, head_dim=16)),
        # a sparse layer's indexer rotates by a slice of the layer's table (index_head_dim <
        # head_dim: the slice's halves differ), which transformers' code keeps serving. Every
        # token takes all 4 experts: a router choosing among them flips its choice for a token
        # on a last-bit difference, and the logits then differ by far more than the rounding
        # (test_bf16_model_patched_runs_as_accurately_as_unpatched measures the rounding).
        "minimax_m3_vl_text": causal_lm(T.MiniMaxM3VLTextConfig(
            **BASE, head_dim=16, layer_types=["minimax_m3_sparse", "full_attention"],
            num_local_experts=4, num_experts_per_tok=4,
            index_n_heads=2, index_head_dim=8, index_block_size=2, index_topk_blocks=2,
            index_local_blocks=1)),
        "lfm3": causal_lm(T.Lfm3Config(**BASE, head_dim=16, pad_token_id=0,
                                       layer_types=["sliding_attention", "full_attention"])),
    })
    # Encoder-decoder: the encoder's and decoder's self-attention fused; the decoder's merged
    # self- and cross-attention too (its k_norm of the cross keys stays as it is).
    FAMILIES["t5gemma2"] = lambda: T.T5Gemma2ForConditionalGeneration(T.T5Gemma2Config(
        encoder=dict(text_config=dict(BASE, head_dim=16), vision_config=SIGLIP),
        decoder=dict(BASE, head_dim=16)))
    FAMILIES["step3p7"] = lambda: T.Step3p7ForConditionalGeneration(T.Step3p7Config(
        text_config=dict(BASE, head_dim=16, sliding_window=8),
        vision_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                           intermediate_size=64, patch_size=2, image_size=8)))
    FAMILIES["exaone4_5"] = lambda: T.Exaone4_5_ForConditionalGeneration(T.Exaone4_5_Config(
        text_config=dict(BASE, model_type="exaone4", head_dim=16, **NOPE_GLOBAL),
        vision_config=dict(depth=1, hidden_size=32, out_hidden_size=64, intermediate_size=64,
                           num_heads=2, patch_size=2, spatial_merge_size=2,
                           temporal_patch_size=1)))
    FAMILIES["minimax_m3_vl"] = lambda: T.MiniMaxM3SparseForConditionalGeneration(
        T.MiniMaxM3VLConfig(
            text_config=dict(BASE, head_dim=16, num_local_experts=4, num_experts_per_tok=4),
            projector_hidden_size=32, image_token_index=5,
            video_token_index=6, vision_config=dict(
                hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                patch_size=2, image_size=8, temporal_patch_size=1)))
    # Norms per head (qk_norm_type "qwen3", fused) or over all heads ("olmo", not: its forward
    # has both, each under its condition)
    FAMILIES["molmo2"] = lambda: T.Molmo2ForConditionalGeneration(T.Molmo2Config(
        text_config=dict(BASE, head_dim=16, additional_vocab_size=8),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=2, head_dim=16,
                           image_size=[8, 8], patch_size=2),
        adapter_config=dict(hidden_size=32, num_attention_heads=2, num_key_value_heads=2,
                            head_dim=16, intermediate_size=64, text_hidden_size=64,
                            vision_feature_layer=[-1]),
        image_start_token_id=120, low_res_image_start_token_id=121, image_end_token_id=122,
        image_patch_id=123, frame_start_token_id=124, frame_end_token_id=125))
    # The vision tower's QK norms fused into its RoPE (the language model's is GLM's, not patched)
    FAMILIES["glm_ocr"] = lambda: T.GlmOcrForConditionalGeneration(T.GlmOcrConfig(
        text_config=dict(BASE, rope_parameters=dict(rope_type="default", rope_theta=1e4,
                                                    mrope_section=[2, 3, 3])),
        vision_config=dict(depth=1, hidden_size=32, num_heads=2, patch_size=2,
                           spatial_merge_size=2, temporal_patch_size=1, out_hidden_size=64,
                           intermediate_size=64, image_size=8),
        image_token_id=5, video_token_id=6, image_start_token_id=7, image_end_token_id=8,
        video_start_token_id=9, video_end_token_id=10))
    FAMILIES["lfm2_vl"] = lambda: T.Lfm2VlForConditionalGeneration(T.Lfm2VlConfig(
        text_config=dict(BASE, model_type="lfm2", layer_types=["conv", "full_attention"]),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, patch_size=2, num_patches=16),
        projector_hidden_size=32, image_token_id=5))
    FAMILIES["lfm2_moe"] = causal_lm(T.Lfm2MoeConfig(
        **BASE, layer_types=["conv", "full_attention"], num_dense_layers=1, num_experts=2,
        num_experts_per_tok=1, moe_intermediate_size=32))
    FAMILIES.update({  # DeepSeek-V3's MLA and its RoPE (transformers 5 only)
        "glm4_moe_lite": causal_lm(T.Glm4MoeLiteConfig(
            **BASE, **MLA, n_routed_experts=2, num_experts_per_tok=1,
            mlp_layer_types=["dense", "sparse"])),
        "mistral4": lambda: T.Mistral4ForCausalLM(T.Mistral4Config(
            **BASE, **MLA, n_routed_experts=2, num_experts_per_tok=1)),
        "youtu": causal_lm(T.YoutuConfig(**BASE, **MLA)),
        # with an indexer (as many kv heads as heads)
        "deepseek_v32": causal_lm(T.DeepseekV32Config(**KV4, **MLA, **MOE_DS, **INDEXER)),
        # each kind of layer (compressed sparse with its indexer, heavily compressed, sliding)
        "deepseek_v4": causal_lm(T.DeepseekV4Config(
            **dict(BASE, num_hidden_layers=3, num_key_value_heads=1), head_dim=32, q_lora_rank=32,
            moe_intermediate_size=32, num_experts_per_tok=1, n_routed_experts=2, o_groups=2,
            o_lora_rank=16, **INDEXER, sliding_window=8, qk_rope_head_dim=8, hc_mult=2,
            hc_sinkhorn_iters=2, num_nextn_predict_layers=0,
            layer_types=["compressed_sparse_attention", "heavily_compressed_attention",
                         "sliding_attention"],
            compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
            mlp_layer_types=["hash_moe", "moe", "moe"])),
        "glm_moe_dsa": causal_lm(T.GlmMoeDsaConfig(**KV4, **MLA, **MOE_DS, **INDEXER)),
        "axk2": causal_lm(T.AXK2Config(**KV4, **MLA, **MOE_DS, **INDEXER)),
        "dots3_note_text": causal_lm(T.Dots3NoteTextConfig(**KV4, **MLA, **MOE_DS, pad_token_id=0)),
        "bailing_hybrid": causal_lm(T.BailingHybridConfig(**BASE, **MLA, **MOE_DS,
                                                          layer_group_size=2, pad_token_id=0)),
        "axk1": causal_lm(T.AXK1Config(**BASE, **MLA, **MOE_DS)),
        "minicpm3": causal_lm(T.MiniCPM3Config(**BASE, **MLA)),  # MLA, Llama's RoPE
        # the second layer reuses the first's keys: its attention rotates q alone
        "mistral_large4": lambda: T.MistralLarge4ForConditionalGeneration(T.MistralLarge4Config(
            text_config=dict(KV4, **MLA, **MOE_DS, **INDEXER, pad_token_id=0,
                             kv_source_layers=[0, 0]),
            vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                               num_attention_heads=2, image_size=8, patch_size=2, head_dim=16))),
    })
    FAMILIES.update({  # Llama's RoPE (OLMo's in the inputs' dtypes, Cohere's pairs), transformers 5
        "minimax_m2": causal_lm(T.MiniMaxM2Config(**BASE, head_dim=16, **MOE)),
        "mimo_v2_flash": causal_lm(T.MiMoV2FlashConfig(**BASE, head_dim=16, **MOE)),
        "ministral3": causal_lm(T.Ministral3Config(**BASE, head_dim=16)),
        "cwm": causal_lm(T.CwmConfig(**BASE, head_dim=16)),
        "hyperclovax": causal_lm(T.HyperCLOVAXConfig(**BASE, head_dim=16)),
        "jais2": causal_lm(T.Jais2Config(**BASE)),
        "solar_open": causal_lm(T.SolarOpenConfig(**BASE, head_dim=16, **MOE)),
        "hy_v4": causal_lm(T.HYV4Config(**BASE, head_dim=16, **MOE, pad_token_id=0)),
        "zaya": causal_lm(T.ZayaConfig(**BASE, head_dim=16, **MOE)),
        "hrm_text": causal_lm(T.HrmTextConfig(**BASE, head_dim=16)),
        "granite_swa": causal_lm(T.GraniteSWAConfig(**BASE, sliding_window=8)),
        # every token takes both experts: a router choosing between them flips its choice for a
        # token on a last-bit difference of bfloat16 rounding
        "granitemoe_swa": causal_lm(T.GraniteMoeSWAConfig(**BASE, num_local_experts=2,
                                                          num_experts_per_tok=2, sliding_window=8)),
        "olmo_hybrid": causal_lm(T.OlmoHybridConfig(**BASE, pad_token_id=0)),
        "beam": causal_lm(T.BeamConfig(**BASE, head_dim=16, **NOPE_GLOBAL)),  # QK-norm, as EXAONE 4
        "cohere2_moe": causal_lm(T.Cohere2MoeConfig(**BASE, **MOE)),
    })
    FAMILIES.update({  # RoPE on some layers only, as EXAONE 4
        "exaone_moe": causal_lm(T.ExaoneMoeConfig(**BASE, head_dim=16, **NOPE_GLOBAL)),
        "afmoe": causal_lm(T.AfmoeConfig(**BASE, head_dim=16, **NOPE_GLOBAL)),
        "flint": causal_lm(T.FlintConfig(**BASE, head_dim=16, **NOPE_GLOBAL)),
        "kolibri1": causal_lm(T.Kolibri1Config(**BASE, head_dim=16, **NOPE_GLOBAL)),
    })
ENCODER_DECODER = {"t5gemma2", "t5gemma", "dia", "diffusion_gemma"}
DECODER_TOKENS = {"dia": (2, 12, 2),  # decoder_input_ids' shape where not input_ids' (2 channels)
                  "diffusion_gemma": (2, 4)}  # (its canvas)
SPEECH = {"moonshine", "moonshine_streaming"}
VL = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "glm_ocr", "glm4v", "glm4v_moe",
      "paddleocr_vl", "ernie4_5_vl_moe", "qwen2_5_omni_thinker")
PATCHES = {"paddleocr_vl": (16, 3, 2, 2)}  # pixel_values' shape where not (patches, 12)
TOKENS = {"kyutai_speech_to_text": (2, 12, 3)}  # input_ids' shape where not (batch, tokens)
# The families that normalize q and k per head right before RoPE: patched onto the fused op.
QK_NORM = {"qwen3", "qwen3_moe", "gemma3_text", "qwen3_next", "glm4_moe", "qwen3_5_text",
           "qwen3_vl", "qwen3_vl_moe", "gemma4_text", "gemma3n_text", "dots1", "apertus",
           "exaone4", "doge", "gemma4_unified_text", "hy_v3", "laguna", "mellum",
           "minimax_m3_vl_text", "lfm3", "qwen3_omni_moe_thinker", "t5gemma2", "step3p7", "exaone4_5",
           "minimax_m3_vl", "gemma3", "gemma4", "qwen3_5", "qwen3_5_moe",
           "molmo2", "glm_ocr", "exaone_moe", "afmoe", "flint", "kolibri1", "lfm2", "lfm2_moe",
           "lfm2_vl", "beam", "embedding_gemma2_text", "qwen4_exp_text", "qwen4_exp",
           "diffusion_gemma"}
# Of those, the families whose attention norms and rotates q and k in separate calls: the fused
# op runs once for each (q only in Gemma 4's layers that reuse another layer's keys).
ONE_TENSOR = {"gemma4_text", "gemma4", "gemma3n_text", "gemma4_unified_text", "diffusion_gemma"}
# And those whose attention rotates on some layers only (it norms on all): the fused op runs on
# those, the norms alone on the others.
SOME_LAYERS = {"exaone4", "exaone4_5", "exaone_moe", "afmoe", "flint", "kolibri1", "beam"}


def fused_per_attention(family, calls):
    """Whether the fused op ran as often as the family's patched attention calls it."""
    if family in ONE_TENSOR:
        return calls["fused attention"] <= calls["fused"] <= 2 * calls["fused attention"]
    if family in SOME_LAYERS:  # both kinds of layer ran
        return 0 < calls["fused"] < calls["fused attention"]
    return calls["fused"] == calls["fused attention"]
# rope ops of one batch through a 2-layer model of a family without QK norms: at these sizes
# compat.transformers rotates q and k in one call (ONE_CALL_NUMEL).
OPS = 2


class RopeOps(TorchDispatchMode):
    """Counts the rope::* ops run inside it."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.namespace == "rope"
        return func(*args, **(kwargs or {}))


def build(family, dtype=torch.float32):
    torch.manual_seed(0)
    model = FAMILIES[family]()
    if isinstance(model, Missing):
        pytest.skip(f"transformers {transformers.__version__} has no {model.name}")
    return model.to(dtype).eval()


def inputs(family):
    ids = torch.randint(10, 128, TOKENS.get(family, (2, 12)))
    if family in ENCODER_DECODER:
        decoder_ids = (torch.randint(10, 124, DECODER_TOKENS[family]) if family in DECODER_TOKENS
                       else ids.flip(1))
        return [dict(input_ids=ids, decoder_input_ids=decoder_ids)]
    if family in SPEECH:  # 1/8 s of 16 kHz audio
        return [dict(input_values=torch.randn(2, 2000), decoder_input_ids=ids)]
    if family not in VL:
        return [dict(input_ids=ids)]
    # Text with distinct temporal/height/width positions, and a 4x4-patch image (4 merged tokens)
    # that runs the vision tower's RoPE too.
    image_ids = torch.randint(10, 128, (1, 12))
    image_ids[0, 2], image_ids[0, 3:7], image_ids[0, 7] = 7, 5, 8
    image = dict(input_ids=image_ids, pixel_values=torch.randn(PATCHES.get(family, (16, 12))),
                 image_grid_thw=torch.tensor([[1, 4, 4]]))
    if HF5:  # transformers 5 takes the image tokens' places from the processor's token types
        image["mm_token_type_ids"] = (image_ids == 5).int()
    return [dict(input_ids=ids, position_ids=torch.randint(0, 100, (3, 2, 12))), image]


def text_batch(model, ids):
    """Model inputs of the token ids: the decoder's too for an encoder-decoder model, and the
    token types (all text) for a multimodal model that takes them."""
    batch = dict(input_ids=ids)
    if model.config.is_encoder_decoder:
        batch["decoder_input_ids"] = ids.flip(1)
    if "mm_token_type_ids" in inspect.signature(model.forward).parameters:
        batch["mm_token_type_ids"] = torch.zeros_like(ids)
    return batch


def logits(model, batches):
    """The model's logits on each batch (an embedding model's last hidden states), and the rope
    ops it ran."""
    counter = RopeOps()
    with torch.no_grad(), counter:
        out = [model(**b) for b in batches]
    out = [o.logits if getattr(o, "logits", None) is not None else o.last_hidden_state for o in out]
    return out, counter.count


def rope_functions(family):
    path, functions = integration.FAMILIES[family]
    module = __import__(f"transformers.models.{path}", fromlist=["_"])
    return {name: getattr(module, name) for name in functions if hasattr(module, name)}


def gradients(model, ids):
    """Every parameter's gradient of the language-model loss on ids (an embedding model's: the
    mean square of its last hidden states), fresh: grads zeroed first."""
    model.zero_grad()
    torch.manual_seed(0)  # (DiffusionGemma's training forward draws its noise)
    out = model(**text_batch(model, ids), labels=ids)
    if out.get("loss") is None:  # an embedding model's, or DiffusionGemma's (its logits)
        last = out.get("last_hidden_state")
        (out.logits if last is None else last).pow(2).mean().backward()
    else:
        out.loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def patched_calls(model, batches):
    """(logits, rope ops, calls of patched attention modules, of fused ones, of the fused op):
    what ran rope_ext while the model ran on `batches`."""
    calls = {"attention": 0, "fused attention": 0, "fused": 0}
    handles = []
    for m in model.modules():
        spec = getattr(type(m), "_rope_ext_spec", None)
        if spec is not None:
            kind = "fused attention" if spec[2] else "attention"
            handles.append(m.register_forward_pre_hook(
                lambda *_, kind=kind: calls.__setitem__(kind, calls[kind] + 1)))
    api = _qk_norm.fused_op

    def counted(*args, **kwargs):
        calls["fused"] += 1
        return api(*args, **kwargs)

    _qk_norm.fused_op = counted
    try:
        out, n = logits(model, batches)
    finally:
        _qk_norm.fused_op = api
        for h in handles:
            h.remove()
    return out, n, calls


@pytest.mark.parametrize("family", ["qwen3", "gemma3_text", "gemma3n_text"])
def test_fused_qk_norm_keeps_the_projections_memory_order(family, monkeypatch):
    """The fused QK-norm + RoPE takes transformers' q and k, (batch, heads, seq, head_dim) views
    of (batch, seq, heads, head_dim) projections, in the projections' order, as the plain RoPE
    drop-in does: attention's output then follows it, and the transpose after attention is a
    view, not a copy (saved for backward in training)."""
    if family not in FAMILIES:
        pytest.skip(f"{family} is not in this transformers")
    model = build(family)
    batches = inputs(family)
    want, _ = logits(model, batches)
    integration.patch(model)
    api, orders = _qk_norm.fused_op, []

    def recorded(q, k, *args):
        out = api(q, k, *args)
        orders.append((q.is_contiguous(), out[0].is_contiguous()))
        return out

    monkeypatch.setattr(_qk_norm, "fused_op", recorded)
    got, _ = logits(model, batches)
    assert orders and all(order == (True, True) for order in orders), orders
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_patched_model_same_logits(family):
    model = build(family)
    batches = inputs(family)
    originals = rope_functions(family)
    want, n_before = logits(model, batches)
    assert n_before == 0
    assert integration.patch(model) is model and integration.is_patched(model)
    got, n_patched, calls = patched_calls(model, batches)
    # Every patched attention call ran rope_ext: its rope ops (q and k in one call or two), or
    # the fused QK-norm + RoPE once per call, in exactly the families that normalize q and k.
    assert calls["attention"] + calls["fused attention"] > 0
    assert n_patched >= calls["attention"]
    assert fused_per_attention(family, calls)
    assert (calls["fused attention"] > 0) == (family in QK_NORM)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    assert integration.unpatch(model) is model and not integration.is_patched(model)
    again, n_after = logits(model, batches)
    assert n_after == 0 and all(torch.equal(a, w) for a, w in zip(again, want))
    assert rope_functions(family) == originals  # transformers' own function objects again
    assert not any("forward" in m.__dict__ for m in model.modules())


@pytest.mark.parametrize("family", ["qwen2_moe", "stablelm", "nemotron", "jetmoe", "olmoe", "dbrx",
                                    "moshi"])
def test_a_forward_handing_its_call_to_its_parent_class_runs_rope_ext_there(family):
    """transformers 4's SDPA attention of these families hands a call with output_attentions=True
    to its eager parent class (super().forward): that forward is patched too, so the call runs
    rope_ext's ops, with transformers' logits and attention weights; a deepcopy does the same,
    and unpatch leaves no patched class (under transformers 5, one attention class serves)."""
    model = build(family)
    ids = torch.randint(10, 128, (2, 12))
    with torch.no_grad():
        want = model(input_ids=ids, output_attentions=True)
    integration.patch(model)
    for m in (model, copy.deepcopy(model)):
        counter = RopeOps()
        with torch.no_grad(), counter:
            got = m(input_ids=ids, output_attentions=True)
        assert counter.count > 0
        torch.testing.assert_close(got.logits, want.logits, rtol=1e-5, atol=1e-5)
        for g, w in zip(got.attentions, want.attentions):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    integration.unpatch(model)
    assert not any(isinstance(m, integration._PatchedAttention) for m in model.modules())
    assert logits(model, [dict(input_ids=ids)])[1] == 0


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_patch_inside_init_empty_weights(family, monkeypatch):
    """Big-model loading builds the model with its parameters on meta (accelerate's and
    transformers' init_empty_weights, which also catch the probe's new norm), patches, then loads
    the weights: the QK-norm is fused, and the logits are transformers'."""
    accelerate = pytest.importorskip("transformers.integrations.accelerate")
    if not hasattr(accelerate, "init_empty_weights"):
        pytest.skip("this transformers has no init_empty_weights")
    monkeypatch.setattr(integration, "_verified", {})
    monkeypatch.setattr(_qk_norm, "_norm_forms", {})  # the norm class probed afresh, inside
    reference = build(family)
    batches = inputs(family)
    want, _ = logits(reference, batches)
    with accelerate.init_empty_weights():
        model = build(family)
        integration.patch(model)
    model = model.to_empty(device="cpu")
    model.load_state_dict(reference.state_dict())
    with torch.no_grad():  # non-persistent buffers (inv_freq) are not in the state dict
        for b, rb in zip(model.buffers(), reference.buffers()):
            b.copy_(rb)
    got, _, calls = patched_calls(model.eval(), batches)
    assert (calls["fused attention"] > 0) == (family in QK_NORM)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("default", ["bfloat16", "meta"])
@pytest.mark.parametrize("family", ["llama", "qwen3", "olmo2"])
def test_patch_whatever_torch_defaults_are(family, default, monkeypatch):
    """A float32 CPU model patched while torch's default dtype or device is another: the
    probes of transformers' functions and norm classes run on the CPU in float32, so the patch
    is made, the QK-norm fused, and the logits are transformers'."""
    monkeypatch.setattr(integration, "_verified", {})  # probed afresh, under these defaults
    monkeypatch.setattr(_qk_norm, "_norm_forms", {})
    model = build(family)
    batches = inputs(family)
    want, _ = logits(model, batches)
    with torch_defaults(default):
        integration.patch(model)
    got, _, calls = patched_calls(model, batches)
    assert (calls["fused attention"] > 0) == (family in QK_NORM)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("default", ["bfloat16", "float16", "meta"])
def test_every_probe_holds_whatever_torch_defaults_are(default, monkeypatch):
    """Every listed function's probe passes while torch's default dtype or device is another:
    another thread's from_pretrained(dtype=...) sets the default dtype for the whole process
    while it loads, and a patch made meanwhile must not be refused."""
    monkeypatch.setattr(integration, "_verified", {})
    probed = 0
    for path, functions in integration.FAMILIES.values():
        try:
            modeling = importlib.import_module(f"transformers.models.{path}")
        except ImportError:  # a family of another transformers release
            continue
        for name, (replacement, probe) in functions.items():
            original = None if name.startswith(integration.SELF) else getattr(modeling, name, None)
            if original is not None:
                with torch_defaults(default):
                    integration._verify(modeling, name, replacement, probe, original)
                probed += 1
    assert probed > 50


def test_bf16_logits():
    model = build("llama", torch.bfloat16)
    batches = inputs("llama")
    want, _ = logits(model, batches)
    integration.patch(model)
    got, n = logits(model, batches)
    integration.unpatch(model)
    assert n == OPS
    torch.testing.assert_close(got[0].float(), want[0].float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_model_patched_runs_as_accurately_as_unpatched(family):
    # A bfloat16 model's rotary module may return float32 tables (Olmo 2's does), and some
    # families cast the rotated q and k back to bfloat16 where others keep float32: the patched
    # model must do what its family does, and be as close to the float32 model as transformers.
    if family == "ernie4_5_moe" and not HF5:
        pytest.skip("transformers 4's own bfloat16 ERNIE 4.5 MoE fails (its router's matmul)")
    reference = build(family)
    batches = inputs(family)
    exact, _ = logits(reference, batches)
    model = build(family).to(torch.bfloat16)  # fresh: CLVP's rotary module keeps its first table
    if family in SPEECH:  # audio goes in as the model's dtype (its first layer is a convolution)
        batches = [{k: v.bfloat16() if v.is_floating_point() else v for k, v in b.items()}
                   for b in batches]
    want, _ = logits(model, batches)
    integration.patch(model)
    try:
        got, n = logits(model, batches)
    finally:
        integration.unpatch(model)
    assert n > 0
    for g, w, e in zip(got, want, exact):
        assert g.dtype == w.dtype
        hf_error = (w.float() - e).abs().max().item()
        assert (g.float() - e).abs().max().item() <= 2 * hf_error + 1e-2


@pytest.mark.parametrize("family", ["llama", "qwen3"])  # the rotation alone; fused with QK-norm
def test_forward_mode_ad_through_a_patched_model(family):
    import torch.autograd.forward_ad as fwAD

    model = perturbed(build(family, torch.float64), 3)
    model.config._attn_implementation = "eager"  # torch's CPU SDPA kernel has no forward AD
    embeds = torch.randn(2, 12, model.config.hidden_size, dtype=torch.float64)
    tangent = torch.randn_like(embeds)

    def dual_logits():
        with torch.no_grad(), fwAD.dual_level():
            return fwAD.unpack_dual(model(inputs_embeds=fwAD.make_dual(embeds, tangent)).logits)

    want = dual_logits()
    integration.patch(model)
    try:
        got = dual_logits()
    finally:
        integration.unpatch(model)
    # (transformers' RMSNorm computes in float32 even for float64 models; a dropped tangent of
    # q and k moves the logits' tangent by about 1e-3)
    assert want.tangent.abs().max() > 0.1
    torch.testing.assert_close(got.primal, want.primal, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got.tangent, want.tangent, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("family", ["llama", "gpt_neox", "gptj", "llama4_text", "deepseek_v2"])
def test_training_gradients_match(family):
    model = build(family).train()
    ids = torch.randint(0, 128, (2, 10))

    want = gradients(model, ids)
    integration.patch(model)
    got = gradients(model, ids)
    integration.unpatch(model)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6)


def test_twins_tables_gradients_are_the_installed_transformers():
    """A twin whose function changed between transformers 4 and 5 follows the installed one,
    with tables whose halves differ and need gradients too (DeepSeek-V3's interleave reads
    both halves in 4, the first halves in 5): values and every gradient, float64."""
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as modeling

    from rope_ext.compat import transformers as hf

    args = [torch.randn(shape, dtype=torch.float64, requires_grad=True)
            for shape in ((2, 3, 4, 8), (2, 1, 4, 8), (2, 4, 8), (2, 4, 8))]
    got = hf.apply_rotary_pos_emb_interleave(*args)
    want = modeling.apply_rotary_pos_emb_interleave(*args)
    w = [torch.randn_like(t) for t in want]
    g_got = torch.autograd.grad(sum((a * b).sum() for a, b in zip(got, w)), args)
    g_want = torch.autograd.grad(sum((a * b).sum() for a, b in zip(want, w)), args)
    for a, b in zip(list(got) + list(g_got), list(want) + list(g_want)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_generate_with_kv_cache_same_tokens():
    model = build("llama")
    ids = torch.randint(10, 128, (2, 6))
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    want = model.generate(ids, **kw)
    integration.patch(model)
    got = model.generate(ids, **kw)
    integration.unpatch(model)
    assert torch.equal(got, want)


def test_patch_is_per_model():
    patched, other = build("llama"), build("llama")
    batches = inputs("llama")
    integration.patch(patched)
    try:
        _, n_other = logits(other, batches)
        _, n_patched = logits(patched, batches)
        assert (n_other, n_patched) == (0, OPS)
        second = build("llama")
        integration.patch(second)
        integration.unpatch(patched)  # the family stays routed for `second`
        assert logits(second, batches)[1] == OPS and logits(patched, batches)[1] == 0
        integration.unpatch(second)
    finally:
        integration.unpatch(patched)
    assert rope_functions("llama")["apply_rotary_pos_emb"].__module__.startswith("transformers")


def test_patch_twice_and_unpatch_unpatched_are_harmless():
    model = build("qwen2")
    integration.patch(model)
    integration.patch(model)
    assert logits(model, inputs("qwen2"))[1] == OPS  # one layer of wrapping, not two
    integration.unpatch(model)
    integration.unpatch(model)
    assert logits(model, inputs("qwen2"))[1] == 0


def test_a_class_whose_fusion_was_refused_patches_again():
    """A class whose norms look fusable but whose forward is not of the fusable shape (OLMoE with
    one head: its norms over all heads are then head_dim wide) keeps transformers' QK-norm and
    rope_ext's RoPE, for a second model and after unpatching alike (the refusal is remembered)."""
    cfg = dict(BASE, num_attention_heads=1, num_key_value_heads=1)
    config = T.OlmoeConfig(**cfg, num_experts=2, num_experts_per_tok=1)
    torch.manual_seed(0)
    first, second = T.OlmoeForCausalLM(config).eval(), T.OlmoeForCausalLM(config).eval()
    ids = torch.randint(0, config.vocab_size, (2, 7))
    with torch.no_grad():
        want = first(ids).logits, second(ids).logits
        for model in (first, second, first):
            integration.unpatch(first)
            integration.patch(model)
            assert integration.is_patched(model)
        got = first(ids).logits, second(ids).logits
    integration.unpatch(first)
    integration.unpatch(second)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_patch_and_unpatch_follow_an_instance_forward_installed_before():
    model = build("mistral")
    batches = inputs("mistral")
    attention = model.model.layers[0].self_attn
    original = type(attention).forward
    attention.forward = attention.forward  # a bound instance forward, as hooks install them
    want, _ = logits(model, batches)
    integration.patch(model)
    got, n = logits(model, batches)
    assert n == OPS  # the bound forward now runs the patched class's forward
    assert attention.__dict__["forward"].__func__ is type(attention).forward
    integration.unpatch(model)
    assert attention.__dict__["forward"].__func__ is original
    assert "forward" not in model.model.layers[1].self_attn.__dict__
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)


def test_patch_replaces_no_transformers_function():
    original = rope_functions("gemma")["apply_rotary_pos_emb"]
    model = build("gemma")
    integration.patch(model)
    assert rope_functions("gemma")["apply_rotary_pos_emb"] is original
    assert logits(build("gemma"), inputs("gemma"))[1] == 0  # another model of the family


# Models whose own model_type is not listed, built around a language model whose is (their
# vision towers: CLIP's, SigLIP's, InternVL's have no RoPE; Mistral 3's Pixtral is listed too):
# the model and the attention classes patch() patches in it.
PIXTRAL = dict(SIGLIP, head_dim=16, model_type="pixtral")
COMPOSITE = {
    "llava": (lambda: T.LlavaForConditionalGeneration(T.LlavaConfig(
        text_config=dict(BASE, model_type="llama"), image_token_index=5,
        vision_config=dict(SIGLIP, model_type="clip_vision_model"))), {"LlamaAttention"}),
    "mistral3": (lambda: T.Mistral3ForConditionalGeneration(T.Mistral3Config(
        text_config=dict(BASE, model_type="mistral"), image_token_index=5,
        vision_config=PIXTRAL)), {"MistralAttention", "PixtralAttention"}),
    "paligemma": (lambda: T.PaliGemmaForConditionalGeneration(T.PaliGemmaConfig(
        text_config=dict(BASE, model_type="gemma", head_dim=16), image_token_index=5,
        vision_config=dict(SIGLIP, model_type="siglip_vision_model"), projection_dim=64)),
        {"GemmaAttention"}),
    "internvl": (lambda: T.InternVLForConditionalGeneration(T.InternVLConfig(
        text_config=dict(BASE, model_type="qwen2"), image_token_id=5, vision_config=dict(
            SIGLIP, image_size=[8, 8], patch_size=[2, 2]))), {"Qwen2Attention"}),
    # GLM-4.6V: GLM-4.1V's parts (transformers 5)
    "glm46v": (glm4v(T.Glm46VConfig, T.Glm46VForConditionalGeneration),
               {"Glm4vTextAttention", "Glm4vVisionAttention"}),
}


def patched_classes(model):
    """The transformers classes of the modules patch() changed."""
    return {type(m).__mro__[1].__name__ for m in model.modules()
            if isinstance(m, integration._PatchedAttention)}


@pytest.mark.parametrize("name", COMPOSITE)
def test_a_model_built_around_a_listed_language_model_patches_that(name):
    make, classes = COMPOSITE[name]
    torch.manual_seed(0)
    model = make()
    if isinstance(model, Missing):
        pytest.skip(f"transformers {transformers.__version__} has no {model.name}")
    model.eval()
    assert model.config.model_type == name and name not in integration.FAMILIES
    language_model = model.get_decoder()
    ids = torch.randint(10, 128, (2, 12))
    want, n_before = logits(model, [dict(input_ids=ids)])
    assert n_before == 0
    integration.patch(model)
    assert patched_classes(model) == classes
    got, n = logits(model, [dict(input_ids=ids)])
    assert n >= language_model.config.num_hidden_layers  # each layer's q and k, in one op or two
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    patched = {m for m in model.modules() if isinstance(m, integration._PatchedAttention)}
    integration.patch(model)  # again: nothing changes
    assert {m for m in model.modules() if isinstance(m, integration._PatchedAttention)} == patched
    integration.unpatch(model)
    assert not integration.is_patched(model)
    again, n_after = logits(model, [dict(input_ids=ids)])
    assert n_after == 0 and torch.equal(again[0], want[0])


def mistral3_on_images():
    ids = torch.randint(10, 128, (2, 12))
    ids[:, 2:6] = 5  # the 2x2 merged patches of one 8x8 image each
    return COMPOSITE["mistral3"][0](), dict(input_ids=ids, pixel_values=torch.randn(2, 3, 8, 8),
                                            image_sizes=torch.tensor([[8, 8], [8, 8]]))


def lfm3_vl_on_an_image():
    model = T.Lfm3VlForConditionalGeneration(T.Lfm3VlConfig(
        text_config=dict(BASE, model_type="lfm3", head_dim=16, pad_token_id=0,
                         layer_types=["sliding_attention", "full_attention"]),
        vision_config=dict(hidden_size=32, intermediate_size=64, patch_size=2,
                           spatial_merge_size=2, temporal_patch_size=1, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=2,
                           layer_types=["conv", "full_attention"]),
        image_token_id=5, video_token_id=6, vision_start_token_id=7, vision_end_token_id=8,
        projector_hidden_size=32))
    if isinstance(model, Missing):
        return model, None
    ids = torch.randint(10, 128, (1, 12))
    ids[0, 2], ids[0, 3:7], ids[0, 7] = 7, 5, 8  # a 4x4-patch image: 4 merged tokens
    return model, dict(input_ids=ids, pixel_values=torch.randn(16, 12),
                       image_grid_thw=torch.tensor([[1, 4, 4]]), mm_token_type_ids=(ids == 5).int())


def mlcd_images():
    model = T.MLCDVisionModel(T.MLCDVisionConfig(hidden_size=32, intermediate_size=64,
                                                 num_hidden_layers=2, num_attention_heads=2,
                                                 image_size=8, patch_size=2))
    return model, dict(pixel_values=torch.randn(2, 3, 8, 8))  # 4x4 patches and a class token


def video_llama_3_images():
    model = T.VideoLlama3VisionModel(T.VideoLlama3VisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        patch_size=2))
    return model, dict(pixel_values=torch.randn(16, 12), grid_thw=torch.tensor([[1, 4, 4]]),
                       merge_sizes=torch.tensor([2]))  # one image of 4x4 patches, merged 2x2


def kimi_k25_images():
    model = T.Kimi_K25VisionModel(T.Kimi_K25VisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        patch_size=2, pos_emb_height=8, pos_emb_width=8, pos_emb_time=2))
    return model, dict(pixel_values=torch.randn(16, 3, 2, 2), grid_thw=torch.tensor([[1, 4, 4]]))


def glm5_next_images():
    """GLM-5 Next's vision tower (its language model has no RoPE): two images of 4x4 and 6x6
    patches."""
    model = T.Glm5NextVisionModel(T.Glm5NextVisionConfig(
        depth=2, hidden_size=32, num_heads=2, patch_size=2, spatial_merge_size=2,
        temporal_patch_size=1, out_hidden_size=64, intermediate_size=64,
        projection_intermediate_size=64))
    return model, dict(hidden_states=torch.randn(16 + 36, 12),
                       grid_thw=torch.tensor([[1, 4, 4], [1, 6, 6]]))


def inkling2_images():
    """Inkling 2's vision tower (its language model has no RoPE: a learned relative bias): two
    images of 2x2 and 3x3 merged patches."""
    model = T.Inkling2VisionModel(T.Inkling2VisionConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, patch_size=2,
        spatial_merge_size=2, posemb_grid_size=4, projection_hidden_dim=32, text_hidden_size=32))
    return model, dict(pixel_values=torch.randn(4 + 9, 4, 4, 3),
                       image_grid_thw=torch.tensor([[1, 2, 2], [1, 3, 3]]))


def dinov3_images():
    model = T.DINOv3ViTModel(T.DINOv3ViTConfig(hidden_size=32, intermediate_size=64,
                                               num_hidden_layers=2, num_attention_heads=2,
                                               image_size=8, patch_size=2, num_register_tokens=2))
    return model, dict(pixel_values=torch.randn(2, 3, 8, 8))  # 4x4 patches after 3 tokens


def evolla_protein_and_text():
    """Evolla on a protein and text (transformers 5 patches its protein encoder too)."""
    model = T.EvollaForProteinText2Text(T.EvollaConfig(**EVOLLA)) if HF5 else Missing(
        "EvollaSaProtSelfAttention calling RoPE (transformers >= 5)")
    return model, dict(input_ids=torch.randint(10, 128, (2, 10)),
                       protein_input_ids=torch.randint(5, 128, (2, 12)),
                       protein_attention_mask=torch.ones(2, 12, dtype=torch.long))


def lasr(encoder):
    """LASR's speech encoder (or its CTC model) on 48 frames of 16 mel bins (11 after its
    subsampling)."""
    sizes = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                 conv_kernel_size=5, subsampling_conv_channels=8, num_mel_bins=16,
                 subsampling_conv_kernel_size=3, max_position_embeddings=256)
    model = (T.LasrEncoder(T.LasrEncoderConfig(**sizes)) if encoder else
             T.LasrForCTC(T.LasrCTCConfig(vocab_size=128, encoder_config=sizes)))
    return model, dict(input_features=torch.randn(2, 48, 16),
                       attention_mask=torch.ones(2, 48, dtype=torch.long))


def muse_on_an_image(name):
    """Muse Spark or Muse Glimmer (5): a text layer with RoPE, a NoPE one, a vision tower; one
    image of 4x4 patches (4 merged tokens)."""
    text = dict(BASE, num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=8,
                bos_token_id=None, eos_token_id=None)
    extra = {}
    if name == "MuseSpark":
        text.update(moe_intermediate_size=32, moe_hidden_size=32, num_local_experts=2,
                    num_experts_per_tok=1)
        extra = dict(audio_token_id=9, audio_config=dict(
            patch_sizes=[2], hidden_sizes=[8], depths=[1], num_hidden_layers=1, out_hidden_size=64))
    model = getattr(T, f"{name}ForConditionalGeneration")(getattr(T, f"{name}Config")(
        text_config=text, out_hidden_size=128, projector_hidden_size=32, image_token_id=5,
        video_token_id=6, vision_config=dict(
            patch_size=2, pos_emb_height=4, pos_emb_width=4, num_attention_heads=2,
            num_hidden_layers=1, hidden_size=32, intermediate_size=64, patch_temporal=1,
            merge_size=2), **extra))
    ids = torch.randint(10, 128, (1, 12))
    ids[0, 3:7] = 5
    return model, dict(input_ids=ids, pixel_values=torch.randn(16, 12),
                       image_grid_thw=torch.tensor([[1, 4, 4]]))


def cohere_compass_on_an_image():
    """Cohere Compass (5): an interleaved-MRoPE sliding layer and a NoPE global one."""
    mrope = dict(rope_type="default", rope_theta=1e4, mrope_section=[2, 3, 3],
                 mrope_interleaved=True)
    model = T.CohereCompassForConditionalGeneration(T.CohereCompassConfig(
        text_config=dict(BASE, num_attention_heads=2, num_key_value_heads=1, sliding_window=8,
                         layer_types=["sliding_attention", "full_attention"], pad_token_id=0,
                         rope_parameters={"sliding_attention": mrope, "full_attention": None}),
        vision_config=dict(QWEN3_VL_VISION, rope_parameters=dict(rope_type="axial", rope_theta=1e4)),
        image_token_id=5, video_token_id=6, vision_start_token_id=7, vision_end_token_id=8))
    ids = torch.randint(10, 128, (1, 12))
    ids[0, 2], ids[0, 3:7], ids[0, 7] = 7, 5, 8
    return model, dict(input_ids=ids, pixel_values=torch.randn(16, 12),
                       image_grid_thw=torch.tensor([[1, 4, 4]]), mm_token_type_ids=(ids == 5).int())


def perception_encoder(kind):
    """Perception Encoder's audio, video or audio-video encoder (5) on 40 samples of audio (10
    tokens) and 3 frames of 8x8 pixels (a tiny ViT stands in for its timm vision tower, which
    has no RoPE)."""
    sizes = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=2, head_dim=16)
    audio = dict(sizes, dac_config=dict(downsampling_ratios=[2, 2], encoder_hidden_size=4,
                                        codebook_dim=8))
    video = dict(sizes, vision_config=T.ViTConfig(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        image_size=8, patch_size=4, num_labels=8))
    batch = dict(input_values=torch.randn(2, 1, 40), pixel_values_videos=torch.randn(2, 3, 3, 8, 8))
    if kind == "audio":
        return T.PeAudioEncoder(T.PeAudioEncoderConfig(**audio)), dict(
            input_values=batch["input_values"])
    if kind == "video":
        return T.PeVideoEncoder(T.PeVideoEncoderConfig(**video)), dict(
            pixel_values_videos=batch["pixel_values_videos"])
    return T.PeAudioVideoEncoder(T.PeAudioVideoEncoderConfig(
        audio_config=dict(audio, model_type="pe_audio_encoder"),
        video_config=dict(video, model_type="pe_video_encoder"), **sizes)), batch


def sapiens2_images():
    model = T.Sapiens2Model(T.Sapiens2Config(  # layer 0 of 4 key heads, layer 1 of 2
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        image_size=8, patch_size=2, num_register_tokens=2, num_key_value_attention_heads=2,
        num_first_full_attention_layers=1, num_last_full_attention_layers=0))
    return model, dict(pixel_values=torch.randn(2, 3, 8, 8))


def timesfm_series():
    model = T.TimesFm2_5ModelForPrediction(T.TimesFm2_5Config(
        patch_length=8, context_length=64, horizon_length=16, output_quantile_len=16,
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, head_dim=8,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64))
    return model, dict(past_values=[torch.randn(64), torch.randn(40)])  # two series


def llama4_on_an_image():
    model = T.Llama4ForConditionalGeneration(T.Llama4Config(
        text_config=LLAMA4_TEXT, image_token_index=5, vision_config=dict(
            hidden_size=32, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
            image_size=8, patch_size=2, pixel_shuffle_ratio=0.5, projector_input_dim=32,
            projector_output_dim=32, vision_output_dim=32)))
    ids = torch.randint(10, 128, (1, 12))
    ids[0, 2:6] = 5  # 4x4 patches, shuffled into 4 tokens
    return model, dict(input_ids=ids, pixel_values=torch.randn(1, 3, 8, 8))


def audio_encoder(exported, encoder, config, **sizes):
    """A speech model's audio encoder (a part: see part()) and 40 frames of 16 mel bins for it."""
    return part(exported, encoder, config, hidden_size=32, intermediate_size=64,
                num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                num_mel_bins=16, **sizes), dict(input_features=torch.randn(2, 16, 40))


# Listed towers and encoders, each run on its inputs: a vision tower in a model on an image (a
# vision encoder on images alone), an audio encoder on audio features. The maker of
# (model, batch), the tower's attention class
TOWERS = {"pixtral": (mistral3_on_images, "PixtralAttention"),  # a 2-D table of patches
             "lfm3_vl_vision": (lfm3_vl_on_an_image, "Lfm3VlVisionAttention"),  # transformers 5
             "mlcd_vision_model": (mlcd_images, "MLCDAttention"),
             "llama4_vision_model": (llama4_on_an_image, "Llama4VisionAttention"),
             "dinov3_vit": (dinov3_images, "DINOv3ViTAttention"),
             "sapiens2": (sapiens2_images, "Sapiens2Attention"),  # 5
             **{f"pe_{kind}_encoder": (functools.partial(perception_encoder, kind),  # 5
                                       f"Pe{name}EncoderAttention")
                for kind, name in (("audio", "Audio"), ("video", "Video"),
                                   ("audio_video", "AudioVideo"))},
             "muse_spark": (lambda: muse_on_an_image("MuseSpark"), "MuseSparkVisionAttention"),
             "muse_glimmer": (lambda: muse_on_an_image("MuseGlimmer"),  # 5
                              "MuseGlimmerVisionAttention"),
             "cohere_compass": (cohere_compass_on_an_image, "CohereCompassVisionAttention"),  # 5
             "timesfm2_5": (timesfm_series, "TimesFm2_5Attention"),  # 5
             "evolla": (evolla_protein_and_text, "EvollaSaProtSelfAttention"),  # 5
             "lasr_encoder": (lambda: lasr(encoder=True), "LasrEncoderAttention"),  # 5
             "lasr_ctc": (lambda: lasr(encoder=False), "LasrEncoderAttention"),  # 5
             "video_llama_3_vision": (video_llama_3_images, "VideoLlama3VisionAttention"),  # 5
             "kimi_k25_vision": (kimi_k25_images, "Kimi_K25VisionAttention"),  # 5
             "glm5_next_vision": (glm5_next_images, "Glm5NextVisionAttention"),  # 5
             "inkling2_vision": (inkling2_images, "Inkling2VisionAttention"),  # 5
             "glmasr_encoder": (lambda: audio_encoder("GlmAsrForConditionalGeneration",  # 5
                                                      "GlmAsrEncoder", "GlmAsrEncoderConfig",
                                                      max_position_embeddings=64),
                                "GlmAsrAttention"),
             "voxtral_realtime_encoder": (lambda: audio_encoder(  # 5
                 "VoxtralRealtimeForConditionalGeneration", "VoxtralRealtimeEncoder",
                 "VoxtralRealtimeEncoderConfig", head_dim=16), "VoxtralRealtimeAttention"),
             # DeepSeek-OCR 2's vision encoder, a Qwen2 over the patches' embeddings (5)
             "deepseek_ocr2_encoder": (lambda: (ocr2_part(
                 "DeepseekOcr2VisionEncoder", "DeepseekOcr2VisionEncoderConfig", **BASE),
                 dict(inputs_embeds=torch.randn(2, 16, 64), num_patches=16)),
                 "DeepseekOcr2VisionAttention")}


def memory_attention(family):
    """A video tracker's memory attention (SAM 2's, SAM 3's, EdgeTAM's: 2 layers, each
    self-attention over a frame's 4x4 features, then cross-attention to the memory of 2 earlier
    frames and 4 object pointers, which are not rotated) and its inputs."""
    module = getattr(transformers.models, family, None)
    if module is None:
        return Missing(f"transformers.models.{family}"), None
    modeling = getattr(module, f"modeling_{family}")
    prefix = {"sam2_video": "Sam2Video", "sam3_tracker_video": "Sam3TrackerVideo",
              "edgetam_video": "EdgeTamVideo"}[family]
    sizes = dict(memory_attention_hidden_size=32, memory_attention_num_attention_heads=2,
                 memory_attention_num_layers=2, memory_attention_rope_feat_sizes=[4, 4],
                 memory_attention_dropout=0.0, memory_attention_rope_dropout=0.0)
    edgetam = family == "edgetam_video"
    sizes.update(dict(memory_attention_mlp_hidden_size=32, memory_attention_rope_k_sizes=[2, 2])
                 if edgetam else dict(memory_attention_feed_forward_hidden_size=32))
    config = getattr(modeling, f"{prefix}Config")(**sizes)
    config.memory_attention_rope_feat_sizes = [4, 4]  # (SAM 3's image_size sets them too)
    config._attn_implementation = "sdpa"  # (a model sets it; transformers 4 has no default)
    memory = 2 * (3 + 4) + 4 if edgetam else 2 * 16 + 4  # (EdgeTAM: 3 temporal + 2x2 spatial)
    batch = dict(current_vision_features=torch.randn(16, 2, 32),
                 current_vision_position_embeddings=torch.randn(16, 2, 32),
                 memory=torch.randn(memory, 2, 64), memory_posision_embeddings=torch.randn(
                     memory, 2, 64), num_object_pointer_tokens=4)
    if edgetam:
        batch["num_spatial_memory_tokens"] = 2
    return getattr(modeling, f"{prefix}MemoryAttention")(config), batch


MEMORY_ATTENTION = ["sam2_video", "sam3_tracker_video", "edgetam_video"]


@pytest.mark.parametrize("family", MEMORY_ATTENTION)
def test_a_video_trackers_memory_attention_patched(family):
    """SAM's 2D RoPE of memory attention (object pointers excluded, keys of several frames by
    the tables repeated, EdgeTAM's temporal keys passed through) on rope_ext's op, its output
    transformers'."""
    torch.manual_seed(0)
    model, batch = memory_attention(family)
    if isinstance(model, Missing):
        pytest.skip(f"transformers {transformers.__version__} has no {model.name}")
    model.eval()
    with torch.no_grad():
        want = model(**batch)
        integration.patch(model)
        with RopeOps() as counter:
            got = model(**batch)
    assert counter.count == 8  # q and k of each layer's self- and cross-attention
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    integration.unpatch(model)
    with torch.no_grad():
        assert torch.equal(model(**batch), want)


def muse_glimmer_assistant():
    """Muse Glimmer's assistant (a draft model: 2 layers, 4 positions of noise embeddings
    attending to 6 of the target model's context, which its keys hold before their own: its
    queries take the last rows of the tables) and its last hidden states."""
    module = getattr(transformers.models, "muse_glimmer_assistant", None)
    if module is None:
        return Missing("transformers.models.muse_glimmer_assistant"), None
    modeling = module.modeling_muse_glimmer_assistant
    config = modeling.MuseGlimmerAssistantConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, sliding_window=8,
        block_size=4, target_layer_ids=[0, 1],
        layer_types=["sliding_attention", "full_attention"])
    batch = dict(noise_embeds=torch.randn(2, 4, 32), context_hidden_states=torch.randn(2, 6, 64))
    return (modeling.MuseGlimmerAssistantModel(config),
            lambda m: (m(**batch).last_hidden_state,))


def spiced(model):
    """model with every Linear and convolution weight drawn at unit gain and batch norms' scales
    at 1: at transformers' initial 0.02 the attention scores of these models are near 0, and
    their outputs barely see how q and k were rotated."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (torch.nn.Linear, torch.nn.modules.conv._ConvNd)):
                fan_in = m.weight[0].numel()
                m.weight.copy_(torch.randn(m.weight.shape, generator=g) / fan_in ** 0.5)
            elif isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.weight is not None:
                m.weight.fill_(1.0)
    return model


def image_matcher(name):
    """EfficientLoFTR's backbone (its coarse features) or LightGlue with a SuperPoint detector
    (its matches and scores) on two pairs of 64x64 images."""
    pixels = torch.rand(2, 2, 3, 64, 64)
    if name == "efficientloftr":
        model = T.EfficientLoFTRModel(T.EfficientLoFTRConfig(
            stage_num_blocks=[1, 1, 1, 1], out_features=[8, 8, 16, 32], stage_stride=[2, 1, 2, 2],
            hidden_size=32, num_attention_heads=8, num_attention_layers=2,
            q_aggregation_kernel_size=2, q_aggregation_stride=2, kv_aggregation_kernel_size=2,
            kv_aggregation_stride=2, fine_kernel_size=4, fine_matching_slice_dim=4))
        return model, lambda m: (m(pixel_values=pixels).feature_maps[0],)
    model = T.LightGlueForKeypointMatching(T.LightGlueConfig(
        descriptor_dim=32, num_hidden_layers=2, num_attention_heads=2, depth_confidence=-1.0,
        width_confidence=-1.0, keypoint_detector_config=dict(
            model_type="superpoint", encoder_hidden_sizes=[8, 8, 16, 16], decoder_hidden_size=16,
            descriptor_decoder_dim=32, max_keypoints=24, keypoint_threshold=0.0, nms_radius=1,
            border_removal_distance=2)))

    def run(m):
        out = m(pixel_values=pixels, output_hidden_states=True)
        return out.matching_scores, out.matches.float(), *out.hidden_states

    return model, run


NEMOTRON_AUDIO = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_mel_bins=16, subsampling_factor=8)
NEMOTRON_DIARIZATION = dict(
    head_config=dict(hidden_size=16, num_speakers=4, audio_hidden_size=32, subsampling_factor=8),
    streaming_config=dict(fifo_length=8, speaker_cache_update_period=6, speaker_cache_length=12,
                          num_speakers=4, subsampling_factor=8),
    chunk_length=10, chunk_right_context=2, fifo_length=8, speaker_cache_update_period=6)
HALF_ROTARY = dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5)


def speech_model(name):
    """Nemotron 3's diarization model on 3 chunks of audio frames, or Nemotron 3.5 Transcribe
    (its ASR encoder, the diarization model inside and its word-timestamp encoder) on a prompt
    holding 24 audio frames."""
    features = torch.randn(2, 8 * 30, 16)
    if name == "nemotron3_diarization":
        model = T.Nemotron3DiarizationForAudioFrameClassification(T.Nemotron3DiarizationConfig(
            audio_config=dict(NEMOTRON_AUDIO, rope_parameters=HALF_ROTARY), **NEMOTRON_DIARIZATION))
        return model, lambda m: (m(input_features=features).logits,)
    model = T.Nemotron3_5TranscribeForConditionalGeneration(T.Nemotron3_5TranscribeConfig(
        audio_token_id=5,
        audio_config=dict(asr_config=dict(NEMOTRON_AUDIO, rope_parameters=HALF_ROTARY),
                          diarization_config=dict(NEMOTRON_DIARIZATION,
                                                  model_type="nemotron3_diarization",
                                                  audio_config=NEMOTRON_AUDIO,
                                                  chunk_left_context=2)),
        word_timestamp_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, vocab_size=20, blank_token_id=19,
                                   rope_parameters=HALF_ROTARY),
        text_config=dict(model_type="nemotron_h", vocab_size=128, hidden_size=64,
                         hybrid_override_pattern="*-", num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, intermediate_size=64,
                         mamba_num_heads=4, mamba_head_dim=16, n_groups=1, ssm_state_size=16,
                         n_routed_experts=2, num_experts_per_tok=1, moe_intermediate_size=32,
                         moe_shared_expert_intermediate_size=32, max_position_embeddings=256)))
    features, mask = torch.randn(2, 8 * 24, 16), torch.ones(2, 8 * 24, dtype=torch.long)
    ids = torch.randint(10, 128, (2, 30))
    ids[:, 3:27] = 5

    def run(m):
        out = m(input_ids=ids, input_features=features, input_features_mask=mask)
        audio = m.get_audio_features(features, mask)
        words = m.get_word_timestamp_logits(audio.asr_last_hidden_state, mask)
        return out.logits, audio.asr_last_hidden_state, audio.speaker_logits, words

    return model, run


ESMFOLD2_ATOMS = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                      intermediate_size=64, num_spatial_rope_pairs_per_axis=1, num_uid_rope_pairs=2)


def esmfold2_trunk():
    """ESMFold2's trunk on 2 chains of 6 residues of 2 atoms each: its atom encoder rotates by
    the atoms' 3-D positions and space ids (its ESMC language model by the residues')."""
    if not HF5:
        return Missing("transformers.models.esmfold2"), None
    from transformers.models.esmfold2.modeling_esmfold2 import EsmFold2AtomInputs

    model = T.EsmFold2Model(T.EsmFold2Config(
        hidden_size=32, pairwise_hidden_size=16, pair_transition_intermediate_size=32,
        single_inputs_size=32 + 2 * 33 + 1, sliding_window=8, chunk_size=None, num_loops=1,
        max_atomic_number=16, char_vocab_size=8, max_chars=2, max_atoms_per_token=4,
        folding_trunk_num_hidden_layers=1, parcae_num_coda_layers=1,
        atom_encoder=dict(ESMFOLD2_ATOMS, output_dim=32),
        structure_head=dict(num_diffusion_samples=1, inference_num_steps=3, num_distogram_bins=8,
                            diffusion_module=dict(
                                hidden_size=32, fourier_dim=16, num_hidden_layers=1,
                                num_attention_heads=2, intermediate_size=64,
                                pair_intermediate_size=32,
                                atom_encoder=dict(ESMFOLD2_ATOMS, output_dim=32,
                                                  num_hidden_layers=1))),
        confidence_head=dict(num_hidden_layers=1, num_plddt_bins=8, num_pde_bins=8,
                             num_pae_bins=8, distogram_bins=8),
        msa_encoder=dict(hidden_size=16, outer_hidden_size=4, num_hidden_layers=1,
                         num_attention_heads=2, head_dim=8, intermediate_size=32),
        lm_encoder=dict(num_hidden_layers=1),
        esmc_config=dict(model_type="esmc", vocab_size=64, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=64)))
    B, N, A = 2, 6, 12
    atom_to_token = torch.arange(A).div(2, rounding_mode="floor").expand(B, A).contiguous()
    atoms = dict(ref_pos=torch.randn(B, A, 3) * 3, ref_charge=torch.zeros(B, A),
                 atom_attention_mask=torch.ones(B, A, dtype=torch.bool),
                 ref_element=torch.randint(1, 16, (B, A)),
                 ref_atom_name_chars=torch.randint(0, 8, (B, A, 2)),
                 ref_space_uid=atom_to_token.clone(), atom_to_token=atom_to_token)
    zeros = torch.zeros(B, N, dtype=torch.long)
    residues = dict(token_index=torch.arange(N).expand(B, N),
                    residue_index=torch.arange(N).expand(B, N), asym_id=zeros, sym_id=zeros,
                    entity_id=zeros, mol_type=zeros, res_type=torch.randint(0, 20, (B, N)),
                    token_bonds=torch.zeros(B, N, N, 1),
                    attention_mask=torch.ones(B, N, dtype=torch.bool),
                    input_ids=torch.randint(4, 24, (B, N)))

    def run(m):
        inputs = EsmFold2AtomInputs(**{k: v.clone() for k, v in atoms.items()})
        out = m(atom_inputs=inputs, **residues)
        return out.single_inputs, out.distogram_logits

    return model, run


def roformer():
    """RoFormer (its RoPE a static method of its attention) rotating q, k and v (rotary_value)."""
    model = T.RoFormerModel(T.RoFormerConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                             num_hidden_layers=2, num_attention_heads=4,
                                             embedding_size=64, rotary_value=True))
    ids = torch.randint(0, 128, (2, 12))
    return model, lambda m: (m(input_ids=ids).last_hidden_state,)


SPEECH_ENCODER = dict(hidden_size=32, num_attention_heads=2, position_embeddings_type="rotary")


def speech_encoder(name):
    """Wav2Vec2-Conformer on 1/4 s of 16 kHz audio, Wav2Vec2-BERT on 20 frames of features, or
    SeamlessM4T's speech-to-text model on them: their rotary encoders (the RoPE a method of
    their attention, on the hidden states before the projections)."""
    features = torch.randn(2, 20, 16)
    if name == "wav2vec2-conformer":
        model = T.Wav2Vec2ConformerModel(T.Wav2Vec2ConformerConfig(
            **SPEECH_ENCODER, num_hidden_layers=2, intermediate_size=64, conv_dim=(16, 16),
            conv_stride=(5, 4), conv_kernel=(10, 8), num_conv_pos_embeddings=16,
            num_conv_pos_embedding_groups=2))
        audio = torch.randn(2, 4000)
        return model, lambda m: (m(input_values=audio).last_hidden_state,)
    encoder = dict(SPEECH_ENCODER, feature_projection_input_dim=16, conv_depthwise_kernel_size=3,
                   add_adapter=False)
    if name == "wav2vec2-bert":
        model = T.Wav2Vec2BertModel(T.Wav2Vec2BertConfig(
            **encoder, num_hidden_layers=2, intermediate_size=64))
        return model, lambda m: (m(input_features=features).last_hidden_state,)
    del encoder["num_attention_heads"], encoder["hidden_size"]
    model = T.SeamlessM4TForSpeechToText(T.SeamlessM4TConfig(
        **encoder, vocab_size=128, hidden_size=32, encoder_layers=1, decoder_layers=1,
        speech_encoder_layers=2, encoder_attention_heads=2, decoder_attention_heads=2,
        speech_encoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
        speech_encoder_intermediate_size=64, max_position_embeddings=64, pad_token_id=0,
        bos_token_id=2, eos_token_id=3, decoder_start_token_id=2))
    decoder_ids = torch.randint(4, 128, (2, 5))
    return model, lambda m: (m(input_features=features, decoder_input_ids=decoder_ids).logits,)


# Models whose outputs are not logits or hidden states, or whose RoPE is a method of their
# attention: name -> (model and a function of it returning its outputs, the rope ops one run
# makes).
OTHER_OUTPUTS = {"efficientloftr": (functools.partial(image_matcher, "efficientloftr"), 4),
                 "lightglue": (functools.partial(image_matcher, "lightglue"), 4),
                 # transformers 5: Nemotron 3's diarization model, Nemotron 3.5 Transcribe
                 "nemotron3_diarization": (functools.partial(speech_model, "nemotron3_diarization"),
                                           6),
                 "nemo_speechlm": (functools.partial(speech_model, "transcribe"), 27),
                 "muse_glimmer_assistant": (muse_glimmer_assistant, 4),  # q and k of each layer
                 # its atom attention's 2 layers and ESMC's
                 "esmfold2": (esmfold2_trunk, 4),
                 "roformer": (roformer, 6),  # q, k and v of each layer
                 **{name: (functools.partial(speech_encoder, name), 2) for name in (
                     "wav2vec2-conformer", "wav2vec2-bert", "seamless_m4t")}}


@pytest.mark.parametrize("family", OTHER_OUTPUTS)
def test_a_model_of_other_outputs_patched(family):
    """Its outputs transformers' (on weights at which the rotation shows in them), its RoPE on
    rope_ext's ops, and transformers' code back after unpatch."""
    make, ops = OTHER_OUTPUTS[family]
    torch.manual_seed(0)
    model, run = make()
    if isinstance(model, Missing):
        pytest.skip(f"transformers {transformers.__version__} has no {model.name}")
    model = spiced(model).eval()

    def outputs():
        torch.manual_seed(1)  # (ESMFold2's trunk draws random numbers)
        return run(model)

    with torch.no_grad():
        want = outputs()
        integration.patch(model)
        with RopeOps() as counter:
            got = outputs()
        integration.unpatch(model)
        again = outputs()
    assert counter.count == ops
    for g, w, a in zip(got, want, again):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
        assert torch.equal(a, w)


@pytest.mark.parametrize("tower", TOWERS)
def test_a_tower_patched(tower):
    """The tower's RoPE runs on rope_ext too, the model's logits are transformers'."""
    make, attention = TOWERS[tower]
    torch.manual_seed(0)
    model, image = make()
    if isinstance(model, Missing):
        pytest.skip(f"transformers {transformers.__version__} has no {model.name}")
    model.eval()
    want, _ = logits(model, [image])
    text = {k: v for k, v in image.items() if k in ("input_ids", "mm_token_type_ids")}
    integration.patch(model)
    text_ops = logits(model, [text])[1] if text else 0  # (an encoder alone reads no text)
    assert attention in patched_classes(model)
    got, n = logits(model, [image])
    assert n > text_ops  # the vision tower's too
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    integration.unpatch(model)


def test_types_sharing_modeling_code_replace_its_functions_alike():
    # patch() merges the functions of the listed types it meets that share a modeling module
    seen = {}
    for model_type, (path, functions) in integration.FAMILIES.items():
        for name, spec in functions.items():
            assert seen.setdefault((path, name), (model_type, spec))[1] == spec, (
                f"{model_type} and {seen[(path, name)][0]} replace {path}.{name} differently")


def test_a_module_holding_models_patches_them():
    class Pair(torch.nn.Module):  # no config: a caller's module around two models
        def __init__(self):
            super().__init__()
            self.a, self.b = build("llama"), build("qwen2")

    pair = Pair()
    integration.patch(pair)
    assert integration.is_patched(pair.a) and integration.is_patched(pair.b)
    integration.unpatch(pair)
    assert not integration.is_patched(pair)
    with pytest.raises(integration.UnsupportedModelError, match="has no config.model_type"):
        integration.patch(torch.nn.Sequential(torch.nn.Linear(2, 2)))


@pytest.mark.parametrize("config", [
    T.BloomConfig(vocab_size=128, hidden_size=64, n_layer=1, n_head=4),  # ALiBi: no RoPE
    T.GPT2Config(vocab_size=128, n_embd=64, n_layer=1, n_head=4),  # no RoPE at all
])
def test_unsupported_family_is_an_error(config):
    model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(integration.UnsupportedModelError,
                       match=f"cannot patch .*model_type '{config.model_type}'.*Supported") as error:
        integration.patch(model)
    assert isinstance(error.value, ValueError) and isinstance(error.value, NotImplementedError)
    assert not integration.is_patched(model)
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_every_listed_family_is_built_here():
    """Each family patch() accepts runs the tests above on a tiny model of it, or shares its
    modeling module with one that does (a vision-language model's text model type), or is one
    this transformers version does not have."""
    import importlib.util

    built = {integration.FAMILIES[f][0] for f in (*FAMILIES, *TOWERS, *MEMORY_ATTENTION,
                                                   *OTHER_OUTPUTS)
             if f in integration.FAMILIES}
    for family, (path, _) in integration.FAMILIES.items():
        package = f"transformers.models.{path.split('.')[0]}"
        assert (family in FAMILIES or path in built or family in TOWERS
                or importlib.util.find_spec(package) is None), f"{family}: no tiny model in FAMILIES"


def test_a_changed_transformers_function_is_refused(monkeypatch):
    modeling = transformers.models.llama.modeling_llama

    def changed(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):  # e.g. a future refactor
        return q * cos.unsqueeze(unsqueeze_dim), k * cos.unsqueeze(unsqueeze_dim)

    monkeypatch.setattr(modeling, "apply_rotary_pos_emb", changed)
    model = build("llama")
    with pytest.raises(RuntimeError, match="does not compute what its rope_ext replacement does"):
        integration.patch(model)
    assert not integration.is_patched(model) and modeling.apply_rotary_pos_emb is changed


def test_a_function_whose_signature_changed_is_refused(monkeypatch):
    """A probe's call that fails (the function takes other arguments now) refuses the patch with
    its message, naming the failure, rather than raising from inside the probe."""
    modeling = transformers.models.llama.modeling_llama

    def changed(x, cos, sin):  # one tensor now
        return x * cos + sin

    monkeypatch.setattr(modeling, "apply_rotary_pos_emb", changed)
    model = build("llama")
    with pytest.raises(RuntimeError, match=r"does not compute what its rope_ext replacement does "
                                           r"\(the probe's call failed: TypeError: .*\); refusing"):
        integration.patch(model)
    assert not integration.is_patched(model)


def test_a_changed_function_at_a_verified_ones_address_is_refused(monkeypatch):
    # a function that passed the probe, freed; a different one that CPython puts at its address
    # (an id() key once took it for the verified one and patched it silently)
    modeling = transformers.models.llama.modeling_llama
    original = modeling.apply_rotary_pos_emb

    def make(scale):
        def apply_rotary_pos_emb(*args, **kwargs):
            q, k = original(*args, **kwargs)
            return q * scale, k * scale
        return apply_rotary_pos_emb

    same = make(1.0)
    try:  # (monkeypatch would keep `same` alive)
        modeling.apply_rotary_pos_emb = same
        integration.unpatch(integration.patch(build("llama")))
    finally:
        modeling.apply_rotary_pos_emb = original
    address = id(same)
    del same
    gc.collect()
    misses = []
    for _ in range(1000):  # usually the first one lands there
        changed = make(2.0)
        if id(changed) == address:
            break
        misses.append(changed)
    monkeypatch.setattr(modeling, "apply_rotary_pos_emb", changed)
    model = build("llama")
    with pytest.raises(RuntimeError, match="does not compute what its rope_ext replacement does"):
        integration.patch(model)
    assert not integration.is_patched(model)


def test_a_forward_replaced_after_a_patch_is_the_one_patched_next(monkeypatch):
    # the patched class is transformers' forward as it is when patch() runs: a forward installed
    # on the attention class later (still calling apply_rotary_pos_emb) serves the next patch
    modeling = transformers.models.llama.modeling_llama
    integration.unpatch(integration.patch(build("llama")))
    source = textwrap.dedent(inspect.getsource(inspect.unwrap(modeling.LlamaAttention.forward)))
    line = "input_shape = hidden_states.shape[:-1]"
    assert line in source
    source = source.replace(line, "_CALLS.append(1)\n    " + line, 1)
    scope = {}
    exec(compile(source, modeling.__file__, "exec"), modeling.__dict__, scope)
    monkeypatch.setattr(modeling, "_CALLS", [], raising=False)
    monkeypatch.setattr(modeling.LlamaAttention, "forward", scope["forward"])
    model, batch = build("llama"), inputs("llama")[0]
    with torch.no_grad():
        want = model(**batch).logits
    del modeling._CALLS[:]
    integration.patch(model)
    with torch.no_grad():
        got = model(**batch).logits
    assert len(modeling._CALLS) == model.config.num_hidden_layers
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    integration.unpatch(model)


def test_not_a_transformers_model_is_an_error():
    with pytest.raises(ValueError, match="has no config.model_type"):
        integration.patch(torch.nn.Linear(2, 2))


# ---- a patched model under ordinary model handling ----

def perturbed(model, seed):
    """model with every parameter moved by a fixed random amount (in place), returned."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.05)
    return model


def test_deepcopy_of_a_patched_model_runs_its_own_weights():
    import copy

    model = build("llama")
    batches = inputs("llama")
    reference = perturbed(copy.deepcopy(model), 1)  # modified independently, never patched
    integration.patch(model)
    before, _ = logits(model, batches)
    clone = perturbed(copy.deepcopy(model), 1)  # TRL's reference model is made this way
    assert integration.is_patched(clone)
    got, n = logits(clone, batches)
    want, _ = logits(reference, batches)
    assert n == OPS
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    assert torch.equal(logits(model, batches)[0][0], before[0])  # the original is untouched
    integration.unpatch(clone)
    assert integration.is_patched(model) and not integration.is_patched(clone)
    assert logits(clone, batches)[1] == 0 and logits(model, batches)[1] == OPS


def test_torch_save_and_load_of_a_whole_patched_model(tmp_path):
    model = build("qwen2")
    batches = inputs("qwen2")
    integration.patch(model)
    want, _ = logits(model, batches)
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    assert integration.is_patched(loaded)
    got, n = logits(loaded, batches)
    assert n == OPS and torch.equal(got[0], want[0])
    integration.unpatch(loaded)
    assert logits(loaded, batches)[1] == 0


def test_a_saved_patched_model_loads_in_a_fresh_process(tmp_path):
    # The patched classes are made at run time: loading must rebuild them where none exists yet.
    import os
    import subprocess
    import sys

    model = build("gemma2")
    integration.patch(model)
    ids = torch.randint(10, 128, (2, 12))
    with torch.no_grad():
        want = model(input_ids=ids).logits
    torch.save({"model": model, "ids": ids, "want": want}, tmp_path / "saved.pt")
    script = (
        "import sys, torch\n"
        f"saved = torch.load({str(tmp_path / 'saved.pt')!r}, weights_only=False)\n"
        "from rope_ext.integrations import transformers as integration\n"
        "model = saved['model']\n"
        "assert integration.is_patched(model)\n"
        "with torch.no_grad():\n"
        "    got = model(input_ids=saved['ids']).logits\n"
        "assert torch.equal(got, saved['want']), (got - saved['want']).abs().max()\n"
        "print('ok')\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                         cwd=str(tmp_path), timeout=600)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-3000:]


def test_state_dict_round_trips_between_patched_and_unpatched():
    batches = inputs("phi3")
    source = perturbed(build("phi3"), 2)
    want, _ = logits(source, batches)
    patched = integration.patch(build("phi3"))
    assert patched.state_dict().keys() == source.state_dict().keys()
    patched.load_state_dict(source.state_dict())
    got, n = logits(patched, batches)
    assert n == OPS
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    back = build("phi3")
    back.load_state_dict(patched.state_dict())
    assert torch.equal(logits(back, batches)[0][0], want[0])


class GraphOps:
    """A torch.compile backend that records the ops of the graphs it is given, then runs them."""

    def __init__(self):
        self.targets = []

    def __call__(self, gm, example_inputs):
        self.targets += [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
        return gm.forward


@pytest.mark.parametrize("family", ["llama", "qwen3", "exaone4", "deepseek_v2"])
def test_torch_compile_fullgraph(family):
    model = build(family)
    ids = torch.randint(10, 128, (2, 12))
    with torch.no_grad():
        want = model(input_ids=ids).logits
    integration.patch(model)
    torch._dynamo.reset()
    backend = GraphOps()
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    api, traced = _qk_norm.fused_op, []
    _qk_norm.fused_op = lambda *a, **k: traced.append(1) or api(*a, **k)
    try:
        with torch.no_grad():
            got = compiled(input_ids=ids).logits
    finally:
        _qk_norm.fused_op = api
        torch._dynamo.reset()
    rope_ops = [t for t in backend.targets if t.startswith("rope.")]
    if family in QK_NORM:  # the fused op, traced once per layer that rotates
        rotating = 1 if family in SOME_LAYERS else 2
        assert len(traced) == rotating
        if hasattr(torch.ops.rope, "qk_norm_rope"):
            assert [t.split(".")[1] for t in rope_ops] == ["qk_norm_rope"] * rotating, rope_ops
    else:
        assert len(rope_ops) == 4 and not traced, backend.targets  # q and k of 2 layers
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_hooks_installed_after_patch_keep_working():
    import functools

    model = build("llama")
    batches = inputs("llama")
    want, _ = logits(model, batches)
    integration.patch(model)
    attention = model.model.layers[0].self_attn
    seen = []
    handle = attention.register_forward_hook(lambda m, args, out: seen.append("hook"))

    # accelerate's add_hook_to_module: the bound forward kept, a new instance forward around it.
    def new_forward(module, *args, **kwargs):
        seen.append("instance forward")
        return module._old_forward(*args, **kwargs)

    attention._old_forward = attention.forward
    attention.forward = functools.update_wrapper(functools.partial(new_forward, attention),
                                                 attention._old_forward)
    got, n = logits(model, batches)
    assert n == OPS and seen == ["instance forward", "hook"] * len(batches)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    installed = attention.__dict__["forward"]
    integration.unpatch(model)
    assert attention.__dict__["forward"] is installed  # unpatch leaves what others installed
    seen.clear()
    again, n = logits(model, batches)
    assert n == 0 and seen == ["instance forward", "hook"] * len(batches)
    assert torch.equal(again[0], want[0])
    handle.remove()


def test_unpatch_removes_only_what_patch_added():
    model = build("qwen3_moe")
    attrs = {name: dict(m.__dict__) for name, m in model.named_modules()}
    classes = {name: type(m) for name, m in model.named_modules()}
    integration.patch(model)
    assert {name: dict(m.__dict__) for name, m in model.named_modules()} == attrs
    integration.unpatch(model)
    assert {name: type(m) for name, m in model.named_modules()} == classes
    assert {name: dict(m.__dict__) for name, m in model.named_modules()} == attrs


# ---- the QK-norm families on the fused op: generation and training as unpatched ----

QK_NORM_TEXT = sorted(f for f in QK_NORM if f in FAMILIES and f not in VL)
EMBEDDING = {"embedding_gemma2_text"}  # no LM head: nothing to generate


@pytest.mark.parametrize("family", [f for f in QK_NORM_TEXT if f not in EMBEDDING])
def test_qk_norm_families_generate_the_same_tokens(family):
    model = perturbed(build(family), 3)  # norm weights away from their initial 1 (or 0)
    ids = torch.randint(10, 128, (2, 6))
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    torch.manual_seed(0)  # (DiffusionGemma's canvas starts from noise)
    want = tokens(model.generate(ids, **kw))
    integration.patch(model)
    assert any(getattr(type(m), "_rope_ext_spec", (0, 0, False))[2] for m in model.modules())
    torch.manual_seed(0)
    got = tokens(model.generate(ids, **kw))
    integration.unpatch(model)
    assert torch.equal(got, want)


def tokens(generated):
    """generate's tokens (DiffusionGemma's come in an output object)."""
    return generated if isinstance(generated, torch.Tensor) else generated.sequences


# Families with norms under other names, one-tensor fusion, and the common case.
HOOK_FAMILIES = ["qwen3", "lfm2", "gemma4_text" if HF5 else "gemma3n_text"]


def first_fused_norm(model):
    """(an attention module of model whose norms are fused, the name of its q norm module)."""
    for m in model.modules():
        if getattr(type(m), "_rope_ext_spec", (None, None, False))[2]:
            fn = getattr(type(m).__bases__[0], "forward")
            names = _qk_norm.norm_names(inspect.unwrap(fn), type(m)._rope_ext_spec[1][0],
                                        type(m)._rope_ext_spec[2])
            return m, names[0]
    raise AssertionError("no fused attention")


def _biased(norm):
    """A norm of a subclass of norm's class adding a bias (zero when constructed: its class
    passes the probe of the norm form) that is not zero."""
    class BiasedNorm(type(norm)):
        def __init__(self, dim, eps=1e-6, **kwargs):
            super().__init__(dim, eps=eps, **kwargs)
            self.bias = torch.nn.Parameter(torch.zeros(dim))

        def forward(self, x):
            return super().forward(x) + self.bias.to(x.dtype)

    dim = norm.weight.shape[0]
    eps = next(getattr(norm, a) for a in ("variance_epsilon", "eps") if hasattr(norm, a))
    new = BiasedNorm(dim, eps=eps)
    with torch.no_grad():
        new.weight.copy_(norm.weight)
        new.bias.normal_(0, 0.5)
    return new


@pytest.mark.parametrize("family", HOOK_FAMILIES)
@pytest.mark.parametrize("how", ["module hook", "global hook", "pre hook", "identity",
                                 "layer norm", "instance forward", "class forward", "biased norm",
                                 "rms norm of eps None"])
def test_norms_with_hooks_or_replaced_after_patch_run_as_transformers_runs_them(family, how,
                                                                                monkeypatch):
    """A q norm with a hook (its own or a global one), an instance forward, its class's forward
    replaced after a patch, or replaced after patch by a module of another form (one holding
    more than its weight, a bias say; torch's RMSNorm with eps None, the dtype's epsilon) is not
    fused: the patched model computes what the unpatched one does with it, and the hooks fire as
    often."""
    model = perturbed(build(family), 8)
    batches = [text_batch(model, torch.randint(10, 128, (2, 9)))]
    integration.patch(model)
    attention, name = first_fused_norm(model)
    integration.unpatch(model)
    norm = getattr(attention, name)
    fired = []
    if how == "module hook":  # an output-scaling hook
        handle = norm.register_forward_hook(lambda m, a, out: fired.append(1) or out * 1.5)
    elif how == "pre hook":
        handle = norm.register_forward_pre_hook(lambda m, a: fired.append(1) or (a[0] * 0.5,))
    elif how == "global hook":
        handle = torch.nn.modules.module.register_module_forward_hook(
            lambda m, a, out: (fired.append(1), out * 1.25)[1] if m is norm else None)
    elif how == "identity":
        setattr(attention, name, torch.nn.Identity())
    elif how == "layer norm":
        setattr(attention, name, torch.nn.LayerNorm(norm.weight.shape[0]))
    elif how == "class forward":  # its class probed by the patch above, then changed
        forward = type(norm).forward
        monkeypatch.setattr(type(norm), "forward", lambda self, x: forward(self, x) * 2)
    elif how == "biased norm":
        setattr(attention, name, _biased(norm))
    elif how == "rms norm of eps None":
        _qk_norm._norm_form(torch.nn.RMSNorm(8, eps=1e-6))  # the class known as fusable
        rms = torch.nn.RMSNorm(norm.weight.shape[0], eps=None)
        with torch.no_grad():
            rms.weight.copy_(norm.weight)
        setattr(attention, name, rms)
    else:
        norm.forward = lambda x: x * 2
    try:
        want, _ = logits(model, batches)
        fired_unpatched, fired[:] = len(fired), []
        integration.patch(model)
        got, _ = logits(model, batches)
        integration.unpatch(model)
    finally:
        if how.endswith("hook"):
            handle.remove()
    assert len(fired) == fired_unpatched
    assert fired_unpatched > 0 or not how.endswith("hook")
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", QK_NORM_TEXT)
def test_qk_norm_families_same_gradients(family):
    model = perturbed(build(family), 4).train()
    ids = torch.randint(0, 128, (2, 10))

    want = gradients(model, ids)
    integration.patch(model)
    _, _, calls = patched_calls(model, [text_batch(model, ids)])  # the fused path runs
    assert calls["fused attention"] > 0 and fused_per_attention(family, calls)
    got = gradients(model, ids)
    integration.unpatch(model)
    assert got.keys() == want.keys()
    assert any("q_norm" in n or "q_layernorm" in n for n in want)  # the norms get gradients
    # Gemma 3n's and 4's models have more steps between the norms and the loss (soft-capped
    # logits; Gemma 4 twice as deep): float32 rounding differences reach a few 1e-6 in some
    # gradients.
    atol = 1e-5 if family in ONE_TENSOR else 1e-6
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=atol)


@pytest.mark.skipif(not HF5, reason="GLM-OCR is in transformers 5")
def test_vision_tower_qk_norm_same_gradients():
    """GLM-OCR's vision attention norms q and k per head before its RoPE: fused, with
    transformers' gradients for every parameter (the vision norms' weights among them)."""
    model = perturbed(build("glm_ocr"), 7).train()
    image = inputs("glm_ocr")[1]
    batch = dict(image, labels=image["input_ids"])

    def grads():
        model.zero_grad()
        model(**batch).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    want = grads()
    integration.patch(model)
    _, _, calls = patched_calls(model, [image])
    assert calls["fused"] == calls["fused attention"] == 1  # the one vision layer
    got = grads()
    integration.unpatch(model)
    assert got.keys() == want.keys() and any("visual" in n and "q_norm" in n for n in want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6)


def test_qk_norm_bf16_logits():
    model = perturbed(build("qwen3"), 5).to(torch.bfloat16)
    batches = inputs("qwen3")
    want, _ = logits(model, batches)
    integration.patch(model)
    got, _, calls = patched_calls(model, batches)
    integration.unpatch(model)
    assert calls["fused"] == 2
    # transformers rounds the normalized value to bf16 before the weight and again after RoPE;
    # the fused op rounds once.
    torch.testing.assert_close(got[0].float(), want[0].float(), rtol=3e-2, atol=3e-2)


def test_qk_norm_tables_of_every_layer():
    """The fused call keeps the half-width views of the last cos/sin it converted for the next
    layer: given the same tensors after they changed in place it reads their new values, other
    tensors are converted afresh, and tables that require grad get transformers' gradients."""
    import copy

    model = perturbed(build("qwen3"), 6)
    plain = copy.deepcopy(model.model.layers[0].self_attn)  # never patched
    integration.patch(model)
    attn = model.model.layers[0].self_attn
    assert type(attn)._rope_ext_spec[2]  # fused
    h = torch.randn(2, 5, 64)
    cos, sin = model.model.rotary_emb(h, torch.arange(5).expand(2, -1))

    def check(cos, sin):
        torch.testing.assert_close(attn(h, (cos, sin), None)[0], plain(h, (cos, sin), None)[0],
                                   rtol=1e-5, atol=1e-5)

    with torch.no_grad():
        check(cos, sin)
        check(cos, sin)  # the kept views
        cos.mul_(0.5)
        sin.add_(0.25)
        check(cos, sin)  # the same tensors, new values
        check(cos.clone(), sin.clone())
        check(cos[:1], sin[:1])  # one batch row of tables for both rows of h
    grads = []
    for module in (attn, plain):
        c, s = cos.clone().requires_grad_(), sin.clone().requires_grad_()
        module(h, (c, s), None)[0].square().sum().backward()
        grads.append((c.grad, s.grad))
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    integration.unpatch(model)


def test_a_forward_leaves_no_table_alive():
    # the tables shared by the layers of one forward are let go with it (a long prefill's would
    # otherwise stay until the next forward)
    model = integration.patch(build("qwen3"))
    with torch.no_grad():
        model(**inputs("qwen3")[0])
    assert _qk_norm._last_tables is None


def test_alternating_long_lived_tables_hold_no_growing_state():
    # two (cos, sin) pairs a caller keeps and alternates: each switch once registered a
    # finalizer on the table that lived as long as it did (unbounded growth)
    model = integration.patch(build("qwen3"))
    attn = model.model.layers[0].self_attn
    h = torch.randn(1, 5, 64)
    pairs = [model.model.rotary_emb(h, torch.arange(5)[None] + i) for i in range(2)]
    with torch.no_grad():
        before = len(weakref.finalize._registry)
        for i in range(50):
            attn(h, pairs[i % 2], None)
        assert len(weakref.finalize._registry) <= before
        assert _qk_norm._last_tables is not None
    del pairs
    gc.collect()
    assert _qk_norm._last_tables is None
    integration.unpatch(model)


def test_olmo2_norms_over_all_heads_are_not_fused():
    model = build("olmo2")
    integration.patch(model)
    specs = [type(m)._rope_ext_spec for m in model.modules() if integration.is_patched(m)
             and getattr(type(m), "_rope_ext_spec", None)]
    integration.unpatch(model)
    assert specs and not any(spec[2] for spec in specs)


# Attention forwards of the shapes the fusion rewrite (_qk_norm) decides on: each is the lines
# after `q = self.q_norm(q)` and `k = self.k_norm(k)`, then `return q, k`.
FUSED_SHAPES = {
    # EXAONE 4: norms on every layer, RoPE on the rotary ones only
    "rope-on-some-layers": """
        k = k.transpose(1, 2)
        if self.rotary:
            q, k = _rope(q, k, cos, sin)""",
    # T5Gemma 2's merged attention: another k_norm call, of the cross-attention keys
    "another-norm-call": """
        n = q.shape[0] * k.shape[-1]  # metadata reads see the same either way
        q, k = _rope(q, k, cos, sin)
        q = q * n + self.k_norm(cos)""",
}
UNFUSED_SHAPES = {
    "rope-or-else": """
        if self.rotary:
            q, k = _rope(q, k, cos, sin)
        else:
            q = q * 2""",
    "rope-to-new-names": """
        q2, k2 = _rope(q, k, cos, sin)""",
    "normed-q-changed-before-rope": """
        q = q * 2
        q, k = _rope(q, k, cos, sin)""",
    "normed-q-read-before-rope": """
        self.seen = q + 0  # would see q unnormed once the norm is fused into the RoPE call
        q, k = _rope(q, k, cos, sin)""",
}


def shaped_forward(name, lines):
    """The forward of one of those shapes, as a function in a file of its own (the rewrite reads
    its source)."""
    import linecache
    import textwrap

    source = ("def forward(self, q, k, cos, sin):\n    q = self.q_norm(q)\n"
              "    k = self.k_norm(k)\n" + textwrap.indent(textwrap.dedent(lines).strip("\n"), "    ")
              + "\n    return q, k\n")
    filename = f"<rope_ext shape {name}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    namespace = {"_rope": lambda q, k, cos, sin: (q, k)}  # with no rotation: the norms alone
    exec(compile(source, filename, "exec"), namespace)
    return namespace["forward"]


def test_norm_names_are_found_by_what_the_forward_does():
    """The modules feeding the RoPE call are found whatever their names (LFM2's q_layernorm);
    a projection found so (no norm at all) is for fusable_norms to refuse."""
    forward = shaped_forward("plain", """
        q, k = _rope(q, k, cos, sin)""")
    assert _qk_norm.norm_names(forward, "_rope") == ("q_norm", "k_norm")
    import linecache
    source = ("def forward(self, h, cos, sin):\n"
              "    q = self.q_layernorm(self.q_proj(h).view(2, 3)).transpose(1, 2)\n"
              "    k = self.k_proj(h).view(2, 3)\n    k = self.key_ln(k).transpose(1, 2)\n"
              "    q, k = _rope(q, k, cos, sin)\n    return q, k\n")
    linecache.cache["<rope_ext named norms>"] = (len(source), None, source.splitlines(True),
                                                 "<rope_ext named norms>")
    namespace = {}
    exec(compile(source, "<rope_ext named norms>", "exec"), namespace)
    assert _qk_norm.norm_names(namespace["forward"], "_rope") == ("q_layernorm", "key_ln")
    assert _qk_norm.rewritten_forward(namespace["forward"], "_rope",
                                      norms=("q_layernorm", "key_ln")) is not None


def test_one_tensor_rewrite_refuses_a_read_of_the_normed_tensor():
    """Norm and RoPE one tensor at a time (Gemma 3n, 4): a statement reading the normed tensor
    before its RoPE call, or after it when the RoPE result went to another name, would see it
    unnormed once the norm moves into that call, so the forward is not rewritten; its own
    relayout in between and reads of its metadata are fine."""
    import linecache

    def forward_of(body):
        source = ("def forward(self, k, cos, sin):\n    k = self.k_norm(k)\n" + body
                  + "    return k, v\n")
        filename = f"<rope_ext one tensor {abs(hash(body))}>"
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        namespace = {}
        exec(compile(source, filename, "exec"), namespace)
        return namespace["forward"]

    def rewritten(body):
        return _qk_norm.rewritten_forward(forward_of(body), "_rope", _qk_norm.ONE_TENSOR, ("k_norm",))

    rope = "    k = _rope(k, cos, sin)\n"
    for body in ("    v = k * 1.0\n" + rope, "    v = k.transpose(1, 2)\n" + rope,
                 "    k = k.transpose(1, 2) + k\n" + rope, "    v = _rope(k, cos, sin)\n",
                 "    v, k = _rope(k, cos, sin), 0\n"):
        assert rewritten(body) is None, body
    for body in ("    k = k.transpose(1, 2)\n    v = 0\n" + rope, "    v = k.shape[0]\n" + rope,
                 "    v = 0\n    k = _rope(k, cos, k.dtype)\n"):
        assert rewritten(body) is not None, body


def test_a_norm_without_its_weight_is_not_stood_in_for():
    """A norm of a class probed as fusable but holding no weight (Gemma 3n's with_scale=False
    form, say) is left to itself, not read for a weight it lacks."""
    norm = torch.nn.RMSNorm(8, eps=1e-6)
    assert _qk_norm._stand_in(norm, torch.randn(2, 8)) is not None
    for weightless in (torch.nn.RMSNorm(8, eps=1e-6, elementwise_affine=False),
                       torch.nn.RMSNorm(8, eps=1e-6)):
        if weightless.weight is not None:
            del weightless.weight  # no such attribute at all
        assert _qk_norm._stand_in(weightless, torch.randn(2, 8)) is None


class _OffsetNorm(torch.nn.Module):
    """An RMSNorm whose form its constructor chooses, as Liger-Kernel's LigerRMSNorm(offset=)."""

    def __init__(self, dim, eps=1e-6, offset=0.0):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(dim) * 0.3)
        self.variance_epsilon, self.offset = eps, offset

    def forward(self, x):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (xf * (self.offset + self.weight.float())).to(x.dtype)


class _CudaOnlyNorm(_OffsetNorm):
    """A norm that cannot run on the CPU tensors a probe would give it (a Triton kernel's)."""

    def forward(self, x):
        if not x.is_cuda:
            raise RuntimeError("expected a CUDA tensor")
        return super().forward(x)


@pytest.mark.parametrize("when", ["before patch", "after patch"])
@pytest.mark.parametrize("norm", ["offset 1", "cuda only"])
def test_norms_the_class_probe_does_not_cover_compute_their_own_form(norm, when, monkeypatch):
    """A norm instance whose settings are not those of the fresh instance its class was probed
    with (offset=1.0: the (1 + w) form, where the probe saw w) is probed on a copy of itself (it
    was fused as w), and a norm class whose forward cannot run on the probe's CPU rows is left
    to itself (patch() raised its error)."""
    monkeypatch.setattr(_qk_norm, "_norm_forms", {})
    model = build("qwen3")
    batches = inputs("qwen3")

    def swap(m):
        torch.manual_seed(1)
        for layer in m.model.layers:
            for name in ("q_norm", "k_norm"):
                setattr(layer.self_attn, name, _OffsetNorm(16, offset=1.0))

    if when == "before patch":
        swap(model)
    if norm == "cuda only":  # the class met first at patch time: probed then
        monkeypatch.setattr(_qk_norm, "_norm_forms", {})
        layer = model.model.layers[0].self_attn
        layer.q_norm = layer.k_norm = _CudaOnlyNorm(16)
        assert _qk_norm._stand_in(layer.q_norm, torch.randn(2, 16)) is None
        offset = _OffsetNorm(16, offset=1.0)
        assert _qk_norm._stand_in(offset, torch.randn(2, 16))[2] is True  # unit_offset
        layer.q_norm, layer.k_norm = _OffsetNorm(16, offset=1.0), _OffsetNorm(16, offset=1.0)
    want, _ = logits(copy.deepcopy(model), batches)
    integration.patch(model)
    if when == "after patch":
        swap(model)
        reference = copy.deepcopy(model)
        integration.unpatch(reference)
        want, _ = logits(reference, batches)
    got, _ = logits(model, batches)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_a_fused_norm_keeps_the_dtype_its_module_returns_under_autocast():
    """Under autocast (bfloat16 rows, float32 norm weights) Qwen3's norm returns float32 rows,
    which the op, writing the rows' dtype, would not: that call runs unfused; Gemma 3's norm
    returns the rows' dtype, and stays fused."""
    for family, fused in (("qwen3", False), ("gemma3_text", True)):
        if family not in FAMILIES or isinstance(build(family), Missing):
            continue
        model = build(family)
        batches = inputs(family)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            want, _ = logits(model, batches)
            integration.patch(model)
            got, _, calls = patched_calls(model, batches)
        assert (calls["fused"] > 0) == fused, family
        tol = 2e-2 if fused else 1e-5  # fused: bfloat16 rows rounded once, not twice
        for g, w in zip(got, want):
            assert g.dtype == w.dtype
            torch.testing.assert_close(g, w, rtol=tol, atol=tol, msg=family)


@pytest.mark.parametrize("shape", sorted(UNFUSED_SHAPES))
def test_rewrite_refuses_shapes(shape):
    assert _qk_norm.rewritten_forward(shaped_forward(shape, UNFUSED_SHAPES[shape]), "_rope") is None


@pytest.mark.parametrize("shape", sorted(FUSED_SHAPES))
def test_rewrite_shapes(shape):
    """The rewrite takes the norm calls whose results the RoPE call rotates and leaves any
    other; RoPE under an `if` after unconditional norms runs fused when taken and the norms
    alone otherwise (an added else branch). The rewritten forward computes what the original
    does (the fused call stands in for the norms)."""
    original = shaped_forward(shape, FUSED_SHAPES[shape])
    fused = _qk_norm.rewritten_forward(original, "_rope")
    assert fused is not None
    original.__globals__[_qk_norm.FUSED_NAME] = (
        lambda self, q, k, cos, sin, _normed, _norms:
            (getattr(self, _norms[0])(q), getattr(self, _norms[1])(k)))
    q, k, cos = torch.randn(2, 3, 4, 8), torch.randn(2, 4, 3, 8), torch.randn(8)
    for rotary in (False, True):
        layer = types.SimpleNamespace(q_norm=lambda x: x + 1, k_norm=lambda x: x * 3,
                                      rotary=rotary)
        got, want = fused(layer, q, k, cos, None), original(layer, q, k, cos, None)
        assert all(torch.equal(g, w) for g, w in zip(got, want)), rotary


class _Doubled(torch.nn.Module):
    def forward(self, w):
        return 2 * w


class _Tagged:
    def __init_subclass__(cls, *, tag, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.tag = tag


def test_unpatch_gives_the_original_class_where_a_later_class_cannot_be_made_again():
    """A class statement over a patched class (its methods' super() bound to it, or an
    __init_subclass__ that asks for arguments) cannot be made again over transformers' class:
    unpatch gives its modules transformers' class, every one of them, as before such classes."""
    import functools

    def passed_on(f):  # a decorator: the super() call sits in the function it wraps
        @functools.wraps(f)
        def wrapper(*args, **kwargs):
            return f(*args, **kwargs)
        return wrapper

    for decorate in (lambda f: f, passed_on):
        model = build("llama")
        batches = inputs("llama")
        want, _ = logits(model, batches)
        integration.patch(model)
        first, second = (layer.self_attn for layer in model.model.layers[:2])

        class Wrapped(type(first)):
            @decorate
            def forward(self, *args, **kwargs):
                return super().forward(*args, **kwargs)

        class Marked(_Tagged, type(second), tag="x"):
            pass

        first.__class__, second.__class__ = Wrapped, Marked
        integration.unpatch(model)
        assert not integration.is_patched(model)
        assert type(first) is type(second) is Wrapped.__mro__[2]  # transformers' class
        again, n = logits(model, batches)
        assert n == 0 and all(torch.equal(g, w) for g, w in zip(again, want))


UNPATCH_AFTER_FSDP2 = """
import os, sys, torch, torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, fully_shard
import rope_ext.integrations.transformers as integration
sys.path.insert(0, {tests!r})
import test_integrations as t
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
model = t.build("llama")
batches = t.inputs("llama")
want, _ = t.logits(model, batches)
integration.patch(model)
attention = [layer.self_attn for layer in model.model.layers]
for a in attention:
    fully_shard(a)
got, n, _ = t.patched_calls(model, batches)
assert n > 0 and all(torch.equal(g, w) for g, w in zip(got, want))
integration.unpatch(model)
assert not integration.is_patched(model)
assert all(isinstance(a, FSDPModule) and type(a).__name__ == "FSDPLlamaAttention" for a in attention)
again, n = t.logits(model, batches)
assert n == 0 and all(torch.equal(a, w) for a, w in zip(again, want))
attention[0].unshard()
attention[0].reshard()
dist.destroy_process_group()
print("ok")
"""


def test_unpatch_keeps_a_class_made_from_the_patched_one_since(tmp_path):
    """A class made from a patched attention class after patch (parametrize's, FSDP2's
    fully_shard's) stays on unpatch, made anew over transformers' class: unpatch neither drops
    what it adds (a parametrized weight, FSDP's unshard) nor leaves rope_ext's forward."""
    import subprocess
    import sys
    from torch.nn.utils import parametrize
    model = build("llama")
    batches = inputs("llama")
    want, _ = logits(model, batches)
    integration.patch(model)
    a = model.model.layers[0].self_attn
    a.register_parameter("extra", torch.nn.Parameter(torch.ones(3)))
    parametrize.register_parametrization(a, "extra", _Doubled())
    integration.unpatch(model)
    assert not integration.is_patched(model) and parametrize.is_parametrized(a, "extra")
    assert torch.equal(a.extra, torch.full((3,), 2.0))
    again, n = logits(model, batches)
    assert n == 0 and all(torch.equal(g, w) for g, w in zip(again, want))
    if not torch.distributed.is_available():
        return
    here = os.path.dirname(os.path.abspath(__file__))
    out = subprocess.run([sys.executable, "-c", UNPATCH_AFTER_FSDP2.format(tests=here)],
                         capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_a_norm_class_made_per_instance_is_not_kept():
    """parametrize gives each parametrized module a class of its own: the QK-norm probe's
    per-class cache holds none of them past its model (it held every one, for the process)."""
    from torch.nn.utils import parametrize
    norm_classes = []
    for _ in range(2):
        model = build("qwen3")
        batches = inputs("qwen3")
        for layer in model.model.layers:
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                parametrize.register_parametrization(norm, "weight", _Doubled())
        want, _ = logits(model, batches)
        integration.patch(model)
        got, _, calls = patched_calls(model, batches)
        assert calls["fused attention"] > 0
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
        norm_classes += [weakref.ref(type(layer.self_attn.q_norm)) for layer in model.model.layers]
        del model, layer, norm
        gc.collect()
    assert norm_classes and all(c() is None for c in norm_classes)


@pytest.mark.parametrize("scaling", [None, {"rope_type": "dynamic", "factor": 2.0,
                                     "original_max_position_embeddings": 128}])
def test_a_model_holding_rotary_embedding_loads_with_its_tables(tmp_path, scaling):
    """from_pretrained of a user model that holds rope_ext.RotaryEmbedding: transformers 5 builds
    it on the meta device and sets each non-persistent buffer to an empty tensor, which a table
    must not be left as (transformers 4 builds it on the CPU)."""
    class Config(transformers.PretrainedConfig):
        model_type = "rope_ext_test_toy"

    class Toy(transformers.PreTrainedModel):
        config_class = Config

        def __init__(self, config):
            super().__init__(config)
            self.proj = torch.nn.Linear(16, 16)
            kw = {} if scaling is None else dict(scaling=scaling, max_position=256)
            self.rope = RotaryEmbedding(16, **kw)
            self.post_init()

        def forward(self, x, pos):
            return self.rope(self.proj(x), None, pos)[0]

    model = Toy(Config()).eval()
    model.save_pretrained(tmp_path)
    loaded = Toy.from_pretrained(tmp_path).eval()
    assert torch.equal(loaded.rope._tables, model.rope._tables)
    x, pos = torch.randn(1, 200, 2, 16), torch.arange(200)[None]
    with torch.no_grad():
        assert torch.equal(loaded(x, pos), model(x, pos))
