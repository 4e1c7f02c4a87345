"""jaxtdist.grouped_matmul on one GPU, against float32 ragged_dot; skipped without
GPUs. Run with ``JAXTDIST_TEST_GPU=1`` (tests/gpu/run.sh does)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxtdist as td

pytestmark = pytest.mark.skipif(
    jax.devices()[0].platform != "gpu", reason="needs CUDA GPUs (none visible)")


def _fn(config=None):
    mesh = jax.make_mesh((1,), ("ep",), devices=jax.devices()[:1],
                         axis_types=(jax.sharding.AxisType.Auto,))
    td.initialize(mesh)
    return jax.jit(jax.shard_map(lambda x, w, s: td.grouped_matmul(x, w, s, config=config),
                                 mesh=mesh, in_specs=(P(), P(), P()), out_specs=P()))


# (R, H, F, sizes): TMA with whole and partial row tiles, rows past the groups, empty
# groups; H = 1000 bf16 (2000 bytes: TMA) and H = 1001 (the pointer GEMM).
CASES = [(1024, 512, 768, [300, 0, 500, 100]), (2048, 1000, 512, [2048]),
         (777, 1001, 264, [5, 0, 0, 700, 1, 3, 0, 60]), (4096, 256, 512, [0] * 8)]


# Decode sizes (16-bit: tiles of 16 or 32 rows; the default splits K in the second)
# with one expert empty; the down projection's shape in the pointer GEMM (F = 2047
# is no 16-byte row); 32 rows with a group of 20, H = 1000 (no K block multiple:
# a weight descriptor per tile; its gradient's dx reads w[g].T in column blocks that
# pass F into the next group's weights) and F = 1032 (a partial column tile); 5 rows.
DECODE = [(16, 2048, 5632, [3, 2, 0, 4, 1, 2, 2, 2]), (16, 5632, 2048, [2] * 8),
          (16, 5632, 2047, [5, 0, 0, 1, 0, 9, 0, 1]), (32, 1000, 1032, [20, 0, 5, 7]),
          (5, 4104, 512, [1, 0, 4])]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("r,h,f,sizes", CASES + DECODE)
def test_grouped_matmul(r, h, f, sizes, dtype):
    _grouped_matmul_matches(_fn(), r, h, f, sizes, dtype)


@pytest.mark.parametrize("split", [1, 2, 7, 16])
def test_grouped_matmul_split_k(split):
    """SPLIT_K forced on a prefill shape (partial row tiles, rows past the groups)
    and on a decode shape."""
    f_gm = _fn(dict(SPLIT_K=split))
    for r, h, f, sizes in (CASES[0], DECODE[0]):
        _grouped_matmul_matches(f_gm, r, h, f, sizes, jnp.bfloat16)


def _grouped_matmul_matches(f_gm, r, h, f, sizes, dtype):
    rng = np.random.default_rng(r + h)
    x = jnp.asarray(rng.standard_normal((r, h)) / np.sqrt(h), dtype)
    w = jnp.asarray(rng.standard_normal((len(sizes), h, f)), dtype)
    s = jnp.asarray(sizes, jnp.int32)
    for _ in range(2):
        out = np.asarray(f_gm(x, w, s), np.float32)
        ref = np.asarray(jax.lax.ragged_dot(x.astype(jnp.float32), w.astype(jnp.float32), s,
                                            precision=jax.lax.Precision.HIGHEST))
        used = min(sum(sizes), r)
        np.testing.assert_array_equal(out[used:], 0.0)
        if used:
            err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
            assert err < (2e-2 if dtype == jnp.bfloat16 else 5e-3), err


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("r,h,f,sizes", [CASES[0], CASES[2], DECODE[1], DECODE[3]])
def test_grouped_matmul_grad(r, h, f, sizes, dtype):
    """Gradients of x and w (the backward is ragged_dot's VJP) against float32,
    TMA and pointer-GEMM shapes."""
    mesh = jax.make_mesh((1,), ("ep",), devices=jax.devices()[:1],
                         axis_types=(jax.sharding.AxisType.Auto,))
    td.initialize(mesh)
    rng = np.random.default_rng(r * 7 + f)
    x = jnp.asarray(rng.standard_normal((r, h)) / np.sqrt(h), dtype)
    w = jnp.asarray(rng.standard_normal((len(sizes), h, f)) / np.sqrt(h), dtype)
    c = jnp.asarray(rng.standard_normal((r, f)), jnp.float32)
    s = jnp.asarray(sizes, jnp.int32)

    def loss(fn):
        return lambda x, w, s: jnp.sum(fn(x, w, s).astype(jnp.float32) * c)

    grad = jax.jit(jax.shard_map(jax.grad(loss(td.grouped_matmul), argnums=(0, 1)), mesh=mesh,
                                 in_specs=(P(), P(), P()), out_specs=(P(), P())))
    ref = jax.grad(loss(lambda a, b, s: jax.lax.ragged_dot(
        a, b, s, precision=jax.lax.Precision.HIGHEST)), argnums=(0, 1))(
        x.astype(jnp.float32), w.astype(jnp.float32), s)
    for _ in range(2):
        for got, want in zip(grad(x, w, s), ref):
            got, want = np.asarray(got, np.float32), np.asarray(want)
            err = np.linalg.norm(got - want) / np.linalg.norm(want)
            assert err < (2e-2 if dtype == jnp.bfloat16 else 5e-3), err
