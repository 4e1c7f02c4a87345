"""The pool of interpreter workers behind the CPU heap."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import threading
from multiprocessing.connection import Listener

from jaxtdist._errors import JaxtdistError, WorkerDiedError


_AUTHKEY_ENV = "_JAXTDIST_WORKER_AUTHKEY"
_WORKER_ENV = {"TRITON_INTERPRET": "1", "_JAXTDIST_INTERPRETER_WORKER": "1"}


class KernelFailed(JaxtdistError):
    """A kernel raised inside an interpreter worker."""


# How long shutdown() waits for calls in flight before it stops the workers.
SHUTDOWN_WAIT_S = 30.0


def kernel_reference(kernel) -> tuple[str, str, str]:
    """How a worker finds ``kernel``: (module, qualified name, file)."""
    fn = kernel
    while hasattr(fn, "fn"):
        fn = fn.fn
    module = getattr(fn, "__module__", None) or "__main__"
    path = fn.__code__.co_filename
    qualname = getattr(kernel, "__name__", None) or fn.__name__
    if "<locals>" in fn.__qualname__:
        raise ValueError(
            f"jaxtdist: kernel {fn.__qualname__} is defined inside a function; the CPU "
            "backend runs kernels in worker processes, which import them by name: define "
            "kernels at module top level")
    return module, fn.__qualname__ if fn.__qualname__ else qualname, path


class WorkerPool:
    """One interpreter process per mesh position, fed through pipes."""

    def __init__(self, positions: int, shm_name: str, segment_base: int,
                 on_failure=lambda: None):
        # ``on_failure`` runs once when a worker is found dead: it releases the
        # other ranks' waits (they would wait for the dead rank until their bound).
        self._on_failure = on_failure
        self._failure: str | None = None
        self._closing = False
        self._inflight = 0
        self._idle = threading.Condition()
        # Plain subprocesses rather than multiprocessing's spawn, which would
        # re-run the user's main script in every worker.
        authkey = secrets.token_bytes(16)
        listener = Listener(family="AF_UNIX", authkey=authkey)
        env = dict(os.environ, **_WORKER_ENV)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        env[_AUTHKEY_ENV] = authkey.hex()
        self._locks = [threading.Lock() for _ in range(positions)]
        self._procs = [
            subprocess.Popen([sys.executable, "-m", "jaxtdist.interpret._worker", str(pos),
                              shm_name, str(segment_base), listener.address], env=env)
            for pos in range(positions)
        ]
        self._conns = [None] * positions
        try:
            listener._listener._socket.settimeout(300)
            for _ in range(positions):
                conn = listener.accept()
                _, pos = conn.recv()
                self._conns[pos] = conn
        except OSError as e:
            self.close()
            raise JaxtdistError(f"jaxtdist: interpreter workers did not start: {e}") from e
        finally:
            listener.close()

    def _dead_worker(self) -> str | None:
        for pos, proc in enumerate(self._procs):
            code = proc.poll()
            if code is not None:
                return (f"jaxtdist: the interpreter worker of mesh position {pos} (pid "
                        f"{proc.pid}) died (exit code {code}); the CPU backend cannot run "
                        "collectives without it. Call jaxtdist.shutdown() and then "
                        "jaxtdist.initialize(mesh) to start new workers, and trace your "
                        "functions again.")
        return None

    def _fail(self, message: str) -> None:
        if self._failure is None:
            self._failure = message
            self._on_failure()
        raise WorkerDiedError(self._failure)

    def run(self, position: int, ref, grid, args, out_specs, constexprs):
        """Runs a kernel on ``position``'s worker; returns (outputs, timed_out).

        Raises ``WorkerDiedError`` at once, on every later call too, once any worker is
        found dead; ``JaxtdistError`` when ``close`` ran while the call was in flight.
        """
        with self._idle:
            if self._closing:
                raise JaxtdistError(
                    "jaxtdist: jaxtdist.shutdown() ran while this call was in flight; its "
                    "results are lost. Call jaxtdist.initialize(mesh) and run it again.")
            self._inflight += 1
        try:
            if self._failure is None and (dead := self._dead_worker()):
                self._fail(dead)
            if self._failure is not None:
                raise WorkerDiedError(self._failure)
            with self._locks[position]:
                conn = self._conns[position]
                try:
                    conn.send((ref, grid, args, out_specs, constexprs))
                    status, payload, timed_out = conn.recv()
                except (EOFError, OSError):
                    if self._closing:
                        raise JaxtdistError(
                            "jaxtdist: jaxtdist.shutdown() stopped the workers while this call "
                            "was in flight; call jaxtdist.initialize(mesh) and run it "
                            "again.") from None
                    try:
                        self._procs[position].wait(timeout=5)
                    except subprocess.TimeoutExpired:
                        pass
                    self._fail(self._dead_worker() or
                               f"jaxtdist: the interpreter worker of mesh position {position} "
                               "stopped answering; call jaxtdist.shutdown() and then "
                               "jaxtdist.initialize(mesh).")
        finally:
            with self._idle:
                self._inflight -= 1
                self._idle.notify_all()
        if status != "ok":
            raise KernelFailed(f"jaxtdist: kernel {ref[1]} failed on mesh position {position} "
                               f"under the interpreter:\n{payload}")
        return payload, timed_out

    def close(self, wait_s: float = SHUTDOWN_WAIT_S) -> None:
        """Stops the workers after the calls in flight finish (at most ``wait_s``
        seconds; calls still running then fail with an error saying why)."""
        with self._idle:
            self._closing = True
            self._idle.wait_for(lambda: self._inflight == 0, timeout=wait_s)
        for conn in self._conns:
            try:
                if conn is not None:
                    conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for proc in self._procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
        self._conns, self._procs = [], []
