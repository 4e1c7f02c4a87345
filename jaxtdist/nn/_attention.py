"""Tensor-parallel self-attention of the Llama family: grouped-query heads over the
tensor-parallel axis, rotary embeddings, packed-sequence masks and a KV cache."""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxtdist.nn._cudnn import check_xla_attention, cudnn_attention, cudnn_refusal, mesh_platform
from jaxtdist.nn._fp8 import Fp8Recipe
from jaxtdist.nn._layout import Layout, make_layout
from jaxtdist.nn._linear import ColumnParallelLinear, RowParallelLinear, column_parallel
from jaxtdist.ops.ag_attention import _MAX_HEAD_DIM as _FUSED_MAX_HEAD_DIM
from jaxtdist.ops.ag_attention import ag_attention
from jaxtdist.ops.flash_decode import _MAX_HEAD_DIM as _DECODE_MAX_HEAD_DIM
from jaxtdist.ops.flash_decode import flash_decode

__all__ = ["ParallelAttention", "RopeScaling", "rope"]


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1's rotary frequency scaling (Hugging Face's ``rope_scaling`` with
    ``rope_type: "llama3"``), which stretches the context a model was trained on.

    Rotations whose wavelength is shorter than ``original_max_position_embeddings
    / high_freq_factor`` stay; those longer than ``original_max_position_embeddings
    / low_freq_factor`` turn ``factor`` times slower; between the two the
    frequency moves smoothly from the one to the other.

    Example:
      >>> scaling = RopeScaling(8.0, 1.0, 4.0, 8192)  # Llama 3.1's
      >>> q = rope(q, positions, 500000.0, scaling)
    """

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self):
        if not (self.factor > 0 and 0 < self.low_freq_factor < self.high_freq_factor
                and self.original_max_position_embeddings > 0):
            raise ValueError(f"jaxtdist.nn.RopeScaling: got {self}; needs factor > 0, 0 < "
                             "low_freq_factor < high_freq_factor and "
                             "original_max_position_embeddings > 0")

    def __call__(self, inv_freq: jax.Array) -> jax.Array:
        """The scaled frequencies (float32) of ``inv_freq``."""
        context = float(self.original_max_position_embeddings)
        # context / wavelength: how many turns a rotation makes over the trained context.
        turns = context * inv_freq / (2 * math.pi)
        blend = (turns - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
        blend = jnp.clip(blend, 0.0, 1.0)  # 0: slowed by factor, 1: kept
        return inv_freq * (blend + (1.0 - blend) / self.factor)


def rope(x: jax.Array, positions: jax.Array, theta: float,
         scaling: RopeScaling | None = None) -> jax.Array:
    """Rotary embeddings (the Hugging Face Llama convention: halves rotated).

    Args:
      x: [batch, seq, heads, head_dim].
      positions: [batch, seq] integer positions.
      theta: the base of the frequencies (``rope_theta``).
      scaling: Llama 3.1's frequency scaling, or None (plain RoPE).

    Example:
      >>> q = rope(q, jnp.arange(seq)[None], 500000.0)
    """
    half = x.shape[-1] // 2
    inv_freq = 1.0 / (theta ** (jnp.arange(half, dtype=jnp.float32) / half))
    if scaling is not None:
        inv_freq = scaling(inv_freq)
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [batch, seq, half]
    cos, sin = (jnp.concatenate([f(angles)] * 2, -1)[:, :, None, :] for f in (jnp.cos, jnp.sin))
    xf = x.astype(jnp.float32)
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos + rotated * sin).astype(x.dtype)


def _dot_product_attention(q, k, v, mask, mesh: Mesh, cudnn: dict | None = None) -> jax.Array:
    """``jax.nn.dot_product_attention``; float16 on a CPU mesh in float32 (XLA's CPU
    dot refuses float16 operands with the float32 result it asks for), rounded once.
    ``cudnn``: the same mask as cuDNN's arguments (``is_causal`` or
    ``key_value_seq_lengths``) for ``xla_attention="cudnn"``: cuDNN's flash attention
    where it takes the case (``cudnn_refusal``), the unfused form elsewhere."""
    if cudnn is not None and cudnn_refusal(q.dtype, q.shape[-1], *mesh_platform(mesh)) is None:
        return cudnn_attention(q, k, v, **cudnn)
    if q.dtype == jnp.float16 and mesh.devices.flat[0].platform == "cpu":
        f32 = [a.astype(jnp.float32) for a in (q, k, v)]
        return jax.nn.dot_product_attention(*f32, mask=mask).astype(q.dtype)
    return jax.nn.dot_product_attention(q, k, v, mask=mask)


def _head_norm(head_dim: int, eps: float, layout: Layout, param_dtype,
               rngs: nnx.Rngs) -> tuple[nnx.RMSNorm, nnx.RMSNorm]:
    """The q and k norms of ``qk_norm``: RMSNorms over ``head_dim`` whose scales are
    created replicated on the layer's mesh (a scale on one device is refused next to
    sharded parameters on explicit axes)."""
    ones = nnx.with_partitioning(nnx.initializers.ones, (None,), mesh=layout.mesh)
    return tuple(nnx.RMSNorm(head_dim, epsilon=eps, dtype=jnp.float32, param_dtype=param_dtype,
                             scale_init=ones, rngs=rngs) for _ in range(2))


def _norm_heads(norm: nnx.RMSNorm, x: jax.Array) -> jax.Array:
    """``norm`` over the last dim of x [batch, seq, heads, head_dim], in float32 and
    rounded once to x's dtype (the mean of squares of 16-bit values loses digits)."""
    return norm(x.astype(jnp.float32)).astype(x.dtype)


