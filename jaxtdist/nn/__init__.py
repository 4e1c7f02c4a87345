"""jaxtdist.nn: tensor-parallel Flax NNX layers on jaxtdist's overlapped ops.

Model code uses these like ``nnx.Linear``: [batch, seq, d] global arrays under
``jax.jit`` / ``nnx.jit``, no ``shard_map``, no static lengths. Inside, the
activations are sequence parallel (Megatron-SP): tokens sharded over
``(*batch_axes, axis_name)``; column-parallel projections gather the tokens
while multiplying (``ag_matmul``, one gather for Q/K/V and one for gate/up),
row-parallel ones multiply and reduce-scatter (``matmul_rs``), or all-reduce
in a decode step (``matmul_ar``). Defaults: ``axis_name="tp"`` and
``batch_axes`` every other mesh axis. Parameters are plain sharded
``nnx.Param``s named as Hugging Face names them (``q_proj.kernel`` ...), so a
checkpoint of a jaxtdist model is a checkpoint of the same model on XLA's
collectives: every layer takes ``impl="xla"`` (no ``jaxtdist.initialize``
needed) for side-by-side comparisons.

Example:
  >>> mesh = jax.make_mesh((2, 4), ("dp", "tp")); jaxtdist.initialize(mesh)
  >>> mlp = jaxtdist.nn.ParallelMLP(512, 2048, rngs=nnx.Rngs(0))
  >>> y = nnx.jit(lambda m, x: m(x))(mlp, x)  # x: [batch, seq, 512]
"""

from jaxtdist.nn._attention import ParallelAttention, RopeScaling, rope
from jaxtdist.nn._embed import Embed
from jaxtdist.nn._fp8 import Fp8Recipe, Fp8Weight
from jaxtdist.nn._generate import generate
from jaxtdist.nn._hf import load_hf_llama
from jaxtdist.nn._linear import ColumnParallelLinear, RowParallelLinear
from jaxtdist.nn._llama import Llama, LlamaConfig, Optimizer, place_on_mesh
from jaxtdist.nn._mlp import ParallelMLP
from jaxtdist.nn._moe import ParallelMoE, RouterStats, load_balancing_loss

__all__ = ["ColumnParallelLinear", "Embed", "Fp8Recipe", "Fp8Weight", "Llama", "LlamaConfig", "Optimizer",
           "ParallelAttention", "ParallelMLP", "ParallelMoE", "RopeScaling", "RouterStats",
           "RowParallelLinear", "generate", "load_balancing_loss", "load_hf_llama",
           "place_on_mesh", "rope"]
