"""Context-extension scalings (docs/math.md "Scalings"): how a `rope_scaling` dict changes the inverse
frequencies w_i and scales cos/sin.

`rope_parameters` returns (inv_freq, attention_factor): inv_freq is float64 of length
rotary_dim/2 and attention_factor a Python float that the tables fold into cos and sin (scaling
q and k by a each scales the attention logits by a^2, as the YaRN and LongRoPE papers intend).
Every formula is evaluated in float64. The dicts are spelled as model configs spell them (the
type in `rope_type`, or the older `type`); a key this module does not know is an error naming
it, never silently dropped. Filling in what a config leaves out (original lengths, factors)
is rope_ext.config's job: here every key the formula needs must be present.
"""

import math

import torch

from ._args import check_positive
from ._compiling import compiling

# Older names of a type. "mrope" (Qwen2-VL configs) does default RoPE: it only changes how
# positions pick cache rows (rope_ext.apply_mrope_). "su" is what early Phi-3 configs call longrope.
_ALIASES = {"su": "longrope", "mrope": "default"}

# Keys every dict may carry: the type, and the MRoPE layout (read by RotaryEmbedding, not here).
_COMMON_KEYS = frozenset({"rope_type", "type", "mrope_section", "mrope_interleaved"})
_YARN_KEYS = {"factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
              "mscale_all_dim", "attn_factor"}
