"""Misuse of jaxtdist.moe_dispatch / moe_combine that must fail clearly: a handle
combined over another group than its dispatch's (a wrong result, or an
interpreter worker killed by a segfault, before moe_combine checked it), and vmap with
grad of the pair (no batching rule for the backward's kernels before)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxtdist as td
from tests.conftest import cpu_only, place, rand, setup

pytestmark = cpu_only()

T, H, K, E = 3, 8, 2, 4
ROWS = P(("dp", "tp"))


def _inputs(mesh):
    rng = np.random.default_rng(11)
    ids = np.stack([rng.permutation(E)[:K] for _ in range(4 * T)]).astype(np.int32)
    x, gate = rand((4 * T, H)), rand((4 * T, K))
    return x, ids, gate, [place(mesh, a, ROWS) for a in (x, ids, gate)]


def _layer(mesh, dispatch_axis, combine_axis, strip=False):
    def body(x, ids, gate):
        recv, _, handle = td.moe_dispatch(x, ids, dispatch_axis, num_experts=E)
        if strip:  # a handle rebuilt without the dispatch's axis_name: its shapes still tell
            handle = dataclasses.replace(handle, axis_name=None)
        return td.moe_combine(recv * 2.0, handle, gate, combine_axis)

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(ROWS,) * 3, out_specs=ROWS))


@pytest.mark.parametrize("dispatch_axis,combine_axis,strip,match", [
    ("tp", "dp", False, r"axis_name='dp', but the handle comes from a moe_dispatch over "
                        r"\('tp',\)"),                           # same size: was a wrong result
    ("tp", ("dp", "tp"), False, "handle comes from a moe_dispatch over"),   # was a segfault
    (("dp", "tp"), "tp", False, "handle comes from a moe_dispatch over"),   # was a wrong result
    ("tp", ("dp", "tp"), True, r"made by a moe_dispatch over 2 ranks .* has W=4 ranks"),
    (("dp", "tp"), "tp", True, r"made by a moe_dispatch over 4 ranks .* has W=2 ranks"),
])
def test_combine_over_another_group_than_the_dispatch(dispatch_axis, combine_axis, strip,
                                                     match):
    mesh = setup((2, 2), ("dp", "tp"))
    _, _, _, args = _inputs(mesh)
    with pytest.raises(ValueError, match=match):
        _layer(mesh, dispatch_axis, combine_axis, strip)(*args)


@pytest.mark.parametrize("dispatch_axis,combine_axis", [("tp", ("tp",)),
                                                        (("dp", "tp"), ["dp", "tp"])])
def test_combine_accepts_the_same_group_spelled_otherwise(dispatch_axis, combine_axis):
    mesh = setup((2, 2), ("dp", "tp"))
    x, ids, gate, args = _inputs(mesh)
    out = np.asarray(_layer(mesh, dispatch_axis, combine_axis)(*args), np.float64)
    ref = 2.0 * np.asarray(x, np.float64) * np.asarray(gate, np.float64).sum(1, keepdims=True)
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 1e-5


@pytest.mark.parametrize("order", ["vmap_of_grad", "grad_of_vmap"])
def test_vmap_and_grad(order):
    """vmap and grad of dispatch + combine in either order: the backward's kernels run
    once per batch element (they had no batching rule); against the same layer in
    pure JAX (identity experts: out[t] = x[t] * sum_k gate[t, k], ids distinct)."""
    mesh = setup(2)
    rng = np.random.default_rng(12)
    ids = np.stack([[rng.permutation(E)[:K] for _ in range(2 * T)] for _ in range(2)])
    x, gate = rand((2, 2 * T, H)), rand((2, 2 * T, K))

    def one(x, ids, gate):
        recv, _, handle = td.moe_dispatch(x, ids, "tp", num_experts=E)
        return jnp.sum(td.moe_combine(recv, handle, gate, "tp") ** 2)

    def reference(x, gate):
        return jnp.sum((x * gate.sum(-1, keepdims=True)) ** 2)

    if order == "vmap_of_grad":
        body = jax.vmap(jax.grad(one, argnums=(0, 2)))
    else:
        body = jax.grad(lambda x, ids, gate: jnp.sum(jax.vmap(one)(x, ids, gate)),
                        argnums=(0, 2))
    spec = P(None, "tp")
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 3, out_specs=(spec, spec)))
    dx, dgate = f(*(place(mesh, a, spec) for a in (x, ids.astype(np.int32), gate)))
    ref_dx, ref_dgate = jax.vmap(jax.grad(reference, argnums=(0, 1)))(
        jnp.asarray(x, jnp.float32), jnp.asarray(gate, jnp.float32))
    for out, ref in ((dx, ref_dx), (dgate, ref_dgate)):
        ref = np.asarray(ref)
        assert np.linalg.norm(np.asarray(out) - ref) / np.linalg.norm(ref) < 1e-5


@pytest.mark.parametrize("edit", ["no_chunks", "flat", "programs"])
def test_combine_rejects_an_altered_handle(edit):
    """A handle whose src_ranges is not the dispatch's [W, P, NCH + 1] (the combine
    sends and sums by those chunk bounds) fails with the shape it got, not an
    IndexError or reads past the array."""
    mesh = setup(2)
    x, gate = rand((2 * T, H)), rand((2 * T, K))
    rng = np.random.default_rng(13)
    ids = np.stack([rng.permutation(E)[:K] for _ in range(2 * T)]).astype(np.int32)

    def body(x, ids, gate):
        recv, _, handle = td.moe_dispatch(x, ids, "tp", num_experts=E)
        ranges = handle.src_ranges
        ranges = {"no_chunks": ranges[:, :, :1], "flat": ranges.reshape(ranges.shape[0], -1),
                  "programs": jnp.concatenate([ranges, ranges], axis=1)}[edit]
        return td.moe_combine(recv, dataclasses.replace(handle, src_ranges=ranges), gate, "tp")

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("tp"),) * 3, out_specs=P("tp")))
    with pytest.raises(ValueError, match=r"src_ranges must be \[W, P, NCH \+ 1\]"):
        f(*(place(mesh, a, P("tp")) for a in (x, ids, gate)))
