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
from jax.sharding import Mesh

from jaxtdist.nn._attention import ParallelAttention, RopeScaling
from jaxtdist.nn._embed import Embed
from jaxtdist.nn._layout import make_layout
from jaxtdist.nn._mlp import ParallelMLP
from jaxtdist.nn._moe import ParallelMoE, load_balancing_loss

__all__ = ["Llama", "LlamaConfig", "place_on_mesh"]


def place_on_mesh(module: nnx.Module, mesh: Mesh) -> None:
    """Puts every variable of ``module`` on ``mesh`` by its sharding metadata
    (replicated where it has none): also the fix after a checkpoint restore
    that left replicated parameters on one device.

    Example:
      >>> nnx.update(model, restored); place_on_mesh(model, mesh)
    """
    state = nnx.state(module)
    nnx.update(module, jax.device_put(state, nnx.get_named_sharding(state, mesh)))


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

    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs, *, sparse: bool = False, **common):
        """``sparse``: a ``ParallelMoE`` MLP (``cfg.is_moe_layer``), else a dense one."""
        dtype = common.get("dtype")
        self.input_layernorm = nnx.RMSNorm(cfg.d_model, epsilon=cfg.norm_eps, dtype=dtype,
                                           rngs=rngs)
        self.self_attn = ParallelAttention(cfg.d_model, cfg.num_heads,
                                           num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                                           rope_theta=cfg.rope_theta,
                                           rope_scaling=cfg.rope_scaling, qk_norm=cfg.qk_norm,
                                           qk_norm_eps=cfg.norm_eps, rngs=rngs, **common)
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
            self.mlp = ParallelMLP(cfg.d_model, hidden, rngs=rngs, **common)

    def __call__(self, x, *, positions=None, segment_ids=None, decode=False,
                 router_stats: list | None = None):
        """``router_stats``: a list the MoE MLP appends its ``RouterStats`` to."""
        x = x + self.self_attn(self.input_layernorm(x), positions=positions,
                               segment_ids=segment_ids, decode=decode)
        h = self.post_attention_layernorm(x)
        if router_stats is None or not isinstance(self.mlp, ParallelMoE):
            return x + self.mlp(h, decode=decode)
        y, stats = self.mlp(h, decode=decode, return_router_stats=True)
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
                 rngs: nnx.Rngs):
        self.config = cfg
        layout = make_layout("Llama", mesh=mesh, axis_name=axis_name, batch_axes=batch_axes,
                             impl=impl)
        self.layout = layout
        common = dict(axis_name=axis_name, batch_axes=layout.batch_axes, mesh=layout.mesh,
                      dtype=dtype, param_dtype=param_dtype, impl=impl)
        self.embed_tokens = Embed(cfg.vocab, cfg.d_model, axis_name=axis_name,
                                  batch_axes=layout.batch_axes, mesh=layout.mesh, dtype=dtype,
                                  param_dtype=param_dtype, rngs=rngs)
        self.layers = nnx.List([DecoderLayer(cfg, rngs, sparse=cfg.is_moe_layer(i), **common)
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
        """A KV cache in every layer for ``batch`` sequences of up to ``max_len`` tokens."""
        for layer in self.layers:
            layer.self_attn.init_cache(batch, max_len, dtype)

    def clear_cache(self) -> None:
        """Drops every layer's KV cache (to train, or to call on another batch size,
        after decoding: while a cache exists every call fills it)."""
        for layer in self.layers:
            layer.self_attn.clear_cache()

    @property
    def position(self) -> jax.Array:
        """The KV cache's next position (tokens cached so far)."""
        return self.layers[0].self_attn.position

    def __call__(self, tokens: jax.Array, *, positions: jax.Array | None = None,
                 segment_ids: jax.Array | None = None, decode: bool = False,
                 return_router_stats: bool = False):
        """Logits [batch, seq, vocab] of tokens [batch, seq] (with a cache: the prefill);
        ``decode``: tokens [batch, 1], one new token per sequence. With
        ``return_router_stats``: ``(logits, [RouterStats of each MoE layer])``."""
        stats = [] if return_router_stats else None
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x, positions=positions, segment_ids=segment_ids, decode=decode,
                      router_stats=stats)
        x = self.norm(x)
        logits = self.embed_tokens.attend(x) if self.lm_head is None else self.lm_head(x)
        return (logits, stats) if return_router_stats else logits

    def loss(self, tokens: jax.Array, targets: jax.Array, **kwargs) -> jax.Array:
        """Mean next-token cross entropy (float32) of tokens [batch, seq] against targets,
        plus ``router_aux_loss_coef`` times the MoE layers' ``load_balancing_loss``
        (Hugging Face Mixtral's, over every layer's routing)."""
        logits, stats = self(tokens, return_router_stats=True, **kwargs)
        picked = jnp.take_along_axis(jax.nn.log_softmax(logits.astype(jnp.float32)),
                                     targets[..., None], axis=-1)
        coef = self.config.router_aux_loss_coef
        if stats and coef:  # MoE layers (stats unused otherwise: XLA drops them)
            return -picked.mean() + coef * load_balancing_loss(stats)
        return -picked.mean()

    @classmethod
    def twins(cls, cfg: LlamaConfig, mesh: Mesh, **kwargs) -> tuple["Llama", "Llama"]:
        """The jaxtdist model and the same model on XLA's collectives, same parameters."""
        ours = cls(cfg, mesh=mesh, impl="jaxtdist", rngs=nnx.Rngs(0), **kwargs)
        theirs = cls(cfg, mesh=mesh, impl="xla", rngs=nnx.Rngs(0), **kwargs)
        return ours, theirs


