"""jaxtdist.ag_matmul and jaxtdist.all_gather on CPU devices (Triton interpreter).

Every check draws fresh random inputs and compares against a float64 numpy
reference; outputs are NaN-poisoned by the workers, so an unwritten element
fails the finiteness check.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxtdist as td
from tests.conftest import assert_close, cpu_only, f64, place, rand, rel_err, setup

pytestmark = cpu_only()

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32


def _ag_matmul_fn(mesh):
    return jax.jit(jax.shard_map(lambda x, w: td.ag_matmul(x, w, "tp"), mesh=mesh,
                                 in_specs=(P("tp", None), P(None, "tp")),
                                 out_specs=P(None, "tp")))


def _check_ag_matmul(mesh, f, world, m, k, n, dtype):
    x = rand((world * m, k), dtype)
    w = rand((k, world * n), dtype)
    out = f(place(mesh, x, P("tp", None)), place(mesh, w, P(None, "tp")))
    assert out.shape == (world * m, world * n) and out.dtype == jnp.dtype(dtype)
    assert_close(out, f64(x) @ f64(w), dtype)


# (world, dtype, (m_shard, k, n_shard)): every world and dtype, odd shapes
# (not multiples of the CPU blocks 16/32), one or several row chunks, and both
# kernel modes: world * m_shard <= 32 runs one M tile over all ranks' rows.
AG_MATMUL_CASES = [
    (2, F32, (5, 24, 12)),
    (2, BF16, (33, 40, 20)),
    (2, F16, (1, 16, 8)),
    (2, F32, (48, 72, 48)),
    (4, F16, (5, 24, 12)),
    (4, F32, (33, 40, 20)),
    (4, BF16, (1, 16, 8)),
    (4, F32, (16, 32, 32)),
    (4, BF16, (9, 24, 12)),
    (8, BF16, (5, 24, 12)),
    (8, F32, (1, 16, 8)),
    (8, F16, (17, 40, 20)),
    (8, F32, (7, 72, 36)),
    (8, F16, (4, 40, 20)),
]


@pytest.mark.parametrize("world,dtype,shape", [
    pytest.param(w, d, s, id=f"w{w}-{jnp.dtype(d).name}-{'x'.join(map(str, s))}")
    for w, d, s in AG_MATMUL_CASES])
def test_ag_matmul(world, dtype, shape):
    mesh = setup(world)
    m, k, n = shape
    f = _ag_matmul_fn(mesh)
    _check_ag_matmul(mesh, f, world, m, k, n, dtype)
    _check_ag_matmul(mesh, f, world, m, k, n, dtype)  # a second epoch (other parity)


# (world, dtype, per-rank shape, axis, tiled)
ALL_GATHER_CASES = [
    (2, F32, (5, 12), 0, True),
    (2, BF16, (3, 7), 1, True),
    (2, F16, (9, 5), 1, False),
    (2, F32, (70, 3), 0, False),
    (4, F16, (5, 12), 0, False),
    (4, F32, (6, 7), 1, True),
    (4, BF16, (1, 33), 0, True),
    (4, F32, (3, 4, 5), 1, True),
    (4, BF16, (3, 4, 5), 2, False),
    (8, BF16, (5, 12), 1, False),
    (8, F32, (13, 9), 0, True),
    (8, F16, (2, 3, 5), 0, False),
    (8, F32, (2, 3, 5), -1, True),
    (8, F32, (40,), 0, True),
]


@pytest.mark.parametrize("case", ALL_GATHER_CASES, ids=lambda c: (
    f"w{c[0]}-{jnp.dtype(c[1]).name}-{'x'.join(map(str, c[2]))}-ax{c[3]}-"
    f"{'tiled' if c[4] else 'stacked'}"))
def test_all_gather(case):
    world, dtype, shape, axis, tiled = case
    mesh = setup(world)
    ndim = len(shape)

    # Each rank returns its own gathered copy under a new leading axis, so that
    # every rank's result is checked.
    def body(x):
        return td.all_gather(x[0], "tp", axis=axis, tiled=tiled)[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("tp"),
                              out_specs=P("tp", *([None] * (ndim + (0 if tiled else 1))))))
    for _ in range(2):
        x = rand((world,) + shape, dtype)
        out = np.asarray(f(place(mesh, x, P("tp"))))
        if tiled:
            ref = np.concatenate(list(x), axis=axis)
        else:
            ref = np.stack(list(x), axis=axis % ndim)
        assert out.shape == (world,) + ref.shape
        for r in range(world):
            assert np.all(np.isfinite(out[r].astype(np.float32)))
            np.testing.assert_array_equal(out[r], ref, err_msg=f"rank {r}")


@pytest.mark.parametrize("tiled", [True, False])
def test_all_gather_matches_lax(tiled):
    """Same result as jax.lax.all_gather inside the same shard_map."""
    mesh = setup(4)

    def body(x):
        a = td.all_gather(x, "tp", axis=1, tiled=tiled)
        b = jax.lax.all_gather(x, "tp", axis=1, tiled=tiled)
        return a[None], b[None]

    spec = P("tp", *([None] * (2 if tiled else 3)))
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("tp", None), out_specs=(spec, spec)))
    x = rand((4 * 3, 5), F32)
    a, b = f(place(mesh, x, P("tp", None)))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# -- a (dp, tp) mesh: groups of ranks --------------------------------------------


def test_ag_matmul_2d_mesh_groups():
    """ag_matmul over "tp" on a (2, 2) mesh: each dp group gathers its own rows."""
    mesh = setup((2, 2), ("dp", "tp"))
    m, k, n = 5, 24, 12

    def body(x, w):
        return td.ag_matmul(x[0], w[0], "tp")[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("dp", "tp", None), P("dp", None, "tp")),
                              out_specs=P("dp", None, "tp")))
    for _ in range(2):
        x = rand((2, 2 * m, k), F32)
        w = rand((2, k, 2 * n), F32)
        out = np.asarray(f(place(mesh, x, P("dp", "tp", None)), place(mesh, w, P("dp", None, "tp"))))
        assert out.shape == (2, 2 * m, 2 * n)
        for g in range(2):
            assert_close(out[g], f64(x[g]) @ f64(w[g]), F32)


def test_all_gather_2d_mesh_groups():
    mesh = setup((2, 2), ("dp", "tp"))

    def body(x):
        return td.all_gather(x[0], "tp", axis=0, tiled=True)[None, None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("dp", "tp", None),
                              out_specs=P("dp", "tp", None, None)))
    for _ in range(2):
        x = rand((2, 2 * 3, 7), F32)
        out = np.asarray(f(place(mesh, x, P("dp", "tp", None))))
        assert out.shape == (2, 2, 6, 7)
        for g in range(2):
            for r in range(2):
                np.testing.assert_array_equal(out[g, r], x[g], err_msg=f"dp {g} tp {r}")


def test_all_gather_2d_mesh_both_axes():
    """A tuple axis_name gathers over the whole mesh in (dp, tp) order, like lax."""
    mesh = setup((2, 2), ("dp", "tp"))

    def body(x):
        a = td.all_gather(x, ("dp", "tp"), axis=0, tiled=True)
        b = jax.lax.all_gather(x, ("dp", "tp"), axis=0, tiled=True)
        return a[None], b[None]

    spec = P(("dp", "tp"), None, None)
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(("dp", "tp"), None),
                              out_specs=(spec, spec)))
    x = rand((4 * 3, 6), BF16)
    a, b = f(place(mesh, x, P(("dp", "tp"), None)))
    a, b = np.asarray(a), np.asarray(b)
    np.testing.assert_array_equal(a, b)
    for r in range(4):
        np.testing.assert_array_equal(a[r], x)


# -- repeated use: epochs, parities, reuse races ---------------------------------


@pytest.mark.parametrize("m", [6, 12])  # world * m below / above the small-M limit
def test_chained_ag_matmuls_in_one_jit(m):
    """8 dependent ag_matmuls inside one jit; each step's input is the last output."""
    world, k = 4, 16
    mesh = setup(world)
    steps = 8

    # w_i: [k, world * k] column-sharded; step output [world*m, k] per rank. The
    # next step's x is this rank's rows of it, mixed with the step's own data.
    def body(x, ws, adds):
        h = x
        me = jax.lax.axis_index("tp")
        for i in range(steps):
            out = td.ag_matmul(h, ws[i], "tp")  # [world*m, k]
            rows = jax.lax.dynamic_slice_in_dim(out, me * m, m, axis=0)
            h = jnp.tanh(rows) + adds[i]
        return h

    f = jax.jit(jax.shard_map(body, mesh=mesh,
                              in_specs=(P("tp", None), P(None, None, "tp"), P(None, "tp", None)),
                              out_specs=P("tp", None)))
    for _ in range(2):
        x = rand((world * m, k), F32)
        ws = rand((steps, k, world * k), F32, scale=0.3)
        adds = rand((steps, world * m, k), F32)
        out = f(place(mesh, x, P("tp", None)), place(mesh, ws, P(None, None, "tp")),
                place(mesh, adds, P(None, "tp", None)))
        # Reference: rank r holds column block r of the product, and its next x
        # is rows block r of that column block.
        h = [f64(x)[r * m:(r + 1) * m] for r in range(world)]
        for i in range(steps):
            full = np.concatenate(h, axis=0)
            h = [np.tanh((full @ f64(ws[i])[:, r * k:(r + 1) * k])[r * m:(r + 1) * m])
                 + f64(adds[i])[r * m:(r + 1) * m] for r in range(world)]
        ref = np.concatenate(h, axis=0)
        assert rel_err(out, ref) < 1e-5


