"""FP8 GEMMs (issue 83) under the interpreter: the quantizer (round trip,
saturation, blockwise shapes), the GEMM core's FP8 mainloops (per-tensor and
blockwise scales, both formats, odd M, TMA and pointer loads, split K) through
ag_matmul, matmul_rs and matmul_ar at world 1 (kernels forced) and 2/4
(shard_map), each against the float64 product of the dequantized operands,
the world-1 XLA path, every bad input and the refusal to differentiate.

Measured (Triton 3.6.0 interpreter, bfloat16 output): relative errors
1.6e-3 to 1.7e-3 on every case, the bfloat16 rounding of the output; the bound
is 1e-2."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxtdist as td
from jaxtdist.ops.matmul_rs import fp8_matmul_kernels
from tests.conftest import cpu_only, place, setup

pytestmark = cpu_only()

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
# Where each op's shards and result live over "tp".
_OUT = {"ag_matmul": P(None, "tp"), "matmul_rs": P("tp", None), "matmul_ar": P()}


def _rel(out, ref) -> float:
    out = np.asarray(out, np.float64)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def _shards(op: str, world: int, m: int, n: int, k: int, dtype, block: bool, seed: int):
    """Each rank's FP8 operands quantized on their own (as a rank would), stacked in
    the op's global layout with their specs, and the float64 reference."""
    rng = np.random.default_rng(seed)
    xb, wb = ((1, 128), (128, 128)) if block else (None, None)
    xs, ws = [], []
    for _ in range(world):
        x = rng.standard_normal((m, k)).astype(np.float32)
        w = rng.standard_normal((k, n)).astype(np.float32) / np.sqrt(k)
        xs.append(td.quantize(x, dtype, xb))
        ws.append(td.quantize_weight(w, dtype, wb))
    deq_x = [np.asarray(td.dequantize(q, s), np.float64) for q, s in xs]
    deq_w = [np.asarray(td.dequantize(q, s), np.float64).T for q, s in ws]
    if op == "ag_matmul":  # rows of x, columns of the output (rows of w [N, K])
        axis_x = axis_w = 0
        ref = np.concatenate(deq_x) @ np.concatenate(deq_w, axis=1)
    else:  # K: columns of x and of w [N, K]; the sum over ranks
        axis_x = axis_w = 1
        ref = sum(a @ b for a, b in zip(deq_x, deq_w))
    spec2 = P("tp", None) if axis_x == 0 else P(None, "tp")
    arrays = [jnp.concatenate([q for q, _ in xs], axis_x),
              jnp.concatenate([q for q, _ in ws], axis_w)]
    if block:
        arrays += [jnp.concatenate([s for _, s in xs], axis_x),
                   jnp.concatenate([s for _, s in ws], axis_w)]
        specs = (spec2, spec2, spec2, spec2)
    else:  # one scale per rank and operand
        arrays += [jnp.stack([s for _, s in xs]), jnp.stack([s for _, s in ws])]
        specs = (spec2, spec2, P("tp"), P("tp"))
    return arrays, specs, ref


def _run(op: str, world: int, m: int, n: int, k: int, dtype, block: bool, *,
         config=None, forced=False, out_dtype=None, seed=0) -> float:
    mesh = setup(world, ("tp",))
    arrays, specs, ref = _shards(op, world, m, n, k, dtype, block, seed)

    def f(x, w, xs, ws):
        if not block:
            xs, ws = xs.reshape(()), ws.reshape(())
        if forced:
            return fp8_matmul_kernels(op, x, w, "tp", x_scale=xs, w_scale=ws,
                                      out_dtype=out_dtype, config=config)
        return getattr(td, op)(x, w, "tp", x_scale=xs, w_scale=ws, out_dtype=out_dtype,
                               config=config)

    g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=specs, out_specs=_OUT[op],
                              check_vma=False))
    out = g(*(place(mesh, a, s) for a, s in zip(arrays, specs)))
    assert out.dtype == jnp.dtype(out_dtype or jnp.bfloat16)
    assert out.shape == ref.shape
    return _rel(out, ref)


