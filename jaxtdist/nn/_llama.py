"""A Llama-3-architecture decoder built from ``jaxtdist.nn``: RMSNorm, RoPE,
grouped-query attention, SwiGLU, tied or untied LM head; with options, Mixtral's
and Qwen3-MoE's sparse MLPs and Qwen3's q/k norm.

Parameter paths follow Hugging Face's (``layers.0.self_attn.q_proj.kernel`` is
``model.layers.0.self_attn.q_proj.weight`` transposed), so ``load_hf_llama``
is a rename and a transpose.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxtdist.nn._attention import ParallelAttention, RopeScaling
from jaxtdist.nn._embed import Embed
from jaxtdist.nn._fp8 import Fp8Recipe, check_recipe
from jaxtdist.nn._layout import make_layout
from jaxtdist.nn._mlp import ParallelMLP
from jaxtdist.nn._moe import ParallelMoE, load_balancing_loss

__all__ = ["Llama", "LlamaConfig", "Optimizer", "place_on_mesh"]


def place_on_mesh(module, mesh: Mesh) -> None:
    """Puts every variable of ``module`` (a module, an optimizer, or a tuple of them)
    on ``mesh`` by its sharding metadata (replicated where it has none): also the
    fix after a checkpoint restore that left replicated parameters on one device.

    Each spec is written out to the array's rank (``P(None)``, not ``P()``, for a
    replicated vector): the spec a jitted step returns it with, so that a step's
    second call finds the shardings of its first and is not compiled again.

    Example:
      >>> nnx.update(model, restored); place_on_mesh(model, mesh)
    """
    state = nnx.state(module)

    def full_rank(a, sharding):
        spec = tuple(sharding.spec)
        return NamedSharding(mesh, P(*spec, *(None,) * (jnp.ndim(a) - len(spec))))

    shardings = jax.tree.map(full_rank, state, nnx.get_named_sharding(state, mesh))
    nnx.update(module, jax.device_put(state, shardings))


class Optimizer(nnx.Optimizer):
    """``nnx.Optimizer`` whose state lives on the model's mesh, placed as a jitted
    step returns it: a training step compiles once (optax's step count, created
    on one device by ``nnx.Optimizer``, would make the second call compile again).
    Same arguments as ``nnx.Optimizer``; ``mesh`` defaults to the model's.

    Example:
      >>> optimizer = jaxtdist.nn.Optimizer(model, optax.adamw(3e-4), wrt=nnx.Param)
      >>> loss = train_step(model, optimizer, tokens, targets)  # nnx.jit: one compile
    """

    def __init__(self, model: nnx.Module, tx, *, wrt=nnx.Param, mesh: Mesh | None = None,
                 **kwargs):
        super().__init__(model, tx, wrt=wrt, **kwargs)
        mesh = mesh or _mesh_of(model)
        place_on_mesh(self, mesh)


def _mesh_of(model: nnx.Module) -> Mesh:
    """The mesh of the model's layers (its ``layout``), else of a sharded parameter."""
    layout = getattr(model, "layout", None)
    if layout is not None:
        return layout.mesh
    for _, value in nnx.to_flat_state(nnx.state(model)):
        sharding = getattr(value[...], "sharding", None)
        if isinstance(sharding, NamedSharding):
            return sharding.mesh
    raise ValueError("jaxtdist.nn.Optimizer: the model has no parameter on a mesh to place "
                     "the optimizer state by; pass mesh=")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """The architecture (Hugging Face ``LlamaConfig`` names in comments).

    Example:
      >>> cfg = LlamaConfig(vocab=32000, d_model=2048, num_layers=4, num_heads=16,
      ...                   num_kv_heads=4, hidden=5632)
    """

    vocab: int                      # vocab_size
    d_model: int                    # hidden_size
    num_layers: int                 # num_hidden_layers
    num_heads: int                  # num_attention_heads
    num_kv_heads: int | None = None  # num_key_value_heads (None: num_heads)
    hidden: int | None = None       # intermediate_size (None: 4 * d_model)
    head_dim: int | None = None     # head_dim (None: d_model // num_heads)
    rope_theta: float = 500000.0    # rope_theta
    rope_scaling: RopeScaling | None = None  # rope_scaling of rope_type "llama3" (3.1+)
    norm_eps: float = 1e-5          # rms_norm_eps
    tie_embeddings: bool = False    # tie_word_embeddings
    qk_norm: bool = False           # Qwen3: RMSNorm of each q and k head before RoPE
    # Where num_experts > 0, a sparse MoE MLP (ParallelMoE) in the layers of moe_layers
    # (None: every layer, Mixtral's), a dense MLP of hidden in the others.
    num_experts: int = 0            # num_local_experts (Qwen3-MoE: num_experts)
    experts_per_token: int = 2      # num_experts_per_tok
    moe_hidden: int | None = None   # Qwen3-MoE: moe_intermediate_size (None: hidden)
    moe_layers: tuple[int, ...] | None = None  # Qwen3-MoE: from mlp_only_layers and
    #                                            decoder_sparse_step
    norm_topk_prob: bool = True     # norm_topk_prob (Mixtral: always)
    router_aux_loss_coef: float = 0.0  # router_aux_loss_coef: loss() adds the
    #                                    layers' load-balancing loss times this
    moe_parallelism: str = "expert"  # ParallelMoE's parallelism
    moe_capacity_factor: float | None = None  # ParallelMoE's capacity_factor (None: none)

    def __post_init__(self):
        """Checks ``moe_layers`` and stores it as a sorted tuple.

        Raises:
          ValueError: a layer index outside ``[0, num_layers)``, or MoE layers
            without experts.
        """
        if self.moe_layers is None:
            return
        layers = tuple(sorted({int(i) for i in self.moe_layers}))  # hashable: a static field
        bad = [i for i in layers if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"jaxtdist.nn.LlamaConfig: moe_layers={self.moe_layers} names "
                             f"layers {bad} of num_layers={self.num_layers}; give indices in "
                             f"[0, {self.num_layers})")
        if layers and self.num_experts < 1:
            raise ValueError(f"jaxtdist.nn.LlamaConfig: moe_layers={self.moe_layers} with "
                             f"num_experts={self.num_experts}; MoE layers need num_experts >= 1")
        object.__setattr__(self, "moe_layers", layers)

    def is_moe_layer(self, index: int) -> bool:
        """Whether layer ``index`` has a ``ParallelMoE`` (else a ``ParallelMLP``)."""
        return bool(self.num_experts) and (self.moe_layers is None or index in self.moe_layers)


