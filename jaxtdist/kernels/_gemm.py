"""The GEMM core every matmul kernel is built on (ag_matmul, matmul_rs, matmul_ar,
grouped_gemm, moe_tp): the two mainloops, TMA (``tile_acc``) and pointer
(``pointer_tile_acc``), and the TMA epilogue (``store_tile``).

A kernel is the core plus its prologue and epilogue: it makes tensor
descriptors (TMA) for its operands on the device, takes tiles in its own
order (rank-rotated, grouped, arrival order), waits for a tile's rows where
they come from peers, calls ``tile_acc`` (the software-pipelined K loop: TMA
loads into shared memory ``num_stages`` deep, wgmma on Hopper), and ends the
tile its own way (``store_tile``: a TMA store, cut along N so that the
output's shared-memory buffer is a fraction of the tile's; or pushes into
peers' heaps; or a reduction of peers' partials).

Why descriptors are made on the device: a host-made descriptor would bake one
buffer's address into the launch, and XLA gives each call new buffers; the
kernels also address peers' heaps, which only the device knows. It needs
Triton's global scratch (``needs_scratch=True`` at launch).

Row tiles of different ranks must not mix: where the output stacks every
rank's rows ([world * rows, N]), ``ranked_out_desc`` views it as [world, rows,
N] with a block of one rank's BLOCK_M rows, so that TMA clips a tile's store at
the end of its rank's rows and the rows need not be a multiple of BLOCK_M. The
loads stay 2-D (the mainloop is the same for every kernel): a tile at the end
of a rank's rows may read the next rank's first rows, whose products are
computed and dropped.

The pointer mainloop ``pointer_tile_acc`` serves what TMA cannot address
(rows that are not 16-byte multiples, rows picked from two arrays): masked
loads, rows, columns and K past the masks read as zeros, into the same
float32 accumulator through the same ``dot_acc`` step, so a kernel picks a
mainloop by a constexpr and keeps one epilogue. It takes A as one pointer per
row, B as row-major [K, N], or [N, K] with B_T.

FP8 (``SCALING``, a constexpr; None: no scales, the 16/32-bit path unchanged):
float8_e4m3fn / float8_e5m2 operands, B K-major ([N, K], ``B_T``: 8-bit wgmma
reads both operands K-major), float32 accumulation, and float32 dequantization
scales (x ~ q * scale) in one of two schemes:

- "tensor": A's scale per row (``a_scale[s_rows]``: the ops broadcast one
  per-tensor scale over the rows, which also lets a gathered A carry each
  rank's own), B's one scale (``b_scale[0]``); applied once, to the tile's
  float32 sum, at the end of the mainloop.
- "block": A's scales [rows, K_BLOCKS] per (row, 128 columns of K), B's
  [cdiv(N, 128), K_BLOCKS] per 128 x 128 block (K_BLOCKS = K / 128); each
  BLOCK_K-deep partial product (BLOCK_K divides 128: with BLOCK_K = 128 every
  128 of K, as DeepGEMM promotes) is scaled in float32 before it joins the
  accumulator, so the tensor cores' limited FP8 accumulation never spans more
  than one block.

The mainloop returns the scaled float32 tile, so every epilogue (stores,
split-K and stream-K partial sums, pushes to peers) is the same for FP8.
Triton's interpreter runs FP8 dots itself (measured exact against a float32
product of the FP8 values, Triton 3.6.0), so the CPU backend runs these very
loads, scales and dots: no upcast.
"""

import triton
import triton.language as tl

from jaxtdist.kernels._tiles import dot_acc


