"""jaxtdist.nn.ParallelMoE on CPU (8 host devices): expert- and tensor-parallel
against a float64 numpy reference from the same parameters and against its
impl="xla" twin, prefill and decode (a batch that divides nothing), gradients,
the router stats and load-balancing loss (Hugging Face Mixtral's), plain JAX
transforms, jaxtdist's grouped GEMM under the interpreter, and
bad arguments."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

flax = pytest.importorskip("flax")
from flax import nnx  # noqa: E402

from jaxtdist import nn as tdnn  # noqa: E402
from tests.conftest import dp_tp_mesh, f64, rel_err  # noqa: E402

D, HIDDEN, EXPERTS, TOP_K = 16, 24, 8, 2
_mesh = dp_tp_mesh


def _weights(layer) -> dict:
    return {name: f64(np.asarray(getattr(layer, name)[...]))
            for name in ("router", "gate_proj", "up_proj", "down_proj")}


def _routing(w, x, k, norm=True):
    """(ids [..., k], weights [..., k], probs [..., E]) as the layer routes, float64."""
    logits = x @ w["router"]
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    ids = np.argsort(-probs, axis=-1, kind="stable")[..., :k]
    gates = np.take_along_axis(probs, ids, -1)
    if norm:
        gates = gates / gates.sum(-1, keepdims=True)
    return ids, gates, probs


def _reference(w, x, k, norm=True):
    """float64: each token through each of its top-k SwiGLU experts, weighted."""
    x = f64(x)
    ids, gates, _ = _routing(w, x, k, norm)
    gate = np.einsum("bsd,bskdh->bskh", x, w["gate_proj"][ids])
    up = np.einsum("bsd,bskdh->bskh", x, w["up_proj"][ids])
    h = gate / (1 + np.exp(-gate)) * up
    return np.einsum("bskh,bskhd,bsk->bsd", h, w["down_proj"][ids], gates)


def _count(monkeypatch):
    """Counts the layer's calls of jaxtdist's MoE ops (not the XLA twin's)."""
    from jaxtdist.nn import _moe

    calls = []
    for name in ("moe_dispatch", "moe_tp_mlp_sharded"):
        real = getattr(_moe, name)

        def counted(*a, _real=real, _name=name, **kw):
            calls.append(_name)
            return _real(*a, **kw)

        monkeypatch.setattr(_moe, name, counted)
    return calls


@pytest.mark.parametrize("shape,parallelism,explicit", [
    ((2, 2), "expert", True), ((1, 4), "expert", False), ((2, 2), "tensor", False),
    ((1, 4), "tensor", True), ((4, 1), "expert", True)])
def test_matches_the_reference_and_its_xla_twin(monkeypatch, shape, parallelism, explicit):
    calls = _count(monkeypatch)
    _mesh(shape, explicit)
    layer, twin = (tdnn.ParallelMoE(D, HIDDEN, num_experts=EXPERTS, top_k=TOP_K,
                                    parallelism=parallelism, impl=impl, rngs=nnx.Rngs(0))
                   for impl in ("jaxtdist", "xla"))
    w = _weights(layer)
    x = np.random.default_rng(1).standard_normal((2, 8, D)).astype(np.float32)
    forward = nnx.jit(lambda m, x: m(x))
    ref = _reference(w, x, TOP_K)
    assert rel_err(forward(layer, x), ref) < 1e-5
    op = "moe_dispatch" if parallelism == "expert" else "moe_tp_mlp_sharded"
    assert calls == [op], calls
    assert rel_err(forward(twin, x), ref) < 1e-5
    assert calls == [op], calls  # the twin ran no jaxtdist op
    # Decode, one token per sequence: 3 sequences (divisible by neither dp nor tp:
    # spread over every device) and 6 (each dp group's spread over its tp ranks).
    for batch in (3, 6):
        x1 = np.random.default_rng(batch).standard_normal((batch, 1, D)).astype(np.float32)
        out = nnx.jit(lambda m, x: m(x, decode=True))(layer, x1)
        assert out.shape == (batch, 1, D)
        assert rel_err(out, _reference(w, x1, TOP_K)) < 1e-5, batch


def test_gradients_and_the_load_balancing_loss_match():
    """Gradients of every parameter (router included, through the routing weights)
    against the XLA twin's; the router stats and the load-balancing loss against
    Hugging Face Mixtral's formula; top-1 without renormalization (DeepSeek-style
    weights)."""
    _mesh((2, 2))
    layer, twin = (tdnn.ParallelMoE(D, HIDDEN, num_experts=EXPERTS, top_k=1,
                                    norm_topk_prob=False, impl=impl, rngs=nnx.Rngs(3))
                   for impl in ("jaxtdist", "xla"))
    x = np.random.default_rng(4).standard_normal((2, 8, D)).astype(np.float32)
    g = np.random.default_rng(5).standard_normal((2, 8, D)).astype(np.float32)

    @nnx.jit
    def grads(m, x, g):
        return nnx.grad(lambda m: jnp.sum(m(x) * g))(m)

    ours, theirs = grads(layer, x, g), grads(twin, x, g)
    for name in ("router", "gate_proj", "up_proj", "down_proj"):
        a, b = np.asarray(getattr(ours, name)[...]), f64(np.asarray(getattr(theirs, name)[...]))
        assert np.abs(b).max() > 0, name
        assert rel_err(a, b) < 1e-5, name
    w = _weights(layer)
    assert rel_err(nnx.jit(lambda m, x: m(x))(layer, x), _reference(w, x, 1, norm=False)) < 1e-5

    # Two layers' stats, against Hugging Face's load_balancing_loss_func (its logits
    # concatenated over the layers): E * sum_e (picks of e / tokens) * mean prob of e.
    other = tdnn.ParallelMoE(D, HIDDEN, num_experts=EXPERTS, top_k=2, rngs=nnx.Rngs(9))
    stats = [nnx.jit(lambda m, x: m(x, return_router_stats=True)[1])(m, x)
             for m in (layer, other)]
    routed = [_routing(_weights(m), f64(x), k, norm=False) for m, k in ((layer, 1), (other, 2))]
    for (ids, _, probs), got, k in zip(routed, stats, (1, 2)):
        load = np.bincount(ids.reshape(-1), minlength=EXPERTS) / (ids.size / k)
        assert rel_err(got.load, load) < 1e-6 and abs(load.sum() - k) < 1e-9
        assert rel_err(got.prob, probs.reshape(-1, EXPERTS).mean(0)) < 1e-6
    load = np.mean([np.bincount(r[0].reshape(-1), minlength=EXPERTS) / 16 for r in routed], 0)
    prob = np.mean([r[2].reshape(-1, EXPERTS).mean(0) for r in routed], 0)
    expected = EXPERTS * np.sum(load * prob)
    assert abs(float(tdnn.load_balancing_loss(stats)) - expected) < 1e-5 * expected
    # It trains the router: its gradient reaches the router and no expert.
    aux = nnx.jit(lambda m, x: nnx.grad(
        lambda m: tdnn.load_balancing_loss([m(x, return_router_stats=True)[1]]))(m))(layer, x)
    assert np.abs(np.asarray(aux.router[...])).max() > 0
    assert not np.asarray(aux.gate_proj[...]).any()
    # No state: plain JAX transforms close over the layer (as over ParallelMLP).
    f = lambda x: layer(x)  # noqa: E731
    ref = f64(nnx.jit(lambda m, x: m(x))(layer, x))
    assert rel_err(jax.jit(jax.checkpoint(f))(x), ref) < 1e-6
    assert np.isfinite(np.asarray(jax.jit(jax.grad(lambda x: jnp.sum(f(x) ** 2)))(x))).all()
    scanned = jax.jit(lambda xs: jax.lax.scan(lambda c, x: (c, f(x)), 0, xs)[1])(x[None])
    assert rel_err(scanned[0], ref) < 1e-6
    # A decode step's padding rows count in no statistic (3 sequences over dp x tp = 4;
    # 6 over dp = 2 groups, each padded from 3 to a multiple of tp = 2).
    for batch in (3, 6):
        x1 = np.random.default_rng(10).standard_normal((batch, 1, D)).astype(np.float32)
        _, got = nnx.jit(lambda m, x: m(x, decode=True, return_router_stats=True))(other, x1)
        ids, _, probs = _routing(_weights(other), f64(x1), 2, norm=False)
        load = np.bincount(ids.reshape(-1), minlength=EXPERTS) / batch
        assert rel_err(got.load, load) < 1e-6, batch
        assert rel_err(got.prob, probs.reshape(-1, EXPERTS).mean(0)) < 1e-6, batch


def _capacity_keep(ids, mesh_shape, batch, capacity):
    """[T, k] bool: GShard's expert capacity per device's tokens (every first pick
    before any second pick, then token order). Device (i, j) of a (dp, tp) mesh
    holds positions block j of the sequences of batch block i, in that order."""
    t, k = ids.shape
    (dp, tp), seq = mesh_shape, t // batch
    keep = np.zeros((t, k), bool)
    for i in range(dp):
        for j in range(tp):
            rows = [b * seq + p for b in range(i * batch // dp, (i + 1) * batch // dp)
                    for p in range(j * seq // tp, (j + 1) * seq // tp)]
            taken = np.zeros(EXPERTS, int)
            for kk in range(k):
                for r in rows:
                    keep[r, kk] = taken[ids[r, kk]] < capacity
                    taken[ids[r, kk]] += 1
    return keep


@pytest.mark.parametrize("shape,parallelism,explicit", [
    ((2, 2), "expert", True), ((1, 4), "expert", False), ((1, 2), "tensor", True)])
def test_expert_capacity_drops_the_picks_past_it(monkeypatch, shape, parallelism, explicit):
    """capacity_factor: the picks past ceil(cf * T * k / E) per expert among each
    device's T tokens weigh 0 (the same ones under every parallelism and the XLA
    twin, against a float64 reference), RouterStats.dropped gives their share,
    the dispatch receives E * C rows instead of its default, gradients match the
    twin's; a large factor drops nothing; a decode step drops only within its
    real tokens."""
    from jaxtdist.nn import _moe

    seen = []
    real_dispatch = _moe.moe_dispatch
    monkeypatch.setattr(_moe, "moe_dispatch", lambda *a, **kw: (
        seen.append(kw.get("max_recv_rows")), real_dispatch(*a, **kw))[1])
    _mesh(shape, explicit)
    groups = shape[0] * shape[1]
    x = np.random.default_rng(11).standard_normal((2, 8, D)).astype(np.float32)
    per_device = 16 // groups
    for factor in (1.0, 0.5, 100.0):
        layer, twin = (tdnn.ParallelMoE(D, HIDDEN, num_experts=EXPERTS, top_k=TOP_K,
                                        parallelism=parallelism, impl=impl,
                                        capacity_factor=factor, rngs=nnx.Rngs(12))
                       for impl in ("jaxtdist", "xla"))
        w = _weights(layer)
        capacity = max(1, int(np.ceil(factor * per_device * TOP_K / EXPERTS)))
        ids, gates, _ = _routing(w, f64(x).reshape(16, D), TOP_K)
        keep = _capacity_keep(ids, shape, 2, capacity)
        if factor < 100:
            assert not keep.all(), "the routing must overflow some expert"
        else:
            assert keep.all()
        gates = np.where(keep, gates, 0)
        xt = f64(x).reshape(16, D)
        gate = np.einsum("td,tkdh->tkh", xt, w["gate_proj"][ids])
        up = np.einsum("td,tkdh->tkh", xt, w["up_proj"][ids])
        h = gate / (1 + np.exp(-gate)) * up
        ref = np.einsum("tkh,tkhd,tk->td", h, w["down_proj"][ids], gates).reshape(2, 8, D)
        seen.clear()
        y, stats = nnx.jit(lambda m, x: m(x, return_router_stats=True))(layer, x)
        assert rel_err(y, ref) < 1e-5, factor
        assert abs(float(stats.dropped) - (~keep).mean()) < 1e-7, factor
        if parallelism == "expert":
            default = shape[1] * per_device * min(TOP_K, EXPERTS // shape[1])
            assert seen == [min(EXPERTS * capacity, default)], (seen, factor)
        y_twin, stats_twin = nnx.jit(lambda m, x: m(x, return_router_stats=True))(twin, x)
        assert rel_err(y_twin, ref) < 1e-5 and float(stats_twin.dropped) == float(stats.dropped)
    # Gradients (factor 0.5) against the twin's: the dropped picks pass none.
    layer, twin = (tdnn.ParallelMoE(D, HIDDEN, num_experts=EXPERTS, top_k=TOP_K,
                                    parallelism=parallelism, impl=impl, capacity_factor=0.5,
                                    rngs=nnx.Rngs(12)) for impl in ("jaxtdist", "xla"))
    grads = nnx.jit(lambda m, x: nnx.grad(lambda m: jnp.sum(m(x) ** 2))(m))
    ours, theirs = grads(layer, x), grads(twin, x)
    for name in ("router", "gate_proj", "up_proj", "down_proj"):
        a, b = np.asarray(getattr(ours, name)[...]), f64(np.asarray(getattr(theirs, name)[...]))
        assert np.abs(b).max() > 0 and rel_err(a, b) < 1e-5, name
    # Decode: 3 sequences padded to a multiple of the devices; the padding takes no
    # place (one token per device at most: nothing to drop at factor 1).
    x1 = np.random.default_rng(13).standard_normal((3, 1, D)).astype(np.float32)
    y1, st1 = nnx.jit(lambda m, x: m(x, decode=True, return_router_stats=True))(layer, x1)
    if groups >= 3:
        assert float(st1.dropped) == 0.0
        assert rel_err(y1, _reference(_weights(layer), x1, TOP_K)) < 1e-5
    assert np.isfinite(np.asarray(y1)).all() and y1.shape == (3, 1, D)
    if shape[0] == 2:
        # 6 sequences over dp = 2: each group's 3 tokens spread over its tp ranks,
        # padded to a multiple of tp; the capacity counts each device's real tokens.
        x6 = np.random.default_rng(14).standard_normal((6, 1, D)).astype(np.float32)
        y6, st6 = nnx.jit(lambda m, x: m(x, decode=True, return_router_stats=True))(layer, x6)
        w = _weights(layer)
        xt = f64(x6).reshape(6, D)
        ids, gates, _ = _routing(w, xt, TOP_K)
        per = -(-3 // shape[1])
        cap = max(1, int(np.ceil(0.5 * per * TOP_K / EXPERTS)))
        keep = np.zeros((6, TOP_K), bool)
        for i in range(2):
            for j in range(shape[1]):
                rows = [3 * i + p for p in range(j * per, min((j + 1) * per, 3))]
                taken = np.zeros(EXPERTS, int)
                for kk in range(TOP_K):
                    for r in rows:
                        keep[r, kk] = taken[ids[r, kk]] < cap
                        taken[ids[r, kk]] += 1
        assert not keep.all(), "the routing must overflow some expert"
        gate = np.einsum("td,tkdh->tkh", xt, w["gate_proj"][ids])
        up = np.einsum("td,tkdh->tkh", xt, w["up_proj"][ids])
        h = gate / (1 + np.exp(-gate)) * up
        ref = np.einsum("tkh,tkhd,tk->td", h, w["down_proj"][ids], np.where(keep, gates, 0))
        assert rel_err(y6, ref.reshape(6, 1, D)) < 1e-5
        assert abs(float(st6.dropped) - (~keep).mean()) < 1e-7


def test_jaxtdist_grouped_gemm_under_the_interpreter():
    """grouped_gemm="jaxtdist": the experts' GEMMs on jaxtdist.grouped_matmul (the
    Triton kernel under the interpreter), both parallelisms, and its gradient."""
    _mesh((1, 2))
    x = np.random.default_rng(6).standard_normal((1, 4, D)).astype(np.float32)
    for parallelism in ("expert", "tensor"):
        layer = tdnn.ParallelMoE(D, HIDDEN, num_experts=4, top_k=2, parallelism=parallelism,
                                 grouped_gemm="jaxtdist", rngs=nnx.Rngs(7))
        assert rel_err(nnx.jit(lambda m, x: m(x))(layer, x),
                       _reference(_weights(layer), x, 2)) < 1e-5, parallelism
    dw = nnx.jit(lambda m, x: nnx.grad(lambda m: jnp.sum(m(x) ** 2))(m))(layer, x)
    assert np.isfinite(np.asarray(dw.down_proj[...])).all()


def test_bad_arguments_name_the_layer():
    _mesh((2, 4))
    make = lambda **kw: tdnn.ParallelMoE(D, HIDDEN, rngs=nnx.Rngs(0),  # noqa: E731
                                         **{"num_experts": 8, "top_k": 2, **kw})
    with pytest.raises(ValueError, match="ParallelMoE: parallelism='data'; allowed"):
        make(parallelism="data")
    with pytest.raises(ValueError, match="top_k=9 exceeds num_experts=8"):
        make(top_k=9)
    with pytest.raises(ValueError, match="num_experts=6 must be divisible by the size 4"):
        make(num_experts=6)
    with pytest.raises(ValueError, match="hidden=26 must be divisible by the size 4"):
        tdnn.ParallelMoE(D, 26, num_experts=8, top_k=2, parallelism="tensor",
                         rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="grouped_gemm='cublas'; allowed"):
        make(grouped_gemm="cublas")
    for bad in (0, 2.0, True):
        with pytest.raises(ValueError, match=rf"top_k={bad} must be an integer >= 1"):
            make(top_k=bad)
    assert make(top_k=np.int64(2)).top_k == 2  # numpy integers are integers
    with pytest.raises(ValueError, match="norm_topk_prob='no' must be a bool"):
        make(norm_topk_prob="no")
    for bad in (0, -1.0, float("inf"), float("nan"), True, "1.25"):
        with pytest.raises(ValueError, match=r"capacity_factor=.* must be None \(no capacity"):
            make(capacity_factor=bad)
    assert make(capacity_factor=np.float32(1.25)).capacity_factor == 1.25
    # jaxtdist's grouped GEMM holds at most 256 experts per rank: refused when built.
    with pytest.raises(ValueError, match="puts 512 of num_experts=512 on each"):
        make(num_experts=512, parallelism="tensor", grouped_gemm="jaxtdist")
    make(num_experts=1024, grouped_gemm="jaxtdist")  # 256 per rank: fine
    with pytest.raises(ValueError, match=r"ParallelMoE: x has shape \(2, 8, 15\); "
                                         r"expected \[batch, seq, 16\]"):
        make()(jnp.zeros((2, 8, 15)))
