"""ag_attention's backward over several ranks with no XLA collective
(``kernels/ag_attention_bwd.py``) on CPU devices (Triton interpreter): the
compiled program's collectives, gradients against jax.grad of float32 attention
on the whole sequence, chained calls on changing data (reuse races), and the
XLA-collective path it replaces (config ``BACKWARD="xla"``, and where the
workspace does not fit the heap)."""

from __future__ import annotations

import importlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxtdist as td
from jaxtdist._errors import HeapExhaustedError
from jaxtdist.ops.ag_attention import attention
from tests.conftest import TOL, cpu_only, place, rand, setup

pytestmark = cpu_only()

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
SP = P(None, "sp")
# XLA's collectives as HLO (compiled) and StableHLO (lowered) name them.
COLLECTIVES = re.compile(r"all-gather|reduce-scatter|all-reduce|collective-permute|all-to-all"
                         r"|collective-broadcast|all_gather|reduce_scatter|all_reduce"
                         r"|collective_permute|all_to_all|collective_broadcast")


def _rel(out, ref) -> float:
    out = np.asarray(out, np.float64)
    assert np.all(np.isfinite(out)), "non-finite output"
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def _grad(mesh, causal, config=None):
    """jax.grad of sum(ag_attention(q, k, v) * c) for q, k and v, per rank."""
    return jax.jit(jax.shard_map(
        lambda q, k, v, c: jax.grad(lambda q, k, v: jnp.sum(
            td.ag_attention(q, k, v, "sp", causal=causal, config=config).astype(F32) * c),
            argnums=(0, 1, 2))(q, k, v),
        mesh=mesh, in_specs=(SP,) * 4, out_specs=(SP,) * 3))


def _operands(mesh, world, b, s, hq, hkv, d, dtype):
    host = (rand((b, world * s, hq, d), dtype), rand((b, world * s, hkv, d), dtype),
            rand((b, world * s, hkv, d), dtype), rand((b, world * s, hq, d)))
    return host, tuple(place(mesh, a, SP) for a in host)


def _check_grads(got, host, causal, dtype):
    """dq, dk, dv against jax.grad of float32 attention over the whole sequence."""
    q, k, v, c = host
    f32 = [np.asarray(a, np.float32) for a in (q, k, v)]
    expect = jax.grad(lambda q, k, v: jnp.sum(attention(q, k, v, causal=causal) * c),
                      argnums=(0, 1, 2))(*f32)
    for name, g, want in zip("qkv", got, expect):
        assert g.dtype == jnp.dtype(dtype), name
        assert _rel(g, np.asarray(want, np.float64)) < TOL[jnp.dtype(dtype)], f"d{name}"


def _collectives(mesh, config=None) -> tuple[set, set]:
    """XLA collectives in the lowered and the compiled program of the gradient."""
    (_, placed) = _operands(mesh, 2, 1, 16, 2, 1, 16, F32)
    lowered = _grad(mesh, True, config).lower(*placed)
    return (set(COLLECTIVES.findall(lowered.as_text())),
            set(COLLECTIVES.findall(lowered.compile().as_text())))


def test_backward_has_no_xla_collective():
    """At world 2 the gradient's program (forward and backward) holds no XLA
    collective, lowered or compiled: only jaxtdist's custom calls communicate.
    The XLA path (BACKWARD="xla") shows the check sees them."""
    mesh = setup(2, ("sp",))
    lowered, compiled = _collectives(mesh)
    assert not lowered and not compiled, (lowered, compiled)
    lowered, compiled = _collectives(mesh, dict(BACKWARD="xla"))
    assert {"all_gather", "reduce_scatter"} <= lowered, lowered
    assert {"all-gather", "reduce-scatter"} <= compiled, compiled


# (world, causal, B, S_shard, Hq, Hkv, D, dtype). test_cpu_ag_attention's
# GRAD_CASES run this backward too (the default): worlds 2, 4 (and 8 with
# JAXTDIST_TEST_SLOW=1), causal and
# not, GQA 1, 4 and 8, odd S_shard (partial key tiles in every chunk), every
# dtype. Here what they leave out: causal at world 4, with batches straddling
# the inbox's 16-row chunks.
CASES = [(4, True, 2, 7, 4, 1, 16, BF16)]


@pytest.mark.parametrize("world,causal,b,s,hq,hkv,d,dtype", CASES)
def test_overlapped_backward(world, causal, b, s, hq, hkv, d, dtype):
    mesh = setup(world, ("sp",))
    grad = _grad(mesh, causal, dict(BACKWARD="overlap"))
    host, placed = _operands(mesh, world, b, s, hq, hkv, d, dtype)
    _check_grads(grad(*placed), host, causal, dtype)


def test_overlapped_backward_chained():
    """Reuse races: three calls in one loss (causal, not, causal: the backward's
    workspace takes epochs e, e + 1, e + 2 in one step, its parities rewritten),
    each on the previous output, differentiated twice on fresh data, against
    jax.grad of the float32 composition."""
    world, b, s, hq, hkv, d = 4, 1, 5, 2, 1, 16
    mesh = setup(world, ("sp",))

    def loss(op, q, k, v, c):
        for i in range(3):
            q = op(q, k, v, causal=i % 2 == 0)
            k = k + q[:, :, :hkv] * 0.5
        return jnp.sum(q.astype(F32) * c)

    def ours(q, k, v, causal):
        return td.ag_attention(q, k, v, "sp", causal=causal, config=dict(BACKWARD="overlap"))

    grad = jax.jit(jax.shard_map(
        lambda q, k, v, c: jax.grad(lambda *a: loss(ours, *a, c), argnums=(0, 1, 2))(q, k, v),
        mesh=mesh, in_specs=(SP,) * 4, out_specs=(SP,) * 3))
    for _ in range(2):
        host, placed = _operands(mesh, world, b, s, hq, hkv, d, F32)
        got = grad(*placed)
        q, k, v, c = host
        expect = jax.grad(lambda *a: loss(attention, *a, c), argnums=(0, 1, 2))(q, k, v)
        for name, g, want in zip("qkv", got, expect):
            assert _rel(g, np.asarray(want, np.float64)) < 1e-5, f"d{name}"


def test_xla_backward_and_heap_fallback(monkeypatch):
    """The XLA-collective backward stays reachable (BACKWARD="xla") and agrees; where
    the overlapped backward's workspace does not fit the heap, "auto" warns and
    takes it, "overlap" raises."""
    world, causal = 2, True
    mesh = setup(world, ("sp",))
    host, placed = _operands(mesh, world, 1, 11, 2, 1, 16, F32)
    _check_grads(_grad(mesh, causal, dict(BACKWARD="xla"))(*placed), host, causal, F32)

    def exhausted(*args, **kwargs):
        raise HeapExhaustedError("jaxtdist: the symmetric heap is exhausted (test)")

    # (The module: jaxtdist.ops re-exports the op under the module's name.)
    module = importlib.import_module("jaxtdist.ops.ag_attention")
    monkeypatch.setattr(module, "_backward_workspace", exhausted)
    with pytest.warns(RuntimeWarning, match="overlapped backward's workspace does not fit"):
        got = _grad(mesh, causal)(*placed)
    _check_grads(got, host, causal, F32)
    with pytest.raises(HeapExhaustedError, match="exhausted"):
        _grad(mesh, causal, dict(BACKWARD="overlap"))(*placed)
