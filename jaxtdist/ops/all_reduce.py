"""jaxtdist.all_reduce: the sum of an array over the group, on every rank.

Equals ``jax.lax.psum(x, axis_name)``, for any shape (scalars included: the
array is flattened, and the kernels mask the ragged ends, so nothing is
padded in memory). Four algorithms (kernels/all_reduce.py), picked by bytes
per rank (``AllReduceConfig``): the pushes (every rank stores its array into
every peer's inbox: as tagged words, no flag, one crossing, for small arrays;
as values behind one flag up to 1 MiB per rank at 2 ranks, 512 KiB above), one-shot
(every rank sums every peer's staged copy) for mid sizes, two-shot
(reduce-scatter, then an all-gather of the reduced chunks through the heap)
for large ones. Differentiable.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import jax
import jax.numpy as jnp

from jaxtdist.kernels.all_reduce import (all_reduce_one_shot_kernel, all_reduce_push_flags_kernel,
                                         all_reduce_push_kernel, all_reduce_two_shot_kernel)
from jaxtdist.ops._config import KernelConfig, Problem, resolve, setting
from jaxtdist.ops._op import DistributedOp
from jaxtdist.ops._protocol import Call, varying_axes
from jaxtdist.ops._shapes import check_dtype
from jaxtdist.ops.reduce_scatter import (ReduceWorkspace, problem_of, slab_grid,
                                         validate_slab_config)
from jaxtdist.runtime._runtime import runtime

__all__ = ["AllReduceConfig", "all_reduce"]

ALGORITHMS = ("auto", "one_shot", "one_shot_push", "one_shot_push_flags", "two_shot")
# (world - 1) x bytes per rank up to which "auto" pushes tagged words (PUSH_MAX_BYTES).
PUSH_MAX_BYTES = 384 << 10
# Bytes per rank up to which "auto" pushes values and flags (PUSH_FLAGS_MAX_BYTES):
# up to 2 ranks, and above.
PUSH_FLAGS_MAX_BYTES = (1 << 20, 512 << 10)
# Two-shot chunks start on multiples of this many elements (aligned vector accesses).
CHUNK_ALIGN = 16


def two_shot_chunk(n: int, world: int) -> int:
    """Elements per chunk of the two-shot algorithm (the last chunks short or empty)."""
    return -(-(-(-n // world)) // CHUNK_ALIGN) * CHUNK_ALIGN


# -- config --------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class AllReduceConfig(KernelConfig):
    """Which all-reduce algorithm runs and how its kernel splits the array.

    Attributes:
      ALGORITHM: "one_shot_push", "one_shot_push_flags", "one_shot",
        "two_shot", or "auto": by size, the tagged push up to PUSH_MAX_BYTES,
        the push with flags up to PUSH_FLAGS_MAX_BYTES, one-shot up to
        ONE_SHOT_MAX_BYTES, two-shot above. "one_shot_push": every rank pushes
        its array into every peer as tagged words (8 bytes per element on the
        wire, no flag and no fence: one crossing of the links);
        "one_shot_push_flags": every rank pushes its values into every peer,
        then a flag behind one fence; "one_shot": every rank stages its array,
        raises a flag and reads every peer's copy; "two_shot": reduce-scatter,
        then all-gather.
      PUSH_MAX_BYTES: the largest (world - 1) x bytes per rank "auto" pushes as
        tagged words (0, the default: 384 KiB, so 256 KiB per rank at 2 ranks,
        128 KiB at 4).
      PUSH_FLAGS_MAX_BYTES: the largest array (bytes per rank) "auto" pushes
        with flags, above the tagged push's sizes (0, the default: 1 MiB at 2
        ranks, 512 KiB above).
      ONE_SHOT_MAX_BYTES: the largest array (bytes per rank) "auto" sends one-shot
        (0, the default: any size at 2 ranks, 2 MiB above).
      NUM_PROGRAMS: programs, each owning one slab of whole BLOCKs (of the array
        one-shot, of every chunk two-shot).
      BLOCK: elements per load (a power of 2).
      SCOPE: memory scope of the signals ("sys" or "gpu").
      num_warps: launch option.
    """
    OP: ClassVar[str] = "all_reduce"

    ALGORITHM: str = setting("auto", choices=ALGORITHMS)
    # 0: 384 KiB of tagged words' payload. On 4 x H100 the push took 9.0-12.8 us
    # from 4 to 128 KiB per rank (one-shot 14.1-15.7) and 18.0 at 256 KiB (one-shot
    # 15.5); on 2 x H100 4.0-7.1 us up to 256 KiB (one-shot 6.5-7.6), 16.2 at 1 MiB
    # (11.5): the tagged words' doubled bytes cost more than the round trip they save.
    PUSH_MAX_BYTES: int = setting(0, low=0)
    # 0: by world size. On 4 x H100 the push with flags took 13.4 / 17.7 / 25.1 /
    # 35.6 us at 256 KiB / 512 KiB / 1 MiB / 2 MiB per rank, one-shot 15.6 / 18.3 /
    # 25.1 / 35.1, the tagged push 18.8 / 30.7 / 54.4 / 94.6; on 2 x H100 7.2 /
    # 10.1 / 10.9 at 256 KiB / 512 KiB / 1 MiB, one-shot 7.7 / 9.9 / 12.1.
    PUSH_FLAGS_MAX_BYTES: int = setting(0, low=0)
    # 0: by world size. At 2 ranks both algorithms move N bytes over the link
    # and one-shot has one step less: measured faster at every size from 16 KiB
    # to 64 MiB per rank on 2 x H200, so always one-shot. Above 2, 2 MiB: on
    # 4 x H100 one-shot took 22.7 / 34.3 / 96.1 us at 1 / 2 / 8 MiB per rank,
    # two-shot 32.1 / 37.2 / 66.1.
    ONE_SHOT_MAX_BYTES: int = setting(0, low=0)
    NUM_PROGRAMS: int = setting(2)
    BLOCK: int = setting(256, pow2=True)
    SCOPE: str = setting("sys", choices=("sys", "gpu"))
    num_warps: int = 4

    @property
    def variant(self) -> str:
        return self.ALGORITHM

    def algorithm(self, problem: Problem) -> str:
        """The algorithm this config runs for ``problem`` ("auto" settled by size)."""
        if self.ALGORITHM != "auto":
            return self.ALGORITHM
        (n,) = problem.shape
        nbytes = n * problem.itemsize
        if (problem.world - 1) * nbytes <= (self.PUSH_MAX_BYTES or PUSH_MAX_BYTES):
            return "one_shot_push"
        flags_limit = self.PUSH_FLAGS_MAX_BYTES or PUSH_FLAGS_MAX_BYTES[problem.world > 2]
        if nbytes <= flags_limit:
            return "one_shot_push_flags"
        limit = self.ONE_SHOT_MAX_BYTES or (1 << 62 if problem.world <= 2 else 2 << 20)
        return "one_shot" if nbytes <= limit else "two_shot"

    def settled(self, problem: Problem) -> "AllReduceConfig":
        """This config with ALGORITHM settled for ``problem``."""
        return self.replace(ALGORITHM=self.algorithm(problem))

    @classmethod
    def default(cls, problem: Problem) -> "AllReduceConfig":
        (n,) = problem.shape
        base = cls()
        one_shot = base.algorithm(problem) != "two_shot"
        return base.replace(**slab_grid(problem, n if one_shot else
                                        two_shot_chunk(n, problem.world)))

    def check(self, problem: Problem) -> None:
        validate_slab_config(self, problem)

    @classmethod
    def search_space(cls, problem: Problem) -> list[dict]:
        # The pushes keep W copies of the array per parity in every rank's heap
        # (the tagged push at 8 bytes per element), and a workspace stays once
        # allocated: candidates only up to a few times the sizes "auto" pushes.
        nbytes = problem.shape[0] * problem.itemsize
        pushes = [a for a, fits in (
            ("one_shot_push", (problem.world - 1) * nbytes <= 4 * PUSH_MAX_BYTES),
            ("one_shot_push_flags", nbytes <= 8 << 20)) if fits]
        algorithms = [dict(ALGORITHM=a) for a in pushes + ["one_shot", "two_shot"]]
        if problem.platform != "gpu":
            return [{}] + algorithms
        return cls.fitting(problem, [{}] + [dict(a, NUM_PROGRAMS=p, BLOCK=b)
                                             for a in algorithms for p in (8, 32, 66, 132)
                                             for b in (1024, 4096)])


# -- the op --------------------------------------------------------------------------

def _check(x, *, axis_name, config=None) -> None:
    del axis_name, config
    check_dtype("all_reduce", "x", x.dtype)


def _resolved(call: Call, n: int, dtype, config, axis_name) -> AllReduceConfig:
    """The config (settled) the kernels take for ``n`` elements of ``dtype``."""
    problem = problem_of(call.rt, call.world, n, dtype)
    return resolve(AllReduceConfig, problem, call.rt, config, axis_name=axis_name).settled(problem)


def _forward(x, *, axis_name, config=None):
    call = Call("all_reduce", axis_name)
    world = call.world
    n = math.prod(x.shape)
    if n == 0:  # an empty array: nothing to sum
        return x, x
    flat = x.reshape(n)
    cfg = _resolved(call, n, x.dtype, config, axis_name)
    programs = cfg.NUM_PROGRAMS
    common = dict(out_shape=jax.ShapeDtypeStruct((n,), x.dtype), grid=(programs,),
                  num_stages=1, varying=call.result_axes(reduced=(flat,)),
                  **cfg.launch_options())
    if cfg.ALGORITHM == "one_shot_push":
        # W slots of n tagged words per parity (the plan's flags go unused).
        plan = ReduceWorkspace(world, world * n, jnp.int64, programs)
        ws = call.workspace("one_shot_push", plan.nbytes, n, x.dtype.name, programs)
        out = call.run(all_reduce_push_kernel, flat, workspace=ws, N=n,
                       INBOX_OFF=ws.offset + plan.stage, PARITY_BYTES=plan.slot_bytes,
                       **common, **_kernel_args(cfg))
    elif cfg.ALGORITHM == "one_shot_push_flags":
        # W slots of n values per parity; READY flags [W, P].
        plan = ReduceWorkspace(world, world * n, x.dtype, programs)
        ws = call.workspace("one_shot_push_flags", plan.nbytes, n, x.dtype.name, programs)
        out = call.run(all_reduce_push_flags_kernel, flat, workspace=ws, N=n,
                       INBOX_OFF=ws.offset + plan.stage, SLOT_BYTES=plan.slot_bytes,
                       READY_OFF=ws.offset + plan.ready, **common, **_kernel_args(cfg))
    elif cfg.ALGORITHM == "one_shot":
        plan = ReduceWorkspace(world, n, x.dtype, programs)
        ws = call.workspace("one_shot", plan.nbytes, n, x.dtype.name, programs)
        out = call.run(all_reduce_one_shot_kernel, flat, workspace=ws, N=n,
                       STAGE_OFF=ws.offset + plan.stage, SLOT_BYTES=plan.slot_bytes,
                       READY_OFF=ws.offset + plan.ready, **common, **_kernel_args(cfg))
    else:
        chunk = two_shot_chunk(n, world)
        plan = ReduceWorkspace(world, world * chunk, x.dtype, programs, done=True)
        ws = call.workspace("two_shot", plan.nbytes, n, x.dtype.name, programs)
        out = call.run(all_reduce_two_shot_kernel, flat, workspace=ws, N=n, CHUNK=chunk,
                       STAGE_OFF=ws.offset + plan.stage, SLOT_BYTES=plan.slot_bytes,
                       READY_OFF=ws.offset + plan.ready, DONE_OFF=ws.offset + plan.done,
                       **common, **_kernel_args(cfg))
    # x is saved by the op mechanism anyway; the backward reads its varying axes.
    return out.reshape(x.shape), x


def _kernel_args(cfg: AllReduceConfig) -> dict:
    args = cfg.kernel_args()
    # The op's choice, not the kernel's.
    del args["ALGORITHM"], args["PUSH_MAX_BYTES"], args["PUSH_FLAGS_MAX_BYTES"]
    del args["ONE_SHOT_MAX_BYTES"]
    return args


def _backward(x, ct, *, axis_name, config=None):
    group = set(runtime().layout(axis_name).axes)
    have, primal = varying_axes(ct), varying_axes(x)
    if have is not None and primal is not None and group <= primal and not group & have:
        # Typed varying axes (shard_map's check_vma): the result is typed the same
        # over the group, so JAX has already summed every rank's cotangent (the
        # transpose of the implicit pvary where the result met per-rank values);
        # psum's transpose is then the identity, as jax.grad of jax.lax.psum gives.
        return (ct,)
    # Untyped (check_vma=False): each rank holds its own cotangent; psum's
    # transpose is psum.
    return (all_reduce(ct, axis_name, config=config),)


def _local(x, *, axis_name, config=None):
    del axis_name, config
    return x


def _check_config(x, *, axis_name, config):
    if x.size:  # an empty array runs no kernel
        _resolved(Call("all_reduce", axis_name), x.size, x.dtype, config, axis_name)


_ALL_REDUCE = DistributedOp("all_reduce", forward=_forward, backward=_backward, check=_check,
                            local=_local, reduces=True, check_config=_check_config)


def all_reduce(x: jax.Array, axis_name, *, config: dict | None = None) -> jax.Array:
    """Sums ``x`` over the ranks of ``axis_name``, like ``jax.lax.psum(x, axis_name)``.

    Call inside ``jax.shard_map`` over the mesh given to ``jaxtdist.initialize``.
    Any shape (scalars too); bfloat16 and float16 are summed in float32 and
    rounded once. Every rank of the group gets the same bits. Small arrays are
    pushed as tagged words, then as values behind a flag (up to 1 MiB per rank
    at 2 ranks, 512 KiB above), mid sizes go one-shot, large ones two-shot
    (``config=dict(ALGORITHM=...)`` forces one).
    Differentiable, as ``jax.lax.psum``.

    Args:
      x: this rank's array (every rank passes the same shape and dtype).
      axis_name: mesh axis (or tuple of axes) of the group.
      config: overrides of the kernel config (``AllReduceConfig`` keys; advanced).

    Returns:
      The sum, ``x``'s shape and dtype, the same on every rank of the group.

    Example:
      >>> mesh = jax.make_mesh((4,), ("x",)); jaxtdist.initialize(mesh)
      >>> f = jax.jit(jax.shard_map(lambda x: jaxtdist.all_reduce(x, "x"), mesh=mesh,
      ...                           in_specs=P("x"), out_specs=P()))
    """
    return _ALL_REDUCE(jnp.asarray(x), axis_name=axis_name, config=config)
