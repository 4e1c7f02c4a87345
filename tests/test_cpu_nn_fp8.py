"""FP8 in jaxtdist.nn on CPU (8 host devices): the blockwise inference recipe's
layers against a float64 reference of their dequantized weights and quantized
activations, the per-tensor training recipe's GEMM and gradients, a Hugging
Face FP8 checkpoint (float8_e4m3fn ``weight`` + ``weight_scale_inv``, written
here with safetensors) through ``load_hf_llama``, bad input, and a few steps of
examples/fp8_train.py (its 200-step run is the issue's loss comparison)."""

from __future__ import annotations

import importlib.util
import json
import pathlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

pytest.importorskip("flax")
pytest.importorskip("optax")
from flax import nnx  # noqa: E402

import jaxtdist as td  # noqa: E402
from jaxtdist import nn as tdnn  # noqa: E402
from jaxtdist.nn._fp8 import tensor_scaled_matmul  # noqa: E402
from tests.conftest import dp_tp_mesh, f64, rel_err  # noqa: E402
from tests.test_cpu_nn import _llama_reference  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
E4M3 = ml_dtypes.float8_e4m3fn


# -- a float64 reference of the blockwise recipe ---------------------------------------

def _fake_quant_rows(x: np.ndarray) -> np.ndarray:
    """x quantized to e4m3 per (row, 128 columns) with amax / 448 scales, dequantized
    (float64): what the blockwise layers feed their GEMMs."""
    *lead, k = x.shape
    blocks = x.reshape(*lead, k // 128, 128)
    amax = np.abs(blocks).max(-1, keepdims=True)
    scale = np.where(amax > 0, amax / 448.0, 1.0)
    q = np.clip(blocks / scale, -448, 448).astype(E4M3).astype(np.float64)
    return (q * scale).reshape(x.shape)


def _dequantized(weight, scale) -> np.ndarray:
    """The [K, N] float64 kernel of a K-major FP8 weight [N, K] and its block scales."""
    w = np.asarray(weight).astype(np.float64)
    s = np.repeat(np.repeat(np.asarray(scale, np.float64), 128, 0), 128, 1)
    return (w * s[:w.shape[0], :w.shape[1]]).T


class _Fp8Kernel:
    """A reference kernel that quantizes what it multiplies: ``x @ kernel`` is
    ``_fake_quant_rows(x) @ dequantized``, so the float64 references of
    tests/test_cpu_nn.py compute the blockwise recipe unchanged."""

    __array_ufunc__ = None  # numpy defers ``x @ self`` to __rmatmul__

    def __init__(self, kernel: np.ndarray):
        self.kernel = kernel

    def __rmatmul__(self, x):
        return _fake_quant_rows(x) @ self.kernel


# -- the blockwise (inference) recipe --------------------------------------------------

@pytest.mark.parametrize("impl", ["jaxtdist", "xla"])
def test_blockwise_linears_match_the_dequantized_reference(impl):
    """Column (ag_matmul's FP8 path over tp 2, one gather for two weights) and row
    (matmul_rs; decode: matmul_ar) layers on FP8 weights stored K-major with
    128 x 128 scales, against float64 products of the dequantized weights and the
    quantized activations."""
    mesh = dp_tp_mesh((2, 2))
    common = dict(mesh=mesh, impl=impl, fp8=tdnn.Fp8Recipe("blockwise"), rngs=nnx.Rngs(0))
    gate = tdnn.ColumnParallelLinear(128, 256, **common)
    up = tdnn.ColumnParallelLinear(128, 256, **common)
    down = tdnn.RowParallelLinear(256, 128, **common)
    assert gate.weight.dtype == jnp.float8_e4m3fn and gate.weight.shape == (256, 128)
    assert gate.weight_scale_inv.shape == (2, 1) and down.weight_scale_inv.shape == (1, 2)
    assert not hasattr(gate, "kernel")  # never a 16/32-bit copy
    assert {".".join(map(str, k)) for k, _ in nnx.to_flat_state(nnx.state(gate, nnx.Param))
            } == {"bias"}
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 16, 128)).astype(np.float32)
    h1 = rng.standard_normal((2, 1, 256)).astype(np.float32)

    @nnx.jit
    def run(gate, up, down, x, h1):
        tokens = gate.layout.to_tokens(jnp.asarray(x), False)
        g, u = tdnn._linear.column_parallel((gate, up), tokens)
        return g, u, down(gate(x)), down(h1, decode=True), gate(x)

    g, u, y, y1, gx = run(gate, up, down, x, h1)
    deq = {n: _dequantized(m.weight[...], m.weight_scale_inv[...])
           for n, m in (("gate", gate), ("up", up), ("down", down))}
    xq = _fake_quant_rows(f64(x))
    assert rel_err(gx, xq @ deq["gate"]) < 1e-5
    ref_g = xq.reshape(-1, 128) @ deq["gate"]
    assert rel_err(np.sort(f64(g), 0), np.sort(ref_g, 0)) < 1e-5  # tokens' layout order
    assert rel_err(np.sort(f64(u), 0), np.sort(xq.reshape(-1, 128) @ deq["up"], 0)) < 1e-5
    # The row layer's input is the column layer's output, quantized the same way.
    assert rel_err(y, _fake_quant_rows(f64(gx)) @ deq["down"]) < 1e-5
    assert rel_err(y1, _fake_quant_rows(f64(h1)) @ deq["down"]) < 1e-5


