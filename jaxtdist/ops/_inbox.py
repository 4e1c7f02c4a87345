"""Pushing a rank's rows into every peer's heap inbox: the producer half of the
inbox ops (ag_matmul's copy-engine kernel, ag_attention).

Layout: ``_shapes.InboxWorkspace``. Each peer's inbox of parity ``epoch % 2``
receives this rank's rows at rows ``me``, with a flag per chunk raised to the
epoch once the chunk has landed, and this rank's "sent" words raised once its
pushes have ended (the consumer waits for them before its inputs may be freed).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxtdist.kernels._gather import push_shards_kernel
from jaxtdist.ops._protocol import Call

__all__ = ["push_to_inboxes"]


def push_to_inboxes(call: Call, ctx: jax.Array, x: jax.Array, *, inbox_offset: int,
                    parity_bytes: int, flags_offset: int, sent_offset: int, chunk_rows: int,
                    serial: bool = False, sm_programs: int = 2, copy_block_c: int = 128,
                    scope: str = "sys") -> jax.Array:
    """Pushes ``x`` [rows, cols] into every peer's inbox; returns the context for the
    consumer kernel, ordered after the pushes are issued.

    Backends with copy engines push on side streams while the consumer runs
    (``serial``: one peer after another). Elsewhere (the interpreter) an SM
    kernel of ``sm_programs`` programs pushes, and the consumer starts after it
    (the context returned is that kernel's output)
    (``copy_block_c`` columns per copy step, flags raised at ``scope``); its
    ``chunk_rows`` must be a power of 2.
    """
    if call.rt.backend.has_copy_engines:
        return call.push_to_peers(ctx, x, inbox_offset=inbox_offset, parity_bytes=parity_bytes,
                                  flags_offset=flags_offset, sent_offset=sent_offset,
                                  chunk_rows=chunk_rows, serial=serial)
    rows, cols = x.shape
    zero = call.launch(push_shards_kernel, ctx, x, out_shape=jax.ShapeDtypeStruct((1,), jnp.int32),
                       grid=(sm_programs,), num_warps=4, num_stages=1, M_SHARD=rows, K=cols,
                       INBOX_OFF=inbox_offset, PARITY_BYTES=parity_bytes,
                       FLAGS_OFF=flags_offset, SENT_OFF=sent_offset, NUM_COMM=sm_programs,
                       CHUNK_ROWS=chunk_rows, COPY_BLOCK_C=copy_block_c, SCOPE=scope)
    # The kernel's 0 added to the context: the consumer, taking the sum, runs after
    # every push. An optimization barrier tying the two did not survive XLA:CPU's
    # compilation (the consumer took the prologue's context directly), and a device
    # whose worker ran the consumer first would wait for peers that could do the same.
    return ctx + zero[0]
