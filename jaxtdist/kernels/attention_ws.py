"""Warp-specialized attention forward for Hopper (sm_90), in Gluon: ag_attention's
kernel where its tile fits (head dim 128, S a multiple of 128, 16-bit), over one
rank's keys or, with INBOX, over every rank's (peers' chunks in this rank's heap
inbox, pushed there by the copy engines while the kernel runs).

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
h // (HQ / HKV). q and the output are [B, S, H, D] (rows of H * D).
Key blocks in order: this rank's chunk (causal: up to the tile's last query,
that block masked on the diagonal), then with INBOX each peer's chunk (causal:
ranks me - 1, ..., 0; else me + 1, me + 2, ... modulo the world), the producer
waiting for a chunk's flag before its first load (the ``ag_attention`` Triton
kernel's inbox protocol, whose reuse waits program (0, 0) also makes).
Worker partitions take no constexpr argument in Triton 3.6 (they arrive as
run-time values), so the tile is fixed here.
"""

import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                              warpgroup_mma, warpgroup_mma_wait)

import jaxtdist.language as dl

BLOCK = gl.constexpr(128)   # query rows per program and keys per block
HALF = gl.constexpr(64)     # query rows per consumer warpgroup
HEAD_DIM = gl.constexpr(128)
STAGES = gl.constexpr(3)    # K/V stages: 32 KiB of queries + 3 x 64 KiB fit an SM
# Registers per thread: the launch limit (12 warps fill the SM's 64K registers)
# and each partition's share (the default partition, a consumer, gets the rest).
# Two consumer warpgroups at 240 and the producer's (a warpgroup's worth) at 32
# fill the 64K exactly; at 24 the producer's inbox waits spilled.
MAX_REGISTERS = 168
CONSUMER_REGISTERS = gl.constexpr(240)
PRODUCER_REGISTERS = gl.constexpr(32)


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
             o_desc, lse_row, row_q, col_q, row_kv, col_kv, mt, n_blocks, qk_scale, causal,
             ki_desc, vi_desc, ctx, flags, sent, me, world, epoch, b, batches, seq, own_n,
             first_program):
    """The producer warp (see the module docstring)."""
    mbarrier.expect(q_bar, 2 * HALF * HEAD_DIM * q_desc.dtype.primitive_bitwidth // 8)
    tma.async_copy_global_to_shared(q_desc, [row_q, col_q], q_bar, q_smem.index(0))
    tma.async_copy_global_to_shared(q_desc, [row_q + HALF, col_q], q_bar, q_smem.index(1))
    blocks_per_chunk = seq // BLOCK
    kv_bytes: gl.constexpr = 2 * BLOCK * HEAD_DIM * k_desc.dtype.primitive_bitwidth // 8
    for j in range(n_blocks):
        stage = j % STAGES
        # A fresh barrier passes a wait for parity 1: the first STAGES fills go at once.
        mbarrier.wait(kv_empty.index(stage), ((j // STAGES) & 1) ^ 1)
        if j < own_n:
            mbarrier.expect(kv_ready.index(stage), kv_bytes)
            tma.async_copy_global_to_shared(k_desc, [row_kv + j * BLOCK, col_kv],
                                            kv_ready.index(stage), k_smem.index(stage))
            tma.async_copy_global_to_shared(v_desc, [row_kv + j * BLOCK, col_kv],
                                            kv_ready.index(stage), v_smem.index(stage))
        else:
            # A peer's chunk in the inbox: wait for its flag before its first block
            # (the wait fences the async proxy; the token keeps the loads below it).
            peer_block = j - own_n
            step = peer_block // blocks_per_chunk + 1
            src = gl.where(causal, me - step, (me + step) % world)
            in_chunk = peer_block % blocks_per_chunk
            token = 0
            if in_chunk == 0:
                token = dl.wait_for_tma(ctx, flags + src * batches + b, epoch, src, "gpu")
            row = (src * batches + b) * seq + in_chunk * BLOCK + token
            mbarrier.expect(kv_ready.index(stage), kv_bytes)
            tma.async_copy_global_to_shared(ki_desc, [row, col_kv], kv_ready.index(stage),
                                            k_smem.index(stage))
            tma.async_copy_global_to_shared(vi_desc, [row, col_kv], kv_ready.index(stage),
                                            v_smem.index(stage))
    if first_program:
        # Reuse: every peer has reached this epoch (so has finished reading what
        # this rank's next-but-one call rewrites), and this rank's pushes, whose
        # source is k_ptr (this kernel's operand), have ended.
        for step in range(1, world):
            src = (me + step) % world
            for chunk in range(0, batches):
                dl.wait_for_tma(ctx, flags + src * batches + chunk, epoch, src, "gpu")
        for step in range(1, world):
            dl.wait_for_tma(ctx, sent + step, epoch, me, "gpu")


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

    # Block 0: masked when it holds the diagonal (the first causal tile).
    mbarrier.wait(kv_ready.index(0), 0)
    mbarrier.wait(turn.index(w), w ^ 1)  # warpgroup 0 issues first
    s = warpgroup_mma(q, k_smem.index(0).permute((1, 0)), zero, use_acc=False, is_async=True)
    mbarrier.arrive(turn.index(1 - w), count=1)
    s = warpgroup_mma_wait(0, deps=(s,))
    if causal & (mt == 0):
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
        if causal & (j == mt):  # the diagonal block; this rank's chunk comes first
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
               o_desc, lse_row, row_q, col_q, row_kv, col_kv, mt, n_blocks, qk_scale, causal,
               ki_desc, vi_desc, ctx, flags, sent, me, world, epoch, b, batches, seq, own_n,
               first_program):
    # The worker partitions share one signature (_produce's).
    _consume(1, q_smem, k_smem, v_smem, q_bar, kv_ready, kv_empty, turn, o_desc, lse_row, row_q,
             col_q, mt, n_blocks, qk_scale, causal)


@gluon.jit
def attention_ws_kernel(ctx, q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, B: gl.constexpr,
                        S: gl.constexpr, HQ: gl.constexpr, HKV: gl.constexpr, D: gl.constexpr,
                        CAUSAL: gl.constexpr, QK_SCALE: gl.constexpr, KV_STRIDE: gl.constexpr,
                        V_OFF: gl.constexpr, INBOX: gl.constexpr, STAGE_OFF: gl.constexpr,
                        PARITY_BYTES: gl.constexpr, FLAGS_OFF: gl.constexpr,
                        SENT_OFF: gl.constexpr):
    """Launch with 4 warps (the default partition: consumer warpgroup 0; the
    kernel has 12) and ``maxnreg=MAX_REGISTERS``. QK_SCALE: softmax's scale times
    log2(e). lse: float32 [B * HQ, S], each row's base-2 log-sum-exp of its
    scaled scores (the backward's).

    This rank's keys and values: rows of KV_STRIDE elements, v at V_OFF elements
    past k (k, v: [B, S, HKV, D], KV_STRIDE HKV * D, V_OFF 0; INBOX: k_ptr = v_ptr
    = the [B * S, 2 * HKV * D] array the copy engines push, V_OFF = HKV * D).
    INBOX: peers' chunks in this rank's inbox at STAGE_OFF + (e % 2) *
    PARITY_BYTES ([world * B * S, 2 * HKV * D]), one flag per (peer, batch) at
    FLAGS_OFF, this rank's sent words at SENT_OFF (``InboxWorkspace``, chunks of
    S rows). Without INBOX ``ctx`` is unused (a group of one).
    """
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
    k_desc = tma.make_tensor_descriptor(k_ptr, [B * S, HKV * D], [KV_STRIDE, 1], [BLOCK, D],
                                        kv_layout)
    v_desc = tma.make_tensor_descriptor(v_ptr + V_OFF, [B * S, HKV * D], [KV_STRIDE, 1],
                                        [BLOCK, D], kv_layout)
    o_desc = tma.make_tensor_descriptor(o_ptr, [B * S, HQ * D], [HQ * D, 1], [HALF, D], q_layout)
    if INBOX:
        me = dl.rank(ctx)
        world = dl.num_ranks(ctx)
        epoch = dl.epoch(ctx)
        inbox = dl.parity_ptr(ctx, STAGE_OFF, PARITY_BYTES, dtype)
        ki_desc = tma.make_tensor_descriptor(inbox, [world * B * S, HKV * D],
                                             [2 * HKV * D, 1], [BLOCK, D], kv_layout)
        vi_desc = tma.make_tensor_descriptor(inbox + HKV * D, [world * B * S, HKV * D],
                                             [2 * HKV * D, 1], [BLOCK, D], kv_layout)
        flags = dl.heap_ptr(ctx, FLAGS_OFF, tl.int32)
        sent = dl.heap_ptr(ctx, SENT_OFF, tl.int32)
        peers = me if CAUSAL else world - 1
    else:
        me = gl.to_tensor(0)
        world = gl.to_tensor(1)
        epoch = gl.to_tensor(0)
        ki_desc = k_desc
        vi_desc = v_desc
        flags = ctx
        sent = ctx
        peers = gl.to_tensor(0)
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
    # Blocks of this rank's chunk, then every block of each peer's that is seen.
    own_n = mt + 1 if CAUSAL else S // BLOCK
    n_blocks = own_n + peers * (S // BLOCK)
    row_q = b * S + mt * BLOCK
    col_q = h * D
    qk_scale = gl.to_tensor(QK_SCALE)
    causal = gl.to_tensor(CAUSAL)
    lse_row = lse_ptr + bh * S
    first_program = (gl.program_id(0) == 0) & (bh == 0)
    workers = (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, kv_ready, kv_empty, turn,
               o_desc, lse_row, row_q, col_q, b * S, h // (HQ // HKV) * D, mt, n_blocks,
               qk_scale, causal, ki_desc, vi_desc, ctx, flags, sent, me, world, epoch, b,
               gl.to_tensor(B), gl.to_tensor(S), own_n, first_program)
    gl.warp_specialize([
        (_consume_0, (q_smem, k_smem, v_smem, q_bar, kv_ready, kv_empty, turn, o_desc, lse_row,
                      row_q, col_q, mt, n_blocks, qk_scale, causal)),
        (_consume_1, workers),
        (_produce, workers),
    ], [4, 1], [CONSUMER_REGISTERS, PRODUCER_REGISTERS])
