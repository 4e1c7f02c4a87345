"""The gather producers shared by all_gather, ag_matmul and ag_attention.

``pull_shards`` (below) stages and pulls; ``push_shards`` writes this rank's
shard straight into every peer's heap inbox, which needs no wait at all.

Producer programs first stage this rank's shard, chunk by chunk, into its
heap slot of parity ``epoch % 2`` (and into the local rows of the output),
telling every peer as each chunk lands. Then they pull peers' chunks into
the output, nearest peer first, raising a local per-chunk flag after each so
that consumers in the same launch can start on it.

Waits only target other ranks' staging, which every rank does before any
wait, so producers cannot deadlock. Reuse safety: a rank rewrites slot
parity p two calls later; by then every peer has staged the call in between,
which it does only after its previous kernel (the last reader of parity p)
has finished.
"""

import triton
import triton.language as tl

import jaxtdist.language as dl


@triton.jit
def copy_rows(src, dst, dst2, row0, row_end, COLS: tl.constexpr, BLOCK_R: tl.constexpr,
               BLOCK_C: tl.constexpr, TWO_DSTS: tl.constexpr):
    """Copies rows [row0, row_end) of ``src`` to ``dst`` (and ``dst2`` if TWO_DSTS)."""
    rows = row0 + tl.arange(0, BLOCK_R)
    row_mask = rows < row_end
    cols = tl.max_contiguous(tl.multiple_of(tl.arange(0, BLOCK_C), BLOCK_C), BLOCK_C)
    offs = rows[:, None] * COLS + cols[None, :]
    mask = row_mask[:, None] & (cols < COLS)[None, :]
    tile = tl.load(src + offs, mask=mask)
    # The next block's load is issued before this block's store, so a peer
    # read's latency overlaps the previous block's store (2 blocks in flight).
    for c0 in range(BLOCK_C, COLS, BLOCK_C):
        next_cols = tl.max_contiguous(tl.multiple_of(c0 + tl.arange(0, BLOCK_C), BLOCK_C),
                                      BLOCK_C)
        next_offs = rows[:, None] * COLS + next_cols[None, :]
        next_mask = row_mask[:, None] & (next_cols < COLS)[None, :]
        next_tile = tl.load(src + next_offs, mask=next_mask)
        tl.store(dst + offs, tile, mask=mask)
        if TWO_DSTS:
            tl.store(dst2 + offs, tile, mask=mask)
        tile = next_tile
        offs = next_offs
        mask = next_mask
    tl.store(dst + offs, tile, mask=mask)
    if TWO_DSTS:
        tl.store(dst2 + offs, tile, mask=mask)


@triton.jit
def pull_shards(ctx, x_ptr, out_ptr, worker, NUM_WORKERS: tl.constexpr, ROWS: tl.constexpr,
                COLS: tl.constexpr, STAGE_OFF: tl.constexpr, SLOT_BYTES: tl.constexpr,
                READY_OFF: tl.constexpr, FLAGS_OFF: tl.constexpr, CHUNK_ROWS: tl.constexpr,
                BLOCK_C: tl.constexpr, SCOPE: tl.constexpr):
    """Producer ``worker`` of ``NUM_WORKERS``: fills ``out`` = all shards in rank order.

    ``x_ptr`` is this rank's shard ([ROWS, COLS]); ``out_ptr`` the gathered
    [world * ROWS, COLS] buffer. ``READY_OFF`` holds world * chunks int32
    flags that peers raise; with ``FLAGS_OFF >= 0`` each chunk written to
    ``out`` (local ones included) raises the local flag
    ``FLAGS_OFF[src * chunks + chunk]`` to the epoch.
    """
    me = dl.rank(ctx)
    world = dl.num_ranks(ctx)
    e = dl.epoch(ctx)
    slot = dl.parity_ptr(ctx, STAGE_OFF, SLOT_BYTES, x_ptr.dtype.element_ty)
    ready = dl.heap_ptr(ctx, READY_OFF, tl.int32)
    n_chunks = tl.cdiv(ROWS, CHUNK_ROWS)
    for chunk in range(worker, n_chunks, NUM_WORKERS):
        row0 = chunk * CHUNK_ROWS
        row_end = tl.minimum(row0 + CHUNK_ROWS, ROWS)
        copy_rows(x_ptr, slot, out_ptr + tl.cast(me, tl.int64) * (ROWS * COLS), row0, row_end,
                  COLS, CHUNK_ROWS, BLOCK_C, True)
        dl.notify_peers(ctx, ready + me * n_chunks + chunk, e, "set", SCOPE)
        if FLAGS_OFF >= 0:
            flags = dl.heap_ptr(ctx, FLAGS_OFF, tl.int32)
            dl.notify(ctx, flags + me * n_chunks + chunk, me, e, "set", "gpu")
    for item in range(0, (world - 1) * n_chunks):
        step = item // n_chunks + 1
        chunk = item % n_chunks
        # Items go round-robin over workers, except that an item whose chunk is
        # staged by a later worker goes to that worker: every wait then targets
        # a chunk staged by the same or a lower program id, so the grid also
        # completes when programs run one after another (Triton's interpreter).
        if tl.maximum(item % NUM_WORKERS, chunk % NUM_WORKERS) == worker:
            src = (me + step) % world
            row0 = chunk * CHUNK_ROWS
            row_end = tl.minimum(row0 + CHUNK_ROWS, ROWS)
            dl.wait(ctx, ready + src * n_chunks + chunk, e, "ge", src, SCOPE)
            copy_rows(dl.symm_at(ctx, slot, src), out_ptr + tl.cast(src, tl.int64) * (ROWS * COLS),
                      out_ptr, row0, row_end, COLS, CHUNK_ROWS, BLOCK_C, False)
            if FLAGS_OFF >= 0:
                flags = dl.heap_ptr(ctx, FLAGS_OFF, tl.int32)
                # Local flag, read on this GPU only: release at GPU scope.
                dl.notify(ctx, flags + src * n_chunks + chunk, me, e, "set", "gpu")


