"""jaxtdist.grouped_matmul on CPU devices (Triton interpreter), against numpy."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxtdist as td
from tests.conftest import assert_close, cpu_only, place, rand, setup

pytestmark = cpu_only()

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32


def _fn(mesh, config=None):
    return jax.jit(jax.shard_map(
        lambda x, w, s: td.grouped_matmul(x, w, s, config=config), mesh=mesh,
        in_specs=(P(), P(), P()), out_specs=P()))


def _reference(x, w, sizes) -> np.ndarray:
    """float32 numpy: group g's rows (clipped at R) times w[g]; the rest zeros."""
    x, w = np.asarray(x, np.float32), np.asarray(w, np.float32)
    out = np.zeros((x.shape[0], w.shape[2]), np.float32)
    start = 0
    for g, size in enumerate(np.asarray(sizes)):
        end = min(start + max(int(size), 0), x.shape[0])
        out[start:end] = x[start:end] @ w[g]
        start = end
    return out


def _check(mesh, r, h, f, sizes, dtype, config=None):
    sizes = np.asarray(sizes, np.int32)
    x, w = rand((r, h), dtype), rand((len(sizes), h, f), dtype)
    out = _fn(mesh, config)(x, w, sizes)
    assert out.shape == (r, f) and out.dtype == jnp.dtype(dtype)
    ref = _reference(x, w, sizes)
    used = min(int(sizes.clip(0).sum()), r)
    # Rows past the groups are exact zeros (the output is poisoned with NaN first).
    np.testing.assert_array_equal(np.asarray(out[used:], np.float32), 0.0)
    if used:
        assert_close(out, ref, dtype)
    return out


# (R, H, F, sizes): G = 1, 3, 8; empty groups, one group taking every row, sizes
# that are no multiple of the row tile (16 on CPU), rows past the sum, H and F no
# multiple of BLOCK_K = 16 / BLOCK_N = 32 (TMA: rows of 16-byte multiples).
CASES = [
    (45, 48, 64, [45]),                        # G=1, every row
    (45, 40, 48, [29]),                        # G=1, rows past the sum
    (50, 32, 40, [0, 50, 0]),                  # G=3, one group takes all
    (50, 48, 32, [17, 0, 20]),                 # G=3, empty middle group, rows past
    (64, 24, 72, [3, 21, 0, 16, 0, 1, 9, 6]),  # G=8, skewed, 8 zero rows past
    (37, 40, 48, [0, 0, 0, 0, 0, 0, 0, 0]),    # G=8, every group empty: all zeros
]


@pytest.mark.parametrize("dtype", [F32, BF16, F16])
@pytest.mark.parametrize("r,h,f,sizes", CASES)
def test_grouped_matmul(r, h, f, sizes, dtype):
    mesh = setup(1, ("ep",))
    _check(mesh, r, h, f, sizes, dtype)


@pytest.mark.parametrize("h,f,dtype", [
    (48, 40, F32),   # float32 reads w[g].T through one stacked descriptor: F = 40 in
                     # 32-column blocks runs into the next group's rows
    (48, 40, BF16),  # BLOCK_K = 16 divides H: one stacked descriptor
    (40, 48, BF16),  # H = 40: a descriptor of w[g] per tile (its partial K block zeros)
])
def test_grouped_matmul_never_reads_other_groups_weights_into_a_result(h, f, dtype):
    """The TMA path (the interpreter runs it as GPUs do) with the empty middle group's
    weights all inf: any block that reached into them for a stored result would
    give inf or NaN there. The forward and dx (dy @ w[g].T) match float32."""
    mesh = setup(1, ("ep",))
    sizes = np.asarray([7, 0, 13], np.int32)
    x, w = rand((24, h), dtype), np.array(rand((3, h, f), dtype), np.float32)
    finite = w.copy()
    finite[1] = 0.0
    w[1] = np.inf
    w = jnp.asarray(w, dtype)
    out = _fn(mesh)(x, w, sizes)
    ref = _reference(x, finite, sizes)
    assert np.isfinite(np.asarray(out, np.float32)).all()
    assert_close(out, ref, dtype)
    c = rand((24, f))

    def loss(fn):
        return lambda x: jnp.sum(fn(x).astype(F32) * c)

    dx = jax.jit(jax.shard_map(jax.grad(loss(lambda x: td.grouped_matmul(x, w, sizes))),
                               mesh=mesh, in_specs=P(), out_specs=P()))(x)
    rdx = jax.grad(loss(lambda x: jax.lax.ragged_dot(
        x.astype(F32), jnp.asarray(finite), sizes, precision=jax.lax.Precision.HIGHEST)))(x)
    assert np.isfinite(np.asarray(dx, np.float32)).all()
    assert_close(dx, np.asarray(rdx), dtype)


