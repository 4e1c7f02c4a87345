"""The tensor-parallel MLP: column-parallel gate and up (one gather), row-parallel down."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from jaxtdist.nn._fp8 import Fp8Recipe
from jaxtdist.nn._layout import make_layout
from jaxtdist.nn._linear import ColumnParallelLinear, RowParallelLinear, column_parallel

__all__ = ["ParallelMLP"]


class ParallelMLP(nnx.Module):
    """``down_proj(act(gate_proj(x)) * up_proj(x))`` (SwiGLU with the default
    ``activation=jax.nn.silu``), or ``down_proj(act(up_proj(x)))`` with ``gated=False``.

    [batch, seq, d_model] in and out (sequence parallel); the hidden
    activations have their features over ``axis_name``. gate and up share one
    gather of the tokens (``ag_matmul`` with two weights); down reduce-scatters
    (``matmul_rs``), or all-reduces in a decode step (``matmul_ar``).
    Parameters as Hugging Face names them: ``gate_proj``, ``up_proj``,
    ``down_proj``, each with ``kernel`` [in, out] (and ``bias``); with
``fp8=Fp8Recipe("blockwise")`` each with FP8 ``weight`` [out, in] and
``weight_scale_inv`` instead of ``kernel``.

    Example:
      >>> mesh = jax.make_mesh((2, 4), ("dp", "tp")); jaxtdist.initialize(mesh)
      >>> mlp = ParallelMLP(512, 2048, rngs=nnx.Rngs(0))
      >>> y = nnx.jit(lambda m, x: m(x))(mlp, x)  # x: [batch, seq, 512]
      >>> y1 = nnx.jit(lambda m, x: m(x, decode=True))(mlp, x1)  # x1: [batch, 1, 512]
    """

    def __init__(self, d_model: int, hidden: int, *, gated: bool = True,
                 activation: Callable[[jax.Array], jax.Array] = jax.nn.silu,
                 use_bias: bool = False, axis_name: str = "tp",
                 batch_axes: str | Sequence[str] | None = None, mesh: Mesh | None = None,
                 dtype=None, param_dtype=jnp.float32, impl: str = "jaxtdist",
                 fp8: Fp8Recipe | str | None = None, rngs: nnx.Rngs):
        """``fp8``: an ``Fp8Recipe`` for gate, up and down (``jaxtdist.nn._linear``)."""
        self.layout = make_layout("ParallelMLP", mesh=mesh, axis_name=axis_name,
                                  batch_axes=batch_axes, impl=impl)
        self.d_model = d_model
        common = dict(axis_name=axis_name, batch_axes=self.layout.batch_axes,
                      mesh=self.layout.mesh, use_bias=use_bias, dtype=dtype,
                      param_dtype=param_dtype, impl=impl, fp8=fp8, rngs=rngs)
        self.gate_proj = ColumnParallelLinear(d_model, hidden, **common) if gated else None
        self.up_proj = ColumnParallelLinear(d_model, hidden, **common)
        self.down_proj = RowParallelLinear(hidden, d_model, **common)
        self.activation = activation

    def __call__(self, x: jax.Array, *, decode: bool = False) -> jax.Array:
        """x: [batch, seq, d_model]; ``decode``: [batch, 1, d_model], one token each."""
        lay = self.layout
        x, batch, seq, real = lay.pad_input(x, self.d_model, decode)  # rows independent
        tokens = lay.to_tokens(x, decode)
        if self.gate_proj is not None:
            gate, up = column_parallel((self.gate_proj, self.up_proj), tokens, decode=decode)
            h = self.activation(gate) * up
        else:
            (up,) = column_parallel((self.up_proj,), tokens, decode=decode)
            h = self.activation(up)
        return lay.unpad(lay.from_tokens(self.down_proj.project(h, decode=decode), batch, seq,
                                         decode), real)
