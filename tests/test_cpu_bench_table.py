"""The benchmark harness's bookkeeping, without GPUs: rounds merged into one
median, interleaved contenders checked against their references, the tables,
the JSON round trip and the plot."""

from __future__ import annotations

import ast
import json
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtdist.bench import __main__ as cli
from jaxtdist.bench import ag_matmul, all_gather, harness, shapes

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _stats(samples):
    return dict(mean_us=float(np.median(samples)), min_us=float(np.median(samples)) - 1,
                samples_us=list(samples), min_samples_us=[v - 1 for v in samples],
                kernels=["k"])


def test_merge_rounds_takes_the_median_of_every_iteration():
    merged = harness.merge_rounds([_stats([10.0, 11.0, 30.0]), _stats([12.0, 13.0, 14.0])])
    assert merged["mean_us"] == 12.5 and merged["min_us"] == 11.5
    assert merged["round_medians_us"] == [11.0, 13.0]
    assert len(merged["samples_us"]) == 6


def test_interleaved_rounds_alternate_check_outputs_and_report_failures():
    calls = []
    ref = np.arange(6.0)

    def measure(fn, args, iterations, world):
        calls.append((fn.__name__, iterations, world))
        if fn.__name__ == "broken":
            raise RuntimeError("no kernel for this shape\nsecond line")
        return fn(), _stats([float(len(calls))] * iterations)

    def good(): return ref
    def bad(): return ref + 1
    def close(): return ref * (1 + 1e-3)
    def unchecked(): return None
    def broken(): return None

    stats = harness.interleaved(dict(
        good=harness.Contender(good, (), 4, ref, exact=True),
        bad=harness.Contender(bad, (), 4, ref, exact=True),
        close=harness.Contender(close, (), 1, ref),
        unchecked=harness.Contender(unchecked, (), 1),
        broken=harness.Contender(broken, (), 1, ref)), iterations=10, rounds=2, measure=measure)
    # Round by round, one contender after another, after an untimed round; a failing
    # one runs once.
    assert [c[0] for c in calls] == ["good", "bad", "close", "unchecked", "broken",
                                     "good", "bad", "close", "unchecked",
                                     "good", "bad", "close", "unchecked"]
    assert {c[1] for c in calls} == {5}
    assert stats["good"]["exact"] and not stats["bad"]["exact"]
    assert abs(stats["close"]["rel_err"] - 1e-3) < 1e-6  # float32 arithmetic
    assert "exact" not in stats["unchecked"] and "rel_err" not in stats["unchecked"]
    # The warm-up round's times (1.0 for "good") are not kept.
    assert stats["good"]["round_medians_us"] == [6.0, 10.0]
    assert len(stats["good"]["samples_us"]) == 10
    assert stats["broken"] == dict(error=["RuntimeError: no kernel for this shape"])


def test_rel_err_of_a_non_finite_output_is_infinite():
    assert harness.rel_err(np.array([1.0, np.nan]), np.ones(2)) == float("inf")
    assert harness.rel_err(np.ones(4), np.ones(4)) == 0.0


def _ag_row(**kw):
    row = dict(m_shard=1024, n_shard=4096, k=4096, world=4, dtype="bfloat16", rounds=4,
               size=2.0 * 4 * 1024 * 4096 * 4096, label="1024x4096x4096",
               local_gemm=_stats([100.0]), local_gemm_all_devices=_stats([105.0]),
               xla_allgather_dot=_stats([200.0]), pallas_mgpu=dict(error=["refused"]),
               jaxtdist=dict(_stats([110.0]), rel_err=1.7e-3),
               jaxtdist_unaligned=_stats([111.0]))
    row.update(kw)
    return row


def _result(bench, rows, world=4):
    return dict(op=bench.op, benchmark=bench.name, device="NVIDIA H200", world=world,
                iterations=100, rounds=4,
                plot=dict(series=list(bench.series), size_label=bench.size_label), rows=rows)


