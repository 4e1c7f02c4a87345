"""jaxtdist.all_gather: an all-gather through the symmetric heap.

The kernel stages the shard itself (see kernels/_gather.py), so the prologue
only produces the context. Differentiable: the backward pass is XLA's
reduce-scatter of the cotangent.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jaxtdist.kernels.all_gather import all_gather_kernel
from jaxtdist.ops._config import KernelConfig, Problem, block, resolve, setting
from jaxtdist.ops._op import DistributedOp, scatter_cotangent
from jaxtdist.ops._protocol import Call
from jaxtdist.ops._shapes import GatherWorkspace, check_dtype, next_pow2

__all__ = ["AllGatherConfig", "all_gather"]


@dataclasses.dataclass(frozen=True)
class AllGatherConfig(KernelConfig):
    """How the gather kernel copies a [rows, cols] shard.

    Attributes:
      NUM_WORKERS: programs copying peers' chunks.
      CHUNK_ROWS: rows per copy step.
      BLOCK_C: columns per copy step (a power of 2).
      SCOPE: memory scope of the ready signals ("sys" or "gpu").
      num_warps: launch option.
    """
    OP: ClassVar[str] = "all_gather"

    NUM_WORKERS: int = setting(128)
    CHUNK_ROWS: int = setting(64)
    BLOCK_C: int = block(256, low=1)
    SCOPE: str = setting("sys", choices=("sys", "gpu"))
    num_warps: int = 4

    variant: ClassVar[str] = "pull"  # peers' staged shards pulled by SM programs

    @classmethod
    def default(cls, problem: Problem) -> "AllGatherConfig":
        rows, cols = problem.shape
        gpu = problem.platform == "gpu"
        block_c = min(next_pow2(cols), 256 if gpu else 64)
        chunk_rows = max(1, min(64, next_pow2(rows), (16384 if gpu else 2048) // block_c))
        return cls(NUM_WORKERS=128 if gpu else 2, CHUNK_ROWS=chunk_rows, BLOCK_C=block_c)

    @classmethod
    def search_space(cls, problem: Problem) -> list[dict]:
        if problem.platform != "gpu":
            return [{}]
        return [{}] + [dict(NUM_WORKERS=w, BLOCK_C=c) for w in (32, 64, 132) for c in (128, 512)]


def _check(x, *, axis_name, axis, tiled, config=None) -> None:
    del axis_name, config
    if x.ndim == 0:
        raise ValueError("jaxtdist.all_gather: x must have at least one dimension, got a scalar")
    if not 0 <= axis < x.ndim + (not tiled):  # all_gather made it non-negative
        raise ValueError(f"jaxtdist.all_gather: axis={axis} is out of range for x of shape "
                         f"{x.shape} (tiled={tiled}: {_axis_range(x.ndim, tiled)})")
    check_dtype("all_gather", "x", x.dtype)


def _axis_range(ndim: int, tiled: bool) -> str:
    n = ndim + (not tiled)
    return f"axis in [{-n}, {n})" + ("" if tiled else ", the position of the new axis")


def _resolved(call: Call, x, axis: int, tiled: bool, config, axis_name):
    """x with the gathered dimension first and the config the kernel takes for its
    [rows, cols] blocks."""
    moved = jnp.moveaxis(x, axis, 0) if tiled else x
    rows, cols = moved.shape[0], math.prod(moved.shape[1:])
    problem = Problem(call.platform, call.world, (rows, cols), jnp.dtype(x.dtype).name)
    return moved, resolve(AllGatherConfig, problem, call.rt, config, axis_name=axis_name)


def _forward(x, *, axis_name, axis, tiled, config=None):
    # axis >= 0: the dimension concatenated along (tiled), or the position of the
    # new stacked axis in the result, 0..x.ndim (as jax.lax.all_gather's).
    call = Call("all_gather", axis_name)
    world = call.world
    moved, cfg = _resolved(call, x, axis, tiled, config, axis_name)
    rows, cols = moved.shape[0], math.prod(moved.shape[1:])
    flat = moved.reshape(rows, cols)
    plan = GatherWorkspace(world, rows, cols, x.dtype, cfg.CHUNK_ROWS)
    ws = call.workspace("gather", plan.nbytes, rows, cols, x.dtype.name)
    out = call.run(all_gather_kernel, flat, workspace=ws,
                   out_shape=jax.ShapeDtypeStruct((world * rows, cols), x.dtype),
                   grid=(cfg.NUM_WORKERS,), num_stages=1, **cfg.launch_options(),
                   varying=call.result_axes(local=(flat,)), ROWS=rows, COLS=cols,
                   STAGE_OFF=ws.offset + plan.stage, SLOT_BYTES=plan.slot_bytes,
                   READY_OFF=ws.offset + plan.ready, **cfg.kernel_args())
    out = out.reshape((world, rows) + moved.shape[1:])
    if tiled:
        out = out.reshape((world * rows,) + moved.shape[1:])
    return jnp.moveaxis(out, 0, axis), None


def _backward(residuals, ct, *, axis_name, axis, tiled, config=None):
    del residuals, config
    return (scatter_cotangent(ct, axis_name, axis, tiled),)


def _local(x, *, axis_name, axis, tiled, config=None):
    del axis_name, config
    return x if tiled else jnp.expand_dims(x, axis)


def _check_config(x, *, axis_name, axis, tiled, config):
    _resolved(Call("all_gather", axis_name), x, axis, tiled, config, axis_name)


_ALL_GATHER = DistributedOp("all_gather", forward=_forward, backward=_backward, check=_check,
                            local=_local, check_config=_check_config)


def all_gather(x: jax.Array, axis_name, *, axis: int = 0, tiled: bool = True,
               config: dict | None = None) -> jax.Array:
    """Gathers ``x`` from every rank of ``axis_name``, like ``jax.lax.all_gather``.

    Call inside ``jax.shard_map`` over the mesh given to ``jaxtdist.initialize``.
    Differentiable (the cotangent is reduce-scattered).

    Args:
      x: this rank's shard.
      axis_name: mesh axis (or tuple of axes) to gather over.
      axis: dimension along which shards are concatenated (``tiled``) or stacked.
      tiled: concatenate along ``axis`` (True) or stack a new ``axis`` (False).
      config: overrides of the kernel config (``AllGatherConfig`` keys; advanced).

    Returns:
      The gathered array, in rank order.

    Example:
      >>> mesh = jax.make_mesh((4,), ("x",)); jaxtdist.initialize(mesh)
      >>> # Typed varying over "x", as jax.lax.all_gather's result is: a replicated
      >>> # out_specs needs check_vma=False, as it would for jax.lax.all_gather.
      >>> f = jax.jit(jax.shard_map(lambda x: jaxtdist.all_gather(x, "x"), mesh=mesh,
      ...                           in_specs=P("x"), out_specs=P(), check_vma=False))
    """
    x = jnp.asarray(x)
    if not isinstance(axis, (int, np.integer)) or isinstance(axis, (bool, np.bool_)):
        raise ValueError(f"jaxtdist.all_gather: axis must be an int, got {axis!r}")
    axis = int(axis)  # a NumPy integer too (as jax.lax.all_gather takes)
    # Negative axes count from the end of the result, as jax.lax.all_gather's: with
    # tiled=False the stacked axis is new, so -1 (or x.ndim) stacks last.
    ndim = x.ndim + (not tiled)
    if x.ndim and -ndim <= axis < ndim:
        axis %= ndim
    return _ALL_GATHER(x, axis_name=axis_name, axis=axis, tiled=bool(tiled), config=config)
