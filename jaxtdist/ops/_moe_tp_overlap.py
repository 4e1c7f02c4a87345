"""moe_tp_mlp's overlapped schedule: the token gather fused into the first grouped
GEMM and the reduce-scatter into the second (``kernels/moe_tp.py``).

Each rank sorts its own (token, expert) pairs by expert (its chunk of R = T_shard
* K rows) and gathers only the group sizes ([W, E], one small all_gather).
``ag_grouped_gemm`` pushes the chunk into every peer's heap inbox (copy engines)
while the first GEMM runs, own chunk first, each peer's tiles as its rows land.
``grouped_gemm_rs`` computes the second GEMM peers' chunks first, pushing each
tile to its owner, and adds the peers' partials of its own chunk in the
epilogue of its own tiles. What is left is local: each token's K rows of its
own chunk, weighted and summed.

Forward only: ``moe_tp`` declares it as an op whose backward pass differentiates
the step-by-step schedule (a recomputation).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from jaxtdist.kernels.moe_tp import ag_grouped_gemm_kernel, grouped_gemm_rs_kernel
from jaxtdist.ops._config import Problem
from jaxtdist.ops._expert_order import expert_order, sum_pairs
from jaxtdist.ops._inbox import push_to_inboxes
from jaxtdist.ops._gemm_config import tma_fits, weights_k_major
from jaxtdist.ops._partial_sums import PartialsWorkspace
from jaxtdist.ops._precision import kernel_operands
from jaxtdist.ops._protocol import Call
from jaxtdist.ops._shapes import InboxWorkspace, next_pow2
from jaxtdist.ops.all_gather import _forward as all_gather_forward
from jaxtdist.ops.grouped_matmul import GroupedMatmulConfig

__all__ = ["ag_grouped_gemm", "grouped_gemm_rs", "overlapped_forward"]

# Flags per pushed chunk on GPUs: a peer's first tiles start after a quarter of
# its chunk has landed, not all of it.
_CHUNKS = 4


def _plan(call: Call, rows: int, k: int, n: int, groups: int, dtype):
    """(problem, config, TMA) of a grouped GEMM of ``rows`` rows in ``groups`` groups,
    [*, k] @ [k, n], on the grouped GEMM's default tiles."""
    problem = Problem(call.platform, 1, (rows, k, n, groups), jnp.dtype(dtype).name,
                      call.rt.sms)
    cfg = GroupedMatmulConfig.default(problem)
    # As jaxtdist.grouped_matmul: TMA wherever rows are 16-byte multiples (the
    # interpreter runs the descriptors too).
    return problem, cfg, problem.vendor == "nvidia" and tma_fits(k, n, problem.itemsize)


def _operands(problem: Problem, rows, w, tma: bool, w_up=None):
    """(rows, w, w_up, W_T, DOT_PRECISION) as the kernels take them (w_up, if given,
    prepared like w; rows rounded once)."""
    w_t = weights_k_major(problem.itemsize, tma)
    rows_in, w, precision = kernel_operands(problem, rows, w, tma=tma, k_major=w_t)
    if w_up is not None:
        w_up = kernel_operands(problem, rows, w_up, tma=tma, exact_x=True, k_major=w_t)[1]
    return rows_in, w, w_up, w_t, precision


