"""jaxtdist.nn's Flax NNX layers on CPU (8 host devices): forward passes against
the same parameters in plain JAX, gradients against jax.grad of that reference,
training steps with optax, decode mode, an axis of size 1, and bad arguments."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

flax = pytest.importorskip("flax", reason="jaxtdist.nn needs flax: pip install -e '.[nn]'")
optax = pytest.importorskip("optax", reason="the training tests need optax: pip install -e '.[nn]'")
from flax import nnx  # noqa: E402

from jaxtdist import nn as tdnn  # noqa: E402
from tests.conftest import f64, place, rand, rel_err, setup  # noqa: E402

TOKENS = P(("dp", "tp"), None)
MESHES = [(2, 2), (2, 4)]


def _sharded(module, mesh):
    """The module with its parameters placed by their sharding metadata."""
    graphdef, state = nnx.split(module)
    shardings = nnx.get_named_sharding(state, mesh)
    return nnx.merge(graphdef, jax.device_put(state, shardings))


def _weights(module) -> dict:
    """Every parameter as float64 numpy, keyed by its path ("up.kernel", ...)."""
    _, state = nnx.split(module)
    return {".".join(str(k) for k in path): f64(np.asarray(v[...]))
            for path, v in nnx.to_flat_state(state)}


def _mlp_reference(w: dict, x, gated: bool, prefix: str = ""):
    def linear(name, h):
        y = h @ w[f"{prefix}{name}.kernel"]
        bias = w.get(f"{prefix}{name}.bias")
        return y if bias is None else y + bias
    gelu = lambda a: f64(jax.nn.gelu(jnp.asarray(a, jnp.float32)))  # noqa: E731
    h = linear("up", x)
    h = gelu(linear("gate", x)) * h if gated else gelu(h)
    return linear("down", h)


@pytest.mark.parametrize("mesh_shape", MESHES)
@pytest.mark.parametrize("gated", [False, True])
def test_mlp_forward_matches_plain_jax(mesh_shape, gated):
    mesh = setup(mesh_shape, ("dp", "tp"))
    mlp = _sharded(tdnn.ParallelMLP(16, 8 * mesh_shape[1], gated=gated, batch_axes=("dp",),
                                    rngs=nnx.Rngs(0)), mesh)
    x = rand((2 * mesh_shape[1] * 3, 16))
    y = nnx.jit(lambda m, a: m(a))(mlp, place(mesh, x, TOKENS))
    assert y.sharding.is_equivalent_to(NamedSharding(mesh, TOKENS), 2)  # sequence parallel
    assert rel_err(y, _mlp_reference(_weights(mlp), f64(x), gated)) < 1e-5


@pytest.mark.parametrize("mesh_shape", MESHES)
def test_mlp_decode_matches_plain_jax(mesh_shape):
    """decode=True: tokens on every tp rank, local GEMMs up, matmul_ar down."""
    mesh = setup(mesh_shape, ("dp", "tp"))
    mlp = _sharded(tdnn.ParallelMLP(16, 8 * mesh_shape[1], gated=True, batch_axes=("dp",),
                                    rngs=nnx.Rngs(1)), mesh)
    x = rand((2 * 3, 16))  # 3 sequences per dp group, one new token each
    y = nnx.jit(lambda m, a: m(a, decode=True))(mlp, place(mesh, x, P("dp", None)))
    assert rel_err(y, _mlp_reference(_weights(mlp), f64(x), True)) < 1e-5


def _attention_reference(w: dict, x, batch, seq, heads):
    q, k, v = (x @ w[f"{n}.kernel"] for n in ("query", "key", "value"))
    shape = (batch, seq, heads, x.shape[1] // heads)
    o = jax.nn.dot_product_attention(*(jnp.asarray(a.reshape(shape), jnp.float32)
                                       for a in (q, k, v)), is_causal=True)
    return f64(o).reshape(batch * seq, -1) @ w["out.kernel"]


@pytest.mark.parametrize("mesh_shape", MESHES)
def test_attention_forward_matches_plain_jax(mesh_shape):
    mesh = setup(mesh_shape, ("dp", "tp"))
    tp = mesh_shape[1]
    heads, seq, batch = 2 * tp, 2 * tp, 4
    attn = _sharded(tdnn.ParallelAttention(8 * heads, heads, batch_axes=("dp",),
                                           rngs=nnx.Rngs(2)), mesh)
    x = rand((batch * seq, 8 * heads))
    y = nnx.jit(lambda m, a: m(a, seq_len=seq))(attn, place(mesh, x, TOKENS))
    assert rel_err(y, _attention_reference(_weights(attn), f64(x), batch, seq, heads)) < 1e-5


def test_gradients_match_jax_grad_of_the_reference():
    mesh = setup((2, 4), ("dp", "tp"))
    mlp = _sharded(tdnn.ParallelMLP(16, 32, gated=True, batch_axes=("dp",),
                                    rngs=nnx.Rngs(3)), mesh)
    x = rand((2 * 4 * 2, 16))
    xs = place(mesh, x, TOKENS)

    grads = nnx.jit(nnx.grad(lambda m, a: jnp.sum(jnp.sin(m(a)))))(mlp, xs)
    flat = {".".join(str(k) for k in path): np.asarray(v[...])
            for path, v in nnx.to_flat_state(grads)}
    weights = {k: jnp.asarray(v, jnp.float32) for k, v in _weights(mlp).items()}

    def loss(w):
        def linear(name, h):
            return h @ w[f"{name}.kernel"] + w[f"{name}.bias"]
        h = jax.nn.gelu(linear("gate", jnp.asarray(x))) * linear("up", jnp.asarray(x))
        return jnp.sum(jnp.sin(linear("down", h)))

    ref = jax.grad(loss)(weights)
    assert set(flat) == set(ref)
    for name in ref:
        assert rel_err(flat[name], f64(ref[name])) < 1e-4, name


def test_training_steps_match_the_reference():
    """Five optax SGD steps of a sequence-parallel MLP: the same loss curve as the
    model in plain JAX from the same parameters."""
    mesh = setup((2, 4), ("dp", "tp"))
    mlp = _sharded(tdnn.ParallelMLP(16, 32, batch_axes=("dp",), rngs=nnx.Rngs(4)), mesh)
    x, target = rand((16, 16)), rand((16, 16))
    xs, ts = place(mesh, x, TOKENS), place(mesh, target, TOKENS)
    optimizer = nnx.Optimizer(mlp, optax.sgd(0.05), wrt=nnx.Param)

    @nnx.jit
    def step(model, opt, a, t):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(a) - t) ** 2))(model)
        opt.update(model, grads)
        return loss

    weights = {k: jnp.asarray(v, jnp.float32) for k, v in _weights(mlp).items()}

    def ref_loss(w):
        def linear(name, h):
            return h @ w[f"{name}.kernel"] + w[f"{name}.bias"]
        y = linear("down", jax.nn.gelu(linear("up", jnp.asarray(x))))
        return jnp.mean((y - jnp.asarray(target)) ** 2)

    ref_opt = optax.sgd(0.05)
    ref_state = ref_opt.init(weights)
    ours, theirs = [], []
    for _ in range(5):
        ours.append(float(step(mlp, optimizer, xs, ts)))
        loss, g = jax.value_and_grad(ref_loss)(weights)
        updates, ref_state = ref_opt.update(g, ref_state)
        weights = optax.apply_updates(weights, updates)
        theirs.append(float(loss))
    np.testing.assert_allclose(ours, theirs, rtol=1e-5)
    assert ours[-1] < ours[0]


def test_axis_of_size_one_is_the_local_computation():
    mesh = setup((8, 1), ("dp", "tp"))
    mlp = _sharded(tdnn.ParallelMLP(16, 32, gated=True, batch_axes=("dp",),
                                    rngs=nnx.Rngs(5)), mesh)
    x = rand((16, 16))
    y = nnx.jit(lambda m, a: m(a))(mlp, place(mesh, x, TOKENS))
    assert rel_err(y, _mlp_reference(_weights(mlp), f64(x), True)) < 1e-5
    # Decode: matmul_ar at world 1 is typed replicated over "tp", as psum types it.
    y = nnx.jit(lambda m, a: m(a, decode=True))(mlp, place(mesh, x, P("dp", None)))
    assert rel_err(y, _mlp_reference(_weights(mlp), f64(x), True)) < 1e-5


def test_bad_arguments_say_what_is_allowed():
    setup((2, 4), ("dp", "tp"))
    with pytest.raises(ValueError, match="out_features=30 must be divisible by the size 4"):
        tdnn.ColumnParallelLinear(16, 30, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="'model' is not an axis of the mesh"):
        tdnn.RowParallelLinear(16, 16, axis_name="model", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="reduce='sum'"):
        tdnn.RowParallelLinear(16, 16, reduce="sum", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="num_heads=6 must be divisible"):
        tdnn.ParallelAttention(24, 6, rngs=nnx.Rngs(0))
    attn = tdnn.ParallelAttention(32, 4, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="whole sequences of seq_len=5"):
        attn(jnp.zeros((8, 32)), seq_len=5)


def test_parameters_are_created_sharded():
    """Weights live sharded from creation (no gather onto one device first)."""
    mesh = setup((2, 4), ("dp", "tp"))
    mlp = tdnn.ParallelMLP(16, 32, gated=True, rngs=nnx.Rngs(6))
    expect = {"up.kernel": P(None, "tp"), "up.bias": P("tp"), "gate.kernel": P(None, "tp"),
              "down.kernel": P("tp", None), "down.bias": P(None)}
    for name, spec in expect.items():
        layer, param = name.split(".")
        value = getattr(getattr(mlp, layer), param)[...]
        assert value.sharding.is_equivalent_to(NamedSharding(mesh, spec), value.ndim), name


def test_explicit_mesh_axes():
    """``jax.make_mesh``'s default axis types (explicit sharding in the types):
    the layers give their reshapes' shardings and match the reference, decode
    steps with the KV cache included."""
    import jaxtdist
    from tests.conftest import DEFAULT_HEAP_BYTES, DEFAULT_WAIT_TIMEOUT_S

    mesh = jax.make_mesh((2, 4), ("dp", "tp"))
    jaxtdist.initialize(mesh, heap_bytes=DEFAULT_HEAP_BYTES["cpu"],
                        wait_timeout_s=DEFAULT_WAIT_TIMEOUT_S)
    heads, seq, batch = 8, 8, 4
    attn = tdnn.ParallelAttention(8 * heads, heads, batch_axes=("dp",), rngs=nnx.Rngs(7))
    mlp = tdnn.ParallelMLP(8 * heads, 32, gated=True, batch_axes=("dp",), rngs=nnx.Rngs(8))
    x = rand((batch * seq, 8 * heads))
    xs = place(mesh, x, TOKENS)
    y = nnx.jit(lambda m, a: m(a, seq_len=seq))(attn, xs)
    assert rel_err(y, _attention_reference(_weights(attn), f64(x), batch, seq, heads)) < 1e-5
    z = nnx.jit(lambda m, a: m(a))(mlp, xs)
    assert rel_err(z, _mlp_reference(_weights(mlp), f64(x), True)) < 1e-5
    # The KV cache too: prefill of 6 tokens, then 2 decode steps (tokens replicated over tp).
    attn.init_cache(batch, seq)
    prompt = x.reshape(batch, seq, -1)
    nnx.jit(lambda m, a: m(a, seq_len=6))(attn, place(mesh, prompt[:, :6].reshape(-1, 8 * heads),
                                                      TOKENS))
    step = nnx.jit(lambda m, a: m(a, decode=True))
    y = np.asarray(y).reshape(batch, seq, -1)
    for t in (6, 7):
        y1 = step(attn, place(mesh, prompt[:, t], P("dp", None)))
        assert rel_err(y1, f64(y[:, t])) < 1e-5, t


def test_train_gpt_example_matches_the_xla_model():
    """examples/train_gpt.py at its tiny size: the jaxtdist GPT and the same GPT on
    XLA's collectives (impl="xla"), same parameters and batches: the same losses."""
    import argparse
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parent.parent / "examples" / "train_gpt.py"
    spec = importlib.util.spec_from_file_location("train_gpt_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    args = argparse.Namespace(vocab=64, d=32, heads=4, layers=2, seq=8, batch=4, steps=3,
                              lr=3e-3, tp=4)
    curves = example.train(args)["curves"]
    np.testing.assert_allclose(curves["jaxtdist"], curves["xla"], rtol=1e-5)


