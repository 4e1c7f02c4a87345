"""The launcher's process supervision: start N ranks, relay their output with a
rank prefix, forward signals, and end the job as soon as one rank fails.

Example:
  >>> opts = LaunchOptions(nproc=2, command=[sys.executable, "prog.py"])
  >>> exit_code = run(opts)
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence

from jaxtdist.launch import (ENV_COORDINATOR, ENV_FAILURE_STAMP, ENV_LOCAL_RANK,
                             ENV_NUM_PROCESSES, ENV_PROCESS_ID)

# Seconds between two looks at the ranks: how late the launcher notices a failure.
_POLL_S = 0.05
# How long a failure's attribution waits for the reaper threads' exit stamps.
_STAMP_WAIT_S = 2.0
# After an error exit, how long a rank killed by a signal still counts as the cause.
_SETTLE_S = 1.0


@dataclasses.dataclass
class LaunchOptions:
    """What ``python -m jaxtdist.launch`` was asked to run (see ``--help``)."""
    nproc: int
    command: Sequence[str]
    share_gpu: bool = False
    cpu_devices: int = 1
    failure_grace_s: float = 0.0
    kill_after_s: float = 5.0
    port: int | None = None


def free_port() -> int:
    """A TCP port free on localhost now (the coordinator binds it moments later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _visible_gpu(rank: int, share_gpu: bool) -> str:
    """The CUDA_VISIBLE_DEVICES of ``rank``: the rank-th of the launcher's own visible
    devices (all of them when unset), or the first one for every rank with --share-gpu."""
    inherited = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d]
    index = 0 if share_gpu else rank
    if inherited:
        if index >= len(inherited):
            raise ValueError(
                f"jaxtdist.launch: rank {rank} needs a GPU but CUDA_VISIBLE_DEVICES="
                f"{os.environ['CUDA_VISIBLE_DEVICES']!r} lists {len(inherited)}; lower "
                "--nproc-per-node, widen CUDA_VISIBLE_DEVICES, or pass --share-gpu")
        return inherited[index]
    return str(index)


def child_env(rank: int, opts: LaunchOptions, coordinator: str,
              failure_stamp: str | None = None) -> dict[str, str]:
    """The environment of rank ``rank``: what jax.distributed.initialize needs, its
    device, unbuffered output (lines reach the prefixer as they are printed), and
    the file where an uncaught exception stamps its time."""
    env = dict(os.environ)
    env.pop(ENV_FAILURE_STAMP, None)
    if failure_stamp is not None:
        env[ENV_FAILURE_STAMP] = failure_stamp
    env.update({
        ENV_COORDINATOR: coordinator,
        ENV_NUM_PROCESSES: str(opts.nproc),
        ENV_PROCESS_ID: str(rank),
        ENV_LOCAL_RANK: str(rank),
        "CUDA_VISIBLE_DEVICES": _visible_gpu(rank, opts.share_gpu),
        "JAX_NUM_CPU_DEVICES": str(opts.cpu_devices),
        "PYTHONUNBUFFERED": "1",
    })
    # One host: NVSHMEM's bootstrap talks over loopback and needs no network
    # transport (peers are NVLink or the same GPU).
    for key, value in (("NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME", "lo"),
                       ("NVSHMEM_REMOTE_TRANSPORT", "none"),
                       ("NVSHMEM_DISABLE_NVLS", "1")):
        env.setdefault(key, value)
    if opts.share_gpu:
        # Every rank's XLA would preallocate 75% of the one GPU.
        env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
        # XLA's collectives fail with every rank on one GPU ("Duplicate GPU
        # detected"): no op may take its decomposed path (XLA's collective + dot).
        env.setdefault("JAXTDIST_PATH", "fused")
    # XLA's older host-device flag would override JAX_NUM_CPU_DEVICES.
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "",
                   env.get("XLA_FLAGS", "")).strip()
    if flags:
        env["XLA_FLAGS"] = flags
    else:
        env.pop("XLA_FLAGS", None)
    return env


def _die_with_launcher() -> None:
    # Runs in the child before exec: a SIGKILLed launcher takes its ranks along.
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _relay(rank: int, stream, out, lock: threading.Lock) -> None:
    prefix = f"[rank {rank}] ".encode()
    for line in iter(stream.readline, b""):
        with lock:
            out.write(prefix + line if line.endswith(b"\n") else prefix + line + b"\n")
            out.flush()
    stream.close()


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _say(message: str) -> None:
    print(f"[launch] {message}", file=sys.stderr, flush=True)


