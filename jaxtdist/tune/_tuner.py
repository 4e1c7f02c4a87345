"""The tuning engine: times an op's candidate configs on the devices and caches the
fastest. One engine for every op; ``tune/_cases.py`` sets each op up for it, and
``autotune_on_miss`` is what a call asks for under ``JAXTDIST_AUTOTUNE=1``."""

from __future__ import annotations

import concurrent.futures
import sys
import time
from collections.abc import Callable

import jax.numpy as jnp
import numpy as np

from jaxtdist.runtime._runtime import runtime
from jaxtdist.tune._registry import lookup, tunable_ops


def cupti_measure(fn, args, world: int, iterations: int) -> float:
    """Median over ``iterations`` of the kernel time per device, microseconds (CUPTI)."""
    from jax.experimental.mosaic.gpu import profiler

    _, per_iter = profiler.measure(fn, aggregate=False, iterations=iterations)(*args)
    if per_iter is None:
        raise RuntimeError("CUPTI saw no kernels")
    if iterations == 1:
        per_iter = [per_iter]
    return float(np.median([sum(t for _, t in kernels) * 1e3 / world for kernels in per_iter]))


def default_measure(platform: str) -> Callable:
    """CUPTI kernel time on GPUs; there is no meaningful kernel time on CPU."""
    if platform != "gpu":
        raise ValueError("jaxtdist.tune: timing needs GPUs (CUPTI kernel time); on CPU pass "
                         "measure= explicitly")
    return cupti_measure


def autotune_on_miss(op: str, problem, axis_name) -> dict | None:
    """The hook ``jaxtdist.tune`` installs on the runtime's tuning cache: tunes a call's problem
    that the cache misses and returns the chosen config; None for an op without a
    tuning case or where kernels cannot be timed (CPU): the call takes its defaults.

    Example:
      >>> autotune_on_miss("ag_matmul", problem, "tp")   # on GPUs
      {'BLOCK_M': 128, ...}
    """
    try:
        default_measure(problem.platform)
    except ValueError:
        return None
    if op not in tunable_ops():
        return None
    return tune(op, problem.shape, problem.dtype, axis_name=axis_name)["config"]


def _describe(overrides: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in overrides.items()) or "defaults"


def tune(op: str, shape, dtype=jnp.bfloat16, *, axis_name="tp", candidates: list[dict] | None = None,
         iterations: int = 10, measure: Callable | None = None, save: bool = True,
         progress: bool | None = None) -> dict:
    """Times configs of ``op`` for one per-rank problem and caches the fastest.

    Runs on the runtime's mesh over ``axis_name``; every candidate's output is
    checked against a float32 reference first, and a candidate that fails to
    compile, errs or is inaccurate is skipped (and reported in ``tried``).

    Args:
      op: a tunable op's name (``jaxtdist.tune.tunable_ops()``).
      shape: the op's per-rank shape key (ag_matmul: (m_shard, n, k)).
      dtype: operand dtype.
      axis_name: the mesh axis (or axes) of the group.
      candidates: config overrides to try (default: the op's search space).
      iterations: timed runs per candidate (median taken).
      measure: ``measure(fn, args, world, iterations) -> microseconds``;
        default CUPTI kernel time (GPUs only).
      save: write the choice to the tuning cache file.
      progress: print each candidate's result and the best so far to stderr
        (default: on GPUs).

    Returns:
      ``dict(config=..., variant=..., us=..., key=..., tried=[...], seconds=...)``.

    Example:
      >>> jaxtdist.initialize(mesh)
      >>> jaxtdist.tune.tune("ag_matmul", (1024, 4096, 4096), jnp.bfloat16, axis_name="tp")
    """
    tunable = lookup(op)
    rt = runtime()
    measure = measure or default_measure(rt.platform)
    progress = rt.platform == "gpu" if progress is None else progress
    started = time.time()
    # JAX's trace state is per thread: a thread of its own runs the candidates
    # eagerly even when tuning starts while the caller is tracing. The caller's
    # trace keeps its record of its last jaxtdist op (program order).
    caller_records = list(rt.order_records)
    try:
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxtdist-tune") as pool:
            case, tried = pool.submit(_time_candidates, tunable, axis_name, tuple(shape),
                                      jnp.dtype(dtype).name, candidates, iterations, measure,
                                      progress).result()
    finally:
        rt.order_records = caller_records
    timed = [r for r in tried if "us" in r]
    if not timed:
        raise RuntimeError(f"jaxtdist.tune: no {op} candidate ran for shape {tuple(shape)} "
                           f"{jnp.dtype(dtype).name}: {tried}")
    best = min(timed, key=lambda r: r["us"])
    result = dict(config=best["config"], variant=best["variant"], us=best["us"], tried=tried,
                  seconds=time.time() - started)
    if save:
        result["key"] = rt.tuning.store(op, case.world, case.shape, case.dtype, best["config"],
                                        best["variant"])
    return result


def _time_candidates(tunable, axis_name, shape, dtype, candidates, iterations, measure,
                     progress):
    case = tunable.setup(axis_name, shape, dtype)
    if candidates is not None:
        case.candidates = list(candidates)
    ref_norm = float(jnp.linalg.norm(case.reference))
    tried, best = [], None
    for i, overrides in enumerate(case.candidates):
        record = dict(overrides=dict(overrides))
        try:
            fn, cfg = case.compile(dict(overrides))
            out = fn(*case.args)
            err = float(jnp.linalg.norm(out.astype(jnp.float32) - case.reference)) / ref_norm
            record["rel_err"] = err
            if not err <= case.tolerance:
                raise ValueError(f"relative error {err:.2e} above {case.tolerance:.0e}")
            record["us"] = float(measure(fn, case.args, case.world, iterations))
            record["config"] = cfg.to_dict()
            record["variant"] = cfg.variant
            if best is None or record["us"] < best["us"]:
                best = record
        except Exception as e:  # noqa: BLE001 - a failing candidate is skipped, reported
            record["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        tried.append(record)
        if progress:
            got = f"{record['us']:.1f} us" if "us" in record else record["error"][:60]
            lead = f"; best {best['us']:.1f} us" if best else ""
            print(f"jaxtdist.tune {tunable.op} {shape} {dtype}: [{i + 1}/{len(case.candidates)}] "
                  f"{_describe(overrides)}: {got}{lead}", file=sys.stderr, flush=True)
    return case, tried
