"""The consumer's waits of a gather into this rank's rows (ag_matmul, ag_attention,
moe_tp's gathering grouped GEMM): a tile's chunk flags, and the copy engines'
"sent" words.

Gathered rows come in chunks of CHUNK_ROWS rows of each source rank, one int32
flag per chunk (source ``src``'s chunk c at ``flags + src * n_chunks + c``),
set to the epoch by whoever moves the chunk: this GPU's producer programs
(``_gather.pull_shards``), peers' (``push_shards``) or peers' copy engines.

The copy engines' side streams (``csrc/ce_gather.cc``) raise this rank's
"sent" word of each peer step to the epoch once its pushes of that step have
ended; ``_gather.push_shards_kernel`` raises them in the CPU backend.
"""

import triton
import triton.language as tl

import jaxtdist.language as dl


@triton.jit
def wait_rows(ctx, flags, e, src, row0, ROWS: tl.constexpr, BLOCK_M: tl.constexpr,
              CHUNK_ROWS: tl.constexpr, SCOPE: tl.constexpr):
    """Waits until the chunks holding rows [row0, row0 + BLOCK_M) of source ``src``'s
    ROWS rows have arrived (one chunk or several: chunks may be coarser or finer
    than tiles). SCOPE: "gpu" for flags this GPU raises (its producers, its copy
    engines), "sys" for flags a peer GPU's programs raise. Returns the last
    wait's token (for ``_tiles.aligned_after``: loads of the rows after it)."""
    n_chunks: tl.constexpr = (ROWS + CHUNK_ROWS - 1) // CHUNK_ROWS
    last = (row0 + BLOCK_M + CHUNK_ROWS - 1) // CHUNK_ROWS
    token = tl.full((), 0, tl.int32)
    for chunk in range(row0 // CHUNK_ROWS, tl.minimum(last, n_chunks)):
        token = dl.wait(ctx, flags + src * n_chunks + chunk, e, "ge", src, SCOPE)
    return token


@triton.jit
def wait_every_peer(ctx, flags, e, me, world, ROWS: tl.constexpr, CHUNK_ROWS: tl.constexpr,
                    SCOPE: tl.constexpr):
    """Waits until every chunk of every peer's ROWS rows of epoch ``e`` has arrived:
    each peer has reached this epoch (so has finished the kernels that read what
    this rank's next-but-one call rewrites: the inbox's reuse)."""
    n_chunks: tl.constexpr = (ROWS + CHUNK_ROWS - 1) // CHUNK_ROWS
    for step in range(1, world):
        src = (me + step) % world
        for chunk in range(0, n_chunks):
            dl.wait(ctx, flags + src * n_chunks + chunk, e, "ge", src, SCOPE)


@triton.jit
def wait_pushes_sent(ctx, SENT_OFF: tl.constexpr, me, world, e):
    """Waits until this rank's copy-engine pushes of epoch ``e`` to every peer have
    ended (the "sent" words at SENT_OFF): the pushes' source (the kernel's operand
    x) is no longer read, so it may die with the kernel."""
    sent = dl.heap_ptr(ctx, SENT_OFF, tl.int32)
    for step in range(1, world):
        dl.wait(ctx, sent + step, e, "ge", me, "gpu")
