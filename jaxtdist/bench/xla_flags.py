"""The ``xla+cudnn+flags`` contender of ``bench model``: XLA with the flags a MaxText
GPU user sets (latency-hiding scheduler, windowed-einsum collective matmul,
pipelined collectives), in a process of its own.

XLA reads ``XLA_FLAGS`` once, when the backend starts, and for every program of
the process: the flags cannot be turned on for one contender among others. So
the benchmark runs itself again with ``XLA_FLAGS`` extended (:func:`flags_env`)
and ``--contenders xla+cudnn+flags`` (:func:`command`), and merges that run's
rows into its own (:func:`merge_rows`); its times are then from another process,
not interleaved with the other contenders' rounds.

Every flag name here was accepted by jaxlib 0.10.2 (an unknown flag in
``XLA_FLAGS`` is fatal at start) and has a default in openxla/xla's
``xla/debug_options_flags.cc`` at commit 00ccad5 (not checked on jaxlib 0.11.2
itself: the GPU run's first line would say so).
``--xla_gpu_enable_async_collective_permute``, still in older guides, is gone
(collectives are asynchronous by default) and is not set.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence

__all__ = ["FLAGS", "FLAGS_CONTENDER", "command", "flags_active", "flags_env", "merge_rows",
           "run_flags_process"]

FLAGS_CONTENDER = "xla+cudnn+flags"

FLAGS = (
    # Schedules collectives to overlap with independent compute.
    "--xla_gpu_enable_latency_hiding_scheduler=true",
    # Collective matmul: every all-gather/reduce-scatter + dot becomes a windowed
    # einsum (a loop of collective-permutes and partial dots), on several streams.
    "--xla_gpu_threshold_for_windowed_einsum_mib=0",
    "--xla_gpu_multi_streamed_windowed_einsum=true",
    # Collectives of a loop's next iteration started in the current one.
    "--xla_gpu_enable_pipelined_all_gather=true",
    "--xla_gpu_enable_pipelined_reduce_scatter=true",
    "--xla_gpu_enable_pipelined_all_reduce=true",
    "--xla_gpu_enable_highest_priority_async_stream=true",
    "--xla_gpu_enable_while_loop_double_buffering=true",
    # Larger combined collectives (MaxText's GPU configs: 1 GiB / 128 MiB).
    "--xla_gpu_all_gather_combine_threshold_bytes=134217728",
    "--xla_gpu_reduce_scatter_combine_threshold_bytes=134217728",
    "--xla_gpu_all_reduce_combine_threshold_bytes=134217728",
)


def flags_active(env: Mapping[str, str]) -> bool:
    """Whether ``env``'s ``XLA_FLAGS`` holds every flag of :data:`FLAGS`."""
    have = set(env.get("XLA_FLAGS", "").split())
    return all(flag in have for flag in FLAGS)


def flags_env(env: Mapping[str, str]) -> dict[str, str]:
    """A copy of ``env`` with :data:`FLAGS` appended to its ``XLA_FLAGS`` (a user's
    own flags kept; where one names the same flag, ours come later and win).

    Example:
      >>> flags_env({"XLA_FLAGS": "--xla_dump_to=/tmp/d"})["XLA_FLAGS"].split()[0]
      '--xla_dump_to=/tmp/d'
    """
    out = dict(env)
    out["XLA_FLAGS"] = " ".join([env.get("XLA_FLAGS", "").strip(), *FLAGS]).strip()
    return out


def command(size: str, world: int, tp: int, iterations: int, rounds: int,
            json_path: str) -> list[str]:
    """The command line of the flags process: the same preset, mesh and iterations,
    only the flags contender, its results written to ``json_path``."""
    return [sys.executable, "-m", "jaxtdist.bench", "model", "--size", size,
            "--world", str(world), "--tp", str(tp), "--iterations", str(iterations),
            "--rounds", str(rounds), "--contenders", FLAGS_CONTENDER, "--json", json_path]


def merge_rows(rows: list[dict], other: Sequence[dict] | str, names: Sequence[str]) -> None:
    """Copies ``names``' entries of the flags process's rows into ``rows`` (matched by
    step and label, in place); a row the other run lacks gets an error entry, and so
    does every row where ``other`` is the flags process's failure (a string)."""
    if isinstance(other, str):
        for row in rows:
            for name in names:
                row[name] = dict(error=[other])
        return
    found = {(r["step"], r["label"]): r for r in other}
    for row in rows:
        theirs = found.get((row["step"], row["label"]))
        for name in names:
            if theirs is None or name not in theirs:
                row[name] = dict(error=[f"the flags process has no {row['label']} row"])
                continue
            row[name] = theirs[name]
            for key in ("variants", "output_rel_diff"):
                if name in theirs.get(key, {}):
                    row.setdefault(key, {})[name] = theirs[key][name]


def run_flags_process(argv: list[str], env: Mapping[str, str],
                      runner: Callable[..., subprocess.CompletedProcess] = subprocess.run
                      ) -> list[dict] | str:
    """Runs the flags process (``argv`` from :func:`command`; its json path is made
    here) and returns its rows, or its failure (exit status and the last lines of
    its output) for :func:`merge_rows`, never a silent gap.

    The benchmark runs it before building its own models: both processes use the
    same GPUs, and this one's memory pool only grows (``bench model`` turns off
    JAX's preallocation, which would hold 75% of each GPU from the start)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "flags.json")
        argv = list(argv)
        argv[argv.index("--json") + 1] = path
        done = runner(argv, env=dict(env), capture_output=True, text=True)
        if done.returncode == 0 and os.path.exists(path):
            with open(path) as f:
                return json.load(f)["rows"]
        tail = (done.stderr or done.stdout or "").strip().splitlines()[-3:]
        return f"flags process exited {done.returncode}: " + " | ".join(tail)[:300]
