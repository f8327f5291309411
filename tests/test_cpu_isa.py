"""The CPU kernel variants (baseline, AVX2, AVX-512, AVX-512 with BF16): which one serves, how to
choose a lower one, each variant this CPU can run checked against the float64 reference, and all
of them giving the same bits."""

import hashlib
import os
import subprocess
import sys

import pytest
import torch

import cpu_isa_matrix
import rope_ext

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
NAMES = ("baseline", "avx2", "avx512", "avx512_bf16")
# The CPU features each variant needs (as /proc/cpuinfo spells them).
NEEDS = {
    "baseline": set(),
    "avx2": {"avx2", "fma", "f16c"},
    "avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma", "f16c"},
    "avx512_bf16": {"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma", "f16c", "avx512_bf16"},
}

native = pytest.mark.skipif(rope_ext.backend("cpu") != "native", reason="native library not built")


def cpu_flags():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def runnable():
    flags = cpu_flags()
    return [n for n in NAMES if NEEDS[n] <= flags] or ["baseline"]


@pytest.fixture
def variant():
    """Serves the test with a chosen variant (and non-temporal stores for every output), then
    restores the defaults."""
    def use(isa, stream_all=True):
        assert rope_ext.set_cpu_isa(isa) == isa
        torch.ops.rope.set_cpu_stream_threshold(0 if stream_all else -1)

    serving = rope_ext.cpu_isa()  # (ROPE_EXT_CPU_ISA may cap it below the best: kept so)
    yield use
    rope_ext.set_cpu_isa(serving)
    torch.ops.rope.set_cpu_stream_threshold(-1)


def run_python(args, **env):
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("ROPE_EXT_CPU")}
    full_env.update(env)
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=full_env, capture_output=True,
                          text=True, timeout=600)


@native
def test_cpu_isa_names_the_serving_variant():
    isa = rope_ext.cpu_isa()
    assert isa in NAMES
    assert NAMES[torch.ops.rope.cpu_isa()] == isa


@native
def test_listing_the_variants_changes_no_setting(variant):
    # cpu_isas() once found the best variant by switching to it and back: meanwhile another
    # thread's calls ran on it (past a cap), and a set_cpu_isa made then was undone.
    import threading

    variant("baseline", stream_all=False)
    stop, seen = threading.Event(), set()

    def list_variants():
        while not stop.is_set():
            rope_ext.cpu_isas()

    lister = threading.Thread(target=list_variants)
    lister.start()
    try:
        for _ in range(20000):
            seen.add(rope_ext.cpu_isa())
    finally:
        stop.set()
        lister.join()
    assert seen == {"baseline"}


@native
def test_best_variant_is_chosen_by_default():
    if not cpu_flags():
        pytest.skip("no /proc/cpuinfo")
    serving = rope_ext.cpu_isa()
    try:
        assert rope_ext.set_cpu_isa("auto") == runnable()[-1]
        assert rope_ext.cpu_isas() == tuple(runnable())
    finally:
        rope_ext.set_cpu_isa(serving)


@native
@pytest.mark.parametrize("isa", NAMES)
def test_variant_matches_float64_reference(isa, variant):
    if isa not in runnable():
        pytest.skip(f"this CPU cannot run the {isa} kernels")
    variant(isa)
    counts = cpu_isa_matrix.run_all()
    assert all(counts.values()), counts


@native
def test_choosing_a_variant_this_cpu_lacks_is_an_error():
    serving = rope_ext.cpu_isa()
    missing = [n for n in NAMES if n not in runnable()]
    for name in missing:
        with pytest.raises(RuntimeError, match="rope.set_cpu_isa: this CPU"):
            rope_ext.set_cpu_isa(name)
    with pytest.raises(ValueError, match="name must be auto or one of baseline, avx2"):
        rope_ext.set_cpu_isa("sse9")
    with pytest.raises(RuntimeError, match="rope.set_cpu_isa: isa must be -1"):
        torch.ops.rope.set_cpu_isa(7)
    with pytest.raises(RuntimeError, match="rope.set_cpu_stream_threshold: bytes must be >= 0"):
        torch.ops.rope.set_cpu_stream_threshold(-5)
    assert rope_ext.cpu_isa() == serving  # a refused choice changes nothing


