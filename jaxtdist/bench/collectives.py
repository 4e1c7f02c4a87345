"""The reductions' benchmarks: ``jaxtdist.all_reduce`` against ``jax.lax.psum`` and
``jaxtdist.reduce_scatter`` against ``jax.lax.psum_scatter``.

Per bytes per rank (16 KiB .. 64 MiB, issue 22's sizes; bf16 vectors), on
``--world`` devices (default: all). all_reduce is timed with its default
algorithm choice and with each algorithm forced, so that one run shows where
two-shot overtakes one-shot (``AllReduceConfig.ONE_SHOT_MAX_BYTES``). Every
output is checked against the float32 sum.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxtdist.bench import harness as h
from jaxtdist.bench.shapes import ALL_GATHER_BYTES as SIZES  # the same sizes per rank


def _setup(world: int):
    import jaxtdist as td

    mesh = jax.make_mesh((world,), ("tp",), devices=jax.devices()[:world],
                         axis_types=(jax.sharding.AxisType.Auto,))
    td.initialize(mesh)
    return mesh


def _inputs(mesh, nbytes: int, world: int, dtype):
    n = max(world, nbytes // jnp.dtype(dtype).itemsize)
    n -= n % world  # reduce_scatter needs a multiple of the world
    x = h.normal(nbytes, (world, n), dtype)
    xs = jax.device_put(x.reshape(-1), NamedSharding(mesh, P("tp")))
    total = np.asarray(x, np.float32).sum(0)
    return xs, total


def _row(nbytes: int, world: int, dtype, rounds: int) -> dict:
    return dict(bytes_per_rank=nbytes, world=world, dtype=jnp.dtype(dtype).name, rounds=rounds,
                size=float(nbytes), label=h.bytes_label(nbytes))


def bench_all_reduce(sizes, iterations: int, world: int, dtype=jnp.bfloat16,
                     rounds: int = 4) -> list[dict]:
    from jaxtdist.ops.all_reduce import all_reduce

    mesh = _setup(world)

    def fn(body):
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("tp"), out_specs=P()))

    xla = fn(lambda v: jax.lax.psum(v, "tp"))
    ours = {name: fn(lambda v, a=algorithm: all_reduce(v, "tp", config=None if a is None
                                                         else dict(ALGORITHM=a)))
            for name, algorithm in (("jaxtdist", None), ("jaxtdist_one_shot", "one_shot"),
                                    ("jaxtdist_one_shot_push", "one_shot_push"),
                                    ("jaxtdist_push_flags", "one_shot_push_flags"),
                                    ("jaxtdist_two_shot", "two_shot"))}
    rows = []
    for nbytes in sizes:
        xs, total = _inputs(mesh, nbytes, world, dtype)
        row = _row(nbytes, world, dtype, rounds)
        contenders = dict(xla_psum=h.Contender(xla, (xs,), world, total))
        contenders.update({name: h.Contender(f, (xs,), world, total, aligned=True)
                           for name, f in ours.items()})
        row.update(h.interleaved(contenders, iterations, rounds))
        rows.append(row)
        print(f"{nbytes:>10} | psum {h.us(row['xla_psum']):>8} | ours "
              f"{h.us(row['jaxtdist']):>8} | one-shot {h.us(row['jaxtdist_one_shot']):>8} | "
              f"two-shot {h.us(row['jaxtdist_two_shot']):>8} | err {h.err(row['jaxtdist'])}",
              flush=True)
    return rows


def bench_reduce_scatter(sizes, iterations: int, world: int, dtype=jnp.bfloat16,
                         rounds: int = 4) -> list[dict]:
    from jaxtdist.ops.reduce_scatter import reduce_scatter

    mesh = _setup(world)

    def fn(body):
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("tp"), out_specs=P("tp")))

    xla = fn(lambda v: jax.lax.psum_scatter(v, "tp", tiled=True))
    ours = fn(lambda v: reduce_scatter(v, "tp"))
    rows = []
    for nbytes in sizes:
        xs, total = _inputs(mesh, nbytes, world, dtype)  # blocks in rank order: the sum
        row = _row(nbytes, world, dtype, rounds)
        row.update(h.interleaved(dict(
            xla_psum_scatter=h.Contender(xla, (xs,), world, total),
            jaxtdist=h.Contender(ours, (xs,), world, total, aligned=True)), iterations, rounds))
        rows.append(row)
        print(f"{nbytes:>10} | psum_scatter {h.us(row['xla_psum_scatter']):>8} | ours "
              f"{h.us(row['jaxtdist']):>8} | err {h.err(row['jaxtdist'])}", flush=True)
    return rows


AR_COLUMNS = [
    h.Column("bytes per rank", lambda r: str(r["bytes_per_rank"])),
    h.Column("jax.lax.psum", lambda r: h.us(r.get("xla_psum"))),
    h.Column("jaxtdist.all_reduce", lambda r: h.us(r.get("jaxtdist"))),
    h.Column("one-shot", lambda r: h.us(r.get("jaxtdist_one_shot"))),
    h.Column("one-shot push (tagged words)", lambda r: h.us(r.get("jaxtdist_one_shot_push"))),
    h.Column("one-shot push (flags)", lambda r: h.us(r.get("jaxtdist_push_flags"))),
    h.Column("two-shot", lambda r: h.us(r.get("jaxtdist_two_shot"))),
    h.Column("jaxtdist / XLA", lambda r: h.ratio(r.get("jaxtdist"), r.get("xla_psum"))),
    h.Column("rel. error", lambda r: h.err(r.get("jaxtdist"))),
]

RS_COLUMNS = [
    h.Column("bytes per rank", lambda r: str(r["bytes_per_rank"])),
    h.Column("jax.lax.psum_scatter", lambda r: h.us(r.get("xla_psum_scatter"))),
    h.Column("jaxtdist.reduce_scatter", lambda r: h.us(r.get("jaxtdist"))),
    h.Column("jaxtdist / XLA", lambda r: h.ratio(r.get("jaxtdist"), r.get("xla_psum_scatter"))),
    h.Column("rel. error", lambda r: h.err(r.get("jaxtdist"))),
]


def _table(op: str, columns):
    def table(res: dict) -> str:
        dtype = res["rows"][0].get("dtype", "bfloat16") if res["rows"] else "bfloat16"
        title = f"{op}, {dtype}, {res['world']} x {res['device']}; {h.timing_note(res)}"
        return h.markdown_table(title, columns, res["rows"])
    return table


def _runner(bench_fn):
    def run(args) -> tuple[list[dict], dict]:
        world = args.world or len(jax.devices())
        sizes = args.sizes or (SIZES[:3] if args.quick else SIZES)
        rows = bench_fn(sizes, args.iterations, world, rounds=args.rounds)
        import jaxtdist as td

        return rows, dict(world=world, launcher=getattr(td.runtime.runtime(), "launcher", None))
    return run


def _arguments(parser) -> None:
    parser.add_argument("--quick", action="store_true", help="first three sizes only")
    parser.add_argument("--sizes", type=int, nargs="+", default=None,
                        help="bytes per rank to time (default: the standard sizes)")
    parser.add_argument("--world", type=int, default=0,
                        help="devices to run on (default: all)")


ALL_REDUCE = h.Benchmark(
    name="all_reduce", op="all_reduce", run=_runner(bench_all_reduce),
    table=_table("all_reduce", AR_COLUMNS), series=("jaxtdist", "xla_psum"),
    size_label="bytes per rank", arguments=_arguments)

REDUCE_SCATTER = h.Benchmark(
    name="reduce_scatter", op="reduce_scatter", run=_runner(bench_reduce_scatter),
    table=_table("reduce_scatter", RS_COLUMNS), series=("jaxtdist", "xla_psum_scatter"),
    size_label="bytes per rank", arguments=_arguments)
