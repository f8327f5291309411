"""The fused attention prologue of the processors rope_ext.integrations.diffusers patches: each
processor's q/k norms run inside its RoPE, one rope.norm_rope call normalizing and rotating query
and key, wherever diffusers rotates the tokens it norms.

REWRITES holds, per processor class, the statements of diffusers' __call__ (0.42) that change and
what replaces them, matched structurally (diffusers.py applies them; a processor whose source does
not hold them is patched for its RoPE only). The q/k norm statements then run only where no RoPE
follows (a cross-attention, a model called without rotary embeddings); the RoPE statements become
a call of norm_rope (or norm_rope_across_heads, norm_rope_span) given the norm modules, and the
replacement names diffusers' RoPE function, which the patching redirects to its
rope_ext.compat.diffusers twin as it does everywhere. Tokens that are normed but never rotated
(text tokens of HunyuanVideo, Mochi, CogVideoX and CogView4; Wan's and LTX-Video's
cross-attention; Wan's image keys) keep diffusers' plain norm.

The helpers decide at each call whether the op stands in for a norm module (_form): a module of
a class in NORM_CLASSES (exactly: a subclass may compute otherwise), called plainly (no hooks, no
instance forward), over one head (or all heads of a token, where diffusers norms the flat
projection), with weights of the dtype the module computes with; and whether the RoPE's tables
are taken in one pass (rope_ext.compat.diffusers.one_pass_tables). Anything else (a norm replaced
after patch by another module, a hooked one, float64, tables whose pairs differ or that need a
gradient, the full-width tables of a traced graph) runs the modules and then the drop-in, as the
RoPE-only patch does. Imports diffusers: imported by the patching when it builds a processor.
"""

import textwrap

import torch
from diffusers.models import normalization as _dn

from .. import qk_norm as _api
from .._call import ops
from .._qk_norm.checks import MAX_GENERAL_HEAD_DIM, uses_general_rows
from ..compat import diffusers as dfx
from ..compat._layout import broadcasts_within
from ._qk_norm import plain_call

# norm class -> (the op's form of its norm, whether the module computes in x's dtype: then its
# weight and bias must have x's dtype for its result to be the op's float32 one rounded (the
# others compute in float32 whatever their weights' dtype and round once, as the op does)).
NORM_CLASSES = {
    torch.nn.RMSNorm: ("rms", True),  # FLUX.1, Chroma, FLUX.2, Wan, LTX-Video
    _dn.RMSNorm: ("rms", True),  # HunyuanVideo, Qwen-Image, Lumina2
    _dn.MochiRMSNorm: ("rms", False),  # Mochi
    torch.nn.LayerNorm: ("layer", True),  # CogVideoX, CogView4 (elementwise_affine=False)
    _dn.FP32LayerNorm: ("layer", False),  # diffusers' Attention(qk_norm="fp32_layer_norm")
}
# Each class's own forward: one replaced on the class (by a library or a user) computes otherwise.
_FORWARDS = {cls: cls.forward for cls in NORM_CLASSES
             if cls.forward.__qualname__ == f"{cls.__qualname__}.forward"}
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# torch.nn.RMSNorm(eps=None) adds the epsilon of the type it computes in: float32 for these
_DEFAULT_EPS = torch.finfo(torch.float32).eps


# ---- what the rewritten __call__ runs ----

def norm(module, x):
    """module(x), or x where the module is None (diffusers' `if attn.norm_q is not None`)."""
    return x if module is None else module(x)


def norm_rope(norms, query, key, rope, *args, **kwargs):
    """`rope(norms[0](query), *args, **kwargs), rope(norms[1](key), *args, **kwargs)` (rope: a
    rope_ext.compat.diffusers function; a norm None: none), in one rope.norm_rope call where the
    op computes what the modules and rope do. query and key: (B, S, H, D) or (B, H, S, D), or
    LTX-Video's flat (B, S, H * D), normed and rotated as one head."""
    return _norm_rope(norms, query, key, False, rope, args, kwargs)


def norm_rope_across_heads(norms, query, key, rope, *args, **kwargs):
    """norm_rope where diffusers applies the norms to the flat projection (B, S, H * D) before
    unflattening it (Wan): query and key here are (B, S, H, D)."""
    return _norm_rope(norms, query, key, True, rope, args, kwargs)