def _digest(seed):
    """One digest of every op's outputs (the rotations, the fused QK-norm and its backward, the
    K-shift) over dtypes, layouts, head dims with vector tails and
    partial rotary, on inputs fixed by the seed."""
    g = torch.Generator().manual_seed(seed)
    h = hashlib.sha256()
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        for head_dim, rot in ((64, 64), (80, 48), (128, 128), (100, 26), (256, 192)):
            for interleaved in (False, True):
                x = torch.randn(37, 3, head_dim, generator=g).to(dtype)
                cache = rope_ext.cos_sin_cache(512, rot)
                pos = torch.randint(0, 512, (37,), generator=g)
                rows = cache[pos].unsqueeze(1)
                cos, sin = rows[..., : rot // 2], rows[..., rot // 2:]
                outs = [torch.ops.rope.apply(x, cos, sin, interleaved),
                        torch.ops.rope.apply_backward(x, cos, sin, interleaved),
                        rope_ext.apply_rope_at(x, pos, cache, interleaved=interleaved)]
                q = x.clone()
                torch.ops.rope.apply_(q, None, pos, cache, interleaved)
                m = x.clone()
                sec = [rot // 2 - 2 * (rot // 6), rot // 6, rot // 6]
                rope_ext.apply_mrope_(m, None, torch.stack((pos, pos.flip(0), pos // 2)), cache,
                                      sec, interleaved=interleaved, mrope_interleaved=True)
                # the fused QK-norm + RoPE: rows of head_dim 64/128/256 rotated whole take
                # a path of their own; 3 heads of q, 5 of k (groups of four and the rest)
                n = torch.cat((x, torch.randn(37, 5, head_dim, generator=g).to(dtype)), 1)
                n[5, 4, 1] = float("nan")  # a NaN row: its codes must agree too
                w = torch.randn(head_dim, generator=g).to(dtype)
                torch.ops.rope.qk_norm_rope_(n[:, :3], n[:, 3:], w, w.flip(0), pos, cache,
                                             1e-6, False, interleaved)
                # its backward (rope.qk_norm_rope_backward): grad_x and grad_weight
                outs += torch.ops.rope.qk_norm_rope_backward(x.flip(0), x, w, cos, sin, 1e-6,
                                                             interleaved, interleaved)
                # K-shift: listed slots of a (37 blocks, 1, 3 heads) cache, each its own delta;
                # a cache whose rows are strided along the head dim; float8 caches of both formats
                slots = torch.randperm(37, generator=g)[:29]
                slots[3] = -1
                delta = torch.randint(-511, 512, (29,), generator=g)
                shifted = [x.clone().view(37, 1, 3, head_dim),
                           x.clone().view(37, 1, 3, head_dim).transpose(-1, -2).contiguous()
                           .transpose(-1, -2)]
                for fmt in (torch.float8_e4m3fn, torch.float8_e5m2):
                    if dtype == torch.float32:
                        shifted.append((x.float() * 8).to(fmt).view(37, 1, 3, head_dim))
                for c in shifted:
                    fp8 = c.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
                    rope_ext.shift_kv_cache_(
                        c, slots, delta, cache, interleaved=interleaved,
                        kv_cache_dtype=("fp8_e4m3" if c.dtype == torch.float8_e4m3fn else "fp8_e5m2")
                        if fp8 else "auto", k_scale=torch.tensor([0.125]) if fp8 else None)
                for t in outs + [q, m, n] + shifted:
                    h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


@native
@pytest.mark.parametrize("interleaved", [False, True])
def test_every_variant_writes_torchs_nan_codes(variant, interleaved):
    """NaN results are 0xFFFF in bfloat16 (torch's CPU conversion) on every variant, in vector
    bodies and tails, out of place, in place and streamed; blocks without NaN keep their values."""
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    x = torch.randn(9, 3, 160, generator=g).to(torch.bfloat16)  # 80 pairs: vectors and a tail
    x[0, 0, 0], x[1, 1, 70], x[2, 0, 159], x[3, 2, 5] = (float("nan"), -float("nan"),
                                                        float("inf"), -float("inf"))
    x[4, 1, :].view(torch.int16)[7] = 0x7F81  # a signalling NaN's code
    cache = rope_ext.cos_sin_cache(64, 160)
    pos = torch.randint(0, 64, (9,), generator=g)
    rows = cache[pos].unsqueeze(1)
    cos, sin = rows[..., :80], rows[..., 80:]
    expected = rope_ext.reference.apply_rope(x, cos, sin, interleaved=interleaved)
    assert expected.isnan().any() and (expected.view(torch.int16) == -1).any()
    for isa in runnable():
        for stream_all in (False, True):
            variant(isa, stream_all)
            got = torch.ops.rope.apply(x, cos, sin, interleaved)
            q = x.clone()
            torch.ops.rope.apply_(q, None, pos, cache, interleaved)
            for t in (got, q):
                assert torch.equal(t.view(torch.int16), expected.view(torch.int16)), (isa, stream_all)


def _flushed(got, want):
    """avx512_bf16's one exception (docs/math.md): where its bfloat16 words differ from `want`,
    `want` is a bfloat16 subnormal or the smallest normal (a float32 result below 2^-126 that
    torch rounds) and the word is a zero of the same sign. Returns how many words differ."""
    got, want = got.view(torch.int16).int() & 0xFFFF, want.view(torch.int16).int() & 0xFFFF
    diff = got != want
    assert ((got[diff] & 0x7FFF) == 0).all(), "only zeros"
    assert ((got[diff] & 0x8000) == (want[diff] & 0x8000)).all(), "of the result's sign"
    assert ((want[diff] & 0x7FFF) <= 0x0080).all(), "only where torch's word is below 2^-126"
    return int(diff.sum())


@native
@pytest.mark.parametrize("interleaved", [False, True])
def test_every_variant_rounds_float_denormals_as_documented(variant, interleaved):
    """bfloat16 results below float32's smallest normal (1.2e-38): every variant rounds them as
    torch does, but avx512_bf16, whose conversion instruction takes them as zero (docs/math.md:
    the one exception besides NaN payloads, and bounded here to exactly those words). The
    rotations (vector bodies and tails), the fused QK-norm's fixed and general rows, the K-shift."""
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    x = (torch.randn(9, 3, 160, generator=g) * 1e-39).to(torch.bfloat16)  # 80 pairs
    x[:, :, 150:] = 0  # zeros stay zeros, beside the denormals
    cache = rope_ext.cos_sin_cache(64, 160)
    pos = torch.randint(0, 64, (9,), generator=g)
    rows = cache[pos].unsqueeze(1)
    cos, sin = rows[..., :80], rows[..., 80:]
    expected = rope_ext.reference.apply_rope(x, cos, sin, interleaved=interleaved)
    assert (expected != 0).float().mean() > 0.7
    w = torch.full((128,), 1e-39).to(torch.bfloat16)  # RMS-normalized rows scaled to denormals
    n = torch.randn(9, 5, 128, generator=g).to(torch.bfloat16)
    general = torch.randn(9, 5, 96, generator=g).to(torch.bfloat16)
    outs = {}
    for isa in runnable():
        variant(isa, False)
        got = torch.ops.rope.apply(x, cos, sin, interleaved)
        q = x.clone()
        torch.ops.rope.apply_(q, None, pos, cache, interleaved)
        fixed, gen = n.clone(), general.clone()
        torch.ops.rope.qk_norm_rope_(fixed[:, :3], fixed[:, 3:], w, w, pos,
                                     rope_ext.cos_sin_cache(64, 128), 1e-6, False, interleaved)
        torch.ops.rope.qk_norm_rope_(gen[:, :3], gen[:, 3:], w[:96], w[:96], pos,
                                     rope_ext.cos_sin_cache(64, 96), 1e-6, False, interleaved)
        shifted = x.clone().view(9, 1, 3, 160)
        rope_ext.shift_kv_cache_(shifted, torch.arange(9), pos - 32, cache, interleaved=interleaved)
        outs[isa] = [got, q, fixed, gen, shifted]
    base = outs["baseline"]
    for t in base[:2]:
        assert torch.equal(t.view(torch.int16), expected.view(torch.int16))
    assert all((t != 0).float().mean() > 0.7 for t in base)
    for isa, ts in outs.items():
        if isa == "avx512_bf16":
            assert sum(_flushed(t, b) for t, b in zip(ts, base)) > 0  # the case is exercised
        else:
            assert all(torch.equal(t.view(torch.int16), b.view(torch.int16)) for t, b in zip(ts, base)), isa


@native
def test_every_variant_gives_the_same_bits(variant):
    """No FMA anywhere (csrc/build.json): each vectorized variant must give exactly the bits of
    the baseline kernels, not just something within tolerance; with non-temporal stores too."""
    seed = int.from_bytes(os.urandom(4), "little")
    digests = {}
    for isa in runnable():
        for stream_all in (False, True):
            variant(isa, stream_all)
            digests[(isa, stream_all)] = _digest(seed)
    assert len(set(digests.values())) == 1, f"seed {seed}: {digests}"


@native
def test_environment_caps_the_variant_at_import():
    r = run_python(["-c", "import rope_ext; print(rope_ext.cpu_isa())"], ROPE_EXT_CPU_ISA="baseline")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[-1] == "baseline"
    r = run_python(["-c", "import rope_ext"], ROPE_EXT_CPU_ISA="sse9")
    assert r.returncode != 0
    assert "ROPE_EXT_CPU_ISA='sse9': expected one of auto, baseline, avx2" in r.stderr
    r = run_python(["-c", "import rope_ext"], ROPE_EXT_CPU_STREAM_MB="2.5")
    assert r.returncode != 0 and "ROPE_EXT_CPU_STREAM_MB='2.5'" in r.stderr


def test_environment_values(monkeypatch):
    """Every bad value names its variable; ROPE_EXT_CPU_STREAM_MB takes ASCII digits whose bytes
    fit in int64; build-only variables are read when a build asks for them, so none (nor the
    CMake spelling ON) stops an installed package from importing."""
    from rope_ext import envs

    for raw in ("8796093022208", "\u00b2", "-1", "2.5"):
        monkeypatch.setenv("ROPE_EXT_CPU_STREAM_MB", raw)
        with pytest.raises(ValueError, match=f"ROPE_EXT_CPU_STREAM_MB={raw!r}: expected an integer"):
            envs._read("ROPE_EXT_CPU_STREAM_MB")
    monkeypatch.setenv("ROPE_EXT_CPU_STREAM_MB", "8796093022207")
    assert envs._read("ROPE_EXT_CPU_STREAM_MB") == (1 << 43) - 1
    r = run_python(["-c", "import rope_ext"], ROPE_EXT_CPU_STREAM_MB="8796093022207",
                   ROPE_EXT_CUDA="ON", ROPE_EXT_BUILD="debug", ROPE_EXT_CPU_VARIANTS="avx2")
    assert r.returncode == 0, r.stderr
    monkeypatch.setenv("ROPE_EXT_CUDA", "ON")
    with pytest.raises(ValueError, match="ROPE_EXT_CUDA='ON': expected one of auto, 0, 1"):
        envs.CUDA  # noqa: B018 - read on access


def test_reference_backend_reports_reference():
    r = run_python(
        ["-c", "import rope_ext, torch; print(torch.ops.rope.cpu_isa(), rope_ext.cpu_isa())"],
        ROPE_EXT_BACKEND="reference",
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["-1", "reference"]


@native
def test_no_avx_instruction_outside_the_per_isa_kernels():
    """The per-ISA files are compiled with `#pragma GCC target`. If an inline function with
    external linkage (a std:: template, a torch header function) were compiled there, the linker
    could keep that AVX copy for every caller and crash CPUs without AVX. So every function with
    VEX/EVEX-encoded instructions must have internal linkage (an anonymous namespace)."""
    import platform
    import shutil

    import rope_ext._C as lib

    if platform.machine() not in ("x86_64", "AMD64") or shutil.which("objdump") is None:
        pytest.skip("needs objdump on x86-64")
    dump = subprocess.run(["objdump", "-d", "--no-show-raw-insn", lib.__file__],
                          capture_output=True, text=True, check=True).stdout
    function, offenders, vex_functions, fused = None, set(), set(), set()
    for line in dump.splitlines():
        if line.endswith(">:"):
            function = line.split("<", 1)[1][:-2]
        elif "\tv" in line and function is not None:
            vex_functions.add(function)
            if "_GLOBAL__N_" not in function:
                offenders.add(function)
            if "\tvfm" in line or "\tvfnm" in line:
                fused.add(function)
    assert vex_functions, "expected the AVX kernels in the library"
    assert not offenders, sorted(offenders)[:10]
    # The variants give the same bits only if none contracts a product and a sum into one
    # rounding (-ffp-contract=off; GCC's vfmaddsub pattern ignored it once).
    assert not fused, sorted(fused)[:10]


@pytest.mark.parametrize("flags, variant", [
    ("fpu sse2 avx", 0),
    ("avx avx2 fma", 0),  # no f16c: the avx2 variant needs all three
    ("avx2 fma f16c bmi2", 1),
    ("avx2 fma f16c avx512f avx512bw avx512vl", 1),  # no avx512dq
    ("avx2 fma f16c avx512f avx512bw avx512vl avx512dq", 2),
    ("avx2 fma f16c avx512f avx512bw avx512vl avx512dq avx512_bf16", 3),
])
def test_native_build_reads_the_variant_from_cpu_flags(tmp_path, flags, variant):
    # ROPE_EXT_CPU_VARIANTS=native compiles the variants up to this one (build_config.py).
    import build_config
    info = tmp_path / "cpuinfo"
    info.write_text(f"processor\t: 0\nflags\t\t: {flags}\n\nprocessor\t: 1\nflags\t\t: {flags}\n")
    assert build_config.native_cpu_variant(str(info)) == variant
    assert build_config.native_cpu_variant(str(tmp_path / "missing")) == 3  # unreadable: all


@pytest.mark.skipif(not os.path.exists("/proc/cpuinfo"), reason="no /proc/cpuinfo")
def test_native_build_keeps_every_variant_this_cpu_runs():
    # The flags the kernel reports and __builtin_cpu_supports (which serves) agree here: a native
    # build would lose no variant this machine could serve.
    import build_config
    if not rope_ext.cpu_isas():
        pytest.skip("no native CPU library")
    assert NAMES[build_config.native_cpu_variant()] == rope_ext.cpu_isas()[-1]
