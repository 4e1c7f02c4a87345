"""Autotuning of jaxtdist ops, with a persistent cache.

Ops look their config up in the runtime's config cache per (op, device kind,
world size, shape, dtype): the user's cache file (``cache_path()``) first,
then the configs shipped with jaxtdist. ``tune`` times an op's candidates
and records the fastest; with ``JAXTDIST_AUTOTUNE=1`` an op tunes a shape it
has no entry for the first time it is traced (GPUs): importing this package
installs that hook on the runtime's tuning cache. A later process reads the file and
pays no tuning cost. The tuner sits above the ops: it imports them, never the
other way round.

Example:
  >>> jaxtdist.initialize(mesh)
  >>> jaxtdist.tune.tune("ag_matmul", (1024, 4096, 4096), jnp.bfloat16, axis_name="tp")
"""

from jaxtdist.runtime._config_cache import TuningCache, cache_path
from jaxtdist.tune._cases import register_builtin_ops
from jaxtdist.tune._registry import TuningCase, Tunable, register, tunable_ops
from jaxtdist.tune._tuner import autotune_on_miss, tune

register_builtin_ops()
TuningCache.install_autotune(autotune_on_miss)


def tune_ag_matmul(m_shard: int, n: int, k: int, dtype=None, **kwargs) -> dict:
    """``tune("ag_matmul", (m_shard, n, k), dtype, **kwargs)``."""
    import jax.numpy as jnp
    return tune("ag_matmul", (m_shard, n, k), jnp.bfloat16 if dtype is None else dtype, **kwargs)


__all__ = ["Tunable", "TuningCase", "cache_path", "register", "tunable_ops", "tune",
           "tune_ag_matmul"]
