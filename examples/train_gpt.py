"""A small GPT trained with sequence-parallel tensor parallelism, side by side:
the same model, parameters and batches on jaxtdist's layers and on XLA's
collectives (``impl="xla"``). Prints both loss curves (and, on GPUs, the
median step time of each).

Run (CPU, 8 host devices, tiny config):
  python examples/train_gpt.py --tiny
On GPUs (a (dp, tp) mesh over the devices found):
  python examples/train_gpt.py --steps 20
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
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxtdist  # noqa: E402

from jaxtdist.nn import GPT  # noqa: E402


def train(args) -> dict:
    n = len(jax.devices())
    tp = args.tp or min(n, 4)
    mesh = jax.make_mesh((n // tp, tp), ("dp", "tp"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    jaxtdist.initialize(mesh)
    ours, theirs = GPT.twins(args.vocab, args.d, args.heads, args.layers, mesh)
    tokens_spec = NamedSharding(mesh, P(("dp", "tp")))
    rng = np.random.default_rng(1)

    @nnx.jit
    def step(model, optimizer, tokens, targets):
        loss, grads = nnx.value_and_grad(GPT.loss)(model, tokens, targets, args.seq)
        optimizer.update(model, grads)
        return loss

    curves, times = {}, {}
    # Something learnable: each sequence counts up (mod vocab) from a random start.
    batches = [(rng.integers(0, args.vocab, (args.batch, 1)) + np.arange(args.seq + 1)) %
               args.vocab for _ in range(args.steps)]
    for name, model in (("jaxtdist", ours), ("xla", theirs)):
        optimizer = nnx.Optimizer(model, optax.adam(args.lr), wrt=nnx.Param)
        curve, spent = [], []
        for batch in batches:
            batch = batch.astype(np.int32)
            tokens = jax.device_put(batch[:, :-1].reshape(-1), tokens_spec)
            targets = jax.device_put(batch[:, 1:].reshape(-1), tokens_spec)
            start = time.perf_counter()
            curve.append(float(step(model, optimizer, tokens, targets)))  # float() syncs
            spent.append(time.perf_counter() - start)
        curves[name] = curve
        times[name] = float(np.median(spent[1:])) if len(spent) > 1 else float("nan")
    return dict(curves=curves, times=times, mesh=dict(mesh.shape))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tiny", action="store_true", help="CPU-sized model and batch")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--tp", type=int, default=0, help="tensor-parallel size (default: "
                        "min(devices, 4))")
    args = parser.parse_args(argv)
    size = (dict(vocab=64, d=32, heads=4, layers=2, seq=8, batch=4, steps=6, lr=3e-3)
            if args.tiny else
            dict(vocab=32000, d=2048, heads=16, layers=4, seq=1024, batch=8, steps=20,
                 lr=3e-4))
    for key, value in size.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    result = train(args)
    print(f"mesh {result['mesh']}, {args.layers} layers, d={args.d}, "
          f"{args.batch} x {args.seq} tokens per step")
    print("step | loss (jaxtdist) | loss (XLA)")
    for i, (a, b) in enumerate(zip(result["curves"]["jaxtdist"], result["curves"]["xla"])):
        print(f"{i:4d} | {a:.6f} | {b:.6f}")
    if jax.devices()[0].platform == "gpu":
        # Host wall time per step (the step ends with a device-to-host read).
        print("median step time (host wall clock, after the first step): "
              + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in result["times"].items()))
    diff = max(abs(a - b) for a, b in zip(*result["curves"].values()))
    print(f"largest loss difference: {diff:.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
