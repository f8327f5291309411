"""Tiny random-weight diffusers transformers, one per family rope_ext patches, built from config,
with random inputs for their forward: shared by the diffusers tests and the benchmark's checks."""

import torch


def _ids(rows, cols, scale=4.0):
    # FLUX-style positions: integer grid plus fractional offsets, as image edits produce.
    return torch.randint(0, 8, (rows, cols)).float() + torch.rand(rows, cols).round() * 0.5


def _duplicated_tables(tokens, head_dim):
    angles = torch.rand(tokens, head_dim // 2, dtype=torch.float64) * 20
    return (angles.cos().repeat_interleave(2, -1).float(), angles.sin().repeat_interleave(2, -1).float())


def flux():
    from diffusers import FluxTransformer2DModel

    m = FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1,
                               attention_head_dim=16, num_attention_heads=2, joint_attention_dim=8,
                               pooled_projection_dim=8, axes_dims_rope=(4, 4, 8))
    inputs = dict(hidden_states=torch.randn(2, 16, 4), encoder_hidden_states=torch.randn(2, 5, 8),
                  pooled_projections=torch.randn(2, 8), timestep=torch.tensor([0.5, 0.8]),
                  img_ids=_ids(16, 3), txt_ids=torch.zeros(5, 3))
    return m, inputs


def chroma():
    from diffusers import ChromaTransformer2DModel

    m = ChromaTransformer2DModel(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1,
                                 attention_head_dim=16, num_attention_heads=2, joint_attention_dim=8,
                                 axes_dims_rope=(4, 4, 8), approximator_num_channels=8,
                                 approximator_hidden_dim=16, approximator_layers=1)
    inputs = dict(hidden_states=torch.randn(2, 16, 4), encoder_hidden_states=torch.randn(2, 5, 8),
                  timestep=torch.tensor([0.5, 0.8]), img_ids=_ids(16, 3), txt_ids=torch.zeros(5, 3))
    return m, inputs


def flux2():
    from diffusers import Flux2Transformer2DModel

    m = Flux2Transformer2DModel(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1,
                                attention_head_dim=16, num_attention_heads=2, joint_attention_dim=8,
                                timestep_guidance_channels=8, axes_dims_rope=(4, 4, 4, 4),
                                guidance_embeds=False)
    inputs = dict(hidden_states=torch.randn(2, 16, 4), encoder_hidden_states=torch.randn(2, 5, 8),
                  timestep=torch.tensor([0.5, 0.8]), img_ids=_ids(16, 4), txt_ids=torch.zeros(5, 4))
    return m, inputs


def wan():
    from diffusers import WanTransformer3DModel

    m = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12,
                              in_channels=4, out_channels=4, text_dim=8, freq_dim=8, ffn_dim=16,
                              num_layers=1, rope_max_seq_len=32)
    inputs = dict(hidden_states=torch.randn(2, 4, 3, 4, 6), timestep=torch.tensor([10, 500]),
                  encoder_hidden_states=torch.randn(2, 5, 8))
    return m, inputs


def hunyuan_video():
    from diffusers import HunyuanVideoTransformer3DModel

    m = HunyuanVideoTransformer3DModel(in_channels=4, out_channels=4, num_attention_heads=2,
                                       attention_head_dim=16, num_layers=1, num_single_layers=1,
                                       num_refiner_layers=1, patch_size=1, patch_size_t=1,
                                       text_embed_dim=8, pooled_projection_dim=8,
                                       rope_axes_dim=(4, 6, 6))
    inputs = dict(hidden_states=torch.randn(2, 4, 2, 4, 4), timestep=torch.tensor([10, 500]),
                  encoder_hidden_states=torch.randn(2, 5, 8),
                  encoder_attention_mask=torch.ones(2, 5), pooled_projections=torch.randn(2, 8),
                  guidance=torch.tensor([3.0, 3.0]))
    return m, inputs


def qwenimage():
    from diffusers import QwenImageTransformer2DModel

    m = QwenImageTransformer2DModel(patch_size=2, in_channels=16, out_channels=4, num_layers=1,
                                    attention_head_dim=16, num_attention_heads=2,
                                    joint_attention_dim=8, axes_dims_rope=(4, 6, 6))
    inputs = dict(hidden_states=torch.randn(2, 12, 16), encoder_hidden_states=torch.randn(2, 5, 8),
                  encoder_hidden_states_mask=torch.ones(2, 5), timestep=torch.tensor([0.5, 0.8]),
                  img_shapes=[[(1, 3, 4)]] * 2)
    return m, inputs


