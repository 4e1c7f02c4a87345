"""Which attention cases cuDNN's flash attention takes, for the ``impl="xla"`` twin.

A JAX GPU user runs ``jax.nn.dot_product_attention(..., implementation="cudnn")``
(XLA's default on GPUs is unfused attention). ``ParallelAttention(...,
xla_attention="cudnn")`` does the same wherever cuDNN takes the case and the
unfused form elsewhere; :func:`cudnn_refusal` is that decision, a pure function
(the op's own rule, ``jaxtdist.ops._cudnn.cudnn_refuses``, plus what the layers
add: ROCm, packed-sequence masks), so it is tested without a GPU and a
benchmark's note can say which cases fell back.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxtdist.ops._cudnn import cudnn_refuses

__all__ = ["XLA_ATTENTIONS", "check_xla_attention", "cudnn_attention", "cudnn_refusal",
           "mesh_platform"]

# "unfused": jax.nn.dot_product_attention as XLA runs it by default (scores in memory);
# "cudnn": cuDNN's flash attention where it takes the case (cudnn_refusal), else unfused.
XLA_ATTENTIONS = ("unfused", "cudnn")


def check_xla_attention(layer: str, value: str) -> str:
    """``value`` if it names an attention of ``XLA_ATTENTIONS``, else a ValueError.

    Example:
      >>> check_xla_attention("ParallelAttention", "cudnn")
      'cudnn'
    """
    if value not in XLA_ATTENTIONS:
        raise ValueError(f"jaxtdist.nn.{layer}: xla_attention={value!r}; allowed: 'unfused' "
                         "(jax.nn.dot_product_attention's default, XLA's unfused attention) or "
                         "'cudnn' (cuDNN flash attention where cuDNN takes the case)")
    return value


def mesh_platform(mesh: Mesh) -> tuple[str, str | None]:
    """(platform, compute capability) of a mesh's devices: platform "cuda", "rocm"
    or the device's own ("cpu"); the capability ("9.0") on CUDA devices, else None."""
    device = mesh.devices.flat[0]
    if device.platform != "gpu":
        return device.platform, None
    version = str(getattr(device.client, "platform_version", "")).lower()
    if "rocm" in version or "hip" in version:
        return "rocm", None
    return "cuda", getattr(device, "compute_capability", None)


def cudnn_refusal(dtype, head_dim: int, platform: str, compute_capability: str | None = None,
                  *, packed: bool = False) -> str | None:
    """Why cuDNN's flash attention does not take an attention case, or None if it does.

    Args:
      dtype: q/k/v's dtype (cuDNN's flash attention takes float16 and bfloat16).
      head_dim: the heads' dimension (a multiple of 8, at most 256 on Hopper and
        later, 128 before).
      platform: "cuda", "rocm", "cpu", ... (``mesh_platform``).
      compute_capability: "9.0" and the like (None: unknown, taken as Hopper).
      packed: the case has an arbitrary mask (packed sequences' segment ids),
        which cuDNN would take only as a dense bias: left to the unfused form.

    Example:
      >>> cudnn_refusal(jnp.bfloat16, 128, "cuda", "9.0") is None
      True
      >>> cudnn_refusal(jnp.float32, 128, "cuda", "9.0")
      'cuDNN flash attention takes bfloat16 or float16, not float32'
    """
    if platform != "cuda":
        return f"no cuDNN on {platform}"
    # The op's own rule (ops/_cudnn.py), the capability unknown taken as Hopper's.
    why = cudnn_refuses("gpu", compute_capability or "9.0", dtype, head_dim)
    if why:
        return why
    if packed:
        return "packed sequences (segment ids): an arbitrary mask, not cuDNN's causal/padding"
    return None


def cudnn_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, is_causal: bool = False,
                    key_value_seq_lengths: jax.Array | None = None) -> jax.Array:
    """``jax.nn.dot_product_attention`` on cuDNN (a case ``cudnn_refusal`` allows):
    q [batch, q_len, heads, dim], k/v [batch, kv_len, kv_heads, dim]; a causal
    mask or each sequence's key length instead of a mask array (cuDNN then skips
    the masked blocks)."""
    return jax.nn.dot_product_attention(q, k, v, is_causal=is_causal,
                                        key_value_seq_lengths=key_value_seq_lengths,
                                        implementation="cudnn")
