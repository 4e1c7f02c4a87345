"""Timestamps for probes: where a kernel's time goes, phase by phase, on the GPU's
own clock (kernels take a TRACE constexpr; off, a stamp is no code)."""

import triton
import triton.language as tl

import jaxtdist.language as dl


@triton.jit
def stamp(ptr, TRACE: tl.constexpr, mask=None):
    """With TRACE, the GPU's global timer (low 32 bits of ns: differences below
    4 s unwrap modulo 2**32) stored at int32 ``ptr`` where ``mask``; nothing
    otherwise."""
    if TRACE:
        tl.store(ptr, dl.now_ns().to(tl.int32), mask=mask)
