"""GPU: one process per GPU (the NVSHMEM heap), run as 2 and 4 processes sharing
one GPU, with and without MPS (issue 24, parts 1, 2 and 5 on a one-GPU machine).

Each test starts its processes with ``python -m jaxtdist.launch --share-gpu``;
they check their shards against host references (XLA's collectives refuse
several processes on one GPU). The parent must hold no CUDA context of its own
(an MPS server cannot serve a GPU another context holds memory on), so
tests/gpu/run.sh runs this file in a pytest process of its own, with
``JAXTDIST_TEST_MULTIPROCESS_GPU=1``; elsewhere it skips.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

from tests.conftest import timeout
from tests.multiprocess.checks import (CASES, GRADS, LL_CASES, OPS, OVERLAP_GRAD_CASES,
                                       TRANSFORMS, XLA_GRAD_CASES, tolerance)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPTS = os.path.join(ROOT, "tests", "multiprocess")
GPU_TOL = 5e-3  # float32 through TF32 tensor cores
# What ops_check.py --ops --transforms reports, then the chain (--grads adds GRADS).
ALL_CHECKS = (*OPS, *TRANSFORMS, "chain")

pytestmark = pytest.mark.skipif(
    os.environ.get("JAXTDIST_TEST_MULTIPROCESS_GPU") != "1" or not shutil.which("nvidia-smi"),
    reason="multi-process GPU tests run from tests/gpu/run.sh in a pytest process of their "
           "own (JAXTDIST_TEST_MULTIPROCESS_GPU=1) on a machine with a GPU")


@pytest.fixture(scope="module", params=["no-mps", "mps"])
def mps(request):
    """Runs the module's tests once without, once under an MPS daemon (root only)."""
    if request.param == "no-mps":
        yield {}
        return
    control = shutil.which("nvidia-cuda-mps-control")
    if control is None or os.geteuid() != 0:
        pytest.skip("MPS needs nvidia-cuda-mps-control run as root")
    pipe = tempfile.mkdtemp(prefix="jaxtdist-mps-pipe-")
    log = tempfile.mkdtemp(prefix="jaxtdist-mps-log-")
    env = {"CUDA_MPS_PIPE_DIRECTORY": pipe, "CUDA_MPS_LOG_DIRECTORY": log}
    subprocess.run([control, "-d"], env={**os.environ, **env}, check=True)
    try:
        yield env
    finally:
        subprocess.run([control], input=b"quit\n", env={**os.environ, **env}, timeout=30)
        time.sleep(1)


def gpu_count() -> int:
    out = subprocess.run(["nvidia-smi", "-L"], stdout=subprocess.PIPE, text=True).stdout
    return sum(line.startswith("GPU ") for line in out.splitlines())


def launch(nproc: int, extra_env: dict, *args: str, grace_s: float = 0,
           limit_s: float = 240, share_gpu: bool = True,
           script: str = "ops_check.py") -> tuple[int, str, float]:
    env = dict(os.environ)
    env.update(extra_env)
    # The kernels' protocol across processes is under test, on every shape.
    env.setdefault("JAXTDIST_PATH", "fused")
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in sys.path if p])
    env.pop("JAX_PLATFORMS", None)
    if extra_env:  # under MPS each process gets its share of the SMs
        env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(100 // nproc)
    start = time.monotonic()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "jaxtdist.launch", "--nproc-per-node", str(nproc),
             *(["--share-gpu"] if share_gpu else []), "--failure-grace-s", str(grace_s),
             os.path.join(SCRIPTS, script), *args],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            timeout=limit_s)
    except subprocess.TimeoutExpired as e:
        # What the ranks printed before the bound (the cases that ended, the one that
        # hung), which the exception alone would not show.
        out = e.output.decode(errors="replace") if isinstance(e.output, bytes) else e.output
        print((out or "")[-6000:])
        raise
    took = time.monotonic() - start
    print(proc.stdout[-6000:])
    return proc.returncode, proc.stdout, took


def rank_lines(out: str, rank: int, tag: str) -> list[str]:
    return [line.split(f"[rank {rank}] ", 1)[1] for line in out.splitlines()
            if line.startswith(f"[rank {rank}] {tag}")]


@timeout(300)
@pytest.mark.parametrize("nproc", [2, 4])
def test_every_op_on_the_nvshmem_heap(mps, nproc):
    """Every built-in op and a user kernel, each process one PE of NVSHMEM, against
    float32 host references, and vmap of each built-in op; then 16 chained
    ag_matmul -> matmul_rs calls."""
    code, out, _ = launch(nproc, mps, "--ops", "--transforms", "--chain", "16")
    assert code == 0, out[-6000:]
    for rank in range(nproc):
        assert rank_lines(out, rank, "OK") == ["OK"], out[-6000:]
        (ready,) = rank_lines(out, rank, "HEAP_READY_S")
        assert "backend=nvshmem" in ready and f"local=({rank},)" in ready, ready
        checks = dict(line.split()[1:3] for line in rank_lines(out, rank, "CHECK"))
        assert set(checks) == set(ALL_CHECKS), checks
        assert all(float(e) <= GPU_TOL for e in checks.values()), checks


