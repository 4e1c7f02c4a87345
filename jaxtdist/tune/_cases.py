"""Every built-in op's tuning case: one declaration per op, one builder for all.

A declaration (``OpCase``) says only what differs between ops: the global
operands of a per-rank shape and their shardings, the op's kernels entry (run
at world 1 too: the tuner times kernels), a float32 reference and the accuracy
asked for. ``build`` makes the ``TuningCase`` the engine times.

Example:
  >>> register_builtin_ops()
  >>> case = lookup("all_gather").setup("tp", (8, 16), "float32")
  >>> fn, cfg = case.compile(case.candidates[0])
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxtdist.ops._ag_matmul_config import AgMatmulConfig
from jaxtdist.ops._config import KernelConfig, Problem, resolve
from jaxtdist.ops._op import distributed_op
from jaxtdist.ops._partial_sums import matmul_ar_kernels, matmul_rs_kernels
from jaxtdist.ops.ag_attention import AgAttentionConfig, ag_attention_kernels, attention
from jaxtdist.ops.ag_matmul import ag_matmul_with_gathered
from jaxtdist.ops.all_gather import AllGatherConfig, all_gather
from jaxtdist.ops.all_reduce import AllReduceConfig
from jaxtdist.ops.flash_decode import FlashDecodeConfig, decode_attention, flash_decode_kernels
from jaxtdist.ops.matmul_rs import MatmulArConfig, MatmulRsConfig
from jaxtdist.ops.reduce_scatter import ReduceScatterConfig
from jaxtdist.runtime._runtime import runtime
from jaxtdist.tune._registry import Tunable, TuningCase, register


def _product_tolerance(dtype: str) -> float:
    """A GEMM or attention in ``dtype`` against float32."""
    return 1e-5 if jnp.dtype(dtype).itemsize == 4 else 2e-2


def _sum_tolerance(dtype: str) -> float:
    """One rounding to ``dtype`` (the kernels sum in float32)."""
    return {"bfloat16": 1e-2, "float16": 2e-3}.get(dtype, 1e-5)


@dataclasses.dataclass(frozen=True)
class OpCase:
    """What the tuner needs to know of one op; ``build`` does the rest.

    Attributes:
      op: the op's name (its config's ``OP``, the tuning cache's key).
      config_type: the op's ``KernelConfig``: its ``search_space`` gives the candidates.
      inputs: ``inputs(rng, world, shape)``: the global operands as host arrays
        (floating ones are cast to the dtype tuned).
      specs: ``specs(axes) -> (in_specs, out_spec)``: the operands' and the result's
        shardings over the group's mesh axes.
      run: ``run(*shards, axis_name=, config=)``: one rank's kernels, world 1 included.
      reference: ``reference(world, *operands)``: the global result, operands in float32.
      tolerance: ``tolerance(dtype)``: the largest relative error a candidate may have.
      configure: ``configure(problem, rt, overrides)``: a candidate's config (default
        ``resolve``; explicit overrides skip the cache).
    """
    op: str
    config_type: type[KernelConfig]
    inputs: Callable[[np.random.Generator, int, tuple[int, ...]], tuple[np.ndarray, ...]]
    specs: Callable[[Any], tuple[tuple[P, ...], P]]
    run: Callable[..., jax.Array]
    reference: Callable[..., jax.Array]
    tolerance: Callable[[str], float] = _product_tolerance
    configure: Callable[[Problem, Any, dict], KernelConfig] | None = None


def _float32(a: jax.Array) -> jax.Array:
    return a.astype(jnp.float32) if jnp.issubdtype(a.dtype, jnp.floating) else a


def build(decl: OpCase, axis_name, shape, dtype) -> TuningCase:
    """``decl``'s problem of per-rank ``shape`` in ``dtype`` on the runtime's mesh, the
    group over ``axis_name``: operands placed, the reference computed on the devices."""
    rt = runtime()
    layout = rt.layout(axis_name)
    world, shape, dtype = layout.world, tuple(shape), jnp.dtype(dtype).name
    in_specs, out_spec = decl.specs(layout.axes if len(layout.axes) > 1 else layout.axes[0])
    operands = [jnp.asarray(a, dtype) if np.issubdtype(a.dtype, np.floating) else jnp.asarray(a)
                for a in decl.inputs(np.random.default_rng(0), world, shape)]
    args = tuple(jax.device_put(a, NamedSharding(rt.mesh, spec))
                 for a, spec in zip(operands, in_specs))
    # On the devices, laid out as the candidates' results (a host reference takes
    # minutes at LLM sizes).
    reference = jax.jit(lambda *a: decl.reference(world, *map(_float32, a)),
                        out_shardings=NamedSharding(rt.mesh, out_spec))(*args)
    problem = Problem(rt.platform, world, shape, dtype, rt.sms)
    configure = decl.configure or functools.partial(resolve, decl.config_type)

    def compile_candidate(overrides: dict):
        cfg = configure(problem, rt, overrides)
        config = cfg.to_dict()
        fn = jax.jit(jax.shard_map(
            lambda *a: decl.run(*a, axis_name=axis_name, config=config), mesh=rt.mesh,
            in_specs=in_specs, out_specs=out_spec, check_vma=False))
        return fn, cfg

    return TuningCase(world=world, shape=shape, dtype=dtype,
                      candidates=decl.config_type.search_space(problem), args=args,
                      reference=reference, tolerance=decl.tolerance(dtype),
                      compile=compile_candidate)


# -- the declarations ---------------------------------------------------------------

def _ag_matmul_inputs(rng, world, shape):
    """(m_shard, n_shard, k): x [W * m_shard, k] (rows sharded), w [k, W * n_shard]."""
    m_shard, n, k = shape
    return (rng.standard_normal((world * m_shard, k), np.float32) / np.sqrt(k),
            rng.standard_normal((k, world * n), np.float32))


def _partial_sums_inputs(rng, world, shape):
    """(M, N, k_shard): x [M, W * k_shard] (columns sharded), w [W * k_shard, N]."""
    m, n, k = shape
    return (rng.standard_normal((m, world * k), np.float32) / np.sqrt(world * k),
            rng.standard_normal((world * k, n), np.float32))


def _attention_inputs(rng, world, shape):
    """(B, S_shard, Hq, Hkv, D): q, k, v [B, W * S_shard, H, D], causal."""
    b, s, hq, hkv, d = shape
    return tuple(rng.standard_normal((b, world * s, h, d), np.float32) for h in (hq, hkv, hkv))


def _decode_inputs(rng, world, shape):
    """(B, Hq, Hkv, D, S_shard): every position of the cache valid but the last."""
    b, hq, hkv, d, s_shard = shape
    q = rng.standard_normal((b, hq, d), np.float32)
    k, v = (rng.standard_normal((b, world * s_shard, hkv, d), np.float32) for _ in "kv")
    return q, k, v, np.full((b,), world * s_shard - 1, np.int32)


def _dot(world, x, w):
    return jnp.dot(x, w, precision=jax.lax.Precision.HIGHEST)


def _sum(world, x):
    """The sum over ranks of (n,) each; reduce_scatter's blocks in rank order are it too."""
    return x.reshape(world, -1).sum(0)