def norm_rope_span(norms, query, key, dim, start, stop, rope, *args, **kwargs):
    """norm_rope of the tokens [start:stop] along dim; the tokens before or after them (text
    tokens, which diffusers norms but does not rotate) normed only, all in their order. Where
    the op does not stand in for the norms, each runs once over all tokens, as in diffusers (a
    hooked norm sees what it sees there)."""
    def part(x, begin, end):
        return x[(slice(None),) * dim + (slice(begin, end),)]

    def joined(x, middle, module=None):
        parts = [middle]
        if start:
            parts.insert(0, norm(module, part(x, None, start)))
        if stop is not None:
            parts.append(norm(module, part(x, stop, None)))
        return torch.cat(parts, dim) if len(parts) > 1 else middle

    rotated = _fused(norms, part(query, start, stop), part(key, start, stop), False, rope, args,
                     kwargs)
    if rotated is None:
        normed = (norm(norms[0], query), norm(norms[1], key))
        return tuple(joined(x, rope(part(x, start, stop), *args, **kwargs)) for x in normed)
    return tuple(joined(x, middle, module)
                 for module, x, middle in zip(norms, (query, key), rotated))


def rows(freqs, text, image, part):
    """FLUX's (cos, sin) tables (tokens, D) of the joint [text, image] sequence cut to one part's
    rows (`part` "text" or "image"): diffusers norms the parts apart and rotates them joined.
    Tables of another row count than text + image are given whole: one row broadcasts over every
    token, as diffusers broadcasts it over the joint sequence, and any other count fails the
    rotation, as it fails diffusers' (cut, a table of the text's rows and one more gave the image
    part one row, which broadcast over its tokens silently)."""
    if not isinstance(freqs, (tuple, list)) or any(t.dim() != 2 or t.shape[0] != text + image
                                                   for t in freqs):
        return freqs  # (not FLUX's form, or not one row per token: the drop-in decides)
    return tuple(t[:text] if part == "text" else t[text:] for t in freqs)


# The globals the rewritten __call__ reads, each under the prefix rope_ext's globals in diffusers'
# modules have (rope_ext.integrations.diffusers._GLOBAL_PREFIX), as REWRITES spells them.
HELPERS = {"norm_rope": norm_rope, "norm_rope_across_heads": norm_rope_across_heads,
           "norm_rope_span": norm_rope_span, "rows": rows}


def _norm_rope(norms, query, key, across, rope, args, kwargs):
    fused = _fused(norms, query, key, across, rope, args, kwargs)
    if fused is not None:
        return fused
    query, key = _normed(norms[0], query, across), _normed(norms[1], key, across)
    return rope(query, *args, **kwargs), rope(key, *args, **kwargs)


def _normed(module, x, across):
    if across and module is not None:
        return module(x.flatten(-2)).unflatten(-1, x.shape[-2:])
    return norm(module, x)


def _fused(norms, query, key, across, rope, args, kwargs):
    """The op's (q, k), or None where it does not compute what the modules and rope do."""
    if key.dtype != query.dtype or key.device != query.device:
        return None
    flat = query.dim() == 3  # LTX-Video's (B, S, H * D): one head
    q, k = (query.unsqueeze(-2), key.unsqueeze(-2)) if flat else (query, key)
    q_form, k_form = _form(norms[0], q, across), _form(norms[1], k, across)
    if q_form is None or k_form is None or q_form[2:] != k_form[2:]:
        return None  # (the op takes one eps and one form for both)
    (q_weight, q_bias, eps, form), (k_weight, k_bias) = q_form, k_form[:2]
    if (uses_general_rows(form, q_weight, k_weight, q_bias, k_bias)
            and q.shape[-1] > MAX_GENERAL_HEAD_DIM):
        return None
    tables = dfx.one_pass_tables(rope, query, *args, **kwargs)
    if tables is None:
        return None
    cos, sin, interleaved = tables
    if flat:
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    if not broadcasts_within(cos, k) or (across and cos.shape[-2] != 1):
        return None  # (tables of one head each cannot rotate heads normed together)
    q, k = _api.norm_rope(q, k, q_weight, k_weight, cos, sin, q_bias=q_bias, k_bias=k_bias,
                          eps=eps, norm=form, interleaved=interleaved, table_width="half")
    return (q.squeeze(-2), k.squeeze(-2)) if flat else (q, k)


