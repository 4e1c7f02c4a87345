"""The multi-process layout on CPU (issue 24, parts 4-6): several processes
joined by jax.distributed on localhost, one shared-memory heap, started by
``python -m jaxtdist.launch``; every op against a host reference, a rank
killed mid-chain, ranks that never join.

Each test starts fresh processes (their JAX must not be this process's), so
none depends on conftest's 8 host devices.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

from tests.conftest import cpu_only, slow, timeout

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "tests", "multiprocess")

pytestmark = cpu_only()


def launch(nproc: int, script: str, *args: str, launcher_args: tuple[str, ...] = (),
           limit_s: float = 150) -> tuple[int, str, float]:
    """Runs ``script`` under the launcher; (exit code, output, seconds)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in sys.path if p])
    env.pop("JAX_PLATFORMS", None)
    env["JAX_PLATFORMS"] = "cpu"
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "jaxtdist.launch", "--nproc-per-node", str(nproc),
         *launcher_args, os.path.join(SCRIPTS, script), *args],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        timeout=limit_s)
    return proc.returncode, proc.stdout, time.monotonic() - start


def rank_lines(out: str, rank: int, tag: str) -> list[str]:
    return [line.split(f"[rank {rank}] ", 1)[1] for line in out.splitlines()
            if line.startswith(f"[rank {rank}] {tag}")]


@timeout(240)
@pytest.mark.parametrize("nproc,devices,transforms", [(2, 1, True), (4, 1, False),
                                                      (2, 2, False)])
def test_every_op_matches_the_host_reference(nproc, devices, transforms):
    """ag_matmul, all_gather, all_reduce, reduce_scatter, matmul_rs, matmul_ar and a
    user kernel through triton_call on a mesh spanning processes, each process
    checking its shards against float32 references from the same seeds (with
    ``transforms``, also vmap of each built-in op and remat + grad of the
    matmuls), then a chain of ag_matmul -> matmul_rs calls on changing data."""
    from tests.multiprocess.checks import GRADS, OPS, TRANSFORMS

    code, out, _ = launch(nproc, "ops_check.py", "--ops",
                          *(["--transforms", "--grads"] if transforms else []),
                          launcher_args=("--cpu-devices-per-process", str(devices)))
    assert code == 0, out[-4000:]
    for rank in range(nproc):
        assert rank_lines(out, rank, "OK") == ["OK"], out[-4000:]
        checks = dict(line.split()[1:3] for line in rank_lines(out, rank, "CHECK"))
        assert set(checks) == {*OPS, *(TRANSFORMS + GRADS if transforms else ()), "chain"}, checks
        assert "XLA_COLLECTIVES" not in out, out[-4000:]  # the CPU backward keeps its gather
        assert all(float(err) <= 1e-5 for err in checks.values()), checks
        (ready,) = rank_lines(out, rank, "HEAP_READY_S")
        local = tuple(range(rank * devices, (rank + 1) * devices))
        assert f"local={local}" in ready, ready


@timeout(120)
@pytest.mark.parametrize("victim", [1, 0])
def test_a_rank_killed_mid_chain_fails_the_job(victim):
    """SIGKILL one of 2 processes in the middle of chained ops: the launcher exits
    non-zero; with a grace period the survivor reports, within a second, an error
    naming the dead process, or (victim 0 hosts the coordination service) JAX
    ends it at once."""
    code, out, took = launch(2, "ops_check.py", "--chain", "8", "--die-after", "3",
                             "--victim", str(victim),
                             launcher_args=("--failure-grace-s", "60"))
    assert code != 0 and "VICTIM dying" in out, out[-4000:]
    assert f"[launch] rank {victim} failed (killed by SIGKILL)" in out, out[-4000:]
    survivor = 1 - victim
    # Victim 0 hosts JAX's coordination service: JAX may end the survivor before
    # jaxtdist's peer watch reports the death (both are a clear end, never a hang).
    jax_ended_it = "Terminating process because the JAX distributed service" in out
    if victim == 1 or not jax_ended_it:
        (failed,) = rank_lines(out, survivor, "CHAIN_FAILED")
        # The status and jaxtdist's error lead the message. The type is JaxRuntimeError,
        # or ValueError where jit's C++ path ran a small one-device program inline.
        assert re.search(r": (JaxRuntimeError|ValueError): UNAVAILABLE: "
                         rf"jaxtdist\.WorkerDiedError: process {victim} \(pid \d+, mesh "
                         r"positions \[\d+(, \d+)*\]\) died", failed), failed
        seconds = float(re.search(r"after ([\d.]+) s", failed).group(1))
        assert seconds < 10, failed   # the peer watch looks every 0.2 s
    assert took < 60, took            # never the kernels' wait bound (60 s here)


