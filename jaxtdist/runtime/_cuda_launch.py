"""Runs Triton kernels through jaxtdist's own launcher (``csrc/triton_launch.cc``).

jax-triton hands kernels to jaxlib's launcher, which passes a null global
scratch pointer: kernels that build TMA descriptors on the device
(``tl.make_tensor_descriptor``) write their descriptors there and would
fault. Here jaxtdist compiles the kernel to a cubin itself and its FFI
handler launches it with a scratch slice of the symmetric heap.

Arguments are arrays or Python/numpy scalars. Scalars reach the kernel at
run time, as attributes of the FFI call that the handler packs between the
pointers, so one compiled kernel serves every value: a shape or a heap
offset passed as a scalar costs no compile, where a constexpr costs one per
value. Unlike Triton's JIT, the compile does not specialize an int on being
1 or a multiple of 16 (it could not: the value is not part of the cache key).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import tempfile
from collections.abc import Sequence
from typing import TYPE_CHECKING

import jax
import numpy as np

from jaxtdist.runtime import _ffi
from jaxtdist.runtime import _native

if TYPE_CHECKING:  # only annotations: the runtime is above its backends' launchers
    from jaxtdist.runtime._runtime import Runtime

_POINTER_TYPES = {
    "bfloat16": "*bf16", "float16": "*fp16", "float32": "*fp32", "float64": "*fp64",
    "int8": "*i8", "int16": "*i16", "int32": "*i32", "int64": "*i64",
    "uint8": "*u8", "uint16": "*u16", "uint32": "*u32", "uint64": "*u64", "bool": "*i1",
    # FP8 GEMM operands (Hopper's e4m3 / e5m2).
    "float8_e4m3fn": "*fp8e4nv", "float8_e5m2": "*fp8e5",
}


# The kinds of a launch's ``arg_kinds`` attribute (csrc/triton_launch.h, ParamKind).
_BUFFER_KIND = 0
_SCALAR_KINDS = {"i32": 1, "i64": 2, "fp32": 3, "i1": 4}

# The CUDA backend asks whether this launcher runs kernels with scalar arguments.
takes_scalars = True


@dataclasses.dataclass(frozen=True)
class CompiledKernel:
    kernel_id: int          # id in the native kernel table
    name: str
    shared_bytes: int
    scratch_bytes: int      # global scratch per program
    scratch_align: int


def pointer_type(dtype) -> str:
    name = np.dtype(dtype).name
    if name not in _POINTER_TYPES:
        raise ValueError(f"jaxtdist: no Triton pointer type for dtype {name}")
    return _POINTER_TYPES[name]


def is_scalar(arg) -> bool:
    return isinstance(arg, (bool, int, float, np.number, np.bool_))


def scalar_type(value) -> str:
    """Triton's type for a scalar argument, as Triton's JIT types Python values:
    i1 for bools, i32 for ints that fit in 32 bits (else i64), fp32 for floats.
    Numpy scalars follow their value, not their dtype."""
    if isinstance(value, (bool, np.bool_)):
        return "i1"
    if isinstance(value, (int, np.integer)):
        if -2**31 <= int(value) < 2**31:
            return "i32"
        if -2**63 <= int(value) < 2**63:
            return "i64"
        raise ValueError(f"jaxtdist: scalar argument {value} does not fit in int64")
    if isinstance(value, (float, np.floating)):
        return "fp32"
    raise TypeError(f"jaxtdist: no Triton type for scalar argument {value!r}")


def _scalar_bits(value, ty: str) -> int:
    """The int64 the handler receives for a scalar (an fp32's bit pattern)."""
    if ty == "fp32":
        return int(np.float32(value).view(np.uint32))
    return int(value)


def argument_types(args: Sequence, outs: Sequence) -> tuple[str, ...]:
    """Triton's signature types of ``kernel(*args, *outs)``'s non-constexpr
    arguments: pointers for arrays, scalar types for scalars (no values: the
    compile cache key)."""
    return (tuple(scalar_type(a) if is_scalar(a) else pointer_type(a.dtype) for a in args)
            + tuple(pointer_type(o.dtype) for o in outs))


def launch_operands(args: Sequence, types: Sequence[str]):
    """(arrays, arg_kinds, scalars) of a launch: the arrays that become the FFI
    call's operands, each kernel argument's kind (outputs included) and the
    scalars' values, in argument order (csrc/triton_launch.h)."""
    arrays = [a for a in args if not is_scalar(a)]
    kinds = np.array([_BUFFER_KIND if t.startswith("*") else _SCALAR_KINDS[t] for t in types],
                     np.int64)
    scalars = np.array([_scalar_bits(a, t) for a, t in zip(args, types) if not t.startswith("*")],
                       np.int64)
    return arrays, kinds, scalars


def compute_capability(device) -> int:
    """The device's compute capability as Triton's target wants it (e.g. 90)."""
    cc = getattr(device, "compute_capability", None)
    if cc is None:
        raise ValueError(f"jaxtdist: cannot tell the compute capability of {device}")
    major, minor = str(cc).split(".")[:2]
    return int(major) * 10 + int(minor)


def _ensure_cache_dir() -> None:
    """Points Triton's cache at a temporary directory when its default is unusable
    (no home directory, or a read-only one, as on some GPU nodes)."""
    from triton import knobs

    cache_dir = knobs.cache.dir
    if cache_dir:
        try:
            os.makedirs(cache_dir, exist_ok=True)
            if os.access(cache_dir, os.W_OK):
                return
        except OSError:
            pass
    knobs.cache.dir = os.path.join(tempfile.gettempdir(), f"jaxtdist-triton-cache-{os.getuid()}")


def compile_kernel(kernel, arg_types: Sequence[str], constexprs: dict, num_warps: int,
                   num_stages: int, capability: int, shmem: bool = False,
                   maxnreg: int | None = None):
    """Compiles ``kernel`` for CUDA ``capability``; returns Triton's compiled kernel.

    ``shmem``: the runtime has NVSHMEM's heap, so kernels calling NVSHMEM device
    functions are linked with its device library (``_shmem_link``); otherwise
    such a kernel is refused with an error naming what it needs. ``maxnreg``:
    Triton's register limit per thread (warp-specialized kernels size their
    partitions' registers from it).
    """
    from jaxtdist.runtime import _shmem_link

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = [n for n in kernel.arg_names if n not in constexprs]
    if len(names) != len(arg_types):
        raise ValueError(f"jaxtdist: kernel {kernel.__name__} takes {len(names)} non-constexpr "
                         f"arguments {names}, got {len(arg_types)}")
    signature = dict(zip(names, arg_types))
    signature.update({n: "constexpr" for n in constexprs})
    # XLA buffers are at least 16-byte aligned (as jax-triton assumes too).
    # Scalars get no attributes: the compile must hold for every value.
    attrs = {(kernel.arg_names.index(n),): [["tt.divisibility", 16]]
             for n, t in zip(names, arg_types) if t.startswith("*")}
    consts = {(kernel.arg_names.index(n),): v for n, v in constexprs.items()}
    source = ASTSource
    try:  # a Gluon kernel (Triton's explicit-layout dialect) has a source of its own
        from triton.experimental.gluon._runtime import GluonASTSource, GluonJITFunction
        if isinstance(kernel, GluonJITFunction):
            source = GluonASTSource
    except ImportError:  # pragma: no cover - triton without Gluon
        pass
    src = source(fn=kernel, signature=signature, constexprs=consts, attrs=attrs)
    _ensure_cache_dir()
    with _shmem_link.linking(shmem):
        options = dict(num_warps=num_warps, num_stages=num_stages)
        if maxnreg is not None:
            options["maxnreg"] = maxnreg
        compiled = triton.compile(src, target=GPUTarget("cuda", capability, 32), options=options)
    if not shmem and _shmem_link.uses_shmem(compiled.asm.get("ptx", "")):
        raise _shmem_link.needs_nvshmem_error()  # a cubin from Triton's cache
    return compiled


def launch_warps(metadata) -> int:
    """Warps to launch each program with: the compiled count, which Triton raises
    above the requested ``num_warps`` for warp-specialized loops (producer
    warps; the cubin requires exactly that many threads per program)."""
    return int(metadata.num_warps)


@functools.lru_cache(maxsize=None)
def _registered(kernel, arg_types: tuple, constexpr_items: tuple, num_warps: int,
                num_stages: int, capability: int, shmem: bool = False,
                maxnreg: int | None = None) -> CompiledKernel:
    from jaxtdist.runtime import _shmem_link

    compiled = compile_kernel(kernel, arg_types, dict(constexpr_items), num_warps, num_stages,
                              capability, shmem, maxnreg)
    md = compiled.metadata
    if getattr(md, "num_ctas", 1) != 1 or getattr(md, "profile_scratch_size", 0):
        raise ValueError(f"jaxtdist: kernel {md.name} needs CTA clusters or profile scratch, "
                         "which jaxtdist's launcher does not provide")
    warps = launch_warps(md)
    kernel_id = _native.native().register_triton_kernel(
        compiled.asm["cubin"], md.name, warps, md.shared, md.global_scratch_size,
        _shmem_link.uses_shmem(compiled.asm.get("ptx", "")))
    return CompiledKernel(kernel_id, md.name, md.shared, md.global_scratch_size,
                          md.global_scratch_align)


def launch(rt: Runtime, kernel, args: Sequence, outs, grid, num_warps: int,
           num_stages: int, constexprs: dict,
           rendezvous: tuple[int, np.ndarray, int] | None = None,
           maxnreg: int | None = None) -> list[jax.Array]:
    """``kernel[grid](*args, *outs, **constexprs)`` on the devices of ``rt``'s mesh.

    ``args``: arrays and Python/numpy scalars (``scalar_type`` says how each
    scalar is typed); the kernel is compiled once for every scalar value.
    ``rendezvous``: (workspace counter id, group table, world) of the call whose
    prologue ran just before: the handler then holds the launch rendezvous
    (``csrc/launch_align.h``) right before it launches.
    """
    grid = tuple(grid) if isinstance(grid, (tuple, list)) else (int(grid),)
    grid = tuple(int(g) for g in grid) + (1,) * (3 - len(grid))
    types = argument_types(args, outs)
    device = rt.mesh.devices.flat[rt.backend.positions[0]]
    capability = compute_capability(device)
    compiled = _registered(kernel, types, tuple(sorted(constexprs.items())), num_warps,
                           num_stages, capability, rt.backend_name == "nvshmem", maxnreg)
    # The devices this process launches on: the backend's positions.
    ordinals = [rt.backend.ordinal_of(p) for p in rt.backend.positions]
    native = _native.native()
    limit = native.cuda_max_shared_per_block(ordinals[0])
    if compiled.shared_bytes > limit:
        blocks = ", ".join(f"{k}={v}" for k, v in sorted(constexprs.items())
                           if k.startswith("BLOCK_"))
        raise ValueError(f"jaxtdist: kernel {compiled.name} needs {compiled.shared_bytes} bytes "
                         f"of shared memory per program with num_stages={num_stages}, "
                         f"{blocks}; {device.device_kind} allows {limit}. Lower num_stages or "
                         "the block sizes")
    # Load the module on every device now, at trace time: a load inside the
    # launch could wait for our spinning kernels (see csrc/triton_launch.h).
    for ordinal in ordinals:
        native.preload_triton_kernel(compiled.kernel_id, ordinal)
    scratch_offset = 0
    if compiled.scratch_bytes:
        # Program p's slice starts at scratch + p * scratch_bytes (Triton's ABI).
        programs = grid[0] * grid[1] * grid[2]
        align = max(compiled.scratch_align, 1)
        ws = rt.workspace(("triton_scratch", compiled.name, compiled.kernel_id, programs),
                          programs * compiled.scratch_bytes + align)
        scratch_offset = -(-ws.offset // align) * align
    call = _ffi.ffi_call(_native.TRITON_LAUNCH_TARGET, list(outs), platform=rt.platform)
    counter, groups, world = (rendezvous if rendezvous is not None
                              else (-1, np.zeros(1, np.int64), 1))
    arrays, arg_kinds, scalars = launch_operands(args, types)
    result = call(*arrays, kernel_id=np.int64(compiled.kernel_id), grid_x=np.int64(grid[0]),
                  grid_y=np.int64(grid[1]), grid_z=np.int64(grid[2]),
                  scratch_offset=np.int64(scratch_offset), generation=np.int64(rt.generation),
                  align_counter=np.int64(counter), groups=groups, world=np.int64(world),
                  arg_kinds=arg_kinds, scalars=scalars)
    return list(result)
