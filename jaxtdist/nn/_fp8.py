"""FP8 recipes of the linear layers: blockwise inference and per-tensor training.

Two recipes (``Fp8Recipe.kind``):

- ``"blockwise"`` (inference, DeepSeek-V3's and the Hugging Face FP8
  checkpoints' scaling): the weight is stored in float8_e4m3fn, K-major
  ``weight`` [N, K], with ``weight_scale_inv`` [cdiv(N, 128), K / 128] float32
  dequantization multipliers (the checkpoints' names and layouts), as
  ``Fp8Weight`` variables (state, not trainable ``nnx.Param``s, never
  dequantized to 16 bits). Each call quantizes the activations per (row, 128
  columns) on the fly and runs the GEMM ops' FP8 path (``x_scale`` /
  ``w_scale``).
- ``"tensor"`` (training, TransformerEngine's hybrid current scaling): the
  master ``kernel`` stays an ``nnx.Param`` in ``param_dtype``; each call
  quantizes x and the kernel per tensor (their current amax) to float8_e4m3fn
  and multiplies them in FP8 with float32 accumulation; the backward pass
  quantizes the output gradient per tensor to float8_e5m2 and computes dx and
  dw with FP8 GEMMs too (``tensor_scaled_matmul``'s ``jax.custom_vjp``).

Example:
  >>> lin = ColumnParallelLinear(512, 2048, fp8=Fp8Recipe("blockwise"), rngs=nnx.Rngs(0))
  >>> lin.weight.shape, lin.weight_scale_inv.shape   # K-major FP8 and its scales
  ((2048, 512), (16, 4))
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtdist.ops._protocol import mark_varying, varying_axes
from jaxtdist.ops.quant import BLOCK, quantize

__all__ = ["Fp8Recipe", "Fp8Weight", "check_recipe", "tensor_scaled_matmul"]

KINDS = ("blockwise", "tensor")


@dataclasses.dataclass(frozen=True)
class Fp8Recipe:
    """How a layer computes in FP8.

    Attributes:
      kind: ``"blockwise"`` (inference: FP8 weights with 128 x 128 scales, 1 x 128
        activation scales) or ``"tensor"`` (training: master weights, per-tensor
        current scaling, e4m3 forward operands, e5m2 gradients).
      out_dtype: the GEMMs' output dtype; None (default): the layer's compute
        dtype (``dtype=``, else the input's), e.g. bfloat16 in a bfloat16 model.

    Example:
      >>> mlp = ParallelMLP(512, 2048, fp8=Fp8Recipe("tensor"), rngs=nnx.Rngs(0))
    """

    kind: str = "blockwise"
    out_dtype: object = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"jaxtdist.nn.Fp8Recipe: kind={self.kind!r}; allowed: 'blockwise' "
                             "(inference from FP8 weights with 128 x 128 scales) or 'tensor' "
                             "(training with per-tensor scaling)")
        if self.out_dtype is not None:
            out = jnp.dtype(self.out_dtype)
            if out not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16),
                           jnp.dtype(jnp.float32)):
                raise ValueError(f"jaxtdist.nn.Fp8Recipe: out_dtype={out.name}; allowed: "
                                 "bfloat16, float16, float32 or None (the layer's dtype)")
            object.__setattr__(self, "out_dtype", out.name)  # hashable, static

    @property
    def blockwise(self) -> bool:
        return self.kind == "blockwise"


class Fp8Weight(nnx.Variable):
    """An FP8 inference weight (K-major [N, K], float8_e4m3fn) or its float32
    ``weight_scale_inv``: module state that ``nnx.jit`` carries, not an
    ``nnx.Param`` (an optimizer over ``nnx.Param`` leaves it alone)."""


def check_recipe(layer: str, fp8) -> Fp8Recipe | None:
    """``fp8`` as a recipe: None, an ``Fp8Recipe``, or its kind as a string.

    Raises:
      ValueError: anything else, naming the layer.
    """
    if fp8 is None or isinstance(fp8, Fp8Recipe):
        return fp8
    if isinstance(fp8, str):
        return Fp8Recipe(fp8)
    raise ValueError(f"jaxtdist.nn.{layer}: fp8={fp8!r}; give None (no FP8), a "
                     "jaxtdist.nn.Fp8Recipe, or its kind 'blockwise' / 'tensor'")


def check_blockwise_width(layer: str, what: str, value: int, tp: int, axis: str,
                          sharded: bool) -> None:
    """Blockwise FP8 needs K a multiple of 128, and a sharded dimension's shard too:
    the 128 x 128 weight scales are sliced per rank, so a shard must hold whole
    blocks (else one block's scale would straddle two ranks)."""
    if what.startswith("in_features") and value % BLOCK:
        raise ValueError(f"jaxtdist.nn.{layer}: fp8 kind 'blockwise' needs {what}={value} (the "
                         f"GEMM's K) a multiple of {BLOCK} (1 x 128 activation and 128 x 128 "
                         "weight scales); use fp8=None or Fp8Recipe('tensor') for this layer")
    if sharded and tp > 1 and (value // tp) % BLOCK:
        raise ValueError(f"jaxtdist.nn.{layer}: fp8 kind 'blockwise' shards {what}={value} over "
                         f"the {tp} ranks of mesh axis {axis!r}: {value // tp} each, not a "
                         f"multiple of {BLOCK}, so the 128 x 128 weight scales cannot be split "
                         "per rank; use a tensor-parallel size that leaves whole 128 blocks "
                         "per rank, or fp8=None / Fp8Recipe('tensor')")


# -- the training GEMM: per-tensor current scaling, FP8 forward and backward ------------

_E4M3, _E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2


def _dot(a, b, contract):
    """An FP8 (or mixed e5m2 x e4m3) dot, float32 accumulation: cuBLASLt's FP8 GEMM
    on Hopper."""
    return jax.lax.dot_general(a, b, (contract, ((), ())), preferred_element_type=jnp.float32)


@functools.lru_cache(maxsize=None)
def _scaled_matmul(out_dtype: str, x_dtype: str, w_dtype: str):
    """The custom_vjp of ``tensor_scaled_matmul`` for these dtypes (the cotangents
    must come back in the primals' dtypes)."""

    @jax.custom_vjp
    def f(x, w):
        return fwd(x, w)[0]

    def fwd(x, w):
        qx, sx = quantize(x, _E4M3)
        # K-major weight [N, K]: the layout 8-bit tensor cores read (one transpose
        # of the master weight per step, fused into its quantization).
        qw, sw = quantize(w.T, _E4M3)
        y = (_dot(qx, qw, ((1,), (1,))) * (sx * sw)).astype(out_dtype)
        return y, (qx, sx, qw, sw)  # FP8 residuals: a quarter of float32's bytes

    def bwd(res, dy):
        qx, sx, qw, sw = res
        # e5m2: gradients need range more than precision (TransformerEngine's hybrid).
        qdy, sdy = quantize(dy, _E5M2)
        dx = _dot(qdy, qw, ((1,), (0,))) * (sdy * sw)   # [M, N] . [N, K] -> [M, K]
        dw = _dot(qx, qdy, ((0,), (0,))) * (sx * sdy)   # [M, K] . [M, N] -> [K, N]
        return dx.astype(x_dtype), dw.astype(w_dtype)

    f.defvjp(fwd, bwd)
    return f


def tensor_scaled_matmul(x: jax.Array, w: jax.Array, out_dtype=None) -> jax.Array:
    """``x @ w`` in FP8 with per-tensor current scaling, differentiable.

    Forward: x and w quantized to float8_e4m3fn with scales of their amax, an FP8
    GEMM accumulating in float32, times both scales. Backward: the output
    gradient quantized to float8_e5m2 with its amax, ``dx = dy @ w.T`` and
    ``dw = x.T @ dy`` as FP8 GEMMs of the e5m2 gradient with the forward's e4m3
    operands (kept as residuals).

    Args:
      x: [M, K] activations (any float dtype).
      w: [K, N] master weight (any float dtype).
      out_dtype: the result's dtype (default x's).

    Example:
      >>> y, grads = jax.value_and_grad(lambda x, w: tensor_scaled_matmul(x, w).sum(),
      ...                               argnums=(0, 1))(x, w)
    """
    out = jnp.dtype(out_dtype or x.dtype).name
    vx, vw = varying_axes(x), varying_axes(w)
    if vx is not None and vw is not None and vx != vw:
        # Inside shard_map: both operands typed as varying over the same axes before
        # the custom_vjp, so that dw (which varies with x over the batch axes) has
        # w's type; the transpose of this cast sums dw over those axes.
        axes = tuple(sorted(vx | vw))
        x, w = mark_varying(x, axes), mark_varying(w, axes)
    return _scaled_matmul(out, jnp.dtype(x.dtype).name, jnp.dtype(w.dtype).name)(x, w)
