"""Grouped GEMM on the GEMM core: out[R, F] = x[R, H] @ w[g] row group by row group.

Group g owns rows ``[off_g, off_g + size_g)`` of x, ``off_g`` the sum of the
sizes before it; ``sizes`` [G] int32 is device data (the routing of an MoE
layer), so one compiled kernel serves every routing. Sizes below zero count
as zero; groups are clipped at R (rows past R are never read or written, as
``jax.lax.ragged_dot`` clips them). Rows past ``min(sum(sizes), R)`` are
written as zeros (the MoE dispatch pads R): every element of out is written.

Schedule: a persistent grid (NUM_PROGRAMS programs, one per SM on GPUs);
every program computes the group table from ``sizes`` (G <= BLOCK_G, one
vector: offsets, ends and m-tile counts by ``tl.cumsum``), then takes tiles
``pid, pid + NUM_PROGRAMS, ...`` of the list: group 0's m-tiles x n-tiles
(``grouped_tile`` order, GROUP_M row tiles sharing columns), group 1's, ...,
then the zero tiles of the rows past the groups. A tile's group is the
number of groups whose tiles end at or before it (a vector compare: no loop).

Row tiles never mix groups: a group's m-tiles start at its own offset (not
at a multiple of BLOCK_M of x), so a tile holds rows of one group only at
the top; a tile at a group's end reads the next group's first rows (or, past
R, TMA's zeros), computes their products and drops them: its store is a
pointer store masked to the group's rows. Tiles wholly inside their group
store through the output's TMA descriptor (``store_tile``).

With TMA (``TMA``: rows of x, w and out are 16-byte multiples) the mainloop
is the GEMM core's ``tile_acc`` on x's descriptor [R, H] and one descriptor of
the weights stacked, w [G * H, F], made once per program, when BLOCK_K divides
H (no K block spans two groups); otherwise a descriptor of the tile's group
``w[g]`` [H, F] made on the device per tile, whose K bound gives a partial last
K block TMA's zeros, never group g + 1's weights. Without TMA, the pointer
mainloop ``pointer_tile_acc`` with masked rows, columns and K. The kernel uses no heap memory
and no signal: ``ctx`` is the calling protocol's context, unused.

``grouped_dw_kernel``: the weights' gradient dw[g] = x[rows of g].T @ dy[rows
of g] ([G, H, F]), a contraction over each group's rows: tiles of every (group,
H tile, F tile), the K loop over the group's whole BLOCK_K row blocks on the
core (x's tiles read transposed through TMA), then its last partial block with
masked pointer loads (the next group's rows read as zeros); empty groups
store zeros.

SPLIT_K (few rows per group: each group's weights are read once by few tiles,
too few to keep every SM streaming): the K range is cut into SPLIT_K ranges of
K_SPLIT (a multiple of BLOCK_K) and each (tile, range) is one item of the list;
out is then float32 [SPLIT_K, R, F], range s's partial products in plane s
(every plane's rows past the groups zeros), which the caller sums in a fixed
order. No counter and no heap: nobody waits for anybody.

W_T: w is [G, F, H] and group g multiplies by ``w[g].T``, read
through one descriptor of w [G * F, H] in [BLOCK_N, BLOCK_K] blocks that the
mainloop feeds to wgmma transposed (a block past F reads group g + 1's rows
into columns that are never stored): the backward's dx = dy @ w[g].T needs no
transposed copy of the weights. (The pointer mainloop reads w[g] K-major too;
the 16/32-bit op transposes w for it instead, FP8 takes it as it is.)

FP8 (``grouped_gemm_fp8_kernel``, the same body): x and K-major w (W_T: 8-bit
wgmma reads both operands K-major) in one FP8 format with float32 scales, the
GEMM core's ``SCALING``: "tensor" (x's per row, w's one per group) or "block"
(x's per row and 128 columns of H, w's per 128 x 128 block of each group: each
group's scale pointer is its own, the stacked descriptor's columns shifted back
to the group's, ``tile_acc``'s ``s_shift``). Each BLOCK_K-deep partial is scaled
in float32 before it joins the accumulator; the output is rounded once.
"""

import triton
import triton.language as tl

