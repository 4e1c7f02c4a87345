"""Partial sums exchanged between ranks: the inbox of partial tiles that
``matmul_rs``, ``moe_tp.grouped_gemm_rs_kernel`` and ``matmul_ar`` push into,
and the reduce-scatter's exchange on it (``exchange_tile``: a tile's partial
pushed into its owner's inbox, or an own tile's peers' partials waited for
and added).

Inbox (per call parity ``e % 2``): W - 1 slots of ``slot_elems`` partials
(float32, or x's dtype with PARTIAL_INPUT), slot ``slot_of(src, dst)`` of
owner ``dst`` holding the partial of source ``src``; the flags:
``flags_per_slot`` int32 per slot, the flag of a tile at ``flags + slot *
flags_per_slot + tile``, set to the epoch.

A peer's tile (not OWN) is stored into the owner's slot of this source, then
its flag is raised (``dl.notify``: a release at system scope publishes every
piece). An own tile waits (acquire) for the tile's flag of each of the
other W - 1 ranks, once per tile, in the order they push to this rank (me-1
first, me+1 last), then adds their partials to its own in float32 and stores
the output. The reuse and deadlock arguments are the callers' (``matmul_rs``).
"""

import triton
import triton.language as tl

import jaxtdist.language as dl
from jaxtdist.kernels._gemm import column_halves
from jaxtdist.kernels._tiles import aligned_after, block_offsets


@triton.jit
def partials_inbox(ctx, x_ptr, INBOX_OFF: tl.constexpr, PARITY_BYTES: tl.constexpr,
                   FLAGS_OFF: tl.constexpr, PARTIAL_INPUT: tl.constexpr):
    """This call's inbox (parity ``epoch % 2``) of partials, in x's dtype with
    PARTIAL_INPUT (half the bytes of float32, one more rounding) else float32,
    and the flags."""
    if PARTIAL_INPUT:
        partial_ty = x_ptr.dtype.element_ty
    else:
        partial_ty = tl.float32
    return (dl.parity_ptr(ctx, INBOX_OFF, PARITY_BYTES, partial_ty),
            dl.heap_ptr(ctx, FLAGS_OFF, tl.int32))


@triton.jit
def slot_of(src, dst, world):
    """The slot of source ``src``'s partials in owner ``dst``'s inbox."""
    return (src - dst + world - 1) % world


@triton.jit
def raise_flag(ctx, flags, flags_per_slot, tile, me, dst, e, WORLD: tl.constexpr):
    """Peer tile ``tile``'s flag in owner ``dst``'s heap, in the slot of this source."""
    dl.notify(ctx, flags + slot_of(me, dst, WORLD) * flags_per_slot + tile, dst, e)


@triton.jit
def wait_partials(ctx, inbox, flags, flags_per_slot, tile, me, e, WORLD: tl.constexpr):
    """``inbox`` ordered after own tile ``tile``'s flags from every other rank (me-1
    first), its 16-byte alignment kept (``aligned_after``: a token on a block of
    pointers made the partials' loads 2 bytes wide)."""
    for step_back in tl.static_range(1, WORLD):
        slot = WORLD - 1 - step_back
        src = (me + WORLD - step_back) % WORLD
        token = dl.wait(ctx, flags + slot * flags_per_slot + tile, e, "ge", src)
        inbox = aligned_after(inbox, token)
    return inbox


