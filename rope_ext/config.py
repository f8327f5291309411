"""Reading RoPE settings from model configs: a config.json as a dict, or a transformers-style
config object. docs/models.md lists what is understood; the rules below follow what transformers
4.57 and 5 build from the same file, and anything else is an error, never a silent default.

The layout (which dims form a pair) is not stored in most configs; it is a property of the model
code. What we assume, in order of precedence:
1. the `interleaved` argument, when given;
2. a boolean config key `rope_interleave` (DeepSeek-V3), `rope_interleaved` or
   `rotary_interleaved`;
3. the model_type: the types in INTERLEAVED_MODEL_TYPES rotate pairs (x[2i], x[2i+1]);
4. otherwise half-split (rotate_half; Llama, Mistral, Qwen, Qwen2/3-VL, Gemma, Phi, GPT-NeoX,
   Falcon and most checkpoints).
"""

import copy
import json
import math
import os
from collections.abc import Mapping

from ._args import check_flag
from .scaling import rotated_dims, scaling_type

INTERLEAVED_MODEL_TYPES = frozenset({
    "gptj", "codegen", "chatglm", "glm", "glm4", "cohere", "cohere2", "cohere2_moe",
    "deepseek_v2", "deepseek_v3", "deepseek_v32", "deepseek_v4", "kimi_k2", "llama4",
    "llama4_text", "ernie4_5", "ernie4_5_moe", "ernie4_5_vl_moe", "ernie4_5_vl_moe_text",
    "helium", "longcat_flash", "moonshine", "moonshine_streaming", "moonshine_streaming_encoder",
    "glm_moe_dsa", "glm_ocr", "glm_ocr_text", "glm4v", "glm4v_text", "glm46v",
    "openai_privacy_filter", "mistral_large4", "mistral_large4_text",
    "bailing_hybrid", "axk2", "blt", "blt_global_transformer", "blt_local_encoder",
    "blt_local_decoder", "blt_patcher", "dots3_note", "dots3_note_text",
})
_LAYOUT_KEYS = ("rope_interleave", "rope_interleaved", "rotary_interleaved")
# Configs with a `rotary_dim` that their transformers model code does not read (MiniMax-M3-VL's
# text model rotates partial_rotary_factor * head_dim dims: the whole head by default).
_ROTARY_DIM_UNREAD = frozenset({"minimax_m3_vl", "minimax_m3_vl_text"})

# The class defaults of transformers' config classes for the keys that decide the table (data:
# model_defaults.json beside this file).
with open(os.path.join(os.path.dirname(__file__), "model_defaults.json")) as _f:
    MODEL_DEFAULTS = json.load(_f)["defaults"]

# A multimodal config's text model type, for a text_config that does not name its own.
_TEXT_MODEL_TYPES = {
    "gemma3": "gemma3_text", "gemma3n": "gemma3n_text", "qwen2_vl": "qwen2_vl_text",
    "qwen2_5_vl": "qwen2_5_vl_text", "qwen3_vl": "qwen3_vl_text", "qwen3_vl_moe": "qwen3_vl_moe_text",
    "llava": "llama", "mistral3": "mistral", "llama4": "llama4_text", "paligemma": "gemma",
    "gemma4": "gemma4_text", "qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text",
    "qwen4_exp": "qwen4_exp_text", "cosmos3_edge": "cosmos3_edge_text",
    "qwen3_omni_moe_thinker": "qwen3_omni_moe_text",
}
_SUB_CONFIGS = ("text_config", "vision_config", "audio_config")
# Other spellings of the standard keys (transformers' attribute_map: a config object's class
# map is read too, a config.json dict has only this).
_GPT2_NAMES = {"hidden_size": "n_embd", "num_attention_heads": "n_head",
               "max_position_embeddings": "n_positions"}
