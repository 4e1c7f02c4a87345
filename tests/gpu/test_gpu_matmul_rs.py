"""matmul_rs and matmul_ar on GPUs: world 1 (the local GEMM, and the kernels
themselves), and 2 and 4 GPUs where that many are visible; skipped without GPUs.
Run with ``JAXTDIST_TEST_GPU=1`` (tests/gpu/run.sh does)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxtdist.ops.matmul_rs import (matmul_ar, matmul_ar_kernels, matmul_rs,
                                    matmul_rs_kernels)
from tests.conftest import gpu_mesh

pytestmark = pytest.mark.skipif(
    jax.devices()[0].platform != "gpu", reason="needs CUDA GPUs (none visible)")

TOL = {jnp.bfloat16: 2e-2, jnp.float16: 5e-3, jnp.float32: 5e-3}  # f32 dots run as tf32
X_SPEC, W_SPEC = P(None, "tp"), P("tp", None)
_seed = [0]


def _rand(shape, dtype, scale=1.0):
    _seed[0] += 1
    x = np.random.default_rng(_seed[0]).standard_normal(shape, np.float32) * scale
    return jnp.asarray(x).astype(dtype)


def _mesh(world):
    return gpu_mesh(world, "tp")


def _check(mesh, op, out_spec, m, n, k, dtype, calls=3):
    f = jax.jit(jax.shard_map(lambda x, w: op(x, w, "tp"), mesh=mesh,
                              in_specs=(X_SPEC, W_SPEC), out_specs=out_spec, check_vma=False))
    for _ in range(calls):  # both inbox parities, fresh data each time
        x, w = _rand((m, k), dtype, 1 / np.sqrt(k)), _rand((k, n), dtype)
        out = f(jax.device_put(x, NamedSharding(mesh, X_SPEC)),
                jax.device_put(w, NamedSharding(mesh, W_SPEC)))
        ref = np.asarray(x, np.float32) @ np.asarray(w, np.float32)
        out = np.asarray(out, np.float32)
        assert np.all(np.isfinite(out)), "non-finite output (unwritten or corrupted)"
        err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
        assert err < TOL[dtype], (op.__name__, m, n, k, err)


# (M, N, K over all ranks): odd sizes, and one large enough for a full persistent grid.
RS_SHAPES = [(4 * 40, 200, 4 * 72), (4 * 1024, 2048, 4 * 1024)]
AR_SHAPES = [(1, 8192, 8192), (16, 4104, 4 * 520), (128, 1000, 4 * 300)]


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("m,n,k", RS_SHAPES)
def test_matmul_rs(world, dtype, m, n, k):
    mesh = _mesh(world)
    ops = (matmul_rs, matmul_rs_kernels) if world == 1 else (matmul_rs,)
    for op in ops:
        _check(mesh, op, P("tp", None), m, n, k, dtype)


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("m,n,k", AR_SHAPES)
def test_matmul_ar(world, dtype, m, n, k):
    mesh = _mesh(world)
    ops = (matmul_ar, matmul_ar_kernels) if world == 1 else (matmul_ar,)
    for op in ops:
        _check(mesh, op, P(), m, n, k, dtype)


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("split_k,tma", [(3, False), (3, True), (8, False)])
def test_matmul_ar_split_k(world, split_k, tma):
    """SPLIT_K programs per tile, K per rank 1000 (8 blocks of 128, the last split
    short), pointer and TMA loads: 4 calls in one jit, run twice (the arrival
    counters only grow), the same bits on every rank."""
    _check_chained_ar(world, 16, 1000, world * 1000,
                      dict(SPLIT_K=split_k, TMA=tma, BLOCK_N=64, BLOCK_K=128))


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("m,config", [
    (128, dict(TWO_SHOT=True)),
    (200, dict(TWO_SHOT=True, PARTIAL="float32", TMA=True, BLOCK_M=64)),
    (16, dict(TWO_SHOT=True, SPLIT_K=3, BLOCK_N=64, BLOCK_K=128))])
def test_matmul_ar_two_shot(world, m, config):
    """Each tile reduced on its owner rank and broadcast: bf16 and float32
    partials, TMA and pointer loads, split K; the same bits on every rank."""
    _check_chained_ar(world, m, 1000, world * 1000, config)


def _check_chained_ar(world, m, n, k, cfg, calls=4):
    """``calls`` matmul_ar kernels in one jit, run twice (the arrival counters and
    flags only grow): the same bits on every rank, each near the float32 product."""
    mesh = _mesh(world)

    def chain(x, w):
        return jnp.stack([matmul_ar_kernels(x * (1.0 + i), w, "tp", config=cfg)
                          for i in range(calls)])[None]

    f = jax.jit(jax.shard_map(chain, mesh=mesh, in_specs=(X_SPEC, W_SPEC),
                              out_specs=P("tp"), check_vma=False))
    for _ in range(2):
        x, w = _rand((m, k), jnp.bfloat16, 1 / np.sqrt(k)), _rand((k, n), jnp.bfloat16)
        out = np.asarray(f(jax.device_put(x, NamedSharding(mesh, X_SPEC)),
                           jax.device_put(w, NamedSharding(mesh, W_SPEC))), np.float32)
        for r in range(1, world):
            np.testing.assert_array_equal(out[r], out[0], err_msg=f"rank {r} differs")
        ref = np.asarray(x, np.float32) @ np.asarray(w, np.float32)
        for i in range(calls):
            want = ref * (1.0 + i)
            assert np.linalg.norm(out[0, i] - want) / np.linalg.norm(want) < 2e-2, i


@pytest.mark.parametrize("world", [2, 4])
def test_chained_calls(world):
    """Reuse races: 8 calls of each op in one jit, 10 times on fresh data."""
    mesh = _mesh(world)
    m, n, k, calls = world * 256, 1024, world * 512, 8

    def chain(x, w):
        rs = [matmul_rs(x * (1.0 + i), w, "tp") for i in range(calls)]
        ar = [matmul_ar(x[:16] * (1.0 + i), w, "tp") for i in range(calls)]
        return jnp.stack(rs), jnp.stack(ar)

    f = jax.jit(jax.shard_map(chain, mesh=mesh, in_specs=(X_SPEC, W_SPEC),
                              out_specs=(P(None, "tp", None), P()), check_vma=False))
    for _ in range(10):
        x, w = _rand((m, k), jnp.bfloat16, 1 / np.sqrt(k)), _rand((k, n), jnp.bfloat16)
        rs, ar = f(jax.device_put(x, NamedSharding(mesh, X_SPEC)),
                   jax.device_put(w, NamedSharding(mesh, W_SPEC)))
        ref = np.asarray(x, np.float32) @ np.asarray(w, np.float32)
        for i in range(calls):
            for out, want in ((rs[i], ref), (ar[i], ref[:16])):
                out = np.asarray(out, np.float32)
                want = want * (1.0 + i)
                assert np.linalg.norm(out - want) / np.linalg.norm(want) < 2e-2, i


@pytest.mark.parametrize("op", ["ag_matmul", "matmul_rs", "matmul_ar"])
def test_float32_kernels_follow_the_matmul_precision(op):
    """float32 GEMM kernels at world 1 against a float64 product, beside XLA's dot:
    under JAX's default precision both round to TF32 (ours no more than 1.5x XLA's
    error); under "highest" both keep float32's accuracy (ours: tf32x3)."""
    import contextlib

    from jaxtdist.ops.ag_matmul import ag_matmul_with_gathered
    mesh = _mesh(1)
    kernels = {"ag_matmul": lambda x, w: ag_matmul_with_gathered(x, w, "tp",
                                                                 gathered=False)[0],
               "matmul_rs": lambda x, w: matmul_rs_kernels(x, w, "tp"),
               "matmul_ar": lambda x, w: matmul_ar_kernels(x, w, "tp")}
    m, n, k = (16, 4096, 4096) if op == "matmul_ar" else (1024, 2048, 2048)
    x, w = _rand((m, k), jnp.float32, 1 / np.sqrt(k)), _rand((k, n), jnp.float32)
    ref = np.asarray(x, np.float64) @ np.asarray(w, np.float64)

    def err(out):
        out = np.asarray(out, np.float64)
        assert np.all(np.isfinite(out)), "non-finite output (unwritten or corrupted)"
        return np.linalg.norm(out - ref) / np.linalg.norm(ref)

    errors = {}
    for precision in (None, "highest"):
        scope = (jax.default_matmul_precision(precision) if precision
                 else contextlib.nullcontext())
        with scope:  # traced inside: the kernels read the precision when traced
            ours = jax.jit(jax.shard_map(kernels[op], mesh=mesh, in_specs=(P(), P()),
                                         out_specs=P(), check_vma=False))(x, w)
            xla = jax.jit(jnp.dot)(x, w)
        errors[precision] = (err(ours), err(xla))
    (ours_tf32, xla_tf32), (ours_f32, xla_f32) = errors[None], errors["highest"]
    assert ours_tf32 <= 1.5 * xla_tf32, errors
    assert ours_f32 < 1e-5 and ours_f32 < 0.1 * ours_tf32, errors