@timeout(120)
@pytest.mark.parametrize("death,failed", [("raise", 1), ("exit0", 0)])
def test_an_uncaught_exception_ends_its_rank_at_once(death, failed):
    """A rank whose exception nobody catches (its own, or the survivor's error
    about a peer that exited with code 0) ends at once with exit code 1: Python's
    exit would wait in jax.distributed's shutdown barrier for the blocked peer, so
    that the job ended at the kernels' wait bound naming the survivor, or after
    JAX's heartbeat timeout with an abort."""
    code, out, took = launch(2, "ops_check.py", "--chain", "8", "--die-after", "3",
                             "--victim", "1", "--death", death, "--uncaught",
                             launcher_args=("--failure-grace-s", "60"))
    assert code == 1 and "VICTIM dying" in out, out[-4000:]
    assert f"[launch] rank {failed} failed (exit code 1)" in out, out[-4000:]
    if death == "raise":
        assert "RuntimeError: the victim raises at call 3" in out, out[-4000:]
    else:
        assert re.search(r"\[rank 0\] .*WorkerDiedError: process 1 \(pid \d+", out), out[-4000:]
    assert took < 45, took  # neither the wait bound (60 s) nor JAX's heartbeat timeout


def test_the_launcher_names_the_killed_rank_when_a_survivor_exits_first(capsys):
    """A survivor that notices its peer's death exits within a poll of it: when the
    launcher sees both dead at once it names (and exits with) the rank killed by a
    signal, not the lower rank's own error exit."""
    from jaxtdist.launch._supervisor import LaunchOptions, _Job

    class Exited:
        def __init__(self, code):
            self.code = code

        def poll(self):
            return self.code

    job = _Job(LaunchOptions(nproc=3, command=["true"], port=1))
    job.procs = [Exited(3), Exited(-9), Exited(None)]
    job.exited_at = {0: 1.0, 1: 2.0}  # the reaper threads' stamps
    job.send = lambda sig: None
    assert job.step()  # rank 2 still runs
    assert job.failed == (1, -9) and job.exit_code() == 128 + 9
    said = capsys.readouterr()
    assert ("rank 1 failed (killed by SIGKILL); rank 0 failed too (exit code 3); ending ranks "
            "[2]") in said.out + said.err
    # The killed rank's teardown outlasts the survivor's: seen one look later (before the
    # launcher signalled anyone), it still becomes the cause.
    job = _Job(LaunchOptions(nproc=2, command=["true"], port=1, failure_grace_s=30))
    job.procs = [Exited(3), Exited(None)]
    job.exited_at = {0: 1.0}
    assert job.step() and job.failed == (0, 3)
    job.procs[1].code = -9
    job.exited_at[1] = 2.0
    assert not job.step()
    assert job.failed == (1, -9) and job.exit_code() == 128 + 9
    said = capsys.readouterr()
    assert "rank 1 failed (killed by SIGKILL), the likely cause" in said.out + said.err
    # An exit code seen before its reaper stamped the time: the failure waits for the
    # stamp, which names the rank that exited first (not the lower rank).
    job = _Job(LaunchOptions(nproc=2, command=["true"], port=1, failure_grace_s=30))
    job.procs = [Exited(1), Exited(1)]
    job.exited_at = {0: 2.0}
    assert job.step() and job.failed is None  # both exited, but look again
    job.exited_at[1] = 1.0
    assert not job.step() and job.failed == (1, 1)
    said = capsys.readouterr()
    assert "rank 1 failed (exit code 1); rank 0 failed too (exit code 1)" in said.out + said.err


