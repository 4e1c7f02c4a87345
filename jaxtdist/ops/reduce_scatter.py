"""jaxtdist.reduce_scatter: a sum over the group, scattered along one dimension.

Equals ``jax.lax.psum_scatter(x, axis_name, scatter_dimension=d, tiled=True)``.
The array is moved so that the scattered dimension leads and flattened:
chunk r (rank r's part of the result) is then contiguous. The kernel
(kernels/reduce_scatter.py, protocol in kernels/_reduce.py) stages every
peer's chunk in the heap and pulls its own chunk from every peer, summing in
float32. Differentiable: the backward pass is an all-gather of the cotangent
(``jaxtdist.all_gather``). This module also holds what all_reduce shares
with it: the slab grid's config rule and the workspace layout.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jaxtdist.kernels.reduce_scatter import reduce_scatter_kernel
from jaxtdist.ops._config import KernelConfig, Problem, resolve, setting
from jaxtdist.ops._op import DistributedOp
from jaxtdist.ops._protocol import Call, check_axis
from jaxtdist.ops._shapes import align, check_dtype, next_pow2
from jaxtdist.ops.all_gather import all_gather
from jaxtdist.runtime._runtime import runtime

__all__ = ["ReduceScatterConfig", "ReduceWorkspace", "reduce_scatter"]


# -- what reduce_scatter and all_reduce share -------------------------------------------

def slab_grid(problem: Problem, slab_elements: int) -> dict:
    """NUM_PROGRAMS and BLOCK for a kernel whose programs each take one slab of whole
    BLOCKs out of ``slab_elements``: one BLOCK per program up to one program per SM
    (latency: a program's remote loads of one block are in flight together), more
    BLOCKs per program beyond. The interpreter gets 2 programs and small blocks."""
    if problem.platform != "gpu":
        return dict(NUM_PROGRAMS=2, BLOCK=min(256, next_pow2(slab_elements)))
    block = min(2048, next_pow2(slab_elements))
    return dict(NUM_PROGRAMS=max(1, min(problem.sms, -(-slab_elements // block))), BLOCK=block)


def validate_slab_config(cfg: KernelConfig, problem: Problem) -> None:
    """The slab grid's bound: programs wait on the same program of other ranks, so all
    must be resident (``ValueError`` naming the key)."""
    if problem.platform == "gpu" and cfg.NUM_PROGRAMS > problem.sms:
        raise ValueError(f"jaxtdist.{cfg.OP}: config NUM_PROGRAMS={cfg.NUM_PROGRAMS} exceeds "
                         f"the {problem.sms} SMs (every program must be resident)")


def problem_of(rt, world: int, n: int, dtype) -> Problem:
    """The per-rank problem of ``n`` elements of ``dtype`` (shape key ``(n,)``)."""
    return Problem(rt.platform, world, (n,), jnp.dtype(dtype).name, rt.sms)


class ReduceWorkspace:
    """Byte layout of a reduction workspace: READY flags (world * programs int32),
    DONE flags (the two-shot all-reduce's second phase, if ``done``), then two
    staging slots (call parities) of ``slot_elements``."""

    def __init__(self, world: int, slot_elements: int, dtype, programs: int,
                 done: bool = False):
        flags = align(4 * world * programs)
        self.ready = 0
        self.done = flags
        self.slot_bytes = align(slot_elements * np.dtype(dtype).itemsize)
        self.stage = flags * (2 if done else 1)
        self.nbytes = self.stage + 2 * self.slot_bytes


# -- config --------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ReduceScatterConfig(KernelConfig):
    """How the reduce-scatter kernel splits its chunk over programs.

    Attributes:
      NUM_PROGRAMS: programs, each owning one slab of whole BLOCKs of every chunk.
      BLOCK: elements per load (a power of 2).
      SCOPE: memory scope of the staging signals ("sys" or "gpu").
      num_warps: launch option.
    """
    OP: ClassVar[str] = "reduce_scatter"
    variant: ClassVar[str] = "pull"  # peers' staged chunks pulled and summed

    NUM_PROGRAMS: int = setting(2)
    BLOCK: int = setting(256, pow2=True)
    SCOPE: str = setting("sys", choices=("sys", "gpu"))
    num_warps: int = 4

    @classmethod
    def default(cls, problem: Problem) -> "ReduceScatterConfig":
        (n,) = problem.shape
        return cls(**slab_grid(problem, max(1, n // problem.world)))

    def check(self, problem: Problem) -> None:
        validate_slab_config(self, problem)

    @classmethod
    def search_space(cls, problem: Problem) -> list[dict]:
        if problem.platform != "gpu":
            return [{}, dict(NUM_PROGRAMS=3, BLOCK=64)]
        return cls.fitting(problem, [{}] + [dict(NUM_PROGRAMS=p, BLOCK=b, num_warps=w)
                                             for p in (16, 32, 66, 132) for b in (1024, 4096)
                                             for w in (4, 8)])


# -- the op --------------------------------------------------------------------------

def _check(x, *, axis_name, scatter_dimension, config=None) -> None:
    del config
    if x.ndim == 0:
        raise ValueError("jaxtdist.reduce_scatter: x must have at least one dimension, got a "
                         "scalar")
    if (isinstance(scatter_dimension, bool) or not isinstance(scatter_dimension, int)
            or not -x.ndim <= scatter_dimension < x.ndim):
        raise ValueError(f"jaxtdist.reduce_scatter: scatter_dimension={scatter_dimension!r} is "
                         f"out of range for x of shape {x.shape}")
    check_dtype("reduce_scatter", "x", x.dtype)
    world = check_axis(runtime(), axis_name, "reduce_scatter").world
    size = x.shape[scatter_dimension]
    if size % world:
        raise ValueError(f"jaxtdist.reduce_scatter: scatter_dimension {scatter_dimension} of x "
                         f"(shape {x.shape}) has size {size}, which the group's {world} ranks "
                         f"do not divide (psum_scatter with tiled=True requires it)")


def _resolved(call: Call, n: int, dtype, config, axis_name) -> ReduceScatterConfig:
    """The config the kernel takes for ``n`` elements of ``dtype`` per rank."""
    return resolve(ReduceScatterConfig, problem_of(call.rt, call.world, n, dtype), call.rt,
                   config, axis_name=axis_name)


def _forward(x, *, axis_name, scatter_dimension, config=None):
    d = scatter_dimension % x.ndim
    call = Call("reduce_scatter", axis_name)
    world = call.world
    moved = jnp.moveaxis(x, d, 0)
    out_shape = (moved.shape[0] // world,) + moved.shape[1:]
    n = math.prod(moved.shape)
    chunk = n // world
    if chunk == 0:  # an empty array: nothing to sum
        return jnp.moveaxis(jnp.zeros(out_shape, x.dtype), 0, d), None
    flat = moved.reshape(n)
    cfg = _resolved(call, n, x.dtype, config, axis_name)
    plan = ReduceWorkspace(world, n, x.dtype, cfg.NUM_PROGRAMS)
    ws = call.workspace("pull", plan.nbytes, n, x.dtype.name, cfg.NUM_PROGRAMS)
    # Each rank's result differs: it varies over the group's axes too.
    varying = set(call.result_axes(local=(flat,))) | set(call.layout.axes)
    out = call.run(reduce_scatter_kernel, flat, workspace=ws,
                   out_shape=jax.ShapeDtypeStruct((chunk,), x.dtype),
                   grid=(cfg.NUM_PROGRAMS,), num_stages=1, **cfg.launch_options(),
                   varying=tuple(a for a in call.rt.mesh.axis_names if a in varying),
                   CHUNK=chunk, STAGE_OFF=ws.offset + plan.stage, SLOT_BYTES=plan.slot_bytes,
                   READY_OFF=ws.offset + plan.ready, **cfg.kernel_args())
    return jnp.moveaxis(out.reshape(out_shape), 0, d), None


def _backward(residuals, ct, *, axis_name, scatter_dimension, config=None):
    del residuals, config
    # psum_scatter's transpose: every rank's input gets the whole cotangent.
    return (all_gather(ct, axis_name, axis=scatter_dimension % ct.ndim, tiled=True),)


def _local(x, *, axis_name, scatter_dimension, config=None):
    del axis_name, scatter_dimension, config
    return x


def _check_config(x, *, axis_name, scatter_dimension, config):
    del scatter_dimension
    if x.size:  # an empty array runs no kernel
        _resolved(Call("reduce_scatter", axis_name), x.size, x.dtype, config, axis_name)


_REDUCE_SCATTER = DistributedOp("reduce_scatter", forward=_forward, backward=_backward,
                                check=_check, local=_local, check_config=_check_config)


def reduce_scatter(x: jax.Array, axis_name, *, scatter_dimension: int = 0,
                   config: dict | None = None) -> jax.Array:
    """Sums ``x`` over the ranks of ``axis_name`` and gives rank r the r-th block of
    the sum along ``scatter_dimension``, like ``jax.lax.psum_scatter(x, axis_name,
    scatter_dimension=scatter_dimension, tiled=True)``.

    Call inside ``jax.shard_map`` over the mesh given to ``jaxtdist.initialize``.
    bfloat16 and float16 inputs are summed in float32 and rounded once.
    Differentiable (the cotangent is all-gathered).

    Args:
      x: this rank's array (every rank passes the same shape and dtype); its
        ``scatter_dimension`` must be divisible by the group's size.
      axis_name: mesh axis (or tuple of axes) of the group.
      scatter_dimension: the dimension the sum is split along.
      config: overrides of the kernel config (``ReduceScatterConfig`` keys; advanced).

    Returns:
      This rank's block of the sum: ``x``'s shape with ``scatter_dimension``
      divided by the group's size.

    Example:
      >>> mesh = jax.make_mesh((4,), ("x",)); jaxtdist.initialize(mesh)
      >>> f = jax.jit(jax.shard_map(lambda x: jaxtdist.reduce_scatter(x, "x"), mesh=mesh,
      ...                           in_specs=P("x"), out_specs=P("x")))
    """
    if isinstance(scatter_dimension, np.integer) and not isinstance(scatter_dimension, np.bool_):
        scatter_dimension = int(scatter_dimension)  # as jax.lax.psum_scatter takes it
    return _REDUCE_SCATTER(jnp.asarray(x), axis_name=axis_name,
                           scatter_dimension=scatter_dimension, config=config)