def _form(module, x, across):
    """(weight, bias, eps, the op's norm form) with which rope.norm_rope normalizes x
    (..., H, D) as calling `module` does (over each head; with across, over the H * D values of a
    token, the module being diffusers' norm of the flat projection); None where it does not."""
    cls = type(module)
    spec = NORM_CLASSES.get(cls)
    if (spec is None or cls.forward is not _FORWARDS.get(cls) or x.dtype not in _DTYPES
            or not plain_call(module)):
        return None
    form, in_x_dtype = spec
    if across:
        if form != "rms":
            return None
        form = "rms_across_heads"
    shape = module.normalized_shape if hasattr(module, "normalized_shape") else module.dim
    if tuple(shape) != (x.shape[-1] * x.shape[-2] if across else x.shape[-1],):
        return None  # (diffusers' RMSNorm norms the last dim whatever its `dim`: one of width D)
    weight, bias = module.weight, getattr(module, "bias", None)
    for t in (weight, bias):
        if t is not None and (t.dtype != x.dtype if in_x_dtype else t.dtype not in _DTYPES):
            return None
    return weight, bias, _DEFAULT_EPS if module.eps is None else module.eps, form


# ---- the rewrites of diffusers' __call__ sources ----

def _source(text):
    return textwrap.dedent(text).strip("\n")


def _unless(condition, statements):
    """(diffusers' q/k norm statements, the same run only `if condition`): where the tokens are
    rotated, the fused call that follows norms them."""
    statements = _source(statements)
    return statements, f"if {condition}:\n" + textwrap.indent(statements, "    ")


_QK_NORMS = """
    query = attn.norm_q(query)
    key = attn.norm_k(key)
"""
_QK_NORMS_IF_SET = """
    if attn.norm_q is not None:
        query = attn.norm_q(query)
    if attn.norm_k is not None:
        key = attn.norm_k(key)
"""

# FLUX.1, Chroma, FLUX.2: the image (hidden_states') and text tokens are normed apart, joined
# [text, image] and rotated together: each part is fused with its rows of the tables, and the
# joint RoPE goes. In a single-stream block hidden_states holds all the tokens (no text part).
_FLUX_IMAGE = (_source(_QK_NORMS), _source("""
    if image_rotary_emb is None:
        query = attn.norm_q(query)
        key = attn.norm_k(key)
    else:
        query, key = _rope_ext_norm_rope(
            (attn.norm_q, attn.norm_k), query, key, apply_rotary_emb,
            _rope_ext_rows(
                image_rotary_emb, encoder_query.shape[1] if attn.added_kv_proj_dim is not None else 0,
                query.shape[1], "image",
            ),
            sequence_dim=1,
        )
"""))
_FLUX_TEXT = (_source("""
    encoder_query = attn.norm_added_q(encoder_query)
    encoder_key = attn.norm_added_k(encoder_key)
"""), _source("""
    if image_rotary_emb is None:
        encoder_query = attn.norm_added_q(encoder_query)
        encoder_key = attn.norm_added_k(encoder_key)
    else:
        encoder_query, encoder_key = _rope_ext_norm_rope(
            (attn.norm_added_q, attn.norm_added_k), encoder_query, encoder_key, apply_rotary_emb,
            _rope_ext_rows(image_rotary_emb, encoder_query.shape[1], query.shape[1], "text"),
            sequence_dim=1,
        )
"""))
_FLUX_ROPE = (_source("""
    if image_rotary_emb is not None:
        query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
        key = apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)
"""), "")
# FLUX.2's parallel (single-stream) blocks: hidden_states holds all the tokens.
_FLUX2_PARALLEL = [_unless("image_rotary_emb is None", _QK_NORMS), (_FLUX_ROPE[0], _source("""
    if image_rotary_emb is not None:
        query, key = _rope_ext_norm_rope(
            (attn.norm_q, attn.norm_k), query, key, apply_rotary_emb, image_rotary_emb, sequence_dim=1
        )
"""))]

