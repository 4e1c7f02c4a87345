"""GPU suite: jaxtdist ops on 1, 2 and 4 GPUs against float32 references.

Skipped unless GPUs are visible. Run with ``JAXTDIST_TEST_GPU=1``
(tests/gpu/run.sh does). Every check draws fresh random inputs, so an output
element a kernel failed to write (holding an earlier run's value) fails the
relative-error check.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxtdist as td

pytestmark = pytest.mark.skipif(
    jax.devices()[0].platform != "gpu", reason="needs CUDA GPUs (none visible)")

AUTO = jax.sharding.AxisType.Auto
TOL = {jnp.bfloat16: 2e-2, jnp.float16: 5e-3, jnp.float32: 5e-3}  # f32 dots run as tf32
_seed = [0]


def _rand(shape, dtype, scale=1.0):
    _seed[0] += 1
    x = np.random.default_rng(_seed[0]).standard_normal(shape, np.float32) * scale
    return jnp.asarray(x).astype(dtype)


def _rel(out, ref):
    out = np.asarray(out, np.float32)
    assert np.all(np.isfinite(out)), "non-finite output (unwritten or corrupted)"
    return np.linalg.norm(out - ref) / np.linalg.norm(ref)


def _mesh(n):
    if len(jax.devices()) < n:
        pytest.skip(f"needs {n} GPUs, have {len(jax.devices())}")
    return jax.make_mesh((n,), ("tp",), devices=jax.devices()[:n], axis_types=(AUTO,))


def _vector_fn(mesh, body):
    """jit(shard_map(body)) for a rank-sharded vector in and out."""
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("tp"), out_specs=P("tp")))


def _ring_shift(x, world, shift):
    return np.roll(np.asarray(x).reshape(world, -1), shift, axis=0).reshape(-1)


def _ag_matmul_fn(mesh, config=None):
    from jaxtdist.ops.ag_matmul import ag_matmul_with_gathered
    # The op on its kernels, also where its path rule would take XLA's (small shards).
    body = ((lambda x, w: td.ag_matmul(x, w, "tp", config=dict(PATH="fused")))
            if config is None else
            (lambda x, w: ag_matmul_with_gathered(x, w, "tp", config=config, gathered=False)[0]))
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("tp", None), P(None, "tp")),
                                 out_specs=P(None, "tp")))


def _check_ag_matmul(mesh, f, world, m_shard, k, n_shard, dtype, calls):
    """``calls`` calls of ``f`` with fresh inputs, each against a float32 reference."""
    for _ in range(calls):
        x = _rand((world * m_shard, k), dtype, 1 / np.sqrt(k))
        w = _rand((k, world * n_shard), dtype)
        # Inputs on the devices first: no device's launch waits for its transfer.
        out = f(*jax.block_until_ready((jax.device_put(x, NamedSharding(mesh, P("tp", None))),
                                        jax.device_put(w, NamedSharding(mesh, P(None, "tp"))))))
        ref = np.asarray(x, np.float32) @ np.asarray(w, np.float32)
        assert _rel(out, ref) < TOL[dtype]


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("m_shard,k,n_shard", [(256, 512, 384), (77, 200, 130), (1, 512, 256),
                                                (1024, 1024, 1024)])
def test_ag_matmul(world, dtype, m_shard, k, n_shard):
    mesh = _mesh(world)
    td.initialize(mesh)
    _check_ag_matmul(mesh, _ag_matmul_fn(mesh), world, m_shard, k, n_shard, dtype, calls=2)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("m_shard,config", [(1, None), (1024, None),
                                            (256, dict(TMA=True, PRODUCER="sm", NUM_COMM=8))])
def test_launches_are_aligned(world, m_shard, config):
    """The host threads of the group's devices meet before every collective launch
    (in the launch handler, the prologue or the copy-engine handler), on time: XLA
    runs them concurrently."""
    mesh = _mesh(world)
    rt = td.initialize(mesh)
    rt.align_launches = True  # also resets the statistics
    calls = 4
    _check_ag_matmul(mesh, _ag_matmul_fn(mesh, config), world, m_shard, 1024, 512,
                     jnp.bfloat16, calls=calls)
    stats = rt.launch_alignment_stats()
    assert stats["enabled"] and stats["timed_out"] == 0, stats
    assert stats["met"] >= world * calls, stats


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("m_shard,k,n_shard,config", [
    (1, 8192, 1024, dict(BLOCK_N=128, BLOCK_K=128, SPLIT_K=8)),       # decode, one row tile
    (16, 1000, 600, dict(BLOCK_N=64, BLOCK_K=64, SPLIT_K=4)),
    (128, 2048, 1024, dict(BLOCK_N=128, BLOCK_K=64, SPLIT_K=2, NUM_COMM=8, num_warps=4)),
    (100, 777, 300, dict(BLOCK_N=64, BLOCK_K=64, SPLIT_K=3, ALL_ROWS=False, BLOCK_M=64)),
])
def test_ag_matmul_split_k(world, dtype, m_shard, k, n_shard, config):
    """Split-K programs combine through heap partials and arrival counters."""
    mesh = _mesh(world)
    td.initialize(mesh)
    if dtype == jnp.float32:
        config = dict(config, BLOCK_K=min(config["BLOCK_K"], 64), num_stages=2)
    # Three calls: the arrival counters carry over between calls.
    _check_ag_matmul(mesh, _ag_matmul_fn(mesh, config), world, m_shard, k, n_shard, dtype,
                     calls=3)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("m_shard,k,n_shard,config", [
    (1, 8192, 1024, dict(ALL_ROWS=True)),                              # decode
    (16, 1000, 600, dict(ALL_ROWS=True, CHUNK_ROWS=4, NUM_COMM=8, SPLIT_K=4)),
    (100, 777, 300, dict(ALL_ROWS=False, BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, CHUNK_ROWS=16)),
    (128, 2048, 1024, dict(SPLIT_K=2, BLOCK_N=128, BLOCK_K=64)),
])
def test_ag_matmul_push(world, dtype, m_shard, k, n_shard, config):
    """Producer programs push into peers' heap inboxes; consumers poll at system scope."""
    mesh = _mesh(world)
    td.initialize(mesh)
    config = dict(config, PRODUCER="push")
    if dtype == jnp.float32:
        config = dict(config, BLOCK_K=min(config.get("BLOCK_K", 64), 64), num_stages=2)
    # Three calls: the inbox parities alternate.
    _check_ag_matmul(mesh, _ag_matmul_fn(mesh, config), world, m_shard, k, n_shard, dtype,
                     calls=3)


