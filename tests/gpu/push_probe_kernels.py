"""All-to-all row pushes through SM stores, for ``probe_defaults.py push``: how
fast the programs of one GPU can store rows into every peer's heap, by
programs, warps, step size and store order (the MoE kernels' traces put most
of their time in such pushes and their drain).

No JAX here: on CPU, interpreter worker processes import this module by name.
"""

import triton
import triton.language as tl

import jaxtdist.language as dl


def push_workspace_bytes(world: int, programs: int, rows: int, cols: int, itemsize: int) -> int:
    """Heap bytes ``push_rows_kernel`` needs: flags, then two parities of inbox."""
    return flag_bytes(world, programs) + 2 * world * rows * cols * itemsize


def flag_bytes(world: int, programs: int) -> int:
    """The flags' bytes, rounded up to 256 (the inbox's alignment)."""
    return -(-4 * world * programs // 256) * 256


@triton.jit
def push_rows_kernel(ctx, x_ptr, out_ptr, ROWS: tl.constexpr, COLS: tl.constexpr,
                     W: tl.constexpr, P: tl.constexpr, BLOCK: tl.constexpr,
                     PEER_MAJOR: tl.constexpr, CHECK: tl.constexpr, ITEMSIZE: tl.constexpr,
                     FLAG_BYTES: tl.constexpr, WORKSPACE: tl.constexpr,
                     TMA_ROWS: tl.constexpr = 0):
    """Grid (P,). x [ROWS, COLS] this rank's rows (COLS a multiple of BLOCK).

    Program p pushes rows p, p + P, ... of x into row ``me * ROWS + r`` of every
    peer's inbox (parity ``e % 2``; peers me + 1, me + 2, ...), BLOCK columns a
    store; PEER_MAJOR: all its rows to one peer, then the next, else each row
    to every peer in turn. Then flag (me, p) at every peer, one release after
    all the stores, and a wait for flag (src, p) of every peer. TMA_ROWS > 0
    (dividing ROWS): tiles of [TMA_ROWS, BLOCK] go through tensor descriptors
    instead (a TMA load of x, a TMA store into each peer's inbox, peer-major;
    program p takes row groups p, p + P, ... of TMA_ROWS rows, every column
    tile of them), and the stores are waited for (``dl.wait_tma_stores``)
    before the flags. CHECK: out
    [W * ROWS, COLS] receives the inbox (every source's rows); else out [P]
    int32 the rows this program pushed.

    Reuse: as the MoE kernels (every rank waits for every peer's flags of each
    call, raised after that peer's previous call ended).
    """
    pid = tl.program_id(0)
    me = dl.rank(ctx)
    e = dl.epoch(ctx)
    flags = dl.heap_ptr(ctx, WORKSPACE, tl.int32)
    inbox = dl.parity_ptr(ctx, WORKSPACE + FLAG_BYTES, W * ROWS * COLS * ITEMSIZE,
                          x_ptr.dtype.element_ty)
    cols = tl.arange(0, BLOCK)
    if TMA_ROWS > 0:
        x_desc = tl.make_tensor_descriptor(x_ptr, shape=[ROWS, COLS], strides=[COLS, 1],
                                           block_shape=[TMA_ROWS, BLOCK])
        for step in range(1, W):
            o_desc = tl.make_tensor_descriptor(dl.symm_at(ctx, inbox, (me + step) % W),
                                               shape=[W * ROWS, COLS], strides=[COLS, 1],
                                               block_shape=[TMA_ROWS, BLOCK])
            for g in range(pid, ROWS // TMA_ROWS, P):
                for c0 in range(0, COLS, BLOCK):
                    o_desc.store([me * ROWS + g * TMA_ROWS, c0],
                                 x_desc.load([g * TMA_ROWS, c0]))
        dl.wait_tma_stores()
    elif PEER_MAJOR:
        for step in range(1, W):
            d = (me + step) % W
            for r in range(pid, ROWS, P):
                dst = inbox + tl.cast(me * ROWS + r, tl.int64) * COLS
                for c in range(0, COLS, BLOCK):
                    v = tl.load(x_ptr + tl.cast(r, tl.int64) * COLS + c + cols)
                    tl.store(dl.symm_at(ctx, dst + c + cols, d), v)
    else:
        for r in range(pid, ROWS, P):
            dst = inbox + tl.cast(me * ROWS + r, tl.int64) * COLS
            for c in range(0, COLS, BLOCK):
                v = tl.load(x_ptr + tl.cast(r, tl.int64) * COLS + c + cols)
                for step in range(1, W):
                    tl.store(dl.symm_at(ctx, dst + c + cols, (me + step) % W), v)
    for step in range(1, W):
        dl.notify(ctx, flags + me * P + pid, (me + step) % W, e)  # release: the rows first
    token = me * 0
    for step in range(1, W):
        src = (me + step) % W
        token = dl.wait(ctx, flags + src * P + pid, e, "ge", src)
    if CHECK:
        # Every source's rows this program pushed (this rank's own from x).
        rows_in = dl.consume_token(inbox, token)
        for src in range(0, W):
            for r in range(0, ROWS):
                mine = (r % P) == pid
                if TMA_ROWS > 0:
                    mine = ((r // TMA_ROWS) % P) == pid
                if mine:
                    row = tl.cast(src * ROWS + r, tl.int64) * COLS
                    for c in range(0, COLS, BLOCK):
                        if src == me:
                            v = tl.load(x_ptr + tl.cast(r, tl.int64) * COLS + c + cols)
                        else:
                            v = tl.load(rows_in + row + c + cols)
                        tl.store(out_ptr + row + c + cols, v)
    else:
        tl.store(out_ptr + pid, (ROWS - pid + P - 1) // P)
