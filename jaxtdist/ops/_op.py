"""One mechanism that makes an op differentiable, ordered and local at world 1.

An op declares itself as a ``DistributedOp``: its argument check, its forward
pass (returning the output and the residuals its backward needs), its
backward pass (cotangents of its arguments, from any code, other ops
included), and optionally its local computation for a group of one rank
with the rule for where that applies. Arguments are pytrees of arrays (a
``MoeHandle`` passes as it is). The mechanism supplies the rest, once for
every op:

- checks once: in ``op(...)`` and ``op.kernels(...)``, never in ``op.launch``;
- program order: the call runs after the previous jaxtdist op of the trace
  (``custom_vjp`` traces its body in a trace of its own, so this happens
  outside it) and records its output for the next one, with an order token
  made by its last kernel where that kernel is a later one (a copy-out of an
  inbox: ``_protocol.order_token``), in the backward pass too;
- autodiff: a ``jax.custom_vjp`` over the arguments' leaves whose cotangents
  get their primal's dtype and varying mesh axes (summed over axes where the
  primal was replicated), integer leaves none; an op without a backward
  raises a clear error when differentiated;
- ``jax.vmap``: one whole op call per batch element, in order (a
  ``lax.map``), each with its own epoch;
- world 1: a group of one rank runs the local computation (what the op costs
  without communication), with JAX's own autodiff, everywhere or only under
  the interpreter (``local_at_world_1``);
- the path (``_path``): per call, the fused kernels or the decomposed form (the
  local computation at world 1; ``decomposed``, XLA's collective and dot, at
  world > 1), by the op's ``path`` rule where it declares one, forced by
  ``config={"PATH": ...}``, logged at DEBUG and shown by ``jaxtdist.explain``.

The pjit-style form of an op is ``_sharded.pjit_wrapper``.

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
from jax.interpreters import ad

from jaxtdist.ops._config import config_dict
from jaxtdist.ops._path import (AUTO, DECOMPOSED, ENV_PATH, FUSED, Choice, PathRule, Situation,
                                log_choice, situation_of, take_path)
from jaxtdist.ops._protocol import (check_axis, mark_varying, order_record, order_token,
                                    program_order_deps, record_output, varying_axes)
from jaxtdist.runtime._ffi import no_derivative
from jaxtdist.runtime._identity import identity_primitive
from jaxtdist.runtime._runtime import runtime

__all__ = ["DistributedOp", "distributed_op", "first_order_only", "later_output",
           "match_cotangent", "one_call_per_element", "run_once", "scatter_cotangent",
           "under_vmap"]


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
class _Plan:
    """A call's custom VJP's non-differentiable argument: the static keywords
    (``axis_name`` among them) as leaves and tree, the types of the order arguments
    before the operands, the arguments' tree, and the backward: ``"backward"`` (the
    op's), ``"local"`` (the VJP of its local computation) or None (none)."""
    static: tuple
    static_tree: Any
    after: tuple
    tree: Any
    gradient: str | None

    @property
    def kwargs(self) -> dict:
        return self.static_tree.unflatten(self.static)


