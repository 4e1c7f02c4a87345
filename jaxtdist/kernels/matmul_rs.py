"""matmul_rs: (x @ w) summed over the ranks and scattered along M, the reduction
overlapped with the GEMM tile by tile.

Every rank holds x [M, K] (its K shard) and w [K, N]; rank r owns output rows
[r * M_SHARD, (r + 1) * M_SHARD). One persistent launch computes every output
tile of this rank's partial product on the GEMM core (``_gemm``: TMA loads,
the pipelined mainloop, a subtiled TMA store of the output), in the order of
``rank_major_tile(tile, me + 1, ...)``: the rows owned by rank me+1 first,
then me+2, ..., and this rank's own rows last.

- A peer's tile is pushed as soon as it is computed: its partial (float32, or
  the input dtype with PARTIAL_INPUT) goes into the owner's heap inbox, in the
  slot of this source rank, as TMA stores (PUSH_TMA; its flag is raised after
  the next tile's mainloop, once ``dl.wait_tma_stores`` finds them landed) or
  as SM stores through ``dl.symm_at`` pointers (its flag raised at once); the
  flag is set to the epoch (``dl.notify``: a release at system scope).
- An own tile is computed last, and its partial stays in registers: the
  program waits (acquire) for the tile's flag of each of the other W - 1
  ranks, once per tile, then adds their partials in float32 (every piece's
  W - 1 loads in flight together) and stores the output tile.
- Both epilogues run a column piece (SUBTILE of them) at a time, so that a
  peer's partial and the offsets fit in registers beside the accumulator
  (``_partials.exchange_tile``, shared with moe_tp's reduce-scatter).

Why one kernel and not a GEMM kernel then a reduction kernel: the own tiles
are the reduction. Since they come last in every program's list, the
partials of the own rows pushed by peers early in their lists (rank me-1
pushes to me first) have arrived by then, and the reduction of each output
tile costs W - 1 reads of local heap memory in the epilogue of a GEMM tile
that was computed anyway; a second kernel would write this rank's partial
to memory and read it back, and could not start before the last GEMM tile.
The price is the tail: the partial from rank me+1 (its last peer step) can
arrive just before this rank's own tiles need it.

Inbox layout (``ops/matmul_rs.RsWorkspace``, ``_partials``): per call parity (``e % 2``),
W - 1 slots of [M_SHARD, N] partials, slot ``(src - dst + W - 1) % W`` of
owner ``dst`` holding the partial of source ``src``; then one int32 flag
per (slot, output tile).

Reuse (why two parities suffice, with no acknowledgement): source s writes
the slot of parity p in owner o's inbox at epochs e and e + 2; o reads it
in its kernel of epoch e. s's kernel e + 2 starts after s's kernel e + 1
ended, and that kernel reduced s's own rows, so it waited for o's pushes of
epoch e + 1 (every rank pushes to every other in every call). o makes those
pushes in its kernel e + 1, which starts after its kernel e (the last
reader of parity p) ended: kernels of one device run in program order
(``Call`` orders every op after the previous one). So o's reads of epoch e
come before s's writes of epoch e + 2. A flag may already hold e + 1 (or
later) when o waits for e: flags compare ">=", and the later value's
release also publishes the earlier data (s stored it before). Flags and
epochs only grow, so nothing is reset.

Deadlock: the only waits are an own tile's waits on other ranks' pushes,
and every program computes all its peer tiles (the first tile loop) before
any own tile (the second). On GPUs the persistent grid is at most one
program per SM (all resident), tiles dealt round-robin (INTERLEAVE). Under
the interpreter a rank's programs run one after another, so program 0
pushes every peer tile before any program of the rank waits.
"""

import triton
import triton.language as tl

import jaxtdist.language as dl
from jaxtdist.kernels._gemm import out_desc, pointer_tile_acc, store_tile, tile_acc, weight_desc
from jaxtdist.kernels._partials import exchange_tile, partials_inbox, raise_flag, slot_of
from jaxtdist.kernels._tiles import block_range, grouped_tile, rank_major_tile
from jaxtdist.kernels._trace import stamp


