"""fp8 dispatch: each token's fp8 bytes and float32 scales travel as one byte row."""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["FP8_DTYPES", "check_fp8", "fp8_rows", "fp8_unpack"]

FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))


def check_fp8(x, x_scale) -> None:
    """Raises ValueError unless x is fp8 with x_scale [T, S] float32, or not fp8
    without it."""
    fp8 = jnp.dtype(x.dtype) in FP8_DTYPES
    if x_scale is None:
        if fp8:
            raise ValueError(f"jaxtdist.moe_dispatch: x is {jnp.dtype(x.dtype).name}: fp8 "
                             "tokens need their scales, x_scale [T, S] float32")
        return
    if not fp8:
        raise ValueError(f"jaxtdist.moe_dispatch: x_scale is given, so x must be fp8 "
                         f"({', '.join(d.name for d in FP8_DTYPES)}), got "
                         f"{jnp.dtype(x.dtype).name}; pass x_scale=None to dispatch it as is")
    t, h = x.shape
    if (getattr(x_scale, "ndim", None) != 2 or x_scale.shape[0] != t or x_scale.shape[1] < 1
            or h % x_scale.shape[1]):
        raise ValueError(f"jaxtdist.moe_dispatch: x_scale must be [T, S] with T = {t} tokens "
                         f"and S >= 1 dividing H = {h} (one scale per H / S columns of a "
                         f"token), got shape {getattr(x_scale, 'shape', None)}")
    if jnp.dtype(x_scale.dtype) != jnp.float32:
        raise ValueError(f"jaxtdist.moe_dispatch: x_scale has dtype "
                         f"{jnp.dtype(x_scale.dtype).name}; it must be float32")


@jax.custom_jvp
def fp8_rows(x, x_scale):
    """One byte row per token: x's H fp8 bytes, then its S float32 scales' bytes,
    padded to a multiple of 16 bytes (the row copies' vector width): [T, H + 4 S
    + pad] uint8. The dispatch moves rows, whatever they hold."""
    t, h = x.shape
    pad = -(h + 4 * x_scale.shape[1]) % 16
    return jnp.concatenate([jax.lax.bitcast_convert_type(x, jnp.uint8),
                            jax.lax.bitcast_convert_type(x_scale, jnp.uint8).reshape(t, -1),
                            jnp.zeros((t, pad), jnp.uint8)], axis=1)


@fp8_rows.defjvp
def _fp8_rows_jvp(primals, tangents):
    # A bitcast would pass zeros silently: say so instead.
    raise TypeError("jaxtdist.moe_dispatch: the fp8 path (x_scale given) is not "
                    "differentiable: quantized tokens carry no gradient here; dispatch the "
                    "bfloat16 x (x_scale=None) where gradients must flow")


def fp8_unpack(recv, dtype, scales: int):
    """(tokens [R, H] uint8, tails [R, 4 S + pad] uint8), the dispatch's two parts of
    each byte row -> (recv_x [R, H] fp8, recv_scale [R, S] float32): bitcasts and
    a slice of the small tails only."""
    tokens, tails = recv
    scale = jax.lax.bitcast_convert_type(
        tails[:, :4 * scales].reshape(tails.shape[0], scales, 4), jnp.float32)
    return jax.lax.bitcast_convert_type(tokens, dtype), scale
