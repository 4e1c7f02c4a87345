"""jaxtdist.moe_dispatch / jaxtdist.moe_combine: expert-parallel all-to-all for MoE.

Experts are split evenly over the ranks of ``axis_name``: with E experts and W
ranks, rank r owns experts ``[r * E / W, (r + 1) * E / W)``. ``moe_dispatch``
sends every (token, expert) pair to its expert's rank, grouped by local
expert; ``moe_combine`` brings the experts' rows back and sums them with the
routing weights. Routing metadata is computed here on the device (counts are
data: one compiled program serves every routing); the kernels
(kernels/moe.py) push rows into peers' heap inboxes. Both are differentiable:
dispatch's backward is a combine (weights 1), combine's is a dispatch of the
output's cotangent scaled by the weights, plus the weights' cotangent (the
combine kernel's dot products). At world 1 both are their local computation
(a scatter and a gather in pure JAX); ``moe_dispatch_kernels`` /
``moe_combine_kernels`` run the kernels at any world (benchmarks, tests).
``moe_dispatch_sharded`` / ``moe_combine_sharded`` are the pjit-style forms
(``pjit_wrapper``): global arrays sharded on rows, the handle's arrays too.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jaxtdist.kernels.moe import TRACE_PHASES, moe_combine_kernel, moe_dispatch_kernel
from jaxtdist.ops._config import KernelConfig, Problem, resolve
from jaxtdist.ops._op import (DistributedOp, mesh_devices, one_call_per_element, pjit_wrapper,
                              rows_over)
from jaxtdist.ops._protocol import Call, check_axis
from jaxtdist.ops._shapes import align, check_dtype, next_pow2, static_bool, traced_hint
from jaxtdist.runtime._runtime import runtime

__all__ = ["MoeConfig", "MoeHandle", "moe_combine", "moe_combine_kernels", "moe_combine_sharded",
           "moe_dispatch", "moe_dispatch_kernels", "moe_dispatch_sharded"]

# Words of a meta row per local expert of a token: local expert id, position
# within (source, expert), k, scale (float32 bits).
_FIELDS = 4


# -- config ----------------------------------------------------------------------

_ROW_BYTES = 16 << 10  # bytes of a row per copy step on GPUs (32 registers per thread)

# Above this many tokens per rank the fused routing, whose every program scans
# every token's ids (1024 pairs per step), gives way to the XLA routing. Dispatch
# on 4 x H200 (H 7168, top-8 of 256 experts; bench moe --world 4,
# docs/perf/moe_NVIDIA_H200x4.md), us: 128 tokens fused 56.5, xla 122.3; 4096
# tokens xla 842.6 (fused 1275.8 in an earlier probe). A third path, two routing
# kernels launched before the dispatch, won nowhere (60.4 and 855.4) and is gone.
_FUSED_ROUTING_MAX_TOKENS = 256


def _chunk_tokens(per_program: int) -> int:
    """The GPU default CHUNK_TOKENS for programs of ``per_program`` tokens: about 8
    chunks of at least 2 tokens above 4 tokens per program, else one chunk (decode
    sizes, where each chunk's fence and flags would add latency). Dispatch on 2 x
    H200 (H 7168, top-8 of 256 experts; probe_defaults.py moe_chunks), us, one
    chunk / chunks of 2 / 4 / 8 / 16 tokens: 4096 tokens per rank (32 per
    program) 544.3 / 482.2 / 468.6 / 488.6 / 528.8; 1024 (8 per program) 146.6 /
    135.7 / 144.3 / 147.4 / 146.7; on 4 x H200 at 4096, 1184.4 / 977.0 / 963.3 /
    992.2 / 1132.1."""
    return max(2, per_program // 8) if per_program > 4 else 0


def _chunk_size(per_program: int, chunks: int) -> int:
    """Tokens per chunk of a program of ``per_program`` tokens in ``chunks`` chunks
    (the last one may be short): one rule for the dispatch and the combine."""
    return -(-per_program // chunks)


@dataclasses.dataclass(frozen=True)
class MoeConfig(KernelConfig):
    """How the dispatch and combine kernels split the work.

    Attributes:
      NUM_PROGRAMS: programs; program p owns tokens ``[p * TP, (p + 1) * TP)``
        on every rank and waits only for program p of the others (on GPUs at
        most one per SM: all resident). Combine uses its dispatch's value.
      BLOCK_H: elements per copy step (a power of 2): of one row in the
        dispatch; the combine moves a token's rows together, BLOCK_H / KL
        columns of each per step.
      num_warps: launch option.
      ROUTING: where the dispatch's routing metadata (slots, expert positions,
        counts) is computed: "fused" (the GPU default up to
        ``_FUSED_ROUTING_MAX_TOKENS`` tokens per rank: each program of the
        dispatch kernel computes its tokens' words itself, from every token's
        ids, with no launch before it) or "xla" (a dozen small XLA fusions
        before the kernel; the GPU default above, and the interpreter's). Both
        give the same words, bit for bit.
      CHUNK_TOKENS: tokens per chunk of a dispatch program (0: all its tokens
        in one chunk; the program's NCH chunks are evened out to
        ceil(TP / NCH) tokens each). Each chunk's rows are flagged on their own,
        and a program lays out the previous chunk it received while its next
        chunk's remote stores drain (bulk sizes: the local copies overlap the
        link). The combine works by the same chunks: it sums one chunk's
        tokens while the next chunk's rows drain.
      COMBINE_SEND: how the combine's forward weighs a token's rows on the
        experts' rank: "rows" (the default: only the valid pairs' rows, BLOCK_H
        columns of one row per load) or "blocks" (all min(K, E / W) pair slots
        of the token as one [KL, BLOCK_H / KL] block per step, masked).
      COMBINE_ROWS: with "rows", how many of a token's valid pair rows are loaded
        at once (their loads in flight together). On 2 x H200 (4096 tokens per
        rank, top-8 of 256 experts, H 7168) dispatch + combine took 891.9 /
        852.1 / 842.0 / 842.0 us with 1 / 2 / 3 / 4 (128 tokens: 51.1 / 51.5 /
        49.7 / 50.9); 2 is the default, as more rows spill registers for some
        row widths and dtypes.
    """
    OP: ClassVar[str] = "moe"
    variant: ClassVar[str] = "push"

    NUM_PROGRAMS: int = 2
    BLOCK_H: int = 64
    num_warps: int = 4
    ROUTING: str = "fused"
    CHUNK_TOKENS: int = 0
    COMBINE_SEND: str = "rows"
    COMBINE_ROWS: int = 2

    @classmethod
    def default(cls, problem: Problem) -> "MoeConfig":
        t, h = problem.shape[0], problem.shape[1]
        if problem.platform != "gpu":
            # The interpreter: few programs, small blocks, and the routing words from
            # XLA (the same words as the kernels', at a fraction of the interpreter's time).
            # Chunks of 2 tokens: the pipelined path runs wherever a program has more.
            return cls(NUM_PROGRAMS=min(2, t), BLOCK_H=min(64, next_pow2(h)), ROUTING="xla",
                       CHUNK_TOKENS=2)
        # Latency: one token per program up to one program per SM, and a whole row
        # (up to _ROW_BYTES) per copy step, so that every load of a row is in flight
        # at once. On 2 x H200 (128 tokens per rank, top-8, H 7168, E 256, bf16)
        # dispatch + combine took 85.4 us with 8192-element steps against 99.5 with
        # 2048 and 112.9 with 1024 (16 bytes per thread); 8 or 16 warps: no better.
        programs = max(1, min(problem.sms, t))
        return cls(NUM_PROGRAMS=programs,
                   BLOCK_H=min(_ROW_BYTES // problem.itemsize, next_pow2(h)),
                   ROUTING="fused" if t <= _FUSED_ROUTING_MAX_TOKENS else "xla",
                   CHUNK_TOKENS=_chunk_tokens(-(-t // programs)))

    def validate(self, problem: Problem) -> None:
        for key in ("NUM_PROGRAMS", "BLOCK_H", "num_warps"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"jaxtdist.moe: config {key}={value!r} must be an int >= 1")
        rows = self.COMBINE_ROWS
        if isinstance(rows, bool) or not isinstance(rows, int) or not 1 <= rows <= 8:
            raise ValueError(f"jaxtdist.moe: config COMBINE_ROWS={rows!r} must be an int in "
                             "[1, 8]")
        chunk = self.CHUNK_TOKENS
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0:
            raise ValueError(f"jaxtdist.moe: config CHUNK_TOKENS={chunk!r} must be an int >= 0 "
                             "(0: one chunk per program)")
        if self.ROUTING not in ("xla", "fused"):
            raise ValueError(f"jaxtdist.moe: config ROUTING={self.ROUTING!r}; allowed: 'xla', "
                             "'fused'")
        if self.COMBINE_SEND not in ("rows", "blocks"):
            raise ValueError(f"jaxtdist.moe: config COMBINE_SEND={self.COMBINE_SEND!r}; "
                             "allowed: 'rows', 'blocks'")
        if self.BLOCK_H & (self.BLOCK_H - 1):
            raise ValueError(f"jaxtdist.moe: config BLOCK_H={self.BLOCK_H} must be a power of 2")
        if problem.platform == "gpu" and self.NUM_PROGRAMS > problem.sms:
            raise ValueError(f"jaxtdist.moe: config NUM_PROGRAMS={self.NUM_PROGRAMS} exceeds "
                             f"the {problem.sms} SMs (every program must be resident)")


# -- the handle --------------------------------------------------------------------

@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MoeHandle:
    """What ``moe_combine`` needs from a ``moe_dispatch`` (a pytree: pass it along
    inside the same ``shard_map``).

    Array fields (per rank):
      expert_ids: [T, K] int32, the routing this rank's tokens were sent with.
      recv_counts: [W, E / W] int32, rows received from each source rank for
        each local expert (before dropping).
      src_pos: [W * T, min(K, E / W)] int32: for inbox row i of source s (slot
        ``s * T + i``) and its kk-th local expert, the row of ``recv_x`` it went
        to, or -1 (no such expert, or dropped).
      src_tk: same shape: ``t * K + k`` of that (token, k) pair at its source, or -1.
      src_ranges: [W, P, NCH + 1] int32: the inbox slots that each source's
        program p pushed, by its NCH chunks (chunk c: slots ``[src_ranges[s, p,
        c], src_ranges[s, p, c + 1])``); the combine sends and sums by them.
      dropped: int32 scalar: (token, expert) rows this rank dropped (past
        ``max_recv_rows``); their combine contribution is zero.
      invalid: int32 scalar: (token, k) pairs of this rank with an expert id
        outside [0, E) or repeated within the token; they are not sent and
        contribute zero.
    Static fields: num_experts, max_recv_rows, programs, axis_name (the
    dispatch's group, as a tuple of mesh axes; None: not recorded, not checked).
    """
    expert_ids: jax.Array
    recv_counts: jax.Array
    src_pos: jax.Array
    src_tk: jax.Array
    src_ranges: jax.Array
    dropped: jax.Array
    invalid: jax.Array
    num_experts: int = dataclasses.field(metadata=dict(static=True), default=0)
    max_recv_rows: int = dataclasses.field(metadata=dict(static=True), default=0)
    programs: int = dataclasses.field(metadata=dict(static=True), default=1)
    axis_name: tuple[str, ...] | None = dataclasses.field(metadata=dict(static=True),
                                                          default=None)


# -- routing metadata (on the device) ------------------------------------------------

def _valid_pairs(expert_ids: jax.Array, num_experts: int) -> jax.Array:
    """[T, K] bool: ids in [0, E) and not a repeat of an earlier k of the token."""
    ids = expert_ids
    in_range = (ids >= 0) & (ids < num_experts)
    k = ids.shape[1]
    earlier = jnp.tril(jnp.ones((k, k), bool), -1)  # [k, k'] k' < k
    repeat = jnp.any((ids[:, :, None] == ids[:, None, :]) & earlier[None], axis=2)
    return in_range & ~repeat


@dataclasses.dataclass(frozen=True)
class _Routing:
    invalid: jax.Array    # [] int32: pairs with an id outside [0, E) or repeated
    slot: jax.Array       # [T, W] int32, -1: not sent to d
    meta: jax.Array       # [T, W, 1 + 4 KL] int32
    dcounts: jax.Array    # [W, E_LOC] int32
    bounds: jax.Array     # [W, P + 1] int32


def _route(expert_ids, world: int, num_experts: int, programs: int,
           scale: jax.Array) -> _Routing:
    """The dispatch's routing words in XLA; ``scale`` [T, K] float32 (the copies'
    factors, their bits travel in the meta rows)."""
    t, k = expert_ids.shape
    e_loc = num_experts // world
    kl = min(k, e_loc)
    valid = _valid_pairs(expert_ids, num_experts)
    ids = jnp.where(valid, expert_ids, 0).astype(jnp.int32)
    dest = jnp.where(valid, ids // e_loc, world)                       # world: nowhere
    send = jnp.any(dest[:, :, None] == jnp.arange(world)[None, None], axis=1)  # [T, W]
    csum = jnp.cumsum(send.astype(jnp.int32), axis=0)
    slot = jnp.where(send, csum - 1, -1).astype(jnp.int32)
    tp = -(-t // programs)
    edges = np.minimum(np.arange(programs + 1) * tp, t)
    padded = jnp.concatenate([jnp.zeros((1, world), jnp.int32), csum], axis=0)
    bounds = padded[edges].T.astype(jnp.int32)                         # [W, P + 1]
    onehot = jnp.sum((ids[:, :, None] == jnp.arange(num_experts)[None, None]) & valid[:, :, None],
                     axis=1, dtype=jnp.int32)                          # [T, E]
    before = jnp.cumsum(onehot, axis=0) - onehot
    pos = jnp.take_along_axis(before, ids, axis=1)                     # [T, K]
    dcounts = jnp.sum(onehot, axis=0).reshape(world, e_loc)
    # kk: the rank of k among the token's valid experts on the same destination.
    earlier = jnp.tril(jnp.ones((k, k), bool), -1)
    same = (dest[:, :, None] == dest[:, None, :]) & valid[:, None, :] & earlier[None]
    kk = jnp.sum(same, axis=2).astype(jnp.int32)
    fields = jnp.stack([ids % e_loc, pos, jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (t, k)),
                        jax.lax.bitcast_convert_type(scale, jnp.int32)], axis=-1)  # [T, K, 4]
    # Slot (d, j) of token t holds the fields of its valid pair k with dest d and
    # kk = j (at most one: kk counts the token's distinct experts on d, fewer than
    # KL). Selected by a masked sum, not a scatter: XLA's GPU scatter of these
    # 4 T K words took 23 us at T = 128, K = 8 (2 x H200), a fused select 1-2 us.
    match = ((dest[:, None, None, :] == jnp.arange(world)[None, :, None, None])
             & (kk[:, None, None, :] == jnp.arange(kl)[None, None, :, None])
             & valid[:, None, None, :])                                # [T, W, KL, K]
    picked = jnp.sum(jnp.where(match[..., None], fields[:, None, None], 0), axis=3)
    table = jnp.where(jnp.any(match, axis=3)[..., None], picked, -1)    # [T, W, KL, 4]
    head = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[:, None, None], (t, world, 1))
    meta = jnp.concatenate([head, table.reshape(t, world, kl * _FIELDS)], axis=2)
    return _Routing(jnp.sum(~valid).astype(jnp.int32), slot, meta, dcounts, bounds)


def _route_tokens_per_step(tokens_per_program: int, top_k: int, num_experts: int) -> int:
    """BT of the fused routing: its own tokens' words BT at a time, a [BT, KP, EP]
    one-hot block of at most 8192 words."""
    return max(1, min(next_pow2(tokens_per_program),
                      8192 // (next_pow2(top_k) * next_pow2(num_experts))))


def _route_scan_tokens(tokens: int, top_k: int) -> int:
    """BS of the fused routing: tokens per step of its scan over every token's ids
    (1024 pairs per histogram)."""
    return min(next_pow2(tokens), max(1, 1024 // next_pow2(top_k)))


def _summary(recv_counts: jax.Array, rows: int) -> tuple[jax.Array, jax.Array]:
    """group_sizes [E_LOC] (rows kept per local expert) and the rows dropped."""
    tot = jnp.sum(recv_counts, axis=0)
    kept = jnp.minimum(jnp.cumsum(tot), rows)
    sizes = jnp.diff(jnp.concatenate([jnp.zeros((1,), kept.dtype), kept]))
    dropped = jnp.sum(tot) - kept[-1]
    return sizes.astype(jnp.int32), dropped.astype(jnp.int32)


# -- shapes ----------------------------------------------------------------------

def default_recv_rows(tokens: int, top_k: int, world: int, num_experts: int) -> int:
    """recv_x's rows by default: every token of every rank, to min(K, E / W) experts."""
    return world * tokens * min(top_k, num_experts // world)


def _check_dispatch(x, expert_ids, *, axis_name, num_experts, max_recv_rows=None, split=0,
                    zero_unused_rows=True, config=None) -> None:
    # split: internal (moe_dispatch's fp8 rows), set consistently; zero_unused_rows:
    # made a bool by moe_dispatch.
    del config, split, zero_unused_rows
    world = check_axis(runtime(), axis_name, "moe_dispatch").world
    if getattr(x, "ndim", None) != 2:
        raise ValueError(f"jaxtdist.moe_dispatch: x must be [tokens, hidden] (2-D), got shape "
                         f"{getattr(x, 'shape', None)}")
    if jnp.dtype(x.dtype) != jnp.uint8:  # uint8: byte rows (the fp8 path's, packed)
        check_dtype("moe_dispatch", "x", x.dtype)
    if (getattr(expert_ids, "ndim", None) != 2 or expert_ids.shape[0] != x.shape[0]):
        raise ValueError(f"jaxtdist.moe_dispatch: expert_ids must be [tokens, top_k] with "
                         f"tokens = x.shape[0] = {x.shape[0]}, got shape "
                         f"{getattr(expert_ids, 'shape', None)}")
    if jnp.dtype(expert_ids.dtype) != jnp.int32:
        raise ValueError(f"jaxtdist.moe_dispatch: expert_ids has dtype "
                         f"{jnp.dtype(expert_ids.dtype).name}; it must be int32 "
                         "(use expert_ids.astype(jnp.int32))")
    if 0 in x.shape or expert_ids.shape[1] == 0:
        raise ValueError(f"jaxtdist.moe_dispatch: empty operand x{x.shape} "
                         f"expert_ids{expert_ids.shape}")
    if (isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1
            or num_experts % world):
        raise ValueError(f"jaxtdist.moe_dispatch: num_experts={num_experts!r} must be a "
                         f"positive multiple of the group size W={world} over {axis_name!r} "
                         f"(an int: experts are split evenly over the ranks)"
                         f"{traced_hint(num_experts)}")
    if expert_ids.shape[1] > num_experts:
        raise ValueError(f"jaxtdist.moe_dispatch: top_k={expert_ids.shape[1]} (expert_ids' "
                         f"columns) exceeds num_experts={num_experts}: a token's experts "
                         "must be distinct")
    if max_recv_rows is not None and (isinstance(max_recv_rows, bool)
                                      or not isinstance(max_recv_rows, int)
                                      or max_recv_rows < 1):
        raise ValueError(f"jaxtdist.moe_dispatch: max_recv_rows={max_recv_rows!r} must be "
                         f"None (every row fits) or an int >= 1{traced_hint(max_recv_rows)}")


def _problem(call: Call, tokens: int, hidden: int, dtype) -> Problem:
    return Problem(call.platform, call.world, (tokens, hidden), jnp.dtype(dtype).name,
                   call.rt.sms)


def _resolved(call: Call, tokens: int, hidden: int, dtype, config, axis_name) -> MoeConfig:
    """The config the kernels take for ``tokens`` rows of ``hidden`` ``dtype`` elements."""
    return resolve(MoeConfig, _problem(call, tokens, hidden, dtype), call.rt, config,
                   axis_name=axis_name)


class DispatchWorkspace:
    """Byte layout of the dispatch workspace: flags [W, P, NCH] int32 (NCH chunks
    per program), then per call parity: headers [W, E_LOC + P (NCH + 1) + 1] int32, meta rows [W, T, 1 + 4 KL] int32,
    rows [W, T, H]; last, this rank's scratch for the fused routing's words
    (``kernels/moe.py``, ROUTE: slot [T, W], meta [T, W, 1 + 4 KL], dcounts
    [P, W * E_LOC], bounds [P, W, 3] int32; written and read by one kernel)."""

    def __init__(self, world, tokens, hidden, itemsize, e_loc, kl, programs, chunks):
        self.hdr_words = e_loc + programs * (chunks + 1) + 1
        self.meta_words = 1 + _FIELDS * kl
        self.flags = 0
        self.hdr = align(4 * world * programs * chunks)
        self.meta = self.hdr + align(4 * world * self.hdr_words)
        self.rows = self.meta + align(4 * world * tokens * self.meta_words)
        self.parity_bytes = self.rows + align(world * tokens * hidden * itemsize) - self.hdr
        self.route = self.hdr + 2 * self.parity_bytes
        self.nbytes = self.route + align(4 * (tokens * world * (1 + self.meta_words)
                                              + programs * world * (e_loc + 3)))


class CombineWorkspace:
    """Byte layout of the combine workspace: flags [W, P, NCH] int32, then per call
    parity an inbox of rows and a weight box [W, T, K] int64 (float32 weights as
    tagged words). Inbox rows: [W, T] (row ``d * T + t``: token t's rows of rank d,
    weighed and summed there: the forward) or [T * K] (row ``t * K + k``: the
    expert's row of pair (t, k): the backward); room for both."""

    def __init__(self, world, tokens, top_k, cols, itemsize, programs, chunks):
        self.flags = 0
        self.inbox = align(4 * world * programs * chunks)
        self.wbox_in_parity = align(max(world, top_k) * tokens * cols * itemsize)
        self.parity_bytes = self.wbox_in_parity + align(8 * world * tokens * top_k)
        self.nbytes = self.inbox + 2 * self.parity_bytes


# -- the kernels at any world -------------------------------------------------------

def moe_dispatch_kernels(x: jax.Array, expert_ids: jax.Array, axis_name, *, num_experts: int,
                         max_recv_rows: int | None = None, scale: jax.Array | None = None,
                         split: int = 0, config: dict | None = None, trace: bool = False,
                         zero_unused_rows: bool = True):
    """moe_dispatch's kernel, at world 1 too (benchmarks, tests); not differentiable.

    With ``trace``, also returns an int32 [P, 6] array of per-program timestamps
    (low 32 bits of the GPU's ns clock; subtract modulo 2**32) at the kernel's
    phases (``kernels/moe.py``, TRACE_PHASES): a probe's view of where the time goes.

    ``scale`` [T, K] (optional): the copy of token t for its k-th expert is
    multiplied by ``scale[t, k]`` (combine's backward uses it). ``split`` (0 <
    split < H): recv_x is the pair ([R, split], [R, H - split]) of each row's
    first columns and the rest (fp8 byte rows: tokens and scales).
    ``zero_unused_rows``: as ``moe_dispatch``'s.
    Returns (recv_x, group_sizes, handle), as ``moe_dispatch``.
    """
    x, expert_ids = jnp.asarray(x), jnp.asarray(expert_ids)
    _check_dispatch(x, expert_ids, axis_name=axis_name, num_experts=num_experts,
                    max_recv_rows=max_recv_rows)
    call = Call("moe_dispatch", axis_name)
    world = call.world
    (t, h), k = x.shape, expert_ids.shape[1]
    e_loc = num_experts // world
    kl = min(k, e_loc)
    rows = max_recv_rows or default_recv_rows(t, k, world, num_experts)
    cfg = _resolved(call, t, h, x.dtype, config, axis_name)
    programs = min(cfg.NUM_PROGRAMS, t)
    per_program = -(-t // programs)
    chunks = -(-per_program // min(cfg.CHUNK_TOKENS or per_program, per_program))
    # The same number of chunks, as even as it gets: the combine, which sends and
    # sums by the dispatch's chunks, finds their size from their count (src_ranges).
    chunk = _chunk_size(per_program, chunks)
    plan = DispatchWorkspace(world, t, h, x.dtype.itemsize, e_loc, kl, programs, chunks)
    # The layout depends on all of these: other shapes get their own workspace.
    ws = call.workspace("push", plan.nbytes, t, h, x.dtype.name, k, num_experts, programs,
                        chunks)
    varying = set(call.result_axes(local=(x, expert_ids))) | set(call.layout.axes)
    i32 = jnp.int32
    if not 0 <= split < h:
        raise ValueError(f"jaxtdist.moe_dispatch: split={split} must be in [0, H={h})")
    factors = (jnp.ones((t, k), jnp.float32) if scale is None
               else jnp.asarray(scale).astype(jnp.float32))
    ids = expert_ids.astype(i32)
    fused = cfg.ROUTING == "fused"
    if fused:  # the dispatch kernel computes the words itself: unused inputs
        none = jnp.zeros((1,), i32)
        route = _Routing(None, none, none, none, none)
    else:
        route = _route(expert_ids, world, num_experts, programs, factors)
    # With split, the rows' first columns and the rest land in two arrays; without,
    # the last output is a one-element placeholder the kernel never writes (as is
    # invalid without the fused routing).
    recv, counts, spos, stk, ranges, tail, stamps, invalid = call.run(
        moe_dispatch_kernel, x, route.slot, route.meta, route.dcounts, route.bounds, ids, factors,
        out_shape=[jax.ShapeDtypeStruct((rows, split or h), x.dtype),
                   jax.ShapeDtypeStruct((world, e_loc), i32),
                   jax.ShapeDtypeStruct((world * t, kl), i32),
                   jax.ShapeDtypeStruct((world * t, kl), i32),
                   jax.ShapeDtypeStruct((world, programs, chunks + 1), i32),
                   jax.ShapeDtypeStruct((rows, h - split) if split else (1,), x.dtype),
                   _trace_shape(trace, programs),
                   jax.ShapeDtypeStruct((1,), i32)],
        workspace=ws, grid=(programs,), num_warps=cfg.num_warps, num_stages=1,
        varying=tuple(a for a in call.rt.mesh.axis_names if a in varying),
        T=t, H=h, K=k, E_LOC=e_loc, KL=kl, R=rows, W=world, P=programs,
        TP=per_program, FLAGS_OFF=ws.offset + plan.flags, HDR_OFF=ws.offset + plan.hdr,
        META_OFF=ws.offset + plan.meta, ROWS_OFF=ws.offset + plan.rows,
        PARITY_BYTES=plan.parity_bytes, HDR_WORDS=plan.hdr_words, META_WORDS=plan.meta_words,
        SCALED=scale is not None, WP=next_pow2(world), EP=next_pow2(e_loc),
        MP=next_pow2(plan.meta_words), KLP=next_pow2(kl), BLOCK_H=cfg.BLOCK_H, SPLIT=split,
        TRACE=trace, ROUTE=fused, ROUTE_OFF=ws.offset + plan.route, KP=next_pow2(k),
        EPG=next_pow2(num_experts), BT=_route_tokens_per_step(-(-t // programs), k, num_experts),
        BS=_route_scan_tokens(t, k), ZERO_TAIL=zero_unused_rows, CT=chunk, NCH=chunks)
    if split:
        recv = (recv, tail)
    sizes, dropped = _summary(counts, rows)
    handle = MoeHandle(expert_ids, counts, spos, stk, ranges, dropped,
                       invalid[0] if fused else route.invalid,
                       num_experts=num_experts, max_recv_rows=rows, programs=programs,
                       axis_name=call.layout.axes)
    return (recv, sizes, handle, stamps) if trace else (recv, sizes, handle)


def _trace_shape(trace: bool, programs: int) -> jax.ShapeDtypeStruct:
    """The kernels' timestamps output: [P, TRACE_PHASES] int32 with ``trace``,
    else a one-element placeholder the kernel never writes."""
    return jax.ShapeDtypeStruct((programs, TRACE_PHASES.value) if trace else (1,), jnp.int32)


def moe_combine_kernels(y: jax.Array, handle: MoeHandle, weights: jax.Array, axis_name, *,
                        cotangent: jax.Array | None = None, config: dict | None = None,
                        trace: bool = False):
    """moe_combine's kernel, at world 1 too (benchmarks, tests); not differentiable.

    With ``cotangent`` [T, F], returns (out, dots) where dots[t, k] = <y row of
    (t, k), cotangent[t]> (float32); else out. With ``trace``, the int32 [P, 6]
    timestamps (as ``moe_dispatch_kernels``'s; phases 0-3) come last.
    """
    y, weights = jnp.asarray(y), jnp.asarray(weights)
    _check_combine(y, weights, handle, axis_name=axis_name)
    call = Call("moe_combine", axis_name)
    world = call.world
    t, k = handle.expert_ids.shape
    f = y.shape[1]
    programs = handle.programs
    kl = handle.src_pos.shape[1]
    cfg = _resolved(call, t, f, y.dtype, config, axis_name)
    per_program = -(-t // programs)
    chunks = handle.src_ranges.shape[2] - 1  # the dispatch's
    plan = CombineWorkspace(world, t, k, f, y.dtype.itemsize, programs, chunks)
    ws = call.workspace("push", plan.nbytes, t, k, f, y.dtype.name, programs, chunks)
    kmask = _valid_pairs(handle.expert_ids, handle.num_experts).astype(jnp.int32)
    dots = cotangent is not None
    g = cotangent if dots else jnp.zeros((1,), y.dtype)
    varying = set(call.result_axes(local=(y, weights, handle.src_pos))) | set(call.layout.axes)
    outs = call.run(
        moe_combine_kernel, y, weights, kmask, handle.expert_ids, g, handle.src_pos,
        handle.src_tk, handle.src_ranges, workspace=ws,
        out_shape=[jax.ShapeDtypeStruct((t, f), y.dtype),
                   jax.ShapeDtypeStruct((t, k) if dots else (1,), jnp.float32),
                   _trace_shape(trace, programs)],
        grid=(programs,), num_warps=cfg.num_warps, num_stages=1,
        varying=tuple(a for a in call.rt.mesh.axis_names if a in varying),
        T=t, F=f, K=k, KL=kl, W=world, P=programs, TP=per_program,
        E_LOC=handle.num_experts // world, FLAGS_OFF=ws.offset + plan.flags,
        INBOX_OFF=ws.offset + plan.inbox,
        WBOX_OFF=ws.offset + plan.inbox + plan.wbox_in_parity, PARITY_BYTES=plan.parity_bytes,
        DOTS=dots, KP=next_pow2(k), KLP=next_pow2(kl), WP=next_pow2(world),
        BLOCK_F=cfg.BLOCK_H, SEND_ROWS=cfg.COMBINE_ROWS if cfg.COMBINE_SEND == "rows" else 0,
        TRACE=trace, CT=_chunk_size(per_program, chunks), NCH=chunks)
    out, dots_out, stamps = outs
    result = ((out, dots_out) if dots else (out,)) + ((stamps,) if trace else ())
    return result if len(result) > 1 else out


# -- the local computation (world 1) ------------------------------------------------

def _local_dispatch(x, expert_ids, *, num_experts, rows, programs):
    t, k = expert_ids.shape
    valid = _valid_pairs(expert_ids, num_experts)
    ids = jnp.where(valid, expert_ids, 0)
    onehot = jnp.sum((ids[:, :, None] == jnp.arange(num_experts)[None, None])
                     & valid[:, :, None], axis=1, dtype=jnp.int32)
    tot = jnp.sum(onehot, axis=0)
    start = jnp.cumsum(tot) - tot
    pos = start[ids] + jnp.take_along_axis(jnp.cumsum(onehot, axis=0) - onehot, ids, axis=1)
    keep = valid & (pos < rows)
    target = jnp.where(keep, pos, rows).reshape(-1)
    src = jnp.broadcast_to(x[:, None, :], (t, k, x.shape[1])).reshape(t * k, -1)
    recv = jnp.zeros((rows, x.shape[1]), x.dtype).at[target].set(src, mode="drop")
    spos = jnp.where(keep, pos, -1).astype(jnp.int32)
    stk = jnp.where(valid, jnp.arange(t * k).reshape(t, k), -1).astype(jnp.int32)
    return recv, tot.reshape(1, -1).astype(jnp.int32), spos, stk, valid


def _local_combine(y, weights, src_pos, src_tk, t, k):
    """out[t] = sum over records (pos, t * K + k) of weights[t, k] * y[pos] (both
    handle flavours: the local one and the kernels')."""
    tk = src_tk.reshape(-1)
    pos = src_pos.reshape(-1)
    # A dropped pair (pos < 0) keeps its tk: its weight, even NaN, must not count.
    w = jnp.where((tk >= 0) & (pos >= 0), weights.reshape(-1)[jnp.maximum(tk, 0)],
                  0).astype(jnp.float32)
    rows = jnp.where((pos >= 0)[:, None], y[jnp.maximum(pos, 0)].astype(jnp.float32), 0)
    out = jnp.zeros((t, y.shape[1]), jnp.float32).at[jnp.where(tk >= 0, tk // k, t)].add(
        w[:, None] * rows, mode="drop")
    return out.astype(y.dtype)


# -- fp8 dispatch ------------------------------------------------------------------

FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))


def _check_fp8(x, x_scale) -> None:
    fp8 = jnp.dtype(x.dtype) in FP8_DTYPES
    if x_scale is None:
        if fp8:
            raise ValueError(f"jaxtdist.moe_dispatch: x is {jnp.dtype(x.dtype).name}: fp8 "
                             "tokens need their scales, x_scale [T, S] float32")
        return
    if not fp8:
        raise ValueError(f"jaxtdist.moe_dispatch: x_scale is given, so x must be fp8 "
                         f"({', '.join(d.name for d in FP8_DTYPES)}), got "
                         f"{jnp.dtype(x.dtype).name}; pass x_scale=None to dispatch it as is")
    t, h = x.shape
    if (getattr(x_scale, "ndim", None) != 2 or x_scale.shape[0] != t or x_scale.shape[1] < 1
            or h % x_scale.shape[1]):
        raise ValueError(f"jaxtdist.moe_dispatch: x_scale must be [T, S] with T = {t} tokens "
                         f"and S >= 1 dividing H = {h} (one scale per H / S columns of a "
                         f"token), got shape {getattr(x_scale, 'shape', None)}")
    if jnp.dtype(x_scale.dtype) != jnp.float32:
        raise ValueError(f"jaxtdist.moe_dispatch: x_scale has dtype "
                         f"{jnp.dtype(x_scale.dtype).name}; it must be float32")


@jax.custom_jvp
def _fp8_rows(x, x_scale):
    """One byte row per token: x's H fp8 bytes, then its S float32 scales' bytes,
    padded to a multiple of 16 bytes (the row copies' vector width): [T, H + 4 S
    + pad] uint8. The dispatch moves rows, whatever they hold."""
    t, h = x.shape
    pad = -(h + 4 * x_scale.shape[1]) % 16
    return jnp.concatenate([jax.lax.bitcast_convert_type(x, jnp.uint8),
                            jax.lax.bitcast_convert_type(x_scale, jnp.uint8).reshape(t, -1),
                            jnp.zeros((t, pad), jnp.uint8)], axis=1)


@_fp8_rows.defjvp
def _fp8_rows_jvp(primals, tangents):
    # A bitcast would pass zeros silently: say so instead.
    raise TypeError("jaxtdist.moe_dispatch: the fp8 path (x_scale given) is not "
                    "differentiable: quantized tokens carry no gradient here; dispatch the "
                    "bfloat16 x (x_scale=None) where gradients must flow")


def _fp8_unpack(recv, dtype, scales: int):
    """(tokens [R, H] uint8, tails [R, 4 S + pad] uint8), the dispatch's two parts of
    each byte row -> (recv_x [R, H] fp8, recv_scale [R, S] float32): bitcasts and
    a slice of the small tails only."""
    tokens, tails = recv
    scale = jax.lax.bitcast_convert_type(
        tails[:, :4 * scales].reshape(tails.shape[0], scales, 4), jnp.float32)
    return jax.lax.bitcast_convert_type(tokens, dtype), scale


# -- the ops ----------------------------------------------------------------------

def _dispatch_forward(x, expert_ids, *, axis_name, num_experts, max_recv_rows=None, split=0,
                      zero_unused_rows=True, config=None):
    recv, sizes, handle = moe_dispatch_kernels(x, expert_ids, axis_name,
                                               num_experts=num_experts,
                                               max_recv_rows=max_recv_rows, split=split,
                                               zero_unused_rows=zero_unused_rows,
                                               config=config)
    out = (recv, sizes, handle.recv_counts, handle.src_pos, handle.src_tk, handle.src_ranges,
           handle.dropped, handle.invalid)
    return out, (expert_ids, handle.src_pos, handle.src_tk, handle.src_ranges)


def _dispatch_backward(residuals, ct, *, axis_name, num_experts, max_recv_rows=None, split=0,
                       zero_unused_rows=True, config=None):
    # Only the fp8 path splits rows, and it is not differentiable; the combine reads
    # the received rows only.
    del split, zero_unused_rows
    expert_ids, spos, stk, ranges = residuals
    t, k = expert_ids.shape
    world = runtime().layout(axis_name).world
    rows = max_recv_rows or default_recv_rows(t, k, world, num_experts)
    programs = ranges.shape[1]
    ones = jnp.ones(expert_ids.shape, jnp.float32)

    def combine(ct_recv, ids, pos, tk, rng):
        handle = MoeHandle(ids, None, pos, tk, rng, None, None, num_experts=num_experts,
                           max_recv_rows=rows, programs=programs)
        return moe_combine_kernels(ct_recv, handle, ones, axis_name, config=config)

    # The transpose of copying x[t] to each of its expert rows: sum those rows (one
    # whole kernel call per element under jax.vmap, like every backward's).
    dx = one_call_per_element(combine)(ct[0], expert_ids, spos, stk, ranges)
    return dx, None


def _dispatch_local(x, expert_ids, *, axis_name, num_experts, max_recv_rows=None, split=0,
                    zero_unused_rows=True, config=None):
    del axis_name, config, zero_unused_rows  # zeros either way: XLA fuses them into the scatter
    t, k = expert_ids.shape
    rows = max_recv_rows or default_recv_rows(t, k, 1, num_experts)
    recv, counts, spos, stk, valid = _local_dispatch(x, expert_ids, num_experts=num_experts,
                                                     rows=rows, programs=1)
    if split:
        recv = (recv[:, :split], recv[:, split:])
    sizes, dropped = _summary(counts, rows)
    ranges = jnp.zeros((1, 1, 2), jnp.int32)
    return (recv, sizes, counts, spos, stk, ranges, dropped,
            jnp.sum(~valid).astype(jnp.int32))


def _check_dispatch_config(x, expert_ids, *, axis_name, config, **static):
    del expert_ids, static
    _resolved(Call("moe_dispatch", axis_name), *x.shape, x.dtype, config, axis_name)


_DISPATCH = DistributedOp("moe_dispatch", forward=_dispatch_forward,
                          backward=_dispatch_backward, check=_check_dispatch,
                          local=_dispatch_local, check_config=_check_dispatch_config)


def _check_combine(y, weights, handle, *, axis_name, config=None) -> None:
    del config
    layout = check_axis(runtime(), axis_name, "moe_combine")
    world = layout.world
    if not isinstance(handle, MoeHandle):
        raise ValueError(f"jaxtdist.moe_combine: handle must be the MoeHandle that "
                         f"moe_dispatch returned, got {type(handle).__name__}")
    # The handle's arrays are laid out for the dispatch's group: combining over
    # another group reads them with the wrong W (a wrong result, or worse: kernels
    # indexing past the handle's arrays).
    if handle.axis_name is not None and handle.axis_name != layout.axes:
        raise ValueError(f"jaxtdist.moe_combine: axis_name={axis_name!r}, but the handle "
                         f"comes from a moe_dispatch over {handle.axis_name!r}; combine over "
                         "the dispatch's axis_name")
    tokens = getattr(handle.expert_ids, "shape", (None,))[0]
    ranks = getattr(handle.src_ranges, "shape", (None,))[0]
    if ranks != world or getattr(handle.src_pos, "shape", (None,))[0] != world * tokens:
        raise ValueError(f"jaxtdist.moe_combine: the handle was made by a moe_dispatch over "
                         f"{ranks} ranks (src_ranges "
                         f"{getattr(handle.src_ranges, 'shape', None)}), but axis_name "
                         f"{axis_name!r} has W={world} ranks; combine over the dispatch's "
                         "axis_name, with its handle unchanged")
    ranges_shape = getattr(handle.src_ranges, "shape", None)
    if (ranges_shape is None or len(ranges_shape) != 3 or ranges_shape[1] != handle.programs
            or ranges_shape[2] < 2):
        raise ValueError(f"jaxtdist.moe_combine: the handle's src_ranges must be [W, P, NCH "
                         f"+ 1] with P = handle.programs = {handle.programs} and NCH >= 1 "
                         f"chunks, as moe_dispatch returns it, got shape {ranges_shape}; "
                         "pass the dispatch's handle unchanged")
    if getattr(y, "ndim", None) != 2 or y.shape[0] != handle.max_recv_rows:
        raise ValueError(f"jaxtdist.moe_combine: y must be [R, F] with R = the dispatch's "
                         f"max_recv_rows = {handle.max_recv_rows} rows (one per row of recv_x), "
                         f"got shape {getattr(y, 'shape', None)}")
    check_dtype("moe_combine", "y", y.dtype)
    if getattr(weights, "shape", None) != tuple(handle.expert_ids.shape):
        raise ValueError(f"jaxtdist.moe_combine: weights must be [tokens, top_k] = "
                         f"{tuple(handle.expert_ids.shape)} like the dispatch's expert_ids, got "
                         f"shape {getattr(weights, 'shape', None)}")
    if not jnp.issubdtype(weights.dtype, jnp.floating):
        raise ValueError(f"jaxtdist.moe_combine: weights has dtype {jnp.dtype(weights.dtype)}; "
                         "it must be a floating dtype")


def _combine_static(handle: MoeHandle) -> dict:
    return dict(num_experts=handle.num_experts, max_recv_rows=handle.max_recv_rows,
                programs=handle.programs)


def _combine_handle(expert_ids, spos, stk, ranges, static) -> MoeHandle:
    return MoeHandle(expert_ids, None, spos, stk, ranges, None, None, **static)


def _combine_forward(y, weights, expert_ids, spos, stk, ranges, *, axis_name, num_experts,
                     max_recv_rows, programs, config=None):
    static = dict(num_experts=num_experts, max_recv_rows=max_recv_rows, programs=programs)
    handle = _combine_handle(expert_ids, spos, stk, ranges, static)
    out = moe_combine_kernels(y, handle, weights, axis_name, config=config)
    return out, (y, weights, expert_ids, spos, stk, ranges)


def _combine_backward(residuals, ct, *, axis_name, num_experts, max_recv_rows, programs,
                      config=None):
    y, weights, expert_ids, spos, stk, ranges = residuals
    static = dict(num_experts=num_experts, max_recv_rows=max_recv_rows, programs=programs)
    ct = ct.astype(y.dtype)

    def dispatch(ct, ids, w):
        # dy: the cotangent of token t's output, sent to each of its experts' rows,
        # times the pair's weight (the same routing lays it out as y is).
        return moe_dispatch_kernels(ct, ids, axis_name, num_experts=num_experts,
                                    max_recv_rows=max_recv_rows, scale=w, config=config)[0]

    def combine(y, w, ct, ids, pos, tk, rng):
        # dweights[t, k] = <y row of (t, k), ct[t]>: the combine kernel's dot products.
        return moe_combine_kernels(y, _combine_handle(ids, pos, tk, rng, static), w,
                                   axis_name, cotangent=ct, config=config)[1]

    # One whole kernel call per element under jax.vmap, like every backward's.
    dy = one_call_per_element(dispatch)(ct, expert_ids, weights)
    dw = one_call_per_element(combine)(y, weights, ct, expert_ids, spos, stk, ranges)
    return dy, dw, None, None, None, None


def _combine_local(y, weights, expert_ids, spos, stk, ranges, *, axis_name, num_experts,
                   max_recv_rows, programs, config=None):
    del ranges, axis_name, num_experts, max_recv_rows, programs, config
    t, k = expert_ids.shape
    return _local_combine(y, weights, spos, stk, t, k)


def _check_combine_op(y, weights, expert_ids, spos, stk, ranges, *, axis_name, num_experts,
                      max_recv_rows, programs, config=None) -> None:
    static = dict(num_experts=num_experts, max_recv_rows=max_recv_rows, programs=programs)
    _check_combine(y, weights, _combine_handle(expert_ids, spos, stk, ranges, static),
                   axis_name=axis_name)


def _check_combine_config(y, weights, expert_ids, *handle_arrays, axis_name, config, **static):
    del weights, handle_arrays, static
    _resolved(Call("moe_combine", axis_name), expert_ids.shape[0], y.shape[1], y.dtype, config,
              axis_name)


_COMBINE = DistributedOp("moe_combine", forward=_combine_forward, backward=_combine_backward,
                         check=_check_combine_op, local=_combine_local,
                         check_config=_check_combine_config)


def moe_dispatch(x: jax.Array, expert_ids: jax.Array, axis_name, *, num_experts: int,
                 max_recv_rows: int | None = None, x_scale: jax.Array | None = None,
                 zero_unused_rows: bool = True,
                 config: dict | None = None) -> tuple[Any, jax.Array, MoeHandle]:
    """Sends every (token, expert) pair to the rank of its expert, grouped by local expert.

    Call inside ``jax.shard_map`` over the mesh given to ``jaxtdist.initialize``.
    Rank r of ``axis_name`` (W ranks) owns experts ``[r * E / W, (r + 1) * E / W)``.
    A token routed to several experts of one rank crosses the link once. Token
    counts are data: one compiled program serves every routing. Differentiable
    in ``x`` (the backward is a combine with weights 1).

    fp8: with ``x_scale``, x is fp8 (``float8_e4m3fn`` or ``float8_e5m2``) and each
    token's S float32 scales travel with its row (one transfer, half the bytes
    of bfloat16); the experts get ``(recv_x, recv_scale)``. Not differentiable
    (a TypeError says so); combine the experts' bfloat16 output as usual.

    Args:
      x: [T, H] this rank's tokens (bfloat16, float16 or float32; fp8 with
        ``x_scale``).
      expert_ids: [T, K] int32 top-K routing, distinct experts per token, in
        [0, E). Pairs outside [0, E) or repeated within a token are not sent
        (counted in ``handle.invalid``; they contribute zero in combine).
      axis_name: mesh axis (or tuple of axes) of the expert-parallel group.
      num_experts: E, a multiple of W.
      max_recv_rows: R, the rows of ``recv_x`` (static); default
        ``W * T * min(K, E / W)`` (nothing can be dropped). Rows past R are
        dropped and counted in ``handle.dropped``.
      x_scale: [T, S] float32 (fp8 x only): token t's columns ``[j * H / S,
        (j + 1) * H / S)`` are scaled by ``x_scale[t, j]`` (S = 1: per token;
        S = H / 128: per 128-column block).
      zero_unused_rows: True (the default): rows of ``recv_x`` (and
        ``recv_scale``) past the received ones are zero. False: they are left
        unwritten, their contents unspecified (they may hold NaN): for
        consumers that read only the first ``sum(group_sizes)`` rows
        (``jax.lax.ragged_dot``, ``jaxtdist.grouped_matmul``, ``moe_combine``
        of their output). It saves writing the unused rows, most of R with the
        default ``max_recv_rows`` (three quarters of it for balanced top-8
        routing over 4 ranks).
      config: overrides of ``MoeConfig`` (advanced).

    Returns:
      ``recv_x`` [R, H]: local expert 0's rows first, then expert 1's, ...;
      within an expert by source rank, then token index; rows past the
      received ones are zero (see ``zero_unused_rows``). With ``x_scale``:
      the pair ``(recv_x, recv_scale)``, recv_scale [R, S] float32 row for
      row (zeros past the received rows, as recv_x's). ``group_sizes`` [E / W] int32: rows per local
      expert (``jax.lax.ragged_dot(recv_x, w_local, group_sizes)``).
      ``handle``: a ``MoeHandle`` for ``moe_combine``.

    Example:
      >>> def layer(x, ids, w, gate):
      ...     recv, sizes, handle = jaxtdist.moe_dispatch(x, ids, "ep", num_experts=8)
      ...     y = jax.lax.ragged_dot(recv, w, sizes)
      ...     return jaxtdist.moe_combine(y, handle, gate, "ep")
    """
    x, expert_ids = jnp.asarray(x), jnp.asarray(expert_ids)
    # NumPy integers (a config's or a shape's) count as ints; floats and bools do not.
    num_experts, max_recv_rows = (int(v) if isinstance(v, np.integer)
                                  and not isinstance(v, np.bool_) else v
                                  for v in (num_experts, max_recv_rows))
    zero_unused_rows = static_bool("moe_dispatch", "zero_unused_rows", zero_unused_rows)
    if getattr(x, "ndim", None) == 2:
        if jnp.dtype(x.dtype) == jnp.uint8:  # byte rows are internal (the fp8 path's)
            check_dtype("moe_dispatch", "x", x.dtype)
        if x_scale is not None:
            x_scale = jnp.asarray(x_scale)
        _check_fp8(x, x_scale)
    rows_in = x if x_scale is None else _fp8_rows(x, x_scale)
    # fp8: each byte row's token bytes and scale bytes come back as two arrays.
    split = x.shape[1] if x_scale is not None else 0
    out = _DISPATCH(rows_in, expert_ids, axis_name=axis_name, num_experts=num_experts,
                    max_recv_rows=max_recv_rows, split=split,
                    zero_unused_rows=zero_unused_rows, config=config)
    recv, sizes, counts, spos, stk, ranges, dropped, invalid = out
    if x_scale is not None:
        recv = _fp8_unpack(recv, x.dtype, x_scale.shape[1])
    t, k = expert_ids.shape
    layout = check_axis(runtime(), axis_name, "moe_dispatch")
    rows = max_recv_rows or default_recv_rows(t, k, layout.world, num_experts)
    programs = ranges.shape[1]
    handle = MoeHandle(expert_ids, counts, spos, stk, ranges, dropped, invalid,
                       num_experts=num_experts, max_recv_rows=rows, programs=programs,
                       axis_name=layout.axes)
    return recv, sizes, handle


def moe_combine(y: jax.Array, handle: MoeHandle, weights: jax.Array, axis_name, *,
                config: dict | None = None) -> jax.Array:
    """Brings the experts' rows back to their tokens and sums them with the weights.

    ``out[t] = sum_k weights[t, k] * (row of y holding token t's copy for
    expert expert_ids[t, k])``, accumulated in float32, in y's dtype; dropped
    and invalid pairs contribute zero. Differentiable in ``y`` and ``weights``.

    Args:
      y: [R, F] the experts' outputs, one row per row of the dispatch's recv_x.
      handle: the ``MoeHandle`` of that dispatch (same ``axis_name``).
      weights: [T, K] routing weights of this rank's tokens (any float dtype).
      axis_name: the dispatch's axis.
      config: overrides of ``MoeConfig`` (advanced; NUM_PROGRAMS is the dispatch's).

    Returns:
      [T, F] in y's dtype.

    Example:
      >>> out = jaxtdist.moe_combine(jax.lax.ragged_dot(recv, w, sizes), handle, gate, "ep")
    """
    y, weights = jnp.asarray(y), jnp.asarray(weights)
    # Here, with the handle itself: _COMBINE's check sees only its arrays (not the
    # dispatch's axis_name).
    _check_combine(y, weights, handle, axis_name=axis_name)
    return _COMBINE(y, weights, handle.expert_ids, handle.src_pos, handle.src_tk,
                    handle.src_ranges, axis_name=axis_name, config=config,
                    **_combine_static(handle))


# -- pjit-style wrappers --------------------------------------------------------------
#
# Every array of the shard_map form is one rank's block of a global array sharded on
# its leading dim over rows_over(axis_name, batch_axes): the tokens (and fp8 scales),
# recv_x (and recv_scale), the group sizes and every array of the handle (one
# PartitionSpec is the prefix of the whole MoeHandle), so nothing moves in or out.
# The handle's two scalars (dropped, invalid) become blocks of one element: [G]
# arrays, G the devices of the rows axes.

def _row_groups(mesh, axis_name: str | tuple[str, ...],
                batch_axes: tuple[str, ...]) -> tuple[int, str]:
    """G, the devices sharding rows (batch axes times the expert axis), and words
    saying so for errors."""
    axes = tuple(batch_axes) + (axis_name if isinstance(axis_name, tuple) else (axis_name,))
    groups, sizes = mesh_devices(mesh, axes)
    return groups, f"the {groups} devices of the rows' mesh axes ({sizes})"


def _handle_blocks(handle: MoeHandle) -> MoeHandle:
    """The handle with its scalars as one-element blocks (the pjit-style layout)."""
    return dataclasses.replace(handle, dropped=handle.dropped[None], invalid=handle.invalid[None])


def _dispatch_per_rank(x, expert_ids, axis_name, *, num_experts, max_recv_rows=None,
                       zero_unused_rows=True, config=None):
    recv, sizes, handle = moe_dispatch(x, expert_ids, axis_name, num_experts=num_experts,
                                       max_recv_rows=max_recv_rows,
                                       zero_unused_rows=zero_unused_rows, config=config)
    return recv, sizes, _handle_blocks(handle)


def _dispatch_fp8_per_rank(x, expert_ids, x_scale, axis_name, *, num_experts,
                           max_recv_rows=None, zero_unused_rows=True, config=None):
    (recv, recv_scale), sizes, handle = moe_dispatch(
        x, expert_ids, axis_name, num_experts=num_experts, max_recv_rows=max_recv_rows,
        x_scale=x_scale, zero_unused_rows=zero_unused_rows, config=config)
    # recv_x first and on its own: the wrapper orders the next jaxtdist call after its
    # first result, which must be an array (not the pair); moe_dispatch_sharded pairs them.
    return recv, sizes, _handle_blocks(handle), recv_scale


def _combine_per_rank(y, handle, weights, axis_name, *, config=None):
    handle = dataclasses.replace(handle, dropped=handle.dropped[0], invalid=handle.invalid[0])
    return moe_combine(y, handle, weights, axis_name, config=config)


def _check_dispatch_sharded(x, expert_ids, x_scale=None, *, axis_name, batch_axes, mesh,
                            num_experts, max_recv_rows=None, zero_unused_rows=True,
                            config=None) -> None:
    # num_experts, max_recv_rows, zero_unused_rows, config, the dtypes and x_scale's
    # columns: checked per rank, as moe_dispatch's.
    del num_experts, max_recv_rows, zero_unused_rows, config
    name = "jaxtdist.moe_dispatch_sharded"
    groups, words = _row_groups(mesh, axis_name, batch_axes)
    if getattr(x, "ndim", None) != 2:
        raise ValueError(f"{name}: x must be the global tokens [W * T, H] (2-D), got shape "
                         f"{getattr(x, 'shape', None)}")
    if x.shape[0] % groups:
        raise ValueError(f"{name}: x has {x.shape[0]} rows, not a multiple of {words}; "
                         f"its rows are sharded over them (T = rows / {groups} per rank)")
    if getattr(expert_ids, "ndim", None) != 2 or expert_ids.shape[0] != x.shape[0]:
        raise ValueError(f"{name}: expert_ids must be [W * T, K] with as many rows as x "
                         f"({x.shape[0]}), got shape {getattr(expert_ids, 'shape', None)}")
    if x_scale is not None and (getattr(x_scale, "ndim", None) != 2
                                or x_scale.shape[0] != x.shape[0]):
        raise ValueError(f"{name}: x_scale must be [W * T, S] with as many rows as x "
                         f"({x.shape[0]}: one row of S scales per token, sharded like x), got "
                         f"shape {getattr(x_scale, 'shape', None)}")


def _check_combine_sharded(y, handle, weights, *, axis_name, batch_axes, mesh,
                           config=None) -> None:
    del config
    name = "jaxtdist.moe_combine_sharded"
    groups, words = _row_groups(mesh, axis_name, batch_axes)
    if not isinstance(handle, MoeHandle) or getattr(handle.dropped, "shape", None) != (groups,):
        got = (f"a MoeHandle whose dropped has shape {getattr(handle.dropped, 'shape', None)}"
               if isinstance(handle, MoeHandle) else type(handle).__name__)
        raise ValueError(f"{name}: handle must be the MoeHandle that moe_dispatch_sharded "
                         f"returned with the same axis_name {axis_name!r} and batch_axes "
                         f"{tuple(batch_axes)} (its dropped: one count per device of {words}: "
                         f"shape ({groups},)); got {got}")
    rows = groups * handle.max_recv_rows
    if getattr(y, "ndim", None) != 2 or y.shape[0] != rows:
        raise ValueError(f"{name}: y must be [G * R, F] = [{rows}, F]: one row per row of the "
                         f"dispatch's recv_x (G = {groups} devices, R = max_recv_rows = "
                         f"{handle.max_recv_rows} per device), got shape "
                         f"{getattr(y, 'shape', None)}")
    if getattr(weights, "shape", None) != tuple(handle.expert_ids.shape):
        raise ValueError(f"{name}: weights must be [W * T, K] = {tuple(handle.expert_ids.shape)} "
                         f"like the dispatch's expert_ids, got shape "
                         f"{getattr(weights, 'shape', None)}")


def _rows_spec(axis, batch):
    return jax.sharding.PartitionSpec(rows_over(axis, batch))


_dispatch_sharded = pjit_wrapper(
    _dispatch_per_rank, name="moe_dispatch_sharded",
    in_specs=lambda axis, batch: (_rows_spec(axis, batch),) * 2,
    out_specs=lambda axis, batch: (_rows_spec(axis, batch),) * 3,
    check=_check_dispatch_sharded)
# fp8: x_scale is a third array, sharded on rows like x; recv_scale a fourth result.
_dispatch_fp8_sharded = pjit_wrapper(
    _dispatch_fp8_per_rank, name="moe_dispatch_sharded",
    in_specs=lambda axis, batch: (_rows_spec(axis, batch),) * 3,
    out_specs=lambda axis, batch: (_rows_spec(axis, batch),) * 4,
    check=_check_dispatch_sharded)


def moe_dispatch_sharded(x: jax.Array, expert_ids: jax.Array, *,
                         axis_name: str | tuple[str, ...],
                         batch_axes: str | tuple[str, ...] = (), mesh=None, num_experts: int,
                         max_recv_rows: int | None = None, x_scale: jax.Array | None = None,
                         zero_unused_rows: bool = True,
                         config: dict | None = None) -> tuple[Any, jax.Array, MoeHandle]:
    """``moe_dispatch`` for pjit-style code: no hand-written ``shard_map``.

    Call it under ``jax.jit`` (or eagerly) on global arrays. The rows of ``x``
    and ``expert_ids`` are sharded over ``(*batch_axes, axis_name)``: G devices,
    each holding T = rows / G tokens; within each batch group the W ranks of
    ``axis_name`` exchange their tokens (rank r owns experts
    ``[r * E / W, (r + 1) * E / W)``, as in ``moe_dispatch``). Mesh axes not
    named are replicated. Ordered after the previous jaxtdist call and
    differentiable in ``x``, as ``moe_dispatch``.

    fp8: with ``x_scale``, x is fp8 (``float8_e4m3fn`` or ``float8_e5m2``) and
    each token's S float32 scales travel with its row, as in ``moe_dispatch``;
    ``x_scale`` is sharded on rows like x (device g gets the scales of its own
    tokens). Not differentiable (a ``TypeError`` says so).

    Every result is the shard_map form's per-device result, concatenated over
    the G devices on its leading dim and sharded there like ``x``: nothing
    moves, and one ``PartitionSpec`` shards the whole handle. The handle's
    scalars become one element per device:

    - ``recv_x`` [G * R, H]: device g's rows are ``[g * R, (g + 1) * R)``.
      With ``x_scale``: the pair ``(recv_x, recv_scale)``, recv_x [G * R, H]
      in x's fp8 dtype and recv_scale [G * R, S] float32, row for row (zeros
      past each device's received rows).
    - ``group_sizes`` [G * E / W] int32: device g's local experts' row counts
      (reshape to [G, E / W] to read them).
    - ``handle``: a ``MoeHandle`` for ``moe_combine_sharded``, arrays
      ``expert_ids`` [G * T, K] (the routing), ``recv_counts`` [G * W, E / W],
      ``src_pos`` / ``src_tk`` [G * W * T, min(K, E / W)], ``src_ranges``
      [G * W, P, NCH + 1], ``dropped`` and ``invalid`` [G] (each device's counts).
      Its static fields are the per-device ones (``max_recv_rows`` = R).

    Args:
      x: [G * T, H] the tokens (bfloat16, float16 or float32; fp8 with
        ``x_scale``).
      expert_ids: [G * T, K] int32 top-K routing, as for ``moe_dispatch``.
      axis_name: the expert-parallel mesh axis, or a tuple of axes taken as one
        group, outermost first (keyword).
      batch_axes: mesh axes that also shard the rows (data parallelism,
        outermost first); each of their groups has its own experts' copies.
      mesh: the mesh; defaults to the one given to ``jaxtdist.initialize``.
      num_experts: E, a multiple of W.
      max_recv_rows: R, ``recv_x``'s rows per device (static); default
        ``W * T * min(K, E / W)`` (nothing can be dropped).
      x_scale: [G * T, S] float32 (fp8 x only), rows sharded like x: token t's
        columns ``[j * H / S, (j + 1) * H / S)`` are scaled by ``x_scale[t, j]``
        (S = 1: per token; S = H / 128: per 128-column block).
      zero_unused_rows: as for ``moe_dispatch`` (False: each device's rows past
        its received ones are left unspecified).
      config: as for ``moe_dispatch``.

    Returns:
      (recv_x, group_sizes, handle), laid out as above; recv_x is the pair
      (recv_x, recv_scale) with ``x_scale``.

    Raises:
      ValueError: an axis not of the mesh or named twice, rows not a multiple
        of G, mismatched shapes (x_scale's rows not x's), or what
        ``moe_dispatch`` refuses (fp8 x without x_scale, x_scale with x not
        fp8, S not dividing H, x_scale not float32).

    Example:
      >>> # Auto axes: on Explicit ones (make_mesh's default) ragged_dot needs out_sharding=
      >>> mesh = jax.make_mesh((4,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,))
      >>> jaxtdist.initialize(mesh)
      >>> @jax.jit
      ... def layer(x, ids, gate, w):  # x, ids, gate: P("ep") rows; w [4, E / 4, H, F]: P("ep")
      ...     recv, sizes, handle = jaxtdist.moe_dispatch_sharded(
      ...         x, ids, axis_name="ep", num_experts=8)
      ...     y = jax.vmap(jax.lax.ragged_dot)(recv.reshape(4, -1, recv.shape[1]), w,
      ...                                      sizes.reshape(4, -1))
      ...     return jaxtdist.moe_combine_sharded(y.reshape(-1, y.shape[2]), handle, gate,
      ...                                         axis_name="ep")
      >>> # fp8: x_q [4 * T, H] float8_e4m3fn, x_s [4 * T, S] float32, both P("ep") rows
      >>> (recv_q, recv_s), sizes, handle = jaxtdist.moe_dispatch_sharded(
      ...     x_q, ids, axis_name="ep", num_experts=8, x_scale=x_s)
    """
    common = dict(axis_name=axis_name, batch_axes=batch_axes, mesh=mesh,
                  num_experts=num_experts, max_recv_rows=max_recv_rows,
                  zero_unused_rows=zero_unused_rows, config=config)
    if x_scale is None:
        return _dispatch_sharded(x, expert_ids, **common)
    recv, sizes, handle, recv_scale = _dispatch_fp8_sharded(x, expert_ids, x_scale, **common)
    return (recv, recv_scale), sizes, handle


moe_combine_sharded = pjit_wrapper(
    _combine_per_rank, name="moe_combine_sharded",
    in_specs=lambda axis, batch: (_rows_spec(axis, batch),) * 3,
    out_specs=_rows_spec,
    check=_check_combine_sharded)
moe_combine_sharded.__doc__ = """``moe_combine`` for pjit-style code: no hand-written ``shard_map``.

    ``out[t] = sum_k weights[t, k] * (row of y holding token t's copy for
    expert expert_ids[t, k])`` for every token t of the global array, each
    device combining its own tokens (as ``moe_combine``). Ordered after the
    previous jaxtdist call; differentiable in ``y`` and ``weights``.

    Args:
      y: [G * R, F] the experts' outputs, one row per row of the dispatch's
        ``recv_x``, sharded on rows like it.
      handle: the ``MoeHandle`` that ``moe_dispatch_sharded`` returned (same
        ``axis_name``, ``batch_axes`` and mesh).
      weights: [G * T, K] routing weights (any float dtype), sharded on rows.
      axis_name: the dispatch's axis (keyword).
      batch_axes: the dispatch's batch axes.
      mesh: the mesh; defaults to the one given to ``jaxtdist.initialize``.
      config: as for ``moe_combine``.

    Returns:
      [G * T, F] in y's dtype, rows sharded over ``(*batch_axes, axis_name)``.

    Raises:
      ValueError: an axis not of the mesh or named twice, a handle not made by
        ``moe_dispatch_sharded`` over the same axes, or mismatched shapes.

    Example:
      >>> recv, sizes, handle = jaxtdist.moe_dispatch_sharded(x, ids, axis_name="ep",
      ...                                                     num_experts=8)
      >>> out = jaxtdist.moe_combine_sharded(recv * 2.0, handle, gate, axis_name="ep")
    """
