"""MoeLLConfig: how the low-latency dispatch and combine kernels split the work."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from jaxtdist.ops._config import KernelConfig, Problem, block, resolve, setting
from jaxtdist.ops._protocol import Call
from jaxtdist.ops._shapes import next_pow2

__all__ = ["MoeLLConfig", "resolved_ll"]

_ROW_BYTES = 16 << 10  # bytes of a row per copy step on GPUs, as MoeConfig's


@dataclasses.dataclass(frozen=True)
class MoeLLConfig(KernelConfig):
    """How ``moe_dispatch_ll`` / ``moe_combine_ll`` split the work.

    Attributes:
      NUM_PROGRAMS: programs per rank; program p owns the global experts p, p +
        P, ... (sending and receiving) and, in the combine's sum, tokens [p * TP,
        (p + 1) * TP). On GPUs at most one per SM (every program resident: they
        wait on peers'). The combine uses its own value.
      BLOCK_H: elements per copy step of a row (a power of 2).
      num_warps: launch option.
    """
    OP: ClassVar[str] = "moe_ll"
    variant: ClassVar[str] = "push"

    NUM_PROGRAMS: int = setting(2)
    BLOCK_H: int = block(64, low=1)
    num_warps: int = 4

    @classmethod
    def default(cls, problem: Problem) -> "MoeLLConfig":
        experts, h = problem.shape[0], problem.shape[1]
        if problem.platform != "gpu":
            # The interpreter: few programs (each one's steps cost Python time).
            return cls(NUM_PROGRAMS=min(2, experts), BLOCK_H=min(64, next_pow2(h)))
        # Latency: one expert per program up to one program per SM (a balanced
        # routing spreads the copies), a whole row (up to _ROW_BYTES) per step.
        return cls(NUM_PROGRAMS=max(1, min(problem.sms, experts)),
                   BLOCK_H=min(_ROW_BYTES // problem.itemsize, next_pow2(h)))

    def check(self, problem: Problem) -> None:
        """On GPUs at most one program per SM: every program must be resident."""
        if problem.platform == "gpu" and self.NUM_PROGRAMS > problem.sms:
            raise ValueError(f"jaxtdist.moe_ll: config NUM_PROGRAMS={self.NUM_PROGRAMS} "
                             f"exceeds the {problem.sms} SMs (every program must be resident)")


def resolved_ll(call: Call, experts: int, hidden: int, dtype, config: dict | None,
                axis_name) -> MoeLLConfig:
    """The config for ``experts`` global experts and rows of ``hidden`` ``dtype``."""
    problem = Problem(call.platform, call.world, (experts, hidden), jnp.dtype(dtype).name,
                      call.rt.sms)
    return resolve(MoeLLConfig, problem, call.rt, config, axis_name=axis_name)
