"""Adversarial use of the public ops on CPU, with default settings: what the other
test files leave out. A group of 3 ranks (not a power of two) and of 1, odd and
prime shapes, every dtype and the unsupported ones, odd axis names, a tuple of a
2-D mesh's axes in both orders, vmap with unbatched operands and other batch
axes, grad through checkpoint, scan and vmap, several shapes of one op in one
jit, NumPy integers as static arguments, re-initializing on another mesh, and
the Flax layers on a (1, 3) and a (2, 3) mesh.

Every numeric check draws fresh random inputs and compares against a float64
numpy (or float32 XLA) reference by relative error; every error check matches
what the message must say. Regression tests of bugs found this way say which.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxtdist as td
from tests.conftest import (TOL, assert_close, cpu_only, f64, mesh_of, place, rand, rel_err, setup,
                            slow)

pytestmark = cpu_only()

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
ROWS, COLS = P("tp", None), P(None, "tp")


def _sm(mesh, body, in_specs, out_specs, **kw):
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, **kw))


def _name(dtype) -> str:
    return jnp.dtype(dtype).name


# -- the matmul ops: worlds 3 and 1, odd and prime shapes, every dtype --------------------

# (m, k, n) per rank: a 1 x 3 x 1 product, a prime K past the CPU blocks, small odd.
MATMUL_SHAPES = [((1, 3, 1), F32), ((17, 257, 3), BF16), ((3, 17, 5), F16)]


@pytest.mark.parametrize("world", [3, 1])
@pytest.mark.parametrize("op", ["ag_matmul", "matmul_rs", "matmul_ar"])
@pytest.mark.parametrize("shape,dtype", MATMUL_SHAPES,
                         ids=[f"{'x'.join(map(str, s))}-{_name(d)}" for s, d in MATMUL_SHAPES])
def test_matmul_ops_odd_shapes(world, op, shape, dtype):
    mesh = setup(world)
    m, k, n = shape
    if op == "ag_matmul":
        x, w = rand((world * m, k), dtype), rand((k, world * n), dtype)
        specs, out = (ROWS, COLS), COLS
        f = _sm(mesh, lambda a, b: td.ag_matmul(a, b, "tp"), specs, out)
    elif op == "matmul_rs":
        x, w = rand((world * m, world * k), dtype), rand((world * k, n), dtype)
        specs, out = (COLS, ROWS), ROWS
        f = _sm(mesh, lambda a, b: td.matmul_rs(a, b, "tp"), specs, out)
    else:
        x, w = rand((m, world * k), dtype), rand((world * k, n), dtype)
        specs, out = (COLS, ROWS), P()
        f = _sm(mesh, lambda a, b: td.matmul_ar(a, b, "tp"), specs, out, check_vma=False)
    got = f(place(mesh, x, specs[0]), place(mesh, w, specs[1]))
    assert got.dtype == jnp.dtype(dtype)
    assert_close(got, f64(x) @ f64(w), dtype)


@pytest.mark.parametrize("world", [3, 4])
@pytest.mark.parametrize("shape,split_k", [((4, 16, 8), 1), ((16, 32, 32), 1), ((2, 5, 3), 1),
                                           ((3, 40, 24), 3)])
def test_matmul_ar_same_bits_on_every_rank(world, shape, split_k):
    """Regression: matmul_ar's float32 sum had each rank add the partials in its own
    order (its own first), so from 3 ranks on the ranks' results differed in the
    last bits (up to 211 of 1024 elements at W=4), against the README's "the same
    bits everywhere". Fixed in kernels/matmul_ar.py: rank order on every rank. With
    K split, each rank's partial is summed in split order before the push."""
    mesh = setup(world)
    m, k, n = shape
    x, w = rand((m, world * k)), rand((world * k, n))
    cfg = dict(SPLIT_K=split_k, BLOCK_K=16) if split_k > 1 else None
    f = _sm(mesh, lambda a, b: td.matmul_ar(a, b, "tp", config=cfg)[None], (COLS, ROWS),
            P("tp"))
    out = np.asarray(f(place(mesh, x, COLS), place(mesh, w, ROWS)))
    for r in range(1, world):
        np.testing.assert_array_equal(out[r], out[0], err_msg=f"rank {r} differs from rank 0")
    assert_close(out[0], f64(x) @ f64(w), F32)


# -- collectives: world 3 and 1, odd shapes, every dtype, every axis -------------------

COLLECTIVE_SHAPES = [((1,), F32), ((3, 17), BF16), ((257,), F16)]


@pytest.mark.parametrize("world", [3, 1])
@pytest.mark.parametrize("shape,dtype", COLLECTIVE_SHAPES,
                         ids=[f"{'x'.join(map(str, s))}-{_name(d)}" for s, d in COLLECTIVE_SHAPES])
def test_collectives_odd_shapes(world, shape, dtype):
    mesh = setup(world)
    g = rand((world * shape[0],) + shape[1:], dtype)
    gathered = _sm(mesh, lambda a: td.all_gather(a, "tp"), (P("tp"),), P(), check_vma=False)(
        place(mesh, g, P("tp")))
    np.testing.assert_array_equal(f64(gathered), f64(g))
    x = rand((world,) + shape, dtype)
    summed = _sm(mesh, lambda a: td.all_reduce(a[0], "tp"), (P("tp"),), P(), check_vma=False)(
        place(mesh, x, P("tp")))
    assert summed.dtype == jnp.dtype(dtype)
    assert_close(summed, f64(x).sum(0), dtype)
    y = rand((world, world * shape[0]) + shape[1:], dtype)
    scattered = _sm(mesh, lambda a: td.reduce_scatter(a[0], "tp"), (P("tp"),), P("tp"))(
        place(mesh, y, P("tp")))
    assert_close(scattered, f64(y).sum(0), dtype)


@pytest.mark.parametrize("dtype,n", [(F32, 65536 + 7)])
def test_all_reduce_two_shot_at_world_3(dtype, n):
    """Above 256 KiB per rank (two-shot: a reduce-scatter of 3 uneven blocks, then a
    gather), a size no rank count divides; the same bits on every rank."""
    world = 3
    mesh = setup(world)
    x = rand((world, n), dtype)
    f = _sm(mesh, lambda a: td.all_reduce(a[0], "tp")[None], (P("tp"),), P("tp"))
    out = np.asarray(f(place(mesh, x, P("tp"))))
    for r in range(1, world):
        np.testing.assert_array_equal(out[r], out[0])
    assert_close(out[0], f64(x).sum(0), dtype)


@pytest.mark.parametrize("world", [3, 1])
@pytest.mark.parametrize("axis", [-4, -3, -2, -1, 0, 1, 2, 3])
def test_all_gather_stacked_axis_matches_lax(world, axis):
    """Regression: with tiled=False a negative axis counted from the end of x, not of
    the result as jax.lax.all_gather does: axis=-1 stacked at x.ndim - 1 (another
    shape), axis=-2 gave lax's shape with other values (silently wrong), and
    axis=x.ndim or -(x.ndim + 1), which lax takes, were refused. Gradients too."""
    mesh = setup(world)
    x = place(mesh, rand((world * 2, 3, 4)), P("tp"))
    ours = jax.shard_map(lambda a: td.all_gather(a, "tp", axis=axis, tiled=False), mesh=mesh,
                         in_specs=P("tp"), out_specs=P("tp"))
    lax = jax.shard_map(lambda a: jax.lax.all_gather(a, "tp", axis=axis, tiled=False),
                        mesh=mesh, in_specs=P("tp"), out_specs=P("tp"))
    got, want = jax.jit(ours)(x), jax.jit(lax)(x)
    assert got.shape == want.shape
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    c = jnp.asarray(rand(want.shape))
    g_ours = jax.jit(jax.grad(lambda a: jnp.sum(jnp.sin(ours(a)) * c)))(x)
    g_lax = jax.jit(jax.grad(lambda a: jnp.sum(jnp.sin(lax(a)) * c)))(x)
    assert rel_err(g_ours, g_lax) < 1e-6


