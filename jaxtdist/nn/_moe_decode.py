"""ParallelMoE's low-latency decode path: the expert-parallel block on the
expert-padded layout (``moe_dispatch_ll`` -> masked grouped GEMMs gate / up ->
activation -> masked grouped GEMM down -> ``moe_combine_ll``), for
``ParallelMoE(..., low_latency_decode=True)`` called with ``decode=True``.
Inference only: the LL ops are not differentiable."""

from __future__ import annotations

import functools

from jax.sharding import PartitionSpec as P

from jaxtdist.ops._sharded import pjit_wrapper, rows_over
from jaxtdist.ops.grouped_matmul_masked import grouped_matmul_masked
from jaxtdist.ops.moe import moe_combine_ll, moe_dispatch_ll

__all__ = ["expert_parallel_decode"]


def _decode_block(tokens, expert_ids, weights, w_gate, w_up, w_down, *, axis_name,
                  num_experts, activation):
    """Inside shard_map: this rank's tokens [T, d] to their experts' ranks (the
    padded layout), through this rank's experts (w_* [E / W, ...]) on their valid
    rows only, and back, weighted (float32 sums, in the tokens' dtype)."""
    recv, counts, handle = moe_dispatch_ll(tokens, expert_ids, axis_name,
                                           num_experts=num_experts)
    # Rows past each expert's counts are padding (unspecified): the masked GEMMs
    # never read them, and the combine reads only the counted rows of y.
    gate = grouped_matmul_masked(recv, w_gate, counts)
    up = grouped_matmul_masked(recv, w_up, counts)
    hidden = (activation(gate) * up).astype(tokens.dtype)
    y = grouped_matmul_masked(hidden, w_down, counts)
    return moe_combine_ll(y, handle, weights, axis_name)


@functools.lru_cache(maxsize=None)
def expert_parallel_decode():
    """The decode block on global arrays: tokens, ids and weights sharded on rows
    over (*batch_axes, axis_name), the experts' weights on E over axis_name.

    Example:
      >>> y = expert_parallel_decode()(tokens, ids, weights, w_gate, w_up, w_down,
      ...                              axis_name="tp", batch_axes=(), num_experts=8,
      ...                              activation=jax.nn.silu)
    """
    def rows(axis, batch):
        return P(rows_over(axis, batch), None)

    return pjit_wrapper(
        _decode_block, name="nn.ParallelMoE.decode",
        in_specs=lambda axis, batch: (rows(axis, batch),) * 3 + (P(axis, None, None),) * 3,
        out_specs=rows)
