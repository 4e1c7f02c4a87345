"""jaxtdist.flash_decode on GPUs, against a float32 reference (decode attention over
the whole cache, computed on the host); skipped without GPUs (run with
JAXTDIST_TEST_GPU=1, as tests/gpu/run.sh does).

World 1 runs both the local computation and the kernel forced there
(``flash_decode_kernels``); 2 and 4 GPUs run the kernel with ragged lengths, a
rank holding no valid position, GQA ratios 1, 4 and 8, head dims 64 and 128,
and chained decode steps on changing data (reuse races). The multi-process
layout (NVSHMEM heap, processes sharing one GPU) is covered by
tests/multiprocess/ops_check.py's ``flash_decode`` check."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxtdist as td
from jaxtdist.bench.flash_decode import paged_cache
from jaxtdist.ops.flash_decode import flash_decode_kernels
from tests.conftest import gpu_mesh

pytestmark = pytest.mark.skipif(
    jax.devices()[0].platform != "gpu", reason="needs CUDA GPUs (none visible)")

# float32: TF32 dots with operands rounded to nearest (JAX's default matmul
# precision, as XLA's decode).
TOL = {jnp.bfloat16: 2e-2, jnp.float16: 5e-3, jnp.float32: 5e-3}
SPECS = (P(), P(None, "sp"), P(None, "sp"), P())
_seed = [0]


def _rand(shape, dtype):
    _seed[0] += 1
    x = np.random.default_rng(_seed[0]).standard_normal(shape, np.float32)
    return np.asarray(jnp.asarray(x).astype(dtype).astype(jnp.float32))


def _mesh(world):
    return gpu_mesh(world, "sp")


def _reference(q, k, v, kv_len):
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    b, hq, d = q.shape
    s, hkv = k.shape[1], k.shape[2]
    scores = np.einsum("bhgd,bshd->bhgs", q.reshape(b, hkv, hq // hkv, d), k) / np.sqrt(d)
    valid = np.arange(s)[None, :] < np.asarray(kv_len)[:, None]
    scores = np.where(valid[:, None, None, :], scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    o = np.einsum("bhgs,bshd->bhgd", p / p.sum(-1, keepdims=True), v)
    return o.reshape(b, hq, d)


def _rel(out, ref):
    out = np.asarray(out, np.float32)
    assert np.all(np.isfinite(out)), "non-finite output (unwritten or corrupted)"
    return np.linalg.norm(out - ref) / np.linalg.norm(ref)


def _place(mesh, q, k, v, lens, dtype):
    return (jax.device_put(jnp.asarray(q, dtype), NamedSharding(mesh, P())),
            jax.device_put(jnp.asarray(k, dtype), NamedSharding(mesh, P(None, "sp"))),
            jax.device_put(jnp.asarray(v, dtype), NamedSharding(mesh, P(None, "sp"))),
            jax.device_put(jnp.asarray(lens, jnp.int32), NamedSharding(mesh, P())))


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("b,hq,hkv,d,s_shard", [(2, 32, 8, 128, 4099), (3, 8, 8, 64, 1000),
                                                (1, 64, 8, 128, 65536), (4, 16, 2, 64, 37)])
@pytest.mark.parametrize("kernels", [False, True])
def test_flash_decode(world, dtype, b, hq, hkv, d, s_shard, kernels):
    if kernels and world > 1:
        pytest.skip("flash_decode runs the kernel at world > 1 anyway")
    mesh = _mesh(world)
    op = flash_decode_kernels if kernels else td.flash_decode
    f = jax.jit(jax.shard_map(lambda q, k, v, n: op(q, k, v, n, "sp"), mesh=mesh,
                              in_specs=SPECS, out_specs=P()))
    total = world * s_shard
    for call in range(3):  # both inbox parities, and one reused
        q = _rand((b, hq, d), dtype)
        k, v = _rand((b, total, hkv, d), dtype), _rand((b, total, hkv, d), dtype)
        # Full, inside rank 0 only (other ranks hold none valid), odd, random.
        lens = np.array([total, max(1, s_shard // 3), total - 7 * call - 1,
                         np.random.default_rng(call).integers(1, total + 1)][:b], np.int32)
        out = f(*_place(mesh, q, k, v, lens, dtype))
        assert out.dtype == jnp.dtype(dtype)
        assert _rel(out, _reference(q, k, v, lens)) < TOL[dtype], (call, lens)


@pytest.mark.parametrize("world", [1, 2])
def test_flash_decode_float32_follows_the_matmul_precision(world):
    """float32 caches: TF32 dots by default (XLA's decode's error level, 4e-4 at
    S = 8K on one H200), float32 accuracy (tf32x3) under
    ``jax.default_matmul_precision("highest")``."""
    mesh = _mesh(world)
    b, hq, hkv, d, total = 2, 16, 4, 128, world * 3001
    q = _rand((b, hq, d), jnp.float32)
    k, v = _rand((b, total, hkv, d), jnp.float32), _rand((b, total, hkv, d), jnp.float32)
    lens = np.array([total, total - 1000], np.int32)
    ref = _reference(q, k, v, lens)
    args = _place(mesh, q, k, v, lens, jnp.float32)
    errors = {}
    for precision in ("default", "highest"):
        with jax.default_matmul_precision(precision):
            f = jax.jit(jax.shard_map(lambda *a: flash_decode_kernels(*a, "sp"), mesh=mesh,
                                      in_specs=SPECS, out_specs=P()))
            errors[precision] = _rel(f(*args), ref)
    assert 1e-5 < errors["default"] < 2e-3, errors  # TF32: not float32's accuracy
    assert errors["highest"] < 2e-5, errors


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("dtype,hq,hkv,d", [(jnp.float32, 8, 2, 160), (jnp.float32, 4, 4, 256),
                                            (jnp.bfloat16, 16, 16, 128),
                                            (jnp.float16, 24, 8, 64)])
def test_flash_decode_default_config_on_other_heads(world, dtype, hq, hkv, d):
    """Default configs where the tile is not the common one: float32 caches past
    head dim 128 (the K/V stages of the default step would not fit an SM),
    multi-head attention (one query row per KV head: partials and inbox slots of
    one row) and GQA group 3 (rows padded to 4); the kernel forced at world 1."""
    mesh = _mesh(world)
    b, s_shard = 2, 1531
    total = world * s_shard
    f = jax.jit(jax.shard_map(lambda *a: flash_decode_kernels(*a, "sp"), mesh=mesh,
                              in_specs=SPECS, out_specs=P()))
    # 12 calls: an exchange that mixed calls (a single wait for all three parts,
    # tried and dropped) failed 2 to 5 calls in 24 at groups 1 and 3.
    for call in range(12):
        q = _rand((b, hq, d), dtype)
        k, v = _rand((b, total, hkv, d), dtype), _rand((b, total, hkv, d), dtype)
        lens = np.array([total - call, s_shard // 2 + 37 * call], np.int32)
        out = f(*_place(mesh, q, k, v, lens, dtype))
        assert _rel(out, _reference(q, k, v, lens)) < TOL[dtype], (call, lens)


@pytest.mark.parametrize("world", [2, 4])
def test_flash_decode_chained_decode_steps(world):
    """50 decode steps (10 per jit call), each query built from the previous output plus
    fresh data, the lengths growing; every call on fresh caches."""
    mesh = _mesh(world)
    b, hq, hkv, d, s_shard, steps = 2, 32, 8, 128, 2048, 10

    def chain(q, k, v, qs, n0):
        outs = []
        for i in range(steps):
            q = td.flash_decode(q * 0.5 + qs[i], k, v, n0 + i, "sp")
            outs.append(q)
        return jnp.stack(outs)

    f = jax.jit(jax.shard_map(chain, mesh=mesh, in_specs=SPECS[:3] + (P(), P()),
                              out_specs=P()))
    for call in range(5):
        q = _rand((b, hq, d), jnp.bfloat16)
        k = _rand((b, world * s_shard, hkv, d), jnp.bfloat16)
        v = _rand((b, world * s_shard, hkv, d), jnp.bfloat16)
        qs = _rand((steps, b, hq, d), jnp.bfloat16)
        n0 = np.array([1 + 100 * call, world * s_shard - steps - call], np.int32)
        args = _place(mesh, q, k, v, n0, jnp.bfloat16)
        out = np.asarray(f(*args[:3], jnp.asarray(qs, jnp.bfloat16), args[3]), np.float32)
        expect = q
        for i in range(steps):
            # The op's input is rounded to bf16 as the kernel sees it.
            q_in = np.asarray(jnp.asarray(expect * 0.5 + qs[i], jnp.bfloat16), np.float32)
            expect = _reference(q_in, k, v, n0 + i)
            assert _rel(out[i], expect) < 3e-2, (call, i)
            expect = out[i]


@pytest.mark.parametrize("dtype,page", [(jnp.bfloat16, 16), (jnp.float16, 64)])
def test_flash_decode_paged_kernel_at_world_1(dtype, page):
    """The kernel forced at world 1 on a paged cache (shuffled pages, junk ids past
    each length) gives the contiguous cache's output bit for bit."""
    mesh = _mesh(1)
    b, hq, hkv, d, s = 3, 32, 8, 128, 4096
    q, k, v = (_rand(shape, dtype) for shape in ((b, hq, d), (b, s, hkv, d), (b, s, hkv, d)))
    k_pool, v_pool, table = paged_cache(jnp.asarray(k, dtype), jnp.asarray(v, dtype), page, 5,
                                        page)
    pools = (k_pool, v_pool)
    table = np.array(table)  # writable
    lens = np.array([s, page + 3, 1000], np.int32)
    for i, n in enumerate(lens):
        table[i, -(-n // page):] = -1  # never read
    spec5 = (P(), P(), P(), P(), P())
    paged = jax.jit(jax.shard_map(
        lambda q, k, v, n, t: flash_decode_kernels(q, k, v, n, "sp", block_table=t),
        mesh=mesh, in_specs=spec5, out_specs=P()))
    flat = jax.jit(jax.shard_map(lambda q, k, v, n: flash_decode_kernels(q, k, v, n, "sp"),
                                 mesh=mesh, in_specs=SPECS, out_specs=P()))
    qd = jnp.asarray(q, dtype)
    out = paged(qd, *pools, jnp.asarray(lens), jnp.asarray(table))
    ref = flat(qd, jnp.asarray(k, dtype), jnp.asarray(v, dtype), jnp.asarray(lens))
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(ref, np.float32))
    assert _rel(out, _reference(q, k, v, lens)) < TOL[dtype]
