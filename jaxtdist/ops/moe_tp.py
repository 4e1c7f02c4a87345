"""jaxtdist.moe_tp_mlp: the tensor-parallel mixture-of-experts MLP.

Tokens are sharded over ``axis_name`` on the sequence; every rank holds every
expert with the FFN dimension sharded over ``axis_name``. The layer is
all-gather of the tokens (and their routing), per-expert GEMMs on this rank's
FFN shard (grouped GEMMs over the (token, expert) pairs sorted by expert:
``jaxtdist.grouped_matmul`` on GPUs, ``jax.lax.ragged_dot`` elsewhere), the
weighted sum over each token's experts, and a reduce-scatter of the partial
sums back to the tokens' owners. The gather (one launch: the tokens, their
expert ids and routing weights packed in one row each) and the reduce-scatter
are jaxtdist's (no XLA collective): the step-by-step schedule. The overlapped
schedule (``_moe_tp_overlap``: the gather fused into the first grouped GEMM,
the reduce-scatter into the second) serves the forward pass where each
(rank, expert) group has rows enough to tile; its backward pass
differentiates the step-by-step schedule.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxtdist._errors import HeapExhaustedError
from jaxtdist.ops._expert_order import expert_order, sum_pairs
from jaxtdist.ops._fp8_gemm import no_gradient
from jaxtdist.ops._moe_tp_fp8 import experts_partial_sum_fp8, moe_fp8_scaling
from jaxtdist.ops._moe_tp_overlap import overlapped_forward
from jaxtdist.ops._op import DistributedOp, first_order_only, run_once, under_vmap
from jaxtdist.ops._protocol import check_axis, check_inside_shard_map
from jaxtdist.ops._shapes import check_dtype, static_bool
from jaxtdist.ops._sharded import pjit_wrapper, rows_over
from jaxtdist.ops.all_gather import all_gather
from jaxtdist.ops.grouped_matmul import MAX_GROUPS, grouped_matmul
from jaxtdist.ops.reduce_scatter import reduce_scatter
from jaxtdist.runtime._runtime import runtime

__all__ = ["moe_tp_mlp", "moe_tp_mlp_sharded"]


def _check(x, expert_ids, weights, w1, w2, w_up, axis_name, fp8: bool = False) -> None:
    """The arguments' shapes and dtypes; ``fp8``: the expert weights were checked by
    ``moe_fp8_scaling`` (K-major FP8), only the tokens and routing are here."""
    if x.ndim != 2:
        raise ValueError(f"jaxtdist.moe_tp_mlp: x must be [T_shard, H], got x{x.shape}")
    t, h = x.shape
    if expert_ids.ndim != 2 or expert_ids.shape[0] != t:
        raise ValueError(f"jaxtdist.moe_tp_mlp: expert_ids must be [T_shard, K] = [{t}, K] "
                         f"like x{x.shape}, got expert_ids{expert_ids.shape}")
    if expert_ids.shape[1] < 1:
        raise ValueError(f"jaxtdist.moe_tp_mlp: expert_ids{expert_ids.shape} routes each token "
                         "to K=0 experts; K must be at least 1 (top-K routing)")
    if not jnp.issubdtype(expert_ids.dtype, jnp.integer):
        raise ValueError(f"jaxtdist.moe_tp_mlp: expert_ids must be integers, got "
                         f"{expert_ids.dtype.name}")
    if weights.shape != expert_ids.shape or not jnp.issubdtype(weights.dtype, jnp.floating):
        raise ValueError(f"jaxtdist.moe_tp_mlp: weights must be floats shaped like expert_ids"
                         f"{expert_ids.shape}, got {weights.dtype.name}{weights.shape}")
    if not fp8:
        _check_weight_shapes(x, w1, w2, w_up)
    check_dtype("moe_tp_mlp", "x", x.dtype)
    for name, a in (("w1", w1), ("w2", w2), ("w_up", w_up)):
        if not fp8 and a is not None and a.dtype != x.dtype:
            raise ValueError(f"jaxtdist.moe_tp_mlp: {name} has dtype {a.dtype.name}, x "
                             f"{x.dtype.name}: they must match")
    rt = runtime()
    check_axis(rt, axis_name, "moe_tp_mlp")
    check_inside_shard_map(rt, "moe_tp_mlp")


def _check_weight_shapes(x, w1, w2, w_up) -> None:
    """16/32-bit expert weights: w1 / w_up [E, H, F_shard], w2 [E, F_shard, H]."""
    h = x.shape[1]
    if w1.ndim != 3 or w1.shape[1] != h:
        raise ValueError(f"jaxtdist.moe_tp_mlp: w1 must be [E, H, F_shard] with H={h} (x's "
                         f"hidden size), got w1{w1.shape}")
    e, _, f = w1.shape
    if e < 1:
        raise ValueError(f"jaxtdist.moe_tp_mlp: w1 must hold at least one expert, got "
                         f"w1{w1.shape}")
    if w2.shape != (e, f, h):
        raise ValueError(f"jaxtdist.moe_tp_mlp: w2 must be [E, F_shard, H] = {(e, f, h)} to "
                         f"match w1{w1.shape} and x{x.shape}, got w2{w2.shape}")
    if w_up is not None and w_up.shape != w1.shape:
        raise ValueError(f"jaxtdist.moe_tp_mlp: w_up must be shaped like w1{w1.shape}, got "
                         f"w_up{w_up.shape}")


def _words(a: jax.Array, dtype) -> jax.Array:
    """[T, K] 32-bit values as words of ``dtype``, exactly: raw bits in a 32-bit
    dtype; in a 16-bit one, each value's four bytes as the numbers 0-255 (raw 16-bit
    words could be NaNs, whose payloads a copy may canonicalize)."""
    if jnp.dtype(dtype).itemsize == 4:
        return jax.lax.bitcast_convert_type(a, dtype)
    return jax.lax.bitcast_convert_type(a, jnp.uint8).astype(dtype).reshape(a.shape[0], -1)


def _values(words: jax.Array, k: int, dtype) -> jax.Array:
    """``_words``' inverse: [T, K] of the 32-bit ``dtype`` from a row's first words."""
    if words.dtype.itemsize == 4:
        return jax.lax.bitcast_convert_type(words[:, :k], dtype)
    octets = words[:, :4 * k].astype(jnp.uint8).reshape(-1, k, 4)
    return jax.lax.bitcast_convert_type(octets, dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _gather_tokens(x: jax.Array, ids: jax.Array, gate: jax.Array, axis_name):
    """jaxtdist's all_gather of x [T, H], ids [T, K] int32 and gate [T, K] float32
    in one launch: each token's ids and weights travel at the end of its row
    (``_words``; the words padded to a multiple of 16 bytes). Small gathers cost
    their latency more than their bytes: at 128 tokens per rank of 4096 bf16 on
    2 x H100 the one launch took 50.8 us against 61.9 for three. (The words as
    extra rows of x's width instead, 129 rows for 128 tokens, took 66.4.)"""
    h = x.shape[1]
    words = [_words(ids, x.dtype), _words(gate, x.dtype)]
    n = words[0].shape[1]
    pad = -(2 * n * x.dtype.itemsize) % 16 // x.dtype.itemsize
    packed = all_gather(jnp.concatenate([x, *words, jnp.zeros((x.shape[0], pad), x.dtype)], 1),
                        axis_name)
    k = ids.shape[1]
    return (packed[:, :h], _values(packed[:, h:h + n], k, jnp.int32),
            _values(packed[:, h + n:], k, jnp.float32))


def _gather_tokens_fwd(x, ids, gate, axis_name):
    # Under jax.checkpoint the gather runs once, in the forward pass (``run_once``): a
    # recomputed call in the backward pass would be unordered with the others.
    x, gate = first_order_only("moe_tp_mlp", x, gate)
    return run_once(_gather_tokens(x, ids, gate, axis_name)), None


def _gather_tokens_bwd(axis_name, _, cts):
    """An all-gather's transpose for x and the weights (the ids have none)."""
    ct_x, _, ct_gate = cts
    return reduce_scatter(ct_x, axis_name), None, reduce_scatter(ct_gate, axis_name)


_gather_tokens.defvjp(_gather_tokens_fwd, _gather_tokens_bwd)


GROUPED_GEMMS = ("auto", "ragged_dot", "jaxtdist")


def _check_grouped_gemm(grouped_gemm) -> None:
    if grouped_gemm not in GROUPED_GEMMS:
        raise ValueError(f"jaxtdist.moe_tp_mlp: grouped_gemm={grouped_gemm!r}; allowed: "
                         "'auto' (the default), 'ragged_dot' (XLA's) or 'jaxtdist' "
                         "(jaxtdist.grouped_matmul)")


def _pick_grouped_gemm(grouped_gemm: str, experts: int, dtype) -> str:
    """"auto": jaxtdist.grouped_matmul on GPUs for 16-bit types and at most its
    MAX_GROUPS experts: on 1 x H200 it ran Mixtral's expert GEMMs (4096 rows, 8
    experts, 4096 x 14336 and back) in 0.17-0.18x ragged_dot's time, the backward
    in 0.26x (docs/perf/grouped_matmul). Elsewhere ragged_dot: under the
    interpreter the Triton GEMM would be slow, and XLA's float32 GEMM is exact."""
    if grouped_gemm != "auto":
        return grouped_gemm
    fast = (runtime().platform == "gpu" and experts <= MAX_GROUPS
            and jnp.dtype(dtype).itemsize == 2)
    return "jaxtdist" if fast else "ragged_dot"


def _ragged_dot(a: jax.Array, b: jax.Array, sizes: jax.Array) -> jax.Array:
    return jax.lax.ragged_dot(a, b, sizes, preferred_element_type=jnp.float32)


def _ragged_dot_pullback(a, b, sizes, dy):
    return jax.vjp(lambda a, b: _ragged_dot(a, b, sizes), a, b)[1](dy)


# JAX has no batching rule for ragged_dot with batched group sizes (each vmapped
# element routes its own tokens), so under vmap the forward and its pullback run
# one element after another (lax.map); without vmap they are ragged_dot itself.
_ragged_dot_each = jax.custom_batching.sequential_vmap(_ragged_dot)
_ragged_dot_pullback_each = jax.custom_batching.sequential_vmap(_ragged_dot_pullback)


@jax.custom_vjp
def _ragged_gemm(a: jax.Array, b: jax.Array, sizes: jax.Array) -> jax.Array:
    """``ragged_dot(a, b, sizes)`` in float32 that vmap and grad both accept."""
    return _ragged_dot_each(a, b, sizes)


def _ragged_gemm_fwd(a, b, sizes):
    # (JAX cannot differentiate sequential_vmap's call: second order stops here.)
    a, b = first_order_only("moe_tp_mlp", a, b)
    return _ragged_dot_each(a, b, sizes), (a, b, sizes)


def _ragged_gemm_bwd(residuals, dy):
    return (*_ragged_dot_pullback_each(*residuals, dy), None)


_ragged_gemm.defvjp(_ragged_gemm_fwd, _ragged_gemm_bwd)


def expert_gemm(grouped_gemm: str, experts: int,
                dtype) -> Callable[[jax.Array, jax.Array, jax.Array], jax.Array]:
    """The experts' grouped GEMM ``gemm(rows, w, group_sizes)`` -> float32, as
    ``grouped_gemm`` names it ("auto": ``_pick_grouped_gemm``; "jaxtdist"'s results
    are rounded to the rows' dtype first). Differentiable; vmap takes both."""
    _check_grouped_gemm(grouped_gemm)
    if _pick_grouped_gemm(grouped_gemm, experts, dtype) == "jaxtdist":
        def gemm(a, b, sizes):
            return grouped_matmul(a, b, sizes).astype(jnp.float32)
        return gemm
    return _ragged_gemm


def experts_partial_sum(xs: jax.Array, ids: jax.Array, gate: jax.Array, k: int, w1: jax.Array,
                        w2: jax.Array, w_up: jax.Array | None,
                        activation: Callable[[jax.Array], jax.Array],
                        grouped_gemm: str = "auto") -> jax.Array:
    """This rank's FFN-shard contribution for every gathered token: [T, H] float32.

    xs [T, H] tokens; ids, gate [T * K] flat routing (pair t * K + j); w1, w_up
    [E, H, F_shard]; w2 [E, F_shard, H]. Pairs are sorted by expert into the
    groups of ``jax.lax.ragged_dot``; an id outside [0, E) is weighted 0.
    ``grouped_gemm``: "ragged_dot" (XLA's grouped GEMM, float32 results),
    "jaxtdist" (``jaxtdist.grouped_matmul``, results rounded to xs's dtype;
    needs E <= 256 and a jaxtdist runtime, inside shard_map) or "auto"
    (``_pick_grouped_gemm``).
    """
    gemm = expert_gemm(grouped_gemm, w1.shape[0], xs.dtype)
    gate, order, position, sizes, valid = expert_order(ids, gate, w1.shape[0])
    rows = _pairs_by_expert(xs, order, position, k)                      # [T * K, H]
    hidden = activation(gemm(rows, w1, sizes))
    if w_up is not None:
        hidden = hidden * gemm(rows, w_up, sizes)
    y = gemm(hidden.astype(xs.dtype), w2, sizes)                        # [T * K, H]
    return sum_pairs(_pairs_by_token(y, order, position).reshape(-1, k, y.shape[-1]), gate,
                     valid)


# The rows' moves between token order and expert order are permutations (with each
# token's row repeated K times), so each one's transpose is the other direction:
# gathers both ways, where JAX's own transposes would be scatter-adds (a scatter-add
# of the pairs into [T, H] float32 took 276 us of a 3.25 ms layer, 2048 tokens per
# rank over 4 x H100, against about 80 us for the gather and sum that replace it).
@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _pairs_by_expert(xs: jax.Array, order: jax.Array, position: jax.Array, k: int):
    """[T * K, H]: each token's row once per pair, the pairs in ``order`` (by expert)."""
    return xs[order // k]


def _pairs_by_expert_fwd(xs, order, position, k):
    return _pairs_by_expert(xs, order, position, k), (order, position)


def _pairs_by_expert_bwd(k, residuals, ct):
    """A token's cotangent: the sum of its K pairs' (float32, rounded once)."""
    order, position = residuals
    rows = ct[position].reshape(-1, k, ct.shape[-1]).astype(jnp.float32)
    return jnp.sum(rows, axis=1).astype(ct.dtype), None, None


_pairs_by_expert.defvjp(_pairs_by_expert_fwd, _pairs_by_expert_bwd)


@jax.custom_vjp
def _pairs_by_token(y: jax.Array, order: jax.Array, position: jax.Array):
    """[T * K, H]: rows in expert order back to pair order (pair t * K + j)."""
    return y[position]


def _pairs_by_token_fwd(y, order, position):
    return _pairs_by_token(y, order, position), (order, position)


def _pairs_by_token_bwd(residuals, ct):
    order, _ = residuals
    return ct[order], None, None


_pairs_by_token.defvjp(_pairs_by_token_fwd, _pairs_by_token_bwd)


def moe_tp_mlp(x: jax.Array, expert_ids: jax.Array, weights: jax.Array, w1: jax.Array,
               w2: jax.Array, axis_name="tp", *,
               activation: Callable[[jax.Array], jax.Array] = jax.nn.silu,
               w_up: jax.Array | None = None, grouped_gemm: str = "auto",
               overlap: bool | None = None, w1_scale: jax.Array | None = None,
               w2_scale: jax.Array | None = None,
               w_up_scale: jax.Array | None = None) -> jax.Array:
    """A mixture-of-experts MLP with the experts' FFN dimension sharded over ``axis_name``.

    Call inside ``jax.shard_map`` over the mesh given to ``jaxtdist.initialize``.
    Equivalent to: gather the tokens of every rank; for each token t and each of
    its K experts e = expert_ids[t, k], ``activation(x[t] @ w1[e]) @ w2[e]``
    (gated: ``(activation(x[t] @ w1[e]) * (x[t] @ w_up[e])) @ w2[e]``) on this
    rank's FFN shard, summed with weights[t, k]; then sum over ranks and keep
    this rank's tokens. Differentiable (x, weights and the expert weights).

    The experts run as grouped GEMMs over the (token, expert) pairs grouped by
    expert (counts are data: one compiled program serves every routing). Two
    schedules (``overlap``): step by step (jaxtdist's all_gather of the tokens,
    the GEMMs, jaxtdist's reduce-scatter of float32 partial sums), or
    overlapped (each rank sorts its own pairs and pushes them to its peers
    while the first GEMM runs; the second GEMM pushes each tile of another
    rank's pairs to that rank as it is computed, 16-bit partials added in
    float32). An expert id outside [0, E) contributes nothing.

    Args:
      x: [T_shard, H], this rank's tokens (sequence sharded over ``axis_name``).
      expert_ids: [T_shard, K] integer top-K routing of those tokens.
      weights: [T_shard, K] float routing weights.
      w1: [E, H, F_shard], every expert's up (or gate) projection, this rank's
        columns of the FFN dimension.
      w2: [E, F_shard, H], every expert's down projection, this rank's rows.
      axis_name: the mesh axis (or tuple of axes) tokens and FFN are sharded over.
      activation: elementwise, applied to ``x @ w1``.
      w_up: optional [E, H, F_shard] second projection of a gated MLP (SwiGLU:
        ``activation=jax.nn.silu``, w1 the gate).
      grouped_gemm: the experts' GEMMs: "auto" (the default: "jaxtdist" on GPUs
        for bfloat16 / float16 and E <= 256, where it ran 5-6x faster than
        ragged_dot; else "ragged_dot"), "ragged_dot" (``jax.lax.ragged_dot``,
        float32 results) or "jaxtdist" (``jaxtdist.grouped_matmul``: E <= 256;
        each GEMM's result rounded to x's dtype before the activation and the sum).
      overlap: the schedule. True: the overlapped one, the token gather fused
        into the first grouped GEMM (each peer's tiles start as its rows land)
        and the reduce-scatter into the second (each tile pushed to its owner
        as it is computed); needs E <= 256. False: gather, GEMMs, reduce-scatter
        one after the other. None (the default): overlapped on GPUs at world > 1
        with jaxtdist's grouped GEMM and at least 256 (token, expert) pairs per
        expert and rank on average (Mixtral's experts over 4 x H200: 0.92x
        the step-by-step time at 2048 tokens per rank, 1.65x at 128). The
        overlapped kernels run where no derivative is taken (inference); under
        autodiff (jax.grad, jax.vjp) the layer is the step-by-step schedule,
        forward and backward, with the residuals JAX keeps (the overlapped
        forward would need the steps' forward again in the backward pass);
        differentiated through jax.vmap, the overlapped forward and the steps'
        recomputed forward and backward.
      w1_scale, w2_scale, w_up_scale: FP8 experts only (below): the weights'
        float32 dequantization scales.

    FP8 experts (the scales given; ``jaxtdist.ops._moe_tp_fp8``): w1 (and w_up)
    K-major [E, F_shard, H] and w2 [E, H, F_shard] in one FP8 format
    (``jaxtdist.quantize_weight`` of the [E, H, F] and [E, F, H] weights, sharded
    over F), scales blockwise ([E, cdiv(F_shard, 128), H / 128] and [E, cdiv(H,
    128), F_shard / 128]; H and F_shard multiples of 128) or per tensor (() or
    [E]). x stays bfloat16 / float16 / float32: the activations are quantized on
    the fly to the weights' format by ``jaxtdist.quantize`` in a JAX pass (each
    gathered token once, per 1 x 128 block or per tensor as the weights are; the
    hidden rows in float32 after the activation), then both GEMMs run
    ``jaxtdist.grouped_matmul``'s FP8 kernel with float32 accumulation and
    results (``grouped_gemm`` "auto" or "jaxtdist"). The step-by-step schedule
    only (tokens gathered in x's dtype; ``overlap=True`` is refused), not
    differentiable (a TypeError names the arguments).

    Returns:
      [T_shard, H] in x's dtype: this rank's tokens' MLP output.

    Example:
      >>> mesh = jax.make_mesh((4,), ("tp",)); jaxtdist.initialize(mesh)
      >>> f = jax.jit(jax.shard_map(
      ...     lambda x, i, g, a, b: jaxtdist.moe_tp_mlp(x, i, g, a, b, "tp"), mesh=mesh,
      ...     in_specs=(P("tp"), P("tp"), P("tp"), P(None, None, "tp"), P(None, "tp")),
      ...     out_specs=P("tp")))
      >>> w1q, w1s = jaxtdist.quantize_weight(w1)   # FP8: [E, F, H], shard P(None, "tp")
      >>> w2q, w2s = jaxtdist.quantize_weight(w2)   # [E, H, F], shard P(None, None, "tp")
      >>> # inside shard_map: jaxtdist.moe_tp_mlp(x, i, g, w1q, w2q, "tp",
      >>> #                                       w1_scale=w1s, w2_scale=w2s)
    """
    x, expert_ids, weights, w1, w2 = (jnp.asarray(a)
                                      for a in (x, expert_ids, weights, w1, w2))
    w_up = None if w_up is None else jnp.asarray(w_up)
    scaling = moe_fp8_scaling(x, w1, w2, w_up, w1_scale, w2_scale, w_up_scale)
    _check(x, expert_ids, weights, w1, w2, w_up, axis_name, fp8=scaling is not None)
    _check_grouped_gemm(grouped_gemm)
    ids = expert_ids
    if jnp.dtype(ids.dtype).itemsize > 4:  # x64: ids past int32 are invalid, not wrapped
        ids = jnp.where((ids >= 0) & (ids < w1.shape[0]), ids, -1)
    ids = ids.astype(jnp.int32)
    gate = weights.astype(jnp.float32)
    if scaling is not None:
        return _fp8_steps(x, ids, gate, w1, w2, w_up, (w1_scale, w2_scale, w_up_scale),
                          activation, axis_name, grouped_gemm, overlap,
                          scaling).astype(x.dtype)
    if _overlaps(overlap, x, ids, w1, axis_name, grouped_gemm):
        try:
            if under_vmap(x, ids, gate, w1, w2, w_up):
                # custom_jvp's rule batched: the steps' custom VJPs inside it fail.
                up = () if w_up is None else (w_up,)
                out = _OVERLAPPED(x, ids, gate, w1, w2, *up, axis_name=axis_name,
                                  activation=activation, grouped_gemm=grouped_gemm)
            else:
                out = _overlapped_or_steps(x, ids, gate, w1, w2, w_up, axis_name, activation,
                                           grouped_gemm)
            return out.astype(x.dtype)
        except HeapExhaustedError:
            if overlap:
                raise
    return _steps(x, ids, gate, w1, w2, w_up, activation, axis_name,
                  grouped_gemm).astype(x.dtype)


def _steps(x, ids, gate, w1, w2, w_up, activation, axis_name, grouped_gemm) -> jax.Array:
    """The step-by-step schedule: [T_shard, H] float32."""
    k = ids.shape[1]
    xs, ids, gate = _gather_tokens(x, ids, gate, axis_name)                # [T, H], [T, K]
    ids, gate = ids.reshape(-1), gate.reshape(-1)                        # [T * K]
    partial = experts_partial_sum(xs, ids, gate, k, w1, w2, w_up, activation, grouped_gemm)
    return reduce_scatter(partial, axis_name)


_FP8_NAMES = ("x", "weights", "w1", "w2", "w_up", "w1_scale", "w2_scale", "w_up_scale")


def _fp8_steps(x, ids, gate, w1, w2, w_up, scales, activation, axis_name, grouped_gemm,
               overlap, scaling: str) -> jax.Array:
    """The step-by-step schedule with FP8 experts (``_moe_tp_fp8``): [T_shard, H]
    float32. The overlapped kernels take no FP8 weights (yet): overlap=True is
    refused, None runs the steps."""
    if static_bool("moe_tp_mlp", "overlap", overlap, none="the default rule"):
        raise ValueError("jaxtdist.moe_tp_mlp: overlap=True with FP8 experts: the overlapped "
                         "schedule has no FP8 kernels; pass overlap=None or False (the "
                         "step-by-step schedule runs the FP8 grouped GEMMs)")
    if grouped_gemm == "ragged_dot":
        raise ValueError("jaxtdist.moe_tp_mlp: grouped_gemm='ragged_dot' with FP8 experts: "
                         "XLA's ragged_dot takes no FP8 scales; pass grouped_gemm='auto' or "
                         "'jaxtdist' (jaxtdist.grouped_matmul's FP8 kernel)")
    x, gate, w1, w2, w_up, *scales = no_gradient("moe_tp_mlp", x, gate, w1, w2, w_up, *scales,
                                                 names=_FP8_NAMES)
    k = ids.shape[1]
    xs, ids, gate = _gather_tokens(x, ids, gate, axis_name)                # [T, H], [T, K]
    partial = experts_partial_sum_fp8(xs, ids.reshape(-1), gate.reshape(-1), k, w1, w2, w_up,
                                      tuple(scales), activation, scaling)
    return reduce_scatter(partial, axis_name)


# The overlapped schedule pays off once a (rank, expert) group fills row tiles: it
# tiles each rank's chunk on its own, so with few rows per group the experts'
# weights are read once per rank instead of once. Mixtral's experts (H 4096, F
# 14336, top-2 of 8) on 4 x H200: 32 rows per group (128 tokens per rank) took
# 724 us against 439 step by step, 128 rows 1006 against 992, 512 rows 2686
# against 2932 (docs/perf/moe_tp_NVIDIA_H200x4).
OVERLAP_MIN_ROWS = 256


def _overlaps(overlap, x, ids, w1, axis_name, grouped_gemm) -> bool:
    """Whether moe_tp_mlp runs the overlapped schedule (``overlap``: True, False or
    None, the default rule: on GPUs, world > 1, where the grouped GEMM picked is
    jaxtdist's, with OVERLAP_MIN_ROWS rows per (rank, expert) on average)."""
    overlap = static_bool("moe_tp_mlp", "overlap", overlap, none="the default rule")
    experts = w1.shape[0]
    rt = runtime()
    # Peers' chunks travel on copy engines on GPUs (the SM push that stands in for
    # them under the interpreter relies on its programs running one at a time).
    pushes = rt.platform != "gpu" or rt.backend.has_copy_engines
    if overlap:
        if experts > MAX_GROUPS:
            raise ValueError(f"jaxtdist.moe_tp_mlp: overlap=True needs at most {MAX_GROUPS} "
                             f"experts, got w1{w1.shape}; pass overlap=None or False")
        if not pushes:
            raise ValueError("jaxtdist.moe_tp_mlp: overlap=True needs copy-engine pushes, "
                             "which this runtime's heap does not offer; pass overlap=None "
                             "or False")
        return True
    if overlap is False or rt.platform != "gpu" or not pushes:
        return False
    world = check_axis(rt, axis_name, "moe_tp_mlp").world
    return (world > 1 and _pick_grouped_gemm(grouped_gemm, experts, x.dtype) == "jaxtdist"
            and ids.size >= OVERLAP_MIN_ROWS * experts)


def _overlapped_forward(x, ids, gate, w1, w2, *w_up, axis_name, activation, grouped_gemm):
    del grouped_gemm
    # Differentiated again only by second-order autodiff: a TypeError naming the op.
    x, gate, w1, w2, *w_up = first_order_only("moe_tp_mlp", x, gate, w1, w2, *w_up)
    out = overlapped_forward(x, ids, gate, w1, w2, w_up[0] if w_up else None, activation,
                             axis_name)
    return out, (x, ids, gate, w1, w2) + tuple(w_up)


def _overlapped_backward(residuals, ct, *, axis_name, activation, grouped_gemm):
    """The step-by-step schedule's gradients, its forward recomputed: the residuals
    are the inputs only, as under jax.checkpoint. Only under jax.vmap (see
    ``_overlapped_or_steps``). (Keeping the forward's VJP as the residual would
    skip that second forward, but a VJP's structure differs between the unbatched
    and batched traces of ``one_call_per_element``: vmap refuses it.)"""
    x, ids, gate, w1, w2, *w_up = residuals

    def steps(x, gate, w1, w2, *w_up):
        return _steps(x, ids, gate, w1, w2, w_up[0] if w_up else None, activation, axis_name,
                      grouped_gemm)

    dx, dgate, dw1, dw2, *dw_up = jax.vjp(steps, x, gate, w1, w2, *w_up)[1](ct)
    return (dx, None, dgate, dw1, dw2, *dw_up)


# The overlapped schedule, [T_shard, H] float32, as a declared op: the platform
# orders its calls among the others' and gives it autodiff, remat and vmap.
_OVERLAPPED = DistributedOp("moe_tp_mlp", forward=_overlapped_forward,
                            backward=_overlapped_backward)


@functools.partial(jax.custom_jvp, nondiff_argnums=(6, 7, 8))
def _overlapped_or_steps(x, ids, gate, w1, w2, w_up, axis_name, activation, grouped_gemm):
    """The overlapped kernels where no derivative is taken; differentiated, the
    step-by-step schedule's (its JVP, which JAX linearizes and transposes, keeping
    the residuals it needs): one forward pass in training, where the overlapped
    forward plus a backward recomputing the steps' forward took two."""
    up = () if w_up is None else (w_up,)
    return _OVERLAPPED(x, ids, gate, w1, w2, *up, axis_name=axis_name,
                       activation=activation, grouped_gemm=grouped_gemm)


@_overlapped_or_steps.defjvp
def _overlapped_or_steps_jvp(axis_name, activation, grouped_gemm, primals, tangents):
    x, ids, gate, w1, w2, w_up = primals
    dx, _, dgate, dw1, dw2, dw_up = tangents
    up, d_up = ((), ()) if w_up is None else ((w_up,), (dw_up,))
    # Differentiated again only by second-order autodiff: a TypeError naming the op.
    x, gate, w1, w2, *up = first_order_only("moe_tp_mlp", x, gate, w1, w2, *up)

    def steps(x, gate, w1, w2, *up):
        return _steps(x, ids, gate, w1, w2, up[0] if up else None, activation, axis_name,
                      grouped_gemm)

    return jax.jvp(steps, (x, gate, w1, w2, *up), (dx, dgate, dw1, dw2, *d_up))


# -- pjit-style ---------------------------------------------------------------------

def _per_rank(x, expert_ids, weights, w1, w2, *w_up, axis_name, **kwargs):
    return moe_tp_mlp(x, expert_ids, weights, w1, w2, axis_name,
                      w_up=w_up[0] if w_up else None, **kwargs)


def _specs(gated: bool):
    """(in_specs, out_specs) of the wrapper: tokens' rows over (*batch_axes,
    axis_name), experts' FFN dimension over axis_name (replicated over the batch)."""
    def in_specs(axis, batch):
        tokens = P(rows_over(axis, batch), None)
        w_in, w_out = P(None, None, axis), P(None, axis, None)
        return (tokens, tokens, tokens, w_in, w_out) + ((w_in,) if gated else ())

    return in_specs, lambda axis, batch: P(rows_over(axis, batch), None)


_SHARDED = {gated: pjit_wrapper(_per_rank, name="moe_tp_mlp_sharded",
                                in_specs=_specs(gated)[0], out_specs=_specs(gated)[1])
            for gated in (False, True)}


def _per_rank_fp8(x, expert_ids, weights, w1, w1_scale, w2, w2_scale, *up, axis_name,
                  **kwargs):
    """FP8 experts: each weight followed by its scales (``up``: w_up, w_up_scale)."""
    w_up, w_up_scale = up if up else (None, None)
    return moe_tp_mlp(x, expert_ids, weights, w1, w2, axis_name, w_up=w_up, w1_scale=w1_scale,
                      w2_scale=w2_scale, w_up_scale=w_up_scale, **kwargs)


def _fp8_specs(gated: bool, blockwise: bool):
    """FP8 experts' specs: K-major w1 / w_up [E, F, H] and w2 [E, H, F] with F over
    axis_name; blockwise scales sharded as their weights, per-tensor ones replicated."""
    def in_specs(axis, batch):
        tokens = P(rows_over(axis, batch), None)
        w_in, w_out = P(None, axis, None), P(None, None, axis)
        s_in, s_out = (w_in, w_out) if blockwise else (P(), P())
        return (tokens, tokens, tokens, w_in, s_in, w_out, s_out) + ((w_in, s_in) if gated
                                                                     else ())

    return in_specs, lambda axis, batch: P(rows_over(axis, batch), None)


_SHARDED_FP8 = {(gated, blockwise): pjit_wrapper(
    _per_rank_fp8, name="moe_tp_mlp_sharded", in_specs=_fp8_specs(gated, blockwise)[0],
    out_specs=_fp8_specs(gated, blockwise)[1])
    for gated in (False, True) for blockwise in (False, True)}


def moe_tp_mlp_sharded(x: jax.Array, expert_ids: jax.Array, weights: jax.Array, w1: jax.Array,
                       w2: jax.Array, *, axis_name: str | tuple[str, ...],
                       batch_axes: str | tuple[str, ...] = (), mesh=None,
                       w_up: jax.Array | None = None, w1_scale: jax.Array | None = None,
                       w2_scale: jax.Array | None = None, w_up_scale: jax.Array | None = None,
                       **kwargs) -> jax.Array:
    """``moe_tp_mlp`` for pjit-style code: no hand-written ``shard_map``.

    Call it under ``jax.jit`` (or eagerly) on global arrays: x [T, H],
    expert_ids and weights [T, K] with their rows sharded over ``(*batch_axes,
    axis_name)``; w1 (and w_up) [E, H, F], w2 [E, F, H] with F sharded over
    ``axis_name`` (replicated over ``batch_axes``). Each batch group's
    ``axis_name`` ranks form one layer. Returns [T, H], sharded like x. Ordered
    after the previous jaxtdist call.

    Args:
      x, expert_ids, weights, w1, w2: the global arrays.
      axis_name: the mesh axis (or tuple of axes) tokens and FFN are sharded over.
      batch_axes: mesh axes that shard the tokens too (data parallel), outermost
        first.
      mesh: the mesh; defaults to the one given to ``jaxtdist.initialize``.
      w_up: the gated MLP's second projection [E, H, F], sharded like w1.
      w1_scale, w2_scale, w_up_scale: FP8 experts (as for ``moe_tp_mlp``): w1 / w_up
        [E, F, H] and w2 [E, H, F] K-major (``jaxtdist.quantize_weight`` of the
        global weights; F / W a multiple of 128 blockwise), F sharded over
        ``axis_name``; blockwise scales sharded with their weights, per-tensor
        ones (() or [E]) replicated.
      **kwargs: ``activation``, ``grouped_gemm``, ``overlap``: as for ``moe_tp_mlp``.

    Example:
      >>> mesh = jax.make_mesh((4,), ("tp",)); jaxtdist.initialize(mesh)
      >>> out = jax.jit(lambda *a: jaxtdist.moe_tp_mlp_sharded(*a, axis_name="tp"))(
      ...     x, expert_ids, weights, w1, w2)
    """
    if w1_scale is not None or w2_scale is not None or w_up_scale is not None:
        arrays = (x, expert_ids, weights, w1, w1_scale, w2, w2_scale) + (
            () if w_up is None else (w_up, w_up_scale))
        arrays = tuple(None if a is None else jnp.asarray(a) for a in arrays)
        if any(a is None for a in arrays):
            raise ValueError("jaxtdist.moe_tp_mlp_sharded: FP8 experts need w1_scale, "
                             "w2_scale" + (" and w_up_scale" if w_up is not None else "")
                             + "; pass every weight's float32 scales (from "
                             "jaxtdist.quantize_weight)")
        blockwise = arrays[4].ndim == 3
        return _SHARDED_FP8[w_up is not None, blockwise](
            *arrays, axis_name=axis_name, batch_axes=batch_axes, mesh=mesh, **kwargs)
    arrays = (x, expert_ids, weights, w1, w2) + (() if w_up is None else (w_up,))
    return _SHARDED[w_up is not None](*(jnp.asarray(a) for a in arrays), axis_name=axis_name,
                                      batch_axes=batch_axes, mesh=mesh, **kwargs)
