"""matmul_rs: (x @ w) summed over the ranks and scattered along M, the reduction
overlapped with the GEMM tile by tile.

Every rank holds x [M, K] (its K shard) and w [K, N]; rank r owns output rows
[r * M_SHARD, (r + 1) * M_SHARD). One persistent launch computes every output
tile of this rank's partial product on the GEMM core (``_gemm``: TMA loads,
the pipelined mainloop, a subtiled TMA store of the output), in the order of
``rank_major_tile(tile, me + 1, ...)``: the rows owned by rank me+1 first,
then me+2, ..., and this rank's own rows last.

- A peer's tile is pushed as soon as it is computed: its partial (float32, or
  the input dtype with PARTIAL_INPUT) is stored through ``dl.symm_at``
  pointers into the owner's heap inbox, in the slot of this source rank,
  then the tile's flag in the owner's heap is set to the epoch (``dl.notify``:
  a release at system scope).
- An own tile is computed last, and its partial stays in registers: the
  program waits (acquire) for the tile's flag of each of the other W - 1
  ranks, adds their partials in float32 and stores the output tile.

Why one kernel and not a GEMM kernel then a reduction kernel: the own tiles
are the reduction. Since they come last in every program's list, the
partials of the own rows pushed by peers early in their lists (rank me-1
pushes to me first) have arrived by then, and the reduction of each output
tile costs W - 1 reads of local heap memory in the epilogue of a GEMM tile
that was computed anyway; a second kernel would write this rank's partial
to memory and read it back, and could not start before the last GEMM tile.
The price is the tail: the partial from rank me+1 (its last peer step) can
arrive just before this rank's own tiles need it.

Inbox layout (``ops/matmul_rs.RsWorkspace``): per call parity (``e % 2``),
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
from jaxtdist.kernels._gemm import out_desc, store_tile, tile_acc, weight_desc
from jaxtdist.kernels._tiles import block_range, dot_tile, grouped_tile, rank_major_tile


@triton.jit
def _tile_offsets(tm, tn, M_SHARD: tl.constexpr, N: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr):
    """Element offsets of tile (tm, tn) in a row-major [M_SHARD, N] array, and the
    mask of its elements inside it."""
    rows = tm * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = block_range(tn, BLOCK_N)
    return rows[:, None] * N + cols[None, :], (rows < M_SHARD)[:, None] & (cols < N)[None, :]


@triton.jit
def _push_partial(ctx, acc, inbox, flags, me, dst, world, e, slot_elems, per_rank, tm, tn,
                  M_SHARD: tl.constexpr, N: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, n_tiles):
    """Stores a peer's tile partial into ``dst``'s inbox slot of this source and
    raises the tile's flag there (release at system scope)."""
    offs, mask = _tile_offsets(tm, tn, M_SHARD, N, BLOCK_M, BLOCK_N)
    slot = (me - dst + world - 1) % world
    remote = dl.symm_at(ctx, inbox + slot * slot_elems + offs, dst)
    tl.store(remote, acc.to(inbox.dtype.element_ty), mask=mask)
    dl.notify(ctx, flags + slot * per_rank + tm * n_tiles + tn, dst, e)


@triton.jit
def _add_partials(ctx, acc, inbox, flags, me, e, slot_elems, per_rank, tm, tn,
                  M_SHARD: tl.constexpr, N: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, n_tiles, WORLD: tl.constexpr):
    """``acc`` plus the other ranks' partials of this own tile, each after its flag.

    Sources in the order they push to this rank: me-1 first (its first peer
    step), me+1 last (slot W-2 down to 0). Unrolled over WORLD - 1 sources
    (none at world 1), so that no loop sits in the epilogue of a flattened
    tile loop.
    """
    offs, mask = _tile_offsets(tm, tn, M_SHARD, N, BLOCK_M, BLOCK_N)
    for step_back in tl.static_range(1, WORLD):
        slot = WORLD - 1 - step_back
        src = (me + WORLD - step_back) % WORLD
        token = dl.wait(ctx, flags + slot * per_rank + tm * n_tiles + tn, e, "ge", src)
        part = tl.load(dl.consume_token(inbox + slot * slot_elems + offs, token), mask=mask,
                       other=0.0)
        acc += part.to(tl.float32)
    return acc


