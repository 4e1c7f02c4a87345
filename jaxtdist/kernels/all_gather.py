"""all_gather: every rank stages its shard in the heap and pulls every peer's."""

import triton
import triton.language as tl

from jaxtdist.kernels._gather import pull_shards


@triton.jit
def all_gather_kernel(ctx, x_ptr, out_ptr, ROWS: tl.constexpr, COLS: tl.constexpr,
                      STAGE_OFF: tl.constexpr, SLOT_BYTES: tl.constexpr,
                      READY_OFF: tl.constexpr, NUM_WORKERS: tl.constexpr,
                      CHUNK_ROWS: tl.constexpr, BLOCK_C: tl.constexpr, SCOPE: tl.constexpr):
    """Grid: (NUM_WORKERS,). out[world * ROWS, COLS] = shards in rank order."""
    pid = tl.program_id(0)
    pull_shards(ctx, x_ptr, out_ptr, pid, NUM_WORKERS, ROWS, COLS, STAGE_OFF, SLOT_BYTES,
                READY_OFF, -1, CHUNK_ROWS, BLOCK_C, SCOPE)