@pytest.mark.parametrize("dtype", [BF16, F16])
def test_grouped_matmul_pointer_path(dtype):
    """H = 20 and F = 36 half-precision elements are no 16-byte rows: the pointer GEMM."""
    mesh = setup(1, ("ep",))
    _check(mesh, 41, 20, 36, [7, 0, 19], dtype)


@pytest.mark.parametrize("split", [2, 3, 16])
@pytest.mark.parametrize("r,h,f,sizes", [CASES[3], CASES[4], CASES[5], (41, 20, 36, [7, 0, 19])])
def test_grouped_matmul_split_k(r, h, f, sizes, split):
    """SPLIT_K: each tile's K cut into ranges (more ranges than K blocks at 16: some
    empty), float32 partials summed by the op; rows past the groups zeros in every
    plane; the pointer path at H = 20 bf16."""
    mesh = setup(1, ("ep",))
    config = dict(SPLIT_K=split)
    _check(mesh, r, h, f, sizes, F32, config)
    _check(mesh, r, h, f, sizes, BF16, config)


def test_grouped_matmul_split_k_default_and_gradient():
    """The GPU rule splits K only where the groups have fewer rows than a tile; a
    split forward and backward match ragged_dot's."""
    from jaxtdist.ops.grouped_matmul import MAX_SPLIT_K, split_k

    # Decode: 16 rows over 8 experts, 64 x 128 tiles: 128 tiles, fewer than the SMs:
    # 4 ranges of 22 K blocks (3 rounds of items); float32's 32-wide K blocks alike.
    assert split_k(16, 5632, 2048, 8, 64, 128, 64, 132) == 4
    assert split_k(16, 5632, 2048, 8, 64, 128, 32, 132, itemsize=4) == 4
    # 64 x 256 at F = 5632: 176 tiles fill the SMs: no split.
    assert split_k(16, 2048, 5632, 8, 64, 256, 64, 132) == 1
    # Rows enough for the tiles, or K too short to cut: no split.
    assert split_k(4096, 4096, 14336, 8, 128, 256, 64, 132) == 1
    assert split_k(16, 256, 128, 8, 64, 128, 64, 132) == 1
    # As many ranges as the rounds ask, at most MAX_SPLIT_K.
    assert split_k(2, 1 << 20, 64, 1, 64, 64, 64, 132) == MAX_SPLIT_K
    # 128 rows per group (112 tiles): the partials of even 2 ranges would pass an
    # eighth of the weights' bytes.
    assert split_k(1024, 4096, 3584, 8, 128, 256, 64, 132) == 1
    # The default: 16-bit decode (at most 32 rows) takes 16 or 32-row tiles (BLOCK_M
    # >= R: no group's weights read twice), unsplit; float32 and 64 rows the core's
    # tiles, split by the rule. The tuner tries K ranges at decode sizes.
    from jaxtdist.ops._config import Problem
    from jaxtdist.ops.grouped_matmul import GroupedMatmulConfig

    def default(r, dtype="bfloat16"):
        problem = Problem("gpu", 1, (r, 5632, 2048, 8), dtype, 132)
        cfg = GroupedMatmulConfig.default(problem)
        cfg.validate(problem)
        return cfg.BLOCK_M, cfg.BLOCK_N, cfg.SPLIT_K

    assert [default(r) for r in (1, 16, 17, 32)] == [(16, 256, 1)] * 2 + [(32, 256, 1)] * 2
    assert default(16, "float32") == (64, 128, 4) and default(64) == (64, 128, 4)
    decode = Problem("gpu", 1, (16, 5632, 2048, 8), "bfloat16", 132)
    space = GroupedMatmulConfig.search_space(decode)
    assert {2, 4, 8} <= {c["SPLIT_K"] for c in space if "SPLIT_K" in c}
    mesh = setup(1, ("ep",))
    x, w = rand((24, 64)), rand((3, 64, 48))
    sizes = jnp.asarray([5, 0, 11], jnp.int32)

    def loss(fn):
        return lambda x, w: jnp.sum(fn(x, w) ** 2)

    ours = jax.jit(jax.shard_map(
        jax.grad(loss(lambda x, w: td.grouped_matmul(x, w, sizes, config=dict(SPLIT_K=3))),
                 argnums=(0, 1)), mesh=mesh, in_specs=(P(), P()), out_specs=(P(), P())))
    ref = jax.grad(loss(lambda x, w: jax.lax.ragged_dot(x, w, sizes, precision="highest")),
                   argnums=(0, 1))
    for got, want in zip(ours(x, w), ref(x, w)):
        assert_close(got, want, F32)