@pytest.mark.parametrize("world", [1, 4])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("m_shard,k,n_shard,config", [
    # SM producers (the defaults of these shapes are the copy engines').
    (256, 512, 384, dict(TMA=True, PRODUCER="sm")),      # N tiles clipped by the descriptor
    (1024, 1024, 1024, dict(TMA=True, PRODUCER="sm", CHUNK_ROWS=32, NUM_COMM=24)),
    (128, 8192, 520, dict(TMA=True, PRODUCER="sm", NUM_COMM=8)),
    # The copy engines gather (csrc/ce_gather.cc); chunks coarser and finer than tiles.
    (1024, 1024, 1024, dict(TMA=True, PRODUCER="ce", CHUNK_ROWS=256)),
    (256, 512, 384, dict(TMA=True, PRODUCER="ce", CHUNK_ROWS=64)),
    # The copy engines push to one peer after another.
    (1024, 1024, 1024, dict(TMA=True, PRODUCER="ce", CHUNK_ROWS=256, PUSH_ORDER="serial")),
    (256, 512, 384, dict(TMA=True, PRODUCER="ce", CHUNK_ROWS=64, PUSH_ORDER="serial")),
])
def test_ag_matmul_tma(world, dtype, m_shard, k, n_shard, config):
    """The persistent TMA kernel, through jaxtdist's own launcher (global scratch)."""
    mesh = _mesh(world)
    td.initialize(mesh)
    # Three calls: the tile counter is reset by each call's last program.
    _check_ag_matmul(mesh, _ag_matmul_fn(mesh, config), world, m_shard, k, n_shard, dtype,
                     calls=3)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("world,m_shard,k,n_shard,config", [
    # 2048 x 2752 (M = 8192, N = 11008 over 4): 44 tiles left over 132 SMs.
    (4, 2048, 4096, 2752, dict(CHUNK_ROWS=128)),
    # 124 tiles left, runs of 31 of 32 K blocks: most tiles shared by 2 programs.
    (4, 512, 2048, 2048, dict(BLOCK_N=128, num_stages=4)),
    (2, 1024, 2048, 4096, dict(CHUNK_ROWS=256)),
    # N clipped by the last tile column; K not a multiple of BLOCK_K.
    (4, 1024, 1000, 2752, dict(CHUNK_ROWS=512)),
])
def test_ag_matmul_tma_stream_k(world, m_shard, k, n_shard, config, dtype):
    """The copy-engine kernel with its last partial wave cut along K (STREAM_K=True)."""
    mesh = _mesh(world)
    rt = td.initialize(mesh)
    config = dict(config, TMA=True, PRODUCER="ce", STREAM_K=True)
    # Three calls: the tiles' arrival counters carry over between calls.
    _check_ag_matmul(mesh, _ag_matmul_fn(mesh, config), world, m_shard, k, n_shard, dtype,
                     calls=3)
    assert any(key[0] == "ag_matmul/stream_k" for key in rt._workspaces), "no tail was cut"


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("world,m_shard,k,n_shard,config,pieces", [
    # 2048 x 2752: 44 tiles left over 132 SMs, in 128-wide halves ("auto").
    (4, 2048, 4096, 2752, {}, 2),
    # 12 tiles left; the last column of tiles is 192 wide (its last piece clipped).
    (4, 512, 2048, 2240, dict(CHUNK_ROWS=128), 2),
    (4, 512, 2048, 2240, dict(TAIL_SPLIT_N=4), 4),
    # 8 tiles left in quarters; the last column is 128 wide (two pieces past N);
    # K not a multiple of BLOCK_K.
    (2, 1024, 1000, 4224, dict(TAIL_SPLIT_N=4, CHUNK_ROWS=512), 4),
    # The pieces' pipeline as deep as asked (auto: 5 for 128-wide halves).
    (4, 2048, 4096, 2752, dict(TAIL_STAGES=3), 2),
    (4, 512, 2048, 2240, dict(TAIL_STAGES=7, FLATTEN=True), 2),
])
def test_ag_matmul_tma_split_n_tail(world, m_shard, k, n_shard, config, pieces, dtype,
                                    ce_launches):
    """The copy-engine kernel with its last partial wave cut along N (TAIL_SPLIT_N)."""
    mesh = _mesh(world)
    td.initialize(mesh)
    config = dict(dict(TMA=True, PRODUCER="ce", BLOCK_M=128, BLOCK_N=256, BLOCK_K=64,
                       num_warps=8, num_stages=3), **config)
    _check_ag_matmul(mesh, _ag_matmul_fn(mesh, config), world, m_shard, k, n_shard, dtype,
                     calls=3)
    assert [c["TAIL_SPLIT_N"] for c in ce_launches] == [pieces]
    # auto: as deep as the whole tiles' 3 stages and their epilogue buffer (a
    # quarter tile: SUBTILE=4 with BLOCK_N=256) take, in pieces' stages.
    auto = (3 * (128 + 256) * 64 + 128 * 256 // 4) // ((128 + 256 // pieces) * 64)
    assert [c["TAIL_STAGES"] for c in ce_launches] == [config.get("TAIL_STAGES", auto)]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("world,m_shard,k,n_shard,config", [
    (4, 1024, 1024, 1024, dict(CHUNK_ROWS=256)),
    (4, 2048, 4096, 2752, dict(CHUNK_ROWS=128)),          # with the split-N tail
    (2, 256, 1000, 520, dict(CHUNK_ROWS=128, BLOCK_N=128, PUSH_ORDER="parallel")),
    (1, 512, 512, 384, {}),
])
def test_ag_matmul_tma_flattened(world, m_shard, k, n_shard, config, dtype):
    """The copy-engine kernel with its tile loops flattened (FLATTEN=True: the next
    tile's loads issued under this tile's epilogue, after its loop-free wait),
    interleaved with unflattened calls that share its inboxes and flags."""
    mesh = _mesh(world)
    td.initialize(mesh)
    base = dict(dict(TMA=True, PRODUCER="ce", BLOCK_M=128, BLOCK_N=256, BLOCK_K=64,
                     num_warps=8, num_stages=3), **config)
    flat = _ag_matmul_fn(mesh, dict(base, FLATTEN=True))
    plain = _ag_matmul_fn(mesh, dict(base, FLATTEN=False))
    for f in (flat, flat, plain, flat):
        _check_ag_matmul(mesh, f, world, m_shard, k, n_shard, dtype, calls=2)


@pytest.mark.parametrize("world", [2, 4])
def test_ag_matmul_ce_push_orders_interleaved(world):
    """Copy-engine calls pushing in parallel and serially, interleaved: they share
    the inboxes, flags and sent words (one workspace), call after call."""
    mesh = _mesh(world)
    td.initialize(mesh)
    base = dict(TMA=True, PRODUCER="ce", CHUNK_ROWS=128)
    fns = [_ag_matmul_fn(mesh, dict(base, PUSH_ORDER=order))
           for order in ("serial", "parallel", "serial", "serial", "parallel")]
    for f in fns:
        _check_ag_matmul(mesh, f, world, 512, 1024, 768, jnp.bfloat16, calls=1)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("order", ["serial", "parallel"])
@pytest.mark.parametrize("m_shard,chunk_rows", [(512, 128), (1024, 64)])
def test_ag_matmul_ce_back_to_back(world, order, m_shard, chunk_rows):
    """Copy-engine calls back to back with no host sync in between, eight inputs
    alive at once (each call reads another x), every output checked at the end;
    then 40 calls queued faster than the GPUs run them."""
    from jaxtdist import _jaxtdist_ffi as native
    mesh = _mesh(world)
    td.initialize(mesh)
    k, n_shard, dtype = 1024, 768, jnp.bfloat16
    f = _ag_matmul_fn(mesh, dict(TMA=True, PRODUCER="ce", CHUNK_ROWS=chunk_rows,
                                 PUSH_ORDER=order))
    hosts = [(_rand((world * m_shard, k), dtype, 1 / np.sqrt(k)),
              _rand((k, world * n_shard), dtype)) for _ in range(8)]
    args = jax.block_until_ready([(jax.device_put(x, NamedSharding(mesh, P("tp", None))),
                                   jax.device_put(w, NamedSharding(mesh, P(None, "tp"))))
                                  for x, w in hosts])
    refs = [np.asarray(x, np.float32) @ np.asarray(w, np.float32) for x, w in hosts]
    before = native.ce_push_stats()["calls"]
    outs = [f(x, w) for x, w in args]
    for out, ref in zip(outs, refs):
        assert _rel(out, ref) < TOL[dtype]
    assert native.ce_push_stats()["calls"] - before == 8 * world  # the copy engines pushed
    outs = [f(*args[i % 8]) for i in range(40)]
    for i in (0, 17, 38, 39):
        assert _rel(outs[i], refs[i % 8]) < TOL[dtype]


def test_ag_matmul_tma_config_over_shared_memory_is_refused():
    mesh = _mesh(2)
    td.initialize(mesh)
    f = _ag_matmul_fn(mesh, dict(TMA=True, BLOCK_N=256, BLOCK_K=128, num_stages=4))
    x = jax.device_put(_rand((512, 1024), jnp.bfloat16), NamedSharding(mesh, P("tp", None)))
    w = jax.device_put(_rand((1024, 512), jnp.bfloat16), NamedSharding(mesh, P(None, "tp")))
    with pytest.raises(ValueError, match="bytes of shared memory per program with num_stages=4"):
        f(x, w)


def test_ag_matmul_tma_chained_with_other_kernels():
    """TMA and pointer kernels of different shapes in one program share the tile counter."""
    from jaxtdist.ops.ag_matmul import ag_matmul_with_gathered
    world = 4
    mesh = _mesh(world)
    td.initialize(mesh)

    def body(x, w1, w2):
        a = ag_matmul_with_gathered(x, w1, "tp", config=dict(TMA=True, PRODUCER="sm"))[0]
        b = ag_matmul_with_gathered(x, w2, "tp", config=dict(TMA=True, PRODUCER="sm",
                                                             BLOCK_N=128, num_stages=3))[0]
        c = ag_matmul_with_gathered(x, w1, "tp", config=dict(TMA=False))[0]
        d = ag_matmul_with_gathered(x, w2, "tp", config=dict(TMA=True, PRODUCER="ce"))[0]
        return a, b, c, d

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("tp", None), P(None, "tp"),
                                                        P(None, "tp")),
                              out_specs=(P(None, "tp"),) * 4))
    for _ in range(3):
        x = _rand((world * 256, 1024), jnp.bfloat16, 1 / 32)
        w1 = _rand((1024, world * 512), jnp.bfloat16)
        w2 = _rand((1024, world * 256), jnp.bfloat16)
        put = lambda v, spec: jax.device_put(v, NamedSharding(mesh, spec))
        a, b, c, d = f(put(x, P("tp", None)), put(w1, P(None, "tp")), put(w2, P(None, "tp")))
        x32 = np.asarray(x, np.float32)
        assert _rel(a, x32 @ np.asarray(w1, np.float32)) < TOL[jnp.bfloat16]
        assert _rel(b, x32 @ np.asarray(w2, np.float32)) < TOL[jnp.bfloat16]
        assert _rel(c, x32 @ np.asarray(w1, np.float32)) < TOL[jnp.bfloat16]
        assert _rel(d, x32 @ np.asarray(w2, np.float32)) < TOL[jnp.bfloat16]


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("shape", [(3, 5), (64, 1000), (1024, 4096)])
def test_all_gather(world, dtype, shape):
    mesh = _mesh(world)
    td.initialize(mesh)
    f = jax.jit(jax.shard_map(lambda x: td.all_gather(x, "tp"), mesh=mesh,
                              in_specs=P("tp", None), out_specs=P(None, None), check_vma=False))
    for _ in range(2):
        x = _rand((world * shape[0], shape[1]), dtype)
        out = f(jax.device_put(x, NamedSharding(mesh, P("tp", None))))
        np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(x, np.float32))


