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
the order me+1, me+2, ...; then the tile's flag in that peer's heap is set
to the epoch, a release), then waits (acquire) for the same tile from each
peer and adds the partials in float32 in rank order (0, 1, ..., W - 1, its
own in its place: the same additions, so the same bits, on every rank) and
stores the output tile. One pass over w, one crossing of the links per
partial, and no second launch: the latency is the GEMM of one tile-wave
plus one push and one flag. Split K lets wide N tiles (long loads of w)
still fill the SMs at decode sizes.

Inbox layout (``ops/matmul_ar.ArWorkspace``): per call parity (``e % 2``),
W - 1 slots of [M, N] float32, slot ``(src - dst + W - 1) % W`` of rank
``dst`` holding the partial of rank ``src``; then one int32 flag per (slot,
tile).

Reuse: rank s writes a slot of parity p in rank o's inbox at epochs e and
e + 2. s's kernel e + 2 starts after its kernel e + 1 ended, which waited
for o's pushes of epoch e + 1; o pushes those in its kernel e + 1, after
its kernel e (the last reader of parity p) ended. So parity alone keeps
call e + 2's writes off the data call e still reads; flags compare ">=".
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
of programs, one at a time included (the interpreter).
"""

import triton
import triton.language as tl

import jaxtdist.language as dl
from jaxtdist.kernels._gemm import tile_acc
from jaxtdist.kernels._splitk import k_range, split_k_total
from jaxtdist.kernels._tiles import block_range, dot_tile, grouped_tile


@triton.jit
def matmul_ar_kernel(ctx, x_ptr, w_ptr, out_ptr,
                     M: tl.constexpr, N: tl.constexpr, K: tl.constexpr,
                     INBOX_OFF: tl.constexpr, PARITY_BYTES: tl.constexpr,
                     FLAGS_OFF: tl.constexpr, PARTIALS_OFF: tl.constexpr,
                     COUNTERS_OFF: tl.constexpr, SPLIT_K: tl.constexpr, K_SPLIT: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     GROUP_M: tl.constexpr, TMA: tl.constexpr):
    """Grid: (SPLIT_K * cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N),).

    x: [M, K], w: [K, N] -> out: [M, N], the sum over ranks of x @ w. TMA: rows
    of x and w are 16-byte multiples (the GEMM core's loads). Split ``s`` covers K
    [s * K_SPLIT, (s + 1) * K_SPLIT) (K_SPLIT a multiple of BLOCK_K); with SPLIT_K
    > 1, PARTIALS_OFF holds SPLIT_K float32 planes of [M, N] and COUNTERS_OFF one
    int32 counter per tile (``SplitKWorkspace``).
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
        w_desc = tl.make_tensor_descriptor(w_ptr, shape=[K, N], strides=[N, 1],
                                           block_shape=[BLOCK_K, BLOCK_N])
        acc = tile_acc(x_desc, w_desc, tm * BLOCK_M, tn * BLOCK_N, k_lo, k_hi, BLOCK_M,
                       BLOCK_N, BLOCK_K)
    else:
        acc = dot_tile(x_ptr, w_ptr, rows, row_mask, cols, col_mask, k_lo, k_hi, K, N,
                       BLOCK_M, BLOCK_N, BLOCK_K)
    offs = rows[:, None] * N + cols[None, :]
    mask = row_mask[:, None] & col_mask[None, :]
    if SPLIT_K == 1:
        _all_reduce_tile(ctx, acc, out_ptr, offs, mask, tile, m_tiles * n_tiles, M, N,
                         INBOX_OFF, PARITY_BYTES, FLAGS_OFF)
    else:
        last, total = split_k_total(acc, split, dl.heap_ptr(ctx, PARTIALS_OFF, tl.float32),
                                    offs, mask, dl.heap_ptr(ctx, COUNTERS_OFF, tl.int32) + tile,
                                    M * N, SPLIT_K)
        if last:
            _all_reduce_tile(ctx, total, out_ptr, offs, mask, tile, m_tiles * n_tiles, M, N,
                             INBOX_OFF, PARITY_BYTES, FLAGS_OFF)


@triton.jit
def _all_reduce_tile(ctx, acc, out_ptr, offs, mask, tile, tiles, M: tl.constexpr,
                     N: tl.constexpr, INBOX_OFF: tl.constexpr, PARITY_BYTES: tl.constexpr,
                     FLAGS_OFF: tl.constexpr):
    """Pushes this rank's partial ``acc`` of tile ``tile`` to every peer, waits for
    theirs and stores the sum over the ranks at ``out_ptr + offs``."""
    me = dl.rank(ctx)
    world = dl.num_ranks(ctx)
    e = dl.epoch(ctx)
    inbox = dl.parity_ptr(ctx, INBOX_OFF, PARITY_BYTES, tl.float32)
    flags = dl.heap_ptr(ctx, FLAGS_OFF, tl.int32)
    slot_elems = M * N
    for step in range(1, world):
        dst = (me + step) % world
        slot = world - 1 - step  # (me - dst + world - 1) % world
        tl.store(dl.symm_at(ctx, inbox + slot * slot_elems + offs, dst), acc, mask=mask)
    # Flags after every peer's stores: the first release drains them all.
    for step in range(1, world):
        dl.notify(ctx, flags + (world - 1 - step) * tiles + tile, (me + step) % world, e)
    # The partials are summed in rank order 0, 1, ..., W - 1 on every rank (this
    # rank's own in its place), so that every rank rounds the same additions and
    # holds the same bits; an order starting from the own partial differs per
    # rank in float32 from W = 3 on.
    total = tl.zeros_like(acc)
    for src in range(0, world):
        if src == me:
            total += acc
        else:
            # Rank src pushes to this rank into slot (src - me + world - 1) % world.
            slot = (src - me + world - 1) % world
            token = dl.wait(ctx, flags + slot * tiles + tile, e, "ge", src)
            total += tl.load(dl.consume_token(inbox + slot * slot_elems + offs, token),
                             mask=mask, other=0.0)
    tl.store(out_ptr + offs, total.to(out_ptr.dtype.element_ty), mask=mask)
