"""CPU heap: host shared memory, one interpreter worker process per rank.

Triton's interpreter keeps one global grid index and runs a kernel's
programs one at a time, so ranks cannot share a process: each mesh position
gets a worker process that maps the same shared-memory segment and runs the
kernels for that position. Peer loads, stores and atomics go straight to the
shared segment, exactly as on GPUs they go over NVLink.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from multiprocessing import shared_memory

import numpy as np

from jaxtdist._errors import JaxtdistError, WaitTimeoutError
from jaxtdist.interpret import WorkerPool
from jaxtdist.language import _layout as L


class CpuHeap:
    """Symmetric heap of ``positions`` ranks in one shared-memory segment."""

    platform = "cpu"
    has_copy_engines = False
    locates_by_device = False

    def __init__(self, positions: int, heap_bytes: int):
        self.heap_bytes = heap_bytes
        self._positions = tuple(range(positions))
        self._shm = shared_memory.SharedMemory(create=True, size=positions * heap_bytes)
        self._view = self._shm.buf
        self._anchor = ctypes.c_char.from_buffer(self._view)
        self.segment_base = ctypes.addressof(self._anchor)
        self.workers = WorkerPool(positions, self._shm.name, self.segment_base,
                                  on_failure=self._release_waits)

    def _release_waits(self) -> None:
        """Marks every rank's waits failed (the word ``dl.wait`` polls), so that
        kernels waiting for a dead rank return at once instead of at their bound."""
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
               rendezvous: tuple | None, op: str = "") -> list:
        """Runs the kernel in the worker of the calling device's position, from a host
        callback: the context (``args[0]``) says which position that is."""
        del num_warps, num_stages, needs_scratch, rendezvous  # GPU launch options
        from jaxtdist.interpret import kernel_reference
        from jaxtdist.runtime._ffi import host_kernel
        from jaxtdist.runtime._runtime import is_initialized, runtime

        ref = kernel_reference(kernel)
        array_idx = [i for i, a in enumerate(args)
                     if not isinstance(a, (bool, int, float, np.number))]
        arrays = [args[i] for i in array_idx]
        out_specs = [(tuple(o.shape), np.dtype(o.dtype)) for o in outs]
        pool = self.workers

        def host(*values):
            if not is_initialized() or runtime() is not rt:
                raise JaxtdistError(
                    "jaxtdist: this program was traced for a jaxtdist runtime that is gone "
                    "(jaxtdist.shutdown() or initialize() with other settings ran since, or "
                    "while this call was in flight); call jaxtdist.initialize(mesh) and trace "
                    "it again")
            full = list(args)
            for i, v in zip(array_idx, values):
                full[i] = np.asarray(v)
            position = int(full[0].view(np.int64)[L.CTX_POSITION])
            results, timed_out = pool.run(position, ref, grid, full, out_specs, constexprs)
            if timed_out:
                raise WaitTimeoutError(rt.native.recorded_timeout(position, False))
            return tuple(results)

        return host_kernel(host, tuple(outs), *arrays, op=op)

    def close(self) -> None:
        self.workers.close()
        del self._anchor
        self._view.release()
        self._shm.close()
        self._shm.unlink()
