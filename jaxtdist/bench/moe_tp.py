"""moe_tp_mlp's benchmark: jaxtdist's tensor-parallel MoE MLP against the same layer
on XLA's collectives.

``python -m jaxtdist.bench moe_tp [--world W]``, per (tokens per rank, H, F, E, K)
of ``shapes.MOE_TP_SHAPES`` (bf16, SwiGLU): ``jaxtdist.moe_tp_mlp`` with its default
schedule, and with each schedule forced (``overlap=False``: jaxtdist's all_gather
and reduce_scatter around its grouped GEMMs, on GPUs ``jaxtdist.grouped_matmul``;
``overlap=True``: the gather and the reduce-scatter fused into the grouped GEMMs)
against the XLA twin (``jax.lax.all_gather``,
``jax.lax.ragged_dot``, ``jax.lax.psum_scatter``), both
checked against a float32 dense computation of the same layer on the device.
At world 1 both are the local layer (the gathers and the sum are identities).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxtdist.bench import harness as h
from jaxtdist.bench.shapes import MOE_TP_SHAPES

TOKENS, W_IN, W_OUT = P("tp", None), P(None, None, "tp"), P(None, "tp", None)
SPECS = (TOKENS, TOKENS, TOKENS, W_IN, W_OUT, W_IN)


def _xla_twin(x, ids, gate, w1, w2, w3):
    """The same layer on XLA's collectives (what a JAX user writes today): the same
    expert computation between ``jax.lax.all_gather`` and ``psum_scatter``."""
    from jaxtdist.ops.moe_tp import experts_partial_sum

    xs = jax.lax.all_gather(x, "tp", tiled=True)
    flat_ids = jax.lax.all_gather(ids, "tp", tiled=True).reshape(-1)
    flat_gate = jax.lax.all_gather(gate.astype(jnp.float32), "tp", tiled=True).reshape(-1)
    part = experts_partial_sum(xs, flat_ids, flat_gate, ids.shape[1], w1, w2, w3, jax.nn.silu,
                               grouped_gemm="ragged_dot")
    return jax.lax.psum_scatter(part, "tp", tiled=True).astype(x.dtype)


def _reference(x, ids, gate, w1, w2, w3) -> np.ndarray:
    """float32, dense over each token's experts, on the first device."""
    @jax.jit
    def dense(x, ids, gate, w1, w2, w3):
        f32 = [a.astype(jnp.float32) for a in (x, w1, w2, w3)]
        x, w1, w2, w3 = f32
        hid = jax.nn.silu(jnp.einsum("th,tkhf->tkf", x, w1[ids], precision="highest"))
        hid = hid * jnp.einsum("th,tkhf->tkf", x, w3[ids], precision="highest")
        return jnp.einsum("tkf,tkfh,tk->th", hid, w2[ids], gate, precision="highest")

    # One token block at a time: w1[ids] for every token would not fit.
    out = [np.asarray(dense(x[i:i + 64], ids[i:i + 64], gate[i:i + 64], w1, w2, w3))
           for i in range(0, x.shape[0], 64)]
    return np.concatenate(out)


GRAD_SPECS = (TOKENS, TOKENS, W_IN, W_OUT, W_IN)  # of x, the weights, w1, w2, w3


def _training_step(layer, mesh):
    """The gradients of sum(layer * ct) in x, the routing weights and the experts: a
    training step's forward and backward."""
    def step(x, ids, gate, w1, w2, w3, ct):
        def loss(x, gate, w1, w2, w3):
            return jnp.sum(layer(x, ids, gate, w1, w2, w3).astype(jnp.float32) * ct)
        return jax.grad(loss, argnums=(0, 1, 2, 3, 4))(x, gate, w1, w2, w3)

    return jax.jit(jax.shard_map(step, mesh=mesh, in_specs=SPECS + (TOKENS,),
                                 out_specs=GRAD_SPECS))


