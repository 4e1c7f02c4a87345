"""jaxtdist.nn on inputs as users have them (CPU, 8 host devices): prompts of any
length and batch on any mesh, right-padded prompts with ``lengths`` or ``pad_id``,
a batch of prompts of different lengths, decode batches smaller than dp, a
training step that compiles once, and the MoE router's count of invalid ids;
against a float64 numpy reference from the same named parameters."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

flax = pytest.importorskip("flax")
optax = pytest.importorskip("optax")
from flax import nnx  # noqa: E402

from jaxtdist import nn as tdnn  # noqa: E402
from tests.conftest import dp_tp_mesh, rel_err  # noqa: E402
from tests.test_cpu_nn import _cfg, _llama_reference, _weights  # noqa: E402

_prefill = nnx.jit(lambda m, t, n: m(t, lengths=n))
_decode = nnx.jit(lambda m, t: m(t, decode=True))


def _greedy_reference(w, prompt, cfg, steps):
    """(the float64 reference's greedy tokens, the logits [steps, vocab] each came from)."""
    seq, logits = list(prompt), []
    for _ in range(steps):
        last = _llama_reference(w, np.asarray([seq]), cfg)[0, -1]
        logits.append(last)
        seq.append(int(np.argmax(last)))
    return seq[len(prompt):], np.asarray(logits)


@pytest.mark.parametrize("impl", ["jaxtdist", "xla"])
def test_odd_and_right_padded_prompts_decode_like_the_reference(impl):
    """A 5- and a 7-token prompt on tp 4 (were refused), and the 5 right-padded to 8
    with lengths (decoded wrong tokens: the cache position counted the padding) or
    pad_id: the reference's greedy tokens, logits close, NaN at the padding. Batch
    1 on dp 2: the decode batch is smaller than dp (init_cache refused it)."""
    mesh = dp_tp_mesh((2, 4))
    cfg = _cfg(8, 2, layers=1)
    model = tdnn.Llama(cfg, mesh=mesh, impl=impl, rngs=nnx.Rngs(0))
    w = _weights(model)
    pad = cfg.vocab - 1
    prompt = np.random.default_rng(11).integers(0, pad, 7).astype(np.int32)  # no pad id
    steps = 3
    want, want_logits = _greedy_reference(w, prompt[:5], cfg, steps)
    padded = np.pad(prompt[None, :5], ((0, 0), (0, 3)), constant_values=pad)
    assert tdnn.generate(model, padded, steps, pad_id=pad)[0].tolist() == want
    # Step by step, the 5 tokens as they are (padded inside): the prefill's logits,
    # the position, the decode steps' logits.
    model.init_cache(1, 8 + steps)
    logits = nnx.jit(lambda m, t: m(t))(model, prompt[None, :5])
    assert rel_err(logits, _llama_reference(w, prompt[None, :5], cfg)) < 1e-5
    assert int(model.position) == 5 and model.lengths.tolist() == [5]
    for t in range(1, steps):
        out = _decode(model, np.array([[want[t - 1]]], np.int32))
        assert rel_err(np.asarray(out)[0, 0], want_logits[t]) < 1e-5, t
    assert model.lengths.tolist() == [5 + steps - 1]
    # Padded with lengths: the same logits at the real positions, NaN past them,
    # the position the length.
    logits = np.asarray(_prefill(model, padded, np.array([5], np.int32)))
    assert logits.shape == (1, 8, cfg.vocab)
    assert rel_err(logits[:, :5], _llama_reference(w, prompt[None, :5], cfg)) < 1e-5
    assert np.isnan(logits[:, 5:]).all()
    assert model.lengths.tolist() == [5]


@pytest.mark.parametrize("impl,lengths,explicit", [("jaxtdist", (5, 3, 7, 2), True),
                                                   ("xla", (5, 3, 7), True),
                                                   ("xla", (6, 1, 3, 2), False)])
def test_batched_prompts_of_different_lengths_each_decode_as_alone(impl, lengths, explicit):
    """Prompts of different lengths in one batch (token lists): each continues as
    the reference continues it alone; a batch of 4 divides over dp 2 (each
    group's positions its own), one of 3 does not (cached replicated); Explicit
    and Auto mesh axes."""
    mesh = dp_tp_mesh((2, 4), explicit)
    cfg = _cfg(8, 2, layers=1)
    model = tdnn.Llama(cfg, mesh=mesh, impl=impl, rngs=nnx.Rngs(0))
    w = _weights(model)
    rng = np.random.default_rng(12)
    prompts = [rng.integers(0, cfg.vocab, n).tolist() for n in lengths]
    got = tdnn.generate(model, prompts, 3)
    assert got.shape == (len(lengths), 3)
    for prompt, row in zip(prompts, got):
        assert row.tolist() == _greedy_reference(w, np.asarray(prompt), cfg, 3)[0], prompt
    assert model.lengths.tolist() == [n + 2 for n in lengths]


def test_padding_routes_nowhere_and_is_out_of_the_loss():
    """MoE Llama (capacity on): a batch right-padded with lengths gives the
    unpadded batch's logits and router statistics (the padding neither counted
    nor taking capacity); the loss and its gradients are the unpadded ones (the
    XLA twin: the masking is the model's, not the ops')."""
    mesh = dp_tp_mesh((2, 4))
    cfg = dataclasses.replace(_cfg(8, 2, layers=1), num_experts=4, experts_per_token=2,
                              moe_capacity_factor=2.0)
    ours, theirs = tdnn.Llama.twins(cfg, mesh)
    rng = np.random.default_rng(13)
    tokens = rng.integers(0, cfg.vocab, (2, 6)).astype(np.int32)
    targets = rng.integers(0, cfg.vocab, (2, 6)).astype(np.int32)
    lengths = np.array([6, 4], np.int32)
    padded, padded_targets = (np.pad(a, ((0, 0), (0, 2)), constant_values=3)
                              for a in (tokens, targets))
    fwd = nnx.jit(lambda m, t, n: m(t, lengths=n, return_router_stats=True))
    # jaxtdist's model on the padded batch, its XLA twin on the batch as it is.
    (ref, ref_stats), (out, stats) = (fwd(theirs, tokens, lengths), fwd(ours, padded, lengths))
    out, ref = np.asarray(out), np.asarray(ref)
    assert np.isnan(out[1, 4:]).all() and np.isnan(ref[1, 4:]).all()
    assert rel_err(out[0, :6], ref[0]) < 1e-6 and rel_err(out[1, :4], ref[1, :4]) < 1e-6
    for a, b in zip(ref_stats[0], stats[0]):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-6, atol=1e-7)
    # The second sequence alone, its first 4 tokens: the reference (capacity 2.0
    # drops nothing here).
    w = _weights(ours)
    assert rel_err(out[1, :4], _llama_reference(w, tokens[1:, :4], cfg)[0]) < 1e-5
    grad = nnx.jit(nnx.value_and_grad(lambda m, t, y, n: m.loss(t, y, lengths=n)))
    (loss, g), (loss_p, g_p) = (grad(theirs, tokens, targets, lengths),
                                grad(theirs, padded, padded_targets, lengths))
    logp = jax.nn.log_softmax(_llama_reference(w, tokens, cfg), -1)
    nll = -np.concatenate([np.take_along_axis(logp[i, :n], targets[i, :n, None], -1)[:, 0]
                           for i, n in enumerate(lengths)]).mean()
    assert abs(float(loss) - nll) < 1e-5 * nll and abs(float(loss_p) - nll) < 1e-5 * nll
    for (path, a), (_, b) in zip(nnx.to_flat_state(nnx.state(g, nnx.Param)),
                                 nnx.to_flat_state(nnx.state(g_p, nnx.Param))):
        assert rel_err(b[...], a[...]) < 1e-5, path