_KEY_ALIASES = {
    "gptj": _GPT2_NAMES, "codegen": _GPT2_NAMES,
    "dbrx": {"hidden_size": "d_model", "num_attention_heads": "n_heads",
             "max_position_embeddings": "max_seq_len"},
    "jetmoe": {"head_dim": "kv_channels"},
    "zamba": {"head_dim": "attention_head_dim"}, "zamba2": {"head_dim": "attention_head_dim"},
    "bailing_hybrid": {"max_position_embeddings": "model_max_length"},
    "chatglm": {"head_dim": "kv_channels", "max_position_embeddings": "seq_length"},
    "kimi_linear": {"max_position_embeddings": "model_max_length"},
}
_ALIASED_KEYS = ("hidden_size", "num_attention_heads", "max_position_embeddings", "head_dim")
# Keys a model type's file keeps in a sub-dict: DBRX's rope_theta in attn_config (which
# transformers 4's DBRX attention reads, and the checkpoints were trained with; transformers
# 5.23's rotary module reads the top level's default instead).
_NESTED_KEYS = {"dbrx": {"rope_theta": "attn_config"}}
# MRoPE as model code lays it out whatever its config says: model type -> (the sections it takes
# where the config gives none, whether it interleaves them, T, H, W, T, ..., or lays them one
# after another, ignoring mrope_interleaved). The text rotary classes of transformers 5.23 (and
# 4.57's Qwen2/2.5/3-VL).
_MROPE_BY_TYPE = {
    **dict.fromkeys(("qwen2_vl", "qwen2_vl_text", "qwen2_5_vl", "qwen2_5_vl_text"),
                    ([16, 24, 24], False)),
    **dict.fromkeys(("qwen3_vl", "qwen3_vl_text", "qwen3_vl_moe", "qwen3_vl_moe_text",
                     "qwen3_omni_moe_thinker", "qwen3_omni_moe_text", "qwen3_omni_moe_talker_text",
                     "cosmos3_edge", "cosmos3_edge_text"), ([24, 20, 20], True)),
    **dict.fromkeys(("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen4_exp",
                     "qwen4_exp_text"), ([11, 11, 10], True)),
}
# Layer types of configs that give sliding-window layers their own base (Gemma 3, transformers 4).
_LOCAL_LAYER_TYPES = ("full_attention", "sliding_attention")
# Scalings whose config may keep max_position_embeddings at the trained length while the model
# is meant to read original * factor positions (serving engines size their tables so): the
# default table length covers that. llama3 and longrope configs state the extended length.
_EXTENDING = ("dynamic", "yarn", "deepseek_yarn")
# DeepSeek-V4 keys its RoPE by these labels (plain RoPE for the sliding-window attention,
# compress_rope_theta and the file's YaRN for the compressed branches), and rotates the last
# rotary_dim dims of each head (rope_dim_offset = head_dim - rotary_dim).
_DEEPSEEK_V4_LABELS = ("main", "compress")
_GEMMA4_TYPES = frozenset({"gemma4", "gemma4_text"})
# Keys of a RoPE dict that do not shape the table, which transformers skips when it checks the
# dict: Ministral 3's and Mistral 4's query scaling by position (applied by their attention, after
# RoPE) and their copy of max_position_embeddings (the top-level one is read).
_NOT_THE_TABLE = ("llama_4_scaling_beta", "max_position_embeddings")
# Configs of models without RoPE, refused rather than given a table: BERT's
# position_embedding_type (ESM's and XLM-RoBERTa's "rotary" is RoPE), and model types whose
# positions are something else where the file says nothing (BERT and RoBERTa default to
# absolute ones).
_NOT_ROPE_POSITIONS = ("absolute", "relative_key", "relative_key_query")
_NOT_ROPE_TYPES = {"bert": "absolute", "roberta": "absolute", "gpt2": "absolute",
                   "opt": "absolute", "bart": "absolute", "t5": "relative (bucketed)",
                   "bloom": "ALiBi", "mpt": "ALiBi"}


def _fail(msg):
    raise ValueError(f"RotaryEmbedding.from_config: {msg}")


def _as_dict(config, what="config"):
    if isinstance(config, Mapping):
        return dict(config)
    to_dict = getattr(config, "to_dict", None)
    if callable(to_dict):
        return dict(to_dict())
    if hasattr(config, "__dict__"):
        return dict(vars(config))
    _fail(f"{what} must be a dict or a config object, got {type(config).__name__}")


def _set(d):
    """The keys a config sets: null means unset, as transformers reads it."""
    return {k: v for k, v in d.items() if v is not None}


