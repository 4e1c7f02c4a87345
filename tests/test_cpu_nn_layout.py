"""jaxtdist.nn's activations stay where they are: [batch, seq, d] arriving
sequence parallel, ``P(batch_axes, axis_name, None)``, leaves each layer the same
way, and the compiled layer holds no XLA collective (jaxtdist's ops move the
data), also on a mesh with no batch axes and when a data-parallel group holds
several sequences (the layers' token order, ``Layout.flatten``)."""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

flax = pytest.importorskip("flax")
from flax import nnx  # noqa: E402

import jaxtdist as td  # noqa: E402
from jaxtdist import nn as tdnn  # noqa: E402
from jaxtdist.runtime import DEFAULT_HEAP_BYTES  # noqa: E402

_COLLECTIVE = re.compile(r" (all-gather|all-to-all|collective-permute|all-reduce|"
                         r"reduce-scatter)(?:-start)?\(")

D = 16


LAYERS = {
    "mlp": lambda: tdnn.ParallelMLP(D, 32, rngs=nnx.Rngs(0)),
    "attention": lambda: tdnn.ParallelAttention(D, 4, num_kv_heads=2, rngs=nnx.Rngs(0)),
    "moe_expert": lambda: tdnn.ParallelMoE(D, 24, num_experts=4, top_k=2, rngs=nnx.Rngs(0)),
    "moe_capacity": lambda: tdnn.ParallelMoE(D, 24, num_experts=4, top_k=2, capacity_factor=1.0,
                                             rngs=nnx.Rngs(0)),
    "moe_tensor": lambda: tdnn.ParallelMoE(D, 24, num_experts=4, top_k=2,
                                           parallelism="tensor", rngs=nnx.Rngs(0)),
    "llama": lambda: tdnn.Llama(tdnn.LlamaConfig(vocab=48, d_model=D, num_layers=1, num_heads=4,
                                                 num_kv_heads=2, hidden=32), rngs=nnx.Rngs(0)),
}


@pytest.mark.parametrize("layer", sorted(LAYERS))
@pytest.mark.parametrize("mesh_shape,names,batch,explicit", [
    ((2,), ("tp",), 2, True), ((2, 2), ("dp", "tp"), 4, False), ((1, 2), ("dp", "tp"), 2, True)])
def test_sequence_parallel_activations_do_not_move(layer, mesh_shape, names, batch, explicit):
    types = (jax.sharding.AxisType.Explicit if explicit else jax.sharding.AxisType.Auto,)
    mesh = jax.make_mesh(mesh_shape, names, axis_types=types * len(names),
                         devices=jax.devices()[:int(np.prod(mesh_shape))])
    td.initialize(mesh, heap_bytes=DEFAULT_HEAP_BYTES["cpu"])
    rows = "dp" if "dp" in names else None
    rng = np.random.default_rng(0)
    if layer == "llama":
        x = jax.device_put(rng.integers(0, 48, (batch, 8)).astype(np.int32),
                           NamedSharding(mesh, P(rows, "tp")))
    else:
        x = jax.device_put(rng.standard_normal((batch, 8, D)).astype(np.float32),
                           NamedSharding(mesh, P(rows, "tp", None)))
    graph, state = nnx.split(LAYERS[layer]())
    compiled = jax.jit(lambda s, x: nnx.merge(graph, s)(x)).lower(state, x).compile()
    assert _COLLECTIVE.findall(compiled.as_text()) == []
    spec = tuple(compiled.output_shardings.spec)
    assert spec[:2] == (rows, "tp") and all(e is None for e in spec[2:]), spec


_GATHER = re.compile(r"= \w+\[([\d,]*)\][^=]* all-gather(?:-start)?\(")


@pytest.mark.parametrize("parallelism", ["expert", "tensor"])
@pytest.mark.parametrize("batch,explicit", [(4, True), (6, False)])
def test_moe_decode_keeps_tokens_in_their_group(parallelism, batch, explicit):
    """A decode step's tokens (one per sequence, on every tensor-parallel rank of
    their data-parallel group) spread over the group's ranks and come back within
    it: the step's one XLA collective gathers a group's batch / dp outputs (padded
    to a multiple of tp), not the whole batch."""
    types = (jax.sharding.AxisType.Explicit if explicit else jax.sharding.AxisType.Auto,) * 2
    mesh = jax.make_mesh((2, 2), ("dp", "tp"), axis_types=types, devices=jax.devices()[:4])
    td.initialize(mesh, heap_bytes=DEFAULT_HEAP_BYTES["cpu"])
    layer = tdnn.ParallelMoE(D, 24, num_experts=4, top_k=2, parallelism=parallelism,
                             rngs=nnx.Rngs(0))
    x = jax.device_put(np.random.default_rng(1).standard_normal((batch, 1, D)).astype(np.float32),
                       NamedSharding(mesh, P("dp", None, None)))
    graph, state = nnx.split(layer)
    compiled = jax.jit(lambda s, x: nnx.merge(graph, s)(x, decode=True)).lower(state, x).compile()
    text = compiled.as_text()
    assert _COLLECTIVE.findall(text) == ["all-gather"], _COLLECTIVE.findall(text)
    (dims,) = _GATHER.findall(text)
    group = -(-batch // 2 // 2) * 2  # a group's tokens, padded to a multiple of tp
    assert np.prod([int(d) for d in dims.split(",")]) == group * D, dims
    assert tuple(compiled.output_shardings.spec)[:1] == ("dp",)


@pytest.mark.parametrize("layer", ["mlp", "attention"])
def test_input_only_backward_sums_no_weight_gradient(layer):
    """A backward pass that asks for the input's gradient only (frozen weights)
    computes no weight gradient: no XLA all-reduce of one over the data-parallel
    axis is left in the program (the ops' order dependencies are made from the
    input's cotangent where it fits, not from a weight's)."""
    mesh = jax.make_mesh((2, 2), ("dp", "tp"), axis_types=(jax.sharding.AxisType.Explicit,) * 2,
                         devices=jax.devices()[:4])
    td.initialize(mesh, heap_bytes=DEFAULT_HEAP_BYTES["cpu"])
    x = jax.device_put(np.random.default_rng(2).standard_normal((4, 8, D)).astype(np.float32),
                       NamedSharding(mesh, P("dp", "tp", None)))
    graph, state = nnx.split(LAYERS[layer]())
    dx = jax.jit(jax.grad(lambda x, s: (nnx.merge(graph, s)(x) ** 2).sum()))
    compiled = dx.lower(x, state).compile()
    assert _COLLECTIVE.findall(compiled.as_text()) == []
    assert np.abs(np.asarray(dx(x, state))).max() > 0
