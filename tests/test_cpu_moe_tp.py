"""jaxtdist.moe_tp_mlp on CPU devices (Triton interpreter for the gather and the
reduce-scatter), against a float64 numpy reference of the whole (unsharded)
layer and jax.grad of a dense plain-JAX twin."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxtdist as td
from tests.conftest import TOL, cpu_only, place, rand, rel_err, setup

pytestmark = cpu_only()

BF16, F32 = jnp.bfloat16, jnp.float32
TOKENS, EXPERTS_W1, EXPERTS_W2 = P("tp", None), P(None, None, "tp"), P(None, "tp", None)


def _silu(a):
    return a / (1.0 + np.exp(-a))


def _reference(x, ids, gate, w1, w2, w_up=None) -> np.ndarray:
    """float64: every token through each of its experts (full FFN), weighted."""
    x, gate, w1, w2 = (np.asarray(a, np.float64) for a in (x, gate, w1, w2))
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for k, e in enumerate(ids[t]):
            if not 0 <= e < w1.shape[0]:
                continue
            h = _silu(x[t] @ w1[e])
            if w_up is not None:
                h = h * (x[t] @ np.asarray(w_up[e], np.float64))
            out[t] += gate[t, k] * (h @ w2[e])
    return out


def _routing(rng, t, k, e) -> np.ndarray:
    return np.stack([rng.permutation(e)[:k] for _ in range(t)]).astype(np.int32)


def _fn(mesh, gated: bool, axis="tp", overlap=None):
    if gated:
        body = lambda x, i, g, a, b, c: td.moe_tp_mlp(  # noqa: E731
            x, i, g, a, b, axis, w_up=c, overlap=overlap)
        specs = (TOKENS, TOKENS, TOKENS, EXPERTS_W1, EXPERTS_W2, EXPERTS_W1)
    else:
        body = lambda x, i, g, a, b: td.moe_tp_mlp(  # noqa: E731
            x, i, g, a, b, axis, overlap=overlap)
        specs = (TOKENS, TOKENS, TOKENS, EXPERTS_W1, EXPERTS_W2)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=TOKENS)), specs


# (world, dtype, tokens per rank, K, E, H, F, gated): K = 1, 2, 8; odd token counts;
# one expert and many; world 1 (local computation), 2 and 4.
CASES = [(2, F32, 5, 2, 4, 16, 32, False), (4, F32, 3, 1, 8, 16, 16, True),
         (2, BF16, 7, 8, 8, 32, 64, True), (4, BF16, 2, 2, 1, 16, 32, False),
         (1, F32, 6, 2, 4, 16, 16, False)]


@pytest.mark.parametrize("world,dtype,t,k,e,h,f,gated", CASES)
def test_moe_tp_mlp(world, dtype, t, k, e, h, f, gated):
    _check_layer(world, dtype, t, k, e, h, f, gated, None)


# The overlapped schedule (forced: the default picks it on GPUs only): odd token
# counts, K = 1, 2, 8, E = 1 and many; H = 24 in float32 (96-byte rows: TMA) and
# H = 20 in bfloat16 (40-byte rows: the pointer GEMM).
OVERLAP_CASES = [(2, F32, 5, 2, 4, 24, 32, False), (4, F32, 3, 1, 8, 16, 16, True),
                 (2, BF16, 7, 8, 8, 32, 64, True), (4, BF16, 2, 2, 1, 16, 32, False),
                 (2, BF16, 9, 2, 3, 20, 16, True), (1, F32, 6, 2, 4, 16, 16, False)]


@pytest.mark.parametrize("world,dtype,t,k,e,h,f,gated", OVERLAP_CASES)
def test_moe_tp_mlp_overlapped(world, dtype, t, k, e, h, f, gated):
    _check_layer(world, dtype, t, k, e, h, f, gated, True)


def _check_layer(world, dtype, t, k, e, h, f, gated, overlap):
    mesh = setup(world, ("tp",))
    fn, specs = _fn(mesh, gated, overlap=overlap)
    rng = np.random.default_rng(world * 100 + t)
    for _ in range(2):  # fresh data and routing: one program for every routing
        x = rand((world * t, h), dtype)
        ids = _routing(rng, world * t, min(k, e), e)
        gate = rand(ids.shape, F32)
        w1, w2 = rand((e, h, f), dtype, 0.3), rand((e, f, h), dtype, 0.3)
        w_up = rand((e, h, f), dtype, 0.3) if gated else None
        arrays = (x, ids, gate, w1, w2) + ((w_up,) if gated else ())
        out = fn(*(place(mesh, a, s) for a, s in zip(arrays, specs)))
        assert out.shape == x.shape and out.dtype == jnp.dtype(dtype)
        ref = _reference(x, ids, gate, w1, w2, w_up)
        err = np.linalg.norm(np.asarray(out, np.float64) - ref) / np.linalg.norm(ref)
        assert err < TOL[jnp.dtype(dtype)] * (1 if dtype == F32 else 2), err


@pytest.mark.parametrize("overlap", [None, True])
def test_moe_tp_mlp_skewed_and_invalid_routing(overlap):
    """Every token to one expert, then ids outside [0, E): those contribute nothing."""
    world, t, k, e, h, f = 2, 4, 2, 4, 16, 16
    mesh = setup(world, ("tp",))
    fn, specs = _fn(mesh, False, overlap=overlap)
    x = rand((world * t, h))
    w1, w2 = rand((e, h, f), scale=0.3), rand((e, f, h), scale=0.3)
    gate = rand((world * t, k))
    for ids in (np.tile(np.array([[3, 1]], np.int32), (world * t, 1)),
                np.array([[0, -1], [e, 2], [1, 3], [7, 0]] * world, np.int32)):
        arrays = (x, ids, gate, w1, w2)
        out = fn(*(place(mesh, a, s) for a, s in zip(arrays, specs)))
        ref = _reference(x, ids, gate, w1, w2)
        np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("world,gated,overlap", [(2, True, None), (4, False, None),
                                                 (2, True, True)])
def test_moe_tp_mlp_grad(world, gated, overlap):
    """Gradients of x, the routing weights and every expert weight, against jax.grad of
    a dense plain-JAX twin on the unsharded arrays (after the overlapped forward
    too, whose backward pass is the step-by-step schedule's)."""
    t, k, e, h, f = 3, 2, 4, 16, 8 * world
    mesh = setup(world, ("tp",))
    fn, specs = _fn(mesh, gated, overlap=overlap)
    rng = np.random.default_rng(7)
    x = rand((world * t, h))
    ids = _routing(rng, world * t, k, e)
    gate = rand(ids.shape)
    w1, w2, w_up = rand((e, h, f), scale=0.3), rand((e, f, h), scale=0.3), rand((e, h, f),
                                                                                 scale=0.3)
    c = rand((world * t, h))
    diff = (0, 2, 3, 4) + ((5,) if gated else ())

    def dense(x, ids, gate, w1, w2, w_up=None):
        hid = jax.nn.silu(jnp.einsum("th,tkhf->tkf", x, w1[ids]))
        if w_up is not None:
            hid = hid * jnp.einsum("th,tkhf->tkf", x, w_up[ids])
        return jnp.einsum("tkf,tkfh,tk->th", hid, w2[ids], gate)

    arrays = (x, ids, gate, w1, w2) + ((w_up,) if gated else ())
    placed = tuple(place(mesh, a, s) for a, s in zip(arrays, specs))
    got = jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a) * c), argnums=diff))(*placed)
    with jax.default_matmul_precision("highest"):
        want = jax.grad(lambda *a: jnp.sum(dense(*a) * c), argnums=diff)(
            *(jnp.asarray(a) for a in arrays))
    for g, w in zip(got, want):
        err = np.linalg.norm(np.asarray(g) - np.asarray(w)) / np.linalg.norm(np.asarray(w))
        assert err < 1e-5, err


