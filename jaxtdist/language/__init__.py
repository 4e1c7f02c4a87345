"""jaxtdist.language: device-side primitives for distributed Triton kernels.

Import as ``import jaxtdist.language as dl``. A kernel receives the context
``ctx`` as its first argument and passes it to every primitive::

    @triton.jit
    def ring_kernel(ctx, x_ptr, out_ptr, N: tl.constexpr, BUF: tl.constexpr, SIG: tl.constexpr):
        me, world, e = dl.rank(ctx), dl.num_ranks(ctx), dl.epoch(ctx)
        ...

See docs/language.md for a tutorial.
"""

from jaxtdist.language.core import (
    barrier_all,
    consume_token,
    epoch,
    fence,
    fence_async_proxy,
    get,
    heap_base,
    heap_ptr,
    load_peer,
    notify,
    notify_peers,
    now_ns,
    pack_tagged,
    num_ranks,
    parity_ptr,
    put,
    rank,
    store_peer,
    symm_at,
    unpack_tagged,
    wait,
    wait_for_tma,
    wait_tagged,
    wait_tma_stores,
)

__all__ = [
    "barrier_all",
    "consume_token",
    "epoch",
    "fence",
    "fence_async_proxy",
    "get",
    "heap_base",
    "heap_ptr",
    "load_peer",
    "notify",
    "notify_peers",
    "now_ns",
    "pack_tagged",
    "num_ranks",
    "parity_ptr",
    "put",
    "rank",
    "store_peer",
    "symm_at",
    "unpack_tagged",
    "wait",
    "wait_for_tma",
    "wait_tagged",
    "wait_tma_stores",
]
