"""ag_attention: sequence-parallel attention whose KV gather is overlapped with the
flash-attention tiles.

Every rank holds S positions of q, k and v ([B, S, H, D], rank r holding global
positions [r * S, (r + 1) * S)). Grid: (B * HQ * cdiv(S, BLOCK_M),): program
``pid`` owns BLOCK_M query rows of one (batch, query head). It runs a float32
online softmax over the chunks of the ranks its queries see, its own chunk first
(read from k and v directly, no wait), then each peer's. Causal: only ranks
me, me - 1, ..., 0 (the own chunk masked on the diagonal and cut at the tile's
last query). Grouped-query attention: query head h reads KV head h // (HQ / HKV).

Two ways to reach a peer's chunk (constexpr INBOX):

- Inbox (default where the heap holds it): every rank pushes its k and v (one
  [B * S, 2 * HKV * D] array, k's columns then v's) into every peer's heap inbox
  of parity ``epoch % 2`` before its kernel starts (copy engines on a side stream
  on GPUs, ``push_shards_kernel`` elsewhere), raising a flag per chunk. Tiles wait
  for their peer chunk's flags and read it from local memory: each peer byte
  crosses the link once, not once per query tile.
- Peer reads (fallback when the inboxes do not fit): the prologue stages k and v
  in this rank's heap (``STAGE_OFF + (e % 2) * PARITY_BYTES``), program 0 raises
  this rank's ready flag in every peer (``READY_OFF + 4 * me``), and tiles load
  peers' staged copies through ``dl.symm_at``: every query tile reads the whole
  chunk over the link, so this is link-bound for long sequences.

Reuse: a rank rewrites a peer's inbox (or its own staging) of parity p at epoch
e + 2, after its kernel e + 1 ended; program 0 of that kernel waited for every
peer's flags of epoch e + 1 (all of them, causal or not), which a peer raises
only after its kernel e (the last reader of parity p) ended.

Deadlock: pushes wait for nothing; program 0 notifies before it waits (peer
reads); every other wait is for a peer's pushes or program 0.
"""

import triton
import triton.language as tl

import jaxtdist.language as dl
from jaxtdist.kernels._inbox import wait_every_peer, wait_pushes_sent, wait_rows
from jaxtdist.kernels._tiles import aligned_after, dot_acc, load_rows


@triton.jit
def _qk(q, k, DOT_PRECISION: tl.constexpr):
    return dot_acc(q, tl.trans(k), None, DOT_PRECISION)


@triton.jit
def _pv(p, v, acc, DOT_PRECISION: tl.constexpr):
    """acc + p @ v, p rounded to v's type (bf16/fp16 tensor-core operands)."""
    return dot_acc(p.to(v.dtype), v, acc, DOT_PRECISION)


@triton.jit
def _attend_block(q, m, l, acc, kb, vb, rows, start, hi, MASKED: tl.constexpr,
                  DIAG: tl.constexpr, STRIDE: tl.constexpr, D: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, QK_SCALE: tl.constexpr,
                  DOT_PRECISION: tl.constexpr):
    """Folds keys [start, start + BLOCK_N) of one chunk into the online softmax
    (m, l, acc) of the query tile ``q`` (rows ``rows`` of the chunk's positions).

    MASKED: keys at or past ``hi`` read as absent, and with DIAG key j is seen by
    row i only when j <= i; rows that have seen no key keep m = -inf. Unmasked
    (the bulk of the loop): the block is whole and seen by every row, so no
    compare, select or -inf guard, and the scale folds into one FMA with the
    shift. ``kb``, ``vb``: the chunk's key and value of position 0 for this
    (batch, KV head); positions are STRIDE elements apart.
    """
    pos = start + tl.arange(0, BLOCK_N)
    s = _qk(q, load_rows(kb, pos, hi, STRIDE, D, BLOCK_D, MASKED), DOT_PRECISION)
    if MASKED:
        seen = (pos < hi)[None, :]
        if DIAG:
            seen = seen & (pos[None, :] <= rows[:, None])
        s = tl.where(seen, s * QK_SCALE, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        # A row with no key seen yet keeps m = -inf: shift by 0 instead (no NaN).
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - shift[:, None])
    else:
        m_new = tl.maximum(m, tl.max(s, 1) * QK_SCALE)
        shift = m_new
        p = tl.exp2(s * QK_SCALE - shift[:, None])
    alpha = tl.exp2(m - shift)
    l = l * alpha + tl.sum(p, 1)
    # The rescale is the dot's accumulator (wgmma adds into it); Triton made the
    # same of acc * alpha + dot(p, v).
    acc = _pv(p, load_rows(vb, pos, hi, STRIDE, D, BLOCK_D, MASKED), acc * alpha[:, None],
              DOT_PRECISION)
    return m_new, l, acc


