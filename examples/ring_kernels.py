"""Triton kernels of the ring-exchange tutorial (docs/language.md).

No JAX here: on CPU, jaxtdist runs kernels in interpreter worker processes
that import this module by name and must not start JAX.
"""

import triton
import triton.language as tl

import jaxtdist.language as dl

# Workspace layout, in bytes from the WORKSPACE offset that triton_call passes:
#   +0    int32 READY: rank r - 1 sets it to e once its data of epoch e is here
#   +4    int32 ACK:   rank r + 1 sets it to e once it has read the data of epoch e
#                      that this rank put into its buffer
#   +256  float32[N] receive buffer of parity 0, then float32[N] of parity 1
READY = tl.constexpr(0)
ACK = tl.constexpr(4)
BUFFERS = tl.constexpr(256)


def ring_workspace_bytes(n: int) -> int:
    """Bytes of symmetric heap ``ring_exchange_kernel`` needs for ``n`` float32 elements."""
    return 256 + 2 * 4 * n


@triton.jit
def ring_exchange_kernel(ctx, x_ptr, out_ptr, N: tl.constexpr, BLOCK: tl.constexpr,
                         WORKSPACE: tl.constexpr):
    """out on rank r = x of rank (r - 1) % world; run by one program per rank (grid=(1,))."""
    me = dl.rank(ctx)
    world = dl.num_ranks(ctx)
    e = dl.epoch(ctx)  # 1 on this kernel's first call, then 2, 3, ...
    nxt = (me + 1) % world
    prv = (me + world - 1) % world
    ready = dl.heap_ptr(ctx, WORKSPACE + READY, tl.int32)
    ack = dl.heap_ptr(ctx, WORKSPACE + ACK, tl.int32)
    # Double buffering: call e receives into the buffer of parity e % 2, so
    # the next call's data (parity (e + 1) % 2) cannot clobber this one's.
    buf = dl.parity_ptr(ctx, WORKSPACE + BUFFERS, N * 4, tl.float32)

    # 1. Reuse race: nxt's buffer of this parity last held the data of epoch
    #    e - 2. Parity alone does not make it free: nothing else in the ring
    #    makes this rank wait for nxt (only for prv), so nxt may still be
    #    reading it. Wait until nxt has acknowledged epoch e - 2 (trivially
    #    true for e <= 2: signals start at 0).
    dl.wait(ctx, ack, e - 2, "ge", nxt)
    # 2. Send: plain stores into nxt's copy of the buffer.
    dl.put(ctx, buf, x_ptr, N, nxt, BLOCK)
    # 3. Publish (release at system scope): whoever acquires READY = e also
    #    sees the stores of step 2. Notify before waiting, or every rank
    #    would wait for its prv and none would ever notify.
    dl.notify(ctx, ready, nxt, e)
    # 4. Receive (acquire): wait until prv's data of epoch e has landed here.
    #    ">=" because prv may already be one call ahead. The wait is bounded:
    #    if prv never notifies, it records rank, peer, signal and values and
    #    the host raises jaxtdist.WaitTimeoutError instead of hanging.
    token = dl.wait(ctx, ready, e, "ge", prv)
    # 5. Copy out; consume_token keeps the loads below the wait on GPUs.
    for start in range(0, N, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < N
        vals = tl.load(dl.consume_token(buf + offs, token), mask=mask)
        tl.store(out_ptr + offs, vals, mask=mask)
    # 6. Acknowledge (release: the loads of step 5 are done): prv may now
    #    reuse this parity buffer, in its epoch e + 2.
    dl.notify(ctx, ack, prv, e)
