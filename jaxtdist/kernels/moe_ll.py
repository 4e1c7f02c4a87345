"""moe_ll: the low-latency (decode) MoE dispatch and combine, expert-major padded layout.

Experts are split evenly over the W ranks (rank d owns global experts
``[d * E_LOC, (d + 1) * E_LOC)``). Every (token, expert) copy has a fixed slot
in its expert's rank's inbox: row ``source * M + i`` of local expert ``le``'s
block ``[E_LOC, W * M, H]``, where i counts the source's earlier tokens routed
to the same expert (M = max tokens per rank >= T). The sender knows every slot
from its own routing: no layout exchange, no remote atomics, nothing zeroed.
The receiver's copy out of the inbox (which any XLA output needs) packs each
expert's rows at the front of its block of ``recv [E_LOC, W * M, H]``, source
by source: the experts' masked GEMM then reads one prefix of rows per expert.

Work split (both kernels' programs): program p owns the global experts
``g = p, p + P, p + 2P, ...``, on the sending side and on the receiving side
(its local experts among them), so every wait targets program p of a peer
(or of this rank, done earlier in the same program): the grid completes in
any order, and under the interpreter (one program at a time per rank) too.

Dispatch (``moe_ll_dispatch_kernel``), program p:

1. Send: for each owned expert g (destination d = g // E_LOC), the tokens
   routed to g in token order, BT at a time: a token's slot is the running
   count of its earlier hits (a prefix count over this rank's own ids); its
   row goes to d's inbox row ``(g % E_LOC, me * M + slot)``, its ``t * K + k``
   (the first k naming g) beside it. FP8: the row is quantized on the way
   (1 x 128 blocks, e4m3, scale = amax / 448; a zero block gets scale 1 /
   448): bytes and scales go out, never the 16-bit row.
2. Signal: one fence over all of the program's stores, then per owned expert
   one tagged int64 word ``(epoch << 32) | count`` into d's count box
   ``[le, me]``. The count travels in the signal: per (source, expert), so a
   receiver needs no header and no second read, and each expert's block is
   usable as soon as its own words are in (a per-expert consumer could start
   there).
3. Receive: for each local expert le this program owns, wait until the W
   words ``[le, 0..W)`` carry this call's epoch (then a fence: the acquire
   half), and copy the counted rows (and their t * K + k) from the inbox
   into the outputs, packed: source s's rows after the counts of the sources
   before it. Rows past an expert's total are never written.

Combine is two launches, because a token's rows come back from experts that
different programs own, and a program may wait only on its own id of other
ranks:

- ``moe_ll_combine_send_kernel`` (no waits): every counted row of
  y [E_LOC, W * M, F] (recv's packed rows) goes back to its source's inbox
  row ``t * K + k`` (unweighed, y's dtype).
- ``moe_ll_combine_kernel`` (after the send kernel on this rank): program p
  raises its flag ``[me, p]`` in every rank's heap (one fence: this rank's
  sends, a whole kernel earlier, are visible first), waits for flag ``[s,
  p]`` of every rank s, and sums its tokens' valid pairs, weighed, in float32.

Reuse: inboxes, count boxes and tk boxes are double-buffered by call parity.
A source writes a peer's parity ``e % 2`` in calls e and e + 2; in call e + 1
it waited (dispatch: some program of it waited for the peer's count words of
e + 1; combine: for the peer's flags of e + 1), which the peer raises in its
kernel e + 1, after its kernel e, the last reader, ended. Count words compare
equal to the epoch (a later call's words are in the other parity); flags
compare ">=" and only grow: nothing is reset.

Workspace layout (byte offsets, ``ops/moe/_ll_launch``): dispatch, per parity:
count box [E_LOC, W] int64, tk box [E_LOC, W * M] int32, rows [E_LOC, W * M,
H] (x's dtype; FP8: uint8) and scales [E_LOC, W * M, S] float32 (FP8 only).
Combine: flags [W, P] int32, then per parity an inbox [T * K, F] (y's dtype).
"""

import triton
import triton.language as tl

import jaxtdist.language as dl
from jaxtdist.kernels._tiles import aligned_after

# e4m3's largest finite value: a block's amax maps to it.
FP8_MAX = tl.constexpr(448.0)
# Columns per FP8 scale (1 x 128 blocks, as DeepSeek-V3's activations).
FP8_BLOCK = tl.constexpr(128)


@triton.jit
def _pick(vec, idx, j):
    """vec[j] for a runtime scalar j (``idx`` the block's arange)."""
    return tl.sum(tl.where(idx == j, vec, 0), axis=0)


