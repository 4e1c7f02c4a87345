"""FP8 grouped GEMMs (issue 83, item 2) under the interpreter: grouped_matmul and
grouped_matmul_masked with FP8 x and K-major w [G, F, H] (per-tensor and blockwise
scales, both formats, empty / uneven / clipped groups, the TMA and pointer
mainloops, split K, every output dtype), moe_dispatch_ll(fp8=True)'s rows into
grouped_matmul_masked, moe_tp_mlp with FP8 experts at world 1 and 2, every bad
input and the refusal to differentiate. References: float64 products of the
dequantized operands (for moe_tp_mlp, of the activations quantized as the op
does), relative error ||out - ref|| / ||ref||.

Measured (Triton 3.6.0 interpreter): 1.6e-3 to 1.8e-3 with bfloat16 outputs
(its rounding), 2e-4 for float16, 1e-7 for float32; the bound is 1e-2."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxtdist as td
from tests.conftest import cpu_only, place, setup

pytestmark = cpu_only()

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32


def _rel(out, ref) -> float:
    out = np.asarray(out, np.float64)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def _deq(q, s) -> np.ndarray:
    return np.asarray(td.dequantize(q, s), np.float64)


def _weights(rng, g, h, f, dtype, scaling):
    """FP8 w [G, F, H] and its scales: blockwise or one per tensor from
    quantize_weight of the [G, H, F] stack, or one per group ("group"); and the
    float64 [G, H, F] it stands for."""
    w = (rng.standard_normal((g, h, f)) / np.sqrt(h)).astype(np.float32)
    if scaling == "group":
        pairs = [td.quantize_weight(w[i], dtype, None) for i in range(g)]
        wq, ws = jnp.stack([p[0] for p in pairs]), jnp.stack([p[1] for p in pairs])
        deq = np.stack([_deq(wq[i], ws[i]) for i in range(g)])
    else:
        wq, ws = td.quantize_weight(w, dtype, (128, 128) if scaling == "block" else None)
        deq = _deq(wq, ws)
    return wq, ws, np.swapaxes(deq, 1, 2)


def _local(fn, n_args: int):
    mesh = setup(1, ("ep",))
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P(),) * n_args, out_specs=P(),
                                 check_vma=False))


# -- grouped_matmul ----------------------------------------------------------------------

def _grouped(r, h, f, sizes, dtype, scaling, out_dtype=None, config=None, seed=0):
    rng = np.random.default_rng(seed)
    g = len(sizes)
    x = rng.standard_normal((r, h)).astype(np.float32)
    xq, xs = td.quantize(x, dtype, (1, 128) if scaling == "block" else None)
    wq, ws, w64 = _weights(rng, g, h, f, dtype, scaling)
    fn = _local(lambda a, b, c, d, e: td.grouped_matmul(
        a, b, c, x_scale=d, w_scale=e, out_dtype=out_dtype, config=config), 5)
    out = fn(xq, wq, np.asarray(sizes, np.int32), xs, ws)
    assert out.shape == (r, f) and out.dtype == jnp.dtype(out_dtype or BF16)
    x64, ref, start = _deq(xq, xs), np.zeros((r, f)), 0
    for i, n in enumerate(sizes):
        end = min(start + max(n, 0), r)
        ref[start:end] = x64[start:end] @ w64[i]
        start = end
    np.testing.assert_array_equal(np.asarray(out[start:], np.float32), 0.0)  # past the groups
    return _rel(out, ref)


# (R, H, F, sizes, format, scaling, out_dtype, config): F = 48 (16-byte rows: TMA, a
# column block of 32 reaching into the next group's weights), F = 40 (the pointer
# mainloop), F = 160 in 64-column tiles (scale blocks crossing tiles), an empty group,
# a negative size, groups clipped at R, rows past the groups, split K.
CASES = [
    (37, 256, 48, [10, 0, 20], E4M3, "block", None, None),
    (37, 256, 40, [10, 0, 20], E5M2, "block", None, None),
    (37, 256, 48, [12, 9, 30], E5M2, "tensor", F16, None),
    (37, 256, 40, [5, -3, 20], E4M3, "group", None, None),
    (24, 256, 160, [5, 3, 9, 2], E4M3, "block", None, dict(BLOCK_K=128, BLOCK_N=64)),
    (24, 128, 48, [5, 3, 9, 0], E4M3, "block", F32, dict(SPLIT_K=2)),
    (24, 256, 40, [5, 3, 9, 2], E5M2, "group", None, dict(SPLIT_K=3)),
]


@pytest.mark.parametrize("r,h,f,sizes,dtype,scaling,out_dtype,config", CASES)
def test_grouped_matmul_fp8(r, h, f, sizes, dtype, scaling, out_dtype, config):
    assert _grouped(r, h, f, sizes, dtype, scaling, out_dtype, config) < 1e-2


def test_grouped_matmul_fp8_nan_in_other_groups_weights_stays_out():
    """The TMA path reads w [G * F, H] stacked: a 32-column block at F = 48 reads
    the next group's first rows. A NaN in the empty middle group's weights must not
    reach a stored result (its scales are masked to 0, but 0 * NaN is NaN)."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((20, 128)).astype(np.float32)
    xq, xs = td.quantize(x, E5M2, (1, 128))
    wq, ws, w64 = _weights(rng, 3, 128, 48, E5M2, "block")
    wq = wq.at[1].set(jnp.asarray(np.nan, E5M2))
    out = _local(lambda a, b, c, d, e: td.grouped_matmul(a, b, c, x_scale=d, w_scale=e),
                 5)(xq, wq, np.array([8, 0, 12], np.int32), xs, ws)
    x64 = _deq(xq, xs)
    ref = np.concatenate([x64[:8] @ w64[0], x64[8:] @ w64[2]])
    assert np.all(np.isfinite(np.asarray(out, np.float32)))
    assert _rel(out, ref) < 1e-2


