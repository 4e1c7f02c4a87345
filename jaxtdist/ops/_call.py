"""The one path through which jaxtdist runs kernels inside jit/shard_map.

``prologue`` runs the native FFI handler (stage a buffer into the symmetric
heap, advance the epoch, produce the kernel context as device data);
``launch`` runs a Triton kernel: through jax-triton on GPUs, through the
interpreter workers on CPU. Kernel arguments follow jax-triton's order:
inputs, then outputs, then constexpr keywords.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from jaxtdist._errors import JaxtdistError, WaitTimeoutError
from jaxtdist.language import _layout as L
from jaxtdist.runtime import _ffi
from jaxtdist.runtime import _native
from jaxtdist.runtime._runtime import Layout, Runtime, Workspace, runtime

CTX_INT32_WORDS = 2 * L.CTX_WORDS


def _abstract_mesh():
    try:
        return jax.sharding.get_abstract_mesh()
    except AttributeError:  # pragma: no cover - older jax
        return None


def check_axis(rt: Runtime, axis_name, op: str) -> Layout:
    """Validates ``axis_name`` against the runtime's mesh and the current shard_map."""
    if axis_name is None:
        raise ValueError(f"jaxtdist.{op}: axis_name is required (a mesh axis name, or a "
                         "tuple of them)")
    layout = rt.layout(axis_name)
    abstract = _abstract_mesh()
    if abstract is not None and not abstract.empty:
        if tuple(abstract.axis_names) != tuple(rt.mesh.axis_names) or tuple(
                abstract.axis_sizes) != tuple(rt.mesh.devices.shape):
            raise ValueError(
                f"jaxtdist.{op}: the shard_map's mesh {dict(abstract.shape)} differs from the "
                f"mesh given to jaxtdist.initialize {dict(rt.mesh.shape)}; initialize with the "
                "mesh you shard_map over")
    return layout


def mesh_position(rt: Runtime, op: str) -> jax.Array:
    """This device's linear position in the mesh, as device data (int32[1])."""
    names = tuple(rt.mesh.axis_names)
    shape = tuple(rt.mesh.devices.shape)
    pos = jnp.zeros((), jnp.int32)
    try:
        for name, size in zip(names, shape):
            pos = pos * size + jax.lax.axis_index(name).astype(jnp.int32)
    except NameError as e:
        raise ValueError(
            f"jaxtdist.{op} must be called inside jax.shard_map over every axis of the mesh "
            f"{dict(rt.mesh.shape)} (all axes manual); axis lookup failed: {e}") from None
    return pos.reshape((1,))


def _current_trace():
    try:
        from jax._src import core
        return core.trace_ctx.trace
    except (ImportError, AttributeError):  # pragma: no cover - other jax versions
        return None


def program_order_deps(rt: Runtime) -> tuple:
    """The previous jaxtdist output of the trace being built, if any."""
    last = rt.last_traced_output
    if last is None:
        return ()
    trace, value = last
    return (value,) if trace is not None and trace is _current_trace() else ()


