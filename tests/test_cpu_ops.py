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


@pytest.mark.parametrize("regather", [False, True])
def test_ag_matmul_grad_keeps_or_regathers_x(regather):
    """Both residual policies give the same gradients, and neither backward runs an
    XLA collective but the reduce-scatter's own kernels (no all-gather in the HLO)."""
    world, m, k, n = 4, 3, 16, 8
    mesh = setup(world)

    def body(x, w, g):
        loss = lambda a, b: jnp.sum(td.ag_matmul(a, b, "tp", regather=regather) * g)  # noqa: E731
        return jax.grad(loss, argnums=(0, 1))(x, w)

    specs = (P("tp", None), P(None, "tp"), P(None, "tp"))
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs,
                              out_specs=(P("tp", None), P(None, "tp"))))
    x, w, g = rand((world * m, k), F32), rand((k, world * n), F32), rand((world * m, world * n), F32)
    args = (place(mesh, x, specs[0]), place(mesh, w, specs[1]), place(mesh, g, specs[2]))
    hlo = f.lower(*args).as_text()
    assert "stablehlo.all_gather" not in hlo and "all-gather" not in hlo
    gx, gw = f(*args)
    assert rel_err(gx, f64(g) @ f64(w).T) < 1e-4
    assert rel_err(gw, f64(x).T @ f64(g)) < 1e-4


@pytest.mark.parametrize("world,dtype", [(2, F32), (4, BF16)])
def test_ag_matmul_several_weights(world, dtype):
    """One gather for several weights: one product each, and their gradients."""
    mesh = setup(world)
    m, k, widths = 3, 24, (8, 4, 12)
    tol = 1e-4 if dtype == F32 else 2e-2

    def loss_td(x, ws, gs):
        ys = td.ag_matmul(x, ws, "tp")
        return sum(jnp.sum(y.astype(jnp.float32) * g) for y, g in zip(ys, gs)), ys

    def body(x, ws, gs):
        (_, ys), grads = jax.value_and_grad(loss_td, argnums=(0, 1), has_aux=True)(x, ws, gs)
        return ys, grads

    wspec = (P(None, "tp"),) * 3
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("tp", None), wspec, wspec),
                              out_specs=(wspec, (P("tp", None), wspec))))
    x = rand((world * m, k), dtype)
    ws = tuple(rand((k, world * n), dtype) for n in widths)
    gs = tuple(rand((world * m, world * n), F32) for n in widths)
    ys, (gx, gws) = f(place(mesh, x, P("tp", None)),
                      tuple(place(mesh, w, P(None, "tp")) for w in ws),
                      tuple(place(mesh, g, P(None, "tp")) for g in gs))
    for y, w in zip(ys, ws):
        assert y.shape == (world * m, w.shape[1]) and y.dtype == jnp.dtype(dtype)
        assert_close(y, f64(x) @ f64(w), dtype)
    ref_gx = sum(f64(g) @ f64(w).T for g, w in zip(gs, ws))
    assert rel_err(gx, ref_gx) < tol
    for gw, g in zip(gws, gs):
        assert rel_err(gw, f64(x).T @ f64(g)) < tol


def test_ag_matmul_several_weights_errors():
    mesh = setup(2)
    x = jnp.ones((4, 8), F32)
    with pytest.raises(ValueError, match="empty sequence"):
        jax.shard_map(lambda x: td.ag_matmul(x, (), "tp"), mesh=mesh, in_specs=P("tp", None),
                      out_specs=P())(x)
    with pytest.raises(ValueError, match=r"weight 1 of 2"):
        jax.shard_map(lambda x: td.ag_matmul(x, (jnp.ones((8, 2)), jnp.ones((6, 2))), "tp"),
                      mesh=mesh, in_specs=P("tp", None), out_specs=P())(x)


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


@pytest.mark.parametrize("world", [4, 8])
def test_independent_same_shape_calls_in_one_jit(world):
    """10 calls with no data dependence share a workspace; every device must run them
    in one order (jaxtdist chains them in trace order through the prologue's
    operands). Before that was a real data dependency, XLA:CPU ran the prologues
    in different orders on different devices: wrong results for every call, or
    stalls, in about half the runs at world 4."""
    m, k, n, calls = 6, 8, 5, 10
    mesh = setup(world)

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P("tp", None), P(None, "tp")),
                       out_specs=P(None, None, "tp"))
    def chain(x, w):
        return jnp.stack([td.ag_matmul(x * (1.0 + i), w, "tp") for i in range(calls)])

    for _ in range(3):
        x, w = rand((world * m, k)), rand((k, world * n))
        out = chain(place(mesh, x, P("tp", None)), place(mesh, w, P(None, "tp")))
        for i in range(calls):
            err = rel_err(out[i], f64(x) * (1.0 + i) @ f64(w))
            assert err < 1e-5, f"call {i}: relative error {err:.3g}"