# -- the per-tensor (training) recipe --------------------------------------------------

def _quant_tensor(a: np.ndarray, dtype, fmax: float):
    """(float64 dequantized, scale) of per-tensor current scaling."""
    scale = np.abs(a).max() / fmax
    return np.clip(a / scale, -fmax, fmax).astype(dtype).astype(np.float64) * scale, scale


def test_tensor_scaled_matmul_runs_fp8_gemms_forward_and_backward():
    """Forward: e4m3(x) @ e4m3(w); backward: dx = e5m2(dy) @ e4m3(w).T and
    dw = e4m3(x).T @ e5m2(dy), each exact against float64 of the quantized operands."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((32, 48)).astype(np.float32)
    w = (0.1 * rng.standard_normal((48, 24))).astype(np.float32)
    dy = rng.standard_normal((32, 24)).astype(np.float32)
    y, vjp = jax.vjp(tensor_scaled_matmul, jnp.asarray(x), jnp.asarray(w))
    dx, dw = vjp(jnp.asarray(dy))
    xq, _ = _quant_tensor(f64(x), E4M3, 448.0)
    wq, _ = _quant_tensor(f64(w), E4M3, 448.0)
    dyq, _ = _quant_tensor(f64(dy), ml_dtypes.float8_e5m2, 57344.0)
    assert rel_err(y, xq @ wq) < 1e-6
    assert rel_err(dx, dyq @ wq.T) < 1e-6 and rel_err(dw, xq.T @ dyq) < 1e-6
    assert dx.dtype == jnp.float32 and dw.dtype == jnp.float32


def test_tensor_recipe_gradients_are_close_to_the_float32_layers():
    """The training recipe's MLP (tp 2, dp 2) against the same MLP with fp8=None: same
    parameters; outputs and every gradient within the FP8 rounding's reach.

    The bounds: round-to-nearest with 3 mantissa bits (e4m3) leaves a relative
    error uniform within half an ulp, 2^-4 to 2^-5 of the value across a binade:
    about 2.7% rms. One GEMM of two quantized operands is off by about
    sqrt(2) x 2.7% = 3.8% (norm); SwiGLU's silu(gate) * up about 5.4%; the down
    projection adds its own 3.8%: 6.6% expected for the output (measured 6.4%),
    bound 0.10. Gradients carry e5m2 (2 mantissa bits, about 5.4% rms) on top
    of the forward's e4m3 operands through both GEMM levels: about 9% expected
    (measured 8.6-9.3%), bound 0.15. A wrong transpose, scale or layout gives
    O(1); float32 against bfloat16 would differ by 0.3%."""
    mesh = dp_tp_mesh((2, 2))
    ours = tdnn.ParallelMLP(64, 128, mesh=mesh, impl="xla", fp8=tdnn.Fp8Recipe("tensor"),
                            rngs=nnx.Rngs(0))
    ref = tdnn.ParallelMLP(64, 128, mesh=mesh, impl="xla", rngs=nnx.Rngs(0))
    x = jnp.asarray(np.random.default_rng(2).standard_normal((2, 16, 64)).astype(np.float32))

    @nnx.jit
    def grads(m, x):
        return nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(m), m(x)

    (loss, g), y = grads(ours, x)
    (loss_ref, g_ref), y_ref = grads(ref, x)
    assert rel_err(y, f64(y_ref)) < 0.10
    errs = {".".join(map(str, k)): rel_err(v[...], f64(g_ref_v[...]))
            for (k, v), (_, g_ref_v) in zip(nnx.to_flat_state(g), nnx.to_flat_state(g_ref))}
    assert set(errs) == {"gate_proj.kernel", "up_proj.kernel", "down_proj.kernel"}
    assert max(errs.values()) < 0.15, errs
    assert abs(float(loss) - float(loss_ref)) / float(loss_ref) < 0.1


def test_fp8_train_example_runs_and_tracks_float32():
    """examples/fp8_train.py's training loop, a few steps (200 by hand: the issue's
    2% comparison; see docs/fp8.md for the numbers)."""
    spec = importlib.util.spec_from_file_location("fp8_train", ROOT / "examples" / "fp8_train.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    mesh = dp_tp_mesh((2, 2))
    batches, held_out = example.markov_batches(np.random.default_rng(0), 6,
                                               example.CONFIG.vocab)
    ref, ref_final = example.train(None, mesh, "xla", batches, held_out, 3e-3)
    fp8, fp8_final = example.train(tdnn.Fp8Recipe("tensor"), mesh, "xla", batches, held_out,
                                   3e-3)
    assert fp8[-1] < fp8[0] and ref[-1] < ref[0]
    assert abs(fp8_final - ref_final) / ref_final < 0.02


# -- Hugging Face FP8 checkpoints ------------------------------------------------------

def _quantize_hf(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A float [out, in] weight in the checkpoints' format: float8_e4m3fn and float32
    ``weight_scale_inv`` per 128 x 128 block (amax / 448)."""
    n, k = w.shape
    bn, bk = -(-n // 128), -(-k // 128)
    pad = np.zeros((bn * 128, bk * 128), np.float32)
    pad[:n, :k] = w
    amax = np.abs(pad.reshape(bn, 128, bk, 128)).max((1, 3))
    scale = np.where(amax > 0, amax / 448.0, 1.0).astype(np.float32)
    full = np.repeat(np.repeat(scale, 128, 0), 128, 1)[:n, :k]
    return np.clip(w / full, -448, 448).astype(E4M3), scale


def _write_fp8_checkpoint(folder: pathlib.Path, rng) -> tuple[dict, dict, tdnn.LlamaConfig]:
    """A tiny Qwen3 FP8 checkpoint (config.json with quantization_config, every
    projection FP8 with its scales, embeddings, norms and head float32), and the
    float64 parameters its dequantized weights mean: (plain reference weights,
    weights whose projections quantize their inputs, LlamaConfig)."""
    save_file = pytest.importorskip("safetensors.numpy").save_file
    d, hd, heads, f, vocab = 128, 128, 2, 256, 64
    config = dict(model_type="qwen3", vocab_size=vocab, hidden_size=d, num_hidden_layers=1,
                  num_attention_heads=heads, num_key_value_heads=heads, head_dim=hd,
                  intermediate_size=f, hidden_act="silu", rope_theta=1e6, rms_norm_eps=1e-6,
                  tie_word_embeddings=False, attention_bias=False, use_sliding_window=False,
                  quantization_config=dict(quant_method="fp8", activation_scheme="dynamic",
                                           weight_block_size=[128, 128]))
    hf, plain, fp8 = {}, {}, {}

    def put(name, ours, shape, offset=0.0, scale=0.3):
        value = (offset + scale * rng.standard_normal(shape)).astype(np.float32)
        hf[name] = value
        plain[ours] = fp8[ours] = f64(value)

    def put_fp8(name, ours, shape):
        q, s = _quantize_hf((0.08 * rng.standard_normal(shape)).astype(np.float32))
        hf[name], hf[name + "_scale_inv"] = q, s
        kernel = _dequantized(q, s)
        plain[ours], fp8[ours] = kernel, _Fp8Kernel(kernel)

    put("model.embed_tokens.weight", "embed_tokens.embedding", (vocab, d))
    put("model.norm.weight", "norm.scale", (d,), 1.0, 0.1)
    plain["lm_head.kernel"] = fp8["lm_head.kernel"] = f64(
        (0.3 * rng.standard_normal((d, vocab))).astype(np.float32))
    # Contiguous: safetensors writes an array's buffer as it lies (a transposed view wrongly).
    hf["lm_head.weight"] = np.ascontiguousarray(plain["lm_head.kernel"].T, np.float32)
    hp, p = "model.layers.0.", "layers.0."
    for norm in ("input_layernorm", "post_attention_layernorm"):
        put(f"{hp}{norm}.weight", f"{p}{norm}.scale", (d,), 1.0, 0.1)
    for name in ("q_norm", "k_norm"):
        put(f"{hp}self_attn.{name}.weight", f"{p}self_attn.{name}.scale", (hd,), 1.0, 0.1)
    for name, shape in (("q", (heads * hd, d)), ("k", (heads * hd, d)), ("v", (heads * hd, d)),
                        ("o", (d, heads * hd))):
        put_fp8(f"{hp}self_attn.{name}_proj.weight", f"{p}self_attn.{name}_proj.kernel", shape)
    for name, shape in (("gate", (f, d)), ("up", (f, d)), ("down", (d, f))):
        put_fp8(f"{hp}mlp.{name}_proj.weight", f"{p}mlp.{name}_proj.kernel", shape)
    save_file(hf, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))
    cfg = tdnn.LlamaConfig(vocab=vocab, d_model=d, num_layers=1, num_heads=heads,
                           num_kv_heads=heads, hidden=f, head_dim=hd, rope_theta=1e6,
                           norm_eps=1e-6, qk_norm=True)
    return plain, fp8, cfg


