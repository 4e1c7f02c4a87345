"""The (token, expert) pairs of a top-K routing sorted by expert: the grouping both
of moe_tp_mlp's schedules run their grouped GEMMs on."""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["expert_order", "sum_pairs"]


def expert_order(ids: jax.Array, gate: jax.Array, experts: int):
    """(gate, order, position, sizes, valid) of the flat pairs ``ids``, ``gate``
    [T * K].

    An id outside [0, experts) joins the last expert with weight 0 (``gate`` is
    returned with those weights zeroed; ``valid`` marks the others), so every pair
    is in some group and the sizes sum to T * K. ``order``: the pairs by expert
    (stable); ``position``: its inverse (where each pair went); ``sizes``
    [experts] int32 rows per expert.
    """
    valid = (ids >= 0) & (ids < experts)
    gate = jnp.where(valid, gate, 0.0)
    ids = jnp.where(valid, ids, experts - 1)
    order = jnp.argsort(ids, stable=True)
    position = jnp.zeros_like(order).at[order].set(jnp.arange(order.size, dtype=order.dtype))
    return (gate, order, position, jnp.bincount(ids, length=experts).astype(jnp.int32),
            valid)


def sum_pairs(pairs: jax.Array, gate: jax.Array, valid: jax.Array) -> jax.Array:
    """float32 [T, H]: each token's pairs ``pairs`` [T, K, H] weighed by ``gate``
    [T * K] and summed, the invalid ones (``valid`` [T * K] false) counting zero:
    they ran through the last expert, whose row may be inf or NaN (0 * inf is NaN)."""
    t, k = pairs.shape[:2]
    weighted = pairs.astype(jnp.float32) * gate.reshape(t, k, 1)
    return jnp.sum(jnp.where(valid.reshape(t, k, 1), weighted, 0.0), axis=1)
