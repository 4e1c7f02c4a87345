"""grouped_matmul's benchmark: ``jaxtdist.grouped_matmul`` against ``jax.lax.ragged_dot``.

``python -m jaxtdist.bench grouped_matmul``: per (R, H, F, G, used) of
``shapes.GROUPED_MATMUL_SHAPES`` (bf16, one device, default configs), both
contenders on the same operands and the same group sizes: a routing drawn
once per shape (``used * R`` rows dealt to the G groups with a mild skew,
the rest padding rows past the groups). Relative errors of both against the
float32 grouped product (``ragged_dot`` of float32 operands at HIGHEST
precision). Issue 33's target: grouped_matmul within 1.10x of ragged_dot.
On GPUs JAX's Pallas Mosaic-GPU grouped GEMM (``ragged_dot_mgpu``, Hopper) too,
at the fastest of a few configs (its forward only). The backward pass too: the
gradients of x and w of ``sum(out * c)`` through each op (grouped_matmul: dx and
dw on its kernels), their relative errors against the float32 gradients.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxtdist.bench import harness as h
from jaxtdist.bench._grouped_ops import group_sizes
from jaxtdist.bench.shapes import GROUPED_MATMUL_SHAPES

TARGET = 1.10


def bench_grouped_matmul(shapes, iterations: int, rounds: int = 4, dtype=jnp.bfloat16,
                         config: dict | None = None) -> list[dict]:
    import jaxtdist as td

    device = jax.devices()[0]
    mesh = jax.make_mesh((1,), ("ep",), devices=[device],
                         axis_types=(jax.sharding.AxisType.Auto,))
    td.initialize(mesh)
    ours = jax.jit(jax.shard_map(lambda x, w, s: td.grouped_matmul(x, w, s, config=config),
                                 mesh=mesh, in_specs=(P(), P(), P()), out_specs=P(),
                                 check_vma=False))
    ragged = jax.jit(jax.lax.ragged_dot)
    exact = jax.jit(lambda x, w, s: jax.lax.ragged_dot(
        x.astype(jnp.float32), w.astype(jnp.float32), s, precision=jax.lax.Precision.HIGHEST))

    def grads(fn):
        return jax.grad(lambda x, w, s, c: jnp.sum(fn(x, w, s).astype(jnp.float32) * c),
                        argnums=(0, 1))

    ours_grad = jax.jit(jax.shard_map(
        grads(lambda x, w, s: td.grouped_matmul(x, w, s, config=config)), mesh=mesh,
        in_specs=(P(), P(), P(), P()), out_specs=(P(), P()), check_vma=False))
    ragged_grad = jax.jit(grads(jax.lax.ragged_dot))
    exact_grad = jax.jit(lambda x, w, s, c: grads(lambda a, b, s: jax.lax.ragged_dot(
        a, b, s, precision=jax.lax.Precision.HIGHEST))(
        x.astype(jnp.float32), w.astype(jnp.float32), s, c))
    pallas = _pallas_ragged_dot() if device.platform == "gpu" else None
    rows = []
    for i, (r, hidden, f, g, used) in enumerate(shapes):
        x = jax.device_put(h.normal(900 + 2 * i, (r, hidden), dtype, scale=hidden ** -0.5),
                           device)
        w = jax.device_put(h.normal(901 + 2 * i, (g, hidden, f), dtype), device)
        sizes = jax.device_put(jnp.asarray(group_sizes(950 + i, r, g, used)), device)
        ref = _by_groups(exact, x, w, sizes)
        args = (x, w, sizes)
        row = dict(R=r, hidden=hidden, ffn=f, groups=g, used=used,
                   dtype=jnp.dtype(dtype).name, world=1, rounds=rounds,
                   size=2.0 * float(np.asarray(sizes).sum()) * hidden * f,
                   label=f"{r}x{hidden}x{f} G={g}")
        c = jax.device_put(h.normal(960 + i, (r, f), jnp.float32), device)
        contenders = dict(
            ragged_dot=h.Contender(ragged, args, 1, ref),
            grouped_matmul=h.Contender(ours, args, 1, ref),
            ragged_dot_grad=h.Contender(ragged_grad, args + (c,), 1),
            grouped_matmul_grad=h.Contender(ours_grad, args + (c,), 1))
        if pallas is not None:
            pallas_fn, pallas_stats = h.fastest(pallas(f), args, 1, max(4, iterations // 4), ref)
            if pallas_fn is not None:
                contenders["pallas_mgpu"] = h.Contender(pallas_fn, args, 1, ref)
        row.update(h.interleaved(contenders, iterations, rounds))
        if pallas is not None:
            if pallas_fn is not None:
                row["pallas_mgpu"]["config"] = pallas_stats["config"]
            else:
                row["pallas_mgpu"] = pallas_stats
        want = _by_groups(exact_grad, x, w, sizes, c)
        for name, fn in (("ragged_dot_grad", ragged_grad), ("grouped_matmul_grad", ours_grad)):
            if "error" not in row[name]:
                got = fn(x, w, sizes, c)
                row[name]["rel_err"] = max(h.rel_err(a, b) for a, b in zip(got, want))
        rows.append(row)
        print(f"grouped_matmul R={r} H={hidden} F={f} G={g} used={used}: ragged_dot "
              f"{h.us(row.get('ragged_dot'))} | grouped_matmul {h.us(row.get('grouped_matmul'))}"
              f" ({h.ratio(row.get('grouped_matmul'), row.get('ragged_dot'))})", flush=True)
    return rows


# Groups per float32 reference call: about this many bytes of float32 weights (a
# whole float32 copy of 256 experts of 7168 x 2048, with its gradient, did not fit
# beside the contenders on one H100).
_REFERENCE_BYTES = 1 << 31


def _by_groups(fn, x, w, sizes, c=None):
    """``fn(x, w, sizes)`` (the float32 product, [R, F]) or ``fn(x, w, sizes, c)``
    (its gradients over x and w) on the host as numpy, computed a few groups at a
    time (their rows are contiguous); rows past the groups: zero."""
    g, hidden, f = w.shape
    counts = np.asarray(sizes)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(int)
    per = max(1, _REFERENCE_BYTES // (hidden * f * 4))
    # Only what is asked for: a float32 dw of 256 experts is 15 GB of host memory.
    if c is None:
        out = np.zeros((x.shape[0], f), np.float32)
    else:
        dx, dw = np.zeros(x.shape, np.float32), np.zeros(w.shape, np.float32)
    for g0 in range(0, g, per):
        g1 = min(g, g0 + per)
        r0, r1 = offsets[g0], offsets[g1]
        if r1 == r0:
            continue  # no row in these groups: zeros
        args = (x[r0:r1], w[g0:g1], sizes[g0:g1]) + (() if c is None else (c[r0:r1],))
        if c is None:
            out[r0:r1] = np.asarray(fn(*args))
        else:
            gx, gw = fn(*args)
            dx[r0:r1], dw[g0:g1] = np.asarray(gx), np.asarray(gw)
    return out if c is None else (dx, dw)


def _pallas_ragged_dot():
    """F -> {config label: (x, w, sizes) -> out} of JAX's Pallas Mosaic-GPU grouped
    GEMM (``ragged_dot_mgpu``, Hopper; a few of the configs its own sweep covers,
    those whose N blocks divide F), or None where it cannot be imported."""
    try:
        from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu
    except Exception:  # noqa: BLE001 - an older or trimmed JAX: no such contender
        return None

    def candidates(f: int) -> dict:
        configs = [dict(block_m=bm, block_n=bn, block_k=64, max_concurrent_steps=steps,
                        grid_block_n=grid)
                   for bm, bn, steps, grid in [(128, 128, 4, 1), (128, 128, 4, 4),
                                               (64, 128, 4, 2), (128, 192, 4, 1),
                                               (192, 128, 4, 1)]
                   if f % (grid * bn) == 0]
        return {", ".join(f"{k}={v}" for k, v in cfg.items()): jax.jit(
                    lambda x, w, s, cfg=cfg: ragged_dot_mgpu.ragged_dot(
                        x, w, group_sizes=s, **cfg))
                for cfg in configs}
    return candidates


COLUMNS = [
    h.Column("R x H x F", lambda r: f"{r['R']} x {r['hidden']} x {r['ffn']}"),
    h.Column("groups", lambda r: str(r["groups"])),
    h.Column("rows used", lambda r: f"{r['used']:.0%}"),
    h.Column("ragged_dot", lambda r: h.us(r.get("ragged_dot"))),
    h.Column("grouped_matmul", lambda r: h.us(r.get("grouped_matmul"))),
    h.Column("grouped_matmul / ragged_dot",
             lambda r: h.ratio(r.get("grouped_matmul"), r.get("ragged_dot"))),
    h.Column("Pallas Mosaic GPU ragged_dot", lambda r: h.us(r.get("pallas_mgpu"))),
    h.Column("grouped_matmul / Pallas",
             lambda r: h.ratio(r.get("grouped_matmul"), r.get("pallas_mgpu"))),
    h.Column("rel err (grouped_matmul)", lambda r: h.err(r.get("grouped_matmul"))),
    h.Column("rel err (ragged_dot)", lambda r: h.err(r.get("ragged_dot"))),
    h.Column("backward: ragged_dot", lambda r: h.us(r.get("ragged_dot_grad"))),
    h.Column("backward: grouped_matmul", lambda r: h.us(r.get("grouped_matmul_grad"))),
    h.Column("ratio", lambda r: h.ratio(r.get("grouped_matmul_grad"), r.get("ragged_dot_grad"))),
    h.Column("rel err dx, dw (grouped_matmul)", lambda r: h.err(r.get("grouped_matmul_grad"))),
]


def table(res: dict) -> str:
    if res.get("dtype") == "fp8":
        from jaxtdist.bench.grouped_fp8 import table as fp8_table
        return fp8_table(res)
    text = h.markdown_table(
        f"grouped_matmul against jax.lax.ragged_dot on the same groups, "
        f"{res['rows'][0]['dtype'] if res['rows'] else 'bfloat16'}, default configs, 1 x "
        f"{res['device']}; {h.timing_note(res)}", COLUMNS, res["rows"])
    text += h.ratio_summary(res["rows"], "grouped_matmul", "ragged_dot", TARGET)
    return text


def run(args) -> tuple[list[dict], dict]:
    if getattr(args, "dtype", "bf16") == "fp8":
        from jaxtdist.bench.grouped_fp8 import SERIES, bench_grouped_fp8
        from jaxtdist.bench.shapes import GROUPED_FP8_SHAPES

        shapes = GROUPED_FP8_SHAPES[:2] if args.quick else GROUPED_FP8_SHAPES
        return bench_grouped_fp8(shapes, args.iterations, rounds=args.rounds), dict(
            world=1, dtype="fp8", plot=dict(series=list(SERIES), size_label="FLOPs"))
    shapes = GROUPED_MATMUL_SHAPES[:2] if args.quick else GROUPED_MATMUL_SHAPES
    return bench_grouped_matmul(shapes, args.iterations, rounds=args.rounds), dict(world=1)


def _arguments(parser) -> None:
    parser.add_argument("--quick", action="store_true", help="the first two shapes only")
    parser.add_argument("--dtype", choices=("bf16", "fp8"), default="bf16",
                        help="bf16 (default): against ragged_dot, forward and backward; fp8: "
                             "float8_e4m3fn operands (per-tensor and blockwise scales) against "
                             "bf16 grouped_matmul and ragged_dot (grouped_fp8)")


BENCHMARK = h.Benchmark(
    name="grouped_matmul", op="grouped_matmul", run=run, table=table,
    series=("grouped_matmul", "ragged_dot"), size_label="FLOPs", arguments=_arguments)
