"""Every environment variable rope_ext reads, in one place, each read once.

Runtime variables are read when rope_ext is imported (read_runtime); build variables when setup.py
or the JIT loader first asks for them (build_config.py loads this file by path, without importing
rope_ext or torch). So a build-only setting never stops an installed package from importing, and a
run-time one never stops a build. The table in docs/packaging.md ("Environment variables") lists
the same names; a test checks that the two agree. A value outside the allowed ones is an error
that names the variable.
"""

import os

# name -> (when it is read, allowed values, default, what it does)
VARIABLES = {
    "ROPE_EXT_BACKEND": (
        "import", ("auto", "native", "reference"), "auto",
        "reference: skip the compiled libraries; every op is served by the pure-PyTorch "
        "reference. native: fail at import if the compiled CPU library cannot be loaded.",
    ),
    "ROPE_EXT_JIT": (
        "import", ("0", "1", "verbose"), "0",
        "1: build csrc/ with torch.utils.cpp_extension (a source checkout) and load that instead "
        "of the compiled library; verbose shows the build.",
    ),
    "ROPE_EXT_CPU_ISA": (
        "import", ("auto", "baseline", "avx2", "avx512", "avx512_bf16"), "auto",
        "Cap the CPU kernel variant (rope_ext.set_cpu_isa does the same at run time).",
    ),
    "ROPE_EXT_CPU_STREAM_MB": (
        "import", "an integer >= 0", None,
        "CPU outputs of at least this many MiB are written with non-temporal stores (default: "
        "the size of the last-level cache).",
    ),
    "ROPE_EXT_CUDA": (
        "build", ("auto", "0", "1"), "auto",
        "Build the CUDA library: 1 forces it (an error if impossible), 0 skips it; auto builds it "
        "when torch is a CUDA build and a toolkit is found (the JIT loader: when a GPU is visible).",
    ),
    "ROPE_EXT_BUILD": (
        "build", ("release", "sanitize"), "release",
        "sanitize: build the CPU library with AddressSanitizer and UndefinedBehaviorSanitizer "
        "(make sanitize).",
    ),
    "ROPE_EXT_CPU_VARIANTS": (
        "build", ("all", "native"), "all",
        "native: compile only the CPU kernel variants the building machine runs (a faster build "
        "for development; make sanitize uses it). The library then serves no better variant on "
        "another CPU.",
    ),
    "ROPE_EXT_BUILD_VERBOSE": (
        "build", ("0", "1"), "0",
        "1: make's builds (scripts/build_native.py) print every compiler command, not a line per "
        "file.",
    ),
}


def _read(name):
    when, allowed, default, _ = VARIABLES[name]
    raw = os.environ.get(name, "").strip()
    if raw == "":
        return default
    if isinstance(allowed, tuple):
        value = raw.lower()
        if value not in allowed:
            raise ValueError(f"{name}={raw!r}: expected one of {', '.join(allowed)}")
        return value
    # ASCII digits only (str.isdigit takes '²'), and a count of MiB whose bytes fit in int64.
    if not (raw.isascii() and raw.isdigit()) or int(raw) >= 1 << 43:
        raise ValueError(f"{name}={raw!r}: expected {allowed} (below 2^43)")
    return int(raw)


_RUNTIME_NAMES = {"BACKEND": "ROPE_EXT_BACKEND", "JIT": "ROPE_EXT_JIT",
                  "CPU_ISA": "ROPE_EXT_CPU_ISA", "CPU_STREAM_MB": "ROPE_EXT_CPU_STREAM_MB"}
_BUILD_NAMES = {"CUDA": "ROPE_EXT_CUDA", "BUILD": "ROPE_EXT_BUILD",
                "CPU_VARIANTS": "ROPE_EXT_CPU_VARIANTS", "BUILD_VERBOSE": "ROPE_EXT_BUILD_VERBOSE"}
assert set(_RUNTIME_NAMES.values()) == {n for n, v in VARIABLES.items() if v[0] == "import"}
assert set(_BUILD_NAMES.values()) == {n for n, v in VARIABLES.items() if v[0] == "build"}


def read_runtime():
    """Reads every run-time variable once (envs.BACKEND, envs.JIT, ...): rope_ext's import calls
    it first, so a bad value stops the import, naming the variable."""
    for attr, name in _RUNTIME_NAMES.items():
        globals()[attr] = _read(name)


def __getattr__(attr):
    """The build variables (envs.CUDA, envs.BUILD, ...), read when a build asks for them; a
    run-time variable asked for before read_runtime ran reads them all."""
    if attr in _BUILD_NAMES:
        return _read(_BUILD_NAMES[attr])
    if attr in _RUNTIME_NAMES:
        read_runtime()
        return globals()[attr]
    raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")
