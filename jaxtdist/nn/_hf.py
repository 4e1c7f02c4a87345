"""Hugging Face Llama, Mistral, Mixtral, Qwen3 and Qwen3-MoE checkpoints (safetensors)
into ``jaxtdist.nn.Llama``, FP8 checkpoints included.

FP8 checkpoints (Qwen3-*-FP8, DeepSeek-V3's format): a linear layer's ``weight``
[out, in] in float8_e4m3fn with ``weight_scale_inv`` [cdiv(out, 128),
cdiv(in, 128)] float32 dequantization multipliers beside it
(``quantization_config`` ``{"quant_method": "fp8", "weight_block_size": [128,
128]}``). Into a model built with ``fp8=Fp8Recipe("blockwise")`` both are
loaded as they are (K-major, the layers' ``weight`` and ``weight_scale_inv``),
never dequantized; into layers without that recipe (``fp8=None``, the
training recipe's master weights, MoE experts) they are dequantized to
float32 and cast to the parameter dtype, with a ``UserWarning`` saying how
many and how to keep them in FP8. A 16/32-bit checkpoint into a blockwise
model is quantized here (``quantize_weight``).
"""

from __future__ import annotations

import json
import pathlib
import re
import struct
import warnings

import jax
import ml_dtypes
import numpy as np
from flax import nnx

from jaxtdist.nn._attention import RopeScaling
from jaxtdist.nn._fp8 import Fp8Weight
from jaxtdist.nn._llama import Llama, LlamaConfig
from jaxtdist.ops.quant import BLOCK, quantize_weight

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


# safetensors dtype names -> numpy (ml_dtypes for bfloat16 and the FP8 formats, which
# safetensors.numpy cannot read).
_ST_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16,
              "BF16": ml_dtypes.bfloat16, "F8_E4M3": ml_dtypes.float8_e4m3fn,
              "F8_E5M2": ml_dtypes.float8_e5m2, "I64": np.int64, "I32": np.int32,
              "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
_FP8 = (np.dtype(ml_dtypes.float8_e4m3fn),)
_LOAD = "jaxtdist.nn.load_hf_llama"


def read_safetensors(path: str | pathlib.Path) -> dict[str, np.ndarray]:
    """Every tensor of a ``.safetensors`` file as numpy (bfloat16 and FP8 through
    ml_dtypes): an 8-byte little-endian header length, a JSON header of
    ``{name: {dtype, shape, data_offsets}}``, then the bytes. Memory-mapped: a
    shard of several GB is read as its tensors are used, not copied at once."""
    data = np.memmap(path, dtype=np.uint8, mode="r")
    (size,) = struct.unpack("<Q", data[:8].tobytes())
    header = json.loads(data[8:8 + size].tobytes())
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _ST_DTYPES:
            raise ValueError(f"{_LOAD}: {path}: tensor {name!r} has dtype {info['dtype']}; "
                             f"readable: {', '.join(_ST_DTYPES)}")
        start, end = info["data_offsets"]
        buf = data[8 + size + start:8 + size + end]
        out[name] = buf.view(_ST_DTYPES[info["dtype"]]).reshape(info["shape"])
    return out


def _check_quantization(config: dict) -> None:
    """A ValueError unless the config's ``quantization_config`` (if any) is the
    blockwise FP8 this loader reads."""
    quant = config.get("quantization_config")
    if not quant:
        return
    method, block = quant.get("quant_method"), quant.get("weight_block_size")
    if method != "fp8" or list(block or ()) != [BLOCK, BLOCK]:
        raise ValueError(f"{_WHERE} quantization_config={quant}; {_LOAD} reads FP8 checkpoints "
                         f"with quant_method 'fp8' and weight_block_size [{BLOCK}, {BLOCK}] "
                         "(weight float8_e4m3fn with weight_scale_inv per 128 x 128 block)")
    if quant.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError(f"{_WHERE} quantization_config activation_scheme="
                         f"{quant['activation_scheme']!r}; jaxtdist's FP8 layers quantize "
                         "activations on the fly ('dynamic'): static input scales are not read")