def bench_moe_tp(shapes, iterations: int, world: int, rounds: int = 4,
                 dtype=jnp.bfloat16, train: bool = False) -> list[dict]:
    import jaxtdist as td

    mesh = jax.make_mesh((world,), ("tp",), devices=jax.devices()[:world],
                         axis_types=(jax.sharding.AxisType.Auto,))
    td.initialize(mesh)
    specs = dict(mesh=mesh, in_specs=SPECS, out_specs=TOKENS)
    def layer(overlap):
        return jax.jit(jax.shard_map(lambda x, i, g, a, b, c: td.moe_tp_mlp(
            x, i, g, a, b, "tp", w_up=c, overlap=overlap), **specs))

    fns = dict(jaxtdist=layer(None), steps=layer(False), overlapped=layer(True),
               xla=jax.jit(jax.shard_map(_xla_twin, **specs)))
    trains = {}
    if train:  # under jax.grad every jaxtdist schedule is the steps' (moe_tp_mlp)
        trains = dict(jaxtdist_train=_training_step(lambda x, i, g, a, b, c: td.moe_tp_mlp(
            x, i, g, a, b, "tp", w_up=c), mesh), xla_train=_training_step(_xla_twin, mesh))
    rows = []
    for n, (t, hidden, ffn, e, k) in enumerate(shapes):
        rng = np.random.default_rng(1500 + n)
        x = h.normal(1510 + n, (world * t, hidden), dtype)
        ids = jnp.asarray(np.argsort(rng.random((world * t, e)), 1)[:, :k].astype(np.int32))
        gate = jnp.asarray(rng.random((world * t, k), np.float32))
        w1, w3 = (h.normal(1520 + 2 * n + j, (e, hidden, ffn), dtype, scale=hidden ** -0.5)
                  for j in range(2))
        w2 = h.normal(1530 + n, (e, ffn, hidden), dtype, scale=ffn ** -0.5)
        arrays = (x, ids, gate, w1, w2, w3)
        args = tuple(jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(arrays, SPECS))
        ref = _reference(*arrays)
        flops = 2.0 * world * t * k * hidden * ffn * 3
        row = dict(tokens=t, hidden=hidden, ffn=ffn, experts=e, top_k=k, world=world,
                   dtype=jnp.dtype(dtype).name, rounds=rounds, size=float(t), flops=flops,
                   label=f"T={t}")
        contenders = {name: h.Contender(fn, args, world, ref) for name, fn in fns.items()}
        if trains:
            ct = h.normal(1540 + n, (world * t, hidden), jnp.float32)
            targs = args + (jax.device_put(ct, NamedSharding(mesh, TOKENS)),)
            # bf16 gradients against XLA's (no float32 reference of the backward here).
            xla_grads = [np.asarray(g, np.float32) for g in trains["xla_train"](*targs)]
            contenders.update({name: h.Contender(fn, targs, world, xla_grads)
                               for name, fn in trains.items()})
        row.update(h.interleaved(contenders, iterations, rounds))
        rows.append(row)
        print(f"moe_tp T={t} H={hidden} F={ffn} E={e} K={k} world={world}: " + " | ".join(
            f"{name} {h.us(row.get(name))}" for name in contenders), flush=True)
    return rows


COLUMNS = [
    h.Column("tokens per rank", lambda r: str(r["tokens"])),
    h.Column("H, F, E, top-K", lambda r: f"{r['hidden']}, {r['ffn']}, {r['experts']}, "
                                         f"top-{r['top_k']}"),
    h.Column("XLA collectives", lambda r: h.us(r.get("xla"))),
    h.Column("jaxtdist, steps", lambda r: h.us(r.get("steps"))),
    h.Column("jaxtdist, overlapped", lambda r: h.us(r.get("overlapped"))),
    h.Column("jaxtdist.moe_tp_mlp (default)", lambda r: h.us(r.get("jaxtdist"))),
    h.Column("default / XLA", lambda r: h.ratio(r.get("jaxtdist"), r.get("xla"))),
    h.Column("rel err (steps)", lambda r: h.err(r.get("steps"))),
    h.Column("rel err (overlapped)", lambda r: h.err(r.get("overlapped"))),
    h.Column("rel err (XLA)", lambda r: h.err(r.get("xla"))),
]
TRAIN_COLUMNS = [
    h.Column("tokens per rank", lambda r: str(r["tokens"])),
    h.Column("training step, XLA collectives", lambda r: h.us(r.get("xla_train"))),
    h.Column("training step, jaxtdist", lambda r: h.us(r.get("jaxtdist_train"))),
    h.Column("jaxtdist / XLA", lambda r: h.ratio(r.get("jaxtdist_train"), r.get("xla_train"))),
    h.Column("gradients' rel diff to XLA's", lambda r: h.err(r.get("jaxtdist_train"))),
]


def table(res: dict) -> str:
    out = h.markdown_table(
        f"moe_tp_mlp (SwiGLU experts, FFN over tp), bfloat16, {res['world']} x "
        f"{res['device']}; {h.timing_note(res)}", COLUMNS, res["rows"])
    if any("xla_train" in r for r in res["rows"]):
        out += "\n\n" + h.markdown_table(
            "Training step (jax.grad in x, routing weights and experts; "
            f"{h.timing_note(res)})", TRAIN_COLUMNS, res["rows"])
    return out


def run(args) -> tuple[list[dict], dict]:
    world = args.world or len(jax.devices())
    shapes = MOE_TP_SHAPES[:1] if args.quick else MOE_TP_SHAPES
    return bench_moe_tp(shapes, args.iterations, world, rounds=args.rounds,
                        train=args.train), dict(world=world)


def _arguments(parser) -> None:
    parser.add_argument("--world", type=int, default=0, help="devices (default: all)")
    parser.add_argument("--quick", action="store_true", help="the first size only")
    parser.add_argument("--train", action="store_true",
                        help="also a training step (forward and backward) of each")


BENCHMARK = h.Benchmark(name="moe_tp", op="moe_tp_mlp", run=run, table=table,
                        series=("jaxtdist", "steps", "overlapped", "xla"), size_label="tokens per rank",
                        arguments=_arguments)