def test_grouped_matmul_unsigned_sizes_past_int32_are_clipped():
    """uint32 sizes from 2**31 up are clipped at R, not wrapped to negative."""
    mesh = setup(1, ("ep",))
    x, w = rand((30, 32)), rand((2, 32, 16))
    sizes = np.array([2 ** 32 - 1, 5], np.uint32)
    assert_close(_fn(mesh)(x, w, sizes), x @ w[0], F32)


def test_grouped_matmul_sizes_past_r_are_clipped():
    """Like ragged_dot, a group reaching past R stops at R; later groups get no rows."""
    mesh = setup(1, ("ep",))
    x, w = rand((30, 32)), rand((3, 32, 32))
    sizes = np.array([12, 25, 7], np.int32)
    out = _fn(mesh)(x, w, sizes)
    assert_close(out, _reference(x, w, sizes), F32)
    assert_close(out, jax.lax.ragged_dot(x, w, sizes, precision="highest"), F32)


def test_grouped_matmul_config_and_routing_changes():
    """One compiled program serves every routing; larger tiles and 1 program too."""
    mesh = setup(1, ("ep",))
    f = _fn(mesh, config=dict(BLOCK_M=32, BLOCK_N=64, NUM_PROGRAMS=1))
    x, w = rand((70, 32)), rand((4, 32, 64))
    for sizes in ([70, 0, 0, 0], [1, 2, 3, 4], [33, 0, 31, 5]):
        sizes = np.array(sizes, np.int32)
        assert_close(f(x, w, sizes), _reference(x, w, sizes), F32)
    assert f._cache_size() == 1


