"""jaxtdist.moe_dispatch_sharded / moe_combine_sharded (pjit-style, no hand-written
shard_map) on CPU devices (Triton interpreter): equal to the shard_map ops, against
the numpy layout reference and a float32 pure-JAX reference of the layer and its
gradients; program order between successive wrappers; misuse."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxtdist as td
from tests.conftest import assert_close, cpu_only, place, rand, rel_err, setup
from tests.test_cpu_moe import _ref_layer_global, ref_dispatch, routing

pytestmark = cpu_only()

BF16, F32 = jnp.bfloat16, jnp.float32
HANDLE_ARRAYS = ("expert_ids", "recv_counts", "src_pos", "src_tk", "src_ranges", "dropped",
                 "invalid")


def _experts(recv, sizes, w, groups):
    """The experts' GEMMs in pjit style: recv [G * R, H] (G = D * W devices),
    sizes [G * E_LOC], w [W, E_LOC, H, F] (each batch group has every expert)
    -> y [G * R, F], each device's rows through its own experts."""
    r = recv.shape[0] // groups
    w = jnp.broadcast_to(w[None], (groups // w.shape[0],) + w.shape).reshape(groups, *w.shape[1:])
    y = jax.vmap(jax.lax.ragged_dot)(recv.reshape(groups, r, -1), w, sizes.reshape(groups, -1))
    return y.reshape(groups * r, -1)


def _sharded_layer(e, rows, batch, groups):
    def layer(x, ids, w, gate):
        recv, sizes, handle = td.moe_dispatch_sharded(x, ids, axis_name="ep", batch_axes=batch,
                                                      num_experts=e, max_recv_rows=rows)
        y = _experts(recv, sizes, w, groups)
        out = td.moe_combine_sharded(y, handle, gate, axis_name="ep", batch_axes=batch)
        return recv, sizes, handle, y, out
    return layer


def _shard_map_twin(mesh, e, rows, batch):
    """The same calls in a hand-written shard_map: dispatch, and combine of the given y."""
    spec = P(tuple(batch) + ("ep",))

    def body(x, ids, gate, y):
        recv, sizes, handle = td.moe_dispatch(x, ids, "ep", num_experts=e, max_recv_rows=rows)
        out = td.moe_combine(y, handle, gate, "ep")
        fields = [getattr(handle, f) for f in HANDLE_ARRAYS]
        return recv, sizes, [f if f.ndim else f[None] for f in fields], out

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 4,
                                 out_specs=(spec, spec, [spec] * len(HANDLE_ARRAYS), spec)))


# (mesh shape, names, batch_axes, dtype, routing, max_recv_rows per device)
CASES = [((2,), ("ep",), (), F32, "random", None),
         ((4,), ("ep",), (), BF16, "random", None),
         ((4,), ("ep",), (), F32, "one_rank", None),
         ((2,), ("ep",), (), F32, "random", 3),                 # rows dropped
         ((2, 2), ("dp", "ep"), ("dp",), F32, "random", None),
         ((2, 1), ("dp", "ep"), ("dp",), F32, "random", None)]  # W = 1: local computation


