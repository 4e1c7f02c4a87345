"""The registry of tunable ops: what the tuning engine needs from an op.

``tune/_cases.py`` registers a ``Tunable`` for every built-in op (a user's op
may register its own); the engine (``jaxtdist.tune.tune``) looks ops up here
by name.

Example:
  >>> register(Tunable("broadcast", lambda axis_name, shape, dtype: case))
  >>> "broadcast" in tunable_ops()
  True
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any


@dataclasses.dataclass
class TuningCase:
    """One problem set up for timing on the runtime's mesh.

    Attributes:
      world: ranks in the group.
      shape: the op's shape key (the tuning cache's).
      dtype: operand dtype name.
      candidates: config overrides to time (the op's search space).
      args: device inputs, placed with the shardings ``compile``'s functions take.
      reference: the float32 result to check each candidate's output against.
      tolerance: largest relative error a candidate may have.
      compile: ``compile(overrides) -> (fn, config)``: a jitted function of
        ``args`` running the op with the defaults updated by ``overrides``,
        and the resolved config (a ``KernelConfig``: ``to_dict()``, ``variant``).
    """
    world: int
    shape: tuple[int, ...]
    dtype: str
    candidates: list[dict]
    args: tuple
    reference: Any
    tolerance: float
    compile: Callable[[dict], tuple[Callable, Any]]


@dataclasses.dataclass(frozen=True)
class Tunable:
    """An op the engine can tune: ``setup(axis_name, shape, dtype) -> TuningCase``."""
    op: str
    setup: Callable[..., TuningCase]


_TUNABLES: dict[str, Tunable] = {}


def register(tunable: Tunable) -> None:
    """Makes ``tunable`` the tuning case of its op (replacing an earlier one)."""
    _TUNABLES[tunable.op] = tunable


def lookup(op: str) -> Tunable:
    """The registered ``Tunable`` of ``op``; ``ValueError`` naming the tunable ops."""
    try:
        return _TUNABLES[op]
    except KeyError:
        raise ValueError(f"jaxtdist.tune: no tunable op {op!r}; tunable ops: "
                         f"{sorted(_TUNABLES)}") from None


def tunable_ops() -> list[str]:
    """The names of the registered ops, sorted."""
    return sorted(_TUNABLES)
