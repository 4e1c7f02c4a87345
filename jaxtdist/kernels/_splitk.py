"""Epilogues of output tiles whose K range is cut over several programs.

Split K (``finish_split_k``): K is cut into SPLIT_K ranges. Each program
stores its float32 partial tile into its own plane of a heap workspace
([SPLIT_K, rows, N]), then counts itself in on the tile's counter. The last
of the SPLIT_K programs to arrive sums the planes in split order 0, 1, ...,
SPLIT_K - 1 (``split_k_total``: the same additions, so the same bits,
whichever program arrives last) and writes the output, or, in matmul_ar,
goes on to push the tile's sum to the peers.

Stream-K tail (``finish_stream_k``): the last partial wave of a persistent
GEMM is cut into equal runs of K blocks, one per program, so that a tile may
be shared by a few programs; each stores its partial into its own slot and
the last to arrive sums the tile's slots.

Counters only ever grow (by the tile's number of parts per call), so "last"
is ``(old + 1) % parts == 0`` and nothing is reset between calls; the
partials are fully overwritten by every call. Nobody waits for anybody, so
the epilogues work whatever the order programs run in (the interpreter runs
them one after another).
"""

import triton
import triton.language as tl


@triton.jit
def k_range(split, K: tl.constexpr, K_SPLIT: tl.constexpr):
    """[k_lo, k_hi) of split ``split``; K_SPLIT is a multiple of BLOCK_K."""
    k_lo = split * K_SPLIT
    return k_lo, tl.minimum(k_lo + K_SPLIT, K)


@triton.jit
def _arrive_last(counter, parts):
    """Counts this program in on ``counter``; True for the last of ``parts`` arrivals."""
    # Every thread's partial is stored before the one thread's release.
    tl.debug_barrier()
    arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
    # The other threads read after the one thread's acquire.
    tl.debug_barrier()
    return (arrived + 1) % parts == 0


@triton.jit
def split_k_total(acc, split, partials, plane_offs, mask, counter, plane,
                  SPLIT_K: tl.constexpr):
    """Stores this program's partial tile ``acc`` (split ``split`` of SPLIT_K) and
    counts it in; returns (last, total): whether this program arrived last of
    the tile's SPLIT_K, and then the float32 sum of the tile's partials (else
    ``acc``).

    ``partials`` is the float32 workspace base, ``plane_offs`` the tile's
    offsets within one plane of ``plane`` elements, ``counter`` the tile's int32
    arrival counter. The planes are added in split order 0, 1, ..., SPLIT_K - 1,
    this program's own read back too: starting from the own accumulator would
    make the rounding depend on which program arrives last. The sum stays in the
    loads' layout (one conversion at the end): adding each plane to ``acc``'s
    layout went through shared memory behind a barrier per plane, which held
    each load back until the previous one had arrived (SPLIT_K L2 round trips
    in a row at the end of every tile).
    """
    tl.store(partials + split * plane + plane_offs, acc, mask=mask)
    last = _arrive_last(counter, SPLIT_K)
    total = acc
    if last:
        # .cg: read the planes from L2, not a stale L1 (the own plane is visible to
        # this program's threads after the barrier of ``_arrive_last``).
        part_sum = tl.load(partials + plane_offs, mask=mask, other=0.0, cache_modifier=".cg")
        for other in tl.static_range(1, SPLIT_K):
            part_sum += tl.load(partials + other * plane + plane_offs, mask=mask, other=0.0,
                                cache_modifier=".cg")
        total = part_sum
    return last, total


@triton.jit
def finish_split_k(acc, split, out_ptrs, partials, plane_offs, mask, counter,
                   plane, SPLIT_K: tl.constexpr):
    """Combines SPLIT_K partial tiles of one output tile (``split_k_total``); the
    last arrival stores it."""
    last, total = split_k_total(acc, split, partials, plane_offs, mask, counter, plane,
                                SPLIT_K)
    if last:
        tl.store(out_ptrs, total.to(out_ptrs.dtype.element_ty), mask=mask)


@triton.jit
def finish_stream_k(acc, slot, first_slot, parts, partials, counter, out_ptr, row0, col0,
                    N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Combines the ``parts`` partial tiles of one output tile, held in the
    consecutive slots ``first_slot ..`` of ``partials`` ([slots, BLOCK_M, BLOCK_N]
    float32); ``acc`` is this program's, for slot ``slot``. The last arrival
    stores out[row0:row0 + BLOCK_M, col0:col0 + BLOCK_N] (columns clipped at N).

    Every part goes through the workspace, the last one's too: the sum then
    runs a quarter of the rows at a time, so that no program holds two full
    accumulators in registers.
    """
    SUB_M: tl.constexpr = BLOCK_M // 4
    plane = BLOCK_M * BLOCK_N
    cols = tl.arange(0, BLOCK_N)
    tile_offs = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + cols[None, :]
    tl.store(partials + slot * plane + tile_offs, acc)
    if _arrive_last(counter, parts):
        sub_rows = tl.arange(0, SUB_M)
        col_mask = (col0 + cols) < N
        for r0 in range(0, BLOCK_M, SUB_M):
            sub_offs = (r0 + sub_rows)[:, None] * BLOCK_N + cols[None, :]
            total = tl.zeros((SUB_M, BLOCK_N), dtype=tl.float32)
            for part in range(first_slot, first_slot + parts):
                # .cg: other programs' partials, from L2 rather than a stale L1.
                total += tl.load(partials + part * plane + sub_offs, cache_modifier=".cg")
            out_offs = (row0 + r0 + sub_rows)[:, None] * N + (col0 + cols)[None, :]
            tl.store(out_ptr + out_offs, total.to(out_ptr.dtype.element_ty),
                     mask=col_mask[None, :])
