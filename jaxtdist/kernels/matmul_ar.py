"""matmul_ar: (x @ w) summed over the ranks, every rank gets the whole sum; for
small M (decode), where latency rules.

One launch, one program per output tile ((m, n) in ``grouped_tile`` order)
and K split (SPLIT_K consecutive programs share a tile): the program computes
its tile of this rank's partial product over its K range (on the GEMM core's
mainloop, ``_gemm.tile_acc``, where TMA can address the rows; else on the
pointer GEMM). With SPLIT_K > 1 it stores the float32 partial into its plane
of a local heap workspace and counts itself in (``_splitk.split_k_total``);
all but the last of the tile's programs end there, and the last sums the
planes in split order (the same bits whichever arrives last) and goes on as
the one program of SPLIT_K = 1 does: it pushes the float32 partial into
every peer's heap inbox (stores through ``dl.symm_at`` pointers, peers in
the order me+1, me+2, ...; then, behind one fence, the tile's flag in each
peer's heap is set to the epoch), then waits (acquire) for the same tile from each
peer and adds the partials in float32 in rank order (0, 1, ..., W - 1, its
own in its place: the same additions, so the same bits, on every rank) and
stores the output tile. One pass over w, one crossing of the links per
partial, and no second launch: the latency is the GEMM of one tile-wave
plus one push and one flag. Split K lets wide N tiles (long loads of w)
still fill the SMs at decode sizes.

Two shot (``TWO_SHOT``, for large tiles, where bytes rule): tile t has an
owner, rank ``t % W``. The others push their partial to the owner only and
wait; the owner sums the W partials in rank order, stores the tile and pushes
the rounded sum into every peer's results box, which they copy out. Per rank
(W - 1) / W of the partials and of the output cross the links, against
(W - 1) whole partials in one shot. Partials go in float32 or, with
``PARTIAL_INPUT``, in x's dtype (half the bytes, one more rounding).

Inbox layout (``ops/_partial_sums.PartialsWorkspace``): one int32 flag per
(slot, tile), then (two shot) one int32 result flag per tile; per call
parity (``e % 2``), W - 1 slots of [M, N] partials, slot ``(src - dst + W -
1) % W`` of rank ``dst`` holding the partial of rank ``src``, then (two shot)
the [M, N] results box in the output's dtype.

Reuse: rank s writes a slot of parity p in rank o's inbox at epochs e and
e + 2. s's kernel e + 2 starts after its kernel e + 1 ended, which waited
for o's pushes of epoch e + 1; o pushes those in its kernel e + 1, after
its kernel e (the last reader of parity p) ended. So parity alone keeps
call e + 2's writes off the data call e still reads; flags compare ">=".
Two shot: a non-owner's kernel e + 1 waited for the owner's sum of e + 1,
pushed after the owner's kernel e read the partials; the owner pushes its sum
of e + 2 after its kernel e + 1 waited for the peer's partial of e + 1, pushed
after the peer's kernel e copied the sum out.
The split workspace is local and rewritten whole by every call, its
counters only grow (``_splitk``); a call's last arrivals read it before the
kernel ends, and the next call's kernel starts after that.

Deadlock: a program pushes before it waits, and waits only on the program
of the same tile on other ranks, which pushes before it waits too. With
SPLIT_K > 1, the programs that do not arrive last never wait; a last
arrival waits only on peers' last arrivals of the same tile, which push
before they wait, and a tile's programs are consecutive, so dispatched
before any later tile's (in-order dispatch: none of them waits for an SM
behind a later tile's waiting program). So the grid completes in any order
of programs, one at a time included (the interpreter). Two shot: a
non-owner pushes before it waits for the owner's sum, and the owner waits
only on those pushes before it sends the sum: the same holds.
"""

import triton
import triton.language as tl

import jaxtdist.language as dl
from jaxtdist.kernels._gemm import pointer_tile_acc, tile_acc, weight_desc
from jaxtdist.kernels._partials import partials_inbox, slot_of
from jaxtdist.kernels._splitk import k_range, split_k_total
from jaxtdist.kernels._tiles import aligned_after, block_offsets, block_range, grouped_tile