class _Config:
    """A config's own keys (`own`, with a sub-config's keys over the top level's) and the
    defaults of its model type beneath them."""

    def __init__(self, config):
        top = _set(_as_dict(config))
        text = top.get("text_config")
        if text is not None:
            text = _set(_as_dict(text, "text_config"))
            model_type = text.get("model_type") or _TEXT_MODEL_TYPES.get(top.get("model_type"))
            outer = {k: v for k, v in top.items() if k not in _SUB_CONFIGS and k != "model_type"}
            # The text model reads its sub-config and its class defaults; the top level only
            # fills what neither has (files that keep both, such as some Qwen2.5-VL ones).
            self.own = dict(text)
            self.fallback = outer
        else:
            model_type = top.get("model_type")
            self.own, self.fallback = top, {}
        self.model_type = str(model_type).lower() if model_type is not None else ""
        aliases = dict(_KEY_ALIASES.get(self.model_type, {}))
        for obj in (config, getattr(config, "text_config", None)):
            mapped = getattr(type(obj), "attribute_map", None)
            if obj is not None and not isinstance(obj, Mapping) and isinstance(mapped, Mapping):
                aliases.update({k: v for k, v in mapped.items() if k in _ALIASED_KEYS})
        for std, alt in aliases.items():
            for d in (self.own, self.fallback):
                if std not in d and alt in d:
                    d[std] = d[alt]
        if self.model_type == "chatglm":
            # ChatGLM2/3's and GLM-4's own model code (trust_remote_code; no transformers class):
            # RoPE on the first half of each head, base 10000. Their rope_ratio means two things:
            # the base's multiplier in ChatGLM3's and GLM-4's code, the positions' divisor in
            # ChatGLM2-32K's; the file does not say which code it goes with.
            self.own.setdefault("partial_rotary_factor", 0.5)
            ratio = self.own.get("rope_ratio", 1)
            if ratio != 1:
                _fail(f"a chatglm config with rope_ratio {ratio!r}: ChatGLM3's and GLM-4's code "
                      "multiply the base by it, ChatGLM2-32K's divides the positions by it, and "
                      "the file does not say which; build RotaryEmbedding(head_dim=..., "
                      "rotary_dim=head_dim // 2, interleaved=True) with base=10000 * rope_ratio "
                      "(ChatGLM3, GLM-4) or scaling={'rope_type': 'linear', 'factor': "
                      "rope_ratio} (ChatGLM2-32K)")
        for key, holder in _NESTED_KEYS.get(self.model_type, {}).items():
            nested = _set(_as_dict(self.own.get(holder) or {}, holder))
            if key not in self.own and key in nested:
                self.own[key] = nested[key]
        self.defaults = MODEL_DEFAULTS.get(self.model_type, {})

    def file(self, key):
        """The value the file itself sets (sub-config or top level), or None."""
        value = self.own.get(key)
        return self.fallback.get(key) if value is None else value

    def get(self, key, default=None):
        for d in (self.own, self.defaults, self.fallback):
            if d.get(key) is not None:
                return d[key]
        return default


def layout_from_config(config, interleaved=None):
    """True for interleaved pairs, False for half-split (see the module docstring)."""
    if interleaved is not None:
        return check_flag(interleaved, "RotaryEmbedding.from_config: interleaved")
    cfg = config if isinstance(config, _Config) else _Config(config)
    for key in _LAYOUT_KEYS:
        value = cfg.file(key)
        if value is not None:
            if not isinstance(value, bool):
                _fail(f"{key} must be true or false, got {value!r}")
            return value
    return cfg.model_type in INTERLEAVED_MODEL_TYPES


def _deepseek_v4_rope(cfg, src):
    """DeepSeek-V4's RoPE keyed by label, as transformers 5 builds it from a file that gives one
    flat dict (the YaRN of the compressed branches) or none."""
    if all(isinstance(src.get(k), Mapping) for k in _DEEPSEEK_V4_LABELS):
        return {k: dict(src[k]) for k in _DEEPSEEK_V4_LABELS}
    flat = {k: v for k, v in src.items() if k not in _DEEPSEEK_V4_LABELS}
    if "rope_type" not in flat:
        flat["rope_type"] = flat.get("type", "default")
    compress = dict(flat, rope_theta=cfg.get("compress_rope_theta"))
    if compress["rope_type"] == "yarn":
        compress.setdefault("attention_factor", 1.0)  # V4 does not scale cos/sin by YaRN's mscale
    return {"main": {"rope_type": "default", "rope_theta": cfg.get("rope_theta")},
            "compress": compress}


