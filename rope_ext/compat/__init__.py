"""Drop-in replacements for other libraries' RoPE entry points, on rope_ext's ops. Each keeps its
peer's name, signature, defaults, layouts, and what it rotates in place and returns; none imports
its peer. docs/migrating.md has the one-line change per library.

    rope_ext.compat.transformers   apply_rotary_pos_emb, apply_multimodal_rotary_pos_emb, ...
    rope_ext.compat.flash_attn     apply_rotary_emb, apply_rotary_emb_qkv_, apply_rotary_emb_kv_
    rope_ext.compat.vllm           rotary_embedding
    rope_ext.compat.flashinfer     apply_rope[_pos_ids][_inplace], apply_llama31_rope*,
                                   apply_rope_with_cos_sin_cache[_inplace],
                                   rope_quantize_fp8, mla_rope_quantize_fp8,
                                   rope_quantize_fp8_append_paged_kv_cache
    rope_ext.compat.sglang         apply_rope_with_cos_sin_cache_inplace, FusedSetKVBufferArg
    rope_ext.compat.diffusers      apply_rotary_emb, apply_rotary_emb_qwen, ..._ltx, ..._wan, ..._mochi
    rope_ext.compat.transformer_engine  apply_rotary_pos_emb, RotaryPositionEmbedding
    rope_ext.compat.llama          apply_rotary_emb, precompute_freqs_cis (Meta's reference)
    rope_ext.compat.gpt_fast       apply_rotary_emb, precompute_freqs_cis
"""

from . import diffusers, flash_attn, flashinfer, gpt_fast, llama, sglang, transformer_engine, transformers, vllm

__all__ = ["diffusers", "flash_attn", "flashinfer", "gpt_fast", "llama", "sglang", "transformer_engine",
           "transformers", "vllm"]