@pytest.mark.parametrize("make", ["Optimizer", "place_on_mesh"])
def test_the_documented_training_step_compiles_once(make):
    """docs/flax.md's loop: traced once over 3 steps (optax's count sat on one
    device and the norms' P() came back P(None): the second call compiled
    again). jaxtdist.nn.Optimizer, or nnx.Optimizer then place_on_mesh."""
    mesh = dp_tp_mesh((2, 4))
    model = tdnn.Llama(_cfg(4, 2, layers=1), mesh=mesh, impl="xla", rngs=nnx.Rngs(0))
    if make == "Optimizer":
        optimizer = tdnn.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
    else:
        optimizer = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
        tdnn.place_on_mesh(optimizer, mesh)
    traces = []

    @nnx.jit
    def train_step(model, optimizer, tokens, targets):
        traces.append(1)
        loss, grads = nnx.value_and_grad(tdnn.Llama.loss)(model, tokens, targets)
        optimizer.update(model, grads)
        return loss

    batch = np.random.default_rng(14).integers(0, 48, (4, 9)).astype(np.int32)
    losses = [float(train_step(model, optimizer, batch[:, :-1], batch[:, 1:]))
              for _ in range(3)]
    assert len(traces) == 1 and losses[-1] < losses[0]


class _BadRouter(tdnn.ParallelMoE):
    """Its route() sends every third token's second pick to expert id E (invalid)."""

    def route(self, tokens, real=None):
        ids, weights, stats = super().route(tokens, real)
        bad = (jnp.arange(ids.shape[0]) % 3 == 0)[:, None] & (jnp.arange(ids.shape[1]) == 1)
        return jnp.where(bad, self.num_experts, ids), weights, stats


