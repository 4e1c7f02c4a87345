"""A token embedding whose output is already sequence parallel."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxtdist.nn._layout import make_layout

__all__ = ["Embed"]


class Embed(nnx.Embed):
    """``nnx.Embed`` (parameter ``embedding`` [vocab, d], replicated) whose lookup
    returns [batch, seq, d] sequence parallel, ``P(batch_axes, axis_name, None)``.

    On explicit mesh axes (``jax.make_mesh``'s default) ``nnx.Embed`` cannot look
    up sharded token ids (``ShardingTypeError: Use .at[...].get(out_sharding=)``);
    this one gives the gather its output sharding. It takes the same arguments
    as ``nnx.Embed`` plus the layers' ``axis_name``, ``batch_axes`` and ``mesh``.

    Example:
      >>> embed = Embed(32000, 512, rngs=nnx.Rngs(0))
      >>> x = embed(tokens)  # tokens [batch, seq] int32 -> [batch, seq, 512]
    """

    def __init__(self, num_embeddings: int, features: int, *, axis_name: str = "tp",
                 batch_axes: str | Sequence[str] | None = None, mesh: Mesh | None = None,
                 impl: str = "xla", rngs: nnx.Rngs, **kwargs):
        self.layout = make_layout("Embed", mesh=mesh, axis_name=axis_name,
                                  batch_axes=batch_axes, impl=impl)
        kwargs.setdefault("embedding_init", nnx.with_partitioning(
            nnx.initializers.variance_scaling(1.0, "fan_in", "normal", out_axis=0),
            (None, None), mesh=self.layout.mesh))
        super().__init__(num_embeddings, features, rngs=rngs, **kwargs)

    def __call__(self, inputs: jax.Array) -> jax.Array:
        lay = self.layout
        if inputs.ndim != 2 or not jnp.issubdtype(inputs.dtype, jnp.integer):
            raise ValueError(f"jaxtdist.nn.Embed: tokens have shape {tuple(inputs.shape)} and "
                             f"dtype {inputs.dtype}; expected integer [batch, seq]")
        batch, seq = inputs.shape
        b = lay.batch_spec(batch)
        spec = P(b, lay.axis_name if seq % lay.tp == 0 and lay.divides(batch) else None, None)
        table = self.embedding[...]
        if self.dtype is not None:
            table = table.astype(self.dtype)
        if lay.explicit:
            tokens = lay.constrain(inputs, P(*spec[:2]))
            return table.at[tokens].get(out_sharding=lay.named(spec))
        return lay.constrain(jnp.take(table, inputs, axis=0), spec)