def test_moe_tp_mlp_grad_bfloat16():
    """bfloat16 tokens and experts: the cotangents of x (summed over a token's K pairs
    in float32, rounded once, then reduce-scattered) and of the weights against the
    float32 gradients of the same rounded inputs."""
    world, t, k, e, h, f = 2, 5, 3, 4, 16, 16
    mesh = setup(world, ("tp",))
    fn, specs = _fn(mesh, False)
    x = rand((world * t, h), BF16)
    ids = _routing(np.random.default_rng(11), world * t, k, e)
    gate = rand(ids.shape)
    w1, w2 = rand((e, h, f), BF16, 0.3), rand((e, f, h), BF16, 0.3)
    c = rand((world * t, h))
    arrays = (x, ids, gate, w1, w2)
    placed = tuple(place(mesh, a, s) for a, s in zip(arrays, specs))
    got = jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a).astype(F32) * c), argnums=(0, 2)))(*placed)
    wide = tuple(place(mesh, np.asarray(a, np.float32) if a.dtype == BF16 else a, s)
                 for a, s in zip(arrays, specs))
    want = jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a) * c), argnums=(0, 2)))(*wide)
    for g, w in zip(got, want):
        assert g.dtype in (jnp.dtype(BF16), jnp.dtype(F32))
        err = np.linalg.norm(np.asarray(g, np.float64) - np.asarray(w, np.float64)) / \
            np.linalg.norm(np.asarray(w, np.float64))
        assert err < 2e-2, err


