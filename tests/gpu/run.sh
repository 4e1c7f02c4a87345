#!/usr/bin/env bash
# The GPU entry point: the GPU suite, the tuner, then the benchmarks for the GPUs
# this node has; prints a short summary and the tables last.
# Usage (repo root, on the GPU node): bash tests/gpu/run.sh [--quick]
#   PHASES=smoke: what has never run on a GPU, sized for one 10-minute device call,
#   each step under its own time bound (logs and tables under $OUT): the FP8,
#   grouped FP8 and low-latency MoE GPU tests, the multi-process LL and overlapped
#   backward cases (2 processes sharing GPU 0), then short world-1 benches.
#   PHASES="tests tune bench" (default: all three) picks phases; PYTEST_K narrows
#   the single-process suite (pytest -k); MULTIPROCESS=0 skips the multi-process one;
#   TUNE_ARGS (e.g. --large) go to python -m jaxtdist.tune;
#   BENCH_WORLDS (default: "1 N", N the GPUs found) the world sizes every op is
#   timed at (BENCH_OPS: which ops, default all, the model step included);
#   WORLD1_BENCHES (default: gemm gemm_random attention_random attention_random_bwd
#   grouped_matmul grouped_fp8 moe moe_ll untuned untuned_matmul_rs) run once at
#   world 1 with default configs: the GEMM core of every matmul family vs jnp.dot,
#   the grouped GEMM vs ragged_dot (grouped_fp8: its FP8 forms, `grouped_matmul
#   --dtype fp8`), MoE dispatch/combine (moe_ll: the low-latency layout and its
#   masked grouped GEMM vs the packed pair), the older untuned tables; at world
#   N > 1, moe and moe_ll also run expert parallel beside the BENCH_OPS;
#   SEED=s: the random-shape benches' draw (default: from the clock).
#   DOCS=1 also copies the benchmark tables and JSON into docs/perf/.
# Writes logs and results under ${OUT:-/tmp/jaxtdist-gpu}. The tuning cache is
# ${JAXTDIST_TUNING_CACHE:-$OUT/tuning.json}: the tune phase writes it, and the
# benchmarks (other processes) read it without tuning again; the GPU suite and
# the `untuned` table run without it (configs shipped with jaxtdist still apply).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/jaxtdist-gpu}
PHASES=${PHASES:-tests tune bench}
mkdir -p "$OUT"
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
WORLDS=${BENCH_WORLDS:-$( [ "$N" -gt 1 ] && echo "1 $N" || echo 1 )}
ARGS="" ITER=""
[ "$QUICK" = "--quick" ] && ARGS="--quick --iterations 10" ITER="--iterations 10"
# ITERATIONS=n: every benchmark's iteration count (default: each benchmark's own).
[ -n "${ITERATIONS:-}" ] && ARGS="${ARGS/--iterations 10/} --iterations $ITERATIONS" ITER="--iterations $ITERATIONS"
TEST_RC=0

if has smoke; then
  timed() {  # timed SECONDS NAME CMD...: CMD under a bound, its log $OUT/smoke_NAME.log
    local limit=$1 name=$2 start=$SECONDS; shift 2
    timeout "$limit" "$@" > "$OUT/smoke_$name.log" 2>&1
    echo "== smoke $name: rc $? in $((SECONDS - start)) s"
  }
  XLA_PYTHON_CLIENT_PREALLOCATE=false timed 170 tests python3 -m pytest -q -p no:cacheprovider \
    -rf tests/gpu/test_gpu_fp8.py tests/gpu/test_gpu_fp8_grouped.py tests/gpu/test_gpu_moe_ll.py
  tail -12 "$OUT/smoke_tests.log"
  JAXTDIST_PATH=fused PYTHONPATH=$PWD:${PYTHONPATH:-} timed 140 cases python3 -m jaxtdist.launch \
    --nproc-per-node 2 --share-gpu tests/multiprocess/cases_check.py --ll --overlap-grads
  grep -E "^\[rank 0\] (CHECK|TOOK|ERROR|OK|FAILED)" "$OUT/smoke_cases.log"
  SEED=${SEED:-$(( $(date +%s) % 100000 ))}
  for spec in "gemm_random gemm --random 25 --seed $SEED" "gemm_fp8 gemm --dtype fp8" \
              "attention_random ag_attention --random 10 --seed $SEED" "moe_ll moe_ll --quick"; do
    set -- $spec
    name=$1; shift
    JAXTDIST_TUNING_CACHE="$OUT/smoke_tuning_$name.json" timed 60 "$name" python3 -m jaxtdist.bench \
      "$@" --iterations 20 --json "$OUT/smoke_$name.json" --markdown "$OUT/smoke_$name.md"
    cat "$OUT/smoke_$name.md" 2>/dev/null
  done
