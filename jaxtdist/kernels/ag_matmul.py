"""ag_matmul: all_gather(x) @ w with the gather overlapped tile by tile.

One launch holds two kinds of programs. The first NUM_COMM programs are the
producers of ``_gather.pull_shards``: they stage this rank's shard in the
heap and copy it into the gathered buffer, then pull peers' shards, raising a
flag per BLOCK_M rows. The rest are GEMM tiles in ``rank_major_tile`` order:
the local shard's tiles first (their chunks are local copies, ready at once),
then each peer's. A tile waits for its chunk flag, which only lower program
ids (the producers) raise, so the grid cannot deadlock. Chunks (CHUNK_ROWS
rows, a divisor of BLOCK_M) can be finer than tiles, so that more producers
pull a small shard in parallel; a tile then waits for each of its chunks.

With SPLIT_K > 1, SPLIT_K consecutive programs share one output tile, each
over its own range of K (``_splitk``): small M then still fills the GPU.

``ag_matmul_tma_kernel`` is the persistent variant for large shapes: one
program per SM, tiles taken from a counter in the same order, operands
loaded with TMA (tensor descriptors built on the device, which needs
Triton's global scratch: jaxtdist's own launcher provides it).

``ag_matmul_ce_kernel`` has no producer programs: peers' copy engines push
their shards into this rank's heap inbox (``csrc/ce_gather.cc``, called
just before it), raising a flag per chunk, so every SM computes. Tiles go
round-robin over programs (a static schedule: no counter), local tiles
first and read straight from ``x``, then each peer's tiles in arrival order.
``_gather.push_shards_kernel`` does the copy engines' part with SM copies: the CPU
backend runs it in their place.

FP8 (``SCALING``: ``_gemm``'s schemes): x's rows are gathered as they are
(one byte each); ``xs_ptr`` holds the scales of the gathered rows (every
rank's, gathered before the launch: [world * M_SHARD] per row, or
[world * M_SHARD, K / 128] blockwise), ``ws_ptr`` w's, and w is K-major
([N, K], B_T). Without SCALING both are ignored (the ops pass x and w).
"""

import triton
import triton.language as tl

import jaxtdist.language as dl
from jaxtdist.kernels._gather import pull_shards, push_shards
from jaxtdist.kernels._gemm import (out_desc, pointer_tile_acc, store_tile, tile_acc,
                                   weight_desc)
from jaxtdist.kernels._inbox import wait_pushes_sent, wait_rows
from jaxtdist.kernels._splitk import finish_split_k, finish_stream_k, k_range
from jaxtdist.kernels._tiles import block_range, grouped_tile, peer_arrival_tile, rank_major_tile


@triton.jit
def _wait_tile_rows_for_tma(ctx, flags, e, src, tm, M_SHARD: tl.constexpr,
                            BLOCK_M: tl.constexpr, CHUNK_ROWS: tl.constexpr):
    """``_inbox.wait_rows`` of row tile ``tm`` for flags this GPU raises (GPU scope),
    then the proxy fence that orders the tile's TMA loads after the wait."""
    wait_rows(ctx, flags, e, src, tm * BLOCK_M, M_SHARD, BLOCK_M, CHUNK_ROWS, "gpu")
    dl.fence_async_proxy()


@triton.jit
def _tile_rows_for_tma(ctx, flags, e, src, tm, n_chunks, BLOCK_M: tl.constexpr,
                       CHUNK_ROWS: tl.constexpr):
    """``_wait_tile_rows`` (GPU scope) for chunks no finer than tiles (one flag per
    tile), then the proxy fence, as one loop-free wait; returns 0 to add to the
    tile's TMA row coordinate (``dl.wait_for_tma``)."""
    tl.static_assert(CHUNK_ROWS >= BLOCK_M, "one chunk flag per row tile")
    chunk = tm * BLOCK_M // CHUNK_ROWS
    return dl.wait_for_tma(ctx, flags + src * n_chunks + chunk, e, src, "gpu")