def ag_grouped_gemm(rows: jax.Array, w: jax.Array, w_up: jax.Array | None, sizes: jax.Array,
                    axis_name) -> jax.Array:
    """[1 + (w_up given), W * R, F]: every rank's chunk (``rows`` [R, H] here, sorted
    by expert, group sizes ``sizes`` [W, E] int32) times its experts' w [E, H, F]
    (and w_up), the chunks gathered while the GEMM runs. Not differentiable."""
    call = Call("moe_tp_mlp", axis_name)
    (r, h), (e, _, f), world = rows.shape, w.shape, call.world
    problem, cfg, tma = _plan(call, world * r, h, f, world * e, rows.dtype)
    up = w_up is not None
    rows_in, w_in, wup_in, w_t, precision = _operands(problem, rows, w, tma, w_up)
    wup_in = w_in if wup_in is None else wup_in  # the kernel's second weight, unread
    ce = call.rt.backend.has_copy_engines
    # The interpreter's SM push copies power-of-2 row blocks.
    chunk_rows = max(64, -(-r // _CHUNKS)) if ce else 16
    plan = InboxWorkspace(world, r, h, rows.dtype, chunk_rows)
    ws = call.workspace("gather_inbox", plan.nbytes, r, h, rows.dtype.name, chunk_rows)
    offsets = dict(INBOX_OFF=ws.offset + plan.inbox, PARITY_BYTES=plan.parity_bytes,
                   FLAGS_OFF=ws.offset + plan.flags, SENT_OFF=ws.offset + plan.sent)
    # The pushes are the last host work before the kernel: they hold the launch
    # rendezvous (at world 1, the launch or the prologue).
    ctx = call.start(ws, deps=(rows, w, sizes) + ((w_up,) if up else ()),
                     align_launch=world == 1 and not call.launch_aligns((rows_in,), tma))
    if world > 1:
        # Push the kernel's own operand: XLA keeps only a kernel's operands alive,
        # and the copy engines read the chunk while the kernel runs. (Pushing
        # ``rows`` when the kernel took a tf32-rounded copy let XLA reuse its
        # buffer mid-push: float32 layers came out wrong on GPUs.)
        ctx = push_to_inboxes(call, ctx, rows_in, inbox_offset=offsets["INBOX_OFF"],
                              parity_bytes=offsets["PARITY_BYTES"],
                              flags_offset=offsets["FLAGS_OFF"], sent_offset=offsets["SENT_OFF"],
                              chunk_rows=chunk_rows, copy_block_c=min(256, next_pow2(h)))
    tiles = (-(-r // cfg.BLOCK_M) + e) * world * -(-f // cfg.BLOCK_N) * (1 + up)
    programs = cfg.programs(problem, tiles)
    # Every rank's chunks: typed like an all_gather's result.
    varying = call.result_axes(local=(rows, w, sizes) + ((w_up,) if up else ()))
    return call.launch(
        ag_grouped_gemm_kernel, ctx, rows_in, w_in, wup_in, sizes,
        out_shape=jax.ShapeDtypeStruct((1 + up, world * r, f), rows.dtype), grid=(programs,),
        needs_scratch=tma, varying=varying, **cfg.launch_options(), R_SHARD=r, H=h, F=f, E=e,
        BLOCK_G=max(16, next_pow2(e)), **offsets, CHUNK_ROWS=chunk_rows,
        SCOPE="gpu" if ce else "sys", WORLD=world, UP=up, BLOCK_M=cfg.BLOCK_M,
        BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, GROUP_M=cfg.GROUP_M, NUM_PROGRAMS=programs,
        SUBTILE=cfg.SUBTILE, TMA=tma, DOT_PRECISION=precision, W_T=w_t)


def grouped_gemm_rs(hidden: jax.Array, w: jax.Array, sizes: jax.Array,
                    axis_name) -> jax.Array:
    """[R, N] float32: this rank's chunk's rows of ``hidden`` [W * R, K] (every rank's
    chunk, sorted by expert, group sizes ``sizes`` [W, E]) times w [E, K, N], summed
    over the ranks of ``axis_name``. Not differentiable."""
    call = Call("moe_tp_mlp", axis_name)
    (rows, k), (e, _, n), world = hidden.shape, w.shape, call.world
    r = rows // world
    problem, cfg, tma = _plan(call, rows, k, n, world * e, hidden.dtype)
    a_in, w_in, _, w_t, precision = _operands(problem, hidden, w, tma)
    # Peers' partials travel in a 16-bit input's own type (the grouped GEMM rounds
    # its results to it anyway), added in float32.
    partial = hidden.dtype if hidden.dtype.itemsize == 2 else jnp.dtype(jnp.float32)
    chunk_tiles = (-(-r // cfg.BLOCK_M) + e) * -(-n // cfg.BLOCK_N)
    plan = PartialsWorkspace(world, r * n, chunk_tiles, partial.itemsize)
    ws = call.workspace("rs_inbox", plan.nbytes, r, n, e, partial.name, cfg.BLOCK_M,
                        cfg.BLOCK_N)
    programs = cfg.programs(problem, world * chunk_tiles)
    # This rank's rows of a sum over the group.
    varying = set(call.result_axes(local=(hidden, w, sizes))) | set(call.layout.axes)
    return call.run(
        grouped_gemm_rs_kernel, a_in, w_in, sizes, workspace=ws, needs_scratch=tma,
        out_shape=jax.ShapeDtypeStruct((r, n), jnp.float32), grid=(programs,),
        varying=tuple(a for a in call.rt.mesh.axis_names if a in varying),
        **cfg.launch_options(), R_SHARD=r, K=k, N=n, E=e, BLOCK_G=max(16, next_pow2(e)),
        INBOX_OFF=ws.offset + plan.inbox, PARITY_BYTES=plan.parity_bytes,
        FLAGS_OFF=ws.offset + plan.flags, CHUNK_TILES=chunk_tiles,
        PARTIAL_INPUT=bool(partial != jnp.float32), WORLD=world, NUM_PROGRAMS=programs,
        INTERLEAVE=call.platform == "gpu", BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N,
        BLOCK_K=cfg.BLOCK_K, GROUP_M=cfg.GROUP_M, SUBTILE=cfg.SUBTILE, TMA=tma,
        DOT_PRECISION=precision, W_T=w_t)


def overlapped_forward(x: jax.Array, ids: jax.Array, gate: jax.Array, w1: jax.Array,
                       w2: jax.Array, w_up: jax.Array | None,
                       activation: Callable[[jax.Array], jax.Array], axis_name) -> jax.Array:
    """moe_tp_mlp's output for this rank's tokens, float32 [T_shard, H], on the
    overlapped kernels: x [T_shard, H], ids [T_shard, K] int32, gate [T_shard, K]
    float32. Not differentiable; one call (under vmap, the caller maps)."""
    k = ids.shape[1]
    # Every pair in some group (invalid ids weighted 0): each chunk's sizes sum to R.
    gate, order, position, sizes, valid = expert_order(ids.reshape(-1), gate.reshape(-1),
                                                       w1.shape[0])
    # Every rank's group sizes (exact in float32: at most R).
    sizes = all_gather_forward(sizes[None].astype(jnp.float32), axis_name=axis_name, axis=0,
                               tiled=True)[0]
    sizes = sizes.astype(jnp.int32)                                      # [W, E]
    rows = x[order // k]                                                 # [R, H]
    h = ag_grouped_gemm(rows, w1, w_up, sizes, axis_name)               # [1 or 2, W * R, F]
    hidden = activation(h[0].astype(jnp.float32))
    if w_up is not None:
        hidden = hidden * h[1].astype(jnp.float32)
    y = grouped_gemm_rs(hidden.astype(x.dtype), w2, sizes, axis_name)   # [R, H] float32
    return sum_pairs(y[position].reshape(-1, k, y.shape[-1]), gate, valid)
