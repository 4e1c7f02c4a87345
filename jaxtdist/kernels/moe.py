"""moe: expert-parallel dispatch and combine (low-latency push all-to-all).

Experts are split evenly over the W ranks: rank d owns local experts
``[d * E_LOC, (d + 1) * E_LOC)``. The sender's routing metadata (which ranks
a token goes to, its slot there, its local experts and their positions) is
computed on the device, by the dispatch kernel itself (ROUTE) or by the op
before it; counts are data, so one compiled kernel serves every routing.

Dispatch (``moe_dispatch_kernel``), program p of rank ``me`` owns tokens
``[p * TP, (p + 1) * TP)``, in NCH chunks of CT tokens:

1. Push: first the header to every rank (rows per local expert, this
   program's first slot, the slot total); then each chunk's token rows, each
   loaded once and stored once per destination rank (not once per expert) into
   that rank's heap inbox, slot ``slot[t, d]`` of the source region ``me``,
   with its meta row (token index, and per local expert: local expert id,
   position within (source, expert), k, scale), and the chunk's end slot into
   the header; then the flag ``FLAGS[me, p, c]`` in every rank's heap, set to
   the epoch, behind one fence (``dl.notify_peers``). Every program notifies
   every rank for every chunk in every call, empty or not.
2. Receive: chunk c of every source s once ``FLAGS[s, p, c] >= e`` (the same
   program id on every rank: no wait targets a program of this rank, so the
   grid completes in any order; under the interpreter programs run one by
   one). The headers give the count matrix cnt[s, j]; recv_x is expert-major,
   and within an expert source-major, then in token order: row (s, t, j) lands
   at ``sum_{j' < j} tot[j'] + sum_{s' < s} cnt[s', j] + pos``. Rows at R or
   beyond are dropped (never written). Program p lays out the rows that
   program p of each source pushed, one load per row chunk and one store per
   local expert, and records, per inbox row and local expert, where the row
   went (for combine); it also zeroes its share of the unused rows of recv_x
   (unless ZERO_TAIL is off).

With several chunks (bulk sizes) the steps are pipelined: chunk c - 1 is laid
out while chunk c's remote stores drain, then chunk c is flagged, a piece of
the unused rows zeroed and chunk c + 1 pushed, and only then does the program
wait for its peers' chunk c: local copies overlap the link, and each wait is
for a chunk the peers flagged a push earlier.

Combine (``moe_combine_kernel``) is the reverse, by the same program split and
the same chunks: chunk c's rows are sent, chunk c - 1's tokens summed while
they drain, then chunk c flagged (the steps below, per chunk).
Forward: program p of every rank first pushes its tokens' weights into every
rank's weight box as tagged words (``dl.pack_tagged``: no fence, no flag);
program p of the experts' rank then, for each token it holds from source s's
program p, waits for the words of the token's pairs, weighs and sums
that token's local expert rows (float32) and sends the one row into s's heap
inbox at row ``me * T + t``; with every source's rows of chunk c sent, it
notifies ``FLAGS[me, p, c]`` in each source's heap (one release drains them
all); it waits for every rank's ``FLAGS[d, p, c]`` and sums, per token, the rows
of the ranks the token went to (read from its routing). Backward (DOTS): the
rows of (t, k) pairs go back unweighed, to inbox row ``t * K + k``, and the
source weighs them (the weights' cotangent needs each pair's row). Every row
a source reads is written by exactly one rank in the same call; invalid pairs
(``KMASK``) contribute zero.

Reuse (both kernels): a source writes a peer's inbox (or weight box) of parity
``e % 2`` at epochs e and e + 2; the peer reads it in its kernel e. The
source's kernel e + 1 waited for the peer's flags of e + 1 (every rank
notifies every rank in every call), which the peer raises in its kernel
e + 1, after its kernel e (the last reader) ended. Flags compare ">=" (a
fast peer may already be at e + 1, writing only the other parity) and only
grow: nothing is reset.
The headers sit in the parity region too, for the same reason.

Workspace layout (byte offsets, ``ops/moe/_launch.DispatchWorkspace`` /
``CombineWorkspace``): FLAGS [W, P, NCH] int32 (both kernels),
then per parity: dispatch's headers [W, HDR_WORDS] int32 (E_LOC counts, per
program its NCH + 1 chunk bounds, the total), meta [W, T, META_WORDS] int32 and
rows [W, T, H]; combine's inbox of [W, T] or [T * K] rows of F and weight box
[W, T, K] int64 (tagged float32 words).
"""

import triton
import triton.language as tl

import jaxtdist.language as dl
from jaxtdist.kernels._tiles import aligned_after
from jaxtdist.kernels._trace import stamp
from jaxtdist.kernels.moe_route import route_program

# Timestamps per program with TRACE: dispatch start, rows and meta pushed, headers
# and flags sent, peers' flags seen, rows laid out, end; combine start, every
# chunk's rows sent and flagged (with chunks, every chunk's sums but the last's
# among them), the last chunk's flags seen, end.
TRACE_PHASES = tl.constexpr(6)


@triton.jit
def _pick(vec, idx, j):
    """vec[j] for a runtime scalar j (vec a 1-D block indexed by ``idx``)."""
    return tl.sum(tl.where(idx == j, vec, 0), axis=0)


@triton.jit
def _store_row(recv_ptr, tail_ptr, r, cols, v, hm, H: tl.constexpr, SPLIT: tl.constexpr):
    """Columns ``cols`` of received row r: into recv [R, H]; with SPLIT > 0 the
    first SPLIT columns into recv [R, SPLIT] and the rest into tail [R, H - SPLIT]
    (fp8 rows: the tokens' bytes and their scales' land as separate arrays, so
    that no copy has to cut them apart afterwards)."""
    if SPLIT == 0:
        tl.store(recv_ptr + tl.cast(r, tl.int64) * H + cols, v, mask=hm)
    else:
        tl.store(recv_ptr + tl.cast(r, tl.int64) * SPLIT + cols, v, mask=hm & (cols < SPLIT))
        tl.store(tail_ptr + tl.cast(r, tl.int64) * (H - SPLIT) + (cols - SPLIT), v,
                 mask=hm & (cols >= SPLIT))


