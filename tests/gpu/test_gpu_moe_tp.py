"""moe_tp_mlp on GPUs: world 1 (the local computation), 2 and 4 GPUs where that many
are visible, both grouped GEMMs (XLA's ragged_dot and jaxtdist.grouped_matmul) and the
overlapped schedule,
against a float64 reference of the unsharded layer; gradients against a dense
plain-JAX twin. Skipped without GPUs; run with ``JAXTDIST_TEST_GPU=1``
(tests/gpu/run.sh does)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

import jaxtdist as td
from tests.test_cpu_moe_tp import EXPERTS_W1, EXPERTS_W2, TOKENS, _reference, _routing
from tests.conftest import gpu_mesh

pytestmark = pytest.mark.skipif(
    jax.devices()[0].platform != "gpu", reason="needs CUDA GPUs (none visible)")

BF16, F32 = jnp.bfloat16, jnp.float32


def _mesh(world):
    return gpu_mesh(world, "tp")


def _normal(rng, shape, dtype, scale=1.0):
    return jnp.asarray(rng.standard_normal(shape) * scale, dtype)


def _layer(mesh, gated, grouped_gemm):
    """The layer with ``grouped_gemm`` ("ragged_dot" or "jaxtdist", step by step), or
    "overlapped": the overlapped schedule (on jaxtdist's grouped GEMMs)."""
    specs = (TOKENS, TOKENS, TOKENS, EXPERTS_W1, EXPERTS_W2) + ((EXPERTS_W1,) if gated else ())
    overlap = grouped_gemm == "overlapped"
    kw = dict(overlap=True) if overlap else dict(grouped_gemm=grouped_gemm, overlap=False)

    def body(x, ids, gate, w1, w2, *w_up):
        return td.moe_tp_mlp(x, ids, gate, w1, w2, "tp", w_up=w_up[0] if w_up else None, **kw)

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=TOKENS)), specs


@pytest.mark.parametrize("grouped_gemm", ["ragged_dot", "jaxtdist", "overlapped"])
@pytest.mark.parametrize("world,t,k,e,h,f,gated", [
    (1, 33, 2, 8, 256, 512, True),      # the local computation
    (2, 64, 2, 8, 512, 1024, True),     # Mixtral-like: top-2 of 8, SwiGLU
    (2, 17, 8, 16, 256, 256, False),    # odd tokens, K = 8
    (4, 32, 1, 4, 256, 512, True),      # K = 1
    (4, 300, 2, 8, 512, 1024, True),    # several row tiles per (rank, expert) group
])
def test_moe_tp_mlp(world, t, k, e, h, f, gated, grouped_gemm):
    mesh = _mesh(world)
    fn, specs = _layer(mesh, gated, grouped_gemm)
    rng = np.random.default_rng(world * 1000 + t)
    for _ in range(2):  # fresh data and routing: one program for every routing
        x = _normal(rng, (world * t, h), BF16)
        ids = _routing(rng, world * t, k, e)
        gate = jnp.asarray(rng.random(ids.shape), F32)
        w1, w2 = _normal(rng, (e, h, f), BF16, h ** -0.5), _normal(rng, (e, f, h), BF16,
                                                                    f ** -0.5)
        arrays = (x, ids, gate, w1, w2) + ((_normal(rng, (e, h, f), BF16, h ** -0.5),)
                                           if gated else ())
        out = fn(*(jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(arrays, specs)))
        assert out.shape == x.shape and out.dtype == jnp.dtype(BF16)
        ref = _reference(*arrays[:5], *arrays[5:])
        err = np.linalg.norm(np.asarray(out, np.float64) - ref) / np.linalg.norm(ref)
        assert err < 2e-2, (world, grouped_gemm, err)  # bf16 GEMMs and activations


@pytest.mark.parametrize("grouped_gemm", ["ragged_dot", "jaxtdist", "overlapped"])
def test_moe_tp_mlp_grad(grouped_gemm):
    """Gradients of x, the routing weights and every expert matrix at the largest world
    visible (up to 4), float32, against jax.grad of a dense plain-JAX twin."""
    world = min(len(jax.devices()), 4)
    mesh = _mesh(world)
    fn, specs = _layer(mesh, True, grouped_gemm)
    t, k, e, h, f = 16, 2, 4, 64, 32 * world
    rng = np.random.default_rng(11)
    x = _normal(rng, (world * t, h), F32)
    ids = _routing(rng, world * t, k, e)
    gate = jnp.asarray(rng.random(ids.shape), F32)
    w1, w2, w_up = (_normal(rng, (e, h, f), F32, 0.3), _normal(rng, (e, f, h), F32, 0.3),
                    _normal(rng, (e, h, f), F32, 0.3))
    c = _normal(rng, (world * t, h), F32)
    diff = (0, 2, 3, 4, 5)

    def dense(x, ids, gate, w1, w2, w_up):
        hid = jax.nn.silu(jnp.einsum("th,tkhf->tkf", x, w1[ids]))
        hid = hid * jnp.einsum("th,tkhf->tkf", x, w_up[ids])
        return jnp.einsum("tkf,tkfh,tk->th", hid, w2[ids], gate)

    arrays = (x, ids, gate, w1, w2, w_up)
    placed = tuple(jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(arrays, specs))
    with jax.default_matmul_precision("highest"):
        got = jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a) * c), argnums=diff))(*placed)
        want = jax.jit(jax.grad(lambda *a: jnp.sum(dense(*a) * c), argnums=diff))(*arrays)
    # jaxtdist's grouped GEMM multiplies float32 on tensor cores (tf32).
    tol = 1e-4 if grouped_gemm == "ragged_dot" else 5e-3
    for i, g, w in zip(diff, got, want):
        err = np.linalg.norm(np.asarray(g) - np.asarray(w)) / np.linalg.norm(np.asarray(w))
        assert err < tol, (i, grouped_gemm, err)


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_moe_tp_mlp_overlapped_forward_matches_the_steps(dtype):
    """The overlapped schedule's output against the step-by-step one and the float64
    reference, float32 included: there the kernel reads a tf32-rounded copy of the
    chunk, and pushing any other buffer let XLA reuse it while the copy engines
    still read it (relative errors of 0.5-0.9 on 2 and 4 GPUs)."""
    world = min(len(jax.devices()), 4)
    mesh = _mesh(world)
    t, k, e, h, f = 64, 2, 8, 256, 128 * world
    rng = np.random.default_rng(17)
    x = _normal(rng, (world * t, h), dtype)
    ids = _routing(rng, world * t, k, e)
    gate = jnp.asarray(rng.random(ids.shape), F32)
    w1, w2 = _normal(rng, (e, h, f), dtype, h ** -0.5), _normal(rng, (e, f, h), dtype, f ** -0.5)
    arrays = (x, ids, gate, w1, w2)
    ref = _reference(*arrays)
    outs = {}
    for name in ("jaxtdist", "overlapped"):
        fn, specs = _layer(mesh, False, name)
        outs[name] = np.asarray(fn(*(jax.device_put(a, NamedSharding(mesh, s))
                                     for a, s in zip(arrays, specs))), np.float64)
    tol = 2e-3 if dtype == F32 else 2e-2  # tf32 / bf16 GEMMs
    for name, out in outs.items():
        err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
        assert err < tol, (name, err)
