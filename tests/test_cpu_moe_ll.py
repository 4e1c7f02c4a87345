"""jaxtdist.moe_dispatch_ll / moe_combine_ll (the low-latency, expert-major padded
layout) on CPU devices under the Triton interpreter, against a numpy reference:
every valid slot of recv_x, the counts, the tokens' t * K + k, and the combined
layer; chained calls with changing routings; FP8 dispatch; bad inputs; grad."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxtdist as td
from jaxtdist.ops.moe import ll_heap_bytes
from tests.conftest import cpu_only, f64, place, rand, rel_err, setup
from tests.fp8_rounding import dispatch_roundtrip

pytestmark = cpu_only()

BF16, F32 = jnp.bfloat16, jnp.float32
TP = P("tp")


def routing(kind: str, world: int, t: int, k: int, e: int, rng) -> np.ndarray:
    """[world * T, K] int32 ids of one of the routing kinds (distinct per token
    unless ``kind`` is "invalid")."""
    n = world * t
    ids = np.stack([rng.permutation(e)[:k] for _ in range(n)]).astype(np.int32)
    if kind == "skewed":  # most tokens to experts 0 and 1 (then others)
        for i in np.flatnonzero(rng.random(n) < 0.8):  # rows in place (a mask copies)
            ids[i] = [0, 1][:k] + [x for x in rng.permutation(e) if x > 1][:max(0, k - 2)]
    elif kind == "one_expert":  # every token to the last expert first
        for row in ids:
            row[:] = [e - 1] + [x for x in rng.permutation(e - 1)][:k - 1]
    elif kind == "empty":  # experts 0 .. e/2 - 1 get nothing
        ids = np.stack([e // 2 + rng.permutation(e // 2)[:k] for _ in range(n)]).astype(np.int32)
    elif kind == "invalid":  # ids out of range and repeats: not sent, weigh zero
        ids[::3, 0] = e + 1
        ids[1::3, -1] = -1
        if k > 1:
            ids[2::3, 1] = ids[2::3, 0]
    return ids


def ref_layout(ids, world, e, m):
    """Per rank d: counts [E_LOC, W] and, per (le, s), the list of (t, k) at s."""
    t = ids.shape[0] // world
    e_loc = e // world
    idss = ids.reshape(world, t, -1)
    counts = np.zeros((world, e_loc, world), np.int64)
    slots = {}
    for s in range(world):
        for tt in range(t):
            seen = set()
            for kk, g in enumerate(idss[s, tt]):
                if 0 <= g < e and g not in seen:
                    seen.add(g)
                    d, le = divmod(int(g), e_loc)
                    slots.setdefault((d, le, s), []).append((tt, kk))
                    counts[d, le, s] += 1
    assert counts.max(initial=0) <= m
    return counts, slots


def valid_mask(ids, e):
    """[N, K]: in range and not a repeat of an earlier k of the token."""
    ok = (ids >= 0) & (ids < e)
    for kk in range(1, ids.shape[1]):
        ok[:, kk] &= ~np.any(ids[:, :kk] == ids[:, kk:kk + 1], axis=1)
    return ok


def _layer(mesh, e, m=None, fp8=False):
    """shard_map'd dispatch -> experts (y = recv * (1 + le)) -> combine."""
    def body(x, ids, gate):
        recv, counts, handle = td.moe_dispatch_ll(x, ids, "tp", num_experts=e,
                                                  max_tokens_per_rank=m, fp8=fp8)
        if fp8:
            q, s = recv
            cols = jnp.repeat(s, 128, axis=2)[:, :, :q.shape[2]]  # 1 x 128 blocks
            recv = (q.astype(F32) * cols).astype(x.dtype)
            scales = s[None]
        else:
            scales = jnp.zeros((1,), F32)
        scale = 1.0 + jnp.arange(recv.shape[0], dtype=F32)[:, None, None]
        y = (recv.astype(F32) * scale).astype(x.dtype)
        out = td.moe_combine_ll(y, handle, gate, "tp")
        return recv[None], counts[None], handle.src_tk[None], handle.invalid[None], out, scales

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(TP, TP, TP),
                                 out_specs=(TP, TP, TP, TP, TP, TP)))


