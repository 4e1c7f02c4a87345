"""The calling protocol: how every op takes a call from arguments to launched kernels.

An op builds one ``Call`` per invocation and goes through it:

1. ``Call(op, axis_name)`` checks the axis against the runtime's mesh and the
   enclosing ``shard_map``, and finds the group layout (rank, world).
2. ``call.workspace(name, nbytes, *key)`` declares a symmetric workspace; the
   runtime allocates it once per key and reuses it on every later call.
3. ``call.start(ws, deps=...)`` runs the prologue: after the op's inputs and
   the previous jaxtdist op of the trace (so every device advances epochs in
   one program order), it advances the workspace's epoch, optionally stages
   a buffer into the heap, and returns the kernel context as device data.
4. ``call.launch(kernel, ctx, *args, ...)`` launches a Triton kernel on the
   runtime's backend (``Runtime.backend``), types its outputs as varying over
   the mesh, and records the output the next op orders itself after.

``call.run(...)`` does 3 and 4 for the common case of one kernel. Kernel
arguments follow jax-triton's order: context, inputs, outputs, constexprs.

Example (an op with one kernel and one workspace)::

    call = Call("my_op", axis_name)
    ws = call.workspace("stage", nbytes, rows, cols, x.dtype.name)
    out = call.run(my_kernel, x, workspace=ws, out_shape=..., grid=(4,), STAGE_OFF=ws.offset)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import config as _jax_config

from jaxtdist.language import _layout as L
from jaxtdist.runtime import _ffi, _native
from jaxtdist.runtime._runtime import Layout, Runtime, Workspace, runtime

CTX_INT32_WORDS = 2 * L.CTX_WORDS


def _abstract_mesh():
    try:
        return jax.sharding.get_abstract_mesh()
    except AttributeError:  # pragma: no cover - older jax
        return None


def same_mesh_axes(mesh, other) -> bool:
    """Whether two meshes (concrete or abstract) have the same axes, in order, of
    the same sizes: what a program traced for one needs of the other."""
    return tuple(mesh.shape.items()) == tuple(other.shape.items())


def check_axis(rt: Runtime, axis_name, op: str) -> Layout:
    """Validates ``axis_name`` against the runtime's mesh and the current shard_map."""
    if axis_name is None:
        raise ValueError(f"jaxtdist.{op}: axis_name is required (a mesh axis name, or a "
                         "tuple of them)")
    layout = rt.layout(axis_name)
    abstract = _abstract_mesh()
    if abstract is not None and not abstract.empty:
        if not same_mesh_axes(abstract, rt.mesh):
            raise ValueError(
                f"jaxtdist.{op}: the shard_map's mesh {dict(abstract.shape)} differs from the "
                f"mesh given to jaxtdist.initialize {dict(rt.mesh.shape)}; initialize with the "
                "mesh you shard_map over")
    return layout


def check_inside_shard_map(rt: Runtime, op: str) -> None:
    """A ``ValueError`` naming ``op`` unless traced inside a shard_map over every
    mesh axis (for ops composed of others, whose first call would name itself)."""
    _mesh_position(rt, op)


def check_outside_shard_map(op: str, inside: str) -> None:
    """A ``ValueError`` naming ``op`` (a pjit-style form, which builds its own
    shard_map) when traced inside a shard_map, and ``inside``, the form to call
    there: nested in the caller's, whose axes are manual already, JAX's error
    names meshes, not the fix."""
    manual = getattr(_abstract_mesh(), "manual_axes", ())
    if manual:
        raise ValueError(
            f"jaxtdist.{op} is the pjit-style form (global arrays, its own shard_map): "
            f"call it under jax.jit outside jax.shard_map; inside shard_map (here, over "
            f"{tuple(manual)}) call jaxtdist.{inside} on the local shards")


def _mesh_position(rt: Runtime, op: str) -> jax.Array:
    """This device's linear position in the mesh, as device data (int32[1])."""
    pos = jnp.zeros((), jnp.int32)
    try:
        for name, size in zip(rt.mesh.axis_names, rt.mesh.devices.shape):
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


# Records kept: one per trace; traces are never marked finished, so old ones go.
_ORDER_RECORDS = 32


