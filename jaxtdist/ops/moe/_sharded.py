"""moe_dispatch_sharded / moe_combine_sharded: the pjit-style forms (``pjit_wrapper``).

Every array of the shard_map form is one rank's block of a global array sharded on
its leading dim over rows_over(axis_name, batch_axes): the tokens (and fp8 scales),
recv_x (and recv_scale), the group sizes and every array of the handle (one
PartitionSpec is the prefix of the whole MoeHandle), so nothing moves in or out.
The handle's two scalars (dropped, invalid) become blocks of one element: [G]
arrays, G the devices of the rows axes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from jaxtdist.ops._sharded import mesh_devices, pjit_wrapper, rows_over
from jaxtdist.ops.moe._combine import moe_combine
from jaxtdist.ops.moe._dispatch import moe_dispatch
from jaxtdist.ops.moe._handle import MoeHandle

__all__ = ["moe_combine_sharded", "moe_dispatch_sharded"]


def _row_groups(mesh, axis_name: str | tuple[str, ...],
                batch_axes: tuple[str, ...]) -> tuple[int, str]:
    """G, the devices sharding rows (batch axes times the expert axis), and words
    saying so for errors."""
    axes = tuple(batch_axes) + (axis_name if isinstance(axis_name, tuple) else (axis_name,))
    groups, sizes = mesh_devices(mesh, axes)
    return groups, f"the {groups} devices of the rows' mesh axes ({sizes})"


def _handle_blocks(handle: MoeHandle) -> MoeHandle:
    """The handle with its scalars as one-element blocks (the pjit-style layout)."""
    return dataclasses.replace(handle, dropped=handle.dropped[None], invalid=handle.invalid[None])


def _dispatch_per_rank(x, expert_ids, *x_scale, axis_name, num_experts, max_recv_rows=None,
                       zero_unused_rows=True, config=None):
    """moe_dispatch with the handle's scalars as blocks; fp8 (``x_scale``, one array):
    recv_scale last, recv_x first and on its own (the wrapper orders the next
    jaxtdist call after its first result, which must be an array, not the pair;
    moe_dispatch_sharded pairs them)."""
    recv, sizes, handle = moe_dispatch(
        x, expert_ids, axis_name, num_experts=num_experts, max_recv_rows=max_recv_rows,
        x_scale=x_scale[0] if x_scale else None, zero_unused_rows=zero_unused_rows,
        config=config)
    if x_scale:
        return recv[0], sizes, _handle_blocks(handle), recv[1]
    return recv, sizes, _handle_blocks(handle)


def _combine_per_rank(y, handle, weights, axis_name, *, config=None):
    handle = dataclasses.replace(handle, dropped=handle.dropped[0], invalid=handle.invalid[0])
    return moe_combine(y, handle, weights, axis_name, config=config)


def _check_dispatch_sharded(x, expert_ids, x_scale=None, *, axis_name, batch_axes, mesh,
                            num_experts, max_recv_rows=None, zero_unused_rows=True,
                            config=None) -> None:
    # num_experts, max_recv_rows, zero_unused_rows, config, the dtypes and x_scale's
    # columns: checked per rank, as moe_dispatch's.
    del num_experts, max_recv_rows, zero_unused_rows, config
    name = "jaxtdist.moe_dispatch_sharded"
    groups, words = _row_groups(mesh, axis_name, batch_axes)
    if getattr(x, "ndim", None) != 2:
        raise ValueError(f"{name}: x must be the global tokens [W * T, H] (2-D), got shape "
                         f"{getattr(x, 'shape', None)}")
    if x.shape[0] % groups:
        raise ValueError(f"{name}: x has {x.shape[0]} rows, not a multiple of {words}; "
                         f"its rows are sharded over them (T = rows / {groups} per rank)")
    if getattr(expert_ids, "ndim", None) != 2 or expert_ids.shape[0] != x.shape[0]:
        raise ValueError(f"{name}: expert_ids must be [W * T, K] with as many rows as x "
                         f"({x.shape[0]}), got shape {getattr(expert_ids, 'shape', None)}")
    if x_scale is not None and (getattr(x_scale, "ndim", None) != 2
                                or x_scale.shape[0] != x.shape[0]):
        raise ValueError(f"{name}: x_scale must be [W * T, S] with as many rows as x "
                         f"({x.shape[0]}: one row of S scales per token, sharded like x), got "
                         f"shape {getattr(x_scale, 'shape', None)}")


def _check_combine_sharded(y, handle, weights, *, axis_name, batch_axes, mesh,
                           config=None) -> None:
    del config
    name = "jaxtdist.moe_combine_sharded"
    groups, words = _row_groups(mesh, axis_name, batch_axes)
    if not isinstance(handle, MoeHandle) or getattr(handle.dropped, "shape", None) != (groups,):
        got = (f"a MoeHandle whose dropped has shape {getattr(handle.dropped, 'shape', None)}"
               if isinstance(handle, MoeHandle) else type(handle).__name__)
        raise ValueError(f"{name}: handle must be the MoeHandle that moe_dispatch_sharded "
                         f"returned with the same axis_name {axis_name!r} and batch_axes "
                         f"{tuple(batch_axes)} (its dropped: one count per device of {words}: "
                         f"shape ({groups},)); got {got}")
    rows = groups * handle.max_recv_rows
    if getattr(y, "ndim", None) != 2 or y.shape[0] != rows:
        raise ValueError(f"{name}: y must be [G * R, F] = [{rows}, F]: one row per row of the "
                         f"dispatch's recv_x (G = {groups} devices, R = max_recv_rows = "
                         f"{handle.max_recv_rows} per device), got shape "
                         f"{getattr(y, 'shape', None)}")
    if getattr(weights, "shape", None) != tuple(handle.expert_ids.shape):
        raise ValueError(f"{name}: weights must be [W * T, K] = {tuple(handle.expert_ids.shape)} "
                         f"like the dispatch's expert_ids, got shape "
                         f"{getattr(weights, 'shape', None)}")


def _rows_spec(axis, batch):
    return jax.sharding.PartitionSpec(rows_over(axis, batch))


_dispatch_sharded = pjit_wrapper(
    _dispatch_per_rank, name="moe_dispatch_sharded",
    in_specs=lambda axis, batch: (_rows_spec(axis, batch),) * 2,
    out_specs=lambda axis, batch: (_rows_spec(axis, batch),) * 3,
    check=_check_dispatch_sharded)
# fp8: x_scale is a third array, sharded on rows like x; recv_scale a fourth result.
_dispatch_fp8_sharded = pjit_wrapper(
    _dispatch_per_rank, name="moe_dispatch_sharded",
    in_specs=lambda axis, batch: (_rows_spec(axis, batch),) * 3,
    out_specs=lambda axis, batch: (_rows_spec(axis, batch),) * 4,
    check=_check_dispatch_sharded)


def moe_dispatch_sharded(x: jax.Array, expert_ids: jax.Array, *,
                         axis_name: str | tuple[str, ...],
                         batch_axes: str | tuple[str, ...] = (), mesh=None, num_experts: int,
                         max_recv_rows: int | None = None, x_scale: jax.Array | None = None,
                         zero_unused_rows: bool = True,
                         config: dict | None = None) -> tuple[Any, jax.Array, MoeHandle]:
    """``moe_dispatch`` for pjit-style code: no hand-written ``shard_map``.

    Call it under ``jax.jit`` (or eagerly) on global arrays. The rows of ``x``
    and ``expert_ids`` are sharded over ``(*batch_axes, axis_name)``: G devices,
    each holding T = rows / G tokens; within each batch group the W ranks of
    ``axis_name`` exchange their tokens (rank r owns experts
    ``[r * E / W, (r + 1) * E / W)``, as in ``moe_dispatch``). Mesh axes not
    named are replicated. Ordered after the previous jaxtdist call and
    differentiable in ``x``, as ``moe_dispatch``.

    fp8: with ``x_scale``, x is fp8 (``float8_e4m3fn`` or ``float8_e5m2``) and
    each token's S float32 scales travel with its row, as in ``moe_dispatch``;
    ``x_scale`` is sharded on rows like x (device g gets the scales of its own
    tokens). Not differentiable (a ``TypeError`` says so).

    Every result is the shard_map form's per-device result, concatenated over
    the G devices on its leading dim and sharded there like ``x``: nothing
    moves, and one ``PartitionSpec`` shards the whole handle. The handle's
    scalars become one element per device:

    - ``recv_x`` [G * R, H]: device g's rows are ``[g * R, (g + 1) * R)``.
      With ``x_scale``: the pair ``(recv_x, recv_scale)``, recv_x [G * R, H]
      in x's fp8 dtype and recv_scale [G * R, S] float32, row for row (zeros
      past each device's received rows).
    - ``group_sizes`` [G * E / W] int32: device g's local experts' row counts
      (reshape to [G, E / W] to read them).
    - ``handle``: a ``MoeHandle`` for ``moe_combine_sharded``, arrays
      ``expert_ids`` [G * T, K] (the routing), ``recv_counts`` [G * W, E / W],
      ``src_pos`` / ``src_tk`` [G * W * T, min(K, E / W)], ``src_ranges``
      [G * W, P, NCH + 1], ``dropped`` and ``invalid`` [G] (each device's counts).
      Its static fields are the per-device ones (``max_recv_rows`` = R).

    Args:
      x: [G * T, H] the tokens (bfloat16, float16 or float32; fp8 with
        ``x_scale``).
      expert_ids: [G * T, K] int32 top-K routing, as for ``moe_dispatch``.
      axis_name: the expert-parallel mesh axis, or a tuple of axes taken as one
        group, outermost first (keyword).
      batch_axes: mesh axes that also shard the rows (data parallelism,
        outermost first); each of their groups has its own experts' copies.
      mesh: the mesh; defaults to the one given to ``jaxtdist.initialize``.
      num_experts: E, a multiple of W.
      max_recv_rows: R, ``recv_x``'s rows per device (static); default
        ``W * T * min(K, E / W)`` (nothing can be dropped).
      x_scale: [G * T, S] float32 (fp8 x only), rows sharded like x: token t's
        columns ``[j * H / S, (j + 1) * H / S)`` are scaled by ``x_scale[t, j]``
        (S = 1: per token; S = H / 128: per 128-column block).
      zero_unused_rows: as for ``moe_dispatch`` (False: each device's rows past
        its received ones are left unspecified).
      config: as for ``moe_dispatch``.

    Returns:
      (recv_x, group_sizes, handle), laid out as above; recv_x is the pair
      (recv_x, recv_scale) with ``x_scale``.

    Raises:
      ValueError: an axis not of the mesh or named twice, rows not a multiple
        of G, mismatched shapes (x_scale's rows not x's), or what
        ``moe_dispatch`` refuses (fp8 x without x_scale, x_scale with x not
        fp8, S not dividing H, x_scale not float32).

    Example:
      >>> # Auto axes: on Explicit ones (make_mesh's default) ragged_dot needs out_sharding=
      >>> mesh = jax.make_mesh((4,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,))
      >>> jaxtdist.initialize(mesh)
      >>> @jax.jit
      ... def layer(x, ids, gate, w):  # x, ids, gate: P("ep") rows; w [4, E / 4, H, F]: P("ep")
      ...     recv, sizes, handle = jaxtdist.moe_dispatch_sharded(
      ...         x, ids, axis_name="ep", num_experts=8)
      ...     y = jax.vmap(jax.lax.ragged_dot)(recv.reshape(4, -1, recv.shape[1]), w,
      ...                                      sizes.reshape(4, -1))
      ...     return jaxtdist.moe_combine_sharded(y.reshape(-1, y.shape[2]), handle, gate,
      ...                                         axis_name="ep")
      >>> # fp8: x_q [4 * T, H] float8_e4m3fn, x_s [4 * T, S] float32, both P("ep") rows
      >>> (recv_q, recv_s), sizes, handle = jaxtdist.moe_dispatch_sharded(
      ...     x_q, ids, axis_name="ep", num_experts=8, x_scale=x_s)
    """
    common = dict(axis_name=axis_name, batch_axes=batch_axes, mesh=mesh,
                  num_experts=num_experts, max_recv_rows=max_recv_rows,
                  zero_unused_rows=zero_unused_rows, config=config)
    if x_scale is None:
        return _dispatch_sharded(x, expert_ids, **common)
    recv, sizes, handle, recv_scale = _dispatch_fp8_sharded(x, expert_ids, x_scale, **common)
    return (recv, recv_scale), sizes, handle


moe_combine_sharded = pjit_wrapper(
    _combine_per_rank, name="moe_combine_sharded",
    in_specs=lambda axis, batch: (_rows_spec(axis, batch),) * 3,
    out_specs=_rows_spec,
    check=_check_combine_sharded)
moe_combine_sharded.__doc__ = """``moe_combine`` for pjit-style code: no hand-written ``shard_map``.

    ``out[t] = sum_k weights[t, k] * (row of y holding token t's copy for
    expert expert_ids[t, k])`` for every token t of the global array, each
    device combining its own tokens (as ``moe_combine``). Ordered after the
    previous jaxtdist call; differentiable in ``y`` and ``weights``.

    Args:
      y: [G * R, F] the experts' outputs, one row per row of the dispatch's
        ``recv_x``, sharded on rows like it.
      handle: the ``MoeHandle`` that ``moe_dispatch_sharded`` returned (same
        ``axis_name``, ``batch_axes`` and mesh).
      weights: [G * T, K] routing weights (any float dtype), sharded on rows.
      axis_name: the dispatch's axis (keyword).
      batch_axes: the dispatch's batch axes.
      mesh: the mesh; defaults to the one given to ``jaxtdist.initialize``.
      config: as for ``moe_combine``.

    Returns:
      [G * T, F] in y's dtype, rows sharded over ``(*batch_axes, axis_name)``.

    Raises:
      ValueError: an axis not of the mesh or named twice, a handle not made by
        ``moe_dispatch_sharded`` over the same axes, or mismatched shapes.

    Example:
      >>> recv, sizes, handle = jaxtdist.moe_dispatch_sharded(x, ids, axis_name="ep",
      ...                                                     num_experts=8)
      >>> out = jaxtdist.moe_combine_sharded(recv * 2.0, handle, gate, axis_name="ep")
    """