@pytest.mark.parametrize("parallelism", ["expert", "tensor"])
def test_router_stats_count_invalid_expert_ids(parallelism):
    """An id outside [0, E) adds zero (as moe_dispatch takes it) and is counted in
    RouterStats.invalid, alike in both impls (was visible only in the handle)."""
    mesh = dp_tp_mesh((2, 4))
    x = np.random.default_rng(15).standard_normal((2, 12, 16)).astype(np.float32)
    outs = []
    for impl in ("jaxtdist", "xla"):
        moe = _BadRouter(16, 32, num_experts=4, top_k=2, parallelism=parallelism, mesh=mesh,
                         impl=impl, rngs=nnx.Rngs(0))
        y, stats = nnx.jit(lambda m, a: m(a, return_router_stats=True))(moe, x)
        assert int(stats.invalid) == 8  # tokens 0, 3, ..., 21 of 24
        outs.append(np.asarray(y))
    assert rel_err(outs[0], outs[1]) < 1e-6
    good = tdnn.ParallelMoE(16, 32, num_experts=4, top_k=2, parallelism=parallelism, mesh=mesh,
                            impl="xla", rngs=nnx.Rngs(0))
    assert int(nnx.jit(lambda m, a: m(a, return_router_stats=True))(good, x)[1].invalid) == 0


def test_bfloat16_moe_twins_route_alike_on_the_same_input():
    """bfloat16: given the same input, both twins route every token alike (the
    router's logits and top-k in float32 in both: equal statistics) and differ by
    bfloat16 rounding only. In a whole model they may not (docs/flax.md): the
    layers before the MoE round differently (ag_matmul, the fused attention), by
    about 0.3-0.7% here, which flips near-tied routes (1 of 64 tokens in the
    second layer of a 2-layer model)."""
    mesh = dp_tp_mesh((2, 4))
    x = jnp.asarray(np.random.default_rng(16).standard_normal((2, 8, 16)), jnp.bfloat16)
    outs = []
    for impl in ("jaxtdist", "xla"):
        moe = tdnn.ParallelMoE(16, 32, num_experts=4, top_k=2, mesh=mesh, impl=impl,
                               dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
        outs.append(nnx.jit(lambda m, a: m(a, return_router_stats=True))(moe, x))
    (ours, ours_stats), (theirs, theirs_stats) = outs
    np.testing.assert_array_equal(np.asarray(ours_stats.load), np.asarray(theirs_stats.load))
    np.testing.assert_array_equal(np.asarray(ours_stats.prob), np.asarray(theirs_stats.prob))
    assert rel_err(ours, np.asarray(theirs.astype(jnp.float32))) < 2e-2


def test_moe_padding_takes_no_dense_expert_slot():
    """ParallelMoE(impl="xla", xla_experts="dense") with a capacity: a sequence's
    right padding (lengths) and the layer's own padding (seq 5 on tp 4) take no
    slot, so the real tokens' outputs and statistics are those of the batch
    without the padding tokens' contents (here: padding of other values)."""
    mesh = dp_tp_mesh((2, 4))
    moe = tdnn.ParallelMoE(16, 24, num_experts=4, top_k=2, impl="xla", mesh=mesh,
                           capacity_factor=1.0, xla_experts="dense", rngs=nnx.Rngs(0))
    rng = np.random.default_rng(17)
    x = rng.standard_normal((2, 5, 16)).astype(np.float32)
    other = x.copy()
    other[1, 3:] = rng.standard_normal((2, 16)) * 10  # padding: must not matter
    lengths = np.array([5, 3], np.int32)
    run = nnx.jit(lambda m, a, n: m(a, lengths=n, return_router_stats=True))
    (y, stats), (y2, stats2) = run(moe, x, lengths), run(moe, other, lengths)
    y, y2 = np.asarray(y), np.asarray(y2)
    assert rel_err(y2[0], y[0]) < 1e-6 and rel_err(y2[1, :3], y[1, :3]) < 1e-6
    for a, b in zip(stats, stats2):
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a))
