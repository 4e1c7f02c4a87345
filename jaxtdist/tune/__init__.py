"""Autotuning of jaxtdist ops, with a persistent cache.

Ops look their config up in the cache per (device kind, world size, shape,
dtype): the user's cache file (``cache_path()``) first, then the configs
shipped with jaxtdist. ``tune_ag_matmul`` times candidates and records the
fastest; with ``JAXTDIST_AUTOTUNE=1`` an op tunes a shape it has no entry
for the first time it is traced. A later process reads the file and pays
no tuning cost.

Example:
  >>> jaxtdist.initialize(mesh)
  >>> jaxtdist.tune.tune_ag_matmul(1024, 4096, 4096, jnp.bfloat16, axis_name="tp")
"""

from jaxtdist.tune._cache import cache_path
from jaxtdist.tune._tuner import candidates_ag_matmul, tune_ag_matmul

__all__ = ["cache_path", "candidates_ag_matmul", "tune_ag_matmul"]
