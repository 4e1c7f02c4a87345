"""The sparse mixture-of-experts MLP block (Mixtral's, Qwen3-MoE's, DeepSeek's routed
experts): a router picks each token's top-k experts, each a SwiGLU MLP, and the
token's output is their weighted sum.

Expert parallel (the default): the experts are split over ``axis_name`` and the
sequence-parallel tokens travel to their experts' ranks and back
(``moe_dispatch``, the grouped GEMMs, ``moe_combine``, in one shard_map).
Tensor parallel: every rank holds every expert with the FFN dimension split
(``moe_tp_mlp``). ``impl="xla"``: the same parameters, the experts' weights
gathered by XLA and each rank's tokens through them (a reference).
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxtdist.nn._dense_experts import check_xla_experts, dense_experts
from jaxtdist.nn._layout import Layout, check_divisible, make_layout
from jaxtdist.nn._linear import _param
from jaxtdist.nn._moe_decode import expert_parallel_decode
from jaxtdist.ops._sharded import pjit_wrapper, rows_over
from jaxtdist.ops.moe import default_recv_rows, moe_combine, moe_dispatch
from jaxtdist.ops.grouped_matmul import MAX_GROUPS
from jaxtdist.ops.moe_tp import (GROUPED_GEMMS, expert_gemm, experts_partial_sum,
                                 moe_tp_mlp_sharded)

__all__ = ["ParallelMoE", "RouterStats", "load_balancing_loss"]

PARALLELISMS = ("expert", "tensor")


class RouterStats(NamedTuple):
    """One MoE layer's routing over one call's tokens (float32).

    Attributes:
      load: [E] per expert, the share of tokens that picked it (summed over the
        k picks: the entries sum to top_k; picks dropped by the capacity count).
      prob: [E] per expert, its router probability averaged over the tokens.
      dropped: [] the share of the tokens' picks that the expert capacity dropped
        (0 without ``capacity_factor``).
      invalid: [] int32, the tokens' picks with an expert id outside [0, E) (from
        a ``route`` that returns such ids): they go to no expert and add zero to
        the output, as ``moe_dispatch`` takes them; 0 from the built-in router.
    """

    load: jax.Array
    prob: jax.Array
    dropped: jax.Array
    invalid: jax.Array | int = 0


def load_balancing_loss(stats: Sequence[RouterStats]) -> jax.Array:
    """The Switch-Transformer load-balancing loss over one or more MoE layers, as
    Hugging Face's Mixtral computes it: ``E * sum_e load_e * prob_e`` with ``load``
    and ``prob`` averaged over the layers (each layer's tokens alike, as HF
    concatenates them). top_k for a balanced router; add ``coef`` times it to the
    loss to train the routers towards balance.

    Example:
      >>> y, stats = moe(x, return_router_stats=True)
      >>> loss = task_loss(y) + 0.02 * jaxtdist.nn.load_balancing_loss([stats])
    """
    stats = list(stats)
    if not stats:
        raise ValueError("jaxtdist.nn.load_balancing_loss: no RouterStats given (a list of "
                         "the MoE layers' stats: layer(x, return_router_stats=True)[1])")
    load = sum(s.load for s in stats) / len(stats)
    prob = sum(s.prob for s in stats) / len(stats)
    return load.shape[-1] * jnp.sum(load * prob, axis=-1)


def _expert_parallel_block(tokens, expert_ids, weights, w_gate, w_up, w_down, *, axis_name,
                           num_experts, activation, grouped_gemm, max_recv_rows=None):
    """Inside shard_map: this rank's tokens to their experts' ranks, through this
    rank's experts (w_* [E / W, ...]), and back, weighted."""
    recv, sizes, handle = moe_dispatch(tokens, expert_ids, axis_name, num_experts=num_experts,
                                       max_recv_rows=max_recv_rows)
    gemm = expert_gemm(grouped_gemm, w_gate.shape[0], tokens.dtype)
    hidden = activation(gemm(recv, w_gate, sizes)) * gemm(recv, w_up, sizes)
    y = gemm(hidden.astype(tokens.dtype), w_down, sizes).astype(tokens.dtype)
    return moe_combine(y, handle, weights, axis_name)


