"""ag_matmul_sharded: the pjit-style entry point (no hand-written shard_map)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxtdist as td
from tests.conftest import assert_close, cpu_only, f64, place, rand, setup

pytestmark = cpu_only()


@pytest.mark.parametrize("shape,names,batch", [
    ((4,), ("tp",), ()),
    ((2, 2), ("dp", "tp"), ("dp",)),
    ((2, 4), ("dp", "tp"), ("dp",)),
])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_forward_and_grad_match_xla(shape, names, batch, dtype):
    mesh = setup(shape, names)
    n_dev = int(np.prod(shape))
    layer = jax.jit(functools.partial(td.ag_matmul_sharded, axis_name="tp", batch_axes=batch))
    x = rand((n_dev * 5, 24), dtype)
    w = rand((24, shape[-1] * 12), dtype, 0.2)
    xs = place(mesh, x, P(tuple(batch) + ("tp",), None))
    ws = place(mesh, w, P(None, "tp"))
    out = layer(xs, ws)
    assert out.sharding.spec == P(batch[0] if batch else None, "tp")
    assert_close(out, f64(x) @ f64(w), dtype)

    with jax.sharding.use_mesh(mesh) if hasattr(jax.sharding, "use_mesh") else jax.set_mesh(mesh):
        gx, gw = jax.grad(lambda a, b: jnp.sum(jnp.sin(layer(a, b).astype(jnp.float32))),
                          argnums=(0, 1))(xs, ws)
    rx, rw = jax.grad(lambda a, b: jnp.sum(jnp.sin(a @ b)), argnums=(0, 1))(
        jnp.asarray(f64(x), jnp.float32), jnp.asarray(f64(w), jnp.float32))
    assert_close(gx, rx, dtype, factor=5)
    assert_close(gw, rw, dtype, factor=5)


def test_axis_in_batch_axes_is_refused():
    mesh = setup((2, 2), ("dp", "tp"))
    x = place(mesh, rand((8, 16)), P(("dp", "tp"), None))
    w = place(mesh, rand((16, 8)), P(None, "tp"))
    with pytest.raises(ValueError, match="also in batch_axes"):
        td.ag_matmul_sharded(x, w, axis_name="tp", batch_axes=("tp",))


def test_mesh_axes_not_named_are_replicated():
    """On a (dp, tp, ep) mesh the result is replicated over ep (typed so: no
    check_vma error) and matches the product."""
    mesh = setup((2, 2, 2), ("dp", "tp", "ep"))
    x = rand((16, 8), jnp.float32)
    w = rand((8, 4), jnp.float32)
    layer = jax.jit(functools.partial(td.ag_matmul_sharded, axis_name="tp", batch_axes=("dp",)))
    out = layer(place(mesh, x, P(("dp", "tp"), None)), place(mesh, w, P(None, "tp")))
    assert out.sharding.spec == P("dp", "tp")
    assert_close(out, f64(x) @ f64(w), jnp.float32)


def test_size_errors_name_the_wrapper_and_the_global_shapes():
    """A global dimension its devices do not divide: an error naming the wrapper and
    the split (was shard_map's, naming a function 'body'); an op's own check on the
    shard it sees gains the shard and global shapes."""
    setup((2, 2), ("dp", "tp"))
    k, n = 6, 4
    with pytest.raises(ValueError, match=r"jaxtdist\.ag_matmul_sharded: argument 0 has shape "
                                         r"\(3, 6\); its dimension 0 \(3\) is split over dp=2 x "
                                         r"tp=2 \(4 devices\), which must divide it"):
        td.ag_matmul_sharded(jnp.ones((3, k)), jnp.ones((k, n)), axis_name="tp",
                             batch_axes="dp")
    with pytest.raises(ValueError, match=r"jaxtdist\.matmul_rs: the rows of x \(M=3\) .* \[in "
                                         r"jaxtdist\.matmul_rs_sharded: the op sees one shard "
                                         r"of each argument, shapes \[\(3, 3\), \(3, 4\)\] of "
                                         r"the global \[\(6, 6\), \(6, 4\)\]"):
        td.matmul_rs_sharded(jnp.ones((6, k)), jnp.ones((k, n)), axis_name="tp",
                             batch_axes="dp")


def _four_forms(rng):
    """(name, call, arguments) of four _sharded forms over sp with dp batches, on
    unplaced arguments (kv_len a Python list)."""
    x, w = rng.standard_normal((16, 24)), rng.standard_normal((24, 16))
    q, kv = rng.standard_normal((2, 4, 16)), rng.standard_normal((2, 8, 2, 16))
    seq = rng.standard_normal((2, 8, 2, 16))
    f32 = functools.partial(jnp.asarray, dtype=jnp.float32)
    return [
        ("ag_matmul_sharded", td.ag_matmul_sharded, (f32(x), f32(w))),
        ("matmul_rs_sharded", td.matmul_rs_sharded, (f32(x), f32(w))),
        ("flash_decode_sharded", td.flash_decode_sharded, (f32(q), f32(kv), f32(kv * 0.5), [8, 3])),
        ("ag_attention_sharded", td.ag_attention_sharded, (f32(seq), f32(seq * 0.7), f32(seq + 1))),
    ]


@pytest.mark.parametrize("form", range(4))
def test_sharded_forms_place_their_arguments_on_explicit_meshes(form):
    """On a mesh of Explicit axes (jax.make_mesh's default) the _sharded forms take
    arguments placed anyhow, as on Auto axes (shard_map there takes only arguments
    placed as its in_specs), and a Python list where the op takes one: the results
    equal those on an Auto mesh of the same devices."""
    shape, names = (2, 4), ("dp", "sp")
    outs = []
    for axis_type in (jax.sharding.AxisType.Auto, jax.sharding.AxisType.Explicit):
        mesh = jax.make_mesh(shape, names, devices=jax.devices()[:8], axis_types=(axis_type,) * 2)
        td.initialize(mesh)
        name, fn, args = _four_forms(np.random.default_rng(form))[form]
        out = jax.jit(functools.partial(fn, axis_name="sp", batch_axes="dp"))(*args)
        outs.append(np.asarray(out))
        # Eager, on NumPy arrays (shard_map takes none on Explicit axes).
        numpy_args = [np.asarray(a) if isinstance(a, jax.Array) else a for a in args]
        outs.append(np.asarray(fn(*numpy_args, axis_name="sp", batch_axes="dp")))
    assert np.isfinite(outs[0]).all(), name
    for out in outs[1:]:
        np.testing.assert_array_equal(out, outs[0], err_msg=name)


@pytest.mark.parametrize("axis_type", [jax.sharding.AxisType.Auto,
                                       jax.sharding.AxisType.Explicit])
def test_sharded_forms_name_misused_arguments(axis_type):
    """Arguments of too few dimensions, batch_axes=None, a mesh= that is no Mesh and
    a tuple where one weight goes: errors naming the wrapper and what it takes (were
    shard_map's text about a function 'body', a bare AssertionError, a TypeError
    from iterating None, and an AttributeError that replaced the op's own message)."""
    mesh = jax.make_mesh((2,), ("tp",), devices=jax.devices()[:2], axis_types=(axis_type,))
    td.initialize(mesh)
    x, w = jnp.ones((8, 4)), jnp.ones((4, 8))
    for bad_x in (jnp.ones((4,)), np.float32(1.0)):
        with pytest.raises(ValueError, match=r"jaxtdist\.ag_matmul_sharded: argument 0 has shape "
                                             r"\(\d*,?\) \([01] dimensions\); the op shards it as "
                                             r"P\('tp', None\), which needs at least 2"):
            td.ag_matmul_sharded(bad_x, w, axis_name="tp")
    q, kv = jnp.ones((1, 2, 8)), jnp.ones((1, 4, 2, 8))
    with pytest.raises(ValueError, match=r"flash_decode_sharded: argument 3 has shape \(\)"):
        td.flash_decode_sharded(q, kv, kv, 4, axis_name="tp")
    with pytest.raises(TypeError, match=r"ag_matmul_sharded: batch_axes must be a mesh axis "
                                        r"name or a tuple of them \(\(\) for none\), got None"):
        td.ag_matmul_sharded(x, w, axis_name="tp", batch_axes=None)
    with pytest.raises(TypeError, match=r"ag_matmul_sharded: mesh= must be a "
                                        r"jax.sharding.Mesh .* got str"):
        td.ag_matmul_sharded(x, w, axis_name="tp", mesh="m")
    with pytest.raises(ValueError, match=r"w must be one \[K, N\] weight, got a tuple.*"
                                         r"the global \[\(8, 4\), 'tuple'\]"):
        td.ag_matmul_sharded(x, (w, w), axis_name="tp")