@triton.jit
def _copy_row(src, dst, N: tl.constexpr, BLOCK: tl.constexpr):
    """dst[0:N] = src[0:N], BLOCK elements per step (dst may be a peer's)."""
    offs = tl.arange(0, BLOCK)
    for c0 in range(0, N, BLOCK):
        m = c0 + offs < N
        tl.store(dst + c0 + offs, tl.load(src + c0 + offs, mask=m), mask=m)


@triton.jit
def _quantize_row(src, dst, dst_scale, H: tl.constexpr, S: tl.constexpr, SP: tl.constexpr,
                  QP: tl.constexpr):
    """Row src[0:H] as e4m3 bytes into dst[0:H] (uint8) and its S block scales into
    dst_scale[0:S] (float32): block j is columns [128 j, 128 j + 128), scale =
    amax / 448, so that x ~ byte value * scale. The whole row is one [SP, QP]
    block (SP: S rounded up to a power of 2; QP: a block's vector width), so that
    its loads and stores go out vectorized and together, not 128 columns a step."""
    j = tl.arange(0, SP)[:, None]
    c = tl.arange(0, QP)[None, :]
    cols = j * FP8_BLOCK + c
    m = (j < S) & (c < FP8_BLOCK) & (cols < H)
    v = tl.load(src + cols, mask=m, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(v), axis=1)
    scale = tl.where(amax > 0, amax, 1.0) / FP8_MAX
    # Clamped: amax / scale may round a hair past 448.
    q = tl.clamp(v / scale[:, None], -FP8_MAX, FP8_MAX).to(tl.float8e4nv)
    tl.store(dst + cols, q.to(tl.uint8, bitcast=True), mask=m)
    tl.store(dst_scale + tl.arange(0, SP), scale, mask=tl.arange(0, SP) < S)


@triton.jit
def _hits(ids_ptr, t0, g, offs_t, offs_k, T: tl.constexpr, K: tl.constexpr):
    """Tokens [t0, t0 + BT) routed to expert g: (hit [BT] int32, k [BT]: the first
    k naming g; a repeat of g in a token is not a second copy)."""
    rows = t0 + offs_t
    ids = tl.load(ids_ptr + rows[:, None] * K + offs_k[None, :],
                  mask=(rows < T)[:, None] & (offs_k < K)[None, :], other=-1)
    match = ids == g
    hit = tl.max(match.to(tl.int32), axis=1)
    first_k = tl.min(tl.where(match, offs_k[None, :], K), axis=1)
    return hit, first_k


@triton.jit
def _send_expert(ctx, x_ptr, ids_ptr, rows, scales, tks, g, me, offs_t, offs_k,
                 T: tl.constexpr, H: tl.constexpr, K: tl.constexpr, E_LOC: tl.constexpr,
                 W: tl.constexpr, M: tl.constexpr, S: tl.constexpr, BT: tl.constexpr,
                 BLOCK_H: tl.constexpr, SP: tl.constexpr, QP: tl.constexpr,
                 FP8: tl.constexpr):
    """Sends this rank's copies for global expert g into its rank's inbox, slot
    ``(g % E_LOC, me * M + i)`` for the i-th token naming g; returns the count."""
    d = g // E_LOC
    first = (g % E_LOC) * (W * M) + me * M  # this source's first slot of the expert
    count = me * 0
    for t0 in range(0, T, BT):
        hit, first_k = _hits(ids_ptr, t0, g, offs_t, offs_k, T, K)
        before = tl.cumsum(hit, axis=0) - hit  # the hits before each token in the block
        for j in range(0, tl.sum(hit, axis=0)):
            here = (hit != 0) & (before == j)
            t = t0 + tl.min(tl.where(here, offs_t, BT), axis=0)
            k = tl.min(tl.where(here, first_k, K), axis=0)
            slot = tl.cast(first + count + j, tl.int64)
            src = x_ptr + tl.cast(t, tl.int64) * H
            if FP8:
                _quantize_row(src, dl.symm_at(ctx, rows + slot * H, d),
                              dl.symm_at(ctx, scales + slot * S, d), H, S, SP, QP)
            else:
                _copy_row(src, dl.symm_at(ctx, rows + slot * H, d), H, BLOCK_H)
            tl.store(dl.symm_at(ctx, tks + slot, d), t * K + k)
        count += tl.sum(hit, axis=0)
    return count


