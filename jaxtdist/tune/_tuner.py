"""Chooses ag_matmul configs by timing candidates on the devices (CUPTI)."""

from __future__ import annotations

import concurrent.futures
import time

import jax
import jax.numpy as jnp
import numpy as np


def candidates_ag_matmul(world: int, m_shard: int, n: int, k: int, dtype) -> list[dict]:
    """Config overrides worth timing for one GPU problem (see ``default_config``),
    those that fit the problem (e.g. SPLIT_K within K's blocks)."""
    from jaxtdist.ops.ag_matmul import check_config, default_config, settle_config

    fitting, seen = [], set()
    for overrides in _gpu_candidates(world, m_shard, n, k, dtype):
        config = settle_config(default_config("gpu", world, m_shard, n, k, dtype), overrides)
        try:
            check_config(config, world, m_shard, k, n, jnp.dtype(dtype).itemsize)
        except ValueError:
            continue
        if tuple(sorted(config.items())) in seen:  # the defaults again: timed once
            continue
        seen.add(tuple(sorted(config.items())))
        fitting.append(overrides)
    return fitting


def _gpu_candidates(world: int, m_shard: int, n: int, k: int, dtype) -> list[dict]:
    rows = world * m_shard
    if jnp.dtype(dtype).itemsize == 4:
        return [{}, dict(NUM_COMM=8), dict(NUM_COMM=32)]
    if rows <= 128:  # decode: one tile over all rows; split K to fill the GPU
        # Producers push into peers' inboxes (one NVLink crossing, no wait),
        # a flag per 4 rows.
        push4 = dict(PRODUCER="push", CHUNK_ROWS=4, COPY_BLOCK_C=1024)
        return [{},
                dict(SPLIT_K=1, BLOCK_N=32, BLOCK_K=256),
                dict(SPLIT_K=8, BLOCK_N=128),
                dict(NUM_COMM=8, CHUNK_ROWS=4, COPY_BLOCK_C=1024),
                dict(NUM_COMM=32),
                dict(SPLIT_K=2, BLOCK_N=32),
                dict(PRODUCER="push"),
                dict(push4, NUM_COMM=8),
                dict(PRODUCER="push", SPLIT_K=2, BLOCK_N=32),
                # One wave: producers plus split-K tiles within what the SMs hold
                # at once (at 64 rows, 132 programs of 1 per SM, or 264 of <= 96 kB).
                dict(push4, NUM_COMM=4, BLOCK_N=128, BLOCK_K=128, SPLIT_K=4, num_stages=3),
                dict(push4, NUM_COMM=4, BLOCK_N=64, BLOCK_K=128, SPLIT_K=2, num_stages=3),
                dict(push4, NUM_COMM=8, BLOCK_N=64, BLOCK_K=64, SPLIT_K=4),
                dict(push4, NUM_COMM=8, BLOCK_N=128, BLOCK_K=64, SPLIT_K=8),
                dict(push4, NUM_COMM=8, BLOCK_N=64, BLOCK_K=64, SPLIT_K=4, num_stages=6),
                dict(push4, NUM_COMM=4, BLOCK_N=64, BLOCK_K=64, SPLIT_K=4),
                dict(push4, NUM_COMM=8, BLOCK_N=32, BLOCK_K=128, SPLIT_K=2),
                dict(push4, NUM_COMM=8, BLOCK_N=128, BLOCK_K=32, SPLIT_K=8),
                dict(PRODUCER="push", NUM_COMM=4, BLOCK_N=64, SPLIT_K=2),
                dict(PRODUCER="push", NUM_COMM=4, BLOCK_N=32, BLOCK_K=256, SPLIT_K=1)]
    if m_shard <= 256:  # few row tiles: narrower N tiles, finer chunks
        # The pointer kernel with SM producers (explicit: the default may be the
        # copy-engine kernel where TMA fits).
        block_m = min(128, max(16, 1 << (m_shard - 1).bit_length()))
        sm = dict(TMA=False, PRODUCER="sm", ALL_ROWS=False, BLOCK_M=block_m, BLOCK_N=64,
                  BLOCK_K=128, GROUP_M=8, NUM_COMM=16, CHUNK_ROWS=min(16, block_m),
                  COPY_BLOCK_C=256, num_warps=4, num_stages=4)
        ce = dict(TMA=True, PRODUCER="ce", BLOCK_K=64, num_stages=4)
        return [{},
                sm,
                dict(sm, NUM_COMM=32),
                dict(sm, CHUNK_ROWS=32, NUM_COMM=8),
                dict(sm, BLOCK_N=128, BLOCK_K=64),
                dict(sm, SPLIT_K=2, BLOCK_N=128, BLOCK_K=64),
                dict(sm, PRODUCER="push"),
                # Copy engines gather, every SM in a persistent TMA GEMM (row
                # tiles must divide m_shard: check_config drops those that do not).
                dict(ce, BLOCK_M=128, BLOCK_N=128, CHUNK_ROWS=128, num_warps=8),
                dict(ce, BLOCK_M=128, BLOCK_N=64, CHUNK_ROWS=128, num_warps=4),
                dict(ce, BLOCK_M=64, BLOCK_N=128, CHUNK_ROWS=64, num_warps=4),
                dict(ce, BLOCK_M=128, BLOCK_N=128, CHUNK_ROWS=128, num_warps=8,
                     PUSH_ORDER="parallel")]
    # Large: the best pointer-GEMM configs of earlier sweeps (4 x H200), and the
    # persistent TMA kernel (refused by check_config where it does not fit).
    return [{},
            dict(CHUNK_ROWS=32, NUM_COMM=24),
            dict(COPY_BLOCK_C=256, num_stages=4),
            dict(TMA=True),
            dict(TMA=True, CHUNK_ROWS=32, NUM_COMM=24),
            dict(TMA=True, NUM_COMM=8),
            dict(TMA=True, BLOCK_N=128, num_stages=4, CHUNK_ROWS=32),
            # The gather on the copy engines, every SM in the GEMM.
            dict(TMA=True, PRODUCER="ce", CHUNK_ROWS=128),
            dict(TMA=True, PRODUCER="ce", CHUNK_ROWS=256),
            dict(TMA=True, PRODUCER="ce", CHUNK_ROWS=512),
            # Coarse chunks: fewer driver calls a call where the host sets the
            # pace of back-to-back calls (docs/perf, run BK).
            dict(TMA=True, PRODUCER="ce", CHUNK_ROWS=1024),
            dict(TMA=True, PRODUCER="ce", CHUNK_ROWS=256, GROUP_M=16),
            # The last partial wave cut along K over every SM, or dealt whole.
            dict(TMA=True, PRODUCER="ce", CHUNK_ROWS=256, STREAM_K=True),
            dict(TMA=True, PRODUCER="ce", CHUNK_ROWS=256, STREAM_K=False),
            # Copy engines push to every peer at once (the default: one after another).
            dict(TMA=True, PRODUCER="ce", CHUNK_ROWS=256, PUSH_ORDER="parallel"),
            dict(TMA=True, PRODUCER="ce", CHUNK_ROWS=128, PUSH_ORDER="parallel")]


