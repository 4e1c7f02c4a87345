"""Tile helpers shared by every kernel: tile orders, swizzles, the dot of a GEMM
step, masked row loads of one attention head, and pointers ordered after a wait
that keep their alignment. The GEMM mainloops built on ``dot_acc`` are in
``_gemm``."""

import triton
import triton.language as tl

import jaxtdist.language as dl
from jaxtdist.language._lowering import round_tf32


@triton.jit
def grouped_tile(tile, m_tiles, n_tiles, GROUP_M: tl.constexpr):
    """Maps a linear tile id to (m, n) so that GROUP_M row-tiles share columns (L2 reuse)."""
    per_group = GROUP_M * n_tiles
    group = tile // per_group
    first_m = group * GROUP_M
    rows = tl.minimum(m_tiles - first_m, GROUP_M)
    in_group = tile % per_group
    return first_m + in_group % rows, in_group // rows


@triton.jit
def rank_major_tile(tile, me, world, m_tiles_per_rank, n_tiles, GROUP_M: tl.constexpr):
    """Tile order of an all-gather consumer: this rank's shard first, then me+1, me+2, ...

    Local tiles need no data from peers and start at once; each peer's tiles
    come in the order its shard is expected to arrive, and ranks start on
    different peers so links are loaded evenly. Returns (source rank, m tile
    within that rank's shard, n tile).
    """
    per_rank = m_tiles_per_rank * n_tiles
    step = tile // per_rank
    src = (me + step) % world
    tm, tn = grouped_tile(tile % per_rank, m_tiles_per_rank, n_tiles, GROUP_M)
    return src, tm, tn


@triton.jit
def peer_arrival_tile(item, me, world, per_rank, m_tiles_per_rank, n_tiles,
                      GROUP_M: tl.constexpr):
    """Tile order over peers' tiles only, in the order the copy engines push
    them to this rank: rank me-1's first (it pushes to this rank first), then
    me-2, ... Returns (source rank, m tile within its shard, n tile)."""
    src = (me + world - 1 - item // per_rank) % world
    tm, tn = grouped_tile(item % per_rank, m_tiles_per_rank, n_tiles, GROUP_M)
    return src, tm, tn


@triton.jit
def block_range(block, BLOCK: tl.constexpr):
    """Indices ``[block * BLOCK, (block + 1) * BLOCK)``, marked contiguous and
    BLOCK-aligned so that loads and stores through them stay vectorized."""
    return tl.max_contiguous(tl.multiple_of(block * BLOCK + tl.arange(0, BLOCK), BLOCK), BLOCK)


@triton.jit
def block_offsets(rows, cols, M, N):
    """Offsets of the block ``rows`` x ``cols`` of a row-major [M, N] array, and the
    mask of its elements inside it."""
    return rows[:, None] * N + cols[None, :], (rows < M)[:, None] & (cols < N)[None, :]


@triton.jit
def dot_acc(a, b, acc, DOT_PRECISION: tl.constexpr):
    """``acc + a @ b``. DOT_PRECISION (``ops._precision``) applies to float32 inputs:
    ``tl.dot``'s input precision (None: the backend's default), or "tf32_rn": TF32
    with both operands first rounded to nearest ("tf32_rn_a": A only, B rounded
    by the op). The tensor cores read float32 operands as TF32 by dropping the
    low mantissa bits, a bias that leaves 2.6x the error of cuBLAS's TF32 GEMMs
    (1 x H100)."""
    if DOT_PRECISION == "tf32_rn":
        acc = tl.dot(round_tf32(a), round_tf32(b), acc, input_precision="tf32")
    elif DOT_PRECISION == "tf32_rn_a":
        acc = tl.dot(round_tf32(a), b, acc, input_precision="tf32")
    else:
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def load_rows(base, pos, hi, STRIDE: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
             MASKED: tl.constexpr):
    """Rows ``pos`` of a [*, D] slice whose rows are STRIDE elements apart (one
    head of [B, S, H, D] keys, values or queries): [len(pos), BLOCK_D]; with
    MASKED, rows at or past ``hi`` read as 0. No mask at all where none is
    needed (an unmasked block and D == BLOCK_D)."""
    d = tl.arange(0, BLOCK_D)
    ptrs = base + pos.to(tl.int64)[:, None] * STRIDE + d[None, :]
    if MASKED:
        if BLOCK_D == D:
            return tl.load(ptrs, mask=(pos < hi)[:, None], other=0.0)
        return tl.load(ptrs, mask=(pos < hi)[:, None] & (d < D)[None, :], other=0.0)
    if BLOCK_D == D:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=(d < D)[None, :], other=0.0)


@triton.jit
def aligned_after(ptr, token):
    """``ptr`` made data-dependent on ``token`` (a wait's or an atomic's result), so
    that loads through it cannot move above what produced the token, with the
    pointer's 16-byte alignment kept for the compiler (``dl.consume_token`` on a
    block of pointers hides it, and the loads then go out 2 or 4 bytes at a time).
    """
    zero = dl.consume_token(token.to(tl.int64) * 0, token)
    zero = (zero >> 4) << 4
    return (ptr.to(tl.pointer_type(tl.int8), bitcast=True) + zero).to(ptr.dtype, bitcast=True)