def _check(outs, x, ids, gate, world, e, m, dtype, fp8=False):
    recv, counts, src_tk, invalid, out, _ = (np.asarray(v.astype(F32)) if v.dtype == BF16
                                             else np.asarray(v) for v in outs)
    t, k = x.shape[0] // world, ids.shape[1]
    e_loc = e // world
    rcounts, slots = ref_layout(ids, world, e, m)
    np.testing.assert_array_equal(counts, rcounts)
    xs = np.asarray(jnp.asarray(x).astype(F32), np.float64).reshape(world, t, -1)
    for (d, le, s), pairs in slots.items():
        first = int(rcounts[d, le, :s].sum())  # packed per expert, source by source
        rows = recv[d, le, first: first + len(pairs)]
        want = np.stack([xs[s, tt] for tt, _ in pairs])
        if fp8:  # the rows as the kernel quantizes them (the interpreter's rounding on
            # CPUs): an ulp of x / scale may flip a rounding, no more
            gpu = jax.devices()[0].platform == "gpu"
            assert rel_err(rows, dispatch_roundtrip(want.astype(np.float32), gpu)) < 1e-2, \
                (d, le, s)
        else:
            np.testing.assert_array_equal(rows, want.astype(np.float32))
        np.testing.assert_array_equal(src_tk[d, le, first: first + len(pairs)],
                                      [tt * k + kk for tt, kk in pairs])
    valid = valid_mask(ids, e)
    np.testing.assert_array_equal(invalid, np.sum(~valid.reshape(world, t, k), axis=(1, 2)))
    # The layer: each valid pair's expert output (x * (1 + local expert)) times its weight.
    factor = np.where(valid, 1.0 + np.where(valid, ids, 0) % e_loc, 0.0)
    g = np.asarray(gate, np.float64)
    if fp8:  # against the dequantized rows the experts saw
        deq = np.zeros_like(xs)
        for (d, le, s), pairs in slots.items():
            for i, (tt, _) in enumerate(pairs):
                deq[s, tt] = recv[d, le, int(rcounts[d, le, :s].sum()) + i]
        xs = deq
    ref = np.sum((g * factor)[:, :, None] * xs.reshape(world * t, 1, -1), axis=1)
    err = rel_err(out.reshape(ref.shape), ref)
    assert err < (2e-2 if dtype == BF16 else 1e-5), err


def check_two_calls(mesh, world, t, h, k, e, kind, dtype, m, rng) -> None:
    """The layer twice (both inbox parities), a new routing of ``kind`` and new
    tokens each call, checked slot by slot (``_check``)."""
    fn = _layer(mesh, e, m)
    for _ in range(2):
        x = rand((world * t, h), dtype)
        ids = routing(kind, world, t, k, e, rng)
        gate = rand((world * t, k), F32)
        outs = fn(place(mesh, x, TP), place(mesh, ids, TP), place(mesh, gate, TP))
        _check(outs, x, ids, gate, world, e, m or t, dtype)


CASES = [  # world, tokens, hidden, top_k, experts, routing, dtype, max_tokens_per_rank
    (1, 3, 16, 2, 4, "invalid", F32, None),  # the kernels at world 1 (no local form)
    (2, 4, 32, 2, 4, "random", F32, None),
    (2, 3, 16, 1, 4, "one_expert", BF16, 5),
    (2, 5, 32, 2, 8, "skewed", BF16, None),
    (2, 4, 16, 2, 8, "invalid", F32, 6),
    (4, 2, 16, 8, 8, "random", BF16, None),
    (4, 3, 16, 2, 8, "empty", F32, 4),
    (8, 2, 16, 2, 16, "skewed", BF16, None),  # every rank a peer of seven
]


@pytest.mark.parametrize("world,t,h,k,e,kind,dtype,m", CASES)
def test_dispatch_and_combine_match_the_reference(world, t, h, k, e, kind, dtype, m):
    """Both call parities (two calls, a new routing each); M = T and M > T."""
    check_two_calls(setup(world), world, t, h, k, e, kind, dtype, m,
                    np.random.default_rng(world * 100 + t * 10 + k))


