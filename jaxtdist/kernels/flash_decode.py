"""flash_decode: one query per sequence attending over a KV cache split across ranks
by position, in one launch.

Grid: ``(B * HKV * NSPLIT,)``; program ``pid`` owns (batch ``b``, KV head ``h``,
split ``s``: every NSPLIT-th step of BLOCK_N positions from step ``s`` on) with
``group = pid // NSPLIT = b * HKV + h``. It serves all
``GROUP = Hq / Hkv`` query heads of its KV head at once (grouped-query attention),
so every K and V row is read from memory once per call.

1. Split-KV: the program runs an online softmax (float32, base 2) over its steps
   of this rank's valid positions (global position ``me * S_SHARD + i`` is valid
   while it is below ``kv_len[b]``) and stores its partial ``(o, lse)``: ``o``
   its steps' normalized output, ``lse`` their log-sum-exp (-inf where it had
   no valid position, with ``o = 0``).
2. Local combine: the program then adds 1 to the group's arrival counter
   (acquire-release, GPU scope); the one that brings it to NSPLIT (the last of
   the group) sets it back to 0 for the next call (which starts after this
   kernel ends: no epoch arithmetic that could overflow) and merges the
   group's NSPLIT partials into this rank's partial.
3. Exchange: that program pushes its rank's partial (and the length it masked
   with) into every peer's inbox as tagged words (``dl.pack_tagged``: each
   32-bit value beside the epoch in one 8-byte store, through ``dl.symm_at``;
   no flag, no fence), waits until every word of every peer carries this
   call's epoch (``dl.wait_tagged``: three waits, the outputs, the
   log-sum-exps and the lengths of all peers, not three per peer: each wait
   is at least one L2 round trip and a barrier; with three per peer every GPU
   of 4 x H100 spent 6-8 us there, with three in all the last to start spends
   2.4), and merges the W ranks' partials as one [W, ...] block (its
   own from registers): every rank performs the same float32 operations on
   the same values, so every rank ends with the same bits. (On 4 x H100 flags
   behind a fence took 5 us per exchange, one release per peer 8 us.) A rank holding no valid position sends
   ``lse = -inf``, which weighs 0; a sequence with ``kv_len = 0`` gets zeros.
   A sequence whose length differs between ranks gets NaN on every rank (each
   rank compares its peers' lengths with its own). At world 1 there is nothing
   to exchange: the local merge is the output.

Workspace (byte offsets, see ``ops/flash_decode.DecodeWorkspace``):

- ``LOCAL_OFF``: B * HKV * NSPLIT partials ([GP, BLOCK_D] float32 ``o``: only the
  GROUP real query rows, not the dot's padded BLOCK_G), then ``LSE_OFF`` their
  [GP] float32 ``lse``; read only by this rank's kernel.
- ``COUNT_OFF``: B * HKV int32 arrival counters.
- ``INBOX_OFF``: two parities (``e % 2``) of PARITY_BYTES: W slots (one per source
  rank) of B * HKV partials ``o``, then their ``lse`` at ``INBOX_LSE``, then
  the sources' lengths at ``INBOX_LEN``, all int64 tagged words.

Reuse: rank s writes parity p of rank o's inbox at epochs e and e + 2. s's
kernel e + 2 starts after its kernel e + 1 ended, which waited for o's push of
epoch e + 1 (every group's last program waits for every peer); o pushes that in
its kernel e + 1, after its kernel e (the last reader of parity p) ended. So
parity alone keeps call e + 2's data off what call e reads, and a word tagged e
is call e's (the heap starts zeroed, epochs start at 1).
The local partials and counters are touched by this rank's kernels only, which
run one after another.

Deadlock: only the last program of a group waits, and only for the last
program of the same group on other ranks, which pushes before it waits. Under
the interpreter programs run in grid order, so each rank reaches group g after
finishing groups < g. On GPUs at most B * HKV programs wait at once, and blocks
are dispatched in grid order, so every group's programs run before a later
group's waiter can hold their SMs.
"""

