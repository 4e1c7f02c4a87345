"""One mechanism that makes an op differentiable, ordered, local at world 1, and
usable from pjit-style code.

An op declares itself as a ``DistributedOp``: its argument check, its forward
pass (returning the output and the residuals its backward needs), its
backward pass (cotangents of its array arguments, from any code, other ops
included), and optionally its local computation for a group of one rank.
The mechanism supplies the rest, once for every op:

- program order: the call runs after the previous jaxtdist op of the trace
  (``custom_vjp`` traces its body in a trace of its own, so this happens
  outside it) and records its output for the next one, with an order token
  made by its last kernel where that kernel is a later one (a copy-out of an
  inbox: ``_protocol.order_token``), in the backward pass too;
- autodiff: a ``jax.custom_vjp`` whose cotangents get their primal's dtype
  and varying mesh axes (summed over axes where the primal was replicated);
  an op without a backward raises a clear error when differentiated;
- ``jax.vmap``: one whole op call per batch element, in order (a
  ``lax.map``), each with its own epoch;
- world 1: a group of one rank runs the local computation (what the op costs
  without communication), with JAX's own autodiff;
- ``pjit_wrapper(...)``: the op for jit with NamedSharding inputs, no
  hand-written ``shard_map``.

Example (an op whose backward is another op)::

    _op = DistributedOp("my_gather", check=_check, forward=_forward,
                        backward=lambda res, ct, *, axis_name: (
                            jax.lax.psum_scatter(ct, axis_name, tiled=True),),
                        local=lambda x, *, axis_name: x)
    def my_gather(x, axis_name):
        return _op(x, axis_name=axis_name)
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import ad
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxtdist.ops._config import config_dict
from jaxtdist.ops._protocol import (check_axis, check_outside_shard_map, mark_varying,
                                    order_record, order_token, program_order_deps,
                                    record_output, same_mesh_axes, varying_axes)
from jaxtdist.runtime._ffi import no_derivative
from jaxtdist.runtime._identity import identity_primitive
from jaxtdist.runtime._runtime import runtime


try:  # no public API registers a remat (partial-eval) rule (jax 0.10, 0.11)
    from jax._src.interpreters import partial_eval as _pe
except ImportError:  # pragma: no cover
    _pe = None
try:  # nor names vmap's tracer
    from jax._src.interpreters.batching import BatchTracer as _BatchTracer
except ImportError:  # pragma: no cover
    _BatchTracer = ()

def under_vmap(*values) -> bool:
    """Whether any of ``values`` is being batched by jax.vmap (at the innermost
    transformation: inside grad(vmap(f)) too)."""
    return any(isinstance(v, _BatchTracer) for v in values)


# -- run once under jax.checkpoint ------------------------------------------------------
#
# jax.checkpoint recomputes the forward pass of what it wraps inside the backward
# pass. For a jaxtdist call that recomputation is a second collective call on the
# same workspace, traced apart from everything else (JAX traces it in a trace of its
# own), so no data orders it against the first call or against the calls around it:
# XLA may interleave their prologues and kernels, a kernel then runs with another
# call's epoch, flags set to a later epoch are lowered again, and a peer waits for
# ever (2 processes on one GPU: wrong remat gradients, a timed-out wait). JAX never
# recomputes an op with side effects (it saves its outputs); jaxtdist's calls have
# none JAX can see (runtime/_ffi.py says why), so the forward pass marks its results
# with this identity, whose remat rule does what JAX does for side effects: the call
# runs once, in the forward pass, and what the backward needs of it is saved.

_run_once_p = identity_primitive("jaxtdist_run_once")
# An identity to differentiation too: tangents pass through unchanged (differentiating
# the jaxtdist calls that made the values raises their own TypeError, naming them).
ad.primitive_jvps[_run_once_p] = lambda primals, tangents: (_run_once_p.bind(*primals),
                                                            list(tangents))


def _run_once_remat_rule(saveable, unks_in, inst_in, eqn):
    """Partial eval under jax.checkpoint: known inputs stay in the forward pass and
    the outputs become residuals (never recomputed), as for an effectful op."""
    del saveable
    n = len(eqn.outvars)
    if any(unks_in):
        residuals = [v for v, inst in zip(eqn.invars, inst_in)
                     if not inst and isinstance(v, _pe.Var)]
        return None, eqn, [True] * n, [True] * n, residuals
    return eqn, None, [False] * n, [False] * n, []


if _pe is not None and hasattr(_pe, "partial_eval_jaxpr_custom_rules"):
    _pe.partial_eval_jaxpr_custom_rules[_run_once_p] = _run_once_remat_rule


# Values a custom VJP's forward rule marks as differentiable once: an identity whose
# derivative is a TypeError naming the op. The forward rules of a custom VJP are
# differentiated only by second-order autodiff (grad of grad), where a composed op
# (moe_tp_mlp) would otherwise fail inside JAX with an error naming no op.
_first_order_p = identity_primitive("jaxtdist_first_order_only")


def _first_order_jvp(primals, tangents, *, op):
    return no_derivative("its custom backward pass", op)(primals, tangents)


ad.primitive_jvps[_first_order_p] = _first_order_jvp


def first_order_only(op: str, *arrays: jax.Array) -> tuple[jax.Array, ...]:
    """``arrays`` unchanged; differentiating them (inside a custom VJP's forward
    rule: only second-order autodiff does) raises ``TypeError`` naming ``op``."""
    return tuple(_first_order_p.bind(*arrays, op=op))


def run_once(tree):
    """Marks values so that ``jax.checkpoint`` does not recompute the calls that made them.

    jaxtdist's ops mark their own outputs. A ``jax.custom_vjp`` of your own whose
    forward rule calls jaxtdist ops needs it on that rule's outputs: under
    ``jax.checkpoint`` JAX recomputes a custom VJP's forward rule in the backward
    pass, and a recomputed collective is a second call on the same workspace,
    unordered with the others (a timed-out wait, or wrong gradients). The marked
    values are saved for the backward pass instead. To differentiation it is an
    identity (second-order autodiff differentiates through it).

    Args:
      tree: a pytree of arrays.

    Returns:
      The same values.

    Example:
      >>> @jax.custom_vjp
      ... def gather(x):
      ...     return jaxtdist.all_gather(x, "tp")
      >>> def gather_fwd(x):
      ...     return jaxtdist.run_once(gather(x)), None
      >>> gather.defvjp(gather_fwd, lambda _, ct: (jaxtdist.reduce_scatter(ct, "tp"),))
    """
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    arrays = [i for i, leaf in enumerate(leaves) if isinstance(leaf, jax.Array)
              or hasattr(leaf, "aval")]
    if not arrays:
        return tree
    marked = _run_once_p.bind(*(leaves[i] for i in arrays))
    for i, value in zip(arrays, marked):
        leaves[i] = value
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _freeze(value):
    """A hashable form of a static argument (dicts and lists become tuples)."""
    if isinstance(value, dict):
        return ("__dict__",) + tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    if isinstance(value, list):
        return ("__list__",) + tuple(_freeze(v) for v in value)
    return value


def _thaw(value):
    if isinstance(value, tuple) and value and value[0] == "__dict__":
        return {k: _thaw(v) for k, v in value[1:]}
    if isinstance(value, tuple) and value and value[0] == "__list__":
        return [_thaw(v) for v in value[1:]]
    return value


def match_cotangent(ct: jax.Array, primal: jax.Array) -> jax.Array:
    """Gives a cotangent the dtype and varying axes of its primal.

    Over axes where the cotangent varies but the primal is replicated, the
    primal was implicitly broadcast, so its cotangent is the sum (psum).
    """
    ct = ct.astype(primal.dtype)
    have, want = varying_axes(ct), varying_axes(primal)
    if have is None or want is None:
        return ct
    extra = tuple(sorted(have - want))
    if extra:
        ct = jax.lax.psum(ct, extra)
    return mark_varying(ct, tuple(sorted(want)))


def scatter_cotangent(ct: jax.Array, axis_name, scatter_dimension: int = 0,
                      tiled: bool = True) -> jax.Array:
    """This rank's block of the group's sum of ``ct``, the cotangent of a gather.

    Where ``ct`` varies over the group's axes, each rank holds its own part and the
    sum is a reduce-scatter (``psum_scatter``). Where it is typed invariant over
    them, JAX has already summed the ranks' contributions (the cotangent of a
    result typed the same on every rank): the block is a slice, and summing again
    would count every contribution ``world`` times.
    """
    axes = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)
    have = varying_axes(ct)
    if have is None or set(axes) <= set(have):
        return jax.lax.psum_scatter(ct, axis_name, scatter_dimension=scatter_dimension,
                                    tiled=tiled)
    partial = tuple(a for a in axes if a in have)
    if partial:
        ct = jax.lax.psum(ct, partial)
    rank = jax.lax.axis_index(axis_name)
    if not tiled:
        return jax.lax.dynamic_index_in_dim(ct, rank, scatter_dimension, keepdims=False)
    world = 1
    for a in axes:
        world *= jax.lax.axis_size(a)
    size = ct.shape[scatter_dimension] // world
    return jax.lax.dynamic_slice_in_dim(ct, rank * size, size, scatter_dimension)


@dataclasses.dataclass(frozen=True)
class DistributedOp:
    """A jaxtdist op, declared by its parts (see the module docstring).

    Attributes:
      name: the public name (``jaxtdist.<name>``), used in errors.
      forward: ``forward(*arrays, **static) -> (out, residuals)``: the
        distributed computation (through ``_protocol.Call``).
      backward: ``backward(residuals, ct, **static) -> tuple`` of cotangents,
        one per array argument; None: not differentiable.
      check: ``check(*arrays, **static)`` raising ``ValueError`` on bad
        arguments, run before anything else.
      local: ``local(*arrays, **static) -> out``: the computation of a group
        of one rank; None: the forward runs at world 1 too.
      reduces: the result is the group's sum, typed as ``jax.lax.psum``'s
        (replicated over the group's axes), at world 1 too.
      primal: ``primal(*arrays, **static) -> (out, None)``: the forward pass when
        no gradient is taken (residuals that cost work to keep are skipped);
        None: ``forward``, its residuals dropped.
      check_config: ``check_config(*arrays, **static)`` resolving the ``config``
        asked for (``static["config"]``, not None) as the kernels would at world 1,
        raising ``ValueError`` where it does not fit; run where ``local`` runs
        instead of the kernels, so that a bad config (an unknown key, a tile that
        is no power of 2) fails on one device as it would on many. None: nothing
        to check.
    """
    name: str
    forward: Callable[..., tuple[Any, Any]]
    backward: Callable[..., tuple] | None = None
    check: Callable[..., None] | None = None
    local: Callable[..., Any] | None = None
    reduces: bool = False
    primal: Callable[..., tuple[Any, Any]] | None = None
    check_config: Callable[..., None] | None = None

    def __call__(self, *arrays: jax.Array, axis_name, **static: Any):
        if isinstance(axis_name, list):
            axis_name = tuple(axis_name)
        if "config" in static:
            static["config"] = config_dict(self.name, static["config"])
        if self.check is not None:
            self.check(*arrays, axis_name=axis_name, **static)
        rt = runtime()
        layout = check_axis(rt, axis_name, self.name)
        if layout.world == 1 and self.local is not None:
            if self.check_config is not None and static.get("config") is not None:
                self.check_config(*arrays, axis_name=axis_name, **static)
            out = self.local(*arrays, axis_name=axis_name, **static)
            return _typed_as_sum(out, layout.axes) if self.reduces else out
        if not arrays:  # nothing to differentiate: the protocol orders the call itself
            return self.forward(axis_name=axis_name, **static)[0]
        # The previous op's output goes in as an argument, so the prologue takes it
        # as an operand (a data dependency XLA must honour; an optimization barrier
        # around the inputs did not survive to XLA:CPU's scheduling, and devices
        # then ran the calls' prologues in different orders under mismatched epochs).
        # With the previous op's order token (``_protocol.order_token``), second.
        after = program_order_deps(rt)
        frozen = tuple(sorted((k, _freeze(v)) for k, v in dict(static, axis_name=axis_name)
                              .items()))
        after_specs = tuple((tuple(a.shape), jnp.dtype(a.dtype).name, rt.platform, i > 0)
                            for i, a in enumerate(after))
        try:
            out, token = self._vjp(frozen, after_specs, *after, *arrays)
        except TypeError as e:
            # Under jax.jvp JAX refuses the custom VJP without naming the op (and
            # eagerly, inside an eager shard_map, fails with "unhashable type").
            known = "unhashable" in str(e) or "forward-mode" in str(e)
            if not known or not any(isinstance(a, ad.JVPTracer) for a in arrays):
                raise
            raise TypeError(
                f"jaxtdist.{self.name}: forward-mode autodiff (jax.jvp, jax.jacfwd, "
                "jax.linearize) is not supported: jaxtdist's ops define reverse mode "
                "only (jax.grad, jax.vjp). (JAX raised: " + str(e) + ")") from None
        record_output(rt, jax.tree_util.tree_leaves(out)[0], token=token)
        return out

    def forward_with_residuals(self, *arrays: jax.Array, axis_name, **static: Any):
        """The forward pass's (out, residuals), bypassing autodiff (for tuning and tests)."""
        return self.forward(*arrays, axis_name=axis_name, **static)

    @functools.cached_property
    def _vjp(self) -> Callable:
        op = self

        def ordered_forward(frozen, n_after, fn=None):
            # The first ``n_after`` arguments are the previous op's output and order
            # token: the call's prologue runs after them (``program_order_deps``).
            def forward(*args):
                if n_after:
                    record_output(runtime(), args[0], token=args[1] if n_after > 1 else None)
                return (fn or op.forward)(*args[n_after:], **_static(frozen))
            return forward

        @functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
        def call(frozen, after_specs, *args):
            n_after = len(after_specs)
            forward = ordered_forward(frozen, n_after, op.primal)

            def with_token(*a):
                out = forward(*a)[0]
                return out, order_token(runtime(), _later_output(out, a[:n_after]))

            return one_call_per_element(with_token)(*args)

        def fwd(frozen, after_specs, *args):
            n_after = len(after_specs)
            forward = ordered_forward(frozen, n_after)

            def with_last(*a):
                # Also the call's last jaxtdist output (the gathered copy-out of an
                # inbox, say): the next op's prologue and the backward pass run after it.
                out, residuals = forward(*a)
                later = _later_output(out, a[:n_after])
                last = jax.tree_util.tree_leaves(out)[0] if later is None else later
                token = order_token(runtime(), later)
                return (out, token), residuals, _done_token(last, residuals)

            out, residuals, done = run_once(one_call_per_element(with_last)(*args))
            # Of the order tokens only their types (empty slices): no memory held.
            typed = tuple(a.reshape(-1)[:0] for a in args[:n_after])
            return out, (residuals, args[n_after:], typed, done)

        def bwd(frozen, after_specs, saved, cts_out):
            residuals, arrays, typed, done = saved
            ct, ct_token = cts_out
            if op.backward is None:
                raise TypeError(f"jaxtdist.{op.name} is not differentiable here (its "
                                "docstring says where it is, if anywhere); wrap it in a "
                                "jax.custom_vjp of your own to give it a backward pass")
            # The backward's first jaxtdist call runs after the forward call's last
            # one (custom_vjp traces bwd apart, so no record of the forward reaches
            # it) and after the next op's backward (the cotangent of this call's
            # order token). (Not under jax.vmap: one_call_per_element's bodies cannot
            # close over a batched value.)
            ordered = not under_vmap(done, ct_token)
            if ordered:
                record_output(runtime(), done, token=ct_token)
            cts = op.backward(residuals, ct, **_static(frozen))
            cts = tuple(None if c is None else match_cotangent(c, a)
                        for c, a in zip(cts, arrays))
            record = order_record(runtime()) if ordered else None
            launched = record is not None and record.value is not done
            last = record.value if launched else (ct_token if ordered else None)
            return _order_cotangents(after_specs, typed, cts, last) + cts

        call.defvjp(fwd, bwd)
        return call


def _later_output(out, after: Sequence) -> jax.Array | None:
    """The call's last kernel output where it is not ``out``'s (the gathered x copied
    out of an inbox after the GEMM, say): the output of the current trace's latest
    record, unless that is ``out`` or the previous op's (nothing launched)."""
    record = order_record(runtime())
    if record is None or record.spec is not None:
        return None
    last = record.value
    if last is jax.tree_util.tree_leaves(out)[0] or any(last is a for a in after):
        return None
    return last


def _done_token(last: jax.Array, residuals) -> jax.Array:
    """A residual that the forward call's last output produced: that output itself
    when the backward keeps it anyway (no memory), else one element of it."""
    if any(leaf is last for leaf in jax.tree_util.tree_leaves(residuals)):
        return last
    return last.reshape(-1)[:1]


def kernels_at_world_1(rt, axis_name, op: str) -> bool:
    """Whether ``op`` over ``axis_name`` runs its kernels in a group of one rank, for
    ops whose local computation is much slower than their kernels there: on GPUs
    only (under the Triton interpreter the local computation stays, the
    interpreter being slow)."""
    return rt.platform == "gpu" and check_axis(rt, axis_name, op).world == 1


def _typed_as_sum(out: jax.Array, axes: Sequence[str]) -> jax.Array:
    """The local result of a group of one rank, typed as the group's sum is (as
    ``jax.lax.psum`` types it: replicated over ``axes``), so that out_specs that
    leave ``axes`` out accept it as they do at larger worlds. JAX has no cast from
    varying to replicated, so this is a psum over groups of one device: a
    degenerate all-reduce that moves no data."""
    have = varying_axes(out)
    summed = tuple(a for a in axes if have is not None and a in have)
    return jax.lax.psum(out, summed) if summed else out


def _order_cotangents(after_specs: tuple, typed: tuple, cts: tuple,
                      last: jax.Array | None) -> tuple:
    """Cotangents of a call's order arguments (the previous op's output and order
    token): zero, but computed from this call's backward results.

    The backward pass runs the calls' backwards in reverse, and the previous op's
    backward receives these cotangents in its own: so it runs after this call's
    backward on every device. The token's (one element) is made from ``last``,
    the backward's last jaxtdist output, on every platform: a backward may end
    with a kernel that its cotangents do not come from (matmul_rs's copies the
    gathered dy out of an inbox after the GEMM that makes dx), and the previous
    op's backward reuses that inbox. The output's, only on CPU: without it, two
    calls with no data dependence in the backward pass (the backwards of two
    pjit-style wrappers) could run in different orders on different devices
    under XLA:CPU, which runs independent work concurrently.
    """
    if not after_specs:
        return ()
    done = [c for c in cts if c is not None]
    out = []
    for (shape, dtype, platform, is_token), typed_as in zip(after_specs, typed):
        probe = last if is_token and last is not None else _probe(done, typed_as)
        if probe is None or not jnp.issubdtype(jnp.dtype(dtype), jnp.floating) or (
                platform != "cpu" and not is_token):
            out.append(None)
            continue
        probe = probe.reshape(-1)[:1].astype(jnp.float32)
        # 1 (0 for NaN), never known before the backward has run; 0 * it stays 0.
        after_backward = (probe == probe).astype(dtype).reshape(())
        # Typed as the argument before it is broadcast: a sum over the axes the
        # probe varies over and the argument does not adds one element, not an array.
        after_backward = match_cotangent(after_backward, typed_as)
        out.append(match_cotangent(jnp.zeros(shape, dtype) * after_backward, typed_as))
    return tuple(out)


def _probe(cts: list, typed_as: jax.Array) -> jax.Array | None:
    """The cotangent that an order argument's zero cotangent is made from: the
    first that varies over no axis ``typed_as`` does not (the input's, where it
    fits: a weight's, summed over the data-parallel axes, would keep that sum
    alive in a backward that asks only for the input's), else the one that
    varies over the fewest axes."""
    if not cts:
        return None
    want = varying_axes(typed_as)
    for c in cts:
        have = varying_axes(c)
        if want is None or have is None or have <= want:
            return c
    return min(cts, key=lambda c: len(varying_axes(c) or ()))


def one_call_per_element(fn: Callable) -> Callable:
    """``fn`` whose batching rule (``jax.vmap``) calls it once per batch element in
    a ``lax.map``: each element's call is a whole op call with its own prologue,
    epoch and launch, in order, as if the caller had looped. (Batching the
    kernel launches inside one call instead would give B launches one epoch:
    they would race on the same workspace.)

    ``fn`` is traced apart (``custom_vmap``), so its last jaxtdist output is also
    returned and recorded in the caller's trace: the caller's next call runs
    after it, not only after ``fn``'s results (which an earlier kernel may make:
    matmul_rs's backward copies the gathered dy out of an inbox after the GEMM)."""
    def call(*args):
        # The previous output (and token) the body's first call runs after, passed
        # in as arguments, not closed over: a body traced unbatched (a backward
        # under jax.checkpoint) may be batched later, and custom_vmap rejects
        # batched closed-over values.
        deps = program_order_deps(runtime())
        n = len(deps)

        def with_deps(*a):
            if n:
                record_output(runtime(), a[0], token=a[1] if n > 1 else None)
            return fn(*a[n:]), _last_record()

        batched_fn = jax.custom_batching.custom_vmap(with_deps)

        @batched_fn.def_vmap
        def rule(axis_size, in_batched, *a):
            del axis_size
            mapped = tuple(x for x, b in zip(a, in_batched) if b)

            def one(elements):
                it = iter(elements)
                # The custom-batched function again, not with_deps: under an outer
                # jax.vmap this body is batched in turn, and must again become one
                # call per element (nested vmaps).
                return batched_fn(*(next(it) if b else x for x, b in zip(a, in_batched)))

            outs = jax.lax.map(one, mapped)
            return outs, jax.tree_util.tree_map(lambda _: True, outs)

        out, last = batched_fn(*deps, *args)
        # (Not a batched value: later bodies would close over it, which they cannot.)
        if last is not None and not under_vmap(*last):
            record_output(runtime(), last[0], token=last[1])
        return out

    return call


def _last_record():
    """(output, order token) of the current trace's latest record, or None."""
    record = order_record(runtime())
    if record is None or record.spec is not None:
        return None
    return record.value, record.token


def _static(frozen) -> dict:
    return {k: _thaw(v) for k, v in frozen}


def _axes_spec(axes: tuple[str, ...]):
    if not axes:
        return None
    return axes if len(axes) > 1 else axes[0]


def pjit_wrapper(op_fn: Callable, *, name: str,
                 in_specs: Callable[[str, tuple[str, ...]], tuple],
                 out_specs: Callable[[str, tuple[str, ...]], Any],
                 check: Callable[..., None] | None = None) -> Callable:
    """The op ``op_fn`` (called inside shard_map) for pjit-style code.

    ``in_specs(axis_name, batch_axes)`` and ``out_specs(axis_name, batch_axes)``
    give the shardings (``PartitionSpec``s) of the op's arrays over the mesh:
    ``batch_axes`` are data-parallel mesh axes (outermost first) and
    ``axis_name`` the tensor-parallel one. A spec may be a prefix of a pytree
    argument or result (one ``PartitionSpec`` for every leaf of a handle). The
    wrapper takes the op's arrays, ``axis_name``, ``batch_axes``, ``mesh``
    (default: the runtime's) and the op's other keyword arguments.
    ``check(*arrays, axis_name=, batch_axes=, mesh=, **static)`` (optional)
    checks the global arguments, raising ``ValueError``, once the axis names
    are known to be the mesh's.
    """

    def wrapper(*arrays: jax.Array, axis_name: str | Sequence[str],
                batch_axes: str | Sequence[str] = (), mesh=None, **static: Any):
        rt = runtime()
        check_outside_shard_map(name, inside=name.removesuffix("_sharded"))
        if mesh is None:
            mesh = rt.mesh
        elif not isinstance(mesh, jax.sharding.Mesh):
            raise TypeError(f"jaxtdist.{name}: mesh= must be a jax.sharding.Mesh (or left out: "
                            f"the initialized mesh), got {type(mesh).__name__}")
        elif not same_mesh_axes(mesh, rt.mesh):
            raise ValueError(f"jaxtdist.{name}: mesh= {dict(mesh.shape)} differs from the mesh "
                             f"given to jaxtdist.initialize {dict(rt.mesh.shape)}; leave mesh= "
                             "out (the initialized mesh) or initialize with this mesh")
        if batch_axes is None or not isinstance(batch_axes, (str, tuple, list)):
            raise TypeError(f"jaxtdist.{name}: batch_axes must be a mesh axis name or a tuple "
                            f"of them (() for none), got {batch_axes!r}")
        batch_axes = (batch_axes,) if isinstance(batch_axes, str) else tuple(batch_axes)
        # A tuple (or list) of axes is one group, outermost first, as inside shard_map.
        if isinstance(axis_name, (tuple, list)):
            axis_name = tuple(axis_name)
            group = axis_name
        else:
            group = (axis_name,)
        if not group or len(set(group)) != len(group):
            raise ValueError(f"jaxtdist.{name}: axis_name {axis_name!r} must be one mesh axis "
                             "or a tuple of distinct ones")
        if set(group) & set(batch_axes):
            raise ValueError(f"jaxtdist.{name}: axis_name {axis_name!r} is also in "
                             f"batch_axes {batch_axes}")
        for a in batch_axes + group:
            if not isinstance(a, str) or a not in mesh.axis_names:
                raise ValueError(f"jaxtdist.{name}: {a!r} is not an axis of the mesh; its "
                                 f"axes are {tuple(mesh.axis_names)}")
        if check is not None:
            check(*arrays, axis_name=axis_name, batch_axes=batch_axes, mesh=mesh, **static)
        # Separate shard_maps are separate traces: the previous wrapper's result goes
        # in as an argument (in its own sharding: nothing moves), so that this
        # call's prologue runs after it on every device.
        # The order token (``_protocol.order_token``, one element per device) too:
        # the op's last kernel need not make its result (a copy-out after the GEMM).
        previous = order_record(rt)
        after = (previous is not None and previous.spec is not None
                 and previous.spec[0] == mesh)
        every_device = P(tuple(mesh.axis_names))
        token, token_spec = (((previous.value, previous.token),
                              (previous.spec[1], every_device)) if after else ((), ()))

        specs = tuple(in_specs(axis_name, batch_axes))
        # Python lists and numbers, NumPy arrays and scalars as the op itself takes them
        # (shard_map takes none of them on Explicit axes, the first two on none).
        arrays = tuple(jnp.asarray(a) if isinstance(a, (list, int, float, np.ndarray, np.generic))
                       else a for a in arrays)
        _check_ranks(name, arrays, specs)
        _check_divisible(name, mesh, arrays, specs)
        arrays = _placed(mesh, arrays, specs)

        def body(*args):
            if after:
                record_output(rt, args[0], token=args[1])
            try:
                out = op_fn(*args[len(token):], axis_name=axis_name, **static)
            except ValueError as e:
                if type(e) is not ValueError:  # JAX's own subclasses pass unchanged
                    raise
                # The op saw one shard: say how its sizes follow from the caller's.
                raise ValueError(
                    f"{e} [in jaxtdist.{name}: the op sees one shard of each argument, shapes "
                    f"{_shard_shapes(mesh, arrays, specs)} of the global "
                    f"{[_shape_or_type(a) for a in arrays]} (in_specs {list(specs)})]") from None
            return out, _token_of(out, args[:len(token)])

        spec_out = out_specs(axis_name, batch_axes)
        out, out_token = jax.shard_map(body, mesh=mesh, in_specs=token_spec + specs,
                                       out_specs=(spec_out, every_device))(*token, *arrays)
        first, first_spec = (out, spec_out) if isinstance(out, jax.Array) else (
            out[0], spec_out[0])
        record_output(rt, first, spec=(mesh, first_spec), token=out_token)
        return out

    wrapper.__name__ = name
    return wrapper


def _placed(mesh, arrays, specs) -> tuple:
    """The arrays resharded to their specs where the mesh has Explicit axes:
    shard_map takes an argument there only as placed as its spec says, while on
    Auto axes XLA moves it by itself."""
    if all(t != jax.sharding.AxisType.Explicit for t in getattr(mesh, "axis_types", ())):
        return arrays
    # A spec is a prefix of a pytree argument (a handle): every leaf takes it.
    return tuple(jax.tree.map(lambda leaf, s=s: jax.sharding.reshard(leaf, NamedSharding(mesh, s))
                              if isinstance(leaf, jax.Array) else leaf, a)
                 if isinstance(s, P) else a for a, s in zip(arrays, specs))


def _spec_sizes(mesh, spec, ndim: int) -> list[int]:
    """Devices each of ``ndim`` dimensions is split over under ``spec``."""
    entries = tuple(spec) + (None,) * (ndim - len(spec))
    return [mesh_devices(mesh, () if e is None else (e,) if isinstance(e, str) else e)[0]
            for e in entries[:ndim]]


def _shard_shapes(mesh, arrays, specs) -> list:
    return [tuple(d // n for d, n in zip(a.shape, _spec_sizes(mesh, s, a.ndim)))
            if isinstance(s, P) and hasattr(a, "shape") else "?" for a, s in zip(arrays, specs)]


def _shape_or_type(a):
    return tuple(a.shape) if hasattr(a, "shape") else type(a).__name__


def _check_ranks(name: str, arrays, specs) -> None:
    """A ``ValueError`` naming the op where an argument has fewer dimensions than its
    spec shards (else shard_map's error names the wrapper's body)."""
    for i, (a, spec) in enumerate(zip(arrays, specs)):
        if isinstance(spec, P) and hasattr(a, "ndim") and a.ndim < len(spec):
            raise ValueError(
                f"jaxtdist.{name}: argument {i} has shape {tuple(a.shape)} ({a.ndim} "
                f"dimensions); the op shards it as {spec}, which needs at least {len(spec)}: "
                "see the op's docstring for its shapes")


def _check_divisible(name: str, mesh, arrays, specs) -> None:
    """A ``ValueError`` naming the op where a sharded dimension of an argument is
    not a multiple of its devices (else shard_map's error names the wrapper's body)."""
    for i, (a, spec) in enumerate(zip(arrays, specs)):
        if not isinstance(spec, P) or not hasattr(a, "shape"):
            continue
        for dim, (size, n) in enumerate(zip(a.shape, _spec_sizes(mesh, spec, a.ndim))):
            if size % n:
                entry = spec[dim]
                axes = mesh_devices(mesh, (entry,) if isinstance(entry, str) else entry)[1]
                raise ValueError(
                    f"jaxtdist.{name}: argument {i} has shape {tuple(a.shape)}; its dimension "
                    f"{dim} ({size}) is split over {axes} ({n} devices), which must divide it")


def _token_of(out, after: Sequence) -> jax.Array:
    """The order token of the op that made ``out`` (a shard_map body's result), made
    from its last kernel's output where that is not ``out``."""
    rt = runtime()
    record = order_record(rt)
    if record is not None and record.spec is None and record.token is not None:
        return record.token
    return order_token(rt, _later_output(out, after))


def mesh_devices(mesh, axes: Sequence[str]) -> tuple[int, str]:
    """The devices of mesh ``axes`` together, and words naming them for errors
    ("dp=2 x sp=4"; "no axes" for none)."""
    axes = tuple(axes)
    size = 1
    for a in axes:
        size *= int(mesh.shape[a])
    return size, " x ".join(f"{a}={mesh.shape[a]}" for a in axes) or "no axes"


def rows_over(axis_name: str | tuple[str, ...] | None, batch_axes: tuple[str, ...]):
    """The mesh axes sharding rows: the batch axes, then ``axis_name`` (if given; a
    tuple of axes, outermost first, as one)."""
    if isinstance(axis_name, tuple):
        return _axes_spec(tuple(batch_axes) + axis_name)
    return _axes_spec(tuple(batch_axes) + ((axis_name,) if axis_name else ()))