def _check_cases(out: str, nproc: int, names) -> None:
    assert "XLA_COLLECTIVES" not in out and "MISMATCH" not in out, out[-6000:]
    for rank in range(nproc):
        assert rank_lines(out, rank, "OK") == ["OK"], out[-6000:]
        checks = dict(line.split()[1:3] for line in rank_lines(out, rank, "CHECK"))
        assert set(checks) == set(names), checks
        # bfloat16 cases (checks.BF16_CASES) to their own bound, the others TF32's.
        assert all(float(e) <= tolerance(name, GPU_TOL) for name, e in checks.items()), checks


@timeout(450)
@pytest.mark.parametrize("nproc", [2, 4])
def test_moe_and_attention_cases_with_processes_sharing_a_gpu(mps, nproc):
    """The MoE and attention ops' cases (tests/multiprocess/cases_check.py: skewed
    and empty routings, top-1/2/8, 50 chained calls with new routings, MoE
    gradients; ragged and empty decode shards, GQA 1/4/8, 50 growing decode steps;
    causal and not, odd shards, head dim 128 in float16 through the
    warp-specialized kernel on Hopper), each process one PE; the low-latency MoE
    layout (--ll: dispatch_ll, the masked grouped GEMM, combine_ll, FP8 dispatch,
    20 chained calls) and ag_attention's gradients through its overlapped
    backward (--overlap-grads: jaxtdist's kernels only, no XLA collective)."""
    code, out, _ = launch(nproc, mps, "--ll", "--overlap-grads", script="cases_check.py",
                          limit_s=420)
    assert code == 0, out[-6000:]
    _check_cases(out, nproc, CASES + LL_CASES + OVERLAP_GRAD_CASES)


@timeout(300)
def test_soak_of_chained_calls(mps):
    """1,000 chained ag_matmul -> matmul_rs calls on changing data, 2 processes."""
    code, out, _ = launch(2, mps, "--chain", "1000", limit_s=280)
    assert code == 0, out[-6000:]
    for rank in range(2):
        (chain,) = rank_lines(out, rank, "CHECK chain")
        assert float(chain.split()[2]) <= GPU_TOL, chain


@timeout(300)
def test_a_rank_killed_mid_chain_fails_the_survivor_within_the_bound(mps):
    """SIGKILL process 1 during a chain: process 0's next wait gives up within the
    wait bound (4 s here) and it fails with a timeout naming the silent peer."""
    bound = 4.0
    code, out, took = launch(2, mps, "--chain", "12", "--die-after", "3", "--victim", "1",
                             "--wait-timeout-s", str(bound), grace_s=90)
    assert code != 0 and "VICTIM dying" in out, out[-6000:]
    (failed,) = rank_lines(out, 0, "CHAIN_FAILED")
    assert "timed out" in failed and "rank 0" in failed, failed
    seconds = float(re.search(r"after ([\d.]+) s", failed).group(1))
    assert seconds < 2 * bound + 10, failed


@timeout(300)
def test_one_gpu_per_process():
    """The production layout: every process its own GPU (peers over NVLink through
    nvshmem_ptr), every op, then 1,000 chained calls."""
    n = min(gpu_count(), 4)
    if n < 2:
        pytest.skip(f"needs 2 GPUs, {n} visible")
    code, out, _ = launch(n, {}, "--ops", "--transforms", "--grads", "--chain", "1000",
                          share_gpu=False, limit_s=280)
    assert code == 0, out[-6000:]
    assert "XLA_COLLECTIVES" not in out, out[-6000:]
    for rank in range(n):
        assert rank_lines(out, rank, "OK") == ["OK"], out[-6000:]
        checks = dict(line.split()[1:3] for line in rank_lines(out, rank, "CHECK"))
        assert set(checks) == {*ALL_CHECKS, *GRADS}, checks
        assert all(float(e) <= GPU_TOL for e in checks.values()), checks


@timeout(450)
def test_moe_and_attention_cases_one_gpu_per_process():
    """The cases above in the production layout, with ag_attention's gradients
    both ways (--xla-grads: its backward gathering through XLA's collectives,
    which work here; --overlap-grads: the overlapped kernels)."""
    n = min(gpu_count(), 4)
    if n < 2:
        pytest.skip(f"needs 2 GPUs, {n} visible")
    code, out, _ = launch(n, {}, "--xla-grads", "--ll", "--overlap-grads",
                          script="cases_check.py", share_gpu=False, limit_s=420)
    assert code == 0, out[-6000:]
    _check_cases(out, n, CASES + XLA_GRAD_CASES + LL_CASES + OVERLAP_GRAD_CASES)


@timeout(300)
@pytest.mark.parametrize("nproc", [2, 4])
def test_gradients_with_processes_sharing_a_gpu(nproc):
    """remat + grad of ag_matmul and matmul_rs, their backward on jaxtdist's kernels
    only (no XLA collective, which processes sharing a GPU could not run), with 2
    and 4 processes."""
    # Last in the file: a timed-out rank is ended by the launcher, which can leave
    # an MPS daemon unusable for later runs.
    code, out, _ = launch(nproc, {}, "--ops", "--grads", "--chain", "2",
                          "--wait-timeout-s", "20", limit_s=280)
    assert code == 0, out[-6000:]
    assert "XLA_COLLECTIVES" not in out, out[-6000:]
    for rank in range(nproc):
        checks = dict(line.split()[1:3] for line in rank_lines(out, rank, "CHECK"))
        assert set(checks) == {*OPS, *GRADS, "chain"}, checks
        assert all(float(e) <= GPU_TOL for e in checks.values()), checks