@triton.jit
def _attend(q, m, l, acc, kb, vb, rows, full, hi, DIAG: tl.constexpr, STRIDE: tl.constexpr,
            D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
            QK_SCALE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Keys [0, hi) of one chunk: [0, full) unmasked (``full`` a multiple of
    BLOCK_N, every key seen by every row), then [full, hi) masked (the causal
    diagonal with DIAG, the chunk's last partial block)."""
    for start in range(0, full, BLOCK_N):
        m, l, acc = _attend_block(q, m, l, acc, kb, vb, rows, start, hi, False, False,
                                  STRIDE, D, BLOCK_N, BLOCK_D, QK_SCALE, DOT_PRECISION)
    for start in range(full, hi, BLOCK_N):
        m, l, acc = _attend_block(q, m, l, acc, kb, vb, rows, start, hi, True, DIAG,
                                  STRIDE, D, BLOCK_N, BLOCK_D, QK_SCALE, DOT_PRECISION)
    return m, l, acc


@triton.jit
def ag_attention_kernel(ctx, q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr,
                        B: tl.constexpr, S: tl.constexpr, HQ: tl.constexpr,
                        HKV: tl.constexpr, D: tl.constexpr, CAUSAL: tl.constexpr,
                        QK_SCALE: tl.constexpr, INBOX: tl.constexpr, STAGE_OFF: tl.constexpr,
                        PARITY_BYTES: tl.constexpr, KV_ELEMS: tl.constexpr,
                        READY_OFF: tl.constexpr, FLAGS_OFF: tl.constexpr,
                        SENT_OFF: tl.constexpr, CHUNK_ROWS: tl.constexpr,
                        KV_STRIDE: tl.constexpr, V_OFF: tl.constexpr,
                        FLAG_SCOPE: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                        DOT_PRECISION: tl.constexpr, HEAD_GROUP: tl.constexpr):
    """Grid: (B * HQ * cdiv(S, BLOCK_M),).

    q: [B, S, HQ, D]; out: [B, S, HQ, D]; lse: float32 [B * HQ, S], each query
    row's base-2 log-sum-exp of its scaled scores (the backward's). This rank's
    keys and values: rows of KV_STRIDE elements, v at V_OFF elements past k (k,
    v: [B, S, HKV, D], V_OFF 0; INBOX: k_ptr = v_ptr = the [B * S, 2 * HKV * D]
    array the copy engines push, which being an operand outlives the pushes,
    V_OFF = HKV * D).
    INBOX: peers' chunks in this rank's inbox at STAGE_OFF + (e % 2) * PARITY_BYTES
    ([world * B * S, 2 * HKV * D]; a flag per CHUNK_ROWS rows of each peer at
    FLAGS_OFF; this rank's pushes raise its sent words at SENT_OFF).
    Otherwise peers' staged copies (k then v, KV_ELEMS = B * S * HKV * D each) at
    STAGE_OFF + (e % 2) * PARITY_BYTES, ready flags at READY_OFF.
    HEAD_GROUP (causal): the tiles of HEAD_GROUP consecutive (batch, head) pairs
    launch together, longest (last queries) first: 1 keeps each head's tiles
    together (the concurrent programs share one head's K/V in L2); B * HQ orders
    every head's longest tiles before any shorter one (the least tail).
    """
    pid = tl.program_id(0)
    m_tiles = tl.cdiv(S, BLOCK_M)
    if CAUSAL:
        # Causal tiles grow with their last query: the longest launch first, so
        # the last programs to start are short ones (a shorter tail).
        per_group = HEAD_GROUP * m_tiles
        group = pid // per_group
        heads = tl.minimum(B * HQ - group * HEAD_GROUP, HEAD_GROUP)  # the last group's
        in_group = pid % per_group
        bh = group * HEAD_GROUP + in_group % heads
        mt = m_tiles - 1 - in_group // heads
    else:
        bh = pid // m_tiles
        mt = pid % m_tiles
    b = bh // HQ
    h = bh % HQ
    hk = h // (HQ // HKV)
    me = dl.rank(ctx)
    world = dl.num_ranks(ctx)
    e = dl.epoch(ctx)
    ready = dl.heap_ptr(ctx, READY_OFF, tl.int32)
    flags = dl.heap_ptr(ctx, FLAGS_OFF, tl.int32)
    if not INBOX:
        if pid == 0:
            # The staged copy of this rank's k and v is in the heap (the prologue
            # ran before this kernel): tell every peer.
            dl.notify_peers(ctx, ready + me, e)

    rows = mt * BLOCK_M + tl.arange(0, BLOCK_M)
    r_mask = rows < S
    d = tl.arange(0, BLOCK_D)
    rd_mask = r_mask[:, None] & (d < D)[None, :]
    q_offs = ((b * S + rows).to(tl.int64) * HQ + h) * D
    q = tl.load(q_ptr + q_offs[:, None] + d[None, :], mask=rd_mask, other=0.0)
    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)

    # The own chunk first: no wait. Causal: keys up to the tile's last query.
    own = b.to(tl.int64) * S * KV_STRIDE + hk * D
    # Keys of a whole chunk: whole blocks unmasked, the last partial one masked.
    whole = S // BLOCK_N * BLOCK_N
    if CAUSAL:
        # Keys before the tile's first query are seen by all its rows.
        m, l, acc = _attend(q, m, l, acc, k_ptr + own, v_ptr + V_OFF + own, rows,
                            mt * BLOCK_M // BLOCK_N * BLOCK_N,
                            tl.minimum((mt + 1) * BLOCK_M, S), True, KV_STRIDE, D, BLOCK_N,
                            BLOCK_D, QK_SCALE, DOT_PRECISION)
        peers = me  # ranks me - 1, ..., 0: every key before every query of this rank
    else:
        m, l, acc = _attend(q, m, l, acc, k_ptr + own, v_ptr + V_OFF + own, rows, whole, S,
                            False, KV_STRIDE, D, BLOCK_N, BLOCK_D, QK_SCALE, DOT_PRECISION)
        peers = world - 1
    staged = dl.parity_ptr(ctx, STAGE_OFF, PARITY_BYTES,
                          k_ptr.dtype.element_ty)
    for step in range(1, peers + 1):
        if CAUSAL:
            src = me - step
        else:
            src = (me + step) % world
        if INBOX:
            # The chunks holding this batch's rows of src, pushed into the local inbox
            # (one chunk per batch from the copy engines).
            token = wait_rows(ctx, flags, e, src, b * S, B * S, S, CHUNK_ROWS, FLAG_SCOPE)
            kb = aligned_after(staged, token) + ((src * B + b).to(tl.int64) * S * 2 * HKV
                                                  + hk) * D
            m, l, acc = _attend(q, m, l, acc, kb, kb + HKV * D, rows, whole, S, False,
                                2 * HKV * D, D, BLOCK_N, BLOCK_D, QK_SCALE, DOT_PRECISION)
        else:
            token = dl.wait(ctx, ready + src, e, "ge", src)
            # The peer's staged copy, loads ordered after the wait; aligned_after
            # keeps the tile loads 16 bytes wide.
            kb = aligned_after(dl.symm_at(ctx, staged, src), token) + (
                (b.to(tl.int64) * S * HKV + hk) * D)
            m, l, acc = _attend(q, m, l, acc, kb, kb + KV_ELEMS, rows, whole, S, False,
                                HKV * D, D, BLOCK_N, BLOCK_D, QK_SCALE, DOT_PRECISION)

    l_safe = tl.where(l > 0, l, 1.0)
    o = acc / l_safe[:, None]
    tl.store(out_ptr + q_offs[:, None] + d[None, :], o.to(out_ptr.dtype.element_ty),
             mask=rd_mask)
    # (+inf where no key was seen, none: the backward then weighs no key.)
    tl.store(lse_ptr + bh.to(tl.int64) * S + rows,
             tl.where(l > 0, m + tl.log2(l_safe), float("inf")), mask=r_mask)
    if pid == 0:
        # Every peer has reached this epoch (so has finished reading what this
        # rank's next-but-one call rewrites), causal or not.
        if INBOX:
            wait_every_peer(ctx, flags, e, me, world, B * S, CHUNK_ROWS, FLAG_SCOPE)
        else:
            for step in range(1, world):
                src = (me + step) % world
                dl.wait(ctx, ready + src, e, "ge", src)
        if INBOX:
            # The pushes' source (k_ptr) must outlive them: this kernel, whose
            # operand it is, ends after they have.
            wait_pushes_sent(ctx, SENT_OFF, me, world, e)