def test_orbax_checkpoint_moves_between_jaxtdist_and_xla_models(tmp_path):
    """A checkpoint of a jaxtdist model restores into the same model on XLA's
    collectives (and back): parameters are plain sharded arrays."""
    ocp = pytest.importorskip("orbax.checkpoint", reason="checkpoints need orbax-checkpoint: "
                                  "pip install -e '.[nn]'")
    mesh = setup((2, 4), ("dp", "tp"))
    ours = tdnn.ParallelMLP(16, 32, gated=True, batch_axes=("dp",), rngs=nnx.Rngs(9))
    theirs = tdnn.ParallelMLP(16, 32, gated=True, batch_axes=("dp",), impl="xla",
                              rngs=nnx.Rngs(10))
    x = place(mesh, rand((16, 16)), TOKENS)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "ours", nnx.state(ours))
    with ocp.StandardCheckpointer() as ckpt:
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, nnx.state(theirs))
        nnx.update(theirs, ckpt.restore(tmp_path / "ours", abstract))
    y_ours = nnx.jit(lambda m, a: m(a))(ours, x)
    y_theirs = nnx.jit(lambda m, a: m(a))(theirs, x)
    assert rel_err(y_theirs, f64(y_ours)) < 1e-6
    back = tdnn.ParallelMLP(16, 32, gated=True, batch_axes=("dp",), rngs=nnx.Rngs(11))
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "theirs", nnx.state(theirs))
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, nnx.state(back))
        nnx.update(back, ckpt.restore(tmp_path / "theirs", abstract))
    assert rel_err(nnx.jit(lambda m, a: m(a))(back, x), f64(y_ours)) < 1e-6


