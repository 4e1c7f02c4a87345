"""A small reference GPT built from ``jaxtdist.nn`` (examples/train_gpt.py,
examples/generate.py, ``python -m jaxtdist.bench model``): pre-norm blocks of
``ParallelAttention`` and a gated ``ParallelMLP`` on a (dp, tp) mesh, sequence
parallel; a KV cache for greedy decoding (``init_cache``, then a prefill call
and ``decode=True`` steps). No positional embedding: a test model, not a
recipe.

Example:
  >>> mesh = jax.make_mesh((1, 4), ("dp", "tp")); jaxtdist.initialize(mesh)
  >>> model = jaxtdist.nn.GPT(vocab=256, d=64, heads=4, layers=2, impl="jaxtdist",
  ...                         rngs=nnx.Rngs(0))
  >>> logits = nnx.jit(lambda m, t: m(t, 16))(model, tokens)  # tokens [batch * 16]
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtdist import nn as tdnn


class Block(nnx.Module):
    """Pre-norm transformer block: parallel attention and gated MLP."""

    def __init__(self, d: int, heads: int, impl: str, rngs: nnx.Rngs, dtype=None):
        common = dict(batch_axes=("dp",), impl=impl, rngs=rngs, dtype=dtype)
        self.norm1 = nnx.LayerNorm(d, dtype=dtype, rngs=rngs)
        self.norm2 = nnx.LayerNorm(d, dtype=dtype, rngs=rngs)
        self.attn = tdnn.ParallelAttention(d, heads, **common)
        self.mlp = tdnn.ParallelMLP(d, 4 * d, gated=True, activation=jax.nn.silu, **common)

    def __call__(self, x: jax.Array, seq_len: int | None = None, *,
                 decode: bool = False) -> jax.Array:
        """x: [batch * seq_len, d] sequence parallel, or ``decode``: [batch, d], one
        token per sequence, replicated over "tp"."""
        x = x + self.attn(self.norm1(x), seq_len=seq_len, decode=decode)
        return x + self.mlp(self.norm2(x), decode=decode)


class GPT(nnx.Module):
    """Token embedding, blocks, final norm, LM head; activations [batch * seq, d]
    with tokens sharded over ("dp", "tp") (sequence parallel)."""

    def __init__(self, vocab: int, d: int, heads: int, layers: int, impl: str,
                 rngs: nnx.Rngs, dtype=None):
        """``impl``: "jaxtdist" or "xla" (the same model on XLA's collectives);
        ``dtype``: the computation dtype (parameters stay float32)."""
        self.embed = nnx.Embed(vocab, d, dtype=dtype, rngs=rngs)
        self.blocks = nnx.List([Block(d, heads, impl, rngs, dtype) for _ in range(layers)])
        self.norm = nnx.LayerNorm(d, dtype=dtype, rngs=rngs)
        self.head = nnx.Linear(d, vocab, use_bias=False, dtype=dtype, rngs=rngs)

    def init_cache(self, batch: int, max_len: int) -> None:
        """A KV cache in every block for ``batch`` sequences of up to ``max_len`` tokens."""
        for block in self.blocks:
            block.attn.init_cache(batch, max_len)

    def __call__(self, tokens: jax.Array, seq_len: int | None = None, *,
                 decode: bool = False) -> jax.Array:
        """Logits for tokens [batch * seq_len] (with a cache: the prefill), or, with
        ``decode``, for one new token per sequence, tokens [batch]."""
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, seq_len, decode=decode)
        return self.head(self.norm(x))

    def loss(self, tokens: jax.Array, targets: jax.Array, seq_len: int) -> jax.Array:
        """Mean next-token cross entropy, in float32, of ``tokens`` [batch * seq_len]
        against ``targets`` (same layout)."""
        logits = self(tokens, seq_len).astype(jnp.float32)
        picked = jnp.take_along_axis(jax.nn.log_softmax(logits), targets[:, None], axis=-1)
        return -picked.mean()

    @classmethod
    def twins(cls, vocab: int, d: int, heads: int, layers: int, mesh,
              dtype=None) -> tuple["GPT", "GPT"]:
        """The jaxtdist model and the same model on XLA's collectives, with
        identical parameters placed by their sharding over ``mesh``."""
        ours = cls(vocab, d, heads, layers, "jaxtdist", nnx.Rngs(0), dtype)
        theirs = cls(vocab, d, heads, layers, "xla", nnx.Rngs(0), dtype)
        for model in (ours, theirs):
            state = nnx.state(model)
            nnx.update(model, jax.device_put(state, nnx.get_named_sharding(state, mesh)))
        return ours, theirs
