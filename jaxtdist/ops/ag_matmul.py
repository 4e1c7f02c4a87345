"""jaxtdist.ag_matmul: all_gather(x) @ w, the gather overlapped with the GEMM.

Shapes (``_check``), plan (the config, ``_ag_matmul_config``; the workspaces),
launch (one function per kernel variant) and backward; the op mechanism
(``_op.DistributedOp``) supplies program order, autodiff, the local
computation at world 1 and the pjit-style wrapper.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxtdist._errors import HeapExhaustedError
from jaxtdist.kernels.ag_matmul import (ag_matmul_ce_kernel, ag_matmul_kernel,
                                        ag_matmul_tma_kernel, copy_gathered_kernel)
from jaxtdist.ops._ag_matmul_config import (AgMatmulConfig, flattens, split_n_tail,
                                            stream_k_tail, tail_stages)
from jaxtdist.ops._config import Problem, resolve
from jaxtdist.ops._fp8_gemm import (Fp8Gemm, check_block_k, fp8_plan, kernel_scales,
                                    local_matmul, logical_weight, no_gradient)
from jaxtdist.ops._gemm_config import weights_k_major
from jaxtdist.ops._gemm_paths import AG_MATMUL_PATH
from jaxtdist.ops._inbox import push_to_inboxes
from jaxtdist.ops._partial_sums import rs_launch
from jaxtdist.ops._precision import kernel_operands
from jaxtdist.ops.all_gather import _forward as all_gather_forward
from jaxtdist.ops._op import DistributedOp, one_call_per_element, scatter_cotangent
from jaxtdist.ops._protocol import Call, varying_axes
from jaxtdist.ops._shapes import (GatherWorkspace, InboxWorkspace, SplitKWorkspace,
                                  StreamKWorkspace, check_dtype)
from jaxtdist.ops._sharded import pjit_wrapper, rows_over

__all__ = ["ag_matmul", "ag_matmul_sharded", "ag_matmul_with_gathered"]


# -- shapes ----------------------------------------------------------------------

def _check(x, w, *, axis_name, config=None, regather=False) -> None:
    del axis_name, config
    if not isinstance(regather, bool):
        raise ValueError(f"jaxtdist.ag_matmul: regather={regather!r} must be True or False")
    for name, a in (("x", x), ("w", w)):
        if not hasattr(a, "shape") or not hasattr(a, "dtype"):
            raise ValueError(f"jaxtdist.ag_matmul: {name} must be an array, got "
                             f"{type(a).__name__}")
    if x.ndim != 2 or w.ndim != 2:
        raise ValueError(f"jaxtdist.ag_matmul: x and w must be 2-D, got x{x.shape} and w{w.shape}")
    if x.shape[1] != w.shape[0]:
        raise ValueError(f"jaxtdist.ag_matmul: contraction sizes differ: x{x.shape} has "
                         f"k={x.shape[1]} but w{w.shape} has k={w.shape[0]}")
    check_dtype("ag_matmul", "x", x.dtype)
    if x.dtype != w.dtype:
        raise ValueError(f"jaxtdist.ag_matmul: x and w must share a dtype, got {x.dtype.name} "
                         f"and {w.dtype.name}")
    if 0 in x.shape or 0 in w.shape:
        raise ValueError(f"jaxtdist.ag_matmul: empty operand x{x.shape} w{w.shape}")


def _problem(call: Call, x, w) -> Problem:
    return Problem(call.platform, call.world, (x.shape[0], w.shape[1], x.shape[1]),
                   jnp.dtype(x.dtype).name, call.rt.sms)


def _resolved(call: Call, x, w, config, axis_name) -> tuple[Problem, AgMatmulConfig]:
    """The call's problem and the config its kernels take (``config`` over the
    defaults, or the tuned entry)."""
    problem = _problem(call, x, w)
    base = AgMatmulConfig.for_overrides(problem, config or {})
    return problem, resolve(AgMatmulConfig, problem, call.rt, config, base=base,
                            axis_name=axis_name)


def persistent_programs(platform: str, sms: int, num_comm: int, tiles: int) -> int:
    """Programs of a persistent kernel: one per SM on GPUs (all must be resident,
    since they spin on each other), a few under the interpreter."""
    if platform != "gpu":
        # Three: the tiles rarely split evenly, so that stream-K tails run too.
        return num_comm + min(tiles, 3)
    if num_comm >= sms:
        raise ValueError(f"jaxtdist.ag_matmul: NUM_COMM={num_comm} leaves none of the {sms} "
                         "SMs for the GEMM")
    return min(sms, num_comm + tiles)


# -- plan and launch ---------------------------------------------------------------

def ag_matmul_with_gathered(x: jax.Array, w: jax.Array, axis_name, *,
                            config: dict | None = None,
                            gathered: bool = True) -> tuple[jax.Array, jax.Array | None]:
    """Like ``ag_matmul`` but also returns the gathered ``x``, and always runs the
    kernels (at world 1 too); not differentiable.

    ``config`` overrides the defaults (``AgMatmulConfig``) and skips the tuning
    cache; see ``jaxtdist.tune``. ``gathered=False`` returns None in its place:
    the kernels that push into heap inboxes then skip copying it out.
    """
    x, w = jnp.asarray(x), jnp.asarray(w)
    _check(x, w, axis_name=axis_name)
    return _gathered_launch(x, w, axis_name, config, gathered)


def _gathered_launch(x, w, axis_name, config, gathered: bool, fp8=None):
    """``ag_matmul_with_gathered`` unchecked; ``fp8``: (plan, x's scales of the
    gathered rows, w's scales) for FP8 x and K-major w (``_fp8_gemm``)."""
    call = Call("ag_matmul", axis_name)
    problem, cfg = _resolved(call, x, logical_weight(w) if fp8 else w, config, axis_name)
    if fp8:
        check_block_k("ag_matmul", fp8[0], cfg.BLOCK_K)
    if cfg.variant == "ce":
        try:
            return _launch_copy_engines(call, problem, cfg, x, w, gathered, fp8)
        except HeapExhaustedError:
            if "PRODUCER" in (config or {}) or (config or {}).get("STREAM_K") is True:
                raise
            # A tuned or default choice that does not fit this heap: SM producers
            # need a quarter of the room (staging slots, no inboxes).
            cfg = cfg.replace(PRODUCER="sm", CHUNK_ROWS=min(cfg.chunk_rows, cfg.BLOCK_M))
    return _launch_sm_producers(call, problem, cfg, x, w, gathered, fp8)


def _fp8_operands(problem: Problem, x, w, fp8, *, tma: bool) -> tuple:
    """(w as the kernel takes it, B_T, DOT_PRECISION, the scale arrays, the FP8
    constexprs, the output dtype): FP8 w is K-major already; 16/32-bit calls pass
    x and w in the scales' places (ignored without SCALING)."""
    if fp8:
        plan, xs, ws = fp8
        return w, True, None, (xs, ws), dict(SCALING=plan.scaling), plan.out
    b_t = weights_k_major(x.dtype.itemsize, tma)
    _, w, precision = kernel_operands(problem, x, w, tma=tma, exact_x=True, k_major=b_t)
    return w, b_t, precision, (x, w), dict(SCALING=None), x.dtype


def _copy_gathered(call: Call, ctx, x, out, inbox_offset: int, parity_bytes: int):
    """The gathered x copied out of the heap inbox the GEMM just read (the residual of
    the backward pass; the inbox is reused two calls later)."""
    m_shard, k = x.shape
    block_c = min(256, max(16, 1 << (k - 1).bit_length()))
    return call.launch(copy_gathered_kernel, ctx, x, out,
                       out_shape=jax.ShapeDtypeStruct((call.world * m_shard, k), x.dtype),
                       grid=(-(-call.world * m_shard // 16), -(-k // block_c)), num_warps=4,
                       num_stages=1, varying=call.result_axes(local=(x,)), M_SHARD=m_shard,
                       K=k, INBOX_OFF=inbox_offset, PARITY_BYTES=parity_bytes, BLOCK_R=16,
                       BLOCK_C=block_c)


def _launch_sm_producers(call: Call, problem: Problem, cfg: AgMatmulConfig, x, w,
                         want_gathered: bool, fp8=None):
    """The pointer and TMA kernels: SM producer programs gather, the rest compute."""
    m_shard, n, k = problem.shape
    world = call.world
    push = cfg.PRODUCER == "push"
    if push:  # one inbox layout whatever the chunking, as for the copy engines
        plan = InboxWorkspace(world, m_shard, k, x.dtype, 1)
        ws = call.workspace("inbox_sm", plan.nbytes, m_shard, k, x.dtype.name)
        gather = dict(STAGE_OFF=ws.offset + plan.inbox, SLOT_BYTES=plan.parity_bytes,
                      READY_OFF=-1, FLAGS_OFF=ws.offset + plan.flags)
    else:
        plan = GatherWorkspace(world, m_shard, k, x.dtype, cfg.chunk_rows)
        ws = call.workspace("gather", plan.nbytes, m_shard, k, x.dtype.name, cfg.chunk_rows)
        gather = dict(STAGE_OFF=ws.offset + plan.stage, SLOT_BYTES=plan.slot_bytes,
                      READY_OFF=ws.offset + plan.ready, FLAGS_OFF=ws.offset + plan.flags)
    gather.update(M_SHARD=m_shard, N=n, K=k)
    w, b_t, precision, scales, scaling, out_dtype = _fp8_operands(problem, x, w, fp8,
                                                                  tma=cfg.TMA)
    tiles = dict(cfg.kernel_args(), DOT_PRECISION=precision, **scaling)
    n_tiles = -(-n // cfg.BLOCK_N)
    m_tiles = world * -(-m_shard // cfg.BLOCK_M)
    # With pushes the gathered x stays in the heap inboxes: a one-element
    # placeholder takes the kernel's second output.
    out_shape = (jax.ShapeDtypeStruct((world * m_shard, n), out_dtype),
                 jax.ShapeDtypeStruct((1,) if push else (world * m_shard, k), x.dtype))
    launch = dict(workspace=ws, out_shape=out_shape, **cfg.launch_options(),
                  varying=call.result_axes(local=(x, w)))
    if cfg.TMA:
        programs = persistent_programs(call.platform, problem.sms, cfg.NUM_COMM,
                                       m_tiles * n_tiles)
        schedule = call.workspace("schedule", 8)
        return tuple(call.run(
            ag_matmul_tma_kernel, x, w, *scales, grid=(programs,), needs_scratch=True,
            SCHEDULE_OFF=schedule.offset, NUM_PROGRAMS=programs, SUBTILE=cfg.SUBTILE,
            PRODUCERS_JOIN=call.platform == "gpu", B_T=b_t, **launch, **gather, **tiles))
    m_tiles = 1 if cfg.ALL_ROWS else m_tiles
    split_k = cfg.SPLIT_K
    k_split = -(-(-(-k // split_k)) // cfg.BLOCK_K) * cfg.BLOCK_K
    partials_off = counters_off = -1
    if split_k > 1:
        split_plan = SplitKWorkspace(split_k, world * m_shard, n, m_tiles * n_tiles)
        split_ws = call.workspace("split_k", split_plan.nbytes, world * m_shard, n, split_k,
                                  cfg.BLOCK_M, cfg.BLOCK_N, cfg.ALL_ROWS)
        partials_off = split_ws.offset + split_plan.partials
        counters_off = split_ws.offset + split_plan.counters
    ctx = call.start(ws, deps=(x, w), align_launch=not call.launch_aligns((x, w)))
    del launch["workspace"]
    out, gathered = call.launch(
        ag_matmul_kernel, ctx, x, w, *scales,
        grid=(cfg.NUM_COMM + split_k * m_tiles * n_tiles,),
        PARTIALS_OFF=partials_off, COUNTERS_OFF=counters_off, K_SPLIT=k_split, SPLIT_K=split_k,
        ALL_ROWS=cfg.ALL_ROWS, PUSH=push, FLAG_SCOPE="sys" if push else "gpu", B_T=b_t,
        **launch, **gather, **tiles)
    if push:  # the inboxes are reused two calls later: the residual is copied out
        gathered = (_copy_gathered(call, ctx, x, out, gather["STAGE_OFF"], gather["SLOT_BYTES"])
                    if want_gathered else None)
    return out, gathered


def _tail_plan(call: Call, cfg: AgMatmulConfig, tiles: int, programs: int, k: int,
               peer_tiles: int) -> dict:
    """The copy-engine kernel's tail constexprs: a split-N tail where the config
    and shape allow it, else a stream-K tail with its heap workspace.

    A stream-K tail whose workspace does not fit the heap is not cut, unless
    the config asked for STREAM_K=True: then HeapExhaustedError says so.
    """
    c = cfg.to_dict()
    off = dict(TAIL_TILES=0, TAIL_UNITS=0, PARTIALS_OFF=-1, COUNTERS_OFF=-1, TAIL_SPLIT_N=1,
               TAIL_STAGES=cfg.num_stages)
    if cfg.STREAM_K is not True:
        tail, pieces = split_n_tail(tiles, programs, peer_tiles, cfg.BLOCK_N, cfg.TAIL_SPLIT_N)
        if tail:
            return dict(off, TAIL_TILES=tail, TAIL_SPLIT_N=pieces,
                        TAIL_STAGES=tail_stages(c, cfg.num_stages, pieces))
    k_blocks = -(-k // cfg.BLOCK_K)
    tail, run = stream_k_tail(tiles, programs, k_blocks, peer_tiles, cfg.STREAM_K)
    if not tail:
        return off
    plan = StreamKWorkspace(programs, tail, cfg.BLOCK_M, cfg.BLOCK_N)
    try:  # counters count arrivals per tile for one (tail, run) cut: a key of its own
        ws = call.workspace("stream_k", plan.nbytes, programs, tail, run, k_blocks, cfg.BLOCK_M,
                            cfg.BLOCK_N)
    except HeapExhaustedError:
        if cfg.STREAM_K is True:
            raise
        return off
    return dict(off, TAIL_TILES=tail, TAIL_UNITS=run, PARTIALS_OFF=ws.offset + plan.partials,
                COUNTERS_OFF=ws.offset + plan.counters)


def _launch_copy_engines(call: Call, problem: Problem, cfg: AgMatmulConfig, x, w,
                         want_gathered: bool, fp8=None):
    """The gather on the copy engines (an SM push kernel under the interpreter),
    every SM in the persistent TMA GEMM."""
    m_shard, n, k = problem.shape
    world = call.world
    # One layout whatever the chunking (room for a flag per row), so that calls
    # with different CHUNK_ROWS share the inboxes safely; stale flags of
    # another chunking hold older epochs, never this call's.
    plan = InboxWorkspace(world, m_shard, k, x.dtype, 1)
    ws = call.workspace("inbox", plan.nbytes, m_shard, k, x.dtype.name)
    offsets = dict(INBOX_OFF=ws.offset + plan.inbox, PARITY_BYTES=plan.parity_bytes,
                   FLAGS_OFF=ws.offset + plan.flags, SENT_OFF=ws.offset + plan.sent)
    # The pushes are the last host work before the GEMM: they, not the
    # prologue, hold the launch rendezvous.
    ctx = call.start(ws, deps=(x, w), align_launch=False)
    ctx = push_to_inboxes(call, ctx, x, inbox_offset=offsets["INBOX_OFF"],
                          parity_bytes=offsets["PARITY_BYTES"], flags_offset=offsets["FLAGS_OFF"],
                          sent_offset=offsets["SENT_OFF"], chunk_rows=cfg.chunk_rows,
                          serial=cfg.PUSH_ORDER == "serial", sm_programs=cfg.NUM_COMM,
                          copy_block_c=cfg.COPY_BLOCK_C, scope=cfg.SCOPE)
    per_rank = (m_shard // cfg.BLOCK_M) * -(-n // cfg.BLOCK_N)
    programs = persistent_programs(call.platform, problem.sms, 0, world * per_rank)
    tail = _tail_plan(call, cfg, world * per_rank, programs, k, (world - 1) * per_rank)
    w_in, b_t, precision, scales, scaling, out_dtype = _fp8_operands(problem, x, w, fp8,
                                                                     tma=True)
    out = call.launch(
        ag_matmul_ce_kernel, ctx, x, w_in, *scales,
        out_shape=jax.ShapeDtypeStruct((world * m_shard, n), out_dtype), grid=(programs,),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, needs_scratch=True,
        varying=call.result_axes(local=(x, w)),
        M_SHARD=m_shard, N=n, K=k, **offsets, CHUNK_ROWS=cfg.chunk_rows, BLOCK_M=cfg.BLOCK_M,
        BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, GROUP_M=cfg.GROUP_M, NUM_PROGRAMS=programs,
        FLATTEN=flattens(dict(cfg.to_dict(), CHUNK_ROWS=cfg.chunk_rows), world * per_rank,
                         programs), SUBTILE=cfg.SUBTILE,
        DOT_PRECISION=precision, B_T=b_t, **scaling, **tail)
    # The gathered x (the autodiff residual) lives in heap inboxes that the call
    # after next reuses: copied out when the backward pass needs it.
    if not want_gathered:
        return out, None
    return out, _copy_gathered(call, ctx, x, out, offsets["INBOX_OFF"],
                               offsets["PARITY_BYTES"])


# -- the op --------------------------------------------------------------------------

def _forward(x, w, *, axis_name, config=None, regather=False):
    if regather:  # memory over time: the backward gathers x again
        out = ag_matmul_with_gathered(x, w, axis_name, config=config, gathered=False)[0]
        return out, (x, w)
    out, gathered = ag_matmul_with_gathered(x, w, axis_name, config=config)
    return out, (gathered, w)


def _primal(x, w, *, axis_name, config=None, regather=False):
    del regather
    out = ag_matmul_with_gathered(x, w, axis_name, config=config, gathered=False)[0]
    return out, None


def _backward(residuals, dy, *, axis_name, config=None, regather=False):
    del config
    gathered, w = residuals
    if regather:
        # jaxtdist's own all_gather: no XLA collective in the backward pass either.
        gathered = one_call_per_element(lambda a: all_gather_forward(
            a, axis_name=axis_name, axis=0, tiled=True)[0])(gathered)
    # dx: the rows of dy @ w^T that belong to this rank, summed over ranks: a
    # matmul_rs, the GEMM overlapped with the reduce-scatter. A cotangent typed
    # the same on every rank is already the group's sum: its rows are sliced.
    axes = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)
    have = varying_axes(dy)
    if have is None or set(axes) <= set(have):
        dx = one_call_per_element(lambda a, b: rs_launch(a, b, axis_name))(dy, w.T)
    else:
        dx = scatter_cotangent(jnp.dot(dy, w.T, preferred_element_type=jnp.float32),
                               axis_name, 0)
    dw = jnp.dot(gathered.T, dy, preferred_element_type=jnp.float32)
    return dx, dw


def _local(x, w, *, axis_name, config=None, regather=False):
    del axis_name, config, regather
    return jnp.dot(x, w)


def _decomposed(x, w, *, axis_name, config=None, regather=False):
    # World > 1 where the kernels cannot win (``_gemm_paths``): XLA's gather, then the dot.
    del config, regather
    return jnp.dot(jax.lax.all_gather(x, axis_name, axis=0, tiled=True), w)


def _check_config(x, w, *, axis_name, config, regather=False):
    del regather
    _resolved(Call("ag_matmul", axis_name), x, w, config, axis_name)


# -- FP8 (``_fp8_gemm``): checked in ag_matmul, no backward (``no_gradient``) -----------
# A variant: jaxtdist.explain's name lookup finds the 16/32-bit op.

def _fp8_forward(x, w, x_scale, w_scale, *, axis_name, config=None, plan: Fp8Gemm):
    xs, ws = kernel_scales(plan, x_scale, x.shape[0], w_scale)
    # Every rank's scales of the gathered rows, before the GEMM (1/32 of the FP8
    # rows' bytes blockwise, 4 bytes a row per tensor), by jaxtdist's all_gather.
    xs = all_gather_forward(xs, axis_name=axis_name, axis=0, tiled=True)[0]
    return _gathered_launch(x, w, axis_name, config, False, (plan, xs, ws))[0], None


def _fp8_local(x, w, x_scale, w_scale, *, axis_name, config=None, plan: Fp8Gemm):
    del axis_name, config
    return local_matmul(x, w, x_scale, w_scale, plan)


def _fp8_check_config(x, w, x_scale, w_scale, *, axis_name, config, plan: Fp8Gemm):
    del x_scale, w_scale
    _, cfg = _resolved(Call("ag_matmul", axis_name), x, logical_weight(w), config, axis_name)
    check_block_k("ag_matmul", plan, cfg.BLOCK_K)


_AG_MATMUL_FP8 = DistributedOp("ag_matmul", forward=_fp8_forward, local=_fp8_local,
                               check_config=_fp8_check_config,
                               variant="fp8")


_AG_MATMUL = DistributedOp("ag_matmul", forward=_forward, backward=_backward, check=_check,
                           local=_local, primal=_primal, check_config=_check_config,
                           decomposed=_decomposed, path=AG_MATMUL_PATH)


def ag_matmul(x: jax.Array, w, axis_name, *, config: dict | None = None,
              regather: bool = False, x_scale: jax.Array | None = None,
              w_scale: jax.Array | None = None, out_dtype=None):
    """``all_gather(x, axis_name, tiled=True) @ w`` with the gather overlapped.

    Call inside ``jax.shard_map`` over the mesh given to ``jaxtdist.initialize``.
    Differentiable: the backward pass reduce-scatters ``dy @ w.T`` and uses the
    gathered ``x`` kept from the forward pass. A group of one rank computes
    ``x @ w`` alone.

    Several weights (``w`` a tuple or list, e.g. the Q, K and V projections)
    share one gather of ``x`` and one launch: the result is one product per
    weight, and the backward sums the products of all cotangents in one
    reduce-scatter. The weights are concatenated along N for the launch (a copy
    of the weights per call, small beside the GEMM).

    FP8 (``x_scale``, ``w_scale`` given; ``jaxtdist.ops._fp8_gemm``): x [m_shard,
    k] and w in one FP8 format, w K-major [n, k] (``jaxtdist.quantize_weight``;
    JAX's ``scaled_matmul`` layout), float32 dequantization scales, the result
    ``all_gather(x * x_scale) @ (w * w_scale).T`` in ``out_dtype``. Per tensor:
    both scales () (x_scale this rank's: each rank may quantize its rows with
    its own). Blockwise: x_scale [m_shard, k / 128] (this rank's rows, sharded
    like x), w_scale [cdiv(n, 128), k / 128] (this rank's columns of the output,
    sharded like w's rows); k a multiple of 128. The FP8 rows are gathered (half
    the bytes of bf16), their scales by jaxtdist's all_gather just before.
    A group of one rank runs XLA: its FP8 dot (per tensor) or the float32 dot
    of the dequantized operands (blockwise). Not differentiable (a TypeError
    names the arguments); one weight only.

    Args:
      x: this rank's rows, [m_shard, k].
      w: this rank's weight, [k, n] (typically column-sharded), or a tuple of
        weights [k, n_i] of x's dtype.
      axis_name: mesh axis (or tuple of axes) the rows are sharded over.
      config: overrides of the kernel config (``AgMatmulConfig`` keys; advanced).
      regather: what the backward pass uses for the gathered x. False (the
        default): the forward pass keeps it (copied out of the heap, a pass over
        [world * m_shard, k] beside the GEMM, and held until the backward, as
        XLA keeps an ``all_gather`` residual); no collective runs in the
        backward but its reduce-scatter. True: nothing is kept and the backward
        gathers x again with jaxtdist's all_gather (memory for time). Neither
        runs an XLA collective. (FP8: no backward, ignored.)
      x_scale, w_scale: FP8 only: float32 scales, () each or blockwise (above).
      out_dtype: FP8 only: bfloat16 (default), float16 or float32.

    Returns:
      [world * m_shard, n] in x's dtype (FP8: ``out_dtype``), accumulated in
      float32; for a tuple of weights, a tuple of [world * m_shard, n_i].

    Example:
      >>> mesh = jax.make_mesh((4,), ("tp",)); jaxtdist.initialize(mesh)
      >>> f = jax.jit(jax.shard_map(lambda x, w: jaxtdist.ag_matmul(x, w, "tp"), mesh=mesh,
      ...             in_specs=(P("tp", None), P(None, "tp")), out_specs=P(None, "tp")))
    """
    if isinstance(w, (tuple, list)):
        if x_scale is not None or w_scale is not None or out_dtype is not None:
            raise ValueError("jaxtdist.ag_matmul: FP8 (x_scale, w_scale, out_dtype) takes one "
                             f"weight, got a {type(w).__name__} of {len(w)}; concatenate the "
                             "K-major FP8 weights along N (and their scales) or call once each")
        return _ag_matmul_many(jnp.asarray(x), tuple(w), axis_name, config, regather)
    x, w = jnp.asarray(x), jnp.asarray(w)
    plan = fp8_plan("ag_matmul", x, w, x_scale, w_scale, out_dtype)
    if plan is not None:
        args = no_gradient("ag_matmul", x, w, x_scale, w_scale)
        return _AG_MATMUL_FP8(*args, axis_name=axis_name, config=config, plan=plan)
    return _AG_MATMUL(jnp.asarray(x), jnp.asarray(w), axis_name=axis_name, config=config,
                      regather=regather)


def _ag_matmul_many(x, ws, axis_name, config, regather):
    """``ag_matmul`` of one x with several weights: one gather, one launch."""
    if not ws:
        raise ValueError("jaxtdist.ag_matmul: w is an empty sequence; give at least one weight")
    ws = tuple(jnp.asarray(w) for w in ws)
    for i, w in enumerate(ws):
        try:
            _check(x, w, axis_name=axis_name)
        except ValueError as e:
            raise ValueError(f"{e} (weight {i} of {len(ws)})") from None
    widths = [w.shape[1] for w in ws]
    out = _AG_MATMUL(x, ws[0] if len(ws) == 1 else jnp.concatenate(ws, axis=1),
                     axis_name=axis_name, config=config, regather=regather)
    return tuple(jnp.split(out, np.cumsum(widths)[:-1].tolist(), axis=1))


def _one_weight(x, w, axis_name, **kwargs):
    if isinstance(w, (tuple, list)):
        raise ValueError("jaxtdist.ag_matmul_sharded: w must be one [K, N] weight, got a "
                         f"{type(w).__name__} of {len(w)}; for one gather over several weights "
                         "call jaxtdist.ag_matmul(x, (w1, w2, ...)) inside shard_map, or use "
                         "jaxtdist.nn.column_parallel")
    return ag_matmul(x, w, axis_name, **kwargs)


ag_matmul_sharded = pjit_wrapper(
    _one_weight, name="ag_matmul_sharded",
    in_specs=lambda axis, batch: (jax.sharding.PartitionSpec(rows_over(axis, batch), None),
                                  jax.sharding.PartitionSpec(None, axis)),
    out_specs=lambda axis, batch: jax.sharding.PartitionSpec(rows_over(None, batch), axis))
ag_matmul_sharded.__doc__ = """``ag_matmul`` for pjit-style code: no hand-written ``shard_map``.

    ``x`` is [M, K] with rows sharded over ``(*batch_axes, axis_name)``; ``w`` is
    [K, N] with columns sharded over ``axis_name``. The result is [M, N] with
    rows sharded over ``batch_axes`` and columns over ``axis_name``: within each
    batch group the rows are all-gathered over ``axis_name`` and multiplied,
    the gather overlapped with the GEMM. Mesh axes not named are replicated.

    Args:
      x: activations, [M, K].
      w: weight, [K, N].
      axis_name: the tensor-parallel mesh axis (keyword).
      batch_axes: mesh axes that shard the rows of ``x`` and the output (data
        parallelism), outermost first.
      mesh: the mesh; defaults to the one given to ``jaxtdist.initialize``.
      config: as for ``ag_matmul``.

    Example:
      >>> mesh = jax.make_mesh((2, 4), ("dp", "tp")); jaxtdist.initialize(mesh)
      >>> layer = jax.jit(functools.partial(jaxtdist.ag_matmul_sharded, axis_name="tp",
      ...                                   batch_axes=("dp",)))
      >>> y = layer(x, w)  # x: P(("dp", "tp"), None), w: P(None, "tp")
    """