def test_grouped_matmul_chained_and_sharded_rows():
    """Two calls in one jit (the second on the first's output), on 2 devices that
    each hold their own rows and sizes: the op is local to each device."""
    mesh = setup(2)
    r, h, g = 24, 32, 3

    def body(x, w1, w2, s):
        return td.grouped_matmul(jnp.tanh(td.grouped_matmul(x, w1, s)), w2, s)

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("tp"), P(), P(), P("tp")),
                              out_specs=P("tp")))
    x, w1, w2 = rand((2 * r, h)), rand((g, h, 48)), rand((g, 48, 16))
    sizes = np.array([5, 0, 17, 9, 9, 6], np.int32)  # device 0: 22 of 24 rows; device 1: all
    out = f(place(mesh, x, P("tp")), w1, w2, place(mesh, sizes, P("tp")))
    ref = np.concatenate([
        _reference(np.tanh(_reference(x[i * r:(i + 1) * r], w1, sizes[i * g:(i + 1) * g])),
                   w2, sizes[i * g:(i + 1) * g]) for i in range(2)])
    assert_close(out, ref, F32)


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_grouped_matmul_grad(dtype):
    mesh = setup(1, ("ep",))
    x, w, c = rand((40, 32), dtype), rand((3, 32, 48), dtype), rand((40, 48))
    sizes = np.array([9, 0, 26], np.int32)

    def loss(fn):
        return lambda x, w, s: jnp.sum(fn(x, w, s).astype(jnp.float32) * c)

    ours = jax.jit(jax.shard_map(jax.grad(loss(td.grouped_matmul), argnums=(0, 1)), mesh=mesh,
                                 in_specs=(P(), P(), P()), out_specs=(P(), P())))
    dx, dw = ours(x, w, sizes)
    rdx, rdw = jax.grad(loss(jax.lax.ragged_dot), argnums=(0, 1))(x, w, sizes)
    assert dx.dtype == jnp.dtype(dtype) and dw.dtype == jnp.dtype(dtype)
    assert_close(dx, np.asarray(rdx, np.float32), dtype)
    assert_close(dw, np.asarray(rdw, np.float32), dtype)


@pytest.mark.parametrize("r,h,f,sizes,dtype", [
    (40, 32, 48, [9, 0, 26], F32),            # TMA; a group ending mid-block, an empty one
    (37, 33, 20, [5, 17, 0, 3], F32),         # H * 4 bytes not 16-byte: the pointer path
    (64, 64, 32, [70, 5], BF16),              # sizes past R: clipped
    (50, 16, 64, [-3, 20, 0, 0, 11], BF16),   # a negative size counts as zero; padding rows
])
def test_grouped_matmul_weight_gradient_kernel(r, h, f, sizes, dtype):
    """dw[g] = x[rows of g].T @ dy[rows of g] on grouped_dw_kernel, against float32
    ragged_dot's VJP: rows past the groups and clipped rows contribute nothing."""
    mesh = setup(1, ("ep",))
    x, w, c = rand((r, h), dtype), rand((len(sizes), h, f), dtype), rand((r, f))
    s = np.asarray(sizes, np.int32)

    def loss(fn):
        return lambda x, w: jnp.sum(fn(x, w, s).astype(jnp.float32) * c)

    dx, dw = jax.jit(jax.shard_map(jax.grad(loss(td.grouped_matmul), argnums=(0, 1)),
                                   mesh=mesh, in_specs=(P(), P()), out_specs=(P(), P())))(x, w)
    # Negative sizes count as zero (ragged_dot's own result for them differs).
    rdx, rdw = jax.grad(loss(lambda a, b, s: jax.lax.ragged_dot(
        a.astype(F32), b.astype(F32), np.maximum(s, 0), precision=jax.lax.Precision.HIGHEST)),
        argnums=(0, 1))(x, w)
    assert dw.shape == w.shape and dw.dtype == w.dtype
    assert_close(dx, np.asarray(rdx), dtype)
    assert_close(dw, np.asarray(rdw), dtype)
    for g in np.nonzero(np.maximum(s, 0) == 0)[0]:
        np.testing.assert_array_equal(np.asarray(dw[g], np.float32), 0.0)