def test_a_failure_stamp_orders_ranks_reaped_in_the_other_order(tmp_path):
    """A rank's uncaught exception stamps its time before its (slow) teardown: the
    launcher names it although its peer, failing because of it, was reaped first."""
    from jaxtdist.launch._supervisor import LaunchOptions, _Job

    class Done:
        def __init__(self, code):
            self.code = code

        def wait(self):
            return self.code

    job = _Job(LaunchOptions(nproc=2, command=["true"], port=1))
    job.stamp_dir = str(tmp_path)
    (tmp_path / "rank1").write_text(repr(time.monotonic() - 5.0))  # failed 5 s ago
    job._reap(0, Done(1))                # the survivor, reaped first and unstamped
    job._reap(1, Done(1))                # the victim, reaped last
    assert job.exited_at[1] < job.exited_at[0]
    (tmp_path / "rank0").write_text("not a time")  # a torn stamp: the reap time counts
    job._reap(0, Done(1))
    assert job.exited_at[0] > job.exited_at[1]


@timeout(120)
def test_the_launcher_ends_the_others_at_once():
    """Without a grace period the launcher ends the surviving rank as soon as one
    fails, and exits with the failed rank's code (128 + SIGKILL). The survivor may
    see the death first (WorkerDiedError) and be gone before the launcher's next
    look: then it is reported as having failed too, the killed rank still the cause."""
    code, out, took = launch(2, "ops_check.py", "--chain", "50", "--die-after", "2",
                             "--victim", "1")
    assert code == 128 + 9, out[-4000:]
    assert re.search(r"\[launch\] rank 1 failed \(killed by SIGKILL\); (ending ranks \[0\]"
                     r"|rank 0 failed too \(exit code \d+\))", out), out[-4000:]
    assert took < 60, took


@timeout(120)
@pytest.mark.parametrize("victim", [1, 0])
def test_a_rank_that_never_calls_initialize_is_named(victim):
    """A process in jax.distributed that never calls jaxtdist.initialize: the other
    fails after bootstrap_timeout_s (3 s here) with an error naming it."""
    code, out, took = launch(2, "never_joins.py", "--stage", "jaxtdist", "--victim",
                             str(victim), "--bound-s", "3")
    assert code == 3, out[-4000:]
    (failed,) = rank_lines(out, 1 - victim, "FAILED_AFTER")
    assert "BootstrapTimeoutError" in failed, failed
    assert f"process {victim} (of 2) did not reach jaxtdist.initialize within 3 s" in failed
    assert 2.5 < float(failed.split()[1].rstrip(":")) < 10, failed
    assert took < 60, took


@timeout(120)
def test_a_rank_that_never_joins_jax_distributed_fails_the_job():
    """A process that never calls jax.distributed.initialize: JAX's own bound
    (initialization_timeout, 3 s here) ends the others; the launcher exits non-zero."""
    code, out, took = launch(2, "never_joins.py", "--stage", "distributed", "--bound-s", "3")
    assert code != 0, out[-4000:]
    assert "[launch] rank 0 failed" in out, out[-4000:]
    assert took < 60, took


