"""One order for the jaxtdist calls of a lowered block.

Data orders an op's prologue after the previous jaxtdist call of its trace
(``ops._protocol.program_order_deps``). Calls traced in nested traces that have
ended leave no record there: the calls of two ``jax.checkpoint`` bodies with no
data between them, or of a layer's forward and of the backward of another, were
unordered, and on CPU (whose runtime runs independent work concurrently) devices
ran them in different orders: wrong values and timed-out waits.

Lowering sees every call. The equations of one block (a shard_map body, with the
bodies of checkpoint, custom_vjp, custom_vmap and, inside a shard_map, nested
jits and ``lax.map`` bodies lowered in place) lower in one order, the same on
every device, so each prologue also takes the result of the block's previous
call as an operand (its handler ignores operands past its own). A call in a
nested region (a loop body, a branch) counts, for the blocks around it, as the op
holding that region; the region's first call takes the call before that op (a
value from around the region, which XLA passes in). Outside a shard_map, a
function holding calls counts as the call of it.

Example (what a prologue's lowering does)::

    ctx, operands = after_previous_call(ctx, operands)
    outs = rule(ctx, *operands)
    record_call(ctx.module_context, outs, ctx.avals_out)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core
from jax.interpreters import ad, mlir
from jaxlib.mlir import ir

from jaxtdist.runtime._identity import identity_primitive

__all__ = ["after_previous_call", "call_done", "record_call", "register_per_site"]

_CALLS_KEY = object()  # the module's {block: [[(a result of a call, its aval)], ...]}


_HOLDS_KEY = object()  # the module's {id(jaxpr): (jaxpr, whether it holds a call)}


def _block_calls(module_context) -> dict:
    # ModuleContext has slots; its per-module dict of cached lowerings carries ours.
    return module_context.cached_primitive_lowerings.setdefault(_CALLS_KEY, {})


def _operation(op) -> ir.Operation:
    return getattr(op, "operation", op)


def _tensor_type(type_) -> ir.RankedTensorType | None:
    try:
        return ir.RankedTensorType(type_)
    except ValueError:
        return None


def _elements(shape) -> int:
    return int(np.prod(shape, dtype=np.int64))


def record_call(module_context, outs: Sequence, avals: Sequence, *, every: bool = False):
    """Makes the smallest of a call's results (``outs``, lowered values, with their
    ``avals``; all of them with ``every``) what the block's next prologue takes, and
    in the blocks around it, the results of the ops holding its region."""
    values = [(v, a) for v, a in zip(outs, avals)
              if isinstance(v, ir.Value) and hasattr(a, "shape")]
    if not values:
        return
    calls = _block_calls(module_context)
    block = ir.InsertionPoint.current.block
    calls.setdefault(block, []).append(values if every else [min(
        values, key=lambda va: _elements(va[1].shape) * jnp.dtype(va[1].dtype).itemsize)])
    while True:  # out through the ops holding the region, up to the function
        holder = block.owner
        # All of them: XLA folds the ones it can (a loop's counter after the loop),
        # and a constant orders nothing. Only an operand's shape is read (its
        # layout): any dtype serves.
        results = [(r, jax.core.ShapedArray(tuple(t.shape), jnp.int8))
                   for r in getattr(holder, "results", ())
                   if (t := _tensor_type(r.type)) is not None and t.has_static_shape]
        if not results:
            return
        block = holder.operation.block
        calls.setdefault(block, []).append(results)


# Regions whose ops may use values defined around them (XLA passes those in).
_OPEN_REGIONS = ("stablehlo.while", "stablehlo.case", "stablehlo.if")


def after_previous_call(ctx, operands: Sequence):
    """``(ctx, operands)`` with the results of the block's previous call appended
    (a prologue's lowering); in a loop body or branch with none yet, those of the
    call before the op holding it."""
    calls = _block_calls(ctx.module_context)
    block = ir.InsertionPoint.current.block
    entries = calls.get(block, [])
    while not entries and block.owner is not None and \
            block.owner.operation.name in _OPEN_REGIONS:
        holder = block.owner.operation
        block = holder.block
        # Not the holder's own results (recorded from a sibling branch): they do
        # not exist inside it.
        entries = [e for e in calls.get(block, [])
                   if all(_operation(v.owner) != holder for v, _ in e)]
    previous = entries[-1] if entries else ()
    return (ctx.replace(avals_in=(*ctx.avals_in, *(a for _, a in previous))),
            (*operands, *(v for v, _ in previous)))


# The primitives whose lowerings record calls (``register_per_site``).
_CALL_PRIMITIVES: set = set()


def register_per_site(prim: jex_core.Primitive, rule: Callable, platform: str | None = None):
    """Registers the lowering rule of a jaxtdist call primitive, run at every call
    site: JAX (0.10 on) may lower an equation once into a function and inline
    copies of it, hiding the other sites from ``record_call``."""
    _CALL_PRIMITIVES.add(prim)
    try:
        mlir.register_lowering(prim, rule, platform=platform, cacheable=False)
    except TypeError:  # pragma: no cover - jax without lowering caches
        mlir.register_lowering(prim, rule, platform=platform)


def _lower_bodies_in_place() -> None:
    """JAX (0.10 on) lowers each equation holding a jaxpr into a function of its own
    and inlines a copy: the calls in it would not see the block they end up in.
    Lowered in place, they do; the HLO is the same."""
    try:
        from jax._src import custom_batching, shard_map
        from jax._src.interpreters import mlir as mlir_internal
        from jax.extend.core import primitives
        uncached = mlir_internal._uncacheable_primitives
    except (ImportError, AttributeError):  # pragma: no cover - jax without the cache
        return
    for module, name in ((primitives, "cond_p"), (primitives, "while_p"),
                         (primitives, "scan_p"), (primitives, "remat_p"),
                         (primitives, "custom_jvp_call_p"), (primitives, "custom_vjp_call_p"),
                         (custom_batching, "custom_vmap_p"), (shard_map, "shard_map_p")):
        if hasattr(module, name):
            uncached.add(getattr(module, name))


def _holds_calls(jaxpr, seen: dict) -> bool:
    """Whether ``jaxpr`` (or one nested in it) holds a jaxtdist call; ``seen``: the
    module's answers so far (nested functions are asked about once)."""
    from jax._src import core
    if id(jaxpr) not in seen:
        seen[id(jaxpr)] = (jaxpr, any(
            eqn.primitive in _CALL_PRIMITIVES
            or any(_holds_calls(j, seen) for j in core.jaxprs_in_params(eqn.params))
            for eqn in jaxpr.eqns))
    return seen[id(jaxpr)][1]


def _order_function_calls() -> None:
    """A function holding calls (a nested jit, lax.map's body), called inside a
    shard_map, is lowered in place, its calls in the caller's block and ordered both
    ways (XLA inlines it anyway: within a shard_map every axis is manual, so its
    shardings say nothing). Elsewhere, its call counts as a call for the block
    that calls it, ordered before the calls after it."""
    try:
        from jax._src.interpreters import mlir as mlir_internal
        from jax.extend.core import primitives
    except ImportError:  # pragma: no cover - other jax
        return
    for name in ("jit_p", "closed_call_p", "call_p"):
        prim = getattr(primitives, name, None)
        entry = mlir_internal._lowerings.get(prim)
        if entry is None or getattr(entry.rule, "_jaxtdist_ordered", False):
            continue

        def rule(ctx, *args, _original=entry.rule, **params):
            body = params.get("jaxpr", params.get("call_jaxpr"))
            jaxpr, consts = (body.jaxpr, body.consts) if hasattr(body, "consts") else (body, ())
            seen = ctx.module_context.cached_primitive_lowerings.setdefault(_HOLDS_KEY, {})
            if jaxpr is None or not _holds_calls(jaxpr, seen):
                return _original(ctx, *args, **params)
            manual = getattr(ctx.module_context.axis_context, "manual_axes", ())
            if manual and len(consts) == len(jaxpr.constvars):
                consts = [mlir_internal.ir_constant(np.asarray(c)) for c in consts]
                outs, tokens = mlir_internal.jaxpr_subcomp(
                    ctx.module_context, jaxpr, ctx.name_stack, ctx.tokens_in, consts, *args,
                    dim_var_values=ctx.dim_var_values, const_lowering=ctx.const_lowering,
                    outer_traceback=ctx.traceback)
                ctx.set_tokens_out(tokens)
                return list(outs)
            outs = _original(ctx, *args, **params)
            # One value per output, as a 1-tuple.
            record_call(ctx.module_context, [
                o[0] if isinstance(o, (tuple, list)) and len(o) == 1 else o
                for o in outs], ctx.avals_out, every=True)
            return outs

        rule._jaxtdist_ordered = True
        mlir_internal._lowerings[prim] = mlir_internal.LoweringRuleEntry(rule, entry.inline)
        mlir_internal._uncacheable_primitives.add(prim)  # runs at every site


_lower_bodies_in_place()
_order_function_calls()

# Kernels launched by another library's custom call (jax-triton): their outputs go
# through this identity, whose lowering records them.
_call_done_p = identity_primitive("jaxtdist_call_done")
ad.primitive_jvps[_call_done_p] = lambda primals, tangents: (_call_done_p.bind(*primals),
                                                             list(tangents))


def _call_done_lowering(ctx, *values):
    record_call(ctx.module_context, values, ctx.avals_in)
    return list(values)


register_per_site(_call_done_p, _call_done_lowering)


def call_done(outputs: Sequence[jax.Array]) -> list[jax.Array]:
    """``outputs`` of a kernel launched by another library's custom call, unchanged;
    the block's next prologue runs after that kernel."""
    return list(_call_done_p.bind(*outputs))
