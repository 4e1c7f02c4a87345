"""Tensor-parallel self-attention: heads split over the tensor-parallel axis."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxtdist.nn._linear import (ColumnParallelLinear, RowParallelLinear, _explicit, _named,
                                 _rows, check_divisible, group_size)


class ParallelAttention(nnx.Module):
    """Causal multi-head self-attention with the heads split over ``axis_name``.

    Q, K and V are column-parallel (each rank computes its heads for every
    token of its batch group, the tokens gathered while multiplying); the
    attention itself is local per head group (``jax.nn.dot_product_attention``);
    the output projection is row-parallel, back to sequence-parallel tokens.

    Input and output: [batch * seq_len, features], tokens (batch-major)
    sharded over ``(*batch_axes, axis_name)``; the batch must divide over
    ``batch_axes``.

    Decoding with a KV cache: ``init_cache(batch, max_len)`` creates the cache
    (``nnx.Cache`` variables, each rank holding the keys and values of its
    head group), then a call with ``seq_len=`` is the prefill of the prompts
    (sequence-parallel as above; their keys and values written to positions
    ``[0, seq_len)``) and a call with ``decode=True`` takes one new token per
    sequence, replicated over ``axis_name`` ([batch, features], batch over
    ``batch_axes``): local Q, K, V GEMMs, keys and values appended at the
    cache's position, attention over the cache, and the output projection
    all-reduced (``matmul_ar``), every rank getting every token.

    Example:
      >>> attn = ParallelAttention(512, num_heads=8, batch_axes=("dp",), rngs=nnx.Rngs(0))
      >>> y = attn(x, seq_len=128)  # x: [batch * 128, 512], P(("dp", "tp"), None)
      >>> attn.init_cache(batch, max_len=256)
      >>> y = attn(prompt, seq_len=128)  # prefill: as above, also fills the cache
      >>> y1 = attn(x1, decode=True)  # x1: [batch, 512], P("dp", None): one token each
    """

    def __init__(self, features: int, num_heads: int, *, axis_name: str = "tp",
                 batch_axes: str | Sequence[str] = (), use_bias: bool = False,
                 dtype=None, param_dtype=jnp.float32, impl: str = "jaxtdist",
                 rngs: nnx.Rngs):
        if features % num_heads:
            raise ValueError(f"jaxtdist.nn.ParallelAttention: features={features} must be "
                             f"divisible by num_heads={num_heads}")
        check_divisible("ParallelAttention", "num_heads", num_heads, axis_name)
        self.num_heads = num_heads
        self.head_dim = features // num_heads
        self.dtype = dtype
        self.param_dtype = param_dtype
        common = dict(axis_name=axis_name, batch_axes=batch_axes, use_bias=use_bias,
                      dtype=dtype, param_dtype=param_dtype, impl=impl, rngs=rngs)
        self.query = ColumnParallelLinear(features, features, **common)
        self.key = ColumnParallelLinear(features, features, **common)
        self.value = ColumnParallelLinear(features, features, **common)
        self.out = RowParallelLinear(features, features, **common)
        self.cached_key: nnx.Cache | None = nnx.data(None)
        self.cached_value: nnx.Cache | None = nnx.data(None)
        self.cache_index: nnx.Cache | None = nnx.data(None)

    def init_cache(self, batch: int, max_len: int, dtype=None) -> None:
        """Creates (or resets) the KV cache for ``batch`` sequences of up to ``max_len`` tokens.

        The cache is two ``nnx.Cache`` arrays [batch, max_len, num_heads, head_dim]
        sharded ``P(batch_axes, None, axis_name, None)`` (each rank holds its
        head group's keys and values) and the next position to write
        (``cache_index``, an int32 scalar), all module state: ``nnx.jit``
        carries them in and out of each step.

        Args:
          batch: the number of sequences decoded together; must divide over
            ``batch_axes``.
          max_len: the longest sequence (prompt and generated tokens) the cache holds.
          dtype: the cache's dtype (default: the layer's ``dtype``, else its
            ``param_dtype``).

        Raises:
          ValueError: ``batch`` or ``max_len`` not positive, or ``batch`` not
            divisible over ``batch_axes``.
        """
        if batch < 1 or max_len < 1:
            raise ValueError(f"jaxtdist.nn.ParallelAttention.init_cache: batch={batch}, "
                             f"max_len={max_len}; both must be positive")
        axes = self.out.batch_axes
        groups = 1
        for axis in axes:
            groups *= group_size(axis)
        if batch % groups:
            raise ValueError(f"jaxtdist.nn.ParallelAttention.init_cache: batch={batch} must be "
                             f"divisible by the {groups} groups of batch_axes={axes} (each "
                             "group caches its own sequences); pad the batch to a multiple "
                             f"of {groups}")
        dtype = dtype or self.dtype or self.param_dtype
        sharding = _named(P(_rows(axes), None, self.out.axis_name, None))
        shape = (batch, max_len, self.num_heads, self.head_dim)
        self.cached_key = nnx.Cache(jax.device_put(jnp.zeros(shape, dtype), sharding))
        self.cached_value = nnx.Cache(jax.device_put(jnp.zeros(shape, dtype), sharding))
        self.cache_index = nnx.Cache(jnp.array(0, jnp.int32))

    def __call__(self, x: jax.Array, *, seq_len: int | None = None,
                 decode: bool = False) -> jax.Array:
        """Attention over whole sequences, or one decode step.

        Args:
          x: ``decode=False``: [batch * seq_len, features], tokens sharded over
            ``(*batch_axes, axis_name)``. ``decode=True``: [batch, features],
            one new token per sequence, replicated over ``axis_name``.
          seq_len: the length of each sequence of x (``decode=False`` only).
            With a cache (``init_cache``) this call is the prefill: the keys
            and values go to the cache's positions ``[0, seq_len)``.
          decode: one token per sequence, attending to the cache (needs
            ``init_cache``); it is written at the cache's position, which
            advances by one. Past ``max_len`` the output is NaN.

        Returns:
          ``decode=False``: [batch * seq_len, features], sharded like x.
          ``decode=True``: [batch, features], replicated over ``axis_name``.

        Raises:
          ValueError: a missing or unexpected ``seq_len``, tokens that are not
            whole sequences, a decode without a cache, or a prompt or batch
            that does not fit the cache.
        """
        if decode:
            if seq_len is not None:
                raise ValueError("jaxtdist.nn.ParallelAttention: decode=True takes one token "
                                 f"per sequence, not seq_len={seq_len}; drop seq_len (x is "
                                 "[batch, features])")
            return self._decode(x)
        if seq_len is None:
            raise ValueError("jaxtdist.nn.ParallelAttention: seq_len is required (x is "
                             "[batch * seq_len, features]), or decode=True for a decode step")
        tokens = x.shape[0]
        if tokens % seq_len:
            raise ValueError(f"jaxtdist.nn.ParallelAttention: the {tokens} tokens of x must be "
                             f"whole sequences of seq_len={seq_len}")
        batch = tokens // seq_len
        if self.cached_key is not None:
            self._check_cache_fits("prefill", batch, seq_len)

        rows, tp = _rows(self.out.batch_axes), self.out.axis_name

        def heads(h):  # [batch * seq, heads * dim] -> [batch, seq, heads, dim]
            return _reshape(h, (batch, seq_len, self.num_heads, self.head_dim),
                            P(rows, None, tp, None))

        q, k, v = (heads(layer(x)) for layer in (self.query, self.key, self.value))
        if self.cached_key is not None:  # prefill: the prompts' keys and values
            self.cached_key[...] = self.cached_key[...].at[:, :seq_len].set(
                k.astype(self.cached_key.dtype))
            self.cached_value[...] = self.cached_value[...].at[:, :seq_len].set(
                v.astype(self.cached_value.dtype))
            self.cache_index[...] = jnp.array(seq_len, jnp.int32)
        o = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        return self.out(_reshape(o, (tokens, self.num_heads * self.head_dim), P(rows, tp)))

    def _check_cache_fits(self, what: str, batch: int, seq_len: int) -> None:
        cache_batch, max_len = self.cached_key.shape[:2]
        if batch != cache_batch:
            raise ValueError(f"jaxtdist.nn.ParallelAttention ({what}): x holds {batch} "
                             f"sequences, the cache was made for {cache_batch}; call "
                             f"init_cache({batch}, max_len) first")
        if seq_len > max_len:
            raise ValueError(f"jaxtdist.nn.ParallelAttention ({what}): the cache is too "
                             f"short: seq_len={seq_len}, the cache holds max_len={max_len} "
                             f"positions; call init_cache(batch, max_len={seq_len}) or more "
                             "(prompt plus tokens to generate)")

    def _decode(self, x: jax.Array) -> jax.Array:
        if self.cached_key is None:
            raise ValueError("jaxtdist.nn.ParallelAttention: decode=True needs a KV cache; "
                             "call init_cache(batch, max_len) first, then prefill with "
                             "attn(prompt, seq_len=...)")
        if x.ndim != 2:
            raise ValueError(f"jaxtdist.nn.ParallelAttention: decode=True takes x of shape "
                             f"[batch, features] (one token per sequence), got {x.shape}")
        batch = x.shape[0]
        self._check_cache_fits("decode", batch, 1)
        rows, tp = _rows(self.out.batch_axes), self.out.axis_name
        max_len = self.cached_key.shape[1]

        def heads(h):  # [batch, heads * dim] -> [batch, 1, heads, dim]
            return _reshape(h, (batch, 1, self.num_heads, self.head_dim),
                            P(rows, None, tp, None))

        q, k, v = (heads(layer(x, replicated_tokens=True))
                   for layer in (self.query, self.key, self.value))
        index = self.cache_index[...]
        start = (jnp.zeros((), jnp.int32), index, jnp.zeros((), jnp.int32),
                 jnp.zeros((), jnp.int32))
        keys = jax.lax.dynamic_update_slice(self.cached_key[...],
                                            k.astype(self.cached_key.dtype), start)
        values = jax.lax.dynamic_update_slice(self.cached_value[...],
                                              v.astype(self.cached_value.dtype), start)
        self.cached_key[...] = keys
        self.cached_value[...] = values
        self.cache_index[...] = index + 1
        mask = (jnp.arange(max_len) <= index)[None, None, None, :]  # [1, 1, q=1, kv]
        o = jax.nn.dot_product_attention(q, keys.astype(q.dtype), values.astype(q.dtype),
                                         mask=mask)
        o = jnp.where(index < max_len, o, jnp.nan)  # past the cache's end: no answer
        return self.out(_reshape(o, (batch, self.num_heads * self.head_dim), P(rows, tp)),
                        reduce="all")


def _reshape(x: jax.Array, shape: tuple[int, ...], spec: P) -> jax.Array:
    """``x.reshape(shape)``; on a mesh with explicit axes (``jax.make_mesh``'s
    default) the result's sharding must be given: ``spec`` (heads stay on their
    ranks, so no data moves)."""
    if _explicit(x):
        mesh = jax.typeof(x).sharding.mesh
        return jax.lax.reshape(x, shape, out_sharding=jax.sharding.NamedSharding(mesh, spec))
    return x.reshape(shape)
