"""moe_tp_mlp's two overlapped pieces: the all-gather fused into the first grouped
GEMM, and the reduce-scatter fused into the second.

Each rank sorts its own (token, expert) pairs by expert: its "chunk", R_SHARD
rows of its tokens (a token once per pair), in groups of one expert each,
group sizes ``sizes[rank]`` [E]. Every chunk's sizes sum to R_SHARD (the op
maps ids outside [0, E) into the last expert, with weight 0). With every
rank's sizes ([WORLD, E], gathered before), every rank knows every chunk's
group table (``grouped_gemm.group_table``), hence the same tile list for a
chunk on every rank: a tile of chunk s is (group e, row tile, column tile),
rows [starts[e] + tm * BLOCK_M, ...) of the chunk, clipped at the group's end.

``ag_grouped_gemm_kernel``: out[c, s * R_SHARD + r] = chunk_s[r] @ w_c[e(r)]
for every chunk s (the gather) and weight c (w1, and w_up with UP). Peers'
copy engines push their chunks into this rank's heap inbox while the kernel
runs (``ops._inbox.push_to_inboxes``, a flag per CHUNK_ROWS rows); the
tiles run this rank's chunk first (read from x, ready at once), then each
peer's in the order they arrive (me-1 first), each tile after the flags of
its rows.

``grouped_gemm_rs_kernel``: out[r] = sum over ranks of (chunk_me's hidden
rows @ w[e(r)]), this rank's chunk's rows of the second GEMM summed over the
group. Tiles of the peers' chunks first (me+1's first: the order in which
peers need them), each pushed as soon as it is computed, its rows (only
the group's: a tile at a group's end also computed the next group's first
rows) stored into the owner's heap inbox in this source's slot, then its
flag raised. This rank's chunk's tiles last: each waits for the flags of
the same tile from the W - 1 peers and adds their partials to its own
(float32) in the epilogue: the reduce-scatter costs no pass of its own
(``_partials.exchange_tile``, matmul_rs's exchange).
Reuse and deadlock as in ``matmul_rs`` (two parities; every rank pushes to
every other in every call: a chunk holds R_SHARD >= 1 rows; own tiles wait
only on peers' pushes, which every program makes before any own tile).
"""

import triton
import triton.language as tl

import jaxtdist.language as dl
from jaxtdist.kernels._gemm import (pointer_tile_acc, ranked_out_desc, store_tile, tile_acc,
                                   weight_desc)
from jaxtdist.kernels._inbox import wait_pushes_sent, wait_rows
from jaxtdist.kernels._partials import exchange_tile, partials_inbox
from jaxtdist.kernels.grouped_gemm import group_table, group_tile, store_rows


@triton.jit
def _first_of(pid, base, NUM_PROGRAMS: tl.constexpr):
    """This program's first tile of a chunk whose tiles come after ``base`` tiles of
    the round-robin (program p takes the tiles numbered p mod NUM_PROGRAMS)."""
    return (pid + NUM_PROGRAMS - base % NUM_PROGRAMS) % NUM_PROGRAMS


