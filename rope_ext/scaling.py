"""Context-extension scalings (ROPE.md section 6): how a config's `rope_scaling` dict changes the
inverse frequencies w_i and scales cos/sin.

`rope_parameters` returns (inv_freq, attention_factor): inv_freq is float64 of length
rotary_dim/2 and attention_factor a Python float that cos_sin_cache folds into cos and sin
(scaling q and k by a each scales the attention logits by a^2, as the YaRN and LongRoPE papers
intend). Every formula is evaluated in float64; the keys and their defaults follow the
`rope_scaling` dicts of model hub configs (the type in `rope_type`, or the older `type`).
"""

import math

import torch

# Types that leave the frequencies alone. "mrope" (Qwen2-VL configs) only changes how positions
# pick cache rows, see rope_ext.apply_mrope_.
_UNSCALED = ("default", "mrope")
_ALIASES = {"su": "longrope"}  # early Phi-3 configs


def _fail(msg):
    raise ValueError(f"cos_sin_cache: {msg}")


def scaling_type(scaling):
    """The scaling type named by a rope_scaling dict ("default" for None)."""
    if scaling is None:
        return "default"
    if not isinstance(scaling, dict):
        _fail(f"scaling must be a dict (a config's rope_scaling) or None, got {type(scaling).__name__}")
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind is None:
        _fail(f"scaling must name its type under 'rope_type' (or the older 'type'), got keys {sorted(scaling)}")
    kind = _ALIASES.get(kind, kind)
    if kind not in _HANDLERS and kind not in _UNSCALED:
        known = ", ".join(sorted((*_HANDLERS, *_UNSCALED)))
        _fail(f"unknown rope scaling type {kind!r}; supported: {known}")
    return kind


def _number(scaling, key, kind, default=None, positive=True):
    value = scaling.get(key, default)
    if value is None:
        _fail(f"rope scaling type {kind!r} needs the key {key!r}")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        _fail(f"rope scaling {kind!r}: {key} must be a finite number, got {value!r}")
    if positive and not value > 0:
        _fail(f"rope scaling {kind!r}: {key} must be > 0, got {value!r}")
    return float(value)


def default_inv_freq(rotary_dim, base, device=None):
    """w_i = base^(-2i/rotary_dim), float64."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float64, device=device) / rotary_dim
    return 1.0 / (float(base) ** exponents)


def _linear(scaling, rotary_dim, base, seq_len, device):
    factor = _number(scaling, "factor", "linear")
    return default_inv_freq(rotary_dim, base, device) / factor, 1.0


def _dynamic(scaling, rotary_dim, base, seq_len, device):
    factor = _number(scaling, "factor", "dynamic")
    original = _number(scaling, "original_max_position_embeddings", "dynamic")
    if seq_len > original:  # NTK-aware: stretch the base, only past the trained length
        if rotary_dim <= 2:
            _fail(f"rope scaling 'dynamic' needs rotary_dim > 2, got {rotary_dim}")
        base = base * ((factor * seq_len / original) - (factor - 1)) ** (rotary_dim / (rotary_dim - 2))
    return default_inv_freq(rotary_dim, base, device), 1.0


def _yarn_mscale(scale, mscale=1.0):
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(scaling, rotary_dim, base, seq_len, device):
    factor = _number(scaling, "factor", "yarn")
    original = _number(scaling, "original_max_position_embeddings", "yarn")
    beta_fast = _number(scaling, "beta_fast", "yarn", default=32)
    beta_slow = _number(scaling, "beta_slow", "yarn", default=1)
    attention = scaling.get("attention_factor")
    if attention is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:  # DeepSeek: the ratio, so the two may cancel
            attention = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention = _yarn_mscale(factor)
    else:
        attention = _number(scaling, "attention_factor", "yarn")

    # The dim index at which a wavelength makes `rotations` full turns over the original context.
    def correction_dim(rotations):
        return rotary_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # the ramp below would divide by zero
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float64, device=device) - low) / (high - low)).clamp(0, 1)
    extrapolated = default_inv_freq(rotary_dim, base, device)
    interpolated = extrapolated / factor
    # ramp 0 (high-frequency dims, many turns): keep w_i; ramp 1 (low frequency): w_i / factor.
    return interpolated * ramp + extrapolated * (1 - ramp), float(attention)


def _llama3(scaling, rotary_dim, base, seq_len, device):
    factor = _number(scaling, "factor", "llama3")
    low_ff = _number(scaling, "low_freq_factor", "llama3")
    high_ff = _number(scaling, "high_freq_factor", "llama3")
    original = _number(scaling, "original_max_position_embeddings", "llama3")
    if not high_ff > low_ff:
        _fail(f"rope scaling 'llama3': high_freq_factor ({high_ff}) must be > low_freq_factor ({low_ff})")
    inv_freq = default_inv_freq(rotary_dim, base, device)
    wavelen = 2 * math.pi / inv_freq
    smooth = (original / wavelen - low_ff) / (high_ff - low_ff)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > original / low_ff, inv_freq / factor, blended)
    return torch.where(wavelen < original / high_ff, inv_freq, out), 1.0


def _factor_list(scaling, key, rotary_dim):
    values = scaling.get(key)
    if values is None:
        _fail(f"rope scaling type 'longrope' needs the key {key!r}")
    if not isinstance(values, (list, tuple)) or len(values) != rotary_dim // 2:
        n = len(values) if isinstance(values, (list, tuple)) else type(values).__name__
        _fail(f"rope scaling 'longrope': {key} must be a list of rotary_dim/2 = {rotary_dim // 2} numbers, got {n}")
    return values


def _longrope(scaling, rotary_dim, base, seq_len, device, max_position):
    short = _factor_list(scaling, "short_factor", rotary_dim)
    long_ = _factor_list(scaling, "long_factor", rotary_dim)
    original = _number(scaling, "original_max_position_embeddings", "longrope")
    # Without `factor`, the extension ratio is the table's length over the trained one (Phi-3).
    factor = _number(scaling, "factor", "longrope", default=max_position / original)
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    else:
        attention = _number(scaling, "attention_factor", "longrope")
    ext = torch.tensor(long_ if seq_len > original else short, dtype=torch.float64, device=device)
    if not bool((ext > 0).all()):
        _fail("rope scaling 'longrope': short_factor and long_factor must be > 0")
    return default_inv_freq(rotary_dim, base, device) / ext, float(attention)


_HANDLERS = {
    "linear": _linear,
    "dynamic": _dynamic,
    "yarn": _yarn,
    "llama3": _llama3,
    "longrope": _longrope,
}


def rope_parameters(scaling, rotary_dim, base, max_position, seq_len=None, device=None):
    """(inv_freq float64 [rotary_dim/2], attention_factor) for a rope_scaling dict (or None).

    seq_len: the sequence length the table serves (default max_position); `dynamic` and
    `longrope` depend on it.
    """
    kind = scaling_type(scaling)
    seq_len = max_position if seq_len is None else seq_len
    if kind in _UNSCALED:
        return default_inv_freq(rotary_dim, base, device), 1.0
    if kind == "longrope":
        return _longrope(scaling, rotary_dim, base, seq_len, device, max_position)
    return _HANDLERS[kind](scaling, rotary_dim, float(base), seq_len, device)