@functools.lru_cache(maxsize=None)
def _expert_parallel():
    """The expert-parallel block on global arrays: tokens, ids and weights sharded on
    rows over (*batch_axes, axis_name), the experts' weights on E over axis_name."""
    def rows(axis, batch):
        return P(rows_over(axis, batch), None)

    return pjit_wrapper(
        _expert_parallel_block, name="nn.ParallelMoE",
        in_specs=lambda axis, batch: (rows(axis, batch),) * 3 + (P(axis, None, None),) * 3,
        out_specs=rows)


def _xla_block(tokens, expert_ids, weights, w_gate, w_up, w_down, *, axis_name, sharded,
               activation, experts="ragged_dot", capacity_factor=None):
    """Inside shard_map, XLA's collectives only: the experts' weights gathered
    (``sharded``: the dims split over ``axis_name``), this rank's tokens through
    every expert they picked (``experts``: ``xla_experts``)."""
    w_gate, w_up, w_down = (jax.lax.all_gather(w, axis_name, axis=d, tiled=True)
                            for w, d in zip((w_gate, w_up, w_down), sharded))
    k = expert_ids.shape[1]
    if experts == "dense":  # slots for the layer's capacity, else for every pick
        capacity = (None if capacity_factor is None else expert_capacity(
            capacity_factor, tokens.shape[0], k, w_gate.shape[0]))
        return dense_experts(tokens, expert_ids, weights, w_gate, w_up, w_down, activation,
                             capacity).astype(tokens.dtype)
    out = experts_partial_sum(tokens, expert_ids.reshape(-1), weights.reshape(-1), k, w_gate,
                              w_down, w_up, activation, "ragged_dot")
    return out.astype(tokens.dtype)


def expert_capacity(capacity_factor: float, tokens: int, top_k: int, num_experts: int) -> int:
    """The picks one rank's ``tokens`` may send each expert:
    ``ceil(capacity_factor * tokens * top_k / num_experts)``, at least 1."""
    return max(1, math.ceil(capacity_factor * tokens * top_k / num_experts))


def _capacity_keep(ids: jax.Array, real: jax.Array, capacity: int, num_experts: int,
                   lay: Layout) -> jax.Array:
    """[T, K] bool: the picks within ``capacity`` per expert among each device's
    tokens (``ids`` [T, K] sharded on rows over the token axes; ``real`` [T] bool,
    padding rows False: never kept, taking no place). Earlier k first, then token
    order (GShard's priority: every token's first pick before any second pick).
    Each device ranks its own picks (no data moves)."""
    rows = P(lay.tokens, None)
    keep = functools.partial(_keep_within, capacity=capacity, num_experts=num_experts)
    ids, real = lay.constrain(ids, rows), lay.constrain(real, P(lay.tokens))
    return jax.shard_map(keep, mesh=lay.mesh, in_specs=(rows, P(lay.tokens)),
                         out_specs=rows)(ids, real)


def _keep_within(ids: jax.Array, real: jax.Array, *, capacity: int,
                 num_experts: int) -> jax.Array:
    """``_capacity_keep`` on one device's [T, K] picks. A pick's place among its
    expert's picks comes from a stable sort by expert (O(T K) memory; a one-hot
    count would take T K E)."""
    t, k = ids.shape
    expert = jnp.where(real[None, :], ids.T, num_experts).reshape(-1)  # k-major; padding last
    pick = jnp.arange(t * k, dtype=jnp.int32)
    expert, perm = jax.lax.sort((expert, pick), num_keys=1, is_stable=True)
    first = jnp.concatenate([jnp.ones((1,), bool), expert[1:] != expert[:-1]])
    start = jax.lax.cummax(jnp.where(first, pick, 0))  # where each expert's run starts
    _, place = jax.lax.sort((perm, pick - start), num_keys=1)  # back in pick order
    return ((place.reshape(k, t) < capacity) & real[None, :]).T