@triton.jit
def matmul_ar_kernel(ctx, x_ptr, w_ptr, xs_ptr, ws_ptr, out_ptr,
                     M: tl.constexpr, N: tl.constexpr, K: tl.constexpr,
                     INBOX_OFF: tl.constexpr, PARITY_BYTES: tl.constexpr,
                     FLAGS_OFF: tl.constexpr, PARTIALS_OFF: tl.constexpr,
                     COUNTERS_OFF: tl.constexpr, SPLIT_K: tl.constexpr, K_SPLIT: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     GROUP_M: tl.constexpr, TMA: tl.constexpr, TWO_SHOT: tl.constexpr,
                     RESULTS_OFF: tl.constexpr, RFLAGS_OFF: tl.constexpr,
                     OWN_OFF: tl.constexpr, PARK: tl.constexpr,
                     PARTIAL_INPUT: tl.constexpr, DOT_PRECISION: tl.constexpr,
                     B_T: tl.constexpr, SCALING: tl.constexpr = None):
    """Grid: (SPLIT_K * cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N),).

    x: [M, K], w: [K, N] ([N, K] with B_T: ``_gemm.weight_desc``) -> out:
    [M, N], the sum over ranks of x @ w. TMA: rows
    of x and w are 16-byte multiples (the GEMM core's loads). Split ``s`` covers K
    [s * K_SPLIT, (s + 1) * K_SPLIT) (K_SPLIT a multiple of BLOCK_K); with SPLIT_K
    > 1, PARTIALS_OFF holds SPLIT_K float32 planes of [M, N] and COUNTERS_OFF one
    int32 counter per tile (``SplitKWorkspace``). TWO_SHOT: reduce each tile on its
    owner rank and broadcast the sum (``_two_shot_tile``), else one shot;
    PARTIAL_INPUT: partials cross the links in x's dtype, else in float32. PARK
    (large tiles): a program parks its own partial in OWN_OFF, a local [M, N]
    plane of partials (their dtype), and sums the ranks' a few rows at a time
    (``_park``); else it sums whole tiles in registers.
    FP8 (SCALING, ``_gemm``'s schemes): x's scales at ``xs_ptr`` ([M] per row, or
    [M, K / 128]), w's at ``ws_ptr``, w K-major (B_T); the partials leave the
    mainloop scaled, in float32. Without SCALING both are ignored.
    """
    pid = tl.program_id(0)
    tile = pid // SPLIT_K
    split = pid % SPLIT_K
    m_tiles = tl.cdiv(M, BLOCK_M)
    n_tiles = tl.cdiv(N, BLOCK_N)
    tm, tn = grouped_tile(tile, m_tiles, n_tiles, GROUP_M)
    rows = tm * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    cols = block_range(tn, BLOCK_N)
    col_mask = cols < N
    k_lo, k_hi = k_range(split, K, K_SPLIT)
    if TMA:
        x_desc = tl.make_tensor_descriptor(x_ptr, shape=[M, K], strides=[K, 1],
                                           block_shape=[BLOCK_M, BLOCK_K])
        w_desc = weight_desc(w_ptr, K, N, BLOCK_K, BLOCK_N, B_T)
        acc = tile_acc(x_desc, w_desc, tm * BLOCK_M, tn * BLOCK_N, k_lo, k_hi, BLOCK_M,
                       BLOCK_N, BLOCK_K, DOT_PRECISION, B_T=B_T, SCALING=SCALING,
                       a_scale=xs_ptr, b_scale=ws_ptr, s_rows=rows, s_mask=row_mask,
                       N_COLS=N, K_BLOCKS=(K + 127) // 128)
    else:
        acc = pointer_tile_acc(x_ptr + rows * K, w_ptr, row_mask, cols, col_mask, k_lo, k_hi,
                               K, N, BLOCK_M, BLOCK_N, BLOCK_K, DOT_PRECISION, B_T, SCALING,
                               xs_ptr, ws_ptr, rows)
    offs, mask = block_offsets(rows, cols, M, N)
    if SPLIT_K > 1:
        last, acc = split_k_total(acc, split, dl.heap_ptr(ctx, PARTIALS_OFF, tl.float32),
                                  offs, mask, dl.heap_ptr(ctx, COUNTERS_OFF, tl.int32) + tile,
                                  M * N, SPLIT_K)
    else:
        last = True
    if last:
        if dl.num_ranks(ctx) == 1:
            # Nothing to exchange: the sum of one partial is the partial (the same
            # bits as the exchange's float32 sum of it).
            tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            inbox, flags = partials_inbox(ctx, x_ptr, INBOX_OFF, PARITY_BYTES, FLAGS_OFF,
                                          PARTIAL_INPUT)
            own = dl.heap_ptr(ctx, OWN_OFF, inbox.dtype.element_ty)
            if TWO_SHOT:
                results = dl.parity_ptr(ctx, RESULTS_OFF, PARITY_BYTES,
                                        out_ptr.dtype.element_ty)
                _two_shot_tile(ctx, acc, out_ptr, offs, mask, tile, m_tiles * n_tiles, M * N,
                               inbox, flags, results, dl.heap_ptr(ctx, RFLAGS_OFF, tl.int32),
                               own, tm * BLOCK_M, cols, M, N, BLOCK_M, PARK)
            else:
                _one_shot_tile(ctx, acc, out_ptr, offs, mask, tile, m_tiles * n_tiles, M * N,
                               inbox, flags, own, tm * BLOCK_M, cols, M, N, BLOCK_M,
                               PARK)


@triton.jit
def _rows_step(row0, r0, cols, M: tl.constexpr, N: tl.constexpr,
               ROWS: tl.constexpr):
    """Offsets and mask of rows [row0 + r0, row0 + r0 + ROWS) of a tile's columns ``cols``."""
    return block_offsets(row0 + r0 + tl.arange(0, ROWS), cols, M, N)


@triton.jit
def _park(own, part, offs, mask):
    """Stores this program's partial into the own plane, readable by all its threads.

    With large tiles the epilogues then sum the ranks' partials from memory a
    few rows at a time, not on the whole tile in registers: the accumulator,
    the running sum, a peer's partial and the tile's offsets together took more
    than 255 registers per thread and spilled (even at world 1, where that code
    does not run). On one H100 the same mainloop ended by a plain store ran 4.0
    us against 4.7 at 256 x 4096 x 512, and 46 against 74 at 512 x 8192 x 4096.
    Small tiles sum in registers: 128 x 64 with 8 warps did not spill, and
    parking took its 128 x 8192 x 4096 call over 2 x H100 from 51.8 to 57.7 us."""
    tl.store(own + offs, part, mask=mask)
    tl.debug_barrier()


@triton.jit
def _sum_store(ctx, part, own, out_ptr, offs, mask, tile, tiles, slot_elems, inbox, flags,
               results, row0, cols, M: tl.constexpr, N: tl.constexpr,
               BLOCK_M: tl.constexpr, PARK: tl.constexpr, BROADCAST: tl.constexpr):
    """Sums tile ``tile``'s partials over the ranks in rank order (this rank's
    ``part`` in its place) and stores the sum at ``out_ptr + offs``; BROADCAST
    (two shot's owner) also into every peer's ``results``. PARK: a quarter of the
    tile at a time from 64 rows on, this rank's partial read back from ``own``."""
    if PARK:
        _park(own, part, offs, mask)
        ROWS: tl.constexpr = BLOCK_M // 4 if BLOCK_M >= 64 else BLOCK_M
        for r0 in range(0, BLOCK_M, ROWS):
            step_offs, step_mask = _rows_step(row0, r0, cols, M, N, ROWS)
            mine = tl.load(own + step_offs, mask=step_mask, other=0.0).to(tl.float32)
            _sum_store_rows(ctx, mine, out_ptr, step_offs, step_mask, tile, tiles, slot_elems,
                            inbox, flags, results, BROADCAST)
    else:
        _sum_store_rows(ctx, part.to(tl.float32), out_ptr, offs, mask, tile, tiles, slot_elems,
                        inbox, flags, results, BROADCAST)


@triton.jit
def _sum_store_rows(ctx, mine, out_ptr, offs, mask, tile, tiles, slot_elems, inbox, flags,
                    results, BROADCAST: tl.constexpr):
    # The partials are summed in rank order 0, 1, ..., W - 1 on every rank (this
    # rank's own in its place), so that every rank rounds the same additions and
    # holds the same bits; an order starting from the own partial differs per
    # rank in float32 from W = 3 on.
    me = dl.rank(ctx)
    world = dl.num_ranks(ctx)
    e = dl.epoch(ctx)
    total = tl.zeros(offs.shape, tl.float32)
    for src in range(0, world):
        if src == me:
            total += mine
        else:
            slot = slot_of(src, me, world)
            token = dl.wait(ctx, flags + slot * tiles + tile, e, "ge", src)
            # After the wait, alignment kept (16-byte loads; a token on the block of
            # pointers made them 2-byte loads).
            total += tl.load(aligned_after(inbox + slot * slot_elems, token) + offs,
                             mask=mask, other=0.0).to(tl.float32)
    y = total.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + offs, y, mask=mask)
    if BROADCAST:
        for step in range(1, world):
            tl.store(dl.symm_at(ctx, results + offs, (me + step) % world), y, mask=mask)


