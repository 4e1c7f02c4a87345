"""jaxtdist.flash_decode: decode attention (one query per sequence) over a KV cache
sharded by position across the ranks of a group, in one launch per call.

Shapes (``_check``), plan (``FlashDecodeConfig``, ``DecodeWorkspace``), launch
(``_forward``), the local computation (``_local``, also the float32 reference's
formula); ``DistributedOp`` supplies program order, world 1 and the ``TypeError``
on differentiation; ``pjit_wrapper`` the pjit-style form. A paged cache is the
same op with a ``block_table``. At world 1 on GPUs the kernel runs, with the local
computation's VJP as its backward (``local_at_world_1="interpreter"``). The
kernel is ``kernels/flash_decode.py``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jaxtdist.kernels.flash_decode import flash_decode_kernel
from jaxtdist.ops._config import KernelConfig, Problem, block, resolve, setting
from jaxtdist.ops._op import DistributedOp
from jaxtdist.ops._precision import dot_precision
from jaxtdist.ops._protocol import Call, check_axis
from jaxtdist.ops._shapes import align, check_dtype, next_pow2
from jaxtdist.ops._sharded import mesh_devices, pjit_wrapper, rows_over
from jaxtdist.runtime._runtime import runtime

__all__ = ["DecodeWorkspace", "FlashDecodeConfig", "decode_attention", "flash_decode",
           "flash_decode_kernels", "flash_decode_sharded"]

_MAX_HEAD_DIM = 256
_MAX_GROUP = 128
# Positions per split at least: fewer make the merge (NSPLIT partials read by one
# program per KV head) cost more than the chunk it saves.
_MIN_CHUNK = 512
# 128-position steps where their K and V tiles of two stages in flight take at most
# this much shared memory (one resident program per SM), else 64.
_WIDE_STEP_SMEM = 160 * 1024
# Shared memory of one Hopper SM available to a program.
_SM90_SMEM = 227 * 1024


def _padded(n: int) -> int:
    """A tile dimension of the kernel: ``n`` padded to a power of 2, at least 16 (tl.dot)."""
    return max(16, next_pow2(n))


def _kv_stage_bytes(problem: Problem, block_n: int, num_stages: int) -> int:
    """Shared memory of the K and V tiles the kernel's pipeline keeps in flight
    (num_stages - 1 of each) for ``problem``'s head dim and dtype."""
    return (num_stages - 1) * 2 * block_n * _padded(problem.shape[3]) * problem.itemsize
# The group's merge is unrolled over the splits (its loads issued ahead): keep it short.
_MAX_SPLITS = 64