NESTINGS = {
    "jit": lambda f, x: jax.jit(f)(x),
    "cond": lambda f, x: jax.lax.cond(jax.lax.psum(jnp.sum(x), "tp") > -1e9, f,
                                      lambda a: f(a) * 0.0, x),
    "checkpoint": lambda f, x: jax.checkpoint(f)(x),
    "vmap": lambda f, x: jax.vmap(f)(jnp.stack([x, x]))[1],
    "scan": lambda f, x: jax.lax.scan(lambda c, a: (c, f(a)), 0.0, jnp.stack([x, x]))[1][1],
}


@pytest.mark.parametrize("nesting", sorted(NESTINGS))
def test_calls_in_a_nested_trace_follow_the_enclosing_calls(nesting):
    """Calls inside a nested jit, cond, checkpoint, vmap or scan, with no data
    dependence on the calls before them in the enclosing shard_map, run after
    those on every device (the enclosing trace's last output, closed over)."""
    world, m, k, n, before = 4, 6, 8, 5, 3
    mesh = setup(world)

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P("tp", None), P(None, "tp")),
                       out_specs=P(None, None, "tp"))
    def program(x, w):
        outs = [td.ag_matmul(x * (1.0 + i), w, "tp") for i in range(before)]
        nested = NESTINGS[nesting](lambda a: td.ag_matmul(a * (1.0 + before), w, "tp"), x)
        return jnp.stack(outs + [nested])

    for _ in range(3):
        x, w = rand((world * m, k)), rand((k, world * n))
        out = program(place(mesh, x, P("tp", None)), place(mesh, w, P(None, "tp")))
        for i in range(before + 1):
            err = rel_err(out[i], f64(x) * (1.0 + i) @ f64(w))
            assert err < 1e-5, f"call {i}: relative error {err:.3g}"


def test_independent_wrapper_calls_in_one_jit():
    """pjit-style wrappers are separate shard_maps: each takes the previous one's
    result as an argument, so independent calls keep one order."""
    world, m, k, n, calls = 4, 6, 8, 5, 6
    mesh = setup(world)
    f = jax.jit(lambda x, w: jnp.stack([
        td.ag_matmul_sharded(x * (1.0 + i), w, axis_name="tp") for i in range(calls)]))
    for _ in range(3):
        x, w = rand((world * m, k)), rand((k, world * n))
        out = f(place(mesh, x, P("tp", None)), place(mesh, w, P(None, "tp")))
        for i in range(calls):
            err = rel_err(out[i], f64(x) * (1.0 + i) @ f64(w))
            assert err < 1e-5, f"call {i}: relative error {err:.3g}"


def test_independent_calls_of_every_op_in_one_jit():
    """Every op twice, none depending on another, in one program at world 4."""
    world, m, k, n = 4, 8, 8, 4
    mesh = setup(world)
    from jaxtdist.ops.matmul_rs import matmul_ar, matmul_rs

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh,
                       in_specs=(P("tp", None), P(None, "tp"), P(None, "tp"), P("tp", None)),
                       out_specs=P())
    def mixed(x, w, xk, wk):
        outs = []
        for i in range(2):
            s = 1.0 + i
            outs += [td.ag_matmul(x * s, w, "tp"), td.all_gather(x * s, "tp"),
                     td.all_reduce(x * s, "tp"), td.reduce_scatter(xk * s, "tp"),
                     matmul_rs(xk * s, wk, "tp"), matmul_ar(xk * s, wk, "tp")]
        # Sums over the group give every result replicated, for one out_spec.
        return [jax.lax.psum(o, "tp") for o in outs]

    for _ in range(2):
        x, w = rand((world * m, k)), rand((k, world * n))
        xk, wk = rand((world * m, world * k)), rand((world * k, n))
        outs = mixed(place(mesh, x, P("tp", None)), place(mesh, w, P(None, "tp")),
                     place(mesh, xk, P(None, "tp")), place(mesh, wk, P("tp", None)))
        xs = [f64(x)[r * m:(r + 1) * m] for r in range(world)]
        xks = [f64(xk)[:, r * k:(r + 1) * k] for r in range(world)]
        wks = [f64(wk)[r * k:(r + 1) * k] for r in range(world)]
        for i in range(2):
            s = 1.0 + i
            partial = sum(a * s @ b for a, b in zip(xks, wks))  # [world*m, n]
            expect = [
                sum(np.concatenate(xs) * s @ f64(w)[:, r * n:(r + 1) * n] for r in range(world)),
                world * np.concatenate(xs) * s,
                world * sum(a * s for a in xs),
                sum(sum(a * s for a in xks)[r * m:(r + 1) * m] for r in range(world)),
                sum(partial[r * m:(r + 1) * m] for r in range(world)),
                world * partial,
            ]
            for j, e in enumerate(expect):
                err = rel_err(outs[6 * i + j], e)
                assert err < 1e-5, f"call {i}, op {j}: relative error {err:.3g}"