fi
if has tests; then
  # One process per GPU (NVSHMEM), as 2 and 4 processes sharing GPU 0, with and
  # without MPS: first, from a pytest process that holds no CUDA context.
  # MULTIPROCESS=0 skips it (about 6 minutes on one GPU before the cases run the
  # low-latency MoE layout and the overlapped attention backward too, not yet timed:
  # run it in a call of its own where a call's time is bounded).
  MP_RC=0
  if [ "${MULTIPROCESS:-1}" != 0 ]; then
    JAXTDIST_TEST_MULTIPROCESS_GPU=1 timeout 1200 python3 -m pytest \
      tests/gpu/test_gpu_multiprocess.py -q -p no:cacheprovider -rs 2>&1 | tee "$OUT/gpu_tests_multiprocess.log"
    MP_RC=${PIPESTATUS[0]}
  fi
  # The suite runs without the user cache (shipped tuned configs still apply), in
  # five shards, each its own process: the TMA kernels (jaxtdist's own launcher)
  # among them, so that a fault there cannot take the rest of the suite down. On
  # one GPU the shards share it at once (the suite is compile-bound: about 5
  # minutes against over 15 one after another); with several GPUs they run one
  # after another, so that no collective kernel waits out another process's
  # time slice on a peer GPU.
  shard() {  # shard NAME PYTEST_ARGS...: log $OUT/gpu_tests_NAME.log, rc in .rc
    local name=$1; shift
    JAXTDIST_TUNING_CACHE="$OUT/tests_tuning_$name.json" timeout 900 python3 -m pytest \
      -q -p no:cacheprovider -rf "$@" > "$OUT/gpu_tests_$name.log" 2>&1
    echo $? > "$OUT/gpu_tests_$name.rc"
  }
  SHARDS=(gemm tma attention decode rest)
  run_shards() {
    local k=${PYTEST_K:+ and ($PYTEST_K)}
    shard gemm tests/gpu/test_gpu.py -k "not ag_matmul_tma$k" & [ "$N" -gt 1 ] && wait
    shard tma tests/gpu/test_gpu.py tests/gpu/test_gpu_nn.py tests/gpu/test_gpu_reliability.py \
      -k "(ag_matmul_tma or test_gpu_nn or test_gpu_reliability)$k" & [ "$N" -gt 1 ] && wait
    shard attention tests/gpu/test_gpu_ag_attention.py ${PYTEST_K:+-k "$PYTEST_K"} & [ "$N" -gt 1 ] && wait
    shard decode tests/gpu/test_gpu_flash_decode.py ${PYTEST_K:+-k "$PYTEST_K"} & [ "$N" -gt 1 ] && wait
    # Every other file (a new one included).
    shard rest $(ls tests/gpu/test_gpu_*.py \
      | grep -v -E 'test_gpu_(ag_attention|flash_decode|nn|reliability|multiprocess)\.py') \
      ${PYTEST_K:+-k "$PYTEST_K"} &
    wait
  }
  [ "$N" -eq 1 ] && export XLA_PYTHON_CLIENT_PREALLOCATE=false
  run_shards
  unset XLA_PYTHON_CLIENT_PREALLOCATE
  for name in "${SHARDS[@]}"; do
    rc=$(cat "$OUT/gpu_tests_$name.rc" 2>/dev/null || echo 1)
    # pytest's 5: nothing selected (PYTEST_K), not a failure.
    [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ] && TEST_RC=$rc
  done
  [ "$MP_RC" -ne 0 ] && TEST_RC=$MP_RC
  python3 examples/ag_matmul.py 2>&1 | tail -1 | tee "$OUT/examples.log"
  python3 examples/ring_exchange.py 2>&1 | tail -1 | tee -a "$OUT/examples.log"
fi
if has tune; then
  python3 -m jaxtdist.tune $ARGS ${TUNE_ARGS:-} --json "$OUT/ag_matmul_tuning_${DEV}x${N}.json" \
    --markdown "$OUT/ag_matmul_tuning_${DEV}x${N}.md" 2>&1 | tee "$OUT/tune.log"
