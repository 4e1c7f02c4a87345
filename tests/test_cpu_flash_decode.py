"""jaxtdist.flash_decode on CPU devices (Triton interpreter), against a float64
reference: softmax attention over the whole gathered sequence."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxtdist as td
from jaxtdist.ops._op import DistributedOp
from tests.conftest import TOL, cpu_only, place, rand, setup, slow

pytestmark = cpu_only()

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
SPECS = (P(), P(None, "sp"), P(None, "sp"), P())


def _reference(q, k, v, kv_len) -> np.ndarray:
    """float64 decode attention over the gathered cache; zeros where kv_len == 0."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    b, hq, d = q.shape
    s, hkv = k.shape[1], k.shape[2]
    qg = q.reshape(b, hkv, hq // hkv, d)
    scores = np.einsum("bhgd,bshd->bhgs", qg, k) / np.sqrt(d)
    valid = np.arange(s)[None, :] < np.asarray(kv_len)[:, None]
    scores = np.where(valid[:, None, None, :], scores, -np.inf)
    m = scores.max(-1, keepdims=True)
    p = np.exp(scores - np.where(np.isfinite(m), m, 0.0))
    l = p.sum(-1, keepdims=True)
    o = np.einsum("bhgs,bshd->bhgd", p, v) / np.where(l > 0, l, 1.0)
    return o.reshape(b, hq, d)


def _rel(out, ref) -> float:
    out = np.asarray(out, np.float64)
    assert np.all(np.isfinite(out)), "non-finite output"
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def _decode_fn(mesh, config=None, kernels=False, axis="sp"):
    op = td.ops.flash_decode_kernels if kernels else td.flash_decode
    return jax.jit(jax.shard_map(lambda q, k, v, n: op(q, k, v, n, axis, config=config),
                                 mesh=mesh, in_specs=SPECS, out_specs=P()))


def _operands(mesh, world, b, hq, hkv, d, s_shard, dtype):
    q = rand((b, hq, d), dtype)
    k = rand((b, world * s_shard, hkv, d), dtype)
    v = rand((b, world * s_shard, hkv, d), dtype)
    placed = (place(mesh, q, P()), place(mesh, k, P(None, "sp")), place(mesh, v, P(None, "sp")))
    return (q, k, v), placed


# (world, dtype, B, Hq, Hkv, D, S_shard): every world, GQA ratios 1, 4 and 8, head
# dims 64 and 128, odd S_shard (no multiple of BLOCK_N), every dtype.
CASES = [(2, F32, 2, 4, 4, 64, 37), (2, BF16, 1, 8, 2, 128, 21),
         (4, F32, 3, 8, 2, 128, 13), (4, F16, 2, 8, 1, 64, 9),
         (8, F32, 2, 8, 1, 64, 5)]


@pytest.mark.parametrize("world,dtype,b,hq,hkv,d,s_shard", CASES)
def test_flash_decode(world, dtype, b, hq, hkv, d, s_shard):
    mesh = setup(world, ("sp",))
    f = _decode_fn(mesh)
    total = world * s_shard
    rng = np.random.default_rng(world * 100 + d)
    for call in range(2):  # a second call: the other inbox parity
        (q, k, v), placed = _operands(mesh, world, b, hq, hkv, d, s_shard, dtype)
        # Ragged lengths: all of the cache, one inside rank 0's positions only
        # (every other rank holds none valid), and a random one.
        lens = np.array([total, max(1, s_shard // 2), int(rng.integers(1, total + 1))][:b],
                        np.int32)
        if call:
            lens = lens[::-1].copy()
        out = f(*placed, place(mesh, lens, P()))
        assert out.dtype == jnp.dtype(dtype) and out.shape == (b, hq, d)
        assert _rel(out, _reference(q, k, v, lens)) < TOL[jnp.dtype(dtype)]


def test_flash_decode_same_bits_on_every_rank():
    """Every rank merges the same partials in the same order: identical outputs."""
    world = 4
    mesh = setup(world, ("sp",))
    f = jax.jit(jax.shard_map(lambda q, k, v, n: td.flash_decode(q, k, v, n, "sp")[None],
                              mesh=mesh, in_specs=SPECS, out_specs=P("sp"), check_vma=False))
    (q, k, v), placed = _operands(mesh, world, 2, 8, 2, 64, 11, F32)
    lens = np.array([40, 17], np.int32)
    out = np.asarray(f(*placed, place(mesh, lens, P())))
    for r in range(1, world):
        np.testing.assert_array_equal(out[r], out[0])
    assert _rel(out[0], _reference(q, k, v, lens)) < 1e-5


@pytest.mark.parametrize("world", [1, 2])
def test_flash_decode_kernel_traces_its_phases(world):
    """trace=True: the same output, plus each program's clock stamps (the probes'
    view): start and split done for every program, in order; a group's last
    program also stamps its merge, pushes, peers' merge and store, in order (at
    world 1, which skips the exchange, its two stamps too)."""
    b, hq, hkv, d, s_shard = 1, 4, 2, 64, 40
    cfg = dict(NUM_SPLITS=2)
    mesh = setup(world, ("sp",))

    def body(q, k, v, n):
        out_t, stamps = td.ops.flash_decode_kernels(q, k, v, n, "sp", config=cfg, trace=True)
        return td.ops.flash_decode_kernels(q, k, v, n, "sp", config=cfg), out_t, stamps[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=SPECS,
                              out_specs=(P(), P(), P("sp")), check_vma=False))
    (q, k, v), placed = _operands(mesh, world, b, hq, hkv, d, s_shard, F32)
    lens = np.array([world * s_shard - 3], np.int32)
    out, out_t, stamps = (np.asarray(a) for a in f(*placed, place(mesh, lens, P())))
    np.testing.assert_array_equal(out, out_t)
    assert _rel(out_t, _reference(q, k, v, lens)) < TOL[jnp.dtype(F32)]
    programs = b * hkv * cfg["NUM_SPLITS"]
    assert stamps.shape == (world, programs, 6)
    stamps = stamps.astype(np.int64)

    def ordered(cols):  # non-decreasing modulo 2**32 along the last axis
        return bool(((np.diff(cols, axis=-1) % (1 << 32)) < (1 << 31)).all())

    assert ordered(stamps[..., :2]), stamps
    # Under the interpreter programs run in grid order: the last split of each group
    # is its merger.
    by_group = stamps.reshape(world, b * hkv, cfg["NUM_SPLITS"], 6)
    last = by_group[:, :, -1]
    assert ordered(last), last
    assert (by_group[:, :, :-1, 2:] == 0).all(), by_group  # only mergers stamp the rest
    with pytest.raises(ValueError, match="trace"):
        td.ops.flash_decode_kernels(*placed, place(mesh, lens, P()), "sp", trace=1)


@pytest.mark.parametrize("precision", ["default", "highest"])
def test_flash_decode_float32_under_each_matmul_precision(precision):
    """float32 follows jax.default_matmul_precision (TF32 on GPUs by default,
    tf32x3 under "highest"); the interpreter multiplies exactly either way."""
    mesh = setup(2, ("sp",))
    (q, k, v), placed = _operands(mesh, 2, 2, 4, 2, 64, 13, F32)
    lens = np.array([26, 9], np.int32)
    with jax.default_matmul_precision(precision):
        out = _decode_fn(mesh, kernels=True)(*placed, place(mesh, lens, P()))
    assert _rel(out, _reference(q, k, v, lens)) < TOL[jnp.dtype(F32)]


def test_flash_decode_empty_sequence_gives_zeros():
    world = 2
    mesh = setup(world, ("sp",))
    (q, k, v), placed = _operands(mesh, world, 2, 4, 1, 64, 7, F32)
    lens = np.array([0, 9], np.int32)
    out = np.asarray(_decode_fn(mesh)(*placed, place(mesh, lens, P())))
    np.testing.assert_array_equal(out[0], 0.0)
    assert _rel(out[1], _reference(q, k, v, lens)[1]) < 1e-5


def test_flash_decode_chained_decode_steps():
    """Reuse races: 50 decode steps (5 per jit call, each step's query built from the
    previous step's output plus fresh data, the length growing by one per step), on
    changing caches, with 3 splits per rank (both merge stages busy)."""
    world, b, hq, hkv, d, s_shard, steps = 4, 2, 4, 1, 64, 6, 5
    mesh = setup(world, ("sp",))
    config = dict(NUM_SPLITS=3)

    def chain(q, k, v, qs, n0):
        outs = []
        for i in range(steps):
            q = td.flash_decode(q * 0.5 + qs[i], k, v, n0 + i, "sp", config=config)
            outs.append(q)
        return jnp.stack(outs)

    f = jax.jit(jax.shard_map(chain, mesh=mesh, in_specs=SPECS[:3] + (P(), P()),
                              out_specs=P()))
    for call in range(10):
        (q, k, v), placed = _operands(mesh, world, b, hq, hkv, d, s_shard, F32)
        qs = rand((steps, b, hq, d))
        n0 = np.array([1 + 2 * call, world * s_shard - steps - call], np.int32)
        out = np.asarray(f(*placed, place(mesh, qs, P()), place(mesh, n0, P())))
        expect = np.asarray(q, np.float64)
        for i in range(steps):
            expect = _reference(expect * 0.5 + qs[i], k, v, n0 + i)
            assert _rel(out[i], expect) < 1e-5, (call, i)


def test_flash_decode_world_1():
    """A group of one rank is plain JAX; flash_decode_kernels runs the kernel there."""
    mesh = setup((1, 8), ("sp", "dp"))
    q, k, v = rand((1, 8, 64)), rand((1, 19, 2, 64)), rand((1, 19, 2, 64))
    lens = np.array([15], np.int32)
    ref = _reference(q, k, v, lens)
    for kernels in (False, True):
        f = jax.jit(jax.shard_map(
            lambda q, k, v, n, kernels=kernels: (td.ops.flash_decode_kernels if kernels
                                                 else td.flash_decode)(q, k, v, n, "sp"),
            mesh=mesh, in_specs=(P(),) * 4, out_specs=P()))
        assert _rel(f(q, k, v, lens), ref) < 1e-5


def test_flash_decode_sharded_over_a_submesh():
    """The pjit-style wrapper: batch over "dp", positions over "sp" (2 x 4 mesh)."""
    mesh = setup((2, 4), ("dp", "sp"))
    b, hq, hkv, d, s = 4, 4, 2, 64, 4 * 5
    q, k, v = rand((b, hq, d)), rand((b, s, hkv, d)), rand((b, s, hkv, d))
    lens = np.array([s, 3, 11, 20], np.int32)
    out = jax.jit(lambda *a: td.flash_decode_sharded(*a, axis_name="sp", batch_axes="dp"))(
        place(mesh, q, P("dp")), place(mesh, k, P("dp", "sp")), place(mesh, v, P("dp", "sp")),
        place(mesh, lens, P("dp")))
    assert _rel(out, _reference(q, k, v, lens)) < 1e-5


def _decode_module():
    # (``jaxtdist.ops.flash_decode`` is the function: the package re-exports it.)
    import importlib
    return importlib.import_module("jaxtdist.ops.flash_decode")


def test_flash_decode_kernels_at_world_1_only_on_gpus():
    """The kernel forward with the local VJP is taken at world 1 on GPUs only: off
    GPUs (the slow interpreter) a group of one rank runs the local computation."""
    import types

    fd = _decode_module()
    setup(1, ("sp",))
    assert fd._FLASH_DECODE.local_applies(types.SimpleNamespace(platform="gpu")) is False
    assert fd._FLASH_DECODE.local_applies(fd.runtime()) is True


@pytest.mark.parametrize("paged,dtype", [(True, F32), (False, BF16)])
def test_flash_decode_kernel_at_world_1_is_differentiable(monkeypatch, paged, dtype):
    """At world 1 on GPUs (forced here) the forward is the kernel (flash_decode_kernels'
    bits) and the backward the VJP of the plain-JAX local computation: q, k and v's
    gradients are the plain path's, under jit + shard_map and under jax.vmap, with a
    0 length and NaN / inf past the lengths (never read forward, masked backward)."""
    fd = _decode_module()
    mesh = setup(1, ("sp",))
    b, hq, hkv, d, s, page = 3, 4, 2, 16, 24, 8
    lens = np.array([0, page + 3, s - 5], np.int32)
    q, w = rand((b, hq, d), dtype), rand((2, b, hq, d))
    k, v = np.array(rand((b, s, hkv, d), dtype)), np.array(rand((b, s, hkv, d), dtype))
    # vmap's two problems: these operands, and them halved.
    refs = [_reference(q * f, k * f, v * f, lens) for f in (1.0, 0.5)]
    for i, n in enumerate(lens):  # stale slots past the length
        k[i, n:], v[i, n:] = np.nan, np.inf
    table = ()
    if paged:
        k, v, t = _paginate(k, v, 1, page, 2, seed=int(lens[1]))
        for i, n in enumerate(lens):  # junk ids past the length: never read
            t[i, -(-n // page):] = -1 if i % 2 else 1 << 30
        table = (t,)
    args = [place(mesh, jnp.asarray(a, dtype), P()) for a in (q, k, v)]
    args += [place(mesh, a, P()) for a in (lens,) + table]
    in_axes = (0, 0, 0, None) + (None,) * len(table)

    def op(fn):
        def call(q, k, v, n, *t):
            # The cache typed as sharded over "sp" (as with in_specs P(None, "sp")).
            k, v = (jax.lax.pcast(a, ("sp",), to="varying") for a in (k, v))
            return fn(q, k, v, n, "sp", block_table=t[0] if t else None)
        return call

    def halved(*a):  # vmap's operands: q, k and v batched, lengths and table shared
        return [jnp.stack([x, x * 0.5]) if ax == 0 else x for x, ax in zip(a, in_axes)]

    def forwards(*a):
        return (op(td.flash_decode)(*a), op(td.ops.flash_decode_kernels)(*a),
                jax.vmap(op(td.flash_decode), in_axes=in_axes)(*halved(*a)))

    def loss(i):
        def f(*a):
            out = op(td.flash_decode)(*a)
            return jnp.sum(out.astype(F32) * w[i]), out
        return jax.grad(f, argnums=(0, 1, 2), has_aux=True)

    def grads(*a):
        return loss(0)(*a), jax.vmap(loss(1), in_axes=in_axes)(*halved(*a))

    def run(kernels, fn):
        # Traced (and run) while the choice is patched in: flash_decode reads it then.
        monkeypatch.setattr(DistributedOp, "local_applies", lambda self, rt: not kernels)
        return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P(), out_specs=P()))(*args)

    f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731
    tol = TOL[jnp.dtype(dtype)]
    out, kernel_out, outs = run(True, forwards)  # no gradient: the primal pass
    assert out.dtype == jnp.dtype(dtype) and _rel(out, refs[0]) < tol
    np.testing.assert_array_equal(f32(out), f32(kernel_out))
    np.testing.assert_array_equal(f32(out[0]), 0.0)  # length 0
    np.testing.assert_array_equal(f32(outs[0]), f32(out))
    assert _rel(outs[1], refs[1]) < tol
    (got, got_out), (got_v, got_v_out) = run(True, grads)
    np.testing.assert_array_equal(f32(got_out), f32(out))  # the forward with residuals
    np.testing.assert_array_equal(f32(got_v_out), f32(outs))
    (want, _), (want_v, _) = run(False, grads)  # the plain-JAX local computation
    close = dict(rtol=1e-6, atol=1e-6) if dtype == F32 else dict(rtol=2e-2, atol=2e-2)
    for name, g, r in zip(["dq", "dk", "dv"] * 2, got + got_v, want + want_v):
        assert np.all(np.isfinite(f32(g))), name
        np.testing.assert_allclose(f32(g), f32(r), err_msg=name, **close)
    assert np.any(f32(got[0]) != 0) and np.any(f32(got_v[0][1]) != 0)


def test_flash_decode_is_not_differentiable():
    mesh = setup(2, ("sp",))
    (_, _, _), placed = _operands(mesh, 2, 1, 4, 1, 64, 4, F32)
    lens = place(mesh, np.array([5], np.int32), P())
    f = jax.jit(jax.shard_map(
        lambda q, k, v, n: jax.grad(lambda q: td.flash_decode(q, k, v, n, "sp").sum())(q),
        mesh=mesh, in_specs=SPECS, out_specs=P()))
    # Over W = 2 ranks; at world 1 it is (its docstring says so, and the message sends there).
    with pytest.raises(TypeError, match="flash_decode is not differentiable here .its "
                                        "docstring says where it is"):
        f(*placed, lens)


@pytest.mark.parametrize("splits", [1, 3, pytest.param(4, marks=slow())])
def test_flash_decode_steps_interleaved_over_the_programs(splits):
    """Each program takes every NUM_SPLITS-th step of the valid positions: right for
    lengths that fill the cache, part of one rank's shard (fewer steps than
    programs, some programs with none) or none of it, over chained calls."""
    world, b, hq, hkv, d, s_shard = 2, 3, 4, 2, 64, 150
    mesh = setup(world, ("sp",))
    f = _decode_fn(mesh, dict(BLOCK_N=16, NUM_SPLITS=splits), kernels=True)
    rng = np.random.default_rng(40 + splits)
    for call in range(3):
        (q, k, v), placed = _operands(mesh, world, b, hq, hkv, d, s_shard, F32)
        lens = np.array([world * s_shard, int(rng.integers(1, 40)),
                         s_shard + int(rng.integers(1, s_shard))], np.int32)
        lens = np.roll(lens, call)
        out = f(*placed, place(mesh, lens, P()))
        assert _rel(out, _reference(q, k, v, lens)) < 1e-5


def test_flash_decode_errors():
    mesh = setup(2, ("sp",))
    q, k = np.zeros((1, 4, 64), np.float32), np.zeros((1, 8, 2, 64), np.float32)
    n = np.array([3], np.int32)

    def run(q, k, v, n, config=None, axis="sp"):
        return _decode_fn(mesh, config, axis=axis)(
            place(mesh, q, P()), place(mesh, k, P(None, "sp")), place(mesh, v, P(None, "sp")),
            place(mesh, n, P()))

    with pytest.raises(ValueError, match=r"expected q \[B, Hq, D\]"):
        run(q[0], k, k, n)
    with pytest.raises(ValueError, match="must be a multiple of Hkv=2"):
        run(np.zeros((1, 3, 64), np.float32), k, k, n)
    with pytest.raises(ValueError, match="disagree on the batch B or the head dim D"):
        run(np.zeros((1, 4, 32), np.float32), k, k, n)
    with pytest.raises(ValueError, match="must share a dtype"):
        run(q, k, k.astype(np.float16), n)
    with pytest.raises(ValueError, match=r"kv_len must be an integer array of shape \(B,\)"):
        run(q, k, k, np.array([3.0], np.float32))
    with pytest.raises(ValueError, match="supported dtypes"):
        run(q.astype(np.int32), k.astype(np.int32), k.astype(np.int32), n)
    with pytest.raises(ValueError, match="BLOCK_N=24 must be a power of 2"):
        run(q, k, k, n, config=dict(BLOCK_N=24))
    with pytest.raises(ValueError, match="unknown config keys"):
        run(q, k, k, n, config=dict(SPLITS=2))
    with pytest.raises(ValueError, match="not an axis|axis"):
        run(q, k, k, n, axis="tp")


def _wall_us(fn, args, world, iterations):
    import time

    jax.block_until_ready(fn(*args))
    t = time.perf_counter()
    for _ in range(iterations):
        jax.block_until_ready(fn(*args))
    return (time.perf_counter() - t) / iterations * 1e6


def test_flash_decode_tunes_with_an_explicit_measure():
    setup(2, ("sp",))
    result = td.tune.tune("flash_decode", (1, 4, 1, 64, 20), jnp.float32, axis_name="sp",
                          candidates=[{}, dict(NUM_SPLITS=1)], iterations=1, measure=_wall_us)
    assert len(result["tried"]) == 2 and all("us" in r for r in result["tried"])
    assert result["variant"] == "split_kv_push"


@pytest.mark.parametrize("dtype,b,hkv,d,s_shard,block_n,splits", [
    ("bfloat16", 1, 8, 128, 32768, 128, 16),   # one program per SM (132 SMs)
    ("bfloat16", 1, 8, 128, 4096, 128, 8),     # at least 512 positions a split
    ("bfloat16", 4, 8, 128, 131072, 128, 4),
    ("bfloat16", 32, 8, 128, 8192, 128, 1),    # more groups than SMs
    ("float16", 1, 8, 256, 32768, 64, 16),     # 128-position tiles would not fit
    ("float32", 1, 8, 128, 32768, 64, 16),
    ("float32", 1, 8, 256, 32768, 32, 16),     # 64-position tiles would not fit either
    ("float32", 1, 8, 160, 32768, 32, 16),     # head dim padded to 256
])
def test_flash_decode_gpu_default(dtype, b, hkv, d, s_shard, block_n, splits):
    """The GPU default: 128-position steps where two stages of K and V tiles fit,
    else the widest that fits an SM, one program per SM (no second wave), chunks
    of at least 512 positions; it always passes its own check."""
    from jaxtdist.ops._config import Problem
    from jaxtdist.ops.flash_decode import FlashDecodeConfig

    problem = Problem("gpu", 4, (b, 4 * hkv, hkv, d, s_shard), dtype, sms=132)
    cfg = FlashDecodeConfig.default(problem)
    assert (cfg.BLOCK_N, cfg.splits(problem)) == (block_n, splits)
    cfg.validate(problem)
    amd = Problem("gpu", 4, (b, 4 * hkv, hkv, d, s_shard), dtype, sms=304, vendor="amd")
    assert FlashDecodeConfig.default(amd).BLOCK_N == 64


@pytest.mark.parametrize("hq,rows", [(32, 1), (128, 4), (256, 8)])
def test_flash_decode_workspace_holds_the_real_query_rows(hq, rows):
    """Partials and inbox slots hold the group's query rows padded to a power of 2,
    not the dot's 16-row tile: plain multi-head attention (one row per KV head)
    at B = 128 over 8 ranks needs 67 MiB, not the 1065 MiB (more than the default
    GPU heap) that 16-row slots took."""
    from jaxtdist.ops._config import Problem
    from jaxtdist.ops.flash_decode import DecodeWorkspace, FlashDecodeConfig

    b, hkv, d, world = 128, 32, 128, 8
    problem = Problem("gpu", world, (b, hq, hkv, d, 4096), "bfloat16", sms=132)
    splits = FlashDecodeConfig.default(problem).splits(problem)
    plan = DecodeWorkspace(world, b * hkv, splits, hq // hkv, d)
    assert plan.rows == rows
    # o and lse of every partial (float32), the counters, two inbox parities of
    # tagged (8-byte) o, lse and lengths: nothing sized by a 16-row tile.
    needed = (b * hkv * splits * rows * (d + 1) * 4 + b * hkv * 4
              + 2 * world * b * hkv * (rows * (d + 1) + 1) * 8)
    assert needed <= plan.nbytes < needed + (64 << 10)
    if rows == 1:
        assert plan.nbytes < 68 << 20


def test_flash_decode_config_of_numpy_integers():
    """Config values read from arrays (NumPy integers) reach the kernel as ints:
    the same output as the same config in Python ints (was a TypeError inside
    the kernel after the config had passed its check)."""
    world = 2
    mesh = setup(world, ("sp",))
    (q, k, v), placed = _operands(mesh, world, 2, 8, 2, 64, 40, F32)
    lens = place(mesh, np.array([70, 23], np.int32), P())
    outs = [np.asarray(_decode_fn(mesh, cfg)(*placed, lens))
            for cfg in (dict(BLOCK_N=16, NUM_SPLITS=2),
                        dict(BLOCK_N=np.int64(16), NUM_SPLITS=np.int32(2),
                             num_warps=np.int64(4)))]
    np.testing.assert_array_equal(outs[0], outs[1])
    assert _rel(outs[0], _reference(q, k, v, np.array([70, 23], np.int32))) < 1e-5


@pytest.mark.parametrize("paged", [False, True])
def test_flash_decode_config_is_checked_at_world_1(paged):
    """World 1 on CPU runs the local computation, which uses no config; a bad one
    is still refused there (as at world > 1 and on GPUs), a good one changes nothing."""
    mesh = setup(1, ("sp",))
    (q, k, v), placed = _operands(mesh, 1, 2, 8, 2, 64, 40, F32)
    lens = place(mesh, np.array([40, 23], np.int32), P())
    if paged:
        table = place(mesh, np.arange(2 * 5, dtype=np.int32).reshape(2, 5), P())
        pools = tuple(place(mesh, np.asarray(a).reshape(10, 8, 2, 64), P()) for a in (k, v))

        def fn(config):
            return jax.jit(jax.shard_map(
                lambda q, k, v, n, t: td.flash_decode(q, k, v, n, "sp", block_table=t,
                                                      config=config),
                mesh=mesh, in_specs=(P(),) * 5, out_specs=P()))
        args = (placed[0], *pools, lens, table)
    else:
        def fn(config):
            return _decode_fn(mesh, config)
        args = (*placed, lens)
    with pytest.raises(ValueError, match=r"BLOCK_N=24 must be a power of 2"):
        fn(dict(BLOCK_N=24))(*args)
    with pytest.raises(ValueError, match=r"NUM_SPLITS"):
        fn(dict(NUM_SPLITS=-1))(*args)
    out = np.asarray(fn(dict(BLOCK_N=32, NUM_SPLITS=2))(*args))
    np.testing.assert_array_equal(out, np.asarray(fn(None)(*args)))
    assert _rel(out, _reference(q, k, v, np.array([40, 23], np.int32))) < 1e-5


def test_flash_decode_config_beyond_shared_memory_is_refused():
    from jaxtdist.ops._config import Problem
    from jaxtdist.ops.flash_decode import FlashDecodeConfig

    problem = Problem("gpu", 2, (1, 32, 8, 256, 32768), "bfloat16")
    with pytest.raises(ValueError, match=r"BLOCK_N=128, num_stages=3 keeps 256 KiB .*head dim "
                                         r"256, bfloat16.* lower BLOCK_N or num_stages"):
        FlashDecodeConfig(BLOCK_N=128, num_stages=3).validate(problem)
    FlashDecodeConfig(BLOCK_N=128, num_stages=2).validate(problem)
    # The tuner never offers such a candidate.
    tried = [FlashDecodeConfig.settle(FlashDecodeConfig.default(problem), o)
             for o in FlashDecodeConfig.search_space(problem)]
    assert tried and all((c.num_stages - 1) * c.BLOCK_N <= 227 for c in tried)  # x 1 KiB
    assert any(c.BLOCK_N == 128 for c in tried)
    FlashDecodeConfig(BLOCK_N=128, num_stages=3).validate(Problem("cpu", 2, problem.shape,
                                                                  "bfloat16"))


def _paginate(k, v, world: int, page: int, spare: int, seed: int):
    """Each rank's positions of k, v [B, world * S_shard, Hkv, D] as its own page pools
    (``paged_cache``: shuffled, with spare pages), stacked over the ranks; the block
    tables side by side ([B, world * pages]: rank r's columns index its own pool)."""
    from jaxtdist.bench.flash_decode import paged_cache

    s_shard = k.shape[1] // world
    ranks = [slice(r * s_shard, (r + 1) * s_shard) for r in range(world)]
    k_pools, v_pools, tables = zip(*(paged_cache(k[:, r], v[:, r], page, spare, seed + i)
                                     for i, r in enumerate(ranks)))
    return (np.concatenate([np.asarray(a) for a in k_pools]),
            np.concatenate([np.asarray(a) for a in v_pools]),
            np.concatenate([np.asarray(a) for a in tables], axis=1))


@pytest.mark.parametrize("world,dtype,b,hq,hkv,d,s_shard,page", [
    (1, F32, 2, 4, 2, 64, 24, 8), (2, F32, 2, 8, 2, 64, 32, 16), (4, BF16, 3, 8, 1, 64, 12, 4)])
def test_flash_decode_paged(world, dtype, b, hq, hkv, d, s_shard, page):
    """A paged cache (block_table): the same output as the contiguous cache it holds,
    bit for bit on the kernels' path, and the reference's within tolerance; pages
    past a sequence's length may hold any id (never read); ids are data."""
    mesh = setup(world, ("sp",))
    rng = np.random.default_rng(world * 7 + page)
    q = rand((b, hq, d), dtype)
    k = np.asarray(rand((b, world * s_shard, hkv, d), dtype))
    v = np.asarray(rand((b, world * s_shard, hkv, d), dtype))
    k_pool, v_pool, table = _paginate(k, v, world, page, 3, world * 7 + page)
    total = world * s_shard
    lens = np.array([total, page + 1, int(rng.integers(1, total))][:b], np.int32)
    # Past its length, a sequence's table holds junk (-1 and huge ids): never read.
    for i, n in enumerate(lens):
        for r in range(world):
            first_unused = -(-max(0, n - r * s_shard) // page)
            cols = slice(r * (s_shard // page) + first_unused, (r + 1) * (s_shard // page))
            table[i, cols] = rng.choice([-1, 1 << 30], size=table[i, cols].shape)
    paged = jax.jit(jax.shard_map(
        lambda q, k, v, n, t: td.flash_decode(q, k, v, n, "sp", block_table=t), mesh=mesh,
        in_specs=(P(), P("sp"), P("sp"), P(), P(None, "sp")), out_specs=P()))
    out = paged(place(mesh, q, P()), place(mesh, jnp.asarray(k_pool, dtype), P("sp")),
                place(mesh, jnp.asarray(v_pool, dtype), P("sp")), place(mesh, lens, P()),
                place(mesh, table, P(None, "sp")))
    contiguous = _decode_fn(mesh)(
        place(mesh, q, P()), place(mesh, jnp.asarray(k), P(None, "sp")),
        place(mesh, jnp.asarray(v), P(None, "sp")), place(mesh, lens, P()))
    assert out.dtype == jnp.dtype(dtype) and out.shape == (b, hq, d)
    assert _rel(out, _reference(q, k, v, lens)) < TOL[jnp.dtype(dtype)]
    if world > 1:  # the kernels' path: the same blocks in the same order
        np.testing.assert_array_equal(np.asarray(out, np.float32),
                                      np.asarray(contiguous, np.float32))


def test_flash_decode_paged_errors():
    mesh = setup(2, ("sp",))
    q, pool = rand((2, 4, 64)), rand((2 * 6, 4, 2, 64))
    lens = np.array([8, 8], np.int32)

    def call(k, v, table):
        return jax.jit(jax.shard_map(
            lambda q, k, v, n, t: td.flash_decode(q, k, v, n, "sp", block_table=t), mesh=mesh,
            in_specs=(P(), P("sp"), P("sp"), P(), P(None, "sp")), out_specs=P()))(
            q, k, v, lens, table)

    with pytest.raises(ValueError, match="block_table must be .B, pages. with B = 2"):
        call(pool, pool, np.zeros((3, 4), np.int32))
    with pytest.raises(ValueError, match="block_table has dtype float32"):
        call(pool, pool, np.zeros((2, 4), np.float32))
    with pytest.raises(ValueError, match="must be paged .num_pages, page, Hkv, D."):
        call(rand((2 * 6, 4, 64)), rand((2 * 6, 4, 64)), np.zeros((2, 4), np.int32))
    with pytest.raises(ValueError, match="page pools"):
        call(pool, rand((2 * 5, 4, 2, 64)), np.zeros((2, 4), np.int32))


def _paginate_sharded(k, v, batches: int, world: int, page: int, spare: int, seed: int):
    """flash_decode_sharded's paged layout of k, v [B, world * S_shard, Hkv, D] over
    batches x world devices: the pools of device (d, r) stacked at block d * world + r,
    the block table [B, world * pages] (batch block d's rows, rank r's columns)."""
    bb = k.shape[0] // batches
    parts = [_paginate(k[d * bb:(d + 1) * bb], v[d * bb:(d + 1) * bb], world, page, spare,
                       seed + 10 * d) for d in range(batches)]
    k_pools, v_pools, tables = zip(*parts)
    return np.concatenate(k_pools), np.concatenate(v_pools), np.concatenate(tables)


@pytest.mark.parametrize("shape,names,batch,b,s_shard,page", [
    ((2,), ("sp",), (), 2, 16, 8),
    ((2, 2), ("dp", "sp"), ("dp",), 4, 8, 4)])
def test_flash_decode_sharded_paged(shape, names, batch, b, s_shard, page):
    """flash_decode_sharded(..., block_table=): pools' pages over (*batch_axes, sp),
    the table's batch over batch_axes and columns over sp. The contiguous wrapper's
    output on the cache it holds, bit for bit, and the reference's; junk ids past
    a sequence's length are never read."""
    mesh = setup(shape, names)
    batches, world = int(np.prod(shape[:-1])), shape[-1]
    hq, hkv, d = 4, 2, 64
    total = world * s_shard
    rng = np.random.default_rng(world * 3 + b)
    q = rand((b, hq, d))
    k, v = rand((b, total, hkv, d)), rand((b, total, hkv, d))
    k_pool, v_pool, table = _paginate_sharded(k, v, batches, world, page, 2, b)
    lens = np.array([total, page + 1, 3, total - 1][:b], np.int32)
    for i, n in enumerate(lens):  # past its length, a sequence's table holds junk
        for r in range(world):
            first_unused = -(-max(0, n - r * s_shard) // page)
            cols = slice(r * (s_shard // page) + first_unused, (r + 1) * (s_shard // page))
            table[i, cols] = rng.choice([-1, 1 << 30], size=table[i, cols].shape)
    bspec = P(batch[0] if batch else None)  # q, kv_len, the result: batch over dp
    kv = P(bspec[0], "sp")                   # k, v and the table: and positions over sp
    pages = P(tuple(batch) + ("sp",))        # the pools: pages over (*batch_axes, sp)
    paged = jax.jit(lambda *a: td.flash_decode_sharded(*a[:4], axis_name="sp",
                                                       batch_axes=batch, block_table=a[4]))
    out = paged(place(mesh, q, bspec), place(mesh, k_pool, pages), place(mesh, v_pool, pages),
                place(mesh, lens, bspec), place(mesh, table, kv))
    contiguous = jax.jit(lambda *a: td.flash_decode_sharded(*a, axis_name="sp",
                                                            batch_axes=batch))(
        place(mesh, q, bspec), place(mesh, k, kv), place(mesh, v, kv), place(mesh, lens, bspec))
    assert out.shape == (b, hq, d) and out.sharding.is_equivalent_to(
        jax.sharding.NamedSharding(mesh, bspec), 3)
    assert _rel(out, _reference(q, k, v, lens)) < 1e-5
    np.testing.assert_array_equal(np.asarray(out), np.asarray(contiguous))


def test_flash_decode_sharded_paged_errors():
    setup((2, 2), ("dp", "sp"))
    q, pool, lens = rand((2, 4, 64)), rand((4 * 3, 4, 2, 64)), np.array([8, 8], np.int32)

    def call(q=q, k=pool, v=pool, table=np.zeros((2, 4), np.int32)):
        return td.flash_decode_sharded(q, k, v, lens[:q.shape[0]], axis_name="sp",
                                       batch_axes="dp", block_table=table)

    with pytest.raises(ValueError, match=r"flash_decode_sharded: the batch B=3 is not a "
                                         r"multiple of the 2 devices of batch_axes \(dp=2\)"):
        call(q=rand((3, 4, 64)), table=np.zeros((3, 4), np.int32))
    with pytest.raises(ValueError, match=r"k must be the page pools \[G \* num_pages, page, "
                                         r"Hkv, D\].* G = the 4 devices .*\(dp=2 x sp=2\); "
                                         r"got shape \(10, 4, 2, 64\)"):
        call(k=rand((10, 4, 2, 64)))
    with pytest.raises(ValueError, match=r"page pools k\(12, 4, 2, 64\) and v\(8, 4, 2, 64\)"):
        call(v=rand((8, 4, 2, 64)))
    with pytest.raises(ValueError, match=r"block_table must be \[B, W \* pages\] with B = 2 "
                                         r"and a multiple of the W = 2 ranks .* got shape "
                                         r"\(2, 3\)"):
        call(table=np.zeros((2, 3), np.int32))
    with pytest.raises(ValueError, match="block_table has dtype float32"):
        call(table=np.zeros((2, 4), np.float32))


def test_lengths_that_differ_across_ranks_give_nan():
    """kv_len must be the same on every rank: a sequence whose length differs
    gets NaN on every rank (the ranks exchange their lengths with the
    partials), the others their attention; the next call, with agreeing
    lengths, is whole again."""
    world, b, s_shard = 2, 3, 11
    mesh = setup(world, ("sp",))
    f = jax.jit(jax.shard_map(lambda q, k, v, n: td.flash_decode(q, k, v, n, "sp"), mesh=mesh,
                              in_specs=(P(), P(None, "sp"), P(None, "sp"), P("sp")),
                              out_specs=P()))
    (q, k, v), placed = _operands(mesh, world, b, 4, 2, 64, s_shard, F32)
    agreed = np.array([2 * s_shard, 5, 16], np.int32)
    per_rank = np.concatenate([agreed, agreed])
    per_rank[b + 1] = 7  # rank 1 sees sequence 1 at length 7, rank 0 at 5
    out = np.asarray(f(*placed, place(mesh, per_rank, P("sp"))), np.float64)
    assert np.all(np.isnan(out[1]))
    ref = _reference(q, k, v, agreed)
    assert _rel(out[[0, 2]], ref[[0, 2]]) < TOL[jnp.dtype(F32)]
    out = f(*placed, place(mesh, np.concatenate([agreed, agreed]), P("sp")))
    assert _rel(out, ref) < TOL[jnp.dtype(F32)]
