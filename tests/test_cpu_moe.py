"""jaxtdist.moe_dispatch / moe_combine on CPU devices (Triton interpreter), against
a numpy reference of the layout and a pure-JAX (all_gather-based) reference of the
layer and its gradients."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxtdist as td
from jaxtdist.ops.moe import moe_combine_kernels, moe_dispatch_kernels
from tests.conftest import assert_close, cpu_only, place, rand, setup

pytestmark = cpu_only()

BF16, F32 = jnp.bfloat16, jnp.float32


# -- routings -------------------------------------------------------------------------

def routing(kind: str, world: int, t: int, k: int, e: int, rng) -> np.ndarray:
    """[world * T, K] int32 expert ids, distinct per token."""
    ids = np.stack([rng.permutation(e)[:k] for _ in range(world * t)]).astype(np.int32)
    e_loc = e // world
    if kind == "one_rank":  # every token to rank world - 1's experts (needs k <= e_loc)
        ids = np.stack([(world - 1) * e_loc + rng.permutation(e_loc)[:k]
                        for _ in range(world * t)]).astype(np.int32)
    elif kind == "empty_expert":  # expert 0 gets nothing
        ids = np.stack([1 + rng.permutation(e - 1)[:k] for _ in range(world * t)]).astype(np.int32)
    elif kind == "one_expert":  # every token to expert 1 (then others)
        ids[:, 0] = 1
        for row in ids:
            rest = [x for x in rng.permutation(e) if x != 1][:k - 1]
            row[1:] = rest
    return ids


# -- references -------------------------------------------------------------------

def ref_dispatch(x, ids, world, e, rows):
    """Per destination rank: recv_x [rows, H] (zero-padded, dropped past rows),
    group sizes, dropped count; and for every (source, t, k) its recv row or -1."""
    t = x.shape[0] // world
    e_loc = e // world
    xs = x.reshape(world, t, -1)
    idss = ids.reshape(world, t, -1)
    recvs, sizes, dropped = [], [], []
    where = -np.ones(idss.shape, np.int64)
    for d in range(world):
        out = []
        for j in range(e_loc):
            for s in range(world):
                for tt in range(t):
                    hit = np.nonzero(idss[s, tt] == d * e_loc + j)[0]
                    if len(hit):
                        if len(out) < rows:
                            where[s, tt, hit[0]] = len(out)
                        out.append((j, xs[s, tt]))
        kept = out[:rows]
        recv = np.zeros((rows, x.shape[1]), np.float64)
        for i, (_, row) in enumerate(kept):
            recv[i] = row
        recvs.append(recv)
        sizes.append(np.bincount([j for j, _ in kept], minlength=e_loc))
        dropped.append(len(out) - len(kept))
    return recvs, sizes, dropped, where


def _specs(world):
    return P("tp")


def _layer_fn(mesh, e, rows=None, config=None, zero_unused_rows=True):
    def body(x, ids, w, gate):
        recv, sizes, handle = td.moe_dispatch(x, ids, "tp", num_experts=e, max_recv_rows=rows,
                                              zero_unused_rows=zero_unused_rows, config=config)
        y = jax.lax.ragged_dot(recv, w[0], sizes)
        out = td.moe_combine(y, handle, gate, "tp", config=config)
        return recv, sizes[None], handle.dropped[None], out

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("tp"), P("tp"), P("tp"), P("tp")),
                                 out_specs=(P("tp"), P("tp"), P("tp"), P("tp"))))


def _run_case(world, t, h, f, k, e, dtype, kind="random", rows=None, calls=2, config=None,
              zero_unused_rows=True):
    mesh = setup(world)
    e_loc = e // world
    fn = _layer_fn(mesh, e, rows, config, zero_unused_rows)
    rng = np.random.default_rng(world * 1000 + t * 10 + k)
    r = rows or world * t * min(k, e_loc)
    for _ in range(calls):  # both parities, changing routings
        x = rand((world * t, h), dtype)
        ids = routing(kind, world, t, k, e, rng)
        w = rand((world, e_loc, h, f), dtype, scale=0.3)
        gate = rand((world * t, k), F32)
        recv, sizes, dropped, out = fn(place(mesh, x, P("tp")), place(mesh, ids, P("tp")),
                                       place(mesh, w, P("tp")), place(mesh, gate, P("tp")))
        recvs, rsizes, rdropped, where = ref_dispatch(np.asarray(x, np.float64), ids, world, e, r)
        recv = np.asarray(recv.astype(F32)).reshape(world, r, h)
        for d in range(world):
            # Without zeroing, only the received rows are defined.
            used = r if zero_unused_rows else int(np.sum(rsizes[d]))
            np.testing.assert_array_equal(recv[d, :used], recvs[d][:used].astype(np.float32))
        np.testing.assert_array_equal(np.asarray(sizes), np.stack(rsizes))
        np.testing.assert_array_equal(np.asarray(dropped), np.array(rdropped))
        # Layer reference: each kept (t, k) pair's expert output times its weight.
        wf = np.asarray(w.astype(F32), np.float64)
        xs = np.asarray(x, np.float64).reshape(world, t, h)
        gs = np.asarray(gate, np.float64).reshape(world, t, k)
        idss = ids.reshape(world, t, k)
        ref = np.zeros((world, t, f))
        for s in range(world):
            for tt in range(t):
                for kk in range(k):
                    if where[s, tt, kk] >= 0:
                        ex = idss[s, tt, kk]
                        ref[s, tt] += gs[s, tt, kk] * (xs[s, tt] @ wf[ex // e_loc, ex % e_loc])
        if np.linalg.norm(ref) > 0:
            assert_close(np.asarray(out.astype(F32)).reshape(world, t, f), ref, dtype, 2.0)
        else:
            assert np.all(np.asarray(out.astype(F32)) == 0)


# (world, T, H, F, K, E, dtype, routing): every world; T odd; K = 1, 2, 8; E / W = 1
# and several; skewed routings.
CASES = [(2, 5, 24, 16, 2, 4, F32, "random"),
         (2, 3, 16, 8, 1, 2, BF16, "random"),           # E / W = 1, K = 1
         (4, 3, 16, 8, 8, 16, BF16, "random"),          # K = 8
         (4, 4, 8, 8, 2, 8, F32, "one_rank"),
         (4, 3, 8, 8, 2, 8, F32, "one_expert"),
         (8, 2, 8, 8, 2, 8, F32, "empty_expert")]       # E / W = 1


@pytest.mark.parametrize("world,t,h,f,k,e,dtype,kind", CASES)
def test_moe_layer(world, t, h, f, k, e, dtype, kind):
    _run_case(world, t, h, f, k, e, dtype, kind)


@pytest.mark.parametrize("world,t,h,f,k,e,dtype,kind", [CASES[0], CASES[2], CASES[3]])
def test_moe_layer_without_zeroing_unused_rows(world, t, h, f, k, e, dtype, kind):
    """zero_unused_rows=False: the received rows, the sizes and ragged_dot + combine
    as with zeros (ragged_dot masks the rows past the groups), over both parities."""
    _run_case(world, t, h, f, k, e, dtype, kind, calls=3, zero_unused_rows=False)


@pytest.mark.parametrize("send", ["rows", "blocks"])
def test_moe_combine_send_ways(send):
    """The combine's two ways of weighing a token's rows on the experts' rank
    (config COMBINE_SEND), rows in several BLOCK_H steps, rows dropped past
    max_recv_rows (the other tests run the default, "rows", in one step)."""
    block_h, rows = 4, 7
    _run_case(4, 5, 16, 12, 4, 8, BF16, rows=rows,
              config=dict(COMBINE_SEND=send, BLOCK_H=block_h))


@pytest.mark.parametrize("rows_at_once", [1, 3, 4])
def test_moe_combine_loads_rows_at_once(rows_at_once):
    """The combine's forward loads COMBINE_ROWS of a token's valid pair rows at once
    (up to 4 pairs of a token per rank here, in one step or several, the last
    masked), rows dropped past max_recv_rows."""
    _run_case(2, 5, 16, 12, 4, 8, BF16, rows=14, config=dict(COMBINE_ROWS=rows_at_once))


@pytest.mark.parametrize("world,chunk,zero,rows", [(2, 1, True, None), (4, 2, False, None),
                                                   (4, 3, True, 9), (2, 2, True, 5),
                                                   (4, 0, True, None), (2, 0, True, 5)])
def test_moe_dispatch_in_chunks(world, chunk, zero, rows):
    """Dispatch programs that push, flag and lay out their tokens chunk by chunk
    (config CHUNK_TOKENS; 7 tokens per rank over 2 programs: up to 4 chunks, the
    last one short), rows dropped past max_recv_rows, zeroed and not, over three
    calls (both parities). One chunk (0): the decode sizes' path."""
    _run_case(world, 7, 16, 8, 2, 2 * world, F32, rows=rows, calls=3, zero_unused_rows=zero,
              config=dict(CHUNK_TOKENS=chunk))