from jaxtdist.kernels._gemm import (out_desc, pointer_tile_acc, ranked_out_desc, store_tile,
                                   tile_acc, weight_desc)
from jaxtdist.kernels._tiles import dot_acc, grouped_tile


@triton.jit
def _pick(values, index, g):
    """values[g] of a [BLOCK_G] vector (``index`` its arange), as a scalar."""
    return tl.sum(tl.where(index == g, values, 0), axis=0)


@triton.jit
def group_table(sizes_ptr, R: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr,
                BLOCK_M: tl.constexpr, MASKED_M: tl.constexpr = 0):
    """(index, starts, ends, tile_starts, tile_ends, used) of the groups: row range
    [starts[g], ends[g]) clipped at R, m-tiles [tile_starts[g], tile_ends[g]) of the
    list, ``used`` = min(sum(sizes), R), the first row past the groups. Summed in
    int64 (sizes are data), returned in int32 (clipped at R, they fit).
    MASKED_M > 0 (the padded layout, R = G * MASKED_M): group g's rows start at
    g * MASKED_M, the first min(sizes[g], MASKED_M) valid; ``used`` = R (no zero
    tiles: rows past a group's valid ones are neither read nor written)."""
    index = tl.arange(0, BLOCK_G)
    sizes = tl.load(sizes_ptr + index, mask=index < G, other=0).to(tl.int64)
    if MASKED_M > 0:
        sizes = tl.minimum(tl.maximum(sizes, 0), MASKED_M)
        starts = tl.minimum(index.to(tl.int64) * MASKED_M, R)
        ends = starts + sizes
    else:
        sizes = tl.minimum(tl.maximum(sizes, 0), R)  # no overflow of the sums
        ends = tl.cumsum(sizes, axis=0)
        starts = tl.minimum(ends - sizes, R)
        ends = tl.minimum(ends, R)
    m_tiles = (ends - starts + BLOCK_M - 1) // BLOCK_M
    tile_ends = tl.cumsum(m_tiles, axis=0)
    used = tl.max(ends, axis=0)
    if MASKED_M > 0:
        used = used * 0 + R
    return (index, starts.to(tl.int32), ends.to(tl.int32), (tile_ends - m_tiles).to(tl.int32),
            tile_ends.to(tl.int32), used.to(tl.int32))


@triton.jit
def group_tile(t, index, starts, ends, tile_starts, tile_ends, n_tiles,
               GROUP_M: tl.constexpr, BLOCK_M: tl.constexpr):
    """Tile ``t`` of the list of a ``group_table``: (group, first row, end of the
    group's rows, column tile). A tile's group is the number of groups whose tiles
    end at or before it."""
    g = tl.sum((tile_ends * n_tiles <= t).to(tl.int32), axis=0)
    first = _pick(tile_starts, index, g)
    tm, tn = grouped_tile(t - first * n_tiles, _pick(tile_ends, index, g) - first, n_tiles,
                          GROUP_M)
    return g, _pick(starts, index, g) + tm * BLOCK_M, _pick(ends, index, g), tn


