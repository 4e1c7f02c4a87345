"""jaxtdist.ag_matmul: all_gather(x) @ w, the gather overlapped with the GEMM."""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from jaxtdist.kernels.ag_matmul import (ag_matmul_ce_kernel, ag_matmul_kernel,
                                        ag_matmul_tma_kernel, push_shards_kernel)
from jaxtdist.ops import _call
from jaxtdist.runtime import _ffi
from jaxtdist.ops._shapes import (GatherWorkspace, InboxWorkspace, SplitKWorkspace,
                                  StreamKWorkspace, check_dtype, next_pow2)
from jaxtdist._errors import HeapExhaustedError
from jaxtdist.runtime import _native
from jaxtdist.runtime._runtime import runtime


def default_config(platform: str, world: int, m_shard: int, n: int, k: int,
                   dtype=jnp.bfloat16, allow_tma: bool = True) -> dict:
    """Block sizes, producer count and signal granularity for one problem.

    The tuning cache (``jaxtdist.tune``) overrides these per shape.
    CHUNK_ROWS=0 means one chunk (signal) per BLOCK_M rows. TMA=True selects
    the persistent kernel with TMA loads (``ag_matmul_tma_kernel``);
    PRODUCER="ce" with it gathers on the copy engines instead of producer
    programs (``ag_matmul_ce_kernel``); PRODUCER="push" (pointer kernel only)
    makes the producer programs push x into peers' heap inboxes instead of
    staging it and pulling. ``allow_tma=False`` gives the pointer
    kernel's defaults (for configs that ask for its modes). STREAM_K (copy-engine
    kernel only) cuts the last partial wave of tiles along K over every
    program (``stream_k_tail``): True, False, or "auto" (where it pays).
    TAIL_SPLIT_N (copy-engine kernel only) cuts that wave's tiles into that
    many pieces along N instead, one piece per program (``split_n_tail``):
    a power of 2, or "auto" (2 where the pieces fit in one wave, unless
    STREAM_K=True asks for the K cut). TAIL_STAGES is those pieces' pipeline
    depth: an int, or "auto" (``tail_stages``). FLATTEN (copy-engine kernel only)
    flattens its tile loops with their K loops, so that a tile's first loads
    overlap the previous tile's epilogue: True, False, or "auto" (``flattens``).
    PUSH_ORDER (copy engines only: "serial" or "parallel", ``PUSH_ORDERS``) is
    not set here: it follows the producer chosen (``settle_config``).
    """
    small = world * m_shard <= (128 if platform == "gpu" else 32)
    wide = jnp.dtype(dtype).itemsize == 4
    common = dict(SCOPE="sys", SPLIT_K=1, CHUNK_ROWS=0, TMA=False, PRODUCER="sm",
                  STREAM_K="auto", TAIL_SPLIT_N="auto", TAIL_STAGES="auto", FLATTEN="auto")
    if platform == "gpu":
        if small:  # decode: one M tile over all ranks' rows, split K, one chunk per row
            return dict(common, BLOCK_M=max(16, next_pow2(world * m_shard)), BLOCK_N=64,
                        BLOCK_K=64 if wide else 128, GROUP_M=1, NUM_COMM=16, CHUNK_ROWS=1,
                        COPY_BLOCK_C=min(4096, next_pow2(k)), ALL_ROWS=True,
                        SPLIT_K=min(4, -(-k // (64 if wide else 128))), num_warps=4,
                        num_stages=4)
        block_m = min(128, max(16, next_pow2(m_shard)))
        if (allow_tma and m_shard <= 256 and not wide and m_shard % 128 == 0
                and not _tma_misfits(m_shard, n, k, jnp.dtype(dtype).itemsize, 128)):
            # Few row tiles that TMA can load: the copy-engine kernel with
            # narrower N tiles, so that the tiles still cover the SMs (2.6x
            # faster than SM producers at 128/4096/8192 on 4 x H200, docs/perf).
            return dict(common, BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, NUM_COMM=16,
                        CHUNK_ROWS=128, COPY_BLOCK_C=256, ALL_ROWS=False, num_warps=8,
                        num_stages=4, TMA=True, PRODUCER="ce")
        if m_shard <= 256:  # few row tiles: narrow N tiles, finer chunks
            return dict(common, BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=64 if wide else 128,
                        GROUP_M=8, NUM_COMM=16, CHUNK_ROWS=min(16, block_m), COPY_BLOCK_C=256,
                        ALL_ROWS=False, num_warps=4, num_stages=3 if wide else 4)
        if wide:  # keep 3 stages within shared memory
            return dict(common, BLOCK_M=block_m, BLOCK_N=128, BLOCK_K=32, GROUP_M=8,
                        NUM_COMM=16, COPY_BLOCK_C=64, ALL_ROWS=False, num_warps=8,
                        num_stages=3)
        # The persistent TMA kernel where it fits, fed by the copy engines:
        # faster than SM producers on every large shape tuned on 4 x H200
        # whose inboxes fit the heap (docs/perf; too big a shape falls back).
        tma = allow_tma and not _tma_misfits(m_shard, n, k, jnp.dtype(dtype).itemsize, block_m)
        return dict(common, BLOCK_M=block_m, BLOCK_N=256 if block_m == 128 else 128,
                    BLOCK_K=64, GROUP_M=8, NUM_COMM=16, COPY_BLOCK_C=128, ALL_ROWS=False,
                    num_warps=8, num_stages=3, TMA=tma, PRODUCER="ce" if tma else "sm",
                    CHUNK_ROWS=256 if tma else 0)
    # CPU (interpreter): small blocks keep interpretation fast.
    if small:
        return dict(common, BLOCK_M=max(16, next_pow2(world * m_shard)), BLOCK_N=32,
                    BLOCK_K=32, GROUP_M=1, NUM_COMM=2, COPY_BLOCK_C=min(64, next_pow2(k)),
                    ALL_ROWS=True, num_warps=4, num_stages=1)
    return dict(common, BLOCK_M=min(32, max(16, next_pow2(m_shard))), BLOCK_N=32, BLOCK_K=32,
                GROUP_M=4, NUM_COMM=2, COPY_BLOCK_C=min(64, next_pow2(k)), ALL_ROWS=False,
                num_warps=4, num_stages=1)


def persistent_programs(rt, num_comm: int, tiles: int) -> int:
    """Programs of the persistent kernel: one per SM on GPUs (all must be resident,
    since they spin on each other), a few under the interpreter."""
    if rt.platform != "gpu":
        # Three: the tiles rarely split evenly, so that stream-K tails run too.
        return num_comm + min(tiles, 3)
    sms = getattr(rt.mesh.devices.flat[0], "core_count", None) or 132
    if num_comm >= sms:
        raise ValueError(f"jaxtdist.ag_matmul: NUM_COMM={num_comm} leaves none of the {sms} "
                         "SMs for the GEMM")
    return min(sms, num_comm + tiles)


def _check(x, w, axis_name):
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


_FLAG_KEYS = ("SCOPE", "ALL_ROWS", "TMA", "PRODUCER", "STREAM_K", "TAIL_SPLIT_N", "TAIL_STAGES",
              "FLATTEN", "PUSH_ORDER")
# PRODUCER="ce": "parallel" pushes to every peer at once (a side stream each),
# "serial" to one peer after another (one stream), in the order the GEMM
# consumes them, so that the first peer's shard lands early. Serial is the
# copy engines' default: 186.9 vs 190.2 us at 1024/4096/4096, 1242.9 vs 1268.5
# at 2048/7168/8192 on 4 x H200, fewer slow rounds (docs/perf, run AA).
PUSH_ORDERS = ("parallel", "serial")
# "auto" cuts a tail when its runs are at most this fraction of a tile's K.
# Measured on 4 x H200 (docs/perf/ag_matmul_stream_k_*): runs of 0.34 of a
# tile gained 1.3%; runs of 0.58-0.89 lost 0.7-18% (the partials' round trip
# through L2 and a second pipeline fill cost more than the shorter wave saves,
# and a part-filled last wave runs faster than a full one).
_STREAM_K_AUTO_MAX_RUN = 0.35
# FLATTEN="auto" needs at least this many tiles per program on average. On 4 x
# H200 (docs/perf, run AS) flattening gained 0.2-1.1% at 3.9-13.6 tiles per SM
# and lost 3.3% at one tile per SM (decode, 128/4096/8192).
_FLATTEN_AUTO_MIN_TILES = 2
# "sm": producer programs stage and pull; "push": producer programs push into
# peers' heap inboxes (pointer kernel only); "ce": the copy engines push (TMA kernel).
PRODUCERS = ("sm", "push", "ce")
# Settings only the copy-engine kernel has: (key, whether a value asks for it, why).
_CE_ONLY = (
    ("STREAM_K", lambda v: v is True,
     "only the copy-engine kernel cuts its last wave of tiles along K"),
    ("TAIL_SPLIT_N", lambda v: v != "auto" and v > 1,
     "only the copy-engine kernel cuts its last wave"),
    ("TAIL_STAGES", lambda v: v != "auto",
     "only the copy-engine kernel cuts its last wave into pieces"),
    ("FLATTEN", lambda v: v is True, "only the copy-engine kernel flattens its tile loops"),
    ("PUSH_ORDER", lambda v: v == "serial", "it orders the copy engines' pushes"),
)
_INT_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "NUM_COMM", "CHUNK_ROWS",
             "COPY_BLOCK_C", "SPLIT_K", "num_warps", "num_stages")


def _tma_misfits(m_shard: int, n: int | None, k: int, itemsize: int, block_m: int) -> list[str]:
    """What a shape lacks for the TMA kernel (empty: it fits). Row tiles must not
    cross into the next rank's rows; descriptor strides must be 16-byte multiples."""
    misfits = []
    if m_shard % block_m:
        misfits.append(f"m_shard={m_shard} to be a multiple of BLOCK_M={block_m}")
    if k * itemsize % 16:
        misfits.append(f"rows of x ({k} elements) to be a multiple of 16 bytes")
    if n is not None and n * itemsize % 16:
        misfits.append(f"rows of w ({n} elements) to be a multiple of 16 bytes")
    return misfits


def check_config(cfg: dict, world: int, m_shard: int, k: int, n: int | None = None,
                 itemsize: int = 2) -> None:
    """Raises ``ValueError`` naming the first constraint ``cfg`` breaks."""
    unknown = set(cfg) - set(_INT_KEYS) - set(_FLAG_KEYS)
    if unknown:
        raise ValueError(f"jaxtdist.ag_matmul: unknown config keys {sorted(unknown)}; known: "
                         f"{sorted(_INT_KEYS + _FLAG_KEYS)}")
    cfg = dict(cfg, CHUNK_ROWS=cfg["CHUNK_ROWS"] or cfg["BLOCK_M"])  # 0: one chunk per row tile
    for key in _INT_KEYS:
        if int(cfg[key]) < 1:
            raise ValueError(f"jaxtdist.ag_matmul: config {key}={cfg[key]} must be >= 1")
    for key in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "CHUNK_ROWS", "COPY_BLOCK_C"):
        if cfg[key] & (cfg[key] - 1):
            raise ValueError(f"jaxtdist.ag_matmul: config {key}={cfg[key]} must be a power of 2")
    if cfg["ALL_ROWS"] and cfg["BLOCK_M"] < world * m_shard:
        raise ValueError(f"jaxtdist.ag_matmul: ALL_ROWS needs BLOCK_M >= world * m_shard "
                         f"= {world * m_shard}, got BLOCK_M={cfg['BLOCK_M']}")
    cfg.setdefault("PRODUCER", "sm")
    if cfg["PRODUCER"] not in PRODUCERS:
        raise ValueError(f"jaxtdist.ag_matmul: config PRODUCER={cfg['PRODUCER']!r}; allowed: "
                         f"{PRODUCERS} (SM producer programs that pull, SM producer programs that "
                         "push, or the copy engines)")
    if cfg["PRODUCER"] == "ce" and not cfg.get("TMA"):
        raise ValueError("jaxtdist.ag_matmul: config PRODUCER='ce' needs TMA=True (the copy "
                         "engines feed the persistent TMA kernel only)")
    if cfg["PRODUCER"] == "push" and cfg.get("TMA"):
        raise ValueError("jaxtdist.ag_matmul: config PRODUCER='push' needs TMA=False (SM "
                         "pushes feed the pointer kernel only; the TMA kernel's pushes are "
                         "PRODUCER='ce')")
    cfg.setdefault("STREAM_K", "auto")
    if not (isinstance(cfg["STREAM_K"], bool) or cfg["STREAM_K"] == "auto"):
        raise ValueError(f"jaxtdist.ag_matmul: config STREAM_K={cfg['STREAM_K']!r}; allowed: "
                         "True, False or 'auto'")
    pieces = cfg.setdefault("TAIL_SPLIT_N", "auto")
    if pieces != "auto" and (isinstance(pieces, bool) or not isinstance(pieces, (int, np.integer))
                             or pieces < 1 or pieces & (pieces - 1)):
        raise ValueError(f"jaxtdist.ag_matmul: config TAIL_SPLIT_N={pieces!r}; allowed: 'auto' "
                         "or a power of 2 >= 1 (pieces per tile of the last wave; 1: whole tiles)")
    if pieces != "auto" and pieces > 1:
        if cfg["STREAM_K"] is True:
            raise ValueError(f"jaxtdist.ag_matmul: config STREAM_K=True and TAIL_SPLIT_N={pieces} "
                             "both cut the last wave (along K, along N); ask for one")
        if cfg["BLOCK_N"] // pieces < 16:
            raise ValueError(f"jaxtdist.ag_matmul: config TAIL_SPLIT_N={pieces} cuts BLOCK_N="
                             f"{cfg['BLOCK_N']} into pieces narrower than 16 columns; lower it")
    stages = cfg.setdefault("TAIL_STAGES", "auto")
    if stages != "auto" and (isinstance(stages, bool) or not isinstance(stages, (int, np.integer))
                             or stages < 1):
        raise ValueError(f"jaxtdist.ag_matmul: config TAIL_STAGES={stages!r}; allowed: 'auto' "
                         "or an int >= 1 (pipeline depth of the split-N tail's pieces)")
    flatten = cfg.setdefault("FLATTEN", "auto")
    if not (isinstance(flatten, bool) or flatten == "auto"):
        raise ValueError(f"jaxtdist.ag_matmul: config FLATTEN={flatten!r}; allowed: True, False "
                         "or 'auto'")
    if flatten is True and cfg["CHUNK_ROWS"] < cfg["BLOCK_M"]:
        raise ValueError(f"jaxtdist.ag_matmul: config FLATTEN=True needs CHUNK_ROWS >= BLOCK_M "
                         f"(one flag per row tile), got CHUNK_ROWS={cfg['CHUNK_ROWS']}, "
                         f"BLOCK_M={cfg['BLOCK_M']}")
    cfg.setdefault("PUSH_ORDER", "parallel")
    if cfg["PUSH_ORDER"] not in PUSH_ORDERS:
        raise ValueError(f"jaxtdist.ag_matmul: config PUSH_ORDER={cfg['PUSH_ORDER']!r}; "
                         f"allowed: {PUSH_ORDERS} (copy engines push to every peer at once, or "
                         "to one peer after another)")
    if cfg["PRODUCER"] != "ce":
        for key, asks, why in _CE_ONLY:
            if asks(cfg[key]):
                raise ValueError(f"jaxtdist.ag_matmul: config {key}={cfg[key]!r} needs "
                                 f"PRODUCER='ce' ({why})")
    if cfg["CHUNK_ROWS"] > cfg["BLOCK_M"] and cfg["PRODUCER"] in ("sm", "push"):
        raise ValueError(f"jaxtdist.ag_matmul: CHUNK_ROWS={cfg['CHUNK_ROWS']} must divide "
                         f"BLOCK_M={cfg['BLOCK_M']}")
    if cfg.get("TMA"):
        misfits = ((["ALL_ROWS=False"] if cfg["ALL_ROWS"] else []) +
                   (["SPLIT_K=1"] if cfg["SPLIT_K"] != 1 else []) +
                   _tma_misfits(m_shard, n, k, itemsize, cfg["BLOCK_M"]))
        if misfits:
            raise ValueError(f"jaxtdist.ag_matmul: config TMA=True needs {misfits[0]}")
    if cfg["SPLIT_K"] > -(-k // cfg["BLOCK_K"]):
        raise ValueError(f"jaxtdist.ag_matmul: SPLIT_K={cfg['SPLIT_K']} exceeds the "
                         f"{-(-k // cfg['BLOCK_K'])} blocks of K={k} (BLOCK_K={cfg['BLOCK_K']})")


def settle_config(cfg: dict, asked: dict) -> dict:
    """``cfg`` updated by the keys ``asked`` for (a tuned entry or a caller's
    config), with the settings that depend on the kernel chosen (its modes,
    the copy engines' push order) following it where they were not asked for."""
    cfg = dict(cfg, **asked)
    if cfg["TMA"]:  # the TMA kernel has neither mode
        for key, value in (("ALL_ROWS", False), ("SPLIT_K", 1)):
            if key not in asked:
                cfg[key] = value
    if "PUSH_ORDER" not in asked:  # serial for the copy engines, moot otherwise
        cfg["PUSH_ORDER"] = "serial" if cfg.get("PRODUCER") == "ce" else "parallel"
    return cfg


def resolve_config(rt, axis_name, world: int, m_shard: int, n: int, k: int, dtype,
                   config: dict | None = None) -> dict:
    """The config a call uses: the defaults, updated by the tuning cache's entry
    for this (device kind, world, shape, dtype), then by ``config``.

    On a cache miss with ``JAXTDIST_AUTOTUNE=1``, tunes the shape first (see
    ``jaxtdist.tune.tune_ag_matmul``) and caches the choice.
    """
    # A config that turns TMA off, or asks for a mode only the pointer kernel
    # has (split K, one tile over all rows, SM pushes), starts from the pointer kernel's
    # defaults: the shape's defaults may be the TMA kernel's.
    asked = config or {}
    pointer = (not asked.get("TMA", True)) or ("TMA" not in asked and (
        asked.get("SPLIT_K", 1) != 1 or asked.get("ALL_ROWS", False)
        or asked.get("PRODUCER") == "push"))
    cfg = default_config(rt.platform, world, m_shard, n, k, dtype, allow_tma=not pointer)
    if config is None:
        tuned = rt.tuning.lookup("ag_matmul", world, (m_shard, n, k), dtype)
        if tuned is None and os.environ.get("JAXTDIST_AUTOTUNE") == "1":
            from jaxtdist.tune import tune_ag_matmul
            tuned = tune_ag_matmul(m_shard, n, k, dtype, axis_name=axis_name)["config"]
        asked = tuned or {}
    cfg = settle_config(cfg, asked)
    check_config(cfg, world, m_shard, k, n, jnp.dtype(dtype).itemsize)
    cfg["CHUNK_ROWS"] = cfg["CHUNK_ROWS"] or cfg["BLOCK_M"]
    return cfg


def ag_matmul_with_gathered(x: jax.Array, w: jax.Array, axis_name, *,
                            config: dict | None = None) -> tuple[jax.Array, jax.Array]:
    """Like ``ag_matmul`` but also returns the gathered ``x``.

    ``config`` overrides the block sizes, producer count (``NUM_COMM``),
    ``SPLIT_K``, ``num_warps`` and ``num_stages`` chosen by the tuning cache
    or the defaults (see ``jaxtdist.tune``).
    """
    rt = runtime()
    layout = _call.check_axis(rt, axis_name, "ag_matmul")
    _check(x, w, axis_name)
    m_shard, k = x.shape
    n = w.shape[1]
    world = layout.world
    cfg = resolve_config(rt, axis_name, world, m_shard, n, k, x.dtype, config)
    num_warps = cfg.pop("num_warps")
    num_stages = cfg.pop("num_stages")
    if cfg["TMA"] and cfg["PRODUCER"] == "ce":
        try:
            return _ag_matmul_ce(rt, layout, x, w, axis_name, cfg, num_warps, num_stages)
        except HeapExhaustedError:
            if "PRODUCER" in (config or {}) or (config or {}).get("STREAM_K") is True:
                raise
            # A tuned or default choice that does not fit this heap: the SM
            # producer needs a quarter of the room (staging slots, no inboxes).
            cfg["PRODUCER"] = "sm"
            cfg["CHUNK_ROWS"] = min(cfg["CHUNK_ROWS"], cfg["BLOCK_M"])
    push = cfg["PRODUCER"] == "push"
    if push:
        # One layout whatever the chunking, as for the copy engines' inboxes.
        plan = InboxWorkspace(world, m_shard, k, x.dtype, 1)
        ws = rt.workspace(("ag_matmul_push", layout.axes, m_shard, k, x.dtype.name),
                          plan.nbytes)
        gather = dict(STAGE_OFF=ws.offset + plan.inbox, SLOT_BYTES=plan.parity_bytes,
                      READY_OFF=-1, FLAGS_OFF=ws.offset + plan.flags)
    else:
        plan = GatherWorkspace(world, m_shard, k, x.dtype, cfg["CHUNK_ROWS"])
        ws = rt.workspace(("ag_matmul", layout.axes, m_shard, k, x.dtype.name,
                           cfg["CHUNK_ROWS"]), plan.nbytes)
        gather = dict(STAGE_OFF=ws.offset + plan.stage, SLOT_BYTES=plan.slot_bytes,
                      READY_OFF=ws.offset + plan.ready, FLAGS_OFF=ws.offset + plan.flags)
    n_tiles = -(-n // cfg["BLOCK_N"])
    m_tiles = 1 if cfg["ALL_ROWS"] else world * -(-m_shard // cfg["BLOCK_M"])
    split_k = cfg["SPLIT_K"]
    k_split = -(-(-(-k // split_k)) // cfg["BLOCK_K"]) * cfg["BLOCK_K"]
    partials_off = counters_off = -1
    if split_k > 1:
        split_plan = SplitKWorkspace(split_k, world * m_shard, n, m_tiles * n_tiles)
        split_ws = rt.workspace(("ag_matmul_split_k", layout.axes, world * m_shard, n, split_k,
                                 cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["ALL_ROWS"]),
                                split_plan.nbytes)
        partials_off = split_ws.offset + split_plan.partials
        counters_off = split_ws.offset + split_plan.counters
    at_launch = _call.aligns_at_launch(rt, (x, w), needs_scratch=cfg["TMA"])
    ctx = _call.prologue(rt, layout, ws, "ag_matmul", deps=(x, w), align_launch=not at_launch)
    # With pushes the gathered x stays in the heap inboxes: a one-element
    # placeholder takes the kernel's second output.
    out_shape = (jax.ShapeDtypeStruct((world * m_shard, n), x.dtype),
                 jax.ShapeDtypeStruct((1,) if push else (world * m_shard, k), x.dtype))
    gather.update(M_SHARD=m_shard, N=n, K=k)
    cfg.pop("PRODUCER")
    for key, _, _ in _CE_ONLY:  # the copy-engine kernel's settings
        cfg.pop(key)
    if cfg.pop("TMA"):
        for key in ("ALL_ROWS", "SPLIT_K"):
            cfg.pop(key)
        programs = persistent_programs(rt, cfg["NUM_COMM"], m_tiles * n_tiles)
        schedule = rt.workspace(("ag_matmul_schedule", layout.axes), 8)
        out, gathered = _call.launch(
            ag_matmul_tma_kernel, ctx, x, w, out_shape=out_shape, grid=(programs,),
            num_warps=num_warps, num_stages=num_stages, needs_scratch=True,
            align_with=(layout, ws), SCHEDULE_OFF=schedule.offset, NUM_PROGRAMS=programs,
            PRODUCERS_JOIN=rt.platform == "gpu", **gather, **cfg)
        return out, gathered
    grid = (cfg["NUM_COMM"] + split_k * m_tiles * n_tiles,)
    out, gathered = _call.launch(
        ag_matmul_kernel, ctx, x, w, out_shape=out_shape, grid=grid, num_warps=num_warps,
        num_stages=num_stages, align_with=(layout, ws), PARTIALS_OFF=partials_off,
        COUNTERS_OFF=counters_off, K_SPLIT=k_split, PUSH=push,
        FLAG_SCOPE="sys" if push else "gpu", **gather, **cfg)
    if push:  # the inboxes are reused by the next call: XLA gathers the residual if used
        return out, jax.lax.all_gather(x, axis_name, tiled=True)
    return out, gathered


def stream_k_tail(tiles: int, programs: int, k_blocks: int, peer_tiles: int,
                  mode=True) -> tuple[int, int]:
    """(tail tiles, K blocks per run) of the copy-engine kernel's stream-K tail, or (0, 0).

    ``tiles`` dealt round-robin over ``programs`` leave ``tiles % programs``
    in a last, partial wave: those programs take a whole tile's time while
    the others idle. Cutting the tail's ``tail * k_blocks`` K blocks into
    equal runs, one per program, ends that wave after ``tail / programs`` of
    a tile instead. Runs are at least a quarter of a tile (at most five
    programs sum one tile); the tail must lie in peers' tiles (the kernel's
    local tiles are dealt first). ``mode="auto"`` cuts only where runs are at
    most ``_STREAM_K_AUTO_MAX_RUN`` of a tile.

    Example:
      >>> stream_k_tail(704, 132, 64, 528)  # 2048 x 2752 tiles of 128 x 256, K=4096
      (44, 22)
    """
    tail = tiles % programs
    if mode is False or tail == 0 or tail > peer_tiles or k_blocks < 2:
        return 0, 0
    run = max(-(-tail * k_blocks // programs), -(-k_blocks // 4))
    if run >= k_blocks or (mode == "auto" and run > _STREAM_K_AUTO_MAX_RUN * k_blocks):
        return 0, 0
    return tail, run


def tail_stages(cfg: dict, num_stages: int, pieces: int) -> int:
    """The pipeline depth of the split-N tail's pieces (config TAIL_STAGES).

    "auto": as deep as fits in the shared memory that the whole tiles' pipeline
    and epilogue already take (a piece's stage is narrower), and never shallower
    than num_stages. A piece reads as much of A as a whole tile for a fraction
    of the MMAs, so its loads want more of them in flight: on 4 x H200 (docs/perf,
    runs AW-AX) 2048/2752/4096 took 256-258 us with 6 stages against 262-265
    with the kernel's 3 (and 288-293 with 2).

    Example:
      >>> tail_stages(dict(TAIL_STAGES="auto", BLOCK_M=128, BLOCK_N=256, BLOCK_K=64), 3, 2)
      6
    """
    if cfg["TAIL_STAGES"] != "auto":
        return int(cfg["TAIL_STAGES"])
    block_m, block_n, block_k = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    # In elements of the operands' dtype (the output's too): the same for all three.
    whole = num_stages * (block_m + block_n) * block_k + block_m * block_n
    piece_stage = (block_m + block_n // pieces) * block_k
    return max(num_stages, whole // piece_stage)


def flattens(cfg: dict, tiles: int, programs: int) -> bool:
    """Whether the copy-engine kernel flattens its tile loops (config FLATTEN).

    "auto" flattens where chunks are no finer than tiles (one flag per tile,
    which the loop-free wait needs) and programs average at least
    ``_FLATTEN_AUTO_MIN_TILES`` tiles: with one tile each there is no next
    tile to prefetch, only the fused loop's overhead.

    Example:
      >>> flattens(dict(FLATTEN="auto", CHUNK_ROWS=128, BLOCK_M=128), 704, 132)
      True
    """
    if cfg["FLATTEN"] != "auto":
        return bool(cfg["FLATTEN"])
    return cfg["CHUNK_ROWS"] >= cfg["BLOCK_M"] and tiles >= _FLATTEN_AUTO_MIN_TILES * programs


def split_n_tail(tiles: int, programs: int, peer_tiles: int, block_n: int,
                 mode="auto") -> tuple[int, int]:
    """(tail tiles, pieces per tile) of the copy-engine kernel's split-N tail, or (0, 1).

    The ``tiles % programs`` tiles of the last, partial wave are cut along N
    into ``pieces`` (BLOCK_N / pieces wide), one piece per program, where
    all of them fit in one wave and pieces are at least 16 columns wide: the
    wave then takes a piece's time instead of a tile's, with no partial sums.
    ``mode``: a power of 2 (1: whole tiles), or "auto" (2).

    Example:
      >>> split_n_tail(704, 132, 528, 256)  # 2048 x 2752 tiles of 128 x 256
      (44, 2)
    """
    pieces = 2 if mode == "auto" else int(mode)
    tail = tiles % programs
    if (pieces < 2 or tail == 0 or tail > peer_tiles or tail * pieces > programs
            or block_n // pieces < 16):
        return 0, 1
    return tail, pieces


def _push_shards(rt, layout, ws, offsets: dict, ctx, x, cfg: dict) -> jax.Array:
    """Starts pushing x into every peer's heap inbox; returns the context for the
    kernel that follows (the same buffer: it orders the kernel after the push).

    On GPUs the copy engines push (``csrc/ce_gather.cc`` enqueues peer copies on
    side streams and returns at once); the CPU backend pushes with SM-style
    copies (``push_shards_kernel`` under the interpreter) before the GEMM.
    """
    m_shard, k = x.shape
    if rt.platform == "gpu":
        call = _ffi.ffi_call(_native.CE_GATHER_TARGET, jax.ShapeDtypeStruct(ctx.shape, ctx.dtype),
                             platform=rt.platform, input_output_aliases={1: 0})
        return call(x, ctx, counter_id=np.int64(ws.counter_id), world=np.int64(layout.world),
                    groups=rt.group_table(layout), inbox_offset=np.int64(offsets["INBOX_OFF"]),
                    parity_bytes=np.int64(offsets["PARITY_BYTES"]),
                    flags_offset=np.int64(offsets["FLAGS_OFF"]),
                    sent_offset=np.int64(offsets["SENT_OFF"]),
                    chunk_rows=np.int64(cfg["CHUNK_ROWS"]), generation=np.int64(rt.generation),
                    align_launch=np.int64(1), serial=np.int64(cfg["PUSH_ORDER"] == "serial"))
    done = _call.launch(push_shards_kernel, ctx, x, out_shape=jax.ShapeDtypeStruct((1,), jnp.int32),
                        grid=(cfg["NUM_COMM"],), num_warps=4, num_stages=1, M_SHARD=m_shard,
                        K=k, NUM_COMM=cfg["NUM_COMM"], CHUNK_ROWS=cfg["CHUNK_ROWS"],
                        COPY_BLOCK_C=cfg["COPY_BLOCK_C"], SCOPE=cfg["SCOPE"], **offsets)
    ctx, _ = jax.lax.optimization_barrier((ctx, done))
    return ctx


def _tail_plan(rt, layout, cfg: dict, tiles: int, programs: int, k: int,
               peer_tiles: int, num_stages: int) -> dict:
    """The copy-engine kernel's tail constexprs: a split-N tail where the config
    and shape allow it, else a stream-K tail with its heap workspace.

    A stream-K tail whose workspace does not fit the heap is not cut, unless
    the config asked for STREAM_K=True: then HeapExhaustedError says so.
    """
    off = dict(TAIL_TILES=0, TAIL_UNITS=0, PARTIALS_OFF=-1, COUNTERS_OFF=-1, TAIL_SPLIT_N=1,
               TAIL_STAGES=num_stages)
    if cfg["STREAM_K"] is not True:
        tail, pieces = split_n_tail(tiles, programs, peer_tiles, cfg["BLOCK_N"],
                                    cfg["TAIL_SPLIT_N"])
        if tail:
            return dict(off, TAIL_TILES=tail, TAIL_SPLIT_N=pieces,
                        TAIL_STAGES=tail_stages(cfg, num_stages, pieces))
    k_blocks = -(-k // cfg["BLOCK_K"])
    tail, run = stream_k_tail(tiles, programs, k_blocks, peer_tiles, cfg["STREAM_K"])
    if not tail:
        return off
    plan = StreamKWorkspace(programs, tail, cfg["BLOCK_M"], cfg["BLOCK_N"])
    # Counters count arrivals per tile for one (tail, run) cut: a key of its own.
    key = ("ag_matmul_stream_k", layout.axes, programs, tail, run, k_blocks, cfg["BLOCK_M"],
           cfg["BLOCK_N"])
    try:
        ws = rt.workspace(key, plan.nbytes)
    except HeapExhaustedError:
        if cfg["STREAM_K"] is True:
            raise
        return off
    return dict(off, TAIL_TILES=tail, TAIL_UNITS=run, PARTIALS_OFF=ws.offset + plan.partials,
                COUNTERS_OFF=ws.offset + plan.counters)


def _ag_matmul_ce(rt, layout, x, w, axis_name, cfg: dict, num_warps: int, num_stages: int):
    """ag_matmul with the gather on the copy engines and every SM in the GEMM."""
    m_shard, k = x.shape
    n = w.shape[1]
    world = layout.world
    # One layout whatever the chunking (room for a flag per row), so that
    # calls with different CHUNK_ROWS share the inboxes safely; stale flags
    # of another chunking hold older epochs, never this call's.
    plan = InboxWorkspace(world, m_shard, k, x.dtype, 1)
    ws = rt.workspace(("ag_matmul_ce", layout.axes, m_shard, k, x.dtype.name), plan.nbytes)
    offsets = dict(INBOX_OFF=ws.offset + plan.inbox, PARITY_BYTES=plan.parity_bytes,
                   FLAGS_OFF=ws.offset + plan.flags, SENT_OFF=ws.offset + plan.sent)
    # The push handler is the last host work before the GEMM: it, not the
    # prologue, holds the launch rendezvous.
    ctx = _call.prologue(rt, layout, ws, "ag_matmul", deps=(x, w), align_launch=False)
    ctx = _push_shards(rt, layout, ws, offsets, ctx, x, cfg)
    per_rank = (m_shard // cfg["BLOCK_M"]) * -(-n // cfg["BLOCK_N"])
    programs = persistent_programs(rt, 0, world * per_rank)
    tail = _tail_plan(rt, layout, cfg, world * per_rank, programs, k, (world - 1) * per_rank,
                      num_stages)
    out = _call.launch(
        ag_matmul_ce_kernel, ctx, x, w,
        out_shape=jax.ShapeDtypeStruct((world * m_shard, n), x.dtype), grid=(programs,),
        num_warps=num_warps, num_stages=num_stages, needs_scratch=True, M_SHARD=m_shard, N=n,
        K=k, **offsets, CHUNK_ROWS=cfg["CHUNK_ROWS"], BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
        BLOCK_K=cfg["BLOCK_K"], GROUP_M=cfg["GROUP_M"], NUM_PROGRAMS=programs,
        FLATTEN=flattens(cfg, world * per_rank, programs), **tail)
    # The gathered x (the autodiff residual) lives only in heap inboxes that the
    # next call reuses: XLA gathers it when it is used (dropped when it is not).
    return out, jax.lax.all_gather(x, axis_name, tiled=True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _ag_matmul(x, w, axis_name):
    return ag_matmul_with_gathered(x, w, axis_name)[0]


def _fwd(x, w, axis_name):
    out, gathered = ag_matmul_with_gathered(x, w, axis_name)
    return out, (gathered, x, w)


def _bwd(axis_name, residuals, dy):
    gathered, x, w = residuals
    # dx: the rows of dy @ w^T that belong to this rank, summed over ranks.
    dx_full = jnp.dot(dy, w.T, preferred_element_type=jnp.float32)
    dx = jax.lax.psum_scatter(dx_full, axis_name, scatter_dimension=0, tiled=True)
    dw = jnp.dot(gathered.T, dy, preferred_element_type=jnp.float32)
    return (_call.match_cotangent(dx.astype(x.dtype), x),
            _call.match_cotangent(dw.astype(w.dtype), w))


_ag_matmul.defvjp(_fwd, _bwd)


def ag_matmul(x: jax.Array, w: jax.Array, axis_name) -> jax.Array:
    """``all_gather(x, axis_name, tiled=True) @ w`` with the gather overlapped.

    Call inside ``jax.shard_map`` over the mesh given to ``jaxtdist.initialize``.
    Differentiable: the backward pass reduce-scatters ``dy @ w.T`` and uses the
    gathered ``x`` kept from the forward pass.

    Args:
      x: this rank's rows, [m_shard, k].
      w: this rank's weight, [k, n] (typically column-sharded).
      axis_name: mesh axis (or tuple of axes) the rows are sharded over.

    Returns:
      [world * m_shard, n] in x's dtype, accumulated in float32.

    Example:
      >>> mesh = jax.make_mesh((4,), ("tp",)); jaxtdist.initialize(mesh)
      >>> f = jax.jit(jax.shard_map(lambda x, w: jaxtdist.ag_matmul(x, w, "tp"), mesh=mesh,
      ...             in_specs=(P("tp", None), P(None, "tp")), out_specs=P(None, "tp")))
    """
    x = jnp.asarray(x)
    w = jnp.asarray(w)
    _check(x, w, axis_name)
    if isinstance(axis_name, list):
        axis_name = tuple(axis_name)
    # The custom_vjp traces its body in a trace of its own: order this call
    # after the previous jaxtdist op of the caller's trace here.
    rt = runtime()
    previous = _call.program_order_deps(rt)
    if previous:
        x, _ = jax.lax.optimization_barrier((x, previous))
    out = _ag_matmul(x, w, axis_name)
    _call.record_output(rt, out)
    return out


def ag_matmul_sharded(x: jax.Array, w: jax.Array, *, axis_name: str, batch_axes=(),
                      mesh=None) -> jax.Array:
    """``ag_matmul`` for pjit-style code: no hand-written ``shard_map`` needed.

    ``x`` is [M, K] with rows sharded over ``(*batch_axes, axis_name)``; ``w`` is
    [K, N] with columns sharded over ``axis_name``. The result is [M, N] with
    rows sharded over ``batch_axes`` and columns over ``axis_name``: within each
    batch group, the rows are all-gathered over ``axis_name`` and multiplied,
    the gather overlapped with the GEMM. Mesh axes not named are replicated.

    Args:
      x: activations, [M, K].
      w: weight, [K, N].
      axis_name: the tensor-parallel mesh axis.
      batch_axes: mesh axes that shard the rows of ``x`` and the output (data
        parallelism), outermost first.
      mesh: the mesh; defaults to the one given to ``jaxtdist.initialize``.

    Returns:
      ``x @ w`` with the sharding described above.

    Example:
      >>> mesh = jax.make_mesh((2, 4), ("dp", "tp")); jaxtdist.initialize(mesh)
      >>> layer = jax.jit(functools.partial(jaxtdist.ag_matmul_sharded, axis_name="tp",
      ...                                   batch_axes=("dp",)))
      >>> y = layer(x, w)  # x: P(("dp", "tp"), None), w: P(None, "tp")
    """
    from jax.sharding import PartitionSpec as P

    rt = runtime()
    mesh = rt.mesh if mesh is None else mesh
    batch_axes = (batch_axes,) if isinstance(batch_axes, str) else tuple(batch_axes)
    if axis_name in batch_axes:
        raise ValueError(f"jaxtdist.ag_matmul_sharded: axis_name {axis_name!r} is also in "
                         f"batch_axes {batch_axes}")
    rows = tuple(batch_axes) + (axis_name,)
    out_rows = (batch_axes if len(batch_axes) > 1 else batch_axes[0]) if batch_axes else None
    body = functools.partial(ag_matmul, axis_name=axis_name)
    return jax.shard_map(body, mesh=mesh, in_specs=(P(rows, None), P(None, axis_name)),
                         out_specs=P(out_rows, axis_name))(x, w)
