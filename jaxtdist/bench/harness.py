"""The benchmark harness every op's benchmark is declared on.

An op's benchmark module (``jaxtdist/bench/<op>.py``) builds, per problem
size, a dict of :class:`Contender` (jaxtdist and what it is compared with,
each with its inputs and float32 reference) and hands it to
:func:`interleaved`; it declares its markdown table as a list of
:class:`Column`. The harness does the rest, the same way for every op:

- Device-side timing: CUPTI through ``jax.experimental.mosaic.gpu.profiler``
  (:func:`profile`): every kernel of every GPU in one iteration, summed per
  device; ``mean_us`` is the median over iterations of the mean per device,
  ``min_us`` the median of the sum over kernel names of the fastest device.
- Interleaved rounds: every contender runs in the same process, one after
  another within a round, so that a drift of the GPUs' clocks reaches every
  contender alike. A contender that raises is reported, not fatal.
- Correctness: each contender's last output is checked against its reference
  (relative Frobenius error against float32, or exact equality), on fresh
  random inputs per problem size.
- Output: one JSON result (:func:`result`), a markdown table
  (:func:`markdown_table`), and a PNG plot of time against size, jaxtdist
  against each contender (:func:`plot`; matplotlib is imported only there,
  so benchmarks run without it and the plot is drawn later from the JSON).

Public names here are the API that probes outside the package use
(``tests/gpu/probe_perf.py``).
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any, Callable, Sequence

import numpy as np

from jaxtdist._timing import merge_rounds, profile

__all__ = [
    "Benchmark", "Column", "Contender", "check_output", "drawn_note", "err", "fastest",
    "float32_matmul", "hbm_peak", "interleaved", "markdown_table", "merge_rounds", "normal",
    "plot",
    "plot_data", "profile", "ratio", "rel_err", "result", "timing_note", "us", "us_min",
    "write_results",
]

OURS = "jaxtdist"


def rel_err(out, ref) -> float:
    """Relative Frobenius error of ``out`` against ``ref`` (in float32); inf if
    ``out`` holds a non-finite value. Tuples (gradients) count as one vector."""
    if isinstance(out, (tuple, list)):
        out = np.concatenate([np.asarray(o, np.float32).reshape(-1) for o in out])
        ref = np.concatenate([np.asarray(r, np.float32).reshape(-1) for r in ref])
    out = np.asarray(out, np.float32)
    ref = np.asarray(ref, np.float32)
    if not np.all(np.isfinite(out)):
        return float("inf")
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def check_output(stats: dict, out, ref, exact: bool) -> None:
    """Records ``exact`` (bitwise equality) or ``rel_err`` of ``out`` in ``stats``."""
    if exact:
        stats["exact"] = bool(np.array_equal(np.asarray(out), np.asarray(ref)))
    else:
        stats["rel_err"] = rel_err(out, ref)


@dataclasses.dataclass
class Contender:
    """One function timed in a benchmark row.

    ``world``: the devices whose kernel times are averaged (1 for a
    single-device function). ``ref``: the output's reference (None: not
    checked); ``exact``: compare bit for bit instead of by relative error.
    ``aligned``: jaxtdist's launch alignment on or off while this contender
    runs (None: left as it is; only jaxtdist contenders set it).
    """
    fn: Callable
    args: tuple
    world: int
    ref: Any = None
    exact: bool = False
    aligned: bool | None = None


def _set_alignment(aligned: bool | None):
    """Turns jaxtdist's launch alignment on or off; returns a function that
    restores it and reports how alignment went (or None)."""
    if aligned is None:
        return lambda: None
    from jaxtdist.runtime import runtime

    rt = runtime()
    if not hasattr(rt, "align_launches"):
        return lambda: None
    before = rt.align_launches
    rt.align_launches = aligned

    def restore():
        stats = rt.launch_alignment_stats() if hasattr(rt, "launch_alignment_stats") else None
        rt.align_launches = before
        return stats
    return restore


def _error(e: BaseException) -> str:
    text = str(e).splitlines()[0][:200] if str(e) else ""
    return f"{type(e).__name__}: {text}"


def interleaved(contenders: dict[str, Contender], iterations: int, rounds: int,
                measure: Callable = profile, warmup_rounds: int = 1) -> dict[str, dict]:
    """Times every contender in ``rounds`` rounds of ``iterations // rounds``
    iterations, one contender after another within a round, after
    ``warmup_rounds`` such rounds that are not kept (on 4 x H200 the first round
    of every small contender ran 1.3-5x its later rounds: the MoE dispatch at 128
    tokens per rank 98.6 us against 62-64, XLA's all_to_all 1208 against 213-239).

    Returns name -> stats over all its kept iterations (:func:`merge_rounds`),
    its last output checked against its reference; a contender that raised gets
    ``{"error": [...]}`` and is not run again. ``measure(fn, args, iterations,
    world) -> (out, stats)`` is :func:`profile` unless given.
    """
    per_round = max(1, iterations // max(1, rounds))
    samples: dict[str, list] = {name: [] for name in contenders}
    outs: dict[str, Any] = {}
    errors: dict[str, str] = {}
    warmup_rounds = max(0, warmup_rounds)
    for index in range(warmup_rounds + max(1, rounds)):
        for name, c in contenders.items():
            if name in errors:
                continue
            restore = _set_alignment(c.aligned)
            try:
                outs[name], t = measure(c.fn, c.args, per_round, c.world)
            except Exception as e:  # noqa: BLE001 - a contender's failure is a result
                errors[name] = _error(e)
                restore()
                continue
            alignment = restore()
            if alignment is not None:
                t["launch_alignment"] = alignment
            if index >= warmup_rounds:
                samples[name].append(t)
    stats = {}
    for name, c in contenders.items():
        if name in errors:
            stats[name] = dict(error=[errors[name]])
            continue
        stats[name] = merge_rounds(samples[name])
        if c.ref is not None:
            check_output(stats[name], outs[name], c.ref, c.exact)
    return stats


def fastest(candidates: dict[str, Callable], args: tuple, world: int, iterations: int,
            ref: Any = None, max_rel_err: float = 2e-2) -> tuple[Callable | None, dict]:
    """The fastest of a contender's configs (an outside library's kernel that has
    no default config of its own), as (function, its stats with ``config``), or
    (None, ``{"error": [...]}``) when none ran.

    ``candidates``: config label -> function of ``args``. A config that raises
    (one past the shared memory, say) or whose output is further than
    ``max_rel_err`` from ``ref`` is skipped, its reason kept for the error.
    """
    best, best_fn, errors = None, None, []
    for label, fn in candidates.items():
        try:
            out, stats = profile(fn, args, iterations, world)
        except Exception as e:  # noqa: BLE001 - an unsupported config is skipped
            errors.append(f"{label}: {_error(e)}")
            continue
        if ref is not None:
            e = rel_err(out, ref)
            if not e < max_rel_err:
                errors.append(f"{label}: relative error {e:.1e}")
                continue
        stats["config"] = label
        if best is None or stats["mean_us"] < best["mean_us"]:
            best, best_fn = stats, fn
    if best_fn is None:
        return None, dict(error=errors[:2] or ["no config to try (the library is missing)"])
    return best_fn, best


# HBM peak bytes/s per device kind (vendor figures), by the first key in a
# device_kind string: the bandwidth benches report a fraction of it.
HBM_PEAK = (("H200", 4.8e12), ("H100 PCIe", 2.0e12), ("H100", 3.35e12), ("H20", 4.0e12),
            ("A100", 2.0e12), ("MI300X", 5.3e12), ("MI325X", 6.0e12))


def hbm_peak(device_kind: str) -> float | None:
    """The HBM peak (bytes/s) of a ``jax.Device.device_kind``, None if unknown."""
    for key, peak in HBM_PEAK:
        if key in device_kind:
            return peak
    return None


def normal(seed: int, shape: tuple, dtype, scale: float = 1.0):
    """Fresh standard-normal inputs (times ``scale``) in ``dtype``, on the default device."""
    import jax
    import jax.numpy as jnp

    return (jax.random.normal(jax.random.key(seed), shape, jnp.float32) * scale).astype(dtype)


def float32_matmul(x, w, device=None) -> np.ndarray:
    """``x @ w`` in float32 (no TF32: HIGHEST precision), on ``device``, as numpy:
    the reference of every GEMM contender."""
    import jax
    import jax.numpy as jnp

    x32 = jax.device_put(jnp.asarray(x, jnp.float32), device)
    w32 = jax.device_put(jnp.asarray(w, jnp.float32), device)
    return np.asarray(jnp.dot(x32, w32, precision=jax.lax.Precision.HIGHEST))


# ---------------------------------------------------------------- tables


def us(entry: dict | None) -> str:
    """The mean-per-device time of a contender's stats, or n/a."""
    return f"{entry['mean_us']:.1f}" if entry and "mean_us" in entry else "n/a"