@pytest.mark.parametrize("shape,names,batch,dtype,kind,rows", CASES)
def test_sharded_equals_shard_map_and_reference(shape, names, batch, dtype, kind, rows):
    mesh = setup(shape, names)
    groups, world = int(np.prod(shape)), shape[-1]
    t, h, f, k, e = 3, 16, 8, 2, 2 * world
    e_loc = e // world
    r = rows or world * t * min(k, e_loc)
    spec = P(tuple(batch) + ("ep",))
    layer = jax.jit(_sharded_layer(e, rows, batch, groups))
    twin = _shard_map_twin(mesh, e, rows, batch)
    rng = np.random.default_rng(groups * 100 + (rows or 0))
    for _ in range(2):  # both inbox parities, changing routings
        x = rand((groups * t, h), dtype)
        ids = routing(kind, groups, t, k, e, rng)
        w = rand((world, e_loc, h, f), dtype, scale=0.3)
        gate = rand((groups * t, k), F32)
        args = (place(mesh, x, spec), place(mesh, ids, spec), place(mesh, w, P("ep")),
                place(mesh, gate, spec))
        recv, sizes, handle, y, out = layer(*args)
        assert isinstance(handle, td.ops.moe.MoeHandle) and handle.max_recv_rows == r
        assert recv.shape == (groups * r, h) and sizes.shape == (groups * e_loc,)
        assert out.shape == (groups * t, f) and out.dtype == jnp.dtype(dtype)
        for a in (recv, sizes, out, *jax.tree_util.tree_leaves(handle)):
            assert a.sharding.is_equivalent_to(NamedSharding(mesh, spec), a.ndim), a.sharding

        # The shard_map ops on the same arrays (combine on the same y): the same bits.
        t_recv, t_sizes, t_fields, t_out = twin(args[0], args[1], args[3], y)
        np.testing.assert_array_equal(np.asarray(recv), np.asarray(t_recv))
        np.testing.assert_array_equal(np.asarray(sizes), np.asarray(t_sizes))
        for name, want in zip(HANDLE_ARRAYS, t_fields):
            np.testing.assert_array_equal(np.asarray(getattr(handle, name)), np.asarray(want),
                                          err_msg=name)
        np.testing.assert_array_equal(np.asarray(out), np.asarray(t_out))

        # The layout against the numpy reference, each batch group on its own.
        xg = np.asarray(x.astype(F32), np.float64).reshape(groups // world, world * t, h)
        idg = ids.reshape(groups // world, world * t, k)
        got = np.asarray(recv.astype(F32)).reshape(groups // world, world, r, h)
        kept = []
        for g in range(groups // world):
            want, want_sizes, want_dropped, where = ref_dispatch(xg[g], idg[g], world, e, r)
            for d in range(world):
                np.testing.assert_array_equal(got[g, d], want[d].astype(np.float32))
            np.testing.assert_array_equal(
                np.asarray(sizes).reshape(-1, world, e_loc)[g], np.stack(want_sizes))
            np.testing.assert_array_equal(
                np.asarray(handle.dropped).reshape(-1, world)[g], want_dropped)
            kept.append(where.reshape(world * t, k) >= 0)
        assert not np.any(np.asarray(handle.invalid))
        if rows is not None:
            assert np.asarray(handle.dropped).sum() > 0  # the case drops rows

        # The layer against a float32 reference (dropped pairs weigh zero).
        gate_kept = jnp.asarray(gate) * jnp.asarray(np.concatenate(kept))
        ref = _ref_layer_global(jnp.asarray(x, F32), jnp.asarray(ids), jnp.asarray(w, F32),
                                gate_kept, e, world)
        assert_close(np.asarray(out.astype(F32)), np.asarray(ref), dtype, 2.0)


@pytest.mark.parametrize("shape,names,batch", [((2,), ("ep",), ()), ((4,), ("ep",), ()),
                                               ((2, 2), ("dp", "ep"), ("dp",))])
def test_sharded_gradients(shape, names, batch):
    """d/d(x, w, gate) of dispatch -> experts' GEMMs -> combine, all pjit-style:
    against the float32 reference and the shard_map ops' gradients."""
    mesh = setup(shape, names)
    groups, world = int(np.prod(shape)), shape[-1]
    t, h, f, k, e = 3, 8, 8, 2, 2 * world
    spec = P(tuple(batch) + ("ep",))
    layer = _sharded_layer(e, None, batch, groups)

    def loss_sharded(x, ids, w, gate, c):
        return jnp.sum(layer(x, ids, w, gate)[-1] * c)

    def loss_shard_map(x, ids, w, gate, c):
        def body(x, ids, w, gate, c):
            recv, sizes, handle = td.moe_dispatch(x, ids, "ep", num_experts=e)
            out = td.moe_combine(jax.lax.ragged_dot(recv, w[0], sizes), handle, gate, "ep")
            return jax.lax.psum(jnp.sum(out * c), tuple(batch) + ("ep",))
        return jax.shard_map(body, mesh=mesh, in_specs=(spec, spec, P("ep"), spec, spec),
                             out_specs=P())(x, ids, w, gate, c)

    def loss_ref(x, ids, w, gate, c):
        return jnp.sum(_ref_layer_global(x, ids, w, gate, e, world) * c)

    x = rand((groups * t, h))
    ids = routing("random", groups, t, k, e, np.random.default_rng(groups + 7))
    w = rand((world, e // world, h, f), scale=0.3)
    gate = rand((groups * t, k))
    c = rand((groups * t, f))
    args = [place(mesh, a, P("ep") if a is w else spec) for a in (x, ids, w, gate, c)]
    got = jax.jit(jax.grad(loss_sharded, argnums=(0, 2, 3)))(*args)
    twin = jax.jit(jax.grad(loss_shard_map, argnums=(0, 2, 3)))(*args)
    want = jax.grad(loss_ref, argnums=(0, 2, 3))(*(jnp.asarray(a) for a in (x, ids, w, gate, c)))
    for name, g, s, r in zip(("x", "w", "gate"), got, twin, want):
        assert g.shape == r.shape, name
        err = rel_err(g, r)
        assert err < 1e-4, f"d{name}: relative error {err:.3g} against the float32 reference"
        err = rel_err(g, s)
        assert err < 1e-6, f"d{name}: relative error {err:.3g} against the shard_map ops"


def _shard_maps(jaxpr):
    return [eqn for eqn in jaxpr.eqns if eqn.primitive.name == "shard_map"]


def test_successive_wrappers_are_chained_in_one_order():
    """Independent dispatch/combine pairs (and an ag_matmul_sharded) in one jit: each
    wrapper's shard_map takes the previous one's result and order token as operands
    (one order on every device), and every result is right."""
    world, t, h, k, e, calls = 2, 3, 8, 2, 4, 3
    mesh = setup(world, ("ep",))
    spec = P("ep")

    def program(x, ids, wm):
        outs = []
        for i in range(calls):
            recv, _, handle = td.moe_dispatch_sharded(x * (1.0 + i), (ids + i) % e,
                                                      axis_name="ep", num_experts=e)
            outs.append(td.moe_combine_sharded(recv * 0.5 + 1.0, handle,
                                               jnp.full(ids.shape, 0.5), axis_name="ep"))
        return jnp.stack(outs), td.ag_matmul_sharded(x, wm, axis_name="ep")

    x = rand((world * t, h))
    ids = routing("random", world, t, k, e, np.random.default_rng(3))
    wm = rand((h, world * 4))
    args = (place(mesh, x, spec), place(mesh, ids, spec), place(mesh, wm, P(None, "ep")))

    maps = _shard_maps(jax.make_jaxpr(program)(*args).jaxpr)
    assert len(maps) == 2 * calls + 1
    for before, after in zip(maps, maps[1:]):
        # The previous wrapper's first result and its order token, side by side (after
        # any constants the body closes over).
        pairs = list(zip(after.invars, after.invars[1:]))
        assert any(a is before.outvars[0] and b is before.outvars[-1] for a, b in pairs)

    outs, prod = jax.jit(program)(*args)
    for i in range(calls):  # sum over K = 2 experts of 0.5 * (0.5 x (1 + i) + 1)
        err = rel_err(outs[i], 0.5 * (1.0 + i) * np.asarray(x, np.float64) + 1.0)
        assert err < 1e-6, f"call {i}: relative error {err:.3g}"
    assert rel_err(prod, np.asarray(x, np.float64) @ np.asarray(wm, np.float64)) < 1e-5


@pytest.mark.parametrize("zero_unused_rows", [True, False])
def test_mesh_axes_not_named_are_replicated(zero_unused_rows):
    """On an (ep, x) mesh with experts over ep, x replicates everything: right
    results and gradients (each x group exchanges among its own ep ranks); the
    same without zeroing recv_x's unused rows (combine reads only received ones)."""
    mesh = setup((2, 2), ("ep", "x"))
    t, h, k, e = 3, 8, 2, 4
    x, gate = rand((2 * t, h)), rand((2 * t, k))
    ids = place(mesh, routing("random", 2, t, k, e, np.random.default_rng(4)), P("ep"))

    def layer(x, gate):
        recv, _, handle = td.moe_dispatch_sharded(x, ids, axis_name="ep", num_experts=e,
                                                  zero_unused_rows=zero_unused_rows)
        return td.moe_combine_sharded(recv * 3.0, handle, gate, axis_name="ep")

    args = (place(mesh, x, P("ep")), place(mesh, gate, P("ep")))
    out = jax.jit(layer)(*args)
    gx = jax.jit(jax.grad(lambda *a: jnp.sum(layer(*a) ** 2)))(*args)
    ref = 3.0 * np.asarray(x, np.float64) * np.asarray(gate).sum(1, keepdims=True)
    assert rel_err(out, ref) < 1e-6
    assert rel_err(gx, 6.0 * ref * np.asarray(gate).sum(1, keepdims=True)) < 1e-6


def test_sharded_misuse():
    mesh = setup((2, 2), ("dp", "ep"))
    spec = P(("dp", "ep"))
    x = place(mesh, rand((8, 4)), spec)
    ids = place(mesh, np.tile(np.array([[0, 1]], np.int32), (8, 1)), spec)
    gate = place(mesh, rand((8, 2)), spec)

    def dispatch(x=x, ids=ids, **kw):
        kw = dict(dict(axis_name="ep", batch_axes="dp", num_experts=4), **kw)
        return td.moe_dispatch_sharded(x, ids, **kw)

    with pytest.raises(ValueError, match=r"'tp' is not an axis of the mesh; its axes are "
                                         r"\('dp', 'ep'\)"):
        dispatch(axis_name="tp")
    with pytest.raises(ValueError, match="axis_name 'ep' is also in batch_axes"):
        dispatch(batch_axes=("dp", "ep"))
    with pytest.raises(ValueError, match=r"x has 6 rows, not a multiple of the 4 devices of "
                                         r"the rows' mesh axes \(dp=2 x ep=2\)"):
        dispatch(x=jnp.zeros((6, 4)), ids=jnp.zeros((6, 2), jnp.int32))
    with pytest.raises(ValueError, match=r"x must be the global tokens \[W \* T, H\]"):
        dispatch(x=jnp.zeros((8,)))
    with pytest.raises(ValueError, match=r"expert_ids must be \[W \* T, K\] with as many rows "
                                         r"as x \(8\), got shape \(4, 2\)"):
        dispatch(ids=jnp.zeros((4, 2), jnp.int32))
    with pytest.raises(ValueError, match="num_experts=3 must be a positive multiple"):
        dispatch(num_experts=3)
    with pytest.raises(ValueError, match="must be int32"):
        dispatch(ids=jnp.zeros((8, 2), jnp.float32))

    recv, sizes, handle = dispatch()
    assert recv.shape == (4 * 2 * 2 * 2, 4) and handle.dropped.shape == (4,)

    def combine(y=recv, handle=handle, weights=gate, **kw):
        kw = dict(dict(axis_name="ep", batch_axes="dp"), **kw)
        return td.moe_combine_sharded(y, handle, weights, **kw)

    assert rel_err(combine(), np.asarray(x, np.float64) * np.asarray(gate).sum(1, keepdims=True)
                   ) < 1e-6
    with pytest.raises(ValueError, match=r"handle must be the MoeHandle that "
                                         r"moe_dispatch_sharded returned .* got str"):
        combine(handle="nope")
    with pytest.raises(ValueError, match=r"batch_axes \(\).* shape \(2,\)\); got a MoeHandle "
                                         r"whose dropped has shape \(4,\)"):
        combine(batch_axes=())  # made over dp x ep, combined over ep only
    with pytest.raises(ValueError, match="got a MoeHandle whose dropped has shape \\(\\)"):
        combine(handle=dataclasses.replace(handle, dropped=jnp.int32(0)))  # a shard_map handle
    with pytest.raises(ValueError, match=r"y must be \[G \* R, F\] = \[32, F\].* got shape "
                                         r"\(8, 4\)"):
        combine(y=x)
    with pytest.raises(ValueError, match=r"weights must be \[W \* T, K\] = \(8, 2\) .* got "
                                         r"shape \(8, 3\)"):
        combine(weights=jnp.ones((8, 3)))
    with pytest.raises(ValueError, match="'tp' is not an axis of the mesh"):
        combine(axis_name="tp")


# -- fp8 (x_scale) ----------------------------------------------------------------------

E4M3 = jnp.float8_e4m3fn


@pytest.mark.parametrize("shape,names,batch,scales,rows", [
    ((2,), ("ep",), (), 2, None),
    ((2, 2), ("dp", "ep"), ("dp",), 1, 3)])  # rows dropped
def test_sharded_fp8_dispatch(shape, names, batch, scales, rows):
    """moe_dispatch_sharded(..., x_scale=): the shard_map op's (recv_x, recv_scale),
    sizes and handle, bit for bit, sharded like x; dequantized, the rows of the
    float32 dispatch of the dequantized tokens; then a combine_sharded of them."""
    from jaxtdist.bench.moe import fp8_dequantize, fp8_tokens

    mesh = setup(shape, names)
    groups, world = int(np.prod(shape)), shape[-1]
    t, h, k, e = 3, 32, 2, 2 * world
    spec = P(tuple(batch) + ("ep",))
    rng = np.random.default_rng(groups * 10 + scales)
    q, scale = fp8_tokens(rng.standard_normal((groups * t, h)).astype(np.float32), scales, E4M3)
    ids = routing("random", groups, t, k, e, rng)
    gate = rand((groups * t, k))

    def sharded(q, scale, ids, gate):
        (rq, rs), sizes, handle = td.moe_dispatch_sharded(
            q, ids, axis_name="ep", batch_axes=batch, num_experts=e, max_recv_rows=rows,
            x_scale=scale)
        ref, ref_sizes, _ = td.moe_dispatch_sharded(
            fp8_dequantize(q, scale), ids, axis_name="ep", batch_axes=batch, num_experts=e,
            max_recv_rows=rows)
        out = td.moe_combine_sharded(fp8_dequantize(rq, rs), handle, gate, axis_name="ep",
                                     batch_axes=batch)
        return rq, rs, sizes, handle, ref, ref_sizes, out

    def body(q, scale, ids, gate):
        (rq, rs), sizes, handle = td.moe_dispatch(q, ids, "ep", num_experts=e,
                                                  max_recv_rows=rows, x_scale=scale)
        out = td.moe_combine(fp8_dequantize(rq, rs), handle, gate, "ep")
        return rq, rs, sizes, handle.dropped[None], out

    args = [place(mesh, a, spec) for a in (q, scale, ids, gate)]
    rq, rs, sizes, handle, ref, ref_sizes, out = jax.jit(sharded)(*args)
    t_rq, t_rs, t_sizes, t_dropped, t_out = jax.jit(jax.shard_map(
        body, mesh=mesh, in_specs=(spec,) * 4, out_specs=(spec,) * 5))(*args)

    r = rows or world * t * min(k, e // world)
    assert rq.dtype == jnp.dtype(E4M3) and rq.shape == (groups * r, h)
    assert rs.dtype == jnp.float32 and rs.shape == (groups * r, scales)
    for a in (rq, rs, sizes, out, *jax.tree_util.tree_leaves(handle)):
        assert a.sharding.is_equivalent_to(NamedSharding(mesh, spec), a.ndim), a.sharding
    for got, want in ((rq, t_rq), (rs, t_rs), (sizes, t_sizes), (handle.dropped, t_dropped),
                      (out, t_out)):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    np.testing.assert_array_equal(np.asarray(sizes), np.asarray(ref_sizes))
    assert rel_err(fp8_dequantize(rq, rs), ref) < 1e-6
    if rows is not None:
        assert int(np.sum(np.asarray(handle.dropped))) > 0, "no row dropped: tests nothing"


def test_sharded_fp8_misuse():
    from jaxtdist.bench.moe import fp8_tokens

    mesh = setup((2,), ("ep",))
    spec = P("ep")
    x = rand((8, 32))
    q, scale = fp8_tokens(x, 2, E4M3)
    ids = place(mesh, routing("random", 2, 4, 2, 4, np.random.default_rng(5)), spec)

    def dispatch(x=q, x_scale=scale):
        return td.moe_dispatch_sharded(
            place(mesh, x, spec), ids, axis_name="ep", num_experts=4,
            x_scale=None if x_scale is None else place(mesh, x_scale, spec))

    with pytest.raises(ValueError, match=r"moe_dispatch_sharded: x_scale must be \[W \* T, S\] "
                                         r"with as many rows as x \(8.* got shape \(4, 2\)"):
        dispatch(x_scale=scale[:4])
    with pytest.raises(ValueError, match="fp8 tokens need their scales"):
        dispatch(x_scale=None)
    with pytest.raises(ValueError, match="x must be fp8"):
        dispatch(x=x)
    with pytest.raises(ValueError, match="S >= 1 dividing H = 32"):
        dispatch(x_scale=np.ones((8, 3), np.float32))
    with pytest.raises(ValueError, match="x_scale has dtype bfloat16"):
        dispatch(x_scale=np.ones((8, 2), jnp.bfloat16))
    with pytest.raises(TypeError, match="fp8 path .* is not differentiable"):
        jax.grad(lambda s: jnp.sum(td.moe_dispatch_sharded(
            place(mesh, q, spec), ids, axis_name="ep", num_experts=4,
            x_scale=s)[0][1]))(place(mesh, scale, spec))


def test_sharded_dispatch_over_a_tuple_of_axes():
    """axis_name=("dp", "ep"): the four devices as one expert group (dp outermost),
    as the shard_map op over the same tuple."""
    mesh = setup((2, 2), ("dp", "ep"))
    spec, e = P(("dp", "ep")), 8
    x, ids = rand((12, 8)), routing("random", 4, 3, 2, e, np.random.default_rng(1))
    args = (place(mesh, x, spec), place(mesh, ids, spec))
    recv, sizes, handle = jax.jit(lambda x, i: td.moe_dispatch_sharded(
        x, i, axis_name=("dp", "ep"), num_experts=e))(*args)
    t_recv, t_sizes = jax.jit(jax.shard_map(
        lambda x, i: td.moe_dispatch(x, i, ("dp", "ep"), num_experts=e)[:2], mesh=mesh,
        in_specs=(spec, spec), out_specs=(spec, spec)))(*args)
    assert handle.dropped.shape == (4,)
    np.testing.assert_array_equal(np.asarray(recv), np.asarray(t_recv))
    np.testing.assert_array_equal(np.asarray(sizes), np.asarray(t_sizes))
