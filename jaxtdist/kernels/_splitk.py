"""Split-K epilogue: K is cut into SPLIT_K ranges computed by different programs.

Each program stores its float32 partial tile into its own plane of a heap
workspace ([SPLIT_K, rows, N]), then counts itself in on the tile's counter.
The last of the SPLIT_K programs to arrive adds the other planes to its own
accumulator and writes the output. Counters only ever grow (by SPLIT_K per
call), so "last" is ``(old + 1) % SPLIT_K == 0`` and nothing is reset
between calls; the planes are fully overwritten by every call.
"""

import triton
import triton.language as tl


@triton.jit
def k_range(split, K: tl.constexpr, K_SPLIT: tl.constexpr):
    """[k_lo, k_hi) of split ``split``; K_SPLIT is a multiple of BLOCK_K."""
    k_lo = split * K_SPLIT
    return k_lo, tl.minimum(k_lo + K_SPLIT, K)


@triton.jit
def finish_split_k(acc, split, out_ptrs, partials, plane_offs, mask, counter,
                   plane, SPLIT_K: tl.constexpr):
    """Combines SPLIT_K partial tiles of one output tile; the last arrival stores it.

    ``partials`` is the float32 workspace base, ``plane_offs`` the tile's
    offsets within one plane of ``plane`` elements, ``counter`` the tile's int32
    arrival counter.
    """
    tl.store(partials + split * plane + plane_offs, acc, mask=mask)
    # Every thread's partial is stored before the one thread's release.
    tl.debug_barrier()
    arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
    if (arrived + 1) % SPLIT_K == 0:
        # The other threads read after the one thread's acquire.
        tl.debug_barrier()
        total = acc
        for other in range(0, SPLIT_K):
            # .cg: read the other programs' partials from L2, not a stale L1.
            total += tl.load(partials + other * plane + plane_offs,
                             mask=mask & (other != split), other=0.0, cache_modifier=".cg")
        tl.store(out_ptrs, total.to(out_ptrs.dtype.element_ty), mask=mask)
