"""Fused attention backward (flash-attention 2's two passes): the gradients of one
rank's queries' attention over a (gathered) sequence of keys and values, without
the [S_q, S_k] score matrix in memory.

Layouts: q, o, do [B, SQ, HQ, D] (this rank's queries: global positions
[me * SQ, (me + 1) * SQ) when CAUSAL, so that the gathered keys [B, SK, HKV, D]
hold every rank's positions in order; SK = SQ at world 1); grouped-query
attention: query head h reads KV head h // (HQ / HKV). Scores are base 2:
``s = q . k * QK_SCALE`` with QK_SCALE = log2(e) / sqrt(D).

The forward kernels store each query row's base-2 log-sum-exp ``lse`` (float32
[B * HQ, SQ]), so ``P = exp2(s - lse)`` is recomputed block by block.

1. ``attention_bwd_dq_kernel``, grid (B * HQ * cdiv(SQ, BLOCK_M),): per query
   tile, ``delta = rowsum(do * o)``, then ``dq = SM_SCALE * sum_j dS_j k_j``
   with ``dS = P * (dO V^T - delta)``. Stores dq (float32) and delta (float32
   [B * HQ, SQ]) for step 2.
2. ``attention_bwd_dkdv_kernel``, grid (B * HKV * cdiv(SK, BLOCK_N),): per key
   tile, over the query tiles of every query head of its KV head that see it,
   ``dv = sum P^T dO`` and ``dk = SM_SCALE * sum dS^T q`` (float32, written once:
   no atomics).

Why dq has a kernel of its own (seven products per block, not five): a dk/dv
kernel that also adds each block's dq share with float32 atomics (16-byte
atomics or TMA reductions) spilled registers under Triton 3.6 and took 1.35-1.42x
cuDNN's forward + backward on one H200 against 1.29-1.31x for the two kernels.

Causal blocks wholly seen (or wholly past the sequence) take no mask; only the
diagonal's and the last partial block's do. Key tiles no query sees (past this
rank's last query) write zeros. Neither kernel touches the heap: ``ctx`` gives
the rank (``dl.rank``) for the causal offset.
"""

import triton
import triton.language as tl

import jaxtdist.language as dl
from jaxtdist.kernels._tiles import dot_acc, load_rows


@triton.jit
def _dq_block(q, do, dq, lse, delta, kb, vb, rows_pos, start, hi, MASKED: tl.constexpr,
              CAUSAL: tl.constexpr, STRIDE: tl.constexpr, D: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, QK_SCALE: tl.constexpr,
              DOT_PRECISION: tl.constexpr):
    """dq + dS @ k over keys [start, start + BLOCK_N) (without SM_SCALE)."""
    pos = start + tl.arange(0, BLOCK_N)
    k = load_rows(kb, pos, hi, STRIDE, D, BLOCK_D, MASKED)
    v = load_rows(vb, pos, hi, STRIDE, D, BLOCK_D, MASKED)
    p = tl.exp2(dot_acc(q, tl.trans(k), None, DOT_PRECISION) * QK_SCALE - lse[:, None])
    if MASKED:
        seen = (pos < hi)[None, :]
        if CAUSAL:
            seen = seen & (pos[None, :] <= rows_pos[:, None])
        p = tl.where(seen, p, 0.0)
    dp = dot_acc(do, tl.trans(v), None, DOT_PRECISION)
    ds = p * (dp - delta[:, None])
    return dot_acc(ds.to(k.dtype), k, dq, DOT_PRECISION)