def us_min(entry: dict | None) -> str:
    """The fastest-device time of a contender's stats, or n/a."""
    return f"{entry['min_us']:.1f}" if entry and "min_us" in entry else "n/a"


def ratio(num: dict | None, den: dict | None) -> str:
    """``num``'s time over ``den``'s, or n/a."""
    if not num or not den or "mean_us" not in num or "mean_us" not in den:
        return "n/a"
    return f"{num['mean_us'] / den['mean_us']:.2f}"


def ratio_summary(rows: Sequence[dict], num: str, den: str, limit: float) -> str:
    """One line over a table's rows: geomean, p90 and max of ``num``'s time over
    ``den``'s, and how many are within ``limit`` (empty where no row has both)."""
    ratios = [r[num]["mean_us"] / r[den]["mean_us"] for r in rows
              if "mean_us" in (r.get(num) or {}) and "mean_us" in (r.get(den) or {})]
    if not ratios:
        return ""
    geo = float(np.exp(np.mean(np.log(ratios))))
    return (f"\n\n{num} / {den}: geomean {geo:.3f}, p90 {np.percentile(ratios, 90):.2f}, "
            f"max {max(ratios):.2f}, {sum(q <= limit for q in ratios)} of {len(ratios)} within "
            f"{limit:.2f}")


