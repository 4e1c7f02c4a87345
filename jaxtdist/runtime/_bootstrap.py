"""Bootstrap of a heap that spans processes: values exchanged through JAX's
distributed key-value store, with one bound on the whole exchange.

A heap backend of a multi-process mesh (the CPU shared-memory heap, the
NVSHMEM heap) needs a few values from other processes before it is ready: a
segment name or a unique id from process 0, every process's "mapped it"
answer. ``jax.distributed.initialize`` already connected every process to
one coordination service; this module puts jaxtdist's values there under
keys that name the runtime generation, so that a second ``initialize``
never reads the first one's values.

Example:
  >>> boot = KeyValueBootstrap("heap", generation=1, timeout_s=300.0)
  >>> if jax.process_index() == 0:
  ...     boot.publish("segment", name)
  >>> name = boot.get("segment", from_process=0)
  >>> pids = boot.all_gather("ready", str(os.getpid()))   # every process's value
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

from jaxtdist._errors import JaxtdistError

# Seconds a process waits for the others during jaxtdist.initialize on a mesh
# that spans processes. As long as jax.distributed.initialize's own default
# (initialization_timeout=300): processes may reach initialize far apart (one
# loads a checkpoint, another compiles), and one that never comes must still
# turn into an error rather than a hang.
DEFAULT_BOOTSTRAP_TIMEOUT_S = 300.0
ENV_BOOTSTRAP_TIMEOUT = "JAXTDIST_BOOTSTRAP_TIMEOUT_S"
_KEY_PREFIX = "jaxtdist"


class BootstrapTimeoutError(JaxtdistError):
    """Another process did not reach ``jaxtdist.initialize`` within the bound."""


def bootstrap_timeout_s(given: float | None = None) -> float:
    """The bootstrap bound: ``given``, else ``$JAXTDIST_BOOTSTRAP_TIMEOUT_S``, else 300 s."""
    source = "bootstrap_timeout_s"
    if given is None:
        raw = os.environ.get(ENV_BOOTSTRAP_TIMEOUT)
        if raw is None:
            return DEFAULT_BOOTSTRAP_TIMEOUT_S
        source = f"${ENV_BOOTSTRAP_TIMEOUT}"
        try:
            given = float(raw)
        except ValueError:
            raise ValueError(f"jaxtdist: {source}={raw!r} is not a number of seconds") from None
    if not 0 < float(given) <= 1e6:
        raise ValueError(f"jaxtdist: {source}={given!r}; allowed: seconds in (0, 1e6]")
    return float(given)


def distributed_client():
    """JAX's coordination-service client; an error saying how to start it if absent."""
    from jax._src.distributed import global_state

    if global_state.client is None:
        raise JaxtdistError(
            "jaxtdist: the mesh spans several processes but jax.distributed is not "
            "initialized in this one. Call jax.distributed.initialize() (or "
            "jaxtdist.launch.initialize_from_env() under `python -m jaxtdist.launch`) "
            "before creating the mesh; see docs/multiprocess.md.")
    return global_state.client


class KeyValueBootstrap:
    """Values of one bootstrap (``what``) of runtime ``generation``, with one deadline.

    Every wait of this object shares the deadline set at construction, so the
    whole exchange takes at most ``timeout_s`` however many values it reads.
    """

    def __init__(self, what: str, generation: int, timeout_s: float,
                 processes: Sequence[int] | None = None, client=None):
        import jax

        self.what = what
        self.timeout_s = float(timeout_s)
        self.process_index = jax.process_index()
        # The processes taking part (those owning devices of the mesh).
        self.processes = sorted(set(processes if processes is not None
                                    else range(jax.process_count())))
        self.process_count = len(self.processes)
        self._client = client if client is not None else distributed_client()
        self._prefix = f"{_KEY_PREFIX}/{what}/{generation}"
        self._deadline = time.monotonic() + self.timeout_s
        self._gathered: set[str] = set()  # names every process publishes

    def _key(self, name: str, process: int) -> str:
        return f"{self._prefix}/{name}/{process}"

    def publish(self, name: str, value: str) -> None:
        """Makes ``value`` readable by every process as this process's ``name``."""
        self._client.key_value_set(self._key(name, self.process_index), value)

    def get(self, name: str, from_process: int) -> str:
        """``from_process``'s ``name``, waiting for it until the deadline."""
        left_ms = max(1, int((self._deadline - time.monotonic()) * 1000))
        try:
            return self._client.blocking_key_value_get(self._key(name, from_process), left_ms)
        except Exception as e:  # JaxRuntimeError: DEADLINE_EXCEEDED, or the service is gone
            if "DEADLINE_EXCEEDED" not in str(e):
                raise JaxtdistError(
                    f"jaxtdist: reading process {from_process}'s {self.what} {name!r} from "
                    f"JAX's coordination service failed: {e}") from e
            also = (f"; processes missing now: {self.missing(name)}"
                    if name in self._gathered else "")
            raise BootstrapTimeoutError(
                f"jaxtdist: process {from_process} (of {self.process_count}) did not reach "
                f"jaxtdist.initialize within {self.timeout_s:g} s (waiting for its {self.what} "
                f"{name!r}{also}). It died, hangs, or runs a "
                "different program. Raise the bound with jaxtdist.initialize(..., "
                f"bootstrap_timeout_s=...) or ${ENV_BOOTSTRAP_TIMEOUT} if it is only "
                "late.") from None

    def missing(self, name: str) -> list[int]:
        """Processes whose ``name`` is not published yet (no waiting)."""
        absent = []
        for p in self.processes:
            try:
                self._client.key_value_try_get(self._key(name, p))
            except Exception:  # NOT_FOUND
                absent.append(p)
        return absent

    def all_gather(self, name: str, value: str) -> list[str]:
        """Publishes ``value`` and returns every taking part process's, in process order."""
        self._gathered.add(name)
        self.publish(name, value)
        return [value if p == self.process_index else self.get(name, p)
                for p in self.processes]
