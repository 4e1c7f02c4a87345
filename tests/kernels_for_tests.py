"""Triton kernels used by the tests through ``jaxtdist.triton_call``.

No JAX here: the CPU backend's interpreter workers import this module.
"""

import triton
import triton.language as tl

import jaxtdist.language as dl
from jaxtdist.language import shmem
from jaxtdist.kernels._tiles import grouped_tile


@triton.jit
def ring_kernel(ctx, x_ptr, out_ptr, N: tl.constexpr, BLOCK: tl.constexpr,
                WORKSPACE: tl.constexpr):
    """out on rank r = x of rank r - 1 (a ring shift by one).

    Workspace: int32 signal at WORKSPACE (data of epoch e arrived), int32 ack
    at WORKSPACE + 4 (the next rank has read the data of epoch e), then two
    float32 buffers of N elements at WORKSPACE + 256 (parity e % 2).
    """
    me = dl.rank(ctx)
    world = dl.num_ranks(ctx)
    e = dl.epoch(ctx)
    nxt = (me + 1) % world
    prv = (me + world - 1) % world
    signal = dl.heap_ptr(ctx, WORKSPACE, tl.int32)
    ack = dl.heap_ptr(ctx, WORKSPACE + 4, tl.int32)
    buf = dl.heap_ptr(ctx, WORKSPACE + 256 + (e % 2) * (N * 4), tl.float32)
    # The next rank must be done with the data of epoch e - 2 (same parity).
    dl.wait(ctx, ack, e - 2, "ge", nxt)
    # The first half through store_peer (tiles), the rest through put.
    half: tl.constexpr = N // 2
    for start in range(0, half, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < half
        dl.store_peer(ctx, buf + offs, tl.load(x_ptr + offs, mask=mask), nxt, mask=mask)
    dl.put(ctx, buf + half, x_ptr + half, N - half, nxt, BLOCK)
    dl.notify(ctx, signal, nxt, e)
    dl.wait(ctx, signal, e, "ge", prv)
    for start in range(0, N, BLOCK):
        o = start + tl.arange(0, BLOCK)
        m = o < N
        tl.store(out_ptr + o, tl.load(buf + o, mask=m), mask=m)
    dl.notify(ctx, ack, prv, e)


@triton.jit
def withheld_kernel(ctx, out_ptr, WORKSPACE: tl.constexpr):
    """Waits for a notify nobody sends; must time out."""
    e = dl.epoch(ctx)
    signal = dl.heap_ptr(ctx, WORKSPACE, tl.int32)
    seen = dl.wait(ctx, signal, e + 1000, "ge", (dl.rank(ctx) + 1) % dl.num_ranks(ctx))
    tl.store(out_ptr, seen)


@triton.jit
def withheld_tma_kernel(ctx, out_ptr, WORKSPACE: tl.constexpr):
    """``withheld_kernel`` with the loop-free TMA wait: must time out the same way."""
    e = dl.epoch(ctx)
    signal = dl.heap_ptr(ctx, WORKSPACE, tl.int32)
    token = dl.wait_for_tma(ctx, signal, e + 1000, (dl.rank(ctx) + 1) % dl.num_ranks(ctx))
    tl.store(out_ptr, tl.load(signal) + token)


@triton.jit
def withheld_tagged_kernel(ctx, out_ptr, WORKSPACE: tl.constexpr):
    """Waits for tagged words nobody sends (``dl.wait_tagged``); must time out the
    same way."""
    e = dl.epoch(ctx)
    words = dl.heap_ptr(ctx, WORKSPACE, tl.int64)
    offs = tl.arange(0, 16)
    got = dl.wait_tagged(ctx, words, offs, offs < 16, e + 1000,
                         (dl.rank(ctx) + 1) % dl.num_ranks(ctx))
    tl.store(out_ptr, tl.max(dl.unpack_tagged(got, tl.int32), 0))


@triton.jit
def staged_prev_kernel(ctx, out_ptr, N: tl.constexpr, BLOCK: tl.constexpr,
                       WORKSPACE: tl.constexpr, STAGE: tl.constexpr,
                       STAGE_BYTES: tl.constexpr):
    """out on rank r = the ``stage`` array of rank r - 1, read from its heap.

    ``barrier_all`` over the int32 words at WORKSPACE makes sure every rank
    has staged this epoch's copy (the prologue stages it before the kernel).
    """
    me = dl.rank(ctx)
    world = dl.num_ranks(ctx)
    e = dl.epoch(ctx)
    prv = (me + world - 1) % world
    dl.barrier_all(ctx, dl.heap_ptr(ctx, WORKSPACE, tl.int32))
    staged = dl.heap_ptr(ctx, STAGE + (e % 2) * STAGE_BYTES, tl.float32)
    for start in range(0, N, BLOCK):
        o = start + tl.arange(0, BLOCK)
        m = o < N
        tl.store(out_ptr + o, dl.load_peer(ctx, staged + o, prv, mask=m), mask=m)


@triton.jit
def scaled_rank_kernel(ctx, x_ptr, scale, out_ptr, N: tl.constexpr, BLOCK: tl.constexpr):
    """out = x * scale + rank: a kernel with a Python scalar argument."""
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, x * scale + dl.rank(ctx).to(tl.float32), mask=mask)


