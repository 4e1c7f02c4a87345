"""MoeConfig: how the dispatch and combine kernels split the work, and its GPU defaults."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from jaxtdist.ops._config import KernelConfig, Problem, block, resolve, setting
from jaxtdist.ops._protocol import Call
from jaxtdist.ops._shapes import next_pow2

__all__ = ["MoeConfig", "chunk_size", "resolved"]

_ROW_BYTES = 16 << 10  # bytes of a row per copy step on GPUs (32 registers per thread)

# Above this many tokens per rank the fused routing, whose every program scans
# every token's ids (1024 pairs per step), gives way to the XLA routing. Dispatch
# on 4 x H200 (H 7168, top-8 of 256 experts; bench moe --world 4,
# docs/perf/moe_NVIDIA_H200x4.md), us: 128 tokens fused 56.5, xla 122.3; 4096
# tokens xla 842.6 (fused 1275.8 in an earlier probe). A third path, two routing
# kernels launched before the dispatch, won nowhere (60.4 and 855.4) and is gone.
_FUSED_ROUTING_MAX_TOKENS = 256


def _chunk_tokens(per_program: int) -> int:
    """The GPU default CHUNK_TOKENS for programs of ``per_program`` tokens: about 8
    chunks of at least 2 tokens above 4 tokens per program, else one chunk (decode
    sizes, where each chunk's fence and flags would add latency). Dispatch on 2 x
    H200 (H 7168, top-8 of 256 experts; probe_defaults.py moe_chunks), us, one
    chunk / chunks of 2 / 4 / 8 / 16 tokens: 4096 tokens per rank (32 per
    program) 544.3 / 482.2 / 468.6 / 488.6 / 528.8; 1024 (8 per program) 146.6 /
    135.7 / 144.3 / 147.4 / 146.7; on 4 x H200 at 4096, 1184.4 / 977.0 / 963.3 /
    992.2 / 1132.1."""
    return max(2, per_program // 8) if per_program > 4 else 0


def chunk_size(per_program: int, chunks: int) -> int:
    """Tokens per chunk of a program of ``per_program`` tokens in ``chunks`` chunks
    (the last one may be short): one rule for the dispatch and the combine."""
    return -(-per_program // chunks)


@dataclasses.dataclass(frozen=True)
class MoeConfig(KernelConfig):
    """How the dispatch and combine kernels split the work.

    Attributes:
      NUM_PROGRAMS: programs; program p owns tokens ``[p * TP, (p + 1) * TP)``
        on every rank and waits only for program p of the others (on GPUs at
        most one per SM: all resident). Combine uses its dispatch's value.
      BLOCK_H: elements per copy step (a power of 2): of one row in the
        dispatch; the combine moves a token's rows together, BLOCK_H / KL
        columns of each per step.
      num_warps: launch option.
      ROUTING: where the dispatch's routing metadata (slots, expert positions,
        counts) is computed: "fused" (the GPU default up to
        ``_FUSED_ROUTING_MAX_TOKENS`` tokens per rank: each program of the
        dispatch kernel computes its tokens' words itself, from every token's
        ids, with no launch before it) or "xla" (a dozen small XLA fusions
        before the kernel; the GPU default above, and the interpreter's). Both
        give the same words, bit for bit.
      CHUNK_TOKENS: tokens per chunk of a dispatch program (0: all its tokens
        in one chunk; the program's NCH chunks are evened out to
        ceil(TP / NCH) tokens each). Each chunk's rows are flagged on their own,
        and a program lays out the previous chunk it received while its next
        chunk's remote stores drain (bulk sizes: the local copies overlap the
        link). The combine works by the same chunks: it sums one chunk's
        tokens while the next chunk's rows drain.
      COMBINE_SEND: how the combine's forward weighs a token's rows on the
        experts' rank: "rows" (the default: only the valid pairs' rows, BLOCK_H
        columns of one row per load) or "blocks" (all min(K, E / W) pair slots
        of the token as one [KL, BLOCK_H / KL] block per step, masked).
      COMBINE_ROWS: with "rows", how many of a token's valid pair rows are loaded
        at once (their loads in flight together). On 2 x H200 (4096 tokens per
        rank, top-8 of 256 experts, H 7168) dispatch + combine took 891.9 /
        852.1 / 842.0 / 842.0 us with 1 / 2 / 3 / 4 (128 tokens: 51.1 / 51.5 /
        49.7 / 50.9); 2 is the default, as more rows spill registers for some
        row widths and dtypes.
    """
    OP: ClassVar[str] = "moe"
    variant: ClassVar[str] = "push"

    NUM_PROGRAMS: int = setting(2)
    BLOCK_H: int = block(64, low=1)
    num_warps: int = 4
    ROUTING: str = setting("fused", choices=("xla", "fused"))
    CHUNK_TOKENS: int = setting(0, low=0, note="(0: one chunk per program)")
    COMBINE_SEND: str = setting("rows", choices=("rows", "blocks"))
    COMBINE_ROWS: int = setting(2, high=8)

    @classmethod
    def default(cls, problem: Problem) -> "MoeConfig":
        t, h = problem.shape[0], problem.shape[1]
        if problem.platform != "gpu":
            # The interpreter: few programs, small blocks, and the routing words from
            # XLA (the same words as the kernels', at a fraction of the interpreter's time).
            # Chunks of 2 tokens: the pipelined path runs wherever a program has more.
            return cls(NUM_PROGRAMS=min(2, t), BLOCK_H=min(64, next_pow2(h)), ROUTING="xla",
                       CHUNK_TOKENS=2)
        # Latency: one token per program up to one program per SM, and a whole row
        # (up to _ROW_BYTES) per copy step, so that every load of a row is in flight
        # at once. On 2 x H200 (128 tokens per rank, top-8, H 7168, E 256, bf16)
        # dispatch + combine took 85.4 us with 8192-element steps against 99.5 with
        # 2048 and 112.9 with 1024 (16 bytes per thread); 8 or 16 warps: no better.
        programs = max(1, min(problem.sms, t))
        return cls(NUM_PROGRAMS=programs,
                   BLOCK_H=min(_ROW_BYTES // problem.itemsize, next_pow2(h)),
                   ROUTING="fused" if t <= _FUSED_ROUTING_MAX_TOKENS else "xla",
                   CHUNK_TOKENS=_chunk_tokens(-(-t // programs)))

    def check(self, problem: Problem) -> None:
        """On GPUs at most one program per SM: every program must be resident."""
        if problem.platform == "gpu" and self.NUM_PROGRAMS > problem.sms:
            raise ValueError(f"jaxtdist.moe: config NUM_PROGRAMS={self.NUM_PROGRAMS} exceeds "
                             f"the {problem.sms} SMs (every program must be resident)")


def resolved(call: Call, tokens: int, hidden: int, dtype, config: dict | None,
             axis_name) -> MoeConfig:
    """The config the kernels take for ``tokens`` rows of ``hidden`` ``dtype`` elements."""
    problem = Problem(call.platform, call.world, (tokens, hidden), jnp.dtype(dtype).name,
                      call.rt.sms)
    return resolve(MoeConfig, problem, call.rt, config, axis_name=axis_name)
