"""``jaxtdist.language.shmem`` built from jaxtdist's own primitives: the lowering
under Triton's interpreter (CPU), where programs run one at a time and every
store is visible at once. PEs are the group's ranks; signals are int64 words
of the symmetric heap, as in NVSHMEM.
"""

import triton
import triton.language as tl

from jaxtdist.language import core

_COPY_BLOCK = tl.constexpr(1024)


@triton.jit
def putmem_nbi_block(ctx, dest, source, nbytes, pe):
    core.put(ctx, dest.to(tl.pointer_type(tl.int8)), source.to(tl.pointer_type(tl.int8)),
             nbytes, pe, _COPY_BLOCK)


@triton.jit
def signal_op(ctx, sig_addr, signal, pe, SIG_OP: tl.constexpr = tl.constexpr("set")):
    core.notify(ctx, sig_addr.to(tl.pointer_type(tl.int64)), pe, tl.cast(signal, tl.int64),
                SIG_OP)


@triton.jit
def putmem_signal_nbi_block(ctx, dest, source, nbytes, sig_addr, signal, pe,
                            SIG_OP: tl.constexpr = tl.constexpr("set")):
    putmem_nbi_block(ctx, dest, source, nbytes, pe)
    signal_op(ctx, sig_addr, signal, pe, SIG_OP)


@triton.jit
def fence(ctx):
    core.fence(ctx)


@triton.jit
def quiet(ctx):
    core.fence(ctx)


@triton.jit
def barrier_all(ctx, signals):
    core.barrier_all(ctx, signals)


@triton.jit
def my_pe(ctx):
    return core.rank(ctx)


@triton.jit
def n_pes(ctx):
    return core.num_ranks(ctx)