# -- the quantizer ---------------------------------------------------------------------

@pytest.mark.parametrize("dtype,bound", [(E4M3, 0.04), (E5M2, 0.08)])
@pytest.mark.parametrize("block,scale_shape", [(None, ()), ((1, 128), (5, 2)),
                                               ((128, 128), (1, 2))])
def test_quantize_round_trip(dtype, bound, block, scale_shape):
    x = np.random.default_rng(1).standard_normal((5, 256)).astype(np.float32) * 3
    q, s = td.quantize(x, dtype, block)
    assert q.dtype == jnp.dtype(dtype) and s.dtype == jnp.float32 and s.shape == scale_shape
    assert _rel(td.dequantize(q, s), x) < bound
    # The largest magnitude of every block lands on the format's largest value.
    assert float(jnp.max(jnp.abs(q.astype(jnp.float32)))) == float(jnp.finfo(dtype).max)


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_quantize_saturates_never_inf_or_nan(dtype):
    fmax = float(jnp.finfo(dtype).max)
    x = jnp.array([1.0, 2 * fmax, -10 * fmax, jnp.inf, -jnp.inf, jnp.nan, 0.0], jnp.float32)
    q, s = td.quantize(x, dtype, scale=jnp.float32(1.0))
    got = np.asarray(q.astype(jnp.float32))
    np.testing.assert_array_equal(got[:5], [1.0, fmax, -fmax, fmax, -fmax])
    assert np.isnan(got[5]) and got[6] == 0.0
    # amax from the finite values: inf saturates, the finite values keep their scale.
    q, s = td.quantize(x[jnp.array([0, 3])], dtype)
    assert float(s) == pytest.approx(1.0 / fmax)
    np.testing.assert_array_equal(np.asarray(q.astype(jnp.float32)), [fmax, fmax])
    # An all-zero block: scale 1, zeros.
    q, s = td.quantize(jnp.zeros((2, 128)), dtype, (1, 128))
    assert np.all(np.asarray(s) == 1.0) and not np.any(np.asarray(q.astype(jnp.float32)))


def test_quantize_weight_is_k_major_with_hf_scales():
    w = np.random.default_rng(2).standard_normal((256, 300)).astype(np.float32)  # [K, N]
    wt, s = td.quantize_weight(w)
    assert wt.shape == (300, 256) and s.shape == (3, 2)  # [N, K], [cdiv(N, 128), K / 128]
    assert _rel(np.asarray(td.dequantize(wt, s)).T, w) < 0.04
    wt, s = td.quantize_weight(w, E5M2, block=None)
    assert wt.dtype == jnp.dtype(E5M2) and s.shape == ()


def test_quantizer_errors():
    x = jnp.ones((4, 256))
    for call, match in [
            (lambda: td.quantize(x, jnp.bfloat16), "not an FP8 format"),
            (lambda: td.quantize(x, block=(1, 64)), "block=\\(1, 64\\) is not supported"),
            (lambda: td.quantize(jnp.ones((4, 100)), block=(1, 128)),
             "last a multiple of 128"),
            (lambda: td.quantize(x, scale=jnp.ones((2,))), "float32 scalar"),
            (lambda: td.quantize(x, block=(1, 128), scale=jnp.float32(1)), "block=None only"),
            (lambda: td.quantize(jnp.ones((4,), jnp.int32)), "give a float array"),
            (lambda: td.dequantize(x, jnp.float32(1)), "q has dtype float32"),
            (lambda: td.dequantize(x.astype(E4M3), jnp.ones((3, 3), jnp.float32)),
             "fits no block layout"),
            (lambda: td.dequantize(x.astype(E4M3), jnp.bfloat16(1)), "must be float32")]:
        with pytest.raises(ValueError, match=match):
            call()


# -- the kernels ---------------------------------------------------------------------

