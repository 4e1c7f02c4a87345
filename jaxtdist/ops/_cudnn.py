"""Which attention calls cuDNN's flash attention takes: one rule for the op's
world-1 path (``ops/ag_attention.py``) and the layers' XLA twin
(``nn/_cudnn.py``), a pure function tested without a GPU.

Example:
  >>> cudnn_refuses("gpu", "9.0", jnp.bfloat16, 128)
  ''
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["cudnn_refuses"]

# What jax.nn.dot_product_attention(implementation="cudnn") accepts, as jax 0.10.2,
# 0.11.0 and 0.11.1 check it (jax/_src/cudnn/fused_attention_stablehlo.py:
# check_layout, check_is_flash_attention): float16 or bfloat16 q, k, v of one
# dtype; head dim a multiple of 8, at most 256 on compute capability >= 9.0 and
# 128 below (cuDNN's own support matrix: backward up to 128 on Ampere/Ada, 256 on
# Hopper); GQA natively (Hq a multiple of Hkv); causal or no mask. Its BTNH layout
# is ag_attention's [B, S, H, D]: no conversion. Kept narrower than that: only
# Ampere/Ada (8.x) and Hopper (9.0), the architectures cuDNN's matrix lists with
# these limits (10.3 needs cuDNN >= 9.11, and Blackwell's head dims above 128
# needed newer cuDNN releases): elsewhere the kernels run. And only from jax
# 0.10.2: before it the cuDNN primitives dropped shard_map's varying axes from
# their results (jax issue 36008: the backward's cotangents then mismatched).
_CUDNN_DTYPES = ("bfloat16", "float16")
_CUDNN_MAX_HEAD_DIM = {"8": 128, "9.0": 256}
_CUDNN_MIN_JAX = (0, 10, 2)


def cudnn_refuses(platform: str, compute_capability: str, dtype, head_dim: int,
                  jax_version: tuple = tuple(jax.__version_info__)) -> str:
    """Why cuDNN's flash attention cannot take an attention call ("": it can).

    Example:
      >>> cudnn_refuses("gpu", "9.0", jnp.bfloat16, 128)
      ''
      >>> cudnn_refuses("gpu", "9.0", jnp.float32, 128)
      'cuDNN flash attention takes bfloat16 or float16, not float32'
    """
    if platform != "gpu":
        return "no cuDNN under the Triton interpreter (CPU)"
    if tuple(jax_version[:3]) < _CUDNN_MIN_JAX:
        return (f"jax {'.'.join(map(str, jax_version))}: its cuDNN attention loses shard_map's "
                "varying axes (jax issue 36008, fixed in 0.10.2)")
    name = jnp.dtype(dtype).name
    if name not in _CUDNN_DTYPES:
        return f"cuDNN flash attention takes bfloat16 or float16, not {name}"
    limit = _CUDNN_MAX_HEAD_DIM.get(compute_capability,
                                    _CUDNN_MAX_HEAD_DIM.get(compute_capability.split(".")[0]))
    if limit is None:
        return (f"compute capability {compute_capability or '(unknown)'}: jaxtdist sends "
                "cuDNN only Ampere/Ada (8.x) and Hopper (9.0) calls")
    if head_dim % 8 or head_dim > limit:
        return (f"head dim {head_dim}: cuDNN takes multiples of 8 up to {limit} on compute "
                f"capability {compute_capability}")
    return ""
