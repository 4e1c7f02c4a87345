"""Column- and row-parallel linear layers (the two halves of a tensor-parallel block).

Both are ``nnx.Linear`` look-alikes (``kernel`` [in, out], ``bias`` [out],
plain sharded ``nnx.Param``s) on [batch, seq, features] inputs. The column
layer gathers the sequence-parallel tokens while multiplying (``ag_matmul``),
the row layer multiplies and reduce-scatters back (``matmul_rs``), or
all-reduces in a decode step (``matmul_ar``). ``column_parallel`` runs several
column layers on one input with one gather (Q/K/V, gate/up).

``fp8=`` (an ``Fp8Recipe``, ``jaxtdist.nn._fp8``): "blockwise" stores the weight
in FP8, K-major ``weight`` [out, in] with ``weight_scale_inv`` (Hugging Face's
FP8 names and layouts, no ``kernel``), and runs the ops' FP8 path; "tensor"
keeps the ``kernel`` and multiplies in FP8 with per-tensor scaling, forward
and backward. None (default): 16/32-bit, as without the argument.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxtdist.nn._fp8 import (Fp8Recipe, Fp8Weight, check_blockwise_width, check_recipe,
                              tensor_scaled_matmul)
from jaxtdist.nn._layout import Layout, check_divisible, make_layout
from jaxtdist.ops import ag_matmul, matmul_ar, matmul_ar_sharded, matmul_rs, matmul_rs_sharded
from jaxtdist.ops._sharded import pjit_wrapper, rows_over
from jaxtdist.ops.quant import BLOCK, dequantize, quantize, quantize_weight

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


def _fp8_weight(init, layout: Layout, spec: tuple, rngs: nnx.Rngs, shape,
                dtype) -> tuple[Fp8Weight, Fp8Weight]:
    """(weight, weight_scale_inv) of a blockwise FP8 layer: a kernel [K, N] drawn from
    ``init`` (sharded as ``spec``) and quantized shard by shard, K-major [N, K] with
    128 x 128 scales (the shards hold whole blocks: ``check_blockwise_width``), so
    a fresh layer computes; ``load_hf_llama`` overwrites both from a checkpoint."""
    kernel = _param(init, layout, spec, rngs, shape, dtype)[...]
    t_spec = P(*reversed(spec))
    w, s = jax.jit(jax.shard_map(quantize_weight, mesh=layout.mesh, in_specs=P(*spec),
                                 out_specs=(t_spec, t_spec)))(kernel)
    names = tuple(reversed(spec))
    return (Fp8Weight(w, out_sharding=names, mesh=layout.mesh),
            Fp8Weight(s, out_sharding=names, mesh=layout.mesh))


def _check_fp8(layer: str, fp8, layout: Layout, in_features: int, out_features: int,
               sharded: str) -> Fp8Recipe | None:
    """The layer's recipe (``check_recipe``), with the blockwise shape rules: K a
    multiple of 128, the ``sharded`` dimension ("in" or "out") whole 128 blocks per rank."""
    fp8 = check_recipe(layer, fp8)
    if fp8 is not None and fp8.blockwise:
        check_blockwise_width(layer, "in_features", in_features, layout.tp, layout.axis_name,
                              sharded == "in")
        check_blockwise_width(layer, "out_features", out_features, layout.tp,
                              layout.axis_name, sharded == "out")
    return fp8


def _fp8_ag_body(x, *ws, axis_name, out_dtype):
    """Blockwise FP8 ``ag_matmul`` of one rank: its rows quantized per (row, 128
    columns), then one gather for all weights where their scales can be stacked
    (every weight but the last of whole 128-row blocks), else one call each."""
    qx, sx = quantize(x, block=(1, BLOCK))
    weights, scales = ws[::2], ws[1::2]
    kw = dict(x_scale=sx, out_dtype=out_dtype)
    if len(weights) > 1 and all(w.shape[0] % BLOCK == 0 for w in weights[:-1]):
        y = ag_matmul(qx, jnp.concatenate(weights), axis_name,
                      w_scale=jnp.concatenate(scales), **kw)
        return tuple(jnp.split(y, np.cumsum([w.shape[0] for w in weights])[:-1].tolist(), 1))
    return tuple(ag_matmul(qx, w, axis_name, w_scale=s, **kw) for w, s in zip(weights, scales))


@functools.lru_cache(maxsize=None)
def _fp8_ag_matmul_many(count: int):
    """``_fp8_ag_body`` on global arrays: tokens, then (weight, scale) per layer."""
    return pjit_wrapper(
        _fp8_ag_body, name="nn.ag_matmul_fp8",
        in_specs=lambda axis, batch: (P(rows_over(axis, batch), None),) + (P(axis, None),) * (
            2 * count),
        out_specs=lambda axis, batch: (P(rows_over(None, batch), axis),) * count)


def _fp8_rs_body(h, w, s, *, axis_name, out_dtype, decode):
    """Blockwise FP8 ``matmul_rs`` (``decode``: ``matmul_ar``) of one rank's features,
    quantized per (row, 128 columns) here."""
    qh, sh = quantize(h, block=(1, BLOCK))
    op = matmul_ar if decode else matmul_rs
    return op(qh, w, axis_name, x_scale=sh, w_scale=s, out_dtype=out_dtype)


_fp8_matmul_rs = pjit_wrapper(
    functools.partial(_fp8_rs_body, decode=False), name="nn.matmul_rs_fp8",
    in_specs=lambda axis, batch: (P(rows_over(None, batch), axis),) + (P(None, axis),) * 2,
    out_specs=lambda axis, batch: P(rows_over(axis, batch), None))
_fp8_matmul_ar = pjit_wrapper(
    functools.partial(_fp8_rs_body, decode=True), name="nn.matmul_ar_fp8",
    in_specs=lambda axis, batch: (P(rows_over(None, batch), axis),) + (P(None, axis),) * 2,
    out_specs=lambda axis, batch: P(rows_over(None, batch), None))


def _local(lay: Layout, fn, in_specs, out_specs, *args):
    """``fn`` on each rank's shards (no communication inside unless ``fn`` has it);
    the arguments placed as ``in_specs`` first (Explicit axes take nothing else)."""
    args = tuple(lay.constrain(a, s) for a, s in zip(args, in_specs))
    return jax.shard_map(fn, mesh=lay.mesh, in_specs=tuple(in_specs),
                         out_specs=out_specs)(*args)


def _fake_quantized(lay: Layout, x: jax.Array, spec: P) -> jax.Array:
    """x quantized per (row, 128 columns) and dequantized, float32, on each rank (the
    activations the blockwise FP8 GEMM sees; XLA's path multiplies these)."""
    return _local(lay, lambda a: dequantize(*quantize(a, block=(1, BLOCK))), (spec,), spec, x)


def _dequantized_kernel(lay: Layout, w: jax.Array, s: jax.Array, spec: P) -> jax.Array:
    """The [K, N] float32 kernel of a K-major FP8 weight [N, K] sharded ``spec``, shard by
    shard (XLA's path: no FP8 blockwise GEMM there)."""
    return _local(lay, lambda w, s: dequantize(w, s).T, (spec, spec), P(*reversed(spec)), w, s)


_HIGHEST = jax.lax.Precision.HIGHEST


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
                 replicated_columns: int = 0, fp8: Fp8Recipe | str | None = None,
                 rngs: nnx.Rngs):
        """``replicated_columns``: the kernel is stored replicated and its columns,
        groups of this width, repeated until they divide over ``axis_name``
        (grouped-query K and V when the tensor-parallel size exceeds the KV heads,
        as Megatron does); 0: the columns are sharded. ``fp8``: an ``Fp8Recipe``
        (see the module docstring), None for none."""
        name = type(self).__name__
        self.layout = make_layout(name, mesh=mesh, axis_name=axis_name,
                                  batch_axes=batch_axes, impl=impl)
        self.in_features, self.out_features = in_features, out_features
        self.replicated_columns = replicated_columns
        if not replicated_columns:
            check_divisible(self.layout, "out_features", out_features)
        self.fp8 = check_recipe(name, fp8)
        if self.fp8 is not None and self.fp8.blockwise and replicated_columns:
            raise ValueError(f"jaxtdist.nn.{name}: fp8 kind 'blockwise' with replicated columns "
                             f"(KV heads repeated over the {self.layout.tp} ranks of "
                             f"{axis_name!r}) is not supported: its 128 x 128 weight scales "
                             "cannot follow the repeated column groups; use a tensor-parallel "
                             "size that divides the KV heads, or fp8=Fp8Recipe('tensor')")
        self.fp8 = _check_fp8(name, self.fp8, self.layout, in_features, out_features, "out")
        column = None if replicated_columns else axis_name
        self.dtype, self.param_dtype = dtype, param_dtype
        if self.fp8 is not None and self.fp8.blockwise:
            self.weight, self.weight_scale_inv = _fp8_weight(
                kernel_init, self.layout, (None, column), rngs, (in_features, out_features),
                param_dtype)
        else:
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
        """(kernel, bias) as the product uses them: cast, replicated columns repeated
        (a blockwise FP8 layer has no kernel: see ``weight`` and ``weight_scale_inv``)."""
        w = None if self.fp8 is not None and self.fp8.blockwise else self._expanded(
            self.kernel[...].astype(dtype), 1)
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
    fp8 = layers[0].fp8
    if any(layer.fp8 != fp8 for layer in layers):
        raise ValueError(f"jaxtdist.nn.column_parallel: the layers have fp8 recipes "
                         f"{[layer.fp8 for layer in layers]}; layers sharing one gather take "
                         "one recipe: build them with the same fp8=")
    if fp8 is not None:
        ys = _fp8_columns(layers, tokens, fp8, dtype, decode)
    elif decode or lay.impl == "xla":
        # Decode: every rank has the tokens. impl="xla": XLA gathers them itself.
        ys = tuple(lay.dot(tokens, w, P(b, lay.axis_name)) for w, _ in weights)
    else:
        ys = _ag_matmul_many(len(layers))(tokens, tuple(w for w, _ in weights),
                                          axis_name=lay.axis_name, batch_axes=lay.batch_axes)
    return tuple(y if bias is None else y + bias.astype(y.dtype)
                 for y, (_, bias) in zip(ys, weights))


