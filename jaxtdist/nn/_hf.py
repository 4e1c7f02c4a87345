"""Hugging Face Llama, Mistral, Mixtral, Qwen3 and Qwen3-MoE checkpoints (safetensors)
into ``jaxtdist.nn.Llama``."""

from __future__ import annotations

import json
import pathlib
import re

import jax
import numpy as np
from flax import nnx

from jaxtdist.nn._attention import RopeScaling
from jaxtdist.nn._llama import Llama, LlamaConfig

__all__ = ["hf_config", "hf_to_params", "load_hf_llama"]


MODEL_TYPES = ("llama", "mistral", "mixtral", "qwen3", "qwen3_moe")
_QWEN3 = ("qwen3", "qwen3_moe")
_WHERE = "jaxtdist.nn.load_hf_llama: config.json has"


def hf_config(config: dict) -> LlamaConfig:
    """A ``LlamaConfig`` from a Hugging Face ``config.json`` dict: Llama, Mistral,
    Mixtral, Qwen3 or Qwen3-MoE (``model_type``; a config without one is read as
    Llama's, with Mixtral's experts where it has ``num_local_experts``).

    Raises:
      ValueError: another ``model_type``, or the config asks for what ``Llama`` does
        not compute (another activation than SiLU, biases, sliding-window attention,
        scaled rotary embeddings).
    """
    model_type = config.get("model_type")
    _check_supported(config, model_type)
    return LlamaConfig(vocab=config["vocab_size"], d_model=config["hidden_size"],
                       num_layers=config["num_hidden_layers"],
                       num_heads=config["num_attention_heads"],
                       num_kv_heads=config.get("num_key_value_heads"),
                       hidden=config["intermediate_size"], head_dim=config.get("head_dim"),
                       rope_theta=float(config.get("rope_theta", 10000.0)),
                       rope_scaling=_rope_scaling(config),
                       norm_eps=float(config.get("rms_norm_eps", 1e-6)),
                       tie_embeddings=bool(config.get("tie_word_embeddings", False)),
                       qk_norm=model_type in _QWEN3,
                       # HF adds the router's loss only with output_router_logits.
                       router_aux_loss_coef=(float(config.get("router_aux_loss_coef", 0.0))
                                             if config.get("output_router_logits") else 0.0),
                       **_moe_fields(config, model_type))


def _check_supported(config: dict, model_type: str | None) -> None:
    """A ValueError naming the key when ``config`` is not a model ``Llama`` computes."""
    if model_type is not None and model_type not in MODEL_TYPES:
        raise ValueError(f"{_WHERE} model_type={model_type!r}; jaxtdist.nn.Llama reads "
                         f"{', '.join(map(repr, MODEL_TYPES))}")
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{_WHERE} hidden_act={act!r}; jaxtdist.nn.Llama computes SwiGLU "
                         "(silu) only")
    for key in ("attention_bias", "mlp_bias"):
        if config.get(key):
            raise ValueError(f"{_WHERE} {key}=true; jaxtdist.nn.Llama's projections have no "
                             "bias (a checkpoint with biases is not supported)")
    # Qwen3 configs carry a sliding_window that applies only with use_sliding_window.
    if model_type in _QWEN3:
        if config.get("use_sliding_window"):
            raise ValueError(f"{_WHERE} use_sliding_window=true; jaxtdist.nn.Llama attends "
                             "over the whole sequence (no sliding window)")
    elif config.get("sliding_window") is not None:
        raise ValueError(f"{_WHERE} sliding_window={config['sliding_window']}; jaxtdist.nn."
                         "Llama attends over the whole sequence (no sliding window)")


def _rope_scaling(config: dict) -> RopeScaling | None:
    """The config's ``rope_scaling``: None (absent, or ``rope_type`` "default") or
    Llama 3.1's ("llama3"); other kinds raise a ValueError naming them."""
    scaling = config.get("rope_scaling")
    kind = scaling and scaling.get("rope_type", scaling.get("type"))
    if not scaling or kind == "default":
        return None
    if kind != "llama3":
        raise ValueError(f"{_WHERE} rope_scaling={scaling}; jaxtdist.nn.Llama computes rotary "
                         "embeddings of rope_theta, plain (rope_scaling null or rope_type "
                         "'default') or scaled as Llama 3.1 does (rope_type 'llama3')")
    try:
        return RopeScaling(float(scaling["factor"]), float(scaling["low_freq_factor"]),
                           float(scaling["high_freq_factor"]),
                           int(scaling["original_max_position_embeddings"]))
    except KeyError as missing:
        raise ValueError(f"{_WHERE} rope_scaling={scaling} without {missing}; Llama 3.1's "
                         "scaling needs factor, low_freq_factor, high_freq_factor and "
                         "original_max_position_embeddings") from None


