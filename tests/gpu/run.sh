#!/usr/bin/env bash
# GPU suite, tuning and benchmarks in one go; prints a short table last.
# Usage (repo root, on the GPU node): bash tests/gpu/run.sh [--quick]
#   PHASES="tests tune bench" (default: all three) picks phases;
#   TUNE_ARGS (e.g. --large) go to python -m jaxtdist.tune.
# Writes logs and raw results under ${OUT:-/tmp/jaxtdist-gpu} and docs/perf/.
# The tuning cache is ${JAXTDIST_TUNING_CACHE:-$OUT/tuning.json}: the tune phase
# writes it, and the bench (a second process) reads it without tuning again.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/jaxtdist-gpu}
PHASES=${PHASES:-tests tune bench}
mkdir -p "$OUT" docs/perf
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export PYTHONUNBUFFERED=1 JAXTDIST_TEST_GPU=1
export JAXTDIST_TUNING_CACHE=${JAXTDIST_TUNING_CACHE:-$OUT/tuning.json}
QUICK=${1:-}
has() { [[ " $PHASES " == *" $1 "* ]]; }

if [ -d .whl ] && ! python3 -c "import jax_triton" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 \
  || { tail -30 "$OUT/install.log"; exit 1; }
python3 -c "import jaxtdist._jaxtdist_ffi as m; print('native library, CUDA:', m.with_cuda)"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -8
DEV=$(python3 -c "import jax; print(jax.devices()[0].device_kind.replace(' ', '_'))")
N=$(python3 -c "import jax; print(len(jax.devices()))")
TAG="${DEV}x${N}"
ARGS=""
[ "$QUICK" = "--quick" ] && ARGS="--quick --iterations 10"
TEST_RC=0

if has tests; then
  # The suite runs without the user cache (shipped tuned configs still apply).
  # TMA kernels (jaxtdist's own launcher) run first in a process of their own,
  # so that a fault there cannot take the rest of the suite down with it.
  JAXTDIST_TUNING_CACHE="$OUT/tests_tuning.json" timeout 600 python3 -m pytest tests/gpu -q \
    -p no:cacheprovider -k ag_matmul_tma 2>&1 | tee "$OUT/gpu_tests_tma.log"
  TMA_RC=${PIPESTATUS[0]}
  JAXTDIST_TUNING_CACHE="$OUT/tests_tuning.json" timeout 900 python3 -m pytest tests/gpu -q \
    -p no:cacheprovider -k "not ag_matmul_tma" 2>&1 | tee "$OUT/gpu_tests.log"
  TEST_RC=${PIPESTATUS[0]}
  [ "$TMA_RC" -ne 0 ] && TEST_RC=$TMA_RC
  python3 examples/ag_matmul.py 2>&1 | tail -1 | tee "$OUT/examples.log"
  python3 examples/ring_exchange.py 2>&1 | tail -1 | tee -a "$OUT/examples.log"
fi
if has tune; then
  python3 -m jaxtdist.tune $ARGS ${TUNE_ARGS:-} --json "docs/perf/ag_matmul_tuning_${TAG}.json" \
    --markdown "docs/perf/ag_matmul_tuning_${TAG}.md" 2>&1 | tee "$OUT/tune.log"
fi
if has bench; then
  # SM clocks, power and throttle reasons during the bench: slow episodes vs clock drops.
  nvidia-smi --query-gpu=index,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active \
    --format=csv,noheader,nounits -lms 250 > "$OUT/clocks.csv" 2>/dev/null &
  CLOCKS_PID=$!
  python3 -m jaxtdist.bench all_gather --json "docs/perf/all_gather_${TAG}.json" \
    --markdown "docs/perf/all_gather_${TAG}.md" 2>&1 | tee "$OUT/bench_all_gather.log"
  python3 -m jaxtdist.bench ag_matmul $ARGS --json "docs/perf/ag_matmul_${TAG}.json" \
    --markdown "docs/perf/ag_matmul_${TAG}.md" 2>&1 | tee "$OUT/bench_ag_matmul.log"
  kill "$CLOCKS_PID" 2>/dev/null
fi
# Only what this run wrote (docs/perf also holds every earlier run's files).
for f in all_gather ag_matmul ag_matmul_tuning; do cp docs/perf/"${f}_${TAG}".* "$OUT/" 2>/dev/null; done

echo
if has tests; then
  echo "== GPU tests (TMA): $(grep -E '^[0-9]+ (passed|failed|skipped|errors?)' "$OUT/gpu_tests_tma.log" | tail -1)"
  echo "== GPU tests (rest): $(grep -E '^[0-9]+ (passed|failed|skipped|errors?)' "$OUT/gpu_tests.log" | tail -1)"
  cat "$OUT/examples.log"
fi
if has tune; then grep -E "best" "$OUT/tune.log"; fi
if has bench; then
  python3 tests/gpu/clock_summary.py "$OUT/clocks.csv" 2>/dev/null
  cat "docs/perf/all_gather_${TAG}.md" 2>/dev/null
  echo
  cat "docs/perf/ag_matmul_${TAG}.md" 2>/dev/null
fi
exit $TEST_RC
