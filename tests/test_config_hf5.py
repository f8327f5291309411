"""RotaryEmbedding.from_config on the RoPE of transformers 5.23's newer configs, against what
transformers 5.23 itself builds: every rope_type of its ROPE_INIT_FUNCTIONS (Gemma 4's
`proportional` among them), Gemma 4's per-layer-type RoPE (sliding layers, and global layers
with their own head dim), and DeepSeek-V4 (RoPE on the last rotary_dim dims of each head, keyed
`main` / `compress`).

Needs transformers >= 5.23 (skipped under older versions; the project's second test
environment has it). Tolerances as in test_config.py: transformers computes inv_freq, the angle
and cos/sin in float32, rope_ext in float64 rounded once, so cos/sin differ by at most
a * (|theta| * 2^-19 + 2^-21) (a: the attention factor); the rotations are then compared on the
same float32 cos/sin.
"""

import copy

import pytest
import torch

import rope_ext
from rope_ext.config import rope_kwargs_from_config

transformers = pytest.importorskip("transformers")
from packaging.version import Version  # noqa: E402

if Version(transformers.__version__) < Version("5.23"):
    pytest.skip(f"needs transformers >= 5.23, found {transformers.__version__}", allow_module_level=True)
transformers.logging.set_verbosity_error()

from transformers import DeepseekV4Config, Gemma4TextConfig, LlamaConfig  # noqa: E402
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf_dsv4  # noqa: E402
from transformers.models.gemma4 import modeling_gemma4 as hf_gemma4  # noqa: E402
from transformers.models.llama import modeling_llama as hf_llama  # noqa: E402

POSITIONS = torch.tensor([0, 1, 2, 7, 100, 511, 1000, 2047])


def close_tables(ours, theirs, positions, inv_freq, attention=1.0):
    """cos/sin of rope_ext (float32) against transformers' (float32), bound per element."""
    theta = positions.double()[:, None] * inv_freq.double()
    bound = 2 * attention * (theta.abs() * 2.0**-19 + 2.0**-21)
    err = (ours.double() - theirs.double()).abs()
    assert (err <= bound).all(), float((err / bound).max())


def hf_half(cos):
    """transformers' full-width cos (the half repeated, cat or interleave) -> one per pair."""
    return cos[..., : cos.shape[-1] // 2]


# ---- every rope_type transformers 5.23 defines, on a Llama config ----------------------------

LLAMA = dict(hidden_size=256, num_attention_heads=4, head_dim=64, max_position_embeddings=2048,
             num_hidden_layers=1, num_key_value_heads=2, intermediate_size=64, vocab_size=32)
RANKS = 32  # rotary_dim / 2 for head_dim 64
ROPE_PARAMETERS = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
    "yarn": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 256,
             "rope_theta": 500000.0},
    "longrope": {"rope_type": "longrope", "original_max_position_embeddings": 1024,
                 "short_factor": [1.0 + 0.01 * i for i in range(RANKS)],
                 "long_factor": [1.0 + 0.5 * i for i in range(RANKS)], "rope_theta": 10000.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 256, "rope_theta": 500000.0},
    # Llama 4 Scout's: equal factors, a step between the scaled and the unscaled frequencies
    "llama3_step": {"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0,
                    "high_freq_factor": 1.0, "original_max_position_embeddings": 256,
                    "rope_theta": 500000.0},
    "proportional": {"rope_type": "proportional", "partial_rotary_factor": 0.5, "factor": 2.0,
                     "rope_theta": 10000.0},
}


def test_every_rope_type_of_transformers_is_checked():
    assert set(ROPE_INIT_FUNCTIONS) | {"default"} <= set(ROPE_PARAMETERS)