def _moe_fields(config: dict, model_type: str | None) -> dict:
    """``LlamaConfig``'s MoE fields: Mixtral's experts in every layer; Qwen3-MoE's in
    the layers HF makes sparse (not in ``mlp_only_layers``, every
    ``decoder_sparse_step``-th), HF's defaults where a key is absent."""
    if model_type != "qwen3_moe":
        return dict(num_experts=int(config.get("num_local_experts", 0)),
                    experts_per_token=int(config.get("num_experts_per_tok", 2)))
    experts, step = int(config.get("num_experts", 128)), config.get("decoder_sparse_step", 1)
    if not isinstance(step, int) or step < 1:
        raise ValueError(f"{_WHERE} decoder_sparse_step={step!r}; expected an int >= 1 (every "
                         "step-th layer is sparse)")
    dense = set(config.get("mlp_only_layers") or ())
    layers = tuple(i for i in range(config["num_hidden_layers"])
                   if experts > 0 and i not in dense and (i + 1) % step == 0)
    return dict(num_experts=experts, experts_per_token=int(config.get("num_experts_per_tok", 8)),
                moe_hidden=int(config.get("moe_intermediate_size", 768)),
                moe_layers=layers, norm_topk_prob=bool(config.get("norm_topk_prob", False)))


# A sparse layer's router and experts: Mixtral's block_sparse_moe (w1, w3, w2) or
# Qwen3-MoE's mlp (gate_proj, up_proj, down_proj).
_MOE = re.compile(r"(layers\.\d+\.)(?:block_sparse_moe|mlp)\.(gate|experts\.(\d+)\."
                  r"(w[123]|gate_proj|up_proj|down_proj))\.weight")
_EXPERT_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj", "gate_proj": "gate_proj",
                "up_proj": "up_proj", "down_proj": "down_proj"}
_NORMS = ("layernorm.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight")


def hf_to_params(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Hugging Face names -> ``Llama`` parameter paths (dot-joined); linear weights
    [out, in] are transposed to kernels [in, out] and norm weights become ``scale``
    (Qwen3's ``self_attn.q_norm.weight`` is ``self_attn.q_norm.scale``). A sparse
    layer's router (Mixtral's ``block_sparse_moe.gate``, Qwen3-MoE's ``mlp.gate``)
    is ``mlp.router``, and its experts' w1, w3, w2 (Qwen3-MoE: gate_proj, up_proj,
    down_proj) are stacked into ``mlp.gate_proj``, ``mlp.up_proj``,
    ``mlp.down_proj`` [E, ...]."""
    out, experts = {}, {}
    for name, value in tensors.items():
        if name.endswith("rotary_emb.inv_freq"):
            continue  # recomputed from rope_theta
        path = name.removeprefix("model.")
        moe = _MOE.fullmatch(path)
        if moe:
            layer, _, expert, w = moe.groups()
            if expert is None:
                out[layer + "mlp.router"] = value.T
            else:
                experts.setdefault(layer + "mlp." + _EXPERT_PROJ[w], {})[int(expert)] = value.T
        elif path == "embed_tokens.weight":
            out["embed_tokens.embedding"] = value
        elif path.endswith(_NORMS) or path == "norm.weight":
            out[path.removesuffix("weight") + "scale"] = value
        elif path.endswith(".weight"):
            out[path.removesuffix("weight") + "kernel"] = value.T
        elif path.endswith(".bias"):
            out[path] = value
        else:
            raise ValueError(f"jaxtdist.nn.load_hf_llama: unexpected tensor {name!r}")
    for path, stack in experts.items():
        if sorted(stack) != list(range(len(stack))):
            raise ValueError(f"jaxtdist.nn.load_hf_llama: {path}: experts {sorted(stack)} in the "
                             f"checkpoint, expected 0 ... {len(stack) - 1}")
        out[path] = np.stack([stack[e] for e in range(len(stack))])
    return out


def load_hf_llama(folder: str | pathlib.Path, mesh, **kwargs) -> Llama:
    """A ``Llama`` with the weights of a Hugging Face checkpoint folder
    (``config.json`` and ``*.safetensors``), placed sharded on ``mesh``.

    Args:
      folder: the checkpoint folder.
      mesh: the mesh (for ``impl="jaxtdist"`` the one given to ``jaxtdist.initialize``).
      **kwargs: ``Llama``'s keyword arguments (``impl``, ``dtype``, ``batch_axes`` ...).

    Example:
      >>> model = load_hf_llama("TinyLlama-1.1B", mesh, dtype=jnp.bfloat16)
    """
    from safetensors.numpy import load_file

    folder = pathlib.Path(folder)
    cfg = hf_config(json.loads((folder / "config.json").read_text()))
    tensors = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    params = hf_to_params(tensors)
    if cfg.tie_embeddings:  # the head is embed_tokens; a saved copy is not read (as in HF)
        params.pop("lm_head.kernel", None)
    model = Llama(cfg, mesh=mesh, rngs=nnx.Rngs(0), **kwargs)
    state = nnx.state(model, nnx.Param)
    flat = dict(nnx.to_flat_state(state))
    missing = {".".join(map(str, k)) for k in flat} - set(params)
    extra = set(params) - {".".join(map(str, k)) for k in flat}
    if missing or extra:
        raise ValueError(f"jaxtdist.nn.load_hf_llama: {folder}: parameters missing "
                         f"{sorted(missing)[:5]}, unexpected {sorted(extra)[:5]}")
    for key, var in flat.items():
        value = params[".".join(map(str, key))]
        if tuple(value.shape) != tuple(var.shape):
            raise ValueError(f"jaxtdist.nn.load_hf_llama: {'.'.join(map(str, key))} has shape "
                             f"{value.shape} in the checkpoint, {tuple(var.shape)} in the model")
        var[...] = jax.device_put(value.astype(var.dtype), var[...].sharding)
    nnx.update(model, state)
    return model