@pytest.mark.parametrize("world,rows", [(2, 3), (4, 5)])
def test_moe_max_recv_rows_drops_and_counts(world, rows):
    """A recv_x smaller than needed: the rows past it are dropped (counted), the
    kept ones exact, the dropped pairs contribute zero."""
    _run_case(world, 4, 8, 8, 2, 2 * world, F32, "random", rows=rows)


@pytest.mark.parametrize("world,calls", [(2, 50), (4, 12)])
def test_moe_chained_calls_with_changing_routings(world, calls):
    """Reuse races: 50 (12 at world 4) dispatch + combine pairs in one jit (a fori_loop), each on the
    previous output and a changed routing (both inbox parities rewritten many times)."""
    t, h, k, e = 3, 8, 2, 2 * world
    mesh = setup(world)

    def chain(x, ids):
        def one(i, x):
            step_ids = (ids + i) % e  # distinct per token, changes every call
            recv, sizes, handle = td.moe_dispatch(x, step_ids, "tp", num_experts=e)
            return td.moe_combine(recv * 0.5 + 1.0, handle, jnp.full(ids.shape, 0.5), "tp")
        # A loop of one traced body: 50 calls at run time (epochs advance on the device).
        return jax.lax.fori_loop(0, calls, one, x)

    f = jax.jit(jax.shard_map(chain, mesh=mesh, in_specs=(P("tp"), P("tp")), out_specs=P("tp")))
    x = rand((world * t, h))
    ids = routing("random", world, t, k, e, np.random.default_rng(5))
    out = f(place(mesh, x, P("tp")), place(mesh, ids, P("tp")))
    # Each call: x -> sum over K experts of 0.5 * (0.5 x + 1) = 0.5 x + 1 (K = 2).
    ref = np.asarray(x, np.float64)
    for _ in range(calls):
        ref = 0.5 * ref + 1.0
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-5)