def _check_local_layer_type(layer_type, what):
    """layer_type given, and full or sliding, for a config that gives `what`."""
    if layer_type is None:
        _fail(f"the config gives {what}; pass layer_type= one of {', '.join(_LOCAL_LAYER_TYPES)}")
    if layer_type not in _LOCAL_LAYER_TYPES:
        _fail(f"layer_type {layer_type!r} is not one of {', '.join(_LOCAL_LAYER_TYPES)}")


def _rope_dict(cfg, layer_type):
    """(params, form): a fresh copy of the RoPE settings that serve `layer_type`, and how the
    config spells them: "legacy" (rope_scaling, transformers 4), "v5" (rope_parameters),
    "v5_layer" (rope_parameters per layer type) or "local" (Gemma 3's rope_local_base_freq)."""
    scaling, params = cfg.file("rope_scaling"), cfg.file("rope_parameters")
    if scaling is not None and params is not None and scaling != params:
        _fail("the config has both rope_scaling and rope_parameters, and they differ; keep one")
    src, form = (scaling, "legacy") if scaling is not None else (params, "v5")
    if src is None and isinstance(cfg.defaults.get("rope_parameters"), Mapping):
        src = copy.deepcopy(cfg.defaults["rope_parameters"])  # a sparse transformers 5 file
    if src is not None and not isinstance(src, Mapping):
        _fail(f"{'rope_scaling' if form == 'legacy' else 'rope_parameters'} must be a dict, got "
              f"{type(src).__name__}")
    src = dict(src or {})
    if cfg.model_type == "deepseek_v4":
        src = _deepseek_v4_rope(cfg, src)
    declared = cfg.get("layer_types")
    per_layer = [v for v in src.values() if v is not None]
    if per_layer and all(isinstance(v, Mapping) for v in per_layer):  # {"full_attention": {...}, ...}
        names = sorted(k for k, v in src.items() if v is not None)
        if layer_type is None:
            _fail(f"the config sets RoPE per layer type ({', '.join(names)}); pass layer_type= one of them")
        if src.get(layer_type) is None:
            _fail(f"layer_type {layer_type!r} has no RoPE parameters in this config (it has: {', '.join(names)})")
        entry = dict(src[layer_type])
        if (layer_type == "sliding_attention" and entry.get("rope_theta") is None
                and cfg.get("rope_local_base_freq") is not None):
            # (Gemma 3: transformers 5 fills a sliding entry's missing base with the local one,
            # the file's or its class default, not with the top level's rope_theta)
            entry["rope_theta"] = cfg.get("rope_local_base_freq")
        return entry, "v5_layer"
    bases = {"full_attention": cfg.get("global_rope_theta"),
             "sliding_attention": cfg.get("local_rope_theta")}
    if any(v is not None for v in bases.values()):  # ModernBERT in transformers 4, and its files
        _check_local_layer_type(layer_type, "global and local attention layers their own bases "
                                            "(global_rope_theta, local_rope_theta)")
        theta = bases[layer_type] if bases[layer_type] is not None else bases["full_attention"]
        # (a rope_scaling serves both kinds of layer, each at its base: transformers 4 builds
        # each attention's rotary module from the config, 5 merges it into both layer types')
        return dict(src, rope_theta=theta), "local"
    if cfg.get("rope_local_base_freq") is not None:  # Gemma 3 in transformers 4
        _check_local_layer_type(layer_type, "sliding-window layers their own base "
                                            "(rope_local_base_freq)")
        if layer_type == "sliding_attention":  # default RoPE at the local base, no scaling
            return {"rope_type": "default", "rope_theta": cfg.get("rope_local_base_freq")}, "local"
        return src, form
    if layer_type is not None and declared is not None and layer_type not in set(declared):
        names = ", ".join(sorted(set(declared)))
        _fail(f"layer_type {layer_type!r} is not among the config's layer_types ({names})")
    return src, form


def _positive(value, name, integer=False):
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < math.inf
    if ok and integer:
        ok = float(value) == int(value)
    if not ok:
        _fail(f"{name} must be a positive {'integer' if integer else 'number'}, got {value!r}")
    return int(value) if integer else float(value)