def cupti_measure(fn, args, world: int, iterations: int) -> float:
    """Median kernel time per device, microseconds (CUPTI)."""
    from jaxtdist._timing import profile

    return profile(fn, args, iterations, world)[1]["mean_us"]


def default_measure(platform: str):
    """CUPTI kernel time on GPUs; there is no meaningful kernel time on CPU."""
    if platform != "gpu":
        raise ValueError("jaxtdist.tune: timing needs GPUs (CUPTI kernel time); on CPU pass "
                         "measure= explicitly")
    return cupti_measure


def tune_ag_matmul(m_shard: int, n: int, k: int, dtype=jnp.bfloat16, *, axis_name="tp",
                   candidates: list[dict] | None = None, iterations: int = 10,
                   measure=None, save: bool = True) -> dict:
    """Times ``ag_matmul`` configs for one problem and caches the fastest.

    Runs on the runtime's mesh with ``x`` rows sharded over ``axis_name``;
    every candidate's output is checked against a float32 reference first,
    and a candidate that fails to compile, errs or is inaccurate is skipped.

    Args:
      m_shard, n, k: the per-rank problem: x [m_shard, k], w [k, n].
      dtype: operand dtype.
      axis_name: the mesh axis (or axes) to gather over.
      candidates: config overrides to try (default: ``candidates_ag_matmul``).
      iterations: timed runs per candidate (median taken).
      measure: ``measure(fn, args, world, iterations) -> microseconds``;
        default CUPTI kernel time (GPUs only).
      save: write the choice to the tuning cache file.

    Returns:
      ``dict(config=..., us=..., key=..., tried=[...])``.

    Example:
      >>> jaxtdist.initialize(mesh)
      >>> jaxtdist.tune.tune_ag_matmul(1024, 4096, 4096, jnp.bfloat16, axis_name="tp")
    """
    from jaxtdist.ops import _call
    from jaxtdist.runtime._runtime import runtime

    rt = runtime()
    layout = _call.check_axis(rt, axis_name, "tune_ag_matmul")
    world = layout.world
    measure = measure or default_measure(rt.platform)
    if candidates is None:
        candidates = candidates_ag_matmul(world, m_shard, n, k, dtype)
    axes = layout.axes if len(layout.axes) > 1 else layout.axes[0]
    started = time.time()
    # JAX's trace state is per thread: a thread of its own runs the candidates
    # eagerly even when tuning starts while the caller is tracing.
    # The caller's trace keeps its record of its last jaxtdist op (program order).
    caller_last_output = rt.last_traced_output
    try:
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxtdist-tune") as pool:
            tried = pool.submit(_time_candidates, rt, axis_name, axes, world, m_shard, n, k,
                                dtype, candidates, iterations, measure).result()
    finally:
        rt.last_traced_output = caller_last_output
    timed = [r for r in tried if "us" in r]
    if not timed:
        raise RuntimeError(f"jaxtdist.tune: no ag_matmul candidate ran for m_shard={m_shard} "
                           f"n={n} k={k} {jnp.dtype(dtype).name}: {tried}")
    best = min(timed, key=lambda r: r["us"])
    result = dict(config=best["config"], us=best["us"], tried=tried,
                  seconds=time.time() - started)
    if save:
        result["key"] = rt.tuning.store(
            "ag_matmul", world, (m_shard, n, k), dtype, best["config"],
            dict(us=best["us"], tried=[{k2: v for k2, v in r.items() if k2 != "config"}
                                       for r in tried],
                 jax=jax.__version__, triton=_triton_version()))
    return result