@triton.jit
def _stamp(trace_ptr, pid, phase, TRACE: tl.constexpr):
    """With TRACE, the GPU's clock (low 32 bits of ns) at ``phase`` of program
    ``pid`` into trace [P, TRACE_PHASES] int32 (a probe's view of where the time
    goes); nothing otherwise."""
    stamp(trace_ptr + pid * TRACE_PHASES + phase, TRACE)


@triton.jit
def _scatter_chunk(recv_ptr, tail_ptr, v, cols, hm, dsts, keeps, scales, offs_kl,
                   KL: tl.constexpr, H: tl.constexpr, SPLIT: tl.constexpr,
                   SCALED: tl.constexpr):
    """Stores one chunk ``v`` (columns ``cols``) of a received row at each of its
    local experts' recv rows ``dsts`` (where ``keeps``); all from registers, so
    the KL stores go out back to back."""
    for kk in range(0, KL):
        if _pick(keeps, offs_kl, kk) != 0:
            dst = _pick(dsts, offs_kl, kk)
            if SCALED:
                out = (v.to(tl.float32) * _pick(scales, offs_kl, kk)).to(
                    recv_ptr.dtype.element_ty)
            else:
                out = v
            _store_row(recv_ptr, tail_ptr, dst, cols, out, hm, H, SPLIT)


@triton.jit
def _push_chunk(ctx, x_ptr, slot_ptr, meta_ptr, rows, meta, mine, me, c, t_lo, t_hi, run,
                offs_w, wm, offs_m, mm, offs_h, T: tl.constexpr, W: tl.constexpr,
                H: tl.constexpr, META_WORDS: tl.constexpr, BLOCK_H: tl.constexpr,
                CT: tl.constexpr):
    """Pushes chunk c of the program's tokens ``[t_lo, t_hi)`` (CT tokens from
    ``t_lo + c * CT``), each row once per destination rank (slot ``slot[t, d]`` of
    d's inbox region ``me``), then its meta rows; then the chunk's end slot at
    every rank into that rank's header word ``mine + c + 1`` (its chunk bounds).
    Returns ``run`` [WP] raised to one past each destination's last slot used (a
    token's slots grow with its index, so a chunk of tokens is a range of slots at
    every rank)."""
    t0 = t_lo + c * CT
    for t in range(t0, tl.minimum(t0 + CT, t_hi)):
        slots = tl.load(slot_ptr + t * W + offs_w, mask=wm, other=-1)
        metas = tl.load(meta_ptr + (t * W + offs_w[:, None]) * META_WORDS + offs_m[None, :],
                        mask=mm, other=0)
        for c0 in range(0, H, BLOCK_H):
            hm = c0 + offs_h < H
            v = tl.load(x_ptr + t * H + c0 + offs_h, mask=hm)
            for step in range(0, W):
                d = (me + step) % W
                s = _pick(slots, offs_w, d)
                if s >= 0:
                    dst = rows + (me * T + s).to(tl.int64) * H + c0 + offs_h
                    tl.store(dl.symm_at(ctx, dst, d), v, mask=hm)
        for step in range(0, W):
            d = (me + step) % W
            s = _pick(slots, offs_w, d)
            if s >= 0:
                m = tl.sum(tl.where(offs_w[:, None] == d, metas, 0), axis=0)
                dst = meta + (me * T + s) * META_WORDS + offs_m
                tl.store(dl.symm_at(ctx, dst, d), m, mask=offs_m < META_WORDS)
        run = tl.maximum(run, slots + 1)
    for step in range(0, W):
        d = (me + step) % W
        tl.store(dl.symm_at(ctx, mine + c + 1, d), _pick(run, offs_w, d))
    return run


@triton.jit
def _wait_chunk(ctx, flags, c, me, e, pid, W: tl.constexpr, P: tl.constexpr,
                NCH: tl.constexpr):
    """Waits until every source's program pid has flagged its chunk c of call e
    (flags [W, P, NCH], both kernels'); returns the token
    of the last wait (for ``aligned_after``)."""
    token = me * 0  # int32, the type dl.wait's token has (loop-carried)
    for step in range(0, W):
        src = (me + step) % W
        token = dl.wait(ctx, flags + (src * P + pid) * NCH + c, e, "ge", src)
    return token


@triton.jit
def _nth_row(lens, los, offs_w, j):
    """Row j of the ranges of slots ``[los[q], los[q] + lens[q])`` taken one after
    another: (its range q, its slot); q = the range count past the last row."""
    ends = tl.cumsum(lens, axis=0)
    q = tl.sum((ends <= j).to(tl.int32), axis=0)
    return q, _pick(los - (ends - lens), offs_w, q) + j


@triton.jit
def _row_words(rows, meta, s, i, ok, offs_h, offs_kl, kl_m, T: tl.constexpr, H: tl.constexpr,
               META_WORDS: tl.constexpr, SCALED: tl.constexpr):
    """Inbox row (s, i)'s first chunk and its meta words (token, and per local
    expert its id, position and k, and the scale's bits), all loads issued at
    once; nothing is read where ``ok`` is false."""
    row = rows + tl.cast(s * T + i, tl.int64) * H
    v = tl.load(row + offs_h, mask=(offs_h < H) & ok)
    mrow = meta + (s * T + i) * META_WORDS
    t = tl.load(mrow, mask=ok, other=0)
    m = kl_m & ok
    experts = tl.load(mrow + 1 + 4 * offs_kl, mask=m, other=-1)
    poss = tl.load(mrow + 2 + 4 * offs_kl, mask=m, other=0)
    ks = tl.load(mrow + 3 + 4 * offs_kl, mask=m, other=0)
    scales = tl.zeros(offs_kl.shape, tl.int32)
    if SCALED:
        scales = tl.load(mrow + 4 + 4 * offs_kl, mask=m, other=0)
    return v, t, experts, poss, ks, scales


