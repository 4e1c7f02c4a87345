"""ag_attention: sequence-parallel attention whose KV gather is overlapped with the
flash-attention tiles.

Every rank holds S positions of q, k and v ([B, S, H, D], rank r holding global
positions [r * S, (r + 1) * S)). Before the kernel, the call's prologue stages
this rank's k and v into its heap (``STAGE_OFF + (e % 2) * PARITY_BYTES``: k, then
v, each [B, S, HKV, D]); program 0 then raises this rank's ready flag in every
peer's heap (``READY_OFF + 4 * me``, set to the epoch, a release).

Grid: (B * HQ * cdiv(S, BLOCK_M),): program ``pid`` owns BLOCK_M query rows of
one (batch, query head). It runs a float32 online softmax over the chunks of
the ranks its queries see, its own chunk first (read from k and v directly,
no wait), then each peer's (loaded from the peer's staged copy through
``dl.symm_at`` once its ready flag shows the epoch). Causal: only ranks
me, me - 1, ..., 0 (chunks the queries never see are never fetched), the own
chunk masked on the diagonal and cut at the tile's last query. Grouped-query
attention: query head h reads KV head h // (HQ / HKV).

Reuse: rank r's prologue rewrites staging parity p at epoch e + 2, after its
kernel e + 1 ended; program 0 of that kernel waited for every peer's ready
flag of epoch e + 1, which a peer raises at the start of its kernel e + 1,
after its kernel e (the last reader of parity p) ended. So parity alone
keeps the staged data of call e while it is read, causal or not.

Deadlock: program 0 notifies before it waits; every other wait is for a
peer's program 0, which waits for nothing before notifying.
"""

import triton
import triton.language as tl

import jaxtdist.language as dl
from jaxtdist.kernels._tiles import aligned_after


@triton.jit
def _attend(q, m, l, acc, kb, vb, b, hk, rows, hi, DIAG: tl.constexpr,
            S: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_D: tl.constexpr, QK_SCALE: tl.constexpr, IEEE: tl.constexpr):
    """Folds keys [0, hi) of one chunk (k at ``kb``, v at ``vb``, [B, S, HKV, D]) into
    the online softmax (m, l, acc) of the query tile ``q`` (rows ``rows`` of the
    chunk's positions; with DIAG, key j is seen by row i only when j <= i)."""
    d = tl.arange(0, BLOCK_D)
    d_mask = d < D
    for start in range(0, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        p_mask = pos < hi
        offs = ((b * S + pos).to(tl.int64) * HKV + hk) * D
        kv_mask = p_mask[:, None] & d_mask[None, :]
        k = tl.load(kb + offs[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        seen = p_mask[None, :]
        if DIAG:
            seen = seen & (pos[None, :] <= rows[:, None])
        s = tl.where(seen, s * QK_SCALE, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        # A row with no key seen yet keeps m = -inf: shift by 0 instead (no NaN).
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - shift)
        p = tl.exp2(s - shift[:, None])
        l = l * alpha + tl.sum(p, 1)
        v = tl.load(vb + offs[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if IEEE:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m = m_new
    return m, l, acc


@triton.jit
def ag_attention_kernel(ctx, q_ptr, k_ptr, v_ptr, out_ptr,
                        S: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                        CAUSAL: tl.constexpr, QK_SCALE: tl.constexpr, STAGE_OFF: tl.constexpr,
                        PARITY_BYTES: tl.constexpr, KV_ELEMS: tl.constexpr,
                        READY_OFF: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr):
    """Grid: (B * HQ * cdiv(S, BLOCK_M),).

    q: [B, S, HQ, D]; k, v: [B, S, HKV, D] (this rank's positions); out: [B, S, HQ, D].
    KV_ELEMS = B * S * HKV * D (v's offset in the staged copy).
    """
    pid = tl.program_id(0)
    m_tiles = tl.cdiv(S, BLOCK_M)
    bh = pid // m_tiles
    mt = pid % m_tiles
    b = bh // HQ
    h = bh % HQ
    hk = h // (HQ // HKV)
    me = dl.rank(ctx)
    world = dl.num_ranks(ctx)
    e = dl.epoch(ctx)
    ready = dl.heap_ptr(ctx, READY_OFF, tl.int32)
    if pid == 0:
        # The staged copy of this rank's k and v is in the heap (the prologue ran
        # before this kernel): tell every peer.
        for step in range(1, world):
            dl.notify(ctx, ready + me, (me + step) % world, e)

    rows = mt * BLOCK_M + tl.arange(0, BLOCK_M)
    r_mask = rows < S
    d = tl.arange(0, BLOCK_D)
    d_mask = d < D
    q_offs = ((b * S + rows).to(tl.int64) * HQ + h) * D
    q = tl.load(q_ptr + q_offs[:, None] + d[None, :], mask=r_mask[:, None] & d_mask[None, :],
                other=0.0)
    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)

    # The own chunk first: no wait. Causal: keys up to the tile's last query.
    if CAUSAL:
        m, l, acc = _attend(q, m, l, acc, k_ptr, v_ptr, b, hk, rows,
                            tl.minimum((mt + 1) * BLOCK_M, S), True, S, HKV, D, BLOCK_N,
                            BLOCK_D, QK_SCALE, IEEE)
        peers = me  # ranks me - 1, ..., 0: every key before every query of this rank
    else:
        m, l, acc = _attend(q, m, l, acc, k_ptr, v_ptr, b, hk, rows, S, False, S, HKV, D,
                            BLOCK_N, BLOCK_D, QK_SCALE, IEEE)
        peers = world - 1
    stage_k = dl.heap_ptr(ctx, STAGE_OFF + (e % 2) * PARITY_BYTES, k_ptr.dtype.element_ty)
    for step in range(1, peers + 1):
        if CAUSAL:
            src = me - step
        else:
            src = (me + step) % world
        token = dl.wait(ctx, ready + src, e, "ge", src)
        # The peer's staged copy, loads ordered after the wait; aligned_after keeps
        # the tile loads 16 bytes wide.
        kb = aligned_after(dl.symm_at(ctx, stage_k, src), token)
        m, l, acc = _attend(q, m, l, acc, kb, kb + KV_ELEMS, b, hk, rows, S, False, S, HKV, D,
                            BLOCK_N, BLOCK_D, QK_SCALE, IEEE)

    l_safe = tl.where(l > 0, l, 1.0)
    o = acc / l_safe[:, None]
    tl.store(out_ptr + q_offs[:, None] + d[None, :], o.to(out_ptr.dtype.element_ty),
             mask=r_mask[:, None] & d_mask[None, :])
    if pid == 0:
        # Every peer has started this epoch, so has finished reading the staging
        # parity that this rank's next-but-one prologue rewrites.
        for step in range(1, world):
            src = (me + step) % world
            dl.wait(ctx, ready + src, e, "ge", src)