def _time_candidates(rt, axis_name, axes, world, m_shard, n, k, dtype, candidates, iterations,
                     measure) -> list[dict]:
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxtdist.ops.ag_matmul import ag_matmul_with_gathered, resolve_config

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((world * m_shard, k), np.float32) / np.sqrt(k), dtype)
    w = jnp.asarray(rng.standard_normal((k, world * n), np.float32), dtype)
    xs = jax.device_put(x, NamedSharding(rt.mesh, P(axes, None)))
    ws = jax.device_put(w, NamedSharding(rt.mesh, P(None, axes)))
    specs = dict(mesh=rt.mesh, in_specs=(P(axes, None), P(None, axes)), out_specs=P(None, axes),
                 check_vma=False)
    # The float32 reference runs on the devices too (host numpy takes minutes at LLM sizes).
    reference = jax.jit(jax.shard_map(
        lambda xb, wb: jnp.dot(jax.lax.all_gather(xb.astype(jnp.float32), axis_name, tiled=True),
                               wb.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST),
        **specs))
    ref = reference(xs, ws)
    ref_norm = float(jnp.linalg.norm(ref))
    tol = 1e-5 if jnp.dtype(dtype).itemsize == 4 else 2e-2
    tried = []
    for overrides in candidates:
        record = dict(overrides=dict(overrides))
        try:
            # An explicit config skips the cache: defaults + this candidate.
            cfg = resolve_config(rt, axis_name, world, m_shard, n, k, dtype, overrides)

            def body(xb, wb, cfg=cfg):
                return ag_matmul_with_gathered(xb, wb, axis_name, config=cfg)[0]

            fn = jax.jit(jax.shard_map(body, **specs))
            err = float(jnp.linalg.norm(fn(xs, ws).astype(jnp.float32) - ref)) / ref_norm
            record["rel_err"] = err
            if not err <= tol:
                raise ValueError(f"relative error {err:.2e} above {tol:.0e}")
            record["us"] = float(measure(fn, (xs, ws), world, iterations))
            record["config"] = cfg
        except Exception as e:  # noqa: BLE001 - a failing candidate is skipped, reported
            record["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        tried.append(record)
    return tried


def _triton_version() -> str:
    import triton

    return triton.__version__
