"""FP8 experts of ``moe_tp_mlp``: the checks and the experts' partial sum.

The expert weights come quantized, K-major per expert (the layout of
``jaxtdist.grouped_matmul``'s FP8 path), this rank's FFN shard:

- w1 (and w_up) [E, F_shard, H]: ``jaxtdist.quantize_weight`` of the [E, H, F]
  weights, sharded over F (axis 1);
- w2 [E, H, F_shard]: ``jaxtdist.quantize_weight`` of the [E, F, H] weights,
  sharded over F (axis 2);

with float32 scales, blockwise (``w1_scale`` [E, cdiv(F_shard, 128), H / 128],
``w2_scale`` [E, cdiv(H, 128), F_shard / 128]: sharded with their weights, so
F_shard and H must be multiples of 128) or per tensor (``()`` or ``[E]``, one per
expert). The activations are quantized on the fly to the weights' format by
``jaxtdist.quantize`` in a JAX pass (not fused into a kernel): each gathered
token once (1 x 128 blocks, or one scale over the tokens per tensor) before its
pairs are formed, the hidden rows (float32, after the activation and the gate)
before the second GEMM. Both GEMMs are ``grouped_matmul``'s FP8 kernel with
float32 results.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from jaxtdist.ops._expert_order import expert_order, sum_pairs
from jaxtdist.ops._fp8_gemm import OUT_DTYPES
from jaxtdist.ops.grouped_matmul import grouped_matmul
from jaxtdist.ops.quant import BLOCK, FP8_DTYPES, quantize

__all__ = ["experts_partial_sum_fp8", "moe_fp8_scaling"]

_OP = "jaxtdist.moe_tp_mlp"
_FORMATS = " or ".join(d.name for d in FP8_DTYPES)


def _name(a) -> str:
    return jnp.dtype(a.dtype).name


def _check_given(weights: dict, scales: dict) -> None:
    """Every FP8 weight has its scale, no scale without an FP8 weight, one format."""
    fp8 = {n: jnp.dtype(w.dtype) in FP8_DTYPES for n, w in weights.items()}
    if not any(fp8.values()):
        for name, s in scales.items():
            if s is not None:
                raise ValueError(
                    f"{_OP}: {name} is given but the expert weights are "
                    f"{', '.join(f'{n} {_name(w)}' for n, w in weights.items())}, not FP8; "
                    f"the scales apply to FP8 weights only ({_FORMATS}, from "
                    "jaxtdist.quantize_weight): drop them or pass FP8 weights")
        return
    formats = {_name(w) for w in weights.values()}
    if not all(fp8.values()) or len(formats) > 1:
        raise ValueError(f"{_OP}: the expert weights are "
                         f"{', '.join(f'{n} {_name(w)}' for n, w in weights.items())}; FP8 "
                         f"experts take every weight in the same FP8 format ({_FORMATS}): "
                         "quantize them all with one dtype")
    for name, s in scales.items():
        if s is None:
            raise ValueError(f"{_OP}: the expert weights are FP8 ({formats.pop()}) but "
                             f"{name} is missing: pass each weight's float32 scales (from "
                             "jaxtdist.quantize_weight)")
        if not hasattr(s, "dtype") or jnp.dtype(s.dtype) != jnp.float32:
            got = _name(s) if hasattr(s, "dtype") else type(s).__name__
            raise ValueError(f"{_OP}: {name} is {got}; scales must be float32 arrays: pass "
                             f"{name}.astype(jnp.float32)")


def _check_layout(x, w1, w2, w_up) -> None:
    """w1 / w_up [E, F, H] and w2 [E, H, F], K-major per expert."""
    h = x.shape[1]
    if w1.ndim != 3 or w1.shape[2] != h:
        hint = (" it looks like [E, H, F_shard]: FP8 expert weights are K-major,"
                if w1.ndim == 3 and w1.shape[1] == h else "")
        raise ValueError(f"{_OP}: FP8 w1 must be [E, F_shard, H] with H={h} (x's hidden "
                         f"size), K-major per expert, got w1{w1.shape};{hint} build it with "
                         "jaxtdist.quantize_weight(w1) of the [E, H, F] weights (it swaps the "
                         "last two axes)")
    e, f, _ = w1.shape
    if w2.shape != (e, h, f):
        hint = (" it looks like [E, F_shard, H]: FP8 expert weights are K-major,"
                if w2.shape == (e, f, h) and f != h else "")
        raise ValueError(f"{_OP}: FP8 w2 must be [E, H, F_shard] = {[e, h, f]} (K-major per "
                         f"expert, to match w1{list(w1.shape)}), got w2{list(w2.shape)};{hint} "
                         "build it with jaxtdist.quantize_weight(w2) of the [E, F, H] weights")
    if w_up is not None and w_up.shape != w1.shape:
        raise ValueError(f"{_OP}: FP8 w_up must be shaped like w1{list(w1.shape)} ([E, "
                         f"F_shard, H]), got w_up{list(w_up.shape)}")


def _scaling_of(weights: dict, scales: dict) -> str:
    """"tensor" (every scale () or [E]) or "block" (each weight's 128 x 128 blocks)."""
    e = weights["w1"].shape[0]
    per_tensor = {n: tuple(s.shape) in ((), (e,)) for n, s in scales.items()}
    if all(per_tensor.values()):
        return "tensor"
    if any(per_tensor.values()):
        raise ValueError(f"{_OP}: the scales mix per-tensor and blockwise layouts "
                         f"({', '.join(f'{n}{list(s.shape)}' for n, s in scales.items())}): "
                         f"give every scale () or [{e}], or every scale blockwise")
    for name, s in scales.items():
        w = weights[name[:-len("_scale")]]
        _, n, k = w.shape
        if k % BLOCK:
            raise ValueError(f"{_OP}: blockwise scales need the contracted size of "
                             f"{name[:-len('_scale')]}{list(w.shape)} a multiple of {BLOCK} "
                             f"(H for w1 / w_up, F_shard for w2), got {k}; pad it or use "
                             f"per-tensor scales (() or [{e}])")
        want = (e, -(-n // BLOCK), k // BLOCK)
        if tuple(s.shape) != want:
            raise ValueError(f"{_OP}: {name}{list(s.shape)} does not fit "
                             f"{name[:-len('_scale')]}{list(w.shape)}: blockwise it is "
                             f"{list(want)} (per expert and 128 x 128 block, "
                             f"jaxtdist.quantize_weight's), per tensor () or [{e}]")
    return "block"


def moe_fp8_scaling(x, w1, w2, w_up, w1_scale, w2_scale, w_up_scale) -> str | None:
    """Checks moe_tp_mlp's FP8 expert weights; returns the scaling ("tensor" or
    "block"), or None for 16/32-bit experts (no scales given).

    Raises:
      ValueError: saying what was given, what is allowed and how to fix it: scales
        with 16/32-bit weights, FP8 weights without scales or of mixed formats,
        non-float32 scales, weights not K-major ([E, H, F] for w1), scale shapes
        that fit neither layout, blockwise scales with H or F_shard not a multiple
        of 128, FP8 x (the op quantizes the activations itself).

    Example:
      >>> moe_fp8_scaling(x, w1q, w2q, None, w1s, w2s, None)   # quantize_weight's
      'block'
    """
    weights = {"w1": w1, "w2": w2} | ({} if w_up is None else {"w_up": w_up})
    scales = {"w1_scale": w1_scale, "w2_scale": w2_scale}
    if w_up is not None or w_up_scale is not None:
        scales["w_up_scale"] = w_up_scale
    _check_given(weights, scales)
    if jnp.dtype(w1.dtype) not in FP8_DTYPES:
        return None
    if jnp.dtype(x.dtype) not in OUT_DTYPES:
        raise ValueError(f"{_OP}: x is {_name(x)}; with FP8 experts x stays in "
                         f"{', '.join(d.name for d in OUT_DTYPES)} (the op quantizes the "
                         "activations itself, per 1 x 128 block or per tensor)")
    _check_layout(x, w1, w2, w_up)
    return _scaling_of(weights, scales)


def _quantized(a: jax.Array, dtype, scaling: str) -> tuple[jax.Array, jax.Array]:
    """Rows quantized to ``dtype``: per 1 x 128 block ("block") or one scale."""
    return quantize(a, dtype, (1, BLOCK) if scaling == "block" else None)


def experts_partial_sum_fp8(xs: jax.Array, ids: jax.Array, gate: jax.Array, k: int,
                            w1: jax.Array, w2: jax.Array, w_up: jax.Array | None,
                            scales: tuple, activation: Callable[[jax.Array], jax.Array],
                            scaling: str) -> jax.Array:
    """``moe_tp._experts_partial_sum``'s FP8 form: [T, H] float32.

    xs [T, H] gathered tokens (16/32-bit); ids, gate [T * K] flat routing; w1,
    w_up [E, F_shard, H], w2 [E, H, F_shard] FP8 with ``scales`` (w1's, w2's,
    w_up's or None). Tokens are quantized once (before their K pairs are
    formed), the hidden rows once in float32; both GEMMs accumulate in float32
    and return float32.
    """
    w1_scale, w2_scale, w_up_scale = scales
    fmt = w1.dtype
    gate, order, position, sizes, valid = expert_order(ids, gate, w1.shape[0])
    q, s = _quantized(xs, fmt, scaling)
    token = order // k
    rows, row_scales = q[token], (s[token] if scaling == "block" else s)   # by expert

    def gemm(a, a_scale, w, w_scale):
        return grouped_matmul(a, w, sizes, x_scale=a_scale, w_scale=w_scale,
                              out_dtype=jnp.float32)

    hidden = activation(gemm(rows, row_scales, w1, w1_scale))
    if w_up is not None:
        hidden = hidden * gemm(rows, row_scales, w_up, w_up_scale)
    hq, hs = _quantized(hidden, fmt, scaling)
    y = gemm(hq, hs, w2, w2_scale)                                      # [T * K, H]
    return sum_pairs(y[position].reshape(-1, k, y.shape[-1]), gate, valid)
