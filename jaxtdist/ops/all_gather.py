"""jaxtdist.all_gather: an all-gather through the symmetric heap.

The kernel stages the shard itself (see kernels/_gather.py), so the prologue
only produces the context.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxtdist.kernels.all_gather import all_gather_kernel
from jaxtdist.ops import _call
from jaxtdist.ops._shapes import GatherWorkspace, check_dtype, next_pow2
from jaxtdist.runtime._runtime import runtime


def _config(platform: str, rows: int, cols: int) -> dict:
    block_c = min(next_pow2(cols), 256 if platform == "gpu" else 64)
    chunk_rows = max(1, min(64, next_pow2(rows), (16384 if platform == "gpu" else 2048) // block_c))
    workers = 128 if platform == "gpu" else 2
    return dict(NUM_WORKERS=workers, CHUNK_ROWS=chunk_rows, BLOCK_C=block_c, SCOPE="sys",
                num_warps=4)


def all_gather(x: jax.Array, axis_name, *, axis: int = 0, tiled: bool = True,
               config: dict | None = None) -> jax.Array:
    """Gathers ``x`` from every rank of ``axis_name``, like ``jax.lax.all_gather``.

    Call inside ``jax.shard_map`` over the mesh given to ``jaxtdist.initialize``.

    Args:
      x: this rank's shard.
      axis_name: mesh axis (or tuple of axes) to gather over.
      axis: dimension along which shards are concatenated (``tiled``) or stacked.
      tiled: concatenate along ``axis`` (True) or stack a new ``axis`` (False).
      config: overrides of the kernel configuration (advanced; see ``_config``).

    Returns:
      The gathered array, in rank order.

    Example:
      >>> mesh = jax.make_mesh((4,), ("x",)); jaxtdist.initialize(mesh)
      >>> f = jax.jit(jax.shard_map(lambda x: jaxtdist.all_gather(x, "x"), mesh=mesh,
      ...                           in_specs=P("x"), out_specs=P()))
    """
    rt = runtime()
    layout = _call.check_axis(rt, axis_name, "all_gather")
    x = jnp.asarray(x)
    if x.ndim == 0:
        raise ValueError("jaxtdist.all_gather: x must have at least one dimension, got a scalar")
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"jaxtdist.all_gather: axis={axis} is out of range for x of shape "
                         f"{x.shape}")
    axis %= x.ndim
    check_dtype("all_gather", "x", x.dtype)
    world = layout.world
    moved = jnp.moveaxis(x, axis, 0)
    rows = moved.shape[0]
    cols = math.prod(moved.shape[1:])
    flat = moved.reshape(rows, cols)
    cfg = _config(rt.platform, rows, cols)
    cfg.update(config or {})
    num_warps = cfg.pop("num_warps")
    plan = GatherWorkspace(world, rows, cols, x.dtype, cfg["CHUNK_ROWS"])
    ws = rt.workspace(("all_gather", layout.axes, rows, cols, x.dtype.name), plan.nbytes)
    ctx = _call.prologue(rt, layout, ws, "all_gather", deps=(flat,),
                         align_launch=not _call.aligns_at_launch(rt, (flat,)))
    out = _call.launch(all_gather_kernel, ctx, flat, align_with=(layout, ws),
                       out_shape=jax.ShapeDtypeStruct((world * rows, cols), x.dtype),
                       grid=(cfg["NUM_WORKERS"],), num_warps=num_warps, num_stages=1,
                       ROWS=rows, COLS=cols, STAGE_OFF=ws.offset + plan.stage,
                       SLOT_BYTES=plan.slot_bytes, READY_OFF=ws.offset + plan.ready, **cfg)
    out = out.reshape((world, rows) + moved.shape[1:])
    if tiled:
        out = out.reshape((world * rows,) + moved.shape[1:])
        return jnp.moveaxis(out, 0, axis)
    return jnp.moveaxis(out, (0, 1), (axis, axis + 1)) if axis else out