def test_many_successive_calls():
    """50 calls of one jitted ag_matmul with fresh inputs: no reuse races."""
    world, m, k, n = 4, 3, 16, 8
    mesh = setup(world)
    f = _ag_matmul_fn(mesh)
    xs = [rand((world * m, k), F32) for _ in range(50)]
    wsv = [rand((k, world * n), F32) for _ in range(50)]
    # Dispatch all first (asynchronous), then check every result.
    outs = [f(place(mesh, x, P("tp", None)), place(mesh, w, P(None, "tp")))
            for x, w in zip(xs, wsv)]
    for i, (x, w, out) in enumerate(zip(xs, wsv, outs)):
        err = rel_err(out, f64(x) @ f64(w))
        assert err < 1e-5, f"call {i}: relative error {err:.3g}"


# -- autodiff ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype,tol", [(F32, 1e-4), (BF16, 2e-2)])
def test_ag_matmul_grad(dtype, tol):
    world, m, k, n = 4, 5, 24, 12
    mesh = setup(world)

    def loss_td(x, w, g):
        return jnp.sum(td.ag_matmul(x, w, "tp").astype(jnp.float32) * g)

    def loss_ref(x, w, g):
        full = jax.lax.all_gather(x, "tp", axis=0, tiled=True)
        y = jnp.dot(full, w, preferred_element_type=jnp.float32).astype(x.dtype)
        return jnp.sum(y.astype(jnp.float32) * g)

    def body(x, w, g):
        gx, gw = jax.grad(loss_td, argnums=(0, 1))(x, w, g)
        rx, rw = jax.grad(loss_ref, argnums=(0, 1))(x, w, g)
        return gx, gw, rx, rw

    specs = (P("tp", None), P(None, "tp"), P(None, "tp"))
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs,
                              out_specs=(P("tp", None), P(None, "tp"), P("tp", None),
                                         P(None, "tp"))))
    x = rand((world * m, k), dtype)
    w = rand((k, world * n), dtype)
    g = rand((world * m, world * n), F32)
    gx, gw, rx, rw = f(place(mesh, x, specs[0]), place(mesh, w, specs[1]),
                       place(mesh, g, specs[2]))
    assert gx.dtype == jnp.dtype(dtype) and gw.dtype == jnp.dtype(dtype)
    # Exact references too: dx = g @ w^T, dw = x^T @ g.
    assert rel_err(gx, f64(rx)) < tol
    assert rel_err(gw, f64(rw)) < tol
    assert rel_err(gx, f64(g) @ f64(w).T) < tol
    assert rel_err(gw, f64(x).T @ f64(g)) < tol


