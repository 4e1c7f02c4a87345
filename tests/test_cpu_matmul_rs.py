"""jaxtdist matmul_rs and matmul_ar on CPU devices (Triton interpreter), against
float64 products and XLA's psum_scatter / psum."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxtdist as td
from jaxtdist.ops._config import Problem
from jaxtdist.ops.matmul_rs import (MatmulArConfig, MatmulRsConfig, matmul_ar,
                                    matmul_ar_kernels, matmul_ar_sharded, matmul_rs,
                                    matmul_rs_kernels, matmul_rs_sharded)
from tests.conftest import assert_close, cpu_only, f64, place, rand, rel_err, setup

pytestmark = cpu_only()

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
X_SPEC, W_SPEC = P(None, "tp"), P("tp", None)


def _rs_fn(mesh, config=None, kernels=False):
    op = matmul_rs_kernels if kernels else matmul_rs
    return jax.jit(jax.shard_map(lambda x, w: op(x, w, "tp", config=config), mesh=mesh,
                                 in_specs=(X_SPEC, W_SPEC), out_specs=P("tp", None)))


def _ar_fn(mesh, config=None, kernels=False):
    op = matmul_ar_kernels if kernels else matmul_ar
    return jax.jit(jax.shard_map(lambda x, w: op(x, w, "tp", config=config), mesh=mesh,
                                 in_specs=(X_SPEC, W_SPEC), out_specs=P()))


def _check(f, mesh, m, n, k, dtype, factor=1.0):
    """One call on fresh x [m, k], w [k, n] (k split over "tp"): the whole product,
    however the op shards it, against float64."""
    x, w = rand((m, k), dtype), rand((k, n), dtype)
    out = f(place(mesh, x, X_SPEC), place(mesh, w, W_SPEC))
    assert out.dtype == jnp.dtype(dtype)
    assert_close(out, f64(x) @ f64(w), dtype, factor)


# (world, dtype, rows per rank, N, k per rank): every world size, every dtype; N and
# k no multiples of the interpreter's blocks (32); rows per rank no multiple of
# BLOCK_M (17 -> BLOCK_M 32; 5 and 3 -> 16), several row tiles (40 -> 2 x 32).
RS_CASES = [(2, F32, 24, 40, 20), (2, BF16, 17, 33, 36), (3, F32, 7, 20, 11),
            (4, F16, 5, 40, 12), (4, F32, 40, 17, 50), (8, BF16, 3, 24, 16),
            (8, F32, 9, 35, 9)]


@pytest.mark.parametrize("world,dtype,m_shard,n,k", RS_CASES)
def test_matmul_rs(world, dtype, m_shard, n, k):
    mesh = setup(world)
    f = _rs_fn(mesh)
    for _ in range(2):  # a second call: the other inbox parity
        _check(f, mesh, world * m_shard, n, world * k, dtype)


@pytest.mark.parametrize("config", [dict(NUM_PROGRAMS=1), dict(NUM_PROGRAMS=7, BLOCK_N=16),
                                    dict(PARTIAL="float32"), dict(BLOCK_M=16, GROUP_M=1)])
def test_matmul_rs_configs(config):
    world = 4
    mesh = setup(world)
    f = _rs_fn(mesh, config)
    for dtype in (F32, BF16):
        _check(f, mesh, world * 21, 37, world * 10, dtype)


@pytest.mark.parametrize("world,push", [(4, "tma"), (2, "stores")])
def test_matmul_rs_push_ways(world, push):
    """Both ways a peer's tile reaches its owner (TMA stores with the flag a tile
    later, SM stores), on rows TMA can address, several tiles per program."""
    mesh = setup(world)
    f = _rs_fn(mesh, dict(PUSH=push, TMA=True, NUM_PROGRAMS=2, BLOCK_M=16, BLOCK_N=16))
    for dtype in (F32, BF16):
        for _ in range(2):  # both inbox parities
            _check(f, mesh, world * 40, 48, world * 16, dtype)


def test_matmul_rs_kernel_traces_its_tiles():
    """trace_tiles: the same output, plus each program's clock stamps per tile (start,
    mainloop done, epilogue done) that run in order (the probes' view of where the
    time goes): one program, every tile traced."""
    world, m_shard, n, k = 2, 40, 48, 16
    cfg = dict(NUM_PROGRAMS=1, BLOCK_M=16, BLOCK_N=16)
    tiles = world * -(-m_shard // 16) * -(-n // 16)
    mesh = setup(world)

    def body(x, w):
        out_t, stamps = matmul_rs_kernels(x, w, "tp", config=cfg, trace_tiles=tiles)
        return matmul_rs_kernels(x, w, "tp", config=cfg), out_t, stamps[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(X_SPEC, W_SPEC),
                              out_specs=(P("tp", None), P("tp", None), P("tp"))))
    x, w = rand((world * m_shard, world * k), F32), rand((world * k, n), F32)
    out, out_t, stamps = (np.asarray(a) for a in f(place(mesh, x, X_SPEC),
                                                    place(mesh, w, W_SPEC)))
    np.testing.assert_array_equal(out, out_t)
    assert_close(out_t, f64(x) @ f64(w), F32)
    assert stamps.shape == (world, 1, tiles, 3)
    steps = np.diff(stamps.reshape(world, -1).astype(np.int64), axis=-1) % (1 << 32)
    assert (steps < 1 << 31).all(), stamps  # non-decreasing modulo 2**32
    for bad in (-1, 2.0, True):
        with pytest.raises(ValueError, match="trace_tiles"):
            jax.jit(jax.shard_map(
                lambda x, w, bad=bad: matmul_rs_kernels(x, w, "tp", trace_tiles=bad)[1],
                mesh=mesh, in_specs=(X_SPEC, W_SPEC), out_specs=P("tp")))(
                    place(mesh, x, X_SPEC), place(mesh, w, W_SPEC))


# (world, dtype, M, N, k per rank): decode rows (1, 5, 16), one case of two row tiles.
AR_CASES = [(2, F32, 1, 40, 20), (2, BF16, 16, 33, 36), (4, BF16, 16, 33, 12),
            (4, F32, 40, 17, 50), (8, F16, 5, 24, 9), (8, F32, 1, 70, 5)]


@pytest.mark.parametrize("world,dtype,m,n,k", AR_CASES)
def test_matmul_ar(world, dtype, m, n, k):
    mesh = setup(world)
    f = _ar_fn(mesh)
    for _ in range(2):
        _check(f, mesh, m, n, world * k, dtype)


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("split_k", [2, 3])
def test_matmul_ar_split_k(world, split_k):
    """SPLIT_K programs per tile, K per rank 70 (5 blocks of 16; split in whole blocks:
    48 + 22 at SPLIT_K=2, 32 + 32 + 6 at 3); two calls in one jit, run twice: the
    arrival counters only grow, nothing is reset."""
    m, n, k = 5, 40, 70
    mesh = setup(world)
    cfg = dict(SPLIT_K=split_k, BLOCK_K=16)

    def two(x, w):
        return jnp.stack([matmul_ar_kernels(x, w, "tp", config=cfg),
                          matmul_ar_kernels(2.0 * x, w, "tp", config=cfg)])

    f = jax.jit(jax.shard_map(two, mesh=mesh, in_specs=(X_SPEC, W_SPEC), out_specs=P()))
    for _ in range(2):
        x, w = rand((m, world * k)), rand((world * k, n))
        out = f(place(mesh, x, X_SPEC), place(mesh, w, W_SPEC))
        y = f64(x) @ f64(w)
        assert rel_err(out[0], y) < 1e-5 and rel_err(out[1], 2.0 * y) < 1e-5


# (world, dtype, M, N, k per rank, config): two shot on several tiles (owners
# rank t % W, some ranks owning none at 2 tiles over 4 ranks), split K, both
# partial dtypes, through the op (autodiff's forward) and its kernel.
TWO_SHOT_CASES = [(3, F32, 16, 70, 20, dict(BLOCK_N=16)),
                  (4, BF16, 40, 33, 12, dict(BLOCK_N=32)),
                  (4, F32, 5, 40, 70, dict(SPLIT_K=3, BLOCK_K=16, BLOCK_N=16,
                                           PARTIAL="float32")),
                  (2, F16, 16, 24, 9, dict(BLOCK_N=16))]


@pytest.mark.parametrize("world,dtype,m,n,k,config", TWO_SHOT_CASES)
def test_matmul_ar_two_shot(world, dtype, m, n, k, config):
    """Each tile reduced on its owner and broadcast: the same bits on every rank,
    twice in one jit and on two calls (both parities, the epochs' flags)."""
    mesh = setup(world)
    cfg = dict(config, TWO_SHOT=True)

    def two(x, w):
        return jnp.stack([matmul_ar(x, w, "tp", config=cfg),
                          matmul_ar_kernels(2.0 * x, w, "tp", config=cfg)])[None]

    f = jax.jit(jax.shard_map(two, mesh=mesh, in_specs=(X_SPEC, W_SPEC), out_specs=P("tp"),
                              check_vma=False))
    for _ in range(2):
        x, w = rand((m, world * k), dtype), rand((world * k, n), dtype)
        out = np.asarray(f(place(mesh, x, X_SPEC), place(mesh, w, W_SPEC)))
        for r in range(1, world):
            np.testing.assert_array_equal(out[r], out[0], err_msg=f"rank {r} differs")
        y = f64(x) @ f64(w)
        assert_close(out[0, 0], y, dtype)
        assert_close(out[0, 1], 2.0 * y, dtype)


@pytest.mark.parametrize("world,two_shot", [(2, False), (3, False), (2, True), (4, True)])
def test_matmul_ar_parked_epilogue(world, two_shot):
    """Tiles of more than 32 float32 elements per thread (here 64 x 32 with one warp)
    park their own partial and sum 16 rows at a time (the last row tile partly
    outside M); the same bits on every rank, two calls (both parities)."""
    m, n, k = 70, 48, 24
    mesh = setup(world)
    cfg = dict(BLOCK_M=64, BLOCK_N=32, num_warps=1, TWO_SHOT=two_shot)
    f = jax.jit(jax.shard_map(lambda x, w: matmul_ar_kernels(x, w, "tp", config=cfg)[None],
                              mesh=mesh, in_specs=(X_SPEC, W_SPEC), out_specs=P("tp"),
                              check_vma=False))
    for _ in range(2):
        x, w = rand((m, world * k)), rand((world * k, n))
        out = np.asarray(f(place(mesh, x, X_SPEC), place(mesh, w, W_SPEC)))
        for r in range(1, world):
            np.testing.assert_array_equal(out[r], out[0], err_msg=f"rank {r} differs")
        assert rel_err(out[0], f64(x) @ f64(w)) < (1e-2 if two_shot else 1e-5)


def test_matmul_ar_parked_and_register_sums_get_their_own_workspaces():
    """Two configs of one shape and tiling, one summing in registers and one parking
    its partial (more warps' worth of elements per thread): the parking call's
    workspace holds its own plane, not the first call's smaller workspace reused."""
    from jaxtdist.runtime import runtime
    m, n, k, world = 66, 40, 24, 2
    mesh = setup(world)
    x, w = rand((m, world * k)), rand((world * k, n))
    args = (place(mesh, x, X_SPEC), place(mesh, w, W_SPEC))
    for warps in (8, 1):  # 64 x 32 tiles: 8 warps sum in registers, 1 warp parks
        cfg = dict(BLOCK_M=64, BLOCK_N=32, num_warps=warps)
        f = jax.jit(jax.shard_map(lambda a, b: matmul_ar_kernels(a, b, "tp", config=cfg),
                                  mesh=mesh, in_specs=(X_SPEC, W_SPEC), out_specs=P(),
                                  check_vma=False))
        assert rel_err(f(*args), f64(x) @ f64(w)) < 1e-5
    inboxes = [ws for key, ws in runtime()._workspaces.items()
               if key[0] == "matmul_ar/inbox" and key[2:6] == (m, n, 64, 32)]
    assert len(inboxes) == 2 and inboxes[0].nbytes < inboxes[1].nbytes


def test_matmul_ar_default_exchange():
    """Two shot in x's dtype where one shot's float32 partials pass 2 MB per rank;
    one shot in float32 elsewhere; TWO_SHOT asked alone brings its partials'
    default."""
    def cfg(world, m, n=8192, platform="gpu", **asked):
        p = Problem(platform, world, (m, n, 2048), "bfloat16", 132)
        return MatmulArConfig.settle(MatmulArConfig.default(p), asked)

    assert (cfg(4, 128).TWO_SHOT, cfg(4, 128).PARTIAL) == (True, "input")
    assert (cfg(4, 16).TWO_SHOT, cfg(4, 16).PARTIAL) == (False, "float32")
    assert cfg(4, 32).TWO_SHOT and not cfg(4, 16, n=4096).TWO_SHOT
    assert cfg(2, 1024).TWO_SHOT and not cfg(2, 64).TWO_SHOT  # two ranks: 2 MB too
    assert cfg(4, 128, TWO_SHOT=False).PARTIAL == "float32"
    assert cfg(4, 16, TWO_SHOT=True).PARTIAL == "input"
    with pytest.raises(ValueError, match="TWO_SHOT"):
        MatmulArConfig.default(Problem("gpu", 4, (16, 8192, 2048), "bfloat16", 132)).replace(
            TWO_SHOT=1).validate(Problem("gpu", 4, (16, 8192, 2048), "bfloat16", 132))
    with pytest.raises(ValueError, match="PARTIAL"):
        cfg(4, 16, PARTIAL="bf16").validate(Problem("gpu", 4, (16, 8192, 2048), "bfloat16",
                                                    132))


@pytest.mark.parametrize("m,n,tile,warps", [(1024, 4096, (128, 256), 8),
                                             (512, 8192, (128, 256), 8),
                                             (1024, 2048, (128, 128), 8),
                                             (256, 4096, (128, 64), 8),
                                             (128, 8192, (128, 64), 8), (96, 4096, (64, 128), 4),
                                             (64, 4096, (64, 128), 4)])
def test_matmul_ar_default_tiles(m, n, tile, warps):
    """16-bit GPU tiles from 64 rows: from 128 rows, 128 rows a tile (two warpgroups)
    and the widest N whose tiles still cover the SMs; 64 x 128 with one warpgroup
    below; pointer loads; the config fits its problem."""
    p = Problem("gpu", 2, (m, n, 512), "bfloat16", 132)
    cfg = MatmulArConfig.default(p)
    assert ((cfg.BLOCK_M, cfg.BLOCK_N), cfg.num_warps, cfg.TMA) == (tile, warps, False)
    cfg.validate(p)


def test_over_tp_of_a_dp_tp_mesh():
    """A (2, 2) dp x tp mesh, the collectives over "tp": each dp group sums its own
    partials (dp groups hold different rows and weights)."""
    mesh = setup((2, 2), ("dp", "tp"))
    m, n, k = 2 * 2 * 7, 24, 2 * 18
    xs, ws = P("dp", "tp"), P("tp", None)
    for dtype in (F32, BF16):
        # Different weights per dp group: w is [2 * k, n], rows over ("dp", "tp").
        x, w = rand((m, k), dtype), rand((2 * k, n), dtype)
        w_spec = P(("dp", "tp"), None)
        rs = jax.jit(jax.shard_map(lambda x, w: matmul_rs(x, w, "tp"), mesh=mesh,
                                   in_specs=(xs, w_spec), out_specs=P(("dp", "tp"), None)))
        ar = jax.jit(jax.shard_map(lambda x, w: matmul_ar(x, w, "tp"), mesh=mesh,
                                   in_specs=(xs, w_spec), out_specs=P("dp", None)))
        xd, wd = place(mesh, x, xs), place(mesh, w, w_spec)
        half = m // 2
        expect = np.concatenate([f64(x)[:half] @ f64(w)[:k], f64(x)[half:] @ f64(w)[k:]])
        assert_close(rs(xd, wd), expect, dtype)
        assert_close(ar(xd, wd), expect, dtype)
    del ws


@pytest.mark.parametrize("op", ["matmul_rs", "matmul_ar"])
def test_chained_calls_on_changing_data(op):
    """Reuse races: 10 calls in one jit, each on a differently rolled and scaled x,
    run 5 times on fresh data: 50 calls, both inbox parities rewritten while
    peers may still lag a call behind."""
    world, m, n, k, calls = 4, 4 * 6, 20, 4 * 8, 10
    rs = op == "matmul_rs"
    rows = m if rs else 5

    def chain(x, w):
        outs = []
        for i in range(calls):
            xi = (jnp.roll(x, i, axis=0) * (1.0 + i))[:rows]
            outs.append(matmul_rs(xi, w, "tp") if rs else matmul_ar(xi, w, "tp"))
        return jnp.stack(outs)

    mesh = setup(world)
    f = jax.jit(jax.shard_map(chain, mesh=mesh, in_specs=(X_SPEC, W_SPEC),
                              out_specs=P(None, "tp", None) if rs else P()))
    for _ in range(5):
        x, w = rand((m, k)), rand((k, n))
        out = f(place(mesh, x, X_SPEC), place(mesh, w, W_SPEC))
        for i in range(calls):
            y = (np.roll(f64(x), i, axis=0) * (1.0 + i))[:rows] @ f64(w)
            assert rel_err(out[i], y) < 1e-5, i


@pytest.mark.parametrize("dtype,tol", [(F32, 1e-5), (BF16, 2e-2)])
def test_matmul_rs_grad(dtype, tol):
    world, m, n, k = 4, 4 * 5, 12, 4 * 6
    mesh = setup(world)

    def loss_td(x, w, g):
        return jnp.sum(matmul_rs(x, w, "tp").astype(F32) * g)

    def loss_ref(x, w, g):
        y = jnp.dot(x, w, preferred_element_type=F32)
        y = jax.lax.psum_scatter(y, "tp", scatter_dimension=0, tiled=True).astype(x.dtype)
        return jnp.sum(y.astype(F32) * g)

    def body(x, w, g):
        return (jax.grad(loss_td, argnums=(0, 1))(x, w, g)
                + jax.grad(loss_ref, argnums=(0, 1))(x, w, g))

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(X_SPEC, W_SPEC, P("tp", None)),
                              out_specs=(X_SPEC, W_SPEC, X_SPEC, W_SPEC)))
    x, w, g = rand((m, k), dtype), rand((k, n), dtype), rand((m, n), F32)
    gx, gw, rx, rw = f(place(mesh, x, X_SPEC), place(mesh, w, W_SPEC),
                       place(mesh, g, P("tp", None)))
    assert gx.dtype == jnp.dtype(dtype) and gw.dtype == jnp.dtype(dtype)
    assert rel_err(gx, f64(rx)) < tol and rel_err(gw, f64(rw)) < tol
    # Exact: dx = g @ w^T, dw = x^T @ g (g: the whole [M, N] cotangent).
    assert rel_err(gx, f64(g) @ f64(w).T) < tol
    assert rel_err(gw, f64(x).T @ f64(g)) < tol