def test_fp8_dispatch_quantizes_in_the_send():
    """1 x 128 blocks (H = 160: one whole block, one partial), e4m3 bytes with
    amax / 448 scales; the combine of the dequantized rows in bfloat16."""
    world, t, h, k, e = 2, 3, 160, 2, 4
    mesh = setup(world)
    rng = np.random.default_rng(7)
    fn = _layer(mesh, e, fp8=True)
    for _ in range(2):
        x = rand((world * t, h), BF16)
        ids = routing("random", world, t, k, e, rng)
        gate = rand((world * t, k), F32)
        outs = fn(place(mesh, x, TP), place(mesh, ids, TP), place(mesh, gate, TP))
        _check(outs, x, ids, gate, world, e, t, BF16, fp8=True)
        # The scales: amax / 448 of each token's block, in its slots.
        scales = np.asarray(outs[5]).reshape(world, e // world, world * t, 2)
        xs = np.abs(np.asarray(jnp.asarray(x).astype(F32))).reshape(world, t, h)
        rcounts, slots = ref_layout(ids, world, e, t)
        for (d, le, s), pairs in slots.items():
            for i, (tt, _) in enumerate(pairs):
                want = [xs[s, tt, :128].max() / 448, xs[s, tt, 128:].max() / 448]
                row = int(rcounts[d, le, :s].sum()) + i
                np.testing.assert_allclose(scales[d, le, row], want, rtol=1e-6)


def chained_call_errors(mesh, world: int, t: int, h: int, k: int, e: int, kinds,
                        rng) -> list[str]:
    """len(kinds) dispatch + combine pairs in one compiled program (lax.scan), call i
    with routing kind ``kinds[i]`` and new float32 tokens, the next call's tokens
    depending on this one's result (by zero): what differs from the reference
    (counts, or a relative error over 1e-5: a race shows as another call's rows)."""
    steps = len(kinds)
    xs = np.stack([rand((world * t, h), F32) for _ in range(steps)])
    idss = np.stack([routing(kind, world, t, k, e, rng) for kind in kinds])
    gates = np.stack([rand((world * t, k), F32) for _ in range(steps)])

    def chain(x, ids, gate):
        def step(carry, inputs):
            xi, ii, gi = inputs
            recv, counts, handle = td.moe_dispatch_ll(xi + carry, ii, "tp", num_experts=e)
            out = td.moe_combine_ll(recv, handle, gi, "tp")
            return carry + 0.0 * out[:1, :1], (counts, out)
        return jax.lax.scan(step, 0.0 * x[0, :1, :1], (x, ids, gate))[1]

    seq = P(None, "tp")
    fn = jax.jit(jax.shard_map(chain, mesh=mesh, in_specs=(seq, seq, seq),
                               out_specs=(seq, seq)))
    counts, outs = fn(place(mesh, xs, seq), place(mesh, idss, seq), place(mesh, gates, seq))
    counts, outs = np.asarray(counts), np.asarray(outs)
    bad = []
    for i in range(steps):
        rcounts, _ = ref_layout(idss[i], world, e, t)
        valid = valid_mask(idss[i], e)
        ref = np.sum(np.where(valid, gates[i], 0)[:, :, None] * xs[i][:, None], axis=1)
        if not np.array_equal(counts[i].reshape(world, e // world, world), rcounts):
            bad.append(f"counts of call {i}")
        err = rel_err(outs[i], ref)
        if err > 1e-5:
            bad.append(f"call {i}: relative error {err:.3g}")
    return bad


def test_fifty_chained_calls_with_changing_routings():
    """50 calls in one program: both parities reused 25 times, every result checked."""
    world = 2
    kinds = ["skewed" if i % 3 else "random" for i in range(50)]
    bad = chained_call_errors(setup(world), world, 2, 16, 2, 4, kinds,
                              np.random.default_rng(50))
    assert not bad, bad


def _traced(world, e, fn, *shapes):
    """Traces ``fn`` inside shard_map over "tp" on arguments of ``shapes``."""
    mesh = setup(world)
    args = [jax.ShapeDtypeStruct((world * s[0],) + s[1:], d) for s, d in shapes]
    jax.eval_shape(jax.shard_map(fn, mesh=mesh, in_specs=(TP,) * len(args), out_specs=TP,
                                 check_vma=False), *args)


@pytest.mark.parametrize("kwargs,shapes,match", [
    (dict(num_experts=5), [((4, 16), F32), ((4, 2), jnp.int32)], "multiple of the group"),
    (dict(num_experts=4), [((4, 16), F32), ((4, 2), jnp.int16)], "must be int32"),
    (dict(num_experts=4), [((4, 16), F32), ((3, 2), jnp.int32)], r"\[tokens, top_k\]"),
    (dict(num_experts=4), [((4, 16), jnp.int32), ((4, 2), jnp.int32)], "dtype"),
    (dict(num_experts=4, max_tokens_per_rank=3), [((4, 16), F32), ((4, 2), jnp.int32)],
     "max_tokens_per_rank=3"),
    (dict(num_experts=2), [((4, 16), F32), ((4, 4), jnp.int32)], "exceeds num_experts"),
    (dict(num_experts=4, fp8=1), [((4, 16), F32), ((4, 2), jnp.int32)], "fp8=1"),
])
def test_bad_dispatch_arguments_raise(kwargs, shapes, match):
    def f(x, ids):
        return td.moe_dispatch_ll(x, ids, "tp", **kwargs)[0]
    with pytest.raises(ValueError, match=match):
        _traced(2, 4, f, *shapes)


def test_bad_combine_arguments_raise():
    def f(x, ids, gate, wrong):
        recv, _, handle = td.moe_dispatch_ll(x, ids, "tp", num_experts=4)
        return td.moe_combine_ll(recv[:, :-1] if wrong == 0 else recv, handle,
                                 gate if wrong else gate[:, :1], "tp")
    for wrong, match in ((0, r"y must be \[E / W, W \* M, F\]"), (None, "weights must be")):
        with pytest.raises(ValueError, match=match):
            _traced(2, 4, lambda x, i, g: f(x, i, g, wrong), ((2, 16), F32),
                    ((2, 2), jnp.int32), ((2, 2), F32))
    with pytest.raises(ValueError, match="MoeLLHandle"):
        _traced(2, 4, lambda y, g: td.moe_combine_ll(y, object(), g, "tp"),
                ((2, 4, 16), F32), ((2, 2), F32))


def test_grad_raises_naming_the_op():
    mesh = setup(2)
    # The masked grouped GEMM too (local: any mesh).
    gemm = jax.shard_map(jax.grad(lambda x, w: jnp.sum(td.grouped_matmul_masked(
        x, w, jnp.ones((2,), jnp.int32)))), mesh=mesh, in_specs=(P(), P()), out_specs=P())
    with pytest.raises(TypeError, match="grouped_matmul_masked is not differentiable"):
        jax.eval_shape(gemm, jax.ShapeDtypeStruct((2, 4, 16), F32),
                       jax.ShapeDtypeStruct((2, 16, 8), F32))

    def loss(x, ids, gate):
        recv, _, handle = td.moe_dispatch_ll(x, ids, "tp", num_experts=4)
        return jnp.sum(td.moe_combine_ll(recv, handle, gate, "tp"))

    f = jax.shard_map(jax.grad(loss), mesh=mesh, in_specs=(TP, TP, TP), out_specs=TP)
    args = (jax.ShapeDtypeStruct((4, 16), F32), jax.ShapeDtypeStruct((4, 2), jnp.int32),
            jax.ShapeDtypeStruct((4, 2), F32))
    with pytest.raises(TypeError, match="moe_(combine|dispatch)_ll is not differentiable"):
        jax.eval_shape(f, *args)


def test_heap_bound_is_documented_and_enforced():
    """max_tokens_per_rank too large for the heap: HeapExhaustedError naming the op,
    the layout's formula and max_tokens_per_rank; ll_heap_bytes gives the bytes."""
    assert ll_heap_bytes(4, 256, 128, 7168, 2) > 2 * 256 * 128 * 7168 * 2
    mesh = setup(2, heap_bytes=1 << 20)
    m = 1 << 12
    need = ll_heap_bytes(2, 4, m, 32, 4)
    assert need > 1 << 20

    def f(x, ids):
        return td.moe_dispatch_ll(x, ids, "tp", num_experts=4, max_tokens_per_rank=m)[0]

    fn = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(TP, TP), out_specs=TP))
    with pytest.raises(td.HeapExhaustedError, match="moe_dispatch_ll.*max_tokens_per_rank"):
        fn(place(mesh, rand((4, 32), F32), TP),
           place(mesh, np.zeros((4, 2), np.int32), TP))
    setup(2)  # the default heap again for the tests after


@pytest.mark.parametrize("dtype", [BF16, F32])
def test_grouped_matmul_masked_reads_only_valid_rows(dtype):
    """Per group its first valid_rows[g] rows times w[g] (0, some, all M rows;
    [G] and [G, W] counts); the padding holds NaN, which must not leak."""
    mesh = setup(1)
    g, m, h, f = 3, 20, 32, 16
    x = rand((g, m, h), dtype)
    w = rand((g, h, f), dtype, scale=0.3)
    valid = np.array([[0, 0], [7, 2], [11, 9]], np.int32)  # per group: 0, 9, 20 rows
    rows = valid.sum(1)
    padded = np.array(x, np.float32)
    for gg in range(g):
        padded[gg, rows[gg]:] = np.nan
    x_nan = jnp.asarray(padded).astype(dtype)
    fn = jax.jit(jax.shard_map(lambda a, b, c: td.grouped_matmul_masked(a, b, c), mesh=mesh,
                               in_specs=(P(), P(), P()), out_specs=P()))
    for counts in (valid, rows):
        out = np.asarray(fn(x_nan, w, counts).astype(F32), np.float64)
        for gg in range(g):
            ref = f64(x[gg, :rows[gg]]) @ f64(w[gg])
            if rows[gg]:
                err = rel_err(out[gg, :rows[gg]], ref)
                assert err < (2e-2 if dtype == BF16 else 1e-5), (gg, err)
    with pytest.raises(ValueError, match="valid_rows must be integers"):
        fn(x_nan, w, valid.astype(np.float32))


def test_decode_layer_end_to_end():
    """dispatch_ll -> masked grouped GEMM (the experts) -> combine_ll, against the
    dense layer sum_k gate[t, k] * x[t] @ w[ids[t, k]] (the docs' decode example)."""
    world, t, h, f, k, e = 2, 3, 32, 32, 2, 4
    mesh = setup(world)
    rng = np.random.default_rng(11)

    def layer(x, ids, gate, w):
        recv, counts, handle = td.moe_dispatch_ll(x, ids, "tp", num_experts=e)
        y = td.grouped_matmul_masked(recv, w, counts)        # [E / W, W * T, F]
        return td.moe_combine_ll(y, handle, gate, "tp")

    fn = jax.jit(jax.shard_map(layer, mesh=mesh, in_specs=(TP, TP, TP, TP), out_specs=TP))
    for kind in ("random", "one_expert"):
        x = rand((world * t, h), BF16)
        ids = routing(kind, world, t, k, e, rng)
        gate = rand((world * t, k), F32)
        w = rand((e, h, f), BF16, scale=0.3)
        out = fn(*(place(mesh, a, TP) for a in (x, ids, gate, w)))
        ref = np.zeros((world * t, f))
        for tt in range(world * t):
            for kk in range(k):
                ref[tt] += float(gate[tt, kk]) * (f64(x[tt]) @ f64(w[ids[tt, kk]]))
        assert rel_err(f64(out), ref) < 2e-2


@pytest.mark.parametrize("fp8", [False, True])
def test_kernels_compile_for_sm90_with_vectorized_rows(fp8):
    """The GPU path (which the interpreter does not compile) at DeepSeek-V3's decode
    shape: every kernel compiles for Hopper and the row copies (and the FP8
    quantization's loads and stores) stay 16-byte vectorized."""
    from tests.test_compile_sm90 import _compile, _ops
    from jaxtdist.kernels.moe_ll import (moe_ll_combine_kernel, moe_ll_combine_send_kernel,
                                         moe_ll_dispatch_kernel)
    dispatch = _compile(
        moe_ll_dispatch_kernel,
        {"ctx": "*i32", "x_ptr": "*bf16", "ids_ptr": "*i32", "recv_ptr": "*u8" if fp8 else "*bf16",
         "rscale_ptr": "*fp32", "rcounts_ptr": "*i32", "rtk_ptr": "*i32"},
        dict(T=128, H=7168, K=8, E_LOC=64, W=4, M=128, P=128, CNT_OFF=0, TK_OFF=4096,
             ROWS_OFF=1 << 20, SCALES_OFF=1 << 30, PARITY_BYTES=1 << 31, KP=8, WP=4, BT=128,
             BLOCK_H=8192, FP8=fp8, S=56, QP=128, SP=64, EPPP=2), num_warps=4, num_stages=1)
    kernels = [dispatch]
    if not fp8:
        kernels.append(_compile(
            moe_ll_combine_send_kernel, {"ctx": "*i32", "y_ptr": "*bf16", "rcounts_ptr": "*i32",
                                         "rtk_ptr": "*i32", "done_ptr": "*i32"},
            dict(T=128, F=7168, K=8, E_LOC=64, W=4, M=128, P=128, INBOX_OFF=4096,
                 PARITY_BYTES=1 << 24, WP=4, BLOCK_F=8192), num_warps=4, num_stages=1))
        kernels.append(_compile(
            moe_ll_combine_kernel, {"ctx": "*i32", "w_ptr": "*fp32", "kmask_ptr": "*i32",
                                    "out_ptr": "*bf16"},
            dict(T=128, F=7168, K=8, P=128, TP=1, FLAGS_OFF=0, INBOX_OFF=4096,
                 PARITY_BYTES=1 << 24, KP=8, BLOCK_F=1024), num_warps=4, num_stages=1))
    for kernel in kernels:
        ops = _ops(kernel)
        narrow = {op: n for op, n in ops.items() if op.endswith((".b16", ".b8"))}
        assert not narrow and ops["st.global.v4.b32"] > 0, dict(ops)


def test_parallel_moe_low_latency_decode_matches_the_reference(monkeypatch):
    """ParallelMoE(low_latency_decode=True): a decode step (3 sequences over a 1 x 2
    mesh: spread over the ranks, the padding row not sent) runs the LL block and
    matches the float64 reference of the same parameters."""
    pytest.importorskip("flax")
    from flax import nnx

    from jaxtdist import nn as tdnn
    from jaxtdist.nn import _moe_decode
    from tests.conftest import dp_tp_mesh
    from tests.test_cpu_nn_moe import _reference, _weights

    calls = []
    real = _moe_decode.moe_dispatch_ll
    monkeypatch.setattr(_moe_decode, "moe_dispatch_ll",
                        lambda *a, **kw: calls.append(1) or real(*a, **kw))
    dp_tp_mesh((1, 2))
    layer = tdnn.ParallelMoE(16, 24, num_experts=4, top_k=2, low_latency_decode=True,
                             rngs=nnx.Rngs(0))
    x1 = np.random.default_rng(3).standard_normal((3, 1, 16)).astype(np.float32)
    out = nnx.jit(lambda m, x: m(x, decode=True))(layer, x1)
    assert out.shape == (3, 1, 16) and calls == [1]
    assert rel_err(out, _reference(_weights(layer), x1, 2)) < 1e-5


def test_masked_grouped_gemm_compiles_for_sm90():
    """The grouped GEMM kernel with MASKED_M (the padded layout) on its TMA path
    for Hopper, at a DeepSeek-V3-like decode shape (64 experts of 512 slots)."""
    from tests.test_compile_sm90 import _compile_native
    from jaxtdist.kernels.grouped_gemm import grouped_gemm_kernel

    m = 512
    k = _compile_native(grouped_gemm_kernel, ["i32", "bf16", "bf16", "i32", "bf16"],
                        dict(R=64 * m, H=7168, F=2048, G=64, BLOCK_G=64, BLOCK_M=32,
                             BLOCK_N=256, BLOCK_K=64, GROUP_M=8, NUM_PROGRAMS=132, SUBTILE=4,
                             TMA=True, DOT_PRECISION=None, W_T=False, SPLIT_K=1, MASKED_M=m),
                        num_warps=4, num_stages=3)
    assert "cp.async.bulk.tensor.2d.shared" in k.asm["ptx"]
    assert k.metadata.shared <= 227 * 1024