def drawn_note(res: dict) -> str:
    """The table note of a random-shape run: how many shapes, the seed and the
    option that draws them again (empty for a fixed list)."""
    if "random" not in res:
        return ""
    return (f"{res['random']} random model-layer shapes, seed {res['seed']} "
            f"(`--random {res['random']} --seed {res['seed']}`); ")


def err(entry: dict | None) -> str:
    """The correctness check of a contender's stats."""
    if not entry:
        return "n/a"
    if "exact" in entry:
        return str(entry["exact"])
    if "rel_err" in entry:
        return f"{entry['rel_err']:.1e}"
    return "n/a"


@dataclasses.dataclass(frozen=True)
class Column:
    """A markdown table column: its header and the cell of a result row."""
    header: str
    cell: Callable[[dict], str]


def markdown_table(title: str, columns: Sequence[Column], rows: Sequence[dict]) -> str:
    lines = [title, "", "| " + " | ".join(c.header for c in columns) + " |",
             "|" + "---|" * len(columns)]
    for r in rows:
        lines.append("| " + " | ".join(c.cell(r) for c in columns) + " |")
    return "\n".join(lines)


def timing_note(res: dict) -> str:
    """How a result's times were taken, for a table's title."""
    median = f"median of {res['iterations']}" if res.get("iterations") else "median"
    if res.get("rounds"):
        median += f" in {res['rounds']} interleaved rounds"
    return f"kernel time (us, CUPTI, {median}, mean per device)"


# ---------------------------------------------------------------- results


@dataclasses.dataclass(frozen=True)
class Benchmark:
    """One ``python -m jaxtdist.bench <name>`` subcommand.

    ``run(args) -> (rows, extra)``: the result rows (each with a ``size`` and
    a ``label`` for the plot) and extra result fields; ``table(result)``: the
    markdown; ``series``: the contenders the plot draws, jaxtdist first;
    ``arguments(parser)`` adds the subcommand's own options.
    """
    name: str
    op: str
    run: Callable
    table: Callable[[dict], str]
    series: tuple[str, ...]
    size_label: str
    arguments: Callable | None = None