# -- grouped_matmul_masked ---------------------------------------------------------------

@pytest.mark.parametrize("scaling,f", [("block", 48), ("tensor", 40)])
def test_grouped_matmul_masked_fp8(scaling, f):
    rng = np.random.default_rng(4)
    g, m, h = 3, 12, 256
    x = rng.standard_normal((g, m, h)).astype(np.float32)
    xq, xs = td.quantize(x, E4M3, (1, 128) if scaling == "block" else None)
    wq, ws, w64 = _weights(rng, g, h, f, E4M3, scaling)
    valid = np.array([5, 0, 12], np.int32)
    out = _local(lambda a, b, c, d, e: td.grouped_matmul_masked(a, b, c, x_scale=d,
                                                                w_scale=e), 5)(
        xq, wq, valid, xs, ws)
    assert out.shape == (g, m, f) and out.dtype == BF16
    x64 = _deq(xq, xs)
    got = np.concatenate([np.asarray(out[i, :n], np.float64) for i, n in enumerate(valid)])
    ref = np.concatenate([x64[i, :n] @ w64[i] for i, n in enumerate(valid)])
    assert _rel(got, ref) < 1e-2


def test_moe_dispatch_ll_fp8_rows_into_grouped_matmul_masked():
    """The low-latency decode path in FP8: moe_dispatch_ll(fp8=True)'s recv_x
    (e4m3) and recv_scale [E / W, W * M, H / 128] go straight into the masked FP8
    GEMM with quantize_weight's experts; each expert's valid rows match the float64
    product of the dequantized rows and weights."""
    world, t, h, f, e = 2, 3, 128, 48, 4
    mesh = setup(world, ("tp",))
    rng = np.random.default_rng(5)
    wq, ws, w64 = _weights(rng, e, h, f, E4M3, "block")
    spec = P("tp")

    def body(x, ids, wq, ws):
        (q, s), counts, _ = td.moe_dispatch_ll(x, ids, "tp", num_experts=e, fp8=True)
        y = td.grouped_matmul_masked(q, wq, counts, x_scale=s, w_scale=ws)
        return q[None], s[None], jnp.sum(counts, axis=1)[None], y[None]

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 4,
                               out_specs=(spec,) * 4, check_vma=False))
    x = jnp.asarray(rng.standard_normal((world * t, h)), BF16)
    ids = np.stack([rng.permutation(e)[:2] for _ in range(world * t)]).astype(np.int32)
    q, s, counts, y = fn(place(mesh, x, spec), place(mesh, ids, spec),
                         place(mesh, wq, spec), place(mesh, ws, spec))
    got, ref = [], []
    for d in range(world):
        for le in range(e // world):
            n = int(counts[d, le])
            rows = _deq(q[d, le, :n], s[d, le, :n])
            got.append(np.asarray(y[d, le, :n], np.float64))
            ref.append(rows @ w64[d * (e // world) + le])
    assert sum(len(a) for a in got) == world * t * 2
    assert _rel(np.concatenate(got), np.concatenate(ref)) < 1e-2


# -- moe_tp_mlp --------------------------------------------------------------------------

def _silu(a):
    return a / (1.0 + np.exp(-a))


def _quantized64(a, dtype, scaling) -> np.ndarray:
    """``a`` as the op quantizes it (1 x 128 blocks or per tensor), dequantized."""
    q, s = td.quantize(jnp.asarray(a, F32), dtype, (1, 128) if scaling == "block" else None)
    return _deq(q, s)


def _moe_reference(x, ids, gate, w1, w2, w_up, dtype, scaling) -> np.ndarray:
    """float64 of the whole layer on every rank's tokens, the activations quantized
    as the op does (tokens once, the hidden rows of all pairs together: the same
    scales as the op's, per row blockwise; per tensor, one over all gathered rows),
    the FFN shards' partial sums added."""
    xq = _quantized64(np.asarray(x, np.float32), dtype, scaling)
    hidden = []  # per shard: [T * K, F_shard] in pair order, then quantized together
    for w1s, w2s, wups in zip(w1, w2, w_up or [None] * len(w1)):
        rows = np.stack([xq[t] for t in range(len(ids)) for _ in ids[t]])
        es = ids.reshape(-1)
        h = _silu(np.einsum("ph,phf->pf", rows, w1s[es]))
        if wups is not None:
            h = h * np.einsum("ph,phf->pf", rows, wups[es])
        hq = _quantized64(h, dtype, scaling)
        y = np.einsum("pf,pfh->ph", hq, w2s[es]).reshape(*ids.shape, -1)
        hidden.append(np.sum(np.asarray(gate, np.float64)[:, :, None] * y, axis=1))
    return sum(hidden)


# (World 2 with gated blockwise experts: test_moe_tp_mlp_sharded_fp8.)
@pytest.mark.parametrize("world,gated,dtype,scaling", [
    (1, True, E4M3, "block"), (2, False, E5M2, "tensor")])
def test_moe_tp_mlp_fp8(world, gated, dtype, scaling):
    t, k, e, h, f = 5, 2, 4, 128, 128 * world
    mesh = setup(world, ("tp",))
    rng = np.random.default_rng(world + 10 * gated)
    x = jnp.asarray(rng.standard_normal((world * t, h)), BF16)
    ids = np.stack([rng.permutation(e)[:k] for _ in range(world * t)]).astype(np.int32)
    gate = rng.random((world * t, k)).astype(np.float32)
    wb = (128, 128) if scaling == "block" else None
    shard = f // world

    def experts(n):  # each rank's shard quantized on its own, as a checkpoint's would be
        w1 = [(rng.standard_normal((e, h, shard)) / np.sqrt(h)).astype(np.float32)
              for _ in range(world)]
        w2 = [(rng.standard_normal((e, shard, h)) / np.sqrt(f)).astype(np.float32)
              for _ in range(world)]
        return w1, w2

    w1, w2 = experts(0)
    w_up = experts(1)[0] if gated else None
    q1 = [td.quantize_weight(a, dtype, wb) for a in w1]           # [E, F_shard, H]
    q2 = [td.quantize_weight(a, dtype, wb) for a in w2]           # [E, H, F_shard]
    qu = [td.quantize_weight(a, dtype, wb) for a in w_up] if gated else None
    deq1 = [np.swapaxes(_deq(*p), 1, 2) for p in q1]
    deq2 = [np.swapaxes(_deq(*p), 1, 2) for p in q2]
    dequ = [np.swapaxes(_deq(*p), 1, 2) for p in qu] if gated else None
    ref = _moe_reference(x.astype(F32), ids, gate, deq1, deq2, dequ, dtype, scaling)

    def cat(pairs, axis, scale_axis):
        scales = [s for _, s in pairs]
        s = (jnp.concatenate(scales, scale_axis) if scaling == "block"
             else jnp.stack(scales))  # per tensor: one per rank, [world]
        return jnp.concatenate([q for q, _ in pairs], axis), s

    arrays = [x, ids, gate, *cat(q1, 1, 1), *cat(q2, 2, 2)] + (list(cat(qu, 1, 1))
                                                              if gated else [])
    tok, w1spec, w2spec = P("tp", None), P(None, "tp", None), P(None, None, "tp")
    s1 = w1spec if scaling == "block" else P("tp")
    s2 = w2spec if scaling == "block" else P("tp")
    specs = (tok, tok, tok, w1spec, s1, w2spec, s2) + ((w1spec, s1) if gated else ())

    def body(x, i, g, a, sa, b, sb, *up):
        if scaling == "tensor":
            sa, sb = sa.reshape(()), sb.reshape(())
            up = (up[0], up[1].reshape(())) if up else ()
        return td.moe_tp_mlp(x, i, g, a, b, "tp", w1_scale=sa, w2_scale=sb,
                             w_up=up[0] if up else None, w_up_scale=up[1] if up else None)

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=tok,
                               check_vma=False))
    out = fn(*(place(mesh, a, s) for a, s in zip(arrays, specs)))
    assert out.dtype == BF16 and out.shape == (world * t, h)
    assert _rel(out, ref) < 1e-2


# -- bad input -----------------------------------------------------------------------------

def test_grouped_fp8_bad_input():
    g, r, h, f = 3, 8, 256, 48
    xq, wq = jnp.ones((r, h), E4M3), jnp.ones((g, f, h), E4M3)
    one = jnp.float32(1)
    xb, wb = jnp.ones((r, 2), F32), jnp.ones((g, 1, 2), F32)
    sizes = jnp.array([3, 2, 3], jnp.int32)
    cases = [
        (dict(x_scale=one), "w_scale is missing"),
        (dict(w_scale=one), "x_scale is missing"),
        (dict(x=xq.astype(BF16), w=jnp.ones((g, h, f), BF16), x_scale=one, w_scale=one),
         "x_scale is given but x and w are bfloat16"),
        (dict(x=xq.astype(BF16), w=jnp.ones((g, h, f), BF16), out_dtype=F32),
         "out_dtype is given"),
        (dict(w=wq.astype(E5M2), x_scale=one, w_scale=one), "same FP8 format"),
        (dict(w=wq.astype(BF16), x_scale=one, w_scale=one), "same FP8 format"),
        (dict(x_scale=jnp.bfloat16(1), w_scale=one), "x_scale has dtype bfloat16"),
        (dict(x_scale=one, w_scale=jnp.ones((g,), F16)), "w_scale has dtype float16"),
        (dict(x_scale=one, w_scale=1.0), "w_scale must be a float32 array"),
        (dict(w=jnp.ones((g, h, f), E4M3), x_scale=one, w_scale=one),
         "looks like \\[G, H, F\\].*quantize_weight"),
        (dict(w=jnp.ones((g, f, 64), E4M3), x_scale=one, w_scale=one), "does not match"),
        (dict(x_scale=one, w_scale=jnp.ones((2,), F32)), "mix per-tensor and blockwise"),
        (dict(x_scale=xb, w_scale=one), "mix per-tensor and blockwise"),
        (dict(x_scale=xb, w_scale=jnp.ones((g, 2, 2), F32)),
         "w_scale\\[3, 2, 2\\] do not fit.*w_scale \\[3, 1, 2\\]"),
        (dict(x_scale=jnp.ones((r, 3), F32), w_scale=wb), "x_scale is \\[8, 2\\]"),
        (dict(x=jnp.ones((r, 200), E4M3), w=jnp.ones((g, f, 200), E4M3),
              x_scale=jnp.ones((r, 1), F32), w_scale=wb), "H a multiple of 128, got H=200"),
        (dict(x_scale=one, w_scale=one, out_dtype=E4M3), "out_dtype=float8_e4m3fn"),
        (dict(sizes=jnp.array([1, 2], jnp.int32), x_scale=one, w_scale=one),
         "group_sizes must be integers with one entry per group"),
    ]
    for kwargs, match in cases:
        kwargs = dict(kwargs)
        x, w, s = kwargs.pop("x", xq), kwargs.pop("w", wq), kwargs.pop("sizes", sizes)
        with pytest.raises(ValueError, match=match):
            td.grouped_matmul(x, w, s, **kwargs)
    # The masked layout's scales are [G, M, H / 128].
    with pytest.raises(ValueError, match="x_scale is \\[3, 4, 2\\]"):
        td.grouped_matmul_masked(jnp.ones((g, 4, h), E4M3), wq, sizes, x_scale=xb,
                                 w_scale=wb)
    with pytest.raises(ValueError, match="looks like \\[G, H, F\\]"):
        td.grouped_matmul_masked(jnp.ones((g, 4, h), E4M3), jnp.ones((g, h, f), E4M3),
                                 sizes, x_scale=one, w_scale=one)
    # A K step that spans two scale blocks (the config resolves inside shard_map).
    fn = _local(lambda a, b, c, d, e: td.grouped_matmul(a, b, c, x_scale=d, w_scale=e,
                                                        config=dict(BLOCK_K=256)), 5)
    with pytest.raises(ValueError, match="BLOCK_K=256 does not divide 128"):
        fn(xq, wq, sizes, xb, wb)


def test_moe_tp_mlp_fp8_bad_input():
    mesh = setup(1, ("tp",))
    t, k, e, h, f = 4, 2, 4, 256, 128
    x, ids, gate = jnp.ones((t, h), BF16), jnp.zeros((t, k), jnp.int32), jnp.ones((t, k), F32)
    w1, w2 = jnp.ones((e, f, h), E4M3), jnp.ones((e, h, f), E4M3)
    s1, s2 = jnp.ones((e, 1, 2), F32), jnp.ones((e, 2, 1), F32)
    one = jnp.float32(1)
    cases = [
        (dict(w2_scale=s2), "w1_scale is missing"),
        (dict(w1_scale=s1), "w2_scale is missing"),
        (dict(w1=jnp.ones((e, h, f), BF16), w2=jnp.ones((e, f, h), BF16), w1_scale=s1,
              w2_scale=s2), "w1_scale is given but the expert weights are .*bfloat16"),
        (dict(w2=w2.astype(E5M2), w1_scale=s1, w2_scale=s2), "same FP8 format"),
        (dict(w1_scale=s1.astype(BF16), w2_scale=s2), "w1_scale is bfloat16"),
        (dict(w1=jnp.ones((e, h, f), E4M3), w1_scale=s1, w2_scale=s2),
         "looks like \\[E, H, F_shard\\]"),
        (dict(w2=jnp.ones((e, f, h), E4M3), w1_scale=s1, w2_scale=s2),
         "FP8 w2 must be \\[E, H, F_shard\\]"),
        (dict(w1_scale=s1, w2_scale=one), "mix per-tensor and blockwise"),
        (dict(w1_scale=jnp.ones((e, 2, 2), F32), w2_scale=s2), "w1_scale\\[4, 2, 2\\] does not"),
        (dict(w1=jnp.ones((e, 64, h), E4M3), w2=jnp.ones((e, h, 64), E4M3), w1_scale=s1,
              w2_scale=jnp.ones((e, 2, 1), F32)), "F_shard for w2\\), got 64"),
        (dict(x=x.astype(E4M3), w1_scale=s1, w2_scale=s2), "x is float8_e4m3fn"),
        (dict(w1_scale=s1, w2_scale=s2, w_up=w1), "w_up_scale is missing"),
        (dict(w1_scale=s1, w2_scale=s2, overlap=True), "overlap=True with FP8"),
        (dict(w1_scale=s1, w2_scale=s2, grouped_gemm="ragged_dot"),
         "grouped_gemm='ragged_dot' with FP8"),
    ]
    for kwargs, match in cases:
        kwargs = dict(kwargs)
        args = [kwargs.pop(n, v) for n, v in (("x", x), ("w1", w1), ("w2", w2))]

        def body(xx, a, b, kwargs=kwargs):
            return td.moe_tp_mlp(xx, ids, gate, a, b, "tp", **kwargs)

        fn = jax.shard_map(body, mesh=mesh, in_specs=(P(),) * 3, out_specs=P(),
                           check_vma=False)
        with pytest.raises(ValueError, match=match):
            jax.jit(fn)(*args)


# -- gradients ----------------------------------------------------------------------------

def test_fp8_grouped_ops_are_not_differentiable():
    wq, ws = td.quantize_weight(jnp.ones((2, 128, 32)), block=None)
    sizes = jnp.array([3, 1], jnp.int32)

    def loss(x):
        q, s = td.quantize(x)
        y = _local(lambda q, s, w, ws: td.grouped_matmul(q, w, sizes, x_scale=s, w_scale=ws),
                   4)(q, s, wq, ws)
        return jnp.sum(y.astype(F32))

    x = jnp.ones((4, 128))
    assert np.isfinite(float(loss(x)))
    with pytest.raises(TypeError, match="grouped_matmul: the FP8 path is not differentiable: "
                                        "its arguments x, x_scale carry no gradient"):
        jax.grad(loss)(x)

    mesh = setup(1, ("tp",))
    w1q, w1s = td.quantize_weight(jnp.ones((2, 128, 128)) / 128)
    w2q, w2s = td.quantize_weight(jnp.ones((2, 128, 128)) / 128)
    ids, gate = jnp.zeros((4, 1), jnp.int32), jnp.ones((4, 1), F32)

    def moe_loss(x):
        y = jax.shard_map(lambda x: td.moe_tp_mlp(x, ids, gate, w1q, w2q, "tp", w1_scale=w1s,
                                                  w2_scale=w2s),
                          mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False)(x)
        return jnp.sum(y.astype(F32))

    with pytest.raises(TypeError, match="moe_tp_mlp: the FP8 path is not differentiable: its "
                                        "arguments x carry no gradient"):
        jax.grad(moe_loss)(x.astype(BF16))


def test_fp8_grouped_variants_leave_the_op_names_to_the_16_bit_ops():
    """jaxtdist.explain finds ops by name: the FP8 declarations must not take it over."""
    import importlib

    from jaxtdist.ops._op import distributed_op

    gm = importlib.import_module("jaxtdist.ops.grouped_matmul")
    masked = importlib.import_module("jaxtdist.ops.grouped_matmul_masked")
    assert distributed_op("grouped_matmul") is gm._GROUPED_MATMUL
    assert distributed_op("grouped_matmul_masked") is masked._MASKED


def test_moe_tp_mlp_sharded_fp8():
    """The pjit-style wrapper with gated FP8 experts (global quantize_weight, F over
    "tp", blockwise scales sharded with their weights) at world 2, against the
    float64 reference of the layer on the per-rank shards."""
    world, t, k, e, h, f = 2, 3, 2, 4, 128, 256
    setup(world, ("tp",))
    rng = np.random.default_rng(8)
    x = jnp.asarray(rng.standard_normal((world * t, h)), BF16)
    ids = np.stack([rng.permutation(e)[:k] for _ in range(world * t)]).astype(np.int32)
    gate = rng.random((world * t, k)).astype(np.float32)
    quantized = [td.quantize_weight(rng.standard_normal(shape).astype(np.float32) / 16)
                 for shape in ((e, h, f), (e, f, h), (e, h, f))]      # w1, w2, w_up
    (w1q, w1s), (w2q, w2s), (wuq, wus) = quantized
    out = jax.jit(lambda x, i, g, a, sa, b, sb, c, sc: td.moe_tp_mlp_sharded(
        x, i, g, a, b, axis_name="tp", w1_scale=sa, w2_scale=sb, w_up=c, w_up_scale=sc))(
        x, ids, gate, w1q, w1s, w2q, w2s, wuq, wus)
    assert out.dtype == BF16 and out.shape == x.shape
    deq = [np.swapaxes(_deq(q, s_), 1, 2) for q, s_ in quantized]   # [E, H, F], [E, F, H]
    shard = f // world
    split = [[a[:, :, r * shard:(r + 1) * shard] for r in range(world)] for a in deq[::2]]
    w2_shards = [deq[1][:, r * shard:(r + 1) * shard] for r in range(world)]
    ref = _moe_reference(x.astype(F32), ids, gate, split[0], w2_shards, split[1], E4M3,
                         "block")
    assert _rel(out, ref) < 1e-2
