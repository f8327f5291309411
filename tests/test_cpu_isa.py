"""The CPU kernel variants (baseline, AVX2, AVX-512, AVX-512 with BF16): which one serves, how to force a lower
one, and each variant this CPU can run checked against the float64 reference."""

import os
import subprocess
import sys

import pytest

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
    return None


def run_python(args, **env):
    """Runs python in a fresh process (the variant is chosen when the library loads); an
    inherited ROPE_EXT_CPU_ISA is dropped unless given here."""
    full_env = {k: v for k, v in os.environ.items() if k != "ROPE_EXT_CPU_ISA"}
    full_env.update(env)
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=full_env, capture_output=True,
                          text=True, timeout=600)


def served(**env):
    r = run_python(["-c", "import rope_ext; print(rope_ext.cpu_isa())"], **env)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip().splitlines()[-1], r.stderr


@native
def test_cpu_isa_names_the_serving_variant():
    import torch

    isa = rope_ext.cpu_isa()
    assert isa in NAMES
    assert NAMES[torch.ops.rope.cpu_isa()] == isa


@native
def test_best_variant_is_chosen_by_default():
    flags = cpu_flags()
    if flags is None:
        pytest.skip("no /proc/cpuinfo")
    best = [n for n in NAMES if NEEDS[n] <= flags][-1]
    assert served()[0] == best


@native
@pytest.mark.parametrize("isa", NAMES)
def test_variant_matches_float64_reference(isa):
    flags = cpu_flags()
    if isa != "baseline" and (flags is None or not NEEDS[isa] <= flags):
        pytest.skip(f"this CPU cannot run the {isa} kernels")
    seed = str(int.from_bytes(os.urandom(4), "little"))
    # ROPE_EXT_CPU_STREAM_MB=0: every output of the matrix takes the non-temporal-store path
    # (with its fallback for unaligned rows); the other tests, in-process, take plain stores.
    r = run_python([os.path.join(HERE, "cpu_isa_matrix.py"), isa, seed], ROPE_EXT_CPU_ISA=isa,
                   ROPE_EXT_CPU_STREAM_MB="0")
    assert r.returncode == 0, f"seed {seed}\n{r.stdout}\n{r.stderr}"
    assert f"cpu_isa={isa} ok" in r.stdout


@native
@pytest.mark.parametrize("bad", ["-3", "big", "2.5"])
def test_bad_stream_threshold_is_a_clear_error(bad):
    code = ("import torch, rope_ext; x = torch.randn(4, 2, 8); c = torch.rand(4, 1, 4); "
            "torch.ops.rope.apply(x, c, c)")
    r = run_python(["-c", code], ROPE_EXT_CPU_STREAM_MB=bad)
    assert r.returncode != 0
    assert "ROPE_EXT_CPU_STREAM_MB" in r.stderr and bad in r.stderr


# Prints one digest of apply / apply_backward / apply_ outputs over dtypes, layouts, head dims
# with vector tails and partial rotary, on inputs fixed by the seed.
DIGEST = """
import hashlib, sys, torch, rope_ext
torch.manual_seed(int(sys.argv[1]))
h = hashlib.sha256()
for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
    for head_dim, rot in ((64, 64), (80, 48), (128, 128), (100, 26), (256, 192)):
        for interleaved in (False, True):
            x = torch.randn(37, 3, head_dim, dtype=dtype)
            cache = rope_ext.cos_sin_cache(512, rot)
            pos = torch.randint(0, 512, (37,))
            rows = cache[pos].unsqueeze(1)
            cos, sin = rows[..., : rot // 2], rows[..., rot // 2:]
            outs = [torch.ops.rope.apply(x, cos, sin, interleaved),
                    torch.ops.rope.apply_backward(x, cos, sin, interleaved)]
            q = x.clone()
            torch.ops.rope.apply_(q, None, pos, cache, interleaved)
            for t in outs + [q]:
                h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
print(rope_ext.cpu_isa(), h.hexdigest())
"""


@native
def test_every_variant_rounds_bit_for_bit_like_the_portable_kernel():
    """No FMA anywhere (rope_ext/_build_flags.py): each vectorized variant must give exactly the
    bits of the portable C++ kernel, not just something within tolerance."""
    flags = cpu_flags() or set()
    runnable = [n for n in NAMES if NEEDS[n] <= flags] or ["baseline"]
    seed = str(int.from_bytes(os.urandom(4), "little"))
    digests = {}
    for isa in runnable:
        r = run_python(["-c", DIGEST, seed], ROPE_EXT_CPU_ISA=isa)
        assert r.returncode == 0, r.stderr
        served_isa, digest = r.stdout.split()
        assert served_isa == isa
        digests[isa] = digest
    assert len(set(digests.values())) == 1, f"seed {seed}: {digests}"


@native
def test_unknown_variant_name_warns_and_uses_the_best():
    best, _ = served()
    got, err = served(ROPE_EXT_CPU_ISA="sse9")
    assert got == best
    assert "ROPE_EXT_CPU_ISA=sse9" in err


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
    function, offenders, vex_functions = None, set(), set()
    for line in dump.splitlines():
        if line.endswith(">:"):
            function = line.split("<", 1)[1][:-2]
        elif "\tv" in line and function is not None:
            vex_functions.add(function)
            if "_GLOBAL__N_" not in function:
                offenders.add(function)
    assert vex_functions, "expected the AVX kernels in the library"
    assert not offenders, sorted(offenders)[:10]