def _pad_rows(a: jax.Array, seq: int, value: int) -> jax.Array:
    """a [batch, real seq] right-padded with ``value`` to [batch, seq]."""
    return a if a.shape[1] == seq else jnp.pad(a, ((0, 0), (0, seq - a.shape[1])),
                                               constant_values=value)


class ParallelAttention(nnx.Module):
    """Multi-head self-attention, heads split over ``axis_name`` (Megatron style).

    Q, K and V are column-parallel and share one gather of the sequence-parallel
    tokens (``ag_matmul`` with three weights); attention is local to each rank's
    heads (jaxtdist's flash-attention kernels on GPUs, forward and backward; with
    ``segment_ids``, or ``impl="xla"``, ``jax.nn.dot_product_attention`` with a
    mask); ``o_proj`` is row-parallel, back to sequence-parallel tokens.
    Grouped-query attention: ``num_kv_heads`` KV heads, sharded over
    ``axis_name`` when they divide over it, else stored replicated and each rank
    using the KV head of its query heads (tp a multiple of ``num_kv_heads``).

    Parameters, as Hugging Face and MaxText name them: ``q_proj``, ``k_proj``,
    ``v_proj``, ``o_proj``, each with ``kernel`` [in, out] (and ``bias``).

    ``xla_attention``: the attention of ``impl="xla"`` (and of jaxtdist's layer
    where its kernels do not take the case): "unfused" (``jax.nn.dot_product_attention``
    with a mask, XLA's default) or "cudnn" (cuDNN's flash attention wherever
    ``jaxtdist.nn._cudnn.cudnn_refusal`` lets it, as a JAX GPU user runs it).

    ``fp8``: an ``Fp8Recipe`` for the four projections (``jaxtdist.nn._linear``;
    the attention itself stays in the activations' dtype).

    ``rope_theta`` turns on rotary embeddings, ``rope_scaling`` (a
    :class:`RopeScaling`) Llama 3.1's scaling of their frequencies.

    ``qk_norm`` (Qwen3's): an RMSNorm over ``head_dim`` of each query and key
    head, after the projections and before the rotary embeddings, computed in
    float32 with ``qk_norm_eps``; parameters ``q_norm`` and ``k_norm``, each a
    ``scale`` [head_dim] (ones at first) shared by the heads, replicated.

    Decoding: ``init_cache(batch, max_len)``, a call on the prompts fills the
    cache (the prefill; ``lengths`` [batch] for prompts of different lengths,
    right-padded), then calls with ``decode=True`` on [batch, 1, d] add one
    token to each sequence at its own position (``lengths``, int32 [batch];
    ``position`` the longest one's), attending
    through ``flash_decode`` where the cache has the activations' dtype. Past
    ``max_len`` the output is NaN, never a wrong number (``check_room`` raises
    ahead of a decode loop).

    Example:
      >>> mesh = jax.make_mesh((2, 4), ("dp", "tp")); jaxtdist.initialize(mesh)
      >>> attn = ParallelAttention(512, 8, num_kv_heads=2, rope_theta=5e5, rngs=nnx.Rngs(0))
      >>> y = nnx.jit(lambda m, x: m(x))(attn, x)  # x: [batch, seq, 512]
      >>> attn.init_cache(batch, max_len=256)
      >>> y = nnx.jit(lambda m, x: m(x))(attn, prompt)  # prefill
      >>> y1 = nnx.jit(lambda m, x: m(x, decode=True))(attn, x1)  # x1: [batch, 1, 512]
    """

    def __init__(self, d_model: int, num_heads: int, *, num_kv_heads: int | None = None,
                 head_dim: int | None = None, rope_theta: float | None = None,
                 rope_scaling: RopeScaling | None = None, use_bias: bool = False,
                 causal: bool = True, qk_norm: bool = False, qk_norm_eps: float = 1e-6,
                 axis_name: str = "tp",
                 batch_axes: str | Sequence[str] | None = None, mesh: Mesh | None = None,
                 dtype=None, param_dtype=jnp.float32, impl: str = "jaxtdist",
                 xla_attention: str = "unfused", fp8: Fp8Recipe | str | None = None,
                 rngs: nnx.Rngs):
        name = "ParallelAttention"
        # impl="xla"'s attention (and jaxtdist's where its kernels do not take the case).
        self.xla_attention = check_xla_attention(name, xla_attention)
        layout = make_layout(name, mesh=mesh, axis_name=axis_name, batch_axes=batch_axes,
                             impl=impl)
        tp = layout.tp
        if num_kv_heads is None:
            num_kv_heads = num_heads
        for what, value in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads)):
            if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
                raise ValueError(f"jaxtdist.nn.{name}: {what} must be a positive int, got "
                                 f"{value!r}")
        if head_dim is None:
            if d_model % num_heads:
                raise ValueError(f"jaxtdist.nn.{name}: d_model={d_model} must be divisible by "
                                 f"num_heads={num_heads}, or give head_dim=")
            head_dim = d_model // num_heads
        if num_heads % num_kv_heads:
            raise ValueError(f"jaxtdist.nn.{name}: num_heads={num_heads} must be a multiple of "
                             f"num_kv_heads={num_kv_heads} (grouped-query attention)")
        if num_heads % tp:
            raise ValueError(f"jaxtdist.nn.{name}: num_heads={num_heads} must be divisible by "
                             f"the size {tp} of mesh axis {axis_name!r} (each rank holds an "
                             "equal part)")
        if num_kv_heads % tp and tp % num_kv_heads:
            raise ValueError(f"jaxtdist.nn.{name}: num_kv_heads={num_kv_heads} must divide over "
                             f"the size {tp} of mesh axis {axis_name!r}, or divide it (then "
                             "each KV head is replicated on tp / num_kv_heads ranks)")
        if rope_theta is not None and head_dim % 2:
            raise ValueError(f"jaxtdist.nn.{name}: rotary embeddings need an even head_dim, "
                             f"got {head_dim}")
        self.layout = layout
        self.d_model, self.num_heads, self.num_kv_heads = d_model, num_heads, num_kv_heads
        if rope_scaling is not None and not isinstance(rope_scaling, RopeScaling):
            raise ValueError(f"jaxtdist.nn.{name}: rope_scaling={rope_scaling!r}; give a "
                             "jaxtdist.nn.RopeScaling (Llama 3.1's) or None")
        self.head_dim, self.rope_theta, self.causal = head_dim, rope_theta, causal
        self.rope_scaling = rope_scaling
        common = dict(axis_name=axis_name, batch_axes=layout.batch_axes, mesh=layout.mesh,
                      use_bias=use_bias, dtype=dtype, param_dtype=param_dtype, impl=impl,
                      fp8=fp8, rngs=rngs)
        kv_replicated = head_dim if num_kv_heads % tp else 0
        self.q_proj = ColumnParallelLinear(d_model, num_heads * head_dim, **common)
        self.k_proj = ColumnParallelLinear(d_model, num_kv_heads * head_dim,
                                           replicated_columns=kv_replicated, **common)
        self.v_proj = ColumnParallelLinear(d_model, num_kv_heads * head_dim,
                                           replicated_columns=kv_replicated, **common)
        self.o_proj = RowParallelLinear(num_heads * head_dim, d_model, **common)
        self.q_norm, self.k_norm = (_head_norm(head_dim, qk_norm_eps, layout, param_dtype, rngs)
                                    if qk_norm else (None, None))
        # KV heads as computed and cached: one per rank at least.
        self.kv_heads_stored = max(num_kv_heads, tp)
        self.cached_key: nnx.Cache | None = nnx.data(None)
        self.cached_value: nnx.Cache | None = nnx.data(None)
        self.cache_index: nnx.Cache | None = nnx.data(None)

    # -- the KV cache ----------------------------------------------------------------------
    def init_cache(self, batch: int, max_len: int, dtype=None) -> None:
        """Creates (or resets) the KV cache for ``batch`` sequences of up to ``max_len`` tokens
        (``clear_cache`` drops it: while it exists, every call on the prompts fills it).

        Two ``nnx.Cache`` arrays [batch, max_len, kv_heads, head_dim] sharded
        ``P(batch_axes, None, axis_name, None)`` and the next position
        of each sequence (``cache_index``, int32 [batch]), all module state that
        ``nnx.jit`` carries.

        A batch that does not divide over ``batch_axes`` is cached replicated over
        them (each group repeats the work, as the layers do for such a batch).

        Raises:
          ValueError: ``batch`` or ``max_len`` not positive.
        """
        lay = self.layout
        if batch < 1 or max_len < 1:
            raise ValueError(f"jaxtdist.nn.ParallelAttention.init_cache: batch={batch}, "
                             f"max_len={max_len}; both must be positive")
        dtype = dtype or self.q_proj.dtype or self.q_proj.param_dtype
        b = lay.batch_spec(batch)
        sharding = lay.named(P(b, None, lay.axis_name, None))
        shape = (batch, max_len, self.kv_heads_stored, self.head_dim)
        self.cached_key = nnx.Cache(jax.device_put(jnp.zeros(shape, dtype), sharding))
        self.cached_value = nnx.Cache(jax.device_put(jnp.zeros(shape, dtype), sharding))
        # Each sequence's next position: prompts of different lengths decode side by side.
        self.cache_index = nnx.Cache(jax.device_put(jnp.zeros((batch,), jnp.int32),
                                                    lay.named(P(b))))

    def clear_cache(self) -> None:
        """Drops the KV cache: calls then neither fill nor check one (training, or
        another batch size, after decoding)."""
        self.cached_key = nnx.data(None)
        self.cached_value = nnx.data(None)
        self.cache_index = nnx.data(None)

    @property
    def position(self) -> jax.Array:
        """The cache's next position (an int32 scalar): the number of tokens cached
        in its longest sequence (``lengths`` gives each one's); needs ``init_cache``."""
        return jnp.max(self.lengths)

    @property
    def lengths(self) -> jax.Array:
        """Each sequence's next position, int32 [batch]: its tokens cached (prompt
        ``lengths`` after the prefill, plus one per decode step)."""
        if self.cache_index is None:
            raise ValueError("jaxtdist.nn.ParallelAttention.position: no KV cache; call "
                             "init_cache(batch, max_len) first")
        return self.cache_index[...]

    def check_room(self, tokens: int) -> None:
        """Raises ValueError unless the cache has room for ``tokens`` more decode steps
        (call outside ``jit``, before a decode loop)."""
        max_len = self.cached_key.shape[1] if self.cached_key is not None else 0
        used = int(self.position)
        if used + tokens > max_len:
            raise ValueError(f"jaxtdist.nn.ParallelAttention: the KV cache holds max_len="
                             f"{max_len} positions, {used} used; {tokens} more do not fit. "
                             f"call init_cache(batch, max_len={used + tokens}) or more")

    # -- the layer -------------------------------------------------------------------------
    def __call__(self, x: jax.Array, *, positions: jax.Array | None = None,
                 segment_ids: jax.Array | None = None, lengths: jax.Array | None = None,
                 decode: bool = False) -> jax.Array:
        """Attention over whole sequences (with a cache: the prefill), or one decode step.

        Any seq: it is padded inside to what the sequence-parallel layout takes
        (``Layout.seq_multiple``) and the padding's outputs dropped.

        Args:
          x: [batch, seq, d_model], any sharding (``P(batch_axes, axis_name, None)``
            moves nothing); ``decode=True``: [batch, 1, d_model].
          positions: [batch, seq] rotary positions (default 0..seq-1; in a decode
            step each sequence's cache position).
          segment_ids: [batch, seq] ids of packed sequences: tokens attend only
            within their segment (not in a decode step).
          lengths: [batch] integers, each sequence's real tokens: the rest of its
            row is right padding, never attended to by a real token; a prefill
            caches each sequence's position as its length, so a decode step goes
            on from there (not in a decode step; default: every token is real).
          decode: one token per sequence, attending to the cache.

        Returns:
          [batch, seq, d_model], sequence parallel (decode: on every tp rank);
          rows at or past ``lengths`` hold no result of use.
        """
        lay = self.layout
        x, batch, seq, real = lay.pad_input(x, self.d_model, decode)
        positions = None if positions is None else jnp.asarray(positions)
        segment_ids = None if segment_ids is None else jnp.asarray(segment_ids)
        for name, arr in (("positions", positions), ("segment_ids", segment_ids)):
            if arr is not None and tuple(arr.shape) != (batch, real):
                raise ValueError(f"jaxtdist.nn.ParallelAttention: {name} has shape "
                                 f"{tuple(arr.shape)}; expected [batch, seq] = {(batch, real)} "
                                 f"as x {(batch, real, self.d_model)}")
        if decode:
            if segment_ids is not None or lengths is not None:
                raise ValueError("jaxtdist.nn.ParallelAttention: segment_ids and lengths are "
                                 "not taken by a decode step (each row is one sequence, "
                                 "going on from its cached length)")
            if self.cached_key is None:
                raise ValueError("jaxtdist.nn.ParallelAttention: decode=True needs a KV cache; "
                                 "call init_cache(batch, max_len) first, then prefill with "
                                 "attn(prompt)")
        b = lay.batch_spec(batch)
        if lengths is not None:
            lengths = lay.check_lengths(lengths, batch, real)
        elif seq != real:  # padded here: the padding is no token
            lengths = lay.constrain(jnp.full((batch,), real, jnp.int32), P(b))
        if self.cached_key is not None:
            # Given lengths, the writes past max_len are cut (padding, or a position
            # past the end that makes decode NaN): only the batch must match.
            self._check_cache_fits(batch, None if lengths is not None else 1 if decode else real)
        q, k, v = column_parallel((self.q_proj, self.k_proj, self.v_proj),
                                  lay.to_tokens(x, decode), decode=decode)
        heads = P(b, None, lay.axis_name, None)
        q = lay.unflatten(q, (batch, seq, self.num_heads, self.head_dim), heads)
        k = lay.unflatten(k, (batch, seq, self.kv_heads_stored, self.head_dim), heads)
        v = lay.unflatten(v, (batch, seq, self.kv_heads_stored, self.head_dim), heads)
        if self.q_norm is not None:  # before RoPE, so before the cache and every attention
            q, k = _norm_heads(self.q_norm, q), _norm_heads(self.k_norm, k)
        if positions is None:
            positions = (self.cache_index[...][:, None] if decode else
                         jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq)))
        positions = jnp.asarray(positions)
        if not jnp.issubdtype(positions.dtype, jnp.integer):
            raise ValueError("jaxtdist.nn.ParallelAttention: positions must be integers (token "
                             f"indices), got dtype {positions.dtype}; round or cast them first")
        positions = _pad_rows(lay.constrain(positions.astype(jnp.int32), P(b, None)), seq, 0)
        if segment_ids is not None:  # padding in a segment of its own
            segment_ids = _pad_rows(lay.constrain(segment_ids.astype(jnp.int32), P(b, None)),
                                    seq, -1)
        if lengths is not None and not self.causal:
            # Causal, a real token sees no right padding; else the padding is masked
            # as a segment of its own (the masked attention).
            live = jnp.arange(seq, dtype=jnp.int32)[None, :] < lengths[:, None]
            segment_ids = jnp.where(live, 0 if segment_ids is None else segment_ids, -1)
        if decode:
            o = self._decode(q, k, v, positions, b)
        else:
            if self.cached_key is not None:  # prefill: the prompts' keys and values
                self._prefill_cache(k, v, positions,
                                    jnp.full((batch,), seq, jnp.int32) if lengths is None
                                    else lengths)
            o = self._attend(q, k, v, positions, segment_ids, b)
        o = lay.flatten(o, heads, (batch * seq, self.num_heads * self.head_dim), P(
            b if decode else lay.rows, lay.axis_name))
        return lay.unpad(lay.from_tokens(self.o_proj.project(o, decode=decode), batch, seq,
                                         decode), real)

    def _check_cache_fits(self, batch: int, seq: int | None) -> None:
        """The cache's batch is x's, and ``seq`` tokens fit (None: not checked)."""
        cache_batch, max_len = self.cached_key.shape[:2]
        if batch != cache_batch:
            raise ValueError(f"jaxtdist.nn.ParallelAttention: x holds {batch} sequences, the "
                             f"cache was made for {cache_batch}; call init_cache({batch}, "
                             "max_len) first")
        if seq is not None and seq > max_len:
            raise ValueError(f"jaxtdist.nn.ParallelAttention: the KV cache is too short: "
                             f"seq={seq}, the cache holds max_len={max_len} positions; call "
                             f"init_cache(batch, max_len={seq}) or more (prompt plus tokens "
                             "to generate)")

    def _rope(self, a: jax.Array, positions: jax.Array) -> jax.Array:
        return (a if self.rope_theta is None
                else rope(a, positions, self.rope_theta, self.rope_scaling))

    def _local(self, fn, in_specs, out_specs, *args):
        """fn on each rank's heads (plain jax: attention is local to a head group)."""
        return jax.shard_map(fn, mesh=self.layout.mesh, in_specs=in_specs,
                             out_specs=out_specs)(*args)

    def _attend(self, q, k, v, positions, segment_ids, b):
        lay = self.layout
        heads, rows = P(b, None, lay.axis_name, None), P(b, None)
        # jaxtdist's fused attention (``ag_attention`` over a group of one rank, the
        # empty axis tuple): on GPUs its flash-attention kernels, forward and
        # backward, where jax.nn.dot_product_attention with a mask takes XLA's
        # unfused attention and keeps [batch, heads, seq, seq] scores for the
        # backward. Packed sequences (segment_ids) keep the mask.
        fused = (lay.impl == "jaxtdist" and segment_ids is None
                 and self.head_dim <= _FUSED_MAX_HEAD_DIM)

        def local(q, k, v, positions, *segments):
            q, k = self._rope(q, positions), self._rope(k, positions)
            if fused:
                return ag_attention(q, k, v, (), causal=bool(self.causal))
            seq = q.shape[1]
            mask = jnp.ones((1, 1, seq, seq), bool)
            if self.causal:
                mask = jnp.tril(mask)
            if segments:
                (seg,) = segments
                mask = mask & (seg[:, None, :, None] == seg[:, None, None, :])
            cudnn = (dict(is_causal=bool(self.causal))
                     if self.xla_attention == "cudnn" and not segments else None)
            return _dot_product_attention(q, k, v, mask, lay.mesh, cudnn)

        extra = () if segment_ids is None else (
            lay.constrain(jnp.asarray(segment_ids, jnp.int32), rows),)
        return self._local(local, (heads, heads, heads, rows) + (rows,) * len(extra), heads,
                           q, k, v, positions, *extra)

    def _prefill_cache(self, k, v, positions, lengths):
        """The prompts' keys and values into the cache (those past ``max_len`` cut:
        padding, or a length that overflows, which ``check_room`` and decode's NaN
        report), each sequence's position set to its length."""
        lay = self.layout
        b = lay.batch_spec(k.shape[0])
        heads = P(b, None, lay.axis_name, None)
        n = min(k.shape[1], self.cached_key.shape[1])

        def local(k, positions, cache_k, v, cache_v):
            k = self._rope(k, positions)
            return (cache_k.at[:, :n].set(k[:, :n].astype(cache_k.dtype)),
                    cache_v.at[:, :n].set(v[:, :n].astype(cache_v.dtype)))

        self.cached_key[...], self.cached_value[...] = self._local(
            local, (heads, P(b, None), heads, heads, heads), (heads, heads),
            k, positions, self.cached_key[...], v, self.cached_value[...])
        self.cache_index[...] = lay.constrain(lengths.astype(jnp.int32), P(b))

    def _decode(self, q, k, v, positions, b):
        lay = self.layout
        heads = P(b, None, lay.axis_name, None)
        max_len = self.cached_key.shape[1]

        def local(q, k, v, positions, cache_k, cache_v, index):
            q, k = self._rope(q, positions), self._rope(k, positions)
            # Each sequence's token at its own position (past the end: dropped).
            rows = jnp.arange(q.shape[0])
            cache_k = cache_k.at[rows, index].set(k[:, 0].astype(cache_k.dtype), mode="drop")
            cache_v = cache_v.at[rows, index].set(v[:, 0].astype(cache_v.dtype), mode="drop")
            if (lay.impl == "jaxtdist" and q.dtype == cache_k.dtype
                    and self.head_dim <= _DECODE_MAX_HEAD_DIM):
                # flash_decode over a group of one rank: on GPUs its split-KV kernel
                # reads the cache up to each length once (XLA's masked attention
                # reads all of it); elsewhere plain JAX.
                o = flash_decode(q[:, 0], cache_k, cache_v, index + 1, ())[:, None]
            else:
                mask = (jnp.arange(max_len)[None, :] <= index[:, None])[:, None, None, :]
                cudnn = (dict(key_value_seq_lengths=index + 1)  # each sequence's length
                         if self.xla_attention == "cudnn" else None)
                o = _dot_product_attention(q, cache_k.astype(q.dtype),
                                           cache_v.astype(q.dtype), mask, lay.mesh, cudnn)
            # Past the cache's end: no answer.
            o = jnp.where((index < max_len)[:, None, None, None], o, jnp.nan)
            return o, cache_k, cache_v

        index = self.cache_index[...]
        o, self.cached_key[...], self.cached_value[...] = self._local(
            local, (heads, heads, heads, P(b, None), heads, heads, P(b)), (heads, heads, heads),
            q, k, v, positions, self.cached_key[...], self.cached_value[...], index)
        self.cache_index[...] = index + 1
        return o
