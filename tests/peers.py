"""Independent eager implementations of the peers' RoPE entry points, with the peers' own names,
arguments and layouts, written here from their documented semantics (and, where a peer publishes
one, its pure-PyTorch reference formula): transformers, flash-attn, vLLM, FlashInfer, SGLang.
tests/test_compat.py checks rope_ext.compat against these; the benchmark times them as the eager
baselines. Nothing here imports rope_ext or the peers.

Arithmetic: transformers computes in its inputs' dtype, as its modeling code does; the kernels
(flash-attn, vLLM, FlashInfer, SGLang) compute in float32 and store the input dtype, so these do
too, or in float64 when given float64 (the tests' references).
"""

import math

import torch


def _acc(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _pairs(x, neox):
    """(first, second) members of each pair of x: halves (GPT-NeoX) or even/odd (GPT-J)."""
    if neox:
        half = x.shape[-1] // 2
        return x[..., :half], x[..., half:]
    return x[..., 0::2], x[..., 1::2]


def _unpairs(first, second, neox):
    if neox:
        return torch.cat((first, second), dim=-1)
    return torch.stack((first, second), dim=-1).flatten(-2)


def kernel_rotate(x, cos, sin, neox):
    """x (..., rot) rotated by cos, sin (..., rot/2) broadcast, as the kernels do it: float32
    (float64) arithmetic, one rounding to x's dtype."""
    acc = _acc(x.dtype)
    a, b = _pairs(x.to(acc), neox)
    c, s = cos.to(acc), sin.to(acc)
    return _unpairs(a * c - b * s, b * c + a * s, neox).to(x.dtype)


# ---- transformers (modeling_llama / modeling_gpt_neox / modeling_gptj / modeling_qwen2_vl) ----

def hf_rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def hf_apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """rotate_half RoPE on the first cos.size(-1) dims (all of them for Llama-style models,
    a prefix for GPT-NeoX / Phi-3 partial rotary), the rest passed through."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    rot = cos.shape[-1]
    out = []
    for t in (q, k):
        t_rot, t_pass = t[..., :rot], t[..., rot:]
        out.append(torch.cat(((t_rot * cos) + (hf_rotate_half(t_rot) * sin), t_pass), dim=-1))
    return tuple(out)


def hf_cos_sin(position_ids, dim, base=10000.0, dtype=torch.float32, attention_scaling=1.0):
    """cos, sin (batch, seq, dim) as transformers' default rotary module makes them: float32
    angles of cat(freqs, freqs), cast to the activations' dtype."""
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    freqs = position_ids[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * attention_scaling).to(dtype), (emb.sin() * attention_scaling).to(dtype)


def hf_rotate_every_two(x):
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def hf_gptj_apply_rotary_pos_emb(tensor, sin, cos):
    """GPT-J: tensor (batch, seq, heads, rotary_dim), sin/cos (batch, seq, rotary_dim/2) repeated
    per pair."""
    sin = torch.repeat_interleave(sin[:, :, None, :], 2, 3)
    cos = torch.repeat_interleave(cos[:, :, None, :], 2, 3)
    return (tensor * cos) + (hf_rotate_every_two(tensor) * sin)


def hf_glm_apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    """GLM / GLM-4 / Helium: interleaved pairs of the first cos.size(-1) dims, rotated by the
    tables' first half repeated per pair; the rest passed through."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    cos = cos[..., : cos.shape[-1] // 2].repeat_interleave(2, dim=-1)
    sin = sin[..., : sin.shape[-1] // 2].repeat_interleave(2, dim=-1)
    rot = cos.shape[-1]
    return tuple(torch.cat((t[..., :rot] * cos + hf_rotate_every_two(t[..., :rot]) * sin,
                            t[..., rot:]), dim=-1) for t in (q, k))


def hf_glm4v_apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    """GLM-4.1V (transformers 5): interleaved pairs of the first cos.size(-1) dims, the tables
    read at each element's own place (each angle twice, side by side); the rest passed through."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    rot = cos.shape[-1]
    return tuple(torch.cat((t[..., :rot] * cos + hf_rotate_every_two(t[..., :rot]) * sin,
                            t[..., rot:]), dim=-1) for t in (q, k))


def hf_glm4v_apply_multimodal_rotary_pos_emb(q, k, cos, sin, mrope_section, unsqueeze_dim=1):
    """GLM-4.1V (transformers 4): Qwen2-VL's choice of sections of cos/sin (3, batch, seq,
    rotary_dim), then GLM's rotation of the first rotary_dim dims."""
    chunks = list(mrope_section) * 2

    def pick(t):
        return torch.cat([m[i % 3] for i, m in enumerate(t.split(chunks, dim=-1))], dim=-1)

    return hf_glm_apply_rotary_pos_emb(q, k, pick(cos), pick(sin), unsqueeze_dim)


def hf_ernie_apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    """ERNIE 4.5: GLM's rotation of the whole head from q.float() and k.float(), in q's dtype."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    cos = cos[..., : cos.shape[-1] // 2].repeat_interleave(2, dim=-1)
    sin = sin[..., : sin.shape[-1] // 2].repeat_interleave(2, dim=-1)
    return tuple((t.float() * cos + hf_rotate_every_two(t).float() * sin).to(q.dtype)
                 for t in (q, k))


def hf_cohere_apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    """Cohere: interleaved pairs of the whole head, the tables read at each element's own place
    (each angle twice, side by side); from q.float() and k.float(), in q's dtype."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return tuple((t.float() * cos + hf_rotate_every_two(t.float()) * sin).to(q.dtype)
                 for t in (q, k))


