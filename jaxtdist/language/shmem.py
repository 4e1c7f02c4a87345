"""NVSHMEM-style device calls for kernels on the NVSHMEM heap (one process per GPU).

``jaxtdist.language``'s put/notify/wait reach peers by load and store through
translated pointers, which needs every peer's heap mapped (NVLink, one node).
These calls go through NVSHMEM instead, whose transports also reach other
nodes (InfiniBand): a kernel written with them runs unchanged across nodes.

- ``putmem_nbi_block(ctx, dest, source, nbytes, pe)``: copies ``nbytes`` from
  local ``source`` to ``dest`` (a symmetric heap address) on ``pe``; returns
  before completion (``quiet``, or a signal, says when it landed).
- ``putmem_signal_nbi_block(ctx, dest, source, nbytes, sig_addr, signal, pe,
  SIG_OP)``: the same, then sets (``SIG_OP="set"``) or adds to ``pe``'s int64
  ``sig_addr`` once the data is there.
- ``signal_op(ctx, sig_addr, signal, pe, SIG_OP)``: sets or adds to ``pe``'s int64 signal.
- ``signal_wait_until(ctx, sig_addr, CMP, value)``: waits until this PE's int64
  signal compares ``CMP`` ("ge", "eq", ...) to ``value``. Bounded like every
  jaxtdist wait (``wait_timeout_s``): a timeout fills the error record.
- ``fence(ctx)``, ``quiet(ctx)``: order, or complete, this PE's earlier puts.
- ``barrier_all(ctx, signals)``: every PE meets (one program per PE calls it;
  ``signals``: ``num_ranks`` int32 heap words, used by the CPU lowering).
- ``my_pe(ctx)``, ``n_pes(ctx)``.

Every call is made by all threads of one program (block-wide, as NVSHMEM's
``_block`` functions). PEs are NVSHMEM's: the processes of the mesh in
process order. On a one-axis mesh over all processes (``jax.make_mesh((n,),
("x",))`` with one GPU per process) a collective's rank is the PE.

Lowerings: NVIDIA (``_shmem_nvidia``: NVSHMEM's device library, linked when
jaxtdist compiles the kernel; the runtime must be on the NVSHMEM heap) and
Triton's interpreter (``_shmem_portable``: jaxtdist's own put/notify/wait).
AMD (ROCSHMEM) is not written yet.

Example (a put-based all_gather; tests/kernels_for_tests.py has the full kernel):
  >>> import jaxtdist.language as dl
  >>> from jaxtdist.language import shmem
  >>> @triton.jit
  ... def k(ctx, x_ptr, out_ptr, N: tl.constexpr, WS: tl.constexpr):
  ...     me, e = dl.rank(ctx), dl.epoch(ctx)
  ...     sig = dl.heap_ptr(ctx, WS, tl.int64)
  ...     for pe in range(0, dl.num_ranks(ctx)):
  ...         shmem.putmem_signal_nbi_block(ctx, dl.heap_ptr(ctx, WS + 1024 + me * N * 4,
  ...             tl.float32), x_ptr, N * 4, sig + me, e, pe)
"""

import triton
import triton.language as tl

from jaxtdist.language import _lowering
from jaxtdist.language import core

if _lowering.TARGET == "interpret":
    from jaxtdist.language._shmem_portable import (barrier_all, fence, my_pe, n_pes,
                                                   putmem_nbi_block, putmem_signal_nbi_block,
                                                   quiet, signal_op)
elif _lowering.TARGET == "cuda":
    from jaxtdist.language._shmem_nvidia import (barrier_all, fence, my_pe, n_pes,
                                                 putmem_nbi_block, putmem_signal_nbi_block,
                                                 quiet, signal_op)
else:
    def _unavailable(*args, **kwargs):
        raise NotImplementedError("jaxtdist.language.shmem has no AMD (ROCSHMEM) lowering yet")

    barrier_all = fence = my_pe = n_pes = putmem_nbi_block = _unavailable
    putmem_signal_nbi_block = quiet = signal_op = _unavailable


@triton.jit
def signal_wait_until(ctx, sig_addr, CMP: tl.constexpr, value):
    """Waits until this PE's int64 signal ``*sig_addr CMP value`` (bounded; see module)."""
    return core.wait(ctx, sig_addr.to(tl.pointer_type(tl.int64)), tl.cast(value, tl.int64), CMP)


__all__ = ["barrier_all", "fence", "my_pe", "n_pes", "putmem_nbi_block",
           "putmem_signal_nbi_block", "quiet", "signal_op", "signal_wait_until"]
