"""FP8 operands of the grouped GEMMs (grouped_matmul, grouped_matmul_masked, and
moe_tp_mlp's experts through them): the checks and the scales as the kernel takes them.

``op(x, w, sizes, x_scale=..., w_scale=..., out_dtype=...)`` with x and w in the
same FP8 format (float8_e4m3fn or float8_e5m2), w K-major per group, [G, F, H]
(group g multiplies by ``w[g].T``: ``jaxtdist.quantize_weight`` of the [G, H, F]
stack, which swaps its last two axes and scales each group on its own), and
float32 dequantization scales (``ops.quant``'s layouts):

- per tensor: ``x_scale`` ``()``; ``w_scale`` ``()`` (one for every group) or
  ``[G]`` (one per group: the stacked scales of ``quantize_weight(w_g,
  block=None)``);
- blockwise: ``x_scale`` ``[R, H / 128]`` (``[G, M, H / 128]`` for the masked
  layout; ``jaxtdist.quantize(x, block=(1, 128))``), ``w_scale`` ``[G, cdiv(F, 128),
  H / 128]`` (``jaxtdist.quantize_weight(w)`` of w [G, H, F]); H a multiple of 128.

The kernel side is ``kernels/grouped_gemm.py``'s ``grouped_gemm_fp8_kernel`` on the
GEMM core's ``SCALING`` (``kernels/_gemm.py``); the plan and the refusal to
differentiate are the dense ops' (``_fp8_gemm``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxtdist.ops._fp8_gemm import Fp8Gemm, fp8_operands
from jaxtdist.ops.quant import BLOCK

__all__ = ["grouped_fp8_plan", "grouped_kernel_scales"]


def _name(dtype) -> str:
    return jnp.dtype(dtype).name


def _check_layout(op: str, x, w, masked: bool) -> None:
    """x [R, H] ([G, M, H] masked) and w K-major [G, F, H]."""
    want_x = "[G, M, H]" if masked else "[R, H]"
    if x.ndim != (3 if masked else 2) or w.ndim != 3:
        raise ValueError(f"jaxtdist.{op}: FP8 operands are x {want_x} and w [G, F, H] "
                         f"(K-major per group), got x{x.shape} and w{w.shape}")
    h = x.shape[-1]
    if w.shape[2] != h:
        if w.shape[1] == h:
            hint = ("it looks like [G, H, F]: FP8 weights are K-major per group, [G, F, H]; "
                    "build them with jaxtdist.quantize_weight(w) on the [G, H, F] stack (it "
                    "swaps the last two axes and scales each group) or pass "
                    "jnp.swapaxes(w, 1, 2)")
        else:
            hint = "FP8 weights are K-major per group, [G, F, H], with x's H"
        raise ValueError(f"jaxtdist.{op}: w{w.shape} does not match x{x.shape} (H={h}): {hint}")


def _scaling(op: str, x, w, x_scale, w_scale, masked: bool) -> str:
    """"tensor" or "block" from the scales' shapes, or a ValueError."""
    g, f, h = w.shape
    xs, ws = tuple(x_scale.shape), tuple(w_scale.shape)
    if xs == () and ws in ((), (g,)):
        return "tensor"
    if xs == () or ws in ((), (g,)):
        raise ValueError(f"jaxtdist.{op}: x_scale{list(xs)} and w_scale{list(ws)} mix per-tensor "
                         f"and blockwise scales: give x_scale () with w_scale () or [{g}] (per "
                         "tensor), or both blockwise")
    if h % BLOCK:
        raise ValueError(f"jaxtdist.{op}: blockwise scales need H a multiple of {BLOCK}, got "
                         f"H={h} (x{list(x.shape)}); pad H or use per-tensor scales "
                         f"(x_scale (), w_scale () or [{g}])")
    want_x = (*x.shape[:-1], h // BLOCK)
    want_w = (g, -(-f // BLOCK), h // BLOCK)
    if (xs, ws) != (want_x, want_w):
        rows = "per row of each group's block" if masked else "per row"
        raise ValueError(
            f"jaxtdist.{op}: scale shapes x_scale{list(xs)} and w_scale{list(ws)} do not fit "
            f"x{list(x.shape)} and w [G, F, H] = {list(w.shape)}: blockwise, x_scale is "
            f"{list(want_x)} ({rows} and 128 columns: jaxtdist.quantize(x, block=(1, 128))) "
            f"and w_scale {list(want_w)} (per group and 128 x 128 block: "
            "jaxtdist.quantize_weight of w [G, H, F]); per tensor, x_scale () and w_scale () "
            f"or [{g}]")
    return "block"


def grouped_fp8_plan(op: str, x, w, x_scale, w_scale, out_dtype, *,
                     masked: bool = False) -> Fp8Gemm | None:
    """Checks a grouped op's FP8 arguments (see the module docstring); returns the
    plan, or None for a call without FP8 (no scales, no out_dtype, neither operand
    FP8).

    Raises:
      ValueError: saying what was given, what is allowed and how to fix it, for
        scales or out_dtype given with 16/32-bit operands, mixed formats, scales
        missing, not float32 or of the wrong shape, w in the [G, H, F] layout, H
        not a multiple of 128 with blockwise scales, an output dtype other than
        bf16 / f16 / f32.

    Example:
      >>> plan = grouped_fp8_plan("grouped_matmul", xq, wq, xs, ws, None)
      >>> plan.scaling, plan.out_dtype
      ('block', 'bfloat16')
    """
    out = fp8_operands(op, x, w, x_scale, w_scale, out_dtype)
    if out is None:
        return None
    _check_layout(op, x, w, masked)
    return Fp8Gemm(_scaling(op, x, w, x_scale, w_scale, masked), out.name)


def grouped_kernel_scales(plan: Fp8Gemm, x_scale: jax.Array, rows: int, w_scale: jax.Array,
                          groups: int) -> tuple[jax.Array, jax.Array]:
    """The scales as ``grouped_gemm_fp8_kernel`` takes them for x's ``rows`` rows (the
    masked layout's G * M): per tensor, x's broadcast to [rows] and w's to [groups];
    blockwise, x's as [rows, H / 128] and w's as given."""
    if plan.scaling == "tensor":
        return (jnp.broadcast_to(x_scale, (rows,)),
                jnp.broadcast_to(w_scale, (groups,)))
    return x_scale.reshape(rows, -1), w_scale