@triton.jit
def attention_bwd_dq_kernel(ctx, q_ptr, k_ptr, v_ptr, o_ptr, do_ptr, lse_ptr, dq_ptr,
                            delta_ptr, SQ: tl.constexpr, SK: tl.constexpr,
                            HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                            CAUSAL: tl.constexpr, QK_SCALE: tl.constexpr,
                            SM_SCALE: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                            DOT_PRECISION: tl.constexpr):
    """Grid: (B * HQ * cdiv(SQ, BLOCK_M),). lse: the forward's float32 [B * HQ, SQ];
    dq: float32 [B, SQ, HQ, D]; delta: float32 [B * HQ, SQ]. Causal tiles launch
    longest (last queries) first."""
    pid = tl.program_id(0)
    m_tiles = tl.cdiv(SQ, BLOCK_M)
    bh = pid // m_tiles
    mt = m_tiles - 1 - pid % m_tiles
    b = bh // HQ
    h = bh % HQ
    hk = h // (HQ // HKV)
    first = 0
    if CAUSAL:
        first = dl.rank(ctx) * SQ  # the global position of this rank's query row 0
    rows = mt * BLOCK_M + tl.arange(0, BLOCK_M)
    r_mask = rows < SQ
    d = tl.arange(0, BLOCK_D)
    rd_mask = r_mask[:, None] & (d < D)[None, :]
    q_offs = ((b * SQ + rows).to(tl.int64) * HQ + h) * D
    q = tl.load(q_ptr + q_offs[:, None] + d[None, :], mask=rd_mask, other=0.0)
    do = tl.load(do_ptr + q_offs[:, None] + d[None, :], mask=rd_mask, other=0.0)
    o = tl.load(o_ptr + q_offs[:, None] + d[None, :], mask=rd_mask, other=0.0)
    delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)
    lse = tl.load(lse_ptr + bh.to(tl.int64) * SQ + rows, mask=r_mask, other=float("inf"))
    kb = k_ptr + (b.to(tl.int64) * SK * HKV + hk) * D
    vb = v_ptr + (b.to(tl.int64) * SK * HKV + hk) * D
    rows_pos = first + rows
    if CAUSAL:
        # Keys up to the tile's last query; those before its first are seen by all.
        hi = tl.minimum(first + tl.minimum((mt + 1) * BLOCK_M, SQ), SK)
        full = tl.minimum(first + mt * BLOCK_M, hi) // BLOCK_N * BLOCK_N
    else:
        hi = SK
        full = SK // BLOCK_N * BLOCK_N
    dq = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    for start in range(0, full, BLOCK_N):
        dq = _dq_block(q, do, dq, lse, delta, kb, vb, rows_pos, start, hi, False, CAUSAL,
                       HKV * D, D, BLOCK_N, BLOCK_D, QK_SCALE, DOT_PRECISION)
    for start in range(full, hi, BLOCK_N):
        dq = _dq_block(q, do, dq, lse, delta, kb, vb, rows_pos, start, hi, True, CAUSAL,
                       HKV * D, D, BLOCK_N, BLOCK_D, QK_SCALE, DOT_PRECISION)
    tl.store(dq_ptr + q_offs[:, None] + d[None, :], dq * SM_SCALE, mask=rd_mask)
    tl.store(delta_ptr + bh.to(tl.int64) * SQ + rows, delta, mask=r_mask)


