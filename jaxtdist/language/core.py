"""Device-side primitives of jaxtdist: Triton ``@jit`` helpers.

Every primitive takes ``ctx``, the kernel context the runtime hands to each
kernel as its first argument (rank, world size, epoch, peers' heap bases).
Pointers into the symmetric heap are translated to a peer's copy with
``symm_at``: ``peer_ptr = ptr - heap_base[me] + heap_base[peer]``, so peer
loads, stores and atomics are plain Triton code in both process layouts and
under Triton's interpreter. The few primitives that need target-specific
code (fences between memory proxies, data dependences the compiler must not
break, the loop-free bounded spin) come from ``_lowering``, the one place a
backend's lowering goes.
"""

import triton
import triton.language as tl

from jaxtdist.language import _layout as L
from jaxtdist.language._lowering import (consume_token, fence_async_proxy, fence_system,
                                         now_ns, poll_pause, spin_acquire_ge,
                                         wait_tma_stores)

_CTX_RANK = tl.constexpr(L.CTX_RANK)
_CTX_WORLD = tl.constexpr(L.CTX_WORLD)
_CTX_EPOCH = tl.constexpr(L.CTX_EPOCH)
_CTX_WAIT_TIMEOUT_NS = tl.constexpr(L.CTX_WAIT_TIMEOUT_NS)
_CTX_ERR_ADDR = tl.constexpr(L.CTX_ERR_ADDR)
_CTX_HEAP_BASE = tl.constexpr(L.CTX_HEAP_BASE)
_CTX_SCRATCH_ADDR = tl.constexpr(L.CTX_SCRATCH_ADDR)
_CTX_PEER_BASES = tl.constexpr(L.CTX_PEER_BASES)
_ERR_RANK = tl.constexpr(L.ERR_RANK)
_ERR_PEER = tl.constexpr(L.ERR_PEER)
_ERR_SIGNAL_OFFSET = tl.constexpr(L.ERR_SIGNAL_OFFSET)
_ERR_EXPECTED = tl.constexpr(L.ERR_EXPECTED)
_ERR_SEEN = tl.constexpr(L.ERR_SEEN)
_ERR_CMP = tl.constexpr(L.ERR_CMP)
_ERR_TIMEOUT_NS = tl.constexpr(L.ERR_TIMEOUT_NS)

@triton.jit
def _words(ctx):
    # XLA hands the context over as int32 words; read it as int64.
    return ctx.to(tl.pointer_type(tl.int64), bitcast=True)


@triton.jit
def rank(ctx):
    """This rank's index within the collective's group."""
    return tl.load(_words(ctx) + _CTX_RANK).to(tl.int32)


@triton.jit
def num_ranks(ctx):
    """Number of ranks in the collective's group."""
    return tl.load(_words(ctx) + _CTX_WORLD).to(tl.int32)


@triton.jit
def epoch(ctx):
    """This call's epoch: 1 for the op's first call on the device, then 2, 3, ..."""
    return tl.load(_words(ctx) + _CTX_EPOCH).to(tl.int32)


@triton.jit
def _round16(delta):
    # Says that an address difference is a multiple of 16 bytes (it is: heap
    # bases are 256-byte aligned and XLA buffers 16-byte aligned), so that
    # accesses through the pointers built from it vectorize.
    return (delta >> 4) << 4


@triton.jit
def heap_base(ctx, peer):
    """Address (int64) of ``peer``'s symmetric heap as this rank sees it."""
    return tl.load(_words(ctx) + _CTX_PEER_BASES + peer)


@triton.jit
def heap_ptr(ctx, offset, dtype: tl.constexpr):
    """Pointer to byte ``offset`` of this rank's symmetric heap, typed ``dtype``."""
    base = tl.load(_words(ctx) + _CTX_HEAP_BASE)
    # Built from the (aligned) ctx pointer rather than from an integer, so
    # the compiler keeps track of alignment.
    anchor = ctx.to(tl.pointer_type(tl.int8), bitcast=True)
    delta = _round16(base - ctx.to(tl.int64, bitcast=True))
    return (anchor + delta + offset).to(tl.pointer_type(dtype), bitcast=True)


