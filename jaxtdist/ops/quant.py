"""FP8 quantization in plain JAX: ``quantize``, ``dequantize`` and ``quantize_weight``.

Scales are dequantization multipliers, ``x ~ q.astype(float32) * scale`` (as
Hugging Face's FP8 checkpoints' ``weight_scale_inv`` and ``moe_dispatch``'s
``x_scale``), float32, in one of three layouts:

- per tensor (``block=None``): one scale, shape ``()``;
- per (row, 128 columns) (``block=(1, 128)``, activations): ``[R, C / 128]``;
- per 128 x 128 block (``block=(128, 128)``, weights): ``[cdiv(R, 128), C / 128]``.

A scale is ``amax / max`` of its block (``max`` the format's largest finite
value: 448 for float8_e4m3fn, 57344 for float8_e5m2), so the block's largest
magnitude maps onto the format's largest; an all-zero block gets scale 1.

Saturation: values are clamped to the format's finite range before the cast,
so a value past the range (possible with a scale given by the caller, or
+-inf in the input) becomes +-max, never inf or NaN (a plain ``astype`` gives
NaN for float8_e4m3fn, which has no infinity). NaN stays NaN. The amax that
picks a scale ignores +-inf (a block holding inf is scaled by its finite
values, and the inf saturates).

The GEMM ops take the weight K-major, ``[N, K]`` (``quantize_weight``): Hopper's
8-bit tensor-core instructions read both operands K-major, the layout of JAX's
``jax.nn.scaled_matmul`` (rhs ``[.., N, K]``) and of the FP8 checkpoints
(``weight`` ``[out, in]``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["FP8_DTYPES", "dequantize", "quantize", "quantize_weight"]

FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
BLOCK = 128
_BLOCKS = (None, (1, BLOCK), (BLOCK, BLOCK))


def _fp8_dtype(dtype, where: str) -> jnp.dtype:
    try:
        dtype = jnp.dtype(dtype)
    except TypeError:
        dtype = None
    if dtype not in FP8_DTYPES:
        raise ValueError(f"jaxtdist.{where}: dtype={dtype} is not an FP8 format; use "
                         f"{' or '.join(d.name for d in FP8_DTYPES)}")
    return dtype


def _check_block(block, where: str) -> tuple | None:
    block = None if block is None else tuple(block)
    if block not in _BLOCKS:
        raise ValueError(f"jaxtdist.{where}: block={block!r} is not supported; use None (one "
                         "scale per tensor), (1, 128) (per row and 128 columns, activations) "
                         "or (128, 128) (per 128 x 128 block, weights)")
    return block


def _blocked_amax(x: jax.Array, block: tuple) -> jax.Array:
    """The finite amax of each block of the last two axes, [..., cdiv(R, br), C / 128]."""
    br, bc = block
    *lead, r, c = x.shape
    a = jnp.abs(x.astype(jnp.float32))
    a = jnp.where(jnp.isinf(a), 0.0, a)
    pad_r = -r % br
    if pad_r:  # a partial last row block (weights with N not a multiple of 128)
        a = jnp.pad(a, [(0, 0)] * len(lead) + [(0, pad_r), (0, 0)])
    a = a.reshape(*lead, (r + pad_r) // br, br, c // bc, bc)
    return jnp.max(a, axis=(-3, -1))


def _expand(scale: jax.Array, block: tuple, shape: tuple) -> jax.Array:
    """Block scales broadcast to every element of ``shape``."""
    br, bc = block
    r, c = shape[-2:]
    full = jnp.repeat(jnp.repeat(scale, br, axis=-2), bc, axis=-1)
    return full[..., :r, :c]


def quantize(x: jax.Array, dtype=jnp.float8_e4m3fn, block=None,
             scale: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Quantizes ``x`` to FP8 with float32 dequantization scales (``x ~ q * scale``).

    Args:
      x: a float array; blockwise, at least 2-D, the last two axes blocked, the
        last one (K) a multiple of 128.
      dtype: ``jnp.float8_e4m3fn`` (default) or ``jnp.float8_e5m2``.
      block: None (one scale), ``(1, 128)`` or ``(128, 128)`` (see the module
        docstring for the scale shapes).
      scale: per tensor only: a given float32 scale (static or delayed scaling)
        instead of ``amax / max``; values past the range then saturate.

    Returns:
      (q in ``dtype``, float32 scale).

    Raises:
      ValueError: an unknown format or block, K not a multiple of 128, a scale
        given with a block.

    Example:
      >>> q, s = jaxtdist.quantize(x, block=(1, 128))   # x [M, K] -> s [M, K / 128]
      >>> jnp.allclose(jaxtdist.dequantize(q, s), x, rtol=0.07)
    """
    dtype = _fp8_dtype(dtype, "quantize")
    block = _check_block(block, "quantize")
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"jaxtdist.quantize: x has dtype {x.dtype.name}; give a float array")
    fmax = float(jnp.finfo(dtype).max)
    if block is None:
        if scale is None:
            a = jnp.abs(x.astype(jnp.float32))
            amax = jnp.max(jnp.where(jnp.isinf(a), 0.0, a))
            scale = jnp.where(amax > 0, amax / fmax, 1.0).astype(jnp.float32)
        else:
            scale = jnp.asarray(scale)
            if scale.shape != () or scale.dtype != jnp.float32:
                raise ValueError(f"jaxtdist.quantize: scale must be a float32 scalar, got "
                                 f"{scale.dtype.name}{list(scale.shape)}; e.g. "
                                 "jnp.float32(amax / 448)")
        full = scale
    else:
        if scale is not None:
            raise ValueError("jaxtdist.quantize: scale= is for block=None only; blockwise "
                             "scales are computed from each block's amax")
        if x.ndim < 2 or x.shape[-1] % BLOCK:
            raise ValueError(f"jaxtdist.quantize: block={block} needs x with >= 2 axes and "
                             f"the last a multiple of {BLOCK}, got shape {list(x.shape)}; pad "
                             "K or quantize per tensor (block=None)")
        amax = _blocked_amax(x, block)
        scale = jnp.where(amax > 0, amax / fmax, 1.0).astype(jnp.float32)
        full = _expand(scale, block, x.shape)
    # Clamp before the cast: saturation, never inf or NaN from a finite input.
    q = jnp.clip(x.astype(jnp.float32) / full, -fmax, fmax).astype(dtype)
    return q, scale


