"""The tensor-parallel MLP: column-parallel up (and gate), row-parallel down."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtdist.nn._linear import ColumnParallelLinear, RowParallelLinear


class ParallelMLP(nnx.Module):
    """``down(act(up(x)))``, or ``down(act(gate(x)) * up(x))`` with ``gated=True``.

    Sequence parallel in and out: [tokens, features] with tokens sharded over
    ``(*batch_axes, axis_name)``; the hidden activations are [tokens, hidden]
    with hidden sharded over ``axis_name``. Two overlapped collectives per
    call (three with ``gated``: gate and up gather the tokens each).
    ``impl="xla"`` builds the same layer on XLA's collectives (a reference
    with the same parameters).

    Example:
      >>> mlp = ParallelMLP(512, 2048, gated=True, batch_axes=("dp",), rngs=nnx.Rngs(0))
      >>> y = mlp(x)  # [tokens, 512] P(("dp", "tp"), None), the same sharding out
      >>> y1 = mlp(x1, decode=True)  # [batch, 512] P("dp", None): replicated over tp
    """

    def __init__(self, features: int, hidden: int, *, gated: bool = False,
                 activation: Callable[[jax.Array], jax.Array] = jax.nn.gelu,
                 axis_name: str = "tp", batch_axes: str | Sequence[str] = (),
                 use_bias: bool = True, dtype=None, param_dtype=jnp.float32,
                 impl: str = "jaxtdist", rngs: nnx.Rngs):
        common = dict(axis_name=axis_name, batch_axes=batch_axes, use_bias=use_bias,
                      dtype=dtype, param_dtype=param_dtype, impl=impl, rngs=rngs)
        self.up = ColumnParallelLinear(features, hidden, **common)
        self.gate = ColumnParallelLinear(features, hidden, **common) if gated else None
        self.down = RowParallelLinear(hidden, features, **common)
        self.activation = activation

    def __call__(self, x: jax.Array, *, decode: bool = False) -> jax.Array:
        """``decode``: x's tokens are on every ``axis_name`` rank (a decode step):
        local GEMMs up, an all-reduce (``matmul_ar``) down; the output likewise."""
        h = self.up(x, replicated_tokens=decode)
        if self.gate is not None:
            h = self.activation(self.gate(x, replicated_tokens=decode)) * h
        else:
            h = self.activation(h)
        return self.down(h, reduce="all" if decode else None)
