"""FFI calls that XLA keeps as side effects, without a JAX effect.

``jax.ffi.ffi_call(..., has_side_effect=True)`` also gives the call a JAX
effect, and jit runs an executable with any effect through Python instead of
its C++ dispatch path: tens of microseconds more host time per call, which
back-to-back ag_matmul calls pay in full (docs/perf, run BE). jaxtdist's
handlers need no JAX effect: data orders them (each takes the kernel context
the previous one returns, and every prologue takes the previous op's output,
``ops._protocol.program_order_deps``). XLA still sees ``has_side_effect``, so it never
drops, merges, hoists or repeats one of them, and a DCE rule keeps JAX from
dropping a call whose outputs go unused. One case is not covered: a nested
jit or shard_map none of whose outputs is used is dropped whole, calls and
all, as JAX drops any effect-free call.

Being effect-free is also what lets JAX transformations treat the calls as
ordinary computations: ``jax.checkpoint`` recomputes them (every device
recomputes the same calls in the same order, so epochs stay in step), and
``lax.scan``/``lax.map`` bodies may hold them. The CPU backend's kernels run
through ``host_kernel``, a primitive of the same kind around a host callback.
Neither has a derivative: ops differentiate through their own custom rules
(``ops._op``), and differentiating a kernel itself raises ``no_derivative``'s
error.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core
from jax.interpreters import ad, mlir

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
def _abstract_eval(*avals, target_name, results, aliases, attributes, op):
    del avals, target_name, aliases, attributes, op
    return [jax.core.ShapedArray(shape, jnp.dtype(dtype)) for shape, dtype in results]


def _lowering(ctx, *operands, target_name, results, aliases, attributes, op):
    del results, op
    rule = jax.ffi.ffi_lowering(target_name, has_side_effect=True,
                                operand_output_aliases=dict(aliases))
    return rule(ctx, *operands, **{name: _thaw(v) for name, v in attributes})


for _platform in ("cpu", "cuda", "rocm"):
    mlir.register_lowering(_ffi_call_p, _lowering, platform=_platform)


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
             input_output_aliases: Mapping[int, int] | None = None, op: str = "") -> Callable:
    """Like ``jax.ffi.ffi_call(target_name, result_shape_dtypes, has_side_effect=True,
    input_output_aliases=...)``, with no JAX effect (see the module doc). ``op``
    names the jaxtdist op in errors; ``platform`` is kept for callers' clarity (the
    target is registered per platform).

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
            op=op)
        return list(outs) if several else outs[0]

    return call


# -- host kernels (the CPU backend) ----------------------------------------------

_host_kernel_p = jex_core.Primitive("jaxtdist_host_kernel")
_host_kernel_p.multiple_results = True


@_host_kernel_p.def_abstract_eval
def _host_abstract_eval(*avals, callback, results, op):
    del avals, callback, op
    return [jax.core.ShapedArray(shape, jnp.dtype(dtype)) for shape, dtype in results]


def _host_lowering(ctx, *operands, callback, results, op):
    del op
    from jax.experimental import io_callback

    shapes = tuple(jax.ShapeDtypeStruct(shape, jnp.dtype(dtype)) for shape, dtype in results)

    def body(*args):
        return list(io_callback(callback, shapes, *args, ordered=False))

    return mlir.lower_fun(body, multiple_results=True)(ctx, *operands)


mlir.register_lowering(_host_kernel_p, _host_lowering, platform="cpu")
ad.primitive_jvps[_host_kernel_p] = lambda primals, tangents, **params: no_derivative(
    "the kernel", params["op"])(primals, tangents)
if _pe is not None and hasattr(_pe, "dce_rules"):
    _pe.dce_rules[_host_kernel_p] = _keep


def host_kernel(callback: Callable, result_shape_dtypes: Sequence, *operands, op: str = ""):
    """``io_callback(callback, result_shape_dtypes, *operands)`` as an effect-free
    primitive that XLA still keeps as a side effect (see the module doc)."""
    results = tuple((tuple(s.shape), jnp.dtype(s.dtype).name) for s in result_shape_dtypes)
    return list(_host_kernel_p.bind(*operands, callback=callback, results=results, op=op))
