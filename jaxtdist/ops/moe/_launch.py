"""The dispatch and combine kernels' launches at any world, unchecked (the ops'
kernels: ``_ops``), and their workspaces' byte layouts."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxtdist.kernels.moe import TRACE_PHASES, moe_combine_kernel, moe_dispatch_kernel
from jaxtdist.ops._protocol import Call
from jaxtdist.ops._shapes import align, next_pow2
from jaxtdist.ops.moe._checks import default_recv_rows
from jaxtdist.ops.moe._config import chunk_size, resolved
from jaxtdist.ops.moe._handle import MoeHandle
from jaxtdist.ops.moe._routing import (META_FIELDS, route, route_scan_tokens,
                                       route_tokens_per_step, valid_pairs)

__all__ = ["CombineWorkspace", "DispatchWorkspace", "launch_combine", "launch_dispatch", "summary"]


class DispatchWorkspace:
    """Byte layout of the dispatch workspace: flags [W, P, NCH] int32 (NCH chunks
    per program), then per call parity: headers [W, E_LOC + P (NCH + 1) + 1]
    int32, meta rows [W, T, 1 + 4 KL] int32, rows [W, T, H]; last, this rank's
    scratch for the fused routing's words (``kernels/moe.py``, ROUTE: slot [T,
    W], meta [T, W, 1 + 4 KL], dcounts [P, W * E_LOC], bounds [P, W, 3] int32;
    written and read by one kernel)."""

    def __init__(self, world, tokens, hidden, itemsize, e_loc, kl, programs, chunks):
        self.hdr_words = e_loc + programs * (chunks + 1) + 1
        self.meta_words = 1 + META_FIELDS * kl
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


def summary(recv_counts: jax.Array, rows: int) -> tuple[jax.Array, jax.Array]:
    """group_sizes [E_LOC] (rows kept per local expert) and the rows dropped."""
    tot = jnp.sum(recv_counts, axis=0)
    kept = jnp.minimum(jnp.cumsum(tot), rows)
    sizes = jnp.diff(jnp.concatenate([jnp.zeros((1,), kept.dtype), kept]))
    dropped = jnp.sum(tot) - kept[-1]
    return sizes.astype(jnp.int32), dropped.astype(jnp.int32)


def launch_dispatch(x, expert_ids, scale=None, *, axis_name, num_experts: int,
                    max_recv_rows: int | None = None, split: int = 0,
                    zero_unused_rows: bool = True, config: dict | None = None,
                    trace: bool = False):
    """The dispatch kernel on checked arguments: (recv_x, group_sizes, handle), and
    the timestamps with ``trace`` (``moe_dispatch_kernels`` says what each is)."""
    call = Call("moe_dispatch", axis_name)
    world = call.world
    (t, h), k = x.shape, expert_ids.shape[1]
    e_loc = num_experts // world
    kl = min(k, e_loc)
    rows = max_recv_rows or default_recv_rows(t, k, world, num_experts)
    cfg = resolved(call, t, h, x.dtype, config, axis_name)
    programs = min(cfg.NUM_PROGRAMS, t)
    per_program = -(-t // programs)
    chunks = -(-per_program // min(cfg.CHUNK_TOKENS or per_program, per_program))
    # The same number of chunks, as even as it gets: the combine, which sends and
    # sums by the dispatch's chunks, finds their size from their count (src_ranges).
    chunk = chunk_size(per_program, chunks)
    plan = DispatchWorkspace(world, t, h, x.dtype.itemsize, e_loc, kl, programs, chunks)
    # The layout depends on all of these: other shapes get their own workspace.
    ws = call.workspace("push", plan.nbytes, t, h, x.dtype.name, k, num_experts, programs,
                        chunks)
    varying = set(call.result_axes(local=(x, expert_ids))) | set(call.layout.axes)
    i32 = jnp.int32
    factors = (jnp.ones((t, k), jnp.float32) if scale is None
               else scale.astype(jnp.float32))
    ids = expert_ids.astype(i32)
    fused = cfg.ROUTING == "fused"
    if fused:  # the dispatch kernel computes the words itself: unused inputs
        invalid, words = None, (jnp.zeros((1,), i32),) * 4
    else:
        invalid, words = route(expert_ids, world, num_experts, programs, factors)
    # With split, the rows' first columns and the rest land in two arrays; without,
    # the last output is a one-element placeholder the kernel never writes (as is
    # fused_invalid without the fused routing).
    recv, counts, spos, stk, ranges, tail, stamps, fused_invalid = call.run(
        moe_dispatch_kernel, x, *words, ids, factors,
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
        EPG=next_pow2(num_experts), BT=route_tokens_per_step(-(-t // programs), k, num_experts),
        BS=route_scan_tokens(t, k), ZERO_TAIL=zero_unused_rows, CT=chunk, NCH=chunks)
    if split:
        recv = (recv, tail)
    sizes, dropped = summary(counts, rows)
    handle = MoeHandle(expert_ids, counts, spos, stk, ranges, dropped,
                       fused_invalid[0] if fused else invalid,
                       num_experts=num_experts, max_recv_rows=rows, programs=programs,
                       axis_name=call.layout.axes)
    return (recv, sizes, handle, stamps) if trace else (recv, sizes, handle)


def _trace_shape(trace: bool, programs: int) -> jax.ShapeDtypeStruct:
    """The kernels' timestamps output: [P, TRACE_PHASES] int32 with ``trace``,
    else a one-element placeholder the kernel never writes."""
    return jax.ShapeDtypeStruct((programs, TRACE_PHASES.value) if trace else (1,), jnp.int32)


def launch_combine(y, weights, handle: MoeHandle, cotangent=None, *, axis_name,
                   config: dict | None = None, trace: bool = False):
    """The combine kernel on checked arguments: out, (out, dots) with ``cotangent``,
    and the timestamps last with ``trace`` (``moe_combine_kernels`` says what each is)."""
    call = Call("moe_combine", axis_name)
    world = call.world
    t, k = handle.expert_ids.shape
    f = y.shape[1]
    programs = handle.programs
    kl = handle.src_pos.shape[1]
    cfg = resolved(call, t, f, y.dtype, config, axis_name)
    per_program = -(-t // programs)
    chunks = handle.src_ranges.shape[2] - 1  # the dispatch's
    plan = CombineWorkspace(world, t, k, f, y.dtype.itemsize, programs, chunks)
    ws = call.workspace("push", plan.nbytes, t, k, f, y.dtype.name, programs, chunks)
    kmask = valid_pairs(handle.expert_ids, handle.num_experts).astype(jnp.int32)
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
        TRACE=trace, CT=chunk_size(per_program, chunks), NCH=chunks)
    out, dots_out, stamps = outs
    result = ((out, dots_out) if dots else (out,)) + ((stamps,) if trace else ())
    return result if len(result) > 1 else out