@triton.jit
def ag_matmul_kernel(ctx, x_ptr, w_ptr, xs_ptr, ws_ptr, out_ptr, gathered_ptr,
                     M_SHARD: tl.constexpr, N: tl.constexpr, K: tl.constexpr,
                     STAGE_OFF: tl.constexpr, SLOT_BYTES: tl.constexpr,
                     READY_OFF: tl.constexpr, FLAGS_OFF: tl.constexpr,
                     PARTIALS_OFF: tl.constexpr, COUNTERS_OFF: tl.constexpr,
                     NUM_COMM: tl.constexpr, CHUNK_ROWS: tl.constexpr,
                     COPY_BLOCK_C: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     SPLIT_K: tl.constexpr, K_SPLIT: tl.constexpr,
                     GROUP_M: tl.constexpr, SCOPE: tl.constexpr, ALL_ROWS: tl.constexpr,
                     PUSH: tl.constexpr, FLAG_SCOPE: tl.constexpr,
                     DOT_PRECISION: tl.constexpr, B_T: tl.constexpr = False,
                     SCALING: tl.constexpr = None):
    """Grid: (NUM_COMM + SPLIT_K * world * cdiv(M_SHARD, BLOCK_M) * cdiv(N, BLOCK_N),),
    or with ``ALL_ROWS`` (BLOCK_M >= world * M_SHARD): (NUM_COMM + SPLIT_K * cdiv(N, BLOCK_N),).

    x: [M_SHARD, K], w: [K, N] ([N, K] with B_T) -> out: [world * M_SHARD, N],
    gathered: [world * M_SHARD, K] (the gathered x, kept for autodiff).

    With PUSH, the producers push x into every peer's heap inbox instead
    (``push_shards``: no staging, no wait, one NVLink crossing before a flag);
    STAGE_OFF and SLOT_BYTES then locate the inbox ([world * M_SHARD, K] per
    call parity), peers' rows of A are read from it and this rank's straight
    from x (no wait: the tiles start at once), and ``gathered`` is not written.
    FLAG_SCOPE is the scope of the chunk-flag waits: "gpu" when this GPU's
    producers raise them (pulls), "sys" when peer GPUs' producers do (PUSH).
    """
    pid = tl.program_id(0)
    if pid < NUM_COMM:
        if PUSH:
            push_shards(ctx, x_ptr, pid, NUM_COMM, M_SHARD, K, STAGE_OFF, SLOT_BYTES, FLAGS_OFF,
                        CHUNK_ROWS, COPY_BLOCK_C, SCOPE)
        else:
            pull_shards(ctx, x_ptr, gathered_ptr, pid, NUM_COMM, M_SHARD, K, STAGE_OFF,
                        SLOT_BYTES, READY_OFF, FLAGS_OFF, CHUNK_ROWS, COPY_BLOCK_C, SCOPE)
    else:
        me = dl.rank(ctx)
        world = dl.num_ranks(ctx)
        e = dl.epoch(ctx)
        m_tiles = tl.cdiv(M_SHARD, BLOCK_M)
        n_tiles = tl.cdiv(N, BLOCK_N)
        n_chunks = tl.cdiv(M_SHARD, CHUNK_ROWS)
        flags = dl.heap_ptr(ctx, FLAGS_OFF, tl.int32)
        if PUSH:
            gathered_ptr = dl.parity_ptr(ctx, STAGE_OFF, SLOT_BYTES,
                                       x_ptr.dtype.element_ty)
        tile = (pid - NUM_COMM) // SPLIT_K
        split = (pid - NUM_COMM) % SPLIT_K
        if ALL_ROWS:
            # Small M: one tile spans every rank's rows, so w is read once.
            tn = tile
            for chunk in range(0, world * n_chunks):
                if PUSH:
                    if chunk // n_chunks != me:  # own rows come from x: no flag
                        dl.wait(ctx, flags + chunk, e, "ge", chunk // n_chunks, FLAG_SCOPE)
                else:
                    dl.wait(ctx, flags + chunk, e, "ge", chunk // n_chunks, FLAG_SCOPE)
            rows = tl.arange(0, BLOCK_M)
            row_mask = rows < world * M_SHARD
            if PUSH:
                own = (rows // M_SHARD) == me
                a_rows = tl.where(own, x_ptr + (rows - me * M_SHARD) * K, gathered_ptr + rows * K)
            else:
                a_rows = gathered_ptr + rows * K
            out_rows = rows
            counter_index = tn
        else:
            src, tm, tn = rank_major_tile(tile, me, world, m_tiles, n_tiles, GROUP_M)
            rows = tm * BLOCK_M + tl.arange(0, BLOCK_M)
            row_mask = rows < M_SHARD
            # One source for A per tile keeps its loads vectorized; with pushes, own
            # rows come from x, with nothing to wait for.
            a_base = gathered_ptr + tl.cast(src, tl.int64) * (M_SHARD * K)
            if PUSH:
                if src == me:
                    a_base = x_ptr
                else:
                    wait_rows(ctx, flags, e, src, tm * BLOCK_M, M_SHARD, BLOCK_M, CHUNK_ROWS,
                              FLAG_SCOPE)
            else:
                wait_rows(ctx, flags, e, src, tm * BLOCK_M, M_SHARD, BLOCK_M, CHUNK_ROWS,
                          FLAG_SCOPE)
            a_rows = a_base + rows * K
            out_rows = src * M_SHARD + rows
            counter_index = (src * m_tiles + tm) * n_tiles + tn
        cols = block_range(tn, BLOCK_N)
        col_mask = cols < N
        k_lo, k_hi = k_range(split, K, K_SPLIT)
        acc = pointer_tile_acc(a_rows, w_ptr, row_mask, cols, col_mask, k_lo, k_hi, K, N,
                               BLOCK_M, BLOCK_N, BLOCK_K, DOT_PRECISION, B_T, SCALING, xs_ptr,
                               ws_ptr, out_rows)
        out_offs = out_rows[:, None] * N + cols[None, :]
        mask = row_mask[:, None] & col_mask[None, :]
        if SPLIT_K == 1:
            tl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            finish_split_k(acc, split, out_ptr + out_offs,
                           dl.heap_ptr(ctx, PARTIALS_OFF, tl.float32), out_offs, mask,
                           dl.heap_ptr(ctx, COUNTERS_OFF, tl.int32) + counter_index,
                           world * M_SHARD * N, SPLIT_K)


@triton.jit
def ag_matmul_tma_kernel(ctx, x_ptr, w_ptr, xs_ptr, ws_ptr, out_ptr, gathered_ptr,
                         M_SHARD: tl.constexpr, N: tl.constexpr, K: tl.constexpr,
                         STAGE_OFF: tl.constexpr, SLOT_BYTES: tl.constexpr,
                         READY_OFF: tl.constexpr, FLAGS_OFF: tl.constexpr,
                         SCHEDULE_OFF: tl.constexpr, NUM_COMM: tl.constexpr,
                         CHUNK_ROWS: tl.constexpr, COPY_BLOCK_C: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         GROUP_M: tl.constexpr, SCOPE: tl.constexpr,
                         NUM_PROGRAMS: tl.constexpr, PRODUCERS_JOIN: tl.constexpr,
                         SUBTILE: tl.constexpr, DOT_PRECISION: tl.constexpr,
                         B_T: tl.constexpr, SCALING: tl.constexpr = None):
    """Grid: (NUM_PROGRAMS,), at most what the GPU holds at once (waits spin).

    Same operands as ``ag_matmul_kernel`` (w [N, K] with B_T: ``_gemm.weight_desc``);
    M_SHARD is a multiple of BLOCK_M.
    The first NUM_COMM programs gather; the others (and, with
    PRODUCERS_JOIN, the producers once done) take tiles in
    ``rank_major_tile`` order from the counter at SCHEDULE_OFF. The last
    program to finish resets the counters, so the next call (ordered after
    this one on the stream) starts from zero.
    """
    pid = tl.program_id(0)
    if pid < NUM_COMM:
        pull_shards(ctx, x_ptr, gathered_ptr, pid, NUM_COMM, M_SHARD, K, STAGE_OFF,
                    SLOT_BYTES, READY_OFF, FLAGS_OFF, CHUNK_ROWS, COPY_BLOCK_C, SCOPE)
    if (pid >= NUM_COMM) or PRODUCERS_JOIN:
        me = dl.rank(ctx)
        world = dl.num_ranks(ctx)
        e = dl.epoch(ctx)
        m_tiles = M_SHARD // BLOCK_M
        n_tiles = (N + BLOCK_N - 1) // BLOCK_N
        total = world * m_tiles * n_tiles
        flags = dl.heap_ptr(ctx, FLAGS_OFF, tl.int32)
        schedule = dl.heap_ptr(ctx, SCHEDULE_OFF, tl.int32)
        a_desc = tl.make_tensor_descriptor(gathered_ptr, shape=[world * M_SHARD, K],
                                           strides=[K, 1], block_shape=[BLOCK_M, BLOCK_K])
        b_desc = weight_desc(w_ptr, K, N, BLOCK_K, BLOCK_N, B_T)
        c_desc = out_desc(out_ptr, world * M_SHARD, N, BLOCK_M, BLOCK_N, SUBTILE)
        tile = tl.atomic_add(schedule, 1, sem="relaxed", scope="gpu")
        while tile < total:
            src, tm, tn = rank_major_tile(tile, me, world, m_tiles, n_tiles, GROUP_M)
            _wait_tile_rows_for_tma(ctx, flags, e, src, tm, M_SHARD, BLOCK_M, CHUNK_ROWS)
            row0 = src * M_SHARD + tm * BLOCK_M
            col0 = tn * BLOCK_N
            acc = tile_acc(a_desc, b_desc, row0, col0, 0, K, BLOCK_M, BLOCK_N, BLOCK_K,
                           DOT_PRECISION, B_T=B_T, SCALING=SCALING, a_scale=xs_ptr,
                           b_scale=ws_ptr, s_rows=row0 + tl.arange(0, BLOCK_M),
                           s_mask=tl.arange(0, BLOCK_M) < M_SHARD, N_COLS=N,
                           K_BLOCKS=(K + 127) // 128)
            store_tile(c_desc, acc, 0, row0, col0, BLOCK_M, BLOCK_N, SUBTILE)
            tile = tl.atomic_add(schedule, 1, sem="relaxed", scope="gpu")
        workers = NUM_PROGRAMS if PRODUCERS_JOIN else NUM_PROGRAMS - NUM_COMM
        finished = tl.atomic_add(schedule + 1, 1, sem="acq_rel", scope="gpu")
        if finished == workers - 1:
            # Every worker has taken its last (failed) tile: nobody reads the counter again.
            tl.atomic_xchg(schedule, 0, sem="relaxed", scope="gpu")
            tl.atomic_xchg(schedule + 1, 0, sem="relaxed", scope="gpu")


@triton.jit
def _tail_pieces(ctx, inbox_desc, w_ptr, xs_ptr, ws_ptr, out_ptr, flags, e, me, world, whole,
                 per_rank,
                 m_tiles, n_tiles, M_SHARD: tl.constexpr, N: tl.constexpr,
                 K: tl.constexpr, CHUNK_ROWS: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                 TAIL_TILES: tl.constexpr, PIECES: tl.constexpr, STAGES: tl.constexpr,
                 DOT_PRECISION: tl.constexpr, B_T: tl.constexpr,
                 SCALING: tl.constexpr = None):
    """The copy-engine kernel's split-N tail: program p computes piece p % PIECES
    (BLOCK_N / PIECES columns) of tail tile p // PIECES, the peer tiles dealt
    after ``whole``, reading A through the kernel's ``inbox_desc``. Pieces of one
    tile go to neighbouring programs, which read the same rows of the inbox at
    about the same time (L2 hits). STAGES: the pieces' pipeline depth (a narrower
    piece takes less shared memory per stage)."""
    PIECE_N: tl.constexpr = BLOCK_N // PIECES
    pid = tl.program_id(0)
    if pid < TAIL_TILES * PIECES:
        src, tm, tn = peer_arrival_tile(whole + pid // PIECES, me, world, per_rank, m_tiles,
                                        n_tiles, GROUP_M)
        col0 = tn * BLOCK_N + (pid % PIECES) * PIECE_N
        if col0 < N:  # the last column of tiles may end before its last pieces
            b_desc = weight_desc(w_ptr, K, N, BLOCK_K, PIECE_N, B_T)
            c_desc = tl.make_tensor_descriptor(out_ptr, shape=[world * M_SHARD, N],
                                               strides=[N, 1], block_shape=[BLOCK_M, PIECE_N])
            _wait_tile_rows_for_tma(ctx, flags, e, src, tm, M_SHARD, BLOCK_M, CHUNK_ROWS)
            row0 = src * M_SHARD + tm * BLOCK_M
            acc = tile_acc(inbox_desc, b_desc, row0, col0, 0, K, BLOCK_M, PIECE_N, BLOCK_K,
                            DOT_PRECISION, STAGES, B_T=B_T, SCALING=SCALING, a_scale=xs_ptr,
                            b_scale=ws_ptr, s_rows=row0 + tl.arange(0, BLOCK_M),
                            s_mask=tl.arange(0, BLOCK_M) < M_SHARD, N_COLS=N,
                            K_BLOCKS=(K + 127) // 128)
            c_desc.store([row0, col0], acc.to(out_ptr.dtype.element_ty))


@triton.jit
def ag_matmul_ce_kernel(ctx, x_ptr, w_ptr, xs_ptr, ws_ptr, out_ptr,
                        M_SHARD: tl.constexpr, N: tl.constexpr, K: tl.constexpr,
                        INBOX_OFF: tl.constexpr, PARITY_BYTES: tl.constexpr,
                        FLAGS_OFF: tl.constexpr, SENT_OFF: tl.constexpr,
                        CHUNK_ROWS: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        GROUP_M: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
                        TAIL_TILES: tl.constexpr, TAIL_UNITS: tl.constexpr,
                        PARTIALS_OFF: tl.constexpr, COUNTERS_OFF: tl.constexpr,
                        TAIL_SPLIT_N: tl.constexpr, TAIL_STAGES: tl.constexpr,
                        FLATTEN: tl.constexpr, SUBTILE: tl.constexpr,
                        DOT_PRECISION: tl.constexpr, B_T: tl.constexpr,
                        SCALING: tl.constexpr = None):
    """Grid: (NUM_PROGRAMS,), at most what the GPU holds at once.

    x: [M_SHARD, K], w: [K, N] ([N, K] with B_T: ``_gemm.weight_desc``) -> out:
    [world * M_SHARD, N]. Peers push their
    shards into this rank's heap inbox of parity ``epoch % 2`` ([world *
    M_SHARD, K] at INBOX_OFF), raising chunk flags at FLAGS_OFF, while this
    runs; this rank's pushes raise its "sent" words at SENT_OFF. M_SHARD is
    a multiple of BLOCK_M.

    Stream-K tail: with TAIL_TILES > 0, the last TAIL_TILES tiles (a partial
    wave: fewer than NUM_PROGRAMS, all peers' tiles) are not dealt whole.
    Their K blocks (TAIL_TILES * cdiv(K, BLOCK_K) "units") are cut into runs
    of TAIL_UNITS, one run per program, so that every program ends at about
    the same time; programs sharing a tile combine their float32 partials in
    the heap (``finish_stream_k``: slots at PARTIALS_OFF, one per (program,
    tile) pair, numbered program + tile; a counter per tile at COUNTERS_OFF).

    Split-N tail: with TAIL_SPLIT_N > 1 instead, each of the TAIL_TILES last
    tiles is cut into TAIL_SPLIT_N pieces BLOCK_N / TAIL_SPLIT_N wide, one
    piece per program (TAIL_TILES * TAIL_SPLIT_N <= NUM_PROGRAMS): no partial
    sums, and the last wave takes a piece's time instead of a tile's. The
    pieces' K loops pipeline TAIL_STAGES deep.

    FLATTEN (chunks no finer than tiles) flattens the two tile loops with their
    K loops (``tl.range(..., flatten=True)``): the next tile's first loads are
    issued under this tile's last MMAs and epilogue. Peers' tiles then wait with
    ``dl.wait_for_tma``, whose token orders those loads after the wait.
    """
    pid = tl.program_id(0)
    me = dl.rank(ctx)
    world = dl.num_ranks(ctx)
    e = dl.epoch(ctx)
    m_tiles = M_SHARD // BLOCK_M
    n_tiles = (N + BLOCK_N - 1) // BLOCK_N
    per_rank = m_tiles * n_tiles
    n_chunks = (M_SHARD + CHUNK_ROWS - 1) // CHUNK_ROWS
    flags = dl.heap_ptr(ctx, FLAGS_OFF, tl.int32)
    inbox = dl.parity_ptr(ctx, INBOX_OFF, PARITY_BYTES,
                         x_ptr.dtype.element_ty)
    x_desc = tl.make_tensor_descriptor(x_ptr, shape=[M_SHARD, K], strides=[K, 1],
                                       block_shape=[BLOCK_M, BLOCK_K])
    inbox_desc = tl.make_tensor_descriptor(inbox, shape=[world * M_SHARD, K], strides=[K, 1],
                                           block_shape=[BLOCK_M, BLOCK_K])
    b_desc = weight_desc(w_ptr, K, N, BLOCK_K, BLOCK_N, B_T)
    c_desc = out_desc(out_ptr, world * M_SHARD, N, BLOCK_M, BLOCK_N, SUBTILE)
    # This rank's rows: ready at once, read from x itself.
    for tile in tl.range(pid, per_rank, NUM_PROGRAMS, flatten=FLATTEN):
        tm, tn = grouped_tile(tile, m_tiles, n_tiles, GROUP_M)
        acc = tile_acc(x_desc, b_desc, tm * BLOCK_M, tn * BLOCK_N, 0, K, BLOCK_M, BLOCK_N,
                       BLOCK_K, DOT_PRECISION, B_T=B_T, SCALING=SCALING, a_scale=xs_ptr,
                       b_scale=ws_ptr, s_rows=me * M_SHARD + tm * BLOCK_M + tl.arange(0, BLOCK_M),
                       s_mask=tl.arange(0, BLOCK_M) < M_SHARD, N_COLS=N,
                       K_BLOCKS=(K + 127) // 128)
        store_tile(c_desc, acc, 0, me * M_SHARD + tm * BLOCK_M, tn * BLOCK_N, BLOCK_M, BLOCK_N,
                   SUBTILE)
    # Peers' rows from the inbox; rank me-1 pushes to this rank first. The
    # round-robin goes on where the local tiles left it.
    first = (pid + NUM_PROGRAMS - per_rank % NUM_PROGRAMS) % NUM_PROGRAMS
    whole = (world - 1) * per_rank - TAIL_TILES
    for item in tl.range(first, whole, NUM_PROGRAMS, flatten=FLATTEN):
        src, tm, tn = peer_arrival_tile(item, me, world, per_rank, m_tiles, n_tiles, GROUP_M)
        row0 = src * M_SHARD + tm * BLOCK_M
        if FLATTEN:
            row0 += _tile_rows_for_tma(ctx, flags, e, src, tm, n_chunks, BLOCK_M, CHUNK_ROWS)
        else:
            _wait_tile_rows_for_tma(ctx, flags, e, src, tm, M_SHARD, BLOCK_M, CHUNK_ROWS)
        acc = tile_acc(inbox_desc, b_desc, row0, tn * BLOCK_N, 0, K, BLOCK_M, BLOCK_N, BLOCK_K,
                       DOT_PRECISION, B_T=B_T, SCALING=SCALING, a_scale=xs_ptr,
                       b_scale=ws_ptr, s_rows=src * M_SHARD + tm * BLOCK_M + tl.arange(0, BLOCK_M),
                       s_mask=tl.arange(0, BLOCK_M) < M_SHARD, N_COLS=N,
                       K_BLOCKS=(K + 127) // 128)
        store_tile(c_desc, acc, 0, row0, tn * BLOCK_N, BLOCK_M, BLOCK_N, SUBTILE)
    if TAIL_TILES > 0 and TAIL_SPLIT_N > 1:
        _tail_pieces(ctx, inbox_desc, w_ptr, xs_ptr, ws_ptr, out_ptr, flags, e, me, world, whole,
                     per_rank,
                     m_tiles, n_tiles, M_SHARD, N, K, CHUNK_ROWS, BLOCK_M,
                     BLOCK_N, BLOCK_K, GROUP_M, TAIL_TILES, TAIL_SPLIT_N, TAIL_STAGES,
                     DOT_PRECISION, B_T, SCALING)
    if TAIL_TILES > 0 and TAIL_SPLIT_N == 1:
        k_blocks = tl.cdiv(K, BLOCK_K)
        partials = dl.heap_ptr(ctx, PARTIALS_OFF, tl.float32)
        counters = dl.heap_ptr(ctx, COUNTERS_OFF, tl.int32)
        unit = pid * TAIL_UNITS
        unit_end = tl.minimum(unit + TAIL_UNITS, TAIL_TILES * k_blocks)
        while unit < unit_end:
            tail = unit // k_blocks
            run_end = tl.minimum(unit_end, (tail + 1) * k_blocks)
            src, tm, tn = peer_arrival_tile(whole + tail, me, world, per_rank, m_tiles, n_tiles,
                                     GROUP_M)
            _wait_tile_rows_for_tma(ctx, flags, e, src, tm, M_SHARD, BLOCK_M, CHUNK_ROWS)
            row0 = src * M_SHARD + tm * BLOCK_M
            acc = tile_acc(inbox_desc, b_desc, row0, tn * BLOCK_N,
                            (unit - tail * k_blocks) * BLOCK_K,
                            (run_end - tail * k_blocks) * BLOCK_K, BLOCK_M, BLOCK_N, BLOCK_K,
                            DOT_PRECISION, B_T=B_T, SCALING=SCALING, a_scale=xs_ptr,
                            b_scale=ws_ptr, s_rows=row0 + tl.arange(0, BLOCK_M),
                            s_mask=tl.arange(0, BLOCK_M) < M_SHARD, N_COLS=N,
                            K_BLOCKS=(K + 127) // 128)
            # The programs whose runs meet this tile: consecutive, from first_program.
            first_program = tail * k_blocks // TAIL_UNITS
            parts = ((tail + 1) * k_blocks - 1) // TAIL_UNITS - first_program + 1
            finish_stream_k(acc, pid + tail, first_program + tail, parts, partials,
                            counters + tail, out_ptr, row0, tn * BLOCK_N, N, BLOCK_M, BLOCK_N)
            unit = run_end
    if pid == 0:
        # x must outlive this rank's pushes: they have ended when the kernel has.
        wait_pushes_sent(ctx, SENT_OFF, me, world, e)


@triton.jit
def copy_gathered_kernel(ctx, x_ptr, after_ptr, gathered_ptr, M_SHARD: tl.constexpr,
                         K: tl.constexpr, INBOX_OFF: tl.constexpr, PARITY_BYTES: tl.constexpr,
                         BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Grid: (cdiv(world * M_SHARD, BLOCK_R), cdiv(K, BLOCK_C)).

    The gathered x [world * M_SHARD, K] (the autodiff residual), copied out of the
    heap inbox of parity ``epoch % 2`` that the call's GEMM read (peers' rows) and
    from x (this rank's rows), so that it outlives the inbox's reuse two calls
    later. Launched after the GEMM (``after_ptr``, its output, orders it there):
    every peer row has arrived by then.
    """
    me = dl.rank(ctx)
    # int64 rows: world * M_SHARD * K may pass 2^31 elements.
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    src = rows // M_SHARD
    world = dl.num_ranks(ctx)
    mask = (rows < world * M_SHARD)[:, None] & (cols < K)[None, :]
    inbox = dl.parity_ptr(ctx, INBOX_OFF, PARITY_BYTES,
                         x_ptr.dtype.element_ty)
    own = (src == me)[:, None]
    from_inbox = tl.load(inbox + rows[:, None] * K + cols[None, :], mask=mask & ~own)
    from_x = tl.load(x_ptr + (rows - me * M_SHARD)[:, None] * K + cols[None, :], mask=mask & own)
    tl.store(gathered_ptr + rows[:, None] * K + cols[None, :],
             tl.where(own, from_x, from_inbox), mask=mask)