@triton.jit
def _one_shot_tile(ctx, acc, out_ptr, offs, mask, tile, tiles, slot_elems, inbox, flags, own,
                   row0, cols, M: tl.constexpr, N: tl.constexpr,
                   BLOCK_M: tl.constexpr, PARK: tl.constexpr):
    """Pushes this rank's partial ``acc`` of tile ``tile`` to every peer, waits for
    theirs and stores the sum over the ranks at ``out_ptr + offs``."""
    me = dl.rank(ctx)
    world = dl.num_ranks(ctx)
    e = dl.epoch(ctx)
    part = acc.to(inbox.dtype.element_ty)
    for step in range(1, world):
        dst = (me + step) % world
        slot = world - 1 - step  # (me - dst + world - 1) % world
        tl.store(dl.symm_at(ctx, inbox + slot * slot_elems + offs, dst), part, mask=mask)
    # Flags after every peer's stores, behind one fence (as dl.notify_peers: the
    # relaxed flags go out together, not one round trip apart).
    dl.fence(ctx)
    for step in range(1, world):
        dl.notify(ctx, flags + (world - 1 - step) * tiles + tile, (me + step) % world, e,
                  "set", "sys", "relaxed")
    _sum_store(ctx, part, own, out_ptr, offs, mask, tile, tiles, slot_elems, inbox, flags,
               None, row0, cols, M, N, BLOCK_M, PARK, False)


