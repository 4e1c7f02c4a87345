"""The heap-backend seam: what a symmetric heap must provide, and the registry.

A backend owns the symmetric heap of the mesh positions this process drives
and runs kernels on them. The single-process CUDA heap (``_cuda.CudaHeap``)
and the CPU shared-memory heap (``_cpu.CpuHeap``) implement it; an NVSHMEM
backend (one process per GPU) or a ROCm one registers itself the same way
and no op changes: ops talk to ``Runtime.backend`` only through this
interface.

This module neither imports nor names a backend: the implementations import
it (for ``BackendSpec`` and ``register_backend``). The built-in ones are
registered from above (``_builtin_backends``, imported by the runtime) by the
name of their factory (``"module:function"``) or module, imported on first
use.

Example:
  >>> from jaxtdist.runtime._backend import register_backend
  >>> register_backend("nvshmem", lambda spec: NvshmemHeap(spec),
  ...                  applies=lambda spec: spec.multi_process and spec.platform == "gpu")
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable


@dataclasses.dataclass(frozen=True)
class BackendSpec:
    """What a backend is asked to serve: the mesh's devices and the heap size.

    In a mesh that spans processes, a backend sets up only ``local_positions``
    (the positions of this process's devices) and reaches the others' heaps
    through ``bootstrap`` (``_bootstrap.KeyValueBootstrap``: values exchanged
    through JAX's key-value store, within ``bootstrap_timeout_s``).
    """
    platform: str                    # "cpu" or "gpu"
    devices: tuple                   # every device of the mesh, in mesh order
    heap_bytes: int
    native: Any                      # the native module (csrc)
    process_index: int = 0           # this process's jax.process_index()
    generation: int = 0              # the runtime's generation (names bootstrap keys)
    bootstrap_timeout_s: float = 300.0

    @property
    def multi_process(self) -> bool:
        return len(self.owners) > 1 and len(set(self.owners)) > 1

    @property
    def owners(self) -> tuple[int, ...]:
        """The process index owning each mesh position."""
        return tuple(int(d.process_index) for d in self.devices)

    @property
    def local_positions(self) -> tuple[int, ...]:
        """Mesh positions of this process's devices: the ones its backend serves."""
        return tuple(p for p, o in enumerate(self.owners) if o == self.process_index)

    def bootstrap(self, what: str):
        """A key-value exchange among the mesh's processes for ``what`` (one deadline)."""
        from jaxtdist.runtime._bootstrap import KeyValueBootstrap

        return KeyValueBootstrap(what, self.generation, self.bootstrap_timeout_s,
                                 processes=self.owners)


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
               rendezvous: tuple | None, op: str = "", maxnreg: int | None = None) -> list:
        """Runs ``kernel[grid](*args, *outs, **constexprs)`` inside the traced program;
        returns the outputs. ``maxnreg``: a register limit per thread (GPUs;
        warp-specialized kernels size their partitions from it)."""

    def close(self) -> None:
        """Frees the heap and anything the backend started."""

    # Backends with ``has_copy_engines`` also provide:
    #   push_to_peers(rt, ctx, x, *, counter_id, groups, world, inbox_offset,
    #                 parity_bytes, flags_offset, sent_offset, chunk_rows, serial) -> ctx
    # which enqueues copies of x into every peer's inbox (a flag per chunk) and
    # returns ctx for the kernel that follows (see ``_cuda.CudaHeap``).


Factory = Callable[[BackendSpec], HeapBackend]


@dataclasses.dataclass(frozen=True)
class _Entry:
    name: str
    factory: Factory | str
    applies: Callable[[BackendSpec], bool]

    def create(self, spec: BackendSpec) -> HeapBackend:
        """Calls the factory, importing it first when it is given by name."""
        factory = self.factory
        if isinstance(factory, str):
            module, _, function = factory.partition(":")
            factory = getattr(importlib.import_module(module), function)
        return factory(spec)


_REGISTRY: list[_Entry] = []


def register_backend(name: str, factory: Factory | str, *,
                     applies: Callable[[BackendSpec], bool]) -> None:
    """Registers a heap backend; the newest one that ``applies`` to a mesh serves it.

    Args:
      name: the backend's name (``Runtime.backend_name``); registering a name
        again replaces the earlier entry.
      factory: ``spec -> HeapBackend``, or ``"package.module:function"`` naming
        one, imported when a mesh first needs it (so that registering a
        backend imports nothing, and its module may import the runtime).
      applies: whether the backend serves a mesh (``spec -> bool``).

    Example:
      >>> register_backend("cpu-shared-memory", "jaxtdist.runtime._cpu:heap_for",
      ...                  applies=lambda spec: spec.platform == "cpu")
    """
    if isinstance(factory, str) and factory.count(":") != 1:
        raise ValueError(
            f"jaxtdist: a backend factory given by name is 'package.module:function', "
            f"got {factory!r} for backend {name!r}; pass the callable or name it so.")
    _REGISTRY[:] = [e for e in _REGISTRY if e.name != name]
    _REGISTRY.append(_Entry(name, factory, applies))


def backend_names() -> list[str]:
    return [e.name for e in _REGISTRY]


# Backends whose module registers them when imported, imported on first need
# only: the NVSHMEM backend loads NVSHMEM's host library, which a
# single-process job must not pay for (or lack). Filled by
# ``register_lazy_backend``.
_LAZY_BACKENDS: dict[str, str] = {}


def register_lazy_backend(name: str, module: str) -> None:
    """Names the module that registers backend ``name`` when imported.

    ``create_backend`` imports it on first need (a GPU mesh spanning processes
    needs "nvshmem"), so that a job which never needs the backend never imports
    it.

    Example:
      >>> register_lazy_backend("nvshmem", "jaxtdist.runtime._nvshmem")
    """
    _LAZY_BACKENDS[name] = module


def _import_lazy(name: str) -> str:
    """Imports the module of lazy backend ``name``; "" or why it is unavailable."""
    if name in backend_names():
        return ""
    module = _LAZY_BACKENDS.get(name)
    if module is None:
        return f"no module registers a backend named {name!r}"
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module:
            raise  # the module exists but needs something absent: say what
        return f"{module} does not exist in this jaxtdist"
    if name not in backend_names():
        return f"{module} did not register a backend named {name!r}"
    return ""


def create_backend(spec: BackendSpec) -> tuple[str, HeapBackend]:
    """The (name, backend) serving ``spec``; ``NotImplementedError`` if none does.

    A GPU mesh spanning processes is served by the backend named "nvshmem"
    (``jaxtdist.runtime._nvshmem``, imported here on first need).
    """
    why = ""
    if spec.platform == "gpu" and spec.multi_process:
        why = _import_lazy("nvshmem")
    for entry in reversed(_REGISTRY):
        if entry.applies(spec):
            return entry.name, entry.create(spec)
    layout = (f"{len(set(spec.owners))} processes" if spec.multi_process else "one process")
    if spec.platform == "gpu" and spec.multi_process:
        raise NotImplementedError(
            f"jaxtdist: a GPU mesh of {len(spec.devices)} devices driven by {layout} needs "
            "the NVSHMEM backend (a heap backend registered as 'nvshmem'), and none is "
            f"available: {why or 'it does not serve this mesh'} (registered: "
            f"{backend_names()}). Until it is, use a mesh of one process's devices (one "
            "process driving every GPU of a host). See docs/multiprocess.md.")
    raise NotImplementedError(
        f"jaxtdist: no heap backend serves a {spec.platform} mesh of {len(spec.devices)} "
        f"devices driven by {layout} (registered: {backend_names()}).")
