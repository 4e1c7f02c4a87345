#!/usr/bin/env bash
# GPU suite + benchmarks in one go; prints a short table last.
# Usage (repo root, on the GPU node): bash tests/gpu/run.sh [--quick]
# Writes logs and raw results under ${OUT:-/tmp/jaxtdist-gpu} and docs/perf/.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/jaxtdist-gpu}
mkdir -p "$OUT" docs/perf
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export PYTHONUNBUFFERED=1 JAXTDIST_TEST_GPU=1
QUICK=${1:-}

if [ -d .whl ] && ! python3 -c "import jax_triton" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 \
  || { tail -30 "$OUT/install.log"; exit 1; }
python3 -c "import jaxtdist._jaxtdist_ffi as m; print('native library, CUDA:', m.with_cuda)"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -8

timeout 900 python3 -m pytest tests/gpu -q -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log"
TEST_RC=${PIPESTATUS[0]}
python3 examples/ag_matmul.py 2>&1 | tail -1 | tee "$OUT/examples.log"
python3 examples/ring_exchange.py 2>&1 | tail -1 | tee -a "$OUT/examples.log"

DEV=$(python3 -c "import jax; print(jax.devices()[0].device_kind.replace(' ', '_'))")
N=$(python3 -c "import jax; print(len(jax.devices()))")
TAG="${DEV}x${N}"
ARGS=""
[ "$QUICK" = "--quick" ] && ARGS="--quick --iterations 10"
python3 -m jaxtdist.bench all_gather --json "docs/perf/all_gather_${TAG}.json" \
  --markdown "docs/perf/all_gather_${TAG}.md" 2>&1 | tee "$OUT/bench_all_gather.log"
python3 -m jaxtdist.bench ag_matmul $ARGS --json "docs/perf/ag_matmul_${TAG}.json" \
  --markdown "docs/perf/ag_matmul_${TAG}.md" 2>&1 | tee "$OUT/bench_ag_matmul.log"
cp docs/perf/*_"${TAG}".* "$OUT/" 2>/dev/null

echo
echo "== GPU tests: $(grep -E '^[0-9]+ (passed|failed|skipped|errors?)' "$OUT/gpu_tests.log" | tail -1)"
cat "$OUT/examples.log"
cat "docs/perf/all_gather_${TAG}.md" 2>/dev/null
echo
cat "docs/perf/ag_matmul_${TAG}.md" 2>/dev/null
exit $TEST_RC
