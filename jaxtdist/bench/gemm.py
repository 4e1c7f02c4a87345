"""The GEMM core at world 1: every matmul kernel family against ``jnp.dot``.

``python -m jaxtdist.bench gemm``: per (op, m, n, k) of ``shapes.GEMM_SHAPES``
(bf16, real models' tensor-parallel layers), one device, a fresh empty tuning
cache (default configs): ``jnp.dot`` of the same operands against the op's
kernels forced at world 1 (``ag_matmul_with_gathered``, ``matmul_rs_kernels``,
``matmul_ar_kernels``), which are the kernels a group of several ranks runs,
communication aside. Relative errors of both against a float32 product.
``--sweep`` also times a few tile overrides per shape (to fit the default rule).
Each row also records the host time of each contender's first call (tracing
and compiling included; with a warm Triton disk cache, less than a user's
first run).
"""

from __future__ import annotations

import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxtdist.bench import harness as h
from jaxtdist.bench.random_shapes import gemm_problems
from jaxtdist.bench.shapes import GEMM_SHAPES

# x's and w's specs per op at world 1 (what the ops' shard_maps take).
_SPECS = {"ag_matmul": (P("tp", None), P(None, "tp")),
          "matmul_rs": (P(None, "tp"), P("tp", None)),
          "matmul_ar": (P(None, "tp"), P("tp", None))}
def _tile(bm: int, bn: int, stages: int | None = None, warps: int | None = None,
          **extra) -> dict:
    """A full tile override (warps, stages and epilogue cut that fit it)."""
    from jaxtdist.ops._gemm_config import stages_for

    sub = 4 if bn == 256 else 2
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=64, SUBTILE=sub,
                num_warps=warps or (8 if bm * bn > 128 * 128 else 4),
                num_stages=stages or stages_for(bm, bn, 64, 2, sub), **extra)


def _decode(bn: int, bk: int, split_k: int, stages: int, **extra) -> dict:
    """An override of ag_matmul's decode kernel (one tile over all rows, split K)."""
    return dict(BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split_k, num_stages=stages, **extra)


def _sweep(op: str, m: int) -> list[dict]:
    """The overrides ``--sweep`` times for one shape: the core's tiles and depths, or
    the decode kernels' N width, K step and split."""
    if op == "matmul_ar":
        # Pointer loads too (TMA=False): one program per tile builds its descriptors
        # on the device, a cost a 4-7 us decode GEMM may feel.
        return [dict(BLOCK_N=bn, BLOCK_K=bk, num_stages=s)
                for bn, bk, s in ((64, 128, 4), (128, 128, 3), (128, 64, 5), (64, 256, 3),
                                  (32, 256, 3), (256, 64, 4))] + [
                    dict(TMA=False), dict(TMA=False, BLOCK_K=64, num_stages=5),
                    dict(TMA=False, BLOCK_N=128, BLOCK_K=64, num_stages=4)]
    if op == "ag_matmul" and m <= 128:
        return [_decode(64, 128, 4, 4), _decode(128, 128, 4, 3), _decode(64, 256, 2, 3),
                _decode(128, 64, 8, 4), _decode(64, 64, 8, 6), _decode(32, 256, 4, 3),
                _decode(64, 128, 2, 4), _decode(128, 128, 2, 4), _decode(32, 128, 2, 4),
                _decode(64, 64, 4, 6)]
    sweep = [_tile(128, 256), _tile(128, 256, stages=3), _tile(128, 128),
             _tile(128, 128, warps=4), _tile(64, 256), _tile(64, 128)]
    if op == "ag_matmul":
        sweep += [_tile(128, 256, FLATTEN=False), _tile(128, 128, FLATTEN=True, GROUP_M=16)]
    else:
        sweep += [_tile(128, 256, FLATTEN=False), _tile(128, 128, FLATTEN=False)]
    return sweep


def _kernel_fn(op: str, mesh, config: dict | None):
    from jaxtdist.ops.ag_matmul import ag_matmul_with_gathered
    from jaxtdist.ops.matmul_rs import matmul_ar_kernels, matmul_rs_kernels

    fn = {"ag_matmul": lambda x, w: ag_matmul_with_gathered(x, w, "tp", config=config,
                                                            gathered=False)[0],
          "matmul_rs": lambda x, w: matmul_rs_kernels(x, w, "tp", config=config),
          "matmul_ar": lambda x, w: matmul_ar_kernels(x, w, "tp", config=config)}[op]
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=_SPECS[op], out_specs=P(),
                                 check_vma=False))


def _first_call_s(fn, args) -> float:
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - t0