def _layer_head_dim(cfg, layer_type):
    """The head dim of `layer_type`'s layers where the config gives them their own (Gemma 4's
    global layers: per_layer_config overrides by layer index, or global_head_dim in a file)."""
    if layer_type is None:
        return None
    overrides = cfg.file("per_layer_config")
    types = cfg.get("layer_types") or []
    if isinstance(overrides, Mapping):
        for key, over in overrides.items():
            index = int(key) if str(key).isdigit() else None
            match = key == layer_type or (index is not None and index < len(types)
                                          and types[index] == layer_type)
            if match and isinstance(over, Mapping) and over.get("head_dim") is not None:
                return over["head_dim"]
        return None
    if cfg.model_type in _GEMMA4_TYPES and layer_type == "full_attention":
        return cfg.get("global_head_dim")
    return None


def _dims(cfg, params, layer_type=None):
    """(head_dim, rotary_dim)."""
    qk_rope = cfg.get("qk_rope_head_dim")  # MLA (DeepSeek): only this part of a head rotates
    layer_dim = _layer_head_dim(cfg, layer_type)
    if layer_dim is not None:
        head_dim = _positive(layer_dim, f"the head_dim of {layer_type} layers", integer=True)
    elif cfg.model_type == "deepseek_v4":  # V4: the rope part is the tail of a full head
        head_dim = _positive(cfg.get("head_dim"), "head_dim", integer=True)
        if cfg.file("partial_rotary_factor") is None and params.get("partial_rotary_factor") is None \
                and qk_rope is not None:
            return head_dim, _positive(qk_rope, "qk_rope_head_dim", integer=True)
    elif qk_rope is not None:
        head_dim = _positive(qk_rope, "qk_rope_head_dim", integer=True)
    elif cfg.get("head_dim") is not None:
        head_dim = _positive(cfg.get("head_dim"), "head_dim", integer=True)
    else:
        hidden, heads = cfg.get("hidden_size"), cfg.get("num_attention_heads")
        if hidden is None or heads is None:
            _fail("the config needs head_dim, or hidden_size and num_attention_heads")
        hidden = _positive(hidden, "hidden_size", integer=True)
        heads = _positive(heads, "num_attention_heads", integer=True)
        if hidden % heads:
            _fail(f"hidden_size ({hidden}) is not a multiple of num_attention_heads ({heads})")
        head_dim = hidden // heads
    if _is_proportional(params):  # the table spans the head; the factor goes to the scaling
        partial = next((v for v in (cfg.file("partial_rotary_factor"),
                                    params.get("partial_rotary_factor")) if v is not None), None)
        if partial is not None:
            params["partial_rotary_factor"] = _positive(partial, "partial_rotary_factor")
        return head_dim, head_dim
    # The top level and rope_parameters say the same where both say it (transformers 5 copies
    # the top level's in, keeping a dict's own; its attention classes read the top level's:
    # differing factors are refused); GPT-NeoX says rotary_pct.
    top, inside = cfg.file("partial_rotary_factor"), params.get("partial_rotary_factor")
    if top is not None and inside is not None and \
            _positive(top, "partial_rotary_factor") != _positive(inside, "partial_rotary_factor"):
        _fail(f"partial_rotary_factor is {top} but rope_parameters holds partial_rotary_factor "
              f"{inside}; keep one")
    key, partial = next(((k, v) for k, v in (
        ("partial_rotary_factor", cfg.file("partial_rotary_factor")),
        ("partial_rotary_factor", params.get("partial_rotary_factor")),
        ("rotary_pct", cfg.file("rotary_pct")),
        ("partial_rotary_factor", cfg.defaults.get("partial_rotary_factor")),
        ("rotary_pct", cfg.defaults.get("rotary_pct"))) if v is not None), (None, None))
    if partial is not None:
        partial = _positive(partial, key)  # named as the config spells it
        if partial > 1:
            _fail(f"{key} must be in (0, 1], got {partial}")
        full = cfg.get("head_dim")
        if qk_rope is not None and layer_dim is None and full is not None and full != head_dim:
            # MLA (Mistral 4): the factor is of the whole head, and names its rotated part
            rotated = int(_positive(full, "head_dim", integer=True) * partial)
            if rotated != head_dim:
                _fail(f"partial_rotary_factor {partial} of head_dim {full} rotates {rotated} dims, "
                      f"but qk_rope_head_dim is {head_dim}")
            return head_dim, head_dim
        return head_dim, int(head_dim * partial)
    if cfg.get("rotary_dim") is not None and cfg.model_type not in _ROTARY_DIM_UNREAD:
        # GPT-J, CodeGen: a count of dims
        return head_dim, _positive(cfg.get("rotary_dim"), "rotary_dim", integer=True)
    return head_dim, head_dim