@triton.jit
def _lay_out_chunk(hdr, meta, rows, recv_ptr, tail_ptr, spos_ptr, stk_ptr, base, c, pid,
                   offs_w, offs_e, offs_h, offs_kl, kl_m, T: tl.constexpr, H: tl.constexpr,
                   K: tl.constexpr, KL: tl.constexpr, R: tl.constexpr, W: tl.constexpr,
                   P: tl.constexpr, NCH: tl.constexpr, HDR_WORDS: tl.constexpr,
                   E_LOC: tl.constexpr, META_WORDS: tl.constexpr, BLOCK_H: tl.constexpr,
                   SPLIT: tl.constexpr, SCALED: tl.constexpr):
    """Copies the rows of chunk c of every source's program pid (the slots between
    its header's bounds c and c + 1) from the inbox into recv at each of their local
    experts' rows, and records where they went (``spos``, ``stk``). ``base`` [WP,
    EP]: the first recv row of (source, local expert).

    The rows of all sources are one sequence (source-major), and the next row's
    first chunk and meta words are loaded before this row's copies: the copies
    wait for one memory latency in all, not one per row (at decode sizes a program
    lays out one row per source)."""
    wm = offs_w < W
    bounds = hdr + offs_w * HDR_WORDS + E_LOC + pid * (NCH + 1) + c
    los = tl.load(bounds, mask=wm, other=0)
    his = tl.load(bounds + 1, mask=wm, other=0)
    lens = tl.maximum(his - los, 0)
    n = tl.sum(lens, axis=0)
    s, i = _nth_row(lens, los, offs_w, 0)
    v, t, experts, poss, ks, scales = _row_words(rows, meta, s, i, n > 0, offs_h, offs_kl,
                                                 kl_m, T, H, META_WORDS, SCALED)
    for j in range(0, n):
        s_next, i_next = _nth_row(lens, los, offs_w, j + 1)
        nv, nt, nexperts, nposs, nks, nscales = _row_words(
            rows, meta, s_next, i_next, j + 1 < n, offs_h, offs_kl, kl_m, T, H, META_WORDS,
            SCALED)
        # recv row of each local expert: its first row plus the position.
        base_s = tl.sum(tl.where(offs_w[:, None] == s, base, 0), axis=0)
        dsts = tl.sum(tl.where(offs_e[None, :] == experts[:, None], base_s[None, :], 0),
                      axis=1) + poss
        keeps = ((experts >= 0) & (dsts < R)).to(tl.int32)
        out = (s * T + i) * KL + offs_kl
        tl.store(spos_ptr + out, tl.where(keeps != 0, dsts, -1), mask=kl_m)
        tl.store(stk_ptr + out, tl.where(experts >= 0, t * K + ks, -1), mask=kl_m)
        fscales = scales.to(tl.float32, bitcast=True)
        _scatter_chunk(recv_ptr, tail_ptr, v, offs_h, offs_h < H, dsts, keeps, fscales,
                       offs_kl, KL, H, SPLIT, SCALED)
        row = rows + tl.cast(s * T + i, tl.int64) * H
        for c0 in range(BLOCK_H, H, BLOCK_H):
            hm = c0 + offs_h < H
            vc = tl.load(row + c0 + offs_h, mask=hm)
            _scatter_chunk(recv_ptr, tail_ptr, vc, c0 + offs_h, hm, dsts, keeps, fscales,
                           offs_kl, KL, H, SPLIT, SCALED)
        s, i = s_next, i_next
        v, t, experts, poss, ks, scales = nv, nt, nexperts, nposs, nks, nscales


@triton.jit
def _zero_rows(recv_ptr, tail_ptr, first, i0, i1, offs_h, H: tl.constexpr, P: tl.constexpr,
               SPLIT: tl.constexpr, BLOCK_H: tl.constexpr, ZERO_TAIL: tl.constexpr):
    """With ZERO_TAIL, zeroes rows ``first + i * P`` of recv (and tail) for i in
    [i0, i1); nothing otherwise (unused rows left unwritten)."""
    if ZERO_TAIL:
        for r in range(first + i0 * P, first + i1 * P, P):
            for c in range(0, H, BLOCK_H):
                hm = c + offs_h < H
                _store_row(recv_ptr, tail_ptr, r, c + offs_h,
                           tl.zeros((BLOCK_H,), recv_ptr.dtype.element_ty), hm, H, SPLIT)


@triton.jit
def _routing_words(ctx, ids_ptr, factor_ptr, invalid_ptr, slot_ptr, meta_ptr, dcounts_ptr,
                   bounds_ptr, pid, offs_e, T: tl.constexpr, K: tl.constexpr,
                   E_LOC: tl.constexpr, KL: tl.constexpr, W: tl.constexpr, P: tl.constexpr,
                   TP: tl.constexpr, META_WORDS: tl.constexpr, WP: tl.constexpr,
                   KLP: tl.constexpr, ROUTE: tl.constexpr, ROUTE_OFF: tl.constexpr,
                   KP: tl.constexpr, EPG: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr):
    """Program pid's routing words: (slot, meta) pointers, the rows it sends per
    rank and local expert [WP, EP], its first slot and the slot total at each rank
    [WP]: with ROUTE computed here first (see the kernel), else the inputs'."""
    if ROUTE:
        slot_ptr = dl.heap_ptr(ctx, ROUTE_OFF, tl.int32)
        meta_ptr = dl.heap_ptr(ctx, ROUTE_OFF + 4 * T * W, tl.int32)
        dcounts_ptr = dl.heap_ptr(ctx, ROUTE_OFF + 4 * T * W * (1 + META_WORDS), tl.int32)
        bounds_ptr = dl.heap_ptr(ctx, ROUTE_OFF + 4 * (T * W * (1 + META_WORDS) + P * W * E_LOC),
                                 tl.int32)
        route_program(ids_ptr, factor_ptr, slot_ptr, meta_ptr, dcounts_ptr, bounds_ptr,
                      invalid_ptr, pid, T, K, W * E_LOC, E_LOC, KL, W, TP, KP, EPG, WP, KLP, BT,
                      BS)
        # The words each thread reads below were written by others of this program.
        tl.debug_barrier()
        dcounts_ptr += pid * (W * E_LOC)
    offs_w = tl.arange(0, WP)
    wm = offs_w < W
    # The header's words per destination, loaded first: their latency hides behind
    # the rows'.
    dcounts = tl.load(dcounts_ptr + offs_w[:, None] * E_LOC + offs_e[None, :],
                      mask=wm[:, None] & (offs_e < E_LOC)[None, :], other=0)
    if ROUTE:
        bounds = bounds_ptr + (pid * W + offs_w) * 3
        los = tl.load(bounds, mask=wm, other=0)
        totals = tl.load(bounds + 2, mask=wm, other=0)
    else:
        bounds = bounds_ptr + offs_w * (P + 1)
        los = tl.load(bounds + pid, mask=wm, other=0)
        totals = tl.load(bounds + P, mask=wm, other=0)
    return slot_ptr, meta_ptr, dcounts, los, totals