def prologue(rt: Runtime, layout: Layout, ws: Workspace, op: str, stage: jax.Array | None = None,
             stage_offset: int = 0, parity_bytes: int = 0, deps: Sequence = (),
             align_launch: bool = True) -> jax.Array:
    """Runs the FFI prologue; returns the kernel context (int32[2 * CTX_WORDS]).

    With ``align_launch`` (and the runtime's ``align_launches``), the CUDA
    prologue ends with a host rendezvous of the group's host threads, so that
    the kernel that follows starts at about the same time on every device
    (``csrc/launch_align.h``); an op whose last host work before its kernel is
    another handler passes False and aligns there.

    The prologue advances the epoch, so it must run after ``deps`` (the op's
    inputs) and after the previous jaxtdist op of the same trace: otherwise
    XLA may order calls differently on different devices (it does on CPU),
    and their epochs would disagree.
    """
    position = mesh_position(rt, op)  # also checks the call is inside a full shard_map
    if rt.platform == "gpu":
        # The CUDA prologue finds its heap from the device ordinal: a constant
        # spares every call the small XLA kernel that computes the position.
        position = np.zeros((1,), np.int32)
    deps = tuple(deps) + program_order_deps(rt)
    if deps:
        position, _ = jax.lax.optimization_barrier((position, deps))
    args = [position]
    if stage is not None:
        args.append(stage)
    call = _ffi.ffi_call(_native.PROLOGUE_TARGET,
                         jax.ShapeDtypeStruct((CTX_INT32_WORDS,), jnp.int32), platform=rt.platform)
    return call(*args, template_offset=np.int64(layout.template_offset),
                counter_id=np.int64(ws.counter_id), stage_offset=np.int64(stage_offset),
                parity_bytes=np.int64(parity_bytes), generation=np.int64(rt.generation),
                groups=rt.group_table(layout), world=np.int64(layout.world),
                align_launch=np.int64(align_launch))


def _out_list(out_shape):
    if isinstance(out_shape, (list, tuple)):
        return [jax.ShapeDtypeStruct(s.shape, s.dtype) for s in out_shape], True
    return [jax.ShapeDtypeStruct(out_shape.shape, out_shape.dtype)], False


@functools.lru_cache(maxsize=None)
def _jax_triton():
    try:
        import jax_triton  # imported lazily: it refuses to import without a GPU jaxlib
    except ImportError as e:
        raise ImportError("jaxtdist on GPUs needs jax-triton>=0.3.1 "
                          "(pip install 'jaxtdist[gpu]')") from e
    params = inspect.signature(jax_triton.triton_call).parameters
    out_kw = "out_shape" if "out_shape" in params else "out_type"
    return jax_triton, out_kw


def _gpu_launch(kernel, args, outs, grid, num_warps, num_stages, constexprs):
    jt, out_kw = _jax_triton()
    return jt.triton_call(*args, kernel=kernel, grid=grid, num_warps=num_warps,
                          num_stages=num_stages, **{out_kw: outs}, **constexprs)


def _cpu_launch(rt: Runtime, kernel, args, outs, grid, constexprs):
    from jaxtdist.interpret import kernel_reference
    ref = kernel_reference(kernel)
    array_idx = [i for i, a in enumerate(args) if not isinstance(a, (bool, int, float))]
    arrays = [args[i] for i in array_idx]
    out_specs = [(tuple(o.shape), np.dtype(o.dtype)) for o in outs]
    pool = rt.heap.workers
    grid = tuple(grid) if isinstance(grid, (tuple, list)) else (int(grid),)

    def host(*values):
        if runtime() is not rt:
            raise JaxtdistError("jaxtdist: this program was traced for an earlier jaxtdist "
                                "runtime (initialize or shutdown ran since); trace it again")
        full = list(args)
        for i, v in zip(array_idx, values):
            full[i] = np.asarray(v)
        ctx = full[0].view(np.int64)
        position = int(ctx[L.CTX_POSITION])
        results, timed_out = pool.run(position, ref, grid, full, out_specs, constexprs)
        if timed_out:
            message = rt._native.recorded_timeout(position)
            raise WaitTimeoutError(message.replace("in an earlier call ", ""))
        return tuple(results)

    return list(io_callback(host, tuple(outs), *arrays, ordered=False))


def varying_axes(value: jax.Array) -> frozenset | None:
    """Manual mesh axes ``value`` varies over (None with jax that does not track them)."""
    aval = jax.typeof(value)
    if hasattr(aval, "manual_axis_type"):  # jax 0.10
        return frozenset(aval.manual_axis_type.varying)
    if hasattr(aval, "vma"):  # jax 0.7 - 0.9, 0.11
        return frozenset(aval.vma)
    return None


