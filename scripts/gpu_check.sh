#!/usr/bin/env bash
# `make gpu-check`: the CUDA kernels on a real GPU, in one unattended run well under 10 minutes.
#
# Made for a lent GPU box (torch with CUDA, nvcc, ninja, no internet), this repository copied in
# with the libraries built here carried along:
#   carry: ["rope_ext/_C.abi3.so", "rope_ext/_C_cuda.abi3.so"]
#   1. libraries: use the carried ones (stable ABI: built against one torch, they load in others)
#      if they load and pass a smoke test on the GPU; else rebuild against the local torch.
#   2. the CUDA tests (tests/test_cuda_device.py, test_cuda_build.py) and the fuzz on the GPU
#      against the CPU kernels (tests/test_fuzz.py, GPU_CHECK_FUZZ cases)
#   3. the benchmark on the GPU: bench/bench.py --device cuda (JSON + Markdown written after every
#      case, so a run cut short by its time budget still leaves what it measured), then
#      bench/gpu_profile.py: each call's kernel time beside its wall time
#   4. compute-sanitizer over the CUDA tests: memcheck on all of them and on some fuzz cases,
#      initcheck, racecheck and synccheck on a few
#   5. the serving benchmark on the GPU (bench/serving_bench.py --device cuda), if time is left
#   6. the rest of the test suite, if time is left
# Everything goes to $OUT (default ./gpu-results): log, env, build log, junit xml, cuda.json/.md.
# Exit status: 0 only if a GPU is visible, the libraries serve CUDA and the CUDA tests pass
# (3: no GPU visible).
#
# Knobs: PYTHON=...             interpreter with torch (default: first of python3, python)
#        GPU_CHECK_REBUILD=1    skip the carried libraries, rebuild
#        GPU_CHECK_DRY=1        no GPU here: try the script itself (the tests, whose GPU cases
#                               skip, and a tiny CPU benchmark; no profile, sanitizer, serving)
#        GPU_CHECK_BUDGET_S=480 the time budget: steps 3b-6 (and benchmark cases) start only while
#                               it lasts, each limited to what is left of it; steps 2 and 3 run at
#                               least 60 s each
#        GPU_CHECK_FUZZ=4000    fuzz cases on the GPU (a tenth of them under memcheck)
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu-results}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
exec > >(tee "$OUT/gpu_check.log") 2>&1
BUDGET="${GPU_CHECK_BUDGET_S:-480}"
SECONDS=0
step() { echo; echo "=== [${SECONDS}s] $*"; }

PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  for c in python3 python; do
    if command -v "$c" >/dev/null 2>&1 && "$c" -c "import torch" 2>/dev/null; then PY="$c"; break; fi
  done
