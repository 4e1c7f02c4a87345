"""The launches of matmul_rs's and matmul_ar's kernels: their typed configs, shapes,
workspaces and the calls through ``Call``, at any world size (the ops of
``matmul_rs.py`` add autodiff, world 1 and the pjit-style forms).

A module of its own so that ag_matmul's backward (a ``matmul_rs_kernels``) and
matmul_rs's backward (an ``ag_matmul_with_gathered``) import no op module of
each other: no import circle.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from jaxtdist.kernels.matmul_ar import matmul_ar_kernel
from jaxtdist.kernels.matmul_rs import matmul_rs_kernel
from jaxtdist.ops._config import KernelConfig, Problem, block, resolve, setting
from jaxtdist.ops._fp8_gemm import check_block_k, logical_weight
from jaxtdist.ops._gemm_config import SMEM_BUDGET, default_tiles, tma_fits, weights_k_major
from jaxtdist.ops._precision import kernel_operands
from jaxtdist.ops._protocol import Call, check_axis
from jaxtdist.ops._shapes import SplitKWorkspace, align, check_dtype, next_pow2
from jaxtdist.runtime._runtime import runtime

__all__ = ["MatmulArConfig", "MatmulRsConfig", "PartialsWorkspace", "ar_launch",
           "matmul_ar_kernels", "matmul_rs_kernels", "rs_launch"]

_CPU_PROGRAMS = 3  # the interpreter runs programs one by one: a few show the dealing
_PARTIALS = ("float32", "input")
_PUSHES = ("auto", "tma", "stores")
# Tiles of the GPU pointer kernels, largest first: the largest whose count still
# covers the SMs is the default (fewer tiles than SMs leave SMs idle throughout).
_RS_TILES = ((128, 128), (128, 64), (64, 64))
_AR_BLOCK_N = (64, 32)
_AR_COVER = 0.9
# matmul_ar's K splits, and the least K a split keeps (8 steps of 128: the
# pipeline's prologue and the partial's round trip through the workspace stay
# small against the split's own loads of w).
_AR_SPLITS = (1, 2, 4, 8)
_AR_MIN_K_SPLIT = 1024
# Above this many bytes of one-shot partials per rank matmul_ar reduces in two
# shots. On 4 x H100 at N 8192, K 8192 split: 16 rows (1.5 MB) one shot
# 25.5 us, two shot 25.3; 64 rows (6 MB) 62.1 against 47.0; 128 rows 88.7
# against 56.2; 1 row 20.8 against 25.2.
_AR_ONE_SHOT_BYTES = 2 << 20


# -- configs ---------------------------------------------------------------------

def _check_tma(cfg, problem: Problem) -> None:
    """TMA=True needs rows of x and w that TMA can address."""
    _, n, k = problem.shape
    if cfg.TMA and not tma_fits(k, n, problem.itemsize):
        raise ValueError(f"jaxtdist.{cfg.OP}: config TMA=True needs rows of x (k={k}) and w "
                         f"(n={n}) that are multiples of 16 bytes ({problem.itemsize}-byte "
                         "elements); leave TMA unset for the pointer GEMM")


@dataclasses.dataclass(frozen=True)
class MatmulRsConfig(KernelConfig):
    """How matmul_rs's persistent kernel runs one problem.

    Attributes:
      BLOCK_M, BLOCK_N, BLOCK_K: GEMM tile (powers of 2, >= 16).
      GROUP_M: row tiles per group of the tile order (L2 reuse of w).
      NUM_PROGRAMS: persistent programs (0: one per SM on GPUs, at most the
        tiles; 3 under the interpreter).
      PARTIAL: dtype of the pushed partials: "input" (default: x's dtype, half
        the link bytes and inbox memory of float32 for bf16; on 2 x H100 at
        8192 x 4096 x 12288, 703 us against 777 with float32 partials, relative
        error 2.0e-3 against 1.7e-3, XLA's psum_scatter 2.4e-3) or "float32"
        (partials rounded once, in the output). The sum is float32 either way.
      TMA: run the tiles on the GEMM core (TMA loads and stores; needs rows of x
        and w that are 16-byte multiples), else on the pointer GEMM.
      SUBTILE: column pieces of the core's output store (1, 2 or 4).
      FLATTEN: at world 1, fuse the tile loop with its K loop (TMA only), so
        that the next tile's first loads go out under this tile's epilogue
        (ignored at world > 1, where a fused loop measured 2.7x slower).
      PUSH: how a peer's tile reaches its owner: "tma" (TMA stores into the
        owner's inbox, its flag raised a tile later: the program computes on
        while the TMA unit sends; TMA tiles only) or "stores" (SM stores
        through peer pointers, then the flag); "auto" (default): "tma" with
        TMA on GPUs, else "stores" (under the interpreter descriptor stores
        ran about 3x slower than pointer stores).
      num_warps, num_stages: launch options.
    """
    OP: ClassVar[str] = "matmul_rs"
    variant: ClassVar[str] = "push"

    BLOCK_M: int = block(128)
    BLOCK_N: int = block(128)
    BLOCK_K: int = block(64)
    GROUP_M: int = setting(8)
    NUM_PROGRAMS: int = setting(0, low=0, note="(0: one per SM)")
    PARTIAL: str = setting("input", choices=_PARTIALS)
    TMA: bool = True
    SUBTILE: int = setting(2, choices=(1, 2, 4))
    FLATTEN: bool = True
    PUSH: str = setting("auto", choices=_PUSHES)
    num_warps: int = 8
    num_stages: int = 3

    @classmethod
    def default(cls, problem: Problem) -> "MatmulRsConfig":
        """One rule: the GEMM core's tile by wave quantisation over every rank's
        rows (``_gemm_config.default_tiles``), one program per SM; the pointer GEMM
        where TMA cannot address the rows. The interpreter takes small tiles and
        3 programs (the same kernel paths)."""
        m, n, k = problem.shape
        m_shard = max(1, m // problem.world)
        fit_m = max(16, next_pow2(m_shard))
        tma = tma_fits(k, n, problem.itemsize)
        if problem.platform != "gpu":
            return cls(BLOCK_M=min(32, fit_m), BLOCK_N=32, BLOCK_K=32, GROUP_M=4,
                       NUM_PROGRAMS=_CPU_PROGRAMS, TMA=tma, SUBTILE=2, num_warps=4,
                       num_stages=1)
        if tma:
            t = default_tiles(m_shard, problem.world, n, k, problem.itemsize, problem.sms)
            return cls(BLOCK_M=t.BLOCK_M, BLOCK_N=t.BLOCK_N, BLOCK_K=t.BLOCK_K, TMA=True,
                       SUBTILE=t.SUBTILE, num_warps=t.num_warps, num_stages=t.num_stages)
        for block_m, block_n in _RS_TILES:
            block_m = min(block_m, fit_m)
            if problem.world * -(-m_shard // block_m) * -(-n // block_n) >= problem.sms:
                break
        big = block_m * block_n >= 128 * 128
        wide = problem.itemsize == 4
        return cls(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=32 if wide else 64, TMA=False,
                   SUBTILE=1, num_warps=8 if big else 4, num_stages=3 if big or wide else 4)

    @classmethod
    def settle(cls, base: "MatmulRsConfig", asked) -> "MatmulRsConfig":
        """``base`` updated by ``asked``; an epilogue cut not asked for narrows with
        an asked BLOCK_N (pieces stay >= 16 columns)."""
        cfg = base.replace(**asked)
        if "SUBTILE" not in asked:
            cfg = cfg.replace(SUBTILE=max(1, min(cfg.SUBTILE, cfg.BLOCK_N // 16)))
        return cfg

    def check(self, problem: Problem) -> None:
        if problem.platform == "gpu" and self.NUM_PROGRAMS > problem.sms:
            raise ValueError(f"jaxtdist.matmul_rs: config NUM_PROGRAMS={self.NUM_PROGRAMS} "
                             f"exceeds the {problem.sms} SMs (the persistent programs spin on "
                             "each other's ranks and must all be resident)")
        if self.PUSH == "tma" and not self.TMA:
            raise ValueError("jaxtdist.matmul_rs: config PUSH='tma' needs TMA=True (the GEMM "
                             "core's tiles); use PUSH='stores' or 'auto' with the pointer GEMM")
        _check_tma(self, problem)
        if self.BLOCK_N // self.SUBTILE < 16:
            raise ValueError(f"jaxtdist.matmul_rs: config SUBTILE={self.SUBTILE} must be 1, 2 "
                             f"or 4 with BLOCK_N / SUBTILE >= 16 (BLOCK_N={self.BLOCK_N})")

    @classmethod
    def search_space(cls, problem: Problem) -> list[dict]:
        if problem.platform != "gpu":
            return cls.fitting(problem, [{}, dict(BLOCK_N=16), dict(NUM_PROGRAMS=1),
                                           dict(PARTIAL="float32"), dict(FLATTEN=False),
                                           dict(PUSH="stores")])
        tiles = [dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=8 if bm >= 128 else 4,
                      SUBTILE=4 if bn == 256 else 2)
                 for bm, bn in ((128, 128), (128, 256), (64, 256), (64, 128))]
        extra = [dict(t, num_stages=s) for t in tiles[:2] for s in (3, 4)]
        extra += [dict(PARTIAL="float32"), dict(GROUP_M=4), dict(GROUP_M=16), dict(FLATTEN=False),
                  dict(PUSH="stores")]
        return cls.fitting(problem, [{}] + tiles + extra)

    def programs(self, problem: Problem, tiles: int) -> int:
        """The persistent grid: NUM_PROGRAMS (0: one per SM; 3 under the
        interpreter), never more than there are tiles."""
        asked = self.NUM_PROGRAMS or (problem.sms if problem.platform == "gpu"
                                      else _CPU_PROGRAMS)
        return max(1, min(asked, tiles))


@dataclasses.dataclass(frozen=True)
class MatmulArConfig(KernelConfig):
    """How matmul_ar's kernel runs one problem (one program per output tile).

    Attributes:
      BLOCK_M, BLOCK_N, BLOCK_K: GEMM tile (powers of 2, >= 16).
      GROUP_M: row tiles per group of the tile order.
      TMA: load the operands with TMA (the GEMM core's mainloop; rows of x and w
        16-byte multiples), else with pointer loads.
      SPLIT_K: programs per output tile, each over its own range of K (at most
        the K blocks; their float32 partials meet in a local workspace first).
      TWO_SHOT: reduce each tile on one owner rank and broadcast its sum (each
        rank sends (W - 1) / W of the partials and of the output), else one
        shot (every partial to every peer: one link round trip, (W - 1) x the
        partials' bytes). Default: two shot where one shot would send more
        than ``_AR_ONE_SHOT_BYTES`` per rank.
      PARTIAL: dtype of the pushed partials, "float32" or "input" (x's dtype:
        half the bytes, one more rounding). Default: "input" with two shot
        (bytes rule), "float32" with one shot (latency rules). The sum is
        float32 either way, and the same bits on every rank.
      num_warps, num_stages: launch options.
    """
    OP: ClassVar[str] = "matmul_ar"
    variant: ClassVar[str] = "push"

    BLOCK_M: int = block(16)
    BLOCK_N: int = block(64)
    BLOCK_K: int = block(128)
    GROUP_M: int = setting(1)
    TMA: bool = True
    SPLIT_K: int = setting(1)
    TWO_SHOT: bool = False
    PARTIAL: str = setting("float32", choices=_PARTIALS)
    num_warps: int = 4
    num_stages: int = 4

    @classmethod
    def default(cls, problem: Problem) -> "MatmulArConfig":
        """The tiles of ``_default_tiles``; the exchange by bytes: two shot with
        partials in x's dtype where one shot's float32 partials would pass
        ``_AR_ONE_SHOT_BYTES`` per rank, else one shot in float32."""
        m, n, _ = problem.shape
        cfg = cls._default_tiles(problem)
        # One shot's bytes per rank: (W - 1) float32 partials of [M, N]. At W = 2
        # two shot sends as many partials, but in x's dtype: on 2 x H100 (N 8192,
        # K 8192 split) 54.1 us against one shot's 57.7 at 128 rows, 112.9 against
        # 125.2 at 512; 47.8 against 44.4 at 64 rows (2 MB).
        if problem.world >= 2 and (problem.world - 1) * m * n * 4 > _AR_ONE_SHOT_BYTES:
            cfg = cfg.replace(TWO_SHOT=True, PARTIAL="input")
        return cfg

    @classmethod
    def settle(cls, base: "MatmulArConfig", asked) -> "MatmulArConfig":
        """``base`` updated by ``asked``; partials asked for by TWO_SHOT alone follow
        its default (two shot in x's dtype, one shot in float32)."""
        cfg = base.replace(**asked)
        if "TWO_SHOT" in asked and "PARTIAL" not in asked:
            cfg = cfg.replace(PARTIAL="input" if cfg.TWO_SHOT else "float32")
        return cfg

    @classmethod
    def _default_tiles(cls, problem: Problem) -> "MatmulArConfig":
        """One rule: pointer loads; all rows in one tile up to 64 rows; below 64 rows
        (decode), the widest N tile up to 64 whose count, times a K split, still
        covers nearly every SM (decode reads w once, spread over the SMs)."""
        m, n, k = problem.shape
        fit_m = max(16, next_pow2(m))
        tma = tma_fits(k, n, problem.itemsize)
        if problem.platform != "gpu":
            return cls(BLOCK_M=min(32, fit_m), BLOCK_N=32, BLOCK_K=32, TMA=tma, num_warps=4,
                       num_stages=1)
        # Pointer loads on every shape: on 1 x H200 (world 1, CUPTI) TMA ran 12.2 us
        # against 10.8 at 128 x 8192 x 2048, 6.7 against 5.3 at 256 x 4096 x 512 and
        # 24.3 against 22.2 at 32 x 4096 x 7168: a kernel this short pays for building
        # its descriptors on the device.
        block_m = min(64, fit_m)
        wide = problem.itemsize == 4
        if m >= 128 and not wide:
            # 128 rows or more: 128-row tiles (two warpgroups), the widest of 256, 128
            # and 64 columns whose tiles still cover nearly every SM. On 1 x H100
            # (CUPTI, world 1): 128 x 64 ran 11.8 us at 128 x 8192 x 2048 (jnp.dot
            # 18.0; 64 x 128 with 4 warps 14.3) and 4.2 at 256 x 4096 x 512 (4.0);
            # 128 x 256 45.5 at 512 x 8192 x 4096 (45.2; 128 x 128 53.3).
            m_tiles = -(-m // 128)
            block_n = next((bn for bn in (256, 128) if m_tiles * -(-n // bn)
                            >= _AR_COVER * problem.sms), 64)
            return cls(BLOCK_M=128, BLOCK_N=block_n, BLOCK_K=64,
                       GROUP_M=8 if 128 < m else 1, TMA=False, num_warps=8,
                       num_stages=3 if block_n == 256 else 4)
        if block_m == 64 and not wide:
            # 64 to 127 rows: 64 x 128 tiles, 64-deep K steps, 5 stages (the rule for
            # 128 rows before: 0.63-0.77x jnp.dot at 128 x 8192 x 2048 on 1 x H100,
            # against 1.02x with 64 x 64 tiles).
            return cls(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8 if block_m < m else 1,
                       TMA=False, num_warps=4, num_stages=5)
        # Decode rows: 64 columns a tile, and K split (each split >= 1024 of K) until the
        # tiles times the splits cover nearly every SM; 32 columns only where K is too
        # short to split. On 1 x H200 at 32 x 4096 x 7168 (jnp.dot 19.1 us, itself split
        # K) 64 tiles x 2 splits ran 18.6 us, 32 x 4 of 128 columns 20.0, 128 x 1 of 32
        # columns 22.2 (too narrow to stream w); at 1 x 8192 x 3584 (jnp.dot 15.9) 128
        # x 1 of 64 columns 15.8, 64 x 2 of 128 columns 16.9.
        m_tiles = -(-m // block_m)
        splits = [s for s in _AR_SPLITS if s == 1 or k // s >= _AR_MIN_K_SPLIT]
        for block_n in _AR_BLOCK_N:
            tiles = m_tiles * -(-n // block_n)
            split_k = next((s for s in splits if tiles * s >= _AR_COVER * problem.sms),
                           splits[-1])
            if tiles * split_k >= _AR_COVER * problem.sms:
                break
        return cls(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=64 if wide else 128,
                   GROUP_M=8 if block_m < m else 1, TMA=False, SPLIT_K=split_k, num_warps=4,
                   num_stages=3 if wide else 4)

    def check(self, problem: Problem) -> None:
        k_blocks = -(-problem.shape[2] // self.BLOCK_K)
        if self.SPLIT_K > k_blocks:
            raise ValueError(f"jaxtdist.matmul_ar: config SPLIT_K={self.SPLIT_K} exceeds the "
                             f"{k_blocks} blocks of K={problem.shape[2]} "
                             f"(BLOCK_K={self.BLOCK_K})")
        _check_tma(self, problem)

    @classmethod
    def search_space(cls, problem: Problem) -> list[dict]:
        if problem.platform != "gpu":
            return cls.fitting(problem, [{}, dict(BLOCK_N=16), dict(BLOCK_K=16),
                                           dict(SPLIT_K=2), dict(TMA=False),
                                           dict(TWO_SHOT=True), dict(PARTIAL="input")])
        tiles = [dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=w)
                 for bn in (32, 64, 128) for bk in (64, 128, 256) for w in (4, 8)]
        # Loads and K splits: the decode rows' open questions (TMA against pointer
        # loads, wide N tiles split along K against narrow ones).
        splits = [dict(TMA=tma, BLOCK_N=bn, SPLIT_K=s)
                  for tma in (False, True) for bn in (64, 128) for s in (1, 2, 4, 8)]
        exchange = [dict(TWO_SHOT=t, PARTIAL=p) for t in (False, True)
                    for p in _PARTIALS] if problem.world > 1 else []
        return cls.fitting(problem, [{}] + tiles + splits + exchange)


class PartialsWorkspace:
    """Byte layout of a partials inbox: one int32 flag per (source slot, output
    tile), then (``result_bytes`` > 0, matmul_ar's two shot) one int32 result
    flag per tile; then two parities (``epoch % 2``) of ``world - 1`` source
    slots of ``elems`` partials each (slot ``(src - dst + world - 1) % world``),
    followed by a results box of ``result_bytes`` (``results``: its offset
    within a parity); with ``own``, one local plane of ``elems`` partials last."""

    def __init__(self, world: int, elems: int, tiles: int, itemsize: int,
                 result_bytes: int = 0, own: bool = False):
        self.flags = 0
        self.result_flags = align(4 * (world - 1) * tiles)
        self.inbox = align(self.result_flags + (4 * tiles if result_bytes else 0))
        self.results = align((world - 1) * elems * itemsize)
        self.parity_bytes = self.results + align(result_bytes)
        # ``own``: a local plane of ``elems`` partials after the parities (matmul_ar's
        # own partial while it sums the ranks').
        self.own = self.inbox + 2 * self.parity_bytes
        self.nbytes = self.own + (align(elems * itemsize) if own else 0)


# -- shapes ----------------------------------------------------------------------

def _check(op: str, x, w) -> None:
    for name, a in (("x", x), ("w", w)):
        if not hasattr(a, "shape") or not hasattr(a, "dtype"):
            raise ValueError(f"jaxtdist.{op}: {name} must be an array, got {type(a).__name__}")
    if x.ndim != 2 or w.ndim != 2:
        raise ValueError(f"jaxtdist.{op}: x and w must be 2-D, got x{x.shape} and w{w.shape}")
    if x.shape[1] != w.shape[0]:
        raise ValueError(f"jaxtdist.{op}: contraction sizes differ: x{x.shape} has "
                         f"k={x.shape[1]} but w{w.shape} has k={w.shape[0]}")
    check_dtype(op, "x", x.dtype)
    if x.dtype != w.dtype:
        raise ValueError(f"jaxtdist.{op}: x and w must share a dtype, got {x.dtype.name} and "
                         f"{w.dtype.name}")
    if 0 in x.shape or 0 in w.shape:
        raise ValueError(f"jaxtdist.{op}: empty operand x{x.shape} w{w.shape}")


def _rs_check(x, w, *, axis_name, config=None) -> None:
    del config
    _check("matmul_rs", x, w)
    world = check_axis(runtime(), axis_name, "matmul_rs").world
    if x.shape[0] % world:
        raise ValueError(f"jaxtdist.matmul_rs: the rows of x (M={x.shape[0]}) must be "
                         f"divisible by the group size W={world} over {axis_name!r}: each rank "
                         "gets M / W rows of the sum (as psum_scatter requires)")


def _ar_check(x, w, *, axis_name, config=None) -> None:
    del axis_name, config
    _check("matmul_ar", x, w)


def _problem(call: Call, x, w) -> Problem:
    return Problem(call.platform, call.world, (x.shape[0], w.shape[1], x.shape[1]),
                   jnp.dtype(x.dtype).name, call.rt.sms)


def resolved_config(config_type: type, call: Call, x, w, axis_name, config) -> tuple:
    """The problem of ``call`` (matmul_rs or matmul_ar of x @ w) and the config its
    kernels take (``config`` over the defaults, or the tuned entry)."""
    problem = _problem(call, x, w)
    return problem, resolve(config_type, problem, call.rt, config, axis_name=axis_name)


# -- launches --------------------------------------------------------------------

def _push_pieces(cfg: MatmulRsConfig, itemsize: int, partial_itemsize: int) -> int:
    """Column pieces of a peer tile's TMA store (PUSH_SUBTILE): as few as fit in
    shared memory beside the pipeline's stages. A piece's buffer is free again
    only once TMA has read it out, at the link's pace: the last piece's wait
    falls under the next tile's mainloop, every earlier one holds the program."""
    stages = cfg.num_stages * (cfg.BLOCK_M + cfg.BLOCK_N) * cfg.BLOCK_K * itemsize
    for pieces in (1, 2):
        if stages + cfg.BLOCK_M * cfg.BLOCK_N // pieces * partial_itemsize <= SMEM_BUDGET:
            return pieces
    return cfg.SUBTILE


def matmul_rs_kernels(x: jax.Array, w: jax.Array, axis_name, *,
                      config: dict | None = None, trace_tiles: int = 0):
    """matmul_rs's kernel, at world 1 too (for the tuner and tests); not differentiable.

    ``config`` overrides the defaults (``MatmulRsConfig``) and skips the tuning cache.
    With ``trace_tiles`` > 0 (a probe's view), also returns the int32
    [programs, trace_tiles, 3] clock stamps of each program's first tiles: start,
    mainloop done, epilogue done (low 32 bits of ns).
    """
    x, w = jnp.asarray(x), jnp.asarray(w)
    _rs_check(x, w, axis_name=axis_name)
    if isinstance(trace_tiles, bool) or not isinstance(trace_tiles, int) or trace_tiles < 0:
        raise ValueError(f"jaxtdist.matmul_rs: trace_tiles={trace_tiles!r} must be an int >= 0 "
                         "(0: no stamps)")
    return rs_launch(x, w, axis_name, config=config, trace_tiles=trace_tiles)


def _fp8_launch(op: str, problem: Problem, cfg, x, w, fp8, tma: bool) -> tuple:
    """(x, w as the kernel takes them, B_T, DOT_PRECISION, the scale arrays, the FP8
    constexprs, the output dtype). ``fp8``: (plan, x's scales, w's scales,
    ``_fp8_gemm.kernel_scales``) for FP8 x and K-major w; 16/32-bit calls pass x
    and w in the scales' places (ignored without SCALING)."""
    if fp8:
        plan, xs, ws = fp8
        check_block_k(op, plan, cfg.BLOCK_K)
        return x, w, True, None, (xs, ws), dict(SCALING=plan.scaling), plan.out
    b_t = weights_k_major(x.dtype.itemsize, tma)
    x_in, w_in, precision = kernel_operands(problem, x, w, tma=tma, k_major=b_t)
    return x_in, w_in, b_t, precision, (x_in, w_in), dict(SCALING=None), x.dtype


def rs_launch(x: jax.Array, w: jax.Array, axis_name, *, config: dict | None = None,
              trace_tiles: int = 0, fp8=None):
    """``matmul_rs_kernels`` unchecked (its caller checked x and w). ``fp8``: see
    ``_fp8_launch``; the partials then cross the links in float32."""
    call = Call("matmul_rs", axis_name)
    problem, cfg = resolved_config(MatmulRsConfig, call, x, logical_weight(w) if fp8 else w,
                                   axis_name, config)
    (m, k), n, world = x.shape, w.shape[0 if fp8 else 1], call.world
    m_shard = m // world
    partial = x.dtype if cfg.PARTIAL == "input" and not fp8 else jnp.dtype(jnp.float32)
    per_rank = -(-m_shard // cfg.BLOCK_M) * -(-n // cfg.BLOCK_N)
    plan = PartialsWorkspace(world, m_shard * n, per_rank, partial.itemsize)
    # The flags' layout depends on the tiling: calls of another tiling get
    # their own workspace (and epoch counter).
    ws = call.workspace("inbox", plan.nbytes, m_shard, n, partial.name, cfg.BLOCK_M,
                        cfg.BLOCK_N)
    programs = cfg.programs(problem, world * per_rank)
    # This rank's rows of a sum over the group: varies over the group's axes
    # and over whatever x and w vary over.
    varying = set(call.result_axes(local=(x, w))) | set(call.layout.axes)
    x_in, w_in, b_t, precision, scales, scaling, out_dtype = _fp8_launch(
        "matmul_rs", problem, cfg, x, w, fp8, cfg.TMA)
    # Without trace_tiles, the stamps' output is a one-element placeholder the
    # kernel never writes.
    stamps = (programs, trace_tiles, 3) if trace_tiles else (1,)
    out, trace = call.run(
        matmul_rs_kernel, x_in, w_in, *scales, workspace=ws, needs_scratch=cfg.TMA,
        deps=(x_in, w_in, *scales[:2 if fp8 else 0]),
        out_shape=[jax.ShapeDtypeStruct((m_shard, n), out_dtype),
                   jax.ShapeDtypeStruct(stamps, jnp.int32)], grid=(programs,),
        varying=tuple(a for a in call.rt.mesh.axis_names if a in varying),
        **cfg.launch_options(), M_SHARD=m_shard, N=n, K=k, INBOX_OFF=ws.offset + plan.inbox,
        PARITY_BYTES=plan.parity_bytes, FLAGS_OFF=ws.offset + plan.flags,
        PARTIAL_INPUT=cfg.PARTIAL == "input" and not fp8, WORLD=world, NUM_PROGRAMS=programs,
        INTERLEAVE=call.platform == "gpu", BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N,
        BLOCK_K=cfg.BLOCK_K, GROUP_M=cfg.GROUP_M, SUBTILE=cfg.SUBTILE, TMA=cfg.TMA,
        FLATTEN=bool(cfg.FLATTEN and cfg.TMA), DOT_PRECISION=precision, B_T=b_t,
        PUSH_TMA=world > 1 and cfg.TMA and (cfg.PUSH == "tma" or (
            cfg.PUSH == "auto" and problem.platform == "gpu")),
        PUSH_SUBTILE=_push_pieces(cfg, x_in.dtype.itemsize, partial.itemsize),
        TRACE_TILES=trace_tiles, **scaling)
    return (out, trace) if trace_tiles else out


def matmul_ar_kernels(x: jax.Array, w: jax.Array, axis_name, *,
                      config: dict | None = None) -> jax.Array:
    """matmul_ar's kernel, at world 1 too (for the tuner and tests); not differentiable."""
    x, w = jnp.asarray(x), jnp.asarray(w)
    _ar_check(x, w, axis_name=axis_name)
    return ar_launch(x, w, axis_name, config=config)


def ar_launch(x: jax.Array, w: jax.Array, axis_name, *,
              config: dict | None = None, fp8=None) -> jax.Array:
    """``matmul_ar_kernels`` unchecked (its caller checked x and w). ``fp8``: see
    ``_fp8_launch``; the partials then cross the links in float32."""
    call = Call("matmul_ar", axis_name)
    problem, cfg = resolved_config(MatmulArConfig, call, x, logical_weight(w) if fp8 else w,
                                   axis_name, config)
    (m, k), n, world = x.shape, w.shape[0 if fp8 else 1], call.world
    tiles = -(-m // cfg.BLOCK_M) * -(-n // cfg.BLOCK_N)
    partial = x.dtype if cfg.PARTIAL == "input" and not fp8 else jnp.dtype(jnp.float32)
    x_in, w_in, b_t, precision, scales, scaling, out_dtype = _fp8_launch(
        "matmul_ar", problem, cfg, x, w, fp8, cfg.TMA)
    two_shot = bool(cfg.TWO_SHOT and world > 1)
    # Tiles of more than 32 float32 elements per thread park their own partial
    # (kernels/matmul_ar._park); smaller ones sum in registers.
    park = cfg.BLOCK_M * cfg.BLOCK_N > 32 * 32 * cfg.num_warps
    plan = PartialsWorkspace(world, m * n, tiles, partial.itemsize,
                             m * n * jnp.dtype(out_dtype).itemsize if two_shot else 0,
                             own=park and world > 1)
    # The flags' layout depends on the tiling and the exchange, and the own plane on
    # park: calls of another get their own workspace (and epoch counter), not a
    # smaller one reused.
    ws = call.workspace("inbox", plan.nbytes, m, n, cfg.BLOCK_M, cfg.BLOCK_N, partial.name,
                        two_shot, park)
    split_k = cfg.SPLIT_K
    k_split = -(-k // (split_k * cfg.BLOCK_K)) * cfg.BLOCK_K  # whole K blocks per split
    partials_off = counters_off = -1
    if split_k > 1:
        # The counters count SPLIT_K arrivals per tile and call: calls of another
        # split or tiling get their own.
        split_plan = SplitKWorkspace(split_k, m, n, tiles)
        split_ws = call.workspace("split_k", split_plan.nbytes, m, n, split_k, cfg.BLOCK_M,
                                  cfg.BLOCK_N)
        partials_off = split_ws.offset + split_plan.partials
        counters_off = split_ws.offset + split_plan.counters
    # The same sum on every rank of the group: like psum, it does not vary over
    # the group's axes.
    return call.run(
        matmul_ar_kernel, x_in, w_in, *scales, workspace=ws,
        deps=(x_in, w_in, *scales[:2 if fp8 else 0]),
        out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
        needs_scratch=cfg.TMA,
        grid=(split_k * tiles,), varying=call.result_axes(reduced=(x, w)),
        **cfg.launch_options(), M=m, N=n, K=k, INBOX_OFF=ws.offset + plan.inbox,
        PARITY_BYTES=plan.parity_bytes, FLAGS_OFF=ws.offset + plan.flags,
        PARTIALS_OFF=partials_off, COUNTERS_OFF=counters_off, SPLIT_K=split_k,
        K_SPLIT=k_split, BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K,
        GROUP_M=cfg.GROUP_M, TMA=cfg.TMA, TWO_SHOT=two_shot,
        RESULTS_OFF=ws.offset + plan.inbox + plan.results,
        RFLAGS_OFF=ws.offset + plan.result_flags, OWN_OFF=ws.offset + plan.own, PARK=park,
        PARTIAL_INPUT=cfg.PARTIAL == "input" and not fp8,
        DOT_PRECISION=precision, B_T=b_t, **scaling)