@triton.jit
def _push_header(ctx, hdr, dcounts, los, totals, me, pid, offs_w, offs_e, W: tl.constexpr,
                 P: tl.constexpr, NCH: tl.constexpr, E_LOC: tl.constexpr,
                 HDR_WORDS: tl.constexpr):
    """This rank's header in every rank's heap (before chunk 0's flag): counts per
    local expert, this program's first slot, the slot total (the same counts and
    total from every program: a receiver's program p reads only what program p of
    this rank wrote). Returns this program's chunk bounds (NCH + 1 words)."""
    h = hdr + me * HDR_WORDS
    mine = h + E_LOC + pid * (NCH + 1)
    for step in range(0, W):
        d = (me + step) % W
        cnt = tl.sum(tl.where(offs_w[:, None] == d, dcounts, 0), axis=0)
        tl.store(dl.symm_at(ctx, h + offs_e, d), cnt, mask=offs_e < E_LOC)
        tl.store(dl.symm_at(ctx, mine, d), _pick(los, offs_w, d))
        tl.store(dl.symm_at(ctx, h + E_LOC + P * (NCH + 1), d), _pick(totals, offs_w, d))
    return mine


@triton.jit
def _record_sources(hdr, sranges_ptr, spos_ptr, stk_ptr, pid, offs_w, offs_kl, T: tl.constexpr,
                    KL: tl.constexpr, W: tl.constexpr, P: tl.constexpr, NCH: tl.constexpr,
                    E_LOC: tl.constexpr, HDR_WORDS: tl.constexpr, KLP: tl.constexpr):
    """Every source's chunk bounds for this program (the combine sends by them),
    and "nothing here" in the records of the slots nobody used (outputs fully
    written)."""
    wm = offs_w < W
    kl_m = offs_kl < KL
    ranges = hdr + offs_w * HDR_WORDS + E_LOC
    for c in range(0, NCH + 1):
        tl.store(sranges_ptr + (offs_w * P + pid) * (NCH + 1) + c,
                 tl.load(ranges + pid * (NCH + 1) + c, mask=wm, other=0), mask=wm)
    used = tl.load(ranges + P * (NCH + 1), mask=wm, other=0)
    for s in range(0, W):
        for i in range(_pick(used, offs_w, s) + pid, T, P):
            none = tl.full((KLP,), -1, tl.int32)
            tl.store(spos_ptr + (s * T + i) * KL + offs_kl, none, mask=kl_m)
            tl.store(stk_ptr + (s * T + i) * KL + offs_kl, none, mask=kl_m)