@triton.jit
def _block_scales(kb, a_scale, b_scale, s_rows, s_mask, cols, col_mask,
                  K_BLOCKS: tl.constexpr):
    """The [BLOCK_M, BLOCK_N] float32 product of A's and B's scales of K block ``kb``
    (SCALING "block"); rows and columns outside the masks scale by 0."""
    a_s = tl.load(a_scale + s_rows * K_BLOCKS + kb, mask=s_mask, other=0.0)
    b_s = tl.load(b_scale + (cols // 128) * K_BLOCKS + kb, mask=col_mask, other=0.0)
    return a_s[:, None] * b_s[None, :]


@triton.jit
def _tensor_scaled(acc, a_scale, b_scale, s_rows, s_mask):
    """``acc`` times A's row scales and B's one scale (SCALING "tensor")."""
    a_s = tl.load(a_scale + s_rows, mask=s_mask, other=0.0)
    return acc * (a_s[:, None] * tl.load(b_scale))


@triton.jit
def _scaled_step(acc, a, b, k0, DOT_PRECISION: tl.constexpr, SCALING: tl.constexpr, a_scale,
                 b_scale, s_rows, s_mask, cols, col_mask, K_BLOCKS: tl.constexpr):
    """One K step of either mainloop: ``acc + a @ b``; with SCALING "block" the step's
    own partial is scaled in float32 (K block ``k0 // 128``) before it joins the sum."""
    if SCALING == "block":
        part = dot_acc(a, b, tl.zeros(acc.shape, dtype=tl.float32), DOT_PRECISION)
        return acc + part * _block_scales(k0 // 128, a_scale, b_scale, s_rows, s_mask, cols,
                                          col_mask, K_BLOCKS)
    return dot_acc(a, b, acc, DOT_PRECISION)


@triton.jit
def tile_acc(a_desc, b_desc, row0, col0, k_lo, k_hi, BLOCK_M: tl.constexpr,
             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
             NUM_STAGES: tl.constexpr = None, B_T: tl.constexpr = False,
             A_T: tl.constexpr = False, b_k0=0, SCALING: tl.constexpr = None,
             a_scale=None, b_scale=None, s_rows=None, s_mask=None, N_COLS=0,
             K_BLOCKS: tl.constexpr = 0, s_shift=0):
    """The TMA mainloop: the float32 accumulator of A[row0:, k_lo:k_hi] @ B[k_lo:k_hi, col0:]
    for 2-D descriptors of A [M, K] (block [BLOCK_M, BLOCK_K]) and B [K, N] (block
    [BLOCK_K, BLOCK_N]); with A_T of A's transpose [K, M] (block [BLOCK_K,
    BLOCK_M]), with B_T of B's [N, K] (block [BLOCK_N, BLOCK_K]): wgmma reads such
    tiles transposed from shared memory, no copy. DOT_PRECISION: as in
    ``_tiles.dot_acc``. NUM_STAGES: the pipeline depth (None: the kernel's
    num_stages). ``b_k0``: B's K coordinate of A's K 0 (B one [K, N] block of a
    descriptor that stacks several, as the grouped GEMM's weights).

    SCALING (FP8, see the module docstring): None, "tensor" or "block", with the
    scale arrays ``a_scale`` / ``b_scale``, the tile's rows of A's scales
    ``s_rows`` ([BLOCK_M] indices, ``s_mask`` those that exist), B's column count
    ``N_COLS`` and K_BLOCKS (scale columns per row). "block": BLOCK_K divides 128
    and k_lo is a multiple of BLOCK_K, so that no K step spans two blocks.
    ``s_shift``: subtracted from col0 for B's scale columns, where the descriptor
    stacks several B's along N, each with its own scales (the grouped GEMM's K-major
    weights [G * F, H]: group g's column c is the descriptor's g * F + c)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if SCALING == "block":
        tl.static_assert(128 % BLOCK_K == 0, "blockwise FP8 scales: BLOCK_K must divide 128")
    # B's columns (the block scales'; unused otherwise).
    cols = (col0 - s_shift) + tl.arange(0, BLOCK_N)
    col_mask = cols < N_COLS
    for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=NUM_STAGES):
        if A_T:
            a = a_desc.load([k0, row0]).T
        else:
            a = a_desc.load([row0, k0])
        if B_T:
            b = b_desc.load([col0, k0]).T
        else:
            b = b_desc.load([b_k0 + k0, col0])
        acc = _scaled_step(acc, a, b, k0, DOT_PRECISION, SCALING, a_scale, b_scale, s_rows,
                           s_mask, cols, col_mask, K_BLOCKS)
    if SCALING == "tensor":
        acc = _tensor_scaled(acc, a_scale, b_scale, s_rows, s_mask)
    return acc


@triton.jit
def pointer_tile_acc(a_rows, b_ptr, row_mask, cols, col_mask, k_lo, k_hi, K: tl.constexpr,
                     N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
                     B_T: tl.constexpr = False, SCALING: tl.constexpr = None,
                     a_scale=None, b_scale=None, s_rows=None):
    """The pointer mainloop: the float32 accumulator of A[rows, k_lo:k_hi] @ B[k_lo:k_hi,
    cols], A's rows at ``a_rows`` ([BLOCK_M] pointers to rows of K elements: one
    array's, ``a_ptr + rows * K``, or rows picked from several), B row-major [K, N]
    (with B_T, [N, K]: K-major), rows and columns outside ``row_mask`` /
    ``col_mask`` and K past K read as zeros; DOT_PRECISION as in ``_tiles.dot_acc``.
    SCALING, ``a_scale``, ``b_scale``: as in ``tile_acc``, A's scale rows at
    ``s_rows`` (masked by ``row_mask``), cdiv(K, 128) scales per row."""
    K_BLOCKS: tl.constexpr = (K + 127) // 128
    if SCALING == "block":
        tl.static_assert(128 % BLOCK_K == 0, "blockwise FP8 scales: BLOCK_K must divide 128")
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        ks = tl.max_contiguous(tl.multiple_of(k0 + tl.arange(0, BLOCK_K), BLOCK_K), BLOCK_K)
        k_mask = ks < K
        a = tl.load(a_rows[:, None] + ks[None, :], mask=row_mask[:, None] & k_mask[None, :],
                    other=0.0)
        b_mask = k_mask[:, None] & col_mask[None, :]
        if B_T:
            b = tl.load(b_ptr + cols[None, :] * K + ks[:, None], mask=b_mask, other=0.0)
        else:
            b = tl.load(b_ptr + ks[:, None] * N + cols[None, :], mask=b_mask, other=0.0)
        acc = _scaled_step(acc, a, b, k0, DOT_PRECISION, SCALING, a_scale, b_scale, s_rows,
                           row_mask, cols, col_mask, K_BLOCKS)
    if SCALING == "tensor":
        acc = _tensor_scaled(acc, a_scale, b_scale, s_rows, row_mask)
    return acc


@triton.jit
def weight_desc(w_ptr, K, N, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, B_T: tl.constexpr):
    """B's descriptor for ``tile_acc``: of w [K, N], or with B_T of its transpose
    [N, K], K-major (pass ``B_T=B_T`` to ``tile_acc`` too). float32 takes the
    transpose (``ops._gemm_config.weights_k_major``): TF32 wgmma reads B only
    K-major, and an N-major tile is rewritten in shared memory at every K step."""
    if B_T:
        desc = tl.make_tensor_descriptor(w_ptr, shape=[N, K], strides=[K, 1],
                                         block_shape=[BLOCK_N, BLOCK_K])
    else:
        desc = tl.make_tensor_descriptor(w_ptr, shape=[K, N], strides=[N, 1],
                                         block_shape=[BLOCK_K, BLOCK_N])
    return desc


@triton.jit
def out_desc(ptr, rows, cols, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             SUBTILE: tl.constexpr):
    """The output descriptor of ``store_tile`` for C [rows, cols]: blocks of
    BLOCK_N / SUBTILE columns."""
    return tl.make_tensor_descriptor(ptr, shape=[rows, cols], strides=[cols, 1],
                                     block_shape=[BLOCK_M, BLOCK_N // SUBTILE])


@triton.jit
def ranked_out_desc(ptr, world, rows, cols, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    SUBTILE: tl.constexpr):
    """The output descriptor of ``store_tile(..., RANKED=True)`` for C [world * rows,
    cols] seen as [world, rows, cols]: a tile's store clips at the end of its rank's
    rows, so rows need not be a multiple of BLOCK_M."""
    return tl.make_tensor_descriptor(ptr, shape=[world, rows, cols],
                                     strides=[rows * cols, cols, 1],
                                     block_shape=[1, BLOCK_M, BLOCK_N // SUBTILE])


@triton.jit
def _store_piece(c_desc, piece, rank, row0, col0, BLOCK_M: tl.constexpr,
                 WIDTH: tl.constexpr, RANKED: tl.constexpr):
    if RANKED:
        c_desc.store([rank, row0, col0], piece.to(c_desc.dtype).reshape(1, BLOCK_M, WIDTH))
    else:
        c_desc.store([row0, col0], piece.to(c_desc.dtype))


@triton.jit
def column_halves(acc, BLOCK_M: tl.constexpr, WIDTH: tl.constexpr):
    """The left and right column halves of a [BLOCK_M, WIDTH] tile."""
    return tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, WIDTH // 2)), (0, 2, 1)))


@triton.jit
def store_tile(c_desc, acc, rank, row0, col0, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               SUBTILE: tl.constexpr, RANKED: tl.constexpr = False):
    """Stores the float32 tile ``acc`` at C[row0:, col0:] in C's dtype (with RANKED,
    at rows row0.. of rank ``rank``'s block, ``ranked_out_desc``), in SUBTILE (1, 2
    or 4) column pieces: the epilogue's shared-memory buffer is then 1 / SUBTILE
    of the tile, which leaves room for another pipeline stage."""
    tl.static_assert(SUBTILE == 1 or SUBTILE == 2 or SUBTILE == 4, "SUBTILE: 1, 2 or 4")
    if SUBTILE == 1:
        _store_piece(c_desc, acc, rank, row0, col0, BLOCK_M, BLOCK_N, RANKED)
    elif SUBTILE == 2:
        HALF: tl.constexpr = BLOCK_N // 2
        left, right = column_halves(acc, BLOCK_M, BLOCK_N)
        _store_piece(c_desc, left, rank, row0, col0, BLOCK_M, HALF, RANKED)
        _store_piece(c_desc, right, rank, row0, col0 + HALF, BLOCK_M, HALF, RANKED)
    else:
        Q: tl.constexpr = BLOCK_N // 4
        left, right = column_halves(acc, BLOCK_M, BLOCK_N)
        a, b = column_halves(left, BLOCK_M, BLOCK_N // 2)
        _store_piece(c_desc, a, rank, row0, col0, BLOCK_M, Q, RANKED)
        _store_piece(c_desc, b, rank, row0, col0 + Q, BLOCK_M, Q, RANKED)
        a, b = column_halves(right, BLOCK_M, BLOCK_N // 2)
        _store_piece(c_desc, a, rank, row0, col0 + 2 * Q, BLOCK_M, Q, RANKED)
        _store_piece(c_desc, b, rank, row0, col0 + 3 * Q, BLOCK_M, Q, RANKED)
