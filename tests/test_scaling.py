"""cos_sin_cache with rope_scaling dicts, against the published formulas.

Each scaling is re-derived here independently, element by element with `math` (the formulas as
the YaRN / Llama 3 / LongRoPE / NTK write-ups and hub model code state them), plus a few values
worked out by hand in the comments.
"""

import math

import numpy as np
import pytest
import torch

import rope_ext


def table(max_position, rotary_dim, **kw):
    return rope_ext.cos_sin_cache(max_position, rotary_dim, dtype=torch.float64, **kw).numpy()


def expected_table(inv_freq, max_position, attention=1.0):
    pos = np.arange(max_position, dtype=np.float64)[:, None]
    ang = pos * np.asarray(inv_freq, dtype=np.float64)[None, :]
    return attention * np.concatenate([np.cos(ang), np.sin(ang)], axis=1)


def plain_inv_freq(d, base):
    return [base ** (-(2 * i) / d) for i in range(d // 2)]


def inv_freq_of(tab, max_position):
    """Recovers w_i from row 1 of an unscaled-attention table: atan2(sin, cos) at pos 1."""
    half = tab.shape[1] // 2
    return np.arctan2(tab[1, half:], tab[1, :half])


# ---- hand-checked values ------------------------------------------------------------------


def test_linear_hand_values():
    # d=8, base 1e4: w = [1, .1, .01, .001]; factor 4 -> [.25, .025, .0025, .00025].
    t = table(16, 8, scaling={"rope_type": "linear", "factor": 4.0})
    np.testing.assert_allclose(inv_freq_of(t, 16), [0.25, 0.025, 0.0025, 0.00025], rtol=1e-12)
    assert t[2, 0] == pytest.approx(math.cos(0.5), abs=1e-15)
    assert t[2, 4] == pytest.approx(math.sin(0.5), abs=1e-15)


def test_dynamic_hand_values():
    # d=4, base 1e4, factor 2, original 100, seq_len 200:
    # base' = 1e4 * (2*200/100 - 1)^(4/2) = 9e4, so w = [1, 9e4^-0.5] = [1, 1/300].
    sc = {"type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 100}
    t = table(300, 4, scaling=sc, seq_len=200)
    np.testing.assert_allclose(inv_freq_of(t, 300), [1.0, 1 / 300], rtol=1e-12)
    # no change while seq_len <= original
    np.testing.assert_array_equal(table(300, 4, scaling=sc, seq_len=100), table(300, 4))
    # seq_len defaults to max_position: 400 -> base' = 1e4 * (8 - 1)^2 = 4.9e5
    np.testing.assert_allclose(inv_freq_of(table(400, 4, scaling=sc), 400), [1.0, 4.9e5 ** -0.5], rtol=1e-12)


def test_yarn_hand_values():
    # d=8, base 1e4 (w = 10^-i), original 6000, factor 4, beta 32/1:
    # low = floor(log10(6000 / (2 pi 32))) = floor(1.47) = 1, high = ceil(log10(6000 / 2 pi)) = ceil(2.98) = 3
    # ramp_i = clamp((i - 1) / 2) = [0, 0, .5, 1] -> w' = [1, .1, (.01/4 + .01)/2, .001/4]
    # attention = 0.1 ln 4 + 1.
    sc = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 6000}
    t = table(64, 8, scaling=sc)
    a = 0.1 * math.log(4) + 1
    assert t[0, 0] == pytest.approx(a, rel=1e-15)  # cos(0) * attention
    np.testing.assert_allclose(inv_freq_of(t, 64), [1, 0.1, 0.00625, 0.00025], rtol=1e-12)


def test_llama3_hand_values():
    # d=8, base 1e4: wavelengths 2 pi [1, 10, 100, 1000]; original 1000, low/high freq factors 1/4:
    # below 250 kept, above 1000 divided by 8, 628.3 blended with s = (1000/628.3 - 1)/3.
    sc = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 1000}
    s = (1000 / (200 * math.pi) - 1) / 3
    assert s == pytest.approx(0.19718, abs=1e-5)
    want = [1, 0.1, (1 - s) * 0.01 / 8 + s * 0.01, 0.001 / 8]
    np.testing.assert_allclose(inv_freq_of(table(16, 8, scaling=sc), 16), want, rtol=1e-12)


def test_longrope_hand_values():
    # d=4, base 1e4: w = [1, .01]; original 100, table of 400 -> factor 4,
    # attention sqrt(1 + ln 4 / ln 100) = sqrt(1.30103); long set since 400 > 100.
    sc = {"rope_type": "longrope", "short_factor": [1.0, 2.0], "long_factor": [3.0, 4.0],
          "original_max_position_embeddings": 100}
    t = table(400, 4, scaling=sc)
    a = math.sqrt(1.30103)
    assert t[0, 0] == pytest.approx(a, rel=1e-5)
    np.testing.assert_allclose(inv_freq_of(t, 400), [1 / 3, 0.0025], rtol=1e-12)
    short = table(400, 4, scaling=sc, seq_len=100)  # at the original length: the short set
    np.testing.assert_allclose(inv_freq_of(short, 400), [1.0, 0.005], rtol=1e-12)
    assert short[0, 0] == pytest.approx(a, rel=1e-5)


# ---- independent re-derivations over many settings ----------------------------------------


def ref_linear(d, base, f):
    return [w / f for w in plain_inv_freq(d, base)], 1.0


def ref_dynamic(d, base, f, m, seq_len):
    if seq_len > m:
        base = base * ((f * seq_len / m) - (f - 1)) ** (d / (d - 2))
    return plain_inv_freq(d, base), 1.0


def ref_yarn(d, base, f, m, beta_fast=32, beta_slow=1, mscale=None, mscale_all_dim=None, attn=None,
             attn_factor=1.0, truncate=True, deepseek=False):
    def get_mscale(scale, ms=1.0):
        return 1.0 if scale <= 1 else 0.1 * ms * math.log(scale) + 1.0

    def corr(rot):  # dim index making `rot` rotations over m positions
        return (d * math.log(m / (rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = corr(beta_fast), corr(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001
    out = []
    for i in range(d // 2):
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)
        extrap = base ** (-(2 * i) / d)
        out.append((extrap / f) * ramp + extrap * (1 - ramp))
    if attn is None:
        if deepseek:  # serving engines' DeepSeek YaRN: mscale defaults 1, mscale_all_dim 0
            attn = get_mscale(f, 1.0 if mscale is None else mscale) / get_mscale(f, mscale_all_dim or 0.0)
        elif mscale and mscale_all_dim:
            attn = get_mscale(f, mscale) / get_mscale(f, mscale_all_dim)
        else:
            attn = get_mscale(f)
        attn *= attn_factor
    return out, attn


def ref_llama3(d, base, f, lo, hi, m):
    out = []
    for w in plain_inv_freq(d, base):
        wl = 2 * math.pi / w
        if wl < m / hi:
            out.append(w)
        elif wl > m / lo:
            out.append(w / f)
        else:
            s = (m / wl - lo) / (hi - lo)
            out.append((1 - s) * w / f + s * w)
    return out, 1.0


def ref_longrope(d, base, short, long_, m, max_position, seq_len, factor=None, attn=None, mscales=None):
    factor = max_position / m if factor is None else factor
    if mscales is not None:  # (short_mscale, long_mscale)
        attn = mscales[1] if seq_len > m else mscales[0]
    if attn is None:
        attn = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(m))
    ext = long_ if seq_len > m else short
    return [w / e for w, e in zip(plain_inv_freq(d, base), ext)], attn


ROTARY_DIMS = [64, 32, 24]  # 32/24: the rotary part of a partial-rotary head of 64


@pytest.mark.parametrize("d", ROTARY_DIMS)
@pytest.mark.parametrize("case", ["linear", "dynamic", "dynamic_short", "yarn", "yarn_mscale", "yarn_attn",
                                  "yarn_attn_factor", "yarn_mscale_alone", "yarn_no_truncate", "yarn_theta",
                                  "deepseek_yarn", "deepseek_yarn_mscale_only", "llama3", "longrope_long",
                                  "longrope_short", "longrope_factor", "longrope_mscale_long",
                                  "longrope_mscale_short"])
def test_scalings_match_formulas(d, case):
    n = 512
    base = 10000.0
    rng = np.random.default_rng()
    if case == "linear":
        sc, (w, a) = {"type": "linear", "factor": 2.5}, ref_linear(d, base, 2.5)
        seq_len = None
    elif case.startswith("dynamic"):
        seq_len = 200 if case == "dynamic" else 64
        sc = {"rope_type": "dynamic", "factor": 3.0, "original_max_position_embeddings": 128}
        w, a = ref_dynamic(d, base, 3.0, 128, seq_len)
    elif case.startswith(("yarn", "deepseek")):
        seq_len = None
        sc = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4096}
        kw = {}
        if case.startswith("deepseek"):  # the vLLM spelling, with its attn_factor
            sc.update(rope_type="deepseek_yarn", mscale=0.707, attn_factor=1.25)
            kw = dict(deepseek=True, mscale=0.707, attn_factor=1.25)
            if case == "deepseek_yarn":
                sc["mscale_all_dim"] = 0.5
                kw["mscale_all_dim"] = 0.5
        elif case == "yarn_attn_factor":
            sc["attn_factor"] = 0.9
            kw = dict(attn_factor=0.9)
        elif case == "yarn_mscale_alone":  # without mscale_all_dim, mscale does not enter yarn
            sc["mscale"] = 0.707
        elif case == "yarn_no_truncate":  # gpt-oss
            sc["truncate"] = False
            kw = dict(truncate=False)
        elif case == "yarn_mscale":
            sc.update(mscale=0.707, mscale_all_dim=1.0, beta_fast=16, beta_slow=2)
            kw = dict(mscale=0.707, mscale_all_dim=1.0, beta_fast=16, beta_slow=2)
        elif case == "yarn_attn":
            sc["attention_factor"] = 0.8
            kw = dict(attn=0.8)
        elif case == "yarn_theta":
            base = 1e6
        w, a = ref_yarn(d, base, 8.0, 4096, **kw)
    elif case == "llama3":
        seq_len = None
        base = 500000.0
        sc = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}
        w, a = ref_llama3(d, base, 8.0, 1.0, 4.0, 8192)
    else:
        short = list(rng.uniform(1.0, 1.5, d // 2))
        long_ = list(rng.uniform(1.0, 60.0, d // 2))
        sc = {"type": "longrope", "short_factor": short, "long_factor": long_,
              "original_max_position_embeddings": 128}
        seq_len = 100 if case == "longrope_short" else None
        kw = {}
        if case == "longrope_factor":
            sc.update(factor=16.0)
            kw = dict(factor=16.0)
        elif case.startswith("longrope_mscale"):  # Phi-3.5-MoE
            sc.update(short_mscale=1.1, long_mscale=1.3)
            kw = dict(mscales=(1.1, 1.3))
            seq_len = 100 if case == "longrope_mscale_short" else None
        w, a = ref_longrope(d, base, short, long_, 128, n, n if seq_len is None else seq_len, **kw)
    got = table(n, d, base=base, scaling=sc, seq_len=seq_len)
    np.testing.assert_allclose(got, expected_table(w, n, a), rtol=0, atol=1e-12)


def test_llama3_real_config_matches_formula():
    # Llama 3.1's published rope_scaling, rotary_dim 128, theta 5e5; a float32 table is the
    # float64 one rounded once.
    sc = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192, "rope_type": "llama3"}
    w, _ = ref_llama3(128, 500000.0, 8.0, 1.0, 4.0, 8192)
    got = rope_ext.cos_sin_cache(4096, 128, base=500000.0, scaling=sc)
    assert got.dtype == torch.float32
    want = torch.from_numpy(expected_table(w, 4096)).float()
    assert torch.equal(got, want)


def test_default_and_mrope_types_are_unscaled():
    plain = table(64, 16)
    np.testing.assert_array_equal(table(64, 16, scaling={"rope_type": "default"}), plain)
    np.testing.assert_array_equal(table(64, 16, scaling={"type": "mrope", "mrope_section": [2, 3, 3]}), plain)


def test_type_and_rope_type_must_agree():
    # Both spellings present (Qwen2.5-VL writes {"type": "mrope", "rope_type": "default"}): fine
    # when they name the same type; when they differ, transformers' model classes disagree on
    # which wins (Llama reads rope_type, DeepSeek type), so it is an error.
    sc = {"rope_type": "linear", "type": "linear", "factor": 2.0}
    np.testing.assert_array_equal(table(32, 8, scaling=sc), table(32, 8, scaling={"type": "linear", "factor": 2.0}))
    np.testing.assert_array_equal(table(32, 8, scaling={"type": "mrope", "rope_type": "default"}), table(32, 8))
    with pytest.raises(ValueError, match=r"two types, rope_type='linear' and type='dynamic'"):
        table(32, 8, scaling={"rope_type": "linear", "type": "dynamic", "factor": 2.0})


def test_null_means_unset():
    # configs write unset optional keys as null: the defaults apply, as in transformers.
    sc = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    nulls = dict(sc, beta_fast=None, beta_slow=None, attention_factor=None, mscale=None)
    np.testing.assert_array_equal(table(128, 8, scaling=nulls), table(128, 8, scaling=sc))


@pytest.mark.parametrize(
    "scaling, match",
    [
        ({"rope_type": "ntk-by-parts", "factor": 2.0}, r"unknown rope scaling type 'ntk-by-parts'"),
        ({"factor": 2.0}, r"'rope_type' \(or the older 'type'\)"),
        ("linear", r"scaling must be a dict"),
        ({"rope_type": "linear"}, r"'linear' needs the key 'factor'"),
        ({"rope_type": "linear", "factor": -1.0}, r"factor must be > 0"),
        ({"rope_type": "linear", "factor": "2"}, r"factor must be a finite number"),
        ({"rope_type": "dynamic", "factor": 2.0}, r"'dynamic' needs the key 'original_max_position_embeddings'"),
        ({"rope_type": "yarn", "original_max_position_embeddings": 64}, r"'yarn' needs the key 'factor'"),
        ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "original_max_position_embeddings": 64},
         r"'llama3' needs the key 'high_freq_factor'"),
        ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0,
          "original_max_position_embeddings": 64}, r"high_freq_factor \(1.0\) must be >= low_freq_factor"),
        ({"rope_type": "longrope", "short_factor": [1.0] * 4, "original_max_position_embeddings": 64},
         r"'longrope' needs the key 'long_factor'"),
        ({"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [1.0] * 3,
          "original_max_position_embeddings": 64}, r"long_factor must be a list of rotary_dim/2 = 4 numbers, got 3"),
        ({"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [1.0] * 4},
         r"'longrope' needs the key 'original_max_position_embeddings'"),
        ({"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [1.0, 2.0, 0.0, 1.0],
          "original_max_position_embeddings": 64}, r"long_factor must hold numbers > 0"),
        ({"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [1.0] * 4, "short_mscale": 1.1,
          "original_max_position_embeddings": 64}, r"short_mscale and long_mscale go together"),
        ({"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [1.0] * 4, "short_mscale": 1.1,
          "long_mscale": 1.2, "attention_factor": 1.0, "original_max_position_embeddings": 64},
         r"attention_factor or short_mscale/long_mscale, not both"),
        # Keys a type does not understand: named, never dropped.
        ({"rope_type": "linear", "factor": 2.0, "finetuned": True},
         r"rope scaling type 'linear' does not understand the key 'finetuned'"),
        ({"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64, "extrapolation_factor": 1.0},
         r"'yarn' does not understand the key 'extrapolation_factor'"),
        ({"rope_type": "deepseek_yarn", "factor": 2.0, "original_max_position_embeddings": 64,
          "attention_factor": 1.0}, r"'deepseek_yarn' does not understand the key 'attention_factor'"),
        ({"rope_type": "default", "factor": 2.0}, r"'default' does not understand the key 'factor'"),
        ({"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}, r"does not understand the key 'rope_theta'"),
        ({"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64, "attention_factor": 1.0,
          "attn_factor": 1.0}, r"attention_factor or attn_factor, not both"),
        ({"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64, "truncate": "no"},
         r"truncate must be true or false"),
        ({"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 64.5},
         r"original_max_position_embeddings must be an integer"),
    ],
)
def test_bad_scaling_raises(scaling, match):
    with pytest.raises(ValueError, match=r"^cos_sin_cache: .*" + match):
        rope_ext.cos_sin_cache(128, 8, scaling=scaling)


def test_bad_seq_len_raises():
    with pytest.raises(ValueError, match="seq_len must be a positive int"):
        rope_ext.cos_sin_cache(16, 8, seq_len=0)


def test_scaled_table_drives_the_ops_with_partial_rotary():
    # A yarn table of rotary_dim 32 on heads of 64: the kernels rotate the first 32 dims by the
    # scaled angles (times the attention factor) and pass the rest through bit-exactly.
    sc = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    cache = rope_ext.cos_sin_cache(256, 32, scaling=sc, dtype=torch.float64)
    q = torch.randn(7, 3, 64, dtype=torch.float64)
    pos = torch.randint(0, 256, (7,))
    out = q.clone()
    rope_ext.apply_rope_(out, None, pos, cache)
    w, a = ref_yarn(32, 10000.0, 4.0, 64)
    ang = pos.double()[:, None, None] * torch.tensor(w, dtype=torch.float64)
    x1, x2 = q[..., :16], q[..., 16:32]
    want = torch.cat([a * (x1 * ang.cos() - x2 * ang.sin()), a * (x2 * ang.cos() + x1 * ang.sin()), q[..., 32:]], -1)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    assert torch.equal(out[..., 32:], q[..., 32:])