@pytest.mark.parametrize("op,kwargs,shape,match", [
    ("all_gather", dict(axis=3), (2, 3, 4), r"axis=3 is out of range.*\(2, 3, 4\)"),
    ("all_gather", dict(axis=4, tiled=False), (2, 3, 4), r"axis=4 is out of range"),
    ("all_gather", dict(axis=-5, tiled=False), (2, 3, 4), r"axis=-5 is out of range"),
    ("all_gather", dict(axis=1.0), (2, 3, 4), r"axis must be an int, got 1.0"),
    ("reduce_scatter", dict(scatter_dimension=1), (3, 4), r"has size 4, which the group's 3"),
    ("reduce_scatter", dict(scatter_dimension=-3), (3, 3), r"scatter_dimension=-3 is out of"),
])
def test_collective_bad_axes_at_world_3(op, kwargs, shape, match):
    mesh = setup(3)
    x = place(mesh, rand((3,) + shape), P("tp"))
    fn = getattr(td, op)
    with pytest.raises(ValueError, match=match):
        _sm(mesh, lambda a: fn(a[0], "tp", **kwargs)[None], (P("tp"),), P("tp"))(x)


def test_numpy_integers_are_ints():
    """Regression: NumPy integers (from a shape or a config) as static arguments were
    refused: num_experts=np.int64(3) with "num_experts=np.int64(3) must be a positive
    multiple of the group size W=3" (self-contradicting), all_gather's axis with
    "must be an int". jax.lax takes them; now jaxtdist does."""
    world = 3
    mesh = setup(world)
    x = rand((world * 2, 3, 4))
    got = _sm(mesh, lambda a: td.all_gather(a, "tp", axis=np.int64(1)), (P("tp"),), P(),
              check_vma=False)(place(mesh, x, P("tp")))
    np.testing.assert_array_equal(f64(got), np.concatenate(list(f64(x).reshape(world, 2, 3, 4)),
                                                           axis=1))
    y = rand((world, 2, 6))
    got = _sm(mesh, lambda a: td.reduce_scatter(a[0], "tp", scatter_dimension=np.int32(1)),
              (P("tp"),), P("tp"))(place(mesh, y, P("tp")))
    assert_close(got, np.concatenate(np.split(f64(y).sum(0), world, axis=1)), F32)
    t, h = 2, 4
    xs = rand((world * t, h))
    ids = np.array([[(r + i) % world] for r in range(world) for i in range(t)], np.int32)

    def layer(a, i):
        recv, _, handle = td.moe_dispatch(a, i, "tp", num_experts=np.int64(world),
                                          max_recv_rows=np.int32(world * t))
        return td.moe_combine(recv * 2.0, handle, jnp.ones(i.shape), "tp")
    out = _sm(mesh, layer, (P("tp"), P("tp")), P("tp"))(place(mesh, xs, P("tp")),
                                                        place(mesh, ids, P("tp")))
    assert_close(out, 2 * f64(xs), F32)
    # Floats and bools stay refused, saying an int is wanted.
    with pytest.raises(ValueError, match=r"num_experts=3.0 must be .*an int"):
        _sm(mesh, lambda a, i: td.moe_dispatch(a, i, "tp", num_experts=3.0)[0],
            (P("tp"), P("tp")), P("tp"))(place(mesh, xs, P("tp")), place(mesh, ids, P("tp")))
    with pytest.raises(ValueError, match=r"axis must be an int"):
        _sm(mesh, lambda a: td.all_gather(a, "tp", axis=np.bool_(True)), (P("tp"),), P("tp"))(
            place(mesh, x, P("tp")))


# -- dtypes --------------------------------------------------------------------------

def _dtype_call(op, mesh, dtype):
    a2 = jnp.ones((6, 6), dtype)
    a1 = jnp.ones((6,), dtype)
    if op == "ag_matmul":
        return _sm(mesh, lambda a, b: td.ag_matmul(a, b, "tp"), (ROWS, COLS), COLS)(a2, a2)
    if op == "matmul_rs":
        return _sm(mesh, lambda a, b: td.matmul_rs(a, b, "tp"), (COLS, ROWS), ROWS)(a2, a2)
    if op == "matmul_ar":
        return _sm(mesh, lambda a, b: td.matmul_ar(a, b, "tp"), (COLS, ROWS), P(),
                   check_vma=False)(a2, a2)
    if op in ("all_gather", "all_reduce", "reduce_scatter"):
        return _sm(mesh, lambda a: getattr(td, op)(a, "tp"), (P("tp"),), P("tp"),
                   check_vma=False)(a1)
    if op == "grouped_matmul":
        return _sm(mesh, lambda a, b: td.grouped_matmul(a, b, jnp.array([1, 1], jnp.int32)),
                   (P(), P()), P())(a2[:2, :3], jnp.ones((2, 3, 3), dtype))
    if op == "moe_dispatch":
        return _sm(mesh, lambda a: td.moe_dispatch(a, jnp.zeros((2, 1), jnp.int32), "tp",
                                                   num_experts=3)[0], (P("tp"),), P("tp"))(a2)
    if op == "flash_decode":
        q, kv = jnp.ones((1, 2, 4), dtype), jnp.ones((1, 3, 1, 4), dtype)
        return _sm(mesh, lambda q, k, v: td.flash_decode(q, k, v, jnp.array([3]), "tp"),
                   (P(), P(None, "tp"), P(None, "tp")), P())(q, kv, kv)
    if op == "ag_attention":
        q = jnp.ones((1, 3, 2, 4), dtype)
        return _sm(mesh, lambda q, k, v: td.ag_attention(q, k, v, "tp"), (P(None, "tp"),) * 3,
                   P(None, "tp"))(q, q, q)
    raise AssertionError(op)


DTYPE_OPS = ["ag_matmul", "matmul_rs", "matmul_ar", "all_gather", "all_reduce",
             "reduce_scatter", "grouped_matmul", "moe_dispatch", "flash_decode", "ag_attention"]


@pytest.mark.parametrize("op", DTYPE_OPS)
@pytest.mark.parametrize("dtype", [jnp.int32, jnp.bool_, jnp.complex64, jnp.float8_e4m3fn,
                                   jnp.float64], ids=_name)
def test_unsupported_dtypes_name_the_dtype_and_the_allowed_ones(op, dtype):
    mesh = setup(3)
    match = rf"jaxtdist\.{op}: \w+ has dtype {_name(dtype)}; supported dtypes are bfloat16, " \
            r"float16, float32"
    if op == "moe_dispatch" and dtype == jnp.float8_e4m3fn:  # fp8 dispatch takes scales
        match = rf"({match}|x is float8_e4m3fn: fp8 tokens need their scales)"
    if (op in ("ag_matmul", "matmul_rs", "matmul_ar", "grouped_matmul")
            and dtype == jnp.float8_e4m3fn):
        # FP8 GEMMs take scales (tests/test_cpu_fp8.py, test_cpu_fp8_grouped.py).
        match = (rf"jaxtdist\.{op}: x and w are float8_e4m3fn: FP8 operands need their "
                 r"dequantization scales; x_scale is missing")
    with jax.enable_x64(dtype == jnp.float64):
        with pytest.raises(ValueError, match=match):
            _dtype_call(op, mesh, dtype)