def _flat(rng, world, shape):
    """(n,): n elements per rank."""
    return (rng.standard_normal((world * shape[0],)),)


CASES = (
    OpCase("ag_matmul", AgMatmulConfig, _ag_matmul_inputs,
           specs=lambda axes: ((P(axes, None), P(None, axes)), P(None, axes)),
           run=lambda x, w, **kw: ag_matmul_with_gathered(x, w, **kw, gathered=False)[0],
           reference=_dot,
           configure=lambda problem, rt, asked: resolve(
               AgMatmulConfig, problem, rt, asked,
               base=AgMatmulConfig.for_overrides(problem, asked))),
    OpCase("matmul_rs", MatmulRsConfig, _partial_sums_inputs,
           specs=lambda axes: ((P(None, axes), P(axes, None)), P(axes, None)),
           run=matmul_rs_kernels, reference=_dot),
    OpCase("matmul_ar", MatmulArConfig, _partial_sums_inputs,
           specs=lambda axes: ((P(None, axes), P(axes, None)), P()),
           run=matmul_ar_kernels, reference=_dot),
    OpCase("ag_attention", AgAttentionConfig, _attention_inputs,
           specs=lambda axes: ((P(None, axes),) * 3, P(None, axes)),
           run=ag_attention_kernels, reference=lambda world, q, k, v: attention(q, k, v)),
    OpCase("flash_decode", FlashDecodeConfig, _decode_inputs,
           specs=lambda axes: ((P(), P(None, axes), P(None, axes), P()), P()),
           run=flash_decode_kernels,
           reference=lambda world, *operands: decode_attention(*operands)),
    OpCase("all_gather", AllGatherConfig,
           lambda rng, world, shape: (rng.standard_normal((world * shape[0], shape[1])),),
           specs=lambda axes: ((P(axes, None),), P()), run=all_gather,
           reference=lambda world, x: x, tolerance=lambda dtype: 0.0),
    OpCase("reduce_scatter", ReduceScatterConfig, _flat,
           specs=lambda axes: ((P(axes),), P(axes)),
           run=lambda x, **kw: distributed_op("reduce_scatter").forward_with_residuals(
               x, **kw, scatter_dimension=0)[0],
           reference=_sum, tolerance=_sum_tolerance),
    # Both algorithms are candidates: the tuned entry records the faster.
    OpCase("all_reduce", AllReduceConfig, _flat, specs=lambda axes: ((P(axes),), P()),
           run=lambda x, **kw: distributed_op("all_reduce").forward_with_residuals(x, **kw)[0],
           reference=_sum, tolerance=_sum_tolerance,
           configure=lambda problem, rt, asked: resolve(
               AllReduceConfig, problem, rt, asked).settled(problem)),
)


def register_builtin_ops() -> None:
    """Registers every declaration of ``CASES`` with the engine's registry."""
    for decl in CASES:
        register(Tunable(decl.op, functools.partial(build, decl)))
