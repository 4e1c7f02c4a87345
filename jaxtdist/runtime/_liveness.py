"""Watches the other processes of a one-host multi-process heap, so that a dead
peer becomes an error naming it within a fraction of a second.

Without it, a rank whose peer died would learn of it only when a kernel's
bounded wait times out (``wait_timeout_s``, 300 s by default), or when JAX's
coordination service misses the peer's heartbeats (100 s by default) and
aborts the process. Processes that share a memory segment share a host, so
each can see the others' process ids directly.

Example:
  >>> watch = PeerWatch({1: 4242}, {1: [1]}, on_death=print)   # process 1 is pid 4242
  >>> watch.close()
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping, Sequence

# Seconds between two looks at the peers: the delay between a peer's death
# and this process's kernels giving up their waits. Each look costs a few
# microseconds per peer.
POLL_INTERVAL_S = 0.2


def process_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped, counts as dead)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by someone else
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            # "pid (comm) state ...": comm may hold spaces and parentheses.
            state = f.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except (OSError, IndexError):
        return True  # no /proc: os.kill's answer stands


class PeerWatch:
    """A daemon thread that calls ``on_death(message)`` once when a peer process dies.

    Args:
      pids: process index -> pid of each peer process to watch.
      positions: process index -> its mesh positions (named in the message).
      on_death: called with the error message, from the watch thread, once.
      exited_cleanly: whether a gone process closed its heap first (then its
        exit is the end of its program, not a death).
      interval_s: seconds between looks.
    """

    def __init__(self, pids: Mapping[int, int], positions: Mapping[int, Sequence[int]],
                 on_death: Callable[[str], None],
                 exited_cleanly: Callable[[int], bool] = lambda process: False,
                 interval_s: float = POLL_INTERVAL_S):
        # Peers whose pid this process cannot see (another pid namespace) are
        # left to the kernels' bounded waits.
        self._pids = {p: pid for p, pid in pids.items() if process_alive(pid)}
        self._positions = positions
        self._on_death = on_death
        self._exited_cleanly = exited_cleanly
        self._interval_s = interval_s
        self._stop = threading.Event()
        self.dead: str | None = None
        self._thread = threading.Thread(target=self._watch, name="jaxtdist-peer-watch",
                                        daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(self._interval_s):
            for process, pid in list(self._pids.items()):
                if not process_alive(pid):
                    if self._exited_cleanly(process):  # shut down, then exited
                        del self._pids[process]
                        continue
                    self.dead = (
                        f"jaxtdist: process {process} (pid {pid}, mesh positions "
                        f"{list(self._positions.get(process, []))}) died; collectives with "
                        "it cannot complete. The job cannot recover in place: restart it "
                        "(under `python -m jaxtdist.launch` the launcher ends every rank).")
                    self._on_death(self.dead)
                    return

    def close(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