@triton.jit
def _piece(ctx, piece, rows, row_end, row0, col0, OWN: tl.constexpr, inbox, me, dst,
           slot_elems, c_desc, out_ptr, N: tl.constexpr, WIDTH: tl.constexpr,
           WORLD: tl.constexpr, TMA: tl.constexpr):
    """Columns [col0, col0 + WIDTH) of a tile's partial ``piece`` (rows ``rows`` below
    ``row_end`` of row-major [*, N] arrays): a peer's stored into ``dst``'s slot of
    this source; an own tile's added to the W - 1 peers' partials (unrolled, none
    at world 1) and stored as output, with TMA through ``c_desc`` at row0."""
    offs, mask = block_offsets(rows, col0 + tl.arange(0, WIDTH), row_end, N)
    if not OWN:
        tl.store(dl.symm_at(ctx, inbox + slot_of(me, dst, WORLD) * slot_elems + offs, dst),
                 piece.to(inbox.dtype.element_ty), mask=mask)
    else:
        # ``inbox`` is ordered after every source's flag (``wait_partials``): the
        # W - 1 partials' loads of the piece go out together.
        for step_back in tl.static_range(1, WORLD):
            part = tl.load(inbox + (WORLD - 1 - step_back) * slot_elems + offs, mask=mask,
                           other=0.0)
            piece += part.to(tl.float32)
        if TMA:
            c_desc.store([row0, col0], piece.to(c_desc.dtype))
        else:
            tl.store(out_ptr + offs, piece.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def exchange_tile(ctx, acc, rows, row_end, row0, col0, OWN: tl.constexpr, inbox, flags,
                  flags_per_slot, tile, me, e, dst, slot_elems, c_desc, out_ptr,
                  N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  SUBTILE: tl.constexpr, WORLD: tl.constexpr, TMA: tl.constexpr):
    """A tile's push to owner ``dst`` then its flag (not OWN), or its peers' flags,
    their partials added and the output stored (OWN), SUBTILE column pieces one
    after another: the accumulator, a peer's partial and the offsets of a whole
    128 x 256 tile took more than 255 registers per thread and spilled at world >
    1, while a piece's fit beside the rest of the accumulator. With TMA, SUBTILE
    is ``c_desc``'s cut too."""
    if OWN:
        inbox = wait_partials(ctx, inbox, flags, flags_per_slot, tile, me, e, WORLD)
    if SUBTILE == 1:
        _piece(ctx, acc, rows, row_end, row0, col0, OWN, inbox, me, dst, slot_elems, c_desc,
               out_ptr, N, BLOCK_N, WORLD, TMA)
    elif SUBTILE == 2:
        HALF: tl.constexpr = BLOCK_N // 2
        left, right = column_halves(acc, BLOCK_M, BLOCK_N)
        _piece(ctx, left, rows, row_end, row0, col0, OWN, inbox, me, dst, slot_elems, c_desc,
               out_ptr, N, HALF, WORLD, TMA)
        _piece(ctx, right, rows, row_end, row0, col0 + HALF, OWN, inbox, me, dst, slot_elems,
               c_desc, out_ptr, N, HALF, WORLD, TMA)
    else:
        tl.static_assert(SUBTILE == 4, "SUBTILE: 1, 2 or 4")
        HALF: tl.constexpr = BLOCK_N // 2
        Q: tl.constexpr = BLOCK_N // 4
        left, right = column_halves(acc, BLOCK_M, BLOCK_N)
        a, b = column_halves(left, BLOCK_M, HALF)
        _piece(ctx, a, rows, row_end, row0, col0, OWN, inbox, me, dst, slot_elems, c_desc,
               out_ptr, N, Q, WORLD, TMA)
        _piece(ctx, b, rows, row_end, row0, col0 + Q, OWN, inbox, me, dst, slot_elems, c_desc,
               out_ptr, N, Q, WORLD, TMA)
        a, b = column_halves(right, BLOCK_M, HALF)
        _piece(ctx, a, rows, row_end, row0, col0 + 2 * Q, OWN, inbox, me, dst, slot_elems,
               c_desc, out_ptr, N, Q, WORLD, TMA)
        _piece(ctx, b, rows, row_end, row0, col0 + 3 * Q, OWN, inbox, me, dst, slot_elems,
               c_desc, out_ptr, N, Q, WORLD, TMA)
    if not OWN:
        raise_flag(ctx, flags, flags_per_slot, tile, me, dst, e, WORLD)
