"""Tensor-parallel self-attention: heads split over the tensor-parallel axis."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxtdist.nn._linear import (ColumnParallelLinear, RowParallelLinear, _rows,
                                 check_divisible)


class ParallelAttention(nnx.Module):
    """Causal multi-head self-attention with the heads split over ``axis_name``.

    Q, K and V are column-parallel (each rank computes its heads for every
    token of its batch group, the tokens gathered while multiplying); the
    attention itself is local per head group (``jax.nn.dot_product_attention``);
    the output projection is row-parallel, back to sequence-parallel tokens.

    Input and output: [batch * seq_len, features], tokens (batch-major)
    sharded over ``(*batch_axes, axis_name)``; the batch must divide over
    ``batch_axes``.

    Example:
      >>> attn = ParallelAttention(512, num_heads=8, batch_axes=("dp",), rngs=nnx.Rngs(0))
      >>> y = attn(x, seq_len=128)  # x: [batch * 128, 512], P(("dp", "tp"), None)
    """

    def __init__(self, features: int, num_heads: int, *, axis_name: str = "tp",
                 batch_axes: str | Sequence[str] = (), use_bias: bool = False,
                 dtype=None, param_dtype=jnp.float32, impl: str = "jaxtdist",
                 rngs: nnx.Rngs):
        if features % num_heads:
            raise ValueError(f"jaxtdist.nn.ParallelAttention: features={features} must be "
                             f"divisible by num_heads={num_heads}")
        check_divisible("ParallelAttention", "num_heads", num_heads, axis_name)
        self.num_heads = num_heads
        self.head_dim = features // num_heads
        common = dict(axis_name=axis_name, batch_axes=batch_axes, use_bias=use_bias,
                      dtype=dtype, param_dtype=param_dtype, impl=impl, rngs=rngs)
        self.query = ColumnParallelLinear(features, features, **common)
        self.key = ColumnParallelLinear(features, features, **common)
        self.value = ColumnParallelLinear(features, features, **common)
        self.out = RowParallelLinear(features, features, **common)

    def __call__(self, x: jax.Array, *, seq_len: int) -> jax.Array:
        tokens = x.shape[0]
        if tokens % seq_len:
            raise ValueError(f"jaxtdist.nn.ParallelAttention: the {tokens} tokens of x must be "
                             f"whole sequences of seq_len={seq_len}")
        batch = tokens // seq_len

        rows, tp = _rows(self.out.batch_axes), self.out.axis_name

        def heads(h):  # [batch * seq, heads * dim] -> [batch, seq, heads, dim]
            return _reshape(h, (batch, seq_len, self.num_heads, self.head_dim),
                            P(rows, None, tp, None))

        q, k, v = (heads(layer(x)) for layer in (self.query, self.key, self.value))
        o = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        return self.out(_reshape(o, (tokens, self.num_heads * self.head_dim), P(rows, tp)))


def _reshape(x: jax.Array, shape: tuple[int, ...], spec: P) -> jax.Array:
    """``x.reshape(shape)``; on a mesh with explicit axes (``jax.make_mesh``'s
    default) the result's sharding must be given: ``spec`` (heads stay on their
    ranks, so no data moves)."""
    mesh = getattr(jax.typeof(x).sharding, "mesh", None)
    types = getattr(mesh, "axis_types", ()) or ()
    if any(t == jax.sharding.AxisType.Explicit for t in types):
        return jax.lax.reshape(x, shape, out_sharding=jax.sharding.NamedSharding(mesh, spec))
    return x.reshape(shape)
