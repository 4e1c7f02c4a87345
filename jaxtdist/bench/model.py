"""The model benchmark: a training step and a decode step of ``jaxtdist.nn.Llama``
(examples/llama.py's model: RMSNorm, RoPE, GQA, SwiGLU; with ``--size moe`` every
MLP is a Mixtral-style ``ParallelMoE``, its experts split over tp) against the same
model on XLA's collectives (``impl="xla"``).

On a (dp, tp) mesh of ``--world`` devices (tp = all of them by default), bf16
computation; kernel time per step from CUPTI (every kernel of the step summed per
device, averaged over devices, median over iterations). The training step is
value_and_grad plus an Adam update on float32 parameters; the decode step is one
token per sequence through the KV cache (the row-parallel layers then use
matmul_ar) on bf16 parameters, its logits from the parameters, the cache after
prefill and the token (the same step every call; the one-token cache write is not
carried to the next call). Both models start from the same parameters and their
outputs are compared (the first step's loss, the decode logits).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxtdist.bench import harness as h

SIZES = {  # name -> model and batch
    "small": dict(vocab=32000, d=2048, heads=16, kv_heads=4, hidden=5632, layers=4, seq=1024,
                  batch=8),
    "tiny": dict(vocab=256, d=64, heads=4, kv_heads=2, hidden=128, layers=2, seq=64, batch=4),
    # Mixtral's layer shape scaled down: 8 experts, top-2, every layer's MLP a ParallelMoE.
    "moe": dict(vocab=32000, d=2048, heads=16, kv_heads=4, hidden=5632, layers=4, seq=1024,
                batch=8, experts=8, top_k=2),
    "tiny-moe": dict(vocab=256, d=64, heads=4, kv_heads=2, hidden=128, layers=2, seq=64, batch=4,
                     experts=4, top_k=2),
}


def _config(a: dict):
    from jaxtdist.nn import LlamaConfig

    return LlamaConfig(vocab=a["vocab"], d_model=a["d"], num_layers=a["layers"],
                       num_heads=a["heads"], num_kv_heads=a["kv_heads"], hidden=a["hidden"],
                       num_experts=a.get("experts", 0), experts_per_token=a.get("top_k", 2))


def _steps(model_args: dict, mesh, decode_len: int):
    import optax
    from flax import nnx

    from jaxtdist.nn import Llama

    a = model_args
    cfg = _config(a)
    models = Llama.twins(cfg, mesh, dtype=jnp.bfloat16)
    tokens_spec = NamedSharding(mesh, P("dp", "tp"))
    rng = np.random.default_rng(0)
    batch = rng.integers(0, a["vocab"], (a["batch"], a["seq"] + 1)).astype(np.int32)
    tokens = jax.device_put(batch[:, :-1], tokens_spec)
    targets = jax.device_put(batch[:, 1:], tokens_spec)

    @nnx.jit
    def train_step(model, optimizer, tokens, targets):
        loss, grads = nnx.value_and_grad(Llama.loss)(model, tokens, targets)
        optimizer.update(model, grads)
        return loss

    @nnx.jit
    def prefill(model, tokens):
        return model(tokens)

    def decode_step(model):
        # The logits from parameters, cache and token, as a decoder with a donated
        # cache runs the step. Not nnx.jit: it returns every Variable, so each
        # call copied all parameters through (1 GB at the "small" size), work
        # that XLA ran as a memcpy kernel in some calls and on the copy engine
        # (out of CUPTI's kernel timing) in others, for either model alike.
        graphdef, state = nnx.split(model)
        return jax.jit(lambda st, token: nnx.merge(graphdef, st)(token, decode=True)), state

    step_token = jax.device_put(batch[:, -1:], NamedSharding(mesh, P("dp", None)))
    train, decode = {}, {}
    for name, model in zip(("jaxtdist", "xla"), models):
        optimizer = nnx.Optimizer(model, optax.adam(1e-4), wrt=nnx.Param)
        train[name] = (train_step, (model, optimizer, tokens, targets))
    # Decode on fresh twins (training moved the first pair's parameters apart only by
    # their rounding, but decode outputs are compared, so start equal) holding bf16
    # parameters, as a server loads them: with float32 ones each step would first
    # round every weight, which XLA folds into its dots and jaxtdist's kernels do
    # not (1.5 ms of the 2.6 of the "moe" size's step on one H200).
    for name, model in zip(("jaxtdist", "xla"),
                           Llama.twins(cfg, mesh, dtype=jnp.bfloat16,
                                       param_dtype=jnp.bfloat16)):
        model.init_cache(a["batch"], a["seq"] + decode_len)
        prefill(model, tokens)
        step, state = decode_step(model)
        decode[name] = (step, (state, step_token))
    return train, decode


def _describe(a: dict) -> str:
    moe = f", MoE {a['experts']} experts top-{a['top_k']}" if a.get("experts") else ""
    return (f"{a['layers']} x d{a['d']} GQA {a['heads']}/{a['kv_heads']}{moe}, "
            f"{a['batch']} x {a['seq']} tokens")


def bench_model(size: str, iterations: int, world: int, tp: int, rounds: int = 4) -> list[dict]:
    import jaxtdist as td

    tp = tp or world
    if world % tp:
        raise ValueError(f"jaxtdist.bench model: --tp {tp} must divide --world {world}")
    mesh = jax.make_mesh((world // tp, tp), ("dp", "tp"), devices=jax.devices()[:world])
    td.initialize(mesh)
    args = SIZES[size]
    # Room in the cache for the timed token after the prompt.
    train, decode = _steps(args, mesh, decode_len=8)
    rows = []
    for step, fns in (("train", train), ("decode", decode)):
        # Compared before timing: the first training step's loss, from equal parameters
        # (the timed steps train both models on one batch, which they soon memorize,
        # so later losses part by where each one's rounding led it).
        outs = {name: np.asarray(fn(*fargs), np.float32) for name, (fn, fargs) in fns.items()}
        stats = h.interleaved({name: h.Contender(fn, fargs, world)
                               for name, (fn, fargs) in fns.items()}, iterations, rounds)
        rows.append(dict(step=step, world=world, tp=tp, size=float(len(rows) + 1), label=step,
                         model=_describe(args), **stats,
                         output_rel_diff=h.rel_err(outs["jaxtdist"], outs["xla"])))
    return rows


COLUMNS = [
    h.Column("step", lambda r: r["step"]),
    h.Column("model", lambda r: r["model"]),
    h.Column("mesh (dp x tp)", lambda r: f"{r['world'] // r['tp']} x {r['tp']}"),
    h.Column("XLA model", lambda r: h.us(r.get("xla"))),
    h.Column("jaxtdist model", lambda r: h.us(r.get("jaxtdist"))),
    h.Column("jaxtdist / XLA", lambda r: h.ratio(r.get("jaxtdist"), r.get("xla"))),
    h.Column("output diff", lambda r: f"{r['output_rel_diff']:.1e}"),
]


def table(res: dict) -> str:
    return h.markdown_table(
        f"Llama training and decode step, bf16, {res['world']} x {res['device']}; "
        f"{h.timing_note(res)}; float32 parameters for training, bf16 for decode; output "
        "diff: relative difference of the first training step's loss or of the decode "
        "logits between the two models", COLUMNS, res["rows"])


def _arguments(parser) -> None:
    parser.add_argument("--world", type=int, default=0, help="devices (default: all)")
    parser.add_argument("--tp", type=int, default=0, help="tensor-parallel size (default: world)")
    parser.add_argument("--size", choices=sorted(SIZES), default="small")


def run(args) -> tuple[list[dict], dict]:
    world = args.world or len(jax.devices())
    return (bench_model(args.size, args.iterations, world, args.tp, rounds=args.rounds),
            dict(world=world))


BENCHMARK = h.Benchmark(name="model", op="model", run=run, table=table,
                        series=("jaxtdist", "xla"), size_label="step", arguments=_arguments)
