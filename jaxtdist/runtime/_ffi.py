"""FFI calls that XLA keeps as side effects, without a JAX effect.

``jax.ffi.ffi_call(..., has_side_effect=True)`` also gives the call a JAX
effect, and jit runs an executable with any effect through Python instead of
its C++ dispatch path: tens of microseconds more host time per call, which
back-to-back ag_matmul calls pay in full (docs/perf, run BE). jaxtdist's
handlers need no JAX effect: data orders them (each takes the kernel context
the previous one returns, and every prologue takes the previous op's output,
``ops._protocol.program_order_deps``). XLA still sees ``has_side_effect``, so it never
drops, merges, hoists or repeats one of them, and a DCE rule keeps JAX from
dropping a call whose outputs go unused. Calls that data does not order (in
separate ``jax.checkpoint`` bodies, say) are ordered as they are lowered
(``_call_order``). One case is not covered: a nested
jit or shard_map none of whose outputs is used is dropped whole, calls and
all, as JAX drops any effect-free call.

Being effect-free is also what lets JAX transformations treat the calls as
ordinary computations: ``jax.checkpoint`` recomputes them (every device
recomputes the same calls in the same order, so epochs stay in step), and
``lax.scan``/``lax.map`` bodies may hold them. The CPU backend's kernels run
through ``host_kernel``, a primitive of the same kind around a native handler
that calls back into Python.
Neither has a derivative: ops differentiate through their own custom rules
(``ops._op``), and differentiating a kernel itself raises ``no_derivative``'s
error.
"""

from __future__ import annotations

import ctypes
import itertools
from collections.abc import Callable, Hashable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core
from jax.interpreters import ad

from jaxtdist._errors import runtime_status
from jaxtdist.runtime import _call_order

try:  # no public API registers a DCE rule (jax 0.10, 0.11)
    from jax._src.interpreters import partial_eval as _pe
except ImportError:  # pragma: no cover
    _pe = None

_ffi_call_p = jex_core.Primitive("jaxtdist_ffi_call")
_ffi_call_p.multiple_results = True


def _freeze(value):
    """A hashable primitive parameter for an attribute (int or int64 array)."""
    if isinstance(value, np.ndarray):
        return ("array", str(value.dtype), tuple(value.reshape(-1).tolist()))
    return ("scalar", np.asarray(value).dtype.name, np.asarray(value).item())


def _thaw(frozen):
    kind, dtype, value = frozen
    if kind == "array":
        return np.asarray(value, dtype)
    return np.asarray(value, dtype)[()]


@_ffi_call_p.def_abstract_eval
def _abstract_eval(*avals, target_name, results, aliases, attributes, op, after_calls,
                   devices):
    del avals, target_name, aliases, attributes, op, after_calls, devices
    return [jax.core.ShapedArray(shape, jnp.dtype(dtype)) for shape, dtype in results]


def device_ids(mesh) -> tuple:
    """(shape, device ids in mesh order) of a mesh: what ``ffi_call``'s ``devices``
    takes."""
    ids = np.vectorize(lambda d: d.id, otypes=[np.int64])(mesh.devices)
    return tuple(ids.shape), tuple(int(i) for i in ids.reshape(-1))


def _nested(devices: tuple) -> list:
    shape, ids = devices
    return np.asarray(ids).reshape(shape).tolist()


def _check_devices(ctx, op: str | None, devices: tuple | None) -> None:
    """A ``ValueError`` when the shard_map being lowered runs on other devices, or
    the same ones in another order, than ``devices`` (the initialized mesh's,
    ``device_ids``): its axes and sizes may match (what tracing checks), but the
    heaps, and each position's rank in the kernels, belong to that mesh."""
    mesh = getattr(ctx.module_context.axis_context, "mesh", None)
    if devices is None or not isinstance(mesh, jax.sharding.Mesh):
        return  # an abstract mesh (no devices to compare), or nothing to compare with
    have = device_ids(mesh)
    if have != devices:
        raise ValueError(
            f"jaxtdist.{op or 'call'}: the shard_map's mesh has devices {_nested(have)}, the "
            f"mesh given to jaxtdist.initialize has {_nested(devices)} (device ids, in mesh "
            "order); the heaps and ranks belong to the initialized mesh: shard_map over that "
            "mesh, or jaxtdist.shutdown() and jaxtdist.initialize(mesh) with this one")


