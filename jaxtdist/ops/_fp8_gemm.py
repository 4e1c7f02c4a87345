"""FP8 operands of the GEMM ops (ag_matmul, matmul_rs, matmul_ar): one API for all.

``op(x, w, axis, x_scale=..., w_scale=..., out_dtype=...)`` with x and w in the
same FP8 format (float8_e4m3fn or float8_e5m2), w K-major [N, K], and float32
dequantization scales (``ops.quant``'s layouts, of the op's local shards):

- per tensor: ``x_scale`` and ``w_scale`` of shape ``()``;
- blockwise: ``x_scale`` [M, K / 128] (per row and 128 columns), ``w_scale``
  [cdiv(N, 128), K / 128] (per 128 x 128 block); K a multiple of 128.

K-sharded operands (``matmul_rs``, ``matmul_ar``): x [M, k_shard] and w
[N, k_shard] (``jaxtdist.quantize_weight`` of the [k_shard, N] shard), scales of
this rank's shards: per tensor, or blockwise x_scale [M, k_shard / 128] and
w_scale [cdiv(N, 128), k_shard / 128] (sharded along K like their operands'
columns); k_shard a multiple of 128. Each rank's partial is scaled in float32
and the partials are summed in float32; the result is in ``out_dtype``
(default bfloat16). A group of one rank runs XLA: its FP8 dot (per tensor) or
the float32 dot of the dequantized operands (blockwise). Not differentiable (a
TypeError names the arguments).

This follows JAX's ``jax.nn.scaled_matmul`` layout (rhs [.., N, K], contracted
on its last axis) and ``moe_dispatch``'s ``x_scale`` (dequantization
multipliers, float32). Here: the checks (``fp8_plan``), the scales as the
kernels take them (``kernel_scales``), the local computation of a group of one
rank (``local_matmul``: XLA's FP8 dot) and the refusal to differentiate
(``no_gradient``). The kernels' side is ``kernels/_gemm.py``'s SCALING.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

try:  # public in jax 0.10; kept importable from its private home should that move
    from jax.custom_derivatives import SymbolicZero
except ImportError:  # pragma: no cover
    from jax._src.custom_derivatives import SymbolicZero

from jaxtdist.ops.quant import BLOCK, FP8_DTYPES, dequantize

__all__ = ["Fp8Gemm", "OUT_DTYPES", "check_block_k", "fp8_operands", "fp8_plan",
           "kernel_scales", "local_matmul", "logical_weight", "no_gradient"]

OUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
_CONTRACT_K = (((1,), (1,)), ((), ()))  # x [M, K] . w [N, K] over K


@dataclasses.dataclass(frozen=True)
class Fp8Gemm:
    """An FP8 call's plan: the scaling scheme ("tensor" or "block", the kernels'
    SCALING) and the output dtype's name."""
    scaling: str
    out_dtype: str

    @property
    def out(self) -> jnp.dtype:
        return jnp.dtype(self.out_dtype)


def _name(dtype) -> str:
    return jnp.dtype(dtype).name