def _ref_layer_global(x, ids, w, gate, e, world):
    """Pure JAX: all_gather-free dense reference of the layer on global arrays."""
    e_loc = e // world
    wf = w.reshape(e, *w.shape[2:])                   # [E, H, F]
    onehot = jax.nn.one_hot(ids, e, dtype=jnp.float32)   # [N, K, E]
    per = jnp.einsum("nh,ehf->nef", x.astype(jnp.float32), wf.astype(jnp.float32))
    del e_loc
    return jnp.einsum("nke,nef,nk->nf", onehot, per, gate.astype(jnp.float32))


@pytest.mark.parametrize("world,k,e,chunk", [(2, 2, 4, 0), (4, 2, 8, 0), (2, 2, 4, 1)])
def test_moe_gradients(world, k, e, chunk):
    """Gradients of x, the experts' weights and the gates against XLA's; chunk 1:
    the dispatch and the combines of both passes in chunks of one token."""
    t, h, f = 3, 8, 8
    mesh = setup(world)
    e_loc = e // world

    def loss_td(x, ids, w, gate, c):
        def body(x, ids, w, gate, c):
            recv, sizes, handle = td.moe_dispatch(x, ids, "tp", num_experts=e,
                                                  config=dict(CHUNK_TOKENS=chunk))
            assert handle.src_ranges.shape[2] == (3 if chunk else 2)  # chunks + 1
            y = jax.lax.ragged_dot(recv, w[0], sizes)
            out = td.moe_combine(y, handle, gate, "tp")
            return jax.lax.psum(jnp.sum(out * c), "tp")
        return jax.shard_map(body, mesh=mesh, in_specs=(P("tp"),) * 5, out_specs=P())(
            x, ids, w, gate, c)

    def loss_ref(x, ids, w, gate, c):
        return jnp.sum(_ref_layer_global(x, ids, w, gate, e, world) * c)

    x = rand((world * t, h))
    ids = routing("random", world, t, k, e, np.random.default_rng(9))
    w = rand((world, e_loc, h, f), scale=0.3)
    gate = rand((world * t, k))
    c = rand((world * t, f))
    args = [place(mesh, a, P("tp")) for a in (x, ids, w, gate, c)]
    got = jax.jit(jax.grad(loss_td, argnums=(0, 2, 3)))(*args)
    want = jax.grad(loss_ref, argnums=(0, 2, 3))(*(jnp.asarray(a) for a in (x, ids, w, gate, c)))
    for g, r in zip(got, want):
        assert_close(np.asarray(g), np.asarray(r, np.float64), F32, 10.0)