class DecoderLayer(nnx.Module):
    """Pre-norm block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs, *, sparse: bool = False,
                 fp8: Fp8Recipe | None = None, **common):
        """``sparse``: a ``ParallelMoE`` MLP (``cfg.is_moe_layer``), else a dense one;
        ``fp8``: the recipe of the attention's projections and the dense MLP (a
        sparse MLP's experts stay in ``param_dtype``)."""
        dtype = common.get("dtype")
        self.input_layernorm = nnx.RMSNorm(cfg.d_model, epsilon=cfg.norm_eps, dtype=dtype,
                                           rngs=rngs)
        self.self_attn = ParallelAttention(cfg.d_model, cfg.num_heads,
                                           num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                                           rope_theta=cfg.rope_theta,
                                           rope_scaling=cfg.rope_scaling, qk_norm=cfg.qk_norm,
                                           qk_norm_eps=cfg.norm_eps, fp8=fp8, rngs=rngs,
                                           **common)
        self.post_attention_layernorm = nnx.RMSNorm(cfg.d_model, epsilon=cfg.norm_eps,
                                                    dtype=dtype, rngs=rngs)
        hidden = cfg.hidden or 4 * cfg.d_model
        if sparse:
            self.mlp = ParallelMoE(cfg.d_model, cfg.moe_hidden or hidden,
                                   num_experts=cfg.num_experts, top_k=cfg.experts_per_token,
                                   parallelism=cfg.moe_parallelism,
                                   norm_topk_prob=cfg.norm_topk_prob,
                                   capacity_factor=cfg.moe_capacity_factor, rngs=rngs, **common)
        else:
            self.mlp = ParallelMLP(cfg.d_model, hidden, fp8=fp8, rngs=rngs, **common)

    def __call__(self, x, *, positions=None, segment_ids=None, lengths=None, decode=False,
                 router_stats: list | None = None):
        """``router_stats``: a list the MoE MLP appends its ``RouterStats`` to;
        ``lengths``: each sequence's real tokens (attention and routing skip the rest)."""
        x = x + self.self_attn(self.input_layernorm(x), positions=positions,
                               segment_ids=segment_ids, lengths=lengths, decode=decode)
        h = self.post_attention_layernorm(x)
        if not isinstance(self.mlp, ParallelMoE):
            return x + self.mlp(h, decode=decode)
        if router_stats is None:
            return x + self.mlp(h, decode=decode, lengths=lengths)
        y, stats = self.mlp(h, decode=decode, lengths=lengths, return_router_stats=True)
        router_stats.append(stats)
        return x + y