@triton.jit
def _publish(ctx, tile, flags, me, e, per_rank, m_tiles, n_tiles, GROUP_M: tl.constexpr,
             WORLD: tl.constexpr):
    """Raises the flag of peer tile ``tile`` (of this rank's list) once its TMA
    stores have landed."""
    dst, tm, tn = rank_major_tile(tile, me + 1, WORLD, m_tiles, n_tiles, GROUP_M)
    dl.wait_tma_stores()
    raise_flag(ctx, flags, per_rank, tm * n_tiles + tn, me, dst, e, WORLD)


@triton.jit
def matmul_rs_kernel(ctx, x_ptr, w_ptr, xs_ptr, ws_ptr, out_ptr, trace_ptr,
                     M_SHARD: tl.constexpr, N: tl.constexpr, K: tl.constexpr,
                     INBOX_OFF: tl.constexpr, PARITY_BYTES: tl.constexpr,
                     FLAGS_OFF: tl.constexpr, PARTIAL_INPUT: tl.constexpr,
                     WORLD: tl.constexpr, NUM_PROGRAMS: tl.constexpr, INTERLEAVE: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     GROUP_M: tl.constexpr, SUBTILE: tl.constexpr, TMA: tl.constexpr,
                     FLATTEN: tl.constexpr, DOT_PRECISION: tl.constexpr,
                     B_T: tl.constexpr, PUSH_TMA: tl.constexpr = False,
                     PUSH_SUBTILE: tl.constexpr = 1, TRACE_TILES: tl.constexpr = 0,
                     SCALING: tl.constexpr = None):
    """Grid: (NUM_PROGRAMS,), at most one program per SM on GPUs (own tiles spin).

    x: [WORLD * M_SHARD, K], w: [K, N] ([N, K] with B_T: ``_gemm.weight_desc``)
    -> out: [M_SHARD, N], this rank's rows of
    the sum over ranks of x @ w. With TMA (rows of x and w 16-byte multiples)
    the tiles run on the GEMM core; a row tile at the end of a rank's rows
    then reads the next rank's first rows too, whose products are dropped
    (masked pushes, clipped stores). Without, on the pointer GEMM
    (``_gemm.pointer_tile_acc``), for rows TMA cannot address.

    Two tile loops, peers' tiles (pushes) then own tiles (reductions), each with
    a straight-line epilogue. FLATTEN (TMA, WORLD 1 only) fuses the own tiles'
    loop with its K loop, so that the next tile's first loads go out under this
    tile's epilogue (matmul_rs 512 x 8192 x 2048 on 1 x H100: 1.13x jnp.dot,
    1.27x before). A flattened loop that pushes or adds partials ran 2.7x
    slower on 2 x H100 (8192 x 4096 x 12288: 2093 us against 777), so the op
    never asks for one there.

    FP8 (SCALING, ``_gemm``'s schemes): x's scales at ``xs_ptr`` ([WORLD * M_SHARD]
    per row, or [WORLD * M_SHARD, K / 128]), w's at ``ws_ptr``, w K-major (B_T);
    every partial leaves the mainloop scaled, in float32 (the ops push float32
    partials for FP8). Without SCALING both are ignored.

    PUSH_TMA (TMA only): a peer tile goes out as TMA stores into the owner's
    inbox (``store_tile`` on a descriptor of the peer's slot): the TMA unit
    moves it while the program goes on to the next tile, where SM stores hold
    the program until the link takes them (8192 x 4096 x 12288 on 4 x H100:
    377 us against 414 with SM stores, a 266 us GEMM; per-tile stamps put what
    is left of the exchange in the own tiles' epilogue, 17 us against 1.6 at
    world 1: docs/perf/rs_trace_*). Its
    flag is raised one tile later, when the stores have long landed
    (``_publish``), so no release waits on the link.
    PUSH_SUBTILE: the pieces of that store (1 where shared memory holds the
    whole tile: Triton waits for a piece's buffer to be read out, at the
    link's pace, before the next piece reuses it, and the last piece's wait
    falls under the next tile's mainloop).
    TRACE_TILES (a probe's view, 0: off): for each program's first TRACE_TILES
    tiles (peers' then own), the clock when the tile starts, when its mainloop
    is done and when its epilogue is (trace [NUM_PROGRAMS, TRACE_TILES, 3]
    int32, ``_trace.stamp``).
    """
    pid = tl.program_id(0)
    me = dl.rank(ctx)
    e = dl.epoch(ctx)
    m_tiles = tl.cdiv(M_SHARD, BLOCK_M)
    n_tiles = tl.cdiv(N, BLOCK_N)
    per_rank = m_tiles * n_tiles
    inbox, flags = partials_inbox(ctx, x_ptr, INBOX_OFF, PARITY_BYTES, FLAGS_OFF, PARTIAL_INPUT)
    slot_elems = M_SHARD * N
    if TMA:
        x_desc = tl.make_tensor_descriptor(x_ptr, shape=[WORLD * M_SHARD, K], strides=[K, 1],
                                           block_shape=[BLOCK_M, BLOCK_K])
        w_desc = weight_desc(w_ptr, K, N, BLOCK_K, BLOCK_N, B_T)
        c_desc = out_desc(out_ptr, M_SHARD, N, BLOCK_M, BLOCK_N, SUBTILE)
    else:
        c_desc = None  # pointer stores
    # Peers' tiles, me+1's rows first. Under the interpreter (programs run one
    # after another) program 0 pushes them all, before any program waits.
    peer_tiles = (WORLD - 1) * per_rank
    if WORLD > 1:
        if INTERLEAVE:
            first, last, step = pid, peer_tiles, NUM_PROGRAMS
        else:
            first, last, step = 0, tl.where(pid == 0, peer_tiles, 0), 1
        pending = first - step  # PUSH_TMA: the tile whose flag is not raised yet
        for tile in tl.range(first, last, step):
            at = trace_ptr + (pid * TRACE_TILES + (tile - first) // step) * 3
            traced = (tile - first) // step < TRACE_TILES
            stamp(at, TRACE_TILES > 0, traced)
            dst, tm, tn = rank_major_tile(tile, me + 1, WORLD, m_tiles, n_tiles, GROUP_M)
            if TMA:
                acc = tile_acc(x_desc, w_desc, dst * M_SHARD + tm * BLOCK_M, tn * BLOCK_N, 0,
                               K, BLOCK_M, BLOCK_N, BLOCK_K, DOT_PRECISION, B_T=B_T,
                               SCALING=SCALING, a_scale=xs_ptr, b_scale=ws_ptr,
                               s_rows=dst * M_SHARD + tm * BLOCK_M + tl.arange(0, BLOCK_M),
                               s_mask=tm * BLOCK_M + tl.arange(0, BLOCK_M) < M_SHARD, N_COLS=N,
                               K_BLOCKS=(K + 127) // 128)
            else:
                acc = _pointer_tile(x_ptr + tl.cast(dst, tl.int64) * (M_SHARD * K), w_ptr, tm, tn,
                                    M_SHARD, N, K, BLOCK_M, BLOCK_N, BLOCK_K, DOT_PRECISION,
                                    B_T, SCALING, xs_ptr, ws_ptr, dst)
            stamp(at + 1, TRACE_TILES > 0, traced)
            if PUSH_TMA:
                tl.static_assert(TMA, "PUSH_TMA: the GEMM core's tiles only")
                if pending >= first:
                    _publish(ctx, pending, flags, me, e, per_rank, m_tiles, n_tiles, GROUP_M,
                             WORLD)
                # Made after the wait above: no store in flight still reads it.
                slot = slot_of(me, dst, WORLD)
                peer_desc = out_desc(dl.symm_at(ctx, inbox + slot * slot_elems, dst), M_SHARD,
                                     N, BLOCK_M, BLOCK_N, PUSH_SUBTILE)
                store_tile(peer_desc, acc, 0, tm * BLOCK_M, tn * BLOCK_N, BLOCK_M, BLOCK_N,
                           PUSH_SUBTILE)
                pending = tile
            else:
                exchange_tile(ctx, acc, tm * BLOCK_M + tl.arange(0, BLOCK_M), M_SHARD,
                              tm * BLOCK_M, tn * BLOCK_N, False, inbox, flags, per_rank,
                              tm * n_tiles + tn, me, e, dst, slot_elems, c_desc, out_ptr, N,
                              BLOCK_M, BLOCK_N, SUBTILE, WORLD, TMA)
            stamp(at + 2, TRACE_TILES > 0, traced)
        done = tl.maximum(last - first + step - 1, 0) // step  # peer tiles computed here
        if PUSH_TMA:
            if pending >= first:
                _publish(ctx, pending, flags, me, e, per_rank, m_tiles, n_tiles, GROUP_M, WORLD)
    else:
        done = 0
    # Own tiles, last: the round-robin goes on where the peers' tiles left it.
    if INTERLEAVE:
        first, last, step = (pid + NUM_PROGRAMS - peer_tiles % NUM_PROGRAMS) % NUM_PROGRAMS, \
            per_rank, NUM_PROGRAMS
    else:
        per_program = tl.cdiv(per_rank, NUM_PROGRAMS)
        first, last, step = pid * per_program, tl.minimum((pid + 1) * per_program, per_rank), 1
    for tile in tl.range(first, last, step, flatten=FLATTEN and WORLD == 1):
        at = trace_ptr + (pid * TRACE_TILES + done + (tile - first) // step) * 3
        traced = done + (tile - first) // step < TRACE_TILES
        stamp(at, TRACE_TILES > 0, traced)
        tm, tn = grouped_tile(tile, m_tiles, n_tiles, GROUP_M)
        if TMA:
            acc = tile_acc(x_desc, w_desc, me * M_SHARD + tm * BLOCK_M, tn * BLOCK_N, 0, K,
                           BLOCK_M, BLOCK_N, BLOCK_K, DOT_PRECISION, B_T=B_T, SCALING=SCALING,
                           a_scale=xs_ptr, b_scale=ws_ptr,
                           s_rows=me * M_SHARD + tm * BLOCK_M + tl.arange(0, BLOCK_M),
                           s_mask=tm * BLOCK_M + tl.arange(0, BLOCK_M) < M_SHARD, N_COLS=N,
                           K_BLOCKS=(K + 127) // 128)
        else:
            acc = _pointer_tile(x_ptr + tl.cast(me, tl.int64) * (M_SHARD * K), w_ptr, tm, tn,
                                M_SHARD, N, K, BLOCK_M, BLOCK_N, BLOCK_K, DOT_PRECISION,
                                B_T, SCALING, xs_ptr, ws_ptr, me)
        stamp(at + 1, TRACE_TILES > 0, traced)
        if WORLD == 1 and TMA:
            store_tile(c_desc, acc, 0, tm * BLOCK_M, tn * BLOCK_N, BLOCK_M, BLOCK_N, SUBTILE)
        else:
            exchange_tile(ctx, acc, tm * BLOCK_M + tl.arange(0, BLOCK_M), M_SHARD, tm * BLOCK_M,
                          tn * BLOCK_N, True, inbox, flags, per_rank, tm * n_tiles + tn, me, e,
                          me, slot_elems, c_desc, out_ptr, N, BLOCK_M, BLOCK_N, SUBTILE, WORLD,
                          TMA)
        stamp(at + 2, TRACE_TILES > 0, traced)


@triton.jit
def _pointer_tile(a_ptr, w_ptr, tm, tn, M_SHARD: tl.constexpr, N: tl.constexpr,
                  K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr, B_T: tl.constexpr,
                  SCALING: tl.constexpr, xs_ptr, ws_ptr, rank):
    """The pointer GEMM's tile (tm, tn) of rank ``rank``'s rows starting at ``a_ptr``."""
    rows = tm * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = block_range(tn, BLOCK_N)
    return pointer_tile_acc(a_ptr + rows * K, w_ptr, rows < M_SHARD, cols, cols < N, 0, K, K, N,
                            BLOCK_M, BLOCK_N, BLOCK_K, DOT_PRECISION, B_T, SCALING, xs_ptr,
                            ws_ptr, rank * M_SHARD + rows)
