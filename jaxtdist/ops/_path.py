"""Which path a call takes: jaxtdist's fused kernels, or the decomposed form a JAX
user has (XLA's collective and cuBLAS's dot; cuDNN's attention; at world 1 the
op's local computation), per shape, dtype and world size.

The op mechanism (``_op.DistributedOp``) asks every call for its path once, at
trace time: the op's declared ``PathRule`` decides where it has one, the
mechanism's default elsewhere (world 1: the local computation where
``local_at_world_1`` applies; world > 1: the kernels). A call's ``config`` may
force either path with its ``PATH`` key; ``jaxtdist.explain`` shows the choice
and the rule's inputs, and the ``jaxtdist`` logger names it at DEBUG level.

Example (an op's declaration, and what a call of it would do)::

    _AG_MATMUL = DistributedOp("ag_matmul", ..., decomposed=_decomposed,
                               path=AG_MATMUL_PATH)   # a gemm_rule (_gemm_paths)
    jaxtdist.explain(jaxtdist.ag_matmul, (8, 4096), (4096, 1024), axis_size=4,
                     platform="gpu").path             # 'decomposed'
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

import jax.numpy as jnp

__all__ = ["AUTO", "DECOMPOSED", "ENV_PATH", "FUSED", "PATHS", "Choice", "PathRule", "Situation",
           "gemm_rule", "log_choice", "situation_of", "take_path"]

FUSED, DECOMPOSED, AUTO = "fused", "decomposed", "auto"
# What ``config={"PATH": ...}`` may ask for.
PATHS = (AUTO, FUSED, DECOMPOSED)
PATH_KEY = "PATH"
# The path of calls whose config asks none (default "auto"): "fused" keeps the
# kernels everywhere (test suites of the kernels; several processes on one GPU,
# where XLA's collectives fail), "decomposed" takes what JAX offers wherever the
# op has it.
ENV_PATH = "JAXTDIST_PATH"

logger = logging.getLogger("jaxtdist")


@dataclasses.dataclass(frozen=True)
class Situation:
    """What a rule may look at besides the operands.

    Attributes:
      platform: "gpu" or "cpu" (the Triton interpreter).
      world: ranks in the group.
      compute_capability: the GPU's ("9.0" on Hopper), "" on CPU.
      sms: the GPU's streaming multiprocessors (for configs).
    """
    platform: str
    world: int
    compute_capability: str = ""
    sms: int = 132


def situation_of(rt, world: int) -> Situation:
    """The situation of a call on runtime ``rt`` in a group of ``world`` ranks."""
    capability = ""
    if rt.platform == "gpu":
        device = rt.mesh.devices.flat[rt.local_positions[0]]
        capability = str(getattr(device, "compute_capability", ""))
    return Situation(rt.platform, world, capability, rt.sms)


@dataclasses.dataclass(frozen=True)
class Choice:
    """A call's path and why.

    Attributes:
      op: the op's name.
      path: "fused" (jaxtdist's kernels) or "decomposed" (what JAX offers: the
        local computation at world 1, XLA's collective and dot above).
      runs: what runs, in words.
      reason: why, with the rule's inputs and threshold.
      inputs: the rule's inputs, by name.
      config: the kernel config the fused path takes (``jaxtdist.explain`` only).
    """
    op: str
    path: str
    runs: str
    reason: str
    inputs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    config: Any = None

    def __str__(self) -> str:
        text = f"jaxtdist.{self.op}: {self.path} path ({self.runs}): {self.reason}"
        if self.config is not None:
            text += f"\n  config: {self.config}"
        return text


@dataclasses.dataclass(frozen=True)
class PathRule:
    """An op's declared path rule.

    Attributes:
      choose: ``choose(situation, *args, **static) -> Choice | None``: the
        op's choice with no ``PATH`` asked for; None leaves it to the
        mechanism's default.
      config_type: the op's ``KernelConfig`` (for ``explain``'s config).
      shape: ``shape(*args) -> tuple``: the op's problem shape key (the
        tuning cache's), for ``explain``'s config.
      decomposed: what the decomposed path runs at world > 1, in words.
      local: what the local computation (world 1) runs, in words.
    """
    choose: Callable[..., Choice | None]
    config_type: type | None = None
    shape: Callable[..., tuple] | None = None
    decomposed: str = ""
    local: str = ""


def take_path(op: str, config: dict | None) -> tuple[str, str, dict | None]:
    """(the path asked for, who asked, the config left for the kernels): ``config``'s
    ``PATH`` taken out, else ``JAXTDIST_PATH``'s, else "auto"; an empty remainder
    is None, so that the tuning cache still applies."""
    if not config or PATH_KEY not in config:
        asked = os.environ.get(ENV_PATH, AUTO) or AUTO
        _check_path(op, asked, f"the environment variable {ENV_PATH}")
        return asked, f"{ENV_PATH}={asked!r}", config
    rest = dict(config)
    asked = rest.pop(PATH_KEY)
    _check_path(op, asked, "config PATH")
    return asked, f"config PATH={asked!r}", rest or None


def _check_path(op: str, asked, where: str) -> None:
    if asked not in PATHS:
        raise ValueError(f"jaxtdist.{op}: {where} is {asked!r}; allowed: "
                         f"{', '.join(repr(p) for p in PATHS)} ('fused': jaxtdist's kernels, "
                         "'decomposed': XLA's collective and dot, or the local computation "
                         "at world 1)")


def log_choice(choice: Choice) -> None:
    """The choice at DEBUG level on the ``jaxtdist`` logger (once per trace)."""
    logger.debug("%s", choice)


def _kib(nbytes: float) -> str:
    return f"{nbytes / 1024:.0f} KiB" if nbytes < 1 << 20 else f"{nbytes / (1 << 20):.1f} MiB"


def gemm_rule(collective: str, *, min_bytes: int, bytes_of: Callable[[int, int, int], int],
              flops_of: Callable[[int, int, int, int], int], runs: str, basis: str,
              config_type: type | None = None) -> PathRule:
    """The world > 1 rule of a GEMM op fused with ``collective``: the fused kernels
    where the collective moves at least ``min_bytes`` per rank, else the
    decomposed form. Only on GPUs: under the interpreter the kernels always run
    (the threshold is a GPU timing, and the CPU tests exercise the kernels).

    The model (per rank; the numbers are in ``docs/performance.md``): the
    decomposed form costs ``T_dot + T_xla(bytes)`` (the collective is not
    overlapped), the fused kernels ``r * T_dot + t_sync`` (the exchange hidden
    under the tiles, plus the kernels' own synchronisation: prologue and flags
    in peer memory). Fused wins where ``T_xla(bytes) > t_sync + (r - 1) * T_dot``.
    For tiny problems T_dot vanishes and the question is the collective's cost
    against ``t_sync``: ``min_bytes`` is where XLA's collective reaches it.
    ``r`` (the kernels' GEMM core against cuBLAS) is the tile rule's concern
    and is not modelled.

    Args:
      collective: the XLA collective of the decomposed form (for the reason).
      min_bytes: bytes per rank the collective moves from which the kernels win.
      bytes_of: ``bytes_of(m, n, k)``: elements per rank the collective moves
        (times the itemsize here), for x [m, k] and w [k, n].
      flops_of: ``flops_of(m, n, k, world)``: the GEMM's FLOPs per rank (reported).
      runs: what the decomposed form runs, in words.
      basis: where ``min_bytes`` comes from, in words (for the reason).
      config_type: the op's ``KernelConfig`` (for ``explain``).
    """
    def choose(situation: Situation, x, w, **static) -> Choice | None:
        del static
        if situation.world == 1:
            return None  # the mechanism's default: the local computation
        m, k = x.shape
        n = w.shape[1]
        itemsize = jnp.dtype(x.dtype).itemsize
        nbytes = bytes_of(m, n, k) * itemsize
        inputs = dict(shape=(m, n, k), dtype=jnp.dtype(x.dtype).name, world=situation.world,
                      platform=situation.platform, collective_bytes=nbytes,
                      flops_per_rank=flops_of(m, n, k, situation.world), min_bytes=min_bytes)
        if situation.platform != "gpu":
            return Choice("", FUSED, "jaxtdist's kernels",
                          "under the Triton interpreter the kernels always run (the "
                          "threshold is a GPU timing)", inputs)
        if not min_bytes:
            return Choice("", FUSED, "jaxtdist's kernels",
                          f"the kernels at every size ({basis}); {collective} moves "
                          f"{_kib(nbytes)} per rank", inputs)
        if nbytes >= min_bytes:
            return Choice("", FUSED, "jaxtdist's kernels",
                          f"{collective} moves {_kib(nbytes)} per rank >= {_kib(min_bytes)}: "
                          f"the exchange costs XLA more than the kernels' synchronisation "
                          f"({basis})", inputs)
        return Choice("", DECOMPOSED, runs,
                      f"{collective} moves {_kib(nbytes)} per rank < {_kib(min_bytes)}: "
                      f"too small for the kernels' synchronisation to pay ({basis})", inputs)

    return PathRule(choose, config_type=config_type,
                    shape=lambda x, w, *_: (x.shape[0], w.shape[1], x.shape[1]),
                    decomposed=runs, local="jnp.dot")