@dataclasses.dataclass(frozen=True)
class DistributedOp:
    """A jaxtdist op, declared by its parts (see the module docstring).

    Positional arguments are pytrees of arrays (an array, None, a ``MoeHandle``),
    passed to every part as they are; keywords are static, ``axis_name`` among them.

    Attributes:
      name: the public name (``jaxtdist.<name>``), used in errors.
      forward: ``forward(*args, **static) -> (out, residuals)``: the
        distributed computation (through ``_protocol.Call``); ``out`` a pytree
        of arrays.
      backward: ``backward(residuals, ct, **static) -> tuple``: one cotangent
        per argument, with the argument's structure, or None for none (integer
        leaves get none, whatever is returned there); None: not differentiable.
      check: ``check(*args, **static)`` raising ``ValueError`` on bad
        arguments, run before anything else, once per call.
      local: ``local(*args, **static) -> out``: the computation of a group
        of one rank; None: the forward runs at world 1 too.
      local_at_world_1: where a group of one rank runs ``local``: ``"always"``
        (every platform), or ``"interpreter"`` (under the Triton interpreter
        only, for ops whose local computation is much slower than their
        kernels on GPUs: there the kernels run, differentiated by ``backward``
        or, without one, by the VJP of ``local`` recomputed from the arguments).
      reduces: the result is the group's sum, typed as ``jax.lax.psum``'s
        (replicated over the group's axes), at world 1 too.
      primal: ``primal(*args, **static) -> (out, None)``: the forward pass when
        no gradient is taken (residuals that cost work to keep are skipped);
        None: ``forward``, its residuals dropped.
      check_config: ``check_config(*args, **static)`` resolving the ``config``
        asked for (``static["config"]``, not None) as the kernels would at world 1,
        raising ``ValueError`` where it does not fit; run where ``local`` runs
        instead of the kernels, so that a bad config (an unknown key, a tile that
        is no power of 2) fails on one device as it would on many. None: nothing
        to check.
      decomposed: ``decomposed(*args, **static) -> out``: the decomposed form at
        world > 1 (XLA's collective and dot), differentiated by JAX; None: none.
      path: the op's ``_path.PathRule``: which path a call takes with no
        ``PATH`` asked for; None: the local computation at world 1 where
        ``local_at_world_1`` applies, else the kernels.
      variant: None for the op itself (found by name: ``distributed_op``), else
        the name of a variant declared beside it ("fp8": the same public
        function and name in errors, other operands), which is not registered.
    """
    name: str
    forward: Callable[..., tuple[Any, Any]]
    backward: Callable[..., tuple] | None = None
    check: Callable[..., None] | None = None
    local: Callable[..., Any] | None = None
    local_at_world_1: str = "always"
    reduces: bool = False
    primal: Callable[..., tuple[Any, Any]] | None = None
    check_config: Callable[..., None] | None = None
    decomposed: Callable[..., Any] | None = None
    path: PathRule | None = None
    variant: str | None = None

    def __post_init__(self):
        if self.local_at_world_1 not in ("always", "interpreter"):
            raise ValueError(f"jaxtdist.{self.name}: local_at_world_1="
                             f"{self.local_at_world_1!r} must be 'always' or 'interpreter'")
        if self.variant is None:
            _OPS[self.name] = self

    def __call__(self, *args: Any, axis_name, **static: Any):
        """The op, checked, on the path ``choose`` picks: the local computation or the
        decomposed form, else the kernels."""
        axis_name, static, asked = self._checked(args, axis_name, static)
        rt = runtime()
        layout = check_axis(rt, axis_name, self.name)
        choice = self.choose(situation_of(rt, layout.world), args, static, *asked,
                             local_applies=self.local_applies(rt))
        log_choice(choice)
        if choice.path == DECOMPOSED:
            if self.check_config is not None and static.get("config") is not None:
                self.check_config(*args, axis_name=axis_name, **static)
            if layout.world > 1:
                return self.decomposed(*args, axis_name=axis_name, **static)
            out = self.local(*args, axis_name=axis_name, **static)
            return _typed_as_sum(out, layout.axes) if self.reduces else out
        gradient = "backward"
        if layout.world == 1 and self.local is not None and self.backward is None:
            gradient = "local"
        return self._ordered(args, axis_name, static, rt, gradient)

    def choose(self, situation: Situation, args: tuple, static: dict, asked: str = AUTO,
               asker: str = "config PATH", *, local_applies: bool = True) -> Choice:
        """The path of a call (``_path``): ``asked`` (by ``asker``: config's PATH or
        ``JAXTDIST_PATH``) where it is not "auto", else the op's ``path`` rule, else
        the default (world 1: the local computation where ``local_applies``;
        world > 1: the kernels)."""
        one = situation.world == 1
        decomposed = "local computation" if one else "decomposed form"
        if asked == FUSED:
            return Choice(self.name, FUSED, "jaxtdist's kernels", asker)
        missing = (self.local if one else self.decomposed) is None
        if asked == DECOMPOSED and not (missing and asker.startswith(ENV_PATH)):
            # (The environment's choice falls back to the rule where there is none.)
            if missing:
                raise ValueError(
                    f"jaxtdist.{self.name}: {asker}, but the op has no {decomposed} at "
                    f"world {situation.world}; allowed here: 'auto', 'fused'")
            return Choice(self.name, DECOMPOSED, self._runs(one), asker)
        keys = sorted(static.get("config") or ())
        if keys and not one:
            # Keys of the kernel config configure the kernels: they run (at world 1
            # the local computation stays, as before paths, with the keys checked).
            return Choice(self.name, FUSED, "jaxtdist's kernels",
                          f"config sets kernel keys {keys}: the kernels they configure run")
        rule = self.path.choose(situation, *args, **static) if self.path is not None else None
        if rule is not None:
            return dataclasses.replace(rule, op=self.name)
        if not one:
            return Choice(self.name, FUSED, "jaxtdist's kernels",
                          "the op's kernels (no rule picks another path at world > 1)")
        if self.local is not None and local_applies:
            return Choice(self.name, DECOMPOSED, self._runs(one),
                          "a group of one rank needs no communication: the local "
                          "computation runs" + ("" if self.local_at_world_1 == "always"
                                                else " (under the Triton interpreter)"))
        return Choice(self.name, FUSED, "jaxtdist's kernels",
                      "the op's kernels at world 1 (its local computation is slower on GPUs)"
                      if self.local is not None else "the op has no local computation")

    def _runs(self, one: bool) -> str:
        """What the decomposed path runs, in words."""
        said = (self.path.local if one else self.path.decomposed) if self.path else ""
        return said or ("the local computation" if one else "the decomposed form")

    def kernels(self, *args: Any, axis_name, **static: Any):
        """``check``, then ``launch`` (``*_kernels`` entry points: benchmarks, tests)."""
        axis_name, static, (asked, asker) = self._checked(args, axis_name, static)
        if asked == DECOMPOSED and asker.startswith("config"):
            raise ValueError(f"jaxtdist.{self.name}: {asker} asks for XLA's path; the kernels "
                             f"entry point always runs the kernels (call jaxtdist.{self.name} "
                             "instead)")
        return self.launch(*args, axis_name=axis_name, **static)

    def launch(self, *args: Any, axis_name, **static: Any):
        """The kernels (``forward``'s output) unchecked, at every world size, ordered and
        batched as the op's calls are, not differentiable (an op's own later launches)."""
        return self._ordered(args, axis_name, static, runtime(), None)

    def local_applies(self, rt) -> bool:
        """Whether a group of one rank on runtime ``rt`` runs ``local`` (not the kernels)."""
        return self.local is not None and (self.local_at_world_1 == "always"
                                           or rt.platform != "gpu")

    def forward_with_residuals(self, *args: Any, axis_name, **static: Any):
        """The forward pass's (out, residuals), bypassing autodiff (for tuning and tests)."""
        return self.forward(*args, axis_name=axis_name, **static)

    def _checked(self, args: tuple, axis_name, static: dict) -> tuple[Any, dict, tuple]:
        """``axis_name`` and ``static`` normalized (``config``'s PATH taken out), after
        ``check`` passed on them, and the path asked for with who asked
        (``_path.take_path``)."""
        if isinstance(axis_name, list):
            axis_name = tuple(axis_name)
        config = config_dict(self.name, static["config"]) if "config" in static else None
        *asked, config = take_path(self.name, config)
        if "config" in static:
            static["config"] = config
        if self.check is not None:
            self.check(*args, axis_name=axis_name, **static)
        return axis_name, static, tuple(asked)

    def _ordered(self, args: tuple, axis_name, static: dict, rt, gradient: str | None):
        """The kernels through the custom VJP, after the previous op of the trace."""
        leaves, tree = jax.tree_util.tree_flatten(args)
        if not leaves:  # nothing to differentiate: the protocol orders the call itself
            return self.forward(*args, axis_name=axis_name, **static)[0]
        # The previous op's output goes in as an argument, so the prologue takes it
        # as an operand (a data dependency XLA must honour; an optimization barrier
        # around the inputs did not survive to XLA:CPU's scheduling, and devices
        # then ran the calls' prologues in different orders under mismatched epochs).
        # With the previous op's order token (``_protocol.order_token``), second.
        after = program_order_deps(rt)
        # Static dicts and lists become trees: hashable.
        static, static_tree = jax.tree_util.tree_flatten(dict(static, axis_name=axis_name))
        plan = _Plan(tuple(static), static_tree,
                     tuple((tuple(a.shape), jnp.dtype(a.dtype).name, rt.platform, i > 0)
                           for i, a in enumerate(after)), tree, gradient)
        try:
            out, token = self._vjp(plan, *after, *leaves)
        except TypeError as e:
            # Under jax.jvp JAX refuses the custom VJP without naming the op (and
            # eagerly, inside an eager shard_map, fails with "unhashable type").
            known = "unhashable" in str(e) or "forward-mode" in str(e)
            if not known or not any(isinstance(a, ad.JVPTracer) for a in leaves):
                raise
            raise TypeError(
                f"jaxtdist.{self.name}: forward-mode autodiff (jax.jvp, jax.jacfwd, "
                "jax.linearize) is not supported: jaxtdist's ops define reverse mode "
                "only (jax.grad, jax.vjp). (JAX raised: " + str(e) + ")") from None
        record_output(rt, jax.tree_util.tree_leaves(out)[0], token=token)
        return out

    def _local_vjp(self, plan: _Plan, leaves: Sequence[jax.Array], ct) -> tuple:
        """Cotangents of the operands by the VJP of ``local``, recomputed from them
        (its kernels ran at world 1 and no ``backward`` is declared)."""
        static = plan.kwargs
        axes = check_axis(runtime(), static["axis_name"], self.name).axes

        def local(*operands):
            out = self.local(*plan.tree.unflatten(operands), **static)
            # Typed as the kernels' result (psum's type where the op reduces), so
            # that ct's type is the one the VJP expects.
            return _typed_as_sum(out, axes) if self.reduces else out

        return jax.vjp(local, *leaves)[1](ct)

    @functools.cached_property
    def _vjp(self) -> Callable:
        op = self

        def ordered_forward(plan: _Plan, fn=None):
            # The first arguments are the previous op's output and order token: the
            # call's prologue runs after them (``program_order_deps``); the operands
            # follow, as the leaves of the op's arguments.
            n_after = len(plan.after)

            def forward(*a):
                if n_after:
                    record_output(runtime(), a[0], token=a[1] if n_after > 1 else None)
                return (fn or op.forward)(*plan.tree.unflatten(a[n_after:]),
                                          **plan.kwargs)
            return forward

        @functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
        def call(plan, *args):
            n_after = len(plan.after)
            forward = ordered_forward(plan, op.primal)

            def with_token(*a):
                out = forward(*a)[0]
                return out, order_token(runtime(), later_output(out, a[:n_after]))

            return one_call_per_element(with_token)(*args)

        def fwd(plan, *args):
            n_after = len(plan.after)
            # Only the op's own backward takes residuals; the local VJP recomputes.
            own = plan.gradient == "backward"
            forward = ordered_forward(plan, None if own else op.primal)

            def with_last(*a):
                # Also the call's last jaxtdist output (the gathered copy-out of an
                # inbox, say): the next op's prologue and the backward pass run after it.
                out, residuals = forward(*a)
                residuals = residuals if own else None
                later = later_output(out, a[:n_after])
                last = jax.tree_util.tree_leaves(out)[0] if later is None else later
                token = order_token(runtime(), later)
                return (out, token), residuals, _done_token(last, residuals)

            out, residuals, done = run_once(one_call_per_element(with_last)(*args))
            # Of the order tokens only their types (empty slices): no memory held.
            typed = tuple(a.reshape(-1)[:0] for a in args[:n_after])
            return out, (residuals, args[n_after:], typed, done)

        def bwd(plan, saved, cts_out):
            residuals, leaves, typed, done = saved
            ct, ct_token = cts_out
            if plan.gradient is None or (plan.gradient == "backward" and op.backward is None):
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
            if plan.gradient == "local":
                cts = op._local_vjp(plan, leaves, ct)
            else:
                cts = _cotangent_leaves(op.name, plan.tree,
                                        op.backward(residuals, ct, **plan.kwargs))
            cts = tuple(None if c is None or not jnp.issubdtype(a.dtype, jnp.inexact)
                        else match_cotangent(c, a) for c, a in zip(cts, leaves))
            record = order_record(runtime()) if ordered else None
            launched = record is not None and record.value is not done
            last = record.value if launched else (ct_token if ordered else None)
            return _order_cotangents(plan.after, typed, cts, last) + cts

        call.defvjp(fwd, bwd)
        return call


