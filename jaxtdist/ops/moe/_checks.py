"""The checks of moe_dispatch's and moe_combine's arguments (shapes, dtypes, the
handle against the combine's group), and recv_x's default rows."""

from __future__ import annotations

import jax.numpy as jnp

from jaxtdist.ops._protocol import check_axis
from jaxtdist.ops._shapes import check_dtype, traced_hint
from jaxtdist.ops.moe._handle import MoeHandle
from jaxtdist.runtime._runtime import runtime

__all__ = ["check_combine", "check_dispatch", "default_recv_rows"]

def default_recv_rows(tokens: int, top_k: int, world: int, num_experts: int) -> int:
    """recv_x's rows by default: every token of every rank, to min(K, E / W) experts."""
    return world * tokens * min(top_k, num_experts // world)


def check_combine_weights(op: str, weights, expert_ids) -> None:
    """Raises ValueError unless a combine's ``weights`` are floating and shaped like
    the dispatch's ``expert_ids`` ([tokens, top_k])."""
    if getattr(weights, "shape", None) != tuple(expert_ids.shape):
        raise ValueError(f"jaxtdist.{op}: weights must be [tokens, top_k] = "
                         f"{tuple(expert_ids.shape)} like the dispatch's expert_ids, got "
                         f"shape {getattr(weights, 'shape', None)}")
    if not jnp.issubdtype(weights.dtype, jnp.floating):
        raise ValueError(f"jaxtdist.{op}: weights has dtype {jnp.dtype(weights.dtype).name}; "
                         "it must be a floating dtype")


def check_dispatch(x, expert_ids, scale=None, *, axis_name, num_experts, max_recv_rows=None,
                   split=0, zero_unused_rows=True, config=None, trace=False) -> None:
    """Raises ValueError on bad arguments of moe_dispatch (its op's ``check``)."""
    # zero_unused_rows: made a bool by moe_dispatch; scale and trace: the kernels'
    # own (moe_dispatch_kernels).
    del scale, config, zero_unused_rows, trace
    world = check_axis(runtime(), axis_name, "moe_dispatch").world
    if getattr(x, "ndim", None) != 2:
        raise ValueError(f"jaxtdist.moe_dispatch: x must be [tokens, hidden] (2-D), got shape "
                         f"{getattr(x, 'shape', None)}")
    if jnp.dtype(x.dtype) != jnp.uint8:  # uint8: byte rows (the fp8 path's, packed)
        check_dtype("moe_dispatch", "x", x.dtype)
    if (getattr(expert_ids, "ndim", None) != 2 or expert_ids.shape[0] != x.shape[0]):
        raise ValueError(f"jaxtdist.moe_dispatch: expert_ids must be [tokens, top_k] with "
                         f"tokens = x.shape[0] = {x.shape[0]}, got shape "
                         f"{getattr(expert_ids, 'shape', None)}")
    if jnp.dtype(expert_ids.dtype) != jnp.int32:
        raise ValueError(f"jaxtdist.moe_dispatch: expert_ids has dtype "
                         f"{jnp.dtype(expert_ids.dtype).name}; it must be int32 "
                         "(use expert_ids.astype(jnp.int32))")
    if 0 in x.shape or expert_ids.shape[1] == 0:
        raise ValueError(f"jaxtdist.moe_dispatch: empty operand x{x.shape} "
                         f"expert_ids{expert_ids.shape}")
    if (isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1
            or num_experts % world):
        raise ValueError(f"jaxtdist.moe_dispatch: num_experts={num_experts!r} must be a "
                         f"positive multiple of the group size W={world} over {axis_name!r} "
                         f"(an int: experts are split evenly over the ranks)"
                         f"{traced_hint(num_experts)}")
    if expert_ids.shape[1] > num_experts:
        raise ValueError(f"jaxtdist.moe_dispatch: top_k={expert_ids.shape[1]} (expert_ids' "
                         f"columns) exceeds num_experts={num_experts}: a token's experts "
                         "must be distinct")
    if max_recv_rows is not None and (isinstance(max_recv_rows, bool)
                                      or not isinstance(max_recv_rows, int)
                                      or max_recv_rows < 1):
        raise ValueError(f"jaxtdist.moe_dispatch: max_recv_rows={max_recv_rows!r} must be "
                         f"None (every row fits) or an int >= 1{traced_hint(max_recv_rows)}")
    if not 0 <= split < x.shape[1]:
        raise ValueError(f"jaxtdist.moe_dispatch: split={split} must be in [0, H={x.shape[1]})")


def check_combine(y, weights, handle, cotangent=None, *, axis_name, config=None,
                  trace=False) -> None:
    """Raises ValueError on bad arguments of moe_combine, the handle included (its
    op's ``check``)."""
    # cotangent and trace: the kernels' own (moe_combine_kernels).
    del cotangent, config, trace
    layout = check_axis(runtime(), axis_name, "moe_combine")
    world = layout.world
    if not isinstance(handle, MoeHandle):
        raise ValueError(f"jaxtdist.moe_combine: handle must be the MoeHandle that "
                         f"moe_dispatch returned, got {type(handle).__name__}")
    # The handle's arrays are laid out for the dispatch's group: combining over
    # another group reads them with the wrong W (a wrong result, or worse: kernels
    # indexing past the handle's arrays).
    if handle.axis_name is not None and handle.axis_name != layout.axes:
        raise ValueError(f"jaxtdist.moe_combine: axis_name={axis_name!r}, but the handle "
                         f"comes from a moe_dispatch over {handle.axis_name!r}; combine over "
                         "the dispatch's axis_name")
    tokens = getattr(handle.expert_ids, "shape", (None,))[0]
    ranks = getattr(handle.src_ranges, "shape", (None,))[0]
    if ranks != world or getattr(handle.src_pos, "shape", (None,))[0] != world * tokens:
        raise ValueError(f"jaxtdist.moe_combine: the handle was made by a moe_dispatch over "
                         f"{ranks} ranks (src_ranges "
                         f"{getattr(handle.src_ranges, 'shape', None)}), but axis_name "
                         f"{axis_name!r} has W={world} ranks; combine over the dispatch's "
                         "axis_name, with its handle unchanged")
    ranges_shape = getattr(handle.src_ranges, "shape", None)
    if (ranges_shape is None or len(ranges_shape) != 3 or ranges_shape[1] != handle.programs
            or ranges_shape[2] < 2):
        raise ValueError(f"jaxtdist.moe_combine: the handle's src_ranges must be [W, P, NCH "
                         f"+ 1] with P = handle.programs = {handle.programs} and NCH >= 1 "
                         f"chunks, as moe_dispatch returns it, got shape {ranges_shape}; "
                         "pass the dispatch's handle unchanged")
    if getattr(y, "ndim", None) != 2 or y.shape[0] != handle.max_recv_rows:
        raise ValueError(f"jaxtdist.moe_combine: y must be [R, F] with R = the dispatch's "
                         f"max_recv_rows = {handle.max_recv_rows} rows (one per row of recv_x), "
                         f"got shape {getattr(y, 'shape', None)}")
    check_dtype("moe_combine", "y", y.dtype)
    check_combine_weights("moe_combine", weights, handle.expert_ids)