def test_moe_world_1_is_local_and_kernels_agree():
    """At world 1 the ops are pure JAX; the kernels forced there give the same."""
    mesh = setup((1, 8), ("tp", "dp"))
    t, h, k, e = 5, 16, 2, 4
    x = rand((8 * t, h))
    ids = routing("random", 8, t, k, e, np.random.default_rng(3))
    gate = rand((8 * t, k))

    def local(x, ids, gate):
        recv, sizes, handle = td.moe_dispatch(x, ids, "tp", num_experts=e)
        return recv, td.moe_combine(recv * 2.0, handle, gate, "tp")

    def kernels(x, ids, gate):
        recv, sizes, handle = moe_dispatch_kernels(x, ids, "tp", num_experts=e)
        return recv, moe_combine_kernels(recv * 2.0, handle, gate, "tp")

    outs = []
    for body in (local, kernels):
        # The kernels' outputs are typed varying over the group's axis ("tp").
        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("dp"),) * 3,
                                  out_specs=(P("dp"), P("dp")), check_vma=False))
        outs.append([np.asarray(o) for o in f(*(place(mesh, a, P("dp"))
                                                for a in (x, ids, gate)))])
    np.testing.assert_array_equal(outs[0][0], outs[1][0])
    np.testing.assert_allclose(outs[0][1], outs[1][1], rtol=1e-6)
    ref = 2.0 * np.asarray(x) * np.asarray(gate).sum(1, keepdims=True)
    # float32 sums of K terms: elements where the weights nearly cancel are off by
    # rounding of the terms (|x|, not |out|), hence the atol.
    np.testing.assert_allclose(outs[0][1], ref, rtol=1e-5, atol=1e-6)


def test_moe_kernels_trace_their_phases():
    """trace=True: the same outputs, plus per-program timestamps whose phases run in
    order (the probes' view of where the kernels' time goes)."""
    world, t, h, k, e = 2, 5, 16, 2, 4
    mesh = setup(world)
    x = rand((world * t, h))
    ids = routing("random", world, t, k, e, np.random.default_rng(5))
    gate = rand((world * t, k))

    def body(x, ids, gate):
        recv, sizes, handle = moe_dispatch_kernels(x, ids, "tp", num_experts=e)
        recv_t, _, handle_t, d_stamps = moe_dispatch_kernels(x, ids, "tp", num_experts=e,
                                                             trace=True)
        out = moe_combine_kernels(recv, handle, gate, "tp")
        out_t, c_stamps = moe_combine_kernels(recv_t, handle_t, gate, "tp", trace=True)
        return recv, recv_t, out, out_t, d_stamps[None], c_stamps[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("tp"),) * 3,
                              out_specs=(P("tp"),) * 6, check_vma=False))
    recv, recv_t, out, out_t, d_stamps, c_stamps = (
        np.asarray(a) for a in f(*(place(mesh, a, P("tp")) for a in (x, ids, gate))))
    np.testing.assert_array_equal(recv, recv_t)
    np.testing.assert_array_equal(out, out_t)
    assert d_stamps.shape == (world, 2, 6) and c_stamps.shape == (world, 2, 6)
    for stamps, phases in ((d_stamps, 6), (c_stamps, 4)):
        steps = np.diff(stamps[..., :phases].astype(np.int64), axis=-1) % (1 << 32)
        assert (steps < 1 << 31).all(), stamps  # non-decreasing modulo 2**32


