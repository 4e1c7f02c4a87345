"""The heap-backend seam: what a symmetric heap must provide, and the registry.

A backend owns the symmetric heap of the mesh positions this process drives
and runs kernels on them. The single-process CUDA heap (``_cuda.CudaHeap``)
and the CPU shared-memory heap (``_cpu.CpuHeap``) implement it; an NVSHMEM
backend (one process per GPU) or a ROCm one registers itself the same way
and no op changes: ops talk to ``Runtime.backend`` only through this
interface.

Example:
  >>> from jaxtdist.runtime import register_backend
  >>> register_backend("nvshmem", lambda spec: NvshmemHeap(spec),
  ...                  applies=lambda spec: spec.multi_process and spec.platform == "gpu")
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable


@dataclasses.dataclass(frozen=True)
class BackendSpec:
    """What a backend is asked to serve: the mesh's devices and the heap size."""
    platform: str                    # "cpu" or "gpu"
    devices: tuple                   # every device of the mesh, in mesh order
    heap_bytes: int
    native: Any                      # the native module (csrc)

    @property
    def multi_process(self) -> bool:
        return len({d.process_index for d in self.devices}) > 1


@runtime_checkable
class HeapBackend(Protocol):
    """A symmetric heap over the mesh positions this process owns.

    Positions are linear indices into the mesh's devices. Addresses are as
    this process sees them: ``base_of(peer)`` is what pointer translation
    (``peer_ptr = ptr - base[me] + base[peer]``) needs.
    """

    platform: str
    heap_bytes: int

    @property
    def positions(self) -> Sequence[int]:
        """Mesh positions whose heap this process owns (and whose kernels it launches)."""

    @property
    def has_copy_engines(self) -> bool:
        """Whether the backend has ``push_to_peers`` (DMA engines); else ops push
        with SM kernels."""

    @property
    def locates_by_device(self) -> bool:
        """Whether the native handlers find a call's heap from XLA's device ordinal
        (then the prologue needs no mesh position computed on the device)."""

    def base_of(self, position: int) -> int:
        """A position's heap base as this process sees it (peers included)."""

    def ordinal_of(self, position: int) -> int:
        """The device ordinal of an owned position (-1 for host heaps)."""

    def error_record(self, position: int) -> int:
        """Host-visible address where a wait of ``position`` records a timeout."""

    def scratch(self, position: int) -> int:
        """A scratch word in ``position``'s heap."""

    def write(self, position: int, offset: int, data: bytes) -> None:
        """Copies ``data`` to ``position``'s heap at ``offset`` (host to heap)."""

    def read(self, position: int, offset: int, nbytes: int) -> bytes:
        """Copies bytes from ``position``'s heap (heap to host)."""

    def aligns_at_launch(self, launcher: str, args: Sequence, needs_scratch: bool) -> bool:
        """Whether this backend's launch of a kernel with ``args`` holds the call's
        launch rendezvous (so the prologue must not)."""

    def launch(self, rt, kernel, args: Sequence, outs: Sequence, grid: tuple, num_warps: int,
               num_stages: int, constexprs: dict, needs_scratch: bool,
               rendezvous: tuple | None, op: str = "") -> list:
        """Runs ``kernel[grid](*args, *outs, **constexprs)`` inside the traced program;
        returns the outputs."""

    def close(self) -> None:
        """Frees the heap and anything the backend started."""

    # Backends with ``has_copy_engines`` also provide:
    #   push_to_peers(rt, ctx, x, *, counter_id, groups, world, inbox_offset,
    #                 parity_bytes, flags_offset, sent_offset, chunk_rows, serial) -> ctx
    # which enqueues copies of x into every peer's inbox (a flag per chunk) and
    # returns ctx for the kernel that follows (see ``_cuda.CudaHeap``).


@dataclasses.dataclass(frozen=True)
class _Entry:
    name: str
    factory: Callable[[BackendSpec], HeapBackend]
    applies: Callable[[BackendSpec], bool]


_REGISTRY: list[_Entry] = []


def register_backend(name: str, factory: Callable[[BackendSpec], HeapBackend], *,
                     applies: Callable[[BackendSpec], bool]) -> None:
    """Registers a heap backend; the newest one that ``applies`` to a mesh serves it."""
    _REGISTRY[:] = [e for e in _REGISTRY if e.name != name]
    _REGISTRY.append(_Entry(name, factory, applies))


def backend_names() -> list[str]:
    return [e.name for e in _REGISTRY]


def create_backend(spec: BackendSpec) -> tuple[str, HeapBackend]:
    """The (name, backend) serving ``spec``; ``NotImplementedError`` if none does."""
    for entry in reversed(_REGISTRY):
        if entry.applies(spec):
            return entry.name, entry.factory(spec)
    layout = "one process per device" if spec.multi_process else "one process"
    raise NotImplementedError(
        f"jaxtdist: no heap backend serves a {spec.platform} mesh of {len(spec.devices)} "
        f"devices driven by {layout} (registered: {backend_names()}). Multi-process meshes "
        "need the NVSHMEM backend, which is not implemented yet; use a mesh of this "
        "process's devices.")


def _cpu_factory(spec: BackendSpec) -> HeapBackend:
    from jaxtdist.runtime._cpu import CpuHeap
    return CpuHeap(len(spec.devices), spec.heap_bytes)


def _cuda_factory(spec: BackendSpec) -> HeapBackend:
    from jaxtdist.runtime._cuda import CudaHeap
    return CudaHeap(spec.native, spec.devices, spec.heap_bytes)


register_backend("cpu-shared-memory", _cpu_factory,
                 applies=lambda s: s.platform == "cpu" and not s.multi_process)
register_backend("cuda-peer", _cuda_factory,
                 applies=lambda s: s.platform == "gpu" and not s.multi_process)