def hf_deepseek_apply_rotary_pos_emb_interleave(q, k, cos, sin, unsqueeze_dim=1):
    """DeepSeek-V3 (transformers 4): q and k de-interleaved (pairs (2i, 2i+1) to halves), then
    Llama's rotate_half RoPE of the whole head."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    out = []
    for t in (q, k):
        t = t.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)
        out.append(t * cos + hf_rotate_half(t) * sin)
    return tuple(out)


def hf_phimoe4_apply_rotary_pos_emb(q, k, cos, sin, position_ids, unsqueeze_dim=1):
    """transformers 4's PhiMoE: the (positions, head_dim) tables gathered at position_ids."""
    cos, sin = cos[position_ids].unsqueeze(unsqueeze_dim), sin[position_ids].unsqueeze(unsqueeze_dim)
    half = q.shape[-1] // 2
    rotate_half = lambda x: torch.cat((-x[..., half:], x[..., :half]), -1)  # noqa: E731
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def hf_nanochat_apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    """NanoChat (transformers 5): rotate_half with flipped signs (x2, -x1)."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    half = q.shape[-1] // 2
    rotate_half = lambda x: torch.cat((x[..., half:], -x[..., :half]), -1)  # noqa: E731
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def hf_gpt_oss_apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    """GPT-OSS: rotate_half pairs, cos and sin of one entry per pair (head_dim / 2 wide)."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    out = []
    for t in (q, k):
        a, b = torch.chunk(t, 2, dim=-1)
        out.append(torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1))
    return tuple(out)


def hf_apply_multimodal_rotary_pos_emb(q, k, cos, sin, mrope_section, unsqueeze_dim=1):
    """Qwen2-VL: cos/sin (3, batch, seq, head_dim); chunk i of the doubled sections takes
    component i % 3."""
    chunks = list(mrope_section) * 2

    def pick(t):
        return torch.cat([m[i % 3] for i, m in enumerate(t.split(chunks, dim=-1))], dim=-1)

    cos, sin = pick(cos).unsqueeze(unsqueeze_dim), pick(sin).unsqueeze(unsqueeze_dim)
    return (q * cos) + (hf_rotate_half(q) * sin), (k * cos) + (hf_rotate_half(k) * sin)


