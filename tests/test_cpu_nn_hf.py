"""Hugging Face Qwen3 and Qwen3-MoE checkpoints through ``jaxtdist.nn.load_hf_llama`` on
CPU (8 host devices): tiny random checkpoints written here as safetensors (HF names,
[out, in] weights), loaded on a dp x tp mesh, their logits (prefill, then decode
steps through the KV cache, both impls) against the float64 numpy reference of
tests/test_cpu_nn.py; the configs the loader maps and those it refuses."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("flax")
from flax import nnx  # noqa: E402

from jaxtdist import nn as tdnn  # noqa: E402
from tests.conftest import dp_tp_mesh, f64, rel_err  # noqa: E402
from tests.test_cpu_nn import _llama_reference  # noqa: E402

QWEN3_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                 norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[0],
                 router_aux_loss_coef=0.001, output_router_logits=False)


def _hf_config(model_type: str, tie: bool) -> dict:
    """A tiny config.json: head_dim 16, not hidden_size / heads = 8 (as Qwen3's);
    Qwen3-MoE's layer 0 dense (mlp_only_layers), layer 1 sparse."""
    config = dict(model_type=model_type, vocab_size=48, hidden_size=32, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  intermediate_size=64, hidden_act="silu", rope_theta=1e6, rms_norm_eps=1e-6,
                  tie_word_embeddings=tie, attention_bias=False, use_sliding_window=False,
                  sliding_window=None, rope_scaling=None)
    if model_type == "qwen3_moe":
        config.update(QWEN3_MOE)
    return config


def _sparse(config: dict, layer: int) -> bool:
    """Hugging Face Qwen3-MoE's rule for a layer with the sparse MoE block."""
    return (config.get("num_experts", 0) > 0 and layer not in config["mlp_only_layers"]
            and (layer + 1) % config["decoder_sparse_step"] == 0)


def _write_checkpoint(folder, config: dict, rng) -> dict:
    """config.json and model.safetensors in ``folder``; returns the same weights under
    ``Llama``'s parameter paths (float64, kernels [in, out], experts stacked), written
    here from the HF names (not through ``hf_to_params``), for the reference."""
    save_file = pytest.importorskip("safetensors.numpy").save_file
    d, hd, f = config["hidden_size"], config["head_dim"], config["intermediate_size"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    hf, ours = {}, {}

    def put(hf_name, our_name, shape, offset=0.0, transpose=True):
        value = (offset + 0.3 * rng.standard_normal(shape)).astype(np.float32)
        hf[hf_name] = value
        if our_name is not None:
            ours[our_name] = f64(value.T if transpose else value)
        return value

    put("model.embed_tokens.weight", "embed_tokens.embedding", (config["vocab_size"], d),
        transpose=False)
    put("model.norm.weight", "norm.scale", (d,), offset=1.0)
    if not config["tie_word_embeddings"]:
        put("lm_head.weight", "lm_head.kernel", (config["vocab_size"], d))
    for i in range(config["num_hidden_layers"]):
        hp, p = f"model.layers.{i}.", f"layers.{i}."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            put(f"{hp}{norm}.weight", f"{p}{norm}.scale", (d,), offset=1.0)
        for name, rows in (("q", heads), ("k", kv), ("v", kv)):
            put(f"{hp}self_attn.{name}_proj.weight", f"{p}self_attn.{name}_proj.kernel",
                (rows * hd, d))
        put(f"{hp}self_attn.o_proj.weight", f"{p}self_attn.o_proj.kernel", (d, heads * hd))
        for name in ("q_norm", "k_norm"):
            put(f"{hp}self_attn.{name}.weight", f"{p}self_attn.{name}.scale", (hd,), offset=1.0)
        if _sparse(config, i):
            mf = config["moe_intermediate_size"]
            put(f"{hp}mlp.gate.weight", f"{p}mlp.router", (config["num_experts"], d))
            for proj, shape in (("gate_proj", (mf, d)), ("up_proj", (mf, d)),
                                ("down_proj", (d, mf))):
                mats = [put(f"{hp}mlp.experts.{e}.{proj}.weight", None, shape)
                        for e in range(config["num_experts"])]
                ours[f"{p}mlp.{proj}"] = f64(np.stack([m.T for m in mats]))
        else:
            for proj, shape in (("gate_proj", (f, d)), ("up_proj", (f, d)),
                                ("down_proj", (d, f))):
                put(f"{hp}mlp.{proj}.weight", f"{p}mlp.{proj}.kernel", shape)
    save_file(hf, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))
    return ours


def _expected_config(config: dict) -> tdnn.LlamaConfig:
    """The ``LlamaConfig`` a tiny config of ``_hf_config`` means, spelled out by hand."""
    moe = {}
    if config["model_type"] == "qwen3_moe":
        moe = dict(num_experts=4, experts_per_token=2, moe_hidden=24, moe_layers=(1,),
                   norm_topk_prob=True)
    return tdnn.LlamaConfig(vocab=48, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                            hidden=64, head_dim=16, rope_theta=1e6, norm_eps=1e-6,
                            tie_embeddings=config["tie_word_embeddings"], qk_norm=True, **moe)


@pytest.mark.parametrize("model_type,mesh_shape,explicit", [
    # Dense, tied head; heads sharded over tp 2 (a KV head per rank), Explicit axes.
    pytest.param("qwen3", (2, 2), True, id="qwen3-tied-tp2"),
    # A dense and a sparse layer; tp 4 over 2 KV heads (stored replicated), Auto axes.
    pytest.param("qwen3_moe", (1, 4), False, id="qwen3_moe-tp4"),
])
def test_qwen3_checkpoint_prefills_and_decodes_like_the_reference(tmp_path, model_type,
                                                                  mesh_shape, explicit):
    """The loaded model's logits, prefill (fused attention) and decode steps
    (flash_decode on the jaxtdist impl, a masked attention on the XLA twin), are the
    reference's from the same weights: q/k norm before RoPE, head_dim apart from
    hidden_size / heads, dense and sparse layers, the tied head."""
    mesh = dp_tp_mesh(mesh_shape, explicit)
    rng = np.random.default_rng(12)
    config = _hf_config(model_type, tie=model_type == "qwen3")
    w = _write_checkpoint(tmp_path, config, rng)
    cfg = _expected_config(config)
    batch, prompt, total = 2, 8, 10
    tokens = rng.integers(0, config["vocab_size"], (batch, total)).astype(np.int32)
    ref = _llama_reference(w, tokens, cfg)
    prefill, step = nnx.jit(lambda m, t: m(t)), nnx.jit(lambda m, t: m(t, decode=True))
    for impl in ("jaxtdist", "xla"):
        model = tdnn.load_hf_llama(tmp_path, mesh, impl=impl)
        assert model.config == cfg
        model.init_cache(batch, total)
        assert rel_err(prefill(model, tokens[:, :prompt]), ref[:, :prompt]) < 1e-5, impl
        for t in range(prompt, total):
            assert rel_err(step(model, tokens[:, t:t + 1])[:, 0], ref[:, t]) < 1e-5, (impl, t)


QWEN3_30B_A3B = dict(  # the keys of Qwen3-30B-A3B's config.json that the loader reads
    model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
    moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
    num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
    norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], hidden_act="silu",
    rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False,
    use_sliding_window=False, sliding_window=None, rope_scaling=None,
    router_aux_loss_coef=0.001, output_router_logits=False)