@pytest.mark.parametrize("op,m,dtype,block,config", [
    ("matmul_ar", 7, E4M3, False, None),                              # TMA mainloop
    ("matmul_ar", 7, E5M2, True, dict(TMA=False, SPLIT_K=2)),         # pointer, split K
    ("matmul_rs", 33, E4M3, True, None),                              # TMA, odd rows
    ("ag_matmul", 5, E5M2, False, None),                              # pointer, all rows
    ("ag_matmul", 32, E4M3, True, dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, TMA=True,
                                       PRODUCER="ce")),               # copy-engine TMA
])
def test_fp8_kernels_at_world_1(op, m, dtype, block, config):
    err = _run(op, 1, m, 160, 256, dtype, block, config=config, forced=True)
    assert err < 1e-2, err


@pytest.mark.parametrize("op,world,m,n,k,dtype,block,out_dtype,config", [
    ("ag_matmul", 2, 9, 32, 256, E4M3, True, None, None),
    # Copy-engine pushes, TMA tiles and a stream-K tail (4 tiles on 3 programs: one
    # peer tile cut into runs of 3 K steps, across the 128-column scale blocks).
    ("ag_matmul", 2, 16, 32, 256, E5M2, True, None,
     dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, TMA=True, PRODUCER="ce", STREAM_K=True)),
    ("matmul_rs", 2, 14, 160, 256, E5M2, False, jnp.float32, None),
    ("matmul_ar", 2, 5, 160, 256, E4M3, True, jnp.float16, None),
    ("matmul_ar", 4, 3, 32, 128, E4M3, False, None, None),
])
def test_fp8_ops_over_ranks(op, world, m, n, k, dtype, block, out_dtype, config,
                            ce_launches):
    err = _run(op, world, m, n, k, dtype, block, out_dtype=out_dtype, config=config)
    assert err < 1e-2, err
    if config and config.get("STREAM_K"):
        assert [c["TAIL_TILES"] for c in ce_launches] == [1], "no stream-K tail ran"


@pytest.mark.parametrize("op", ["ag_matmul", "matmul_rs", "matmul_ar"])
@pytest.mark.parametrize("block", [False, True])
def test_fp8_world_1_runs_xla(op, block):
    """A group of one rank: XLA's FP8 dot (per tensor) or the dequantized dot."""
    assert _run(op, 1, 6, 160, 256, E4M3, block) < 1e-2


# -- bad input -------------------------------------------------------------------------

def test_fp8_bad_input():
    q = jnp.ones((8, 256), E4M3)
    wt = jnp.ones((160, 256), E4M3)
    one = jnp.float32(1)
    xb, wb = jnp.ones((8, 2), jnp.float32), jnp.ones((2, 2), jnp.float32)
    cases = [
        (dict(w=wt), "x_scale is missing"),
        (dict(w=wt, x_scale=one), "w_scale is missing"),
        (dict(x=q.astype(jnp.bfloat16), w=wt.astype(jnp.bfloat16), x_scale=one, w_scale=one),
         "x_scale is given but x and w are bfloat16"),
        (dict(x=q.astype(jnp.bfloat16), w=wt.astype(jnp.bfloat16), out_dtype=jnp.float32),
         "out_dtype is given"),
        (dict(w=wt.astype(E5M2), x_scale=one, w_scale=one), "same FP8 format"),
        (dict(w=wt.astype(jnp.bfloat16), x_scale=one, w_scale=one), "same FP8 format"),
        (dict(w=wt, x_scale=jnp.bfloat16(1), w_scale=one), "x_scale has dtype bfloat16"),
        (dict(w=wt, x_scale=one, w_scale=jnp.ones((), jnp.float16)),
         "w_scale has dtype float16"),
        (dict(w=wt.T, x_scale=one, w_scale=one), "looks like \\[K, N\\]: FP8 weights are K-major"),
        (dict(w=wt, x_scale=xb, w_scale=jnp.ones((1, 2), jnp.float32)), "w_scale\\[2, 2\\]"),
        (dict(w=wt, x_scale=jnp.ones((8, 3), jnp.float32), w_scale=wb), "do not fit"),
        (dict(w=wt, x_scale=xb, w_scale=one), "both per tensor"),
        (dict(x=q[:, :200], w=wt[:, :200], x_scale=xb, w_scale=wb),
         "K a multiple of 128, got K=200"),
        (dict(w=wt, x_scale=one, w_scale=one, out_dtype=E4M3), "out_dtype=float8_e4m3fn"),
    ]
    for op in ("ag_matmul", "matmul_rs", "matmul_ar"):
        for kwargs, match in cases:
            kwargs = dict(kwargs)
            x, w = kwargs.pop("x", q), kwargs.pop("w")
            with pytest.raises(ValueError, match=match):
                getattr(td, op)(x, w, "tp", **kwargs)
    with pytest.raises(ValueError, match="takes one weight"):
        td.ag_matmul(q, (wt, wt), "tp", x_scale=one, w_scale=one)
    # A K step that spans two scale blocks, under shard_map (the config resolves there).
    mesh = setup(1, ("tp",))
    f = jax.shard_map(lambda x, w, xs, ws: fp8_matmul_kernels(
        "matmul_ar", x, w, "tp", x_scale=xs, w_scale=ws, config=dict(BLOCK_K=256)),
        mesh=mesh, in_specs=(P(),) * 4, out_specs=P(), check_vma=False)
    with pytest.raises(ValueError, match="BLOCK_K=256 does not divide 128"):
        jax.jit(f)(q, wt, xb, wb)