# Wan: RMSNorm over the flat projection (all heads of a token), RoPE after the unflatten; the
# cross-attention (no rotary_emb) and the image keys of I2V (norm_added_k) keep the plain norm.
_WAN = [_unless("rotary_emb is None", _QK_NORMS), (_source("""
    query = apply_rotary_emb(query, *rotary_emb)
    key = apply_rotary_emb(key, *rotary_emb)
"""), _source("""
    query, key = _rope_ext_norm_rope_across_heads(
        (attn.norm_q, attn.norm_k), query, key, apply_rotary_emb, *rotary_emb
    )
"""))]

# HunyuanVideo: a single-stream block joins [video, text] and rotates the video tokens only (the
# text's are normed only); a double-stream block rotates all of hidden_states' tokens and norms
# the text's with norm_added_q/k, unrotated.
_HUNYUAN_VIDEO = [_unless("image_rotary_emb is None", _QK_NORMS_IF_SET), (_source("""
    if attn.add_q_proj is None and encoder_hidden_states is not None:
        query = torch.cat(
            [
                apply_rotary_emb(
                    query[:, : -encoder_hidden_states.shape[1]],
                    image_rotary_emb,
                    sequence_dim=1,
                ),
                query[:, -encoder_hidden_states.shape[1] :],
            ],
            dim=1,
        )
        key = torch.cat(
            [
                apply_rotary_emb(
                    key[:, : -encoder_hidden_states.shape[1]],
                    image_rotary_emb,
                    sequence_dim=1,
                ),
                key[:, -encoder_hidden_states.shape[1] :],
            ],
            dim=1,
        )
    else:
        query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
        key = apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)
"""), _source("""
    if attn.add_q_proj is None and encoder_hidden_states is not None:
        query, key = _rope_ext_norm_rope_span(
            (attn.norm_q, attn.norm_k), query, key, 1, None, -encoder_hidden_states.shape[1],
            apply_rotary_emb, image_rotary_emb, sequence_dim=1,
        )
    else:
        query, key = _rope_ext_norm_rope(
            (attn.norm_q, attn.norm_k), query, key, apply_rotary_emb, image_rotary_emb, sequence_dim=1
        )
"""))]

# Qwen-Image: image and text streams normed and rotated apart, each by its own tables.
_QWEN_IMAGE = [_unless("image_rotary_emb is None", """
    if attn.norm_q is not None:
        img_query = attn.norm_q(img_query)
    if attn.norm_k is not None:
        img_key = attn.norm_k(img_key)
    if attn.norm_added_q is not None:
        txt_query = attn.norm_added_q(txt_query)
    if attn.norm_added_k is not None:
        txt_key = attn.norm_added_k(txt_key)
"""), (_source("""
    img_query = apply_rotary_emb_qwen(img_query, img_freqs, use_real=False)
    img_key = apply_rotary_emb_qwen(img_key, img_freqs, use_real=False)
    txt_query = apply_rotary_emb_qwen(txt_query, txt_freqs, use_real=False)
    txt_key = apply_rotary_emb_qwen(txt_key, txt_freqs, use_real=False)
"""), _source("""
    img_query, img_key = _rope_ext_norm_rope(
        (attn.norm_q, attn.norm_k), img_query, img_key, apply_rotary_emb_qwen, img_freqs, use_real=False
    )
    txt_query, txt_key = _rope_ext_norm_rope(
        (attn.norm_added_q, attn.norm_added_k), txt_query, txt_key, apply_rotary_emb_qwen, txt_freqs,
        use_real=False,
    )
"""))]

# LTX-Video: RMSNorm and RoPE both on the flat (B, S, H * D) projection; the cross-attention
# (no image_rotary_emb) keeps the plain norm.
_LTX = [_unless("image_rotary_emb is None", _QK_NORMS), (_source("""
    query = apply_rotary_emb(query, image_rotary_emb)
    key = apply_rotary_emb(key, image_rotary_emb)
"""), _source("""
    query, key = _rope_ext_norm_rope((attn.norm_q, attn.norm_k), query, key, apply_rotary_emb, image_rotary_emb)
"""))]

# CogVideoX: (B, H, S, D), the text tokens first, normed only.
_COGVIDEOX = [_unless("image_rotary_emb is None or attn.is_cross_attention", _QK_NORMS_IF_SET), (_source("""
    query[:, :, text_seq_length:] = apply_rotary_emb(query[:, :, text_seq_length:], image_rotary_emb)
    if not attn.is_cross_attention:
        key[:, :, text_seq_length:] = apply_rotary_emb(key[:, :, text_seq_length:], image_rotary_emb)
"""), _source("""
    if attn.is_cross_attention:
        query[:, :, text_seq_length:] = apply_rotary_emb(query[:, :, text_seq_length:], image_rotary_emb)
    else:
        query, key = _rope_ext_norm_rope_span(
            (attn.norm_q, attn.norm_k), query, key, 2, text_seq_length, None, apply_rotary_emb, image_rotary_emb
        )
"""))]

