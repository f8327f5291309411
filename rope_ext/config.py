"""Reading RoPE settings from model configs (transformers-style config objects or plain dicts).

The layout (which dims form a pair) is not stored in most configs; it is a property of the model
code. What we assume, in order of precedence:
1. the `interleaved` argument, when given;
2. a boolean config key `rope_interleave` (DeepSeek-V3), `rope_interleaved` or
   `rotary_interleaved`;
3. the model_type: GPT-J, CodeGen, ChatGLM/GLM and Cohere rotate interleaved pairs
   (x[2i], x[2i+1]);
4. otherwise half-split (rotate_half; Llama, Mistral, Qwen, Qwen2-VL, Gemma, Phi, GPT-NeoX,
   Falcon and most checkpoints).
"""

INTERLEAVED_MODEL_TYPES = frozenset({"gptj", "codegen", "chatglm", "glm", "glm4", "cohere", "cohere2"})
_LAYOUT_KEYS = ("rope_interleave", "rope_interleaved", "rotary_interleaved")
# Scalings whose formulas need the pretrained context length; configs often leave it out of the
# dict and mean max_position_embeddings (or, for Phi-3, the top-level original length).
_NEEDS_ORIGINAL = ("dynamic", "yarn", "longrope", "su")


def _get(config, key, default=None):
    if isinstance(config, dict):
        value = config.get(key, default)
    else:
        value = getattr(config, key, default)
    return default if value is None else value


def layout_from_config(config, interleaved=None):
    """True for interleaved pairs, False for half-split (see the module docstring)."""
    if interleaved is not None:
        return bool(interleaved)
    for key in _LAYOUT_KEYS:
        value = _get(config, key)
        if value is not None:
            return bool(value)
    return str(_get(config, "model_type", "")).lower() in INTERLEAVED_MODEL_TYPES


def _fail(msg):
    raise ValueError(f"RotaryEmbedding.from_config: {msg}")


def rope_kwargs_from_config(config, *, interleaved=None, max_position=None):
    """Keyword arguments for RotaryEmbedding from a config."""
    # transformers >= 5 keeps theta and the scaling together in `rope_parameters`.
    params = _get(config, "rope_parameters")
    params = dict(params) if isinstance(params, dict) else None
    scaling = _get(config, "rope_scaling", params)
    scaling = dict(scaling) if scaling is not None else None
    base = _get(config, "rope_theta", (params or {}).get("rope_theta", 10000.0))

    head_dim = _get(config, "head_dim")
    if head_dim is None:
        hidden, heads = _get(config, "hidden_size"), _get(config, "num_attention_heads")
        if hidden is None or heads is None:
            _fail("the config needs head_dim, or hidden_size and num_attention_heads")
        if hidden % heads:
            _fail(f"hidden_size ({hidden}) is not a multiple of num_attention_heads ({heads})")
        head_dim = hidden // heads
    head_dim = int(head_dim)
    partial = _get(config, "partial_rotary_factor", (params or {}).get("partial_rotary_factor"))
    if partial is not None:
        rotary_dim = int(head_dim * partial)
    elif _get(config, "rotary_dim") is not None:  # GPT-J, CodeGen
        rotary_dim = int(_get(config, "rotary_dim"))
    elif _get(config, "rotary_pct") is not None:  # GPT-NeoX
        rotary_dim = int(head_dim * _get(config, "rotary_pct"))
    else:
        rotary_dim = head_dim

    max_pos = _get(config, "max_position_embeddings")
    if max_position is None:
        if max_pos is None:
            _fail("the config has no max_position_embeddings; pass max_position=")
        max_position = int(max_pos)

    mrope_section = None
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type"))
        explicit_original = scaling.get("original_max_position_embeddings") is not None
        if kind in _NEEDS_ORIGINAL and not explicit_original:
            original = _get(config, "original_max_position_embeddings", max_pos)
            if original is not None:
                scaling["original_max_position_embeddings"] = original
        # Without `factor`, the extension ratio is the config's (Phi-3 longrope, DeepSeek-V3 yarn),
        # whatever length the table gets.
        derive_factor = kind in ("longrope", "su") or (kind == "yarn" and explicit_original)
        if derive_factor and scaling.get("factor") is None and max_pos is not None:
            scaling["factor"] = max_pos / scaling["original_max_position_embeddings"]
        mrope_section = scaling.get("mrope_section")
        if kind in (None, "default") and mrope_section is None and "factor" not in scaling:
            scaling = None  # e.g. rope_parameters holding only rope_theta
    return dict(
        head_dim=head_dim,
        rotary_dim=rotary_dim,
        max_position=max_position,
        base=float(base),
        interleaved=layout_from_config(config, interleaved),
        scaling=scaling,
        mrope_section=mrope_section,
    )
