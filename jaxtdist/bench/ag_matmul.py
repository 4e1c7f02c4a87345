"""ag_matmul's benchmarks: world N against XLA and Pallas, world 1 against jnp.dot.

``ag_matmul`` (``python -m jaxtdist.bench ag_matmul``), per (m_shard, n_shard, k)
of the tuner's ``jaxtdist.tune.shapes.AG_MATMUL_SHAPES``, bf16, on ``--world``
devices (default: all):

- (a) ``local_gemm``: one device's GEMM of the gathered rows, ``x @ w_shard``,
  while the others idle: the lower bound of an overlapped all-gather GEMM;
- (a4) ``local_gemm_all_devices``: every device's GEMM of the gathered rows at
  once (no communication, under the collective contenders' power draw);
- (b) ``xla_allgather_dot``: ``jax.lax.all_gather`` then ``@`` in one shard_map;
- (c) ``pallas_mgpu``: JAX's Pallas Mosaic-GPU ``all_gather_lhs_matmul``, the
  fastest of a small config sweep, where JAX has it and it takes the shape;
- (d) ``jaxtdist``: ``jaxtdist.ag_matmul`` with launch alignment (the
  default), and ``jaxtdist_unaligned`` without.

With 4 devices or more, one more row: ``ag_matmul_sharded`` over "tp" in a
(dp, tp) = (2, 2) mesh against all_gather over "tp" + dot in the same mesh.

``untuned`` (``python -m jaxtdist.bench untuned``): at world 1 ag_matmul is its
local GEMM and should cost what ``jnp.dot`` of the same operands costs. Per
(m, n, k, dtype) of ``shapes.AG_MATMUL_UNTUNED_SHAPES``, on one device, with
the default configs: the user's tuning cache is replaced by a fresh empty file
(``JAXTDIST_TUNING_CACHE``); configs shipped with jaxtdist still apply where
they have an entry (they are for other world sizes today).
"""

from __future__ import annotations

import functools
import os
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxtdist.bench import harness as h
from jaxtdist.bench.shapes import AG_MATMUL_UNTUNED_SHAPES
from jaxtdist.tune.shapes import AG_MATMUL_SHAPES

# bf16 products of unit-variance inputs: jaxtdist and XLA land near 2e-3; a
# Pallas config above this computes a wrong product and is no contender.
_PALLAS_MAX_REL_ERR = 2e-2


def _td():
    import jaxtdist

    return jaxtdist


def _tuned_config(op: str, world: int, shape: tuple, dtype):
    """The tuning cache's (or shipped) config for a problem, or None."""
    try:
        return _td().runtime.runtime().tuning.lookup(op, world, shape, dtype)
    except Exception:  # noqa: BLE001 - the tuning API is informational here
        return None


def _pallas_candidates():
    """JAX's Pallas MGPU collective matmul module and a few of its configs."""
    try:
        from jax.experimental.pallas.ops.gpu import collective_matmul_mgpu as cm
    except Exception as e:  # noqa: BLE001 - report any import problem
        return None, f"import failed: {e}"
    dims = cm.MatmulDimension
    configs = [cm.TuningConfig(tile_m=tile_m, tile_n=tile_n, tile_k=64, max_concurrent_steps=4,
                               grid_minor_dim=minor, grid_tile_width=width, wg_dimension=dims.N)
               for tile_m, tile_n, minor, width in [(128, 128, dims.N, 8), (128, 256, dims.N, 8),
                                                    (256, 128, dims.M, 8), (128, 128, dims.M, 4)]]
    return (cm, configs), None


def _best_pallas(pallas_mod, mesh, specs, args, ref, iterations: int, world: int, dtype):
    """The fastest correct config of the Pallas MGPU collective matmul, as
    (function, stats), or (None, error stats)."""
    if pallas_mod is None:
        return None, None
    cm, configs = pallas_mod
    candidates = {str(cfg): jax.jit(jax.shard_map(
        functools.partial(cm.all_gather_lhs_matmul, axis_name="tp", config=cfg, dtype=dtype),
        mesh=mesh, in_specs=specs[:2], out_specs=specs[2], check_vma=False))
        for cfg in configs}
    return h.fastest(candidates, args, world, iterations, ref, _PALLAS_MAX_REL_ERR)