def test_moe_tp_mlp_overlapped_chained_calls():
    """30 overlapped layers in one program, each on the last one's output with a fresh
    routing: the inboxes of both fused kernels are reused every other call (a reuse
    race shows as a wrong layer), against the float64 reference layer by layer."""
    world, t, k, e, h, f, layers = 2, 3, 2, 4, 16, 16, 30
    mesh = setup(world, ("tp",))
    rng = np.random.default_rng(5)
    x = rand((world * t, h))
    ids = np.stack([_routing(rng, world * t, k, e) for _ in range(layers)])
    gate = rand(ids.shape, scale=0.5)
    w1, w2 = rand((e, h, f), scale=0.3), rand((e, f, h), scale=0.3)

    def body(x, ids, gate, w1, w2):
        outs = []
        for i in range(layers):
            x = td.moe_tp_mlp(x, ids[i], gate[i], w1, w2, "tp", overlap=True)
            outs.append(x)
        return jnp.stack(outs)

    routed = P(None, "tp", None)
    specs = (TOKENS, routed, routed, EXPERTS_W1, EXPERTS_W2)
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=routed))
    outs = np.asarray(fn(*(place(mesh, a, sp) for a, sp in zip((x, ids, gate, w1, w2), specs))),
                      np.float64)
    want = np.asarray(x, np.float64)
    for i in range(layers):
        want = _reference(want, ids[i], gate[i], w1, w2)
        err = np.linalg.norm(outs[i] - want) / np.linalg.norm(want)
        assert err < 1e-4, (i, err)
        want = outs[i]  # the next layer's reference input: the op's own output


@pytest.mark.parametrize("grouped_gemm,overlap", [("jaxtdist", None), ("auto", None),
                                                   ("auto", True)])
def test_moe_tp_mlp_under_vmap(grouped_gemm, overlap):
    """jax.vmap over a leading batch of layers' inputs (each element its own routing),
    forward and grad, against the float64 reference and the per-element gradients,
    with jaxtdist's grouped GEMM and with the default (ragged_dot on CPU, whose
    batched group sizes JAX cannot batch: moe_tp runs them one element at a time)."""
    world, batch, t, k, e, h, f = 2, 2, 3, 2, 4, 16, 16
    mesh = setup(world, ("tp",))
    rng = np.random.default_rng(9)
    x = rand((batch, world * t, h))
    ids = np.stack([_routing(rng, world * t, k, e) for _ in range(batch)])
    gate = rand(ids.shape)
    w1, w2 = rand((e, h, f), scale=0.3), rand((e, f, h), scale=0.3)

    def layer(x, ids, gate, w1, w2):
        return td.moe_tp_mlp(x, ids, gate, w1, w2, "tp", grouped_gemm=grouped_gemm,
                             overlap=overlap)

    def loss(x, ids, gate, w1, w2):
        return jnp.sum(jax.vmap(layer, in_axes=(0, 0, 0, None, None))(x, ids, gate, w1, w2)
                       ** 2)

    batched = P(None, "tp", None)
    specs = (batched, batched, batched, EXPERTS_W1, EXPERTS_W2)
    placed = tuple(place(mesh, a, sp) for a, sp in zip((x, ids, gate, w1, w2), specs))
    out = jax.jit(jax.shard_map(jax.vmap(layer, in_axes=(0, 0, 0, None, None)), mesh=mesh,
                                in_specs=specs, out_specs=batched))(*placed)
    grads = jax.jit(jax.shard_map(jax.grad(loss, argnums=(0, 2)), mesh=mesh, in_specs=specs,
                                  out_specs=(batched, batched)))(*placed)
    one, one_specs = _fn(mesh, False)
    one_grad = jax.jit(jax.grad(lambda *a: jnp.sum(one(*a) ** 2), argnums=(0, 2)))

    def rel(a, b):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        return np.linalg.norm(a - b) / np.linalg.norm(b)

    for i in range(batch):
        args = tuple(place(mesh, a, sp)
                     for a, sp in zip((x[i], ids[i], gate[i], w1, w2), one_specs))
        assert rel(out[i], _reference(x[i], ids[i], gate[i], w1, w2)) < 1e-5
        dx, dgate = one_grad(*args)
        assert rel(grads[0][i], dx) < 1e-5 and rel(grads[1][i], dgate) < 1e-5