@triton.jit
def matmul_rs_kernel(ctx, x_ptr, w_ptr, out_ptr,
                     M_SHARD: tl.constexpr, N: tl.constexpr, K: tl.constexpr,
                     INBOX_OFF: tl.constexpr, PARITY_BYTES: tl.constexpr,
                     FLAGS_OFF: tl.constexpr, PARTIAL_INPUT: tl.constexpr,
                     WORLD: tl.constexpr, NUM_PROGRAMS: tl.constexpr, INTERLEAVE: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     GROUP_M: tl.constexpr, SUBTILE: tl.constexpr, TMA: tl.constexpr,
                     FLATTEN: tl.constexpr, DOT_PRECISION: tl.constexpr,
                     B_T: tl.constexpr):
    """Grid: (NUM_PROGRAMS,), at most one program per SM on GPUs (own tiles spin).

    x: [WORLD * M_SHARD, K], w: [K, N] ([N, K] with B_T, TMA only: ``_gemm.weight_desc``)
    -> out: [M_SHARD, N], this rank's rows of
    the sum over ranks of x @ w. With TMA (rows of x and w 16-byte multiples)
    the tiles run on the GEMM core; a row tile at the end of a rank's rows
    then reads the next rank's first rows too, whose products are dropped
    (masked pushes, clipped stores). Without, on the pointer GEMM
    (``dot_tile``), for rows TMA cannot address.

    Two tile loops, peers' tiles (pushes) then own tiles (reductions), each with
    a straight-line epilogue. FLATTEN (TMA, WORLD 1 only) fuses the own tiles'
    loop with its K loop, so that the next tile's first loads go out under this
    tile's epilogue (matmul_rs 512 x 8192 x 2048 on 1 x H100: 1.13x jnp.dot,
    1.27x before). A flattened loop that pushes or adds partials ran 2.7x
    slower on 2 x H100 (8192 x 4096 x 12288: 2093 us against 777), so the op
    never asks for one there.
    """
    pid = tl.program_id(0)
    me = dl.rank(ctx)
    e = dl.epoch(ctx)
    m_tiles = tl.cdiv(M_SHARD, BLOCK_M)
    n_tiles = tl.cdiv(N, BLOCK_N)
    per_rank = m_tiles * n_tiles
    if PARTIAL_INPUT:
        partial_ty = x_ptr.dtype.element_ty
    else:
        partial_ty = tl.float32
    inbox = dl.parity_ptr(ctx, INBOX_OFF, PARITY_BYTES, partial_ty)
    flags = dl.heap_ptr(ctx, FLAGS_OFF, tl.int32)
    slot_elems = M_SHARD * N
    if TMA:
        x_desc = tl.make_tensor_descriptor(x_ptr, shape=[WORLD * M_SHARD, K], strides=[K, 1],
                                           block_shape=[BLOCK_M, BLOCK_K])
        w_desc = weight_desc(w_ptr, K, N, BLOCK_K, BLOCK_N, B_T)
        c_desc = out_desc(out_ptr, M_SHARD, N, BLOCK_M, BLOCK_N, SUBTILE)
    else:
        tl.static_assert(not B_T, "B_T: TMA loads only")
    # Peers' tiles, me+1's rows first. Under the interpreter (programs run one
    # after another) program 0 pushes them all, before any program waits.
    peer_tiles = (WORLD - 1) * per_rank
    if WORLD > 1:
        if INTERLEAVE:
            first, last, step = pid, peer_tiles, NUM_PROGRAMS
        else:
            first, last, step = 0, tl.where(pid == 0, peer_tiles, 0), 1
        for tile in tl.range(first, last, step):
            dst, tm, tn = rank_major_tile(tile, me + 1, WORLD, m_tiles, n_tiles, GROUP_M)
            if TMA:
                acc = tile_acc(x_desc, w_desc, dst * M_SHARD + tm * BLOCK_M, tn * BLOCK_N, 0,
                               K, BLOCK_M, BLOCK_N, BLOCK_K, DOT_PRECISION, B_T=B_T)
            else:
                acc = _pointer_tile(x_ptr + tl.cast(dst, tl.int64) * (M_SHARD * K), w_ptr, tm, tn,
                                    M_SHARD, N, K, BLOCK_M, BLOCK_N, BLOCK_K, DOT_PRECISION)
            _push_partial(ctx, acc, inbox, flags, me, dst, WORLD, e, slot_elems, per_rank, tm,
                          tn, M_SHARD, N, BLOCK_M, BLOCK_N, n_tiles)
    # Own tiles, last: the round-robin goes on where the peers' tiles left it.
    if INTERLEAVE:
        first, last, step = (pid + NUM_PROGRAMS - peer_tiles % NUM_PROGRAMS) % NUM_PROGRAMS, \
            per_rank, NUM_PROGRAMS
    else:
        per_program = tl.cdiv(per_rank, NUM_PROGRAMS)
        first, last, step = pid * per_program, tl.minimum((pid + 1) * per_program, per_rank), 1
    for tile in tl.range(first, last, step, flatten=FLATTEN and WORLD == 1):
        tm, tn = grouped_tile(tile, m_tiles, n_tiles, GROUP_M)
        if TMA:
            acc = tile_acc(x_desc, w_desc, me * M_SHARD + tm * BLOCK_M, tn * BLOCK_N, 0, K,
                           BLOCK_M, BLOCK_N, BLOCK_K, DOT_PRECISION, B_T=B_T)
        else:
            acc = _pointer_tile(x_ptr + tl.cast(me, tl.int64) * (M_SHARD * K), w_ptr, tm, tn,
                                M_SHARD, N, K, BLOCK_M, BLOCK_N, BLOCK_K, DOT_PRECISION)
        acc = _add_partials(ctx, acc, inbox, flags, me, e, slot_elems, per_rank, tm, tn,
                            M_SHARD, N, BLOCK_M, BLOCK_N, n_tiles, WORLD)
        if TMA:
            store_tile(c_desc, acc, 0, tm * BLOCK_M, tn * BLOCK_N, BLOCK_M, BLOCK_N, SUBTILE)
        else:
            offs, mask = _tile_offsets(tm, tn, M_SHARD, N, BLOCK_M, BLOCK_N)
            tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _pointer_tile(a_ptr, w_ptr, tm, tn, M_SHARD: tl.constexpr, N: tl.constexpr,
                  K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """The pointer GEMM's tile (tm, tn) of a rank's rows starting at ``a_ptr``."""
    rows = tm * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = block_range(tn, BLOCK_N)
    return dot_tile(a_ptr, w_ptr, rows, rows < M_SHARD, cols, cols < N, 0, K, K, N, BLOCK_M,
                    BLOCK_N, BLOCK_K, DOT_PRECISION)
