"""jaxtdist.moe_combine: the experts' rows back to their tokens, summed with the
routing weights (the op: ``_ops.COMBINE``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxtdist.ops.moe._handle import MoeHandle
from jaxtdist.ops.moe._ops import COMBINE

__all__ = ["moe_combine", "moe_combine_kernels"]


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
    return COMBINE(jnp.asarray(y), jnp.asarray(weights), handle, axis_name=axis_name,
                   config=config)


def moe_combine_kernels(y: jax.Array, handle: MoeHandle, weights: jax.Array, axis_name, *,
                        cotangent: jax.Array | None = None, config: dict | None = None,
                        trace: bool = False):
    """moe_combine's kernel, at world 1 too (benchmarks, tests); not differentiable.

    With ``cotangent`` [T, F], returns (out, dots) where dots[t, k] = <y row of
    (t, k), cotangent[t]> (float32); else out. With ``trace``, the int32 [P, 6]
    timestamps (as ``moe_dispatch_kernels``'s; phases 0-3) come last.
    """
    cotangent = None if cotangent is None else jnp.asarray(cotangent)
    return COMBINE.kernels(jnp.asarray(y), jnp.asarray(weights), handle, cotangent,
                           axis_name=axis_name, config=config, trace=trace)
