"""jaxtdist.moe_dispatch: every (token, expert) pair to its expert's rank, grouped
by local expert. Its op: the kernels (``_launch``) with a combine as the backward,
and a scatter in pure JAX at world 1."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxtdist.ops._op import DistributedOp, one_call_per_element
from jaxtdist.ops._protocol import Call, check_axis
from jaxtdist.ops._shapes import check_dtype, static_bool
from jaxtdist.ops.moe._checks import check_dispatch, default_recv_rows
from jaxtdist.ops.moe._config import resolved
from jaxtdist.ops.moe._fp8 import check_fp8, fp8_rows, fp8_unpack
from jaxtdist.ops.moe._handle import (COMBINE_ARRAYS, DISPATCH_ARRAYS, MoeHandle,
                                      flatten_handle, rebuild_handle)
from jaxtdist.ops.moe._launch import moe_combine_kernels, moe_dispatch_kernels, summary
from jaxtdist.ops.moe._routing import valid_pairs
from jaxtdist.runtime._runtime import runtime

__all__ = ["moe_dispatch"]


def _local_dispatch(x, expert_ids, *, num_experts, rows):
    """recv_x, recv_counts [1, E], src_pos, src_tk and the valid pairs of one rank."""
    t, k = expert_ids.shape
    valid = valid_pairs(expert_ids, num_experts)
    ids = jnp.where(valid, expert_ids, 0)
    onehot = jnp.sum((ids[:, :, None] == jnp.arange(num_experts)[None, None])
                     & valid[:, :, None], axis=1, dtype=jnp.int32)
    tot = jnp.sum(onehot, axis=0)
    start = jnp.cumsum(tot) - tot
    pos = start[ids] + jnp.take_along_axis(jnp.cumsum(onehot, axis=0) - onehot, ids, axis=1)
    keep = valid & (pos < rows)
    target = jnp.where(keep, pos, rows).reshape(-1)
    src = jnp.broadcast_to(x[:, None, :], (t, k, x.shape[1])).reshape(t * k, -1)
    recv = jnp.zeros((rows, x.shape[1]), x.dtype).at[target].set(src, mode="drop")
    spos = jnp.where(keep, pos, -1).astype(jnp.int32)
    stk = jnp.where(valid, jnp.arange(t * k).reshape(t, k), -1).astype(jnp.int32)
    return recv, tot.reshape(1, -1).astype(jnp.int32), spos, stk, valid


def _forward(x, expert_ids, *, axis_name, num_experts, max_recv_rows=None, split=0,
             zero_unused_rows=True, config=None):
    recv, sizes, handle = moe_dispatch_kernels(x, expert_ids, axis_name,
                                               num_experts=num_experts,
                                               max_recv_rows=max_recv_rows, split=split,
                                               zero_unused_rows=zero_unused_rows,
                                               config=config)
    return ((recv, sizes, *flatten_handle(handle, DISPATCH_ARRAYS)[0]),
            flatten_handle(handle, COMBINE_ARRAYS)[0])


def _backward(residuals, ct, *, axis_name, num_experts, max_recv_rows=None, split=0,
              zero_unused_rows=True, config=None):
    # Only the fp8 path splits rows, and it is not differentiable; the combine reads
    # the received rows only.
    del split, zero_unused_rows
    named = dict(zip(COMBINE_ARRAYS, residuals))
    t, k = named["expert_ids"].shape
    world = runtime().layout(axis_name).world
    static = dict(num_experts=num_experts, programs=named["src_ranges"].shape[1],
                  max_recv_rows=max_recv_rows or default_recv_rows(t, k, world, num_experts))
    ones = jnp.ones((t, k), jnp.float32)

    def combine(ct_recv, *arrays):
        handle = rebuild_handle(COMBINE_ARRAYS, arrays, **static)
        return moe_combine_kernels(ct_recv, handle, ones, axis_name, config=config)

    # The transpose of copying x[t] to each of its expert rows: sum those rows (one
    # whole kernel call per element under jax.vmap, like every backward's).
    return one_call_per_element(combine)(ct[0], *residuals), None


def _local(x, expert_ids, *, axis_name, num_experts, max_recv_rows=None, split=0,
           zero_unused_rows=True, config=None):
    del axis_name, config, zero_unused_rows  # zeros either way: XLA fuses them into the scatter
    t, k = expert_ids.shape
    rows = max_recv_rows or default_recv_rows(t, k, 1, num_experts)
    recv, counts, spos, stk, valid = _local_dispatch(x, expert_ids, num_experts=num_experts,
                                                     rows=rows)
    if split:
        recv = (recv[:, :split], recv[:, split:])
    sizes, dropped = summary(counts, rows)
    handle = MoeHandle(expert_ids, counts, spos, stk, jnp.zeros((1, 1, 2), jnp.int32), dropped,
                       jnp.sum(~valid).astype(jnp.int32))
    return recv, sizes, *flatten_handle(handle, DISPATCH_ARRAYS)[0]


def _check_config(x, expert_ids, *, axis_name, config, **static):
    del expert_ids, static
    resolved(Call("moe_dispatch", axis_name), *x.shape, x.dtype, config, axis_name)


_DISPATCH = DistributedOp("moe_dispatch", forward=_forward, backward=_backward,
                          check=check_dispatch, local=_local, check_config=_check_config)


def moe_dispatch(x: jax.Array, expert_ids: jax.Array, axis_name, *, num_experts: int,
                 max_recv_rows: int | None = None, x_scale: jax.Array | None = None,
                 zero_unused_rows: bool = True,
                 config: dict | None = None) -> tuple[Any, jax.Array, MoeHandle]:
    """Sends every (token, expert) pair to the rank of its expert, grouped by local expert.

    Call inside ``jax.shard_map`` over the mesh given to ``jaxtdist.initialize``.
    Rank r of ``axis_name`` (W ranks) owns experts ``[r * E / W, (r + 1) * E / W)``.
    A token routed to several experts of one rank crosses the link once. Token
    counts are data: one compiled program serves every routing. Differentiable
    in ``x`` (the backward is a combine with weights 1).

    fp8: with ``x_scale``, x is fp8 (``float8_e4m3fn`` or ``float8_e5m2``) and each
    token's S float32 scales travel with its row (one transfer, half the bytes
    of bfloat16); the experts get ``(recv_x, recv_scale)``. Not differentiable
    (a TypeError says so); combine the experts' bfloat16 output as usual.

    Args:
      x: [T, H] this rank's tokens (bfloat16, float16 or float32; fp8 with
        ``x_scale``).
      expert_ids: [T, K] int32 top-K routing, distinct experts per token, in
        [0, E). Pairs outside [0, E) or repeated within a token are not sent
        (counted in ``handle.invalid``; they contribute zero in combine).
      axis_name: mesh axis (or tuple of axes) of the expert-parallel group.
      num_experts: E, a multiple of W.
      max_recv_rows: R, the rows of ``recv_x`` (static); default
        ``W * T * min(K, E / W)`` (nothing can be dropped). Rows past R are
        dropped and counted in ``handle.dropped``.
      x_scale: [T, S] float32 (fp8 x only): token t's columns ``[j * H / S,
        (j + 1) * H / S)`` are scaled by ``x_scale[t, j]`` (S = 1: per token;
        S = H / 128: per 128-column block).
      zero_unused_rows: True (the default): rows of ``recv_x`` (and
        ``recv_scale``) past the received ones are zero. False: they are left
        unwritten, their contents unspecified (they may hold NaN): for
        consumers that read only the first ``sum(group_sizes)`` rows
        (``jax.lax.ragged_dot``, ``jaxtdist.grouped_matmul``, ``moe_combine``
        of their output). It saves writing the unused rows, most of R with the
        default ``max_recv_rows`` (three quarters of it for balanced top-8
        routing over 4 ranks).
      config: overrides of ``MoeConfig`` (advanced).

    Returns:
      ``recv_x`` [R, H]: local expert 0's rows first, then expert 1's, ...;
      within an expert by source rank, then token index; rows past the
      received ones are zero (see ``zero_unused_rows``). With ``x_scale``:
      the pair ``(recv_x, recv_scale)``, recv_scale [R, S] float32 row for
      row (zeros past the received rows, as recv_x's). ``group_sizes`` [E / W] int32: rows per local
      expert (``jax.lax.ragged_dot(recv_x, w_local, group_sizes)``).
      ``handle``: a ``MoeHandle`` for ``moe_combine``.

    Example:
      >>> def layer(x, ids, w, gate):
      ...     recv, sizes, handle = jaxtdist.moe_dispatch(x, ids, "ep", num_experts=8)
      ...     y = jax.lax.ragged_dot(recv, w, sizes)
      ...     return jaxtdist.moe_combine(y, handle, gate, "ep")
    """
    x, expert_ids = jnp.asarray(x), jnp.asarray(expert_ids)
    # NumPy integers (a config's or a shape's) count as ints; floats and bools do not.
    num_experts, max_recv_rows = (int(v) if isinstance(v, np.integer)
                                  and not isinstance(v, np.bool_) else v
                                  for v in (num_experts, max_recv_rows))
    zero_unused_rows = static_bool("moe_dispatch", "zero_unused_rows", zero_unused_rows)
    if getattr(x, "ndim", None) == 2:
        if jnp.dtype(x.dtype) == jnp.uint8:  # byte rows are internal (the fp8 path's)
            check_dtype("moe_dispatch", "x", x.dtype)
        if x_scale is not None:
            x_scale = jnp.asarray(x_scale)
        check_fp8(x, x_scale)
    rows_in = x if x_scale is None else fp8_rows(x, x_scale)
    # fp8: each byte row's token bytes and scale bytes come back as two arrays.
    split = x.shape[1] if x_scale is not None else 0
    out = _DISPATCH(rows_in, expert_ids, axis_name=axis_name, num_experts=num_experts,
                    max_recv_rows=max_recv_rows, split=split,
                    zero_unused_rows=zero_unused_rows, config=config)
    recv, sizes, *arrays = out
    if x_scale is not None:
        recv = fp8_unpack(recv, x.dtype, x_scale.shape[1])
    t, k = expert_ids.shape
    layout = check_axis(runtime(), axis_name, "moe_dispatch")
    handle = rebuild_handle(
        DISPATCH_ARRAYS, arrays, expert_ids=expert_ids, num_experts=num_experts,
        max_recv_rows=max_recv_rows or default_recv_rows(t, k, layout.world, num_experts),
        programs=arrays[DISPATCH_ARRAYS.index("src_ranges")].shape[1], axis_name=layout.axes)
    return recv, sizes, handle
