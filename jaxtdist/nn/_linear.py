"""Column- and row-parallel linear layers (the two halves of a tensor-parallel block)."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxtdist.ops import ag_matmul_sharded, matmul_ar_sharded, matmul_rs_sharded
from jaxtdist.runtime._runtime import runtime


def group_size(axis_name: str) -> int:
    """The size of mesh axis ``axis_name`` of the mesh jaxtdist was initialized with."""
    mesh = runtime().mesh
    if axis_name not in mesh.axis_names:
        raise ValueError(f"jaxtdist.nn: axis_name {axis_name!r} is not an axis of the mesh "
                         f"given to jaxtdist.initialize, whose axes are "
                         f"{tuple(mesh.axis_names)}")
    return int(mesh.shape[axis_name])


def check_divisible(layer: str, what: str, value: int, axis_name: str) -> None:
    size = group_size(axis_name)
    if value % size:
        raise ValueError(f"jaxtdist.nn.{layer}: {what}={value} must be divisible by the size "
                         f"{size} of mesh axis {axis_name!r} (each rank holds an equal part)")


def check_impl(layer: str, impl: str) -> str:
    if impl not in ("jaxtdist", "xla"):
        raise ValueError(f"jaxtdist.nn.{layer}: impl={impl!r}; allowed: 'jaxtdist' (the "
                         "overlapped ops), 'xla' (the same layer with XLA's collectives: "
                         "a reference with the same parameters)")
    return impl


def _batch_axes(batch_axes: str | Sequence[str]) -> tuple[str, ...]:
    return (batch_axes,) if isinstance(batch_axes, str) else tuple(batch_axes)


def _rows(axes: tuple[str, ...]):
    """A PartitionSpec entry for rows sharded over ``axes`` (None: replicated)."""
    return None if not axes else axes[0] if len(axes) == 1 else axes


def _mesh():
    """The mesh jaxtdist was initialized with: parameters are created sharded on it."""
    return runtime().mesh


def _named(spec: P) -> NamedSharding:
    return NamedSharding(_mesh(), spec)


def _explicit(x: jax.Array) -> bool:
    """Whether x's mesh has explicit axes (``jax.make_mesh``'s default): there
    shardings are part of the types and ``with_sharding_constraint`` refuses them."""
    mesh = getattr(jax.typeof(x).sharding, "mesh", None)
    types = getattr(mesh, "axis_types", ()) or ()
    return any(t == jax.sharding.AxisType.Explicit for t in types)


def _dot(x: jax.Array, w: jax.Array, spec: P) -> jax.Array:
    """``x @ w`` with the result sharded ``spec``: a sharding constraint (XLA moves
    the data), or on explicit axes the dot's ``out_sharding``."""
    if _explicit(x) or _explicit(w):
        return jnp.dot(x, w, out_sharding=_named(spec))
    return jax.lax.with_sharding_constraint(jnp.dot(x, w), _named(spec))


class ColumnParallelLinear(nnx.Module):
    """``y = x @ w + b`` with w's columns sharded over ``axis_name``; the tokens of x
    are all-gathered over ``axis_name`` while multiplying (``ag_matmul``).

    Input [tokens, in_features], tokens sharded over ``(*batch_axes, axis_name)``;
    output [tokens, out_features], tokens over ``batch_axes`` and features over
    ``axis_name`` (what a row-parallel layer takes).

    Example:
      >>> up = ColumnParallelLinear(512, 2048, batch_axes=("dp",), rngs=nnx.Rngs(0))
      >>> h = up(x)  # x: [tokens, 512] P(("dp", "tp"), None) -> [tokens, 2048] P("dp", "tp")
    """

    def __init__(self, in_features: int, out_features: int, *, axis_name: str = "tp",
                 batch_axes: str | Sequence[str] = (), use_bias: bool = True,
                 dtype=None, param_dtype=jnp.float32,
                 kernel_init=nnx.initializers.lecun_normal(), impl: str = "jaxtdist",
                 rngs: nnx.Rngs):
        check_divisible("ColumnParallelLinear", "out_features", out_features, axis_name)
        self.impl = check_impl("ColumnParallelLinear", impl)
        self.axis_name = axis_name
        self.batch_axes = _batch_axes(batch_axes)
        self.dtype = dtype
        self.kernel = nnx.Param(nnx.with_partitioning(kernel_init, (None, axis_name), mesh=_mesh())(
            rngs.params(), (in_features, out_features), param_dtype))
        zeros = nnx.with_partitioning(nnx.initializers.zeros, (axis_name,), mesh=_mesh())
        self.bias = (nnx.Param(zeros(rngs.params(), (out_features,), param_dtype))
                     if use_bias else None)

    def __call__(self, x: jax.Array, *, replicated_tokens: bool = False) -> jax.Array:
        """``replicated_tokens``: x's tokens are already on every ``axis_name`` rank
        (decode): a local GEMM with this rank's columns, nothing to gather."""
        dtype = self.dtype or x.dtype
        w = self.kernel[...].astype(dtype)
        if replicated_tokens or self.impl == "xla":
            # XLA gathers the tokens itself where they are sharded (impl="xla").
            y = _dot(x.astype(dtype), w, P(_rows(self.batch_axes), self.axis_name))
        else:
            y = ag_matmul_sharded(x.astype(dtype), w, axis_name=self.axis_name,
                                  batch_axes=self.batch_axes)
        return y if self.bias is None else y + self.bias[...].astype(y.dtype)


