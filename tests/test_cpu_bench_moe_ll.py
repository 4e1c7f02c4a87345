"""The low-latency MoE and FP8 grouped-GEMM benchmarks on CPU with faked timing
(``python -m jaxtdist.bench moe_ll`` and ``grouped_matmul --dtype fp8``): every
contender runs on tiny shapes, its output checked, the tables and JSON fields
there. The GPU run (tests/gpu/run.sh) times them."""

from __future__ import annotations

import argparse
import json

import pytest

from jaxtdist.bench import __main__ as cli
from jaxtdist.bench import harness
from tests.conftest import cpu_only

pytestmark = cpu_only()


def _res(bench, rows, extra=None, world=1):
    """The JSON document ``python -m jaxtdist.bench`` writes, through JSON and back."""
    fields = {"world": world, **(extra or {})}  # run()'s extra names the world, as in main
    res = harness.result(bench, rows, device="cpu", iterations=2, rounds=1, started=0.0,
                         **fields)
    return json.loads(json.dumps(res))


def test_grouped_fp8_benchmark_runs_every_contender(faked_timing, monkeypatch):
    """``grouped_matmul --dtype fp8`` (its ``run``) on one tiny shape: FP8 per-tensor
    and blockwise, bf16 grouped_matmul and ragged_dot all close to their float32
    references."""
    from jaxtdist.bench import grouped_matmul, shapes

    monkeypatch.setattr(shapes, "GROUPED_FP8_SHAPES", [(24, 128, 48, 3, 0.75)])
    args = argparse.Namespace(dtype="fp8", quick=True, iterations=2, rounds=1)
    rows, extra = grouped_matmul.BENCHMARK.run(args)
    assert extra["dtype"] == "fp8" and extra["plot"]["series"][0] == "tensor"
    row = rows[0]
    for name in ("bf16", "ragged_dot"):
        assert row[name]["rel_err"] < 1e-2, (name, row[name])
    for name in ("tensor", "block"):
        assert row[name]["rel_err"] < 2e-2, (name, row[name])
    res = _res(grouped_matmul.BENCHMARK, rows, extra)
    text = grouped_matmul.table(res)
    assert "FP8 grouped_matmul" in text and "| 24 x 128 x 48 | 3 | 75% |" in text
    assert "tensor / bf16: geomean 1.000" in text


@pytest.mark.parametrize("world", [1, 2])
def test_moe_ll_benchmark_runs_and_tabulates(faked_timing, monkeypatch, world):
    """``moe_ll [--world 2]`` (its ``run``) on a tiny layout shape and expert shape:
    the LL pair (bf16 and FP8 dispatch) and the packed pair, and at world 2 XLA's
    all_to_all (ragged_all_to_all: XLA:CPU lacks it, its error recorded); recv_x's
    valid rows and counts exact, every combine close to float32; then the masked
    GEMM rows on one rank's E / W experts."""
    from jaxtdist.bench import moe_ll

    monkeypatch.setattr(moe_ll, "MOE_LL_SHAPES", [(3, 128, 2, 4)])
    monkeypatch.setattr(moe_ll, "MOE_LL_GEMM_MODELS", [("tiny", 128, 48, 4, 2)])
    monkeypatch.setattr(moe_ll, "MOE_LL_GEMM_TOKENS", (4,))
    monkeypatch.setattr(moe_ll, "layout_heap_bytes", lambda shapes, world: 32 << 20)
    args = argparse.Namespace(world=world, quick=False, iterations=2, rounds=1)
    rows, extra = moe_ll.BENCHMARK.run(args)
    assert [r["kind"] for r in rows] == ["layout", "masked_gemm"]
    assert rows[1]["groups"] == 4 // world and rows[1]["masked"]["rel_err"] < 1e-2, rows[1]
    row = rows[0]
    assert row["ll_dispatch"]["exact"] and row["packed_dispatch"]["exact"], row
    assert row["ll_fp8_dispatch"]["rel_err"] < 0.1, row["ll_fp8_dispatch"]
    for name in ("ll_layer", "packed_layer") + (("all_to_all_layer",) if world > 1 else ()):
        assert row[name]["rel_err"] < 1e-2, (name, row[name])
    if world > 1:
        assert "mean_us" in row["all_to_all_dispatch"]
        assert "mean_us" in row["ragged_layer"] or "error" in row["ragged_layer"]
    res = _res(moe_ll.BENCHMARK, rows, extra)
    assert res["world"] == world and res["plot"]["series"] == list(moe_ll.SERIES)
    text = moe_ll.table(res)
    assert "| 3 x 128, top-2, 4 |" in text and "low-latency" in text
    assert "| tiny | 4 |" in text and "grouped_matmul_masked" in text


def test_moe_ll_masked_gemm_benchmark_runs_and_tabulates(faked_timing):
    """``moe_ll``'s masked grouped GEMM on a tiny expert shape: masked bf16 and FP8
    (per tensor, blockwise), grouped_matmul and ragged_dot on the packed rows, all
    close to float32; the weight-read bandwidth recorded."""
    from jaxtdist.bench import moe_ll

    rows = moe_ll.bench_masked_gemm([("tiny", 128, 48, 4, 2)], (1, 5), 2, world=1, rounds=1)
    assert len(rows) == 2
    for row in rows:
        for name in ("masked", "grouped_matmul", "ragged_dot"):
            assert row[name]["rel_err"] < 1e-2, (name, row)
        for name in ("masked_fp8_tensor", "masked_fp8_block"):
            assert row[name]["rel_err"] < 2e-2, (name, row)
        assert row["masked"]["gb_per_s"] > 0 and row["weight_bytes"] > 0
    res = _res(moe_ll.BENCHMARK, rows)
    text = moe_ll.table(res)
    assert "grouped_matmul_masked" in text and "| tiny |" in text
    assert set(moe_ll.moe_ll_gemm.SERIES) <= set(res["rows"][0]) <= set(res["rows"][0]) | {
        "kind"}
    assert res["rows"][0]["kind"] == "masked_gemm" and "gb_per_s" in res["rows"][0]["masked"]


def test_new_benches_are_subcommands():
    """``moe_ll`` is a subcommand; ``grouped_matmul`` takes ``--dtype fp8``; the HBM
    peak is known for the GPUs the run uses."""
    assert "moe_ll" in cli.benchmarks()
    assert harness.hbm_peak("NVIDIA H100 80GB HBM3") == 3.35e12
    assert harness.hbm_peak("NVIDIA H200") == 4.8e12 and harness.hbm_peak("cpu") is None
    import argparse

    parser = argparse.ArgumentParser()
    cli.benchmarks()["grouped_matmul"].arguments(parser)
    assert parser.parse_args(["--dtype", "fp8"]).dtype == "fp8"
    parser = argparse.ArgumentParser()
    cli.benchmarks()["moe_ll"].arguments(parser)
    args = parser.parse_args(["--world", "2", "--quick"])
    assert args.world == 2 and args.quick
