"""The (token, expert) pairs of a top-K routing sorted by expert: the grouping both
of moe_tp_mlp's schedules run their grouped GEMMs on."""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["expert_order"]


def expert_order(ids: jax.Array, gate: jax.Array, experts: int):
    """(gate, order, position, sizes) of the flat pairs ``ids``, ``gate`` [T * K].

    An id outside [0, experts) joins the last expert with weight 0 (``gate`` is
    returned with those weights zeroed), so every pair is in some group and the
    sizes sum to T * K. ``order``: the pairs by expert (stable); ``position``: its
    inverse (where each pair went); ``sizes`` [experts] int32 rows per expert.
    """
    valid = (ids >= 0) & (ids < experts)
    gate = jnp.where(valid, gate, 0.0)
    ids = jnp.where(valid, ids, experts - 1)
    order = jnp.argsort(ids, stable=True)
    position = jnp.zeros_like(order).at[order].set(jnp.arange(order.size, dtype=order.dtype))
    return gate, order, position, jnp.bincount(ids, length=experts).astype(jnp.int32)
