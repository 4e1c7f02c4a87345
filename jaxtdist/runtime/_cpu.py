"""CPU heap: host shared memory, one interpreter worker process per rank.

Triton's interpreter keeps one global grid index and runs a kernel's
programs one at a time, so ranks cannot share a process: each mesh position
gets a worker process that maps the same shared-memory segment and runs the
kernels for that position. Peer loads, stores and atomics go straight to the
shared segment, exactly as on GPUs they go over NVLink.
"""

from __future__ import annotations

import ctypes
from multiprocessing import shared_memory

from jaxtdist.interpret import WorkerPool


class CpuHeap:
    """Symmetric heap of ``positions`` ranks in one shared-memory segment."""

    def __init__(self, positions: int, heap_bytes: int):
        self.heap_bytes = heap_bytes
        self.positions = positions
        self._shm = shared_memory.SharedMemory(create=True, size=positions * heap_bytes)
        self._view = self._shm.buf
        self._anchor = ctypes.c_char.from_buffer(self._view)
        self.segment_base = ctypes.addressof(self._anchor)
        self.workers = WorkerPool(positions, self._shm.name, self.segment_base)

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

    def close(self) -> None:
        self.workers.close()
        del self._anchor
        self._view.release()
        self._shm.close()
        self._shm.unlink()