fi
[ -n "$PY" ] || { echo "gpu_check: no python with torch found (set PYTHON=...)"; exit 2; }
# absolute (the rebuild may run from a copy elsewhere), the venv's link itself kept
case "$PY" in */*) PY="$(cd "$(dirname "$PY")" 2>/dev/null && pwd)/$(basename "$PY")" ;; *) PY="$(command -v "$PY")" ;; esac
"$PY" -c "import torch" 2>/dev/null || { echo "gpu_check: PYTHON=${PYTHON:-$PY} cannot import torch"; exit 2; }
DRY="${GPU_CHECK_DRY:-0}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

step "environment"
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 || echo "no nvidia-smi"
  "$PY" -c "import sys, torch; print('python', sys.version.split()[0]); print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpu', torch.cuda.is_available() and torch.cuda.get_device_name())"
  command -v nvcc >/dev/null && nvcc --version | tail -1 || echo "no nvcc on PATH"
  ls -la rope_ext/*.so 2>&1
} | tee "$OUT/env.txt"
# Without a visible GPU every CUDA test would skip and the check would pass having checked
# nothing (a box whose CUDA_VISIBLE_DEVICES hides the GPU, a CPU machine).
if [ "$DRY" != "1" ] && ! "$PY" -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then
  echo "gpu_check: no CUDA device visible (torch.cuda.is_available() is False): nothing to check;"
  echo "  GPU_CHECK_DRY=1 runs the script anyway"
  exit 3
fi

# True if rope_ext loads both libraries, CUDA is served natively, and (with a GPU) one call of
# each op agrees with the float64 reference.
libs_ok() {
  "$PY" - <<'EOF'
import torch, rope_ext
from rope_ext._library import state
print("rope_ext._C:", state.path or state.error)
print("rope_ext._C_cuda:", state.cuda_path or state.cuda_error)
assert rope_ext.backend("cuda") == "native", "CUDA is not served by the native kernels"
if torch.cuda.is_available():
    x = torch.randn(7, 5, 128, device="cuda", dtype=torch.bfloat16)
    cache = rope_ext.cos_sin_cache(64, 128, device="cuda")
    pos = torch.randint(0, 64, (7,), device="cuda")
    rows = cache[pos][:, None]
    out = torch.ops.rope.apply(x, rows[..., :64], rows[..., 64:], False)
    ref = rope_ext.reference.apply_rope(x.double(), rows[..., :64].double(), rows[..., 64:].double())
    torch.testing.assert_close(out.double(), ref, rtol=1e-2, atol=1.6e-2)
    q = x.clone()
    torch.ops.rope.apply_(q, None, pos, cache, False)
    torch.testing.assert_close(q.double(), ref, rtol=1e-2, atol=1.6e-2)
    torch.cuda.synchronize()
    print("smoke test on", torch.cuda.get_device_name(), "passed")
EOF
}

# The arch of the GPU here unless TORCH_CUDA_ARCH_LIST names others (9.0 without a GPU).
ARCH="$("$PY" -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())" 2>/dev/null)"
build_here() {
  MAX_JOBS="$(nproc)" ROPE_EXT_CUDA=1 TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-${ARCH:-9.0}+PTX}" \
    timeout 360 "$PY" setup.py build_ext --inplace >>"$OUT/build.log" 2>&1
}

# setuptools < 77 rejects pyproject.toml's SPDX license string; the build itself does not need
# the project metadata, so then build from a copy without pyproject.toml.
build_libs() {
  : > "$OUT/build.log"  # (an earlier run's error must not steer this one)
  build_here && return 0
  grep -q "project.license" "$OUT/build.log" || return 1
  echo "old setuptools: building from a copy without pyproject.toml"
  local tmp; tmp="$(mktemp -d)"
  cp -r setup.py build_config.py csrc rope_ext "$tmp"/
  (cd "$tmp" && build_here) && cp "$tmp"/rope_ext/*.so rope_ext/
}

step "1. libraries"
LIBS="none"
if [ "${GPU_CHECK_REBUILD:-0}" != "1" ] && libs_ok; then
  LIBS="as found (carried or built before; loaded unchanged)"
else
  stash="$(mktemp -d)"
  echo "rebuilding against the local torch (log: $OUT/build.log; the libraries found: $stash)"
  mv rope_ext/*.so "$stash"/ 2>/dev/null || true
  if build_libs && libs_ok; then
    LIBS="rebuilt here"
  else
    tail -30 "$OUT/build.log"
    # (the libraries found go back when the script ends: the checkout as it was)
    trap 'rm -f rope_ext/*.so; mv -f "$stash"/*.so rope_ext/ 2>/dev/null' EXIT
    echo "gpu_check: no working CUDA library; the remaining steps show what the fallback does"
  fi
fi
echo "libraries: $LIBS"

step "2. CUDA tests"
left=$((BUDGET - SECONDS - 90)); [ "$left" -gt 240 ] && left=240; [ "$left" -lt 60 ] && left=60
FUZZ="${GPU_CHECK_FUZZ:-4000}"
FUZZ_TEST=tests/test_fuzz.py::test_cuda_agrees_with_native_on_random_inputs
timeout "$left" "$PY" -m pytest tests/test_cuda_device.py tests/test_cuda_build.py "$FUZZ_TEST" \
  --fuzz-cases "$((FUZZ * 2))" -q -rs -p no:cacheprovider --junitxml="$OUT/tests_cuda.xml" 2>&1 \
  | tee "$OUT/tests_cuda.txt"
CUDA_TESTS=$?

step "3. GPU benchmark"
# Cases start only while the budget lasts (the bench checks before each one); the timeout is the
# backstop for a single case that hangs. SANITIZER_S is kept back for step 4.
SANITIZER_S="${GPU_CHECK_SANITIZER_S:-200}"
left=$((BUDGET - SECONDS - 60 - SANITIZER_S))
[ "$left" -lt 60 ] && left=60
BENCH_ARGS=(--device cuda --out "$OUT" --time-budget "$((left - 60 > 30 ? left - 60 : 30))")
if [ "$DRY" = "1" ]; then BENCH_ARGS=(--device cpu --quick --out "$OUT" --stem cuda); fi
timeout "$left" "$PY" bench/bench.py "${BENCH_ARGS[@]}" 2> >(grep -v "^W[0-9]" >&2) | tee "$OUT/bench.txt"
BENCH=${PIPESTATUS[0]}

step "3b. where each call's time goes"
# Kernel GPU time beside wall time per call (bench/gpu_profile.py): about 20 s on an H200.
# skipped: why a step did not run.
skipped() { if [ "$DRY" = "1" ]; then echo "skipped (GPU_CHECK_DRY)"; else echo "skipped (time budget)"; fi; }
PROFILE="$(skipped)"
left=$((BUDGET - SECONDS)); [ "$left" -gt 90 ] && left=90
if [ "$DRY" != "1" ] && [ "$left" -ge 30 ]; then
  timeout "$left" "$PY" bench/gpu_profile.py --out "$OUT" 2> >(grep -v -i "warn" >&2) | tee "$OUT/gpu-profile.md"
  PROFILE="exit ${PIPESTATUS[0]} ($OUT/gpu-profile.md, .json)"
fi

step "4. compute-sanitizer"
# memcheck: every CUDA test but the ones that cannot run under it (the device-side assert is
# meant to fault; the > 2^31-element test, and torch.compile's code generation, would take
# minutes at sanitizer speed), and some fuzz cases. initcheck (no read of memory nothing wrote):
# the reference tests and the paged caches' writes, whose slot sets the kernels fill themselves.
# racecheck and synccheck: the kernels use no shared memory and no barrier; one short pass each
# proves that stays true. (On an H200: memcheck 20-25 s; racecheck took 55 s over 10 tests.)
SANITIZER="skipped (no compute-sanitizer)"
CS="$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null || true)"
# sanitize TOOL SECONDS PYTEST-ARGS...: one tool over some CUDA tests; its exit joins SANITIZER.
sanitize() {
  local tool="$1" secs="$2"; shift 2
  timeout "$secs" "$CS" --tool "$tool" --error-exitcode 7 --print-limit 20 \
    --target-processes all "$PY" -m pytest -q -p no:cacheprovider "$@" 2>&1 | tail -30 \
    | tee "$OUT/sanitizer_$tool.txt"
  SANITIZER="$SANITIZER$tool exit ${PIPESTATUS[0]}, "
}
left=$((BUDGET - SECONDS)); [ "$left" -gt "$SANITIZER_S" ] && left="$SANITIZER_S"
if [ -n "$CS" ] && { [ "$DRY" = "1" ] || [ "$left" -lt 60 ]; }; then SANITIZER="$(skipped)"; fi
if [ -n "$CS" ] && [ "$DRY" != "1" ] && [ "$left" -ge 60 ]; then
  SAN_K="not device_side_assert and not more_than_2_pow_31 and not opcheck_and_compile"
  SANITIZER=""
  sanitize memcheck "$((left * 2 / 5))" tests/test_cuda_device.py "$FUZZ_TEST" \
    --fuzz-cases "$((FUZZ / 5))" -k "$SAN_K"
  sanitize initcheck "$((left / 5))" tests/test_cuda_device.py \
    -k "gqa_matches_reference or mrope_and_cache or qk_norm_prologue"
  # (racecheck is the slowest tool: 8 tests took over 30 s on an H200, 2 took 8 s)
  sanitize racecheck "$((left / 5))" tests/test_cuda_device.py -k "gqa_matches_reference and bfloat16"
  sanitize synccheck "$((left / 5))" tests/test_cuda_device.py -k "gqa_matches_reference"
  SANITIZER="${SANITIZER%, } (7: errors found, 124: time)"
fi
echo "sanitizer: $SANITIZER"

step "5. serving benchmark"
SERVING="$(skipped)"
left=$((BUDGET - SECONDS))
if [ "$left" -gt 60 ] && [ "$DRY" != "1" ]; then
  timeout "$left" "$PY" bench/serving_bench.py --device cuda --out "$OUT" 2>&1 | tee "$OUT/serving.txt"
  SERVING="exit ${PIPESTATUS[0]} ($OUT/serving-cuda.md)"
fi

step "6. the rest of the test suite"
REST="skipped (time budget)"
left=$((BUDGET - SECONDS))
if [ "$left" -gt 30 ]; then
  # One line per test (-v), so a run cut short by the budget still names what failed; in
  # parallel where pytest-xdist is installed (about 4x faster on a 16-core box).
  XDIST=(); "$PY" -c "import xdist" 2>/dev/null && XDIST=(-n 12)
  timeout "$left" "$PY" -m pytest tests -v "${XDIST[@]}" -p no:cacheprovider --tb=short \
    --ignore=tests/test_cuda_device.py --ignore=tests/test_cuda_build.py > "$OUT/tests_rest.txt" 2>&1
  REST="exit $? ($(grep -c ' PASSED' "$OUT/tests_rest.txt") passed, failed or errors:"
  REST="$REST $(grep -E ' (FAILED|ERROR)( |$)' "$OUT/tests_rest.txt" | grep -oE 'tests/[^ ]+' | sort -u | head -30 | tr '\n' ' '))"
fi

step "summary (${SECONDS}s)"
{
  echo "libraries:   $LIBS"
  echo "CUDA tests:  exit $CUDA_TESTS  ($(tail -1 "$OUT/tests_cuda.txt"))"
  echo "benchmark:   exit $BENCH  ($OUT/cuda.md, cuda.json)"
  echo "profile:     $PROFILE"
  echo "sanitizer:   $SANITIZER"
  echo "serving:     $SERVING"
  echo "rest:        $REST"
  echo
  cat "$OUT/cuda.md" 2>/dev/null
} | tee "$OUT/summary.txt"
status=1
[ "$LIBS" != "none" ] && [ "$CUDA_TESTS" = "0" ] && status=0
sleep 1  # let tee flush the log
exit "$status"