def test_moe_invalid_expert_ids_are_not_sent():
    """Ids outside [0, E) and repeats within a token: not sent, counted, zero in
    combine; nothing else changes (no memory written out of place)."""
    world, t, h, e = 2, 4, 8, 4  # top-2: the ids below
    mesh = setup(world)

    def body(x, ids):
        recv, sizes, handle = td.moe_dispatch(x, ids, "tp", num_experts=e)
        out = td.moe_combine(recv, handle, jnp.ones(ids.shape), "tp")
        return out, handle.invalid[None], sizes[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("tp"), P("tp")),
                              out_specs=(P("tp"), P("tp"), P("tp"))))
    x = rand((world * t, h))
    ids = np.array([[0, 1], [-3, 2], [9, 3], [1, 1], [2, 0], [3, 100], [0, 0], [1, 2]],
                   np.int32)
    out, invalid, sizes = f(place(mesh, x, P("tp")), place(mesh, ids, P("tp")))
    valid = np.array([[1, 1], [0, 1], [0, 1], [1, 0], [1, 1], [1, 0], [1, 0], [1, 1]])
    np.testing.assert_allclose(np.asarray(out), np.asarray(x) * valid.sum(1, keepdims=True),
                               rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(invalid), [3, 2])
    assert int(np.asarray(sizes).sum()) == valid.sum()


def test_moe_errors():
    mesh = setup(2)
    x = place(mesh, rand((8, 4)), P("tp"))
    ids = place(mesh, np.zeros((8, 2), np.int32), P("tp"))

    def call(x, ids, **kw):
        return jax.jit(jax.shard_map(
            lambda x, ids: td.moe_dispatch(x, ids, "tp", **kw)[0], mesh=mesh,
            in_specs=(P("tp"), P("tp")), out_specs=P("tp")))(x, ids)

    with pytest.raises(ValueError, match="num_experts=3 must be a positive multiple"):
        call(x, ids, num_experts=3)
    with pytest.raises(ValueError, match="must be int32"):
        call(x, place(mesh, np.zeros((8, 2), np.float32), P("tp")), num_experts=4)
    with pytest.raises(ValueError, match="expert_ids must be"):
        call(x, place(mesh, np.zeros((6, 2), np.int32), P("tp")), num_experts=4)
    with pytest.raises(ValueError, match="top_k=2 .* exceeds num_experts=1"):
        jax.jit(jax.shard_map(lambda x, ids: td.moe_dispatch(x, ids, ("tp",), num_experts=1)[0],
                              mesh=setup((1, 8), ("tp", "dp")), in_specs=(P("dp"), P("dp")),
                              out_specs=P("dp")))(
            place(setup((1, 8), ("tp", "dp")), rand((8, 4)), P("dp")),
            place(setup((1, 8), ("tp", "dp")), np.zeros((8, 2), np.int32), P("dp")))
    mesh = setup(2)
    with pytest.raises(ValueError, match="max_recv_rows=0"):
        call(x, ids, num_experts=4, max_recv_rows=0)
    with pytest.raises(ValueError, match="zero_unused_rows='no' must be True or False"):
        call(x, ids, num_experts=4, zero_unused_rows="no")
    # NumPy's bool counts as a bool (a config's value).
    assert call(x, ids, num_experts=4, zero_unused_rows=np.bool_(True)).shape == (2 * 16, 4)
    with pytest.raises(ValueError, match="COMBINE_SEND='row'; allowed: 'rows', 'blocks'"):
        call(x, ids, num_experts=4, config=dict(COMBINE_SEND="row"))
    with pytest.raises(ValueError, match="CHUNK_TOKENS=-1 must be an int >= 0"):
        call(x, ids, num_experts=4, config=dict(CHUNK_TOKENS=-1))
    with pytest.raises(ValueError, match=r"COMBINE_ROWS=9 must be an int in \[1, 8\]"):
        call(x, ids, num_experts=4, config=dict(COMBINE_ROWS=9))
    with pytest.raises(ValueError, match="y must be"):
        jax.jit(jax.shard_map(
            lambda x, ids: td.moe_combine(x, td.moe_dispatch(x, ids, "tp", num_experts=4)[2],
                                          jnp.ones(ids.shape), "tp"),
            mesh=mesh, in_specs=(P("tp"), P("tp")), out_specs=P("tp")))(x, ids)
    with pytest.raises(ValueError, match="handle must be the MoeHandle"):
        jax.jit(jax.shard_map(lambda x: td.moe_combine(x, "nope", jnp.ones((4, 2)), "tp"),
                              mesh=mesh, in_specs=P("tp"), out_specs=P("tp")))(x)
    with pytest.raises(ValueError, match="weights must be"):
        jax.jit(jax.shard_map(
            lambda x, ids: td.moe_combine(*td.moe_dispatch(x, ids, "tp", num_experts=4)[::2],
                                          jnp.ones((3, 2)), "tp"),
            mesh=mesh, in_specs=(P("tp"), P("tp")), out_specs=P("tp")))(x, ids)