@triton.jit
def moe_dispatch_kernel(ctx, x_ptr, slot_ptr, meta_ptr, dcounts_ptr, bounds_ptr, ids_ptr,
                        factor_ptr, recv_ptr, rcounts_ptr, spos_ptr, stk_ptr, sranges_ptr,
                        tail_ptr, trace_ptr, invalid_ptr,
                        T: tl.constexpr, H: tl.constexpr, K: tl.constexpr,
                        E_LOC: tl.constexpr, KL: tl.constexpr, R: tl.constexpr,
                        W: tl.constexpr, P: tl.constexpr, TP: tl.constexpr,
                        FLAGS_OFF: tl.constexpr, HDR_OFF: tl.constexpr,
                        META_OFF: tl.constexpr, ROWS_OFF: tl.constexpr,
                        PARITY_BYTES: tl.constexpr, HDR_WORDS: tl.constexpr,
                        META_WORDS: tl.constexpr, SCALED: tl.constexpr,
                        WP: tl.constexpr, EP: tl.constexpr, MP: tl.constexpr,
                        KLP: tl.constexpr, BLOCK_H: tl.constexpr, SPLIT: tl.constexpr = 0,
                        TRACE: tl.constexpr = False, ROUTE: tl.constexpr = False,
                        ROUTE_OFF: tl.constexpr = 0, KP: tl.constexpr = 1,
                        EPG: tl.constexpr = 1, BT: tl.constexpr = 1,
                        BS: tl.constexpr = 1, ZERO_TAIL: tl.constexpr = True,
                        CT: tl.constexpr = 1 << 30, NCH: tl.constexpr = 1):
    """Grid: (P,), at most one program per SM on GPUs (programs wait on peers').

    Inputs: x [T, H]; slot [T, W] int32 (slot of token t in rank d's inbox, -1:
    not sent); meta [T, W, META_WORDS] int32; dcounts [W, E_LOC] int32 (rows
    sent to rank d per local expert); bounds [W, P + 1] int32 (slots of d before
    program p's tokens); ids [T, K] int32 and factor [T, K] float32 (the
    copies' factors) are read only with ROUTE. Outputs: recv [R, H]; rcounts
    [W, E_LOC] int32 (rows received per source and local expert); spos / stk [W
    * T, KL] int32 (recv row and t * K + k of inbox row (s, i), local expert kk;
    -1: none or dropped); sranges [W, P, NCH + 1] int32 (slot bounds of each
    source's program's chunks: chunk c is slots [sranges[s, p, c], sranges[s, p,
    c + 1])).
    SPLIT > 0: recv is [R, SPLIT] and tail [R, H - SPLIT] holds the rest of each
    row (``_store_row``); else tail is unused. WP, EP, MP, KLP: W, E_LOC,
    META_WORDS and KL rounded up to powers of 2 (vector widths). TRACE: phase
    timestamps into trace (``_stamp``); else trace is unused.

    ROUTE (the fused routing, ``_routing_words``): each program computes its
    tokens' routing words first (``moe_route.route_program``) into its rows of a
    heap scratch at ROUTE_OFF (slot [T, W], meta [T, W, META_WORDS], dcounts [P, W
    * E_LOC], bounds [P, W, 3]) and reads them back behind a CTA barrier, instead
    of the inputs slot, meta, dcounts and bounds; invalid [1] gets the invalid
    pairs (program 0). KP, EPG: K and W * E_LOC rounded up to powers of 2; BT, BS:
    tokens per routing step.
    ZERO_TAIL: rows of recv (and tail) past the received ones are zeroed; else
    they are left unwritten. CT: tokens per chunk of a program (its pushes are
    flagged chunk by chunk), NCH = ceil(TP / CT) chunks (default: one).
    The body is the steps; each feature (ROUTE, SPLIT, SCALED, TRACE, ZERO_TAIL) sits
    in the constexpr-specialized helper of its step.
    """
    pid = tl.program_id(0)
    _stamp(trace_ptr, pid, 0, TRACE)
    me = dl.rank(ctx)
    e = dl.epoch(ctx)
    flags = dl.heap_ptr(ctx, FLAGS_OFF, tl.int32)
    hdr = dl.parity_ptr(ctx, HDR_OFF, PARITY_BYTES, tl.int32)
    meta = dl.parity_ptr(ctx, META_OFF, PARITY_BYTES, tl.int32)
    rows = dl.parity_ptr(ctx, ROWS_OFF, PARITY_BYTES, x_ptr.dtype.element_ty)
    offs_h = tl.arange(0, BLOCK_H)
    offs_m = tl.arange(0, MP)
    offs_e = tl.arange(0, EP)
    offs_kl = tl.arange(0, KLP)
    kl_m = offs_kl < KL
    slot_ptr, meta_ptr, dcounts, los, totals = _routing_words(
        ctx, ids_ptr, factor_ptr, invalid_ptr, slot_ptr, meta_ptr, dcounts_ptr, bounds_ptr, pid,
        offs_e, T, K, E_LOC, KL, W, P, TP, META_WORDS, WP, KLP, ROUTE, ROUTE_OFF, KP, EPG, BT, BS)

    # 1. Push this program's tokens, chunk by chunk (CT tokens each): each row once
    # per destination rank. The token's slots and meta rows are loaded as blocks up
    # front, beside the row: one memory latency for all of them, not one per
    # destination.
    offs_w = tl.arange(0, WP)
    wm = offs_w < W
    mm = wm[:, None] & (offs_m[None, :] < META_WORDS)
    t_lo = pid * TP
    t_hi = tl.minimum(t_lo + TP, T)
    mine = _push_header(ctx, hdr, dcounts, los, totals, me, pid, offs_w, offs_e, W, P, NCH,
                        E_LOC, HDR_WORDS)
    run = _push_chunk(ctx, x_ptr, slot_ptr, meta_ptr, rows, meta, mine, me, 0, t_lo, t_hi,
                      los, offs_w, wm, offs_m, mm, offs_h, T, W, H, META_WORDS, BLOCK_H, CT)
    _stamp(trace_ptr, pid, 1, TRACE)
    # Flags after every rank's stores, behind one fence: the relaxed flags go out
    # together (W releases went out one round trip to a peer apart).
    my_flags = flags + (me * P + pid) * NCH
    dl.notify_peers(ctx, my_flags, e, INCLUDE_SELF=True)  # rows, meta, header
    _stamp(trace_ptr, pid, 2, TRACE)

    # With chunks, chunk 1 goes out before the wait for chunk 0 (and below chunk
    # c + 1 before the wait for chunk c): a rank waits for the chunk its peers
    # flagged one push earlier, not for the one they are flagging now, so no
    # chunk's wait is a rendezvous of every rank.
    if NCH > 1:
        run = _push_chunk(ctx, x_ptr, slot_ptr, meta_ptr, rows, meta, mine, me, 1, t_lo,
                          t_hi, run, offs_w, wm, offs_m, mm, offs_h, T, W, H, META_WORDS,
                          BLOCK_H, CT)

    # 2. Receive: every source's program pid has pushed its chunk 0 and header.
    token = _wait_chunk(ctx, flags, 0, me, e, pid, W, P, NCH)
    _stamp(trace_ptr, pid, 3, TRACE)
    # Every load below goes through pointers that depend on the wait (aligned_after).
    ws = offs_w[:, None]
    js = offs_e[None, :]
    cnt = tl.load(aligned_after(hdr, token) + ws * HDR_WORDS + js,
                  mask=(ws < W) & (js < E_LOC), other=0)
    tot = tl.sum(cnt, axis=0)
    base = tl.cumsum(cnt, axis=0) - cnt + (tl.cumsum(tot, axis=0) - tot)[None, :]
    total = tl.sum(tot, axis=0)
    if pid == 0:
        tl.store(rcounts_ptr + ws * E_LOC + js, cnt, mask=(ws < W) & (js < E_LOC))
    # This program's share of the unused rows (ZERO_TAIL): rows first + i * P,
    # i < n, zeroed a piece per chunk (behind the next chunk's pushes).
    first = tl.minimum(total, R) + pid
    n = tl.maximum(R - first + P - 1, 0) // P

    # Chunk c - 1 is laid out while chunk c's remote stores drain, and the fence
    # before chunk c's flags finds them landed; then chunk c + 1 goes out before
    # the wait for chunk c. One chunk (NCH = 1, the low-latency default): no loop.
    for c in range(1, NCH):
        _lay_out_chunk(aligned_after(hdr, token), aligned_after(meta, token),
                       aligned_after(rows, token), recv_ptr, tail_ptr, spos_ptr, stk_ptr,
                       base, c - 1, pid, offs_w, offs_e, offs_h, offs_kl, kl_m, T, H,
                       K, KL, R, W, P, NCH, HDR_WORDS, E_LOC, META_WORDS, BLOCK_H, SPLIT,
                       SCALED)
        dl.notify_peers(ctx, my_flags + c, e, INCLUDE_SELF=True)
        _zero_rows(recv_ptr, tail_ptr, first, (c - 1) * n // NCH, c * n // NCH, offs_h, H, P,
                   SPLIT, BLOCK_H, ZERO_TAIL)
        if c + 1 < NCH:
            run = _push_chunk(ctx, x_ptr, slot_ptr, meta_ptr, rows, meta, mine, me, c + 1,
                              t_lo, t_hi, run, offs_w, wm, offs_m, mm, offs_h, T, W, H,
                              META_WORDS, BLOCK_H, CT)
        token = _wait_chunk(ctx, flags, c, me, e, pid, W, P, NCH)
    hdr = aligned_after(hdr, token)
    _lay_out_chunk(hdr, aligned_after(meta, token), aligned_after(rows, token), recv_ptr,
                   tail_ptr, spos_ptr, stk_ptr, base, NCH - 1, pid, offs_w, offs_e, offs_h,
                   offs_kl, kl_m, T, H, K, KL, R, W, P, NCH, HDR_WORDS, E_LOC, META_WORDS,
                   BLOCK_H, SPLIT, SCALED)
    _record_sources(hdr, sranges_ptr, spos_ptr, stk_ptr, pid, offs_w, offs_kl, T, KL, W, P, NCH,
                    E_LOC, HDR_WORDS, KLP)
    _stamp(trace_ptr, pid, 4, TRACE)
    _zero_rows(recv_ptr, tail_ptr, first, (NCH - 1) * n // NCH, n, offs_h, H, P, SPLIT, BLOCK_H,
               ZERO_TAIL)
    _stamp(trace_ptr, pid, 5, TRACE)