@pytest.mark.parametrize("dtype,tol", [(F32, 1e-5), (F16, 5e-3)])
def test_matmul_ar_grad(dtype, tol):
    world, m, n, k = 4, 3, 12, 4 * 6
    mesh = setup(world)

    def loss_td(x, w, g):
        return jnp.sum(matmul_ar(x, w, "tp").astype(F32) * g)

    def loss_ref(x, w, g):
        y = jax.lax.psum(jnp.dot(x, w, preferred_element_type=F32), "tp").astype(x.dtype)
        return jnp.sum(y.astype(F32) * g)

    def body(x, w, g):
        return (jax.grad(loss_td, argnums=(0, 1))(x, w, g)
                + jax.grad(loss_ref, argnums=(0, 1))(x, w, g))

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(X_SPEC, W_SPEC, P()),
                              out_specs=(X_SPEC, W_SPEC, X_SPEC, W_SPEC)))
    x, w, g = rand((m, k), dtype), rand((k, n), dtype), rand((m, n), F32)
    gx, gw, rx, rw = f(place(mesh, x, X_SPEC), place(mesh, w, W_SPEC), place(mesh, g, P()))
    assert gx.dtype == jnp.dtype(dtype) and gw.dtype == jnp.dtype(dtype)
    assert rel_err(gx, f64(rx)) < tol and rel_err(gw, f64(rw)) < tol
    assert rel_err(gx, f64(g) @ f64(w).T) < tol
    assert rel_err(gw, f64(x).T @ f64(g)) < tol


