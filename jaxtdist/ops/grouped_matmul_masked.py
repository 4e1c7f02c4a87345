"""jaxtdist.grouped_matmul_masked: the experts' GEMM over the low-latency MoE layout.

x [G, M, H] holds each group's (expert's) rows at the front of its block of M,
``valid_rows[g]`` of them (``moe_dispatch_ll``'s recv_x and its counts); the
rest are padding, never read. One launch of the grouped GEMM kernel
(``kernels/grouped_gemm.py`` with ``MASKED_M``): tiles only over each group's
valid rows, so empty experts and the padding cost nothing. Local (no
communication), not differentiable (decode).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxtdist.ops._fp8_gemm import Fp8Gemm, no_gradient
from jaxtdist.ops._fp8_grouped import grouped_fp8_plan, grouped_kernel_scales
from jaxtdist.ops._op import DistributedOp
from jaxtdist.ops._shapes import check_dtype
from jaxtdist.ops.grouped_matmul import MAX_GROUPS, _check_sizes, _launch

__all__ = ["grouped_matmul_masked"]

_LOCAL = ()  # a group of one device, as grouped_matmul's


def _check(x, w, valid_rows, *, axis_name=_LOCAL, config=None) -> None:
    del axis_name, config
    op = "jaxtdist.grouped_matmul_masked"
    if getattr(x, "ndim", None) != 3 or getattr(w, "ndim", None) != 3:
        raise ValueError(f"{op}: expected x [G, M, H] and w [G, H, F], got x"
                         f"{getattr(x, 'shape', None)}, w{getattr(w, 'shape', None)}")
    g, h, _ = w.shape
    if x.shape[0] != g or x.shape[2] != h:
        raise ValueError(f"{op}: x{x.shape} and w{w.shape} disagree on G or H (x [G, M, H], "
                         "w [G, H, F])")
    if not 1 <= g <= MAX_GROUPS:
        raise ValueError(f"{op}: w{w.shape} has G={g} groups; allowed: 1 to {MAX_GROUPS}")
    if (getattr(valid_rows, "ndim", None) not in (1, 2) or valid_rows.shape[0] != g
            or not jnp.issubdtype(valid_rows.dtype, jnp.integer)):
        got = f"{getattr(valid_rows, 'dtype', None)}{getattr(valid_rows, 'shape', None)}"
        raise ValueError(f"{op}: valid_rows must be integers [G] or [G, W] (summed over W: "
                         f"moe_dispatch_ll's recv_counts) with G = {g}, got {got}")
    check_dtype("grouped_matmul_masked", "x", x.dtype)
    if w.dtype != x.dtype:
        raise ValueError(f"{op}: w has dtype {w.dtype.name}, x {x.dtype.name}: they must "
                         "match (bfloat16, float16 or float32)")


def _valid(valid_rows, m: int) -> jax.Array:
    """Per group valid rows, [G] int32 in [0, M] ([G, W] counts summed over W)."""
    if valid_rows.ndim == 2:
        valid_rows = jnp.sum(valid_rows, axis=1)
    return jnp.clip(valid_rows, 0, m).astype(jnp.int32)


def _forward(x, w, valid_rows, *, axis_name=_LOCAL, config=None):
    del axis_name
    g, m, h = x.shape
    sizes = _valid(valid_rows, m)
    if m == 0:
        return jnp.zeros((g, 0, w.shape[2]), x.dtype), None
    out = _launch(x.reshape(g * m, h), w, sizes, config, w_t=False, masked_m=m)
    return out.reshape(g, m, -1), None


def _fp8_forward(x, w, valid_rows, x_scale, w_scale, *, axis_name=_LOCAL, config=None,
                 plan: Fp8Gemm):
    """FP8: x [G, M, H], K-major w [G, F, H], the scales of ``_fp8_grouped``."""
    del axis_name
    g, m, h = x.shape
    if m == 0:
        return jnp.zeros((g, 0, w.shape[1]), plan.out), None
    xs, ws = grouped_kernel_scales(plan, x_scale, g * m, w_scale, g)
    out = _launch(x.reshape(g * m, h), w, _valid(valid_rows, m), config, w_t=True,
                  masked_m=m, fp8=(plan, xs, ws))
    return out.reshape(g, m, -1), None


_MASKED = DistributedOp("grouped_matmul_masked", forward=_forward, check=_check)
# A variant: jaxtdist.explain's name lookup finds the 16/32-bit op.
_MASKED_FP8 = DistributedOp("grouped_matmul_masked", forward=_fp8_forward, variant="fp8")


def grouped_matmul_masked(x: jax.Array, w: jax.Array, valid_rows: jax.Array, *,
                          x_scale: jax.Array | None = None, w_scale: jax.Array | None = None,
                          out_dtype=None, config: dict | None = None) -> jax.Array:
    """Per group g: ``x[g, :valid_rows[g]] @ w[g]``, over the padded layout.

    The experts' GEMM of the low-latency MoE layer: x is ``moe_dispatch_ll``'s
    recv_x [E / W, W * M, H], valid_rows its recv_counts [E / W, W] (summed per
    expert) or per-expert counts [E / W]. Only the valid rows are read and
    computed (tiles past them are skipped: an empty expert costs nothing);
    rows past them in the result are unspecified (never written), as recv_x's
    are. Counts are data: one compiled program serves every routing.

    Call inside ``jax.shard_map`` (any axes: local to each device). Float32
    accumulation, rounded once to x's dtype. Not differentiable (decode):
    ``jax.grad`` raises ``TypeError`` naming the op; ``grouped_matmul`` is.

    FP8 (``x_scale``, ``w_scale`` given; as ``grouped_matmul``'s, with
    ``jaxtdist.ops._fp8_grouped``'s layouts): x [G, M, H] and w K-major [G, F, H]
    (``jaxtdist.quantize_weight`` of the experts' [G, H, F]) in one FP8 format;
    per tensor x_scale () and w_scale () or [G], or blockwise x_scale [G, M, H /
    128] and w_scale [G, cdiv(F, 128), H / 128]. This is what
    ``moe_dispatch_ll(..., fp8=True)`` hands over: recv_x float8_e4m3fn with
    recv_scale [E / W, W * M, H / 128] (H a multiple of 128). Float32
    accumulation, blockwise scales applied per 128-deep partial, the result in
    ``out_dtype`` (default bfloat16).

    Args:
      x: [G, M, H] bfloat16, float16 or float32; or FP8 with ``x_scale``.
      w: [G, H, F] in x's dtype, 1 <= G <= 256; FP8: [G, F, H] (K-major per group).
      valid_rows: [G] or [G, W] integers: valid rows of each group (clipped to [0, M]).
      x_scale, w_scale: FP8 only: float32 scales, per tensor or blockwise (above).
      out_dtype: FP8 only: bfloat16 (default), float16 or float32.
      config: overrides of ``GroupedMatmulConfig`` (advanced).

    Returns:
      [G, M, F] in x's dtype (FP8: ``out_dtype``); rows ``[valid_rows[g], M)`` of
      group g unspecified.

    Example:
      >>> recv, counts, handle = jaxtdist.moe_dispatch_ll(x, ids, "ep", num_experts=E)
      >>> y = jaxtdist.grouped_matmul_masked(recv, w_local, counts)   # [E / W, W * M, F]
      >>> (q, s), counts, handle = jaxtdist.moe_dispatch_ll(x, ids, "ep", num_experts=E,
      ...                                                   fp8=True)
      >>> wq, ws = jaxtdist.quantize_weight(w_local)                 # [E / W, F, H]
      >>> y = jaxtdist.grouped_matmul_masked(q, wq, counts, x_scale=s, w_scale=ws)
    """
    x, w, valid_rows = (jnp.asarray(a) for a in (x, w, valid_rows))
    plan = grouped_fp8_plan("grouped_matmul_masked", x, w, x_scale, w_scale, out_dtype,
                            masked=True)
    if plan is not None:
        _check_sizes("grouped_matmul_masked", w.shape[0], valid_rows, "valid_rows")
        if x.shape[0] != w.shape[0]:
            raise ValueError(f"jaxtdist.grouped_matmul_masked: x{x.shape} and w{w.shape} "
                             "disagree on G (x [G, M, H], FP8 w [G, F, H])")
        x, w, x_scale, w_scale = no_gradient("grouped_matmul_masked", x, w, x_scale, w_scale)
        return _MASKED_FP8(x, w, valid_rows, x_scale, w_scale, axis_name=_LOCAL,
                           config=config, plan=plan)
    return _MASKED(x, w, valid_rows, axis_name=_LOCAL, config=config)
