"""Kernel-time benchmarks of jaxtdist ops against JAX's own, side by side.

Usage::

    python -m jaxtdist.bench ag_matmul  [--world W] [--quick] [--json F] [--markdown F]
    python -m jaxtdist.bench all_gather [--world W] [--quick] [--json F] [--markdown F]
    python -m jaxtdist.bench untuned    [--json F] [--markdown F]
    python -m jaxtdist.bench grouped_matmul [--dtype fp8] [--quick] [--json F]
    python -m jaxtdist.bench moe_ll     [--world W] [--quick] [--json F] [--markdown F]
    python -m jaxtdist.bench plot F.json [G.json ...] --png F.png
    python -m jaxtdist.bench table F.json [--markdown F.md]

``harness`` holds the shared machinery (timing, interleaved rounds, checks,
tables, JSON, plot); one module per op declares its shapes, contenders and
reference (``ag_matmul``, ``all_gather``); ``shapes`` holds the problem sizes (the
tuned ag_matmul shapes are the tuner's, ``jaxtdist.tune.shapes``). Importing this package imports neither JAX nor the
op modules.
"""

from jaxtdist.bench.shapes import AG_MATMUL_UNTUNED_SHAPES, ALL_GATHER_BYTES
from jaxtdist.tune.shapes import AG_MATMUL_SHAPES

__all__ = ["AG_MATMUL_SHAPES", "AG_MATMUL_UNTUNED_SHAPES", "ALL_GATHER_BYTES"]
