"""The input precision of the GEMM kernels' float32 dots, from JAX's matmul precision.

XLA's float32 dots on NVIDIA GPUs run on TF32 tensor cores unless the precision asks
for more (``jax.default_matmul_precision("highest")`` or the
``jax_default_matmul_precision`` flag). The kernels follow the same setting, read when
the op is traced. By default, TF32 on NVIDIA GPUs with the operands rounded to
nearest first ("tf32_rn": the tensor cores alone drop the low bits, 2.6x cuBLAS's
error), the backend's default elsewhere (float32 on AMD; the interpreter multiplies
exactly). Pointer GEMMs round in registers (``kernels._tiles.dot_acc``); TMA GEMMs
feed the tensor cores from shared memory, where rounding would cost a pass through
registers per K step, so XLA rounds their operands beforehand (``kernel_operands``,
fused with the weights' transpose). When float32 accuracy is asked for, three TF32
products on NVIDIA (Triton's ``tf32x3``: float32's accuracy, measured 2e-7 against
XLA's 4-8e-7 on 1 x H100) and float32 on AMD. bf16 and f16 inputs are multiplied
exactly either way.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

if TYPE_CHECKING:  # annotations only
    from jaxtdist.ops._config import Problem

# JAX's precision names that allow TF32 (XLA on GPU rounds to TF32 under them too);
# any other name asks for float32's accuracy.
_TF32_NAMES = frozenset({
    "default", "fastest", "high", "bfloat16", "tensorfloat32", "DEFAULT", "HIGH",
    "BF16_BF16_F32", "TF32_TF32_F32", "F16_F16_F32", "ANY_F8_ANY_F8_F32",
    "ANY_F8_ANY_F8_F32_FAST_ACCUM", "ANY_F8_ANY_F8_ANY", "ANY_F8_ANY_F8_ANY_FAST_ACCUM",
})


def dot_precision(dtype, platform: str = "gpu", vendor: str = "nvidia") -> str | None:
    """A GEMM kernel's ``DOT_PRECISION`` (``kernels._tiles.dot_acc``) for ``dtype``
    inputs under the current ``jax.default_matmul_precision``: None (the backend's
    default; also for 16-bit inputs, where it does not apply), "tf32_rn" (the
    default for float32 on NVIDIA GPUs), or "tf32x3" (NVIDIA, and the interpreter) /
    "ieee" (AMD) when float32 accuracy is asked for.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> dot_precision(jnp.float32)
        'tf32_rn'
        >>> with jax.default_matmul_precision("highest"):
        ...     dot_precision(jnp.float32)
        'tf32x3'
    """
    if jnp.dtype(dtype) != jnp.dtype(jnp.float32):
        return None
    name = jax.config.jax_default_matmul_precision
    if name is None or str(name) in _TF32_NAMES:
        return "tf32_rn" if platform == "gpu" and vendor == "nvidia" else None
    return "ieee" if vendor == "amd" else "tf32x3"


def round_to_tf32(a: jax.Array) -> jax.Array:
    """float32 ``a`` rounded to TF32 (10 mantissa bits) to nearest, ties away from
    zero, as ``cvt.rna.tf32.f32`` rounds; NaNs stay NaNs.

    Example:
        >>> import jax.numpy as jnp
        >>> float(round_to_tf32(jnp.float32(1 + 2**-11)))  # a tie: away from zero
        1.0009765625
    """
    bits = jax.lax.bitcast_convert_type(a, jnp.uint32)
    rounded = jax.lax.bitcast_convert_type(
        (bits + jnp.uint32(0x1000)) & jnp.uint32(0xFFFFE000), jnp.float32)
    return jnp.where(jnp.isnan(a), a, rounded)


def kernel_operands(problem: Problem, x: jax.Array, w: jax.Array, *, tma: bool,
                    exact_x: bool = False,
                    k_major: bool = False) -> tuple[jax.Array, jax.Array, str | None]:
    """(x, w, DOT_PRECISION) as a GEMM kernel for ``problem`` takes them, under the
    current ``jax.default_matmul_precision`` (``dot_precision``).

    Pointer kernels (``tma`` False) round "tf32_rn" operands in registers. TMA
    kernels feed the tensor cores from shared memory, so there XLA rounds w, and x
    unless ``exact_x`` (ag_matmul: the gathered x is the backward's residual), whose
    tiles the kernel then rounds ("tf32_rn_a"). ``k_major``: w handed over with its
    last two axes swapped (the kernels' ``B_T``, ``ops._gemm_config.weights_k_major``),
    in the same XLA fusion as its rounding.
    """
    precision = dot_precision(x.dtype, problem.platform, problem.vendor)
    if tma and precision == "tf32_rn":
        w = round_to_tf32(w)
        if exact_x:
            precision = "tf32_rn_a"
        else:
            x, precision = round_to_tf32(x), None
    if k_major:
        w = jnp.swapaxes(w, -1, -2)
    return x, w, precision
