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

On CPU, where the interpreter's host callbacks carry an effect anyway,
``ffi_call`` is ``jax.ffi.ffi_call`` with ``has_side_effect=True``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core
from jax.interpreters import mlir

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
def _abstract_eval(*avals, target_name, results, aliases, attributes):
    del avals, target_name, aliases, attributes
    return [jax.core.ShapedArray(shape, jnp.dtype(dtype)) for shape, dtype in results]


def _lowering(ctx, *operands, target_name, results, aliases, attributes):
    del results
    rule = jax.ffi.ffi_lowering(target_name, has_side_effect=True,
                                operand_output_aliases=dict(aliases))
    return rule(ctx, *operands, **{name: _thaw(v) for name, v in attributes})


for _platform in ("cuda", "rocm"):
    mlir.register_lowering(_ffi_call_p, _lowering, platform=_platform)


def _keep(used_outputs, eqn):
    """DCE rule: the call runs even when nothing reads its outputs (a kernel
    that only signals peers, say)."""
    del used_outputs
    return [True] * len(eqn.invars), eqn


if _pe is not None and hasattr(_pe, "dce_rules"):
    _pe.dce_rules[_ffi_call_p] = _keep


def ffi_call(target_name: str, result_shape_dtypes, *, platform: str,
             input_output_aliases: Mapping[int, int] | None = None) -> Callable:
    """Like ``jax.ffi.ffi_call(target_name, result_shape_dtypes, has_side_effect=True,
    input_output_aliases=...)``, with no JAX effect on GPUs (see the module doc).

    Returns a function of the operands and the attributes (ints and int64 arrays).

    Example (a handler registered for the GPU, with one int32 result)::

      call = ffi_call("my_target", jax.ShapeDtypeStruct((4,), jnp.int32), platform="gpu")
      out = call(x, step=np.int64(0))
    """
    if platform != "gpu":
        return jax.ffi.ffi_call(target_name, result_shape_dtypes, has_side_effect=True,
                                input_output_aliases=input_output_aliases)
    several = isinstance(result_shape_dtypes, Sequence)
    specs = list(result_shape_dtypes) if several else [result_shape_dtypes]
    # By name: numpy spells bfloat16 "|V2".
    results = tuple((tuple(s.shape), jnp.dtype(s.dtype).name) for s in specs)
    aliases = tuple(sorted((input_output_aliases or {}).items()))

    def call(*operands, **attributes):
        outs = _ffi_call_p.bind(
            *operands, target_name=target_name, results=results, aliases=aliases,
            attributes=tuple(sorted((name, _freeze(v)) for name, v in attributes.items())))
        return list(outs) if several else outs[0]

    return call