def fp8_operands(op: str, x, w, x_scale, w_scale, out_dtype) -> jnp.dtype | None:
    """The checks every FP8 GEMM op shares (dense and grouped): None where neither
    operand is FP8 (and no scale nor out_dtype is given), else the output dtype,
    with x and w in one FP8 format and both scales float32 arrays. The shapes are
    each op's own check.

    Raises:
      ValueError: scales or out_dtype given with 16/32-bit operands, mixed formats,
        a scale missing or not a float32 array, an output dtype not bf16/f16/f32.
    """
    formats = " or ".join(d.name for d in FP8_DTYPES)
    fp8_x, fp8_w = (jnp.dtype(a.dtype) in FP8_DTYPES for a in (x, w))
    if not (fp8_x or fp8_w):
        for name, given in (("x_scale", x_scale), ("w_scale", w_scale),
                            ("out_dtype", out_dtype)):
            if given is not None:
                raise ValueError(
                    f"jaxtdist.{op}: {name} is given but x and w are {_name(x.dtype)} and "
                    f"{_name(w.dtype)}, not FP8; {name} applies to FP8 operands only "
                    f"({formats}, e.g. from jaxtdist.quantize and jaxtdist.quantize_weight): "
                    "drop it or pass FP8 x and w")
        return None
    if not (fp8_x and fp8_w) or x.dtype != w.dtype:
        raise ValueError(f"jaxtdist.{op}: x is {_name(x.dtype)} and w is {_name(w.dtype)}; "
                         f"FP8 GEMMs take x and w in the same FP8 format ({formats}): "
                         "quantize both with the same dtype")
    for name, s in (("x_scale", x_scale), ("w_scale", w_scale)):
        if s is None:
            raise ValueError(f"jaxtdist.{op}: x and w are {_name(x.dtype)}: FP8 operands need "
                             f"their dequantization scales; {name} is missing (float32, per "
                             "tensor or blockwise, e.g. from jaxtdist.quantize)")
        if not hasattr(s, "shape") or not hasattr(s, "dtype"):
            raise ValueError(f"jaxtdist.{op}: {name} must be a float32 array, got "
                             f"{type(s).__name__}")
        if jnp.dtype(s.dtype) != jnp.float32:
            raise ValueError(f"jaxtdist.{op}: {name} has dtype {_name(s.dtype)}; scales must "
                             f"be float32: pass {name}.astype(jnp.float32)")
    out = jnp.dtype(jnp.bfloat16) if out_dtype is None else jnp.dtype(out_dtype)
    if out not in OUT_DTYPES:
        raise ValueError(f"jaxtdist.{op}: out_dtype={out.name} is not supported for FP8; use "
                         f"{', '.join(d.name for d in OUT_DTYPES)} (default bfloat16)")
    return out


