"""Single-process CUDA heap: one equal-sized allocation on each local GPU.

The memory is a plain ``cudaMalloc`` outside XLA's memory pool, so it competes
with XLA's preallocation: lower ``XLA_PYTHON_CLIENT_MEM_FRACTION`` (default
0.75) if the heap does not fit. Peers are reached through CUDA peer access
(NVLink), with pointers valid on every GPU of the process (UVA).
"""

from __future__ import annotations

from collections.abc import Sequence

from jaxtdist.language import _layout as L
from jaxtdist._errors import HeapExhaustedError


class CudaHeap:
    """Symmetric heap across the CUDA devices of one process."""

    def __init__(self, native, devices: Sequence, heap_bytes: int):
        self._native = native
        self.ordinals = [d.local_hardware_id if d.local_hardware_id is not None else d.id
                         for d in devices]
        self.heap_bytes = heap_bytes
        self.bases: list[int] = []
        for ordinal in self.ordinals:
            free, total = native.cuda_mem_get_info(ordinal)
            if heap_bytes > free:
                self.close()
                raise HeapExhaustedError(
                    f"jaxtdist: the symmetric heap needs {heap_bytes} bytes on CUDA device "
                    f"{ordinal} but only {free} of {total} bytes are free (XLA preallocates "
                    "75% by default). Lower heap_bytes in jaxtdist.initialize(...), or set "
                    "XLA_PYTHON_CLIENT_MEM_FRACTION lower before JAX starts.")
            self.bases.append(native.cuda_malloc(ordinal, heap_bytes))
        for a in self.ordinals:
            for b in self.ordinals:
                native.cuda_enable_peer_access(a, b)
        # Waits record timeouts in mapped pinned memory: readable by the host
        # without synchronising with the GPU.
        self._records = native.cuda_host_alloc_mapped(8 * L.ERR_WORDS * len(self.ordinals))

    def base_of(self, position: int) -> int:
        return self.bases[position]

    def ordinal_of(self, position: int) -> int:
        return self.ordinals[position]

    def error_record(self, position: int) -> int:
        return self._records + 8 * L.ERR_WORDS * position

    def scratch(self, position: int) -> int:
        return self.bases[position] + 64

    def write(self, position: int, offset: int, data: bytes) -> None:
        self._native.cuda_copy_to_device(self.ordinals[position], self.bases[position] + offset, data)

    def read(self, position: int, offset: int, nbytes: int) -> bytes:
        return self._native.cuda_copy_from_device(self.ordinals[position],
                                                  self.bases[position] + offset, nbytes)

    def close(self) -> None:
        for ordinal, base in zip(self.ordinals, self.bases):
            self._native.cuda_free(ordinal, base)
        self.bases = []
        if getattr(self, "_records", 0):
            self._native.cuda_free_host(self._records)
            self._records = 0