@triton.jit
def parity_ptr(ctx, offset, parity_bytes, dtype: tl.constexpr):
    """Pointer to byte ``offset`` of this call's parity (``epoch % 2``) of a
    double-buffered heap region whose parities are ``parity_bytes`` apart,
    typed ``dtype``. The parity's offset is 64-bit: regions pass 2 GiB."""
    return heap_ptr(ctx, offset + (epoch(ctx) % 2).to(tl.int64) * parity_bytes, dtype)


@triton.jit
def symm_at(ctx, ptr, peer):
    """Translates ``ptr`` (into this rank's heap) to the same place in ``peer``'s heap.

    Works on scalar pointers and on blocks of pointers.
    """
    me = rank(ctx)
    shift = _round16(heap_base(ctx, peer) - heap_base(ctx, me))
    moved = ptr.to(tl.pointer_type(tl.int8), bitcast=True) + shift
    return moved.to(ptr.dtype, bitcast=True)


@triton.jit
def load_peer(ctx, ptr, peer, mask=None, other=None):
    """Loads a tile from ``peer``'s copy of the heap location ``ptr``."""
    return tl.load(symm_at(ctx, ptr, peer), mask=mask, other=other)


@triton.jit
def store_peer(ctx, ptr, value, peer, mask=None):
    """Stores a tile into ``peer``'s copy of the heap location ``ptr``."""
    tl.store(symm_at(ctx, ptr, peer), value, mask=mask)


@triton.jit
def put(ctx, dst, src, n, peer, BLOCK: tl.constexpr):
    """Copies ``n`` elements from local ``src`` to ``peer``'s copy of heap ``dst``.

    Run by one program; ``BLOCK`` elements per step.
    """
    remote = symm_at(ctx, dst, peer)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(remote + offs, tl.load(src + offs, mask=mask), mask=mask)


@triton.jit
def get(ctx, dst, src, n, peer, BLOCK: tl.constexpr):
    """Copies ``n`` elements from ``peer``'s copy of heap ``src`` to local ``dst``."""
    remote = symm_at(ctx, src, peer)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(dst + offs, tl.load(remote + offs, mask=mask), mask=mask)


@triton.jit
def notify(ctx, signal, peer, value, OP: tl.constexpr = tl.constexpr("set"),
           SCOPE: tl.constexpr = tl.constexpr("sys"), SEM: tl.constexpr = tl.constexpr("release")):
    """Sets (``OP="set"``) or adds to (``OP="add"``) ``peer``'s copy of ``signal``.

    Release semantics at ``SCOPE`` ("sys" by default; "gpu" suffices for a
    signal that only this GPU reads): every store this program made before
    the notify is visible to whoever acquires the signal. ``SEM="relaxed"``:
    no ordering of its own, for a signal right after a ``fence`` (which then
    publishes the stores before it); see ``notify_peers``.
    """
    remote = symm_at(ctx, signal, peer)
    if SEM == "release":
        # Every thread's earlier stores happen before the one thread's release
        # (relaxed: the fence before it has its own barrier).
        tl.debug_barrier()
    if OP == "add":
        tl.atomic_add(remote, value, sem=SEM, scope=SCOPE)
    else:
        tl.atomic_xchg(remote, value, sem=SEM, scope=SCOPE)


@triton.jit
def notify_peers(ctx, signal, value, OP: tl.constexpr = tl.constexpr("set"),
                 SCOPE: tl.constexpr = tl.constexpr("sys"),
                 INCLUDE_SELF: tl.constexpr = tl.constexpr(False)):
    """``notify`` of every other rank's copy of ``signal`` (me + 1 first; this
    rank's own copy first with ``INCLUDE_SELF``), with one system-scope fence for
    all of them: every store this program made before is visible to whoever
    acquires any of the signals.

    Why not W - 1 notifies: each release waits until everything before it,
    the previous signal's round trip to its peer included, has completed, so
    the signals went out one NVLink round trip apart (about 8 us for 3 peers on
    H100); after one fence the relaxed signals are in flight together.
    """
    me = rank(ctx)
    world = num_ranks(ctx)
    fence(ctx)
    for step in range(0 if INCLUDE_SELF else 1, world):
        notify(ctx, signal, (me + step) % world, value, OP, SCOPE, "relaxed")


@triton.jit
def pack_tagged(value, tag):
    """int64 words holding ``value``'s 32 bits (float32 or int32) low and ``tag``
    (int32) high: a message that needs no flag and no fence. An aligned 8-byte
    store is single-copy atomic, so a reader (``wait_tagged``) that sees a
    word's tag sees its value; each call's tag (its epoch) tells its words
    from an earlier call's."""
    bits = value.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
    return bits | (tl.cast(tag, tl.int64) << 32)


