"""ag_attention's backward over several ranks: the gradients of this rank's queries'
attention over every rank's keys and values, the KV gather and the dk/dv
reduce-scatter overlapped with the tiles (no XLA collective).

Layouts as in the forward (``kernels/ag_attention.py``): rank r holds S positions
of q, k, v ([B, S, H, D], global positions [r * S, (r + 1) * S)); this rank's k
and v as one [B * S, 2 * HKV * D] array ``kv`` (k's columns, then v's), which
every rank pushes into every peer's heap inbox as its call starts (the copy
engines on GPUs, while these kernels run; ``_gather.push_shards_kernel`` before
them under the interpreter), one flag per CHUNK_ROWS rows, parity ``epoch % 2``. Scores are base 2 as in
``attention_bwd``, whose block steps (``_dq_block``, ``_dkdv_block``) these
kernels run; the rows' ``lse`` come from the forward, ``delta = rowsum(dO * O)``
(float32 [B * HQ, S]) from the op.

Three kernels of one call (one epoch), in this order on the device:

1. ``ag_attention_bwd_dkdv_kernel``, grid (W * B * HKV * cdiv(S, BLOCK_N),):
   a program owns one key tile of one chunk (source rank ``src``) and sums its
   dk and dv over this rank's query rows (every query head of its KV head).
   Chunks in program order: this rank's own first (read from ``kv``: no wait,
   it overlaps the gather), then me - 1, me - 2, ... (the order peers push to
   this rank). A peer chunk's tile waits for its rows' inbox flags; its float32
   partials go straight into the owner's heap (slot ``_partials.slot_of(me,
   src)``, dk then dv), then the owner's tile flag is raised. Own tiles store
   their partials to ``dk_own``/``dv_own`` (float32, local). Causal: chunks
   after this rank's are never seen (those programs end at once); the own
   chunk is masked on the diagonal, peers' chunks not at all.
2. ``ag_attention_bwd_dq_kernel``, grid (B * HQ * cdiv(S, BLOCK_M),): a query
   tile's dq over its own chunk, then each peer's (after its flags), as the
   forward. Program 0 then waits for every peer's flags of this epoch (the
   inbox reuse) and for this rank's pushes to have ended (``kv`` outlives them).
3. ``ag_attention_bwd_reduce_kernel``, grid (B * HKV * cdiv(S, BLOCK_N),): an
   own key tile's partials plus every peer's that sees it (causal: ranks after
   this one; else all), in float32, rounded once to dk's and dv's dtype.

Why dk/dv first and the sum in a kernel of its own: the partials of the last
peer tiles leave as the dk/dv kernel ends, and cross the link under the dq
kernel, so the reduce kernel finds them there (the tail hidden); its waits
target a previous kernel of the peers, never a program that could be waiting
for a slot on the same SMs.

Reuse (two parities, no acknowledgement): a rank writes a peer's KV inbox or
partials slot of parity p at epoch e + 2. The KV pushes of e + 2 start after
its kernels of e + 1, whose dq program 0 waited for every peer's KV flags of
e + 1, which a peer raises only after all its kernels of e (the last readers
of parity p, the reduce of the partials included) ended. A partial of e + 2
for owner o is pushed only after o's KV flags of e + 2 for that tile: o's
kernels of e have ended. Partial flags compare ">=" (a flag may already hold
e + 1: its data went to the other parity).

Deadlock: the KV pushes wait for nothing; the dk/dv and dq kernels wait only
for them; the reduce kernel waits only for peers' dk/dv kernels.
"""

import triton
import triton.language as tl

import jaxtdist.language as dl
from jaxtdist.kernels._inbox import wait_every_peer, wait_pushes_sent, wait_rows
from jaxtdist.kernels._partials import partials_inbox, raise_flag, slot_of
from jaxtdist.kernels._tiles import aligned_after, load_rows
from jaxtdist.kernels.attention_bwd import _dkdv_block, _dq_block


@triton.jit
def _chunk_src(me, step, CAUSAL: tl.constexpr, WORLD: tl.constexpr):
    """The source rank of chunk ``step`` in a program's order (0: this rank's own,
    then me - 1, me - 2, ...); causal: -1 past rank 0 (chunks no query sees)."""
    if CAUSAL:
        src = me - step
    else:
        src = (me + WORLD - step) % WORLD
    return src