def _is_proportional(params):
    return "proportional" in (params.get("rope_type"), params.get("type"))


def _theta(cfg, params, form):
    inside = params.pop("rope_theta", None)
    if form in ("v5", "v5_layer", "local"):  # rope_parameters carry the base
        theta = inside if inside is not None else cfg.file("rope_theta")
    else:
        top = cfg.file("rope_theta")
        if inside is not None and top is not None and \
                _positive(inside, "rope_scaling.rope_theta") != _positive(top, "rope_theta"):
            _fail(f"rope_theta is {top} but rope_scaling holds rope_theta {inside}; keep one")
        theta = top if top is not None else inside
    if theta is None:
        theta = cfg.file("rotary_emb_base")  # GPT-NeoX
    if theta is None:
        theta = cfg.defaults.get("rope_theta", cfg.defaults.get("rotary_emb_base", 10000.0))
    return _positive(theta, "rope_theta")


def _need_max_pos(max_pos, kind):
    if max_pos is None:
        _fail(f"rope type {kind!r} needs the config's max_position_embeddings")
    return max_pos


def _resolve(kind, params, cfg, form, max_pos):
    """The scaling dict with the lengths and factors transformers derives from the rest of the
    config (which one it takes differs between its generations; see docs/models.md)."""
    key = "original_max_position_embeddings"
    top = cfg.get(key)  # Phi-3 keeps the trained length at the top level
    if top is not None:
        top = _positive(top, key, integer=True)
    own = params.get(key)
    if own is not None and kind != "dynamic":
        own = _positive(own, f"{kind} {key}", integer=True)

    if kind == "dynamic":
        # transformers grows the base past max_position_embeddings, whatever the dict says.
        original = _need_max_pos(max_pos, kind)
    elif kind in ("yarn", "deepseek_yarn"):
        # transformers 4 reads only the dict; 5 copies a top-level length over it.
        original = top if form == "v5" and top is not None else own
    elif kind == "llama3":
        original = top if form == "v5" and top is not None else own
        if original is None and form == "legacy":
            original = top
    elif kind == "longrope":
        if form == "legacy":  # transformers 4 reads the top level only, not the dict's length
            original = top
            if top is not None:  # and takes the ratio, not the dict's factor
                params["factor"] = _need_max_pos(max_pos, kind) / top
        else:
            original = top if form == "v5" and top is not None else own
    else:
        return params
    params[key] = original if original is not None else _need_max_pos(max_pos, kind)
    if kind in ("yarn", "deepseek_yarn", "longrope") and params.get("factor") is None:
        params["factor"] = _need_max_pos(max_pos, kind) / params[key]
    return params


def _per_layer_settings(cfg, base, kind):
    """The base, after the keys that set RoPE per layer index (not per layer type): one table
    serves where they agree across the layers; elsewhere an error naming the key."""
    thetas = cfg.file("layer_rope_theta")  # GraniteMoE-SWA: a base per layer
    if thetas is not None:
        if not isinstance(thetas, (list, tuple)) or not thetas:
            _fail(f"layer_rope_theta must be a list of bases, one per layer, got {thetas!r}")
        if not all(isinstance(t, (int, float)) and not isinstance(t, bool) for t in thetas):
            _fail(f"layer_rope_theta must be a list of bases (numbers), got {thetas!r}")
        if any(t != thetas[0] for t in thetas):  # (Muse Spark's 0: a layer without RoPE)
            _fail("layer_rope_theta gives the layers different bases; from_config builds one "
                  "table: build RotaryEmbedding(..., base=layer_rope_theta[i]) for layer i")
        base = _positive(thetas[0], "layer_rope_theta")
    scaled = cfg.file("rope_scaling_layers")  # Molmo2: the scaling only in the listed layers
    if scaled is None or kind == "default":
        return base
    if not (isinstance(scaled, (list, tuple)) and all(isinstance(i, int) for i in scaled)):
        _fail(f"rope_scaling_layers must be a list of layer indices, got {scaled!r}")
    layers = cfg.get("num_hidden_layers")
    layers = _positive(layers, "num_hidden_layers", integer=True) if layers else 0
    if sorted(scaled) != list(range(layers)):
        _fail(f"rope_scaling_layers applies the {kind} scaling to layers {list(scaled)} only; "
              "from_config builds one table (the scaled one for those layers: drop the key, "
              "or build the others without the scaling)")
    return base