def test_moe_over_a_submesh():
    """dp x tp mesh, experts over "tp": each dp group exchanges among its own ranks."""
    mesh = setup((2, 2), ("dp", "tp"))
    t, h, k, e = 3, 8, 2, 4
    x = rand((4 * t, h))
    ids = routing("random", 4, t, k, e, np.random.default_rng(11))
    gate = rand((4 * t, k))
    spec = P(("dp", "tp"))

    def body(x, ids, gate):
        recv, sizes, handle = td.moe_dispatch(x, ids, "tp", num_experts=e)
        return recv, td.moe_combine(recv * 3.0, handle, gate, "tp")

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 3, out_specs=(spec, spec)))
    recv, out = f(*(place(mesh, a, spec) for a in (x, ids, gate)))
    for g in range(2):  # each dp group on its own
        rows = 2 * t * min(k, e // 2)
        xs, idg = np.asarray(x)[g * 2 * t:(g + 1) * 2 * t], ids[g * 2 * t:(g + 1) * 2 * t]
        want, _, _, _ = ref_dispatch(np.asarray(xs, np.float64), idg, 2, e, rows)
        got = np.asarray(recv).reshape(2, 2, rows, h)[g]
        for d in range(2):
            np.testing.assert_array_equal(got[d], want[d].astype(np.float32))
    ref = 3.0 * np.asarray(x) * np.asarray(gate).sum(1, keepdims=True)
    # atol: where two weights nearly cancel, float32 rounding of the sum is
    # relatively large (seen: 5.7e-8 on 3.9e-3, with random data from earlier tests).
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-5, atol=1e-6)


def test_moe_bench_table():
    """The benchmark's table renders from result rows (the timing itself needs GPUs)."""
    from jaxtdist.bench import __main__ as cli
    from jaxtdist.bench import moe

    assert "moe" in cli.benchmarks()
    stats = dict(mean_us=10.0, min_us=9.0)
    row = dict(tokens=128, hidden=7168, top_k=8, experts=256, reference_dispatch=stats,
               kernels_dispatch=dict(stats, exact=True), reference_layer=stats,
               kernels_layer=dict(stats, rel_err=1e-3), ragged_dot=stats)
    text = moe.table(dict(device="H100", world=1, iterations=10, rounds=2, rows=[row]))
    assert "128 x 7168, top-8, 256" in text and "True" in text


ROUTINGS = ("xla", "fused")