import triton
import triton.language as tl

import jaxtdist.language as dl
from jaxtdist.kernels._tiles import aligned_after, dot_acc
from jaxtdist.kernels._trace import stamp


@triton.jit
def _merge(m, l, acc, lse, o):
    """Folds one partial (``o`` normalized, ``lse`` its log2-sum-exp, -inf when
    empty) into the running (max ``m``, weight ``l``, weighted sum ``acc``)."""
    m_new = tl.maximum(m, lse)
    # All -inf so far (empty partials only): keep every weight 0, no NaN.
    safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m - safe)
    w = tl.exp2(lse - safe)
    return m_new, l * alpha + w, acc * alpha[:, None] + o * w[:, None]


@triton.jit
def _merge_block(m, l, acc, lse, o):
    """Folds a block of partials (``o`` [S, G, D] normalized, ``lse`` [S, G]; -inf
    and 0 where empty or masked) into the running (``m``, ``l``, ``acc``) at once:
    one rescale per block, not one per partial."""
    m_new = tl.maximum(m, tl.max(lse, 0))
    safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m - safe)
    w = tl.exp2(lse - safe[None, :])
    return (m_new, l * alpha + tl.sum(w, 0),
            acc * alpha[:, None] + tl.sum(w[:, :, None] * o, 0))


@triton.jit
def _finish(m, l, acc):
    """(o, lse) of merged partials; o = 0 and lse = -inf where nothing was valid
    (l == 0). A NaN weight (NaN or inf in q or in a valid key) gives NaN o and
    lse, which every later merge carries to the output: not an empty partial."""
    has = l != 0
    l_safe = tl.where(has, l, 1.0)
    o = tl.where(has[:, None], acc / l_safe[:, None], 0.0)
    lse = tl.where(has, m + tl.log2(l_safe), float("-inf"))
    return o, lse


