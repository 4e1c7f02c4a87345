"""matmul_rs's and matmul_ar's benchmarks: world N against XLA, world 1 against jnp.dot.

``matmul_rs`` (``python -m jaxtdist.bench matmul_rs``), per (M, N, K) of
``MATMUL_RS_SHAPES``, bf16, K split over ``--world`` devices (default: all),
x [M, K] columns and w [K, N] rows sharded:

- (a) ``local_gemm``: one device's GEMM x[:, :K/W] @ w[:K/W] while the others
  idle: the lower bound of an overlapped GEMM + reduce-scatter;
- (a4) ``local_gemm_all_devices``: every device's GEMM at once, no reduction;
- (b) ``xla_dot_psum_scatter``: ``psum_scatter(x @ w, tiled=True)`` in one shard_map;
- (d) ``jaxtdist``: ``jaxtdist.matmul_rs`` (launch alignment on, the default).

``matmul_ar`` (``python -m jaxtdist.bench matmul_ar``), per M of
``MATMUL_AR_ROWS``, K = 8192 split over the devices, N = 8192, bf16:
``psum(x @ w)`` against ``jaxtdist.matmul_ar``, and the local GEMM.

``untuned_matmul_rs`` (``python -m jaxtdist.bench untuned_matmul_rs``): at world
1 both ops are their local GEMM and should cost what ``jnp.dot`` costs; the
table also times their kernels at world 1 (``matmul_rs_kernels``,
``matmul_ar_kernels``) with the default configs (a fresh, empty user tuning
cache), what a group of several ranks runs, communication aside.

The sizes are in ``shapes.py``.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxtdist.bench import harness as h
from jaxtdist.bench.shapes import (MATMUL_AR_NK, MATMUL_AR_ROWS, MATMUL_RS_SHAPES,
                                   MATMUL_RS_UNTUNED_SHAPES)

X_SPEC, W_SPEC = P(None, "tp"), P("tp", None)


def _mesh(world: int):
    return jax.make_mesh((world,), ("tp",), devices=jax.devices()[:world],
                         axis_types=(jax.sharding.AxisType.Auto,))


def _ops():
    # The module, not the function ``jaxtdist.ops.matmul_rs`` its package exports.
    import importlib

    return importlib.import_module("jaxtdist.ops.matmul_rs")


def _operands(seed: int, mesh, m: int, n: int, k: int, dtype):
    x = h.normal(seed, (m, k), dtype, scale=1 / np.sqrt(k))
    w = h.normal(seed + 1, (k, n), dtype)
    return x, w, (jax.device_put(x, NamedSharding(mesh, X_SPEC)),
                  jax.device_put(w, NamedSharding(mesh, W_SPEC)))


def _config_source(op: str, world: int, shape: tuple, dtype) -> dict:
    try:
        import jaxtdist

        tuned = jaxtdist.runtime.runtime().tuning.lookup(op, world, shape, jnp.dtype(dtype).name)
    except Exception:  # noqa: BLE001 - informational
        tuned = None
    return dict(config_source="tuning cache" if tuned else "defaults", config=tuned)


def bench_matmul_rs(shapes, iterations: int, world: int, dtype=jnp.bfloat16,
                    rounds: int = 4) -> list[dict]:
    import jaxtdist as td

    ops = _ops()
    devices = jax.devices()[:world]
    mesh = _mesh(world)
    td.initialize(mesh)
    specs = dict(mesh=mesh, in_specs=(X_SPEC, W_SPEC), out_specs=P("tp", None),
                 check_vma=False)
    ours = jax.jit(jax.shard_map(lambda x, w: ops.matmul_rs(x, w, "tp"), **specs))
    # Both ways a peer's tile leaves (TMA stores, SM stores) forced, beside the default.
    pushes = {f"jaxtdist_push_{push}": jax.jit(jax.shard_map(
        lambda x, w, push=push: ops.matmul_rs(x, w, "tp", config=dict(PUSH=push)), **specs))
        for push in ("tma", "stores")} if world > 1 else {}
    xla = jax.jit(jax.shard_map(
        lambda x, w: jax.lax.psum_scatter(x @ w, "tp", scatter_dimension=0, tiled=True),
        **specs))
    local_all = jax.jit(jax.shard_map(lambda x, w: x @ w, **specs))
    local = jax.jit(jnp.dot)
    rows = []
    for i, (m, n, k) in enumerate(shapes):
        k_shard = k // world
        k = k_shard * world
        x, w, args = _operands(500 + 2 * i, mesh, m, n, k, dtype)
        ref = h.float32_matmul(x, w, devices[0])
        x0 = jax.device_put(x[:, :k_shard], devices[0])
        w0 = jax.device_put(w[:k_shard], devices[0])
        row = dict(m=m, n=n, k=k, world=world, dtype=jnp.dtype(dtype).name, rounds=rounds,
                   size=2.0 * m * n * k_shard, label=f"{m}x{n}x{k}")
        row.update(h.interleaved(dict(
            local_gemm=h.Contender(local, (x0, w0), 1),
            local_gemm_all_devices=h.Contender(local_all, args, world),
            xla_dot_psum_scatter=h.Contender(xla, args, world, ref),
            jaxtdist=h.Contender(ours, args, world, ref, aligned=True),
            **{name: h.Contender(f, args, world, ref, aligned=True)
               for name, f in pushes.items()}), iterations, rounds))
        row["jaxtdist"].update(_config_source("matmul_rs", world, (m, n, k_shard), dtype))
        rows.append(row)
        print(f"matmul_rs {m} {n} {k}: " + " | ".join(
            f"{name} {h.us(row.get(name))}" for name in
            ("local_gemm", "local_gemm_all_devices", "xla_dot_psum_scatter", "jaxtdist",
             *pushes)),
            flush=True)
    return rows


def bench_matmul_ar(ms, iterations: int, world: int, dtype=jnp.bfloat16,
                    rounds: int = 4) -> list[dict]:
    import jaxtdist as td

    ops = _ops()
    devices = jax.devices()[:world]
    mesh = _mesh(world)
    td.initialize(mesh)
    specs = dict(mesh=mesh, in_specs=(X_SPEC, W_SPEC), out_specs=P(), check_vma=False)
    ours = jax.jit(jax.shard_map(lambda x, w: ops.matmul_ar(x, w, "tp"), **specs))
    # Both exchanges forced (each with its default partials), beside the default's pick.
    shots = {f"jaxtdist_{name}": jax.jit(jax.shard_map(
        lambda x, w, two=two: ops.matmul_ar(x, w, "tp", config=dict(TWO_SHOT=two)), **specs))
        for name, two in (("one_shot", False), ("two_shot", True))} if world > 1 else {}
    xla = jax.jit(jax.shard_map(lambda x, w: jax.lax.psum(x @ w, "tp"), **specs))
    local = jax.jit(jnp.dot)
    n, k = MATMUL_AR_NK
    k_shard = k // world
    k = k_shard * world
    rows = []
    for i, m in enumerate(ms):
        x, w, args = _operands(700 + 2 * i, mesh, m, n, k, dtype)
        ref = h.float32_matmul(x, w, devices[0])
        row = dict(m=m, n=n, k=k, world=world, dtype=jnp.dtype(dtype).name, rounds=rounds,
                   size=float(m), label=f"M={m}")
        row.update(h.interleaved(dict(
            local_gemm=h.Contender(local, (jax.device_put(x[:, :k_shard], devices[0]),
                                           jax.device_put(w[:k_shard], devices[0])), 1),
            xla_dot_psum=h.Contender(xla, args, world, ref),
            jaxtdist=h.Contender(ours, args, world, ref, aligned=True),
            **{name: h.Contender(f, args, world, ref, aligned=True)
               for name, f in shots.items()}), iterations, rounds))
        row["jaxtdist"].update(_config_source("matmul_ar", world, (m, n, k_shard), dtype))
        rows.append(row)
        print(f"matmul_ar M={m}: " + " | ".join(
            f"{name} {h.us(row.get(name))}" for name in ("local_gemm", "xla_dot_psum",
                                                         "jaxtdist", *shots)), flush=True)
    return rows


_SHAPE = [h.Column("M", lambda r: str(r["m"])), h.Column("N", lambda r: str(r["n"])),
          h.Column("K (all ranks)", lambda r: str(r["k"]))]

RS_COLUMNS = _SHAPE + [
    h.Column("(a) local GEMM", lambda r: h.us(r.get("local_gemm"))),
    h.Column("(a4) local GEMM, all devices", lambda r: h.us(r.get("local_gemm_all_devices"))),
    h.Column("(b) dot + psum_scatter", lambda r: h.us(r.get("xla_dot_psum_scatter"))),
    h.Column("(d) jaxtdist", lambda r: h.us(r.get("jaxtdist"))),
    h.Column("(d) fastest device", lambda r: h.us_min(r.get("jaxtdist"))),
    h.Column("TMA-store pushes", lambda r: h.us(r.get("jaxtdist_push_tma"))),
    h.Column("SM-store pushes", lambda r: h.us(r.get("jaxtdist_push_stores"))),
    h.Column("(d)/(a)", lambda r: h.ratio(r.get("jaxtdist"), r.get("local_gemm"))),
    h.Column("(d)/(b)", lambda r: h.ratio(r.get("jaxtdist"), r.get("xla_dot_psum_scatter"))),
    h.Column("rel err (d)", lambda r: h.err(r.get("jaxtdist"))),
]

AR_COLUMNS = _SHAPE + [
    h.Column("local GEMM", lambda r: h.us(r.get("local_gemm"))),
    h.Column("dot + psum", lambda r: h.us(r.get("xla_dot_psum"))),
    h.Column("jaxtdist", lambda r: h.us(r.get("jaxtdist"))),
    h.Column("one shot", lambda r: h.us(r.get("jaxtdist_one_shot"))),
    h.Column("two shot", lambda r: h.us(r.get("jaxtdist_two_shot"))),
    h.Column("jaxtdist / (dot + psum)", lambda r: h.ratio(r.get("jaxtdist"),
                                                          r.get("xla_dot_psum"))),
    h.Column("rel err", lambda r: h.err(r.get("jaxtdist"))),
    h.Column("rel err (two shot)", lambda r: h.err(r.get("jaxtdist_two_shot"))),
]


def rs_table(res: dict) -> str:
    return h.markdown_table(
        f"matmul_rs, bfloat16, K split over {res['world']} x {res['device']}; "
        f"{h.timing_note(res)}. (a) one device, the others idle; (a4) every device at once",
        RS_COLUMNS, res["rows"])


def ar_table(res: dict) -> str:
    return h.markdown_table(
        f"matmul_ar, bfloat16, K split over {res['world']} x {res['device']}; "
        f"{h.timing_note(res)}", AR_COLUMNS, res["rows"])


def _world_argument(parser) -> None:
    parser.add_argument("--world", type=int, default=0, help="devices to run on (default: all)")
    parser.add_argument("--quick", action="store_true", help="the first size only")


def run_rs(args) -> tuple[list[dict], dict]:
    world = args.world or len(jax.devices())
    shapes = MATMUL_RS_SHAPES[:1] if args.quick else MATMUL_RS_SHAPES
    return bench_matmul_rs(shapes, args.iterations, world, rounds=args.rounds), dict(world=world)


def run_ar(args) -> tuple[list[dict], dict]:
    world = args.world or len(jax.devices())
    rows = MATMUL_AR_ROWS[:1] if args.quick else MATMUL_AR_ROWS
    return bench_matmul_ar(rows, args.iterations, world, rounds=args.rounds), dict(world=world)


BENCHMARK = h.Benchmark(
    name="matmul_rs", op="matmul_rs", run=run_rs, table=rs_table,
    series=("jaxtdist", "local_gemm", "xla_dot_psum_scatter"),
    size_label="GEMM FLOP per device", arguments=_world_argument)

AR_BENCHMARK = h.Benchmark(
    name="matmul_ar", op="matmul_ar", run=run_ar, table=ar_table,
    series=("jaxtdist", "xla_dot_psum", "local_gemm"), size_label="rows (M)",
    arguments=_world_argument)


# ---------------------------------------------------------------- world 1, untuned


def bench_untuned(shapes, iterations: int, rounds: int = 4) -> list[dict]:
    import jaxtdist as td

    ops = _ops()
    device = jax.devices()[0]
    mesh = _mesh(1)
    td.initialize(mesh)
    specs = dict(mesh=mesh, in_specs=(X_SPEC, W_SPEC), out_specs=P(), check_vma=False)
    public = {name: jax.jit(jax.shard_map(lambda x, w, f=getattr(ops, name): f(x, w, "tp"),
                                          **specs)) for name in ("matmul_rs", "matmul_ar")}
    kernels = {name: jax.jit(jax.shard_map(
        lambda x, w, f=getattr(ops, name + "_kernels"): f(x, w, "tp"), **specs))
        for name in ("matmul_rs", "matmul_ar")}
    dot = jax.jit(jnp.dot)
    rows = []
    for i, (op, m, n, k, dtype) in enumerate(shapes):
        dtype = jnp.dtype(dtype)
        x, w, args = _operands(900 + 2 * i, mesh, m, n, k, dtype)
        ref = h.float32_matmul(x, w, device)
        row = dict(op=op, m=m, n=n, k=k, dtype=dtype.name, world=1, rounds=rounds,
                   size=2.0 * m * n * k, label=f"{op} {m}x{n}x{k}")
        row.update(h.interleaved(dict(jnp_dot=h.Contender(dot, args, 1, ref),
                                      jaxtdist=h.Contender(public[op], args, 1, ref),
                                      kernels=h.Contender(kernels[op], args, 1, ref)),
                                 iterations, rounds))
        row["kernels"].update(_config_source(op, 1, (m, n, k), dtype))
        rows.append(row)
        print(f"{op} {m} {n} {k} {dtype.name}: jnp.dot {h.us(row['jnp_dot'])} | op "
              f"{h.us(row['jaxtdist'])} | kernels {h.us(row['kernels'])} "
              f"({h.ratio(row['kernels'], row['jnp_dot'])})", flush=True)
    return rows


UNTUNED_COLUMNS = [
    h.Column("op", lambda r: r["op"]),
    h.Column("m x n x k", lambda r: f"{r['m']} x {r['n']} x {r['k']}"),
    h.Column("dtype", lambda r: r["dtype"]),
    h.Column("jnp.dot", lambda r: h.us(r.get("jnp_dot"))),
    h.Column("op (local at world 1)", lambda r: h.us(r.get("jaxtdist"))),
    h.Column("op / jnp.dot", lambda r: h.ratio(r.get("jaxtdist"), r.get("jnp_dot"))),
    h.Column("kernels at world 1", lambda r: h.us(r.get("kernels"))),
    h.Column("kernels / jnp.dot", lambda r: h.ratio(r.get("kernels"), r.get("jnp_dot"))),
    h.Column("config", lambda r: (r.get("kernels") or {}).get("config_source", "n/a")),
    h.Column("rel err (kernels)", lambda r: h.err(r.get("kernels"))),
]


def untuned_table(res: dict) -> str:
    return h.markdown_table(
        f"matmul_rs and matmul_ar at world 1 against jnp.dot of the same operands, default "
        f"configs (no user tuning cache), 1 x {res['device']}; {h.timing_note(res)}. At world "
        "1 each op is its local GEMM; 'kernels at world 1' runs jaxtdist's kernels there",
        UNTUNED_COLUMNS, res["rows"])


def run_untuned(args) -> tuple[list[dict], dict]:
    from jaxtdist.bench.ag_matmul import fresh_tuning_cache

    cache = None if args.keep_cache else fresh_tuning_cache()
    rows = bench_untuned(MATMUL_RS_UNTUNED_SHAPES, args.iterations, args.rounds)
    return rows, dict(world=1, tuning_cache=cache or os.environ.get("JAXTDIST_TUNING_CACHE",
                                                                    "default"))


def _untuned_arguments(parser) -> None:
    parser.add_argument("--keep-cache", action="store_true",
                        help="use the user's tuning cache (default: a fresh empty one)")


UNTUNED = h.Benchmark(
    name="untuned_matmul_rs", op="matmul_rs", run=run_untuned, table=untuned_table,
    series=("kernels", "jnp_dot"), size_label="GEMM FLOP", arguments=_untuned_arguments)
