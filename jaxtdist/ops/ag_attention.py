"""jaxtdist.ag_attention: sequence-parallel attention, every rank's queries over every
rank's keys and values, the KV gather overlapped with the flash-attention tiles.

Shapes (``_check``), plan (``AgAttentionConfig``, ``StageWorkspace``), launch
(``_forward``, the fused backward's kernels too) and the local computation;
``DistributedOp`` supplies program order, autodiff and world 1 (cuDNN on GPUs
where it takes the case, ``_world_1_path``); ``pjit_wrapper`` the pjit-style
form. The kernels are ``kernels/ag_attention.py`` (forward),
``kernels/attention_ws.py`` (forward, one rank, Hopper) and
``kernels/attention_bwd.py`` (backward).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jaxtdist._errors import HeapExhaustedError
from jaxtdist.kernels import attention_bwd, attention_ws
from jaxtdist.kernels.ag_attention import ag_attention_kernel
from jaxtdist.ops._config import KernelConfig, Problem, STAGES, WARPS, block, resolve, setting
from jaxtdist.ops._cudnn import cudnn_refuses
from jaxtdist.ops._inbox import push_to_inboxes
from jaxtdist.ops._op import DistributedOp
from jaxtdist.ops._path import DECOMPOSED, FUSED, Choice, PathRule, Situation, situation_of
from jaxtdist.ops._precision import dot_precision
from jaxtdist.ops._protocol import Call, check_axis
from jaxtdist.ops._shapes import InboxWorkspace, align, check_dtype, next_pow2, static_bool
from jaxtdist.ops._sharded import pjit_wrapper, rows_over
from jaxtdist.runtime._runtime import runtime

__all__ = ["AgAttentionConfig", "ag_attention", "ag_attention_kernels", "ag_attention_sharded",
           "attention", "cudnn_refuses"]

_MAX_HEAD_DIM = 256
# 64-row query tiles below this many rounds of 128-row programs per SM. On 1 x H200
# (B=1, H=32, D=128, causal, bf16): 64 x 64 with 4 warps ran 340.6 us against
# 358.9 for 128 x 64 with 8 warps at S = 4096 (7.8 rounds), 4210.6 against 4201.6
# at S = 16384 (31 rounds); BLOCK_N = 128, 2 or 4 stages, and TMA loads were slower.
_MIN_WAVES = 16
# Causal program order with 64-row tiles (few rounds: the tail counts): 4 (batch,
# head) pairs' tiles interleaved, longest first. Same H200 problem at S = 4096:
# 312.4 us against 336.4 for each head's tiles alone (8 heads: 313.2; all heads:
# 317.5, K/V of every head in flight). 128-row tiles keep each head alone:
# 4 heads ran 1-2% slower at S = 16384 and 32768 (4229.7 / 4189.0, 16924 / 16579).
_HEAD_GROUP = 4
# The fused backward's shared memory per kernel: about 3 * (tile + step) rows of
# the padded head dim in flight; smaller steps, then tiles, where that passes the
# SM's (float32, head dim 256). Measured tiles: ``_backward_tiles``.
_BWD_SMEM = {"nvidia": 200 << 10, "amd": 60 << 10}


@dataclasses.dataclass(frozen=True)
class AgAttentionConfig(KernelConfig):
    """How ag_attention's kernel tiles one problem.

    Attributes:
      BLOCK_M: query rows per program (a power of 2, >= 16).
      BLOCK_N: keys per step of the online softmax (a power of 2, >= 16).
      num_warps, num_stages: launch options.
      GATHER: how peers' k and v are reached: "inbox" (pushed once into this
        rank's heap, by the copy engines on GPUs, and read locally), "peer"
        (every query tile reads peers' staged copies over the link: a quarter of
        the heap, link-bound at long sequences) or "auto" (inbox when it fits the
        heap, else peer).
      HEAD_GROUP: causal program order: the query tiles of HEAD_GROUP consecutive
        (batch, head) pairs launch interleaved, longest first. 1: each head's
        tiles together (K/V of few heads in flight, L2-friendly); B * Hq: every
        head's longest tiles first (the shortest tail).
      KERNEL: "auto" (the warp-specialized Gluon kernel where it fits, else the
        Triton kernel), "triton", or "ws" (the warp-specialized kernel, an error
        where it does not fit: NVIDIA Hopper, bfloat16 or float16, head dim 128,
        S a multiple of 128, and in a group of several ranks the inbox gather).
        The tile fields above configure the Triton kernel.
      BWD_BLOCK_Q, BWD_BLOCK_STEP: the fused backward's dq kernel: query rows per
        program and keys per step (powers of 2, 16 to 256).
      BWD_WARPS, BWD_STAGES: the dq kernel's launch options.
      BWD_BLOCK_KV, BWD_KV_STEP: its dk/dv kernel: keys per program and query
        rows per step (powers of 2, 16 to 256).
      BWD_KV_WARPS, BWD_KV_STAGES: the dk/dv kernel's launch options.
    """
    OP: ClassVar[str] = "ag_attention"
    variant: ClassVar[str] = "pull"

    BLOCK_M: int = block(128)
    BLOCK_N: int = block(64)
    num_warps: int = 8
    num_stages: int = 3
    GATHER: str = setting("auto", choices=("auto", "inbox", "peer"))
    HEAD_GROUP: int = setting(1)
    KERNEL: str = setting("auto", choices=("auto", "triton", "ws"))
    BWD_BLOCK_Q: int = setting(64, low=16, high=256, pow2=True)
    BWD_BLOCK_STEP: int = setting(64, low=16, high=256, pow2=True)
    BWD_WARPS: int = setting(4, **WARPS)
    BWD_STAGES: int = setting(2, **STAGES)
    BWD_BLOCK_KV: int = setting(64, low=16, high=256, pow2=True)
    BWD_KV_STEP: int = setting(64, low=16, high=256, pow2=True)
    BWD_KV_WARPS: int = setting(4, **WARPS)
    BWD_KV_STAGES: int = setting(2, **STAGES)

    @classmethod
    def default(cls, problem: Problem) -> "AgAttentionConfig":
        """The interpreter takes 16 x 16 tiles; GPUs 128 x 64 with 8 warps for head
        dims above 64, and 64 x 64 with 4 warps where 128-row programs would fill
        fewer than ``_MIN_WAVES`` rounds of the SMs (or a rank has fewer than 128
        rows): more, shorter programs balance the causal triangle's uneven ones.
        There, causal tiles of ``_HEAD_GROUP`` heads launch together, longest
        first."""
        b, s, hq, _, d = problem.shape
        if problem.platform != "gpu":
            return cls(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1, BWD_BLOCK_Q=16,
                       BWD_BLOCK_STEP=16, BWD_WARPS=4, BWD_STAGES=1, BWD_BLOCK_KV=16,
                       BWD_KV_STEP=16, BWD_KV_WARPS=4, BWD_KV_STAGES=1)
        backward = _backward_tiles(problem)
        if s < 128 or b * hq * -(-s // 128) < _MIN_WAVES * problem.sms:
            return cls(**_forward_tiles(problem, 64, 64, 3), num_warps=4,
                       HEAD_GROUP=_HEAD_GROUP, **backward)
        tiles = _forward_tiles(problem, 128, 64, 3)
        return cls(**tiles, num_warps=8 if d > 64 and tiles["BLOCK_M"] >= 64 else 4,
                   **backward)

    @classmethod
    def search_space(cls, problem: Problem) -> list[dict]:
        if problem.platform != "gpu":
            return cls.fitting(problem, [{}, dict(BLOCK_N=32)])
        return cls.fitting(problem, [{}] + [
            dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=st)
            for bm in (64, 128) for bn in (32, 64, 128) for w in (4, 8) for st in (2, 3, 4)])


def _forward_tiles(problem: Problem, block_m: int, block_n: int, stages: int) -> dict:
    """The forward kernel's tiles and stages, cut down until its shared memory
    fits NVIDIA's ``_BWD_SMEM``: ``stages`` k and v tiles and the query tile of
    the padded head dim, the query twice for float32 (its high and low TF32
    halves under "highest" precision). Compiled for sm_90 this is exact for
    16-bit types (128 KiB at 128 x 64, 3 stages, head dim 128) and float32's
    three TF32 products (256 KiB at 64 x 64, 3 stages, head dim 128: past the
    H100's 227). Fewer stages first (not below 2), then fewer query rows (not
    below 32), then fewer keys per step; 16-bit types at head dim 128 and below
    and float32 at 64 keep their measured defaults."""
    row = max(16, next_pow2(problem.shape[4])) * problem.itemsize
    q_tiles = 2 if problem.itemsize == 4 else 1

    def size(bm, bn, st):
        return (q_tiles * bm + 2 * st * bn) * row

    while problem.vendor == "nvidia" and size(block_m, block_n, stages) > _BWD_SMEM["nvidia"]:
        if stages > 2:
            stages -= 1
        elif block_m > 32:
            block_m //= 2
        elif block_n > 16:
            block_n //= 2
        elif stages > 1:
            stages -= 1
        else:
            break
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, num_stages=stages)


def _backward_tiles(problem: Problem) -> dict:
    """The fused backward's default tiles on GPUs (see ``_BWD_SMEM``): 64 x 64, 4
    warps, 2 stages; for rows of 512 bytes or more (the float32 accumulators spill
    otherwise) 32-position steps and 8 warps; on NVIDIA GPUs with shorter rows the
    dq kernel takes 128 x 64 tiles, 8 warps, 3 stages."""
    row = max(16, next_pow2(problem.shape[4])) * problem.itemsize
    limit = _BWD_SMEM.get(problem.vendor, _BWD_SMEM["amd"])
    tile, step = 64, 64 if row < 512 else 32
    while 3 * (tile + step) * row > limit and step > 16:
        step //= 2
    while 3 * (tile + step) * row > limit and tile > 16:
        tile //= 2
    warps = 8 if row >= 512 else 4
    tiles = dict(BWD_BLOCK_Q=tile, BWD_BLOCK_STEP=step, BWD_WARPS=warps, BWD_STAGES=2,
                 BWD_BLOCK_KV=tile, BWD_KV_STEP=step, BWD_KV_WARPS=warps, BWD_KV_STAGES=2)
    if problem.vendor == "nvidia" and row < 512:
        # dq: 128-row programs, 8 warps, 3 stages (160 KiB of shared memory at 256-byte
        # rows). Forward + backward on one H200 (B=1, H=32, D=128, causal, bf16):
        # 1.27x / 1.22x cuDNN's time at S = 4K / 16K, against 1.30x / 1.27x with
        # the dk/dv kernel's tiles; no other tile tried for dk/dv beat its default.
        tiles.update(BWD_BLOCK_Q=128, BWD_BLOCK_STEP=64, BWD_WARPS=8, BWD_STAGES=3)
    return tiles


class StageWorkspace:
    """Byte layout: W int32 ready flags, then two parities (``epoch % 2``) of this
    rank's staged k and v ([2, B, S, HKV, D]); a group of one rank stages nothing
    (no peer reads it: two parities took 1 GiB at S = 32K, H = 32, D = 128)."""

    def __init__(self, world: int, kv_elems: int, itemsize: int):
        self.ready = 0
        self.stage = align(4 * world)
        self.parity_bytes = align(2 * kv_elems * itemsize) if world > 1 else 0
        self.nbytes = self.stage + 2 * self.parity_bytes


# -- shapes ----------------------------------------------------------------------

def _check(q, k, v, *, axis_name, causal=True, config=None) -> None:
    del config
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"jaxtdist.ag_attention: expected q [B, S_shard, Hq, D] and k, v "
                         f"[B, S_shard, Hkv, D], got q{q.shape}, k{k.shape}, v{v.shape}")
    if k.shape != v.shape:
        raise ValueError(f"jaxtdist.ag_attention: k{k.shape} and v{v.shape} must have the "
                         "same shape")
    b, s, hq, d = q.shape
    if (k.shape[0], k.shape[1], k.shape[3]) != (b, s, d):
        raise ValueError(f"jaxtdist.ag_attention: q{q.shape} and k{k.shape} disagree on B, "
                         "S_shard or D (q [B, S_shard, Hq, D], k [B, S_shard, Hkv, D]: every "
                         "rank holds as many keys as queries)")
    if 0 in q.shape or 0 in k.shape:
        raise ValueError(f"jaxtdist.ag_attention: empty operand q{q.shape} k{k.shape}")
    if hq % k.shape[2]:
        raise ValueError(f"jaxtdist.ag_attention: Hq={hq} query heads must be a multiple of "
                         f"Hkv={k.shape[2]} KV heads (grouped-query attention)")
    if d > _MAX_HEAD_DIM:
        raise ValueError(f"jaxtdist.ag_attention: head dim D={d}; at most {_MAX_HEAD_DIM} is "
                         "supported")
    check_dtype("ag_attention", "q", q.dtype)
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"jaxtdist.ag_attention: q, k and v must share a dtype, got "
                         f"{q.dtype.name}, {k.dtype.name} and {v.dtype.name}")
    check_axis(runtime(), axis_name, "ag_attention")


# -- launch ----------------------------------------------------------------------

def _resolved(call: Call, q, k, config, axis_name) -> tuple[Problem, AgAttentionConfig]:
    """The call's problem and the config its kernel takes (``config`` over the
    defaults, or the tuned entry)."""
    (b, s, hq, d), hkv = q.shape, k.shape[2]
    problem = Problem(call.platform, call.world, (b, s, hq, hkv, d), jnp.dtype(q.dtype).name,
                      call.rt.sms)
    return problem, resolve(AgAttentionConfig, problem, call.rt, config, axis_name=axis_name)


def ag_attention_kernels(q: jax.Array, k: jax.Array, v: jax.Array, axis_name, *,
                         causal: bool = True, config: dict | None = None) -> jax.Array:
    """ag_attention's forward kernel, at world 1 too (for benchmarks and tests); not
    differentiable. ``config`` overrides the defaults (``AgAttentionConfig``)."""
    return _AG_ATTENTION.kernels(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                                 axis_name=axis_name,
                                 causal=static_bool("ag_attention", "causal", causal),
                                 config=config)


def _forward_kernels(q, k, v, axis_name, *, causal: bool,
                     config: dict | None) -> tuple[jax.Array, jax.Array]:
    """The forward kernel's output and its rows' base-2 log-sum-exp (float32
    [B * Hq, S_shard], for the backward)."""
    call = Call("ag_attention", axis_name)
    b, s, hq, d = q.shape
    hkv = k.shape[2]
    problem, cfg = _resolved(call, q, k, config, axis_name)
    kv_elems = b * s * hkv * d
    tiles = dict(**cfg.launch_options(), B=b, S=s, HQ=hq, HKV=hkv, D=d, CAUSAL=causal,
                 QK_SCALE=float(math.log2(math.e) / math.sqrt(d)), KV_ELEMS=kv_elems,
                 BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_D=max(16, next_pow2(d)),
                 DOT_PRECISION=dot_precision(q.dtype, call.platform, problem.vendor),
                 HEAD_GROUP=min(int(cfg.HEAD_GROUP), b * hq))
    grid = (b * hq * -(-s // cfg.BLOCK_M),)
    out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype),
                 jax.ShapeDtypeStruct((b * hq, s), jnp.float32)]
    varying = call.result_axes(local=(q, k, v))
    # Inboxes need a bulk push that overlaps the kernel (copy engines, both GPU
    # layouts) or the interpreter; a GPU backend without them reads peers.
    inbox_ok = call.rt.backend.has_copy_engines or call.platform != "gpu"
    if cfg.GATHER == "inbox" and not inbox_ok:
        raise ValueError("jaxtdist.ag_attention: config GATHER='inbox' needs copy-engine "
                         "pushes, which this heap backend lacks; use 'auto' or 'peer'")
    warp_specialized = False
    if cfg.KERNEL != "triton":
        unfit = _ws_unfit(call, q, cfg.GATHER, inbox_ok)
        if unfit and cfg.KERNEL == "ws":
            raise ValueError(f"jaxtdist.ag_attention: config KERNEL='ws' (the warp-specialized "
                             f"kernel) cannot run this call: {unfit}; use 'auto' or 'triton'")
        warp_specialized = not unfit
    if warp_specialized and call.world == 1:
        return _launch_ws(call, q, k, v, causal, tiles["QK_SCALE"], out_shape, varying)
    if cfg.GATHER != "peer" and inbox_ok and call.world > 1:
        try:
            return _launch_inbox(call, q, k, v, tiles, grid, out_shape, varying,
                                 warp_specialized)
        except HeapExhaustedError as err:
            if cfg.GATHER == "inbox" or cfg.KERNEL == "ws":
                raise
            warnings.warn(f"jaxtdist.ag_attention: the KV inboxes do not fit the heap ({err}); "
                          "every query tile reads peers' k and v over the link instead, "
                          "which is much slower at long sequences. Raise "
                          "jaxtdist.initialize(mesh, heap_bytes=...) to at least 4 * world * "
                          "B * S_shard * Hkv * D * itemsize plus the other ops' workspaces.",
                          RuntimeWarning, stacklevel=2)
    plan = StageWorkspace(call.world, kv_elems, q.dtype.itemsize)
    ws = call.workspace("stage", plan.nbytes, kv_elems, q.dtype.name)
    staging = {}
    if plan.parity_bytes:
        # The prologue copies k and v into this rank's heap (parity e % 2) before
        # the kernel: peers read them from there.
        staged = jnp.concatenate([k.reshape(-1), v.reshape(-1)])
        staging = dict(deps=(q, k, v, staged), stage=staged,
                       stage_offset=ws.offset + plan.stage, parity_bytes=plan.parity_bytes)
    return call.run(
        ag_attention_kernel, q, k, v, workspace=ws, **staging,
        out_shape=out_shape, grid=grid, varying=varying, **tiles, INBOX=False,
        STAGE_OFF=ws.offset + plan.stage, PARITY_BYTES=plan.parity_bytes,
        READY_OFF=ws.offset + plan.ready, FLAGS_OFF=0, SENT_OFF=0, CHUNK_ROWS=1,
        KV_STRIDE=hkv * d, V_OFF=0, FLAG_SCOPE="sys")


_WS_BLOCK = int(attention_ws.BLOCK.value)
_WS_HEAD_DIM = int(attention_ws.HEAD_DIM.value)
_MAX_GRID_Y = 65535  # CUDA's limit on a grid's second dimension


def _ws_unfit(call: Call, q, gather: str, inbox_ok: bool) -> str:
    """Why the warp-specialized kernel cannot run this call ("" where it can)."""
    b, s, hq, d = q.shape
    if call.platform != "gpu":
        return "it runs on NVIDIA GPUs, not under the interpreter"
    device = call.rt.mesh.devices.flat[call.rt.local_positions[0]]
    if str(getattr(device, "compute_capability", "")) != "9.0":
        return (f"it runs on Hopper GPUs (compute capability 9.0), not on "
                f"{device.device_kind}")
    if call.world > 1 and (gather == "peer" or not inbox_ok):
        return ("in a group of several ranks it reads peers' keys from the heap inbox, "
                + ("and config GATHER='peer'" if gather == "peer"
                   else "which needs copy-engine pushes that this heap backend lacks"))
    if q.dtype not in (jnp.bfloat16, jnp.float16):
        return f"it takes bfloat16 or float16, not {q.dtype}"
    if d != _WS_HEAD_DIM:
        return f"it takes head dim {_WS_HEAD_DIM}, not {d}"
    if s % _WS_BLOCK:
        return f"it takes S a multiple of {_WS_BLOCK}, not {s}"
    if b * hq > _MAX_GRID_Y:
        return f"its grid takes B * Hq up to {_MAX_GRID_Y}, not {b * hq}"
    return ""


def _launch_ws(call: Call, q, k, v, causal: bool, qk_scale: float, out_shape, varying):
    """The warp-specialized Gluon kernel (``kernels/attention_ws``): one rank's
    attention, TMA loads into shared memory (descriptors in Triton's global
    scratch, which jaxtdist's launcher provides)."""
    d = q.shape[3]
    ws = call.workspace("ws", 64)  # the prologue's; the kernel reads no heap
    return call.run(attention_ws.attention_ws_kernel, q, k, v, workspace=ws,
                    out_shape=out_shape, varying=varying,
                    **_ws_launch(q, k.shape[2], causal, qk_scale),
                    KV_STRIDE=k.shape[2] * d, V_OFF=0, INBOX=False, STAGE_OFF=0,
                    PARITY_BYTES=0, FLAGS_OFF=0, SENT_OFF=0)


def _ws_launch(q, hkv: int, causal: bool, qk_scale: float) -> dict:
    """The warp-specialized kernel's grid, launch options and shape constants."""
    b, s, hq, d = q.shape
    return dict(grid=(s // _WS_BLOCK, b * hq), num_warps=4, num_stages=1, needs_scratch=True,
                maxnreg=attention_ws.MAX_REGISTERS, B=b, S=s, HQ=hq, HKV=hkv, D=d,
                CAUSAL=causal, QK_SCALE=qk_scale)


def _launch_inbox(call: Call, q, k, v, tiles: dict, grid, out_shape, varying,
                  warp_specialized: bool):
    """k and v pushed once into every peer's heap inbox (the copy engines, one chunk
    flag per (rank, batch); under the interpreter an SM push kernel before the
    attention kernel, 16-row chunks); the tiles read peers' chunks locally, in the
    warp-specialized kernel (copy engines only) or the Triton kernel."""
    b, s, hkv, d = k.shape
    ce = call.rt.backend.has_copy_engines
    chunk_rows = s if ce else 16  # the SM push copies pow-2 row blocks
    # One row per position: k's columns, then v's.
    kv = jnp.concatenate([k.reshape(b * s, hkv * d), v.reshape(b * s, hkv * d)], axis=1)
    plan = InboxWorkspace(call.world, b * s, 2 * hkv * d, k.dtype, chunk_rows)
    ws = call.workspace("inbox", plan.nbytes, b, s, hkv * d, k.dtype.name, chunk_rows)
    offsets = dict(STAGE_OFF=ws.offset + plan.inbox, PARITY_BYTES=plan.parity_bytes,
                   FLAGS_OFF=ws.offset + plan.flags, SENT_OFF=ws.offset + plan.sent)
    ctx = call.start(ws, deps=(q, k, v, kv), align_launch=False)
    ctx = push_to_inboxes(call, ctx, kv, inbox_offset=offsets["STAGE_OFF"],
                          parity_bytes=offsets["PARITY_BYTES"], flags_offset=offsets["FLAGS_OFF"],
                          sent_offset=offsets["SENT_OFF"], chunk_rows=chunk_rows,
                          copy_block_c=min(256, next_pow2(2 * hkv * d)))
    scope = "gpu" if ce else "sys"  # copy engines' flags are read on the GPU they land on
    # The kernel reads its own chunk from kv, not k and v: kv must stay alive until
    # the copy engines have read it, and XLA keeps only a kernel's operands alive
    # (as the ce push's alone, its buffer could become the kernel's output while
    # peers were still being sent it).
    if warp_specialized:
        return call.launch(attention_ws.attention_ws_kernel, ctx, q, kv, kv,
                           out_shape=out_shape, varying=varying,
                           **_ws_launch(q, hkv, tiles["CAUSAL"], tiles["QK_SCALE"]),
                           KV_STRIDE=2 * hkv * d, V_OFF=hkv * d, INBOX=True,
                           STAGE_OFF=offsets["STAGE_OFF"], PARITY_BYTES=offsets["PARITY_BYTES"],
                           FLAGS_OFF=offsets["FLAGS_OFF"], SENT_OFF=offsets["SENT_OFF"])
    return call.launch(ag_attention_kernel, ctx, q, kv, kv, out_shape=out_shape, grid=grid,
                       varying=varying, **tiles, INBOX=True, READY_OFF=0,
                       CHUNK_ROWS=chunk_rows, KV_STRIDE=2 * hkv * d, V_OFF=hkv * d,
                       FLAG_SCOPE=scope, **offsets)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = True,
              q_offset: int | jax.Array = 0) -> jax.Array:
    """Attention of queries at global positions [q_offset, q_offset + S_q) over keys
    at [0, S_k), in plain JAX (float32 softmax), GQA by repeating KV heads.

    q [B, S_q, Hq, D], k, v [B, S_k, Hkv, D] -> [B, S_q, Hq, D] in q's dtype.
    ag_attention's backward differentiates it on the gathered keys.
    """
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    qg = q.reshape(b, sq, hkv, hq // hkv, d).astype(jnp.float32)
    scores = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k.astype(jnp.float32),
                        precision=jax.lax.Precision.HIGHEST) / np.float32(math.sqrt(d))
    if causal:
        seen = (q_offset + jnp.arange(sq))[:, None] >= jnp.arange(sk)[None, :]
        scores = jnp.where(seen, scores, -jnp.inf)
    p = jax.nn.softmax(scores, axis=-1)
    o = jnp.einsum("bhgqk,bkhd->bqhgd", p, v.astype(jnp.float32),
                   precision=jax.lax.Precision.HIGHEST)
    return o.reshape(b, sq, hq, d).astype(q.dtype)


def _forward(q, k, v, *saved, axis_name, causal=True, config=None, fused_backward=False):
    """The forward kernel's output, with the backward's residuals; with
    ``fused_backward`` (the op's backward pass, ``saved`` = its (out, lse, dout)),
    the fused backward kernels' float32 (dq, dk, dv), no residuals."""
    if fused_backward:
        return _launch_backward(q, k, v, *saved, axis_name=axis_name, causal=causal,
                                config=config)
    out, lse = _forward_kernels(q, k, v, axis_name, causal=causal, config=config)
    return out, (q, k, v, out, lse)


def _backward(residuals, dout, *, axis_name, causal=True, config=None):
    q, k, v, out, lse = residuals
    world = check_axis(runtime(), axis_name, "ag_attention").world
    if world > 1:
        # Every rank's keys and values through XLA; the queries' gradients over
        # them fused (``_forward``'s ``fused_backward``); the keys' and values'
        # cotangents summed back to their owners.
        k = jax.lax.all_gather(k, axis_name, axis=1, tiled=True)
        v = jax.lax.all_gather(v, axis_name, axis=1, tiled=True)
    # An unchecked launch of this op's kernels, ordered and batched as its calls are.
    dq, dk, dv = _AG_ATTENTION.launch(q, k, v, out, lse, dout.astype(q.dtype),
                                      axis_name=axis_name, causal=causal, config=config,
                                      fused_backward=True)
    if world > 1:
        dk, dv = (jax.lax.psum_scatter(a, axis_name, scatter_dimension=1, tiled=True)
                  for a in (dk, dv))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def _launch_backward(q, k, v, out, lse, dout, *, axis_name, causal=True, config=None):
    """The fused backward (``kernels/attention_bwd``) of this rank's queries over keys
    and values [B, S_k, Hkv, D] (every rank's, in order), from the forward's output
    and row log-sum-exps ``lse``: float32 (dq, dk, dv), no residuals."""
    call = Call("ag_attention", axis_name)
    problem, cfg = _resolved(call, q, k, config, axis_name)
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    shared = dict(SQ=sq, SK=sk, HQ=hq, HKV=hkv, D=d, CAUSAL=causal,
                  QK_SCALE=float(math.log2(math.e) / math.sqrt(d)),
                  SM_SCALE=float(1 / math.sqrt(d)), BLOCK_D=max(16, next_pow2(d)),
                  DOT_PRECISION=dot_precision(q.dtype, call.platform, problem.vendor))
    varying = call.result_axes(local=(q, k, v, out, dout))
    ctx = call.start(call.workspace("bwd", 64), deps=(q, k, v, out, lse, dout))  # no heap read
    f32 = jnp.float32
    tile = int(cfg.BWD_BLOCK_Q)
    dq, delta = call.launch(
        attention_bwd.attention_bwd_dq_kernel, ctx, q, k, v, out, dout, lse,
        out_shape=[jax.ShapeDtypeStruct(q.shape, f32), jax.ShapeDtypeStruct((b * hq, sq), f32)],
        grid=(b * hq * -(-sq // tile),), varying=varying, num_warps=int(cfg.BWD_WARPS),
        num_stages=int(cfg.BWD_STAGES), BLOCK_M=tile, BLOCK_N=int(cfg.BWD_BLOCK_STEP),
        **shared)
    tile = int(cfg.BWD_BLOCK_KV)
    dk, dv = call.launch(
        attention_bwd.attention_bwd_dkdv_kernel, ctx, q, k, v, dout, lse, delta,
        out_shape=[jax.ShapeDtypeStruct(k.shape, f32)] * 2,
        grid=(b * hkv * -(-sk // tile),), varying=varying, num_warps=int(cfg.BWD_KV_WARPS),
        num_stages=int(cfg.BWD_KV_STAGES), BLOCK_M=int(cfg.BWD_KV_STEP), BLOCK_N=tile,
        **shared)
    return (dq, dk, dv), None


def _world_1_path(situation: Situation, q, k, v, *, causal=True, config=None) -> Choice | None:
    """On a GPU at world 1: cuDNN where it takes the case (forward and its own
    backward), else the kernels; elsewhere the mechanism's default (the local
    computation under the interpreter, the kernels at world > 1)."""
    del k, v, config
    if situation.world != 1 or situation.platform != "gpu":
        return None
    why = cudnn_refuses(situation.platform, situation.compute_capability, q.dtype, q.shape[3])
    inputs = dict(dtype=jnp.dtype(q.dtype).name, head_dim=q.shape[3], causal=causal,
                  compute_capability=situation.compute_capability)
    if why:
        return Choice("", FUSED, "jaxtdist's kernels", f"cuDNN does not take the case: {why}",
                      inputs)
    return Choice("", DECOMPOSED, _CUDNN_RUNS, "cuDNN takes the case (" + ", ".join(
        f"{k}={v}" for k, v in inputs.items()) + "); its forward and backward run", inputs)


_CUDNN_RUNS = "cuDNN flash attention (jax.nn.dot_product_attention, implementation='cudnn')"


def _local(q, k, v, *, axis_name, causal=True, config=None):
    del axis_name, config
    rt = runtime()
    if rt.platform == "gpu":
        situation = situation_of(rt, 1)
        take = not cudnn_refuses("gpu", situation.compute_capability, q.dtype, q.shape[3])
        # Where cuDNN refuses, only config PATH='decomposed' gets here: XLA's attention.
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                            implementation="cudnn" if take else None)
    if q.dtype == jnp.float16:
        # XLA's CPU dot refuses float16 operands with a float32 result (what
        # dot_product_attention asks for): attend in float32, round once.
        f32 = [a.astype(jnp.float32) for a in (q, k, v)]
        return jax.nn.dot_product_attention(*f32, is_causal=causal).astype(q.dtype)
    return jax.nn.dot_product_attention(q, k, v, is_causal=causal)


def _check_config(q, k, v, *, axis_name, causal=True, config):
    del v, causal
    _resolved(Call("ag_attention", axis_name), q, k, config, axis_name)


# A group of one rank on GPUs runs cuDNN where it takes the case (``_world_1_path``),
# else the kernels: JAX's dot_product_attention takes XLA's unfused attention by
# default (2903 us against the warp-specialized kernel's 273.5 on one H200 at
# S = 4096, H = 32, D = 128, causal, bf16) and keeps [S, S] scores for its
# backward. Under the Triton interpreter the local computation stays.
_AG_ATTENTION = DistributedOp("ag_attention", forward=_forward, backward=_backward,
                              check=_check, local=_local, local_at_world_1="interpreter",
                              check_config=_check_config,
                              path=PathRule(_world_1_path, config_type=AgAttentionConfig,
                                            shape=lambda q, k, *_: (*q.shape[:3], k.shape[2],
                                                                    q.shape[3])))


def ag_attention(q: jax.Array, k: jax.Array, v: jax.Array, axis_name, *, causal: bool = True,
                 config: dict | None = None) -> jax.Array:
    """Attention of this rank's queries over every rank's keys and values, the gather
    overlapped with the flash-attention tiles.

    Call inside ``jax.shard_map`` over the mesh given to ``jaxtdist.initialize``.
    q, k, v are sharded on the sequence over ``axis_name``: rank r holds global
    positions [r * S_shard, (r + 1) * S_shard). One launch: each rank's k and v
    are pushed into every peer's heap inbox (the copy engines on GPUs; where the
    inboxes do not fit, staged in its own heap and read over NVLink); every
    program starts on its own chunk's tiles at once and on each peer's chunk as
    soon as it has arrived; under causal masking, chunks of later ranks are never
    read. On Hopper GPUs (bf16/f16, head dim 128, S_shard a multiple of 128) the
    kernel is a warp-specialized one, elsewhere a Triton flash kernel.
    Differentiable: the backward gathers k and v through XLA
    (``all_gather``), runs a fused flash-attention backward (two Triton
    kernels; no [S_shard, S] score matrix in memory; the forward keeps each
    row's log-sum-exp) and sums dk and dv back to their owners
    (``psum_scatter``). A group of one rank runs cuDNN's flash attention on
    GPUs where cuDNN takes the case (``cudnn_refuses``: bfloat16 or float16,
    head dims it supports; differentiated by cuDNN's own backward), else the
    kernels, and ``jax.nn.dot_product_attention`` under the interpreter
    (``jaxtdist.explain`` says which; ``config={"PATH": "fused"}`` forces the
    kernels). float32 inputs
    follow ``jax.default_matmul_precision`` like XLA's dots on GPUs: TF32
    tensor cores by default, float32 accuracy under ``"highest"``. A NaN or inf
    in a value a query sees reaches its output; under causal masking one in a
    later position's value can also reach the earlier queries of its tile (the
    tile's masked weights are zeros, and 0 * NaN is NaN), as in other flash
    kernels; XLA's unfused attention spreads it to every query. In the
    backward, a NaN or inf in the cotangent reaches dk and dv of every key of
    its KV head, seen or not (masked weights again).

    Args:
      q: [B, S_shard, Hq, D], this rank's queries.
      k, v: [B, S_shard, Hkv, D], this rank's keys and values; Hq a multiple of Hkv.
      axis_name: mesh axis (or tuple of axes) the sequence is sharded over.
      causal: mask keys after each query's global position.
      config: overrides of the kernel config (``AgAttentionConfig`` keys; advanced).

    Returns:
      [B, S_shard, Hq, D] in q's dtype: this rank's queries' attention output.

    Example:
      >>> mesh = jax.make_mesh((4,), ("sp",)); jaxtdist.initialize(mesh)
      >>> spec = P(None, "sp")
      >>> f = jax.jit(jax.shard_map(lambda q, k, v: jaxtdist.ag_attention(q, k, v, "sp"),
      ...             mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec))
    """
    return _AG_ATTENTION(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), axis_name=axis_name,
                         causal=static_bool("ag_attention", "causal", causal), config=config)


ag_attention_sharded = pjit_wrapper(
    ag_attention, name="ag_attention_sharded",
    in_specs=lambda axis, batch: (jax.sharding.PartitionSpec(rows_over(None, batch), axis),) * 3,
    out_specs=lambda axis, batch: jax.sharding.PartitionSpec(rows_over(None, batch), axis))
ag_attention_sharded.__doc__ = """``ag_attention`` for pjit-style code: no hand-written ``shard_map``.

    q, k, v [B, S, H, D] have their batch sharded over ``batch_axes`` and their
    sequence over ``axis_name``; the result is sharded like q.

    Args:
      q, k, v: the global arrays.
      axis_name: the mesh axis the sequence is sharded over (keyword).
      batch_axes: mesh axes that shard the batch, outermost first.
      mesh: the mesh; defaults to the one given to ``jaxtdist.initialize``.
      causal, config: as for ``ag_attention``.
    """
