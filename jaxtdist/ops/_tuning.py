"""The tuner as the ops see it: one slot that ``jaxtdist.tune`` fills when imported.

Ops sit below the tuner and never import it. With ``JAXTDIST_AUTOTUNE=1``, a
call whose problem has no tuning-cache entry asks the installed tuner for a
config (``autotuned``); the tuner answers None when it cannot tune the op
there (an op it has no case for, a platform without a kernel timer).
``import jaxtdist`` imports the tuner, so the slot is filled for every user.

Example:
  >>> install(lambda op, problem, axis_name: {"BLOCK_N": 128})
  >>> autotuned("ag_matmul", problem, "tp")   # with JAXTDIST_AUTOTUNE=1
  {'BLOCK_N': 128}
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jaxtdist.ops._config import Problem

# autotune(op, problem, axis_name) -> the tuned config overrides, or None.
Autotune = Callable[[str, "Problem", Any], "dict | None"]

_autotune: Autotune | None = None


def install(autotune: Autotune) -> None:
    """Makes ``autotune`` the tuner that calls ask on a cache miss (the last one wins)."""
    global _autotune
    if not callable(autotune):
        raise ValueError(f"jaxtdist: the autotune hook must be callable, got {autotune!r}")
    _autotune = autotune


def autotuned(op: str, problem: Problem, axis_name) -> dict | None:
    """The installed tuner's config for ``problem`` when ``JAXTDIST_AUTOTUNE=1``; else
    None (the call takes its defaults)."""
    if _autotune is None or os.environ.get("JAXTDIST_AUTOTUNE") != "1":
        return None
    tuned = _autotune(op, problem, axis_name)
    return None if tuned is None else dict(tuned)