@pytest.mark.parametrize("config", [None, dict(TMA=True, PRODUCER="ce", CHUNK_ROWS=64,
                                                BLOCK_N=64)], ids=["default", "copy_engine"])
def test_submesh_2x2(config):
    if len(jax.devices()) < 4:
        pytest.skip("needs 4 GPUs")
    from jaxtdist.ops.ag_matmul import ag_matmul_with_gathered
    mesh = jax.make_mesh((2, 2), ("dp", "tp"), devices=jax.devices()[:4], axis_types=(AUTO, AUTO))
    td.initialize(mesh)
    m, k, n = 128, 256, 192

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P("dp", "tp", None), P("dp", None, "tp")),
                       out_specs=P("dp", None, "tp"))
    def f(x, w):
        x, w = x.reshape(x.shape[1:]), w.reshape(w.shape[1:])
        if config is None:
            return td.ag_matmul(x, w, "tp")[None]
        return ag_matmul_with_gathered(x, w, "tp", config=config, gathered=False)[0][None]

    x = _rand((2, 2 * m, k), jnp.bfloat16, 1 / np.sqrt(k))
    w = _rand((2, k, 2 * n), jnp.bfloat16)
    out = f(jax.device_put(x, NamedSharding(mesh, P("dp", "tp", None))),
            jax.device_put(w, NamedSharding(mesh, P("dp", None, "tp"))))
    for g in range(2):
        ref = np.asarray(x[g], np.float32) @ np.asarray(w[g], np.float32)
        assert _rel(out[g], ref) < TOL[jnp.bfloat16]