@triton.jit
def moe_ll_dispatch_kernel(ctx, x_ptr, ids_ptr, recv_ptr, rscale_ptr, rcounts_ptr, rtk_ptr,
                           T: tl.constexpr, H: tl.constexpr, K: tl.constexpr,
                           E_LOC: tl.constexpr, W: tl.constexpr, M: tl.constexpr,
                           P: tl.constexpr, CNT_OFF: tl.constexpr, TK_OFF: tl.constexpr,
                           ROWS_OFF: tl.constexpr, SCALES_OFF: tl.constexpr,
                           PARITY_BYTES: tl.constexpr, KP: tl.constexpr, WP: tl.constexpr,
                           BT: tl.constexpr, BLOCK_H: tl.constexpr, FP8: tl.constexpr,
                           S: tl.constexpr, QP: tl.constexpr, SP: tl.constexpr,
                           EPPP: tl.constexpr):
    """Grid: (P,), at most one program per SM on GPUs (programs wait on peers').

    x [T, H] (16-bit or float32), ids [T, K] int32 (ids outside [0, E) are
    never sent; a repeated id is sent once, for its first k) -> recv [E_LOC, W *
    M, H] (x's dtype; FP8: uint8 e4m3 bytes), rscale [E_LOC, W * M, S] float32
    (FP8; else a placeholder never written), rcounts [E_LOC, W] int32, rtk
    [E_LOC, W * M] int32 (``t * K + k`` at the source). Expert le's rows are
    packed: source s's at ``sum(rcounts[le, :s]) + i``; rows past
    ``sum(rcounts[le])`` are not written. KP, WP: K and W
    rounded up to powers of 2; BT: tokens per step of the prefix count; QP: an
    FP8 block's vector width; SP, EPPP: S and ceil(E / P) rounded up to powers of
    2. See the module docstring.
    """
    pid = tl.program_id(0)
    me = dl.rank(ctx)
    e = dl.epoch(ctx)
    E: tl.constexpr = E_LOC * W
    cnt = dl.parity_ptr(ctx, CNT_OFF, PARITY_BYTES, tl.int64)
    tks = dl.parity_ptr(ctx, TK_OFF, PARITY_BYTES, tl.int32)
    rows = dl.parity_ptr(ctx, ROWS_OFF, PARITY_BYTES, recv_ptr.dtype.element_ty)
    scales = dl.parity_ptr(ctx, SCALES_OFF, PARITY_BYTES, tl.float32)
    offs_t = tl.arange(0, BT)
    offs_k = tl.arange(0, KP)
    offs_w = tl.arange(0, WP)
    wm = offs_w < W

    # 1. Send every copy for this program's experts, each expert's tokens in order.
    # 2. Then one fence, and the counts as the signals (tagged words, no flag).
    # The counts wait in registers meanwhile: EPP = ceil(E / P) experts per program.
    EPP: tl.constexpr = (E + P - 1) // P
    offs_j = tl.arange(0, EPPP)
    sent = tl.zeros((EPPP,), tl.int32)
    for j in range(0, EPP):
        g = pid + j * P
        if g < E:
            n = _send_expert(ctx, x_ptr, ids_ptr, rows, scales, tks, g, me, offs_t, offs_k, T,
                             H, K, E_LOC, W, M, S, BT, BLOCK_H, SP, QP, FP8)
            sent = tl.where(offs_j == j, n, sent)
    dl.fence(ctx)
    for j in range(0, EPP):
        g = pid + j * P
        if g < E:
            word = dl.pack_tagged(_pick(sent, offs_j, j), e)
            tl.store(dl.symm_at(ctx, cnt + (g % E_LOC) * W + me, g // E_LOC), word)

    # 3. Receive this program's local experts: le with (me * E_LOC + le) % P == pid.
    le0 = ((pid - me * E_LOC) % P + P) % P
    for le in range(le0, E_LOC, P):
        words = dl.wait_tagged(ctx, cnt + le * W, offs_w, wm, e)
        dl.fence(ctx)  # the acquire half: rows stored before the peers' fences
        counts = tl.where(wm, dl.unpack_tagged(words, tl.int32), 0)
        tl.store(rcounts_ptr + le * W + offs_w, counts, mask=wm)
        token = tl.max(words, axis=0)
        src_rows = aligned_after(rows, token)
        src_tks = aligned_after(tks, token)
        src_scales = aligned_after(scales, token)
        # Packed per expert, source-major: source s's rows from the sum of the
        # counts before it (the copy is where they are packed: no pass of its own).
        before = tl.cumsum(counts, axis=0) - counts
        for s in range(0, W):
            src_base = tl.cast(le * (W * M) + s * M, tl.int64)
            dst_base = tl.cast(le * (W * M) + _pick(before, offs_w, s), tl.int64)
            for i in range(0, _pick(counts, offs_w, s)):
                r = src_base + i
                q = dst_base + i
                _copy_row(src_rows + r * H, recv_ptr + q * H, H, BLOCK_H)
                if FP8:
                    _copy_row(src_scales + r * S, rscale_ptr + q * S, S, SP)
                tl.store(rtk_ptr + q, tl.load(src_tks + r))


@triton.jit
def moe_ll_combine_send_kernel(ctx, y_ptr, rcounts_ptr, rtk_ptr, done_ptr, T: tl.constexpr,
                               F: tl.constexpr, K: tl.constexpr, E_LOC: tl.constexpr,
                               W: tl.constexpr, M: tl.constexpr, P: tl.constexpr,
                               INBOX_OFF: tl.constexpr, PARITY_BYTES: tl.constexpr,
                               WP: tl.constexpr, BLOCK_F: tl.constexpr):
    """Grid: (P,). y [E_LOC, W * M, F] (rows packed as the dispatch's recv), its
    rcounts [E_LOC, W] and rtk [E_LOC, W * M] -> every counted row of y into its
    source's inbox row ``t * K + k`` (this call's parity). done [1] int32: 0, for
    ordering the next launch.
    No waits: program p sends the (le, s) blocks p, p + P, ...; a tk outside
    [0, T * K) (not the dispatch's handle) is not sent."""
    pid = tl.program_id(0)
    inbox = dl.parity_ptr(ctx, INBOX_OFF, PARITY_BYTES, y_ptr.dtype.element_ty)
    offs_w = tl.arange(0, WP)
    for item in range(pid, E_LOC * W, P):
        le = item // W
        s = item % W
        # Source s's rows of expert le follow the other sources' before it (packed).
        counts = tl.load(rcounts_ptr + le * W + offs_w, mask=offs_w < W, other=0)
        counts = tl.minimum(tl.maximum(counts, 0), M)
        base = tl.cast(le * (W * M) + tl.sum(tl.where(offs_w < s, counts, 0), axis=0), tl.int64)
        for i in range(0, _pick(counts, offs_w, s)):
            tk = tl.load(rtk_ptr + base + i)
            if (tk >= 0) & (tk < T * K):
                dst = dl.symm_at(ctx, inbox + tk.to(tl.int64) * F, s)
                _copy_row(y_ptr + (base + i) * F, dst, F, BLOCK_F)
    # Performed before the kernel ends (the next kernel's flags announce them).
    dl.fence(ctx)
    if pid == 0:
        tl.store(done_ptr, 0)


@triton.jit
def moe_ll_combine_kernel(ctx, w_ptr, kmask_ptr, out_ptr, T: tl.constexpr, F: tl.constexpr,
                          K: tl.constexpr, P: tl.constexpr, TP: tl.constexpr,
                          FLAGS_OFF: tl.constexpr, INBOX_OFF: tl.constexpr,
                          PARITY_BYTES: tl.constexpr, KP: tl.constexpr,
                          BLOCK_F: tl.constexpr):
    """Grid: (P,), launched after ``moe_ll_combine_send_kernel`` on this rank.
    w [T, K] weights, kmask [T, K] int32 (1: a valid pair) -> out [T, F], out[t] =
    sum over valid k of w[t, k] * inbox row t * K + k, in float32, rounded once
    to out's dtype. Program p owns tokens [p * TP, (p + 1) * TP)."""
    pid = tl.program_id(0)
    me = dl.rank(ctx)
    W = dl.num_ranks(ctx)
    e = dl.epoch(ctx)
    flags = dl.heap_ptr(ctx, FLAGS_OFF, tl.int32)
    inbox = dl.parity_ptr(ctx, INBOX_OFF, PARITY_BYTES, out_ptr.dtype.element_ty)
    # This rank's sends ended with the previous kernel: one fence, then the flags.
    dl.notify_peers(ctx, flags + me * P + pid, e, INCLUDE_SELF=True)
    token = me * 0
    for step in range(0, W):
        src = (me + step) % W
        token = dl.wait(ctx, flags + src * P + pid, e, "ge", src)
    rows = aligned_after(inbox, token)
    offs_k = tl.arange(0, KP)
    km = offs_k < K
    offs_f = tl.arange(0, BLOCK_F)
    for t in range(pid * TP, tl.minimum(pid * TP + TP, T)):
        valid = tl.load(kmask_ptr + t * K + offs_k, mask=km, other=0) != 0
        wk = tl.where(valid, tl.load(w_ptr + t * K + offs_k, mask=km, other=0.0), 0.0)
        wk = wk.to(tl.float32)[:, None]
        pair_rows = rows + (t * K + offs_k)[:, None].to(tl.int64) * F
        for c0 in range(0, F, BLOCK_F):
            cols = c0 + offs_f
            fm = cols < F
            v = tl.load(pair_rows + cols[None, :], mask=valid[:, None] & fm[None, :], other=0.0)
            acc = tl.sum(wk * v.to(tl.float32), axis=0)
            tl.store(out_ptr + t * F + cols, acc.to(out_ptr.dtype.element_ty), mask=fm)