def bench_gemm(shapes, iterations: int, rounds: int = 4, sweep: bool = False) -> list[dict]:
    import jaxtdist as td

    mesh = jax.make_mesh((1,), ("tp",), devices=jax.devices()[:1],
                         axis_types=(jax.sharding.AxisType.Auto,))
    td.initialize(mesh)
    device = jax.devices()[0]
    dot = jax.jit(jnp.dot)
    rows = []
    for i, (op, m, n, k) in enumerate(shapes):
        dtype = jnp.dtype(jnp.bfloat16)
        x = h.normal(700 + 2 * i, (m, k), dtype, scale=1 / np.sqrt(k))
        w = h.normal(701 + 2 * i, (k, n), dtype)
        args = (jax.device_put(x, NamedSharding(mesh, _SPECS[op][0])),
                jax.device_put(w, NamedSharding(mesh, _SPECS[op][1])))
        ref = h.float32_matmul(x, w, device)
        kernels = _kernel_fn(op, mesh, None)
        # What a user waits for on the first call (trace, XLA and Triton compiles):
        # host time, and an upper bound only where Triton's disk cache is fresh.
        first_call_s = {"jnp_dot": _first_call_s(dot, args), "kernels": _first_call_s(kernels, args)}
        contenders = dict(jnp_dot=h.Contender(dot, args, 1, ref),
                          kernels=h.Contender(kernels, args, 1, ref))
        if sweep:
            for j, cfg in enumerate(_sweep(op, m)):
                contenders[f"sweep{j}"] = h.Contender(_kernel_fn(op, mesh, cfg), args, 1, ref)
        row = dict(op=op, m=m, n=n, k=k, dtype=dtype.name, world=1, rounds=rounds,
                   size=2.0 * m * n * k, label=f"{op} {m}x{n}x{k}",
                   overrides=_sweep(op, m) if sweep else [], first_call_s=first_call_s)
        row.update(h.interleaved(contenders, iterations, rounds))
        rows.append(row)
        extra = " ".join(f"{name} {h.ratio(row[name], row['jnp_dot'])}"
                         for name in row if name.startswith("sweep"))
        print(f"{op} {m} {n} {k}: jnp.dot {h.us(row['jnp_dot'])} | kernels "
              f"{h.us(row['kernels'])} ({h.ratio(row['kernels'], row['jnp_dot'])}) {extra}",
              flush=True)
    return rows


COLUMNS = [
    h.Column("op", lambda r: r["op"]),
    h.Column("m x n x k", lambda r: f"{r['m']} x {r['n']} x {r['k']}"),
    h.Column("jnp.dot", lambda r: h.us(r.get("jnp_dot"))),
    h.Column("kernels at world 1", lambda r: h.us(r.get("kernels"))),
    h.Column("kernels / jnp.dot", lambda r: h.ratio(r.get("kernels"), r.get("jnp_dot"))),
    h.Column("rel err (kernels)", lambda r: h.err(r.get("kernels"))),
    h.Column("rel err (jnp.dot)", lambda r: h.err(r.get("jnp_dot"))),
    h.Column("first call, s (kernels / jnp.dot)", lambda r: (
        f"{r['first_call_s']['kernels']:.2f} / {r['first_call_s']['jnp_dot']:.2f}"
        if "first_call_s" in r else "n/a")),
]


def table(res: dict) -> str:
    text = h.markdown_table(
        f"The GEMM core at world 1: each matmul op's kernels forced at world 1 against "
        f"jnp.dot of the same operands, bf16, default configs (no tuning cache), 1 x "
        f"{res['device']}; {h.drawn_note(res)}{h.timing_note(res)}", COLUMNS, res["rows"])
    text += h.ratio_summary(res["rows"], "kernels", "jnp_dot", 1.15)
    return text


def run(args) -> tuple[list[dict], dict]:
    from jaxtdist.bench.ag_matmul import fresh_tuning_cache

    cache = fresh_tuning_cache()
    shapes = GEMM_SHAPES if args.random is None else gemm_problems(args.random, args.seed)
    shapes = [s for s in shapes
              if not args.only or any(o in f"{s[0]} {s[1]}x{s[2]}x{s[3]}" for o in args.only)]
    rows = bench_gemm(shapes, args.iterations, args.rounds, sweep=args.sweep)
    drawn = {} if args.random is None else dict(random=args.random, seed=args.seed)
    return rows, dict(world=1, tuning_cache=cache or os.environ.get("JAXTDIST_TUNING_CACHE"),
                      **drawn)


def _arguments(parser) -> None:
    parser.add_argument("--sweep", action="store_true",
                        help="also time tile overrides per shape (fitting the default rule)")
    parser.add_argument("--only", nargs="*", default=[],
                        help="shapes whose label ('op MxNxK') contains one of these strings")
    parser.add_argument("--random", type=int, metavar="N",
                        help="N random model-layer shapes (bench/random_shapes.py) instead of "
                             "the fixed list")
    parser.add_argument("--seed", type=int, default=0,
                        help="the seed of --random's draw (report it with the table)")


BENCHMARK = h.Benchmark(name="gemm", op="gemm", run=run, table=table,
                        series=("kernels", "jnp_dot"), size_label="GEMM FLOP",
                        arguments=_arguments)