def test_chained_and_repeated_calls():
    mesh = _mesh(4) if len(jax.devices()) >= 4 else _mesh(len(jax.devices()))
    world = mesh.devices.size
    td.initialize(mesh)
    m, k = 256, 512
    ws = [_rand((k, k), jnp.float32, 1 / np.sqrt(k)) for _ in range(8)]

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P("tp", None), P()),
                       out_specs=P("tp", None))
    def chain(x, w_all):
        me = jax.lax.axis_index("tp")
        h = x
        for i in range(8):
            full = td.ag_matmul(h, w_all[i], "tp")  # [world*m, k]
            h = jax.lax.dynamic_slice_in_dim(full, me * m, m) + 0.5 * h
        return h

    w_all = jnp.stack(ws)
    for _ in range(3):
        x = _rand((world * m, k), jnp.float32)
        out = chain(jax.device_put(x, NamedSharding(mesh, P("tp", None))), w_all)
        h = np.asarray(x, np.float64)
        for i in range(8):
            h = h @ np.asarray(ws[i], np.float64) + 0.5 * h
        assert _rel(out, h) < 1e-2
    f = _ag_matmul_fn(mesh)
    for _ in range(50):
        x = _rand((world * m, k), jnp.bfloat16, 1 / np.sqrt(k))
        w = _rand((k, world * 128), jnp.bfloat16)
        # Inputs on the devices first: no device's launch waits for its transfer.
        out = f(*jax.block_until_ready((jax.device_put(x, NamedSharding(mesh, P("tp", None))),
                                        jax.device_put(w, NamedSharding(mesh, P(None, "tp"))))))
        ref = np.asarray(x, np.float32) @ np.asarray(w, np.float32)
        assert _rel(out, ref) < TOL[jnp.bfloat16]