fi
TABLES=() FAILED=()
bench() {  # bench NAME FILE_STEM ARGS...: one benchmark, its JSON and table under $OUT
  local name=$1 stem=$2 rc; shift 2
  rm -f "$OUT/$stem.json" "$OUT/$stem.md"
  timeout 1500 python3 -m jaxtdist.bench "$name" "$@" --json "$OUT/$stem.json" \
    --markdown "$OUT/$stem.md" 2>&1 | tee "$OUT/bench_$stem.log"
  rc=${PIPESTATUS[0]}
  if [ "$rc" -eq 0 ] && [ -s "$OUT/$stem.md" ]; then TABLES+=("$stem"); else FAILED+=("$stem (rc $rc)"); fi
}
if has bench; then
  # SM clocks, power and throttle reasons during the bench: slow episodes vs clock drops.
  nvidia-smi --query-gpu=index,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active \
    --format=csv,noheader,nounits -lms 250 > "$OUT/clocks.csv" 2>/dev/null &
  CLOCKS_PID=$!
  for W in $WORLDS; do
    for OP in ${BENCH_OPS:-all_gather ag_matmul all_reduce reduce_scatter matmul_rs matmul_ar flash_decode ag_attention moe_tp model}; do
      # The model benchmark takes no --quick (its size is --size).
      if [ "$OP" = model ]; then bench model "model_${DEV}x${W}" --world "$W" $ITER
      else bench "$OP" "${OP}_${DEV}x${W}" --world "$W" $ARGS; fi
    done
    # MoE expert-parallel dispatch/combine against XLA's all_to_all and ragged_all_to_all.
    [ "$W" -gt 1 ] && bench moe "moe_${DEV}x${W}" --world "$W" $ARGS
    # The low-latency layout (dispatch_ll / combine_ll, masked GEMM) against the packed one.
    [ "$W" -gt 1 ] && bench moe_ll "moe_ll_${DEV}x${W}" --world "$W" $ARGS
  done
  # World 1, default configs: a fresh, empty tuning cache (the subcommands make one).
  # The random-shape benches draw from SEED (default: the clock, printed in the
  # tables): defaults are judged on shapes nobody tuned.
  SEED=${SEED:-$(( $(date +%s) % 100000 ))}
  for B in ${WORLD1_BENCHES:-gemm gemm_random attention_random attention_random_bwd grouped_matmul grouped_fp8 moe moe_ll untuned untuned_matmul_rs}; do
    case $B in
      gemm_random) bench gemm "gemm_random_${DEV}x1" --random 50 --seed "$SEED" $ITER ;;
      attention_random) bench ag_attention "ag_attention_random_${DEV}x1" --random 20 --seed "$SEED" $ITER ;;
      attention_random_bwd) bench ag_attention "ag_attention_bwd_random_${DEV}x1" --random 20 --seed "$SEED" --backward $ITER ;;
      untuned) bench untuned "ag_matmul_untuned_${DEV}x1" $ITER ;;
      untuned_matmul_rs) bench untuned_matmul_rs "matmul_rs_untuned_${DEV}x1" $ITER ;;
      moe) bench moe "moe_${DEV}x1" $ARGS ;;
      moe_ll) bench moe_ll "moe_ll_${DEV}x1" $ARGS ;;
      grouped_fp8) bench grouped_matmul "grouped_fp8_${DEV}x1" --dtype fp8 $ARGS ;;
      # A fresh Triton cache: the table's first-call times are what a user's first run waits.
      gemm) TRITON_CACHE_DIR=$(mktemp -d) bench gemm "gemm_${DEV}x1" $ITER ;;
      *) bench "$B" "${B}_${DEV}x1" $ITER ;;
    esac
  done
  kill "$CLOCKS_PID" 2>/dev/null
  if python3 -c "import matplotlib" 2>/dev/null; then
    for stem in "${TABLES[@]}"; do
      python3 -m jaxtdist.bench plot "$OUT/$stem.json" --png "$OUT/$stem.png" > /dev/null
    done
  fi
  if [ "${DOCS:-0}" = 1 ]; then
    for stem in "${TABLES[@]}"; do cp "$OUT/$stem".{json,md} docs/perf/; done
    cp "$OUT"/*.png docs/perf/ 2>/dev/null
  fi
fi

echo
if has tests; then
  [ "${MULTIPROCESS:-1}" != 0 ] && echo "== GPU tests (multi-process): $(grep -E '^[0-9]+ (passed|failed|skipped|errors?)' "$OUT/gpu_tests_multiprocess.log" | tail -1)"
  for name in "${SHARDS[@]}"; do
    echo "== GPU tests ($name): $(grep -E '^[0-9]+ (passed|failed|skipped|deselected|errors?)' "$OUT/gpu_tests_$name.log" | tail -1) (rc $(cat "$OUT/gpu_tests_$name.rc"))"
  done
  grep -h -E '^(FAILED|ERROR) ' "$OUT"/gpu_tests_*.log | head -20
  cat "$OUT/examples.log"
fi
if has tune; then grep -E "best" "$OUT/tune.log"; fi
if has bench; then
  python3 tests/gpu/clock_summary.py "$OUT/clocks.csv" 2>/dev/null
  for f in "${FAILED[@]}"; do echo "== benchmark failed: $f, log $OUT/bench_${f%% *}.log"; done
  for stem in "${TABLES[@]}"; do echo; cat "$OUT/$stem.md"; done
  python3 -c "import matplotlib" 2>/dev/null || echo "
No matplotlib here: draw the plots on a machine with it, from the JSON under $OUT:
  python -m jaxtdist.bench plot $OUT/<result>.json --png <result>.png"
fi
exit $TEST_RC
