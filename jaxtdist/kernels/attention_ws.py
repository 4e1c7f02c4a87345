"""Warp-specialized attention forward for Hopper (sm_90), in Gluon: ag_attention's
kernel at world 1 where its tile fits (head dim 128, S a multiple of 128, 16-bit).

Triton's own pipeliner waits for each wgmma right after it, so a key block's
softmax runs with the tensor cores idle, both warpgroups at once (the loop is
issue-bound). Gluon states the schedule instead, as FA3 does:

- a producer warp loads both halves of the query tile, then the keys and values
  of every key block (TMA) into one of STAGES shared-memory stages, once both
  consumers have released it (``kv_empty``, two arrivals);
- two consumer warpgroups of 64 query rows each: the QK^T of block j and the PV
  of block j - 1 are issued together, the softmax of block j waits only for the
  first; and the warpgroups issue their products in turns (``turn``: each opens
  the other's after issuing), so one's softmax runs while the other's products
  are on the tensor cores.

Grid: (S // 128, B * HQ); program (i, bh) owns query tile S // 128 - 1 - i (the
longest causal tiles first) of batch bh // HQ, head bh % HQ, which reads KV head
h // (HQ / HKV). q, k, v and the output are [B, S, H, D] (rows of H * D).
Causal: keys up to the tile's last query, the last block masked on the diagonal.
Worker partitions take no constexpr argument in Triton 3.6 (they arrive as
run-time values), so the tile is fixed here.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                              warpgroup_mma, warpgroup_mma_wait)

BLOCK = gl.constexpr(128)   # query rows per program and keys per block
HALF = gl.constexpr(64)     # query rows per consumer warpgroup
HEAD_DIM = gl.constexpr(128)
STAGES = gl.constexpr(3)    # K/V stages: 32 KiB of queries + 3 x 64 KiB fit an SM
# Registers per thread: the launch limit (12 warps fill the SM's 64K registers)
# and each partition's share (the default partition, a consumer, gets the rest).
MAX_REGISTERS = 168
CONSUMER_REGISTERS = gl.constexpr(240)
PRODUCER_REGISTERS = gl.constexpr(24)


@gluon.jit
def _softmax_step(s, m, l, rows, cols, qk_scale, MASKED: gl.constexpr):
    """One key block's online-softmax step on the float32 scores ``s``: returns
    (m, l, p, alpha), p unnormalized, base 2 (``qk_scale`` includes log2(e))."""
    if MASKED:
        s = gl.where(cols[None, :] <= rows[:, None], s * qk_scale, float("-inf"))
        m_new = gl.maximum(m, gl.max(s, axis=1))
        # A row with no key seen yet keeps m = -inf: shift by 0 instead (no NaN).
        shift = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(s - shift[:, None])
    else:
        m_new = gl.maximum(m, gl.max(s, axis=1) * qk_scale)
        shift = m_new
        p = gl.exp2(s * qk_scale - shift[:, None])
    alpha = gl.exp2(m - shift)
    return m_new, l * alpha + gl.sum(p, axis=1), p, alpha


@gluon.jit
def _produce(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, kv_ready, kv_empty, turn,
             o_desc, lse_row, row_q, col_q, row_kv, col_kv, mt, n_blocks, qk_scale, causal):
    """The producer warp (see the module docstring)."""
    mbarrier.expect(q_bar, 2 * HALF * HEAD_DIM * q_desc.dtype.primitive_bitwidth // 8)
    tma.async_copy_global_to_shared(q_desc, [row_q, col_q], q_bar, q_smem.index(0))
    tma.async_copy_global_to_shared(q_desc, [row_q + HALF, col_q], q_bar, q_smem.index(1))
    for j in range(n_blocks):
        stage = j % STAGES
        # A fresh barrier passes a wait for parity 1: the first STAGES fills go at once.
        mbarrier.wait(kv_empty.index(stage), ((j // STAGES) & 1) ^ 1)
        mbarrier.expect(kv_ready.index(stage),
                        2 * BLOCK * HEAD_DIM * k_desc.dtype.primitive_bitwidth // 8)
        tma.async_copy_global_to_shared(k_desc, [row_kv + j * BLOCK, col_kv],
                                        kv_ready.index(stage), k_smem.index(stage))
        tma.async_copy_global_to_shared(v_desc, [row_kv + j * BLOCK, col_kv],
                                        kv_ready.index(stage), v_smem.index(stage))


@gluon.jit
def _consume(w: gl.constexpr, q_smem, k_smem, v_smem, q_bar, kv_ready, kv_empty, turn, o_desc,
             lse_row, row_q, col_q, mt, n_blocks, qk_scale, causal):
    """Consumer warpgroup ``w``: query rows [w * HALF, (w + 1) * HALF) of the tile."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, BLOCK, 16])
    o_mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                    instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_mma, k_width=2)
    # Scores and output tile rows alike over the warpgroup: row vectors move
    # between the two layouts without data movement.
    rows_layout: gl.constexpr = gl.SliceLayout(1, mma)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_mma)
    rows = mt * BLOCK + w * HALF + gl.arange(0, HALF, layout=rows_layout)
    cols = gl.arange(0, BLOCK, layout=gl.SliceLayout(0, mma))
    zero = gl.zeros([HALF, BLOCK], gl.float32, mma)
    acc = gl.zeros([HALF, HEAD_DIM], gl.float32, o_mma)
    m = gl.full([HALF], float("-inf"), gl.float32, rows_layout)
    l = gl.zeros([HALF], gl.float32, rows_layout)
    q = q_smem.index(w)
    mbarrier.wait(q_bar, 0)

    # Block 0: masked when it is the last (the first causal tile).
    mbarrier.wait(kv_ready.index(0), 0)
    mbarrier.wait(turn.index(w), w ^ 1)  # warpgroup 0 issues first
    s = warpgroup_mma(q, k_smem.index(0).permute((1, 0)), zero, use_acc=False, is_async=True)
    mbarrier.arrive(turn.index(1 - w), count=1)
    s = warpgroup_mma_wait(0, deps=(s,))
    if causal & (n_blocks == 1):
        m, l, p, alpha = _softmax_step(s, m, l, rows, cols, qk_scale, True)
    else:
        m, l, p, alpha = _softmax_step(s, m, l, rows, cols, qk_scale, False)
    p = gl.convert_layout(p.to(q_smem.dtype), p_layout)
    for j in range(1, n_blocks):
        stage = j % STAGES
        prev = (j - 1) % STAGES
        mbarrier.wait(kv_ready.index(stage), (j // STAGES) & 1)
        mbarrier.wait(turn.index(w), (j & 1) ^ w ^ 1)
        s = warpgroup_mma(q, k_smem.index(stage).permute((1, 0)), zero, use_acc=False,
                          is_async=True)
        acc = warpgroup_mma(p, v_smem.index(prev), acc, is_async=True)
        mbarrier.arrive(turn.index(1 - w), count=1)
        s = warpgroup_mma_wait(1, deps=(s,))  # QK^T of block j; PV of j - 1 still runs
        if causal & (j == n_blocks - 1):
            m, l, p_next, alpha = _softmax_step(s, m, l, rows, j * BLOCK + cols, qk_scale,
                                                True)
        else:
            m, l, p_next, alpha = _softmax_step(s, m, l, rows, j * BLOCK + cols, qk_scale,
                                                False)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(kv_empty.index(prev), count=1)  # this warpgroup is past block j - 1
        acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
        p = gl.convert_layout(p_next.to(q_smem.dtype), p_layout)
    last = (n_blocks - 1) % STAGES
    acc = warpgroup_mma(p, v_smem.index(last), acc, is_async=True)
    acc = warpgroup_mma_wait(0, deps=(acc,))
    mbarrier.arrive(kv_empty.index(last), count=1)
    # The rows' base-2 log-sum-exp, for the backward (every row sees a key: l > 0).
    gl.store(lse_row + rows, m + gl.log2(l))
    l = gl.convert_layout(l, o_rows)
    o = acc / gl.where(l > 0, l, 1.0)[:, None]
    q.store(o.to(q_smem.dtype))  # this warpgroup's queries are read no more
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [row_q + w * HALF, col_q], q)
    tma.store_wait(0)


@gluon.jit
def _consume_0(q_smem, k_smem, v_smem, q_bar, kv_ready, kv_empty, turn, o_desc, lse_row, row_q,
               col_q, mt, n_blocks, qk_scale, causal):
    _consume(0, q_smem, k_smem, v_smem, q_bar, kv_ready, kv_empty, turn, o_desc, lse_row, row_q,
             col_q, mt, n_blocks, qk_scale, causal)


@gluon.jit
def _consume_1(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, kv_ready, kv_empty, turn,
               o_desc, lse_row, row_q, col_q, row_kv, col_kv, mt, n_blocks, qk_scale, causal):
    # The worker partitions share one signature (_produce's).
    _consume(1, q_smem, k_smem, v_smem, q_bar, kv_ready, kv_empty, turn, o_desc, lse_row, row_q,
             col_q, mt, n_blocks, qk_scale, causal)


@gluon.jit
def attention_ws_kernel(ctx, q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, B: gl.constexpr,
                        S: gl.constexpr,
                        HQ: gl.constexpr, HKV: gl.constexpr, D: gl.constexpr,
                        CAUSAL: gl.constexpr, QK_SCALE: gl.constexpr):
    """Launch with 4 warps (the default partition: consumer warpgroup 0; the
    kernel has 12) and ``maxnreg=MAX_REGISTERS``; ``ctx`` is unused (a local
    kernel). QK_SCALE: softmax's scale times log2(e). lse: float32 [B * HQ, S],
    each row's base-2 log-sum-exp of its scaled scores (the backward's)."""
    gl.static_assert(D == HEAD_DIM, "head dim 128 only")
    gl.static_assert(S % BLOCK == 0, "S a multiple of 128")
    mt = S // BLOCK - 1 - gl.program_id(0)
    bh = gl.program_id(1)
    b = bh // HQ
    h = bh % HQ
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HALF, D], dtype)
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK, D], dtype)
    q_desc = tma.make_tensor_descriptor(q_ptr, [B * S, HQ * D], [HQ * D, 1], [HALF, D], q_layout)
    k_desc = tma.make_tensor_descriptor(k_ptr, [B * S, HKV * D], [HKV * D, 1], [BLOCK, D],
                                        kv_layout)
    v_desc = tma.make_tensor_descriptor(v_ptr, [B * S, HKV * D], [HKV * D, 1], [BLOCK, D],
                                        kv_layout)
    o_desc = tma.make_tensor_descriptor(o_ptr, [B * S, HQ * D], [HQ * D, 1], [HALF, D], q_layout)
    q_smem = gl.allocate_shared_memory(dtype, [2, HALF, D], q_layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK, D], kv_layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK, D], kv_layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    kv_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(kv_ready.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=2)  # both consumer warpgroups
    mbarrier.init(turn.index(0), count=1)
    mbarrier.init(turn.index(1), count=1)
    n_blocks = mt + 1 if CAUSAL else S // BLOCK
    row_q = b * S + mt * BLOCK
    col_q = h * D
    qk_scale = gl.to_tensor(QK_SCALE)
    causal = gl.to_tensor(CAUSAL)
    lse_row = lse_ptr + bh * S
    workers = (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, kv_ready, kv_empty, turn,
               o_desc, lse_row, row_q, col_q, b * S, h // (HQ // HKV) * D, mt, n_blocks,
               qk_scale, causal)
    gl.warp_specialize([
        (_consume_0, (q_smem, k_smem, v_smem, q_bar, kv_ready, kv_empty, turn, o_desc, lse_row,
                      row_q, col_q, mt, n_blocks, qk_scale, causal)),
        (_consume_1, workers),
        (_produce, workers),
    ], [4, 1], [CONSUMER_REGISTERS, PRODUCER_REGISTERS])