def test_grad():
    mesh = _mesh(min(4, len(jax.devices())))
    td.initialize(mesh)
    m, k, n = 64, 128, 96
    world = mesh.devices.size

    def loss(fn):
        @jax.jit
        @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P("tp", None), P(None, "tp")),
                           out_specs=P())
        def inner(x, w):
            return jax.lax.psum(jnp.sum(jnp.sin(fn(x, w))), "tp")
        return inner

    ours = loss(lambda x, w: td.ag_matmul(x, w, "tp"))
    ref = loss(lambda x, w: jax.lax.all_gather(x, "tp", tiled=True) @ w)
    x = jax.device_put(_rand((world * m, k), jnp.float32), NamedSharding(mesh, P("tp", None)))
    w = jax.device_put(_rand((k, world * n), jnp.float32, 0.1), NamedSharding(mesh, P(None, "tp")))
    g1 = jax.grad(ours, argnums=(0, 1))(x, w)
    g2 = jax.grad(ref, argnums=(0, 1))(x, w)
    for a, b in zip(g1, g2):
        assert _rel(a, np.asarray(b, np.float32)) < 5e-3


@pytest.mark.parametrize("world", [2, 4])
def test_user_kernel_ring(world):
    from tests.kernels_for_tests import ring_kernel
    mesh = _mesh(world)
    td.initialize(mesh)
    n = 1000

    ring = _vector_fn(mesh, lambda x: td.triton_call(
        x, kernel=ring_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(1,),
        axis_name="tp", workspace_bytes=256 + 2 * 4 * 1024, N=n, BLOCK=1024))

    for _ in range(3):
        x = _rand((world * n,), jnp.float32)
        out = ring(jax.device_put(x, NamedSharding(mesh, P("tp"))))
        np.testing.assert_array_equal(np.asarray(out), _ring_shift(x, world, 1))


