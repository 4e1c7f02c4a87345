"""A causal flash-attention forward with TMA descriptors and, optionally, Triton's
warp specialization of its key loop (TMA producer warps apart from two consumer
warpgroups, FA3's split), for ``probe_defaults.py attention_ws``: what Triton 3.6's
Hopper warp specialization would give ag_attention's tiles.

What it showed (1 x H100, S = 4K / 16K / 32K, H = 32, D = 128, bf16, against
cuDNN in the same process): 1.28 / 1.22 / 1.20x cuDNN's time for 128 x 128 tiles
with every block masked in one specialized loop, against 1.29x for ag_attention's
kernel at 4K; the same kernel without specialization 1.45-1.50x. Triton 3.6
specializes a kernel only when that loop is its only loop: a second loop before
or after it (the causal diagonal, a peer's chunk) fails in its
NVGPUWarpSpecialization pass, a branch in the loop body or num_warps=8 leaves
the kernel unspecialized, and 64-position key blocks with 3 stages produced
non-finite outputs. ag_attention needs a loop per chunk and a wait before each
peer's, so it keeps its own kernel.
"""

import triton
import triton.language as tl


@triton.jit
def _attend_block(q, m, l, acc, k_desc, v_desc, row0, col, start, rows,
                  QK_SCALE: tl.constexpr, MASKED: tl.constexpr, BLOCK_N: tl.constexpr):
    """Folds keys [start, start + BLOCK_N) into the online softmax (m, l, acc);
    MASKED: key j seen by query row i only when j <= i."""
    k = k_desc.load([row0 + start, col])
    s = tl.dot(q, k.T)
    if MASKED:
        pos = start + tl.arange(0, BLOCK_N)
        s = tl.where(pos[None, :] <= rows[:, None], s * QK_SCALE, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
    else:
        m_new = tl.maximum(m, tl.max(s, 1) * QK_SCALE)
        p = tl.exp2(s * QK_SCALE - m_new[:, None])
    alpha = tl.exp2(m - m_new)
    l = l * alpha + tl.sum(p, 1)
    v = v_desc.load([row0 + start, col])
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc)
    return m_new, l, acc


@triton.jit
def causal_attention_tma_kernel(ctx, q_ptr, k_ptr, v_ptr, o_ptr, B: tl.constexpr,
                                S: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr,
                                D: tl.constexpr, QK_SCALE: tl.constexpr,
                                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                ONE_LOOP: tl.constexpr, WS: tl.constexpr):
    """Grid (S // BLOCK_M, B * HQ); q, k, v, out [B, S, H, D] (S a multiple of
    BLOCK_M, BLOCK_M of BLOCK_N); each program one query tile, longest first.
    ONE_LOOP: every key block in one loop, masked (warp-specialized with WS);
    otherwise the diagonal's blocks masked, then the blocks before it unmasked."""
    mt = S // BLOCK_M - 1 - tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // HQ
    h = bh % HQ
    col = h // (HQ // HKV) * D
    q_desc = tl.make_tensor_descriptor(q_ptr, shape=[B * S, HQ * D], strides=[HQ * D, 1],
                                       block_shape=[BLOCK_M, D])
    k_desc = tl.make_tensor_descriptor(k_ptr, shape=[B * S, HKV * D], strides=[HKV * D, 1],
                                       block_shape=[BLOCK_N, D])
    v_desc = tl.make_tensor_descriptor(v_ptr, shape=[B * S, HKV * D], strides=[HKV * D, 1],
                                       block_shape=[BLOCK_N, D])
    o_desc = tl.make_tensor_descriptor(o_ptr, shape=[B * S, HQ * D], strides=[HQ * D, 1],
                                       block_shape=[BLOCK_M, D])
    row0 = b * S
    q = q_desc.load([row0 + mt * BLOCK_M, h * D])
    rows = mt * BLOCK_M + tl.arange(0, BLOCK_M)
    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D), tl.float32)
    diag = mt * BLOCK_M
    if ONE_LOOP:
        for start in tl.range(0, diag + BLOCK_M, BLOCK_N, warp_specialize=WS):
            m, l, acc = _attend_block(q, m, l, acc, k_desc, v_desc, row0, col, start, rows,
                                      QK_SCALE, True, BLOCK_N)
    else:
        for start in tl.range(diag, diag + BLOCK_M, BLOCK_N):
            m, l, acc = _attend_block(q, m, l, acc, k_desc, v_desc, row0, col, start, rows,
                                      QK_SCALE, True, BLOCK_N)
        for start in tl.range(0, diag, BLOCK_N):
            m, l, acc = _attend_block(q, m, l, acc, k_desc, v_desc, row0, col, start, rows,
                                      QK_SCALE, False, BLOCK_N)
    o_desc.store([row0 + mt * BLOCK_M, h * D], (acc / l[:, None]).to(o_ptr.dtype.element_ty))

