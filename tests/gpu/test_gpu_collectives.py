"""jaxtdist's reduce_scatter and all_reduce on GPUs, against float32 sums; skipped
without GPUs (run with JAXTDIST_TEST_GPU=1, as tests/gpu/run.sh does).

World 1 runs the local computation (no kernel); 2 and 4 GPUs run the kernels,
both all-reduce algorithms, sizes on both sides of the one-shot threshold and
odd ones, and back-to-back calls on changing data (reuse races)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxtdist.ops.all_reduce import all_reduce
from jaxtdist.ops.reduce_scatter import reduce_scatter
from tests.conftest import gpu_mesh

pytestmark = pytest.mark.skipif(
    jax.devices()[0].platform != "gpu", reason="needs CUDA GPUs (none visible)")

# The all-reduce algorithm of call i of the chained test (i % 3 == 2: reduce_scatter).
ALGOS = ("one_shot", "two_shot", None, "one_shot_push", "one_shot_push_flags")
TOL = {jnp.bfloat16: 1e-2, jnp.float16: 2e-3, jnp.float32: 1e-5}
_seed = [0]


def _rand(shape, dtype):
    _seed[0] += 1
    x = np.random.default_rng(_seed[0]).standard_normal(shape, np.float32)
    return np.asarray(jnp.asarray(x).astype(dtype).astype(jnp.float32))


def _mesh(world):
    return gpu_mesh(world, "tp")


def _rel(out, ref):
    out = np.asarray(out, np.float32)
    assert np.all(np.isfinite(out)), "non-finite output (unwritten or corrupted)"
    return np.linalg.norm(out - ref) / np.linalg.norm(ref)


def _run(mesh, body, x, dtype):
    world = mesh.devices.size
    f = jax.jit(jax.shard_map(lambda v: body(v[0])[None], mesh=mesh, in_specs=P("tp"),
                              out_specs=P("tp")))
    return f(jax.device_put(jnp.asarray(x, dtype), NamedSharding(mesh, P("tp")))), world


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("n", [8192, 1000003, 1 << 22])   # 16 KiB bf16, odd, 8 MiB bf16
@pytest.mark.parametrize("algorithm", ["auto", "one_shot", "two_shot"])
def test_all_reduce(world, dtype, n, algorithm):
    _check_all_reduce(world, dtype, n, algorithm)


def _check_all_reduce(world, dtype, n, algorithm):
    """all_reduce of fresh [world, n] data with ``algorithm``: the float32 sum on
    rank 0, the same bits on every rank."""
    mesh = _mesh(world)
    x = _rand((world, n), dtype)
    out, _ = _run(mesh, lambda v: all_reduce(v, "tp", config=dict(ALGORITHM=algorithm)), x,
                  dtype)
    out = np.asarray(out, np.float32)
    assert _rel(out[0], x.sum(0)) < TOL[dtype]
    for r in range(1, world):
        np.testing.assert_array_equal(out[r], out[0])


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("n", [8192, 1000003])   # 16 KiB bf16, odd
@pytest.mark.parametrize("algorithm", ["one_shot_push", "one_shot_push_flags"])
def test_all_reduce_pushes(world, dtype, n, algorithm):
    """The push algorithms (each rank's values stored into every peer's heap),
    which "auto" picks for small arrays only."""
    _check_all_reduce(world, dtype, n, algorithm)


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("shape", [(4096, 1024), (12, 1001)])
def test_reduce_scatter(world, dtype, shape):
    mesh = _mesh(world)
    x = _rand((world,) + shape, dtype)
    out, _ = _run(mesh, lambda v: reduce_scatter(v, "tp"), x, dtype)
    expect = np.stack(np.split(x.sum(0), world, axis=0))
    assert _rel(out, expect) < TOL[dtype]


@pytest.mark.parametrize("world", [2, 4])
def test_back_to_back_calls_on_changing_data(world):
    """20 calls of a jitted chain of 6 (four all-reduce algorithms, reduce_scatter)
    queued without waiting: a fast rank runs calls ahead of a slow one."""
    mesh = _mesh(world)
    n = 1 << 16

    def chain(v, y):
        for i in range(6):
            z = v / world + jnp.roll(y, i)
            if i % 3 == 2:
                v = jnp.tile(reduce_scatter(z, "tp"), world)
            else:
                v = all_reduce(z, "tp", config=dict(ALGORITHM=ALGOS[i % 5]))
        return v

    f = jax.jit(jax.shard_map(chain, mesh=mesh, in_specs=(P("tp"), P("tp")),
                              out_specs=P("tp")))
    sharding = NamedSharding(mesh, P("tp"))
    x = _rand((world, n), jnp.float32)
    ys = [_rand((world, n), jnp.float32) for _ in range(20)]
    out = jax.device_put(x.reshape(-1), sharding)
    for y in ys:
        out = f(out, jax.device_put(y.reshape(-1), sharding))
    xs = x.astype(np.float64)
    for y in ys:
        for i in range(6):
            total = (xs / world + np.roll(y, i, axis=1)).sum(0)
            xs = (np.stack([np.tile(b, world) for b in np.split(total, world)]) if i % 3 == 2
                  else np.tile(total, (world, 1)))
    assert _rel(np.asarray(out).reshape(world, n), xs) < 1e-4