@triton.jit
def half_doubled_kernel(ctx, x_ptr, out_ptr, N: tl.constexpr, BLOCK: tl.constexpr):
    """out[:N // 2] = 2 * x[:N // 2] (through float32: Triton 3.6's interpreter adds
    bfloat16 values as their bit patterns); the rest of out is left unwritten."""
    offs = tl.arange(0, BLOCK)
    mask = offs < N // 2
    x = tl.load(x_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, (x.to(tl.float32) * 2).to(x.dtype), mask=mask)


@triton.jit
def ids_kernel(ctx, out_ptr):
    """out = [rank, num_ranks, epoch] (int32)."""
    tl.store(out_ptr + 0, dl.rank(ctx))
    tl.store(out_ptr + 1, dl.num_ranks(ctx))
    tl.store(out_ptr + 2, dl.epoch(ctx))


@triton.jit
def fenced_broadcast_kernel(ctx, x_ptr, out_ptr, N: tl.constexpr, BLOCK: tl.constexpr,
                            WORKSPACE: tl.constexpr):
    """Rank 0's x to every rank: plain peer stores, then ``notify_peers`` (a fence,
    then relaxed signals).

    Workspace: int32 signal at WORKSPACE, an int32 ack per rank at WORKSPACE + 64,
    float32 buffers (parity e % 2) at WORKSPACE + 256. Every rank acks (to rank 0)
    after reading, and rank 0 waits for all acks of epoch e - 1 before writing.
    """
    me = dl.rank(ctx)
    world = dl.num_ranks(ctx)
    e = dl.epoch(ctx)
    signal = dl.heap_ptr(ctx, WORKSPACE, tl.int32)
    acks = dl.heap_ptr(ctx, WORKSPACE + 64, tl.int32)
    buf = dl.heap_ptr(ctx, WORKSPACE + 256 + (e % 2) * (N * 4), tl.float32)
    if me == 0:
        for peer in range(0, world):
            dl.wait(ctx, acks + peer, e - 2, "ge", peer)
            for start in range(0, N, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                mask = offs < N
                dl.store_peer(ctx, buf + offs, tl.load(x_ptr + offs, mask=mask), peer, mask=mask)
        # One fence, then relaxed signals (dl.fence and relaxed dl.notify inside).
        dl.notify_peers(ctx, signal, e, INCLUDE_SELF=True)
    token = dl.wait(ctx, signal, e, "ge", 0)
    for start in range(0, N, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < N
        tl.store(out_ptr + offs, tl.load(dl.consume_token(buf + offs, token), mask=mask), mask=mask)
    dl.notify(ctx, acks + me, 0, e)



@triton.jit
def matmul_descriptors(a_ptr, b_ptr, c_ptr, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """TMA descriptors of A [M, K], B [K, N] and C [M, N] (row-major)."""
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[K, 1],
                                       block_shape=[BLOCK_M, BLOCK_K])
    b_desc = tl.make_tensor_descriptor(b_ptr, shape=[K, N], strides=[N, 1],
                                       block_shape=[BLOCK_K, BLOCK_N])
    c_desc = tl.make_tensor_descriptor(c_ptr, shape=[M, N], strides=[N, 1],
                                       block_shape=[BLOCK_M, BLOCK_N])
    return a_desc, b_desc, c_desc


@triton.jit
def warp_specialized_matmul_kernel(ctx, a_ptr, b_ptr, c_ptr, M: tl.constexpr, N: tl.constexpr,
                                   K: tl.constexpr, BLOCK_M: tl.constexpr,
                                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                   GROUP_M: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
                                   WS: tl.constexpr):
    """c = a @ b, persistent, TMA loads, with Triton's warp specialization of the
    tile loop (WS): on Hopper the compiled kernel has more warps than asked for
    (TMA producer warps apart from the MMA warps, as cuBLAS does). Also timed by
    ``tests/gpu/probe_perf.py --balance``."""
    m_tiles = M // BLOCK_M
    n_tiles = tl.cdiv(N, BLOCK_N)
    a_desc, b_desc, c_desc = matmul_descriptors(a_ptr, b_ptr, c_ptr, M, N, K, BLOCK_M,
                                                BLOCK_N, BLOCK_K)
    for tile in tl.range(tl.program_id(0), m_tiles * n_tiles, NUM_PROGRAMS,
                         warp_specialize=WS):
        tm, tn = grouped_tile(tile, m_tiles, n_tiles, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in tl.range(0, K, BLOCK_K):
            acc = tl.dot(a_desc.load([tm * BLOCK_M, k0]), b_desc.load([k0, tn * BLOCK_N]), acc)
        c_desc.store([tm * BLOCK_M, tn * BLOCK_N], acc.to(c_ptr.dtype.element_ty))


@triton.jit
def to_bfloat16_kernel(ctx, x_ptr, out_ptr, N: tl.constexpr, BLOCK: tl.constexpr):
    """out = x (float32) cast to bfloat16: the interpreter must round like the GPU."""
    for start in range(0, N, BLOCK):
        o = start + tl.arange(0, BLOCK)
        m = o < N
        tl.store(out_ptr + o, tl.load(x_ptr + o, mask=m).to(tl.bfloat16), mask=m)


@triton.jit
def shmem_all_gather_kernel(ctx, x_ptr, out_ptr, N: tl.constexpr, BLOCK: tl.constexpr,
                            WORKSPACE: tl.constexpr):
    """out = x of every rank, in rank order (N float32 each), pushed with
    NVSHMEM-style puts (``jaxtdist.language.shmem``): the put-based all_gather.

    Workspace: int64 signals at WORKSPACE (slot r: rank r's data of epoch e
    landed here), int64 acks at WORKSPACE + 512 (rank r is done reading its
    buffer of epoch e), then two buffers of world * N float32 at WORKSPACE +
    1024 (parity e % 2). Needs 1024 + 2 * world * N * 4 bytes.
    """
    me = dl.rank(ctx)
    world = dl.num_ranks(ctx)
    e = dl.epoch(ctx)
    signals = dl.heap_ptr(ctx, WORKSPACE, tl.int64)
    acks = dl.heap_ptr(ctx, WORKSPACE + 512, tl.int64)
    buf = dl.heap_ptr(ctx, WORKSPACE + 1024 + (e % 2) * (world * N * 4), tl.float32)
    for pe in range(0, world):
        # pe's buffer of this parity held epoch e - 2's data: pe must be done with it.
        shmem.signal_wait_until(ctx, acks + pe, "ge", e - 2)
        shmem.putmem_signal_nbi_block(ctx, buf + me * N, x_ptr, N * 4, signals + me, e, pe)
    for pe in range(0, world):
        shmem.signal_wait_until(ctx, signals + pe, "ge", e)
    for start in range(0, world * N, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < world * N
        tl.store(out_ptr + offs, tl.load(buf + offs, mask=mask), mask=mask)
    for pe in range(0, world):
        shmem.signal_op(ctx, acks + me, e, pe)


@triton.jit
def fails_on_rank0_kernel(ctx, x_ptr, out_ptr, WORKSPACE: tl.constexpr):
    """Rank 0 raises under the interpreter before it notifies (a reshape to a size
    that does not match); every other rank waits for its left neighbour's notify.
    CPU only: on a GPU the reshape is a compile error."""
    me = dl.rank(ctx)
    world = dl.num_ranks(ctx)
    e = dl.epoch(ctx)
    sig = dl.heap_ptr(ctx, WORKSPACE, tl.int32)
    v = tl.load(x_ptr)
    if me == 0:
        v += tl.sum(tl.reshape(tl.arange(0, 4), (3,)), 0).to(tl.float32)
    dl.notify(ctx, sig, (me + 1) % world, e)
    dl.wait(ctx, sig, e, "ge", (me + world - 1) % world)
    tl.store(out_ptr, v)


@triton.jit
def rank_as_float_kernel(ctx, x_ptr, out_ptr, WORKSPACE: tl.constexpr):
    """out = [rank] (float32); the shape of ``fails_on_rank0_kernel``, which works."""
    tl.store(out_ptr, dl.rank(ctx).to(tl.float32) + 0 * tl.load(x_ptr))


@triton.jit
def scale_kernel(ctx, x_ptr, scale, out_ptr, N: tl.constexpr):
    """out = x * scale, ``scale`` a run-time scalar."""
    offs = tl.arange(0, N)
    tl.store(out_ptr + offs, tl.load(x_ptr + offs) * scale)
