"""jaxtdist.matmul_rs and jaxtdist.matmul_ar: GEMMs fused with the reduction of
their partial products over the ranks of a group.

- ``matmul_rs(x, w)``: ``psum_scatter(x @ w, scatter_dimension=0, tiled=True)``,
  the row-parallel layer of a tensor-parallel MLP; finished tiles are pushed
  to the rank owning their rows and reduced there while later tiles compute
  (``kernels/matmul_rs.py``).
- ``matmul_ar(x, w)``: ``psum(x @ w)`` for small M (decode): every tile's
  partial goes to every peer, each rank sums (``kernels/matmul_ar.py``).

The kernels' launches, configs and shapes are in ``_partial_sums``; here are
the ops: forward, backward and the local computation, on ``DistributedOp``
(program order, autodiff, world 1) and ``pjit_wrapper`` (the pjit-style forms).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxtdist.ops._fp8_gemm import (Fp8Gemm, check_block_k, fp8_plan, kernel_scales,
                                    local_matmul, logical_weight, no_gradient)
from jaxtdist.ops._gemm_paths import MATMUL_AR_PATH, MATMUL_RS_PATH
from jaxtdist.ops._op import DistributedOp, one_call_per_element
from jaxtdist.ops._partial_sums import (MatmulArConfig, MatmulRsConfig, _ar_check, _rs_check,
                                        ar_launch, matmul_ar_kernels, matmul_rs_kernels,
                                        resolved_config, rs_launch)
from jaxtdist.ops._protocol import Call, check_axis, varying_axes
from jaxtdist.ops._sharded import pjit_wrapper, rows_over
from jaxtdist.ops.ag_matmul import _AG_MATMUL_FP8, ag_matmul_with_gathered
from jaxtdist.ops.all_reduce import all_reduce
from jaxtdist.runtime._runtime import runtime

__all__ = ["MatmulArConfig", "MatmulRsConfig", "fp8_matmul_kernels", "matmul_ar",
           "matmul_ar_kernels", "matmul_ar_sharded", "matmul_rs", "matmul_rs_kernels",
           "matmul_rs_sharded"]

# -- matmul_rs -------------------------------------------------------------------

def _rs_forward(x, w, *, axis_name, config=None):
    return rs_launch(x, w, axis_name, config=config), (x, w)


def _rs_backward(residuals, dy, *, axis_name, config=None):
    del config
    x, w = residuals
    # dx = all_gather(dy) @ w^T, the gather overlapped with the GEMM; the
    # gathered dy serves dw = x^T @ all_gather(dy).
    dx, gathered = one_call_per_element(
        lambda a, b: ag_matmul_with_gathered(a, b, axis_name))(dy, w.T)
    dw = jnp.dot(x.T, gathered, preferred_element_type=jnp.float32)
    return dx, dw


def _local(x, w, *, axis_name, config=None):
    del axis_name, config
    return jnp.dot(x, w)


def _rs_check_config(x, w, *, axis_name, config):
    resolved_config(MatmulRsConfig, Call("matmul_rs", axis_name), x, w, axis_name, config)


def _ar_check_config(x, w, *, axis_name, config):
    resolved_config(MatmulArConfig, Call("matmul_ar", axis_name), x, w, axis_name, config)


def _rs_decomposed(x, w, *, axis_name, config=None):
    # World > 1 where the kernels cannot win (``_gemm_paths``): the dot, then XLA's.
    del config
    return jax.lax.psum_scatter(jnp.dot(x, w), axis_name, scatter_dimension=0, tiled=True)


def _ar_decomposed(x, w, *, axis_name, config=None):
    del config
    return jax.lax.psum(jnp.dot(x, w), axis_name)


# -- FP8 (``_fp8_gemm``): checked by the public functions, no backward ------------------
# Variants: jaxtdist.explain's name lookup finds the 16/32-bit ops.

def _fp8_local(x, w, x_scale, w_scale, *, axis_name, config=None, plan: Fp8Gemm):
    del axis_name, config
    return local_matmul(x, w, x_scale, w_scale, plan)


def _fp8_rs_forward(x, w, x_scale, w_scale, *, axis_name, config=None, plan: Fp8Gemm):
    scales = kernel_scales(plan, x_scale, x.shape[0], w_scale)
    return rs_launch(x, w, axis_name, config=config, fp8=(plan, *scales)), None


def _fp8_ar_forward(x, w, x_scale, w_scale, *, axis_name, config=None, plan: Fp8Gemm):
    scales = kernel_scales(plan, x_scale, x.shape[0], w_scale)
    return ar_launch(x, w, axis_name, config=config, fp8=(plan, *scales)), None


def _fp8_check_config(op: str, config_type: type):
    def check(x, w, x_scale, w_scale, *, axis_name, config, plan: Fp8Gemm):
        del x_scale, w_scale
        _, cfg = resolved_config(config_type, Call(op, axis_name), x, logical_weight(w),
                                 axis_name, config)
        check_block_k(op, plan, cfg.BLOCK_K)
    return check


_MATMUL_RS_FP8 = DistributedOp("matmul_rs", forward=_fp8_rs_forward, local=_fp8_local,
                               check_config=_fp8_check_config("matmul_rs", MatmulRsConfig),
                               variant="fp8")
_MATMUL_AR_FP8 = DistributedOp("matmul_ar", forward=_fp8_ar_forward, local=_fp8_local,
                               reduces=True, variant="fp8",
                               check_config=_fp8_check_config("matmul_ar", MatmulArConfig))


_MATMUL_RS = DistributedOp("matmul_rs", forward=_rs_forward, backward=_rs_backward,
                           check=_rs_check, local=_local, check_config=_rs_check_config,
                           decomposed=_rs_decomposed, path=MATMUL_RS_PATH)


def _fp8_call(op: str, fp8_op: DistributedOp, x, w, axis_name, config, x_scale, w_scale,
              out_dtype):
    """The FP8 op's call, or None where x and w are not FP8 (and no scale is given)."""
    plan = fp8_plan(op, x, w, x_scale, w_scale, out_dtype)
    if plan is None:
        return None
    if op == "matmul_rs":
        world = check_axis(runtime(), axis_name, op).world
        if x.shape[0] % world:
            raise ValueError(f"jaxtdist.matmul_rs: the rows of x (M={x.shape[0]}) must be "
                             f"divisible by the group size W={world} over {axis_name!r}: each "
                             "rank gets M / W rows of the sum (as psum_scatter requires)")
    args = no_gradient(op, x, w, x_scale, w_scale)
    return fp8_op(*args, axis_name=axis_name, config=config, plan=plan)