@triton.jit
def _two_shot_tile(ctx, acc, out_ptr, offs, mask, tile, tiles, slot_elems, inbox, flags,
                   results, rflags, own, row0, cols, M: tl.constexpr,
                   N: tl.constexpr, BLOCK_M: tl.constexpr, PARK: tl.constexpr):
    """Tile ``tile``'s owner (rank ``tile % world``) gathers every peer's partial,
    sums them in rank order and pushes the rounded sum into every peer's results
    box; the others push their partial to the owner and copy the owner's sum
    into ``out_ptr + offs``. Each rank sends (W - 1) / W of the partials and
    of the output once: against one shot's (W - 1) whole partials, the bytes
    of large tiles, at the price of a second link round trip."""
    me = dl.rank(ctx)
    world = dl.num_ranks(ctx)
    e = dl.epoch(ctx)
    owner = tile % world
    if owner != me:
        slot = slot_of(me, owner, world)
        tl.store(dl.symm_at(ctx, inbox + slot * slot_elems + offs, owner),
                 acc.to(inbox.dtype.element_ty), mask=mask)
        dl.notify(ctx, flags + slot * tiles + tile, owner, e)  # release: the partial
        token = dl.wait(ctx, rflags + tile, e, "ge", owner)
        y = tl.load(aligned_after(results, token) + offs, mask=mask)
        tl.store(out_ptr + offs, y, mask=mask)
    else:
        # Its own partial rounds like the peers' (the same error wherever a tile lands).
        _sum_store(ctx, acc.to(inbox.dtype.element_ty), own, out_ptr, offs, mask, tile, tiles,
                   slot_elems, inbox, flags, results, row0, cols, M, N, BLOCK_M,
                   PARK, True)
        dl.notify_peers(ctx, rflags + tile, e)  # the sum first