def test_grouped_matmul_vmap_of_remat_grad():
    """vmap(grad(checkpoint(f))) with w and the sizes unbatched: the backward's
    kernel call, traced unbatched under remat and batched afterwards, takes the
    previous call's output as an argument (one_call_per_element), not as a
    closed-over value that custom_vmap would reject."""
    mesh = setup(1, ("ep",))
    x, w = rand((3, 40, 32)), rand((3, 32, 48))
    sizes = jnp.asarray([9, 0, 26], jnp.int32)

    def loss(fn):
        return lambda x, w: jnp.sum(jnp.sin(fn(x, w, sizes)))

    ours = jax.jit(jax.shard_map(
        jax.vmap(jax.grad(jax.checkpoint(loss(td.grouped_matmul)), argnums=(0, 1)),
                 in_axes=(0, None)), mesh=mesh, in_specs=(P(), P()), out_specs=(P(), P())))
    dx, dw = ours(x, w)
    for i in range(3):
        rdx, rdw = jax.grad(loss(jax.lax.ragged_dot), argnums=(0, 1))(x[i], w)
        assert_close(dx[i], np.asarray(rdx), F32)
        assert_close(dw[i], np.asarray(rdw), F32)


def test_grouped_matmul_errors():
    mesh = setup(1, ("ep",))
    x, w, s = rand((8, 16)), rand((2, 16, 16)), np.array([4, 4], np.int32)
    cases = [
        ((x[0], w, s), "expected x \\[R, H\\], w \\[G, H, F\\]"),
        ((x, w[:, :8], s), "disagree on H"),
        ((x, w, s[:1]), "one size per group"),
        ((x, w, s.astype(np.float32)), "group_sizes must be integers"),
        ((x.astype(np.int32), w.astype(np.int32), s), "supported dtypes are"),
        ((x, w.astype(jnp.bfloat16), s), "w has dtype bfloat16, x float32"),
        ((rand((8, 4)), rand((257, 4, 16)), np.zeros(257, np.int32)), "allowed: 1 to 256"),
    ]
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            _fn(mesh)(*args)
    with pytest.raises(ValueError, match=r"SPLIT_K=17 must be an int in \[1, 16\]"):
        _fn(mesh, dict(SPLIT_K=17))(x, w, s)
    with pytest.raises(ValueError, match="SPLIT_K=0 must be an int >= 1"):
        _fn(mesh, dict(SPLIT_K=0))(x, w, s)
    with pytest.raises(ValueError, match="BLOCK_M=24 must be a power of 2"):
        _fn(mesh, dict(BLOCK_M=24))(x, w, s)
    with pytest.raises(ValueError, match="unknown config keys"):
        _fn(mesh, dict(BLOCK_Q=16))(x, w, s)


def test_grouped_matmul_default_tiles_on_gpu_shapes():
    """The GPU rule: the GEMM core's tiles with groups as ranks; a grid of at most
    the SMs; configs that overflow shared memory refused."""
    from jaxtdist.ops._config import Problem
    from jaxtdist.ops.grouped_matmul import GroupedMatmulConfig

    big = Problem("gpu", 1, (32768, 4096, 14336, 8), "bfloat16", 132)
    cfg = GroupedMatmulConfig.default(big)
    cfg.validate(big)
    assert (cfg.BLOCK_M, cfg.BLOCK_N, cfg.BLOCK_K) == (128, 256, 64)
    assert cfg.programs(big) == 132
    small = Problem("gpu", 1, (64, 7168, 2048, 8), "float32", 132)
    cfg = GroupedMatmulConfig.default(small)
    cfg.validate(small)
    assert cfg.BLOCK_N <= 128 and cfg.BLOCK_M == 64
    with pytest.raises(ValueError, match="shared memory"):
        cfg.replace(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_stages=6).validate(big)
    assert GroupedMatmulConfig.search_space(big)[0] == {}


