"""moe_dispatch / moe_combine on GPUs: world 1 (the local computation, and the
kernels themselves), and 2 and 4 GPUs where that many are visible; skipped without
GPUs. Run with ``JAXTDIST_TEST_GPU=1`` (tests/gpu/run.sh does)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxtdist as td
from jaxtdist.ops.moe import moe_combine_kernels, moe_dispatch_kernels
from tests.conftest import gpu_mesh

pytestmark = pytest.mark.skipif(
    jax.devices()[0].platform != "gpu", reason="needs CUDA GPUs (none visible)")

_seed = [0]


def _mesh(world):
    return gpu_mesh(world, "ep")


def _routing(kind, n, k, e, world, rng):
    ids = np.argsort(rng.random((n, e)), axis=1)[:, :k].astype(np.int32)
    e_loc = e // world
    if kind == "one_rank":  # every token to the last rank's experts
        ids = (world - 1) * e_loc + np.argsort(rng.random((n, e_loc)), axis=1)[:, :k]
    elif kind == "one_expert":  # every token to expert 0 first
        ids = 1 + np.argsort(rng.random((n, e - 1)), axis=1)[:, :k]
        ids[:, 0] = 0
    return ids.astype(np.int32)


def _reference(x, ids, gate, world, e, rows):
    """Per rank: recv_x [rows, H] (float64) and the layer's out with identity experts
    times 2 (y = 2 recv_x), dropped pairs contributing zero."""
    n, hdim = x.shape
    t = n // world
    e_loc = e // world
    recvs = np.zeros((world, rows, hdim))
    out = np.zeros((n, hdim))
    for d in range(world):
        r = 0
        for j in range(e_loc):
            for s in range(world):
                for tt in range(t):
                    g = s * t + tt
                    hit = np.nonzero(ids[g] == d * e_loc + j)[0]
                    if len(hit):
                        if r < rows:
                            recvs[d, r] = x[g]
                            out[g] += 2.0 * gate[g, hit[0]] * x[g]
                        r += 1
    return recvs, out


def _check(world, t, hdim, k, e, dtype, kind, rows=None, kernels=False, calls=3, config=None,
           zero_unused_rows=True):
    mesh = _mesh(world)
    op_d, op_c = ((moe_dispatch_kernels, moe_combine_kernels) if kernels
                  else (td.moe_dispatch, td.moe_combine))

    def body(x, ids, gate):
        recv, sizes, handle = op_d(x, ids, "ep", num_experts=e, max_recv_rows=rows,
                                   zero_unused_rows=zero_unused_rows, config=config)
        return recv, op_c(recv * 2.0, handle, gate, "ep", config=config), sizes[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("ep"),) * 3,
                              out_specs=(P("ep"),) * 3, check_vma=False))
    rng = np.random.default_rng(world * 100 + t)
    r = rows or world * t * min(k, e // world)
    for _ in range(calls):  # both inbox parities, a fresh routing each time
        _seed[0] += 1
        x = jax.random.normal(jax.random.key(_seed[0]), (world * t, hdim), jnp.float32)
        x = x.astype(dtype)
        ids = _routing(kind, world * t, k, e, world, rng)
        gate = rng.random((world * t, k)).astype(np.float32)
        put = lambda a: jax.device_put(jnp.asarray(a), NamedSharding(mesh, P("ep")))  # noqa: E731
        recv, out, sizes = f(put(x), put(ids), put(gate))
        xs = np.asarray(x.astype(jnp.float32), np.float64)
        want_recv, want_out = _reference(xs, ids, gate, world, e, r)
        recv = np.asarray(recv.astype(jnp.float32)).reshape(world, r, -1)
        for d in range(world):  # without zeroing only the received rows are defined
            used = r if zero_unused_rows else int(np.asarray(sizes)[d].sum())
            np.testing.assert_array_equal(recv[d, :used], want_recv[d, :used].astype(np.float32))
        out = np.asarray(out.astype(jnp.float32), np.float64)
        assert np.all(np.isfinite(out)), "non-finite output (unwritten or corrupted)"
        err = np.linalg.norm(out - want_out) / max(np.linalg.norm(want_out), 1e-30)
        assert err < (2e-2 if dtype == jnp.bfloat16 else 1e-5), (world, t, kind, err)


# (T per rank, H, K, E, routing): decode-like, odd T, K = 1, skewed routings.
CASES = [(128, 7168, 8, 32, "random"), (37, 512, 2, 8, "random"), (64, 256, 1, 4, "random"),
         (50, 1024, 2, 8, "one_rank"), (33, 768, 4, 16, "one_expert")]


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("t,hdim,k,e,kind", CASES)
def test_moe(world, dtype, t, hdim, k, e, kind):
    if e % world or k > e // world and kind == "one_rank":
        pytest.skip("routing needs more experts per rank")
    _check(world, t, hdim, k, e, dtype, kind)
    if world == 1:  # the kernels themselves at world 1
        _check(world, t, hdim, k, e, dtype, kind, kernels=True)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("send", ["rows", "blocks"])
def test_moe_combine_send_ways(world, send):
    """The combine's two ways of weighing a token's rows (config COMBINE_SEND), at
    DeepSeek-V3's row and in two steps of a row, with rows dropped."""
    _check(world, 64, 7168, 8, 32, jnp.bfloat16, "random", rows=300,
           config=dict(COMBINE_SEND=send, BLOCK_H=4096))


