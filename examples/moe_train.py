"""Trains a tiny expert-parallel MoE layer with jaxtdist.moe_dispatch / moe_combine.

4 ranks over the mesh axis "ep", 8 experts (2 per rank), top-2 routing by a
learned router, experts as ``jax.lax.ragged_dot``; the target is a fixed random
MoE layer. Without GPUs it runs on 4 host devices under Triton's interpreter
(a minute or so). Prints the loss of each step on one batch; it falls.

    python examples/moe_train.py
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxtdist as td  # noqa: E402

WORLD, TOKENS, HIDDEN, EXPERTS, TOP_K = 4, 8, 16, 8, 2


def moe_layer(params, x):
    """x [T, H] this rank's tokens -> [T, H]. params["w"]: [E / W, H, H] local experts."""
    logits = x @ params["router"]                                  # [T, E], replicated router
    gate, ids = jax.lax.top_k(jax.nn.softmax(logits), TOP_K)      # [T, K]
    recv, sizes, handle = td.moe_dispatch(x, ids.astype(jnp.int32), "ep",
                                          num_experts=EXPERTS)
    y = jax.lax.ragged_dot(recv, params["w"], sizes)              # [R, H], the experts' work
    return td.moe_combine(y, handle, gate, "ep")


def main() -> None:
    mesh = jax.make_mesh((WORLD,), ("ep",), devices=jax.devices()[:WORLD])
    td.initialize(mesh)
    rng = np.random.default_rng(0)
    shard = lambda a, spec: jax.device_put(jnp.asarray(a, jnp.float32),  # noqa: E731
                                           NamedSharding(mesh, spec))
    specs = {"router": P(), "w": P("ep")}
    params = {"router": shard(rng.standard_normal((HIDDEN, EXPERTS)), P()),
              "w": shard(rng.standard_normal((EXPERTS, HIDDEN, HIDDEN)) * 0.1, P("ep"))}
    target = {"router": shard(rng.standard_normal((HIDDEN, EXPERTS)), P()),
              "w": shard(rng.standard_normal((EXPERTS, HIDDEN, HIDDEN)) * 0.3, P("ep"))}

    def loss(params, target, x):
        err = moe_layer(params, x) - jax.lax.stop_gradient(moe_layer(target, x))
        return jax.lax.pmean(jnp.mean(err ** 2), "ep")

    @jax.jit
    def step(params, target, x):
        value, grads = jax.shard_map(jax.value_and_grad(loss), mesh=mesh,
                                     in_specs=(specs, specs, P("ep")),
                                     out_specs=(P(), specs))(params, target, x)
        return value, jax.tree.map(lambda p, g: p - 0.2 * g, params, grads)

    x = shard(rng.standard_normal((WORLD * TOKENS, HIDDEN)), P("ep"))  # one batch
    for i in range(10):
        value, params = step(params, target, x)
        print(f"step {i}: loss {float(value):.4f}", flush=True)


if __name__ == "__main__":
    main()