@triton.jit
def _split_kv(q_ptr, k_ptr, v_ptr, table_ptr, b, h, lo, hi, qk_scale,
              STRIDE: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr,
              GROUP: tl.constexpr, D: tl.constexpr, S_SHARD: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
              DOT_PRECISION: tl.constexpr, PAGE: tl.constexpr, NUM_PAGES: tl.constexpr):
    """Online softmax of the GROUP query heads of KV head ``h`` over the steps of
    BLOCK_N positions starting at lo, lo + STRIDE, ... below ``hi`` (positions at
    ``hi`` or past masked); returns (m, l, acc) in float32, base 2. With PAGE > 0
    the cache is paged: position i of sequence b is row i % PAGE of page
    ``table[b, i // PAGE]`` of k, v [NUM_PAGES, PAGE, HKV, D]."""
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < D
    q_rows = b * HQ + h * GROUP + g
    q = tl.load(q_ptr + q_rows[:, None] * D + d[None, :],
                mask=(g < GROUP)[:, None] & d_mask[None, :], other=0.0)
    m = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)
    for start in range(lo, hi, STRIDE):
        pos = start + tl.arange(0, BLOCK_N)
        p_mask = pos < hi
        # int64: B * S_SHARD * HKV * D passes 2^31 for large caches.
        if PAGE > 0:
            page = tl.load(table_ptr + b * (S_SHARD // PAGE) + pos // PAGE, mask=p_mask,
                           other=0)
            # Page ids are data: clamped, an id out of range reads a wrong page, never
            # memory outside the cache.
            page = tl.minimum(tl.maximum(page, 0), NUM_PAGES - 1)
            rows = ((page.to(tl.int64) * PAGE + pos % PAGE) * HKV + h) * D
        else:
            rows = ((b * S_SHARD + pos).to(tl.int64) * HKV + h) * D
        kv_mask = p_mask[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
        s = dot_acc(q, tl.trans(k), None, DOT_PRECISION)
        # Every step holds a valid position (start < hi): the row max is finite.
        s = tl.where(p_mask[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
        pv = dot_acc(p.to(v.dtype), v, None, DOT_PRECISION)
        acc = acc * alpha[:, None] + pv
        m = m_new
    return m, l, acc


@triton.jit
def flash_decode_kernel(ctx, q_ptr, k_ptr, v_ptr, len_ptr, table_ptr, out_ptr, trace_ptr,
                        QK_SCALE: tl.constexpr,
                        HQ: tl.constexpr, HKV: tl.constexpr, GROUP: tl.constexpr,
                        D: tl.constexpr, S_SHARD: tl.constexpr, GROUPS: tl.constexpr,
                        NSPLIT: tl.constexpr,
                        LOCAL_OFF: tl.constexpr, LSE_OFF: tl.constexpr,
                        COUNT_OFF: tl.constexpr, INBOX_OFF: tl.constexpr,
                        INBOX_LSE: tl.constexpr, INBOX_LEN: tl.constexpr,
                        PARITY_BYTES: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
                        DOT_PRECISION: tl.constexpr,
                        PAGE: tl.constexpr = 0, NUM_PAGES: tl.constexpr = 0,
                        TRACE: tl.constexpr = 0, GP: tl.constexpr = 16, WP: tl.constexpr = 1):
    """Grid: (GROUPS * NSPLIT,), GROUPS = B * HKV.

    q: [B, HQ, D]; k, v: [B, S_SHARD, HKV, D] (this rank's positions); len_ptr:
    [B] int32 global valid lengths (negative: 0); out: [B, HQ, D]. ``QK_SCALE`` is
    softmax's scale times log2(e). Paged (PAGE > 0): k, v [NUM_PAGES, PAGE, HKV,
    D], table [B, S_SHARD / PAGE] int32 the pages of this rank's positions
    (unused otherwise). TRACE (a probe's view): int32 [GROUPS * NSPLIT, 6] clock
    stamps per program at trace_ptr (``_trace.stamp``): start, split-KV done and
    arrived; for a group's last program also local merge done, pushes and flags
    issued, every peer's partial merged, output stored (0 for the others).
    GP: GROUP rounded up to a power of 2 (<= BLOCK_G); WP: the world size
    rounded up to a power of 2. DOT_PRECISION: the dots' precision for float32
    caches (``_tiles.dot_acc``; the op follows JAX's matmul precision: TF32
    with operands rounded to nearest by default, as XLA's decode on GPUs).
    """
    pid = tl.program_id(0)
    at = trace_ptr + pid * 6
    stamp(at, TRACE)
    group = pid // NSPLIT
    split = pid % NSPLIT
    b = group // HKV
    h = group % HKV
    me = dl.rank(ctx)
    world = dl.num_ranks(ctx)
    e = dl.epoch(ctx)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    tile = g[:, None] * BLOCK_D + d[None, :]
    # Only the GROUP real query rows of the padded tile move through memory.
    real = g < GROUP
    real_tile = real[:, None] & (d < BLOCK_D)[None, :]

    # 1. Every NSPLIT-th step of this rank's valid positions, from step ``split``
    # on. Interleaved, the group's programs sweep the cache side by side: a cache
    # filled to a third keeps every program busy (contiguous chunks of the capacity
    # left two thirds of them idle), and the rows in flight at any moment are
    # one window of the cache (faster on one H200 than contiguous chunks of the
    # valid positions).
    # A negative length is 0 (none valid): the op passes int32 lengths unclamped.
    length = tl.maximum(tl.load(len_ptr + b), 0)
    valid = tl.minimum(tl.maximum(length - me * S_SHARD, 0), S_SHARD)
    m, l, acc = _split_kv(q_ptr, k_ptr, v_ptr, table_ptr, b, h, split * BLOCK_N, valid,
                          QK_SCALE, NSPLIT * BLOCK_N, HQ, HKV, GROUP, D, S_SHARD, BLOCK_N,
                          BLOCK_G, BLOCK_D, DOT_PRECISION, PAGE, NUM_PAGES)
    o, lse = _finish(m, l, acc)
    local_o = dl.heap_ptr(ctx, LOCAL_OFF, tl.float32)
    local_lse = dl.heap_ptr(ctx, LSE_OFF, tl.float32)
    # evict_last: the group's merger reads them back from L2 while other programs
    # still stream K and V through it (faster on one H200).
    tl.store(local_o + pid * (GP * BLOCK_D) + tile, o, mask=real_tile,
             eviction_policy="evict_last")
    tl.store(local_lse + pid * GP + g, lse, mask=real, eviction_policy="evict_last")

    # 2. The group's last program merges the group's partials.
    counter = dl.heap_ptr(ctx, COUNT_OFF, tl.int32) + group
    tl.debug_barrier()  # every thread's stores come before the release
    arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
    stamp(at + 1, TRACE)
    if TRACE:  # 0: not the group's merger (the merger's stamps overwrite these)
        tl.store(at + 2 + tl.arange(0, 4), tl.zeros((4,), tl.int32))
    if arrived == NSPLIT - 1:
        # Every program of the group has arrived: none touches the counter again
        # in this kernel, and the next kernel starts after this one ends.
        tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")
        tl.debug_barrier()  # the acquiring thread's view extends to the program
        # From here on only the GROUP real query rows (GP, a power of 2 >= GROUP):
        # the peers' merge holds a block of partials, and BLOCK_G rows would not fit.
        gp = tl.arange(0, GP)
        tile_p = gp[:, None] * BLOCK_D + d[None, :]
        real_p = gp < GROUP
        real_tile_p = real_p[:, None] & (d < BLOCK_D)[None, :]
        m_p = tl.full((GP,), float("-inf"), tl.float32)
        l_p = tl.zeros((GP,), tl.float32)
        acc_p = tl.zeros((GP, BLOCK_D), tl.float32)
        # Unrolled (NSPLIT is small, see FlashDecodeConfig): the loads do not
        # depend on each other, so they are issued ahead instead of one L2
        # round trip per split; each fold is elementwise, in registers (a block of
        # partials folded at once, reduced across threads, took 4.0 us against
        # 2.8 at 16 splits on 4 x H100).
        group_o = aligned_after(local_o, arrived) + group * NSPLIT * (GP * BLOCK_D)
        group_lse = aligned_after(local_lse, arrived) + group * NSPLIT * GP
        for s in tl.static_range(NSPLIT):
            # .cg: written by other programs (L2), never stale L1 lines.
            part_o = tl.load(group_o + s * (GP * BLOCK_D) + tile_p, mask=real_tile_p,
                             other=0.0, cache_modifier=".cg")
            part_lse = tl.load(group_lse + s * GP + gp, mask=real_p, other=float("-inf"),
                               cache_modifier=".cg")
            m_p, l_p, acc_p = _merge(m_p, l_p, acc_p, part_lse, part_o)
        o_p, lse_p = _finish(m_p, l_p, acc_p)
        stamp(at + 2, TRACE)

        agree = length == length  # a scalar of the type the exchange's test has
        # World 1 (the kernel forced on one GPU): the local merge is the output
        # (a merge of one partial returns it unchanged, bit for bit).
        if world > 1:
            # 3. Push this rank's partial to every peer as tagged words.
            inbox_o = dl.parity_ptr(ctx, INBOX_OFF, PARITY_BYTES, tl.int64)
            inbox_lse = dl.parity_ptr(ctx, INBOX_OFF + INBOX_LSE, PARITY_BYTES, tl.int64)
            inbox_len = dl.parity_ptr(ctx, INBOX_OFF + INBOX_LEN, PARITY_BYTES, tl.int64)
            my_o = inbox_o + (me * GROUPS + group) * (GP * BLOCK_D) + tile_p
            my_lse = inbox_lse + (me * GROUPS + group) * GP + gp
            my_len = inbox_len + me * GROUPS + group
            o_words = dl.pack_tagged(o_p, e)
            lse_words = dl.pack_tagged(lse_p, e)
            len_words = dl.pack_tagged(length, e)
            for step in range(1, world):
                dst = (me + step) % world
                tl.store(dl.symm_at(ctx, my_o, dst), o_words, mask=real_tile_p)
                tl.store(dl.symm_at(ctx, my_lse, dst), lse_words, mask=real_p)
                tl.store(dl.symm_at(ctx, my_len, dst), len_words)
            stamp(at + 3, TRACE)

            # Every peer's words at once (three waits, not three per peer), then one
            # merge of the W partials: the same operations on the same values on
            # every rank (this rank's own partial from registers, as the peers
            # received it), so every rank ends with the same bits.
            src = tl.arange(0, WP)
            peer = (src != me) & (src < world)
            slot = src * GROUPS + group
            # Parity e % 2 holds only this call's words or an earlier call's (epoch
            # e - 2 or less): equal tags are this call's. Three waits in a row, not
            # one loop polling all three blocks: there the outputs' test is a
            # block-wide reduction (shared memory, barriers) while the small lse and
            # length blocks, replicated in every warp, are tested per warp, so warps
            # left the loop at different polls and the barriers paired up wrongly
            # (4 x H100: wrong groups in up to 5 of 24 calls). Alone, each small
            # block's loop has no barrier: a warp leaves once its own copies carry
            # the tag.
            got_o = dl.unpack_tagged(dl.wait_tagged(
                ctx, inbox_o, slot[:, None, None] * (GP * BLOCK_D) + tile_p[None],
                peer[:, None, None] & real_tile_p[None], e), tl.float32)
            got_lse = dl.unpack_tagged(dl.wait_tagged(
                ctx, inbox_lse, slot[:, None] * GP + gp[None, :],
                peer[:, None] & real_p[None, :], e), tl.float32)
            seen = dl.unpack_tagged(dl.wait_tagged(ctx, inbox_len, slot, peer, e), tl.int32)
            # kv_len must agree: every rank merged with this rank's length.
            agree = tl.min(tl.where(peer, seen == length, True).to(tl.int32), 0) != 0
            mine = (src == me)
            all_o = tl.where(mine[:, None, None], tl.where(real_tile_p, o_p, 0.0)[None],
                             tl.where(peer[:, None, None] & real_tile_p[None], got_o, 0.0))
            all_lse = tl.where(mine[:, None], tl.where(real_p, lse_p, float("-inf"))[None, :],
                               tl.where(peer[:, None] & real_p[None, :], got_lse, float("-inf")))
            m_p = tl.full((GP,), float("-inf"), tl.float32)
            l_p = tl.zeros((GP,), tl.float32)
            acc_p = tl.zeros((GP, BLOCK_D), tl.float32)
            m_p, l_p, acc_p = _merge_block(m_p, l_p, acc_p, all_lse, all_o)
            o_p, lse_p = _finish(m_p, l_p, acc_p)
            stamp(at + 4, TRACE)
        else:
            stamp(at + 3, TRACE)
            stamp(at + 4, TRACE)
        # kv_len must be the same on every rank: where it is not, the ranks masked
        # different positions and their merge is no attention at all, so the
        # sequence's output is NaN rather than a wrong number.
        o_p = tl.where(agree, o_p, float("nan"))
        out_rows = b * HQ + h * GROUP + gp
        tl.store(out_ptr + out_rows[:, None] * D + d[None, :], o_p.to(out_ptr.dtype.element_ty),
                 mask=real_p[:, None] & (d < D)[None, :])
        stamp(at + 5, TRACE)