def test_world_1_is_local():
    """A group of one rank is x @ w (no kernel); the kernels themselves at world 1
    (no peers, no inbox) agree."""
    mesh = setup((1, 8), ("tp", "dp"))
    specs = dict(mesh=mesh, in_specs=(P("dp", None), P()), out_specs=P("dp", None))
    x, w = rand((8 * 3, 20)), rand((20, 9))
    xd, wd = place(mesh, x, P("dp", None)), place(mesh, w, P())
    expect = f64(x) @ f64(w)
    for op in (matmul_rs, matmul_ar, matmul_rs_kernels, matmul_ar_kernels):
        # matmul_rs's kernel types its rows as varying over "tp" (of size 1 here).
        f = jax.jit(jax.shard_map(lambda x, w, op=op: op(x, w, "tp"), **specs,
                                  check_vma=op is not matmul_rs_kernels))
        assert rel_err(f(xd, wd), expect) < 1e-5, op.__name__
    text = jax.jit(jax.shard_map(lambda x, w: matmul_rs(x, w, "tp"), **specs)).lower(
        xd, wd).as_text()
    assert "jaxtdist" not in text


def test_world_1_sums_are_typed_like_psum():
    """At world 1 matmul_ar and all_reduce of operands varying over the group's axis
    are typed as jax.lax.psum types them (replicated over it), so out_specs that
    leave the axis out pass shard_map's check as at larger worlds (the decode
    layers' P("dp", None)); values and gradients are the local ones."""
    from jaxtdist.ops._protocol import varying_axes

    mesh = setup((2, 1), ("dp", "tp"))
    seen = {}

    def body(x, w):
        y, r = matmul_ar(x, w, "tp"), td.all_reduce(x, "tp")
        seen.update(y=varying_axes(y), r=varying_axes(r), psum=varying_axes(
            jax.lax.psum(x @ w, "tp")))
        return y, r

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("dp", "tp"), P("tp", None)),
                              out_specs=(P("dp", None), P("dp", None))))
    x, w = rand((2 * 3, 20)), rand((20, 9))
    xd, wd = place(mesh, x, P("dp", "tp")), place(mesh, w, P("tp", None))
    y, r = f(xd, wd)
    if seen["psum"] is not None:
        assert seen["y"] == seen["r"] == seen["psum"] == {"dp"}, seen
    assert rel_err(y, f64(x) @ f64(w)) < 1e-5 and rel_err(r, f64(x)) == 0
    g = rand((2 * 3, 9))
    gx = jax.jit(jax.grad(lambda a: jnp.sum(f(a, wd)[0] * g)))(xd)
    assert rel_err(gx, f64(g) @ f64(w).T) < 1e-5


