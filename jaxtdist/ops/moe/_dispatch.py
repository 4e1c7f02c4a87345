"""jaxtdist.moe_dispatch: every (token, expert) pair to its expert's rank, grouped
by local expert (the op: ``_ops.DISPATCH``; fp8 rows packed around it)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxtdist.ops._shapes import check_dtype, static_bool
from jaxtdist.ops.moe._fp8 import check_fp8, fp8_rows, fp8_unpack
from jaxtdist.ops.moe._handle import MoeHandle
from jaxtdist.ops.moe._ops import DISPATCH

__all__ = ["moe_dispatch", "moe_dispatch_kernels"]


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
    recv, sizes, handle = DISPATCH(rows_in, expert_ids, axis_name=axis_name,
                                   num_experts=num_experts, max_recv_rows=max_recv_rows,
                                   split=split, zero_unused_rows=zero_unused_rows, config=config)
    if x_scale is not None:
        recv = fp8_unpack(recv, x.dtype, x_scale.shape[1])
    return recv, sizes, handle


def moe_dispatch_kernels(x: jax.Array, expert_ids: jax.Array, axis_name, *, num_experts: int,
                         max_recv_rows: int | None = None, scale: jax.Array | None = None,
                         split: int = 0, config: dict | None = None, trace: bool = False,
                         zero_unused_rows: bool = True):
    """moe_dispatch's kernel, at world 1 too (benchmarks, tests); not differentiable.

    With ``trace``, also returns an int32 [P, 6] array of per-program timestamps
    (low 32 bits of the GPU's ns clock; subtract modulo 2**32) at the kernel's
    phases (``kernels/moe.py``, TRACE_PHASES): a probe's view of where the time goes.

    ``scale`` [T, K] (optional): the copy of token t for its k-th expert is
    multiplied by ``scale[t, k]`` (combine's backward uses it). ``split`` (0 <
    split < H): recv_x is the pair ([R, split], [R, H - split]) of each row's
    first columns and the rest (fp8 byte rows: tokens and scales).
    ``zero_unused_rows``: as ``moe_dispatch``'s.
    Returns (recv_x, group_sizes, handle), as ``moe_dispatch``.
    """
    scale = None if scale is None else jnp.asarray(scale)
    return DISPATCH.kernels(jnp.asarray(x), jnp.asarray(expert_ids), scale, axis_name=axis_name,
                            num_experts=num_experts, max_recv_rows=max_recv_rows, split=split,
                            zero_unused_rows=zero_unused_rows, config=config, trace=trace)
