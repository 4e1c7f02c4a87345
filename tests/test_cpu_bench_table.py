"""The benchmark's bookkeeping, without GPUs: rounds merged into one median,
interleaved contenders checked against their references, and the tables."""

from __future__ import annotations

import numpy as np

from jaxtdist import bench
from jaxtdist._timing import merge_rounds


def _stats(samples):
    return dict(mean_us=float(np.median(samples)), min_us=float(np.median(samples)) - 1,
                samples_us=list(samples), min_samples_us=[v - 1 for v in samples],
                kernels=["k"])


def test_merge_rounds_takes_the_median_of_every_iteration():
    merged = merge_rounds([_stats([10.0, 11.0, 30.0]), _stats([12.0, 13.0, 14.0])])
    assert merged["mean_us"] == 12.5 and merged["min_us"] == 11.5
    assert merged["round_medians_us"] == [11.0, 13.0]
    assert len(merged["samples_us"]) == 6


def test_interleaved_rounds_alternate_and_check_outputs():
    calls = []
    ref = np.arange(6.0)

    def runner(name, out):
        def run(args, iterations, world):
            calls.append((name, iterations, world))
            return out, _stats([float(len(calls))] * iterations)
        return run

    stats = bench._interleaved(dict(
        good=(runner("good", ref), (), 4, ref, True),
        bad=(runner("bad", ref + 1), (), 4, ref, True),
        close=(runner("close", ref * (1 + 1e-3)), (), 1, ref, False),
        unchecked=(runner("unchecked", None), (), 1, None, False)), iterations=10, rounds=2)
    assert [c[0] for c in calls] == ["good", "bad", "close", "unchecked"] * 2
    assert {c[1] for c in calls} == {5}
    assert stats["good"]["exact"] and not stats["bad"]["exact"]
    assert abs(stats["close"]["rel_err"] - 1e-3) < 1e-6  # float32 arithmetic
    assert "exact" not in stats["unchecked"] and "rel_err" not in stats["unchecked"]
    assert stats["good"]["round_medians_us"] == [1.0, 5.0]


def test_ag_matmul_table_has_both_lower_bounds():
    row = dict(m_shard=1024, n_shard=4096, k=4096, world=4, dtype="bfloat16", rounds=4,
               local_gemm=_stats([100.0]), local_gemm_all_devices=_stats([105.0]),
               xla_allgather_dot=_stats([200.0]), pallas_mgpu=dict(error=["refused"]),
               jaxtdist=dict(_stats([110.0]), rel_err=1.7e-3),
               jaxtdist_unaligned=_stats([111.0]))
    table = bench.ag_matmul_table([row], "NVIDIA H200", 100)
    assert "median of 100 in 4 interleaved rounds" in table
    assert "| 1024 | 4096 | 4096 | 100.0 | 105.0 | 200.0 | n/a | 110.0 | 109.0 | 111.0 | " \
           "1.10 | 1.05 | 1.7e-03 |" in table
    header = table.splitlines()[2]
    assert header.count("|") == table.splitlines()[-1].count("|")
