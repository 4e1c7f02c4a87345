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


# -- Gluon: FA3's in-warpgroup overlap, written out ---------------------------------
#
# Triton 3.6's pipeliner waits for each wgmma right after it, so the softmax of a
# key block runs with the tensor cores idle (the loop is issue-bound: 343 SASS
# instructions per 128 x 64 step). Gluon places the waits by hand: the QK^T of
# block j and the PV of block j - 1 are issued together, the softmax of block j
# waits only for the first, and runs while the second is on the tensor cores.
#
# What it showed (``probe_defaults.py attention_gluon``, 1 x H200, causal, H = 32,
# D = 128, bf16, us and ratio to cuDNN in the same process): 128 x 128 tiles, 3
# stages: 363.4 (1.40) / 4305.9 (1.29) / 17163.8 (1.33) at S = 4K / 16K / 32K,
# against ag_attention's kernel 311.4 (1.20) / 4238.9 (1.27) / 17267.0 (1.33);
# with 2 stages (the refill issued one block ahead) 1.60-1.62. Error against
# cuDNN 2.5e-5 to 4.5e-5 (the same 128-key blocks). Both warpgroups still run
# their softmax at once (one CTA barrier per block before the refill); FA3's
# next steps are a producer warp (warp_specialize) with per-stage empty
# barriers and the warpgroups' ping-pong.

from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import (  # noqa: E402
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)


@gluon.jit
def _g_softmax(s, m, l, rows, cols, QK_SCALE: gl.constexpr, MASKED: gl.constexpr):
    """One key block's online-softmax step on the scores ``s`` (float32, the
    wgmma layout): returns (m, l, p, alpha), p unnormalized (float32)."""
    if MASKED:
        s = gl.where(cols[None, :] <= rows[:, None], s * QK_SCALE, float("-inf"))
        m_new = gl.maximum(m, gl.max(s, axis=1))
        p = gl.exp2(s - m_new[:, None])
    else:
        m_new = gl.maximum(m, gl.max(s, axis=1) * QK_SCALE)
        p = gl.exp2(s * QK_SCALE - m_new[:, None])
    alpha = gl.exp2(m - m_new)
    return m_new, l * alpha + gl.sum(p, axis=1), p, alpha