def test_moe_tp_mlp_errors():
    mesh = setup(2, ("tp",))
    x, ids, gate = rand((4, 16)), np.zeros((4, 2), np.int32), rand((4, 2))
    w1, w2 = rand((4, 16, 8)), rand((4, 8, 16))

    def run(*arrays, axis="tp", **kw):
        specs = (TOKENS, TOKENS, TOKENS, EXPERTS_W1, EXPERTS_W2)
        return jax.jit(jax.shard_map(lambda *a: td.moe_tp_mlp(*a, axis, **kw), mesh=mesh,
                                     in_specs=specs, out_specs=TOKENS))(
            *(place(mesh, a, s) for a, s in zip(arrays, specs)))

    with pytest.raises(ValueError, match=r"w2 must be \[E, F_shard, H\]"):
        run(x, ids, gate, w1, rand((4, 8, 8)))
    with pytest.raises(ValueError, match="expert_ids must be integers"):
        run(x, ids.astype(np.float32), gate, w1, w2)
    # Regression (an adversarial sweep): K = 0 was a ZeroDivisionError deep inside.
    for overlap in (False, True):
        with pytest.raises(ValueError, match=r"expert_ids\(2, 0\) routes each token to K=0 "
                                             r"experts; K must be at least 1"):
            run(x, ids[:, :0], gate[:, :0], w1, w2, overlap=overlap)
    with pytest.raises(ValueError, match="weights must be floats shaped like"):
        run(x, ids, gate[:, :1], w1, w2)
    with pytest.raises(ValueError, match="w1 has dtype float16"):
        run(x, ids, gate, w1.astype(np.float16), w2)
    with pytest.raises(ValueError, match=r"w1 must be \[E, H, F_shard\] with H=16"):
        run(x, ids, gate, rand((4, 8, 8)), w2)
    with pytest.raises(ValueError, match="axis"):
        run(x, ids, gate, w1, w2, axis="sp")
    with pytest.raises(ValueError,
                       match=r"w1 must hold at least one expert, got w1\(0, 16, 4\)"):
        run(x, ids, gate, rand((0, 16, 8)), rand((0, 8, 16)))
    for bad in ("yes", 1.0, 0):  # numbers equal to True or False are not bools
        with pytest.raises(ValueError, match=rf"overlap={bad!r} must be True, False or None \(the default rule\)"):
            run(x, ids, gate, w1, w2, overlap=bad)
    many = np.zeros((4, 2), np.int32)
    with pytest.raises(ValueError, match=r"overlap=True needs at most 256 experts, got "
                                         r"w1\(257, 16, 4\)"):
        run(x, many, gate, rand((257, 16, 8)), rand((257, 8, 16)), overlap=True)
    # Outside shard_map: the error names moe_tp_mlp, not the gather inside it.
    with pytest.raises(ValueError, match=r"jaxtdist\.moe_tp_mlp must be called inside "
                                         r"jax\.shard_map"):
        td.moe_tp_mlp(x, ids, gate, w1, w2, "tp")