@pytest.mark.parametrize("rope_type", list(ROPE_PARAMETERS))
@pytest.mark.parametrize("as_object", [True, False])
def test_llama_tables_of_every_rope_type(rope_type, as_object):
    config = LlamaConfig(**LLAMA, rope_parameters=copy.deepcopy(ROPE_PARAMETERS[rope_type]))
    hf = hf_llama.LlamaRotaryEmbedding(config)
    ours = rope_ext.RotaryEmbedding.from_config(config if as_object else config.to_dict())
    for positions in (POSITIONS[:5], POSITIONS):  # a short call, then one past the originals
        cos, sin = hf(torch.zeros(1, dtype=torch.float32), positions[None])
        c, s = ours.cos_sin(positions)
        close_tables(c, hf_half(cos[0]), positions, hf.inv_freq, hf.attention_scaling)
        close_tables(s, hf_half(sin[0]), positions, hf.inv_freq, hf.attention_scaling)


@pytest.mark.parametrize("model_type", ["ministral3", "mistral4"])
@pytest.mark.parametrize("as_object", [True, False])
def test_mistral_yarn_with_a_query_scaling(model_type, as_object):
    # Their YaRN dicts carry llama_4_scaling_beta (a query scaling their attention applies after
    # RoPE) and a copy of max_position_embeddings, which transformers skips when it checks the
    # dict; Mistral 4 (MLA) gives partial_rotary_factor of its whole head: qk_rope_head_dim
    from transformers import CONFIG_MAPPING
    import importlib

    config = CONFIG_MAPPING[model_type](num_hidden_layers=1)
    modeling = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    rotary = next(getattr(modeling, n) for n in dir(modeling) if n.endswith("RotaryEmbedding"))
    hf = rotary(config)
    ours = rope_ext.RotaryEmbedding.from_config(config if as_object else config.to_dict())
    positions = torch.tensor([0, 1, 7, 1000, 20000, 100000])
    cos, sin = hf(torch.zeros(1, dtype=torch.float32), positions[None])
    c, s = ours.cos_sin(positions)
    assert 2 * c.shape[-1] == cos.shape[-1]
    close_tables(c, hf_half(cos[0]), positions, hf.inv_freq, hf.attention_scaling)
    close_tables(s, hf_half(sin[0]), positions, hf.inv_freq, hf.attention_scaling)