def _late_rendezvous_summary(stats: dict, late_calls: list) -> str:
    """The aligner's statistics in a few lines: per late rendezvous, each
    member's mesh position, when its handler was entered and when it arrived
    (ms after the first arrival)."""
    lines = [f"met {stats['met']}, timed out {stats['timed_out']}, enabled {stats['enabled']} "
             f"{stats['disabled_because']}, largest spread {stats['max_spread_us'] / 1e3:.2f} ms",
             f"calls with a timeout: {late_calls}"]
    for record in stats["late"]:
        members = ", ".join(f"pos {m['position']} in +{m['entered_us'] / 1e3:.2f} "
                            f"at +{m['arrived_us'] / 1e3:.2f}" for m in record["members"])
        lines.append(f"  counter {record['counter']} epoch {record['epoch']}: {members}")
    return "\n".join(lines)


@pytest.mark.parametrize("launcher", ["native", "jax-triton"])
def test_launchers(launcher):
    """Both GPU launchers run the pointer kernels (SM producers and pushes), the
    all-gather and user kernels; a kernel with a scalar argument always goes
    through jax-triton (the native launcher takes arrays only). Once every
    program has run (compiled, modules loaded), every launch rendezvous is met."""
    from tests.kernels_for_tests import ring_kernel, scaled_rank_kernel
    world, n = 4, 1000
    mesh = _mesh(world)
    rt = td.initialize(mesh, launcher=launcher)
    try:
        ag_cases = [(m_shard, _ag_matmul_fn(mesh, config)) for m_shard, config in (
            (1, dict(PRODUCER="push", ALL_ROWS=True, CHUNK_ROWS=4, NUM_COMM=4, SPLIT_K=4,
                     BLOCK_N=64, BLOCK_K=64)),
            (100, dict(TMA=False, PRODUCER="sm", BLOCK_M=64, BLOCK_N=64, BLOCK_K=64,
                       CHUNK_ROWS=16)))]
        gather = jax.jit(jax.shard_map(lambda x: td.all_gather(x, "tp"), mesh=mesh,
                                       in_specs=P("tp", None), out_specs=P(None, None),
                                       check_vma=False))
        ring = _vector_fn(mesh, lambda x: td.triton_call(
            x, kernel=ring_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(1,),
            axis_name="tp", workspace_bytes=256 + 2 * 4 * 1024, N=n, BLOCK=1024))
        scaled = _vector_fn(mesh, lambda x: td.triton_call(
            x, 2.5, kernel=scaled_rank_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
            grid=(1,), axis_name="tp", N=n, BLOCK=1024))

        late = []  # (call, timeouts) of calls whose rendezvous timed out

        def note(label):
            seen = sum(t for _, t in late)
            timed_out = rt.launch_alignment_stats()["timed_out"]
            if timed_out > seen:
                late.append((label, timed_out - seen))

        def check_all(calls):
            for m_shard, f in ag_cases:
                for call in range(calls):
                    _check_ag_matmul(mesh, f, world, m_shard, 1024, 512, jnp.bfloat16, calls=1)
                    note(f"ag_matmul m_shard={m_shard} #{call}")
            for call in range(calls):
                x = _rand((world * 64, 256), jnp.bfloat16)
                xs = jax.block_until_ready(jax.device_put(x, NamedSharding(mesh, P("tp", None))))
                np.testing.assert_array_equal(np.asarray(gather(xs), np.float32),
                                              np.asarray(x, np.float32))
                note(f"all_gather #{call}")
                v = _rand((world * n,), jnp.float32)
                vs = jax.block_until_ready(jax.device_put(v, NamedSharding(mesh, P("tp"))))
                np.testing.assert_array_equal(np.asarray(ring(vs)), _ring_shift(v, world, 1))
                note(f"ring #{call}")
                # The GPU fuses x * 2.5 + rank (one rounding): compare with the exact
                # value (float64 holds it) rounded once, to within 1 ulp.
                exact = (np.asarray(v, np.float64) * 2.5
                         + np.repeat(np.arange(world, dtype=np.float64), n)).astype(np.float32)
                np.testing.assert_array_max_ulp(np.asarray(scaled(vs)), exact, maxulp=1)
                note(f"scalar kernel #{call}")

        # First calls compile and load modules, which may hold one host thread
        # past the rendezvous bound (a timeout only delays, it is never wrong).
        check_all(calls=1)
        rt.align_launches = True  # resets the statistics
        late.clear()
        check_all(calls=3)
        # 15 calls, each launch rendezvous met by all 4 host threads (in the
        # native launch, or in the prologue before a jax-triton launch). `late`
        # names the calls whose rendezvous timed out.
        stats = rt.launch_alignment_stats()
        why = _late_rendezvous_summary(stats, late)
        print(why)
        assert stats["enabled"] and stats["timed_out"] == 0, why
        assert stats["met"] >= world * 15, why
    finally:
        rt.launcher = "native"


