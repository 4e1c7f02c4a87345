"""Column- and row-parallel linear layers (the two halves of a tensor-parallel block).

Both are ``nnx.Linear`` look-alikes (``kernel`` [in, out], ``bias`` [out],
plain sharded ``nnx.Param``s) on [batch, seq, features] inputs. The column
layer gathers the sequence-parallel tokens while multiplying (``ag_matmul``),
the row layer multiplies and reduce-scatters back (``matmul_rs``), or
all-reduces in a decode step (``matmul_ar``). ``column_parallel`` runs several
column layers on one input with one gather (Q/K/V, gate/up).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxtdist.nn._layout import Layout, check_divisible, make_layout
from jaxtdist.ops import ag_matmul, matmul_ar_sharded, matmul_rs_sharded
from jaxtdist.ops._sharded import pjit_wrapper, rows_over

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "column_parallel"]


@functools.lru_cache(maxsize=None)
def _ag_matmul_many(count: int):
    """``ag_matmul(x, (w1, ..., w_count))`` on global arrays: one gather, one launch."""
    return pjit_wrapper(
        ag_matmul, name="nn.ag_matmul",
        in_specs=lambda axis, batch: (P(rows_over(axis, batch), None), (P(None, axis),) * count),
        out_specs=lambda axis, batch: (P(rows_over(None, batch), axis),) * count)


def _param(init, layout: Layout, spec: tuple, rngs: nnx.Rngs, shape, dtype) -> nnx.Param:
    """A parameter created sharded (never gathered onto one device first)."""
    return nnx.Param(nnx.with_partitioning(init, spec, mesh=layout.mesh)(
        rngs.params(), shape, dtype))


class ColumnParallelLinear(nnx.Module):
    """``y = x @ kernel + bias`` with the kernel's columns sharded over ``axis_name``.

    Input [batch, seq, in_features], any sharding (sequence parallel,
    ``P(batch_axes, axis_name, None)``, moves nothing); output [batch, seq,
    out_features] with features over ``axis_name`` (what a row-parallel layer
    takes). With ``decode=True`` x is [batch, 1, in_features] and every rank
    multiplies all tokens by its columns (nothing to gather).

    Example:
      >>> mesh = jax.make_mesh((2, 4), ("dp", "tp")); jaxtdist.initialize(mesh)
      >>> up = ColumnParallelLinear(512, 2048, rngs=nnx.Rngs(0))
      >>> h = nnx.jit(lambda m, x: m(x))(up, x)  # x: [batch, seq, 512]
    """

    def __init__(self, in_features: int, out_features: int, *, axis_name: str = "tp",
                 batch_axes: str | Sequence[str] | None = None, mesh: Mesh | None = None,
                 use_bias: bool = True, dtype=None, param_dtype=jnp.float32,
                 kernel_init=nnx.initializers.lecun_normal(), impl: str = "jaxtdist",
                 replicated_columns: int = 0, rngs: nnx.Rngs):
        """``replicated_columns``: the kernel is stored replicated and its columns,
        groups of this width, repeated until they divide over ``axis_name``
        (grouped-query K and V when the tensor-parallel size exceeds the KV heads,
        as Megatron does); 0: the columns are sharded."""
        self.layout = make_layout(type(self).__name__, mesh=mesh, axis_name=axis_name,
                                  batch_axes=batch_axes, impl=impl)
        self.in_features, self.out_features = in_features, out_features
        self.replicated_columns = replicated_columns
        if not replicated_columns:
            check_divisible(self.layout, "out_features", out_features)
        column = None if replicated_columns else axis_name
        self.dtype = dtype
        self.kernel = _param(kernel_init, self.layout, (None, column), rngs,
                             (in_features, out_features), param_dtype)
        self.bias = (_param(nnx.initializers.zeros, self.layout, (column,), rngs,
                            (out_features,), param_dtype) if use_bias else None)

    @property
    def local_width(self) -> int:
        """The global width of the product (the repeated columns included)."""
        if not self.replicated_columns:
            return self.out_features
        return max(self.out_features, self.layout.tp * self.replicated_columns)

    def _expanded(self, value: jax.Array, axis: int) -> jax.Array:
        """The kernel (or bias) with replicated column groups repeated to one group
        per rank, sharded over ``axis_name``: each rank slices its group (no data moves)."""
        if not self.replicated_columns or self.out_features >= self.local_width:
            return value
        lay, width = self.layout, self.replicated_columns
        groups = self.out_features // width
        shape = value.shape[:axis] + (groups, width)
        value = jnp.repeat(value.reshape(shape), lay.tp // groups, axis=axis)
        spec = P(None, lay.axis_name) if axis == 1 else P(lay.axis_name)
        return lay.reshape(value, value.shape[:axis] + (lay.tp * width,), spec)

    def weights(self, dtype) -> tuple[jax.Array, jax.Array | None]:
        """(kernel, bias) as the product uses them: cast, replicated columns repeated."""
        w = self._expanded(self.kernel[...].astype(dtype), 1)
        b = None if self.bias is None else self._expanded(self.bias[...].astype(dtype), 0)
        return w, b

    def __call__(self, x: jax.Array, *, decode: bool = False) -> jax.Array:
        x, batch, seq, real = self.layout.pad_input(x, self.in_features, decode)
        (y,) = column_parallel((self,), self.layout.to_tokens(x, decode), decode=decode)
        b = self.layout.batch_spec(batch)
        return self.layout.unpad(self.layout.unflatten(y, (batch, seq, y.shape[-1]),
                                                       P(b, None, self.layout.axis_name)), real)


def column_parallel(layers: Sequence[ColumnParallelLinear], tokens: jax.Array, *,
                    decode: bool = False) -> tuple[jax.Array, ...]:
    """Several column-parallel layers on the same tokens, gathered once.

    Args:
      layers: column-parallel layers of one layout and input width.
      tokens: [batch * seq, in_features] in the ops' layout (``Layout.to_tokens``).
      decode: the tokens are on every tensor-parallel rank (a local GEMM each).

    Returns:
      One [batch * seq, width_i] product per layer, features over ``axis_name``.
    """
    lay = layers[0].layout
    dtype = layers[0].dtype or tokens.dtype
    tokens = tokens.astype(dtype)
    weights = [layer.weights(dtype) for layer in layers]
    b = lay.batch_spec(tokens.shape[0]) if decode else lay.rows
    if decode or lay.impl == "xla":
        # Decode: every rank has the tokens. impl="xla": XLA gathers them itself.
        ys = tuple(lay.dot(tokens, w, P(b, lay.axis_name)) for w, _ in weights)
    else:
        ys = _ag_matmul_many(len(layers))(tokens, tuple(w for w, _ in weights),
                                          axis_name=lay.axis_name, batch_axes=lay.batch_axes)
    return tuple(y if bias is None else y + bias.astype(y.dtype)
                 for y, (_, bias) in zip(ys, weights))


class RowParallelLinear(nnx.Module):
    """``y = x @ kernel + bias`` with the kernel's rows sharded over ``axis_name``:
    each rank multiplies its features and the partial products are summed over
    the ranks, overlapped with the GEMM.

    Input [batch, seq, in_features] with features over ``axis_name`` (a
    column-parallel layer's output); output [batch, seq, out_features] sequence
    parallel (``matmul_rs``), or with ``decode=True`` ([batch, 1, in_features])
    on every rank (``matmul_ar``).

    Example:
      >>> down = RowParallelLinear(2048, 512, rngs=nnx.Rngs(0))
      >>> y = nnx.jit(lambda m, h: m(h))(down, h)  # h: [batch, seq, 2048]
    """

    def __init__(self, in_features: int, out_features: int, *, axis_name: str = "tp",
                 batch_axes: str | Sequence[str] | None = None, mesh: Mesh | None = None,
                 use_bias: bool = True, dtype=None, param_dtype=jnp.float32,
                 kernel_init=nnx.initializers.lecun_normal(), impl: str = "jaxtdist",
                 rngs: nnx.Rngs):
        self.layout = make_layout(type(self).__name__, mesh=mesh, axis_name=axis_name,
                                  batch_axes=batch_axes, impl=impl)
        check_divisible(self.layout, "in_features", in_features)
        self.in_features, self.out_features = in_features, out_features
        self.dtype = dtype
        self.kernel = _param(kernel_init, self.layout, (axis_name, None), rngs,
                             (in_features, out_features), param_dtype)
        self.bias = (_param(nnx.initializers.zeros, self.layout, (None,), rngs,
                            (out_features,), param_dtype) if use_bias else None)

    def project(self, h: jax.Array, *, decode: bool = False) -> jax.Array:
        """[tokens, in_features] (features over ``axis_name``) -> [tokens, out_features]
        in the ops' layout: sequence parallel, or with ``decode`` on every rank."""
        lay = self.layout
        dtype = self.dtype or h.dtype
        h, w = h.astype(dtype), self.kernel[...].astype(dtype)
        if lay.impl == "xla":  # XLA reduce-scatters or all-reduces the partial products
            rows = lay.batch_spec(h.shape[0]) if decode else lay.tokens
            y = lay.dot(h, w, P(rows, None))
        else:
            op = matmul_ar_sharded if decode else matmul_rs_sharded
            # A decode batch that does not divide over batch_axes is on every rank.
            batch_axes = (() if decode and lay.batch_spec(h.shape[0]) is None
                          else lay.batch_axes)
            y = op(h, w, axis_name=lay.axis_name, batch_axes=batch_axes)
        return y if self.bias is None else y + self.bias[...].astype(y.dtype)

    def __call__(self, x: jax.Array, *, decode: bool = False) -> jax.Array:
        lay = self.layout
        x, batch, seq, real = lay.pad_input(x, self.in_features, decode)
        b = lay.batch_spec(batch)
        spec = P(b, None, lay.axis_name)
        h = lay.flatten(lay.constrain(x, spec), spec, (batch * seq, self.in_features),
                        P(b, lay.axis_name))
        return lay.unpad(lay.from_tokens(self.project(h, decode=decode), batch, seq, decode),
                         real)