@triton.jit
def _kv_head(ctx, kv_ptr, inbox, flags, e, src, me, b, hk, row0, ROWS: tl.constexpr,
             B: tl.constexpr, S: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
             CHUNK_ROWS: tl.constexpr, SCOPE: tl.constexpr):
    """The key of position 0 of (batch ``b``, KV head ``hk``) in chunk ``src`` (rows
    2 * HKV * D elements apart, the value HKV * D past the key): ``kv`` itself for
    this rank's chunk, else the inbox after the flags of the chunk's positions
    [row0, row0 + ROWS)."""
    head = (b.to(tl.int64) * S * 2 * HKV + hk) * D
    base = kv_ptr + head
    if src != me:
        token = wait_rows(ctx, flags, e, src, b * S + row0, B * S, ROWS, CHUNK_ROWS, SCOPE)
        base = aligned_after(inbox, token) + src.to(tl.int64) * (B * S * 2 * HKV * D) + head
    return base


@triton.jit
def _dkdv_tile(k, v, nt, b, hk, q_ptr, do_ptr, lse_ptr, delta_ptr, pos, DIAG: tl.constexpr,
               S: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
               QK_SCALE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """(dk without SM_SCALE, dv) of key tile ``nt`` (positions ``pos`` of a chunk)
    over this rank's S query rows of every query head of KV head ``hk``. DIAG: the
    chunk is this rank's own under causal masking (row i sees key j <= i): rows
    before the tile are skipped, the diagonal's masked; else every row sees every
    key (only the last partial query tile masked)."""
    group: tl.constexpr = HQ // HKV
    dk = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
    whole = S // BLOCK_M * BLOCK_M  # rows of whole query tiles
    if DIAG:
        # Rows that see any key of the tile start at its first key; from the first
        # query tile whose first row sees the tile's last key on, unmasked.
        lo = tl.minimum(nt * BLOCK_N, S) // BLOCK_M * BLOCK_M
        unmasked = tl.minimum(tl.maximum(
            tl.cdiv(nt * BLOCK_N + BLOCK_N - 1, BLOCK_M) * BLOCK_M, lo), whole)
    else:
        lo = 0
        unmasked = 0
    for g in range(group):
        h = hk * group + g
        qb = q_ptr + (b.to(tl.int64) * S * HQ + h) * D
        dob = do_ptr + (b.to(tl.int64) * S * HQ + h) * D
        lse_row = lse_ptr + (b * HQ + h).to(tl.int64) * S
        delta_row = delta_ptr + (b * HQ + h).to(tl.int64) * S
        for start in range(lo, unmasked, BLOCK_M):  # the causal diagonal
            dk, dv = _dkdv_block(k, v, dk, dv, qb, dob, lse_row, delta_row, pos, start, True,
                                 DIAG, 0, S, HQ * D, D, BLOCK_M, BLOCK_D, QK_SCALE,
                                 DOT_PRECISION)
        for start in range(tl.maximum(unmasked, lo), whole, BLOCK_M):
            dk, dv = _dkdv_block(k, v, dk, dv, qb, dob, lse_row, delta_row, pos, start, False,
                                 DIAG, 0, S, HQ * D, D, BLOCK_M, BLOCK_D, QK_SCALE,
                                 DOT_PRECISION)
        for start in range(tl.maximum(whole, lo), S, BLOCK_M):  # the last partial tile
            dk, dv = _dkdv_block(k, v, dk, dv, qb, dob, lse_row, delta_row, pos, start, True,
                                 DIAG, 0, S, HQ * D, D, BLOCK_M, BLOCK_D, QK_SCALE,
                                 DOT_PRECISION)
    return dk, dv


@triton.jit
def ag_attention_bwd_dkdv_kernel(ctx, q_ptr, kv_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr,
                                 dv_ptr, B: tl.constexpr, S: tl.constexpr, HQ: tl.constexpr,
                                 HKV: tl.constexpr, D: tl.constexpr, CAUSAL: tl.constexpr,
                                 QK_SCALE: tl.constexpr, SM_SCALE: tl.constexpr,
                                 WORLD: tl.constexpr, INBOX_OFF: tl.constexpr,
                                 PARITY_BYTES: tl.constexpr, FLAGS_OFF: tl.constexpr,
                                 CHUNK_ROWS: tl.constexpr, FLAG_SCOPE: tl.constexpr,
                                 PART_OFF: tl.constexpr, PART_PARITY_BYTES: tl.constexpr,
                                 PART_FLAGS_OFF: tl.constexpr, BLOCK_M: tl.constexpr,
                                 BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                                 DOT_PRECISION: tl.constexpr):
    """Grid: (WORLD * B * HKV * cdiv(S, BLOCK_N),).

    q, do: [B, S, HQ, D]; kv: [B * S, 2 * HKV * D]; lse, delta: float32 [B * HQ, S];
    dk, dv: float32 [B, S, HKV, D], this rank's queries' share of its own keys'
    gradients. Peers' shares go to their owners' partials inboxes at PART_OFF
    (parity ``epoch % 2`` of PART_PARITY_BYTES; WORLD - 1 slots of [2, B, S, HKV,
    D] float32; flags at PART_FLAGS_OFF, B * HKV * cdiv(S, BLOCK_N) per slot).
    KV inbox at INBOX_OFF (parity of PARITY_BYTES, [WORLD * B * S, 2 * HKV * D]),
    its chunk flags at FLAGS_OFF."""
    pid = tl.program_id(0)
    n_tiles: tl.constexpr = (S + BLOCK_N - 1) // BLOCK_N
    per_chunk: tl.constexpr = B * HKV * n_tiles
    step = pid // per_chunk
    tile = pid % per_chunk
    bhk = tile // n_tiles
    nt = tile % n_tiles
    b = bhk // HKV
    hk = bhk % HKV
    me = dl.rank(ctx)
    e = dl.epoch(ctx)
    src = _chunk_src(me, step, CAUSAL, WORLD)
    if src >= 0:
        inbox = dl.parity_ptr(ctx, INBOX_OFF, PARITY_BYTES, kv_ptr.dtype.element_ty)
        flags = dl.heap_ptr(ctx, FLAGS_OFF, tl.int32)
        pos = nt * BLOCK_N + tl.arange(0, BLOCK_N)
        kb = _kv_head(ctx, kv_ptr, inbox, flags, e, src, me, b, hk, nt * BLOCK_N, BLOCK_N, B,
                      S, HKV, D, CHUNK_ROWS, FLAG_SCOPE)
        k = load_rows(kb, pos, S, 2 * HKV * D, D, BLOCK_D, True)
        v = load_rows(kb + HKV * D, pos, S, 2 * HKV * D, D, BLOCK_D, True)
        d = tl.arange(0, BLOCK_D)
        offs = ((b * S + pos).to(tl.int64) * HKV + hk)[:, None] * D + d[None, :]
        mask = (pos < S)[:, None] & (d < D)[None, :]
        if step == 0:
            dk, dv = _dkdv_tile(k, v, nt, b, hk, q_ptr, do_ptr, lse_ptr, delta_ptr, pos, CAUSAL,
                                S, HQ, HKV, D, BLOCK_M, BLOCK_N, BLOCK_D, QK_SCALE,
                                DOT_PRECISION)
            tl.store(dk_ptr + offs, dk * SM_SCALE, mask=mask)
            tl.store(dv_ptr + offs, dv, mask=mask)
        else:
            dk, dv = _dkdv_tile(k, v, nt, b, hk, q_ptr, do_ptr, lse_ptr, delta_ptr, pos, False,
                                S, HQ, HKV, D, BLOCK_M, BLOCK_N, BLOCK_D, QK_SCALE,
                                DOT_PRECISION)
            parts, part_flags = partials_inbox(ctx, dk_ptr, PART_OFF, PART_PARITY_BYTES,
                                               PART_FLAGS_OFF, False)
            slot = parts + slot_of(me, src, WORLD).to(tl.int64) * (2 * B * S * HKV * D)
            tl.store(dl.symm_at(ctx, slot + offs, src), dk * SM_SCALE, mask=mask)
            tl.store(dl.symm_at(ctx, slot + B * S * HKV * D + offs, src), dv, mask=mask)
            raise_flag(ctx, part_flags, per_chunk, tile, me, src, e, WORLD)


@triton.jit
def _dq_chunk(q, do, dq, lse, delta, kb, rows, full, hi, DIAG: tl.constexpr,
              STRIDE: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_D: tl.constexpr, QK_SCALE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """dq + dS @ k over keys [0, hi) of one chunk: [0, full) unmasked (a multiple of
    BLOCK_N, seen by every row), then [full, hi) masked (DIAG: key j seen by row i
    only when j <= i; the chunk's last partial block)."""
    for start in range(0, full, BLOCK_N):
        # (The value: half a row past the key.)
        dq = _dq_block(q, do, dq, lse, delta, kb, kb + STRIDE // 2, rows, start, hi, False,
                       DIAG, STRIDE, D, BLOCK_N, BLOCK_D, QK_SCALE, DOT_PRECISION)
    for start in range(full, hi, BLOCK_N):
        dq = _dq_block(q, do, dq, lse, delta, kb, kb + STRIDE // 2, rows, start, hi, True,
                       DIAG, STRIDE, D, BLOCK_N, BLOCK_D, QK_SCALE, DOT_PRECISION)
    return dq


@triton.jit
def ag_attention_bwd_dq_kernel(ctx, q_ptr, kv_ptr, do_ptr, lse_ptr, delta_ptr, after_ptr, dq_ptr,
                               B: tl.constexpr, S: tl.constexpr, HQ: tl.constexpr,
                               HKV: tl.constexpr, D: tl.constexpr, CAUSAL: tl.constexpr,
                               QK_SCALE: tl.constexpr, SM_SCALE: tl.constexpr,
                               WORLD: tl.constexpr, INBOX_OFF: tl.constexpr,
                               PARITY_BYTES: tl.constexpr, FLAGS_OFF: tl.constexpr,
                               SENT_OFF: tl.constexpr, CHUNK_ROWS: tl.constexpr,
                               FLAG_SCOPE: tl.constexpr, BLOCK_M: tl.constexpr,
                               BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                               DOT_PRECISION: tl.constexpr):
    """Grid: (B * HQ * cdiv(S, BLOCK_M),). dq: [B, S, HQ, D] in its own dtype;
    ``after``: the dk/dv kernel's output, unread (XLA runs this kernel after that
    one); other operands as ``ag_attention_bwd_dkdv_kernel``'s. Causal tiles
    launch longest (last queries) first."""
    pid = tl.program_id(0)
    m_tiles: tl.constexpr = (S + BLOCK_M - 1) // BLOCK_M
    bh = pid // m_tiles
    mt = m_tiles - 1 - pid % m_tiles
    b = bh // HQ
    h = bh % HQ
    hk = h // (HQ // HKV)
    me = dl.rank(ctx)
    e = dl.epoch(ctx)
    inbox = dl.parity_ptr(ctx, INBOX_OFF, PARITY_BYTES, kv_ptr.dtype.element_ty)
    flags = dl.heap_ptr(ctx, FLAGS_OFF, tl.int32)
    rows = mt * BLOCK_M + tl.arange(0, BLOCK_M)
    r_mask = rows < S
    d = tl.arange(0, BLOCK_D)
    rd_mask = r_mask[:, None] & (d < D)[None, :]
    q_offs = ((b * S + rows).to(tl.int64) * HQ + h) * D
    q = tl.load(q_ptr + q_offs[:, None] + d[None, :], mask=rd_mask, other=0.0)
    do = tl.load(do_ptr + q_offs[:, None] + d[None, :], mask=rd_mask, other=0.0)
    lse = tl.load(lse_ptr + bh.to(tl.int64) * S + rows, mask=r_mask, other=float("inf"))
    delta = tl.load(delta_ptr + bh.to(tl.int64) * S + rows, mask=r_mask, other=0.0)
    dq = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    stride: tl.constexpr = 2 * HKV * D
    # The own chunk first: no wait. Causal: keys up to the tile's last query, those
    # before its first seen by every row.
    own = kv_ptr + (b.to(tl.int64) * S * 2 * HKV + hk) * D
    whole = S // BLOCK_N * BLOCK_N
    if CAUSAL:
        hi = tl.minimum((mt + 1) * BLOCK_M, S)
        dq = _dq_chunk(q, do, dq, lse, delta, own, rows, mt * BLOCK_M // BLOCK_N * BLOCK_N, hi,
                       True, stride, D, BLOCK_N, BLOCK_D, QK_SCALE, DOT_PRECISION)
        peers = me  # ranks me - 1, ..., 0: every key before every query of this rank
    else:
        dq = _dq_chunk(q, do, dq, lse, delta, own, rows, whole, S, False, stride, D, BLOCK_N,
                       BLOCK_D, QK_SCALE, DOT_PRECISION)
        peers = WORLD - 1
    for step in range(1, peers + 1):
        src = (me + WORLD - step) % WORLD
        kb = _kv_head(ctx, kv_ptr, inbox, flags, e, src, me, b, hk, 0, S, B, S, HKV, D,
                      CHUNK_ROWS, FLAG_SCOPE)
        dq = _dq_chunk(q, do, dq, lse, delta, kb, rows, whole, S, False, stride, D, BLOCK_N,
                       BLOCK_D, QK_SCALE, DOT_PRECISION)
    tl.store(dq_ptr + q_offs[:, None] + d[None, :], (dq * SM_SCALE).to(dq_ptr.dtype.element_ty),
             mask=rd_mask)
    if pid == 0:
        # Every peer has pushed this epoch's KV (so has finished the kernels that
        # read what this rank's next-but-one call rewrites), causal or not; this
        # rank's pushes have read kv, this kernel's operand.
        wait_every_peer(ctx, flags, e, me, WORLD, B * S, CHUNK_ROWS, FLAG_SCOPE)
        wait_pushes_sent(ctx, SENT_OFF, me, WORLD, e)


@triton.jit
def ag_attention_bwd_reduce_kernel(ctx, dk_own_ptr, dv_own_ptr, after_ptr, dk_ptr, dv_ptr,
                                   B: tl.constexpr, S: tl.constexpr, HKV: tl.constexpr,
                                   D: tl.constexpr, CAUSAL: tl.constexpr, WORLD: tl.constexpr,
                                   PART_OFF: tl.constexpr, PART_PARITY_BYTES: tl.constexpr,
                                   PART_FLAGS_OFF: tl.constexpr, BLOCK_N: tl.constexpr,
                                   BLOCK_D: tl.constexpr):
    """Grid: (B * HKV * cdiv(S, BLOCK_N),), the dk/dv kernel's key tiles of this
    rank's chunk. dk_own, dv_own: its float32 partials; dk, dv: [B, S, HKV, D], the
    sums over every rank whose queries see the tile, in their own dtype. ``after``:
    the dq kernel's output, unread: the call's last output (which the next call
    runs after) comes after every kernel of the call that reads the inbox."""
    tile = tl.program_id(0)
    n_tiles: tl.constexpr = (S + BLOCK_N - 1) // BLOCK_N
    per_chunk: tl.constexpr = B * HKV * n_tiles
    bhk = tile // n_tiles
    nt = tile % n_tiles
    b = bhk // HKV
    hk = bhk % HKV
    me = dl.rank(ctx)
    e = dl.epoch(ctx)
    parts, flags = partials_inbox(ctx, dk_own_ptr, PART_OFF, PART_PARITY_BYTES, PART_FLAGS_OFF,
                                  False)
    pos = nt * BLOCK_N + tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    offs = ((b * S + pos).to(tl.int64) * HKV + hk)[:, None] * D + d[None, :]
    mask = (pos < S)[:, None] & (d < D)[None, :]
    dk = tl.load(dk_own_ptr + offs, mask=mask, other=0.0)
    dv = tl.load(dv_own_ptr + offs, mask=mask, other=0.0)
    # Peers in the order they push to this rank (rank me + s does at its step s);
    # causal: only later ranks' queries see this rank's keys.
    if CAUSAL:
        sources = WORLD - 1 - me
    else:
        sources = WORLD - 1
    for step in range(1, sources + 1):
        src = (me + step) % WORLD
        slot = slot_of(src, me, WORLD)
        token = dl.wait(ctx, flags + slot * per_chunk + tile, e, "ge", src)
        part = aligned_after(parts, token) + slot.to(tl.int64) * (2 * B * S * HKV * D)
        dk += tl.load(part + offs, mask=mask, other=0.0)
        dv += tl.load(part + B * S * HKV * D + offs, mask=mask, other=0.0)
    tl.store(dk_ptr + offs, dk.to(dk_ptr.dtype.element_ty), mask=mask)
    tl.store(dv_ptr + offs, dv.to(dv_ptr.dtype.element_ty), mask=mask)
