"""NVSHMEM heap: one process per GPU, on one host or several.

The symmetric heap of a mesh whose devices belong to several processes (one
GPU each, started by ``jax.distributed``) comes from ``nvshmem_malloc``.
NVSHMEM's host library is loaded at run time by the native side
(``csrc/nvshmem_host.cc``) from the ``nvidia-nvshmem-cu12``/``-cu13`` package
that matches the installed jaxlib (or ``$JAXTDIST_NVSHMEM_LIB``). Process 0
makes NVSHMEM's unique id; it travels through JAX's key-value store (the
bootstrap of ``jaxtdist.initialize``, bounded by ``bootstrap_timeout_s``).

Peers are reached the way the single-process heap reaches them: each peer's
heap base as this process sees it (``nvshmem_ptr``: NVLink, or the same GPU
under MPS), so every kernel runs unchanged. A peer that only a network
transport reaches (another node) has no such base and is refused with an
error; kernels that use NVSHMEM's put/signal device calls are the way there.

NVSHMEM cannot be initialised twice in a process, so the first
``initialize`` on a multi-process GPU mesh starts NVSHMEM for the life of the
process, and the heap is kept across runtimes (zero-filled again for each):
``shutdown()`` then ``initialize()`` reuses it, and a later runtime with a
larger heap, or other processes, needs a restart.

Example (each of 2 processes, started by ``python -m jaxtdist.launch``):
  >>> jaxtdist.launch.initialize_from_env()
  >>> mesh = jax.make_mesh((jax.device_count(),), ("tp",))
  >>> jaxtdist.initialize(mesh).backend_name
  'nvshmem'
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Sequence

from jaxtdist._errors import HeapExhaustedError, JaxtdistError
from jaxtdist.language import _layout as L
from jaxtdist.runtime._backend import BackendSpec, register_backend
from jaxtdist.runtime._cuda import CudaHeap, device_ordinal
# Finding the host library lives below this backend: kernel linking
# (``_shmem_link``, called by the CUDA launcher) needs it too. Both names stay
# importable from here.
from jaxtdist.runtime._nvshmem_lib import ENV_LIBRARY, host_library_path  # noqa: F401

# NVSHMEM reserves its symmetric address range at initialisation; physical
# memory is mapped as nvshmem_malloc asks (CUDA VMM), so the range can be
# generous. NVSHMEM's own buffers (teams, signals) come from it too.
_SYMMETRIC_SLACK = 256 << 20


@dataclasses.dataclass
class _Job:
    """This process's NVSHMEM job: started once, it outlives runtimes."""
    processes: tuple[int, ...]
    pe: int
    ordinal: int
    symmetric_bytes: int
    heap: int = 0
    heap_bytes: int = 0


# NVSHMEM's state is per process and cannot be reset; this mirrors it.
_JOB: _Job | None = None


def _symmetric_bytes(heap_bytes: int) -> int:
    raw = os.environ.get("NVSHMEM_SYMMETRIC_SIZE")
    if raw is None:
        size = heap_bytes + _SYMMETRIC_SLACK
        os.environ["NVSHMEM_SYMMETRIC_SIZE"] = str(size)
        return size
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    text = raw.strip().lower().rstrip("b")
    scale = units.get(text[-1:], 1)
    try:
        size = int(float(text[:-1] if scale > 1 else text) * scale)
    except ValueError:
        raise ValueError(f"jaxtdist: $NVSHMEM_SYMMETRIC_SIZE={raw!r} is not a size") from None
    if size < heap_bytes + (16 << 20):
        raise ValueError(
            f"jaxtdist: $NVSHMEM_SYMMETRIC_SIZE={raw!r} ({size} bytes) cannot hold a heap of "
            f"{heap_bytes} bytes plus NVSHMEM's own buffers; unset it (jaxtdist then asks "
            f"for {heap_bytes + _SYMMETRIC_SLACK}) or raise it")
    return size


def _start_job(spec: BackendSpec, ordinal: int) -> _Job:
    """Initialises NVSHMEM over the mesh's processes (one PE each, in process order)."""
    native = spec.native
    processes = tuple(sorted(set(spec.owners)))
    pe = processes.index(spec.process_index)
    symmetric = _symmetric_bytes(spec.heap_bytes)
    # Multicast objects are off on the lent machines; NVSHMEM must not create them.
    os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
    native.nvshmem_load(host_library_path())
    boot = spec.bootstrap("nvshmem")
    if pe == 0:
        boot.publish("unique-id", native.nvshmem_unique_id().hex())
    unique_id = bytes.fromhex(boot.get("unique-id", from_process=processes[0]))
    # NVSHMEM's own bootstrap waits without a bound: enter it only once every
    # process is known to be here (this wait is bounded).
    boot.all_gather("joining", str(pe))
    native.nvshmem_init(ordinal, pe, len(processes), unique_id)
    return _Job(processes, pe, ordinal, symmetric)


def _job_for(spec: BackendSpec, ordinal: int) -> _Job:
    global _JOB
    processes = tuple(sorted(set(spec.owners)))
    if _JOB is None:
        _JOB = _start_job(spec, ordinal)
    elif _JOB.processes != processes or _JOB.ordinal != ordinal:
        raise JaxtdistError(
            f"jaxtdist: NVSHMEM was started in this process for processes {_JOB.processes} "
            f"on CUDA device {_JOB.ordinal}; this mesh needs processes {processes} on device "
            f"{ordinal}. NVSHMEM cannot be restarted in a process: keep one set of processes "
            "per job (sub-meshes of the first mesh's processes are fine), or restart.")
    return _JOB