@pytest.mark.parametrize("world", [1, 2, 4])
def test_moe_without_zeroing_unused_rows(world):
    """zero_unused_rows=False: the received rows and the combine as with zeros, at
    DeepSeek-V3's decode row and a skewed small case (the kernels at world 1)."""
    _check(world, 128, 7168, 8, 32, jnp.bfloat16, "random", zero_unused_rows=False,
           kernels=world == 1)
    _check(world, 33, 768, 4, 16, jnp.float32, "one_expert", zero_unused_rows=False)


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("chunk,zero", [(1, True), (3, False), (3, True)])
def test_moe_chunked_dispatch(world, chunk, zero):
    """Dispatch programs pushing, flagging and laying out their tokens chunk by chunk
    (config CHUNK_TOKENS; 25 tokens per program: 25 or 9 chunks, the last one
    short), rows dropped past max_recv_rows, zeroing the unused rows and not;
    then the bulk default (1000 tokens per rank: chunks of 4 tokens)."""
    cfg = dict(NUM_PROGRAMS=8, CHUNK_TOKENS=chunk)
    _check(world, 200, 1024, 4, 16, jnp.bfloat16, "random", rows=world * 200 * 2,
           config=cfg, zero_unused_rows=zero, kernels=world == 1)
    _check(world, 200, 512, 2, 8, jnp.float32, "one_expert", config=cfg,
           zero_unused_rows=zero)
    if chunk == 1:
        _check(world, 1000, 2048, 8, 32, jnp.bfloat16, "random", calls=2, kernels=world == 1)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_moe_drops_rows_past_max_recv_rows(world):
    _check(world, 40, 256, 4, 16, jnp.bfloat16, "one_expert", rows=30, kernels=world == 1)


@pytest.mark.parametrize("world", [2, 4])
def test_moe_chained_calls(world):
    """Reuse races: 50 dispatch + combine pairs in one jit on changing routings."""
    mesh = _mesh(world)
    t, hdim, k, e, calls = 16, 512, 4, 4 * world, 50

    def chain(x, ids):
        for i in range(calls):
            recv, _, handle = td.moe_dispatch(x, (ids + i) % e, "ep", num_experts=e)
            x = td.moe_combine(recv * 0.5 + 1.0, handle, jnp.full(ids.shape, 0.25), "ep")
        return x

    f = jax.jit(jax.shard_map(chain, mesh=mesh, in_specs=(P("ep"), P("ep")),
                              out_specs=P("ep"), check_vma=False))
    for seed in range(3):
        rng = np.random.default_rng(seed)
        x = rng.standard_normal((world * t, hdim)).astype(np.float32)
        ids = _routing("random", world * t, k, e, world, rng)
        out = f(jax.device_put(x, NamedSharding(mesh, P("ep"))),
                jax.device_put(ids, NamedSharding(mesh, P("ep"))))
        ref = x.astype(np.float64)
        for _ in range(calls):  # K * 0.25 * (0.5 x + 1) = 0.5 x + 1 (K = 4)
            ref = 0.5 * ref + 1.0
        np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-5)