def test_proportional_tail_pairs_pass_through():
    config = LlamaConfig(**LLAMA, rope_parameters=copy.deepcopy(ROPE_PARAMETERS["proportional"]))
    ours = rope_ext.RotaryEmbedding.from_config(config)
    assert ours.rotary_dim == 64  # the table spans the head
    c, s = ours.cos_sin(POSITIONS)
    angles = int(0.5 * 64 // 2)
    assert torch.equal(c[:, angles:], torch.ones_like(c[:, angles:]))
    assert torch.equal(s[:, angles:], torch.zeros_like(s[:, angles:]))
    q = torch.randn(len(POSITIONS), 4, 64, dtype=torch.float64)
    out, _ = ours(q, None, POSITIONS)
    pairs = torch.cat((torch.arange(angles), 32 + torch.arange(angles)))
    rest = torch.ones(64, dtype=torch.bool)
    rest[pairs] = False
    assert torch.equal(out[..., rest], q[..., rest])


# ---- Gemma 4 --------------------------------------------------------------------------------

def gemma4_file():
    """A Gemma 4 text config.json as transformers 5 writes it (keys equal to the class defaults
    left out), with the global layers' head dim."""
    return {"model_type": "gemma4_text", "num_hidden_layers": 6, "global_head_dim": 512,
            "max_position_embeddings": 4096}


@pytest.mark.parametrize("layer_type", ["full_attention", "sliding_attention"])
@pytest.mark.parametrize("form", ["object", "to_dict", "file", "multimodal"])
def test_gemma4_tables(layer_type, form):
    config = Gemma4TextConfig(num_hidden_layers=6, max_position_embeddings=4096)
    hf = hf_gemma4.Gemma4TextRotaryEmbedding(config)
    source = {"object": config, "to_dict": config.to_dict(), "file": gemma4_file(),
              "multimodal": {"model_type": "gemma4", "text_config": gemma4_file()}}[form]
    ours = rope_ext.RotaryEmbedding.from_config(source, layer_type=layer_type)
    head_dim = 512 if layer_type == "full_attention" else 256
    assert (ours.head_dim, ours.rotary_dim, ours.interleaved) == (head_dim, head_dim, False)
    cos, sin = hf(torch.zeros(1), POSITIONS[None], layer_type)
    inv_freq = getattr(hf, f"{layer_type}_inv_freq")
    c, s = ours.cos_sin(POSITIONS)
    close_tables(c, hf_half(cos[0]), POSITIONS, inv_freq)
    close_tables(s, hf_half(sin[0]), POSITIONS, inv_freq)
    # The rotation: transformers' apply function and rope_ext on the same float32 cos/sin.
    q = torch.randn(1, 2, len(POSITIONS), head_dim, dtype=torch.float64)
    want = hf_gemma4.apply_rotary_pos_emb(q, cos.double(), sin.double())
    x = q[0].transpose(0, 1)  # (tokens, heads, head_dim)
    table = torch.cat((hf_half(cos[0]), hf_half(sin[0])), -1).double()
    got = rope_ext.apply_rope_at(x, torch.arange(len(POSITIONS)), table)
    torch.testing.assert_close(got.transpose(0, 1)[None], want, rtol=1e-12, atol=1e-12)


def test_gemma4_layer_type_required():
    with pytest.raises(ValueError, match="pass layer_type="):
        rope_kwargs_from_config(gemma4_file())


# ---- DeepSeek-V4 ----------------------------------------------------------------------------

YARN = {"type": "yarn", "factor": 16.0, "original_max_position_embeddings": 256, "beta_fast": 32,
        "beta_slow": 1}


def deepseek_v4_file():
    """DeepSeek-V4's config.json keys that decide RoPE, in the legacy spelling checkpoints ship
    (rope_scaling for the compressed branches, qk_rope_head_dim)."""
    return {"model_type": "deepseek_v4", "head_dim": 512, "qk_rope_head_dim": 64, "rope_theta": 10000.0,
            "compress_rope_theta": 160000.0, "max_position_embeddings": 4096,
            "rope_scaling": dict(YARN)}


@pytest.mark.parametrize("label", ["main", "compress"])
@pytest.mark.parametrize("form", ["object", "to_dict", "file"])
def test_deepseek_v4_tables_and_rotation(label, form):
    config = DeepseekV4Config(num_hidden_layers=4, max_position_embeddings=4096,
                              rope_scaling=dict(YARN))
    hf = hf_dsv4.DeepseekV4RotaryEmbedding(config)
    source = {"object": config, "to_dict": config.to_dict(), "file": deepseek_v4_file()}[form]
    kwargs = rope_kwargs_from_config(source, layer_type=label)
    assert (kwargs["head_dim"], kwargs["rotary_dim"], kwargs["rope_dim_offset"]) == (512, 64, 448)
    assert kwargs["interleaved"] is True
    ours = rope_ext.RotaryEmbedding.from_config(source, layer_type=label)
    cos, sin = hf(torch.zeros(1), POSITIONS[None], layer_type=label)  # one per pair
    inv_freq = getattr(hf, f"{label}_inv_freq")
    c, s = ours.cos_sin(POSITIONS)
    attention = getattr(hf, f"{label}_attention_scaling")
    close_tables(c, cos[0], POSITIONS, inv_freq, attention)
    close_tables(s, sin[0], POSITIONS, inv_freq, attention)
    # The rotation of the tail, on the same cos/sin: transformers' apply function, rope_ext's
    # module (out of place) and the in-place op with rope_dim_offset.
    # float32 values (transformers' apply function rounds x to float32 first), held in float64.
    x = torch.randn(len(POSITIONS), 3, 512).double()
    want = hf_dsv4.apply_rotary_pos_emb(x.transpose(0, 1)[None], cos.double(), sin.double()).squeeze(0)
    want = want.transpose(0, 1)
    table = torch.cat((cos[0], sin[0]), -1).double()
    index = torch.arange(len(POSITIONS))
    y = x.clone()
    rope_ext.apply_rope_(y, None, index, table, interleaved=True, rope_dim_offset=448)
    torch.testing.assert_close(y, want, rtol=1e-12, atol=1e-12)
    module = rope_ext.RotaryEmbedding(512, rotary_dim=64, max_position=8, interleaved=True,
                                      rope_dim_offset=448)
    module._tables = table.float()
    out, _ = module(x.float(), None, index)
    torch.testing.assert_close(out.double(), want, rtol=2e-6, atol=2e-6)
    q = x.float().clone()
    module.forward_(q, None, index)
    torch.testing.assert_close(q, out, rtol=0, atol=0)


def test_deepseek_v4_labels():
    with pytest.raises(ValueError, match="pass layer_type= one of them"):
        rope_kwargs_from_config(deepseek_v4_file())
    with pytest.raises(ValueError, match="layer_type 'sliding_attention' has no RoPE parameters"):
        rope_kwargs_from_config(deepseek_v4_file(), layer_type="sliding_attention")


# Model types whose transformers code rotates interleaved pairs with no config key saying so
# (the function their attention calls): the attention scores <R(m) q, R(n) k> of from_config's
# rotation must be the model code's. Scores compare layouts whatever permutation of the dims a
# model applies to q and k alike (DeepSeek's de-interleaving).
INTERLEAVED_BY_CODE = {
    "longcat_flash": "apply_rotary_pos_emb_interleave", "moonshine": "apply_rotary_pos_emb",
    "moonshine_streaming": "apply_rotary_pos_emb",
    "deepseek_v32": "apply_rotary_pos_emb_interleave",
    "glm_moe_dsa": "apply_rotary_pos_emb_interleave",
    "mistral_large4": "apply_rotary_pos_emb_interleave",
    "bailing_hybrid": "apply_rotary_pos_emb_interleave",
    "axk2": "apply_rotary_pos_emb_interleave", "cohere2_moe": "apply_rotary_pos_emb",
    "ernie4_5_vl_moe": "apply_rotary_pos_emb", "glm_ocr": "apply_rotary_pos_emb",
    "glm4v": "apply_rotary_pos_emb", "glm46v": "apply_rotary_pos_emb",
    "openai_privacy_filter": "apply_rotary_pos_emb",
    "blt_global_transformer": "apply_rotary_pos_emb", "blt_patcher": "apply_rotary_pos_emb",
    "cohere2": "apply_rotary_pos_emb", "deepseek_v3": "apply_rotary_pos_emb_interleave",
}


def _config_of(model_type):
    if model_type in ("glm4v", "glm46v"):  # their text model: MRoPE sections of its rotary dims
        return transformers.Glm4vTextConfig(
            hidden_size=256, num_attention_heads=2, num_key_value_heads=1, head_dim=128,
            rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                             "partial_rotary_factor": 0.5, "mrope_section": [8, 12, 12]})
    return transformers.AutoConfig.for_model(model_type)