# Lumina-Image 2.0: complex freqs, grouped key heads.
_LUMINA2 = [_unless("image_rotary_emb is None", _QK_NORMS_IF_SET), (_source("""
    query = apply_rotary_emb(query, image_rotary_emb, use_real=False)
    key = apply_rotary_emb(key, image_rotary_emb, use_real=False)
"""), _source("""
    query, key = _rope_ext_norm_rope(
        (attn.norm_q, attn.norm_k), query, key, apply_rotary_emb, image_rotary_emb, use_real=False
    )
"""))]

# CogView4: (B, H, S, D), LayerNorm without affine, the text tokens first, normed only; the
# training processor's packed batches (batch_flag) keep diffusers' per-segment code.
_COGVIEW4_NORMS = """
    if attn.norm_q is not None:
        query = attn.norm_q(query).to(dtype=dtype)
    if attn.norm_k is not None:
        key = attn.norm_k(key).to(dtype=dtype)
"""
_COGVIEW4_ROPE = (_source("""
    query[:, :, text_seq_length:, :] = apply_rotary_emb(
        query[:, :, text_seq_length:, :], image_rotary_emb, use_real_unbind_dim=-2
    )
    key[:, :, text_seq_length:, :] = apply_rotary_emb(
        key[:, :, text_seq_length:, :], image_rotary_emb, use_real_unbind_dim=-2
    )
"""), _source("""
    query, key = _rope_ext_norm_rope_span(
        (attn.norm_q, attn.norm_k), query, key, 2, text_seq_length, None,
        apply_rotary_emb, image_rotary_emb, use_real_unbind_dim=-2,
    )
    query, key = query.to(dtype=dtype), key.to(dtype=dtype)
"""))

# Mochi: per-head RMSNorm and per-head tables; the text tokens (norm_added_q/k) are not rotated.
_MOCHI = [_unless("image_rotary_emb is None", _QK_NORMS_IF_SET), (_source("""
    query = apply_rotary_emb(query, *image_rotary_emb)
    key = apply_rotary_emb(key, *image_rotary_emb)
"""), _source("""
    query, key = _rope_ext_norm_rope(
        (attn.norm_q, attn.norm_k), query, key, apply_rotary_emb, *image_rotary_emb
    )
"""))]

_FLUX_JOINT = [_FLUX_IMAGE, _FLUX_TEXT, _FLUX_ROPE]

# processor class name -> [(diffusers' statements, their replacement)]. FluxIPAdapterAttnProcessor
# has none: its IP-Adapter attention reads the image query normed and unrotated as well.
REWRITES = {
    "FluxAttnProcessor": _FLUX_JOINT,
    "Flux2AttnProcessor": _FLUX_JOINT,
    "Flux2KVAttnProcessor": _FLUX_JOINT,
    "Flux2ParallelSelfAttnProcessor": _FLUX2_PARALLEL,
    "Flux2KVParallelSelfAttnProcessor": _FLUX2_PARALLEL,
    "WanAttnProcessor": _WAN,
    "HunyuanVideoAttnProcessor2_0": _HUNYUAN_VIDEO,
    "QwenDoubleStreamAttnProcessor2_0": _QWEN_IMAGE,
    "LTXVideoAttnProcessor": _LTX,
    "CogVideoXAttnProcessor2_0": _COGVIDEOX,
    "FusedCogVideoXAttnProcessor2_0": _COGVIDEOX,
    "Lumina2AttnProcessor2_0": _LUMINA2,
    "CogView4AttnProcessor": [_unless("image_rotary_emb is None", _COGVIEW4_NORMS), _COGVIEW4_ROPE],
    "CogView4TrainingAttnProcessor": [
        _unless("image_rotary_emb is None or batch_flag is not None", _COGVIEW4_NORMS), _COGVIEW4_ROPE],
    "MochiAttnProcessor2_0": _MOCHI,
}