@triton.jit
def unpack_tagged(words, dtype: tl.constexpr):
    """The values of ``pack_tagged`` words, as ``dtype`` (float32 or int32)."""
    return words.to(tl.int32).to(dtype, bitcast=True)


@triton.jit
def wait_tagged(ctx, base, offs, mask, tag, peer=-1):
    """Re-reads the int64 words ``base + offs`` (a block; where ``mask``) until
    every one carries ``tag`` (``pack_tagged``); returns them. Bounded like ``wait`` (the
    error names ``base``'s word). The low-latency exchange: the sender's
    stores of tagged words are the whole protocol, one NVLink crossing."""
    limit, failed_flag, failed = _wait_state(ctx)
    start = now_ns()
    got = tl.load(base + offs, mask=mask, other=0, volatile=True)
    ok = tl.min(tl.where(mask, (got >> 32).to(tl.int32) == tag, True).to(tl.int32)) != 0
    done = ok | failed
    while not done:
        poll_pause()
        got = tl.load(base + offs, mask=mask, other=0, volatile=True)
        ok = tl.min(tl.where(mask, (got >> 32).to(tl.int32) == tag, True).to(tl.int32)) != 0
        failed = tl.load(failed_flag, volatile=True) != 0
        done = ok | failed | (now_ns() - start >= limit)
    if not (ok | failed):
        seen = (tl.load(base, volatile=True) >> 32).to(tl.int32)
        _record_timeout(ctx, failed_flag, base, tag, seen, peer, "eq")
    tl.debug_barrier()
    return got


@triton.jit
def _satisfied(seen, value, CMP: tl.constexpr):
    if CMP == "eq":
        ok = seen == value
    elif CMP == "ne":
        ok = seen != value
    elif CMP == "gt":
        ok = seen > value
    elif CMP == "le":
        ok = seen <= value
    elif CMP == "lt":
        ok = seen < value
    else:
        ok = seen >= value
    return ok


@triton.jit
def _cmp_code(CMP: tl.constexpr):
    if CMP == "eq":
        code = 0
    elif CMP == "ne":
        code = 1
    elif CMP == "gt":
        code = 3
    elif CMP == "le":
        code = 4
    elif CMP == "lt":
        code = 5
    else:
        code = 2
    return code


@triton.jit
def wait(ctx, signal, value, CMP: tl.constexpr = tl.constexpr("ge"), peer=-1,
         SCOPE: tl.constexpr = tl.constexpr("sys")):
    """Spins until ``*signal CMP value`` holds, with acquire semantics.

    ``signal`` is a pointer (usually into this rank's heap; pass a
    ``symm_at`` pointer to watch a peer's). ``peer`` only names the rank that
    is expected to notify, for the error report. The wait is bounded in time
    (``initialize(mesh, wait_timeout_s=...)``): past the bound it records rank,
    peer, signal offset, expected and seen values and the bound in the error
    record and returns; the host raises an error naming them. Once any wait of
    this rank has timed out (or the host has marked the rank failed), waits
    return at once instead of piling up timeouts.

    Returns the value last seen, a token for ``consume_token``.
    """
    limit, failed_flag, failed = _wait_state(ctx)
    start = now_ns()
    seen = tl.atomic_add(signal, 0, sem="acquire", scope=SCOPE)
    done = _satisfied(seen, value, CMP) | failed
    while not done:
        poll_pause()
        seen = tl.atomic_add(signal, 0, sem="acquire", scope=SCOPE)
        failed = tl.load(failed_flag, volatile=True) != 0
        done = _satisfied(seen, value, CMP) | failed | (now_ns() - start >= limit)
    if not (_satisfied(seen, value, CMP) | failed):
        _record_timeout(ctx, failed_flag, signal, value, seen, peer, CMP)
    # The acquiring thread's view extends to the whole program.
    tl.debug_barrier()
    return seen


@triton.jit
def _wait_state(ctx):
    """(timeout in ns, pointer to the "some wait timed out" word, its value != 0).

    That word lives in device memory (the heap's scratch word): the error
    record itself is host memory on GPUs, far too slow to poll.
    """
    words = _words(ctx)
    limit = tl.load(words + _CTX_WAIT_TIMEOUT_NS)
    failed_flag = tl.load(words + _CTX_SCRATCH_ADDR).to(tl.pointer_type(tl.int32))
    failed = tl.load(failed_flag, volatile=True) != 0
    return limit, failed_flag, failed