@pytest.mark.parametrize("overlap", [None, True])
def test_moe_tp_mlp_second_order_names_the_op(overlap):
    """grad of grad (w.r.t. x, and w.r.t. the experts alone): a TypeError naming
    moe_tp_mlp, not an error from inside JAX naming none."""
    mesh = setup(2, ("tp",))
    fn, specs = _fn(mesh, False, overlap=overlap)
    x, gate = rand((4, 16)), rand((4, 2))
    ids = _routing(np.random.default_rng(5), 4, 2, 4)
    w1, w2 = rand((4, 16, 8), scale=0.3), rand((4, 8, 16), scale=0.3)
    placed = [place(mesh, a, s) for a, s in zip((x, ids, gate, w1, w2), specs)]
    for arg in (0, 3):
        def inner(a, arg=arg):
            return jax.grad(lambda b: jnp.sum(jnp.sin(fn(*placed[:arg], b,
                                                         *placed[arg + 1:]))))(a)
        with pytest.raises(TypeError, match=r"jaxtdist\.moe_tp_mlp: .*no derivative.*grad of "
                                            r"grad"):
            jax.jit(jax.grad(lambda a: jnp.sum(inner(a))))(placed[arg])


@pytest.mark.parametrize("overlap", [None, True])
def test_moe_tp_mlp_under_nested_vmap(overlap):
    """vmap of vmap (a [2, 2] batch of layer inputs): one whole call per element,
    each against the float64 reference."""
    world, t, k, e, h, f = 2, 2, 2, 4, 16, 16
    mesh = setup(world, ("tp",))
    rng = np.random.default_rng(11)
    x = rand((2, 2, world * t, h))
    ids = np.stack([np.stack([_routing(rng, world * t, k, e) for _ in range(2)])
                    for _ in range(2)])
    gate = rand(ids.shape)
    w1, w2 = rand((e, h, f), scale=0.3), rand((e, f, h), scale=0.3)
    layer = jax.vmap(jax.vmap(lambda x, i, g, a, b: td.moe_tp_mlp(x, i, g, a, b, "tp",
                                                                  overlap=overlap),
                              in_axes=(0, 0, 0, None, None)), in_axes=(0, 0, 0, None, None))
    batched = P(None, None, "tp", None)
    specs = (batched, batched, batched, EXPERTS_W1, EXPERTS_W2)
    out = jax.jit(jax.shard_map(layer, mesh=mesh, in_specs=specs, out_specs=batched))(
        *(place(mesh, a, sp) for a, sp in zip((x, ids, gate, w1, w2), specs)))
    for i in range(2):
        for j in range(2):
            ref = _reference(x[i, j], ids[i, j], gate[i, j], w1, w2)
            err = np.linalg.norm(np.asarray(out[i, j], np.float64) - ref) / np.linalg.norm(ref)
            assert err < 1e-5, (i, j, err)


@pytest.mark.parametrize("overlap", [None, True])
def test_moe_tp_mlp_over_a_submesh(overlap):
    """dp x tp: each dp group's tp ranks form their own layer."""
    mesh = setup((2, 2), ("dp", "tp"))
    t, k, e, h, f = 3, 2, 4, 16, 16
    tokens = P(("dp", "tp"), None)
    specs = (tokens, tokens, tokens, EXPERTS_W1, EXPERTS_W2)
    fn = jax.jit(jax.shard_map(lambda *a: td.moe_tp_mlp(*a, "tp", overlap=overlap), mesh=mesh,
                               in_specs=specs, out_specs=tokens))
    x = rand((4 * t, h))
    ids = _routing(np.random.default_rng(3), 4 * t, k, e)
    gate, w1, w2 = rand(ids.shape), rand((e, h, f), scale=0.3), rand((e, f, h), scale=0.3)
    out = fn(*(place(mesh, a, s) for a, s in zip((x, ids, gate, w1, w2), specs)))
    np.testing.assert_allclose(np.asarray(out), _reference(x, ids, gate, w1, w2), rtol=1e-4,
                               atol=1e-5)