def test_qwen3_configs_map_and_what_llama_does_not_compute_is_refused():
    cfg = tdnn._hf.hf_config(QWEN3_30B_A3B)
    assert (cfg.head_dim, cfg.hidden, cfg.moe_hidden, cfg.num_experts) == (128, 6144, 768, 128)
    assert cfg.qk_norm and cfg.norm_topk_prob and cfg.experts_per_token == 8
    assert cfg.moe_layers == tuple(range(48)) and cfg.router_aux_loss_coef == 0.0
    # Every second layer sparse, but not layer 3: layers 1 and 5 of 6.
    odd = tdnn._hf.hf_config({**QWEN3_30B_A3B, "num_hidden_layers": 6, "decoder_sparse_step": 2,
                              "mlp_only_layers": [3], "norm_topk_prob": False})
    assert odd.moe_layers == (1, 5) and not odd.norm_topk_prob
    assert [odd.is_moe_layer(i) for i in range(6)] == [False, True, False, False, False, True]
    dense = tdnn._hf.hf_config({**QWEN3_30B_A3B, "model_type": "qwen3",
                                "tie_word_embeddings": True})
    assert dense.num_experts == 0 and dense.qk_norm and dense.tie_embeddings
    # A sliding_window without use_sliding_window is not used by HF Qwen3 either.
    assert tdnn._hf.hf_config({**QWEN3_30B_A3B, "sliding_window": 4096}).qk_norm
    llama = tdnn._hf.hf_config({**QWEN3_30B_A3B, "model_type": "llama"})
    assert not llama.qk_norm and llama.num_experts == 0
    for key, value, match in (
            ("model_type", "qwen2", r"model_type='qwen2'; jaxtdist.nn.Llama reads 'llama', "
                                    r"'mistral', 'mixtral', 'qwen3', 'qwen3_moe'"),
            ("attention_bias", True, "attention_bias=true; .* no bias"),
            ("use_sliding_window", True, "use_sliding_window=true"),
            ("rope_scaling", {"rope_type": "yarn", "factor": 4.0},
             "rope_scaling=.*yarn.*rope_scaling null or rope_type 'default'"),
            ("decoder_sparse_step", 0, "decoder_sparse_step=0; expected an int >= 1")):
        with pytest.raises(ValueError, match=match):
            tdnn._hf.hf_config({**QWEN3_30B_A3B, key: value})
    with pytest.raises(ValueError, match=r"rope_scaling=.*llama3.* without 'low_freq_factor'"):
        tdnn._hf.hf_config({**QWEN3_30B_A3B, "model_type": "llama",
                            "rope_scaling": {"rope_type": "llama3", "factor": 8.0}})
    llama31 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=8192)
    assert tdnn._hf.hf_config({**QWEN3_30B_A3B, "model_type": "llama", "rope_scaling": llama31}
                              ).rope_scaling == tdnn.RopeScaling(8.0, 1.0, 4.0, 8192)
    assert tdnn._hf.hf_config({**QWEN3_30B_A3B, "rope_scaling": {"rope_type": "default"}})
    with pytest.raises(ValueError, match=r"moe_layers=\(0, 2\) names layers \[2\] of "
                                         r"num_layers=2"):
        tdnn.LlamaConfig(48, 32, 2, 4, num_experts=4, moe_layers=(0, 2))
    with pytest.raises(ValueError, match=r"moe_layers=\(1,\) with num_experts=0"):
        tdnn.LlamaConfig(48, 32, 2, 4, moe_layers=(1,))
    assert tdnn.LlamaConfig(48, 32, 2, 4, num_experts=4, moe_layers=[1, 0, 1]).moe_layers == (0, 1)