@timeout(60)
def test_launcher_prefixes_lines_and_passes_the_job_variables(tmp_path):
    prog = tmp_path / "show.py"
    prog.write_text("import os, sys\n"
                    "print(os.environ['JAXTDIST_PROCESS_ID'], os.environ['JAXTDIST_NUM_PROCESSES'],"
                    " os.environ['JAX_COORDINATOR_ADDRESS'].startswith('127.0.0.1:'),"
                    " os.environ['CUDA_VISIBLE_DEVICES'], os.environ['JAX_NUM_CPU_DEVICES'],"
                    " sys.argv[1:])\n")
    proc = subprocess.run([sys.executable, "-m", "jaxtdist.launch", "--nproc-per-node", "3",
                           "--cpu-devices-per-process", "2", str(prog), "a", "--b"],
                          cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout
    for r in range(3):
        assert f"[rank {r}] {r} 3 True {r} 2 ['a', '--b']" in proc.stdout, proc.stdout
    shared = subprocess.run([sys.executable, "-m", "jaxtdist.launch", "--nproc-per-node", "2",
                             "--share-gpu", str(prog)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, timeout=60)
    assert "[rank 1] 1 2 True 0 1 []" in shared.stdout, shared.stdout


@timeout(120)
def test_sub_meshes_spanning_processes():
    """A dp x tp mesh over 2 processes x 2 devices: all_reduce over tp, with tp
    across the processes and within each (initialize twice: new keys)."""
    code, out, _ = launch(2, "submesh_check.py",
                          launcher_args=("--cpu-devices-per-process", "2"))
    assert code == 0, out[-4000:]
    for rank in range(2):
        errs = dict(line.split()[1:3] for line in rank_lines(out, rank, "SUBMESH"))
        assert set(errs) == {"tp-across", "tp-within"}, out[-4000:]
        assert all(float(e) <= 1e-6 for e in errs.values()), errs


@timeout(240)
def test_moe_and_attention_cases_across_processes():
    """The MoE and attention ops' cases (tests/multiprocess/cases_check.py: skewed
    and empty routings, top-1/2/8, chained calls with new routings, MoE gradients;
    ragged and empty decode shards, GQA 1/4/8, 50 growing decode steps; causal and
    not, odd shards, head dim 128) over 2 processes, no XLA collective."""
    from tests.multiprocess.checks import CASES

    code, out, _ = launch(2, "cases_check.py", limit_s=230)
    assert code == 0, out[-4000:]
    assert "XLA_COLLECTIVES" not in out, out[-4000:]
    for rank in range(2):
        assert rank_lines(out, rank, "OK") == ["OK"], out[-4000:]
        checks = dict(line.split()[1:3] for line in rank_lines(out, rank, "CHECK"))
        assert set(checks) == set(CASES), checks
        assert all(float(err) <= 1e-5 for err in checks.values()), checks


@slow()
@timeout(420)
def test_low_latency_moe_and_overlapped_attention_backward_across_processes():
    """cases_check.py with --ll and --overlap-grads over 2 processes: the cases above,
    then the low-latency MoE layout (dispatch_ll -> experts, the masked grouped
    GEMM among them -> combine_ll, FP8 dispatch, skewed and invalid routings, 20
    chained calls; counts exact) and ag_attention's gradients through its
    overlapped backward, no XLA collective. About 130 s on 2 shared cores (the
    cases above alone 57 s), hence JAXTDIST_TEST_SLOW."""
    from tests.multiprocess.checks import CASES, LL_CASES, OVERLAP_GRAD_CASES, tolerance

    code, out, _ = launch(2, "cases_check.py", "--ll", "--overlap-grads", limit_s=400)
    assert code == 0, out[-4000:]
    assert "XLA_COLLECTIVES" not in out and "MISMATCH" not in out, out[-4000:]
    for rank in range(2):
        assert rank_lines(out, rank, "OK") == ["OK"], out[-4000:]
        checks = dict(line.split()[1:3] for line in rank_lines(out, rank, "CHECK"))
        assert set(checks) == {*CASES, *LL_CASES, *OVERLAP_GRAD_CASES}, checks
        assert all(float(err) <= tolerance(name, 1e-5) for name, err in checks.items()), checks