def test_grouped_gemm_auto_picks_by_platform(monkeypatch):
    """grouped_gemm="auto" (the default): jaxtdist.grouped_matmul on GPUs for 16-bit
    types and at most 256 experts, jax.lax.ragged_dot otherwise (here: the CPU)."""
    from jaxtdist.ops import moe_tp

    setup(2)
    assert moe_tp._pick_grouped_gemm("auto", 8, BF16) == "ragged_dot"  # CPU
    assert moe_tp._pick_grouped_gemm("jaxtdist", 8, F32) == "jaxtdist"  # as asked

    class Gpu:
        platform = "gpu"

    monkeypatch.setattr(moe_tp, "runtime", lambda: Gpu())
    assert moe_tp._pick_grouped_gemm("auto", 8, BF16) == "jaxtdist"
    assert moe_tp._pick_grouped_gemm("auto", 8, jnp.float16) == "jaxtdist"
    assert moe_tp._pick_grouped_gemm("auto", 8, F32) == "ragged_dot"
    assert moe_tp._pick_grouped_gemm("auto", 257, BF16) == "ragged_dot"
    assert moe_tp._pick_grouped_gemm("ragged_dot", 8, BF16) == "ragged_dot"


@pytest.mark.parametrize("dtype,k", [(BF16, 3), (F32, 1), (jnp.float16, 2)])
def test_tokens_ids_and_weights_travel_in_one_gather(monkeypatch, dtype, k):
    """moe_tp_mlp gathers x, the expert ids and the routing weights with one
    all_gather launch (ids and weights as raw words at the end of each row): the
    ids come back bit for bit, out-of-range ones included, as do the weights."""
    from jaxtdist.ops import moe_tp

    world, t, h = 2, 3, 16
    mesh = setup(world, ("tp",))
    calls = []

    def counted(a, axis_name):
        calls.append(a.shape)
        return td.all_gather(a, axis_name)

    monkeypatch.setattr(moe_tp, "all_gather", counted)
    x = rand((world * t, h), dtype)
    ids = np.random.default_rng(5).integers(-2**31, 2**31 - 1, (world * t, k), dtype=np.int32)
    ids[0, 0], ids[1, 0] = -1, 0x7FC0FFFF  # a NaN's bits in a 16-bit word
    gate = rand((world * t, k), F32)
    got = jax.jit(jax.shard_map(
        lambda x, i, g: moe_tp._gather_tokens(x, i, g, "tp"), mesh=mesh,
        in_specs=(TOKENS,) * 3, out_specs=(P(),) * 3, check_vma=False))(
        *(place(mesh, a, TOKENS) for a in (x, ids, gate)))
    assert len(calls) == 1, calls
    assert calls[0][1] * jnp.dtype(dtype).itemsize % 16 == h * jnp.dtype(dtype).itemsize % 16
    np.testing.assert_array_equal(np.asarray(got[0]).view(np.uint8),
                                  np.asarray(jnp.asarray(x)).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(got[1]), ids)
    np.testing.assert_array_equal(np.asarray(got[2]).view(np.uint32), gate.view(np.uint32))


def test_moe_tp_mlp_overlapped_under_checkpoint():
    """jax.checkpoint around two overlapped layers, differentiated: the gradients of
    x and every expert weight match those without checkpoint (no forward kernel is
    recomputed out of order in the backward pass)."""
    world, t, k, e, h, f = 2, 3, 2, 4, 16, 16
    mesh = setup(world, ("tp",))
    rng = np.random.default_rng(13)
    x = rand((world * t, h))
    ids = np.stack([_routing(rng, world * t, k, e) for _ in range(2)])
    gate = rand(ids.shape, scale=0.5)
    w1, w2 = rand((e, h, f), scale=0.3), rand((e, f, h), scale=0.3)

    def two(x, ids, gate, w1, w2):
        for i in range(2):
            x = td.moe_tp_mlp(x, ids[i], gate[i], w1, w2, "tp", overlap=True)
        return x

    routed = P(None, "tp", None)
    specs = (TOKENS, routed, routed, EXPERTS_W1, EXPERTS_W2)
    placed = tuple(place(mesh, a, sp) for a, sp in zip((x, ids, gate, w1, w2), specs))
    grads = {}
    for remat in (False, True):
        body = jax.checkpoint(two) if remat else two
        grads[remat] = jax.jit(jax.shard_map(
            jax.grad(lambda *a: jnp.sum(body(*a) ** 2), argnums=(0, 3, 4)), mesh=mesh,
            in_specs=specs, out_specs=(TOKENS, EXPERTS_W1, EXPERTS_W2)))(*placed)
    for a, b in zip(grads[True], grads[False]):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("remat", [False, True])
