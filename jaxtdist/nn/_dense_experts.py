"""The experts of the ``impl="xla"`` MoE twin as MaxText's dense path runs them: each
expert's picks placed in ``capacity`` slots of an [E, C, d] buffer, the SwiGLU as
batched GEMMs over the experts (cuBLAS's batched GEMMs on GPUs), the results
gathered back to their tokens.

``ParallelMoE(..., xla_experts="dense")`` uses it; the default "ragged_dot" runs
``jax.lax.ragged_dot`` over the picks sorted by expert. A JAX user picks either;
the model benchmark times both and keeps the faster.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

__all__ = ["XLA_EXPERTS", "check_xla_experts", "dense_experts"]

XLA_EXPERTS = ("ragged_dot", "dense")


def check_xla_experts(layer: str, value: str) -> str:
    """``value`` if it names an expert form of ``XLA_EXPERTS``, else a ValueError.

    Example:
      >>> check_xla_experts("ParallelMoE", "dense")
      'dense'
    """
    if value not in XLA_EXPERTS:
        raise ValueError(f"jaxtdist.nn.{layer}: xla_experts={value!r}; allowed: 'ragged_dot' "
                         "(jax.lax.ragged_dot over the picks sorted by expert) or 'dense' "
                         "(batched GEMMs over [experts, capacity, d] slots, MaxText's dense "
                         "path)")
    return value


def dense_experts(tokens: jax.Array, ids: jax.Array, weights: jax.Array, w_gate: jax.Array,
                  w_up: jax.Array, w_down: jax.Array, activation: Callable[[jax.Array], jax.Array],
                  capacity: int | None = None) -> jax.Array:
    """One device's tokens through their picked experts, [T, d] float32.

    Args:
      tokens: [T, d].
      ids, weights: [T, K] picks and their weights; a pick of weight 0 (dropped by
        the layer's capacity) or with an id outside [0, E) takes no slot.
      w_gate, w_up: [E, d, F]; w_down: [E, F, d].
      activation: applied to the gate projection.
      capacity: slots per expert (None: T, so that no pick is dropped: each token
        picks an expert once). Picks past it are dropped, every token's first pick
        before any second one, then in token order (GShard's priority, as
        ``ParallelMoE``'s capacity ranks them).

    Example:
      >>> y = dense_experts(x, ids, w, w_gate, w_up, w_down, jax.nn.silu)  # [T, d]
    """
    t, k = ids.shape
    e, d = w_gate.shape[0], tokens.shape[1]
    c = t if capacity is None else int(capacity)
    flat = ids.T.reshape(-1)                           # pick j * T + i: token i's j-th
    gate = weights.T.reshape(-1).astype(jnp.float32)
    valid = (flat >= 0) & (flat < e) & (gate != 0)
    expert = jnp.where(valid, flat, 0)
    # A pick's slot: how many valid picks of its expert came before it (k-major order).
    onehot = jax.nn.one_hot(jnp.where(valid, flat, e), e, dtype=jnp.int32)  # [K * T, E]
    slot = jnp.take_along_axis(jnp.cumsum(onehot, axis=0), expert[:, None], axis=1)[:, 0] - 1
    kept = valid & (slot < c)
    dest = jnp.where(kept, expert * c + slot, e * c)   # out of range: dropped by the scatter
    rows = jnp.tile(jnp.arange(t), k)
    slots = jnp.zeros((e * c, d), tokens.dtype).at[dest].set(tokens[rows], mode="drop")
    slots = slots.reshape(e, c, d)
    f32 = dict(preferred_element_type=jnp.float32)
    hidden = activation(jnp.einsum("ecd,edf->ecf", slots, w_gate, **f32))
    hidden = hidden * jnp.einsum("ecd,edf->ecf", slots, w_up, **f32)
    y = jnp.einsum("ecf,efd->ecd", hidden.astype(tokens.dtype), w_down, **f32)
    picked = jnp.take(y.reshape(e * c, d), dest, axis=0, mode="fill", fill_value=0)
    return jnp.sum((picked * jnp.where(kept, gate, 0.0)[:, None]).reshape(k, t, d), axis=0)