def ltx():
    from diffusers import LTXVideoTransformer3DModel

    m = LTXVideoTransformer3DModel(in_channels=8, out_channels=8, num_attention_heads=2,
                                   attention_head_dim=8, cross_attention_dim=16, num_layers=1,
                                   caption_channels=8)
    inputs = dict(hidden_states=torch.randn(2, 2 * 4 * 4, 8), encoder_hidden_states=torch.randn(2, 5, 8),
                  timestep=torch.tensor([10, 500]), encoder_attention_mask=torch.ones(2, 5),
                  num_frames=2, height=4, width=4)
    return m, inputs


def cogvideox():
    from diffusers import CogVideoXTransformer3DModel

    m = CogVideoXTransformer3DModel(num_attention_heads=2, attention_head_dim=16, in_channels=4,
                                    out_channels=4, time_embed_dim=8, text_embed_dim=8, num_layers=1,
                                    sample_width=8, sample_height=8, sample_frames=9, patch_size=2,
                                    max_text_seq_length=5, use_rotary_positional_embeddings=True)
    inputs = dict(hidden_states=torch.randn(2, 3, 4, 8, 8), encoder_hidden_states=torch.randn(2, 5, 8),
                  timestep=torch.tensor([10, 500]), image_rotary_emb=_duplicated_tables(3 * 4 * 4, 16))
    return m, inputs


def lumina2():
    from diffusers import Lumina2Transformer2DModel

    m = Lumina2Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, hidden_size=32,
                                  num_layers=1, num_refiner_layers=1, num_attention_heads=2,
                                  num_kv_heads=1, multiple_of=16, axes_dim_rope=(4, 6, 6),
                                  axes_lens=(32, 32, 32), cap_feat_dim=8)
    mask = torch.ones(2, 5, dtype=torch.bool)
    mask[1, 3:] = False
    inputs = dict(hidden_states=torch.randn(2, 4, 8, 8), timestep=torch.tensor([0.5, 0.8]),
                  encoder_hidden_states=torch.randn(2, 5, 8), encoder_attention_mask=mask)
    return m, inputs


def cogview4():
    from diffusers import CogView4Transformer2DModel

    m = CogView4Transformer2DModel(patch_size=2, in_channels=4, out_channels=4, num_layers=1,
                                   attention_head_dim=16, num_attention_heads=2, text_embed_dim=8,
                                   time_embed_dim=8, condition_dim=4, sample_size=8,
                                   rope_axes_dim=(16, 16))
    inputs = dict(hidden_states=torch.randn(2, 4, 8, 8), encoder_hidden_states=torch.randn(2, 5, 8),
                  timestep=torch.tensor([10, 500]), original_size=torch.tensor([[64, 64]] * 2),
                  target_size=torch.tensor([[64, 64]] * 2), crop_coords=torch.tensor([[0, 0]] * 2))
    return m, inputs


def mochi():
    from diffusers import MochiTransformer3DModel

    m = MochiTransformer3DModel(patch_size=2, num_attention_heads=2, attention_head_dim=16,
                                num_layers=1, pooled_projection_dim=8, in_channels=4,
                                text_embed_dim=8, time_embed_dim=8, max_sequence_length=5)
    inputs = dict(hidden_states=torch.randn(2, 4, 2, 4, 4), encoder_hidden_states=torch.randn(2, 5, 8),
                  timestep=torch.tensor([10, 500]), encoder_attention_mask=torch.ones(2, 5))
    return m, inputs


BUILDERS = {"flux": flux, "chroma": chroma, "flux2": flux2, "wan": wan,
            "hunyuan_video": hunyuan_video, "qwenimage": qwenimage, "ltx": ltx,
            "cogvideox": cogvideox, "lumina2": lumina2, "cogview4": cogview4, "mochi": mochi}


def build(family, dtype=torch.float32):
    """(model in eval mode, its forward inputs), random weights, in `dtype`."""
    model, inputs = BUILDERS[family]()
    model = model.to(dtype).eval()
    inputs = {k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point()
              and k not in ("img_ids", "txt_ids", "image_rotary_emb") else v
              for k, v in inputs.items()}
    return model, dict(inputs, return_dict=False)
