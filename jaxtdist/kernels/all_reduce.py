"""all_reduce: one-shot (every rank sums every peer's staged copy), one-shot
push (every rank pushes its array into every peer as tagged words, or as its
values behind flags) and two-shot (reduce-scatter, then an all-gather of the
reduced chunks through the heap).

One-shot: one exchange (one signal round trip), each rank reads
(world - 1) x N elements over the links: latency-optimal for small arrays.
Two-shot: two exchanges, each rank reads 2 (world - 1) / world x N elements:
bandwidth-optimal for large ones. The op picks by bytes per rank.

Both sum in float32 and round once. Every rank's result is bit-identical
(the op types it as the same over the group): one-shot sums the copies in
rank order 0, 1, ... on every rank; two-shot sums each chunk once, on its
owner, and the others copy that sum.

Two-shot protocol (``kernels/_reduce.py`` for phase 1): phase 1 stages the
peers' chunks, then sums chunk ``me`` into ``out`` and into this rank's own
chunk of its staging slot (never staged: nobody reads it in phase 1), and
raises flag ``me * NUM_PROGRAMS + p`` of DONE in every peer's heap. Phase 2
waits for each peer's DONE flag and copies that peer's reduced chunk from its
slot into ``out``.

Reuse (two-shot): a rank rewrites its slot of parity p (staged chunks and
its reduced chunk) at epoch e + 2. Peers read it in epoch e: staged chunks in
phase 1, the reduced chunk in phase 2, both within their kernel e. In epoch
e + 1 the rank waited for every peer's READY flags of e + 1 (all programs'),
which a peer raises only from its kernel e + 1, so after its kernel e, phase
2 reads included, has finished: no peer can still read parity p. (A fast
peer may raise e + 1 while this rank still waits for e: the waits compare
with ">=", and that peer wrote only the other parity.) One-shot: the same
argument with a single phase.
"""

import triton
import triton.language as tl

import jaxtdist.language as dl
from jaxtdist.kernels._reduce import (chunk_end, copy_range, reduce_own_chunk, slab_bounds,
                                      stage_for_peers)