@triton.jit
def _pair_words(stk_ptr, spos_ptr, s, i, ok, offs_kl, T: tl.constexpr, KL: tl.constexpr):
    """Inbox row (s, i)'s pair words from the dispatch: per local expert, t * K + k
    and the recv row (-1: none or dropped); all -1 where ``ok`` is false."""
    m = (offs_kl < KL) & ok
    tks = tl.load(stk_ptr + (s * T + i) * KL + offs_kl, mask=m, other=-1)
    poss = tl.load(spos_ptr + (s * T + i) * KL + offs_kl, mask=m, other=-1)
    return tks, poss


@triton.jit
def _tagged_weights(ctx, weights, tks, e, src):
    """The weights of pairs ``tks`` (t * K + k; -1: none, weight 0) from source
    ``src``'s weight box words, once they carry call e's tag."""
    got = dl.wait_tagged(ctx, weights, tl.maximum(tks, 0), tks >= 0, e, src)
    return tl.where(tks >= 0, dl.unpack_tagged(got, tl.float32), 0.0)


@triton.jit
def _send_chunk(ctx, y_ptr, stk_ptr, spos_ptr, sranges_ptr, inbox, wbox, pid, c, me, e,
                T: tl.constexpr, F: tl.constexpr, K: tl.constexpr, KL: tl.constexpr,
                W: tl.constexpr, P: tl.constexpr, NCH: tl.constexpr, DOTS: tl.constexpr,
                SEND_ROWS: tl.constexpr, SEND_F: tl.constexpr, BLOCK_F: tl.constexpr,
                KLP: tl.constexpr, WP: tl.constexpr):
    """Sends the rows held for chunk c of every source's program pid (inbox slots
    ``[sranges[s, pid, c], sranges[s, pid, c + 1])`` of source s) back to their
    sources. The rows of all sources are one sequence, walked from this rank's own
    first row around (ranks start at different peers), and the next row's pair
    words are loaded before this row's sends: one memory latency per row, not two."""
    offs_f = tl.arange(0, SEND_F)
    offs_row = tl.arange(0, BLOCK_F)
    offs_kl = tl.arange(0, KLP)
    offs_w = tl.arange(0, WP)
    wm = offs_w < W
    bounds = sranges_ptr + (offs_w * P + pid) * (NCH + 1)
    los = tl.load(bounds + c, mask=wm, other=0)
    his = tl.load(bounds + c + 1, mask=wm, other=0)
    lens = tl.maximum(his - los, 0)
    n = tl.sum(lens, axis=0)
    first = tl.sum(tl.where(offs_w < me, lens, 0), axis=0)  # this rank's first row
    s, i = _nth_row(lens, los, offs_w, first % tl.maximum(n, 1))
    tks, poss = _pair_words(stk_ptr, spos_ptr, s, i, n > 0, offs_kl, T, KL)
    for j in range(0, n):
        s_next, i_next = _nth_row(lens, los, offs_w, (first + j + 1) % n)
        tks_next, poss_next = _pair_words(stk_ptr, spos_ptr, s_next, i_next, j + 1 < n,
                                          offs_kl, T, KL)
        src = y_ptr + poss[:, None].to(tl.int64) * F
        if DOTS:
            # A dropped row (pos -1) of a valid pair goes back as zeros.
            send = (tks >= 0)[:, None]
            dst = dl.symm_at(ctx, inbox + tks[:, None].to(tl.int64) * F, s)
            for c0 in range(0, F, SEND_F):
                cols = (c0 + offs_f)[None, :]
                fm = cols < F
                v = tl.load(src + cols, mask=send & fm & (poss >= 0)[:, None], other=0.0)
                tl.store(dst + cols, v, mask=send & fm)
        elif SEND_ROWS:
            # One row per (token, rank), as below, from the valid pairs' rows only,
            # SEND_ROWS of them loaded at once: a program has one token in hand, so
            # the rows in flight bound its bandwidth (one at a time, the sends of
            # 4096 tokens per rank on 2 x H200 read y at 1.5 TB/s).
            keep = ((tks >= 0) & (poss >= 0)).to(tl.int32)
            # A dropped pair's weight (even NaN) must not meet its zero row.
            wks = tl.where(keep != 0, _tagged_weights(ctx, wbox + s * T * K, tks, e, s), 0.0)
            t = tl.max(tks, axis=0) // K
            # The token's pairs here hold the first slots (in k order): held of them.
            held = tl.max(tl.where(tks >= 0, offs_kl + 1, 0), axis=0)
            dst = dl.symm_at(ctx, inbox + (me * T + t).to(tl.int64) * F, s)
            for c0 in range(0, F, BLOCK_F):
                cols = c0 + offs_row
                fm = cols < F
                part = tl.zeros((BLOCK_F,), tl.float32)
                for r0 in range(0, held, SEND_ROWS):
                    for u in tl.static_range(SEND_ROWS):
                        r = r0 + u
                        pos = tl.maximum(_pick(poss, offs_kl, r), 0)
                        v = tl.load(y_ptr + tl.cast(pos, tl.int64) * F + cols,
                                    mask=fm & (_pick(keep, offs_kl, r) != 0), other=0.0)
                        part += _pick(wks, offs_kl, r) * v.to(tl.float32)
                tl.store(dst + cols, part.to(y_ptr.dtype.element_ty), mask=fm)
        else:
            # One row per (token, rank): the pairs' rows weighed and summed here
            # (dropped rows count zero; a token whose rows all dropped gets zeros).
            keep = ((tks >= 0) & (poss >= 0))[:, None]
            wk = tl.where(keep, _tagged_weights(ctx, wbox + s * T * K, tks, e, s)[:, None], 0.0)
            t = tl.max(tks, axis=0) // K
            dst = dl.symm_at(ctx, inbox + (me * T + t).to(tl.int64) * F, s)
            for c0 in range(0, F, SEND_F):
                cols = c0 + offs_f
                fm = cols < F
                v = tl.load(src + cols[None, :], mask=keep & fm[None, :], other=0.0)
                part = tl.sum(wk * v.to(tl.float32), axis=0)
                tl.store(dst + cols, part.to(y_ptr.dtype.element_ty), mask=fm)
        s, i, tks, poss = s_next, i_next, tks_next, poss_next