@pytest.mark.parametrize("world,t,k,e,kind,programs,routings", [
    (1, 7, 2, 4, "random", 2, ROUTINGS),
    (2, 6, 3, 8, "random", 4, ROUTINGS),       # programs of 2 tokens
    (2, 5, 2, 4, "one_rank", 2, ROUTINGS),     # T not a multiple of the programs
    (4, 3, 2, 8, "one_expert", 3, ROUTINGS),
    (2, 9, 3, 4, "empty_expert", 2, ROUTINGS), # K > E / W: KL = E / W
    (2, 4, 2, 4, "invalid", 2, ROUTINGS),      # ids outside [0, E) and repeats
    # The fused routing scans 1024 / K tokens per step: here two steps, the second short.
    (2, 40, 32, 64, "random", 2, ROUTINGS),
])
def test_fused_routing_matches_the_xla_routing(world, t, k, e, kind, programs, routings):
    """config ROUTING="fused" (the words computed inside the dispatch kernel,
    kernels/moe_route.py) gives the dispatch every word the XLA routing gives it: the same recv_x, sizes and handle, bit for bit, with
    and without the combine backward's scale."""
    mesh = setup(world)
    rng = np.random.default_rng(world * 31 + t)
    x = rand((world * t, 16))
    ids = routing("random" if kind == "invalid" else kind, world, t, k, e, rng)
    if kind == "invalid":
        ids[0, 0], ids[1, 1], ids[2, 1] = e, -3, ids[2, 0]
    scale = rand((world * t, k))
    outs = []
    for routing_at in routings:
        cfg = dict(ROUTING=routing_at, NUM_PROGRAMS=programs)

        def body(x, ids, scale, cfg=cfg):
            recv, sizes, hd = moe_dispatch_kernels(x, ids, "tp", num_experts=e, config=cfg)
            scaled, _, _ = moe_dispatch_kernels(x, ids, "tp", num_experts=e, scale=scale,
                                                config=cfg)
            return (recv, scaled, sizes[None], hd.recv_counts[None], hd.src_pos, hd.src_tk,
                    hd.src_ranges[None], hd.dropped[None], hd.invalid[None])

        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("tp"),) * 3,
                                  out_specs=(P("tp"),) * 9, check_vma=False))
        outs.append([np.asarray(o) for o in f(*(place(mesh, a, P("tp"))
                                                for a in (x, ids, scale)))])
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            np.testing.assert_array_equal(a, b)
    if kind == "invalid":  # rank 0's tokens 0, 1, 2: out of range, negative, a repeat
        assert all(out[-1].tolist() == [3, 0] for out in outs)


@pytest.mark.parametrize("tokens,routing_at", [(1, "fused"), (128, "fused"), (256, "fused"),
                                                (257, "xla"), (4096, "xla")])
def test_gpu_default_routing_follows_the_token_count(tokens, routing_at):
    """On GPUs the dispatch computes its routing words inside its kernel while few
    tokens make the scan short, with XLA above (both give the same words:
    test_fused_routing_matches_the_xla_routing); the interpreter's default is the
    XLA routing."""
    from jaxtdist.ops._config import Problem
    from jaxtdist.ops.moe import MoeConfig

    gpu = MoeConfig.default(Problem("gpu", 4, (tokens, 7168), "bfloat16", sms=132))
    assert gpu.ROUTING == routing_at
    assert gpu.NUM_PROGRAMS == min(132, tokens)
    # Chunked pushes where a program has more than 4 tokens (bulk), about 8 chunks of
    # at least 2 tokens; else one chunk.
    assert gpu.CHUNK_TOKENS == {1: 0, 128: 0, 256: 0, 257: 0, 4096: 4}[tokens]
    assert MoeConfig.default(Problem("gpu", 4, (1024, 7168), "bfloat16", sms=132)).CHUNK_TOKENS == 2
    assert MoeConfig.default(Problem("cpu", 4, (tokens, 7168), "bfloat16")).ROUTING == "xla"


def test_routing_by_two_kernels_is_refused():
    """ROUTING="kernels" (two routing launches before the dispatch, removed: they won
    at no size) is refused naming the routings there are."""
    from jaxtdist.ops._config import Problem
    from jaxtdist.ops.moe import MoeConfig

    with pytest.raises(ValueError, match=r"ROUTING='kernels'; allowed: 'xla', 'fused'"):
        MoeConfig(ROUTING="kernels").validate(Problem("gpu", 4, (128, 7168), "bfloat16",
                                                      sms=132))
