"""The low-latency dispatch and combine kernels' launches (unchecked: the ops'
kernels, ``_ll``), their workspaces' byte layouts and the heap they need."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxtdist._errors import HeapExhaustedError
from jaxtdist.kernels.moe_ll import (moe_ll_combine_kernel, moe_ll_combine_send_kernel,
                                     moe_ll_dispatch_kernel)
from jaxtdist.ops._protocol import Call
from jaxtdist.ops._shapes import align, next_pow2
from jaxtdist.ops.moe._ll_config import resolved_ll
from jaxtdist.ops.moe._ll_handle import MoeLLHandle
from jaxtdist.ops.moe._routing import valid_pairs

__all__ = ["FP8_BLOCK", "LLCombineWorkspace", "LLDispatchWorkspace", "launch_combine_ll",
           "launch_dispatch_ll", "ll_heap_bytes"]

FP8_BLOCK = 128  # columns per scale of the FP8 dispatch (kernels/moe_ll.py's FP8_BLOCK)


def fp8_scales(hidden: int) -> int:
    """S: scales per token of the FP8 dispatch (1 x 128 blocks, the last one partial)."""
    return -(-hidden // FP8_BLOCK)


class LLDispatchWorkspace:
    """Byte layout of the dispatch workspace, per call parity: count box [E_LOC, W]
    int64 (tagged counts), tk box [E_LOC, W * M] int32, rows [E_LOC, W * M, H] of
    ``itemsize`` bytes, scales [E_LOC, W * M, S] float32 (S = 0 but with FP8).

    ``nbytes`` = 2 x (E_LOC W M (H itemsize + 4 + 4 S) + 8 E_LOC W), each part
    rounded up to 256 bytes: the bound on M (max_tokens_per_rank) for a heap."""

    def __init__(self, world: int, e_loc: int, m: int, hidden: int, itemsize: int,
                 scales: int):
        slots = e_loc * world * m
        self.cnt = 0
        self.tk = align(8 * e_loc * world)
        self.rows = self.tk + align(4 * slots)
        self.scales = self.rows + align(slots * hidden * itemsize)
        self.parity_bytes = self.scales + align(4 * slots * scales)
        self.nbytes = 2 * self.parity_bytes


class LLCombineWorkspace:
    """Byte layout of the combine workspace: flags [W, P] int32, then per call parity
    an inbox [T * K, F] of ``itemsize`` bytes (row t * K + k: pair (t, k)'s row)."""

    def __init__(self, world: int, tokens: int, top_k: int, cols: int, itemsize: int,
                 programs: int):
        self.flags = 0
        self.inbox = align(4 * world * programs)
        self.parity_bytes = align(tokens * top_k * cols * itemsize)
        self.nbytes = self.inbox + 2 * self.parity_bytes


def ll_heap_bytes(world: int, num_experts: int, max_tokens_per_rank: int, hidden: int,
                  itemsize: int, *, fp8: bool = False) -> int:
    """Heap bytes a ``moe_dispatch_ll`` workspace takes (each shape keeps its own):
    2 x E / W x W x M x (H x itemsize + 4 + 4 S) plus small words; FP8: itemsize 1
    and S = ceil(H / 128) scales. At E = 256, M = 128, H = 7168 that is 470 MB
    per parity in bfloat16 (whatever W), 242 MB in FP8."""
    return LLDispatchWorkspace(world, num_experts // world, max_tokens_per_rank, hidden,
                               1 if fp8 else itemsize,
                               fp8_scales(hidden) if fp8 else 0).nbytes


def _workspace(call: Call, op: str, what: str, nbytes: int, *key):
    """``call.workspace``, its HeapExhaustedError saying what the LL layout needs."""
    try:
        return call.workspace("push", nbytes, *key)
    except HeapExhaustedError as e:
        raise HeapExhaustedError(f"jaxtdist.{op}: {what} ({nbytes} bytes). {e}") from None


def launch_dispatch_ll(x, expert_ids, *, axis_name, num_experts: int,
                       max_tokens_per_rank: int | None = None, fp8: bool = False,
                       config: dict | None = None):
    """The dispatch kernel on checked arguments: (recv_x, recv_counts, handle); with
    ``fp8`` recv_x is the pair (bytes [E_LOC, W * M, H] uint8, scales [E_LOC, W * M,
    S] float32)."""
    call = Call("moe_dispatch_ll", axis_name)
    world = call.world
    (t, h), k = x.shape, expert_ids.shape[1]
    e_loc = num_experts // world
    m = max_tokens_per_rank or t
    cfg = resolved_ll(call, num_experts, h, x.dtype, config, axis_name)
    programs = max(1, min(cfg.NUM_PROGRAMS, num_experts))
    s = fp8_scales(h) if fp8 else 0
    row_type = jnp.dtype(jnp.uint8) if fp8 else jnp.dtype(x.dtype)
    plan = LLDispatchWorkspace(world, e_loc, m, h, row_type.itemsize, s)
    ws = _workspace(call, "moe_dispatch_ll",
                    f"its double-buffered inbox of E / W x W x M = {e_loc} x {world} x {m} "
                    f"rows of H = {h} {row_type.name} needs 2 x E / W x W x M x (H x "
                    f"{row_type.itemsize} + {4 + 4 * s}) bytes; lower max_tokens_per_rank or "
                    "raise heap_bytes", plan.nbytes, t, h, x.dtype.name, k, num_experts, m,
                    fp8)
    varying = set(call.result_axes(local=(x, expert_ids))) | set(call.layout.axes)
    i32 = jnp.int32
    recv, rscale, counts, src_tk = call.run(
        moe_ll_dispatch_kernel, x, expert_ids,
        out_shape=[jax.ShapeDtypeStruct((e_loc, world * m, h), row_type),
                   jax.ShapeDtypeStruct((e_loc, world * m, s) if fp8 else (1,), jnp.float32),
                   jax.ShapeDtypeStruct((e_loc, world), i32),
                   jax.ShapeDtypeStruct((e_loc, world * m), i32)],
        workspace=ws, grid=(programs,), num_warps=cfg.num_warps, num_stages=1,
        varying=tuple(a for a in call.rt.mesh.axis_names if a in varying),
        T=t, H=h, K=k, E_LOC=e_loc, W=world, M=m, P=programs, CNT_OFF=ws.offset + plan.cnt,
        TK_OFF=ws.offset + plan.tk, ROWS_OFF=ws.offset + plan.rows,
        SCALES_OFF=ws.offset + plan.scales, PARITY_BYTES=plan.parity_bytes, KP=next_pow2(k),
        WP=next_pow2(world), BT=min(next_pow2(t), 128), BLOCK_H=cfg.BLOCK_H, FP8=fp8, S=s,
        QP=min(FP8_BLOCK, next_pow2(h)), SP=next_pow2(max(s, 1)),
        EPPP=next_pow2(-(-num_experts // programs)))
    invalid = jnp.sum(~valid_pairs(expert_ids, num_experts)).astype(i32)
    handle = MoeLLHandle(expert_ids, counts, src_tk, invalid, num_experts=num_experts,
                         max_tokens_per_rank=m, axis_name=call.layout.axes)
    return ((recv, rscale) if fp8 else recv), counts, handle


def launch_combine_ll(y, weights, handle: MoeLLHandle, *, axis_name,
                      config: dict | None = None):
    """The combine's two kernels on checked arguments: out [T, F] in y's dtype."""
    call = Call("moe_combine_ll", axis_name)
    world = call.world
    t, k = handle.expert_ids.shape
    e_loc, _, f = y.shape
    cfg = resolved_ll(call, handle.num_experts, f, y.dtype, config, axis_name)
    programs = max(1, min(cfg.NUM_PROGRAMS, t))
    plan = LLCombineWorkspace(world, t, k, f, y.dtype.itemsize, programs)
    ws = _workspace(call, "moe_combine_ll",
                    f"its double-buffered inbox of T x K = {t} x {k} rows of F = {f} "
                    f"{jnp.dtype(y.dtype).name}", plan.nbytes, t, k, f, y.dtype.name, programs)
    kmask = valid_pairs(handle.expert_ids, handle.num_experts).astype(jnp.int32)
    varying = set(call.result_axes(local=(y, weights, handle.src_tk))) | set(call.layout.axes)
    varying = tuple(a for a in call.rt.mesh.axis_names if a in varying)
    ctx = call.start(ws, deps=(y, weights, kmask, handle.recv_counts, handle.src_tk),
                     align_launch=not call.launch_aligns((y,)))
    offsets = dict(INBOX_OFF=ws.offset + plan.inbox, PARITY_BYTES=plan.parity_bytes)
    done = call.launch(moe_ll_combine_send_kernel, ctx, y, handle.recv_counts, handle.src_tk,
                       out_shape=jax.ShapeDtypeStruct((1,), jnp.int32), grid=(programs,),
                       num_warps=cfg.num_warps, num_stages=1, varying=varying, T=t, F=f, K=k,
                       E_LOC=e_loc, W=world, M=handle.max_tokens_per_rank, P=programs,
                       WP=next_pow2(world), BLOCK_F=cfg.BLOCK_H, **offsets)
    # The sum runs after every send of this rank: it takes the send kernel's 0 in
    # its context (a data dependency XLA honours, as ``_inbox.push_to_inboxes``'s).
    return call.launch(moe_ll_combine_kernel, ctx + done[0], weights, kmask,
                       out_shape=jax.ShapeDtypeStruct((t, f), y.dtype), grid=(programs,),
                       num_warps=cfg.num_warps, num_stages=1, varying=varying, T=t, F=f, K=k,
                       P=programs, TP=-(-t // programs), FLAGS_OFF=ws.offset + plan.flags,
                       KP=next_pow2(k), BLOCK_F=cfg.BLOCK_H, **offsets)