def fp8_matmul_kernels(op: str, x: jax.Array, w: jax.Array, axis_name, *,
                       x_scale: jax.Array, w_scale: jax.Array, out_dtype=None,
                       config: dict | None = None) -> jax.Array:
    """The FP8 kernels of ``op`` ("ag_matmul", "matmul_rs" or "matmul_ar"), at world 1
    too (benchmarks, tests), with the op's checks; not differentiable.

    Example:
      >>> y = fp8_matmul_kernels("matmul_rs", q, w_t, "tp", x_scale=s, w_scale=w_s)
    """
    ops = {"ag_matmul": _AG_MATMUL_FP8, "matmul_rs": _MATMUL_RS_FP8,
           "matmul_ar": _MATMUL_AR_FP8}
    if op not in ops:
        raise ValueError(f"jaxtdist.fp8_matmul_kernels: op={op!r}; use one of {sorted(ops)}")
    x, w = jnp.asarray(x), jnp.asarray(w)
    plan = fp8_plan(op, x, w, x_scale, w_scale, out_dtype)
    if plan is None:
        raise ValueError(f"jaxtdist.fp8_matmul_kernels: x and w are {x.dtype.name}, not FP8; "
                         f"call jaxtdist.{op}'s kernels for 16/32-bit operands")
    return ops[op].launch(x, w, x_scale, w_scale, axis_name=axis_name,
                          config=None if config is None else dict(config), plan=plan)


