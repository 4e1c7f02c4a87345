"""The dispatch's routing metadata: in XLA (config ROUTING="xla"), and the step
sizes of the fused routing that the dispatch kernel computes itself
(ROUTING="fused", ``kernels/moe_route.py``); both give the same words, bit for bit."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxtdist.ops._shapes import next_pow2

__all__ = ["META_FIELDS", "route", "route_scan_tokens", "route_tokens_per_step",
           "valid_pairs"]

# Words of a meta row per local expert of a token: local expert id, position
# within (source, expert), k, scale (float32 bits).
META_FIELDS = 4


def valid_pairs(expert_ids: jax.Array, num_experts: int) -> jax.Array:
    """[T, K] bool: ids in [0, E) and not a repeat of an earlier k of the token."""
    ids = expert_ids
    in_range = (ids >= 0) & (ids < num_experts)
    k = ids.shape[1]
    earlier = jnp.tril(jnp.ones((k, k), bool), -1)  # [k, k'] k' < k
    repeat = jnp.any((ids[:, :, None] == ids[:, None, :]) & earlier[None], axis=2)
    return in_range & ~repeat


def route(expert_ids, world: int, num_experts: int, programs: int,
          scale: jax.Array) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    """The dispatch's routing words in XLA; ``scale`` [T, K] float32 (the copies'
    factors, their bits travel in the meta rows). Returns the invalid pairs (an
    int32 scalar: ids outside [0, E) or repeated) and the dispatch kernel's inputs
    slot [T, W] int32 (-1: not sent to d), meta [T, W, 1 + 4 KL] int32, dcounts [W,
    E_LOC] int32 and bounds [W, P + 1] int32."""
    t, k = expert_ids.shape
    e_loc = num_experts // world
    kl = min(k, e_loc)
    valid = valid_pairs(expert_ids, num_experts)
    ids = jnp.where(valid, expert_ids, 0).astype(jnp.int32)
    dest = jnp.where(valid, ids // e_loc, world)                       # world: nowhere
    send = jnp.any(dest[:, :, None] == jnp.arange(world)[None, None], axis=1)  # [T, W]
    csum = jnp.cumsum(send.astype(jnp.int32), axis=0)
    slot = jnp.where(send, csum - 1, -1).astype(jnp.int32)
    tp = -(-t // programs)
    edges = np.minimum(np.arange(programs + 1) * tp, t)
    padded = jnp.concatenate([jnp.zeros((1, world), jnp.int32), csum], axis=0)
    bounds = padded[edges].T.astype(jnp.int32)                         # [W, P + 1]
    onehot = jnp.sum((ids[:, :, None] == jnp.arange(num_experts)[None, None]) & valid[:, :, None],
                     axis=1, dtype=jnp.int32)                          # [T, E]
    before = jnp.cumsum(onehot, axis=0) - onehot
    pos = jnp.take_along_axis(before, ids, axis=1)                     # [T, K]
    dcounts = jnp.sum(onehot, axis=0).reshape(world, e_loc)
    # kk: the rank of k among the token's valid experts on the same destination.
    earlier = jnp.tril(jnp.ones((k, k), bool), -1)
    same = (dest[:, :, None] == dest[:, None, :]) & valid[:, None, :] & earlier[None]
    kk = jnp.sum(same, axis=2).astype(jnp.int32)
    fields = jnp.stack([ids % e_loc, pos, jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (t, k)),
                        jax.lax.bitcast_convert_type(scale, jnp.int32)], axis=-1)  # [T, K, 4]
    # Slot (d, j) of token t holds the fields of its valid pair k with dest d and
    # kk = j (at most one: kk counts the token's distinct experts on d, fewer than
    # KL). Selected by a masked sum, not a scatter: XLA's GPU scatter of these
    # 4 T K words took 23 us at T = 128, K = 8 (2 x H200), a fused select 1-2 us.
    match = ((dest[:, None, None, :] == jnp.arange(world)[None, :, None, None])
             & (kk[:, None, None, :] == jnp.arange(kl)[None, None, :, None])
             & valid[:, None, None, :])                                # [T, W, KL, K]
    picked = jnp.sum(jnp.where(match[..., None], fields[:, None, None], 0), axis=3)
    table = jnp.where(jnp.any(match, axis=3)[..., None], picked, -1)    # [T, W, KL, 4]
    head = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[:, None, None], (t, world, 1))
    meta = jnp.concatenate([head, table.reshape(t, world, kl * META_FIELDS)], axis=2)
    return jnp.sum(~valid).astype(jnp.int32), (slot, meta, dcounts, bounds)


def route_tokens_per_step(tokens_per_program: int, top_k: int, num_experts: int) -> int:
    """BT of the fused routing: its own tokens' words BT at a time, a [BT, KP, EP]
    one-hot block of at most 8192 words."""
    return max(1, min(next_pow2(tokens_per_program),
                      8192 // (next_pow2(top_k) * next_pow2(num_experts))))


def route_scan_tokens(tokens: int, top_k: int) -> int:
    """BS of the fused routing: tokens per step of its scan over every token's ids
    (1024 pairs per histogram)."""
    return min(next_pow2(tokens), max(1, 1024 // next_pow2(top_k)))