@pytest.mark.parametrize("world", [2, 4])
def test_example_ring_with_consume_token(world):
    """The tutorial's ring kernel (it uses dl.consume_token) on GPUs, chained calls."""
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
    from ring_kernels import ring_exchange_kernel, ring_workspace_bytes
    mesh = _mesh(world)
    td.initialize(mesh)
    n = 4000

    def once(v):
        return td.triton_call(v, kernel=ring_exchange_kernel,
                              out_shape=jax.ShapeDtypeStruct(v.shape, v.dtype), grid=(1,),
                              axis_name="tp", workspace_bytes=ring_workspace_bytes(n),
                              N=n, BLOCK=1024)

    ring_twice = _vector_fn(mesh, lambda x: once(once(x) * 2.0))
    for _ in range(3):
        x = _rand((world * n,), jnp.float32)
        out = ring_twice(jax.device_put(x, NamedSharding(mesh, P("tp"))))
        np.testing.assert_array_equal(np.asarray(out), 2 * _ring_shift(x, world, 2))
    td.check_errors()


@pytest.mark.parametrize("world", [1, 2, 4])
def test_staged_input_read_by_peer(world):
    """triton_call(stage=...): the FFI prologue stages x in the heap on XLA's stream."""
    from tests.kernels_for_tests import staged_prev_kernel
    mesh = _mesh(world)
    td.initialize(mesh)
    n = 3000

    prev = _vector_fn(mesh, lambda x: td.triton_call(
        kernel=staged_prev_kernel, stage=x, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(1,), axis_name="tp", workspace_bytes=4 * 64, N=n, BLOCK=1024))

    for _ in range(4):
        x = _rand((world * n,), jnp.float32)
        out = prev(jax.device_put(x, NamedSharding(mesh, P("tp"))))
        np.testing.assert_array_equal(np.asarray(out), _ring_shift(x, world, 1))


