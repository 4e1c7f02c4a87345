"""The heap backends jaxtdist ships, registered with the registry (``_backend``).

Each is named, not imported: its module is imported when a mesh first needs
it, so a CPU job never imports the CUDA launcher and a single-process job
never loads NVSHMEM. Naming them here, above both the registry and the
backends (which import the registry for ``BackendSpec`` and
``register_backend``), keeps the registry free of its implementations. The
runtime imports this module, so the built-ins are registered before any
mesh is served, and before (so below) any backend a user registers.

Example:
  >>> from jaxtdist.runtime import _backend, _builtin_backends
  >>> _backend.backend_names()[:2]
  ['cpu-shared-memory', 'cuda-peer']
"""

from __future__ import annotations

from jaxtdist.runtime._backend import register_backend, register_lazy_backend

__all__: list[str] = []

# One host's processes share one segment (the CPU emulation of one process per
# GPU); processes on several hosts are refused with a clear error when mapping.
register_backend("cpu-shared-memory", "jaxtdist.runtime._cpu:heap_for",
                 applies=lambda s: s.platform == "cpu")
register_backend("cuda-peer", "jaxtdist.runtime._cuda:heap_for",
                 applies=lambda s: s.platform == "gpu" and not s.multi_process)
# Registers itself ("nvshmem") when imported: a GPU mesh spanning processes.
register_lazy_backend("nvshmem", "jaxtdist.runtime._nvshmem")