class _Job:
    def __init__(self, opts: LaunchOptions):
        self.opts = opts
        self.coordinator = f"127.0.0.1:{opts.port or free_port()}"
        self.procs: list[subprocess.Popen] = []
        self.failed: tuple[int, int] | None = None   # (rank, exit code)
        self.signalled: int | None = None
        self.term_at: float | None = None             # when to SIGTERM the others
        self.kill_at: float | None = None             # when to SIGKILL what is left
        self.settle_at = 0.0                           # until when a killed rank is the cause
        self.sent = False                              # whether the launcher signalled ranks
        # When each rank was reaped, by a thread blocked in its wait: the polls 0.05 s
        # apart cannot order two ranks that exit between them (a rank's error, then
        # its peer's about it), and the first to exit is the cause.
        self.exited_at: dict[int, float] = {}
        # Where each rank's uncaught exception writes its time (earlier than its exit).
        self.stamp_dir: str | None = None
        self.unstamped_since: float | None = None     # a failed rank seen without its stamp

    def start(self) -> list[threading.Thread]:
        lock = threading.Lock()
        self.stamp_dir = tempfile.mkdtemp(prefix="jaxtdist-launch-")
        envs = [child_env(r, self.opts, self.coordinator, self._stamp_path(r))
                for r in range(self.opts.nproc)]
        for env in envs:
            self.procs.append(subprocess.Popen(
                list(self.opts.command), env=env, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                preexec_fn=_die_with_launcher))
        threads = [threading.Thread(target=_relay, args=(r, p.stdout, sys.stdout.buffer, lock),
                                    daemon=True) for r, p in enumerate(self.procs)]
        for t in threads:
            t.start()
        for r, p in enumerate(self.procs):
            threading.Thread(target=self._reap, args=(r, p), daemon=True).start()
        return threads

    def _stamp_path(self, rank: int) -> str:
        return os.path.join(self.stamp_dir, f"rank{rank}")

    def _reap(self, rank: int, proc: subprocess.Popen) -> None:
        proc.wait()
        exited = time.monotonic()
        # A rank that failed with an uncaught exception stamped when: its teardown
        # (unmapping a large heap) can end after a peer's exit about its death.
        try:
            with open(self._stamp_path(rank)) as f:
                exited = min(exited, float(f.read()))
        except (OSError, ValueError):
            pass
        self.exited_at[rank] = exited

    def cleanup(self) -> None:
        if self.stamp_dir is not None:
            shutil.rmtree(self.stamp_dir, ignore_errors=True)

    def send(self, sig: int) -> None:
        self.sent = True
        for p in self.procs:
            if p.poll() is None:
                try:
                    p.send_signal(sig)
                except ProcessLookupError:
                    pass

    def on_signal(self, signum: int, frame) -> None:
        del frame
        if self.signalled is None:
            self.signalled = signum
            _say(f"got {signal.Signals(signum).name}: forwarding it to every rank "
                 "(send it again to kill them)")
            self.send(signum)
            self.kill_at = time.monotonic() + self.opts.kill_after_s
        else:
            self.send(signal.SIGKILL)

    def step(self) -> bool:
        """One look at the ranks; False once all have exited (and a failure, if any,
        is attributed)."""
        now = time.monotonic()
        codes = [p.poll() for p in self.procs]
        deferred = False  # a failure waits for its exit stamps: look again
        if self.failed is None and self.signalled is None:  # else the launcher ends them
            failed = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0)]
            # A rank's exit code can show before its reaper thread stamped the time (the
            # thread waits for the GIL in between): without the stamp, a victim would
            # sort after the survivor that exited because of it. Wait for the stamps
            # (a look or two; at most _STAMP_WAIT_S).
            unstamped = [rank for rank, _ in failed if rank not in self.exited_at]
            if unstamped:
                self.unstamped_since = self.unstamped_since or now
                if now - self.unstamped_since < _STAMP_WAIT_S:
                    failed, deferred = [], True
            if failed:
                # Ranks seen dead in the same look: a rank killed by a signal first (a
                # survivor that noticed its peer's death exits right after it, with
                # an error of its own), then the first to exit, then the lowest rank.
                failed.sort(key=lambda rc: (rc[1] >= 0, self.exited_at.get(rc[0], now), rc[0]))
                rank, code = self.failed = failed[0]
                running = [r for r, c in enumerate(codes) if c is None]
                also = "".join(f"; rank {r} failed too ({_describe(c)})" for r, c in failed[1:])
                _say(f"rank {rank} failed ({_describe(code)})" + also
                     + (f"; ending ranks {running}" if running else ""))
                self.term_at = now + self.opts.failure_grace_s
                self.settle_at = now + _SETTLE_S
        elif (self.failed is not None and self.failed[1] >= 0 and now < self.settle_at
              and not self.sent):
            # A rank killed by a signal (none of ours yet) just after another's error
            # exit is the likely cause: its teardown can outlast the survivor's.
            killed = [(rank, code) for rank, code in enumerate(codes)
                      if code is not None and code < 0]
            if killed:
                rank, code = self.failed = killed[0]
                _say(f"rank {rank} failed ({_describe(code)}), the likely cause")
        if self.term_at is not None and now >= self.term_at:
            self.term_at = None
            self.send(signal.SIGTERM)
            self.kill_at = now + self.opts.kill_after_s
        if self.kill_at is not None and now >= self.kill_at:
            self.kill_at = None
            self.send(signal.SIGKILL)
        return deferred or any(c is None for c in codes)

    def exit_code(self) -> int:
        if self.failed is not None:
            code = self.failed[1]
            return 128 - code if code < 0 else code
        if self.signalled is not None:
            return 128 + self.signalled
        return 0


def run(opts: LaunchOptions) -> int:
    """Runs the job to its end; returns the launcher's exit code: 0 when every rank
    exited 0, else the first failing rank's (128 + signal when it was killed)."""
    if opts.nproc < 1:
        raise ValueError(f"jaxtdist.launch: --nproc-per-node {opts.nproc}; allowed: >= 1")
    job = _Job(opts)
    previous = {s: signal.signal(s, job.on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        threads = job.start()
        while job.step():
            time.sleep(_POLL_S)
        for t in threads:
            t.join(timeout=5)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        job.send(signal.SIGKILL)
        job.cleanup()
    return job.exit_code()