@pytest.mark.parametrize("kernel", ["withheld_kernel", "withheld_tma_kernel"])
def test_withheld_notify_times_out_with_named_error(kernel):
    """``dl.wait`` and the loop-free ``dl.wait_for_tma`` (inline-asm spin) give up
    after the bound in seconds (%globaltimer), with the same named error."""
    import tests.kernels_for_tests as kernels
    withheld_kernel = getattr(kernels, kernel)
    world = min(2, len(jax.devices()))
    mesh = _mesh(world)
    bound = 1.0
    td.initialize(mesh, wait_timeout_s=bound)
    try:
        @jax.jit
        @functools.partial(jax.shard_map, mesh=mesh, in_specs=P("tp"), out_specs=P("tp"))
        def stuck(x):
            return td.triton_call(kernel=withheld_kernel,
                                  out_shape=jax.ShapeDtypeStruct((1,), jnp.int32), grid=(1,),
                                  axis_name="tp", workspace_bytes=256) + x

        import time
        zeros = jax.device_put(jnp.zeros((world,), jnp.int32), NamedSharding(mesh, P("tp")))
        compiled = stuck.lower(zeros).compile()
        start = time.time()
        jax.block_until_ready(compiled(zeros))
        elapsed = time.time() - start
        assert bound * 0.9 < elapsed < 2 * bound, f"a {bound} s bound took {elapsed:.2f} s"
        with pytest.raises(td.WaitTimeoutError, match=r"timed out.*rank"):
            td.check_errors()
        # The next op refuses to run on out-of-step signals, naming the timeout.
        with pytest.raises(Exception, match="timed out"):
            jax.block_until_ready(stuck(jax.device_put(jnp.zeros((world,), jnp.int32),
                                                       NamedSharding(mesh, P("tp")))))
        # The documented recovery: a fresh runtime runs ops again. Running one also
        # replaces JAX's failed per-device runtime tokens, which JAX would otherwise
        # re-raise at interpreter exit.
        td.shutdown()
        td.initialize(mesh)
        x = _rand((world * 64, 32), jnp.float32)
        gather = _vector_fn(mesh, lambda v: td.all_gather(v, "tp", tiled=True))
        np.testing.assert_array_equal(np.asarray(gather(jax.device_put(
            x, NamedSharding(mesh, P("tp", None))))), np.tile(np.asarray(x), (world, 1)))
    finally:
        td.shutdown()


@pytest.mark.parametrize("num_warps", [4, 8])
def test_warp_specialized_user_kernel(num_warps):
    """A user kernel with a warp-specialized loop (TMA, so the native launcher):
    launched with the compiled warp count (12 for num_warps=4 on Hopper; the
    requested count failed with CUDA_ERROR_INVALID_VALUE), per-rank c = a @ b."""
    from tests.kernels_for_tests import warp_specialized_matmul_kernel
    world, m, n, k = 2, 512, 512, 256
    mesh = _mesh(world)
    td.initialize(mesh)
    sms = jax.devices()[0].core_count
    f = jax.jit(jax.shard_map(
        lambda a, b: td.triton_call(
            a, b, kernel=warp_specialized_matmul_kernel, grid=(sms,), axis_name="tp", tma=True,
            out_shape=jax.ShapeDtypeStruct((m, n), jnp.bfloat16), num_warps=num_warps,
            num_stages=3, M=m, N=n, K=k, BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8,
            NUM_PROGRAMS=sms, WS=True),
        mesh=mesh, in_specs=(P("tp", None), P("tp", None)), out_specs=P("tp", None),
        check_vma=False))
    a = _rand((world * m, k), jnp.bfloat16, k ** -0.5)
    b = _rand((world * k, n), jnp.bfloat16)
    out = f(a, b)
    a32 = np.asarray(a, np.float32).reshape(world, m, k)
    b32 = np.asarray(b, np.float32).reshape(world, k, n)
    ref = np.einsum("rmk,rkn->rmn", a32, b32).reshape(world * m, n)
    assert _rel(out, ref) < TOL[jnp.bfloat16]