def test_fp8_is_not_differentiable():
    mesh = setup(1, ("tp",))
    wt, ws = td.quantize_weight(jnp.ones((256, 32)), block=None)

    def loss(x):
        q, s = td.quantize(x)
        y = jax.shard_map(lambda q, s, w, ws: td.matmul_ar(q, w, "tp", x_scale=s, w_scale=ws),
                          mesh=mesh, in_specs=(P(),) * 4, out_specs=P(),
                          check_vma=False)(q, s, wt, ws)
        return jnp.sum(y.astype(jnp.float32))

    x = jnp.ones((4, 256))
    assert np.isfinite(float(jax.jit(loss)(x)))
    with pytest.raises(TypeError, match="matmul_ar: the FP8 path is not differentiable: its "
                                        "arguments x, x_scale carry no gradient"):
        jax.grad(loss)(x)


# -- the benchmark ---------------------------------------------------------------------

def test_fp8_gemm_benchmark_runs_every_contender(faked_timing):
    """``python -m jaxtdist.bench gemm --dtype fp8`` on a small shape (CPU, faked
    timing): every contender runs and is checked against its float32 reference;
    the table has the ratios."""
    from jaxtdist.bench import gemm, gemm_fp8

    rows = gemm_fp8.bench_gemm_fp8([("matmul_ar", 8, 32, 128)], iterations=1, rounds=1)
    for name in ("bf16_dot", "xla_fp8", "tensor", "dequant_bf16", "block"):
        assert rows[0][name]["rel_err"] < 2e-2, (name, rows[0][name])
    text = gemm.table(dict(device="cpu", rows=rows, iterations=1, rounds=1, dtype="fp8"))
    assert "per-tensor / XLA FP8" in text and "tensor / xla_fp8: geomean" in text


def test_fp8_ops_leave_the_op_names_to_the_16_bit_ops():
    """jaxtdist.explain finds ops by name: the FP8 declarations, which share their
    op's name (errors say jaxtdist.ag_matmul), must not take it over."""
    import importlib

    from jaxtdist.ops._op import distributed_op

    ag = importlib.import_module("jaxtdist.ops.ag_matmul")
    rs = importlib.import_module("jaxtdist.ops.matmul_rs")
    assert distributed_op("ag_matmul") is ag._AG_MATMUL
    assert distributed_op("matmul_rs") is rs._MATMUL_RS
    assert distributed_op("matmul_ar") is rs._MATMUL_AR