def test_float32_ops_under_x64():
    """jax_enable_x64 on: float32 operands and int64 lengths / group sizes still work
    (results and gradients stay float32)."""
    world = 3
    mesh = setup(world)
    with jax.enable_x64(True):
        x, w = rand((world * 2, 5)), rand((5, world * 3))
        f = _sm(mesh, lambda a, b: td.ag_matmul(a, b, "tp"), (ROWS, COLS), COLS)
        px, pw = place(mesh, x, ROWS), place(mesh, w, COLS)
        out = f(px, pw)
        assert out.dtype == jnp.float32
        assert_close(out, f64(x) @ f64(w), F32)
        grads = jax.jit(jax.grad(lambda a, b: jnp.sum(f(a, b)), argnums=(0, 1)))(px, pw)
        assert [g.dtype for g in grads] == [jnp.float32] * 2
        q, kv = rand((1, 2, 4)), rand((1, world * 2, 1, 4))
        lens = jnp.array([5])  # int64 under x64
        assert lens.dtype == jnp.int64
        fd = _sm(mesh, lambda q, k, v, n: td.flash_decode(q, k, v, n, "tp"),
                 (P(), P(None, "tp"), P(None, "tp"), P()), P())
        assert fd(q, place(mesh, kv, P(None, "tp")), place(mesh, kv, P(None, "tp")),
                  lens).dtype == jnp.float32


# -- axis names ----------------------------------------------------------------------

@pytest.mark.parametrize("axis_name,shown", [(0, r"0 \(int\)"), (1.5, r"1.5 \(float\)"),
                                              (b"tp", r"b'tp' \(bytes\)"),
                                              ({"tp"}, r"\{'tp'\} \(set\)")])
@pytest.mark.parametrize("op", ["ag_matmul", "all_reduce"])
def test_axis_name_of_the_wrong_type_is_a_clear_error(op, axis_name, shown):
    """Regression: an int axis_name raised "TypeError: 'int' object is not iterable",
    bytes b"tp" said "axis_name 116 is not an axis", and a set was accepted (its
    order, the rank order of a tuple of axes, undefined)."""
    mesh = setup(2)
    x = place(mesh, rand((4, 4)), ROWS)
    with pytest.raises(ValueError, match=rf"axis_name must be a mesh axis name \(a str\) or a "
                                         rf"tuple of them, got {shown}"):
        if op == "ag_matmul":
            _sm(mesh, lambda a, b: td.ag_matmul(a, b, axis_name), (ROWS, COLS), COLS)(
                x, place(mesh, rand((4, 4)), COLS))
        else:
            _sm(mesh, lambda a: td.all_reduce(a, axis_name), (ROWS,), ROWS)(x)


@pytest.mark.parametrize("axes", [("dp", "tp"), ["dp", "tp"], ("tp", "dp"), "tp", ("tp",),
                                  "dp"])
def test_ag_matmul_and_matmul_rs_over_axes_of_a_2x3_mesh(axes):
    """One axis, a tuple (or list) of both in either order: the group's rank order is
    the tuple's, as in jax.lax (row blocks placed accordingly)."""
    mesh = setup((2, 3), ("dp", "tp"))
    spec = tuple(axes) if isinstance(axes, list) else axes
    x, w = rand((6, 5)), rand((5, 12))
    f = _sm(mesh, lambda a, b: td.ag_matmul(a, b, axes), (P(spec, None), P(None, spec)),
            P(None, spec))
    assert_close(f(place(mesh, x, P(spec, None)), place(mesh, w, P(None, spec))),
                 f64(x) @ f64(w), F32)
    x, w = rand((6, 12)), rand((12, 7))
    g = _sm(mesh, lambda a, b: td.matmul_rs(a, b, axes), (P(None, spec), P(spec, None)),
            P(spec, None))
    assert_close(g(place(mesh, x, P(None, spec)), place(mesh, w, P(spec, None))),
                 f64(x) @ f64(w), F32)


@pytest.mark.parametrize("axes", [("dp", "tp"), "tp"])
def test_all_reduce_and_reduce_scatter_over_axes_of_a_2x3_mesh(axes):
    mesh = setup((2, 3), ("dp", "tp"))
    every = P(("dp", "tp"))
    x = rand((6, 4))
    out = _sm(mesh, lambda a: td.all_reduce(a, axes), (every,), every)(place(mesh, x, every))
    per = f64(x).reshape(2, 3, 4)  # [dp, tp, 4]: one row per device
    ref = (np.broadcast_to(per.sum((0, 1)), per.shape) if axes != "tp"
           else np.broadcast_to(per.sum(1, keepdims=True), per.shape))
    assert_close(out, ref.reshape(6, 4), F32)
    y = rand((6, 6, 4))
    out = _sm(mesh, lambda a: td.reduce_scatter(a[0], axes), (every,), every)(
        place(mesh, y, every))
    if axes != "tp":
        ref = f64(y).sum(0)
    else:
        s = f64(y).reshape(2, 3, 6, 4).sum(1)  # per dp group; tp rank t gets rows 2t, 2t+1
        ref = np.concatenate([s[d].reshape(3, 2, 4)[t] for d in range(2) for t in range(3)])
    assert_close(out, ref, F32)


@pytest.mark.parametrize("op", ["ag_matmul_sharded", "matmul_rs_sharded", "matmul_ar_sharded"])
def test_sharded_form_with_a_tuple_axis_name(op):
    """axis_name=("dp", "tp"): the six devices as one group (dp outermost), as a
    tuple of axes means inside shard_map."""
    setup((2, 3), ("dp", "tp"))
    fn = getattr(td, op)
    x, w = (rand((12, 5)), rand((5, 12))) if op == "ag_matmul_sharded" else (
        rand((12, 12)), rand((12, 5)))
    out = jax.jit(lambda a, b: fn(a, b, axis_name=("dp", "tp")))(jnp.asarray(x), jnp.asarray(w))
    assert_close(out, f64(x) @ f64(w), F32)
    with pytest.raises(ValueError, match="a tuple of distinct ones"):
        fn(jnp.asarray(x), jnp.asarray(w), axis_name=("tp", "tp"))
    with pytest.raises(ValueError, match="is also in batch_axes"):
        fn(jnp.asarray(x), jnp.asarray(w), axis_name=("dp", "tp"), batch_axes="dp")


# -- the _sharded forms on a 2 x 3 mesh ----------------------------------------------

@pytest.mark.parametrize("op", ["ag_matmul_sharded", "matmul_rs_sharded", "matmul_ar_sharded"])
@pytest.mark.parametrize("batch_axes", [(), "dp"])
def test_sharded_forms_on_a_2x3_mesh_forward_and_grad(op, batch_axes):
    setup((2, 3), ("dp", "tp"))
    fn = getattr(td, op)
    x, w = (rand((12, 5)), rand((5, 9))) if op == "ag_matmul_sharded" else (rand((6, 9)),
                                                                          rand((9, 5)))
    f = jax.jit(lambda a, b: fn(a, b, axis_name="tp", batch_axes=batch_axes))
    assert_close(f(jnp.asarray(x), jnp.asarray(w)), f64(x) @ f64(w), F32)
    loss = lambda g: lambda a, b: jnp.sum(jnp.sin(g(a, b)))  # noqa: E731
    got = jax.jit(jax.grad(loss(f), argnums=(0, 1)))(jnp.asarray(x), jnp.asarray(w))
    want = jax.grad(loss(lambda a, b: a @ b), argnums=(0, 1))(jnp.asarray(x), jnp.asarray(w))
    for g, r in zip(got, want):
        assert_close(g, f64(r), F32, factor=10)


