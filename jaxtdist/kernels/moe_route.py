"""moe_route: the dispatch's routing metadata, computed by the dispatch kernel's
programs themselves (config ROUTING="fused"; ``ops/moe/_routing.route`` computes
the same words in XLA).

``route_program``, called by program p of the dispatch kernel first thing,
scans every token's ids for the counts before its own tokens and in all
(histograms; T K words, from L2), then writes its tokens' words: their slot
per rank and their meta rows (token index; per local expert of a rank: local
expert id, position among that expert's rows from this rank, k, scale bits).
No launch before the dispatch and no other program to wait for.

A pair (t, k) is valid when its id is in [0, E) and not a repeat of an earlier
k of the same token.
"""

import triton
import triton.language as tl


@triton.jit
def _pairs(ids_ptr, t0, t_end, K: tl.constexpr, E: tl.constexpr, E_LOC: tl.constexpr,
           W: tl.constexpr, KP: tl.constexpr, WP: tl.constexpr, BT: tl.constexpr):
    """Tokens [t0, min(t0 + BT, t_end)): (t [BT], in-bounds [BT, KP], valid [BT, KP],
    expert id (0 where invalid) [BT, KP], destination rank (W where invalid) [BT,
    KP], sent to rank w [BT, WP] int32)."""
    t = t0 + tl.arange(0, BT)
    ks = tl.arange(0, KP)
    inb = (t[:, None] < t_end) & (ks[None, :] < K)
    ids = tl.load(ids_ptr + t[:, None] * K + ks[None, :], mask=inb, other=-1)
    earlier = ks[None, None, :] < ks[None, :, None]                      # k' < k
    repeat = tl.max(((ids[:, :, None] == ids[:, None, :]) & earlier).to(tl.int32), axis=2)
    valid = inb & (ids >= 0) & (ids < E) & (repeat == 0)
    vid = tl.where(valid, ids, 0)
    dest = tl.where(valid, vid // E_LOC, W)
    ws = tl.arange(0, WP)
    send = tl.max((dest[:, :, None] == ws[None, None, :]).to(tl.int32), axis=1)
    return t, inb, valid, vid, dest, send


@triton.jit
def route_program(ids_ptr, scale_ptr, slot_ptr, meta_ptr, dcounts_ptr, bounds_ptr, invalid_ptr,
                  pid, T: tl.constexpr, K: tl.constexpr, E: tl.constexpr,
                  E_LOC: tl.constexpr, KL: tl.constexpr, W: tl.constexpr, TP: tl.constexpr,
                  KP: tl.constexpr, EP: tl.constexpr, WP: tl.constexpr, KLP: tl.constexpr,
                  BT: tl.constexpr, BS: tl.constexpr):
    """The routing words of program pid's tokens, computed by the program itself
    (the dispatch's fused routing). ids [T, K] int32, scale [T, K] float32 ->
    slot [T, W] and meta [T, W, 1 + 4 KL] of its tokens; dcounts [E] (row pid of
    [P, E]: pairs per expert, every token); bounds [W, 3] (row pid of [P, W, 3]:
    per rank, the tokens sent there before this program's tokens, before their
    end, and in all); program 0 also invalid [1]. Every program reads all T K
    ids: each count is a histogram of BS tokens' pairs per step (BT: tokens per
    step of its own tokens' words, a [BT, KP, EP] block)."""
    t_lo = pid * TP
    t_hi = tl.minimum(t_lo + TP, T)
    all_e = tl.zeros((EP,), tl.int32)
    pre_e = tl.zeros((EP,), tl.int32)
    all_d = tl.zeros((WP,), tl.int32)
    pre_d = tl.zeros((WP,), tl.int32)
    end_d = tl.zeros((WP,), tl.int32)
    bad = tl.zeros((KP,), tl.int32)
    for t0 in range(0, T, BS):
        t, inb, valid, vid, dest, send = _pairs(ids_ptr, t0, T, K, E, E_LOC, W, KP, WP, BS)
        before = (t < t_lo)[:, None]
        flat = tl.reshape(vid, (BS * KP,))
        all_e += tl.histogram(flat, EP, mask=tl.reshape(valid, (BS * KP,)))
        pre_e += tl.histogram(flat, EP, mask=tl.reshape(valid & before, (BS * KP,)))
        all_d += tl.sum(send, axis=0)
        pre_d += tl.sum(tl.where(before, send, 0), axis=0)
        end_d += tl.sum(tl.where((t < t_hi)[:, None], send, 0), axis=0)
        bad += tl.sum((inb & ~valid).to(tl.int32), axis=0)
    es = tl.arange(0, EP)
    ws = tl.arange(0, WP)
    tl.store(dcounts_ptr + pid * E + es, all_e, mask=es < E)
    b = bounds_ptr + (pid * W + ws) * 3
    tl.store(b, pre_d, mask=ws < W)
    tl.store(b + 1, end_d, mask=ws < W)
    tl.store(b + 2, all_d, mask=ws < W)
    if pid == 0:
        tl.store(invalid_ptr, tl.sum(bad, axis=0))
    # Its tokens' slots and meta rows, BT at a time, from the pairs per expert
    # (pre_e) and the tokens per rank (pre_d) before them.
    META_WORDS: tl.constexpr = 1 + 4 * KL
    ks = tl.arange(0, KP)
    js = tl.arange(0, KLP)
    for t0 in range(t_lo, t_hi, BT):
        t, inb, valid, vid, dest, send = _pairs(ids_ptr, t0, t_hi, K, E, E_LOC, W, KP, WP, BT)
        tm = t < t_hi
        # Slot of token t at rank w: sends to w before it (this program's earlier
        # tokens and earlier programs').
        before_d = tl.cumsum(send, axis=0) - send + pre_d[None, :]
        slot = tl.where(send > 0, before_d, -1)
        tl.store(slot_ptr + t[:, None] * W + ws[None, :], slot,
                 mask=tm[:, None] & (ws[None, :] < W))
        pre_d += tl.sum(send, axis=0)
        # Position of pair (t, k) among its expert's rows from this rank.
        onehot = ((vid[:, :, None] == es[None, None, :])
                  & valid[:, :, None]).to(tl.int32)                     # [BT, KP, EP]
        per_token = tl.sum(onehot, axis=1)                               # [BT, EP]
        before_e = tl.cumsum(per_token, axis=0) - per_token + pre_e[None, :]
        pos = tl.sum(tl.where(vid[:, :, None] == es[None, None, :], before_e[:, None, :], 0),
                     axis=2)                                             # [BT, KP]
        pre_e += tl.sum(per_token, axis=0)
        # kk: the pair's rank among the token's valid pairs on the same destination.
        earlier = ks[None, None, :] < ks[None, :, None]
        kk = tl.sum(((dest[:, :, None] == dest[:, None, :]) & valid[:, None, :]
                     & earlier).to(tl.int32), axis=2)
        scale = tl.load(scale_ptr + t[:, None] * K + ks[None, :], mask=inb, other=0.0)
        bits = scale.to(tl.int32, bitcast=True)
        kidx = tl.zeros((BT, KP), tl.int32) + ks[None, :]
        for w in range(0, W):
            base = meta_ptr + (t * W + w) * META_WORDS
            tl.store(base, t, mask=tm)
            # Slot j of rank w: the valid pair with dest w and kk == j (at most one).
            match = (valid & (dest == w))[:, :, None] & (kk[:, :, None] == js[None, None, :])
            hit = tl.max(match.to(tl.int32), axis=1) > 0                 # [BT, KLP]
            jm = tm[:, None] & (js[None, :] < KL)
            words = base[:, None] + 1 + 4 * js[None, :]
            local = tl.sum(tl.where(match, (vid % E_LOC)[:, :, None], 0), axis=1)
            tl.store(words, tl.where(hit, local, -1), mask=jm)
            tl.store(words + 1, tl.where(hit, tl.sum(tl.where(match, pos[:, :, None], 0),
                                                     axis=1), -1), mask=jm)
            tl.store(words + 2, tl.where(hit, tl.sum(tl.where(match, kidx[:, :, None], 0),
                                                     axis=1), -1), mask=jm)
            tl.store(words + 3, tl.where(hit, tl.sum(tl.where(match, bits[:, :, None], 0),
                                                     axis=1), -1), mask=jm)