def rope_kwargs_from_config(config, *, layer_type=None, interleaved=None, max_position=None):
    """Keyword arguments for RotaryEmbedding from a config (see docs/models.md)."""
    if layer_type is not None and not isinstance(layer_type, str):
        _fail(f"layer_type must be a string such as 'full_attention', got {layer_type!r}")
    cfg = _Config(config)
    if cfg.file("alibi") is True:
        _fail("the config uses ALiBi position biases, not RoPE")
    kind = cfg.file("position_embedding_type")
    if kind in _NOT_ROPE_POSITIONS or (kind is None and cfg.model_type in _NOT_ROPE_TYPES):
        _fail(f"the config's model ({cfg.model_type or 'no model_type'}) uses "
              f"{kind or _NOT_ROPE_TYPES[cfg.model_type]} position embeddings, not RoPE")
    params, form = _rope_dict(cfg, layer_type)
    for key in _NOT_THE_TABLE:
        params.pop(key, None)
    if "rope_type" not in params and "type" not in params:
        params["rope_type"] = "default"  # transformers 5: rope_parameters without a type
    for k in ("rope_type", "type"):  # Phi-3's config maps its older names onto longrope
        if cfg.model_type == "phi3" and params.get(k) in ("su", "yarn"):
            params[k] = "longrope"
    base = _theta(cfg, params, form)
    head_dim, rotary_dim = _dims(cfg, params, layer_type)
    if not _is_proportional(params):
        params.pop("partial_rotary_factor", None)
    try:
        kind = scaling_type(params)
    except ValueError as e:
        _fail(str(e).removeprefix("cos_sin_cache: "))

    base = _per_layer_settings(cfg, base, kind)

    max_pos = cfg.get("max_position_embeddings")
    if max_pos is not None:
        max_pos = _positive(max_pos, "max_position_embeddings", integer=True)
    params = _resolve(kind, params, cfg, form, max_pos)

    section = params.get("mrope_section")
    mrope_interleaved = params.get("mrope_interleaved")
    if mrope_interleaved is not None and not isinstance(mrope_interleaved, bool):
        _fail(f"mrope_interleaved must be true or false, got {mrope_interleaved!r}")
    if cfg.model_type in _MROPE_BY_TYPE:
        default_section, interleaved_by_code = _MROPE_BY_TYPE[cfg.model_type]
        if mrope_interleaved is not None and mrope_interleaved != interleaved_by_code:
            laid = "interleaved" if interleaved_by_code else "one section after another"
            _fail(f"{cfg.model_type} lays MRoPE out {laid}; the config says "
                  f"mrope_interleaved={str(mrope_interleaved).lower()}")
        mrope_interleaved = interleaved_by_code
        # The code's own sections where the config gives none and they fill the rotated dims
        # (otherwise its text positions are plain RoPE, as rope_ext builds them).
        if section is None and sum(default_section) == rotated_dims(rotary_dim) // 2:
            section = list(default_section)

    if max_position is None:
        if max_pos is None:
            _fail("the config has no max_position_embeddings; pass max_position=")
        max_position = max_pos
        original, factor = params.get("original_max_position_embeddings"), params.get("factor")
        if kind in _EXTENDING and all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0
                                      for v in (original, factor)):
            max_position = max(max_pos, int(original * factor))

    scaling = None
    if kind != "default":
        scaling = {k: v for k, v in params.items() if k not in ("type", "mrope_section", "mrope_interleaved")}
        scaling["rope_type"] = kind
    return dict(
        head_dim=head_dim,
        rotary_dim=rotary_dim,
        max_position=max_position,
        base=base,
        interleaved=layout_from_config(cfg, interleaved),
        scaling=scaling,
        mrope_section=section,
        mrope_interleaved=bool(mrope_interleaved) and section is not None,  # no section: plain RoPE
        rope_dim_offset=head_dim - rotary_dim if cfg.model_type == "deepseek_v4" else 0,
    )