def dequantize(q: jax.Array, scale: jax.Array, dtype=jnp.float32) -> jax.Array:
    """``q * scale`` in ``dtype`` (float32 by default), for any layout of ``quantize``:
    the block is read from the shapes (``scale`` () per tensor; [R, C / 128] per row
    and 128 columns; [cdiv(R, 128), C / 128] per 128 x 128 block).

    Example:
      >>> w_t, s = jaxtdist.quantize_weight(w)     # w [K, N]
      >>> w_again = jaxtdist.dequantize(w_t, s).T  # [K, N], float32
    """
    q, scale = jnp.asarray(q), jnp.asarray(scale)
    if jnp.dtype(q.dtype) not in FP8_DTYPES:
        raise ValueError(f"jaxtdist.dequantize: q has dtype {q.dtype.name}; it must be "
                         f"{' or '.join(d.name for d in FP8_DTYPES)}")
    if scale.dtype != jnp.float32:
        raise ValueError(f"jaxtdist.dequantize: scale has dtype {scale.dtype.name}; it must be "
                         "float32")
    qf = q.astype(jnp.float32)
    if scale.ndim == 0:
        return (qf * scale).astype(dtype)
    block = scale_block(q.shape, scale.shape)
    if block is None:
        raise ValueError(f"jaxtdist.dequantize: scale{list(scale.shape)} fits no block layout "
                         f"of q{list(q.shape)}: expected () per tensor, "
                         f"{list(q.shape[:-1]) + [q.shape[-1] // BLOCK]} per (row, 128 "
                         f"columns) or {list(q.shape[:-2]) + [-(-q.shape[-2] // BLOCK)]}"
                         f"{[q.shape[-1] // BLOCK]} per 128 x 128 block")
    return (qf * _expand(scale, block, q.shape)).astype(dtype)


def scale_block(q_shape: tuple, scale_shape: tuple) -> tuple | None:
    """The block, (1, 128) or (128, 128), whose scales of an array of ``q_shape`` have
    ``scale_shape``; None if neither (or ``q_shape``'s last axis is no multiple of
    128)."""
    if len(q_shape) < 2 or len(scale_shape) != len(q_shape) or q_shape[-1] % BLOCK:
        return None
    *lead, r, c = q_shape
    for br in (1, BLOCK):
        if tuple(scale_shape) == (*lead, -(-r // br), c // BLOCK):
            return (br, BLOCK)
    return None


def quantize_weight(w: jax.Array, dtype=jnp.float8_e4m3fn,
                    block=(BLOCK, BLOCK)) -> tuple[jax.Array, jax.Array]:
    """A [K, N] weight (or [E, K, N] experts) as the FP8 GEMM ops take it: K-major,
    ``w_t`` [N, K] (one transpose, here, not in every call), and its scales.

    Args:
      w: [..., K, N] float weight; K a multiple of 128 for blockwise scales.
      dtype: the FP8 format.
      block: (128, 128) (default: ``scale`` [..., cdiv(N, 128), K / 128], the
        layout of ``weight_scale_inv`` in FP8 checkpoints) or None (one scale).

    Returns:
      (w_t [..., N, K] in ``dtype``, float32 scale).

    Example:
      >>> w_t, w_s = jaxtdist.quantize_weight(w)          # w [4096, 14336]
      >>> w_t.shape, w_s.shape
      ((14336, 4096), (112, 32))
    """
    block = _check_block(block, "quantize_weight")
    w = jnp.asarray(w)
    if w.ndim < 2:
        raise ValueError(f"jaxtdist.quantize_weight: w must be [..., K, N], got shape "
                         f"{list(w.shape)}")
    return quantize(jnp.swapaxes(w, -1, -2), dtype, block)
