"""A Llama-3-architecture model (RMSNorm, RoPE, grouped-query attention, SwiGLU)
built from ``jaxtdist.nn``, trained a few AdamW steps and greedy-decoded with
the KV cache, side by side with the same model on XLA's collectives
(``impl="xla"``): same parameters, same batches, printed losses and tokens.
``--hf FOLDER`` loads a Hugging Face Llama (3.1's scaled RoPE included), Mistral,
Mixtral, Qwen3 or Qwen3-MoE checkpoint (safetensors) instead of random parameters.

Run (CPU, 8 host devices, tiny config):
  python examples/llama.py --tiny
On GPUs (a (dp, tp) mesh over the devices found):
  python examples/llama.py --steps 20
"""

from __future__ import annotations

import argparse
import os
import time

if "--tiny" in os.sys.argv and "XLA_FLAGS" not in os.environ:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import jaxtdist  # noqa: E402
from jaxtdist.nn import (Llama, LlamaConfig, Optimizer, generate,  # noqa: E402
                         load_hf_llama)

TINY = LlamaConfig(vocab=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, hidden=64)
SMALL = LlamaConfig(vocab=32000, d_model=2048, num_layers=4, num_heads=16, num_kv_heads=4,
                    hidden=5632)


def counting(rng: np.random.Generator, batch: int, length: int, vocab: int) -> np.ndarray:
    """[batch, length] int32 sequences counting up (mod vocab) from random starts."""
    return ((rng.integers(0, vocab, (batch, 1)) + np.arange(length)) % vocab).astype(np.int32)


@nnx.jit
def train_step(model: Llama, optimizer: nnx.Optimizer, tokens, targets):
    loss, grads = nnx.value_and_grad(Llama.loss)(model, tokens, targets)
    optimizer.update(model, grads)
    return loss


def make_models(cfg: LlamaConfig, mesh, hf: str | None, dtype=None) -> tuple[Llama, Llama]:
    if hf:
        return (load_hf_llama(hf, mesh, impl="jaxtdist", dtype=dtype),
                load_hf_llama(hf, mesh, impl="xla", dtype=dtype))
    return Llama.twins(cfg, mesh, dtype=dtype)


def run(args) -> dict:
    n = len(jax.devices())
    tp = args.tp or min(n, 4)
    mesh = jax.make_mesh((n // tp, tp), ("dp", "tp"))  # Explicit axes, the default
    jaxtdist.initialize(mesh)
    models = dict(zip(("jaxtdist", "xla"), make_models(args.cfg, mesh, args.hf)))
    vocab = models["xla"].config.vocab
    rng = np.random.default_rng(1)
    batches = [counting(rng, args.batch, args.seq + 1, vocab) for _ in range(args.steps)]
    prompt = counting(np.random.default_rng(2), args.batch, args.prompt_len, vocab)
    curves, times, tokens = {}, {}, {}
    for name, model in models.items():
        # On the model's mesh: the step compiles once (nnx.Optimizer puts optax's
        # step count on one device, and the second call compiled again).
        optimizer = Optimizer(model, optax.adamw(args.lr), wrt=nnx.Param)
        curve, spent = [], []
        for batch in batches:
            start = time.perf_counter()
            curve.append(float(train_step(model, optimizer, batch[:, :-1], batch[:, 1:])))
            spent.append(time.perf_counter() - start)
        curves[name] = curve
        times[name] = float(np.median(spent[1:])) if len(spent) > 1 else float("nan")
        # Greedy, through the KV cache; any prompt length (a list of token lists of
        # different lengths works too).
        tokens[name] = generate(model, prompt, args.tokens)
    return dict(curves=curves, times=times, tokens=tokens, prompt=prompt,
                mesh=dict(mesh.shape))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tiny", action="store_true", help="CPU-sized model and batch")
    parser.add_argument("--hf", default=None,
                        help="a Hugging Face Llama, Mistral, Mixtral, Qwen3 or Qwen3-MoE "
                             "checkpoint folder")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--tokens", type=int, default=8, help="tokens to generate")
    parser.add_argument("--tp", type=int, default=0, help="tensor-parallel size (default: "
                        "min(devices, 4))")
    args = parser.parse_args(argv)
    size = (dict(cfg=TINY, seq=16, batch=4, steps=6, lr=1e-2, prompt_len=7) if args.tiny else
            dict(cfg=SMALL, seq=1024, batch=8, steps=20, lr=3e-4, prompt_len=128))
    for key, value in size.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    result = run(args)
    print(f"mesh {result['mesh']}, {args.cfg}")
    print("step | loss (jaxtdist) | loss (XLA)")
    for i, (a, b) in enumerate(zip(result["curves"]["jaxtdist"], result["curves"]["xla"])):
        print(f"{i:4d} | {a:.6f} | {b:.6f}")
    for name, toks in result["tokens"].items():
        print(f"greedy ({name}): {toks[0].tolist()}")
    same = np.array_equal(result["tokens"]["jaxtdist"], result["tokens"]["xla"])
    print(f"same tokens: {same}; median step time: "
          + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in result["times"].items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