def test_moe_tp_mlp_overlapped_chained_layers_all_gradients(remat):
    """Two overlapped layers with their own experts and routings, each under
    jax.checkpoint or not, differentiated in x, the routing weights and the expert
    weights: the gradients of the step-by-step schedule, and no deadlock (calls
    that data did not order once waited for ever here, the routing weights
    differentiated: a short wait bound makes that a quick failure)."""
    world, t, k, e, h, f, layers = 2, 3, 2, 4, 16, 16, 2
    mesh = setup(world, ("tp",), wait_timeout_s=60.0)
    rng = np.random.default_rng(31)
    x = rand((world * t, h))
    ids = np.stack([_routing(rng, world * t, k, e) for _ in range(layers)])
    gate = rand(ids.shape, scale=0.5)
    w1, w2 = rand((layers, e, h, f), scale=0.3), rand((layers, e, f, h), scale=0.3)
    routed = P(None, "tp", None)
    w1_spec, w2_spec = P(None, None, None, "tp"), P(None, None, "tp", None)
    specs = (TOKENS, routed, routed, w1_spec, w2_spec)
    placed = tuple(place(mesh, a, sp) for a, sp in zip((x, ids, gate, w1, w2), specs))
    grads = {}
    for overlap in (True, False):
        def loss(x, ids, gate, w1, w2, overlap=overlap):
            for i in range(layers):
                layer = functools.partial(td.moe_tp_mlp, axis_name="tp", overlap=overlap)
                x = (jax.checkpoint(layer) if remat else layer)(x, ids[i], gate[i], w1[i],
                                                                 w2[i])
            return jnp.sum(x ** 2)

        grads[overlap] = jax.jit(jax.shard_map(
            jax.grad(loss, argnums=(0, 2, 3, 4)), mesh=mesh, in_specs=specs,
            out_specs=(TOKENS, routed, w1_spec, w2_spec)))(*placed)
    # The overlapped forward sums in another order than the steps: element-wise, a
    # near-cancelling entry may differ by 2e-4 of itself (jax 0.11's CPU dots).
    for a, b in zip(grads[True], grads[False]):
        assert rel_err(a, b) < 1e-5


def test_overlap_default_rule(monkeypatch):
    """overlap=None: the overlapped schedule on GPUs at world > 1 with jaxtdist's grouped
    GEMM and OVERLAP_MIN_ROWS pairs per expert; the steps elsewhere."""
    from jaxtdist.ops import moe_tp
    mesh = setup(2, ("tp",))
    del mesh
    x = jnp.zeros((8, 16), BF16)
    w1 = jnp.zeros((4, 16, 8), BF16)
    few, many = jnp.zeros((8, 2), jnp.int32), jnp.zeros((moe_tp.OVERLAP_MIN_ROWS * 2, 2),
                                                         jnp.int32)
    assert not moe_tp._overlaps(None, x, many, w1, "tp", "auto")  # the CPU
    assert moe_tp._overlaps(True, x, few, w1, "tp", "auto")
    assert not moe_tp._overlaps(False, x, many, w1, "tp", "auto")
    real = moe_tp.runtime()

    class Backend:
        has_copy_engines = True

    class Gpu:
        platform = "gpu"
        backend = Backend()

        def __getattr__(self, name):
            return getattr(real, name)

    monkeypatch.setattr(moe_tp, "runtime", lambda: Gpu())
    assert moe_tp._overlaps(None, x, many, w1, "tp", "auto")
    assert not moe_tp._overlaps(None, x, few, w1, "tp", "auto")
    assert not moe_tp._overlaps(None, x, many, w1, "tp", "ragged_dot")
    assert not moe_tp._overlaps(None, x.astype(F32), many, w1, "tp", "auto")
    Backend.has_copy_engines = False  # a GPU heap without copy-engine pushes
    assert not moe_tp._overlaps(None, x, many, w1, "tp", "auto")
    with pytest.raises(ValueError, match="overlap=True needs copy-engine pushes"):
        moe_tp._overlaps(True, x, many, w1, "tp", "auto")