@pytest.mark.parametrize("world", [2, 4])
def test_moe_gradients(world):
    mesh = _mesh(world)
    t, hdim, f_out, k, e = 24, 128, 64, 2, 2 * world
    rng = np.random.default_rng(7)
    x = rng.standard_normal((world * t, hdim)).astype(np.float32)
    ids = _routing("random", world * t, k, e, world, rng)
    w = (rng.standard_normal((e, hdim, f_out)) / np.sqrt(hdim)).astype(np.float32)
    gate = rng.random((world * t, k)).astype(np.float32)
    c = rng.standard_normal((world * t, f_out)).astype(np.float32)

    def loss_td(x, w, gate):
        def body(x, ids, w, gate, c):
            recv, sizes, handle = td.moe_dispatch(x, ids, "ep", num_experts=e)
            y = jax.lax.ragged_dot(recv, w, sizes, precision=jax.lax.Precision.HIGHEST)
            return jax.lax.psum(jnp.sum(td.moe_combine(y, handle, gate, "ep") * c), "ep")
        return jax.shard_map(body, mesh=mesh, in_specs=(P("ep"),) * 5, out_specs=P(),
                             check_vma=False)(x, put(ids), w, gate, put(c))

    def loss_ref(x, w, gate):
        onehot = jax.nn.one_hot(ids, e, dtype=jnp.float32)
        per = jnp.einsum("nh,ehf->nef", x, w,
                         precision=jax.lax.Precision.HIGHEST)
        return jnp.sum(jnp.einsum("nke,nef,nk->nf", onehot, per, gate) * c)

    def put(a):
        return jax.device_put(jnp.asarray(a), NamedSharding(mesh, P("ep")))

    # w [E, H, F] sharded over the experts: rank r holds its E / W local experts.
    got = jax.jit(jax.grad(loss_td, argnums=(0, 1, 2)))(put(x), put(w), put(gate))
    want = jax.grad(loss_ref, argnums=(0, 1, 2))(jnp.asarray(x), jnp.asarray(w),
                                                 jnp.asarray(gate))
    for g, r in zip(got, want):
        g, r = np.asarray(g, np.float64).reshape(-1), np.asarray(r, np.float64).reshape(-1)
        assert np.linalg.norm(g - r) / np.linalg.norm(r) < 1e-4


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_moe_fp8_dispatch(world, dtype):
    """fp8 dispatch with per-token scales (DeepSeek-V3's decode size): the rows and
    scales land where a dispatch of the dequantized float32 tokens puts them, bit
    for bit, and the combine of the dequantized rows matches too."""
    from jaxtdist.bench.moe import fp8_dequantize, fp8_tokens

    mesh = _mesh(world)
    t, hdim, k, e, scales = 128, 7168, 8, 32, 56
    rng = np.random.default_rng(world + len(dtype))
    q, scale = fp8_tokens(rng.standard_normal((world * t, hdim)).astype(np.float32), scales,
                          jnp.dtype(dtype))
    ids = _routing("random", world * t, k, e, world, rng)
    gate = rng.random((world * t, k)).astype(np.float32)

    def layer(q, scale, ids, gate):
        (rx, rs), sizes, handle = td.moe_dispatch(q, ids, "ep", num_experts=e, x_scale=scale)
        deq = fp8_dequantize(rx, rs)
        ref, ref_sizes, ref_handle = td.moe_dispatch(fp8_dequantize(q, scale), ids, "ep",
                                                     num_experts=e)
        out = td.moe_combine(deq.astype(jnp.bfloat16), handle, gate, "ep")
        ref_out = td.moe_combine(ref.astype(jnp.bfloat16), ref_handle, gate, "ep")
        return deq, ref, sizes, ref_sizes, out, ref_out

    ep = P("ep")
    f = jax.jit(jax.shard_map(layer, mesh=mesh, in_specs=(ep,) * 4, out_specs=(ep,) * 6,
                              check_vma=False))
    args = [jax.device_put(a, NamedSharding(mesh, ep)) for a in (q, scale, ids, gate)]
    for _ in range(2):  # a second call reuses the inboxes of the other parity
        deq, ref, sizes, ref_sizes, out, ref_out = (np.asarray(a, np.float32) for a in f(*args))
        np.testing.assert_array_equal(deq, ref)
        np.testing.assert_array_equal(sizes, ref_sizes)
        np.testing.assert_array_equal(out, ref_out)
        assert np.linalg.norm(out) > 0


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("t", [128, 1000])
def test_moe_fused_routing_matches_xla_routing(world, t):
    """config ROUTING="fused" (the routing metadata computed inside the dispatch
    kernel) gives the same recv_x, sizes and combine output as the XLA routing,
    bit for bit, over two calls (DeepSeek-V3's routing: top-8 of 256 experts; 128
    tokens per rank, one step of the fused routing's scan over the ids, and 1000,
    eight steps, the last one partial)."""
    mesh = _mesh(world)
    hdim, k, e = 1024, 8, 256
    rng = np.random.default_rng(40 + world)
    x = jnp.asarray(rng.standard_normal((world * t, hdim)), jnp.bfloat16)
    ids = _routing("random", world * t, k, e, world, rng)
    gate = rng.random((world * t, k)).astype(np.float32)
    ep = P("ep")
    outs = []
    for routing in ("xla", "fused"):
        cfg = dict(ROUTING=routing)

        def layer(x, ids, gate, cfg=cfg):
            recv, sizes, handle = moe_dispatch_kernels(x, ids, "ep", num_experts=e, config=cfg)
            return recv, sizes, moe_combine_kernels(recv, handle, gate, "ep")

        f = jax.jit(jax.shard_map(layer, mesh=mesh, in_specs=(ep,) * 3, out_specs=(ep,) * 3,
                                  check_vma=False))
        args = [jax.device_put(a, NamedSharding(mesh, ep)) for a in (x, ids, gate)]
        f(*args)  # a first call, then the one compared (the other inbox parity)
        outs.append([np.asarray(o, np.float32) for o in f(*args)])
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            np.testing.assert_array_equal(a, b)
    assert np.linalg.norm(outs[1][2]) > 0
