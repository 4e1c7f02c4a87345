"""Hugging Face Llama and Mixtral checkpoints (safetensors) into ``jaxtdist.nn.Llama``."""

from __future__ import annotations

import json
import pathlib
import re

import jax
import numpy as np
from flax import nnx

from jaxtdist.nn._llama import Llama, LlamaConfig

__all__ = ["hf_config", "hf_to_params", "load_hf_llama"]


def hf_config(config: dict) -> LlamaConfig:
    """A ``LlamaConfig`` from a Hugging Face ``config.json`` dict.

    Raises:
      ValueError: the config asks for what ``Llama`` does not compute (another
        activation than SiLU, sliding-window attention).
    """
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"jaxtdist.nn.load_hf_llama: config.json has hidden_act={act!r}; "
                         "jaxtdist.nn.Llama computes SwiGLU (silu) only")
    if config.get("sliding_window") is not None:
        raise ValueError(f"jaxtdist.nn.load_hf_llama: config.json has sliding_window="
                         f"{config['sliding_window']}; jaxtdist.nn.Llama attends over the whole "
                         "sequence (no sliding window)")
    return LlamaConfig(vocab=config["vocab_size"], d_model=config["hidden_size"],
                       num_layers=config["num_hidden_layers"],
                       num_heads=config["num_attention_heads"],
                       num_kv_heads=config.get("num_key_value_heads"),
                       hidden=config["intermediate_size"], head_dim=config.get("head_dim"),
                       rope_theta=float(config.get("rope_theta", 10000.0)),
                       norm_eps=float(config.get("rms_norm_eps", 1e-6)),
                       tie_embeddings=bool(config.get("tie_word_embeddings", False)),
                       # Mixtral: its sparse MoE MLP; HF adds the router's loss only
                       # with output_router_logits.
                       num_experts=int(config.get("num_local_experts", 0)),
                       experts_per_token=int(config.get("num_experts_per_tok", 2)),
                       router_aux_loss_coef=(float(config.get("router_aux_loss_coef", 0.0))
                                             if config.get("output_router_logits") else 0.0))


def hf_to_params(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Hugging Face names -> ``Llama`` parameter paths (dot-joined); linear weights
    [out, in] are transposed to kernels [in, out]. Mixtral's
    ``block_sparse_moe.gate`` is ``mlp.router``, and its experts' w1, w3, w2 are
    stacked into ``mlp.gate_proj``, ``mlp.up_proj``, ``mlp.down_proj`` [E, ...]."""
    out, experts = {}, {}
    for name, value in tensors.items():
        if name.endswith("rotary_emb.inv_freq"):
            continue  # recomputed from rope_theta
        path = name.removeprefix("model.")
        moe = re.fullmatch(r"(layers\.\d+\.)block_sparse_moe\.(gate|experts\.(\d+)\.(w[123]))"
                           r"\.weight", path)
        if moe:
            layer, _, expert, w = moe.groups()
            if expert is None:
                out[layer + "mlp.router"] = value.T
            else:
                proj = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}[w]
                experts.setdefault(layer + "mlp." + proj, {})[int(expert)] = value.T
        elif path == "embed_tokens.weight":
            out["embed_tokens.embedding"] = value
        elif path.endswith("layernorm.weight") or path == "norm.weight":
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