# -- the README / docstring example -----------------------------------------------


@pytest.mark.parametrize("source", ["docstring", "readme"])
def test_user_example(source):
    """jaxtdist/__init__.py's docstring (all devices) and the README (4 devices), verbatim."""
    if source == "docstring":
        mesh = jax.make_mesh((jax.device_count(),), ("tp",))
    else:
        mesh = jax.make_mesh((4,), ("tp",))
    td.initialize(mesh)

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P("tp", None), P(None, "tp")),
                       out_specs=P(None, "tp"))
    def f(x, w):
        return td.ag_matmul(x, w, axis_name="tp")

    world = mesh.devices.size
    for _ in range(2):
        x = rand((world * 4, 32), F32)
        w = rand((32, world * 16), F32)
        out = f(place(mesh, x, P("tp", None)), place(mesh, w, P(None, "tp")))
        assert_close(out, f64(x) @ f64(w), F32)


def test_independent_same_shape_calls_in_one_jit():
    """Calls with no data dependence share a workspace; every device must run them
    in one order (jaxtdist chains them in trace order)."""
    world, m, k, n = 4, 3, 16, 8
    mesh = setup(world)

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P("tp", None), P(None, "tp")),
                       out_specs=P(None, "tp"))
    def four(x, w):
        outs = [td.ag_matmul(x * (i + 1), w, "tp") for i in range(3)]
        outs.append(td.all_gather(x, "tp") @ w)
        return sum(o * (10.0 ** i) for i, o in enumerate(outs))

    for _ in range(5):
        x, w = rand((world * m, k)), rand((k, world * n))
        out = four(place(mesh, x, P("tp", None)), place(mesh, w, P(None, "tp")))
        ref = f64(x) @ f64(w)
        expect = sum((i + 1 if i < 3 else 1) * ref * 10.0 ** i for i in range(4))
        assert rel_err(out, expect) < 1e-5