def _lowering(ctx, *operands, target_name, results, aliases, attributes, op, after_calls,
              devices):
    del results
    _check_devices(ctx, op, devices)
    if after_calls:
        ctx, operands = _call_order.after_previous_call(ctx, operands)
    rule = jax.ffi.ffi_lowering(target_name, has_side_effect=True,
                                operand_output_aliases=dict(aliases))
    outs = rule(ctx, *operands, **{name: _thaw(v) for name, v in attributes})
    _call_order.record_call(ctx.module_context, outs, ctx.avals_out)
    return outs


for _platform in ("cpu", "cuda", "rocm"):
    _call_order.register_per_site(_ffi_call_p, _lowering, platform=_platform)


def no_derivative(what: str, op: str):
    """A JVP rule for a primitive that has none: an error naming the op."""

    def jvp(primals, tangents, **params):
        del primals, tangents, params
        raise TypeError(
            f"jaxtdist.{op or 'op'}: {what} has no derivative of its own. jaxtdist ops are "
            "differentiable once, through their custom backward passes (jax.grad, jax.vjp); "
            "differentiating again (grad of grad, jax.hessian), forward mode (jax.jvp, "
            "jax.jacfwd) and differentiating a kernel called directly (triton_call, "
            "ag_matmul_with_gathered) are not supported. See docs/errors.md.")

    return jvp


def _ffi_jvp(primals, tangents, **params):
    return no_derivative(f"the native call {params['target_name']}", params["op"])(
        primals, tangents)


ad.primitive_jvps[_ffi_call_p] = _ffi_jvp


def _keep(used_outputs, eqn):
    """DCE rule: the call runs even when nothing reads its outputs (a kernel
    that only signals peers, say)."""
    del used_outputs
    return [True] * len(eqn.invars), eqn


if _pe is not None and hasattr(_pe, "dce_rules"):
    _pe.dce_rules[_ffi_call_p] = _keep


def ffi_call(target_name: str, result_shape_dtypes, *, platform: str = "gpu",
             input_output_aliases: Mapping[int, int] | None = None, op: str = "",
             after_calls: bool = False, devices: tuple | None = None) -> Callable:
    """Like ``jax.ffi.ffi_call(target_name, result_shape_dtypes, has_side_effect=True,
    input_output_aliases=...)``, with no JAX effect (see the module doc). ``op``
    names the jaxtdist op in errors; ``platform`` is kept for callers' clarity (the
    target is registered per platform). ``after_calls``: the call also takes the
    result of the previous jaxtdist call lowered in its block as a last operand
    (a prologue: ``_call_order``). ``devices``: the initialized mesh's
    (``device_ids``); a shard_map over other devices is refused when lowered.

    Returns a function of the operands and the attributes (ints and int64 arrays).

    Example (a handler registered for the GPU, with one int32 result)::

      call = ffi_call("my_target", jax.ShapeDtypeStruct((4,), jnp.int32), op="my_op")
      out = call(x, step=np.int64(0))
    """
    del platform
    several = isinstance(result_shape_dtypes, Sequence)
    specs = list(result_shape_dtypes) if several else [result_shape_dtypes]
    # By name: numpy spells bfloat16 "|V2".
    results = tuple((tuple(s.shape), jnp.dtype(s.dtype).name) for s in specs)
    aliases = tuple(sorted((input_output_aliases or {}).items()))

    def call(*operands, **attributes):
        outs = _ffi_call_p.bind(
            *operands, target_name=target_name, results=results, aliases=aliases,
            attributes=tuple(sorted((name, _freeze(v)) for name, v in attributes.items())),
            op=op, after_calls=bool(after_calls), devices=devices)
        return list(outs) if several else outs[0]

    return call