@triton.jit
def _sum_tokens(rows, w_ptr, kmask_ptr, ids_ptr, g_ptr, out_ptr, dots_ptr, t0, t1, offs_k,
                offs_w, T: tl.constexpr, F: tl.constexpr, K: tl.constexpr,
                E_LOC: tl.constexpr, DOTS: tl.constexpr, SUM_F: tl.constexpr,
                KP: tl.constexpr):
    """out rows [t0, t1): each token's received rows (``rows``: the inbox, read
    after the wait) summed in float32; with DOTS the pairs' rows weighed here, and
    their dots with g."""
    km = offs_k < K
    offs_f = tl.arange(0, SUM_F)
    for t in range(t0, t1):
        valid = tl.load(kmask_ptr + t * K + offs_k, mask=km, other=0) != 0
        if DOTS:
            wk = tl.load(w_ptr + t * K + offs_k, mask=km, other=0.0).to(tl.float32)[:, None]
            wk = tl.where(valid[:, None], wk, 0.0)
            pair_rows = rows + (t * K + offs_k)[:, None].to(tl.int64) * F
            dot = tl.zeros((KP, SUM_F), tl.float32)
            for c in range(0, F, SUM_F):
                cols = c + offs_f
                fm = cols < F
                v = tl.load(pair_rows + cols[None, :], mask=valid[:, None] & fm[None, :],
                            other=0.0)
                v = v.to(tl.float32)
                acc = tl.sum(wk * v, axis=0)
                tl.store(out_ptr + t * F + cols, acc.to(out_ptr.dtype.element_ty), mask=fm)
                g = tl.load(g_ptr + t * F + cols, mask=fm, other=0.0)
                dot += v * g.to(tl.float32)[None, :]
            tl.store(dots_ptr + t * K + offs_k, tl.sum(dot, axis=1), mask=km)
        else:
            # The ranks token t went to: those of its valid pairs' experts.
            ranks = tl.load(ids_ptr + t * K + offs_k, mask=km, other=0) // E_LOC
            sent = tl.sum(((ranks[None, :] == offs_w[:, None]) & valid[None, :]).to(tl.int32),
                          axis=1) > 0
            rank_rows = rows + (offs_w * T + t)[:, None].to(tl.int64) * F
            for c in range(0, F, SUM_F):
                cols = c + offs_f
                fm = cols < F
                v = tl.load(rank_rows + cols[None, :], mask=sent[:, None] & fm[None, :],
                            other=0.0)
                acc = tl.sum(v.to(tl.float32), axis=0)
                tl.store(out_ptr + t * F + cols, acc.to(out_ptr.dtype.element_ty), mask=fm)


