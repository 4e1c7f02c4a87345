"""CPU heap: host shared memory, one interpreter worker process per rank.

Triton's interpreter keeps one global grid index and runs a kernel's
programs one at a time, so ranks cannot share a process: each mesh position
gets a worker process that maps the same shared-memory segment and runs the
kernels for that position. Peer loads, stores and atomics go straight to the
shared segment, exactly as on GPUs they go over NVLink.

A mesh that spans processes (``jax.distributed`` on one host, the CPU
emulation of one process per GPU) uses one segment too: the mesh's first
process creates it and publishes its name through JAX's key-value store,
every process maps it and starts workers for its own positions only, and the
creator unlinks the name once every process has mapped it (so no segment
outlives the job, however it ends). Each process computes peers' bases in its
own mapping.
"""

from __future__ import annotations

import ctypes
import os
import socket
from collections.abc import Sequence
from multiprocessing import shared_memory

import numpy as np

from jaxtdist._errors import HeapExhaustedError, JaxtdistError, WaitTimeoutError
from jaxtdist.interpret import WorkerPool
from jaxtdist.language import _layout as L
from jaxtdist.runtime._backend import BackendSpec


# Heap offset of the word a process sets in each of its positions' heaps when it
# closes the heap cleanly (a peer that exits after that did not die). Inside the
# reserved head of the heap, after the error record (0) and the scratch word (64).
_CLOSED_OFFSET = 128


def _new_segment(size: int, heap_bytes: int) -> shared_memory.SharedMemory:
    """The heap's shared-memory segment of ``size`` bytes, or ``HeapExhaustedError``
    saying what was asked and what the host has. Pages are allocated on first
    touch, so a segment larger than the free shared memory is allowed; one
    larger than the host's memory can never be backed and is refused."""
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    fix = ("lower heap_bytes in jaxtdist.initialize (the default is 32 MiB per device on "
           "CPU)")
    if size > ram:
        raise HeapExhaustedError(
            f"jaxtdist: the CPU heap needs {size} bytes of shared memory (heap_bytes="
            f"{heap_bytes} per device) but this host has {ram} bytes of memory; {fix}")
    try:
        return shared_memory.SharedMemory(create=True, size=size)
    except (OSError, OverflowError, ValueError) as e:
        raise HeapExhaustedError(
            f"jaxtdist: the CPU heap's {size} bytes of shared memory (heap_bytes={heap_bytes} "
            f"per device) could not be created ({type(e).__name__}: {e}); {fix}, or make "
            "room in /dev/shm") from None


