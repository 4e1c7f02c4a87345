"""Reduction helpers shared by reduce_scatter and the two-shot all_reduce.

The array of a rank is cut into ``world`` chunks of ``CHUNK`` elements (chunk
``s`` = elements ``[s * CHUNK, min((s + 1) * CHUNK, N))``; the last ones may
be short or empty). Rank ``r`` owns chunk ``r``: it sums chunk ``r`` over the
group. Each of the ``NUM_PROGRAMS`` programs handles the same slab (a range of
whole BLOCKs) of every chunk, so a program's waits only ever target the same
program id on other ranks.

Protocol (pull): program ``p`` copies its slab of chunk ``s`` into this
rank's heap slot of parity ``epoch % 2`` and raises flag ``me * NUM_PROGRAMS +
p`` in rank ``s``'s heap to the epoch, for every peer ``s``; then it waits for
every peer's flag ``s * NUM_PROGRAMS + p`` and sums its slab of chunk ``me``:
its own elements from ``x``, the peers' straight from their slots, in float32,
rounded once. Pulling sums the data in registers as it crosses the link: no
landing buffer is written and read again, and the staging copy is local.

Deadlock: every program stages before it waits, and waits only on the same
program id of other ranks, so the grid completes in any program order
(the interpreter runs a rank's programs one by one). On GPUs every program of
a grid must be resident (NUM_PROGRAMS <= SMs): otherwise two ranks could
schedule different programs first and wait on each other's unscheduled ones.

Reuse: a rank rewrites its slot of parity p at epoch e + 2. In epoch e + 1 it
waited for every peer's flags of e + 1 (every program's), which a peer raises
from its kernel e + 1, which started after its kernel e (the last reader of
parity p) had finished. Flags compare with ">=": a peer already at e + 1 has
staged into the other parity only.
"""

import triton
import triton.language as tl

import jaxtdist.language as dl


@triton.jit
def slab_bounds(pid, CHUNK: tl.constexpr, NUM_PROGRAMS: tl.constexpr, BLOCK: tl.constexpr):
    """Program ``pid``'s slab ``[lo, hi)`` within a chunk: whole BLOCKs, the same on
    every rank."""
    per = tl.cdiv(tl.cdiv(CHUNK, BLOCK), NUM_PROGRAMS) * BLOCK
    lo = pid * per
    hi = tl.minimum(lo + per, CHUNK)
    return lo, hi


@triton.jit
def chunk_end(s, hi, CHUNK: tl.constexpr, N):
    """End (chunk-relative, exclusive) of a slab ending at ``hi`` in chunk ``s``:
    clipped to the chunk's length ``N - s * CHUNK`` (the last chunks may be short)."""
    return tl.maximum(tl.minimum(hi, N - s * CHUNK), 0)


@triton.jit
def copy_range(src, dst, start, end, BLOCK: tl.constexpr):
    """dst[i] = src[i] for i in [start, end)."""
    for off in range(start, end, BLOCK):
        offs = off + tl.arange(0, BLOCK)
        mask = offs < end
        tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


@triton.jit
def stage_for_peers(ctx, x_ptr, slot, ready, pid, lo, hi, CHUNK: tl.constexpr,
                    N, NUM_PROGRAMS: tl.constexpr, BLOCK: tl.constexpr,
                    SCOPE: tl.constexpr):
    """Copies slab ``[lo, hi)`` of every peer's chunk of ``x`` into the heap ``slot``
    (same offsets) and tells that peer, nearest first. This rank's own chunk is
    not staged: nobody reads it (the two-shot all-reduce writes its sum there)."""
    me = dl.rank(ctx)
    world = dl.num_ranks(ctx)
    e = dl.epoch(ctx)
    for step in range(1, world):
        dst = (me + step) % world
        base = dst * CHUNK
        copy_range(x_ptr + base, slot + base, lo, chunk_end(dst, hi, CHUNK, N), BLOCK)
        dl.notify(ctx, ready + me * NUM_PROGRAMS + pid, dst, e, "set", SCOPE)


@triton.jit
def reduce_own_chunk(ctx, x_ptr, slot, ready, out_ptr, out2_ptr, pid, lo, hi,
                     CHUNK: tl.constexpr, N, NUM_PROGRAMS: tl.constexpr,
                     BLOCK: tl.constexpr, SCOPE: tl.constexpr, TWO_OUTS: tl.constexpr):
    """Sums slab ``[lo, hi)`` of chunk ``me`` over the group (after the peers'
    staging flags) into ``out_ptr[lo:hi]`` (and ``out2_ptr[lo:hi]`` if TWO_OUTS):
    float32 accumulation, one rounding to the output's dtype."""
    me = dl.rank(ctx)
    world = dl.num_ranks(ctx)
    e = dl.epoch(ctx)
    for step in range(1, world):
        src = (me + step) % world
        dl.wait(ctx, ready + src * NUM_PROGRAMS + pid, e, "ge", src, SCOPE)
    base = me * CHUNK
    end = chunk_end(me, hi, CHUNK, N)
    for off in range(lo, end, BLOCK):
        offs = off + tl.arange(0, BLOCK)
        mask = offs < end
        acc = tl.load(x_ptr + base + offs, mask=mask).to(tl.float32)
        # Peers in the order me + 1, me + 2, ...: ranks start on different
        # peers, so no rank's memory serves every reader at once.
        for step in range(1, world):
            src = (me + step) % world
            acc += tl.load(dl.symm_at(ctx, slot, src) + base + offs, mask=mask).to(tl.float32)
        val = acc.to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + offs, val, mask=mask)
        if TWO_OUTS:
            tl.store(out2_ptr + offs, val, mask=mask)
