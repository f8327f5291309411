"""Fused per-head QK-RMSNorm + RoPE: the attention prologue of Qwen3, Gemma 3/4, GLM-4 MoE and
their kin, which normalize each head of q and k (RMSNorm over head_dim) right before RoPE.

Each head of query and key is normalized in float32 (float64 for float64 inputs),
    y = x * rsqrt(mean(x^2) + eps) * w,   w = weight, or 1 + weight when unit_offset (Gemma),
then its first rotary_dim dims are rotated (the rest stay normalized, unrotated) and the result
is rounded once to the input dtype. Values (V) are never touched.

- qk_norm_rope: out-of-place and differentiable (w.r.t. query, key, both weights and the
  tables), taking cos/sin as transformers' rotary embedding returns them; for training and
  model patching.
- norm_rope: the same for the norms of image/video (DiT) attention: RMSNorm per head or
  across the heads of a token (Wan, LTX-Video), LayerNorm per head (CogVideoX, CogView4), with
  optional weights and biases; out of place, differentiable (w.r.t. the biases too).
- qk_norm_rope_ / qkv_norm_rope_: in place on separate query/key or on a packed qkv buffer
  (vLLM's layout), positions gathered from a cos_sin_cache; for serving, not differentiable.
- qk_norm_rope_and_cache_: the whole serving attention prologue in one op call: qk_norm_rope_,
  an optional weightless V-norm (Gemma 4), and the paged KV-cache write (fp8 too);
  qk_norm_rope_and_cache: the same returning new query, key and value, the inputs only read.
"""

import torch

from ._args import check_dense, check_eps, check_flags, check_int, mrope_section_arg
from ._call import ops  # torch.ops.rope, without autograd where none is needed
from ._compiling import compiling
from .ops import heads

__all__ = ["qk_norm_rope", "norm_rope", "qk_norm_rope_", "qk_norm_rope_and_cache_",
           "qk_norm_rope_and_cache", "qkv_norm_rope_", "half_tables"]

TABLE_WIDTHS = ("full", "half")


