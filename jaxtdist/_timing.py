"""Device-side kernel timing (CUPTI), shared by the benchmarks and the tuner."""

from __future__ import annotations

import json
import statistics
from collections import defaultdict


# The CUDA prologue's context writer (csrc/ctx_writer.h): a kernel of each call's
# prologue, not of the op. Left out of the sums, as the prologue's copy and memset
# were before it (CUPTI's kernel list never held them), and reported apart.
PROLOGUE_KERNEL = "jaxtdist_write_ctx"

# Attempts at a measurement that JAX's profiler refuses because the kernels' order
# differed between iterations (see ``profile``).
_ATTEMPTS = 3


def profile(fn, args, iterations: int, world: int):
    """Runs ``fn(*args)`` ``iterations`` times under CUPTI.

    Returns ``(out, stats)``: ``stats["mean_us"]`` is the median over
    iterations of the kernel time summed per device and averaged over the
    ``world`` devices; ``stats["min_us"]`` the median of the per-kernel-name
    fastest device's sum (JAX's collective-matmul example's statistic);
    ``stats["kernel_us"]`` the median per kernel name (where the time goes).
    The prologue's context writer (``PROLOGUE_KERNEL``) is in none of these: its
    median time per iteration and device is ``stats["prologue_us"]``.
    """
    from jax.experimental.mosaic.gpu import profiler

    for attempt in range(_ATTEMPTS):
        try:
            out, per_iter = profiler.measure(fn, aggregate=False, iterations=iterations)(*args)
            break
        except RuntimeError as e:
            # CUPTI lists several devices' kernels as they complete, an order that
            # can differ between iterations; JAX's profiler then refuses to split
            # the list ("Kernel names are not consistent across iterations": a
            # moe_tp contender on 4 x H200). The kernels themselves ran: measure
            # again.
            if "not consistent" not in str(e) or attempt == _ATTEMPTS - 1:
                raise
    if per_iter is None:
        raise RuntimeError("CUPTI saw no kernels")
    if iterations == 1:
        per_iter = [per_iter]
    means, mins, prologue = [], [], []
    per_name = defaultdict(list)  # name -> per-iteration time, summed over launches, per device
    for kernels in per_iter:
        prologue.append(sum(t for name, t in kernels if name == PROLOGUE_KERNEL) * 1e3 / world)
        kernels = [(name, t) for name, t in kernels if name != PROLOGUE_KERNEL]
        it = defaultdict(float)
        for name, t in kernels:
            it[name] += t * 1e3 / world
        for name, t in it.items():
            per_name[name].append(t)
        means.append(sum(t for _, t in kernels) * 1e3 / world)
        fastest = defaultdict(lambda: float("inf"))
        for name, t in kernels:
            fastest[name] = min(fastest[name], t)
        mins.append(sum(fastest.values()) * 1e3)
    names = sorted({name for name, _ in per_iter[0]} - {PROLOGUE_KERNEL})
    kernel_us = {name: round(statistics.median(ts), 3) for name, ts in per_name.items()}
    return out, dict(mean_us=statistics.median(means), min_us=statistics.median(mins),
                     kernels=names, kernel_us=kernel_us, samples_us=means,
                     min_samples_us=mins, prologue_us=statistics.median(prologue))


def merge_rounds(rounds: list[dict]) -> dict:
    """One ``profile`` stats dict from several rounds of the same function: the
    medians over every round's iterations (the last round's other keys kept)."""
    means = [v for r in rounds for v in r["samples_us"]]
    mins = [v for r in rounds for v in r["min_samples_us"]]
    return dict(rounds[-1], mean_us=statistics.median(means), min_us=statistics.median(mins),
                samples_us=means, min_samples_us=mins,
                round_medians_us=[r["mean_us"] for r in rounds])


def write_results(result: dict, table: str, json_path: str | None,
                  markdown_path: str | None) -> None:
    """Writes raw results (JSON) and the markdown table where asked, prints the table."""
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=1)
    if markdown_path:
        with open(markdown_path, "w") as f:
            f.write(table + "\n")
    print(table)
