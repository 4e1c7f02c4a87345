"""Greedy decoding with a KV cache, side by side: the small GPT of
examples/train_gpt.py on jaxtdist's layers and on XLA's collectives
(``impl="xla"``), from the same parameters. Prefill of the prompts is
sequence parallel (``ag_matmul`` / ``matmul_rs``); each decode step takes one
token per sequence, replicated over "tp" (local GEMMs, ``matmul_ar``), its
keys and values appended to each rank's head group of the cache. Prints both
token sequences and checks that they are identical.

The parameters are first trained for a few steps (on the XLA model, then
copied into the jaxtdist one) on sequences that count up modulo the vocabulary,
so the continuations are recognizable.

Run (CPU, 8 host devices, tiny config):
  python examples/generate.py --tiny
On GPUs (a (dp, tp) mesh over the devices found):
  python examples/generate.py --tokens 32
"""

from __future__ import annotations

import argparse
import os

if "--tiny" in os.sys.argv and "XLA_FLAGS" not in os.environ:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxtdist  # noqa: E402

from jaxtdist.nn import GPT  # noqa: E402


def counting(rng: np.random.Generator, batch: int, length: int, vocab: int) -> np.ndarray:
    """[batch, length] int32 sequences counting up (mod vocab) from random starts."""
    return ((rng.integers(0, vocab, (batch, 1)) + np.arange(length)) % vocab).astype(np.int32)


def train(model: GPT, args, mesh) -> list[float]:
    """A few Adam steps of next-token prediction on counting sequences."""
    spec = NamedSharding(mesh, P(("dp", "tp")))
    optimizer = nnx.Optimizer(model, optax.adam(args.lr), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, tokens, targets):
        loss, grads = nnx.value_and_grad(GPT.loss)(model, tokens, targets, args.seq)
        optimizer.update(model, grads)
        return loss

    rng, losses = np.random.default_rng(1), []
    for _ in range(args.train_steps):
        batch = counting(rng, args.batch, args.seq + 1, args.vocab)
        losses.append(float(step(model, optimizer,
                                 jax.device_put(batch[:, :-1].reshape(-1), spec),
                                 jax.device_put(batch[:, 1:].reshape(-1), spec))))
    return losses


@nnx.jit(static_argnames="seq_len")
def _prefill(model: GPT, tokens: jax.Array, seq_len: int) -> jax.Array:
    logits = model(tokens, seq_len)                      # [batch * seq_len, vocab]
    last = logits.reshape(-1, seq_len, logits.shape[-1])[:, -1]
    return jnp.argmax(last, axis=-1).astype(jnp.int32)


@nnx.jit
def _decode_step(model: GPT, tokens: jax.Array) -> jax.Array:
    return jnp.argmax(model(tokens, decode=True), axis=-1).astype(jnp.int32)


def greedy(model: GPT, prompt: np.ndarray, steps: int, mesh) -> np.ndarray:
    """Greedy continuation of ``prompt`` [batch, prompt_len] by ``steps`` tokens.

    The prompt is prefilled sequence parallel (tokens over ("dp", "tp"): batch *
    prompt_len must divide over the mesh, and batch over "dp"); the new tokens
    are decoded one per step with the KV cache.

    Returns:
      [batch, steps] int32, the generated tokens.
    """
    batch, prompt_len = prompt.shape
    model.init_cache(batch, prompt_len + steps)
    tokens = jax.device_put(prompt.reshape(-1), NamedSharding(mesh, P(("dp", "tp"))))
    out = [_prefill(model, tokens, prompt_len)]
    for _ in range(steps - 1):
        out.append(_decode_step(model, out[-1]))
    return np.stack([np.asarray(t) for t in out], axis=1)


def generate(args) -> dict:
    """Trains, then decodes greedily with both models; returns prompt, tokens and losses."""
    n = len(jax.devices())
    tp = args.tp or min(n, 4)
    mesh = jax.make_mesh((n // tp, tp), ("dp", "tp"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    jaxtdist.initialize(mesh)
    ours, theirs = GPT.twins(args.vocab, args.d, args.heads, args.layers, mesh)
    losses = train(theirs, args, mesh)                  # XLA's model trains quickly on CPU
    nnx.update(ours, nnx.state(theirs, nnx.Param))      # same parameters in both
    prompt = counting(np.random.default_rng(2), args.batch, args.prompt_len, args.vocab)
    tokens = {name: greedy(model, prompt, args.tokens, mesh)
              for name, model in (("jaxtdist", ours), ("xla", theirs))}
    return dict(prompt=prompt, tokens=tokens, losses=losses, mesh=dict(mesh.shape))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tiny", action="store_true", help="CPU-sized model and batch")
    parser.add_argument("--tokens", type=int, default=None, help="tokens to generate")
    parser.add_argument("--train-steps", type=int, default=None,
                        help="Adam steps before decoding (0: random parameters)")
    parser.add_argument("--tp", type=int, default=0, help="tensor-parallel size (default: "
                        "min(devices, 4))")
    args = parser.parse_args(argv)
    size = (dict(vocab=64, d=32, heads=4, layers=2, seq=16, batch=4, lr=1e-2, prompt_len=8,
                 tokens=8, train_steps=60)
            if args.tiny else
            dict(vocab=32000, d=2048, heads=16, layers=4, seq=1024, batch=8, lr=3e-4,
                 prompt_len=128, tokens=32, train_steps=20))
    for key, value in size.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    result = generate(args)
    print(f"mesh {result['mesh']}, {args.layers} layers, d={args.d}; "
          f"{len(result['losses'])} training steps"
          + (f", loss {result['losses'][0]:.3f} -> {result['losses'][-1]:.3f}"
             if result["losses"] else ""))
    for i, row in enumerate(result["prompt"]):
        print(f"prompt {i}: {row.tolist()}")
        for name, tokens in result["tokens"].items():
            print(f"  {name:>8}: {tokens[i].tolist()}")
    same = np.array_equal(result["tokens"]["jaxtdist"], result["tokens"]["xla"])
    print("jaxtdist and XLA tokens identical:", same)
    assert same, "the jaxtdist model and the XLA model decoded different tokens"
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