def hf_apply_rotary_pos_emb_vision(q, k, cos, sin):
    """Qwen2-VL vision tower: float32 arithmetic, results in the inputs' dtypes."""
    cos, sin = cos.unsqueeze(-2).float(), sin.unsqueeze(-2).float()
    qf, kf = q.float(), k.float()
    q_embed = (qf * cos) + (hf_rotate_half(qf) * sin)
    k_embed = (kf * cos) + (hf_rotate_half(kf) * sin)
    return q_embed.to(q.dtype), k_embed.to(k.dtype)


def hf_deepseek_v4_apply_rotary_pos_emb(x, cos, sin, unsqueeze_dim=1):
    """DeepSeek-V4: the last 2 * cos.size(-1) dims of x, pairs (2i, 2i+1), rotated by tables of
    one entry per pair; the dims before them passed through."""
    cos = cos.repeat_interleave(2, dim=-1).unsqueeze(unsqueeze_dim)
    sin = sin.repeat_interleave(2, dim=-1).unsqueeze(unsqueeze_dim)
    nope, rope = x[..., :x.shape[-1] - cos.shape[-1]], x[..., x.shape[-1] - cos.shape[-1]:]
    pairs = rope.unflatten(-1, (-1, 2))
    turned = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
    return torch.cat((nope, rope * cos + turned * sin), dim=-1)


def hf_dinov3_apply_rotary_pos_emb(q, k, cos, sin):
    """DINOv3's ViT: the last cos.size(-2) tokens (the patches) rotated, the tokens before them
    (class and register tokens) passed through."""
    n = sin.shape[-2]
    out = []
    for x in (q, k):
        prefix, patches = x.split((x.shape[-2] - n, n), dim=-2)
        out.append(torch.cat((prefix, patches * cos + hf_rotate_half(patches) * sin), dim=-2))
    return tuple(out)


def hf_complex_apply_rotary_emb(xq, xk, freqs_cis):
    """Llama 4's and DeepSeek-V2's apply_rotary_emb with the table already placed over the heads:
    pairs (2i, 2i+1) as complex numbers times freqs_cis, in the inputs' precision (complex128 for
    float64)."""
    def rotated(x):
        z = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2).contiguous())
        return torch.view_as_real(z * freqs_cis).flatten(-2)
    return rotated(xq), rotated(xk)


# ---- flash-attn (flash_attn.layers.rotary) ----

def fa_apply_rotary_emb_torch(x, cos, sin, interleaved=False):
    """flash-attn's published reference: x (batch, seqlen, nheads, headdim), cos/sin (seqlen,
    rotary_dim/2) or (batch, seqlen, rotary_dim/2), repeated to full width per layout."""
    ro_dim = cos.shape[-1] * 2
    if interleaved:
        cos = torch.repeat_interleave(cos, 2, dim=-1).unsqueeze(-2)
        sin = torch.repeat_interleave(sin, 2, dim=-1).unsqueeze(-2)
        rotated = hf_rotate_every_two(x[..., :ro_dim])
    else:
        cos = torch.cat((cos, cos), dim=-1).unsqueeze(-2)
        sin = torch.cat((sin, sin), dim=-1).unsqueeze(-2)
        rotated = hf_rotate_half(x[..., :ro_dim])
    return torch.cat((x[..., :ro_dim] * cos + rotated * sin, x[..., ro_dim:]), dim=-1)


def _fa_rotate_rows(dst, src, cos, sin, positions, interleaved):
    """dst[i] = src[i] with its first rotary_dim dims rotated by table row positions[i]; rows
    past the table keep cos 1 / sin 0, as flash-attn's kernel masks them."""
    inside = positions < cos.shape[0]
    rows = positions.clamp(0, cos.shape[0] - 1)
    c = torch.where(inside[:, None], cos[rows], torch.ones_like(cos[rows]))
    s = torch.where(inside[:, None], sin[rows], torch.zeros_like(sin[rows]))
    r = 2 * cos.shape[1]
    dst[:, :, :r] = kernel_rotate(src[:, :, :r], c[:, None, :], s[:, None, :], not interleaved)
    dst[:, :, r:] = src[:, :, r:]