class RowParallelLinear(nnx.Module):
    """``y = x @ w + b`` with w's rows sharded over ``axis_name``: each rank
    multiplies its features and the partial products are summed over the
    ranks, overlapped with the GEMM.

    Input [tokens, in_features], tokens over ``batch_axes`` and features over
    ``axis_name``. ``reduce="scatter"`` (training, prefill): ``matmul_rs``, the
    output's tokens sharded over ``(*batch_axes, axis_name)`` (sequence
    parallel); ``reduce="all"`` (decode, where every rank holds all tokens):
    ``matmul_ar``, the output replicated over ``axis_name``.

    Example:
      >>> down = RowParallelLinear(2048, 512, batch_axes=("dp",), rngs=nnx.Rngs(0))
      >>> y = down(h)  # [tokens, 2048] P("dp", "tp") -> [tokens, 512] P(("dp", "tp"), None)
    """

    def __init__(self, in_features: int, out_features: int, *, axis_name: str = "tp",
                 batch_axes: str | Sequence[str] = (), use_bias: bool = True,
                 reduce: str = "scatter", dtype=None, param_dtype=jnp.float32,
                 kernel_init=nnx.initializers.lecun_normal(), impl: str = "jaxtdist",
                 rngs: nnx.Rngs):
        check_divisible("RowParallelLinear", "in_features", in_features, axis_name)
        self.impl = check_impl("RowParallelLinear", impl)
        if reduce not in ("scatter", "all"):
            raise ValueError(f"jaxtdist.nn.RowParallelLinear: reduce={reduce!r}; allowed: "
                             "'scatter' (matmul_rs: tokens come back sharded), 'all' "
                             "(matmul_ar: every rank gets every token)")
        self.axis_name = axis_name
        self.batch_axes = _batch_axes(batch_axes)
        self.reduce = reduce
        self.dtype = dtype
        self.kernel = nnx.Param(nnx.with_partitioning(kernel_init, (axis_name, None), mesh=_mesh())(
            rngs.params(), (in_features, out_features), param_dtype))
        self.bias = nnx.Param(nnx.with_partitioning(nnx.initializers.zeros, (None,), mesh=_mesh())(
            rngs.params(), (out_features,), param_dtype)) if use_bias else None

    def __call__(self, x: jax.Array, *, reduce: str | None = None) -> jax.Array:
        """``reduce`` overrides the layer's choice for this call ("scatter" or "all")."""
        reduce = reduce or self.reduce
        dtype = self.dtype or x.dtype
        x, w = x.astype(dtype), self.kernel[...].astype(dtype)
        if self.impl == "xla":  # XLA reduce-scatters or all-reduces the partial products
            rows = self.batch_axes + ((self.axis_name,) if reduce == "scatter" else ())
            y = _dot(x, w, P(_rows(rows), None))
        else:
            op = matmul_rs_sharded if reduce == "scatter" else matmul_ar_sharded
            y = op(x, w, axis_name=self.axis_name, batch_axes=self.batch_axes)
        return y if self.bias is None else y + self.bias[...].astype(y.dtype)