class CpuHeap:
    """Symmetric heap of ``positions`` ranks in one shared-memory segment.

    Args:
      positions: mesh positions (the whole mesh).
      heap_bytes: bytes of heap per position.
      owners: the process index owning each position, when the mesh spans
        processes (``None``: this process owns them all).
      bootstrap: the key-value exchange with the other processes (needed with
        ``owners``).

    Example:
      >>> heap = CpuHeap(8, 32 << 20)       # one process, 8 positions
      >>> heap.base_of(3) - heap.base_of(0)
      100663296
    """

    platform = "cpu"
    has_copy_engines = False
    locates_by_device = False

    def __init__(self, positions: int, heap_bytes: int, owners: Sequence[int] | None = None,
                 bootstrap=None):
        self.heap_bytes = heap_bytes
        self._watch = None
        self._shm = None
        self._segment = None
        self._anchor = None
        self._unlinked = False
        self.workers = None
        me = bootstrap.process_index if bootstrap is not None else None
        if owners is None:
            self._positions = tuple(range(positions))
            self._shm = _new_segment(positions * heap_bytes, heap_bytes)
            self._view = self._shm.buf
        else:
            self._positions = tuple(p for p in range(positions) if owners[p] == me)
            self._view = self._map_shared(positions * heap_bytes, min(owners), bootstrap)
        self._anchor = ctypes.c_char.from_buffer(self._view)
        self.segment_base = ctypes.addressof(self._anchor)
        try:
            self.workers = WorkerPool(self._positions, self._segment_name, self.segment_base,
                                      on_failure=self._release_waits)
            if owners is not None:
                self._join(owners, bootstrap)
        except BaseException:
            self.close()
            raise

    # -- one heap over several processes -----------------------------------------

    def _map_shared(self, size: int, creator: int, bootstrap) -> memoryview:
        """Creates (the creator) or maps (the others) the segment; its name travels
        through the key-value store with the creator's host name."""
        host = socket.gethostname()
        if bootstrap.process_index == creator:
            self._shm = _new_segment(size, self.heap_bytes)
            bootstrap.publish("segment", f"{self._shm.name} {size} {host}")
            return self._shm.buf
        name, their_size, their_host = bootstrap.get("segment", creator).split(" ", 2)
        if their_host != host or int(their_size) != size:
            raise ValueError(
                f"jaxtdist: the CPU heap of a multi-process mesh is one shared-memory segment "
                f"on one host, but process {creator} created it on host {their_host!r} "
                f"({their_size} bytes) and this process (process {bootstrap.process_index}) "
                f"runs on {host!r} and expects {size} bytes. Run every process of a CPU mesh "
                "on one host with the same mesh and heap_bytes; several hosts need GPUs and "
                "the NVSHMEM backend.")
        from jaxtdist.interpret._segment import map_segment

        self._segment = map_segment(name)
        self._segment_name_mapped = name
        return memoryview(self._segment)

    @property
    def _segment_name(self) -> str:
        return self._shm.name if self._shm is not None else self._segment_name_mapped

    def _join(self, owners: Sequence[int], bootstrap) -> None:
        """Waits until every process mapped the segment and started its workers; then
        the creator unlinks its name and each process watches the others' pids."""
        pids = [int(v) for v in bootstrap.all_gather("ready", str(os.getpid()))]
        if self._shm is not None:
            self._unlink()
        positions = {p: [pos for pos, o in enumerate(owners) if o == p]
                     for p in bootstrap.processes}
        peers = {p: pid for p, pid in zip(bootstrap.processes, pids)
                 if p != bootstrap.process_index}
        from jaxtdist.runtime._liveness import PeerWatch

        self._watch = PeerWatch(peers, positions, on_death=self.workers.fail,
                                exited_cleanly=lambda p: self.closed_cleanly(positions[p]))

    def _unlink(self) -> None:
        try:
            self._shm.unlink()
        except FileNotFoundError:
            pass
        self._unlinked = True

    def closed_cleanly(self, positions: Sequence[int]) -> bool:
        """Whether the process owning ``positions`` closed its heap before exiting."""
        return all(self.read(p, _CLOSED_OFFSET, 1) == b"\x01" for p in positions)

    def _release_waits(self) -> None:
        """Marks this process's ranks' waits failed (the word ``dl.wait`` polls), so
        that kernels waiting for a dead rank return at once instead of at their bound."""
        for pos in self._positions:
            self.write(pos, self.scratch(pos) - self.base_of(pos), (1).to_bytes(4, "little"))

    @property
    def positions(self) -> Sequence[int]:
        return self._positions

    def base_of(self, position: int) -> int:
        return self.segment_base + position * self.heap_bytes

    def ordinal_of(self, position: int) -> int:
        return -1

    def error_record(self, position: int) -> int:
        return self.base_of(position)

    def scratch(self, position: int) -> int:
        return self.base_of(position) + 64

    def write(self, position: int, offset: int, data: bytes) -> None:
        start = position * self.heap_bytes + offset
        self._view[start:start + len(data)] = data

    def read(self, position: int, offset: int, nbytes: int) -> bytes:
        start = position * self.heap_bytes + offset
        return bytes(self._view[start:start + nbytes])

    def aligns_at_launch(self, launcher: str, args: Sequence, needs_scratch: bool) -> bool:
        return False  # workers run one kernel at a time: nothing to align

    def launch(self, rt, kernel, args: Sequence, outs: Sequence, grid: tuple, num_warps: int,
               num_stages: int, constexprs: dict, needs_scratch: bool,
               rendezvous: tuple | None, op: str = "", maxnreg: int | None = None) -> list:
        """Runs the kernel in the worker of the calling device's position, from the
        native host-kernel handler (``_ffi.host_kernel``): the context (``args[0]``)
        says which position that is. Errors reach the user as the handler's status:
        ``DEADLINE_EXCEEDED: jaxtdist.WaitTimeoutError: ...``,
        ``UNAVAILABLE: jaxtdist.WorkerDiedError: ...``, and so on."""
        del num_warps, num_stages, needs_scratch, rendezvous, maxnreg  # GPU launch options
        from jaxtdist.interpret import kernel_reference
        from jaxtdist.runtime._ffi import host_kernel

        ref = kernel_reference(kernel)
        array_idx = [i for i, a in enumerate(args)
                     if not isinstance(a, (bool, int, float, np.number))]
        arrays = [args[i] for i in array_idx]
        # The scalars only: the callable outlives the trace, and must not hold its tracers.
        scalars = [None if i in array_idx else a for i, a in enumerate(args)]
        out_specs = [(tuple(o.shape), np.dtype(o.dtype)) for o in outs]
        pool = self.workers

        def host(*values):
            if not rt.is_current():
                raise JaxtdistError(
                    "jaxtdist: this program was traced for a jaxtdist runtime that is gone "
                    "(jaxtdist.shutdown() or initialize() with other settings ran since, or "
                    "while this call was in flight); call jaxtdist.initialize(mesh) and trace "
                    "it again")
            full = list(scalars)
            for i, v in zip(array_idx, values):
                full[i] = np.asarray(v)
            position = int(full[0].view(np.int64)[L.CTX_POSITION])
            results, timed_out = pool.run(position, ref, grid, full, out_specs, constexprs)
            if timed_out:
                raise WaitTimeoutError(rt.native.recorded_timeout(position, False)
                                       + _CPU_TIMEOUT_HINT)
            return tuple(results)

        # Owned by this heap: close() releases the callable (and the runtime it holds).
        return host_kernel(host, tuple(outs), *arrays, op=op, owner=self)

    def close(self) -> None:
        if self._watch is not None:
            self._watch.close()
            self._watch = None
        if self.workers is not None:
            self.workers.close()  # after the calls in flight: none of them needs a kernel now
            self.workers = None
        from jaxtdist.runtime._ffi import release_host_kernels

        release_host_kernels(self)
        if self._anchor is not None:
            for pos in self._positions:  # peers must not take this exit for a death
                self.write(pos, _CLOSED_OFFSET, b"\x01")
            self._anchor = None  # the buffer export must go before the view
            self._view.release()
        if self._segment is not None:
            self._segment.close()
            self._segment = None
        if self._shm is not None:
            self._shm.close()
            if not self._unlinked:
                self._unlink()
            self._shm = None


# What else ends a CPU wait this way (README, limits): programs dispatched without
# waiting for a result can leave a peer's program queued behind XLA:CPU's per-device
# limit on computations in flight.
_CPU_TIMEOUT_HINT = (
    " On CPU devices this also happens when many jitted programs are dispatched "
    "without waiting for a result (a peer's program then waits behind XLA:CPU's "
    "limit on computations in flight): call jax.block_until_ready every 20 calls or so.")


def heap_for(spec: BackendSpec) -> CpuHeap:
    """The "cpu-shared-memory" backend's factory (registered by name in ``_backend``).

    One segment serves the mesh; a mesh spanning processes maps it in each of
    them, its name exchanged through ``spec.bootstrap``.
    """
    if not spec.multi_process:
        return CpuHeap(len(spec.devices), spec.heap_bytes)
    return CpuHeap(len(spec.devices), spec.heap_bytes, owners=spec.owners,
                   bootstrap=spec.bootstrap("cpu-heap"))