def test_fp8_checkpoint_loads_as_fp8_weights_and_matches_the_reference(tmp_path):
    """Built with the blockwise recipe, the checkpoint's FP8 bytes and scales become
    the layers' ``weight`` / ``weight_scale_inv`` unchanged (no dequantization) and
    the logits match float64 of the dequantized weights with the activations
    quantized where the layers quantize them; built without, the weights are
    dequantized (a warning says so) and the logits match the plain reference."""
    mesh = dp_tp_mesh((1, 2))
    rng = np.random.default_rng(3)
    plain, fp8_ref, cfg = _write_fp8_checkpoint(tmp_path, rng)
    tokens = rng.integers(0, cfg.vocab, (2, 8)).astype(np.int32)
    forward = nnx.jit(lambda m, t: m(t))
    model = tdnn.load_hf_llama(tmp_path, mesh, fp8=tdnn.Fp8Recipe("blockwise"))
    q_proj = model.layers[0].self_attn.q_proj
    saved = td.nn._hf.read_safetensors(tmp_path / "model.safetensors")
    name = "model.layers.0.self_attn.q_proj.weight"
    assert q_proj.weight.dtype == jnp.float8_e4m3fn
    np.testing.assert_array_equal(np.asarray(q_proj.weight[...]).view(np.uint8),
                                  saved[name].view(np.uint8))
    np.testing.assert_array_equal(np.asarray(q_proj.weight_scale_inv[...]),
                                  saved[name + "_scale_inv"])
    assert rel_err(forward(model, tokens), _llama_reference(fp8_ref, tokens, cfg)) < 1e-5
    with pytest.warns(UserWarning, match=r"7 FP8 weights dequantized .* "
                                         r"fp8=jaxtdist.nn.Fp8Recipe\('blockwise'\)"):
        dense = tdnn.load_hf_llama(tmp_path, mesh, impl="xla")
    assert dense.layers[0].mlp.up_proj.kernel.dtype == jnp.float32
    assert rel_err(forward(dense, tokens), _llama_reference(plain, tokens, cfg)) < 1e-5