# -- config ----------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class FlashDecodeConfig(KernelConfig):
    """How flash_decode's kernel splits one problem.

    Attributes:
      BLOCK_N: positions per step of the online softmax (a power of 2, >= 16).
      NUM_SPLITS: programs per (batch, KV head) on each rank, at most
        ``_MAX_SPLITS`` (0: about one program per SM on GPUs, at least
        ``_MIN_CHUNK`` positions each); each takes every NUM_SPLITS-th step of
        the valid positions.
      num_warps, num_stages: launch options.
    """
    OP: ClassVar[str] = "flash_decode"
    variant: ClassVar[str] = "split_kv_push"

    BLOCK_N: int = block(64)
    NUM_SPLITS: int = setting(0, low=0, high=_MAX_SPLITS, note="(0: chosen from the SMs and the "
                              "sequence; the merge is unrolled over the splits)")
    num_warps: int = 4
    num_stages: int = 3

    @classmethod
    def default(cls, problem: Problem) -> "FlashDecodeConfig":
        """One rule: the interpreter takes 16-position steps and 2 splits (both
        merge paths run). NVIDIA GPUs take 128-position steps where two stages of
        K and V tiles fit ``_WIDE_STEP_SMEM`` (bf16 and f16 up to D = 128), else 64,
        halved further while they would not fit an SM (float32 past D = 128),
        and splits from ``splits``. On one H100 (B=1, Hq=32, Hkv=8, D=128)
        128-position steps with one program per SM took 50.2 / 179.3 / 11.9 us at
        32K / 128K / 8K positions, against 55.8 / 186.1 / 15.1 for 64-position
        steps with two programs per SM."""
        if problem.platform != "gpu":
            return cls(BLOCK_N=16, NUM_SPLITS=2, num_warps=4, num_stages=1)
        # AMD's 64 KiB of LDS per CU holds no such tiles.
        if (problem.vendor == "nvidia"
                and _kv_stage_bytes(problem, 128, cls.num_stages) <= _WIDE_STEP_SMEM):
            return cls(BLOCK_N=128)
        block_n = 64
        while (problem.vendor == "nvidia" and block_n > 16
               and _kv_stage_bytes(problem, block_n, cls.num_stages) > _SM90_SMEM):
            block_n //= 2
        return cls(BLOCK_N=block_n)

    def splits(self, problem: Problem) -> int:
        """Programs per (batch, KV head): NUM_SPLITS, or one program per SM (no
        second wave of programs, each streaming its steps at the SM's share of
        the bandwidth) with at least ``_MIN_CHUNK`` positions each; then only as
        many as the busiest one's share of the shard's BLOCK_N steps needs (no
        more partials to merge than that)."""
        b, _, hkv, _, s_shard = problem.shape
        steps = -(-s_shard // self.BLOCK_N)
        asked = self.NUM_SPLITS
        if not asked:
            asked = min(problem.sms // (b * hkv), -(-s_shard // _MIN_CHUNK), _MAX_SPLITS)
        busiest = -(-steps // max(1, asked))
        return -(-steps // busiest)

    def check(self, problem: Problem) -> None:
        if problem.platform == "gpu" and problem.vendor == "nvidia" and self.num_stages > 1:
            tiles = _kv_stage_bytes(problem, self.BLOCK_N, self.num_stages)
            if tiles > _SM90_SMEM:
                raise ValueError(
                    f"jaxtdist.flash_decode: config BLOCK_N={self.BLOCK_N}, num_stages="
                    f"{self.num_stages} keeps {tiles >> 10} KiB of K and V tiles (head dim "
                    f"{problem.shape[3]}, {problem.dtype}) in shared memory; an SM has "
                    f"{_SM90_SMEM >> 10} KiB: lower BLOCK_N or num_stages")

    @classmethod
    def search_space(cls, problem: Problem) -> list[dict]:
        if problem.platform != "gpu":
            return cls.fitting(problem, [{}, dict(NUM_SPLITS=1), dict(BLOCK_N=32)])
        b, _, hkv, _, _ = problem.shape
        base = -(-2 * problem.sms // (b * hkv))
        return cls.fitting(problem, [{}] + [
            dict(BLOCK_N=bn, NUM_SPLITS=min(_MAX_SPLITS, max(1, base * f // 2)), num_warps=w,
                 num_stages=st)
            for bn in (32, 64, 128) for f in (1, 2, 4) for w in (4, 8) for st in (2, 3, 4)])


class DecodeWorkspace:
    """Byte layout of flash_decode's workspace (see ``kernels/flash_decode.py``):
    the local partials (o, then lse), the arrival counters, two inbox parities
    (W source slots of o, then of lse, then of the length each source merged
    with, as tagged 8-byte words)."""

    def __init__(self, world: int, groups: int, splits: int, group: int, block_d: int):
        # Rows of a partial: the group's query rows padded to a power of 2 (the
        # kernel's GP), not the dot's 16-row tile: multi-head attention keeps 1.
        self.rows = rows = next_pow2(group)
        tile = rows * block_d * 4
        self.local = 0
        self.lse = align(groups * splits * tile)
        self.counters = self.lse + align(groups * splits * rows * 4)
        # The inbox holds tagged words (8 bytes per 32-bit value).
        self.inbox_lse = align(world * groups * 2 * tile)
        self.inbox_len = self.inbox_lse + align(world * groups * rows * 8)
        self.parity_bytes = self.inbox_len + align(world * groups * 8)
        self.inbox = self.counters + align(groups * 4)
        self.nbytes = self.inbox + 2 * self.parity_bytes


# -- shapes ----------------------------------------------------------------------

def _check(q, k, v, kv_len, block_table=None, *, axis_name, config=None,
           trace=False) -> None:
    """The arguments (arrays); a paged cache's pages, then its contiguous view."""
    del config
    if not isinstance(trace, bool):
        raise ValueError(f"jaxtdist.flash_decode: trace={trace!r} must be a bool")
    if block_table is not None:
        _check_pages(k, v, block_table, batch=(q.shape or (None,))[0])
        k, v = _as_contiguous(k, block_table), _as_contiguous(v, block_table)
    if q.ndim != 3 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"jaxtdist.flash_decode: expected q [B, Hq, D] and k, v [B, S_shard, "
                         f"Hkv, D], got q{q.shape}, k{k.shape}, v{v.shape}")
    if k.shape != v.shape:
        raise ValueError(f"jaxtdist.flash_decode: k{k.shape} and v{v.shape} must have the "
                         "same shape")
    b, hq, d = q.shape
    kb, s_shard, hkv, kd = k.shape
    if kb != b or kd != d:
        raise ValueError(f"jaxtdist.flash_decode: q{q.shape} and k{k.shape} disagree on the "
                         "batch B or the head dim D (q [B, Hq, D], k [B, S_shard, Hkv, D])")
    if 0 in q.shape or 0 in k.shape:
        raise ValueError(f"jaxtdist.flash_decode: empty operand q{q.shape} k{k.shape}")
    if hq % hkv:
        raise ValueError(f"jaxtdist.flash_decode: Hq={hq} query heads must be a multiple of "
                         f"Hkv={hkv} KV heads (grouped-query attention)")
    if hq // hkv > _MAX_GROUP:
        raise ValueError(f"jaxtdist.flash_decode: {hq // hkv} query heads per KV head; at "
                         f"most {_MAX_GROUP} are supported")
    if d > _MAX_HEAD_DIM:
        raise ValueError(f"jaxtdist.flash_decode: head dim D={d}; at most {_MAX_HEAD_DIM} is "
                         "supported")
    check_dtype("flash_decode", "q", q.dtype)
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"jaxtdist.flash_decode: q, k and v must share a dtype, got "
                         f"{q.dtype.name}, {k.dtype.name} and {v.dtype.name}")
    if kv_len.shape != (b,) or not jnp.issubdtype(kv_len.dtype, jnp.integer):
        raise ValueError(f"jaxtdist.flash_decode: kv_len must be an integer array of shape "
                         f"(B,) = ({b},), got {kv_len.dtype.name}{tuple(kv_len.shape)}")
    check_axis(runtime(), axis_name, "flash_decode")


def _check_pages(k, v, block_table, batch: int) -> None:
    """The paged form: k, v [num_pages, page, Hkv, D], block_table [B, pages] int32."""
    if getattr(block_table, "ndim", None) != 2 or block_table.shape[0] != batch:
        raise ValueError(f"jaxtdist.flash_decode: block_table must be [B, pages] with B = "
                         f"{batch}, got shape {getattr(block_table, 'shape', None)}")
    if jnp.dtype(block_table.dtype) != jnp.int32:
        raise ValueError(f"jaxtdist.flash_decode: block_table has dtype "
                         f"{jnp.dtype(block_table.dtype).name}; it must be int32")
    if 0 in block_table.shape:
        raise ValueError(f"jaxtdist.flash_decode: empty block_table{block_table.shape}")
    if getattr(k, "shape", None) != getattr(v, "shape", None):
        raise ValueError(f"jaxtdist.flash_decode: the page pools k{getattr(k, 'shape', None)} "
                         f"and v{getattr(v, 'shape', None)} must have the same shape")
    if getattr(k, "ndim", None) == 4 and 0 in k.shape:
        # (The contiguous view below has no num_pages: a pool of 0 pages would pass, and
        # clamping ids into [0, num_pages) would then read outside it.)
        raise ValueError(f"jaxtdist.flash_decode: empty page pool k{k.shape}; "
                         "[num_pages, page, Hkv, D] needs at least one page of one position")


def _as_contiguous(cache, block_table):
    """The shape-only view a paged cache [num_pages, page, Hkv, D] has as a contiguous
    one [B, pages * page, Hkv, D] (for the checks)."""
    if getattr(cache, "ndim", None) != 4:
        raise ValueError(f"jaxtdist.flash_decode: with block_table, k and v must be paged "
                         f"[num_pages, page, Hkv, D], got shape {getattr(cache, 'shape', None)}")
    b, pages = block_table.shape
    return jax.ShapeDtypeStruct((b, pages * cache.shape[1]) + cache.shape[2:], cache.dtype)


def _gather_pages(cache, block_table):
    """[B, pages * page, Hkv, D]: each sequence's pages in order (ids clamped, as
    the kernel reads them)."""
    b, pages = block_table.shape
    ids = jnp.clip(block_table, 0, cache.shape[0] - 1)
    return cache[ids].reshape((b, pages * cache.shape[1]) + cache.shape[2:])


def _int32_lengths(kv_len):
    """kv_len (checked: integers) as int32: lengths past int32's range read the whole
    cache instead of wrapping around on the cast (and wide negative ones are 0).
    Negative int32 lengths are left as they are: the kernel and ``decode_attention``
    read them as 0 (none valid), so int32 lengths, the usual case, take no XLA
    kernel before the decode (the clamp cost 0.8-1 us on one H200)."""
    hi = np.iinfo(np.int32).max
    if jnp.iinfo(kv_len.dtype).max > hi:
        lo = 0 if jnp.issubdtype(kv_len.dtype, jnp.signedinteger) else None
        kv_len = jnp.clip(kv_len, lo, np.array(hi, kv_len.dtype))
    return kv_len.astype(jnp.int32)


def _problem(call: Call, q, k) -> Problem:
    b, hq, d = q.shape
    return Problem(call.platform, call.world, (b, hq, k.shape[2], d, k.shape[1]),
                   jnp.dtype(q.dtype).name, call.rt.sms)


# -- launch ----------------------------------------------------------------------

def _forward(q, k, v, kv_len, block_table=None, *, axis_name, config=None, trace=False):
    """The kernel's output (with ``trace``, and its clock stamps); no residuals."""
    cache = k if block_table is None else _as_contiguous(k, block_table)
    call = Call("flash_decode", axis_name)
    problem = _problem(call, q, cache)
    cfg = resolve(FlashDecodeConfig, problem, call.rt, config, axis_name=axis_name)
    b, hq, d = q.shape
    _, s_shard, hkv, _ = cache.shape
    group = hq // hkv
    groups = b * hkv
    splits = cfg.splits(problem)
    block_g, block_d = _padded(group), _padded(d)
    plan = DecodeWorkspace(call.world, groups, splits, group, block_d)
    # The layout depends on the groups, the splits and the padded partials.
    ws = call.workspace("partials", plan.nbytes, groups, splits, plan.rows, block_d)
    o = ws.offset
    # The same value on every rank of the group (like psum's result).
    lengths = _int32_lengths(kv_len)
    table = lengths if block_table is None else block_table  # (unused when not paged)
    # Without trace, the stamps' output is a one-element placeholder the kernel
    # never writes.
    stamps = (groups * splits, 6) if trace else (1,)
    out, stamped = call.run(
        flash_decode_kernel, q, k, v, lengths, table, workspace=ws,
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                   jax.ShapeDtypeStruct(stamps, jnp.int32)], grid=(groups * splits,),
        varying=call.result_axes(reduced=(q, k, v, kv_len)), **cfg.launch_options(),
        QK_SCALE=float(math.log2(math.e) / math.sqrt(d)), HQ=hq, HKV=hkv, GROUP=group, D=d,
        S_SHARD=s_shard, GROUPS=groups, NSPLIT=splits,
        LOCAL_OFF=o + plan.local, LSE_OFF=o + plan.lse, COUNT_OFF=o + plan.counters,
        INBOX_OFF=o + plan.inbox, INBOX_LSE=plan.inbox_lse, INBOX_LEN=plan.inbox_len,
        PARITY_BYTES=plan.parity_bytes, BLOCK_N=cfg.BLOCK_N, BLOCK_G=block_g, BLOCK_D=block_d,
        DOT_PRECISION=dot_precision(q.dtype, call.platform, problem.vendor),
        PAGE=0 if block_table is None else k.shape[1],
        NUM_PAGES=k.shape[0], TRACE=trace, GP=plan.rows, WP=next_pow2(call.world))
    return ((out, stamped) if trace else out), None


def flash_decode_kernels(q: jax.Array, k: jax.Array, v: jax.Array, kv_len: jax.Array,
                         axis_name, *, block_table: jax.Array | None = None,
                         config: dict | None = None, trace: bool = False):
    """flash_decode's kernel, at world 1 too (for benchmarks and tests); not differentiable.

    ``config`` overrides the defaults (``FlashDecodeConfig``) and skips the tuning cache.
    With ``trace`` (a probe's view) also returns the kernel's int32 [programs, 6]
    clock stamps (see ``kernels/flash_decode.flash_decode_kernel``).
    """
    return _FLASH_DECODE.kernels(*_operands(q, k, v, kv_len, block_table),
                                 axis_name=axis_name, config=config, trace=trace)


def _operands(q, k, v, kv_len, block_table) -> tuple:
    """The op's arguments as arrays (``block_table`` None: a contiguous cache)."""
    arrays = tuple(jnp.asarray(a) for a in (q, k, v, kv_len))
    return arrays + (None if block_table is None else jnp.asarray(block_table),)


def decode_attention(q: jax.Array, k: jax.Array, v: jax.Array, kv_len: jax.Array,
                     start: int | jax.Array = 0) -> jax.Array:
    """Decode attention of one KV block in plain JAX (float32 softmax).

    q [B, Hq, D]; k, v [B, S, Hkv, D] holding global positions [start, start + S);
    positions at or past ``kv_len`` [B] are masked; a sequence with none valid
    gets zeros. Returns [B, Hq, D] in q's dtype. flash_decode's computation at
    world 1 under the interpreter, and what its backward differentiates at world
    1 on GPUs: 16-bit operands go to the tensor cores as they are (float32
    accumulation; the weights rounded to v's dtype, as the kernel does), float32
    ones in full float32 (its reference, on the gathered cache).
    """
    b, hq, d = q.shape
    s, hkv = k.shape[1], k.shape[2]
    exact = jnp.float32 in (q.dtype, k.dtype, v.dtype)
    dtype = jnp.float32 if exact else jnp.promote_types(k.dtype, v.dtype)
    precision = jax.lax.Precision.HIGHEST if exact else None
    valid = (start + jnp.arange(s))[None, :] < kv_len.astype(jnp.int32)[:, None]  # [B, S]
    # Positions past the length may hold anything (stale or never written slots):
    # zeroed, so that NaN or inf there cannot reach the output (0 * inf is NaN) or
    # q's gradient, as the kernels never load them.
    k, v = (jnp.where(valid[:, :, None, None], a.astype(dtype), 0) for a in (k, v))
    qg = q.reshape(b, hkv, hq // hkv, d).astype(dtype)
    scores = jnp.einsum("bhgd,bshd->bhgs", qg, k, precision=precision,
                        preferred_element_type=jnp.float32) / np.float32(math.sqrt(d))
    scores = jnp.where(valid[:, None, None, :], scores, -jnp.inf)
    m = jnp.max(scores, axis=-1, keepdims=True)
    p = jnp.exp(scores - jnp.where(jnp.isfinite(m), m, 0.0))
    l = jnp.sum(p, axis=-1, keepdims=True)
    o = jnp.einsum("bhgs,bshd->bhgd", p.astype(dtype), v, precision=precision,
                   preferred_element_type=jnp.float32)
    # Zeros only where nothing was valid (l == 0): a NaN weight (NaN or inf in q or
    # in a valid key) stays NaN, as in jax.nn.dot_product_attention.
    o = jnp.where(l != 0, o / jnp.where(l != 0, l, 1.0), 0.0)
    return o.reshape(b, hq, d).astype(q.dtype)


def _check_config(q, k, v, kv_len, block_table=None, *, axis_name, config):
    """``config`` resolved for the cache (a paged one's contiguous view), as the kernel
    would (DistributedOp.check_config)."""
    del v, kv_len
    cache = k if block_table is None else _as_contiguous(k, block_table)
    call = Call("flash_decode", axis_name)
    resolve(FlashDecodeConfig, _problem(call, q, jax.ShapeDtypeStruct(cache.shape, q.dtype)),
            call.rt, config, axis_name=axis_name)


def _local(q, k, v, kv_len, block_table=None, *, axis_name, config=None):
    del axis_name, config
    if block_table is not None:
        k, v = _gather_pages(k, block_table), _gather_pages(v, block_table)
    return decode_attention(q, k, v, _int32_lengths(kv_len))


# At world 1 on GPUs the kernel runs, differentiated by the local computation's VJP
# (recomputed from the inputs): the local computation zeroes K and V past the
# length (two copies of the cache): on one H100 (B=1, Hq=32, Hkv=8, D=128, bf16) it
# took 43.4 / 155.2 / 571.9 us at 8K / 32K / 128K positions, the kernel (which never
# reads past the length) 13.3 / 52.2 / 180.8. Under the Triton interpreter the local
# computation stays (the interpreter is slow).
_FLASH_DECODE = DistributedOp("flash_decode", forward=_forward, check=_check, local=_local,
                              local_at_world_1="interpreter", reduces=True,
                              check_config=_check_config)


def flash_decode(q: jax.Array, k: jax.Array, v: jax.Array, kv_len: jax.Array, axis_name, *,
                 block_table: jax.Array | None = None,
                 config: dict | None = None) -> jax.Array:
    """Decode attention over a KV cache sharded by position over ``axis_name``.

    Call inside ``jax.shard_map`` over the mesh given to ``jaxtdist.initialize``.
    Rank r holds positions [r * S_shard, (r + 1) * S_shard) of every sequence.
    One launch: each rank computes split-KV partial outputs with their
    log-sum-exp over its positions (all query heads of a KV head together, so
    K and V are read once), merges them, pushes its partial into every peer's
    heap and merges the W partials in rank order, so every rank ends with the
    same bits. Lengths are data: no recompilation as ``kv_len`` grows. Not
    differentiable (differentiating it raises ``TypeError``) except at world
    1: there, on GPUs, the kernel runs (it never reads past the length) and the
    backward is the VJP of ``decode_attention`` (plain JAX, recomputed from q, k,
    v); under the Triton interpreter (CPU) the op is ``decode_attention``, with
    JAX's autodiff. kv_len and block_table get no cotangent. float32 caches
    follow ``jax.default_matmul_precision`` like XLA's dots on GPUs: TF32 tensor
    cores by default (operands rounded to nearest), float32 accuracy (three TF32
    products) under ``"highest"``.

    Args:
      q: [B, Hq, D], the same on every rank.
      k, v: [B, S_shard, Hkv, D], this rank's positions; Hq a multiple of Hkv.
      kv_len: [B] integers, the global valid lengths, the same on every rank
        (positions at or past them are masked; a rank may hold none; a sequence
        of length 0 gets zeros; a sequence whose length differs across ranks
        gets NaN on every rank: the ranks exchange their lengths with their
        partials).
      axis_name: mesh axis (or tuple of axes) the cache is sharded over.
      block_table: [B, pages] int32 (optional): a paged cache. k and v are then
        this rank's page pool [num_pages, page, Hkv, D], and this rank's
        position i of sequence b is row ``i % page`` of page
        ``block_table[b, i // page]`` (S_shard = pages * page). Ids are data
        (no recompilation as pages are handed out); ids outside [0,
        num_pages) are clamped: a wrong page is read, never memory outside
        the pool. Pages past a sequence's length are never read.
      config: overrides of the kernel config (``FlashDecodeConfig`` keys; advanced),
        checked even where the local computation runs (world 1 on CPU).

    Returns:
      [B, Hq, D] in q's dtype: ``softmax(q k^T / sqrt(D), masked) v`` over the
      whole sequence, on every rank (typed like psum's result: not varying
      over ``axis_name``).

    Example:
      >>> mesh = jax.make_mesh((4,), ("sp",)); jaxtdist.initialize(mesh)
      >>> f = jax.jit(jax.shard_map(
      ...     lambda q, k, v, n: jaxtdist.flash_decode(q, k, v, n, "sp"), mesh=mesh,
      ...     in_specs=(P(), P(None, "sp"), P(None, "sp"), P()), out_specs=P()))
    """
    return _FLASH_DECODE(*_operands(q, k, v, kv_len, block_table), axis_name=axis_name,
                         config=config)


# -- pjit-style ---------------------------------------------------------------------
#
# Contiguous: q, kv_len and the result have their batch over batch_axes; k, v their
# batch over batch_axes and positions over axis_name. Paged: each device has its own
# page pools, so the pools' pages are sharded over (*batch_axes, axis_name), and the
# block table is laid out as a contiguous cache's positions are (batch over
# batch_axes, columns over axis_name): every device gets its shard_map arguments and
# nothing moves.

def _batch_spec(axis, batch):
    return jax.sharding.PartitionSpec(rows_over(None, batch))


def _positions_spec(axis, batch):
    return jax.sharding.PartitionSpec(rows_over(None, batch), axis)


def _pages_spec(axis, batch):
    return jax.sharding.PartitionSpec(rows_over(axis, batch))


def _check_paged_sharded(q, k, v, kv_len, block_table, *, axis_name, batch_axes, mesh,
                         config=None) -> None:
    """The global shapes of the paged form; the rest is checked per device, as
    ``flash_decode``'s."""
    del kv_len, config
    name = "jaxtdist.flash_decode_sharded"
    group = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    world, group_words = mesh_devices(mesh, group)
    batches, batch_words = mesh_devices(mesh, tuple(batch_axes))
    groups, groups_words = mesh_devices(mesh, tuple(batch_axes) + group)
    if getattr(q, "ndim", None) != 3:
        raise ValueError(f"{name}: expected q [B, Hq, D], got shape {getattr(q, 'shape', None)}")
    b = q.shape[0]
    if b % batches:
        raise ValueError(f"{name}: the batch B={b} is not a multiple of the {batches} devices "
                         f"of batch_axes ({batch_words}); q, kv_len and block_table have their "
                         "batch sharded over them")
    for label, pool in (("k", k), ("v", v)):
        if getattr(pool, "ndim", None) != 4 or pool.shape[0] % groups:
            raise ValueError(f"{name}: with block_table, {label} must be the page pools "
                             f"[G * num_pages, page, Hkv, D]: device g's pool is pages "
                             f"[g * num_pages, (g + 1) * num_pages), G = the {groups} devices "
                             f"of (*batch_axes, axis_name) ({groups_words}); got shape "
                             f"{getattr(pool, 'shape', None)}")
    if getattr(k, "shape", None) != getattr(v, "shape", None):
        raise ValueError(f"{name}: the page pools k{k.shape} and v{v.shape} must have the "
                         "same shape")
    if (getattr(block_table, "ndim", None) != 2 or block_table.shape[0] != b
            or block_table.shape[1] % world):
        raise ValueError(f"{name}: block_table must be [B, W * pages] with B = {b} and a "
                         f"multiple of the W = {world} ranks of axis_name ({group_words}) "
                         "columns (rank r's table: columns [r * pages, (r + 1) * pages), ids "
                         f"into its own pool), got shape {getattr(block_table, 'shape', None)}")


_decode_sharded = pjit_wrapper(
    flash_decode, name="flash_decode_sharded",
    in_specs=lambda axis, batch: (_batch_spec(axis, batch), _positions_spec(axis, batch),
                                  _positions_spec(axis, batch), _batch_spec(axis, batch)),
    out_specs=_batch_spec)
_paged_decode_sharded = pjit_wrapper(
    lambda q, k, v, kv_len, block_table, axis_name, **static: flash_decode(
        q, k, v, kv_len, axis_name, block_table=block_table, **static),
    name="flash_decode_sharded",
    in_specs=lambda axis, batch: (_batch_spec(axis, batch), _pages_spec(axis, batch),
                                  _pages_spec(axis, batch), _batch_spec(axis, batch),
                                  _positions_spec(axis, batch)),
    out_specs=_batch_spec, check=_check_paged_sharded)


def flash_decode_sharded(q: jax.Array, k: jax.Array, v: jax.Array, kv_len: jax.Array, *,
                         axis_name: str | tuple[str, ...],
                         batch_axes: str | tuple[str, ...] = (), mesh=None,
                         block_table: jax.Array | None = None,
                         config: dict | None = None) -> jax.Array:
    """``flash_decode`` for pjit-style code: no hand-written ``shard_map``.

    q [B, Hq, D] and kv_len [B] have their batch sharded over ``batch_axes`` (or
    are replicated); k and v [B, S, Hkv, D] their batch over ``batch_axes`` and
    their positions over ``axis_name`` (W ranks: rank r holds positions
    ``[r * S / W, (r + 1) * S / W)``). The result [B, Hq, D] is sharded like q.
    Mesh axes not named are replicated. Differentiable where ``flash_decode`` is
    (a group of one rank).

    Paged cache (``block_table`` given): every device has its own page pools,
    so k and v are the pools of the G devices of ``(*batch_axes, axis_name)``
    stacked, [G * num_pages, page, Hkv, D], their pages sharded over those
    devices (device g, numbered outermost axis first, holds pages ``[g *
    num_pages, (g + 1) * num_pages)``). ``block_table`` [B, W * pages] int32 is
    laid out as a contiguous cache's positions are: batch over ``batch_axes``,
    columns over ``axis_name``; rank r's columns ``[r * pages, (r + 1) *
    pages)`` are its ``flash_decode`` block table, whose ids index its own
    pool (``[0, num_pages)``, not the stacked array). So global position i of
    sequence b (held by rank r = i // (pages * page)) is row ``i % page`` of
    page ``block_table[b, i // page]`` of rank r's pool. Each device gets
    exactly its shard_map arguments: nothing moves. Ids are data; ids outside
    ``[0, num_pages)`` are clamped and pages past a sequence's length never
    read, as in ``flash_decode``.

    Args:
      q: [B, Hq, D] queries.
      k, v: [B, S, Hkv, D] the cache (S a multiple of W); with ``block_table``,
        the stacked page pools [G * num_pages, page, Hkv, D].
      kv_len: [B] integers, the global valid lengths.
      axis_name: the mesh axis the positions are sharded over, or a tuple of
        axes taken as one group, outermost first (keyword).
      batch_axes: mesh axes that shard the batch, outermost first.
      mesh: the mesh; defaults to the one given to ``jaxtdist.initialize``.
      block_table: [B, W * pages] int32 (optional): a paged cache, laid out as
        above.
      config: as for ``flash_decode``.

    Returns:
      [B, Hq, D] in q's dtype, sharded like q.

    Raises:
      ValueError: an axis not of the mesh or named twice; paged: B not a
        multiple of the batch devices, pools' pages not a multiple of G,
        block_table not [B, W * pages]; or what ``flash_decode`` refuses.

    Example:
      >>> mesh = jax.make_mesh((2, 4), ("dp", "sp")); jaxtdist.initialize(mesh)
      >>> out = jax.jit(lambda q, k, v, n: jaxtdist.flash_decode_sharded(
      ...     q, k, v, n, axis_name="sp", batch_axes="dp"))(q, k, v, n)
      >>> # paged: pools P(("dp", "sp")) [8 * num_pages, page, Hkv, D], table P("dp", "sp")
      >>> out = jax.jit(lambda q, kp, vp, n, t: jaxtdist.flash_decode_sharded(
      ...     q, kp, vp, n, axis_name="sp", batch_axes="dp", block_table=t))(q, kp, vp, n, t)
    """
    common = dict(axis_name=axis_name, batch_axes=batch_axes, mesh=mesh, config=config)
    if block_table is None:
        return _decode_sharded(q, k, v, kv_len, **common)
    return _paged_decode_sharded(q, k, v, kv_len, block_table, **common)