def test_sharded_forms_refuse_shapes_the_group_does_not_divide():
    setup((2, 3), ("dp", "tp"))
    with pytest.raises(ValueError, match=r"rows of x \(M=5\) must be divisible by the group "
                                         r"size W=3"):
        jax.jit(lambda a, b: td.matmul_rs_sharded(a, b, axis_name="tp"))(
            jnp.asarray(rand((5, 6))), jnp.asarray(rand((6, 4))))
    with pytest.raises(ValueError, match=r"axis_name 'tp' is also in batch_axes"):
        jax.jit(lambda a, b: td.ag_matmul_sharded(a, b, axis_name="tp", batch_axes="tp"))(
            jnp.asarray(rand((6, 5))), jnp.asarray(rand((5, 6))))
    # Regression (an adversarial sweep): a mesh= other than the initialized one said
    # "the shard_map's mesh differs" and added a note on shard shapes.
    for other in (mesh_of((6,), ("tp",)), mesh_of((3, 2), ("tp", "dp"))):
        with pytest.raises(ValueError, match=r"ag_matmul_sharded: mesh= \{.*\} differs from the "
                                             r"mesh given to jaxtdist.initialize \{'dp': 2, "
                                             r"'tp': 3\}; leave mesh= out"):
            jax.jit(lambda a, b: td.ag_matmul_sharded(a, b, axis_name="tp", mesh=other))(
                jnp.asarray(rand((6, 5))), jnp.asarray(rand((5, 6))))


@pytest.mark.parametrize("op", ["moe_dispatch", "flash_decode", "ag_matmul"])
def test_sharded_forms_inside_shard_map_say_which_form_to_call(op):
    """A _sharded form called inside shard_map (its own shard_map would nest in the
    caller's) names the form to call there. Regression: a divisibility error about
    the local shard, or JAX's "context mesh ... should match the mesh passed to
    shard_map"."""
    mesh = setup(2)
    x = place(mesh, rand((8, 8)), P("tp"))
    body = {
        "moe_dispatch": lambda x: td.moe_dispatch_sharded(
            x, jnp.zeros((4, 2), jnp.int32), axis_name="tp", num_experts=4)[0],
        "flash_decode": lambda x: td.flash_decode_sharded(
            x[None, :2], x[None, :, None], x[None, :, None], jnp.ones((1,), jnp.int32),
            axis_name="tp"),
        "ag_matmul": lambda x: td.ag_matmul_sharded(x, x, axis_name="tp"),
    }[op]
    with pytest.raises(ValueError, match=rf"jaxtdist.{op}_sharded is the pjit-style form .* "
                                         rf"inside shard_map \(here, over \('tp',\)\) call "
                                         rf"jaxtdist.{op} on the local shards"):
        jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("tp"), out_specs=P("tp")))(x)


def test_traced_static_arguments_say_to_pass_python_values():
    """A static argument given as a traced array (num_experts, causal) is refused with
    what to pass instead. Regression: the message printed the tracer only."""
    mesh = setup(2)
    x = place(mesh, rand((8, 8)), P("tp"))
    ids = place(mesh, np.tile(np.array([[0, 1]], np.int32), (8, 1)), P("tp"))
    with pytest.raises(ValueError, match="num_experts=.* not a traced array: it picks the "
                                         "compiled program"):
        jax.jit(jax.shard_map(
            lambda x, ids: td.moe_dispatch(x, ids, "tp", num_experts=jnp.int32(4))[0],
            mesh=mesh, in_specs=(P("tp"),) * 2, out_specs=P("tp")))(x, ids)
    q = place(mesh, rand((1, 8, 2, 16)), P(None, "tp"))
    with pytest.raises(ValueError, match="causal=.* must be True or False, a Python value, "
                                         "not a traced array"):
        jax.jit(jax.shard_map(lambda q: td.ag_attention(q, q, q, "tp", causal=jnp.array(True)),
                              mesh=mesh, in_specs=P(None, "tp"), out_specs=P(None, "tp")))(q)


# -- transformations at world 3 ------------------------------------------------------

def test_vmap_with_unbatched_operands_and_other_batch_axes():
    world, b = 3, 2
    mesh = setup(world)
    # x batched, w shared (in_axes None).
    x, w = rand((b, world * 3, 5)), rand((5, world * 2))
    f = _sm(mesh, jax.vmap(lambda a, c: td.ag_matmul(a, c, "tp"), in_axes=(0, None)),
            (P(None, "tp", None), COLS), P(None, None, "tp"))
    assert_close(f(place(mesh, x, P(None, "tp", None)), place(mesh, w, COLS)),
                 np.einsum("bmk,kn->bmn", f64(x), f64(w)), F32)
    # x shared, w batched.
    x, w = rand((world * 3, 5)), rand((b, 5, world * 2))
    f = _sm(mesh, jax.vmap(lambda a, c: td.ag_matmul(a, c, "tp"), in_axes=(None, 0)),
            (ROWS, P(None, None, "tp")), P(None, None, "tp"))
    assert_close(f(place(mesh, x, ROWS), place(mesh, w, P(None, None, "tp"))),
                 np.einsum("mk,bkn->bmn", f64(x), f64(w)), F32)
    # The batch in the middle of x and last of the result.
    x, w = rand((world * 3, b, 5)), rand((5, world * 2))
    f = _sm(mesh, jax.vmap(lambda a, c: td.ag_matmul(a, c, "tp"), in_axes=(1, None),
                           out_axes=2), (P("tp", None, None), COLS), P(None, "tp", None))
    assert_close(f(place(mesh, x, P("tp", None, None)), place(mesh, w, COLS)),
                 np.einsum("mbk,kn->mnb", f64(x), f64(w)), F32)
    # matmul_rs with a shared weight.
    x, w = rand((b, 6, world * 4)), rand((world * 4, 5))
    f = _sm(mesh, jax.vmap(lambda a, c: td.matmul_rs(a, c, "tp"), in_axes=(0, None)),
            (P(None, None, "tp"), ROWS), P(None, "tp", None))
    assert_close(f(place(mesh, x, P(None, None, "tp")), place(mesh, w, ROWS)),
                 np.einsum("bmk,kn->bmn", f64(x), f64(w)), F32)
    # all_reduce batched over axis 1.
    x = rand((world * 2, b, 5))
    f = _sm(mesh, jax.vmap(lambda a: td.all_reduce(a, "tp"), in_axes=1),
            (P("tp", None, None),), P("tp", None, None))
    ref = f64(x).reshape(world, 2, b, 5).sum(0).transpose(1, 0, 2)  # [b, 2, 5] per rank
    assert_close(f(place(mesh, x, P("tp", None, None))), np.tile(ref, (world, 1, 1)), F32)


def test_vmap_of_decode_and_attention_with_shared_operands():
    """flash_decode with only q batched (one KV cache, one length); ag_attention with
    only q batched; and grad of vmap(ag_attention) against XLA's attention."""
    from tests.test_cpu_flash_decode import _reference
    world, b = 3, 2
    mesh = setup(world)
    q, k, v = rand((b, 1, 2, 8)), rand((1, world * 3, 1, 8)), rand((1, world * 3, 1, 8))
    lens = np.array([world * 3 - 1], np.int32)
    f = _sm(mesh, jax.vmap(lambda q, k, v, n: td.flash_decode(q, k, v, n, "tp"),
                           in_axes=(0, None, None, None)),
            (P(), P(None, "tp"), P(None, "tp"), P()), P())
    out = f(place(mesh, q, P()), place(mesh, k, P(None, "tp")), place(mesh, v, P(None, "tp")),
            place(mesh, lens, P()))
    assert_close(out, np.stack([_reference(q[i], k, v, lens) for i in range(b)]), F32)
    sp, sp5 = P(None, "tp"), P(None, None, "tp")
    q, k, v = rand((b, 1, world * 2, 2, 4)), rand((b, 1, world * 2, 2, 4)), rand(
        (b, 1, world * 2, 2, 4))
    g = jax.shard_map(jax.vmap(lambda q, k, v: td.ag_attention(q, k, v, "tp"),
                               in_axes=(0, None, None)), mesh=mesh, in_specs=(sp5, sp, sp),
                      out_specs=sp5)
    ref = jax.vmap(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True),
                   in_axes=(0, None, None))
    args = (place(mesh, q, sp5), place(mesh, k[0], sp), place(mesh, v[0], sp))
    assert_close(jax.jit(g)(*args), ref(*map(jnp.asarray, (q, k[0], v[0]))), F32)
    loss = lambda fn: lambda *a: jnp.sum(jnp.sin(fn(*a)))  # noqa: E731
    got = jax.jit(jax.grad(loss(g), argnums=(0, 1, 2)))(*args)
    want = jax.grad(loss(ref), argnums=(0, 1, 2))(*map(jnp.asarray, (q, k[0], v[0])))
    for a, r in zip(got, want):
        assert_close(a, f64(r), F32, factor=10)