@triton.jit
def ag_grouped_gemm_kernel(ctx, x_ptr, w_ptr, wup_ptr, sizes_ptr, out_ptr,
                           R_SHARD: tl.constexpr, H: tl.constexpr, F: tl.constexpr,
                           E: tl.constexpr, BLOCK_G: tl.constexpr, INBOX_OFF: tl.constexpr,
                           PARITY_BYTES: tl.constexpr, FLAGS_OFF: tl.constexpr,
                           SENT_OFF: tl.constexpr, CHUNK_ROWS: tl.constexpr,
                           SCOPE: tl.constexpr, WORLD: tl.constexpr, UP: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           GROUP_M: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
                           SUBTILE: tl.constexpr, TMA: tl.constexpr,
                           DOT_PRECISION: tl.constexpr, W_T: tl.constexpr):
    """Grid: (NUM_PROGRAMS,). x [R_SHARD, H] (this rank's chunk), w and w_up [E, H, F]
    ([E, F, H] with W_T), sizes [WORLD, E] int32 -> out [1 + UP, WORLD * R_SHARD, F].

    Peers' chunks arrive in this rank's inbox of parity ``epoch % 2`` ([WORLD *
    R_SHARD, H] at INBOX_OFF, flags per CHUNK_ROWS rows at FLAGS_OFF raised at
    SCOPE); this rank's pushes raise its "sent" words at SENT_OFF. TMA: rows of
    x, w and out are 16-byte multiples (Triton's global scratch given).
    """
    pid = tl.program_id(0)
    me = dl.rank(ctx)
    e = dl.epoch(ctx)
    flags = dl.heap_ptr(ctx, FLAGS_OFF, tl.int32)
    inbox = dl.parity_ptr(ctx, INBOX_OFF, PARITY_BYTES, x_ptr.dtype.element_ty)
    n_cols: tl.constexpr = (F + BLOCK_N - 1) // BLOCK_N
    n_tiles: tl.constexpr = n_cols * (1 + UP)  # w_up's column tiles after w's
    if TMA:
        c_desc = ranked_out_desc(out_ptr, 1 + UP, WORLD * R_SHARD, F, BLOCK_M, BLOCK_N, SUBTILE)
    base = 0
    for step in range(0, WORLD):
        src = (me + WORLD - step) % WORLD  # own chunk, then me-1's: the push order
        own = step == 0
        chunk = tl.where(own, x_ptr, inbox + src.to(tl.int64) * (R_SHARD * H))
        index, starts, ends, tile_starts, tile_ends, _ = group_table(
            sizes_ptr + src * E, R_SHARD, E, BLOCK_G, BLOCK_M)
        chunk_tiles = tl.max(tile_ends, axis=0) * n_tiles
        if TMA:
            a_desc = tl.make_tensor_descriptor(chunk, shape=[R_SHARD, H], strides=[H, 1],
                                               block_shape=[BLOCK_M, BLOCK_K])
        # num_stages=1: never pipeline the tile loop itself (where the K loop folds
        # away, K <= BLOCK_K, Triton's pipeliner cannot predicate the per-group
        # weight descriptor it would then have to prefetch).
        for t in tl.range(_first_of(pid, base, NUM_PROGRAMS), chunk_tiles, NUM_PROGRAMS,
                          num_stages=1):
            g, row0, row_end, tn = group_tile(t, index, starts, ends, tile_starts, tile_ends,
                                              n_tiles, GROUP_M, BLOCK_M)
            up = tn >= n_cols
            col0 = tl.where(up, tn - n_cols, tn) * BLOCK_N
            w_group = tl.where(up, wup_ptr, w_ptr) + g.to(tl.int64) * (H * F)
            if not own:
                wait_rows(ctx, flags, e, src, row0, R_SHARD, BLOCK_M, CHUNK_ROWS, SCOPE)
                if TMA:
                    dl.fence_async_proxy()  # the tile's TMA loads after the wait
            rows = row0.to(tl.int64) + tl.arange(0, BLOCK_M)
            cols = col0 + tl.arange(0, BLOCK_N)
            if TMA:
                acc = tile_acc(a_desc, weight_desc(w_group, H, F, BLOCK_K, BLOCK_N, W_T), row0,
                               col0, 0, H, BLOCK_M, BLOCK_N, BLOCK_K, DOT_PRECISION, B_T=W_T)
            else:
                tl.static_assert(not W_T, "W_T needs TMA")
                acc = pointer_tile_acc(chunk + rows * H, w_group, rows < row_end, cols, cols < F,
                                       0, H, H, F, BLOCK_M, BLOCK_N, BLOCK_K, DOT_PRECISION)
            out_row0 = src * R_SHARD + row0
            if TMA and row0 + BLOCK_M <= row_end:
                store_tile(c_desc, acc, up.to(tl.int32), out_row0, col0, BLOCK_M, BLOCK_N,
                           SUBTILE, RANKED=True)
            else:  # the group's last rows: drop the next group's
                plane = out_ptr + (up.to(tl.int64) * WORLD + src) * (R_SHARD * F)
                store_rows(plane, acc, rows, row_end, cols, F)
        base += chunk_tiles
    if pid == 0 and WORLD > 1:
        # x must outlive this rank's pushes: they have ended when the kernel has.
        wait_pushes_sent(ctx, SENT_OFF, me, WORLD, e)