@triton.jit
def push_shards(ctx, x_ptr, worker, NUM_WORKERS: tl.constexpr, ROWS: tl.constexpr,
                COLS: tl.constexpr, INBOX_OFF: tl.constexpr, PARITY_BYTES: tl.constexpr,
                FLAGS_OFF: tl.constexpr, CHUNK_ROWS: tl.constexpr, BLOCK_C: tl.constexpr,
                SCOPE: tl.constexpr):
    """Producer ``worker`` of ``NUM_WORKERS``: pushes this rank's shard ([ROWS, COLS]),
    chunk by chunk, into rows ``me`` of every peer's inbox (heap, [world * ROWS,
    COLS] at INBOX_OFF + (epoch % 2) * PARITY_BYTES), raising that peer's flag
    ``FLAGS_OFF[me * chunks + chunk]`` to the epoch after each chunk (consumers
    read their own rows from x). It never waits.

    Reuse safety: a rank writes a peer's inbox parity p two calls later only
    after its own kernel of the call in between consumed that peer's pushes,
    which the peer issued after its kernel that last read parity p finished.
    """
    me = dl.rank(ctx)
    world = dl.num_ranks(ctx)
    e = dl.epoch(ctx)
    n_chunks = tl.cdiv(ROWS, CHUNK_ROWS)
    flags = dl.heap_ptr(ctx, FLAGS_OFF, tl.int32)
    rows_of_me = (dl.parity_ptr(ctx, INBOX_OFF, PARITY_BYTES, x_ptr.dtype.element_ty)
                  + tl.cast(me, tl.int64) * (ROWS * COLS))
    for item in range(worker, (world - 1) * n_chunks, NUM_WORKERS):
        dst = (me + 1 + item // n_chunks) % world  # nearest peers first
        chunk = item % n_chunks
        row0 = chunk * CHUNK_ROWS
        row_end = tl.minimum(row0 + CHUNK_ROWS, ROWS)
        remote = dl.symm_at(ctx, rows_of_me, dst)
        copy_rows(x_ptr, remote, remote, row0, row_end, COLS, CHUNK_ROWS, BLOCK_C, False)
        dl.notify(ctx, flags + me * n_chunks + chunk, dst, e, "set", SCOPE)


@triton.jit
def push_shards_kernel(ctx, x_ptr, zero_ptr, M_SHARD: tl.constexpr, K: tl.constexpr,
                       INBOX_OFF: tl.constexpr, PARITY_BYTES: tl.constexpr,
                       FLAGS_OFF: tl.constexpr, SENT_OFF: tl.constexpr,
                       NUM_COMM: tl.constexpr, CHUNK_ROWS: tl.constexpr,
                       COPY_BLOCK_C: tl.constexpr, SCOPE: tl.constexpr):
    """Grid: (NUM_COMM,). What the copy engines do for the inbox consumers
    (``ag_matmul_ce_kernel``, ``ag_attention_kernel``), by SM programs, for the
    CPU backend: push x's chunks into every peer's inbox, raise the peer's chunk
    flag, then (last program) the local sent words and ``zero`` [1] int32, a 0
    that the op adds to the consumer's context (a value XLA cannot know, so the
    consumer runs after this kernel).

    The sent words assume programs run one after another (the interpreter).
    """
    pid = tl.program_id(0)
    me = dl.rank(ctx)
    world = dl.num_ranks(ctx)
    e = dl.epoch(ctx)
    push_shards(ctx, x_ptr, pid, NUM_COMM, M_SHARD, K, INBOX_OFF, PARITY_BYTES, FLAGS_OFF,
                CHUNK_ROWS, COPY_BLOCK_C, SCOPE)
    if pid == NUM_COMM - 1:
        sent = dl.heap_ptr(ctx, SENT_OFF, tl.int32)
        for step in range(1, world):
            dl.notify(ctx, sent + step, me, e, "set", "gpu")
        tl.store(zero_ptr, 0)