def fa_apply_rotary_emb(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0,
                        cu_seqlens=None, max_seqlen=None):
    """flash-attn's apply_rotary_emb: per sequence b, token s at position s + offset_b; with
    cu_seqlens only the first max_seqlen tokens of each sequence. Returns x when inplace."""
    src = x.clone()
    out = x if inplace else x.clone()
    if cu_seqlens is None:
        batch, seqlen = x.shape[:2]
        for b in range(batch):
            off = int(seqlen_offsets[b]) if torch.is_tensor(seqlen_offsets) else seqlen_offsets
            positions = torch.arange(seqlen, device=x.device) + off
            _fa_rotate_rows(out[b], src[b], cos, sin, positions, interleaved)
    else:
        assert max_seqlen is not None
        for b in range(cu_seqlens.shape[0] - 1):
            start, end = int(cu_seqlens[b]), int(cu_seqlens[b + 1])
            end = min(end, start + max_seqlen)
            off = int(seqlen_offsets[b]) if torch.is_tensor(seqlen_offsets) else seqlen_offsets
            positions = torch.arange(end - start, device=x.device) + off
            _fa_rotate_rows(out[start:end], src[start:end], cos, sin, positions, interleaved)
    return out


def fa_apply_rotary_emb_qkv_(qkv, cos, sin, cos_k=None, sin_k=None, interleaved=False,
                             seqlen_offsets=0, num_heads_q=None):
    """flash-attn's apply_rotary_emb_qkv_: Q and K of qkv rotated in place; returns qkv."""
    cos_k = cos if cos_k is None else cos_k
    sin_k = sin if sin_k is None else sin_k
    if qkv.dim() == 5:
        q, k = qkv[:, :, 0], qkv[:, :, 1]
    else:
        hk = (qkv.shape[2] - num_heads_q) // 2
        q, k = qkv[:, :, :num_heads_q], qkv[:, :, num_heads_q : num_heads_q + hk]
    fa_apply_rotary_emb(q, cos, sin, interleaved, True, seqlen_offsets)
    fa_apply_rotary_emb(k, cos_k, sin_k, interleaved, True, seqlen_offsets)
    return qkv


def fa_apply_rotary_emb_kv_(kv, cos, sin, interleaved=False, seqlen_offsets=0):
    fa_apply_rotary_emb(kv[:, :, 0], cos, sin, interleaved, True, seqlen_offsets)
    return kv


# ---- vLLM (_custom_ops.rotary_embedding, the in-place kernel) ----