@gluon.jit
def gluon_causal_attention_kernel(ctx, q_ptr, k_ptr, v_ptr, o_ptr, B: gl.constexpr,
                                  S: gl.constexpr, HQ: gl.constexpr, HKV: gl.constexpr,
                                  D: gl.constexpr, QK_SCALE: gl.constexpr,
                                  BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                                  STAGES: gl.constexpr):
    """Grid (S // BLOCK_M, B * HQ); q, k, v, out [B, S, H, D] bf16, S a multiple of
    BLOCK_M, BLOCK_N == BLOCK_M (only the last key block holds the diagonal); causal; each program one query tile, longest first. K and V of
    block j + STAGES - 1 load (TMA) into the stage of block j - 1 once every
    warp is past it."""
    gl.static_assert(BLOCK_N == BLOCK_M, "the last key block must hold the whole diagonal")
    mt = S // BLOCK_M - 1 - gl.program_id(0)
    bh = gl.program_id(1)
    b = bh // HQ
    h = bh % HQ
    col_kv = h // (HQ // HKV) * D
    row0 = b * S
    layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, D], gl.bfloat16)
    q_desc = tma.make_tensor_descriptor(q_ptr, [B * S, HQ * D], [HQ * D, 1], [BLOCK_M, D], layout)
    k_desc = tma.make_tensor_descriptor(k_ptr, [B * S, HKV * D], [HKV * D, 1], [BLOCK_N, D],
                                        layout)
    v_desc = tma.make_tensor_descriptor(v_ptr, [B * S, HKV * D], [HKV * D, 1], [BLOCK_N, D],
                                        layout)
    o_desc = tma.make_tensor_descriptor(o_ptr, [B * S, HQ * D], [HQ * D, 1], [BLOCK_M, D], layout)

    # Scores [BLOCK_M, BLOCK_N] and the output [BLOCK_M, D]: one row split over the
    # same threads in both (the same M tiling), so row vectors move between them
    # without data movement.
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0],
                                                  warps_per_cta=[gl.num_warps(), 1],
                                                  instr_shape=[16, BLOCK_N, 16])
    o_mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0],
                                                    warps_per_cta=[gl.num_warps(), 1],
                                                    instr_shape=[16, D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_mma, k_width=2)
    rows_layout: gl.constexpr = gl.SliceLayout(1, mma)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_mma)
    cols_layout: gl.constexpr = gl.SliceLayout(0, mma)

    q_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_M, D], layout)
    k_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, D], layout)
    v_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, D], layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    kv_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(kv_bar.index(i), count=1)

    n_blocks = (mt + 1) * BLOCK_M // BLOCK_N  # causal: keys up to the tile's last query
    kv_bytes: gl.constexpr = 2 * BLOCK_N * D * 2
    mbarrier.expect(q_bar, BLOCK_M * D * 2)
    tma.async_copy_global_to_shared(q_desc, [row0 + mt * BLOCK_M, h * D], q_bar, q_smem)
    for j in gl.static_range(STAGES):
        if j < n_blocks:
            mbarrier.expect(kv_bar.index(j), kv_bytes)
            tma.async_copy_global_to_shared(k_desc, [row0 + j * BLOCK_N, col_kv], kv_bar.index(j),
                                            k_smem.index(j))
            tma.async_copy_global_to_shared(v_desc, [row0 + j * BLOCK_N, col_kv], kv_bar.index(j),
                                            v_smem.index(j))

    rows = mt * BLOCK_M + gl.arange(0, BLOCK_M, layout=rows_layout)
    cols = gl.arange(0, BLOCK_N, layout=cols_layout)
    zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma)
    acc = gl.zeros([BLOCK_M, D], gl.float32, o_mma)
    m = gl.full([BLOCK_M], float("-inf"), gl.float32, rows_layout)
    l = gl.zeros([BLOCK_M], gl.float32, rows_layout)

    # Block 0 (masked: it holds the diagonal when the tile is the first).
    mbarrier.wait(q_bar, 0)
    mbarrier.wait(kv_bar.index(0), 0)
    s = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), zero, use_acc=False,
                      is_async=True)
    s = warpgroup_mma_wait(0, deps=(s,))
    m, l, p, alpha = _g_softmax(s, m, l, rows, cols, QK_SCALE, True)
    p = gl.convert_layout(p.to(gl.bfloat16), p_layout)

    # Blocks 1 .. n - 1: QK^T of block j with PV of block j - 1 in flight.
    for j in range(1, n_blocks):
        stage = j % STAGES
        prev = (j - 1) % STAGES
        mbarrier.wait(kv_bar.index(stage), (j // STAGES) & 1)
        s = warpgroup_mma(q_smem, k_smem.index(stage).permute((1, 0)), zero, use_acc=False,
                          is_async=True)
        acc = warpgroup_mma(p, v_smem.index(prev), acc, is_async=True)
        s = warpgroup_mma_wait(1, deps=(s,))
        if j == n_blocks - 1:
            m, l, p_new, alpha = _g_softmax(s, m, l, rows, j * BLOCK_N + cols, QK_SCALE, True)
        else:
            m, l, p_new, alpha = _g_softmax(s, m, l, rows, j * BLOCK_N + cols, QK_SCALE, False)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        # Every warp is past block j - 1 (its PV waited above): refill its stage.
        gl.thread_barrier()
        nxt = j - 1 + STAGES
        if nxt < n_blocks:
            mbarrier.expect(kv_bar.index(prev), kv_bytes)
            tma.async_copy_global_to_shared(k_desc, [row0 + nxt * BLOCK_N, col_kv],
                                            kv_bar.index(prev), k_smem.index(prev))
            tma.async_copy_global_to_shared(v_desc, [row0 + nxt * BLOCK_N, col_kv],
                                            kv_bar.index(prev), v_smem.index(prev))
        acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
        p = gl.convert_layout(p_new.to(gl.bfloat16), p_layout)

    last = (n_blocks - 1) % STAGES
    acc = warpgroup_mma(p, v_smem.index(last), acc, is_async=True)
    acc = warpgroup_mma_wait(0, deps=(acc,))
    o = (acc / gl.convert_layout(l, o_rows)[:, None]).to(gl.bfloat16)
    mbarrier.invalidate(q_bar)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(kv_bar.index(i))
    q_smem.store(o)
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [row0 + mt * BLOCK_M, h * D], q_smem)
    tma.store_wait(0)
