"""The pool of interpreter workers behind the CPU heap."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import threading
from collections.abc import Sequence
from multiprocessing.connection import Listener

from jaxtdist._errors import JaxtdistError, WorkerDiedError
from jaxtdist.interpret._wire import from_wire, spec_to_wire, to_wire


_AUTHKEY_ENV = "_JAXTDIST_WORKER_AUTHKEY"
_PARENT_ENV = "_JAXTDIST_PARENT_PID"
_WORKER_ENV = {"TRITON_INTERPRET": "1", "_JAXTDIST_INTERPRETER_WORKER": "1"}


class KernelFailed(JaxtdistError):
    """A kernel raised inside an interpreter worker."""

    status = "INTERNAL"  # a bug in the kernel (or the interpreter), not the runtime's state


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
    """One interpreter process per mesh position this process drives, fed through pipes.

    Args:
      positions: the mesh positions to start workers for: ``range(n)`` in one
        process, this process's own positions when the mesh spans processes.
      shm_name: the heap's shared-memory segment, which every worker maps.
      segment_base: the segment's address in this process (workers translate
        context addresses from it to their own mapping).
      on_failure: runs once when a worker is found dead or ``fail`` is called:
        it releases the other ranks' waits (they would wait for the dead rank
        until their bound).

    Example:
      >>> pool = WorkerPool([2, 3], shm.name, base)   # positions 2 and 3 of the mesh
      >>> outs, timed_out = pool.run(2, kernel_reference(k), (1,), args, specs, {})
    """

    def __init__(self, positions: int | Sequence[int], shm_name: str, segment_base: int,
                 on_failure=lambda: None):
        if isinstance(positions, int):
            positions = range(positions)
        positions = [int(p) for p in positions]
        self._on_failure = on_failure
        self._failure: str | None = None
        self._failure_type: type[JaxtdistError] = WorkerDiedError
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
        env[_PARENT_ENV] = str(os.getpid())
        self._locks = {pos: threading.Lock() for pos in positions}
        self._procs = {
            pos: subprocess.Popen([sys.executable, "-m", "jaxtdist.interpret._worker", str(pos),
                                   shm_name, str(segment_base), listener.address], env=env)
            for pos in positions
        }
        self._conns = dict.fromkeys(positions)
        try:
            listener._listener._socket.settimeout(300)
            for _ in positions:
                conn = listener.accept()
                _, pos = conn.recv()
                self._conns[pos] = conn
        except OSError as e:
            self.close()
            raise JaxtdistError(f"jaxtdist: interpreter workers did not start: {e}") from e
        finally:
            listener.close()

    def _dead_worker(self) -> str | None:
        for pos, proc in self._procs.items():
            code = proc.poll()
            if code is not None:
                return (f"jaxtdist: the interpreter worker of mesh position {pos} (pid "
                        f"{proc.pid}) died (exit code {code}); the CPU backend cannot run "
                        "collectives without it. Call jaxtdist.shutdown() and then "
                        "jaxtdist.initialize(mesh) to start new workers, and trace your "
                        "functions again.")
        return None

    @property
    def positions(self) -> list[int]:
        return list(self._procs)

    def fail(self, message: str, error: type[JaxtdistError] = WorkerDiedError) -> None:
        """Marks the pool failed (a peer process died, a kernel raised): waits are
        released, the calls in flight and every later one raise ``error(message)``."""
        with self._idle:
            first = self._failure is None
            if first:
                self._failure, self._failure_type = message, error
        if first:
            self._on_failure()

    def _fail(self, message: str) -> None:
        self.fail(message)
        raise self._failure_type(self._failure)

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
                raise self._failure_type(self._failure)
            if position not in self._locks:
                raise JaxtdistError(
                    f"jaxtdist: a kernel of mesh position {position} reached this process, "
                    f"whose interpreter workers serve positions {self.positions}; the program "
                    "runs on a mesh other than the one given to jaxtdist.initialize")
            with self._locks[position]:
                conn = self._conns[position]
                try:
                    conn.send((ref, grid, [to_wire(a) for a in args],
                               [spec_to_wire(o) for o in out_specs], constexprs))
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
            message = (f"jaxtdist: kernel {ref[1]} failed on mesh position {position} under "
                       f"the interpreter:\n{payload}")
            # Its peers may wait for what it never did: release them now (not at their
            # bound); signals are out of step, so later calls fail until re-initialized.
            self.fail(message + "\nCall jaxtdist.shutdown() and then "
                      "jaxtdist.initialize(mesh) to run kernels again.", KernelFailed)
            raise KernelFailed(message)
        if self._failure is not None:  # failed while the kernel ran: its outputs are void
            raise self._failure_type(self._failure)
        return [from_wire(out, dtype) for out, (_, dtype) in zip(payload, out_specs)], timed_out

    def close(self, wait_s: float = SHUTDOWN_WAIT_S) -> None:
        """Stops the workers after the calls in flight finish (at most ``wait_s``
        seconds; calls still running then fail with an error saying why)."""
        with self._idle:
            self._closing = True
            self._idle.wait_for(lambda: self._inflight == 0, timeout=wait_s)
        for conn in self._conns.values():
            try:
                if conn is not None:
                    conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for proc in self._procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
        self._conns, self._procs = {}, {}
