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


@pytest.mark.parametrize("world", [1, 2])
def test_a_dropped_pairs_nan_weight_does_not_count(world):
    """A pair past max_recv_rows contributes zero to the combine, even with a NaN
    weight (it was weighed against its zero row: NaN)."""
    mesh = setup((world,), ("ep",))
    t, h = 2, 4
    x = np.asarray(rand((world * t, h)))
    ids = np.zeros((world * t, 1), np.int32)  # every token to expert 0
    g = np.ones((world * t, 1), np.float32)
    g[-1, 0] = np.nan  # the last token's pair arrives last: dropped

    def body(x, ids, g):
        recv, _, hd = td.moe_dispatch(x, ids, "ep", num_experts=2,
                                      max_recv_rows=world * t - 1)
        return td.moe_combine(recv, hd, g, "ep"), hd.dropped[None]

    out, dropped = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("ep"),) * 3,
                                         out_specs=(P("ep"), P("ep"))))(
        *(place(mesh, a, P("ep")) for a in (x, ids, g)))
    assert int(np.sum(np.asarray(dropped))) == 1
    np.testing.assert_array_equal(np.asarray(out)[-1], 0.0)
    np.testing.assert_allclose(np.asarray(out)[:-1], x[:-1], rtol=1e-6)


@pytest.mark.parametrize("overlap", [False, True])
def test_moe_tp_invalid_pairs_contribute_nothing_even_where_the_last_expert_overflows(overlap):
    """An invalid id's pair runs through the last expert with weight 0: where that
    expert overflows (float16 inf), the token's output stays its valid pairs' sum,
    on both schedules."""
    setup((2,), ("tp",))
    h, f = 32, 8
    x = np.full((4, h), 3.0, np.float16)
    w1 = np.asarray(rand((2, h, f), jnp.float32, 0.1)).astype(np.float16)
    w1[1] = 1000.0  # expert 1 overflows float16 on x
    w2 = np.asarray(rand((2, f, h), jnp.float32, 0.1)).astype(np.float16)
    ids = np.tile(np.array([[0, -1]], np.int32), (4, 1))
    g = np.ones((4, 2), np.float32)
    out = jax.jit(lambda *a: td.moe_tp_mlp_sharded(*a, axis_name="tp", overlap=overlap))(
        *(jnp.asarray(v) for v in (x, ids, g, w1, w2)))
    x64, w164, w264 = (np.asarray(a, np.float64) for a in (x, w1, w2))
    ref = np.asarray(jax.nn.silu(x64 @ w164[0]), np.float64) @ w264[0]  # the default activation
    out = np.asarray(out, np.float64)
    assert np.isfinite(out).all()
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 5e-3


def test_ids_and_group_sizes_past_int32_do_not_wrap():
    """Under jax_enable_x64, moe_tp_mlp's int64 ids outside [0, E) contribute nothing
    (2**32 + 1 was expert 1), and grouped_matmul's int64 sizes past R clip at R
    (2**32 + 2 was 2)."""
    with jax.enable_x64(True) if hasattr(jax, "enable_x64") else jax.experimental.enable_x64():
        setup((2,), ("tp",))
        h, f = 16, 8
        x = jnp.asarray(rand((4, h)))
        w1, w2 = jnp.asarray(rand((4, h, f), scale=0.3)), jnp.asarray(rand((4, f, h), scale=0.3))
        g = jnp.ones((4, 2), jnp.float32)
        layer = jax.jit(lambda i: td.moe_tp_mlp_sharded(x, i, g, w1, w2, axis_name="tp"))
        wide = layer(jnp.tile(jnp.array([[0, 2**32 + 1]], jnp.int64), (4, 1)))
        alone = layer(jnp.tile(jnp.array([[0, -1]], jnp.int64), (4, 1)))
        np.testing.assert_array_equal(np.asarray(wide), np.asarray(alone))

        setup((1,), ("ep",))
        xs, w = jnp.asarray(rand((5, 8))), jnp.asarray(rand((2, 8, 4)))
        gmm = jax.jit(jax.shard_map(td.grouped_matmul, mesh=jax.make_mesh(
            (1,), ("ep",), devices=jax.devices()[:1]), in_specs=(P(), P(), P()), out_specs=P()))
        clipped = np.asarray(gmm(xs, w, jnp.array([2**32 + 2, 3], jnp.int64)), np.float64)
        # Relative to the whole product: an element near cancellation is no measure.
        ref = np.asarray(xs, np.float64) @ np.asarray(w[0], np.float64)
        assert np.linalg.norm(clipped - ref) / np.linalg.norm(ref) < 1e-6
