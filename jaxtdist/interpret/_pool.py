"""The pool of interpreter workers behind the CPU heap."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import threading
from multiprocessing.connection import Listener

from jaxtdist._errors import JaxtdistError


_AUTHKEY_ENV = "_JAXTDIST_WORKER_AUTHKEY"
_WORKER_ENV = {"TRITON_INTERPRET": "1", "_JAXTDIST_INTERPRETER_WORKER": "1"}


class KernelFailed(JaxtdistError):
    """A kernel raised inside an interpreter worker."""


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

    def __init__(self, positions: int, shm_name: str, segment_base: int):
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

    def run(self, position: int, ref, grid, args, out_specs, constexprs):
        """Runs a kernel on ``position``'s worker; returns (outputs, timed_out)."""
        with self._locks[position]:
            conn = self._conns[position]
            conn.send((ref, grid, args, out_specs, constexprs))
            status, payload, timed_out = conn.recv()
        if status != "ok":
            raise KernelFailed(f"jaxtdist: kernel {ref[1]} failed on mesh position {position} "
                               f"under the interpreter:\n{payload}")
        return payload, timed_out

    def close(self) -> None:
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
