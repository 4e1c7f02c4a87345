"""jaxtdist.moe_dispatch_ll / moe_combine_ll: the low-latency (decode) MoE exchange,
expert-major padded layout (kernels/moe_ll.py).

A pair of ops beside ``moe_dispatch`` / ``moe_combine``, not a ``layout=`` argument
of theirs: the results' shapes ([E / W, W * M, H] and per-(expert, source) counts
against [R, H] and group sizes), the handle, the workspaces and the kernels all
differ, and neither is differentiable, so each pair stays one short declaration
on ``DistributedOp`` and no shared entry branches on a string.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxtdist.ops._op import DistributedOp
from jaxtdist.ops._protocol import check_axis
from jaxtdist.ops._shapes import check_dtype, static_bool, traced_hint
from jaxtdist.ops.moe._checks import check_combine_weights
from jaxtdist.ops.moe._fp8 import FP8_DTYPES
from jaxtdist.ops.moe._ll_handle import MoeLLHandle
from jaxtdist.ops.moe._ll_launch import launch_combine_ll, launch_dispatch_ll
from jaxtdist.runtime._runtime import runtime

__all__ = ["moe_combine_ll", "moe_dispatch_ll"]


def _check_dispatch(x, expert_ids, *, axis_name, num_experts, max_tokens_per_rank=None,
                    fp8=False, config=None) -> None:
    """Raises ValueError on bad arguments of moe_dispatch_ll."""
    del fp8, config
    op = "jaxtdist.moe_dispatch_ll"
    world = check_axis(runtime(), axis_name, "moe_dispatch_ll").world
    if getattr(x, "ndim", None) != 2 or 0 in x.shape:
        raise ValueError(f"{op}: x must be [tokens, hidden] (2-D, non-empty), got shape "
                         f"{getattr(x, 'shape', None)}")
    if jnp.dtype(x.dtype) in FP8_DTYPES:
        raise ValueError(f"{op}: x is {jnp.dtype(x.dtype).name}; pass the 16-bit or float32 "
                         "tokens with fp8=True: the kernel quantizes them as it sends them")
    check_dtype("moe_dispatch_ll", "x", x.dtype)
    if (getattr(expert_ids, "ndim", None) != 2 or expert_ids.shape[0] != x.shape[0]
            or expert_ids.shape[1] == 0):
        raise ValueError(f"{op}: expert_ids must be [tokens, top_k] with tokens = x.shape[0] "
                         f"= {x.shape[0]} and top_k >= 1, got shape "
                         f"{getattr(expert_ids, 'shape', None)}")
    if jnp.dtype(expert_ids.dtype) != jnp.int32:
        raise ValueError(f"{op}: expert_ids has dtype {jnp.dtype(expert_ids.dtype).name}; it "
                         "must be int32 (use expert_ids.astype(jnp.int32))")
    if (isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1
            or num_experts % world):
        raise ValueError(f"{op}: num_experts={num_experts!r} must be a positive multiple of "
                         f"the group size W={world} over {axis_name!r} (an int: experts are "
                         f"split evenly over the ranks){traced_hint(num_experts)}")
    if expert_ids.shape[1] > num_experts:
        raise ValueError(f"{op}: top_k={expert_ids.shape[1]} (expert_ids' columns) exceeds "
                         f"num_experts={num_experts}: a token's experts must be distinct")
    t = x.shape[0]
    if max_tokens_per_rank is not None and (
            isinstance(max_tokens_per_rank, bool) or not isinstance(max_tokens_per_rank, int)
            or max_tokens_per_rank < t):
        raise ValueError(f"{op}: max_tokens_per_rank={max_tokens_per_rank!r} must be None "
                         f"(this rank's T = {t} tokens) or an int >= T = {t}: every token's "
                         f"copy has its slot, none is dropped{traced_hint(max_tokens_per_rank)}")


def _dispatch_forward(x, expert_ids, **static):
    return launch_dispatch_ll(x, expert_ids, **static), None


DISPATCH_LL = DistributedOp("moe_dispatch_ll", forward=_dispatch_forward, check=_check_dispatch)


def _check_combine(y, weights, handle, *, axis_name, config=None) -> None:
    """Raises ValueError on bad arguments of moe_combine_ll, the handle included."""
    del config
    op = "jaxtdist.moe_combine_ll"
    layout = check_axis(runtime(), axis_name, "moe_combine_ll")
    if not isinstance(handle, MoeLLHandle):
        raise ValueError(f"{op}: handle must be the MoeLLHandle that moe_dispatch_ll "
                         f"returned, got {type(handle).__name__}")
    if handle.axis_name is not None and handle.axis_name != layout.axes:
        raise ValueError(f"{op}: axis_name={axis_name!r}, but the handle comes from a "
                         f"moe_dispatch_ll over {handle.axis_name!r}; combine over the "
                         "dispatch's axis_name")
    world, e_loc = layout.world, handle.num_experts // layout.world
    rows = world * handle.max_tokens_per_rank
    if getattr(y, "ndim", None) != 3 or tuple(y.shape[:2]) != (e_loc, rows):
        raise ValueError(f"{op}: y must be [E / W, W * M, F] = [{e_loc}, {rows}, F] (one row "
                         f"per row of the dispatch's recv_x), got shape "
                         f"{getattr(y, 'shape', None)}")
    check_dtype("moe_combine_ll", "y", y.dtype)
    check_combine_weights("moe_combine_ll", weights, handle.expert_ids)


def _combine_forward(y, weights, handle, **static):
    return launch_combine_ll(y, weights, handle, **static), None


COMBINE_LL = DistributedOp("moe_combine_ll", forward=_combine_forward, check=_check_combine)


def _static_int(value):
    """NumPy integers (a shape's, a config's) as ints; anything else unchanged."""
    return int(value) if isinstance(value, np.integer) and not isinstance(value, np.bool_) \
        else value


def moe_dispatch_ll(x: jax.Array, expert_ids: jax.Array, axis_name, *, num_experts: int,
                    max_tokens_per_rank: int | None = None, fp8: bool = False,
                    config: dict | None = None) -> tuple[Any, jax.Array, MoeLLHandle]:
    """Sends every (token, expert) copy to a fixed slot of its expert's rank (decode).

    The low-latency layout: copy i of source rank s for local expert le lands in
    slot ``[le, s * M + i]`` of the expert's rank's heap inbox, where i counts
    s's earlier tokens routed to the same expert (M = ``max_tokens_per_rank``).
    The sender computes every slot from its own routing, so nothing else is
    exchanged: no layout pass, no remote atomics, nothing zeroed; the
    per-(expert, source) counts travel as the completion signals. The
    receiver's copy out of its inbox packs each expert's rows at the front of
    its block: ``recv_x[le, :sum(recv_counts[le])]``, source by source, each
    source's in token order (the masked grouped GEMM reads one prefix per
    expert). Static shapes, no host synchronization: one
    compiled program serves every routing. Use it for decode (few tokens per
    rank); ``moe_dispatch`` (packed rows) for prefill and training.

    Not differentiable (decode: inference only): ``jax.grad`` through it raises
    ``TypeError`` naming the op; use ``moe_dispatch`` where gradients flow.

    Heap: the inbox is double-buffered, ``2 x E x M x (H x itemsize + 4 + 4 S)``
    bytes per rank (``jaxtdist.ops.moe.ll_heap_bytes``; S = 0, or the FP8 scales);
    ``HeapExhaustedError`` says what was asked for: lower M or raise
    ``initialize(mesh, heap_bytes=...)``.

    Args:
      x: [T, H] this rank's tokens (bfloat16, float16 or float32).
      expert_ids: [T, K] int32 top-K routing in [0, E). Ids outside [0, E) are
        not sent; a repeat of an earlier expert of the token is sent once (for
        its first k). Both count in ``handle.invalid`` and weigh zero in combine.
      axis_name: mesh axis (or tuple of axes) of the expert-parallel group (W ranks).
      num_experts: E, a multiple of W; rank r owns experts ``[r E / W, (r + 1) E / W)``.
      max_tokens_per_rank: M >= T (static), the slots per source rank; default T.
      fp8: quantize in the send: each token's 1 x 128 column blocks as e4m3
        bytes with a float32 scale per block (amax / 448, x ~ bytes * scale),
        half the bytes of bfloat16 on the links.
      config: overrides of ``MoeLLConfig`` (advanced).

    Returns:
      ``recv_x`` [E / W, W * M, H] in x's dtype (with ``fp8``: the pair
      ``(recv_x float8_e4m3fn, recv_scale [E / W, W * M, ceil(H / 128)]
      float32)``); only each expert's first ``sum(recv_counts[le])`` rows are
      written (source s's from ``sum(recv_counts[le, :s])``), the others are
      unspecified (they may hold NaN).
      ``recv_counts`` [E / W, W] int32. ``handle``: a ``MoeLLHandle`` for
      ``moe_combine_ll``.

    Example:
      >>> def decode_moe(x, ids, gate, w):              # inside shard_map over "ep"
      ...     recv, counts, handle = jaxtdist.moe_dispatch_ll(x, ids, "ep", num_experts=8)
      ...     y = jaxtdist.grouped_matmul_masked(recv, w, counts)   # [E / W, W * M, F]
      ...     return jaxtdist.moe_combine_ll(y, handle, gate, "ep")
    """
    x, expert_ids = jnp.asarray(x), jnp.asarray(expert_ids)
    fp8 = static_bool("moe_dispatch_ll", "fp8", fp8)
    recv, counts, handle = DISPATCH_LL(
        x, expert_ids, axis_name=axis_name, num_experts=_static_int(num_experts),
        max_tokens_per_rank=_static_int(max_tokens_per_rank), fp8=fp8, config=config)
    if fp8:
        recv = (jax.lax.bitcast_convert_type(recv[0], jnp.float8_e4m3fn), recv[1])
    return recv, counts, handle


def moe_combine_ll(y: jax.Array, handle: MoeLLHandle, weights: jax.Array, axis_name, *,
                   config: dict | None = None) -> jax.Array:
    """Brings the experts' rows of the low-latency layout back, summed with the weights.

    ``out[t] = sum_k weights[t, k] * (row of y holding token t's copy for expert
    expert_ids[t, k])`` over the valid pairs, accumulated in float32, in y's
    dtype. Each row crosses the link once (unweighed, in y's dtype); the
    token's rank weighs and sums. Only the counted rows of y are read. Not
    differentiable (``TypeError`` under ``jax.grad``, naming the op).

    Args:
      y: [E / W, W * M, F] the experts' outputs, row for row of the dispatch's recv_x.
      handle: the ``MoeLLHandle`` of that dispatch (same ``axis_name``).
      weights: [T, K] routing weights of this rank's tokens (any float dtype).
      axis_name: the dispatch's axis.
      config: overrides of ``MoeLLConfig`` (advanced).

    Returns:
      [T, F] in y's dtype.

    Example:
      >>> out = jaxtdist.moe_combine_ll(y, handle, gate, "ep")
    """
    return COMBINE_LL(jnp.asarray(y), jnp.asarray(weights), handle, axis_name=axis_name,
                      config=config)