@pytest.mark.parametrize("op", ["ag_matmul", "matmul_rs"])
@pytest.mark.parametrize("inside", [False, True], ids=["outside_shard_map", "inside_shard_map"])
def test_vmap_of_grad_of_checkpoint_at_world_3(op, inside):
    """vmap(grad(checkpoint(f))): outside the shard_map, or inside it with a
    nothing_saveable policy, against the same of a @ b."""
    world, b = 3, 2
    mesh = setup(world)
    if op == "ag_matmul":
        body = lambda a, c: td.ag_matmul(a, c, "tp")  # noqa: E731
        specs, out, xs, ws = (ROWS, COLS), COLS, (world * 3, 5), (5, world * 2)
    else:
        body = lambda a, c: td.matmul_rs(a, c, "tp")  # noqa: E731
        specs, out, xs, ws = (COLS, ROWS), ROWS, (world * 2, world * 3), (world * 3, 5)
    loss = lambda fn: lambda a, c: jnp.sum(jnp.sin(fn(a, c)))  # noqa: E731
    vspecs = tuple(P(None, *s) for s in specs)
    x, w = rand((b,) + xs), rand((b,) + ws)
    if inside:
        # Per rank: the gradient of its own part of the loss; the sum over ranks is
        # the whole loss's, which the backward's collectives assemble.
        policy = jax.checkpoint_policies.nothing_saveable
        f = jax.jit(jax.shard_map(
            jax.vmap(jax.grad(loss(jax.checkpoint(body, policy=policy)), argnums=(0, 1))),
            mesh=mesh, in_specs=vspecs, out_specs=vspecs))
    else:
        inner = jax.shard_map(jax.checkpoint(body), mesh=mesh, in_specs=specs, out_specs=out)
        f = jax.jit(jax.vmap(jax.grad(loss(inner), argnums=(0, 1))))
    got = f(place(mesh, x, vspecs[0]), place(mesh, w, vspecs[1]))
    want = jax.vmap(jax.grad(loss(lambda a, c: a @ c), argnums=(0, 1)))(jnp.asarray(x),
                                                                       jnp.asarray(w))
    for g, r in zip(got, want):
        assert_close(g, f64(r), F32, factor=10)


@pytest.mark.parametrize("remat", [True])
def test_grad_through_scan_of_a_tensor_parallel_mlp(remat):
    """Three layers of ag_matmul -> tanh -> matmul_rs in a lax.scan (a residual
    stream), value and gradients against the same network on XLA's collectives."""
    world, layers, m, d, f = 3, 3, 2, 5, 6
    mesh = setup(world)

    def net(x, w1s, w2s, ours):
        def layer(h, ws):
            w1, w2 = ws
            if ours:
                a = td.ag_matmul(h, w1, "tp")
                out = td.matmul_rs(jnp.tanh(a), w2, "tp")
            else:
                a = jax.lax.all_gather(h, "tp", axis=0, tiled=True) @ w1
                out = jax.lax.psum_scatter(jnp.tanh(a) @ w2, "tp", scatter_dimension=0,
                                           tiled=True)
            return h + out, None
        return jax.lax.scan(layer, x, (w1s, w2s))[0]

    specs = (ROWS, P(None, None, "tp"), P(None, "tp", None))

    def loss(ours):
        body = lambda *a: net(*a, ours)  # noqa: E731
        if remat:
            body = jax.checkpoint(body)
        g = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=ROWS)
        return lambda *a: jnp.sum(jnp.sin(g(*a)))

    host = (rand((world * m, d)), rand((layers, d, f), scale=0.4),
            rand((layers, f, d), scale=0.4))
    args = [place(mesh, a, s) for a, s in zip(host, specs)]
    val, got = jax.jit(jax.value_and_grad(loss(True), argnums=(0, 1, 2)))(*args)
    rval, want = jax.jit(jax.value_and_grad(loss(False), argnums=(0, 1, 2)))(*args)
    assert abs(float(val) - float(rval)) < 1e-4 * max(1.0, abs(float(rval)))
    for g, r in zip(got, want):
        assert_close(g, f64(r), F32, factor=10)


def test_scan_and_while_loop_chain_calls():
    world = 3
    mesh = setup(world)
    x, w = rand((world * 2, 4)), rand((4, 4), scale=0.3)

    def body(a, c):
        def step(h, _):
            h = td.reduce_scatter(td.ag_matmul(h, c, "tp"), "tp") / world
            return h, jnp.sum(h)
        return jax.lax.scan(step, a, None, length=5)[0]
    out = _sm(mesh, body, (ROWS, P()), ROWS)(place(mesh, x, ROWS), place(mesh, w, P()))
    ref = f64(x)
    for _ in range(5):
        ref = ref @ f64(w)
    assert_close(out, ref, F32, factor=3)

    def loop(a):
        def step(c):
            return c[0] + 1, jax.lax.pcast(td.all_reduce(c[1], "tp") / world, "tp",
                                           to="varying")
        return jax.lax.while_loop(lambda c: c[0] < 4, step, (0, a))[1]
    y = rand((world * 2, 3))
    out = _sm(mesh, loop, (ROWS,), ROWS)(place(mesh, y, ROWS))
    assert_close(out, np.tile(f64(y).reshape(world, 2, 3).mean(0), (world, 1)), F32)


def test_one_op_at_several_shapes_and_dtypes_in_one_jit():
    world = 3
    mesh = setup(world)
    x1, w1 = rand((world * 3, 5)), rand((5, world * 2))
    x2, w2 = rand((world * 1, 17)), rand((17, world * 3))
    f = _sm(mesh, lambda a, b, c, d: (td.ag_matmul(a, b, "tp"), td.ag_matmul(c, d, "tp")),
            (ROWS, COLS, ROWS, COLS), (COLS, COLS))
    o1, o2 = f(place(mesh, x1, ROWS), place(mesh, w1, COLS), place(mesh, x2, ROWS),
               place(mesh, w2, COLS))
    assert_close(o1, f64(x1) @ f64(w1), F32)
    assert_close(o2, f64(x2) @ f64(w2), F32)
    a, c = rand((world * 3, 5), BF16), rand((world * 2, 7, 3))
    g = _sm(mesh, lambda a, c: (td.all_reduce(a, "tp"), td.all_reduce(c, "tp"),
                                td.all_gather(c, "tp", axis=1)),
            (ROWS, P("tp", None, None)), (ROWS, P("tp", None, None), P("tp", None, None)))
    r1, r2, r3 = g(place(mesh, a, ROWS), place(mesh, c, P("tp", None, None)))
    assert_close(r1, np.tile(f64(a).reshape(world, 3, 5).sum(0), (world, 1)), BF16)
    assert_close(r2, np.tile(f64(c).reshape(world, 2, 7, 3).sum(0), (world, 1, 1)), F32)
    gathered = np.concatenate(list(f64(c).reshape(world, 2, 7, 3)), axis=1)
    np.testing.assert_array_equal(f64(r3), np.concatenate([gathered] * world))