def test_sharded_wrappers():
    """The row-parallel layer pjit-style: x [M, K] rows over dp, columns over tp; w
    rows over tp. The result is x @ w, rows over (dp, tp) (matmul_rs) or dp
    (matmul_ar)."""
    mesh = setup((2, 4), ("dp", "tp"))
    x, w = rand((2 * 4 * 3, 4 * 10)), rand((4 * 10, 19))
    xd, wd = place(mesh, x, P("dp", "tp")), place(mesh, w, P("tp", None))
    expect = f64(x) @ f64(w)
    out = jax.jit(lambda x, w: matmul_rs_sharded(x, w, axis_name="tp", batch_axes="dp"))(xd, wd)
    assert out.sharding.spec == P(("dp", "tp"), None) or out.sharding.spec[0] == ("dp", "tp")
    assert rel_err(out, expect) < 1e-5
    out = jax.jit(lambda x, w: matmul_ar_sharded(x, w, axis_name="tp", batch_axes="dp"))(xd, wd)
    assert rel_err(out, expect) < 1e-5


def test_errors():
    mesh = setup(4)
    x, w = place(mesh, rand((6, 8)), X_SPEC), place(mesh, rand((8, 8)), W_SPEC)
    with pytest.raises(ValueError, match=r"M=6\) must be divisible by the group size W=4"):
        _rs_fn(mesh)(x, w)
    x = place(mesh, rand((8, 8)), X_SPEC)
    for make in (_rs_fn, _ar_fn):
        with pytest.raises(ValueError, match="contraction sizes differ"):
            make(mesh)(x, place(mesh, rand((12, 8)), W_SPEC))
        with pytest.raises(ValueError, match="must share a dtype"):
            make(mesh)(x, place(mesh, rand((8, 8), BF16), W_SPEC))
        with pytest.raises(ValueError, match="unknown config keys"):
            make(mesh, dict(BLOCKM=16))(x, w)
        with pytest.raises(ValueError, match=r"BLOCK_N=24 must be a power of 2 >= 16"):
            make(mesh, dict(BLOCK_N=24))(x, w)
        with pytest.raises(ValueError, match=r"BLOCK_K=8 must be a power of 2 >= 16"):
            make(mesh, dict(BLOCK_K=8))(x, w)
    with pytest.raises(ValueError, match="SPLIT_K=0 must be an int >= 1"):
        _ar_fn(mesh, dict(SPLIT_K=0))(x, w)
    with pytest.raises(ValueError, match=r"SPLIT_K=2 exceeds the 1 blocks of K=2 \(BLOCK_K=32\)"):
        _ar_fn(mesh, dict(SPLIT_K=2))(x, w)
    with pytest.raises(ValueError, match="PARTIAL='bf16'; allowed: 'float32', 'input'"):
        _rs_fn(mesh, dict(PARTIAL="bf16"))(x, w)
    with pytest.raises(ValueError, match="PUSH='dma'; allowed: 'auto', 'tma', 'stores'"):
        _rs_fn(mesh, dict(PUSH="dma"))(x, w)
    with pytest.raises(ValueError, match="PUSH='tma' needs TMA=True"):
        _rs_fn(mesh, dict(PUSH="tma", TMA=False))(x, w)
    with pytest.raises(ValueError, match="NUM_PROGRAMS=-1 must be an int >= 0"):
        _rs_fn(mesh, dict(NUM_PROGRAMS=-1))(x, w)
    with pytest.raises(ValueError, match="dtype int32"):
        _rs_fn(mesh)(place(mesh, np.ones((8, 8), np.int32), X_SPEC),
                     place(mesh, np.ones((8, 8), np.int32), W_SPEC))
    gpu = Problem("gpu", 4, (8192, 4096, 3072), "bfloat16", 132)
    with pytest.raises(ValueError, match="NUM_PROGRAMS=200 exceeds the 132 SMs"):
        MatmulRsConfig.default(gpu).replace(NUM_PROGRAMS=200).validate(gpu)


