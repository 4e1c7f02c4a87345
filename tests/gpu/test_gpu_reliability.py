"""GPU: transformations through the op mechanism and a soak of chained kernel calls.

Skipped unless GPUs are visible (``JAXTDIST_TEST_GPU=1``, tests/gpu/run.sh). On one
GPU the built-in ops are their local computation, so these tests drive the kernels
themselves: ``triton_call`` and ``ag_matmul_with_gathered``.
"""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxtdist as td
import tests.kernels_for_tests as K

pytestmark = pytest.mark.skipif(
    jax.devices()[0].platform != "gpu", reason="needs CUDA GPUs (none visible)")


def _mesh():
    n = min(4, len(jax.devices()))
    mesh = jax.make_mesh((n,), ("tp",), devices=jax.devices()[:n],
                         axis_types=(jax.sharding.AxisType.Auto,))
    td.initialize(mesh)
    return mesh, n


def test_vmap_and_checkpoint_of_a_user_kernel():
    """vmap gives each batch element its own call (epoch); jax.checkpoint holds the
    effect-free calls."""
    mesh, world = _mesh()
    n = 1024

    def ring(v):
        return td.triton_call(v, kernel=K.ring_kernel, grid=(1,), axis_name="tp",
                              out_shape=jax.ShapeDtypeStruct((n,), jnp.float32),
                              workspace_bytes=256 + 8 * n, N=n, BLOCK=256)

    f = jax.jit(jax.shard_map(jax.checkpoint(jax.vmap(ring, in_axes=1, out_axes=1)),
                              mesh=mesh, in_specs=P("tp"), out_specs=P("tp")))
    for _ in range(3):
        v = np.random.default_rng().standard_normal((world * n, 5)).astype(np.float32)
        out = np.asarray(f(jax.device_put(v, NamedSharding(mesh, P("tp")))))
        np.testing.assert_array_equal(
            out, np.roll(v.reshape(world, n, 5), 1, axis=0).reshape(world * n, 5))


def test_soak_1000_chained_kernel_calls():
    """1,000 chained ag_matmul kernel calls (a scan: each call's input is the last
    one's output), data changing every call, shapes changing between runs: 0
    mismatches against float32 products of each call's own input."""
    from jaxtdist.ops.ag_matmul import ag_matmul_with_gathered

    mesh, world = _mesh()
    calls = mismatches = 0
    for m, k in [(128, 256), (256, 512), (128, 256), (384, 128)] * 2 + [(256, 256)] * 2:
        steps = 100
        n = k // world

        def chain(a, b):
            def step(carry, _):
                y = ag_matmul_with_gathered(carry, b, "tp", gathered=False)[0]       # [world m, n]
                nxt = jnp.tanh(carry + y[:m, :1].astype(carry.dtype))
                return nxt, (carry, y)
            return jax.lax.scan(step, a, None, length=steps)[1]

        f = jax.jit(jax.shard_map(chain, mesh=mesh, in_specs=(P("tp", None), P(None, "tp")),
                                  out_specs=(P(None, "tp", None), P(None, None, "tp")),
                                  check_vma=False))
        rng = np.random.default_rng()
        x = rng.standard_normal((world * m, k)).astype(np.float32)
        w = (rng.standard_normal((k, world * n)) / np.sqrt(k)).astype(np.float32)
        carries, ys = f(jax.device_put(jnp.asarray(x, jnp.bfloat16),
                                       NamedSharding(mesh, P("tp", None))),
                        jax.device_put(jnp.asarray(w, jnp.bfloat16),
                                       NamedSharding(mesh, P(None, "tp"))))
        carries = np.asarray(carries, np.float32)
        ys = np.asarray(ys, np.float32)
        wf = np.asarray(jnp.asarray(w, jnp.bfloat16), np.float32)
        for t in range(steps):
            ref = carries[t] @ wf
            err = np.linalg.norm(ys[t] - ref) / np.linalg.norm(ref)
            mismatches += int(not err < 2e-2)
            calls += 1
    assert calls == 1000 and mismatches == 0, (calls, mismatches)