def vllm_rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox,
                          rope_dim_offset=0, inverse=False):
    """In place, like vLLM's kernel (0.33): dims [rope_dim_offset, rope_dim_offset + rot_dim) of
    every head rotated by cos_sin_cache[positions] (cos | sin), by the negative angle (sin
    negated) with inverse; query/key flat (tokens, H * head_size) or (tokens, H, head_size).
    Returns None."""
    rot = cos_sin_cache.shape[1]
    rows = cos_sin_cache[positions.flatten().long()]
    cos, sin = rows[:, None, : rot // 2], rows[:, None, rot // 2 :]
    if inverse:
        sin = -sin
    lo, hi = rope_dim_offset, rope_dim_offset + rot
    for t in (query, key):
        if t is None:
            continue
        try:  # rotated where it lies (a benchmark times this peer: no extra pass)
            heads, copied = t.view(positions.numel(), -1, head_size), False
        except RuntimeError:  # strides no view can take: through a copy
            heads, copied = t.reshape(positions.numel(), -1, head_size), True
        heads[..., lo:hi] = kernel_rotate(heads[..., lo:hi], cos, sin, is_neox)
        if copied:
            t.copy_(heads.reshape(t.shape))


# ---- FlashInfer (flashinfer.rope) ----

def flashinfer_frequencies(rotary_dim, rope_scale=1.0, rope_theta=1e4, low_freq_factor=None,
                           high_freq_factor=None, old_context_len=None):
    """(rotary_dim/2,) float32, as FlashInfer's kernels compute them: powf(1/theta, 2i/rotary_dim)
    times 1/rope_scale; Llama 3.1 blends scaled and unscaled by the clamped smooth factor."""
    f32 = torch.float32
    rcp_theta = torch.tensor(1.0, dtype=f32) / torch.tensor(rope_theta, dtype=f32)
    rcp_scale = torch.tensor(1.0, dtype=f32) / torch.tensor(rope_scale, dtype=f32)
    i = torch.arange(rotary_dim // 2, dtype=f32)
    freq = rcp_theta ** ((2 * i) / torch.tensor(float(rotary_dim), dtype=f32))
    if low_freq_factor is None:
        return freq * rcp_scale
    # the host function takes the three as C floats, then forms smooth_a in double
    old, high, low = (float(torch.tensor(float(v), dtype=f32))
                      for v in (old_context_len, high_freq_factor, low_freq_factor))
    smooth_a = torch.tensor(old / (2 * math.pi * high - 2 * math.pi * low), dtype=f32)
    smooth_b = -1.0 / (torch.tensor(high_freq_factor, dtype=f32)
                       / torch.tensor(low_freq_factor, dtype=f32) - 1.0)
    smooth = torch.clamp(freq * smooth_a + smooth_b, 0.0, 1.0)
    return (1 - smooth) * (freq * rcp_scale) + smooth * freq


def _fi_rotate(q, k, positions, freq, rotary_dim, interleave, q_out, k_out, rows=None):
    angles = positions.to(torch.float32)[:, None] * freq  # float32 angles, as the kernels
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    for src, dst in ((q, q_out), (k, k_out)):
        new = src.clone()
        sel = slice(None) if rows is None else rows
        new[sel, :, :rotary_dim] = kernel_rotate(src[sel, :, :rotary_dim], cos[sel], sin[sel],
                                                 not interleave)
        dst.copy_(new)


def _fi_ragged_positions(indptr, offsets):
    positions, rows = [], []
    for b in range(indptr.shape[0] - 1):
        start, end = int(indptr[b]), int(indptr[b + 1])
        positions += [int(offsets[b]) + i for i in range(end - start)]
        rows += list(range(start, end))
    return torch.tensor(positions, dtype=torch.int64), torch.tensor(rows, dtype=torch.int64)


def _fi_llama31(low_freq_factor, high_freq_factor, old_context_len):
    return dict(low_freq_factor=low_freq_factor, high_freq_factor=high_freq_factor,
                old_context_len=old_context_len)


def _fi_ragged(q, k, indptr, offsets, rotary_dim, interleave, rope_scale, rope_theta, q_out, k_out,
               llama31=None):
    rotary_dim = q.shape[-1] if rotary_dim is None else rotary_dim
    freq = flashinfer_frequencies(rotary_dim, rope_scale, rope_theta, **(llama31 or {}))
    token_positions, rows = _fi_ragged_positions(indptr, offsets)
    positions = torch.zeros(q.shape[0], dtype=torch.int64)
    positions[rows] = token_positions
    _fi_rotate(q, k, positions, freq, rotary_dim, interleave, q_out, k_out, rows)


def flashinfer_apply_rope_inplace(q, k, indptr, offsets, rotary_dim=None, interleave=False,
                                  rope_scale=1, rope_theta=1e4):
    _fi_ragged(q, k, indptr, offsets, rotary_dim, interleave, rope_scale, rope_theta, q, k)


def flashinfer_apply_rope(q, k, indptr, offsets, rotary_dim=None, interleave=False, rope_scale=1,
                          rope_theta=1e4):
    q_rope, k_rope = q.clone(), k.clone()
    _fi_ragged(q, k, indptr, offsets, rotary_dim, interleave, rope_scale, rope_theta, q_rope, k_rope)
    return q_rope, k_rope


def flashinfer_apply_rope_pos_ids_inplace(q, k, pos_ids, rotary_dim=None, interleave=False,
                                          rope_scale=1, rope_theta=1e4):
    rotary_dim = q.shape[-1] if rotary_dim is None else rotary_dim
    freq = flashinfer_frequencies(rotary_dim, rope_scale, rope_theta)
    _fi_rotate(q, k, pos_ids, freq, rotary_dim, interleave, q, k)


def flashinfer_apply_rope_pos_ids(q, k, pos_ids, rotary_dim=None, interleave=False, rope_scale=1,
                                  rope_theta=1e4):
    q_rope, k_rope = q.clone(), k.clone()
    flashinfer_apply_rope_pos_ids_inplace(q_rope, k_rope, pos_ids, rotary_dim, interleave,
                                          rope_scale, rope_theta)
    return q_rope, k_rope


def flashinfer_apply_llama31_rope_inplace(q, k, indptr, offsets, rotary_dim=None, interleave=False,
                                          rope_scale=8, rope_theta=5e5, low_freq_factor=1,
                                          high_freq_factor=4, old_context_len=8192):
    _fi_ragged(q, k, indptr, offsets, rotary_dim, interleave, rope_scale, rope_theta, q, k,
               _fi_llama31(low_freq_factor, high_freq_factor, old_context_len))


def flashinfer_apply_llama31_rope_pos_ids_inplace(q, k, pos_ids, rotary_dim=None, interleave=False,
                                                  rope_scale=8, rope_theta=5e5, low_freq_factor=1,
                                                  high_freq_factor=4, old_context_len=8192):
    rotary_dim = q.shape[-1] if rotary_dim is None else rotary_dim
    freq = flashinfer_frequencies(rotary_dim, rope_scale, rope_theta,
                                  **_fi_llama31(low_freq_factor, high_freq_factor, old_context_len))
    _fi_rotate(q, k, pos_ids, freq, rotary_dim, interleave, q, k)


def flashinfer_apply_rope_with_cos_sin_cache_inplace(positions, query, key, head_size,
                                                     cos_sin_cache, is_neox=True):
    if cos_sin_cache.dtype != torch.float32:
        raise ValueError("cos_sin_cache should be float32")
    vllm_rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox)


def flashinfer_apply_rope_with_cos_sin_cache(positions, query, key, head_size, cos_sin_cache,
                                             is_neox=True):
    query_out, key_out = query.clone(), key.clone()
    flashinfer_apply_rope_with_cos_sin_cache_inplace(positions, query_out, key_out, head_size,
                                                     cos_sin_cache, is_neox)
    return query_out, key_out


# ---- SGLang (sgl_kernel.apply_rope_with_cos_sin_cache_inplace) ----

def sglang_apply_rope_with_cos_sin_cache_inplace(positions, query, key, head_size, cos_sin_cache,
                                                 is_neox=True, fused_set_kv_buffer_arg=None):
    """Rotates query and key in place; with fused_set_kv_buffer_arg also stores the rotated key and
    the value at rows cache_loc of k_buffer / v_buffer (num_slots, H * head_size or H, head_size).
    fused_set_kv_buffer_arg: SGLang's record of those fields (value, k_buffer, v_buffer, k_scale,
    v_scale, cache_loc), read by name; the callers pass rope_ext.compat.sglang's copy of it."""
    if cos_sin_cache.dtype != torch.float32:
        raise ValueError("cos_sin_cache should be float32")
    vllm_rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox)
    a = fused_set_kv_buffer_arg
    if a is not None:
        assert a.k_scale is None and a.v_scale is None
        n = positions.shape[0]
        kb = a.k_buffer.view(a.k_buffer.shape[0], -1)
        vb = a.v_buffer.view(a.v_buffer.shape[0], -1)
        kb[a.cache_loc] = key.reshape(n, -1).to(kb.dtype)
        vb[a.cache_loc] = a.value.reshape(n, -1).to(vb.dtype)
