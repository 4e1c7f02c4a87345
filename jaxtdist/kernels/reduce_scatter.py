"""reduce_scatter: rank r pulls chunk r of every peer's staged array and sums it.

Pull rather than push: the sum happens in registers as peers' data crosses
the link, so nothing lands in a buffer to be read back (a push would write
world - 1 chunks into the owner's inbox, then read them all again); the only
extra pass is the local staging copy. Protocol, deadlock and reuse argument:
``kernels/_reduce.py``.
"""

import triton
import triton.language as tl

import jaxtdist.language as dl
from jaxtdist.kernels._reduce import reduce_own_chunk, slab_bounds, stage_for_peers


@triton.jit
def reduce_scatter_kernel(ctx, x_ptr, out_ptr, CHUNK: tl.constexpr, STAGE_OFF: tl.constexpr,
                          SLOT_BYTES: tl.constexpr, READY_OFF: tl.constexpr,
                          NUM_PROGRAMS: tl.constexpr, BLOCK: tl.constexpr,
                          SCOPE: tl.constexpr):
    """Grid: (NUM_PROGRAMS,). x: [world * CHUNK] of this rank; out[CHUNK] = sum over
    ranks of their chunk ``me``."""
    pid = tl.program_id(0)
    world = dl.num_ranks(ctx)
    slot = dl.parity_ptr(ctx, STAGE_OFF, SLOT_BYTES, x_ptr.dtype.element_ty)
    ready = dl.heap_ptr(ctx, READY_OFF, tl.int32)
    lo, hi = slab_bounds(pid, CHUNK, NUM_PROGRAMS, BLOCK)
    n = world * CHUNK
    stage_for_peers(ctx, x_ptr, slot, ready, pid, lo, hi, CHUNK, n, NUM_PROGRAMS, BLOCK, SCOPE)
    reduce_own_chunk(ctx, x_ptr, slot, ready, out_ptr, out_ptr, pid, lo, hi, CHUNK, n,
                     NUM_PROGRAMS, BLOCK, SCOPE, False)
