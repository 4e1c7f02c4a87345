"""ag_matmul with GEMM="cublas" (one library GEMM per source rank), under the interpreter.

On the CPU backend the copy engines' pushes are SM-style kernels, the waits
are the real ``shard_wait_kernel`` and the library GEMM is the CPU handler's
loop behind the same step plan as cuBLASLt's (``csrc/shard_gemm.h``): these
tests cover the step order, the inbox parity and the rows each step writes.
"""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxtdist as td
from jaxtdist.ops.ag_matmul import resolve_config
from tests.conftest import (ag_matmul_fn, assert_close, check_ag_matmul_call, check_config_errors,
                            cpu_only, f64, place, rand, setup)

pytestmark = cpu_only()

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
CUBLAS = dict(GEMM="cublas")


@pytest.mark.parametrize("world,dtype,shape", [
    (1, F32, (16, 32, 8)), (2, F32, (16, 48, 24)), (2, BF16, (32, 64, 16)),
    (4, BF16, (16, 32, 20)), (4, F16, (8, 40, 16)), (3, F32, (24, 16, 8)),
    (8, F32, (8, 16, 8))], ids=str)
def test_shard_gemm_matches_reference_over_chained_calls(world, dtype, shape):
    """Several calls on fresh data: both inbox parities, every step's rows."""
    mesh = setup(world)
    m, k, n = shape
    f = ag_matmul_fn(mesh, CUBLAS)
    for _ in range(3):
        check_ag_matmul_call(mesh, f, world, m, k, n, dtype)


def test_shard_gemm_interleaved_with_the_fused_kernel():
    """Both GEMM modes share the inboxes of one shape: interleaved calls stay exact."""
    world, m, k, n = 4, 16, 32, 16
    mesh = setup(world)
    base = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, TMA=True, PRODUCER="ce")
    fused, by_shard = ag_matmul_fn(mesh, base), ag_matmul_fn(mesh, CUBLAS)
    for f in (by_shard, fused, by_shard, by_shard, fused):
        check_ag_matmul_call(mesh, f, world, m, k, n, F32)


def test_shard_gemm_on_tp_of_a_dp_tp_mesh():
    """Groups of a (dp, tp) mesh: each tp group's steps use its own ranks."""
    mesh = setup((2, 2), ("dp", "tp"))
    m, k, n = 16, 32, 8
    x = rand((4 * m, k), F32)
    w = rand((k, 2 * n), F32)
    f = ag_matmul_fn(mesh, CUBLAS, batch="dp")
    out = f(place(mesh, x, P(("dp", "tp"), None)), place(mesh, w, P(None, "tp")))
    ref = np.concatenate([f64(x[:2 * m]) @ f64(w), f64(x[2 * m:]) @ f64(w)])
    assert_close(out, ref, F32)


def test_shard_gemm_gradients(monkeypatch):
    """jax.grad through the shard-at-a-time forward (chosen by the tuning cache)."""
    world, m, k, n = 2, 16, 32, 16
    mesh = setup(world)
    x = rand((world * m, k), F32)
    w = rand((k, world * n), F32)

    def loss(fwd):
        def body(xs, ws):
            return jnp.sum(jnp.sin(fwd(xs, ws)))
        return jax.jit(jax.grad(lambda a, b: jax.shard_map(
            lambda xs, ws: jax.lax.psum(body(xs, ws), "tp"), mesh=mesh,
            in_specs=(P("tp", None), P(None, "tp")), out_specs=P())(a, b), argnums=(0, 1)))

    monkeypatch.setattr(td.runtime.runtime().tuning, "lookup", lambda *args: dict(CUBLAS))
    got = loss(lambda xs, ws: td.ag_matmul(xs, ws, "tp"))(
        place(mesh, x, P("tp", None)), place(mesh, w, P(None, "tp")))
    want = jax.grad(lambda a, b: jnp.sum(jnp.sin(a @ b)), argnums=(0, 1))(
        jnp.asarray(x, F32), jnp.asarray(w, F32))
    for g, r in zip(got, want):
        assert_close(g, np.asarray(r, np.float64), F32)


def test_shard_gemm_config_errors():
    check_config_errors([
        (dict(GEMM="cutlass"), r"GEMM='cutlass'; allowed: \('triton', 'cublas'\)"),
        (dict(GEMM="cublas", PRODUCER="sm"), "GEMM='cublas' needs PRODUCER='ce'"),
        (dict(GEMM="cublas", GEMM_ALGO=-1), "GEMM_ALGO=-1 must be an int >= 0"),
        (dict(GEMM="cublas", GEMM_ALGO=1.5), "GEMM_ALGO=1.5 must be an int >= 0")],
        x_shape=(32, 16), w_shape=(16, 16))


def test_shard_gemm_config_defaults():
    """GEMM="cublas" brings the copy engines and, on GPUs, one chunk (flag) per shard."""
    rt = td.runtime.runtime()
    setup(2)
    cpu = resolve_config(rt, "tp", 2, 48, 32, 64, F32, CUBLAS)
    assert (cpu["PRODUCER"], cpu["TMA"], cpu["STREAM_K"]) == ("ce", False, False)
    assert cpu["CHUNK_ROWS"] == cpu["BLOCK_M"]  # power-of-2 chunks for the interpreter's pushes

    gpu_rt = types.SimpleNamespace(platform="gpu",
                                   tuning=types.SimpleNamespace(lookup=lambda *args: None))
    gpu = resolve_config(gpu_rt, "tp", 4, 2048, 2752, 4096, BF16, CUBLAS)
    assert (gpu["PRODUCER"], gpu["CHUNK_ROWS"], gpu["PUSH_ORDER"]) == ("ce", 2048, "serial")
    assert resolve_config(gpu_rt, "tp", 4, 2048, 2752, 4096, BF16,
                          dict(CUBLAS, CHUNK_ROWS=512))["CHUNK_ROWS"] == 512
