"""Kernel-time benchmarks of jaxtdist ops against JAX's own, side by side.

Usage::

    python -m jaxtdist.bench ag_matmul [--quick] [--json docs/perf/ag_matmul_h200x4.json]
    python -m jaxtdist.bench all_gather

Times come from CUPTI through ``jax.experimental.mosaic.gpu.profiler``: every
kernel of every GPU in one iteration, summed per device; the table reports
the median over iterations of the mean per device ("mean") and, as JAX's own
collective-matmul example does, the sum over kernel names of the fastest
device ("min"). Every contender runs in the same process, in interleaved
rounds (``--rounds``): a drift of the GPUs' clocks during the run (the node
caps power now and then) then reaches every contender alike. jaxtdist runs
twice: with launch alignment (the default: its handlers' host threads meet
before a collective kernel is launched) and without. ag_matmul's lower
bound (a) is timed twice: on one device while the others idle (the issue's
definition), and on every device at once (each rank's GEMM of the gathered
rows, under the same power draw as the collective contenders).
"""

from __future__ import annotations

import argparse
import functools
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxtdist as td
from jaxtdist._timing import merge_rounds
from jaxtdist._timing import profile as _profile
from jaxtdist._timing import write_results

AG_MATMUL_SHAPES = [  # (m_shard, n_shard, k)
    (1024, 4096, 4096), (2048, 3072, 4096), (2048, 7168, 8192),
    (2048, 11008 // 4, 4096), (2048, 14336 // 4, 4096), (2048, 28672 // 4, 8192),
    (1, 4096, 8192), (16, 4096, 8192), (128, 4096, 8192),
]
ALL_GATHER_BYTES = [16 << 10, 256 << 10, 1 << 20, 8 << 20, 64 << 20]


def _rel_err(out, ref) -> float:
    out = np.asarray(out, np.float32)
    ref = np.asarray(ref, np.float32)
    if not np.all(np.isfinite(out)):
        return float("inf")
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def _check_output(stats: dict, out, ref, exact: bool) -> None:
    if exact:
        stats["exact"] = bool(np.array_equal(np.asarray(out), ref))
    else:
        stats["rel_err"] = _rel_err(out, ref)


def _aligned_runner(fn, aligned: bool):
    """A runner of ``fn`` with jaxtdist's launch alignment on or off."""
    def run(args, iterations, world):
        rt = td.runtime.runtime()
        rt.align_launches = aligned
        try:
            out, t = _profile(fn, args, iterations, world)
            t["launch_alignment"] = rt.launch_alignment_stats()
        finally:
            rt.align_launches = True
        return out, t
    return run


def _plain_runner(fn):
    return lambda args, iterations, world: _profile(fn, args, iterations, world)


def _interleaved(contenders: dict, iterations: int, rounds: int) -> dict:
    """Times every contender in ``rounds`` rounds of ``iterations // rounds``
    iterations, one contender after another within a round; returns each one's
    stats over all its iterations, its output checked against its reference.

    ``contenders``: name -> (runner, args, world, ref or None, exact).
    """
    per_round = max(1, iterations // rounds)
    samples = {name: [] for name in contenders}
    outs = {}
    for _ in range(rounds):
        for name, (run, args, world, _, _) in contenders.items():
            outs[name], t = run(args, per_round, world)
            samples[name].append(t)
    stats = {}
    for name, (_, _, _, ref, exact) in contenders.items():
        stats[name] = merge_rounds(samples[name])
        if ref is not None:
            _check_output(stats[name], outs[name], ref, exact)
    return stats


def _pallas_candidates():
    try:
        from jax.experimental.pallas.ops.gpu import collective_matmul_mgpu as cm
    except Exception as e:  # noqa: BLE001 - report any import problem
        return None, f"import failed: {e}"
    dims = cm.MatmulDimension
    configs = []
    for tile_m, tile_n, minor, width in [(128, 128, dims.N, 8), (128, 256, dims.N, 8),
                                         (256, 128, dims.M, 8), (128, 128, dims.M, 4)]:
        configs.append(cm.TuningConfig(tile_m=tile_m, tile_n=tile_n, tile_k=64,
                                       max_concurrent_steps=4, grid_minor_dim=minor,
                                       grid_tile_width=width, wg_dimension=dims.N))
    return (cm, configs), None


# bf16 products of unit-variance inputs: jaxtdist and XLA land near 2e-3.
_PALLAS_MAX_REL_ERR = 2e-2


def _best_pallas(pallas_mod, mesh, specs, args, ref, iterations: int, world: int, dtype):
    """JAX's Pallas MGPU collective matmul: the fastest of a small config sweep
    (each timed ``iterations`` times), as (function, stats), or (None, error stats)."""
    if pallas_mod is None:
        return None, None
    cm, configs = pallas_mod
    best, best_fn, errors = None, None, []
    for cfg in configs:
        try:
            fn = jax.jit(jax.shard_map(
                functools.partial(cm.all_gather_lhs_matmul, axis_name="tp", config=cfg,
                                  dtype=dtype),
                mesh=mesh, in_specs=specs[:2], out_specs=specs[2], check_vma=False))
            out, t = _profile(fn, args, iterations, world)
            # A config that computes a wrong product is no contender.
            err = _rel_err(out, ref)
            if not err < _PALLAS_MAX_REL_ERR:
                errors.append(f"{cfg}: relative error {err:.1e}")
                continue
            t["config"] = str(cfg)
            if best is None or t["mean_us"] < best["mean_us"]:
                best, best_fn = t, fn
        except Exception as e:  # noqa: BLE001 - unsupported configs are skipped
            errors.append(f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")
    return (best_fn, best) if best_fn is not None else (None, dict(error=errors[:2]))


def bench_ag_matmul(shapes, iterations: int, dtype=jnp.bfloat16, pallas: bool = True,
                    rounds: int = 4):
    devices = jax.devices()
    world = len(devices)
    mesh = jax.make_mesh((world,), ("tp",))
    td.initialize(mesh)
    spec_x, spec_w, spec_o = P("tp", None), P(None, "tp"), P(None, "tp")
    ours = jax.jit(jax.shard_map(lambda x, w: td.ag_matmul(x, w, "tp"), mesh=mesh,
                                 in_specs=(spec_x, spec_w), out_specs=spec_o))
    xla = jax.jit(jax.shard_map(
        lambda x, w: jax.lax.all_gather(x, "tp", tiled=True) @ w, mesh=mesh,
        in_specs=(spec_x, spec_w), out_specs=spec_o))
    local = jax.jit(lambda a, b: a @ b)
    # Every rank's GEMM of the whole gathered x at once: no communication.
    local_all = jax.jit(jax.shard_map(lambda x, w: x @ w, mesh=mesh,
                                      in_specs=(P(None, None), spec_w), out_specs=spec_o))
    pallas_mod, pallas_err = _pallas_candidates() if pallas else (None, "disabled")
    rows = []
    for i, (m_shard, n_shard, k) in enumerate(shapes):
        keys = jax.random.split(jax.random.key(100 + i), 2)
        x = (jax.random.normal(keys[0], (world * m_shard, k), jnp.float32)
             / np.sqrt(k)).astype(dtype)
        w = jax.random.normal(keys[1], (k, world * n_shard), jnp.float32).astype(dtype)
        xs = jax.device_put(x, NamedSharding(mesh, spec_x))
        xr = jax.device_put(x, NamedSharding(mesh, P(None, None)))
        ws = jax.device_put(w, NamedSharding(mesh, spec_w))
        ref = np.asarray(x, np.float32) @ np.asarray(w, np.float32)
        row = dict(m_shard=m_shard, n_shard=n_shard, k=k, world=world, dtype=jnp.dtype(dtype).name,
                   rounds=rounds)
        x0 = jax.device_put(x, devices[0])
        w0 = jax.device_put(w[:, :n_shard], devices[0])
        pallas_fn, pallas_stats = _best_pallas(pallas_mod, mesh, (spec_x, spec_w, spec_o),
                                               (xs, ws), ref, max(1, iterations // rounds),
                                               world, dtype)
        contenders = dict(
            local_gemm=(_plain_runner(local), (x0, w0), 1, None, False),
            local_gemm_all_devices=(_plain_runner(local_all), (xr, ws), world, ref, False),
            xla_allgather_dot=(_plain_runner(xla), (xs, ws), world, ref, False),
            jaxtdist=(_aligned_runner(ours, True), (xs, ws), world, ref, False),
            jaxtdist_unaligned=(_aligned_runner(ours, False), (xs, ws), world, ref, False))
        if pallas_fn is not None:
            contenders["pallas_mgpu"] = (_plain_runner(pallas_fn), (xs, ws), world, ref, False)
        row.update(_interleaved(contenders, iterations, rounds))
        if pallas_fn is not None:
            row["pallas_mgpu"]["config"] = pallas_stats["config"]
            row["pallas_mgpu"]["sweep_us"] = pallas_stats["mean_us"]
        else:
            row["pallas_mgpu"] = pallas_stats or dict(error=[pallas_err])
        tuned = td.runtime.runtime().tuning.lookup("ag_matmul", world, (m_shard, n_shard, k),
                                                   dtype)
        row["jaxtdist"]["config_source"] = "tuning cache" if tuned else "defaults"
        row["jaxtdist"]["config"] = tuned
        rows.append(row)
        print(_ag_line(row), flush=True)
    return rows


def bench_ag_matmul_2d(iterations: int, m_shard=1024, n_shard=4096, k=4096,
                       dtype=jnp.bfloat16, rounds: int = 4):
    """ag_matmul over "tp" in a ("dp", "tp") = (2, 2) mesh, called pjit-style through
    ``ag_matmul_sharded``, against all_gather over "tp" + dot in the same mesh."""
    devices = jax.devices()[:4]
    mesh = jax.make_mesh((2, 2), ("dp", "tp"), devices=devices,
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    td.initialize(mesh)
    spec_x, spec_w = P(("dp", "tp"), None), P(None, "tp")
    ours = jax.jit(functools.partial(td.ag_matmul_sharded, axis_name="tp", batch_axes=("dp",)))
    xla = jax.jit(jax.shard_map(lambda x, w: jax.lax.all_gather(x, "tp", tiled=True) @ w,
                                mesh=mesh, in_specs=(spec_x, spec_w), out_specs=P("dp", "tp")))
    keys = jax.random.split(jax.random.key(7), 2)
    x = (jax.random.normal(keys[0], (4 * m_shard, k), jnp.float32) / np.sqrt(k)).astype(dtype)
    w = jax.random.normal(keys[1], (k, 2 * n_shard), jnp.float32).astype(dtype)
    xs = jax.device_put(x, NamedSharding(mesh, spec_x))
    ws = jax.device_put(w, NamedSharding(mesh, spec_w))
    ref = np.asarray(x, np.float32) @ np.asarray(w, np.float32)
    row = dict(mesh="dp=2 x tp=2", m_shard=m_shard, n_shard=n_shard, k=k, world=2,
               dtype=jnp.dtype(dtype).name, rounds=rounds)
    local = jax.jit(lambda a, b: a @ b)
    # Every device's GEMM of its tp group's gathered rows at once.
    local_all = jax.jit(jax.shard_map(lambda x, w: x @ w, mesh=mesh,
                                      in_specs=(P("dp", None), spec_w), out_specs=P("dp", "tp")))
    contenders = dict(
        local_gemm=(_plain_runner(local), (jax.device_put(x[:2 * m_shard], devices[0]),
                                           jax.device_put(w[:, :n_shard], devices[0])),
                    1, None, False),
        local_gemm_all_devices=(_plain_runner(local_all),
                                (jax.device_put(x, NamedSharding(mesh, P("dp", None))), ws),
                                4, ref, False),
        xla_allgather_dot=(_plain_runner(xla), (xs, ws), 4, ref, False),
        jaxtdist=(_aligned_runner(ours, True), (xs, ws), 4, ref, False),
        jaxtdist_unaligned=(_aligned_runner(ours, False), (xs, ws), 4, ref, False))
    row.update(_interleaved(contenders, iterations, rounds))
    row["pallas_mgpu"] = dict(error=["not run on the 2-D mesh"])
    print("dp x tp: " + _ag_line(row), flush=True)
    return row


def _fmt(entry) -> str:
    if "mean_us" not in entry:
        return "n/a"
    return f"{entry['mean_us']:.1f}"


def _fmt_min(entry) -> str:
    return f"{entry['min_us']:.1f}" if "min_us" in entry else "n/a"


def _ag_line(row) -> str:
    return (f"{row['m_shard']:>5} {row['n_shard']:>5} {row['k']:>5} | "
            f"{_fmt(row['local_gemm']):>9} | {_fmt(row.get('local_gemm_all_devices', {})):>9} | "
            f"{_fmt(row['xla_allgather_dot']):>9} | "
            f"{_fmt(row['pallas_mgpu']):>9} | {_fmt(row['jaxtdist']):>9} | "
            f"{_fmt_min(row['jaxtdist']):>9} | {_fmt(row['jaxtdist_unaligned']):>9} | "
            f"{row['jaxtdist'].get('rel_err', float('nan')):.2e}")


def _ratio(num: dict, den: dict) -> str:
    if "mean_us" not in num or "mean_us" not in den:
        return "n/a"
    return f"{num['mean_us'] / den['mean_us']:.2f}"


def ag_matmul_table(rows, device: str, iterations: int | None = None) -> str:
    median = f"median of {iterations}" if iterations else "median"
    rounds = rows[0].get("rounds")
    median += f" in {rounds} interleaved rounds" if rounds else ""
    lines = [f"ag_matmul, {rows[0]['dtype']}, {rows[0]['world']} x {device}; kernel time (us, "
             f"CUPTI, {median}, mean per device). (a) one device, the others idle; (a4) "
             "every device at once", "",
             "| m_shard | n_shard | k | (a) local GEMM | (a4) local GEMM, all devices | "
             "(b) all_gather + dot | (c) Pallas MGPU | (d) jaxtdist | (d) fastest device | "
             "(d) launches not aligned | (d)/(a) | (d)/(a4) | rel err (d) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['m_shard']} | {r['n_shard']} | {r['k']} | {_fmt(r['local_gemm'])} | "
                     f"{_fmt(r.get('local_gemm_all_devices', {}))} | "
                     f"{_fmt(r['xla_allgather_dot'])} | {_fmt(r['pallas_mgpu'])} | "
                     f"{_fmt(r['jaxtdist'])} | {_fmt_min(r['jaxtdist'])} | "
                     f"{_fmt(r['jaxtdist_unaligned'])} | {_ratio(r['jaxtdist'], r['local_gemm'])} | "
                     f"{_ratio(r['jaxtdist'], r.get('local_gemm_all_devices', {}))} | "
                     f"{r['jaxtdist'].get('rel_err', float('nan')):.1e} |")
    return "\n".join(lines)


def bench_all_gather(sizes, iterations: int, dtype=jnp.bfloat16, rounds: int = 4):
    devices = jax.devices()
    world = len(devices)
    mesh = jax.make_mesh((world,), ("tp",))
    td.initialize(mesh)
    ours = jax.jit(jax.shard_map(lambda x: td.all_gather(x, "tp"), mesh=mesh,
                                 in_specs=P("tp", None), out_specs=P(None, None),
                                 check_vma=False))
    xla = jax.jit(jax.shard_map(lambda x: jax.lax.all_gather(x, "tp", tiled=True), mesh=mesh,
                                in_specs=P("tp", None), out_specs=P(None, None),
                                check_vma=False))
    rows = []
    for nbytes in sizes:
        cols = 1024
        rows_per_rank = max(1, nbytes // (cols * jnp.dtype(dtype).itemsize))
        x = jax.random.normal(jax.random.key(nbytes), (world * rows_per_rank, cols),
                              jnp.float32).astype(dtype)
        xs = jax.device_put(x, NamedSharding(mesh, P("tp", None)))
        row = dict(bytes_per_rank=nbytes, world=world, rounds=rounds)
        ref = np.asarray(x)
        row.update(_interleaved(dict(
            xla_all_gather=(_plain_runner(xla), (xs,), world, ref, True),
            jaxtdist=(_aligned_runner(ours, True), (xs,), world, ref, True),
            jaxtdist_unaligned=(_aligned_runner(ours, False), (xs,), world, ref, True)),
            iterations, rounds))
        rows.append(row)
        print(f"{nbytes:>10} | {_fmt(row['xla_all_gather']):>9} | {_fmt(row['jaxtdist']):>9} | "
              f"{_fmt(row['jaxtdist_unaligned']):>9} | exact={row['jaxtdist']['exact']}",
              flush=True)
    return rows


def all_gather_table(rows, device: str) -> str:
    lines = [f"all_gather, bf16, {rows[0]['world']} x {device}; kernel time (us, CUPTI, median in "
             f"{rows[0].get('rounds', 1)} interleaved rounds, "
             "mean per device)", "",
             "| bytes per rank | jax.lax.all_gather | jaxtdist.all_gather | jaxtdist, launches "
             "not aligned | exact |",
             "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['bytes_per_rank']} | {_fmt(r['xla_all_gather'])} | "
                     f"{_fmt(r['jaxtdist'])} | {_fmt(r['jaxtdist_unaligned'])} | "
                     f"{r['jaxtdist']['exact'] and r['jaxtdist_unaligned']['exact']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jaxtdist.bench")
    parser.add_argument("op", choices=["ag_matmul", "all_gather"])
    # 100: a median that the slow episodes seen on 4 x H200 (runs of 20-40
    # iterations, every device at once) do not move; the same for every contender.
    parser.add_argument("--iterations", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=4,
                        help="interleaved rounds the iterations are split into")
    parser.add_argument("--quick", action="store_true", help="first three shapes only")
    parser.add_argument("--no-pallas", action="store_true")
    parser.add_argument("--json", help="write raw results here")
    parser.add_argument("--markdown", help="write the table here")
    args = parser.parse_args(argv)
    if jax.devices()[0].platform != "gpu":
        print("jaxtdist.bench measures GPU kernel time; no GPU is visible", file=sys.stderr)
        return 2
    device = jax.devices()[0].device_kind
    started = time.time()
    if args.op == "ag_matmul":
        shapes = AG_MATMUL_SHAPES[:3] if args.quick else AG_MATMUL_SHAPES
        rows = bench_ag_matmul(shapes, args.iterations, pallas=not args.no_pallas,
                               rounds=args.rounds)
        table = ag_matmul_table(rows, device, args.iterations)
        if len(jax.devices()) >= 4 and not args.quick:
            row_2d = bench_ag_matmul_2d(args.iterations, rounds=args.rounds)
            rows.append(row_2d)
            table += ("\n\nag_matmul over tp in a (dp, tp) = (2, 2) mesh (ag_matmul_sharded "
                      "under jit; (a) is one tp group's GEMM; mean over all 4 devices)\n\n"
                      + "\n".join(ag_matmul_table([row_2d], device).splitlines()[2:]))
    else:
        rows = bench_all_gather(ALL_GATHER_BYTES, args.iterations, rounds=args.rounds)
        table = all_gather_table(rows, device)
    result = dict(op=args.op, device=device, world=len(jax.devices()), jax=jax.__version__,
                  iterations=args.iterations, rounds=args.rounds, launcher=td.runtime.runtime().launcher,
                  seconds=time.time() - started, rows=rows)
    write_results(result, table, args.json, args.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