def fp8_plan(op: str, x, w, x_scale, w_scale, out_dtype) -> Fp8Gemm | None:
    """Checks an op's FP8 arguments; returns the plan, or None for a call without
    FP8 (no scales, no out_dtype, neither operand FP8).

    Raises:
      ValueError: saying what was given, what is allowed and how to fix it, for
        scales missing or given without FP8 operands, mixed formats, scales not
        float32 or of the wrong shape, a weight not K-major, K not a multiple of
        128 with blockwise scales, an output dtype that is not bf16/f16/f32.
    """
    out = fp8_operands(op, x, w, x_scale, w_scale, out_dtype)
    if out is None:
        return None
    if x.ndim != 2 or w.ndim != 2:
        raise ValueError(f"jaxtdist.{op}: x and w must be 2-D, got x{x.shape} and w{w.shape}")
    m, k = x.shape
    if w.shape[1] != k:
        hint = ("it looks like [K, N]: FP8 weights are K-major [N, K], pass w.T or build it "
                "with jaxtdist.quantize_weight" if w.shape[0] == k else
                "FP8 weights are K-major [N, K] with x's K")
        raise ValueError(f"jaxtdist.{op}: w{w.shape} does not match x{x.shape} (K={k}): {hint}")
    if 0 in x.shape or 0 in w.shape:
        raise ValueError(f"jaxtdist.{op}: empty operand x{x.shape} w{w.shape}")
    n = w.shape[0]
    shapes = (tuple(x_scale.shape), tuple(w_scale.shape))
    if shapes == ((), ()):
        return Fp8Gemm("tensor", out.name)
    if k % BLOCK:
        raise ValueError(f"jaxtdist.{op}: blockwise scales need K a multiple of {BLOCK}, got "
                         f"K={k} (x_scale{list(shapes[0])}, w_scale{list(shapes[1])}); pad K "
                         "or use per-tensor scales (shape ())")
    want = ((m, k // BLOCK), (-(-n // BLOCK), k // BLOCK))
    if shapes != want:
        raise ValueError(f"jaxtdist.{op}: scale shapes x_scale{list(shapes[0])} and "
                         f"w_scale{list(shapes[1])} do not fit x{list(x.shape)} and w [N, K] = "
                         f"{list(w.shape)}: give both per tensor (shape ()) or both blockwise, "
                         f"x_scale{list(want[0])} (per row and 128 columns: "
                         f"jaxtdist.quantize(x, block=(1, 128))) and w_scale{list(want[1])} "
                         f"(per 128 x 128 block: jaxtdist.quantize_weight(w))")
    return Fp8Gemm("block", out.name)


def check_block_k(op: str, plan: Fp8Gemm, block_k: int) -> None:
    """Blockwise scales apply per K step: BLOCK_K must divide 128."""
    if plan.scaling == "block" and BLOCK % block_k:
        raise ValueError(f"jaxtdist.{op}: config BLOCK_K={block_k} does not divide {BLOCK}: "
                         "blockwise FP8 scales are applied per K step; use BLOCK_K <= 128")


def logical_weight(w) -> jax.ShapeDtypeStruct:
    """The [K, N] shape of a K-major FP8 weight [N, K] (what configs and problems
    are keyed on, as for 16-bit weights)."""
    return jax.ShapeDtypeStruct((w.shape[1], w.shape[0]), w.dtype)


def kernel_scales(plan: Fp8Gemm, x_scale: jax.Array, rows: int,
                  w_scale: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The scales as the kernels take them (``kernels/_gemm.py``) for x with ``rows``
    rows: per tensor, x's broadcast to one per row ([rows]: a gathered x then
    carries each rank's own) and w's as [1]; blockwise, as given."""
    if plan.scaling == "tensor":
        return jnp.broadcast_to(x_scale, (rows,)), w_scale.reshape(1)
    return x_scale, w_scale


def local_matmul(x, w, x_scale, w_scale, plan: Fp8Gemm) -> jax.Array:
    """``x @ w.T`` dequantized, on one rank, by XLA. Per tensor: XLA's FP8 dot
    (``dot_general`` of the FP8 operands contracting dim 1 of both, float32
    accumulation: cuBLASLt's FP8 GEMM on Hopper, no transpose), then the two
    scales. Blockwise (no XLA path on Hopper): the dequantized operands'
    float32 product."""
    if plan.scaling == "tensor":
        acc = jax.lax.dot_general(x, w, _CONTRACT_K, preferred_element_type=jnp.float32)
        return (acc * (x_scale * w_scale)).astype(plan.out)
    acc = jax.lax.dot_general(dequantize(x, x_scale), dequantize(w, w_scale), _CONTRACT_K,
                              precision=jax.lax.Precision.HIGHEST,
                              preferred_element_type=jnp.float32)
    return acc.astype(plan.out)


_NAMES = ("x", "w", "x_scale", "w_scale")


def no_gradient(op: str, *operands, names: tuple = _NAMES):
    """``operands`` (x, w, x_scale, w_scale; or those ``names`` names, arrays or None)
    unchanged; differentiating any of them raises ``TypeError`` naming those asked
    for: the FP8 path has no backward pass (a plain backward through FP8 casts would
    give silently wrong gradients)."""
    # The op's name is carried by a closure: the rule raises before anything runs.
    @jax.custom_jvp
    def guard(*args):
        return args

    def rule(primals, tangents):
        del primals
        asked = [n for n, t in zip(names, tangents)
                 if t is not None and not isinstance(t, SymbolicZero)]
        raise TypeError(
            f"jaxtdist.{op}: the FP8 path is not differentiable: its arguments "
            f"{', '.join(asked) or ', '.join(names)} carry no gradient here (FP8 training "
            "recipes are not implemented); differentiate a bfloat16/float16/float32 call "
            "(no scales), or stop the gradient before quantizing (jax.lax.stop_gradient)")

    guard.defjvp(rule, symbolic_zeros=True)
    return guard(*operands)
