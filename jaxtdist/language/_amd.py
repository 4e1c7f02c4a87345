"""AMD (CDNA3, gfx942) lowering of the target-specific primitives (see ``_lowering``).

AMD GPUs have no asynchronous (TMA) proxy, so there is nothing to fence
between generic and TMA accesses, and the kernels that need TMA (the
persistent ag_matmul variants) are not offered on AMD (``Problem.vendor``).
The spin is a Triton loop of scoped acquire atomics: LLVM sees the atomics,
so the loads that follow a wait cannot be hoisted above it and
``consume_token`` has nothing to add. The clock is ``s_memrealtime``, the
constant 100 MHz counter of gfx9 (MI200, MI300), shared by every CU.
"""

import triton
import triton.language as tl

_NS_PER_REALTIME_TICK = tl.constexpr(10)  # s_memrealtime counts at 100 MHz on gfx9


@triton.jit
def fence_async_proxy():
    """Orders earlier generic accesses before later TMA ones: AMD has no TMA
    proxy, so nothing to order."""
    pass


@triton.jit
def wait_tma_stores():
    """Waits for this thread's TMA stores: AMD has none (no TMA proxy)."""
    pass


@triton.jit
def consume_token(value, token):
    """Returns ``value``: the wait that made ``token`` is a Triton acquire atomic,
    which the compiler already orders the later loads after."""
    return value


@triton.jit
def fence_system(scratch):
    """An acquire-release read-modify-write at system scope of int32 ``scratch``
    (a word of this rank): LLVM's AMDGPU lowering makes it a full system-scope
    fence (L2 write-back before, invalidate after)."""
    tl.atomic_add(scratch, 0, sem="acq_rel", scope="sys")


@triton.jit
def now_ns():
    """The GPU's constant real-time counter (``s_memrealtime``, 100 MHz), in
    nanoseconds (int64; the same clock on every CU)."""
    ticks = tl.inline_asm_elementwise("s_memrealtime $0\n s_waitcnt lgkmcnt(0)", "=s,v",
                                      [tl.full([], 0, tl.int32)], dtype=tl.int64,
                                      is_pure=False, pack=1)
    return ticks * _NS_PER_REALTIME_TICK


@triton.jit
def spin_acquire_ge(signal, value, limit, SCOPE: tl.constexpr):
    """Acquire re-reads of ``*signal`` until it is >= ``value`` or ``limit`` ns have
    passed. Returns (last value seen, a zero int32 token)."""
    start = now_ns()
    seen = tl.atomic_add(signal, 0, sem="acquire", scope=SCOPE)
    while (seen < value) & (now_ns() - start < limit):
        seen = tl.atomic_add(signal, 0, sem="acquire", scope=SCOPE)
    return seen, (seen * 0).to(tl.int32)


@triton.jit
def poll_pause():
    """Nothing: a CU spinning on a flag takes no bandwidth from the peer it waits for."""
    pass


@triton.jit
def round_tf32(x):
    """``x`` unchanged: no kernel asks for TF32 rounding on AMD (``ops._precision``)."""
    return x