class ParallelMoE(nnx.Module):
    """A sparse MoE MLP block: ``sum_k w_k * down_e(act(gate_e(x)) * up_e(x))`` over
    the ``top_k`` experts ``e`` the router picks for each token.

    [batch, seq, d_model] in and out (sequence parallel, as the other layers).
    Routing: ``probs = softmax(x @ router)`` (float32), the ``top_k`` largest,
    renormalized to sum to 1 with ``norm_topk_prob`` (Mixtral's and Qwen3-MoE's
    routing; without it DeepSeek-V2-style weights). A call keeps no state (any
    JAX transform takes it, as ``ParallelMLP``); with ``return_router_stats=True``
    it returns ``(y, RouterStats)`` too, from which ``load_balancing_loss`` gives
    the router's auxiliary loss.

    ``parallelism="expert"`` (the default): experts ``[r * E / W, (r + 1) * E / W)``
    on rank r of ``axis_name`` (W its size; E a multiple of W), replicated over
    ``batch_axes``; tokens go to their experts' ranks with ``jaxtdist.moe_dispatch``
    and back with ``moe_combine``.
    ``parallelism="tensor"``: every rank holds every expert with ``hidden`` split
    over ``axis_name`` (``jaxtdist.moe_tp_mlp``). Parameters: ``router`` [d_model,
    E] (replicated), ``gate_proj`` and ``up_proj`` [E, d_model, hidden],
    ``down_proj`` [E, hidden, d_model], split on E (expert) or hidden (tensor).
    Hugging Face's ``mlp.gate.weight`` is ``router`` transposed and
    ``mlp.experts.{e}.gate_proj.weight`` is ``gate_proj[e]`` transposed.

    Expert capacity (``capacity_factor``, default None: none, no pick is dropped):
    each device's T tokens send each expert at most ``C = ceil(capacity_factor *
    T * top_k / num_experts)`` picks, first picks before second picks, then in
    token order (GShard's); a pick past C is dropped (weight 0, not sent), and
    ``RouterStats.dropped`` gives their share. Expert parallel, each rank then
    receives at most ``num_experts * C`` rows (``moe_dispatch``'s
    ``max_recv_rows``) instead of ``W * T * min(top_k, E / W)``: the memory and
    the grouped GEMMs' rows of a prefill shrink by about ``W / capacity_factor``.
    Every ``parallelism`` and ``impl`` drops the same picks (the same model).

    Example:
      >>> mesh = jax.make_mesh((2, 4), ("dp", "tp")); jaxtdist.initialize(mesh)
      >>> moe = ParallelMoE(512, 1024, num_experts=8, top_k=2, rngs=nnx.Rngs(0))
      >>> y = nnx.jit(lambda m, x: m(x))(moe, x)  # x: [batch, seq, 512]
    """

    def __init__(self, d_model: int, hidden: int, *, num_experts: int, top_k: int,
                 parallelism: str = "expert", norm_topk_prob: bool = True,
                 activation: Callable[[jax.Array], jax.Array] = jax.nn.silu,
                 grouped_gemm: str = "auto", axis_name: str = "tp",
                 batch_axes: str | Sequence[str] | None = None, mesh: Mesh | None = None,
                 dtype=None, param_dtype=jnp.float32,
                 kernel_init=nnx.initializers.lecun_normal(), impl: str = "jaxtdist",
                 capacity_factor: float | None = None, xla_experts: str = "ragged_dot",
                 low_latency_decode: bool = False, rngs: nnx.Rngs):
        """``grouped_gemm``: the experts' GEMMs, as ``jaxtdist.moe_tp_mlp`` takes it
        ("auto": ``jaxtdist.grouped_matmul`` on GPUs for 16-bit types, else
        ``jax.lax.ragged_dot``). ``xla_experts``: those of ``impl="xla"``,
        "ragged_dot" or "dense" (MaxText's capacity slots and batched GEMMs,
        ``jaxtdist.nn._dense_experts``). ``low_latency_decode``: expert parallel, a
        ``decode=True`` call runs the low-latency layout (``_moe_decode``; inference
        only, not differentiable)."""
        self.xla_experts = check_xla_experts("ParallelMoE", xla_experts)
        self.layout = make_layout("ParallelMoE", mesh=mesh, axis_name=axis_name,
                                  batch_axes=batch_axes, impl=impl)
        name = "jaxtdist.nn.ParallelMoE"
        if parallelism not in PARALLELISMS:
            raise ValueError(f"{name}: parallelism={parallelism!r}; allowed: 'expert' (experts "
                             "split over axis_name) or 'tensor' (every expert's hidden split)")
        if grouped_gemm not in GROUPED_GEMMS:
            raise ValueError(f"{name}: grouped_gemm={grouped_gemm!r}; allowed: "
                             f"{', '.join(map(repr, GROUPED_GEMMS))}")
        sizes = {"d_model": d_model, "hidden": hidden, "num_experts": num_experts,
                 "top_k": top_k}
        for what, value in sizes.items():
            if (isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral)
                    or value < 1):
                raise ValueError(f"{name}: {what}={value!r} must be an integer >= 1")
        d_model, hidden, num_experts, top_k = (int(v) for v in sizes.values())
        if not isinstance(norm_topk_prob, (bool, np.bool_)):
            raise ValueError(f"{name}: norm_topk_prob={norm_topk_prob!r} must be a bool")
        if capacity_factor is not None and (
                isinstance(capacity_factor, (bool, np.bool_))
                or not isinstance(capacity_factor, numbers.Real)
                or not math.isfinite(capacity_factor) or capacity_factor <= 0):
            raise ValueError(f"{name}: capacity_factor={capacity_factor!r} must be None (no "
                             "capacity: nothing dropped) or a finite number > 0 (each expert "
                             "takes at most ceil(capacity_factor * tokens * top_k / "
                             "num_experts) picks of each device's tokens)")
        if top_k > num_experts:
            raise ValueError(f"{name}: top_k={top_k} exceeds num_experts={num_experts}; each "
                             "token picks top_k distinct experts")
        check_divisible(self.layout, "num_experts" if parallelism == "expert" else "hidden",
                        num_experts if parallelism == "expert" else hidden)
        local = num_experts // self.layout.tp if parallelism == "expert" else num_experts
        if grouped_gemm == "jaxtdist" and local > MAX_GROUPS:
            raise ValueError(f"{name}: grouped_gemm='jaxtdist' runs at most {MAX_GROUPS} experts "
                             f"per rank; parallelism={parallelism!r} puts {local} of "
                             f"num_experts={num_experts} on each: use grouped_gemm='auto' or "
                             "'ragged_dot', or split the experts over more ranks")
        self.d_model, self.hidden = d_model, hidden
        self.num_experts, self.top_k = num_experts, top_k
        self.parallelism, self.norm_topk_prob = parallelism, bool(norm_topk_prob)
        self.activation, self.grouped_gemm, self.dtype = activation, grouped_gemm, dtype
        self.capacity_factor = None if capacity_factor is None else float(capacity_factor)
        self.low_latency_decode = bool(low_latency_decode)
        axis = axis_name
        specs = (((axis, None, None),) * 3 if parallelism == "expert"
                 else ((None, None, axis), (None, None, axis), (None, axis, None)))
        self.router = _param(kernel_init, self.layout, (None, None), rngs,
                             (d_model, num_experts), param_dtype)
        shapes = ((num_experts, d_model, hidden),) * 2 + ((num_experts, hidden, d_model),)
        self.gate_proj, self.up_proj, self.down_proj = (
            _param(_per_expert(kernel_init), self.layout, spec, rngs, shape, param_dtype)
            for spec, shape in zip(specs, shapes))

    def route(self, tokens: jax.Array,
              real: jax.Array | None = None) -> tuple[jax.Array, jax.Array, RouterStats]:
        """(expert_ids [T, top_k] int32, weights [T, top_k] float32, the stats of the
        rows where ``real`` [T] bool holds, all by default) of tokens [T, d] sharded
        over (*batch_axes, axis_name)."""
        lay = self.layout
        logits = lay.dot(tokens.astype(jnp.float32), self.router[...].astype(jnp.float32),
                         P(lay.tokens, None))
        probs = jax.nn.softmax(logits, axis=-1)
        # Each rank its own tokens' top k: XLA's partitioner gathers every token's
        # probabilities onto every device for a top_k it is given on sharded rows.
        rows = P(lay.tokens, None)
        weights, ids = jax.shard_map(lambda p: tuple(jax.lax.top_k(p, self.top_k)),
                                     mesh=lay.mesh, in_specs=rows, out_specs=(rows, rows))(probs)
        if self.norm_topk_prob:
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        # A decode step's padding rows route too, but count in no statistic.
        picks = jnp.sum(jax.nn.one_hot(ids, self.num_experts, dtype=jnp.float32), axis=1)
        if real is None:
            load, prob = jnp.mean(picks, axis=0), jnp.mean(probs, axis=0)
        else:
            live = real.astype(jnp.float32)[:, None]
            count = jnp.maximum(jnp.sum(live), 1.0)  # a batch of padding only: zeros
            load, prob = jnp.sum(picks * live, 0) / count, jnp.sum(probs * live, 0) / count
        stats = RouterStats(load=load, prob=prob, dropped=jnp.zeros((), jnp.float32),
                            invalid=jnp.zeros((), jnp.int32))
        return ids.astype(jnp.int32), weights, stats

    def __call__(self, x: jax.Array, *, decode: bool = False,
                 lengths: jax.Array | None = None, return_router_stats: bool = False):
        """x: [batch, seq, d_model] (any seq: padded inside); ``decode``: [batch, 1,
        d_model], one token each. ``lengths`` [batch]: each sequence's real tokens,
        the rest right padding, which routes nowhere (not sent, no capacity taken,
        in no statistic; its rows hold no result of use). Returns y like x, or
        ``(y, RouterStats)`` with ``return_router_stats``."""
        lay = self.layout
        x, batch, seq, real_seq = lay.pad_input(x, self.d_model, decode)
        if decode and lengths is not None:
            raise ValueError("jaxtdist.nn.ParallelMoE: lengths are not taken by a decode "
                             "step (one real token per sequence)")
        dtype = self.dtype or x.dtype
        tokens = lay.to_tokens(x, decode).astype(dtype)
        real = None
        if lengths is not None or seq != real_seq:
            lengths = (jnp.full((batch,), real_seq, jnp.int32) if lengths is None
                       else lay.check_lengths(lengths, batch, real_seq))
            real = lay.token_mask(lengths, batch, seq)
        if decode:
            # One token per sequence, on every tensor-parallel rank of its group:
            # spread over the group's ranks like a prefill (padding rows route too).
            tokens, real = lay.spread_decode(tokens)
        ids, weights, stats = self.route(tokens, real)
        live = jnp.ones(tokens.shape[:1], bool) if real is None else real
        # Picks outside [0, E) (a route() that returns them): no expert, zero output.
        stats = stats._replace(invalid=jnp.sum(live[:, None] & ((ids < 0)
                                                               | (ids >= self.num_experts)),
                                               dtype=jnp.int32))
        rows, sent = None, None if real is None else real[:, None]
        if self.capacity_factor is not None:
            per_device = tokens.shape[0] // (lay.dp * lay.tp)
            capacity = expert_capacity(self.capacity_factor, per_device, self.top_k,
                                       self.num_experts)
            keep = _capacity_keep(ids, live, capacity, self.num_experts, lay)
            picks = jnp.maximum(jnp.sum(live, dtype=jnp.float32), 1.0) * self.top_k
            stats = stats._replace(dropped=jnp.sum(live[:, None] & ~keep, dtype=jnp.float32)
                                   / picks)
            weights = jnp.where(keep, weights, 0.0)
            rows = min(self.num_experts * capacity,
                       default_recv_rows(per_device, self.top_k, lay.tp, self.num_experts))
            sent = keep  # padding rows are never kept
        if sent is not None:  # padding weighs 0: it takes no slot of the dense experts
            weights = jnp.where(sent, weights, 0.0)
        if sent is not None and self.parallelism == "expert" and lay.impl != "xla":
            # Dropped picks and padding rows (a decode step's, which all route
            # alike, or a prompt's): not sent; the dispatch skips ids outside [0, E).
            ids = jnp.where(sent, ids, -1)
        w_gate, w_up, w_down = (p[...].astype(dtype)
                                for p in (self.gate_proj, self.up_proj, self.down_proj))
        if (decode and self.low_latency_decode and self.parallelism == "expert"
                and lay.impl != "xla"):
            y = expert_parallel_decode()(tokens, ids, weights, w_gate, w_up, w_down,
                                         axis_name=lay.axis_name, batch_axes=lay.batch_axes,
                                         num_experts=self.num_experts, activation=self.activation)
        else:
            y = self._experts(lay, tokens, ids, weights, w_gate, w_up, w_down, rows)
        if decode:
            y = lay.gather_decode(y, batch)
        y = lay.unpad(lay.from_tokens(y, batch, seq, decode), real_seq)
        return (y, stats) if return_router_stats else y

    def _experts(self, lay: Layout, tokens, ids, weights, w_gate, w_up, w_down,
                 max_recv_rows: int | None) -> jax.Array:
        """[T, d] tokens sharded over (*batch_axes, axis_name) -> their outputs, alike
        (``max_recv_rows``: the expert-parallel dispatch's, None: its default)."""
        axis, batch_axes = lay.axis_name, lay.batch_axes
        if lay.impl == "xla":
            sharded = (0, 0, 0) if self.parallelism == "expert" else (2, 2, 1)
            specs = (P(lay.tokens, None),) * 3 + tuple(_spec(axis, d, 3) for d in sharded)
            args = tuple(lay.constrain(a, s) for a, s in
                         zip((tokens, ids, weights, w_gate, w_up, w_down), specs))
            return jax.shard_map(
                functools.partial(_xla_block, axis_name=axis, sharded=sharded,
                                  activation=self.activation, experts=self.xla_experts,
                                  capacity_factor=self.capacity_factor),
                mesh=lay.mesh, in_specs=specs, out_specs=P(lay.tokens, None))(*args)
        if self.parallelism == "expert":
            return _expert_parallel()(tokens, ids, weights, w_gate, w_up, w_down,
                                      axis_name=axis, batch_axes=batch_axes,
                                      num_experts=self.num_experts, activation=self.activation,
                                      grouped_gemm=self.grouped_gemm,
                                      max_recv_rows=max_recv_rows)
        return moe_tp_mlp_sharded(tokens, ids, weights, w_gate, w_down, w_up=w_up,
                                  axis_name=axis, batch_axes=batch_axes,
                                  activation=self.activation, grouped_gemm=self.grouped_gemm)


def _spec(axis: str, dim: int, ndim: int) -> P:
    """A PartitionSpec of ``ndim`` dims with ``dim`` split over ``axis``."""
    return P(*(axis if d == dim else None for d in range(ndim)))


def _per_expert(init):
    """``init`` applied to each expert's [in, out] matrix of an [E, in, out] stack
    (fan-in and fan-out are the matrix's, not the stack's)."""
    def stacked(key, shape, dtype=jnp.float32):
        keys = jax.random.split(key, shape[0])
        return jax.vmap(lambda k: init(k, shape[1:], dtype))(keys)
    return stacked