def _example(name: str):
    """A module of examples/ (loaded from its file; examples/ is not a package)."""
    import importlib.util
    import pathlib

    folder = pathlib.Path(__file__).parent.parent / "examples"
    spec = importlib.util.spec_from_file_location(f"{name}_example", folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("impl", ["jaxtdist", "xla"])
def test_kv_cache_decode_matches_full_recomputation(impl):
    """The GPT of the examples: prefill of 4 tokens then 4 decode steps with the KV
    cache give the logits of one forward pass over all 8 tokens without a cache."""
    mesh = setup((2, 4), ("dp", "tp"))
    vocab, batch, prompt, total = 64, 4, 4, 8
    model = _sharded(tdnn.GPT(vocab, 32, 4, 2, impl, nnx.Rngs(12)), mesh)
    tokens = np.random.default_rng(3).integers(0, vocab, (batch, total)).astype(np.int32)
    seq_parallel = NamedSharding(mesh, P(("dp", "tp")))
    full = nnx.jit(lambda m, t: m(t, total))(model, jax.device_put(tokens.reshape(-1),
                                                                   seq_parallel))
    full = f64(np.asarray(full)).reshape(batch, total, vocab)

    model.init_cache(batch, total)
    logits = nnx.jit(lambda m, t: m(t, prompt))(
        model, jax.device_put(tokens[:, :prompt].reshape(-1), seq_parallel))
    assert rel_err(np.asarray(logits).reshape(batch, prompt, vocab), full[:, :prompt]) < 1e-5
    step = nnx.jit(lambda m, t: m(t, decode=True))
    for t in range(prompt, total):
        logits = step(model, jax.device_put(tokens[:, t], NamedSharding(mesh, P("dp"))))
        assert logits.shape == (batch, vocab)
        assert rel_err(logits, full[:, t]) < 1e-5, t
    assert int(model.blocks[0].attn.cache_index[...]) == total


def test_kv_cache_misuse_says_what_is_allowed():
    mesh = setup((2, 4), ("dp", "tp"))
    attn = _sharded(tdnn.ParallelAttention(32, 4, batch_axes=("dp",), impl="xla",
                                           rngs=nnx.Rngs(13)), mesh)
    with pytest.raises(ValueError, match="needs a KV cache; call init_cache"):
        attn(jnp.zeros((4, 32)), decode=True)
    with pytest.raises(ValueError, match="seq_len is required"):
        attn(jnp.zeros((4, 32)))
    with pytest.raises(ValueError, match="batch=3 must be divisible by the 2 groups"):
        attn.init_cache(3, 8)
    attn.init_cache(4, 8)
    assert attn.cached_key[...].sharding.is_equivalent_to(
        NamedSharding(mesh, P("dp", None, "tp", None)), 4)
    with pytest.raises(ValueError, match=r"cache is too short: seq_len=16, the cache holds "
                                         r"max_len=8 positions; call init_cache\(batch, "
                                         r"max_len=16\)"):
        attn(jnp.zeros((4 * 16, 32)), seq_len=16)
    with pytest.raises(ValueError, match="x holds 2 sequences, the cache was made for 4"):
        attn(jnp.zeros((2, 32)), decode=True)
    with pytest.raises(ValueError, match="not seq_len=1"):
        attn(jnp.zeros((4, 32)), seq_len=1, decode=True)
    # A full cache (the position is traced: no exception inside jit): NaN, never wrong numbers.
    nnx.jit(lambda m, a: m(a, seq_len=8))(attn, place(mesh, rand((4 * 8, 32)), TOKENS))
    y = nnx.jit(lambda m, a: m(a, decode=True))(attn, place(mesh, rand((4, 32)), P("dp", None)))
    assert np.isnan(np.asarray(y)).all()


def test_generate_example_decodes_the_same_tokens_with_both_impls():
    """examples/generate.py at its tiny size: greedy decoding with the KV cache on the
    jaxtdist GPT and on the XLA one, same parameters: identical tokens."""
    import argparse

    example = _example("generate")
    args = argparse.Namespace(vocab=64, d=32, heads=4, layers=2, seq=16, batch=4, lr=1e-2,
                              prompt_len=8, tokens=6, train_steps=20, tp=4)
    result = example.generate(args)
    ours, theirs = result["tokens"]["jaxtdist"], result["tokens"]["xla"]
    assert ours.shape == (4, 6)
    np.testing.assert_array_equal(ours, theirs)