def _fp8_columns(layers, tokens: jax.Array, fp8: Fp8Recipe, dtype,
                 decode: bool) -> tuple[jax.Array, ...]:
    """``column_parallel``'s products under an FP8 recipe (see the module docstring)."""
    lay = layers[0].layout
    out = jnp.dtype(fp8.out_dtype or dtype)
    rows_in = lay.batch_spec(tokens.shape[0]) if decode else lay.tokens
    rows_out = lay.batch_spec(tokens.shape[0]) if decode else lay.rows
    cols = P(None, lay.axis_name)
    if not fp8.blockwise:
        # Training: FP8 GEMMs with per-tensor scales, forward and backward, inside a
        # shard_map whose gather is XLA's (its transpose, the reduce-scatter of dx,
        # too): the overlapped ops' FP8 path has no backward pass.
        kernels = [layer.weights(dtype)[0] for layer in layers]

        def body(x, *ws):
            if not decode:
                x = jax.lax.all_gather(x, lay.axis_name, axis=0, tiled=True)
            return tuple(tensor_scaled_matmul(x, w, out) for w in ws)

        return _local(lay, body, (P(rows_in, None),) + (cols,) * len(kernels),
                      (P(rows_out, lay.axis_name),) * len(kernels), tokens, *kernels)
    stored = [(layer.weight[...], layer.weight_scale_inv[...]) for layer in layers]
    if lay.impl == "jaxtdist" and not decode:
        flat = [a for pair in stored for a in pair]
        return _fp8_ag_matmul_many(len(layers))(tokens, *flat, axis_name=lay.axis_name,
                                                 batch_axes=lay.batch_axes, out_dtype=out)
    # Decode (every rank has its tokens) and impl="xla" (XLA gathers): the float32
    # product of the dequantized operands, what the FP8 kernels compute.
    x = _fake_quantized(lay, tokens, P(rows_in, None))
    return tuple(lay.dot(x, _dequantized_kernel(lay, w, s, P(lay.axis_name, None)),
                         P(rows_out, lay.axis_name), precision=_HIGHEST).astype(out)
                 for w, s in stored)


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
                 fp8: Fp8Recipe | str | None = None, rngs: nnx.Rngs):
        name = type(self).__name__
        self.layout = make_layout(name, mesh=mesh, axis_name=axis_name,
                                  batch_axes=batch_axes, impl=impl)
        check_divisible(self.layout, "in_features", in_features)
        self.in_features, self.out_features = in_features, out_features
        self.fp8 = _check_fp8(name, fp8, self.layout, in_features, out_features, "in")
        self.dtype, self.param_dtype = dtype, param_dtype
        if self.fp8 is not None and self.fp8.blockwise:
            self.weight, self.weight_scale_inv = _fp8_weight(
                kernel_init, self.layout, (axis_name, None), rngs, (in_features, out_features),
                param_dtype)
        else:
            self.kernel = _param(kernel_init, self.layout, (axis_name, None), rngs,
                                 (in_features, out_features), param_dtype)
        self.bias = (_param(nnx.initializers.zeros, self.layout, (None,), rngs,
                            (out_features,), param_dtype) if use_bias else None)

    def project(self, h: jax.Array, *, decode: bool = False) -> jax.Array:
        """[tokens, in_features] (features over ``axis_name``) -> [tokens, out_features]
        in the ops' layout: sequence parallel, or with ``decode`` on every rank."""
        lay = self.layout
        dtype = self.dtype or h.dtype
        if self.fp8 is not None:
            y = self._fp8_project(h.astype(dtype), dtype, decode)
            return y if self.bias is None else y + self.bias[...].astype(y.dtype)
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

    def _fp8_project(self, h: jax.Array, dtype, decode: bool) -> jax.Array:
        """``project``'s product under the layer's FP8 recipe."""
        lay, fp8 = self.layout, self.fp8
        out = jnp.dtype(fp8.out_dtype or dtype)
        rows = lay.batch_spec(h.shape[0]) if decode else lay.rows
        # As project: a decode batch that does not divide over batch_axes is on every rank.
        batch_axes = () if decode and rows is None else lay.batch_axes
        if not fp8.blockwise:
            # Training: per-rank FP8 partials (per-tensor scales), summed in float32
            # by XLA's reduce-scatter (all-reduce in decode), differentiable.
            def body(h, w):
                y = tensor_scaled_matmul(h, w, jnp.float32)
                y = (jax.lax.psum(y, lay.axis_name) if decode else
                     jax.lax.psum_scatter(y, lay.axis_name, scatter_dimension=0, tiled=True))
                return y.astype(out)

            rows_out = rows if decode else lay.tokens
            return _local(lay, body, (P(rows, lay.axis_name), P(lay.axis_name, None)),
                          P(rows_out, None), h, self.kernel[...].astype(dtype))
        w, s = self.weight[...], self.weight_scale_inv[...]
        if lay.impl == "jaxtdist":
            op = _fp8_matmul_ar if decode else _fp8_matmul_rs
            return op(h, w, s, axis_name=lay.axis_name, batch_axes=batch_axes, out_dtype=out)
        hq = _fake_quantized(lay, h, P(rows, lay.axis_name))
        rows_out = lay.batch_spec(h.shape[0]) if decode else lay.tokens
        return lay.dot(hq, _dequantized_kernel(lay, w, s, P(None, lay.axis_name)),
                       P(rows_out, None), precision=_HIGHEST).astype(out)

    def __call__(self, x: jax.Array, *, decode: bool = False) -> jax.Array:
        lay = self.layout
        x, batch, seq, real = lay.pad_input(x, self.in_features, decode)
        b = lay.batch_spec(batch)
        spec = P(b, None, lay.axis_name)
        h = lay.flatten(lay.constrain(x, spec), spec, (batch * seq, self.in_features),
                        P(b, lay.axis_name))
        return lay.unpad(lay.from_tokens(self.project(h, decode=decode), batch, seq, decode),
                         real)
