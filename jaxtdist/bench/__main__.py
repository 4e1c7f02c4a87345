"""``python -m jaxtdist.bench``: see ``jaxtdist.bench``'s docstring."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def benchmarks() -> dict:
    """Subcommand -> ``harness.Benchmark``, one per op benchmark."""
    from jaxtdist.bench import (ag_attention, ag_matmul, all_gather, collectives, flash_decode,
                                gemm, grouped_matmul, matmul_rs, model, moe, moe_ll,
                                moe_tp)

    return {b.name: b for b in (ag_matmul.BENCHMARK, all_gather.BENCHMARK, ag_matmul.UNTUNED,
                                collectives.ALL_REDUCE, collectives.REDUCE_SCATTER,
                                matmul_rs.BENCHMARK, matmul_rs.AR_BENCHMARK,
                                matmul_rs.UNTUNED, model.BENCHMARK, gemm.BENCHMARK,
                                flash_decode.BENCHMARK, ag_attention.BENCHMARK, moe.BENCHMARK,
                                moe_tp.BENCHMARK, grouped_matmul.BENCHMARK,
                                moe_ll.BENCHMARK)}


def _load(parser: argparse.ArgumentParser, path: str, benches: dict | None = None) -> dict:
    """A results file written by ``--json`` (with ``benches``: one whose benchmark
    is known), or argparse's error naming the file and what is wrong with it."""
    try:
        with open(path) as f:
            res = json.load(f)
    except (OSError, ValueError) as e:
        parser.error(f"cannot read {path}: {e}")
    if not isinstance(res, dict) or not isinstance(res.get("rows"), list):
        parser.error(f"{path} is not a results file written by --json (no 'rows' list)")
    if benches is not None and res.get("benchmark", res.get("op")) not in benches:
        parser.error(f"{path} is the result of benchmark "
                     f"{res.get('benchmark', res.get('op'))!r}; known: {sorted(benches)}")
    return res


def main(argv=None) -> int:
    benches = benchmarks()
    parser = argparse.ArgumentParser(prog="python -m jaxtdist.bench")
    sub = parser.add_subparsers(dest="command", required=True)
    for bench in benches.values():
        p = sub.add_parser(bench.name, help=f"time {bench.op} ({bench.name})")
        # 100: a median that the slow episodes seen on 4 x H200 (runs of 20-40
        # iterations, every device at once) do not move; the same for every contender.
        p.add_argument("--iterations", type=int, default=100)
        p.add_argument("--rounds", type=int, default=4,
                       help="interleaved rounds the iterations are split into")
        p.add_argument("--json", help="write the raw results here")
        p.add_argument("--markdown", help="write the table here")
        if bench.arguments:
            bench.arguments(p)
    p = sub.add_parser("plot", help="draw results (JSON) as a PNG (needs matplotlib)")
    p.add_argument("results", nargs="+", help="JSON files written by --json")
    p.add_argument("--png", required=True)
    p = sub.add_parser("table", help="print a result's markdown table again")
    p.add_argument("result", help="a JSON file written by --json")
    p.add_argument("--markdown", help="write the table here")
    args = parser.parse_args(argv)
    for key in ("iterations", "rounds"):
        if getattr(args, key, 1) < 1:
            parser.error(f"--{key} {getattr(args, key)}: must be at least 1")

    from jaxtdist.bench import harness

    if args.command == "plot":
        harness.plot([_load(parser, p) for p in args.results], args.png)
        print(f"wrote {args.png}")
        return 0
    if args.command == "table":
        res = _load(parser, args.result, benches)
        bench = benches[res.get("benchmark", res.get("op"))]
        harness.write_results(res, bench.table(res), None, args.markdown)
        return 0

    if args.command == "model":
        # Its xla+cudnn+flags contender runs in a second process on the same GPUs
        # (jaxtdist.bench.xla_flags): this one must not hold 75% of their memory
        # from the start. Read when the backend starts, below.
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

    import jax

    if jax.devices()[0].platform != "gpu":
        print("jaxtdist.bench measures GPU kernel time; no GPU is visible", file=sys.stderr)
        return 2
    bench = benches[args.command]
    started = time.time()
    rows, extra = bench.run(args)
    res = harness.result(bench, rows, device=jax.devices()[0].device_kind,
                         iterations=args.iterations, rounds=args.rounds, started=started,
                         **extra)
    harness.write_results(res, bench.table(res), args.json, args.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