def test_grouped_matmul_benchmark_runs_both_contenders_and_tabulates(faked_timing,
                                                                   monkeypatch):
    """``python -m jaxtdist.bench grouped_matmul`` on small shapes (CPU, faked timing):
    grouped_matmul and ragged_dot both match the float32 grouped product and
    gradients, computed a few groups at a time (here 2 and 6 per call, as 7 GiB
    of weights are on a GPU); the table's summary counts the shapes within the
    target."""
    from jaxtdist.bench import __main__ as cli
    from jaxtdist.bench import grouped_matmul as bench
    monkeypatch.setattr(bench, "_REFERENCE_BYTES", 2 * 32 * 48 * 4)
    rows = bench.bench_grouped_matmul([(40, 32, 48, 3, 0.8), (33, 16, 32, 8, 1.0)], 2,
                                      rounds=1, dtype=jnp.float32)
    for row in rows:
        assert row["grouped_matmul"]["rel_err"] < 1e-5, row
        assert row["ragged_dot"]["rel_err"] < 1e-5, row
        for name in ("grouped_matmul_grad", "ragged_dot_grad"):
            assert row[name]["rel_err"] < 1e-5, (name, row)
    assert bench.group_sizes(1, 40, 3, 0.8).sum() == 32
    text = bench.table(dict(device="cpu", rows=rows, iterations=2, rounds=1))
    assert "| 40 x 32 x 48 | 3 | 80% |" in text
    assert "geomean 1.000, p90 1.00, max 1.00, 2 of 2 within 1.10" in text
    assert "grouped_matmul" in cli.benchmarks()


def _compile_for_sm90(kernel, dtype: str, tma: bool, out: str | None = None, **extra):
    """One of the grouped kernels compiled for sm_90 at 4096 x 4096 x 14336, 8 groups
    (H = 4100: rows TMA cannot address), the output in ``out`` (default: dtype);
    skips where ptxas cannot assemble."""
    from jaxtdist.runtime._cuda_launch import compile_kernel

    bn, bk, sub = (256, 64, 4) if dtype == "bf16" else (128, 32, 2)
    try:
        return compile_kernel(kernel, ["*i32", f"*{dtype}", f"*{dtype}", "*i32",
                                       f"*{out or dtype}"],
                              dict(R=4096, H=4096 if tma else 4100, F=14336, G=8, BLOCK_G=16,
                                   BLOCK_M=128, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8,
                                   NUM_PROGRAMS=132, SUBTILE=sub, TMA=tma,
                                   # The native launcher takes every constexpr: the
                                   # defaulted ones at their defaults unless given.
                                   **dict(dict(DOT_PRECISION=None),
                                          **{k: v for k, v in (("MASKED_M", 0),)
                                             if k in kernel.arg_names}, **extra)),
                              num_warps=8, num_stages=3, capability=90)
    except RuntimeError as e:
        if "ptxas" in str(e).lower():
            pytest.skip(f"cannot assemble for sm_90 here: {e}")
        raise


@pytest.mark.parametrize("dtype,tma", [("bf16", True), ("fp32", True), ("bf16", False)])
def test_grouped_dw_kernel_compiles_for_sm90(dtype, tma):
    """The weights' gradient kernel on the GPU path: x's tiles TMA-loaded and fed
    to wgmma transposed, dy's TMA-loaded, dw stored by TMA clipped per group."""
    import re

    from jaxtdist.kernels.grouped_gemm import grouped_dw_kernel

    k = _compile_for_sm90(grouped_dw_kernel, dtype, tma)
    ptx = k.asm["ptx"]
    assert "wgmma.mma_async" in ptx or "mma.sync" in ptx
    assert k.metadata.shared <= 227 * 1024
    if tma:
        assert "cp.async.bulk.tensor.2d.shared" in ptx, "x / dy tiles are not TMA loads"
        assert "cp.async.bulk.tensor.3d.global.shared" in ptx, "no TMA store of dw"
        assert len(re.findall(r"tensormap\.cp_fenceproxy", ptx)) == 3  # x, dy, dw
    else:
        assert "cp.async.bulk.tensor" not in ptx


@pytest.mark.parametrize("dtype,tma,w_t,split", [
    ("bf16", True, False, 1), ("fp32", True, False, 1), ("bf16", False, False, 1),
    ("bf16", True, True, 1), ("bf16", True, False, 4), ("bf16", False, False, 4)])