class Llama(nnx.Module):
    """Token ids [batch, seq] -> logits [batch, seq, vocab].

    Example:
      >>> mesh = jax.make_mesh((2, 4), ("dp", "tp")); jaxtdist.initialize(mesh)
      >>> model = Llama(LlamaConfig(256, 64, 2, 4, num_kv_heads=2), rngs=nnx.Rngs(0))
      >>> logits = nnx.jit(lambda m, t: m(t))(model, tokens)  # tokens [batch, seq]
      >>> model.init_cache(batch, max_len=64); model(prompt)  # prefill, then:
      >>> logits1 = nnx.jit(lambda m, t: m(t, decode=True))(model, next_tokens)  # [batch, 1]
    """

    def __init__(self, cfg: LlamaConfig, *, axis_name: str = "tp",
                 batch_axes: str | Sequence[str] | None = None, mesh: Mesh | None = None,
                 dtype=None, param_dtype=jnp.float32, impl: str = "jaxtdist",
                 fp8: Fp8Recipe | str | None = None, rngs: nnx.Rngs):
        """``fp8``: an ``Fp8Recipe`` for every attention projection and dense MLP
        (not the embedding, the head, the norms, nor MoE experts)."""
        self.config = cfg
        fp8 = check_recipe("Llama", fp8)
        layout = make_layout("Llama", mesh=mesh, axis_name=axis_name, batch_axes=batch_axes,
                             impl=impl)
        self.layout = layout
        common = dict(axis_name=axis_name, batch_axes=layout.batch_axes, mesh=layout.mesh,
                      dtype=dtype, param_dtype=param_dtype, impl=impl)
        self.embed_tokens = Embed(cfg.vocab, cfg.d_model, axis_name=axis_name,
                                  batch_axes=layout.batch_axes, mesh=layout.mesh, dtype=dtype,
                                  param_dtype=param_dtype, rngs=rngs)
        self.layers = nnx.List([DecoderLayer(cfg, rngs, sparse=cfg.is_moe_layer(i), fp8=fp8,
                                             **common)
                                for i in range(cfg.num_layers)])
        self.norm = nnx.RMSNorm(cfg.d_model, epsilon=cfg.norm_eps, dtype=dtype, rngs=rngs)
        self.lm_head = None if cfg.tie_embeddings else nnx.Linear(
            cfg.d_model, cfg.vocab, use_bias=False, dtype=dtype, param_dtype=param_dtype,
            kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, None),
                                              mesh=layout.mesh), rngs=rngs)
        # Norm scales and the like carry no sharding: replicate them on the mesh too
        # (else they sit on one device, which explicit axes and restores refuse).
        place_on_mesh(self, layout.mesh)

    def init_cache(self, batch: int, max_len: int, dtype=None) -> None:
        """A KV cache in every layer for ``batch`` sequences of up to ``max_len`` tokens
        (any batch: one that does not divide over the dp axes is cached replicated)."""
        for layer in self.layers:
            layer.self_attn.init_cache(batch, max_len, dtype)

    def clear_cache(self) -> None:
        """Drops every layer's KV cache (to train, or to call on another batch size,
        after decoding: while a cache exists every call fills it)."""
        for layer in self.layers:
            layer.self_attn.clear_cache()

    @property
    def position(self) -> jax.Array:
        """The KV cache's next position (int32 scalar): the tokens cached in its
        longest sequence."""
        return self.layers[0].self_attn.position

    @property
    def lengths(self) -> jax.Array:
        """Each sequence's tokens cached so far, int32 [batch]: its next position."""
        return self.layers[0].self_attn.lengths

    def __call__(self, tokens: jax.Array, *, positions: jax.Array | None = None,
                 segment_ids: jax.Array | None = None, lengths: jax.Array | None = None,
                 decode: bool = False, return_router_stats: bool = False):
        """Logits [batch, seq, vocab] of tokens [batch, seq] (with a cache: the prefill);
        ``decode``: tokens [batch, 1], one new token per sequence. With
        ``return_router_stats``: ``(logits, [RouterStats of each MoE layer])``.

        Any seq and batch on any mesh: the tokens are padded inside to what the
        sequence-parallel layout takes, and the logits returned for the given
        positions only (then gathered over tp: a seq of ``layout.seq_multiple(batch)``
        moves nothing). ``lengths`` [batch] (prefill or training): each
        sequence's real tokens, the rest of its row right padding, which no real
        token attends to, routes to no expert, and whose logits are NaN (no
        prediction; ``loss`` takes ``lengths`` too). A prefill sets each
        sequence's cache position to its length, so that a decode step goes on
        from its last real token. A prompt padded without ``lengths`` is read as
        all real tokens: pass ``lengths`` (or ``generate``'s ``pad_id``).

        Example:
          >>> model.init_cache(2, 32)
          >>> logits = model(prompts, lengths=jnp.array([5, 3]))  # prompts [2, 5]
          >>> last = logits[jnp.arange(2), jnp.array([4, 2])]     # next-token logits
        """
        logits, stats, real = self._forward(tokens, positions, segment_ids, lengths, decode,
                                            return_router_stats)
        if real is not None:
            # NaN where no token was given: never a silent prediction from padding.
            logits = jnp.where(real[..., None], logits, jnp.nan)
        logits = self.layout.unpad(logits, tokens.shape[1])
        return (logits, stats) if return_router_stats else logits

    def _forward(self, tokens, positions, segment_ids, lengths, decode, return_router_stats):
        """(logits [batch, padded seq, vocab], RouterStats list or None, real [batch,
        padded seq] bool where ``lengths`` were given, else None)."""
        lay = self.layout
        tokens = jnp.asarray(tokens)
        if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise ValueError(f"jaxtdist.nn.Llama: tokens have shape {tuple(tokens.shape)} and "
                             f"dtype {tokens.dtype}; expected integer [batch, seq]")
        batch, real_seq = tokens.shape
        if decode and lengths is not None:
            raise ValueError("jaxtdist.nn.Llama: lengths are not taken by a decode step "
                             "(each sequence goes on from its cached length)")
        seq = real_seq
        if not decode and real_seq:
            multiple = lay.seq_multiple(batch)
            seq = -(-real_seq // multiple) * multiple
        attn = self.layers[0].self_attn
        if not decode and attn.cached_key is not None:
            attn._check_cache_fits(batch, real_seq)  # the prompt's own length
        real = None
        if lengths is not None:
            lengths = lay.check_lengths(lengths, batch, real_seq)
            real = jnp.arange(seq, dtype=jnp.int32)[None, :] < lengths[:, None]
        elif seq != real_seq:
            lengths = lay.constrain(jnp.full((batch,), real_seq, jnp.int32),
                                    P(lay.batch_spec(batch)))
        if seq != real_seq:
            pad = ((0, 0), (0, seq - real_seq))
            b = P(lay.batch_spec(batch), None)
            tokens = jnp.pad(lay.constrain(tokens, b), pad)  # token 0: masked out
            if positions is not None:
                positions = jnp.pad(lay.constrain(jnp.asarray(positions), b), pad)
            if segment_ids is not None:
                segment_ids = jnp.pad(lay.constrain(jnp.asarray(segment_ids), b), pad,
                                      constant_values=-1)
        stats = [] if return_router_stats else None
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x, positions=positions, segment_ids=segment_ids, lengths=lengths,
                      decode=decode, router_stats=stats)
        x = self.norm(x)
        logits = self.embed_tokens.attend(x) if self.lm_head is None else self.lm_head(x)
        return logits, stats, real

    def loss(self, tokens: jax.Array, targets: jax.Array, lengths: jax.Array | None = None,
             positions: jax.Array | None = None,
             segment_ids: jax.Array | None = None) -> jax.Array:
        """Mean next-token cross entropy (float32) of tokens [batch, seq] against targets
        over the real positions (below ``lengths`` [batch], all by default), plus
        ``router_aux_loss_coef`` times the MoE layers' ``load_balancing_loss``
        (Hugging Face Mixtral's, over every layer's routing of the real tokens).
        No keyword-only arguments: ``nnx.value_and_grad(Llama.loss)`` takes it."""
        batch, real_seq = jnp.shape(tokens)
        logits, stats, _ = self._forward(tokens, positions, segment_ids, lengths, False, True)
        targets = jnp.asarray(targets)
        if targets.shape != (batch, real_seq):
            raise ValueError(f"jaxtdist.nn.Llama.loss: targets have shape "
                             f"{tuple(targets.shape)}; expected tokens' {(batch, real_seq)}")
        seq = logits.shape[1]
        lay = self.layout
        b = P(lay.batch_spec(batch), None)
        count = real_seq if lengths is None else lay.check_lengths(lengths, batch, real_seq)
        weight = (jnp.arange(seq, dtype=jnp.int32)[None, :]
                  < jnp.broadcast_to(count, (batch,))[:, None]).astype(jnp.float32)
        if seq != real_seq:
            targets = jnp.pad(lay.constrain(targets, b), ((0, 0), (0, seq - real_seq)))
        picked = jnp.take_along_axis(jax.nn.log_softmax(logits.astype(jnp.float32)),
                                     targets[..., None], axis=-1)[..., 0]
        # A padding position's log-probability is finite (computed from token 0):
        # weighted 0, it adds nothing, to the loss or to its gradient.
        nll = -jnp.sum(picked * weight) / jnp.maximum(jnp.sum(weight), 1.0)
        coef = self.config.router_aux_loss_coef
        if stats and coef:  # MoE layers (stats unused otherwise: XLA drops them)
            return nll + coef * load_balancing_loss(stats)
        return nll

    @classmethod
    def twins(cls, cfg: LlamaConfig, mesh: Mesh, **kwargs) -> tuple["Llama", "Llama"]:
        """The jaxtdist model and the same model on XLA's collectives, same parameters."""
        ours = cls(cfg, mesh=mesh, impl="jaxtdist", rngs=nnx.Rngs(0), **kwargs)
        theirs = cls(cfg, mesh=mesh, impl="xla", rngs=nnx.Rngs(0), **kwargs)
        return ours, theirs


