"""jaxtdist.grouped_matmul: the local grouped GEMM (MoE experts) on the GEMM core.

Shapes (``_check``), plan (``GroupedMatmulConfig``), launch
(``_forward``) and backward (dx on the same kernel, dw on
``grouped_dw_kernel``);
``DistributedOp`` supplies program order, remat safety and the custom_vjp.
The op is local: it runs in a group of one device (``axis_name=()``, world
1), whatever the mesh, and never communicates. The kernel is
``kernels/grouped_gemm.py``.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from jaxtdist.kernels.grouped_gemm import (grouped_dw_kernel, grouped_gemm_fp8_kernel,
                                           grouped_gemm_kernel)
from jaxtdist.ops._config import KernelConfig, Problem, block, resolve, setting
from jaxtdist.ops._fp8_gemm import Fp8Gemm, check_block_k, no_gradient
from jaxtdist.ops._fp8_grouped import grouped_fp8_plan, grouped_kernel_scales
from jaxtdist.ops._gemm_config import default_tiles, stages_for, tma_fits, weights_k_major
from jaxtdist.ops._op import DistributedOp, one_call_per_element
from jaxtdist.ops._precision import kernel_operands
from jaxtdist.ops._protocol import Call
from jaxtdist.ops._shapes import check_dtype, next_pow2

__all__ = ["GroupedMatmulConfig", "grouped_matmul", "grouped_matmul_kernels"]

# Groups the kernel's group table holds (one vector of the kernel: G <= MAX_GROUPS).
MAX_GROUPS = 256
# The group of one device every call runs in: no mesh axis, world 1.
_LOCAL = ()
# Hopper's shared memory per block, less Triton's barriers and conversions.
_SMEM_LIMIT = 227 << 10
# K ranges per output tile at most, and K blocks per range at least under the
# default (a range must be long enough to fill the mainloop's pipeline).
MAX_SPLIT_K = 16
_MIN_SPLIT_K_BLOCKS = 8
# Decode: up to this many rows in all (16 tokens' top-2), 16-bit operands, the tile
# has BLOCK_M >= R rows, so that no group's weights are read by two row tiles,
# and mma.sync instead of wgmma's 64 rows: the GEMM is the weights' read.
_DECODE_ROWS = 32
_DECODE_STAGES = 6
# Where it splits, the default cuts K until every program has this many
# (tile, range) items: the routing decides how many groups have rows, so a
# partial last round matters less the more rounds there are.
_SPLIT_K_ROUNDS = 3


def split_k(r: int, h: int, f: int, g: int, block_m: int, block_n: int, block_k: int,
            sms: int, itemsize: int = 2) -> int:
    """The default SPLIT_K for [R, H] x [G, H, F] in BLOCK_M x BLOCK_N tiles.

    K is split only where the tiles, one row tile per group (a group has at most
    BLOCK_M rows on average), are fewer than the SMs: then SMs idle while the
    others stream their tiles' weights. It is cut into ranges enough for
    ``_SPLIT_K_ROUNDS`` items per SM, each range at least ``_MIN_SPLIT_K_BLOCKS``
    K blocks, the float32 partials (written and read back) at most an eighth of
    the weights' bytes. The default applies it to the GEMM core's tiles (16-bit
    operands in at most ``_DECODE_ROWS`` rows take ``_decode_tiles``, unsplit).
    On 1 x H200 (``tests/gpu/probe_defaults.py grouped_decode``, bf16, 16 rows
    over 8 experts: 128 tiles of 64 x 128):
    16 x 5632 x 2048 took 59.1 us unsplit, 52.5 / 46.6 / 49.0 / 51.1 with 2 / 4 /
    5 / 8 ranges (ragged_dot 50.8); 16 x 14336 x 4096 210.0 unsplit, 209.8 with 4
    (ragged_dot 223.3). Where the tiles fill the SMs, splitting lost: 16 x 2048 x
    5632 (176 tiles) 34.5 unsplit, 38.1 / 41.4 with 2 / 3 ranges.
    """
    tiles = min(g, r) * -(-f // block_n)
    if r > g * block_m or tiles >= sms:
        return 1
    most = max(1, min(MAX_SPLIT_K, -(-h // block_k) // _MIN_SPLIT_K_BLOCKS,
                      g * h * itemsize // (64 * r)))
    split = 1
    while split < most and tiles * split < _SPLIT_K_ROUNDS * sms:
        split += 1
    return split


# -- config ----------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class GroupedMatmulConfig(KernelConfig):
    """How the grouped GEMM tiles one problem (shape key (R, H, F, G)).

    Attributes:
      BLOCK_M, BLOCK_N, BLOCK_K: the tile (powers of 2, >= 16).
      GROUP_M: row tiles of one group that share columns in the tile order.
      NUM_PROGRAMS: programs of the persistent grid (0: one per SM on GPUs,
        at most the tiles there can be).
      SUBTILE: column pieces of the TMA store (1, 2 or 4; ``store_tile``).
      SPLIT_K: K ranges each output tile is cut into (1 to ``MAX_SPLIT_K``): float32
        partials the op sums, for few rows per group (``split_k``).
      num_warps, num_stages: launch options.
    """
    OP: ClassVar[str] = "grouped_matmul"
    variant: ClassVar[str] = "persistent"

    BLOCK_M: int = block(128)
    BLOCK_N: int = block(256)
    BLOCK_K: int = block(64)
    GROUP_M: int = setting(8)
    NUM_PROGRAMS: int = setting(0, low=0)
    SUBTILE: int = setting(4, choices=(1, 2, 4))
    SPLIT_K: int = setting(1, high=MAX_SPLIT_K, note="(K ranges per output tile)")
    num_warps: int = 8
    num_stages: int = 3

    @classmethod
    def default(cls, problem: Problem) -> "GroupedMatmulConfig":
        """The GEMM core's rule (``default_tiles``) with each group's rows as one
        rank's (groups tile on their own, like ranks), sized for R / G rows per
        group; the interpreter takes small tiles and 3 programs."""
        r, h, f, g = problem.shape
        if problem.platform != "gpu":
            return cls(BLOCK_M=16, BLOCK_N=32, BLOCK_K=16, GROUP_M=2, NUM_PROGRAMS=3,
                       SUBTILE=2, num_warps=4, num_stages=1)
        if problem.itemsize == 2 and r <= _DECODE_ROWS:
            return cls._decode_tiles(r)
        cfg = cls._core_tiles(problem, max(1, r // g), f, h)
        return cfg.replace(SPLIT_K=split_k(r, h, f, g, cfg.BLOCK_M, cfg.BLOCK_N, cfg.BLOCK_K,
                                           problem.sms, problem.itemsize))

    @classmethod
    def weight_gradient(cls, problem: Problem) -> "GroupedMatmulConfig":
        """The weights' gradient kernel's config (``grouped_dw_kernel``): the same
        rule, each group an H x F output over its R / G rows on average."""
        r, h, f, g = problem.shape
        if problem.platform != "gpu":
            return cls.default(problem)
        return cls._core_tiles(problem, h, f, max(1, r // g))

    @classmethod
    def _decode_tiles(cls, r: int) -> "GroupedMatmulConfig":
        """R <= ``_DECODE_ROWS`` rows of 16-bit operands: 16 or 32-row tiles (every
        group's rows in one), 256 columns, the deepest pipeline that fits beside a
        float32 epilogue, K not split. On 1 x H200 (``tests/gpu/probe_defaults.py
        grouped_decode_tiles``, bf16, 2 rows for each of 8 experts) they took
        54.0 / 53.4 / 224.1 / 217.3 us for 16 x 2048 x 5632, 16 x 5632 x 2048,
        16 x 4096 x 14336 and 16 x 14336 x 4096, against 58.1 / 56.5 / 239.7 / 221.7
        for the GEMM core's 64-row tiles (ragged_dot 49.1 / 51.5 / 217.8 / 225.3).
        Splitting K gained up to 9% on some shapes and lost up to 22% on others
        (16 x 5632 x 2048 with 6 of 8 experts used: 38.0 unsplit, 46.5 in 2 ranges),
        so it is left to the tuner."""
        bm, bn, bk, subtile = max(16, next_pow2(r)), 256, 64, 4
        # A float32 epilogue: the tuner's K splits store float32 partials.
        stages = stages_for(bm, bn, bk, 2, subtile, epilogue_itemsize=4,
                            max_stages=_DECODE_STAGES)
        return cls(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, NUM_PROGRAMS=0,
                   SUBTILE=subtile, num_warps=4, num_stages=stages)

    @classmethod
    def _core_tiles(cls, problem: Problem, rows: int, n: int, k: int) -> "GroupedMatmulConfig":
        """``default_tiles`` for G blocks of rows x n outputs over k."""
        t = default_tiles(rows, problem.shape[3], n, k, problem.itemsize, problem.sms)
        return cls(BLOCK_M=t.BLOCK_M, BLOCK_N=t.BLOCK_N, BLOCK_K=t.BLOCK_K, GROUP_M=8,
                   NUM_PROGRAMS=0, SUBTILE=t.SUBTILE, num_warps=t.num_warps,
                   num_stages=t.num_stages)

    def programs(self, problem: Problem, tiles: int | None = None) -> int:
        """The grid: NUM_PROGRAMS, or one per SM (the interpreter: 3), never more
        than ``tiles`` (default: the forward's items of the worst routing, every
        group's last tile partial, times the K ranges)."""
        r, _, f, g = problem.shape
        bound = tiles or (-(-r // self.BLOCK_M) + g) * -(-f // self.BLOCK_N) * self.SPLIT_K
        asked = self.NUM_PROGRAMS or (problem.sms if problem.platform == "gpu" else 3)
        return max(1, min(asked, bound))

    def check(self, problem: Problem) -> None:
        if self.BLOCK_N // self.SUBTILE < 8:
            raise ValueError(f"jaxtdist.grouped_matmul: config SUBTILE={self.SUBTILE} must be "
                             f"1, 2 or 4, with BLOCK_N / SUBTILE >= 8 (BLOCK_N={self.BLOCK_N})")
        if problem.platform == "gpu":
            # Split K stores float32 partials through the epilogue's buffer; FP8
            # operands' outputs are wider than they (up to float32: out_dtype).
            out_itemsize = (4 if self.SPLIT_K > 1 or problem.itemsize == 1
                            else problem.itemsize)
            smem = ((self.BLOCK_M + self.BLOCK_N) * self.BLOCK_K * self.num_stages
                    * problem.itemsize
                    + self.BLOCK_M * self.BLOCK_N // self.SUBTILE * out_itemsize)
            if smem > _SMEM_LIMIT:
                raise ValueError(
                    f"jaxtdist.grouped_matmul: config BLOCK_M={self.BLOCK_M} BLOCK_N="
                    f"{self.BLOCK_N} BLOCK_K={self.BLOCK_K} num_stages={self.num_stages} "
                    f"SUBTILE={self.SUBTILE} needs {smem} bytes of shared memory for "
                    f"{problem.dtype}; at most {_SMEM_LIMIT}")

    @classmethod
    def search_space(cls, problem: Problem) -> list[dict]:
        if problem.platform != "gpu":
            return cls.fitting(problem, [{}, dict(BLOCK_M=32, NUM_PROGRAMS=2)])
        bk = 32 if problem.itemsize == 4 else 64
        tiles = [(128, 256), (64, 256), (128, 128), (64, 128)]
        r, _, _, g = problem.shape
        # Few rows per group: K ranges too (the default's tile, float32 partials).
        splits = ([dict(SPLIT_K=s) for s in (1, 2, 4, 8)] if r <= 64 * g else [])
        return cls.fitting(problem, [{}] + splits + [
            dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SUBTILE=4 if bn == 256 else 2,
                 num_warps=8 if bm == 128 else 4,
                 num_stages=min(4, stages_for(bm, bn, bk, problem.itemsize,
                                              4 if bn == 256 else 2)))
            for bm, bn in tiles])


# -- shapes ----------------------------------------------------------------------

def _check(x, w, group_sizes, *, axis_name=_LOCAL, config=None) -> None:
    del axis_name, config
    if x.ndim != 2 or w.ndim != 3 or group_sizes.ndim != 1:
        raise ValueError(f"jaxtdist.grouped_matmul: expected x [R, H], w [G, H, F] and "
                         f"group_sizes [G], got x{x.shape}, w{w.shape}, "
                         f"group_sizes{group_sizes.shape}")
    g, h, _ = w.shape
    if x.shape[1] != h:
        raise ValueError(f"jaxtdist.grouped_matmul: x{x.shape} and w{w.shape} disagree on H "
                         "(x [R, H], w [G, H, F])")
    if group_sizes.shape[0] != g:
        raise ValueError(f"jaxtdist.grouped_matmul: group_sizes{group_sizes.shape} must have "
                         f"one size per group of w{w.shape}: ({g},)")
    if not 1 <= g <= MAX_GROUPS:
        raise ValueError(f"jaxtdist.grouped_matmul: w{w.shape} has G={g} groups; allowed: "
                         f"1 to {MAX_GROUPS}")
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"jaxtdist.grouped_matmul: group_sizes must be integers, got "
                         f"{group_sizes.dtype.name}")
    check_dtype("grouped_matmul", "x", x.dtype)
    if w.dtype != x.dtype:
        raise ValueError(f"jaxtdist.grouped_matmul: w has dtype {w.dtype.name}, x "
                         f"{x.dtype.name}: they must match (bfloat16, float16 or float32)")


# -- launch ----------------------------------------------------------------------

def grouped_matmul_kernels(x: jax.Array, w: jax.Array, group_sizes: jax.Array, *,
                           config: dict | None = None) -> jax.Array:
    """The grouped GEMM kernel's launch (not differentiable; ``grouped_matmul`` is).

    Call inside ``jax.shard_map`` over the mesh given to ``jaxtdist.initialize``.
    ``config`` overrides the defaults (``GroupedMatmulConfig``) and skips the
    tuning cache.
    """
    return _GROUPED_MATMUL.kernels(*(jnp.asarray(a) for a in (x, w, group_sizes)),
                                   axis_name=_LOCAL, config=config)


def _launch(x, w, group_sizes, config, *, w_t: bool, masked_m: int = 0,
            fp8: tuple | None = None) -> jax.Array:
    """x [R, H] times w[g] ([G, H, F]), or with ``w_t`` times w[g].T (w [G, F, H]),
    row group by row group -> [R, F]. ``masked_m`` > 0: the padded layout
    (``grouped_matmul_masked``), group g's rows from g * masked_m. ``fp8``: (plan,
    x's scales, w's scales) as the kernel takes them (``grouped_kernel_scales``),
    for FP8 x and K-major w (``w_t``): the result in the plan's dtype."""
    r, h = x.shape
    f = w.shape[1] if w_t else w.shape[2]
    out_dtype = fp8[0].out if fp8 else x.dtype
    if r == 0 or f == 0 or h == 0:
        return jnp.zeros((r, f), out_dtype)
    call, problem = _problem(x, f, w.shape[0])
    cfg = resolve(GroupedMatmulConfig, problem, call.rt, config, axis_name=_LOCAL)
    tma = problem.vendor == "nvidia" and tma_fits(h, f, problem.itemsize)
    kernel, extra = grouped_gemm_kernel, dict(W_T=w_t)
    if fp8:  # w is K-major for both mainloops (8-bit wgmma reads B only so)
        check_block_k("grouped_matmul", fp8[0], cfg.BLOCK_K)
        kernel, extra = grouped_gemm_fp8_kernel, dict(SCALING=fp8[0].scaling, scales=fp8[1:])
    elif w_t and not tma:  # the pointer GEMM reads w[g] row-major: transpose it
        w, extra = jnp.swapaxes(w, 1, 2), dict(W_T=False)
    elif not w_t and weights_k_major(problem.itemsize, tma):
        w, extra = jnp.swapaxes(w, 1, 2), dict(W_T=True)
    if cfg.SPLIT_K == 1:
        return _run(call, problem, cfg, kernel, x, w, group_sizes, (r, f), tma,
                    cfg.programs(problem), out_dtype=out_dtype, SPLIT_K=1, MASKED_M=masked_m,
                    **extra)
    # Split K: float32 partials [SPLIT_K, R, F], summed here in plane order (the same
    # bits every call) and rounded once.
    splits = cfg.SPLIT_K
    partials = _run(call, problem, cfg, kernel, x, w, group_sizes, (splits * r, f), tma,
                    cfg.programs(problem), out_dtype=jnp.float32, SPLIT_K=splits,
                    MASKED_M=masked_m, **extra)
    return jnp.sum(partials.reshape(splits, r, f), axis=0).astype(out_dtype)


def _launch_dw(x, dy, group_sizes) -> jax.Array:
    """dw [G, H, F] = x[rows of g].T @ dy[rows of g] per group (the weights' gradient)."""
    (r, h), f, g = x.shape, dy.shape[1], group_sizes.shape[0]
    if r == 0 or h == 0 or f == 0:
        return jnp.zeros((g, h, f), x.dtype)
    call, problem = _problem(x, f, g)
    cfg = GroupedMatmulConfig.weight_gradient(problem)
    tiles = g * -(-h // cfg.BLOCK_M) * -(-f // cfg.BLOCK_N)
    # x's rows read as TMA's K (16-byte rows of x and dy), dw stored by TMA.
    tma = problem.vendor == "nvidia" and tma_fits(h, f, problem.itemsize)
    return _run(call, problem, cfg, grouped_dw_kernel, x, dy, group_sizes, (g, h, f), tma,
                cfg.programs(problem, tiles))


def _problem(x, f: int, g: int) -> tuple[Call, Problem]:
    """The local call and its problem (R, H, F, G) for x [R, H]."""
    call = Call("grouped_matmul", _LOCAL)
    return call, Problem(call.platform, 1, (x.shape[0], x.shape[1], f, g),
                         jnp.dtype(x.dtype).name, call.rt.sms)


def _run(call, problem, cfg, kernel, a, b, group_sizes, out_shape, tma: bool, programs: int,
         out_dtype=None, scales: tuple | None = None, **extra) -> jax.Array:
    """Launches one of the grouped kernels (same constexprs; no heap memory: the
    workspace is the epoch counter the protocol keeps); the output in ``out_dtype``
    (default: the operands'). ``scales``: FP8's (x's, w's), inputs after the sizes
    (``grouped_gemm_fp8_kernel``, no DOT_PRECISION)."""
    r, h, f, g = problem.shape
    sizes = group_sizes.astype(jnp.int32)
    varying = call.result_axes(local=(a, b, sizes))
    if scales is None:
        a, b, precision = kernel_operands(problem, a, b, tma=tma)
        inputs, extra = (a, b, sizes), dict(extra, DOT_PRECISION=precision)
    else:
        inputs = (a, b, sizes, *scales)
    return call.run(
        kernel, *inputs, workspace=call.workspace("local", 1),
        out_shape=jax.ShapeDtypeStruct(out_shape, out_dtype or a.dtype), grid=(programs,),
        needs_scratch=tma, varying=varying,
        **cfg.launch_options(), R=r, H=h, F=f, G=g, BLOCK_G=max(16, next_pow2(g)),
        BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, GROUP_M=cfg.GROUP_M,
        NUM_PROGRAMS=programs, SUBTILE=cfg.SUBTILE, TMA=tma, **extra)


def _int32_sizes(group_sizes, rows: int) -> jax.Array:
    if group_sizes.dtype != jnp.int32:  # int64 (x64 on), uint32: clip at R rather than wrap
        group_sizes = jnp.clip(group_sizes, 0, rows)
    return group_sizes.astype(jnp.int32)


def _forward(x, w, group_sizes, *, axis_name=_LOCAL, config=None):
    del axis_name
    group_sizes = _int32_sizes(group_sizes, x.shape[0])
    return _launch(x, w, group_sizes, config, w_t=False), (x, w, group_sizes)


def _backward(residuals, ct, *, axis_name=_LOCAL, config=None):
    del axis_name, config
    x, w, group_sizes = residuals
    ct = ct.astype(x.dtype)
    # dx = ct @ w[g].T per group, on this kernel (w read transposed, no copy);
    # rows past the groups get zeros, as ragged_dot's VJP gives them.
    dx = one_call_per_element(lambda a, b, c: _launch(a, b, c, None, w_t=True))(
        ct, w, group_sizes)
    # dw[g] = x_g.T @ ct_g, a contraction over each group's rows.
    dw = one_call_per_element(_launch_dw)(x, ct, group_sizes)
    return dx, dw, None


_GROUPED_MATMUL = DistributedOp("grouped_matmul", forward=_forward, backward=_backward,
                                check=_check)


# -- FP8 (``_fp8_grouped``): checked in grouped_matmul, no backward (``no_gradient``) ---
# A variant: jaxtdist.explain's name lookup finds the 16/32-bit op.

def _check_sizes(op: str, groups: int, group_sizes, per_group: str) -> None:
    """group_sizes: G integers ([G] or, masked, [G] / [G, W]) for 1 <= G <= MAX_GROUPS."""
    if not 1 <= groups <= MAX_GROUPS:
        raise ValueError(f"jaxtdist.{op}: w has G={groups} groups; allowed: 1 to {MAX_GROUPS}")
    ndims = (1, 2) if per_group == "valid_rows" else (1,)
    if (group_sizes.ndim not in ndims or group_sizes.shape[0] != groups
            or not jnp.issubdtype(group_sizes.dtype, jnp.integer)):
        raise ValueError(f"jaxtdist.{op}: {per_group} must be integers with one entry per "
                         f"group of w (G={groups}), got "
                         f"{group_sizes.dtype.name}{list(group_sizes.shape)}")


def _fp8_forward(x, w, group_sizes, x_scale, w_scale, *, axis_name=_LOCAL, config=None,
                 plan: Fp8Gemm):
    del axis_name
    scales = grouped_kernel_scales(plan, x_scale, x.shape[0], w_scale, w.shape[0])
    return _launch(x, w, _int32_sizes(group_sizes, x.shape[0]), config, w_t=True,
                   fp8=(plan, *scales)), None


_GROUPED_MATMUL_FP8 = DistributedOp("grouped_matmul", forward=_fp8_forward, variant="fp8")


def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array, *,
                   x_scale: jax.Array | None = None, w_scale: jax.Array | None = None,
                   out_dtype=None, config: dict | None = None) -> jax.Array:
    """Grouped matmul: ``jax.lax.ragged_dot(x, w, group_sizes)`` on jaxtdist's GEMM core.

    Group g owns rows ``[off_g, off_g + group_sizes[g])`` of x (``off_g`` the sum
    of the sizes before it) and multiplies them by ``w[g]``. Sizes are device
    data: one compiled program serves every routing. Rows past
    ``sum(group_sizes)`` come out as zeros; groups reaching past R are clipped
    at R, and negative sizes count as zero (``jax.lax.ragged_dot`` leaves them
    unspecified).

    Call inside ``jax.shard_map`` over the mesh given to ``jaxtdist.initialize``
    (any axes: the op is local to each device and never communicates), e.g.
    on the experts' rows after ``jaxtdist.moe_dispatch``. One persistent
    kernel: tiles of every (group, row tile, column tile), TMA loads through
    the GEMM core's mainloop where rows of x, w and the output are 16-byte
    multiples, a masked pointer GEMM otherwise; results accumulate in float32
    and are rounded once to x's dtype. Where the groups have so few rows that
    their tiles leave SMs idle (MoE decode), each tile's K is cut into ranges
    whose float32 partials are summed in a fixed order (``SPLIT_K``).

    Differentiable on jaxtdist's kernels: dx on this kernel (w read
    transposed), dw on its companion (``grouped_dw_kernel``: a contraction
    over each group's rows); ``group_sizes`` gets no cotangent.

    FP8 (``x_scale``, ``w_scale`` given; ``jaxtdist.ops._fp8_grouped``): x [R, H]
    and w in one FP8 format (float8_e4m3fn or float8_e5m2), w K-major per group,
    [G, F, H] (``jaxtdist.quantize_weight`` of the [G, H, F] stack), float32
    dequantization scales, the result ``(x * x_scale)[rows of g] @ (w[g] *
    w_scale[g]).T`` in ``out_dtype``. Per tensor: x_scale (), w_scale () or [G]
    (one per group). Blockwise: x_scale [R, H / 128] (``jaxtdist.quantize(x,
    block=(1, 128))``), w_scale [G, cdiv(F, 128), H / 128]; H a multiple of 128.
    The same kernel and GEMM core (8-bit wgmma on Hopper), float32 accumulation,
    blockwise scales applied to each 128-deep partial in float32. Always the
    kernel, on every platform (the interpreter on CPU). Not differentiable (a
    TypeError names the arguments).

    Args:
      x: [R, H], bfloat16, float16 or float32; or FP8 with ``x_scale``.
      w: [G, H, F], x's dtype, 1 <= G <= 256; FP8: [G, F, H] (K-major per group).
      group_sizes: [G] integers. Sizes past int32's range need
        ``jax_enable_x64``: without it JAX wraps int64 arrays to int32 when they
        enter a traced function, before any op sees them.
      x_scale, w_scale: FP8 only: float32 scales, per tensor or blockwise (above).
      out_dtype: FP8 only: bfloat16 (default), float16 or float32.
      config: overrides of the kernel config (``GroupedMatmulConfig`` keys; advanced).

    Returns:
      [R, F] in x's dtype (FP8: ``out_dtype``).

    Example:
      >>> mesh = jax.make_mesh((1,), ("ep",)); jaxtdist.initialize(mesh)
      >>> f = jax.jit(jax.shard_map(jaxtdist.grouped_matmul, mesh=mesh,
      ...                           in_specs=(P(), P(), P()), out_specs=P()))
      >>> y = f(x, w, sizes)   # == jax.lax.ragged_dot(x, w, sizes)
      >>> wq, ws = jaxtdist.quantize_weight(w)                 # [G, F, H], blockwise
      >>> xq, xs = jaxtdist.quantize(x, block=(1, 128))
      >>> y8 = jaxtdist.grouped_matmul(xq, wq, sizes, x_scale=xs, w_scale=ws)  # bf16
    """
    x, w, group_sizes = (jnp.asarray(a) for a in (x, w, group_sizes))
    plan = grouped_fp8_plan("grouped_matmul", x, w, x_scale, w_scale, out_dtype)
    if plan is not None:
        _check_sizes("grouped_matmul", w.shape[0], group_sizes, "group_sizes")
        x, w, x_scale, w_scale = no_gradient("grouped_matmul", x, w, x_scale, w_scale)
        return _GROUPED_MATMUL_FP8(x, w, group_sizes, x_scale, w_scale, axis_name=_LOCAL,
                                   config=config, plan=plan)
    return _GROUPED_MATMUL(x, w, group_sizes, axis_name=_LOCAL, config=config)