@pytest.mark.parametrize("model_type", sorted(INTERLEAVED_BY_CODE))
def test_layout_of_models_whose_code_interleaves(model_type):
    import importlib

    cfg = _config_of(model_type)
    sub = getattr(cfg, "text_config", None) or cfg
    mod = importlib.import_module(type(sub).__module__.replace("configuration_", "modeling_"))
    rotary = next(c for n, c in vars(mod).items()
                  if n.endswith("RotaryEmbedding") and "Vision" not in n)
    T = 16
    cos, sin = rotary(config=sub)(torch.zeros(1, T, 4), torch.arange(T)[None])[:2]
    rope = rope_ext.RotaryEmbedding.from_config(cfg)
    assert rope.interleaved
    q, k = torch.randn(2, 1, 1, T, rope.head_dim, dtype=torch.float64)
    qh, kh = getattr(mod, INTERLEAVED_BY_CODE[model_type])(q, k, cos.double(), sin.double())[:2]
    want = qh[0, 0] @ kh[0, 0].T
    qr, kr = rope(q[0].transpose(0, 1).float(), k[0].transpose(0, 1).float(), torch.arange(T))
    got = qr[:, 0].double() @ kr[:, 0].double().T
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4 * float(want.abs().max()))


def test_minimax_m3_vl_rotates_what_its_model_code_rotates():
    # Its config carries rotary_dim (64 by default), which its model code does not read: it
    # rotates partial_rotary_factor * head_dim dims, the whole head unless told.
    from transformers import MiniMaxM3VLTextConfig
    from transformers.models.minimax_m3_vl import modeling_minimax_m3_vl as hf_m3

    for extra in ({}, {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                          "partial_rotary_factor": 0.25}}):
        cfg = MiniMaxM3VLTextConfig(hidden_size=256, num_attention_heads=2, head_dim=128,
                                    num_key_value_heads=1, **extra)
        cos, sin = hf_m3.MiniMaxM3VLRotaryEmbedding(config=cfg)(torch.zeros(1, 4, 4),
                                                                   POSITIONS[None, :4])
        rope = rope_ext.RotaryEmbedding.from_config(cfg)
        assert rope.rotary_dim == cos.shape[-1] and not rope.interleaved
        q, k = torch.randn(2, 1, 1, 4, 128)
        want = hf_m3.apply_rotary_pos_emb(q, k, cos, sin)
        got = rope(q[0].transpose(0, 1), k[0].transpose(0, 1), POSITIONS[:4])
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w[0].transpose(0, 1), rtol=1e-5, atol=1e-5)