@dataclasses.dataclass(frozen=True)
class OrderRecord:
    """The last jaxtdist output traced in ``trace``; ``spec``: (mesh, PartitionSpec)
    when it is a pjit-style wrapper's global result (outside shard_map), else None.
    ``token``: the op's order token (``order_token``), or None."""
    trace: Any
    value: Any
    spec: Any = None
    token: Any = None


def order_record(rt: Runtime) -> OrderRecord | None:
    """The latest record of the current trace. Not of a trace it is nested in: a
    nested body (jit, scan, cond, checkpoint) that took an enclosing trace's value
    would close over it, and JAX caches such bodies by function and shapes, so the
    next program (or the same one at other shapes) reusing the body met a dead
    tracer (UnexpectedTracerError). A body's first call is ordered after the call
    before it when the program is lowered (``runtime._call_order``)."""
    trace = _current_trace()
    for record in reversed(rt.order_records):
        if record.trace is trace:
            return record
    return None


def program_order_deps(rt: Runtime) -> tuple:
    """The previous jaxtdist output of the trace being built (or of a trace it is
    nested in: closed over, JAX passes it in), and its op's order token, if any."""
    record = order_record(rt)
    if record is None or record.spec is not None:
        return ()
    return (record.value,) + (() if record.token is None else (record.token,))


def record_output(rt: Runtime, value: jax.Array, spec: Any = None, token: Any = None) -> None:
    """Makes ``value`` (and the op's order ``token``) the one the next jaxtdist op of
    this trace runs after."""
    if not isinstance(value, jax.core.Tracer):
        return  # run eagerly: dispatch orders it, and a record would hold the array
    trace = _current_trace()
    records = [r for r in rt.order_records if r.trace is not trace][-(_ORDER_RECORDS - 1):]
    rt.order_records = records + [OrderRecord(trace, value, spec, token)]


# -- order tokens -------------------------------------------------------------------
#
# An op's output is not always its last kernel's: differentiated, ag_matmul copies
# the gathered x out of its heap inbox after the GEMM (the backward's residual), and
# a backward pass's last kernel need not make the cotangent that flows on. Only the
# output reaches the next op's prologue, so XLA may run that later kernel after the
# next calls, one of which reuses its inbox (parity epoch % 2, two calls later): a
# silently wrong gradient. Such an op also hands on a token, one element that its
# last kernel's output made; the next op's prologue takes it as an operand too.
# Every op hands one on (custom_vjp's primal and differentiated forward passes
# return the same types); where the output is the last kernel's (every op, not
# differentiated) it is a constant: an operand, no work on the primal path.

ORDER_TOKEN = jax.ShapeDtypeStruct((1,), jnp.float32)


def order_token(rt: Runtime, last: jax.Array | None = None) -> jax.Array:
    """The order token made by ``last`` (a kernel's output), or a constant (None).

    Typed varying over every mesh axis, whatever ``last`` varies over: so that it
    has one type on every path, and its cotangent never needs a psum."""
    if last is None:
        token = jnp.zeros(ORDER_TOKEN.shape, ORDER_TOKEN.dtype)
    else:
        token = last.reshape(-1)[:1].astype(ORDER_TOKEN.dtype)
    return mark_varying(token, tuple(rt.mesh.axis_names))


def _vma_checked() -> bool:
    """Whether the enclosing shard_map types varying axes (``check_vma=True``)."""
    state = getattr(_jax_config, "_check_vma", None)  # shard_map's own flag, not public
    return True if state is None else bool(state.value)


def varying_axes(value: jax.Array) -> frozenset | None:
    """Manual mesh axes ``value`` varies over; None where they are not tracked:
    with jax that does not track them, and under ``shard_map(check_vma=False)``,
    where every value is typed invariant whatever it holds (a cotangent there is
    each rank's own, never the group's sum: treating it as summed gave gradients
    1/world of the true ones)."""
    if not _vma_checked():
        return None
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


def _out_list(out_shape) -> tuple[list[jax.ShapeDtypeStruct], bool]:
    if isinstance(out_shape, (list, tuple)):
        return [jax.ShapeDtypeStruct(s.shape, s.dtype) for s in out_shape], True
    return [jax.ShapeDtypeStruct(out_shape.shape, out_shape.dtype)], False