@triton.jit
def moe_combine_kernel(ctx, y_ptr, w_ptr, kmask_ptr, ids_ptr, g_ptr, spos_ptr, stk_ptr,
                       sranges_ptr, out_ptr, dots_ptr, trace_ptr, T: tl.constexpr,
                       F: tl.constexpr, K: tl.constexpr, KL: tl.constexpr, W: tl.constexpr,
                       P: tl.constexpr, TP: tl.constexpr, E_LOC: tl.constexpr,
                       FLAGS_OFF: tl.constexpr,
                       INBOX_OFF: tl.constexpr, WBOX_OFF: tl.constexpr,
                       PARITY_BYTES: tl.constexpr, DOTS: tl.constexpr, KP: tl.constexpr,
                       KLP: tl.constexpr, WP: tl.constexpr, BLOCK_F: tl.constexpr,
                       SEND_ROWS: tl.constexpr, TRACE: tl.constexpr = False,
                       CT: tl.constexpr = 1 << 30, NCH: tl.constexpr = 1):
    """Grid: (P,), the dispatch's P. y [R, F] (rows of this rank's experts);
    w [T, K] weights, kmask [T, K] int32 (1: a valid pair) and ids [T, K] (the
    routing) of this rank's tokens; spos / stk / sranges from the dispatch, whose
    chunks (NCH of CT tokens per program) the combine sends and sums by.
    out [T, F] = sum_k w[t, k] * y row of (t, k), float32 accumulation. KP, KLP,
    WP: K, KL and W rounded up to powers of 2.

    Without DOTS (the forward) the experts' rank reduces first: program p pushes
    its tokens' weights (0 for invalid pairs) into every rank's weight box
    (WBOX, [W, T, K] tagged float32 words); the experts' rank sums each
    received row's local pairs, w * y in float32, and sends one row per (token,
    rank) back, in y's type, to the source's inbox row ``me * T + t``; the source
    sums the rows of the ranks its token went to. A token's rows cross the link
    once per rank, as in the dispatch, not once per expert.
    With DOTS (the backward) each pair's row goes back on its own, to inbox row
    ``t * K + k``, and dots [T, K] float32 = <y row of (t, k), g[t]> (the
    weights' cotangent, g the output's) come out beside out.

    Every step moves a token's rows together, [KLP, KP or WP, BLOCK_F / that]
    blocks: their loads are in flight at once; except (SEND_ROWS, the forward)
    the experts' rank's weighing, which loads only the valid pairs' rows, BLOCK_F
    columns of one at a time (a token has about K / W pairs on a rank, and a
    [KLP, BLOCK_F / KLP] step of mostly masked rows took one load latency per
    BLOCK_F / KLP columns). TRACE: phase timestamps into trace (``_stamp``);
    else trace is unused.
    """
    pid = tl.program_id(0)
    _stamp(trace_ptr, pid, 0, TRACE)
    me = dl.rank(ctx)
    e = dl.epoch(ctx)
    flags = dl.heap_ptr(ctx, FLAGS_OFF, tl.int32)
    inbox = dl.parity_ptr(ctx, INBOX_OFF, PARITY_BYTES, y_ptr.dtype.element_ty)
    wbox = dl.parity_ptr(ctx, WBOX_OFF, PARITY_BYTES, tl.int64)
    SEND_F: tl.constexpr = max(BLOCK_F // KLP, 16)
    SUM_F: tl.constexpr = max(BLOCK_F // (KP if DOTS else WP), 16)
    offs_k = tl.arange(0, KP)
    km = offs_k < K
    t_lo = pid * TP
    t_hi = tl.minimum(t_lo + TP, T)

    # 0. Forward: this program's tokens' weights to every rank (their experts' ranks
    # weigh the rows before sending them back), as tagged words: no fence, no flag;
    # a reader waits for the words it needs.
    if not DOTS:
        for t in range(t_lo, t_hi):
            valid = tl.load(kmask_ptr + t * K + offs_k, mask=km, other=0) != 0
            wk = tl.where(valid, tl.load(w_ptr + t * K + offs_k, mask=km, other=0.0), 0.0)
            words = dl.pack_tagged(wk.to(tl.float32), e)
            for step in range(0, W):
                d = (me + step) % W
                tl.store(dl.symm_at(ctx, wbox + (me * T + t) * K + offs_k, d), words, mask=km)

    # 1. Chunk by chunk (the dispatch's chunks: NCH of CT tokens per program): send
    # the rows held for chunk c of source s's program pid back to s; sum chunk c -
    # 1's tokens, which every rank flagged a send earlier, while chunk c's remote
    # stores drain; then flag chunk c (the fence finds them landed). One chunk
    # (NCH = 1, the decode default): send, flag, wait, sum.
    offs_w = tl.arange(0, WP)
    for c in range(0, NCH):
        _send_chunk(ctx, y_ptr, stk_ptr, spos_ptr, sranges_ptr, inbox, wbox, pid, c, me, e,
                    T, F, K, KL, W, P, NCH, DOTS, SEND_ROWS, SEND_F, BLOCK_F, KLP, WP)
        if c > 0:
            token = _wait_chunk(ctx, flags, c - 1, me, e, pid, W, P, NCH)
            t0 = t_lo + (c - 1) * CT
            _sum_tokens(aligned_after(inbox, token), w_ptr, kmask_ptr, ids_ptr, g_ptr,
                        out_ptr, dots_ptr, t0, tl.minimum(t0 + CT, t_hi), offs_k, offs_w,
                        T, F, K, E_LOC, DOTS, SUM_F, KP)
        # Flags once every rank's rows of the chunk are in flight, behind one fence.
        dl.notify_peers(ctx, flags + (me * P + pid) * NCH + c, e,
                        INCLUDE_SELF=True)  # the rows first
    _stamp(trace_ptr, pid, 1, TRACE)

    # 2. The last chunk's tokens, once every rank's program pid has sent them.
    token = _wait_chunk(ctx, flags, NCH - 1, me, e, pid, W, P, NCH)
    _stamp(trace_ptr, pid, 2, TRACE)
    # Loads below depend on the wait, with the pointer's alignment kept (16-byte loads).
    t0 = t_lo + (NCH - 1) * CT
    _sum_tokens(aligned_after(inbox, token), w_ptr, kmask_ptr, ids_ptr, g_ptr, out_ptr,
                dots_ptr, t0, tl.minimum(t0 + CT, t_hi), offs_k, offs_w, T, F, K, E_LOC, DOTS,
                SUM_F, KP)
    _stamp(trace_ptr, pid, 3, TRACE)