def test_bad_fp8_checkpoints_and_recipes_are_refused(tmp_path):
    split = tdnn._hf._split_fp8
    q, s = _quantize_hf(np.ones((256, 128), np.float32))
    w = "model.layers.0.mlp.up_proj.weight"
    with pytest.raises(ValueError, match=r"float8_e4m3fn \[256, 128\] without "
                                         r"'model.layers.0.mlp.up_proj.weight_scale_inv'"):
        split({w: q}, set())
    with pytest.raises(ValueError, match=r"weight_scale_inv' is float32\[2, 2\]; the weight "
                                         r"\[256, 128\] \[out, in\] needs float32\[2, 1\]"):
        split({w: q, w + "_scale_inv": np.ones((2, 2), np.float32)}, set())
    with pytest.raises(ValueError, match=r"has no float8_e4m3fn .* beside it"):
        split({w: np.ones((256, 128), np.float32), w + "_scale_inv": s}, set())
    with pytest.raises(ValueError, match=r"static activation scale"):
        split({w: q, w + "_scale_inv": s, "model.layers.0.mlp.up_proj.input_scale": s}, set())
    with pytest.raises(ValueError, match=r"weight_block_size \[128, 128\]"):
        tdnn._hf._check_quantization({"quantization_config": {
            "quant_method": "fp8", "weight_block_size": [64, 64]}})
    # A missing scale, end to end through the loader.
    plain, _, _ = _write_fp8_checkpoint(tmp_path, np.random.default_rng(4))
    tensors = td.nn._hf.read_safetensors(tmp_path / "model.safetensors")
    tensors.pop("model.layers.0.self_attn.o_proj.weight_scale_inv")
    pytest.importorskip("safetensors.numpy").save_file(tensors,
                                                       str(tmp_path / "model.safetensors"))
    mesh = dp_tp_mesh((1, 2))
    with pytest.raises(ValueError, match=r"o_proj.weight' is float8_e4m3fn .* without"):
        tdnn.load_hf_llama(tmp_path, mesh, impl="xla", fp8="blockwise")
    # Recipes on layers that cannot take them: what, what is allowed, the fix.
    with pytest.raises(ValueError, match=r"in_features=96 \(the GEMM's K\) a multiple of 128"):
        tdnn.ColumnParallelLinear(96, 256, mesh=mesh, impl="xla", fp8="blockwise",
                                  rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"out_features=128 over the 2 ranks .* 64 each, not "
                                         r"a multiple of 128"):
        tdnn.ColumnParallelLinear(128, 128, mesh=mesh, impl="xla", fp8="blockwise",
                                  rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"replicated columns .* not supported"):
        tdnn.ParallelAttention(128, 2, num_kv_heads=1, head_dim=128, mesh=mesh, impl="xla",
                               fp8="blockwise", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"fp8=3; give None \(no FP8\), a jaxtdist.nn.Fp8Recipe"):
        tdnn.ParallelMLP(128, 256, mesh=mesh, impl="xla", fp8=3, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"kind='e4m3'; allowed: 'blockwise' .* or 'tensor'"):
        tdnn.Fp8Recipe("e4m3")
    # The training recipe takes any width (one scale per tensor).
    tdnn.ColumnParallelLinear(96, 64, mesh=mesh, impl="xla", fp8="tensor", rngs=nnx.Rngs(0))