class NvshmemHeap(CudaHeap):
    """The symmetric heap of this process's one GPU, from NVSHMEM.

    Kernels, launches and error records work as in ``CudaHeap``; what differs
    is where the memory comes from and how peers' bases are found.
    """

    # Peers' heaps are mapped into this process (nvshmem_ptr), so the copy
    # engines push into them as into a peer GPU of one process.
    has_copy_engines = True
    locates_by_device = True

    def __init__(self, spec: BackendSpec):
        self._native = native = spec.native
        self.heap_bytes = spec.heap_bytes
        self.bases = []
        self._records = 0
        local = spec.local_positions
        if len(local) != 1:
            raise NotImplementedError(
                f"jaxtdist: with NVSHMEM each process drives one GPU of the mesh, but process "
                f"{spec.process_index} owns mesh positions {list(local)}. Start one process per "
                "GPU (python -m jaxtdist.launch --nproc-per-node N, or one SLURM task per "
                "GPU), or drive all of a host's GPUs from one process with a mesh of that "
                "process's devices only.")
        self._position = local[0]
        device = spec.devices[self._position]
        self._ordinal = device_ordinal(device)
        started = time.perf_counter()
        job = _job_for(spec, self._ordinal)
        self._job = job
        self._heap_base = self._heap(job, spec)
        # Peers' bases as this process sees them.
        self._bases = {}
        unreachable = []
        for pos, owner in enumerate(spec.owners):
            base = native.nvshmem_ptr(self._heap_base, job.processes.index(owner))
            if base == 0:
                unreachable.append((pos, owner))
            self._bases[pos] = base
        if unreachable:
            raise NotImplementedError(
                "jaxtdist: the heaps of mesh positions "
                f"{[p for p, _ in unreachable]} (processes {sorted({o for _, o in unreachable})}) "
                "are not load/store reachable from this GPU (no NVLink or same-GPU path: "
                "another node). jaxtdist's built-in ops address peers' heaps directly, so "
                "their axis must stay within a node (NVLink domain); put the axis that "
                "crosses nodes outside the op (for example dp).")
        self._records = native.cuda_host_alloc_mapped(8 * L.ERR_WORDS)
        self.setup_s = time.perf_counter() - started

    def _heap(self, job: _Job, spec: BackendSpec) -> int:
        """The job's heap, allocated (collectively) or reused, zero-filled on every PE."""
        native = self._native
        if spec.heap_bytes > job.symmetric_bytes - (16 << 20):
            raise HeapExhaustedError(
                f"jaxtdist: heap_bytes={spec.heap_bytes} does not fit NVSHMEM's symmetric "
                f"size of {job.symmetric_bytes} bytes, fixed when NVSHMEM started in this "
                "process. Restart with the larger heap_bytes from the first initialize.")
        if job.heap and job.heap_bytes >= spec.heap_bytes:
            native.cuda_zero(self._ordinal, job.heap, spec.heap_bytes)
        else:
            free, total = native.cuda_mem_get_info(self._ordinal)
            if spec.heap_bytes > free:
                raise HeapExhaustedError(
                    f"jaxtdist: the NVSHMEM heap needs {spec.heap_bytes} bytes on CUDA device "
                    f"{self._ordinal} but only {free} of {total} bytes are free (XLA "
                    "preallocates 75% by default). Lower heap_bytes in jaxtdist.initialize(...), "
                    "or set XLA_PYTHON_CLIENT_MEM_FRACTION lower before JAX starts.")
            if job.heap:
                native.nvshmem_free(job.heap)  # collective, as is the malloc below
                job.heap, job.heap_bytes = 0, 0
            job.heap = native.nvshmem_malloc(self._ordinal, spec.heap_bytes)
            job.heap_bytes = spec.heap_bytes
        # No peer may signal into this heap before it is zero (bounded wait).
        spec.bootstrap("nvshmem-heap").all_gather("zeroed", "1")
        return job.heap

    @property
    def positions(self) -> Sequence[int]:
        return (self._position,)

    def base_of(self, position: int) -> int:
        return self._bases[position]

    def ordinal_of(self, position: int) -> int:
        return self._ordinal

    def error_record(self, position: int) -> int:
        return self._records

    def scratch(self, position: int) -> int:
        return self._bases[position] + 64

    def write(self, position: int, offset: int, data: bytes) -> None:
        self._native.cuda_copy_to_device(self._ordinal, self._bases[position] + offset, data)

    def read(self, position: int, offset: int, nbytes: int) -> bytes:
        return self._native.cuda_copy_from_device(self._ordinal,
                                                  self._bases[position] + offset, nbytes)

    def aligns_at_launch(self, launcher: str, args: Sequence, needs_scratch: bool) -> bool:
        """Always jaxtdist's launcher: it binds NVSHMEM's device state in modules that
        call NVSHMEM (jaxlib's does not). Nothing to align across processes."""
        return True

    @property
    def remote_bases(self) -> dict[int, int]:
        """Other processes' positions -> their heap base as mapped in this process."""
        return {p: b for p, b in self._bases.items() if p != self._position}

    def close(self) -> None:
        # The heap stays with the NVSHMEM job (freeing it is collective, and a
        # dead peer would hang it); the next runtime reuses it.
        self._bases = {}
        if self._records:
            self._native.cuda_free_host(self._records)
            self._records = 0


def _factory(spec: BackendSpec) -> NvshmemHeap:
    return NvshmemHeap(spec)


register_backend("nvshmem", _factory,
                 applies=lambda s: s.platform == "gpu" and s.multi_process)