@pytest.mark.parametrize("world", [2, 4, 8])
def test_gpu_defaults_and_search_spaces_validate(world):
    """The default rule and the search spaces give valid configs on the benchmark's
    problems (no device needed)."""
    for dtype in ("bfloat16", "float32"):
        for shape in ((8192, 4096, 12288 // world), (8192, 8192, 29568 // world), (40, 33, 7)):
            p = Problem("gpu", world, shape, dtype, 132)
            cfg = MatmulRsConfig.default(p)
            cfg.validate(p)
            m_shard = shape[0] // world
            tiles = world * -(-m_shard // cfg.BLOCK_M) * -(-shape[1] // cfg.BLOCK_N)
            assert cfg.programs(p, tiles) <= 132
            assert MatmulRsConfig.search_space(p)[0] == {}
        for m in (1, 16, 128):
            p = Problem("gpu", world, (m, 8192, 8192 // world), dtype, 132)
            MatmulArConfig.default(p).validate(p)
            assert MatmulArConfig.search_space(p)[0] == {}
    # The GEMM core where TMA can address the rows (wave rule: 1024 tiles of 128 x 256
    # are 7.8 rounds of 132 SMs), the pointer GEMM where it cannot (rows of 33 bf16).
    big = MatmulRsConfig.default(Problem("gpu", 4, (8192, 4096, 3072), "bfloat16", 132))
    assert (big.BLOCK_M, big.BLOCK_N, big.TMA, big.SUBTILE) == (128, 256, True, 4)
    # matmul_ar: pointer loads; decode rows 64 columns a tile and K split to cover
    # the SMs, 32 columns where K is too short to split.
    for shape, block_n, split_k in (((32, 4096, 7168), 64, 2), ((1, 8192, 3584), 64, 1),
                                    ((1, 1024, 1024), 32, 1), ((128, 8192, 2048), 64, 1)):
        ar = MatmulArConfig.default(Problem("gpu", 1, shape, "bfloat16", 132))
        assert (ar.TMA, ar.BLOCK_N, ar.SPLIT_K) == (False, block_n, split_k), ar
    odd = MatmulRsConfig.default(Problem("gpu", 4, (40, 33, 7), "bfloat16", 132))
    assert not odd.TMA
    p = Problem("gpu", 4, (40, 33, 7), "bfloat16", 132)
    with pytest.raises(ValueError, match="multiples of 16 bytes"):
        odd.replace(TMA=True).validate(p)


def test_tunes_with_an_explicit_measure():
    setup(2)

    def wall_us(fn, args, world, iterations):
        fn(*args).block_until_ready()
        t = time.perf_counter()
        for _ in range(iterations):
            fn(*args).block_until_ready()
        return (time.perf_counter() - t) / iterations * 1e6

    for op, shape in (("matmul_rs", (2 * 9, 20, 12)), ("matmul_ar", (3, 20, 12))):
        result = td.tune.tune(op, shape, jnp.float32, axis_name="tp",
                              candidates=[{}, dict(BLOCK_N=16)], iterations=1, measure=wall_us)
        assert len(result["tried"]) == 2 and all("us" in r for r in result["tried"]), result
        assert result["variant"] == "push"
        assert td.runtime.runtime().tuning.lookup(op, 2, shape, "float32") == result["config"]


def test_vmap_of_grad():
    """The backward's ag_matmul runs once per batch element too."""
    world, m, n, k = 2, 2 * 4, 6, 2 * 5
    mesh = setup(world)
    loss = lambda a, b: jnp.sum(jnp.sin(matmul_rs(a, b, "tp")))  # noqa: E731
    f = jax.jit(jax.shard_map(jax.vmap(jax.grad(loss, argnums=(0, 1))), mesh=mesh,
                              in_specs=(P(None, None, "tp"), P(None, "tp", None)),
                              out_specs=(P(None, None, "tp"), P(None, "tp", None))))
    x, w = rand((2, m, k), F32), rand((k, n), F32)
    w = np.stack([w, 2 * w])
    gx, gw = f(place(mesh, x, P(None, None, "tp")), place(mesh, w, P(None, "tp", None)))
    rx, rw = jax.vmap(jax.grad(lambda a, b: jnp.sum(jnp.sin(a @ b)), argnums=(0, 1)))(
        jnp.asarray(x), jnp.asarray(w))
    assert_close(gx, f64(rx), F32)
    assert_close(gw, f64(rw), F32)


def test_gemm_kernels_follow_the_matmul_precision(monkeypatch):
    """Every GEMM kernel gets its DOT_PRECISION from JAX's matmul precision when
    traced: the backend's default (None: TF32 on NVIDIA) unless float32 accuracy is
    asked for ("tf32x3"), and the default for 16-bit inputs whatever is asked."""
    from jaxtdist.ops._protocol import Call
    seen = []
    launch = Call.launch

    def record(self, kernel, *args, **kwargs):
        if "DOT_PRECISION" in kernel.arg_names:
            seen.append((kernel.__name__, kwargs["DOT_PRECISION"]))
        return launch(self, kernel, *args, **kwargs)

    monkeypatch.setattr(Call, "launch", record)
    mesh = setup(2)
    sizes = jnp.array([3, 5], jnp.int32)
    calls = {
        "ag_matmul": (lambda x, w: td.ag_matmul(x, w, "tp"), (P("tp"), P()), P("tp")),
        "matmul_rs": (lambda x, w: td.matmul_rs(x, w, "tp"), (X_SPEC, W_SPEC), P("tp")),
        "matmul_ar": (lambda x, w: td.matmul_ar(x, w, "tp"), (X_SPEC, W_SPEC), P()),
        "grouped": (lambda x, w: td.grouped_matmul(x, w.reshape(2, 16, 16), sizes),
                    (P(), P()), P()),
    }
    for precision, dtype, want in ((None, F32, None), ("highest", F32, "tf32x3"),
                                   ("float32", F32, "tf32x3"), ("tensorfloat32", F32, None),
                                   ("highest", BF16, None)):
        for name, (fn, in_specs, out_spec) in calls.items():
            del seen[:]
            f = jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_spec,
                              check_vma=False)
            x, w = jnp.zeros((8, 16), dtype), jnp.zeros((32, 16), dtype)
            with jax.default_matmul_precision(precision):
                jax.eval_shape(f, x, w if name == "grouped" else w[:16])
            assert seen and all(p == want for _, p in seen), (precision, dtype, name, seen)


def test_tf32_rounding_of_kernel_operands():
    """The "tf32_rn" default on NVIDIA GPUs: XLA rounds a TMA GEMM's operands (to
    nearest, ties away from zero, on 10 mantissa bits; infinities and NaNs kept):
    w always, x unless its exact values must stay (the kernel then rounds A,
    "tf32_rn_a"); pointer GEMMs round in the kernel; w handed over K-major on
    request; other precisions, dtypes and the interpreter leave the operands alone."""
    from jaxtdist.ops._precision import kernel_operands, round_to_tf32
    x = rand((64, 48), F32)
    bits = np.asarray(x).view(np.uint32).astype(np.int64)
    magnitude = bits & 0x7FFFFFFF
    want = ((bits & 0x80000000) | (((magnitude + 0x1000) >> 13) << 13)).astype(np.uint32)
    assert (np.asarray(round_to_tf32(x)).view(np.uint32) == want).all()
    special = np.array([np.inf, -np.inf, np.nan, 0.0, -0.0, 1 + 2**-11, -1 - 2**-11,
                        1 + 2**-12], np.float32)
    np.testing.assert_array_equal(np.asarray(round_to_tf32(special)),
                                  [np.inf, -np.inf, np.nan, 0.0, -0.0, 1 + 2**-10,
                                   -1 - 2**-10, 1.0])
    w = rand((48, 32), F32)
    gpu = Problem("gpu", 1, (64, 32, 48), "float32", 132)
    rx, rw, precision = kernel_operands(gpu, x, w, tma=True)
    assert precision is None and (rx == round_to_tf32(x)).all()
    assert (rw == round_to_tf32(w)).all()
    rx, rw, precision = kernel_operands(gpu, x, w, tma=True, exact_x=True, k_major=True)
    assert precision == "tf32_rn_a" and (rx == x).all() and (rw == round_to_tf32(w).T).all()
    rx, rw, precision = kernel_operands(gpu, x, w, tma=False)
    assert precision == "tf32_rn" and (rx == x).all() and (rw == w).all()
    with jax.default_matmul_precision("highest"):
        rx, rw, precision = kernel_operands(gpu, x, w, tma=True, k_major=True)
    assert precision == "tf32x3" and (rx == x).all() and (rw == w.T).all()
    cpu = Problem("cpu", 1, (64, 32, 48), "float32", 4)
    amd = Problem("gpu", 1, (64, 32, 48), "float32", 304, vendor="amd")
    bf16 = Problem("gpu", 1, (64, 32, 48), "bfloat16", 132)
    for problem, a, b in ((cpu, x, w), (amd, x, w),
                          (bf16, x.astype(BF16), w.astype(BF16))):
        rx, rw, precision = kernel_operands(problem, a, b, tma=True)
        assert precision is None and (rx == a).all() and (rw == b).all(), problem