def test_forward_mode_is_a_type_error():
    mesh = setup(3)
    f = _sm(mesh, lambda a: td.all_reduce(a, "tp"), (ROWS,), ROWS)
    x = place(mesh, rand((6, 4)), ROWS)
    with pytest.raises(TypeError, match="forward-mode"):
        jax.jvp(f, (x,), (x,))
    # Eagerly (no jit around the shard_map): JAX's own failure there said only
    # "unhashable type"; the error names the op and what is not supported.
    eager = jax.shard_map(lambda a: td.all_gather(a, "tp"), mesh=mesh, in_specs=ROWS,
                          out_specs=ROWS)
    with pytest.raises(TypeError, match=r"jaxtdist\.all_gather: forward-mode autodiff .* "
                                        r"reverse mode only"):
        jax.jvp(eager, (x,), (x,))


# -- attention and MoE at worlds 3 and 1 ----------------------------------------------

@pytest.mark.parametrize("world", [3, 1])
@pytest.mark.parametrize("b,hq,hkv,d,s,dtype", [(1, 3, 1, 17, 5, F32), (2, 6, 3, 3, 1, BF16),
                                                (1, 1, 1, 1, 7, F16)])
def test_flash_decode_odd_heads_and_head_dims(world, b, hq, hkv, d, s, dtype):
    from tests.test_cpu_flash_decode import _reference
    mesh = setup(world)
    q, k, v = rand((b, hq, d), dtype), rand((b, world * s, hkv, d), dtype), rand(
        (b, world * s, hkv, d), dtype)
    lens = np.array([world * s, max(1, s - 1)][:b], np.int32)
    f = _sm(mesh, lambda q, k, v, n: td.flash_decode(q, k, v, n, "tp"),
            (P(), P(None, "tp"), P(None, "tp"), P()), P())
    out = f(place(mesh, q, P()), place(mesh, k, P(None, "tp")), place(mesh, v, P(None, "tp")),
            place(mesh, lens, P()))
    assert out.dtype == jnp.dtype(dtype)
    assert_close(out, _reference(q, k, v, lens), dtype)


def test_flash_decode_lengths_past_the_cache_or_negative_are_clamped():
    """kv_len is data: longer than the cache reads the whole cache, negative or 0
    none (zeros), int16 / uint32 / int64 lengths work; a float or [B, 1] is refused."""
    from tests.test_cpu_flash_decode import _reference
    world, s = 3, 3
    mesh = setup(world)
    q, k, v = rand((2, 2, 8)), rand((2, world * s, 1, 8)), rand((2, world * s, 1, 8))
    f = _sm(mesh, lambda q, k, v, n: td.flash_decode(q, k, v, n, "tp"),
            (P(), P(None, "tp"), P(None, "tp"), P()), P())
    args = (place(mesh, q, P()), place(mesh, k, P(None, "tp")), place(mesh, v, P(None, "tp")))
    for lens, dtype in (([world * s + 5, 2], np.int32), ([-1, 3], np.int32),
                        ([2 ** 31 - 1, 1], np.int32), ([4, 5], np.int16), ([4, 5], np.uint32)):
        out = np.asarray(f(*args, jnp.asarray(np.array(lens, dtype))))
        ref = _reference(q, k, v, np.clip(np.array(lens, np.int64), 0, world * s))
        assert np.all(np.isfinite(out))
        np.testing.assert_allclose(out, ref, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"kv_len must be an integer array of shape \(B,\) = "
                                         r"\(2,\), got float32\(2,\)"):
        f(*args, jnp.array([3.0, 4.0]))
    with pytest.raises(ValueError, match=r"got int32\(2, 1\)"):
        f(*args, jnp.array([[3], [4]], jnp.int32))


@pytest.mark.parametrize("world,b,s,hq,hkv,d,causal,dtype", [
    pytest.param(3, 1, 5, 3, 1, 17, True, F32, marks=slow()), (3, 1, 1, 2, 2, 8, False, BF16), (3, 2, 3, 2, 1, 3, True, F16),
    (1, 2, 3, 2, 1, 3, True, F16), (1, 1, 4, 2, 2, 8, False, F16)])
