"""Starting multi-process jaxtdist jobs: ``python -m jaxtdist.launch`` and
the helper its processes call.

One host: ``python -m jaxtdist.launch --nproc-per-node 2 prog.py ARGS`` starts
2 processes of ``prog.py``, each with the variables below; ``prog.py`` calls
``jaxtdist.launch.initialize_from_env()`` (or ``jax.distributed.initialize``
with the same values) before anything else touches JAX's devices. Under
SLURM, Open MPI or Kubernetes, ``initialize_from_env()`` falls back to JAX's
own cluster detection. See docs/multiprocess.md.

Example (prog.py):
  >>> import jaxtdist, jaxtdist.launch
  >>> jaxtdist.launch.initialize_from_env()
  >>> mesh = jax.make_mesh((jax.device_count(),), ("tp",))
  >>> jaxtdist.initialize(mesh)
"""

from __future__ import annotations

import os

# Set by the launcher in every process it starts.
ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"   # honoured by jax.distributed.initialize too
ENV_NUM_PROCESSES = "JAXTDIST_NUM_PROCESSES"
ENV_PROCESS_ID = "JAXTDIST_PROCESS_ID"
ENV_LOCAL_RANK = "JAXTDIST_LOCAL_RANK"
# Optional: seconds JAX's coordination service waits for a silent process
# before it declares it dead (jax.distributed's heartbeat_timeout_seconds).
ENV_HEARTBEAT_TIMEOUT = "JAXTDIST_HEARTBEAT_TIMEOUT_S"
# Optional: seconds jax.distributed.initialize waits for every process to connect.
ENV_INIT_TIMEOUT = "JAXTDIST_INIT_TIMEOUT_S"
# Set by the launcher: the file where an uncaught exception writes when it happened
# (CLOCK_MONOTONIC, one clock for every process of the host).
ENV_FAILURE_STAMP = "JAXTDIST_FAILURE_STAMP"


def _int_env(name: str) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return None
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"jaxtdist.launch: ${name}={raw!r} is not a number") from None
    if not value.is_integer():
        raise ValueError(f"jaxtdist.launch: ${name}={raw!r} must be a whole number")
    return int(value)


def distributed_args() -> dict:
    """The ``jax.distributed.initialize`` arguments the launcher's variables give
    (empty when this process was not started by ``python -m jaxtdist.launch``)."""
    args: dict = {}
    if os.environ.get(ENV_PROCESS_ID) is not None:
        args = {"coordinator_address": os.environ.get(ENV_COORDINATOR),
                "num_processes": _int_env(ENV_NUM_PROCESSES),
                "process_id": _int_env(ENV_PROCESS_ID)}
        missing = [k for k, v in args.items() if v is None]
        if missing:
            raise ValueError(
                f"jaxtdist.launch: ${ENV_PROCESS_ID} is set but {missing} are not (expected "
                f"${ENV_COORDINATOR}, ${ENV_NUM_PROCESSES}); start the program with "
                "`python -m jaxtdist.launch` or unset it")
    for key, env in (("heartbeat_timeout_seconds", ENV_HEARTBEAT_TIMEOUT),
                     ("initialization_timeout", ENV_INIT_TIMEOUT)):
        value = _int_env(env)
        if value is not None:
            args[key] = value
    return args


def initialize_from_env(**kwargs) -> None:
    """``jax.distributed.initialize`` with what ``python -m jaxtdist.launch`` set.

    Outside the launcher it is ``jax.distributed.initialize(**kwargs)``, so
    JAX's cluster detection (SLURM, Open MPI, Kubernetes) applies. Keyword
    arguments override the environment. Call it before anything else uses
    JAX's devices.

    Under the launcher, an uncaught exception then ends the process at once with
    exit code 1 after printing its traceback (atexit handlers do not run): Python's
    usual exit waits in jax.distributed's shutdown barrier for peers that may be
    blocked on this rank.

    Example:
      >>> jaxtdist.launch.initialize_from_env(heartbeat_timeout_seconds=20)
    """
    import jax

    jax.distributed.initialize(**{**distributed_args(), **kwargs})
    if os.environ.get(ENV_PROCESS_ID) is not None:
        _end_rank_on_uncaught_exception()


def _end_rank_on_uncaught_exception() -> None:
    """Under the launcher, an uncaught exception ends this process at once with
    exit code 1, after its traceback: Python's exit would run jax.distributed's
    shutdown barrier, which waits for peers that may be blocked on this rank (a
    jaxtdist wait, their own barrier) until a timeout, so that the launcher named
    a survivor, minutes later, instead of this rank."""
    import sys
    import time

    previous = sys.excepthook
    stamp = os.environ.get(ENV_FAILURE_STAMP)

    def end_rank(kind, value, traceback):
        # When it failed, before the traceback and the process's teardown: a peer that
        # fails because of this rank can be reaped first (a large address space takes
        # long to unmap), and the launcher names the rank that failed first.
        if stamp:
            try:
                with open(stamp, "w") as f:
                    f.write(repr(time.monotonic()))
            except OSError:
                pass
        previous(kind, value, traceback)
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(1)

    sys.excepthook = end_rank


__all__ = ["ENV_COORDINATOR", "ENV_FAILURE_STAMP", "ENV_HEARTBEAT_TIMEOUT", "ENV_INIT_TIMEOUT", "ENV_LOCAL_RANK",
           "ENV_NUM_PROCESSES", "ENV_PROCESS_ID", "distributed_args", "initialize_from_env"]
