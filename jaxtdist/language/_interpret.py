"""The interpreter's lowering of the target-specific primitives (see ``_lowering``).

Under Triton's interpreter a rank's programs run one at a time, in order,
through one memory proxy: nothing to fence and nothing that can move.
"""

import time

import triton
import triton.language as tl


def _host_clock_ns() -> int:
    return time.monotonic_ns()


# Between two polls of a wait. A rank is a process and the host has few cores:
# a waiter re-reading its flag at full speed halves (with 8 ranks on 2 cores,
# quarters) the share of a core left to the rank it waits for. Short next to a
# kernel's time under the interpreter (milliseconds per tile).
POLL_PAUSE_S = 0.001


def _pause() -> int:
    time.sleep(POLL_PAUSE_S)
    return 0


@triton.jit
def fence_async_proxy():
    """Orders this thread's earlier memory accesses before its later TMA ones:
    nothing to order under the interpreter (one proxy)."""
    pass


@triton.jit
def wait_tma_stores():
    """Waits for this thread's TMA stores: the interpreter's are done when issued."""
    pass


@triton.jit
def consume_token(value, token):
    """Returns ``value``; programs run in order, so nothing can move."""
    return value


@triton.jit
def fence_system(scratch):
    """An acquire-release read-modify-write at system scope of int32 ``scratch``
    (a word of this rank): the interpreter runs it as an atomic on the shared
    heap, ordered like every access of the rank's one process."""
    tl.atomic_add(scratch, 0, sem="acq_rel", scope="sys")


@triton.jit
def now_ns():
    """The host's monotonic clock, in nanoseconds (int64)."""
    return tl.full([], _host_clock_ns(), tl.int64)


@triton.jit
def poll_pause():
    """Gives the host's core away for ``POLL_PAUSE_S`` (see there)."""
    tl.full([], _pause(), tl.int32)


@triton.jit
def spin_acquire_ge(signal, value, limit, SCOPE: tl.constexpr):
    """Acquire re-reads of ``*signal`` until it is >= ``value`` or ``limit`` ns
    have passed. Returns (last value seen, 0)."""
    start = now_ns()
    seen = tl.atomic_add(signal, 0, sem="acquire", scope=SCOPE)
    while (seen < value) & (now_ns() - start < limit):
        poll_pause()
        seen = tl.atomic_add(signal, 0, sem="acquire", scope=SCOPE)
    return seen, (seen * 0).to(tl.int32)


@triton.jit
def round_tf32(x):
    """``x`` unchanged: the interpreter's dots multiply float32 exactly."""
    return x