def test_ag_attention_odd_shapes(world, b, s, hq, hkv, d, causal, dtype):
    """Regression (world 1, float16): the local path ran jax.nn.dot_product_attention
    on float16 operands, which XLA's CPU dot refuses ("The precision 'F16_F16_F32' is
    not supported by dot_general on CPU") while world 2+ worked. Fixed in
    ops/ag_attention.py. Gradients checked too."""
    mesh = setup(world)
    sp = P(None, "tp")
    q, k, v = rand((b, world * s, hq, d), dtype), rand((b, world * s, hkv, d), dtype), rand(
        (b, world * s, hkv, d), dtype)
    g = jax.shard_map(lambda q, k, v: td.ag_attention(q, k, v, "tp", causal=causal), mesh=mesh,
                      in_specs=(sp,) * 3, out_specs=sp)

    def ref(q, k, v):
        q, k, v = (jnp.asarray(a, F32) for a in (q, k, v))
        k, v = (jnp.repeat(a, hq // hkv, axis=2) for a in (k, v))
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal)
    args = [place(mesh, a, sp) for a in (q, k, v)]
    out = jax.jit(g)(*args)
    assert out.dtype == jnp.dtype(dtype)
    assert_close(out, ref(q, k, v), dtype)
    loss = lambda fn: lambda *a: jnp.sum(jnp.sin(fn(*a).astype(F32)))  # noqa: E731
    got = jax.jit(jax.grad(loss(g), argnums=(0, 1, 2)))(*args)
    want = jax.grad(loss(ref), argnums=(0, 1, 2))(*map(jnp.asarray, (q, k, v)))
    for a, r in zip(got, want):
        assert a.dtype == jnp.dtype(dtype)
        if np.linalg.norm(f64(r)) == 0:  # one key per query: q and k get no gradient
            np.testing.assert_allclose(f64(a), 0.0, atol=1e-6)
        else:
            assert_close(a, f64(r), dtype, factor=10)


def _moe_reference(x, ids, gate, w, e, world) -> np.ndarray:
    """float64: each (t, k) with a valid id (in [0, E), not a repeat of an earlier k
    of the token) adds gate * x[t] @ w[expert]; the rest add nothing (docs/moe.md)."""
    wf = f64(w).reshape(e, *w.shape[2:])
    out = np.zeros((x.shape[0], wf.shape[-1]))
    for t in range(x.shape[0]):
        seen = set()
        for k, ex in enumerate(ids[t]):
            if 0 <= ex < e and ex not in seen:
                out[t] += f64(gate)[t, k] * (f64(x)[t] @ wf[ex])
            seen.add(int(ex))
    del world
    return out


@pytest.mark.parametrize("t,h,f,k,e,dtype", [(1, 3, 5, 1, 3, F32), (5, 17, 3, 2, 6, BF16),
                                             (2, 8, 8, 3, 9, F32)])
def test_moe_layer_at_world_3(t, h, f, k, e, dtype):
    from tests.test_cpu_moe import routing
    world = 3
    mesh = setup(world)
    x = rand((world * t, h), dtype)
    ids = routing("random", world, t, k, e, np.random.default_rng(t * 10 + k))
    w, gate = rand((world, e // world, h, f), dtype, scale=0.3), rand((world * t, k))

    def body(x, ids, w, gate):
        recv, sizes, handle = td.moe_dispatch(x, ids, "tp", num_experts=e)
        return td.moe_combine(jax.lax.ragged_dot(recv, w[0], sizes), handle, gate, "tp")
    out = _sm(mesh, body, (P("tp"),) * 4, P("tp"))(
        *(place(mesh, a, P("tp")) for a in (x, ids, w, gate)))
    assert_close(out.astype(F32), _moe_reference(x, ids, gate, w, e, world), dtype, 2.0)


def test_moe_invalid_and_repeated_ids_at_world_3():
    world, t, e = 3, 2, 6
    mesh = setup(world)
    x, w, gate = rand((world * t, 4)), rand((world, e // world, 4, 5), scale=0.3), rand(
        (world * t, 2))
    ids = np.array([[0, 1], [2, -1], [7, 3], [5, 4], [1, 1], [3, 2]], np.int32)

    def body(x, ids, w, gate):
        recv, sizes, handle = td.moe_dispatch(x, ids, "tp", num_experts=e)
        out = td.moe_combine(jax.lax.ragged_dot(recv, w[0], sizes), handle, gate, "tp")
        return out, handle.invalid[None]
    out, invalid = _sm(mesh, body, (P("tp"),) * 4, (P("tp"), P("tp")))(
        *(place(mesh, a, P("tp")) for a in (x, ids, w, gate)))
    assert_close(out, _moe_reference(x, ids, gate, w, e, world), F32)
    np.testing.assert_array_equal(np.asarray(invalid), [1, 1, 1])  # -1, 7, the repeated 1


@pytest.mark.parametrize("t,k,e,h,f,gated,dtype", [(1, 1, 1, 3, 3, False, F32),
                                                   (5, 2, 3, 17, 6, True, F32),
                                                   (2, 3, 5, 8, 9, False, BF16)])
def test_moe_tp_mlp_at_world_3(t, k, e, h, f, gated, dtype):
    from tests.test_cpu_moe_tp import _reference, _routing
    world = 3
    mesh = setup(world)
    x, gate = rand((world * t, h), dtype), rand((world * t, k))
    ids = _routing(np.random.default_rng(t), world * t, k, e)
    w1, w2 = rand((e, h, f), dtype, 0.3), rand((e, f, h), dtype, 0.3)
    wu = rand((e, h, f), dtype, 0.3) if gated else None
    tok, e1, e2 = ROWS, P(None, None, "tp"), P(None, "tp", None)
    arrays = [place(mesh, a, s) for a, s in ((x, tok), (ids, tok), (gate, tok), (w1, e1),
                                             (w2, e2))]
    if gated:
        fn = _sm(mesh, lambda *a: td.moe_tp_mlp(*a[:5], "tp", w_up=a[5]), (tok,) * 3 + (e1, e2, e1),
                 tok)
        arrays.append(place(mesh, wu, e1))
    else:
        fn = _sm(mesh, lambda *a: td.moe_tp_mlp(*a, "tp"), (tok,) * 3 + (e1, e2), tok)
    out = fn(*arrays)
    assert out.dtype == jnp.dtype(dtype)
    assert_close(out, _reference(x, ids, gate, w1, w2, wu), dtype, 2.0)


@pytest.mark.parametrize("r,h,f,sizes,dtype", [(1, 1, 1, [1], F32), (17, 3, 5, [5, 0, 12], F32),
                                               (5, 4, 4, [2, 2, 9], F32),
                                               (3, 1, 257, [1, 1, 1], BF16),
                                               (9, 5, 3, [9], F16)])
def test_grouped_matmul_odd_shapes_inside_a_3_device_shard_map(r, h, f, sizes, dtype):
    """grouped_matmul's groups: one row, empty groups, sizes past R (clipped)."""
    mesh = setup(3)
    x, w = rand((r, h), dtype), rand((len(sizes), h, f), dtype)
    out = _sm(mesh, lambda a, b, c: td.grouped_matmul(a, b, c), (P(), P(), P()), P())(
        x, w, np.array(sizes, np.int32))
    ends = np.minimum(np.cumsum(sizes), r)
    ref = np.zeros((r, f))
    for g, (lo, hi) in enumerate(zip(np.concatenate([[0], ends[:-1]]), ends)):
        ref[lo:hi] = f64(x)[lo:hi] @ f64(w)[g]
    assert out.dtype == jnp.dtype(dtype)
    assert_close(out, ref, dtype)


# -- initialize ----------------------------------------------------------------------

def test_every_kind_of_op_before_initialize_says_to_initialize():
    mesh = mesh_of((3,), ("tp",))
    td.shutdown()
    x = rand((6, 4))
    calls = [
        lambda: _sm(mesh, lambda a: td.reduce_scatter(a, "tp"), (ROWS,), ROWS)(x),
        lambda: _sm(mesh, lambda a: td.grouped_matmul(a, jnp.ones((1, 4, 3)), jnp.array([2])),
                    (ROWS,), ROWS)(x),
        lambda: _sm(mesh, lambda a: td.moe_dispatch(a, jnp.zeros((2, 1), jnp.int32), "tp",
                                                    num_experts=3)[0], (ROWS,), ROWS)(x),
        lambda: jax.jit(lambda a, b: td.matmul_rs_sharded(a, b, axis_name="tp", mesh=mesh))(
            x[:, :3], x[:3]),
    ]
    for call in calls:
        with pytest.raises(td.NotInitializedError, match=r"jaxtdist.initialize\(mesh\)"):
            call()
    setup(3)


def test_reinitialize_on_another_mesh():
    """A function jitted for a 3-device mesh, after initialize on a 2-device one, says
    which meshes differ; on the 3-device mesh again it runs (retraced), right."""
    mesh3 = setup(3)
    f3 = _sm(mesh3, lambda a, b: td.ag_matmul(a, b, "tp"), (ROWS, COLS), COLS)
    x, w = rand((6, 5)), rand((5, 6))
    assert_close(f3(place(mesh3, x, ROWS), place(mesh3, w, COLS)), f64(x) @ f64(w), F32)
    mesh2 = setup(2)
    with pytest.raises(ValueError, match=r"the shard_map's mesh \{'tp': 3\} differs from the "
                                         r"mesh given to jaxtdist.initialize \{'tp': 2\}"):
        f3(place(mesh3, x, ROWS), place(mesh3, w, COLS))
    x2, w2 = rand((4, 5)), rand((5, 4))
    f2 = _sm(mesh2, lambda a, b: td.ag_matmul(a, b, "tp"), (ROWS, COLS), COLS)
    assert_close(f2(place(mesh2, x2, ROWS), place(mesh2, w2, COLS)), f64(x2) @ f64(w2), F32)
    td.initialize(mesh_of((2,), ("sp",)))
    with pytest.raises(ValueError, match=r"axis_name 'tp' is not an axis of the mesh passed to "
                                         r"jaxtdist.initialize; its axes are \('sp',\)"):
        f2(place(mesh2, x2, ROWS), place(mesh2, w2, COLS))
    setup(3)
    x, w = rand((6, 5)), rand((5, 6))
    assert_close(f3(place(mesh3, x, ROWS), place(mesh3, w, COLS)), f64(x) @ f64(w), F32)


# Regression (an adversarial sweep): initialize on another mesh while a program was
# still running hung, then XLA aborted the process, in about 1 of 3 runs (some
# devices' calls failed against the new runtime, the others waited in an XLA
# collective). Run apart: an abort must fail this test, not end pytest.
_REINIT_IN_FLIGHT = """
import numpy as np, jax, jax.numpy as jnp, jaxtdist as td
auto = jax.sharding.AxisType.Auto
def mesh(shape):
    return jax.make_mesh(shape, ("dp", "tp"), axis_types=(auto, auto),
                         devices=jax.devices()[:int(np.prod(shape))])
rng = np.random.default_rng(0)
for cycle in range(4):
    td.initialize(mesh((2, 2)))
    x, w = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((8, 12), (12, 8)))
    y = jax.jit(lambda a, b: td.ag_matmul_sharded(a, b, axis_name="tp",
                                                  batch_axes="dp").sum(0))(x, w)
    td.initialize(mesh((2, 4)))  # y may still be running
    x2, w2 = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((16, 12), (12, 8)))
    y2 = jax.jit(lambda a, b: td.ag_matmul_sharded(a, b, axis_name="tp",
                                                   batch_axes="dp"))(x2, w2)
    for got, want in ((y, (x @ w).sum(0)), (y2, x2 @ w2)):
        err = np.linalg.norm(np.asarray(got) - np.asarray(want)) / np.linalg.norm(want)
        assert err < 1e-5, (cycle, err)
td.shutdown()
print("REINIT_OK")
"""


def test_reinitialize_while_a_program_runs():
    """initialize on another mesh waits for the program still running (its result is
    right), then the new mesh's program runs right: 4 cycles, no hang, no abort."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
               JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", _REINIT_IN_FLIGHT], env=env, timeout=400,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.returncode == 0 and "REINIT_OK" in proc.stdout, proc.stdout[-3000:]


# -- Flax layers on (1, 3) and (2, 3) meshes -----------------------------------------

@pytest.mark.parametrize("shape", [(2, 3)])
def test_flax_layers_on_a_mesh_of_3(shape):
    pytest.importorskip("flax")
    from flax import nnx
    from jax.sharding import AxisType, NamedSharding

    from jaxtdist import nn as tdnn
    mesh = jax.make_mesh(shape, ("dp", "tp"), axis_types=(AxisType.Explicit,) * 2,
                         devices=jax.devices()[:int(np.prod(shape))])
    td.initialize(mesh)  # Explicit axes: another mesh than conftest's
    dp, tp = shape
    put = lambda a, spec: jax.device_put(jnp.asarray(a), NamedSharding(mesh, spec))  # noqa: E731
    with jax.set_mesh(mesh):
        col = tdnn.ColumnParallelLinear(5, 3 * tp, rngs=nnx.Rngs(0))
        x = rand((2 * dp, tp, 5))
        y = nnx.jit(lambda m, a: m(a))(col, put(x, P("dp", "tp", None)))
        assert_close(y, f64(x) @ f64(col.kernel[...]) + f64(col.bias[...]), F32)
        row = tdnn.RowParallelLinear(3 * tp, 7, rngs=nnx.Rngs(1))
        x = rand((2 * dp, 2 * tp, 3 * tp))
        y = nnx.jit(lambda m, a: m(a))(row, put(x, P("dp", None, "tp")))
        bias = 0.0 if row.bias is None else f64(row.bias[...])
        assert_close(y, f64(x) @ f64(row.kernel[...]) + bias, F32)
        mlp = tdnn.ParallelMLP(6, 3 * tp, rngs=nnx.Rngs(2))
        x = rand((2 * dp, tp, 6))
        y = nnx.jit(lambda m, a: m(a))(mlp, put(x, P("dp", "tp", None)))
        gate = f64(x) @ f64(mlp.gate_proj.kernel[...])
        ref = (gate / (1 + np.exp(-gate)) * (f64(x) @ f64(mlp.up_proj.kernel[...]))) @ f64(
            mlp.down_proj.kernel[...])
        assert_close(y, ref, F32)


@pytest.mark.parametrize("shape", [(1, 2)])
def test_flax_attention_in_float16_on_cpu(shape):
    """Regression: ParallelAttention(dtype=float16) failed on CPU at every tensor-parallel
    size ("The precision 'F16_F16_F32' is not supported by dot_general on CPU": XLA's
    CPU dot under jax.nn.dot_product_attention). Fixed in nn/_attention.py: float32
    attention on CPU meshes, rounded once. Checked against the float32 layer."""
    pytest.importorskip("flax")
    from flax import nnx
    from jax.sharding import AxisType

    from jaxtdist import nn as tdnn
    mesh = jax.make_mesh(shape, ("dp", "tp"), axis_types=(AxisType.Explicit,) * 2,
                         devices=jax.devices()[:int(np.prod(shape))])
    td.initialize(mesh)
    with jax.set_mesh(mesh):
        half = tdnn.ParallelAttention(8, 2, rngs=nnx.Rngs(3), dtype=F16)
        full = tdnn.ParallelAttention(8, 2, rngs=nnx.Rngs(3), dtype=F32)
        x = jnp.asarray(rand((2, 4, 8)))
        y16 = nnx.jit(lambda m, a: m(a))(half, x)
        y32 = nnx.jit(lambda m, a: m(a))(full, x)
    assert y16.dtype == F16
    assert rel_err(y16, f64(y32)) < TOL[jnp.dtype(F16)] * 4


# -- gradients under shard_map(check_vma=False) ---------------------------------------------
#
# Regression: with check_vma=False every value is typed invariant, so the backwards took
# each rank's own cotangent for the group's sum: matmul_ar's gradients, ag_matmul's dx
# and all_gather's were 1/world of the true ones (found by an adversarial sweep). The
# README prescribes check_vma=False for a replicated out_specs.

def _vma_case(op, world):
    """(body, in_specs, out_specs, global operands, the same computation in jax.lax)."""
    m, k, n = 3, 4, 5
    if op == "matmul_ar":
        args = (rand((m, world * k), F32), rand((world * k, n), F32))
        return (lambda a, b: td.matmul_ar(a, b, "tp"), (COLS, ROWS), P(), args,
                lambda a, b: jax.lax.psum(a @ b, "tp"))
    if op == "ag_matmul":
        args = (rand((world * m, k), F32), rand((k, world * n), F32))
        return (lambda a, b: td.ag_matmul(a, b, "tp"), (ROWS, COLS), COLS, args,
                lambda a, b: jax.lax.all_gather(a, "tp", tiled=True) @ b)
    if op == "ag_matmul_replicated_out":
        args = (rand((world * m, k), F32), rand((k, n), F32))
        return (lambda a, b: td.ag_matmul(a, b, "tp"), (ROWS, P()), P(), args,
                lambda a, b: jax.lax.all_gather(a, "tp", tiled=True) @ b)
    if op == "all_gather":
        args = (rand((world * m, k), F32),)
        return (lambda a: td.all_gather(a, "tp"), (ROWS,), P(), args,
                lambda a: jax.lax.all_gather(a, "tp", tiled=True))
    if op == "all_reduce":
        args = (rand((world * m, k), F32),)
        return (lambda a: td.all_reduce(a, "tp"), (ROWS,), P(), args,
                lambda a: jax.lax.psum(a, "tp"))
    if op == "reduce_scatter":
        args = (rand((world * m, world * k), F32),)
        return (lambda a: td.reduce_scatter(a, "tp"), (COLS,), ROWS, args,
                lambda a: jax.lax.psum_scatter(a, "tp", tiled=True))
    args = (rand((world * m, world * k), F32), rand((world * k, n), F32))  # matmul_rs
    return (lambda a, b: td.matmul_rs(a, b, "tp"), (COLS, ROWS), ROWS, args,
            lambda a, b: jax.lax.psum_scatter(a @ b, "tp", tiled=True))


# A gather's result under a replicated out_specs passes shard_map's check only with
# check_vma=False (as jax.lax.all_gather's does).
VMA_CASES = [(op, vma) for op in ("matmul_ar", "ag_matmul", "ag_matmul_replicated_out",
                                  "all_gather", "all_reduce", "reduce_scatter", "matmul_rs")
             for vma in (False, True)
             if not (vma and op in ("all_gather", "ag_matmul_replicated_out"))]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("op,check_vma", VMA_CASES)
def test_gradients_match_jax_lax_with_and_without_check_vma(op, world, check_vma):
    """jax.grad through each op equals jax.grad through its jax.lax twin in the same
    shard_map, with check_vma on and off (a cotangent of the sum's square, so every
    rank's contribution differs)."""
    mesh = setup(world)
    body, in_specs, out_specs, args, twin = _vma_case(op, world)

    def grads(fn):
        f = jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                          check_vma=check_vma)
        return jax.jit(jax.grad(lambda *a: jnp.sum(f(*a) ** 2),
                                argnums=tuple(range(len(args)))))(*args)

    for got, want in zip(grads(body), grads(twin)):
        assert rel_err(got, want) < TOL[jnp.dtype(F32)], (op, rel_err(got, want))
