"""all_gather's benchmark: ``jaxtdist.all_gather`` against ``jax.lax.all_gather``.

Per bytes per rank of ``shapes.ALL_GATHER_BYTES`` (bf16 rows of 1024 columns),
on ``--world`` devices (default: all): XLA's all_gather, and jaxtdist's with
launch alignment (the default) and without; every output checked bit for bit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxtdist.bench import harness as h
from jaxtdist.bench.shapes import ALL_GATHER_BYTES

COLS = 1024


def bench_all_gather(sizes, iterations: int, world: int, dtype=jnp.bfloat16,
                     rounds: int = 4) -> list[dict]:
    import jaxtdist as td

    mesh = jax.make_mesh((world,), ("tp",), devices=jax.devices()[:world],
                         axis_types=(jax.sharding.AxisType.Auto,))
    td.initialize(mesh)
    specs = dict(mesh=mesh, in_specs=P("tp", None), out_specs=P(None, None), check_vma=False)
    ours = jax.jit(jax.shard_map(lambda x: td.all_gather(x, "tp"), **specs))
    xla = jax.jit(jax.shard_map(lambda x: jax.lax.all_gather(x, "tp", tiled=True), **specs))
    rows = []
    for nbytes in sizes:
        rows_per_rank = max(1, nbytes // (COLS * jnp.dtype(dtype).itemsize))
        x = h.normal(nbytes, (world * rows_per_rank, COLS), dtype)
        xs = jax.device_put(x, NamedSharding(mesh, P("tp", None)))
        ref = np.asarray(x)
        row = dict(bytes_per_rank=nbytes, world=world, dtype=jnp.dtype(dtype).name,
                   rounds=rounds, size=float(nbytes), label=h.bytes_label(nbytes))
        row.update(h.interleaved(dict(
            xla_all_gather=h.Contender(xla, (xs,), world, ref, exact=True),
            jaxtdist=h.Contender(ours, (xs,), world, ref, exact=True, aligned=True),
            jaxtdist_unaligned=h.Contender(ours, (xs,), world, ref, exact=True, aligned=False)),
            iterations, rounds))
        rows.append(row)
        print(f"{nbytes:>10} | {h.us(row['xla_all_gather']):>9} | {h.us(row['jaxtdist']):>9} | "
              f"{h.us(row['jaxtdist_unaligned']):>9} | exact={_exact(row)}", flush=True)
    return rows


def _exact(row: dict) -> str:
    checks = [row.get(name, {}).get("exact") for name in ("jaxtdist", "jaxtdist_unaligned")]
    return "n/a" if None in checks else str(all(checks))


COLUMNS = [
    h.Column("bytes per rank", lambda r: str(r["bytes_per_rank"])),
    h.Column("jax.lax.all_gather", lambda r: h.us(r.get("xla_all_gather"))),
    h.Column("jaxtdist.all_gather", lambda r: h.us(r.get("jaxtdist"))),
    h.Column("jaxtdist, launches not aligned", lambda r: h.us(r.get("jaxtdist_unaligned"))),
    h.Column("jaxtdist / XLA", lambda r: h.ratio(r.get("jaxtdist"), r.get("xla_all_gather"))),
    h.Column("exact", _exact),
]


def table(res: dict) -> str:
    dtype = res["rows"][0].get("dtype", "bfloat16") if res["rows"] else "bfloat16"
    title = f"all_gather, {dtype}, {res['world']} x {res['device']}; {h.timing_note(res)}"
    return h.markdown_table(title, COLUMNS, res["rows"])


def run(args) -> tuple[list[dict], dict]:
    world = args.world or len(jax.devices())
    sizes = ALL_GATHER_BYTES[:3] if args.quick else ALL_GATHER_BYTES
    rows = bench_all_gather(sizes, args.iterations, world, rounds=args.rounds)
    import jaxtdist as td

    return rows, dict(world=world, launcher=getattr(td.runtime.runtime(), "launcher", None))


def _arguments(parser) -> None:
    parser.add_argument("--quick", action="store_true", help="first three sizes only")
    parser.add_argument("--world", type=int, default=0,
                        help="devices to run on (default: all)")


BENCHMARK = h.Benchmark(
    name="all_gather", op="all_gather", run=run, table=table,
    series=("jaxtdist", "xla_all_gather"), size_label="bytes per rank", arguments=_arguments)