# The keys each type understands, beyond _COMMON_KEYS.
_KEYS = {
    "default": frozenset(),
    "linear": frozenset({"factor"}),
    # original_max_position_embeddings: the length past which the base grows.
    "dynamic": frozenset({"factor", "original_max_position_embeddings"}),
    # yarn as transformers computes it, plus serving engines' attn_factor (a multiplier on the
    # attention factor).
    "yarn": frozenset(_YARN_KEYS | {"attention_factor", "truncate"}),
    # DeepSeek's YaRN as serving engines name it: mscale / mscale_all_dim default to 1 and 0.
    "deepseek_yarn": frozenset(_YARN_KEYS),
    "llama3": frozenset({"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}),
    # short_mscale / long_mscale (Phi-3.5-MoE) replace the attention factor of each set.
    "longrope": frozenset({"short_factor", "long_factor", "factor", "original_max_position_embeddings",
                           "attention_factor", "short_mscale", "long_mscale"}),
    # Gemma 4's global layers: the table spans the whole head (rotary_dim = head_dim); the first
    # partial_rotary_factor of its pairs rotate with exponents over head_dim, the rest not at all.
    "proportional": frozenset({"factor", "partial_rotary_factor"}),
}


def _fail(msg):
    raise ValueError(f"cos_sin_cache: {msg}")


def _canonical_type(name):
    """The type a `rope_type` string names (aliases resolved); None if unknown."""
    if not isinstance(name, str):
        return None
    name = _ALIASES.get(name, name)
    return name if name in _KEYS else None


def scaling_type(scaling):
    """The scaling type named by a rope_scaling dict ("default" for None), after checking that the
    dict names one known type and holds only keys that type understands."""
    if scaling is None:
        return "default"
    if not isinstance(scaling, dict):
        _fail(f"scaling must be a dict (a config's rope_scaling) or None, got {type(scaling).__name__}")
    names = [scaling[k] for k in ("rope_type", "type") if scaling.get(k) is not None]
    if not names:
        _fail(f"scaling must name its type under 'rope_type' (or the older 'type'), got keys {sorted(scaling)}")
    kinds = [_canonical_type(n) for n in names]
    for name, kind in zip(names, kinds):
        if kind is None:
            known = ", ".join(sorted((*_KEYS, *_ALIASES)))
            _fail(f"unknown rope scaling type {name!r}; supported: {known}")
    if len(set(kinds)) > 1:
        _fail(f"scaling names two types, rope_type={names[0]!r} and type={names[1]!r}; keep one")
    kind = kinds[0]
    unknown = sorted(set(scaling) - _COMMON_KEYS - _KEYS[kind])
    if unknown:
        allowed = ", ".join(sorted(_KEYS[kind] | _COMMON_KEYS))
        _fail(f"rope scaling type {kind!r} does not understand the key {unknown[0]!r} "
              f"(keys it understands: {allowed})")
    return kind


def _number(scaling, key, kind, default=None, positive=True):
    value = scaling.get(key)
    if value is None:  # configs spell "not set" as a missing key or as null
        value = default
    if value is None:
        _fail(f"rope scaling type {kind!r} needs the key {key!r}")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        _fail(f"rope scaling {kind!r}: {key} must be a finite number, got {value!r}")
    if positive and not value > 0:
        _fail(f"rope scaling {kind!r}: {key} must be > 0, got {value!r}")
    return float(value)


def original_length(scaling):
    """original_max_position_embeddings of a dynamic/longrope dict, as an int."""
    kind = scaling_type(scaling)
    value = _number(scaling, "original_max_position_embeddings", kind)
    if value != int(value):
        _fail(f"rope scaling {kind!r}: original_max_position_embeddings must be an integer, got {value!r}")
    return int(value)


def rotated_dims(rotary_dim):
    """The dims a rotary_dim of d rotates, the width of its table: d, or d + 1 for an odd d.
    transformers' rule, which every rope_ext entry follows: from d = int(head_dim *
    partial_rotary_factor) it builds ceil(d/2) frequencies base^(-2i/d) (the d of the exponent
    stays odd) and rotates twice as many dims."""
    return rotary_dim + rotary_dim % 2


def default_inv_freq(rotary_dim, base, device=None):
    """w_i = base^(-2i/rotary_dim), float64. base: a number, or a tensor of one element used
    where it lies (the module's dynamic-NTK base, computed on the device: float() would sync)."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float64, device=device) / rotary_dim
    if isinstance(base, torch.Tensor):
        base = base.to(device=exponents.device, dtype=torch.float64)
    else:
        base = float(base)
    return 1.0 / (base ** exponents)


def dynamic_base(base, factor, original, seq_len, rotary_dim):
    """The NTK-aware base for a sequence of seq_len > original positions (floats or float64
    tensors alike, so the module can evaluate it on the device)."""
    return base * ((factor * seq_len / original) - (factor - 1)) ** (rotary_dim / (rotary_dim - 2))


def dynamic_parameters(scaling, rotary_dim):
    """(factor, original) of a dynamic dict, checked."""
    factor = _number(scaling, "factor", "dynamic")
    original = original_length(scaling)
    if rotary_dim <= 2:
        _fail(f"rope scaling 'dynamic' needs rotary_dim > 2, got {rotary_dim}")
    return factor, original


def _linear(scaling, rotary_dim, base, seq_len, device):
    factor = _number(scaling, "factor", "linear")
    return default_inv_freq(rotary_dim, base, device) / factor, 1.0


def _dynamic(scaling, rotary_dim, base, seq_len, device):
    factor, original = dynamic_parameters(scaling, rotary_dim)
    if seq_len > original:  # only past the trained length; below it the plain frequencies
        base = dynamic_base(base, factor, original, seq_len, rotary_dim)
    return default_inv_freq(rotary_dim, base, device), 1.0


def _yarn_mscale(scale, mscale=1.0):
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_attention(scaling, kind, factor):
    attn_factor = _number(scaling, "attn_factor", kind, default=1.0)
    if kind == "deepseek_yarn":
        mscale = _number(scaling, "mscale", kind, default=1.0, positive=False)
        mscale_all_dim = _number(scaling, "mscale_all_dim", kind, default=0.0, positive=False)
        return _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim) * attn_factor
    if scaling.get("attention_factor") is not None:
        if scaling.get("attn_factor") is not None:
            _fail("rope scaling 'yarn': give attention_factor or attn_factor, not both")
        return _number(scaling, "attention_factor", kind)
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:  # DeepSeek: the ratio, so equal values cancel
        mscale = _number(scaling, "mscale", kind)
        mscale_all_dim = _number(scaling, "mscale_all_dim", kind)
        return _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim) * attn_factor
    # One of the two alone does not enter the yarn formula (as in transformers).
    return _yarn_mscale(factor) * attn_factor


def _yarn(scaling, rotary_dim, base, seq_len, device, kind="yarn"):
    factor = _number(scaling, "factor", kind)
    original = _number(scaling, "original_max_position_embeddings", kind)
    beta_fast = _number(scaling, "beta_fast", kind, default=32)
    beta_slow = _number(scaling, "beta_slow", kind, default=1)
    attention = _yarn_attention(scaling, kind, factor)
    truncate = scaling.get("truncate", True)
    if not isinstance(truncate, bool):
        _fail(f"rope scaling {kind!r}: truncate must be true or false, got {truncate!r}")

    # The dim index at which a wavelength makes `rotations` full turns over the original context.
    def correction_dim(rotations):
        return rotary_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # the ramp below would divide by zero
    ramp = ((torch.arange(rotated_dims(rotary_dim) // 2, dtype=torch.float64, device=device) - low) / (high - low)).clamp(0, 1)
    extrapolated = default_inv_freq(rotary_dim, base, device)
    interpolated = extrapolated / factor
    # ramp 0 (high-frequency dims, many turns): keep w_i; ramp 1 (low frequency): w_i / factor.
    return interpolated * ramp + extrapolated * (1 - ramp), float(attention)


def _deepseek_yarn(scaling, rotary_dim, base, seq_len, device):
    return _yarn(scaling, rotary_dim, base, seq_len, device, kind="deepseek_yarn")


def llama3_parameters(scaling, prefix="cos_sin_cache: rope scaling 'llama3'", ordered=True):
    """(factor, low_freq_factor, high_freq_factor, original_max_position_embeddings) of a Llama 3
    dict, each a finite number > 0 and, if `ordered`, high >= low (transformers' configs: equal
    factors, as Llama 4 Scout's, leave no band between the scaled and the unscaled frequencies:
    a step), or a ValueError naming the key after `prefix`: rope_ext.scaling's and gpt-fast's
    (whose formula gives a step function for high <= low: not `ordered`)."""
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    if not isinstance(scaling, dict):
        raise ValueError(f"{prefix} must be a dict with the keys {', '.join(keys)}, got "
                         f"{type(scaling).__name__}")
    for key in keys:
        if scaling.get(key) is None:
            raise ValueError(f"{prefix} needs the key {key!r}")
    factor, low, high, original = (check_positive(scaling[key], f"{prefix}: {key}") for key in keys)
    if ordered and not high >= low:
        raise ValueError(f"{prefix}: high_freq_factor ({high}) must be >= low_freq_factor ({low})")
    return factor, low, high, original


def _llama3(scaling, rotary_dim, base, seq_len, device):
    factor, low_ff, high_ff, original = llama3_parameters(scaling)
    inv_freq = default_inv_freq(rotary_dim, base, device)
    wavelen = 2 * math.pi / inv_freq
    # (equal factors: no band to blend in; a wavelength exactly at the step keeps its frequency)
    smooth = (original / wavelen - low_ff) / (high_ff - low_ff) if high_ff > low_ff else 1.0
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > original / low_ff, inv_freq / factor, blended)
    return torch.where(wavelen < original / high_ff, inv_freq, out), 1.0


def _proportional(scaling, rotary_dim, base, seq_len, device):
    """w_i = base^(-2i / head_dim) / factor for the first int(partial * head_dim / 2) pairs and 0
    (cos 1, sin 0: the pair passes through) for the rest; rotary_dim is the head dim here."""
    factor = _number(scaling, "factor", "proportional", default=1.0)
    partial = _number(scaling, "partial_rotary_factor", "proportional", default=1.0)
    if partial > 1:
        _fail(f"rope scaling 'proportional': partial_rotary_factor must be in (0, 1], got {partial!r}")
    if rotary_dim % 2:  # (its table spans the head: no odd dim's extra pair, as transformers builds it)
        _fail(f"rope scaling 'proportional': rotary_dim (the head dim) must be even, got {rotary_dim}")
    angles = int(partial * rotary_dim // 2)  # as transformers rounds it
    inv_freq = torch.zeros(rotary_dim // 2, dtype=torch.float64, device=device)
    i = torch.arange(angles, dtype=torch.float64, device=device)
    inv_freq[:angles] = float(base) ** (-2.0 * i / rotary_dim)
    return inv_freq / factor, 1.0


def _factor_list(scaling, key, rotary_dim):
    values = scaling.get(key)
    if values is None:
        _fail(f"rope scaling type 'longrope' needs the key {key!r}")
    half = rotated_dims(rotary_dim) // 2
    if not isinstance(values, (list, tuple)) or len(values) != half:
        n = len(values) if isinstance(values, (list, tuple)) else type(values).__name__
        _fail(f"rope scaling 'longrope': {key} must be a list of rotary_dim/2 = {half} numbers, got {n}")
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0
               for v in values):
        _fail(f"rope scaling 'longrope': {key} must hold numbers > 0")
    return values


def _longrope(scaling, rotary_dim, base, seq_len, device, max_position):
    short = _factor_list(scaling, "short_factor", rotary_dim)
    long_ = _factor_list(scaling, "long_factor", rotary_dim)
    original = original_length(scaling)
    # Without `factor`, the extension ratio is the table's length over the trained one (Phi-3).
    factor = _number(scaling, "factor", "longrope", default=max_position / original)
    has_short, has_long = (scaling.get(k) is not None for k in ("short_mscale", "long_mscale"))
    if has_short != has_long:
        _fail("rope scaling 'longrope': short_mscale and long_mscale go together")
    if has_short and scaling.get("attention_factor") is not None:
        _fail("rope scaling 'longrope': give attention_factor or short_mscale/long_mscale, not both")
    use_long = seq_len > original
    if has_short:
        attention = _number(scaling, "long_mscale" if use_long else "short_mscale", "longrope")
    elif scaling.get("attention_factor") is not None:
        attention = _number(scaling, "attention_factor", "longrope")
    else:
        attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    ext = torch.tensor(long_ if use_long else short, dtype=torch.float64, device=device)
    return default_inv_freq(rotary_dim, base, device) / ext, float(attention)


_HANDLERS = {
    "linear": _linear,
    "dynamic": _dynamic,
    "yarn": _yarn,
    "deepseek_yarn": _deepseek_yarn,
    "llama3": _llama3,
    "proportional": _proportional,
}


def rope_parameters(scaling, rotary_dim, base, max_position, seq_len=None, device=None):
    """(inv_freq float64 [rotary_dim/2], attention_factor) for a rope_scaling dict (or None).

    seq_len: the sequence length served (default max_position); `dynamic` and `longrope`
    depend on it.
    """
    kind = scaling_type(scaling)
    seq_len = max_position if seq_len is None else seq_len
    if kind == "default":
        return default_inv_freq(rotary_dim, base, device), 1.0
    try:
        if kind == "longrope":
            inv_freq, attention = _longrope(scaling, rotary_dim, float(base), seq_len, device, max_position)
        else:
            inv_freq, attention = _HANDLERS[kind](scaling, rotary_dim, float(base), seq_len, device)
    except (ZeroDivisionError, OverflowError) as e:  # e.g. yarn's log(base) with base 1
        _fail(f"rope scaling {kind!r} with base {float(base)!r} and {_values(scaling)} has no table "
              f"({e})")
    # Each value finite can still give frequencies or an attention factor that are not (a factor
    # of 1e-320 divides them to inf): a table of NaN or inf would rotate silently to NaN.
    if not (_F32_TINY <= attention <= _F32_MAX) or not _finite(inv_freq):
        _fail(f"rope scaling {kind!r} with base {float(base)!r} and {_values(scaling)} gives "
              f"non-finite frequencies or an attention factor outside float32's range ({attention!r})")
    return inv_freq, attention


_F32_TINY, _F32_MAX = torch.finfo(torch.float32).tiny, torch.finfo(torch.float32).max


def _finite(t):
    """Whether every value of t is finite, where that can be read (a plain tensor off the meta
    device: not a FakeTensor or other subclass, not traced)."""
    if type(t) is not torch.Tensor or t.device.type == "meta" or compiling():
        return True
    return bool(torch.isfinite(t).all())


def _values(scaling):
    return ", ".join(f"{k}={v!r}" for k, v in sorted(scaling.items()) if k not in _COMMON_KEYS)
