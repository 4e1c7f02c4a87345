"""DistributedOp with pytree arguments and results: a registered dataclass (float
and integer leaves, a static field) passes to every part as it is, at world 1 and
2, differentiated, batched and under jax.checkpoint."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxtdist.ops._op import DistributedOp
from tests.conftest import cpu_only, place, rand, rel_err, setup

pytestmark = cpu_only()

ROWS, COLS = 3, 5


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Rows:
    """A handle-like pytree: float rows, integer counts, a static scale."""
    values: jax.Array  # [ROWS, COLS] float32
    counts: jax.Array  # [ROWS] int32
    scale: float = dataclasses.field(metadata=dict(static=True), default=1.0)


def _check(h, bias, *, axis_name) -> None:
    del bias, axis_name
    if not isinstance(h, Rows):
        raise ValueError(f"pytree_sum: h must be a Rows, got {type(h).__name__}")


def _weighted(h: Rows) -> jax.Array:
    return h.values * h.scale * h.counts[:, None].astype(h.values.dtype)


def _forward(h, bias, *, axis_name):
    assert isinstance(h, Rows)  # every part sees the argument as it was passed
    out = (jax.lax.psum(_weighted(h), axis_name) + bias,
           jax.lax.psum(jnp.sum(h.counts), axis_name))
    return out, h


def _backward(h, ct, *, axis_name):
    del axis_name
    ct_y, _ = ct  # the integer result's cotangent is float0
    # A cotangent with the argument's structure; None for the integer leaf.
    return Rows(ct_y * h.scale * h.counts[:, None].astype(ct_y.dtype), None, h.scale), ct_y


def _local(h, bias, *, axis_name):
    del axis_name
    return _weighted(h) + bias, jnp.sum(h.counts)


_OP = DistributedOp("pytree_sum", forward=_forward, backward=_backward, check=_check,
                    local=_local, reduces=True)
# No backward, kernels at world 1 where forced: differentiated by the local VJP.
_LOCAL_VJP = DistributedOp("pytree_sum", forward=_forward, check=_check, local=_local,
                           local_at_world_1="interpreter", reduces=True)


def _data(world: int, batch: int = 0):
    lead = (batch,) if batch else ()
    values = rand(lead + (world * ROWS, COLS))
    counts = np.arange(1, world * ROWS + 1, dtype=np.int32) % 4
    return values, counts, rand((ROWS, COLS))


def _expect(values, counts, bias, world: int, scale: float):
    parts = (values * scale * counts[:, None]).reshape(world, ROWS, COLS)
    return parts.sum(0) + bias, counts.sum()


def _run(mesh, fn, values, counts, bias, values_spec=P("x"), out_specs=P()):
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(values_spec, P("x"), P()),
                                 out_specs=out_specs))(
        place(mesh, values, values_spec), place(mesh, counts, P("x")), place(mesh, bias, P()))


@pytest.mark.parametrize("world", [1, 2])
def test_pytree_argument_forward_grad_vmap_checkpoint(world):
    mesh = setup(world, ("x",))
    values, counts, bias = _data(world)
    scale = 0.5
    y_ref, n_ref = _expect(values, counts, bias, world, scale)

    def op(v, c, b):
        return _OP(Rows(v, c, scale), b, axis_name="x")

    y, n = _run(mesh, op, values, counts, bias)
    assert rel_err(y, y_ref) < 1e-6
    assert int(n) == n_ref and n.dtype == jnp.int32

    def loss(v, c, b, call=op):
        y, _ = call(v, c, b)
        return jnp.sum(y * y)

    for wrap in (lambda f: f, jax.checkpoint):
        dv, db = _run(mesh, lambda v, c, b, wrap=wrap: jax.grad(wrap(loss), argnums=(0, 2))(
            v, c, b), values, counts, bias, out_specs=(P("x"), P()))
        dy = 2 * y_ref
        want_dv = np.concatenate([dy * scale * counts[r * ROWS:(r + 1) * ROWS, None]
                                  for r in range(world)])
        np.testing.assert_allclose(np.asarray(dv).reshape(-1, COLS), want_dv, rtol=1e-5)
        np.testing.assert_allclose(db, dy, rtol=1e-5)

    batched, _, _ = _data(world, batch=2)
    y_b, n_b = jax.jit(jax.shard_map(jax.vmap(op, in_axes=(0, None, None)), mesh=mesh,
                                     in_specs=(P(None, "x"), P("x"), P()), out_specs=P()))(
        place(mesh, batched, P(None, "x")), place(mesh, counts, P("x")), place(mesh, bias, P()))
    for i in range(2):
        assert rel_err(y_b[i], _expect(batched[i], counts, bias, world, scale)[0]) < 1e-6
    np.testing.assert_array_equal(n_b, n_ref)


def test_pytree_argument_kernels_and_local_vjp_at_world_1(monkeypatch):
    """At world 1: ``kernels`` runs the forward, and an op without a backward whose
    kernels run there (forced) is differentiated by its local computation's VJP."""
    mesh = setup(1, ("x",))
    values, counts, bias = _data(1)
    y_ref, _ = _expect(values, counts, bias, 1, 2.0)
    y, _ = _run(mesh, lambda v, c, b: _OP.kernels(Rows(v, c, 2.0), b, axis_name="x"),
                values, counts, bias)
    assert rel_err(y, y_ref) < 1e-6

    def grads(op):
        def loss(v, c, b):
            return jnp.sum(op(Rows(v, c, 2.0), b, axis_name="x")[0] ** 2)
        return _run(mesh, lambda v, c, b: jax.grad(loss, argnums=(0, 2))(v, c, b),
                    values, counts, bias, out_specs=(P("x"), P()))

    want = grads(_OP)
    monkeypatch.setattr(DistributedOp, "local_applies", lambda self, rt: False)
    got = grads(_LOCAL_VJP)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-6)


def test_pytree_argument_errors():
    mesh = setup(2, ("x",))
    values, counts, bias = _data(2)
    with pytest.raises(ValueError, match="pytree_sum: h must be a Rows, got tuple"):
        _run(mesh, lambda v, c, b: _OP((v, c), b, axis_name="x"), values, counts, bias)
    with pytest.raises(TypeError, match="pytree_sum is not differentiable here"):
        _run(mesh, lambda v, c, b: jax.grad(lambda v: jnp.sum(
            _OP.launch(Rows(v, c), b, axis_name="x")[0]))(v), values, counts, bias,
             out_specs=P("x"))
    wrong = DistributedOp("pytree_sum", forward=_forward, backward=lambda h, ct, **_: (None,))
    with pytest.raises(ValueError, match="pytree_sum: its backward returned 1 cotangents for "
                                         "2 arguments"):
        _run(mesh, lambda v, c, b: jax.grad(lambda v: jnp.sum(
            wrong(Rows(v, c), b, axis_name="x")[0]))(v), values, counts, bias,
             out_specs=P("x"))
    with pytest.raises(ValueError, match="local_at_world_1='gpu' must be 'always' or "):
        DistributedOp("pytree_sum", forward=_forward, local_at_world_1="gpu")