@triton.jit
def all_reduce_one_shot_kernel(ctx, x_ptr, out_ptr, N: tl.constexpr, STAGE_OFF: tl.constexpr,
                               SLOT_BYTES: tl.constexpr, READY_OFF: tl.constexpr,
                               NUM_PROGRAMS: tl.constexpr, BLOCK: tl.constexpr,
                               SCOPE: tl.constexpr):
    """Grid: (NUM_PROGRAMS,). out[N] = sum over ranks of x[N]; program p owns one
    slab of whole BLOCKs."""
    pid = tl.program_id(0)
    me = dl.rank(ctx)
    world = dl.num_ranks(ctx)
    e = dl.epoch(ctx)
    slot = dl.parity_ptr(ctx, STAGE_OFF, SLOT_BYTES, x_ptr.dtype.element_ty)
    ready = dl.heap_ptr(ctx, READY_OFF, tl.int32) + pid
    lo, hi = slab_bounds(pid, N, NUM_PROGRAMS, BLOCK)
    copy_range(x_ptr, slot, lo, hi, BLOCK)
    dl.notify_peers(ctx, ready + me * NUM_PROGRAMS, e, "set", SCOPE)
    for step in range(1, world):
        src = (me + step) % world
        dl.wait(ctx, ready + src * NUM_PROGRAMS, e, "ge", src, SCOPE)
    for off in range(lo, hi, BLOCK):
        offs = off + tl.arange(0, BLOCK)
        mask = offs < hi
        acc = tl.zeros((BLOCK,), tl.float32)
        for src in range(0, world):  # rank order on every rank: bit-identical results
            acc += tl.load(dl.symm_at(ctx, slot, src) + offs, mask=mask).to(tl.float32)
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _sum_pushed(ctx, x_ptr, out_ptr, inbox, lo, hi, N: tl.constexpr, BLOCK: tl.constexpr,
                TAGGED: tl.constexpr):
    """out[lo:hi] = the W copies of x[lo:hi] summed in rank order (the same bits on
    every rank): this rank's from x, peer src's from slot src of ``inbox`` (W
    slots of N), as tagged words waited for (TAGGED) or values already flagged."""
    me = dl.rank(ctx)
    world = dl.num_ranks(ctx)
    e = dl.epoch(ctx)
    for off in range(lo, hi, BLOCK):
        offs = off + tl.arange(0, BLOCK)
        mask = offs < hi
        acc = tl.zeros((BLOCK,), tl.float32)
        for src in range(0, world):
            if src == me:
                part = tl.load(x_ptr + offs, mask=mask).to(tl.float32)
            elif TAGGED:
                part = dl.unpack_tagged(dl.wait_tagged(ctx, inbox + src * N, offs, mask, e, src),
                                        tl.float32)
            else:
                part = tl.load(inbox + src * N + offs, mask=mask).to(tl.float32)
            acc += part
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def all_reduce_push_kernel(ctx, x_ptr, out_ptr, N: tl.constexpr, INBOX_OFF: tl.constexpr,
                           PARITY_BYTES: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
                           BLOCK: tl.constexpr, SCOPE: tl.constexpr):
    """Grid: (NUM_PROGRAMS,). out[N] = sum over ranks of x[N], one-shot by pushes:
    program p stores its slab of x, each element's float32 bits beside the epoch
    (``dl.pack_tagged``, one 8-byte word), into slot ``me`` of every peer's
    inbox (parity ``e % 2``, W slots of N words), with no flag and no fence;
    then it sums its slab's W copies in rank order (its own from x, a peer's
    once its words carry the epoch, ``dl.wait_tagged``). One crossing of the
    links where one-shot takes a signal and then remote reads; 8 bytes per
    element on the wire. (SCOPE: unused, no signal.)

    Reuse: a peer rewrites parity p of this rank's inbox at epoch e + 2 from its
    kernel e + 2, which starts after its kernel e + 1 waited for this rank's
    words of e + 1, pushed after this rank's kernel e (the reader of parity p)
    ended. Every word of parity p is this call's or an earlier one's (tag e - 2
    or less, or 0: the heap starts zeroed)."""
    pid = tl.program_id(0)
    me = dl.rank(ctx)
    world = dl.num_ranks(ctx)
    e = dl.epoch(ctx)
    inbox = dl.parity_ptr(ctx, INBOX_OFF, PARITY_BYTES, tl.int64)
    lo, hi = slab_bounds(pid, N, NUM_PROGRAMS, BLOCK)
    for off in range(lo, hi, BLOCK):
        offs = off + tl.arange(0, BLOCK)
        mask = offs < hi
        words = dl.pack_tagged(tl.load(x_ptr + offs, mask=mask).to(tl.float32), e)
        for step in range(1, world):
            tl.store(dl.symm_at(ctx, inbox + me * N + offs, (me + step) % world), words,
                     mask=mask)
    _sum_pushed(ctx, x_ptr, out_ptr, inbox, lo, hi, N, BLOCK, True)


