"""The two ops, declared together since each one's backward launches the other:
``DISPATCH`` over (x, expert_ids) and ``COMBINE`` over (y, weights, handle), the
``MoeHandle`` passed as it is. Their kernels (``_launch``) take one more
argument, through ``launch`` and ``kernels`` only: the dispatch's per-pair
``scale``, the combine's ``cotangent``. At world 1 each is a scatter or a
gather in pure JAX."""

from __future__ import annotations

import jax.numpy as jnp

from jaxtdist.ops._op import DistributedOp
from jaxtdist.ops._protocol import Call, check_axis
from jaxtdist.ops.moe._checks import check_combine, check_dispatch, default_recv_rows
from jaxtdist.ops.moe._config import resolved
from jaxtdist.ops.moe._handle import MoeHandle
from jaxtdist.ops.moe._launch import launch_combine, launch_dispatch, summary
from jaxtdist.ops.moe._routing import valid_pairs
from jaxtdist.runtime._runtime import runtime

__all__ = ["COMBINE", "DISPATCH"]


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


def _dispatch_forward(x, expert_ids, scale=None, **static):
    out = launch_dispatch(x, expert_ids, scale, **static)
    return out, out[2]  # the handle: the backward is a combine by it


def _dispatch_backward(handle, ct, *, axis_name, config=None, **static):
    # The handle holds what the static keywords gave the forward. Only the fp8 path
    # splits recv_x, and it is not differentiable: ct[0] is recv_x's cotangent.
    del static
    # The transpose of copying x[t] to each of its expert rows: sum those rows.
    ones = jnp.ones(handle.expert_ids.shape, jnp.float32)
    return COMBINE.launch(ct[0], ones, handle, axis_name=axis_name, config=config), None


def _dispatch_local(x, expert_ids, *, axis_name, num_experts, max_recv_rows=None, split=0,
                    zero_unused_rows=True, config=None):
    del config, zero_unused_rows  # zeros either way: XLA fuses them into the scatter
    t, k = expert_ids.shape
    rows = max_recv_rows or default_recv_rows(t, k, 1, num_experts)
    recv, counts, spos, stk, valid = _local_dispatch(x, expert_ids, num_experts=num_experts,
                                                     rows=rows)
    if split:
        recv = (recv[:, :split], recv[:, split:])
    sizes, dropped = summary(counts, rows)
    # One program, one chunk: the combine's local computation reads no src_ranges.
    handle = MoeHandle(expert_ids, counts, spos, stk, jnp.zeros((1, 1, 2), jnp.int32), dropped,
                       jnp.sum(~valid).astype(jnp.int32), num_experts=num_experts,
                       max_recv_rows=rows, programs=1,
                       axis_name=check_axis(runtime(), axis_name, "moe_dispatch").axes)
    return recv, sizes, handle


def _dispatch_check_config(x, expert_ids, *, axis_name, config, **static):
    del expert_ids, static
    resolved(Call("moe_dispatch", axis_name), *x.shape, x.dtype, config, axis_name)


DISPATCH = DistributedOp("moe_dispatch", forward=_dispatch_forward, backward=_dispatch_backward,
                         check=check_dispatch, local=_dispatch_local,
                         check_config=_dispatch_check_config)


def _combine_forward(y, weights, handle, cotangent=None, **static):
    return launch_combine(y, weights, handle, cotangent, **static), (y, weights, handle)


def _combine_backward(residuals, ct, *, axis_name, config=None):
    y, weights, handle = residuals
    ct = ct.astype(y.dtype)
    # dy: the cotangent of token t's output, sent to each of its experts' rows,
    # times the pair's weight (the same routing lays it out as y is).
    dy = DISPATCH.launch(ct, handle.expert_ids, weights, axis_name=axis_name,
                         num_experts=handle.num_experts, max_recv_rows=handle.max_recv_rows,
                         config=config)[0]
    # dweights[t, k] = <y row of (t, k), ct[t]>: the combine kernel's dot products.
    dw = COMBINE.launch(y, weights, handle, ct, axis_name=axis_name, config=config)[1]
    return dy, dw, None


def _combine_local(y, weights, handle, *, axis_name, config=None):
    """out[t] = sum over records (pos, t * K + k) of weights[t, k] * y[pos] (both
    handle flavours: the local one and the kernels')."""
    del axis_name, config
    t, k = handle.expert_ids.shape
    tk = handle.src_tk.reshape(-1)
    pos = handle.src_pos.reshape(-1)
    # A dropped pair (pos < 0) keeps its tk: its weight, even NaN, must not count.
    w = jnp.where((tk >= 0) & (pos >= 0), weights.reshape(-1)[jnp.maximum(tk, 0)],
                  0).astype(jnp.float32)
    rows = jnp.where((pos >= 0)[:, None], y[jnp.maximum(pos, 0)].astype(jnp.float32), 0)
    out = jnp.zeros((t, y.shape[1]), jnp.float32).at[jnp.where(tk >= 0, tk // k, t)].add(
        w[:, None] * rows, mode="drop")
    return out.astype(y.dtype)


def _combine_check_config(y, weights, handle, *, axis_name, config):
    del weights
    resolved(Call("moe_combine", axis_name), handle.expert_ids.shape[0], y.shape[1], y.dtype,
             config, axis_name)


COMBINE = DistributedOp("moe_combine", forward=_combine_forward, backward=_combine_backward,
                        check=check_combine, local=_combine_local,
                        check_config=_combine_check_config)
