"""Kernel time of jaxtdist's ops against XLA's, in either process layout.

  python tests/multiprocess/bench_layouts.py                       # one process, every GPU
  python -m jaxtdist.launch --nproc-per-node 2 tests/multiprocess/bench_layouts.py  # one per GPU

CUPTI kernel time (``jaxtdist.bench.harness``: median over interleaved rounds,
per GPU, averaged over this process's GPUs), bf16; each jaxtdist output
checked against XLA's (relative error over this process's shards). Process 0
prints a markdown table and, with --json, writes the rows.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jaxtdist.launch  # noqa: E402

if os.environ.get(jaxtdist.launch.ENV_PROCESS_ID) is not None:
    jaxtdist.launch.initialize_from_env()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxtdist as td  # noqa: E402
from jaxtdist.bench import harness as h  # noqa: E402


def place(mesh, x: np.ndarray, spec) -> jax.Array:
    return jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec), lambda i: x[i])


def shard_err(out: jax.Array, ref: jax.Array) -> float:
    worst = 0.0
    for a, b in zip(out.addressable_shards, ref.addressable_shards):
        x, y = np.asarray(a.data, np.float64), np.asarray(b.data, np.float64)
        worst = max(worst, float(np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-30)))
    return worst


def rand(seed: int, shape) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(jnp.bfloat16)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iterations", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    world = jax.device_count()
    mesh = jax.make_mesh((world,), ("tp",), axis_types=(jax.sharding.AxisType.Auto,))
    rt = td.initialize(mesh)
    layout = (f"{jax.process_count()} processes x 1 GPU" if jax.process_count() > 1
              else f"1 process x {world} GPUs")
    local = len(jax.local_devices())
    sm = lambda f, i, o: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=i, out_specs=o,
                                               check_vma=False))
    cases = []
    for m, k, n in ((4096, 4096, 8192), (1024, 8192, 8192)):
        x, w = rand(1, (m, k)), rand(2, (k, n))
        cases.append((f"ag_matmul {m}x{n}x{k}",
                      sm(lambda a, b: td.ag_matmul(a, b, "tp"), (P("tp"), P(None, "tp")),
                         P(None, "tp")),
                      sm(lambda a, b: jax.lax.all_gather(a, "tp", tiled=True) @ b,
                         (P("tp"), P(None, "tp")), P(None, "tp")),
                      (place(mesh, x, P("tp")), place(mesh, w, P(None, "tp")))))
    for m, k, n in ((4096, 8192, 4096),):
        x, w = rand(3, (m, k)), rand(4, (k, n))
        cases.append((f"matmul_rs {m}x{n}x{k}",
                      sm(lambda a, b: td.matmul_rs(a, b, "tp"), (P(None, "tp"), P("tp")),
                         P("tp")),
                      sm(lambda a, b: jax.lax.psum_scatter(a @ b, "tp", tiled=True),
                         (P(None, "tp"), P("tp")), P("tp")),
                      (place(mesh, x, P(None, "tp")), place(mesh, w, P("tp")))))
    for nbytes in (1 << 20, 16 << 20):
        rows = nbytes // 2048
        x = rand(5, (world * rows, 1024))
        cases.append((f"all_gather {nbytes >> 20} MiB/rank",
                      sm(lambda a: td.all_gather(a, "tp"), P("tp"), P()),
                      sm(lambda a: jax.lax.all_gather(a, "tp", tiled=True), P("tp"), P()),
                      (place(mesh, x, P("tp")),)))
    for nbytes in (1 << 20, 16 << 20):
        x = rand(6, (world * nbytes // 2048, 1024))
        cases.append((f"all_reduce {nbytes >> 20} MiB",
                      sm(lambda a: td.all_reduce(a, "tp"), P("tp"), P("tp")),
                      sm(lambda a: jax.lax.psum(a, "tp"), P("tp"), P("tp")),
                      (place(mesh, x, P("tp")),)))
    rows = []
    for name, ours, xla, operands in cases:
        stats = h.interleaved({"jaxtdist": h.Contender(ours, operands, local),
                               "xla": h.Contender(xla, operands, local)},
                              args.iterations, args.rounds)
        err = shard_err(ours(*operands), xla(*operands))
        rows.append(dict(op=name, layout=layout, jaxtdist_us=stats["jaxtdist"].get("mean_us"),
                         xla_us=stats["xla"].get("mean_us"), rel_err_vs_xla=err,
                         errors={k: v["error"] for k, v in stats.items() if "error" in v}))
    if jax.process_index() == 0:
        print(f"\n{layout}, {jax.devices()[0].device_kind}, backend {rt.backend_name}, "
              f"CUPTI kernel time (us, median), bf16\n")
        print("| op | jaxtdist | XLA | XLA / jaxtdist | rel err vs XLA |")
        print("|---|---|---|---|---|")
        for r in rows:
            a, b = r["jaxtdist_us"], r["xla_us"]
            speed = f"{b / a:.2f}" if a and b else "n/a"
            print(f"| {r['op']} | {a and round(a, 1)} | {b and round(b, 1)} | {speed} | "
                  f"{r['rel_err_vs_xla']:.1e} |" + (f" {r['errors']}" if r["errors"] else ""))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
    td.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