class Call:
    """One call of a jaxtdist op inside ``shard_map``: see the module docstring.

    Attributes:
      op: the op's name, for error messages and workspace keys.
      rt: the runtime.
      layout: the group layout of ``axis_name`` (``layout.world`` ranks).
    """

    def __init__(self, op: str, axis_name):
        self.op = op
        self.rt = runtime()
        self.layout = check_axis(self.rt, axis_name, op)
        self._ws: Workspace | None = None
        self._launch_holds_rendezvous = False

    @property
    def world(self) -> int:
        return self.layout.world

    @property
    def platform(self) -> str:
        return self.rt.platform

    def workspace(self, name: str, nbytes: int, *key: Any) -> Workspace:
        """The symmetric workspace ``name`` of this op for ``key`` (the sizes its layout
        depends on), allocated on first use; ``HeapExhaustedError`` if it does not fit."""
        return self.rt.workspace((f"{self.op}/{name}", self.layout.axes) + tuple(key), nbytes)

    def launch_aligns(self, args: Sequence = (), needs_scratch: bool = False) -> bool:
        """Whether the backend's launch of a kernel with ``args`` holds the launch
        rendezvous (then the prologue must not)."""
        return self.rt.backend.aligns_at_launch(self.rt.launcher, args, needs_scratch)

    def start(self, ws: Workspace, *, deps: Sequence = (), stage: jax.Array | None = None,
              stage_offset: int = 0, parity_bytes: int = 0,
              align_launch: bool = True) -> jax.Array:
        """Runs the prologue for workspace ``ws``; returns the kernel context.

        The prologue advances ``ws``'s epoch, so it runs after ``deps`` (the
        op's inputs) and after the previous jaxtdist op of the same trace:
        otherwise XLA may order calls differently on different devices (it
        does on CPU), and their epochs would disagree. With ``align_launch``
        (and the runtime's ``align_launches``), the prologue ends with a host
        rendezvous of the group's host threads (``csrc/launch_align.h``); pass
        False when later host work (the launch, a push) holds it.
        ``stage``: a buffer copied into the heap at ``stage_offset + (epoch % 2)
        * parity_bytes`` before the kernel.
        """
        rt = self.rt
        position = _mesh_position(rt, self.op)  # also checks the call is inside shard_map
        if rt.backend.locates_by_device:
            # The handler finds its heap from the device ordinal: a constant spares
            # every call the small XLA kernel that computes the position.
            position = np.zeros((1,), np.int32)
        # The dependencies are operands of the prologue itself: an optimization
        # barrier alone does not survive to XLA's scheduling (on CPU, devices then
        # ran independent prologues in different orders, and calls exchanged data
        # under mismatched epochs). Operands cost nothing: the handler ignores them.
        # Lowering adds one more: the previous call of the lowered program, wherever
        # it was traced (``runtime._call_order``).
        deps = [d for d in tuple(deps) + program_order_deps(rt)
                if isinstance(d, jax.Array) or hasattr(d, "aval")]
        args = [position] + ([stage] if stage is not None else []) + deps
        call = _ffi.ffi_call(_native.PROLOGUE_TARGET,
                             jax.ShapeDtypeStruct((CTX_INT32_WORDS,), jnp.int32), op=self.op,
                             after_calls=True, devices=rt.device_ids)
        self._ws = ws
        self._launch_holds_rendezvous = not align_launch
        return call(*args, template_offset=np.int64(self.layout.template_offset),
                    counter_id=np.int64(ws.counter_id), stage_offset=np.int64(stage_offset),
                    parity_bytes=np.int64(parity_bytes), generation=np.int64(rt.generation),
                    groups=rt.group_table(self.layout), world=np.int64(self.layout.world),
                    align_launch=np.int64(align_launch), stages=np.int64(stage is not None))

    def result_axes(self, *, reduced: Sequence = (), local: Sequence = ()) -> tuple[str, ...]:
        """The mesh axes a result varies over, typed as ``jax.lax``'s collectives type
        theirs: ``local`` inputs count with every axis they vary over (as for
        ``jax.lax.all_gather``, whose result varies over the gathered axes though
        its value is the same on every rank); ``reduced`` inputs are summed over
        the group, so they count without the group's axes (as for
        ``jax.lax.psum``). Pass it as ``launch(..., varying=...)``; mesh axes no
        input varies over stay replicated.

        With jax that does not track varying axes: every mesh axis.
        """
        axes = set()
        for arrays, drop in ((reduced, set(self.layout.axes)), (local, set())):
            for a in arrays:
                have = varying_axes(a)
                if have is None:
                    return tuple(self.rt.mesh.axis_names)
                axes |= set(have) - drop
        return tuple(a for a in self.rt.mesh.axis_names if a in axes)

    def launch(self, kernel, ctx: jax.Array, *args: Any, out_shape, grid: int | Sequence[int],
               num_warps: int = 4, num_stages: int = 3, needs_scratch: bool = False,
               varying: Sequence[str] | None = None, maxnreg: int | None = None,
               **constexprs: Any):
        """Runs ``kernel[grid](ctx, *args, *outputs, **constexprs)`` on the backend.

        ``needs_scratch``: the kernel builds tensor descriptors on the device
        (Triton's global scratch), which only jaxtdist's own launcher provides.
        ``varying``: the mesh axes the outputs vary over (``result_axes``); by
        default every axis (a user kernel may compute anything from its rank).
        ``maxnreg``: a register limit per thread (GPUs: a warp-specialized kernel
        sizes its partitions from it). Returns the output, or a list of them when
        ``out_shape`` is a sequence.
        """
        rt = self.rt
        outs, many = _out_list(out_shape)
        grid = tuple(int(g) for g in grid) if isinstance(grid, (tuple, list)) else (int(grid),)
        rendezvous = None
        if self._launch_holds_rendezvous:
            rendezvous = (self._ws.counter_id, rt.group_table(self.layout), self.layout.world)
            self._launch_holds_rendezvous = False
        result = rt.backend.launch(rt, kernel, (ctx,) + tuple(args), outs, grid, num_warps,
                                   num_stages, constexprs, needs_scratch, rendezvous, op=self.op,
                                   maxnreg=maxnreg)
        varying = tuple(rt.mesh.axis_names) if varying is None else tuple(varying)
        result = [mark_varying(r, varying) for r in result]
        record_output(rt, result[0])
        return result if many else result[0]

    def push_to_peers(self, ctx: jax.Array, x: jax.Array, **layout: int) -> jax.Array:
        """Copy-engine pushes of ``x`` into every peer's inbox (backends with copy
        engines only, see ``CudaHeap.push_to_peers``); they hold the launch
        rendezvous. Returns the context for the kernel that follows."""
        rt = self.rt
        self._launch_holds_rendezvous = False
        return rt.backend.push_to_peers(rt, ctx, x, counter_id=self._ws.counter_id,
                                        groups=rt.group_table(self.layout),
                                        world=self.layout.world, op=self.op, **layout)

    def run(self, kernel, *args: Any, workspace: Workspace, out_shape,
            grid: int | Sequence[int], deps: Sequence | None = None,
            stage: jax.Array | None = None, stage_offset: int = 0, parity_bytes: int = 0,
            num_warps: int = 4, num_stages: int = 3, needs_scratch: bool = False,
            varying: Sequence[str] | None = None, maxnreg: int | None = None,
            **constexprs: Any):
        """``start`` then ``launch``: one kernel after the prologue. ``deps`` defaults
        to the array arguments."""
        if deps is None:
            deps = tuple(a for a in args if isinstance(a, jax.Array))
        ctx = self.start(workspace, deps=deps, stage=stage, stage_offset=stage_offset,
                         parity_bytes=parity_bytes,
                         align_launch=not self.launch_aligns(args, needs_scratch))
        return self.launch(kernel, ctx, *args, out_shape=out_shape, grid=grid,
                           num_warps=num_warps, num_stages=num_stages,
                           needs_scratch=needs_scratch, varying=varying, maxnreg=maxnreg,
                           **constexprs)