@triton.jit
def _dkdv_block(k, v, dk, dv, qb, dob, lse_row, delta_row, pos, start,
                MASKED: tl.constexpr, CAUSAL: tl.constexpr, first, SQ: tl.constexpr,
                STRIDE: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_D: tl.constexpr, QK_SCALE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """(dk, dv) + the contributions of query rows [start, start + BLOCK_M) of one
    query head (dk without SM_SCALE); scores transposed: [BLOCK_N keys, BLOCK_M rows]."""
    rows = start + tl.arange(0, BLOCK_M)
    q = load_rows(qb, rows, SQ, STRIDE, D, BLOCK_D, MASKED)
    do = load_rows(dob, rows, SQ, STRIDE, D, BLOCK_D, MASKED)
    if MASKED:
        lse = tl.load(lse_row + rows, mask=rows < SQ, other=float("inf"))
        delta = tl.load(delta_row + rows, mask=rows < SQ, other=0.0)
    else:
        lse = tl.load(lse_row + rows)
        delta = tl.load(delta_row + rows)
    p_t = tl.exp2(dot_acc(k, tl.trans(q), None, DOT_PRECISION) * QK_SCALE - lse[None, :])
    if MASKED:
        if CAUSAL:
            p_t = tl.where((first + rows)[None, :] >= pos[:, None], p_t, 0.0)
    dv = dot_acc(p_t.to(do.dtype), do, dv, DOT_PRECISION)
    dp_t = dot_acc(v, tl.trans(do), None, DOT_PRECISION)
    ds_t = p_t * (dp_t - delta[None, :])
    return dot_acc(ds_t.to(q.dtype), q, dk, DOT_PRECISION), dv


@triton.jit
def attention_bwd_dkdv_kernel(ctx, q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr,
                              dv_ptr, SQ: tl.constexpr, SK: tl.constexpr, HQ: tl.constexpr,
                              HKV: tl.constexpr, D: tl.constexpr, CAUSAL: tl.constexpr,
                              QK_SCALE: tl.constexpr, SM_SCALE: tl.constexpr,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                              BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Grid: (B * HKV * cdiv(SK, BLOCK_N),). dk, dv: float32 [B, SK, HKV, D]; lse,
    delta from ``attention_bwd_dq_kernel``."""
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(SK, BLOCK_N)
    bhk = pid // n_tiles
    nt = pid % n_tiles  # causal: the first keys are seen by the most queries, first
    b = bhk // HKV
    hk = bhk % HKV
    group: tl.constexpr = HQ // HKV
    first = 0
    if CAUSAL:
        first = dl.rank(ctx) * SQ
    pos = nt * BLOCK_N + tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    pd_mask = (pos < SK)[:, None] & (d < D)[None, :]
    kv_offs = ((b * SK + pos).to(tl.int64) * HKV + hk) * D
    k = tl.load(k_ptr + kv_offs[:, None] + d[None, :], mask=pd_mask, other=0.0)
    v = tl.load(v_ptr + kv_offs[:, None] + d[None, :], mask=pd_mask, other=0.0)
    dk = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
    whole = SQ // BLOCK_M * BLOCK_M  # rows of whole query tiles
    if CAUSAL:
        # Query rows that see any key of this tile start at its first key's position;
        # from the first tile whose first row sees the tile's last key on, unmasked.
        lo = tl.minimum(tl.maximum(nt * BLOCK_N - first, 0), SQ) // BLOCK_M * BLOCK_M
        unmasked = tl.minimum(tl.maximum(
            tl.cdiv(nt * BLOCK_N + BLOCK_N - 1 - first, BLOCK_M) * BLOCK_M, lo), whole)
    else:
        lo = 0
        unmasked = 0
    for g in range(group):
        h = hk * group + g
        qb = q_ptr + (b.to(tl.int64) * SQ * HQ + h) * D
        dob = do_ptr + (b.to(tl.int64) * SQ * HQ + h) * D
        lse_row = lse_ptr + (b * HQ + h).to(tl.int64) * SQ
        delta_row = delta_ptr + (b * HQ + h).to(tl.int64) * SQ
        for start in range(lo, unmasked, BLOCK_M):  # the causal diagonal
            dk, dv = _dkdv_block(k, v, dk, dv, qb, dob, lse_row, delta_row, pos, start, True,
                                 CAUSAL, first, SQ, HQ * D, D, BLOCK_M, BLOCK_D, QK_SCALE,
                                 DOT_PRECISION)
        for start in range(tl.maximum(unmasked, lo), whole, BLOCK_M):
            dk, dv = _dkdv_block(k, v, dk, dv, qb, dob, lse_row, delta_row, pos, start,
                                 False, CAUSAL, first, SQ, HQ * D, D, BLOCK_M, BLOCK_D,
                                 QK_SCALE, DOT_PRECISION)
        for start in range(tl.maximum(whole, lo), SQ, BLOCK_M):  # the last partial tile
            dk, dv = _dkdv_block(k, v, dk, dv, qb, dob, lse_row, delta_row, pos, start, True,
                                 CAUSAL, first, SQ, HQ * D, D, BLOCK_M, BLOCK_D, QK_SCALE,
                                 DOT_PRECISION)
    tl.store(dk_ptr + kv_offs[:, None] + d[None, :], dk * SM_SCALE, mask=pd_mask)
    tl.store(dv_ptr + kv_offs[:, None] + d[None, :], dv, mask=pd_mask)