@triton.jit
def grouped_gemm_rs_kernel(ctx, a_ptr, w_ptr, sizes_ptr, out_ptr,
                           R_SHARD: tl.constexpr, K: tl.constexpr, N: tl.constexpr,
                           E: tl.constexpr, BLOCK_G: tl.constexpr, INBOX_OFF: tl.constexpr,
                           PARITY_BYTES: tl.constexpr, FLAGS_OFF: tl.constexpr,
                           CHUNK_TILES: tl.constexpr, PARTIAL_INPUT: tl.constexpr,
                           WORLD: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
                           INTERLEAVE: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                           SUBTILE: tl.constexpr, TMA: tl.constexpr,
                           DOT_PRECISION: tl.constexpr, W_T: tl.constexpr):
    """Grid: (NUM_PROGRAMS,), at most one program per SM on GPUs (own tiles spin).

    a [WORLD * R_SHARD, K] (every chunk's rows), w [E, K, N] ([E, N, K] with W_T),
    sizes [WORLD, E] int32 -> out [R_SHARD, N] float32: this rank's chunk's rows of
    a @ w[group], summed over the ranks. The inbox of parity ``epoch % 2`` at
    INBOX_OFF holds WORLD - 1 slots of [R_SHARD, N] partials (the input dtype
    with PARTIAL_INPUT, else float32), slot ``(src - dst + WORLD - 1) % WORLD``;
    flags at FLAGS_OFF, CHUNK_TILES per slot (a bound on a chunk's tiles).
    INTERLEAVE (GPUs): tiles dealt round-robin over programs; else (the
    interpreter, whose programs run one after another) program 0 pushes every
    peer tile before any program waits.
    """
    pid = tl.program_id(0)
    me = dl.rank(ctx)
    e = dl.epoch(ctx)
    inbox, flags = partials_inbox(ctx, a_ptr, INBOX_OFF, PARITY_BYTES, FLAGS_OFF, PARTIAL_INPUT)
    slot_elems = R_SHARD * N
    n_tiles: tl.constexpr = (N + BLOCK_N - 1) // BLOCK_N
    if TMA:
        a_desc = tl.make_tensor_descriptor(a_ptr, shape=[WORLD * R_SHARD, K], strides=[K, 1],
                                           block_shape=[BLOCK_M, BLOCK_K])
    base = 0
    for step in range(1, WORLD + 1):
        dst = (me + step) % WORLD  # me+1's chunk first; this rank's own last
        own = step == WORLD
        index, starts, ends, tile_starts, tile_ends, _ = group_table(
            sizes_ptr + dst * E, R_SHARD, E, BLOCK_G, BLOCK_M)
        chunk_tiles = tl.max(tile_ends, axis=0) * n_tiles
        if INTERLEAVE:
            first, last, stride = _first_of(pid, base, NUM_PROGRAMS), chunk_tiles, NUM_PROGRAMS
            base += chunk_tiles
        elif own:
            first, last, stride = pid, chunk_tiles, NUM_PROGRAMS
        else:
            first, last, stride = 0, tl.where(pid == 0, chunk_tiles, 0), 1
        for t in tl.range(first, last, stride, num_stages=1):  # as in ag_grouped_gemm_kernel
            g, row0, row_end, tn = group_tile(t, index, starts, ends, tile_starts, tile_ends,
                                              n_tiles, GROUP_M, BLOCK_M)
            col0 = tn * BLOCK_N
            rows = row0.to(tl.int64) + tl.arange(0, BLOCK_M)
            w_group = w_ptr + g.to(tl.int64) * (K * N)
            if TMA:
                acc = tile_acc(a_desc, weight_desc(w_group, K, N, BLOCK_K, BLOCK_N, W_T),
                               dst * R_SHARD + row0, col0, 0, K, BLOCK_M, BLOCK_N, BLOCK_K,
                               DOT_PRECISION, B_T=W_T)
            else:
                tl.static_assert(not W_T, "W_T needs TMA")
                cols = col0 + tl.arange(0, BLOCK_N)
                acc = pointer_tile_acc(a_ptr + dst.to(tl.int64) * (R_SHARD * K) + rows * K,
                                       w_group, rows < row_end, cols, cols < N, 0, K, K, N,
                                       BLOCK_M, BLOCK_N, BLOCK_K, DOT_PRECISION)
            # Only the group's rows (a tile at a group's end computed the next group's
            # first rows too); pointer stores, whose mask drops them.
            if own:
                exchange_tile(ctx, acc, rows, row_end, row0, col0, True, inbox, flags,
                              CHUNK_TILES, t, me, e, me, slot_elems, None, out_ptr, N, BLOCK_M,
                              BLOCK_N, SUBTILE, WORLD, False)
            else:
                exchange_tile(ctx, acc, rows, row_end, row0, col0, False, inbox, flags,
                              CHUNK_TILES, t, me, e, dst, slot_elems, None, out_ptr, N, BLOCK_M,
                              BLOCK_N, SUBTILE, WORLD, False)