def test_grouped_gemm_kernel_compiles_for_sm90(dtype, tma, w_t, split):
    """The GPU path (not run by the interpreter): TMA loads through the core's
    mainloop with wgmma, the per-tile w descriptor, TMA stores of whole tiles;
    with W_T (the backward's dx) w[g]'s tiles fed to wgmma transposed; with
    SPLIT_K float32 partial planes (the output pointer float32)."""
    import re

    from jaxtdist.kernels.grouped_gemm import grouped_gemm_kernel

    k = _compile_for_sm90(grouped_gemm_kernel, dtype, tma, W_T=w_t, SPLIT_K=split,
                          out="fp32" if split > 1 else None)
    ptx = k.asm["ptx"]
    assert "wgmma.mma_async" in ptx
    assert k.metadata.shared <= 227 * 1024
    if tma:
        assert "cp.async.bulk.tensor.2d.shared" in ptx, "x / w tiles are not TMA loads"
        assert "cp.async.bulk.tensor.2d.global.shared" in ptx, "no TMA store"
        assert len(re.findall(r"tensormap\.cp_fenceproxy", ptx)) == 3  # x, w[g], out
        assert k.metadata.global_scratch_size > 0
    else:
        assert "cp.async.bulk.tensor" not in ptx and k.metadata.global_scratch_size == 0


@pytest.mark.parametrize("dtype,gated", [(F32, True), (BF16, False)])
def test_moe_tp_mlp_on_grouped_matmul(dtype, gated):
    """moe_tp_mlp(grouped_gemm="jaxtdist"): the experts' GEMMs on this kernel, at world
    2, against the float64 layer; gradients against the default (ragged_dot) path."""
    from tests.test_cpu_moe_tp import EXPERTS_W1, EXPERTS_W2, TOKENS, _reference, _routing

    world, t, k, e, h, f = 2, 5, 2, 4, 16, 32
    mesh = setup(world, ("tp",))
    rng = np.random.default_rng(7)
    x = rand((world * t, h), dtype)
    ids = _routing(rng, world * t, k, e)
    gate = rand(ids.shape, F32)
    w1, w2 = rand((e, h, f), dtype, 0.3), rand((e, f, h), dtype, 0.3)
    w_up = rand((e, h, f), dtype, 0.3) if gated else None
    specs = (TOKENS, TOKENS, TOKENS, EXPERTS_W1, EXPERTS_W2, EXPERTS_W1)

    def layer(which):
        return lambda x, i, g, a, b, c: td.moe_tp_mlp(
            x, i, g, a, b, "tp", w_up=c if gated else None, grouped_gemm=which)

    arrays = [place(mesh, a, s) for a, s in zip(
        (x, ids, gate, w1, w2, w_up if gated else w1), specs)]
    out = jax.jit(jax.shard_map(layer("jaxtdist"), mesh=mesh, in_specs=specs,
                                out_specs=TOKENS))(*arrays)
    assert out.dtype == jnp.dtype(dtype)
    assert_close(out, _reference(x, ids, gate, w1, w2, w_up), dtype, factor=2)

    def grads(which):
        loss = lambda *a: jnp.sum(layer(which)(*a).astype(jnp.float32) ** 2)  # noqa: E731
        return jax.jit(jax.shard_map(jax.grad(loss, argnums=(0, 3, 4)), mesh=mesh,
                                     in_specs=specs, out_specs=(TOKENS, EXPERTS_W1,
                                                                EXPERTS_W2)))(*arrays)

    for ours, theirs in zip(grads("jaxtdist"), grads("ragged_dot")):
        assert_close(ours, np.asarray(theirs, np.float32), dtype, factor=2)
    with pytest.raises(ValueError, match="grouped_gemm='cublas'; allowed"):
        jax.jit(jax.shard_map(layer("cublas"), mesh=mesh, in_specs=specs,
                              out_specs=TOKENS))(*arrays)
