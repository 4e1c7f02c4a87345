"""jaxtdist.ag_attention on CPU devices (Triton interpreter), against a float64
reference: attention of each rank's queries over the whole gathered sequence."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxtdist as td
from tests.conftest import TOL, cpu_only, place, rand, setup, slow

pytestmark = cpu_only()

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
SP = P(None, "sp")


def _reference(q, k, v, causal) -> np.ndarray:
    """float64 attention over the whole sequence, GQA, causal by global position."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    b, s, hq, d = q.shape
    hkv = k.shape[2]
    qg = q.reshape(b, s, hkv, hq // hkv, d)
    scores = np.einsum("bqhgd,bkhd->bhgqk", qg, k) / np.sqrt(d)
    if causal:
        scores = np.where(np.tril(np.ones((s, s), bool)), scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    o = np.einsum("bhgqk,bkhd->bqhgd", p / p.sum(-1, keepdims=True), v)
    return o.reshape(b, s, hq, d)


def _rel(out, ref) -> float:
    out = np.asarray(out, np.float64)
    assert np.all(np.isfinite(out)), "non-finite output"
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def _fn(mesh, causal, config=None, kernels=False, axis="sp"):
    op = td.ops.ag_attention_kernels if kernels else td.ag_attention
    return jax.jit(jax.shard_map(lambda q, k, v: op(q, k, v, axis, causal=causal, config=config),
                                 mesh=mesh, in_specs=(SP, SP, SP), out_specs=SP))


def _operands(mesh, world, b, s, hq, hkv, d, dtype):
    q = rand((b, world * s, hq, d), dtype)
    k = rand((b, world * s, hkv, d), dtype)
    v = rand((b, world * s, hkv, d), dtype)
    return (q, k, v), tuple(place(mesh, a, SP) for a in (q, k, v))


# (world, dtype, causal, B, S_shard, Hq, Hkv, D): every world, causal and not, GQA
# ratios 1, 4 and 8, head dims 64 and 128, odd S_shard, every dtype.
CASES = [(2, F32, True, 2, 19, 4, 4, 64), (2, BF16, False, 1, 16, 4, 1, 128),
         (4, F32, False, 1, 9, 8, 2, 64), (4, F16, True, 1, 13, 8, 1, 64),
         (8, F32, True, 1, 5, 2, 2, 64)]


@pytest.mark.parametrize("world,dtype,causal,b,s,hq,hkv,d", CASES)
def test_ag_attention(world, dtype, causal, b, s, hq, hkv, d):
    mesh = setup(world, ("sp",))
    f = _fn(mesh, causal)
    for _ in range(2):  # a second call: the other staging parity
        (q, k, v), placed = _operands(mesh, world, b, s, hq, hkv, d, dtype)
        out = f(*placed)
        assert out.dtype == jnp.dtype(dtype) and out.shape == q.shape
        assert _rel(out, _reference(q, k, v, causal)) < TOL[jnp.dtype(dtype)]


@pytest.mark.parametrize("precision", ["default", "highest"])
def test_ag_attention_float32_under_each_matmul_precision(precision):
    """float32 follows jax.default_matmul_precision (TF32 on GPUs by default,
    tf32x3 under "highest"); the interpreter multiplies exactly either way."""
    mesh = setup(2, ("sp",))
    (q, k, v), placed = _operands(mesh, 2, 1, 11, 4, 2, 64, F32)
    with jax.default_matmul_precision(precision):
        out = _fn(mesh, True, kernels=True)(*placed)
    assert _rel(out, _reference(q, k, v, True)) < TOL[jnp.dtype(F32)]


@pytest.mark.parametrize("block_m,block_n", [(16, 32), (32, 16)])
@pytest.mark.parametrize("causal", [True, False])
def test_ag_attention_block_shapes(block_m, block_n, causal):
    """Query tiles narrower and wider than key blocks: the unmasked keys (before the
    tile's first query, causal; whole blocks, not) end on a key-block boundary,
    the masked rest (the diagonal, the partial last block) follows."""
    world = 2
    mesh = setup(world, ("sp",))
    f = _fn(mesh, causal, config=dict(BLOCK_M=block_m, BLOCK_N=block_n))
    (q, k, v), placed = _operands(mesh, world, 1, 50, 2, 1, 64, F32)
    assert _rel(f(*placed), _reference(q, k, v, causal)) < TOL[jnp.dtype(F32)]


@pytest.mark.parametrize("gather", ["inbox", "peer"])
@pytest.mark.parametrize("world,causal,b,s", [(2, True, 2, 21), (3, False, 1, 16)])
def test_ag_attention_gather_paths(gather, world, causal, b, s):
    """Both ways to reach peers' k and v (pushed once into local inboxes, the
    default; or read from peers' staged copies, the fallback when inboxes do not
    fit the heap), three calls each (both parities, then the first again), with
    batches whose rows straddle the inbox's 16-row chunks."""
    mesh = setup(world, ("sp",))
    f = _fn(mesh, causal, config=dict(GATHER=gather))
    for _ in range(3):
        (q, k, v), placed = _operands(mesh, world, b, s, 4, 2, 64, F32)
        assert _rel(f(*placed), _reference(q, k, v, causal)) < TOL[jnp.dtype(F32)]


def test_ag_attention_chained_calls():
    """Reuse races: 4 calls in one jit, each on the previous output plus fresh data,
    causal and not alternating, 8 jit calls (staging parities rewritten often)."""
    world, b, s, hq, hkv, d = 4, 1, 7, 2, 1, 64
    mesh = setup(world, ("sp",))

    def chain(q, k, v, xs):
        for i in range(4):
            q = td.ag_attention(q + xs[i], k, v, "sp", causal=i % 2 == 0)
            k = k + q[:, :, :hkv] * 0.5
        return q

    f = jax.jit(jax.shard_map(chain, mesh=mesh, in_specs=(SP, SP, SP, P(None, None, "sp")),
                              out_specs=SP))
    for _ in range(8):
        (q, k, v), placed = _operands(mesh, world, b, s, hq, hkv, d, F32)
        xs = rand((4, b, world * s, hq, d))
        out = f(*placed, place(mesh, xs, P(None, None, "sp")))
        expect, kk = np.asarray(q, np.float64), np.asarray(k, np.float64)
        for i in range(4):
            expect = _reference(expect + xs[i], kk, v, i % 2 == 0)
            kk = kk + expect[:, :, :hkv] * 0.5
        assert _rel(out, expect) < 1e-5


# (world, causal, B, S_shard, Hq, Hkv, D, dtype): the fused backward's kernels
# under the interpreter (16-row tiles): GQA 1, 4 and 8, odd S_shard and head dims,
# several tiles per rank, every dtype. At these worlds (> 1) the default is the
# backward with no XLA collective (kernels/ag_attention_bwd.py; more of it in
# test_cpu_ag_attention_bwd.py).
GRAD_CASES = [(2, True, 1, 6, 4, 1, 64, F32), (4, False, 1, 6, 2, 2, 64, F32),
              (2, True, 2, 37, 8, 1, 48, BF16), (4, False, 1, 19, 4, 1, 32, F16),
              pytest.param(8, True, 1, 5, 2, 2, 32, F32, marks=slow()),
              (2, False, 1, 33, 2, 2, 16, F32)]


@pytest.mark.parametrize("world,causal,b,s,hq,hkv,d,dtype", GRAD_CASES)
def test_ag_attention_grad(world, causal, b, s, hq, hkv, d, dtype):
    """The fused backward against jax.grad of float32 attention on the gathered
    arrays, twice on fresh inputs."""
    from jaxtdist.ops.ag_attention import attention

    mesh = setup(world, ("sp",))
    grad = jax.jit(jax.shard_map(
        lambda q, k, v, c: jax.grad(lambda q, k, v: jnp.sum(
            td.ag_attention(q, k, v, "sp", causal=causal).astype(F32) * c),
            argnums=(0, 1, 2))(q, k, v),
        mesh=mesh, in_specs=(SP,) * 4, out_specs=(SP,) * 3))
    for _ in range(2):
        (q, k, v), placed = _operands(mesh, world, b, s, hq, hkv, d, dtype)
        c = rand(q.shape)
        got = grad(*placed, place(mesh, c, SP))
        f32 = [np.asarray(a, np.float32) for a in (q, k, v)]
        expect = jax.grad(lambda q, k, v: jnp.sum(attention(q, k, v, causal=causal) * c),
                          argnums=(0, 1, 2))(*f32)
        for name, g, want in zip("qkv", got, expect):
            assert g.dtype == jnp.dtype(dtype), name
            assert _rel(g, np.asarray(want, np.float64)) < TOL[jnp.dtype(dtype)], f"d{name}"


def test_ag_attention_backward_config():
    """The backward's tiles are config keys: any valid one gives the same
    gradients; an invalid one is refused naming the constraint."""
    mesh = setup(2, ("sp",))
    (q, k, v), placed = _operands(mesh, 2, 1, 21, 2, 1, 32, F32)

    def grads(config):
        return jax.jit(jax.shard_map(
            lambda q, k, v: jax.grad(lambda q, k, v: jnp.sum(
                td.ag_attention(q, k, v, "sp", config=config) ** 2),
                argnums=(0, 1, 2))(q, k, v),
            mesh=mesh, in_specs=(SP,) * 3, out_specs=(SP,) * 3))(*placed)

    base = grads(None)
    for other in (dict(BWD_BLOCK_Q=32, BWD_BLOCK_STEP=16),
                  dict(BWD_BLOCK_KV=32, BWD_KV_STEP=16, BWD_KV_WARPS=8, BWD_KV_STAGES=2)):
        for a, b_ in zip(base, grads(other)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b_), rtol=1e-5, atol=1e-6)
    for bad, why in ((dict(BWD_BLOCK_Q=48), "power of 2"),
                     (dict(BWD_WARPS=3), "BWD_WARPS=3; allowed: 1, 2, 4, 8, 16, 32"),
                     (dict(BWD_BLOCK_STEP=512), r"power of 2 in \[16, 256\]"),
                     (dict(BWD_STAGES=0), ">= 1"), (dict(BWD_BLOCK_KV=8), "power of 2 >= 16"),
                     (dict(BWD_KV_STEP=512), r"power of 2 in \[16, 256\]"),
                     (dict(BWD_KV_WARPS=64), "allowed: 1, 2, 4, 8, 16, 32"),
                     (dict(BWD_KV_STAGES=17), r"an int in \[1, 16\]"),
                     (dict(BWD_KV_STAGES=1.5), "int")):
        with pytest.raises(ValueError, match=why):
            grads(bad)


def test_ag_attention_world_1():
    """A group of one rank runs jax.nn.dot_product_attention; ag_attention_kernels runs
    the kernel there, with no heap beyond its prologue's (no staged k and v). A
    group of no axes (``()``) is one rank too."""
    from jaxtdist.runtime._runtime import runtime

    mesh = setup((1, 8), ("sp", "dp"))
    q, k, v = rand((1, 21, 8, 64)), rand((1, 21, 2, 64)), rand((1, 21, 2, 64))
    for causal in (True, False):
        ref = _reference(q, k, v, causal)
        for kernels, axis in ((False, "sp"), (True, "sp"), (True, ()), (False, ())):
            before = runtime().bytes_in_use
            f = jax.jit(jax.shard_map(
                lambda q, k, v, kernels=kernels, causal=causal, axis=axis: (
                    td.ops.ag_attention_kernels if kernels else td.ag_attention)(
                        q, k, v, axis, causal=causal),
                mesh=mesh, in_specs=(P(),) * 3, out_specs=P()))
            assert _rel(f(q, k, v), ref) < 1e-5, (causal, kernels, axis)
            assert runtime().bytes_in_use - before <= 1024, (causal, kernels, axis)


def test_ag_attention_sharded_over_a_submesh():
    mesh = setup((2, 4), ("dp", "sp"))
    q, k, v = rand((2, 4 * 5, 2, 64)), rand((2, 4 * 5, 1, 64)), rand((2, 4 * 5, 1, 64))
    spec = P("dp", "sp")
    out = jax.jit(lambda *a: td.ag_attention_sharded(*a, axis_name="sp", batch_axes="dp"))(
        *(place(mesh, a, spec) for a in (q, k, v)))
    assert _rel(out, _reference(q, k, v, True)) < 1e-5


def test_ag_attention_errors():
    mesh = setup(2, ("sp",))
    q, k = rand((1, 8, 4, 64)), rand((1, 8, 2, 64))

    def run(q, k, v, causal=True, config=None, axis="sp"):
        return _fn(mesh, causal, config, axis=axis)(*(place(mesh, a, SP) for a in (q, k, v)))

    with pytest.raises(ValueError, match=r"expected q \[B, S_shard, Hq, D\]"):
        run(q[0], k, k)
    with pytest.raises(ValueError, match="must be a multiple of Hkv=2"):
        run(rand((1, 8, 3, 64)), k, k)
    with pytest.raises(ValueError, match="disagree on B, S_shard or D"):
        run(rand((1, 4, 4, 64)), k, k)
    with pytest.raises(ValueError, match="must share a dtype"):
        run(q, k, k.astype(np.float16))
    with pytest.raises(ValueError, match="causal=1 must be True or False"):
        run(q, k, k, causal=1)
    with pytest.raises(ValueError, match="BLOCK_M=48 must be a power of 2"):
        run(q, k, k, config=dict(BLOCK_M=48))
    with pytest.raises(ValueError, match="unknown config keys"):
        run(q, k, k, config=dict(BLOCK=16))
    with pytest.raises(ValueError, match="GATHER='ring'; allowed"):
        run(q, k, k, config=dict(GATHER="ring"))
    with pytest.raises(ValueError, match="axis"):
        run(q, k, k, axis="tp")


def _wall_us(fn, args, world, iterations):
    import time

    jax.block_until_ready(fn(*args))
    t = time.perf_counter()
    for _ in range(iterations):
        jax.block_until_ready(fn(*args))
    return (time.perf_counter() - t) / iterations * 1e6


def test_ag_attention_tunes_with_an_explicit_measure():
    setup(2, ("sp",))
    result = td.tune.tune("ag_attention", (1, 8, 2, 1, 64), jnp.float32, axis_name="sp",
                          candidates=[{}, dict(BLOCK_N=32)], iterations=1, measure=_wall_us)
    assert len(result["tried"]) == 2 and all("us" in r for r in result["tried"])
    assert result["variant"] == "pull"


@pytest.mark.parametrize("b,s,hq,d,block_m,warps", [
    (1, 4096, 32, 128, 64, 4),     # 1024 programs of 128 rows: under 16 rounds of 132 SMs
    (1, 16384, 32, 128, 128, 8),   # 4096 programs: 128-row tiles
    (4, 8192, 32, 64, 128, 4),     # enough programs; D = 64: 4 warps
    (1, 100, 8, 128, 64, 4),       # fewer than 128 rows per rank
])
def test_default_tiles_on_gpus(b, s, hq, d, block_m, warps):
    """GPU defaults: 64-row query tiles where 128-row ones would fill few rounds of
    the SMs, else 128 rows (8 warps above D = 64); always valid configs."""
    from jaxtdist.ops._config import Problem
    from jaxtdist.ops.ag_attention import AgAttentionConfig

    problem = Problem("gpu", 1, (b, s, hq, 8, d), "bfloat16", 132)
    cfg = AgAttentionConfig.default(problem)
    assert (cfg.BLOCK_M, cfg.num_warps) == (block_m, warps)
    assert cfg.HEAD_GROUP == (4 if block_m == 64 else 1)  # 64-row tiles: a shorter tail
    cfg.validate(problem)


# The forward's default (BLOCK_M, BLOCK_N, num_stages) on NVIDIA GPUs by dtype and
# head dim, with few (S = 4K: 64-row tiles) and many programs (S = 16K: 128 rows).
FORWARD_TILES = [
    ("bfloat16", 128, 4096, (64, 64, 3)), ("bfloat16", 128, 16384, (128, 64, 3)),
    ("float16", 64, 16384, (128, 64, 3)), ("float32", 64, 16384, (128, 64, 3)),
    ("float32", 128, 4096, (64, 64, 2)), ("float32", 128, 16384, (64, 64, 2)),
    ("bfloat16", 256, 4096, (64, 64, 2)), ("bfloat16", 256, 16384, (128, 64, 2)),
    ("float32", 256, 4096, (32, 32, 2)),
]


@pytest.mark.parametrize("dtype,d,s,tiles", FORWARD_TILES)
def test_default_forward_tiles_fit_shared_memory(dtype, d, s, tiles):
    """The forward's defaults are cut down where 512-byte rows or more would pass
    the SM's shared memory (float32 at head dim 128 took 256 KiB with 64 x 64
    tiles and 3 stages under "highest" precision on 1 x H100, which allows 227;
    bfloat16 at head dim 256, 256 KiB with 128 x 64 and 3 stages). Compiled
    sizes: tests/test_compile_sm90.py."""
    from jaxtdist.ops._config import Problem
    from jaxtdist.ops.ag_attention import AgAttentionConfig

    problem = Problem("gpu", 1, (1, s, 32, 8, d), dtype, 132)
    cfg = AgAttentionConfig.default(problem)
    assert (cfg.BLOCK_M, cfg.BLOCK_N, cfg.num_stages) == tiles
    cfg.validate(problem)


@pytest.mark.parametrize("vendor,dtype,d,dq,dkdv", [
    ("nvidia", "bfloat16", 128, (128, 64, 8, 3), (64, 64, 4, 2)),
    ("nvidia", "float16", 64, (128, 64, 8, 3), (64, 64, 4, 2)),
    ("nvidia", "float32", 128, (64, 32, 8, 2), (64, 32, 8, 2)),   # 512-byte rows
    ("nvidia", "bfloat16", 256, (64, 32, 8, 2), (64, 32, 8, 2)),
    ("amd", "bfloat16", 128, (64, 16, 4, 2), (64, 16, 4, 2)),     # 64 KiB of LDS
])
def test_default_backward_tiles(vendor, dtype, d, dq, dkdv):
    """The backward's default tiles per kernel (rows, step, warps, stages): within
    shared memory (``_BWD_SMEM``), valid configs."""
    from jaxtdist.ops._config import Problem
    from jaxtdist.ops.ag_attention import AgAttentionConfig

    problem = Problem("gpu", 1, (1, 4096, 32, 8, d), dtype, 132, vendor)
    cfg = AgAttentionConfig.default(problem)
    assert (cfg.BWD_BLOCK_Q, cfg.BWD_BLOCK_STEP, cfg.BWD_WARPS, cfg.BWD_STAGES) == dq
    assert (cfg.BWD_BLOCK_KV, cfg.BWD_KV_STEP, cfg.BWD_KV_WARPS, cfg.BWD_KV_STAGES) == dkdv
    cfg.validate(problem)


@pytest.mark.parametrize("knobs,causal,b,hq,d", [
    (dict(HEAD_GROUP=3), True, 2, 4, 64),                # 8 (batch, head) pairs: 3, 3, 2
    (dict(HEAD_GROUP=3, BLOCK_M=32), True, 1, 4, 40),    # D below BLOCK_D: masked dims
    (dict(HEAD_GROUP=64), True, 2, 4, 64),               # clipped to 8
    (dict(HEAD_GROUP=8), False, 2, 4, 64),               # not causal: no reordering
])
def test_ag_attention_kernel_knobs(knobs, causal, b, hq, d):
    """The causal program order over head groups (HEAD_GROUP), world 2 and world 1
    (the own chunk only), against the float64 reference."""
    for world in (2, 1):
        mesh = setup(world, ("sp",))
        f = _fn(mesh, causal, config=knobs, kernels=True)
        (q, k, v), placed = _operands(mesh, world, b, 21, hq, 2, d, F32)
        assert _rel(f(*placed), _reference(q, k, v, causal)) < TOL[jnp.dtype(F32)], world


def test_ag_attention_knob_errors():
    mesh = setup(2, ("sp",))
    q = rand((1, 8, 2, 64))
    for config, match in ((dict(HEAD_GROUP=0), "HEAD_GROUP=0 must be an int >= 1"),
                          (dict(HEAD_GROUP=True), "HEAD_GROUP=True must be an int")):
        with pytest.raises(ValueError, match=match):
            _fn(mesh, True, config, kernels=True)(*(place(mesh, a, SP) for a in (q, q, q)))


def test_ag_attention_grad_under_vmap_checkpoint_and_scan():
    """The fused backward's kernels are an op call of their own: batched under
    jax.vmap (one call per element), ordered under jax.checkpoint and scan."""
    from jaxtdist.ops.ag_attention import attention

    mesh = setup(2, ("sp",))
    spec = P(None, None, "sp")
    q, k, v = rand((3, 1, 16, 2, 16)), rand((3, 1, 16, 1, 16)), rand((3, 1, 16, 1, 16))
    placed = tuple(place(mesh, a, spec) for a in (q, k, v))

    def loss(q, k, v):
        return jnp.sum(td.ag_attention(q, k, v, "sp") ** 2)

    def reference(q, k, v):
        return jnp.sum(attention(q, k, v) ** 2)

    got = jax.jit(jax.shard_map(
        lambda q, k, v: jax.vmap(jax.grad(jax.checkpoint(loss), argnums=(0, 1, 2)))(q, k, v),
        mesh=mesh, in_specs=(spec,) * 3, out_specs=(spec,) * 3))(*placed)
    expect = jax.vmap(jax.grad(reference, argnums=(0, 1, 2)))(q, k, v)
    for g, want in zip(got, expect):
        assert _rel(g, np.asarray(want, np.float64)) < 1e-5

    def steps(q, k, v):
        return jax.lax.scan(lambda c, x: (c + loss(*x), None), 0.0, (q, k, v))[0]

    got = jax.jit(jax.shard_map(lambda q, k, v: jax.grad(steps)(q, k, v), mesh=mesh,
                                in_specs=(spec,) * 3, out_specs=spec, check_vma=False))(*placed)
    expect = jax.grad(lambda q: sum(reference(q[i], k[i], v[i]) for i in range(3)))(q)
    assert _rel(got, np.asarray(expect, np.float64)) < 1e-5
