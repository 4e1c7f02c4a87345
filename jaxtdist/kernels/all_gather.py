"""all_gather: every rank pulls every peer's staged shard into its output."""

import triton
import triton.language as tl

from jaxtdist.kernels._gather import announce_shard, pull_shards


@triton.jit
def all_gather_kernel(ctx, x_ptr, out_ptr, ROWS: tl.constexpr, COLS: tl.constexpr,
                      STAGE_OFF: tl.constexpr, SLOT_BYTES: tl.constexpr,
                      READY_OFF: tl.constexpr, NUM_WORKERS: tl.constexpr,
                      CHUNK_ROWS: tl.constexpr, BLOCK_C: tl.constexpr):
    """Grid: (NUM_WORKERS,). out[world * ROWS, COLS] = shards in rank order."""
    pid = tl.program_id(0)
    if pid == 0:
        announce_shard(ctx, READY_OFF)
    pull_shards(ctx, x_ptr, out_ptr, pid, NUM_WORKERS, ROWS, COLS, STAGE_OFF, SLOT_BYTES,
                READY_OFF, -1, CHUNK_ROWS, BLOCK_C)