# ---- MRoPE as each model's code lays it out ----------------------------------------------------

# A text config type per family whose rotary class chooses MRoPE's sections where the config
# gives none, and (all but Qwen2/2.5-VL) interleaves them whatever mrope_interleaved says.
MROPE_TEXT_TYPES = ["qwen2_vl_text", "qwen2_5_vl_text", "qwen3_vl_text", "qwen3_vl_moe_text",
                    "qwen3_5_text", "qwen3_5_moe_text", "qwen4_exp_text", "cosmos3_edge_text",
                    "qwen3_omni_moe_text"]
# Their default sections fill the rotated dims of a head this big (Qwen3.5's rotate a quarter).
MROPE_HEAD_DIM = {"qwen3_5_text": 256, "qwen3_5_moe_text": 256, "qwen4_exp_text": 64}


@pytest.mark.parametrize("given", [{}, {"mrope_section": "theirs"}, {"mrope_section": "theirs",
                                                                     "mrope_interleaved": "theirs"}])
@pytest.mark.parametrize("model_type", MROPE_TEXT_TYPES)
def test_mrope_of_models_whose_code_chooses_it(model_type, given):
    """A config without mrope_section, or with it and without mrope_interleaved (Cosmos3-Edge's
    class defaults are such a config): rope_ext rotates image-grid positions (3, T) as the model's
    code does (rope_ext once laid these families' sections out one after another: 3-4 off)."""
    import importlib

    D = MROPE_HEAD_DIM.get(model_type, 128)
    cfg = transformers.AutoConfig.for_model(model_type, hidden_size=256, num_attention_heads=2,
                                            num_key_value_heads=1, head_dim=D)
    mod = importlib.import_module(type(cfg).__module__.replace("configuration_", "modeling_"))
    rotary = next(c for n, c in vars(mod).items()
                  if n.endswith("RotaryEmbedding") and "Vision" not in n and "Talker" not in n)
    theirs = rotary(config=cfg)
    params = {k: v for k, v in cfg.rope_parameters.items()
              if not k.startswith("mrope") or given.get(k) == "theirs"}
    if "mrope_section" in given:
        params["mrope_section"] = list(theirs.mrope_section)
    if "mrope_interleaved" in given:
        params["mrope_interleaved"] = "qwen2" not in model_type
    cfg.rope_parameters = params
    T = 12
    grid = torch.stack([torch.full((T,), 3), torch.arange(T) // 4 + 3, torch.arange(T) % 4 + 3])
    cos, sin = rotary(config=cfg)(torch.zeros(1, T, 4), grid[:, None])
    q, k = torch.randn(1, T, 2, D), torch.randn(1, T, 1, D)
    want = mod.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=2)
    for form in (cfg, cfg.to_dict()):
        got = rope_ext.RotaryEmbedding.from_config(form)(q[0], k[0], grid)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w[0], rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("model_type,flag", [("qwen3_5_text", False), ("cosmos3_edge_text", False),
                                             ("qwen2_vl_text", True)])
def test_a_layout_the_code_does_not_use_is_refused(model_type, flag):
    cfg = transformers.AutoConfig.for_model(model_type, hidden_size=256, num_attention_heads=2,
                                            num_key_value_heads=1,
                                            head_dim=MROPE_HEAD_DIM.get(model_type, 128))
    cfg.rope_parameters = dict(cfg.rope_parameters, mrope_interleaved=flag)
    laid = "one section after another" if flag else "interleaved"
    with pytest.raises(ValueError, match=f"{model_type} lays MRoPE out {laid}; the config says "
                                         f"mrope_interleaved={str(flag).lower()}"):
        rope_ext.RotaryEmbedding.from_config(cfg)


@pytest.mark.parametrize("model_type", ["qwen4_exp_text", "qwen3_5_text"])
def test_default_sections_that_do_not_fit_leave_plain_rope(model_type):
    """A head whose rotated dims the code's default sections do not fill (transformers' slices
    run such a model): no sections, so text positions rotate as transformers rotates them."""
    import importlib

    D = 2 * MROPE_HEAD_DIM.get(model_type, 128)
    cfg = transformers.AutoConfig.for_model(model_type, hidden_size=256, num_attention_heads=2,
                                            num_key_value_heads=1, head_dim=D)
    rope = rope_ext.RotaryEmbedding.from_config(cfg)
    assert rope.mrope_section is None
    mod = importlib.import_module(type(cfg).__module__.replace("configuration_", "modeling_"))
    rotary = next(c for n, c in vars(mod).items()
                  if n.endswith("RotaryEmbedding") and "Vision" not in n)
    T = 12
    cos, sin = rotary(config=cfg)(torch.zeros(1, T, 4), torch.arange(T)[None].expand(3, 1, T))
    q, k = torch.randn(1, T, 2, D), torch.randn(1, T, 1, D)
    want = mod.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=2)
    for g, w in zip(rope(q[0], k[0], torch.arange(T)), want):
        torch.testing.assert_close(g, w[0], rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("local", [None, 50000.0])
@pytest.mark.parametrize("model_type", ["gemma3_text", "gemma3n_text"])
def test_a_sliding_entry_without_a_base_takes_the_local_one(model_type, local):
    # Gemma 3's per-layer rope_parameters written sparse: transformers 5 fills the sliding entry's
    # base with rope_local_base_freq (the file's, else its default 10000), not with rope_theta
    from transformers import CONFIG_MAPPING

    params = {"full_attention": {"rope_type": "linear", "factor": 8.0},
              "sliding_attention": {"rope_type": "default"}}
    extra = {} if local is None else {"rope_local_base_freq": local}
    config = CONFIG_MAPPING[model_type](rope_parameters=copy.deepcopy(params), rope_theta=1e6,
                                        **extra)
    file = {"model_type": model_type, "rope_parameters": params, "rope_theta": 1e6, **extra,
            "hidden_size": config.hidden_size, "num_attention_heads": config.num_attention_heads,
            "head_dim": config.head_dim}
    for layer_type in params:
        want = config.rope_parameters[layer_type]["rope_theta"]
        assert rope_kwargs_from_config(file, layer_type=layer_type)["base"] == want
        assert rope_kwargs_from_config(config, layer_type=layer_type)["base"] == want
    assert config.rope_parameters["sliding_attention"]["rope_theta"] == (local or 10000.0)