@triton.jit
def all_reduce_push_flags_kernel(ctx, x_ptr, out_ptr, N: tl.constexpr, INBOX_OFF: tl.constexpr,
                                 SLOT_BYTES: tl.constexpr, READY_OFF: tl.constexpr,
                                 NUM_PROGRAMS: tl.constexpr, BLOCK: tl.constexpr,
                                 SCOPE: tl.constexpr):
    """Grid: (NUM_PROGRAMS,). out[N] = sum over ranks of x[N], one-shot by pushes
    of the values themselves: program p stores its slab of x into slot ``me`` of
    every peer's inbox (parity ``e % 2``, W slots of N elements of x's dtype),
    then raises READY[me, p] in every peer's heap behind one fence
    (``dl.notify_peers``); it waits for READY[src, p] of every peer and sums its
    slab's W copies in rank order (its own from x) from local memory. Remote
    writes only, in x's bytes: the tagged push's one crossing costs twice the
    bytes, one-shot's remote reads a round trip each.

    Reuse: as ``all_reduce_push_kernel``'s (a peer rewrites parity p at epoch
    e + 2 only after its kernel e + 1 waited for this rank's flags of e + 1,
    raised after this rank's kernel e, the reader of parity p, ended); flags
    compare ">=" and only grow."""
    pid = tl.program_id(0)
    me = dl.rank(ctx)
    world = dl.num_ranks(ctx)
    e = dl.epoch(ctx)
    inbox = dl.parity_ptr(ctx, INBOX_OFF, SLOT_BYTES, x_ptr.dtype.element_ty)
    ready = dl.heap_ptr(ctx, READY_OFF, tl.int32) + pid
    lo, hi = slab_bounds(pid, N, NUM_PROGRAMS, BLOCK)
    for off in range(lo, hi, BLOCK):
        offs = off + tl.arange(0, BLOCK)
        mask = offs < hi
        v = tl.load(x_ptr + offs, mask=mask)
        for step in range(1, world):
            tl.store(dl.symm_at(ctx, inbox + me * N + offs, (me + step) % world), v, mask=mask)
    dl.notify_peers(ctx, ready + me * NUM_PROGRAMS, e, "set", SCOPE)
    token = me * 0  # int32, the type dl.wait's token has (loop-carried)
    for step in range(1, world):
        src = (me + step) % world
        token = dl.wait(ctx, ready + src * NUM_PROGRAMS, e, "ge", src, SCOPE)
    # The inbox loads depend on the waits (consume_token), through a zero offset
    # times 16 elements: the pointer keeps its known alignment.
    inbox = inbox + dl.consume_token((me * 0).to(tl.int64), token) * 16
    _sum_pushed(ctx, x_ptr, out_ptr, inbox, lo, hi, N, BLOCK, False)


@triton.jit
def all_reduce_two_shot_kernel(ctx, x_ptr, out_ptr, N: tl.constexpr, CHUNK: tl.constexpr,
                               STAGE_OFF: tl.constexpr, SLOT_BYTES: tl.constexpr,
                               READY_OFF: tl.constexpr, DONE_OFF: tl.constexpr,
                               NUM_PROGRAMS: tl.constexpr, BLOCK: tl.constexpr,
                               SCOPE: tl.constexpr):
    """Grid: (NUM_PROGRAMS,). out[N] = sum over ranks of x[N], x cut into world chunks
    of CHUNK elements (the last ones short or empty); program p owns one slab of
    every chunk."""
    pid = tl.program_id(0)
    me = dl.rank(ctx)
    world = dl.num_ranks(ctx)
    e = dl.epoch(ctx)
    slot = dl.parity_ptr(ctx, STAGE_OFF, SLOT_BYTES, x_ptr.dtype.element_ty)
    ready = dl.heap_ptr(ctx, READY_OFF, tl.int32)
    done = dl.heap_ptr(ctx, DONE_OFF, tl.int32) + pid
    lo, hi = slab_bounds(pid, CHUNK, NUM_PROGRAMS, BLOCK)
    # Phase 1: reduce-scatter; chunk me's sum goes to out and to this rank's slot.
    stage_for_peers(ctx, x_ptr, slot, ready, pid, lo, hi, CHUNK, N, NUM_PROGRAMS, BLOCK, SCOPE)
    reduce_own_chunk(ctx, x_ptr, slot, ready, out_ptr + me * CHUNK, slot + me * CHUNK, pid, lo,
                     hi, CHUNK, N, NUM_PROGRAMS, BLOCK, SCOPE, True)
    dl.notify_peers(ctx, done + me * NUM_PROGRAMS, e, "set", SCOPE)
    # Phase 2: all-gather of the reduced chunks, straight from the owners' slots.
    for step in range(1, world):
        src = (me + step) % world
        dl.wait(ctx, done + src * NUM_PROGRAMS, e, "ge", src, SCOPE)
        base = src * CHUNK
        copy_range(dl.symm_at(ctx, slot, src) + base, out_ptr + base, lo,
                   chunk_end(src, hi, CHUNK, N), BLOCK)