@pytest.mark.parametrize("calls", [10, 30])
def test_chained_calls_in_one_jit(calls):
    """Several calls of one op inside one jitted function (independent inputs, program
    order only): every call exact. (On the CPU backend at world >= 4 this is the open
    defect of docs/errors.md.)"""
    from jaxtdist.ops.ag_matmul import ag_matmul_with_gathered

    mesh, world = _mesh()
    m, k, n = 256, 512, 256

    def chain(x, w):
        return jnp.stack([ag_matmul_with_gathered(x * (1.0 + i), w, "tp")[0]
                          for i in range(calls)])

    f = jax.jit(jax.shard_map(chain, mesh=mesh, in_specs=(P("tp", None), P(None, "tp")),
                              out_specs=P(None, None, "tp"), check_vma=False))
    rng = np.random.default_rng()
    for _ in range(3):
        x = rng.standard_normal((world * m, k)).astype(np.float32) / np.sqrt(k)
        w = rng.standard_normal((k, world * n)).astype(np.float32)
        xb, wb = jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16)
        out = np.asarray(f(jax.device_put(xb, NamedSharding(mesh, P("tp", None))),
                           jax.device_put(wb, NamedSharding(mesh, P(None, "tp")))), np.float32)
        base = np.asarray(xb, np.float32) @ np.asarray(wb, np.float32)
        for i in range(calls):
            ref = (1.0 + i) * base
            assert np.linalg.norm(out[i] - ref) / np.linalg.norm(ref) < 2e-2, i


def _check_call_contexts(path: str) -> None:
    """Runs 20 calls in one program twice: epochs rise by one on every device, and
    each call writes its context by `path` ("kernel": the writer, "copy": the
    template copy and epoch memset), never the other."""
    from jaxtdist.runtime import _native

    mesh, world = _mesh()
    calls = 20
    other = {"kernel": "copy", "copy": "kernel"}[path]

    def body():
        outs = [td.triton_call(kernel=K.ids_kernel, out_shape=jax.ShapeDtypeStruct((3,), jnp.int32),
                               grid=(1,), axis_name="tp", name="ctx_writer_test")
                for _ in range(calls)]
        return jnp.stack(outs)[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(), out_specs=P("tp")))
    lib = _native.native()
    for run in range(2):
        before = lib.context_write_stats()
        ids = np.asarray(f())  # [world, calls, 3]: rank, world, epoch
        after = lib.context_write_stats()
        assert after[path] - before[path] == world * calls, (before, after)
        assert after[other] == before[other], (before, after)
        for rank in range(world):
            np.testing.assert_array_equal(ids[rank, :, 0], rank)
            np.testing.assert_array_equal(ids[rank, :, 1], world)
            first = ids[rank, 0, 2]
            np.testing.assert_array_equal(ids[rank, :, 2], first + np.arange(calls))
            assert first == 1 + run * calls, ids[rank, :, 2]


def test_every_call_writes_its_context_with_the_writer_kernel():
    """The CUDA prologue writes each call's context (rank, world and a fresh epoch)
    with its one-kernel writer (csrc/ctx_writer.h), never the template copy."""
    _check_call_contexts("kernel")


_NO_WRITER = """
import warnings
from jaxtdist.runtime import _native
from tests.gpu.test_gpu_reliability import _check_call_contexts

def refuse(ordinal):
    raise RuntimeError("refused by the test")

_native.native().preload_context_writer = refuse
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    _check_call_contexts("copy")
assert any("context writer did not load" in str(w.message) for w in caught), caught
print("fallback ok")
"""


def test_calls_copy_their_context_where_the_writer_does_not_load():
    """Where the writer cannot load, initialize warns and every prologue copies the
    template and sets the epoch instead, with the same contexts (a fresh process:
    the writer stays loaded in this one)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-c", _NO_WRITER], cwd=root, env=dict(os.environ),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert proc.returncode == 0 and "fallback ok" in proc.stdout, proc.stdout[-4000:]