@triton.jit
def store_rows(out_ptr, acc, rows, row_end, cols, F: tl.constexpr):
    """Pointer store of the tile's rows below ``row_end`` and columns below F."""
    mask = (rows < row_end)[:, None] & (cols < F)[None, :]
    tl.store(out_ptr + rows[:, None] * F + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def grouped_gemm_kernel(ctx, x_ptr, w_ptr, sizes_ptr, out_ptr,
                        R: tl.constexpr, H: tl.constexpr, F: tl.constexpr, G: tl.constexpr,
                        BLOCK_G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                        NUM_PROGRAMS: tl.constexpr, SUBTILE: tl.constexpr,
                        TMA: tl.constexpr, DOT_PRECISION: tl.constexpr,
                        W_T: tl.constexpr = False, SPLIT_K: tl.constexpr = 1,
                        MASKED_M: tl.constexpr = 0):
    """Grid: (NUM_PROGRAMS,). x [R, H], w [G, H, F] ([G, F, H] with W_T), sizes [G]
    int32 -> out [R, F] (SPLIT_K > 1: float32 [SPLIT_K, R, F] of partials).
    MASKED_M > 0: the padded layout (``group_table``), x [G * MASKED_M, H]: only
    each group's first sizes[g] rows are computed and written.

    See the module docstring. TMA: H and F times the itemsize are multiples of
    16 bytes (the launch gives the kernel Triton's global scratch).
    """
    _grouped_gemm(x_ptr, w_ptr, sizes_ptr, out_ptr, None, None, R, H, F, G, BLOCK_G, BLOCK_M,
                  BLOCK_N, BLOCK_K, GROUP_M, NUM_PROGRAMS, SUBTILE, TMA, DOT_PRECISION, W_T,
                  SPLIT_K, MASKED_M, None)


@triton.jit
def grouped_gemm_fp8_kernel(ctx, x_ptr, w_ptr, sizes_ptr, x_scale_ptr, w_scale_ptr, out_ptr,
                            R: tl.constexpr, H: tl.constexpr, F: tl.constexpr,
                            G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            GROUP_M: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
                            SUBTILE: tl.constexpr, TMA: tl.constexpr,
                            SCALING: tl.constexpr, SPLIT_K: tl.constexpr = 1,
                            MASKED_M: tl.constexpr = 0):
    """``grouped_gemm_kernel`` with FP8 operands (the same body and GEMM core, its
    ``SCALING``): x [R, H] and w [G, F, H] (K-major per group: W_T, which 8-bit
    wgmma needs) in one FP8 format, float32 scales, out [R, F] in bf16 / f16 /
    f32 (SPLIT_K > 1: float32 partials).

    SCALING "tensor": x_scale [R] (the op broadcasts x's one scale over its rows),
    w_scale [G] (one per group). "block": x_scale [R, H / 128], w_scale [G,
    cdiv(F, 128), H / 128] (each group's 128 x 128 blocks; H a multiple of 128).
    TMA: H and F are multiples of 16 (bytes of the FP8 rows; F also of the
    output's rows)."""
    _grouped_gemm(x_ptr, w_ptr, sizes_ptr, out_ptr, x_scale_ptr, w_scale_ptr, R, H, F, G,
                  BLOCK_G, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, NUM_PROGRAMS, SUBTILE, TMA,
                  None, True, SPLIT_K, MASKED_M, SCALING)


@triton.jit
def _group_w_scales(w_scale_ptr, g, F: tl.constexpr, H: tl.constexpr, SCALING: tl.constexpr):
    """Group g's w scales as the GEMM core takes B's: its one scale ("tensor"), or
    its [cdiv(F, 128), H / 128] blocks ("block"). (x's scales are per row: every
    group's rows index the one array.)"""
    if SCALING == "block":
        per_group: tl.constexpr = (F + 127) // 128 * (H // 128)
        w_s = w_scale_ptr + g.to(tl.int64) * per_group
    else:
        w_s = w_scale_ptr + g
    return w_s


@triton.jit
def _grouped_gemm(x_ptr, w_ptr, sizes_ptr, out_ptr, x_scale_ptr, w_scale_ptr,
                  R: tl.constexpr, H: tl.constexpr, F: tl.constexpr, G: tl.constexpr,
                  BLOCK_G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
                  SUBTILE: tl.constexpr, TMA: tl.constexpr, DOT_PRECISION: tl.constexpr,
                  W_T: tl.constexpr, SPLIT_K: tl.constexpr, MASKED_M: tl.constexpr,
                  SCALING: tl.constexpr):
    """The grouped GEMM of both entry points (SCALING None: no scales, 16/32-bit)."""
    K_BLOCKS: tl.constexpr = H // 128
    pid = tl.program_id(0)
    index, starts, ends, tile_starts, tile_ends, used = group_table(sizes_ptr, R, G, BLOCK_G,
                                                                    BLOCK_M, MASKED_M)
    n_tiles: tl.constexpr = (F + BLOCK_N - 1) // BLOCK_N
    K_SPLIT: tl.constexpr = (H + BLOCK_K * SPLIT_K - 1) // (BLOCK_K * SPLIT_K) * BLOCK_K
    # Items: (tile, K range) with the range fastest, so that a tile's ranges run at
    # once; every plane gets the zero tiles.
    group_items = tl.max(tile_ends, axis=0) * n_tiles * SPLIT_K
    total = group_items + (R - used + BLOCK_M - 1) // BLOCK_M * n_tiles * SPLIT_K
    # One descriptor of every group's weights stacked, made once, where no block
    # reaches into the next group where it would count: w [G * H, F] when BLOCK_K
    # divides H; w [G * F, H] (W_T), where a column block past F reads the next
    # group's rows into columns that are never stored. Else a descriptor of w[g] per
    # tile, whose bounds give a partial block zeros (making one costs a global
    # write and a fence per tile: a few percent of a decode call).
    STACKED: tl.constexpr = W_T or H % BLOCK_K == 0
    if TMA:
        x_desc = tl.make_tensor_descriptor(x_ptr, shape=[R, H], strides=[H, 1],
                                           block_shape=[BLOCK_M, BLOCK_K])
        c_desc = out_desc(out_ptr, SPLIT_K * R, F, BLOCK_M, BLOCK_N, SUBTILE)
        if W_T:
            w_all = weight_desc(w_ptr, H, G * F, BLOCK_K, BLOCK_N, True)
        elif STACKED:
            w_all = weight_desc(w_ptr, G * H, F, BLOCK_K, BLOCK_N, False)
    for item in range(pid, total, NUM_PROGRAMS):
        split = item % SPLIT_K
        plane = out_ptr
        if SPLIT_K > 1:
            plane += tl.cast(split, tl.int64) * (R * F)
        if item < group_items:
            g, row0, row_end, tn = group_tile(item // SPLIT_K, index, starts, ends, tile_starts,
                                              tile_ends, n_tiles, GROUP_M, BLOCK_M)
            col0 = tn * BLOCK_N
            rows = row0.to(tl.int64) + tl.arange(0, BLOCK_M)  # rows * H, rows * F: int64
            cols = col0 + tl.arange(0, BLOCK_N)
            w_group = w_ptr + g.to(tl.int64) * (H * F)
            k_lo = split * K_SPLIT
            k_hi = tl.minimum(k_lo + K_SPLIT, H)
            row_mask = rows < row_end
            a_s = x_scale_ptr
            if SCALING == "tensor" or SCALING == "block":
                b_s = _group_w_scales(w_scale_ptr, g, F, H, SCALING)
            else:  # no scales (None)
                b_s = w_scale_ptr
            if TMA:
                if STACKED:
                    if W_T:
                        # (Scale columns are the group's own: shifted back by g * F.)
                        acc = tile_acc(x_desc, w_all, row0, g * F + col0, k_lo, k_hi, BLOCK_M,
                                       BLOCK_N, BLOCK_K, DOT_PRECISION, B_T=True,
                                       SCALING=SCALING, a_scale=a_s, b_scale=b_s, s_rows=rows,
                                       s_mask=row_mask, N_COLS=F, K_BLOCKS=K_BLOCKS,
                                       s_shift=g * F)
                    else:
                        acc = tile_acc(x_desc, w_all, row0, col0, k_lo, k_hi, BLOCK_M,
                                       BLOCK_N, BLOCK_K, DOT_PRECISION, b_k0=g * H)
                else:
                    w_desc = weight_desc(w_group, H, F, BLOCK_K, BLOCK_N, False)
                    acc = tile_acc(x_desc, w_desc, row0, col0, k_lo, k_hi, BLOCK_M,
                                   BLOCK_N, BLOCK_K, DOT_PRECISION)
                if row0 + BLOCK_M <= row_end:
                    store_tile(c_desc, acc, 0, split * R + row0, col0, BLOCK_M, BLOCK_N,
                               SUBTILE)
                else:  # the group's last rows: drop the next group's
                    store_rows(plane, acc, rows, row_end, cols, F)
            else:
                # W_T: w[g] read K-major ([F, H]: FP8; 16/32-bit ops transpose w here).
                acc = pointer_tile_acc(x_ptr + rows * H, w_group, row_mask, cols, cols < F,
                                       k_lo, k_hi, H, F, BLOCK_M, BLOCK_N, BLOCK_K,
                                       DOT_PRECISION, B_T=W_T, SCALING=SCALING, a_scale=a_s,
                                       b_scale=b_s, s_rows=rows)
                store_rows(plane, acc, rows, row_end, cols, F)
        else:  # rows past the groups: zeros
            zero = (item - group_items) // SPLIT_K
            row0 = used + (zero // n_tiles) * BLOCK_M
            col0 = (zero % n_tiles) * BLOCK_N
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            store_rows(plane, acc, row0.to(tl.int64) + tl.arange(0, BLOCK_M), R,
                        col0 + tl.arange(0, BLOCK_N), F)


@triton.jit
def grouped_dw_kernel(ctx, x_ptr, dy_ptr, sizes_ptr, dw_ptr,
                      R: tl.constexpr, H: tl.constexpr, F: tl.constexpr, G: tl.constexpr,
                      BLOCK_G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                      NUM_PROGRAMS: tl.constexpr, SUBTILE: tl.constexpr, TMA: tl.constexpr,
                      DOT_PRECISION: tl.constexpr):
    """Grid: (NUM_PROGRAMS,). x [R, H], dy [R, F], sizes [G] int32 -> dw [G, H, F],
    dw[g] = x[starts[g]:ends[g]].T @ dy[starts[g]:ends[g]] in float32, rounded once.

    TMA: rows of x, dy and dw are 16-byte multiples (the launch gives the kernel
    Triton's global scratch).
    """
    pid = tl.program_id(0)
    index, starts, ends, _, _, _ = group_table(sizes_ptr, R, G, BLOCK_G, BLOCK_M)
    m_tiles: tl.constexpr = (H + BLOCK_M - 1) // BLOCK_M
    n_tiles: tl.constexpr = (F + BLOCK_N - 1) // BLOCK_N
    per_group: tl.constexpr = m_tiles * n_tiles
    if TMA:
        xt_desc = tl.make_tensor_descriptor(x_ptr, shape=[R, H], strides=[H, 1],
                                            block_shape=[BLOCK_K, BLOCK_M])
        dy_desc = tl.make_tensor_descriptor(dy_ptr, shape=[R, F], strides=[F, 1],
                                            block_shape=[BLOCK_K, BLOCK_N])
        # [G, H, F]: a tile's store clips at the end of its group's H rows.
        dw_desc = ranked_out_desc(dw_ptr, G, H, F, BLOCK_M, BLOCK_N, SUBTILE)
    for tile in range(pid, G * per_group, NUM_PROGRAMS):
        g = tile // per_group
        tm, tn = grouped_tile(tile % per_group, m_tiles, n_tiles, GROUP_M)
        row0 = _pick(starts, index, g)
        row_end = _pick(ends, index, g)
        whole_end = row0 + (row_end - row0) // BLOCK_K * BLOCK_K
        hs = tm * BLOCK_M + tl.arange(0, BLOCK_M)
        fs = tn * BLOCK_N + tl.arange(0, BLOCK_N)
        if TMA:
            acc = tile_acc(xt_desc, dy_desc, tm * BLOCK_M, tn * BLOCK_N, row0, whole_end,
                           BLOCK_M, BLOCK_N, BLOCK_K, DOT_PRECISION, A_T=True)
            tail = whole_end
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            tail = row0
        # The rest (pointer path: every block) with the group's end masked.
        for r0 in range(tail, row_end, BLOCK_K):
            rs = r0 + tl.arange(0, BLOCK_K)
            r_mask = rs < row_end
            xt = tl.load(x_ptr + rs.to(tl.int64)[:, None] * H + hs[None, :],
                         mask=r_mask[:, None] & (hs < H)[None, :], other=0.0)
            d = tl.load(dy_ptr + rs.to(tl.int64)[:, None] * F + fs[None, :],
                        mask=r_mask[:, None] & (fs < F)[None, :], other=0.0)
            acc = dot_acc(tl.trans(xt), d, acc, DOT_PRECISION)
        if TMA:
            store_tile(dw_desc, acc, g, tm * BLOCK_M, tn * BLOCK_N, BLOCK_M, BLOCK_N, SUBTILE,
                       RANKED=True)
        else:
            tl.store(dw_ptr + tl.cast(g, tl.int64) * (H * F) + hs[:, None] * F + fs[None, :],
                     acc.to(dw_ptr.dtype.element_ty),
                     mask=(hs < H)[:, None] & (fs < F)[None, :])