# -- host kernels (the CPU backend) ----------------------------------------------
#
# The CPU backend runs a kernel from the native handler jaxtdist_host_kernel
# (csrc/ffi_host_kernel.cc), which calls ``_dispatch`` with the GIL held. Not
# io_callback: XLA reports a callback's exception as "INTERNAL: CpuCallback
# error calling callback: Traceback ...", with jaxtdist's error at the end of a
# Python traceback, while the handler reports the error's own status and
# message ("DEADLINE_EXCEEDED: jaxtdist.WaitTimeoutError: ..."), as on GPUs.

HOST_KERNEL_TARGET = "jaxtdist_host_kernel"

_host_kernel_p = jex_core.Primitive("jaxtdist_host_kernel")
_host_kernel_p.multiple_results = True

# {id: (callable, operand (shape, dtype)s, result (shape, dtype)s)}: the callables
# of lowered host kernels, under the id the lowering passed the handler, and
# {owner: ids} for ``release_host_kernels``. Not freed with the executable: JAX
# keeps a lowering's keepalives with the Python executable object, which async
# dispatch may free while XLA still runs the program; an owner (the CPU heap)
# releases its kernels once no call of theirs can run any more.
_host_callbacks: dict[int, tuple[Callable, tuple, tuple]] = {}
_host_owned: dict[Hashable, set[int]] = {}
_host_ids = itertools.count(1)
_dispatch_set_on: object | None = None  # the native module _dispatch was handed to


def release_host_kernels(owner: Hashable) -> None:
    """Forgets the host kernels lowered for ``owner`` (``host_kernel(..., owner=)``):
    programs that still call one fail with ``FAILED_PRECONDITION``. Call it once
    none of them can run any more (the CPU heap does, when it closes)."""
    for key in _host_owned.pop(owner, ()):
        _host_callbacks.pop(key, None)


def _view(address: int, nbytes: int, shape: tuple, dtype: np.dtype) -> np.ndarray:
    """A numpy array over ``nbytes`` of XLA's buffer at ``address`` (no copy; valid
    during the call only)."""
    if nbytes == 0:  # an empty buffer may have no address
        return np.zeros(shape, dtype)
    return np.frombuffer((ctypes.c_char * nbytes).from_address(address), dtype).reshape(shape)


def _store(values: Sequence, rets: Sequence[tuple[int, int]], specs: tuple) -> None:
    """Copies a host kernel's results into XLA's result buffers."""
    if len(values) != len(specs):
        raise TypeError(f"the host kernel returned {len(values)} results, expected {len(specs)}")
    for i, (value, (address, nbytes), (shape, dtype)) in enumerate(zip(values, rets, specs)):
        value = np.asarray(value)
        if value.shape != shape or value.dtype != dtype:
            raise TypeError(f"the host kernel's result {i} is {value.dtype}{list(value.shape)}, "
                            f"expected {np.dtype(dtype)}{list(shape)}")
        np.copyto(_view(address, nbytes, shape, dtype), value)


def _dispatch(key: int, args: Sequence[tuple[int, int]],
              rets: Sequence[tuple[int, int]]) -> tuple[str, str] | None:
    """Runs host kernel ``key`` on the call's buffers (``(address, bytes)`` each).

    Returns:
      None on success, else the status and message the handler reports
      (``_errors.runtime_status``): the error's name and message, no traceback.
    """
    entry = _host_callbacks.get(key)
    if entry is None:  # released: its owner (the runtime) is gone
        return ("FAILED_PRECONDITION",
                "jaxtdist.JaxtdistError: this program was traced for a jaxtdist runtime that "
                f"is gone (its host kernel #{key} was released by jaxtdist.shutdown()); call "
                "jaxtdist.initialize(mesh) and trace it again")
    callback, arg_specs, ret_specs = entry
    try:
        values = []
        for (address, nbytes), (shape, dtype) in zip(args, arg_specs):
            value = _view(address, nbytes, shape, dtype)
            value.flags.writeable = False  # XLA's operand: the kernel must not write it
            values.append(value)
        _store(callback(*values), rets, ret_specs)
    except Exception as e:  # noqa: BLE001 -- every error becomes the call's status
        return runtime_status(e)
    return None