def matmul_rs(x: jax.Array, w: jax.Array, axis_name, *, config: dict | None = None,
              x_scale: jax.Array | None = None, w_scale: jax.Array | None = None,
              out_dtype=None) -> jax.Array:
    """``psum_scatter(x @ w, axis_name, scatter_dimension=0, tiled=True)``, the
    reduction overlapped with the GEMM.

    Call inside ``jax.shard_map`` over the mesh given to ``jaxtdist.initialize``.
    Each rank computes its partial product tile by tile, its own rows last;
    finished tiles go straight into the heap of the rank owning their rows,
    which sums the W partials in float32. Differentiable: dx is
    ``ag_matmul(dy, w.T)`` (an all-gather GEMM), dw is ``x.T @ all_gather(dy)``.
    A group of one rank computes ``x @ w`` alone.
    FP8 (``x_scale``, ``w_scale`` given): the layouts of K-sharded operands in
    ``jaxtdist.ops._fp8_gemm`` (w K-major [N, k_shard]); partials scaled and summed
    in float32; not differentiable.

    Args:
      x: this rank's [M, k_shard] (typically the columns of the activations
        that match its rows of w).
      w: this rank's weight, [k_shard, N] (row-sharded over the group).
      axis_name: mesh axis (or tuple of axes) of the group.
      config: overrides of the kernel config (``MatmulRsConfig`` keys; advanced).
      x_scale, w_scale: FP8 only: float32 scales (below).
      out_dtype: FP8 only: bfloat16 (default), float16 or float32.

    Returns:
      [M / W, N] in x's dtype (FP8: ``out_dtype``): this rank's rows of the sum
      over ranks.

    Raises:
      ValueError: M not divisible by the group size W, mismatched shapes or dtypes.

    Example:
      >>> mesh = jax.make_mesh((4,), ("tp",)); jaxtdist.initialize(mesh)
      >>> f = jax.jit(jax.shard_map(lambda x, w: jaxtdist.matmul_rs(x, w, "tp"), mesh=mesh,
      ...             in_specs=(P(None, "tp"), P("tp", None)), out_specs=P("tp", None)))
    """
    x, w = jnp.asarray(x), jnp.asarray(w)
    out = _fp8_call("matmul_rs", _MATMUL_RS_FP8, x, w, axis_name, config, x_scale, w_scale,
                    out_dtype)
    if out is not None:
        return out
    return _MATMUL_RS(x, w, axis_name=axis_name, config=config)


# -- matmul_ar -------------------------------------------------------------------

def _ar_forward(x, w, *, axis_name, config=None):
    return ar_launch(x, w, axis_name, config=config), (x, w)


def _ar_backward(residuals, dy, *, axis_name, config=None):
    del config
    x, w = residuals
    # Typed invariant over the group (shard_map's check_vma), dy is already the
    # group's sum (psum's transpose is the identity). Untyped (check_vma=False),
    # each rank holds its own: psum's transpose is psum.
    have = varying_axes(dy)
    if have is None or set(runtime().layout(axis_name).axes) & have:
        dy = all_reduce(dy, axis_name)
    dx = jnp.dot(dy, w.T, preferred_element_type=jnp.float32)
    dw = jnp.dot(x.T, dy, preferred_element_type=jnp.float32)
    return dx, dw


_MATMUL_AR = DistributedOp("matmul_ar", forward=_ar_forward, backward=_ar_backward,
                           check=_ar_check, local=_local, reduces=True,
                           check_config=_ar_check_config, decomposed=_ar_decomposed,
                           path=MATMUL_AR_PATH)


