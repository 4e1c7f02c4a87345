"""What the low-latency MoE dispatch's fused FP8 quantization produces, on the host:
the reference of its received rows (tests only; no side effects on import)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def e4m3(v: np.ndarray, gpu: bool) -> np.ndarray:
    """float32 values (in [-448, 448]) through e4m3 as the dispatch kernel converts
    them: round to nearest even on GPUs; under the Triton interpreter its own
    conversion, which (Triton 3.6) rounds ties away from zero and loses a carry
    into the exponent (1.98 becomes 1.0, 124.5 64.0): a check is then of the
    exchange and the layer, not of the interpreter's rounding."""
    if gpu:
        return np.asarray(jnp.asarray(v, jnp.float32).astype(jnp.float8_e4m3fn), np.float32)
    import triton.language as tl
    from triton._C.libtriton import ir
    from triton.runtime.interpreter import _convert_float
    bits = _convert_float(np.ascontiguousarray(v, np.float32), tl.float32, tl.float8e4nv,
                          ir.ROUNDING_MODE.RTNE)
    return bits.view(jnp.float8_e4m3fn).astype(np.float32)


def dispatch_roundtrip(x: np.ndarray, gpu: bool) -> np.ndarray:
    """[N, H] float32 rows as the FP8 dispatch quantizes them (1 x 128 blocks, scale
    amax / 448, ``e4m3`` of x / scale), dequantized: what the experts see."""
    n, h = x.shape
    s = -(-h // 128)
    blocks = np.zeros((n, s * 128), np.float32)
    blocks[:, :h] = x
    blocks = blocks.reshape(n, s, 128)
    amax = np.abs(blocks).max(-1, keepdims=True)
    scale = np.where(amax > 0, amax, np.float32(1)) / np.float32(448)
    q = e4m3(np.clip(blocks / scale, -448, 448), gpu)
    return (q * scale).reshape(n, -1)[:, :h]
