"""The gather producer shared by all_gather and ag_matmul.

Each rank's prologue staged its shard in its heap slot of parity
``epoch % 2``. Program 0 tells every peer the shard is there; then the
producer programs pull peers' shards chunk by chunk into the local output,
raising a local per-chunk flag after each so consumers can start.

Reuse safety: a rank overwrites slot parity p two calls later. By then every
peer has raised the next call's ready flag, which it does only after its
previous kernel (the last reader of parity p) has finished.
"""

import triton
import triton.language as tl

import jaxtdist.language as dl


@triton.jit
def announce_shard(ctx, READY_OFF: tl.constexpr):
    """Tells every peer that this rank's shard for this epoch is staged."""
    me = dl.rank(ctx)
    world = dl.num_ranks(ctx)
    e = dl.epoch(ctx)
    ready = dl.heap_ptr(ctx, READY_OFF, tl.int32) + me
    for peer in range(0, world):
        if peer != me:
            dl.notify(ctx, ready, peer, e)


@triton.jit
def _copy_rows(src, dst, row0, row_end, COLS: tl.constexpr, BLOCK_R: tl.constexpr,
               BLOCK_C: tl.constexpr):
    rows = row0 + tl.arange(0, BLOCK_R)
    row_mask = rows < row_end
    for c0 in range(0, COLS, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        mask = row_mask[:, None] & (cols < COLS)[None, :]
        offs = rows[:, None] * COLS + cols[None, :]
        tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


@triton.jit
def pull_shards(ctx, x_ptr, out_ptr, worker, NUM_WORKERS: tl.constexpr, ROWS: tl.constexpr,
                COLS: tl.constexpr, STAGE_OFF: tl.constexpr, SLOT_BYTES: tl.constexpr,
                READY_OFF: tl.constexpr, FLAGS_OFF: tl.constexpr, CHUNK_ROWS: tl.constexpr,
                BLOCK_C: tl.constexpr):
    """Producer ``worker`` of ``NUM_WORKERS``: fills ``out`` = all shards in rank order.

    ``x_ptr`` is this rank's shard ([ROWS, COLS]); ``out_ptr`` the gathered
    [world * ROWS, COLS] buffer. Peers' chunks come first, nearest peer
    first; the local copy last. With ``FLAGS_OFF >= 0`` each finished peer
    chunk raises the local flag ``FLAGS_OFF[src * chunks + chunk]`` to the epoch.
    """
    me = dl.rank(ctx)
    world = dl.num_ranks(ctx)
    e = dl.epoch(ctx)
    slot = dl.heap_ptr(ctx, STAGE_OFF + (e % 2) * SLOT_BYTES, x_ptr.dtype.element_ty)
    ready = dl.heap_ptr(ctx, READY_OFF, tl.int32)
    n_chunks = tl.cdiv(ROWS, CHUNK_ROWS)
    for item in range(worker, world * n_chunks, NUM_WORKERS):
        step = item // n_chunks + 1
        chunk = item % n_chunks
        src = (me + step) % world
        row0 = chunk * CHUNK_ROWS
        row_end = tl.minimum(row0 + CHUNK_ROWS, ROWS)
        dst = out_ptr + src * ROWS * COLS
        if src == me:
            _copy_rows(x_ptr, dst, row0, row_end, COLS, CHUNK_ROWS, BLOCK_C)
        else:
            dl.wait(ctx, ready + src, e, "ge", src)
            _copy_rows(dl.symm_at(ctx, slot, src), dst, row0, row_end, COLS, CHUNK_ROWS,
                       BLOCK_C)
            if FLAGS_OFF >= 0:
                flags = dl.heap_ptr(ctx, FLAGS_OFF, tl.int32)
                # Local flag: release orders the copy's stores before it.
                dl.notify(ctx, flags + src * n_chunks + chunk, me, e)
