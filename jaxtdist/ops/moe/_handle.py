"""MoeHandle: what moe_combine needs from a moe_dispatch."""

from __future__ import annotations

import dataclasses

import jax

__all__ = ["MoeHandle"]

@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MoeHandle:
    """What ``moe_combine`` needs from a ``moe_dispatch`` (a pytree: pass it along
    inside the same ``shard_map``).

    Array fields (per rank):
      expert_ids: [T, K] int32, the routing this rank's tokens were sent with.
      recv_counts: [W, E / W] int32, rows received from each source rank for
        each local expert (before dropping).
      src_pos: [W * T, min(K, E / W)] int32: for inbox row i of source s (slot
        ``s * T + i``) and its kk-th local expert, the row of ``recv_x`` it went
        to, or -1 (no such expert, or dropped).
      src_tk: same shape: ``t * K + k`` of that (token, k) pair at its source, or -1.
      src_ranges: [W, P, NCH + 1] int32: the inbox slots that each source's
        program p pushed, by its NCH chunks (chunk c: slots ``[src_ranges[s, p,
        c], src_ranges[s, p, c + 1])``); the combine sends and sums by them.
      dropped: int32 scalar: (token, expert) rows this rank dropped (past
        ``max_recv_rows``); their combine contribution is zero.
      invalid: int32 scalar: (token, k) pairs of this rank with an expert id
        outside [0, E) or repeated within the token; they are not sent and
        contribute zero.
    Static fields: num_experts, max_recv_rows, programs, axis_name (the
    dispatch's group, as a tuple of mesh axes; None: not recorded, not checked).
    """
    expert_ids: jax.Array
    recv_counts: jax.Array
    src_pos: jax.Array
    src_tk: jax.Array
    src_ranges: jax.Array
    dropped: jax.Array
    invalid: jax.Array
    num_experts: int = dataclasses.field(metadata=dict(static=True), default=0)
    max_recv_rows: int = dataclasses.field(metadata=dict(static=True), default=0)
    programs: int = dataclasses.field(metadata=dict(static=True), default=1)
    axis_name: tuple[str, ...] | None = dataclasses.field(metadata=dict(static=True),
                                                          default=None)