# Every declared op by name (``jaxtdist.explain`` finds ops here).
_OPS: dict[str, DistributedOp] = {}


def distributed_op(op) -> DistributedOp:
    """The declared op of ``op``: a ``DistributedOp``, its name, or its public
    function (``jaxtdist.ag_matmul``)."""
    if isinstance(op, DistributedOp):
        return op
    name = op if isinstance(op, str) else getattr(op, "__name__", None)
    if name not in _OPS:
        raise ValueError(f"jaxtdist: {op!r} is not a jaxtdist op; known: {sorted(_OPS)} (the "
                         "shard_map forms: pass jaxtdist.ag_matmul, not ag_matmul_sharded)")
    return _OPS[name]


def _cotangent_leaves(op: str, tree, cts: Sequence) -> list:
    """The cotangents a backward returned, one per argument of ``tree`` (a pytree
    like the argument, or None for none), as the operands' leaves."""
    args = tree.children()
    if len(cts) != len(args):
        raise ValueError(f"jaxtdist.{op}: its backward returned {len(cts)} cotangents for "
                         f"{len(args)} arguments; it must return one per argument (None: none)")
    return [leaf for arg, ct in zip(args, cts)
            for leaf in ([None] * arg.num_leaves if ct is None else arg.flatten_up_to(ct))]


def later_output(out, after: Sequence) -> jax.Array | None:
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


def _typed_as_sum(out, axes: Sequence[str]):
    """The local result (a pytree) of a group of one rank, typed as the group's sum
    is (as ``jax.lax.psum`` types it: replicated over ``axes``), so that out_specs
    that leave ``axes`` out accept it as they do at larger worlds. JAX has no cast
    from varying to replicated, so this is a psum over groups of one device: a
    degenerate all-reduce that moves no data."""
    def typed(leaf):
        have = varying_axes(leaf)
        summed = tuple(a for a in axes if have is not None and a in have)
        return jax.lax.psum(leaf, summed) if summed else leaf
    return jax.tree_util.tree_map(typed, out)


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


