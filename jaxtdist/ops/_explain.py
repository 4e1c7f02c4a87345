"""jaxtdist.explain: which path and config an op call would take, and why.

The same choice the op makes at trace time (``DistributedOp.choose``), from
shapes alone: no mesh, no runtime and no device needed (the runtime's
platform and tuning cache are used where it is initialized).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jaxtdist.ops._config import KernelConfig, Problem, config_dict
from jaxtdist.ops._op import distributed_op
from jaxtdist.ops._path import FUSED, Choice, Situation, situation_of, take_path
from jaxtdist.runtime._runtime import is_initialized, runtime

__all__ = ["explain"]


def explain(op, *args: Any, axis_size: int = 1, platform: str | None = None,
            compute_capability: str | None = None, config: Any = None,
            dtype: Any = jnp.bfloat16, **static: Any) -> Choice:
    """Which path a call of ``op`` would take, with which config, and why.

    Args:
      op: the op (``jaxtdist.ag_matmul``) or its name ("ag_matmul").
      *args: one rank's operands as the op takes them: arrays,
        ``jax.ShapeDtypeStruct``s, or shape tuples (of ``dtype``).
      axis_size: ranks in the group (the world size of ``axis_name``).
      platform: "gpu" or "cpu" (default: the runtime's, else JAX's default backend).
      compute_capability: the GPU's, e.g. "9.0" (default: the runtime's or JAX's
        first device's).
      config: as the op takes it (``{"PATH": "fused"}`` forces the kernels,
        ``{"PATH": "decomposed"}`` XLA's path; without PATH, ``JAXTDIST_PATH``'s).
      dtype: the dtype of operands given as shape tuples.
      **static: the op's other keywords (``causal=False``).

    Returns:
      A ``Choice``: ``path`` ("fused" or "decomposed"), ``runs``, ``reason``
      (the rule's inputs and threshold), ``inputs`` and, for the fused path, the
      kernel ``config`` (the defaults and ``config``'s keys; where the runtime is
      initialized, a tuned entry of its cache as the call would take it).
      ``print`` it for one line of text.

    Raises:
      ValueError: an unknown op, a bad ``PATH``, or a path the op does not have.

    Example:
      >>> print(jaxtdist.explain(jaxtdist.ag_matmul, (8, 4096), (4096, 1024),
      ...                        axis_size=4, platform="gpu", compute_capability="9.0"))
      jaxtdist.ag_matmul: decomposed path (jax.lax.all_gather + jnp.dot): all_gather
      moves 64 KiB per rank < 128 KiB: ...
    """
    decl = distributed_op(op)
    if not isinstance(axis_size, int) or axis_size < 1:
        raise ValueError(f"jaxtdist.explain: axis_size={axis_size!r} must be an int >= 1 (the "
                         "ranks of the group)")
    avals = tuple(_aval(a, dtype) for a in args)
    situation = _situation(axis_size, platform, compute_capability)
    asked, asker, kernel_config = take_path(decl.name, config_dict(decl.name, config))
    static = dict(static, config=kernel_config)
    local_applies = decl.local is not None and (decl.local_at_world_1 == "always"
                                                or situation.platform != "gpu")
    choice = decl.choose(situation, avals, static, asked, asker, local_applies=local_applies)
    if choice.path == FUSED and decl.path is not None and decl.path.config_type is not None:
        choice = dataclasses.replace(choice, config=_config(decl, situation, avals,
                                                            kernel_config))
    return choice


def _aval(a: Any, dtype) -> jax.ShapeDtypeStruct:
    if hasattr(a, "shape") and hasattr(a, "dtype"):
        return jax.ShapeDtypeStruct(tuple(a.shape), a.dtype)
    if isinstance(a, (tuple, list)) and all(isinstance(d, int) for d in a):
        return jax.ShapeDtypeStruct(tuple(a), jnp.dtype(dtype))
    raise ValueError(f"jaxtdist.explain: operands are arrays, jax.ShapeDtypeStructs or shape "
                     f"tuples of ints, got {type(a).__name__}: {a!r}")


def _situation(world: int, platform: str | None, capability: str | None) -> Situation:
    """The explained call's situation: the arguments', else the runtime's, else JAX's."""
    if is_initialized():
        base = situation_of(runtime(), world)
    else:
        device = jax.devices()[0]
        gpu = device.platform in ("gpu", "cuda")
        base = Situation("gpu" if gpu else "cpu", world,
                         str(getattr(device, "compute_capability", "")) if gpu else "")
    if platform not in (None, "gpu", "cpu"):
        raise ValueError(f"jaxtdist.explain: platform={platform!r}; allowed: 'gpu', 'cpu'")
    platform = platform or base.platform
    if capability is None:
        capability = base.compute_capability if platform == base.platform else ""
    return dataclasses.replace(base, platform=platform, compute_capability=capability)


def _config(decl, situation: Situation, avals: tuple, asked: dict | None) -> KernelConfig:
    """The kernel config the fused path takes: the defaults (the rule a variant's
    defaults start from, for ag_matmul), a tuned entry where the runtime has one
    and nothing is asked, then ``asked``."""
    config_type = decl.path.config_type
    problem = Problem(situation.platform, situation.world, tuple(decl.path.shape(*avals)),
                      jnp.dtype(avals[0].dtype).name, situation.sms)
    start = getattr(config_type, "for_overrides", None)
    cfg = start(problem, asked or {}) if start is not None else config_type.default(problem)
    if asked is None and is_initialized():
        asked = runtime().tuning.lookup(config_type.OP, problem.world, problem.shape,
                                        problem.dtype)
    cfg = config_type.settle(cfg, dict(asked or {}))
    cfg.validate(problem)
    return cfg
