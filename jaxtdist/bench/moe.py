"""moe's benchmark: ``jaxtdist.moe_dispatch`` + ``moe_combine`` at world 1.

``python -m jaxtdist.bench moe``, per (tokens, hidden, top_k, experts) of
``shapes.MOE_SHAPES`` (bf16, one device): the op at world 1 is its local
computation, pure JAX (a scatter into the expert-major layout, then a
weighted gather), which is the reference the kernels are held to; the
kernels forced at world 1 (``moe_dispatch_kernels`` / ``moe_combine_kernels``:
what a group of several ranks runs, communication aside) are timed for
dispatch alone and for dispatch + combine. The experts are the identity
(y = recv_x), so combine's output is x times the sum of its token's weights,
checked against float32. Also ``jax.lax.ragged_dot`` on the received groups
(the experts' GEMM with w [E, H, H/4]), for scale.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxtdist.bench import harness as h
from jaxtdist.bench.shapes import MOE_SHAPES

# The combine inbox holds T * K rows per call parity (940 MB at 4096 x 8 x 7168
# bf16): more than the default 1 GiB heap with the dispatch's inbox beside it.
HEAP_BYTES = 4 << 30


def _routing(seed: int, t: int, k: int, e: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.argsort(rng.random((t, e)), axis=1)[:, :k].astype(np.int32)


def bench_moe(shapes, iterations: int, rounds: int = 4, dtype=jnp.bfloat16) -> list[dict]:
    import jaxtdist as td
    from jaxtdist.ops.moe import moe_combine_kernels, moe_dispatch_kernels

    device = jax.devices()[0]
    mesh = jax.make_mesh((1,), ("ep",), devices=[device],
                         axis_types=(jax.sharding.AxisType.Auto,))
    td.initialize(mesh, heap_bytes=HEAP_BYTES)
    rows = []
    for i, (t, hidden, k, e) in enumerate(shapes):
        specs = dict(mesh=mesh, in_specs=(P(), P(), P()), out_specs=P(), check_vma=False)

        def op_dispatch(x, ids, w):
            return td.moe_dispatch(x, ids, "ep", num_experts=e)[0]

        def op_layer(x, ids, w):
            recv, _, handle = td.moe_dispatch(x, ids, "ep", num_experts=e)
            return td.moe_combine(recv, handle, w, "ep")

        def kernel_dispatch(x, ids, w):
            return moe_dispatch_kernels(x, ids, "ep", num_experts=e)[0]

        def kernel_layer(x, ids, w):
            recv, _, handle = moe_dispatch_kernels(x, ids, "ep", num_experts=e)
            return moe_combine_kernels(recv, handle, w, "ep")

        fns = {name: jax.jit(jax.shard_map(body, **specs)) for name, body in (
            ("reference_dispatch", op_dispatch), ("reference_layer", op_layer),
            ("kernels_dispatch", kernel_dispatch), ("kernels_layer", kernel_layer))}
        x = h.normal(1100 + i, (t, hidden), dtype)
        ids = jnp.asarray(_routing(1200 + i, t, k, e))
        w = jnp.asarray(np.random.default_rng(1300 + i).random((t, k), np.float32))
        args = tuple(jax.device_put(a, device) for a in (x, ids, w))
        ref = np.asarray(x, np.float32) * np.asarray(w).sum(1, keepdims=True)
        recv_ref = np.asarray(fns["reference_dispatch"](*args))
        # The experts' GEMM on the received groups, for scale (H -> H / 4).
        local_sizes = jax.jit(jax.shard_map(
            lambda x, ids, w: td.moe_dispatch(x, ids, "ep", num_experts=e)[1], **specs))(*args)
        wexp = h.normal(1400 + i, (e, hidden, hidden // 4), dtype, scale=hidden ** -0.5)
        ragged = jax.jit(jax.lax.ragged_dot)
        recv_dev = jax.device_put(jnp.asarray(recv_ref), device)
        row = dict(tokens=t, hidden=hidden, top_k=k, experts=e, world=1,
                   dtype=jnp.dtype(dtype).name, rounds=rounds, size=float(t),
                   label=f"T={t}")
        row.update(h.interleaved(dict(
            reference_dispatch=h.Contender(fns["reference_dispatch"], args, 1),
            kernels_dispatch=h.Contender(fns["kernels_dispatch"], args, 1, recv_ref,
                                         exact=True),
            reference_layer=h.Contender(fns["reference_layer"], args, 1, ref),
            kernels_layer=h.Contender(fns["kernels_layer"], args, 1, ref),
            ragged_dot=h.Contender(ragged, (recv_dev, wexp, local_sizes), 1)),
            iterations, rounds))
        rows.append(row)
        print(f"moe T={t} H={hidden} K={k} E={e}: " + " | ".join(
            f"{name} {h.us(row.get(name))}" for name in
            ("reference_dispatch", "kernels_dispatch", "reference_layer", "kernels_layer",
             "ragged_dot")), flush=True)
    return rows


COLUMNS = [
    h.Column("T x H, top-K, E", lambda r: f"{r['tokens']} x {r['hidden']}, top-{r['top_k']}, "
                                          f"{r['experts']}"),
    h.Column("dispatch: pure JAX", lambda r: h.us(r.get("reference_dispatch"))),
    h.Column("dispatch: kernels", lambda r: h.us(r.get("kernels_dispatch"))),
    h.Column("ratio", lambda r: h.ratio(r.get("kernels_dispatch"), r.get("reference_dispatch"))),
    h.Column("dispatch + combine: pure JAX", lambda r: h.us(r.get("reference_layer"))),
    h.Column("dispatch + combine: kernels", lambda r: h.us(r.get("kernels_layer"))),
    h.Column("ratio ", lambda r: h.ratio(r.get("kernels_layer"), r.get("reference_layer"))),
    h.Column("ragged_dot (H -> H/4)", lambda r: h.us(r.get("ragged_dot"))),
    h.Column("exact dispatch", lambda r: h.err(r.get("kernels_dispatch"))),
    h.Column("rel err layer", lambda r: h.err(r.get("kernels_layer"))),
]


def table(res: dict) -> str:
    return h.markdown_table(
        f"moe dispatch + combine at world 1, bfloat16, 1 x {res['device']}; "
        f"{h.timing_note(res)}. Pure JAX = the op's local computation", COLUMNS, res["rows"])


def run(args) -> tuple[list[dict], dict]:
    shapes = MOE_SHAPES[:1] if args.quick else MOE_SHAPES
    return bench_moe(shapes, args.iterations, rounds=args.rounds), dict(world=1)


def _arguments(parser) -> None:
    parser.add_argument("--quick", action="store_true", help="the first size only")


BENCHMARK = h.Benchmark(
    name="moe", op="moe", run=run, table=table,
    series=("kernels_layer", "reference_layer", "kernels_dispatch", "reference_dispatch"),
    size_label="tokens per rank", arguments=_arguments)