@triton.jit
def _record_timeout(ctx, failed_flag, signal, value, seen, peer, CMP: tl.constexpr):
    """A wait gave up: marks this rank's waits failed and fills the error record
    (rank, peer, signal offset, expected and seen values) that the host reports."""
    words = _words(ctx)
    err = tl.load(words + _CTX_ERR_ADDR).to(tl.pointer_type(tl.int64))
    tl.atomic_xchg(failed_flag, 1, sem="relaxed", scope="gpu")
    me = rank(ctx)
    # The signal usually sits in this rank's heap; a symm_at pointer sits
    # in the notifying peer's. Report the offset within whichever holds it.
    address = signal.to(tl.int64, bitcast=True)
    offset = address - heap_base(ctx, me)
    if peer >= 0:
        in_peer = address - heap_base(ctx, peer)
        offset = tl.where((offset < 0) | (offset >= (1 << 40)), in_peer, offset)
    tl.store(err + _ERR_RANK, me.to(tl.int64))
    tl.store(err + _ERR_PEER, tl.cast(peer, tl.int64))
    tl.store(err + _ERR_SIGNAL_OFFSET, offset)
    tl.store(err + _ERR_EXPECTED, tl.cast(value, tl.int64))
    tl.store(err + _ERR_SEEN, seen.to(tl.int64))
    tl.store(err + _ERR_CMP, tl.cast(_cmp_code(CMP), tl.int64))
    tl.store(err + _ERR_TIMEOUT_NS, tl.load(words + _CTX_WAIT_TIMEOUT_NS))
    tl.atomic_xchg(err, 1, sem="release", scope="sys")


@triton.jit
def fence(ctx):
    """Orders this program's earlier memory operations before its later ones, system-wide.

    A CTA barrier (so every thread's accesses count), then a system-scope
    acquire-release fence (``fence.acq_rel.sys`` on NVIDIA; an acquire-release
    read-modify-write of this rank's scratch word where that is the fence).
    """
    tl.debug_barrier()
    scratch = tl.load(_words(ctx) + _CTX_SCRATCH_ADDR).to(tl.pointer_type(tl.int32))
    fence_system(scratch)
    tl.debug_barrier()


@triton.jit
def barrier_all(ctx, signals):
    """Barrier among all ranks of the group, run by one program per rank.

    ``signals`` points at ``num_ranks`` int32 words of symmetric heap
    reserved for this barrier; they are compared against the epoch, so the
    barrier may run once per call.
    """
    me = rank(ctx)
    world = num_ranks(ctx)
    e = epoch(ctx)
    for peer in range(0, world):
        notify(ctx, signals + me, peer, e)
    for peer in range(0, world):
        wait(ctx, signals + peer, e, "ge", peer)


@triton.jit
def wait_for_tma(ctx, signal, value, peer=-1, SCOPE: tl.constexpr = tl.constexpr("gpu")):
    """``wait(ctx, signal, value, "ge", peer, SCOPE)``, then ``fence_async_proxy()``;
    returns 0, a token to add to the TMA coordinates that read what the wait
    guards (so that no load is scheduled above the wait).

    On NVIDIA GPUs the spin is one inline-asm op, with no loop in Triton's IR:
    a tile loop that waits this way can still be flattened
    (``tl.range(..., flatten=True)``), which pipelines the next tile's loads
    under this tile's epilogue. Every thread acquires for itself. Bounded like
    ``wait``: a timeout fills the same error record.

    Example (a persistent TMA GEMM, tile ``t`` ready once ``flags[t] >= e``)::

        for t in tl.range(pid, tiles, programs, flatten=True):
            row0 = t * BLOCK_M + dl.wait_for_tma(ctx, flags + t, e)
            acc = tl.dot(a_desc.load([row0, 0]), ...)
    """
    limit, failed_flag, failed = _wait_state(ctx)
    # After any timeout of this rank, one read and no spinning (as ``wait``).
    limit = tl.where(failed, 0, limit)
    seen, token = spin_acquire_ge(signal, value, limit, SCOPE)
    if not ((seen >= value) | failed):
        _record_timeout(ctx, failed_flag, signal, value, seen, peer, "ge")
    return token
