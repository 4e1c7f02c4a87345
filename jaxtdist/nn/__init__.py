"""jaxtdist.nn: tensor-parallel Flax NNX layers on jaxtdist's overlapped ops.

Model code uses these like ``nnx.Linear``: global arrays under ``jax.jit``,
no ``shard_map`` and no axis bookkeeping. Activations are sequence parallel
(Megatron-SP): [tokens, features] with tokens sharded over
``(*batch_axes, axis_name)``. A column-parallel layer gathers the tokens
while multiplying (``ag_matmul``); a row-parallel layer multiplies and
reduce-scatters back to sharded tokens (``matmul_rs``), or all-reduces for
decode, where every rank holds all tokens (``matmul_ar``). Weights are plain
``nnx.Param``s with sharding metadata over the mesh axes, so a checkpoint of
a jaxtdist model is a checkpoint of the same model written with XLA
collectives: every layer also takes ``impl="xla"``, the same layer on XLA's
collectives, for side-by-side comparisons. On an axis of size 1 every layer
is its local computation.

Example:
  >>> mesh = jax.make_mesh((2, 4), ("dp", "tp")); jaxtdist.initialize(mesh)
  >>> mlp = jaxtdist.nn.ParallelMLP(512, 2048, gated=True, batch_axes=("dp",),
  ...                               rngs=nnx.Rngs(0))
  >>> y = nnx.jit(lambda m, x: m(x))(mlp, x)  # x: [tokens, 512], P(("dp", "tp"), None)
"""

from jaxtdist.nn._attention import ParallelAttention
from jaxtdist.nn._gpt import GPT
from jaxtdist.nn._linear import ColumnParallelLinear, RowParallelLinear
from jaxtdist.nn._mlp import ParallelMLP

__all__ = ["GPT", "ColumnParallelLinear", "ParallelAttention", "ParallelMLP", "RowParallelLinear"]
