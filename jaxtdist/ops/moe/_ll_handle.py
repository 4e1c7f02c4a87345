"""MoeLLHandle: what moe_combine_ll needs from a moe_dispatch_ll."""

from __future__ import annotations

import dataclasses

import jax

__all__ = ["MoeLLHandle"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MoeLLHandle:
    """What ``moe_combine_ll`` needs from a ``moe_dispatch_ll`` (a pytree: pass it
    along inside the same ``shard_map``).

    Array fields (per rank; E_LOC = E / W local experts, M = max_tokens_per_rank):
      expert_ids: [T, K] int32, the routing this rank's tokens went out with.
      recv_counts: [E_LOC, W] int32: copies received per (local expert, source
        rank); the valid rows of ``recv_x[le]`` are its first
        ``sum(recv_counts[le])``, source by source (source s's from
        ``sum(recv_counts[le, :s])``), each source's in token order.
      src_tk: [E_LOC, W * M] int32: for each valid row, ``t * K + k`` of its
        (token, k) pair at its source (rows past the counts: unspecified).
      invalid: int32 scalar: this rank's (t, k) pairs with an id outside [0, E)
        or repeating an earlier k of the token (not sent; zero in combine).
    Static fields: num_experts, max_tokens_per_rank, axis_name (the dispatch's
    group as a tuple of mesh axes).
    """
    expert_ids: jax.Array
    recv_counts: jax.Array
    src_tk: jax.Array
    invalid: jax.Array
    num_experts: int = dataclasses.field(metadata=dict(static=True), default=0)
    max_tokens_per_rank: int = dataclasses.field(metadata=dict(static=True), default=0)
    axis_name: tuple[str, ...] | None = dataclasses.field(metadata=dict(static=True),
                                                          default=None)