@pytest.mark.parametrize("gated,overlap", [(False, None), (True, True)])
def test_moe_tp_mlp_sharded(gated, overlap):
    """The pjit-style wrapper on global arrays, dp x tp (each dp group's tp ranks one
    layer): equal to the float64 reference, and its gradients to the shard_map
    form's; a token count the devices do not divide names the wrapper."""
    mesh = setup((2, 2), ("dp", "tp"))
    t, k, e, h, f = 3, 2, 4, 16, 16
    x = rand((4 * t, h))
    ids = _routing(np.random.default_rng(21), 4 * t, k, e)
    gate, w1, w2 = rand(ids.shape), rand((e, h, f), scale=0.3), rand((e, f, h), scale=0.3)
    w_up = rand((e, h, f), scale=0.3) if gated else None

    def sharded(x, gate, w1, w2, w_up):
        return td.moe_tp_mlp_sharded(x, ids, gate, w1, w2, axis_name="tp", batch_axes="dp",
                                     w_up=w_up, overlap=overlap)

    out = jax.jit(sharded)(x, gate, w1, w2, w_up)
    np.testing.assert_allclose(np.asarray(out), _reference(x, ids, gate, w1, w2, w_up),
                               rtol=1e-4, atol=1e-5)
    tokens = P(("dp", "tp"), None)
    specs = (tokens, tokens, tokens, EXPERTS_W1, EXPERTS_W2) + ((EXPERTS_W1,) if gated else ())
    body = jax.shard_map(lambda x, i, g, a, b, *c: td.moe_tp_mlp(
        x, i, g, a, b, "tp", w_up=c[0] if c else None, overlap=overlap), mesh=mesh,
        in_specs=specs, out_specs=tokens)
    arrays = (x, ids, gate, w1, w2) + ((w_up,) if gated else ())
    placed = [place(mesh, a, s) for a, s in zip(arrays, specs)]
    want = jax.jit(jax.grad(lambda a, g: jnp.sum(body(a, placed[1], g, *placed[3:]) ** 2),
                            argnums=(0, 1)))(placed[0], placed[2])
    got = jax.jit(jax.grad(lambda a, g: jnp.sum(sharded(a, g, w1, w2, w_up) ** 2),
                           argnums=(0, 1)))(x, gate)
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="moe_tp_mlp_sharded"):
        td.moe_tp_mlp_sharded(x[:10], ids[:10], gate[:10], w1, w2, axis_name="tp",
                              batch_axes="dp")


def _ops_launched(fn, *args) -> set[str]:
    """The ops named by the jaxtdist calls in ``fn``'s jaxpr (nested ones included)."""
    from jax._src import core

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name in ("jaxtdist_ffi_call", "jaxtdist_host_kernel"):
                yield eqn.params["op"]
            for sub in core.jaxprs_in_params(eqn.params):
                yield from walk(sub)
    return set(walk(jax.make_jaxpr(fn)(*args).jaxpr))


def test_moe_tp_mlp_overlapped_trains_on_the_steps():
    """overlap=True: the overlapped kernels serve the forward pass where no derivative
    is taken; under jax.grad the layer is the step-by-step schedule, forward and
    backward (one forward: the overlapped one would need the steps' forward again
    in the backward pass), and its gradients are the steps'."""
    world = 2
    mesh = setup(world, ("tp",))
    fn, specs = _fn(mesh, True, overlap=True)
    steps, _ = _fn(mesh, True, overlap=False)
    rng = np.random.default_rng(41)
    arrays = (rand((world * 3, 16)), _routing(rng, world * 3, 2, 4), rand((world * 3, 2)),
              rand((4, 16, 8), scale=0.3), rand((4, 8, 16), scale=0.3),
              rand((4, 16, 8), scale=0.3))
    placed = [place(mesh, a, s) for a, s in zip(arrays, specs)]
    assert "moe_tp_mlp" in _ops_launched(fn, *placed)  # the overlapped kernels
    grad = jax.grad(lambda *a: jnp.sum(fn(*a) ** 2), argnums=(0, 2, 3, 4, 5))
    assert "moe_tp_mlp" not in _ops_launched(grad, *placed)
    assert "all_gather" in _ops_launched(grad, *placed)
    want = jax.grad(lambda *a: jnp.sum(steps(*a) ** 2), argnums=(0, 2, 3, 4, 5))(*placed)
    for got, ref in zip(jax.jit(grad)(*placed), want):
        assert rel_err(got, ref) < 1e-6