def _mesh(world: int):
    return jax.make_mesh((world,), ("tp",), devices=jax.devices()[:world],
                         axis_types=(jax.sharding.AxisType.Auto,))


def bench_ag_matmul(shapes, iterations: int, world: int, dtype=jnp.bfloat16,
                    pallas: bool = True, rounds: int = 4) -> list[dict]:
    td = _td()
    devices = jax.devices()[:world]
    mesh = _mesh(world)
    td.initialize(mesh)
    spec_x, spec_w, spec_o = P("tp", None), P(None, "tp"), P(None, "tp")
    specs = dict(mesh=mesh, in_specs=(spec_x, spec_w), out_specs=spec_o)
    ours = jax.jit(jax.shard_map(lambda x, w: td.ag_matmul(x, w, "tp"), **specs))
    xla = jax.jit(jax.shard_map(lambda x, w: jax.lax.all_gather(x, "tp", tiled=True) @ w,
                                **specs))
    local = jax.jit(jnp.dot)
    local_all = jax.jit(jax.shard_map(lambda x, w: x @ w, mesh=mesh,
                                      in_specs=(P(None, None), spec_w), out_specs=spec_o))
    pallas_mod, pallas_err = _pallas_candidates() if pallas else (None, "disabled")
    rows = []
    for i, (m_shard, n_shard, k) in enumerate(shapes):
        x = h.normal(100 + 2 * i, (world * m_shard, k), dtype, scale=1 / np.sqrt(k))
        w = h.normal(101 + 2 * i, (k, world * n_shard), dtype)
        xs = jax.device_put(x, NamedSharding(mesh, spec_x))
        ws = jax.device_put(w, NamedSharding(mesh, spec_w))
        xr = jax.device_put(x, NamedSharding(mesh, P(None, None)))
        x0, w0 = jax.device_put(x, devices[0]), jax.device_put(w[:, :n_shard], devices[0])
        ref = h.float32_matmul(x, w, devices[0])
        pallas_fn, pallas_stats = _best_pallas(pallas_mod, mesh, (spec_x, spec_w, spec_o),
                                               (xs, ws), ref, max(1, iterations // rounds),
                                               world, dtype)
        contenders = dict(
            local_gemm=h.Contender(local, (x0, w0), 1),
            local_gemm_all_devices=h.Contender(local_all, (xr, ws), world, ref),
            xla_allgather_dot=h.Contender(xla, (xs, ws), world, ref),
            jaxtdist=h.Contender(ours, (xs, ws), world, ref, aligned=True),
            jaxtdist_unaligned=h.Contender(ours, (xs, ws), world, ref, aligned=False))
        if pallas_fn is not None:
            contenders["pallas_mgpu"] = h.Contender(pallas_fn, (xs, ws), world, ref)
        row = dict(m_shard=m_shard, n_shard=n_shard, k=k, world=world,
                   dtype=jnp.dtype(dtype).name, rounds=rounds,
                   size=2.0 * world * m_shard * n_shard * k,
                   label=f"{m_shard}x{n_shard}x{k}")
        row.update(h.interleaved(contenders, iterations, rounds))
        if pallas_fn is not None and "mean_us" in row["pallas_mgpu"]:
            row["pallas_mgpu"]["config"] = pallas_stats["config"]
            row["pallas_mgpu"]["sweep_us"] = pallas_stats["mean_us"]
        elif pallas_fn is None:
            row["pallas_mgpu"] = pallas_stats or dict(error=[pallas_err])
        tuned = _tuned_config("ag_matmul", world, (m_shard, n_shard, k), dtype)
        row["jaxtdist"]["config_source"] = "tuning cache" if tuned else "defaults"
        row["jaxtdist"]["config"] = tuned
        rows.append(row)
        print(_line(row), flush=True)
    return rows


def bench_ag_matmul_2d(iterations: int, m_shard=1024, n_shard=4096, k=4096,
                       dtype=jnp.bfloat16, rounds: int = 4) -> dict:
    """ag_matmul over "tp" in a ("dp", "tp") = (2, 2) mesh, called pjit-style through
    ``ag_matmul_sharded``, against all_gather over "tp" + dot in the same mesh."""
    td = _td()
    devices = jax.devices()[:4]
    mesh = jax.make_mesh((2, 2), ("dp", "tp"), devices=devices,
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    td.initialize(mesh)
    spec_x, spec_w = P(("dp", "tp"), None), P(None, "tp")
    ours = jax.jit(functools.partial(td.ag_matmul_sharded, axis_name="tp", batch_axes=("dp",)))
    xla = jax.jit(jax.shard_map(lambda x, w: jax.lax.all_gather(x, "tp", tiled=True) @ w,
                                mesh=mesh, in_specs=(spec_x, spec_w), out_specs=P("dp", "tp")))
    local_all = jax.jit(jax.shard_map(lambda x, w: x @ w, mesh=mesh,
                                      in_specs=(P("dp", None), spec_w), out_specs=P("dp", "tp")))
    x = h.normal(7, (4 * m_shard, k), dtype, scale=1 / np.sqrt(k))
    w = h.normal(8, (k, 2 * n_shard), dtype)
    xs = jax.device_put(x, NamedSharding(mesh, spec_x))
    ws = jax.device_put(w, NamedSharding(mesh, spec_w))
    ref = h.float32_matmul(x, w, devices[0])
    contenders = dict(
        local_gemm=h.Contender(jax.jit(jnp.dot), (jax.device_put(x[:2 * m_shard], devices[0]),
                                                  jax.device_put(w[:, :n_shard], devices[0])), 1),
        local_gemm_all_devices=h.Contender(
            local_all, (jax.device_put(x, NamedSharding(mesh, P("dp", None))), ws), 4, ref),
        xla_allgather_dot=h.Contender(xla, (xs, ws), 4, ref),
        jaxtdist=h.Contender(ours, (xs, ws), 4, ref, aligned=True),
        jaxtdist_unaligned=h.Contender(ours, (xs, ws), 4, ref, aligned=False))
    row = dict(mesh="dp=2 x tp=2", m_shard=m_shard, n_shard=n_shard, k=k, world=2,
               dtype=jnp.dtype(dtype).name, rounds=rounds)
    row.update(h.interleaved(contenders, iterations, rounds))
    row["pallas_mgpu"] = dict(error=["not run on the 2-D mesh"])
    print("dp x tp: " + _line(row), flush=True)
    return row


def _line(row) -> str:
    return (f"{row['m_shard']:>5} {row['n_shard']:>5} {row['k']:>5} | "
            + " | ".join(f"{h.us(row.get(name)):>9}" for name in _TIMED)
            + f" | {h.err(row.get('jaxtdist'))}")


_TIMED = ("local_gemm", "local_gemm_all_devices", "xla_allgather_dot", "pallas_mgpu",
          "jaxtdist", "jaxtdist_unaligned")

COLUMNS = [
    h.Column("m_shard", lambda r: str(r["m_shard"])),
    h.Column("n_shard", lambda r: str(r["n_shard"])),
    h.Column("k", lambda r: str(r["k"])),
    h.Column("(a) local GEMM", lambda r: h.us(r.get("local_gemm"))),
    h.Column("(a4) local GEMM, all devices", lambda r: h.us(r.get("local_gemm_all_devices"))),
    h.Column("(b) all_gather + dot", lambda r: h.us(r.get("xla_allgather_dot"))),
    h.Column("(c) Pallas MGPU", lambda r: h.us(r.get("pallas_mgpu"))),
    h.Column("(d) jaxtdist", lambda r: h.us(r.get("jaxtdist"))),
    h.Column("(d) fastest device", lambda r: h.us_min(r.get("jaxtdist"))),
    h.Column("(d) launches not aligned", lambda r: h.us(r.get("jaxtdist_unaligned"))),
    h.Column("(d)/(a)", lambda r: h.ratio(r.get("jaxtdist"), r.get("local_gemm"))),
    h.Column("(d)/(a4)", lambda r: h.ratio(r.get("jaxtdist"), r.get("local_gemm_all_devices"))),
    h.Column("rel err (d)", lambda r: h.err(r.get("jaxtdist"))),
]


def table(res: dict) -> str:
    rows = [r for r in res["rows"] if "mesh" not in r]
    dtype = rows[0]["dtype"] if rows else "bfloat16"
    title = (f"ag_matmul, {dtype}, {res['world']} x {res['device']}; {h.timing_note(res)}. "
             "(a) one device, the others idle; (a4) every device at once")
    text = h.markdown_table(title, COLUMNS, rows)
    for r in res["rows"]:
        if "mesh" in r:
            text += "\n\n" + h.markdown_table(
                f"ag_matmul over tp in a {r['mesh']} mesh (ag_matmul_sharded under jit; (a) is "
                "one tp group's GEMM; mean over all 4 devices)", COLUMNS, [r])
    return text


def run(args) -> tuple[list[dict], dict]:
    world = args.world or len(jax.devices())
    shapes = AG_MATMUL_SHAPES[:3] if args.quick else AG_MATMUL_SHAPES
    rows = bench_ag_matmul(shapes, args.iterations, world, pallas=not args.no_pallas,
                           rounds=args.rounds)
    if world >= 4 and not args.quick:
        rows.append(bench_ag_matmul_2d(args.iterations, rounds=args.rounds))
    return rows, dict(world=world, launcher=_launcher())


def _launcher():
    try:
        return _td().runtime.runtime().launcher
    except Exception:  # noqa: BLE001 - informational
        return None


def _arguments(parser) -> None:
    parser.add_argument("--quick", action="store_true", help="first three shapes only")
    parser.add_argument("--no-pallas", action="store_true",
                        help="leave out JAX's Pallas MGPU collective matmul")
    parser.add_argument("--world", type=int, default=0,
                        help="devices to run on (default: all)")


BENCHMARK = h.Benchmark(
    name="ag_matmul", op="ag_matmul", run=run, table=table,
    series=("jaxtdist", "local_gemm", "xla_allgather_dot", "pallas_mgpu"),
    size_label="GEMM FLOP per device", arguments=_arguments)


# ---------------------------------------------------------------- world 1, untuned


def fresh_tuning_cache() -> str:
    """Points ``JAXTDIST_TUNING_CACHE`` at a new empty directory's file; returns it."""
    path = os.path.join(tempfile.mkdtemp(prefix="jaxtdist-untuned-"), "tuning.json")
    os.environ["JAXTDIST_TUNING_CACHE"] = path
    return path


def bench_untuned(shapes, iterations: int, rounds: int = 4) -> list[dict]:
    td = _td()
    device = jax.devices()[0]
    mesh = _mesh(1)
    td.initialize(mesh)
    ours = jax.jit(jax.shard_map(lambda x, w: td.ag_matmul(x, w, "tp"), mesh=mesh,
                                 in_specs=(P("tp", None), P(None, "tp")),
                                 out_specs=P(None, "tp")))
    # The kernels themselves at world 1 with their default configs (what a group of
    # several ranks runs on the shape, communication aside): how sound the default
    # rule is on shapes nobody tuned.
    from jaxtdist.ops.ag_matmul import ag_matmul_with_gathered
    kernels = jax.jit(jax.shard_map(lambda x, w: ag_matmul_with_gathered(x, w, "tp",
            gathered=False)[0],
                                    mesh=mesh, in_specs=(P("tp", None), P(None, "tp")),
                                    out_specs=P(None, "tp")))
    dot = jax.jit(jnp.dot)
    rows = []
    for i, (m, n, k, dtype) in enumerate(shapes):
        dtype = jnp.dtype(dtype)
        # The same operands for both, placed as the shard_map takes them.
        x = jax.device_put(h.normal(300 + 2 * i, (m, k), dtype, scale=1 / np.sqrt(k)),
                           NamedSharding(mesh, P("tp", None)))
        w = jax.device_put(h.normal(301 + 2 * i, (k, n), dtype), NamedSharding(mesh, P(None, "tp")))
        ref = h.float32_matmul(x, w, device)
        row = dict(m=m, n=n, k=k, dtype=dtype.name, world=1, rounds=rounds,
                   size=2.0 * m * n * k, label=f"{m}x{n}x{k}")
        row.update(h.interleaved(dict(jnp_dot=h.Contender(dot, (x, w), 1, ref),
                                      jaxtdist=h.Contender(ours, (x, w), 1, ref),
                                      kernels=h.Contender(kernels, (x, w), 1, ref)),
                                 iterations, rounds))
        tuned = _tuned_config("ag_matmul", 1, (m, n, k), dtype)
        row["jaxtdist"]["config_source"] = "shipped tuned config" if tuned else "defaults"
        row["jaxtdist"]["config"] = tuned
        rows.append(row)
        print(f"{m:>5} {n:>5} {k:>5} {dtype.name:>8} | {h.us(row['jnp_dot']):>8} | "
              f"{h.us(row['jaxtdist']):>8} | {h.ratio(row['jaxtdist'], row['jnp_dot'])} | "
              f"kernels {h.us(row['kernels']):>8} | {h.ratio(row['kernels'], row['jnp_dot'])}",
              flush=True)
    return rows


UNTUNED_COLUMNS = [
    h.Column("m x n x k", lambda r: f"{r['m']} x {r['n']} x {r['k']}"),
    h.Column("dtype", lambda r: r["dtype"]),
    h.Column("jnp.dot", lambda r: h.us(r.get("jnp_dot"))),
    h.Column("ag_matmul", lambda r: h.us(r.get("jaxtdist"))),
    h.Column("ag_matmul / jnp.dot", lambda r: h.ratio(r.get("jaxtdist"), r.get("jnp_dot"))),
    h.Column("config", lambda r: (r.get("jaxtdist") or {}).get("config_source", "n/a")),
    h.Column("kernels at world 1", lambda r: h.us(r.get("kernels"))),
    h.Column("kernels / jnp.dot", lambda r: h.ratio(r.get("kernels"), r.get("jnp_dot"))),
    h.Column("rel err (ag_matmul)", lambda r: h.err(r.get("jaxtdist"))),
    h.Column("rel err (jnp.dot)", lambda r: h.err(r.get("jnp_dot"))),
]


def untuned_table(res: dict) -> str:
    title = (f"ag_matmul at world 1 against jnp.dot of the same operands, default configs "
             f"(no tuning cache), 1 x {res['device']}; {h.timing_note(res)}. At world 1 "
             "ag_matmul is its local computation; 'kernels at world 1' runs jaxtdist's own "
             "kernels there (ag_matmul_with_gathered) with the default configs")
    text = h.markdown_table(title, UNTUNED_COLUMNS, res["rows"])
    ratios = [r["jaxtdist"]["mean_us"] / r["jnp_dot"]["mean_us"] for r in res["rows"]
              if "mean_us" in r.get("jaxtdist", {}) and "mean_us" in r.get("jnp_dot", {})]
    if ratios:
        text += (f"\n\nag_matmul / jnp.dot: at most {max(ratios):.2f}; "
                 f"{sum(v <= 1.05 for v in ratios)} of {len(ratios)} rows within 1.05")
    return text


def run_untuned(args) -> tuple[list[dict], dict]:
    cache = None if args.keep_cache else fresh_tuning_cache()
    rows = bench_untuned(AG_MATMUL_UNTUNED_SHAPES, args.iterations, args.rounds)
    return rows, dict(world=1, launcher=_launcher(),
                      tuning_cache=cache or os.environ.get("JAXTDIST_TUNING_CACHE", "default"))


def _untuned_arguments(parser) -> None:
    parser.add_argument("--keep-cache", action="store_true",
                        help="use the user's tuning cache (default: a fresh empty one)")


UNTUNED = h.Benchmark(
    name="untuned", op="ag_matmul", run=run_untuned, table=untuned_table,
    series=("jaxtdist", "jnp_dot"), size_label="GEMM FLOP", arguments=_untuned_arguments)