def mark_varying(value: jax.Array, axes: Sequence[str]) -> jax.Array:
    """Types a kernel output as varying over the manual ``axes`` (it differs per device).

    Custom calls carry no varying-manual-axes type; without this, shard_map's
    type checks and autodiff would treat per-device results as replicated.
    """
    have = varying_axes(value)
    if have is None:
        return value
    missing = tuple(a for a in axes if a not in have)
    if not missing:
        return value
    return jax.lax.pcast(value, missing, to="varying")


def match_cotangent(ct: jax.Array, primal: jax.Array) -> jax.Array:
    """Gives a cotangent the varying axes of its primal.

    Over axes where the cotangent varies but the primal is replicated, the
    primal was implicitly broadcast, so its cotangent is the sum (psum).
    """
    have, want = varying_axes(ct), varying_axes(primal)
    if have is None or want is None:
        return ct
    extra = tuple(sorted(have - want))
    if extra:
        ct = jax.lax.psum(ct, extra)
    return mark_varying(ct, tuple(sorted(want)))


def aligns_at_launch(rt: Runtime, args: Sequence = (), needs_scratch: bool = False) -> bool:
    """Whether jaxtdist's own launcher runs a kernel with ``args`` on GPUs, and so
    its launch, not the prologue, holds the call's launch rendezvous.

    The native launcher runs a kernel always with ``needs_scratch``, else with
    the runtime's "native" launcher and no Python scalar among ``args`` (it
    takes arrays only); its handler launches right after the rendezvous.
    jax-triton's launch is a custom call of its own, so the prologue holds the
    rendezvous then. Ops pass ``align_launch=not aligns_at_launch(...)`` to
    ``prologue`` and the call's layout and workspace to ``launch``
    (``align_with``).
    """
    arrays_only = not any(isinstance(a, (bool, int, float, np.number)) for a in args)
    return rt.platform == "gpu" and (needs_scratch or (rt.launcher == "native" and arrays_only))


def launch(kernel, ctx: jax.Array, *args: Any, out_shape, grid: int | Sequence[int],
           num_warps: int = 4, num_stages: int = 3, needs_scratch: bool = False,
           align_with: tuple[Layout, Workspace] | None = None, **constexprs):
    """Runs ``kernel[grid](ctx, *args, *outputs, **constexprs)`` on the runtime's backend.

    On GPUs, jaxtdist's own launcher runs it when the runtime's ``launcher``
    is "native" and every argument is an array (it takes no scalars), and
    always when ``needs_scratch``: the kernel uses Triton's global scratch
    (device-side TMA descriptors). jax-triton runs it otherwise.

    ``align_with``: the (layout, workspace) of the call's prologue; the native
    launch then holds the call's launch rendezvous.
    """
    rt = runtime()
    outs, many = _out_list(out_shape)
    full_args = (ctx,) + tuple(args)
    if aligns_at_launch(rt, args, needs_scratch):
        from jaxtdist.runtime import _cuda_launch as _native_launch
        rendezvous = None
        if align_with is not None:
            layout, ws = align_with
            rendezvous = (ws.counter_id, rt.group_table(layout), layout.world)
        result = _native_launch.launch(rt, kernel, full_args, outs, grid, num_warps, num_stages,
                                       constexprs, rendezvous)
    elif rt.platform == "gpu":
        result = _gpu_launch(kernel, full_args, outs, grid, num_warps, num_stages, constexprs)
        result = list(result) if isinstance(result, (list, tuple)) else [result]
    else:
        result = _cpu_launch(rt, kernel, full_args, outs, grid, constexprs)
    result = [mark_varying(r, rt.mesh.axis_names) for r in result]
    record_output(rt, result[0])
    return result if many else result[0]


def record_output(rt: Runtime, value: jax.Array) -> None:
    """Makes ``value`` the one the next jaxtdist op of this trace runs after."""
    rt.last_traced_output = (_current_trace(), value)
