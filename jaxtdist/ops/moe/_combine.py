"""jaxtdist.moe_combine: the experts' rows back to their tokens, summed with the
routing weights. Its op: the combine kernel (``_launch``) with a dispatch and the
kernel's dot products as the backward, and a gather in pure JAX at world 1."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxtdist.ops._op import DistributedOp, one_call_per_element
from jaxtdist.ops._protocol import Call
from jaxtdist.ops.moe._checks import check_combine
from jaxtdist.ops.moe._config import resolved
from jaxtdist.ops.moe._handle import COMBINE_ARRAYS, MoeHandle, flatten_handle, rebuild_handle
from jaxtdist.ops.moe._launch import moe_combine_kernels, moe_dispatch_kernels

__all__ = ["moe_combine"]


def _local_combine(y, weights, src_pos, src_tk, t, k):
    """out[t] = sum over records (pos, t * K + k) of weights[t, k] * y[pos] (both
    handle flavours: the local one and the kernels')."""
    tk = src_tk.reshape(-1)
    pos = src_pos.reshape(-1)
    # A dropped pair (pos < 0) keeps its tk: its weight, even NaN, must not count.
    w = jnp.where((tk >= 0) & (pos >= 0), weights.reshape(-1)[jnp.maximum(tk, 0)],
                  0).astype(jnp.float32)
    rows = jnp.where((pos >= 0)[:, None], y[jnp.maximum(pos, 0)].astype(jnp.float32), 0)
    out = jnp.zeros((t, y.shape[1]), jnp.float32).at[jnp.where(tk >= 0, tk // k, t)].add(
        w[:, None] * rows, mode="drop")
    return out.astype(y.dtype)


# The op's arrays after y and weights: the handle's COMBINE_ARRAYS; its static
# keywords: the handle's (flatten_handle).

def _forward(y, weights, *arrays, axis_name, config=None, **static):
    handle = rebuild_handle(COMBINE_ARRAYS, arrays, **static)
    out = moe_combine_kernels(y, handle, weights, axis_name, config=config)
    return out, (y, weights, *arrays)


def _backward(residuals, ct, *, axis_name, config=None, **static):
    y, weights, *arrays = residuals
    expert_ids = rebuild_handle(COMBINE_ARRAYS, arrays, **static).expert_ids
    ct = ct.astype(y.dtype)

    def dispatch(ct, ids, w):
        # dy: the cotangent of token t's output, sent to each of its experts' rows,
        # times the pair's weight (the same routing lays it out as y is).
        return moe_dispatch_kernels(ct, ids, axis_name, num_experts=static["num_experts"],
                                    max_recv_rows=static["max_recv_rows"], scale=w,
                                    config=config)[0]

    def combine(y, w, ct, *arrays):
        # dweights[t, k] = <y row of (t, k), ct[t]>: the combine kernel's dot products.
        handle = rebuild_handle(COMBINE_ARRAYS, arrays, **static)
        return moe_combine_kernels(y, handle, w, axis_name, cotangent=ct, config=config)[1]

    # One whole kernel call per element under jax.vmap, like every backward's.
    dy = one_call_per_element(dispatch)(ct, expert_ids, weights)
    dw = one_call_per_element(combine)(y, weights, ct, *arrays)
    return (dy, dw) + (None,) * len(arrays)


def _local(y, weights, *arrays, axis_name, config=None, **static):
    del axis_name, config
    handle = rebuild_handle(COMBINE_ARRAYS, arrays, **static)
    t, k = handle.expert_ids.shape
    return _local_combine(y, weights, handle.src_pos, handle.src_tk, t, k)


def _check(y, weights, *arrays, axis_name, config=None, **static) -> None:
    del config
    check_combine(y, weights, rebuild_handle(COMBINE_ARRAYS, arrays, **static),
                  axis_name=axis_name)


def _check_config(y, weights, *arrays, axis_name, config, **static):
    del weights
    tokens = rebuild_handle(COMBINE_ARRAYS, arrays, **static).expert_ids.shape[0]
    resolved(Call("moe_combine", axis_name), tokens, y.shape[1], y.dtype, config, axis_name)


_COMBINE = DistributedOp("moe_combine", forward=_forward, backward=_backward, check=_check,
                         local=_local, check_config=_check_config)


def moe_combine(y: jax.Array, handle: MoeHandle, weights: jax.Array, axis_name, *,
                config: dict | None = None) -> jax.Array:
    """Brings the experts' rows back to their tokens and sums them with the weights.

    ``out[t] = sum_k weights[t, k] * (row of y holding token t's copy for
    expert expert_ids[t, k])``, accumulated in float32, in y's dtype; dropped
    and invalid pairs contribute zero. Differentiable in ``y`` and ``weights``.

    Args:
      y: [R, F] the experts' outputs, one row per row of the dispatch's recv_x.
      handle: the ``MoeHandle`` of that dispatch (same ``axis_name``).
      weights: [T, K] routing weights of this rank's tokens (any float dtype).
      axis_name: the dispatch's axis.
      config: overrides of ``MoeConfig`` (advanced; NUM_PROGRAMS is the dispatch's).

    Returns:
      [T, F] in y's dtype.

    Example:
      >>> out = jaxtdist.moe_combine(jax.lax.ragged_dot(recv, w, sizes), handle, gate, "ep")
    """
    y, weights = jnp.asarray(y), jnp.asarray(weights)
    # Here, with the handle itself: _COMBINE's check sees only its arrays (not the
    # dispatch's axis_name).
    check_combine(y, weights, handle, axis_name=axis_name)
    arrays, static = flatten_handle(handle, COMBINE_ARRAYS)
    return _COMBINE(y, weights, *arrays, axis_name=axis_name, config=config, **static)
