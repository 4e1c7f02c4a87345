"""Tunes ag_matmul for the benchmark shapes on this machine's GPUs.

Usage::

    python -m jaxtdist.tune [--quick] [--large] [--shape 2048,7168,8192 ...]
        [--json docs/perf/ag_matmul_tuning.json] [--markdown docs/perf/ag_matmul_tuning.md]

Writes the chosen configs to the tuning cache (``jaxtdist.tune.cache_path()``)
and, optionally, every candidate's kernel time.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp


def _describe(overrides: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in overrides.items())


def _shape(text: str) -> tuple[int, int, int]:
    try:
        m_shard, n_shard, k = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--shape takes M_SHARD,N_SHARD,K (three integers), not {text!r}") from None
    if min(m_shard, n_shard, k) < 1:
        raise argparse.ArgumentTypeError(f"--shape {text!r}: sizes must be positive")
    return m_shard, n_shard, k


def main(argv=None) -> int:
    from jaxtdist._timing import write_results
    from jaxtdist.runtime import initialize
    from jaxtdist.tune import cache_path, tune
    from jaxtdist.tune.shapes import AG_MATMUL_SHAPES

    parser = argparse.ArgumentParser(prog="python -m jaxtdist.tune")
    parser.add_argument("--quick", action="store_true", help="first three shapes only")
    parser.add_argument("--large", action="store_true",
                        help="large shapes only (m_shard >= 512), not the decode sizes")
    parser.add_argument("--shape", action="append", type=_shape, default=[],
                        metavar="M_SHARD,N_SHARD,K",
                        help="tune this shape (repeatable) instead of the benchmark shapes")
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--json", help="write every candidate's time here")
    parser.add_argument("--markdown", help="write the comparison table here")
    args = parser.parse_args(argv)
    if args.iterations < 1:
        parser.error(f"--iterations {args.iterations}: must be at least 1")
    if jax.devices()[0].platform != "gpu":
        print("jaxtdist.tune times GPU kernels; no GPU is visible", file=sys.stderr)
        return 2
    world = len(jax.devices())
    mesh = jax.make_mesh((world,), ("tp",), axis_types=(jax.sharding.AxisType.Auto,))
    initialize(mesh)
    device = jax.devices()[0].device_kind
    shapes = AG_MATMUL_SHAPES[:3] if args.quick else AG_MATMUL_SHAPES
    if args.shape:
        shapes = args.shape
    if args.large:
        shapes = [s for s in shapes if s[0] >= 512]
    shapes = list(dict.fromkeys(shapes))  # a shape listed twice is tuned once
    rows = []
    lines = [f"ag_matmul tuning, bfloat16, {world} x {device}; kernel time (us, CUPTI, median "
             f"of {args.iterations}, mean per device); the chosen config is in bold", "",
             "| m_shard | n_shard | k | candidate (overrides of the defaults) | us | rel err |",
             "|---|---|---|---|---|---|"]
    started = time.time()
    for m_shard, n_shard, k in shapes:
        result = tune("ag_matmul", (m_shard, n_shard, k), jnp.bfloat16, axis_name="tp",
                      iterations=args.iterations)
        rows.append(dict(m_shard=m_shard, n_shard=n_shard, k=k, **result))
        for r in result["tried"]:
            chosen = r.get("config") == result["config"]
            us = f"{r['us']:.1f}" if "us" in r else r.get("error", "?")[:80]
            if chosen:
                us = f"**{us}**"
            lines.append(f"| {m_shard} | {n_shard} | {k} | {_describe(r['overrides'])} | {us} | "
                         f"{r.get('rel_err', float('nan')):.1e} |")
        print(f"{m_shard} {n_shard} {k}: best {result['us']:.1f} us with "
              f"{_describe(result['config'])} ({result['seconds']:.0f} s)", flush=True)
    table = "\n".join(lines)
    write_results(dict(device=device, world=world, jax=jax.__version__,
                       cache=str(cache_path()), seconds=time.time() - started,
                       rows=rows), table, args.json, args.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
