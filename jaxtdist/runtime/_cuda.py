"""Single-process CUDA heap: one equal-sized allocation on each local GPU.

The memory is a plain ``cudaMalloc`` outside XLA's memory pool, so it competes
with XLA's preallocation: lower ``XLA_PYTHON_CLIENT_MEM_FRACTION`` (default
0.75) if the heap does not fit. Peers are reached through CUDA peer access
(NVLink), with pointers valid on every GPU of the process (UVA).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence

import jax
import numpy as np

from jaxtdist.language import _layout as L
from jaxtdist._errors import HeapExhaustedError
from jaxtdist.runtime import _call_order, _ffi, _native
from jaxtdist.runtime._backend import BackendSpec


def device_ordinal(device) -> int:
    """The CUDA ordinal of a JAX device of this process."""
    return device.local_hardware_id if device.local_hardware_id is not None else device.id


@functools.lru_cache(maxsize=None)
def _jax_triton():
    try:
        import jax_triton  # imported lazily: it refuses to import without a GPU jaxlib
    except ImportError as e:
        raise ImportError("jaxtdist on GPUs needs jax-triton>=0.3.1 "
                          "(pip install 'jaxtdist[gpu]')") from e
    params = inspect.signature(jax_triton.triton_call).parameters
    # jax-triton 0.3 names the outputs out_shape=, 0.4 out_type=.
    out_kw = "out_shape" if "out_shape" in params else "out_type"
    return jax_triton, out_kw


def _is_scalar(a) -> bool:
    return isinstance(a, (bool, int, float, np.number))


class CudaHeap:
    """Symmetric heap across the CUDA devices of one process."""

    platform = "gpu"
    has_copy_engines = True
    locates_by_device = True

    def __init__(self, native, devices: Sequence, heap_bytes: int):
        self._native = native
        self.ordinals = [device_ordinal(d) for d in devices]
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

    @property
    def positions(self) -> Sequence[int]:
        return tuple(range(len(self.ordinals)))

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

    def aligns_at_launch(self, launcher: str, args: Sequence, needs_scratch: bool) -> bool:
        """jaxtdist's launcher holds the rendezvous right before it launches; it runs
        kernels that need Triton's global scratch always, others when the runtime's
        launcher is "native" and it can take their arguments. jax-triton's launch is
        a custom call of its own, so the prologue holds the rendezvous then."""
        return needs_scratch or (launcher == "native" and self._native_takes(args))

    def _native_takes(self, args: Sequence) -> bool:
        from jaxtdist.runtime import _cuda_launch
        takes = getattr(_cuda_launch, "takes_scalars", False)
        return takes or not any(_is_scalar(a) for a in args)

    def launch(self, rt, kernel, args: Sequence, outs: Sequence, grid: tuple, num_warps: int,
               num_stages: int, constexprs: dict, needs_scratch: bool,
               rendezvous: tuple | None, op: str = "", maxnreg: int | None = None) -> list:
        if self.aligns_at_launch(rt.launcher, args, needs_scratch or maxnreg is not None):
            from jaxtdist.runtime import _cuda_launch
            return _cuda_launch.launch(rt, kernel, args, outs, grid, num_warps, num_stages,
                                       constexprs, rendezvous, maxnreg=maxnreg)
        jt, out_kw = _jax_triton()
        result = jt.triton_call(*args, kernel=kernel, grid=grid, num_warps=num_warps,
                                num_stages=num_stages, **{out_kw: list(outs)}, **constexprs)
        outs = list(result) if isinstance(result, (list, tuple)) else [result]
        return _call_order.call_done(outs)  # ordered before the next prologue

    def push_to_peers(self, rt, ctx: jax.Array, x: jax.Array, *, counter_id: int,
                      groups: np.ndarray, world: int, inbox_offset: int, parity_bytes: int,
                      flags_offset: int, sent_offset: int, chunk_rows: int,
                      serial: bool, op: str) -> jax.Array:
        """Starts the copy engines pushing ``x`` into every peer's heap inbox, chunk by
        chunk, raising a flag per chunk (``csrc/ce_gather.cc``); returns ``ctx``
        (aliased: it orders the kernel that follows after the pushes are enqueued).
        The handler is the call's last host work: it holds the launch rendezvous."""
        call = _ffi.ffi_call(_native.CE_GATHER_TARGET,
                             jax.ShapeDtypeStruct(ctx.shape, ctx.dtype),
                             input_output_aliases={1: 0}, op=op)
        return call(x, ctx, counter_id=np.int64(counter_id), world=np.int64(world),
                    groups=groups, inbox_offset=np.int64(inbox_offset),
                    parity_bytes=np.int64(parity_bytes), flags_offset=np.int64(flags_offset),
                    sent_offset=np.int64(sent_offset), chunk_rows=np.int64(chunk_rows),
                    generation=np.int64(rt.generation), align_launch=np.int64(1),
                    serial=np.int64(serial))

    def close(self) -> None:
        for ordinal, base in zip(self.ordinals, self.bases):
            self._native.cuda_free(ordinal, base)
        self.bases = []
        if getattr(self, "_records", 0):
            self._native.cuda_free_host(self._records)
            self._records = 0


def heap_for(spec: BackendSpec) -> CudaHeap:
    """The "cuda-peer" backend's factory (registered by name in ``_backend``)."""
    return CudaHeap(spec.native, spec.devices, spec.heap_bytes)