def _native_with_dispatch():
    """The native module, its targets registered and ``_dispatch`` handed to it."""
    global _dispatch_set_on
    from jaxtdist.runtime._native import native

    module = native()
    if _dispatch_set_on is not module:
        if not hasattr(module, "set_host_kernel_dispatch"):
            raise ImportError(
                f"jaxtdist's native library {getattr(module, '__file__', module)} predates "
                "the CPU host-kernel handler: a stale build. Rebuild it "
                "(`pip install --no-build-isolation -e .`).")
        module.set_host_kernel_dispatch(_dispatch)
        _dispatch_set_on = module
    return module


@_host_kernel_p.def_abstract_eval
def _host_abstract_eval(*avals, callback, results, op, owner):
    del avals, callback, op, owner
    return [jax.core.ShapedArray(shape, jnp.dtype(dtype)) for shape, dtype in results]


def _host_lowering(ctx, *operands, callback, results, op, owner):
    del op
    _native_with_dispatch()
    key = next(_host_ids)
    _host_callbacks[key] = (
        callback,
        tuple((tuple(a.shape), np.dtype(a.dtype)) for a in ctx.avals_in),
        tuple((tuple(shape), np.dtype(jnp.dtype(dtype))) for shape, dtype in results))
    _host_owned.setdefault(owner, set()).add(key)
    rule = jax.ffi.ffi_lowering(HOST_KERNEL_TARGET, has_side_effect=True)
    outs = rule(ctx, *operands, callback=np.int64(key))
    _call_order.record_call(ctx.module_context, outs, ctx.avals_out)
    return outs


_call_order.register_per_site(_host_kernel_p, _host_lowering, platform="cpu")
ad.primitive_jvps[_host_kernel_p] = lambda primals, tangents, **params: no_derivative(
    "the kernel", params["op"])(primals, tangents)
if _pe is not None and hasattr(_pe, "dce_rules"):
    _pe.dce_rules[_host_kernel_p] = _keep


def host_kernel(callback: Callable, result_shape_dtypes: Sequence, *operands, op: str = "",
                owner: Hashable = None):
    """Calls ``callback`` on the host with numpy arrays of ``operands`` (read-only
    views, valid during the call) and returns its results, as an effect-free
    primitive that XLA still keeps as a side effect (see the module doc). CPU only.

    ``callback`` returns one array per ``result_shape_dtypes`` entry, of that shape
    and dtype. An exception it raises fails the program with
    ``jax.errors.JaxRuntimeError`` whose message is the exception's status, name and
    message (``DEADLINE_EXCEEDED: jaxtdist.WaitTimeoutError: ...``; see
    ``_errors.runtime_status``), not a traceback.

    Args:
      callback: the host function.
      result_shape_dtypes: ``jax.ShapeDtypeStruct``-likes of its results.
      *operands: the arrays it receives.
      op: the jaxtdist op, named in errors.
      owner: ``release_host_kernels(owner)`` forgets ``callback`` (and what it
        holds) once no program calling it can run any more; with None it is
        kept for the life of the process.

    Returns:
      The list of results.
    """
    results = tuple((tuple(s.shape), jnp.dtype(s.dtype).name) for s in result_shape_dtypes)
    return list(_host_kernel_p.bind(*operands, callback=callback, results=results, op=op,
                                    owner=owner))
