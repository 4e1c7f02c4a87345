"""jaxtdist.nn's Flax NNX layers on CPU (8 host devices): the Llama model and its
layers against a float64 plain-numpy reference from the same named parameters
(GQA, RoPE, segment ids, decode with the KV cache), gradients and optax steps,
Explicit and Auto mesh axes, checkpoints, the Hugging Face loader, and bad
arguments."""

from __future__ import annotations

import dataclasses
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

flax = pytest.importorskip("flax")
optax = pytest.importorskip("optax")
from flax import nnx  # noqa: E402

from jaxtdist import nn as tdnn  # noqa: E402
from tests.conftest import dp_tp_mesh, f64, rel_err  # noqa: E402


_mesh = dp_tp_mesh


def _weights(module) -> dict:
    """Every parameter as float64 numpy, keyed by its path ("layers.0.mlp.up_proj.kernel")."""
    return {".".join(str(k) for k in path): f64(np.asarray(v[...]))
            for path, v in nnx.to_flat_state(nnx.state(module, nnx.Param))}


def _tokens(rng, shape, vocab):
    return rng.integers(0, vocab, shape).astype(np.int32)


# -- a float64 reference, written from the Hugging Face Llama equations ----------------

def _llama3_inv_freq(inv, scaling):
    """Llama 3.1's scaled frequencies, frequency by frequency as Meta's reference
    code branches (by wavelength against the trained context)."""
    context = scaling.original_max_position_embeddings
    short, long = context / scaling.high_freq_factor, context / scaling.low_freq_factor
    out = []
    for freq in inv:
        wavelength = 2 * np.pi / freq
        if wavelength < short:
            out.append(freq)
        elif wavelength > long:
            out.append(freq / scaling.factor)
        else:
            smooth = ((context / wavelength - scaling.low_freq_factor)
                      / (scaling.high_freq_factor - scaling.low_freq_factor))
            out.append((1 - smooth) * freq / scaling.factor + smooth * freq)
    return np.asarray(out)


def _rope(x, positions, theta, scaling=None):
    half = x.shape[-1] // 2
    inv = 1.0 / theta ** (np.arange(half) / half)
    if scaling is not None:
        inv = _llama3_inv_freq(inv, scaling)
    ang = positions[..., None] * inv
    cos, sin = (np.concatenate([f(ang)] * 2, -1)[:, :, None] for f in (np.cos, np.sin))
    return x * cos + np.concatenate([-x[..., half:], x[..., :half]], -1) * sin


def _attention(w, p, x, cfg, positions, segment_ids, causal=True):
    b, s, _ = x.shape
    hd = cfg.head_dim or cfg.d_model // cfg.num_heads
    kv = cfg.num_kv_heads or cfg.num_heads
    q = (x @ w[p + "q_proj.kernel"]).reshape(b, s, cfg.num_heads, hd)
    k = (x @ w[p + "k_proj.kernel"]).reshape(b, s, kv, hd)
    v = (x @ w[p + "v_proj.kernel"]).reshape(b, s, kv, hd)
    if cfg.qk_norm:  # Qwen3: each head's q and k RMS-normalized, before RoPE
        q, k = _rms(q, w[p + "q_norm.scale"], cfg.norm_eps), _rms(k, w[p + "k_norm.scale"],
                                                                  cfg.norm_eps)
    if cfg.rope_theta:
        q, k = (_rope(a, positions, cfg.rope_theta, cfg.rope_scaling) for a in (q, k))
    rep = cfg.num_heads // kv
    k, v = np.repeat(k, rep, axis=2), np.repeat(v, rep, axis=2)
    scores = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(hd)
    mask = np.tril(np.ones((s, s), bool)) if causal else np.ones((s, s), bool)
    mask = mask[None, None] & (segment_ids[:, None, :, None] == segment_ids[:, None, None, :])
    scores = np.where(mask, scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    o = np.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, -1)
    return o @ w[p + "o_proj.kernel"]