def result(bench: Benchmark, rows: list[dict], *, device: str, world: int, iterations: int,
           rounds: int, started: float, **extra) -> dict:
    """The JSON document of one benchmark run."""
    import jax

    res = dict(op=bench.op, benchmark=bench.name, device=device, world=world,
               jax=jax.__version__, iterations=iterations, rounds=rounds,
               seconds=round(time.time() - started, 1),
               plot=dict(series=list(bench.series), size_label=bench.size_label))
    res.update(extra)
    res["rows"] = rows
    return res


def write_results(res: dict, table: str, json_path: str | None = None,
                  markdown_path: str | None = None) -> None:
    """Writes the JSON result and the markdown table where asked; prints the table."""
    if json_path:
        with open(json_path, "w") as f:
            json.dump(res, f, indent=1)
            f.write("\n")
    if markdown_path:
        with open(markdown_path, "w") as f:
            f.write(table + "\n")
    print(table, flush=True)


# ---------------------------------------------------------------- plot


def _row_size(row: dict) -> float | None:
    """A row's problem size: its ``size``, or (results written before the
    harness recorded one) ag_matmul's FLOP per device / all_gather's bytes."""
    if "mesh" in row:
        return None  # a 2-D mesh row: not on the 1-D size axis
    if "size" in row:
        return row["size"]
    if "bytes_per_rank" in row:
        return float(row["bytes_per_rank"])
    if {"m_shard", "n_shard", "k", "world"} <= row.keys():
        return 2.0 * row["world"] * row["m_shard"] * row["n_shard"] * row["k"]
    return None


def _series(res: dict) -> list[str]:
    declared = res.get("plot", {}).get("series")
    if declared:
        return list(declared)
    names = []
    for row in res["rows"]:
        for key, value in row.items():
            if isinstance(value, dict) and "mean_us" in value and key not in names:
                names.append(key)
    return sorted(names, key=lambda n: (n != OURS, names.index(n)))


def plot_data(res: dict) -> dict[str, list[tuple[float, float, str]]]:
    """Contender -> [(size, mean_us, label)] sorted by size: what :func:`plot` draws."""
    data: dict[str, list] = {}
    for name in _series(res):
        points = []
        for row in res["rows"]:
            size = _row_size(row)
            entry = row.get(name)
            if size is None or not isinstance(entry, dict) or "mean_us" not in entry:
                continue
            label = row.get("label") or "x".join(
                str(row[k]) for k in ("m_shard", "n_shard", "k") if k in row)
            points.append((float(size), float(entry["mean_us"]), label))
        if points:
            data[name] = sorted(points)
    return data


def _size_label(res: dict) -> str:
    label = res.get("plot", {}).get("size_label")
    if label:
        return label
    return "bytes per rank" if res.get("op") == "all_gather" else "GEMM FLOP per device"


def plot(results: Sequence[dict], png_path: str) -> None:
    """Draws one panel per result: kernel time against problem size, log-log,
    jaxtdist against each contender. Needs matplotlib (imported here only)."""
    try:
        import matplotlib
    except ImportError as e:
        raise RuntimeError("plotting needs matplotlib (pip install matplotlib); the "
                           "benchmarks themselves do not") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6.5 * len(results), 4.8),
                             squeeze=False)
    for ax, res in zip(axes[0], results):
        data = plot_data(res)
        for name, points in data.items():
            xs, ys = [p[0] for p in points], [p[1] for p in points]
            ours = name == OURS
            ax.plot(xs, ys, marker="o" if ours else ".", linewidth=2.2 if ours else 1.2,
                    zorder=3 if ours else 2, label=name)
            if ours:
                for x, y, label in points:
                    ax.annotate(label, (x, y), textcoords="offset points", xytext=(4, -10),
                                fontsize=6, color="0.35")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(_size_label(res))
        ax.set_ylabel("kernel time per device (us)")
        title = res.get("benchmark", res.get("op", "?"))
        ax.set_title(f"{title}: {res.get('world', '?')} x {res.get('device', '?')}",
                     fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        if data:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)


def bytes_label(n: int) -> str:
    """``n`` bytes as a table label: "16 KiB", "8 MiB", "100 B"."""
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"