def dequantize_blockwise(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """float32 ``q * scale_inv`` of a checkpoint's FP8 weight [N, K] and its
    [cdiv(N, 128), cdiv(K, 128)] scales (partial last blocks included)."""
    full = np.repeat(np.repeat(scale.astype(np.float32), BLOCK, 0), BLOCK, 1)
    return q.astype(np.float32) * full[:q.shape[0], :q.shape[1]]


def _split_fp8(tensors: dict, fp8_paths: set[str]) -> tuple[dict, dict, int]:
    """(float tensors, FP8 layer values, how many FP8 weights were dequantized).

    Each FP8 ``*.weight`` must come with its ``*.weight_scale_inv`` of the block
    shape; where the model has an FP8 layer of that path (``fp8_paths``, the
    model's ``...weight`` variables) both go to the FP8 values as they are, else
    the weight is dequantized (float32) into the float tensors.

    Raises:
      ValueError: an FP8 weight without scales, scales without an FP8 weight,
        scales of the wrong shape or dtype, static activation scales.
    """
    floats, fp8, dequantized = {}, {}, 0
    for name, value in tensors.items():
        if name.endswith((".input_scale", ".activation_scale")):
            raise ValueError(f"{_LOAD}: tensor {name!r} is a static activation scale; "
                             "jaxtdist's FP8 layers quantize activations on the fly (dynamic "
                             "scaling): use a checkpoint with activation_scheme 'dynamic'")
        if name.endswith(".weight_scale_inv"):
            weight = name.removesuffix("_scale_inv")
            if weight not in tensors or np.dtype(tensors[weight].dtype) not in _FP8:
                raise ValueError(f"{_LOAD}: {name!r} has no float8_e4m3fn {weight!r} beside it "
                                 "(scales belong to FP8 weights); remove the stray scale or "
                                 "add its weight")
            continue
        if np.dtype(value.dtype) not in _FP8:
            if name.endswith(".weight") and np.dtype(value.dtype) == np.dtype(
                    ml_dtypes.float8_e5m2):
                raise ValueError(f"{_LOAD}: {name!r} is float8_e5m2; FP8 checkpoint weights "
                                 "are float8_e4m3fn (with weight_scale_inv)")
            floats[name] = value
            continue
        scale = tensors.get(name + "_scale_inv")
        if not name.endswith(".weight") or value.ndim != 2 or scale is None:
            raise ValueError(f"{_LOAD}: {name!r} is float8_e4m3fn {list(value.shape)} without "
                             f"{name + '_scale_inv'!r}: FP8 checkpoints store each 2-D linear "
                             "weight [out, in] with its 128 x 128 block scales (float32 "
                             "dequantization multipliers) beside it; add them (or dequantize "
                             "the checkpoint first)")
        n, k = value.shape
        want = (-(-n // BLOCK), -(-k // BLOCK))
        if tuple(scale.shape) != want or np.dtype(scale.dtype) != np.float32:
            raise ValueError(f"{_LOAD}: {name + '_scale_inv'!r} is {np.dtype(scale.dtype).name}"
                             f"{list(scale.shape)}; the weight {list(value.shape)} [out, in] "
                             f"needs float32{list(want)} (one scale per 128 x 128 block, "
                             "cdiv(out, 128) x cdiv(in, 128))")
        path = name.removeprefix("model.")
        if path in fp8_paths:
            fp8[path], fp8[path + "_scale_inv"] = value, scale
        else:
            floats[name] = dequantize_blockwise(value, scale)
            dequantized += 1
    return floats, fp8, dequantized


def load_hf_llama(folder: str | pathlib.Path, mesh, **kwargs) -> Llama:
    """A ``Llama`` with the weights of a Hugging Face checkpoint folder
    (``config.json`` and ``*.safetensors``), placed sharded on ``mesh``.

    FP8 checkpoints (see the module docstring): with ``fp8=Fp8Recipe("blockwise")``
    the FP8 weights and their scales are loaded as they are; without, they are
    dequantized (a ``UserWarning`` says so).

    Args:
      folder: the checkpoint folder.
      mesh: the mesh (for ``impl="jaxtdist"`` the one given to ``jaxtdist.initialize``).
      **kwargs: ``Llama``'s keyword arguments (``impl``, ``dtype``, ``batch_axes``,
        ``fp8`` ...).

    Raises:
      ValueError: a config ``Llama`` does not compute, missing or unexpected
        tensors, shapes that differ from the model's, FP8 weights without their
        scales or with scales of the wrong shape.

    Example:
      >>> model = load_hf_llama("TinyLlama-1.1B", mesh, dtype=jnp.bfloat16)
      >>> fp8 = load_hf_llama("Qwen3-0.6B-FP8", mesh, dtype=jnp.bfloat16,
      ...                     fp8=jaxtdist.nn.Fp8Recipe("blockwise"))
    """
    folder = pathlib.Path(folder)
    config = json.loads((folder / "config.json").read_text())
    cfg = hf_config(config)
    _check_quantization(config)
    tensors = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update(read_safetensors(file))
    model = Llama(cfg, mesh=mesh, rngs=nnx.Rngs(0), **kwargs)
    state = nnx.state(model, (nnx.Param, Fp8Weight))
    flat = dict(nnx.to_flat_state(state))
    fp8_paths = {".".join(map(str, k)) for k, v in flat.items()
                 if isinstance(v, Fp8Weight) and k[-1] == "weight"}
    tensors, fp8_values, dequantized = _split_fp8(tensors, fp8_paths)
    if dequantized:
        warnings.warn(f"{_LOAD}: {folder}: {dequantized} FP8 weights dequantized to float "
                      "(their layers have no blockwise FP8 recipe: built without fp8=, with "
                      "the training recipe, or MoE experts); build the model with "
                      "fp8=jaxtdist.nn.Fp8Recipe('blockwise') to keep the dense layers' "
                      "weights in FP8", UserWarning, stacklevel=2)
    params = hf_to_params(tensors)
    for path in fp8_paths - set(fp8_values):
        # A 16/32-bit checkpoint into a blockwise FP8 model: quantized here, once.
        kernel = params.pop(path.removesuffix("weight") + "kernel", None)
        if kernel is not None:
            w, s = quantize_weight(np.asarray(kernel, np.float32))
            fp8_values[path], fp8_values[path + "_scale_inv"] = np.asarray(w), np.asarray(s)
    params.update(fp8_values)
    if cfg.tie_embeddings:  # the head is embed_tokens; a saved copy is not read (as in HF)
        params.pop("lm_head.kernel", None)
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