def _rms(x, scale, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * scale


def _silu(a):
    return a / (1 + np.exp(-a))


def _mlp(w, p, x):
    return (_silu(x @ w[p + "gate_proj.kernel"]) * (x @ w[p + "up_proj.kernel"])) @ w[
        p + "down_proj.kernel"]


def _moe_mlp(w, p, x, k, norm=True):
    """Mixtral's and Qwen3-MoE's sparse MLP: the top k of softmax(x @ router),
    renormalized with ``norm`` (Qwen3-MoE's norm_topk_prob), each a SwiGLU expert
    (weights stacked [E, ...])."""
    logits = x @ w[p + "router"]
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    ids = np.argsort(-probs, axis=-1, kind="stable")[..., :k]
    gates = np.take_along_axis(probs, ids, -1)
    if norm:
        gates /= gates.sum(-1, keepdims=True)
    h = (_silu(np.einsum("bsd,bskdh->bskh", x, w[p + "gate_proj"][ids]))
         * np.einsum("bsd,bskdh->bskh", x, w[p + "up_proj"][ids]))
    return np.einsum("bskh,bskhd,bsk->bsd", h, w[p + "down_proj"][ids], gates)


def _llama_reference(w, tokens, cfg, positions=None, segment_ids=None):
    b, s = tokens.shape
    positions = np.broadcast_to(np.arange(s), (b, s)) if positions is None else positions
    segment_ids = np.zeros((b, s), np.int32) if segment_ids is None else segment_ids
    x = w["embed_tokens.embedding"][tokens]
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        x = x + _attention(w, p + "self_attn.", _rms(x, w[p + "input_layernorm.scale"],
                                                     cfg.norm_eps), cfg, positions, segment_ids)
        h = _rms(x, w[p + "post_attention_layernorm.scale"], cfg.norm_eps)
        # Sparse: Mixtral's every layer, Qwen3-MoE's those in moe_layers.
        sparse = cfg.num_experts and (cfg.moe_layers is None or i in cfg.moe_layers)
        x = x + (_moe_mlp(w, p + "mlp.", h, cfg.experts_per_token, cfg.norm_topk_prob)
                 if sparse else _mlp(w, p + "mlp.", h))
    x = _rms(x, w["norm.scale"], cfg.norm_eps)
    head = w["embed_tokens.embedding"].T if cfg.tie_embeddings else w["lm_head.kernel"]
    return x @ head


def _cfg(heads=8, kv=2, layers=1, d=32, tie=False, theta=10000.0):
    return tdnn.LlamaConfig(vocab=48, d_model=d, num_layers=layers, num_heads=heads,
                            num_kv_heads=kv, hidden=64, rope_theta=theta, tie_embeddings=tie)


# -- forward, decode, gradients, training ---------------------------------------------

# (dp, tp), heads, kv heads: GQA ratios 1, 2, 4; tp above, equal to and below num_kv_heads.
CASES = [((2, 4), 8, 2, True), ((2, 4), 8, 8, False), ((1, 8), 8, 4, True), ((8, 1), 4, 2, True)]


@pytest.mark.parametrize("mesh_shape,heads,kv,explicit", CASES)
def test_llama_matches_the_reference(mesh_shape, heads, kv, explicit):
    """Logits from [batch, seq] tokens, sequence parallel inside, both impls, packed
    sequences (segment ids, positions restarting per segment)."""
    mesh = _mesh(mesh_shape, explicit)
    cfg = _cfg(heads, kv, tie=kv == 8)
    ours, theirs = tdnn.Llama.twins(cfg, mesh)
    rng = np.random.default_rng(0)
    batch, seq = 2 * mesh_shape[0], 16
    tokens = _tokens(rng, (batch, seq), cfg.vocab)
    segs = np.repeat(np.arange(2), seq // 2)[None].repeat(batch, 0).astype(np.int32)
    pos = (np.arange(seq) % (seq // 2))[None].repeat(batch, 0).astype(np.int32)
    w = _weights(ours)
    ref = _llama_reference(w, tokens, cfg)
    ref_packed = _llama_reference(w, tokens, cfg, pos, segs)
    fwd = nnx.jit(lambda m, t, p, s: m(t, positions=p, segment_ids=s))
    for model in (ours, theirs):
        out = nnx.jit(lambda m, t: m(t))(model, tokens)  # plain numpy in: resharded
        assert out.shape == (batch, seq, cfg.vocab)
        assert rel_err(out, ref) < 1e-5
    assert rel_err(fwd(ours, tokens, pos, segs), ref_packed) < 1e-5


def test_attention_takes_jaxtdist_fused_attention(monkeypatch):
    """ParallelAttention attends through ag_attention over a group of one rank (the
    flash-attention kernels on GPUs), except with segment ids or impl="xla";
    logits match the reference either way (here, and in the test above)."""
    from jaxtdist.nn import _attention

    calls = []
    real = _attention.ag_attention

    def counted(q, k, v, axis_name, **kw):
        calls.append((tuple(q.shape), tuple(k.shape), axis_name, kw))
        return real(q, k, v, axis_name, **kw)

    monkeypatch.setattr(_attention, "ag_attention", counted)
    mesh = _mesh((2, 4))
    cfg = _cfg(8, 2, layers=2)
    ours, theirs = tdnn.Llama.twins(cfg, mesh)
    tokens = _tokens(np.random.default_rng(1), (4, 16), cfg.vocab)
    ref = _llama_reference(_weights(ours), tokens, cfg)
    assert rel_err(nnx.jit(lambda m, t: m(t))(ours, tokens), ref) < 1e-5
    # Each layer, each rank's 2 query heads over its 1 KV head (tp 4, 2 KV heads
    # stored replicated), the whole sequence.
    assert calls == [((2, 16, 2, 4), (2, 16, 1, 4), (), dict(causal=True))] * 2, calls
    calls.clear()
    nnx.jit(lambda m, t: m(t))(theirs, tokens)
    segs = np.zeros((4, 16), np.int32)
    nnx.jit(lambda m, t, s: m(t, segment_ids=s))(ours, tokens, segs)
    assert not calls
    # A flag given as 0 or 1 (the masked path took any truth value).
    x = jnp.asarray(np.random.default_rng(2).standard_normal((2, 8, 32)), jnp.float32)
    for causal in (0, 1):
        layers = [tdnn.ParallelAttention(32, 8, num_kv_heads=2, causal=causal, mesh=mesh,
                                         impl=impl, rngs=nnx.Rngs(0)) for impl in ("jaxtdist", "xla")]
        ours_y, xla_y = (nnx.jit(lambda m, x: m(x))(layer, x) for layer in layers)
        assert rel_err(ours_y, xla_y) < 1e-5, causal
        assert calls[-1][3] == dict(causal=bool(causal))


def test_decode_with_the_kv_cache_matches_the_full_forward(monkeypatch):
    """Prefill of 8 tokens then 8 decode steps (GQA, KV heads replicated over tp):
    the logits of one forward pass over all 16 tokens; the position is readable;
    clear_cache drops the cache (then another batch size runs).
    The jaxtdist layers attend through flash_decode over a group of one rank (its
    kernel on GPUs), the XLA twin with a mask."""
    from jaxtdist.nn import _attention

    calls = []
    real = _attention.flash_decode

    def counted(q, k, v, kv_len, axis_name, **kw):
        calls.append((tuple(q.shape), tuple(k.shape), axis_name))
        return real(q, k, v, kv_len, axis_name, **kw)

    monkeypatch.setattr(_attention, "flash_decode", counted)
    mesh = _mesh((2, 4))
    cfg = _cfg(8, 2, layers=2)
    ours, theirs = tdnn.Llama.twins(cfg, mesh)
    batch, prompt, total = 4, 8, 16
    tokens = _tokens(np.random.default_rng(1), (batch, total), cfg.vocab)
    ref = _llama_reference(_weights(ours), tokens, cfg)
    step = nnx.jit(lambda m, t: m(t, decode=True))
    for model in (ours, theirs):
        calls.clear()
        model.init_cache(batch, total)
        logits = nnx.jit(lambda m, t: m(t))(model, tokens[:, :prompt])
        assert rel_err(logits, ref[:, :prompt]) < 1e-5
        assert int(model.position) == prompt
        for t in range(prompt, total):
            logits = step(model, tokens[:, t:t + 1])
            assert logits.shape == (batch, 1, cfg.vocab)
            assert rel_err(logits[:, 0], ref[:, t]) < 1e-5, t
        assert int(model.position) == total
        with pytest.raises(ValueError, match="max_len=16 positions, 16 used; 1 more do not fit"):
            model.layers[0].self_attn.check_room(1)
        # Inside jit past the end: NaN, never a wrong number.
        assert np.isnan(np.asarray(step(model, tokens[:, :1]))).all()
        # Traced once, each layer: each rank's 2 query heads of 2 sequences over
        # its cache (1 KV head, 16 positions).
        assert calls == ([((2, 2, 4), (2, 16, 1, 4), ())] * 2 if model is ours else []), calls
        # Done decoding: without the cache, another batch size runs the full forward.
        model.clear_cache()
        with pytest.raises(ValueError, match="no KV cache"):
            model.position  # noqa: B018 - the property raises
        assert rel_err(nnx.jit(lambda m, t: m(t))(model, tokens[:2]), ref[:2]) < 1e-5


def test_gradients_and_five_adamw_steps_match_the_reference():
    _mesh((2, 4))
    cfg = _cfg(8, 4)
    model = tdnn.Llama(cfg, rngs=nnx.Rngs(3))
    rng = np.random.default_rng(2)
    batch = _tokens(rng, (4, 9), cfg.vocab)
    tokens, targets = batch[:, :-1], batch[:, 1:]

    def ref_loss(params):  # the same model in plain jax (float32), no mesh
        w = params
        x = w["embed_tokens.embedding"][tokens]
        h = x
        s = tokens.shape[1]
        pos = jnp.broadcast_to(jnp.arange(s), tokens.shape)
        for i in range(cfg.num_layers):
            p = f"layers.{i}."
            n = h / jnp.sqrt((h * h).mean(-1, keepdims=True) + cfg.norm_eps) * w[
                p + "input_layernorm.scale"]
            q, k, v = (n @ w[p + f"self_attn.{n_}_proj.kernel"] for n_ in "qkv")
            q = tdnn.rope(q.reshape(4, s, 8, 4), pos, cfg.rope_theta)
            k = tdnn.rope(k.reshape(4, s, 4, 4), pos, cfg.rope_theta)
            o = jax.nn.dot_product_attention(q, k, v.reshape(4, s, 4, 4), is_causal=True)
            h = h + o.reshape(4, s, -1) @ w[p + "self_attn.o_proj.kernel"]
            n = h / jnp.sqrt((h * h).mean(-1, keepdims=True) + cfg.norm_eps) * w[
                p + "post_attention_layernorm.scale"]
            h = h + (jax.nn.silu(n @ w[p + "mlp.gate_proj.kernel"]) * (
                n @ w[p + "mlp.up_proj.kernel"])) @ w[p + "mlp.down_proj.kernel"]
        h = h / jnp.sqrt((h * h).mean(-1, keepdims=True) + cfg.norm_eps) * w["norm.scale"]
        logp = jax.nn.log_softmax(h @ w["lm_head.kernel"])
        return -jnp.take_along_axis(logp, targets[..., None], -1).mean()

    params = {k: jnp.asarray(v, jnp.float32) for k, v in _weights(model).items()}
    grads = nnx.jit(nnx.grad(lambda m, t, y: m.loss(t, y)))(model, tokens, targets)
    flat = {".".join(map(str, k)): np.asarray(v[...])
            for k, v in nnx.to_flat_state(nnx.state(grads, nnx.Param))}
    ref_grads = jax.grad(ref_loss)(params)
    assert set(flat) == set(ref_grads)
    for name in ref_grads:
        assert rel_err(flat[name], f64(ref_grads[name])) < 1e-4, name

    tx = optax.adamw(1e-2)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def step(m, opt, t, y):
        loss, g = nnx.value_and_grad(lambda m: m.loss(t, y))(m)
        opt.update(m, g)
        return loss

    ref_state, ours, theirs = tx.init(params), [], []
    for _ in range(5):
        ours.append(float(step(model, optimizer, tokens, targets)))
        loss, g = jax.value_and_grad(ref_loss)(params)
        updates, ref_state = tx.update(g, ref_state, params)
        params = optax.apply_updates(params, updates)
        theirs.append(float(loss))
    np.testing.assert_allclose(ours, theirs, rtol=2e-5)
    assert ours[-1] < ours[0]


# -- checkpoints, the Hugging Face loader, errors ----------------------------------------

def test_orbax_restore_then_train_on_another_mesh(tmp_path):
    """Parameters and optimizer state saved from a (2, 4) jaxtdist model, restored
    into the XLA twin on a (4, 2) mesh, then a training step works there."""
    ocp = pytest.importorskip("orbax.checkpoint")
    cfg = _cfg(4, 2)
    _mesh((2, 4))
    model = tdnn.Llama(cfg, rngs=nnx.Rngs(4))
    opt = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
    batch = _tokens(np.random.default_rng(5), (4, 9), cfg.vocab)
    step = nnx.jit(lambda m, o, t, y: (lambda loss_grads: (o.update(m, loss_grads[1]),
                                                          loss_grads[0])[1])(
        nnx.value_and_grad(lambda m: m.loss(t, y))(m)))
    step(model, opt, batch[:, :-1], batch[:, 1:])
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "ck", nnx.state((model, opt)))
    ref_next = float(step(model, opt, batch[:, :-1], batch[:, 1:]))

    other = jax.make_mesh((4, 2), ("dp", "tp"))
    theirs = tdnn.Llama(cfg, mesh=other, impl="xla", rngs=nnx.Rngs(9))
    their_opt = nnx.Optimizer(theirs, optax.adamw(1e-2), wrt=nnx.Param)
    target = nnx.state((theirs, their_opt))
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                            target)
    with ocp.StandardCheckpointer() as ckpt:
        nnx.update((theirs, their_opt), ckpt.restore(tmp_path / "ck", abstract))
    tdnn.place_on_mesh((theirs, their_opt), other)
    got = float(step(theirs, their_opt, batch[:, :-1], batch[:, 1:]))
    assert abs(got - ref_next) < 1e-5 * abs(ref_next)


def _write_hf_checkpoint(folder, cfg, rng, **config) -> dict:
    """A one-layer Hugging Face checkpoint of ``cfg`` in ``folder`` (HF names, [out, in]
    weights; Mixtral's block_sparse_moe where cfg.num_experts): its tensors."""
    save_file = pytest.importorskip("safetensors.numpy").save_file
    hd, kv, d, f = cfg.d_model // cfg.num_heads, cfg.num_kv_heads, cfg.d_model, cfg.hidden
    p = "model.layers.0."
    shapes = {"model.embed_tokens.weight": (cfg.vocab, d), "model.norm.weight": (d,),
              "lm_head.weight": (cfg.vocab, d), p + "input_layernorm.weight": (d,),
              p + "post_attention_layernorm.weight": (d,),
              p + "self_attn.q_proj.weight": (cfg.num_heads * hd, d),
              p + "self_attn.k_proj.weight": (kv * hd, d),
              p + "self_attn.v_proj.weight": (kv * hd, d),
              p + "self_attn.o_proj.weight": (d, cfg.num_heads * hd)}
    if cfg.num_experts:
        shapes[p + "block_sparse_moe.gate.weight"] = (cfg.num_experts, d)
        for e in range(cfg.num_experts):
            q = f"{p}block_sparse_moe.experts.{e}."
            shapes.update({q + "w1.weight": (f, d), q + "w3.weight": (f, d),
                           q + "w2.weight": (d, f)})
        config.update(num_local_experts=cfg.num_experts,
                      num_experts_per_tok=cfg.experts_per_token)
    else:
        shapes.update({p + "mlp.gate_proj.weight": (f, d), p + "mlp.up_proj.weight": (f, d),
                       p + "mlp.down_proj.weight": (d, f)})
    tensors = {k: (0.3 * rng.standard_normal(s)).astype(np.float32) for k, s in shapes.items()}
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(dict(
        vocab_size=cfg.vocab, hidden_size=d, num_hidden_layers=1,
        num_attention_heads=cfg.num_heads, num_key_value_heads=kv, intermediate_size=f,
        rope_theta=cfg.rope_theta, rms_norm_eps=cfg.norm_eps, tie_word_embeddings=False,
        **config)))
    return tensors


# Llama 3.1's RoPE scaling with a short trained context: of a 4-wide head's two
# frequencies, one is blended and one slowed (the test below checks the third band).
LLAMA3_SCALING = dict(rope_type="llama3", factor=4.0, low_freq_factor=0.5, high_freq_factor=4.0,
                      original_max_position_embeddings=20)


@pytest.mark.parametrize("rope_scaling", [None, LLAMA3_SCALING])
def test_hf_safetensors_checkpoint_loads(tmp_path, rope_scaling):
    """A tiny Hugging Face Llama checkpoint written here (HF names, [out, in]
    weights), plain or Llama 3.1's scaled RoPE: the loaded model's logits are the
    reference's from those tensors."""
    mesh = _mesh((2, 4))
    cfg = _cfg(8, 2)
    rng = np.random.default_rng(6)
    tensors = _write_hf_checkpoint(tmp_path, cfg, rng, rope_scaling=rope_scaling)
    model = tdnn.load_hf_llama(tmp_path, mesh)
    if rope_scaling is not None:
        scaling = {k: v for k, v in rope_scaling.items() if k != "rope_type"}
        assert model.config.rope_scaling == tdnn.RopeScaling(**scaling)
        cfg = dataclasses.replace(cfg, rope_scaling=model.config.rope_scaling)
    w = {k: f64(v) for k, v in tdnn._hf.hf_to_params(tensors).items()}
    tokens = _tokens(rng, (2, 8), cfg.vocab)
    out = nnx.jit(lambda m, t: m(t))(model, tokens)
    assert rel_err(out, _llama_reference(w, tokens, cfg)) < 1e-5
    try:
        import torch
        import transformers
    except ImportError:
        return
    hf = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path)).eval()
    with torch.no_grad():
        ref = hf(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    assert rel_err(out, f64(ref)) < 1e-4


def test_rope_scaling_matches_llama_3_1_band_by_band():
    """RopeScaling against Meta's branches on frequencies in all three bands (kept,
    blended, slowed), and rope() with it against the reference's rotation; bad
    values are refused."""
    scaling = tdnn.RopeScaling(8.0, 1.0, 4.0, 8192)  # Llama 3.1's
    inv = 1.0 / 500000.0 ** (np.arange(64) / 64)
    want = _llama3_inv_freq(inv, scaling)
    assert (want == inv).any() and (want == inv / 8).any()
    assert ((want != inv) & (want != inv / 8)).any()
    assert rel_err(scaling(jnp.asarray(inv, jnp.float32)), want) < 1e-6
    x = np.random.default_rng(3).standard_normal((1, 5, 2, 128))
    pos = np.array([[0, 1, 7, 300, 1000]])  # float32 angles: far positions lose digits
    assert rel_err(tdnn.rope(jnp.asarray(x, jnp.float32), jnp.asarray(pos), 500000.0, scaling),
                   _rope(x, pos, 500000.0, scaling)) < 1e-4
    with pytest.raises(ValueError, match="low_freq_factor < high_freq_factor"):
        tdnn.RopeScaling(8.0, 4.0, 1.0, 8192)
    with pytest.raises(ValueError, match="rope_scaling=.*RopeScaling"):
        tdnn.ParallelAttention(32, 8, rope_theta=1e4, rope_scaling=dict(factor=8.0),
                               mesh=_mesh((2, 4)), rngs=nnx.Rngs(0))


def test_hf_mixtral_checkpoint_loads_and_trains_like_its_twin(tmp_path):
    """A tiny Hugging Face Mixtral checkpoint (block_sparse_moe: a router, experts'
    w1/w3/w2): the loaded model's logits are the reference's from those tensors; a
    Llama with MoE layers matches its XLA twin's loss (router loss included) and
    gradients, and decodes like its full forward."""
    mesh = _mesh((2, 2))
    cfg = dataclasses.replace(_cfg(4, 2), num_experts=4, experts_per_token=2)
    rng = np.random.default_rng(8)
    tensors = _write_hf_checkpoint(tmp_path, cfg, rng, router_aux_loss_coef=0.02,
                                   output_router_logits=True)
    model = tdnn.load_hf_llama(tmp_path, mesh)
    assert model.config.num_experts == 4 and model.config.router_aux_loss_coef == 0.02
    w = {k: f64(v) for k, v in tdnn._hf.hf_to_params(tensors).items()}
    assert w["layers.0.mlp.gate_proj"].shape == (4, cfg.d_model, cfg.hidden)
    tokens = _tokens(rng, (2, 8), cfg.vocab)
    out = nnx.jit(lambda m, t: m(t))(model, tokens)
    assert rel_err(out, _llama_reference(w, tokens, cfg)) < 1e-5

    cfg = dataclasses.replace(cfg, num_layers=2, router_aux_loss_coef=0.1)
    ours, theirs = tdnn.Llama.twins(cfg, mesh)
    batch = _tokens(rng, (2, 9), cfg.vocab)

    @nnx.jit
    def loss_and_grads(m, t, y):
        return nnx.value_and_grad(lambda m: m.loss(t, y))(m)

    (a, ga), (b, gb) = (loss_and_grads(m, batch[:, :-1], batch[:, 1:]) for m in (ours, theirs))
    assert abs(float(a) - float(b)) < 1e-5 * abs(float(b))
    plain = dataclasses.replace(cfg, router_aux_loss_coef=0.0)
    ours.config, theirs.config = plain, plain
    assert float(a) > float(nnx.jit(lambda m, t, y: m.loss(t, y))(ours, batch[:, :-1],
                                                                   batch[:, 1:]))
    for (path, x), (_, y) in zip(nnx.to_flat_state(nnx.state(ga, nnx.Param)),
                                 nnx.to_flat_state(nnx.state(gb, nnx.Param))):
        assert rel_err(x[...], f64(np.asarray(y[...]))) < 1e-4, path
    # moe_capacity_factor reaches every MoE layer; both twins drop the same picks.
    capped = tdnn.Llama.twins(dataclasses.replace(plain, moe_capacity_factor=0.5), mesh)
    assert all(layer.mlp.capacity_factor == 0.5 for m in capped for layer in m.layers)
    losses = [float(nnx.jit(lambda m, t, y: m.loss(t, y))(m, batch[:, :-1], batch[:, 1:]))
              for m in capped]
    assert abs(losses[0] - losses[1]) < 1e-5 * abs(losses[1])
    ours.init_cache(2, 8)
    full = nnx.jit(lambda m, t: m(t))(theirs, batch[:, :8])
    nnx.jit(lambda m, t: m(t))(ours, batch[:, :6])
    step = nnx.jit(lambda m, t: m(t, decode=True))
    assert rel_err(step(ours, batch[:, 6:7]), f64(np.asarray(full))[:, 6:7]) < 1e-5
    # What Llama does not compute is refused, not loaded.
    config = json.loads((tmp_path / "config.json").read_text())
    for key, value, match in (("sliding_window", 4096, "sliding_window=4096"),
                              ("hidden_act", "gelu", "hidden_act='gelu'")):
        with pytest.raises(ValueError, match=match):
            tdnn._hf.hf_config({**config, key: value})


def test_bad_arguments_name_the_layer_and_the_shapes():
    mesh = _mesh((2, 4))
    with pytest.raises(ValueError, match=r"batch_axes=\('data',\) names 'data', not an axis"):
        tdnn.ParallelMLP(16, 32, batch_axes="data", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="axis_name='model' is not an axis of the mesh"):
        tdnn.RowParallelLinear(16, 16, axis_name="model", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="impl='cuda'"):
        tdnn.ParallelMLP(16, 32, impl="cuda", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="out_features=30 must be divisible by the size 4"):
        tdnn.ColumnParallelLinear(16, 30, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="num_kv_heads=3 must divide over the size 4"):
        tdnn.ParallelAttention(48, 6 * 4 // 2, num_kv_heads=3, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="num_heads=8 must be a multiple of num_kv_heads=3"):
        tdnn.ParallelAttention(32, 8, num_kv_heads=3, rngs=nnx.Rngs(0))
    for kv in (0, -4, 2.0):
        with pytest.raises(ValueError, match=rf"num_kv_heads must be a positive int, got {kv}"):
            tdnn.ParallelAttention(32, 8, num_kv_heads=kv, rngs=nnx.Rngs(0))
    attn = tdnn.ParallelAttention(32, 4, rngs=nnx.Rngs(0))
    assert attn.layout.batch_axes == ("dp",)  # the default: every other mesh axis
    with pytest.raises(ValueError, match="positions must be integers .* got dtype float32"):
        attn(jnp.zeros((2, 8, 32)), positions=jnp.zeros((2, 8), jnp.float32) + 0.5)
    assert attn(jnp.zeros((2, 6, 32))).shape == (2, 6, 32)  # any seq: padded inside
    with pytest.raises(ValueError, match=r"lengths has shape \(3,\) and dtype int32; expected "
                                         r"integers \[batch\] = \[2\]"):
        attn(jnp.zeros((2, 6, 32)), lengths=jnp.ones((3,), jnp.int32))
    with pytest.raises(ValueError, match=r"ParallelAttention: x has shape \(2, 8, 16\); "
                                         r"expected \[batch, seq, 32\]"):
        attn(jnp.zeros((2, 8, 16)))
    mlp = tdnn.ParallelMLP(16, 32, rngs=nnx.Rngs(0))
    for empty in ((0, 4, 16), (2, 0, 16)):
        with pytest.raises(ValueError, match=rf"ParallelMLP: x has shape "
                                             rf"{re.escape(str(empty))}, an empty batch"):
            mlp(jnp.zeros(empty))
    with pytest.raises(ValueError, match=r"jaxtdist\.nn\.ParallelMLP: x has dtype int32; "
                                         r"supported dtypes are bfloat16, float16, float32"):
        mlp(jnp.zeros((2, 4, 16), jnp.int32))
    with pytest.raises(ValueError, match="decode=True needs a KV cache"):
        attn(jnp.zeros((2, 1, 32)), decode=True)
    attn.init_cache(3, 8)  # a batch that does not divide over dp: cached replicated
    assert attn.cached_key[...].sharding.is_equivalent_to(
        NamedSharding(mesh, P(None, None, "tp", None)), 4)
    attn.init_cache(4, 8)
    assert attn.cached_key[...].sharding.is_equivalent_to(
        NamedSharding(mesh, P("dp", None, "tp", None)), 4)
    with pytest.raises(ValueError, match=r"cache is too short: seq=16, the cache holds max_len=8"):
        attn(jnp.zeros((4, 16, 32)))
    with pytest.raises(ValueError, match="x holds 2 sequences, the cache was made for 4"):
        attn(jnp.zeros((2, 1, 32)), decode=True)


def test_layers_on_odd_batches_lists_a_user_shard_map_and_a_new_mesh():
    """A decode batch that does not divide over dp runs replicated (RowParallelLinear
    passed dp as a batch axis: matmul_ar_sharded refused the batch); a prefill of
    any seq is padded inside (was refused); lists are taken as arrays;
    a layer inside a user's shard_map, or after jaxtdist.initialize with another
    mesh, is refused naming why (were JAX's raw errors)."""
    mesh = _mesh((2, 2))
    mlp = tdnn.ParallelMLP(32, 64, rngs=nnx.Rngs(0))
    twin = tdnn.ParallelMLP(32, 64, impl="xla", rngs=nnx.Rngs(0))
    x = np.random.default_rng(0).standard_normal((1, 1, 32)).astype(np.float32)
    decode = nnx.jit(lambda m, x: m(x, decode=True))
    out, ref = decode(mlp, x), decode(twin, x)
    assert out.shape == (1, 1, 32) and rel_err(out, f64(ref)) < 1e-5
    odd = np.random.default_rng(1).standard_normal((1, 6, 32)).astype(np.float32)
    assert rel_err(mlp(odd), f64(twin(odd))) < 1e-5  # padded inside to a multiple of 4
    tokens = np.ones((2, 4, 32), np.float32)
    assert rel_err(mlp(tokens.tolist()), f64(twin(tokens))) < 1e-5
    attn = tdnn.ParallelAttention(32, 4, rngs=nnx.Rngs(0))
    positions = np.broadcast_to(np.arange(4), (2, 4))
    assert attn(tokens, positions=positions.tolist()).shape == (2, 4, 32)
    inside = jax.jit(jax.shard_map(lambda t: mlp(t), mesh=mesh, in_specs=P("dp", "tp", None),
                                   out_specs=P("dp", "tp", None)))
    with pytest.raises(ValueError, match=r"ParallelMLP takes global arrays and shards them "
                                         r"itself: call it under jax.jit or nnx.jit, outside "
                                         r"jax.shard_map"):
        inside(jax.device_put(tokens, NamedSharding(mesh, P("dp", "tp", None))))
    _mesh((1, 4))
    with pytest.raises(ValueError, match=r"ParallelMLP was built on the mesh \{'dp': 2, 'tp': "
                                         r"2\} .* now initialized with \{'dp': 1, 'tp': 4\}"):
        nnx.jit(lambda m, x: m(x))(mlp, tokens)


def test_xla_impl_needs_no_initialize(monkeypatch):
    """impl='xla' runs no jaxtdist kernel: a mesh from jax.set_mesh is enough."""
    from jaxtdist.runtime import _runtime

    monkeypatch.setattr(_runtime, "is_initialized", lambda: False)
    with pytest.raises(ValueError, match="call jaxtdist.initialize"):
        tdnn.ParallelMLP(16, 32, rngs=nnx.Rngs(0))
    mesh = jax.make_mesh((2, 4), ("dp", "tp"))
    with jax.set_mesh(mesh):
        mlp = tdnn.ParallelMLP(16, 32, impl="xla", rngs=nnx.Rngs(0))
    x = np.random.default_rng(7).standard_normal((2, 8, 16)).astype(np.float32)
    w = _weights(mlp)
    assert rel_err(nnx.jit(lambda m, a: m(a))(mlp, x), _mlp(w, "", f64(x))) < 1e-5