def half_tables(cos, sin, *, interleaved=False, head_first=False, ndim=4):
    """transformers' full-width tables (..., seq, rotary_dim) -> the half-width tables
    (..., rotary_dim/2) that the ops take, with a size-1 head dim inserted and leading 1s so
    they have `ndim` dims. The full-width tables hold each angle twice: the halves duplicated
    (half-split pairs: cos[..., i] == cos[..., i + rotary_dim/2]) or each entry repeated
    (interleaved pairs: cos[..., 2i] == cos[..., 2i+1]); the first copy is read. Interleaved
    models whose rotary module duplicates the halves and repeats entries only inside its
    apply_rotary_pos_emb (transformers' GLM and GLM-4) need cos[..., None, :rotary_dim // 2]
    with table_width="half" instead: their tables read here as repeated entries would be wrong."""
    if not (isinstance(cos, torch.Tensor) and isinstance(sin, torch.Tensor)):
        raise ValueError(f"cos and sin must be tensors (..., seq, rotary_dim), got "
                         f"{type(cos).__name__} and {type(sin).__name__}")
    check_dense(cos, "cos")
    check_dense(sin, "sin")
    if cos.dim() < 2 or cos.shape != sin.shape:
        raise ValueError(f"cos and sin must have one shape (..., seq, rotary_dim), got cos "
                         f"{list(cos.shape)} and sin {list(sin.shape)}")
    width = cos.shape[-1]
    if width % 2:
        raise ValueError(f"rotary_dim = cos.size(-1) = {width} must be even (full-width tables: "
                         "each angle twice)")
    if interleaved:
        cos, sin = cos[..., 0::2], sin[..., 0::2]
    else:
        cos, sin = cos.narrow(-1, 0, width // 2), sin.narrow(-1, 0, width // 2)
    head_axis = -3 if head_first else -2
    cos, sin = cos.unsqueeze(head_axis), sin.unsqueeze(head_axis)
    if cos.dim() == ndim:  # transformers' (batch, seq, rotary_dim) tables for 4-dim q and k
        return cos, sin
    if cos.dim() > ndim:
        raise ValueError(f"cos and sin of shape {list(cos.shape[:-1])} + (rotary_dim,) have more "
                         f"leading dims than query and key ({ndim} dims)")
    lead = (1,) * (ndim - cos.dim())
    return cos.reshape(lead + tuple(cos.shape)), sin.reshape(lead + tuple(sin.shape))


def qk_norm_rope(query, key, q_weight, k_weight, cos, sin, *, eps=1e-6, unit_offset=False,
                 interleaved=False, head_first=False, table_width="full"):
    """Normalized and rotated copies (q, k) of query and key. Out of place, differentiable
    w.r.t. query, key, q_weight, k_weight, cos and sin.

    query: (batch, seq, Hq, head_dim), as transformers has it right after the projection and
        `.view(hidden_shape)` (before the transpose); or (batch, Hq, seq, head_dim) with
        head_first=True. Any number of leading dims, any strides; float16/bfloat16/float32/
        float64. key: (batch, seq, Hk, head_dim) alike, the same dtype.
    q_weight, k_weight: (head_dim,) RMSNorm weights, any float dtype (the norm runs in float32,
        or float64 for float64 inputs).
    cos, sin: table_width="full" (default): transformers' rotary embedding output
        (batch, seq, rotary_dim) or (seq, rotary_dim), each angle twice (see half_tables);
        table_width="half": (..., rotary_dim/2) with query's number of dims (size 1 where they
        broadcast, e.g. over heads), or one row (rotary_dim/2,), as rope_ext.apply_rope takes.
        Any float dtype. rotary_dim <= head_dim; dims >= rotary_dim are normalized only.
    eps: >= 0, added to mean(x^2). unit_offset: the norm scales by (1 + weight) (Gemma).
    interleaved: pairs (x[2i], x[2i+1]) (GPT-J, GLM) if True, (x[i], x[i + rotary_dim/2]) if
        False (GPT-NeoX, Llama, Qwen: transformers' rotate_half). GLM's rotary module gives its
        tables with the halves duplicated: take table_width="half" and
        cos[..., None, :rotary_dim // 2] (a head dim added; see half_tables).
    Returns (q, k), of query's and key's shapes and dtype, contiguous.
    """
    if table_width not in TABLE_WIDTHS:
        raise ValueError(f"table_width must be 'full' or 'half', got {table_width!r}")
    if unit_offset is not False or interleaved is not False or head_first is not False:
        check_flags("unit_offset interleaved head_first", unit_offset, interleaved, head_first)
    if table_width == "full":
        ndim = query.dim() if isinstance(query, torch.Tensor) else 4  # (else the op names it)
        cos, sin = half_tables(cos, sin, interleaved=interleaved, head_first=head_first, ndim=ndim)
    if type(eps) is not float:
        eps = check_eps(eps)
    return ops.qk_norm_rope(query, key, q_weight, k_weight, cos, sin, eps, unit_offset, interleaved)


def norm_rope(query, key, q_weight, k_weight, cos, sin, *, q_bias=None, k_bias=None, eps=1e-6,
              norm="rms", interleaved=False, head_first=False, table_width="full"):
    """Normalized and rotated copies (q, k) of query and key, for the norm forms of image and
    video diffusion transformers. Out of place, differentiable w.r.t. query, key, the weights,
    the biases and the tables.

    norm: "rms": each head RMS-normalized over head_dim, x * rsqrt(mean(x^2) + eps) (FLUX,
        HunyuanVideo, Qwen-Image, Lumina, Mochi); "rms_across_heads": over all heads of a token
        at once (Wan, LTX-Video: an RMSNorm of the (heads * head_dim) projection before the
        unflatten; the tables must be shared by the heads); "layer": each head's LayerNorm,
        (x - mean) * rsqrt(var + eps) (CogVideoX, CogView4). Math in float32 (float64 for
        float64 inputs).
    q_weight, k_weight, q_bias, k_bias: then times weight, plus bias; None: no weight (1) or no
        bias (0). (head_dim,), or (heads * head_dim,) for "rms_across_heads" (the tensor's own
        number of heads).
    query, key, cos, sin, interleaved, head_first, table_width: as qk_norm_rope (with
    head_first=True, "rms_across_heads" normalizes dim -3 and -1 together: the heads of x
    (batch, heads, seq, head_dim)). Returns (q, k) of query's and key's shapes and dtype.
    """
    if table_width not in TABLE_WIDTHS:
        raise ValueError(f"table_width must be 'full' or 'half', got {table_width!r}")
    if interleaved is not False or head_first is not False:
        check_flags("interleaved head_first", interleaved, head_first)
    if type(eps) is not float:
        eps = check_eps(eps)
    if table_width == "full":
        ndim = query.dim() if isinstance(query, torch.Tensor) else 4  # (else the op names it)
        cos, sin = half_tables(cos, sin, interleaved=interleaved, head_first=head_first, ndim=ndim)
    if head_first and norm == "rms_across_heads" and isinstance(query, torch.Tensor) and \
            isinstance(key, torch.Tensor):  # (else the op names what is no tensor)
        # the heads as dim -2, where the op normalizes them together (views, no copy)
        def t(x):
            return x.transpose(-3, -2) if x.dim() == query.dim() else x  # (or one table row)

        try:
            q, k = norm_rope(t(query), t(key), q_weight, k_weight, t(cos), t(sin), q_bias=q_bias,
                             k_bias=k_bias, eps=eps, norm=norm, interleaved=interleaved,
                             table_width="half")
        except (RuntimeError, ValueError) as e:  # its shapes are those of the swapped views
            raise type(e)(f"{e} (with head_first=True and norm='rms_across_heads' the op sees "
                          "query, key, cos and sin with dims -3 and -2 swapped)") from e
        return q.transpose(-3, -2), k.transpose(-3, -2)
    args = (query, key, q_weight, k_weight, q_bias, k_bias, cos, sin, eps, norm, interleaved)
    return ops.norm_rope(*args)


def _flags(unit_offset, interleaved, mrope_section, mrope_interleaved):
    """The trailing flags of rope.qk_norm_rope_ / qkv_norm_rope_ to pass on: none when all four
    are their defaults (torch converts each argument given: 0.6 us of a decode call)."""
    if unit_offset is False and interleaved is False and mrope_section is None and \
            mrope_interleaved is False:
        return ()
    if not ((unit_offset is True or unit_offset is False) and (interleaved is True or interleaved is False)
            and (mrope_interleaved is True or mrope_interleaved is False)):  # (40 ns; the call 250)
        check_flags("unit_offset interleaved mrope_interleaved", unit_offset, interleaved,
                    mrope_interleaved)
    return unit_offset, interleaved, mrope_section_arg(mrope_section, mrope_interleaved), \
        mrope_interleaved


def qk_norm_rope_(query, key, q_weight, k_weight, positions, cos_sin_cache, *, eps=1e-6,
                  unit_offset=False, interleaved=False, mrope_section=None,
                  mrope_interleaved=False, head_size=None):
    """In place: normalizes and rotates query (..., Hq, D) and key (..., Hk, D) (one dtype, the
    same leading dims, any strides) by the rows of cos_sin_cache (max_position, rotary_dim;
    cos in the first half of each row, sin in the second, any float dtype) at positions
    (query.shape[:-2], int32/int64). With mrope_section (3 ints summing to rotary_dim/2),
    positions are (3,) + query.shape[:-2] (temporal, height, width), the pairs split in order
    (chunked) or T,H,W,T,H,W,... (mrope_interleaved). head_size: query and key are flat
    (..., H * head_size). eps, unit_offset, interleaved: as qk_norm_rope. Serving only: not
    differentiable. A rejected call writes nothing. Returns (query, key)."""
    # The op refuses inference tensors outside inference mode itself (torch's error, before any
    # write), as every in-place op of the library does.
    if type(eps) is not float:
        eps = check_eps(eps)
    ops.qk_norm_rope_(heads(query, head_size, "query"), heads(key, head_size, "key"), q_weight,
                      k_weight, positions, cos_sin_cache, eps,
                      *_flags(unit_offset, interleaved, mrope_section, mrope_interleaved))
    return query, key


def qkv_norm_rope_(qkv, num_heads_q, num_heads_k, num_heads_v, head_dim, q_weight, k_weight,
                   positions, cos_sin_cache, *, eps=1e-6, unit_offset=False, interleaved=False,
                   mrope_section=None, mrope_interleaved=False):
    """In place on a packed qkv (num_tokens, (Hq + Hk + Hv) * head_dim) (vLLM's layout, rows of
    any stride): the q and k heads normalized and rotated as qk_norm_rope_ does, positions
    (num_tokens,) (or (3, num_tokens) with mrope_section); the v heads untouched. Serving only.
    Returns qkv."""
    if type(eps) is not float:
        eps = check_eps(eps)
    sizes = (num_heads_q, num_heads_k, num_heads_v, head_dim)
    if not all(type(n) is int and -2**63 <= n < 2**63 for n in sizes):  # (torch's int takes True for 1)
        names = ("num_heads_q", "num_heads_k", "num_heads_v", "head_dim")
        num_heads_q, num_heads_k, num_heads_v, head_dim = (
            check_int(n, f"qkv_norm_rope_: {name}") for n, name in zip(sizes, names))
    ops.qkv_norm_rope_(qkv, num_heads_q, num_heads_k, num_heads_v, head_dim, q_weight, k_weight,
                       positions, cos_sin_cache, eps,
                       *_flags(unit_offset, interleaved, mrope_section, mrope_interleaved))
    return qkv


def qk_norm_rope_and_cache_(query, key, value, positions, cos_sin_cache, q_weight, k_weight,
                            key_cache, value_cache, slot_mapping, *, eps=1e-6, unit_offset=False,
                            interleaved=False, mrope_section=None, mrope_interleaved=False,
                            v_norm=False, kv_cache_dtype="auto", k_scale=None, v_scale=None):
    """The serving attention prologue in one pass, in place:
    query (T, Hq, D) and key (T, Hk, D) normalized and rotated as qk_norm_rope_ does (positions
    (T,), or (3, T) with mrope_section); with v_norm each head of value (T, Hk, Dv)
    RMS-normalized without a weight (Gemma 4), in place; then key and value written into the
    paged caches key_cache (num_blocks, block_size, Hk, D) / value_cache (num_blocks,
    block_size, Hk, Dv) at slot_mapping (T,) as apply_rope_and_cache_ writes them (negative
    slots: rotated, not cached; kv_cache_dtype "fp8" / "fp8_e4m3" / "fp8_e5m2" store x / scale
    saturated, with float32 one-element k_scale / v_scale). Any strides (views of one qkv
    projection output included). Serving only: not differentiable. A rejected call (bad
    shapes, dtypes, positions or slots out of range, a repeated slot, a missing scale) writes
    nothing. Returns (query, key)."""
    if v_norm is False and compiling():
        value = _readable_value(value)
    _prologue("qk_norm_rope_and_cache_", (query, key, value, positions, cos_sin_cache, q_weight,
                                          k_weight, key_cache, value_cache, slot_mapping),
              eps, unit_offset, interleaved, mrope_section, mrope_interleaved, v_norm,
              kv_cache_dtype, k_scale, v_scale)
    return query, key


def qk_norm_rope_and_cache(query, key, value, positions, cos_sin_cache, q_weight, k_weight,
                           key_cache, value_cache, slot_mapping, *, eps=1e-6, unit_offset=False,
                           interleaved=False, mrope_section=None, mrope_interleaved=False,
                           v_norm=False, kv_cache_dtype="auto", k_scale=None, v_scale=None):
    """qk_norm_rope_and_cache_ out of place, in the same single pass (vLLM's
    fused_qknorm_rope_cache): query, key and value are only read (any strides, views of one qkv
    projection output included, which may overlap each other); returns new contiguous (query,
    key, value): query and key normalized and rotated, value normalized with v_norm or else
    copied, the same key and value rows written into the paged caches. A rejected call writes
    nothing. Serving only: not differentiable."""
    return _prologue("qk_norm_rope_and_cache", (query, key, value, positions, cos_sin_cache,
                                                q_weight, k_weight, key_cache, value_cache,
                                                slot_mapping),
                     eps, unit_offset, interleaved, mrope_section, mrope_interleaved, v_norm,
                     kv_cache_dtype, k_scale, v_scale)




def _readable_value(value):
    """value, copied where elements overlap (expanded from one head): the in-place prologue's
    schema marks value written (for v_norm), and torch's functionalization refuses a written
    tensor that overlaps itself, though without v_norm the op only reads it and eager mode
    takes it. Under torch.compile only; nothing of value is written back."""
    if any(st == 0 and n > 1 for n, st in zip(value.shape, value.stride())):
        return value.contiguous()
    return value


def _prologue(name, tensors, eps, unit_offset, interleaved, mrope_section, mrope_interleaved,
              v_norm, kv_cache_dtype, k_scale, v_scale):
    """The op call of both prologue functions (op `name`, its ten leading arguments)."""
    if type(eps) is not float:
        eps = check_eps(eps)
    if (unit_offset is False and interleaved is False and mrope_section is None and
            mrope_interleaved is False and v_norm is False):
        # The common serving calls, with no keyword to pass on but the caches' format (torch
        # matches each keyword given by name, and Python packs them at each hop: 1.5 us of a
        # 10 us decode call with eight).
        if kv_cache_dtype == "auto" and k_scale is None and v_scale is None:
            return getattr(ops, name)(*tensors, eps)
        return getattr(ops, name)(*tensors, eps, kv_cache_dtype=kv_cache_dtype, k_scale=k_scale,
                                  v_scale=v_scale)
    if not ((unit_offset is True or unit_offset is False) and (interleaved is True or interleaved is False)
            and (mrope_interleaved is True or mrope_interleaved is False)
            and (v_norm is True or v_norm is False)):  # (the test: 50 ns; the call 250)
        check_flags("unit_offset interleaved mrope_interleaved v_norm", unit_offset, interleaved,
                    mrope_interleaved, v_norm)
    return getattr(ops, name)(*tensors, eps, unit_offset=unit_offset, interleaved=interleaved,
                              mrope_section=mrope_section_arg(mrope_section, mrope_interleaved),
                              mrope_interleaved=mrope_interleaved, v_norm=v_norm,
                              kv_cache_dtype=kv_cache_dtype, k_scale=k_scale, v_scale=v_scale)
