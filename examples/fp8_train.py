"""Trains a tiny Llama with the FP8 training recipe beside the same model in float32.

``jaxtdist.nn.Fp8Recipe("tensor")`` (TransformerEngine's hybrid current scaling:
e4m3 forward operands, e5m2 gradients, per-tensor amax scales, FP8 GEMMs in the
forward and the backward) on every attention projection and MLP, against the
same model, same initial weights and same batches, with ``fp8=None``. The data
is a random first-order Markov chain over the vocabulary (fresh batches every
step), so the loss falls towards the chain's entropy rather than zero. Prints
both losses every ``--every`` steps, then the final held-out losses side by
side and their relative difference (the target: within 2%).

Without GPUs it runs on 4 host devices (a 2 x 2 dp x tp mesh); on CPU use
``--impl xla`` (the attention kernels under Triton's interpreter are slow), the
FP8 GEMMs are the same code in both impls.

    python examples/fp8_train.py --steps 200 --impl xla
"""

import argparse
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import jaxtdist as td  # noqa: E402
from jaxtdist import nn as tdnn  # noqa: E402

CONFIG = tdnn.LlamaConfig(vocab=64, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2,
                          hidden=128)
BATCH, SEQ = 8, 32


def markov_batches(rng, steps: int, vocab: int):
    """(tokens, targets) int32 [BATCH, SEQ] per step, and a held-out batch, from one
    random transition matrix (each row a softmax of Gaussian logits: entropy ~2 nats)."""
    trans = np.exp(2.0 * rng.standard_normal((vocab, vocab)))
    trans /= trans.sum(-1, keepdims=True)
    cum = np.cumsum(trans, -1)

    def batch():
        seq = np.empty((BATCH, SEQ + 1), np.int64)
        seq[:, 0] = rng.integers(0, vocab, BATCH)
        for t in range(SEQ):
            u = rng.random(BATCH)[:, None]
            seq[:, t + 1] = np.minimum((u > cum[seq[:, t]]).sum(-1), vocab - 1)
        return seq[:, :-1].astype(np.int32), seq[:, 1:].astype(np.int32)

    return [batch() for _ in range(steps)], batch()


def train(fp8, mesh, impl: str, batches, held_out, lr: float):
    """Losses of each step and the final held-out loss of a model built with ``fp8``."""
    model = tdnn.Llama(CONFIG, mesh=mesh, impl=impl, fp8=fp8, rngs=nnx.Rngs(0))
    optimizer = tdnn.Optimizer(model, optax.adamw(lr), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, tokens, targets):
        loss, grads = nnx.value_and_grad(lambda m: m.loss(tokens, targets))(model)
        optimizer.update(model, grads)
        return loss

    losses = [float(step(model, optimizer, t, y)) for t, y in batches]
    final = float(nnx.jit(lambda m, t, y: m.loss(t, y))(model, *held_out))
    return losses, final


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--impl", default="jaxtdist", choices=("jaxtdist", "xla"))
    parser.add_argument("--every", type=int, default=20)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()
    mesh = jax.make_mesh((2, 2), ("dp", "tp"), devices=jax.devices()[:4])
    if args.impl == "jaxtdist":
        td.initialize(mesh)
    batches, held_out = markov_batches(np.random.default_rng(0), args.steps, CONFIG.vocab)
    ref, ref_final = train(None, mesh, args.impl, batches, held_out, args.lr)
    fp8, fp8_final = train(tdnn.Fp8Recipe("tensor"), mesh, args.impl, batches, held_out,
                           args.lr)
    print(f"{'step':>5} {'float32':>9} {'fp8':>9}")
    for i in range(0, args.steps, args.every):
        print(f"{i:5d} {ref[i]:9.4f} {fp8[i]:9.4f}")
    last = min(10, args.steps)
    print(f"mean of the last {last} steps: float32 {np.mean(ref[-last:]):.4f} "
          f"fp8 {np.mean(fp8[-last:]):.4f}")
    rel = abs(fp8_final - ref_final) / ref_final
    print(f"final held-out loss: float32 {ref_final:.4f} fp8 {fp8_final:.4f} "
          f"relative difference {rel:.4f}")


if __name__ == "__main__":
    main()
