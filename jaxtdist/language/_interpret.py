"""The interpreter's lowering of the target-specific primitives (see ``_lowering``).

Under Triton's interpreter a rank's programs run one at a time, in order,
through one memory proxy: nothing to fence and nothing that can move.
"""

import triton
import triton.language as tl


@triton.jit
def fence_async_proxy():
    """Orders this thread's earlier memory accesses before its later TMA ones:
    nothing to order under the interpreter (one proxy)."""
    pass


@triton.jit
def consume_token(value, token):
    """Returns ``value``; programs run in order, so nothing can move."""
    return value


@triton.jit
def spin_acquire_ge(signal, value, limit, SCOPE: tl.constexpr):
    """Up to ``limit`` acquire re-reads of ``*signal`` until it is >= ``value``.
    Returns (last value seen, 0)."""
    seen = tl.atomic_add(signal, 0, sem="acquire", scope=SCOPE)
    spins = 0
    while (seen < value) & (spins < limit):
        seen = tl.atomic_add(signal, 0, sem="acquire", scope=SCOPE)
        spins += 1
    return seen, (seen * 0).to(tl.int32)