def matmul_ar(x: jax.Array, w: jax.Array, axis_name, *, config: dict | None = None,
              x_scale: jax.Array | None = None, w_scale: jax.Array | None = None,
              out_dtype=None) -> jax.Array:
    """``psum(x @ w, axis_name)`` as one kernel, for small M (decode).

    Call inside ``jax.shard_map`` over the mesh given to ``jaxtdist.initialize``.
    Every output tile's partial is pushed into every peer's heap as soon as it
    is computed, and every rank sums the W partials in float32. The result is
    the same on every rank of the group (typed like psum's: not varying over
    ``axis_name``). Differentiable: dx = dy @ w.T, dw = x.T @ dy. A group of
    one rank computes ``x @ w`` alone.
    FP8 (``x_scale``, ``w_scale`` given): the layouts of K-sharded operands in
    ``jaxtdist.ops._fp8_gemm`` (w K-major [N, k_shard]); partials scaled and summed
    in float32; not differentiable.

    Args:
      x: this rank's [M, k_shard].
      w: this rank's weight, [k_shard, N].
      axis_name: mesh axis (or tuple of axes) of the group.
      config: overrides of the kernel config (``MatmulArConfig`` keys; advanced).
      x_scale, w_scale: FP8 only: float32 scales (below).
      out_dtype: FP8 only: bfloat16 (default), float16 or float32.

    Returns:
      [M, N] in x's dtype (FP8: ``out_dtype``), the sum over ranks, on every rank.

    Example:
      >>> mesh = jax.make_mesh((4,), ("tp",)); jaxtdist.initialize(mesh)
      >>> f = jax.jit(jax.shard_map(lambda x, w: jaxtdist.matmul_ar(x, w, "tp"), mesh=mesh,
      ...             in_specs=(P(None, "tp"), P("tp", None)), out_specs=P()))
    """
    x, w = jnp.asarray(x), jnp.asarray(w)
    out = _fp8_call("matmul_ar", _MATMUL_AR_FP8, x, w, axis_name, config, x_scale, w_scale,
                    out_dtype)
    if out is not None:
        return out
    return _MATMUL_AR(x, w, axis_name=axis_name, config=config)


# -- pjit-style wrappers -------------------------------------------------------------

matmul_rs_sharded = pjit_wrapper(
    matmul_rs, name="matmul_rs_sharded",
    in_specs=lambda axis, batch: (jax.sharding.PartitionSpec(rows_over(None, batch), axis),
                                  jax.sharding.PartitionSpec(axis, None)),
    out_specs=lambda axis, batch: jax.sharding.PartitionSpec(rows_over(axis, batch), None))
matmul_rs_sharded.__doc__ = """``matmul_rs`` for pjit-style code: the row-parallel layer.

    ``x`` is [M, K] with rows sharded over ``batch_axes`` and columns over
    ``axis_name``; ``w`` is [K, N] with rows sharded over ``axis_name``. The
    result is [M, N], the full product, with rows sharded over
    ``(*batch_axes, axis_name)``: within each batch group, each ``axis_name``
    rank holds its block of the rows of the sum. Mesh axes not named are
    replicated.

    Args:
      x: activations, [M, K].
      w: weight, [K, N].
      axis_name: the tensor-parallel mesh axis (keyword).
      batch_axes: mesh axes that shard the rows (data parallelism), outermost first.
      mesh: the mesh; defaults to the one given to ``jaxtdist.initialize``.
      config: as for ``matmul_rs``.

    Example:
      >>> mesh = jax.make_mesh((2, 4), ("dp", "tp")); jaxtdist.initialize(mesh)
      >>> layer = jax.jit(functools.partial(jaxtdist.matmul_rs_sharded, axis_name="tp",
      ...                                   batch_axes=("dp",)))
      >>> y = layer(h, w2)  # h: P("dp", "tp"), w2: P("tp", None) -> y: P(("dp", "tp"), None)
    """

matmul_ar_sharded = pjit_wrapper(
    matmul_ar, name="matmul_ar_sharded",
    in_specs=lambda axis, batch: (jax.sharding.PartitionSpec(rows_over(None, batch), axis),
                                  jax.sharding.PartitionSpec(axis, None)),
    out_specs=lambda axis, batch: jax.sharding.PartitionSpec(rows_over(None, batch), None))
matmul_ar_sharded.__doc__ = """``matmul_ar`` for pjit-style code.

    ``x`` is [M, K] with rows sharded over ``batch_axes`` and columns over
    ``axis_name``; ``w`` is [K, N] with rows sharded over ``axis_name``. The
    result is [M, N] with rows sharded over ``batch_axes``, replicated over
    ``axis_name``.

    Args:
      x, w, axis_name, batch_axes, mesh, config: as for ``matmul_rs_sharded``.
    """