def test_ag_matmul_table_has_both_lower_bounds_and_the_2d_row():
    row_2d = _ag_row(mesh="dp=2 x tp=2", world=2)
    for key in ("size", "label"):
        del row_2d[key]
    table = ag_matmul.table(_result(ag_matmul.BENCHMARK, [_ag_row(), row_2d]))
    assert "median of 100 in 4 interleaved rounds" in table
    line = ("| 1024 | 4096 | 4096 | 100.0 | 105.0 | 200.0 | n/a | 110.0 | 109.0 | 111.0 | "
            "1.10 | 1.05 | 1.7e-03 |")
    assert table.count(line) == 2  # the 1-D row and the 2-D mesh's own table
    assert "dp=2 x tp=2 mesh" in table
    lines = table.splitlines()
    assert lines[2].count("|") == lines[4].count("|") == len(ag_matmul.COLUMNS) + 1


def test_untuned_table_reports_the_ratio_to_jnp_dot():
    rows = [dict(m=m, n=4096, k=4096, dtype="bfloat16", world=1, size=2.0 * m * 4096 * 4096,
                 label=f"{m}", jnp_dot=dict(_stats([100.0]), rel_err=2e-3),
                 jaxtdist=dict(_stats([us]), rel_err=2e-3, config_source="defaults"))
            for m, us in ((1024, 104.0), (16, 130.0))]
    rows.append(dict(m=1000, n=1000, k=1000, dtype="bfloat16", world=1, size=2e9, label="1000",
                     jnp_dot=_stats([7.0]), jaxtdist=dict(error=["ValueError: shape"])))
    table = ag_matmul.untuned_table(_result(ag_matmul.UNTUNED, rows, world=1))
    assert "| 1024 x 4096 x 4096 | bfloat16 | 100.0 | 104.0 | 1.04 | defaults | n/a | n/a | 2.0e-03 |" \
           in table
    assert "| 1000 x 1000 x 1000 | bfloat16 | 7.0 | n/a | n/a |" in table
    assert table.splitlines()[-1] == "ag_matmul / jnp.dot: at most 1.30; 1 of 2 rows within 1.05"


def test_all_gather_table_checks_both_runs_exact():
    rows = [dict(bytes_per_rank=16384, world=4, dtype="bfloat16", rounds=4, size=16384.0,
                 label="16 KiB", xla_all_gather=dict(_stats([10.0]), exact=True),
                 jaxtdist=dict(_stats([12.0]), exact=True),
                 jaxtdist_unaligned=dict(_stats([20.0]), exact=False))]
    table = all_gather.table(_result(all_gather.BENCHMARK, rows))
    assert "| 16384 | 10.0 | 12.0 | 20.0 | 1.20 | False |" in table


def test_json_round_trip_and_the_table_subcommand(tmp_path, capsys):
    res = _result(ag_matmul.BENCHMARK, [_ag_row()])
    table = ag_matmul.table(res)
    paths = tmp_path / "r.json", tmp_path / "r.md"
    harness.write_results(res, table, str(paths[0]), str(paths[1]))
    assert json.loads(paths[0].read_text()) == res
    assert paths[1].read_text() == table + "\n"
    capsys.readouterr()
    assert cli.main(["table", str(paths[0])]) == 0
    assert capsys.readouterr().out == table + "\n"


@pytest.mark.parametrize("content,match", [
    (None, r"cannot read .*missing.json: \[Errno 2\]"),
    ("{bad", r"cannot read .*r.json: Expecting property name"),
    ('{"x": 1}', r"r.json is not a results file written by --json \(no 'rows' list\)"),
    ('{"op": "nope", "rows": []}', r"r.json is the result of benchmark 'nope'; known: "),
])
def test_the_table_subcommand_names_a_bad_results_file(tmp_path, capsys, content, match):
    """argparse's error (exit code 2) naming the file, not a raw traceback."""
    path = tmp_path / ("missing.json" if content is None else "r.json")
    if content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit) as e:
        cli.main(["table", str(path)])
    assert e.value.code == 2
    assert re.search(match, capsys.readouterr().err)
    with pytest.raises(SystemExit):
        cli.main(["gemm", "--iterations", "0"])
    assert "--iterations 0: must be at least 1" in capsys.readouterr().err


def test_plot_data_sorts_by_size_and_reads_results_without_plot_fields():
    old = dict(op="ag_matmul", world=4, device="H200", rows=[
        {k: v for k, v in _ag_row(m_shard=16).items() if k not in ("size", "label")},
        {k: v for k, v in _ag_row().items() if k not in ("size", "label")},
        dict(_ag_row(), mesh="dp=2 x tp=2")])
    data = harness.plot_data(old)
    assert list(data)[0] == "jaxtdist" and "pallas_mgpu" not in data  # no time: no series
    assert [p[2] for p in data["jaxtdist"]] == ["16x4096x4096", "1024x4096x4096"]
    assert data["jaxtdist"][0][0] == 2.0 * 4 * 16 * 4096 * 4096
    new = _result(ag_matmul.BENCHMARK, [_ag_row()])
    assert list(harness.plot_data(new)) == ["jaxtdist", "local_gemm", "xla_allgather_dot"]


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib", reason="the plot needs matplotlib (pip install "
                                             "matplotlib); the benchmarks do not")
    res = [_result(ag_matmul.BENCHMARK, [_ag_row(), _ag_row(m_shard=16, size=1e9, label="16")]),
           _result(all_gather.BENCHMARK, [dict(bytes_per_rank=1 << 20, size=float(1 << 20),
                                                jaxtdist=_stats([30.0]),
                                                xla_all_gather=_stats([38.0]))])]
    for i, r in enumerate(res):
        (tmp_path / f"{i}.json").write_text(json.dumps(r))
    png = tmp_path / "plot.png"
    assert cli.main(["plot", str(tmp_path / "0.json"), str(tmp_path / "1.json"),
                     "--png", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_shape_lists_are_written_once():
    from jaxtdist.tune import shapes as tuned

    for rows in (tuned.AG_MATMUL_SHAPES, shapes.AG_MATMUL_UNTUNED_SHAPES,
                 shapes.ALL_GATHER_BYTES):
        assert len(rows) == len(set(rows)), "a row listed twice is timed twice"
    assert all(d in ("bfloat16", "float16") for *_, d in shapes.AG_MATMUL_UNTUNED_SHAPES)
    # The shape lists are plain data: they import nothing (jaxtdist and JAX included).
    for path in ("jaxtdist/bench/shapes.py", "jaxtdist/tune/shapes.py"):
        tree = ast.parse((ROOT / path).read_text())
        assert not [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
    init = ast.parse((ROOT / "jaxtdist/bench/__init__.py").read_text())
    imported = {n.module for n in ast.walk(init) if isinstance(n, ast.ImportFrom)}
    assert imported == {"jaxtdist.bench.shapes", "jaxtdist.tune.shapes"}


def test_matmul_rs_benchmark_finds_its_ops():
    """The benchmark imports the op module, not the functions the package exports
    under the same names (a contender that cannot be built shows as n/a)."""
    from jaxtdist.bench import matmul_rs as bench

    ops = bench._ops()
    for name in ("matmul_rs", "matmul_ar", "matmul_rs_kernels", "matmul_ar_kernels"):
        assert callable(getattr(ops, name)), name


def test_matmul_ar_benchmark_times_both_exchanges(faked_timing, monkeypatch):
    """``python -m jaxtdist.bench matmul_ar`` on a small shape (CPU, world 4, faked
    timing): the default, one shot and two shot all match the float32 product and
    have their columns."""
    from jaxtdist.bench import matmul_rs as bench

    monkeypatch.setattr(bench, "MATMUL_AR_NK", (48, 64))
    rows = bench.bench_matmul_ar([5], 2, 4, rounds=1)
    for name in ("jaxtdist", "jaxtdist_one_shot", "jaxtdist_two_shot", "xla_dot_psum"):
        assert rows[0][name]["rel_err"] < 1e-2, (name, rows[0][name])
    text = bench.ar_table(dict(world=4, device="cpu", rows=rows, iterations=2, rounds=1))
    assert "| one shot | two shot |" in text and "| 5 | 48 | 64 |" in text


def test_moe_tp_benchmark_runs_every_layer_and_tabulates(faked_timing):
    """``python -m jaxtdist.bench moe_tp`` on a small shape (CPU, world 4, faked
    timing): jaxtdist's layer (default, step-by-step and overlapped schedules) and
    the XLA twin all match the float32 reference."""
    from jaxtdist.bench import moe_tp

    rows = moe_tp.bench_moe_tp([(3, 32, 64, 4, 2)], 2, 4, rounds=1, dtype=np.float32,
                               train=True)
    for name in ("jaxtdist", "steps", "overlapped", "xla"):
        assert rows[0][name]["rel_err"] < 1e-5, (name, rows)
    # The training step's gradients against XLA's (float32 here).
    assert rows[0]["jaxtdist_train"]["rel_err"] < 1e-5, rows
    text = moe_tp.table(dict(world=4, device="cpu", rows=rows, iterations=2, rounds=1))
    assert "| 3 | 32, 64, 4, top-2 |" in text
    assert "Training step" in text and "| 3 | " in text.split("Training step")[1]
    assert "moe_tp" in cli.benchmarks()


def test_gemm_benchmark_checks_every_family_and_tabulates(faked_timing):
    """``python -m jaxtdist.bench gemm`` on small shapes (CPU, faked timing): each
    family's kernels at world 1 match the float32 product, the first call is
    timed, and the summary line counts the shapes."""
    from jaxtdist.bench import gemm

    rows = gemm.bench_gemm([("ag_matmul", 32, 32, 64), ("matmul_rs", 32, 48, 32),
                            ("matmul_ar", 4, 32, 32)], 2, rounds=1)
    for row in rows:
        assert row["kernels"]["rel_err"] < 1e-2 and row["jnp_dot"]["rel_err"] < 1e-2, row
        assert row["first_call_s"]["kernels"] > 0 and row["first_call_s"]["jnp_dot"] > 0
    text = gemm.table(dict(device="cpu", rows=rows, iterations=2, rounds=1))
    assert "| matmul_rs | 32 x 48 x 32 |" in text
    assert "geomean 1.000, p90 1.00, max 1.00, 3 of 3 within 1.15" in text


def _emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                                recv_sizes, *, axis_name):
    """``jax.lax.ragged_all_to_all``'s semantics from all_gather (XLA:CPU lacks the op):
    source s's slice for this rank lands at the offset s chose for it."""
    del recv_sizes
    me = jax.lax.axis_index(axis_name)
    ops, ins, sizes, outs = (jax.lax.all_gather(a, axis_name) for a in
                             (operand, input_offsets, send_sizes, output_offsets))
    row = jnp.arange(output.shape[0])
    for s in range(ops.shape[0]):
        start, size = outs[s, me], sizes[s, me]
        take = (row >= start) & (row < start + size)
        src = jnp.clip(ins[s, me] + row - start, 0, operand.shape[0] - 1)
        output = jnp.where(take[:, None], ops[s][src], output)
    return output


def test_moe_xla_contenders_match_the_reference():
    """The world-W benchmark's XLA contenders (pure JAX, world 4, float32): the
    all_to_all layer, and the ragged_all_to_all layer's offsets (the collective
    emulated: XLA:CPU has none), give x times each token's weight sum; the
    dispatch's layout reference agrees with the ops' own reference."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxtdist.bench import moe
    from tests.test_cpu_moe import ref_dispatch

    world, t, hidden, k, e = 4, 5, 16, 3, 8
    mesh = jax.make_mesh((world,), ("ep",), devices=jax.devices()[:world],
                         axis_types=(jax.sharding.AxisType.Auto,))
    rng = np.random.default_rng(7)
    x = rng.standard_normal((world * t, hidden)).astype(np.float32)
    ids = moe._routing(8, world * t, k, e)
    w = rng.random((world * t, k), np.float32)
    ref = x * w.sum(1, keepdims=True)
    args = tuple(jax.device_put(jnp.asarray(a), NamedSharding(mesh, P("ep"))) for a in (x, ids, w))
    specs = dict(mesh=mesh, in_specs=(P("ep"),) * 3, out_specs=P("ep"), check_vma=False)
    layers = dict(
        all_to_all=lambda x, i, w: moe.all_to_all_moe(x, i, w, "ep", world=world, num_experts=e),
        ragged=lambda x, i, w: moe.ragged_moe(x, i, w, "ep", world=world, num_experts=e,
                                              ragged_all_to_all=_emulated_ragged_all_to_all))
    for name, body in layers.items():
        out = jax.jit(jax.shard_map(body, **specs))(*args)
        np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-5, atol=1e-5, err_msg=name)
    # ragged's dispatch: every rank's rows, grouped by source rank, then padding.
    recv = np.asarray(jax.jit(jax.shard_map(lambda x, i, w: moe.ragged_moe(
        x, i, w, "ep", world=world, num_experts=e, combine=False,
        ragged_all_to_all=_emulated_ragged_all_to_all), **specs))(*args))
    rows = world * t * min(k, e // world)
    for d in range(world):
        pairs = (ids // (e // world) == d)
        want = np.concatenate([np.repeat(x[s * t:(s + 1) * t], pairs[s * t:(s + 1) * t].sum(1),
                                         axis=0) for s in range(world)])
        np.testing.assert_array_equal(recv[d * rows:d * rows + len(want)], want)
        assert not recv[d * rows + len(want):(d + 1) * rows].any()
    want, _, _, _ = ref_dispatch(x, ids, world, e, rows)
    np.testing.assert_array_equal(moe.expected_recv(x, ids, world, e),
                                  np.concatenate(list(want)).astype(np.float32))


@pytest.mark.parametrize("world", [1, 2])
def test_moe_benchmark_runs_and_tabulates(faked_timing, world):
    """``python -m jaxtdist.bench moe [--world 2]`` on a tiny shape (CPU, faked timing,
    bf16): at world 1 the kernels against the local computation; at world 2
    jaxtdist, all_to_all and ragged_all_to_all (which XLA:CPU lacks: its error is
    recorded) in one table, every combine that ran close to float32, recv_x exact."""
    from jaxtdist.bench import moe

    shape = (4, 32, 2, 4)
    if world == 1:
        rows = moe.bench_moe([shape], 2, rounds=1, heap_bytes=16 << 20)
        assert rows[0]["kernels_dispatch"]["exact"], rows
        assert rows[0]["kernels_layer"]["rel_err"] < 1e-2, rows
        text = moe.table(dict(world=1, device="cpu", rows=rows, iterations=2, rounds=1))
        assert "| 4 x 32, top-2, 4 | 1.5 | 1.5 | 1.00 |" in text
        return
    # The heap the GPU run asks for by default: every shape's workspaces at their
    # largest (one chunk per token), at least moe.HEAP_BYTES.
    assert moe.ep_heap_bytes(moe.MOE_SHAPES, 4) >= moe.HEAP_BYTES
    assert moe.ep_heap_bytes([(16384, 7168, 8, 256)], 4) > moe.HEAP_BYTES
    rows = moe.bench_moe_ep([shape], 2, world, rounds=1, heap_bytes=16 << 20)
    row = rows[0]
    assert row["jaxtdist_dispatch"]["exact"], row
    assert row["jaxtdist_fp8_dispatch"]["exact"], row  # fp8 rows and scales where they belong
    assert row["fp8_dispatch_bytes_per_rank"] < row["dispatch_bytes_per_rank"]
    ran = [n for n in moe.EP_SERIES if "error" not in row[n]]
    assert {"jaxtdist_layer", "jaxtdist_dispatch", "all_to_all_layer", "all_to_all_dispatch",
            "jaxtdist_dispatch_unzeroed", "jaxtdist_layer_unzeroed"} <= set(ran), row
    for name in ran:
        if name.endswith("_layer"):
            assert row[name]["rel_err"] < 1e-2, (name, row[name])
    for name in set(moe.EP_SERIES) - set(ran):
        assert name.startswith("ragged") and "ragged" in row[name]["error"][0].lower(), row
    assert row["pair_bytes_per_rank"] == 4 * 2 * 32 * 2
    assert 0 < row["dispatch_remote_bytes_per_rank"] <= row["dispatch_bytes_per_rank"] \
        <= row["pair_bytes_per_rank"]
    assert row["jaxtdist_dispatch"]["gb_per_s"] == row["dispatch_bytes_per_rank"] / 1.5e3
    res = dict(world=world, device="cpu", rows=rows, iterations=2, rounds=1)
    text = moe.table(res)
    lines = text.splitlines()
    assert lines[2].count("|") == lines[4].count("|") == len(moe.EP_COLUMNS) + 1
    assert "| 4 x 32, top-2, 4 |" in lines[4] and "expert parallel over 2 x cpu" in lines[0]
    for header in ("dispatch: jaxtdist", "dispatch: all_to_all", "dispatch: ragged_all_to_all",
                   "dispatch: jaxtdist / a2a", "dispatch: jaxtdist / ragged",
                   "jaxtdist dispatch GB/s", "d + c: jaxtdist", "d + c: jaxtdist / a2a",
                   "dispatch: jaxtdist, routing by XLA", "rel err: a2a", "rel err: ragged",
                   "dispatch: jaxtdist fp8 (MB/rank)", "fp8 / bf16", "exact fp8 recv",
                   "dispatch: jaxtdist, unused rows not zeroed",
                   "d + c: jaxtdist, unused rows not zeroed"):
        assert f"| {header} |" in lines[2], header
    assert " | 1.00 | " in lines[4]  # jaxtdist / a2a on equal faked times


def test_flash_decode_benchmark_times_the_paged_cache(faked_timing, monkeypatch):
    """``python -m jaxtdist.bench flash_decode`` at world 1 (CPU, faked timing, small
    heads): the paged contender reads the same cache through a shuffled block table
    and matches the reference like the contiguous kernel."""
    from jaxtdist.bench import flash_decode

    monkeypatch.setattr(flash_decode, "FLASH_DECODE_HEADS", (1, 4, 2, 32))
    rows = flash_decode.bench_flash_decode([64], 1, 1, rounds=1)
    row = rows[0]
    assert row["jaxtdist"]["rel_err"] < 2e-2 and row["jaxtdist_paged"]["rel_err"] < 2e-2, row
    text = flash_decode.table(dict(world=1, device="cpu", rows=rows, iterations=1, rounds=1))
    lines = text.splitlines()
    assert lines[2].count("|") == lines[4].count("|") == len(flash_decode.WORLD1_COLUMNS) + 1
    assert "| jaxtdist paged (16-position pages) | paged / contiguous |" in lines[2]
    # The read floor is timed, not checked (its output is no attention), and reads
    # exactly K and V: its maxima over the positions, added to the query.
    assert "rel_err" not in row["read_floor"] and row["read_floor"]["mean_us"] > 0
    assert "| read floor: XLA reduction over K, V |" in lines[2]
    q, k, v, n = flash_decode._operands(700, 1, 4, 2, 32, 64, jnp.float32)
    peak = np.max(np.asarray(k), 1) + np.max(np.asarray(v), 1)
    np.testing.assert_allclose(np.asarray(flash_decode._read_floor(q, k, v, n)),
                               np.asarray(q) + np.repeat(peak, 2, axis=1), rtol=1e-6)


def test_flash_decode_benchmark_chains_layers_and_reports_per_call(faked_timing, monkeypatch):
    """``bench flash_decode --layers 2``: each contender runs two calls back to back,
    checked against the reference of the chain, and its times are per call (the
    faked 1.5 us step over 2 layers)."""
    from jaxtdist.bench import flash_decode

    monkeypatch.setattr(flash_decode, "FLASH_DECODE_HEADS", (1, 4, 2, 32))
    rows = flash_decode.bench_flash_decode([64], 1, 1, rounds=1, layers=2)
    row = rows[0]
    for name in ("jaxtdist", "jaxtdist_paged", "op", "xla_decode"):
        assert row[name]["rel_err"] < 2e-2, (name, row[name])
        assert row[name]["mean_us"] == 0.75 and row[name]["samples_us"] == [0.5, 1.0], name
        assert row[name]["layers"] == 2
    assert "read_floor" not in row  # chained, XLA would hoist its reads
    # The chain's reference is not the single call's: a contender that ran once fails it.
    q, k, v, n = flash_decode._operands(700, 1, 4, 2, 32, 64, jnp.float32)
    once = flash_decode._reference(q, k, v, n)
    twice = flash_decode._chain_reference(q, k, v, n, 2)
    assert harness.rel_err(once, twice) > 1e-2
    text = flash_decode.table(dict(world=1, device="cpu", rows=rows, iterations=1, rounds=1,
                                   layers=2))
    assert "2 calls back to back per program" in text
    with pytest.raises(ValueError, match="layers=0"):
        flash_decode.bench_flash_decode([64], 1, 1, rounds=1, layers=0)


def test_profile_measures_again_when_kernel_order_differs(monkeypatch):
    """JAX's CUPTI profiler refuses a run whose kernels (several devices' in completion
    order) came in another order in some iteration: ``_timing.profile`` measures
    again, up to its attempts, and passes other errors on at once."""
    from jax.experimental.mosaic.gpu import profiler

    from jaxtdist import _timing

    calls = []

    def measure(fn, *, aggregate, iterations):
        def run(*args):
            calls.append(1)
            if len(calls) < 3:
                raise RuntimeError("Kernel names are not consistent across iterations")
            return fn(*args), [[("a", 0.001), ("b", 0.002)]] * iterations
        return run

    monkeypatch.setattr(profiler, "measure", measure)
    out, stats = _timing.profile(lambda x: x + 1, (1,), iterations=2, world=1)
    assert out == 2 and len(calls) == 3 and stats["kernels"] == ["a", "b"]
    assert stats["mean_us"] == pytest.approx(3.0)
    calls.clear()
    monkeypatch.setattr(_timing, "_ATTEMPTS", 2)
    with pytest.raises(RuntimeError, match="not consistent"):
        _timing.profile(lambda x: x, (1,), iterations=2, world=1)
    assert len(calls) == 2

    def broken(fn, *, aggregate, iterations):
        def run(*args):
            calls.append(1)
            raise RuntimeError("CUPTI profiling is not supported on this platform")
        return run

    calls.clear()
    monkeypatch.setattr(profiler, "measure", broken)
    with pytest.raises(RuntimeError, match="not supported"):
        _timing.profile(lambda x: x, (1,), iterations=2, world=1)
    assert len(calls) == 1


def test_ag_attention_benchmark_takes_head_dim_and_dtype(faked_timing, monkeypatch):
    """``bench ag_attention --head-dim 64 --dtype float32`` at world 1 (CPU, faked
    timing, 2 heads): the kernel runs at that head dim and type, matches the float32
    reference on the checked rows, and the table's title names both."""
    from jaxtdist.bench import ag_attention

    monkeypatch.setattr(ag_attention, "AG_ATTENTION_HEADS", (1, 2, 128))
    rows = ag_attention.bench_ag_attention([32], 1, 1, dtype=jnp.float32, rounds=1,
                                           head_dim=64)
    row = rows[0]
    assert (row["d"], row["dtype"]) == (64, "float32")
    assert row["jaxtdist"]["rel_err"] < 1e-4, row["jaxtdist"]
    text = ag_attention.table(dict(world=1, device="cpu", rows=rows, iterations=1, rounds=1))
    assert "D=64, causal, float32" in text.splitlines()[0]


@pytest.mark.parametrize("backward", [False, True])
def test_ag_attention_benchmark_draws_random_problems(faked_timing, monkeypatch, backward):
    """``bench ag_attention --random N --seed S`` at world 1 (CPU, faked timing, the
    draw swapped for tiny problems: GQA, non-causal, a length off the tiles): the op
    and its kernels match a float32 reference per problem, and the table names the
    seed and summarizes the ratios."""
    import argparse

    from jaxtdist.bench import ag_attention
    from jaxtdist.bench.random_shapes import AttentionProblem

    tiny = [AttentionProblem(2, 40, 4, 2, 64, True), AttentionProblem(1, 32, 2, 2, 32, False)]
    monkeypatch.setattr(ag_attention, "attention_problems", lambda n, seed: tiny[:n])
    args = argparse.Namespace(world=1, seqs=[], quick=False, random=2, seed=9, iterations=1,
                              rounds=1, backward=backward, head_dim=None, dtype="float32")
    rows, meta = ag_attention.run(args)
    assert [(r["b"], r["seq"], r["h"], r["h_kv"], r["d"], r["causal"]) for r in rows] == [
        tuple(p) for p in tiny]
    ours = ("jaxtdist", "jaxtdist_kernels") if backward else ("jaxtdist", "jaxtdist_op")
    for row in rows:   # the op, and its kernels forced (the gradients of both under backward)
        for name in ours:
            assert row[name]["rel_err"] < 1e-4, (row["label"], name, row[name])
    text = ag_attention.table(dict(device="cpu", rows=rows, iterations=1, rounds=1, **meta))
    assert "seed 9 (`--random 2 --seed 9`)" in text and "B=2 S=40 H=4/2 D=64" in text
    assert "non-causal" in text
